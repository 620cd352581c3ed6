//! `--format ndjson` and `--format messages`: one JSON object per line.
//!
//! This is the wire specification of both formats. Every line is a JSON
//! object followed by `\n`. New keys may appear in later versions;
//! consumers must ignore keys they do not know.
//!
//! ## `ndjson`: the seed's `ChatStreamChunk`
//!
//! One line per effect, in stream order:
//!
//! | line | when |
//! | --- | --- |
//! | `{"reasoningDelta":"…"}` | non-empty reasoning text (`reasoning_content`, `reasoning`, Ollama `thinking`, Mistral thinking parts) |
//! | `{"contentDelta":"…"}` | non-empty answer text |
//! | `{"toolCallProgress":{"index":0,"name":"get_weather","charsAccumulated":42}}` | every entry of every `tool_calls` delta, after it is applied |
//! | `{"done":true,"toolCalls":[…],"usage":{…}}` | once, at `[DONE]`, Ollama's `done: true`, or the end of input |
//! | `{"error":{…}}` | the upstream reported an error inside the stream: its `error` value, as it came (on one line); for vLLM's older `{"object":"error",…}`, that whole object |
//! | `{"unparsed":"…"}` | an event or line that could not be read as JSON, a JSON object that is no chunk (none of `choices`, `usage` and `error`), or an SSE event with a name of its own (`event: error`; not this tool's `toolCallProgress`, left out): its data, as a string (bytes that are not UTF-8 become U+FFFD; what comes after the end, an event too large to parse and one the input ended inside are left out, with a warning: the done line(s) stay last) |
//!
//! - `charsAccumulated` is the length of the arguments so far, unescaped, in
//!   UTF-16 code units (JavaScript `String.length`); the name is not counted.
//! - For a choice other than 0, text lines carry `"choice":k` and progress
//!   objects carry `"choice":k` inside `toolCallProgress`.
//! - `toolCalls` lists the assembled calls in index order:
//!   `{"id":"call_…","type":"function","function":{"name":"…","arguments":"…"}}`
//!   (`id` is `""` when the provider sent none); a custom tool's call
//!   (OpenAI's freeform tools, whose deltas carry `custom.name` and
//!   `custom.input`) is `{"id":…,"type":"custom","custom":{"name":…,"input":…}}`,
//!   and its progress counts its input. When several choices made
//!   tool calls, each gets its own `done` line, in choice order, with
//!   `"choice":k` for k > 0; with no tool calls at all there is one
//!   `{"done":true}`. A choice's `done` line has `"incomplete":true` when
//!   its answer may stop in the middle: its `finish_reason` (Ollama:
//!   `done_reason`) is `length`, `max_tokens`, `content_filter` or
//!   `error`; or it reported none (`null` and `""` are none) and the stream
//!   carried an error (anywhere, whatever came after it) or ended with
//!   neither `[DONE]` nor Ollama's `done`; or a frame of the stream could
//!   not be read (not JSON or not UTF-8, of an unexpected shape, or over
//!   `--max-event-bytes`), which may have held a piece of it; or calls
//!   past the stream's limit of 1,024 were refused, and are missing from
//!   `toolCalls`. Its calls'
//!   arguments may then be cut short, so do not run them blindly. Without
//!   tool calls, the one `done` line speaks for every choice the stream
//!   tracks (choice 0, and any that gave a `finish_reason`): it has it
//!   when any of their texts may stop in the middle. A choice
//!   without tool calls has no `done` line of its own when another choice
//!   has some, so its text's end is not told there (the `messages` line
//!   tells it).
//! - `usage` is `{"promptTokens":…,"completionTokens":…,"totalTokens":…}`,
//!   the last usage of the stream, on the last `done` line only, so it is
//!   counted once. Progress lines never carry text or usage: concatenating
//!   `contentDelta` gives exactly the upstream text.
//!
//! ## `messages`: the seed's `StreamChunkMessage`
//!
//! The same lines, each starting with `"sessionId":"…"`, without `toolCalls`
//! and `usage`: `{"sessionId":"s1","contentDelta":"…"}`,
//! `{"sessionId":"s1","toolCallProgress":{…}}`, `{"sessionId":"s1","error":{…}}`,
//! `{"sessionId":"s1","unparsed":"…"}`, and a single
//! `{"sessionId":"s1","done":true}` at the end, with `"incomplete":true`
//! when any choice's answer may stop in the middle (a text answer
//! included, which has no `done` line of its own in `ndjson` when another
//! choice made tool calls).

