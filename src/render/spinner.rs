//! One spinner per in-progress tool on stderr (issue 4): the seed's
//! `ToolCallProgressCard` brought to a terminal.
//!
//! Each line reads `⠙ get_weather  142 chars · 3.2s`: the tool name (as the
//! model wrote it, neutralized for the terminal), the length of its
//! arguments so far, and the time since its `startedAt`, with one decimal.
//! Tools show in index order (per session, then choice, then index), and
//! parallel tools never share a line. When a tool leaves the in-progress
//! state (text or reasoning resumes, `done`, the stream ends, the tool
//! starts executing) its spinner ends with one final line, `✓ …`, or `✗ …`
//! when the stream failed.
//!
//! [`ProgressDisplay`] takes the whole in-progress state of a session each
//! time it changes ([`ProgressDisplay::show`]) and works out what to draw.
//! Where it draws is chosen once, from `--progress` and whether stderr is a
//! terminal (passed in as values, never read deep inside):
//! - a terminal: indicatif `MultiProgress`, spinners redrawn in place;
//! - not a terminal with `always`: plain lines, at most one per tool per
//!   second, plus the final one (for logs);
//! - `auto` without a terminal, or `never`: nothing.
//!
//! On a terminal, `serve` draws from a thread of its own
//! ([`ProgressDisplay::drawn_apart`]): a write to a terminal blocks while
//! it is paused (Ctrl-S) or while nothing reads it, and a worker that drew
//! there would stop every stream it serves.
//!
//! Read [`status_line`] first.

use std::collections::BTreeMap;
use std::io::Write;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use indicatif::{MultiProgress, ProgressBar, ProgressDrawTarget, ProgressStyle};

use crate::progress::ProgressEntry;
use crate::stderr_log::write_waiting;

/// Longest tool name shown, in characters.
pub const MAX_NAME_CHARS: usize = 48;

/// Plain mode writes at most one line per tool per this long (besides its
/// first and its final line).
const PLAIN_INTERVAL_MS: u64 = 1000;

/// Spinner frames, then the icon a finished line gets.
const SPINNER: &str = "⠋⠙⠹⠸⠼⠴⠦⠧⠇⠏";

/// When to draw (`--progress[=auto|always|never]`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum ProgressMode {
    /// Spinners when stderr is a terminal, nothing otherwise
    Auto,
    /// Spinners on a terminal, plain lines (at most one per tool per second)
    /// otherwise
    Always,
    /// Nothing
    #[default]
    Never,
}

impl ProgressMode {
    /// Whether spinners are drawn on a terminal, given whether stderr is
    /// one: then whatever else goes to that terminal goes through
    /// [`ProgressDisplay::above`].
    pub fn draws_on_a_terminal(self, stderr_is_terminal: bool) -> bool {
        stderr_is_terminal && self != ProgressMode::Never
    }
}

/// How a tool's generation ended, for its final line.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// Text resumed, the stream finished, or the tool started: `✓`.
    Done,
    /// The stream failed: `✗`.
    Failed,
}

impl Outcome {
    /// `Failed` when the stream (or the call) failed, else `Done`.
    pub fn from_failed(failed: bool) -> Outcome {
        if failed {
            Outcome::Failed
        } else {
            Outcome::Done
        }
    }

    fn icon(self) -> &'static str {
        match self {
            Outcome::Done => "✓",
            Outcome::Failed => "✗",
        }
    }
}

/// `<icon> <name>  <chars> chars · <elapsed>s`, with the name neutralized
/// ([`sanitize_name`]) and the elapsed time with one decimal.
pub fn status_line(icon: &str, name: &str, chars: usize, elapsed: Duration) -> String {
    render_line(icon, &shown_name("", 0, name), chars, elapsed)
}

/// A line from a name already made safe by [`shown_name`].
fn render_line(icon: &str, shown: &str, chars: usize, elapsed: Duration) -> String {
    format!("{icon} {}{}", message(shown, chars), seconds(elapsed))
}

