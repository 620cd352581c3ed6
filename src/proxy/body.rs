//! [`TapBody`]: the response body wrapper through which every upstream
//! response reaches the client.
//!
//! It polls the upstream body only when the client's connection polls it,
//! so backpressure comes from the client for free and nothing is read ahead
//! (linkerd2-proxy `http/body-eos`). For a stream it pushes each data frame
//! through the same [`Annotator`] as `annotate` and yields what comes out;
//! for anything else it yields the frames untouched and only counts them.
//! Annotated output is coalesced: while the upstream has more frames ready,
//! they are gathered (up to 64 KiB) into one write; as soon as it has none,
//! what was gathered goes out, so no event waits for a later one.
//! Trailers pass through. It also:
//! - ends the stream when the upstream is silent longer than the idle
//!   timeout (an error, so the client sees a cut stream, not a fake end);
//! - on an upstream error, first yields the bytes it still held, then the
//!   error once the connection has written them to the client (100 ms
//!   later, or as long as the client's socket stays full, up to the idle
//!   timeout): nothing is lost, and never an invented `[DONE]`;
//! - publishes the stream's progress to its session as it changes;
//! - logs one line per request when the body ends, fails, or is dropped by
//!   a client that went away (`outcome=cancelled`).

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use http_body::{Body, Frame, SizeHint};
use pin_project_lite::pin_project;
use tokio::time::Sleep;

use super::gate::SocketFull;
use super::metrics::{Metrics, UpstreamErrorKind};
use super::record::Recording;
use super::sessions::StreamHandle;
use super::upstream::{BoxError, UpstreamBody};
use crate::filter::unix_ms;
use crate::pipeline::Annotator;
use crate::progress::Now;

/// A stream's output is gathered up to this many bytes while the upstream
/// has more ready (see `poll_frame`): fewer writes, no added wait.
const COALESCE_BYTES: usize = 64 * 1024;

/// Room made in a stream's output buffer, beyond its largest piece,
/// before output is written into it when it is empty (see [`OutBuf`]); a
/// larger output grows the buffer.
const OUT_ROOM: usize = 2 * 1024;

/// After an upstream failure, how long the connection is given to send
/// the client what it was handed before the error ends the stream, and
/// how often it is asked again while the client's socket is full (see
/// [`Phase::Flushing`]). `mock` waits as long before it cuts a replay.
pub(crate) const FLUSH_GRACE: Duration = Duration::from_millis(100);

/// The upstream sent nothing for longer than `--idle-timeout`.
#[derive(Debug, thiserror::Error)]
#[error("upstream silent for more than {0:?} mid-stream")]
pub struct IdleTimeout(pub Duration);

/// Longest piece of client text (a path, a session id) put in a log line.
const MAX_LOGGED_CHARS: usize = 1024;

/// Client text made safe for a log line: control (newlines, escape
/// sequences, C1), bidi and zero-width characters escaped, at most
/// 1,024 characters; ordinary text unchanged. A request
/// path may hold any UTF-8 the HTTP parser lets through, and a log line
/// must not be forged or recolored by it. See: issue 7.
pub fn log_safe(text: &str) -> String {
    crate::error::excerpt(text.as_bytes(), MAX_LOGGED_CHARS)
}

/// What is logged about a request when its response body ends.
#[derive(Debug)]
pub struct RequestLog {
    pub method: http::Method,
    /// The request path, through [`log_safe`].
    pub path: String,
    pub status: http::StatusCode,
    pub session_id: String,
    pub started: Instant,
}

impl RequestLog {
    /// The one info line of a request, the same for every outcome:
    /// `ok`, `cancelled` (the client went away), `idle_timeout`,
    /// `upstream_error`, or the fault of a request that got no upstream
    /// response (`upstream_unreachable`, `upstream_timeout`, …): one
    /// spelling, that of the error types of the JSON answers.
    pub fn write(&self, bytes_in: u64, bytes_out: u64, tool_calls: usize, outcome: &str) {
        tracing::info!(
            method = %self.method,
            path = %self.path,
            status = self.status.as_u16(),
            session = %self.session_id,
            duration_ms = self.started.elapsed().as_millis() as u64,
            bytes_in,
            bytes_out,
            tool_calls,
            outcome,
            "request"
        );
    }

