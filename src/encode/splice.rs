//! Output that refers to its input instead of copying it.
//!
//! Most of what `annotate` writes is its input, forwarded unchanged: with
//! `--inject none` all of it. Framing in place ([`crate::framing::window`])
//! hands the pipeline frames that are slices of the piece just read, so the
//! output of a piece can be written as runs of that piece with what the
//! pipeline added in between, in one vectored write, without copying the
//! runs. [`Splice`] keeps that list; its [`Sink`] ([`SpliceSink`]) notes a
//! forwarded slice of the piece as a run, and copies anything else (added
//! bytes, bytes of a frame carried over from an earlier piece, short runs
//! between additions, which cost less to copy than to write as a part of
//! their own).

use std::io::{self, IoSlice, Write};
use std::ops::Range;

use super::Sink;

/// A run of the piece shorter than this is copied when an addition follows
/// it, so the parts of a write stay few (an event with injected progress
/// is a short run, an addition and a shorter run).
const MIN_RUN: usize = 4096;

/// One part of the output, in order.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Part {
    /// Bytes of the piece.
    Input(Range<usize>),
    /// Bytes of [`Splice::owned`].
    Owned(Range<usize>),
}

/// The output of one piece of input, not yet written.
#[derive(Debug, Default)]
pub struct Splice {
    owned: Vec<u8>,
    parts: Vec<Part>,
}

/// The [`Sink`] for the output of one piece.
pub struct SpliceSink<'a> {
    input: &'a [u8],
    splice: &'a mut Splice,
}

impl Splice {
    /// With room for `bytes` of copied output.
    pub fn with_capacity(bytes: usize) -> Splice {
        Splice {
            owned: Vec::with_capacity(bytes),
            parts: Vec::new(),
        }
    }

    /// A sink for the output of `input`, to write with
    /// [`SpliceSink::write_to`].
    pub fn sink<'a>(&'a mut self, input: &'a [u8]) -> SpliceSink<'a> {
        SpliceSink {
            input,
            splice: self,
        }
    }
}

impl SpliceSink<'_> {
    /// Nothing to write.
    pub fn is_empty(&self) -> bool {
        self.splice.parts.is_empty()
    }

    /// Writes the output, in order, to `out` (vectored: one write for the
    /// whole piece when `out` takes it), and empties the splice for the
    /// next piece.
    pub fn write_to(self, out: &mut dyn Write) -> io::Result<()> {
        let Splice { owned, parts } = self.splice;
        let input = self.input;
        let result = parts
            .iter()
            .map(|part| match part {
                Part::Input(range) => input.get(range.clone()).map(IoSlice::new),
                Part::Owned(range) => owned.get(range.clone()).map(IoSlice::new),
            })
            .collect::<Option<Vec<_>>>()
            .ok_or_else(|| io::Error::other("output refers past its input"))
            .and_then(|mut slices| write_all_vectored(out, &mut slices));
        owned.clear();
        parts.clear();
        result
    }
}