/// The part of a line that changes only with progress: `name  142 chars · `.
fn message(shown: &str, chars: usize) -> String {
    format!("{shown}  {chars} chars · ")
}

/// Longest session label shown before a tool name, in characters.
const MAX_SESSION_CHARS: usize = 24;

/// The name as shown: sanitized and cut on its own, and in `serve`
/// prefixed with the session, cut shorter, so a long session id never
/// hides the tool's name.
fn shown_name(session: &str, choice: i64, name: &str) -> String {
    let name = sanitize_name(name);
    let mut name = if name.is_empty() {
        "(unnamed)".to_owned()
    } else {
        name
    };
    // With `n` > 1, each choice's calls have lines of their own, told
    // apart (choice 0, nearly every stream's only one, is left plain).
    if choice != 0 {
        name.push_str(&format!(" (choice {choice})"));
    }
    if session.is_empty() {
        return name;
    }
    let mut session: String = sanitize_name(session)
        .chars()
        .take(MAX_SESSION_CHARS + 1)
        .collect();
    if session.chars().count() > MAX_SESSION_CHARS {
        session = session.chars().take(MAX_SESSION_CHARS).collect();
        session.push('…');
    }
    format!("[{session}] {name}")
}

fn seconds(elapsed: Duration) -> String {
    format!("{:.1}s", elapsed.as_secs_f64())
}

/// A tool name from the model, made safe to draw: control characters
/// (escape sequences included), bidi controls and zero-width characters are
/// dropped, line breaks and tabs become spaces, and a name longer than
/// [`MAX_NAME_CHARS`] is cut at a character boundary with `…`.
pub fn sanitize_name(name: &str) -> String {
    let mut out = String::with_capacity(name.len().min(MAX_NAME_CHARS * 4));
    let mut count = 0;
    for c in name.chars() {
        let c = match c {
            '\n' | '\r' | '\t' => ' ',
            c if super::is_hostile(c) => continue,
            c => c,
        };
        if count == MAX_NAME_CHARS {
            out.push('…');
            break;
        }
        out.push(c);
        count += 1;
    }
    out
}

/// Which tool a line is for: session, choice, index.
type Key = (String, i64, i64);

/// What is known of one drawn tool.
struct Line {
    name: Arc<str>,
    chars: usize,
    started_at_ms: u64,
    /// Terminal mode: its spinner.
    bar: Option<ProgressBar>,
    /// Plain mode: when its last line was written.
    last_written_ms: u64,
}

enum Target {
    Terminal { multi: MultiProgress, color: bool },
    Plain(Box<dyn Write + Send>),
    Off,
}

/// The spinners of one process (shared by every stream of `serve`); see the
/// module docs.
pub struct ProgressDisplay {
    inner: Arc<Mutex<Inner>>,
    /// Set by [`ProgressDisplay::drawn_apart`]: `show` leaves the state
    /// here, and the drawing thread draws it.
    apart: Option<Arc<Apart>>,
}

/// Most final lines (`✓`, `✗`) that wait for the drawing thread; past
/// this many (a terminal paused for a long time), they are counted, and
/// the count is drawn in their place once the terminal takes output again.
const MAX_WAITING_FINAL_LINES: usize = 1024;

/// What waits for the drawing thread, and how it is told.
struct Apart {
    state: Mutex<ApartState>,
    /// Something to draw, or the display was dropped.
    wake: Condvar,
    /// The drawing thread has drawn everything it was given.
    idle: Condvar,
}

