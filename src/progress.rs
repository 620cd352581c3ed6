//! Tool-call progress: the state machine of one stream (SPEC.md, "Progress
//! state").
//!
//! [`ToolCallTracker`] takes the normalized [`Chunk`]s of a stream in order
//! and keeps two things:
//! - the assembled tool calls of each choice (id, name, arguments), for the
//!   final `toolCalls` of the `done` chunk;
//! - the in-progress map `(choice, index) → startedAt`, the seed's
//!   `toolCallsProgress`, which non-empty text or reasoning, `done`, the end
//!   or failure of the stream and a tool execution start clear.
//!
//! It is pure: no clock inside (callers pass the time as a [`Now`], Unix
//! milliseconds or a clock to read them from), no I/O, no output format.
//! Counting is O(length of the fragment) per delta, whatever the length of
//! the arguments so far. A stream has at most [`MAX_CALLS`] calls and
//! [`MAX_CHOICES`] choices: the calls are kept sorted, and a stream that
//! announced new calls without end (in descending order, each moving all
//! the others) took time that grew with their square.
//!
//! Read [`ToolCallTracker::apply`] first.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use crate::chunk::{ArgumentsDelta, Chunk, FinishKind, ToolCallDelta, Usage};
use crate::js::utf16_len;

/// The most tool calls one stream's tracker keeps, over all its choices;
/// a delta that would start another is refused ([`Applied::Unchanged`],
/// counted by [`ToolCallTracker::refused_calls`]). Models call a few tools
/// at once, rarely dozens.
pub const MAX_CALLS: usize = 1024;

/// The most choices one stream's tracker keeps; a delta or `finish_reason`
/// of another is refused as past [`MAX_CALLS`].
pub const MAX_CHOICES: usize = 1024;

/// The most call ids one stream's tracker remembers (to find the call a
/// delta without an index names by its id), and their most bytes in all.
/// An id stays remembered after its call took another, so a stream that
/// gave one call a new id on every delta grew without end (300,000 ids of
/// 200 characters: 112 MB against 24). Past either bound, new ids are not
/// remembered: a delta that names one later by its id alone, without an
/// index, starts a new call, as an unknown id does.
pub const MAX_IDS: usize = 4 * MAX_CALLS;
/// See [`MAX_IDS`].
pub const MAX_ID_BYTES: usize = 1 << 20;

/// The time a chunk is applied at, in Unix milliseconds: a time the
/// caller read, or the caller's clock, read only if the chunk starts a
/// call. A call's start is the only time the tracker keeps, and a stream
/// has few of them, so `serve` passes its clock and reads it a few times a
/// stream, instead of once per upstream read (BENCHMARKS.md, twenty-sixth
/// round).
#[derive(Debug, Clone, Copy)]
pub enum Now {
    At(u64),
    Clock(fn() -> u64),
}

impl Now {
    /// The time, read from the clock if it is one.
    pub fn ms(self) -> u64 {
        match self {
            Now::At(ms) => ms,
            Now::Clock(read) => read(),
        }
    }
}

impl From<u64> for Now {
    fn from(ms: u64) -> Now {
        Now::At(ms)
    }
}

/// Where a stream is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum StreamPhase {
    /// Nothing meaningful received yet.
    #[default]
    Waiting,
    Reasoning,
    Answering,
    CallingTools,
    /// The provider said the stream is over, or it ended.
    Done,
    /// The provider reported an error.
    Failed,
}

/// Where one tool call is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CallState {
    /// Known (id or name), no arguments yet.
    Announced,
    /// Arguments are arriving.
    StreamingArgs,
    /// Its choice finished or the stream is done.
    Complete,
}

/// One tool call as assembled so far.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ToolCall {
    /// The provider's `tool_calls[j].index` (or the resolved one).
    pub index: i64,
    /// Empty until the provider sends one.
    pub id: String,
    /// Empty until the provider sends one. Shared with the progress that
    /// names it ([`ProgressEntry::name`]), so that reporting a delta copies
    /// no name.
    pub name: Arc<str>,
    /// The arguments text, unescaped; empty when the tracker was made not to
    /// keep it. Read it with [`arguments()`](Self::arguments()), which adds
    /// a surrogate still waiting for its pair.
    pub arguments: String,
    /// A high surrogate the last fragment ended with (`\ud83d`), not yet in
    /// `arguments`: the next fragment's low surrogate completes it.
    carry: Option<u16>,
    /// `arguments` in UTF-16 code units (JavaScript `String.length`).
    pub chars_accumulated: usize,
    pub state: CallState,
    /// A function's call, or a custom tool's (its `arguments` are the
    /// tool's `input`).
    pub kind: CallKind,
}

/// What a call calls: the `type` of an assembled call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CallKind {
    /// `{"type":"function","function":{"name","arguments"}}`.
    Function,
    /// `{"type":"custom","custom":{"name","input"}}`: one of OpenAI's
    /// freeform tools. A call is custom once one of its deltas was.
    Custom,
}

impl ToolCall {
    /// The arguments text, unescaped: the field `arguments`, and U+FFFD
    /// for a high surrogate the last fragment ended with, which no low one
    /// completed (yet).
    pub fn arguments(&self) -> std::borrow::Cow<'_, str> {
        match self.carry {
            None => std::borrow::Cow::Borrowed(&self.arguments),
            Some(_) => std::borrow::Cow::Owned(format!("{}\u{FFFD}", self.arguments)),
        }
    }
}

/// One `toolCallProgress`, borrowed from the tracker.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Progress<'a> {
    pub choice: i64,
    pub index: i64,
    pub name: &'a Arc<str>,
    pub chars_accumulated: usize,
    /// When this index entered the in-progress map, Unix milliseconds.
    pub started_at_ms: u64,
}

impl Progress<'_> {
    /// The same, owned.
    pub fn to_entry(&self) -> ProgressEntry {
        ProgressEntry {
            choice: self.choice,
            index: self.index,
            name: Arc::clone(self.name),
            chars_accumulated: self.chars_accumulated,
            started_at_ms: self.started_at_ms,
        }
    }
}

