//! Plain-HTTP/1.1 upstream connections that the response drives itself.
//!
//! A request is written and its response head read by [`H1Pool::request`];
//! the response body ([`DrivenBody`]) then reads the connection's socket
//! itself, in the task of the client's connection, and decodes the body's
//! framing ([`wire`]) from what it read: every event that has arrived is
//! found in one poll, so [`TapBody`](super::body::TapBody) sends them in one
//! write. Nothing is read ahead of the client either: the socket is only
//! read when the body is polled, that is when the client's side has room.
//! Nothing is spawned, and there is no channel between the connection and
//! the body, but for a response whose head came before all of the request
//! was written (below).
//!
//! Until the eighteenth round (BENCHMARKS.md) this was hyper's client
//! connection, polled by the body: its chunked decoder took a chunk-size
//! line a byte at a time, and its dispatcher and body channel cost about
//! as much again, about 2,000 instructions of an SSE event's 11,700 in
//! all. The HTTP/1.1 framing it took over is in [`wire`]; what it does not
//! do: tunnels (`101`, `CONNECT`), content codings (the proxy asks for
//! `identity`). A response whose head came before all of the request was
//! written (an upstream may answer before it has read it all) is read, and
//! the rest of the request sent, by a task of its own (`pump`), as hyper's
//! client goes on sending it whether or not the response is read: the
//! response is not held back for the request, nor the request for a client
//! that reads its response only once it has sent all of its request; the
//! connection is kept for reuse only once all of the request is written
//! (see `send_rest`).
//! After a poll of the socket that found nothing, the body does not poll it
//! again until it was woken (`Gate`, in `proxy::gate`; nineteenth round).
//!
//! [`H1Pool`] keeps finished keep-alive connections for the next request
//! (each at most [`IDLE_KEEP`]) in a list per thread (at most [`MAX_IDLE`]
//! in each): a connection goes back to the list of the thread whose
//! runtime's reactor watches its socket, and a thread takes from its own
//! list first. When its own is empty it takes another thread's connection
//! and moves its socket to its own reactor (see `Conn::rehome`); left
//! with the other's, every event of the stream woke that thread to wake
//! this one. An idle connection is not read; it is checked when taken
//! (a connection the upstream closed meanwhile reads its end and is
//! dropped) and every 15 s by a sweeper task, and a request that finds it
//! closed before any byte was written is sent again on a new connection,
//! as hyper-util's client does, and so is one with no body and an
//! idempotent method that it fails before any byte of the answer, as
//! nginx does.
//!
//! TLS upstreams keep hyper-util's client (they mostly speak HTTP/2, whose
//! streams buffer several frames anyway); see
//! [`UpstreamClient`](super::upstream::UpstreamClient).

pub mod wire;

use std::cell::Cell;
use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock, PoisonError, Weak};
use std::task::{Context, Poll, Waker, ready};
use std::time::{Duration, Instant};

use bytes::{Buf, Bytes, BytesMut};
use http::header::{self, HeaderValue};
use http::uri::Authority;
use http::{Method, Request, Response, Uri};
use http_body::{Body, Frame, SizeHint};
use http_body_util::BodyExt;
use hyper_util::client::legacy::connect::HttpConnector;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio::sync::mpsc;
use tower_service::Service;

use super::gate::Gate;

use self::wire::{Chunked, Framing, Head, Piece, RequestFraming, WireError};
use super::upstream::{BoxError, ProxyBody};

/// The most an HTTP/1.1 connection buffers, each way (hyper's default is
/// about 400 KiB): upstream connections here, client connections in
/// [`server`](super::server). A slow client's stream holds about this much
/// in the proxy, not more, and reads and writes stay large enough.
pub const CONN_BUF_BYTES: usize = 64 * 1024;

/// How often idle connections are checked (see [`H1Pool::sweep`]).
const SWEEP_EVERY: Duration = Duration::from_secs(15);

/// Sweeps `pool` every `period` while it exists.
async fn sweep_every(period: Duration, pool: Weak<H1Pool>) {
    loop {
        tokio::time::sleep(period).await;
        let Some(pool) = pool.upgrade() else {
            return;
        };
        pool.sweep();
    }
}

/// Idle connections kept for reuse, at most, in each of the [`SHARDS`]
/// lists.
pub const MAX_IDLE: usize = 256;

/// How many lists of idle connections a pool keeps (one per thread, while
/// there are no more threads than this): at most `SHARDS * MAX_IDLE` idle
/// connections in all.
pub const SHARDS: usize = 8;

/// This thread's list of idle connections, the same in every pool.
/// `serve`'s worker threads are given theirs ([`pin_shard`]); any other
/// thread takes the next number on its first checkout or checkin. Threads
/// past [`SHARDS`] share lists, which costs only locality.
fn own_shard() -> usize {
    SHARD.with(|shard| match shard.get() {
        Some(shard) => shard,
        None => {
            static NEXT: AtomicUsize = AtomicUsize::new(0);
            let next = NEXT.fetch_add(1, Ordering::Relaxed) % SHARDS;
            shard.set(Some(next));
            next
        }
    })
}

/// Gives the calling thread the idle list `worker % SHARDS` (for
/// [`Workers`](super::server::Workers), so that its threads have a list each).
pub(crate) fn pin_shard(worker: usize) {
    SHARD.with(|shard| shard.set(Some(worker % SHARDS)));
}

thread_local! {
    static SHARD: Cell<Option<usize>> = const { Cell::new(None) };
}

/// How long an unused connection is kept (hyper-util's default too).
pub const IDLE_KEEP: Duration = Duration::from_secs(90);

/// The least room a read is given in a connection's buffer: below it, the
/// buffer is made larger first.
const MIN_READ_BYTES: usize = 1024;

/// The room a connection's first read gets (hyper's starting size too); it
/// doubles, up to [`CONN_BUF_BYTES`], each time a read fills all it had.
const FIRST_READ_BYTES: usize = 8 * 1024;

/// One HTTP/1.1 connection to the upstream: its socket and what was read
/// from it and not yet taken.
struct Conn {
    io: TcpStream,
    /// Bytes read and not yet taken: a response head being completed, then
    /// the body's bytes. Data handed on is split off its front.
    buf: BytesMut,
    /// The room the next growth of `buf` makes (see [`FIRST_READ_BYTES`]).
    read_bytes: usize,
    /// How far `buf` is known to hold no end of a response head: a head is
    /// parsed only once its blank line has come, not again on every read
    /// (a head sent a byte at a time would cost its length squared).
    scanned: usize,
    /// The idle list of the thread whose runtime's reactor watches its
    /// socket (the thread that made it, or the one it was moved to): it
    /// goes back there.
    home: usize,
    /// A byte of an answer to the request under way has come (of its head,
    /// or of an interim `1xx` one): it is not sent again.
    heard: bool,
}

impl Conn {
    /// A connection on `io`, at home on this thread.
    fn new(io: TcpStream) -> Conn {
        Conn {
            io,
            buf: BytesMut::new(),
            read_bytes: FIRST_READ_BYTES,
            scanned: 0,
            home: own_shard(),
            heard: false,
        }
    }

    /// This idle connection, made on another thread, moved to this one: its
    /// socket leaves the other runtime's reactor for this thread's. Left on
    /// the other reactor, each of its wake-ups would wake the other thread
    /// only for it to wake this one: a second wake-up per event, about
    /// 30 µs of CPU at C=1 here (BENCHMARKS.md, "Eleventh round"). (The
    /// threads of a multi-thread runtime share one reactor: there the move
    /// changes only the list it goes back to.) `None`, and the connection
    /// is dropped, when it cannot be moved: it holds bytes read ahead of a
    /// request (never, when idle), or the socket cannot be registered here.
    fn rehome(self) -> Option<Conn> {
        if !self.buf.is_empty() {
            return None;
        }
        match self.io.into_std().and_then(TcpStream::from_std) {
            Ok(io) => Some(Conn::new(io)),
            Err(err) => {
                tracing::debug!("cannot move an idle upstream connection to this thread: {err}");
                None
            }
        }
    }

    /// Asks the kernel to acknowledge what the upstream sends from now on
    /// one segment in two (or when its delayed-ACK timer fires, 40 ms or
    /// more later) rather than each one (`TCP_QUICKACK` off: Linux's
    /// delayed-ACK mode, as RFC 1122 allows). A response body flows one way
    /// and a streaming one comes a small segment an event; by default each
    /// read that emptied the socket after such a segment sent an ACK of its
    /// own, which carried loopback TCP's whole send and receive path in this
    /// proxy's CPU time: a sixth of it an event, paced (BENCHMARKS.md,
    /// forty-third round). Nothing else changes: a segment out of order is
    /// still acknowledged at once, and with one segment unacknowledged the
    /// upstream's loss probe waits 200 ms beyond twice the round trip. The
    /// mode is not kept: the kernel leaves it when its timer fires (a pause
    /// of the stream after an odd segment, or the end of a response), so it
    /// is asked for again for every response, once its head is read (asked
    /// for before, the head's ACK would wait through a model's wait for its
    /// first token, and the mode would be gone by then). A failure costs
    /// only the saving, and is not reported. Whether it was asked for.
    ///
    /// An upstream with Nagle's algorithm on (no `TCP_NODELAY`) waits for
    /// the ACK of one small segment before it sends the next: in this mode
    /// that ACK waits for the timer, and each event sent meanwhile with it,
    /// up to 40 ms once a response (the kernel leaves the mode when the
    /// timer fires). [`PairsWatch`] tells such an upstream, and the pool
    /// then reads it in the kernel's default mode.
    fn ack_in_pairs(&self) -> bool {
        #[cfg(any(target_os = "linux", target_os = "android"))]
        return rustix::net::sockopt::set_tcp_quickack(&self.io, false).is_ok();
        #[cfg(not(any(target_os = "linux", target_os = "android")))]
        false
    }

