//! `serve --record DIR`: every streamed upstream response, saved as a
//! capture `annotate` and `mock` replay (see [`crate::capture`]).
//!
//! For each stream three files, named `<unix ms>-<session>-<n>` so they
//! sort by time and never collide:
//! - `.sse` or `.ndjson`: the upstream body, byte for byte, as it came
//!   (before any injection);
//! - the same name plus `.timing`: when each piece arrived;
//! - `.request.json`: the request body. Headers are not recorded, so no
//!   `Authorization`, key or cookie is ever written.
//!
//! The session id comes from a request header: it is reduced to a safe file
//! name part ([`crate::capture::safe_file_part`]) so it cannot escape `DIR`
//! or name a hidden file. Writes are buffered; they are small and local, so
//! they are done in place rather than on a thread of their own.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use crate::capture::{Timing, safe_file_part};
use crate::filter::unix_ms;
use crate::framing::Framing;

/// Where recordings go; shared by every stream of the proxy.
#[derive(Debug)]
pub struct Recorder {
    dir: PathBuf,
    counter: AtomicU64,
}

/// One stream being recorded; finished when dropped.
#[derive(Debug)]
pub struct Recording {
    body: BufWriter<File>,
    timing_path: PathBuf,
    timing: Timing,
    started: Instant,
    bytes: u64,
}

impl Recorder {
    /// Records into `dir`, which must exist (the CLI creates it at start,
    /// so a bad directory fails before the port is taken).
    pub fn new(dir: &Path) -> Recorder {
        Recorder {
            dir: dir.to_owned(),
            counter: AtomicU64::new(0),
        }
    }

    /// Starts recording a stream of `session` whose request body was
    /// `request_body`.
    pub fn start(
        &self,
        session: &str,
        framing: Framing,
        request_body: &[u8],
    ) -> std::io::Result<Recording> {
        let n = self.counter.fetch_add(1, Ordering::Relaxed);
        let stem = format!("{}-{}-{n}", unix_ms(), safe_file_part(session));
        let extension = match framing {
            Framing::Sse => "sse",
            Framing::Ndjson => "ndjson",
        };
        let body_path = self.dir.join(format!("{stem}.{extension}"));
        std::fs::write(self.dir.join(format!("{stem}.request.json")), request_body)?;
        let body = BufWriter::new(File::create(&body_path)?);
        Ok(Recording {
            body,
            timing_path: Timing::sidecar(&body_path),
            timing: Timing::default(),
            started: Instant::now(),
            bytes: 0,
        })
    }
}

impl Recording {
    /// A piece of the upstream body, as it arrived.
    pub fn data(&mut self, bytes: &[u8]) {
        if bytes.is_empty() {
            return;
        }
        if let Err(err) = self.body.write_all(bytes) {
            tracing::warn!("recording stopped writing: {err}");
        }
        self.bytes += bytes.len() as u64;
        let ms = u64::try_from(self.started.elapsed().as_millis()).unwrap_or(u64::MAX);
        self.timing.marks.push((self.bytes, ms));
    }
}

impl Drop for Recording {
    fn drop(&mut self) {
        let flushed = self.body.flush();
        let timing = std::fs::write(&self.timing_path, self.timing.render());
        if let Err(err) = flushed.and(timing) {
            tracing::warn!(
                "cannot finish the recording {}: {err}",
                self.timing_path.display()
            );
        }
    }
}
