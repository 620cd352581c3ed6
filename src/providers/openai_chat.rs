//! OpenAI-compatible `chat.completion.chunk` frames (SPEC.md, "Decoding
//! rules").
//!
//! Reads, per choice: `delta.content` (a string, or Mistral's array of
//! parts), `delta.reasoning_content` (DeepSeek, Qwen), `delta.reasoning`
//! (OpenRouter, Groq), `delta.tool_calls`, `finish_reason`; at the top level
//! `usage` (or Groq's `x_groq.usage`) and a mid-stream `error`. `[DONE]`
//! ends the stream. Everything else in a chunk is ignored, never rejected.
//!
//! Index resolution for entries without `index` is not done here: the
//! decoder reports what the provider sent and
//! [`ToolCallTracker`](crate::progress::ToolCallTracker) resolves it.

use serde::Deserialize;
use serde_json::value::RawValue;

use serde::de::{self, Deserializer};

use super::scan::{
    Bail, Cursor, Span, SpanMap, Template, first_time, from_rank, has_text, json_text, text,
};
use super::{
    ArgumentsView, DecoderState, FieldShape, FrameError, FrameInfo, JsonStr, Lenient, ProbedText,
    counts, decode_string, expect_object, is_set, raw_i64,
};
use crate::chunk::{
    ArgumentsDelta, Chunk, ChunkText, FinishKind, JsonLiteral, ToolCallDelta, Usage,
};

#[derive(Deserialize)]
struct ChunkView<'a> {
    #[serde(borrow, default)]
    choices: Option<Vec<ChoiceView<'a>>>,
    #[serde(borrow, default)]
    usage: Option<Lenient<'a, UsageView<'a>>>,
    #[serde(borrow, default)]
    x_groq: Option<Lenient<'a, XGroqView<'a>>>,
    #[serde(borrow, default)]
    error: Option<&'a RawValue>,
    #[serde(borrow, default)]
    id: Option<&'a RawValue>,
    #[serde(borrow, default)]
    object: Option<&'a RawValue>,
    #[serde(borrow, default)]
    created: Option<&'a RawValue>,
    #[serde(borrow, default)]
    model: Option<&'a RawValue>,
    #[serde(borrow, default, rename = "toolCallProgress")]
    tool_call_progress: Option<&'a RawValue>,
}

#[derive(Deserialize)]
struct ChoiceView<'a> {
    #[serde(borrow, default)]
    index: Option<&'a RawValue>,
    #[serde(borrow, default)]
    delta: Option<DeltaView<'a>>,
    #[serde(borrow, default)]
    finish_reason: Option<&'a RawValue>,
}

#[derive(Deserialize)]
struct DeltaView<'a> {
    #[serde(borrow, default)]
    content: Option<ContentView<'a>>,
    #[serde(borrow, default)]
    reasoning_content: Option<Lenient<'a, JsonStr<'a>>>,
    #[serde(borrow, default)]
    reasoning: Option<Lenient<'a, JsonStr<'a>>>,
    #[serde(borrow, default)]
    tool_calls: Option<Vec<ToolCallView<'a>>>,
}

#[derive(Deserialize)]
struct ToolCallView<'a> {
    #[serde(borrow, default)]
    index: Option<&'a RawValue>,
    #[serde(borrow, default)]
    id: Option<Lenient<'a, JsonStr<'a>>>,
    #[serde(borrow, default)]
    function: Option<FunctionView<'a>>,
    #[serde(borrow, default)]
    custom: Option<CustomView<'a>>,
}

/// A custom (freeform) tool's payload: its text input is what a function's
/// arguments are.
#[derive(Deserialize)]
struct CustomView<'a> {
    #[serde(borrow, default)]
    name: Option<Lenient<'a, JsonStr<'a>>>,
    #[serde(borrow, default)]
    input: Option<ArgumentsView<'a>>,
}

#[derive(Deserialize)]
struct FunctionView<'a> {
    #[serde(borrow, default)]
    name: Option<Lenient<'a, JsonStr<'a>>>,
    #[serde(borrow, default)]
    arguments: Option<ArgumentsView<'a>>,
}

#[derive(Deserialize)]
struct UsageView<'a> {
    #[serde(borrow, default)]
    prompt_tokens: Option<&'a RawValue>,
    #[serde(borrow, default)]
    completion_tokens: Option<&'a RawValue>,
    #[serde(borrow, default)]
    total_tokens: Option<&'a RawValue>,
}

#[derive(Deserialize)]
struct XGroqView<'a> {
    #[serde(borrow, default)]
    usage: Option<UsageView<'a>>,
}

impl FieldShape for UsageView<'_> {
    const OBJECT: bool = true;
}

impl FieldShape for XGroqView<'_> {
    const OBJECT: bool = true;
}

impl FieldShape for PartView<'_> {
    const OBJECT: bool = true;
}

impl FieldShape for TextPartView<'_> {
    const OBJECT: bool = true;
}

/// `delta.content`: a string, or Mistral's array of typed parts; anything
/// else carries no text.
type ContentView<'a> = Content<'a, PartView<'a>>;

/// A Mistral thinking part's `thinking`: a string, or parts of which only
/// the text is read. Nothing nested deeper is decoded, so a value nested
/// without end costs no stack (serde's depth limit starts again with each
/// `Content`, which parses its array anew).
type ThinkingView<'a> = Content<'a, TextPartView<'a>>;

/// A string, an array of parts `P` (each passed over when it is not of
/// `P`'s shape), or anything else (no text).
enum Content<'a, P> {
    Text(JsonStr<'a>),
    Parts(Vec<Lenient<'a, P>>),
    Other,
}

/// A Mistral content part: `{"type":"text","text":…}` or
/// `{"type":"thinking","thinking":[{"type":"text","text":…}]}`.
#[derive(Deserialize)]
struct PartView<'a> {
    #[serde(borrow, default, rename = "type")]
    kind: Option<JsonStr<'a>>,
    #[serde(borrow, default)]
    text: Option<JsonStr<'a>>,
    #[serde(borrow, default)]
    thinking: Option<ThinkingView<'a>>,
}

/// A part of a thinking part: its text.
#[derive(Deserialize)]
struct TextPartView<'a> {
    #[serde(borrow, default)]
    text: Option<JsonStr<'a>>,
}

impl<'de: 'a, 'a, P: Deserialize<'de> + FieldShape> Deserialize<'de> for Content<'a, P> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let raw: &'de RawValue = Deserialize::deserialize(d)?;
        let json = raw.get();
        if let Some(text) = decode_string(json) {
            return Ok(Content::Text(JsonStr(text)));
        }
        if json.starts_with('[') {
            let parts = serde_json::from_str(json).map_err(de::Error::custom)?;
            return Ok(Content::Parts(parts));
        }
        Ok(Content::Other)
    }
}

/// The names of a top-level `usage`'s members, for [`counts`]' warnings.
const USAGE_FIELDS: [&str; 3] = [
    "usage.prompt_tokens",
    "usage.completion_tokens",
    "usage.total_tokens",
];

/// The same in Groq's `x_groq.usage`.
const GROQ_USAGE_FIELDS: [&str; 3] = [
    "x_groq.usage.prompt_tokens",
    "x_groq.usage.completion_tokens",
    "x_groq.usage.total_tokens",
];

