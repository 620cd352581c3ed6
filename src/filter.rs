//! `aalis-proxy annotate`: the pipeline between a reader and a writer.
//!
//! Reads whatever the input has (a pipe read returns as soon as bytes
//! arrive), pushes it through one [`Annotator`], and writes and flushes the
//! output after every read, so each event goes out as soon as it is
//! complete; or replays a capture with its recorded timing
//! ([`Source::Replay`]), so spinners show real elapsed times. Warnings go to the `warnings` writer (stderr), prefixed with
//! the program name. The clock is a parameter, so tests are deterministic.

use std::io::{self, Read, Write};
use std::ops::Range;
use std::time::Duration;

use crate::error::FilterError;
use crate::pipeline::{Annotator, AnnotatorConfig};
use crate::progress::{ProgressEntry, StreamPhase};
use crate::render::spinner::{Outcome, ProgressDisplay};

/// Read size: big enough for throughput, and a pipe read returns early
/// anyway when less is available.
const READ_BYTES: usize = 64 * 1024;

/// Where the filter's input comes from.
pub enum Source<'a> {
    /// A reader, read as bytes arrive.
    Live(&'a mut dyn Read),
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
    let mut filter = Filter {
        annotator: Annotator::new(config),
        spinners: Spinners::new(display),
        out: Vec::with_capacity(READ_BYTES),
        output,
        warnings,
    };
    match source {
        Source::Live(input) => {
            let mut buf = vec![0u8; READ_BYTES];
            loop {
                let n = match input.read(&mut buf) {
                    Ok(0) => break,
                    Ok(n) => n,
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                    Err(e) => {
                        // Whatever came before the failure still goes out.
                        let _ = filter.end(clock());
                        return Err(FilterError::Read {
                            input: input_name.to_owned(),
                            source: e,
                        });
                    }
                };
                filter.feed(&buf[..n], clock())?;
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

/// The pipeline with its output and spinners.
struct Filter<'a> {
    annotator: Annotator,
    spinners: Spinners<'a>,
    /// Output not yet written.
    out: Vec<u8>,
    output: &'a mut dyn Write,
    warnings: &'a mut dyn Write,
}

impl Filter<'_> {
    /// One piece of input: processed, written, flushed, drawn.
    fn feed(&mut self, piece: &[u8], now_ms: u64) -> Result<(), FilterError> {
        self.annotator.push(piece, now_ms, &mut self.out);
        self.emit()?;
        self.spinners.update(&self.annotator, now_ms);
        Ok(())
    }

    /// End of input.
    fn end(&mut self, now_ms: u64) -> Result<(), FilterError> {
        self.annotator.finish(now_ms, &mut self.out);
        self.spinners.update(&self.annotator, now_ms);
        self.emit()
    }

    /// Writes and flushes pending output, then pending warnings.
    fn emit(&mut self) -> Result<(), FilterError> {
        if !self.out.is_empty() {
            self.output
                .write_all(&self.out)
                .map_err(FilterError::Write)?;
            self.output.flush().map_err(FilterError::Write)?;
            self.out.clear();
        }
        for warning in self.annotator.take_warnings() {
            // A closed stderr must not stop the stream.
            let _ = writeln!(self.warnings, "aalis-proxy: warning: {warning}");
        }
        Ok(())
    }
}

/// Feeds the spinners when the tracker's state changed.
struct Spinners<'d> {
    display: &'d ProgressDisplay,
    /// The tracker's change counter when last shown.
    shown: u64,
    entries: Vec<ProgressEntry>,
}

impl<'d> Spinners<'d> {
    fn new(display: &'d ProgressDisplay) -> Self {
        Spinners {
            display,
            shown: 0,
            entries: Vec::new(),
        }
    }

    fn update(&mut self, annotator: &Annotator, now_ms: u64) {
        let tracker = annotator.tracker();
        if self.display.is_off() || tracker.changes() == self.shown {
            return;
        }
        self.shown = tracker.changes();
        tracker.snapshot_into(&mut self.entries);
        let outcome = match tracker.phase() {
            StreamPhase::Failed => Outcome::Failed,
            StreamPhase::Waiting
            | StreamPhase::Reasoning
            | StreamPhase::Answering
            | StreamPhase::CallingTools
            | StreamPhase::Done => Outcome::Done,
        };
        self.display.show("", &self.entries, outcome, now_ms);
    }
}

/// Milliseconds since the Unix epoch, the clock `annotate` uses.
pub fn unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}
