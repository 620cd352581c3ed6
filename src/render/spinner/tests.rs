use std::sync::{Arc, Mutex};

use indicatif::{InMemoryTerm, ProgressDrawTarget, TermLike};

use super::*;

fn entry(index: i64, name: &str, chars: usize, started_at_ms: u64) -> ProgressEntry {
    ProgressEntry {
        choice: 0,
        index,
        name: name.into(),
        chars_accumulated: chars,
        started_at_ms,
    }
}

#[test]
fn status_lines() {
    let s = Duration::from_millis;
    insta::assert_snapshot!(status_line("⠙", "get_weather", 142, s(3200)), @"⠙ get_weather  142 chars · 3.2s");
    insta::assert_snapshot!(status_line("✓", "get_weather", 0, s(0)), @"✓ get_weather  0 chars · 0.0s");
    // Wide characters are kept whole.
    insta::assert_snapshot!(status_line("✓", "天気を調べる", 12, s(61_049)), @"✓ 天気を調べる  12 chars · 61.0s");
    // Rounding to one decimal.
    insta::assert_snapshot!(status_line("⠙", "f", 1, s(49)), @"⠙ f  1 chars · 0.0s");
    insta::assert_snapshot!(status_line("⠙", "f", 1, s(51)), @"⠙ f  1 chars · 0.1s");
    insta::assert_snapshot!(status_line("⠙", "f", 1, s(9_960)), @"⠙ f  1 chars · 10.0s");
    // A missing name still says what the line is.
    insta::assert_snapshot!(status_line("⠙", "", 5, s(100)), @"⠙ (unnamed)  5 chars · 0.1s");
}

#[test]
fn hostile_names_are_neutralized() {
    // An escape sequence that would clear the screen, bidi overrides that
    // would reorder the line, zero-width characters, a line break.
    let name = "rm\u{1b}[2J\u{202E}fdp\u{202C}\u{200B}_all\nnow\u{7f}";
    let line = status_line("⠙", name, 3, Duration::from_millis(1500));
    assert!(!line.chars().any(|c| c.is_control()), "{line:?}");
    insta::assert_snapshot!(line, @"⠙ rm[2Jfdp_all now  3 chars · 1.5s");
    // Separators some terminals break lines at, and invisible characters
    // that can hide text: the soft hyphen, tag characters.
    let line = status_line(
        "⠙",
        "a\u{2028}b\u{2029}c\u{AD}d\u{E0041}\u{E007F}e",
        1,
        Duration::ZERO,
    );
    insta::assert_snapshot!(line, @"⠙ abcde  1 chars · 0.0s");
    // Long names are cut at a character boundary.
    let long = "é".repeat(60);
    let shown = sanitize_name(&long);
    assert_eq!(shown.chars().count(), MAX_NAME_CHARS + 1);
    assert!(shown.ends_with('…'));
}

/// Spinners drawn on `term`, without colour, redrawn up to 100 times a
/// second.
fn on_memory_term(term: &InMemoryTerm) -> ProgressDisplay {
    ProgressDisplay::terminal(
        ProgressDrawTarget::term_like_with_hz(Box::new(term.clone()), 100),
        false,
    )
}

#[test]
fn two_parallel_tools_then_a_clear_on_a_terminal() {
    let term = InMemoryTerm::new(10, 80);
    let display = on_memory_term(&term);
    let now = 1_000_000;
    // The second tool is announced first: lines still come in index order.
    display.show(
        "",
        &[entry(1, "get_time", 7, now - 1200)],
        Outcome::Done,
        now,
    );
    display.show(
        "",
        &[
            entry(0, "get_weather", 42, now - 3200),
            entry(1, "get_time", 9, now - 1200),
        ],
        Outcome::Done,
        now,
    );
    std::thread::sleep(Duration::from_millis(150));
    let screen = term.contents();
    let lines: Vec<&str> = screen.lines().filter(|l| !l.trim().is_empty()).collect();
    assert_eq!(lines.len(), 2, "{screen}");
    assert!(lines[0].contains("get_weather  42 chars · 3."), "{screen}");
    assert!(lines[1].contains("get_time  9 chars · 1."), "{screen}");
    // Text resumes: both end with a final line, nothing spins any more.
    display.show("", &[], Outcome::Done, now + 800);
    std::thread::sleep(Duration::from_millis(150));
    let screen = term.contents();
    let lines: Vec<&str> = screen.lines().filter(|l| !l.trim().is_empty()).collect();
    assert_eq!(
        lines,
        vec![
            "✓ get_weather  42 chars · 4.0s",
            "✓ get_time  9 chars · 2.0s"
        ],
        "{screen}"
    );
    assert_eq!(term.height(), 10);
}

