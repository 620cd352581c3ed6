use super::*;
use crate::framing::window::OnePayload;

/// What a block says, owned, so a test can compare whole streams.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Seen {
    Event {
        raw: String,
        data: String,
        event_type: String,
        brace: Option<usize>,
        ending: LineEnding,
    },
    NoData(String),
    Unterminated(String, bool),
    /// A `LineEndTail` block and, for checking, whether the event before it
    /// had an open line ending.
    Tail(String),
    /// An event handed out with its line ending still open.
    OpenEvent(String),
}

fn feed(pieces: &[&[u8]]) -> Vec<Seen> {
    let mut decoder = SseDecoder::new();
    let mut seen = Vec::new();
    let drain = |decoder: &mut SseDecoder, seen: &mut Vec<Seen>| {
        while let Some(block) = decoder.next_block() {
            let raw = String::from_utf8_lossy(block.raw).into_owned();
            seen.push(match block.kind {
                SseBlockKind::Event(e) if e.line_ending_open => Seen::OpenEvent(raw),
                SseBlockKind::Event(e) => Seen::Event {
                    raw,
                    data: String::from_utf8_lossy(e.data).into_owned(),
                    event_type: String::from_utf8_lossy(e.event_type).into_owned(),
                    brace: e.closing_brace,
                    ending: e.line_ending,
                },
                SseBlockKind::NoData => Seen::NoData(raw),
                SseBlockKind::Unterminated { has_data, .. } => Seen::Unterminated(raw, has_data),
                SseBlockKind::LineEndTail => Seen::Tail(raw),
                SseBlockKind::Oversized { .. } => panic!("no test here is oversized: {raw:?}"),
                SseBlockKind::Passed { .. } => panic!("no probe here takes events: {raw:?}"),
            });
        }
    };
    for piece in pieces {
        decoder.push(piece);
        drain(&mut decoder, &mut seen);
    }
    decoder.finish();
    drain(&mut decoder, &mut seen);
    seen
}

fn event(raw: &str, data: &str, brace: Option<usize>, ending: LineEnding) -> Seen {
    Seen::Event {
        raw: raw.into(),
        data: data.into(),
        event_type: String::new(),
        brace,
        ending,
    }
}

fn bytewise(input: &[u8]) -> Vec<Seen> {
    let pieces: Vec<&[u8]> = input.chunks(1).collect();
    feed(&pieces)
}

#[test]
fn events_end_at_blank_lines_and_keep_their_raw_bytes() {
    let input = b"data: {\"a\":1}\n\ndata: [DONE]\n\n";
    let expected = vec![
        event("data: {\"a\":1}\n\n", "{\"a\":1}", Some(12), LineEnding::Lf),
        event("data: [DONE]\n\n", "[DONE]", None, LineEnding::Lf),
    ];
    assert_eq!(feed(&[input]), expected);
    assert_eq!(bytewise(input), expected);
}

#[test]
fn crlf_split_across_pieces_is_one_line_break() {
    let whole = vec![event("data: x\r\n\r\n", "x", None, LineEnding::CrLf)];
    assert_eq!(feed(&[b"data: x\r\n\r\n"]), whole);
    assert_eq!(feed(&[b"data: x\r", b"\n\r\n"]), whole);
    // The event goes out at its CR, not when the next byte comes; the LF
    // follows as the tail that closes its line ending.
    let split = vec![
        Seen::OpenEvent("data: x\r\n\r".into()),
        Seen::Tail("\n".into()),
    ];
    assert_eq!(feed(&[b"data: x\r", b"\n\r", b"\n"]), split);
    assert_eq!(feed(&[b"data: x\r\n\r", b"\n"]), split);
    assert_eq!(bytewise(b"data: x\r\n\r\n"), split);
}

#[test]
fn cr_alone_ends_lines() {
    // Whole: the first event's CR is followed by a byte, so it is closed;
    // the last one's is open until the end of input closes it.
    let whole = vec![
        event("data: a\r\r", "a", None, LineEnding::Cr),
        Seen::OpenEvent("data: b\r\r".into()),
        Seen::Tail(String::new()),
    ];
    assert_eq!(feed(&[b"data: a\r\rdata: b\r\r"]), whole);
    // Byte by byte, each event goes out at its second CR; the next byte (or
    // the end of input) closes its line ending with an empty tail.
    assert_eq!(
        bytewise(b"data: a\r\rdata: b\r\r"),
        vec![
            Seen::OpenEvent("data: a\r\r".into()),
            Seen::Tail(String::new()),
            Seen::OpenEvent("data: b\r\r".into()),
            Seen::Tail(String::new()),
        ]
    );
}

