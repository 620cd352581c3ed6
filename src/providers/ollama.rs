//! Ollama native `/api/chat` NDJSON lines (SPEC.md, "The protocol").
//!
//! Each line is one object: `message.content`, `message.thinking`, and
//! `message.tool_calls`, where every call arrives whole with its arguments as
//! a JSON object (also on the final `done: true` line). A call becomes one
//! [`ToolCallDelta`] whose arguments replace anything before, serialized as
//! `JSON.stringify` would. The `done: true` line carries the usage
//! (`prompt_eval_count`, `eval_count`) and ends the stream. `{"error": …}`
//! lines are reported as errors.
//!
//! Calls are numbered by `function.index` when Ollama sends it and that index
//! is still free in the stream (and at most 2^53 − 1, the largest integer a
//! JavaScript reader holds exactly), otherwise after the last call seen:
//! every Ollama call is a distinct, complete call, so two calls must never
//! share a number.

use serde::Deserialize;
use serde_json::value::RawValue;

use super::openai_chat::error_message;
use super::scan::{
    Bail, Cursor, Span, SpanMap, Template, first_time, from_rank, has_text, json_text,
};
use super::{
    ArgumentsView, DecoderState, FrameError, FrameInfo, JsonStr, OLLAMA_CHUNK_KEYS, ProbedText,
    counts, expect_object, is_set, raw_i64,
};
use crate::chunk::{ArgumentsDelta, Chunk, FinishKind, ToolCallDelta, Usage};

#[derive(Deserialize)]
struct LineView<'a> {
    #[serde(borrow, default)]
    message: Option<MessageView<'a>>,
    /// `/api/generate`'s text, where `/api/chat` has `message.content`.
    #[serde(borrow, default)]
    response: Option<JsonStr<'a>>,
    /// `/api/generate`'s reasoning, where `/api/chat` has
    /// `message.thinking`.
    #[serde(borrow, default)]
    thinking: Option<JsonStr<'a>>,
    #[serde(default)]
    done: Option<bool>,
    #[serde(borrow, default)]
    done_reason: Option<&'a RawValue>,
    #[serde(borrow, default)]
    prompt_eval_count: Option<&'a RawValue>,
    #[serde(borrow, default)]
    eval_count: Option<&'a RawValue>,
    #[serde(borrow, default)]
    error: Option<&'a RawValue>,
    #[serde(borrow, default, rename = "toolCallProgress")]
    tool_call_progress: Option<&'a RawValue>,
}

#[derive(Deserialize)]
struct MessageView<'a> {
    #[serde(borrow, default)]
    content: Option<JsonStr<'a>>,
    #[serde(borrow, default)]
    thinking: Option<JsonStr<'a>>,
    #[serde(borrow, default)]
    tool_calls: Option<Vec<ToolCallView<'a>>>,
}

#[derive(Deserialize)]
struct ToolCallView<'a> {
    #[serde(borrow, default)]
    id: Option<JsonStr<'a>>,
    #[serde(borrow, default)]
    function: Option<FunctionView<'a>>,
}

#[derive(Deserialize)]
struct FunctionView<'a> {
    #[serde(borrow, default)]
    index: Option<&'a RawValue>,
    #[serde(borrow, default)]
    name: Option<JsonStr<'a>>,
    #[serde(borrow, default)]
    arguments: Option<ArgumentsView<'a>>,
}

/// Decodes one NDJSON line.
pub fn decode<'a>(
    data: &'a str,
    state: &mut DecoderState,
    emit: &mut dyn FnMut(Chunk<'a>),
) -> Result<FrameInfo<'a>, FrameError> {
    let probed = std::mem::take(&mut state.probed);
    match state.lines.scan(data, probed) {
        Ok(line) => Ok(line.emit(data, emit)),
        Err(Bail) => decode_serde(data, state, emit),
    }
}