/// One in-progress tool call, owned: what a resume snapshot or a spinner
/// shows.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProgressEntry {
    /// `choices[k].index`; 0 for nearly every stream.
    pub choice: i64,
    pub index: i64,
    pub name: Arc<str>,
    pub chars_accumulated: usize,
    /// Unix milliseconds at which this index entered the in-progress map.
    pub started_at_ms: u64,
}

/// A call whose progress ended (see [`ToolCallTracker::keep_ended`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EndedCall {
    /// Its last state.
    pub entry: ProgressEntry,
    /// The stream failed (an error chunk) rather than moved on.
    pub failed: bool,
}

/// What applying a chunk did.
#[derive(Debug, PartialEq, Eq)]
pub enum Applied<'a> {
    /// A tool-call delta: the progress to report.
    Progress(Progress<'a>),
    /// The in-progress map was cleared (it had entries).
    Cleared,
    /// Nothing a progress consumer needs to know.
    Unchanged,
}

#[derive(Debug, Default)]
struct ChoiceCalls {
    choice: i64,
    /// Sorted by index.
    calls: Vec<ToolCall>,
    /// Index of the call the last delta went to.
    last_touched: Option<i64>,
    /// Every id seen, with the call it last named (an id keeps naming that
    /// call even after a later delta gave the call another id). A map: an
    /// Ollama stream names every call with a new id, and a linear search
    /// made a long stream quadratic.
    ids: HashMap<String, i64>,
    /// How the choice finished, if it reported a `finish_reason`.
    finish: Option<FinishKind>,
}

/// The progress state of one stream; see the module docs.
#[derive(Debug, Default)]
pub struct ToolCallTracker {
    /// Sorted by choice.
    choices: Vec<ChoiceCalls>,
    /// `(choice, index) → startedAt`: the calls being generated now.
    in_progress: BTreeMap<(i64, i64), u64>,
    phase: StreamPhase,
    /// The stream carried an error, whatever came after it.
    errored: bool,
    /// A frame of the stream that may have carried a chunk could not be
    /// read ([`frame_unread`](Self::frame_unread)).
    unread: bool,
    usage: Option<Usage>,
    /// Counts changes of the in-progress map (progress or clear), so an
    /// observer can tell cheaply whether there is anything new to publish.
    changes: u64,
    /// The value of `changes` from which on every change was more
    /// arguments for the call `last` names (through `apply_delta`'s
    /// shortcut): a snapshot taken at or after it differs from the calls in
    /// progress in that call's count alone (see
    /// [`refresh_snapshot`](Self::refresh_snapshot)).
    layout_at: u64,
    /// Keep the arguments text (for the final `toolCalls`), or only count.
    keep_arguments: bool,
    /// The calls kept, over all choices (at most [`MAX_CALLS`]).
    call_count: usize,
    /// The ids remembered, over all choices, and their bytes (at most
    /// [`MAX_IDS`] and [`MAX_ID_BYTES`]).
    id_count: usize,
    id_bytes: usize,
    /// See [`refused_calls`](Self::refused_calls).
    refused_calls: u64,
    /// Calls whose progress ended, in the order they ended, with their last
    /// state, kept from [`keep_ended`](Self::keep_ended) on until taken
    /// ([`take_ended`](Self::take_ended)): `annotate`'s spinners, fed once
    /// per read, see a tool that started and ended within one read, and
    /// every tool's final count.
    ended: Option<Vec<EndedCall>>,
    /// Where the last delta went, for the next one: nearly every delta of
    /// a streaming call goes to the call the one before it went to, or
    /// (parallel calls streamed in turns) to another call in progress of
    /// the same choice.
    last: Option<LastCall>,
}

/// The call the last delta went to: its place in `choices` and in that
/// choice's `calls` (checked before use: a new choice or call moves them),
/// and its start in the in-progress map (forgotten when the map is
/// cleared, the only way an entry leaves it). `choice` and `index` are
/// not derivable from the places: they name the call whose start is
/// kept, and a new choice can move another choice, with a call of the
/// same index, into the kept place (the shortcut's test fails when the
/// delta is checked against the places alone).
#[derive(Debug, Clone, Copy)]
struct LastCall {
    choice: i64,
    index: i64,
    choice_pos: usize,
    slot: usize,
    started_at_ms: u64,
}

impl ToolCallTracker {
    /// A tracker; `keep_arguments` says whether the assembled arguments
    /// text is kept (needed for the final `toolCalls`) or only counted
    /// (O(1) memory per call, enough for progress).
    pub fn new(keep_arguments: bool) -> Self {
        ToolCallTracker {
            keep_arguments,
            ..ToolCallTracker::default()
        }
    }

    /// Applies one chunk at time `now` (see [`Now`]).
    ///
    /// Always inlined into its caller, the pipeline's per-chunk closure
    /// (the only one outside tests), where the chunk's kind was just
    /// matched: a text or reasoning chunk, nearly every chunk of a stream,
    /// is then a store and a test, not a call that returns its `Applied`
    /// through memory. The tool-call work stays out of line
    /// (`apply_delta`).
    #[inline(always)]
    pub fn apply(&mut self, chunk: &Chunk<'_>, now: impl Into<Now>) -> Applied<'_> {
        match chunk {
            Chunk::Text { .. } => self.text(StreamPhase::Answering),
            Chunk::Reasoning { .. } => self.text(StreamPhase::Reasoning),
            Chunk::ToolCallDelta(delta) => {
                self.phase = StreamPhase::CallingTools;
                match self.apply_delta(delta, now.into()) {
                    Some(progress) => Applied::Progress(progress),
                    None => Applied::Unchanged,
                }
            }
            Chunk::Finish { choice, kind } => {
                if self.choices.len() >= MAX_CHOICES
                    && self
                        .choices
                        .binary_search_by_key(choice, |c| c.choice)
                        .is_err()
                {
                    return Applied::Unchanged;
                }
                let c = self.choice_mut(*choice);
                c.finish = Some(*kind);
                for call in &mut c.calls {
                    call.state = CallState::Complete;
                }
                Applied::Unchanged
            }
            Chunk::Usage(usage) => {
                self.usage = Some(*usage);
                Applied::Unchanged
            }
            Chunk::Error { .. } => {
                self.phase = StreamPhase::Failed;
                self.errored = true;
                self.clear()
            }
            Chunk::Done => self.end(),
            Chunk::Ignored { .. } => Applied::Unchanged,
        }
    }

    /// Text came (`Answering`) or reasoning (`Reasoning`), whatever it
    /// says: the calls in progress are over. What [`apply`](Self::apply)
    /// does with a text or reasoning chunk, for a caller that has no chunk
    /// to build.
    #[inline(always)]
    pub fn text(&mut self, phase: StreamPhase) -> Applied<'_> {
        self.phase = phase;
        self.clear()
    }

