//! The accept loop: one task per connection, HTTP/1.1 and HTTP/2 (cleartext,
//! negotiated per connection) from the client, and graceful shutdown (as in
//! hyper-util's `examples/server_graceful.rs`, with a cheaper watch: see
//! `Drain`): when `shutdown` resolves the listener closes, open
//! connections finish their responses, and after `grace` whatever is left
//! is dropped.
//!
//! `serve` hands its connections in turn to [`Workers`]: one thread per
//! CPU, each running a current-thread runtime, as nginx runs one worker
//! process per CPU. A connection, the `http://` upstream connection it
//! takes (see [`H1Pool`](super::h1::H1Pool)'s per-thread idle lists) and its
//! timers stay on one thread, so an event that arrives wakes no other
//! thread. (An `https://` upstream's connections belong to hyper-util's
//! pooled client, shared by all workers: each runs as a task on the worker
//! that opened it, and its streams may be read from the others.) The
//! multi-thread runtime woke a second worker for about 0.6 events in 1, and
//! that cost a quarter of `serve`'s CPU per paced event (BENCHMARKS.md,
//! "Fifth round").

use std::convert::Infallible;
use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::num::NonZeroUsize;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::{Context, Poll};
use std::thread;
use std::time::Duration;

use http::{Request, Response};
use hyper::body::Incoming;

use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto;
use hyper_util::server::graceful::GracefulConnection;
use tokio::net::{TcpListener, TcpStream};
use tokio::runtime::{self, Handle};
use tokio::sync::{oneshot, watch};
use tokio::task::JoinSet;

use super::gate::GatedRead;
use super::h1::CONN_BUF_BYTES;
use super::upstream::ProxyBody;

