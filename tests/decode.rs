//! The pipeline on every fixture: snapshots per output format, chunking
//! invariance, the never-lose-a-byte guarantee, and agreement with the
//! independent JavaScript oracle (`fixtures/oracle.mjs` →
//! `fixtures/expected.json`).

mod common;

use std::collections::BTreeMap;

use aalis_proxy::encode::{InjectMode, OutputFormat};
use aalis_proxy::framing::sse::{SseBlockKind, SseDecoder};
use aalis_proxy::pipeline::AnnotatorConfig;
use common::*;
use serde_json::Value;

fn config(output: OutputFormat, inject: InjectMode) -> AnnotatorConfig {
    AnnotatorConfig {
        output,
        inject,
        session_id: Some("s1".into()),
        ..AnnotatorConfig::default()
    }
}

/// A run as a person reads it: for the passthrough, only what was inserted
/// and where (the rest is the input, asserted separately); for line formats,
/// the lines; then the warnings.
fn render(run: &Run, passthrough: bool) -> String {
    let mut out = String::new();
    if passthrough {
        for (at, bytes) in &run.inserted {
            // Line breaks shown as escapes, so CRLF is visible.
            let text = String::from_utf8_lossy(bytes)
                .replace('\r', "\\r")
                .replace('\n', "\\n");
            out.push_str(&format!("@{at} +{text}\n"));
        }
    } else {
        out.push_str(&String::from_utf8_lossy(&run.output));
    }
    if !run.warnings.is_empty() {
        out.push_str("--- stderr\n");
        for w in &run.warnings {
            out.push_str(w);
            out.push('\n');
        }
    }
    out
}

#[test]
fn fixture_snapshots() {
    insta::glob!("../fixtures", "**/*.{sse,ndjson}", |path| {
        let input = std::fs::read(path).expect("read fixture");
        let sse = run_whole(&config(OutputFormat::Sse, InjectMode::Field), &input);
        insta::assert_snapshot!("sse_field", render(&sse, true));
        let ndjson = run_whole(&config(OutputFormat::Ndjson, InjectMode::Field), &input);
        insta::assert_snapshot!("ndjson", render(&ndjson, false));
        let messages = run_whole(&config(OutputFormat::Messages, InjectMode::Field), &input);
        insta::assert_snapshot!("messages", render(&messages, false));
    });
}

/// The other inject modes, whole output, on fixtures that exercise them:
/// several calls in one delta, CRLF line endings, and a usage chunk (where
/// `chunk` must not inject after the finish or usage chunk).
#[test]
fn inject_mode_snapshots() {
    for fixture in [
        "openai/several_calls_one_delta.sse",
        "malformed/crlf_line_endings.sse",
        "openai/n2_choices.sse",
    ] {
        let input = std::fs::read(fixtures_dir().join(fixture)).expect("read fixture");
        for (name, mode) in [
            ("comment", InjectMode::Comment),
            ("event", InjectMode::Event),
            ("chunk", InjectMode::Chunk),
        ] {
            let run = run_whole(&config(OutputFormat::Sse, mode), &input);
            let snapshot = format!("{}__{name}", fixture.replace(['/', '.'], "_"));
            insta::assert_snapshot!(snapshot, render(&run, true));
        }
    }
}

/// A small deterministic generator for cut points (no dependency needed).
struct XorShift(u64);

impl XorShift {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
}

#[test]
fn output_does_not_depend_on_how_input_is_cut() {
    let mut rng = XorShift(0x9E37_79B9_7F4A_7C15);
    for (name, input) in fixtures() {
        for (mode, config) in all_configs() {
            let whole = run_whole(&config, &input);
            assert!(!whole.output.is_empty(), "{name} [{mode}] wrote nothing");
            assert_eq!(
                run_bytewise(&config, &input),
                whole,
                "{name} [{mode}] byte by byte"
            );
            assert_eq!(
                run_split_at_line_breaks(&config, &input),
                whole,
                "{name} [{mode}] split at every CR and LF"
            );
            for _ in 0..20 {
                let n = (rng.next() % 8) as usize;
                let cuts: Vec<usize> = (0..n).map(|_| rng.next() as usize).collect();
                assert!(
                    run_cut_at(&config, &input, &cuts) == whole,
                    "{name} [{mode}] cut at {cuts:?}"
                );
            }
        }
    }
}

