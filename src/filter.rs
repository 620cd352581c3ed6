//! `aalis-proxy annotate`: the pipeline between a reader and a writer.
//!
//! Reads whatever the input has (a pipe read returns as soon as bytes
//! arrive) on a thread of its own, so the next read overlaps the work on
//! the last (`read_ahead`); pushes each piece through one [`Annotator`],
//! in order, and writes and flushes the output after every piece, so each
//! event goes out as soon as it is complete. Or replays a capture with its
//! recorded timing ([`Source::Replay`]), so spinners show real elapsed
//! times. Warnings go to the `warnings` writer (stderr), prefixed with the
//! program name. The clock is a parameter, so tests are deterministic.

use std::io::{self, Read, Write};
use std::ops::Range;
use std::os::fd::AsFd;
use std::time::Duration;

use crate::encode::splice::{Splice, SpliceSink};
use crate::error::FilterError;
use crate::pipeline::{Annotator, AnnotatorConfig};
use crate::progress::{EndedCall, ProgressEntry, StreamPhase};
use crate::render::spinner::{Outcome, ProgressDisplay};

/// Read size: a whole widened pipe ([`PIPE_BYTES`]) at once; a pipe read
/// returns early anyway when less is available.
const READ_BYTES: usize = PIPE_BYTES;

/// The capacity [`widen_pipe`] asks for: the most an unprivileged process
/// may set by default (`/proc/sys/fs/pipe-max-size`).
pub const PIPE_BYTES: usize = 1 << 20;

/// Widens the pipe the input comes from, if it is one, to [`PIPE_BYTES`]
/// (never narrows it). A pipe holds 64 KiB by default, so when the
/// pipeline falls behind its writer a read gets at most that much, and each
/// piece costs a hand-over between the reading thread and the pipeline
/// that wakes a thread on another CPU (a fifth of the pipeline's time on a
/// 200 MB capture). With a wider pipe, a read takes up to a megabyte of
/// what has piled up. A stream that arrives slowly is read as before, as
/// soon as bytes arrive. Failures are ignored: not a pipe, or a lower limit
/// on this system.
pub fn widen_pipe(input: impl AsFd) {
    if rustix::pipe::fcntl_getpipe_size(&input).is_ok_and(|size| size < PIPE_BYTES) {
        let _ = rustix::pipe::fcntl_setpipe_size(&input, PIPE_BYTES);
    }
}

/// Where the filter's input comes from.
pub enum Source<'a> {
    /// A reader, read as bytes arrive, on a thread of its own; if [`run`]
    /// fails before the end of the input (a write error), that thread ends
    /// at its next read, or with the process.
    Live(Box<dyn Read + Send>),
    /// A whole capture replayed piece by piece, each after its pause
    /// (`--realtime`; see [`crate::capture::schedule`]).
    Replay {
        bytes: &'a [u8],
        schedule: Vec<(Range<usize>, Duration)>,
    },
}

/// Runs the filter to the end of `source` (`input_name` says which input,
/// for messages).
#[allow(clippy::too_many_arguments)]
pub fn run(
    source: Source<'_>,
    input_name: &str,
    output: &mut dyn Write,
    warnings: &mut dyn Write,
    config: AnnotatorConfig,
    display: &ProgressDisplay,
    clock: &mut dyn FnMut() -> u64,
) -> Result<(), FilterError> {
    let mut annotator = Annotator::new(config);
    if !display.is_off() {
        annotator.tracker_mut().keep_ended();
    }
    let mut filter = Filter {
        annotator,
        spinners: Spinners::new(display),
        out: Splice::with_capacity(READ_BYTES),
        output,
        warnings,
    };
    match source {
        Source::Live(input) => {
            let read = read_ahead(input, |piece| filter.feed(piece, clock()));
            if let Err(stop) = read {
                if let Stop::Read(_) = stop {
                    // Whatever came before the failure still goes out; no
                    // done line says the stream ended well.
                    filter.annotator.input_failed();
                    let _ = filter.end(clock());
                }
                return Err(stop.into_error(input_name));
            }
        }
        Source::Replay { bytes, schedule } => {
            for (range, pause) in schedule {
                if !pause.is_zero() {
                    std::thread::sleep(pause);
                }
                filter.feed(&bytes[range], clock())?;
            }
        }
    }
    filter.end(clock())
}

