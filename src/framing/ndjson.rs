//! Incremental NDJSON framing: one JSON document per `\n`-terminated line.
//!
//! [`NdjsonDecoder`] hands out [`NdjsonLine`]s with their exact raw bytes
//! (terminator included), so forwarding lines in order reproduces the input.
//! A `\r` before the `\n` is tolerated (left out of `content`), a BOM at the
//! start of the stream is left out of the first line's `content`, and at end
//! of input a last line without `\n` is still a line.
//!
//! It does not parse JSON or decode UTF-8 (under [`NdjsonDecoder::feed`]
//! a line says when it was checked as text with the rest of its piece).
//! Lines longer than its limit are handed out in pieces, unparsed.

use memchr::memchr;

use super::window::{self, Cutter, Each, Frames, NoProbe, Probe, Window};

/// One line of the stream.
#[derive(Debug)]
pub struct NdjsonLine<'a> {
    /// The exact input bytes, terminator included.
    pub raw: &'a [u8],
    /// The line without its terminator (and without a leading BOM).
    pub content: &'a [u8],
    /// Offset in `raw` where `content` starts (3 after a BOM, else 0).
    pub content_start: usize,
    /// 1-based line number.
    pub number: u64,
    /// `Some` for a piece of a line longer than the decoder's
    /// `max_line_bytes`: such a line is handed out as it arrives, unparsed.
    pub oversized: Option<OversizedPiece>,
    /// Offset of `raw[0]` in the whole stream.
    pub offset: u64,
    /// `content` as text, when it was checked as valid UTF-8 with the rest
    /// of its window ([`Window::checked`]); `None` says nothing about it.
    pub text: Option<&'a str>,
    /// Framed by a [`Probe`] that recognized `text`: the decoder that did
    /// holds its holes.
    pub probed: bool,
    /// When not 0: `raw` is a run of this many whole lines, each one
    /// recognized and then taken by the probe ([`Probe::pass`]), so that
    /// they only have to be passed on. `content` is empty, `text` is
    /// `None`, `number` is the last line's and `offset` the first's.
    pub passed: u64,
}

/// Which piece of an oversized line this is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OversizedPiece {
    pub first: bool,
    pub last: bool,
}

impl NdjsonLine<'_> {
    /// Offset in `raw` of the last non-whitespace byte of the content when
    /// it is `}`: where a top-level key can be added without re-encoding.
    pub fn closing_brace(&self) -> Option<usize> {
        let i = self
            .content
            .iter()
            .rposition(|b| !b.is_ascii_whitespace())?;
        (self.content[i] == b'}').then_some(self.content_start + i)
    }

    /// True when the line holds only whitespace.
    pub fn is_blank(&self) -> bool {
        self.content.iter().all(|b| b.is_ascii_whitespace())
    }
}

/// Incremental NDJSON decoder; see the module docs.
#[derive(Debug)]
pub struct NdjsonDecoder {
    /// Input: lines already handed out (until the next `push` drops them,
    /// one move per push rather than per line), then the current line.
    /// Under [`NdjsonDecoder::feed`], only the bytes of a line cut by the
    /// end of a piece.
    buf: Vec<u8>,
    state: NdjsonScan,
}

/// The decoder's state apart from its bytes ([`Cutter`]): positions count
/// from the start of the window it reads.
#[derive(Debug)]
pub(crate) struct NdjsonScan {
    /// Lines longer than this are handed out as they come, unparsed.
    max_line_bytes: usize,
    /// In an oversized line: `Some(first piece not handed out yet)`.
    oversized: Option<bool>,
    /// Where the current line starts.
    start: usize,
    /// Where to resume looking for `\n` (everything before it has none).
    scan: usize,
    /// Stream offset of the window's first byte.
    base_offset: u64,
    lines: u64,
    eof: bool,
}

impl Default for NdjsonDecoder {
    fn default() -> Self {
        NdjsonDecoder::with_max_line_bytes(crate::framing::sse::DEFAULT_MAX_EVENT_BYTES)
    }
}

