use super::*;

/// Every piece `decode` gives for `input` fed in slices of `step` bytes,
/// with `End` last; an error stops it.
fn pieces(input: &[u8], step: usize) -> Result<Vec<Piece>, WireError> {
    let mut chunked = Chunked::new();
    let mut buf = BytesMut::new();
    let mut out = Vec::new();
    let mut fed = 0;
    loop {
        match chunked.decode(&mut buf)? {
            Some(Piece::End) => {
                out.push(Piece::End);
                return Ok(out);
            }
            Some(piece) => out.push(piece),
            None if fed < input.len() => {
                let end = (fed + step).min(input.len());
                buf.extend_from_slice(&input[fed..end]);
                fed = end;
            }
            None => return Ok(out),
        }
    }
}

/// The data of `pieces`, joined, and whether it ended.
fn joined(pieces: &[Piece]) -> (Vec<u8>, bool) {
    let mut data = Vec::new();
    let mut ended = false;
    for piece in pieces {
        match piece {
            Piece::Data(bytes) => data.extend_from_slice(bytes),
            Piece::Trailers(_) => {}
            Piece::End => ended = true,
        }
    }
    (data, ended)
}

const SSE_BODY: &[u8] = b"13\r\ndata: {\"a\":\"\xe4\xbd\xa0\"}\n\n\r\n\
    c\r\ndata: [DONE]\r\n0\r\n\r\n";

#[test]
fn a_chunked_body_decodes_the_same_however_it_arrives() {
    let whole = pieces(SSE_BODY, SSE_BODY.len()).expect("valid");
    let (data, ended) = joined(&whole);
    assert_eq!(data, b"data: {\"a\":\"\xe4\xbd\xa0\"}\n\ndata: [DONE]");
    assert!(ended);
    assert_eq!(
        whole.len(),
        3,
        "one piece per chunk when whole, then the end"
    );
    for step in 1..SSE_BODY.len() {
        let (split, ended) = joined(&pieces(SSE_BODY, step).expect("valid"));
        assert_eq!(split, data, "fed {step} bytes at a time");
        assert!(ended, "fed {step} bytes at a time");
    }
}

#[test]
fn a_chunk_is_handed_on_as_it_arrives_not_when_it_is_complete() {
    let mut chunked = Chunked::new();
    let mut buf = BytesMut::from(&b"a\r\n01234"[..]);
    assert_eq!(
        chunked.decode(&mut buf),
        Ok(Some(Piece::Data(Bytes::from_static(b"01234"))))
    );
    assert_eq!(chunked.decode(&mut buf), Ok(None));
    buf.extend_from_slice(b"56789\r\n");
    assert_eq!(
        chunked.decode(&mut buf),
        Ok(Some(Piece::Data(Bytes::from_static(b"56789"))))
    );
    assert!(buf.is_empty(), "the CRLF after the data is taken with it");
    assert_eq!(chunked.decode(&mut buf), Ok(None));
}

#[test]
fn extensions_whitespace_and_upper_case_sizes_are_read() {
    let body = b"A ;name=value\r\n0123456789\r\n1;x\r\n!\r\n0\r\n\r\n";
    let (data, ended) = joined(&pieces(body, body.len()).expect("valid"));
    assert_eq!(data, b"0123456789!");
    assert!(ended);
}

#[test]
fn trailers_come_as_their_own_piece_before_the_end() {
    let body = b"3\r\nabc\r\n0\r\nx-usage: 12\r\nx-done: yes\r\n\r\n";
    for step in [1, 2, 5, body.len()] {
        let got = pieces(body, step).expect("valid");
        let trailers = got
            .iter()
            .find_map(|piece| match piece {
                Piece::Trailers(map) => Some(map.clone()),
                Piece::Data(_) | Piece::End => None,
            })
            .expect("trailers");
        assert_eq!(
            trailers.get("x-usage").map(HeaderValue::as_bytes),
            Some(&b"12"[..])
        );
        assert_eq!(
            trailers.get("x-done").map(HeaderValue::as_bytes),
            Some(&b"yes"[..])
        );
        assert_eq!(got.last(), Some(&Piece::End), "fed {step} at a time");
    }
}

