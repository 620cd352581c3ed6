//! A validating JSON cursor for the decoders' fast path.
//!
//! A chunk is a few hundred bytes of which progress needs a few dozen. The
//! cursor walks a frame's bytes once, checks every byte against JSON's
//! grammar (RFC 8259, as `serde_json` does: strings without raw control
//! characters, escapes of the allowed forms, numbers of the grammar's shape,
//! only whitespace after the value) and hands the decoder the raw text of
//! the values it asks for, skipping the rest without building anything.
//!
//! The cursor is stricter than the grammar in a few corners it leaves to
//! the serde path: a key with an escape, a key seen twice, a value of an
//! unexpected type, nesting deeper than [`MAX_DEPTH`]. Each of those is a
//! [`Bail`], and the decoder then parses the frame again with `serde_json`,
//! which gives the answer (or the error message) it always gave. So the
//! fast path changes speed, never results: where it answers, the serde path
//! answers the same (the unit tests of [`providers`](super) compare the
//! two on every fixture frame, its truncations and its mutations).

use std::borrow::Cow;

use memchr::memchr;

use super::decode_string;
use crate::chunk::{ChunkText, JsonLiteral};

/// The fast path gives up; the caller decodes the frame with serde.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Bail;

/// Nesting the cursor follows before it gives up (serde's limit is 128).
pub(crate) const MAX_DEPTH: u32 = 64;

/// The byte range of a raw JSON value in the frame.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) struct Span {
    pub start: usize,
    pub end: usize,
}

impl Span {
    pub fn of(self, data: &str) -> &str {
        data.get(self.start..self.end).unwrap_or("")
    }
}

/// A position in a frame's bytes.
pub(crate) struct Cursor<'a> {
    bytes: &'a [u8],
    pos: usize,
    depth: u32,
    /// The spans of the string and number values walked so far (not keys):
    /// the holes of a [`Template`].
    holes: Vec<Span>,
}

const LO: u64 = 0x0101_0101_0101_0101;
const HI: u64 = 0x8080_8080_8080_8080;

/// Bytes of `v` that are `"`, `\` or below 0x20 have their high bit set in
/// the result, and the lowest set one is exact (higher ones may be false
/// alarms from borrows, which the caller checks byte by byte anyway).
///
/// Two tests, not three: `"` (0x22) xor 0x02 is 0x20, and xor 0x02 keeps
/// the control characters below 0x20 (and every other byte at 0x21 or
/// above), so one "below 0x21" finds both; the other finds `\`. A byte
/// with its high bit set (UTF-8) is neither.
#[inline]
fn string_stops(v: u64) -> u64 {
    let below = (v ^ (LO * 0x02)).wrapping_sub(LO * 0x21);
    let backslash = (v ^ (LO * u64::from(b'\\'))).wrapping_sub(LO);
    (below | backslash) & !v & HI
}

/// From `i`, skips eight bytes at a time while none is `"`, `\` or a
/// control character: the first such byte (exactly), or the start of the
/// last seven bytes or fewer, which the caller reads one by one.
#[inline(always)]
fn skip_plain(b: &[u8], mut i: usize) -> usize {
    while let Some(word) = b.get(i..i + 8) {
        let mut buf = [0u8; 8];
        buf.copy_from_slice(word);
        let stops = string_stops(u64::from_le_bytes(buf));
        if stops != 0 {
            return i + (stops.trailing_zeros() / 8) as usize;
        }
        i += 8;
    }
    i
}

/// The end of the run of ASCII digits that starts at `i`.
#[inline]
fn digits(b: &[u8], mut i: usize) -> usize {
    while b.get(i).is_some_and(u8::is_ascii_digit) {
        i += 1;
    }
    i
}

/// Where a walk through an object or array is.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Walk {
    first: bool,
}

impl<'a> Cursor<'a> {
    /// A cursor at the start of `data`, noting value spans in `holes`
    /// (cleared; a buffer to reuse, given back by [`Cursor::into_holes`]).
    pub fn new(data: &'a str, mut holes: Vec<Span>) -> Self {
        holes.clear();
        Cursor {
            bytes: data.as_bytes(),
            pos: 0,
            depth: 0,
            holes,
        }
    }

