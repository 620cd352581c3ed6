//! Framing a piece of input where it lies.
//!
//! A decoder's `push` copies each piece into the decoder's buffer, and its
//! frames borrow that buffer. On the pipeline's hot path that copy is most
//! of the cost of forwarding a byte, so [`feed`] frames a piece in place
//! instead: only the bytes of a frame cut by the end of a piece are kept
//! (the *carry*) until the next piece completes it. Frames from the piece
//! itself borrow the piece, so a caller that writes the piece out can write
//! those bytes without copying them.
//!
//! A [`Cutter`] is a decoder's state machine, apart from the bytes it reads:
//! positions in its state count from the start of the [`Window`] it is
//! given, and [`Cutter::rebase`] moves them when the window moves. The same
//! cutter runs under `push` (its window is always the decoder's buffer) and
//! under [`feed`]: the frames, and where they start and end, are the same
//! however the input is cut.
//!
//! A window also says which of its bytes are valid UTF-8: [`feed`] checks a
//! piece up to its last line break in one pass, so the frames inside it are
//! text without a check each (a frame that reaches past it, or a piece with
//! an invalid byte, leaves the check to the decoder of the frame).

use memchr::memrchr2;

/// Bytes to frame, and the part of them known to be valid UTF-8.
#[derive(Debug, Clone, Copy)]
pub struct Window<'a> {
    /// The bytes; frames are slices of them.
    pub bytes: &'a [u8],
    /// `bytes[text_start..text_start + text.len()]`, checked.
    text: &'a str,
    text_start: usize,
}

impl<'a> Window<'a> {
    /// A window with nothing checked.
    pub fn raw(bytes: &'a [u8]) -> Window<'a> {
        Window {
            bytes,
            text: "",
            text_start: 0,
        }
    }

    /// A window whose bytes from `from` to the last line break (CR or LF)
    /// are checked in one pass; if they are not all valid UTF-8, only the
    /// valid part before the first bad byte counts as checked.
    pub fn checked(bytes: &'a [u8], from: usize) -> Window<'a> {
        let tail = bytes.get(from..).unwrap_or_default();
        let Some(last_break) = memrchr2(b'\n', b'\r', tail) else {
            return Window::raw(bytes);
        };
        let lines = &tail[..=last_break];
        let text = match simdutf8::basic::from_utf8(lines) {
            Ok(text) => text,
            Err(_) => match std::str::from_utf8(lines) {
                Ok(text) => text,
                Err(e) => std::str::from_utf8(&lines[..e.valid_up_to()]).unwrap_or_default(),
            },
        };
        Window {
            bytes,
            text,
            text_start: from,
        }
    }

    /// `bytes[start..end]` as text, when it lies in the checked part.
    pub fn text(&self, start: usize, end: usize) -> Option<&'a str> {
        let start = start.checked_sub(self.text_start)?;
        self.text.get(start..end.checked_sub(self.text_start)?)
    }

    /// The checked text from `start` on, when `start` lies in it.
    pub fn text_from(&self, start: usize) -> Option<&'a str> {
        self.text.get(start.checked_sub(self.text_start)?..)
    }
}

/// What a cutter may ask the decoder of its frames, at the start of a
/// line in the checked part of a window: whether `text` starts with a
/// payload of the shape the decoder expects (its template, see
/// `providers::scan`), and how long it is. A payload it recognizes holds
/// no line break, so when the line break the frame's syntax wants comes
/// right after it, the cutter has the frame without searching for its
/// end; anything else is framed as usual. Such a frame says it was
/// probed, and the decoder already holds its holes.
pub trait Probe {
    /// By default nothing is recognized: every frame is searched for.
    fn payload_len(&mut self, _text: &str) -> Option<usize> {
        None
    }

    /// Asked of a frame the cutter recognized (its payload by
    /// [`payload_len`](Self::payload_len), then the line break and the size
    /// its framing wants): whether the decoder took that frame itself, so
    /// that it only has to be passed on. `text` starts with the payload,
    /// where the `text` `payload_len` was asked of starts; what follows the
    /// payload, if anything, is not the frame's. A cutter that asks hands
    /// the frames taken one after the other out together, as one run of
    /// bytes (`NdjsonLine::passed`, `SseBlockKind::Passed`). A no must
    /// change nothing: the frame is then handed out alone, or, when it ends
    /// a run, recognized and asked about again at the next call. By default
    /// nothing is taken.
    fn pass(&mut self, _text: &str) -> bool {
        false
    }
}

/// A caller with nothing to say: every frame is searched for.
pub struct NoProbe;

impl Probe for NoProbe {}