#[test]
fn every_input_byte_is_forwarded_once_in_order() {
    for (name, input) in fixtures() {
        for (mode, config) in all_configs() {
            let run = run_whole(&config, &input);
            match config.output {
                OutputFormat::Sse => assert_eq!(run.forwarded, input, "{name} [{mode}]"),
                OutputFormat::Ndjson | OutputFormat::Messages => {
                    assert!(run.forwarded.is_empty(), "{name} [{mode}] forwards nothing")
                }
            }
            if config.inject == InjectMode::None && config.output == OutputFormat::Sse {
                assert_eq!(run.output, input, "{name} [none] is the identity");
            }
        }
    }
}

/// `json` with every `\uD800`–`\uDFFF` escape made `\u0020` (an escaped
/// backslash is skipped, so `\\ud83d` stays).
fn without_surrogate_escapes(json: &str) -> String {
    let mut out = String::with_capacity(json.len());
    let mut chars = json.chars();
    while let Some(c) = chars.next() {
        out.push(c);
        if c != '\\' {
            continue;
        }
        let Some(next) = chars.next() else { break };
        out.push(next);
        if next != 'u' {
            continue;
        }
        let hex: String = chars.by_ref().take(4).collect();
        let surrogate = u16::from_str_radix(&hex, 16).is_ok_and(|u| (0xD800..=0xDFFF).contains(&u));
        out.push_str(if surrogate { "0020" } else { &hex });
    }
    out
}

/// In `field` mode, every event whose JSON we changed is still valid JSON
/// and differs from the original only by the added keys.
#[test]
fn field_injection_keeps_json_valid() {
    // What was checked, over all fixtures: none would be a pass on nothing.
    let (mut insertions, mut events) = (0, 0);
    for (name, input) in fixtures() {
        let run = run_whole(&config(OutputFormat::Sse, InjectMode::Field), &input);
        insertions += run.inserted.len();
        for (at, bytes) in &run.inserted {
            // The insertion sits just before a closing brace of the input
            // and adds top-level keys only.
            assert_eq!(
                input[*at], b'}',
                "{name}: insertion at {at} is not before a brace"
            );
            assert!(
                bytes.starts_with(b",\"toolCallProgress\":{")
                    || bytes.starts_with(b",\"toolCallsProgress\":["),
                "{name}: unexpected insertion {}",
                String::from_utf8_lossy(bytes)
            );
        }
        // Read the output back with the crate's own WHATWG decoder.
        let mut decoder = SseDecoder::new();
        decoder.push(&run.output);
        decoder.finish();
        while let Some(block) = decoder.next_block() {
            let SseBlockKind::Event(event) = block.kind else {
                continue;
            };
            let data = String::from_utf8_lossy(event.data);
            if !data.contains("toolCallProgress") {
                continue;
            }
            // serde_json refuses surrogate escapes that are not pairs, which
            // JSON's grammar allows (a pair cut between two deltas): each is
            // read as a space, which leaves the structure as it is.
            let value: Value = serde_json::from_str(&without_surrogate_escapes(&data))
                .unwrap_or_else(|e| panic!("{name}: injected event is not JSON ({e}): {data}"));
            let progress = &value["toolCallProgress"];
            assert!(
                progress["index"].is_u64() && progress["charsAccumulated"].is_u64(),
                "{name}: {data}"
            );
            events += 1;
            if let Some(all) = value.get("toolCallsProgress") {
                assert_eq!(
                    all.as_array().and_then(|a| a.last()),
                    Some(progress),
                    "{name}"
                );
            }
        }
    }
    // Each annotated event carries one insertion (two keys at most in one).
    assert!(events >= 100, "{events} annotated events checked");
    assert!(
        insertions >= events,
        "{insertions} insertions, {events} events"
    );
}

#[test]
fn agrees_with_the_javascript_oracle() {
    let expected: BTreeMap<String, Value> = serde_json::from_slice(
        &std::fs::read(fixtures_dir().join("expected.json")).expect("read expected.json"),
    )
    .expect("expected.json is JSON");
    let fixtures = fixtures();
    assert_eq!(
        fixtures.iter().map(|(n, _)| n.clone()).collect::<Vec<_>>(),
        expected.keys().cloned().collect::<Vec<_>>(),
        "expected.json covers every fixture (regenerate with `node fixtures/oracle.mjs`)"
    );
    for (name, input) in fixtures {
        let run = run_whole(&config(OutputFormat::Ndjson, InjectMode::Field), &input);
        let got = observed(&run.output);
        let want = &expected[&name];
        assert_eq!(got["progress"], want["progress"], "{name}: progress");
        assert_eq!(got["usage"], want["usage"], "{name}: usage");
        assert_eq!(got["choices"], oracle_choices(want), "{name}: choices");
        // The final charsAccumulated of each call is the JavaScript length
        // of its assembled arguments.
        for c in want["choices"].as_array().expect("choices") {
            for t in c["toolCalls"].as_array().expect("toolCalls") {
                let args = t["arguments"].as_str().expect("arguments string");
                assert_eq!(
                    t["charsAccumulated"].as_u64(),
                    Some(aalis_proxy::js::utf16_len(args) as u64),
                    "{name}: oracle and utf16_len agree"
                );
            }
        }
    }
}