/// Interrupted (`annotate` on SIGINT): every spinner of every session ends
/// with a `✗` line, and what is shown afterwards draws nothing.
#[test]
fn an_interrupt_ends_every_spinner_and_draws_nothing_after() {
    let term = InMemoryTerm::new(10, 80);
    let display = on_memory_term(&term);
    let now = 1_000_000;
    display.show(
        "",
        &[
            entry(0, "get_weather", 42, now - 3200),
            entry(1, "get_time", 9, now - 1200),
        ],
        Outcome::Done,
        now,
    );
    display.show("b", &[entry(0, "edit_file", 5, now)], Outcome::Done, now);
    std::thread::sleep(Duration::from_millis(150));
    display.interrupt(now + 800);
    // A state shown after the interrupt (the pipeline's next read) and a
    // tick's worth of time: nothing is drawn again.
    display.show(
        "",
        &[entry(0, "get_weather", 50, now - 3200)],
        Outcome::Done,
        now + 900,
    );
    std::thread::sleep(Duration::from_millis(150));
    let screen = term.contents();
    let lines: Vec<&str> = screen.lines().filter(|l| !l.trim().is_empty()).collect();
    assert_eq!(
        lines,
        vec![
            "✗ get_weather  42 chars · 4.0s",
            "✗ get_time  9 chars · 2.0s",
            "✗ [b] edit_file  5 chars · 0.8s",
        ],
        "{screen}"
    );
    assert!(display.is_off());
}

