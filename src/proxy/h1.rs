//! Plain-HTTP/1.1 upstream connections that the response drives itself.
//!
//! hyper-util's pooled client runs every connection in a task of its own
//! and hands a response body to its reader one HTTP chunk per round trip:
//! the body's channel holds one chunk, refilled only after the reader has
//! asked for the next. An SSE upstream writes one event per chunk, so each
//! event cost two task wake-ups and left in its own `writev`, whatever had
//! already been read (BENCHMARKS.md, "The proxy after this round").
//!
//! Here nothing is spawned: the connection future is polled by whoever
//! polls the exchange — the request future until the response head has
//! come, then the response body ([`DrivenBody`]). When the body's channel
//! is empty, the connection is polled right there and parses the next
//! chunk from what it already read, so [`TapBody`](super::body::TapBody)
//! finds every event that has arrived and sends them in one write. Nothing
//! is read ahead of the client either: the connection only reads when the
//! body is polled, that is when the client's side has room.
//!
//! [`H1Pool`] keeps finished keep-alive connections for the next request
//! (each at most [`IDLE_KEEP`]) in a list per thread (at most [`MAX_IDLE`]
//! in each): a connection goes back to the list of the thread whose
//! runtime's reactor watches its socket, and a thread takes from its own
//! list first. When its own is empty it takes another thread's connection
//! and moves its socket to its own reactor (see `Conn::rehome`); left
//! with the other's, every event of the stream woke that thread to wake
//! this one. An idle connection is not polled; it is checked when taken
//! (a connection the upstream closed meanwhile reads its end and is
//! dropped) and every 15 s by a sweeper task, and a request that finds it
//! closed before any byte was written is sent again on a new connection,
//! as hyper-util's client does.
//!
//! TLS upstreams keep hyper-util's client (they mostly speak HTTP/2, whose
//! streams buffer several frames anyway); see
//! [`UpstreamClient`](super::upstream::UpstreamClient).

use std::cell::Cell;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError, Weak};
use std::task::{Context, Poll, Wake, Waker, ready};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::header::{self, HeaderValue};
use http::uri::Authority;
use http::{Request, Response, Uri};
use http_body::{Body, Frame, SizeHint};
use hyper::body::Incoming;
use hyper::client::conn::http1::{self, Connection, SendRequest};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;
use tower_service::Service;

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

type Io = TokioIo<TcpStream>;

/// One HTTP/1.1 connection: the handle that sends and the future that does
/// the I/O, kept together because whoever uses the one must poll the other.
struct Conn {
    sender: SendRequest<ProxyBody>,
    /// `None` once it finished (closed or failed). It is dropped at once:
    /// a finished dispatcher still holds what was queued on it, and only
    /// dropping it answers a request it never sent (with the request back,
    /// for a retry) and ends a body it was feeding.
    io: Option<Connection<Io, ProxyBody>>,
    /// The idle list of the thread whose runtime's reactor watches its
    /// socket (the thread that made it, or the one it was moved to): it
    /// goes back there.
    home: usize,
}

impl Conn {
    /// Polls the connection future; `Ready` when it finished (it is then
    /// dropped).
    fn poll_io(&mut self, cx: &mut Context<'_>) -> Poll<()> {
        let Some(io) = self.io.as_mut() else {
            return Poll::Ready(());
        };
        let result = ready!(Pin::new(io).poll(cx));
        self.io = None;
        if let Err(err) = result {
            tracing::debug!("upstream connection ended: {err}");
        }
        Poll::Ready(())
    }

    /// This idle connection, made on another thread, moved to this one: its
    /// socket leaves the other runtime's reactor for this thread's, and a
    /// new HTTP/1.1 connection state takes it over (hyper's handshake does
    /// no I/O). Left on the other reactor, each of its wake-ups would wake
    /// the other thread only for it to wake this one: a second wake-up per
    /// event, about 30 µs of CPU at C=1 here (BENCHMARKS.md, "Eleventh
    /// round"). (The threads of a multi-thread runtime share one reactor:
    /// there the move changes only the list it goes back to.) `None`, and
    /// the connection is dropped, when it cannot be moved: it holds bytes
    /// read ahead of a request (never, when idle), or the socket cannot be
    /// registered here.
    async fn rehome(self) -> Option<Conn> {
        let parts = self.io?.into_parts();
        if !parts.read_buf.is_empty() {
            return None;
        }
        let moved = parts
            .io
            .into_inner()
            .into_std()
            .and_then(TcpStream::from_std);
        let stream = match moved {
            Ok(stream) => stream,
            Err(err) => {
                tracing::debug!("cannot move an idle upstream connection to this thread: {err}");
                return None;
            }
        };
        Conn::start(TokioIo::new(stream)).await.ok()
    }

