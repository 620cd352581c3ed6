use super::*;
use crate::chunk::{ArgumentsDelta, Chunk, ToolCallDelta};
use crate::progress::StreamPhase;

/// A tracker after deltas `(index, name, args)` at time `now` (the clock is
/// a value: these tests never sleep).
fn tracker_with(calls: &[(i64, &str, &str)], now: u64) -> ToolCallTracker {
    let mut t = ToolCallTracker::new(true);
    for &(index, name, args) in calls {
        t.apply(&delta(index, name, args), now);
    }
    t
}

fn delta(index: i64, name: &str, args: &str) -> Chunk<'static> {
    Chunk::ToolCallDelta(ToolCallDelta {
        choice: 0,
        index: Some(index),
        id: None,
        name: Some(name.to_owned().into()),
        arguments: ArgumentsDelta::Append(std::borrow::Cow::<str>::Owned(args.to_owned()).into()),
        custom: false,
    })
}

/// `session`'s calls in progress as `(index, charsAccumulated, startedAt)`.
fn calls(registry: &SessionRegistry, session: &str) -> Vec<(i64, usize, u64)> {
    registry
        .snapshot(session)
        .iter()
        .map(|p| (p.index, p.chars_accumulated, p.started_at_ms))
        .collect()
}

fn progress_event(index: i64, name: &str, chars: usize, started: u64) -> StreamEvent {
    StreamEvent::Progress(ProgressEntry {
        choice: 0,
        index,
        name: name.into(),
        chars_accumulated: chars,
        started_at_ms: started,
    })
}

fn received(sub: &mut Subscription) -> Vec<String> {
    let mut out = Vec::new();
    while let Ok(frame) = sub.frames.try_recv() {
        out.push(frame.to_string());
    }
    out
}

/// `serverTime` changes from run to run; everything else is exact.
fn without_server_time(frame: &str) -> String {
    match frame.find(",\"serverTime\":") {
        Some(at) => format!("{}}}", &frame[..at]),
        None => frame.to_owned(),
    }
}

/// The frames received so far, each [`without_server_time`].
fn received_untimed(sub: &mut Subscription) -> Vec<String> {
    received(sub)
        .iter()
        .map(|f| without_server_time(f))
        .collect()
}

