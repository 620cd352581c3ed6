//! Property tests of the two guarantees of `annotate` (issue 2, "Never lose
//! a byte"), on any input in any cutting:
//! 1. with `--inject none` the output is the input, byte for byte;
//! 2. with any other mode, removing what was inserted gives the input back
//!    (the bytes the pipeline forwards are exactly the input, in order).
//!
//! And: output never depends on how the input was cut; generated tool-call
//! streams give one progress per `tool_calls` entry with the JavaScript
//! length of the arguments, and `field` injection keeps every chunk valid
//! JSON.

mod common;
// The fuzz targets' checks: `javascript_accepts` is shared, so that the
// two never disagree on what JSON JavaScript reads and serde_json refuses.
#[path = "../fuzz/src/lib.rs"]
mod fuzz_checks;

use aalis_proxy::encode::{InjectMode, OutputFormat};
use aalis_proxy::framing::Framing;
use aalis_proxy::framing::ndjson::NdjsonDecoder;
use aalis_proxy::framing::sse::{SseBlockKind, SseDecoder};
use aalis_proxy::pipeline::{Annotator, AnnotatorConfig};
use aalis_proxy::progress::{ProgressEntry, StreamPhase, ToolCall};
use common::*;
use fuzz_checks::javascript_accepts;
use proptest::prelude::*;
use serde_json::{Value, json};

fn check_guarantees(input: &[u8], cuts: &[usize]) -> Result<(), TestCaseError> {
    for (mode, config) in all_configs() {
        let whole = run_whole(&config, input);
        let cut = run_cut_at(&config, input, cuts);
        prop_assert_eq!(&cut, &whole, "[{}] output depends on the cutting", mode);
        // Byte by byte, every frame is framed from the carry, where the
        // framer never asks the decoder's probe: what it recognizes in a
        // whole piece must change nothing.
        let bytewise = run_bytewise(&config, input);
        prop_assert_eq!(&bytewise, &whole, "[{}] byte by byte", mode);
        if config.output == OutputFormat::Sse {
            prop_assert_eq!(
                &whole.forwarded,
                &input.to_vec(),
                "[{}] forwarded != input",
                mode
            );
        }
        if config.inject == InjectMode::None && config.output == OutputFormat::Sse {
            prop_assert_eq!(&whole.output, &input.to_vec(), "[none] output != input");
        }
        // NDJSON input takes `field` whatever the mode asks.
        if Framing::sniff(input) != Some(Framing::Ndjson) {
            check_injected_json(&whole, config.inject)?;
        }
    }
    Ok(())
}

/// Whatever `comment`, `event` and `chunk` add is well-formed: each added
/// line is a `data:` line, an `event: toolCallProgress` line, a
/// `: toolCallProgress` comment or empty, and the JSON in it parses (with
/// serde_json, not with the crate's own decoders) — but for what `chunk`
/// copies from the input that only JavaScript parses.
fn check_injected_json(run: &Run, mode: InjectMode) -> Result<(), TestCaseError> {
    if !matches!(
        mode,
        InjectMode::Comment | InjectMode::Event | InjectMode::Chunk
    ) {
        return Ok(());
    }
    for (_, bytes) in &run.inserted {
        let text = String::from_utf8(bytes.clone()).expect("injections are UTF-8");
        for line in text.split(['\r', '\n']).filter(|l| !l.is_empty()) {
            let json = if let Some(json) = line.strip_prefix("data: ") {
                json
            } else if let Some(json) = line.strip_prefix(": toolCallProgress ") {
                json
            } else {
                prop_assert_eq!(line, "event: toolCallProgress");
                continue;
            };
            match serde_json::from_str::<Value>(json) {
                Ok(value) => prop_assert!(value.is_object(), "injected {}", json),
                // `chunk` copies `id`, `object`, `created` and `model`
                // verbatim (SPEC.md), so it carries what the input's frame
                // held: JSON that JavaScript parses and serde_json refuses.
                Err(e) if mode == InjectMode::Chunk && javascript_accepts(&e) => {}
                Err(e) => return Err(TestCaseError::fail(format!("injected {json:?}: {e}"))),
            }
        }
    }
    Ok(())
}