    /// The line of a request whose head HTTP/1.1's parser refused and
    /// answered itself (`status`, no body; [`super::server::RefusedHead`]):
    /// the same fields, its method, path and session unknown (`-`), its
    /// time not measured (0).
    pub fn write_refused(status: http::StatusCode, outcome: &str) {
        tracing::info!(
            method = %"-",
            path = %"-",
            status = status.as_u16(),
            session = %"-",
            duration_ms = 0u64,
            bytes_in = 0u64,
            bytes_out = 0u64,
            tool_calls = 0usize,
            outcome,
            "request"
        );
    }
}

/// How a response body ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// Frames are flowing.
    Streaming,
    /// The upstream failed. The error waits [`FLUSH_GRACE`] on the idle
    /// timer: an error yielded at once loses the stream's last bytes.
    /// hyper's HTTP/1 server polls the body again before it flushes what
    /// it was given, and an error then drops what it has not written; over
    /// HTTP/2 the stream's reset follows its last data so closely that a
    /// client may read both at once, and curl then drops the data. While
    /// the connection's last write found the client's socket full
    /// ([`SocketFull`]: a client that reads slowly, or not now), bytes
    /// still wait, and the error waits another `FLUSH_GRACE`, up to the
    /// idle timeout from the failure. Over HTTP/2 this sees only the
    /// socket: data h2 holds back for the client's flow-control window is
    /// not in it, and the stream's reset drops it (a limit, see README).
    Flushing,
    /// Over: the end was yielded (or the error).
    Done,
}

pin_project! {
    /// See the module docs.
    pub struct TapBody {
        #[pin]
        inner: UpstreamBody,
        // `None` for a response that is not a stream: frames pass untouched.
        annotator: Option<Annotator>,
        session: Option<StreamHandle>,
        // `--record`: the upstream bytes, as they come.
        recording: Option<Recording>,
        // The request body's failure, if it fails (see `with_client_body`).
        client_body: Option<ClientBodyNote>,
        #[pin]
        idle: Sleep,
        // The waker `idle` was last polled with while it had not fired
        // (see `idle_fired`); `None` after it fired or was moved.
        idle_waker: Option<Waker>,
        idle_timeout: Duration,
        // When the upstream last sent a frame (or the body began; in
        // `Flushing`, when it failed).
        heard: tokio::time::Instant,
        // Whether the client's connection still holds bytes to write.
        socket_full: SocketFull,
        out: OutBuf,
        phase: Phase,
        error: Option<BoxError>,
        // Trailers waiting behind the last data (see poll_frame).
        trailers: Option<Frame<Bytes>>,
        outcome: &'static str,
        bytes_in: u64,
        bytes_out: u64,
        // The upstream body's length, when its head gave one.
        length: Option<u64>,
        log: RequestLog,
        metrics: Arc<Metrics>,
    }

    impl PinnedDrop for TapBody {
        fn drop(this: Pin<&mut Self>) {
            let this = this.project();
            // A client that leaves while an upstream failure waits to be
            // told (`Flushing`) did not cancel it. Nor did one that got
            // all of a body of known length: hyper stops polling such a
            // body once the length is written, so a body whose end comes
            // in a frame of its own (HTTP/2's empty END_STREAM, as Node
            // sends it) is dropped whole.
            // (A stream is polled to its end: its length is not given.)
            let whole = this.annotator.is_none() && *this.length == Some(*this.bytes_in);
            if *this.phase == Phase::Streaming && !whole {
                *this.outcome = "cancelled";
            }
            // An error the upstream sent inside its stream: the answer
            // failed, though its status was 200.
            let in_stream = *this.outcome == "ok"
                && this
                    .annotator
                    .as_ref()
                    .is_some_and(|a| a.tracker().errored());
            if in_stream {
                *this.outcome = "upstream_error";
            }
            let tool_calls = this
                .annotator
                .as_ref()
                .map_or(0, |a| a.tracker().calls().map(|(_, calls)| calls.len()).sum::<usize>());
            // Counted before the line is out, so that whoever reads the
            // line finds them counted.
            let metrics = &**this.metrics;
            metrics.request_over(this.log.status);
            match *this.outcome {
                "idle_timeout" => metrics.upstream_error(UpstreamErrorKind::IdleTimeout),
                "upstream_error" if in_stream => metrics.upstream_error(UpstreamErrorKind::InStream),
                "upstream_error" => metrics.upstream_error(UpstreamErrorKind::Reset),
                _ => {}
            }
            if let Some(annotator) = this.annotator.as_ref() {
                metrics.streams_open.fetch_sub(1, Ordering::Relaxed);
                metrics.tool_calls_total.fetch_add(tool_calls as u64, Ordering::Relaxed);
                metrics.frames_total.fetch_add(annotator.frames(), Ordering::Relaxed);
            }
            this.log.write(*this.bytes_in, *this.bytes_out, tool_calls, this.outcome);
            // Ends the session's stream: its progress is cleared.
            if let Some(mut session) = this.session.take()
                && *this.outcome != "ok"
            {
                session.mark_failed();
            }
        }
    }
}