/// Serves `handler` on `listener` until `shutdown` resolves, then drains.
/// The handler never fails: errors are responses. Each connection is served
/// on one of `workers` in turn, or on the current runtime when there are
/// none.
pub async fn serve<H, F>(
    listener: TcpListener,
    handler: H,
    shutdown: impl Future<Output = ()>,
    grace: Duration,
    workers: &[Handle],
) where
    H: Fn(Request<Incoming>, SocketAddr) -> F + Clone + Send + Sync + 'static,
    F: Future<Output = Response<ProxyBody>> + Send + 'static,
{
    let graceful = Drain::new();
    let mut builder = auto::Builder::new(TokioExecutor::new());
    // hyper queues a response's frames up to its buffer size before it
    // stops polling the body. Its default (about 400 KiB) let each slow
    // client hold that much of coalesced output; 64 KiB keeps a slow
    // stream's memory near one coalesced write.
    builder.http1().max_buf_size(CONN_BUF_BYTES);
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
    builder.http1().writev(false);
    // The connection tasks, so that what outlives the grace period can be
    // stopped (the drain only asks them to finish).
    let mut connections = JoinSet::new();
    let mut turn = 0usize;
    tokio::pin!(shutdown);
    loop {
        tokio::select! {
            accepted = listener.accept() => {
                let (stream, peer) = match accepted {
                    Ok(accepted) => accepted,
                    Err(err) => {
                        // Out of file descriptors and the like: wait instead
                        // of spinning; the listener itself stays usable.
                        tracing::warn!("accept failed: {err}");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                };
                let _ = stream.set_nodelay(true);
                let handler = handler.clone();
                let service = service_fn(move |req| {
                    let response = handler(req, peer);
                    async move { Ok::<_, Infallible>(response.await) }
                });
                let builder = builder.clone();
                let watcher = graceful.watcher();
                let serve = move |stream| async move {
                    let conn = builder.serve_connection(TokioIo::new(GatedRead::new(stream)), service);
                    if let Err(err) = watcher.watch(conn.into_owned()).await {
                        tracing::debug!(%peer, "connection ended: {err}");
                    }
                };
                if workers.is_empty() {
                    connections.spawn(serve(stream));
                } else {
                    // The socket leaves this runtime's reactor for the
                    // worker's, where its task runs.
                    let worker = &workers[turn % workers.len()];
                    turn = turn.wrapping_add(1);
                    match stream.into_std() {
                        Ok(stream) => {
                            connections.spawn_on(
                                async move {
                                    match TcpStream::from_std(stream) {
                                        Ok(stream) => serve(stream).await,
                                        Err(err) => tracing::warn!(%peer, "cannot hand the connection to a worker: {err}"),
                                    }
                                },
                                worker,
                            );
                        }
                        Err(err) => tracing::warn!(%peer, "cannot hand the connection to a worker: {err}"),
                    }
                }
                // Reap finished connections so the set stays as small as
                // the number of open ones.
                while connections.try_join_next().is_some() {}
            }
            () = &mut shutdown => break,
        }
    }
    drop(listener);
    tracing::info!("shutting down: waiting up to {grace:?} for open streams");
    tokio::select! {
        () = graceful.shutdown() => tracing::info!("all connections closed"),
        () = tokio::time::sleep(grace) => tracing::warn!("grace period over: closing open streams"),
    }
    connections.shutdown().await;
}

/// Graceful shutdown of the open connections, as hyper-util's
/// `GracefulShutdown` does it (a watch channel: its send tells every
/// connection to finish its response and close, and its sender sees when
/// the last of them has), with a flag in front of the channel. A
/// connection's task polls its receiver once, which registers the task's
/// waker, and after that only once the flag says the signal was sent:
/// hyper-util's polls the receiver every time the connection is polled,
/// about 160 instructions a poll, and in a paced stream a poll is an event
/// (BENCHMARKS.md, twenty-fifth round).
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
    /// Runs `conn`, shut down gracefully once the drain starts; the
    /// receiver is held until `conn` is done, so that the drain waits
    /// for it.
    fn watch<C: GracefulConnection>(self, conn: C) -> Watched<C, impl Future<Output = ()>> {
        let DrainWatcher { mut rx, started } = self;
        Watched {
            conn,
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
    /// A connection and its shutdown signal ([`DrainWatcher::watch`]).
    struct Watched<C, S> {
        #[pin]
        conn: C,
        #[pin]
        signal: S,
        started: Arc<AtomicBool>,
        // The signal was polled, and holds the task's waker.
        registered: bool,
        // The connection was told to finish.
        shut: bool,
    }
}

impl<C: GracefulConnection, S: Future<Output = ()>> Future for Watched<C, S> {
    type Output = C::Output;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<C::Output> {
        let mut this = self.project();
        if !*this.shut {
            if this.started.load(Ordering::Acquire) {
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

impl Workers {
    /// Starts `count` threads, named `worker-0`, `worker-1`, …, each with
    /// its own list of idle upstream connections (up to
    /// [`SHARDS`](super::h1::SHARDS) threads; see
    /// [`H1Pool`](super::h1::H1Pool)).
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
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// The names of the threads that served the requests on one connection
    /// (each response's body is its thread's name), the connection asking
    /// for `requests` responses, the last with `connection: close`.
    async fn served_by(addr: SocketAddr, requests: usize) -> Vec<String> {
        let mut stream = TcpStream::connect(addr).await.expect("connect");
        for i in 1..=requests {
            let close = if i == requests {
                "connection: close\r\n"
            } else {
                ""
            };
            let request = format!("GET /{i} HTTP/1.1\r\nhost: test\r\n{close}\r\n");
            stream.write_all(request.as_bytes()).await.expect("request");
        }
        let mut reply = String::new();
        stream.read_to_string(&mut reply).await.expect("reply");
        reply
            .split("\r\n\r\n")
            .skip(1)
            .map(|rest| rest.split("HTTP/1.1").next().unwrap_or("").to_owned())
            .collect()
    }

    /// Connections go to the workers in turn and each stays on its worker:
    /// every request of a keep-alive connection is served by the thread
    /// that took the connection, none on the accepting runtime.
    #[tokio::test]
    async fn connections_are_served_on_the_workers_in_turn() {
        let workers = Workers::start(NonZeroUsize::new(2).expect("2 > 0")).expect("workers");
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        let handler = |_req: Request<Incoming>, _peer: SocketAddr| async {
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
            serve(
                listener,
                handler,
                shutdown,
                Duration::from_secs(5),
                &handles,
            )
            .await;
        });

        let mut seen = Vec::new();
        for _ in 0..4 {
            seen.push(served_by(addr, 2).await);
        }
        let pair = |name: &str| vec![name.to_owned(), name.to_owned()];
        assert_eq!(
            seen,
            [
                pair("worker-0"),
                pair("worker-1"),
                pair("worker-0"),
                pair("worker-1")
            ],
        );

        stop.send(()).expect("the server runs");
        tokio::time::timeout(Duration::from_secs(10), server)
            .await
            .expect("the server stops")
            .expect("without a panic");
        drop(workers);
    }
}
