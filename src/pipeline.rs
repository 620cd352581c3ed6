//! The whole synchronous pipeline of one stream: bytes → frames → chunks →
//! progress → output bytes.
//!
//! [`Annotator`] is what `annotate` runs on stdin and what the proxy runs on
//! each streamed response body: feed it input as it arrives
//! ([`push`](Annotator::push)), then [`finish`](Annotator::finish) at end of
//! input; it writes to a [`Sink`] and collects [`Warning`]s for the caller to
//! print. It does no I/O and reads no clock: the caller passes the time, or
//! its clock, as a [`Now`].
//!
//! Framing and decoding meet in one place: at the start of a line, the
//! framer asks the decoder whether the bytes there start with a payload of
//! the shape it learned from the frames before ([`Probe`]); if so, and the
//! line break the framing wants follows it, that is the frame, found
//! without a search for its end, and the decoder keeps the values it found
//! for it. In a steady stream that is nearly every frame.
//!
//! Guarantee: with [`OutputFormat::Sse`], every input byte reaches
//! [`Sink::forward`] exactly once, in order; what is added goes to
//! [`Sink::insert`]. A frame that cannot be understood is forwarded unchanged
//! and reported once.

use crate::chunk::{Chunk, ChunkText, HeldHalves};
use crate::encode::inject::{self, Frame};
use crate::encode::ndjson::{LineEncoder, LineFormat, TextField};
use crate::encode::{InjectMode, OutputFormat, ProgressBatch, Sink};
use crate::error::{Location, Warning, excerpt};
use crate::framing::Framing;
use crate::framing::ndjson::{NdjsonDecoder, NdjsonLine, NdjsonScan};
use crate::framing::sse::{DEFAULT_MAX_EVENT_BYTES, SseBlock, SseBlockKind, SseDecoder, SseScan};
use crate::framing::window::{self, Probe};
use crate::progress::{Applied, Now, ProgressEntry, StreamPhase, ToolCallTracker};
use crate::providers::{self, DecoderState, FrameError, FrameInfo, Provider};

/// How many undecodable frames are reported one by one before the rest are
/// only counted.
const MAX_REPORTED: u64 = 10;
/// Characters of a bad frame quoted in its warning.
const EXCERPT_CHARS: usize = 80;

/// The bytes at a stream's start that decide its framing (see
/// [`Framing::sniff`]): if they are all whitespace (after a BOM), the
/// stream is taken for SSE, which forwards blank lines as they are, so
/// that what is held stays bounded. Only these bytes count, however the
/// reads fall, so the framing never depends on the cuts.
const MAX_BLANK_START: usize = 64 * 1024;

/// What the pipeline should do; validated by the CLI or the proxy.
#[derive(Debug, Clone)]
pub struct AnnotatorConfig {
    pub output: OutputFormat,
    pub inject: InjectMode,
    /// Session id for [`OutputFormat::Messages`].
    pub session_id: Option<String>,
    /// The framing, when known (from a `Content-Type`); `None` sniffs it
    /// from the first bytes.
    pub framing: Option<Framing>,
    /// Events (SSE) or lines (NDJSON) larger than this are passed on as
    /// they stream, unparsed, and reported once.
    pub max_event_bytes: usize,
    /// Keep the stream's increments ([`StreamEvent`]) for
    /// [`Annotator::take_events`] and [`Annotator::collected`] (the proxy's
    /// events route needs them). [`Annotator::collect_events`] turns it on
    /// and off as the stream goes.
    pub collect_events: bool,
}

impl Default for AnnotatorConfig {
    fn default() -> Self {
        AnnotatorConfig {
            output: OutputFormat::default(),
            inject: InjectMode::default(),
            session_id: None,
            framing: None,
            max_event_bytes: DEFAULT_MAX_EVENT_BYTES,
            collect_events: false,
        }
    }
}

/// One increment of a stream's state, as the proxy's events route sends it
/// to subscribers (SPEC.md: one `StreamChunkMessage` per increment, and a
/// clear).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StreamEvent {
    /// A tool-call delta was applied.
    Progress(ProgressEntry),
    /// Answer text (non-empty).
    Content { choice: i64, text: String },
    /// Reasoning text (non-empty).
    Reasoning { choice: i64, text: String },
    /// The in-progress map was cleared, and why.
    Cleared(ClearReason),
    /// The provider said the stream is over.
    Done,
    /// The provider reported an error mid-stream: its `error` value as it
    /// came, on one line (as `--format messages` writes it).
    Error(String),
}

/// Why the in-progress tools were cleared (SPEC.md, "Progress state").
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ClearReason {
    /// Text or reasoning resumed.
    Text,
    /// `[DONE]` or `done: true`.
    Done,
    /// The provider reported an error.
    Error,
    /// The stream ended (or failed, or was cancelled).
    StreamEnd,
    /// A tool started executing.
    ToolExecute,
    /// A new request of the session began.
    NewRequest,
}

impl ClearReason {
    pub fn as_str(self) -> &'static str {
        match self {
            ClearReason::Text => "text",
            ClearReason::Done => "done",
            ClearReason::Error => "error",
            ClearReason::StreamEnd => "stream_end",
            ClearReason::ToolExecute => "tool_execute",
            ClearReason::NewRequest => "new_request",
        }
    }
}

/// The increments collected for subscribers
/// ([`AnnotatorConfig::collect_events`]), and the strings of texts already
/// published, kept for the next ones: a stream's text deltas are collected
/// without an allocation each.
#[derive(Default)]
struct EventLog {
    events: Vec<StreamEvent>,
    /// Emptied strings of published [`StreamEvent::Content`] and
    /// [`StreamEvent::Reasoning`] events.
    spare_texts: Vec<String>,
    /// Whether `events` holds a text event (else they are emptied without
    /// a look at each).
    has_texts: bool,
    /// Input was handled while collecting was off since the increments
    /// were last taken or emptied: they are not all of what changed.
    missed: bool,
    /// High surrogates held back for the next text, as the line formats
    /// hold them (`LineEncoder`).
    carries: HeldHalves,
}

/// Strings an [`EventLog`] keeps for texts to come: a read holds a few text
/// deltas, and a stream's reads are alike.
const SPARE_TEXTS: usize = 16;
/// A string grown past this (a long text delta) is not kept: an idle
/// stream holds at most `SPARE_TEXTS` of these.
const SPARE_TEXT_BYTES: usize = 256;

impl EventLog {
    /// What subscribers hear of one applied chunk.
    fn record(&mut self, chunk: &Chunk<'_>, applied: &Applied<'_>) {
        if !self.carries.is_empty() {
            // Only the choice's next text of the same field can complete a
            // held-back half: before its other field, its progress, an
            // error or the end, it is a U+FFFD (as in `LineEncoder`).
            match (chunk, applied) {
                (Chunk::Text { choice, .. }, _) => {
                    self.end_carries(|c, f| c == *choice && f == TextField::Reasoning)
                }
                (Chunk::Reasoning { choice, .. }, _) => {
                    self.end_carries(|c, f| c == *choice && f == TextField::Content)
                }
                (_, Applied::Progress(p)) => self.end_carries(|c, _| c == p.choice),
                (Chunk::Done | Chunk::Error { .. }, _) => self.end_carries(|_, _| true),
                _ => {}
            }
        }
        if let Applied::Cleared = applied {
            let reason = match chunk {
                Chunk::Text { .. } | Chunk::Reasoning { .. } => ClearReason::Text,
                Chunk::Error { .. } => ClearReason::Error,
                Chunk::Done
                | Chunk::ToolCallDelta(_)
                | Chunk::Finish { .. }
                | Chunk::Usage(_)
                | Chunk::Ignored { .. } => ClearReason::Done,
            };
            self.events.push(StreamEvent::Cleared(reason));
        }
        match (chunk, applied) {
            (_, Applied::Progress(p)) => self.events.push(StreamEvent::Progress(ProgressEntry {
                choice: p.choice,
                index: p.index,
                name: std::sync::Arc::clone(p.name),
                chars_accumulated: p.chars_accumulated,
                started_at_ms: p.started_at_ms,
            })),
            (Chunk::Text { choice, text }, _) => {
                if let Some(text) = self.owned(*choice, TextField::Content, text) {
                    self.events.push(StreamEvent::Content {
                        choice: *choice,
                        text,
                    });
                }
            }
            (Chunk::Reasoning { choice, text }, _) => {
                if let Some(text) = self.owned(*choice, TextField::Reasoning, text) {
                    self.events.push(StreamEvent::Reasoning {
                        choice: *choice,
                        text,
                    });
                }
            }
            (Chunk::Done, _) => self.events.push(StreamEvent::Done),
            // An `event: error` has no value of its own here: its data is
            // given by `sse_block` (`named_error`).
            (Chunk::Error { raw, .. }, _) if !raw.is_empty() => self
                .events
                .push(StreamEvent::Error(crate::js::one_line(raw).collect())),
            (Chunk::Error { .. }, _) => {}
            (
                Chunk::ToolCallDelta(_)
                | Chunk::Finish { .. }
                | Chunk::Usage(_)
                | Chunk::Ignored { .. },
                Applied::Cleared | Applied::Unchanged,
            ) => {}
        }
    }

