//! Per-session tool-call progress, shared by every connection of the proxy
//! (SPEC.md, "Progress state"; issue 5).
//!
//! A session is named by the `X-Aalis-Session` request header. Each streamed
//! response of the session publishes here, as it goes, its in-progress tool
//! calls (the snapshot a reconnecting UI resumes from) and its increments
//! (what live subscribers of `/_aalis/sessions/{id}/events` receive). A new
//! streamed request of the session starts a new *generation*: it clears
//! what the previous one left, and the older stream can no longer publish
//! while the new one is open. If the new one ends first, the session goes
//! back to the older one, which publishes all its calls again at its next
//! read (a chat's side request, a title say, sent with the chat's session
//! while its answer streams, took the answer's progress for good before).
//!
//! Subscribers get the snapshot and a `broadcast` receiver under one lock,
//! so they lose nothing after their snapshot and see nothing twice. A
//! subscriber that falls behind by more than [`SUBSCRIBER_BACKLOG`] frames is
//! not buffered for: it is told it lagged and starts again from a fresh
//! snapshot, so a slow browser never slows a stream. (The events routes
//! also bound in bytes what a subscriber's connection has not taken:
//! `admin::SUBSCRIBER_BACKLOG_BYTES`.)
//!
//! Memory stays bounded: a session is kept while a stream or a subscriber
//! uses it; when the last of them goes it is forgotten at once (a stream's
//! end clears its progress). `--session-ttl` is the safety net: a purge
//! task ([`SessionRegistry::spawn_purger`], stopped when its guard is
//! dropped) forgets any session nothing has used for that long.
//!
//! The state sits behind a `std::sync::Mutex` that is never held across an
//! `.await` (mini-redis `db.rs`): every method takes the lock, does a few
//! map operations (and, with `--progress`, hands the spinners the
//! session's new state, which never waits) and returns.
//!
//! Read [`SessionRegistry`] first.

use std::collections::HashMap;
use std::fmt::Write as _;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use slab::Slab;
use tokio::sync::broadcast;

use crate::filter::unix_ms;
use crate::js::push_string;
use crate::pipeline::{ClearReason, StreamEvent};
pub use crate::progress::ProgressEntry;
use crate::progress::{EndedCall, ToolCallTracker};
use crate::render::spinner::{Outcome, ProgressDisplay};

/// Frames a subscriber may fall behind before it is resent a snapshot.
pub const SUBSCRIBER_BACKLOG: usize = 256;

/// [`SUBSCRIBER_BACKLOG`] for the subscribers of every session
/// (`/_aalis/events`), whose one stream carries all their frames.
pub const ALL_SESSIONS_BACKLOG: usize = 4 * SUBSCRIBER_BACKLOG;

/// One frame for subscribers: a JSON object, rendered once for all.
pub type Frame = Arc<str>;

#[derive(Debug)]
struct Session {
    /// The generation of the stream that owns the session's progress.
    generation: u64,
    /// Sorted by choice, then index.
    progress: Vec<ProgressEntry>,
    /// The owning stream is still open.
    streaming: bool,
    /// The owning stream's `done` went out to subscribers (its body may
    /// go on a while: an upstream that ends its body after `[DONE]`).
    answered: bool,
    /// Last publish, stream start or end, or subscription.
    last_active: Instant,
    /// Increments for live subscribers; made by the first subscription
    /// (its buffer of [`SUBSCRIBER_BACKLOG`] slots is a sixth of what an
    /// open stream costs, and most sessions are never subscribed to).
    frames: Option<broadcast::Sender<Frame>>,
    /// What its stream reads without the lock, shared with it.
    flags: Arc<Flags>,
    /// Streams of the session still open that a newer one superseded,
    /// with whether each one's `done` went out (`answered`),
    /// oldest first, with their flags: when the owner ends, the last of
    /// them takes the session back. Empty (no allocation) but for
    /// sessions with streams at once.
    superseded: Vec<(u64, Arc<Flags>, bool)>,
}

