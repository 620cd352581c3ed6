//! The accept loops: one task per connection, HTTP/1.1 and HTTP/2 (cleartext,
//! negotiated per connection) from the client, and graceful shutdown (as in
//! hyper-util's `examples/server_graceful.rs`, with a cheaper watch: see
//! `Drain`): when `shutdown` resolves the listener closes, open
//! connections finish their responses, and after `grace` whatever is left
//! is dropped.
//!
//! `serve` has [`Workers`] accept and serve the connections: one thread
//! per CPU, each running a current-thread runtime with an accept loop of
//! its own on the shared listening socket, as nginx runs one worker process
//! per CPU; a new connection goes to a worker with the fewest open ones
//! (`accept_loop`). A connection, the `http://` upstream connection it
//! takes (see [`H1Pool`](super::h1::H1Pool)'s per-thread idle lists) and its
//! timers stay on one thread, so an event that arrives wakes no other
//! thread. (An `https://` upstream's connections belong to hyper-util's
//! pooled client, shared by all workers: each runs as a task on the worker
//! that opened it, and its streams may be read from the others.) The
//! multi-thread runtime woke a second worker for about 0.6 events in 1, and
//! that cost a quarter of `serve`'s CPU per paced event (BENCHMARKS.md,
//! "Fifth round"). `serve` runs as `SCHED_BATCH` on Linux with glibc
//! ([`Sched`]).

use std::convert::Infallible;
use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::num::NonZeroUsize;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::task::{Context, Poll};
use std::thread;
use std::time::Duration;

use http::{Request, Response};
use hyper::body::Incoming;

use http_body_util::combinators::BoxBody;
use hyper::server::conn::{http1, http2};
use hyper::service::{Service, service_fn};
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulConnection;
use tokio::net::{TcpListener, TcpStream};
use tokio::runtime::{self, Handle};
use tokio::sync::{Notify, oneshot, watch};
use tokio::task::JoinSet;

use super::gate::{GatedRead, SocketFull};
use super::h1::CONN_BUF_BYTES;
use super::upstream::ProxyBody;

/// How [`serve`] treats its connections, beside the handler.
pub struct ServeOptions {
    /// How long open streams may go on once the server drains.
    pub grace: Duration,
    /// See [`HEAD_READ_TIMEOUT`].
    pub head_timeout: Duration,
    /// How long a client may leave the bytes sent to it waiting.
    pub client_timeout: Duration,
    /// Told of each request head that HTTP/1.1's parser refused and
    /// answered itself (no handler sees such a request).
    pub refused: Box<dyn Fn(RefusedHead<'_>) + Send + Sync>,
}

/// A request head that hyper's HTTP/1.1 parser refused, and answered with
/// `status` and no body, before any handler saw it: a malformed request
/// line or header field (`400`), a head larger than the connection's
/// buffer (`431`). Its connection is closed after the answer.
#[derive(Debug, Clone, Copy)]
pub struct RefusedHead<'a> {
    pub peer: SocketAddr,
    pub status: http::StatusCode,
    /// hyper's words for what was wrong.
    pub reason: &'a hyper::Error,
}

/// The client a request came from: its address, and whether its
/// connection's last write found the socket full.
#[derive(Debug, Clone)]
pub struct Peer {
    pub addr: SocketAddr,
    pub socket_full: SocketFull,
}

/// How long a client has to send its first bytes, from the connection's
/// start (the first read, which tells HTTP/2 from HTTP/1.1), and then a
/// whole HTTP/1.1 request head, from those bytes or from the end of its
/// last response (hyper's header-read timeout, once it is given a timer):
/// a connection that sends nothing, or half a head, is closed then, rather
/// than holding a task and a descriptor for ever. (The two add up: a head
/// begun just before the first deadline has another 30 s.)
pub const HEAD_READ_TIMEOUT: Duration = Duration::from_secs(30);

