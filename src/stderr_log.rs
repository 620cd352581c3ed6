//! The log of `serve` and `mock`: `tracing` lines written to stderr by a
//! thread of their own, so that a stderr nobody reads never stalls a stream.
//!
//! A write to a pipe whose reader has stopped reading (`serve 2>&1 | cmd`
//! with `cmd` stuck, a terminal paused with Ctrl-S) blocks once the pipe
//! is full, about 64 KiB on Linux. When the request's log line was written
//! on the worker thread that had just ended the stream, that write blocked
//! the worker, and every stream on it stopped: after about 350 requests the
//! proxy answered nothing more. Here the workers only format the line and
//! hand it to a bounded queue ([`QUEUE_LINES`] lines, [`QUEUE_BYTES`]
//! bytes); the writer thread does the blocking write. When the queue is
//! full the line is dropped and counted, never waited for
//! ([`StderrLog::dropped_lines`]), and the count is logged
//! ([`StderrLog::report_dropped`]: `serve` checks every
//! [`DROP_REPORT_INTERVAL`], and once more at exit).
//!
//! The writer does not wait on the queue after every line: once it has
//! written what was queued, it looks again after [`LINGER`], and waits on
//! the queue only when that look finds nothing. A line queued in between
//! costs its sender no wake-up of the writer (a `futex` call, and a switch
//! to the writer's thread on a CPU a worker needs): a burst of streams
//! ending together wakes it once, not once a line (BENCHMARKS.md,
//! forty-fourth round). A queue half full wakes it at once, so lingering
//! drops no line that waking would have kept. The lines it finds queued
//! go out together, with one write.
//!
//! `serve --progress=always` with a stderr that is not a terminal writes its
//! plain lines through the same queue ([`StderrLog::line_writer`]), in order
//! with the log lines.
//!
//! What it does not do: the `annotate` filter writes its warnings to stderr
//! itself, in order with its output, and waits for a slow reader like any
//! Unix filter; `serve`'s spinners on a terminal are drawn by a thread of
//! their own (`ProgressDisplay::drawn_apart`), on stderr directly.
//!
//! Read [`StderrLog`] first.

use std::io::{self, Write};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{self, Receiver, SyncSender, TrySendError};
use std::thread::{self, Thread};
use std::time::{Duration, Instant};

use tracing::field::{Field, Visit};
use tracing_subscriber::field::{RecordFields, VisitOutput};
use tracing_subscriber::fmt::format::{DefaultFields, DefaultVisitor, Writer};
use tracing_subscriber::fmt::time::{FormatTime, SystemTime};
use tracing_subscriber::fmt::{FormatFields, MakeWriter};

/// Lines the queue holds while the writer waits on stderr: a burst of
/// streams ending at once, on a terminal that scrolls slowly, fits.
pub const QUEUE_LINES: usize = 1024;

/// Bytes the queue holds, whatever its lines: trace lines (`-vv`) can be
/// long. A line longer than this alone is queued when nothing else waits.
pub const QUEUE_BYTES: usize = 1 << 20;

/// How often `serve` checks for dropped lines to report.
pub const DROP_REPORT_INTERVAL: Duration = Duration::from_secs(10);

/// How long the writer, having written every queued line, waits before it
/// looks at the queue again, rather than sleeping until a sender wakes it.
/// A line waits at most this long more before it is written.
pub const LINGER: Duration = Duration::from_millis(5);

/// How long the end of the process waits for the queued lines to be
/// written.
pub const FLUSH_TIMEOUT: Duration = Duration::from_secs(1);

/// How long [`StderrLog::flush`] sleeps before it tries a full queue
/// again.
const FLUSH_RETRY: Duration = Duration::from_millis(5);

thread_local! {
    /// Whether this thread's last line was queued (or dropped): how
    /// [`StderrLog::report_dropped`] knows if its warning went out.
    static LAST_QUEUED: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

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
    /// The writer's thread, woken when the queue is half full.
    writer: Thread,
    /// The bytes of the lines queued or being written, and their bound.
    queued_bytes: Arc<AtomicUsize>,
    max_bytes: usize,
    /// The lines queued (not yet taken by the writer), and their bound.
    queued_lines: Arc<AtomicUsize>,
    max_lines: usize,
    dropped: Arc<AtomicUsize>,
    /// How many of the dropped lines [`StderrLog::report_dropped`] told of.
    reported: Arc<AtomicUsize>,
}

