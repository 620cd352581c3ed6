//! The checks behind the fuzz targets: one `pub fn` per target, taking the
//! fuzzer's bytes and panicking when an invariant breaks (issue 7,
//! "Fuzzing").
//!
//! This file is the library of the `fuzz/` package, whose targets in
//! `fuzz_targets/` are one line each, and it is also compiled into
//! `tests/fuzz_regressions.rs` (`#[path]`), so `cargo test` replays every
//! saved crash input through exactly the checks that found it. It uses only
//! `aalis_proxy`, `serde_json`, `bytes` and `http`, which both packages have.
//!
//! The stream targets ([`sse_framing`], [`ndjson_framing`], [`annotate`],
//! [`chunked_body`]) read their input as a [`Plan`]: byte 0 picks the
//! configuration, byte 1 the cutting, then come the cut points and the
//! stream. The output for any cutting must be the output for the whole
//! input, so chunking invariance is fuzzed along with everything else.
//!
//! The provider decoders are reached only through [`decode_frame`]: when
//! their API changes, that function is the one to adapt.

#![allow(dead_code)]

use std::collections::HashSet;

use aalis_proxy::chunk::{ArgumentsDelta, Chunk};
use aalis_proxy::encode::inject::{self, Frame};
use aalis_proxy::encode::{InjectMode, OutputFormat, ProgressBatch, Sink};
use aalis_proxy::framing::Framing;
use aalis_proxy::framing::ndjson::NdjsonDecoder;
use aalis_proxy::framing::sse::{DEFAULT_MAX_EVENT_BYTES, LineEnding, SseBlockKind, SseDecoder};
use aalis_proxy::js;
use aalis_proxy::pipeline::{Annotator, AnnotatorConfig, StreamEvent};
use aalis_proxy::progress::Progress;
use aalis_proxy::providers::{self, DecoderState, FrameError, FrameInfo, Provider};
use aalis_proxy::proxy::h1::wire::{Chunked, Piece, WireError};
use bytes::BytesMut;
use http::{HeaderMap, HeaderValue};
use serde_json::{Map, Value};

/// A fixed clock: nothing checked here depends on time.
const NOW_MS: u64 = 1_767_225_600_000;

/// The event (line) size limits a plan can pick: the default, and small
/// ones that make the oversized path (events passed on unparsed, in pieces)
/// reachable with small inputs.
const MAX_EVENT_BYTES: [usize; 4] = [DEFAULT_MAX_EVENT_BYTES, 16, 64, 300];

// === the input layout ===

/// How a stream target's input is read: `[config, cutting, cuts…, stream…]`.
#[derive(Debug)]
pub struct Plan<'a> {
    /// Byte 0: what to run; each target reads it its own way.
    pub config: u8,
    pub cutting: Cutting,
    pub stream: &'a [u8],
}

/// How the stream is fed to a decoder or the pipeline.
#[derive(Debug, Clone)]
pub enum Cutting {
    /// Cut at these offsets (reduced modulo `len + 1`, sorted, deduplicated).
    At(Vec<usize>),
    /// One byte at a time.
    Bytewise,
}

impl<'a> Plan<'a> {
    /// Byte 1: the low 3 bits say how many 2-byte little-endian cut points
    /// follow; bit 3 asks for one byte at a time instead. Missing bytes read
    /// as zero, so every input is a plan.
    pub fn parse(data: &'a [u8]) -> Plan<'a> {
        let byte = |i: usize| data.get(i).copied().unwrap_or(0);
        let config = byte(0);
        let cutting_byte = byte(1);
        let count = usize::from(cutting_byte & 0b111);
        let mut cuts = Vec::with_capacity(count);
        for k in 0..count {
            let at = 2 + 2 * k;
            cuts.push(usize::from(u16::from_le_bytes([byte(at), byte(at + 1)])));
        }
        let stream = data.get(2 + 2 * count..).unwrap_or_default();
        let cutting = if cutting_byte & 0b1000 != 0 {
            Cutting::Bytewise
        } else {
            let len = stream.len() + 1;
            let mut cuts: Vec<usize> = cuts.into_iter().map(|c| c % len).collect();
            cuts.sort_unstable();
            cuts.dedup();
            Cutting::At(cuts)
        };
        Plan {
            config,
            cutting,
            stream,
        }
    }

    /// The stream in the plan's pieces (the whole stream is one piece when
    /// there are no cuts).
    pub fn pieces(&self) -> Vec<&'a [u8]> {
        match &self.cutting {
            Cutting::Bytewise => self.stream.chunks(1).collect(),
            Cutting::At(cuts) => {
                let mut pieces = Vec::with_capacity(cuts.len() + 1);
                let mut start = 0;
                for &cut in cuts {
                    pieces.push(&self.stream[start..cut]);
                    start = cut;
                }
                pieces.push(&self.stream[start..]);
                pieces
            }
        }
    }
}

// === sse_framing ===

/// One SSE block as recorded for comparison, with everything that may
/// legitimately depend on the cutting normalized away: an open line ending
/// is resolved by its [`SseBlockKind::LineEndTail`], and the pieces of an
/// oversized event are merged.
#[derive(Debug, PartialEq, Eq)]
enum SseRecord {
    Event {
        offset: u64,
        number: u64,
        event_type: Vec<u8>,
        data: Vec<u8>,
        last_event_id: Vec<u8>,
        /// Stream offset of the closing brace.
        closing_brace: Option<u64>,
        line_ending: LineEnding,
    },
    NoData {
        offset: u64,
    },
    Unterminated {
        offset: u64,
        has_data: bool,
        number: u64,
    },
    Oversized {
        offset: u64,
        number: u64,
        bytes: u64,
    },
}

/// What an [`SseDecoder`] handed out for some pieces.
struct SseRun {
    /// Every block's `raw`, concatenated.
    raw: Vec<u8>,
    records: Vec<SseRecord>,
}