#[test]
fn a_bad_size_line_is_an_error_that_says_where() {
    let err = pieces(b"3\r\nabc\r\nzz\r\n", 64).expect_err("not hex");
    assert_eq!(
        err,
        WireError::ChunkSize {
            at: 8,
            line: "zz\r".to_owned()
        }
    );
    assert!(err.to_string().contains("at byte 8 of the body"), "{err}");
    for bad in [
        &b"\r\n"[..],             // no digits
        b"3\n",                   // LF without CR
        b"3x\r\n",                // junk after the digits
        b"11111111111111111\r\n", // more than 64 bits
        b"3\r\r\n",               // a CR that ends no line
        b"3\x0c\r\n",             // a form feed is no whitespace here
        b"3;\x01\r\r\n",          // a CR inside an extension
    ] {
        assert!(
            matches!(pieces(bad, 64), Err(WireError::ChunkSize { at: 0, .. })),
            "{:?}",
            String::from_utf8_lossy(bad)
        );
    }
    let endless = vec![b'1'; MAX_SIZE_LINE + 1];
    assert!(matches!(
        pieces(&endless, 512),
        Err(WireError::ChunkSize { .. })
    ));
}

/// A size line's digits read as `u64::from_str_radix` reads them, with
/// any number of leading zeros, and no more than 16 digits after them.
#[test]
fn a_size_is_its_hex_digits_at_every_width_and_case() {
    let mut digits = vec![
        "0".to_owned(),
        "00000000000000000000".to_owned(),
        "ffffffffffffffff".to_owned(),
        "FFFFFFFFFFFFFFFF".to_owned(),
        "0000ffffffffffffffff".to_owned(),
        "10000000000000000".to_owned(),
        "aBcDeF0123456789".to_owned(),
    ];
    for width in 1..=17 {
        for fill in ['1', '9', 'a', 'f', 'A', 'F'] {
            digits.push(fill.to_string().repeat(width));
            digits.push(format!("00{}", fill.to_string().repeat(width)));
        }
    }
    for text in &digits {
        let significant = text.trim_start_matches('0');
        let want = if significant.len() > 16 {
            None
        } else {
            u64::from_str_radix(
                if significant.is_empty() {
                    "0"
                } else {
                    significant
                },
                16,
            )
            .ok()
        };
        for line in [format!("{text}\r"), format!("{text} ;x=1\r")] {
            assert_eq!(chunk_size(line.as_bytes()), want, "{line:?}");
        }
    }
}

#[test]
fn data_not_followed_by_crlf_is_an_error_that_says_where() {
    assert_eq!(
        pieces(b"3\r\nabcX\r\n", 64).map(|p| joined(&p)),
        Err(WireError::ChunkEnd { at: 6 })
    );
    assert_eq!(
        pieces(b"3\r\nabc\rX", 1).map(|p| joined(&p)),
        Err(WireError::ChunkEnd { at: 6 })
    );
}

#[test]
fn a_body_cut_short_is_not_an_end() {
    for cut in 1..SSE_BODY.len() {
        let (_, ended) = joined(&pieces(&SSE_BODY[..cut], 7).expect("valid so far"));
        assert!(!ended, "cut at {cut}");
    }
}

fn head(text: &str, method: &Method) -> Result<Option<(usize, Head)>, WireError> {
    parse_head(text.as_bytes(), method)
}

fn framing_of(text: &str) -> (Framing, bool) {
    let (_, head) = head(text, &Method::POST).expect("valid").expect("complete");
    (head.framing, head.keep_alive)
}

#[test]
fn a_response_head_is_parsed_with_its_length_and_headers_as_sent() {
    let text = "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n\
        Transfer-Encoding: chunked\r\nX-Two: a\r\nx-two: b\r\n\r\n17\r\n";
    let (len, head) = head(text, &Method::POST).expect("valid").expect("complete");
    assert_eq!(len, text.len() - 4, "up to the blank line, not the body");
    assert_eq!(head.status, StatusCode::OK);
    assert_eq!(head.version, Version::HTTP_11);
    assert_eq!(head.framing, Framing::Chunked);
    assert!(head.keep_alive);
    assert_eq!(
        head.headers
            .get(header::CONTENT_TYPE)
            .map(HeaderValue::as_bytes),
        Some(&b"text/event-stream"[..])
    );
    let twos: Vec<_> = head.headers.get_all("x-two").iter().collect();
    assert_eq!(twos, ["a", "b"], "repeated fields kept, in order");
    for cut in 0..len {
        assert!(
            parse_head(&text.as_bytes()[..cut], &Method::POST)
                .expect("valid so far")
                .is_none(),
            "incomplete at {cut}"
        );
    }
}

