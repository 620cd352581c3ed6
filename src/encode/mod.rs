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
    /// openai-python and openai-node iterators
    Event,
    /// Add a chunk-shaped event with "choices":[] after the event; breaks code
    /// that reads the first choice unguarded
    Chunk,
    /// Add nothing: the output is the input, byte for byte
    None,
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
}

impl ProgressBatch {
    pub fn clear(&mut self) {
        self.json.clear();
        self.spans.clear();
    }

    pub fn push(&mut self, p: &Progress<'_>) {
        let start = self.json.len();
        write_progress(p, &mut self.json);
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

/// Renders one progress object.
pub fn write_progress(p: &Progress<'_>, out: &mut String) {
    // itoa, not `write!`: this runs once per tool-call delta.
    let mut digits = itoa::Buffer::new();
    out.push_str("{\"index\":");
    out.push_str(digits.format(p.index));
    out.push_str(",\"name\":");
    push_string(p.name, out);
    out.push_str(",\"charsAccumulated\":");
    out.push_str(digits.format(p.chars_accumulated));
    if p.choice != 0 {
        out.push_str(",\"choice\":");
        out.push_str(digits.format(p.choice));
    }
    out.push('}');
}