fn run_sse_decoder(max_event_bytes: usize, pieces: &[&[u8]]) -> SseRun {
    let mut decoder = SseDecoder::with_max_event_bytes(max_event_bytes);
    let mut run = SseRun {
        raw: Vec::new(),
        records: Vec::new(),
    };
    // An event whose line ending is still open: the next block must be its
    // tail. An oversized event whose last piece has not come: the next block
    // must be its next piece.
    let mut tail_due = false;
    let mut oversized_open: Option<u64> = None;
    let mut drain = |decoder: &mut SseDecoder, run: &mut SseRun| {
        while let Some(block) = decoder.next_block() {
            assert_eq!(
                block.offset,
                run.raw.len() as u64,
                "block offset is where the previous block ended"
            );
            run.raw.extend_from_slice(block.raw);
            let is_tail = matches!(block.kind, SseBlockKind::LineEndTail);
            assert!(
                !tail_due || is_tail,
                "an open line ending is followed by its tail, not {:?}",
                block.kind
            );
            if let Some(number) = oversized_open {
                assert!(
                    matches!(block.kind, SseBlockKind::Oversized { number: n, first: false, .. } if n == number),
                    "oversized event {number} continues with {:?}",
                    block.kind
                );
            }
            tail_due = false;
            match block.kind {
                SseBlockKind::Event(event) => {
                    assert!(!block.raw.is_empty(), "an event has bytes");
                    let closing_brace = event.closing_brace.map(|i| {
                        assert_eq!(
                            block.raw.get(i),
                            Some(&b'}'),
                            "closing_brace points at `}}`"
                        );
                        block.offset + i as u64
                    });
                    let last_data_byte = event
                        .data
                        .iter()
                        .rev()
                        .find(|b| !matches!(b, b' ' | b'\t' | b'\n'));
                    assert_eq!(
                        closing_brace.is_some(),
                        last_data_byte == Some(&b'}'),
                        "closing_brace is set exactly when the data ends with `}}`"
                    );
                    if event.line_ending_open {
                        assert_eq!(event.line_ending, LineEnding::Cr);
                        assert!(block.raw.ends_with(b"\r"));
                        tail_due = true;
                    }
                    run.records.push(SseRecord::Event {
                        offset: block.offset,
                        number: event.number,
                        event_type: event.event_type.to_vec(),
                        data: event.data.to_vec(),
                        last_event_id: event.last_event_id.to_vec(),
                        closing_brace,
                        line_ending: event.line_ending,
                    });
                }
                SseBlockKind::NoData => run.records.push(SseRecord::NoData {
                    offset: block.offset,
                }),
                SseBlockKind::LineEndTail => {
                    assert!(
                        block.raw.is_empty() || block.raw == b"\n",
                        "a line-end tail is empty or one LF, not {:?}",
                        block.raw
                    );
                    if block.raw == b"\n"
                        && let Some(SseRecord::Event { line_ending, .. }) = run.records.last_mut()
                    {
                        *line_ending = LineEnding::CrLf;
                    }
                }
                SseBlockKind::Unterminated { has_data, number } => {
                    run.records.push(SseRecord::Unterminated {
                        offset: block.offset,
                        has_data,
                        number,
                    })
                }
                SseBlockKind::Oversized {
                    number,
                    first,
                    last,
                } => {
                    let bytes = block.raw.len() as u64;
                    if first {
                        run.records.push(SseRecord::Oversized {
                            offset: block.offset,
                            number,
                            bytes,
                        });
                    } else if let Some(SseRecord::Oversized { bytes: total, .. }) =
                        run.records.last_mut()
                    {
                        *total += bytes;
                    } else {
                        panic!("a later piece of oversized event {number} comes first");
                    }
                    oversized_open = (!last).then_some(number);
                }
                SseBlockKind::Passed { .. } => {
                    panic!("next_block asks no probe: no event is passed")
                }
            }
        }
    };
    for piece in pieces {
        decoder.push(piece);
        drain(&mut decoder, &mut run);
    }
    decoder.finish();
    drain(&mut decoder, &mut run);
    assert!(!tail_due, "an open line ending got no tail at the end");
    assert_eq!(oversized_open, None, "an oversized event got no last piece");
    run
}

/// The events a WHATWG event-stream parser dispatches for `input`: (event
/// type, data, last event id). Written from the specification, line by line
/// over the whole input, sharing nothing with [`SseDecoder`].
fn reference_sse_events(input: &[u8]) -> Vec<(Vec<u8>, Vec<u8>, Vec<u8>)> {
    let input = input.strip_prefix(b"\xEF\xBB\xBF").unwrap_or(input);
    let mut events = Vec::new();
    let (mut data, mut event_type, mut last_id) = (Vec::new(), Vec::new(), Vec::new());
    let mut has_data = false;
    let mut rest = input;
    // Only complete lines count: the end of input discards a partial one.
    while let Some(end) = rest.iter().position(|b| matches!(b, b'\r' | b'\n')) {
        let line = &rest[..end];
        let skip = if rest[end..].starts_with(b"\r\n") {
            2
        } else {
            1
        };
        rest = &rest[end + skip..];
        if line.is_empty() {
            if has_data {
                events.push((event_type.clone(), data.clone(), last_id.clone()));
            }
            data.clear();
            event_type.clear();
            has_data = false;
            continue;
        }
        if line[0] == b':' {
            continue;
        }
        let (name, value) = match line.iter().position(|&b| b == b':') {
            Some(colon) => {
                let value = &line[colon + 1..];
                (&line[..colon], value.strip_prefix(b" ").unwrap_or(value))
            }
            None => (line, &b""[..]),
        };
        match name {
            b"data" => {
                if has_data {
                    data.push(b'\n');
                }
                has_data = true;
                data.extend_from_slice(value);
            }
            b"event" => event_type = value.to_vec(),
            b"id" if !value.contains(&0) => last_id = value.to_vec(),
            _ => {}
        }
    }
    events
}

/// `sse_framing`: the [`SseDecoder`] on any bytes, in any cutting.
///
/// - no panic;
/// - the blocks' raw bytes, concatenated, are the input; offsets add up;
/// - the blocks (normalized, see [`SseRecord`]) are the same for the whole
///   input and for the plan's cutting;
/// - events and oversized events are numbered 1, 2, …; an unterminated tail
///   gets the next number;
/// - without oversized events, the events are those of a WHATWG parser.
///
/// Config byte: `% 4` picks the maximum event size.
pub fn sse_framing(data: &[u8]) {
    let plan = Plan::parse(data);
    let max = MAX_EVENT_BYTES[usize::from(plan.config) % MAX_EVENT_BYTES.len()];
    let whole = run_sse_decoder(max, &[plan.stream]);
    assert_eq!(whole.raw, plan.stream, "blocks of the whole input != input");
    let cut = run_sse_decoder(max, &plan.pieces());
    assert_eq!(cut.raw, plan.stream, "blocks of the cut input != input");
    assert_eq!(cut.records, whole.records, "blocks depend on the cutting");

    let mut expected_number = 1;
    let mut oversized = false;
    for record in &whole.records {
        match record {
            SseRecord::Event { number, .. } | SseRecord::Oversized { number, .. } => {
                assert_eq!(*number, expected_number, "events are numbered in order");
                expected_number += 1;
                oversized |= matches!(record, SseRecord::Oversized { .. });
            }
            SseRecord::Unterminated { number, .. } => assert_eq!(*number, expected_number),
            SseRecord::NoData { .. } => {}
        }
    }
    if !oversized {
        let events: Vec<(Vec<u8>, Vec<u8>, Vec<u8>)> = whole
            .records
            .iter()
            .filter_map(|r| match r {
                SseRecord::Event {
                    event_type,
                    data,
                    last_event_id,
                    ..
                } => Some((event_type.clone(), data.clone(), last_event_id.clone())),
                _ => None,
            })
            .collect();
        assert_eq!(
            events,
            reference_sse_events(plan.stream),
            "events differ from a WHATWG parser"
        );
    }
}