/// A session's flags its stream reads without the registry's lock, in one
/// allocation.
#[derive(Debug, Default)]
struct Flags {
    /// Someone may listen to the session's increments: its stream collects
    /// them only then ([`StreamHandle::listened`]). Turned on, under the
    /// lock, by a subscription (to the session or to all); turned off by a
    /// publish that finds nobody listening. The stream reads it without
    /// the lock, before each read: a stale `true` costs a read collected
    /// for nothing, a stale `false` a read published as a fresh snapshot
    /// (see [`StreamHandle::publish_at`]).
    listened: AtomicBool,
    /// Set by [`SessionRegistry::tool_execution_started`]; taken by the
    /// stream before its next read, which clears its own calls in progress
    /// too (else its next publish, a snapshot of its calls, would bring the
    /// cleared ones back).
    cleared: AtomicBool,
    /// Set when the session came back to this stream (the newer stream
    /// that superseded it ended); taken by the stream before its next
    /// read, whose publish then sends all its calls.
    regained: AtomicBool,
}

impl Session {
    fn new() -> Session {
        Session {
            generation: 0,
            progress: Vec::new(),
            streaming: false,
            answered: false,
            last_active: Instant::now(),
            frames: None,
            flags: Arc::new(Flags::default()),
            superseded: Vec::new(),
        }
    }

    /// Live subscribers of this session.
    fn subscribers(&self) -> usize {
        self.frames
            .as_ref()
            .map_or(0, broadcast::Sender::receiver_count)
    }

    /// Someone listens to it: its own subscribers or those of every
    /// session (`all`).
    fn listening(&self, all: &broadcast::Sender<Frame>) -> bool {
        all.receiver_count() > 0 || self.subscribers() > 0
    }

    /// An answer is under way: a stream owns the session and its `done`
    /// has not gone out (a snapshot's `"streaming"`).
    fn answering(&self) -> bool {
        self.streaming && !self.answered
    }

    /// Nothing uses it any more (a superseded stream is open only while
    /// the owner is: it counts as `streaming`).
    fn unused(&self) -> bool {
        !self.streaming && self.subscribers() == 0
    }
}

/// The sessions of one proxy; cheap to clone (one `Arc`).
#[derive(Debug, Clone, Default)]
pub struct SessionRegistry {
    shared: Arc<Mutex<State>>,
    /// Turns true when the proxy shuts down: live subscriptions end once
    /// the streams they follow have, so their connections can close within
    /// the grace period.
    closing: Arc<tokio::sync::watch::Sender<bool>>,
    /// Spinners on stderr (`serve --progress`), fed as progress is published.
    display: Option<Arc<ProgressDisplay>>,
}

/// The sessions, found by id, each in a slot that stays its own while it
/// lives: a stream remembers its session's slot and publishes without
/// hashing the id (SipHash of the id was about 30 % of a publish,
/// BENCHMARKS.md "Seventeenth round"). A slot freed and taken by another
/// session is told apart by the generation, which is never reused.
#[derive(Debug, Default)]
struct Sessions {
    slots: Slab<Session>,
    by_id: HashMap<String, usize>,
}

impl Sessions {
    fn get(&self, id: &str) -> Option<&Session> {
        self.by_id.get(id).and_then(|&slot| self.slots.get(slot))
    }

    fn get_mut(&mut self, id: &str) -> Option<&mut Session> {
        self.by_id
            .get(id)
            .and_then(|&slot| self.slots.get_mut(slot))
    }

    /// The session in `slot`, whichever it is now: check its generation.
    fn in_slot(&mut self, slot: usize) -> Option<&mut Session> {
        self.slots.get_mut(slot)
    }

    /// The session `id`, made when unknown, and its slot.
    fn get_or_insert(&mut self, id: &str) -> (usize, &mut Session) {
        let slot = match self.by_id.get(id) {
            Some(&slot) if self.slots.contains(slot) => slot,
            _ => {
                let slot = self.slots.insert(Session::new());
                self.by_id.insert(id.to_owned(), slot);
                slot
            }
        };
        (slot, &mut self.slots[slot])
    }

    fn remove(&mut self, id: &str) {
        if let Some(slot) = self.by_id.remove(id) {
            self.slots.try_remove(slot);
        }
    }

    /// Keeps the sessions for which `keep` is true.
    fn retain(&mut self, mut keep: impl FnMut(&Session) -> bool) {
        let slots = &mut self.slots;
        self.by_id.retain(|_, &mut slot| {
            let kept = slots.get(slot).is_some_and(&mut keep);
            if !kept {
                slots.try_remove(slot);
            }
            kept
        });
    }

