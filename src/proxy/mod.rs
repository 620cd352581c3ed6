//! `aalis-proxy serve`: a reverse proxy that injects progress into live
//! streams (SPEC.md, "Commands"; issue 3).
//!
//! Layout:
//! - [`server`]: accept loops, HTTP/1.1 + HTTP/2, graceful shutdown
//! - [`service`]: the request path: our headers → upstream request → response
//! - [`upstream`]: the upstream URL, the rustls client, hop-by-hop hygiene
//! - [`h1`]: the HTTP/1.1 client of plain-HTTP upstreams, whose response
//!   body reads its connection ([`h1::wire`]: the framing, pure)
//! - [`body`]: [`body::TapBody`], which runs the annotate pipeline on
//!   streamed responses as the client reads them
//! - [`sessions`]: per-session progress shared by all connections
//! - [`record`]: `--record`'s captures; [`replay`]: a request sent again
//!   when an HTTP/2 upstream refused it unprocessed
//!
//! Read [`run`] first.

pub mod admin;
pub mod body;
mod gate;
pub use gate::SocketFull;
pub mod h1;
pub mod metrics;
pub mod record;
pub mod replay;
pub mod server;
pub mod service;
pub mod sessions;
pub mod upstream;

use std::future::Future;
use std::path::PathBuf;
use std::time::Duration;

use bytes::BytesMut;
use tokio::net::TcpListener;

use crate::encode::InjectMode;
use service::Proxy;
use upstream::{Upstream, UpstreamConfigError};

/// Locks `mutex`, whether or not a thread panicked while holding it: what
/// it guards is never left half changed, and a request path must not panic.
fn lock<T>(mutex: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// The validated configuration of `serve`.
#[derive(Debug, Clone)]
pub struct ProxyConfig {
    pub upstream: Upstream,
    /// A PEM file of extra CA certificates for the upstream.
    pub upstream_ca: Option<PathBuf>,
    /// The inject mode when a request does not choose one.
    pub inject: InjectMode,
    /// Deadline for the TCP (and TLS) connection to the upstream.
    pub connect_timeout: Duration,
    /// Deadline for the upstream's response headers.
    pub response_timeout: Duration,
    /// Longest silence of the upstream in the middle of a body.
    pub idle_timeout: Duration,
    /// Longest a client may leave the bytes sent to it unread, its TCP
    /// window shut, before the kernel closes its connection
    /// (`TCP_USER_TIMEOUT`).
    pub client_timeout: Duration,
    /// How long open streams may run on after a shutdown signal.
    pub shutdown_grace: Duration,
    /// Stream events larger than this are passed on unparsed.
    pub max_event_bytes: usize,
    /// Record every streamed response here (`--record`); the directory
    /// must exist.
    pub record_dir: Option<PathBuf>,
    /// Sessions nothing uses are forgotten after this much idleness.
    pub session_ttl: Duration,
    /// Lets non-loopback clients use `/_aalis/` with `Authorization:
    /// Bearer <token>`.
    pub admin_token: Option<String>,
}

impl ProxyConfig {
    /// A configuration for `upstream` with the CLI's defaults.
    pub fn new(upstream: Upstream) -> ProxyConfig {
        ProxyConfig {
            upstream,
            upstream_ca: None,
            inject: InjectMode::Field,
            connect_timeout: Duration::from_secs(10),
            response_timeout: Duration::from_secs(600),
            idle_timeout: Duration::from_secs(300),
            client_timeout: Duration::from_secs(300),
            shutdown_grace: Duration::from_secs(10),
            max_event_bytes: crate::framing::sse::DEFAULT_MAX_EVENT_BYTES,
            record_dir: None,
            session_ttl: Duration::from_secs(600),
            admin_token: None,
        }
    }
}

/// Runs the proxy on `listener` until `shutdown` resolves and the open
/// streams have drained (or the grace period is over).
pub async fn run(
    listener: TcpListener,
    config: ProxyConfig,
    shutdown: impl Future<Output = ()>,
) -> Result<(), UpstreamConfigError> {
    let proxy = Proxy::from_config(config, sessions::SessionRegistry::new())?;
    serve_proxy(listener, proxy, shutdown).await;
    Ok(())
}

/// Serves a ready [`Proxy`] on `listener` until `shutdown` resolves and the
/// open streams have drained (or its grace period is over).
pub async fn serve_proxy(listener: TcpListener, proxy: Proxy, shutdown: impl Future<Output = ()>) {
    serve_proxy_on(listener, proxy, shutdown, &[]).await;
}

/// [`serve_proxy`], with each connection accepted and served by one of
/// `workers` (by the current runtime when there are none): see
/// [`server::Workers`].
pub async fn serve_proxy_on(
    listener: TcpListener,
    proxy: Proxy,
    shutdown: impl Future<Output = ()>,
    workers: &[tokio::runtime::Handle],
) {
    let grace = proxy.config().shutdown_grace;
    let client_timeout = proxy.config().client_timeout;
    let _purger = proxy.sessions().spawn_purger(proxy.config().session_ttl);
    let sessions = proxy.sessions().clone();
    let shutdown = async move {
        shutdown.await;
        sessions.close_subscriptions();
    };
    let refusals = proxy.clone();
    let options = server::ServeOptions {
        grace,
        head_timeout: server::HEAD_READ_TIMEOUT,
        client_timeout,
        refused: Box::new(move |head| refusals.refused_head(head)),
    };
    let handler = move |req, peer| {
        let proxy = proxy.clone();
        async move { proxy.handle(req, peer).await }
    };
    server::serve(listener, handler, shutdown, options, workers).await;
}

/// Moves an empty `buf` back to the start of its allocation when no piece
/// split off it is still held: the next bytes then go where the last ones
/// went, into memory still in the cache, not into the next lines along
/// (BENCHMARKS.md, thirty-eighth round). Whether it did; it never
/// allocates or copies, and does nothing to a buffer that holds bytes, is
/// already at its start, or shares its allocation. (`try_reclaim`, asked
/// for more than the buffer has left, goes back to the start when it is
/// the only handle left.)
pub(crate) fn rewind(buf: &mut BytesMut) -> bool {
    buf.is_empty() && buf.try_reclaim(buf.capacity() + 1)
}