/// What [`ProgressDisplay::show`] left for the drawing thread. The state
/// is kept as it will be once everything waiting is drawn: a new state is
/// compared with it, the tools it no longer has are queued as final lines
/// there and then (with their own outcome and time), and only the latest
/// state of a session waits. However long the terminal is paused, no
/// tool's final line is lost or marked wrongly (up to
/// [`MAX_WAITING_FINAL_LINES`]), and what waits is bounded by the tools in
/// progress.
#[derive(Default)]
struct ApartState {
    /// Each session's tools in progress, as shown last; a session with
    /// none is not kept.
    sessions: BTreeMap<String, Waiting>,
    /// The final lines of tools that ended, in the order they ended.
    finals: Vec<FinalLine>,
    /// Final lines not kept because [`MAX_WAITING_FINAL_LINES`] waited.
    dropped_finals: usize,
    /// There is something to draw: final lines, or a changed session.
    pending: bool,
    /// The drawing thread is drawing what it took.
    drawing: bool,
    /// The display was dropped: the thread draws what waits, and ends.
    closed: bool,
}

/// A session's latest state.
struct Waiting {
    entries: Vec<ProgressEntry>,
    now_ms: u64,
    /// Changed since the drawing thread last took it.
    changed: bool,
}

/// A tool that ended, as it was last shown.
struct FinalLine {
    session: String,
    entry: ProgressEntry,
    outcome: Outcome,
    now_ms: u64,
}

struct Inner {
    target: Target,
    lines: BTreeMap<Key, Line>,
    /// indicatif drew last on the terminal, and left the cursor at the end
    /// of the line it drew (to draw over it next time): the end of the
    /// display moves it to a line of its own ([`ProgressDisplay::close`]).
    mid_line: bool,
}

impl std::fmt::Debug for ProgressDisplay {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never waits: the drawing thread holds the lock while a paused
        // terminal blocks it.
        let Ok(inner) = self.inner.try_lock() else {
            return f.debug_struct("ProgressDisplay").finish_non_exhaustive();
        };
        let target = match inner.target {
            Target::Terminal { .. } => "terminal",
            Target::Plain(_) => "plain",
            Target::Off => "off",
        };
        f.debug_struct("ProgressDisplay")
            .field("target", &target)
            .field("lines", &inner.lines.len())
            .finish()
    }
}

/// Whether stderr is a terminal spinners can be drawn on: one that
/// indicatif does not hide (`TERM` unset or `dumb`: no cursor motion).
/// On a terminal it hides, a display drew nothing, not even a tool's final
/// line; such a terminal is taken for no terminal (`--progress=always`
/// writes plain lines to it).
pub fn stderr_draws() -> bool {
    use std::io::IsTerminal;
    std::io::stderr().is_terminal() && !ProgressDrawTarget::stderr().is_hidden()
}

impl ProgressDisplay {
    /// The display `--progress=<mode>` asks for, given whether stderr is a
    /// terminal spinners can be drawn on ([`stderr_draws`]) and whether
    /// colour is allowed (`NO_COLOR`).
    pub fn new(mode: ProgressMode, stderr_is_terminal: bool, color: bool) -> ProgressDisplay {
        ProgressDisplay::new_plain_to(mode, stderr_is_terminal, color, || {
            Box::new(std::io::stderr())
        })
    }

    /// [`ProgressDisplay::new`], with plain lines written to what `plain`
    /// makes (`serve`: the log's queue, so that they keep their order
    /// with the log lines and a stderr nobody reads stops no stream).
    pub fn new_plain_to(
        mode: ProgressMode,
        stderr_is_terminal: bool,
        color: bool,
        plain: impl FnOnce() -> Box<dyn Write + Send>,
    ) -> ProgressDisplay {
        let target = match (mode, stderr_is_terminal) {
            _ if mode.draws_on_a_terminal(stderr_is_terminal) => Target::Terminal {
                multi: MultiProgress::with_draw_target(ProgressDrawTarget::stderr()),
                color,
            },
            (ProgressMode::Always, false) => Target::Plain(plain()),
            _ => Target::Off,
        };
        ProgressDisplay::with_target(target)
    }

    /// Spinners drawn to `target` (tests use indicatif's in-memory terminal).
    pub fn terminal(target: ProgressDrawTarget, color: bool) -> ProgressDisplay {
        ProgressDisplay::with_target(Target::Terminal {
            multi: MultiProgress::with_draw_target(target),
            color,
        })
    }