/// The serde path: lines with tool calls, and every line the fast path
/// gives up on.
pub(super) fn decode_serde<'a>(
    data: &'a str,
    state: &mut DecoderState,
    emit: &mut dyn FnMut(Chunk<'a>),
) -> Result<FrameInfo<'a>, FrameError> {
    expect_object(data)?;
    let view: LineView<'a> = serde_json::from_str(data)?;
    // Another API's line (or a line of nothing): passed on, and said.
    let chunk_like = view.message.is_some()
        || view.done.is_some()
        || is_set(view.error)
        || view.response.is_some()
        || view.thinking.is_some();
    if !chunk_like {
        return Err(FrameError::NotAChunk(OLLAMA_CHUNK_KEYS));
    }
    let done = view.done == Some(true);
    let mut info = FrameInfo::object(view.tool_call_progress.is_some());
    let finish = view.done_reason.and_then(|r| FinishKind::of(r.get()));
    info.set_finishes(done || finish.is_some());
    if let Some(error) = view.error.filter(|e| is_set(Some(e))) {
        emit(Chunk::Error {
            raw: error.get(),
            message: error_message(error.get()),
        });
    }
    let (thinking, content, calls) = match view.message {
        Some(message) => (message.thinking, message.content, message.tool_calls),
        None => (None, None, None),
    };
    // A line has `/api/chat`'s fields or `/api/generate`'s; one with both
    // gives the chat's first.
    for text in [thinking, view.thinking]
        .into_iter()
        .filter_map(JsonStr::non_empty)
    {
        emit(Chunk::Reasoning {
            choice: 0,
            text: text.into(),
        });
    }
    for text in [content, view.response]
        .into_iter()
        .filter_map(JsonStr::non_empty)
    {
        emit(Chunk::Text {
            choice: 0,
            text: text.into(),
        });
    }
    for call in calls.into_iter().flatten() {
        emit(Chunk::ToolCallDelta(whole_call(call, state)));
    }
    if done {
        emit(Chunk::Finish {
            choice: 0,
            kind: finish.unwrap_or(FinishKind::Whole),
        });
        if let Some(usage) = done_usage(
            view.prompt_eval_count.map(RawValue::get),
            view.eval_count.map(RawValue::get),
            emit,
        ) {
            emit(Chunk::Usage(usage));
        }
        emit(Chunk::Done);
    }
    Ok(info)
}

/// A done line's usage from its raw `prompt_eval_count` and `eval_count`
/// (both decoder paths): none when neither is a count, as an SSE stream
/// without `usage` has none; a missing one counts 0, and one that is no
/// count is emitted as ignored.
fn done_usage<'a>(
    prompt: Option<&'a str>,
    completion: Option<&'a str>,
    emit: &mut dyn FnMut(Chunk<'a>),
) -> Option<Usage> {
    let [prompt, completion] = counts(
        [(prompt, "prompt_eval_count"), (completion, "eval_count")],
        emit,
    );
    (prompt.is_some() || completion.is_some()).then(|| Usage::new(prompt, completion, None))
}

/// JavaScript's `Number.MAX_SAFE_INTEGER`: numbering stays far from
/// `i64::MAX`, where "after the last call" would have no room.
const MAX_SAFE_INTEGER: i64 = (1 << 53) - 1;

fn whole_call<'a>(call: ToolCallView<'a>, state: &mut DecoderState) -> ToolCallDelta<'a> {
    let (wire_index, name, arguments) = match call.function {
        Some(f) => (
            raw_i64(f.index.map(RawValue::get)),
            JsonStr::non_empty(f.name),
            f.arguments.map_or(ArgumentsDelta::Unchanged, |a| a.0),
        ),
        None => (None, None, ArgumentsDelta::Unchanged),
    };
    let index = match wire_index {
        Some(i) if i >= state.ollama_calls && i <= MAX_SAFE_INTEGER => i,
        _ => state.ollama_calls,
    };
    state.ollama_calls = index.saturating_add(1);
    // A whole call replaces: a string here is the complete arguments text.
    let arguments = match arguments {
        ArgumentsDelta::Append(text) => ArgumentsDelta::Replace(text.get().into_owned()),
        other @ (ArgumentsDelta::Replace(_) | ArgumentsDelta::Unchanged) => other,
    };
    ToolCallDelta {
        choice: 0,
        index: Some(index),
        id: JsonStr::non_empty(call.id),
        name,
        arguments,
        custom: false,
    }
}