use std::fmt::Write;

use super::Sink;
pub use crate::chunk::TextField;
use crate::chunk::{ChunkText, HeldHalves, Usage};
use crate::js::push_string;
use crate::progress::{CallKind, ToolCallTracker};

/// Which line format.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LineFormat {
    /// `ChatStreamChunk` lines.
    Chunks,
    /// `StreamChunkMessage` lines for this session id.
    Messages { session_id: String },
}

/// Writes lines of one [`LineFormat`]; reuses one buffer for every line.
#[derive(Debug)]
pub struct LineEncoder {
    format: LineFormat,
    line: String,
    /// The text of the current fragment, unescaped.
    text: String,
    /// High surrogates held back for the next fragment.
    carries: HeldHalves,
}

impl LineEncoder {
    pub fn new(format: LineFormat) -> Self {
        LineEncoder {
            format,
            line: String::new(),
            text: String::new(),
            carries: HeldHalves::default(),
        }
    }

    /// A `contentDelta` or `reasoningDelta` line, of one fragment of the
    /// choice's text: a surrogate pair cut between two fragments is joined
    /// (the high one held back from the first line), so that the lines'
    /// texts, concatenated, are the upstream's text. Only the choice's
    /// next line can complete a held-back surrogate: a line of another of
    /// its fields, or of its progress, writes it as U+FFFD first, in its
    /// place.
    pub fn text(
        &mut self,
        out: &mut impl Sink,
        field: TextField,
        choice: i64,
        text: &ChunkText<'_>,
    ) {
        if !self.carries.is_empty() {
            self.write_carries(out, |c, f| c == choice && f != field);
        }
        if self.carries.passes(choice, field, text) {
            // Nearly every fragment: its text is its literal's, borrowed.
            self.text_line(out, field, choice, &text.get());
            return;
        }
        let mut fragment = std::mem::take(&mut self.text);
        fragment.clear();
        self.carries.join(choice, field, text, &mut fragment);
        if !fragment.is_empty() {
            self.text_line(out, field, choice, &fragment);
        }
        self.text = fragment;
    }

    /// Writes the held-back high surrogates that `which` picks, each as
    /// a line of U+FFFD, and forgets them: a line of anything else of
    /// their choice (another field, progress) or of the stream (an error,
    /// the end) comes between them and the fragment that could have
    /// completed them, and the lines stay in stream order. (Choices take
    /// turns in a stream with `n` > 1: a line of another choice leaves
    /// them held.)
    fn write_carries(&mut self, out: &mut impl Sink, which: impl Fn(i64, TextField) -> bool) {
        let mut carries = std::mem::take(&mut self.carries);
        carries.end(which, |choice, field| {
            self.text_line(out, field, choice, "\u{FFFD}");
        });
        self.carries = carries;
    }

    fn text_line(&mut self, out: &mut impl Sink, field: TextField, choice: i64, text: &str) {
        self.open();
        self.line.push_str(match field {
            TextField::Content => "\"contentDelta\":",
            TextField::Reasoning => "\"reasoningDelta\":",
        });
        push_string(text, &mut self.line);
        self.choice(choice);
        self.close(out);
    }

    /// A `toolCallProgress` line, from an object rendered by
    /// [`ProgressBatch`](super::ProgressBatch).
    pub fn progress(&mut self, out: &mut impl Sink, choice: i64, progress_json: &str) {
        if !self.carries.is_empty() {
            self.write_carries(out, |c, _| c == choice);
        }
        self.open();
        self.line.push_str("\"toolCallProgress\":");
        self.line.push_str(progress_json);
        self.close(out);
    }

    /// An `error` line: the upstream's `error` value, as it came, on one
    /// line (a raw line break can only lie between JSON tokens). As it
    /// came: what JavaScript reads and serde_json does not (a lone
    /// surrogate's escape, `1E400`) stays.
    pub fn error(&mut self, out: &mut impl Sink, raw: &str) {
        self.write_carries(out, |_, _| true);
        self.open();
        self.line.push_str("\"error\":");
        self.line.extend(crate::js::one_line(raw));
        self.close(out);
    }