/// Serves `handler` on `listener` until `shutdown` resolves, then drains.
/// The handler never fails: errors are responses. Each of `workers`
/// accepts its own connections from the listener (see `accept_loop`), or
/// the current runtime does when there are none. A client connection
/// gets `head_timeout` (see [`HEAD_READ_TIMEOUT`]) for each request head,
/// and is closed by the kernel once bytes sent to it have waited
/// `client_timeout` for its window to open (it takes none of them:
/// `TCP_USER_TIMEOUT`; see `serve`'s body), or over HTTP/2 once a
/// response has waited as long for its flow-control window (`held_for`).
pub async fn serve<H, F>(
    listener: TcpListener,
    handler: H,
    shutdown: impl Future<Output = ()>,
    options: ServeOptions,
    workers: &[Handle],
) where
    H: Fn(Request<Incoming>, Peer) -> F + Clone + Send + Sync + 'static,
    F: Future<Output = Response<ProxyBody>> + Send + 'static,
{
    let ServeOptions {
        grace,
        head_timeout,
        client_timeout,
        refused,
    } = options;
    let mut http1 = http1::Builder::new();
    // A head that does not come whole in time closes the connection, as
    // does a keep-alive connection idle that long (hyper's timer runs
    // from the moment it waits for a head). hyper sets the timer once a
    // head and does nothing with it per event of a response; but while a
    // connection of a worker waits for a head, its pending timer puts
    // that worker's parks on tokio's timed path (a clock read and a
    // timeout each): about 145 instructions a paced event, 1.7 %, in
    // `scripts/bench/callgrind_serve.sh`'s drive (TESTING.md).
    http1.timer(TokioTimer::new());
    http1.header_read_timeout(head_timeout);
    // hyper queues a response's frames up to its buffer size before it
    // stops polling the body. Its default (about 400 KiB) let each slow
    // client hold that much of coalesced output; 64 KiB keeps a slow
    // stream's memory near one coalesced write.
    http1.max_buf_size(CONN_BUF_BYTES);
    // Each frame copied into hyper's write buffer, written with one
    // `write`, rather than queued for a `writev` with its chunk-size line
    // and CRLF as pieces of their own: hyper's queue (a `VecDeque`, its
    // length summed at every `can_buffer`, its `IoSlice`s built and
    // advanced per write) cost about 500 instructions a paced event, the
    // copy of an event a few dozen (BENCHMARKS.md, twenty-sixth round).
    // The buffer keeps the most it held at once for the connection's life:
    // one write's size, or for a client that reads slowly up to about
    // twice `CONN_BUF_BYTES` (hyper buffers another frame, of up to 64 KiB,
    // while it holds less than `max_buf_size`); our pieces go back to
    // their `OutBuf` as soon as they are copied.
    http1.writev(false);
    let mut http2 = http2::Builder::new(TokioExecutor::new());
    // A request head as large over HTTP/2 as over HTTP/1.1 (where the
    // buffer's size bounds it): h2's default is 16 KiB.
    http2.max_header_list_size(u32::try_from(CONN_BUF_BYTES).unwrap_or(u32::MAX));
    let listener = match listener.into_std() {
        Ok(listener) => listener,
        Err(err) => {
            tracing::error!("cannot share the listening socket: {err}");
            return;
        }
    };
    // Events are written as they come, never held for Nagle's algorithm.
    // Set on the listening socket, the option is each accepted
    // connection's from its start (Linux copies the listener's options
    // into it), which spares a `setsockopt` a connection; `accept_loop`
    // checks its first connection and sets it on each if not.
    let _ = rustix::net::sockopt::set_tcp_nodelay(&listener, true);
    // A client that stops reading while a response has bytes for it shuts
    // its TCP window: nothing else bounds it (hyper then polls neither the
    // response body nor its idle timer), so the stream, its upstream
    // request and its session were held until it read again. With
    // TCP_USER_TIMEOUT the kernel closes a connection whose bytes have
    // waited this long, unacknowledged or behind a shut window, and the
    // connection's next write fails. A client that reads opens its window
    // and is left alone, if it frees room fast enough: Linux reopens a
    // shut window once a sixteenth of the receive buffer is free, so a
    // client reading less than that within the timeout is cut. (A timer
    // of our own on writes that found the socket full would cut more:
    // Linux takes a third of a full send buffer, 1.3 MB on loopback,
    // before it reports room.) Set
    // on the listening socket, whose options an accepted connection takes
    // (checked on the first, as for TCP_NODELAY). Linux only.
    #[cfg(any(target_os = "linux", target_os = "android"))]
    let _ = rustix::net::sockopt::set_tcp_user_timeout(&listener, user_timeout_ms(client_timeout));
    let graceful = Drain::new();
    let (phase, phase_rx) = watch::channel(Phase::Accepting);
    let loads = Arc::new(Loads::new(workers.len().max(1)));
    let shared = Arc::new(Shared {
        handler,
        http1,
        http2,
        head_timeout,
        client_timeout,
        refused,
        graceful: graceful.clone(),
        loads,
    });
    // One accept loop per runtime, each with its own descriptor of the
    // listening socket, registered with that runtime's reactor.
    let mut loops = JoinSet::new();
    for me in 0..workers.len().max(1) {
        let listener = match listener.try_clone() {
            Ok(listener) => listener,
            Err(err) => {
                tracing::error!("cannot share the listening socket: {err}");
                shared.loads.retire(me);
                continue;
            }
        };
        let run = accept_loop(me, listener, Arc::clone(&shared), phase_rx.clone());
        match workers.get(me) {
            Some(worker) => loops.spawn_on(run, worker),
            None => loops.spawn(run),
        };
    }
    // The socket closes once every loop has dropped its descriptor too.
    drop(listener);
    drop(phase_rx);
    tokio::pin!(shutdown);
    tokio::select! {
        () = &mut shutdown => {}
        // Every loop ended early (a descriptor it could not register):
        // nothing accepts any more.
        () = async { while loops.join_next().await.is_some() {} } => {
            tracing::error!("no worker accepts connections any more");
        }
    }
    let _ = phase.send(Phase::Draining);
    tracing::info!("shutting down: waiting up to {grace:?} for open streams");
    tokio::select! {
        () = graceful.shutdown() => tracing::info!("all connections closed"),
        () = tokio::time::sleep(grace) => tracing::warn!("grace period over: closing open streams"),
    }
    let _ = phase.send(Phase::Closing);
    while loops.join_next().await.is_some() {}
}

/// Where the server is in its life, as its accept loops see it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    Accepting,
    /// No new connections; open ones finish their responses.
    Draining,
    /// The grace period is over: what is still open is dropped.
    Closing,
}

/// What every accept loop shares.
struct Shared<H> {
    handler: H,
    http1: http1::Builder,
    http2: http2::Builder<TokioExecutor>,
    /// The deadline of the first read (hyper's `http1` has it for the
    /// heads after).
    head_timeout: Duration,
    /// How long a client may leave the bytes sent to it waiting
    /// (`TCP_USER_TIMEOUT`).
    client_timeout: Duration,
    /// See [`ServeOptions::refused`].
    refused: Box<dyn Fn(RefusedHead<'_>) + Send + Sync>,
    graceful: Drain,
    loads: Arc<Loads>,
}

/// The open connections of each accept loop, to keep the loops even.
struct Loads {
    open: Box<[AtomicUsize]>,
    /// One per loop, told when a change may let that loop accept again:
    /// its own count fell, or another's rose.
    changed: Box<[Notify]>,
}

/// The count of a loop that cannot accept ([`Loads::retire`]): never the
/// least, so the others do not wait for it.
const RETIRED: usize = usize::MAX / 2;

impl Loads {
    fn new(loops: usize) -> Loads {
        Loads {
            open: (0..loops).map(|_| AtomicUsize::new(0)).collect(),
            changed: (0..loops).map(|_| Notify::new()).collect(),
        }
    }

    /// Whether loop `me` has no more open connections than any other: the
    /// least busy loops accept, and whichever of them gets to a connection
    /// first serves it.
    fn may_accept(&self, me: usize) -> bool {
        let Some(mine) = self.open.get(me).map(|n| n.load(Ordering::Relaxed)) else {
            return true;
        };
        self.open.iter().all(|n| mine <= n.load(Ordering::Relaxed))
    }