// === ndjson_framing ===

#[derive(Debug, PartialEq, Eq)]
enum NdjsonRecord {
    Line {
        offset: u64,
        number: u64,
        content: Vec<u8>,
        content_start: usize,
        closing_brace: Option<usize>,
    },
    Oversized {
        offset: u64,
        number: u64,
        bytes: u64,
    },
}

fn run_ndjson_decoder(max_line_bytes: usize, pieces: &[&[u8]]) -> (Vec<u8>, Vec<NdjsonRecord>) {
    let mut decoder = NdjsonDecoder::with_max_line_bytes(max_line_bytes);
    let mut raw = Vec::new();
    let mut records = Vec::new();
    let mut oversized_open: Option<u64> = None;
    let mut drain = |decoder: &mut NdjsonDecoder, raw: &mut Vec<u8>, records: &mut Vec<_>| {
        while let Some(line) = decoder.next_line() {
            assert_eq!(line.offset, raw.len() as u64, "lines are contiguous");
            raw.extend_from_slice(line.raw);
            match line.oversized {
                Some(piece) => {
                    if piece.first {
                        assert_eq!(oversized_open, None, "a new oversized line mid-line");
                        records.push(NdjsonRecord::Oversized {
                            offset: line.offset,
                            number: line.number,
                            bytes: line.raw.len() as u64,
                        });
                    } else {
                        assert_eq!(oversized_open, Some(line.number), "piece of another line");
                        match records.last_mut() {
                            Some(NdjsonRecord::Oversized { bytes, .. }) => {
                                *bytes += line.raw.len() as u64
                            }
                            other => panic!("a later oversized piece after {other:?}"),
                        }
                    }
                    oversized_open = (!piece.last).then_some(line.number);
                }
                None => {
                    assert_eq!(oversized_open, None, "a line inside an oversized line");
                    assert!(!line.raw.is_empty(), "a line has bytes");
                    let closing_brace = line.closing_brace();
                    if let Some(i) = closing_brace {
                        assert_eq!(line.raw[i], b'}');
                    }
                    records.push(NdjsonRecord::Line {
                        offset: line.offset,
                        number: line.number,
                        content: line.content.to_vec(),
                        content_start: line.content_start,
                        closing_brace,
                    });
                }
            }
        }
    };
    for piece in pieces {
        decoder.push(piece);
        drain(&mut decoder, &mut raw, &mut records);
    }
    decoder.finish();
    drain(&mut decoder, &mut raw, &mut records);
    assert_eq!(oversized_open, None, "an oversized line got no last piece");
    (raw, records)
}

/// The lines of `input` as the module docs of `framing::ndjson` describe
/// them, computed in one pass over the whole input.
fn reference_ndjson_lines(input: &[u8], max_line_bytes: usize) -> Vec<NdjsonRecord> {
    let mut offset = 0u64;
    let mut records = Vec::new();
    for (i, raw) in input.split_inclusive(|&b| b == b'\n').enumerate() {
        let number = i as u64 + 1;
        let without_lf = raw.strip_suffix(b"\n").unwrap_or(raw);
        if without_lf.len() > max_line_bytes {
            records.push(NdjsonRecord::Oversized {
                offset,
                number,
                bytes: raw.len() as u64,
            });
        } else {
            let mut content = without_lf.strip_suffix(b"\r").unwrap_or(without_lf);
            let mut content_start = 0;
            if offset == 0
                && let Some(rest) = content.strip_prefix(b"\xEF\xBB\xBF")
            {
                content = rest;
                content_start = 3;
            }
            let closing_brace = content
                .iter()
                .rposition(|b| !b.is_ascii_whitespace())
                .filter(|&j| content[j] == b'}')
                .map(|j| content_start + j);
            records.push(NdjsonRecord::Line {
                offset,
                number,
                content: content.to_vec(),
                content_start,
                closing_brace,
            });
        }
        offset += raw.len() as u64;
    }
    records
}

/// `ndjson_framing`: the [`NdjsonDecoder`] on any bytes, in any cutting.
///
/// - no panic;
/// - the lines' raw bytes, concatenated, are the input; offsets add up;
/// - the lines (oversized pieces merged) are the same for the whole input
///   and for the plan's cutting, and are those of a one-pass reference
///   split on `\n`.
///
/// Config byte: `% 4` picks the maximum line size.
pub fn ndjson_framing(data: &[u8]) {
    let plan = Plan::parse(data);
    let max = MAX_EVENT_BYTES[usize::from(plan.config) % MAX_EVENT_BYTES.len()];
    let (raw, whole) = run_ndjson_decoder(max, &[plan.stream]);
    assert_eq!(raw, plan.stream, "lines of the whole input != input");
    let (raw, cut) = run_ndjson_decoder(max, &plan.pieces());
    assert_eq!(raw, plan.stream, "lines of the cut input != input");
    assert_eq!(cut, whole, "lines depend on the cutting");
    assert_eq!(
        whole,
        reference_ndjson_lines(plan.stream, max),
        "lines differ from the reference split"
    );
}

// === openai_decode, ollama_decode ===

/// What decoding one frame gave.
#[derive(Debug)]
struct Decoded<'a> {
    chunks: Vec<Chunk<'a>>,
    result: Result<FrameInfo<'a>, FrameError>,
}

/// The one call into the provider decoders (adapt here when their API
/// changes).
fn decode_frame<'a>(provider: Provider, data: &'a [u8], state: &mut DecoderState) -> Decoded<'a> {
    let mut chunks = Vec::new();
    let result = providers::decode(provider, data, state, &mut |chunk| chunks.push(chunk));
    Decoded { chunks, result }
}

/// serde_json rejects some JSON that JavaScript's `JSON.parse` accepts, and
/// so do our decoders (SPEC.md): lone surrogate escapes (`"\ud83d"`, from a
/// UTF-16 server cutting a fragment inside a pair) and numbers beyond `f64`
/// (`1e400`, Infinity). Values copied verbatim from upstream can hold them.
pub fn javascript_accepts(err: &serde_json::Error) -> bool {
    let message = err.to_string();
    message.contains("surrogate")
        || message.starts_with("unexpected end of hex escape")
        || message.starts_with("number out of range")
}

