//! Per-session tool-call progress, shared by every connection of the proxy
//! (SPEC.md, "Progress state").
//!
//! A session is named by the `X-Aalis-Session` request header. Each streamed
//! response of the session publishes its in-progress tool calls here as they
//! change; a new streamed request of the session starts a new *generation*
//! and clears what the previous one left, and an older stream of the same
//! session can no longer overwrite it. A session whose stream ended with
//! nothing in progress is forgotten, so memory is bounded by the number of
//! open streams.
//!
//! The state sits behind a `std::sync::Mutex` that is never held across an
//! `.await` (mini-redis `db.rs`): every method takes the lock, does a few
//! map operations and returns.
//!
//! Read [`SessionRegistry`] first.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};

use crate::filter::unix_ms;
pub use crate::progress::ProgressEntry;
use crate::progress::ToolCallTracker;
use crate::render::spinner::{Outcome, ProgressDisplay};

#[derive(Debug, Default)]
struct Session {
    /// The generation of the stream that owns the session's progress.
    generation: u64,
    /// Sorted by choice, then index.
    progress: Vec<ProgressEntry>,
    /// The owning stream is still open.
    streaming: bool,
}

/// The sessions of one proxy; cheap to clone (one `Arc`).
#[derive(Debug, Clone, Default)]
pub struct SessionRegistry {
    shared: Arc<Mutex<State>>,
    /// Spinners on stderr (`serve --progress`), fed as progress is published.
    display: Option<Arc<ProgressDisplay>>,
}

#[derive(Debug, Default)]
struct State {
    sessions: HashMap<String, Session>,
    next_generation: u64,
}

/// A stream's claim on its session: publish through it.
#[derive(Debug)]
pub struct StreamHandle {
    registry: SessionRegistry,
    session_id: String,
    generation: u64,
    /// The tracker's change counter when last published.
    published: u64,
    /// The stream failed (its spinners end with `✗`).
    failed: bool,
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
        let session = state.sessions.entry(session_id.to_owned()).or_default();
        session.generation = generation;
        session.progress.clear();
        session.streaming = true;
        drop(state);
        if let Some(display) = &self.display {
            display.show(session_id, &[], Outcome::Done, unix_ms());
        }
        StreamHandle {
            registry: self.clone(),
            session_id: session_id.to_owned(),
            generation,
            published: 0,
            failed: false,
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

    /// Number of sessions held (open streams and sessions with progress).
    pub fn len(&self) -> usize {
        self.lock().sessions.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // A panic while holding the lock cannot leave the maps half-updated
        // in a way that matters more than losing the service: keep going.
        self.shared.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl StreamHandle {
    pub fn session_id(&self) -> &str {
        &self.session_id
    }

    /// Publishes the tracker's in-progress calls if they changed since the
    /// last call and this stream still owns the session.
    pub fn publish(&mut self, tracker: &ToolCallTracker) {
        if tracker.changes() == self.published {
            return;
        }
        self.published = tracker.changes();
        let mut state = self.registry.lock();
        let Some(session) = state.sessions.get_mut(&self.session_id) else {
            return;
        };
        if session.generation != self.generation {
            return;
        }
        tracker.snapshot_into(&mut session.progress);
        if let Some(display) = &self.registry.display {
            // Drawn outside the registry's lock.
            let entries = session.progress.clone();
            drop(state);
            display.show(&self.session_id, &entries, Outcome::Done, unix_ms());
        }
    }

    /// The stream failed (upstream error, idle timeout, client gone): its
    /// spinners end with `✗`.
    pub fn mark_failed(&mut self) {
        self.failed = true;
    }

    /// The stream ended, failed or was cancelled: its progress is cleared
    /// (SPEC.md: the end or failure of the stream clears it).
    pub fn end(self) {
        // The work is in `Drop`, so a stream dropped mid-way ends too.
    }
}

impl Drop for StreamHandle {
    fn drop(&mut self) {
        let mut state = self.registry.lock();
        let owned = state
            .sessions
            .get(&self.session_id)
            .is_some_and(|s| s.generation == self.generation);
        if owned {
            state.sessions.remove(&self.session_id);
            drop(state);
            if let Some(display) = &self.registry.display {
                let outcome = if self.failed {
                    Outcome::Failed
                } else {
                    Outcome::Done
                };
                display.show(&self.session_id, &[], outcome, unix_ms());
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::chunk::{ArgumentsDelta, Chunk, ToolCallDelta};

    fn tracker_with(calls: &[(i64, &str, &str)], now: u64) -> ToolCallTracker {
        let mut t = ToolCallTracker::new(true);
        for &(index, name, args) in calls {
            let chunk = Chunk::ToolCallDelta(ToolCallDelta {
                choice: 0,
                index: Some(index),
                id: None,
                name: Some(name.into()),
                arguments: ArgumentsDelta::Append(args.into()),
            });
            t.apply(&chunk, now);
        }
        t
    }

    #[test]
    fn publish_snapshot_and_end() {
        let registry = SessionRegistry::new();
        let mut stream = registry.begin_stream("s1");
        stream.publish(&tracker_with(&[(1, "b", "xy"), (0, "a", "")], 5));
        let names: Vec<_> = registry
            .snapshot("s1")
            .into_iter()
            .map(|p| (p.index, p.name, p.chars_accumulated))
            .collect();
        assert_eq!(names, vec![(0, "a".into(), 0), (1, "b".into(), 2)]);
        stream.end();
        assert!(registry.snapshot("s1").is_empty());
        assert!(registry.is_empty());
    }

    #[test]
    fn a_new_request_clears_and_the_old_stream_cannot_overwrite() {
        let registry = SessionRegistry::new();
        let mut old = registry.begin_stream("s1");
        old.publish(&tracker_with(&[(0, "a", "abc")], 1));
        let mut new = registry.begin_stream("s1");
        assert!(registry.snapshot("s1").is_empty());
        old.publish(&tracker_with(&[(0, "stale", "")], 2));
        assert!(registry.snapshot("s1").is_empty());
        new.publish(&tracker_with(&[(0, "fresh", "")], 3));
        drop(old);
        assert_eq!(registry.snapshot("s1")[0].name, "fresh");
        drop(new);
        assert!(registry.is_empty());
    }
}