    /// What subscribers hear of an `event: error`, after its chunk's
    /// [`record`](Self::record): its data ([`error_frame_value`]).
    fn named_error(&mut self, data: &[u8]) {
        self.events
            .push(StreamEvent::Error(error_frame_value(data)));
    }

    /// A text event's text, in a string a published one left if any; a
    /// surrogate pair cut between two texts of a choice's field joined
    /// (`None` when all there was is a held-back half).
    fn owned(&mut self, choice: i64, field: TextField, text: &ChunkText<'_>) -> Option<String> {
        self.has_texts = true;
        let mut owned = self.spare_texts.pop().unwrap_or_default();
        if self.carries.passes(choice, field, text) {
            text.push_to(&mut owned);
            return Some(owned);
        }
        self.carries.join(choice, field, text, &mut owned);
        if owned.is_empty() {
            self.spare_texts.push(owned);
            return None;
        }
        Some(owned)
    }

    /// Ends the held-back halves `which` picks, each as a text of U+FFFD.
    fn end_carries(&mut self, which: impl Fn(i64, TextField) -> bool) {
        let EventLog {
            carries,
            events,
            has_texts,
            ..
        } = self;
        carries.end(which, |choice, field| {
            *has_texts = true;
            let text = char::REPLACEMENT_CHARACTER.to_string();
            events.push(match field {
                TextField::Reasoning => StreamEvent::Reasoning { choice, text },
                TextField::Content => StreamEvent::Content { choice, text },
            });
        });
    }

    /// Empties the increments, keeping their texts' strings (emptied) for
    /// the next ones.
    fn clear(&mut self) {
        if !std::mem::take(&mut self.has_texts) {
            self.events.clear();
            return;
        }
        for event in self.events.drain(..) {
            if let StreamEvent::Content { mut text, .. } | StreamEvent::Reasoning { mut text, .. } =
                event
                && self.spare_texts.len() < SPARE_TEXTS
                && (1..=SPARE_TEXT_BYTES).contains(&text.capacity())
            {
                text.clear();
                self.spare_texts.push(text);
            }
        }
    }
}

enum Framer {
    /// Waiting for the first byte that tells SSE from NDJSON.
    Sniffing(Vec<u8>),
    Sse(SseDecoder),
    Ndjson(NdjsonDecoder),
}

/// The pipeline of one stream; see the module docs.
pub struct Annotator {
    framer: Framer,
    max_event_bytes: usize,
    /// Bytes at the start of the framer's pending input (a frame cut by
    /// the end of a piece) that were forwarded already ([`SentAhead`]).
    sent_ahead: usize,
    /// Everything after framing; a separate struct so a frame borrowed from
    /// the framer can be handled while the rest is mutated.
    state: StreamState,
}

/// One frame as the framer saw it.
struct RawFrame<'a> {
    /// Its exact input bytes.
    raw: &'a [u8],
    /// The payload to decode, or `None` when the frame is not a chunk
    /// (a named SSE event, a blank NDJSON line).
    data: Option<&'a [u8]>,
    /// `data` as text, when the framer checked it as UTF-8.
    text: Option<&'a str>,
    /// Offset in `raw` of the closing `}` of the payload, if any (of an
    /// NDJSON line, only under field injection, the one mode that writes
    /// there).
    closing_brace: Option<usize>,
    /// The line break to use for added lines.
    line_ending: &'static [u8],
    /// The frame's line break may still turn from CR into CRLF: what goes
    /// after it waits for the [`SseBlockKind::LineEndTail`].
    line_ending_open: bool,
    /// The framer found it with the decoder's probe, which holds its holes
    /// ([`DecoderState::probed`]).
    probed: bool,
    /// An NDJSON line, which may start a JSON value spread over several
    /// lines ([`Spread`]).
    may_spread: bool,
    at: Location,
}

/// The most bytes and lines a [`Spread`] gathers: an API's pretty-printed
/// error body is well under both.
const MAX_SPREAD_BYTES: usize = 64 * 1024;
/// See [`MAX_SPREAD_BYTES`].
const MAX_SPREAD_LINES: usize = 256;

/// The lines of one JSON value spread over several NDJSON lines, gathered
/// until they parse as one: a pretty-printed body (an API's error, as
/// `curl` gets it for a bad key and pipes it to `annotate`) is then one
/// frame, `{"error":…}` said as the upstream's error, not a dozen lines
/// that are no JSON. A line that starts an object or array and ends
/// early (EOF) starts one. Each line after it is scanned once for the
/// brackets it opens and closes ([`depth_after`]), and the whole is
/// parsed once, when they are all closed: the cost stays linear in the
/// bytes. A line that cannot continue it (a string open at its end, a
/// bracket closed that was not open, or a whole value of its own, as the
/// good lines after one cut after `:` are), the end of the input, or more
/// than [`MAX_SPREAD_BYTES`] or [`MAX_SPREAD_LINES`], ends it, and its
/// lines are then handled one by one as they would have been. Only the
/// line formats are held back; the lines themselves are forwarded as they
/// come.
#[derive(Debug)]
struct Spread {
    /// The lines' payloads, joined by `\n`.
    text: Vec<u8>,
    /// Where each line starts in `text`, and where it was in the input.
    lines: Vec<(usize, Location)>,
    /// The objects and arrays the lines leave open ([`depth_after`]).
    depth: usize,
}

/// The state of one stream after framing.
struct StreamState {
    output: OutputFormat,
    inject: InjectMode,
    /// For the oversized-frame warning.
    max_event_bytes: usize,
    decoder_state: DecoderState,
    tracker: ToolCallTracker,
    /// The progress objects of the current frame.
    batch: ProgressBatch,
    /// Progress is rendered only when some output shows it.
    render_progress: bool,
    lines: LineEncoder,
    /// Reused buffer for text injected after a frame.
    after: String,
    /// Text to inject after the last frame once its line ending is known,
    /// rendered with `\n` line breaks.
    deferred: String,
    warnings: Vec<Warning>,
    /// Undecodable frames so far that may have been chunks.
    undecodable: u64,
    /// A frame that is no chunk was said (once a stream).
    no_chunk_said: bool,
    /// `[DONE]` (or Ollama's `done: true`) was seen: later frames are only
    /// forwarded.
    ended: bool,
    /// Frames after the end were reported.
    ended_warned: bool,
    /// A named event was warned about (once a stream: the line formats
    /// carry each as an `unparsed` line).
    named_warned: bool,
    /// A call refused past the tracker's limits was reported.
    refused_warned: bool,
    /// The fields passed over for their shape that were reported (once
    /// each a stream: [`Chunk::Ignored`]).
    ignored_warned: Vec<&'static str>,
    /// The `done` line(s) were written.
    done_written: bool,
    /// Frames (SSE events with data, NDJSON lines) handled so far.
    frames: u64,
    /// Bytes of input so far.
    input_bytes: u64,
    /// The input failed ([`Annotator::input_failed`]): its end is no
    /// stream's, and was said so.
    failed: bool,
    /// Of those, the frames the framer found with the decoder's probe.
    probed_frames: u64,
    /// Increments for subscribers, kept only when asked for
    /// ([`AnnotatorConfig::collect_events`]).
    events: EventLog,
    /// [`AnnotatorConfig::collect_events`].
    collect_events: bool,
    /// What only the tracker reads of a recognized frame's chunks:
    /// nothing, the text ([`Unread::Text`]), or the text and a tool call
    /// delta's progress ([`Unread::TextAndProgress`]). Frames of that kind
    /// are applied to the tracker by [`StreamState::pass`] as the framer
    /// recognizes them. Kept rather than derived from `output`, `inject`
    /// and `collect_events` on each frame: one test instead of several on
    /// every probed frame (BENCHMARKS.md, thirty-fourth round). Made again
    /// whenever one of them changes. [`Unread::Nothing`] while a
    /// [`Spread`] is gathered, so that every line comes to it.
    unread: Unread,
    /// A JSON value spread over several NDJSON lines, being gathered.
    spread: Option<Box<Spread>>,
    /// A spread's lines are handled one by one again (it could not be
    /// read whole): none of them starts another.
    unspreading: bool,
}

