//! The normalized stream chunk every provider decoder produces.
//!
//! A provider frame (an SSE event, an NDJSON line) becomes zero or more
//! [`Chunk`]s, in the order their effects happen within the frame. Chunks
//! borrow from the frame's data where they can; the raw frame itself stays
//! with the caller, which forwards it unchanged whatever the chunks say.
//!
//! Read [`Chunk`] first.

use std::borrow::Cow;

/// One effect of a provider frame on the stream's state.
#[derive(Debug, Clone, PartialEq)]
pub enum Chunk<'a> {
    /// Answer text for choice `choice`. Never empty.
    Text { choice: i64, text: ChunkText<'a> },
    /// Reasoning text (`reasoning_content`, `reasoning`, Ollama `thinking`,
    /// Mistral thinking parts). Never empty.
    Reasoning { choice: i64, text: ChunkText<'a> },
    /// One entry of a `tool_calls` list.
    ToolCallDelta(ToolCallDelta<'a>),
    /// The choice reported a `finish_reason` (Ollama: the `done` line,
    /// with its `done_reason`).
    Finish { choice: i64, kind: FinishKind },
    /// Token usage; the last one of a stream wins.
    Usage(Usage),
    /// The provider reported an error inside the stream: its `error`
    /// value as it came (JSON text), and the message read from it.
    Error { raw: &'a str, message: String },
    /// The provider said the stream is over (`[DONE]`, Ollama `done: true`).
    Done,
    /// A field of the frame did not have the shape expected (`usage` a
    /// string, `reasoning_content` a number): it was passed over, and the
    /// rest of the frame read. `field` names it; `raw` is its JSON value.
    Ignored { field: &'static str, raw: &'a str },
}

/// How a choice ended, by its `finish_reason` (Ollama: `done_reason`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishKind {
    /// As the model meant to: `stop`, `tool_calls` and every reason not
    /// below.
    Whole,
    /// Cut short: `length` or `max_tokens` (the token limit),
    /// `content_filter`, `error`. Its text, and its last call's arguments,
    /// may stop in the middle.
    CutShort,
}

impl FinishKind {
    /// The kind of a `finish_reason` (or `done_reason`) given as its raw
    /// JSON value, or `None` when the value says nothing: `null`, or an
    /// empty string (Ollama's `/v1` sent `"finish_reason":""` on every
    /// chunk).
    pub fn of(raw: &str) -> Option<FinishKind> {
        match raw {
            "null" | "\"\"" => None,
            "\"length\"" | "\"max_tokens\"" | "\"content_filter\"" | "\"error\"" => {
                Some(FinishKind::CutShort)
            }
            _ => Some(FinishKind::Whole),
        }
    }
}

/// A text field of a choice: answer or reasoning.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TextField {
    Content,
    Reasoning,
}

/// High surrogates a choice's text field ended with, held back for the low
/// one its next text may start with: written alone, each half would be a
/// U+FFFD where JavaScript, joining the texts, has one character. The line
/// formats (`LineEncoder`) and the events route (`EventLog`) hold them so.
#[derive(Debug, Default)]
pub struct HeldHalves(Vec<(i64, TextField, u16)>);

impl HeldHalves {
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Whether `text` of `choice`'s `field` can be taken as it is: nothing
    /// is held for it, and it has no escape (so it cannot end with a half).
    pub fn passes(&self, choice: i64, field: TextField, text: &ChunkText<'_>) -> bool {
        !self.0.iter().any(|&(c, f, _)| c == choice && f == field) && text.is_plain()
    }

    /// Appends `text` of `choice`'s `field` to `out`, joined with the half
    /// held for it, and holds the half it ends with.
    pub fn join(&mut self, choice: i64, field: TextField, text: &ChunkText<'_>, out: &mut String) {
        let held = self
            .0
            .iter()
            .position(|&(c, f, _)| c == choice && f == field);
        let mut carry = held.map(|at| self.0.swap_remove(at).2);
        text.push_joined(out, &mut carry);
        if let Some(high) = carry {
            self.0.push((choice, field, high));
        }
    }

    /// Ends the held halves `which` picks, in the order they were held:
    /// each is handed to `end` (which writes it as U+FFFD) and forgotten.
    pub fn end(
        &mut self,
        which: impl Fn(i64, TextField) -> bool,
        mut end: impl FnMut(i64, TextField),
    ) {
        let mut i = 0;
        while let Some(&(choice, field, _)) = self.0.get(i) {
            if which(choice, field) {
                self.0.remove(i);
                end(choice, field);
            } else {
                i += 1;
            }
        }
    }

    /// Forgets them all.
    pub fn clear(&mut self) {
        self.0.clear();
    }
}

/// The text of a [`Chunk::Text`] or [`Chunk::Reasoning`]. Progress only
/// needs to know that text came, so the fast decoders hand over the JSON
/// string as it stands and it is unescaped only when read ([`get`](Self::get):
/// the line formats, the proxy's events).
#[derive(Debug, Clone)]
pub enum ChunkText<'a> {
    Decoded(Cow<'a, str>),
    Json(JsonLiteral<'a>),
}

/// A JSON string literal, quotes included, that a decoder of this crate
/// validated (only they make one), so it always unescapes.
#[derive(Debug, Clone, Copy)]
pub struct JsonLiteral<'a>(&'a str);

impl<'a> JsonLiteral<'a> {
    pub(crate) fn validated(json: &'a str) -> Self {
        JsonLiteral(json)
    }

    /// `json`, a JSON value a decoder of this crate validated, as a string
    /// literal, or `None` when it is another kind of value. Only the quotes
    /// are looked at: the escapes were checked with the value.
    pub(crate) fn string(json: &'a str) -> Option<Self> {
        (json.len() >= 2 && json.starts_with('"') && json.ends_with('"'))
            .then_some(JsonLiteral(json))
    }

    /// The literal as it is in the frame.
    pub fn as_str(&self) -> &'a str {
        self.0
    }
}

