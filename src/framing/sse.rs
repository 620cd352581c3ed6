//! Incremental `text/event-stream` framing (WHATWG HTML, "Server-sent
//! events", section 9.2.6 "Interpreting an event stream").
//!
//! [`SseDecoder`] takes bytes in pieces of any size and hands out
//! [`SseBlock`]s: the exact raw bytes from the end of the previous block up to
//! and including the blank line that ends this one, plus the event they
//! dispatch, if any. Concatenating every block's `raw` gives back the input,
//! byte for byte, which is what lets the annotator forward a stream
//! unchanged while it reads it.
//!
//! What it follows: CR, LF and CRLF all end a line, and a CRLF split across
//! two pieces is one line break; a UTF-8 BOM at the very start is skipped;
//! lines starting with `:` are comments; one space after `field:` is
//! optional; several `data:` lines join with `\n`; a block without `data`
//! dispatches nothing; at end of input an unterminated event is *not*
//! dispatched (it comes back as [`SseBlockKind::Unterminated`] so its bytes
//! are still forwarded).
//!
//! What it does not do: decode UTF-8 (data stays bytes, a character split
//! across pieces whole by the time its line is complete; under
//! [`SseDecoder::feed`] an event also says when its data was checked as
//! text with the rest of its piece), or interpret the data.
//!
//! Read `SseScan::next_block` first.

use std::ops::Range;

use memchr::memchr2;

use super::window::{self, Cutter, Each, Frames, NoProbe, Probe, Window};

const BOM: &[u8] = b"\xEF\xBB\xBF";

/// Which line break ended the blank line of an event. Injected lines reuse
/// it, so a CRLF stream stays CRLF.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LineEnding {
    Lf,
    CrLf,
    Cr,
}

impl LineEnding {
    pub fn as_bytes(self) -> &'static [u8] {
        match self {
            LineEnding::Lf => b"\n",
            LineEnding::CrLf => b"\r\n",
            LineEnding::Cr => b"\r",
        }
    }
}

/// One piece of the stream, ready to forward.
#[derive(Debug)]
pub struct SseBlock<'a> {
    /// The exact input bytes of this block, blank line included.
    pub raw: &'a [u8],
    /// Offset of `raw[0]` in the whole stream.
    pub offset: u64,
    pub kind: SseBlockKind<'a>,
}

#[derive(Debug)]
pub enum SseBlockKind<'a> {
    /// The block dispatched an event.
    Event(SseEvent<'a>),
    /// The block ended with a blank line but had no `data` (comments,
    /// keep-alives, stray blank lines): nothing is dispatched.
    NoData,
    /// The input ended before the blank line that would end this block.
    /// Per WHATWG nothing is dispatched; `has_data` says whether data
    /// (complete `data` lines, or a last `data` line cut off mid-way) was
    /// lost to that rule; `number` is the number the event would have had.
    Unterminated { has_data: bool, number: u64 },
    /// Follows an event whose blank line ended with a CR at the end of the
    /// input then available ([`SseEvent::line_ending_open`]): `raw` is the
    /// LF that completed that CRLF, or empty when the next byte (or the end
    /// of input) showed that no LF follows. The event itself was handed out
    /// at once, not held until this byte arrived.
    LineEndTail,
    /// A piece of an event larger than the decoder's `max_event_bytes`: such
    /// an event is handed out as its bytes arrive, unparsed, so memory stays
    /// bounded whatever the input. `first` and `last` mark its first and
    /// last piece; `number` is its event number.
    Oversized {
        number: u64,
        first: bool,
        last: bool,
    },
    /// Events the probe took ([`Probe::pass`]), one after the other:
    /// `raw` holds all of them, `events` says how many. Each was a `data`
    /// line whose value the probe recognized (after any comment lines) and
    /// its blank line, handed out only to be passed on; the decoder counted
    /// them (a later event's number counts them too). Only a caller whose
    /// probe takes events gets these.
    Passed { events: u64 },
}