/// What [`feed`] hands each frame to, and asks first ([`Probe`]).
pub trait Frames<C: Cutter + ?Sized>: Probe {
    fn frame(&mut self, frame: C::Frame<'_>);
}

/// A closure that takes each frame, and asks nothing.
pub struct Each<F>(pub F);

impl<F> Probe for Each<F> {}

impl<C: Cutter, F: FnMut(C::Frame<'_>)> Frames<C> for Each<F> {
    fn frame(&mut self, frame: C::Frame<'_>) {
        (self.0)(frame);
    }
}

/// A decoder's state machine, over a window it does not own.
pub trait Cutter {
    /// What it hands out; borrows the window and the cutter.
    type Frame<'a>
    where
        Self: 'a;
    /// The next complete frame in `window`, or `None` when it needs bytes
    /// after the window's end (or, after the end of input, has handed out
    /// everything); `probe` may tell where a payload ends.
    fn next_frame<'a>(
        &'a mut self,
        window: Window<'a>,
        probe: &mut impl Probe,
    ) -> Option<Self::Frame<'a>>;
    /// Window position of the first byte not handed out yet.
    fn consumed(&self) -> usize;
    /// The window now starts `n` bytes later (`n` ≤ [`consumed`](Self::consumed)):
    /// every position moves back by `n`.
    fn rebase(&mut self, n: usize);
}

/// How many bytes of a piece join the carry at first when they complete a
/// carried frame; doubled until that frame is complete.
const CARRY_STEP: usize = 4096;

/// Frames `input`, which follows the `carry` (bytes of an incomplete frame
/// kept from earlier pieces, or nothing): calls `each` for every frame that
/// is complete, in order, then keeps the incomplete rest in the carry.
///
/// While the carry holds bytes, input joins it a few kilobytes at a time
/// until the carried frame is out; the rest of the input is framed in place.
pub fn feed<C: Cutter + 'static>(
    carry: &mut Vec<u8>,
    cutter: &mut C,
    input: &[u8],
    each: &mut impl Frames<C>,
) {
    drop_consumed(carry, cutter);
    let mut taken = 0;
    if !carry.is_empty() {
        let carried = carry.len();
        let mut step = CARRY_STEP.max(carried);
        loop {
            let more = step.min(input.len() - taken);
            carry.extend_from_slice(&input[taken..taken + more]);
            taken += more;
            while let Some(frame) = cutter.next_frame(Window::raw(carry), each) {
                each.frame(frame);
            }
            if cutter.consumed() >= carried {
                break;
            }
            if taken == input.len() {
                return;
            }
            step = step.saturating_mul(2);
        }
        // What is left of the carry is a copy of `input[..taken]`'s end:
        // go on in the input itself.
        cutter.rebase(carried);
        carry.clear();
    }
    let window = Window::checked(input, cutter.consumed());
    while let Some(frame) = cutter.next_frame(window, each) {
        each.frame(frame);
    }
    let rest = cutter.consumed();
    carry.extend_from_slice(&input[rest..]);
    cutter.rebase(rest);
}

/// Drops the bytes of the carry that were handed out.
pub fn drop_consumed<C: Cutter>(carry: &mut Vec<u8>, cutter: &mut C) {
    let done = cutter.consumed();
    if done > 0 {
        carry.drain(..done);
        cutter.rebase(done);
    }
}

/// The probe of the framers' tests: recognizes one payload, and takes
/// ([`Probe::pass`]) the frames it recognizes while `passes` is above 0,
/// one less each time. It checks that `pass` is asked right after a
/// recognition, of the text it recognized, where that starts.
#[cfg(test)]
pub(crate) struct OnePayload {
    pub payload: &'static str,
    pub passes: usize,
    /// Where the text it last recognized starts (0: none since `pass` was
    /// last asked).
    recognized_at: usize,
}

#[cfg(test)]
impl OnePayload {
    pub fn new(payload: &'static str, passes: usize) -> Self {
        OnePayload {
            payload,
            passes,
            recognized_at: 0,
        }
    }
}

#[cfg(test)]
impl Probe for OnePayload {
    fn payload_len(&mut self, text: &str) -> Option<usize> {
        let len = text.starts_with(self.payload).then_some(self.payload.len());
        self.recognized_at = if len.is_some() {
            text.as_ptr() as usize
        } else {
            0
        };
        len
    }

    fn pass(&mut self, text: &str) -> bool {
        let at = std::mem::take(&mut self.recognized_at);
        assert_eq!(
            text.as_ptr() as usize,
            at,
            "the text recognized, where it starts"
        );
        assert!(text.starts_with(self.payload));
        self.passes = self.passes.saturating_sub(1);
        self.passes > 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_checked_window_is_text_up_to_its_last_line_break() {
        let bytes = "ab\ncd é\nef".as_bytes();
        let w = Window::checked(bytes, 0);
        assert_eq!(w.text(0, 2), Some("ab"));
        assert_eq!(w.text(3, 9), Some("cd é\n"));
        // After the last line break: not checked.
        assert_eq!(w.text(10, 12), None);
        // From a later start, positions still count from the window's start.
        let w = Window::checked(bytes, 3);
        assert_eq!(w.text(0, 2), None);
        assert_eq!(w.text(3, 8), Some("cd é"));
    }

    #[test]
    fn a_bad_byte_ends_the_checked_part() {
        let bytes = b"ok\n\xFFno\n";
        let w = Window::checked(bytes, 0);
        assert_eq!(w.text(0, 3), Some("ok\n"));
        assert_eq!(w.text(3, 6), None);
        // A character cut by the window's end is after its last line break.
        let cut = &"a\né".as_bytes()[..3];
        assert_eq!(Window::checked(cut, 0).text(0, 2), Some("a\n"));
        assert_eq!(Window::raw(b"a\n").text(0, 1), None);
    }
}