    /// Asks the kernel to acknowledge each segment of what follows, for an
    /// upstream that waits for each ACK ([`PairsWatch`]): the kernel may
    /// have put the socket in delayed-ACK mode by itself, guessing request
    /// and response from a request sent soon after the last response came
    /// (back-to-back requests on a reused connection), and such an upstream
    /// would then wait on its timer once a response still.
    fn ack_each_segment(&self) {
        #[cfg(any(target_os = "linux", target_os = "android"))]
        let _ = rustix::net::sockopt::set_tcp_quickack(&self.io, true);
    }

    /// Whether the socket has left delayed-ACK mode ([`Conn::ack_in_pairs`]):
    /// the kernel's delayed-ACK timer fired since it was asked for.
    fn left_pairs(&self) -> bool {
        #[cfg(any(target_os = "linux", target_os = "android"))]
        return rustix::net::sockopt::tcp_quickack(&self.io).unwrap_or(false);
        #[cfg(not(any(target_os = "linux", target_os = "android")))]
        false
    }

    /// Whether it is open with nothing to read: one read is tried (with
    /// `cx`'s waker registered if it would wait). An upstream that closed
    /// it meanwhile makes the read find its end.
    fn quiet(&mut self, cx: &mut Context<'_>) -> bool {
        let mut byte = [0u8; 1];
        let mut probe = ReadBuf::new(&mut byte);
        self.buf.is_empty()
            && Pin::new(&mut self.io)
                .poll_read(cx, &mut probe)
                .is_pending()
    }

    /// Whether it can take a request now (checked without a waker).
    fn usable(&mut self) -> bool {
        self.quiet(&mut Context::from_waker(Waker::noop()))
    }

    /// [`usable`](Self::usable), and the kernel agrees: nothing to read
    /// and no end. The reactor learns of an upstream's close only when it
    /// next runs, so a connection the upstream closed just before (without
    /// `Connection: close`, or at its keep-alive timeout) passed for open;
    /// the request was then written to it and failed with a `502`, too
    /// late to be sent again (2 of 300 back-to-back requests). One
    /// `recv(MSG_PEEK)` for each connection taken from the pool.
    fn usable_now(&mut self) -> bool {
        if !self.usable() {
            return false;
        }
        let mut byte = [0u8; 1];
        let flags = rustix::net::RecvFlags::PEEK | rustix::net::RecvFlags::DONTWAIT;
        matches!(
            rustix::net::recv(&self.io, &mut byte, flags),
            Err(err) if err == rustix::io::Errno::AGAIN
        )
    }

    /// Room for a read: at least [`MIN_READ_BYTES`], made `read_bytes`
    /// when short (`BytesMut` takes back the front of its buffer when no
    /// data handed on still points into it). A buffer whose bytes were all
    /// taken, and dropped, reads at its start again ([`super::rewind`]): a
    /// paced stream's reads then land on the same few lines of memory.
    fn make_room(&mut self) -> usize {
        super::rewind(&mut self.buf);
        if self.buf.capacity() - self.buf.len() < MIN_READ_BYTES {
            self.buf.reserve(self.read_bytes);
        }
        self.buf.capacity() - self.buf.len()
    }

    /// A larger next buffer when a read filled all the room it had.
    fn grew(&mut self, read: usize, room: usize) {
        if read == room && self.read_bytes < CONN_BUF_BYTES {
            self.read_bytes = (self.read_bytes * 2).min(CONN_BUF_BYTES);
        }
    }

    /// Reads until a final response head is complete at the front of `buf`,
    /// and takes it (and any interim `1xx` before it) off `buf`.
    fn poll_head(&mut self, method: &Method, cx: &mut Context<'_>) -> Poll<Result<Head, H1Error>> {
        loop {
            let head = if wire::has_blank_line(&self.buf[self.scanned..]) {
                wire::parse_head(&self.buf, method)?
            } else {
                None
            };
            // The blank line's three bytes may be cut by the next read.
            self.scanned = self.buf.len().saturating_sub(3);
            if let Some((len, head)) = head {
                self.scanned = 0;
                // The limit holds however the head arrived (in pieces it
                // fails below), as with hyper's client before.
                if len > CONN_BUF_BYTES {
                    return Poll::Ready(Err(WireError::HeadTooLarge(CONN_BUF_BYTES).into()));
                }
                self.buf.advance(len);
                if head.status == http::StatusCode::SWITCHING_PROTOCOLS {
                    return Poll::Ready(Err(H1Error::Switched));
                }
                if head.status.is_informational() {
                    continue;
                }
                return Poll::Ready(Ok(head));
            }
            if self.buf.len() >= CONN_BUF_BYTES {
                return Poll::Ready(Err(WireError::HeadTooLarge(CONN_BUF_BYTES).into()));
            }
            match ready!(self.poll_fill(cx)) {
                Ok(0) => return Poll::Ready(Err(H1Error::Closed)),
                Ok(_) => self.heard = true,
                Err(err) => return Poll::Ready(Err(H1Error::Read(err))),
            }
        }
    }