#[test]
fn bom_is_skipped_for_parsing_but_forwarded() {
    let input = b"\xEF\xBB\xBFdata: x\n\n";
    let expected = vec![event("\u{feff}data: x\n\n", "x", None, LineEnding::Lf)];
    assert_eq!(feed(&[input]), expected);
    assert_eq!(bytewise(input), expected);
    // A BOM anywhere else is data.
    let seen = feed(&[b"data: \xEF\xBB\xBFx\n\n"]);
    assert!(matches!(&seen[0], Seen::Event { data, .. } if data == "\u{feff}x"));
}

#[test]
fn comments_fields_and_multiline_data() {
    let input = b": keep-alive\n\nid: 7\nretry: 100\nevent: ping\ndata:{\"a\":\ndata: 1}  \n\n";
    let seen = feed(&[input]);
    assert_eq!(seen[0], Seen::NoData(": keep-alive\n\n".into()));
    let Seen::Event {
        data,
        event_type,
        brace,
        ..
    } = &seen[1]
    else {
        panic!("expected an event, got {seen:?}");
    };
    assert_eq!(data, "{\"a\":\n1}  ");
    assert_eq!(event_type, "ping");
    // The brace sits on the second data line, before the trailing spaces.
    assert_eq!(*brace, Some(input.len() - 14 - 5));
    assert_eq!(seen.len(), 2);
}

#[test]
fn a_line_without_colon_is_a_field_name_with_empty_value() {
    let seen = feed(&[b"data\n\n"]);
    assert_eq!(seen, vec![event("data\n\n", "", None, LineEnding::Lf)]);
}

#[test]
fn only_one_space_after_the_colon_is_removed() {
    let seen = feed(&[b"data:  x\n\n"]);
    assert_eq!(
        seen,
        vec![event("data:  x\n\n", " x", None, LineEnding::Lf)]
    );
}

#[test]
fn unterminated_last_event_is_forwarded_but_not_dispatched() {
    let seen = feed(&[b"data: a\n\ndata: [DONE]\n"]);
    assert_eq!(seen[1], Seen::Unterminated("data: [DONE]\n".into(), true));
    // A data line cut off by the end of input is data lost too.
    let seen = feed(&[b"data: a\n\ndata: {\"x\":1}"]);
    assert_eq!(seen[1], Seen::Unterminated("data: {\"x\":1}".into(), true));
    let seen = feed(&[b"data: a\n\n: bye"]);
    assert_eq!(seen[1], Seen::Unterminated(": bye".into(), false));
    assert_eq!(feed(&[b""]), vec![]);
}

#[test]
fn event_type_resets_after_each_block() {
    let seen = feed(&[b"event: a\n\ndata: x\n\n"]);
    assert_eq!(seen[1], event("data: x\n\n", "x", None, LineEnding::Lf));
}

#[test]
fn utf8_split_across_pieces_is_whole_in_data() {
    let input = "data: {\"x\":\"東😀\"}\n\n".as_bytes();
    let seen = bytewise(input);
    assert!(matches!(&seen[0], Seen::Event { data, .. } if data == "{\"x\":\"東😀\"}"));
}

#[test]
fn offsets_and_numbers_count_the_whole_stream() {
    let mut decoder = SseDecoder::new();
    decoder.push(b": c\n\ndata: 1\n\ndata: 2\n\n");
    let mut got = Vec::new();
    while let Some(block) = decoder.next_block() {
        let number = match block.kind {
            SseBlockKind::Event(e) => e.number,
            _ => 0,
        };
        got.push((block.offset, number));
    }
    assert_eq!(got, vec![(0, 0), (5, 1), (14, 2)]);
}

#[test]
fn oversized_events_go_out_in_pieces_and_parsing_resumes_after_them() {
    let input = b"data: small\n\ndata: 0123456789abcdef\ndata: more\r\n\r\ndata: next\n\n";
    for pieces in [
        vec![&input[..]],
        input.chunks(1).collect(),
        input.chunks(5).collect(),
    ] {
        let mut decoder = SseDecoder::with_max_event_bytes(16);
        let mut raw = Vec::new();
        let mut kinds = Vec::new();
        let drain = |d: &mut SseDecoder, raw: &mut Vec<u8>, kinds: &mut Vec<String>| {
            while let Some(block) = d.next_block() {
                raw.extend_from_slice(block.raw);
                kinds.push(match block.kind {
                    SseBlockKind::Event(e) => format!("event {}", String::from_utf8_lossy(e.data)),
                    SseBlockKind::Oversized {
                        number,
                        first,
                        last,
                    } => {
                        format!("oversized {number} {first} {last}")
                    }
                    other => format!("{other:?}"),
                });
            }
        };
        for piece in &pieces {
            decoder.push(piece);
            drain(&mut decoder, &mut raw, &mut kinds);
        }
        decoder.finish();
        drain(&mut decoder, &mut raw, &mut kinds);
        assert_eq!(raw, input, "every byte once, in order");
        assert_eq!(kinds.first().map(String::as_str), Some("event small"));
        assert_eq!(kinds.last().map(String::as_str), Some("event next"));
        let oversized: Vec<_> = kinds
            .iter()
            .filter(|k| k.starts_with("oversized"))
            .collect();
        assert!(
            oversized
                .first()
                .is_some_and(|k| k.starts_with("oversized 2 true")),
            "{kinds:?}"
        );
        assert!(
            oversized.last().is_some_and(|k| k.ends_with("true")),
            "{kinds:?}"
        );
    }
}

