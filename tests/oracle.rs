//! Generated streams, decoded by the crate and by the independent
//! JavaScript oracle (`fixtures/oracle.mjs`, run with node): the same
//! progress events (index, name, `charsAccumulated`), assembled calls, text
//! and usage. The generator aims at what fixed fixtures miss: lone
//! surrogate escapes split across fragments, entries without `index`,
//! negative indexes, ids that change, object arguments, several entries per
//! delta, custom tools' entries, several choices, and CR, LF and CRLF line
//! endings.
//!
//! node is part of the machine image; the test fails, not skips, without it.

mod common;

use std::fmt::Write as _;
use std::process::Command;

use aalis_proxy::encode::OutputFormat;
use aalis_proxy::pipeline::AnnotatorConfig;
use common::*;
use serde_json::Value;

/// Deterministic xorshift, so a failure names a seed that reproduces it.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
    fn pick<'a>(&mut self, items: &[&'a str]) -> &'a str {
        items[self.below(items.len() as u64) as usize]
    }
}

/// Pieces of JSON string content (already escaped as on the wire).
const FRAGMENTS: &[&str] = &[
    "{",
    "}",
    "\\\"city\\\":",
    "\\\"東京\\\"",
    "é",
    "😀",
    "\\u00e9",
    "\\n",
    "\\\\",
    "\\/",
    "\\ud83d",
    "\\ude00",
    "\\ud83d\\ude00",
    "abc",
    " ",
    "1.5",
    "\\t",
];

/// One stream as SSE text, and whether it has surrogate escapes (whose
/// assembled text differs by design: a split pair is two U+FFFD here).
fn generate(rng: &mut Rng) -> (String, bool) {
    let eol = rng.pick(&["\n", "\r\n", "\r"]);
    let mut out = String::new();
    let mut surrogates = false;
    let events = 1 + rng.below(12);
    for _ in 0..events {
        let choice = if rng.below(5) == 0 { 1 } else { 0 };
        let mut delta = String::new();
        match rng.below(6) {
            0 => delta.push_str("\"content\":\"Hi \\u00e9\","),
            1 => delta.push_str("\"reasoning_content\":\"hm\",\"content\":null,"),
            2 => delta.push_str("\"content\":\"\","),
            _ => {}
        }
        delta.push_str("\"tool_calls\":[");
        let entries = 1 + rng.below(2);
        for e in 0..entries {
            if e > 0 {
                delta.push(',');
            }
            let mut fields = Vec::new();
            match rng.below(6) {
                0 | 1 => {}
                2 => fields.push("\"index\":-1".to_owned()),
                _ => fields.push(format!("\"index\":{}", rng.below(3))),
            }
            match rng.below(5) {
                0 => fields.push(format!("\"id\":\"call_{}\"", rng.below(3))),
                1 => fields.push("\"id\":\"\"".to_owned()),
                _ => {}
            }
            let mut function = Vec::new();
            match rng.below(5) {
                0 => function.push(format!(
                    "\"name\":\"{}\"",
                    rng.pick(&["get_weather", "ls", "名前"])
                )),
                1 => function.push("\"name\":null".to_owned()),
                _ => {}
            }
            match rng.below(8) {
                0 => function
                    .push("\"arguments\":{\"b\":1.50,\"a\":[1e21,null],\"2\":\"x\"}".to_owned()),
                1 => function.push("\"arguments\":null".to_owned()),
                2 => {}
                _ => {
                    let mut text = String::new();
                    for _ in 0..rng.below(4) {
                        let piece = rng.pick(FRAGMENTS);
                        surrogates |= piece.contains("\\ud");
                        text.push_str(piece);
                    }
                    function.push(format!("\"arguments\":\"{text}\""));
                }
            }
            match rng.below(10) {
                // A custom tool's payload, its input in place of arguments.
                0 => fields.push(format!(
                    "\"custom\":{{{}}}",
                    function.join(",").replace("\"arguments\":", "\"input\":")
                )),
                // Beside a function's, it counts for nothing.
                1 => {
                    fields.push(format!("\"function\":{{{}}}", function.join(",")));
                    fields.push("\"custom\":{\"name\":\"other\",\"input\":\"zz\"}".to_owned());
                }
                _ => fields.push(format!("\"function\":{{{}}}", function.join(","))),
            }
            delta.push('{');
            delta.push_str(&fields.join(","));
            delta.push('}');
        }
        delta.push(']');
        let _ = write!(
            out,
            "data: {{\"id\":\"c\",\"choices\":[{{\"index\":{choice},\"delta\":{{{delta}}}}}]}}{eol}{eol}"
        );
    }
    if rng.below(2) == 0 {
        let _ = write!(
            out,
            "data: {{\"choices\":[],\"usage\":{{\"prompt_tokens\":3,\"completion_tokens\":4,\"total_tokens\":7}}}}{eol}{eol}"
        );
    }
    if rng.below(4) != 0 {
        let _ = write!(out, "data: [DONE]{eol}{eol}");
    }
    (out, surrogates)
}

#[test]
fn generated_streams_agree_with_the_javascript_oracle() {
    const STREAMS: u64 = 300;
    let dir = std::env::temp_dir().join(format!("aalis-oracle-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let mut cases = Vec::new();
    for seed in 1..=STREAMS {
        let mut rng = Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15));
        let (text, surrogates) = generate(&mut rng);
        let path = dir.join(format!("seed-{seed}.sse"));
        std::fs::write(&path, &text).expect("write stream");
        cases.push((seed, path, text, surrogates));
    }
    let oracle = fixtures_dir().join("oracle.mjs");
    let output = Command::new("node")
        .arg(&oracle)
        .args(cases.iter().map(|(_, path, _, _)| path))
        .output()
        .expect("node runs (it is part of the machine image)");
    assert!(
        output.status.success(),
        "oracle failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    let expected: Value = serde_json::from_slice(&output.stdout).expect("oracle prints JSON");
    let ndjson = AnnotatorConfig {
        output: OutputFormat::Ndjson,
        ..AnnotatorConfig::default()
    };
    for (seed, path, text, surrogates) in &cases {
        let want = &expected[path.to_string_lossy().as_ref()];
        let got = observed(&run_whole(&ndjson, text.as_bytes()).output);
        let context = format!("seed {seed}:\n{text}");
        assert_eq!(got["progress"], want["progress"], "progress, {context}");
        assert_eq!(got["usage"], want["usage"], "usage, {context}");
        if !surrogates {
            assert_eq!(got["choices"], oracle_choices(want), "choices, {context}");
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}