impl<'a> ChunkText<'a> {
    /// The text, unescaped.
    pub fn get(&self) -> Cow<'_, str> {
        match self {
            ChunkText::Decoded(text) => Cow::Borrowed(text),
            // Validated, so it decodes; the literal itself otherwise, rather
            // than nothing.
            ChunkText::Json(json) => {
                crate::providers::decode_string(json.0).unwrap_or(Cow::Borrowed(json.0))
            }
        }
    }

    /// Appends the text, unescaped, to `out`: [`get`](Self::get) into a
    /// string the caller keeps, without allocating one of its own.
    pub fn push_to(&self, out: &mut String) {
        match self {
            ChunkText::Decoded(text) => out.push_str(text),
            ChunkText::Json(json) => {
                let start = out.len();
                if crate::providers::decode_string_into(json.0, out).is_none() {
                    // As `get`: the literal itself, rather than a part.
                    out.truncate(start);
                    out.push_str(json.0);
                }
            }
        }
    }

    /// Appends the text, unescaped, to `out`, as one fragment of a longer
    /// text: a surrogate pair cut between this fragment and the one before
    /// (`carry`, which this one updates) is joined; see
    /// `providers::decode_fragment_into`.
    pub fn push_joined(&self, out: &mut String, carry: &mut Option<u16>) {
        match self {
            // Nothing between the halves of a pair: the carry waits on.
            ChunkText::Decoded(text) if text.is_empty() => {}
            ChunkText::Decoded(text) => {
                if carry.take().is_some() {
                    out.push(char::REPLACEMENT_CHARACTER);
                }
                out.push_str(text);
            }
            ChunkText::Json(json) => {
                let start = out.len();
                if crate::providers::decode_fragment_into(json.0, out, carry).is_none() {
                    out.truncate(start);
                    out.push_str(json.0);
                }
            }
        }
    }

    /// Whether the text is the literal's own bytes (no escape to undo): then
    /// it cannot end with half a surrogate pair either.
    pub fn is_plain(&self) -> bool {
        match self {
            ChunkText::Decoded(_) => true,
            ChunkText::Json(json) => memchr::memchr(b'\\', json.0.as_bytes()).is_none(),
        }
    }

    /// The length of the text in UTF-16 units (JavaScript's
    /// `string.length`), counted without unescaping a JSON literal.
    pub fn utf16_len(&self) -> usize {
        match self {
            ChunkText::Decoded(text) => crate::js::utf16_len(text),
            ChunkText::Json(json) => literal_utf16_len(json.0),
        }
    }

    pub fn is_empty(&self) -> bool {
        match self {
            ChunkText::Decoded(text) => text.is_empty(),
            // Every escape stands for at least one character.
            ChunkText::Json(json) => json.0.len() <= 2,
        }
    }
}

