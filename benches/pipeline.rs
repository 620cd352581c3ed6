//! Criterion micro-benchmarks of the synchronous core (issue 6): the whole
//! [`Annotator`] per output mode, the [`SseDecoder`] alone, and
//! [`utf16_len`], over a generated tool-heavy stream fed in 16 KiB pieces
//! (what a socket read or `annotate`'s 64 KiB read hands over, or less).
//!
//! The input is generated here, deterministically, in the shape of
//! `fixtures/openai/*.sse` and of `scripts/bench/gen_captures.py --kind tool`:
//! turns of 1–4 parallel tool calls whose arguments (200–20,000 characters,
//! some CJK and emoji) arrive in 3–12 character deltas. Set
//! `AALIS_BENCH_CAPTURE=path.sse` to bench a capture file instead.
//!
//! `scripts/bench.sh` runs these with short measurement times; run them alone
//! with `cargo bench --bench pipeline`.

use std::hint::black_box;

use aalis_proxy::encode::{InjectMode, OutputFormat};
use aalis_proxy::framing::sse::SseDecoder;
use aalis_proxy::js::utf16_len;
use aalis_proxy::pipeline::{Annotator, AnnotatorConfig};
use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};

/// Input piece size.
const PIECE_BYTES: usize = 16 * 1024;
/// Size of the generated stream.
const STREAM_BYTES: usize = 4_000_000;

/// xorshift64*: deterministic and dependency-free.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
    fn range(&mut self, lo: usize, hi: usize) -> usize {
        lo + self.below(hi - lo + 1)
    }
}

const WORDS: &[&str] = &[
    "the",
    "of",
    "and",
    "to",
    "in",
    "file",
    "path",
    "line",
    "value",
    "return",
    "result",
    "error",
    "config",
    "stream",
    "tool",
    "call",
    "index",
    "fn",
    "let",
    "mut",
    "impl",
    "match",
    "self",
    "weather",
    "query",
    "limit",
    "update",
    "replace",
    "\"quoted\"",
    "line\n",
    "back\\slash",
    "北京",
    "天气预报",
    "文件",
    "😀",
    "🚀",
];
const FUNCTIONS: &[&str] = &["write_file", "edit_file", "get_weather", "search_docs"];

/// `s` as a JSON string literal.
fn json_string(s: &str, out: &mut String) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            c => out.push(c),
        }
    }
    out.push('"');
}