/// How a request's body failed on the client's side, noted as it passed
/// on its way upstream (`service`'s body watch). A response that fails
/// after it is the client's doing, not the upstream's: hyper's HTTP/2
/// client, its request body failed, resets the stream and reports only
/// "stream error sent by user".
#[derive(Debug)]
pub struct ClientBodyFailure {
    /// The client's connection ended (or was reset) inside the body;
    /// otherwise the body was framed wrong.
    pub gone: bool,
    /// What the client's side said, for the answer or the log.
    pub message: String,
}

impl ClientBodyFailure {
    /// The log's outcome word for a request that failed so (those of
    /// `service`'s `Fault::outcome` for the same failure before the head).
    pub fn outcome(&self) -> &'static str {
        match self.gone {
            true => "cancelled",
            false => "invalid_request_error",
        }
    }
}

/// Where a request's [`ClientBodyFailure`] is noted, shared by the body
/// sent upstream and the response's [`TapBody`].
pub type ClientBodyNote = Arc<std::sync::OnceLock<ClientBodyFailure>>;

impl TapBody {
    /// A response whose request body is `note`d as it is sent: if it
    /// fails, so does the response, by the client's fault.
    pub fn with_client_body(mut self, note: Option<ClientBodyNote>) -> TapBody {
        self.client_body = note;
        self
    }

    /// A body that annotates a stream.
    #[allow(clippy::too_many_arguments)]
    pub fn stream(
        inner: UpstreamBody,
        annotator: Annotator,
        session: StreamHandle,
        recording: Option<Recording>,
        idle_timeout: Duration,
        socket_full: SocketFull,
        log: RequestLog,
        metrics: Arc<Metrics>,
    ) -> TapBody {
        metrics.streams_open.fetch_add(1, Ordering::Relaxed);
        metrics.streams_total.fetch_add(1, Ordering::Relaxed);
        let mut body = TapBody::new(
            inner,
            Some(annotator),
            Some(session),
            idle_timeout,
            socket_full,
            log,
            metrics,
        );
        body.recording = recording;
        if body.phase == Phase::Done {
            came_to_its_end(&mut body.phase, &mut body.recording);
        }
        body
    }

    /// A body that only passes frames through (and counts them).
    pub fn passthrough(
        inner: UpstreamBody,
        idle_timeout: Duration,
        socket_full: SocketFull,
        log: RequestLog,
        metrics: Arc<Metrics>,
    ) -> TapBody {
        TapBody::new(inner, None, None, idle_timeout, socket_full, log, metrics)
    }

    fn new(
        inner: UpstreamBody,
        annotator: Option<Annotator>,
        session: Option<StreamHandle>,
        idle_timeout: Duration,
        socket_full: SocketFull,
        log: RequestLog,
        metrics: Arc<Metrics>,
    ) -> TapBody {
        let now = tokio::time::Instant::now();
        // A response without a body (to a HEAD, a 204 or 304, a length of
        // 0) is over before it starts: hyper never polls it, and its drop
        // is no client going away.
        let length = inner.size_hint().exact();
        let phase = if inner.is_end_stream() {
            Phase::Done
        } else {
            Phase::Streaming
        };
        TapBody {
            metrics,
            inner,
            annotator,
            session,
            recording: None,
            client_body: None,
            idle: tokio::time::sleep_until(deadline_after(now, idle_timeout)),
            idle_waker: None,
            idle_timeout,
            heard: now,
            socket_full,
            out: OutBuf::default(),
            phase,
            error: None,
            trailers: None,
            outcome: "ok",
            bytes_in: 0,
            bytes_out: 0,
            length,
            log,
        }
    }
}