    /// Plain lines written to `out`.
    pub fn plain(out: Box<dyn Write + Send>) -> ProgressDisplay {
        ProgressDisplay::with_target(Target::Plain(out))
    }

    /// A display that draws nothing.
    pub fn off() -> ProgressDisplay {
        ProgressDisplay::with_target(Target::Off)
    }

    fn with_target(target: Target) -> ProgressDisplay {
        ProgressDisplay {
            inner: Arc::new(Mutex::new(Inner {
                target,
                lines: BTreeMap::new(),
                mid_line: false,
            })),
            apart: None,
        }
    }

    /// This display, drawn from a thread of its own when it draws on a
    /// terminal (`serve`): [`show`](Self::show) then leaves the new state
    /// for that thread (see `ApartState`) and returns at once, so a terminal
    /// that takes no output (paused with Ctrl-S, or nobody reads it) holds
    /// up only the drawing. Plain lines and an off display are left as
    /// they are: plain lines go to the writer the caller chose (`serve`'s
    /// log queue, when it has one, never blocks). If the thread cannot be
    /// started, the display draws in place, as before.
    pub fn drawn_apart(mut self) -> ProgressDisplay {
        if !matches!(lock(&self.inner).target, Target::Terminal { .. }) || self.apart.is_some() {
            return self;
        }
        let apart = Arc::new(Apart {
            state: Mutex::new(ApartState::default()),
            wake: Condvar::new(),
            idle: Condvar::new(),
        });
        let (inner, theirs) = (Arc::clone(&self.inner), Arc::clone(&apart));
        let started = std::thread::Builder::new()
            .name("aalis-spinners".into())
            .spawn(move || draw_apart(&inner, &theirs));
        if started.is_ok() {
            self.apart = Some(apart);
        }
        self
    }

    /// Waits until the drawing thread has drawn every state shown so far,
    /// for at most `timeout` (a terminal that takes no writes never lets
    /// it); true if it has. At once for a display drawn in place.
    pub fn flush(&self, timeout: Duration) -> bool {
        let Some(apart) = &self.apart else {
            return true;
        };
        let deadline = Instant::now() + timeout;
        let mut state = lock(&apart.state);
        while state.pending || state.drawing {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return false;
            }
            state = match apart.idle.wait_timeout(state, left) {
                Ok((state, _)) => state,
                Err(poisoned) => poisoned.into_inner().0,
            };
        }
        true
    }

    /// True when spinners are drawn on a terminal.
    pub fn is_terminal(&self) -> bool {
        matches!(self.lock().target, Target::Terminal { .. })
    }

    /// True when nothing is ever drawn (callers can skip the work).
    pub fn is_off(&self) -> bool {
        matches!(self.lock().target, Target::Off)
    }

    /// The in-progress tools of `session` are now `entries` (sorted by
    /// choice, then index; empty when the state cleared). Tools that are no
    /// longer there end with a final line marked as `outcome` says.
    pub fn show(&self, session: &str, entries: &[ProgressEntry], outcome: Outcome, now_ms: u64) {
        if let Some(apart) = &self.apart {
            apart.leave(session, entries, outcome, now_ms);
            return;
        }
        self.lock().show(session, entries, outcome, now_ms);
    }

    /// A tool of `session` ended as `entry` (its last state): its final
    /// line, with its last count, drawn on its own if it never had a
    /// spinner (it began and ended between two states shown). Callers
    /// tell it before [`show`](Self::show) with what is still in
    /// progress, which then no longer has the tool: `annotate` once per
    /// read, `serve` once per write to its client.
    pub fn ended(&self, session: &str, entry: &ProgressEntry, outcome: Outcome, now_ms: u64) {
        if let Some(apart) = &self.apart {
            apart.ended(session, entry, outcome, now_ms);
            return;
        }
        let mut inner = self.lock();
        if !matches!(inner.target, Target::Off) {
            inner.end(session, entry, outcome, now_ms);
        }
    }

    /// The process is about to end on a signal (`annotate` interrupted):
    /// every tool still in progress ends with its final line, marked `✗`
    /// (its stream did not finish), and nothing is drawn after, so the
    /// terminal keeps no spinner frozen mid-turn. Lines written through
    /// [`above`](Self::above) after this go straight out.
    pub fn interrupt(&self, now_ms: u64) {
        let mut inner = self.lock();
        for (key, line) in std::mem::take(&mut inner.lines) {
            inner.finish(&key, line, Outcome::Failed, now_ms);
        }
        inner.close();
    }

    /// Nothing more is drawn (the process ends): the cursor goes below the
    /// last line drawn, so that the shell's prompt does not follow it on
    /// that line. Skipped if the drawing thread holds the display (a
    /// paused terminal): the end of the process is not held up for it.
    pub fn close(&self) {
        if let Ok(mut inner) = self.inner.try_lock() {
            inner.close();
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        lock(&self.inner)
    }

    /// `out`, for lines that share the terminal with the spinners
    /// (warnings, log lines): each flush's whole lines are written with
    /// the spinners taken off the screen; their next tick draws them again
    /// below. Written straight through, the spinners' next redraw moved
    /// the cursor up over those lines and erased them.
    pub fn above<W: Write>(&self, out: W) -> Above<W> {
        Above {
            display: Arc::downgrade(&self.inner),
            out,
            held: Vec::new(),
            whole_lines: true,
        }
    }

    /// [`above`](Self::above) for an output (stdout on the same
    /// terminal): every flush writes all it has, a line not ended yet
    /// included, since the data must go out as it comes.
    pub fn above_as_is<W: Write>(&self, out: W) -> Above<W> {
        let mut above = self.above(out);
        above.whole_lines = false;
        above
    }
}

