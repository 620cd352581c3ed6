//! Provider frames → normalized [`Chunk`]s.
//!
//! One file per wire format: [`openai_chat`] for OpenAI-compatible chat
//! completion chunks (OpenAI, Azure, DeepSeek, Groq, OpenRouter, Gemini,
//! Mistral, vLLM, Ollama's `/v1`…) and [`ollama`] for Ollama's native
//! `/api/chat` NDJSON. Each decodes one frame's data, synchronously, into
//! chunks handed to a callback (no allocation per chunk) and returns a
//! [`FrameInfo`] the encoders need to inject progress into the frame.
//!
//! Decoding reads only what progress needs, with borrowed views: it never
//! builds a `serde_json::Value` of a whole chunk and never re-serializes one.
//!
//! Read [`Provider`] first.

pub mod ollama;
pub mod openai_chat;
mod scan;

use serde::de::{self, Deserialize, Deserializer};
use serde_json::value::RawValue;
use std::borrow::Cow;

use crate::chunk::{ArgumentsDelta, Chunk, ChunkText, JsonLiteral, ToolCallDelta};

/// The wire format of a stream's frames.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Provider {
    /// `chat.completion.chunk` objects in SSE `data:` events.
    OpenAiChat,
    /// Ollama native `/api/chat` objects, one per NDJSON line.
    OllamaChat,
}

/// What a decoder learned about a frame besides its chunks.
#[derive(Debug, Default, PartialEq)]
pub struct FrameInfo<'a> {
    /// The yes/no facts ([`FrameInfo::is_object`] and the others), a bit
    /// each. One byte, so that the decoder writes them and the pipeline
    /// reads them back in one access: as four `bool`s they were written a
    /// byte at a time and read two at a time, a store-to-load forwarding
    /// stall on every frame.
    flags: u8,
    /// Top-level `id`, `object`, `created`, `model`, their raw JSON text
    /// verbatim (absent when `null`), for the `chunk` inject mode.
    pub id: Option<&'a str>,
    pub object: Option<&'a str>,
    pub created: Option<&'a str>,
    pub model: Option<&'a str>,
}

const IS_OBJECT: u8 = 1;
const ALREADY_ANNOTATED: u8 = 1 << 1;
const FINISHES: u8 = 1 << 2;

impl FrameInfo<'_> {
    /// A frame that is a JSON object; `already_annotated` when it has a
    /// top-level `toolCallProgress`.
    pub fn object(already_annotated: bool) -> Self {
        FrameInfo {
            flags: IS_OBJECT
                | if already_annotated {
                    ALREADY_ANNOTATED
                } else {
                    0
                },
            ..FrameInfo::default()
        }
    }

    /// The frame is a JSON object (so a key can be added before its last
    /// `}`); false for `[DONE]`.
    pub fn is_object(&self) -> bool {
        self.flags & IS_OBJECT != 0
    }

    /// The frame already has a top-level `toolCallProgress` (the stream was
    /// annotated before): nothing is added again.
    pub fn already_annotated(&self) -> bool {
        self.flags & ALREADY_ANNOTATED != 0
    }

    /// A choice of this frame has a `finish_reason`.
    pub fn finishes(&self) -> bool {
        self.flags & FINISHES != 0
    }

    /// Notes (when `yes`) that a choice has a `finish_reason`.
    pub fn set_finishes(&mut self, yes: bool) {
        if yes {
            self.flags |= FINISHES;
        }
    }
}

/// The keys of which an OpenAI-style chunk has one.
pub const OPENAI_CHUNK_KEYS: &str = "`choices`, `usage` or `error`";

/// The keys of which an Ollama line (`/api/chat`, `/api/generate`) has one.
pub const OLLAMA_CHUNK_KEYS: &str = "`message`, `response`, `thinking`, `done` or `error`";

/// Why a frame's data could not be understood. The frame is forwarded
/// unchanged all the same.
#[derive(Debug, thiserror::Error)]
pub enum FrameError {
    #[error("data is not UTF-8 (byte {valid_up_to} of the data)")]
    NotUtf8 { valid_up_to: usize },
    #[error("cannot parse JSON: {0}")]
    InvalidJson(serde_json::Error),
    #[error("not a JSON object")]
    NotAnObject,
    /// An object with none of a chunk's keys (each `null` or absent), as
    /// another API's stream has: named here, [`OPENAI_CHUNK_KEYS`] or
    /// [`OLLAMA_CHUNK_KEYS`].
    #[error("a JSON object without {0}, so no chat chunk")]
    NotAChunk(&'static str),
    #[error("unexpected JSON shape: {0}")]
    UnexpectedShape(serde_json::Error),
}

impl FrameError {
    /// Whether the frame may have been a chunk, and held a piece of an
    /// answer: one that is not JSON or not UTF-8, or of a shape the chunk
    /// does not take. A JSON value that is no chunk (a number, another
    /// API's `{"type":"ping"}`) held none.
    pub fn may_be_a_chunk(&self) -> bool {
        match self {
            FrameError::NotUtf8 { .. }
            | FrameError::InvalidJson(_)
            | FrameError::UnexpectedShape(_) => true,
            FrameError::NotAnObject | FrameError::NotAChunk(_) => false,
        }
    }
}

impl From<serde_json::Error> for FrameError {
    fn from(err: serde_json::Error) -> Self {
        match err.classify() {
            serde_json::error::Category::Data => FrameError::UnexpectedShape(err),
            serde_json::error::Category::Io
            | serde_json::error::Category::Syntax
            | serde_json::error::Category::Eof => FrameError::InvalidJson(err),
        }
    }
}

/// Decodes one frame's data with `provider`'s rules.
pub fn decode<'a>(
    provider: Provider,
    data: &'a [u8],
    state: &mut DecoderState,
    emit: &mut dyn FnMut(Chunk<'a>),
) -> Result<FrameInfo<'a>, FrameError> {
    decode_text(provider, utf8(data)?, state, emit)
}