    pub fn into_holes(self) -> Vec<Span> {
        self.holes
    }

    #[inline]
    fn skip_ws(&mut self) {
        while let Some(&b) = self.bytes.get(self.pos) {
            if matches!(b, b' ' | b'\n' | b'\r' | b'\t') {
                self.pos += 1;
            } else {
                break;
            }
        }
    }

    /// The next byte that is not whitespace, not consumed.
    #[inline]
    pub fn peek(&mut self) -> Option<u8> {
        if let Some(&b) = self.bytes.get(self.pos)
            && b > b' '
        {
            return Some(b);
        }
        self.skip_ws();
        self.bytes.get(self.pos).copied()
    }

    /// Only whitespace may follow the top-level value.
    pub fn end(&mut self) -> Result<(), Bail> {
        if self.peek().is_none() {
            Ok(())
        } else {
            Err(Bail)
        }
    }

    /// Enters an object at the cursor: then call [`Cursor::key`] until it
    /// says `None`, consuming each value in between.
    #[inline]
    pub fn object(&mut self) -> Result<Walk, Bail> {
        self.open(b'{')
    }

    /// The next key of the object (its raw text without quotes; keys with
    /// escapes bail) with the cursor on its value, or `None` at the end.
    #[inline]
    pub fn key(&mut self, walk: &mut Walk) -> Result<Option<&'a [u8]>, Bail> {
        match self.peek() {
            Some(b'}') => {
                self.pos += 1;
                self.depth -= 1;
                return Ok(None);
            }
            Some(b',') if !walk.first => self.pos += 1,
            Some(b'"') if walk.first => {}
            _ => return Err(Bail),
        }
        walk.first = false;
        if self.peek() != Some(b'"') {
            return Err(Bail);
        }
        let (key, escaped) = self.string_inner()?;
        if escaped {
            return Err(Bail);
        }
        if self.peek() != Some(b':') {
            return Err(Bail);
        }
        self.pos += 1;
        self.bytes
            .get(key.start + 1..key.end - 1)
            .map(Some)
            .ok_or(Bail)
    }

    /// Enters an array at the cursor: then call [`Cursor::element`] until
    /// it says false, consuming each element in between.
    #[inline]
    pub fn array(&mut self) -> Result<Walk, Bail> {
        self.open(b'[')
    }

    /// Steps into the object or array that `bracket` opens.
    #[inline]
    fn open(&mut self, bracket: u8) -> Result<Walk, Bail> {
        if self.peek() != Some(bracket) {
            return Err(Bail);
        }
        self.pos += 1;
        self.depth += 1;
        if self.depth > MAX_DEPTH {
            return Err(Bail);
        }
        Ok(Walk { first: true })
    }

    /// Whether another element follows, with the cursor on it.
    #[inline]
    pub fn element(&mut self, walk: &mut Walk) -> Result<bool, Bail> {
        match self.peek() {
            Some(b']') => {
                self.pos += 1;
                self.depth -= 1;
                Ok(false)
            }
            Some(b',') if !walk.first => {
                self.pos += 1;
                Ok(true)
            }
            Some(_) if walk.first => {
                walk.first = false;
                Ok(true)
            }
            _ => Err(Bail),
        }
    }

    /// Any value, validated; its span.
    pub fn value(&mut self) -> Result<Span, Bail> {
        let Some(first) = self.peek() else {
            return Err(Bail);
        };
        let start = self.pos;
        match first {
            b'"' => return self.string(),
            b'{' => {
                let mut walk = self.object()?;
                while self.key(&mut walk)?.is_some() {
                    self.value()?;
                }
            }
            b'[' => {
                let mut walk = self.array()?;
                while self.element(&mut walk)? {
                    self.value()?;
                }
            }
            b't' => self.literal(b"true")?,
            b'f' => self.literal(b"false")?,
            b'n' => self.literal(b"null")?,
            b'-' | b'0'..=b'9' => return self.number_hole(),
            _ => return Err(Bail),
        }
        Ok(Span {
            start,
            end: self.pos,
        })
    }

    /// A value that is `null` (`None`) or anything else (its span): what
    /// serde gives an `Option<&RawValue>` field.
    #[inline]
    pub fn optional(&mut self) -> Result<Option<Span>, Bail> {
        if self.null()? {
            return Ok(None);
        }
        self.value().map(Some)
    }

    /// `null` or a string (its span, quotes included); anything else bails.
    #[inline]
    pub fn optional_string(&mut self) -> Result<Option<Span>, Bail> {
        match self.peek() {
            Some(b'"') => self.string().map(Some),
            Some(b'n') => self.literal(b"null").map(|()| None),
            _ => Err(Bail),
        }
    }

    /// Whether the next value is `null`, consuming it if so.
    #[inline]
    pub fn null(&mut self) -> Result<bool, Bail> {
        if self.peek() == Some(b'n') {
            self.literal(b"null")?;
            Ok(true)
        } else {
            Ok(false)
        }
    }

    #[inline]
    fn literal(&mut self, word: &[u8]) -> Result<(), Bail> {
        if self.bytes.get(self.pos..self.pos + word.len()) == Some(word) {
            self.pos += word.len();
            Ok(())
        } else {
            Err(Bail)
        }
    }

    /// A number at the cursor (no whitespace before it), noted as a hole;
    /// its span.
    fn number_hole(&mut self) -> Result<Span, Bail> {
        let start = self.pos;
        self.number()?;
        let span = Span {
            start,
            end: self.pos,
        };
        self.holes.push(span);
        Ok(span)
    }

    /// A number at the cursor (no whitespace before it).
    #[inline]
    fn number(&mut self) -> Result<(), Bail> {
        self.pos = number_end(self.bytes, self.pos)?;
        Ok(())
    }

    /// A string at the cursor, validated; its span, quotes included.
    #[inline]
    pub fn string(&mut self) -> Result<Span, Bail> {
        let (span, _) = self.string_inner()?;
        self.holes.push(span);
        Ok(span)
    }

    /// A string's span, and whether it has escapes.
    #[inline(always)]
    fn string_inner(&mut self) -> Result<(Span, bool), Bail> {
        let b = self.bytes;
        let start = self.pos;
        if b.get(start) != Some(&b'"') {
            return Err(Bail);
        }
        let (end, escaped) = string_end(b, start + 1)?;
        self.pos = end;
        Ok((Span { start, end }, escaped))
    }
}