/// The most of an unfinished line [`Above`] holds back.
const MAX_HELD_BYTES: usize = 64 * 1024;

/// A writer of lines above the spinners ([`ProgressDisplay::above`]).
/// Bytes are held until a flush, then written up to their last line break
/// (a spinner drawn after half a line would land on it); what follows that
/// break waits for the next flush that completes its line, or for the
/// display to draw nothing, or for the writer's end. An output
/// ([`ProgressDisplay::above_as_is`]) writes all it has at each flush.
pub struct Above<W: Write> {
    display: std::sync::Weak<Mutex<Inner>>,
    out: W,
    held: Vec<u8>,
    whole_lines: bool,
}

impl<W: Write> Write for Above<W> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.held.extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        let Above {
            display,
            out,
            held,
            whole_lines,
        } = self;
        let inner = display.upgrade();
        let mut inner = inner.as_deref().map(lock);
        let ready = match inner.as_deref().map(|inner| &inner.target) {
            Some(Target::Terminal { .. }) if *whole_lines => {
                match held.iter().rposition(|&b| b == b'\n') {
                    Some(at) => at + 1,
                    // A line that never ends is not held without bound.
                    None if held.len() > MAX_HELD_BYTES => held.len(),
                    None => 0,
                }
            }
            _ => held.len(),
        };
        if ready == 0 {
            return Ok(());
        }
        let mut below = false;
        if let Some(inner) = inner.as_deref()
            && let Target::Terminal { multi, .. } = &inner.target
        {
            // Not `suspend`, which panics when the terminal fails (a
            // closed one): a failed clear is the write's to report.
            let _ = multi.clear();
            // With no spinner to clear, the cursor is still at the end of
            // the last line indicatif drew (a tool's final line): the
            // text goes below it, not after it.
            below = inner.mid_line
                && !multi.is_hidden()
                && !inner.lines.values().any(|line| line.bar.is_some());
        }
        // Waited for when full, as a blocking stderr would be, if it was
        // left non-blocking: the log's writer, whose lines come through
        // here on a terminal, waits the same way.
        let written = match below {
            true => write_waiting(out, b"\n"),
            false => Ok(()),
        }
        .and_then(|()| write_waiting(out, &held[..ready]))
        .and_then(|()| out.flush());
        // Drawn again at once below what was written, rather than at the
        // next tick (a stream's flushes came faster: the spinners
        // flickered); not after half a line, which a draw would follow on
        // its terminal line (and a later redraw erase).
        if let Some(inner) = inner.as_deref_mut()
            && matches!(inner.target, Target::Terminal { .. })
        {
            let redrawn = held[..ready].ends_with(b"\n")
                && match inner.lines.values().find_map(|line| line.bar.as_ref()) {
                    Some(bar) => {
                        bar.force_draw();
                        true
                    }
                    None => false,
                };
            // Text that ended its line leaves the cursor at a line's
            // start; half a line, in the output's own text.
            inner.mid_line = redrawn;
        }
        // Written or not (a closed stderr), the bytes go: nothing piles up.
        held.drain(..ready);
        written
    }
}