/// Whether an NDJSON line that failed to decode is the start of a JSON
/// value spread over lines ([`Spread`]): an object or array that ends
/// early, as the first line of a pretty-printed body (`{`) does; the
/// brackets it leaves open, if so.
#[cold]
fn spread_depth(data: Option<&[u8]>) -> Option<usize> {
    let data = data?;
    let first = data.iter().find(|b| !b.is_ascii_whitespace());
    if !matches!(first, Some(b'{' | b'['))
        || !serde_json::from_slice::<serde::de::IgnoredAny>(data).is_err_and(|e| e.is_eof())
    {
        return None;
    }
    depth_after(0, data).filter(|&depth| depth > 0)
}

/// Whether `line` is a JSON object or array whole by itself.
fn is_a_whole_value(line: &[u8]) -> bool {
    let first = line.iter().find(|b| !b.is_ascii_whitespace());
    matches!(first, Some(b'{' | b'['))
        && serde_json::from_slice::<serde::de::IgnoredAny>(line).is_ok()
}

/// The objects and arrays open after `line`, `depth` of them open before
/// it, counted outside strings; `None` when the line cannot continue a
/// JSON value: a string still open at its end (JSON strings hold no raw
/// line break), or a bracket closed that was not open.
fn depth_after(mut depth: usize, line: &[u8]) -> Option<usize> {
    let mut in_string = false;
    let mut escaped = false;
    for &byte in line {
        if in_string {
            match (escaped, byte) {
                (true, _) => escaped = false,
                (false, b'\\') => escaped = true,
                (false, b'"') => in_string = false,
                (false, _) => {}
            }
            continue;
        }
        match byte {
            b'"' => in_string = true,
            b'{' | b'[' => depth += 1,
            b'}' | b']' => depth = depth.checked_sub(1)?,
            _ => {}
        }
    }
    (!in_string).then_some(depth)
}

/// [`StreamState::render_progress`]: a line format writes progress, and
/// every inject mode but `none` injects it.
fn renders_progress(output: OutputFormat, inject: InjectMode) -> bool {
    output != OutputFormat::Sse || inject != InjectMode::None
}

/// [`StreamState::unread`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Unread {
    /// Something reads every chunk: a line format writes them, or the
    /// event log records them.
    Nothing,
    /// SSE output, whose frames of text are forwarded as they are, and no
    /// event log.
    Text,
    /// And no progress rendered (`--inject none`).
    TextAndProgress,
}

impl Unread {
    fn of(output: OutputFormat, inject: InjectMode, collect_events: bool) -> Unread {
        if output != OutputFormat::Sse || collect_events {
            Unread::Nothing
        } else if !renders_progress(output, inject) {
            Unread::TextAndProgress
        } else {
            Unread::Text
        }
    }
}

impl Annotator {
    pub fn new(config: AnnotatorConfig) -> Annotator {
        let format = match (config.output, config.session_id) {
            (OutputFormat::Messages, session_id) => LineFormat::Messages {
                session_id: session_id.unwrap_or_default(),
            },
            (OutputFormat::Sse | OutputFormat::Ndjson, _) => LineFormat::Chunks,
        };
        let mut annotator = Annotator {
            framer: Framer::Sniffing(Vec::new()),
            max_event_bytes: config.max_event_bytes,
            sent_ahead: 0,
            state: StreamState {
                output: config.output,
                inject: config.inject,
                max_event_bytes: config.max_event_bytes,
                decoder_state: DecoderState {
                    without_frame_head: config.inject != InjectMode::Chunk,
                    ..DecoderState::default()
                },
                // Only the NDJSON output lists the assembled calls; the
                // others need counts, not the arguments text.
                tracker: ToolCallTracker::new(config.output == OutputFormat::Ndjson),
                batch: ProgressBatch::default(),
                render_progress: renders_progress(config.output, config.inject),
                lines: LineEncoder::new(format),
                after: String::new(),
                deferred: String::new(),
                warnings: Vec::new(),
                undecodable: 0,
                no_chunk_said: false,
                ended: false,
                ended_warned: false,
                named_warned: false,
                refused_warned: false,
                ignored_warned: Vec::new(),
                done_written: false,
                frames: 0,
                input_bytes: 0,
                failed: false,
                probed_frames: 0,
                events: EventLog::default(),
                collect_events: config.collect_events,
                unread: Unread::of(config.output, config.inject, config.collect_events),
                spread: None,
                unspreading: false,
            },
        };
        if let Some(framing) = config.framing {
            annotator.start(framing);
        }
        annotator
    }

    /// Feeds input; complete frames are written to `out` at once.
    pub fn push(&mut self, input: &[u8], now: impl Into<Now>, out: &mut impl Sink) {
        let now = now.into();
        self.state.input_bytes += input.len() as u64;
        match &mut self.framer {
            Framer::Sniffing(seen) => {
                // The first piece nearly always tells the framing: it is
                // then framed where it lies.
                let window = |bytes: &[u8]| bytes.len().min(MAX_BLANK_START);
                if seen.is_empty()
                    && let Some(framing) = Framing::sniff(&input[..window(input)])
                {
                    self.start(framing);
                    self.feed(input, now, out);
                    return;
                }
                // What came before is a BOM and whitespace: unless it is
                // still too short to tell a BOM, the new piece's bytes
                // within the window decide (sniffing the whole again cost
                // the square of a long blank start).
                let before = seen.len();
                seen.extend_from_slice(input);
                let sniffed = match before < 3 {
                    true => Framing::sniff(&seen[..window(seen)]),
                    false => Framing::sniff_after_start(&seen[before..window(seen)]),
                };
                let framing = match sniffed {
                    Some(framing) => framing,
                    None if seen.len() > MAX_BLANK_START => {
                        self.state.warnings.push(Warning::BlankStart {
                            bytes: MAX_BLANK_START,
                        });
                        Framing::Sse
                    }
                    None => return,
                };
                let seen = std::mem::take(seen);
                self.start(framing);
                self.feed(&seen, now, out);
            }
            Framer::Sse(_) | Framer::Ndjson(_) => self.feed(input, now, out),
        }
    }

    /// Ends the input: writes what is left, and the `done` line(s) if no
    /// frame said the stream was over.
    /// The input failed (a read error): [`finish`](Self::finish) then
    /// writes what it holds but no done line(s), which would tell a
    /// consumer of the lines that the stream ended well.
    pub fn input_failed(&mut self) {
        self.state.done_written = true;
        self.state.failed = true;
    }

    pub fn finish(&mut self, now: impl Into<Now>, out: &mut impl Sink) {
        let now = now.into();
        if let Framer::Sniffing(seen) = &mut self.framer {
            // Only whitespace (or nothing) came: forward it as SSE.
            let seen = std::mem::take(seen);
            self.start(Framing::Sse);
            self.feed(&seen, now, out);
        }
        match &mut self.framer {
            Framer::Sse(d) => d.finish(),
            Framer::Ndjson(d) => d.finish(),
            Framer::Sniffing(_) => {}
        }
        self.feed(&[], now, out);
        let state = &mut self.state;
        // A value still spread at the end never came whole: its lines,
        // one by one.
        state.unspread(now, out);
        if !state.deferred.is_empty() {
            state.line_end_tail(b"", out);
        }
        // The end of the input clears what was in progress: subscribers
        // are told, as of any other clear (a stream cut by its upstream,
        // or one that just stops, has no `[DONE]` to say it).
        if state.collect_events {
            state.events.end_carries(|_, _| true);
        }
        if let Applied::Cleared = state.tracker.end_of_input(!state.ended)
            && state.collect_events
        {
            state
                .events
                .events
                .push(StreamEvent::Cleared(ClearReason::StreamEnd));
        }
        state.write_done(out);
        // Bytes, but no event or line at all, nor one too large or
        // unreadable, nor one cut by the end, nor a failed input (each
        // said already): not a stream of chunks (an HTML error page, a
        // capture of another API), which would otherwise pass without a
        // word.
        if state.frames == 0
            && !state.failed
            && state.undecodable == 0
            && state.input_bytes > 0
            && !state
                .warnings
                .iter()
                .any(|w| matches!(w, Warning::Unterminated { .. }))
        {
            state.warnings.push(Warning::NoFrames {
                bytes: state.input_bytes,
                lines: state.output != OutputFormat::Sse,
            });
        }
        if state.undecodable > MAX_REPORTED {
            state.warnings.push(Warning::Suppressed {
                count: state.undecodable - MAX_REPORTED,
            });
        }
    }

