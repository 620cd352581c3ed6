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

/// How a tool's generation ended, for its final line.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// Text resumed, the stream finished, or the tool started: `✓`.
    Done,
    /// The stream failed: `✗`.
    Failed,
}

impl Outcome {
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
    render_line(icon, &shown_name("", name), chars, elapsed)
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
fn shown_name(session: &str, name: &str) -> String {
    let name = sanitize_name(name);
    let name = if name.is_empty() {
        "(unnamed)".to_owned()
    } else {
        name
    };
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

/// Most updates one session keeps waiting for the drawing thread (see
/// [`Apart::leave`]). Past this many (a terminal paused through several
/// streams of one session), an update takes the last one's place, and the
/// tools that one ended may get no final line.
const MAX_WAITING_PER_SESSION: usize = 8;

/// What waits for the drawing thread, and how it is told.
struct Apart {
    state: Mutex<ApartState>,
    /// Something to draw, or the display was dropped.
    wake: Condvar,
    /// The drawing thread has drawn everything it was given.
    idle: Condvar,
}

#[derive(Default)]
struct ApartState {
    /// Each session's updates in the order they came (see
    /// [`MAX_WAITING_PER_SESSION`]).
    waiting: BTreeMap<String, Vec<Update>>,
    /// The drawing thread is drawing a batch it took.
    drawing: bool,
    /// The display was dropped: the thread draws what waits, and ends.
    closed: bool,
}

struct Update {
    entries: Vec<ProgressEntry>,
    outcome: Outcome,
    now_ms: u64,
    /// It may end tools of the state before it: it is drawn, not replaced.
    ends: bool,
}

struct Inner {
    target: Target,
    lines: BTreeMap<Key, Line>,
}

impl std::fmt::Debug for ProgressDisplay {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let inner = self.lock();
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

impl ProgressDisplay {
    /// The display `--progress=<mode>` asks for, given whether stderr is a
    /// terminal and whether colour is allowed (`NO_COLOR`).
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
            (ProgressMode::Never, _) | (ProgressMode::Auto, false) => Target::Off,
            (ProgressMode::Auto | ProgressMode::Always, true) => Target::Terminal {
                multi: MultiProgress::with_draw_target(ProgressDrawTarget::stderr()),
                color,
            },
            (ProgressMode::Always, false) => Target::Plain(plain()),
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
            })),
            apart: None,
        }
    }

    /// This display, drawn from a thread of its own when it draws on a
    /// terminal (`serve`): [`show`](Self::show) then leaves the new state
    /// for that thread and returns at once, so a terminal that does not
    /// take its writes (paused with Ctrl-S, or nobody reads it) holds up
    /// only the drawing. Plain lines and an off display are left as they
    /// are (plain lines go to a writer of the caller's choosing, `serve`'s
    /// log queue, which never blocks). If the thread cannot be started,
    /// the display draws in place, as before.
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
        while !state.waiting.is_empty() || state.drawing {
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

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        lock(&self.inner)
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
    /// Leaves a session's new state for the drawing thread.
    ///
    /// Each update holds the session's whole state, so one that waits can
    /// take the place of the last waiting one, if drawing it alone draws
    /// the same final lines as drawing both: when that one ended no tool
    /// of the state before it, and this one ends none of its tools, with
    /// the same outcome. Otherwise it waits after it (the first waiting
    /// update counts as one that ended tools: what was drawn before it is
    /// not kept here). Nothing after nothing is dropped.
    fn leave(&self, session: &str, entries: &[ProgressEntry], outcome: Outcome, now_ms: u64) {
        let mut state = lock(&self.state);
        let updates = match state.waiting.get_mut(session) {
            Some(updates) => updates,
            None => state.waiting.entry(session.to_owned()).or_default(),
        };
        let full = updates.len() >= MAX_WAITING_PER_SESSION;
        let ends = match updates.last_mut() {
            Some(last) if last.entries.is_empty() && entries.is_empty() => return,
            Some(last)
                if full
                    || (!last.ends
                        && last.outcome == outcome
                        && ends_none(&last.entries, entries)) =>
            {
                last.entries.clear();
                last.entries.extend_from_slice(entries);
                last.outcome = outcome;
                last.now_ms = now_ms;
                last.ends |= full;
                None
            }
            Some(last) => Some(!ends_none(&last.entries, entries)),
            None => Some(true),
        };
        if let Some(ends) = ends {
            updates.push(Update {
                entries: entries.to_vec(),
                outcome,
                now_ms,
                ends,
            });
        }
        drop(state);
        self.wake.notify_one();
    }
}

/// Whether every tool of `before` is still in `after`.
fn ends_none(before: &[ProgressEntry], after: &[ProgressEntry]) -> bool {
    before.iter().all(|b| {
        after
            .iter()
            .any(|a| a.choice == b.choice && a.index == b.index)
    })
}

/// The drawing thread of [`ProgressDisplay::drawn_apart`]: takes what
/// waits, draws it, and waits again; ends when the display is dropped.
fn draw_apart(inner: &Mutex<Inner>, apart: &Apart) {
    loop {
        let batch = {
            let mut state = lock(&apart.state);
            state.drawing = false;
            apart.idle.notify_all();
            while state.waiting.is_empty() && !state.closed {
                state = apart.wake.wait(state).unwrap_or_else(|e| e.into_inner());
            }
            if state.waiting.is_empty() {
                return;
            }
            state.drawing = true;
            std::mem::take(&mut state.waiting)
        };
        let mut inner = lock(inner);
        for (session, updates) in &batch {
            for update in updates {
                inner.show(session, &update.entries, update.outcome, update.now_ms);
            }
        }
    }
}

impl Inner {
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
        let label = shown_name(&key.0, &entry.name);
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

    fn finish(&mut self, key: &Key, line: Line, outcome: Outcome, now_ms: u64) {
        let elapsed = Duration::from_millis(now_ms.saturating_sub(line.started_at_ms));
        let text = render_line(
            outcome.icon(),
            &shown_name(&key.0, &line.name),
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
