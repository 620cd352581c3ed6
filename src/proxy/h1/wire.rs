//! HTTP/1.1 on the wire, for the upstream side of `http://` upstreams:
//! a request head written, a response head read, and a response body's
//! framing decoded (RFC 9112). Pure: bytes in, values out, no I/O.
//!
//! Why not hyper's client here: its chunked decoder reads a chunk-size
//! line a byte at a time, each byte a `BytesMut::split_to` and a `freeze`
//! (about 1,160 instructions for an SSE event's eight-byte framing), and
//! its dispatcher and body channel about as much again
//! (BENCHMARKS.md, "Eighteenth round"). [`Chunked`] finds a size line
//! with `memchr` and hands each chunk's data on as one slice of the read
//! buffer.
//!
//! It does not tunnel (`101`, `CONNECT`), nor decode content codings: the
//! proxy asks for `identity`. Read [`parse_head`] first.

use bytes::{Buf, Bytes, BytesMut};
use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::{Method, StatusCode, Version};

/// The most header fields a response head (or a trailer section) may have
/// (hyper's default too).
pub const MAX_HEADERS: usize = 100;

/// The longest chunk-size line, extensions included.
const MAX_SIZE_LINE: usize = 4096;

/// The largest trailer section.
const MAX_TRAILER_BYTES: usize = 16 * 1024;

/// What is wrong with what the upstream sent.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum WireError {
    #[error("invalid response head: {0}")]
    Head(String),
    #[error("response head larger than {0} bytes")]
    HeadTooLarge(usize),
    #[error("invalid chunk size line at byte {at} of the body: {line:?}")]
    ChunkSize { at: u64, line: String },
    #[error("chunk data not followed by CRLF at byte {at} of the body")]
    ChunkEnd { at: u64 },
    #[error("invalid trailer section at byte {at} of the body: {reason}")]
    Trailers { at: u64, reason: String },
}

/// How a response body is delimited (RFC 9112 §6.3).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Framing {
    /// No body: a response to `HEAD`, a `204`, a `304`, `content-length: 0`.
    Empty,
    /// `content-length` bytes.
    Length(u64),
    /// `transfer-encoding: chunked`.
    Chunked,
    /// Everything until the upstream closes the connection.
    Close,
}

/// A response head as the upstream sent it.
#[derive(Debug)]
pub struct Head {
    pub status: StatusCode,
    pub version: Version,
    pub headers: HeaderMap,
    pub framing: Framing,
    /// The connection may carry another request after this response.
    pub keep_alive: bool,
}

/// Parses a response head at the start of `buf`: `Ok(None)` while it is
/// incomplete, else the head and its length in bytes. Interim (`1xx`)
/// responses are returned like any other; the caller skips them.
pub fn parse_head(buf: &[u8], method: &Method) -> Result<Option<(usize, Head)>, WireError> {
    let mut fields = [httparse::EMPTY_HEADER; MAX_HEADERS];
    let mut response = httparse::Response::new(&mut fields);
    let len = match response.parse(buf) {
        Ok(httparse::Status::Complete(len)) => len,
        Ok(httparse::Status::Partial) => return Ok(None),
        Err(err) => return Err(WireError::Head(err.to_string())),
    };
    let version = match response.version {
        Some(0) => Version::HTTP_10,
        _ => Version::HTTP_11,
    };
    let status = response
        .code
        .and_then(|code| StatusCode::from_u16(code).ok())
        .ok_or_else(|| WireError::Head("no status code".to_owned()))?;
    // The values are slices of one copy of the head: two allocations for
    // all of them (the copy, and the count that shares it), not one each.
    let head = Bytes::copy_from_slice(buf.get(..len).unwrap_or_default());
    // Room for the three a stream's head gets besides (`Cache-Control`,
    // `X-Accel-Buffering`, `X-Aalis-Session`): the map grew (rehashed) for
    // them when the upstream sent few headers.
    let mut headers = HeaderMap::with_capacity(response.headers.len() + 3);
    for field in response.headers.iter() {
        let name = HeaderName::from_bytes(field.name.as_bytes())
            .map_err(|_| WireError::Head(format!("invalid header name {:?}", field.name)))?;
        let value = HeaderValue::from_maybe_shared(shared_slice(&head, buf, field.value))
            .map_err(|_| WireError::Head(format!("invalid value of header {:?}", field.name)))?;
        headers.append(name, value);
    }
    let (framing, mut keep_alive) = framing(&headers, status, method)?;
    keep_alive &= match version {
        Version::HTTP_10 => has_token(&headers, header::CONNECTION, "keep-alive"),
        _ => !has_token(&headers, header::CONNECTION, "close"),
    };
    Ok(Some((
        len,
        Head {
            status,
            version,
            headers,
            framing,
            keep_alive,
        },
    )))
}