impl Body for TapBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let mut this = self.project();
        // When this poll took its first frame from the upstream. A read of
        // many events hands them over as as many frames, one after the
        // other: they share that clock read, one a write, not one a frame.
        let mut first_frame: Option<tokio::time::Instant> = None;
        loop {
            match *this.phase {
                Phase::Done => return Poll::Ready(this.trailers.take().map(Ok)),
                Phase::Flushing => {
                    if this.idle.as_mut().poll(cx).is_pending() {
                        return Poll::Pending;
                    }
                    // Bytes still wait in the connection: ask again later.
                    let now = tokio::time::Instant::now();
                    if this.socket_full.get()
                        && now < deadline_after(*this.heard, *this.idle_timeout)
                    {
                        this.idle.as_mut().reset(now + FLUSH_GRACE);
                        continue;
                    }
                    *this.phase = Phase::Done;
                    return Poll::Ready(this.error.take().map(Err));
                }
                Phase::Streaming => {}
            }
            let polled = this.inner.as_mut().poll_frame(cx);
            let event = match polled {
                Poll::Ready(event) => event,
                // Nothing more has arrived: what was gathered goes out now,
                // never waiting for a later event.
                Poll::Pending if !this.out.is_empty() => {
                    publish_read(this.annotator, this.session, *this.heard);
                    let chunk = take_out(this.out, this.bytes_out, this.metrics, first_frame);
                    return Poll::Ready(Some(Ok(Frame::data(chunk))));
                }
                Poll::Pending => {
                    if !idle_fired(this.idle.as_mut(), this.idle_waker, cx) {
                        // A read whose frame is not whole yet collected
                        // nothing; this costs a comparison.
                        publish_read(this.annotator, this.session, *this.heard);
                        return Poll::Pending;
                    }
                    // The timer is moved only when it fires (moving it on
                    // every frame costs a timer-wheel update per event):
                    // if something was heard since it was set, it now
                    // counts from that.
                    let deadline = deadline_after(*this.heard, *this.idle_timeout);
                    if deadline > tokio::time::Instant::now() {
                        this.idle.as_mut().reset(deadline);
                        continue;
                    }
                    // Silent too long: end as if the upstream failed.
                    *this.outcome = "idle_timeout";
                    Some(Err(Box::new(IdleTimeout(*this.idle_timeout)) as BoxError))
                }
            };
            // One clock read for all that needs the time of the frames this
            // poll takes: when they were heard (the idle timer's start, the
            // session's last activity), and the start of the latency their
            // write adds.
            *this.heard = *first_frame.get_or_insert_with(tokio::time::Instant::now);
            match event {
                Some(Ok(frame)) => {
                    let data = match frame.into_data() {
                        Ok(data) => data,
                        // Trailers end the body: what the annotator held
                        // goes out first, then the trailers, untouched.
                        Err(frame) => {
                            came_to_its_end(this.phase, this.recording);
                            finish(this.annotator, this.session, this.out, this.log);
                            if this.out.is_empty() {
                                return Poll::Ready(Some(Ok(frame)));
                            }
                            *this.trailers = Some(frame);
                            let chunk =
                                take_out(this.out, this.bytes_out, this.metrics, first_frame);
                            return Poll::Ready(Some(Ok(Frame::data(chunk))));
                        }
                    };
                    // An empty first frame (HTTP/2 allows them) is no
                    // first byte; it would also leave `bytes_in` at 0 and
                    // count the next one again.
                    if *this.bytes_in == 0 && !data.is_empty() {
                        this.metrics
                            .time_to_first_byte
                            .observe(this.log.started.elapsed());
                    }
                    *this.bytes_in += data.len() as u64;
                    this.metrics
                        .bytes_in_total
                        .fetch_add(data.len() as u64, Ordering::Relaxed);
                    if let Some(recording) = this.recording.as_mut()
                        && !recording.data(&data)
                    {
                        // Its recording was finished for an exit at once
                        // (a second signal): what it holds is all the
                        // client may get, so this piece stays here, and
                        // the stream waits for the exit.
                        return Poll::Pending;
                    }
                    // A body with a known length ends with its last frame:
                    // the connection will not poll again to hear so.
                    let last = this.inner.is_end_stream();
                    if last {
                        came_to_its_end(this.phase, this.recording);
                    }
                    let Some(annotator) = this.annotator.as_mut() else {
                        count_out(this.bytes_out, this.metrics, data.len());
                        return Poll::Ready(Some(Ok(Frame::data(data))));
                    };
                    // Increments are collected only while someone listens
                    // to the session (a look at a flag, without a lock).
                    annotator
                        .collect_events(this.session.as_ref().is_some_and(StreamHandle::listened));
                    // A tool started executing (`tool:execute`): the calls
                    // in progress are over, here as in the session (whose
                    // clear ended their spinners); or the session came
                    // back to this stream.
                    if let Some(session) = this.session.as_mut()
                        && session.before_read(annotator.tracker_mut())
                    {
                        // Taken between two reads of one publish: what the
                        // reads before brought of the calls is over.
                        annotator.drop_progress_events();
                    }
                    annotator.push(&data, Now::Clock(unix_ms), this.out.room_for(data.len()));
                    log_warnings(annotator, this.log);
                    // What it collected is published when its output goes
                    // out, once for all the reads gathered into it.
                    if last {
                        finish(this.annotator, this.session, this.out, this.log);
                    }
                }
                Some(Err(err)) => {
                    // The client's request body failed first: the upstream
                    // is not to blame (nor counted as failing).
                    match this.client_body.as_ref().and_then(|note| note.get()) {
                        Some(client) => {
                            if *this.outcome == "ok" {
                                *this.outcome = client.outcome();
                            }
                            tracing::debug!(session = %this.log.session_id, path = %this.log.path, "stream cut: {}", client.message);
                        }
                        None => {
                            if *this.outcome == "ok" {
                                *this.outcome = "upstream_error";
                            }
                            tracing::warn!(session = %this.log.session_id, path = %this.log.path, "stream ended early: {err}");
                        }
                    }
                    // Before `finish` publishes the calls' end: their
                    // spinners end with `✗`.
                    if let Some(session) = this.session.as_mut() {
                        session.mark_failed();
                    }
                    if let Some(annotator) = this.annotator.as_mut() {
                        annotator.input_failed();
                    }
                    *this.error = Some(err);
                    *this.phase = Phase::Flushing;
                    this.idle
                        .as_mut()
                        .reset(tokio::time::Instant::now() + FLUSH_GRACE);
                    *this.idle_waker = None;
                    finish(this.annotator, this.session, this.out, this.log);
                }
                None => {
                    came_to_its_end(this.phase, this.recording);
                    finish(this.annotator, this.session, this.out, this.log);
                }
            }
            // Coalesce: while the upstream has more ready, keep reading
            // (up to COALESCE_BYTES), so a burst of events goes out in one
            // write instead of one write per event.
            let more_may_come = *this.phase == Phase::Streaming && this.out.len() < COALESCE_BYTES;
            if !this.out.is_empty() && !more_may_come {
                publish_read(this.annotator, this.session, *this.heard);
                let chunk = take_out(this.out, this.bytes_out, this.metrics, first_frame);
                return Poll::Ready(Some(Ok(Frame::data(chunk))));
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.phase == Phase::Done && self.out.is_empty() && self.trailers.is_none()
    }

    fn size_hint(&self) -> SizeHint {
        match self.annotator {
            // Passthrough: the upstream's length is ours.
            None => self.inner.size_hint(),
            Some(_) => SizeHint::default(),
        }
    }
}