/// What holds for any frame of either provider.
fn check_decoded(provider: Provider, data: &[u8], decoded: &Decoded<'_>) {
    if decoded.result.is_err() {
        assert!(
            decoded.chunks.is_empty(),
            "a frame that fails emits no chunk, got {:?}",
            decoded.chunks
        );
    }
    for (i, chunk) in decoded.chunks.iter().enumerate() {
        match chunk {
            Chunk::Text { text, .. } | Chunk::Reasoning { text, .. } => {
                assert!(!text.get().is_empty(), "text chunks are never empty")
            }
            Chunk::Done => assert_eq!(i + 1, decoded.chunks.len(), "Done is the last chunk"),
            Chunk::ToolCallDelta(delta) => {
                if provider == Provider::OpenAiChat
                    && let ArgumentsDelta::Replace(json) = &delta.arguments
                {
                    // A whole value, serialized as JSON.stringify would:
                    // always JSON (with lone surrogate escapes, which
                    // JavaScript keeps and serde_json refuses).
                    let value = serde_json::from_str::<Value>(json);
                    assert!(
                        value.is_ok() || matches!(&value, Err(e) if javascript_accepts(e)),
                        "replacement arguments are not JSON: {json:?}"
                    );
                }
                for text in [&delta.id, &delta.name].into_iter().flatten() {
                    assert!(!text.is_empty(), "ids and names are never empty");
                }
            }
            Chunk::Ignored { raw, .. } => {
                // A field passed over for its shape is still a JSON value.
                let value: Result<Value, _> = serde_json::from_str(raw);
                assert!(
                    value.is_ok() || matches!(&value, Err(e) if javascript_accepts(e)),
                    "an ignored field is no JSON value: {raw:?}"
                );
            }
            Chunk::Finish { .. } | Chunk::Usage(_) | Chunk::Error { .. } => {}
        }
    }
    // A frame the decoder reads as an object is JSON: serde_json agrees,
    // but for what JavaScript accepts and serde_json does not.
    if let Ok(info) = &decoded.result
        && info.is_object()
    {
        let value: Result<Value, _> = serde_json::from_slice(data);
        assert!(
            matches!(&value, Ok(Value::Object(_)))
                || matches!(&value, Err(e) if javascript_accepts(e)),
            "decoded as an object, but serde_json says {value:?}"
        );
    }
}

/// Decodes `frames` in order with one [`DecoderState`], as a stream does,
/// and checks each result against the same frame decoded with a fresh
/// state (the fast paths keep a template learned from the frames before:
/// it may change speed, never a result). Only Ollama's call numbering
/// carries over, so the fresh state starts at the same number.
fn decode_stream<'a>(provider: Provider, frames: &[&'a [u8]]) -> Vec<Decoded<'a>> {
    let mut state = DecoderState::default();
    let mut decoded = Vec::with_capacity(frames.len());
    for frame in frames {
        let mut fresh = DecoderState::default();
        fresh.ollama_calls = state.ollama_calls;
        let alone = decode_frame(provider, frame, &mut fresh);
        let in_stream = decode_frame(provider, frame, &mut state);
        assert_eq!(
            format!("{in_stream:?}"),
            format!("{alone:?}"),
            "a frame decodes differently after the frames before it"
        );
        assert_eq!(state.ollama_calls, fresh.ollama_calls);
        decoded.push(in_stream);
    }
    decoded
}

/// `openai_decode`: SSE events' data, any bytes; each `\n` starts the
/// next event, all decoded with one [`DecoderState`].
///
/// - no panic; decoding the events twice gives the same chunks and results;
/// - an event decodes the same after any events as alone;
/// - a failed frame emits no chunk; text is never empty; `Done` is last;
///   whole-value arguments are JSON; what decodes as an object is JSON;
/// - a frame that `js::stringifies_to_itself` says prints back unchanged
///   does (the check that spares whole-value arguments a parse).
pub fn openai_decode(data: &[u8]) {
    let frames: Vec<&[u8]> = data.split(|&b| b == b'\n').collect();
    let first = decode_stream(Provider::OpenAiChat, &frames);
    let second = decode_stream(Provider::OpenAiChat, &frames);
    assert_eq!(
        format!("{first:?}"),
        format!("{second:?}"),
        "decoding is deterministic"
    );
    for (frame, decoded) in frames.iter().zip(&first) {
        check_decoded(Provider::OpenAiChat, frame, decoded);
        check_stringifies_to_itself(frame);
    }
}

/// If `data` is JSON that [`js::stringifies_to_itself`] recognizes,
/// `JSON.stringify` of its value is `data` again.
fn check_stringifies_to_itself(data: &[u8]) {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let Ok(value) = serde_json::from_str::<Value>(text) else {
        return;
    };
    if js::stringifies_to_itself(text) {
        assert_eq!(
            js::stringify_to_string(&value),
            text,
            "recognized, but prints otherwise"
        );
    }
}

/// `ollama_decode`: a stream of NDJSON lines (split on `\n`), any bytes,
/// decoded with one [`DecoderState`].
///
/// - no panic; decoding the stream twice gives the same chunks and results;
/// - a line decodes the same after any lines as alone (with the same next
///   call number);
/// - per line, what [`openai_decode`] checks (but arguments: Ollama's may
///   be any text), `stringifies_to_itself` included;
/// - every tool call gets an index, and no two calls of the stream share one
///   (`providers::ollama`: "two calls must never share a number").
pub fn ollama_decode(data: &[u8]) {
    let lines: Vec<&[u8]> = data.split(|&b| b == b'\n').collect();
    let first = decode_stream(Provider::OllamaChat, &lines);
    let second = decode_stream(Provider::OllamaChat, &lines);
    assert_eq!(
        format!("{first:?}"),
        format!("{second:?}"),
        "decoding is deterministic"
    );
    let mut indexes = HashSet::new();
    for (line, decoded) in lines.iter().zip(&first) {
        check_decoded(Provider::OllamaChat, line, decoded);
        check_stringifies_to_itself(line);
        for chunk in &decoded.chunks {
            if let Chunk::ToolCallDelta(delta) = chunk {
                let index = delta.index.expect("every Ollama call gets an index");
                assert!(
                    indexes.insert(index),
                    "two Ollama calls share index {index}"
                );
            }
        }
    }
}

// === inject_field ===

/// Tells forwarded bytes from inserted ones, like `tests/common`'s `Run`.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Recorder {
    /// Everything written, in order.
    pub output: Vec<u8>,
    /// Only the forwarded bytes.
    pub forwarded: Vec<u8>,
    /// Each insertion: (offset in the forwarded bytes, bytes); adjacent
    /// insertions are merged.
    pub inserted: Vec<(usize, Vec<u8>)>,
    pub warnings: Vec<String>,
    /// What the proxy's subscribers would hear (`collect_events`).
    pub events: Vec<StreamEvent>,
}