/// A usage from its raw members, the members named `fields`; one that is
/// no count is emitted as ignored (both decoder paths).
fn usage_of<'a>(
    [prompt, completion, total]: [Option<&'a str>; 3],
    fields: [&'static str; 3],
    emit: &mut dyn FnMut(Chunk<'a>),
) -> Usage {
    let [prompt, completion, total] = counts(
        [
            (prompt, fields[0]),
            (completion, fields[1]),
            (total, fields[2]),
        ],
        emit,
    );
    Usage::new(prompt, completion, total)
}

impl<'a> UsageView<'a> {
    fn members(&self) -> [Option<&'a str>; 3] {
        [
            self.prompt_tokens.map(RawValue::get),
            self.completion_tokens.map(RawValue::get),
            self.total_tokens.map(RawValue::get),
        ]
    }
}

/// Decodes one SSE event's data.
pub fn decode<'a>(
    data: &'a str,
    state: &mut DecoderState,
    emit: &mut dyn FnMut(Chunk<'a>),
) -> Result<FrameInfo<'a>, FrameError> {
    let probed = std::mem::take(&mut state.probed);
    if !data.starts_with('{') && data.trim() == "[DONE]" {
        emit(Chunk::Done);
        return Ok(FrameInfo::default());
    }
    let spans = &mut state.spans;
    let head = !state.without_frame_head;
    match spans.scan(data, head, probed) {
        Ok(Scanned::Steady(call)) => Ok(spans.emit_steady(data, call, head, emit)),
        Ok(Scanned::Spans(top)) => Ok(spans.emit(data, &top, head, emit)),
        Err(Bail) => decode_serde(data, emit),
    }
}

/// The serde path: every frame the fast path gives up on, with the
/// answers and error messages it always gave.
pub(super) fn decode_serde<'a>(
    data: &'a str,
    emit: &mut dyn FnMut(Chunk<'a>),
) -> Result<FrameInfo<'a>, FrameError> {
    expect_object(data)?;
    // The whole frame is parsed here; from now on nothing can fail, so a
    // bad frame emits no chunk at all.
    let view: ChunkView<'a> = serde_json::from_str(data)?;
    let groq_usage = matches!(&view.x_groq, Some(Lenient::Fit(x)) if x.usage.is_some());
    if view.choices.is_none() && view.usage.is_none() && !groq_usage && !is_set(view.error) {
        // vLLM's older errors: `{"object":"error","message":…}`.
        if view.object.map(RawValue::get) == Some("\"error\"") {
            let raw = data.trim();
            emit(Chunk::Error {
                raw,
                message: error_message(raw),
            });
            return Ok(FrameInfo::object(view.tool_call_progress.is_some()));
        }
        return Err(FrameError::NotAChunk(super::OPENAI_CHUNK_KEYS));
    }
    let mut info = FrameInfo {
        id: view.id.map(RawValue::get),
        object: view.object.map(RawValue::get),
        created: view.created.map(RawValue::get),
        model: view.model.map(RawValue::get),
        ..FrameInfo::object(view.tool_call_progress.is_some())
    };
    if let Some(error) = view.error.filter(|e| is_set(Some(e))) {
        emit(Chunk::Error {
            raw: error.get(),
            message: error_message(error.get()),
        });
    }
    for choice in view.choices.into_iter().flatten() {
        let k = raw_i64(choice.index.map(RawValue::get)).unwrap_or(0);
        if let Some(delta) = choice.delta {
            decode_delta(k, delta, emit);
        }
        if let Some(kind) = choice.finish_reason.and_then(|r| FinishKind::of(r.get())) {
            info.set_finishes(true);
            emit(Chunk::Finish { choice: k, kind });
        }
    }
    let usage = Lenient::fit(view.usage, "usage", emit).map(|u| (u, USAGE_FIELDS));
    let groq = Lenient::fit(view.x_groq, "x_groq", emit);
    let usage = usage.or_else(|| groq.and_then(|x| x.usage).map(|u| (u, GROQ_USAGE_FIELDS)));
    if let Some((usage, fields)) = usage {
        let usage = usage_of(usage.members(), fields, emit);
        emit(Chunk::Usage(usage));
    }
    Ok(info)
}

fn decode_delta<'a>(choice: i64, delta: DeltaView<'a>, emit: &mut dyn FnMut(Chunk<'a>)) {
    // Some servers (newer vLLM) send the same text as both fields.
    let reasoning_content = Lenient::fit(delta.reasoning_content, "delta.reasoning_content", emit);
    let reasoning = Lenient::fit(delta.reasoning, "delta.reasoning", emit);
    let reasoning = JsonStr::non_empty(reasoning_content).or_else(|| JsonStr::non_empty(reasoning));
    if let Some(text) = reasoning {
        emit(Chunk::Reasoning {
            choice,
            text: text.into(),
        });
    }
    if let Some(content) = delta.content {
        decode_content(choice, content, emit);
    }
    for call in delta.tool_calls.into_iter().flatten() {
        let (name, arguments, custom) = match (call.function, call.custom) {
            (Some(f), _) => (
                JsonStr::non_empty(Lenient::fit(f.name, "function.name", emit)),
                f.arguments.map_or(ArgumentsDelta::Unchanged, |a| a.0),
                false,
            ),
            (None, Some(c)) => (
                JsonStr::non_empty(Lenient::fit(c.name, "custom.name", emit)),
                c.input.map_or(ArgumentsDelta::Unchanged, |a| a.0),
                true,
            ),
            (None, None) => (None, ArgumentsDelta::Unchanged, false),
        };
        let id = JsonStr::non_empty(Lenient::fit(call.id, "tool_calls[].id", emit));
        emit(Chunk::ToolCallDelta(ToolCallDelta {
            choice,
            index: raw_i64(call.index.map(RawValue::get)),
            id,
            name,
            arguments,
            custom,
        }));
    }
}

/// Emits the text of `delta.content` (or of a Mistral thinking part's
/// `thinking`): a string is answer text, parts of type `text` too, parts of
/// type `thinking` reasoning.
fn decode_content<'a>(choice: i64, content: ContentView<'a>, emit: &mut dyn FnMut(Chunk<'a>)) {
    match content {
        Content::Text(text) => {
            if let Some(text) = JsonStr::non_empty(Some(text)) {
                emit(Chunk::Text {
                    choice,
                    text: text.into(),
                });
            }
        }
        Content::Parts(parts) => {
            for part in parts {
                let Some(part) = Lenient::fit(Some(part), "delta.content", emit) else {
                    continue;
                };
                match part.kind.as_ref().map(|k| k.0.as_ref()) {
                    Some("thinking") => {
                        if let Some(thinking) = part.thinking {
                            decode_thinking(choice, thinking, emit);
                        }
                    }
                    Some("text") | None => {
                        if let Some(text) = JsonStr::non_empty(part.text) {
                            emit(Chunk::Text {
                                choice,
                                text: text.into(),
                            });
                        }
                    }
                    Some(_) => {}
                }
            }
        }
        Content::Other => {}
    }
}