    fn len(&self) -> usize {
        self.by_id.len()
    }

    fn iter(&self) -> impl Iterator<Item = (&String, &Session)> {
        self.by_id
            .iter()
            .filter_map(|(id, &slot)| Some((id, self.slots.get(slot)?)))
    }
}

#[derive(Debug)]
struct State {
    sessions: Sessions,
    next_generation: u64,
    /// Every frame of every session, for the status page's one stream.
    all: broadcast::Sender<Frame>,
}

impl Default for State {
    fn default() -> Self {
        State {
            sessions: Sessions::default(),
            next_generation: 0,
            all: broadcast::channel(ALL_SESSIONS_BACKLOG).0,
        }
    }
}

/// Sends `frame` to the session's subscribers and to those of every
/// session (`all`).
fn send(all: &broadcast::Sender<Frame>, session: &Session, frame: Frame) {
    if all.receiver_count() > 0 {
        let _ = all.send(frame.clone());
    }
    if let Some(frames) = &session.frames
        && frames.receiver_count() > 0
    {
        let _ = frames.send(frame);
    }
}

impl State {
    /// The `sessions_resume` frame: every session with something in
    /// progress.
    fn all_resume(&self) -> Frame {
        let mut ids: Vec<&String> = self
            .sessions
            .iter()
            .filter(|(_, s)| !s.progress.is_empty())
            .map(|(id, _)| id)
            .collect();
        ids.sort();
        let mut out = String::from("{\"type\":\"sessions_resume\",\"sessions\":[");
        for (i, id) in ids.into_iter().enumerate() {
            if i > 0 {
                out.push(',');
            }
            let progress = self.sessions.get(id).map_or(&[][..], |s| &s.progress[..]);
            out.push_str("{\"sessionId\":");
            push_string(id, &mut out);
            out.push_str(",\"toolCallsProgress\":");
            push_entries(progress, &mut out);
            out.push('}');
        }
        let _ = write!(out, "],\"serverTime\":{}}}", unix_ms());
        Arc::from(out)
    }
}

/// A stream's claim on its session: publish through it.
#[derive(Debug)]
pub struct StreamHandle {
    registry: SessionRegistry,
    session_id: String,
    /// Where the session is in the registry ([`Sessions`]).
    slot: usize,
    generation: u64,
    /// The session's [`Session::flags`].
    flags: Arc<Flags>,
    /// The tracker's change counter when last published.
    published: u64,
    /// The stream failed (its spinners end with `✗`).
    failed: bool,
    /// The calls that ended since the last publish, taken from the
    /// tracker for the spinners ([`keep_ended_calls`](Self::keep_ended_calls)).
    ended: Vec<EndedCall>,
    /// The stream's `done` was sent to subscribers; if not, its end (as
    /// the session's owner) sends one.
    done: bool,
    /// At its end, the stream's answer may stop in the middle
    /// ([`note_end`](Self::note_end)): its `done` says `incomplete`.
    incomplete: bool,
    /// The session came back to this stream ([`before_read`](Self::before_read)):
    /// its next publish sends subscribers a fresh snapshot.
    regained: bool,
}

/// A live subscription to one session.
#[derive(Debug)]
pub struct Subscription {
    /// The `stream_resume` frame to send first.
    pub resume: Frame,
    /// The increments after it.
    pub frames: broadcast::Receiver<Frame>,
}

/// Stops the purge task when dropped.
#[derive(Debug)]
pub struct PurgeGuard {
    stop: Option<tokio::sync::oneshot::Sender<()>>,
}

impl Drop for PurgeGuard {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
    }
}

impl SessionRegistry {
    pub fn new() -> Self {
        Self::default()
    }

    /// A registry that also draws every session's progress on `display`.
    pub fn with_display(display: Arc<ProgressDisplay>) -> Self {
        SessionRegistry {
            display: (!display.is_off()).then_some(display),
            ..SessionRegistry::default()
        }
    }