/// Where the scan of an oversized event is.
#[derive(Debug, Clone, Copy)]
struct Oversized {
    number: u64,
    /// No piece was handed out yet.
    first: bool,
    /// The current line has no byte yet (a line break now is a blank line).
    line_empty: bool,
    /// The last byte was a CR: an LF now completes that line break.
    cr_pending: bool,
    /// The blank line ending the event was a CR at the end of the input: the
    /// next piece is its LF, if one comes, and ends the event.
    closing_cr: bool,
}

/// The default for [`SseDecoder::with_max_event_bytes`]: large enough for
/// any real chunk (a whole Ollama tool call in one line included), small
/// enough that a stream without blank lines cannot exhaust memory.
pub const DEFAULT_MAX_EVENT_BYTES: usize = 16 * 1024 * 1024;

/// A dispatched event.
#[derive(Debug)]
pub struct SseEvent<'a> {
    /// 1-based count of dispatched events in the stream.
    pub number: u64,
    /// The `event:` field, empty for the default `message` type.
    pub event_type: &'a [u8],
    /// The `data:` lines joined with `\n`.
    pub data: &'a [u8],
    /// `data` as text, when it was checked as valid UTF-8 with the rest of
    /// its window ([`Window::checked`]); `None` says nothing about it.
    pub text: Option<&'a str>,
    /// The last event ID seen so far in the stream (`id:` persists).
    pub last_event_id: &'a [u8],
    /// Offset in `raw` of the last non-whitespace byte of the data when that
    /// byte is `}`: where a top-level key can be added to a JSON object
    /// without re-encoding it.
    pub closing_brace: Option<usize>,
    /// The line break of the blank line that ended the event.
    pub line_ending: LineEnding,
    /// The blank line ended with a CR at the end of the input then
    /// available: it may yet be a CRLF, which the next block, a
    /// [`SseBlockKind::LineEndTail`], tells.
    pub line_ending_open: bool,
    /// Framed by a [`Probe`] that recognized `text`: the decoder that did
    /// holds its holes.
    pub probed: bool,
}

/// Incremental SSE decoder; see the module docs.
#[derive(Debug)]
pub struct SseDecoder {
    /// Input: blocks already handed out (until the next `push` drops them,
    /// one move per push rather than per block), then the current block.
    /// Under [`SseDecoder::feed`], only the bytes of a block cut by the end
    /// of a piece.
    buf: Vec<u8>,
    state: SseScan,
}

/// The decoder's state apart from its bytes ([`Cutter`]): positions count
/// from the start of the window it reads.
#[derive(Debug)]
pub(crate) struct SseScan {
    /// Events larger than this are handed out as they come, unparsed.
    max_event_bytes: usize,
    /// The current event outgrew `max_event_bytes`.
    oversized: Option<Oversized>,
    /// Where the current block starts.
    start: usize,
    /// The block handed out last still borrows the event fields; they are
    /// reset at the next call.
    reset_pending: bool,
    /// Start of the next line to read.
    scan: usize,
    /// `window[scan..searched]` holds no line break: a long line arriving in
    /// pieces is searched once, not once per piece.
    searched: usize,
    /// Stream offset of the window's first byte.
    base_offset: u64,
    /// The BOM check at stream start is done.
    started: bool,
    /// The last line ended with a CR at the end of the available input, so an
    /// LF arriving next belongs to that line break.
    skip_lf: bool,
    /// The last event's blank line ended with a CR at the end of the input:
    /// a [`SseBlockKind::LineEndTail`] is due once the next byte is known.
    tail_pending: bool,
    /// No more input will come.
    eof: bool,
    /// The `data` lines joined, once there are two or more…
    data: Vec<u8>,
    /// … while the only one so far is `window[.0...1]`, not copied.
    data_line: Option<(usize, usize)>,
    has_data: bool,
    event_type: Vec<u8>,
    last_event_id: Vec<u8>,
    /// `last_event_id` as it was before the current event's first `id`
    /// line (swapped in, so no allocation per event), for when that event
    /// turns out oversized: an oversized event is not parsed, its `id`
    /// included, whether its `id` line came before the limit or after.
    id_before_event: Vec<u8>,
    /// The current event has set `last_event_id` (`id_before_event` holds
    /// the value to restore).
    id_changed: bool,
    /// Position of the last non-whitespace data byte, if any.
    data_last_byte: Option<usize>,
    events: u64,
}