    /// Counts a connection as loop `me`'s while the guard lives.
    fn open(self: &Arc<Self>, me: usize) -> OpenConnection {
        self.rise(me, 1);
        OpenConnection {
            loads: Arc::clone(self),
            me,
        }
    }

    /// Loop `me` accepts no more (its descriptor could not be set up): the
    /// others stop waiting for it to catch up.
    fn retire(&self, me: usize) {
        self.rise(me, RETIRED);
    }

    /// Another loop may now be among the least busy: it looks again.
    fn rise(&self, me: usize, by: usize) {
        if let Some(n) = self.open.get(me) {
            n.fetch_add(by, Ordering::Relaxed);
        }
        for (i, changed) in self.changed.iter().enumerate() {
            if i != me {
                changed.notify_waiters();
            }
        }
    }

    /// Loop `me`'s count fell: it may be among the least busy again.
    fn fall(&self, me: usize) {
        if let Some(n) = self.open.get(me) {
            n.fetch_sub(1, Ordering::Relaxed);
        }
        if let Some(changed) = self.changed.get(me) {
            changed.notify_waiters();
        }
    }
}

/// One open connection of a loop ([`Loads::open`]).
struct OpenConnection {
    loads: Arc<Loads>,
    me: usize,
}

impl Drop for OpenConnection {
    fn drop(&mut self) {
        self.loads.fall(self.me);
    }
}

/// How long an accept loop waits after a failed accept (out of file
/// descriptors, say) before it tries again.
const ACCEPT_RETRY: Duration = Duration::from_millis(50);

/// A failed accept is warned of at most once in this long per loop: out
/// of descriptors, each loop retried every 50 ms with a warning each time,
/// 40 lines a second on two workers.
const ACCEPT_WARN_EVERY: Duration = Duration::from_secs(10);

/// When an accept loop's failures are said ([`ACCEPT_WARN_EVERY`]). A
/// success in between changes nothing: with descriptors short, accepts
/// fail and succeed in turn as connections close, and a warning after
/// each success would be the flood again. Failures held back when they
/// stop are not said: the warnings stopping says it.
#[derive(Debug, Default)]
struct AcceptFailures {
    /// When the last warning was given.
    warned: Option<std::time::Instant>,
    /// Failures since then, not said.
    held: u64,
}

impl AcceptFailures {
    /// An accept failed at `now`: `Some(held)` to warn of it, with the
    /// failures held back since the last warning; `None` to stay quiet.
    fn failed(&mut self, now: std::time::Instant) -> Option<u64> {
        match self.warned {
            Some(warned) if now.saturating_duration_since(warned) < ACCEPT_WARN_EVERY => {
                self.held += 1;
                None
            }
            _ => {
                self.warned = Some(now);
                Some(std::mem::take(&mut self.held))
            }
        }
    }
}

/// Accepts connections on this runtime and serves them here, until the
/// server drains; then waits for them to finish, or drops them once the
/// grace period is over.
///
/// Every runtime accepts from the listening socket for itself, as each of
/// nginx's workers does: a connection is served by the runtime that
/// accepted it, with no hand-off to another thread. A hand-off put one
/// more wake-up on the way to a stream's first byte, and a thread woken on
/// a CPU that runs another process may wait out that process's time slice
/// (about 2 ms here): with other processes starting now and then, a fourth
/// of the streams at C=1 had their first byte after more than 1 ms, and
/// one in twenty without the hand-off; on a quiet machine the median went
/// from 637 to 544 µs (BENCHMARKS.md, thirty-second round).
///
/// A new connection wakes every loop that waits for one, and the first to
/// accept it serves it; a loop with more open connections than another
/// leaves the next ones to the others until it has no more
/// ([`Loads::may_accept`]), so the workers stay as even as when
/// connections were dealt in turn (a worker with more streams adds latency
/// to each of them). A loop already waiting for a connection when another's
/// count falls may still take it: the loops stay within one connection of
/// each other.
async fn accept_loop<H, F>(
    me: usize,
    listener: std::net::TcpListener,
    shared: Arc<Shared<H>>,
    mut phase: watch::Receiver<Phase>,
) where
    H: Fn(Request<Incoming>, Peer) -> F + Clone + Send + Sync + 'static,
    F: Future<Output = Response<ProxyBody>> + Send + 'static,
{
    let listener = match TcpListener::from_std(listener) {
        Ok(listener) => listener,
        Err(err) => {
            tracing::error!("a worker cannot accept connections: {err}");
            shared.loads.retire(me);
            return;
        }
    };
    // Held while this loop may still accept: the drain waits for it too,
    // so a connection accepted as the server stops is drained, not
    // dropped at the end of the grace period.
    let accepting = shared.graceful.hold();
    // The connection tasks, so that what outlives the grace period can be
    // stopped (the drain only asks them to finish).
    let mut connections = JoinSet::new();
    // Whether accepted connections come with TCP_NODELAY and
    // TCP_USER_TIMEOUT (see `serve`): asked of the first one.
    let mut nodelay_inherited = None;
    #[cfg(any(target_os = "linux", target_os = "android"))]
    let mut user_timeout_inherited = None;
    let mut failures = AcceptFailures::default();
    while *phase.borrow_and_update() == Phase::Accepting {
        tokio::select! {
            accepted = accept_when_even(&listener, &shared.loads, me) => {
                let (stream, peer) = match accepted {
                    Ok(accepted) => accepted,
                    Err(err) => {
                        // Out of file descriptors and the like: wait instead
                        // of spinning; the listener itself stays usable.
                        match failures.failed(std::time::Instant::now()) {
                            Some(0) => tracing::warn!(
                                "accept failed: {err}; retrying every {} ms, said at most \
                                 once every {} s",
                                ACCEPT_RETRY.as_millis(),
                                ACCEPT_WARN_EVERY.as_secs()
                            ),
                            Some(held) => tracing::warn!(
                                "accept failed: {err} (and {held} times since the last warning)"
                            ),
                            None => {}
                        }
                        tokio::select! {
                            () = tokio::time::sleep(ACCEPT_RETRY) => {}
                            // Checked by the loop's condition.
                            _ = phase.changed() => {}
                        }
                        continue;
                    }
                };
                if !*nodelay_inherited.get_or_insert_with(|| stream.nodelay().unwrap_or(false)) {
                    let _ = stream.set_nodelay(true);
                }
                #[cfg(any(target_os = "linux", target_os = "android"))]
                {
                    let wanted = user_timeout_ms(shared.client_timeout);
                    let inherited = user_timeout_inherited.get_or_insert_with(|| {
                        rustix::net::sockopt::tcp_user_timeout(&stream).is_ok_and(|ms| ms == wanted)
                    });
                    if !*inherited {
                        let _ = rustix::net::sockopt::set_tcp_user_timeout(&stream, wanted);
                    }
                }
                let open = shared.loads.open(me);
                let watcher = shared.graceful.watcher();
                let shared = Arc::clone(&shared);
                connections.spawn(async move {
                    // Boxed: the connection's future (3 KiB) is moved
                    // into the task, its cell and out again several times
                    // as tokio spawns and runs it; a pointer is moved
                    // instead. 2,380 instructions a stream fewer
                    // (BENCHMARKS.md, fifth session after the fiftieth round).
                    let connection = Box::pin(serve_connection(stream, peer, &shared, watcher));
                    if let Err(err) = connection.await {
                        if let Some((status, reason)) = answered_by_the_parser(&*err) {
                            (shared.refused)(RefusedHead { peer, status, reason });
                        } else if timed_out(&*err) {
                            // Its streams' log lines say `cancelled`: this
                            // says why.
                            tracing::info!(
                                %peer,
                                "connection closed: the client took none of the bytes sent to \
                                 it for {:?} (--client-timeout)",
                                shared.client_timeout
                            );
                        } else {
                            tracing::debug!(%peer, "connection ended: {err}");
                        }
                    }
                    drop(open);
                });
                // Reap finished connections so the set stays as small as
                // the number of open ones.
                while connections.try_join_next().is_some() {}
            }
            changed = phase.changed() => {
                if changed.is_err() {
                    // `serve` is gone without a word: nothing will drain.
                    connections.shutdown().await;
                    return;
                }
            }
        }
    }
    drop(listener);
    drop(accepting);
    loop {
        tokio::select! {
            joined = connections.join_next() => {
                if joined.is_none() {
                    return;
                }
            }
            // Err: the server is gone; drop what is left all the same.
            _ = async { phase.wait_for(|p| *p == Phase::Closing).await.map(|_| ()) } => {
                connections.shutdown().await;
                return;
            }
        }
    }
}

/// The HTTP/2 client preface (RFC 9113, section 3.4): a connection that
/// starts with it speaks HTTP/2 without TLS ("prior knowledge", h2c).
pub(super) const H2_PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

/// Serves one connection: HTTP/2 if it starts with the preface, HTTP/1.1
/// otherwise, as hyper-util's `auto` server decides. Unlike that server,
/// the first read takes what has arrived, not the preface's 24 bytes
/// alone, and hyper reads it again from [`GatedRead`]: one system call a
/// connection fewer.
async fn serve_connection<H, F>(
    stream: TcpStream,
    peer: SocketAddr,
    shared: &Shared<H>,
    mut watcher: DrainWatcher,
) -> Result<(), Box<dyn std::error::Error + Send + Sync>>
where
    H: Fn(Request<Incoming>, Peer) -> F + Clone + Send + Sync + 'static,
    F: Future<Output = Response<ProxyBody>> + Send + 'static,
{
    let mut io = GatedRead::new(stream);
    let h2 = tokio::select! {
        // The read first: a request that came with its connection is
        // taken without the deadline's timer being set.
        biased;
        read = io.read_first(H2_PREFACE) => read?,
        // A connection that has sent nothing when the server drains is
        // closed, as hyper closes an idle one.
        () = watcher.draining() => return Ok(()),
        () = tokio::time::sleep(shared.head_timeout) => {
            return Err(format!(
                "no request within {:?} of the connection's start",
                shared.head_timeout
            )
            .into());
        }
    };
    let handler = shared.handler.clone();
    let socket_full = io.socket_full().clone();
    let service = service_fn(move |req| {
        let response = handler(
            req,
            Peer {
                addr: peer,
                socket_full: socket_full.clone(),
            },
        );
        async move { Ok::<_, Infallible>(response.await) }
    });
    if h2 {
        // HTTP/2 has no head deadline in hyper: a connection with no
        // request open for `head_timeout` is told to close (a GOAWAY, and
        // a PING whose answer confirms it), as hyper closes an idle
        // HTTP/1.1 one; one still open, idle, as long again (a client
        // that does not answer) is dropped.
        let limit = shared.head_timeout;
        let (open, quiet) = watch::channel(0usize);
        let dead = open.subscribe();
        let open_now = open.subscribe();
        let open = Arc::new(open);
        let sends = Arc::new(H2Sends::default());
        let bodies = Arc::clone(&sends);
        let service = service_fn(move |req| {
            let held = StreamOpen::new(&open);
            let sends = Arc::clone(&bodies);
            let response = service.call(req);
            async move {
                let response = response.await?;
                Ok::<_, Infallible>(response.map(|body| {
                    BoxBody::new(H2Body {
                        inner: body,
                        _open: held,
                        sends,
                        taken: false,
                    })
                }))
            }
        });
        let conn = shared.http2.serve_connection(TokioIo::new(io), service);
        tokio::select! {
            done = watcher.watch(conn, quiet_for(quiet, limit)) => done?,
            () = quiet_for(dead, 2 * limit) => {
                return Err(format!(
                    "no request on the HTTP/2 connection within {:?}, nor its close after a GOAWAY",
                    2 * limit
                )
                .into());
            }
            // The kernel's `TCP_USER_TIMEOUT` sees a shut TCP window, not
            // a shut HTTP/2 one: a client whose connection reads its
            // socket but not a response is caught here, and reported
            // alike (`timed_out`).
            () = held_for(&sends, &open_now, shared.client_timeout) => {
                return Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    "a response's bytes waited behind the client's HTTP/2 flow-control window",
                )
                .into());
            }
        }
    } else {
        let conn = shared.http1.serve_connection(TokioIo::new(io), service);
        watcher.watch(conn, std::future::pending()).await?;
    }
    Ok(())
}