    /// Takes the increments collected since the last call (empty unless
    /// [`AnnotatorConfig::collect_events`]).
    pub fn take_events(&mut self) -> Vec<StreamEvent> {
        self.state.events.has_texts = false;
        self.state.events.missed = false;
        std::mem::take(&mut self.state.events.events)
    }

    /// Turns collecting the increments on or off from the next input on
    /// ([`AnnotatorConfig::collect_events`]). The proxy collects only
    /// while someone listens to the stream's session: a frame nobody
    /// reads the chunks of then goes the quick way (`StreamState::pass`),
    /// as in `annotate`. The output and the tracker are the same either way.
    #[inline]
    pub fn collect_events(&mut self, on: bool) {
        let state = &mut self.state;
        if !on {
            // The next text collected may not follow the last one.
            state.events.carries.clear();
        }
        state.collect_events = on;
        if state.spread.is_none() {
            state.unread = Unread::of(state.output, state.inject, on);
        }
    }

    /// Some input since the increments were last taken or emptied was
    /// handled while collecting was off: they do not tell all that changed.
    #[inline]
    pub fn events_missed(&self) -> bool {
        self.state.events.missed
    }

    /// Whether warnings were collected since they were last taken: a
    /// look, where taking them builds and drops a list (the proxy asks
    /// after every read).
    #[inline]
    pub fn has_warnings(&self) -> bool {
        !self.state.warnings.is_empty()
    }

    /// Takes the warnings collected since the last call.
    pub fn take_warnings(&mut self) -> Vec<Warning> {
        std::mem::take(&mut self.state.warnings)
    }

    /// Frames (SSE events with data, NDJSON lines) handled so far.
    pub fn frames(&self) -> u64 {
        self.state.frames
    }

    /// Of [`frames`](Self::frames), those the framer found by asking the
    /// decoder whether a line starts with a payload of the shape it
    /// learned ([`Probe`]), without a search for the line's end.
    pub fn probed_frames(&self) -> u64 {
        self.state.probed_frames
    }

    /// The stream's progress state.
    pub fn tracker(&self) -> &ToolCallTracker {
        &self.state.tracker
    }

    /// Whether, at the end of the input, some answer of the stream may stop
    /// in the middle: the input failed, or by the rule of the done lines'
    /// `incomplete` ([`ToolCallTracker::any_cut_short`]).
    pub fn incomplete(&self) -> bool {
        self.state.failed || self.state.tracker.any_cut_short(!self.state.ended)
    }

    /// The same, to change: its record of ended calls
    /// ([`ToolCallTracker::keep_ended`]).
    pub fn tracker_mut(&mut self) -> &mut ToolCallTracker {
        &mut self.state.tracker
    }

    /// The tracker, with the increments collected since they were last
    /// emptied ([`clear_events`](Self::clear_events)), in place (the proxy
    /// publishes them on every write to its client, and takes the calls
    /// that ended from the tracker).
    pub fn collected(&mut self) -> (&mut ToolCallTracker, &[StreamEvent]) {
        (&mut self.state.tracker, &self.state.events.events)
    }

    /// Empties the collected increments (they were published), keeping
    /// what they were made of for the next ones: neither the list nor a
    /// text delta's string is allocated again in steady state.
    #[inline]
    pub fn clear_events(&mut self) {
        self.state.events.missed = false;
        if !self.state.events.events.is_empty() {
            self.state.events.clear();
        }
    }

    /// Drops the progress increments collected so far, keeping the rest
    /// (text, `done`, clears): their calls were cleared before they could
    /// be published (`serve`'s `tool-execute`, taken between two reads of
    /// one publish).
    pub fn drop_progress_events(&mut self) {
        self.state
            .events
            .events
            .retain(|e| !matches!(e, StreamEvent::Progress(_)));
    }

    fn start(&mut self, framing: Framing) {
        let state = &mut self.state;
        self.framer = match framing {
            Framing::Sse => Framer::Sse(SseDecoder::with_max_event_bytes(self.max_event_bytes)),
            Framing::Ndjson => {
                let mode = match state.inject {
                    InjectMode::Comment => Some("comment"),
                    InjectMode::Event => Some("event"),
                    InjectMode::Chunk => Some("chunk"),
                    InjectMode::Field | InjectMode::None => None,
                };
                if let (Some(mode), OutputFormat::Sse) = (mode, state.output) {
                    state
                        .warnings
                        .push(Warning::InjectModeNotForNdjson { mode });
                    state.inject = InjectMode::Field;
                    state.unread = Unread::of(state.output, state.inject, state.collect_events);
                }
                Framer::Ndjson(NdjsonDecoder::with_max_line_bytes(self.max_event_bytes))
            }
        };
    }

    fn feed(&mut self, input: &[u8], now: Now, out: &mut impl Sink) {
        self.state.events.missed |= !self.state.collect_events;
        let provider = match self.framer {
            Framer::Ndjson(_) => Provider::OllamaChat,
            Framer::Sse(_) | Framer::Sniffing(_) => Provider::OpenAiChat,
        };
        // Only `field` writes inside an event: with SSE output in any other
        // mode, the bytes of an event cut by the end of a piece go out at
        // once, and the event is parsed once it is whole.
        let ahead =
            self.state.output == OutputFormat::Sse && self.state.inject != InjectMode::Field;
        let mut out = SentAhead {
            out,
            skip: &mut self.sent_ahead,
        };
        let mut frames = FrameHandler {
            state: &mut self.state,
            provider,
            now,
            out: &mut out,
        };
        match &mut self.framer {
            Framer::Sse(decoder) => decoder.feed_probing(input, &mut frames),
            Framer::Ndjson(decoder) => decoder.feed_probing(input, &mut frames),
            Framer::Sniffing(_) => {}
        }
        if !ahead {
            return;
        }
        let pending = match &self.framer {
            Framer::Sse(decoder) => decoder.pending(),
            Framer::Ndjson(decoder) => decoder.pending(),
            Framer::Sniffing(_) => &[],
        };
        if let Some(new) = pending.get(*out.skip..)
            && !new.is_empty()
        {
            out.out.forward(new);
            *out.skip = pending.len();
        }
    }
}

/// The sink of a stream whose cut frames go out ahead: the first `skip`
/// bytes forwarded are dropped, having been forwarded when they came. The
/// blocks a framer hands out cover its input in order, each once, so they
/// are the bytes of the frame that was cut, which comes first.
struct SentAhead<'a, O> {
    out: &'a mut O,
    skip: &'a mut usize,
}

impl<O: Sink> Sink for SentAhead<'_, O> {
    #[inline(always)]
    fn forward(&mut self, bytes: &[u8]) {
        if *self.skip == 0 {
            return self.out.forward(bytes);
        }
        let dropped = (*self.skip).min(bytes.len());
        *self.skip -= dropped;
        if let Some(rest) = bytes.get(dropped..)
            && !rest.is_empty()
        {
            self.out.forward(rest);
        }
    }

    #[inline(always)]
    fn insert(&mut self, bytes: &[u8]) {
        self.out.insert(bytes);
    }
}

/// Where the framer hands the frames of a piece: to the stream's state,
/// whose decoder (the framing's provider's) it asks first whether a line
/// starts with a payload of the shape it learned ([`Probe`]).
struct FrameHandler<'a, O> {
    state: &'a mut StreamState,
    provider: Provider,
    now: Now,
    out: &'a mut O,
}

impl<O> Probe for FrameHandler<'_, O> {
    fn payload_len(&mut self, text: &str) -> Option<usize> {
        self.state.decoder_state.match_prefix(self.provider, text)
    }

    fn pass(&mut self, text: &str) -> bool {
        self.state.pass(self.provider, text, self.now)
    }
}

impl<O: Sink> window::Frames<SseScan> for FrameHandler<'_, O> {
    fn frame(&mut self, block: SseBlock<'_>) {
        self.state.sse_block(block, self.now, self.out);
    }
}

impl<O: Sink> window::Frames<NdjsonScan> for FrameHandler<'_, O> {
    /// Inlined, with `ndjson_line`, into the framing loop.
    #[inline(always)]
    fn frame(&mut self, line: NdjsonLine<'_>) {
        self.state.ndjson_line(line, self.now, self.out);
    }
}