impl StderrLog {
    /// A writer thread for `out` (stderr, or a test's writer) with a queue
    /// of `lines` lines and `bytes` bytes, that lingers [`LINGER`].
    pub fn spawn<W: Write + Send + 'static>(
        out: W,
        lines: usize,
        bytes: usize,
    ) -> io::Result<StderrLog> {
        StderrLog::spawn_lingering(out, lines, bytes, LINGER)
    }

    /// [`StderrLog::spawn`], with the writer lingering `linger` (tests).
    fn spawn_lingering<W: Write + Send + 'static>(
        out: W,
        lines: usize,
        bytes: usize,
        linger: Duration,
    ) -> io::Result<StderrLog> {
        let (queue, received) = mpsc::sync_channel(lines);
        let queued_bytes = Arc::new(AtomicUsize::new(0));
        let queued_lines = Arc::new(AtomicUsize::new(0));
        let dropped = Arc::new(AtomicUsize::new(0));
        let written = Queued {
            bytes: Arc::clone(&queued_bytes),
            lines: Arc::clone(&queued_lines),
            dropped: Arc::clone(&dropped),
        };
        let writer = thread::Builder::new()
            .name("aalis-log".to_owned())
            .spawn(move || write_lines(out, received, &written, linger))?;
        Ok(StderrLog {
            queue,
            writer: writer.thread().clone(),
            queued_bytes,
            max_bytes: bytes,
            queued_lines,
            max_lines: lines,
            dropped,
            reported: Arc::new(AtomicUsize::new(0)),
        })
    }

    /// Lines dropped so far because the queue was full (or the writer
    /// thread had gone).
    pub fn dropped_lines(&self) -> usize {
        self.dropped.load(Ordering::Relaxed)
    }

    /// A writer of whole lines into the queue: each line is queued once its
    /// line break is written (log events, and `--progress=always` lines in
    /// `serve`).
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
        let before = self.reported.load(Ordering::Relaxed);
        if dropped <= before {
            return;
        }
        LAST_QUEUED.set(false);
        tracing::warn!(
            "{} log lines were dropped: stderr was not being read",
            dropped - before
        );
        // Told only if the warning was queued (on this thread, just now):
        // a warning dropped in turn leaves the count to the next report.
        if LAST_QUEUED.get() {
            self.reported.store(dropped, Ordering::Relaxed);
        }
    }

    /// Queues `line` (one or more whole lines) without waiting; a full
    /// queue (in lines or in bytes) drops and counts its lines.
    fn send(&self, line: Vec<u8>) {
        let len = line.len();
        // Its bytes are counted before it is queued, and only if they fit
        // (or nothing else waits); its line too, so that the writer never
        // takes away what was not yet counted.
        let bytes = self
            .queued_bytes
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |queued| {
                (queued == 0 || queued + len <= self.max_bytes).then_some(queued + len)
            })
            .map(|before| before + len);
        let refused = match bytes {
            Err(_) => Some(line),
            Ok(bytes) => {
                let lines = self.queued_lines.fetch_add(1, Ordering::Relaxed) + 1;
                match self.queue.try_send(Message::Line(line)) {
                    Ok(()) => {
                        // A lingering writer is woken before the queue fills.
                        if 2 * lines >= self.max_lines || 2 * bytes >= self.max_bytes {
                            self.writer.unpark();
                        }
                        None
                    }
                    Err(TrySendError::Full(message) | TrySendError::Disconnected(message)) => {
                        self.queued_bytes.fetch_sub(len, Ordering::Relaxed);
                        self.queued_lines.fetch_sub(1, Ordering::Relaxed);
                        match message {
                            Message::Line(line) => Some(line),
                            Message::Flush(_) => Some(Vec::new()),
                        }
                    }
                }
            }
        };
        if let Some(line) = &refused {
            let lines = memchr::memchr_iter(b'\n', line).count().max(1);
            self.dropped.fetch_add(lines, Ordering::Relaxed);
        }
        LAST_QUEUED.set(refused.is_none());
    }

    /// Waits up to `timeout` for the lines queued so far to be written;
    /// false if they were not (stderr does not take them). A full queue is
    /// waited on too, a few milliseconds at a time, within `timeout`.
    pub fn flush(&self, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        let (done, written) = mpsc::sync_channel(1);
        let mut flush = Message::Flush(done);
        loop {
            match self.queue.try_send(flush) {
                Ok(()) => {
                    self.writer.unpark();
                    break;
                }
                Err(TrySendError::Full(again)) if Instant::now() < deadline => {
                    flush = again;
                    thread::sleep(FLUSH_RETRY);
                }
                Err(TrySendError::Full(_) | TrySendError::Disconnected(_)) => return false,
            }
        }
        written
            .recv_timeout(deadline.saturating_duration_since(Instant::now()))
            .is_ok()
    }
}

impl std::fmt::Debug for StderrLog {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StderrLog")
            .field("dropped", &self.dropped_lines())
            .finish_non_exhaustive()
    }
}

/// The counts of what is queued, shared by the senders and the writer.
struct Queued {
    bytes: Arc<AtomicUsize>,
    lines: Arc<AtomicUsize>,
    /// [`StderrLog::dropped_lines`]: the writer adds the lines a failed
    /// write lost.
    dropped: Arc<AtomicUsize>,
}