/// Where a number that starts at `i` ends:
/// `-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?`
fn number_end(b: &[u8], mut i: usize) -> Result<usize, Bail> {
    if b.get(i) == Some(&b'-') {
        i += 1;
    }
    match b.get(i) {
        Some(b'0') => i += 1,
        Some(b'1'..=b'9') => i = digits(b, i),
        _ => return Err(Bail),
    }
    if b.get(i) == Some(&b'.') {
        let end = digits(b, i + 1);
        if end == i + 1 {
            return Err(Bail);
        }
        i = end;
    }
    if matches!(b.get(i), Some(b'e' | b'E')) {
        i += 1;
        if matches!(b.get(i), Some(b'+' | b'-')) {
            i += 1;
        }
        let end = digits(b, i);
        if end == i {
            return Err(Bail);
        }
        i = end;
    }
    Ok(i)
}

/// Where a string ends (past its closing quote), scanned from `i`, and
/// whether it has escapes: its bytes between its opening quote and `i` are
/// known to be plain text (no quote, escape or control character).
#[inline(always)]
fn string_end(b: &[u8], i: usize) -> Result<(usize, bool), Bail> {
    // In chunks, strings are short and mostly without escapes: the first
    // stop is usually the closing quote.
    let i = skip_plain(b, i);
    if b.get(i) == Some(&b'"') {
        return Ok((i + 1, false));
    }
    string_rest(b, i)
}