/// Whether a connection ended because the kernel gave up on it
/// (`ETIMEDOUT`: its `TCP_USER_TIMEOUT`), in hyper's chain: not beneath an
/// error of a response body (hyper's "user" errors), which is the
/// upstream's (its socket's own `ETIMEDOUT`).
fn timed_out(err: &(dyn std::error::Error + 'static)) -> bool {
    for err in std::iter::successors(Some(err), |err| err.source()) {
        if err
            .downcast_ref::<hyper::Error>()
            .is_some_and(hyper::Error::is_user)
        {
            return false;
        }
        if err
            .downcast_ref::<std::io::Error>()
            .is_some_and(|io| io.kind() == std::io::ErrorKind::TimedOut)
        {
            return true;
        }
    }
    false
}

/// The answer hyper's HTTP/1.1 server wrote itself for a request head its
/// parser refused, found in the chain of the connection's error `err`:
/// `400` for a malformed method, URI, version or header field, `431` for
/// a head larger than the connection's buffer, `414` for a URI too long
/// (hyper's `on_error`, in `proto/h1/role.rs`). hyper's error tells only
/// "too large" apart, so its own words tell the URI from the head, and its
/// internal error and the HTTP/2 preface (no answer written) from the rest.
fn answered_by_the_parser<'e>(
    err: &'e (dyn std::error::Error + 'static),
) -> Option<(http::StatusCode, &'e hyper::Error)> {
    let hyper = std::iter::successors(Some(err), |err| err.source())
        .find_map(|err| err.downcast_ref::<hyper::Error>())?;
    if !hyper.is_parse() || hyper.is_parse_version_h2() || hyper.is_parse_status() {
        return None;
    }
    let words = hyper.to_string();
    let status = if hyper.is_parse_too_large() {
        match words.starts_with("URI too long") {
            true => http::StatusCode::URI_TOO_LONG,
            false => http::StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE,
        }
    } else if words.starts_with("internal error") {
        return None;
    } else {
        http::StatusCode::BAD_REQUEST
    };
    Some((status, hyper))
}