    /// A new streamed request of `session_id` starts: what the session had
    /// in progress is cleared, and the new stream owns it.
    pub fn begin_stream(&self, session_id: &str) -> StreamHandle {
        let mut state = self.lock();
        state.next_generation += 1;
        let generation = state.next_generation;
        let State { sessions, all, .. } = &mut *state;
        let (slot, session) = sessions.get_or_insert(session_id);
        if session.streaming {
            // The owner is still open: it waits, superseded, with flags of
            // its own (shared, it took the new stream's `cleared`, and the
            // new one kept its calls), to take the session back if the new
            // stream ends first.
            session.flags.listened.store(false, Ordering::Relaxed);
            let flags = std::mem::replace(&mut session.flags, Arc::new(Flags::default()));
            session
                .superseded
                .push((session.generation, flags, session.answered));
        }
        session.generation = generation;
        session.streaming = true;
        session.answered = false;
        session.last_active = Instant::now();
        session
            .flags
            .listened
            .store(session.listening(all), Ordering::Relaxed);
        session.flags.cleared.store(false, Ordering::Relaxed);
        let flags = Arc::clone(&session.flags);
        if !session.progress.is_empty() {
            session.progress.clear();
            send(
                all,
                session,
                clear_frame(session_id, ClearReason::NewRequest),
            );
        }
        self.show(session_id, &[], Outcome::Done);
        drop(state);
        StreamHandle {
            registry: self.clone(),
            session_id: session_id.to_owned(),
            slot,
            generation,
            flags,
            published: 0,
            failed: false,
            ended: Vec::new(),
            done: false,
            incomplete: false,
            regained: false,
        }
    }

    /// The session's in-progress calls, sorted by choice then index; empty
    /// for an unknown session.
    pub fn snapshot(&self, session_id: &str) -> Vec<ProgressEntry> {
        self.lock()
            .sessions
            .get(session_id)
            .map(|s| s.progress.clone())
            .unwrap_or_default()
    }

    /// The `stream_resume` frame of a session (an empty list for an unknown
    /// one).
    pub fn resume_frame(&self, session_id: &str) -> Frame {
        let state = self.lock();
        match state.sessions.get(session_id) {
            Some(session) => resume_frame(session_id, &session.progress, session.answering()),
            None => resume_frame(session_id, &[], false),
        }
    }

    /// Subscribes to a session, known yet or not: its snapshot now, and
    /// every increment after it.
    pub fn subscribe(&self, session_id: &str) -> Subscription {
        let mut state = self.lock();
        let (_, session) = state.sessions.get_or_insert(session_id);
        session.last_active = Instant::now();
        session.flags.listened.store(true, Ordering::Relaxed);
        Subscription {
            frames: session
                .frames
                .get_or_insert_with(|| broadcast::channel(SUBSCRIBER_BACKLOG).0)
                .subscribe(),
            resume: resume_frame(session_id, &session.progress, session.answering()),
        }
    }

    /// The `sessions_resume` frame: `{"type":"sessions_resume","sessions":
    /// [{"sessionId","toolCallsProgress"}],"serverTime"}`, every session
    /// with something in progress, sorted by id.
    pub fn sessions_resume(&self) -> Frame {
        self.lock().all_resume()
    }

    /// Subscribes to every session: a `sessions_resume` frame of all the
    /// sessions with something in progress, and every frame after it (the
    /// status page's single stream: a browser allows few connections per
    /// host, so one per session would not do).
    pub fn subscribe_all(&self) -> Subscription {
        let state = self.lock();
        for (_, session) in state.sessions.iter() {
            session.flags.listened.store(true, Ordering::Relaxed);
        }
        Subscription {
            frames: state.all.subscribe(),
            resume: state.all_resume(),
        }
    }

    /// A subscriber of `session_id` left: the session is forgotten now if
    /// nothing else uses it and it has nothing in progress.
    pub fn release(&self, session_id: &str) {
        let mut state = self.lock();
        if state
            .sessions
            .get(session_id)
            .is_some_and(|s| s.unused() && s.progress.is_empty())
        {
            state.sessions.remove(session_id);
        }
    }

    /// A tool of the session started executing (`tool:execute` with
    /// `phase: "start"`): its progress is cleared. Returns how many tools
    /// were in progress.
    pub fn tool_execution_started(&self, session_id: &str) -> usize {
        let mut state = self.lock();
        let State { sessions, all, .. } = &mut *state;
        let Some(session) = sessions.get_mut(session_id) else {
            return 0;
        };
        let cleared = session.progress.len();
        session.progress.clear();
        if session.streaming {
            session.flags.cleared.store(true, Ordering::Relaxed);
            // A superseded stream's calls are over too: given the session
            // back, it would show them again.
            for (_, flags, _) in &session.superseded {
                flags.cleared.store(true, Ordering::Relaxed);
            }
        }
        session.last_active = Instant::now();
        send(
            all,
            session,
            clear_frame(session_id, ClearReason::ToolExecute),
        );
        self.show(session_id, &[], Outcome::Done);
        drop(state);
        cleared
    }