/// The UTF-16 length of the text a validated JSON string literal (quotes
/// included) stands for, read off the literal: an escape is one unit, as
/// `\uXXXX` is one unit (the two escapes of a surrogate pair are two, and a
/// lone surrogate decodes to U+FFFD, one unit, as
/// [`decode_string`](crate::providers::decode_string) does); the runs
/// between escapes count as they are.
fn literal_utf16_len(literal: &str) -> usize {
    let inner = literal
        .get(1..literal.len().saturating_sub(1))
        .unwrap_or_default();
    if inner.len() <= SHORT_LITERAL_BYTES {
        short_literal_utf16_len(inner)
    } else {
        long_literal_utf16_len(inner)
    }
}

/// Up to this many bytes, a literal is counted a byte at a time: most
/// argument deltas are a few characters, and a `memchr` call for their
/// escapes cost about as much as counting them (callgrind, tool-heavy
/// capture: 87 instructions a delta fewer this way).
const SHORT_LITERAL_BYTES: usize = 32;

/// [`literal_utf16_len`] of a literal's inside, in one pass: an escape is
/// one unit (`\uXXXX` included: a pair is two escapes), any other byte
/// counts as in [`crate::js::utf16_len`].
fn short_literal_utf16_len(inner: &str) -> usize {
    let bytes = inner.as_bytes();
    let mut units = 0;
    let mut i = 0;
    while let Some(&b) = bytes.get(i) {
        if b == b'\\' {
            units += 1;
            i += if bytes.get(i + 1) == Some(&b'u') {
                6
            } else {
                2
            };
        } else {
            units += usize::from((b & 0xC0) != 0x80) + usize::from(b >= 0xF0);
            i += 1;
        }
    }
    units
}

/// [`literal_utf16_len`] of a literal's inside, from escape to escape.
fn long_literal_utf16_len(inner: &str) -> usize {
    let mut units = 0;
    let mut rest = inner;
    while let Some(at) = memchr::memchr(b'\\', rest.as_bytes()) {
        units += crate::js::utf16_len(rest.get(..at).unwrap_or_default()) + 1;
        let escape_len = if rest.as_bytes().get(at + 1) == Some(&b'u') {
            6
        } else {
            2
        };
        rest = rest.get(at + escape_len..).unwrap_or_default();
    }
    units + crate::js::utf16_len(rest)
}

impl PartialEq for ChunkText<'_> {
    fn eq(&self, other: &Self) -> bool {
        self.get() == other.get()
    }
}

impl std::fmt::Display for ChunkText<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.get())
    }
}

impl<'a> From<Cow<'a, str>> for ChunkText<'a> {
    fn from(text: Cow<'a, str>) -> Self {
        ChunkText::Decoded(text)
    }
}

impl<'a> From<&'a str> for ChunkText<'a> {
    fn from(text: &'a str) -> Self {
        ChunkText::Decoded(Cow::Borrowed(text))
    }
}

/// One `tool_calls[j]` entry as the provider sent it.
#[derive(Debug, Clone, PartialEq)]
pub struct ToolCallDelta<'a> {
    /// `choices[k].index`, 0 when absent or not an integer.
    pub choice: i64,
    /// `tool_calls[j].index` when it is an integer (of any sign: SPEC.md
    /// makes an integer index authoritative).
    pub index: Option<i64>,
    /// A non-empty `id`, if sent.
    pub id: Option<Cow<'a, str>>,
    /// A non-empty `function.name` (or `custom.name`), if sent.
    pub name: Option<Cow<'a, str>>,
    /// `function.arguments` (or `custom.input`).
    pub arguments: ArgumentsDelta<'a>,
    /// The entry came as a custom tool's, `custom: {name, input}` (OpenAI's
    /// freeform tools), rather than as a function's.
    pub custom: bool,
}

/// What a delta does to the accumulated arguments string.
#[derive(Debug, Clone, PartialEq)]
pub enum ArgumentsDelta<'a> {
    /// Absent or `null`: unchanged.
    Unchanged,
    /// A string fragment to append. The fast decoders hand over the JSON
    /// literal as it stands: progress counts its characters without
    /// unescaping it ([`ChunkText::utf16_len`]).
    Append(ChunkText<'a>),
    /// A whole value (a JSON object some providers send, or an Ollama call),
    /// already serialized as `JSON.stringify` would, replacing what was
    /// accumulated.
    Replace(String),
}

/// Token usage, in the seed's camelCase names when serialized.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Usage {
    pub prompt_tokens: u64,
    pub completion_tokens: u64,
    pub total_tokens: u64,
}