impl Default for SseDecoder {
    fn default() -> Self {
        SseDecoder::with_max_event_bytes(DEFAULT_MAX_EVENT_BYTES)
    }
}

impl SseDecoder {
    pub fn new() -> Self {
        Self::default()
    }

    /// A decoder that passes events larger than `max_event_bytes` on as
    /// they stream, unparsed ([`SseBlockKind::Oversized`]).
    pub fn with_max_event_bytes(max_event_bytes: usize) -> Self {
        SseDecoder {
            buf: Vec::new(),
            state: SseScan {
                max_event_bytes: max_event_bytes.max(1),
                oversized: None,
                start: 0,
                reset_pending: false,
                scan: 0,
                searched: 0,
                base_offset: 0,
                started: false,
                skip_lf: false,
                tail_pending: false,
                eof: false,
                data: Vec::new(),
                data_line: None,
                has_data: false,
                event_type: Vec::new(),
                last_event_id: Vec::new(),
                id_before_event: Vec::new(),
                id_changed: false,
                data_last_byte: None,
                events: 0,
            },
        }
    }

    /// Adds input. Call [`next_block`](Self::next_block) until it returns
    /// `None` afterwards.
    pub fn push(&mut self, input: &[u8]) {
        self.state.reset_event();
        window::drop_consumed(&mut self.buf, &mut self.state);
        self.buf.extend_from_slice(input);
    }

    /// Frames `input` where it lies, after what is kept from earlier
    /// pieces: `each` gets every block that is complete, in order (the same
    /// blocks as [`push`](Self::push) then [`next_block`](Self::next_block)
    /// until `None`); only the bytes of a block cut by the end of `input`
    /// are copied ([`window::feed`]).
    pub fn feed(&mut self, input: &[u8], each: impl FnMut(SseBlock<'_>)) {
        self.feed_probing(input, &mut Each(each));
    }

    /// [`feed`](Self::feed), asking `frames` first at each event that
    /// starts with a `data` line, after any comment lines ([`Probe`]).
    pub(crate) fn feed_probing(&mut self, input: &[u8], frames: &mut impl Frames<SseScan>) {
        self.state.reset_event();
        window::feed(&mut self.buf, &mut self.state, input, frames);
    }

    /// Marks the end of input: the next calls hand out whatever is left.
    pub fn finish(&mut self) {
        self.state.eof = true;
    }

    /// The input not handed out yet: after [`feed`](Self::feed), the bytes
    /// of the block cut by the end of the last piece. The next blocks
    /// handed out start with them.
    pub fn pending(&self) -> &[u8] {
        self.buf.get(self.state.consumed()..).unwrap_or_default()
    }

    /// The next complete block, or `None` when more input is needed (or,
    /// after [`finish`](Self::finish), when everything has been handed out).
    pub fn next_block(&mut self) -> Option<SseBlock<'_>> {
        self.state.next_block(Window::raw(&self.buf), &mut NoProbe)
    }
}

impl Cutter for SseScan {
    type Frame<'a> = SseBlock<'a>;

    #[inline(always)]
    fn next_frame<'a>(
        &'a mut self,
        window: Window<'a>,
        probe: &mut impl Probe,
    ) -> Option<SseBlock<'a>> {
        self.next_block(window, probe)
    }

    fn consumed(&self) -> usize {
        self.start
    }

    fn rebase(&mut self, n: usize) {
        self.reset_event();
        self.base_offset += n as u64;
        self.start -= n;
        self.scan -= n;
        self.searched -= n;
        self.data_last_byte = self.data_last_byte.map(|i| i - n);
        self.data_line = self.data_line.map(|(a, b)| (a - n, b - n));
    }
}