/// The upstream body came to its end (not cut): so says its recording too.
fn came_to_its_end(phase: &mut Phase, recording: &mut Option<Recording>) {
    *phase = Phase::Done;
    if let Some(recording) = recording.as_mut() {
        recording.ended();
    }
}

/// Whether the idle timer fired. It is polled only when it may have to
/// tell something new: the first time, after it fired or was moved, or for
/// a new waker. Otherwise it already holds `cx`'s waker, which it wakes
/// when it fires, and a look at its state is enough: hyper's server polls
/// a body two or three times per event, and each poll of the timer costs
/// about a hundred instructions (budget, state, waker) that say nothing new.
fn idle_fired(
    mut idle: Pin<&mut Sleep>,
    polled_with: &mut Option<Waker>,
    cx: &mut Context<'_>,
) -> bool {
    if let Some(waker) = polled_with.as_ref()
        && waker.will_wake(cx.waker())
        && !idle.is_elapsed()
    {
        return false;
    }
    // A task out of budget gets `Pending` from the timer before the timer
    // keeps its waker: that poll does not count as one that registered it.
    let registers = tokio::task::coop::has_budget_remaining();
    if idle.as_mut().poll(cx).is_ready() {
        // It is moved or dropped next: the next poll registers again.
        *polled_with = None;
        return true;
    }
    if !registers {
        *polled_with = None;
    } else if !polled_with
        .as_ref()
        .is_some_and(|w| w.will_wake(cx.waker()))
    {
        *polled_with = Some(cx.waker().clone());
    }
    false
}