/// The writer thread: every line in order. The lines it finds queued are
/// written together, with one `write_all`, after which their bytes leave
/// `queued` (a line leaves its count of lines when it is taken off the
/// queue: the lines bound counts those waiting, the bytes bound those
/// written too). A stderr left non-blocking (its description shared with
/// the process that started this one) is waited for when full, as a
/// blocking one would be. Another write error leaves the lines unwritten,
/// as an `eprintln!` that cannot write would, without stopping the queue;
/// they are counted as dropped, unless stderr is a closed pipe (there is
/// nobody to tell).
///
/// It waits on the queue (where a sender wakes it) only when a look
/// `linger` after its last write found nothing; in between it is parked,
/// and only a queue half full or a flush unparks it ([`StderrLog::send`]).
fn write_lines<W: Write>(
    mut out: W,
    received: Receiver<Message>,
    queued: &Queued,
    linger: Duration,
) {
    let mut batch = Vec::new();
    while let Ok(first) = received.recv() {
        let mut next = Some(first);
        while let Some(message) = next {
            match message {
                Message::Line(line) => {
                    queued.lines.fetch_sub(1, Ordering::Relaxed);
                    batch.extend_from_slice(&line);
                    // Lines that keep coming are written as they fill
                    // a batch, not held until they stop.
                    if batch.len() >= BATCH_BYTES {
                        write_batch(&mut out, &mut batch, queued);
                    }
                }
                Message::Flush(done) => {
                    write_batch(&mut out, &mut batch, queued);
                    let _ = out.flush();
                    let _ = done.try_send(());
                }
            }
            next = received.try_recv().ok().or_else(|| {
                write_batch(&mut out, &mut batch, queued);
                thread::park_timeout(linger);
                received.try_recv().ok()
            });
        }
    }
}

/// A batch is written once it holds this many bytes, whatever is still
/// queued: lines that keep coming (`-vv`) never wait for a lull, and never
/// fill the queue's bytes while stderr takes them.
const BATCH_BYTES: usize = 64 * 1024;

/// The most a batch's buffer keeps between writes: a batch that grew with
/// one long line leaves no buffer of its size behind.
const BATCH_KEEP: usize = 2 * BATCH_BYTES;

/// Writes the lines taken so far, and forgets their bytes.
fn write_batch<W: Write>(out: &mut W, batch: &mut Vec<u8>, queued: &Queued) {
    if !batch.is_empty() {
        if let Err(e) = write_waiting(out, batch).and_then(|()| out.flush())
            && e.kind() != io::ErrorKind::BrokenPipe
        {
            let lines = memchr::memchr_iter(b'\n', batch).count();
            queued.dropped.fetch_add(lines, Ordering::Relaxed);
        }
        queued.bytes.fetch_sub(batch.len(), Ordering::Relaxed);
        batch.clear();
        if batch.capacity() > BATCH_KEEP {
            *batch = Vec::new();
        }
    }
}

/// How long a write to a full non-blocking output, or a read of an empty
/// non-blocking input, waits before it tries again (a descriptor shared
/// with the process that started this one may have been left so).
pub const WOULD_BLOCK_RETRY: Duration = Duration::from_millis(1);

/// Writes `bytes` whole, waiting out `WouldBlock` (a non-blocking stderr
/// that is full) [`WOULD_BLOCK_RETRY`] at a time, as a blocking one would wait.
pub fn write_waiting<W: Write>(out: &mut W, mut bytes: &[u8]) -> io::Result<()> {
    while !bytes.is_empty() {
        match out.write(bytes) {
            Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
            Ok(n) => bytes = bytes.get(n..).unwrap_or_default(),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                thread::sleep(WOULD_BLOCK_RETRY);
            }
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// See [`StderrLog::line_writer`]. What follows the last line break waits
/// for the next write, or goes when the writer is dropped.
/// `tracing-subscriber` gets one per event and writes the event whole, line
/// break included, so each event is one message.
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

impl Drop for QueuedLines {
    fn drop(&mut self) {
        if !self.partial.is_empty() {
            self.log.send(std::mem::take(&mut self.partial));
        }
    }
}

impl<'a> MakeWriter<'a> for StderrLog {
    type Writer = QueuedLines;

    fn make_writer(&'a self) -> QueuedLines {
        self.line_writer()
    }
}

/// Whether `NO_COLOR` asks for no colour: set and not empty (no-color.org).
pub fn no_color() -> bool {
    std::env::var_os("NO_COLOR").is_some_and(|value| !value.is_empty())
}

/// Installs the `tracing` subscriber of `serve` and `mock`: info by
/// default, more with -v, or as RUST_LOG says; colored on a terminal unless
/// NO_COLOR is set. Without a writer thread (the system refused one) the
/// lines are written to stderr directly, as before this module.
pub fn init(verbose: u8) -> Option<StderrLog> {
    init_to(verbose, io::stderr())
}

/// [`init`], with the lines written to `out` (stderr above `serve`'s
/// spinners: [`ProgressDisplay::above`](crate::render::spinner::ProgressDisplay::above)).
pub fn init_to<W: Write + Send + 'static>(verbose: u8, out: W) -> Option<StderrLog> {
    use std::io::IsTerminal;
    use tracing_subscriber::EnvFilter;
    let default = match verbose {
        0 => "info",
        1 => "debug",
        _ => "trace",
    };
    // A RUST_LOG that does not parse is said, once the log is up, not
    // silently replaced.
    // An empty one is taken for none (it would log errors alone).
    let given = std::env::var_os("RUST_LOG").filter(|value| !value.is_empty());
    let (filter, bad_filter) = match given.map(|_| EnvFilter::try_from_default_env()) {
        Some(Ok(filter)) => (filter, None),
        Some(Err(err)) => (EnvFilter::new(default), Some(err)),
        None => (EnvFilter::new(default), None),
    };
    let color = io::stderr().is_terminal() && !no_color();
    let builder = tracing_subscriber::fmt()
        .fmt_fields(LogFields)
        .with_timer(LogTime)
        .with_env_filter(filter)
        .with_ansi(color)
        .with_target(false);
    let log = match StderrLog::spawn(out, QUEUE_LINES, QUEUE_BYTES) {
        Ok(log) => {
            builder.with_writer(log.clone()).init();
            Some(log)
        }
        Err(err) => {
            builder.with_writer(io::stderr).init();
            tracing::warn!("cannot start the log thread, logging on the workers: {err}");
            None
        }
    };
    if let Some(err) = bad_filter {
        tracing::warn!("RUST_LOG is not a filter ({err}); logging at {default} level");
    }
    log
}

/// The fields of a log line, written as `tracing-subscriber`'s default
/// ([`DefaultFields`]) writes them, for less: without colors, a plain
/// field goes straight to the line as `name=value`, an integer through
/// `itoa`, where the default paints its name and `=` with empty styles and
/// formats every value through `core::fmt`. A request's line is written
/// once a stream, and its fields cost about 12,000 instructions that way
/// (BENCHMARKS.md, forty-fourth round). The message, `r#` and `log.`
/// names, errors and anything with colors go to the default's visitor, so
/// a line never differs from the default's (the tests compare them).
#[derive(Debug, Default)]
pub struct LogFields;

impl<'w> FormatFields<'w> for LogFields {
    fn format_fields<R: RecordFields>(&self, writer: Writer<'w>, fields: R) -> std::fmt::Result {
        if writer.has_ansi_escapes() {
            return DefaultFields::new().format_fields(writer, fields);
        }
        let mut visitor = PlainVisitor {
            writer,
            is_empty: true,
            result: Ok(()),
        };
        fields.record(&mut visitor);
        visitor.result
    }
}

/// See [`LogFields`].
struct PlainVisitor<'w> {
    writer: Writer<'w>,
    is_empty: bool,
    result: std::fmt::Result,
}