/// Bytes that look like SSE or NDJSON often enough to reach the decoders.
fn streamish_bytes() -> impl Strategy<Value = Vec<u8>> {
    let token = prop_oneof![
        Just(b"data: ".to_vec()),
        Just(b"data:".to_vec()),
        Just(b"\n".to_vec()),
        Just(b"\r\n".to_vec()),
        Just(b"\r".to_vec()),
        Just(b": c\n".to_vec()),
        Just(b"event: x\n".to_vec()),
        Just(b"[DONE]".to_vec()),
        Just(b"\xEF\xBB\xBF".to_vec()),
        Just(br#"{"choices":[{"delta":{"tool_calls":[{"index":0,"function":{"name":"f","arguments":"{\"a"}}]}}]}"#.to_vec()),
        Just(br#"{"choices":[{"index":1,"delta":{"content":"hi","tool_calls":[{"id":"x","function":{"arguments":{"k":1.5}}}]}}]}"#.to_vec()),
        Just(br#"{"message":{"thinking":"t","tool_calls":[{"function":{"name":"g","arguments":{"b":[1e21]}}}]},"done":false}"#.to_vec()),
        Just(br#"{"error":{"message":"boom"}}"#.to_vec()),
        Just(b"}".to_vec()),
        Just(b"{".to_vec()),
        proptest::collection::vec(any::<u8>(), 0..8),
    ];
    proptest::collection::vec(token, 0..40).prop_map(|t| t.concat())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn arbitrary_bytes_are_never_lost(
        input in proptest::collection::vec(any::<u8>(), 0..600),
        cuts in proptest::collection::vec(any::<usize>(), 0..6),
    ) {
        check_guarantees(&input, &cuts)?;
    }

    #[test]
    fn stream_like_bytes_are_never_lost(
        input in streamish_bytes(),
        cuts in proptest::collection::vec(any::<usize>(), 0..6),
    ) {
        check_guarantees(&input, &cuts)?;
    }

    #[test]
    fn mutated_fixtures_are_never_lost(
        which in any::<usize>(),
        edits in proptest::collection::vec((any::<usize>(), any::<u8>(), 0u8..3), 1..6),
        cuts in proptest::collection::vec(any::<usize>(), 0..6),
    ) {
        let fixtures = fixtures();
        let mut input = fixtures[which % fixtures.len()].1.clone();
        for (pos, byte, op) in edits {
            let pos = pos % (input.len() + 1);
            match op {
                0 => input.insert(pos, byte),
                1 if pos < input.len() => { input.remove(pos); }
                _ if pos < input.len() => input[pos] = byte,
                _ => {}
            }
        }
        check_guarantees(&input, &cuts)?;
    }
}

/// One generated tool-call delta entry: which call, and the fragment.
#[derive(Debug, Clone)]
struct Entry {
    index: u32,
    fragment: String,
}

/// Fragments with the characters that make counting hard: escapes,
/// non-ASCII, astral characters, control characters.
fn fragment() -> impl Strategy<Value = String> {
    proptest::collection::vec(
        prop_oneof![
            Just("{".to_string()),
            Just("\"key\":".to_string()),
            Just("\\".to_string()),
            Just("\"".to_string()),
            Just("\n".to_string()),
            Just("é".to_string()),
            Just("東京".to_string()),
            Just("😀".to_string()),
            Just("\u{1}".to_string()),
            "[a-z0-9 ]{0,6}",
        ],
        0..5,
    )
    .prop_map(|parts| parts.concat())
}

fn line_ending() -> impl Strategy<Value = &'static str> {
    prop_oneof![Just("\n"), Just("\r\n"), Just("\r")]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 128, ..ProptestConfig::default() })]

    #[test]
    fn generated_streams_count_like_javascript(
        names in proptest::collection::vec("[a-z_]{1,8}|名前|😀x", 1..4),
        entries in proptest::collection::vec((0u32..4, fragment()), 1..20),
        eol in line_ending(),
        cuts in proptest::collection::vec(any::<usize>(), 0..6),
    ) {
        let entries: Vec<Entry> = entries
            .into_iter()
            .map(|(i, fragment)| Entry { index: i % names.len() as u32, fragment })
            .collect();
        // Announce every call first (id and name), then stream fragments.
        let mut stream = String::new();
        let mut event = |chunk: Value| {
            stream.push_str("data: ");
            stream.push_str(&chunk.to_string());
            stream.push_str(eol);
            stream.push_str(eol);
        };
        for (i, name) in names.iter().enumerate() {
            event(json!({"id":"c","choices":[{"index":0,"delta":{"tool_calls":[
                {"index":i,"id":format!("call_{i}"),"type":"function","function":{"name":name,"arguments":""}}]}}]}));
        }
        for e in &entries {
            event(json!({"id":"c","choices":[{"index":0,"delta":{"tool_calls":[
                {"index":e.index,"function":{"arguments":e.fragment}}]}}]}));
        }
        stream.push_str("data: [DONE]");
        stream.push_str(eol);
        stream.push_str(eol);
        let input = stream.into_bytes();

        // --format ndjson: one progress per entry, JavaScript lengths.
        let ndjson = AnnotatorConfig { output: OutputFormat::Ndjson, ..AnnotatorConfig::default() };
        let run = run_cut_at(&ndjson, &input, &cuts);
        let lines: Vec<Value> = String::from_utf8(run.output.clone())
            .expect("ndjson output is UTF-8")
            .lines()
            .map(|l| serde_json::from_str(l).expect("every line is JSON"))
            .collect();
        let progress: Vec<&Value> = lines.iter().filter_map(|l| l.get("toolCallProgress")).collect();
        prop_assert_eq!(progress.len(), names.len() + entries.len());
        let mut expected_args = vec![String::new(); names.len()];
        for (k, e) in entries.iter().enumerate() {
            expected_args[e.index as usize].push_str(&e.fragment);
            let p = progress[names.len() + k];
            prop_assert_eq!(p["index"].as_u64(), Some(u64::from(e.index)));
            prop_assert_eq!(p["name"].as_str(), Some(names[e.index as usize].as_str()));
            prop_assert_eq!(
                p["charsAccumulated"].as_u64(),
                // JavaScript's String.length, counted here by the standard
                // library rather than by the crate's own `utf16_len`.
                Some(expected_args[e.index as usize].encode_utf16().count() as u64)
            );
        }
        let done = lines.last().expect("a done line");
        let calls = done["toolCalls"].as_array().expect("toolCalls");
        for (i, call) in calls.iter().enumerate() {
            prop_assert_eq!(call["function"]["arguments"].as_str(), Some(expected_args[i].as_str()));
        }

        // --inject field: forwarded bytes are the input; every annotated
        // event is valid JSON with the last progress of its entries.
        let field = AnnotatorConfig::default();
        let run = run_cut_at(&field, &input, &cuts);
        prop_assert_eq!(&run.forwarded, &input);
        let mut decoder = SseDecoder::new();
        decoder.push(&run.output);
        decoder.finish();
        let mut annotated = 0;
        while let Some(block) = decoder.next_block() {
            if let SseBlockKind::Event(e) = block.kind
                && e.data != b"[DONE]"
            {
                let v: Value = serde_json::from_slice(e.data).expect("annotated event is JSON");
                prop_assert!(v["toolCallProgress"]["charsAccumulated"].is_u64());
                annotated += 1;
            }
        }
        prop_assert_eq!(annotated, names.len() + entries.len());
    }
}