impl<W: Write> Drop for Above<W> {
    /// A last line without its break is written as it is.
    fn drop(&mut self) {
        if !self.held.is_empty() {
            let _ = self.out.write_all(&self.held);
            let _ = self.out.flush();
        }
    }
}

impl Drop for ProgressDisplay {
    /// The drawing thread, if any, draws what waits and ends.
    fn drop(&mut self) {
        if let Some(apart) = &self.apart {
            lock(&apart.state).closed = true;
            apart.wake.notify_one();
        }
    }
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|e| e.into_inner())
}

impl Apart {
    /// Leaves a session's new state for the drawing thread (see
    /// [`ApartState`]); wakes it if nothing was waiting.
    fn leave(&self, session: &str, entries: &[ProgressEntry], outcome: Outcome, now_ms: u64) {
        let mut state = lock(&self.state);
        let ApartState {
            sessions,
            finals,
            dropped_finals,
            pending,
            ..
        } = &mut *state;
        let was_pending = *pending;
        if let Some(before) = sessions.get(session) {
            for ended in before.entries.iter().filter(|b| !has_tool(entries, b)) {
                queue_final(finals, dropped_finals, session, ended, outcome, now_ms);
                *pending = true;
            }
        }
        if entries.is_empty() {
            sessions.remove(session);
        } else {
            let waiting = match sessions.get_mut(session) {
                Some(waiting) => waiting,
                None => sessions.entry(session.to_owned()).or_insert(Waiting {
                    entries: Vec::new(),
                    now_ms,
                    changed: true,
                }),
            };
            waiting.entries.clear();
            waiting.entries.extend_from_slice(entries);
            waiting.now_ms = now_ms;
            waiting.changed = true;
            *pending = true;
        }
        let wake = *pending && !was_pending;
        drop(state);
        if wake {
            self.wake.notify_one();
        }
    }

    /// Queues the final line of a tool that ended as `entry`, and takes
    /// the tool out of its session's state (see [`ApartState`]), so that
    /// the next [`leave`](Self::leave) does not end it again with an older
    /// count; wakes the drawing thread if nothing was waiting.
    fn ended(&self, session: &str, entry: &ProgressEntry, outcome: Outcome, now_ms: u64) {
        let mut state = lock(&self.state);
        let was_pending = state.pending;
        let ApartState {
            finals,
            dropped_finals,
            ..
        } = &mut *state;
        queue_final(finals, dropped_finals, session, entry, outcome, now_ms);
        if let Some(waiting) = state.sessions.get_mut(session) {
            waiting.entries.retain(|e| !same_tool(e, entry));
            if waiting.entries.is_empty() {
                state.sessions.remove(session);
            }
        }
        state.pending = true;
        drop(state);
        if !was_pending {
            self.wake.notify_one();
        }
    }
}

/// Queues the final line of `entry`, a tool of `session` that ended, or
/// counts it past [`MAX_WAITING_FINAL_LINES`].
fn queue_final(
    finals: &mut Vec<FinalLine>,
    dropped_finals: &mut usize,
    session: &str,
    entry: &ProgressEntry,
    outcome: Outcome,
    now_ms: u64,
) {
    if finals.len() < MAX_WAITING_FINAL_LINES {
        finals.push(FinalLine {
            session: session.to_owned(),
            entry: entry.clone(),
            outcome,
            now_ms,
        });
    } else {
        *dropped_finals += 1;
    }
}

