//! Fuzzing regressions (issue 7): every input a fuzz target failed on,
//! replayed by `cargo test` through the very checks of the targets.
//!
//! The checks live in `fuzz/src/lib.rs`, the library of the cargo-fuzz
//! package, and are compiled in here as a module, so a saved input fails
//! here exactly as it failed under the fuzzer. Inputs are files in
//! `tests/fuzz-regressions/<target>/`, named for what they found, in the
//! target's input layout (see `fuzz/src/lib.rs`); `scripts/fuzz.sh` also
//! feeds them to the fuzzer. To add one: minimize the artifact
//! (`fuzz/target/<host>/release/<target> -minimize_crash=1
//! -exact_artifact_path=OUT ARTIFACT`), copy it there, and, for a bug, add
//! a named test below that says what it was.
//!
//! The fixtures pass every check too ([`fixtures_pass_every_check`]).

mod common;
#[path = "../fuzz/src/lib.rs"]
mod fuzz_checks;

use std::path::Path;

/// A target's check: panics when an invariant breaks.
type Check = fn(&[u8]);

/// Each target's check, by the name of its directory.
const TARGETS: &[(&str, Check)] = &[
    ("sse_framing", fuzz_checks::sse_framing),
    ("ndjson_framing", fuzz_checks::ndjson_framing),
    ("openai_decode", fuzz_checks::openai_decode),
    ("ollama_decode", fuzz_checks::ollama_decode),
    ("inject_field", fuzz_checks::inject_field),
    ("annotate", fuzz_checks::annotate),
    ("chunked_body", fuzz_checks::chunked_body),
];

fn regressions_dir() -> &'static Path {
    Path::new(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fuzz-regressions"
    ))
}

/// The saved inputs of one target, sorted by name.
fn saved_inputs(target: &str) -> Vec<(String, Vec<u8>)> {
    let dir = regressions_dir().join(target);
    let Ok(entries) = std::fs::read_dir(&dir) else {
        return Vec::new();
    };
    let mut inputs: Vec<(String, Vec<u8>)> = entries
        .map(|entry| {
            let path = entry.expect("dir entry").path();
            let name = path
                .file_name()
                .expect("a file name")
                .to_string_lossy()
                .into_owned();
            (name, std::fs::read(&path).expect("read a saved input"))
        })
        .collect();
    inputs.sort();
    inputs
}

/// One saved input, by target and name.
fn saved(target: &str, name: &str) -> Vec<u8> {
    std::fs::read(regressions_dir().join(target).join(name)).expect("read a saved input")
}

#[test]
fn every_saved_input_passes_its_target() {
    let mut count = 0;
    for (target, check) in TARGETS {
        for (name, input) in saved_inputs(target) {
            eprintln!("{target}/{name}");
            check(&input);
            count += 1;
        }
    }
    assert!(count > 0, "no saved inputs found");
}

#[test]
fn saved_inputs_belong_to_a_target() {
    for entry in std::fs::read_dir(regressions_dir()).expect("tests/fuzz-regressions") {
        let name = entry.expect("dir entry").file_name();
        let name = name.to_string_lossy();
        if name.starts_with('.') {
            continue;
        }
        assert!(
            TARGETS.iter().any(|(t, _)| *t == name),
            "tests/fuzz-regressions/{name} is not a fuzz target"
        );
    }
}

/// The seed corpus passes: each fixture through each stream target, whole
/// and cut in three places, in every configuration the config byte can
/// pick (168). `chunked_body` reads a fixture as a body under even configs
/// (an error, SSE is not chunked, but the same error whole and cut), and
/// as the payload of a valid body it must decode back under odd ones from
/// 128: chunks of 64 bytes and more (one-byte chunks of every fixture take
/// seconds in the debug profile; the fuzzer's seeds have small chunks).
#[test]
fn fixtures_pass_every_check() {
    let fixtures = common::fixtures();
    assert!(!fixtures.is_empty());
    for (_, fixture) in &fixtures {
        let third = u16::try_from(fixture.len() / 3).expect("fixtures are small");
        for config in 0..168u8 {
            let mut whole = vec![config, 0];
            whole.extend_from_slice(fixture);
            let mut cut = vec![config, 2];
            cut.extend_from_slice(&third.to_le_bytes());
            cut.extend_from_slice(&(2 * third).to_le_bytes());
            cut.extend_from_slice(fixture);
            fuzz_checks::annotate(&whole);
            fuzz_checks::annotate(&cut);
            if config % 2 == 0 || config >= 128 {
                fuzz_checks::chunked_body(&whole);
                fuzz_checks::chunked_body(&cut);
            }
            if config < 4 {
                fuzz_checks::sse_framing(&cut);
                fuzz_checks::ndjson_framing(&cut);
            }
        }
    }
}