/// `Write::write_all_vectored`, which is not stable yet.
fn write_all_vectored(out: &mut dyn Write, mut slices: &mut [IoSlice<'_>]) -> io::Result<()> {
    IoSlice::advance_slices(&mut slices, 0);
    while !slices.is_empty() {
        match out.write_vectored(slices) {
            Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
            Ok(n) => IoSlice::advance_slices(&mut slices, n),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            // A stdout left non-blocking by the process that started this
            // one, full: waited for, as a blocking one would be.
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                std::thread::sleep(crate::stderr_log::WOULD_BLOCK_RETRY);
            }
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Where `inner` starts in `outer`, if it lies wholly inside it (the same
/// memory: its bytes are those of `outer` there).
fn offset_in(outer: &[u8], inner: &[u8]) -> Option<usize> {
    let at = (inner.as_ptr() as usize).checked_sub(outer.as_ptr() as usize)?;
    (at <= outer.len() && inner.len() <= outer.len() - at).then_some(at)
}

impl SpliceSink<'_> {
    /// Copies `bytes` into the owned output.
    fn copy(&mut self, bytes: &[u8]) {
        let splice = &mut *self.splice;
        // A short run of the piece before an addition is copied too.
        if let Some(Part::Input(run)) = splice.parts.last()
            && run.len() < MIN_RUN
        {
            let run = run.clone();
            splice.parts.pop();
            copy_into(splice, &self.input[run]);
        }
        copy_into(splice, bytes);
    }
}

/// Appends `bytes` to the owned output, as part of the last part if that
/// is owned.
fn copy_into(splice: &mut Splice, bytes: &[u8]) {
    let start = splice.owned.len();
    splice.owned.extend_from_slice(bytes);
    let end = splice.owned.len();
    match splice.parts.last_mut() {
        Some(Part::Owned(last)) if last.end == start => last.end = end,
        _ => splice.parts.push(Part::Owned(start..end)),
    }
}

impl Sink for SpliceSink<'_> {
    fn forward(&mut self, bytes: &[u8]) {
        if bytes.is_empty() {
            return;
        }
        let Some(at) = offset_in(self.input, bytes) else {
            self.copy(bytes);
            return;
        };
        let run = at..at + bytes.len();
        match self.splice.parts.last_mut() {
            Some(Part::Input(last)) if last.end == run.start => last.end = run.end,
            _ => self.splice.parts.push(Part::Input(run)),
        }
    }

    fn insert(&mut self, bytes: &[u8]) {
        if !bytes.is_empty() {
            self.copy(bytes);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A writer that takes at most `max` bytes per call, vectored or not,
    /// and counts its calls.
    struct Trickle {
        written: Vec<u8>,
        max: usize,
        calls: usize,
    }

    impl Write for Trickle {
        fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
            self.calls += 1;
            let n = buf.len().min(self.max);
            self.written.extend_from_slice(&buf[..n]);
            Ok(n)
        }
        fn write_vectored(&mut self, bufs: &[IoSlice<'_>]) -> io::Result<usize> {
            self.calls += 1;
            let mut n = 0;
            for buf in bufs {
                let take = buf.len().min(self.max - n);
                self.written.extend_from_slice(&buf[..take]);
                n += take;
                if n == self.max {
                    break;
                }
            }
            Ok(n)
        }
        fn flush(&mut self) -> io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn runs_of_the_input_are_referenced_and_everything_comes_out_in_order() {
        let input = vec![b'x'; 3 * MIN_RUN];
        let carried = b"from an earlier piece ".to_vec();
        let mut splice = Splice::default();
        let mut sink = splice.sink(&input);
        sink.forward(&carried);
        sink.forward(&input[..MIN_RUN]);
        sink.forward(&input[MIN_RUN..2 * MIN_RUN]);
        sink.insert(b"<added>");
        sink.forward(&input[2 * MIN_RUN..2 * MIN_RUN + 10]);
        sink.insert(b"<more>");
        sink.forward(&input[2 * MIN_RUN + 10..]);
        assert_eq!(
            sink.splice.parts,
            [
                Part::Owned(0..22),
                Part::Input(0..2 * MIN_RUN),
                // The short run between two additions is copied with them.
                Part::Owned(22..22 + 7 + 10 + 6),
                Part::Input(2 * MIN_RUN + 10..3 * MIN_RUN),
            ]
        );
        let mut want = carried.clone();
        want.extend_from_slice(&input[..2 * MIN_RUN]);
        want.extend_from_slice(b"<added>");
        want.extend_from_slice(&input[2 * MIN_RUN..2 * MIN_RUN + 10]);
        want.extend_from_slice(b"<more>");
        want.extend_from_slice(&input[2 * MIN_RUN + 10..]);

        // A writer that takes a few bytes at a time gets it all, in order.
        let mut out = Trickle {
            written: Vec::new(),
            max: 1000,
            calls: 0,
        };
        sink.write_to(&mut out).expect("write");
        assert_eq!(out.written, want);
        assert!(splice.sink(&input).is_empty());

        // One that takes everything gets it in one call.
        let mut splice_again = Splice::default();
        let mut sink = splice_again.sink(&input);
        sink.forward(&input);
        sink.insert(b"end");
        let mut out = Trickle {
            written: Vec::new(),
            max: usize::MAX,
            calls: 0,
        };
        sink.write_to(&mut out).expect("write");
        assert_eq!(out.calls, 1);
        assert_eq!(out.written.len(), input.len() + 3);
    }

    #[test]
    fn a_slice_of_other_memory_is_copied() {
        let input = b"abc".to_vec();
        let other = b"abc".to_vec();
        assert_eq!(offset_in(&input, &input[1..]), Some(1));
        assert_eq!(offset_in(&input, &input[3..]), Some(3));
        assert_eq!(offset_in(&input, &other), None);
        assert_eq!(offset_in(&input[1..], &input[..2]), None);
        assert_eq!(offset_in(&input[..2], &input[1..]), None);
    }
}