impl Sink for Recorder {
    fn forward(&mut self, bytes: &[u8]) {
        self.output.extend_from_slice(bytes);
        self.forwarded.extend_from_slice(bytes);
    }
    fn insert(&mut self, bytes: &[u8]) {
        self.output.extend_from_slice(bytes);
        match self.inserted.last_mut() {
            Some((at, b)) if *at == self.forwarded.len() => b.extend_from_slice(bytes),
            _ => self.inserted.push((self.forwarded.len(), bytes.to_vec())),
        }
    }
}

impl Recorder {
    /// The output rebuilt from the forwarded bytes and the insertions: it
    /// must be the output, so that removing the insertions gives exactly
    /// what was forwarded.
    fn rebuilt(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(self.output.len());
        let mut from = 0;
        for (at, bytes) in &self.inserted {
            out.extend_from_slice(&self.forwarded[from..*at]);
            out.extend_from_slice(bytes);
            from = *at;
        }
        out.extend_from_slice(&self.forwarded[from..]);
        out
    }
}

/// One progress object the `inject_field` input asks for.
#[derive(Debug)]
struct ProgressSpec {
    choice: i64,
    index: i64,
    name: std::sync::Arc<str>,
    chars_accumulated: usize,
}

/// Checks that `value` is the progress object of `spec`.
fn assert_progress_json(value: &Value, spec: &ProgressSpec) {
    let Value::Object(object) = value else {
        panic!("progress is not an object: {value}")
    };
    assert_eq!(object.get("index"), Some(&Value::from(spec.index)));
    assert_eq!(
        object.get("name").and_then(Value::as_str),
        Some(&*spec.name),
        "the name survives escaping"
    );
    assert_eq!(
        object.get("charsAccumulated"),
        Some(&Value::from(spec.chars_accumulated as u64))
    );
    let choice = (spec.choice != 0).then(|| Value::from(spec.choice));
    assert_eq!(object.get("choice"), choice.as_ref());
}

/// `inject_field`: [`inject::write_frame`] in `field` mode on any frame with
/// any progress objects (names of any characters).
///
/// - no panic; the forwarded bytes are the frame;
/// - nothing is inserted unless the frame is an object with a closing brace,
///   not yet annotated, with progress; then exactly one insertion, right
///   before the closing brace;
/// - the insertion is a valid JSON member list whose `toolCallProgress` is
///   the last progress object (and `toolCallsProgress` all of them, when
///   there are several), with every name and number intact;
/// - when the frame is a JSON object, the annotated frame is the same
///   object plus those members;
/// - `none` mode forwards the frame alone.
///
/// Input: byte 0 (bits 0–1: progress objects − 1; bit 2: the frame is
/// already annotated; bit 3: the frame is not an object), then per progress
/// object `choice: i8, index: i16 LE, chars: u32 LE, name_len: u8, name`
/// (lossy UTF-8), then the frame.
pub fn inject_field(data: &[u8]) {
    let mut rest = data;
    let mut take = |n: usize| {
        let (head, tail) = rest.split_at(n.min(rest.len()));
        rest = tail;
        let mut bytes = head.to_vec();
        bytes.resize(n, 0);
        bytes
    };
    let flags = take(1)[0];
    let count = usize::from(flags & 0b11) + 1;
    let already_annotated = flags & 0b100 != 0;
    let not_object = flags & 0b1000 != 0;
    let mut specs = Vec::with_capacity(count);
    for _ in 0..count {
        let head = take(8);
        let name_len = usize::from(head[7]);
        specs.push(ProgressSpec {
            choice: i64::from(i8::from_le_bytes([head[0]])),
            index: i64::from(i16::from_le_bytes([head[1], head[2]])),
            chars_accumulated: u32::from_le_bytes([head[3], head[4], head[5], head[6]]) as usize,
            name: String::from_utf8_lossy(&take(name_len)).into(),
        });
    }
    let raw = rest;

    let mut batch = ProgressBatch::default();
    for spec in &specs {
        batch.push(&Progress {
            choice: spec.choice,
            index: spec.index,
            name: &spec.name,
            chars_accumulated: spec.chars_accumulated,
            started_at_ms: NOW_MS,
        });
    }
    // Where the framers put it: the last non-whitespace byte, if `}`.
    let closing_brace = raw
        .iter()
        .rposition(|b| !b.is_ascii_whitespace())
        .filter(|&i| raw[i] == b'}');
    // Only an object can be annotated already: a frame that is not one
    // has no flags at all.
    let info = if not_object {
        FrameInfo::default()
    } else {
        FrameInfo::object(already_annotated)
    };
    let frame = Frame {
        raw,
        closing_brace,
        line_ending: b"\n",
        info: Some(&info),
    };

    let mut after = String::new();
    let mut none = Recorder::default();
    inject::write_frame(&mut none, &frame, InjectMode::None, &batch, &mut after);
    assert_eq!(none.output, raw, "`none` forwards the frame alone");
    assert!(after.is_empty());

    let mut out = Recorder::default();
    inject::write_frame(&mut out, &frame, InjectMode::Field, &batch, &mut after);
    assert!(after.is_empty(), "`field` adds nothing after the frame");
    assert_eq!(out.forwarded, raw, "forwarded bytes != frame");
    assert_eq!(out.rebuilt(), out.output);
    let Some(brace) = closing_brace.filter(|_| !already_annotated && !not_object) else {
        assert!(
            out.inserted.is_empty(),
            "inserted into a frame that takes nothing"
        );
        return;
    };
    assert_eq!(out.inserted.len(), 1, "one insertion");
    let (at, inserted) = &out.inserted[0];
    assert_eq!(*at, brace, "inserted right before the closing brace");
    let inserted = std::str::from_utf8(inserted).expect("insertions are UTF-8");
    let after_open_brace =
        raw[..brace].iter().rev().find(|b| !b.is_ascii_whitespace()) == Some(&b'{');
    let members = match inserted.strip_prefix(',') {
        Some(members) => {
            assert!(!after_open_brace, "a comma after `{{`");
            members
        }
        None => {
            assert!(after_open_brace, "no comma after a member");
            inserted
        }
    };
    let object: Map<String, Value> = serde_json::from_str(&format!("{{{members}}}"))
        .unwrap_or_else(|e| panic!("insertion {inserted:?} is not JSON members: {e}"));
    let last = specs.last().expect("at least one progress");
    assert_progress_json(&object["toolCallProgress"], last);
    if count > 1 {
        let Some(Value::Array(all)) = object.get("toolCallsProgress") else {
            panic!("several progress objects without toolCallsProgress: {inserted}")
        };
        assert_eq!(all.len(), count);
        for (value, spec) in all.iter().zip(&specs) {
            assert_progress_json(value, spec);
        }
        assert_eq!(object.len(), 2);
    } else {
        assert_eq!(object.len(), 1);
    }

    // On a real JSON object: the same object plus the members.
    if let Ok(Value::Object(original)) = serde_json::from_slice::<Value>(raw)
        && !object.keys().any(|k| original.contains_key(k))
    {
        let annotated: Value = serde_json::from_slice(&out.output)
            .unwrap_or_else(|e| panic!("annotated object is not JSON: {e}"));
        let mut expected = original.clone();
        expected.extend(object);
        assert_eq!(annotated, Value::Object(expected));
    }
}