/// Where the last complete frame of `input` ends, by a scanner written
/// apart from the crate's: after the last blank line (SSE: a line break
/// right after a line break; a CR at the very end counts) or the last LF
/// (NDJSON).
fn end_of_last_complete_frame(input: &[u8], ndjson: bool) -> usize {
    if ndjson {
        return input.iter().rposition(|b| *b == b'\n').map_or(0, |i| i + 1);
    }
    let (mut end, mut line_start, mut i) = (0, 0, 0);
    while i < input.len() {
        if matches!(input[i], b'\r' | b'\n') {
            let mut next = i + 1;
            if input[i] == b'\r' && input.get(next) == Some(&b'\n') {
                next += 1;
            }
            if i == line_start {
                end = next;
            }
            line_start = next;
            i = next;
        } else {
            i += 1;
        }
    }
    end
}

/// "Each output event is written as soon as its input event is complete":
/// fed one byte at a time, after every byte the output already holds every
/// input byte up to the end of the last complete event (so a consumer of
/// `curl -N … | aalis-proxy annotate` sees each event at once).
#[test]
fn each_frame_is_written_as_soon_as_it_is_complete() {
    for (name, input) in fixtures() {
        let ndjson = name.ends_with(".ndjson");
        for (mode, config) in all_configs() {
            if config.output != OutputFormat::Sse {
                continue;
            }
            let mut annotator = aalis_proxy::pipeline::Annotator::new(config.clone());
            let mut run = Run::default();
            for i in 0..input.len() {
                annotator.push(&input[i..=i], NOW_MS, &mut run);
                let due = end_of_last_complete_frame(&input[..=i], ndjson);
                assert!(
                    run.forwarded.len() >= due,
                    "{name} [{mode}]: after byte {i}, {} bytes out, {due} due",
                    run.forwarded.len()
                );
            }
        }
    }
}

/// In a steady stream, where each frame has the shape of the one before,
/// the framer finds each frame by asking the decoder (its template) where
/// the payload ends, not by searching for the line's end; and the output
/// is the one of a byte-by-byte run, where no frame is found that way.
#[test]
fn frames_of_a_steady_stream_are_found_by_the_decoders_template() {
    use aalis_proxy::pipeline::Annotator;
    let fragments: Vec<String> = (0..40)
        .map(|i| "abcdefghijkl"[..3 + i % 10].to_owned())
        .collect();
    let total: usize = fragments.iter().map(String::len).sum();

    let mut sse = String::from(
        "data: {\"id\":\"c\",\"object\":\"chat.completion.chunk\",\"created\":1,\"model\":\"m\",\
         \"choices\":[{\"index\":0,\"delta\":{\"tool_calls\":[{\"index\":0,\"id\":\"call_1\",\
         \"function\":{\"name\":\"f\",\"arguments\":\"\"}}]}}]}\n\n",
    );
    for fragment in &fragments {
        sse.push_str(&format!(
            "data: {{\"id\":\"c\",\"object\":\"chat.completion.chunk\",\"created\":1,\"model\":\"m\",\
             \"choices\":[{{\"index\":0,\"delta\":{{\"tool_calls\":[{{\"index\":0,\
             \"function\":{{\"arguments\":\"{fragment}\"}}}}]}}}}]}}\n\n"
        ));
    }
    sse.push_str("data: [DONE]\n\n");
    // The same events, each after a comment line (a timestamp, as the
    // benchmark's upstream sends; a keep-alive): the scan skips comments,
    // and so does the template's probe.
    let commented: String = sse
        .split_inclusive("\n\n")
        .enumerate()
        .map(|(i, event)| format!(": t={i}\n{event}"))
        .collect();

    let mut ndjson = String::new();
    for (i, fragment) in fragments.iter().enumerate() {
        ndjson.push_str(&format!(
            "{{\"model\":\"m\",\"created_at\":\"2026-01-01T09:00:{i:02}.000Z\",\
             \"message\":{{\"role\":\"assistant\",\"content\":\"\",\"thinking\":\"{fragment}\"}},\
             \"done\":false}}\n"
        ));
    }
    ndjson.push_str("{\"model\":\"m\",\"created_at\":\"2026-01-01T09:01:00.000Z\",\"message\":{\"role\":\"assistant\",\"content\":\"\"},\"done\":true}\n");

    // SSE: the first frame and the second (another shape) teach the
    // template; the 39 after them are found by it, `[DONE]` is not.
    // NDJSON: every line after the first (which may start with a BOM) but
    // the `done` line, of another shape.
    for (input, probed) in [(sse, 39), (commented, 39), (ndjson, 39)] {
        let config = AnnotatorConfig::default();
        let mut annotator = Annotator::new(config.clone());
        let mut run = Run::default();
        annotator.push(input.as_bytes(), 0, &mut run);
        run.state = tracker_state(&annotator);
        annotator.finish(0, &mut run);
        assert_eq!(annotator.frames(), 42 - u64::from(input.starts_with('{')));
        assert_eq!(annotator.probed_frames(), probed, "{input}");
        assert_eq!(run, run_bytewise(&config, input.as_bytes()));
        if !input.starts_with('{') {
            let last = String::from_utf8_lossy(&run.output)
                .rsplit("\"charsAccumulated\":")
                .next()
                .and_then(|rest| rest.split(['}', ',']).next().map(str::to_owned));
            assert_eq!(last, Some(total.to_string()), "the arguments counted");
        }
    }
}