/// `idle_timeout` after `heard`; a huge `--idle-timeout` means "never",
/// without overflow.
fn deadline_after(heard: tokio::time::Instant, idle_timeout: Duration) -> tokio::time::Instant {
    heard
        .checked_add(idle_timeout)
        .unwrap_or_else(|| heard + Duration::from_secs(100 * 365 * 24 * 3600))
}

/// A stream's output buffer: what the annotator writes, handed to the
/// connection a piece at a time ([`take`](Self::take)) without a copy.
///
/// A piece handed on shares the buffer's allocation until the connection
/// has written and dropped it. Once it is dropped, the buffer is made whole
/// again and the next output is written at the start of its allocation:
/// the same first bytes every event of a paced stream, which are still in
/// the cache, rather than the next ones along, which are not (BENCHMARKS.md,
/// thirty-eighth round). While the piece is held, the next output is
/// written after it if the rest of the allocation has room for as much as
/// the largest piece took. (Left to itself, `bytes` would move what was
/// gathered back to the start once it ran out of room: a copy of up to a
/// whole burst, in an unpaced stream nearly every burst.)
///
/// The connection may still hold a piece when the next event comes (it
/// polls the body again before it writes, and may queue several pieces),
/// so a second buffer takes turns with the first: output is written into
/// whichever has room, and a new buffer is allocated only when neither
/// has, as large as the largest piece was plus `OUT_ROOM`. A burst gathered
/// in it (up to `COALESCE_BYTES`) then does not grow it step by step, each
/// step a copy of all it holds, unless it is larger than any before
/// (BENCHMARKS.md, nineteenth and twentieth rounds). The largest piece, not
/// the last: a small burst between two large ones (the upstream paused)
/// would otherwise leave the next large one too little room.
///
/// A stream's first bursts have no piece to go by, so the room for a read
/// is also sized from the read ([`room_for`](Self::room_for)): an empty
/// buffer gets room for the read's output, and a buffer already gathering
/// a burst that has less room left than the next read is grown once to
/// hold a whole burst, rather than doubled step by step as the burst fills
/// it (BENCHMARKS.md, thirty-seventh round).
#[derive(Default)]
pub struct OutBuf {
    out: Whole,
    spare: Whole,
    /// The length of the largest piece taken.
    largest: usize,
}

/// One of [`OutBuf`]'s buffers, with the capacity its allocation has.
#[derive(Default)]
struct Whole {
    buf: BytesMut,
    /// The most room `buf` has been seen to have from its start (when made
    /// whole, or when a piece is taken after `bytes` grew it); 0: it has
    /// no allocation yet.
    capacity: usize,
}

impl Whole {
    /// Room in the empty buffer: the whole allocation, at its start, once
    /// no piece of it is held (an allocation smaller than `need` then grows
    /// as it is written); while one is, where it is, if it has `need` bytes
    /// left after the pieces taken before. False while a piece is held and
    /// there is less room than `need`, or when it has no allocation yet;
    /// never allocates or copies.
    fn reclaim(&mut self, need: usize) -> bool {
        let room = self.buf.capacity();
        if self.capacity == 0 {
            return false;
        }
        if room >= self.capacity {
            // Nothing taken since it was last whole.
            return true;
        }
        // A piece was taken, so the start is further back.
        if super::rewind(&mut self.buf) {
            self.capacity = self.capacity.max(self.buf.capacity());
            return true;
        }
        room >= need
    }

    /// What was written since the last take, as one piece.
    fn take(&mut self) -> Bytes {
        self.capacity = self.capacity.max(self.buf.capacity());
        self.buf.split().freeze()
    }
}

impl OutBuf {
    /// Whether nothing was written since the last take.
    pub fn is_empty(&self) -> bool {
        self.out.buf.is_empty()
    }