// === annotate ===

/// The configuration byte of [`annotate`]: `% 7` the mode (`field`,
/// `comment`, `event`, `chunk`, `none`, `--format ndjson`, `--format
/// messages`), `/ 7 % 4` the maximum event size, `/ 28 % 3` the framing
/// (sniffed, SSE, NDJSON), `/ 84 % 2` whether increments are collected for
/// subscribers (what the proxy's events route does).
fn annotator_config(config: u8) -> AnnotatorConfig {
    let sse = |inject| (OutputFormat::Sse, inject);
    let (output, inject) = match config % 7 {
        0 => sse(InjectMode::Field),
        1 => sse(InjectMode::Comment),
        2 => sse(InjectMode::Event),
        3 => sse(InjectMode::Chunk),
        4 => sse(InjectMode::None),
        5 => (OutputFormat::Ndjson, InjectMode::Field),
        _ => (OutputFormat::Messages, InjectMode::Field),
    };
    let framing = match config / 28 % 3 {
        0 => None,
        1 => Some(Framing::Sse),
        _ => Some(Framing::Ndjson),
    };
    AnnotatorConfig {
        output,
        inject,
        session_id: (output == OutputFormat::Messages).then(|| "s1".to_owned()),
        framing,
        max_event_bytes: MAX_EVENT_BYTES[usize::from(config / 7 % 4)],
        collect_events: config / 84 % 2 == 1,
    }
}

fn run_annotator(config: &AnnotatorConfig, pieces: &[&[u8]]) -> Recorder {
    let mut annotator = Annotator::new(config.clone());
    let mut out = Recorder::default();
    for piece in pieces {
        annotator.push(piece, NOW_MS, &mut out);
        out.warnings
            .extend(annotator.take_warnings().iter().map(ToString::to_string));
        out.events.extend(annotator.take_events());
    }
    annotator.finish(NOW_MS, &mut out);
    out.warnings
        .extend(annotator.take_warnings().iter().map(ToString::to_string));
    out.events.extend(annotator.take_events());
    if !config.collect_events {
        assert!(out.events.is_empty(), "events collected without asking");
    }
    out
}

/// The data of each frame of `stream` as the annotator frames it: `Some`
/// for an SSE event or an NDJSON line, `None` for an oversized one.
fn frame_payloads(stream: &[u8], framing: Framing, max_event_bytes: usize) -> Vec<Option<Vec<u8>>> {
    let mut payloads = Vec::new();
    match framing {
        Framing::Sse => {
            let mut decoder = SseDecoder::with_max_event_bytes(max_event_bytes);
            decoder.push(stream);
            decoder.finish();
            while let Some(block) = decoder.next_block() {
                match block.kind {
                    SseBlockKind::Event(event) => payloads.push(Some(event.data.to_vec())),
                    SseBlockKind::Oversized { first: true, .. } => payloads.push(None),
                    _ => {}
                }
            }
        }
        Framing::Ndjson => {
            let mut decoder = NdjsonDecoder::with_max_line_bytes(max_event_bytes);
            decoder.push(stream);
            decoder.finish();
            while let Some(line) = decoder.next_line() {
                match line.oversized {
                    Some(piece) if piece.first => payloads.push(None),
                    Some(_) => {}
                    None => payloads.push(Some(line.content.to_vec())),
                }
            }
        }
    }
    payloads
}

/// `field` injection, checked on the output alone: frame for frame, an
/// annotated frame that was a JSON object is the same object plus
/// `toolCallProgress` (and `toolCallsProgress`), nothing else.
fn check_field_output(input: &[u8], output: &[u8], framing: Framing, max_event_bytes: usize) {
    let before = frame_payloads(input, framing, max_event_bytes);
    let after = frame_payloads(output, framing, max_event_bytes);
    assert_eq!(
        before.len(),
        after.len(),
        "`field` changed the number of frames"
    );
    for (before, after) in before.iter().zip(&after) {
        let (Some(before), Some(after)) = (before, after) else {
            continue;
        };
        if before == after {
            continue;
        }
        let Ok(Value::Object(original)) = serde_json::from_slice::<Value>(before) else {
            continue;
        };
        let annotated = match serde_json::from_slice::<Value>(after) {
            Ok(Value::Object(annotated)) => annotated,
            other => panic!(
                "an annotated object is not a JSON object: {other:?}: {}",
                String::from_utf8_lossy(after)
            ),
        };
        assert!(annotated.contains_key("toolCallProgress"));
        for (key, value) in &annotated {
            match original.get(key) {
                Some(v) => assert_eq!(v, value, "`field` changed key {key:?}"),
                None => assert!(
                    matches!(key.as_str(), "toolCallProgress" | "toolCallsProgress"),
                    "`field` added key {key:?}"
                ),
            }
        }
        assert!(original.keys().all(|k| annotated.contains_key(k)));
    }
}

/// What `comment`, `event` and `chunk` add: whole lines after a line
/// break, each a `data:` line, an `event: toolCallProgress` line, a
/// `: toolCallProgress` comment or empty, with a JSON object where one is
/// due.
fn check_added_lines(input: &[u8], out: &Recorder) {
    for (at, bytes) in &out.inserted {
        assert!(
            *at > 0 && matches!(input[*at - 1], b'\r' | b'\n'),
            "added lines start after a line break"
        );
        let text = std::str::from_utf8(bytes).expect("insertions are UTF-8");
        assert!(
            text.ends_with(['\r', '\n']),
            "added lines end with a line break"
        );
        for line in text.split(['\r', '\n']).filter(|l| !l.is_empty()) {
            let json = if let Some(json) = line.strip_prefix("data: ") {
                json
            } else if let Some(json) = line.strip_prefix(": toolCallProgress ") {
                json
            } else {
                assert_eq!(line, "event: toolCallProgress");
                continue;
            };
            match serde_json::from_str::<Value>(json) {
                Ok(Value::Object(_)) => {}
                // `chunk` copies `id`, `model`… verbatim.
                Err(e) if javascript_accepts(&e) => {}
                other => panic!("added {json:?}: {other:?}"),
            }
        }
    }
}