// === the bugs, one test each (See: issue 7) ===

/// An oversized SSE event's `id` line set the last event ID when the line
/// was complete before the size limit was crossed, and not when the limit
/// was crossed first (input cut before the line's end): the events after
/// it carried a different `last_event_id` depending on how the input was
/// cut. Fixed in `SseDecoder::enter_oversized`: an oversized event's `id`
/// is undone, like the rest of its fields.
#[test]
fn oversized_event_id_does_not_depend_on_the_cutting() {
    use aalis_proxy::framing::sse::{SseBlockKind, SseDecoder};
    let ids = |pieces: &[&[u8]]| {
        let mut decoder = SseDecoder::with_max_event_bytes(16);
        let mut ids = Vec::new();
        for piece in pieces {
            decoder.push(piece);
            while let Some(block) = decoder.next_block() {
                if let SseBlockKind::Event(e) = block.kind {
                    ids.push(e.last_event_id.to_vec());
                }
            }
        }
        decoder.finish();
        while let Some(block) = decoder.next_block() {
            if let SseBlockKind::Event(e) = block.kind {
                ids.push(e.last_event_id.to_vec());
            }
        }
        ids
    };
    let stream: &[u8] = b"id: 1\n\nid: a-long-identifier\n\ndata: x\n\n";
    // The second event is oversized (its first line alone is 21 bytes):
    // whole, its `id` line is complete when the limit is crossed; cut
    // after 17 bytes of that line, it is not. Either way the third event
    // carries the id of the first.
    let (head, tail) = stream.split_at(7 + 17);
    assert_eq!(ids(&[stream]), vec![b"1".to_vec()]);
    assert_eq!(ids(&[head, tail]), vec![b"1".to_vec()]);

    let input = saved("sse_framing", "oversized-event-id-depends-on-cutting");
    fuzz_checks::sse_framing(&input);
}

/// The LF of a CRLF that arrived in the next piece was not counted toward
/// the event's size, so an event one byte over the limit was oversized
/// when its CRLF came whole and parsed when the input was cut between CR
/// and LF. Fixed in `SseDecoder::next_block`: the size is checked again
/// after that LF.
#[test]
fn split_crlf_counts_toward_the_event_size() {
    use aalis_proxy::framing::sse::{SseBlockKind, SseDecoder};
    let kinds = |pieces: &[&[u8]]| {
        let mut decoder = SseDecoder::with_max_event_bytes(16);
        let mut kinds = Vec::new();
        let mut drain = |decoder: &mut SseDecoder| {
            while let Some(block) = decoder.next_block() {
                kinds.push(match block.kind {
                    SseBlockKind::Event(_) => "event",
                    SseBlockKind::Oversized { .. } => "oversized",
                    SseBlockKind::NoData => "no data",
                    SseBlockKind::LineEndTail => "tail",
                    SseBlockKind::Unterminated { .. } => "unterminated",
                    SseBlockKind::Passed { .. } => "passed",
                });
            }
        };
        for piece in pieces {
            decoder.push(piece);
            drain(&mut decoder);
        }
        decoder.finish();
        drain(&mut decoder);
        kinds
    };
    // 17 bytes with its CRLF: one more than the limit.
    let stream: &[u8] = b"data: 123456789\r\n\r\n";
    let (head, tail) = stream.split_at(16);
    assert_eq!(kinds(&[stream]), ["oversized"]);
    assert_eq!(kinds(&[head, tail]), ["oversized"]);

    let input = saved("sse_framing", "split-crlf-not-counted-toward-event-size");
    fuzz_checks::sse_framing(&input);
}

/// Ollama calls are numbered after the last one; a wire index of
/// `i64::MAX` made the next number saturate at `i64::MAX` again, so two
/// distinct calls shared one index and the tracker merged them (the `done`
/// line listed one call instead of two). Fixed: a wire index is taken only
/// up to 2^53 − 1 (`src/providers/ollama.rs`).
#[test]
fn ollama_calls_after_index_i64_max_get_distinct_indexes() {
    let input = br#"{"message":{"tool_calls":[{"function":{"index":9223372036854775807,"name":"a","arguments":{}}},{"function":{"name":"b","arguments":{}}}]},"done":false}"#;
    fuzz_checks::ollama_decode(input);
}