/// Copies `input` to `output` the way [`run`] reads and writes (the
/// reading thread and its buffers, each piece written and flushed as it
/// comes), and parses nothing: the filter's I/O alone. `scripts/bench.sh`
/// measures it beside `annotate` (`loadgen copy`), to tell what the work
/// costs from what moving the bytes costs (BENCHMARKS.md).
pub fn copy(
    input: Box<dyn Read + Send>,
    input_name: &str,
    output: &mut dyn Write,
) -> Result<(), FilterError> {
    read_ahead(input, |piece| {
        output
            .write_all(piece)
            .and_then(|()| output.flush())
            .map_err(FilterError::Write)
    })
    .map_err(|stop| stop.into_error(input_name))
}

/// Why [`read_ahead`] stopped before the end of its input.
enum Stop {
    Read(io::Error),
    Filter(FilterError),
}

impl Stop {
    /// The error to report; a failed read names `input_name`.
    fn into_error(self, input_name: &str) -> FilterError {
        match self {
            Stop::Filter(e) => e,
            Stop::Read(source) => FilterError::Read {
                input: input_name.to_owned(),
                source,
            },
        }
    }
}

/// Buffers in flight between the reading thread and the pipeline: one being
/// filled, one being processed, one waiting.
const READ_AHEAD_BUFFERS: usize = 3;

/// Reads `input` on a thread of its own and hands each piece, in order, to
/// `process` on this one, so that the copy out of the kernel overlaps the
/// pipeline's work on the piece before (a tenth to a quarter more
/// throughput from a pipe). A piece is handed over as soon as a read
/// returns, whatever its size, so a live stream is not held back. If
/// `process` fails, this returns at once; the reading thread ends at its
/// next read, or with the process.
fn read_ahead(
    input: Box<dyn Read + Send>,
    mut process: impl FnMut(&[u8]) -> Result<(), FilterError>,
) -> Result<(), Stop> {
    use std::sync::mpsc::sync_channel;
    // Filled buffers go one way, emptied ones come back.
    let (full_tx, full_rx) = sync_channel::<io::Result<(Vec<u8>, usize)>>(READ_AHEAD_BUFFERS);
    let (empty_tx, empty_rx) = sync_channel::<Vec<u8>>(READ_AHEAD_BUFFERS);
    for _ in 0..READ_AHEAD_BUFFERS {
        let _ = empty_tx.send(vec![0u8; READ_BYTES]);
    }
    // The input goes to the thread once it runs, so that it is still here
    // to read if no thread can be had.
    let (input_tx, input_rx) = sync_channel::<Box<dyn Read + Send>>(1);
    let reader = std::thread::Builder::new()
        .name("read".to_owned())
        .spawn(move || {
            let Ok(mut input) = input_rx.recv() else {
                return;
            };
            while let Ok(mut buf) = empty_rx.recv() {
                let read = read_retrying(&mut *input, &mut buf);
                let last = !matches!(read, Ok(n) if n > 0);
                if full_tx.send(read.map(|n| (buf, n))).is_err() || last {
                    return;
                }
            }
        });
    if reader.is_err() {
        return read_inline(input, process);
    }
    if let Err(std::sync::mpsc::SendError(input)) = input_tx.send(input) {
        // Not in practice: the thread holds `input_rx` until it receives.
        return read_inline(input, process);
    }
    loop {
        match full_rx.recv() {
            Ok(Ok((_, 0))) => return Ok(()),
            Ok(Ok((buf, n))) => {
                process(&buf[..n]).map_err(Stop::Filter)?;
                let _ = empty_tx.send(buf);
            }
            Ok(Err(e)) => return Err(Stop::Read(e)),
            // The thread sends the end or an error before it stops; without
            // either, the input must not pass for complete.
            Err(_) => {
                return Err(Stop::Read(io::Error::other(
                    "the reading thread stopped before the end of the input",
                )));
            }
        }
    }
}