    /// The stream ended (`[DONE]`, its last byte, or `done: true`): every
    /// call is complete and the in-progress map is cleared.
    pub fn end(&mut self) -> Applied<'_> {
        self.end_of_input(false)
    }

    /// [`end`](Self::end), at the end of the input (`stopped_early`: with
    /// neither `[DONE]` nor Ollama's `done`): a call in progress whose
    /// answer may stop in the middle ends as failed (its spinner's `✗`),
    /// by the rule of the done line's `incomplete`
    /// ([`cut_short`](Self::cut_short)); it ended with `✓`, as if whole.
    pub fn end_of_input(&mut self, stopped_early: bool) -> Applied<'_> {
        if self.phase != StreamPhase::Failed {
            self.phase = StreamPhase::Done;
        }
        for call in self.choices.iter_mut().flat_map(|c| c.calls.iter_mut()) {
            call.state = CallState::Complete;
        }
        if self.in_progress.is_empty() {
            return Applied::Unchanged;
        }
        self.clear_calls_with(|tracker, choice| {
            tracker.phase == StreamPhase::Failed || tracker.cut_short(choice, stopped_early)
        })
    }

    /// A frame that may have carried a chunk (not JSON, not UTF-8, of an
    /// unexpected shape, or too large to read) was passed over: every
    /// answer of the stream may lack a piece ([`cut_short`](Self::cut_short)).
    pub fn frame_unread(&mut self) {
        self.unread = true;
    }

    /// A tool started executing (`tool:execute` with `phase: "start"`).
    pub fn tool_execution_started(&mut self) -> Applied<'_> {
        self.clear()
    }

    /// [`tool_execution_started`](Self::tool_execution_started), told by
    /// whoever already ended the calls in progress (`serve`'s session, whose
    /// clear drew their final lines): they are not kept as ended
    /// ([`keep_ended`](Self::keep_ended)), which would end them twice.
    pub fn tool_execution_started_elsewhere(&mut self) {
        let ended = self.ended.take();
        self.clear();
        self.ended = ended;
    }

    /// From now on, remember the calls whose progress ends, until taken.
    pub fn keep_ended(&mut self) {
        self.ended.get_or_insert_with(Vec::new);
    }

    /// Moves the calls whose progress ended since the last call into `out`
    /// (emptied first), in the order they ended; none unless
    /// [`keep_ended`](Self::keep_ended) was called.
    pub fn take_ended(&mut self, out: &mut Vec<EndedCall>) {
        out.clear();
        if let Some(ended) = self.ended.as_mut() {
            out.append(ended);
        }
    }

    /// Deltas refused because they would have started a call past
    /// [`MAX_CALLS`] (or a choice past [`MAX_CHOICES`]).
    pub fn refused_calls(&self) -> u64 {
        self.refused_calls
    }

    /// A number that grows whenever the in-progress map changes.
    pub fn changes(&self) -> u64 {
        self.changes
    }

    pub fn phase(&self) -> StreamPhase {
        self.phase
    }

    /// The last usage the stream reported.
    pub fn usage(&self) -> Option<Usage> {
        self.usage
    }

    /// The calls being generated now, sorted by choice then index.
    pub fn in_progress(&self) -> impl Iterator<Item = Progress<'_>> {
        self.in_progress
            .iter()
            .filter_map(|(&(choice, index), &started)| {
                let call = self.call(choice, index)?;
                Some(Progress {
                    choice,
                    index,
                    name: &call.name,
                    chars_accumulated: call.chars_accumulated,
                    started_at_ms: started,
                })
            })
    }

    /// Replaces `out` with the calls being generated now, sorted by choice
    /// then index (reusing its allocations).
    pub fn snapshot_into(&self, out: &mut Vec<ProgressEntry>) {
        let mut len = 0;
        for p in self.in_progress() {
            match out.get_mut(len) {
                // Reuse the entry, and share the name: this runs on every
                // delta of a proxied stream.
                Some(entry) => {
                    entry.choice = p.choice;
                    entry.index = p.index;
                    if !Arc::ptr_eq(&entry.name, p.name) {
                        entry.name = Arc::clone(p.name);
                    }
                    entry.chars_accumulated = p.chars_accumulated;
                    entry.started_at_ms = p.started_at_ms;
                }
                None => out.push(ProgressEntry {
                    choice: p.choice,
                    index: p.index,
                    name: Arc::clone(p.name),
                    chars_accumulated: p.chars_accumulated,
                    started_at_ms: p.started_at_ms,
                }),
            }
            len += 1;
        }
        out.truncate(len);
    }

    /// Brings `out` up to date: a [`snapshot_into`](Self::snapshot_into)
    /// taken when [`changes`](Self::changes) was `taken_at`, and changed
    /// since by nothing but being emptied. When all that changed since is
    /// more arguments for the last call, the steady case of a streaming
    /// call, only that call's entry is rewritten (found by a binary search
    /// of the sorted entries); otherwise the whole snapshot is taken again.
    /// `serve` publishes a snapshot per write, every event of a paced
    /// stream, and the whole one costs a walk of the in-progress map and
    /// two searches per call in it (BENCHMARKS.md, twenty-sixth round).
    pub fn refresh_snapshot(&self, out: &mut Vec<ProgressEntry>, taken_at: u64) {
        if taken_at >= self.layout_at
            && let Some(last) = self.last
            // A new choice (a `finish_reason` for a choice not seen yet)
            // moves the places without a change of progress.
            && let Some(call) = self.last_call(last)
            && let Ok(at) =
                out.binary_search_by(|e| (e.choice, e.index).cmp(&(last.choice, last.index)))
            && let Some(entry) = out.get_mut(at)
        {
            entry.chars_accumulated = call.chars_accumulated;
            return;
        }
        self.snapshot_into(out);
    }

    /// Every choice that has tool calls, in choice order, with its calls in
    /// index order.
    pub fn calls(&self) -> impl Iterator<Item = (i64, &[ToolCall])> {
        self.choices
            .iter()
            .filter(|c| !c.calls.is_empty())
            .map(|c| (c.choice, c.calls.as_slice()))
    }

    /// Whether `choice`'s answer may stop in the middle (the `done` lines'
    /// `incomplete`): its `finish_reason` says it was cut short (`length`,
    /// …); or it reported none, and the stream failed (an error inside it)
    /// or `stopped_early`, with neither `[DONE]` nor Ollama's `done`. A
    /// choice that reported none before `[DONE]` is whole: some providers
    /// never send one. An error counts whatever came after it (a stream
    /// that goes on after an error is still one that failed). And any
    /// choice may lack a piece when a frame could not be read, or a call
    /// when calls past [`MAX_CALLS`] were refused.
    pub fn cut_short(&self, choice: i64, stopped_early: bool) -> bool {
        if self.unread || self.refused_calls > 0 {
            return true;
        }
        let calls = self.choices.iter().find(|c| c.choice == choice);
        match calls.and_then(|c| c.finish) {
            Some(FinishKind::Whole) => false,
            Some(FinishKind::CutShort) => true,
            None => stopped_early || self.errored,
        }
    }

    /// Whether the upstream reported an error inside the stream (a
    /// `{"error":…}` chunk, an `event: error`).
    pub fn errored(&self) -> bool {
        self.errored
    }

    /// Whether any answer of the stream may stop in the middle
    /// ([`cut_short`](Self::cut_short)): choice 0's, or that of any choice
    /// the tracker knows (one that made calls or gave a `finish_reason`),
    /// text answers included. A choice other than 0 that gave only text,
    /// and no `finish_reason`, is not known: the tracker keeps no state
    /// for text.
    pub fn any_cut_short(&self, stopped_early: bool) -> bool {
        self.cut_short(0, stopped_early)
            || self
                .choices
                .iter()
                .any(|c| self.cut_short(c.choice, stopped_early))
    }

    fn call(&self, choice: i64, index: i64) -> Option<&ToolCall> {
        let c = self.choices.iter().find(|c| c.choice == choice)?;
        let i = c
            .calls
            .binary_search_by_key(&index, |call| call.index)
            .ok()?;
        c.calls.get(i)
    }

    /// Inlined for its usual answer: a text delta with no call in
    /// progress (every content line of a stream) changes nothing, and the
    /// call of the whole clear cost 22 instructions a line (callgrind, the
    /// Ollama capture).
    #[inline(always)]
    fn clear(&mut self) -> Applied<'_> {
        if self.in_progress.is_empty() {
            return Applied::Unchanged;
        }
        self.clear_calls()
    }

    /// [`clear`](Self::clear) with calls in progress.
    #[inline(never)]
    fn clear_calls(&mut self) -> Applied<'_> {
        self.clear_calls_with(|tracker, _| tracker.phase == StreamPhase::Failed)
    }

    /// [`clear_calls`](Self::clear_calls), each ended call `failed` as
    /// the tracker and its choice say.
    fn clear_calls_with(&mut self, failed: impl Fn(&Self, i64) -> bool) -> Applied<'_> {
        if let Some(mut ended) = self.ended.take() {
            ended.extend(self.in_progress().map(|p| EndedCall {
                entry: p.to_entry(),
                failed: failed(self, p.choice),
            }));
            self.ended = Some(ended);
        }
        self.in_progress.clear();
        self.last = None;
        self.changes += 1;
        self.layout_at = self.changes;
        Applied::Cleared
    }

    /// The call `last` names, if its places still hold it (a new choice
    /// or call moves them). Inlined: the shortcut asks on every delta.
    #[inline(always)]
    fn last_call(&self, last: LastCall) -> Option<&ToolCall> {
        self.choices
            .get(last.choice_pos)
            .filter(|choice| choice.choice == last.choice)
            .and_then(|choice| choice.calls.get(last.slot))
            .filter(|call| call.index == last.index)
    }

    fn choice_mut(&mut self, choice: i64) -> &mut ChoiceCalls {
        choice_entry(&mut self.choices, choice)
    }

    /// The call of `last`'s choice with `index`, if it is in progress:
    /// `last` itself when it names that call (and its places still hold
    /// it), else the call found among its choice's calls, with its start
    /// from the in-progress map. Inlined: the shortcut asks on every delta.
    #[inline(always)]
    fn call_in_progress(&self, last: LastCall, index: i64) -> Option<LastCall> {
        if index == last.index {
            return self.last_call(last).map(|_| last);
        }
        let choice = self
            .choices
            .get(last.choice_pos)
            .filter(|choice| choice.choice == last.choice)?;
        let slot = choice
            .calls
            .binary_search_by_key(&index, |call| call.index)
            .ok()?;
        let &started_at_ms = self.in_progress.get(&(last.choice, index))?;
        Some(LastCall {
            index,
            slot,
            started_at_ms,
            ..last
        })
    }

    fn apply_delta(&mut self, delta: &ToolCallDelta<'_>, now: Now) -> Option<Progress<'_>> {
        let keep_arguments = self.keep_arguments;
        let before = self.changes;
        self.changes += 1;
        // More arguments for a call in progress of the choice the last
        // delta went to (with an index, which is authoritative; no id or
        // name to record): what the searches below would find, without
        // them, or with one search of that choice's calls when parallel
        // calls stream in turns.
        if let Some(last) = self.last
            && delta.id.is_none()
            && delta.name.is_none()
            && delta.choice == last.choice
            && let Some(index) = delta.index
            && let Some(to) = self.call_in_progress(last, index)
        {
            if to.index != last.index {
                // A snapshot taken before this delta differs from the
                // calls in progress in this call's count alone.
                self.layout_at = before;
                self.last = Some(to);
            }
            // (Both places were just checked.)
            let choice = &mut self.choices[to.choice_pos];
            choice.last_touched = Some(to.index);
            let call = &mut choice.calls[to.slot];
            if delta.custom {
                call.kind = CallKind::Custom;
            }
            append_arguments(call, &delta.arguments, keep_arguments);
            return Some(Progress {
                choice: to.choice,
                index: to.index,
                name: &call.name,
                chars_accumulated: call.chars_accumulated,
                started_at_ms: to.started_at_ms,
            });
        }
        if self.past_the_limits(delta) {
            self.changes = before;
            self.refused_calls += 1;
            // A delta without index, id or name goes to the call the last
            // one went to: after a refused call, that is the refused one,
            // not the call touched before it.
            if let Ok(pos) = self
                .choices
                .binary_search_by_key(&delta.choice, |c| c.choice)
                && let Some(choice) = self.choices.get_mut(pos)
            {
                choice.last_touched = None;
            }
            return None;
        }
        self.layout_at = self.changes;
        let choice_pos = choice_position(&mut self.choices, delta.choice);
        let choice = &mut self.choices[choice_pos];
        let index = resolve_index(choice, delta);
        if let Some(id) = &delta.id {
            // The latest call an id named is the one it names.
            match choice.ids.get_mut(id.as_ref()) {
                Some(named) => *named = index,
                None if self.id_count < MAX_IDS
                    && self.id_bytes.saturating_add(id.len()) <= MAX_ID_BYTES =>
                {
                    self.id_count += 1;
                    self.id_bytes += id.len();
                    choice.ids.insert(id.to_string(), index);
                }
                // Not remembered (see `MAX_IDS`).
                None => {}
            }
        }
        choice.last_touched = Some(index);
        let slot = match choice.calls.binary_search_by_key(&index, |c| c.index) {
            Ok(slot) => slot,
            Err(slot) => {
                let call = ToolCall {
                    index,
                    id: String::new(),
                    name: Arc::from(""),
                    arguments: String::new(),
                    carry: None,
                    chars_accumulated: 0,
                    state: CallState::Announced,
                    kind: CallKind::Function,
                };
                choice.calls.insert(slot, call);
                self.call_count += 1;
                slot
            }
        };
        let call = &mut choice.calls[slot];
        // SPEC.md: a non-empty id or name replaces, never concatenates.
        if let Some(id) = &delta.id {
            call.id.clear();
            call.id.push_str(id);
        }
        // (A provider that repeats the name on each delta keeps the one
        // allocation.)
        if let Some(name) = &delta.name
            && *call.name != **name
        {
            call.name = Arc::from(name.as_ref());
        }
        if delta.custom {
            call.kind = CallKind::Custom;
        }
        append_arguments(call, &delta.arguments, keep_arguments);
        let started_at_ms = *self
            .in_progress
            .entry((delta.choice, index))
            .or_insert_with(|| now.ms());
        self.last = Some(LastCall {
            choice: delta.choice,
            index,
            choice_pos,
            slot,
            started_at_ms,
        });
        Some(Progress {
            choice: delta.choice,
            index,
            name: &call.name,
            chars_accumulated: call.chars_accumulated,
            started_at_ms,
        })
    }

    /// Whether `delta` would start a call past [`MAX_CALLS`], or a choice
    /// past [`MAX_CHOICES`] (and be refused).
    pub(crate) fn past_the_limits(&self, delta: &ToolCallDelta<'_>) -> bool {
        if self.call_count < MAX_CALLS && self.choices.len() < MAX_CHOICES {
            return false;
        }
        match self
            .choices
            .binary_search_by_key(&delta.choice, |c| c.choice)
        {
            Err(_) => true,
            Ok(pos) => {
                let choice = &self.choices[pos];
                let index = resolve_index(choice, delta);
                self.call_count >= MAX_CALLS
                    && choice
                        .calls
                        .binary_search_by_key(&index, |c| c.index)
                        .is_err()
            }
        }
    }
}