/// An event as handed out: raw, number, data, text, closing brace, line
/// ending, probed.
type Handed = (
    String,
    u64,
    String,
    Option<String>,
    Option<usize>,
    LineEnding,
    bool,
);

/// A probe that recognizes one payload, and the blocks it was handed.
struct Recognizes {
    probe: OnePayload,
    blocks: Vec<Handed>,
    other: Vec<String>,
    /// The runs it was handed: raw, events, offset.
    runs: Vec<(String, u64, u64)>,
}

impl Probe for Recognizes {
    fn payload_len(&mut self, text: &str) -> Option<usize> {
        self.probe.payload_len(text)
    }

    fn pass(&mut self, text: &str) -> bool {
        self.probe.pass(text)
    }
}

impl Frames<SseScan> for Recognizes {
    fn frame(&mut self, block: SseBlock<'_>) {
        let raw = String::from_utf8_lossy(block.raw).into_owned();
        match block.kind {
            SseBlockKind::Event(e) => self.blocks.push((
                raw,
                e.number,
                String::from_utf8_lossy(e.data).into_owned(),
                e.text.map(str::to_owned),
                e.closing_brace,
                e.line_ending,
                e.probed,
            )),
            SseBlockKind::Passed { events } => self.runs.push((raw, events, block.offset)),
            _ => self.other.push(raw),
        }
    }
}

fn probed(payload: &'static str, max: usize, input: &[u8]) -> Recognizes {
    probed_passing(payload, max, input, 0)
}

fn probed_passing(payload: &'static str, max: usize, input: &[u8], passes: usize) -> Recognizes {
    let mut frames = Recognizes {
        probe: OnePayload::new(payload, passes),
        blocks: Vec::new(),
        other: Vec::new(),
        runs: Vec::new(),
    };
    let mut decoder = SseDecoder::with_max_event_bytes(max);
    decoder.feed_probing(input, &mut frames);
    decoder.finish();
    decoder.feed_probing(&[], &mut frames);
    frames
}

impl Recognizes {
    /// Which events were recognized, in order.
    fn which(&self) -> Vec<bool> {
        self.blocks.iter().map(|b| b.6).collect()
    }

    /// The same blocks as a run that recognized nothing (`searched`) handed
    /// out, but for being probed.
    fn assert_as_searched(&self, searched: &Recognizes) {
        assert_eq!(self.other, searched.other);
        assert_eq!(self.blocks.len(), searched.blocks.len());
        for (a, b) in self.blocks.iter().zip(&searched.blocks) {
            assert_eq!(
                (&a.0, a.1, &a.2, &a.3, a.4, a.5),
                (&b.0, b.1, &b.2, &b.3, b.4, b.5)
            );
            assert!(!b.6, "nothing is recognized without a probe");
        }
    }
}

/// An event that is one `data` line the probe recognizes, then a blank
/// line, both LF or both CRLF, is handed out without a search, as the
/// search would hand it out; every other event is searched for, and says
/// so.
#[test]
fn a_recognized_data_line_is_the_event_the_search_would_find() {
    let input: &[u8] = b"\xEF\xBB\xBFdata: {\"a\":1}\n\n\
        data: {\"a\":1}\n\n\
        data:{\"a\":1}\n\n\
        data: {\"a\":1}\r\n\r\n\
        id: 7\ndata: {\"a\":1}\n\n\
        data: {\"a\":1}\ndata: {\"a\":1}\n\n\
        data: {\"a\":1}  \n\n\
        data: {\"a\":1}\r\n\n\
        data: {\"a\":1}\n\n";
    let with = probed("{\"a\":1}", 1 << 20, input);
    with.assert_as_searched(&probed("never", 1 << 20, input));
    assert_eq!(with.blocks.len(), 9);
    // The first after a BOM, one after an `id` line, one with two `data`
    // lines, one with spaces after the payload and one whose lines end
    // differently are searched.
    assert_eq!(
        with.which(),
        [false, true, true, true, false, false, false, false, true]
    );
    assert_eq!(with.blocks[3].5, LineEnding::CrLf);
    assert_eq!(with.blocks[1].4, Some(12), "the closing brace, in `raw`");

    // An event the limit would make oversized is searched for (and then
    // handed out in pieces), not recognized.
    let input = b"data: {}\n\ndata: {\"a\":1}\n\n";
    let small = probed("{\"a\":1}", 13, input);
    assert_eq!(small.blocks.len(), 1);
    assert_eq!(small.other, ["data: {\"a\":1}\n\n"]);
    assert_eq!(probed("{\"a\":1}", 14, input).which(), [false, true]);
    // With CRLF, the line's size counts its CR.
    let input = b"data: {}\r\n\r\ndata: {\"a\":1}\r\n\r\n";
    assert_eq!(probed("{\"a\":1}", 14, input).blocks.len(), 1);
    assert_eq!(probed("{\"a\":1}", 15, input).which(), [false, true]);
}

