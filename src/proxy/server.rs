//! The accept loop: one task per connection, HTTP/1.1 and HTTP/2 (cleartext,
//! negotiated per connection) from the client, and graceful shutdown
//! (hyper-util `examples/server_graceful.rs`): when `shutdown` resolves the
//! listener closes, open connections finish their responses, and after
//! `grace` whatever is left is dropped.

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::time::Duration;

use http::{Request, Response};
use hyper::body::Incoming;

use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto;
use hyper_util::server::graceful::GracefulShutdown;
use tokio::net::TcpListener;
use tokio::task::JoinSet;

use super::h1::CONN_BUF_BYTES;
use super::upstream::ProxyBody;

/// Serves `handler` on `listener` until `shutdown` resolves, then drains.
/// The handler never fails: errors are responses.
pub async fn serve<H, F>(
    listener: TcpListener,
    handler: H,
    shutdown: impl Future<Output = ()>,
    grace: Duration,
) where
    H: Fn(Request<Incoming>, SocketAddr) -> F + Clone + Send + Sync + 'static,
    F: Future<Output = Response<ProxyBody>> + Send + 'static,
{
    let graceful = GracefulShutdown::new();
    let mut builder = auto::Builder::new(TokioExecutor::new());
    // hyper queues a response's frames up to its buffer size before it
    // stops polling the body. Its default (about 400 KiB) let each slow
    // client hold that much of coalesced output; 64 KiB keeps a slow
    // stream's memory near one coalesced write.
    builder.http1().max_buf_size(CONN_BUF_BYTES);
    // The connection tasks, so that what outlives the grace period can be
    // stopped (dropping GracefulShutdown does not stop them).
    let mut connections = JoinSet::new();
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
                let conn = builder.serve_connection(TokioIo::new(stream), service).into_owned();
                let conn = graceful.watch(conn);
                connections.spawn(async move {
                    if let Err(err) = conn.await {
                        tracing::debug!(%peer, "connection ended: {err}");
                    }
                });
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