/// Whether `a` and `b` are the same tool (the same choice and index).
fn same_tool(a: &ProgressEntry, b: &ProgressEntry) -> bool {
    a.choice == b.choice && a.index == b.index
}

/// Whether `entries` has the tool of `entry`.
fn has_tool(entries: &[ProgressEntry], entry: &ProgressEntry) -> bool {
    entries.iter().any(|e| same_tool(e, entry))
}

/// The drawing thread of [`ProgressDisplay::drawn_apart`]: takes what
/// waits, draws it, and waits again; ends when the display is dropped.
fn draw_apart(inner: &Mutex<Inner>, apart: &Apart) {
    loop {
        let (finals, dropped_finals, changed) = {
            let mut state = lock(&apart.state);
            state.drawing = false;
            apart.idle.notify_all();
            while !state.pending && !state.closed {
                state = apart.wake.wait(state).unwrap_or_else(|e| e.into_inner());
            }
            if !state.pending {
                return;
            }
            state.pending = false;
            state.drawing = true;
            let changed: Vec<(String, Vec<ProgressEntry>, u64)> = state
                .sessions
                .iter_mut()
                .filter(|(_, waiting)| waiting.changed)
                .map(|(session, waiting)| {
                    waiting.changed = false;
                    (session.clone(), waiting.entries.clone(), waiting.now_ms)
                })
                .collect();
            (
                std::mem::take(&mut state.finals),
                std::mem::take(&mut state.dropped_finals),
                changed,
            )
        };
        // A panic in the drawing loses this batch, not the thread.
        let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let mut inner = lock(inner);
            for last in &finals {
                inner.end(&last.session, &last.entry, last.outcome, last.now_ms);
            }
            if dropped_finals > 0 {
                inner.println(&format!(
                    "({dropped_finals} more tools ended while the terminal took no output)"
                ));
            }
            for (session, entries, now_ms) in &changed {
                inner.show(session, entries, Outcome::Done, *now_ms);
            }
        }));
    }
}

impl Inner {
    /// See [`ProgressDisplay::close`].
    fn close(&mut self) {
        if self.mid_line
            && let Target::Terminal { multi, .. } = &self.target
            && !multi.is_hidden()
        {
            let mut stderr = std::io::stderr();
            let _ = stderr.write_all(b"\n").and_then(|()| stderr.flush());
        }
        self.mid_line = false;
        self.target = Target::Off;
    }

    /// [`ProgressDisplay::show`], drawn here and now.
    fn show(&mut self, session: &str, entries: &[ProgressEntry], outcome: Outcome, now_ms: u64) {
        if matches!(self.target, Target::Off) {
            return;
        }
        let gone: Vec<Key> = self
            .lines
            .range((session.to_owned(), i64::MIN, i64::MIN)..)
            .take_while(|(k, _)| k.0 == session)
            .filter(|(k, _)| !entries.iter().any(|e| e.choice == k.1 && e.index == k.2))
            .map(|(k, _)| k.clone())
            .collect();
        for key in gone {
            if let Some(line) = self.lines.remove(&key) {
                self.finish(&key, line, outcome, now_ms);
            }
        }
        for entry in entries {
            let key = (session.to_owned(), entry.choice, entry.index);
            self.update(key, entry, now_ms);
        }
    }