impl StreamState {
    /// One SSE block: an event is handled, anything else forwarded.
    fn sse_block(&mut self, block: SseBlock<'_>, now: Now, out: &mut impl Sink) {
        match block.kind {
            SseBlockKind::Event(event) => {
                // Only default-type events are chunks; named events (ours,
                // or a provider's) are forwarded.
                let is_chunk = matches!(event.event_type, b"" | b"message");
                // A provider's `event: error` is a failure, as a chunk
                // `{"error": …}` is: what was in progress is cleared, and
                // the line formats' done line(s) say the answer may be cut.
                if event.event_type == b"error" && !self.ended {
                    let error = Chunk::Error {
                        raw: "",
                        message: String::new(),
                    };
                    let applied = self.tracker.apply(&error, now);
                    if self.collect_events {
                        self.events.record(&error, &applied);
                        self.events.named_error(event.data);
                    }
                    self.warnings.push(Warning::Upstream {
                        at: Location {
                            unit: "SSE event",
                            number: event.number,
                            offset: block.offset,
                        },
                        message: excerpt(event.data, EXCERPT_CHARS * 2),
                    });
                }
                // The line formats carry no event as it is: a provider's
                // named event (an `event: error`, say) goes out as an
                // `unparsed` line, said once, rather than nowhere. Ours,
                // from a stream annotated before, is progress the lines
                // give afresh.
                if !is_chunk
                    && self.output != OutputFormat::Sse
                    && event.event_type != b"toolCallProgress"
                {
                    let at = Location {
                        unit: "SSE event",
                        number: event.number,
                        offset: block.offset,
                    };
                    if self.ended {
                        // After the done line(s), as any data.
                        self.warn_after_end(at);
                    } else {
                        self.lines.unparsed_between(out, event.data);
                        // Said once a stream: a provider's keep-alive
                        // events would drown the rest. An `event: error`
                        // is said as the upstream's error (above).
                        if event.event_type != b"error"
                            && !std::mem::replace(&mut self.named_warned, true)
                        {
                            self.warnings.push(Warning::NamedEvent {
                                at,
                                name: excerpt(event.event_type, EXCERPT_CHARS),
                                excerpt: excerpt(event.data, EXCERPT_CHARS),
                            });
                        }
                    }
                }
                let frame = RawFrame {
                    raw: block.raw,
                    data: is_chunk.then_some(event.data),
                    text: event.text,
                    closing_brace: event.closing_brace,
                    // An open line ending renders as `\n` now and is fixed
                    // up at its tail.
                    line_ending: if event.line_ending_open {
                        b"\n"
                    } else {
                        event.line_ending.as_bytes()
                    },
                    line_ending_open: event.line_ending_open,
                    probed: event.probed,
                    may_spread: false,
                    at: Location {
                        unit: "SSE event",
                        number: event.number,
                        offset: block.offset,
                    },
                };
                self.handle(Provider::OpenAiChat, &frame, now, out);
            }
            SseBlockKind::Passed { events } => self.passed(events, block.raw, out),
            SseBlockKind::NoData => self.forward(block.raw, out),
            SseBlockKind::LineEndTail => self.line_end_tail(block.raw, out),
            SseBlockKind::Oversized { number, first, .. } => {
                let at = Location {
                    unit: "SSE event",
                    number,
                    offset: block.offset,
                };
                self.oversized(at, first, block.raw, out);
            }
            SseBlockKind::Unterminated { has_data, number } => {
                if has_data {
                    self.warnings.push(Warning::Unterminated {
                        number,
                        offset: block.offset,
                        lines: self.output != OutputFormat::Sse,
                    });
                }
                self.forward(block.raw, out);
            }
        }
    }

    /// One NDJSON line (or a piece of an oversized one, or a run of lines
    /// [`pass`](Self::pass) took). Inlined into the framing loop, as it
    /// was before a [`Spread`] made it a little larger: out of line, a
    /// stream of NDJSON lines took 3.5 % more instructions (callgrind, the
    /// Ollama capture, `--format ndjson`).
    #[inline(always)]
    fn ndjson_line(&mut self, line: NdjsonLine<'_>, now: Now, out: &mut impl Sink) {
        if line.passed > 0 {
            self.passed(line.passed, line.raw, out);
            return;
        }
        if let Some(piece) = line.oversized {
            self.unspread(now, out);
            let at = Location {
                unit: "NDJSON line",
                number: line.number,
                offset: line.offset,
            };
            self.oversized(at, piece.first, line.raw, out);
            return;
        }
        let mut probed = line.probed;
        if self.spread.is_some() {
            let at = Location {
                unit: "NDJSON line",
                number: line.number,
                offset: line.offset,
            };
            if self.spread_line(line.raw, line.content, at, now, out) {
                return;
            }
            // The spread's lines were decoded since the framer's probe
            // found this one: the decoder's holes are theirs now.
            probed = false;
        }
        let frame = RawFrame {
            raw: line.raw,
            data: (!line.is_blank()).then_some(line.content),
            text: line.text,
            // Only field injection writes before the brace: other modes
            // need not look for it.
            closing_brace: match self.inject {
                InjectMode::Field => line.closing_brace(),
                InjectMode::None | InjectMode::Comment | InjectMode::Event | InjectMode::Chunk => {
                    None
                }
            },
            line_ending: b"\n",
            line_ending_open: false,
            probed,
            may_spread: true,
            at: Location {
                unit: "NDJSON line",
                number: line.number,
                offset: line.offset,
            },
        };
        self.handle(Provider::OllamaChat, &frame, now, out);
    }

    /// A line while a [`Spread`] is gathered: it joins it, and the value
    /// is handled once whole; or it cannot continue it, which is then
    /// handled line by line, and this line is left to the caller (false).
    /// Out of line and cold: kept out of `ndjson_line`, which is inlined
    /// into the framing loop (inlined, it was not, and a stream of NDJSON
    /// lines took 4 % more instructions).
    #[cold]
    #[inline(never)]
    fn spread_line(
        &mut self,
        raw: &[u8],
        content: &[u8],
        at: Location,
        now: Now,
        out: &mut impl Sink,
    ) -> bool {
        let Some(spread) = self.spread.as_mut() else {
            return false;
        };
        // The brackets the value leaves open after this line, found by one
        // pass over it: none when it cannot continue the value (a string
        // open at its end), or when it is a whole value of its own (a line
        // cut after `:`, `[` or `,` would otherwise take in the good lines
        // after it). Bounded in bytes and lines.
        let depth = match is_a_whole_value(content) {
            true => None,
            false => depth_after(spread.depth, content),
        };
        let fits = spread.text.len() + 1 + content.len()
            <= MAX_SPREAD_BYTES.min(self.max_event_bytes)
            && spread.lines.len() < MAX_SPREAD_LINES;
        let Some(depth) = depth.filter(|_| fits) else {
            self.unspread(now, out);
            return false;
        };
        let start = spread.text.len() + 1;
        spread.text.push(b'\n');
        spread.text.extend_from_slice(content);
        spread.depth = depth;
        // Parsed once, when its brackets close: not again at every line.
        let whole = depth == 0;
        spread.lines.push((start, at));
        let parsed = whole && serde_json::from_slice::<serde::de::IgnoredAny>(&spread.text).is_ok();
        self.forward(raw, out);
        if !whole {
            return true;
        }
        if !parsed {
            // Closed, and no JSON value: each line as it would have been.
            self.unspread(now, out);
            return true;
        }
        if let Some(spread) = self.spread.take() {
            self.unread = Unread::of(self.output, self.inject, self.collect_events);
            let Spread { text, lines, .. } = *spread;
            let at = lines.first().map_or(at, |(_, first)| *first);
            // Counted as one frame: its first line was.
            self.frames -= 1;
            self.handle_spread_part(Some(&text), at, now, out);
        }
        true
    }

    /// Handles what a [`Spread`] gathered, whole or a line of it: its bytes
    /// were forwarded as they came, and it is decoded without the probe.
    fn handle_spread_part(
        &mut self,
        data: Option<&[u8]>,
        at: Location,
        now: Now,
        out: &mut impl Sink,
    ) {
        let frame = RawFrame {
            raw: b"",
            data,
            text: None,
            closing_brace: None,
            line_ending: b"\n",
            line_ending_open: false,
            probed: false,
            may_spread: false,
            at,
        };
        self.handle(Provider::OllamaChat, &frame, now, out);
    }

    /// Ends a [`Spread`] that could not be read whole, if one is gathered:
    /// its lines are handled one by one, as without it (their bytes went
    /// out already).
    #[inline]
    fn unspread(&mut self, now: Now, out: &mut impl Sink) {
        if self.spread.is_some() {
            self.unspread_now(now, out);
        }
    }