/// One generated Ollama line: text (content, thinking, either, neither;
/// with or without the `thinking` key), a call, the last line, an error,
/// a line that is not JSON.
fn ollama_line() -> impl Strategy<Value = String> {
    let text = prop_oneof![Just(String::new()), fragment()];
    prop_oneof![
        6 => (text.clone(), text.clone(), 0u32..100).prop_map(|(content, thinking, ms)| json!({
            "model": "m", "created_at": format!("2026-01-01T00:00:00.{ms:03}Z"),
            "message": {"role": "assistant", "content": content, "thinking": thinking},
            "done": false,
        }).to_string()),
        3 => (text, 0u32..100).prop_map(|(content, ms)| json!({
            "model": "m", "created_at": format!("2026-01-01T00:00:00.{ms:03}Z"),
            "message": {"role": "assistant", "content": content},
            "done": false,
        }).to_string()),
        1 => Just(r#"{"model":"m","message":{"role":"assistant","content":"","tool_calls":[{"function":{"name":"f","arguments":{"a":1}}}]},"done":false}"#.to_string()),
        1 => Just(r#"{"model":"m","message":{"role":"assistant","content":""},"done":true,"done_reason":"stop","eval_count":3}"#.to_string()),
        1 => Just(r#"{"error":"boom"}"#.to_string()),
        1 => Just(r#"{"model":"m","message":{"role":"assistant","content":"x"},"done":false,"toolCallProgress":{}}"#.to_string()),
        1 => Just("not json".to_string()),
    ]
}

/// One generated OpenAI chunk (the `data` of an SSE event): text,
/// reasoning (under either key), the role chunk, a call announced or
/// streamed, a finish, usage, two choices, an error, `[DONE]`, a value
/// that is not JSON.
fn openai_data() -> impl Strategy<Value = String> {
    let text = prop_oneof![Just(String::new()), fragment()];
    let delta = |delta: Value| {
        json!({"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "m",
               "choices": [{"index": 0, "delta": delta, "finish_reason": null}]})
        .to_string()
    };
    prop_oneof![
        6 => text.clone().prop_map(move |t| delta(json!({"content": t}))),
        2 => text.clone().prop_map(move |t| delta(json!({"reasoning_content": t}))),
        1 => text.clone().prop_map(move |t| delta(json!({"reasoning": t}))),
        1 => (text.clone(), text.clone()).prop_map(move |(r, c)| delta(json!({"reasoning_content": r, "content": c}))),
        1 => (text.clone(), text).prop_map(move |(r, c)| delta(json!({"reasoning": r, "content": c}))),
        1 => Just(delta(json!({"role": "assistant", "content": ""}))),
        1 => Just(delta(json!({"tool_calls": [{"index": 0, "id": "call_0", "type": "function",
                                               "function": {"name": "f", "arguments": ""}}]}))),
        2 => fragment().prop_map(move |f| delta(json!({"tool_calls": [{"index": 0, "function": {"arguments": f}}]}))),
        // A second call, streamed in turns with the first; and deltas
        // with no index, which go to the call touched last.
        1 => Just(delta(json!({"tool_calls": [{"index": 1, "id": "call_1", "type": "function",
                                               "function": {"name": "g", "arguments": ""}}]}))),
        1 => fragment().prop_map(move |f| delta(json!({"tool_calls": [{"index": 1, "function": {"arguments": f}}]}))),
        1 => fragment().prop_map(move |f| delta(json!({"tool_calls": [{"function": {"arguments": f}}]}))),
        1 => Just(r#"{"id":"c","choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}"#.to_string()),
        1 => Just(r#"{"id":"c","choices":[],"usage":{"prompt_tokens":1,"completion_tokens":2,"total_tokens":3}}"#.to_string()),
        1 => Just(r#"{"id":"c","choices":[{"index":0,"delta":{"content":"a"}},{"index":1,"delta":{"content":"b"}}]}"#.to_string()),
        1 => Just(r#"{"error":{"message":"boom"}}"#.to_string()),
        1 => Just("[DONE]".to_string()),
        1 => Just("not json".to_string()),
    ]
}

/// The `data` of a tool call announced, then streamed in 1 to 19 deltas
/// of one shape (the decoder's steady shape, so that runs of them form):
/// of choice 0 or 1, call 0 to 2, every delta with the call's index or
/// none with it.
fn call_block() -> impl Strategy<Value = Vec<String>> {
    (
        0i64..2,
        0i64..3,
        any::<bool>(),
        proptest::collection::vec(fragment(), 1..20),
    )
        .prop_map(|(choice, index, indexed, fragments)| {
            let chunk = |delta: Value| {
                json!({"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "m",
                       "choices": [{"index": choice, "delta": delta, "finish_reason": null}]})
                .to_string()
            };
            let announce = json!({"tool_calls": [{"index": index, "id": format!("call_{index}"),
                "type": "function", "function": {"name": format!("f{index}"), "arguments": ""}}]});
            let mut data = vec![chunk(announce)];
            data.extend(fragments.into_iter().map(|f| {
                let call = if indexed {
                    json!({"index": index, "function": {"arguments": f}})
                } else {
                    json!({"function": {"arguments": f}})
                };
                chunk(json!({ "tool_calls": [call] }))
            }));
            data
        })
}

/// After each piece: the tracker's phase and change count, its calls
/// (their names, states and character counts among them) and the calls in
/// progress (with the time each started), and the frames handled and
/// recognized so far. And the output, and the warnings as they read.
type Traced = (Vec<TracedState>, Vec<u8>, Vec<String>);
type TracedState = (CallsState, u64, u64);
type CallsState = (
    StreamPhase,
    u64,
    Vec<(i64, Vec<ToolCall>)>,
    Vec<ProgressEntry>,
);

/// The tracker's phase, change count, calls and calls in progress.
fn calls_state(a: &Annotator) -> CallsState {
    let (phase, changes) = tracker_state(a);
    let calls = a
        .tracker()
        .calls()
        .map(|(choice, calls)| (choice, calls.to_vec()))
        .collect();
    let mut in_progress = Vec::new();
    a.tracker().snapshot_into(&mut in_progress);
    (phase, changes, calls, in_progress)
}

/// The clock as piece `i` is read: a second later than the piece before,
/// so that a call's start says which piece started it.
fn now_at(i: usize) -> u64 {
    NOW_MS + 1000 * i as u64
}

fn traced(config: &AnnotatorConfig, pieces: &[String]) -> Traced {
    let mut annotator = Annotator::new(config.clone());
    let mut out = Vec::new();
    let mut trace = Vec::new();
    let state = |a: &Annotator| (calls_state(a), a.frames(), a.probed_frames());
    for (i, piece) in pieces.iter().enumerate() {
        annotator.push(piece.as_bytes(), now_at(i), &mut out);
        trace.push(state(&annotator));
    }
    annotator.finish(now_at(pieces.len()), &mut out);
    trace.push(state(&annotator));
    let warnings = annotator
        .take_warnings()
        .iter()
        .map(ToString::to_string)
        .collect();
    (trace, out, warnings)
}

/// Consecutive frames joined into pieces of `per_piece` frames each.
fn grouped(frames: &[String], per_piece: usize) -> Vec<String> {
    frames
        .chunks(per_piece)
        .map(|group| group.concat())
        .collect()
}

/// The frames joined, then cut where `cuts` say (anywhere, frames
/// included; at the character boundary at or before each).
fn cut_anywhere(frames: &[String], cuts: &[prop::sample::Index]) -> Vec<String> {
    let all = frames.concat();
    let mut at: Vec<usize> = cuts
        .iter()
        .map(|i| {
            let mut at = i.index(all.len() + 1);
            while !all.is_char_boundary(at) {
                at -= 1;
            }
            at
        })
        .collect();
    at.push(all.len());
    at.sort_unstable();
    at.dedup();
    let mut from = 0;
    at.into_iter()
        .map(|to| {
            let piece = all[from..to].to_string();
            from = to;
            piece
        })
        .collect()
}

/// [`check_frames_taken`] on `frames` fed one a piece, `per_piece` a
/// piece, and cut where `cuts` say.
fn check_frames_taken_cut_three_ways(
    frames: &[String],
    per_piece: usize,
    cuts: &[prop::sample::Index],
) -> Result<(), TestCaseError> {
    check_frames_taken(frames)?;
    check_frames_taken(&grouped(frames, per_piece))?;
    check_frames_taken(&cut_anywhere(frames, cuts))
}

/// A recognized frame of text, or of one tool call's arguments, is
/// handled without its chunks (`StreamState::pass`) only when nothing but
/// the tracker reads them (for a call: no progress injected): fed one frame
/// a piece (so that every frame the template knows is recognized), a few
/// frames a piece (so that frames of text or of a call's arguments go out
/// in runs), or cut
/// anywhere (so that runs end where a piece ends, and go on after a frame
/// carried over), the tracker goes through the same states, piece by
/// piece, as when the proxy's event log reads every chunk (which takes
/// the decoder's path); the frames are counted and recognized the same,
/// and the output and the warnings (which say where, by line or event
/// and byte) are the same.
fn check_frames_taken(pieces: &[String]) -> Result<(), TestCaseError> {
    for inject in [InjectMode::None, InjectMode::Field, InjectMode::Comment] {
        let quick = AnnotatorConfig {
            inject,
            ..AnnotatorConfig::default()
        };
        let decoded = AnnotatorConfig {
            collect_events: true,
            ..quick.clone()
        };
        prop_assert_eq!(
            traced(&quick, pieces),
            traced(&decoded, pieces),
            "{:?}",
            inject
        );
    }
    Ok(())
}

/// `serve` collects a stream's increments only while someone listens to
/// its session, turning collection on and off between reads
/// ([`Annotator::collect_events`]). Fed the same pieces, an annotator whose
/// collection is turned on and off (`collect[i]` for piece `i`) goes
/// through the same tracker states and writes the same output as one that
/// always collects; for a piece read while collecting it collects the
/// same increments, for another none, and says it missed them.
fn check_collect_toggles(pieces: &[String], collect: &[bool]) -> Result<(), TestCaseError> {
    for inject in [InjectMode::None, InjectMode::Field] {
        let config = AnnotatorConfig {
            inject,
            collect_events: true,
            ..AnnotatorConfig::default()
        };
        let mut always = Annotator::new(config.clone());
        let mut toggled = Annotator::new(config);
        let (mut always_out, mut toggled_out) = (Vec::new(), Vec::new());
        let on = |i: usize| collect[i % collect.len()];
        for (i, piece) in pieces.iter().enumerate() {
            toggled.collect_events(on(i));
            always.push(piece.as_bytes(), now_at(i), &mut always_out);
            toggled.push(piece.as_bytes(), now_at(i), &mut toggled_out);
            prop_assert_eq!(calls_state(&always), calls_state(&toggled), "piece {}", i);
            prop_assert_eq!(toggled.events_missed(), !on(i), "piece {}", i);
            prop_assert!(!always.events_missed());
            let mut expected = always.take_events();
            if !on(i) {
                expected.clear();
            }
            prop_assert_eq!(toggled.take_events(), expected, "piece {}", i);
            prop_assert!(!toggled.events_missed(), "taken: nothing missed since");
        }
        toggled.collect_events(true);
        always.finish(now_at(pieces.len()), &mut always_out);
        toggled.finish(now_at(pieces.len()), &mut toggled_out);
        prop_assert_eq!(calls_state(&always), calls_state(&toggled));
        prop_assert_eq!(toggled.take_events(), always.take_events(), "the end's");
        prop_assert_eq!(&toggled_out, &always_out, "{:?}", inject);
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn collecting_increments_on_and_off_changes_nothing_else(
        data in proptest::collection::vec(openai_data(), 1..30),
        lines in proptest::collection::vec(ollama_line(), 1..30),
        collect in proptest::collection::vec(any::<bool>(), 1..8),
    ) {
        check_collect_toggles(&data.iter().map(|d| format!("data: {d}\n\n")).collect::<Vec<_>>(), &collect)?;
        check_collect_toggles(&lines.iter().map(|l| format!("{l}\n")).collect::<Vec<_>>(), &collect)?;
    }

    #[test]
    fn ollama_lines_taken_without_chunks_change_what_chunks_change(
        lines in proptest::collection::vec(ollama_line(), 1..30),
        crlf in any::<bool>(),
        per_piece in 1usize..8,
        cuts in proptest::collection::vec(any::<prop::sample::Index>(), 0..6),
    ) {
        let eol = if crlf { "\r\n" } else { "\n" };
        let lines: Vec<String> = lines.iter().map(|l| format!("{l}{eol}")).collect();
        check_frames_taken_cut_three_ways(&lines, per_piece, &cuts)?;
    }

    #[test]
    fn openai_call_deltas_taken_without_chunks_change_what_chunks_change(
        blocks in proptest::collection::vec(call_block(), 1..5),
        crlf in any::<bool>(),
        per_piece in 1usize..8,
        cuts in proptest::collection::vec(any::<prop::sample::Index>(), 0..6),
    ) {
        let eol = if crlf { "\r\n" } else { "\n" };
        let events: Vec<String> =
            blocks.concat().iter().map(|d| format!("data: {d}{eol}{eol}")).collect();
        check_frames_taken_cut_three_ways(&events, per_piece, &cuts)?;
    }

    #[test]
    fn openai_events_taken_without_chunks_change_what_chunks_change(
        data in proptest::collection::vec(openai_data(), 1..30),
        crlf in any::<bool>(),
        per_piece in 1usize..8,
        cuts in proptest::collection::vec(any::<prop::sample::Index>(), 0..6),
    ) {
        let eol = if crlf { "\r\n" } else { "\n" };
        let events: Vec<String> = data.iter().map(|d| format!("data: {d}{eol}{eol}")).collect();
        check_frames_taken_cut_three_ways(&events, per_piece, &cuts)?;
    }
}

/// Bytes with long lines (to make a carried frame outgrow the first step of
/// [`SseDecoder::feed`]), multi-byte characters (cut anywhere), invalid
/// UTF-8, and every line break.
fn long_streamish_bytes() -> impl Strategy<Value = Vec<u8>> {
    let token = prop_oneof![
        Just(b"data: ".to_vec()),
        Just(b"\n".to_vec()),
        Just(b"\r\n".to_vec()),
        Just(b"\r".to_vec()),
        Just(b"\n\n".to_vec()),
        Just(b": c\n".to_vec()),
        Just(b"id: 7\n".to_vec()),
        Just("é😀世".as_bytes().to_vec()),
        Just(b"\xFF".to_vec()),
        Just(br#"{"message":{"content":"hi"},"done":false}"#.to_vec()),
        (1usize..12_000).prop_map(|n| vec![b'x'; n]),
    ];
    proptest::collection::vec(token, 0..24).prop_map(|t| t.concat())
}

/// What a decoder hands out, as far as it does not depend on where the
/// input was cut: every frame's raw bytes in order, and each dispatched
/// event or parsed line. A frame whose `text` is set must have that text
/// as its data.
#[derive(Debug, Default, PartialEq)]
struct Framed {
    raw: Vec<u8>,
    frames: Vec<String>,
}

fn sse_framed(max: usize, pieces: &[&[u8]], in_place: bool) -> Result<Framed, TestCaseError> {
    let mut decoder = SseDecoder::with_max_event_bytes(max);
    let mut seen = Framed::default();
    let mut bad_text = None;
    let mut each = |block: aalis_proxy::framing::sse::SseBlock<'_>| {
        seen.raw.extend_from_slice(block.raw);
        if let SseBlockKind::Event(e) = block.kind {
            if let Some(text) = e.text
                && text.as_bytes() != e.data
            {
                bad_text = Some(format!("{text:?} for {:?}", e.data));
            }
            seen.frames.push(format!(
                "{} {:?} {:?} {:?}",
                e.number, e.data, e.event_type, e.last_event_id
            ));
        }
    };
    for piece in pieces {
        if in_place {
            decoder.feed(piece, &mut each);
        } else {
            decoder.push(piece);
            while let Some(block) = decoder.next_block() {
                each(block);
            }
        }
    }
    decoder.finish();
    if in_place {
        decoder.feed(&[], &mut each);
    } else {
        while let Some(block) = decoder.next_block() {
            each(block);
        }
    }
    prop_assert!(bad_text.is_none(), "{:?}", bad_text);
    Ok(seen)
}

fn ndjson_framed(max: usize, pieces: &[&[u8]], in_place: bool) -> Result<Framed, TestCaseError> {
    let mut decoder = NdjsonDecoder::with_max_line_bytes(max);
    let mut seen = Framed::default();
    let mut bad_text = None;
    let mut each = |line: aalis_proxy::framing::ndjson::NdjsonLine<'_>| {
        seen.raw.extend_from_slice(line.raw);
        if let Some(text) = line.text
            && text.as_bytes() != line.content
        {
            bad_text = Some(format!("{text:?} for {:?}", line.content));
        }
        if line.oversized.is_none() {
            seen.frames.push(format!(
                "{} {} {:?}",
                line.number, line.offset, line.content
            ));
        }
    };
    for piece in pieces {
        if in_place {
            decoder.feed(piece, &mut each);
        } else {
            decoder.push(piece);
            while let Some(line) = decoder.next_line() {
                each(line);
            }
        }
    }
    decoder.finish();
    if in_place {
        decoder.feed(&[], &mut each);
    } else {
        while let Some(line) = decoder.next_line() {
            each(line);
        }
    }
    prop_assert!(bad_text.is_none(), "{:?}", bad_text);
    Ok(seen)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    /// Framing in place (`feed`, which keeps only a cut frame) hands out
    /// the bytes and the events of framing a copy (`push`), however the
    /// input is cut, with and without an event size limit; the text it
    /// checked in bulk is the frame's data.
    #[test]
    fn framing_in_place_is_framing_a_copy(
        input in long_streamish_bytes(),
        cuts in proptest::collection::vec(any::<usize>(), 0..8),
        small_limit in any::<bool>(),
    ) {
        let max = if small_limit { 9_000 } else { 1 << 20 };
        let pieces = cut_at(&input, &cuts);
        let whole = sse_framed(max, &[&input], false)?;
        prop_assert_eq!(&whole.raw, &input);
        prop_assert_eq!(&sse_framed(max, &pieces, true)?, &whole);
        prop_assert_eq!(&sse_framed(max, &pieces, false)?, &whole);
        let whole = ndjson_framed(max, &[&input], false)?;
        prop_assert_eq!(&whole.raw, &input);
        prop_assert_eq!(&ndjson_framed(max, &pieces, true)?, &whole);
    }
}

/// JSON text in the spellings that decide whether `JSON.stringify` prints
/// it back unchanged: numbers with and without exponents, trailing zeros
/// and long digit runs; strings with every kind of escape; keys that repeat
/// or are array indices; some whitespace.
fn json_text() -> impl Strategy<Value = String> {
    let number = prop_oneof![
        "-?(0|[1-9][0-9]{0,17})(\\.[0-9]{1,17})?([eE][+-]?[0-9]{1,3})?",
        Just("-0".to_string()),
        Just("0.000001".to_string()),
        Just("0.0000001".to_string()),
        Just("1e21".to_string()),
    ];
    let string = proptest::collection::vec(
        prop_oneof![
            "[a-z0-9 /]{0,4}",
            Just("é東😀\u{7f}".to_string()),
            Just("\\\"".to_string()),
            Just("\\\\".to_string()),
            Just("\\/".to_string()),
            Just("\\n\\r\\t\\b\\f".to_string()),
            Just("\\u0001".to_string()),
            Just("\\u001f".to_string()),
            Just("\\u001F".to_string()),
            Just("\\u000a".to_string()),
            Just("\\u0041".to_string()),
            Just("\\u00e9".to_string()),
            Just("\\ud83d\\ude00".to_string()),
        ],
        0..4,
    )
    .prop_map(|parts| format!("\"{}\"", parts.concat()));
    let key = prop_oneof![
        Just("\"a\"".to_string()),
        Just("\"b\"".to_string()),
        Just("\"0\"".to_string()),
        Just("\"01\"".to_string()),
        Just("\"\"".to_string()),
        string.clone(),
    ];
    let space = prop_oneof![8 => Just(""), 1 => Just(" "), 1 => Just("\n")];
    let leaf = prop_oneof![
        number,
        string,
        Just("true".to_string()),
        Just("false".to_string()),
        Just("null".to_string()),
    ];
    leaf.prop_recursive(4, 48, 6, move |inner| {
        prop_oneof![
            proptest::collection::vec(inner.clone(), 0..6)
                .prop_map(|items| format!("[{}]", items.join(","))),
            proptest::collection::vec((key.clone(), space.clone(), inner), 0..6).prop_map(
                |members| {
                    let members: Vec<String> = members
                        .into_iter()
                        .map(|(k, s, v)| format!("{k}:{s}{v}"))
                        .collect();
                    format!("{{{}}}", members.join(","))
                }
            ),
        ]
    })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2048, ..ProptestConfig::default() })]

    /// What `stringifies_to_itself` recognizes is exactly what
    /// `JSON.stringify` prints: the length the decoders take from the text
    /// as it came is the length JavaScript would count.
    #[test]
    fn recognized_json_is_what_stringify_prints(json in json_text()) {
        if let Ok(value) = serde_json::from_str::<Value>(&json)
            && aalis_proxy::js::stringifies_to_itself(&json)
        {
            prop_assert_eq!(aalis_proxy::js::stringify_to_string(&value), json);
        }
    }
}