/// `part`, a slice of `buf`, as the same bytes of `head`, a copy of
/// `buf`'s start (a copy of its own if it lies beyond).
fn shared_slice(head: &Bytes, buf: &[u8], part: &[u8]) -> Bytes {
    let start = (part.as_ptr() as usize).wrapping_sub(buf.as_ptr() as usize);
    match start.checked_add(part.len()) {
        Some(end) if end <= head.len() => head.slice(start..end),
        _ => Bytes::copy_from_slice(part),
    }
}

/// Whether `bytes` hold the blank line that ends a head (CRLF CRLF, or a
/// bare LF's LF LF, which httparse also takes): until then a head cannot
/// be complete.
pub fn has_blank_line(bytes: &[u8]) -> bool {
    memchr::memmem::find(bytes, b"\n\r\n").is_some()
        || memchr::memmem::find(bytes, b"\n\n").is_some()
}

/// The body's framing, and whether it lets the connection be reused.
fn framing(
    headers: &HeaderMap,
    status: StatusCode,
    method: &Method,
) -> Result<(Framing, bool), WireError> {
    if method == Method::HEAD
        || status.is_informational()
        || status == StatusCode::NO_CONTENT
        || status == StatusCode::NOT_MODIFIED
    {
        return Ok((Framing::Empty, true));
    }
    if method == Method::CONNECT && status.is_success() {
        // A tunnel: what follows is not HTTP.
        return Ok((Framing::Empty, false));
    }
    if headers.contains_key(header::TRANSFER_ENCODING) {
        // Both headers: transfer-encoding wins, and the connection is not
        // trusted with another message (RFC 9112 §6.3 item 3).
        let reusable = !headers.contains_key(header::CONTENT_LENGTH);
        return Ok(if last_coding_is_chunked(headers) {
            (Framing::Chunked, reusable)
        } else {
            (Framing::Close, false)
        });
    }
    let mut length: Option<u64> = None;
    for value in headers.get_all(header::CONTENT_LENGTH) {
        for part in value.as_bytes().split(|&b| b == b',') {
            let part = part.trim_ascii();
            let parsed = (!part.is_empty() && part.iter().all(u8::is_ascii_digit))
                .then(|| std::str::from_utf8(part).ok()?.parse::<u64>().ok())
                .flatten()
                .ok_or_else(|| WireError::Head("invalid content-length".to_owned()))?;
            if length.is_some_and(|seen| seen != parsed) {
                return Err(WireError::Head("conflicting content-length".to_owned()));
            }
            length = Some(parsed);
        }
    }
    Ok(match length {
        Some(0) => (Framing::Empty, true),
        Some(n) => (Framing::Length(n), true),
        None => (Framing::Close, false),
    })
}

fn last_coding_is_chunked(headers: &HeaderMap) -> bool {
    let last = headers
        .get_all(header::TRANSFER_ENCODING)
        .iter()
        .next_back();
    last.and_then(|value| value.as_bytes().rsplit(|&b| b == b',').next())
        .is_some_and(|coding| coding.trim_ascii().eq_ignore_ascii_case(b"chunked"))
}