// === the fast path ===
//
// Text and thinking lines (nearly all of a stream) are scanned with the
// validating cursor; a line with tool calls, or anything unusual, bails to
// serde, which also numbers the calls.

/// The fast path's memory of the last line; see [`Template`].
#[derive(Debug, Default)]
pub(crate) struct Lines {
    template: Template,
    learned: LineSpans,
    holes: Vec<Span>,
}

impl Lines {
    /// The spans of `data`'s values. `probed`: `data` is the line
    /// [`match_prefix`](Self::match_prefix) recognized last.
    fn scan(&mut self, data: &str, probed: bool) -> Result<LineSpans, Bail> {
        if (probed || self.template.matches(data, &mut self.holes))
            && let Ok(line) = self.learned.map(&mut |span| from_rank(&self.holes, span))
        {
            return Ok(line);
        }
        let mut c = Cursor::new(data, std::mem::take(&mut self.holes));
        let line = walk(&mut c);
        self.holes = c.into_holes();
        let line = line?;
        self.template.learn(data, &self.holes);
        // Only a line whose every span is a hole can be moved.
        match line.map(&mut |span| self.template.to_rank(span)) {
            Ok(ranks) => self.learned = ranks,
            Err(Bail) => self.template.forget(),
        }
        Ok(line)
    }

    /// See [`DecoderState::match_prefix`]: the holes it finds are the line
    /// at hand's.
    pub(super) fn match_prefix(&mut self, text: &str) -> Option<usize> {
        self.template.match_prefix(text, &mut self.holes)
    }

    /// What the line [`match_prefix`](Self::match_prefix) just recognized
    /// holds, when it holds text and nothing else: the chunks
    /// [`decode`] would emit for it are then only these, and they change
    /// nothing but the phase. `None` for any other line (a call, `done`,
    /// an error, usage), or one whose values the template does not hold.
    pub(super) fn probed_text(&self) -> Option<ProbedText> {
        let line = &self.learned;
        let other = line.done
            || line.done_reason.is_some()
            || line.prompt_eval_count.is_some()
            || line.eval_count.is_some()
            || line.error.is_some();
        if other {
            return None;
        }
        Some(ProbedText {
            reasoning: has_text(&self.holes, line.thinking).ok()?,
            content: has_text(&self.holes, line.content).ok()?,
        })
    }
}

/// Where one line's values are.
#[derive(Debug, Default, Clone, Copy)]
struct LineSpans {
    content: Option<Span>,
    thinking: Option<Span>,
    done: bool,
    done_reason: Option<Span>,
    prompt_eval_count: Option<Span>,
    eval_count: Option<Span>,
    error: Option<Span>,
    annotated: bool,
}