#[test]
fn a_heads_values_share_one_copy_of_it() {
    let text = "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n\
        Empty:\r\nX-Request-Id: req-1\r\nCache-Control: no-cache\r\n\r\n";
    let (_, head) = head(text, &Method::POST).expect("valid").expect("complete");
    let at = |name: &str| {
        let value = head.headers.get(name).expect("present").as_bytes();
        (value, value.as_ptr() as usize)
    };
    let (kind, kind_at) = at("content-type");
    let (id, id_at) = at("x-request-id");
    let (cache, cache_at) = at("cache-control");
    assert_eq!(
        (kind, id, cache),
        (&b"text/event-stream"[..], &b"req-1"[..], &b"no-cache"[..])
    );
    assert_eq!(at("empty").0, b"");
    // Where the values lie from each other is where they lay in the head:
    // they are slices of one buffer, not a copy each.
    let offset = |part: &str| text.find(part).expect("in the head");
    assert_eq!(
        id_at - kind_at,
        offset("req-1") - offset("text/event-stream")
    );
    assert_eq!(
        cache_at - kind_at,
        offset("no-cache") - offset("text/event-stream")
    );
}

#[test]
fn the_body_framing_follows_rfc_9112() {
    use Framing::{Chunked, Close, Empty, Length};
    let ok = "HTTP/1.1 200 OK\r\n";
    assert_eq!(
        framing_of(&format!("{ok}content-length: 12\r\n\r\n")),
        (Length(12), true)
    );
    assert_eq!(
        framing_of(&format!("{ok}content-length: 0\r\n\r\n")),
        (Empty, true)
    );
    assert_eq!(
        framing_of(&format!(
            "{ok}content-length: 5, 5\r\ncontent-length: 5\r\n\r\n"
        )),
        (Length(5), true),
        "repeated equal lengths are one length"
    );
    assert_eq!(
        framing_of(&format!("{ok}\r\n")),
        (Close, false),
        "no length: until closed"
    );
    assert_eq!(
        framing_of(&format!("{ok}transfer-encoding: gzip, chunked\r\n\r\n")),
        (Chunked, true)
    );
    assert_eq!(
        framing_of(&format!(
            "{ok}transfer-encoding: chunked\r\ncontent-length: 3\r\n\r\n"
        )),
        (Chunked, false),
        "both: chunked wins and the connection is not reused"
    );
    assert_eq!(
        framing_of(&format!("{ok}transfer-encoding: gzip\r\n\r\n")),
        (Close, false)
    );
    assert_eq!(
        framing_of(&format!(
            "{ok}connection: keep-alive, close\r\ncontent-length: 1\r\n\r\n"
        )),
        (Length(1), false)
    );
    assert_eq!(framing_of("HTTP/1.1 204 No Content\r\n\r\n"), (Empty, true));
    assert_eq!(
        framing_of("HTTP/1.1 304 Not Modified\r\ncontent-length: 9\r\n\r\n"),
        (Empty, true)
    );
    assert_eq!(
        framing_of("HTTP/1.0 200 OK\r\ncontent-length: 1\r\n\r\n"),
        (Length(1), false)
    );
    assert_eq!(
        framing_of("HTTP/1.0 200 OK\r\nconnection: Keep-Alive\r\ncontent-length: 1\r\n\r\n"),
        (Length(1), true)
    );
    let (_, to_head) = head(&format!("{ok}content-length: 12\r\n\r\n"), &Method::HEAD)
        .expect("valid")
        .expect("complete");
    assert_eq!(to_head.framing, Empty, "a response to HEAD has no body");
}

#[test]
fn bad_response_heads_are_errors() {
    for bad in [
        "HTTP/1.1 200 OK\r\ncontent-length: 1\r\ncontent-length: 2\r\n\r\n",
        "HTTP/1.1 200 OK\r\ncontent-length: -1\r\n\r\n",
        "HTTP/1.1 200 OK\r\ncontent-length: 0x10\r\n\r\n",
        "HTTP/1.1 2000 OK\r\n\r\n",
        "SSH-2.0-OpenSSH\r\n\r\n",
        "HTTP/1.1 200 OK\r\nbad header\r\n\r\n",
    ] {
        assert!(
            matches!(head(bad, &Method::GET), Err(WireError::Head(_))),
            "{bad:?}"
        );
    }
}