impl Usage {
    /// Builds a usage from provider fields, computing a missing total.
    pub fn new(prompt: Option<u64>, completion: Option<u64>, total: Option<u64>) -> Usage {
        let prompt_tokens = prompt.unwrap_or(0);
        let completion_tokens = completion.unwrap_or(0);
        Usage {
            prompt_tokens,
            completion_tokens,
            total_tokens: total.unwrap_or(prompt_tokens.saturating_add(completion_tokens)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A text left as JSON reads as the decoded one, and equals it.
    #[test]
    fn json_text_is_unescaped_when_read() {
        let json = |literal| ChunkText::Json(JsonLiteral::validated(literal));
        let text = json(r#""a\"b\n\u00e9\ud83d""#);
        assert_eq!(text.get(), "a\"b\né\u{fffd}");
        assert_eq!(text.to_string(), "a\"b\né\u{fffd}");
        assert_eq!(text, ChunkText::from("a\"b\né\u{fffd}"));
        assert_ne!(text, ChunkText::from(r#"a\"b\n\u00e9\ud83d"#));
        assert_eq!(json(r#""\u0061""#), json(r#""a""#));
        assert!(matches!(json(r#""plain""#).get(), Cow::Borrowed("plain")));
        // Empty only when the literal is: any escape is a character.
        assert!(json(r#""""#).is_empty());
        for literal in [r#""\u0000""#, r#""\ud83d""#, r#""\n""#] {
            assert!(!json(literal).is_empty(), "{literal}");
            assert!(!json(literal).get().is_empty(), "{literal}");
        }
    }

    /// A literal's length, read off the literal, is the decoded text's,
    /// over every sequence of up to three pieces: plain characters of one
    /// to four UTF-8 bytes, each short escape, `\u` escapes of ASCII, of a
    /// wider character, of a surrogate pair, and lone surrogates.
    #[test]
    fn a_literal_counts_as_its_decoded_text_does() {
        const PIECES: [&str; 16] = [
            "a",
            "é",
            "東",
            "😀",
            r#"\""#,
            r"\\",
            r"\/",
            r"\b",
            r"\f",
            r"\n",
            r"\r",
            r"\t",
            r"\u0041",
            r"\u6771",
            r"\ud83d\ude00",
            r"\ud83d",
        ];
        let mut literals = vec![String::new()];
        for _ in 0..3 {
            let longer: Vec<String> = literals
                .iter()
                .flat_map(|l| PIECES.iter().map(move |p| format!("{l}{p}")))
                .collect();
            literals.extend(longer);
        }
        literals.sort();
        literals.dedup();
        assert_eq!(literals.len(), 1 + 16 + 256 + 4096);
        for inner in &literals {
            let literal = format!("\"{inner}\"");
            let text = ChunkText::Json(JsonLiteral::validated(&literal));
            let decoded = crate::providers::decode_string(&literal).expect("valid literal");
            assert_eq!(
                text.utf16_len(),
                decoded.encode_utf16().count(),
                "{literal}"
            );
            assert_eq!(
                ChunkText::from(decoded.as_ref()).utf16_len(),
                text.utf16_len()
            );
            // Both ways of counting, whatever the length.
            assert_eq!(
                short_literal_utf16_len(inner),
                long_literal_utf16_len(inner),
                "{literal}"
            );
            // Appended to what a string already holds, the same text.
            let mut appended = String::from("kept");
            text.push_to(&mut appended);
            assert_eq!(
                appended.strip_prefix("kept"),
                Some(decoded.as_ref()),
                "{literal}"
            );
        }
        // A lone low surrogate too, and one at the end after a high one's
        // pair.
        for literal in [r#""\ude00""#, r#""\ud83d\ude00\ude00""#] {
            let decoded = crate::providers::decode_string(literal).expect("valid literal");
            let text = ChunkText::Json(JsonLiteral::validated(literal));
            assert_eq!(
                text.utf16_len(),
                decoded.encode_utf16().count(),
                "{literal}"
            );
            let mut appended = String::new();
            text.push_to(&mut appended);
            assert_eq!(appended, decoded, "{literal}");
        }
        // A literal that does not decode (only a bug could make one) reads
        // as itself, with nothing of a partial decoding left before it.
        for literal in [r#""ab\x""#, r#""ab\u12""#, r#""é\n\q""#] {
            let text = ChunkText::Json(JsonLiteral::validated(literal));
            assert_eq!(text.get(), literal);
            let mut appended = String::from("kept");
            text.push_to(&mut appended);
            assert_eq!(appended, format!("kept{literal}"));
        }
    }
}
