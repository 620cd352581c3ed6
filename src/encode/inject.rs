//! The annotated passthrough: a frame's raw bytes, verbatim, plus progress
//! as the inject mode says (SPEC.md, "Injection into an SSE stream").
//!
//! - `field`: `,"toolCallProgress":{…}` is inserted before the last `}` of
//!   the frame's JSON object, found by the framer without re-encoding
//!   anything. When one frame updated several calls, `"toolCallsProgress":[…]`
//!   lists them all, in order, and `toolCallProgress` is the last. Used for
//!   SSE events and NDJSON lines alike.
//! - `comment`: after the event, one `: toolCallProgress {…}` line per
//!   progress, then a blank line (so clients that split on blank lines see a
//!   comment-only block, which they skip).
//! - `event`: after the event, one `event: toolCallProgress` event each.
//! - `chunk`: after the event, one unnamed event each shaped like a chunk
//!   (same `id`, `object`, `created`, `model`, verbatim), `"choices":[]`;
//!   never after a finish or usage chunk, whose position SDKs rely on. A
//!   usage chunk has no choices, so no progress; a chunk that carries
//!   usage beside its choices (Gemini's, every one; vLLM's with continuous
//!   usage) is no usage chunk, and gets its progress chunk.
//! - `none`: nothing.
//!
//! Nothing is ever added inside `delta`, nor under a key named `error`, nor
//! to a frame that already has a `toolCallProgress` (so in `field` mode,
//! annotating an annotated stream changes nothing; the other modes add their
//! events again).

use super::{InjectMode, ProgressBatch, Sink};
use crate::providers::FrameInfo;

/// Everything the encoder needs to know about one frame.
pub struct Frame<'a, 'i> {
    /// The frame's exact input bytes.
    pub raw: &'a [u8],
    /// Offset in `raw` of the JSON object's closing `}`, if any.
    pub closing_brace: Option<usize>,
    /// The line break to use for added lines.
    pub line_ending: &'static [u8],
    /// What the decoder learned, when it could decode the frame.
    pub info: Option<&'a FrameInfo<'i>>,
}

/// Writes one frame, with its progress inside it (`field`), and renders in
/// `after` what goes after it (`comment`, `event`, `chunk`; empty
/// otherwise), for the caller to insert now or, when the frame's line
/// ending is not known yet, once it is.
pub fn write_frame(
    out: &mut impl Sink,
    frame: &Frame<'_, '_>,
    mode: InjectMode,
    progress: &ProgressBatch,
    after: &mut String,
) {
    after.clear();
    let info = match frame.info {
        Some(info) if !progress.is_empty() && !info.already_annotated() => info,
        _ => return out.forward(frame.raw),
    };
    let scratch = after;
    match mode {
        InjectMode::None => return out.forward(frame.raw),
        InjectMode::Field => {
            let Some(brace) = frame.closing_brace.filter(|_| info.is_object()) else {
                return out.forward(frame.raw);
            };
            let (before, after) = frame.raw.split_at(brace);
            let empty_object = before
                .iter()
                .rev()
                .find(|b| !b.is_ascii_whitespace())
                .is_some_and(|b| *b == b'{');
            if !empty_object {
                scratch.push(',');
            }
            if progress.len() > 1 {
                scratch.push_str("\"toolCallsProgress\":[");
                for (i, p) in progress.iter().enumerate() {
                    if i > 0 {
                        scratch.push(',');
                    }
                    scratch.push_str(p);
                }
                scratch.push_str("],");
            }
            scratch.push_str("\"toolCallProgress\":");
            scratch.push_str(progress.last().unwrap_or("{}"));
            out.forward(before);
            out.insert(scratch.as_bytes());
            out.forward(after);
            scratch.clear();
            return;
        }
        InjectMode::Comment => {
            for p in progress.iter() {
                scratch.push_str(": toolCallProgress ");
                scratch.push_str(p);
                push_line_end(scratch, frame.line_ending);
            }
            push_line_end(scratch, frame.line_ending);
        }
        InjectMode::Event => {
            for p in progress.iter() {
                scratch.push_str("event: toolCallProgress");
                push_line_end(scratch, frame.line_ending);
                scratch.push_str("data: ");
                scratch.push_str(p);
                push_line_end(scratch, frame.line_ending);
                push_line_end(scratch, frame.line_ending);
            }
        }
        InjectMode::Chunk => {
            if info.finishes() {
                scratch.clear();
                return out.forward(frame.raw);
            }
            for p in progress.iter() {
                scratch.push_str("data: {");
                for (key, value) in [
                    ("id", info.id),
                    ("object", info.object),
                    ("created", info.created),
                    ("model", info.model),
                ] {
                    if let Some(value) = value {
                        scratch.push('"');
                        scratch.push_str(key);
                        scratch.push_str("\":");
                        // A value from a multi-line `data` can hold line
                        // breaks; in JSON they are whitespace outside
                        // strings (inside, they are escaped), so dropping
                        // them keeps the value and the `data:` line whole.
                        scratch.extend(value.chars().filter(|c| !matches!(c, '\r' | '\n')));
                        scratch.push(',');
                    }
                }
                scratch.push_str("\"choices\":[],\"toolCallProgress\":");
                scratch.push_str(p);
                scratch.push('}');
                push_line_end(scratch, frame.line_ending);
                push_line_end(scratch, frame.line_ending);
            }
        }
    }
    out.forward(frame.raw);
}

fn push_line_end(s: &mut String, line_ending: &[u8]) {
    // Line endings are ASCII: "\n", "\r\n" or "\r".
    s.extend(line_ending.iter().map(|&b| char::from(b)));
}
