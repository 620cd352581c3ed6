//! Shared test helpers: running the pipeline on fixtures in any chunking,
//! and the base command for CLI tests.
#![allow(dead_code)]

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde_json::{Value, json};

use aalis_proxy::encode::{InjectMode, OutputFormat, Sink};
use aalis_proxy::pipeline::{Annotator, AnnotatorConfig};
use aalis_proxy::progress::StreamPhase;

/// Variables that could change what the binary does or prints: colors
/// (`NO_COLOR`; `CLICOLOR_FORCE` makes clap color even a pipe), help
/// wrapping (`COLUMNS`, `LINES`: clap's `wrap_help` reads them), terminal,
/// logging, proxies.
pub const SCRUBBED_ENV: &[&str] = &[
    "AALIS_ADMIN_TOKEN",
    "NO_COLOR",
    "CLICOLOR",
    "CLICOLOR_FORCE",
    "TERM",
    "COLUMNS",
    "LINES",
    "RUST_LOG",
    "RUST_BACKTRACE",
    "http_proxy",
    "https_proxy",
    "all_proxy",
    "no_proxy",
    "HTTP_PROXY",
    "HTTPS_PROXY",
    "ALL_PROXY",
    "NO_PROXY",
];

/// The base command of CLI tests: the `aalis-proxy` binary, run from the
/// package root (so relative fixture paths work and messages show them as
/// typed), without the variables of [`SCRUBBED_ENV`] (bat
/// `tests/utils/command.rs`, xh `get_base_command`).
pub fn base_command() -> std::process::Command {
    let mut cmd = std::process::Command::new(assert_cmd::cargo::cargo_bin!("aalis-proxy"));
    cmd.current_dir(env!("CARGO_MANIFEST_DIR"));
    for var in SCRUBBED_ENV {
        cmd.env_remove(var);
    }
    cmd
}

/// A fixed clock: nothing in the output depends on time.
pub const NOW_MS: u64 = 1_767_225_600_000;

pub fn fixtures_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures")
}

/// Every fixture, as (path relative to `fixtures/`, bytes), sorted.
pub fn fixtures() -> Vec<(String, Vec<u8>)> {
    let mut out = Vec::new();
    let root = fixtures_dir();
    let mut dirs = vec![root.clone()];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir).expect("fixtures dir") {
            let path = entry.expect("dir entry").path();
            if path.is_dir() {
                dirs.push(path);
            } else if matches!(
                path.extension().and_then(|e| e.to_str()),
                Some("sse" | "ndjson")
            ) {
                let rel = path
                    .strip_prefix(&root)
                    .expect("under fixtures")
                    .to_string_lossy()
                    .replace('\\', "/");
                out.push((rel, std::fs::read(&path).expect("read fixture")));
            }
        }
    }
    out.sort();
    out
}

/// Every output configuration `annotate` has.
pub fn all_configs() -> Vec<(&'static str, AnnotatorConfig)> {
    let sse = |inject| AnnotatorConfig {
        output: OutputFormat::Sse,
        inject,
        ..AnnotatorConfig::default()
    };
    vec![
        ("field", sse(InjectMode::Field)),
        ("comment", sse(InjectMode::Comment)),
        ("event", sse(InjectMode::Event)),
        ("chunk", sse(InjectMode::Chunk)),
        ("none", sse(InjectMode::None)),
        (
            "ndjson",
            AnnotatorConfig {
                output: OutputFormat::Ndjson,
                ..AnnotatorConfig::default()
            },
        ),
        (
            "messages",
            AnnotatorConfig {
                output: OutputFormat::Messages,
                session_id: Some("s1".into()),
                ..AnnotatorConfig::default()
            },
        ),
        // Most events are larger than this: they go out unparsed, in pieces.
        (
            "field_max_64_bytes",
            AnnotatorConfig {
                max_event_bytes: 64,
                ..AnnotatorConfig::default()
            },
        ),
        (
            "ndjson_max_300_bytes",
            AnnotatorConfig {
                output: OutputFormat::Ndjson,
                max_event_bytes: 300,
                ..AnnotatorConfig::default()
            },
        ),
    ]
}

/// What a run produced, with forwarded and inserted bytes told apart.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Run {
    /// Everything written, in order.
    pub output: Vec<u8>,
    /// Only the forwarded input bytes.
    pub forwarded: Vec<u8>,
    /// Each insertion: (offset in the input where it was inserted, bytes).
    pub inserted: Vec<(usize, Vec<u8>)>,
    pub warnings: Vec<String>,
    /// The tracker's phase and change count once every piece was pushed,
    /// before the end of input: the same in every cutting.
    pub state: (StreamPhase, u64),
}

impl Sink for Run {
    fn forward(&mut self, bytes: &[u8]) {
        self.output.extend_from_slice(bytes);
        self.forwarded.extend_from_slice(bytes);
    }
    fn insert(&mut self, bytes: &[u8]) {
        self.output.extend_from_slice(bytes);
        // Adjacent insertions (one per line of NDJSON output) are merged.
        match self.inserted.last_mut() {
            Some((at, b)) if *at == self.forwarded.len() => b.extend_from_slice(bytes),
            _ => self.inserted.push((self.forwarded.len(), bytes.to_vec())),
        }
    }
}