    /// Forgets sessions nothing uses and that were idle longer than `ttl`.
    /// Returns how many were forgotten.
    pub fn purge(&self, ttl: Duration) -> usize {
        let mut state = self.lock();
        let before = state.sessions.len();
        state
            .sessions
            .retain(|s| !(s.unused() && s.last_active.elapsed() >= ttl));
        before - state.sessions.len()
    }

    /// Runs [`purge`](Self::purge) every `ttl / 4` (at least every 100 ms,
    /// at most every minute) until the guard is dropped. Needs a tokio
    /// runtime.
    pub fn spawn_purger(&self, ttl: Duration) -> PurgeGuard {
        let (stop, mut stopped) = tokio::sync::oneshot::channel::<()>();
        let registry = self.clone();
        let period = (ttl / 4).clamp(Duration::from_millis(100), Duration::from_secs(60));
        tokio::spawn(async move {
            let mut ticks = tokio::time::interval(period);
            loop {
                tokio::select! {
                    _ = ticks.tick() => {
                        let forgotten = registry.purge(ttl);
                        if forgotten > 0 {
                            tracing::debug!("forgot {forgotten} idle sessions");
                        }
                    }
                    _ = &mut stopped => break,
                }
            }
        });
        PurgeGuard { stop: Some(stop) }
    }

    /// Ends every live subscription once no stream it follows is open (the
    /// proxy is shutting down).
    pub fn close_subscriptions(&self) {
        self.closing.send_replace(true);
    }

    /// Whether a stream is open: of session `session_id`, or of any
    /// session for `None` (a superseded stream counts: it takes its session
    /// back when the newer one ends).
    pub fn streaming(&self, session_id: Option<&str>) -> bool {
        let state = self.lock();
        match session_id {
            Some(id) => state.sessions.get(id).is_some_and(|s| s.streaming),
            None => state.sessions.slots.iter().any(|(_, s)| s.streaming),
        }
    }

    /// Resolves when [`close_subscriptions`](Self::close_subscriptions) is
    /// called (at once if it already was).
    pub async fn closed(&self) {
        let mut closing = self.closing.subscribe();
        let _ = closing.wait_for(|closed| *closed).await;
    }