/// [`read_ahead`] without a thread: one piece at a time.
fn read_inline(
    mut input: Box<dyn Read + Send>,
    mut process: impl FnMut(&[u8]) -> Result<(), FilterError>,
) -> Result<(), Stop> {
    let mut buf = vec![0u8; READ_BYTES];
    loop {
        match read_retrying(&mut *input, &mut buf) {
            Ok(0) => return Ok(()),
            Ok(n) => process(&buf[..n]).map_err(Stop::Filter)?,
            Err(e) => return Err(Stop::Read(e)),
        }
    }
}

/// One read, again after an interruption by a signal, and after a
/// `WouldBlock` of a non-blocking input (see below).
pub fn read_retrying(input: &mut dyn Read, buf: &mut [u8]) -> io::Result<usize> {
    loop {
        match input.read(buf) {
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            // A stdin left non-blocking by the process that started this
            // one (its description is shared; a Node parent does this)
            // has nothing yet: that is no end. Looked at again every
            // millisecond, on this reading thread of its own.
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                std::thread::sleep(crate::stderr_log::WOULD_BLOCK_RETRY);
            }
            other => return other,
        }
    }
}

/// The pipeline with its output and spinners.
struct Filter<'a> {
    annotator: Annotator,
    spinners: Spinners<'a>,
    /// Output not yet written: runs of the piece, and what was added.
    out: Splice,
    output: &'a mut dyn Write,
    warnings: &'a mut dyn Write,
}

impl Filter<'_> {
    /// One piece of input: processed, written, flushed, drawn.
    fn feed(&mut self, piece: &[u8], now_ms: u64) -> Result<(), FilterError> {
        let mut sink = self.out.sink(piece);
        self.annotator.push(piece, now_ms, &mut sink);
        write_out(sink, self.output)?;
        self.warn();
        self.spinners.update(&mut self.annotator, now_ms);
        Ok(())
    }

    /// End of input.
    fn end(&mut self, now_ms: u64) -> Result<(), FilterError> {
        let mut sink = self.out.sink(&[]);
        self.annotator.finish(now_ms, &mut sink);
        self.spinners.update(&mut self.annotator, now_ms);
        write_out(sink, self.output)?;
        self.warn();
        Ok(())
    }

    /// Writes the pending warnings.
    fn warn(&mut self) {
        if !self.annotator.has_warnings() {
            return;
        }
        for warning in self.annotator.take_warnings() {
            // A closed stderr must not stop the stream.
            let _ = writeln!(self.warnings, "aalis-proxy: warning: {warning}");
        }
        // Each piece's warnings at once (above the spinners, the writer
        // holds them until told).
        let _ = self.warnings.flush();
    }
}

/// Writes and flushes the output of a piece, if it has any.
fn write_out(sink: SpliceSink<'_>, output: &mut dyn Write) -> Result<(), FilterError> {
    if sink.is_empty() {
        return Ok(());
    }
    sink.write_to(output)
        .and_then(|()| output.flush())
        .map_err(FilterError::Write)
}

/// Feeds the spinners when the tracker's state changed: first the calls
/// that ended since (each with its final count, a call that began and
/// ended within one read included), then the calls in progress.
struct Spinners<'d> {
    display: &'d ProgressDisplay,
    /// The tracker's change counter when last shown.
    shown: u64,
    entries: Vec<ProgressEntry>,
    ended: Vec<EndedCall>,
}

impl<'d> Spinners<'d> {
    fn new(display: &'d ProgressDisplay) -> Self {
        Spinners {
            display,
            shown: 0,
            entries: Vec::new(),
            ended: Vec::new(),
        }
    }