fn has_token(headers: &HeaderMap, name: HeaderName, token: &str) -> bool {
    headers.get_all(name).iter().any(|value| {
        value
            .as_bytes()
            .split(|&b| b == b',')
            .any(|t| t.trim_ascii().eq_ignore_ascii_case(token.as_bytes()))
    })
}

/// How a request body is delimited on the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RequestFraming {
    /// No body.
    Empty,
    /// `content-length` bytes.
    Length(u64),
    /// `transfer-encoding: chunked`.
    Chunked,
}

/// Appends the request head to `out`: the request line (origin form),
/// `headers` as they are (names lower case, as `http` keeps them), then
/// the framing header `framing` needs if `headers` lack it.
pub fn write_head(
    method: &Method,
    target: &str,
    headers: &HeaderMap,
    framing: RequestFraming,
    out: &mut Vec<u8>,
) {
    out.extend_from_slice(method.as_str().as_bytes());
    out.push(b' ');
    out.extend_from_slice(target.as_bytes());
    out.extend_from_slice(b" HTTP/1.1\r\n");
    for (name, value) in headers {
        out.extend_from_slice(name.as_str().as_bytes());
        out.extend_from_slice(b": ");
        out.extend_from_slice(value.as_bytes());
        out.extend_from_slice(b"\r\n");
    }
    match framing {
        RequestFraming::Length(n) if !headers.contains_key(header::CONTENT_LENGTH) => {
            out.extend_from_slice(b"content-length: ");
            out.extend_from_slice(itoa::Buffer::new().format(n).as_bytes());
            out.extend_from_slice(b"\r\n");
        }
        RequestFraming::Chunked => out.extend_from_slice(b"transfer-encoding: chunked\r\n"),
        RequestFraming::Length(_) | RequestFraming::Empty => {}
    }
    out.extend_from_slice(b"\r\n");
}

/// Fields a request's trailer section may not carry on to the upstream
/// (RFC 9110 §6.5.1): those that frame the message, route it,
/// authenticate it or modify the request (controls and conditionals), and
/// the hop-by-hop ones. An upstream that merged trailers into the header
/// section would take them for the request's own.
static NOT_IN_TRAILERS: [HeaderName; 25] = [
    header::AUTHORIZATION,
    header::CACHE_CONTROL,
    header::CONNECTION,
    header::CONTENT_ENCODING,
    header::CONTENT_LENGTH,
    header::CONTENT_RANGE,
    header::CONTENT_TYPE,
    header::COOKIE,
    header::EXPECT,
    header::HOST,
    header::IF_MATCH,
    header::IF_MODIFIED_SINCE,
    header::IF_NONE_MATCH,
    header::IF_RANGE,
    header::IF_UNMODIFIED_SINCE,
    HeaderName::from_static("keep-alive"),
    header::MAX_FORWARDS,
    header::PRAGMA,
    header::RANGE,
    header::SET_COOKIE,
    header::TE,
    header::TRAILER,
    header::TRANSFER_ENCODING,
    header::UPGRADE,
    header::WWW_AUTHENTICATE,
];

/// Whether a request trailer field may go on to the upstream: not one of
/// `NOT_IN_TRAILERS`, nor a `proxy-` field (`Proxy-Authorization`,
/// `Proxy-Connection`, …).
pub fn allowed_in_trailers(name: &HeaderName) -> bool {
    !name.as_str().starts_with("proxy-") && !NOT_IN_TRAILERS.contains(name)
}

/// Appends the size line of a chunk of `len` bytes (`len` > 0): its
/// length in lower-case hexadecimal and a CRLF, written digit by digit (no
/// formatting machinery, no allocation).
pub fn write_chunk_size(len: usize, out: &mut Vec<u8>) {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    let digits = (usize::BITS - len.leading_zeros()).div_ceil(4).max(1);
    for digit in (0..digits).rev() {
        out.push(HEX[(len >> (4 * digit)) & 0xf]);
    }
    out.extend_from_slice(b"\r\n");
}