/// `--format ndjson` and `messages`: every line a JSON object, the `done`
/// line(s) last.
fn check_lines_output(config: &AnnotatorConfig, out: &Recorder) {
    assert!(out.forwarded.is_empty(), "line formats forward nothing");
    let text = std::str::from_utf8(&out.output).expect("line output is UTF-8");
    assert!(text.ends_with('\n'), "a done line always ends the output");
    let mut done_lines = 0;
    for line in text.split_terminator('\n') {
        let value: Map<String, Value> = match serde_json::from_str(line) {
            Ok(value) => value,
            // An upstream's `error` value is copied as it came: it may
            // hold what JavaScript reads and serde_json does not.
            Err(e) if javascript_accepts(&e) && line.contains("\"error\":") => {
                assert_eq!(done_lines, 0, "a line after the done line(s): {line}");
                continue;
            }
            Err(e) => panic!("line {line:?} is not a JSON object: {e}"),
        };
        if config.output == OutputFormat::Messages {
            assert!(line.starts_with("{\"sessionId\":\"s1\","), "{line}");
        }
        if value.get("done") == Some(&Value::Bool(true)) {
            done_lines += 1;
        } else {
            assert_eq!(done_lines, 0, "a line after the done line(s): {line}");
        }
    }
    assert!(done_lines >= 1, "no done line");
    if config.output == OutputFormat::Messages {
        assert_eq!(done_lines, 1, "messages end with one done line");
    }
}

/// `annotate`: the whole pipeline ([`Annotator`]) on any bytes, in the
/// configuration and cutting the [`Plan`] picks ([`annotator_config`]).
///
/// - no panic;
/// - the output, the warnings and the subscribers' increments for the
///   plan's cutting are those for the whole input;
/// - with the same framing and size limit, `--inject none` gives the input;
/// - SSE output: the forwarded bytes are the input, and the output is the
///   input with the insertions at their places (removing them gives the
///   input); `field`: every annotated JSON object is the original plus
///   progress keys, and annotating the output again changes nothing;
///   `comment`/`event`/`chunk`: the added lines are well-formed;
/// - line formats: every line is a JSON object, done line(s) last.
pub fn annotate(data: &[u8]) {
    let plan = Plan::parse(data);
    let input = plan.stream;
    let config = annotator_config(plan.config);
    let pieces = plan.pieces();
    let whole = run_annotator(&config, &[input]);
    let cut = run_annotator(&config, &pieces);
    assert_eq!(cut, whole, "output depends on the cutting");

    let none = AnnotatorConfig {
        output: OutputFormat::Sse,
        inject: InjectMode::None,
        ..config.clone()
    };
    assert_eq!(
        run_annotator(&none, &pieces).output,
        input,
        "`--inject none` output != input"
    );

    match config.output {
        OutputFormat::Sse => {
            assert_eq!(whole.forwarded, input, "forwarded bytes != input");
            assert_eq!(whole.rebuilt(), whole.output);
            let framing = config
                .framing
                .or_else(|| Framing::sniff(input))
                .unwrap_or(Framing::Sse);
            // NDJSON input takes `field` whatever the mode asks.
            let field = config.inject == InjectMode::Field || framing == Framing::Ndjson;
            match config.inject {
                InjectMode::None => assert!(whole.inserted.is_empty()),
                _ if field => {
                    check_field_output(input, &whole.output, framing, config.max_event_bytes);
                    let again = run_annotator(&config, &[&whole.output]);
                    assert_eq!(
                        again.output, whole.output,
                        "annotating an annotated stream changed it"
                    );
                }
                InjectMode::Comment | InjectMode::Event | InjectMode::Chunk | InjectMode::Field => {
                    check_added_lines(input, &whole)
                }
            }
        }
        OutputFormat::Ndjson | OutputFormat::Messages => check_lines_output(&config, &whole),
    }
}

// === chunked_body ===

/// How decoding a chunked body ended.
#[derive(Debug, PartialEq)]
enum ChunkedEnd {
    /// `Piece::End`, with what the decoder left of the input: the bytes
    /// after the body (what the connection carries next), those still in
    /// the read buffer and those not fed yet.
    End { rest: Vec<u8> },
    /// The decoder refused the body.
    Error(WireError),
    /// The input ran out before the body's end.
    Incomplete,
}

/// What a [`Chunked`] decoder handed on for some pieces of a stream. The
/// data is joined: how it is split into `Data` pieces follows the reads.
#[derive(Debug, PartialEq)]
struct ChunkedRun {
    data: Vec<u8>,
    trailers: Vec<HeaderMap>,
    end: ChunkedEnd,
    /// Bytes of the input the decoder took (framing included).
    taken: usize,
}

/// Feeds `pieces` to one [`Chunked`] as the proxy's upstream connection
/// does: each piece appended to the read buffer, then `decode` until it
/// asks for more, starting on the empty buffer (all of a read can be the
/// response head). Checks on the way what holds for any cutting.
fn run_chunked(pieces: &[&[u8]]) -> ChunkedRun {
    let mut decoder = Chunked::new();
    let mut buf = BytesMut::new();
    let mut next = pieces.iter();
    let mut fed = 0;
    let mut data = Vec::new();
    let mut trailers = Vec::new();
    let end = loop {
        let piece = decoder.decode(&mut buf);
        assert!(
            trailers.is_empty() || matches!(piece, Ok(Some(Piece::End))),
            "trailers followed by {piece:?}, not End"
        );
        match piece {
            Ok(Some(Piece::Data(bytes))) => {
                assert!(!bytes.is_empty(), "an empty Data piece");
                data.extend_from_slice(&bytes);
            }
            Ok(Some(Piece::Trailers(map))) => trailers.push(map),
            Ok(Some(Piece::End)) => {
                assert!(decoder.is_done(), "End before the decoder is done");
                let left = buf.len();
                assert_eq!(
                    decoder.decode(&mut buf),
                    Ok(Some(Piece::End)),
                    "after End comes End again"
                );
                assert_eq!(buf.len(), left, "bytes taken after End");
                break ChunkedEnd::End { rest: buf.to_vec() };
            }
            Err(err) => break ChunkedEnd::Error(err),
            Ok(None) => {
                assert!(!decoder.is_done(), "asks for more bytes once done");
                match next.next() {
                    Some(piece) => {
                        buf.extend_from_slice(piece);
                        fed += piece.len();
                    }
                    None => break ChunkedEnd::Incomplete,
                }
            }
        }
    };
    let taken = fed - buf.len();
    // The data comes out of the chunks: never more than what was taken,
    // and less once the framing around it (at least the last chunk) is in.
    assert!(data.len() <= taken, "more data than bytes taken");
    let end = match end {
        ChunkedEnd::End { mut rest } => {
            assert!(data.len() < taken, "ended with no framing taken");
            for piece in next {
                rest.extend_from_slice(piece);
            }
            ChunkedEnd::End { rest }
        }
        ChunkedEnd::Error(err) => {
            let at = match &err {
                WireError::ChunkSize { at, .. }
                | WireError::ChunkEnd { at }
                | WireError::Trailers { at, .. } => *at,
                other => panic!("a head error from the body decoder: {other:?}"),
            };
            assert_eq!(
                at, taken as u64,
                "an error's `at` is not the bytes taken before it"
            );
            ChunkedEnd::Error(err)
        }
        ChunkedEnd::Incomplete => ChunkedEnd::Incomplete,
    };
    ChunkedRun {
        data,
        trailers,
        end,
        taken,
    }
}

