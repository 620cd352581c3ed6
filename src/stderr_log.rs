//! The log of `serve` and `mock`: `tracing` lines written to stderr by a
//! thread of their own, so that a stderr nobody reads never stalls a stream.
//!
//! A write to a pipe whose reader has stopped reading (`serve 2>&1 | cmd`
//! with `cmd` stuck, a terminal paused with Ctrl-S) blocks once the pipe
//! is full, about 64 KiB on Linux. When the request's log line was written
//! on the worker thread that had just ended the stream, that write blocked
//! the worker, and every stream on it stopped: after about 340 requests the
//! proxy answered nothing more. Here the workers only format the line and
//! hand it to a bounded queue ([`QUEUE_LINES`] lines); the writer thread
//! does the blocking write. When the queue is full the line is dropped and
//! counted, never waited for ([`StderrLog::dropped_lines`]), and the count
//! is logged ([`StderrLog::report_dropped`]: `serve` checks every
//! [`DROP_REPORT_INTERVAL`], and once more at exit).
//!
//! `serve --progress=always` with a stderr that is not a terminal writes its
//! plain lines through the same queue ([`StderrLog::line_writer`]), in order
//! with the log lines.
//!
//! What it does not do: the `annotate` filter writes its warnings to stderr
//! itself, in order with its output, and waits for a slow reader like any
//! Unix filter; spinners on a terminal are drawn by indicatif, on stderr
//! directly.
//!
//! Read [`StderrLog`] first.

use std::io::{self, Write};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{self, Receiver, SyncSender, TrySendError};
use std::thread;
use std::time::Duration;

use tracing_subscriber::fmt::MakeWriter;

/// Lines the queue holds while the writer waits on stderr: a burst of
/// streams ending at once, on a terminal that scrolls slowly, fits.
pub const QUEUE_LINES: usize = 1024;

/// How often `serve` checks for dropped lines to report.
pub const DROP_REPORT_INTERVAL: Duration = Duration::from_secs(10);

/// How long the end of the process waits for the queued lines to be
/// written.
pub const FLUSH_TIMEOUT: Duration = Duration::from_secs(1);

/// What the writer thread is sent.
enum Message {
    /// One whole log line (or several, if one event wrote several).
    Line(Vec<u8>),
    /// Answer on this channel once everything before is written.
    Flush(SyncSender<()>),
}

/// A queue of log lines and the thread that writes them: the
/// [`MakeWriter`] of the `tracing` subscriber. Clones share the queue.
#[derive(Clone)]
pub struct StderrLog {
    queue: SyncSender<Message>,
    dropped: Arc<AtomicUsize>,
    /// How many of the dropped lines [`StderrLog::report_dropped`] told of.
    reported: Arc<AtomicUsize>,
}

impl StderrLog {
    /// A writer thread for `out` (stderr, or a test's writer) with a queue
    /// of `lines` lines.
    pub fn spawn<W: Write + Send + 'static>(out: W, lines: usize) -> io::Result<StderrLog> {
        let (queue, received) = mpsc::sync_channel(lines);
        thread::Builder::new()
            .name("aalis-log".to_owned())
            .spawn(move || write_lines(out, received))?;
        Ok(StderrLog {
            queue,
            dropped: Arc::new(AtomicUsize::new(0)),
            reported: Arc::new(AtomicUsize::new(0)),
        })
    }

    /// Lines dropped so far because the queue was full (or the writer
    /// thread had gone).
    pub fn dropped_lines(&self) -> usize {
        self.dropped.load(Ordering::Relaxed)
    }

    /// A writer of whole lines into the queue: each line is queued once its
    /// line break is written (`--progress=always` lines in `serve`).
    pub fn line_writer(&self) -> QueuedLines {
        QueuedLines {
            log: self.clone(),
            partial: Vec::new(),
        }
    }

    /// Logs a warning with the number of lines dropped since the last
    /// report, if any. The warning goes through the queue too: if it does
    /// not fit either, it is counted, and the next report includes it.
    pub fn report_dropped(&self) {
        let dropped = self.dropped_lines();
        let before = self.reported.swap(dropped, Ordering::Relaxed);
        if dropped > before {
            tracing::warn!(
                "{} log lines were dropped: stderr was not being read",
                dropped - before
            );
        }
    }

    /// Queues `line` without waiting; a full queue drops and counts it.
    fn send(&self, line: Vec<u8>) {
        match self.queue.try_send(Message::Line(line)) {
            Ok(()) => {}
            Err(TrySendError::Full(_) | TrySendError::Disconnected(_)) => {
                self.dropped.fetch_add(1, Ordering::Relaxed);
            }
        }
    }

    /// Waits up to `timeout` for the lines queued so far to be written;
    /// false if they were not (stderr still does not take them, or the
    /// queue is full). Never blocks longer than `timeout`.
    pub fn flush(&self, timeout: Duration) -> bool {
        let (done, written) = mpsc::sync_channel(1);
        if self.queue.try_send(Message::Flush(done)).is_err() {
            return false;
        }
        written.recv_timeout(timeout).is_ok()
    }
}