/// `TCP_USER_TIMEOUT`'s value for `limit`, in milliseconds: at least 1 (0
/// would mean the system's default) and at most `i32::MAX`, about 24.8
/// days (the kernel reads an `int` and refuses a negative one).
#[cfg(any(target_os = "linux", target_os = "android"))]
fn user_timeout_ms(limit: Duration) -> u32 {
    let ms = u32::try_from(limit.as_millis()).unwrap_or(u32::MAX);
    ms.clamp(1, i32::MAX.unsigned_abs())
}

/// One request open on an HTTP/2 connection, counted in the connection's
/// channel while it lives: from its head until its response body is done
/// or dropped.
struct StreamOpen(Arc<watch::Sender<usize>>);

impl StreamOpen {
    fn new(open: &Arc<watch::Sender<usize>>) -> StreamOpen {
        open.send_modify(|n| *n += 1);
        StreamOpen(Arc::clone(open))
    }
}

impl Drop for StreamOpen {
    fn drop(&mut self) {
        self.0.send_modify(|n| *n = n.saturating_sub(1));
    }
}

/// What an HTTP/2 connection's response bodies tell its watch
/// ([`held_for`]).
#[derive(Debug, Default)]
struct H2Sends {
    /// Bodies whose last frame hyper has taken without asking for the
    /// next yet. hyper asks again at once unless h2 has no room for more:
    /// the client's flow-control window is shut (or the socket is full).
    held: AtomicUsize,
    /// Polls of any of the connection's response bodies, as a sign of
    /// life.
    polls: AtomicUsize,
    /// Told when `held` leaves 0: [`held_for`]'s timer runs only then.
    first_held: Notify,
}

/// A response body on an HTTP/2 connection: a request open while it lives
/// ([`StreamOpen`]), and counted in its connection's [`H2Sends`].
struct H2Body {
    inner: ProxyBody,
    _open: StreamOpen,
    sends: Arc<H2Sends>,
    /// Its last frame was taken, and no poll has come since.
    taken: bool,
}

