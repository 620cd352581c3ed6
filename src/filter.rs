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
    clock: &mut dyn FnMut() -> u64,
) -> Result<(), FilterError> {
    let mut annotator = Annotator::new(config);
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
        annotator.push(&buf[..n], clock(), &mut out);
        emit(output, warnings, &mut annotator, &mut out)?;
    }
    annotator.finish(clock(), &mut out);
    emit(output, warnings, &mut annotator, &mut out)
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