/// A Mistral thinking part's `thinking`: a string or an array of text parts,
/// all reasoning.
fn decode_thinking<'a>(choice: i64, thinking: ThinkingView<'a>, emit: &mut dyn FnMut(Chunk<'a>)) {
    match thinking {
        Content::Text(text) => {
            if let Some(text) = JsonStr::non_empty(Some(text)) {
                emit(Chunk::Reasoning {
                    choice,
                    text: text.into(),
                });
            }
        }
        Content::Parts(parts) => {
            for part in parts {
                let part = Lenient::fit(Some(part), "delta.content", emit);
                if let Some(text) = part.and_then(|p| JsonStr::non_empty(p.text)) {
                    emit(Chunk::Reasoning {
                        choice,
                        text: text.into(),
                    });
                }
            }
        }
        Content::Other => {}
    }
}

/// The human part of an error value: `error.message`, or the value itself.
pub(crate) fn error_message(error: &str) -> String {
    #[derive(Deserialize)]
    struct ErrorView {
        message: Option<String>,
    }
    if let Ok(ErrorView {
        message: Some(message),
    }) = serde_json::from_str(error)
    {
        return message;
    }
    serde_json::from_str::<String>(error).unwrap_or_else(|_| error.to_owned())
}

// === the fast path ===
//
// `Spans::scan` walks the frame once with a validating cursor and notes
// where the values progress needs are; nothing is emitted until the whole
// frame has proved valid, then `Spans::emit` turns the spans into chunks in
// the serde path's order. Anything unusual (Mistral content parts, object
// arguments, a value of the wrong type, a duplicate key) bails to serde.

/// Where one frame's values are; reused from frame to frame.
#[derive(Debug, Default)]
pub(crate) struct Spans {
    choices: Vec<ChoiceSpans>,
    calls: Vec<CallSpans>,
    /// The last valid frame's shape, its spans in its bytes…
    shape: Shape,
    /// … and the holes of the frame at hand.
    holes: Vec<Span>,
    /// Frames in a row that had neither the learned shape nor one of the
    /// thread's ([`RECENT_SHAPES`]); from [`RECALL_GIVES_UP`] on, the
    /// stream stops asking the thread's.
    recall_misses: u8,
}

/// A valid frame's shape: its template, and the spans the decoder took
/// from it as hole ranks.
#[derive(Debug, Default)]
struct Shape {
    template: Template,
    top: TopSpans,
    choices: Vec<ChoiceSpans>,
    calls: Vec<CallSpans>,
    /// The shape, when it is the steady one of a streaming call.
    steady: Option<SteadyCall>,
    /// The shape, when its frames hold text and nothing else.
    text_only: Option<TextOnly>,
}

impl Shape {
    /// Becomes a copy of `other`, in the buffers this one already has.
    fn copy_from(&mut self, other: &Shape) {
        // Every field named, so that a new one is not forgotten here.
        let Shape {
            template,
            top,
            choices,
            calls,
            steady,
            text_only,
        } = other;
        self.template.copy_from(template);
        self.top = *top;
        self.choices.clone_from(choices);
        self.calls.clone_from(calls);
        self.steady = *steady;
        self.text_only = *text_only;
    }
}

/// How many shapes a thread keeps for its streams ([`RECENT_SHAPES`]).
const SHAPES_KEPT: usize = 8;

/// The longest frame whose shape a thread keeps: a template holds its
/// frame's bytes.
const SHAPE_BYTES_KEPT: usize = 4096;

/// Frames in a row without a known shape after which a stream stops
/// looking in its thread's shapes.
const RECALL_GIVES_UP: u8 = 8;

thread_local! {
    /// The shapes this thread learned last, the most recently used first.
    /// Each stream learns its own, but most streams a thread serves have
    /// the same few: the role chunk, text, a call's announcement, its
    /// arguments, the finish. A frame whose shape is not the stream's
    /// current one is matched against these before it is walked: a new
    /// stream's first frames, and a stream that goes from text to a call,
    /// are then matched rather than walked. Which shape a frame is matched
    /// with changes nothing it decodes to: a match proves the frame's
    /// structure whichever frame taught it (see [`Template`]).
    /// BENCHMARKS.md, forty-second round.
    static RECENT_SHAPES: std::cell::RefCell<Vec<Shape>> =
        const { std::cell::RefCell::new(Vec::new()) };
}

/// A learned shape whose frames hold text only: one choice with a delta,
/// its reasoning or content (as hole ranks), and no call, finish, usage
/// or error. [`Spans::emit`] gives such a frame's chunks from these spans
/// alone: a [`Chunk::Reasoning`], then a [`Chunk::Text`], each when its
/// text is not empty.
#[derive(Debug, Clone, Copy)]
struct TextOnly {
    reasoning_content: Option<Span>,
    reasoning: Option<Span>,
    content: Option<Span>,
}

impl TextOnly {
    fn of(top: &TopSpans, choices: &[ChoiceSpans], calls: &[CallSpans]) -> Option<TextOnly> {
        let [choice] = choices else {
            return None;
        };
        let only_text = calls.is_empty()
            && choice.has_delta
            && choice.finish_reason.is_none()
            && top.error.is_none()
            && top.usage.is_none()
            && top.groq_usage.is_none();
        only_text.then_some(TextOnly {
            reasoning_content: choice.reasoning_content,
            reasoning: choice.reasoning,
            content: choice.content,
        })
    }
}

/// A learned shape whose frames say one thing only: more arguments for one
/// tool call (one choice with a delta, one `tool_calls` entry with an
/// `arguments` string and neither `id` nor `name`; no text, reasoning,
/// finish, usage or error). Nearly every frame of a streaming call has it,
/// and its one chunk is read straight from the holes (as hole ranks):
/// [`Spans::emit`] on [`Spans::moved_from_template`] would give the same,
/// through every span the shape does not have.
#[derive(Debug, Clone, Copy)]
struct SteadyCall {
    choice_index: Option<Span>,
    call_index: Option<Span>,
    arguments: Span,
}

impl SteadyCall {
    /// The steady call of a learned shape (its spans as hole ranks), if it
    /// is that shape.
    fn of(top: &TopSpans, choices: &[ChoiceSpans], calls: &[CallSpans]) -> Option<SteadyCall> {
        // (A frame's one call is its one choice's, in that choice's delta.)
        let ([choice], [call]) = (choices, calls) else {
            return None;
        };
        let only_a_call = top.error.is_none()
            && top.usage.is_none()
            && top.groq_usage.is_none()
            && choice.reasoning_content.is_none()
            && choice.reasoning.is_none()
            && choice.content.is_none()
            && choice.finish_reason.is_none()
            && call.id.is_none()
            && call.name.is_none();
        Some(SteadyCall {
            choice_index: choice.index,
            call_index: call.index,
            arguments: call.arguments.filter(|_| only_a_call)?,
        })
    }
}

/// What [`Spans::scan`] found. Returned, never stored: boxing the large
/// variant would allocate per frame.
#[allow(clippy::large_enum_variant)]
enum Scanned {
    /// The frame has the learned steady shape ([`SteadyCall`]); its holes
    /// are in `Spans::holes`.
    Steady(SteadyCall),
    /// The spans of the frame's values.
    Spans(TopSpans),
}

#[derive(Debug, Default, Clone, Copy)]
struct TopSpans {
    error: Option<Span>,
    id: Option<Span>,
    object: Option<Span>,
    created: Option<Span>,
    model: Option<Span>,
    annotated: bool,
    usage: Option<UsageSpans>,
    groq_usage: Option<UsageSpans>,
}