#[test]
fn publish_snapshot_and_end() {
    let registry = SessionRegistry::new();
    let mut stream = registry.begin_stream("s1");
    stream.publish(&mut tracker_with(&[(1, "b", "xy"), (0, "a", "")], 5), &[]);
    let names: Vec<_> = registry
        .snapshot("s1")
        .into_iter()
        .map(|p| (p.index, p.name, p.chars_accumulated, p.started_at_ms))
        .collect();
    assert_eq!(names, vec![(0, "a".into(), 0, 5), (1, "b".into(), 2, 5)]);
    assert!(registry.sessions_resume().contains(r#""sessionId":"s1""#));
    drop(stream);
    assert!(registry.snapshot("s1").is_empty());
    assert!(registry.is_empty(), "nothing uses the session any more");
}

#[test]
fn same_index_keeps_started_at_new_index_gets_its_own() {
    let registry = SessionRegistry::new();
    let mut stream = registry.begin_stream("s1");
    let mut tracker = tracker_with(&[(0, "a", "x")], 1_000);
    stream.publish(&mut tracker, &[]);
    tracker.apply(&delta(0, "a", "yz"), 2_000);
    tracker.apply(&delta(1, "b", ""), 3_000);
    stream.publish(&mut tracker, &[]);
    let started = calls(&registry, "s1");
    assert_eq!(started, vec![(0, 3, 1_000), (1, 0, 3_000)]);
}

#[test]
fn a_new_request_clears_and_the_old_stream_cannot_overwrite() {
    let registry = SessionRegistry::new();
    let mut sub = registry.subscribe("s1");
    let mut old = registry.begin_stream("s1");
    old.publish(&mut tracker_with(&[(0, "a", "abc")], 1), &[]);
    let mut new = registry.begin_stream("s1");
    assert!(registry.snapshot("s1").is_empty());
    old.publish(
        &mut tracker_with(&[(0, "stale", "")], 2),
        &[progress_event(0, "stale", 0, 2)],
    );
    assert!(registry.snapshot("s1").is_empty());
    new.publish(&mut tracker_with(&[(0, "fresh", "")], 3), &[]);
    drop(old);
    assert_eq!(&*registry.snapshot("s1")[0].name, "fresh");
    let frames = received_untimed(&mut sub);
    assert_eq!(
        frames,
        vec![r#"{"type":"tool_call_progress_clear","sessionId":"s1","reason":"new_request"}"#],
        "the old stream's late progress never reaches subscribers"
    );
    drop(new);
    assert_eq!(registry.len(), 1, "kept while subscribed");
    drop(sub);
    assert_eq!(registry.purge(Duration::ZERO), 1, "then expired");
}

#[test]
fn a_stale_stream_cannot_touch_the_session_that_took_its_slot() {
    let registry = SessionRegistry::new();
    let mut old = registry.begin_stream("s1");
    // Forced: a session is kept while any stream of it is open (a newer
    // stream's end gives it back to the older one), so the slot of a live
    // stream is not freed; the generation still guards it if it ever is.
    registry.lock().sessions.remove("s1");
    assert!(registry.is_empty(), "s1 is forgotten: its slot is free");
    // Another session takes the freed slot, first with a stream of its
    // own, then only subscribed to; the old stream of s1 still names it.
    for streamed in [true, false] {
        let mut sub = registry.subscribe("s2");
        let mut s2 = streamed.then(|| registry.begin_stream("s2"));
        if let Some(s2) = &mut s2 {
            s2.publish(&mut tracker_with(&[(0, "mine", "x")], 1), &[]);
        }
        assert_eq!(
            registry.lock().sessions.by_id.get("s2"),
            Some(&old.slot),
            "s2 took s1's slot"
        );
        let before = registry.snapshot("s2");
        old.publish(
            &mut tracker_with(&[(0, "stale", "abc")], 2),
            &[progress_event(0, "stale", 3, 2)],
        );
        assert_eq!(registry.snapshot("s2"), before, "streamed: {streamed}");
        assert!(
            received(&mut sub).iter().all(|f| !f.contains("stale")),
            "streamed: {streamed}"
        );
        assert!(registry.snapshot("s1").is_empty());
        assert_eq!(registry.len(), 1, "s1 is not made again");
        drop(s2);
        drop(sub);
        registry.release("s2");
        assert!(registry.is_empty());
    }
    let mut s3 = registry.begin_stream("s3");
    s3.publish(&mut tracker_with(&[(0, "kept", "xy")], 4), &[]);
    drop(old);
    assert_eq!(
        &*registry.snapshot("s3")[0].name,
        "kept",
        "the old stream's end clears nothing of s3"
    );
    assert_eq!(registry.len(), 1);
}

#[test]
fn a_subscriber_before_the_first_request_gets_an_empty_snapshot_then_everything() {
    let registry = SessionRegistry::new();
    let mut sub = registry.subscribe("s1");
    assert_eq!(
        without_server_time(&sub.resume),
        r#"{"type":"stream_resume","sessionId":"s1","toolCallsProgress":[],"streaming":false}"#
    );
    let mut stream = registry.begin_stream("s1");
    let mut tracker = tracker_with(&[(0, "get_weather", "{\"c")], 7);
    let events = vec![
        StreamEvent::Reasoning {
            choice: 0,
            text: "hm".into(),
        },
        progress_event(0, "get_weather", 3, 7),
    ];
    stream.publish(&mut tracker, &events);
    let mut later = ToolCallTracker::new(true);
    later.apply(&delta(0, "get_weather", "{\"c"), 7);
    later.apply(
        &Chunk::Text {
            choice: 0,
            text: "ok".into(),
        },
        9,
    );
    stream.publish(
        &mut later,
        &[
            StreamEvent::Cleared(ClearReason::Text),
            StreamEvent::Content {
                choice: 0,
                text: "ok".into(),
            },
            StreamEvent::Done,
        ],
    );
    drop(stream);
    let frames = received_untimed(&mut sub);
    assert_eq!(
        frames,
        vec![
            r#"{"sessionId":"s1","reasoningDelta":"hm"}"#,
            r#"{"sessionId":"s1","toolCallProgress":{"index":0,"name":"get_weather","charsAccumulated":3,"startedAt":7}}"#,
            r#"{"type":"tool_call_progress_clear","sessionId":"s1","reason":"text"}"#,
            r#"{"sessionId":"s1","contentDelta":"ok"}"#,
            r#"{"sessionId":"s1","done":true}"#,
        ]
    );
    assert_eq!(registry.len(), 1, "kept while subscribed");
}

#[test]
fn a_late_subscriber_resumes_mid_call_and_loses_nothing_after() {
    let registry = SessionRegistry::new();
    let mut stream = registry.begin_stream("s1");
    let mut tracker = tracker_with(&[(0, "a", "12345"), (1, "b", "1")], 100);
    stream.publish(&mut tracker, &[]);
    let mut sub = registry.subscribe("s1");
    assert_eq!(
        without_server_time(&sub.resume),
        r#"{"type":"stream_resume","sessionId":"s1","toolCallsProgress":[{"index":0,"name":"a","charsAccumulated":5,"startedAt":100},{"index":1,"name":"b","charsAccumulated":1,"startedAt":100}],"streaming":true}"#
    );
    tracker.apply(&delta(1, "b", "23"), 200);
    stream.publish(&mut tracker, &[progress_event(1, "b", 3, 100)]);
    assert_eq!(received(&mut sub).len(), 1);
}

/// Whether `id` holds a subscriber backlog (its broadcast channel).
fn has_backlog(registry: &SessionRegistry, id: &str) -> bool {
    registry
        .lock()
        .sessions
        .get(id)
        .is_some_and(|s| s.frames.is_some())
}

#[test]
fn a_session_keeps_a_subscriber_backlog_only_once_subscribed() {
    let registry = SessionRegistry::new();
    let mut stream = registry.begin_stream("s1");
    let mut tracker = tracker_with(&[(0, "a", "x")], 1);
    stream.publish(&mut tracker, &[progress_event(0, "a", 1, 1)]);
    assert!(
        !has_backlog(&registry, "s1"),
        "no subscriber yet: no channel"
    );
    let mut sub = registry.subscribe("s1");
    assert!(has_backlog(&registry, "s1"));
    tracker.apply(&delta(0, "a", "yz"), 2);
    stream.publish(&mut tracker, &[progress_event(0, "a", 3, 1)]);
    assert_eq!(received(&mut sub).len(), 1, "made late, it still delivers");
    drop(sub);
    drop(stream);
    assert!(registry.is_empty());
}

#[test]
fn tool_execution_clears_and_tells_subscribers() {
    let registry = SessionRegistry::new();
    let mut stream = registry.begin_stream("s1");
    stream.publish(&mut tracker_with(&[(0, "a", "x"), (1, "b", "")], 1), &[]);
    let mut sub = registry.subscribe("s1");
    assert_eq!(registry.tool_execution_started("s1"), 2);
    assert!(registry.snapshot("s1").is_empty());
    assert_eq!(registry.tool_execution_started("unknown"), 0);
    let frames = received_untimed(&mut sub);
    assert_eq!(
        frames,
        vec![r#"{"type":"tool_call_progress_clear","sessionId":"s1","reason":"tool_execute"}"#]
    );
}

/// A `tool-execute` clear is taken by the stream that owns the session,
/// whatever an older one of the session still open does. (Before, the two
/// shared the flag: the older stream took it and could publish nothing,
/// and the owner's next publish brought every cleared call back.)
#[test]
fn a_clear_is_taken_by_the_stream_that_owns_the_session() {
    let registry = SessionRegistry::new();
    let old = registry.begin_stream("s1");
    let mut new = registry.begin_stream("s1");
    let mut tracker = tracker_with(&[(0, "a", "x"), (1, "b", "")], 1);
    new.publish(&mut tracker, &[]);
    assert_eq!(registry.tool_execution_started("s1"), 2);
    // Each takes a clear of its own: the older one's taking it first
    // leaves the owner's.
    assert!(old.take_cleared());
    assert!(
        new.take_cleared(),
        "the older stream took the owner's clear"
    );
    // What the body does then, before its next read, and that read.
    tracker.tool_execution_started_elsewhere();
    tracker.apply(&delta(1, "b", "yz"), 2);
    new.publish(&mut tracker, &[]);
    let now = calls(&registry, "s1");
    assert_eq!(now, [(1, 2, 2)], "only what came after the clear");
}

/// A `tool-execute` clear that comes after a read and before its publish:
/// the calls that read brought were over before they were published, so
/// the publish brings back neither the cleared cards nor their progress
/// frames. (Before, both came back, and no clear followed them.)
#[test]
fn a_clear_between_a_read_and_its_publish_is_not_undone() {
    let registry = SessionRegistry::new();
    let mut stream = registry.begin_stream("s1");
    let mut tracker = tracker_with(&[(0, "a", "x")], 1);
    stream.publish(&mut tracker, &[]);
    let mut sub = registry.subscribe("s1");
    // A read: the call grows.
    tracker.apply(&delta(0, "a", "yz"), 2);
    let read = [progress_event(0, "a", 3, 1)];
    registry.tool_execution_started("s1");
    stream.publish(&mut tracker, &read);
    assert!(registry.snapshot("s1").is_empty());
    assert_eq!(
        received_untimed(&mut sub),
        [r#"{"type":"tool_call_progress_clear","sessionId":"s1","reason":"tool_execute"}"#]
    );
    assert!(!stream.take_cleared(), "taken by the publish");
    // The stream goes on: a new call is shown.
    tracker.apply(&delta(1, "b", "q"), 3);
    stream.publish(&mut tracker, &[progress_event(1, "b", 1, 3)]);
    assert_eq!(registry.snapshot("s1").len(), 1);
}

/// A stream that ends without a `done` of its own (no `[DONE]`: cut,
/// failed, cancelled, or one that just stops) tells its subscribers
/// `done` after its clear; one whose `done` was published tells them
/// once. (Before, the subscribers heard no end.)
#[test]
fn every_stream_end_tells_subscribers_done_once() {
    let registry = SessionRegistry::new();
    let mut stream = registry.begin_stream("s1");
    let mut sub = registry.subscribe("s1");
    let mut tracker = tracker_with(&[(0, "a", "x")], 1);
    stream.publish(&mut tracker, &[progress_event(0, "a", 1, 1)]);
    drop(stream);
    let frames = received_untimed(&mut sub);
    assert_eq!(
        &frames[1..],
        [
            r#"{"type":"tool_call_progress_clear","sessionId":"s1","reason":"stream_end"}"#,
            r#"{"sessionId":"s1","done":true}"#,
        ],
        "{frames:?}"
    );

    let mut stream = registry.begin_stream("s1");
    stream.publish(&mut ToolCallTracker::new(true), &[StreamEvent::Done]);
    drop(stream);
    assert_eq!(
        received_untimed(&mut sub),
        [r#"{"sessionId":"s1","done":true}"#]
    );
}

/// Two streams of one session at once: the newer one owns the session
/// while it is open; when it ends first, the session goes back to the
/// older one, whose next read publishes all its calls (their first
/// `startedAt` kept) and sends subscribers a fresh snapshot. (Before, the
/// older stream, still streaming its tool call, could publish nothing more:
/// the session stayed empty.)
#[test]
fn a_session_goes_back_to_the_older_stream_when_the_newer_ends_first() {
    let registry = SessionRegistry::new();
    let mut old = registry.begin_stream("s1");
    let mut tracker = tracker_with(&[(0, "write_file", "abc")], 1);
    old.publish(&mut tracker, &[]);
    let new = registry.begin_stream("s1");
    assert!(registry.snapshot("s1").is_empty(), "the new request clears");
    let mut sub = registry.subscribe("s1");
    drop(new);
    assert_eq!(
        received_untimed(&mut sub),
        [r#"{"sessionId":"s1","done":true}"#]
    );
    // The older stream's next read.
    old.before_read(&mut tracker);
    tracker.apply(&delta(0, "write_file", "d"), 2);
    old.publish(&mut tracker, &[progress_event(0, "write_file", 4, 1)]);
    let now = calls(&registry, "s1");
    assert_eq!(now, [(0, 4, 1)]);
    assert_eq!(
        received_untimed(&mut sub),
        [
            r#"{"sessionId":"s1","toolCallProgress":{"index":0,"name":"write_file","charsAccumulated":4,"startedAt":1}}"#,
            r#"{"type":"stream_resume","sessionId":"s1","toolCallsProgress":[{"index":0,"name":"write_file","charsAccumulated":4,"startedAt":1}],"streaming":true}"#,
        ]
    );
    drop(old);
    assert!(registry.snapshot("s1").is_empty(), "its end clears");
    drop(sub);
    registry.release("s1");
    assert!(registry.is_empty());
}

/// A `tool-execute` clear while a newer stream owns the session clears the
/// superseded stream's calls too: given the session back, it does not
/// show them again.
#[test]
fn a_clear_reaches_the_streams_that_wait_to_take_the_session_back() {
    let registry = SessionRegistry::new();
    let mut old = registry.begin_stream("s1");
    let mut tracker = tracker_with(&[(0, "write_file", "abc")], 1);
    old.publish(&mut tracker, &[]);
    let new = registry.begin_stream("s1");
    registry.tool_execution_started("s1");
    drop(new);
    assert!(old.before_read(&mut tracker), "the clear reached it");
    tracker.apply(&delta(1, "read_file", "x"), 2);
    old.publish(&mut tracker, &[]);
    assert_eq!(
        calls(&registry, "s1"),
        [(1, 1, 2)],
        "only the call that came after the clear"
    );
}

/// An older stream of a session that ends while a newer one owns it
/// changes nothing: the newer keeps the session, and the session is
/// forgotten once that one ends too.
#[test]
fn a_superseded_stream_that_ends_leaves_the_owner_alone() {
    let registry = SessionRegistry::new();
    let old = registry.begin_stream("s1");
    let mut new = registry.begin_stream("s1");
    new.publish(&mut tracker_with(&[(0, "a", "x")], 1), &[]);
    drop(old);
    assert_eq!(registry.snapshot("s1").len(), 1);
    drop(new);
    assert!(registry.is_empty());
}

#[test]
fn idle_sessions_expire_and_used_ones_do_not() {
    let registry = SessionRegistry::new();
    let sub = registry.subscribe("watched");
    let _stream = registry.begin_stream("streaming");
    let left = registry.subscribe("left");
    drop(left);
    assert_eq!(registry.len(), 3);
    assert_eq!(
        registry.purge(Duration::from_secs(3600)),
        0,
        "not idle long enough"
    );
    assert_eq!(
        registry.purge(Duration::ZERO),
        1,
        "only the session nothing uses"
    );
    assert_eq!(registry.len(), 2);
    drop(sub);
    assert_eq!(registry.purge(Duration::ZERO), 1);
}

#[test]
fn a_slow_subscriber_is_told_it_lagged_instead_of_being_buffered_for() {
    let registry = SessionRegistry::new();
    let mut sub = registry.subscribe("s1");
    let mut stream = registry.begin_stream("s1");
    let mut tracker = tracker_with(&[(0, "a", "")], 1);
    for i in 0..(SUBSCRIBER_BACKLOG + 10) {
        stream.publish(&mut tracker, &[progress_event(0, "a", i, 1)]);
    }
    assert!(matches!(
        sub.frames.try_recv(),
        Err(broadcast::error::TryRecvError::Lagged(10))
    ));
}

#[test]
fn frames_escape_what_they_carry() {
    let frame = event_frame(
        "s\"1",
        &StreamEvent::Content {
            choice: 2,
            text: "a\nb".into(),
        },
    );
    assert_eq!(
        &*frame,
        r#"{"sessionId":"s\"1","contentDelta":"a\nb","choice":2}"#
    );
    let value: serde_json::Value = serde_json::from_str(&frame).expect("valid JSON");
    assert_eq!(value["contentDelta"], "a\nb");
}

/// Plain spinner lines that note, for each write, whether the registry's
/// lock was free at that moment (it is taken on this thread only, so a
/// failed `try_lock` means this thread holds it).
struct LockProbe {
    registry: Arc<std::sync::OnceLock<SessionRegistry>>,
    written: Arc<Mutex<Vec<(String, bool)>>>,
}

impl std::io::Write for LockProbe {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let held = self
            .registry
            .get()
            .is_some_and(|r| r.shared.try_lock().is_err());
        let text = String::from_utf8_lossy(buf).into_owned();
        self.written
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push((text, held));
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// What a [`LockProbe`] wrote: each write, and whether the registry's lock
/// was held.
type Written = Arc<Mutex<Vec<(String, bool)>>>;

/// A registry whose spinners are plain lines, kept in what it returns.
fn drawing_plain_lines() -> (SessionRegistry, Written) {
    let written = Arc::new(Mutex::new(Vec::new()));
    let display = ProgressDisplay::plain(Box::new(LockProbe {
        registry: Arc::new(std::sync::OnceLock::new()),
        written: Arc::clone(&written),
    }));
    (SessionRegistry::with_display(Arc::new(display)), written)
}

/// The final lines (`✓`, `✗`) in `written`, without their elapsed time.
fn final_lines(written: &Mutex<Vec<(String, bool)>>) -> Vec<String> {
    let written = written.lock().unwrap_or_else(|e| e.into_inner());
    written
        .iter()
        .flat_map(|(text, _)| text.lines())
        .filter(|l| l.starts_with('✓') || l.starts_with('✗'))
        .map(|l| l.split(" · ").next().unwrap_or_default().to_owned())
        .collect()
}

/// A stream's last publish and the next request of its session race on
/// two workers; the spinners must get their states in the order the
/// registry made them, or the old tool, cleared by the new request, would
/// be drawn again after the clear and spin on. The display is told with
/// the registry's lock held: every line it writes (a tool's first line,
/// its final line) is written under that lock.
#[test]
fn the_spinners_are_told_in_the_registrys_order() {
    let registry_cell = Arc::new(std::sync::OnceLock::new());
    let written = Arc::new(Mutex::new(Vec::new()));
    let display = ProgressDisplay::plain(Box::new(LockProbe {
        registry: Arc::clone(&registry_cell),
        written: Arc::clone(&written),
    }));
    let registry = SessionRegistry::with_display(Arc::new(display));
    registry_cell.set(registry.clone()).expect("set once");
    let mut old = registry.begin_stream("s1");
    old.publish(&mut tracker_with(&[(0, "get_weather", "abc")], 1), &[]);
    let new = registry.begin_stream("s1");
    let mut other = registry.begin_stream("s2");
    other.publish(&mut tracker_with(&[(0, "get_time", "")], 2), &[]);
    assert_eq!(registry.tool_execution_started("s2"), 1);
    // The stream takes the clear before its next read, as the body does;
    // what it reads after is new.
    assert!(other.take_cleared());
    // Two deltas: a tracker's change count must differ from the last one
    // published for the stream to publish again.
    other.publish(
        &mut tracker_with(&[(1, "search", "q"), (1, "search", "r")], 3),
        &[],
    );
    other.mark_failed();
    drop(other);
    drop((old, new));
    let written = written.lock().unwrap_or_else(|e| e.into_inner());
    let lines: String = written.iter().map(|(text, _)| text.as_str()).collect();
    // A first and a final line for each of the three tools.
    assert_eq!(lines.lines().count(), 6, "{lines}");
    for name in ["get_weather", "get_time", "search"] {
        assert_eq!(lines.matches(name).count(), 2, "{name}: {lines}");
    }
    let unlocked: Vec<&str> = written
        .iter()
        .filter(|(_, held)| !held)
        .map(|(text, _)| text.as_str())
        .collect();
    assert!(
        unlocked.is_empty(),
        "written after the registry's lock was let go: {unlocked:?}"
    );
}

/// A stream that failed while a tool was in progress ends that tool's
/// spinner with `✗`, also when its last publish, the end of its tracker,
/// is what clears the tool (as `serve` does when the upstream fails).
#[test]
fn a_failed_streams_tools_end_with_a_cross() {
    let (registry, written) = drawing_plain_lines();
    let mut stream = registry.begin_stream("s1");
    let mut tracker = tracker_with(&[(0, "get_weather", "abc")], 1);
    stream.publish(&mut tracker, &[]);
    stream.mark_failed();
    tracker.end();
    stream.publish(&mut tracker, &[]);
    drop(stream);
    assert_eq!(final_lines(&written), ["✗ [s1] get_weather  3 chars"]);
}

/// A stream of session `s1` that keeps its ended calls, as `serve` makes
/// it when it draws spinners, with `get_weather` in progress (3 chars),
/// published.
fn get_weather_drawn(registry: &SessionRegistry) -> (StreamHandle, ToolCallTracker) {
    let mut stream = registry.begin_stream("s1");
    let mut tracker = ToolCallTracker::new(false);
    stream.keep_ended_calls(&mut tracker);
    tracker.apply(&delta(0, "get_weather", "{\"c"), 1);
    stream.publish(&mut tracker, &[]);
    (stream, tracker)
}

/// `serve` publishes once per write to its client, and a burst read in
/// one piece can carry a call's last arguments, a whole second call and
/// the text after them. Each tool still ends with its last count, the
/// call that began and ended within the burst included (before, the
/// first ended at its count of the publish before, the second was never
/// drawn).
#[test]
fn each_tool_ends_with_its_last_count_after_a_burst() {
    let (registry, written) = drawing_plain_lines();
    let (mut stream, mut tracker) = get_weather_drawn(&registry);
    // One read: the rest of the first call, all of a second, then text.
    tracker.apply(&delta(0, "get_weather", "ity\":\"Paris\"}"), 2);
    tracker.apply(&delta(1, "get_time", "{}"), 2);
    tracker.text(StreamPhase::Answering);
    stream.publish(&mut tracker, &[]);
    drop(stream);
    assert_eq!(
        final_lines(&written),
        ["✓ [s1] get_weather  16 chars", "✓ [s1] get_time  2 chars"]
    );
}

/// A `tool-execute` clear ends the session's tools on the spinners; the
/// stream then clears its own calls before its next read (`TapBody`, with
/// `tool_execution_started_elsewhere`), and its next publish must not end
/// them a second time.
#[test]
fn a_tool_execute_clear_ends_each_tool_once() {
    let (registry, written) = drawing_plain_lines();
    let (mut stream, mut tracker) = get_weather_drawn(&registry);
    registry.tool_execution_started("s1");
    // What the body does before its next read, then that read: text.
    assert!(stream.take_cleared());
    tracker.tool_execution_started_elsewhere();
    stream.publish(&mut tracker, &[]);
    tracker.text(StreamPhase::Answering);
    stream.publish(&mut tracker, &[]);
    drop(stream);
    assert_eq!(final_lines(&written), ["✓ [s1] get_weather  3 chars"]);
}

/// Without spinners, a stream's tracker keeps no ended calls.
#[test]
fn without_spinners_no_ended_call_is_kept() {
    let registry = SessionRegistry::with_display(Arc::new(ProgressDisplay::off()));
    let stream = registry.begin_stream("s1");
    let mut tracker = ToolCallTracker::new(false);
    stream.keep_ended_calls(&mut tracker);
    tracker.apply(&delta(0, "a", "x"), 1);
    tracker.text(StreamPhase::Answering);
    let mut ended = vec![];
    tracker.take_ended(&mut ended);
    assert!(ended.is_empty(), "{ended:?}");
}

/// A stream collects its increments only while someone may listen: from
/// a subscription to its session or to all, until a publish finds nobody.
#[test]
fn a_stream_collects_only_while_someone_listens() {
    let registry = SessionRegistry::new();
    let mut stream = registry.begin_stream("s1");
    assert!(!stream.listened(), "nobody subscribed");
    let sub = registry.subscribe("s1");
    assert!(stream.listened(), "subscribed");
    let mut tracker = tracker_with(&[(0, "a", "x")], 1);
    stream.publish(&mut tracker, &[progress_event(0, "a", 1, 1)]);
    assert!(stream.listened(), "still subscribed");
    drop(sub);
    tracker.apply(&delta(0, "a", "y"), 2);
    stream.publish(&mut tracker, &[progress_event(0, "a", 2, 1)]);
    assert!(!stream.listened(), "a publish found nobody");
    let all = registry.subscribe_all();
    assert!(stream.listened(), "every session is listened to");
    let mut other = registry.begin_stream("s2");
    assert!(
        other.listened(),
        "a stream that begins under a subscriber to all"
    );
    drop(all);
    other.publish(&mut tracker, &[]);
    assert!(!other.listened());
    assert!(stream.listened(), "told when it publishes next");
    // A new request of the session starts from what is true now.
    drop(stream);
    let _sub = registry.subscribe("s3");
    assert!(registry.begin_stream("s3").listened());
    assert!(!registry.begin_stream("s1").listened());
}

/// A subscriber that came while the stream read without collecting
/// (`missed`) took its snapshot before that read: if the read changed the
/// calls, it gets the session's snapshot again, after the increments that
/// were collected, and so does a subscriber to all. A missed read that
/// changed no call sends nothing.
#[test]
fn a_read_missed_by_a_new_subscriber_is_sent_as_a_snapshot() {
    let registry = SessionRegistry::new();
    let mut stream = registry.begin_stream("s1");
    let mut tracker = tracker_with(&[(0, "a", "12345")], 100);
    stream.publish_at(&mut tracker, &[], true, Instant::now());
    let mut sub = registry.subscribe("s1");
    let mut all = registry.subscribe_all();
    assert!(
        sub.resume.contains(r#""charsAccumulated":5"#),
        "{}",
        sub.resume
    );
    // Read without collecting, then with: the snapshot goes last.
    tracker.apply(&delta(0, "a", "67"), 200);
    tracker.apply(&delta(1, "b", "1"), 200);
    stream.publish_at(
        &mut tracker,
        &[progress_event(1, "b", 1, 200)],
        true,
        Instant::now(),
    );
    let expected = vec![
        r#"{"sessionId":"s1","toolCallProgress":{"index":1,"name":"b","charsAccumulated":1,"startedAt":200}}"#,
        r#"{"type":"stream_resume","sessionId":"s1","toolCallsProgress":[{"index":0,"name":"a","charsAccumulated":7,"startedAt":100},{"index":1,"name":"b","charsAccumulated":1,"startedAt":200}],"streaming":true}"#,
    ];
    for sub in [&mut sub, &mut all] {
        let frames = received_untimed(sub);
        assert_eq!(frames, expected);
    }
    // A missed clear (text after the calls) reaches them as an empty
    // snapshot.
    tracker.apply(
        &Chunk::Text {
            choice: 0,
            text: "ok".into(),
        },
        300,
    );
    stream.publish_at(&mut tracker, &[], true, Instant::now());
    assert_eq!(
        received_untimed(&mut sub),
        vec![
            r#"{"type":"stream_resume","sessionId":"s1","toolCallsProgress":[],"streaming":true}"#
        ]
    );
    // Nothing changed: nothing to resend.
    stream.publish_at(&mut tracker, &[], true, Instant::now());
    assert!(received(&mut sub).is_empty());
    // Collected: the increments alone.
    tracker.apply(&delta(2, "c", ""), 400);
    stream.publish_at(
        &mut tracker,
        &[progress_event(2, "c", 0, 400)],
        false,
        Instant::now(),
    );
    assert_eq!(received(&mut sub).len(), 1);
}

/// A snapshot says whether an answer is under way: a stream of the
/// session is open and its `done` has not gone out. A subscriber that was
/// away when the answer ended (and missed its `done`) gets an empty list
/// either way, which alone does not tell an answer over from one in its
/// text; and one that comes after the `done`, while the stream's body
/// still goes on (an upstream that ends it after `[DONE]`), would wait
/// for a `done` that went out already.
#[test]
fn a_snapshot_says_whether_an_answer_is_under_way() {
    let registry = SessionRegistry::new();
    let resume = |registry: &SessionRegistry| without_server_time(&registry.resume_frame("s1"));
    let empty = |streaming: bool| {
        format!(
            r#"{{"type":"stream_resume","sessionId":"s1","toolCallsProgress":[],"streaming":{streaming}}}"#
        )
    };
    assert_eq!(resume(&registry), empty(false), "an unknown session");
    let mut older = registry.begin_stream("s1");
    assert_eq!(resume(&registry), empty(true));
    let listening = registry.subscribe("s1");
    assert_eq!(without_server_time(&listening.resume), empty(true));
    // A newer stream ends first: the older one takes the session back,
    // its answer still under way.
    let newer = registry.begin_stream("s1");
    assert_eq!(resume(&registry), empty(true));
    drop(newer);
    assert_eq!(resume(&registry), empty(true), "given back");
    older.publish(&mut ToolCallTracker::new(true), &[StreamEvent::Done]);
    assert_eq!(resume(&registry), empty(false), "its done went out");
    // Another newer one, which ends first: the older one's done went out
    // already, and stays so (its end sends none again).
    let newer = registry.begin_stream("s1");
    assert_eq!(resume(&registry), empty(true));
    drop(newer);
    assert_eq!(resume(&registry), empty(false), "given back, answered");
    drop(older);
    assert_eq!(resume(&registry), empty(false), "the stream ended");
    assert_eq!(
        without_server_time(&registry.subscribe("s1").resume),
        empty(false)
    );
    drop(listening);
}