impl PlainVisitor<'_> {
    /// Writes the separator and `name=` of a plain field, or returns false
    /// for a field the default's visitor must write.
    fn plain(&mut self, field: &Field) -> bool {
        let name = field.name();
        if self.result.is_err()
            || name == "message"
            || name.starts_with("r#")
            || name.starts_with("log.")
        {
            return false;
        }
        let sep = if std::mem::replace(&mut self.is_empty, false) {
            ""
        } else {
            " "
        };
        self.result = self
            .writer
            .write_str(sep)
            .and_then(|()| self.writer.write_str(name))
            .and_then(|()| self.writer.write_char('='));
        true
    }

    /// Lets the default's visitor write this field.
    fn by_default(&mut self, record: impl FnOnce(&mut DefaultVisitor<'_>)) {
        if self.result.is_err() {
            return;
        }
        let mut visitor = DefaultVisitor::new(self.writer.by_ref(), self.is_empty);
        record(&mut visitor);
        self.result = visitor.finish();
        self.is_empty = false;
    }

    fn integer(&mut self, field: &Field, value: impl itoa::Integer + std::fmt::Debug) {
        if self.plain(field) {
            let mut digits = itoa::Buffer::new();
            self.result = self.writer.write_str(digits.format(value));
        } else {
            self.by_default(|visitor| visitor.record_debug(field, &value));
        }
    }
}

impl Visit for PlainVisitor<'_> {
    fn record_u64(&mut self, field: &Field, value: u64) {
        self.integer(field, value);
    }

    fn record_i64(&mut self, field: &Field, value: i64) {
        self.integer(field, value);
    }

    fn record_str(&mut self, field: &Field, value: &str) {
        if self.plain(field) {
            self.result = write!(self.writer, "{value:?}");
        } else {
            self.by_default(|visitor| visitor.record_str(field, value));
        }
    }

    fn record_error(&mut self, field: &Field, value: &(dyn std::error::Error + 'static)) {
        self.by_default(|visitor| visitor.record_error(field, value));
    }

    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        if self.plain(field) {
            self.result = write!(self.writer, "{value:?}");
        } else {
            self.by_default(|visitor| visitor.record_debug(field, value));
        }
    }
}

/// A log line's time, as `tracing-subscriber`'s [`SystemTime`] writes it
/// (`2026-12-05T17:11:51.417922Z`), for less: the part up to the second
/// is written by [`SystemTime`] once a second and kept for the thread's
/// next lines, and only the microseconds are written for each. The
/// default writes all seven numbers through `core::fmt` for every line,
/// about 4,600 instructions.
#[derive(Debug, Default, Clone, Copy)]
pub struct LogTime;

thread_local! {
    /// The second [`LogTime`] last wrote, and its text up to the `.`.
    static SECOND: std::cell::RefCell<(u64, String)> =
        const { std::cell::RefCell::new((u64::MAX, String::new())) };
}

impl FormatTime for LogTime {
    fn format_time(&self, w: &mut Writer<'_>) -> std::fmt::Result {
        let Ok(now) = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH) else {
            return SystemTime.format_time(w);
        };
        SECOND.with_borrow_mut(|kept| {
            if kept.0 != now.as_secs() && !learn_second(now.as_secs(), kept) {
                return SystemTime.format_time(w);
            }
            write_time(w, &kept.1, now.subsec_micros())
        })
    }
}