#[derive(Debug, Default, Clone, Copy)]
struct UsageSpans {
    prompt: Option<Span>,
    completion: Option<Span>,
    total: Option<Span>,
}

#[derive(Debug, Default, Clone, Copy)]
struct ChoiceSpans {
    index: Option<Span>,
    finish_reason: Option<Span>,
    has_delta: bool,
    reasoning_content: Option<Span>,
    reasoning: Option<Span>,
    /// A string `content` (any other non-null type carries no text).
    content: Option<Span>,
    /// This choice's entries in `Spans::calls`.
    calls: (usize, usize),
}

#[derive(Debug, Default, Clone, Copy)]
struct CallSpans {
    index: Option<Span>,
    id: Option<Span>,
    name: Option<Span>,
    /// A string `arguments`; object arguments bail.
    arguments: Option<Span>,
}

impl Spans {
    /// The spans of `data`'s values; those of the frame head (`id`,
    /// `object`, `created`, `model`) only when `head` asks for them, or
    /// the frame was walked. `probed`: `data` is the frame
    /// [`match_prefix`](Self::match_prefix) recognized last.
    fn scan(&mut self, data: &str, head: bool, probed: bool) -> Result<Scanned, Bail> {
        if probed || self.shape.template.matches(data, &mut self.holes) || self.recall(data) {
            if let Some(call) = self.shape.steady {
                return Ok(Scanned::Steady(call));
            }
            if let Ok(top) = self.moved_from_template(head) {
                return Ok(Scanned::Spans(top));
            }
        }
        self.choices.clear();
        self.calls.clear();
        #[cfg(test)]
        tests::WALKS.set(tests::WALKS.get() + 1);
        let mut c = Cursor::new(data, std::mem::take(&mut self.holes));
        let top = self.walk(&mut c);
        self.holes = c.into_holes();
        let top = top?;
        self.learn(data, &top);
        self.remember();
        Ok(Scanned::Spans(top))
    }

    /// Whether `data` has one of the shapes this thread learned last
    /// ([`RECENT_SHAPES`]); if so, that is the stream's shape now,
    /// its template learned from `data`, and `holes` are `data`'s.
    fn recall(&mut self, data: &str) -> bool {
        if self.recall_misses >= RECALL_GIVES_UP {
            return false;
        }
        let holes = &mut self.holes;
        let shape = &mut self.shape;
        let found = RECENT_SHAPES.with_borrow_mut(|shapes| {
            let k = shapes
                .iter()
                .position(|known| known.template.matches(data, holes))?;
            shape.copy_from(&shapes[k]);
            shapes[..=k].rotate_right(1);
            Some(())
        });
        if found.is_none() {
            self.recall_misses += 1;
            return false;
        }
        self.recall_misses = 0;
        // The template now holds another stream's values (its id, its
        // model, its text): learned again from this frame, the holes that
        // keep their value from frame to frame are not scanned again. The
        // same holes in the same order, so the ranks stay.
        self.shape.template.learn(data, &self.holes);
        true
    }

    /// Keeps the shape just learned among this thread's.
    fn remember(&self) {
        let template = &self.shape.template;
        if !template.is_ready() || template.learned_bytes() > SHAPE_BYTES_KEPT {
            return;
        }
        RECENT_SHAPES.with_borrow_mut(|shapes| {
            if shapes.len() < SHAPES_KEPT {
                shapes.push(Shape::default());
            }
            // The least recently used one's buffers take the copy.
            shapes.rotate_right(1);
            if let Some(first) = shapes.first_mut() {
                first.copy_from(&self.shape);
            }
        });
    }

    /// See [`DecoderState::match_prefix`]: the holes it finds are the
    /// frame at hand's.
    pub(super) fn match_prefix(&mut self, text: &str) -> Option<usize> {
        self.shape.template.match_prefix(text, &mut self.holes)
    }

    /// What the frame [`match_prefix`](Self::match_prefix) just recognized
    /// holds, when its shape holds text and nothing else ([`TextOnly`]):
    /// the chunks [`decode`] would emit for it change only the phase.
    pub(super) fn probed_text(&self) -> Option<ProbedText> {
        let shape = self.shape.text_only?;
        let holes = self.holes.as_slice();
        // `emit` takes the first of the two reasoning keys that has text.
        Some(ProbedText {
            reasoning: has_text(holes, shape.reasoning_content).ok()?
                || has_text(holes, shape.reasoning).ok()?,
            content: has_text(holes, shape.content).ok()?,
        })
    }

    /// The frame at hand has the learned shape: the learned spans, moved
    /// to its holes.
    fn moved_from_template(&mut self, head: bool) -> Result<TopSpans, Bail> {
        let holes = self.holes.as_slice();
        let mut moved = |span| from_rank(holes, span);
        let top = self.shape.top.map(&mut moved, head)?;
        self.choices.clear();
        for choice in &self.shape.choices {
            self.choices.push(choice.map(&mut moved)?);
        }
        self.calls.clear();
        for call in &self.shape.calls {
            self.calls.push(call.map(&mut moved)?);
        }
        Ok(top)
    }

    /// Keeps a valid frame's shape, its spans as hole ranks, when every
    /// span the decoder took is a hole (a string or a number); otherwise
    /// the next frame is walked in full.
    fn learn(&mut self, data: &str, top: &TopSpans) {
        let shape = &mut self.shape;
        shape.template.learn(data, &self.holes);
        let t = &shape.template;
        let mut rank = |span| t.to_rank(span);
        let mut learn = || -> Result<(), Bail> {
            shape.top = top.map(&mut rank, true)?;
            shape.choices.clear();
            for choice in &self.choices {
                shape.choices.push(choice.map(&mut rank)?);
            }
            shape.calls.clear();
            for call in &self.calls {
                shape.calls.push(call.map(&mut rank)?);
            }
            Ok(())
        };
        (shape.steady, shape.text_only) = match learn() {
            Ok(()) => (
                SteadyCall::of(&shape.top, &shape.choices, &shape.calls),
                TextOnly::of(&shape.top, &shape.choices, &shape.calls),
            ),
            Err(Bail) => {
                shape.template.forget();
                (None, None)
            }
        };
    }

    /// Walks a whole frame.
    fn walk(&mut self, c: &mut Cursor<'_>) -> Result<TopSpans, Bail> {
        let mut top = TopSpans::default();
        let mut seen = 0;
        // `choices` that is not `null`: with usage or an error, what makes
        // the object a chunk. One that is none is the serde path's to tell.
        let mut has_choices = false;
        let mut walk = c.object()?;
        while let Some(key) = c.key(&mut walk)? {
            match key {
                b"choices" => {
                    first_time(&mut seen, 1)?;
                    if !c.null()? {
                        has_choices = true;
                        let mut choices = c.array()?;
                        while c.element(&mut choices)? {
                            self.scan_choice(c)?;
                        }
                    }
                }
                b"usage" => {
                    first_time(&mut seen, 2)?;
                    top.usage = scan_usage(c)?;
                }
                b"x_groq" => {
                    first_time(&mut seen, 4)?;
                    if !c.null()? {
                        let mut seen = 0;
                        let mut groq = c.object()?;
                        while let Some(key) = c.key(&mut groq)? {
                            if key == b"usage" {
                                first_time(&mut seen, 1)?;
                                top.groq_usage = scan_usage(c)?;
                            } else {
                                c.value()?;
                            }
                        }
                    }
                }
                b"error" => {
                    first_time(&mut seen, 8)?;
                    top.error = c.optional()?;
                }
                b"id" => {
                    first_time(&mut seen, 16)?;
                    top.id = c.optional()?;
                }
                b"object" => {
                    first_time(&mut seen, 32)?;
                    top.object = c.optional()?;
                }
                b"created" => {
                    first_time(&mut seen, 64)?;
                    top.created = c.optional()?;
                }
                b"model" => {
                    first_time(&mut seen, 128)?;
                    top.model = c.optional()?;
                }
                b"toolCallProgress" => {
                    first_time(&mut seen, 256)?;
                    top.annotated = c.optional()?.is_some();
                }
                _ => {
                    c.value()?;
                }
            }
        }
        c.end()?;
        if !has_choices && top.usage.is_none() && top.groq_usage.is_none() && top.error.is_none() {
            return Err(Bail);
        }
        Ok(top)
    }