/// The rest of a string from `i`: escapes, control characters, the last
/// bytes of the frame. Where it ends (past its closing quote), and whether
/// it has escapes.
#[inline(never)]
fn string_rest(b: &[u8], mut i: usize) -> Result<(usize, bool), Bail> {
    let mut escaped = false;
    loop {
        i = skip_plain(b, i);
        match b.get(i) {
            Some(b'"') => return Ok((i + 1, escaped)),
            Some(b'\\') => {
                escaped = true;
                i += 1;
                match b.get(i) {
                    Some(b'"' | b'\\' | b'/' | b'b' | b'f' | b'n' | b'r' | b't') => i += 1,
                    Some(b'u') => {
                        let hex = b.get(i + 1..i + 5).ok_or(Bail)?;
                        if !hex.iter().all(u8::is_ascii_hexdigit) {
                            return Err(Bail);
                        }
                        i += 5;
                    }
                    _ => return Err(Bail),
                }
            }
            Some(0..=0x1f) | None => return Err(Bail),
            Some(_) => i += 1,
        }
    }
}

/// The shape of the last valid frame of a stream, to check the next one
/// against in one pass.
///
/// Chunks of one stream differ mostly in their string and number values:
/// same keys, same order, same punctuation. The template keeps the last
/// valid frame's bytes and the spans of its string and number values (its
/// holes). A frame that has the same bytes outside the holes and a valid
/// string (or number) in each hole has the same structure as that valid
/// frame, so it is valid too, and every value the decoder wants sits in the
/// hole of the same rank. Any other frame is walked in full (and teaches
/// the template).
#[derive(Debug, Default)]
pub(crate) struct Template {
    bytes: Vec<u8>,
    holes: Vec<Hole>,
    ready: bool,
    /// The learned frame holds no line break (CR or LF): a frame that
    /// matches it holds none either (a hole cannot: a string with a raw
    /// control character, or a number, does not lex), so its match also
    /// finds where its line ends ([`Template::match_prefix`]).
    one_line: bool,
}

/// A hole of the learned frame.
#[derive(Debug, Clone, Copy)]
struct Hole {
    span: Span,
    /// A string (else a number).
    string: bool,
    /// An equal run that reaches this far holds the whole value: the end
    /// of a string (its closing quote ends it), one past the end of a
    /// number (which may go on in the input: `12` where the template had
    /// `1`). Derived from `span` and `string`, and kept: computed in the
    /// match's loop instead, it cost 1.1 % more instructions per line.
    kept_at: usize,
    /// For a string, where its plain text ends: its first escape, or its
    /// closing quote. A new value that shares the bytes up to there is
    /// scanned from where it differs, not from its opening quote (the
    /// shared bytes are plain text in both). For a number, its start.
    plain_end: usize,
}

/// How many leading bytes `a` and `b` share, sixteen at a time.
fn common_prefix(a: &[u8], b: &[u8]) -> usize {
    let n = a.len().min(b.len());
    let (a, b) = (&a[..n], &b[..n]);
    let mut same = 0;
    for (x, y) in a.chunks_exact(16).zip(b.chunks_exact(16)) {
        let (Ok(x), Ok(y)) = (<[u8; 16]>::try_from(x), <[u8; 16]>::try_from(y)) else {
            break;
        };
        let diff = u128::from_le_bytes(x) ^ u128::from_le_bytes(y);
        if diff != 0 {
            return same + (diff.trailing_zeros() / 8) as usize;
        }
        same += 16;
    }
    same + a[same..]
        .iter()
        .zip(&b[same..])
        .take_while(|(x, y)| x == y)
        .count()
}

/// `a == b`, without a `memcmp` call for the usual 8 to 16 bytes (the tail
/// after a template's last hole, `}},"done":false}` and the like): two
/// overlapping words.
#[inline(always)]
fn short_eq(a: &[u8], b: &[u8]) -> bool {
    fn word(s: &[u8], at: usize) -> Option<u64> {
        Some(u64::from_le_bytes(s.get(at..at + 8)?.try_into().ok()?))
    }
    let n = a.len();
    if n != b.len() {
        return false;
    }
    if (8..=16).contains(&n) {
        return word(a, 0) == word(b, 0) && word(a, n - 8) == word(b, n - 8);
    }
    a == b
}

impl Template {
    /// Whether `data` has this shape; if so, `out` holds its holes, one
    /// per rank (if not, what `out` holds means nothing: a walk clears it).
    pub fn matches(&self, data: &str, out: &mut Vec<Span>) -> bool {
        if !self.ready {
            return false;
        }
        // One slot per hole, written by rank: the buffer keeps its length
        // from one matched frame to the next, so this is a comparison.
        out.resize(self.holes.len(), Span { start: 0, end: 0 });
        self.fill(data.as_bytes(), out, false) == Some(data.len())
    }