/// Runs the pipeline on `pieces` in order.
pub fn run_pieces<'a>(config: &AnnotatorConfig, pieces: impl IntoIterator<Item = &'a [u8]>) -> Run {
    let mut annotator = Annotator::new(config.clone());
    let mut run = Run::default();
    for piece in pieces {
        annotator.push(piece, NOW_MS, &mut run);
        run.warnings
            .extend(annotator.take_warnings().iter().map(ToString::to_string));
    }
    run.state = tracker_state(&annotator);
    annotator.finish(NOW_MS, &mut run);
    run.warnings
        .extend(annotator.take_warnings().iter().map(ToString::to_string));
    run
}

/// The tracker's phase and change count: what a stream's frames did to
/// it, as far as a reader of its snapshots can tell.
pub fn tracker_state(annotator: &Annotator) -> (StreamPhase, u64) {
    (annotator.tracker().phase(), annotator.tracker().changes())
}

/// Runs the pipeline on the whole input at once.
pub fn run_whole(config: &AnnotatorConfig, input: &[u8]) -> Run {
    run_pieces(config, [input])
}

/// Runs the pipeline one byte at a time.
pub fn run_bytewise(config: &AnnotatorConfig, input: &[u8]) -> Run {
    run_pieces(config, input.chunks(1))
}

/// Runs the pipeline with a cut after every CR and LF.
pub fn run_split_at_line_breaks(config: &AnnotatorConfig, input: &[u8]) -> Run {
    run_pieces(
        config,
        input.split_inclusive(|b| *b == b'\r' || *b == b'\n'),
    )
}

/// Runs the pipeline with the input cut at `cuts` (sorted or not).
pub fn run_cut_at(config: &AnnotatorConfig, input: &[u8], cuts: &[usize]) -> Run {
    run_pieces(config, cut_at(input, cuts))
}

/// `input` cut at `cuts` (sorted or not, taken modulo its length plus one).
pub fn cut_at<'a>(input: &'a [u8], cuts: &[usize]) -> Vec<&'a [u8]> {
    let mut cuts: Vec<usize> = cuts.iter().map(|c| c % (input.len() + 1)).collect();
    cuts.sort_unstable();
    cuts.dedup();
    let mut pieces = Vec::new();
    let mut start = 0;
    for cut in cuts {
        pieces.push(&input[start..cut]);
        start = cut;
    }
    pieces.push(&input[start..]);
    pieces
}

/// What the oracle says for one fixture, rebuilt from our `ndjson` lines.
pub fn observed(output: &[u8]) -> Value {
    let mut progress = Vec::new();
    let mut choices: BTreeMap<u64, (String, String, Vec<Value>)> = BTreeMap::new();
    let mut usage = Value::Null;
    let mut done_lines = 0;
    for line in String::from_utf8_lossy(output).lines() {
        let v: Value = serde_json::from_str(line).expect("every ndjson line is JSON");
        let choice = v["choice"].as_u64().unwrap_or(0);
        if let Some(p) = v.get("toolCallProgress") {
            progress.push(json!({
                "choice": p["choice"].as_u64().unwrap_or(0),
                "index": p["index"],
                "name": p["name"],
                "charsAccumulated": p["charsAccumulated"],
            }));
        }
        if let Some(t) = v["contentDelta"].as_str() {
            choices.entry(choice).or_default().0.push_str(t);
        }
        if let Some(t) = v["reasoningDelta"].as_str() {
            choices.entry(choice).or_default().1.push_str(t);
        }
        if v["done"] == json!(true) {
            done_lines += 1;
            if let Some(u) = v.get("usage") {
                assert!(usage.is_null(), "usage appears once");
                usage = u.clone();
            }
            for call in v["toolCalls"].as_array().into_iter().flatten() {
                choices.entry(choice).or_default().2.push(call.clone());
            }
        }
    }
    assert!(done_lines >= 1, "a done line is always written");
    json!({
        "progress": progress,
        "usage": usage,
        "choices": choices.into_iter().map(|(k, (content, reasoning, calls))| json!({
            "choice": k, "content": content, "reasoning": reasoning,
            "toolCalls": calls.iter().map(|c| match c["type"].as_str() {
                Some("custom") => json!({
                    "id": c["id"], "type": "custom", "name": c["custom"]["name"], "arguments": c["custom"]["input"],
                }),
                _ => json!({
                    "id": c["id"], "type": c["type"], "name": c["function"]["name"], "arguments": c["function"]["arguments"],
                }),
            }).collect::<Vec<_>>(),
        })).collect::<Vec<_>>(),
    })
}

/// The oracle's `choices` in the shape [`observed`] gives.
pub fn oracle_choices(want: &Value) -> Value {
    let choices: Vec<Value> = want["choices"]
        .as_array()
        .expect("choices")
        .iter()
        // A choice that produced nothing has no line in our output.
        .filter(|c| c["content"] != "" || c["reasoning"] != "" || c["toolCalls"] != json!([]))
        .map(|c| {
            json!({
                "choice": c["choice"], "content": c["content"], "reasoning": c["reasoning"],
                "toolCalls": c["toolCalls"].as_array().expect("toolCalls").iter().map(|t| json!({
                    "id": t["id"], "type": t["type"], "name": t["name"], "arguments": t["arguments"],
                })).collect::<Vec<_>>(),
            })
        })
        .collect();
    json!(choices)
}