    fn scan_choice(&mut self, c: &mut Cursor<'_>) -> Result<(), Bail> {
        let mut choice = ChoiceSpans::default();
        let mut seen = 0;
        let calls_start = self.calls.len();
        let mut walk = c.object()?;
        while let Some(key) = c.key(&mut walk)? {
            match key {
                b"index" => {
                    first_time(&mut seen, 1)?;
                    choice.index = c.optional()?;
                }
                b"finish_reason" => {
                    first_time(&mut seen, 2)?;
                    choice.finish_reason = c.optional()?;
                }
                b"delta" => {
                    first_time(&mut seen, 4)?;
                    if !c.null()? {
                        choice.has_delta = true;
                        self.scan_delta(c, &mut choice)?;
                    }
                }
                _ => {
                    c.value()?;
                }
            }
        }
        choice.calls = (calls_start, self.calls.len());
        self.choices.push(choice);
        Ok(())
    }

    fn scan_delta(&mut self, c: &mut Cursor<'_>, choice: &mut ChoiceSpans) -> Result<(), Bail> {
        let mut seen = 0;
        let mut walk = c.object()?;
        while let Some(key) = c.key(&mut walk)? {
            match key {
                b"content" => {
                    first_time(&mut seen, 1)?;
                    match c.peek() {
                        Some(b'"') => choice.content = Some(c.string()?),
                        // Mistral's parts: the serde path.
                        Some(b'[') => return Err(Bail),
                        _ => {
                            c.value()?;
                        }
                    }
                }
                b"reasoning_content" => {
                    first_time(&mut seen, 2)?;
                    choice.reasoning_content = c.optional_string()?;
                }
                b"reasoning" => {
                    first_time(&mut seen, 4)?;
                    choice.reasoning = c.optional_string()?;
                }
                b"tool_calls" => {
                    first_time(&mut seen, 8)?;
                    if !c.null()? {
                        let mut calls = c.array()?;
                        while c.element(&mut calls)? {
                            self.scan_call(c)?;
                        }
                    }
                }
                _ => {
                    c.value()?;
                }
            }
        }
        Ok(())
    }

    fn scan_call(&mut self, c: &mut Cursor<'_>) -> Result<(), Bail> {
        let mut call = CallSpans::default();
        let mut seen = 0;
        let mut walk = c.object()?;
        while let Some(key) = c.key(&mut walk)? {
            match key {
                b"index" => {
                    first_time(&mut seen, 1)?;
                    call.index = c.optional()?;
                }
                b"id" => {
                    first_time(&mut seen, 2)?;
                    call.id = c.optional_string()?;
                }
                b"function" => {
                    first_time(&mut seen, 4)?;
                    if !c.null()? {
                        let mut seen = 0;
                        let mut function = c.object()?;
                        while let Some(key) = c.key(&mut function)? {
                            match key {
                                b"name" => {
                                    first_time(&mut seen, 1)?;
                                    call.name = c.optional_string()?;
                                }
                                b"arguments" => {
                                    first_time(&mut seen, 2)?;
                                    // Object arguments: the serde path.
                                    call.arguments = c.optional_string()?;
                                }
                                _ => {
                                    c.value()?;
                                }
                            }
                        }
                    }
                }
                // A custom tool's payload: the serde path.
                b"custom" => {
                    if !c.null()? {
                        return Err(Bail);
                    }
                }
                _ => {
                    c.value()?;
                }
            }
        }
        self.calls.push(call);
        Ok(())
    }

    /// The one chunk of a frame of the steady shape, and its info: what
    /// [`emit`](Self::emit) gives for it.
    fn emit_steady<'a>(
        &self,
        data: &'a str,
        call: SteadyCall,
        head: bool,
        emit: &mut dyn FnMut(Chunk<'a>),
    ) -> FrameInfo<'a> {
        let info = self.shape.top.info(head, |rank| self.hole(data, rank));
        emit(Chunk::ToolCallDelta(self.steady_delta(data, call)));
        info
    }

    /// The delta of a frame of the steady shape `call`, whose holes are
    /// in place.
    #[inline(always)]
    fn steady_delta<'a>(&self, data: &'a str, call: SteadyCall) -> ToolCallDelta<'a> {
        let arguments = match self
            .hole(data, Some(call.arguments))
            .and_then(JsonLiteral::string)
        {
            Some(fragment) => ArgumentsDelta::Append(ChunkText::Json(fragment)),
            None => ArgumentsDelta::Unchanged,
        };
        ToolCallDelta {
            choice: raw_i64(self.hole(data, call.choice_index)).unwrap_or(0),
            index: raw_i64(self.hole(data, call.call_index)),
            id: None,
            name: None,
            arguments,
            custom: false,
        }
    }

    /// The value in `data`, a matched frame, of the hole of rank `rank`.
    /// A matched frame has a hole of every rank, so this is `None` only
    /// for a rank the shape does not have.
    #[inline(always)]
    fn hole<'a>(&self, data: &'a str, rank: Option<Span>) -> Option<&'a str> {
        from_rank(&self.holes, rank)
            .ok()
            .flatten()
            .map(|span| span.of(data))
    }

    /// The delta the frame [`match_prefix`](Self::match_prefix) just
    /// recognized at the start of `data` holds, when its shape is the
    /// steady one ([`SteadyCall`]): the one chunk [`decode`] would emit
    /// for it.
    pub(super) fn probed_call<'a>(&self, data: &'a str) -> Option<ToolCallDelta<'a>> {
        let call = self.shape.steady?;
        Some(self.steady_delta(data, call))
    }

    /// The chunks of a scanned frame, in the serde path's order.
    fn emit<'a>(
        &self,
        data: &'a str,
        top: &TopSpans,
        head: bool,
        emit: &mut dyn FnMut(Chunk<'a>),
    ) -> FrameInfo<'a> {
        let raw = |span: Option<Span>| span.map(|s| s.of(data));
        let mut info = top.info(head, raw);
        if let Some(error) = raw(top.error) {
            emit(Chunk::Error {
                raw: error,
                message: error_message(error),
            });
        }
        for choice in &self.choices {
            let k = raw_i64(raw(choice.index)).unwrap_or(0);
            if choice.has_delta {
                let reasoning = json_text(data, choice.reasoning_content)
                    .or_else(|| json_text(data, choice.reasoning));
                if let Some(text) = reasoning {
                    emit(Chunk::Reasoning { choice: k, text });
                }
                if let Some(text) = json_text(data, choice.content) {
                    emit(Chunk::Text { choice: k, text });
                }
                let (from, to) = choice.calls;
                for call in self.calls.get(from..to).unwrap_or_default() {
                    // Counted as it stands, unescaped only if read.
                    let arguments = match raw(call.arguments).and_then(JsonLiteral::string) {
                        Some(fragment) => ArgumentsDelta::Append(ChunkText::Json(fragment)),
                        None => ArgumentsDelta::Unchanged,
                    };
                    emit(Chunk::ToolCallDelta(ToolCallDelta {
                        choice: k,
                        index: raw_i64(raw(call.index)),
                        id: text(data, call.id),
                        name: text(data, call.name),
                        arguments,
                        custom: false,
                    }));
                }
            }
            if let Some(kind) = raw(choice.finish_reason).and_then(FinishKind::of) {
                info.set_finishes(true);
                emit(Chunk::Finish { choice: k, kind });
            }
        }
        let usage = (top.usage.map(|u| (u, USAGE_FIELDS)))
            .or(top.groq_usage.map(|u| (u, GROQ_USAGE_FIELDS)));
        if let Some((usage, fields)) = usage {
            let members = [raw(usage.prompt), raw(usage.completion), raw(usage.total)];
            let usage = usage_of(members, fields, emit);
            emit(Chunk::Usage(usage));
        }
        info
    }
}