/// Where the line after the comment lines starting at `line` starts, when
/// each ends with LF or CRLF in `bytes`. A comment (a keep-alive, a
/// timestamp) changes no field: the scan skips it, and so does the probe.
/// Out of line: few providers send comments, but a stream that has them
/// may have one before every event (the benchmark's stamping upstream).
#[cold]
fn after_comments(bytes: &[u8], mut line: usize) -> Option<usize> {
    while bytes.get(line) == Some(&b':') {
        let end = line + memchr2(b'\r', b'\n', &bytes[line..])?;
        line = match (bytes[end], bytes.get(end + 1)) {
            (b'\n', _) => end + 1,
            (b'\r', Some(b'\n')) => end + 2,
            // A lone CR, or one whose LF may be yet to come.
            _ => return None,
        };
    }
    Some(line)
}

impl SseScan {
    // Inlined into the framing loop, like `NdjsonScan::next_line`: a block
    // handed back from a call stalls on its way through the stack.
    #[inline(always)]
    fn next_block<'a>(
        &'a mut self,
        window: Window<'a>,
        probe: &mut impl Probe,
    ) -> Option<SseBlock<'a>> {
        let buf = window.bytes;
        self.reset_event();
        // The events the probe recognizes and then takes ([`Probe::pass`])
        // go out together, as one run, ended by the first event it does
        // not take (recognized and asked about again at the next call),
        // one it does not recognize (searched for), or the window's end.
        // Not while the block's first line is still unfinished (a piece of
        // it was searched, and what came since holds no line break): the
        // probe would search it again from its start at each piece, the
        // square of its length (a 16 MB comment line in 1 KiB pieces: 2.5 s
        // against 0.14). Once a line break has come, the event is probed
        // as one that came whole (an event cut by a read is no slower).
        if self.scan == self.start
            && self.started
            && !self.tail_pending
            && !self.skip_lf
            && self.oversized.is_none()
            && (self.searched <= self.start
                || memchr2(b'\r', b'\n', buf.get(self.searched..).unwrap_or_default()).is_some())
        {
            let start = self.start;
            let mut passed = 0;
            while let Some((value, ending, text)) = self.probed_value(window, probe) {
                if probe.pass(text) {
                    let end = value.end + 2 * ending.as_bytes().len();
                    self.events += 1;
                    self.scan = end;
                    self.searched = end;
                    self.start = end;
                    passed += 1;
                    continue;
                }
                if passed == 0 {
                    return Some(self.probed_event(window, value, ending));
                }
                break;
            }
            if passed > 0 {
                return Some(SseBlock {
                    raw: &buf[start..self.start],
                    offset: self.base_offset + start as u64,
                    kind: SseBlockKind::Passed { events: passed },
                });
            }
        }
        if !self.started {
            let n = buf.len().min(BOM.len());
            if buf[..n] != BOM[..n] {
                self.started = true;
            } else if n == BOM.len() {
                self.started = true;
                self.scan = BOM.len();
            } else if self.eof {
                self.started = true;
            } else {
                return None;
            }
        }
        loop {
            if self.tail_pending {
                match buf.get(self.scan) {
                    Some(b'\n') => self.scan += 1,
                    Some(_) => {}
                    None if self.eof => {}
                    None => return None,
                }
                self.tail_pending = false;
                self.searched = self.scan;
                return Some(self.hand_out(buf, SseBlockKind::LineEndTail));
            }
            if self.oversized.is_some() {
                return self.next_oversized_piece(buf);
            }
            if self.skip_lf {
                match buf.get(self.scan) {
                    Some(b'\n') => self.scan += 1,
                    Some(_) => {}
                    None if self.eof => {}
                    None => return None,
                }
                self.skip_lf = false;
                // That LF counts toward the event's size as it does when
                // the CRLF arrives whole, or whether an event is oversized
                // would depend on where the input was cut (found by the
                // `sse_framing` fuzz target, issue 7).
                if self.scan - self.start > self.max_event_bytes {
                    self.enter_oversized();
                    continue;
                }
            }
            let from = self.searched.max(self.scan);
            // The blank line that ends most events is found without a call.
            let found = match buf.get(from) {
                Some(b'\r' | b'\n') => Some(0),
                _ => memchr2(b'\r', b'\n', &buf[from..]),
            };
            let Some(len) = found else {
                self.searched = buf.len();
                if !self.eof && buf.len() - self.start > self.max_event_bytes {
                    self.enter_oversized();
                    continue;
                }
                return self.unterminated_tail(buf);
            };
            let line_start = self.scan;
            let line_end = from + len;
            let mut next = line_end + 1;
            let mut ending = LineEnding::Lf;
            let mut cr_at_end = false;
            if buf[line_end] == b'\r' {
                ending = LineEnding::Cr;
                match buf.get(next) {
                    Some(b'\n') => {
                        next += 1;
                        ending = LineEnding::CrLf;
                    }
                    Some(_) => {}
                    None => cr_at_end = true,
                }
            }
            self.scan = next;
            self.searched = next;
            if line_start == line_end {
                let open = cr_at_end && !self.eof;
                self.tail_pending = open;
                return Some(self.dispatch(window, ending, open));
            }
            self.skip_lf = cr_at_end;
            self.field(buf, line_start, line_end);
            if self.scan - self.start > self.max_event_bytes {
                self.enter_oversized();
            }
        }
    }

    /// At the start of an event, in the checked part of the window: where
    /// its payload lies when the event is one `data` line whose value
    /// `probe` recognizes (after any comment lines, ended by LF or CRLF),
    /// then a blank line, both ended by LF or both by CRLF, and it is not
    /// oversized; and the text the probe was asked of, from the value on.
    /// [`probed_event`](Self::probed_event) then hands it out: the block
    /// the line-by-line scan would, without its searches.
    #[inline(always)]
    fn probed_value<'w>(
        &self,
        window: Window<'w>,
        probe: &mut impl Probe,
    ) -> Option<(Range<usize>, LineEnding, &'w str)> {
        let bytes = window.bytes;
        let mut line = self.start;
        // `data:` is looked at first, so an event without comments pays
        // for no comment check (with that check first, comment-free
        // captures ran 0.6 % more instructions).
        if !bytes.get(line..)?.starts_with(b"data:") {
            if bytes.get(line) != Some(&b':') {
                return None;
            }
            line = after_comments(bytes, line)?;
            if !bytes.get(line..)?.starts_with(b"data:") {
                return None;
            }
        }
        // The field's name, and the one space after it the value drops.
        let value = line + 5 + usize::from(bytes.get(line + 5) == Some(&b' '));
        let text = window.text_from(value)?;
        let len = probe.payload_len(text)?;
        let end = value + len;
        let after = bytes.get(end..)?;
        let ending = if after.starts_with(b"\n\n") {
            LineEnding::Lf
        } else if after.starts_with(b"\r\n\r\n") {
            LineEnding::CrLf
        } else {
            return None;
        };
        // As the scan measures it: up to the end of the `data` line.
        let fits = end + ending.as_bytes().len() - self.start <= self.max_event_bytes;
        (len > 0 && fits).then_some((value..end, ending, text))
    }

    /// Hands out the event whose `data` value
    /// [`probed_value`](Self::probed_value) found at `value`, its `data`
    /// line and blank line ended by `ending`.
    fn probed_event<'a>(
        &'a mut self,
        window: Window<'a>,
        value: Range<usize>,
        ending: LineEnding,
    ) -> SseBlock<'a> {
        let buf = window.bytes;
        let start = self.start;
        let data = &buf[value.clone()];
        let end = value.end + 2 * ending.as_bytes().len();
        self.events += 1;
        self.scan = end;
        self.searched = end;
        self.start = end;
        self.reset_pending = true;
        let closing_brace = data
            .iter()
            .rposition(|b| !matches!(b, b' ' | b'\t'))
            .filter(|&i| data[i] == b'}')
            .map(|i| value.start + i - start);
        SseBlock {
            raw: &buf[start..end],
            offset: self.base_offset + start as u64,
            kind: SseBlockKind::Event(SseEvent {
                number: self.events,
                event_type: &self.event_type,
                data,
                text: window.text(value.start, value.end),
                last_event_id: &self.last_event_id,
                closing_brace,
                line_ending: ending,
                line_ending_open: false,
                probed: true,
            }),
        }
    }

    /// The current event is too large to hold: from now on its bytes go out
    /// as they come. `scan` is at the start of a line.
    fn enter_oversized(&mut self) {
        self.events += 1;
        self.oversized = Some(Oversized {
            number: self.events,
            first: true,
            line_empty: true,
            cr_pending: std::mem::take(&mut self.skip_lf),
            closing_cr: false,
        });
        // What was gathered of its fields will not be used; an `id` it
        // set is undone, as it would never have been read had the event's
        // first bytes arrived alone (the result must not depend on how the
        // input was cut; found by the `sse_framing` fuzz target, issue 7).
        self.data = Vec::new();
        self.data_line = None;
        self.has_data = false;
        self.data_last_byte = None;
        if std::mem::take(&mut self.id_changed) {
            std::mem::swap(&mut self.last_event_id, &mut self.id_before_event);
        }
    }

    /// Hands out what arrived of an oversized event, up to and including its
    /// blank line if that has come.
    fn next_oversized_piece<'a>(&'a mut self, buf: &'a [u8]) -> Option<SseBlock<'a>> {
        let mut state = self.oversized?;
        let mut pos = self.scan;
        if state.closing_cr {
            // As for a normal event: an LF right after its last CR is its.
            let end = match buf.get(pos) {
                Some(b'\n') => pos + 1,
                Some(_) => pos,
                None if self.eof => pos,
                None => return None,
            };
            return Some(self.oversized_piece(buf, state, end, true));
        }
        let event_end = loop {
            let Some(offset) = memchr2(b'\r', b'\n', &buf[pos..]) else {
                if pos < buf.len() {
                    state.line_empty = false;
                    state.cr_pending = false;
                }
                pos = buf.len();
                break None;
            };
            let i = pos + offset;
            if i > pos {
                state.line_empty = false;
                state.cr_pending = false;
            }
            let byte = buf[i];
            if byte == b'\n' && state.cr_pending {
                // The LF of a CRLF whose CR was already counted.
                state.cr_pending = false;
                pos = i + 1;
                continue;
            }
            if state.line_empty {
                let mut end = i + 1;
                if byte == b'\r' {
                    match buf.get(end) {
                        Some(b'\n') => end += 1,
                        Some(_) => {}
                        None if self.eof => {}
                        None => {
                            // Wait for the next byte before ending it.
                            state.closing_cr = true;
                            return Some(self.oversized_piece(buf, state, end, false));
                        }
                    }
                }
                break Some(end);
            }
            state.line_empty = true;
            state.cr_pending = byte == b'\r';
            pos = i + 1;
        };
        let last = event_end.is_some() || self.eof;
        let end = event_end.unwrap_or(pos);
        if end == self.start && !last {
            self.oversized = Some(state);
            return None;
        }
        Some(self.oversized_piece(buf, state, end, last))
    }

    /// Hands out `buf[start..end]` as a piece of the oversized event.
    fn oversized_piece<'a>(
        &'a mut self,
        buf: &'a [u8],
        state: Oversized,
        end: usize,
        last: bool,
    ) -> SseBlock<'a> {
        self.scan = end;
        self.searched = end;
        self.oversized = if last {
            None
        } else {
            Some(Oversized {
                first: false,
                ..state
            })
        };
        self.hand_out(
            buf,
            SseBlockKind::Oversized {
                number: state.number,
                first: state.first,
                last,
            },
        )
    }

    /// Interprets one non-empty line `buf[start..end]`.
    fn field(&mut self, buf: &[u8], start: usize, end: usize) {
        let line = &buf[start..end];
        if line[0] == b':' {
            return;
        }
        // `data:`, the line of nearly every event, without a search.
        let colon = if line.starts_with(b"data:") {
            Some(4)
        } else {
            memchr::memchr(b':', line)
        };
        let (name, value_start) = match colon {
            Some(colon) => {
                let mut v = start + colon + 1;
                if buf.get(v) == Some(&b' ') && v < end {
                    v += 1;
                }
                (&line[..colon], v)
            }
            None => (line, end),
        };
        let value = &buf[value_start..end];
        match name {
            b"data" => {
                if let Some(i) = value.iter().rposition(|b| !matches!(b, b' ' | b'\t')) {
                    self.data_last_byte = Some(value_start + i);
                }
                if !self.has_data {
                    // Most events have one data line: it is read in place.
                    self.has_data = true;
                    self.data_line = Some((value_start, end));
                    return;
                }
                if let Some((a, b)) = self.data_line.take() {
                    self.data.extend_from_slice(&buf[a..b]);
                }
                self.data.push(b'\n');
                self.data.extend_from_slice(&buf[value_start..end]);
            }
            b"event" => {
                self.event_type.clear();
                self.event_type.extend_from_slice(value);
            }
            b"id" if !value.contains(&0) => {
                if !std::mem::replace(&mut self.id_changed, true) {
                    std::mem::swap(&mut self.last_event_id, &mut self.id_before_event);
                }
                self.last_event_id.clear();
                self.last_event_id.extend_from_slice(value);
            }
            // `retry` and unknown fields change nothing we track.
            _ => {}
        }
    }

    /// Hands out `buf[start..scan]` as a block ended by a blank line.
    fn dispatch<'a>(
        &'a mut self,
        window: Window<'a>,
        line_ending: LineEnding,
        line_ending_open: bool,
    ) -> SseBlock<'a> {
        let buf = window.bytes;
        let start = self.start;
        // The block is whole: an `id` it set stays (WHATWG: the last event
        // ID buffer persists, with or without data).
        self.id_changed = false;
        let kind = if self.has_data {
            self.events += 1;
            let closing_brace = self
                .data_last_byte
                .filter(|&i| buf[i] == b'}')
                .map(|i| i - start);
            SseBlockKind::Event(SseEvent {
                number: self.events,
                event_type: &self.event_type,
                data: match self.data_line {
                    Some((a, b)) => &buf[a..b],
                    None => &self.data,
                },
                text: self.data_line.and_then(|(a, b)| window.text(a, b)),
                last_event_id: &self.last_event_id,
                closing_brace,
                line_ending,
                line_ending_open,
                probed: false,
            })
        } else {
            SseBlockKind::NoData
        };
        let end = self.scan;
        self.start = end;
        self.reset_pending = true;
        SseBlock {
            raw: &buf[start..end],
            offset: self.base_offset + start as u64,
            kind,
        }
    }

    /// Hands out `buf[start..scan]` as a block of `kind`.
    fn hand_out<'a>(&'a mut self, buf: &'a [u8], kind: SseBlockKind<'a>) -> SseBlock<'a> {
        let start = self.start;
        self.start = self.scan;
        self.reset_pending = true;
        SseBlock {
            raw: &buf[start..self.scan],
            offset: self.base_offset + start as u64,
            kind,
        }
    }

    /// At end of input, the bytes after the last blank line.
    fn unterminated_tail<'a>(&'a mut self, buf: &'a [u8]) -> Option<SseBlock<'a>> {
        if !self.eof || self.start == buf.len() {
            return None;
        }
        let start = self.start;
        // A last `data` line cut off before its line break is data lost
        // too (its first bytes are a prefix of `data:`, or it is `data:…`).
        let partial = &buf[self.scan..];
        let cut_data_line =
            !partial.is_empty() && b"data:".starts_with(&partial[..partial.len().min(5)]);
        let has_data = self.has_data || cut_data_line;
        self.scan = buf.len();
        self.start = buf.len();
        self.reset_pending = true;
        Some(SseBlock {
            raw: &buf[start..],
            offset: self.base_offset + start as u64,
            kind: SseBlockKind::Unterminated {
                has_data,
                number: self.events + 1,
            },
        })
    }

    /// Resets the per-event fields once the block handed out last no longer
    /// borrows them.
    fn reset_event(&mut self) {
        if !std::mem::take(&mut self.reset_pending) {
            return;
        }
        self.data.clear();
        self.data_line = None;
        self.has_data = false;
        self.event_type.clear();
        self.data_last_byte = None;
    }
}

#[cfg(test)]
mod tests;