/// Walks a whole line.
fn walk(c: &mut Cursor<'_>) -> Result<LineSpans, Bail> {
    let mut line = LineSpans::default();
    let mut seen = 0;
    // One of a chunk's keys came (`OLLAMA_CHUNK_KEYS`); without, serde
    // says the line is none.
    let mut chunk_like = false;
    let mut walk = c.object()?;
    while let Some(key) = c.key(&mut walk)? {
        match key {
            b"message" => {
                first_time(&mut seen, 1)?;
                if !c.null()? {
                    chunk_like = true;
                    let mut seen = 0;
                    let mut message = c.object()?;
                    while let Some(key) = c.key(&mut message)? {
                        match key {
                            b"content" => {
                                first_time(&mut seen, 1)?;
                                text_once(&mut line.content, c.optional_string()?)?;
                            }
                            b"thinking" => {
                                first_time(&mut seen, 2)?;
                                text_once(&mut line.thinking, c.optional_string()?)?;
                            }
                            b"tool_calls" => {
                                first_time(&mut seen, 4)?;
                                if !c.null()? {
                                    return Err(Bail);
                                }
                            }
                            _ => {
                                c.value()?;
                            }
                        }
                    }
                }
            }
            b"done" => {
                first_time(&mut seen, 2)?;
                // `true`, `false` and `null` are part of a template's bytes.
                line.done = match c.peek() {
                    Some(b't') => {
                        c.value()?;
                        chunk_like = true;
                        true
                    }
                    Some(b'f') => {
                        c.value()?;
                        chunk_like = true;
                        false
                    }
                    Some(b'n') => {
                        c.value()?;
                        false
                    }
                    _ => return Err(Bail),
                };
            }
            b"response" => {
                first_time(&mut seen, 128)?;
                let text = c.optional_string()?;
                chunk_like |= text.is_some();
                text_once(&mut line.content, text)?;
            }
            b"thinking" => {
                first_time(&mut seen, 256)?;
                let text = c.optional_string()?;
                chunk_like |= text.is_some();
                text_once(&mut line.thinking, text)?;
            }
            b"done_reason" => {
                first_time(&mut seen, 4)?;
                line.done_reason = c.optional()?;
            }
            b"prompt_eval_count" => {
                first_time(&mut seen, 8)?;
                line.prompt_eval_count = c.optional()?;
            }
            b"eval_count" => {
                first_time(&mut seen, 16)?;
                line.eval_count = c.optional()?;
            }
            b"error" => {
                first_time(&mut seen, 32)?;
                line.error = c.optional()?;
                chunk_like |= line.error.is_some();
            }
            b"toolCallProgress" => {
                first_time(&mut seen, 64)?;
                line.annotated = c.optional()?.is_some();
            }
            _ => {
                c.value()?;
            }
        }
    }
    c.end()?;
    if !chunk_like {
        return Err(Bail);
    }
    Ok(line)
}

/// `text` into `slot`, which a line's chat and generate fields share: a
/// line with both is left to serde.
fn text_once(slot: &mut Option<Span>, text: Option<Span>) -> Result<(), Bail> {
    if text.is_some() {
        if slot.is_some() {
            return Err(Bail);
        }
        *slot = text;
    }
    Ok(())
}

impl LineSpans {
    /// This line with each span mapped by `f` (to a hole rank and back).
    fn map(&self, f: &mut SpanMap<'_>) -> Result<LineSpans, Bail> {
        Ok(LineSpans {
            content: f(self.content)?,
            thinking: f(self.thinking)?,
            done_reason: f(self.done_reason)?,
            prompt_eval_count: f(self.prompt_eval_count)?,
            eval_count: f(self.eval_count)?,
            error: f(self.error)?,
            ..*self
        })
    }

    /// The chunks of a scanned line, in the serde path's order.
    fn emit<'a>(&self, data: &'a str, emit: &mut dyn FnMut(Chunk<'a>)) -> FrameInfo<'a> {
        let raw = |span: Option<Span>| span.map(|s| s.of(data));
        let mut info = FrameInfo::object(self.annotated);
        let finish = raw(self.done_reason).and_then(FinishKind::of);
        info.set_finishes(self.done || finish.is_some());
        if let Some(error) = raw(self.error) {
            emit(Chunk::Error {
                raw: error,
                message: error_message(error),
            });
        }
        if let Some(text) = json_text(data, self.thinking) {
            emit(Chunk::Reasoning { choice: 0, text });
        }
        if let Some(text) = json_text(data, self.content) {
            emit(Chunk::Text { choice: 0, text });
        }
        if self.done {
            emit(Chunk::Finish {
                choice: 0,
                kind: finish.unwrap_or(FinishKind::Whole),
            });
            if let Some(usage) = done_usage(raw(self.prompt_eval_count), raw(self.eval_count), emit)
            {
                emit(Chunk::Usage(usage));
            }
            emit(Chunk::Done);
        }
        info
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chunks<'a>(data: &'a str, state: &mut DecoderState) -> Vec<Chunk<'a>> {
        let mut out = Vec::new();
        decode(data, state, &mut |c| out.push(c)).expect("decodes");
        out
    }