impl TopSpans {
    /// The frame's info: whether it is annotated, and its head (`id`,
    /// `object`, `created`, `model`) when `head` asks for it, each span
    /// read through `raw`.
    fn info<'a>(&self, head: bool, raw: impl Fn(Option<Span>) -> Option<&'a str>) -> FrameInfo<'a> {
        let mut info = FrameInfo::object(self.annotated);
        if head {
            info.id = raw(self.id);
            info.object = raw(self.object);
            info.created = raw(self.created);
            info.model = raw(self.model);
        }
        info
    }

    /// The spans through `f`; the frame head's only with `head` (else
    /// `None`).
    fn map(&self, f: &mut SpanMap<'_>, head: bool) -> Result<TopSpans, Bail> {
        let (id, object, created, model) = if head {
            (
                f(self.id)?,
                f(self.object)?,
                f(self.created)?,
                f(self.model)?,
            )
        } else {
            (None, None, None, None)
        };
        Ok(TopSpans {
            id,
            object,
            created,
            model,
            error: f(self.error)?,
            annotated: self.annotated,
            usage: self.usage.map(|u| u.map(f)).transpose()?,
            groq_usage: self.groq_usage.map(|u| u.map(f)).transpose()?,
        })
    }
}

impl UsageSpans {
    fn map(self, f: &mut SpanMap<'_>) -> Result<UsageSpans, Bail> {
        Ok(UsageSpans {
            prompt: f(self.prompt)?,
            completion: f(self.completion)?,
            total: f(self.total)?,
        })
    }
}

impl ChoiceSpans {
    fn map(&self, f: &mut SpanMap<'_>) -> Result<ChoiceSpans, Bail> {
        Ok(ChoiceSpans {
            index: f(self.index)?,
            finish_reason: f(self.finish_reason)?,
            reasoning_content: f(self.reasoning_content)?,
            reasoning: f(self.reasoning)?,
            content: f(self.content)?,
            ..*self
        })
    }
}

impl CallSpans {
    fn map(&self, f: &mut SpanMap<'_>) -> Result<CallSpans, Bail> {
        Ok(CallSpans {
            index: f(self.index)?,
            id: f(self.id)?,
            name: f(self.name)?,
            arguments: f(self.arguments)?,
        })
    }
}