/// What a body decoder found next in the read buffer.
#[derive(Debug, PartialEq)]
pub enum Piece {
    Data(Bytes),
    Trailers(HeaderMap),
    /// The body is complete.
    End,
}

/// Where a chunked body's decoder is (RFC 9112 §7.1).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ChunkState {
    /// At a chunk-size line.
    Size,
    /// Inside a chunk's data, this many bytes from its end.
    Data(u64),
    /// At the CRLF after a chunk's data.
    DataEnd,
    /// After the last chunk: at the trailer section.
    Trailers,
    Done,
}

/// The decoder of a chunked body. Each call of [`decode`](Self::decode)
/// takes what it can from the front of the read buffer and gives one
/// [`Piece`], or `None` when it needs more bytes.
#[derive(Debug)]
pub struct Chunked {
    state: ChunkState,
    /// Bytes of the body (framing included) taken so far: where an error is.
    at: u64,
}

impl Default for Chunked {
    fn default() -> Chunked {
        Chunked::new()
    }
}

impl Chunked {
    pub fn new() -> Chunked {
        Chunked {
            state: ChunkState::Size,
            at: 0,
        }
    }

    /// The next piece from the front of `buf`, or `Ok(None)` when `buf`
    /// holds too little for one.
    pub fn decode(&mut self, buf: &mut BytesMut) -> Result<Option<Piece>, WireError> {
        loop {
            match self.state {
                ChunkState::Size => {
                    let Some(lf) = memchr::memchr(b'\n', buf) else {
                        if buf.len() > MAX_SIZE_LINE {
                            return Err(self.size_error(&buf[..64]));
                        }
                        return Ok(None);
                    };
                    // The limit holds however the line arrived: in pieces it
                    // would have failed above.
                    if lf > MAX_SIZE_LINE {
                        return Err(self.size_error(&buf[..64]));
                    }
                    let size = chunk_size(&buf[..lf]).ok_or_else(|| self.size_error(&buf[..lf]))?;
                    self.take(buf, lf + 1);
                    self.state = match size {
                        0 => ChunkState::Trailers,
                        n => ChunkState::Data(n),
                    };
                }
                ChunkState::Data(left) => {
                    if buf.is_empty() {
                        return Ok(None);
                    }
                    let n = usize::try_from(left).map_or(buf.len(), |left| left.min(buf.len()));
                    let data = buf.split_to(n).freeze();
                    self.at += n as u64;
                    let left = left - n as u64;
                    self.state = if left == 0 {
                        ChunkState::DataEnd
                    } else {
                        ChunkState::Data(left)
                    };
                    // The CRLF that ends it, when already here: the body's
                    // end is then known without another call.
                    if left == 0 && buf.starts_with(b"\r\n") {
                        self.take(buf, 2);
                        self.state = ChunkState::Size;
                    }
                    return Ok(Some(Piece::Data(data)));
                }
                ChunkState::DataEnd => {
                    if buf.len() < 2 {
                        if buf.first().is_some_and(|&b| b != b'\r') {
                            return Err(WireError::ChunkEnd { at: self.at });
                        }
                        return Ok(None);
                    }
                    if &buf[..2] != b"\r\n" {
                        return Err(WireError::ChunkEnd { at: self.at });
                    }
                    self.take(buf, 2);
                    self.state = ChunkState::Size;
                }
                ChunkState::Trailers => {
                    // No trailers: the blank line (a bare LF is a line end
                    // too, RFC 9112 §2.2).
                    let blank = if buf.starts_with(b"\r\n") {
                        2
                    } else if buf.starts_with(b"\n") {
                        1
                    } else {
                        0
                    };
                    if blank > 0 {
                        self.take(buf, blank);
                        self.state = ChunkState::Done;
                        return Ok(Some(Piece::End));
                    }
                    if buf.len() < 2 {
                        return Ok(None);
                    }
                    let mut fields = [httparse::EMPTY_HEADER; MAX_HEADERS];
                    // Only the first MAX_TRAILER_BYTES are read: the same
                    // verdict however the section arrived.
                    let window = &buf[..buf.len().min(MAX_TRAILER_BYTES)];
                    let (len, trailers) = match httparse::parse_headers(window, &mut fields) {
                        Ok(httparse::Status::Complete((len, fields))) => {
                            let mut trailers = HeaderMap::with_capacity(fields.len());
                            for field in fields.iter() {
                                let name = HeaderName::from_bytes(field.name.as_bytes());
                                let value = HeaderValue::from_bytes(field.value);
                                match (name, value) {
                                    (Ok(name), Ok(value)) => {
                                        trailers.append(name, value);
                                    }
                                    _ => {
                                        return Err(self.trailer_error(format!(
                                            "invalid field {:?}",
                                            field.name
                                        )));
                                    }
                                }
                            }
                            (len, trailers)
                        }
                        Ok(httparse::Status::Partial) => {
                            if buf.len() >= MAX_TRAILER_BYTES {
                                return Err(self.trailer_error(format!(
                                    "larger than {MAX_TRAILER_BYTES} bytes"
                                )));
                            }
                            return Ok(None);
                        }
                        Err(err) => return Err(self.trailer_error(err.to_string())),
                    };
                    self.take(buf, len);
                    self.state = ChunkState::Done;
                    return Ok(Some(Piece::Trailers(trailers)));
                }
                ChunkState::Done => return Ok(Some(Piece::End)),
            }
        }
    }