    fn update(&mut self, key: Key, entry: &ProgressEntry, now_ms: u64) {
        let elapsed = Duration::from_millis(now_ms.saturating_sub(entry.started_at_ms));
        let label = shown_name(&key.0, key.1, &entry.name);
        if let Some(line) = self.lines.get_mut(&key) {
            if *line.name == *entry.name && line.chars == entry.chars_accumulated {
                return;
            }
            line.name = Arc::clone(&entry.name);
            line.chars = entry.chars_accumulated;
            if let Some(bar) = &line.bar {
                bar.set_message(message(&label, line.chars));
            }
            if let Target::Plain(out) = &mut self.target
                && now_ms.saturating_sub(line.last_written_ms) >= PLAIN_INTERVAL_MS
            {
                line.last_written_ms = now_ms;
                let _ = writeln!(out, "{}", render_line("⠿", &label, line.chars, elapsed));
            }
            return;
        }
        let next = self
            .lines
            .range((std::ops::Bound::Excluded(&key), std::ops::Bound::Unbounded))
            .next()
            .and_then(|(_, line)| line.bar.clone());
        let bar = match &mut self.target {
            Target::Terminal { multi, color } => {
                let bar = ProgressBar::new_spinner()
                    .with_style(spinner_style(*color))
                    .with_elapsed(elapsed)
                    .with_message(message(&label, entry.chars_accumulated));
                let bar = match next {
                    Some(next) => multi.insert_before(&next, bar),
                    None => multi.add(bar),
                };
                bar.enable_steady_tick(Duration::from_millis(100));
                self.mid_line = true;
                Some(bar)
            }
            Target::Plain(out) => {
                let _ = writeln!(
                    out,
                    "{}",
                    render_line("⠿", &label, entry.chars_accumulated, elapsed)
                );
                None
            }
            Target::Off => None,
        };
        self.lines.insert(
            key,
            Line {
                name: entry.name.clone(),
                chars: entry.chars_accumulated,
                started_at_ms: entry.started_at_ms,
                bar,
                last_written_ms: now_ms,
            },
        );
    }

    /// A tool of `session` ended as `entry` (its last state): its line ends
    /// with a final line, drawn on its own if it never had a spinner (it
    /// started and ended while the terminal was paused).
    fn end(&mut self, session: &str, entry: &ProgressEntry, outcome: Outcome, now_ms: u64) {
        let key = (session.to_owned(), entry.choice, entry.index);
        let bar = self.lines.remove(&key).and_then(|line| line.bar);
        let line = Line {
            name: Arc::clone(&entry.name),
            chars: entry.chars_accumulated,
            started_at_ms: entry.started_at_ms,
            bar,
            last_written_ms: now_ms,
        };
        self.finish(&key, line, outcome, now_ms);
    }

    /// A line above the spinners.
    fn println(&mut self, text: &str) {
        match &mut self.target {
            Target::Terminal { multi, .. } => {
                let _ = multi.println(text);
                self.mid_line = true;
            }
            Target::Plain(out) => {
                let _ = writeln!(out, "{text}");
            }
            Target::Off => {}
        }
    }

    fn finish(&mut self, key: &Key, line: Line, outcome: Outcome, now_ms: u64) {
        let elapsed = Duration::from_millis(now_ms.saturating_sub(line.started_at_ms));
        let text = render_line(
            outcome.icon(),
            &shown_name(&key.0, key.1, &line.name),
            line.chars,
            elapsed,
        );
        match &mut self.target {
            Target::Terminal { multi, .. } => {
                if let Some(bar) = line.bar {
                    bar.finish_and_clear();
                    multi.remove(&bar);
                }
                let _ = multi.println(text);
                self.mid_line = true;
            }
            Target::Plain(out) => {
                let _ = writeln!(out, "{text}");
            }
            Target::Off => {}
        }
    }
}

fn spinner_style(color: bool) -> ProgressStyle {
    let template = if color {
        "{spinner:.cyan} {msg}{secs}"
    } else {
        "{spinner} {msg}{secs}"
    };
    ProgressStyle::with_template(template)
        .unwrap_or_else(|_| ProgressStyle::default_spinner())
        .tick_chars(&format!("{SPINNER}✓"))
        .with_key(
            "secs",
            |state: &indicatif::ProgressState, w: &mut dyn std::fmt::Write| {
                let _ = w.write_str(&seconds(state.elapsed()));
            },
        )
}

#[cfg(test)]
mod tests;