impl http_body::Body for H2Body {
    type Data = bytes::Bytes;
    type Error = super::upstream::BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Self::Data>, Self::Error>>> {
        let this = self.get_mut();
        this.sends.polls.fetch_add(1, Ordering::Relaxed);
        let polled = Pin::new(&mut this.inner).poll_frame(cx);
        let taken = matches!(polled, Poll::Ready(Some(Ok(_))));
        if taken != this.taken {
            this.taken = taken;
            if taken {
                if this.sends.held.fetch_add(1, Ordering::Relaxed) == 0 {
                    this.sends.first_held.notify_one();
                }
            } else {
                this.sends.held.fetch_sub(1, Ordering::Relaxed);
            }
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

impl Drop for H2Body {
    fn drop(&mut self) {
        if self.taken {
            self.sends.held.fetch_sub(1, Ordering::Relaxed);
        }
    }
}

/// Resolves once every request open on the connection (`open`, the
/// [`StreamOpen`] count) has had its body held ([`H2Sends::held`]), and
/// no body was polled, for `limit` (within an eighth of it, looked at
/// that often): the client has left the bytes sent to it waiting that
/// long. A request whose response head has not come, or whose body waits
/// on a quiet upstream, is not held, and keeps the connection open; so is
/// a body held while another moves. Its timer runs only while a body is
/// held.
async fn held_for(sends: &H2Sends, open: &watch::Receiver<usize>, limit: Duration) {
    let tick = (limit / 8).max(Duration::from_millis(10));
    loop {
        if sends.held.load(Ordering::Relaxed) == 0 {
            // A permit stored by a `notify_one` meanwhile is taken here.
            sends.first_held.notified().await;
            continue;
        }
        let mut still = Duration::ZERO;
        let mut polls = sends.polls.load(Ordering::Relaxed);
        loop {
            tokio::time::sleep(tick).await;
            let held = sends.held.load(Ordering::Relaxed);
            if held == 0 {
                break;
            }
            let now = sends.polls.load(Ordering::Relaxed);
            if now == polls && held >= *open.borrow() {
                still += tick;
                if still >= limit {
                    return;
                }
            } else {
                still = Duration::ZERO;
            }
            polls = now;
        }
    }
}

/// Resolves once the count of open requests `open` has stayed at zero
/// for `limit`.
async fn quiet_for(mut open: watch::Receiver<usize>, limit: Duration) {
    loop {
        // Err: the count's sender, the connection's service, is gone, and
        // the connection with it.
        if open.wait_for(|n| *n == 0).await.is_err() {
            return std::future::pending().await;
        }
        tokio::select! {
            () = tokio::time::sleep(limit) => return,
            changed = open.changed() => {
                if changed.is_err() {
                    return std::future::pending().await;
                }
            }
        }
    }
}

/// The next connection from `listener`, accepted once loop `me` is among
/// the least busy ([`Loads::may_accept`]).
async fn accept_when_even(
    listener: &TcpListener,
    loads: &Loads,
    me: usize,
) -> io::Result<(TcpStream, SocketAddr)> {
    loop {
        let Some(changed) = loads.changed.get(me) else {
            return listener.accept().await;
        };
        let changed = changed.notified();
        tokio::pin!(changed);
        // Registered before the check, so that a change right after it
        // is not missed.
        changed.as_mut().enable();
        if loads.may_accept(me) {
            return listener.accept().await;
        }
        changed.await;
    }
}

/// Graceful shutdown of the open connections, as hyper-util's
/// `GracefulShutdown` does it (a watch channel: its send tells every
/// connection to finish its response and close, and its sender sees when
/// the last of them has), with a flag in front of the channel. A
/// connection's task polls its receiver once, which registers the task's
/// waker, and after that only once the flag says the signal was sent:
/// hyper-util's polls the receiver every time the connection is polled,
/// about 160 instructions a poll, and in a paced stream a poll is an event
/// (BENCHMARKS.md, twenty-fifth round). The accept loops keep clones, to
/// give watchers: a sender is not waited for, only the watchers are.
#[derive(Clone)]
struct Drain {
    tx: watch::Sender<()>,
    started: Arc<AtomicBool>,
}

/// What a connection holds to hear of the shutdown.
struct DrainWatcher {
    rx: watch::Receiver<()>,
    started: Arc<AtomicBool>,
}

impl Drain {
    fn new() -> Drain {
        Drain {
            tx: watch::channel(()).0,
            started: Arc::new(AtomicBool::new(false)),
        }
    }

    /// A receiver the drain waits for, like a connection's.
    fn hold(&self) -> watch::Receiver<()> {
        self.tx.subscribe()
    }

    fn watcher(&self) -> DrainWatcher {
        DrainWatcher {
            rx: self.tx.subscribe(),
            started: Arc::clone(&self.started),
        }
    }

    /// Tells every connection to finish, and waits until they all have.
    async fn shutdown(self) {
        // The flag first: a connection woken by the send must see it.
        self.started.store(true, Ordering::Release);
        let _ = self.tx.send(());
        self.tx.closed().await;
    }
}

impl DrainWatcher {
    /// Resolves once the drain has started.
    async fn draining(&mut self) {
        if self.started.load(Ordering::Acquire) {
            return;
        }
        // Err: the server is gone, which drains nothing more.
        let _ = self.rx.changed().await;
    }

    /// Runs `conn`, shut down gracefully once the drain starts or `idle`
    /// resolves; the receiver is held until `conn` is done, so that the
    /// drain waits for it.
    fn watch<C: GracefulConnection, I: Future<Output = ()>>(
        self,
        conn: C,
        idle: I,
    ) -> Watched<C, impl Future<Output = ()>, I> {
        let DrainWatcher { mut rx, started } = self;
        Watched {
            conn,
            idle,
            // Polled once, to register; it holds the receiver until the
            // connection is done.
            signal: async move {
                let _ = rx.changed().await;
                std::future::pending::<()>().await;
            },
            started,
            registered: false,
            shut: false,
        }
    }
}

pin_project_lite::pin_project! {
    /// A connection and its shutdown signals ([`DrainWatcher::watch`]).
    struct Watched<C, S, I> {
        #[pin]
        conn: C,
        #[pin]
        signal: S,
        // Resolves when the connection has been idle too long.
        #[pin]
        idle: I,
        started: Arc<AtomicBool>,
        // The signal was polled, and holds the task's waker.
        registered: bool,
        // The connection was told to finish.
        shut: bool,
    }
}

impl<C: GracefulConnection, S: Future<Output = ()>, I: Future<Output = ()>> Future
    for Watched<C, S, I>
{
    type Output = C::Output;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<C::Output> {
        let mut this = self.project();
        if !*this.shut {
            if this.started.load(Ordering::Acquire) || this.idle.as_mut().poll(cx).is_ready() {
                *this.shut = true;
                this.conn.as_mut().graceful_shutdown();
            } else if !*this.registered {
                // Once: the channel keeps the task's waker, and its send
                // wakes the task, which then sees the flag.
                *this.registered = true;
                let _ = this.signal.as_mut().poll(cx);
            }
        }
        this.conn.poll(cx)
    }
}

/// Threads that serve connections, each running a current-thread runtime
/// (see the module docs). Dropping it stops them: each runtime drops the
/// tasks it still has, and the threads are waited for.
pub struct Workers {
    /// The runtimes, one per thread.
    handles: Vec<Handle>,
    /// Dropping a sender ends its thread's `block_on`.
    stops: Vec<oneshot::Sender<()>>,
    /// Waited for on drop.
    threads: Vec<thread::JoinHandle<()>>,
}

/// How the kernel schedules `serve`'s threads (`serve --sched`).
///
/// Under `SCHED_BATCH` (Linux) a worker that an event wakes does not cut
/// in on the task running on its CPU, but waits for its turn to end (an
/// idle CPU runs it at once): an upstream that writes an event and a
/// client that reads one are not cut off in the middle, and a busy worker
/// takes several events at once (BENCHMARKS.md, fifty-first round). The
/// policy is the whole process's, as under `chrt -b`: set on the main
/// thread before it starts any other (the log writer, the spinners, the
/// workers, their blocking threads), which inherit it (fifty-second
/// round).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Sched {
    /// SCHED_BATCH, when the process runs under the default SCHED_OTHER
    Batch,
    /// the policy the process was started with (chrt), kept
    Inherit,
}

impl Sched {
    /// Gives the calling thread this policy, which the threads it starts
    /// afterwards inherit (Linux copies a thread's policy to the threads
    /// it makes). An `Err` is the kernel's refusal: the thread keeps its
    /// policy. Called before the log is set up, so the caller tells it.
    pub fn apply(self) -> io::Result<()> {
        match self {
            Sched::Batch => batch_if_other(),
            Sched::Inherit => Ok(()),
        }
    }
}

/// `SCHED_BATCH` for the calling thread, when it runs under
/// `SCHED_OTHER` (a policy chosen with `chrt` is kept). The
/// `SCHED_RESET_ON_FORK` flag (`chrt -R`), which the kernel reports ORed
/// into the policy, is not a policy: `SCHED_OTHER` with it becomes
/// `SCHED_BATCH` with it (an unprivileged caller may not clear the flag).
#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn batch_if_other() -> io::Result<()> {
    let param = libc::sched_param { sched_priority: 0 };
    // SAFETY: both are system calls on the calling thread (pid 0); `param`
    // is a valid `sched_param` that outlives the call, and the kernel only
    // reads it. The crate's one `unsafe`: no crate wraps these calls
    // (rustix leaves them out; thread-priority sets the nice value too).
    let ret = unsafe {
        match libc::sched_getscheduler(0) {
            ..0 => -1,
            current if current & !libc::SCHED_RESET_ON_FORK == libc::SCHED_OTHER => {
                let flag = current & libc::SCHED_RESET_ON_FORK;
                libc::sched_setscheduler(0, libc::SCHED_BATCH | flag, &param)
            }
            _ => 0,
        }
    };
    match ret {
        0.. => Ok(()),
        _ => Err(io::Error::last_os_error()),
    }
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn batch_if_other() -> io::Result<()> {
    Ok(())
}

impl Workers {
    /// Starts `count` threads, named `worker-0`, `worker-1`, …, each with
    /// its own list of idle upstream connections (up to
    /// [`SHARDS`](super::h1::SHARDS) threads; see
    /// [`H1Pool`](super::h1::H1Pool)), with the calling thread's scheduling
    /// policy (see [`Sched`]).
    pub fn start(count: NonZeroUsize) -> io::Result<Workers> {
        let mut workers = Workers {
            handles: Vec::with_capacity(count.get()),
            stops: Vec::with_capacity(count.get()),
            threads: Vec::with_capacity(count.get()),
        };
        for i in 0..count.get() {
            let runtime = runtime::Builder::new_current_thread()
                .enable_all()
                .build()?;
            let handle = runtime.handle().clone();
            let (stop, stopped) = oneshot::channel::<()>();
            let thread = thread::Builder::new()
                .name(format!("worker-{i}"))
                .spawn(move || {
                    super::h1::pin_shard(i);
                    // Err is the sender dropped: the signal to stop.
                    let _ = runtime.block_on(stopped);
                })?;
            workers.handles.push(handle);
            workers.stops.push(stop);
            workers.threads.push(thread);
        }
        Ok(workers)
    }

    /// The runtimes, for [`serve`] (and `spawn_on`).
    pub fn handles(&self) -> &[Handle] {
        &self.handles
    }
}

impl Drop for Workers {
    fn drop(&mut self) {
        self.stops.clear();
        for thread in self.threads.drain(..) {
            // A worker that panicked has already said so on stderr.
            let _ = thread.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::Bytes;
    use http_body_util::{BodyExt, Full};
    use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};

    /// Failed accepts are warned of once in ten seconds, with the count of
    /// those held back; successes in between change nothing.
    #[test]
    fn failed_accepts_are_said_once_in_a_while() {
        let start = std::time::Instant::now();
        let at = |ms: u64| start + Duration::from_millis(ms);
        let mut failures = AcceptFailures::default();
        assert_eq!(failures.failed(at(0)), Some(0), "the first is said");
        // Every 50 ms for ten seconds: 199 held back.
        for k in 1..200 {
            assert_eq!(failures.failed(at(k * 50)), None, "failure {k}");
        }
        assert_eq!(failures.failed(at(10_000)), Some(199));
        assert_eq!(failures.failed(at(10_050)), None);
        assert_eq!(failures.failed(at(30_000)), Some(1));
    }

    /// Asks a keep-alive connection for one response: the name of the
    /// thread that served it (the handler's whole body).
    async fn served_by(conn: &mut BufReader<TcpStream>) -> String {
        conn.get_mut()
            .write_all(b"GET / HTTP/1.1\r\nhost: test\r\n\r\n")
            .await
            .expect("request");
        let mut length = None;
        loop {
            let mut line = String::new();
            conn.read_line(&mut line).await.expect("head");
            assert!(
                !line.is_empty(),
                "the connection closed before its response"
            );
            if line == "\r\n" {
                break;
            }
            if let Some((name, value)) = line.split_once(':')
                && name.eq_ignore_ascii_case("content-length")
            {
                length = value.trim().parse::<usize>().ok();
            }
        }
        let mut body = vec![0; length.expect("a content-length")];
        conn.read_exact(&mut body).await.expect("body");
        String::from_utf8(body).expect("a thread name")
    }

    /// Every connection is accepted and served by a worker (none on the
    /// runtime that called `serve`), each keeps its worker for all its
    /// requests, and a connection goes to a worker with the fewest open
    /// ones: four connections held open, one after another, are two on
    /// each worker (a connection is counted when it is accepted, before
    /// its response).
    #[tokio::test]
    async fn connections_are_served_on_the_least_busy_worker() {
        let workers = Workers::start(NonZeroUsize::new(2).expect("2 > 0")).expect("workers");
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        let handler = |_req: Request<Incoming>, _peer: Peer| async {
            let name = thread::current().name().unwrap_or("unnamed").to_owned();
            let body = Full::new(Bytes::from(name)).map_err(|never| match never {});
            Response::new(body.boxed())
        };
        let (stop, stopped) = oneshot::channel::<()>();
        let handles = workers.handles().to_vec();
        let server = tokio::spawn(async move {
            let shutdown = async move {
                let _ = stopped.await;
            };
            let options = ServeOptions {
                grace: Duration::from_secs(5),
                head_timeout: HEAD_READ_TIMEOUT,
                client_timeout: Duration::from_secs(300),
                refused: Box::new(|_| {}),
            };
            serve(listener, handler, shutdown, options, &handles).await;
        });

        let mut open = Vec::new();
        let mut first = Vec::new();
        for _ in 0..4 {
            let mut conn = BufReader::new(TcpStream::connect(addr).await.expect("connect"));
            first.push(served_by(&mut conn).await);
            open.push(conn);
        }
        for (conn, name) in open.iter_mut().zip(&first) {
            assert_eq!(
                &served_by(conn).await,
                name,
                "a connection keeps its worker"
            );
        }
        let on = |worker: &str| first.iter().filter(|name| *name == worker).count();
        assert_eq!(
            (on("worker-0"), on("worker-1")),
            (2, 2),
            "served by {first:?}"
        );

        stop.send(()).expect("the server runs");
        drop(open);
        tokio::time::timeout(Duration::from_secs(10), server)
            .await
            .expect("the server stops")
            .expect("without a panic");
        drop(workers);
    }

    /// What `serve` relies on to spare each connection its `setsockopt`:
    /// a connection accepted from a listening socket with TCP_NODELAY has
    /// it from its start. (Where it would not, `accept_loop` sets it on
    /// each connection.)
    #[tokio::test]
    async fn a_connection_takes_tcp_nodelay_from_its_listening_socket() {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        rustix::net::sockopt::set_tcp_nodelay(&listener, true).expect("set");
        let (client, accepted) = tokio::join!(TcpStream::connect(addr), listener.accept());
        let (accepted, _) = accepted.expect("accept");
        assert!(accepted.nodelay().expect("nodelay"));
        drop(client);
    }

    /// A listener and the counts of `loops` accept loops.
    async fn listener_and_loads(loops: usize) -> (TcpListener, SocketAddr, Arc<Loads>) {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        (listener, addr, Arc::new(Loads::new(loops)))
    }

    /// Whether an accept is still waiting after 200 ms. Nothing is timed:
    /// a loop that may not accept never takes the client, however slow the
    /// machine.
    async fn still_waiting<F: Future>(accept: Pin<&mut F>) -> bool {
        tokio::time::timeout(Duration::from_millis(200), accept)
            .await
            .is_err()
    }

    /// The accept completes, within 10 s, with a connection.
    async fn accepted(accept: impl Future<Output = io::Result<(TcpStream, SocketAddr)>>) {
        tokio::time::timeout(Duration::from_secs(10), accept)
            .await
            .expect("accepted in time")
            .expect("a connection");
    }

    /// A loop with more open connections than another accepts nothing,
    /// even with a client waiting, until the counts change; then it does.
    #[tokio::test]
    async fn a_busier_loop_waits_until_it_is_not() {
        let (listener, addr, loads) = listener_and_loads(2).await;
        let ahead = loads.open(0);
        assert!(!loads.may_accept(0));
        assert!(loads.may_accept(1));

        let _first = TcpStream::connect(addr).await.expect("connect");
        let busier = accept_when_even(&listener, &loads, 0);
        tokio::pin!(busier);
        assert!(
            still_waiting(busier.as_mut()).await,
            "the busier loop accepted"
        );
        accepted(accept_when_even(&listener, &loads, 1)).await;

        // Loop 0 waits for a change of the counts; one that makes it even
        // wakes it, and it accepts the next client.
        let waiting = accept_when_even(&listener, &loads, 0);
        tokio::pin!(waiting);
        let _second = TcpStream::connect(addr).await.expect("connect");
        assert!(
            still_waiting(waiting.as_mut()).await,
            "the busier loop accepted"
        );
        let even = loads.open(1);
        accepted(waiting).await;
        drop((ahead, even));
        assert!(loads.may_accept(0) && loads.may_accept(1));
    }

    /// A loop waiting to be even is woken when its own connection closes,
    /// and a loop that could not start holds no other back.
    #[tokio::test]
    async fn a_loop_is_woken_by_its_own_close_and_a_retired_loop_is_ignored() {
        let (listener, addr, loads) = listener_and_loads(3).await;
        let _first = loads.open(0);
        let second = loads.open(0);
        let _theirs = loads.open(2);
        // Loop 1 is the least busy: loop 0 waits.
        let waiting = accept_when_even(&listener, &loads, 0);
        tokio::pin!(waiting);
        let _client = TcpStream::connect(addr).await.expect("connect");
        assert!(
            still_waiting(waiting.as_mut()).await,
            "loop 0 accepted while behind"
        );
        // Loop 1 could not start: it no longer counts, but loop 2 still has
        // fewer connections than loop 0.
        loads.retire(1);
        assert!(
            still_waiting(waiting.as_mut()).await,
            "loop 0 accepted while behind"
        );
        // One of loop 0's connections closes: it is even with loop 2, and
        // woken to see so.
        drop(second);
        accepted(waiting).await;
        assert!(!loads.may_accept(1));
    }
}