/// [`decode`] of a frame already known to be valid UTF-8.
pub fn decode_text<'a>(
    provider: Provider,
    data: &'a str,
    state: &mut DecoderState,
    emit: &mut dyn FnMut(Chunk<'a>),
) -> Result<FrameInfo<'a>, FrameError> {
    match provider {
        Provider::OpenAiChat => openai_chat::decode(data, state, emit),
        Provider::OllamaChat => ollama::decode(data, state, emit),
    }
}

/// The frame as text. SIMD validation (simdutf8, 4–10× std's on text with
/// CJK and emoji); std's, which says where, only for the message of a frame
/// that fails.
fn utf8(data: &[u8]) -> Result<&str, FrameError> {
    match simdutf8::basic::from_utf8(data) {
        Ok(text) => Ok(text),
        Err(_) => match std::str::from_utf8(data) {
            Ok(text) => Ok(text),
            Err(e) => Err(FrameError::NotUtf8 {
                valid_up_to: e.valid_up_to(),
            }),
        },
    }
}

/// What a decoder must remember between frames.
#[derive(Debug, Default)]
pub struct DecoderState {
    /// Ollama: the index the next tool call gets unless it brings a higher
    /// free one.
    pub ollama_calls: i64,
    /// Reused by the fast paths: no allocation per frame in steady state.
    pub(crate) spans: openai_chat::Spans,
    pub(crate) lines: ollama::Lines,
    /// Set when nothing reads [`FrameInfo::id`], `object`, `created` or
    /// `model` (only the `chunk` inject mode writes them): the fast path
    /// then leaves them `None`, four string slices fewer per frame.
    pub without_frame_head: bool,
    /// The frame about to be decoded is the one [`match_prefix`] last
    /// recognized: its holes are in place, the template need not be
    /// matched again. Set by the caller for that frame only (a framer
    /// says which frame it was); taken by the decoder.
    ///
    /// [`match_prefix`]: DecoderState::match_prefix
    pub(crate) probed: bool,
}

impl DecoderState {
    /// Whether `text` starts with a frame of the shape `provider`'s
    /// decoder last learned, and its length: the [`Probe`] a framer asks
    /// before it searches for the end of a line (the template match of
    /// the decoder's fast path, `Template::match_prefix`).
    ///
    /// [`Probe`]: crate::framing::window::Probe
    pub(crate) fn match_prefix(&mut self, provider: Provider, text: &str) -> Option<usize> {
        match provider {
            Provider::OpenAiChat => self.spans.match_prefix(text),
            Provider::OllamaChat => self.lines.match_prefix(text),
        }
    }

    /// For the frame [`match_prefix`](Self::match_prefix) just
    /// recognized: the text it holds, when it holds nothing else (see
    /// [`ProbedText`]); `None` when it may hold more.
    pub(crate) fn probed_text(&self, provider: Provider) -> Option<ProbedText> {
        match provider {
            Provider::OpenAiChat => self.spans.probed_text(),
            Provider::OllamaChat => self.lines.probed_text(),
        }
    }

    /// For the frame [`match_prefix`](Self::match_prefix) just recognized
    /// at the start of `data` (which starts where the text it was asked of
    /// starts): its one tool call delta, when it holds that and nothing
    /// else (an OpenAI-style frame of the steady shape, which
    /// [`decode`] would decode into that one [`Chunk::ToolCallDelta`]);
    /// `None` when it may hold more. Ollama's lines carry whole calls,
    /// never such a frame.
    pub(crate) fn probed_call<'a>(
        &self,
        provider: Provider,
        data: &'a str,
    ) -> Option<ToolCallDelta<'a>> {
        match provider {
            Provider::OpenAiChat => self.spans.probed_call(data),
            Provider::OllamaChat => None,
        }
    }
}

/// A recognized frame of text and nothing else: whether it holds
/// reasoning, and content (non-empty; the decoder would emit a
/// [`Chunk::Reasoning`] then a [`Chunk::Text`] for them). It says
/// nothing of the text itself, which only a caller that reads it needs
/// decoded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct ProbedText {
    pub reasoning: bool,
    pub content: bool,
}