/// Decodes `stream` whole and in `pieces` (the same bytes), asserts that
/// both give the same [`ChunkedRun`], and returns it.
fn check_chunked(stream: &[u8], pieces: &[&[u8]]) -> ChunkedRun {
    let whole = run_chunked(&[stream]);
    if let ChunkedEnd::End { rest } = &whole.end {
        assert_eq!(
            rest.as_slice(),
            &stream[whole.taken..],
            "what End left is not the input after the body"
        );
    }
    let cut = run_chunked(pieces);
    assert_eq!(cut, whole, "decoding depends on the cutting");
    whole
}

/// The largest chunk [`encode_chunked`] writes, by config bits 4–7.
const CHUNK_SIZES: [usize; 16] = [
    1,
    2,
    3,
    5,
    8,
    13,
    16,
    31,
    64,
    100,
    255,
    256,
    1000,
    4095,
    4096,
    usize::MAX,
];

/// What the oracle's bodies end with: the trailer section of config bit 3.
const ORACLE_TRAILER: (&str, &str) = ("x-trailer", "done");

/// What follows the oracle's bodies on the connection: the decoder must
/// leave it.
const NEXT_MESSAGE: &[u8] = b"HTTP/1.1 200 OK\r\n";

/// `payload` as an upstream sends it chunked, written here without the
/// decoder's code: a chunk ends at each of `cuts` (offsets in `payload`)
/// and after [`CHUNK_SIZES`]`[config >> 4]` bytes. Config bit 1 adds the
/// extension `;x=y` to every other size line and to the last chunk's,
/// bit 2 writes the sizes in upper case hex, bit 3 adds a trailer section
/// ([`ORACLE_TRAILER`]).
fn encode_chunked(payload: &[u8], config: u8, cuts: &[usize]) -> Vec<u8> {
    let max = CHUNK_SIZES[usize::from(config >> 4)];
    let extensions = config & 0b10 != 0;
    let upper = config & 0b100 != 0;
    let mut body = Vec::with_capacity(payload.len() + 64);
    let mut start = 0;
    let mut count = 0;
    for end in cuts.iter().copied().chain([payload.len()]) {
        while start < end {
            let len = (end - start).min(max);
            let size = if upper {
                format!("{len:X}")
            } else {
                format!("{len:x}")
            };
            body.extend_from_slice(size.as_bytes());
            if extensions && count % 2 == 1 {
                body.extend_from_slice(b";x=y");
            }
            body.extend_from_slice(b"\r\n");
            body.extend_from_slice(&payload[start..start + len]);
            body.extend_from_slice(b"\r\n");
            start += len;
            count += 1;
        }
    }
    body.extend_from_slice(if extensions { b"0;x=y\r\n" } else { b"0\r\n" });
    if config & 0b1000 != 0 {
        let (name, value) = ORACLE_TRAILER;
        body.extend_from_slice(format!("{name}: {value}\r\n").as_bytes());
    }
    body.extend_from_slice(b"\r\n");
    body
}

/// `chunked_body`: the HTTP/1.1 chunked-body decoder ([`Chunked`]) on the
/// bytes an upstream sends after a `transfer-encoding: chunked` head, fed
/// whole and in the plan's cutting.
///
/// - no panic;
/// - the data (joined), the trailer sections, how decoding ended (`End`
///   and what it left of the input, the same error with the same `at`, or
///   incomplete when the input ran out) and the bytes taken are the same
///   for the whole input and for the cutting: how reads split a body must
///   not change what the client gets;
/// - no `Data` piece is empty; the data is never more than the bytes
///   taken; an error's `at` is the number of bytes taken before it;
///   trailers come at most once, right before `End`; once done, `decode`
///   gives `End` again and takes nothing;
/// - at `End`, what is left is exactly the input after the body: the
///   decoder takes no byte of the next response.
///
/// Config byte: even, the stream is the body. Odd, the stream is a payload
/// that [`encode_chunked`] writes as a valid body (chunks ending at the
/// plan's cuts and after a size from bits 4–7; bits 1–3: extensions, upper
/// case hex, trailers), followed by [`NEXT_MESSAGE`], and cut where the
/// plan cuts, scaled to the body; decoding it gives exactly the payload,
/// the trailers, `End`, and leaves [`NEXT_MESSAGE`].
pub fn chunked_body(data: &[u8]) {
    let plan = Plan::parse(data);
    if plan.config & 1 == 0 {
        check_chunked(plan.stream, &plan.pieces());
        return;
    }
    let payload = plan.stream;
    let cuts: &[usize] = match &plan.cutting {
        Cutting::At(cuts) => cuts,
        Cutting::Bytewise => &[],
    };
    let mut stream = encode_chunked(payload, plan.config, cuts);
    stream.extend_from_slice(NEXT_MESSAGE);
    // The same cutting, over the encoded stream: each cut moved in
    // proportion (still sorted; duplicates removed).
    let cutting = match &plan.cutting {
        Cutting::At(cuts) => {
            let mut scaled: Vec<usize> = cuts
                .iter()
                .map(|&cut| cut * stream.len() / payload.len().max(1))
                .collect();
            scaled.dedup();
            Cutting::At(scaled)
        }
        Cutting::Bytewise => Cutting::Bytewise,
    };
    let encoded = Plan {
        config: plan.config,
        cutting,
        stream: &stream,
    };
    let run = check_chunked(&stream, &encoded.pieces());
    assert_eq!(run.data, payload, "the payload did not come back");
    let mut trailers = Vec::new();
    if plan.config & 0b1000 != 0 {
        let (name, value) = ORACLE_TRAILER;
        let mut map = HeaderMap::new();
        map.insert(name, HeaderValue::from_static(value));
        trailers.push(map);
    }
    assert_eq!(run.trailers, trailers, "the trailers did not come back");
    assert_eq!(
        run.end,
        ChunkedEnd::End {
            rest: NEXT_MESSAGE.to_vec()
        },
        "a valid body did not end right before the next message"
    );
}
