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
//! Read [`status_line`] first.

use std::collections::BTreeMap;
use std::io::Write;
use std::sync::{Arc, Mutex};
use std::time::Duration;

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
    inner: Mutex<Inner>,
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
            inner: Mutex::new(Inner {
                target,
                lines: BTreeMap::new(),
            }),
        }
    }

    /// True when nothing is ever drawn (callers can skip the work).
    pub fn is_off(&self) -> bool {
        matches!(self.lock().target, Target::Off)
    }

    /// The in-progress tools of `session` are now `entries` (sorted by
    /// choice, then index; empty when the state cleared). Tools that are no
    /// longer there end with a final line marked as `outcome` says.
    pub fn show(&self, session: &str, entries: &[ProgressEntry], outcome: Outcome, now_ms: u64) {
        let mut inner = self.lock();
        if matches!(inner.target, Target::Off) {
            return;
        }
        let gone: Vec<Key> = inner
            .lines
            .range((session.to_owned(), i64::MIN, i64::MIN)..)
            .take_while(|(k, _)| k.0 == session)
            .filter(|(k, _)| !entries.iter().any(|e| e.choice == k.1 && e.index == k.2))
            .map(|(k, _)| k.clone())
            .collect();
        for key in gone {
            if let Some(line) = inner.lines.remove(&key) {
                inner.finish(&key, line, outcome, now_ms);
            }
        }
        for entry in entries {
            let key = (session.to_owned(), entry.choice, entry.index);
            inner.update(key, entry, now_ms);
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl Inner {
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