/// Frames whose chunks nothing but the tracker reads go out of the framer
/// in runs, many frames a write (`StreamState::pass`): frames of text
/// whenever the output is SSE and no event log records the chunks, frames
/// of one call's arguments only when no progress is injected either. The
/// first frame of each shape teaches the decoder's template, and goes out
/// alone; the frames after it, recognized, go out together.
#[test]
fn frames_only_the_tracker_reads_go_out_in_runs() {
    use aalis_proxy::encode::Sink;
    use aalis_proxy::pipeline::Annotator;
    /// How many events each forwarded piece holds.
    struct Events(Vec<usize>);
    impl Sink for Events {
        fn forward(&mut self, bytes: &[u8]) {
            let events = bytes.windows(6).filter(|w| w == b"data: ").count();
            self.0.push(events);
        }
        fn insert(&mut self, _: &[u8]) {}
    }
    let chunk = |delta: &str| {
        format!(
            "data: {{\"id\":\"c\",\"object\":\"chat.completion.chunk\",\"created\":1,\"model\":\"m\",\
             \"choices\":[{{\"index\":0,\"delta\":{delta}}}]}}\n\n"
        )
    };
    let mut input = chunk(
        r#"{"tool_calls":[{"index":0,"id":"call_1","function":{"name":"f","arguments":""}}]}"#,
    );
    for i in 0..40 {
        let arguments = &"abcdefghijkl"[..3 + i % 10];
        input.push_str(&chunk(&format!(
            r#"{{"tool_calls":[{{"index":0,"function":{{"arguments":"{arguments}"}}}}]}}"#
        )));
    }
    for i in 0..20 {
        input.push_str(&chunk(&format!(r#"{{"content":"word{i} "}}"#)));
    }
    input.push_str("data: [DONE]\n\n");

    // Inject mode, event log, and the events of each run, in order: 39
    // deltas after the one that taught the template, then 19 frames of
    // text.
    for (inject, collect_events, runs) in [
        (InjectMode::None, false, vec![39, 19]),
        (InjectMode::Field, false, vec![19]),
        (InjectMode::Comment, false, vec![19]),
        (InjectMode::None, true, vec![]),
        (InjectMode::Field, true, vec![]),
    ] {
        let mut annotator = Annotator::new(AnnotatorConfig {
            inject,
            collect_events,
            ..AnnotatorConfig::default()
        });
        let mut events = Events(Vec::new());
        annotator.push(input.as_bytes(), 0, &mut events);
        annotator.finish(0, &mut events);
        assert_eq!(
            events.0.iter().sum::<usize>(),
            62,
            "{inject:?}: every event forwarded"
        );
        let found: Vec<usize> = events.0.into_iter().filter(|&n| n > 1).collect();
        assert_eq!(found, runs, "{inject:?}, event log {collect_events}");
        assert_eq!(annotator.frames(), 62);
    }
}