    /// Whether `input` starts with a frame of this shape; if so, that
    /// frame's length (and `out` holds its holes, as [`matches`] on the
    /// frame alone would). The framer asks this of the bytes at a line's
    /// start before it searches for the line's end: a frame that matches,
    /// followed by a line break, is the line.
    ///
    /// The same as `matches` on `input[..len]` whenever `input[len]` is a
    /// line break, which the caller checks: the learned frame holds none
    /// (else this is `None`), so a comparison that runs past `len` stops
    /// at that byte, as it stops at the end of the frame alone; and a
    /// string or number scanned up to it ends (or fails) there as it does
    /// at the end.
    ///
    /// [`matches`]: Self::matches
    pub fn match_prefix(&self, input: &str, out: &mut Vec<Span>) -> Option<usize> {
        if !self.ready || !self.one_line {
            return None;
        }
        out.resize(self.holes.len(), Span { start: 0, end: 0 });
        self.fill(input.as_bytes(), out, true)
    }

    /// One pass that compares the frame with the template a word at a
    /// time, and scans only the holes where they differ. Holes inside an
    /// equal run kept their value (an id, a model name, `created`, most
    /// indexes): the same bytes lex the same. A difference inside a hole
    /// means a new value there: a number is scanned from its start, a
    /// string from the difference (or from its first escape, if that comes
    /// first); its length may differ, which shifts everything after it. A
    /// difference anywhere else is another shape.
    ///
    /// Where the frame ends, if it matched: at `input`'s end, unless
    /// `prefix` lets `input` go on after it.
    fn fill(&self, input: &[u8], out: &mut [Span], prefix: bool) -> Option<usize> {
        let template = self.bytes.as_slice();
        let holes = self.holes.as_slice();
        let out = out.get_mut(..holes.len())?;
        // The position of the next byte to match, in the template and in
        // the input, and the rank of the next hole.
        let mut from = 0;
        let mut pos = 0;
        let mut k = 0;
        while k < holes.len() {
            let (Some(rest_in), Some(rest)) = (input.get(pos..), template.get(from..)) else {
                return None;
            };
            let differs_at = from + common_prefix(rest_in, rest);
            // Holes wholly in the equal run sit at the same distance from
            // `from` in the input: a shift (wrapping, as it may be negative;
            // the shifted positions are not).
            let shift = pos.wrapping_sub(from);
            while let (Some(hole), Some(slot)) = (holes.get(k), out.get_mut(k))
                && hole.kept_at <= differs_at
            {
                *slot = Span {
                    start: hole.span.start.wrapping_add(shift),
                    end: hole.span.end.wrapping_add(shift),
                };
                k += 1;
            }
            let (Some(hole), Some(slot)) = (holes.get(k), out.get_mut(k)) else {
                // The difference (or the end) lies after the last hole.
                pos += differs_at - from;
                from = differs_at;
                break;
            };
            if differs_at < hole.span.start {
                return None; // a literal differs: another shape
            }
            let start = pos + (hole.span.start - from);
            // A string where a string was, a number where a number was.
            let end = if !hole.string {
                number_end(input, start)
            } else if differs_at > hole.span.start {
                string_end(input, pos + (differs_at.min(hole.plain_end) - from)).map(|(end, _)| end)
            } else if input.get(start) == Some(&b'"') {
                string_end(input, start + 1).map(|(end, _)| end)
            } else {
                Err(Bail)
            };
            let Ok(end) = end else {
                return None;
            };
            *slot = Span { start, end };
            pos = end;
            from = hole.span.end;
            k += 1;
        }
        let rest = template.get(from..)?;
        let end = pos + rest.len();
        let rest_in = if prefix {
            input.get(pos..end)?
        } else {
            input.get(pos..)?
        };
        short_eq(rest_in, rest).then_some(end)
    }