    /// [`unspread`](Self::unspread) with a spread gathered.
    #[cold]
    #[inline(never)]
    fn unspread_now(&mut self, now: Now, out: &mut impl Sink) {
        let Some(spread) = self.spread.take() else {
            return;
        };
        self.unread = Unread::of(self.output, self.inject, self.collect_events);
        self.unspreading = true;
        let Spread { text, lines, .. } = *spread;
        for (i, &(start, at)) in lines.iter().enumerate() {
            let end = lines.get(i + 1).map_or(text.len(), |&(next, _)| next - 1);
            let data = text.get(start..end).unwrap_or_default();
            // The first was counted when it came; the others joined it.
            if i == 0 {
                self.frames -= 1;
            }
            let data = (!data.iter().all(u8::is_ascii_whitespace)).then_some(data);
            self.handle_spread_part(data, at, now, out);
        }
        self.unspreading = false;
    }

    /// A run of `count` frames that [`pass`](Self::pass) took as the
    /// framer recognized them, and applied to the tracker: counted and
    /// forwarded. (`batch` is `handle`'s, cleared as each frame there
    /// starts: nothing here reads or leaves it.)
    fn passed(&mut self, count: u64, raw: &[u8], out: &mut impl Sink) {
        self.frames += count;
        self.probed_frames += count;
        out.forward(raw);
    }

    /// Forwards bytes that carry no chunk (comments, blank lines).
    fn forward(&mut self, raw: &[u8], out: &mut impl Sink) {
        if self.output == OutputFormat::Sse {
            out.forward(raw);
        }
    }

    /// A piece of a frame too large to parse: forwarded, reported once.
    fn oversized(&mut self, at: Location, first: bool, raw: &[u8], out: &mut impl Sink) {
        if first {
            // Not read, so it may have held a piece of any answer, or not
            // (a comment, a named event): the done lines cannot tell.
            self.tracker.frame_unread();
            // Counted with the undecodable frames: past the first few, a
            // count at the end says how many more (a small
            // --max-event-bytes made one warning an event).
            self.undecodable += 1;
            if self.undecodable <= MAX_REPORTED {
                self.warnings.push(Warning::Oversized {
                    at,
                    max_bytes: self.max_event_bytes,
                    lines: self.output != OutputFormat::Sse,
                });
            }
        }
        self.forward(raw, out);
    }

    /// The byte after an event whose line ending was open: forward it, then
    /// what was waiting to go after that event, with the line ending now
    /// known (`\n` completed a CRLF; anything else left a lone CR).
    fn line_end_tail(&mut self, raw: &[u8], out: &mut impl Sink) {
        self.forward(raw, out);
        if self.deferred.is_empty() {
            return;
        }
        let ending = if raw == b"\n" { "\r\n" } else { "\r" };
        let text = self.deferred.replace('\n', ending);
        out.insert(text.as_bytes());
        self.deferred.clear();
    }

    /// Decodes one frame, updates the tracker and writes the output.
    fn handle(&mut self, provider: Provider, frame: &RawFrame<'_>, now: Now, out: &mut impl Sink) {
        self.batch.clear();
        self.frames += 1;
        self.probed_frames += u64::from(frame.probed);
        // For this frame only: a frame left undecoded leaves it set, and
        // the next frame's sets it again.
        self.decoder_state.probed = frame.probed;
        let data = match frame.data {
            // The line formats end with their done line(s): what comes
            // after is left out of them (and said so).
            Some(_) if self.ended => {
                self.warn_after_end(frame.at);
                None
            }
            data => data,
        };
        let decoded = match data {
            Some(data) => self.decode(provider, data, frame.text, frame.at, now, out),
            None => Ok(FrameInfo::default()),
        };
        let info = match decoded {
            Ok(info) => Some(info),
            // The start of a value spread over lines: held until it is
            // whole, or cannot be ([`Spread`]).
            Err(_)
                if let Some(depth) = (frame.may_spread && !self.unspreading)
                    .then(|| spread_depth(data))
                    .flatten() =>
            {
                self.spread = Some(Box::new(Spread {
                    text: data.unwrap_or_default().to_vec(),
                    lines: vec![(0, frame.at)],
                    depth,
                }));
                self.unread = Unread::Nothing;
                None
            }
            Err(source) => {
                if self.output != OutputFormat::Sse {
                    self.lines.unparsed(out, data.unwrap_or_default());
                }
                // A frame that may have been a chunk, unread: the answers
                // may lack what it held. One that is none (another API's
                // object, as each line of Ollama's `/api/pull` is) held
                // nothing of them, and is said once a stream.
                let said = if source.may_be_a_chunk() {
                    self.tracker.frame_unread();
                    self.undecodable += 1;
                    self.undecodable > MAX_REPORTED
                } else {
                    std::mem::replace(&mut self.no_chunk_said, true)
                };
                if !said {
                    self.warnings.push(Warning::Undecodable {
                        at: frame.at,
                        source,
                        excerpt: excerpt(data.unwrap_or_default(), EXCERPT_CHARS),
                        lines: self.output != OutputFormat::Sse,
                    });
                }
                None
            }
        };
        if self.output == OutputFormat::Sse {
            let encoded = Frame {
                raw: frame.raw,
                closing_brace: frame.closing_brace,
                line_ending: frame.line_ending,
                info: info.as_ref(),
            };
            inject::write_frame(out, &encoded, self.inject, &self.batch, &mut self.after);
            if frame.line_ending_open {
                self.deferred.push_str(&self.after);
            } else if !self.after.is_empty() {
                out.insert(self.after.as_bytes());
            }
        }
    }

    /// The frame the decoder just recognized at the start of `text`, when
    /// nothing but the tracker reads its chunks ([`unread`](Self::unread)):
    /// applies it as [`handle`](Self::handle) would, without decoding it
    /// into chunks, and says so; the frame then only has to be forwarded,
    /// as [`inject::write_frame`] forwards a frame without progress. Two
    /// kinds of frame are taken:
    ///
    /// - text and nothing else ([`ProbedText`](providers::ProbedText)),
    ///   whose chunks change only the phase (reasoning first, as the
    ///   decoder emits them). Nearly every frame of a chat is one;
    /// - one tool call's arguments and nothing else (the decoder's
    ///   steady shape), when no progress is rendered either
    ///   (`--inject none`): its one delta goes to the tracker. Nearly
    ///   every frame of a tool call is one.
    ///
    /// The framer asks this of every frame it recognizes
    /// ([`Probe::pass`]) and hands the frames taken out as runs
    /// ([`passed`](Self::passed)); a frame not taken comes to `handle`
    /// (BENCHMARKS.md, forty-seventh and forty-eighth rounds). A no
    /// changes nothing.
    #[inline]
    fn pass(&mut self, provider: Provider, text: &str, now: Now) -> bool {
        if self.unread == Unread::Nothing || self.ended {
            return false;
        }
        if let Some(probed) = self.decoder_state.probed_text(provider) {
            if probed.reasoning {
                self.tracker.text(StreamPhase::Reasoning);
            }
            if probed.content {
                self.tracker.text(StreamPhase::Answering);
            }
            return true;
        }
        self.unread == Unread::TextAndProgress && self.pass_call(provider, text, now)
    }

    /// [`pass`](Self::pass) for a frame of one tool call's arguments. Out
    /// of line, so that `pass` stays small enough to be inlined into the
    /// framing loop of a stream of text (with the tracker's code inlined
    /// in it, `pass` was a call, and the Ollama and text-heavy captures
    /// took 5 % more instructions: BENCHMARKS.md, forty-eighth round).
    #[inline(never)]
    fn pass_call(&mut self, provider: Provider, text: &str, now: Now) -> bool {
        let Some(delta) = self.decoder_state.probed_call(provider, text) else {
            return false;
        };
        // The first delta refused past the tracker's limits is decoded in
        // full, where its warning gets its frame's place (here it had none:
        // the warning came with a later frame, or never).
        if !self.refused_warned && self.tracker.past_the_limits(&delta) {
            return false;
        }
        self.tracker.apply(&Chunk::ToolCallDelta(delta), now);
        true
    }

    /// Reports, once, that frames came after the end of the stream.
    fn warn_after_end(&mut self, at: Location) {
        if !std::mem::replace(&mut self.ended_warned, true) {
            self.warnings.push(Warning::AfterEnd {
                at,
                lines: self.output != OutputFormat::Sse,
            });
        }
    }