impl NdjsonDecoder {
    pub fn new() -> Self {
        Self::default()
    }

    /// A decoder that passes lines longer than `max_line_bytes` on as they
    /// stream, unparsed ([`NdjsonLine::oversized`]).
    pub fn with_max_line_bytes(max_line_bytes: usize) -> Self {
        NdjsonDecoder {
            buf: Vec::new(),
            state: NdjsonScan {
                max_line_bytes: max_line_bytes.max(1),
                oversized: None,
                start: 0,
                scan: 0,
                base_offset: 0,
                lines: 0,
                eof: false,
            },
        }
    }

    /// Adds input. Call [`next_line`](Self::next_line) until it returns
    /// `None` afterwards.
    pub fn push(&mut self, input: &[u8]) {
        window::drop_consumed(&mut self.buf, &mut self.state);
        self.buf.extend_from_slice(input);
    }

    /// Frames `input` where it lies, after what is kept from earlier
    /// pieces: `each` gets every line that is complete, in order (the same
    /// lines as [`push`](Self::push) then [`next_line`](Self::next_line)
    /// until `None`); only the bytes of a line cut by the end of `input`
    /// are copied ([`window::feed`]).
    pub fn feed(&mut self, input: &[u8], each: impl FnMut(NdjsonLine<'_>)) {
        self.feed_probing(input, &mut Each(each));
    }

    /// [`feed`](Self::feed), asking `frames` first at the start of each
    /// line ([`Probe`]).
    pub(crate) fn feed_probing(&mut self, input: &[u8], frames: &mut impl Frames<NdjsonScan>) {
        window::feed(&mut self.buf, &mut self.state, input, frames);
    }

    /// Marks the end of input: a last line without `\n` is then handed out.
    pub fn finish(&mut self) {
        self.state.eof = true;
    }

    /// The input not handed out yet: after [`feed`](Self::feed), the bytes
    /// of the line cut by the end of the last piece. The next lines handed
    /// out start with them.
    pub fn pending(&self) -> &[u8] {
        self.buf.get(self.state.consumed()..).unwrap_or_default()
    }

    /// The next complete line, or `None` when more input is needed.
    pub fn next_line(&mut self) -> Option<NdjsonLine<'_>> {
        self.state.next_line(Window::raw(&self.buf), &mut NoProbe)
    }
}

impl Cutter for NdjsonScan {
    type Frame<'a> = NdjsonLine<'a>;

    #[inline(always)]
    fn next_frame<'a>(
        &'a mut self,
        window: Window<'a>,
        probe: &mut impl Probe,
    ) -> Option<NdjsonLine<'a>> {
        self.next_line(window, probe)
    }

    fn consumed(&self) -> usize {
        self.start
    }

    fn rebase(&mut self, n: usize) {
        self.base_offset += n as u64;
        self.start -= n;
        self.scan -= n;
    }
}