    /// Takes a valid frame's shape.
    pub fn learn(&mut self, data: &str, holes: &[Span]) {
        self.bytes.clear();
        self.bytes.extend_from_slice(data.as_bytes());
        self.holes.clear();
        let bytes = data.as_bytes();
        self.holes.extend(holes.iter().map(|&span| {
            let string = bytes.get(span.start) == Some(&b'"');
            let plain_end = if string {
                // Holes are valid strings: between their quotes, the first
                // stop is a backslash or nothing.
                let inner = bytes.get(span.start + 1..span.end - 1).unwrap_or_default();
                span.start + 1 + memchr(b'\\', inner).unwrap_or(inner.len())
            } else {
                span.start
            };
            Hole {
                span,
                string,
                kept_at: if string { span.end } else { span.end + 1 },
                plain_end,
            }
        }));
        self.one_line = memchr::memchr2(b'\n', b'\r', bytes).is_none();
        self.ready = true;
    }

    /// Forgets the shape (a frame whose values are not all holes).
    pub fn forget(&mut self) {
        self.ready = false;
    }

    /// Whether a shape was learned (and not forgotten).
    pub fn is_ready(&self) -> bool {
        self.ready
    }

    /// The learned frame's length in bytes.
    pub fn learned_bytes(&self) -> usize {
        self.bytes.len()
    }

    /// Becomes a copy of `other`, in the buffers this one already has.
    pub fn copy_from(&mut self, other: &Template) {
        // Every field named, so that a new one is not forgotten here.
        let Template {
            bytes,
            holes,
            ready,
            one_line,
        } = other;
        self.bytes.clone_from(bytes);
        self.holes.clone_from(holes);
        self.ready = *ready;
        self.one_line = *one_line;
    }

    /// A span of the learned frame as the rank of its hole (kept as
    /// `start..start + 1`); a span that is not a hole gives up.
    pub fn to_rank(&self, span: Option<Span>) -> Result<Option<Span>, Bail> {
        let Some(span) = span else {
            return Ok(None);
        };
        let k = self
            .holes
            .binary_search_by_key(&span.start, |h| h.span.start)
            .map_err(|_| Bail)?;
        if self.holes.get(k).is_some_and(|h| h.span.end == span.end) {
            Ok(Some(Span {
                start: k,
                end: k + 1,
            }))
        } else {
            Err(Bail)
        }
    }
}

/// A hole rank (from [`Template::to_rank`]) as the span of that hole in a
/// matched frame.
#[inline]
pub(crate) fn from_rank(holes: &[Span], rank: Option<Span>) -> Result<Option<Span>, Bail> {
    match rank {
        None => Ok(None),
        Some(rank) => holes.get(rank.start).copied().map(Some).ok_or(Bail),
    }
}

/// Whether the string at a hole rank of a matched frame has text, as
/// [`json_text`] reads it: its span holds its quotes, and `""` is no
/// value.
#[inline]
pub(crate) fn has_text(holes: &[Span], rank: Option<Span>) -> Result<bool, Bail> {
    from_rank(holes, rank).map(|span| span.is_some_and(|s| s.end - s.start > 2))
}

/// A function from span to span that may give up: to a hole rank and back.
pub(crate) type SpanMap<'f> = dyn FnMut(Option<Span>) -> Result<Option<Span>, Bail> + 'f;

/// The text of a string span, if not empty (SPEC.md: `""` is no value).
pub(crate) fn text(data: &str, span: Option<Span>) -> Option<Cow<'_, str>> {
    span.and_then(|s| decode_string(s.of(data)))
        .filter(|t| !t.is_empty())
}

/// The text of a string span the cursor validated, if not empty, left
/// escaped until it is read ([`ChunkText::get`]).
pub(crate) fn json_text(data: &str, span: Option<Span>) -> Option<ChunkText<'_>> {
    span.map(|s| s.of(data))
        .filter(|json| json.len() > 2)
        .map(|json| ChunkText::Json(JsonLiteral::validated(json)))
}