    /// Reads what has arrived into `buf`: `Ready(Ok(0))` at the upstream's
    /// end of the connection.
    fn poll_fill(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<usize>> {
        #[cfg(test)]
        tests::SOCKET_POLLS.with(|n| n.set(n.get() + 1));
        let room = self.make_room();
        let read = ready!(tokio_util::io::poll_read_buf(
            Pin::new(&mut self.io),
            cx,
            &mut self.buf
        ))?;
        self.grew(read, room);
        Poll::Ready(Ok(read))
    }
}

struct Idle {
    conn: Conn,
    since: Instant,
}

/// Why a request got no response.
#[derive(Debug, thiserror::Error)]
pub enum H1Error {
    /// No connection could be made.
    #[error("{0}")]
    Connect(#[source] BoxError),
    /// A connection made for this request closed before taking it.
    #[error("the new connection closed before the request was sent")]
    Refused,
    /// The client's request body failed while it was being sent (the
    /// client's fault, not the upstream's).
    #[error("the request body failed: {0}")]
    RequestBody(#[source] BoxError),
    #[error("cannot send the request: {0}")]
    Write(#[source] io::Error),
    #[error("cannot read the response: {0}")]
    Read(#[source] io::Error),
    #[error("the upstream closed the connection before sending a response head")]
    Closed,
    /// [`H1Error::Closed`] on a connection made for this request: what a
    /// TLS server does with a plain HTTP request.
    #[error(
        "the upstream closed a new connection without answering the request (if it speaks \
         TLS, give --upstream as https://)"
    )]
    ClosedNew,
    #[error("the upstream answered 101 Switching Protocols, which the proxy does not tunnel")]
    Switched,
    #[error(transparent)]
    Wire(#[from] WireError),
}

/// Why a response body ended before its end.
#[derive(Debug, thiserror::Error)]
pub enum BodyError {
    #[error("cannot read the response body: {0}")]
    Read(#[source] io::Error),
    #[error("the upstream closed the connection before the end of the body")]
    Closed,
    #[error(transparent)]
    Wire(#[from] WireError),
}

/// The pool and connector of plain-HTTP upstream connections.
pub struct H1Pool {
    connector: HttpConnector,
    /// How long a new connection may take, its name's lookup included
    /// (the connector's own timeout covers the TCP connect alone, so a
    /// slow resolver went past `--connect-timeout`).
    connect_timeout: Duration,
    /// How long the rest of a request whose response has ended may go
    /// without progress (the proxy's idle timeout) before its connection
    /// is given up.
    rest_idle: Duration,
    /// Idle connections, one list per thread ([`own_shard`]) holding the
    /// connections that thread made (`Conn::home`): each connection's
    /// socket is registered with the reactor of the runtime that made it,
    /// so a connection reused on that thread is woken there, not from
    /// another thread.
    idle: Box<[Mutex<Vec<Idle>>]>,
    /// The sweeper task runs (started with the first idle connection,
    /// inside the runtime; it ends with the pool).
    sweeping: AtomicBool,
    /// The `Host` value of the first authority asked for, kept: `serve`
    /// asks for one only, and each request then shares it rather than
    /// building it (two allocations a request; BENCHMARKS.md, forty-sixth
    /// round).
    host: OnceLock<(Authority, HeaderValue)>,
    /// Responses are read acknowledging in pairs ([`Conn::ack_in_pairs`])
    /// until one shows that the upstream waits for each ACK
    /// ([`PairsWatch`]).
    pairs: AtomicBool,
}

/// Tells an upstream that waits for the ACK of each small segment (Nagle's
/// algorithm on) while a response is read in delayed-ACK mode. Such an
/// upstream sends one segment, then holds what follows until the kernel's
/// delayed-ACK timer (40 ms at least on Linux) sends the ACK, and the
/// timer's firing takes the socket out of the mode. So a socket that has
/// left the mode while its response still streams is what it looks like.
/// One that does not wait leaves it only when its stream pauses for that
/// long after an odd segment: a slow stream, for which the mode saves
/// nothing. Either way the pool then reads every response in the kernel's
/// default mode. The socket is asked (one `getsockopt`) at the response's
/// 2nd, 4th, 8th… read, not at each: the 2nd read is the one such an
/// upstream holds back. An upstream that waits so costs its first
/// response's events one wait of the timer, at most about 40 ms; the
/// ones after, none: each is read with an ACK a segment, the kernel's own
/// guess of delayed-ACK mode taken back ([`Conn::ack_each_segment`]).
/// The pool does not go back to the mode for the rest of the process,
/// also when what tripped it was one pause of a stream that does not
/// wait: the saving (a sixth of a paced event's CPU) goes, no latency.
struct PairsWatch {
    /// Reads of the response body so far.
    reads: u64,
}

impl PairsWatch {
    /// A read came: whether it is that upstream's sign.
    fn read(&mut self, conn: &Conn) -> bool {
        self.reads += 1;
        self.reads >= 2 && self.reads.is_power_of_two() && conn.left_pairs()
    }
}

impl H1Pool {
    /// A pool whose connections are made within `connect_timeout`, and
    /// whose requests sent on after their response ended may stall for
    /// `idle_timeout` at most.
    pub fn new(connect_timeout: Duration, idle_timeout: Duration) -> Arc<H1Pool> {
        let mut connector = HttpConnector::new();
        connector.set_nodelay(true);
        // Also the connector's own: it shares it among a name's addresses,
        // so that one that drops the connection leaves time for the next
        // (the outer bound, in `connect`, covers the lookup too).
        connector.set_connect_timeout(Some(connect_timeout));
        Arc::new(H1Pool {
            connector,
            connect_timeout,
            rest_idle: idle_timeout,
            idle: (0..SHARDS).map(|_| Mutex::new(Vec::new())).collect(),
            sweeping: AtomicBool::new(false),
            host: OnceLock::new(),
            pairs: AtomicBool::new(true),
        })
    }

    /// Sends `req` (its URI absolute: `http://authority/path`) and returns
    /// the response, whose body reads the connection.
    pub async fn request(
        self: &Arc<Self>,
        mut req: Request<ProxyBody>,
    ) -> Result<Response<DrivenBody>, H1Error> {
        let uri = req.uri().clone();
        if let Some(authority) = uri.authority() {
            req.headers_mut()
                .entry(header::HOST)
                .or_insert_with(|| self.host_value(authority));
        }
        *req.uri_mut() = origin_form(&uri);
        let mut resent = false;
        if let Some(mut conn) = self.checkout() {
            // Its close may also come after the check in `exchange`, while
            // the request is on its way, and the request then gets no byte
            // of an answer. One that can be sent twice (an idempotent
            // method, RFC 9110 §9.2.2, and no body to keep) is sent again
            // on a new connection, as nginx does on a kept connection.
            let copy = resendable(&req).then(|| copy_of(&req));
            match exchange(&mut conn, req).await {
                Ok(answer) => return Ok(self.driven(conn, answer)),
                // Closed before a byte of it was written: an upstream that
                // closed an idle connection. Send it again on a new one.
                Err(Retry::Again(again)) => req = again,
                Err(Retry::No(err)) => match copy {
                    Some(copy) if unanswered(&err) && !conn.heard => {
                        tracing::debug!(
                            "sent again on a new connection: a kept one failed ({err})"
                        );
                        req = copy;
                        resent = true;
                    }
                    _ => return Err(err),
                },
            }
        }
        let mut conn = self.connect(uri).await?;
        match exchange(&mut conn, req).await {
            Ok(answer) => Ok(self.driven(conn, answer)),
            Err(Retry::Again(_)) => Err(H1Error::Refused),
            // A kept connection has shown that the upstream speaks plain
            // HTTP: no hint of TLS then.
            Err(Retry::No(H1Error::Closed)) if !resent => Err(H1Error::ClosedNew),
            Err(Retry::No(err)) => Err(err),
        }
    }

    /// `Host` for `authority`: the kept one when it is the first asked for.
    fn host_value(&self, authority: &Authority) -> HeaderValue {
        let (kept, value) = self
            .host
            .get_or_init(|| (authority.clone(), host_value(authority)));
        if kept.as_str() == authority.as_str() {
            value.clone()
        } else {
            host_value(authority)
        }
    }

    fn driven(self: &Arc<Self>, conn: Conn, answer: Answer) -> Response<DrivenBody> {
        let Answer { head, sending } = answer;
        let watch = match head.framing {
            Framing::Empty => None,
            _ if self.pairs.load(Ordering::Relaxed) => {
                conn.ack_in_pairs().then_some(PairsWatch { reads: 0 })
            }
            _ => {
                conn.ack_each_segment();
                None
            }
        };
        let mut response = Response::new(DrivenBody {
            reader: match head.framing {
                Framing::Empty => Reader::Done,
                Framing::Length(n) => Reader::Length(n),
                Framing::Chunked => Reader::Chunked(Chunked::new()),
                Framing::Close => Reader::Close,
            },
            reusable: head.keep_alive,
            sending,
            conn: Some(conn),
            pool: Arc::clone(self),
            gate: Gate::new(),
            watch,
        });
        *response.status_mut() = head.status;
        *response.version_mut() = head.version;
        *response.headers_mut() = head.headers;
        // No body to read (HEAD, 204, 304): hyper's server will not poll
        // it, so the connection goes back now or never.
        if response.body().is_end_stream() {
            response.body_mut().release();
        } else if response.body().sending.is_some() {
            pump(response.body_mut());
        }
        response
    }

    /// From now on, responses are read in the kernel's default mode: the
    /// upstream waits for each ACK ([`PairsWatch`]).
    fn read_without_pairs(&self) {
        if self.pairs.swap(false, Ordering::Relaxed) {
            tracing::debug!(
                "the upstream waits for the ACK of each segment (Nagle's algorithm on, no \
                 TCP_NODELAY): its responses are now read acknowledging each one"
            );
        }
    }

    /// The newest usable idle connection, this thread's first; another
    /// thread's is moved to this one.
    fn checkout(&self) -> Option<Conn> {
        let own = own_shard();
        let conn = (0..SHARDS).find_map(|k| {
            let mut idle = self.idle[(own + k) % SHARDS]
                .lock()
                .unwrap_or_else(PoisonError::into_inner);
            while let Some(mut entry) = idle.pop() {
                if entry.since.elapsed() < IDLE_KEEP && entry.conn.usable_now() {
                    return Some(entry.conn);
                }
            }
            None
        })?;
        if conn.home == own {
            Some(conn)
        } else {
            conn.rehome()
        }
    }

    /// Keeps `conn` for the next request (old ones are dropped by
    /// [`sweep`](Self::sweep) and at checkout, not here, on every request).
    fn checkin(self: &Arc<Self>, conn: Conn) {
        let mut idle = self.idle[conn.home]
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if idle.len() < MAX_IDLE {
            idle.push(Idle {
                conn,
                since: Instant::now(),
            });
        }
        drop(idle);
        if !self.sweeping.swap(true, Ordering::Relaxed)
            && let Ok(runtime) = tokio::runtime::Handle::try_current()
        {
            runtime.spawn(sweep_every(SWEEP_EVERY, Arc::downgrade(self)));
        }
    }

    /// Drops the idle connections that are too old or that the upstream
    /// closed. An idle connection is not read, so without this one the
    /// upstream closed would hold its socket (in CLOSE_WAIT) until the next
    /// request came by.
    pub fn sweep(&self) {
        for shard in &self.idle {
            let mut idle = shard.lock().unwrap_or_else(PoisonError::into_inner);
            idle.retain_mut(|entry| entry.since.elapsed() < IDLE_KEEP && entry.conn.usable());
        }
    }

    /// How many connections wait for reuse.
    pub fn idle_connections(&self) -> usize {
        self.idle
            .iter()
            .map(|shard| shard.lock().unwrap_or_else(PoisonError::into_inner).len())
            .sum()
    }

    /// Sends the rest of a request whose response has ended, in a task of
    /// its own; `conn` is kept for reuse once all of it is written, when
    /// `reusable`. A send that fails, or makes no progress for
    /// `rest_idle`, gives the connection up.
    fn send_rest(self: &Arc<Self>, conn: Conn, sending: Sending, reusable: bool) {
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            tracing::debug!("the rest of the request was not sent: no runtime");
            return;
        };
        runtime.spawn(finish_sending(Arc::clone(self), conn, sending, reusable));
    }

    async fn connect(&self, uri: Uri) -> Result<Conn, H1Error> {
        let timeout = self.connect_timeout;
        let io = tokio::time::timeout(timeout, self.connector.clone().call(uri))
            .await
            // Timed out: the service answers `504`, as for a TLS upstream
            // (`upstream::TimedConnect`).
            .map_err(|_| {
                H1Error::Connect(Box::new(io::Error::new(
                    io::ErrorKind::TimedOut,
                    format!("connect (name lookup and TCP) timed out after {timeout:?}"),
                )))
            })?
            .map_err(|err| H1Error::Connect(err.into()))?;
        Ok(Conn::new(io.into_inner()))
    }
}

/// Frames of a pumped response waiting for the client's side: one, so
/// that nothing is read far ahead of the client.
const PUMPED_FRAMES: usize = 1;

/// A response whose head came before the upstream had all of the request
/// (`body.sending`): from now on a task of its own reads it and sends the
/// rest of the request, and `body` becomes the end of a channel of
/// [`PUMPED_FRAMES`] from that task. The response body drove both, and
/// hyper polls it only while the client takes bytes: a client that sends
/// its whole request before it reads (a blocking one), to an upstream that
/// answers at length before it has read the request, waited on the proxy,
/// which waited on the client, for good. The task sends the rest of the
/// request whether or not the client reads; it ends with the response, or
/// when the client's side is dropped (the connection with it).
fn pump(body: &mut DrivenBody) {
    let Ok(runtime) = tokio::runtime::Handle::try_current() else {
        return;
    };
    let (tx, rx) = mpsc::channel(PUMPED_FRAMES);
    let left = match body.reader {
        Reader::Length(left) => Some(left),
        _ => None,
    };
    let mut driven = DrivenBody {
        reader: std::mem::replace(&mut body.reader, Reader::Pumped(rx, left)),
        conn: body.conn.take(),
        sending: body.sending.take(),
        reusable: body.reusable,
        pool: Arc::clone(&body.pool),
        gate: Gate::new(),
        watch: body.watch.take(),
    };
    // The client's side can go while the pump waits on the upstream alone
    // (the request sent, no frame to hand on): a sender's `closed` hears
    // it, and the connection goes with the task.
    let gone = tx.clone();
    runtime.spawn(async move {
        let mut room = Box::pin(tx.reserve_owned());
        // Room taken and not yet used: kept while the upstream has nothing.
        let mut held = None;
        let pumped = std::future::poll_fn(|cx| {
            loop {
                let permit = match held.take() {
                    Some(permit) => permit,
                    None => match room.as_mut().poll(cx) {
                        Poll::Ready(Ok(permit)) => permit,
                        // The client's side is gone.
                        Poll::Ready(Err(_)) => return Poll::Ready(()),
                        Poll::Pending => {
                            // No room: the request still goes on.
                            driven.send_rest(cx);
                            return Poll::Pending;
                        }
                    },
                };
                match Pin::new(&mut driven).poll_frame(cx) {
                    Poll::Ready(Some(frame)) => {
                        room = Box::pin(permit.send(frame).reserve_owned());
                    }
                    Poll::Ready(None) => return Poll::Ready(()),
                    Poll::Pending => {
                        held = Some(permit);
                        return Poll::Pending;
                    }
                }
            }
        });
        tokio::select! {
            () = pumped => {}
            () = gone.closed() => {}
        }
    });
}

/// Writes the rest of `sending` on `conn` (see [`H1Pool::send_rest`]).
async fn finish_sending(pool: Arc<H1Pool>, mut conn: Conn, mut sending: Sending, reusable: bool) {
    let idle = pool.rest_idle;
    let mut progress = sending.progress();
    let stalled = tokio::time::sleep(idle);
    tokio::pin!(stalled);
    let sent = std::future::poll_fn(|cx| {
        if let Poll::Ready(sent) = sending.poll_send(&mut conn.io, cx) {
            return Poll::Ready(Some(sent));
        }
        if sending.progress() != progress {
            progress = sending.progress();
            let now = tokio::time::Instant::now();
            stalled
                .as_mut()
                .reset(now.checked_add(idle).unwrap_or(now + FAR_FUTURE));
        }
        stalled.as_mut().poll(cx).map(|()| None)
    })
    .await;
    match sent {
        Some(Ok(())) => {
            if reusable && conn.usable() {
                pool.checkin(conn);
            }
        }
        Some(Err(err)) => tracing::debug!("the rest of the request was not sent: {err}"),
        None => tracing::debug!(
            "the rest of the request was not sent: no progress for {idle:?} after its response"
        ),
    }
}

/// Whether `req` may be sent again after a kept connection failed under
/// it: its method is idempotent and it has no body.
fn resendable(req: &Request<ProxyBody>) -> bool {
    req.method().is_idempotent() && req.body().is_end_stream()
}

/// `req` again, with an empty body (see [`resendable`]).
fn copy_of(req: &Request<ProxyBody>) -> Request<ProxyBody> {
    let body = http_body_util::Empty::new()
        .map_err(|never| match never {})
        .boxed();
    let mut copy = Request::new(body);
    *copy.method_mut() = req.method().clone();
    *copy.uri_mut() = req.uri().clone();
    *copy.version_mut() = req.version();
    *copy.headers_mut() = req.headers().clone();
    copy
}

/// Whether `err` is a kept connection's failing before any answer: closed,
/// reset, or not writable (not an answer the proxy could not read).
fn unanswered(err: &H1Error) -> bool {
    matches!(err, H1Error::Closed | H1Error::Read(_) | H1Error::Write(_))
}

/// A deadline that never comes, for a huge idle timeout.
const FAR_FUTURE: Duration = Duration::from_secs(100 * 365 * 24 * 3600);

// Short-lived, moved once: the request inside is the point.
#[allow(clippy::large_enum_variant)]
enum Retry {
    /// The request was never written: here it is back.
    Again(Request<ProxyBody>),
    No(H1Error),
}

/// What an exchange got: the response head, and the rest of the request
/// when the head came before all of it was sent.
struct Answer {
    head: Head,
    sending: Option<Sending>,
}

/// Sends one request on `conn` and reads until the response head has come
/// (interim `1xx` responses skipped). The request body is sent while the
/// head is awaited: an upstream may answer before it has read it all, and
/// the response body then sends the rest (see [`Sending`]).
async fn exchange(conn: &mut Conn, req: Request<ProxyBody>) -> Result<Answer, Retry> {
    // Closed, or holding bytes no request asked for: the request goes
    // back untouched. (The reactor has seen an upstream's close that came
    // while the connection sat idle; one that comes later makes the
    // exchange fail, as with hyper's client.)
    if !std::future::poll_fn(|cx| Poll::Ready(conn.quiet(cx))).await {
        return Err(Retry::Again(req));
    }
    conn.heard = false;
    let (parts, body) = req.into_parts();
    let framing = request_framing(&parts.method, &parts.headers, &body);
    let target = parts.uri.path_and_query().map_or("/", |path| path.as_str());
    let mut head = Vec::with_capacity(512);
    wire::write_head(&parts.method, target, &parts.headers, framing, &mut head);
    let mut sending = Some(Sending::new(head, body, framing));
    // A failed write is reported only when no response head follows: an
    // upstream may answer (and close) before it has read the whole request.
    let mut write_failed = None;
    std::future::poll_fn(|cx| {
        if let Some(send) = sending.as_mut() {
            match send.poll_send(&mut conn.io, cx) {
                Poll::Ready(Ok(())) => sending = None,
                Poll::Ready(Err(err @ H1Error::RequestBody(_))) => {
                    return Poll::Ready(Err(Retry::No(err)));
                }
                Poll::Ready(Err(err)) => {
                    sending = None;
                    write_failed = Some(err);
                }
                Poll::Pending => {}
            }
        }
        match conn.poll_head(&parts.method, cx) {
            Poll::Ready(Ok(mut head)) => {
                // After a failed write the connection carries this
                // response and no other.
                head.keep_alive &= write_failed.is_none();
                Poll::Ready(Ok(Answer {
                    head,
                    sending: sending.take(),
                }))
            }
            Poll::Ready(Err(err)) => {
                Poll::Ready(Err(Retry::No(write_failed.take().unwrap_or(err))))
            }
            Poll::Pending => Poll::Pending,
        }
    })
    .await
}

/// How the request body goes on the wire: as the client framed it when it
/// gave a length, else a known length, else chunked.
fn request_framing(method: &Method, headers: &http::HeaderMap, body: &ProxyBody) -> RequestFraming {
    let given = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|value| value.to_str().ok()?.trim().parse::<u64>().ok());
    if let Some(n) = given {
        return RequestFraming::Length(n);
    }
    if body.is_end_stream() {
        // RFC 9110 §8.6: a request whose method means to send content says
        // it sends none.
        return if matches!(*method, Method::POST | Method::PUT | Method::PATCH) {
            RequestFraming::Length(0)
        } else {
            RequestFraming::Empty
        };
    }
    match body.size_hint().exact() {
        Some(n) => RequestFraming::Length(n),
        None => RequestFraming::Chunked,
    }
}

/// A request on its way out: the bytes not yet written (the head first),
/// and the body they come from. It is polled by the exchange until the
/// response head comes, then by the response body (then, if the response
/// ends first, by a task of its own), until the client's request body has
/// ended and all of it is written (as hyper's client
/// does: the client's server side only sees its request body end when it
/// is read to its end, and until then it does not notice a client that
/// goes away).
struct Sending {
    /// `None` once it ended (and its end was framed into `pending`).
    body: Option<ProxyBody>,
    framing: RequestFraming,
    /// Bytes to write, from `at` on.
    pending: Vec<u8>,
    at: usize,
    /// Body bytes framed so far (against a `content-length`).
    framed: u64,
    /// Bytes written so far, head and framing included.
    written: u64,
    trailers: Option<http::HeaderMap>,
}

impl Sending {
    fn new(head: Vec<u8>, body: ProxyBody, framing: RequestFraming) -> Sending {
        Sending {
            body: Some(body),
            framing,
            pending: head,
            at: 0,
            framed: 0,
            written: 0,
            trailers: None,
        }
    }

    /// Writes what the body has ready, the head with the first of it (one
    /// write for a body the client sent whole, not one per piece):
    /// `Ready(Ok)` once the body has ended and all of it is written. After
    /// an error it is not polled again.
    fn poll_send(&mut self, io: &mut TcpStream, cx: &mut Context<'_>) -> Poll<Result<(), H1Error>> {
        loop {
            let mut waiting = false;
            while self.pending.len() < CONN_BUF_BYTES {
                let Some(body) = self.body.as_mut() else {
                    break;
                };
                match Pin::new(body).poll_frame(cx) {
                    Poll::Pending => {
                        waiting = true;
                        break;
                    }
                    Poll::Ready(None) => self.end()?,
                    Poll::Ready(Some(Err(err))) => {
                        return Poll::Ready(Err(H1Error::RequestBody(err)));
                    }
                    Poll::Ready(Some(Ok(frame))) => self.frame(frame)?,
                }
            }
            while self.at < self.pending.len() {
                let written = ready!(Pin::new(&mut *io).poll_write(cx, &self.pending[self.at..]));
                match written {
                    Ok(0) => {
                        return Poll::Ready(Err(H1Error::Write(io::ErrorKind::WriteZero.into())));
                    }
                    Ok(n) => {
                        self.at += n;
                        self.written += n as u64;
                    }
                    Err(err) => return Poll::Ready(Err(H1Error::Write(err))),
                }
            }
            self.pending.clear();
            self.at = 0;
            if self.body.is_none() {
                return Poll::Ready(Ok(()));
            }
            if waiting {
                return Poll::Pending;
            }
        }
    }

    /// How far it got: body bytes taken from the client, bytes written.
    fn progress(&self) -> (u64, u64) {
        (self.framed, self.written)
    }

    /// Frames one frame of the body into `pending`.
    fn frame(&mut self, frame: Frame<Bytes>) -> Result<(), H1Error> {
        let data = match frame.into_data() {
            Ok(data) => data,
            Err(frame) => {
                // Trailers have a place on the wire only in a chunked body.
                self.trailers = frame.into_trailers().ok();
                return Ok(());
            }
        };
        if data.is_empty() {
            return Ok(());
        }
        self.framed += data.len() as u64;
        match self.framing {
            RequestFraming::Chunked => {
                wire::write_chunk_size(data.len(), &mut self.pending);
                self.pending.extend_from_slice(&data);
                self.pending.extend_from_slice(b"\r\n");
            }
            RequestFraming::Length(n) if self.framed <= n => self.pending.extend_from_slice(&data),
            RequestFraming::Length(_) | RequestFraming::Empty => {
                return Err(H1Error::RequestBody(
                    "the request body is longer than its content-length".into(),
                ));
            }
        }
        Ok(())
    }

    /// The body ended: its end framed into `pending`.
    fn end(&mut self) -> Result<(), H1Error> {
        self.body = None;
        match self.framing {
            RequestFraming::Chunked => {
                self.pending.extend_from_slice(b"0\r\n");
                // Fitted by the service's request body (`fit_trailers`).
                for (name, value) in self.trailers.iter().flatten() {
                    self.pending.extend_from_slice(name.as_str().as_bytes());
                    self.pending.extend_from_slice(b": ");
                    self.pending.extend_from_slice(value.as_bytes());
                    self.pending.extend_from_slice(b"\r\n");
                }
                self.pending.extend_from_slice(b"\r\n");
            }
            RequestFraming::Length(n) if self.framed < n => {
                return Err(H1Error::RequestBody(
                    "the request body ended before its content-length".into(),
                ));
            }
            RequestFraming::Length(_) | RequestFraming::Empty => {}
        }
        Ok(())
    }
}

/// `Host` as hyper-util's client writes it: the port only when it is not
/// HTTP's default.
fn host_value(authority: &Authority) -> HeaderValue {
    let host = authority.host();
    let mut value = String::with_capacity(host.len() + 6);
    value.push_str(host);
    if let Some(port) = authority.port_u16().filter(|&port| port != 80) {
        // Not `format!`: about 1,000 instructions a request more
        // (BENCHMARKS.md, forty-second round).
        value.push(':');
        value.push_str(itoa::Buffer::new().format(port));
    }
    HeaderValue::from_str(&value).unwrap_or_else(|_| HeaderValue::from_static("localhost"))
}

/// `/path?query` of an absolute URI.
fn origin_form(uri: &Uri) -> Uri {
    match uri.path_and_query() {
        Some(path) => Uri::from(path.clone()),
        None => Uri::from_static("/"),
    }
}

/// Where a response body's reader is.
enum Reader {
    /// The response, read by a task of its own ([`pump`]), and how many
    /// bytes of a `content-length` body are still to come through it: at
    /// 0 the body says it is over, as hyper's server, which has written
    /// the length, drops it without another poll (its end, unheard, was
    /// logged as the client's going away).
    Pumped(mpsc::Receiver<Result<Frame<Bytes>, BoxError>>, Option<u64>),
    /// This many bytes of a `content-length` body to come.
    Length(u64),
    Chunked(Chunked),
    /// Until the upstream closes the connection.
    Close,
    /// The body is complete.
    Done,
}

/// A response body that reads its connection's socket when polled, and
/// gives the connection back to the pool at its end.
pub struct DrivenBody {
    reader: Reader,
    /// `None` once back in the pool (or given up).
    conn: Option<Conn>,
    /// The rest of the request, when the response head came first: sent
    /// as the response is read, and after its end by a task of its own
    /// ([`H1Pool::send_rest`]).
    sending: Option<Sending>,
    /// The upstream keeps the connection open after this response.
    reusable: bool,
    pool: Arc<H1Pool>,
    gate: Gate,
    /// While the body is read in delayed-ACK mode.
    watch: Option<PairsWatch>,
}

impl DrivenBody {
    /// At the body's end: a connection still open, idle, and fit for
    /// another request is kept.
    fn release(&mut self) {
        self.reader = Reader::Done;
        let Some(mut conn) = self.conn.take() else {
            return;
        };
        // The upstream answered before it had read all of the request: the
        // rest is still sent, without holding the response back.
        if let Some(sending) = self.sending.take() {
            self.pool.send_rest(conn, sending, self.reusable);
            return;
        }
        if self.reusable && conn.usable() {
            self.pool.checkin(conn);
        }
    }

    /// Sends what it can of the rest of the request. The response goes on
    /// if that fails (the connection is then not reused); a failed request
    /// body is the client's, which is going away.
    fn send_rest(&mut self, cx: &mut Context<'_>) {
        let (Some(send), Some(conn)) = (self.sending.as_mut(), self.conn.as_mut()) else {
            return;
        };
        match send.poll_send(&mut conn.io, cx) {
            Poll::Ready(Ok(())) => self.sending = None,
            Poll::Ready(Err(err)) => {
                tracing::debug!("the rest of the request was not sent: {err}");
                self.reusable = false;
                self.sending = None;
            }
            Poll::Pending => {}
        }
    }

    /// The body ended before its end: the connection is dropped.
    fn fail(&mut self, err: BodyError) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        self.reader = Reader::Done;
        self.conn = None;
        Poll::Ready(Some(Err(Box::new(err))))
    }

    /// The next piece of the body from what was read, if there is one.
    fn take(&mut self) -> Option<Result<Frame<Bytes>, BodyError>> {
        let conn = self.conn.as_mut()?;
        match &mut self.reader {
            Reader::Done | Reader::Pumped(..) => None,
            Reader::Length(left) => {
                if conn.buf.is_empty() {
                    return None;
                }
                let n =
                    usize::try_from(*left).map_or(conn.buf.len(), |left| left.min(conn.buf.len()));
                let data = conn.buf.split_to(n).freeze();
                *left -= n as u64;
                if *left == 0 {
                    self.release();
                }
                Some(Ok(Frame::data(data)))
            }
            Reader::Close => {
                (!conn.buf.is_empty()).then(|| Ok(Frame::data(conn.buf.split().freeze())))
            }
            Reader::Chunked(chunked) => match chunked.decode(&mut conn.buf) {
                Ok(None) => None,
                Ok(Some(Piece::Data(data))) => Some(Ok(Frame::data(data))),
                Ok(Some(Piece::Trailers(trailers))) => {
                    self.release();
                    Some(Ok(Frame::trailers(trailers)))
                }
                Ok(Some(Piece::End)) => {
                    self.release();
                    None
                }
                Err(err) => Some(Err(err.into())),
            },
        }
    }
}

impl Body for DrivenBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = self.get_mut();
        if this.sending.is_some() {
            this.send_rest(cx);
        } else if this.gate.closed(cx) {
            return Poll::Pending;
        }
        if let Reader::Pumped(frames, left) = &mut this.reader {
            if *left == Some(0) {
                return Poll::Ready(None);
            }
            let frame = ready!(frames.poll_recv(cx));
            if let (Some(left), Some(Ok(frame))) = (left.as_mut(), frame.as_ref())
                && let Some(data) = frame.data_ref()
            {
                *left = left.saturating_sub(data.len() as u64);
            }
            return Poll::Ready(frame);
        }
        loop {
            match this.take() {
                Some(Ok(frame)) => return Poll::Ready(Some(Ok(frame))),
                Some(Err(err)) => return this.fail(err),
                None => {}
            }
            let Some(conn) = this.conn.as_mut() else {
                return Poll::Ready(None);
            };
            if matches!(this.reader, Reader::Done) {
                return Poll::Ready(None);
            }
            // While the rest of the request is sent, the socket's write
            // side holds the task's waker: read with it too.
            let filled = if this.sending.is_some() {
                ready!(conn.poll_fill(cx))
            } else {
                ready!(this.gate.poll(cx, |cx| conn.poll_fill(cx)))
            };
            match filled {
                Ok(0) => {
                    if matches!(this.reader, Reader::Close) {
                        // Its end: the upstream may still read the rest
                        // of the request (the connection is not reused).
                        this.reusable = false;
                        this.release();
                        return Poll::Ready(None);
                    }
                    return this.fail(BodyError::Closed);
                }
                Ok(_) => {
                    if let Some(watch) = &mut this.watch
                        && watch.read(conn)
                    {
                        this.watch = None;
                        this.pool.read_without_pairs();
                    }
                }
                Err(err) => return this.fail(BodyError::Read(err)),
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        matches!(self.reader, Reader::Done | Reader::Pumped(_, Some(0)))
    }

    fn size_hint(&self) -> SizeHint {
        match self.reader {
            Reader::Length(n) | Reader::Pumped(_, Some(n)) => SizeHint::with_exact(n),
            Reader::Done => SizeHint::with_exact(0),
            Reader::Chunked(_) | Reader::Close | Reader::Pumped(_, None) => SizeHint::default(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::{BodyExt, Empty};
    use std::net::SocketAddr;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpListener;
    use tokio::runtime;
    use tokio::sync::oneshot;

    /// An upstream's close that the reactor has not seen yet (it runs only
    /// when the task waits) still makes the connection unusable: the
    /// kernel is asked. The reactor's view alone took the connection for
    /// open, and the request written to it failed with a `502`.
    #[tokio::test(flavor = "current_thread")]
    async fn a_close_the_reactor_has_not_seen_makes_a_connection_unusable() {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        let (io, accepted) = tokio::join!(TcpStream::connect(addr), listener.accept());
        let mut conn = Conn::new(io.expect("connect"));
        let (peer, _) = accepted.expect("accept");
        assert!(conn.usable_now(), "open and quiet");
        // The peer closes; nothing here awaits, so the reactor does not run.
        drop(peer);
        std::thread::sleep(Duration::from_millis(50));
        assert!(
            conn.usable(),
            "the reactor's view is stale (else this test shows nothing)"
        );
        assert!(!conn.usable_now(), "the kernel knows of the close");
    }

    /// `Host` keeps the port unless it is HTTP's default, as hyper-util's
    /// client writes it.
    #[test]
    fn host_is_the_authority_without_port_80() {
        for (authority, host) in [
            ("127.0.0.1:8080", "127.0.0.1:8080"),
            ("example.com:80", "example.com"),
            ("example.com", "example.com"),
            ("[::1]:11434", "[::1]:11434"),
            ("h:65535", "h:65535"),
            ("h:0", "h:0"),
        ] {
            let authority: Authority = authority.parse().expect("authority");
            assert_eq!(host_value(&authority), host, "{authority}");
        }
    }

    /// The pool keeps the first authority's `Host` and shares it; any
    /// other authority (or the same in other letters) gets its own.
    #[test]
    fn the_pool_keeps_its_first_hosts_value() {
        let pool = H1Pool::new(Duration::from_secs(1), Duration::from_secs(5));
        let first: Authority = "api.example.com:8080".parse().expect("authority");
        let letters: Authority = "API.example.com:8080".parse().expect("authority");
        let other: Authority = "Example.com:80".parse().expect("authority");
        let a = pool.host_value(&first);
        let b = pool.host_value(&first);
        assert_eq!(a, "api.example.com:8080");
        assert_eq!(b, "api.example.com:8080");
        assert_eq!(
            a.as_bytes().as_ptr(),
            b.as_bytes().as_ptr(),
            "shared, not built again"
        );
        assert_eq!(pool.host_value(&letters), "API.example.com:8080");
        assert_eq!(pool.host_value(&other), "Example.com");
        assert_eq!(pool.host_value(&first), "api.example.com:8080");
    }

    /// Reads up to the end of a request head (a test's requests have no
    /// body): `false` when the connection ended first.
    async fn read_request_head(stream: &mut TcpStream) -> bool {
        let mut seen = Vec::new();
        let mut buf = [0u8; 1024];
        while !seen.windows(4).any(|w| w == b"\r\n\r\n") {
            match stream.read(&mut buf).await {
                Ok(0) | Err(_) => return false,
                Ok(n) => seen.extend_from_slice(&buf[..n]),
            }
        }
        true
    }

    /// An upstream that answers one request on one connection with `ok`
    /// (keep-alive), then closes that connection when `close` is told.
    async fn upstream_once() -> (SocketAddr, oneshot::Sender<()>) {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        let (close, closed) = oneshot::channel::<()>();
        tokio::spawn(async move {
            let Ok((mut stream, _)) = listener.accept().await else {
                return;
            };
            if !read_request_head(&mut stream).await {
                return;
            }
            let reply = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok";
            if stream.write_all(reply).await.is_ok() {
                let _ = closed.await;
            }
        });
        (addr, close)
    }

    fn get(addr: SocketAddr) -> Request<ProxyBody> {
        let body = Empty::new().map_err(|never| match never {}).boxed();
        Request::get(format!("http://{addr}/x"))
            .body(body)
            .expect("request")
    }

    /// A response's body, read whole.
    async fn whole(response: Response<DrivenBody>) -> Bytes {
        let body = response.into_body().collect().await.expect("body");
        body.to_bytes()
    }

    /// One request through `pool`, read whole: it must be `ok`.
    async fn get_ok(pool: &Arc<H1Pool>, addr: SocketAddr) {
        let response = pool.request(get(addr)).await.expect("response");
        assert_eq!(&whole(response).await[..], b"ok");
    }

    /// An upstream that runs `script` on the first connection it accepts
    /// (with `TCP_NODELAY`, so that each write leaves at once).
    async fn upstream_script<F, Fut>(script: F) -> SocketAddr
    where
        F: FnOnce(TcpStream) -> Fut + Send + 'static,
        Fut: std::future::Future<Output = ()> + Send,
    {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        tokio::spawn(async move {
            let Ok((stream, _)) = listener.accept().await else {
                return;
            };
            stream.set_nodelay(true).expect("nodelay");
            script(stream).await;
        });
        addr
    }

    /// A response written a byte at a time, each byte read on its own (the
    /// upstream waits between them): the head's end is found across reads,
    /// and the body comes whole. Its connection is then reused.
    #[tokio::test]
    async fn a_response_that_comes_a_byte_at_a_time_is_read_whole() {
        let addr = upstream_script(|mut stream| async move {
            let reply =
                b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n2\r\nok\r\n0\r\n\r\n";
            for _ in 0..2 {
                if !read_request_head(&mut stream).await {
                    return;
                }
                for byte in reply {
                    if stream.write_all(&[*byte]).await.is_err() {
                        return;
                    }
                    tokio::time::sleep(Duration::from_millis(2)).await;
                }
            }
            let _ = stream.read(&mut [0u8; 1]).await;
        })
        .await;
        let pool = H1Pool::new(Duration::from_secs(1), Duration::from_secs(5));
        for round in ["first", "second, on the same connection"] {
            tokio::time::timeout(Duration::from_secs(10), get_ok(&pool, addr))
                .await
                .unwrap_or_else(|_| panic!("{round} response not read in time"));
            assert_eq!(pool.idle_connections(), 1, "{round}: kept for reuse");
        }
    }

    /// A request of `body`, sent to `addr` by POST.
    fn post(addr: SocketAddr, body: ProxyBody) -> Request<ProxyBody> {
        Request::post(format!("http://{addr}/x"))
            .body(body)
            .expect("request")
    }

    /// Waits until `check` holds, polling every 10 ms, at most 10 s.
    async fn eventually(mut check: impl FnMut() -> bool) -> bool {
        for _ in 0..1000 {
            if check() {
                return true;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        check()
    }

    /// An upstream that answers `202` as soon as it has a request's head,
    /// then reads its 4 MiB body (more than the sockets hold): the rest of
    /// the request is sent once the response has ended, and the connection
    /// then goes back to the pool and carries the next request. (Before,
    /// the rest was dropped with the connection.)
    #[tokio::test]
    async fn the_rest_of_a_request_answered_early_is_sent_and_its_connection_kept() {
        let size = 4 << 20;
        let (got, told) = oneshot::channel::<usize>();
        let addr = upstream_script(move |mut stream| async move {
            let mut seen = Vec::new();
            let mut buf = vec![0u8; 64 * 1024];
            // Up to the next request's head (the body is all `x`), each
            // byte looked at once.
            let (mut from, mut start) = (0, None);
            loop {
                let end = seen[from..]
                    .windows(4)
                    .position(|w| w == b"\r\n\r\n")
                    .map(|at| from + at + 4);
                from = seen.len().saturating_sub(3);
                match (start, end) {
                    (None, Some(end)) => {
                        start = Some(end);
                        from = end;
                        let reply = b"HTTP/1.1 202 Accepted\r\ncontent-length: 0\r\n\r\n";
                        if stream.write_all(reply).await.is_err() {
                            return;
                        }
                        continue;
                    }
                    (Some(_), Some(_)) => break,
                    _ => {}
                }
                match stream.read(&mut buf).await {
                    Ok(0) | Err(_) => break,
                    Ok(n) => seen.extend_from_slice(&buf[..n]),
                }
            }
            let start = start.unwrap_or(seen.len());
            let body = seen[start..].iter().take_while(|&&b| b == b'x').count();
            let _ = got.send(body);
            let reply = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok";
            if stream.write_all(reply).await.is_ok() {
                let _ = stream.read(&mut [0u8; 1]).await;
            }
        })
        .await;
        let pool = H1Pool::new(Duration::from_secs(1), Duration::from_secs(5));
        let body = http_body_util::Full::new(Bytes::from(vec![b'x'; size]))
            .map_err(|never| match never {})
            .boxed();
        let response = pool.request(post(addr, body)).await.expect("response");
        assert_eq!(response.status(), 202);
        assert!(whole(response).await.is_empty());
        assert!(
            eventually(|| pool.idle_connections() == 1).await,
            "kept once the request was sent"
        );
        // The one connection the upstream serves carries the next one.
        tokio::time::timeout(Duration::from_secs(10), get_ok(&pool, addr))
            .await
            .expect("the second request answered on the kept connection");
        assert_eq!(told.await.expect("the upstream counted"), size);
    }

    /// A request body that stalls after its response has ended: its
    /// connection is given up once it made no progress for the idle
    /// timeout (the upstream sees it closed), not held forever.
    #[tokio::test]
    async fn the_rest_of_a_request_that_stalls_is_given_up() {
        /// One frame, then nothing ever.
        struct Stalls(bool);
        impl Body for Stalls {
            type Data = Bytes;
            type Error = BoxError;
            fn poll_frame(
                mut self: Pin<&mut Self>,
                _: &mut Context<'_>,
            ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
                if std::mem::replace(&mut self.0, true) {
                    Poll::Pending
                } else {
                    Poll::Ready(Some(Ok(Frame::data(Bytes::from_static(b"part")))))
                }
            }
        }
        let (closed, seen_closed) = oneshot::channel::<()>();
        let addr = upstream_script(move |mut stream| async move {
            if !read_request_head(&mut stream).await {
                return;
            }
            let reply = b"HTTP/1.1 202 Accepted\r\ncontent-length: 0\r\n\r\n";
            if stream.write_all(reply).await.is_err() {
                return;
            }
            let mut buf = [0u8; 1024];
            while let Ok(1..) = stream.read(&mut buf).await {}
            let _ = closed.send(());
        })
        .await;
        let pool = H1Pool::new(Duration::from_secs(1), Duration::from_millis(200));
        let mut req = post(addr, Stalls(false).boxed());
        req.headers_mut()
            .insert(header::CONTENT_LENGTH, HeaderValue::from_static("100"));
        let response = pool.request(req).await.expect("response");
        assert_eq!(response.status(), 202);
        assert!(whole(response).await.is_empty());
        tokio::time::timeout(Duration::from_secs(10), seen_closed)
            .await
            .expect("the connection given up in time")
            .expect("the upstream saw it closed");
        assert_eq!(pool.idle_connections(), 0);
    }

    /// Every response's body is read in delayed-ACK mode (`TCP_QUICKACK`
    /// off), also on a reused connection whose socket has left that mode,
    /// as the kernel makes it do after its delayed-ACK timer fires. (The
    /// ACKs themselves are counted by the benchmark, with `nstat`: a
    /// socket's own count is not readable without `TCP_INFO`.)
    #[cfg(any(target_os = "linux", target_os = "android"))]
    #[tokio::test]
    async fn every_response_body_is_read_acknowledging_in_pairs() {
        use rustix::net::sockopt::{set_tcp_quickack, tcp_quickack};
        let addr = upstream_script(|mut stream| async move {
            for _ in 0..2 {
                if !read_request_head(&mut stream).await {
                    return;
                }
                let reply = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok";
                if stream.write_all(reply).await.is_err() {
                    return;
                }
            }
            let _ = stream.read(&mut [0u8; 1]).await;
        })
        .await;
        let pool = H1Pool::new(Duration::from_secs(1), Duration::from_secs(5));
        for round in ["first", "second, on the same connection"] {
            let response = pool.request(get(addr)).await.expect("response");
            let io = &response.body().conn.as_ref().expect("a connection").io;
            assert!(
                !tcp_quickack(io).expect("getsockopt"),
                "{round}: quick ACKs"
            );
            // As the kernel does when its delayed-ACK timer fires.
            set_tcp_quickack(io, true).expect("setsockopt");
            assert_eq!(&whole(response).await[..], b"ok");
            assert_eq!(pool.idle_connections(), 1, "{round}: kept for reuse");
        }
    }

    /// An upstream that streams `events` chunks `gap` apart, twice, with
    /// Nagle's algorithm on or off.
    async fn pacing_upstream(nagle: bool, events: usize, gap: Duration) -> SocketAddr {
        upstream_script(move |mut stream| async move {
            if stream.set_nodelay(!nagle).is_err() {
                return;
            }
            for _ in 0..2 {
                if !read_request_head(&mut stream).await {
                    return;
                }
                let head = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n";
                if stream.write_all(head).await.is_err() {
                    return;
                }
                for i in 0..events {
                    tokio::time::sleep(gap).await;
                    let event = format!("data: {i:02}\n\n");
                    let chunk = format!("{:x}\r\n{event}\r\n", event.len());
                    if stream.write_all(chunk.as_bytes()).await.is_err() {
                        return;
                    }
                }
                if stream.write_all(b"0\r\n\r\n").await.is_err() {
                    return;
                }
            }
            let _ = stream.read(&mut [0u8; 1]).await;
        })
        .await
    }

    /// An upstream with Nagle's algorithm on waits for the ACK of each
    /// small segment before it sends the next, and in delayed-ACK mode
    /// that ACK waits for the kernel's timer (40 ms): its first response
    /// shows it (`PairsWatch`), and from then on the pool reads its
    /// responses in the kernel's default mode, where each event goes on
    /// at once. An upstream with `TCP_NODELAY`, streaming fast, keeps the
    /// mode. (Before, every response of the first kept it, and its events
    /// waited up to 35 ms once a response.)
    #[cfg(any(target_os = "linux", target_os = "android"))]
    #[tokio::test]
    async fn an_upstream_that_waits_for_each_ack_is_read_acknowledging_each_segment() {
        let events = 12;
        let expected: Vec<u8> = (0..events)
            .flat_map(|i| format!("data: {i:02}\n\n").into_bytes())
            .collect();
        for (nagle, gap) in [
            (true, Duration::from_millis(5)),
            (false, Duration::from_millis(1)),
        ] {
            let addr = pacing_upstream(nagle, events, gap).await;
            let pool = H1Pool::new(Duration::from_secs(1), Duration::from_secs(5));
            let response = pool.request(get(addr)).await.expect("first response");
            assert_eq!(whole(response).await, expected);
            assert_eq!(pool.pairs.load(Ordering::Relaxed), !nagle, "Nagle {nagle}");
            // The mode asked for, or the kernel's own guess of it (this
            // request followed a response at once) taken back.
            let response = pool.request(get(addr)).await.expect("second response");
            assert_eq!(response.body().watch.is_some(), !nagle, "Nagle {nagle}");
            let io = &response.body().conn.as_ref().expect("a connection").io;
            assert_eq!(
                rustix::net::sockopt::tcp_quickack(io).expect("getsockopt"),
                nagle,
                "Nagle {nagle}: the second response's mode"
            );
            assert_eq!(whole(response).await, expected);
        }
    }

    thread_local! {
        /// Polls of an upstream socket for reading, on this thread.
        pub(super) static SOCKET_POLLS: Cell<u64> = const { Cell::new(0) };
    }

    fn socket_polls() -> u64 {
        SOCKET_POLLS.with(Cell::get)
    }

    /// A body polled as hyper's server polls it: once for a frame, then
    /// twice more before the next event has come. Only the first of those
    /// two polls the socket; the next event wakes the task and is read
    /// whole. Moved to another task mid-stream, the body wakes that task.
    #[tokio::test]
    async fn a_body_reads_its_socket_only_when_woken() {
        let addr = upstream_script(|mut stream| async move {
            if !read_request_head(&mut stream).await {
                return;
            }
            let head = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n";
            if stream.write_all(head).await.is_err() {
                return;
            }
            for event in [
                "1\r\na\r\n",
                "1\r\nb\r\n",
                "1\r\nc\r\n",
                "1\r\nd\r\n",
                "0\r\n\r\n",
            ] {
                tokio::time::sleep(Duration::from_millis(30)).await;
                if stream.write_all(event.as_bytes()).await.is_err() {
                    return;
                }
            }
            let _ = stream.read(&mut [0u8; 1]).await;
        })
        .await;
        let pool = H1Pool::new(Duration::from_secs(1), Duration::from_secs(5));
        let response = pool.request(get(addr)).await.expect("response");
        let mut body = response.into_body();
        // One frame, polled as hyper polls, and the socket polls that the
        // two polls after it took.
        async fn next(body: &mut DrivenBody) -> (Option<Bytes>, u64) {
            let mut after = 0;
            let frame = std::future::poll_fn(|cx| {
                let polled = Pin::new(&mut *body).poll_frame(cx);
                if let Poll::Ready(Some(_)) = polled {
                    let before = socket_polls();
                    for again in ["once", "twice"] {
                        assert!(
                            Pin::new(&mut *body).poll_frame(cx).is_pending(),
                            "polled {again} more: nothing has come"
                        );
                    }
                    after = socket_polls() - before;
                }
                polled
            })
            .await;
            let data = frame.map(|f| f.expect("frame").into_data().expect("data"));
            (data, after)
        }
        let deadline = Duration::from_secs(10);
        let mut seen = Vec::new();
        for _ in 0..2 {
            let (data, polls) = tokio::time::timeout(deadline, next(&mut body))
                .await
                .expect("in time");
            seen.push(data.expect("an event"));
            // The first poll after the frame finds nothing; the second
            // does not look.
            assert_eq!(polls, 1, "socket polls after a frame");
        }
        // The rest, in another task: its waker is the one woken.
        let rest = tokio::spawn(async move {
            let mut rest = Vec::new();
            while let (Some(data), polls) = tokio::time::timeout(deadline, next(&mut body))
                .await
                .expect("in time")
            {
                assert_eq!(polls, 1, "socket polls after a frame, in the other task");
                rest.push(data);
            }
            rest
        });
        seen.extend(rest.await.expect("the other task"));
        assert_eq!(seen, [&b"a"[..], b"b", b"c", b"d"]);
    }

    /// A finished response leaves its connection in the pool; a sweep
    /// keeps it while it is open and drops it once the upstream closed it.
    #[tokio::test]
    async fn a_sweep_drops_only_the_idle_connections_the_upstream_closed() {
        let (addr, close) = upstream_once().await;
        let pool = H1Pool::new(Duration::from_secs(1), Duration::from_secs(5));
        get_ok(&pool, addr).await;
        assert_eq!(pool.idle_connections(), 1, "kept for reuse");
        pool.sweep();
        assert_eq!(pool.idle_connections(), 1, "an open connection stays");

        close.send(()).expect("the upstream waits");
        let deadline = Instant::now() + Duration::from_secs(5);
        while pool.idle_connections() > 0 && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(10)).await;
            pool.sweep();
        }
        assert_eq!(pool.idle_connections(), 0, "the closed one is dropped");
    }

    /// The race a pooled connection can lose: the upstream's close arrives
    /// after the connection was taken as usable and before the request
    /// went out. The exchange gives the request back (to be sent on a new
    /// connection) instead of waiting for a response that cannot come.
    #[tokio::test]
    async fn a_request_on_a_connection_closed_under_it_comes_back_unsent() {
        let (addr, close) = upstream_once().await;
        let pool = H1Pool::new(Duration::from_secs(1), Duration::from_secs(5));
        get_ok(&pool, addr).await;
        let mut conn = pool.idle[own_shard()]
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .pop()
            .expect("an idle connection")
            .conn;
        close.send(()).expect("the upstream waits");
        // Let its FIN arrive; the connection is not polled meanwhile.
        tokio::time::sleep(Duration::from_millis(100)).await;
        let mut req = get(addr);
        *req.uri_mut() = origin_form(req.uri());
        let outcome = tokio::time::timeout(Duration::from_secs(5), exchange(&mut conn, req))
            .await
            .expect("an answer, not a hang");
        assert!(
            matches!(outcome, Err(Retry::Again(_))),
            "the request must come back unsent"
        );
    }

    /// An upstream whose first connection answers one request, then reads
    /// the head of the next, writes `second` of an answer to it and closes
    /// (its idle close crossing that request, when `second` is empty).
    /// Every later connection answers `ok` to each request, or, unless
    /// `later_answer`, closes once it has read one. Counts the connections
    /// it accepted.
    async fn upstream_closing_under_the_second(
        second: &'static [u8],
        later_answer: bool,
    ) -> (SocketAddr, Arc<AtomicUsize>) {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        let accepted = Arc::new(AtomicUsize::new(0));
        let counted = accepted.clone();
        tokio::spawn(async move {
            while let Ok((mut stream, _)) = listener.accept().await {
                let first = counted.fetch_add(1, Ordering::SeqCst) == 0;
                tokio::spawn(async move {
                    let reply = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok";
                    if !first && !later_answer {
                        read_request_head(&mut stream).await;
                        return;
                    }
                    while read_request_head(&mut stream).await {
                        if stream.write_all(reply).await.is_err() {
                            return;
                        }
                        if first && read_request_head(&mut stream).await {
                            let _ = stream.write_all(second).await;
                            return;
                        }
                    }
                });
            }
        });
        (addr, accepted)
    }

    /// What a second request on a kept connection (`request`, made for
    /// the upstream's address) gets when the upstream does as
    /// [`upstream_closing_under_the_second`] says, and how many
    /// connections the upstream accepted.
    async fn second_on_a_kept_connection(
        request: impl FnOnce(SocketAddr) -> Request<ProxyBody>,
        second: &'static [u8],
        later_answer: bool,
    ) -> (Result<Bytes, H1Error>, usize) {
        let (addr, accepted) = upstream_closing_under_the_second(second, later_answer).await;
        let pool = H1Pool::new(Duration::from_secs(1), Duration::from_secs(5));
        get_ok(&pool, addr).await;
        assert_eq!(pool.idle_connections(), 1, "kept for reuse");
        let req = request(addr);
        let outcome = tokio::time::timeout(Duration::from_secs(10), async {
            match pool.request(req).await {
                Ok(response) => Ok(whole(response).await),
                Err(err) => Err(err),
            }
        })
        .await
        .expect("an answer, not a hang");
        (outcome, accepted.load(Ordering::SeqCst))
    }

    /// A `GET` on a kept connection that the upstream closes after the
    /// request went out, before a byte of its answer: sent again on a new
    /// connection (it was a `502`). Not sent again: a `POST`, even without
    /// a body (it may have been acted on); a `GET` that got a byte of an
    /// answer first (an interim `103`, part of a head). And one sent again
    /// whose new connection closes too is not told to try TLS.
    #[tokio::test]
    async fn a_get_on_a_kept_connection_closed_under_it_is_sent_again() {
        let (outcome, accepted) = second_on_a_kept_connection(get, b"", true).await;
        assert_eq!(&outcome.expect("answered on a new connection")[..], b"ok");
        assert_eq!(accepted, 2);

        let empty = Empty::new().map_err(|never| match never {}).boxed();
        let (outcome, accepted) =
            second_on_a_kept_connection(|addr| post(addr, empty), b"", true).await;
        assert!(matches!(outcome, Err(H1Error::Closed)), "POST: {outcome:?}");
        assert_eq!(accepted, 1, "a POST is not sent again");

        for second in [
            &b"HTTP/1.1 103 Early Hints\r\n\r\n"[..],
            b"HTTP/1.1 200 OK\r\n",
        ] {
            let (outcome, accepted) = second_on_a_kept_connection(get, second, true).await;
            assert!(matches!(outcome, Err(H1Error::Closed)), "{outcome:?}");
            let second = String::from_utf8_lossy(second);
            assert_eq!(accepted, 1, "not sent again after {second:?}");
        }

        let (outcome, accepted) = second_on_a_kept_connection(get, b"", false).await;
        assert!(
            matches!(outcome, Err(H1Error::Closed)),
            "not ClosedNew: {outcome:?}"
        );
        assert_eq!(accepted, 2);
    }

    /// Reads from `upstream`'s writing `event` until the whole of it is
    /// in `conn`'s buffer, and takes it off as the body would.
    async fn read_event(conn: &mut Conn, upstream: &mut TcpStream, event: &[u8]) -> Bytes {
        upstream.write_all(event).await.expect("write");
        while conn.buf.len() < event.len() {
            let read = std::future::poll_fn(|cx| conn.poll_fill(cx)).await;
            assert!(read.expect("read") > 0, "the upstream closed");
        }
        conn.buf.split_to(event.len()).freeze()
    }

    /// A paced stream's reads land on the same memory every event: once
    /// what was read before was taken and dropped, the next read goes to
    /// the buffer's start (still in the cache), not after it; while a
    /// piece taken still points into the buffer, the next goes after it.
    #[tokio::test]
    async fn a_read_lands_where_the_last_did_once_that_was_dropped() {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        let (ours, theirs) = tokio::join!(TcpStream::connect(addr), listener.accept());
        let mut conn = Conn::new(ours.expect("connect"));
        let mut upstream = theirs.expect("accept").0;
        let event = b"data: {\"choices\":[{\"delta\":{\"content\":\"hi\"}}]}\n\n";

        let first = read_event(&mut conn, &mut upstream, event).await;
        let start = first.as_ptr();
        let held = read_event(&mut conn, &mut upstream, event).await;
        assert_eq!(
            held.as_ptr(),
            start.wrapping_add(event.len()),
            "after the held one"
        );
        drop((first, held));
        for _ in 0..20 {
            let piece = read_event(&mut conn, &mut upstream, event).await;
            assert_eq!(&piece[..], &event[..]);
            assert_eq!(piece.as_ptr(), start, "at the start again");
        }
    }

    /// An upstream that numbers its connections from 0 and answers every
    /// request (keep-alive) with the number of the connection it came on.
    async fn numbering_upstream() -> SocketAddr {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        tokio::spawn(async move {
            for number in 0usize.. {
                let Ok((mut stream, _)) = listener.accept().await else {
                    return;
                };
                tokio::spawn(async move {
                    let mut seen = Vec::new();
                    let mut buf = [0u8; 1024];
                    loop {
                        while let Some(end) = seen.windows(4).position(|w| w == b"\r\n\r\n") {
                            seen.drain(..end + 4);
                            let body = number.to_string();
                            let reply = format!(
                                "HTTP/1.1 200 OK\r\ncontent-length: {}\r\n\r\n{body}",
                                body.len()
                            );
                            if stream.write_all(reply.as_bytes()).await.is_err() {
                                return;
                            }
                        }
                        match stream.read(&mut buf).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => seen.extend_from_slice(&buf[..n]),
                        }
                    }
                });
            }
        });
        addr
    }

    /// A thread takes back the idle connection it made, not one another
    /// thread checked in after it (whose socket that thread's reactor
    /// watches), and takes another thread's only when it has none; that
    /// one then belongs to the thread that took it and goes back to its
    /// list.
    #[tokio::test]
    async fn an_idle_connection_goes_back_to_the_thread_that_made_it() {
        let addr = numbering_upstream().await;
        let pool = H1Pool::new(Duration::from_secs(1), Duration::from_secs(5));
        let workers =
            super::super::server::Workers::start(std::num::NonZeroUsize::new(2).expect("2 > 0"))
                .expect("workers");
        let [first, second] = workers.handles() else {
            panic!("two workers");
        };
        // On `on`, one response's head; its connection stays taken until
        // `number` reads the body (the number of the connection it came
        // on), on the same thread.
        let head = async |on: &tokio::runtime::Handle| {
            let pool = Arc::clone(&pool);
            let response =
                on.spawn(async move { pool.request(get(addr)).await.expect("response") });
            response.await.expect("no panic")
        };
        let number = async |on: &tokio::runtime::Handle, response: Response<DrivenBody>| {
            let read = on.spawn(async move {
                String::from_utf8(whole(response).await.to_vec()).expect("a number")
            });
            read.await.expect("no panic")
        };
        let on_first = head(first).await;
        let on_second = head(second).await;
        assert_eq!(number(first, on_first).await, "0");
        assert_eq!(number(second, on_second).await, "1");
        assert_eq!(pool.idle_connections(), 2);

        // The second thread's connection was checked in last.
        assert_eq!(
            number(first, head(first).await).await,
            "0",
            "the first thread's own"
        );
        assert_eq!(
            number(second, head(second).await).await,
            "1",
            "the second thread's own"
        );

        // With no idle connection of its own, a thread takes another's.
        let own = head(first).await;
        let other = head(first).await;
        assert_eq!(number(first, own).await, "0");
        assert_eq!(
            number(first, other).await,
            "1",
            "the second thread's, the first's being taken"
        );
        assert_eq!(pool.idle_connections(), 2, "both kept");
        // Both went back to the first thread's list, the taken one last:
        // the first thread now takes both without taking the second's.
        let both = (head(first).await, head(first).await);
        assert_eq!(
            (number(first, both.0).await, number(first, both.1).await),
            ("1".to_owned(), "0".to_owned()),
            "the first thread's list holds both, newest first",
        );
        // The second thread, with none of its own, takes the first's newest
        // (`0`, checked in last), which then goes back to the second's list.
        assert_eq!(number(second, head(second).await).await, "0");
        assert_eq!(
            number(first, head(first).await).await,
            "1",
            "the first thread's list holds only the other one"
        );
        assert_eq!(
            number(second, head(second).await).await,
            "0",
            "the second thread's own now"
        );
        assert_eq!(pool.idle_connections(), 2, "no new connection made");
        drop(workers);
    }

    /// A connection taken from another thread's list is woken on the thread
    /// that took it: here the thread that made it stops driving its runtime
    /// (whose reactor still holds the socket, unpolled), and the other
    /// thread's request on that connection still gets its whole response,
    /// on the same connection. Left on the first reactor, the response
    /// would never be read.
    #[test]
    fn a_connection_taken_from_another_thread_is_woken_where_it_is_used() {
        let upstream = runtime::Runtime::new().expect("upstream runtime");
        let addr = upstream.block_on(numbering_upstream());
        let pool = H1Pool::new(Duration::from_secs(1), Duration::from_secs(5));
        let current = || {
            runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("runtime")
        };
        async fn in_time(
            response: impl Future<Output = Response<DrivenBody>>,
        ) -> Result<String, tokio::time::error::Elapsed> {
            tokio::time::timeout(Duration::from_secs(5), async move {
                let response = response.await;
                String::from_utf8(whole(response).await.to_vec()).expect("a number")
            })
            .await
        }

        // The first thread makes the connection, then its runtime is
        // kept but no longer driven.
        let made = {
            let pool = Arc::clone(&pool);
            std::thread::spawn(move || {
                pin_shard(0);
                let runtime = current();
                let number = runtime.block_on(in_time(async move {
                    pool.request(get(addr)).await.expect("response")
                }));
                (runtime, number)
            })
        };
        let (stopped, number) = made.join().expect("the first thread");
        assert_eq!(number.expect("in time"), "0");
        assert_eq!(pool.idle_connections(), 1);

        let taken = {
            let pool = Arc::clone(&pool);
            std::thread::spawn(move || {
                pin_shard(1);
                current().block_on(in_time(async move {
                    pool.request(get(addr)).await.expect("response")
                }))
            })
        };
        let number = taken.join().expect("the second thread");
        assert_eq!(
            number.expect("the response comes while the first runtime sleeps"),
            "0",
            "the first thread's connection"
        );
        assert_eq!(pool.idle_connections(), 1);
        drop(stopped);
    }
}
