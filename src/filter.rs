//! `aalis-proxy annotate`: the pipeline between a reader and a writer.
//!
//! Reads whatever the input has (a pipe read returns as soon as bytes
//! arrive), pushes it through one [`Annotator`], and writes and flushes the
//! output after every read, so each event goes out as soon as it is
//! complete. Warnings go to the `warnings` writer (stderr), prefixed with
//! the program name. The clock is a parameter, so tests are deterministic.

use std::io::{self, Read, Write};

use crate::error::FilterError;
use crate::pipeline::{Annotator, AnnotatorConfig};
use crate::progress::{ProgressEntry, StreamPhase};
use crate::render::spinner::{Outcome, ProgressDisplay};

/// Read size: big enough for throughput, and a pipe read returns early
/// anyway when less is available.
const READ_BYTES: usize = 64 * 1024;

/// Runs the filter to the end of `input` (`input_name` says which, for
/// messages).
pub fn run(
    input: &mut dyn Read,
    input_name: &str,
    output: &mut dyn Write,
    warnings: &mut dyn Write,
    config: AnnotatorConfig,
    display: &ProgressDisplay,
    clock: &mut dyn FnMut() -> u64,
) -> Result<(), FilterError> {
    let mut annotator = Annotator::new(config);
    let mut spinners = Spinners::new(display);
    let mut buf = vec![0u8; READ_BYTES];
    let mut out = Vec::with_capacity(READ_BYTES);
    loop {
        let n = match input.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => {
                // Whatever came before the failure still goes out.
                annotator.finish(clock(), &mut out);
                let _ = emit(output, warnings, &mut annotator, &mut out);
                return Err(FilterError::Read {
                    input: input_name.to_owned(),
                    source: e,
                });
            }
        };
        let now = clock();
        annotator.push(&buf[..n], now, &mut out);
        emit(output, warnings, &mut annotator, &mut out)?;
        spinners.update(&annotator, now);
    }
    let now = clock();
    annotator.finish(now, &mut out);
    spinners.update(&annotator, now);
    emit(output, warnings, &mut annotator, &mut out)
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

/// Writes and flushes pending output, then pending warnings.
fn emit(
    output: &mut dyn Write,
    warnings: &mut dyn Write,
    annotator: &mut Annotator,
    out: &mut Vec<u8>,
) -> Result<(), FilterError> {
    if !out.is_empty() {
        output.write_all(out).map_err(FilterError::Write)?;
        output.flush().map_err(FilterError::Write)?;
        out.clear();
    }
    for warning in annotator.take_warnings() {
        // A closed stderr must not stop the stream.
        let _ = writeln!(warnings, "aalis-proxy: warning: {warning}");
    }
    Ok(())
}

/// Milliseconds since the Unix epoch, the clock `annotate` uses.
pub fn unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}