/// Comment lines before the `data` line (a keep-alive, a timestamp) are
/// skipped, as the search skips them, when they end with LF or CRLF; a
/// lone CR is searched for.
#[test]
fn comment_lines_before_the_data_line_do_not_stop_the_probe() {
    let input: &[u8] = b"data: {}\n\n\
        : t=1\ndata: {\"a\":1}\n\n\
        :\n: two\ndata: {\"a\":1}\n\n\
        : t=2\r\ndata: {\"a\":1}\r\n\r\n\
        : t=3\r\ndata: {\"a\":1}\n\n\
        : t=4\n: t=5\r\ndata: {\"a\":1}\r\n\r\n\
        : t=6\rdata: {\"a\":1}\r\r\
        : t=7\nid: 8\ndata: {\"a\":1}\n\n\
        : t=9\n\n\
        : t=10\ndata: {\"a\":1}\n\n";
    let with = probed("{\"a\":1}", 1 << 20, input);
    with.assert_as_searched(&probed("never", 1 << 20, input));
    assert_eq!(
        with.other,
        [": t=9\n\n"],
        "a block without data is no event"
    );
    assert_eq!(
        with.which(),
        [false, true, true, true, true, true, false, false, true]
    );
    assert_eq!(with.blocks[1].0, ": t=1\ndata: {\"a\":1}\n\n");
    assert_eq!(with.blocks[1].4, Some(18), "the closing brace, in `raw`");
    assert_eq!(with.blocks[3].5, LineEnding::CrLf);
    // The comments count toward the event's size.
    let input = b"data: {}\n\n: t\ndata: {\"a\":1}\n\n";
    assert_eq!(probed("{\"a\":1}", 17, input).blocks.len(), 1);
    assert_eq!(probed("{\"a\":1}", 18, input).which(), [false, true]);
}

/// Events the probe takes go out together, as a run that holds their
/// bytes (comment lines included) and counts them; the first event it does
/// not take ends the run and is handed out alone next, recognized again.
/// Event numbers after a run count the events in it, and the other blocks
/// are those handed out when nothing is taken.
#[test]
fn events_the_probe_takes_go_out_as_one_run() {
    let input: &[u8] = b"data: {}\n\n\
        data: {\"a\":1}\n\n\
        : t=1\ndata: {\"a\":1}\r\n\r\n\
        data: {\"a\":1}\n\n\
        data: {\"a\":1}\n\n\
        event: x\ndata: {\"a\":1}\n\n\
        data: {\"a\":1}\n\n";
    // Takes the 2nd to 4th events, and no event after them.
    let run = probed_passing("{\"a\":1}", 1 << 20, input, 4);
    assert_eq!(
        run.runs,
        [(
            "data: {\"a\":1}\n\n: t=1\ndata: {\"a\":1}\r\n\r\ndata: {\"a\":1}\n\n".to_string(),
            3,
            10
        )]
    );
    let alone = probed("{\"a\":1}", 1 << 20, input);
    assert_eq!(alone.blocks.len(), 7);
    assert!(run.other.is_empty() && alone.other.is_empty());
    let kept = |r: &Recognizes, i: usize| (r.blocks[i].0.clone(), r.blocks[i].1, r.blocks[i].6);
    // The 1st, then the 5th to 7th: numbered as when none is taken; the
    // one with an event type is searched for.
    assert_eq!(run.blocks.len(), 4);
    for (i, j) in [(0, 0), (1, 4), (2, 5), (3, 6)] {
        assert_eq!(kept(&run, i), kept(&alone, j));
    }
    assert_eq!(run.which(), [false, true, false, true]);
    let joined: String = alone.blocks[1..4].iter().map(|b| b.0.as_str()).collect();
    assert_eq!(joined, run.runs[0].0);
}