#[test]
fn a_failed_stream_ends_with_crosses_and_sessions_are_labelled() {
    let buffer = Arc::new(Mutex::new(Vec::new()));
    let display = ProgressDisplay::plain(Box::new(SharedBuffer(buffer.clone())));
    display.show(
        "chat-1",
        &[entry(0, "edit_file", 10, 0)],
        Outcome::Done,
        500,
    );
    display.show("chat-1", &[], Outcome::Failed, 2500);
    let text = String::from_utf8(buffer.lock().expect("lock").clone()).expect("UTF-8");
    insta::assert_snapshot!(text, @r"
    ⠿ [chat-1] edit_file  10 chars · 0.5s
    ✗ [chat-1] edit_file  10 chars · 2.5s
    ");
}

#[test]
fn plain_lines_are_rate_limited_per_tool() {
    let buffer = Arc::new(Mutex::new(Vec::new()));
    let display = ProgressDisplay::plain(Box::new(SharedBuffer(buffer.clone())));
    // Ten updates within a second give the first line only; one a second
    // later gives another; the clear gives the final one.
    for i in 0..10 {
        display.show("", &[entry(0, "f", i, 0)], Outcome::Done, 100 * i as u64);
    }
    display.show("", &[entry(0, "f", 50, 0)], Outcome::Done, 1200);
    display.show("", &[], Outcome::Done, 1300);
    let text = String::from_utf8(buffer.lock().expect("lock").clone()).expect("UTF-8");
    insta::assert_snapshot!(text, @r"
    ⠿ f  0 chars · 0.0s
    ⠿ f  50 chars · 1.2s
    ✓ f  50 chars · 1.3s
    ");
}

#[test]
fn never_and_auto_without_a_terminal_draw_nothing() {
    assert!(ProgressDisplay::new(ProgressMode::Never, true, true).is_off());
    assert!(ProgressDisplay::new(ProgressMode::Auto, false, true).is_off());
    assert!(!ProgressDisplay::new(ProgressMode::Always, false, true).is_off());
}

/// A writer tests can read back.
struct SharedBuffer(Arc<Mutex<Vec<u8>>>);

impl std::io::Write for SharedBuffer {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().expect("lock").extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[test]
fn a_long_session_id_never_hides_the_tool_name() {
    let buffer = Arc::new(Mutex::new(Vec::new()));
    let display = ProgressDisplay::plain(Box::new(SharedBuffer(buffer.clone())));
    let session = "conversation-0123456789abcdef0123456789abcdef0123456789abcdef";
    display.show(
        session,
        &[entry(0, "get_weather", 47, 0)],
        Outcome::Done,
        1200,
    );
    display.show(session, &[], Outcome::Done, 1200);
    let text = String::from_utf8(buffer.lock().expect("lock").clone()).expect("UTF-8");
    insta::assert_snapshot!(text, @r"
    ⠿ [conversation-0123456789a…] get_weather  47 chars · 1.2s
    ✓ [conversation-0123456789a…] get_weather  47 chars · 1.2s
    ");
}

/// An in-memory terminal whose writes block while it is paused, as a real
/// one's do after Ctrl-S; it says on `blocked` when a write first waits.
#[derive(Debug, Clone)]
struct PausedTerm {
    term: InMemoryTerm,
    paused: Arc<(Mutex<bool>, std::sync::Condvar)>,
    blocked: Arc<Mutex<Option<std::sync::mpsc::Sender<()>>>>,
}

impl PausedTerm {
    /// A paused terminal, and what says when a write first waits on it.
    fn paused(rows: u16, cols: u16) -> (PausedTerm, std::sync::mpsc::Receiver<()>) {
        let (blocked, first_blocked) = std::sync::mpsc::channel();
        let term = PausedTerm {
            term: InMemoryTerm::new(rows, cols),
            paused: Arc::new((Mutex::new(true), std::sync::Condvar::new())),
            blocked: Arc::new(Mutex::new(Some(blocked))),
        };
        (term, first_blocked)
    }

    fn resume(&self) {
        *self.paused.0.lock().expect("lock") = false;
        self.paused.1.notify_all();
    }

    fn wait(&self) {
        let mut paused = self.paused.0.lock().expect("lock");
        if *paused && let Some(blocked) = self.blocked.lock().expect("lock").take() {
            let _ = blocked.send(());
        }
        while *paused {
            paused = self.paused.1.wait(paused).expect("wait");
        }
    }
}

impl TermLike for PausedTerm {
    fn width(&self) -> u16 {
        self.term.width()
    }
    fn height(&self) -> u16 {
        self.term.height()
    }
    fn move_cursor_up(&self, n: usize) -> std::io::Result<()> {
        self.wait();
        self.term.move_cursor_up(n)
    }
    fn move_cursor_down(&self, n: usize) -> std::io::Result<()> {
        self.wait();
        self.term.move_cursor_down(n)
    }
    fn move_cursor_right(&self, n: usize) -> std::io::Result<()> {
        self.wait();
        self.term.move_cursor_right(n)
    }
    fn move_cursor_left(&self, n: usize) -> std::io::Result<()> {
        self.wait();
        self.term.move_cursor_left(n)
    }
    fn write_line(&self, s: &str) -> std::io::Result<()> {
        self.wait();
        self.term.write_line(s)
    }
    fn write_str(&self, s: &str) -> std::io::Result<()> {
        self.wait();
        self.term.write_str(s)
    }
    fn clear_line(&self) -> std::io::Result<()> {
        self.wait();
        self.term.clear_line()
    }
    fn flush(&self) -> std::io::Result<()> {
        self.wait();
        self.term.flush()
    }
}

/// Spinners drawn apart, on `term`.
fn drawn_apart_on(term: &PausedTerm) -> ProgressDisplay {
    ProgressDisplay::terminal(
        ProgressDrawTarget::term_like_with_hz(Box::new(term.clone()), 100),
        false,
    )
    .drawn_apart()
}

#[test]
fn a_paused_terminal_holds_up_only_the_drawing() {
    let (term, _) = PausedTerm::paused(40, 80);
    let display = Arc::new(drawn_apart_on(&term));
    let (done, finished) = std::sync::mpsc::channel();
    let shower = Arc::clone(&display);
    std::thread::spawn(move || {
        for n in 1..=1_000 {
            let session = format!("s{}", n % 10);
            shower.show(
                &session,
                &[entry(0, "get_weather", n, 0)],
                Outcome::Done,
                1_000,
            );
        }
        for n in 0..10 {
            shower.show(&format!("s{n}"), &[], Outcome::Done, 2_000);
        }
        let _ = done.send(());
    });
    // Drawn in place, the first draw blocks until the terminal resumes.
    assert!(
        finished.recv_timeout(Duration::from_secs(10)).is_ok(),
        "show() blocked on a paused terminal"
    );
    assert!(
        !display.flush(Duration::from_millis(50)),
        "drawn while paused"
    );
    term.resume();
    assert!(
        display.flush(Duration::from_secs(10)),
        "not drawn once resumed"
    );
    let contents = term.term.contents();
    for n in 0..10 {
        // Each session's last state before its end: 990 + n chars (n > 0),
        // 1,000 for s0.
        let chars = if n == 0 { 1_000 } else { 990 + n };
        let line = format!("✓ [s{n}] get_weather  {chars} chars · 2.0s");
        assert!(contents.contains(&line), "no {line:?} in:\n{contents}");
    }
}

/// Rounds of one session while the terminal is paused, each a tool that
/// starts, grows and ends (`✗` when `failed`), then the next stream's
/// start.
fn rounds(display: &ProgressDisplay, count: i64, failed: impl Fn(i64) -> bool) {
    for round in 0..count {
        let name = format!("t{round}");
        let at = 1_000 * round as u64;
        for chars in 1..=3 {
            display.show(
                "s",
                &[entry(round % 2, &name, chars, at)],
                Outcome::Done,
                at + 100,
            );
        }
        let outcome = if failed(round) {
            Outcome::Failed
        } else {
            Outcome::Done
        };
        display.show("s", &[], outcome, at + 500);
        display.show("s", &[], Outcome::Done, at + 600);
    }
}

#[test]
fn every_tools_final_line_is_drawn_once_the_terminal_resumes() {
    let (term, blocked) = PausedTerm::paused(60, 80);
    let display = drawn_apart_on(&term);
    // A tool drawn before the pause (its spinner waits in the terminal),
    // then a rename, a second tool, and the end of both.
    let show = |entries: &[ProgressEntry], outcome| display.show("p", entries, outcome, 5_000);
    show(&[entry(0, "a", 1, 0)], Outcome::Done);
    blocked
        .recv()
        .expect("the drawing thread waits on the terminal");
    show(&[entry(0, "a", 9, 0), entry(1, "b", 2, 0)], Outcome::Done);
    show(&[entry(1, "b", 3, 0)], Outcome::Done);
    show(&[], Outcome::Failed);
    // Thirty rounds of another session, every third one failed.
    rounds(&display, 30, |round| round % 3 == 0);
    term.resume();
    assert!(display.flush(Duration::from_secs(10)));
    let contents = term.term.contents();
    let mut expected = vec![
        "✓ [p] a  9 chars · 5.0s".to_owned(),
        "✗ [p] b  3 chars · 5.0s".to_owned(),
    ];
    expected.extend((0..30).map(|round| {
        let icon = if round % 3 == 0 { "✗" } else { "✓" };
        format!("{icon} [s] t{round}  3 chars · 0.5s")
    }));
    let drawn: Vec<&str> = contents.lines().map(str::trim_end).collect();
    assert_eq!(drawn, expected, "in:\n{contents}");
}

#[test]
fn final_lines_past_the_bound_are_counted() {
    let (term, _) = PausedTerm::paused(20, 100);
    term.resume();
    let display = drawn_apart_on(&term);
    let apart = display.apart.as_ref().expect("drawn apart");
    // The drawing thread takes the first state, then waits for the
    // display: everything after it waits.
    let drawing = lock(&display.inner);
    display.show("first", &[entry(0, "a", 1, 0)], Outcome::Done, 0);
    let start = std::time::Instant::now();
    while !lock(&apart.state).drawing {
        assert!(start.elapsed() < Duration::from_secs(10), "never drawn");
        std::thread::sleep(Duration::from_millis(1));
    }
    let over = 10;
    for n in 0..MAX_WAITING_FINAL_LINES + over {
        let session = format!("s{n}");
        display.show(&session, &[entry(0, "f", 1, 0)], Outcome::Done, 0);
        display.show(&session, &[], Outcome::Done, 0);
    }
    {
        let state = lock(&apart.state);
        assert_eq!(state.finals.len(), MAX_WAITING_FINAL_LINES);
        assert_eq!(state.dropped_finals, over);
        // Sessions with no tool in progress are not kept.
        assert_eq!(state.sessions.keys().collect::<Vec<_>>(), ["first"]);
    }
    drop(drawing);
    assert!(display.flush(Duration::from_secs(10)));
    let contents = term.term.contents();
    assert!(
        contents.contains("(10 more tools ended while the terminal took no output)"),
        "{contents}"
    );
}

#[test]
fn a_session_with_nothing_to_draw_leaves_nothing_waiting() {
    let (term, _) = PausedTerm::paused(20, 80);
    let display = drawn_apart_on(&term);
    // Streams without tool calls: each begins and ends with nothing.
    for n in 0..1_000 {
        display.show(&format!("s{n}"), &[], Outcome::Done, 0);
    }
    let apart = display.apart.as_ref().expect("drawn apart");
    let state = lock(&apart.state);
    assert!(state.sessions.is_empty() && state.finals.is_empty() && !state.pending);
}

/// Drawn apart, as `serve` draws: a tool told to have ended gets its
/// final line with the count it was told, once; one that was never shown
/// (it began and ended between two states) gets its final line alone;
/// the tools still in progress spin on.
#[test]
fn drawn_apart_each_ended_tool_ends_once_with_its_last_count() {
    let (term, blocked) = PausedTerm::paused(20, 80);
    let display = drawn_apart_on(&term);
    display.show("p", &[entry(0, "a", 3, 0)], Outcome::Done, 1_000);
    blocked
        .recv()
        .expect("the drawing thread waits on the terminal");
    display.show(
        "p",
        &[entry(0, "a", 5, 0), entry(2, "c", 1, 0)],
        Outcome::Done,
        1_500,
    );
    // One burst: `a` grew to 16 and ended, `b` began and ended, `c` goes on.
    display.ended("p", &entry(0, "a", 16, 0), Outcome::Done, 2_000);
    display.ended("p", &entry(1, "b", 2, 0), Outcome::Failed, 2_000);
    display.show("p", &[entry(2, "c", 4, 0)], Outcome::Done, 2_000);
    term.resume();
    assert!(display.flush(Duration::from_secs(10)));
    let finals = |contents: &str| -> Vec<String> {
        contents
            .lines()
            .map(str::trim_end)
            .filter(|l| l.starts_with('✓') || l.starts_with('✗'))
            .map(str::to_owned)
            .collect()
    };
    let contents = term.term.contents();
    assert_eq!(
        finals(&contents),
        ["✓ [p] a  16 chars · 2.0s", "✗ [p] b  2 chars · 2.0s"],
        "{contents}"
    );
    // `c` ends with the session's end, and `a` is not ended again.
    display.show("p", &[], Outcome::Done, 3_000);
    assert!(display.flush(Duration::from_secs(10)));
    let contents = term.term.contents();
    assert_eq!(
        finals(&contents),
        [
            "✓ [p] a  16 chars · 2.0s",
            "✗ [p] b  2 chars · 2.0s",
            "✓ [p] c  4 chars · 3.0s"
        ],
        "{contents}"
    );
}

/// Text written to the in-memory terminal, as a program writes it to a
/// real one (a line break returns the cursor too).
struct TermWriter(InMemoryTerm);

impl Write for TermWriter {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let text = String::from_utf8_lossy(buf).replace('\n', "\r\n");
        self.0.write_str(&text)?;
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Lines written above the spinners stay on the screen, above them, and
/// the spinners are drawn once, below: written straight to the terminal,
/// each line was erased by the spinners' next redraw (the cursor moved up
/// over it). A line is written only once it is whole.
#[test]
fn lines_written_above_the_spinners_stay() {
    let term = InMemoryTerm::new(10, 80);
    let display = on_memory_term(&term);
    let now = 1_000_000;
    let show = |chars| {
        display.show(
            "",
            &[
                entry(0, "get_weather", chars, now - 3200),
                entry(1, "get_time", chars, now - 1200),
            ],
            Outcome::Done,
            now,
        );
        std::thread::sleep(Duration::from_millis(30));
    };
    show(1);
    let mut above = display.above(TermWriter(term.clone()));
    write!(above, "aalis-proxy: warning: one\nand a half").expect("held");
    above.flush().expect("written");
    show(2);
    above.write_all(b" line\n").expect("held");
    above.flush().expect("written");
    show(3);
    let screen = term.contents();
    let lines: Vec<&str> = screen.lines().filter(|l| !l.trim().is_empty()).collect();
    assert_eq!(lines.len(), 4, "{screen}");
    assert_eq!(lines[0], "aalis-proxy: warning: one", "{screen}");
    assert_eq!(lines[1], "and a half line", "{screen}");
    assert!(lines[2].contains("get_weather  3 chars"), "{screen}");
    assert!(lines[3].contains("get_time  3 chars"), "{screen}");
}

/// A line written once the last spinner has ended goes below that tool's
/// final line, not after it on the same line (indicatif leaves the cursor
/// at the end of the line it drew). The terminal here is wider than the
/// lines indicatif pads, as when it cannot tell the width.
#[test]
fn text_after_the_last_final_line_starts_below_it() {
    let term = InMemoryTerm::new(10, 120);
    let display = ProgressDisplay::terminal(
        ProgressDrawTarget::term_like_with_hz(Box::new(NarrowTerm(term.clone())), 100),
        false,
    );
    let now = 1_000_000;
    display.show(
        "",
        &[entry(0, "get_weather", 3, now - 200)],
        Outcome::Done,
        now,
    );
    std::thread::sleep(Duration::from_millis(30));
    display.show("", &[], Outcome::Done, now + 100);
    let mut above = display.above(TermWriter(term.clone()));
    above.write_all(b"a log line\n").expect("held");
    above.flush().expect("written");
    display.show(
        "",
        &[entry(1, "get_time", 2, now)],
        Outcome::Done,
        now + 200,
    );
    std::thread::sleep(Duration::from_millis(30));
    display.show("", &[], Outcome::Done, now + 300);
    let screen = term.contents();
    let lines: Vec<&str> = screen.lines().map(str::trim_end).collect();
    assert_eq!(lines[0], "✓ get_weather  3 chars · 0.3s", "{screen}");
    assert_eq!(lines[1], "a log line", "{screen}");
    assert_eq!(lines[2], "✓ get_time  2 chars · 0.3s", "{screen}");
}

/// A writer that refuses every other write with `WouldBlock` and takes
/// at most 5 bytes of the others, as a full non-blocking stderr does.
struct Full(Arc<Mutex<Vec<u8>>>, bool);

impl Write for Full {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.1 = !self.1;
        if self.1 {
            return Err(std::io::ErrorKind::WouldBlock.into());
        }
        let n = buf.len().min(5);
        self.0.lock().expect("lock").extend_from_slice(&buf[..n]);
        Ok(n)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Lines written above the spinners to a stderr left non-blocking are
/// waited for when it is full, and go whole (`serve`'s log lines on a
/// terminal come this way). They were dropped at the first `WouldBlock`.
#[test]
fn lines_above_the_spinners_wait_for_a_full_stderr() {
    let term = InMemoryTerm::new(10, 80);
    let display = on_memory_term(&term);
    let got = Arc::new(Mutex::new(Vec::new()));
    let mut above = display.above(Full(Arc::clone(&got), false));
    above.write_all(b"one line\nand another\n").expect("held");
    above.flush().expect("written");
    assert_eq!(*got.lock().expect("lock"), b"one line\nand another\n");
}

/// An in-memory terminal that tells indicatif it is 80 columns wide.
#[derive(Debug, Clone)]
struct NarrowTerm(InMemoryTerm);

impl TermLike for NarrowTerm {
    fn width(&self) -> u16 {
        80
    }
    fn move_cursor_up(&self, n: usize) -> std::io::Result<()> {
        self.0.move_cursor_up(n)
    }
    fn move_cursor_down(&self, n: usize) -> std::io::Result<()> {
        self.0.move_cursor_down(n)
    }
    fn move_cursor_right(&self, n: usize) -> std::io::Result<()> {
        self.0.move_cursor_right(n)
    }
    fn move_cursor_left(&self, n: usize) -> std::io::Result<()> {
        self.0.move_cursor_left(n)
    }
    fn write_line(&self, s: &str) -> std::io::Result<()> {
        self.0.write_line(s)
    }
    fn write_str(&self, s: &str) -> std::io::Result<()> {
        self.0.write_str(s)
    }
    fn clear_line(&self) -> std::io::Result<()> {
        self.0.clear_line()
    }
    fn flush(&self) -> std::io::Result<()> {
        TermLike::flush(&self.0)
    }
}

/// With `n` > 1, the same tool called by two choices gets two lines that
/// say which is which (they were the same line twice).
#[test]
fn a_choice_past_the_first_is_named() {
    let buffer = Arc::new(Mutex::new(Vec::new()));
    let display = ProgressDisplay::plain(Box::new(SharedBuffer(buffer.clone())));
    let second = ProgressEntry {
        choice: 1,
        ..entry(0, "lookup_word", 7, 0)
    };
    display.show(
        "",
        &[entry(0, "lookup_word", 5, 0), second],
        Outcome::Done,
        300,
    );
    display.show("", &[], Outcome::Done, 400);
    let text = String::from_utf8(buffer.lock().expect("lock").clone()).expect("UTF-8");
    insta::assert_snapshot!(text, @r"
    ⠿ lookup_word  5 chars · 0.3s
    ⠿ lookup_word (choice 1)  7 chars · 0.3s
    ✓ lookup_word  5 chars · 0.4s
    ✓ lookup_word (choice 1)  7 chars · 0.4s
    ");
}