/// A tool-heavy OpenAI-style SSE stream of at least `bytes` bytes, ending
/// with `[DONE]`.
fn tool_heavy_stream(bytes: usize) -> Vec<u8> {
    let mut rng = Rng(0x006A_A115);
    let mut out = String::with_capacity(bytes + (1 << 20));
    let mut turn = 0u64;
    while out.len() < bytes {
        turn += 1;
        let head = format!(
            r#"data: {{"id":"chatcmpl-{turn:029}","object":"chat.completion.chunk","created":{},"model":"gpt-4o-2024-08-06","service_tier":"default","system_fingerprint":"fp_cbf1785567","choices":[{{"index":0,"delta":"#,
            1_767_225_661 + turn
        );
        let tail = r#","logprobs":null,"finish_reason":null}],"obfuscation":"Hh7"}"#;
        let event = |out: &mut String, delta: &str| {
            out.push_str(&head);
            out.push_str(delta);
            out.push_str(tail);
            out.push_str("\n\n");
        };
        event(&mut out, r#"{"role":"assistant","content":null}"#);
        let calls = rng.range(1, 4);
        for index in 0..calls {
            let name = FUNCTIONS[rng.below(FUNCTIONS.len())];
            event(
                &mut out,
                &format!(
                    r#"{{"tool_calls":[{{"index":{index},"id":"call_{turn:024}","type":"function","function":{{"name":"{name}","arguments":""}}}}]}}"#
                ),
            );
            // Log-uniform 200..20,000 characters of JSON arguments.
            let target = (200.0 * 100f64.powf(rng.below(1000) as f64 / 1000.0)) as usize;
            let mut text = String::from("{\"path\": \"src/lib.rs\", \"content\": ");
            let mut content = String::new();
            while content.chars().count() < target {
                content.push_str(WORDS[rng.below(WORDS.len())]);
                content.push(' ');
            }
            json_string(&content, &mut text);
            text.push('}');
            let chars: Vec<char> = text.chars().collect();
            let mut at = 0;
            while at < chars.len() {
                let end = (at + rng.range(3, 12)).min(chars.len());
                let piece: String = chars[at..end].iter().collect();
                let mut delta =
                    format!(r#"{{"tool_calls":[{{"index":{index},"function":{{"arguments":"#);
                json_string(&piece, &mut delta);
                delta.push_str("}}]}");
                event(&mut out, &delta);
                at = end;
            }
        }
        out.push_str(&head);
        out.push_str(r#"{},"logprobs":null,"finish_reason":"tool_calls"}],"obfuscation":"Hh7"}"#);
        out.push_str("\n\n");
    }
    out.push_str("data: [DONE]\n\n");
    out.into_bytes()
}

fn input() -> Vec<u8> {
    match std::env::var_os("AALIS_BENCH_CAPTURE") {
        Some(path) => std::fs::read(&path).expect("invariant: AALIS_BENCH_CAPTURE is readable"),
        None => tool_heavy_stream(STREAM_BYTES),
    }
}

/// One whole stream through a fresh annotator, in 16 KiB pieces; returns the
/// output size so nothing is optimized away.
fn annotate(config: &AnnotatorConfig, input: &[u8], out: &mut Vec<u8>) -> usize {
    let mut annotator = Annotator::new(config.clone());
    let mut total = 0;
    for piece in input.chunks(PIECE_BYTES) {
        annotator.push(piece, 0, out);
        total += out.len();
        out.clear();
    }
    annotator.finish(0, out);
    total += out.len();
    out.clear();
    total
}

fn bench_annotator(c: &mut Criterion) {
    let input = input();
    let mut group = c.benchmark_group("annotator_tool_heavy_16k");
    group.throughput(Throughput::Bytes(input.len() as u64));
    let modes: [(&str, OutputFormat, InjectMode); 7] = [
        ("sse_field", OutputFormat::Sse, InjectMode::Field),
        ("sse_comment", OutputFormat::Sse, InjectMode::Comment),
        ("sse_event", OutputFormat::Sse, InjectMode::Event),
        ("sse_chunk", OutputFormat::Sse, InjectMode::Chunk),
        ("sse_none", OutputFormat::Sse, InjectMode::None),
        ("ndjson", OutputFormat::Ndjson, InjectMode::Field),
        ("messages", OutputFormat::Messages, InjectMode::Field),
    ];
    for (name, output, inject) in modes {
        let config = AnnotatorConfig {
            output,
            inject,
            session_id: Some("bench".to_owned()),
            ..AnnotatorConfig::default()
        };
        let mut out = Vec::with_capacity(4 * PIECE_BYTES);
        group.bench_function(BenchmarkId::from_parameter(name), |b| {
            b.iter(|| annotate(&config, black_box(&input), &mut out));
        });
    }
    group.finish();
}

fn bench_sse_decoder(c: &mut Criterion) {
    let input = input();
    let mut group = c.benchmark_group("sse_decoder_16k");
    group.throughput(Throughput::Bytes(input.len() as u64));
    group.bench_function("blocks", |b| {
        b.iter(|| {
            let mut decoder = SseDecoder::new();
            let mut blocks = 0u64;
            for piece in black_box(&input).chunks(PIECE_BYTES) {
                decoder.push(piece);
                while let Some(block) = decoder.next_block() {
                    blocks += block.raw.len() as u64;
                }
            }
            decoder.finish();
            while let Some(block) = decoder.next_block() {
                blocks += block.raw.len() as u64;
            }
            blocks
        });
    });
    group.finish();
}

fn bench_utf16_len(c: &mut Criterion) {
    let mut group = c.benchmark_group("utf16_len");
    let delta_ascii = "{\"path\": ";
    let delta_cjk = "天气预报北京";
    let mixed: String = WORDS
        .iter()
        .cycle()
        .take(600)
        .copied()
        .collect::<Vec<_>>()
        .join(" ");
    for (name, text) in [
        ("delta_ascii_9B", delta_ascii),
        ("delta_cjk_18B", delta_cjk),
        ("mixed_4KiB", char_prefix(&mixed, 4096)),
    ] {
        group.throughput(Throughput::Bytes(text.len() as u64));
        group.bench_function(name, |b| b.iter(|| utf16_len(black_box(text))));
    }
    group.finish();
}

/// The longest prefix of `s` of at most `bytes` bytes that is whole characters.
fn char_prefix(s: &str, bytes: usize) -> &str {
    let mut end = bytes.min(s.len());
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}

criterion_group!(benches, bench_annotator, bench_sse_decoder, bench_utf16_len);
criterion_main!(benches);