/// A delta's arguments, added to its call.
fn append_arguments(call: &mut ToolCall, arguments: &ArgumentsDelta<'_>, keep_arguments: bool) {
    match arguments {
        ArgumentsDelta::Unchanged => {}
        ArgumentsDelta::Append(fragment) => {
            // Unescaped only to be kept (a surrogate pair cut between two
            // fragments joined); counted as it stands.
            if keep_arguments {
                fragment.push_joined(&mut call.arguments, &mut call.carry);
            }
            call.chars_accumulated += fragment.utf16_len();
        }
        ArgumentsDelta::Replace(whole) => {
            call.arguments.clear();
            call.carry = None;
            if keep_arguments {
                call.arguments.push_str(whole);
            }
            call.chars_accumulated = utf16_len(whole);
        }
    }
    if call.chars_accumulated > 0 {
        call.state = CallState::StreamingArgs;
    }
}

/// The calls of `choice`, created in choice order when new.
fn choice_entry(choices: &mut Vec<ChoiceCalls>, choice: i64) -> &mut ChoiceCalls {
    let pos = choice_position(choices, choice);
    &mut choices[pos]
}

/// Where the calls of `choice` are in `choices`, created in choice order
/// when new.
fn choice_position(choices: &mut Vec<ChoiceCalls>, choice: i64) -> usize {
    match choices.binary_search_by_key(&choice, |c| c.choice) {
        Ok(pos) => pos,
        Err(pos) => {
            let calls = ChoiceCalls {
                choice,
                ..ChoiceCalls::default()
            };
            choices.insert(pos, calls);
            pos
        }
    }
}