/// Marks a struct's known field as seen; a second one bails, as serde's
/// derive rejects a duplicate field.
#[inline]
pub(crate) fn first_time(seen: &mut u32, bit: u32) -> Result<(), Bail> {
    if *seen & bit != 0 {
        return Err(Bail);
    }
    *seen |= bit;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn valid(json: &str) -> bool {
        let mut c = Cursor::new(json, Vec::new());
        c.value().is_ok() && c.end().is_ok()
    }

    #[test]
    fn accepts_exactly_what_serde_json_accepts() {
        let cases = [
            "0",
            "-0",
            "1.5e+3",
            "-12.25E-2",
            "01",
            "1.",
            ".5",
            "1e",
            "-",
            "+1",
            "true",
            "tru",
            "nul",
            "null ",
            " \t\r\n{} ",
            "{\"a\":1,}",
            "[1,]",
            "[1 2]",
            "{\"a\" 1}",
            "{1:2}",
            "\"a\\u00e9\\ud83d\"",
            "\"\\x\"",
            "\"\\u12g4\"",
            "\"tab\there\"",
            "\"a\u{7f}\"",
            "\"unterminated",
            "\"esc at end\\",
            "[\"a\",{\"b\":[null,false,{}]}]",
            "{\"a\":1} x",
            "{\"a\":\"12345678901234567890\\\"\",\"b\":\"1234567\\\\\"}",
            "",
            " ",
            "[] []",
        ];
        for json in cases {
            let serde = serde_json::from_str::<serde::de::IgnoredAny>(json).is_ok();
            assert_eq!(valid(json), serde, "{json:?}");
        }
    }

    #[test]
    fn control_characters_in_strings_are_found_at_every_offset() {
        for len in 0..20 {
            for at in 0..len {
                let mut s = "x".repeat(len);
                s.replace_range(at..at + 1, "\u{1}");
                assert!(!valid(&format!("\"{s}\"")), "{len} {at}");
                s.replace_range(at..at + 1, "\"");
                assert!(!valid(&format!("\"{s}\"")), "{len} {at}");
                s.replace_range(at..at + 1, "é");
                assert!(valid(&format!("\"{s}\"")), "{len} {at}");
            }
        }
    }

    #[test]
    fn spans_are_raw_text() {
        let data = r#" {"a" : [1, "x\"y"] , "b":null}"#;
        let mut c = Cursor::new(data, Vec::new());
        let mut seen = Vec::new();
        let mut walk = c.object().expect("object");
        while let Some(key) = c.key(&mut walk).expect("valid") {
            let span = c.optional().expect("valid");
            seen.push((
                String::from_utf8_lossy(key).into_owned(),
                span.map(|s| s.of(data).to_owned()),
            ));
        }
        assert_eq!(
            seen,
            vec![
                ("a".to_owned(), Some(r#"[1, "x\"y"]"#.to_owned())),
                ("b".to_owned(), None)
            ]
        );
    }

    #[test]
    fn string_stops_finds_the_first_stop_of_any_two_bytes() {
        let stop = |b: u8| b == b'"' || b == b'\\' || b < 0x20;
        for first in 0..8 {
            for second in first + 1..8 {
                for x in 0..=255u8 {
                    for y in 0..=255u8 {
                        let mut word = [b'a'; 8];
                        word[first] = x;
                        word[second] = y;
                        let expected = word.iter().position(|&b| stop(b));
                        let stops = string_stops(u64::from_le_bytes(word));
                        let found = (stops != 0).then(|| (stops.trailing_zeros() / 8) as usize);
                        assert_eq!(found, expected, "{word:?}");
                    }
                }
            }
        }
    }

    #[test]
    fn short_eq_is_slice_equality_at_every_length_and_offset() {
        let a: Vec<u8> = (0..40u8).collect();
        for len in 0..a.len() {
            assert!(short_eq(&a[..len], &a[..len]));
            assert!(!short_eq(&a[..len], &a[..len + 1]));
            for differ in 0..len {
                let mut b = a[..len].to_vec();
                b[differ] ^= 0x01;
                assert!(!short_eq(&a[..len], &b), "len {len}, differ {differ}");
                assert!(!short_eq(&b, &a[..len]), "len {len}, differ {differ}");
            }
        }
    }

    #[test]
    fn common_prefix_is_the_bytewise_one_at_every_length_and_offset() {
        let a: Vec<u8> = (0..100u8).collect();
        for len in 0..a.len() {
            for differ in 0..=len {
                let mut b = a[..len].to_vec();
                if let Some(byte) = b.get_mut(differ) {
                    *byte ^= 0x40;
                }
                let naive = a.iter().zip(&b).take_while(|(x, y)| x == y).count();
                assert_eq!(common_prefix(&a, &b), naive, "len {len}, differ {differ}");
                assert_eq!(common_prefix(&b, &a), naive, "len {len}, differ {differ}");
            }
        }
    }

    #[test]
    fn a_matched_frame_has_the_holes_a_full_walk_finds() {
        fn walk(json: &str) -> Option<Vec<Span>> {
            let mut c = Cursor::new(json, Vec::new());
            (c.value().is_ok() && c.end().is_ok()).then(|| c.into_holes())
        }
        // Raw string contents, some invalid, sharing prefixes with each
        // other up to and into escapes.
        let strings = [
            "",
            "p",
            "plain text",
            "plain texts",
            "plain\\\"",
            "pl\\\"ain text",
            "x\\\"y\\nz",
            "x\\\"y\\tz",
            "x\\\"y",
            "x\\",
            "\\u00e9 and more",
            "\\u00",
            "é",
            "tab\there",
            "line\nbreak",
            "12345678901234567",
            "1234567\\\"",
        ];
        let numbers = ["1", "12", "1.5", "01"];
        let mut frames = Vec::new();
        for a in strings {
            for n in numbers {
                for c in strings {
                    frames.push(format!(r#"{{"a":"{a}","b":{n},"c":["{c}",0]}}"#));
                }
            }
        }
        let mut out = Vec::new();
        for learned in &frames {
            let Some(holes) = walk(learned) else {
                continue;
            };
            let mut template = Template::default();
            template.learn(learned, &holes);
            for frame in &frames {
                let walked = walk(frame);
                let matched = template.matches(frame, &mut out);
                assert_eq!(matched, walked.is_some(), "{learned} then {frame}");
                if matched {
                    assert_eq!(Some(&out), walked.as_ref(), "{learned} then {frame}");
                }
                // The same frame at the start of a line, with what may come
                // after it: found, with the same holes, exactly when it
                // matches alone; and anything found ends at a line break.
                for after in ["\n", "\r\n", "1}\n", "\"\n"] {
                    let input = format!("{frame}{after}");
                    let found = template.match_prefix(&input, &mut out);
                    if found.is_some_and(|len| matches!(input.as_bytes()[len], b'\n' | b'\r')) {
                        assert_eq!(found, Some(frame.len()), "{learned} then {input:?}");
                        assert_eq!(Some(&out), walked.as_ref(), "{learned} then {input:?}");
                    } else {
                        assert!(
                            !matched || !after.starts_with(['\n', '\r']),
                            "{learned} then {input:?}"
                        );
                    }
                }
            }
        }
    }

    /// A template learned from a frame that spans lines (SSE `data` lines
    /// join with LF, which JSON takes as whitespace) cannot say where a
    /// line ends: it never recognizes a prefix, though it still matches.
    #[test]
    fn a_template_with_a_line_break_recognizes_no_prefix() {
        let learned = "{\"a\":\n\"x\"}";
        let mut c = Cursor::new(learned, Vec::new());
        assert!(c.value().is_ok() && c.end().is_ok());
        let holes = c.into_holes();
        let mut template = Template::default();
        template.learn(learned, &holes);
        let mut out = Vec::new();
        assert!(template.matches("{\"a\":\n\"yz\"}", &mut out));
        assert_eq!(
            template.match_prefix("{\"a\":\n\"yz\"}\n\n", &mut out),
            None
        );

        let one_line = "{\"a\":\"x\"}";
        template.learn(one_line, &[Span { start: 5, end: 8 }]);
        assert_eq!(
            template.match_prefix("{\"a\":\"yz\"}\n\n", &mut out),
            Some(10)
        );
        assert_eq!(out, [Span { start: 5, end: 9 }]);
    }

    #[test]
    fn deep_nesting_bails_instead_of_recursing() {
        let deep = "[".repeat(100_000);
        assert_eq!(Cursor::new(&deep, Vec::new()).value(), Err(Bail));
    }
}