    /// Applies one frame's chunks; with a line format, writes their lines.
    /// The provider decoder parses the whole frame before it emits a chunk,
    /// so a frame that fails changes nothing.
    fn decode<'d>(
        &mut self,
        provider: Provider,
        data: &'d [u8],
        text: Option<&'d str>,
        at: Location,
        now: Now,
        out: &mut impl Sink,
    ) -> Result<FrameInfo<'d>, FrameError> {
        let lines_out = self.output != OutputFormat::Sse;
        let render = self.render_progress;
        let mut upstream_error = None;
        let mut done = false;
        // A field was passed over for its shape (`Chunk::Ignored`); a line
        // was written for the frame.
        let mut ignored = false;
        let mut wrote = false;
        let tracker = &mut self.tracker;
        let batch = &mut self.batch;
        let lines = &mut self.lines;
        let mut events = self.collect_events.then_some(&mut self.events);
        let ignored_warned = &mut self.ignored_warned;
        let warnings = &mut self.warnings;
        let mut each = |chunk: Chunk<'d>| {
            match &chunk {
                Chunk::Text { choice, text } if lines_out => {
                    wrote = true;
                    lines.text(out, TextField::Content, *choice, text)
                }
                Chunk::Reasoning { choice, text } if lines_out => {
                    wrote = true;
                    lines.text(out, TextField::Reasoning, *choice, text)
                }
                Chunk::Error { raw, message } => {
                    if lines_out {
                        wrote = true;
                        lines.error(out, raw);
                    }
                    upstream_error = Some(excerpt(message.as_bytes(), EXCERPT_CHARS * 2));
                }
                Chunk::Done => done = true,
                Chunk::Ignored { field, raw } => {
                    ignored = true;
                    warn_ignored(ignored_warned, warnings, at, field, raw, lines_out)
                }
                Chunk::Text { .. }
                | Chunk::Reasoning { .. }
                | Chunk::ToolCallDelta(_)
                | Chunk::Finish { .. }
                | Chunk::Usage(_) => {}
            }
            let applied = tracker.apply(&chunk, now);
            if let Some(events) = events.as_deref_mut() {
                events.record(&chunk, &applied);
            }
            match applied {
                Applied::Progress(p) if render => {
                    batch.push(&p);
                    if lines_out && let Some(json) = batch.last() {
                        wrote = true;
                        lines.progress(out, p.choice, json);
                    }
                }
                Applied::Progress(_) | Applied::Cleared | Applied::Unchanged => {}
            }
        };
        let info = match text {
            Some(text) => {
                providers::decode_text(provider, text, &mut self.decoder_state, &mut each)
            }
            None => providers::decode(provider, data, &mut self.decoder_state, &mut each),
        }?;
        // A frame whose only content was passed over would leave no line:
        // the line formats carry it whole, as one they could not read
        // (nothing is lost). One with lines of its own is not repeated
        // (an `unparsed` line is a frame no line told of).
        if ignored && lines_out && !wrote {
            self.lines.unparsed(out, data);
        }
        if let Some(message) = upstream_error {
            self.warnings.push(Warning::Upstream { at, message });
        }
        if self.tracker.refused_calls() > 0 && !std::mem::replace(&mut self.refused_warned, true) {
            self.warnings.push(Warning::TooManyCalls {
                at,
                max_calls: crate::progress::MAX_CALLS,
            });
        }
        if done {
            // `Done` is the last chunk of its frame (`[DONE]`, Ollama's
            // `done: true` line), so the done line(s) come right after it.
            self.ended = true;
            self.write_done(out);
        }
        Ok(info)
    }

    /// Writes the `done` line(s) of a line format, once per stream.
    fn write_done(&mut self, out: &mut impl Sink) {
        if std::mem::replace(&mut self.done_written, true) {
            return;
        }
        match self.output {
            OutputFormat::Sse => {}
            OutputFormat::Ndjson | OutputFormat::Messages => {
                // A stream that ended without its end marker, whether or
                // not it had frames: an empty body is no whole answer.
                let stopped_early = !self.ended;
                self.lines.done(out, &self.tracker, stopped_early);
            }
        }
    }
}

/// An `event: error`'s data as the value of an `error` frame of the events
/// routes: the data itself when it is JSON (on one line), else the data
/// as a JSON string. Never empty, so the frame is always JSON.
fn error_frame_value(data: &[u8]) -> String {
    match serde_json::from_slice::<&serde_json::value::RawValue>(data) {
        Ok(value) => crate::js::one_line(value.get()).collect(),
        Err(_) => {
            let mut out = String::new();
            crate::js::push_string(&String::from_utf8_lossy(data), &mut out);
            out
        }
    }
}