/// SPEC.md, "Which call a `tool_calls` entry belongs to".
fn resolve_index(choice: &ChoiceCalls, delta: &ToolCallDelta<'_>) -> i64 {
    if let Some(index) = delta.index {
        return index;
    }
    if let Some(id) = &delta.id
        && let Some(&index) = choice.ids.get(id.as_ref())
    {
        return index;
    }
    let next = choice.calls.last().map_or(0, |c| c.index.saturating_add(1));
    if delta.id.is_some() || delta.name.is_some() {
        return next;
    }
    choice.last_touched.unwrap_or(next)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::borrow::Cow;

    fn delta(
        index: Option<i64>,
        id: Option<&str>,
        name: Option<&str>,
        args: &str,
    ) -> Chunk<'static> {
        Chunk::ToolCallDelta(ToolCallDelta {
            choice: 0,
            index,
            id: id.map(|s| Cow::Owned(s.to_owned())),
            name: name.map(|s| Cow::Owned(s.to_owned())),
            arguments: ArgumentsDelta::Append(Cow::<str>::Owned(args.to_owned()).into()),
            custom: false,
        })
    }

    fn progress(t: &mut ToolCallTracker, chunk: Chunk<'_>, now: u64) -> (i64, String, usize, u64) {
        match t.apply(&chunk, now) {
            Applied::Progress(p) => (
                p.index,
                p.name.to_string(),
                p.chars_accumulated,
                p.started_at_ms,
            ),
            other => panic!("expected progress, got {other:?}"),
        }
    }

    /// A call given a new id on every delta: the ids remembered stay
    /// within [`MAX_IDS`] and [`MAX_ID_BYTES`] (they grew with the
    /// stream); one remembered still names its call, and one past the
    /// bound, named alone, starts a new call, as an unknown id does.
    #[test]
    fn the_ids_remembered_are_bounded() {
        let mut t = ToolCallTracker::new(false);
        let id = |n: usize| format!("call_{n:0>200}");
        for n in 0..10_000 {
            t.apply(&delta(Some(0), Some(&id(n)), Some("f"), "x"), 1);
        }
        assert!(t.id_count <= MAX_IDS && t.id_bytes <= MAX_ID_BYTES);
        let remembered: usize = t.choices.iter().map(|c| c.ids.len()).sum();
        assert_eq!(remembered, t.id_count);
        assert_eq!(t.id_count, MAX_IDS.min(MAX_ID_BYTES / id(0).len()));
        assert_eq!(
            progress(&mut t, delta(None, Some(&id(0)), None, "y"), 2),
            (0, "f".into(), 10_001, 1)
        );
        assert_eq!(
            progress(&mut t, delta(None, Some(&id(9_999)), None, "y"), 2),
            (1, "".into(), 1, 2)
        );
        // Long ids: the bytes' bound comes first.
        let mut t = ToolCallTracker::new(false);
        let long = |n: usize| format!("{n:0>2000}");
        for n in 0..2_000 {
            t.apply(&delta(Some(0), Some(&long(n)), Some("f"), "x"), 1);
        }
        assert_eq!(t.id_count, MAX_ID_BYTES / 2000);
        assert!(t.id_bytes <= MAX_ID_BYTES);
    }

    /// Past [`MAX_CALLS`] calls (here announced in descending order, the
    /// order that moved every call kept at each new one), a delta that
    /// would start another is refused and counted; the calls kept go on,
    /// and a new choice past [`MAX_CHOICES`] is refused too.
    #[test]
    fn calls_past_the_limit_are_refused() {
        let mut t = ToolCallTracker::new(false);
        let extra = 10;
        for i in 0..(MAX_CALLS + extra) as i64 {
            let applied = t.apply(&delta(Some(1_000_000 - i), None, Some("f"), "x"), 1);
            let kept = (i as usize) < MAX_CALLS;
            assert_eq!(matches!(applied, Applied::Progress(_)), kept, "call {i}");
        }
        assert_eq!(t.refused_calls(), extra as u64);
        let (_, calls) = t.calls().next().expect("one choice");
        assert_eq!(calls.len(), MAX_CALLS);
        assert!(calls.windows(2).all(|w| w[0].index < w[1].index));
        // A call kept still grows; a refused one still is not there.
        assert_eq!(
            progress(&mut t, delta(Some(1_000_000), None, None, "yz"), 2),
            (1_000_000, "f".into(), 3, 1)
        );
        let refused = 1_000_000 - MAX_CALLS as i64;
        assert!(matches!(
            t.apply(&delta(Some(refused), None, None, "y"), 2),
            Applied::Unchanged
        ));
        assert_eq!(t.refused_calls(), extra as u64 + 1);
        // A refused call announced by id (no index), then its arguments with
        // nothing to name the call: they are the refused call's, refused
        // too, and the call touched before does not grow.
        let touched = 1_000_000 - (MAX_CALLS as i64 - 1);
        t.apply(&delta(Some(touched), None, None, ""), 3);
        assert!(matches!(
            t.apply(&delta(None, Some("new"), Some("g"), ""), 3),
            Applied::Unchanged
        ));
        assert!(matches!(
            t.apply(&delta(None, None, None, "{\"a\":1}"), 3),
            Applied::Unchanged
        ));
        let (_, calls) = t.calls().next().expect("one choice");
        let kept = calls.iter().find(|c| c.index == touched).expect("kept");
        assert_eq!(kept.chars_accumulated, 1);
        assert_eq!(t.refused_calls(), extra as u64 + 3);
        // Choices: past MAX_CHOICES, neither a finish nor a delta of a new
        // one is kept.
        let mut t = ToolCallTracker::new(false);
        for choice in 0..MAX_CHOICES as i64 {
            let kind = FinishKind::Whole;
            t.apply(&Chunk::Finish { choice, kind }, 1);
        }
        let past = MAX_CHOICES as i64;
        let kind = FinishKind::CutShort;
        t.apply(&Chunk::Finish { choice: past, kind }, 1);
        // Kept, the last one would say "whole" however the stream stopped;
        // the one past them, not kept, says nothing.
        assert!(!t.cut_short(past - 1, true) && !t.cut_short(past, false));
        let mut new_choice = delta(Some(0), None, Some("f"), "x");
        if let Chunk::ToolCallDelta(d) = &mut new_choice {
            d.choice = past;
        }
        assert!(matches!(t.apply(&new_choice, 1), Applied::Unchanged));
        assert_eq!(t.refused_calls(), 1);
    }

    #[test]
    fn same_index_keeps_started_at_and_counts_utf16() {
        let mut t = ToolCallTracker::new(true);
        assert_eq!(
            progress(&mut t, delta(Some(0), Some("c1"), Some("edit"), ""), 100),
            (0, "edit".into(), 0, 100)
        );
        assert_eq!(
            progress(&mut t, delta(Some(0), None, None, "{\"a\":\"é😀"), 200),
            (0, "edit".into(), 9, 100)
        );
        assert_eq!(
            progress(&mut t, delta(Some(1), Some("c2"), Some("ls"), ""), 300),
            (1, "ls".into(), 0, 300)
        );
        let snapshot: Vec<_> = t
            .in_progress()
            .map(|p| (p.index, p.started_at_ms))
            .collect();
        assert_eq!(snapshot, vec![(0, 100), (1, 300)]);
    }

    #[test]
    fn text_reasoning_done_error_and_execution_clear() {
        let text = Chunk::Text {
            choice: 0,
            text: "hi".into(),
        };
        for clear in [
            text.clone(),
            Chunk::Reasoning {
                choice: 0,
                text: "hm".into(),
            },
            Chunk::Done,
            Chunk::Error {
                raw: "\"x\"",
                message: "x".into(),
            },
        ] {
            let mut t = ToolCallTracker::new(true);
            progress(&mut t, delta(Some(0), None, Some("f"), ""), 1);
            assert_eq!(t.apply(&clear, 2), Applied::Cleared);
            assert_eq!(t.in_progress().count(), 0);
            // The assembled calls survive a clear.
            assert_eq!(t.calls().count(), 1);
        }
        let mut t = ToolCallTracker::new(true);
        progress(&mut t, delta(Some(0), None, Some("f"), ""), 1);
        assert_eq!(t.tool_execution_started(), Applied::Cleared);
        assert_eq!(t.apply(&text, 3), Applied::Unchanged);
        // After a clear, the same index starts again with a new startedAt.
        assert_eq!(
            progress(&mut t, delta(Some(0), None, None, "x"), 9),
            (0, "f".into(), 1, 9)
        );
    }

    #[test]
    fn entries_without_index_resolve_by_id_then_name_then_last_touched() {
        let mut t = ToolCallTracker::new(true);
        assert_eq!(
            progress(&mut t, delta(None, Some("a"), Some("f"), "{"), 1).0,
            0
        );
        assert_eq!(
            progress(&mut t, delta(None, Some("b"), Some("g"), "["), 1).0,
            1
        );
        assert_eq!(progress(&mut t, delta(None, None, None, "]"), 1).0, 1);
        assert_eq!(progress(&mut t, delta(None, Some("a"), None, "}"), 1).0, 0);
        assert_eq!(progress(&mut t, delta(None, None, None, " "), 1).0, 0);
        assert_eq!(progress(&mut t, delta(None, None, Some("h"), ""), 1).0, 2);
        let calls: Vec<_> = t
            .calls()
            .flat_map(|(_, c)| c.iter().map(|c| c.arguments.clone()))
            .collect();
        assert_eq!(calls, vec!["{} ", "[]", ""]);
    }

    #[test]
    fn index_is_authoritative_and_names_replace() {
        let mut t = ToolCallTracker::new(true);
        progress(&mut t, delta(Some(0), Some("a"), Some("get"), "1"), 1);
        progress(
            &mut t,
            delta(Some(0), Some("other"), Some("get_weather"), "2"),
            1,
        );
        let (_, calls) = t.calls().next().expect("one choice");
        assert_eq!(calls.len(), 1);
        assert_eq!(
            (
                calls[0].id.as_str(),
                &*calls[0].name,
                calls[0].arguments.as_str()
            ),
            ("other", "get_weather", "12")
        );
    }

    /// Pseudo-random chunks that move the last-call shortcut's places: new
    /// choices before and after, new calls before, clears, finishes,
    /// deltas without an index, ids and names.
    struct Chunks {
        state: u64,
    }

    impl Chunks {
        fn new(seed: u64) -> Chunks {
            Chunks { state: seed }
        }

        fn roll(&mut self, n: u64) -> u64 {
            self.state = self
                .state
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            (self.state >> 33) % n
        }

        fn next(&mut self, step: u64) -> Chunk<'static> {
            let roll = self.roll(100);
            if roll < 80 {
                let index = match self.roll(10) {
                    0 => None,
                    i => Some(i64::try_from(i % 4).expect("small") * 2 - 1),
                };
                let arguments = match self.roll(20) {
                    0 => ArgumentsDelta::Unchanged,
                    1 => ArgumentsDelta::Replace("{\"é\":1}".into()),
                    _ => ArgumentsDelta::Append(
                        Cow::<str>::Owned("ab😀".repeat(1 + step as usize % 3)).into(),
                    ),
                };
                let choice = [0, 0, 0, 2, -1][self.roll(5) as usize];
                let id = (self.roll(8) == 0).then(|| Cow::Owned(format!("call_{}", self.roll(3))));
                let name = (self.roll(8) == 0).then(|| Cow::Owned(format!("f{}", self.roll(3))));
                Chunk::ToolCallDelta(ToolCallDelta {
                    choice,
                    index,
                    id,
                    name,
                    arguments,
                    custom: false,
                })
            } else if roll < 90 {
                Chunk::Text {
                    choice: 0,
                    text: "t".into(),
                }
            } else {
                // A new choice first, at times: every choice after it
                // moves.
                Chunk::Finish {
                    choice: [0, 1, 5, -1 - step as i64][self.roll(4) as usize],
                    kind: FinishKind::Whole,
                }
            }
        }
    }

    /// A snapshot refreshed after each of a few chunks (as `serve` does
    /// after each write) is the whole snapshot: 20 seeds × 2,000 chunks,
    /// refreshed after one to three chunks, and now and then emptied in
    /// between (as a tool's execution start empties a session's). Most
    /// refreshes rewrite one entry, after deltas to the last call or
    /// (parallel calls in turns) to another call in progress.
    #[test]
    fn a_refreshed_snapshot_is_the_whole_snapshot() {
        for seed in 1..=20u64 {
            let mut tracker = ToolCallTracker::new(false);
            let mut chunks = Chunks::new(seed);
            let (mut refreshed, mut whole) = (Vec::new(), Vec::new());
            let mut taken_at = tracker.changes();
            let (mut one_entry, mut switched) = (0, 0);
            let mut last = None;
            for step in 0..2_000u64 {
                // Two chunks in three carry on a call: the last one, or
                // one time in three another call in progress.
                let carried_on = match last {
                    Some(last) if chunks.roll(3) != 0 => {
                        let others: Vec<(i64, i64)> = tracker
                            .in_progress()
                            .map(|p| (p.choice, p.index))
                            .filter(|&call| call != last)
                            .collect();
                        let pick = chunks.roll(3 * others.len().max(1) as u64) as usize;
                        Some(others.get(pick).copied().unwrap_or(last))
                    }
                    _ => None,
                };
                let chunk = match carried_on {
                    Some((choice, index)) => Chunk::ToolCallDelta(ToolCallDelta {
                        choice,
                        index: Some(index),
                        id: None,
                        name: None,
                        arguments: ArgumentsDelta::Append(Cow::Borrowed("ab😀").into()),
                        custom: false,
                    }),
                    None => chunks.next(step),
                };
                if let Chunk::ToolCallDelta(delta) = &chunk {
                    let to = delta.index.map(|index| (delta.choice, index));
                    switched += u64::from(carried_on.is_some() && to != last);
                    last = to;
                }
                tracker.apply(&chunk, step);
                if chunks.roll(2) != 0 {
                    continue;
                }
                if chunks.roll(20) == 0 {
                    refreshed.clear();
                }
                one_entry += u64::from(
                    taken_at >= tracker.layout_at
                        && tracker.last.is_some()
                        && !refreshed.is_empty(),
                );
                tracker.refresh_snapshot(&mut refreshed, taken_at);
                taken_at = tracker.changes();
                tracker.snapshot_into(&mut whole);
                assert_eq!(refreshed, whole, "seed {seed}, step {step}: {chunk:?}");
            }
            assert!(one_entry > 300, "seed {seed}: {one_entry}");
            assert!(switched > 50, "seed {seed}: {switched}");
        }
    }

    /// The shortcut to the call the last delta went to, or to another
    /// call in progress of its choice, gives what the searches give: two trackers take the same chunks, one of them with
    /// its last call forgotten before each, and must agree on every
    /// answer and on what they hold at the end. The chunks move the
    /// shortcut's places: new choices before and after, new calls before,
    /// clears, finishes, deltas without an index, ids and names.
    #[test]
    fn the_last_call_shortcut_answers_as_the_searches_do() {
        for seed in 1..=20u64 {
            let mut fast = ToolCallTracker::new(seed % 2 == 0);
            let mut slow = ToolCallTracker::new(seed % 2 == 0);
            let mut chunks = Chunks::new(seed);
            let (mut shortcuts, mut switches) = (0, 0);
            for step in 0..2_000u64 {
                let chunk = chunks.next(step);
                shortcuts += u64::from(fast.last.is_some());
                slow.last = None;
                let (a, b) = (fast.apply(&chunk, step), slow.apply(&chunk, step));
                assert_eq!(a, b, "seed {seed}, step {step}: {chunk:?}");
                // Only a delta to another call in progress sets this (a
                // chunk that changes nothing after it keeps it).
                switches += u64::from(fast.layout_at + 1 == fast.changes);
            }
            assert!(shortcuts > 500, "seed {seed}: {shortcuts}");
            assert!(switches > 50, "seed {seed}: {switches}");
            assert_eq!(
                fast.in_progress().collect::<Vec<_>>(),
                slow.in_progress().collect::<Vec<_>>()
            );
            let calls = |t: &ToolCallTracker| {
                t.calls()
                    .map(|(choice, calls)| (choice, format!("{calls:?}")))
                    .collect::<Vec<_>>()
            };
            assert_eq!(calls(&fast), calls(&slow), "seed {seed}");
        }
    }

    #[test]
    fn replace_resets_the_count_and_end_completes_calls() {
        let mut t = ToolCallTracker::new(true);
        progress(&mut t, delta(Some(0), None, Some("f"), "abc"), 1);
        let replace = Chunk::ToolCallDelta(ToolCallDelta {
            choice: 0,
            index: Some(0),
            id: None,
            name: None,
            arguments: ArgumentsDelta::Replace("{}".into()),
            custom: false,
        });
        assert_eq!(progress(&mut t, replace, 2).2, 2);
        t.end();
        assert_eq!(t.phase(), StreamPhase::Done);
        let (_, calls) = t.calls().next().expect("one choice");
        assert_eq!(calls[0].state, CallState::Complete);
    }
}