// === shared borrowed views ===
//
// Every leaf is parsed inside `Deserialize`, so a frame either parses whole
// or fails before any chunk is emitted. Strings go through `&RawValue` and
// our own unescaper: JavaScript accepts lone surrogate escapes (`\ud83d`,
// which a UTF-16 server can produce by cutting a fragment inside a pair),
// serde_json's string decoder does not.

/// A JSON string that borrows from the input when it has no escapes.
#[derive(Debug)]
pub(crate) struct JsonStr<'a>(pub Cow<'a, str>);

impl<'de: 'a, 'a> Deserialize<'de> for JsonStr<'a> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let raw: &'de RawValue = Deserialize::deserialize(d)?;
        decode_string(raw.get()).map(JsonStr).ok_or_else(|| {
            de::Error::custom(format_args!("expected a string, found {}", raw.get()))
        })
    }
}

/// A field read when it has the shape expected, and otherwise passed over
/// as its raw JSON: one odd field (`usage` a string, `reasoning_content`
/// a number) costs its frame nothing else. The decoder emits a
/// [`Chunk::Ignored`] for it, which the pipeline reports.
pub(crate) enum Lenient<'a, T> {
    Fit(T),
    Odd(&'a str),
}

/// What a [`Lenient`] field must be besides what its type reads: serde's
/// derived structs also read an array, by position (`"usage":[5,6,11]`),
/// which is no shape a provider means.
pub(crate) trait FieldShape {
    /// Only a JSON object fits.
    const OBJECT: bool;
}

impl FieldShape for JsonStr<'_> {
    const OBJECT: bool = false;
}

impl<'de: 'a, 'a, T: Deserialize<'de> + FieldShape> Deserialize<'de> for Lenient<'a, T> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let raw: &'de RawValue = Deserialize::deserialize(d)?;
        let json = raw.get();
        if T::OBJECT && !json.starts_with('{') {
            return Ok(Lenient::Odd(json));
        }
        Ok(match serde_json::from_str(json) {
            Ok(value) => Lenient::Fit(value),
            Err(_) => Lenient::Odd(json),
        })
    }
}