impl NdjsonScan {
    // Inlined into the framing loop: a line handed back from a call is
    // written to the stack field by field and read back sixteen bytes at a
    // time, a store-to-load stall on every line (perf annotate).
    #[inline(always)]
    fn next_line<'a>(
        &'a mut self,
        window: Window<'a>,
        probe: &mut impl Probe,
    ) -> Option<NdjsonLine<'a>> {
        let buf = window.bytes;
        let start = self.start;
        // A line whose content the probe recognizes, then LF or CRLF, is
        // the line the search below would find (a recognized payload holds
        // no line break). Not the stream's first line, which may start
        // with a BOM. The lines the probe then takes ([`Probe::pass`]) go
        // out together, as one run, ended by the first line it does not
        // take (recognized and asked about again at the next call), one it
        // does not recognize (searched for), or the window's end.
        if self.scan == start && self.oversized.is_none() && self.base_offset + start as u64 > 0 {
            let mut end = start;
            let mut passed = 0;
            while let Some((text, line_len)) = self.recognized(window, end, probe) {
                if probe.pass(text) {
                    end += line_len;
                    passed += 1;
                    self.lines += 1;
                    continue;
                }
                if passed == 0 {
                    self.start = start + line_len;
                    self.scan = start + line_len;
                    self.lines += 1;
                    return Some(NdjsonLine {
                        raw: &buf[start..start + line_len],
                        content: text.as_bytes(),
                        content_start: 0,
                        number: self.lines,
                        offset: self.base_offset + start as u64,
                        oversized: None,
                        text: Some(text),
                        probed: true,
                        passed: 0,
                    });
                }
                break;
            }
            if passed > 0 {
                self.start = end;
                self.scan = end;
                return Some(NdjsonLine {
                    raw: &buf[start..end],
                    content: &buf[end..end],
                    content_start: 0,
                    number: self.lines,
                    offset: self.base_offset + start as u64,
                    oversized: None,
                    text: None,
                    probed: true,
                    passed,
                });
            }
        }
        let newline = memchr(b'\n', &buf[self.scan..]).map(|i| self.scan + i + 1);
        // Too long, whether it is complete or still arriving: the same line
        // is oversized however the input was cut.
        let line_bytes = newline.map_or(buf.len(), |end| end - 1) - start;
        if self.oversized.is_none() && line_bytes > self.max_line_bytes {
            self.lines += 1;
            self.oversized = Some(true);
        }
        if let Some(first) = self.oversized {
            let last = newline.is_some() || self.eof;
            let end = newline.unwrap_or(buf.len());
            if end == start && !last {
                return None;
            }
            self.start = end;
            self.scan = end;
            self.oversized = (!last).then_some(false);
            let raw = &buf[start..end];
            return Some(NdjsonLine {
                raw,
                content: raw,
                content_start: 0,
                number: self.lines,
                offset: self.base_offset + start as u64,
                oversized: Some(OversizedPiece { first, last }),
                text: None,
                probed: false,
                passed: 0,
            });
        }
        let end = match newline {
            Some(end) => end,
            None if self.eof && start < buf.len() => buf.len(),
            None => {
                self.scan = buf.len();
                return None;
            }
        };
        self.start = end;
        self.scan = end;
        self.lines += 1;
        let offset = self.base_offset + start as u64;
        let raw = &buf[start..end];
        let mut content = raw.strip_suffix(b"\n").unwrap_or(raw);
        content = content.strip_suffix(b"\r").unwrap_or(content);
        let mut content_start = 0;
        if offset == 0
            && let Some(rest) = content.strip_prefix(b"\xEF\xBB\xBF")
        {
            content = rest;
            content_start = 3;
        }
        let text = window.text(start + content_start, start + content_start + content.len());
        Some(NdjsonLine {
            raw,
            content,
            content_start,
            number: self.lines,
            offset,
            oversized: None,
            text,
            probed: false,
            passed: 0,
        })
    }

    /// The line at `at` when the probe recognizes its content and LF or
    /// CRLF follows within the limit: its content as text, and its length
    /// with the line break.
    #[inline(always)]
    fn recognized<'a>(
        &self,
        window: Window<'a>,
        at: usize,
        probe: &mut impl Probe,
    ) -> Option<(&'a str, usize)> {
        let buf = window.bytes;
        let text = window.text_from(at)?;
        let len = probe.payload_len(text)?;
        let ending = match buf.get(at + len) {
            Some(b'\n') => 1,
            Some(b'\r') if buf.get(at + len + 1) == Some(&b'\n') => 2,
            _ => return None,
        };
        // As the search measures it: up to the LF.
        if len == 0 || len + ending - 1 > self.max_line_bytes {
            return None;
        }
        Some((text.get(..len)?, len + ending))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::framing::window::OnePayload;

    fn lines(pieces: &[&[u8]]) -> Vec<(String, String, u64)> {
        let mut decoder = NdjsonDecoder::new();
        let mut out = Vec::new();
        let drain = |d: &mut NdjsonDecoder, out: &mut Vec<(String, String, u64)>| {
            while let Some(line) = d.next_line() {
                out.push((
                    String::from_utf8_lossy(line.raw).into_owned(),
                    String::from_utf8_lossy(line.content).into_owned(),
                    line.offset,
                ));
            }
        };
        for p in pieces {
            decoder.push(p);
            drain(&mut decoder, &mut out);
        }
        decoder.finish();
        drain(&mut decoder, &mut out);
        out
    }

    #[test]
    fn lines_keep_terminators_and_the_last_line_needs_none() {
        let expected = vec![
            ("{\"a\":1}\r\n".to_string(), "{\"a\":1}".to_string(), 0),
            ("\n".to_string(), String::new(), 9),
            ("{\"b\":2}".to_string(), "{\"b\":2}".to_string(), 10),
        ];
        let input = b"{\"a\":1}\r\n\n{\"b\":2}";
        assert_eq!(lines(&[input]), expected);
        let bytewise: Vec<&[u8]> = input.chunks(1).collect();
        assert_eq!(lines(&bytewise), expected);
    }

    #[test]
    fn bom_is_outside_content_and_brace_is_found() {
        let mut decoder = NdjsonDecoder::new();
        decoder.push(b"\xEF\xBB\xBF{\"a\":1} \n");
        let line = decoder.next_line().expect("one line");
        assert_eq!(line.content, b"{\"a\":1} ");
        assert_eq!(line.closing_brace(), Some(9));
        assert_eq!(line.raw[9], b'}');
    }

    #[test]
    fn nothing_in_nothing_out() {
        assert!(lines(&[b""]).is_empty());
    }

    /// A line as handed out: raw, content, number, offset, text, probed.
    type Handed = (String, String, u64, u64, Option<String>, bool);

    /// A probe that recognizes one payload, and the lines it was handed.
    struct Recognizes {
        probe: OnePayload,
        lines: Vec<Handed>,
        /// The runs it was handed.
        runs: Vec<(String, u64, u64, u64)>,
    }

    impl Recognizes {
        /// Which lines were recognized, in order.
        fn which(&self) -> Vec<bool> {
            self.lines.iter().map(|l| l.5).collect()
        }
    }

    impl Probe for Recognizes {
        fn payload_len(&mut self, text: &str) -> Option<usize> {
            self.probe.payload_len(text)
        }

        fn pass(&mut self, text: &str) -> bool {
            self.probe.pass(text)
        }
    }

    impl Frames<NdjsonScan> for Recognizes {
        fn frame(&mut self, line: NdjsonLine<'_>) {
            if line.passed > 0 {
                self.runs.push((
                    String::from_utf8_lossy(line.raw).into_owned(),
                    line.passed,
                    line.number,
                    line.offset,
                ));
                return;
            }
            self.lines.push((
                String::from_utf8_lossy(line.raw).into_owned(),
                String::from_utf8_lossy(line.content).into_owned(),
                line.number,
                line.offset,
                line.text.map(str::to_owned),
                line.probed,
            ));
        }
    }

    fn probed(payload: &'static str, max: usize, input: &[u8]) -> Recognizes {
        probed_passing(payload, max, input, 0)
    }

    fn probed_passing(
        payload: &'static str,
        max: usize,
        input: &[u8],
        passes: usize,
    ) -> Recognizes {
        let mut frames = Recognizes {
            probe: OnePayload::new(payload, passes),
            lines: Vec::new(),
            runs: Vec::new(),
        };
        let mut decoder = NdjsonDecoder::with_max_line_bytes(max);
        decoder.feed_probing(input, &mut frames);
        decoder.finish();
        decoder.feed_probing(&[], &mut frames);
        frames
    }

    /// A line whose content the probe recognizes, then LF or CRLF, is
    /// handed out without a search, as the search would hand it out: not
    /// the first line (a BOM may start it), not one with more after the
    /// payload, not one over the limit.
    #[test]
    fn a_recognized_line_is_the_line_the_search_would_find() {
        let input: &[u8] = b"{\"a\":1}\n{\"a\":1}\n{\"a\":1}\r\n{\"a\":1} \n{\"a\":1}\n";
        let with = probed("{\"a\":1}", 1 << 20, input);
        let without = probed("never", 1 << 20, input);
        assert_eq!(with.which(), [false, true, true, false, true]);
        for (a, b) in with.lines.iter().zip(&without.lines) {
            assert_eq!((&a.0, &a.1, a.2, a.3, &a.4), (&b.0, &b.1, b.2, b.3, &b.4));
            assert!(!b.5, "nothing is recognized without a probe");
        }
        assert_eq!(with.lines.len(), without.lines.len());

        let limited = probed("{\"a\":1}", 6, input);
        assert!(
            limited.lines.iter().all(|l| !l.5),
            "over the limit: searched"
        );
        // At the limit: the CRLF line's size counts its CR.
        assert_eq!(
            probed("{\"a\":1}", 7, input).which(),
            [false, true, false, false, true]
        );
    }

    /// Lines the probe takes go out together, as a run that holds their
    /// bytes, counts them, and bears the last one's number and the first
    /// one's offset; the first line it does not take ends the run and is
    /// handed out alone next, recognized again. Numbers and offsets after a
    /// run are those of the lines handed out one by one.
    #[test]
    fn lines_the_probe_takes_go_out_as_one_run() {
        let input: &[u8] =
            b"{\"a\":1}\n{\"a\":1}\n{\"a\":1}\r\n{\"a\":1}\n{\"a\":1}\nnot\n{\"a\":1}\n";
        // Takes the 2nd to 4th lines (the 1st is never recognized: a BOM
        // may start it), and no line after them.
        let run = probed_passing("{\"a\":1}", 1 << 20, input, 4);
        assert_eq!(
            run.runs,
            [("{\"a\":1}\n{\"a\":1}\r\n{\"a\":1}\n".to_string(), 3, 4, 8)]
        );
        let alone = probed("{\"a\":1}", 1 << 20, input);
        let numbered = |r: &Recognizes| -> Vec<(String, u64, u64, bool)> {
            r.lines
                .iter()
                .map(|l| (l.0.clone(), l.2, l.3, l.5))
                .collect()
        };
        assert_eq!(
            numbered(&run),
            [
                ("{\"a\":1}\n".to_string(), 1, 0, false),
                ("{\"a\":1}\n".to_string(), 5, 33, true),
                ("not\n".to_string(), 6, 41, false),
                ("{\"a\":1}\n".to_string(), 7, 45, true),
            ]
        );
        // A line it does not recognize ends a run too, and is searched
        // for; the window's end ends the last.
        let all_taken = probed_passing("{\"a\":1}", 1 << 20, input, 100);
        assert_eq!(
            all_taken.runs,
            [
                (
                    "{\"a\":1}\n{\"a\":1}\r\n{\"a\":1}\n{\"a\":1}\n".to_string(),
                    4,
                    5,
                    8
                ),
                ("{\"a\":1}\n".to_string(), 1, 7, 45)
            ]
        );
        assert_eq!(
            numbered(&all_taken),
            [
                ("{\"a\":1}\n".to_string(), 1, 0, false),
                ("not\n".to_string(), 6, 41, false)
            ]
        );
        // The same lines, numbers and offsets as when none is taken.
        let all = numbered(&alone);
        assert_eq!(all.len(), 7);
        assert_eq!(
            [&all[0], &all[4], &all[5], &all[6]],
            [
                &numbered(&run)[0],
                &numbered(&run)[1],
                &numbered(&run)[2],
                &numbered(&run)[3]
            ]
        );
        let joined: String = all[1..4].iter().map(|l| l.0.as_str()).collect();
        assert_eq!(joined, run.runs[0].0);
        assert_eq!((all[1].2, all[3].1), (8, 4));
    }
}