impl std::fmt::Debug for StderrLog {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StderrLog")
            .field("dropped", &self.dropped_lines())
            .finish_non_exhaustive()
    }
}

/// The writer thread: every line in order, each with one `write_all`.
/// A write error (stderr closed) leaves the lines unwritten, as an
/// `eprintln!` that cannot write would, without stopping the queue.
fn write_lines<W: Write>(mut out: W, received: Receiver<Message>) {
    for message in received {
        match message {
            Message::Line(line) => {
                let _ = out.write_all(&line);
            }
            Message::Flush(done) => {
                let _ = out.flush();
                let _ = done.try_send(());
            }
        }
    }
}

/// One event's output, gathered and queued as one line when dropped
/// (`tracing-subscriber` writes a whole event, then drops the writer).
pub struct LineWriter<'a> {
    log: &'a StderrLog,
    line: Vec<u8>,
}

impl Write for LineWriter<'_> {
    fn write(&mut self, bytes: &[u8]) -> io::Result<usize> {
        self.line.extend_from_slice(bytes);
        Ok(bytes.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

impl Drop for LineWriter<'_> {
    fn drop(&mut self) {
        if !self.line.is_empty() {
            self.log.send(std::mem::take(&mut self.line));
        }
    }
}

/// See [`StderrLog::line_writer`]. What follows the last line break waits
/// for the next write.
pub struct QueuedLines {
    log: StderrLog,
    partial: Vec<u8>,
}

impl Write for QueuedLines {
    fn write(&mut self, bytes: &[u8]) -> io::Result<usize> {
        self.partial.extend_from_slice(bytes);
        if let Some(last_break) = memchr::memrchr(b'\n', &self.partial) {
            let rest = self.partial.split_off(last_break + 1);
            self.log.send(std::mem::replace(&mut self.partial, rest));
        }
        Ok(bytes.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

impl<'a> MakeWriter<'a> for StderrLog {
    type Writer = LineWriter<'a>;

    fn make_writer(&'a self) -> LineWriter<'a> {
        LineWriter {
            log: self,
            line: Vec::new(),
        }
    }
}

/// Installs the `tracing` subscriber of `serve` and `mock`: info by
/// default, more with -v, or as RUST_LOG says; colored on a terminal unless
/// NO_COLOR is set. Without a writer thread (the system refused one) the
/// lines are written to stderr directly, as before this module.
pub fn init(verbose: u8) -> Option<StderrLog> {
    use std::io::IsTerminal;
    use tracing_subscriber::EnvFilter;
    let default = match verbose {
        0 => "info",
        1 => "debug",
        _ => "trace",
    };
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(default));
    let color = io::stderr().is_terminal() && std::env::var_os("NO_COLOR").is_none();
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(color)
        .with_target(false);
    match StderrLog::spawn(io::stderr(), QUEUE_LINES) {
        Ok(log) => {
            builder.with_writer(log.clone()).init();
            Some(log)
        }
        Err(err) => {
            builder.with_writer(io::stderr).init();
            tracing::warn!("cannot start the log thread, logging on the workers: {err}");
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;

    /// A writer that takes nothing until `open` is sent, as a pipe whose
    /// reader has stopped, then keeps what it is given.
    struct Stuck {
        open: Receiver<()>,
        opened: bool,
        got: Arc<Mutex<Vec<u8>>>,
    }

    impl Write for Stuck {
        fn write(&mut self, bytes: &[u8]) -> io::Result<usize> {
            if !self.opened {
                self.open
                    .recv()
                    .map_err(|_| io::Error::from(io::ErrorKind::BrokenPipe))?;
                self.opened = true;
            }
            self.got.lock().expect("lock").extend_from_slice(bytes);
            Ok(bytes.len())
        }

        fn flush(&mut self) -> io::Result<()> {
            Ok(())
        }
    }

    /// Flushes, retrying while the queue is still full (bounded).
    fn flushed(log: &StderrLog) -> bool {
        (0..1000).any(|_| {
            log.flush(Duration::from_millis(10)) || {
                thread::sleep(Duration::from_millis(10));
                false
            }
        })
    }

    fn line(log: &StderrLog, text: &str) {
        let mut writer = log.make_writer();
        writer.write_all(text.as_bytes()).expect("to memory");
    }

    #[test]
    fn a_stuck_writer_never_blocks_the_caller_and_every_line_is_written_or_counted() {
        let (open, opened) = mpsc::channel();
        let got = Arc::new(Mutex::new(Vec::new()));
        let stuck = Stuck {
            open: opened,
            opened: false,
            got: Arc::clone(&got),
        };
        let log = StderrLog::spawn(stuck, 4).expect("spawn");
        // The writer thread takes the first line and waits in it; the
        // queue holds four more; the rest are dropped. None of this waits:
        // a blocked caller would hang the test here.
        for i in 0..20 {
            line(&log, &format!("line {i}\n"));
        }
        assert!(!log.flush(Duration::from_millis(50)), "stderr is stuck");
        // Four queued, and a fifth if the thread took the first before the
        // queue filled.
        let dropped = log.dropped_lines();
        assert!((15..=16).contains(&dropped), "{dropped} dropped");
        open.send(()).expect("open");
        assert!(flushed(&log), "written once stderr takes them");
        let got = String::from_utf8(got.lock().expect("lock").clone()).expect("utf-8");
        let lines: Vec<&str> = got.lines().collect();
        assert_eq!(lines.len() + dropped, 20, "{got}");
        // What was written is whole lines, in order, from the first.
        let expected: Vec<String> = (0..lines.len()).map(|i| format!("line {i}")).collect();
        assert_eq!(lines, expected);
    }

    #[test]
    fn queued_lines_go_whole_whatever_the_writes() {
        let got = Arc::new(Mutex::new(Vec::new()));
        let (open, opened) = mpsc::channel();
        open.send(()).expect("open");
        let writer = Stuck {
            open: opened,
            opened: false,
            got: Arc::clone(&got),
        };
        let log = StderrLog::spawn(writer, 4).expect("spawn");
        let mut lines = log.line_writer();
        for piece in ["one", " line\ntwo", "\n", "three\nfour\nfi", "ve"] {
            lines.write_all(piece.as_bytes()).expect("to memory");
        }
        assert!(flushed(&log));
        assert_eq!(*got.lock().expect("lock"), b"one line\ntwo\nthree\nfour\n");
        lines.write_all(b"\n").expect("to memory");
        assert!(flushed(&log));
        assert_eq!(
            *got.lock().expect("lock"),
            b"one line\ntwo\nthree\nfour\nfive\n"
        );
    }

    #[test]
    fn a_report_says_how_many_lines_were_dropped_since_the_last() {
        let got = Arc::new(Mutex::new(Vec::new()));
        let (open, opened) = mpsc::channel();
        open.send(()).expect("open");
        let writer = Stuck {
            open: opened,
            opened: false,
            got: Arc::clone(&got),
        };
        let log = StderrLog::spawn(writer, 4).expect("spawn");
        let subscriber = tracing_subscriber::fmt()
            .with_writer(log.clone())
            .with_ansi(false)
            .finish();
        tracing::subscriber::with_default(subscriber, || {
            log.report_dropped(); // none: no line
            log.dropped.store(3, Ordering::Relaxed);
            log.report_dropped(); // "3"
            log.report_dropped(); // none new: no line
            log.dropped.store(7, Ordering::Relaxed);
            log.report_dropped(); // "4"
        });
        assert!(flushed(&log));
        let got = String::from_utf8(got.lock().expect("lock").clone()).expect("utf-8");
        let lines: Vec<&str> = got.lines().collect();
        assert_eq!(lines.len(), 2, "{got}");
        for (line, n) in lines.iter().zip([3, 4]) {
            assert!(line.contains(" WARN "), "{line}");
            assert!(
                line.ends_with(&format!(
                    " {n} log lines were dropped: stderr was not being read"
                )),
                "{line}"
            );
        }
    }
}