/// Reports a field passed over for its shape ([`Chunk::Ignored`]), once
/// a stream for each field. Out of line: the decoder's loop over a
/// frame's chunks stays as small as it was without it.
#[cold]
#[inline(never)]
fn warn_ignored(
    warned: &mut Vec<&'static str>,
    warnings: &mut Vec<Warning>,
    at: Location,
    field: &'static str,
    raw: &str,
    lines: bool,
) {
    if !warned.contains(&field) {
        warned.push(field);
        warnings.push(Warning::Ignored {
            at,
            field,
            excerpt: excerpt(raw.as_bytes(), EXCERPT_CHARS),
            lines,
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn forwarding() -> Annotator {
        Annotator::new(AnnotatorConfig {
            inject: InjectMode::None,
            ..AnnotatorConfig::default()
        })
    }

    /// With SSE output, in every inject mode but `field` (which writes
    /// inside a frame), the bytes of a frame cut by the end of a piece go
    /// out at once, each once; the frame is handled once whole, and the
    /// output is what the whole input gives. NDJSON, whose other modes fall
    /// back to `field`, sends ahead under `none` alone; the line formats
    /// never do.
    #[test]
    fn a_cut_frame_goes_out_at_once_unless_field_injects() {
        let sse: &[u8] = b"data: {\"choices\":[{\"index\":0,\"delta\":{\"tool_calls\":[{\"index\":0,\"id\":\"c\",\"function\":{\"name\":\"f\",\"arguments\":\"{}\"}}]}}]}\n\ndata: [DONE]\n\n";
        let ndjson: &[u8] = b"{\"message\":{\"content\":\"hi\"},\"done\":false}\n{\"message\":{\"content\":\"\"},\"done\":true}\n";
        use InjectMode::{Chunk, Comment, Event, Field, None as Bare};
        let cases = [
            (sse, Framing::Sse, OutputFormat::Sse, Bare, true),
            (sse, Framing::Sse, OutputFormat::Sse, Comment, true),
            (sse, Framing::Sse, OutputFormat::Sse, Event, true),
            (sse, Framing::Sse, OutputFormat::Sse, Chunk, true),
            (sse, Framing::Sse, OutputFormat::Sse, Field, false),
            (sse, Framing::Sse, OutputFormat::Ndjson, Bare, false),
            (ndjson, Framing::Ndjson, OutputFormat::Sse, Bare, true),
            (ndjson, Framing::Ndjson, OutputFormat::Sse, Comment, false),
            (ndjson, Framing::Ndjson, OutputFormat::Sse, Field, false),
        ];
        for (input, framing, output, inject, ahead) in cases {
            let config = || AnnotatorConfig {
                output,
                inject,
                framing: Some(framing),
                ..AnnotatorConfig::default()
            };
            let mut whole = Vec::new();
            let mut annotator = Annotator::new(config());
            annotator.push(input, 0, &mut whole);
            annotator.finish(0, &mut whole);
            let case = format!("{framing:?} {output:?} {inject:?}");
            for cut in [5, 20, 40] {
                let mut annotator = Annotator::new(config());
                let mut out = Vec::new();
                annotator.push(&input[..cut], 0, &mut out);
                let want: &[u8] = if ahead { &input[..cut] } else { b"" };
                assert_eq!(out, want, "{case}, cut at {cut}");
                // In two more pieces, the first inside the same frame.
                annotator.push(&input[cut..cut + 3], 0, &mut out);
                annotator.push(&input[cut + 3..], 0, &mut out);
                annotator.finish(0, &mut out);
                assert_eq!(out, whole, "{case}, cut at {cut}");
            }
        }
    }

    /// A stream that starts blank is framed by its first other byte, a BOM
    /// split across pieces included, and forwarded whole.
    #[test]
    fn a_blank_start_waits_for_the_first_byte_that_tells() {
        let input = b"\xEF\xBB\xBF\n \r\n{\"message\":{\"content\":\"hi\"},\"done\":true}\n";
        let mut annotator = forwarding();
        let mut out = Vec::new();
        for piece in input.chunks(1) {
            annotator.push(piece, 0, &mut out);
        }
        assert!(matches!(annotator.framer, Framer::Ndjson(_)));
        annotator.finish(0, &mut out);
        assert_eq!(out, input);
    }

    /// A BOM after the start is no BOM, wherever the reads fall: framed
    /// alike in one read and cut after the blank lines (cut, it was taken
    /// for NDJSON, whole for SSE).
    #[test]
    fn a_bom_after_the_start_is_framed_alike_however_it_is_cut() {
        let input = b"\n\n\n\xEF\xBB\xBF{\"message\":{\"content\":\"a\"}}\n";
        for cut in [input.len(), 1, 3, 4] {
            let mut annotator = forwarding();
            let mut out = Vec::new();
            annotator.push(&input[..cut], 0, &mut out);
            annotator.push(&input[cut..], 0, &mut out);
            assert!(matches!(annotator.framer, Framer::Sse(_)), "cut at {cut}");
            annotator.finish(0, &mut out);
            assert_eq!(out, input, "cut at {cut}");
        }
    }

    /// Past `MAX_BLANK_START` bytes of whitespace the stream is framed as
    /// SSE: nothing more is held (the whole input was, and sniffed again
    /// at each piece: 200 MB of newlines took 17 s and 485 MB).
    #[test]
    fn a_long_blank_start_is_not_held() {
        let mut annotator = forwarding();
        let mut out = Vec::new();
        let blank = [b'\n'; 1000];
        let mut sent = 0;
        while matches!(annotator.framer, Framer::Sniffing(_)) {
            assert!(sent <= MAX_BLANK_START, "still sniffing after {sent} bytes");
            annotator.push(&blank, 0, &mut out);
            sent += blank.len();
        }
        assert!(matches!(annotator.framer, Framer::Sse(_)));
        let event = b"data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"hi\"}}]}\n\n";
        annotator.push(event, 0, &mut out);
        annotator.finish(0, &mut out);
        assert_eq!(out.len(), sent + event.len());
        assert!(out.ends_with(event));
        assert_eq!(annotator.frames(), 1);
    }

    /// The warning of the first call past the tracker's limit names that
    /// call's event with `--inject none` as with `field`, where frames of
    /// one call's arguments take the quick path (it came with the next
    /// frame decoded in full, `[DONE]`, or never).
    #[test]
    fn the_first_refused_call_is_warned_at_its_event() {
        let mut input = String::new();
        for n in 0..crate::progress::MAX_CALLS + 76 {
            input.push_str(&format!(
                "data: {{\"choices\":[{{\"index\":0,\"delta\":{{\"tool_calls\":[{{\"index\":{n},\"function\":{{\"arguments\":\"x\"}}}}]}}}}]}}\n\n"
            ));
        }
        for done in ["", "data: [DONE]\n\n"] {
            let input = format!("{input}{done}");
            let warnings = |inject: InjectMode| {
                let mut annotator = Annotator::new(AnnotatorConfig {
                    inject,
                    ..AnnotatorConfig::default()
                });
                let mut out = Vec::new();
                annotator.push(input.as_bytes(), 0, &mut out);
                annotator.finish(0, &mut out);
                let warnings: Vec<String> = annotator
                    .take_warnings()
                    .iter()
                    .map(|w| w.to_string())
                    .collect();
                warnings
            };
            let field = warnings(InjectMode::Field);
            assert_eq!(field.len(), 1, "{field:?}");
            assert!(field[0].starts_with("SSE event 1025 (byte "), "{field:?}");
            assert_eq!(
                warnings(InjectMode::None),
                field,
                "[DONE]: {}",
                !done.is_empty()
            );
        }
    }

    /// A body of bytes with no event is said so once, unless its input
    /// failed (an upstream that dropped the connection while it sent only
    /// comments, as OpenRouter does while a model is queued: its failure
    /// is what `serve` says).
    #[test]
    fn a_body_without_events_is_said_so_unless_it_failed() {
        for failed in [false, true] {
            let mut annotator = Annotator::new(AnnotatorConfig::default());
            let mut out = Vec::new();
            annotator.push(b": OPENROUTER PROCESSING\n\n", 0, &mut out);
            if failed {
                annotator.input_failed();
            }
            annotator.finish(0, &mut out);
            assert_eq!(out, b": OPENROUTER PROCESSING\n\n");
            let said = annotator
                .take_warnings()
                .iter()
                .any(|w| matches!(w, Warning::NoFrames { bytes: 25, .. }));
            assert_eq!(said, !failed, "failed {failed}");
        }
    }

    /// Only the first `MAX_BLANK_START` bytes decide, whatever the cuts: a
    /// `{` within them makes the stream NDJSON, one past them SSE (with a
    /// warning), fed whole, in pieces of 1,000 bytes, or cut just before
    /// and after the bound. Before, pieces that added up to the bound
    /// before the `{` came made an NDJSON stream SSE: no progress at all.
    #[test]
    fn only_the_window_decides_the_framing() {
        let line = b"{\"message\":{\"content\":\"hi\"},\"done\":false}\n";
        for (blank, framing) in [
            (MAX_BLANK_START - 1, Framing::Ndjson),
            (MAX_BLANK_START, Framing::Sse),
            (MAX_BLANK_START + 15_000, Framing::Sse),
        ] {
            let mut input = vec![b'\n'; blank];
            input.extend_from_slice(line);
            input.extend_from_slice(line);
            let mut cuts: Vec<Vec<usize>> =
                vec![vec![], (1..input.len() / 1000).map(|k| k * 1000).collect()];
            for at in [MAX_BLANK_START - 1, MAX_BLANK_START, MAX_BLANK_START + 1] {
                if at < input.len() {
                    cuts.push(vec![at]);
                }
            }
            for cut in cuts {
                let mut annotator = forwarding();
                let mut out = Vec::new();
                let mut from = 0;
                for &at in cut.iter().chain([&input.len()]) {
                    annotator.push(&input[from..at], 0, &mut out);
                    from = at;
                }
                let framed = match annotator.framer {
                    Framer::Sse(_) => Framing::Sse,
                    Framer::Ndjson(_) => Framing::Ndjson,
                    Framer::Sniffing(_) => panic!("{blank}: still sniffing"),
                };
                annotator.finish(0, &mut out);
                let cuts = cut.len();
                assert_eq!(framed, framing, "{blank} blank bytes, {cuts} cuts");
                assert_eq!(out, input, "{blank} blank bytes, {cuts} cuts");
                let warnings: Vec<String> = annotator
                    .take_warnings()
                    .iter()
                    .map(|w| w.to_string())
                    .collect();
                match framing {
                    Framing::Ndjson => assert!(warnings.is_empty(), "{warnings:?}"),
                    // The NDJSON lines, read as SSE, are no events.
                    Framing::Sse => assert!(
                        warnings.len() == 2
                            && warnings[0].contains("first 65536 bytes")
                            && warnings[1].contains("held no SSE event"),
                        "{blank}, {cuts} cuts: {warnings:?}"
                    ),
                }
            }
        }
    }
}

#[cfg(test)]
mod event_tests {
    use super::*;

    /// The increments `serve`'s events route sends join a surrogate pair
    /// cut between two texts, as the line formats do; a half that the next
    /// text does not complete is a U+FFFD in its place. (They were two
    /// U+FFFD, the second one after the text that came between.)
    #[test]
    fn texts_join_a_surrogate_pair_cut_between_them() {
        let event = |delta: &str| {
            format!(r#"data: {{"choices":[{{"index":0,"delta":{delta}}}]}}"#) + "\n\n"
        };
        let input = [
            event(r#"{"reasoning_content":"think\ud83d"}"#),
            event(r#"{"content":"Hi \ud83d"}"#),
            event(r#"{"content":"\ude00!"}"#),
            event(r#"{"content":"\ud83d"}"#),
            // Another choice between the halves leaves them joined.
            r#"data: {"choices":[{"index":1,"delta":{"content":"x"}}]}"#.to_owned() + "\n\n",
            event(r#"{"content":"\ude00"}"#),
            event(r#"{"content":"\ud83d"}"#),
        ]
        .concat();
        let mut annotator = Annotator::new(AnnotatorConfig {
            collect_events: true,
            ..AnnotatorConfig::default()
        });
        let mut out = Vec::new();
        annotator.push(input.as_bytes(), 0, &mut out);
        annotator.finish(0, &mut out);
        let texts: Vec<String> = annotator
            .take_events()
            .into_iter()
            .filter_map(|event| match event {
                StreamEvent::Content { text, .. } => Some(format!("content {text}")),
                StreamEvent::Reasoning { text, .. } => Some(format!("reasoning {text}")),
                _ => None,
            })
            .collect();
        assert_eq!(
            texts,
            [
                "reasoning think",
                "reasoning \u{FFFD}",
                "content Hi ",
                "content \u{1F600}!",
                "content x",
                "content \u{1F600}",
                "content \u{FFFD}",
            ]
        );
    }
}