#[test]
fn a_request_head_is_written_with_the_framing_it_needs() {
    let head = |target: &str, headers: &HeaderMap, framing: RequestFraming| {
        let mut out = Vec::new();
        write_head(&Method::POST, target, headers, framing, &mut out);
        String::from_utf8(out).expect("ascii")
    };
    let mut headers = HeaderMap::new();
    headers.insert(header::HOST, HeaderValue::from_static("up:8080"));
    headers.append("x-many", HeaderValue::from_static("1"));
    headers.append("x-many", HeaderValue::from_static("2"));
    assert_eq!(
        head(
            "/v1/chat/completions?x=1",
            &headers,
            RequestFraming::Chunked
        ),
        "POST /v1/chat/completions?x=1 HTTP/1.1\r\nhost: up:8080\r\nx-many: 1\r\nx-many: 2\r\n\
         transfer-encoding: chunked\r\n\r\n"
    );
    assert!(
        head("/", &headers, RequestFraming::Length(42))
            .ends_with("x-many: 2\r\ncontent-length: 42\r\n\r\n")
    );
    headers.insert(header::CONTENT_LENGTH, HeaderValue::from_static("42"));
    let text = head("/", &headers, RequestFraming::Length(42));
    assert_eq!(text.matches("content-length").count(), 1, "{text}");
    let mut out = Vec::new();
    write_chunk_size(0x1a2b, &mut out);
    assert_eq!(out, b"1a2b\r\n");
}

/// The size line is what `format!("{len:x}")` gives, at every number of
/// digits, appended after what the buffer held.
#[test]
fn a_chunk_size_line_is_lower_case_hex_at_every_width() {
    let mut lens: Vec<usize> = (0..=4096).collect();
    for bits in 0..usize::BITS {
        let power = 1usize << bits;
        lens.extend([
            power - 1,
            power,
            power | (power >> 1),
            power.wrapping_mul(0xb),
        ]);
    }
    lens.push(usize::MAX);
    for len in lens {
        let mut out = b"x".to_vec();
        write_chunk_size(len, &mut out);
        assert_eq!(out, format!("x{len:x}\r\n").as_bytes(), "{len}");
    }
}

#[test]
fn a_head_ends_only_at_its_blank_line() {
    assert!(has_blank_line(b"HTTP/1.1 200 OK\r\n\r\n"));
    assert!(has_blank_line(b"HTTP/1.1 200 OK\n\n"));
    assert!(has_blank_line(b"\n\r\n"));
    assert!(!has_blank_line(b"HTTP/1.1 200 OK\r\nx: y\r\n"));
    assert!(!has_blank_line(b"\r\n\r"));
    // What the caller relies on: no complete head without a blank line.
    let text = b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n";
    for cut in 0..text.len() {
        let complete = parse_head(&text[..cut], &Method::GET).expect("valid so far");
        assert_eq!(
            complete.is_some(),
            has_blank_line(&text[..cut]),
            "cut at {cut}"
        );
    }
}

#[test]
fn leading_zeros_and_a_bare_lf_after_the_last_chunk_are_read() {
    let (data, ended) =
        joined(&pieces(b"00000000000000003\r\nabc\r\n0\r\n\r\n", 64).expect("valid"));
    assert_eq!((&data[..], ended), (&b"abc"[..], true));
    // A body whose last line ends with a bare LF ends there, with nothing
    // more needed.
    let (data, ended) = joined(&pieces(b"3\r\nabc\r\n0\r\n\n", 64).expect("valid"));
    assert_eq!((&data[..], ended), (&b"abc"[..], true));
}

#[test]
fn a_trailer_section_over_the_limit_fails_the_same_however_it_arrives() {
    let mut body = b"0\r\n".to_vec();
    for i in 0..10 {
        body.extend_from_slice(format!("x-f{i}: {}\r\n", "v".repeat(1700)).as_bytes());
    }
    body.extend_from_slice(b"bad field\r\n\r\n");
    let whole = pieces(&body, body.len()).expect_err("too large");
    assert!(
        matches!(whole, WireError::Trailers { at: 3, .. }),
        "{whole}"
    );
    for step in [1000, 16_500] {
        assert_eq!(
            pieces(&body, step).expect_err("too large"),
            whole,
            "fed {step} at a time"
        );
    }
}

/// Fields a trailer section may not carry stop; others pass, whatever
/// their name looks like.
#[test]
fn only_fields_allowed_in_trailers_pass() {
    for stopped in [
        "content-length",
        "transfer-encoding",
        "host",
        "authorization",
        "te",
        "trailer",
        "connection",
        "keep-alive",
        "proxy-authorization",
        "proxy-connection",
        "upgrade",
        "cookie",
        "content-type",
        "content-encoding",
        "content-range",
        "expect",
        "max-forwards",
        "cache-control",
        "if-none-match",
        "range",
    ] {
        let name = HeaderName::from_static(stopped);
        assert!(!allowed_in_trailers(&name), "{stopped}");
    }
    for passed in [
        "x-checksum",
        "server-timing",
        "digest",
        "x-proxy-id",
        "etag",
    ] {
        let name = HeaderName::from_static(passed);
        assert!(allowed_in_trailers(&name), "{passed}");
    }
}