    /// Bytes written since the last take.
    pub fn len(&self) -> usize {
        self.out.buf.len()
    }

    /// What was written since the last take, as one piece.
    pub fn take(&mut self) -> Bytes {
        self.largest = self.largest.max(self.out.buf.len());
        self.out.take()
    }

    /// The buffer to write the output of a read of `read` bytes into (0
    /// for what the input's end writes). When it is empty, room is made
    /// first, as much as the largest piece or the read took and some: this
    /// buffer or the spare made whole, or a new one allocated when the
    /// connection still holds pieces of both. A buffer that already gathers
    /// a burst and has less room left than the read grows once to a whole
    /// burst's size (`COALESCE_BYTES`, then this read, and `OUT_ROOM`): the
    /// burst goes on until it is that large, and its other reads then fit
    /// where they are.
    pub fn room_for(&mut self, read: usize) -> &mut BytesMut {
        let need = self.largest.max(read) + OUT_ROOM;
        if self.out.buf.is_empty() && !self.out.reclaim(need) {
            // Held: the spare takes its turn, and this buffer waits as the
            // spare until its pieces are dropped.
            std::mem::swap(&mut self.out, &mut self.spare);
            if !self.out.reclaim(need) {
                let buf = BytesMut::with_capacity(need);
                self.out = Whole {
                    capacity: buf.capacity(),
                    buf,
                };
            }
        }
        let buf = &mut self.out.buf;
        if !buf.is_empty() && buf.capacity() - buf.len() < read {
            buf.reserve((COALESCE_BYTES + read + OUT_ROOM).saturating_sub(buf.len()));
        }
        buf
    }
}

/// End of input for the annotator: what it still held goes out, and what
/// its end changed (a last event, the end's clear) reaches subscribers.
fn finish(
    annotator: &mut Option<Annotator>,
    session: &mut Option<StreamHandle>,
    out: &mut OutBuf,
    log: &RequestLog,
) {
    if let Some(annotator) = annotator.as_mut() {
        annotator.finish(Now::Clock(unix_ms), out.room_for(0));
        log_warnings(annotator, log);
        if let Some(session) = session.as_mut() {
            session.note_end(annotator.incomplete());
        }
        publish(annotator, session, Instant::now());
    }
}

/// The gathered output, taken to go to the client, and counted; the time
/// since its first frame was taken from the upstream (`first_frame`, when
/// this poll took one) is the latency it adds.
#[inline]
fn take_out(
    out: &mut OutBuf,
    bytes_out: &mut u64,
    metrics: &Metrics,
    first_frame: Option<tokio::time::Instant>,
) -> Bytes {
    let chunk = out.take();
    count_out(bytes_out, metrics, chunk.len());
    if let Some(first) = first_frame {
        metrics.added_latency.observe(first.elapsed());
    }
    chunk
}

/// Counts `len` bytes handed to the client, in the request's log line and
/// in the proxy's `bytes_out_total`: every piece of output goes through here.
#[inline]
fn count_out(bytes_out: &mut u64, metrics: &Metrics, len: usize) {
    *bytes_out += len as u64;
    metrics
        .bytes_out_total
        .fetch_add(len as u64, Ordering::Relaxed);
}

/// Publishes what the reads gathered into the output collected, as that
/// output goes out (`heard`: when the last of them came).
fn publish_read(
    annotator: &mut Option<Annotator>,
    session: &mut Option<StreamHandle>,
    heard: tokio::time::Instant,
) {
    if let Some(annotator) = annotator.as_mut() {
        publish(annotator, session, heard.into_std());
    }
}

/// Publishes what the annotator collected to the stream's session, if it
/// has one, and empties it for the next write.
fn publish(annotator: &mut Annotator, session: &mut Option<StreamHandle>, now: Instant) {
    if let Some(session) = session.as_mut() {
        let missed = annotator.events_missed();
        let (tracker, events) = annotator.collected();
        session.publish_at(tracker, events, missed, now);
    }
    annotator.clear_events();
}

#[inline]
fn log_warnings(annotator: &mut Annotator, log: &RequestLog) {
    if !annotator.has_warnings() {
        return;
    }
    for warning in annotator.take_warnings() {
        tracing::warn!(session = %log.session_id, path = %log.path, "{warning}");
    }
}