    fn update(&mut self, annotator: &mut Annotator, now_ms: u64) {
        if self.display.is_off() || annotator.tracker().changes() == self.shown {
            return;
        }
        annotator.tracker_mut().take_ended(&mut self.ended);
        for ended in &self.ended {
            let outcome = Outcome::from_failed(ended.failed);
            self.display.ended("", &ended.entry, outcome, now_ms);
        }
        let tracker = annotator.tracker();
        self.shown = tracker.changes();
        tracker.snapshot_into(&mut self.entries);
        let outcome = Outcome::from_failed(tracker.phase() == StreamPhase::Failed);
        self.display.show("", &self.entries, outcome, now_ms);
    }
}

/// Milliseconds since the Unix epoch, the clock `annotate` uses.
pub fn unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A reader that returns its pieces one per read, an interruption
    /// before each, then either the end or an error.
    struct Pieces {
        pieces: std::collections::VecDeque<Vec<u8>>,
        interrupt: bool,
        fail_at_end: bool,
        /// The reading thread is the one read on (not the caller's).
        on_reading_thread: bool,
    }

    impl Read for Pieces {
        fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
            if self.on_reading_thread {
                assert_eq!(std::thread::current().name(), Some("read"));
            }
            self.interrupt = !self.interrupt;
            if self.interrupt {
                return Err(io::ErrorKind::Interrupted.into());
            }
            match self.pieces.pop_front() {
                Some(piece) => {
                    buf[..piece.len()].copy_from_slice(&piece);
                    Ok(piece.len())
                }
                None if self.fail_at_end => Err(io::Error::other("the disk went away")),
                None => Ok(0),
            }
        }
    }

    fn fixture() -> Vec<u8> {
        std::fs::read(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/fixtures/openai/parallel_tool_calls.sse"
        ))
        .expect("read the fixture")
    }

    fn filter(input: Pieces) -> (Vec<u8>, Result<(), FilterError>) {
        let mut out = Vec::new();
        let mut warnings = Vec::new();
        let result = run(
            Source::Live(Box::new(input)),
            "stdin",
            &mut out,
            &mut warnings,
            AnnotatorConfig::default(),
            &ProgressDisplay::off(),
            &mut || 0,
        );
        (out, result)
    }

    fn pieces(bytes: &[u8], size: usize, fail_at_end: bool) -> Pieces {
        Pieces {
            pieces: bytes.chunks(size).map(<[u8]>::to_vec).collect(),
            interrupt: false,
            fail_at_end,
            on_reading_thread: true,
        }
    }

    /// A writer whose bytes the test keeps.
    #[derive(Clone, Default)]
    struct Shared(std::sync::Arc<std::sync::Mutex<Vec<u8>>>);

    impl Write for Shared {
        fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
            self.0
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .extend_from_slice(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> io::Result<()> {
            Ok(())
        }
    }

    /// The spinners' plain lines (`--progress=always`, stderr not a
    /// terminal) when the stream's calls go on and end within one read:
    /// every tool gets its final line with its last count, a tool that
    /// began and ended in that read too. The two calls' first deltas come
    /// in a read of their own; the rest, and text that ends the calls,
    /// in the next.
    #[test]
    fn each_tool_ends_with_its_last_count() {
        let calls = fixture();
        let events: Vec<&[u8]> = calls.split_inclusive(|&b| b == b'\n').collect();
        // Up to the first call's first arguments (events: role, its
        // announcement, its first fragment).
        let first: usize = events
            .iter()
            .scan(0, |blank_lines, line| {
                if *blank_lines == 3 {
                    return None;
                }
                *blank_lines += usize::from(*line == b"\n");
                Some(line.len())
            })
            .sum();
        let done_at = calls
            .windows(12)
            .position(|w| w == b"data: [DONE]")
            .expect("[DONE]");
        let mut input = calls[..done_at].to_vec();
        input.extend_from_slice(b"data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"ok\"}}]}\n\ndata: [DONE]\n\n");
        let lines = Shared::default();
        let display = ProgressDisplay::plain(Box::new(lines.clone()));
        let mut now = 0;
        run(
            Source::Replay {
                bytes: &input,
                schedule: vec![
                    (0..first, Duration::ZERO),
                    (first..input.len(), Duration::ZERO),
                ],
            },
            "stdin",
            &mut Vec::new(),
            &mut Vec::new(),
            AnnotatorConfig::default(),
            &display,
            &mut || {
                now += 1000;
                now
            },
        )
        .expect("the filter runs");
        let lines = String::from_utf8_lossy(&lines.0.lock().expect("lines")).into_owned();
        let finals: Vec<&str> = lines.lines().filter(|l| l.starts_with('✓')).collect();
        assert_eq!(
            finals,
            [
                "✓ get_weather  47 chars · 1.0s",
                "✓ get_local_time  26 chars · 0.0s"
            ],
            "{lines}"
        );
    }

    /// A stream that ends with neither `[DONE]` nor a finish ends its tools
    /// with `✗`, as its done line calls them incomplete, and so does one
    /// whose choice was cut (`length`) or that had a frame it could not
    /// read; one whose choice finished (`tool_calls`) before it just ended
    /// ends them with `✓`. Before, all ended with `✓`.
    #[test]
    fn a_stream_cut_short_ends_its_tools_with_a_cross() {
        let call = concat!(
            "data: {\"choices\":[{\"index\":0,\"delta\":{\"tool_calls\":[{\"index\":0,\"id\":\"c\",",
            "\"function\":{\"name\":\"get_weather\",\"arguments\":\"{\\\"ci\"}}]}}]}\n\n",
        );
        let finish =
            "data: {\"choices\":[{\"index\":0,\"delta\":{},\"finish_reason\":\"tool_calls\"}]}\n\n";
        let cut =
            "data: {\"choices\":[{\"index\":0,\"delta\":{},\"finish_reason\":\"length\"}]}\n\n";
        for (input, mark) in [
            (call.to_owned(), '✗'),
            (format!("{call}{finish}"), '✓'),
            (format!("{call}data: [DONE]\n\n"), '✓'),
            // Cut by its finish (`length`), with `[DONE]` or without: as
            // the done line says, incomplete either way.
            (format!("{call}{cut}data: [DONE]\n\n"), '✗'),
            (format!("{call}{cut}"), '✗'),
            // A frame that could not be read may have held a piece.
            (
                format!("{call}data: {{bad\n\n{finish}data: [DONE]\n\n"),
                '✗',
            ),
        ] {
            let lines = Shared::default();
            let display = ProgressDisplay::plain(Box::new(lines.clone()));
            run(
                Source::Replay {
                    bytes: input.as_bytes(),
                    schedule: vec![(0..input.len(), Duration::ZERO)],
                },
                "stdin",
                &mut Vec::new(),
                &mut Vec::new(),
                AnnotatorConfig::default(),
                &display,
                &mut || 1000,
            )
            .expect("the filter runs");
            let lines = String::from_utf8_lossy(&lines.0.lock().expect("lines")).into_owned();
            let last = lines.lines().last().unwrap_or_default();
            assert_eq!(
                last,
                format!("{mark} get_weather  4 chars · 0.0s"),
                "{input}"
            );
        }
    }

    /// Many small reads through the reading thread come out as one read of
    /// the whole input does: in order, nothing lost, interruptions retried.
    #[test]
    fn pieces_read_ahead_are_processed_in_order() {
        let input = fixture();
        let (whole, result) = filter(pieces(&input, input.len(), false));
        result.expect("the whole input at once");
        assert!(whole.windows(16).any(|w| w == b"toolCallProgress"));
        for size in [1, 7, 100] {
            let (out, result) = filter(pieces(&input, size, false));
            result.expect("the input in pieces");
            assert_eq!(
                String::from_utf8_lossy(&out),
                String::from_utf8_lossy(&whole),
                "pieces of {size} bytes"
            );
        }
    }

    /// A read that fails after some input: what came before it still goes
    /// out, even the unfinished event it cut, and the error names the input.
    #[test]
    fn a_failed_read_still_writes_what_came_before() {
        let input = fixture();
        let cut = &input[..input.len() - 5];
        let (out, result) = filter(pieces(cut, 100, true));
        let Err(FilterError::Read {
            input: name,
            source,
        }) = result
        else {
            panic!("expected a read error, got {result:?}");
        };
        assert_eq!(name, "stdin");
        assert_eq!(source.to_string(), "the disk went away");
        assert!(
            out.ends_with(b"\n\ndata: [DO"),
            "{:?}",
            String::from_utf8_lossy(&out)
        );
        let (ended, _) = filter(pieces(cut, cut.len(), false));
        assert_eq!(
            String::from_utf8_lossy(&out),
            String::from_utf8_lossy(&ended)
        );
    }

    /// The I/O alone: every byte out, in order, whatever the pieces; a
    /// failed read still writes what came before and names the input.
    #[test]
    fn copy_writes_what_it_reads() {
        let input = fixture();
        for size in [1, 7, input.len()] {
            let mut out = Vec::new();
            copy(Box::new(pieces(&input, size, false)), "stdin", &mut out).expect("copied");
            assert!(out == input, "pieces of {size} bytes");
        }
        let mut out = Vec::new();
        let result = copy(Box::new(pieces(&input, 100, true)), "capture.sse", &mut out);
        assert!(
            matches!(&result, Err(FilterError::Read { input, .. }) if input == "capture.sse"),
            "{result:?}"
        );
        assert!(out == input);
    }

    /// Without a thread, the same pieces in the same order, and the same
    /// end.
    #[test]
    fn the_inline_reader_reads_the_same_pieces() {
        let input = fixture();
        let mut read = Vec::new();
        let source = Pieces {
            on_reading_thread: false,
            ..pieces(&input, 7, true)
        };
        let result = read_inline(Box::new(source), |piece| {
            read.extend_from_slice(piece);
            Ok(())
        });
        assert!(matches!(result, Err(Stop::Read(e)) if e.to_string() == "the disk went away"));
        assert_eq!(read, input);
    }

    /// A reader that returns one piece, then waits for input that never
    /// comes (until the test ends).
    struct Stalls {
        first: Option<Vec<u8>>,
        never: std::sync::mpsc::Receiver<()>,
    }

    impl Read for Stalls {
        fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
            if let Some(first) = self.first.take() {
                buf[..first.len()].copy_from_slice(&first);
                return Ok(first.len());
            }
            let _ = self.never.recv();
            Ok(0)
        }
    }

    /// An output whose reader is gone.
    struct Closed;

    impl Write for Closed {
        fn write(&mut self, _: &[u8]) -> io::Result<usize> {
            Err(io::ErrorKind::BrokenPipe.into())
        }
        fn flush(&mut self) -> io::Result<()> {
            Ok(())
        }
    }

    /// A write that fails ends the filter at once, though the reading
    /// thread is blocked on an input that stays open.
    #[test]
    fn a_failed_write_returns_while_the_input_stays_open() {
        let input = fixture();
        let (keep_open, never) = std::sync::mpsc::channel::<()>();
        let (done_tx, done_rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let result = run(
                Source::Live(Box::new(Stalls {
                    first: Some(input),
                    never,
                })),
                "stdin",
                &mut Closed,
                &mut Vec::new(),
                AnnotatorConfig::default(),
                &ProgressDisplay::off(),
                &mut || 0,
            );
            let _ = done_tx.send(result.map_err(|e| e.is_broken_pipe()));
        });
        let result = done_rx
            .recv_timeout(std::time::Duration::from_secs(10))
            .expect("the filter returns while its input is still open");
        assert_eq!(result, Err(true), "a broken pipe");
        drop(keep_open);
    }
}