    #[test]
    fn thinking_content_and_whole_calls() {
        let mut state = DecoderState::default();
        let line = r#"{"model":"m","message":{"role":"assistant","content":"","thinking":"hmm","tool_calls":[{"function":{"name":"get_weather","arguments":{"city":"東京","n":1.0}}},{"function":{"name":"b","arguments":{}}}]},"done":false}"#;
        let out = chunks(line, &mut state);
        assert_eq!(
            out[0],
            Chunk::Reasoning {
                choice: 0,
                text: "hmm".into()
            }
        );
        let Chunk::ToolCallDelta(first) = &out[1] else {
            panic!("{out:?}")
        };
        assert_eq!(first.index, Some(0));
        assert_eq!(
            first.arguments,
            ArgumentsDelta::Replace(r#"{"city":"東京","n":1}"#.into())
        );
        let Chunk::ToolCallDelta(second) = &out[2] else {
            panic!("{out:?}")
        };
        assert_eq!(second.index, Some(1));
        assert_eq!(out.len(), 3);
    }

    #[test]
    fn wire_indexes_that_repeat_do_not_merge_calls() {
        let mut state = DecoderState::default();
        let line = r#"{"message":{"tool_calls":[{"function":{"index":0,"name":"a","arguments":{}}}]},"done":false}"#;
        let first = chunks(line, &mut state);
        let second = chunks(line, &mut state);
        let index = |c: &[Chunk]| match &c[0] {
            Chunk::ToolCallDelta(d) => d.index,
            other => panic!("{other:?}"),
        };
        assert_eq!((index(&first), index(&second)), (Some(0), Some(1)));
    }

    /// A done line without `prompt_eval_count` and `eval_count` (an
    /// Ollama-compatible server that counts nothing) has no usage; it had
    /// one of zeros. With one of them, the other counts 0 (Ollama leaves
    /// `prompt_eval_count` out when the whole prompt was cached).
    #[test]
    fn a_done_line_without_counts_has_no_usage() {
        let mut state = DecoderState::default();
        for (line, usage) in [
            (
                r#"{"message":{"role":"assistant","content":""},"done":true}"#,
                None,
            ),
            (
                r#"{"message":{"role":"assistant","content":""},"done":true,"eval_count":5}"#,
                Some(Usage {
                    prompt_tokens: 0,
                    completion_tokens: 5,
                    total_tokens: 5,
                }),
            ),
        ] {
            let mut expected = vec![Chunk::Finish {
                choice: 0,
                kind: FinishKind::Whole,
            }];
            expected.extend(usage.map(Chunk::Usage));
            expected.push(Chunk::Done);
            assert_eq!(chunks(line, &mut state), expected, "{line}");
        }
    }

    #[test]
    fn done_line_has_usage_and_ends() {
        let mut state = DecoderState::default();
        let line = r#"{"message":{"role":"assistant","content":""},"done_reason":"stop","done":true,"prompt_eval_count":10,"eval_count":5}"#;
        assert_eq!(
            chunks(line, &mut state),
            vec![
                Chunk::Finish {
                    choice: 0,
                    kind: FinishKind::Whole
                },
                Chunk::Usage(Usage {
                    prompt_tokens: 10,
                    completion_tokens: 5,
                    total_tokens: 15
                }),
                Chunk::Done,
            ]
        );
    }
}