    /// Whether the whole body (its last chunk and trailers) was decoded.
    pub fn is_done(&self) -> bool {
        self.state == ChunkState::Done
    }

    fn take(&mut self, buf: &mut BytesMut, n: usize) {
        buf.advance(n);
        self.at += n as u64;
    }

    fn size_error(&self, line: &[u8]) -> WireError {
        WireError::ChunkSize {
            at: self.at,
            line: String::from_utf8_lossy(&line[..line.len().min(64)]).into_owned(),
        }
    }

    fn trailer_error(&self, reason: String) -> WireError {
        WireError::Trailers {
            at: self.at,
            reason,
        }
    }
}

/// The size of a chunk-size line (without its LF): hex digits, optional
/// spaces or tabs, optional extensions (ignored, but holding no CR or
/// NUL), and the CR.
fn chunk_size(line: &[u8]) -> Option<u64> {
    let line = line.strip_suffix(b"\r")?;
    let digits = line
        .iter()
        .position(|b| !b.is_ascii_hexdigit())
        .unwrap_or(line.len());
    let mut rest = &line[digits..];
    while let [b' ' | b'\t', tail @ ..] = rest {
        rest = tail;
    }
    let extensions_ok = match rest {
        [] => true,
        [b';', ext @ ..] => !ext.iter().any(|&b| b == b'\r' || b == 0),
        _ => false,
    };
    if digits == 0 || !extensions_ok {
        return None;
    }
    // Leading zeros are no part of the value; more than 16 digits after
    // them do not fit in 64 bits. (Folded here: a `str` and
    // `from_str_radix` cost about a hundred instructions more per chunk,
    // and an upstream sends a chunk per event.)
    let significant = line[..digits].iter().skip_while(|&&b| b == b'0');
    let mut value = 0u64;
    for (n, &b) in significant.enumerate() {
        if n == 16 {
            return None;
        }
        let digit = match b {
            b'0'..=b'9' => b - b'0',
            b'a'..=b'f' => b - b'a' + 10,
            _ => b - b'A' + 10,
        };
        value = value << 4 | u64::from(digit);
    }
    Some(value)
}

#[cfg(test)]
mod tests;
