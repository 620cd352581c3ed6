//! Frames and progress → output bytes.
//!
//! Two encoders share the [`Sink`] they write to and the rendering of one
//! progress object ([`ProgressBatch`]):
//! - [`inject`]: the annotated passthrough. Every input byte is forwarded
//!   verbatim; progress is added as `--inject` says (SPEC.md, "Injection into
//!   an SSE stream").
//! - [`ndjson`]: re-encoding as the seed's `ChatStreamChunk` or
//!   `StreamChunkMessage` lines. Its rustdoc is the wire specification.

pub mod inject;
pub mod ndjson;
pub mod splice;

use std::ops::Range;
use std::sync::Arc;

use crate::js::push_string;
use crate::progress::Progress;

/// Where encoders write. Forwarded input and added bytes are told apart, so
/// a test can check that removing what was added gives the input back.
pub trait Sink {
    /// Input bytes, forwarded unchanged.
    fn forward(&mut self, bytes: &[u8]);
    /// Bytes we add (injected progress, re-encoded lines).
    fn insert(&mut self, bytes: &[u8]);
}

impl Sink for Vec<u8> {
    fn forward(&mut self, bytes: &[u8]) {
        self.extend_from_slice(bytes);
    }
    fn insert(&mut self, bytes: &[u8]) {
        self.extend_from_slice(bytes);
    }
}

impl Sink for bytes::BytesMut {
    fn forward(&mut self, bytes: &[u8]) {
        self.extend_from_slice(bytes);
    }
    fn insert(&mut self, bytes: &[u8]) {
        self.extend_from_slice(bytes);
    }
}

/// How progress is added to a forwarded stream (SPEC.md's `--inject` table).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum InjectMode {
    /// Add a top-level "toolCallProgress" key to the chunk that carried the
    /// tool-call delta; no SDK breaks, every SDK can read it
    #[default]
    Field,
    /// Add a `: toolCallProgress {…}` comment line after the event; only raw
    /// SSE readers see it
    Comment,
    /// Add an `event: toolCallProgress` event after the event; breaks the
    /// openai-python and openai-node iterators and the Vercel AI SDK (an
    /// error part each)
    Event,
    /// Add a chunk-shaped event with "choices":[] after the event; breaks code
    /// that reads the first choice unguarded
    Chunk,
    /// Add nothing: the output is the input, byte for byte
    None,
}

impl InjectMode {
    /// The mode as `--inject` spells it.
    pub fn name(self) -> &'static str {
        match self {
            InjectMode::Field => "field",
            InjectMode::Comment => "comment",
            InjectMode::Event => "event",
            InjectMode::Chunk => "chunk",
            InjectMode::None => "none",
        }
    }
}

/// What `annotate` writes on stdout.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum OutputFormat {
    /// The input stream itself, byte for byte, with progress injected as
    /// --inject says (NDJSON input stays NDJSON, with `field` injection)
    #[default]
    #[value(alias = "passthrough")]
    Sse,
    /// One ChatStreamChunk JSON object per line: contentDelta,
    /// reasoningDelta, toolCallProgress, then done with toolCalls and usage
    Ndjson,
    /// One StreamChunkMessage JSON object per line (needs --session)
    Messages,
}

/// The progress objects of one frame, rendered once as JSON and reused by
/// every encoder: `{"index":0,"name":"f","charsAccumulated":12}`, with
/// `"choice":k` added for a choice other than 0.
#[derive(Debug, Default)]
pub struct ProgressBatch {
    json: String,
    spans: Vec<Range<usize>>,
    /// The calls' heads, kept across frames.
    heads: ProgressHeads,
}

/// How many calls keep a rendered head; a stream with more starts over
/// (models send a handful of parallel calls at most).
const MAX_HEADS: usize = 16;

/// `{"index":0,"name":"f","charsAccumulated":` for each call: the part of
/// a progress object that stays the same from one delta of a call to the
/// next, so the name is escaped once a call, not once a delta (parallel
/// calls' deltas interleave, so one per call, not only the last).
#[derive(Debug, Default)]
struct ProgressHeads {
    heads: Vec<ProgressHead>,
}

#[derive(Debug)]
struct ProgressHead {
    choice: i64,
    index: i64,
    /// Held, so the same allocation is the same name.
    name: Arc<str>,
    json: String,
}

impl ProgressHeads {
    /// Appends the head of `p`'s object: its call's kept one, rendered
    /// again if the call's name is not the one it was rendered with.
    fn write(&mut self, p: &Progress<'_>, out: &mut String) {
        let kept = self
            .heads
            .iter_mut()
            .find(|h| h.index == p.index && h.choice == p.choice);
        match kept {
            Some(head) => {
                if !(Arc::ptr_eq(&head.name, p.name) || head.name == *p.name) {
                    head.name = Arc::clone(p.name);
                    head.json.clear();
                    write_head(p, &mut head.json);
                }
                out.push_str(&head.json);
            }
            None => {
                if self.heads.len() >= MAX_HEADS {
                    self.heads.clear();
                }
                let mut json = String::new();
                write_head(p, &mut json);
                out.push_str(&json);
                self.heads.push(ProgressHead {
                    choice: p.choice,
                    index: p.index,
                    name: Arc::clone(p.name),
                    json,
                });
            }
        }
    }
}