/// `null` or an object with the three counts; anything else bails.
fn scan_usage(c: &mut Cursor<'_>) -> Result<Option<UsageSpans>, Bail> {
    if c.null()? {
        return Ok(None);
    }
    let mut usage = UsageSpans::default();
    let mut seen = 0;
    let mut walk = c.object()?;
    while let Some(key) = c.key(&mut walk)? {
        match key {
            b"prompt_tokens" => {
                first_time(&mut seen, 1)?;
                usage.prompt = c.optional()?;
            }
            b"completion_tokens" => {
                first_time(&mut seen, 2)?;
                usage.completion = c.optional()?;
            }
            b"total_tokens" => {
                first_time(&mut seen, 4)?;
                usage.total = c.optional()?;
            }
            _ => {
                c.value()?;
            }
        }
    }
    Ok(Some(usage))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::borrow::Cow;
    use std::cell::Cell;

    thread_local! {
        /// Frames this thread walked in full (see `Spans::scan`).
        pub(super) static WALKS: Cell<usize> = const { Cell::new(0) };
    }

    /// A stream's frames of five shapes: the role chunk, text, a call's
    /// announcement, its arguments, the finish; `id` and `n` change the
    /// values (not the shapes) from one stream to the next.
    fn stream_frames(id: &str, n: usize) -> Vec<String> {
        let head = format!(
            r#"{{"id":"{id}","object":"chat.completion.chunk","created":{},"model":"m","choices":[{{"index":0,"delta":"#,
            1_700_000_000 + n
        );
        [
            r#"{"role":"assistant","content":null},"finish_reason":null}]}"#.to_owned(),
            format!(r#"{{"content":"text {n}"}},"finish_reason":null}}]}}"#),
            format!(
                r#"{{"tool_calls":[{{"index":0,"id":"call_{n}","type":"function","function":{{"name":"f{n}","arguments":""}}}}]}},"finish_reason":null}}]}}"#
            ),
            format!(
                r#"{{"tool_calls":[{{"index":0,"function":{{"arguments":"{{\"k\":{n}"}}}}]}},"finish_reason":null}}]}}"#
            ),
            r#"{},"finish_reason":"tool_calls"}]}"#.to_owned(),
        ]
        .into_iter()
        .map(|rest| format!("{head}{rest}"))
        .collect()
    }

    /// Decodes `frames` as one stream, each frame twice in a row as a
    /// stream's frames of one shape come, and checks every answer against
    /// the serde path; returns how many frames were walked in full.
    fn walks_of(frames: &[String]) -> usize {
        let before = WALKS.get();
        let mut state = DecoderState::default();
        for frame in frames.iter().flat_map(|f| [f, f]) {
            let mut fast = Vec::new();
            let info = decode(frame, &mut state, &mut |c| fast.push(c)).expect("fast");
            let mut slow = Vec::new();
            let slow_info = decode_serde(frame, &mut |c| slow.push(c)).expect("serde");
            assert_eq!((fast, info), (slow, slow_info), "{frame}");
        }
        WALKS.get() - before
    }

    /// A new stream's frames take the shapes another stream on the same
    /// thread learned: matched, not walked, and decoded the same. Frames
    /// of a shape the thread has not seen are still walked.
    #[test]
    fn a_new_stream_recalls_the_shapes_of_the_last() {
        let first = stream_frames("chatcmpl-a", 1);
        assert_eq!(walks_of(&first), 5, "each shape is new to the thread");
        let second = stream_frames("chatcmpl-bcdefgh", 22);
        assert_eq!(walks_of(&second), 0, "every shape is the thread's");
        // From another thread's point of view they are all new.
        let walks = std::thread::spawn(move || walks_of(&second))
            .join()
            .expect("thread");
        assert_eq!(walks, 5);
        // Another shape: a second choice.
        let other = first[1].replace(r#"}]}"#, r#"},{"index":1,"delta":{}}]}"#);
        assert_eq!(walks_of(&[other]), 1);
    }

    /// The thread keeps the few shapes used last, none of a frame too
    /// long to keep, and a stream of ever new shapes stops looking.
    #[test]
    fn the_thread_keeps_a_few_short_shapes() {
        let shapes: Vec<String> = (0..SHAPES_KEPT + 1)
            .map(|k| {
                format!(
                    r#"{{"choices":[{{"index":0,"delta":{{"content":"x"}}{}}}]}}"#,
                    ",\"a\":1".repeat(k)
                )
            })
            .collect();
        assert_eq!(walks_of(&shapes), SHAPES_KEPT + 1);
        // The last SHAPES_KEPT are kept; the first was dropped.
        assert_eq!(walks_of(&shapes[1..]), 0);
        assert_eq!(walks_of(&shapes[..1]), 1);
        // A long key is part of the shape (a long string would be a hole).
        let long = format!(
            r#"{{"choices":[{{"index":0,"delta":{{"content":"x"}}}}],"{}":1}}"#,
            "k".repeat(SHAPE_BYTES_KEPT)
        );
        assert_eq!(walks_of(std::slice::from_ref(&long)), 1);
        assert_eq!(walks_of(std::slice::from_ref(&long)), 1, "not kept");
        let mut state = DecoderState::default();
        for k in 0..RECALL_GIVES_UP as usize + 3 {
            let novel = format!(r#"{{"choices":[],"k{k}":1}}"#);
            decode(&novel, &mut state, &mut |_| {}).expect("decodes");
        }
        assert_eq!(state.spans.recall_misses, RECALL_GIVES_UP);
    }

    fn chunks(data: &str) -> Vec<Chunk<'_>> {
        let mut out = Vec::new();
        decode(data, &mut DecoderState::default(), &mut |c| out.push(c)).expect("decodes");
        out
    }

    fn delta<'a>(
        index: Option<i64>,
        id: Option<&'a str>,
        name: Option<&'a str>,
        arguments: ArgumentsDelta<'a>,
    ) -> Chunk<'a> {
        Chunk::ToolCallDelta(ToolCallDelta {
            choice: 0,
            index,
            id: id.map(Cow::Borrowed),
            name: name.map(Cow::Borrowed),
            arguments,
            custom: false,
        })
    }

    /// A field of an unexpected shape beside a tool delta is passed over
    /// and named (`Chunk::Ignored`); the delta is read all the same. Before,
    /// the whole frame was undecodable and its delta lost (a first delta
    /// lost left the call without a name).
    #[test]
    fn an_odd_field_is_passed_over_and_the_rest_read() {
        let call =
            r#""tool_calls":[{"index":0,"id":"a","function":{"name":"f","arguments":"ab"}}]"#;
        for (delta_extra, top_extra, field, raw) in [
            (
                r#""reasoning":{"text":"x"},"#,
                "",
                "delta.reasoning",
                r#"{"text":"x"}"#,
            ),
            (
                r#""reasoning_content":5,"#,
                "",
                "delta.reasoning_content",
                "5",
            ),
            (r#""content":["raw"],"#, "", "delta.content", r#""raw""#),
            ("", r#","usage":"n/a""#, "usage", r#""n/a""#),
            ("", r#","x_groq":"q""#, "x_groq", r#""q""#),
            // serde's structs read arrays by position: these are no objects.
            ("", r#","usage":[5,6,11]"#, "usage", "[5,6,11]"),
            (
                r#""content":[["text","hi"]],"#,
                "",
                "delta.content",
                r#"["text","hi"]"#,
            ),
        ] {
            let data = format!(
                r#"{{"choices":[{{"index":0,"delta":{{{delta_extra}{call}}}}}]{top_extra}}}"#
            );
            let got = chunks(&data);
            let expected_delta = delta(
                Some(0),
                Some("a"),
                Some("f"),
                ArgumentsDelta::Append("ab".into()),
            );
            assert!(got.contains(&expected_delta), "{data}: {got:?}");
            assert!(
                got.contains(&Chunk::Ignored { field, raw }),
                "{data}: {got:?}"
            );
            assert_eq!(got.len(), 2, "{data}: {got:?}");
        }
        // The call's own fields: the delta goes on without them.
        let data = r#"{"choices":[{"delta":{"tool_calls":[{"index":0,"id":7,"function":{"name":5,"arguments":"ab"}}]}}]}"#;
        assert_eq!(
            chunks(data),
            vec![
                Chunk::Ignored {
                    field: "function.name",
                    raw: "5"
                },
                Chunk::Ignored {
                    field: "tool_calls[].id",
                    raw: "7"
                },
                delta(Some(0), None, None, ArgumentsDelta::Append("ab".into())),
            ]
        );
    }

    /// An error inside arguments given as an object (arrays nested past
    /// serde_json's limit, counted from the object) is placed in the
    /// frame, just after the object; it was placed in the object.
    #[test]
    fn an_error_inside_object_arguments_is_placed_in_the_frame() {
        let object = format!(r#"{{"a":{}{}}}"#, "[".repeat(127), "]".repeat(127));
        let data = format!(
            r#"{{"id":"x","choices":[{{"index":0,"delta":{{"tool_calls":[{{"index":0,"id":"a","function":{{"name":"f","arguments":{object}}}}}]}}}}]}}"#
        );
        // 1-based, the column after the object's last character.
        let end = data.find(&object).expect("in the frame") + object.len() + 1;
        let err = decode(&data, &mut DecoderState::default(), &mut |_| {}).expect_err("too deep");
        assert_eq!(
            err.to_string(),
            format!("unexpected JSON shape: recursion limit exceeded at line 1 column {end}")
        );
    }

    #[test]
    fn tool_call_entries_come_out_in_list_order() {
        let data = r#"{"choices":[{"index":0,"delta":{"content":"","tool_calls":[
            {"index":0,"id":"call_a","type":"function","function":{"name":"f","arguments":""}},
            {"index":1,"id":"","function":{"name":null,"arguments":"{\"x\""}}]},"finish_reason":null}]}"#;
        assert_eq!(
            chunks(data),
            vec![
                delta(
                    Some(0),
                    Some("call_a"),
                    Some("f"),
                    ArgumentsDelta::Append("".into())
                ),
                delta(Some(1), None, None, ArgumentsDelta::Append("{\"x\"".into())),
            ]
        );
    }

    #[test]
    fn object_arguments_are_stringified_like_javascript() {
        let data = r#"{"choices":[{"delta":{"tool_calls":[{"id":"c","function":{"name":"f","arguments":{"b":1.50,"a":[1e21]}}}]}}]}"#;
        assert_eq!(
            chunks(data),
            vec![delta(
                None,
                Some("c"),
                Some("f"),
                ArgumentsDelta::Replace(r#"{"b":1.5,"a":[1e+21]}"#.into())
            )]
        );
    }

    #[test]
    fn reasoning_content_and_usage() {
        let data = r#"{"choices":[{"index":1,"delta":{"reasoning_content":"hm","content":null}}],"usage":{"prompt_tokens":3,"completion_tokens":4,"total_tokens":7}}"#;
        assert_eq!(
            chunks(data),
            vec![
                Chunk::Reasoning {
                    choice: 1,
                    text: "hm".into()
                },
                Chunk::Usage(Usage {
                    prompt_tokens: 3,
                    completion_tokens: 4,
                    total_tokens: 7
                }),
            ]
        );
    }

    /// A custom tool's entry (`custom: {name, input}`) reads as a
    /// function's, marked custom, on both paths; beside a function's
    /// payload it counts for nothing.
    #[test]
    fn custom_tool_entries_read_as_function_ones() {
        let custom = r#"{"choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"id":"c","type":"custom","custom":{"name":"apply_patch","input":"*** Begin"}}]}}]}"#;
        let both = r#"{"choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"function":{"arguments":"{}"},"custom":{"name":"x","input":"y"}}]}}]}"#;
        let mut state = DecoderState::default();
        for _ in 0..2 {
            let mut got = Vec::new();
            decode(custom, &mut state, &mut |c| got.push(c)).expect("decodes");
            let mut want = delta(
                Some(0),
                Some("c"),
                Some("apply_patch"),
                ArgumentsDelta::Append("*** Begin".into()),
            );
            if let Chunk::ToolCallDelta(d) = &mut want {
                d.custom = true;
            }
            assert_eq!(got, vec![want]);
        }
        assert_eq!(
            chunks(both),
            vec![delta(
                Some(0),
                None,
                None,
                ArgumentsDelta::Append("{}".into())
            )]
        );
    }

    /// An object with none of a chunk's keys is no chunk, on both paths;
    /// one whose `object` is `"error"` (vLLM's older errors) is an error,
    /// whole. One key is enough, `null` is none. (Both decoded to nothing,
    /// without a word.)
    #[test]
    fn objects_without_a_chunks_keys_are_no_chunks() {
        let vllm = r#"{"object":"error","message":"too long","type":"BadRequestError","code":400}"#;
        assert_eq!(
            chunks(&format!("{vllm} ")),
            vec![Chunk::Error {
                raw: vllm,
                message: "too long".to_owned()
            }]
        );
        for data in [
            r#"{"response":"Hi"}"#,
            r#"{"id":"x","object":"chat.completion.chunk","choices":null,"usage":null}"#,
            "{}",
        ] {
            let mut state = DecoderState::default();
            // Twice: what the fast path gave up on, it did not learn.
            for _ in 0..2 {
                let got = decode(data, &mut state, &mut |c| panic!("{c:?}"));
                assert!(
                    matches!(got, Err(FrameError::NotAChunk(_))),
                    "{data}: {got:?}"
                );
            }
        }
        for data in [
            r#"{"choices":[]}"#,
            r#"{"usage":{"prompt_tokens":1}}"#,
            r#"{"x_groq":{"usage":{"prompt_tokens":1}}}"#,
            r#"{"error":"overloaded"}"#,
        ] {
            let mut state = DecoderState::default();
            assert!(decode(data, &mut state, &mut |_| {}).is_ok(), "{data}");
        }
    }

    #[test]
    fn groq_usage_and_finish() {
        let data = r#"{"choices":[{"index":0,"delta":{},"finish_reason":"tool_calls"}],"x_groq":{"id":"req","usage":{"prompt_tokens":1,"completion_tokens":2}}}"#;
        assert_eq!(
            chunks(data),
            vec![
                Chunk::Finish {
                    choice: 0,
                    kind: FinishKind::Whole
                },
                Chunk::Usage(Usage {
                    prompt_tokens: 1,
                    completion_tokens: 2,
                    total_tokens: 3
                }),
            ]
        );
    }

    /// Thinking parts nested 100,000 deep (a 1.5 MB event, well within
    /// `--max-event-bytes`): decoded without a stack overflow, which
    /// aborted the process (`annotate`, and all of `serve`) when each
    /// level's `thinking` was parsed as content again, each with serde's
    /// depth limit anew. Only the outer level is read: no text here (the
    /// part that is an array is no object: passed over, and said so).
    #[test]
    fn deeply_nested_thinking_parts_cost_no_stack() {
        let depth = 100_000;
        for (open, close) in [(r#"[{"thinking":"#, "}]"), ("[[0,0,", "]]")] {
            let data = format!(
                r#"{{"choices":[{{"delta":{{"content":{}"x"{}}}}}]}}"#,
                open.repeat(depth),
                close.repeat(depth)
            );
            let mut out = Vec::new();
            let decoded = decode(&data, &mut DecoderState::default(), &mut |c| {
                out.push(format!("{c:?}"))
            });
            assert!(decoded.is_ok(), "{open}");
            if open.starts_with("[{") {
                assert!(out.is_empty(), "{open}: {out:?}");
            } else {
                assert_eq!(out.len(), 1, "{open}: {out:?}");
                assert!(
                    out[0].starts_with(r#"Ignored { field: "delta.content", raw: "[0,0,[[0,0,"#),
                    "{}",
                    &out[0][..80]
                );
            }
        }
    }

    #[test]
    fn mistral_content_parts() {
        let data = r#"{"choices":[{"delta":{"content":[{"type":"thinking","thinking":[{"type":"text","text":"why"}]},{"type":"text","text":"so"}]}}]}"#;
        assert_eq!(
            chunks(data),
            vec![
                Chunk::Reasoning {
                    choice: 0,
                    text: "why".into()
                },
                Chunk::Text {
                    choice: 0,
                    text: "so".into()
                },
            ]
        );
    }

    #[test]
    fn done_error_and_non_index_values() {
        assert_eq!(chunks("[DONE]"), vec![Chunk::Done]);
        assert_eq!(
            chunks(r#"{"error":{"message":"overloaded","type":"server_error"}}"#),
            vec![Chunk::Error {
                raw: r#"{"message":"overloaded","type":"server_error"}"#,
                message: "overloaded".into()
            }]
        );
        let data = r#"{"choices":[{"delta":{"tool_calls":[{"index":"0","function":{"arguments":null}}]}}]}"#;
        assert_eq!(
            chunks(data),
            vec![delta(None, None, None, ArgumentsDelta::Unchanged)]
        );
    }

    #[test]
    fn escaped_strings_are_unescaped_and_plain_ones_borrowed() {
        let data = r#"{"choices":[{"delta":{"content":"a\"b","tool_calls":[{"index":0,"function":{"arguments":"plain"}}]}}]}"#;
        let out = chunks(data);
        assert_eq!(
            out[0],
            Chunk::Text {
                choice: 0,
                text: "a\"b".into()
            }
        );
        let Chunk::ToolCallDelta(d) = &out[1] else {
            panic!("{out:?}")
        };
        assert_eq!(d.arguments, ArgumentsDelta::Append("plain".into()));
    }

    #[test]
    fn shapes_that_are_not_chunks_are_errors_not_panics() {
        let mut sink = |_c: Chunk<'_>| {};
        assert!(matches!(
            decode("{bad", &mut DecoderState::default(), &mut sink),
            Err(FrameError::InvalidJson(_))
        ));
        assert!(matches!(
            decode("[1]", &mut DecoderState::default(), &mut sink),
            Err(FrameError::NotAnObject)
        ));
        assert!(matches!(
            decode(
                r#"{"choices":"x"}"#,
                &mut DecoderState::default(),
                &mut sink
            ),
            Err(FrameError::UnexpectedShape(_))
        ));
    }
}