/// Keeps second `wanted` and [`SystemTime`]'s text of it up to its `.`;
/// false, with nothing kept, if the clock is no longer in that second (or
/// the text has no `.`): a text half written, or of another second, is
/// never kept as this one's, even for a clock stepped back.
fn learn_second(wanted: u64, (second, text): &mut (u64, String)) -> bool {
    *second = u64::MAX;
    text.clear();
    if SystemTime.format_time(&mut Writer::new(text)).is_err() {
        return false;
    }
    let after = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .ok();
    match text.find('.') {
        Some(dot) if after == Some(wanted) => {
            text.truncate(dot);
            *second = wanted;
            true
        }
        _ => false,
    }
}

/// `second` (up to its `.`), then `.`, six digits of `micros` and `Z`.
fn write_time(w: &mut Writer<'_>, second: &str, micros: u32) -> std::fmt::Result {
    let mut digits = itoa::Buffer::new();
    let digits = digits.format(micros);
    w.write_str(second)?;
    w.write_str(&".000000"[..7 - digits.len().min(6)])?;
    w.write_str(digits)?;
    w.write_char('Z')
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;

    /// A writer that takes nothing until `open` is sent, as a pipe whose
    /// reader has stopped, then keeps what it is given; it says on
    /// `entered` when its first write has begun.
    struct Stuck {
        open: Receiver<()>,
        opened: bool,
        entered: mpsc::Sender<()>,
        got: Arc<Mutex<Vec<u8>>>,
    }

    impl Write for Stuck {
        fn write(&mut self, bytes: &[u8]) -> io::Result<usize> {
            if !self.opened {
                let _ = self.entered.send(());
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

    /// A log whose writer is stuck until `open` sends.
    struct StuckLog {
        log: StderrLog,
        open: mpsc::Sender<()>,
        /// Sent to when the writer's first write has begun.
        entered: Receiver<()>,
        /// What the writer wrote.
        got: Arc<Mutex<Vec<u8>>>,
    }

    /// A log of `lines` lines whose writer is stuck.
    fn stuck_log(lines: usize) -> StuckLog {
        stuck_log_of(lines, QUEUE_BYTES)
    }

    /// A log of `lines` lines and `bytes` bytes whose writer is stuck.
    fn stuck_log_of(lines: usize, bytes: usize) -> StuckLog {
        let (open, opened) = mpsc::channel();
        let (entered_tx, entered) = mpsc::channel();
        let got = Arc::new(Mutex::new(Vec::new()));
        let stuck = Stuck {
            open: opened,
            opened: false,
            entered: entered_tx,
            got: Arc::clone(&got),
        };
        let log = StderrLog::spawn(stuck, lines, bytes).expect("spawn");
        StuckLog {
            log,
            open,
            entered,
            got,
        }
    }

    /// A writer that answers each write first with `refusals` errors of
    /// `kind` (a partial write after each refusal when `kind` is
    /// `WouldBlock`, as a full non-blocking pipe gives), and keeps what it
    /// takes.
    struct Refusing {
        kind: io::ErrorKind,
        refusals: usize,
        left: usize,
        got: Arc<Mutex<Vec<u8>>>,
    }

    impl Write for Refusing {
        fn write(&mut self, bytes: &[u8]) -> io::Result<usize> {
            if self.left > 0 {
                self.left -= 1;
                return Err(self.kind.into());
            }
            self.left = self.refusals;
            let n = if self.kind == io::ErrorKind::WouldBlock {
                bytes.len().min(7)
            } else {
                bytes.len()
            };
            self.got
                .lock()
                .expect("lock")
                .extend_from_slice(&bytes[..n]);
            Ok(n)
        }

        fn flush(&mut self) -> io::Result<()> {
            Ok(())
        }
    }

    /// A stderr left non-blocking answers `WouldBlock` when full: the lines
    /// are waited for and written whole, in order, none counted as dropped.
    /// Before, each batch that met it was lost, and not counted.
    #[test]
    fn a_full_non_blocking_stderr_is_waited_for() {
        let got = Arc::new(Mutex::new(Vec::new()));
        let out = Refusing {
            kind: io::ErrorKind::WouldBlock,
            refusals: 2,
            left: 2,
            got: Arc::clone(&got),
        };
        let log = StderrLog::spawn(out, 64, QUEUE_BYTES).expect("spawn");
        let mut expected = String::new();
        for n in 0..20 {
            let line = format!("line {n}\n");
            expected.push_str(&line);
            log.send(line.into_bytes());
        }
        assert!(flushed(&log));
        assert_eq!(text(&got), expected);
        assert_eq!(log.dropped_lines(), 0);
    }

    /// Lines a write error lost are counted as dropped (the warning then
    /// says how many), unless stderr is a closed pipe.
    #[test]
    fn lines_a_write_error_lost_are_counted() {
        for (kind, counted) in [
            (io::ErrorKind::Other, true),
            (io::ErrorKind::BrokenPipe, false),
        ] {
            let out = Refusing {
                kind,
                refusals: usize::MAX,
                left: usize::MAX,
                got: Arc::new(Mutex::new(Vec::new())),
            };
            let log = StderrLog::spawn(out, 64, QUEUE_BYTES).expect("spawn");
            for n in 0..5 {
                log.send(format!("line {n}\n").into_bytes());
            }
            assert!(flushed(&log));
            assert_eq!(log.dropped_lines(), if counted { 5 } else { 0 }, "{kind:?}");
        }
    }

    fn text(got: &Mutex<Vec<u8>>) -> String {
        String::from_utf8(got.lock().expect("lock").clone()).expect("utf-8")
    }

    /// Flushes, retrying while the queue is still full (bounded).
    fn flushed(log: &StderrLog) -> bool {
        (0..100).any(|_| log.flush(Duration::from_millis(100)))
    }

    fn line(log: &StderrLog, text: &str) {
        let mut writer = log.make_writer();
        writer.write_all(text.as_bytes()).expect("to memory");
    }

    #[test]
    fn a_stuck_writer_never_blocks_the_caller_and_every_line_is_written_or_counted() {
        let t = stuck_log(4);
        line(&t.log, "line 0\n");
        t.entered
            .recv()
            .expect("the writer took line 0 and waits in it");
        // The queue holds four more; the rest are dropped. None of this
        // waits: a blocked caller would hang the test here.
        for i in 1..20 {
            line(&t.log, &format!("line {i}\n"));
        }
        assert_eq!(t.log.dropped_lines(), 15);
        assert!(!t.log.flush(Duration::from_millis(50)), "stderr is stuck");
        t.open.send(()).expect("open");
        assert!(flushed(&t.log), "written once stderr takes them");
        assert_eq!(text(&t.got), "line 0\nline 1\nline 2\nline 3\nline 4\n");
    }

    #[test]
    fn the_queue_holds_at_most_its_bytes() {
        // Lines of 10 bytes; the queue takes 100 lines, but 35 bytes.
        let t = stuck_log_of(100, 35);
        line(&t.log, "line 0...\n");
        t.entered
            .recv()
            .expect("the writer took line 0 and waits in it");
        // Line 0 still counts, as it is held until written: two more fit.
        for i in 1..10 {
            line(&t.log, &format!("line {i}...\n"));
        }
        assert_eq!(t.log.dropped_lines(), 7);
        t.open.send(()).expect("open");
        assert!(flushed(&t.log));
        assert_eq!(text(&t.got), "line 0...\nline 1...\nline 2...\n");
        // Written, their bytes are free again; a line longer than the
        // bound goes when nothing else waits.
        let long = format!("{}\n", "x".repeat(99));
        line(&t.log, &long);
        assert!(flushed(&t.log));
        line(&t.log, "line 10..\n");
        assert!(flushed(&t.log));
        assert_eq!(t.log.dropped_lines(), 7);
        assert!(text(&t.got).ends_with(&format!("{long}line 10..\n")));
    }

    #[test]
    fn queued_lines_go_whole_whatever_the_writes() {
        let t = stuck_log(4);
        t.open.send(()).expect("open");
        let mut lines = t.log.line_writer();
        for piece in ["one", " line\ntwo", "\n", "three\nfour\nfi", "ve"] {
            lines.write_all(piece.as_bytes()).expect("to memory");
        }
        assert!(flushed(&t.log));
        assert_eq!(text(&t.got), "one line\ntwo\nthree\nfour\n");
        lines.write_all(b"\n").expect("to memory");
        assert!(flushed(&t.log));
        assert_eq!(text(&t.got), "one line\ntwo\nthree\nfour\nfive\n");
    }

    #[test]
    fn dropped_lines_are_counted_one_by_one() {
        let t = stuck_log(1);
        let mut lines = t.log.line_writer();
        lines.write_all(b"first\n").expect("to memory");
        t.entered
            .recv()
            .expect("the writer waits in the first line");
        lines.write_all(b"queued\n").expect("to memory");
        lines
            .write_all(b"three\nlines\ndropped\n")
            .expect("to memory");
        assert_eq!(t.log.dropped_lines(), 3);
        t.open.send(()).expect("open");
        assert!(flushed(&t.log));
        assert_eq!(text(&t.got), "first\nqueued\n");
    }

    /// A log of `lines` lines whose writer takes everything at once and
    /// lingers `linger`, what it wrote, and the count of its `write` calls.
    fn lingering_log(
        lines: usize,
        linger: Duration,
    ) -> (StderrLog, Arc<Mutex<Vec<u8>>>, Arc<AtomicUsize>) {
        let out = Buffer::default();
        let log =
            StderrLog::spawn_lingering(out.clone(), lines, QUEUE_BYTES, linger).expect("spawn");
        (log, out.got, out.calls)
    }

    #[test]
    fn the_lines_found_queued_are_written_with_one_call() {
        let (log, got, calls) = lingering_log(64, Duration::from_secs(3600));
        line(&log, "line 0\n");
        assert!(written(&got, "line 0\n"));
        assert_eq!(calls.load(Ordering::Relaxed), 1);
        // Queued while the writer lingers, then all taken at its flush.
        thread::sleep(Duration::from_millis(100));
        for i in 1..11 {
            line(&log, &format!("line {i}\n"));
        }
        assert!(log.flush(Duration::from_secs(10)));
        let expected: String = (0..11).map(|i| format!("line {i}\n")).collect();
        assert_eq!(text(&got), expected);
        assert_eq!(calls.load(Ordering::Relaxed), 2, "ten lines, one write");
        // Written, they are counted no more.
        assert_eq!(log.queued_bytes.load(Ordering::Relaxed), 0);
        assert_eq!(log.queued_lines.load(Ordering::Relaxed), 0);
    }

    /// Whether the writer has written `expected`, looking for 10 s at most.
    fn written(got: &Mutex<Vec<u8>>, expected: &str) -> bool {
        (0..2000).any(|_| {
            thread::sleep(Duration::from_millis(5));
            text(got) == expected
        })
    }

    #[test]
    fn a_line_queued_while_the_writer_lingers_is_written_when_it_looks_again() {
        let (log, got, _) = lingering_log(16, Duration::from_millis(20));
        line(&log, "line 0\n");
        assert!(written(&got, "line 0\n"));
        // Neither line wakes the writer (the queue is far from half full),
        // and nothing else is sent: each goes at the writer's next look.
        line(&log, "line 1\n");
        assert!(written(&got, "line 0\nline 1\n"));
        thread::sleep(Duration::from_millis(100));
        line(&log, "line 2\n");
        assert!(written(&got, "line 0\nline 1\nline 2\n"));
    }

    #[test]
    fn a_queue_half_full_wakes_a_lingering_writer() {
        let (log, got, _) = lingering_log(8, Duration::from_secs(3600));
        line(&log, "line 0\n");
        assert!(written(&got, "line 0\n"));
        // The writer has looked at the empty queue and lingers: lines that
        // leave the queue less than half full do not wake it.
        thread::sleep(Duration::from_millis(300));
        for i in 1..4 {
            line(&log, &format!("line {i}\n"));
        }
        thread::sleep(Duration::from_millis(100));
        assert_eq!(text(&got), "line 0\n");
        // The fourth fills half of the eight: all four go now, not in an hour.
        line(&log, "line 4\n");
        assert!(written(&got, "line 0\nline 1\nline 2\nline 3\nline 4\n"));
        assert_eq!(log.dropped_lines(), 0);
    }

    #[test]
    fn a_flush_wakes_a_lingering_writer() {
        let (log, got, _) = lingering_log(8, Duration::from_secs(3600));
        line(&log, "line 0\n");
        assert!(written(&got, "line 0\n"));
        thread::sleep(Duration::from_millis(100));
        line(&log, "line 1\n");
        assert!(
            log.flush(Duration::from_secs(10)),
            "flushed, not an hour later"
        );
        assert_eq!(text(&got), "line 0\nline 1\n");
    }

    fn time_of(timer: impl FormatTime) -> String {
        let mut text = String::new();
        timer
            .format_time(&mut Writer::new(&mut text))
            .expect("to memory");
        text
    }

    #[test]
    fn log_time_writes_what_system_time_writes() {
        // Twice on this thread: the second from its kept second. Tried
        // again if the clock turned a second between the two texts.
        for _ in 0..2 {
            let same = (0..100).any(|_| {
                let ours = time_of(LogTime);
                let theirs = time_of(SystemTime);
                assert_eq!(ours.len(), theirs.len(), "{ours} {theirs}");
                assert_eq!(ours.len(), "2026-12-05T17:11:51.417922Z".len(), "{ours}");
                assert!(ours.ends_with('Z') && ours.as_bytes()[19] == b'.', "{ours}");
                ours[..20] == theirs[..20]
            });
            assert!(same, "never the same second as SystemTime");
        }
    }

    #[test]
    fn log_time_writes_six_digits_of_microseconds() {
        for (micros, text) in [
            (0, "2026-12-05T17:11:51.000000Z"),
            (7, "2026-12-05T17:11:51.000007Z"),
            (123_456, "2026-12-05T17:11:51.123456Z"),
            (999_999, "2026-12-05T17:11:51.999999Z"),
        ] {
            let mut got = String::new();
            write_time(&mut Writer::new(&mut got), "2026-12-05T17:11:51", micros)
                .expect("to memory");
            assert_eq!(got, text);
        }
    }

    #[test]
    fn lines_that_keep_coming_are_written_a_batch_at_a_time() {
        let (log, got, calls) = lingering_log(1024, Duration::from_secs(3600));
        line(&log, "line 0\n");
        assert!(written(&got, "line 0\n"));
        thread::sleep(Duration::from_millis(100));
        // Forty lines of 2 KiB queued while the writer lingers (less than
        // half the queue: none wakes it), all taken at the flush: the
        // first 32 fill a batch and go, then the other 8.
        let long: Vec<String> = (0..40)
            .map(|i| format!("{i:04} {}\n", "x".repeat(2048 - 6)))
            .collect();
        for text in &long {
            line(&log, text);
        }
        assert!(log.flush(Duration::from_secs(10)));
        assert_eq!(text(&got), format!("line 0\n{}", long.concat()));
        assert_eq!(calls.load(Ordering::Relaxed), 3);
    }

    /// A `MakeWriter` into a shared buffer, that counts its `write`s.
    #[derive(Clone, Default)]
    struct Buffer {
        got: Arc<Mutex<Vec<u8>>>,
        calls: Arc<AtomicUsize>,
    }

    impl Write for Buffer {
        fn write(&mut self, bytes: &[u8]) -> io::Result<usize> {
            self.calls.fetch_add(1, Ordering::Relaxed);
            self.got.lock().expect("lock").extend_from_slice(bytes);
            Ok(bytes.len())
        }

        fn flush(&mut self) -> io::Result<()> {
            Ok(())
        }
    }

    impl<'a> MakeWriter<'a> for Buffer {
        type Writer = Buffer;

        fn make_writer(&'a self) -> Buffer {
            self.clone()
        }
    }

    /// Logs events of every kind of field, in spans with fields, once
    /// through `tracing-subscriber`'s default fields and once through
    /// [`LogFields`], with colors or without: the same lines.
    fn lines_with(fields: bool, ansi: bool) -> String {
        let out = Buffer::default();
        let builder = tracing_subscriber::fmt()
            .with_writer(out.clone())
            .with_max_level(tracing::Level::TRACE)
            .without_time()
            .with_target(false)
            .with_ansi(ansi);
        let events = || {
            let error = io::Error::other("upstream gone");
            let span = tracing::info_span!("conn", peer = "127.0.0.1:9", n = 3_u64);
            let _entered = span.enter();
            tracing::info!(
                method = %http::Method::POST,
                path = %"/v1/chat/completions?q=\"é\"",
                status = 200_u16,
                session = %"s-1",
                duration_ms = 12_u64,
                bytes_in = 0_u64,
                bytes_out = u64::MAX,
                tool_calls = 2_usize,
                outcome = "ok",
                "request"
            );
            let inner = tracing::debug_span!("inner", r#type = "x");
            inner.in_scope(|| {
                tracing::warn!(
                    delta = -7_i64,
                    big = i64::MIN,
                    flag = true,
                    ratio = 0.5_f64,
                    wide = 1_u128 << 100,
                    quoted = "a \"b\"\n\u{1b}[31m",
                    list = ?[1, 2],
                    r#type = "t",
                    err = &error as &(dyn std::error::Error + 'static),
                    "{} log lines were dropped: {}",
                    3,
                    "stderr was not being read"
                );
            });
            tracing::error!(only = 1_u64);
            tracing::trace!("\u{1b}[2Jno fields");
        };
        if fields {
            tracing::subscriber::with_default(builder.fmt_fields(LogFields).finish(), events);
        } else {
            tracing::subscriber::with_default(builder.finish(), events);
        }
        text(&out.got)
    }

    #[test]
    fn log_fields_write_what_the_default_writes() {
        for ansi in [false, true] {
            let ours = lines_with(true, ansi);
            assert_eq!(ours, lines_with(false, ansi), "ansi: {ansi}");
            assert_eq!(ours.lines().count(), 4, "{ours}");
        }
        let plain = lines_with(true, false);
        assert!(
            plain.contains(
                " INFO conn{peer=\"127.0.0.1:9\" n=3}: request method=POST \
                 path=/v1/chat/completions?q=\"é\" status=200 session=s-1 duration_ms=12 \
                 bytes_in=0 bytes_out=18446744073709551615 tool_calls=2 outcome=\"ok\"\n"
            ),
            "{plain}"
        );
    }

    /// A `tracing` subscriber that logs to `log`, as `serve`'s does.
    fn subscriber(log: &StderrLog) -> impl tracing::Subscriber + Send + Sync {
        tracing_subscriber::fmt()
            .with_writer(log.clone())
            .with_ansi(false)
            .with_target(false)
            .finish()
    }

    /// Each warning line of a report, as its number.
    fn reports(got: &str) -> Vec<usize> {
        got.lines()
            .map(|line| {
                assert!(line.contains(" WARN "), "{line}");
                line.rsplit_once(" WARN ")
                    .and_then(|(_, rest)| {
                        rest.strip_suffix(" log lines were dropped: stderr was not being read")
                    })
                    .and_then(|n| n.parse().ok())
                    .unwrap_or_else(|| panic!("not a report: {line}"))
            })
            .collect()
    }

    #[test]
    fn a_report_says_how_many_lines_were_dropped_since_the_last() {
        let t = stuck_log(4);
        t.open.send(()).expect("open");
        tracing::subscriber::with_default(subscriber(&t.log), || {
            t.log.report_dropped(); // none: no line
            t.log.dropped.store(3, Ordering::Relaxed);
            t.log.report_dropped(); // "3"
            t.log.report_dropped(); // none new: no line
            t.log.dropped.store(7, Ordering::Relaxed);
            t.log.report_dropped(); // "4"
        });
        assert!(flushed(&t.log));
        assert_eq!(reports(&text(&t.got)), [3, 4]);
    }

    #[test]
    fn a_report_that_is_dropped_leaves_its_count_to_the_next() {
        let t = stuck_log(1);
        tracing::subscriber::with_default(subscriber(&t.log), || {
            tracing::warn!("1 log lines were dropped: stderr was not being read");
            t.entered
                .recv()
                .expect("the writer waits in the first line");
            tracing::warn!("0 log lines were dropped: stderr was not being read"); // queued
            tracing::info!("dropped");
            tracing::info!("dropped");
            t.log.report_dropped(); // "2", dropped in turn
            assert_eq!(t.log.dropped_lines(), 3);
            t.open.send(()).expect("open");
            assert!(flushed(&t.log));
            t.log.report_dropped(); // "3": the two lines and the first report
        });
        assert!(flushed(&t.log));
        assert_eq!(reports(&text(&t.got)), [1, 0, 3]);
    }
}