    /// An HTTP/1.1 connection on `io`, at home on this thread (hyper's
    /// HTTP/1.1 handshake does no I/O: it only builds the state).
    async fn start(io: Io) -> Result<Conn, hyper::Error> {
        let (sender, io) = http1::Builder::new()
            .max_buf_size(CONN_BUF_BYTES)
            .handshake(io)
            .await?;
        Ok(Conn {
            sender,
            io: Some(io),
            home: own_shard(),
        })
    }

    /// Whether it can take a request now. Polls the connection once, with
    /// a waker that does nothing: an upstream that closed it meanwhile
    /// makes it read its end and finish.
    fn usable(&mut self) -> bool {
        let mut cx = Context::from_waker(Waker::noop());
        // (Ready means wanting a request, which a closed sender never is.)
        self.poll_io(&mut cx).is_pending() && self.sender.is_ready()
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
    /// The exchange failed (hyper says how; its source may be the request
    /// body's own error).
    #[error("{0}")]
    Http(#[from] hyper::Error),
    /// A connection made for this request closed before taking it.
    #[error("the new connection closed before the request was sent")]
    Refused,
}

/// The pool and connector of plain-HTTP upstream connections.
pub struct H1Pool {
    connector: HttpConnector,
    /// Idle connections, one list per thread ([`own_shard`]) holding the
    /// connections that thread made (`Conn::home`): each connection's
    /// socket is registered with the reactor of the runtime that made it,
    /// so a connection reused on that thread is woken there, not from
    /// another thread.
    idle: Box<[Mutex<Vec<Idle>>]>,
    /// The sweeper task runs (started with the first idle connection,
    /// inside the runtime; it ends with the pool).
    sweeping: AtomicBool,
}

impl H1Pool {
    pub fn new(connect_timeout: Duration) -> Arc<H1Pool> {
        let mut connector = HttpConnector::new();
        connector.set_nodelay(true);
        connector.set_connect_timeout(Some(connect_timeout));
        Arc::new(H1Pool {
            connector,
            idle: (0..SHARDS).map(|_| Mutex::new(Vec::new())).collect(),
            sweeping: AtomicBool::new(false),
        })
    }

    /// Sends `req` (its URI absolute: `http://authority/path`) and returns
    /// the response, whose body drives the connection.
    pub async fn request(
        self: &Arc<Self>,
        mut req: Request<ProxyBody>,
    ) -> Result<Response<DrivenBody>, H1Error> {
        let uri = req.uri().clone();
        if let Some(authority) = uri.authority() {
            req.headers_mut()
                .entry(header::HOST)
                .or_insert_with(|| host_value(authority));
        }
        *req.uri_mut() = origin_form(&uri);
        if let Some(mut conn) = self.checkout().await {
            match exchange(&mut conn, req).await {
                Ok(response) => return Ok(self.driven(conn, response)),
                // Closed before a byte of it was written: an upstream that
                // closed an idle connection. Send it again on a new one.
                Err(Retry::Again(again)) => req = again,
                Err(Retry::No(err)) => return Err(err),
            }
        }
        let mut conn = self.connect(uri).await?;
        match exchange(&mut conn, req).await {
            Ok(response) => Ok(self.driven(conn, response)),
            Err(Retry::Again(_)) => Err(H1Error::Refused),
            Err(Retry::No(err)) => Err(err),
        }
    }

    fn driven(self: &Arc<Self>, conn: Conn, response: Response<Incoming>) -> Response<DrivenBody> {
        let mut driven = response.map(|body| DrivenBody::new(body, conn, Arc::clone(self)));
        // No body to read (HEAD, 204, 304): hyper's server will not poll
        // it, so the connection goes back now or never.
        if driven.body().body.is_end_stream() {
            driven.body_mut().release();
        }
        driven
    }

    /// The newest usable idle connection, this thread's first; another
    /// thread's is moved to this one.
    async fn checkout(&self) -> Option<Conn> {
        let own = own_shard();
        let conn = (0..SHARDS).find_map(|k| {
            let mut idle = self.idle[(own + k) % SHARDS]
                .lock()
                .unwrap_or_else(PoisonError::into_inner);
            while let Some(mut entry) = idle.pop() {
                if entry.since.elapsed() < IDLE_KEEP && entry.conn.usable() {
                    return Some(entry.conn);
                }
            }
            None
        })?;
        if conn.home == own {
            Some(conn)
        } else {
            conn.rehome().await
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
    /// closed. An idle connection is not polled, so without this one the
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

    async fn connect(&self, uri: Uri) -> Result<Conn, H1Error> {
        let io = self
            .connector
            .clone()
            .call(uri)
            .await
            .map_err(|err| H1Error::Connect(err.into()))?;
        Ok(Conn::start(io).await?)
    }
}

// Short-lived, moved once: the request inside is the point.
#[allow(clippy::large_enum_variant)]
enum Retry {
    /// The request was never written: here it is back.
    Again(Request<ProxyBody>),
    No(H1Error),
}

/// Sends one request on `conn` and polls the connection until the
/// response head has come.
async fn exchange(conn: &mut Conn, req: Request<ProxyBody>) -> Result<Response<Incoming>, Retry> {
    let mut response = std::pin::pin!(conn.sender.try_send_request(req));
    let result = std::future::poll_fn(|cx| {
        if let Poll::Ready(result) = response.as_mut().poll(cx) {
            return Poll::Ready(result);
        }
        if conn.io.is_some() && conn.poll_io(cx).is_ready() {
            // It ended, and was dropped: the response future now has the
            // error that says why (with the request back if it was never
            // sent, as when the upstream closed an idle connection just
            // as it was taken).
            return response.as_mut().poll(cx);
        }
        Poll::Pending
    })
    .await;
    match result {
        Ok(response) => Ok(response),
        Err(mut err) => match err.take_message() {
            Some(req) => Err(Retry::Again(req)),
            None => Err(Retry::No(H1Error::Http(err.into_error()))),
        },
    }
}

/// `Host` as hyper-util's client writes it: the port only when it is not
/// HTTP's default.
fn host_value(authority: &Authority) -> HeaderValue {
    let value = match authority.port_u16() {
        Some(80) | None => authority.host().to_owned(),
        Some(port) => format!("{}:{port}", authority.host()),
    };
    HeaderValue::from_str(&value).unwrap_or_else(|_| HeaderValue::from_static("localhost"))
}

/// `/path?query` of an absolute URI.
fn origin_form(uri: &Uri) -> Uri {
    match uri.path_and_query() {
        Some(path) => Uri::from(path.clone()),
        None => Uri::from_static("/"),
    }
}

/// A response body that polls its connection whenever it has no frame
/// ready and the connection was woken since it last had nothing, and gives
/// the connection back to the pool at its end.
pub struct DrivenBody {
    body: Incoming,
    /// `None` once back in the pool (or given up).
    conn: Option<Conn>,
    pool: Arc<H1Pool>,
    /// What the connection's wake-ups record (see [`Nudge`]).
    nudge: Arc<Nudge>,
    /// `nudge` as the waker the connection is polled with.
    nudged: Waker,
    /// The connection was polled since the body last had nothing.
    fed: bool,
}

/// The connection's waker while its body drives it. A connection that
/// returned `Pending` has nothing to do until it is woken (by its socket,
/// or by the body taking the chunk it holds); polling it before that costs
/// a turn of hyper's dispatcher (about 1,000 instructions) for nothing, and
/// hyper's server polls a body two or three times per event. So the body
/// polls the connection only when `woken` says it may have something.
/// Wake-ups that come while the body is being polled (the connection
/// waking itself as the body takes a chunk) only set `woken`: the body
/// looks at it before it returns, and the task is not run again for it.
struct Nudge {
    /// The connection was woken since the body last polled it.
    woken: AtomicBool,
    /// A `DrivenBody::poll_frame` is running (and will look at `woken`).
    polling: AtomicBool,
    /// The task that polls the body.
    task: Mutex<Option<Waker>>,
}

impl Nudge {
    fn new() -> Arc<Nudge> {
        Arc::new(Nudge {
            // Nothing is known yet: the first poll polls the connection.
            woken: AtomicBool::new(true),
            polling: AtomicBool::new(false),
            task: Mutex::new(None),
        })
    }

    fn set_task(&self, waker: &Waker) {
        let mut task = self.task.lock().unwrap_or_else(PoisonError::into_inner);
        if !task.as_ref().is_some_and(|task| task.will_wake(waker)) {
            *task = Some(waker.clone());
        }
    }
}

impl Wake for Nudge {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        // SeqCst, with `polling`'s: either the body sees `woken` before it
        // returns, or this sees it is not polling and wakes the task.
        self.woken.store(true, Ordering::SeqCst);
        if !self.polling.load(Ordering::SeqCst) {
            let task = self.task.lock().unwrap_or_else(PoisonError::into_inner);
            if let Some(task) = task.as_ref() {
                task.wake_by_ref();
            }
        }
    }
}

impl DrivenBody {
    fn new(body: Incoming, conn: Conn, pool: Arc<H1Pool>) -> DrivenBody {
        let nudge = Nudge::new();
        DrivenBody {
            body,
            conn: Some(conn),
            pool,
            nudged: Waker::from(Arc::clone(&nudge)),
            nudge,
            fed: true,
        }
    }

    /// At the body's end: a connection still open and idle is kept.
    fn release(&mut self) {
        if let Some(mut conn) = self.conn.take()
            && conn.usable()
        {
            self.pool.checkin(conn);
        }
    }

    /// Passes a polled frame on; at the body's end (its last frame, the
    /// trailers, or nothing more), releases the connection.
    fn seen(
        &mut self,
        polled: Poll<Option<Result<Frame<Bytes>, hyper::Error>>>,
    ) -> Poll<Option<Result<Frame<Bytes>, hyper::Error>>> {
        if let Poll::Ready(frame) = &polled {
            let trailers = matches!(frame, Some(Ok(frame)) if frame.is_trailers());
            if frame.is_none() || trailers || self.body.is_end_stream() {
                self.release();
            }
        }
        polled
    }

    /// The next frame, polling the connection while it has something to do.
    fn drive(&mut self, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, hyper::Error>>> {
        // Only the connection feeds the body, so the body's own wake-ups
        // would only run the task once more to find nothing: it is polled
        // with a waker that does nothing, and the connection with `nudged`.
        let mut quiet = Context::from_waker(Waker::noop());
        let mut nudged = Context::from_waker(&self.nudged);
        loop {
            let Some(conn) = self.conn.as_mut().filter(|c| c.io.is_some()) else {
                // Nothing feeds it any more but its own end (and no
                // connection's wake-up can matter: `poll_frame` must not
                // loop on one).
                self.nudge.woken.store(false, Ordering::SeqCst);
                return Pin::new(&mut self.body).poll_frame(cx);
            };
            // The body can have something new only after a poll of the
            // connection: hyper's server polls a body again and again.
            if self.fed {
                let polled = Pin::new(&mut self.body).poll_frame(&mut quiet);
                if polled.is_ready() {
                    return polled;
                }
                self.fed = false;
            }
            if !self.nudge.woken.swap(false, Ordering::SeqCst) {
                return Poll::Pending;
            }
            // It may parse one more chunk (and then wait for the body to
            // take it), find nothing more to read yet, or finish (and be
            // dropped: the body then has its end or its error).
            let _ = conn.poll_io(&mut nudged);
            self.fed = true;
        }
    }
}

impl Body for DrivenBody {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, hyper::Error>>> {
        let this = &mut *self;
        this.nudge.set_task(cx.waker());
        loop {
            this.nudge.polling.store(true, Ordering::SeqCst);
            let polled = this.drive(cx);
            this.nudge.polling.store(false, Ordering::SeqCst);
            // A wake-up that came while it ran did not wake the task.
            if polled.is_pending() && this.nudge.woken.load(Ordering::SeqCst) {
                continue;
            }
            return this.seen(polled);
        }
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
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
            let mut seen = Vec::new();
            let mut buf = [0u8; 1024];
            while !seen.windows(4).any(|w| w == b"\r\n\r\n") {
                match stream.read(&mut buf).await {
                    Ok(0) | Err(_) => return,
                    Ok(n) => seen.extend_from_slice(&buf[..n]),
                }
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

    /// A finished response leaves its connection in the pool; a sweep
    /// keeps it while it is open and drops it once the upstream closed it.
    #[tokio::test]
    async fn a_sweep_drops_only_the_idle_connections_the_upstream_closed() {
        let (addr, close) = upstream_once().await;
        let pool = H1Pool::new(Duration::from_secs(1));
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
        let pool = H1Pool::new(Duration::from_secs(1));
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

    /// A waker that counts its wake-ups.
    struct Counter(std::sync::atomic::AtomicUsize);

    impl Wake for Counter {
        fn wake(self: Arc<Self>) {
            self.wake_by_ref();
        }
        fn wake_by_ref(self: &Arc<Self>) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }

    /// The connection's wake-ups always say it has something to do; they
    /// wake the task only when its body is not being polled (which looks
    /// at `woken` before it returns).
    #[test]
    fn a_connection_wake_up_wakes_the_task_only_outside_its_poll() {
        let nudge = Nudge::new();
        assert!(
            nudge.woken.load(Ordering::SeqCst),
            "the first poll polls the connection"
        );
        let counter = Arc::new(Counter(std::sync::atomic::AtomicUsize::new(0)));
        nudge.set_task(&Waker::from(Arc::clone(&counter)));
        let waker = Waker::from(Arc::clone(&nudge));

        nudge.woken.store(false, Ordering::SeqCst);
        nudge.polling.store(true, Ordering::SeqCst);
        waker.wake_by_ref();
        assert!(nudge.woken.load(Ordering::SeqCst));
        assert_eq!(
            counter.0.load(Ordering::SeqCst),
            0,
            "no task wake-up while polling"
        );

        nudge.woken.store(false, Ordering::SeqCst);
        nudge.polling.store(false, Ordering::SeqCst);
        waker.wake();
        assert!(nudge.woken.load(Ordering::SeqCst));
        assert_eq!(counter.0.load(Ordering::SeqCst), 1, "the task is woken");
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
        let pool = H1Pool::new(Duration::from_secs(1));
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
        let pool = H1Pool::new(Duration::from_secs(1));
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