    /// Number of sessions held (open streams, subscribed sessions, and idle
    /// ones with progress not yet expired).
    pub fn len(&self) -> usize {
        self.lock().sessions.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Tells the spinners a session's new state. Called with the lock
    /// held, so the display gets each session's states in the order the
    /// registry made them: told after the lock was let go, a stream's last
    /// publish could reach it after the clear of the session's next
    /// request, and leave a finished tool spinning. It never waits on the
    /// terminal: `serve` draws apart ([`ProgressDisplay::drawn_apart`]),
    /// and its plain lines go to the log's queue.
    fn show(&self, session_id: &str, entries: &[ProgressEntry], outcome: Outcome) {
        if let Some(display) = &self.display {
            display.show(session_id, entries, outcome, unix_ms());
        }
    }

    /// Tells the spinners that a tool of the session ended as `entry`, its
    /// last state; called with the lock held, as [`show`](Self::show).
    fn ended(&self, session_id: &str, entry: &ProgressEntry, outcome: Outcome) {
        if let Some(display) = &self.display {
            display.ended(session_id, entry, outcome, unix_ms());
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // A panic while holding the lock cannot leave the maps half-updated
        // in a way that matters more than losing the service: keep going.
        self.shared.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl StreamHandle {
    /// Whether someone may listen to the session's increments: the stream
    /// collects them for [`publish_at`](Self::publish_at) only then
    /// ([`Annotator::collect_events`](crate::pipeline::Annotator::collect_events)).
    /// One load, without the lock.
    #[inline]
    pub fn listened(&self) -> bool {
        self.flags.listened.load(Ordering::Relaxed)
    }

    /// A tool of the session started executing since the last call
    /// ([`SessionRegistry::tool_execution_started`]): the stream clears
    /// its calls in progress before it reads on. A look at a flag, without
    /// a lock, before each read.
    pub fn take_cleared(&self) -> bool {
        self.flags.cleared.load(Ordering::Relaxed)
            && self.flags.cleared.swap(false, Ordering::Relaxed)
    }

    /// What the stream does before each read: a tool-execute clear
    /// ([`take_cleared`](Self::take_cleared)) ends `tracker`'s calls in
    /// progress, and a session given back to this stream (the newer one
    /// that had taken it ended) makes the next publish send all its calls,
    /// and its subscribers a fresh snapshot. Two loads, without a lock.
    /// Returns whether a clear was taken: the caller drops the progress
    /// increments it collected for the next publish (their calls are over).
    #[inline]
    pub fn before_read(&mut self, tracker: &mut ToolCallTracker) -> bool {
        let cleared = self.take_cleared();
        if cleared {
            tracker.tool_execution_started_elsewhere();
        }
        if self.flags.regained.load(Ordering::Relaxed)
            && self.flags.regained.swap(false, Ordering::Relaxed)
        {
            // A count the tracker never has: the next publish finds its
            // calls changed, and the session's progress (emptied) is taken
            // whole.
            self.published = u64::MAX;
            self.regained = true;
        }
        cleared
    }

    /// Called once, before the stream's first read: when the proxy draws
    /// spinners, `tracker` keeps the calls whose progress ends
    /// ([`ToolCallTracker::keep_ended`]), so that each publish ends them
    /// with their last count, also a call that began and ended between two
    /// publishes (a burst read in one piece). Nothing otherwise.
    pub fn keep_ended_calls(&self, tracker: &mut ToolCallTracker) {
        if self.registry.display.is_some() {
            tracker.keep_ended();
        }
    }

    /// Publishes what the stream did since the last call: the tracker's
    /// in-progress calls (when they changed) and `events` for subscribers,
    /// as long as this stream still owns the session. The caller empties
    /// `events` ([`Annotator::clear_events`](crate::pipeline::Annotator::clear_events)).
    pub fn publish(&mut self, tracker: &mut ToolCallTracker, events: &[StreamEvent]) {
        self.publish_at(tracker, events, false, Instant::now());
    }

    /// [`publish`](Self::publish), with `now` (a moment ago) as the
    /// session's last activity: a caller that has just read the clock
    /// passes that, and publishing costs no clock read of its own.
    ///
    /// `missed`: some of what is published was read while the stream did
    /// not collect increments ([`listened`](Self::listened) was false), so
    /// `events` do not tell all that changed. A subscriber that came in
    /// the meantime took its snapshot before that read, so if the calls
    /// changed it is sent the session's snapshot again (`stream_resume`,
    /// as after a lag) after `events`. The text and `done` of such a read
    /// are not sent: they came before the subscriber could hear them.
    #[inline]
    pub fn publish_at(
        &mut self,
        tracker: &mut ToolCallTracker,
        events: &[StreamEvent],
        missed: bool,
        now: Instant,
    ) {
        // Most calls find nothing new (a stream's body is polled more often
        // than it reads): a comparison, without a call.
        let changed = tracker.changes() != self.published;
        if changed || !events.is_empty() {
            self.publish_changes(tracker, events, now, changed, missed);
        }
    }

    /// [`publish_at`](Self::publish_at) when there is something to
    /// publish: `changed` says whether the tracker's calls changed.
    fn publish_changes(
        &mut self,
        tracker: &mut ToolCallTracker,
        events: &[StreamEvent],
        now: Instant,
        changed: bool,
        missed: bool,
    ) {
        let taken_at = std::mem::replace(&mut self.published, tracker.changes());
        // Taken whether or not the stream still owns its session, so
        // that they never pile up.
        tracker.take_ended(&mut self.ended);
        let mut state = self.registry.lock();
        let State { sessions, all, .. } = &mut *state;
        let Some(session) = sessions.in_slot(self.slot) else {
            return;
        };
        if session.generation != self.generation {
            return;
        }
        session.last_active = now;
        // A tool-execute clear came after the reads published here (had a
        // read come after it, it would have taken the flag first): what
        // they brought of the calls was over before it is published. Their
        // calls go (the clear ended their spinners), and so do their
        // progress frames, which would bring the cleared cards back.
        let stale = self.flags.cleared.load(Ordering::Relaxed)
            && self.flags.cleared.swap(false, Ordering::Relaxed);
        if stale {
            tracker.tool_execution_started_elsewhere();
            self.published = tracker.changes();
            self.ended.clear();
            session.progress.clear();
        }
        let changed = changed && !stale;
        // Given back, the subscribers hear all the stream's calls: they
        // were told the newer stream's clear.
        let missed = missed || std::mem::take(&mut self.regained);
        let events = events
            .iter()
            .filter(|e| !(stale && matches!(e, StreamEvent::Progress(_))));
        if changed {
            // The session's progress is this stream's snapshot of
            // `taken_at`: only the stream of the session's generation
            // writes it, and anything else only empties it.
            tracker.refresh_snapshot(&mut session.progress, taken_at);
        }
        // Frames are rendered only when someone listens; when nobody does,
        // the stream stops collecting increments.
        if session.listening(all) {
            for event in events {
                let frame = match event {
                    // By the rule of `--format messages`' done line.
                    StreamEvent::Done => {
                        self.done = true;
                        session.answered = true;
                        done_frame(&self.session_id, tracker.any_cut_short(false))
                    }
                    _ => event_frame(&self.session_id, event),
                };
                send(all, session, frame);
            }
            if missed && changed {
                send(
                    all,
                    session,
                    resume_frame(&self.session_id, &session.progress, session.answering()),
                );
            }
        } else {
            session.flags.listened.store(false, Ordering::Relaxed);
        }
        if changed {
            // The calls that ended first, each with its last count, then
            // what is still in progress. A failed stream's last publish
            // (its calls cleared by the end of its tracker) ends its tools
            // with `✗`.
            for ended in &self.ended {
                let outcome = Outcome::from_failed(self.failed || ended.failed);
                self.registry.ended(&self.session_id, &ended.entry, outcome);
            }
            let outcome = Outcome::from_failed(self.failed);
            self.registry
                .show(&self.session_id, &session.progress, outcome);
        }
        drop(state);
    }

    /// The stream failed (upstream error, idle timeout, client gone): its
    /// spinners end with `✗`.
    pub fn mark_failed(&mut self) {
        self.failed = true;
    }

    /// The stream's input ended; `incomplete`: an answer of it may stop in
    /// the middle ([`Annotator::incomplete`](crate::pipeline::Annotator::incomplete)).
    /// The `done` its end sends says so, as a failed stream's does.
    pub fn note_end(&mut self, incomplete: bool) {
        self.incomplete = incomplete;
    }
}

/// The stream ended, failed or was cancelled: its progress is cleared
/// (SPEC.md: the end or failure of the stream clears it), and subscribers
/// are told it is `done` if no frame of it said so (a stream that just
/// stops, fails or is cancelled has no `[DONE]`), as `annotate --format
/// messages` ends every stream with a `done` line: `incomplete` when it
/// failed or its answer may stop in the middle.
impl Drop for StreamHandle {
    fn drop(&mut self) {
        let mut state = self.registry.lock();
        let State { sessions, all, .. } = &mut *state;
        let Some(session) = sessions.in_slot(self.slot) else {
            return;
        };
        if session.generation != self.generation {
            // Superseded (or gone, its slot another session's): it only
            // leaves the queue of those that may take the session back.
            session.superseded.retain(|(g, _, _)| *g != self.generation);
            return;
        }
        session.last_active = Instant::now();
        if !session.progress.is_empty() {
            session.progress.clear();
            send(
                all,
                session,
                clear_frame(&self.session_id, ClearReason::StreamEnd),
            );
        }
        if !self.done && session.listening(all) {
            send(
                all,
                session,
                done_frame(&self.session_id, self.failed || self.incomplete),
            );
        }
        match session.superseded.pop() {
            // An older stream of the session is still open: it takes the
            // session back.
            Some((generation, flags, answered)) => {
                session.generation = generation;
                flags
                    .listened
                    .store(session.listening(all), Ordering::Relaxed);
                flags.regained.store(true, Ordering::Relaxed);
                session.flags = flags;
                session.answered = answered;
            }
            None => session.streaming = false,
        }
        if session.unused() {
            sessions.remove(&self.session_id);
        }
        self.registry
            .show(&self.session_id, &[], Outcome::from_failed(self.failed));
        drop(state);
    }
}

// === frames (the wire format of the events route) ===

/// `{"type":"stream_resume","sessionId":…,"toolCallsProgress":[{index,
/// name, charsAccumulated, startedAt}],"streaming":…,"serverTime":…}`,
/// entries sorted by index, times in Unix milliseconds; `streaming`: an
/// answer is under way, a stream owning the session open whose `done` has
/// not been sent to subscribers (a subscriber that was away when it went
/// out tells an answer over from one in its text by it); `serverTime`
/// lets a browser correct for its own clock.
pub fn resume_frame(session_id: &str, progress: &[ProgressEntry], streaming: bool) -> Frame {
    let mut out = String::from("{\"type\":\"stream_resume\",\"sessionId\":");
    push_string(session_id, &mut out);
    out.push_str(",\"toolCallsProgress\":");
    push_entries(progress, &mut out);
    let _ = write!(
        out,
        ",\"streaming\":{streaming},\"serverTime\":{}}}",
        unix_ms()
    );
    Arc::from(out)
}

/// One increment as a `StreamChunkMessage` (or a clear frame).
fn event_frame(session_id: &str, event: &StreamEvent) -> Frame {
    let mut out = String::from("{\"sessionId\":");
    push_string(session_id, &mut out);
    match event {
        StreamEvent::Progress(entry) => {
            out.push_str(",\"toolCallProgress\":");
            push_entry(entry, true, &mut out);
        }
        StreamEvent::Content { choice, text } => {
            out.push_str(",\"contentDelta\":");
            push_string(text, &mut out);
            push_choice(*choice, &mut out);
        }
        StreamEvent::Reasoning { choice, text } => {
            out.push_str(",\"reasoningDelta\":");
            push_string(text, &mut out);
            push_choice(*choice, &mut out);
        }
        StreamEvent::Done => return done_frame(session_id, false),
        StreamEvent::Error(raw) => {
            out.push_str(",\"error\":");
            out.push_str(raw);
        }
        StreamEvent::Cleared(reason) => return clear_frame(session_id, *reason),
    }
    out.push('}');
    Arc::from(out)
}

/// `{"sessionId":…,"done":true}`, with `"incomplete":true` when the
/// stream's answer may stop in the middle (as `--format messages` says it).
fn done_frame(session_id: &str, incomplete: bool) -> Frame {
    let mut out = String::from("{\"sessionId\":");
    push_string(session_id, &mut out);
    out.push_str(",\"done\":true");
    if incomplete {
        out.push_str(",\"incomplete\":true");
    }
    out.push('}');
    Arc::from(out)
}

/// `{"type":"tool_call_progress_clear","sessionId":…,"reason":…}`: every
/// in-progress tool of the session is gone (the seed's
/// `onToolCallProgressClear`).
pub fn clear_frame(session_id: &str, reason: ClearReason) -> Frame {
    let mut out = String::from("{\"type\":\"tool_call_progress_clear\",\"sessionId\":");
    push_string(session_id, &mut out);
    let _ = write!(
        out,
        ",\"reason\":\"{}\",\"serverTime\":{}}}",
        reason.as_str(),
        unix_ms()
    );
    Arc::from(out)
}

/// `[entry, …]`, as [`push_entry`] writes each.
fn push_entries(entries: &[ProgressEntry], out: &mut String) {
    out.push('[');
    for (i, entry) in entries.iter().enumerate() {
        if i > 0 {
            out.push(',');
        }
        push_entry(entry, true, out);
    }
    out.push(']');
}

/// `{"index":0,"name":"…","charsAccumulated":12,"startedAt":…}` (+ `choice`
/// when not 0).
fn push_entry(entry: &ProgressEntry, started_at: bool, out: &mut String) {
    let _ = write!(out, "{{\"index\":{},\"name\":", entry.index);
    push_string(&entry.name, out);
    let _ = write!(out, ",\"charsAccumulated\":{}", entry.chars_accumulated);
    if started_at {
        let _ = write!(out, ",\"startedAt\":{}", entry.started_at_ms);
    }
    push_choice(entry.choice, out);
    out.push('}');
}

fn push_choice(choice: i64, out: &mut String) {
    if choice != 0 {
        let _ = write!(out, ",\"choice\":{choice}");
    }
}

#[cfg(test)]
mod tests;