    /// An `unparsed` line: the data of a frame that could not be read, as
    /// a string, so that nothing is lost.
    pub fn unparsed(&mut self, out: &mut impl Sink, data: &[u8]) {
        self.write_carries(out, |_, _| true);
        self.unparsed_line(out, data);
    }

    /// An `unparsed` line for a frame that is no chunk (a provider's named
    /// SSE event), which leaves the text around it whole: a high surrogate
    /// held back stays held for the low one that may follow.
    pub fn unparsed_between(&mut self, out: &mut impl Sink, data: &[u8]) {
        self.unparsed_line(out, data);
    }

    fn unparsed_line(&mut self, out: &mut impl Sink, data: &[u8]) {
        self.open();
        self.line.push_str("\"unparsed\":");
        push_string(&String::from_utf8_lossy(data), &mut self.line);
        self.close(out);
    }

    /// The final `done` line(s), after a line of U+FFFD for each high
    /// surrogate still held back (no fragment completed it).
    /// `stopped_early`: the stream had frames and ended with neither
    /// `[DONE]` nor Ollama's `done` ([`ToolCallTracker::cut_short`]).
    pub fn done(&mut self, out: &mut impl Sink, tracker: &ToolCallTracker, stopped_early: bool) {
        self.write_carries(out, |_, _| true);
        let cut_short = |choice| tracker.cut_short(choice, stopped_early);
        if matches!(self.format, LineFormat::Messages { .. }) {
            self.open();
            self.line.push_str("\"done\":true");
            // One line for every choice: any answer that may stop in the
            // middle makes it so.
            if tracker.any_cut_short(stopped_early) {
                self.line.push_str(",\"incomplete\":true");
            }
            return self.close(out);
        }
        let usage = tracker.usage();
        let choices = tracker.calls().count();
        if choices == 0 {
            self.open();
            self.line.push_str("\"done\":true");
            // The stream's one `done` line speaks for every choice: a text
            // answer cut short would end as a whole one does.
            if tracker.any_cut_short(stopped_early) {
                self.line.push_str(",\"incomplete\":true");
            }
            self.usage(usage);
            return self.close(out);
        }
        for (i, (choice, calls)) in tracker.calls().enumerate() {
            self.open();
            self.line.push_str("\"done\":true");
            self.choice(choice);
            self.line.push_str(",\"toolCalls\":[");
            for (j, call) in calls.iter().enumerate() {
                if j > 0 {
                    self.line.push(',');
                }
                self.line.push_str("{\"id\":");
                push_string(&call.id, &mut self.line);
                let (head, arguments) = match call.kind {
                    CallKind::Function => (
                        ",\"type\":\"function\",\"function\":{\"name\":",
                        ",\"arguments\":",
                    ),
                    CallKind::Custom => {
                        (",\"type\":\"custom\",\"custom\":{\"name\":", ",\"input\":")
                    }
                };
                self.line.push_str(head);
                push_string(&call.name, &mut self.line);
                self.line.push_str(arguments);
                push_string(&call.arguments(), &mut self.line);
                self.line.push_str("}}");
            }
            self.line.push(']');
            if cut_short(choice) {
                // Its last call's arguments may stop in the middle, or
                // lack the piece an unread frame held.
                self.line.push_str(",\"incomplete\":true");
            }
            if i + 1 == choices {
                self.usage(usage);
            }
            self.close(out);
        }
    }

    fn open(&mut self) {
        self.line.clear();
        self.line.push('{');
        if let LineFormat::Messages { session_id } = &self.format {
            self.line.push_str("\"sessionId\":");
            push_string(session_id, &mut self.line);
            self.line.push(',');
        }
    }

    fn choice(&mut self, choice: i64) {
        if choice != 0 {
            let _ = write!(self.line, ",\"choice\":{choice}");
        }
    }

    fn usage(&mut self, usage: Option<Usage>) {
        if let Some(u) = usage {
            let _ = write!(
                self.line,
                ",\"usage\":{{\"promptTokens\":{},\"completionTokens\":{},\"totalTokens\":{}}}",
                u.prompt_tokens, u.completion_tokens, u.total_tokens
            );
        }
    }

    fn close(&mut self, out: &mut impl Sink) {
        self.line.push_str("}\n");
        out.insert(self.line.as_bytes());
    }
}