impl<'a, T> Lenient<'a, T> {
    /// The value of `field`, if it came and fits; one that does not is
    /// emitted as ignored.
    pub fn fit(
        field: Option<Self>,
        name: &'static str,
        emit: &mut dyn FnMut(Chunk<'a>),
    ) -> Option<T> {
        match field? {
            Lenient::Fit(value) => Some(value),
            Lenient::Odd(raw) => {
                emit(Chunk::Ignored { field: name, raw });
                None
            }
        }
    }
}

impl<'a> JsonStr<'a> {
    /// The string, if not empty (SPEC.md: `""` is no value).
    pub fn non_empty(this: Option<JsonStr<'a>>) -> Option<Cow<'a, str>> {
        this.map(|s| s.0).filter(|s| !s.is_empty())
    }
}

/// The text of a JSON string literal (`json` is a validated JSON value),
/// or `None` when it is not a string. Lone surrogate escapes become U+FFFD,
/// which is one UTF-16 unit like the surrogate, so lengths stay JavaScript's.
pub(crate) fn decode_string(json: &str) -> Option<Cow<'_, str>> {
    let inner = json.strip_prefix('"')?.strip_suffix('"')?;
    if plain(inner) {
        // A validated JSON string without escapes is its own text.
        return Some(Cow::Borrowed(inner));
    }
    let mut out = String::with_capacity(inner.len());
    unescape_into(inner, &mut out)?;
    Some(Cow::Owned(out))
}

/// Appends the text of `json`, a validated JSON string literal (quotes
/// included), to `out`, as [`decode_string`] decodes it; `None` (with
/// `out` partly written) when it is not a string literal.
pub(crate) fn decode_string_into(json: &str, out: &mut String) -> Option<()> {
    let inner = json.strip_prefix('"')?.strip_suffix('"')?;
    if plain(inner) {
        out.push_str(inner);
        return Some(());
    }
    unescape_into(inner, out)
}

/// Whether the inside of a JSON string literal has no escape.
fn plain(inner: &str) -> bool {
    let bytes = inner.as_bytes();
    // A tool call's argument delta is a few bytes: the slice's own search
    // (a plain loop at that length) finds its escapes in less than
    // `memchr`'s set-up costs.
    if bytes.len() < 16 {
        !bytes.contains(&b'\\')
    } else {
        memchr::memchr(b'\\', bytes).is_none()
    }
}

/// Appends the text of `json`, a validated JSON string literal (quotes
/// included), to `out`, as one fragment of a longer text: `carry` is a
/// high surrogate the fragment before ended with, which a low surrogate
/// at this one's start completes (a server that cuts text in UTF-16
/// units can cut a pair), and on return the high surrogate this one ends
/// with, not yet written. A surrogate left alone is U+FFFD, as in
/// [`decode_string`]. `None` (with `out` partly written) when `json` is
/// not a string.
pub(crate) fn decode_fragment_into(
    json: &str,
    out: &mut String,
    carry: &mut Option<u16>,
) -> Option<()> {
    let inner = json.strip_prefix('"')?.strip_suffix('"')?;
    if inner.is_empty() {
        // Nothing between the halves of a pair: the carry waits on.
        return Some(());
    }
    if plain(inner) {
        flush_high(carry, out);
        out.push_str(inner);
        return Some(());
    }
    unescape_joined(inner, out, carry, true)
}

/// Appends `inner`, the inside of a JSON string literal, unescaped.
fn unescape_into(inner: &str, out: &mut String) -> Option<()> {
    unescape_joined(inner, out, &mut None, false)
}

/// [`unescape_into`], after a high surrogate `carry` the text before ended
/// with; with `carry_out`, a high surrogate at the very end is left in
/// `carry` rather than written as U+FFFD.
fn unescape_joined(
    inner: &str,
    out: &mut String,
    carry: &mut Option<u16>,
    carry_out: bool,
) -> Option<()> {
    let mut rest = inner;
    let mut pending_high: Option<u16> = carry.take();
    // Runs without escapes are copied whole; each escape is decoded.
    while let Some(at) = memchr::memchr(b'\\', rest.as_bytes()) {
        let (run, escape) = rest.split_at(at);
        if !run.is_empty() {
            flush_high(&mut pending_high, out);
            out.push_str(run);
        }
        let mut chars = escape.get(1..)?.chars();
        let escaped = match chars.next()? {
            'u' => {
                let hex = escape.get(2..6)?;
                let unit = u16::from_str_radix(hex, 16).ok()?;
                rest = escape.get(6..)?;
                match (pending_high.take(), unit) {
                    (Some(high), 0xDC00..=0xDFFF) => {
                        let code = 0x10000
                            + ((u32::from(high) - 0xD800) << 10)
                            + (u32::from(unit) - 0xDC00);
                        out.push(char::from_u32(code).unwrap_or(char::REPLACEMENT_CHARACTER));
                    }
                    (high, 0xD800..=0xDBFF) => {
                        if high.is_some() {
                            out.push(char::REPLACEMENT_CHARACTER);
                        }
                        pending_high = Some(unit);
                    }
                    (high, _) => {
                        if high.is_some() {
                            out.push(char::REPLACEMENT_CHARACTER);
                        }
                        out.push(
                            char::from_u32(u32::from(unit)).unwrap_or(char::REPLACEMENT_CHARACTER),
                        );
                    }
                }
                continue;
            }
            '"' => '"',
            '\\' => '\\',
            '/' => '/',
            'b' => '\u{8}',
            'f' => '\u{c}',
            'n' => '\n',
            'r' => '\r',
            't' => '\t',
            _ => return None,
        };
        rest = escape.get(2..)?;
        flush_high(&mut pending_high, out);
        out.push(escaped);
    }
    if !rest.is_empty() {
        flush_high(&mut pending_high, out);
        out.push_str(rest);
    }
    if carry_out {
        *carry = pending_high;
    } else {
        flush_high(&mut pending_high, out);
    }
    Some(())
}

/// A high surrogate not followed by a low one stands alone: U+FFFD.
fn flush_high(pending_high: &mut Option<u16>, out: &mut String) {
    if pending_high.take().is_some() {
        out.push(char::REPLACEMENT_CHARACTER);
    }
}

/// A tool call's `arguments`: a string fragment or a whole value.
#[derive(Debug)]
pub(crate) struct ArgumentsView<'a>(pub ArgumentsDelta<'a>);

impl<'de: 'a, 'a> Deserialize<'de> for ArgumentsView<'a> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let raw: &'de RawValue = Deserialize::deserialize(d)?;
        let json = raw.get();
        if json == "null" {
            return Ok(ArgumentsView(ArgumentsDelta::Unchanged));
        }
        if let Some(text) = JsonLiteral::string(json) {
            return Ok(ArgumentsView(ArgumentsDelta::Append(ChunkText::Json(text))));
        }
        // A whole value: serialized as JavaScript's JSON.stringify would,
        // which for a compact value is usually the text as it came.
        if crate::js::stringifies_to_itself(json) {
            return Ok(ArgumentsView(ArgumentsDelta::Replace(json.to_owned())));
        }
        let text = crate::js::restringify(json)
            .map_err(|err| de::Error::custom(without_position(&err)))?;
        Ok(ArgumentsView(ArgumentsDelta::Replace(text)))
    }
}

/// The message of an error from parsing a value inside a frame anew,
/// without its place, which counts from the value's start: the frame's
/// parse adds the place in the frame.
fn without_position(err: &serde_json::Error) -> String {
    let message = err.to_string();
    let place = format!(" at line {} column {}", err.line(), err.column());
    match message.strip_suffix(&place) {
        Some(message) => message.to_owned(),
        None => message,
    }
}

/// A JSON number that is an integer (`1.0` included, as JavaScript's
/// `Number.isInteger` would say) within `i64`; anything else is `None`.
pub(crate) fn raw_i64(raw: Option<&str>) -> Option<i64> {
    let text = raw?;
    // Nearly every index is one digit: no parser for it.
    if let &[digit @ b'0'..=b'9'] = text.as_bytes() {
        return Some(i64::from(digit - b'0'));
    }
    if let Ok(n) = text.parse::<i64>() {
        return Some(n);
    }
    let f = text.parse::<f64>().ok()?;
    // The range check keeps the cast exact: ±2^63 excluded.
    (f.fract() == 0.0 && f.abs() < 9.223_372_036_854_776e18).then_some(f as i64)
}