impl ProgressBatch {
    pub fn clear(&mut self) {
        self.json.clear();
        self.spans.clear();
    }

    pub fn push(&mut self, p: &Progress<'_>) {
        let start = self.json.len();
        self.heads.write(p, &mut self.json);
        write_tail(p, &mut self.json);
        self.spans.push(start..self.json.len());
    }

    pub fn is_empty(&self) -> bool {
        self.spans.is_empty()
    }

    pub fn len(&self) -> usize {
        self.spans.len()
    }

    /// The rendered objects, in the order they were pushed.
    pub fn iter(&self) -> impl Iterator<Item = &str> {
        self.spans.iter().map(|r| &self.json[r.clone()])
    }

    /// The last object pushed.
    pub fn last(&self) -> Option<&str> {
        self.spans.last().map(|r| &self.json[r.clone()])
    }
}

/// A progress object up to its count: `{"index":0,"name":"f","charsAccumulated":`.
fn write_head(p: &Progress<'_>, out: &mut String) {
    // itoa, not `write!`: this runs once per tool-call delta.
    let mut digits = itoa::Buffer::new();
    out.push_str("{\"index\":");
    out.push_str(digits.format(p.index));
    out.push_str(",\"name\":");
    push_string(p.name, out);
    out.push_str(",\"charsAccumulated\":");
}

/// The rest of a progress object: its count, its choice if not 0, `}`.
fn write_tail(p: &Progress<'_>, out: &mut String) {
    let mut digits = itoa::Buffer::new();
    out.push_str(digits.format(p.chars_accumulated));
    if p.choice != 0 {
        out.push_str(",\"choice\":");
        out.push_str(digits.format(p.choice));
    }
    out.push('}');
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_inject_modes_name_is_its_flag_value() {
        use clap::ValueEnum;
        for mode in InjectMode::value_variants() {
            let value = mode.to_possible_value().expect("every mode is a value");
            assert_eq!(mode.name(), value.get_name());
        }
    }

    fn progress(choice: i64, index: i64, name: &Arc<str>, chars: usize) -> Progress<'_> {
        Progress {
            choice,
            index,
            name,
            chars_accumulated: chars,
            started_at_ms: 0,
        }
    }

    /// The object as SPEC.md writes it, built without the batch's code.
    fn expected(p: &Progress<'_>) -> String {
        let name = serde_json::to_string(&**p.name).expect("a string serializes");
        let choice = if p.choice == 0 {
            String::new()
        } else {
            format!(",\"choice\":{}", p.choice)
        };
        format!(
            "{{\"index\":{},\"name\":{name},\"charsAccumulated\":{}{choice}}}",
            p.index, p.chars_accumulated
        )
    }

    #[test]
    fn a_kept_head_renders_what_a_fresh_one_would() {
        // Each frame's progress, in order: the same call again, another
        // index, a renamed call, another choice, a name that needs escapes,
        // and back to a call seen before.
        let weather: Arc<str> = Arc::from("get_weather");
        let time: Arc<str> = Arc::from("get_time");
        // Another allocation of the same name, and a name of the same
        // length as another.
        let weather_again: Arc<str> = Arc::from("get_weather");
        let set_time: Arc<str> = Arc::from("set_time");
        let quoted: Arc<str> = Arc::from("say \"hi\"\n\u{1}");
        let empty: Arc<str> = Arc::from("");
        let frames: Vec<Vec<Progress<'_>>> = vec![
            vec![progress(0, 0, &weather, 3)],
            vec![progress(0, 0, &weather, 11)],
            vec![progress(0, 1, &weather, 2), progress(0, 0, &weather, 12)],
            vec![progress(0, 1, &time, 9)],
            vec![progress(2, 1, &time, 10)],
            vec![progress(0, 1, &time, 13)],
            vec![progress(0, 1, &set_time, 14)],
            vec![progress(0, 1, &quoted, 1)],
            vec![progress(0, 1, &empty, 0)],
            vec![progress(0, 0, &weather_again, 40)],
            vec![progress(0, 0, &weather, 41), progress(-1, 7, &time, 5)],
            // Parallel calls interleaved, and the same index in two
            // choices with two names.
            vec![progress(0, 1, &time, 6), progress(0, 0, &weather, 42)],
            vec![progress(3, 1, &set_time, 1), progress(0, 1, &time, 7)],
            vec![progress(3, 1, &set_time, 2), progress(0, 1, &time, 8)],
        ];
        // More calls than heads are kept, then the first again.
        let many: Vec<Progress<'_>> = (0..=MAX_HEADS as i64 + 2)
            .map(|index| progress(0, index, &set_time, 1))
            .collect();
        let frames: Vec<Vec<Progress<'_>>> = frames
            .into_iter()
            .chain([many, vec![progress(0, 0, &weather, 43)]])
            .collect();
        let mut batch = ProgressBatch::default();
        for frame in &frames {
            batch.clear();
            for p in frame {
                batch.push(p);
            }
            let got: Vec<&str> = batch.iter().collect();
            let want: Vec<String> = frame.iter().map(expected).collect();
            assert_eq!(got, want);
            assert_eq!(batch.last(), want.last().map(String::as_str));
        }
    }
}