/// A JSON number that is a non-negative integer; anything else is `None`.
pub(crate) fn raw_u64(raw: Option<&str>) -> Option<u64> {
    raw_i64(raw).and_then(|n| u64::try_from(n).ok())
}

/// Counts from their raw members (both decoder paths of each provider):
/// a member that is no count (`"9"`, `-3`, `9.5`) counts as missing and is
/// named ([`Chunk::Ignored`], reported once a stream), as a field of an
/// odd shape is; `null` or no member is missing without a word.
pub(crate) fn counts<'a, const N: usize>(
    members: [(Option<&'a str>, &'static str); N],
    emit: &mut dyn FnMut(Chunk<'a>),
) -> [Option<u64>; N] {
    members.map(|(raw, field)| {
        let count = raw_u64(raw);
        if count.is_none()
            && let Some(raw) = raw.filter(|raw| *raw != "null")
        {
            emit(Chunk::Ignored { field, raw });
        }
        count
    })
}

/// True when a raw value is present and not `null`.
pub(crate) fn is_set(raw: Option<&RawValue>) -> bool {
    raw.is_some_and(|r| r.get() != "null")
}

/// The frame's data must be a JSON object: serde would read an array into
/// a struct field by field, and JavaScript's `chunk.choices` of an array is
/// `undefined`.
pub(crate) fn expect_object(data: &str) -> Result<(), FrameError> {
    if data.trim_start().starts_with('{') {
        Ok(())
    } else {
        Err(FrameError::NotAnObject)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strings_decode_like_javascript_json_parse() {
        let s = |json: &str| decode_string(json).map(|c| c.into_owned());
        assert_eq!(s(r#""plain""#).as_deref(), Some("plain"));
        assert!(matches!(
            decode_string(r#""plain""#),
            Some(Cow::Borrowed(_))
        ));
        assert_eq!(
            s(r#""a\"b\\c\/d\n\t\u00e9""#).as_deref(),
            Some("a\"b\\c/d\n\t\u{e9}")
        );
        assert_eq!(s(r#""\ud83d\ude00""#).as_deref(), Some("😀"));
        // Lone surrogates: one U+FFFD each, one UTF-16 unit each, as in JS.
        assert_eq!(s(r#""x\ud83d""#).as_deref(), Some("x\u{fffd}"));
        assert_eq!(s(r#""\ude00y""#).as_deref(), Some("\u{fffd}y"));
        assert_eq!(s(r#""\ud83d\ud83d\ude00""#).as_deref(), Some("\u{fffd}😀"));
        assert_eq!(
            crate::js::utf16_len(&s(r#""\ud83dx\ude00""#).unwrap_or_default()),
            3
        );
        assert_eq!(s("5"), None);
        assert_eq!(s("null"), None);
    }

    #[test]
    fn integers_as_javascript_sees_them() {
        assert_eq!(raw_i64(Some("3")), Some(3));
        assert_eq!(raw_i64(Some("0")), Some(0));
        assert_eq!(raw_i64(Some("9")), Some(9));
        assert_eq!(raw_i64(Some("-")), None);
        assert_eq!(raw_i64(Some("-1")), Some(-1));
        assert_eq!(raw_i64(Some("2.0")), Some(2));
        assert_eq!(raw_i64(Some("4294967296")), Some(4_294_967_296));
        assert_eq!(raw_i64(Some("1.5")), None);
        assert_eq!(raw_i64(Some("\"0\"")), None);
        assert_eq!(raw_i64(Some("1e300")), None);
        assert_eq!(raw_u64(Some("-1")), None);
    }

    // === the fast path answers as the serde path does ===

    /// Decodes `data` both ways and requires the same chunks and info, or
    /// an error from both. The fast path keeps `state` from frame to frame
    /// (its template of the last valid frame), as in a stream.
    fn same_as_serde(provider: Provider, data: &str, state: &mut DecoderState) {
        let mut fast = Vec::new();
        state.ollama_calls = 0;
        let fast_info = decode(provider, data.as_bytes(), state, &mut |c| fast.push(c));
        let mut slow = Vec::new();
        let mut state = DecoderState::default();
        let slow_info = match provider {
            Provider::OpenAiChat if data.trim() == "[DONE]" => return,
            Provider::OpenAiChat => openai_chat::decode_serde(data, &mut |c| slow.push(c)),
            Provider::OllamaChat => ollama::decode_serde(data, &mut state, &mut |c| slow.push(c)),
        };
        match (fast_info, slow_info) {
            (Ok(f), Ok(s)) => assert_eq!(f, s, "{data}"),
            (Err(_), Err(_)) => {}
            (f, s) => panic!("fast {f:?} serde {s:?} on {data}"),
        }
        assert_eq!(fast, slow, "{data}");
    }

    fn fixture_frames() -> Vec<(Provider, String)> {
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures");
        let mut frames = Vec::new();
        let mut dirs = vec![root];
        while let Some(dir) = dirs.pop() {
            for entry in std::fs::read_dir(&dir).expect("fixtures").flatten() {
                let path = entry.path();
                if path.is_dir() {
                    dirs.push(path);
                    continue;
                }
                let text = std::fs::read_to_string(&path).unwrap_or_default();
                let name = path.to_string_lossy();
                for line in text.lines() {
                    if name.ends_with(".ndjson") {
                        frames.push((Provider::OllamaChat, line.to_owned()));
                    } else if let Some(data) = line.strip_prefix("data:") {
                        frames.push((Provider::OpenAiChat, data.trim_start().to_owned()));
                    }
                }
            }
        }
        frames.sort();
        frames.dedup();
        frames
    }

    /// A usage member that is no count (`"9"`, `-3`, `9.5`, `true`) counts
    /// as missing and is named, by both decoder paths; `null` is missing
    /// without a word, and an integral `12.0` counts. Before, each counted
    /// 0 without a word.
    #[test]
    fn usage_members_that_are_no_counts_are_named() {
        use crate::chunk::Usage;
        let usage = |prompt_tokens, completion_tokens, total_tokens| Usage {
            prompt_tokens,
            completion_tokens,
            total_tokens,
        };
        // (provider, frame, the members named as ignored, the usage)
        type Case<'a> = (Provider, &'a str, &'a [(&'a str, &'a str)], Usage);
        let cases: [Case; 4] = [
            (
                Provider::OpenAiChat,
                r#"{"id":"a","choices":[],"usage":{"prompt_tokens":"9","completion_tokens":-3,"total_tokens":9.5}}"#,
                &[
                    ("usage.prompt_tokens", "\"9\""),
                    ("usage.completion_tokens", "-3"),
                    ("usage.total_tokens", "9.5"),
                ],
                usage(0, 0, 0),
            ),
            (
                Provider::OpenAiChat,
                r#"{"id":"a","choices":[],"usage":{"prompt_tokens":4,"completion_tokens":null,"total_tokens":12.0}}"#,
                &[],
                usage(4, 0, 12),
            ),
            (
                Provider::OpenAiChat,
                r#"{"id":"a","choices":[],"x_groq":{"usage":{"prompt_tokens":true,"completion_tokens":2}}}"#,
                &[("x_groq.usage.prompt_tokens", "true")],
                usage(0, 2, 2),
            ),
            (
                Provider::OllamaChat,
                r#"{"model":"m","message":{"role":"assistant","content":""},"done":true,"prompt_eval_count":"7","eval_count":5}"#,
                &[("prompt_eval_count", "\"7\"")],
                usage(0, 5, 5),
            ),
        ];
        for (provider, data, ignored, expected) in cases {
            let mut state = DecoderState::default();
            // Learned, then matched: both of the fast path's branches.
            for _ in 0..2 {
                let mut got = Vec::new();
                decode(provider, data.as_bytes(), &mut state, &mut |c| got.push(c))
                    .expect("decodes");
                let named: Vec<(&str, &str)> = got
                    .iter()
                    .filter_map(|c| match c {
                        Chunk::Ignored { field, raw } => Some((*field, *raw)),
                        _ => None,
                    })
                    .collect();
                assert_eq!(named, ignored, "{data}");
                assert!(got.contains(&Chunk::Usage(expected)), "{data}: {got:?}");
                same_as_serde(provider, data, &mut state);
            }
        }
    }

    /// Ollama lines: `/api/generate`'s `response` and `thinking` are text
    /// and reasoning, as `/api/chat`'s `message` fields are; a line with
    /// none of a chunk's keys is no chunk (it was taken for an empty one,
    /// and its text lost without a word); a line with both APIs' fields
    /// gives the chat's first. Both paths, learned and matched.
    #[test]
    fn ollama_generate_lines_are_read_and_other_objects_are_no_chunks() {
        let text = |text: &'static str| Chunk::Text {
            choice: 0,
            text: text.into(),
        };
        let reasoning = |text: &'static str| Chunk::Reasoning {
            choice: 0,
            text: text.into(),
        };
        let cases: [(&str, Option<Vec<Chunk<'static>>>); 6] = [
            (
                r#"{"model":"m","created_at":"t","response":"Hi","done":false}"#,
                Some(vec![text("Hi")]),
            ),
            (
                r#"{"model":"m","created_at":"t","response":"","thinking":"hmm","done":false}"#,
                Some(vec![reasoning("hmm")]),
            ),
            (
                r#"{"model":"m","message":{"content":"a"},"response":"b","done":false}"#,
                Some(vec![text("a"), text("b")]),
            ),
            (r#"{"foo":1}"#, None),
            (
                r#"{"type":"ping","done":null,"message":null,"error":null}"#,
                None,
            ),
            (r#"{"done_reason":"stop","eval_count":3}"#, None),
        ];
        for (data, expected) in cases {
            let mut state = DecoderState::default();
            for _ in 0..2 {
                let mut got = Vec::new();
                let info = decode(
                    Provider::OllamaChat,
                    data.as_bytes(),
                    &mut state,
                    &mut |c| got.push(c),
                );
                match &expected {
                    Some(chunks) => {
                        assert!(info.is_ok(), "{data}: {info:?}");
                        assert_eq!(&got, chunks, "{data}");
                    }
                    None => assert!(
                        matches!(info, Err(FrameError::NotAChunk(OLLAMA_CHUNK_KEYS))),
                        "{data}: {info:?}"
                    ),
                }
                same_as_serde(Provider::OllamaChat, data, &mut state);
            }
        }
    }

    #[test]
    fn fast_path_equals_serde_on_fixture_frames_and_their_mutations() {
        let frames = fixture_frames();
        assert!(frames.len() > 200, "{}", frames.len());
        let replacements = [
            "\"", "\\", "{", "}", "[", "]", ",", ":", "0", "-", " ", "\u{1}", "n", "null", "true",
            "\"\"", "{}", "[]", "1.5", "1e400", "\\ud83d",
        ];
        let mut checked = 0usize;
        let mut state = DecoderState::default();
        for (provider, data) in &frames {
            same_as_serde(*provider, data, &mut state);
            for at in (0..data.len()).filter(|&i| data.is_char_boundary(i)) {
                same_as_serde(*provider, &data[..at], &mut state);
                let next = data[at..].chars().next().map_or(0, char::len_utf8);
                // The frame itself again, so that the mutations below meet
                // its template (the fast path's other branch). Two of the
                // replacements per position, rotating, keeps the test to
                // seconds in a debug build.
                same_as_serde(*provider, data, &mut state);
                for k in 0..2 {
                    let with = replacements[(at + k * 7) % replacements.len()];
                    let mut mutated = String::with_capacity(data.len() + 8);
                    mutated.push_str(&data[..at]);
                    mutated.push_str(with);
                    mutated.push_str(&data[at + next..]);
                    same_as_serde(*provider, &mutated, &mut state);
                    // Inserted rather than replaced.
                    mutated.clear();
                    mutated.push_str(&data[..at]);
                    mutated.push_str(with);
                    mutated.push_str(&data[at..]);
                    same_as_serde(*provider, &mutated, &mut state);
                    checked += 2;
                }
            }
        }
        assert!(checked > 50_000, "{checked}");
    }

    /// Frames next to the steady shape of a streaming call (one entry with
    /// arguments and nothing else), each decoded twice in a row: learned,
    /// then matched. The fixtures' frames that carry a name carry an id too;
    /// these do not.
    #[test]
    fn fast_path_equals_serde_on_shapes_beside_a_streaming_call() {
        // (top level before `choices`, the choice's keys before `delta`, the
        // delta's keys before `tool_calls`, choices after the first, top
        // level after `choices`)
        let frame = |entry: &str, parts: [&str; 5]| {
            let [top, choice, delta, choices, after] = parts;
            format!(
                r#"{{"id":"c",{top}"choices":[{{{choice}"delta":{{{delta}"tool_calls":[{entry}]}}}}{choices}]{after}}}"#
            )
        };
        let entries = [
            r#"{"index":1,"function":{"arguments":"{\"a\":"}}"#,
            r#"{"index":1,"function":{"name":"f","arguments":"x"}}"#,
            r#"{"index":1,"id":"call_1","function":{"arguments":"x"}}"#,
            r#"{"function":{"arguments":"x"}}"#,
            r#"{"index":2,"function":{"arguments":""}}"#,
            r#"{"index":-3,"type":"function","function":{"arguments":"\u00e9"}}"#,
            r#"{"index":1,"function":{"arguments":"x"}},{"index":9,"function":{"arguments":"y"}}"#,
        ];
        let neighbours = [
            ["", r#""index":0,"#, "", "", ""],
            ["", r#""index":0,"finish_reason":"tool_calls","#, "", "", ""],
            ["", r#""finish_reason":null,"#, "", "", ""],
            ["", "", r#""content":"t","#, "", ""],
            ["", "", r#""reasoning":"r","#, "", ""],
            ["", "", r#""reasoning_content":"r","#, "", ""],
            ["", "", "", "", r#","usage":{"total_tokens":3}"#],
            ["", "", "", "", r#","x_groq":{"usage":{"total_tokens":3}}"#],
            [r#""error":"e","#, "", "", "", ""],
            [r#""toolCallProgress":[],"#, "", "", "", ""],
            ["", r#""index":1,"#, "", r#",{"index":2,"delta":{}}"#, ""],
        ];
        let mut frames = Vec::new();
        for entry in entries {
            for parts in neighbours {
                let frame = frame(entry, parts);
                assert!(
                    serde_json::from_str::<serde_json::Value>(&frame).is_ok(),
                    "{frame}"
                );
                frames.push(frame);
            }
        }
        let mut state = DecoderState::default();
        for frame in &frames {
            same_as_serde(Provider::OpenAiChat, frame, &mut state);
            same_as_serde(Provider::OpenAiChat, frame, &mut state);
        }
        // Without the frame head, as every inject mode but `chunk` decodes.
        let mut state = DecoderState {
            without_frame_head: true,
            ..DecoderState::default()
        };
        for frame in &frames {
            for _ in 0..2 {
                let mut fast = Vec::new();
                let info = decode(
                    Provider::OpenAiChat,
                    frame.as_bytes(),
                    &mut state,
                    &mut |c| fast.push(c),
                );
                let mut slow = Vec::new();
                let slow_info = openai_chat::decode_serde(frame, &mut |c| slow.push(c));
                assert_eq!(fast, slow, "{frame}");
                let (info, slow_info) = (info.expect("fast"), slow_info.expect("serde"));
                assert_eq!(info.id, None, "{frame}");
                assert_eq!(info.flags, slow_info.flags, "{frame}");
            }
        }
    }

    #[test]
    fn fast_path_equals_serde_on_shapes_it_hands_over() {
        let openai = [
            r#"{"choices":[{"delta":{"content":"a"}}],"choices":[]}"#,
            r#"{"choi\u0063es":[{"delta":{"content":"a"}}]}"#,
            r#"{"choices":[[0,{"content":"a"}]]}"#,
            r#"{"choices":[null]}"#,
            r#"{"choices":null,"usage":null,"x_groq":null,"error":null,"id":null}"#,
            r#"{"choices":[{"index":1,"delta":null,"finish_reason":"stop"}],"usage":{}}"#,
            r#"{"choices":[{"delta":{"tool_calls":[{"index":0,"function":{"arguments":{"a":[1,2.50]}}}]}}]}"#,
            r#"{"choices":[{"delta":{"tool_calls":[{"index":0,"function":{"arguments":1e400}}]}}]}"#,
            r#"{"choices":[{"delta":{"tool_calls":[{"index":0,"id":5}]}}]}"#,
            r#"{"choices":[{"delta":{"tool_calls":[{"index":0,"id":"","function":null}]}}]}"#,
            r#"{"choices":[{"delta":{"tool_calls":[null]}}]}"#,
            r#"{"choices":[{"delta":{"content":[{"type":"text","text":"x"}]}}]}"#,
            r#"{"choices":[{"delta":{"content":{"a":1},"reasoning":"r","reasoning_content":""}}]}"#,
            r#"{"choices":[{"delta":{"content":"\ud83d\ude00\ud83d"},"index":"2"}]}"#,
            r#"{"choices":[{"delta":{"content":"x","content":"y"}}]}"#,
            r#"{"choices":[],"x_groq":{"usage":{"prompt_tokens":1},"usage":null}}"#,
            r#"{"choices":[],"usage":5}"#,
            r#"{"choices":[],"usage":{"prompt_tokens":-1,"total_tokens":2.0}}"#,
            r#"{"error":"plain"}"#,
            r#"{"error":{"message":"m","code":1}}"#,
            r#"{"toolCallProgress":null,"choices":[]}"#,
            r#"{"toolCallProgress":{"index":0},"choices":[]}"#,
            r#"  {"choices":[]}  "#,
            r#"{"choices":[]} x"#,
            r#"{"a":[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]}"#,
            "[DONE]",
            "[1]",
            "",
        ];
        let mut state = DecoderState::default();
        for data in openai {
            same_as_serde(Provider::OpenAiChat, data, &mut DecoderState::default());
            same_as_serde(Provider::OpenAiChat, data, &mut state);
        }
        let ollama = [
            r#"{"message":{"content":"a"},"done":"yes"}"#,
            r#"{"message":{"content":"a"},"done":null,"done_reason":"stop"}"#,
            r#"{"message":{"content":"a","tool_calls":[]},"done":false}"#,
            r#"{"message":{"content":"a","tool_calls":null},"done":true,"eval_count":3}"#,
            r#"{"message":null,"done":true,"prompt_eval_count":null}"#,
            r#"{"message":{"content":5}}"#,
            r#"{"message":{"thinking":"t","thinking":"u"}}"#,
            r#"{"error":"model not found"}"#,
            r#"{"message":[]}"#,
        ];
        for data in ollama {
            same_as_serde(Provider::OllamaChat, data, &mut DecoderState::default());
        }
    }

    /// Fragments of one text, joined: a pair cut between two fragments is
    /// one character, also with an empty fragment between the halves; a
    /// half left alone is U+FFFD (here by the caller, at the end).
    #[test]
    fn a_pair_cut_between_fragments_is_joined() {
        let join = |fragments: &[&str]| {
            let mut out = String::new();
            let mut carry = None;
            for fragment in fragments {
                decode_fragment_into(fragment, &mut out, &mut carry).expect("a string");
            }
            (out, carry)
        };
        assert_eq!(
            join(&[r#""a\ud83d""#, r#""\ude00b""#]),
            ("a\u{1F600}b".to_owned(), None)
        );
        assert_eq!(
            join(&[r#""a\ud83d""#, r#""""#, r#""\ude00b""#]),
            ("a\u{1F600}b".to_owned(), None)
        );
        assert_eq!(
            join(&[r#""\ud83d""#, r#""x""#, r#""\ud83d""#]),
            ("\u{FFFD}x".to_owned(), Some(0xD83D))
        );
        assert_eq!(
            join(&[r#""\ud83d""#, r#""\n""#]),
            ("\u{FFFD}\n".to_owned(), None)
        );
    }
}
