//! The upstream side: where requests go, the HTTP client that sends them,
//! and the header hygiene of a proxy (RFC 9110 §7.6.1).
//!
//! - [`Upstream`]: the validated `--upstream` URL and how a request path
//!   maps onto it.
//! - [`build_client`]: for `https://`, hyper-util legacy clients over
//!   rustls (bundled web PKI roots plus `--upstream-ca`), HTTP/1.1 and
//!   HTTP/2 (ALPN), at most [`H2_STREAMS_PER_CONNECTION`] requests on a
//!   connection ([`TlsClients`]); for `http://`, the self-driven HTTP/1.1
//!   connections of [`h1`](super::h1). Both with a connect timeout.
//! - [`strip_hop_by_hop`]: removes the headers that describe one hop, both
//!   ways.
//!
//! It does not log header values: `Authorization`, `api-key`, `x-api-key`
//! and cookies must never reach a log.

use std::num::NonZeroUsize;
use std::path::Path;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::header::{self, HeaderMap, HeaderName};
use http::uri::{Authority, PathAndQuery, Scheme, Uri};
use http::{Request, Response};
use http_body::{Body, Frame, SizeHint};
use http_body_util::BodyExt;
use http_body_util::combinators::BoxBody;
use hyper::body::Incoming;
use hyper_rustls::HttpsConnector;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioTimer};
use rustls_pki_types::CertificateDer;
use rustls_pki_types::pem::PemObject;

use super::h1::{CONN_BUF_BYTES, DrivenBody, H1Error, H1Pool};
use super::replay::{self, Replayable};

/// Errors of bodies the proxy forwards, both ways.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The body type of every request and response the proxy produces.
pub type ProxyBody = BoxBody<Bytes, BoxError>;

/// The client that talks to the upstream, chosen by its scheme.
// One per proxy: the size of its variants does not matter.
#[allow(clippy::large_enum_variant)]
pub enum UpstreamClient {
    /// `https://`: hyper-util's pooled clients over rustls (HTTP/2 or
    /// HTTP/1.1 by ALPN); each connection runs in a task of its own.
    Tls(TlsClients),
    /// `http://`: HTTP/1.1 connections driven by the responses that use
    /// them (see [`h1`](super::h1) for why).
    Plain(Arc<H1Pool>),
}

/// The most requests an `https://` upstream is sent on one of its HTTP/2
/// connections at once; the next opens another. hyper-util's client keeps
/// one HTTP/2 connection to a host and queues what its peer's
/// `SETTINGS_MAX_CONCURRENT_STREAMS` does not let in (hyper issue #2197),
/// so that stream 129 to a server that allows 128 (nginx's default)
/// waited for a stream to end: minutes, for a model's answers. 100 is the
/// least RFC 9113 (section 6.5.2) asks a server to allow.
pub const H2_STREAMS_PER_CONNECTION: usize = 100;

/// How much of a response an HTTP/2 upstream may send before the proxy's
/// client reads it (the stream's flow-control window). The proxy reads
/// a response as its client takes it, so a client that stops reading
/// leaves this much waiting, and no more.
const H2_STREAM_WINDOW: u32 = 1 << 20;

/// The window of a whole HTTP/2 connection: room for every stream it
/// carries to hold its own window. With hyper's default (5 MiB against
/// 2 MiB a stream), three clients that stopped reading stopped every
/// other stream on the connection.
const H2_CONNECTION_WINDOW: u32 = H2_STREAM_WINDOW * H2_STREAMS_PER_CONNECTION as u32;

type TlsClient = Client<TimedConnect<HttpsConnector<HttpConnector>>, ProxyBody>;

/// hyper-util clients to an `https://` upstream, each with a pool (and so
/// an HTTP/2 connection) of its own, and the requests each has open: a
/// request goes to the least busy, and a new client is made when all
/// have [`H2_STREAMS_PER_CONNECTION`] open. There are as many as the
/// most requests ever open at once needed (they are kept: a client is a
/// few hundred bytes); an idle one's connections close after its pool's
/// idle timeout (hyper-util's 90 s, swept by the pool's timer).
pub struct TlsClients {
    builder: hyper_util::client::legacy::Builder,
    connector: TimedConnect<HttpsConnector<HttpConnector>>,
    per_client: usize,
    clients: Mutex<Vec<(TlsClient, Arc<AtomicUsize>)>>,
}

/// A request open on one of [`TlsClients`]: counted until dropped.
pub struct Open(Arc<AtomicUsize>);

impl Drop for Open {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

impl TlsClients {
    /// A client for the next request, and its count taken.
    fn pick(&self) -> (TlsClient, Open) {
        let mut clients = self.clients.lock().unwrap_or_else(|e| e.into_inner());
        let least = clients
            .iter()
            .min_by_key(|(_, open)| open.load(Ordering::Relaxed))
            .filter(|(_, open)| open.load(Ordering::Relaxed) < self.per_client)
            .cloned();
        let (client, open) = match least {
            Some(least) => least,
            None => {
                let made = (
                    self.builder.build(self.connector.clone()),
                    Arc::new(AtomicUsize::new(0)),
                );
                clients.push(made.clone());
                made
            }
        };
        open.fetch_add(1, Ordering::Relaxed);
        (client, Open(open))
    }
}

/// Why an upstream request got no response.
#[derive(Debug, thiserror::Error)]
pub enum SendError {
    #[error(transparent)]
    Tls(#[from] hyper_util::client::legacy::Error),
    #[error(transparent)]
    Plain(#[from] H1Error),
}

impl SendError {
    /// No connection could be made.
    pub fn is_connect(&self) -> bool {
        match self {
            SendError::Tls(err) => err.is_connect(),
            SendError::Plain(err) => matches!(err, H1Error::Connect(_)),
        }
    }
}

/// A response body from the upstream.
// It lives inside the boxed `TapBody`; boxing the large variant would only
// add an allocation per response.
#[allow(clippy::large_enum_variant)]
pub enum UpstreamBody {
    /// With its request counted open on its client until it is dropped.
    Tls(Incoming, Open),
    Plain(DrivenBody),
}

impl UpstreamClient {
    /// Sends a request (its URI absolute) and returns the response head.
    pub async fn request(
        &self,
        req: Request<ProxyBody>,
    ) -> Result<Response<UpstreamBody>, SendError> {
        match self {
            // Boxed: its state (a request head kept to send again, and
            // two sends) would otherwise grow every request's future, the
            // `http://` ones' too, and so every open stream's memory.
            UpstreamClient::Tls(clients) => Box::pin(Self::tls_request(clients, req)).await,
            UpstreamClient::Plain(pool) => Ok(pool.request(req).await?.map(UpstreamBody::Plain)),
        }
    }

    /// [`request`](Self::request) to an `https://` upstream.
    async fn tls_request(
        clients: &TlsClients,
        req: Request<ProxyBody>,
    ) -> Result<Response<UpstreamBody>, SendError> {
        let (client, open) = clients.pick();
        // Sent once more, on a stream of another connection, when
        // the upstream refused it unprocessed (see `replay`).
        let (parts, body) = req.into_parts();
        let again = Request::from_parts(head_of(&parts), ());
        let (body, replay) = Replayable::new(body);
        let first = client
            .request(Request::from_parts(parts, body.boxed()))
            .await;
        let response = match first {
            Err(err) if replay::refused_unprocessed(&err) => {
                let Some(body) = replay.again() else {
                    return Err(err.into());
                };
                tracing::debug!(
                    "the upstream refused a request unprocessed ({}); sent again",
                    error_chain(&err)
                );
                client.request(again.map(|()| body.boxed())).await?
            }
            first => first?,
        };
        Ok(response.map(|body| UpstreamBody::Tls(body, open)))
    }
}

/// A copy of a request's head, without its extensions (the proxy sets
/// none).
fn head_of(parts: &http::request::Parts) -> http::request::Parts {
    let mut head = Request::new(()).into_parts().0;
    head.method = parts.method.clone();
    head.uri = parts.uri.clone();
    head.version = parts.version;
    head.headers = parts.headers.clone();
    head
}

impl Body for UpstreamBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        match self.get_mut() {
            UpstreamBody::Tls(body, _) => Pin::new(body).poll_frame(cx).map_err(|err| {
                Box::new(TlsBodyError {
                    message: error_chain(&err),
                    source: err,
                }) as BoxError
            }),
            UpstreamBody::Plain(body) => Pin::new(body).poll_frame(cx),
        }
    }

    fn is_end_stream(&self) -> bool {
        match self {
            UpstreamBody::Tls(body, _) => body.is_end_stream(),
            UpstreamBody::Plain(body) => body.is_end_stream(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match self {
            UpstreamBody::Tls(body, _) => body.size_hint(),
            UpstreamBody::Plain(body) => body.size_hint(),
        }
    }
}

/// An error and its causes, `: `-separated, each once.
pub fn error_chain(err: &(dyn std::error::Error + 'static)) -> String {
    let mut out = err.to_string();
    let mut source = err.source();
    while let Some(e) = source {
        let text = e.to_string();
        if !out.contains(&text) {
            out.push_str(": ");
            out.push_str(&text);
        }
        source = e.source();
    }
    out
}

/// Whether `err` or one of its causes passes `test`, the errors that I/O
/// errors carry included: an I/O error's `source` skips the error inside
/// it (hyper-rustls's, inside hyper-util's connect error, is an I/O
/// error that holds rustls's).
pub(crate) fn has_cause(
    err: &(dyn std::error::Error + 'static),
    test: &dyn Fn(&(dyn std::error::Error + 'static)) -> bool,
) -> bool {
    find_cause(err, &|e| test(e).then_some(())).is_some()
}

/// What `find` says of the first of `err` and its causes it says
/// something of, in [`has_cause`]'s order.
pub(crate) fn find_cause<T>(
    err: &(dyn std::error::Error + 'static),
    find: &dyn Fn(&(dyn std::error::Error + 'static)) -> Option<T>,
) -> Option<T> {
    if let Some(found) = find(err) {
        return Some(found);
    }
    if let Some(found) = err
        .downcast_ref::<std::io::Error>()
        .and_then(std::io::Error::get_ref)
        .and_then(|inner| find_cause(inner, find))
    {
        return Some(found);
    }
    err.source().and_then(|source| find_cause(source, find))
}

/// An error of an `https://` upstream's response body, its causes in its
/// message: hyper's own says "error reading a body from connection", and
/// not why.
#[derive(Debug, thiserror::Error)]
#[error("{message}")]
pub struct TlsBodyError {
    message: String,
    #[source]
    source: hyper::Error,
}

/// Why the upstream configuration is unusable.
#[derive(Debug, thiserror::Error)]
pub enum UpstreamConfigError {
    #[error("--upstream {url:?} is not a URL: {reason}")]
    BadUrl { url: String, reason: String },
    #[error("--upstream {url:?} must be an http:// or https:// URL")]
    BadScheme { url: String },
    #[error(
        "--upstream must not contain credentials (user:password@); let the client send \
         its Authorization header, which is forwarded"
    )]
    Credentials,
    #[error(
        "--upstream-ca applies to an https:// upstream, and --upstream is http://; \
         leave one out"
    )]
    CaForHttp,
    #[error("cannot read --upstream-ca {path}: {reason}")]
    BadCa { path: String, reason: String },
    #[error("TLS setup failed: {0}")]
    Tls(#[from] rustls::Error),
}

/// Why a request's path cannot go to the upstream.
#[derive(Debug, thiserror::Error)]
pub enum PathError {
    #[error(
        "it has a `.` or `..` segment, which the upstream could resolve to a path \
         outside {prefix}"
    )]
    DotSegment { prefix: String },
    #[error(transparent)]
    Http(#[from] http::Error),
}

/// The validated `--upstream` URL.
#[derive(Debug, Clone)]
pub struct Upstream {
    scheme: Scheme,
    authority: Authority,
    /// The URL's path without a trailing `/` (empty for the root).
    path_prefix: String,
}

impl Upstream {
    pub fn parse(url: &str) -> Result<Upstream, UpstreamConfigError> {
        let bad = |reason: &str| UpstreamConfigError::BadUrl {
            url: url.to_owned(),
            reason: reason.to_owned(),
        };
        let uri: Uri = url
            .parse()
            .map_err(|e: http::uri::InvalidUri| bad(&e.to_string()))?;
        let scheme = uri
            .scheme()
            .cloned()
            .ok_or_else(|| UpstreamConfigError::BadScheme {
                url: url.to_owned(),
            })?;
        if scheme != Scheme::HTTP && scheme != Scheme::HTTPS {
            return Err(UpstreamConfigError::BadScheme {
                url: url.to_owned(),
            });
        }
        let authority = uri
            .authority()
            .cloned()
            .ok_or_else(|| bad("it has no host"))?;
        if authority.as_str().contains('@') {
            // They would be printed in logs and error bodies, and never
            // sent: credentials belong in a header the client sends.
            // Checked first: no other message may print such a URL.
            return Err(UpstreamConfigError::Credentials);
        }
        // What follows the host (after an IPv6 address's `]`); an empty
        // port is the scheme's (RFC 3986 §3.2.3).
        let after_host = authority
            .as_str()
            .rsplit_once(']')
            .map_or(authority.as_str(), |(_, rest)| rest);
        let port_given = after_host
            .rsplit_once(':')
            .is_some_and(|(_, port)| !port.is_empty());
        if port_given && authority.port_u16().is_none() {
            // Left to the client, a port that does not fit in 16 bits is
            // dropped, and the request goes to the scheme's default port.
            return Err(bad("its port is not a number from 0 to 65535"));
        }
        if uri.query().is_some() {
            return Err(bad(
                "it has a query string; give only scheme, host and path",
            ));
        }
        if url.contains('#') {
            // The parser drops it silently.
            return Err(bad(
                "it has a fragment (#…); give only scheme, host and path",
            ));
        }
        let path_prefix = uri.path().trim_end_matches('/').to_owned();
        Ok(Upstream {
            scheme,
            authority,
            path_prefix,
        })
    }

    /// `http://`: the proxy's own client, no TLS.
    pub fn is_plain_http(&self) -> bool {
        self.scheme == Scheme::HTTP
    }

    /// `host:port` as given, for messages.
    pub fn authority(&self) -> &Authority {
        &self.authority
    }

    /// The upstream URI for a request URI. The upstream URL's path is a
    /// prefix: a request path that already starts with it (at a segment
    /// boundary) is kept, any other gets it prepended. So with
    /// `--upstream https://host/v1`, both `/v1/chat/completions` and
    /// `/chat/completions` go to `https://host/v1/chat/completions`.
    ///
    /// Under a prefix, a path with a `.` or `..` segment (also written
    /// `%2e`) is refused: the upstream could resolve `/v1/../admin` to
    /// `/admin`, outside the prefix (RFC 3986 §5.2.4).
    pub fn uri_for(&self, request: &Uri) -> Result<Uri, PathError> {
        let path = request.path();
        let prefix = self.path_prefix.as_str();
        if !prefix.is_empty() && has_dot_segment(path) {
            return Err(PathError::DotSegment {
                prefix: prefix.to_owned(),
            });
        }
        let has_prefix = prefix.is_empty()
            || path == prefix
            || path
                .strip_prefix(prefix)
                .is_some_and(|rest| rest.starts_with('/'));
        // `OPTIONS *` asks about the server itself: its target goes as it
        // is, under no prefix (RFC 9112 §3.2.4).
        if path == "*" {
            return Ok(Uri::builder()
                .scheme(self.scheme.clone())
                .authority(self.authority.clone())
                .path_and_query(PathAndQuery::from_static("*"))
                .build()?);
        }
        let path_and_query = match request.path_and_query() {
            // The request's own path and query, shared rather than copied
            // (hyper's request head holds them; three allocations a
            // stream fewer, BENCHMARKS.md, forty-sixth round). Not an
            // absolute-form target with an empty path (`http://h?q`),
            // whose path is then `/` but whose text lacks it.
            Some(kept) if has_prefix && kept.as_str().starts_with('/') => kept.clone(),
            _ => {
                let mut joined = format!("{prefix}{path}");
                if let Some(query) = request.query() {
                    joined.push('?');
                    joined.push_str(query);
                }
                PathAndQuery::try_from(joined).map_err(http::Error::from)?
            }
        };
        Ok(Uri::builder()
            .scheme(self.scheme.clone())
            .authority(self.authority.clone())
            .path_and_query(path_and_query)
            .build()?)
    }
}

/// Whether `path` has a `.` or `..` segment, with `\\`, `%2F` and `%5C` also
/// taken for `/`: URL parsers of the WHATWG kind read `\\` as `/` in an
/// http URL, and some servers decode `%2F` before they resolve dots.
fn has_dot_segment(path: &str) -> bool {
    // Without a dot or an escape, no segment is one (the common case).
    if !path.contains(['.', '%']) {
        return false;
    }
    let bytes = path.as_bytes();
    let mut start = 0;
    let mut i = 0;
    while i < bytes.len() {
        let separator = match bytes[i] {
            b'/' | b'\\' => 1,
            b'%' if path.get(i + 1..i + 3).is_some_and(|hex| {
                hex.eq_ignore_ascii_case("2f") || hex.eq_ignore_ascii_case("5c")
            }) =>
            {
                3
            }
            _ => 0,
        };
        if separator > 0 {
            if is_dot_segment(&path[start..i]) {
                return true;
            }
            i += separator;
            start = i;
        } else {
            i += 1;
        }
    }
    is_dot_segment(&path[start..])
}

/// `.` or `..`, either dot written as it is or as `%2e` / `%2E`, with
/// any parameters after it (`..;x`, `..%3B`): servlet containers (Tomcat,
/// Jetty) drop a segment's parameters before they resolve dots.
fn is_dot_segment(segment: &str) -> bool {
    let segment = segment.split(';').next().unwrap_or_default();
    let segment = match segment
        .as_bytes()
        .windows(3)
        .position(|w| w.eq_ignore_ascii_case(b"%3b"))
    {
        Some(at) => &segment[..at],
        None => segment,
    };
    let rest = segment
        .strip_prefix('.')
        .or_else(|| strip_encoded_dot(segment));
    match rest {
        Some("") => true,
        Some(rest) => rest == "." || strip_encoded_dot(rest) == Some(""),
        None => false,
    }
}

fn strip_encoded_dot(s: &str) -> Option<&str> {
    s.get(..3)
        .filter(|head| head.eq_ignore_ascii_case("%2e"))
        .map(|_| &s[3..])
}

/// Builds the upstream client. `idle_timeout` bounds how long the rest of
/// a request body may stall once its response has ended (plain-HTTP
/// upstreams; see [`H1Pool`]).
pub fn build_client(
    upstream: &Upstream,
    extra_ca: Option<&Path>,
    connect_timeout: Duration,
    idle_timeout: Duration,
) -> Result<UpstreamClient, UpstreamConfigError> {
    if upstream.scheme == Scheme::HTTP {
        if let Some(path) = extra_ca {
            // Taken silently, it would hide a mistyped scheme.
            return Err(UpstreamConfigError::BadCa {
                path: path.display().to_string(),
                reason: "it applies to an https:// upstream, and this one is http://".into(),
            });
        }
        return Ok(UpstreamClient::Plain(H1Pool::new(
            connect_timeout,
            idle_timeout,
        )));
    }
    let mut roots = rustls::RootCertStore {
        roots: webpki_roots::TLS_SERVER_ROOTS.to_vec(),
    };
    if let Some(path) = extra_ca {
        let bad = |reason: String| UpstreamConfigError::BadCa {
            path: path.display().to_string(),
            reason,
        };
        let mut added = 0;
        for cert in CertificateDer::pem_file_iter(path).map_err(|e| bad(e.to_string()))? {
            let cert = cert.map_err(|e| bad(e.to_string()))?;
            // rustls says a certificate it cannot read as a peer's
            // ("invalid peer certificate: BadEncoding"): this is the file's.
            roots.add(cert).map_err(|e| {
                let why = match e {
                    rustls::Error::InvalidCertificate(why) => format!("{why:?}"),
                    other => other.to_string(),
                };
                bad(format!(
                    "its certificate number {} is no X.509 certificate a CA can have ({why})",
                    added + 1
                ))
            })?;
            added += 1;
        }
        if added == 0 {
            return Err(bad("no PEM certificate in it".to_owned()));
        }
    }
    let provider = std::sync::Arc::new(rustls::crypto::ring::default_provider());
    let tls = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()?
        .with_root_certificates(roots)
        .with_no_client_auth();
    let mut http = HttpConnector::new();
    http.enforce_http(false);
    http.set_nodelay(true);
    let connector = hyper_rustls::HttpsConnectorBuilder::new()
        .with_tls_config(tls)
        .https_or_http()
        .enable_http1()
        .enable_http2()
        .wrap_connector(http);
    // The timeout covers the TLS handshake too: an upstream that takes
    // the connection and never answers its ClientHello is as unreachable
    // as one that never takes it (HttpConnector's own timeout covers only
    // the TCP connect).
    let connector = TimedConnect {
        inner: connector,
        timeout: connect_timeout,
    };
    let mut builder = Client::builder(TokioExecutor::new());
    builder
        // Without a timer, an idle connection is found expired only when
        // its client next takes one from its pool.
        .pool_timer(TokioTimer::new())
        .http2_initial_stream_window_size(H2_STREAM_WINDOW)
        .http2_initial_connection_window_size(H2_CONNECTION_WINDOW)
        // A response head's limit, as for `http://` upstreams (hyper's
        // would be about 400 KiB over HTTP/1.1, 16 KiB over HTTP/2).
        .http1_max_buf_size(CONN_BUF_BYTES)
        .http2_max_header_list_size(CONN_BUF_BYTES as u32);
    Ok(UpstreamClient::Tls(TlsClients {
        builder,
        connector,
        per_client: H2_STREAMS_PER_CONNECTION,
        clients: Mutex::new(Vec::new()),
    }))
}

impl UpstreamClient {
    /// The same client, sending at most `streams` requests on one HTTP/2
    /// connection to an `https://` upstream (see
    /// [`H2_STREAMS_PER_CONNECTION`]); for tests.
    pub fn with_h2_streams_per_connection(mut self, streams: NonZeroUsize) -> UpstreamClient {
        if let UpstreamClient::Tls(clients) = &mut self {
            clients.per_client = streams.get();
        }
        self
    }
}

/// A connector whose connections, handshakes included, must be made
/// within `timeout`; past it, an [`std::io::ErrorKind::TimedOut`] error, which
/// the service answers with `504` as it does a TCP connect that timed out.
#[derive(Clone)]
pub struct TimedConnect<C> {
    inner: C,
    timeout: Duration,
}

impl<C> tower_service::Service<http::Uri> for TimedConnect<C>
where
    C: tower_service::Service<http::Uri>,
    C::Error: Into<BoxError>,
    C::Future: Send + 'static,
{
    type Response = C::Response;
    type Error = BoxError;
    type Future = Pin<Box<dyn Future<Output = Result<C::Response, BoxError>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        self.inner.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, uri: http::Uri) -> Self::Future {
        let timeout = self.timeout;
        let connecting = self.inner.call(uri);
        Box::pin(async move {
            match tokio::time::timeout(timeout, connecting).await {
                Ok(connected) => connected.map_err(Into::into),
                Err(_) => Err(Box::new(std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    format!("connect (TCP and TLS) timed out after {timeout:?}"),
                )) as BoxError),
            }
        })
    }
}

/// Headers that describe one connection, not the message (RFC 9110 §7.6.1),
/// and `Upgrade` (the proxy does not tunnel). `Trailer` is not one: it
/// names the trailers a chunked body ends with, which pass through, and
/// hyper's HTTP/1.1 server writes only the trailers it names.
const HOP_BY_HOP: [HeaderName; HOPS] = [
    header::CONNECTION,
    HeaderName::from_static("keep-alive"),
    HeaderName::from_static("proxy-connection"),
    header::PROXY_AUTHENTICATE,
    header::PROXY_AUTHORIZATION,
    header::TE,
    header::TRANSFER_ENCODING,
    header::UPGRADE,
];
const HOPS: usize = 8;

/// Where `Transfer-Encoding` is in [`HOP_BY_HOP`].
const TRANSFER_ENCODING_AT: usize = 6;

/// The request headers that carry credentials, in the forms OpenAI-style
/// APIs take them.
const CREDENTIALS: [HeaderName; 4] = [
    header::AUTHORIZATION,
    header::COOKIE,
    HeaderName::from_static("api-key"),
    HeaderName::from_static("x-api-key"),
];

/// Marks the credentials a client sends (`Authorization`, `Cookie`,
/// `api-key`, `x-api-key`) sensitive, so that HTTP/2's header
/// compression never puts them in its table (RFC 7541 §7.1.3): one
/// connection to the upstream carries the requests of every client, and a
/// value in its table could be probed by a client whose own headers are
/// compressed against it.
pub fn mark_credentials_sensitive(headers: &mut HeaderMap) {
    for name in &CREDENTIALS {
        if let http::header::Entry::Occupied(mut entry) = headers.entry(name) {
            for value in entry.iter_mut() {
                value.set_sensitive(true);
            }
        }
    }
}

/// Removes hop-by-hop headers, including those `Connection` names, and
/// `Upgrade` (the proxy does not tunnel). A `Content-Length` beside a
/// `Transfer-Encoding` goes too: the body was framed by the latter, and
/// the length, which no longer describes it, must not be forwarded (RFC
/// 9112 §6.3).
pub fn strip_hop_by_hop(headers: &mut HeaderMap) {
    // Most messages carry none of them, or only `Transfer-Encoding`: find
    // the ones present, then remove those. Removing all nine by name hashed
    // each, about 1,200 instructions a message, twice a stream
    // (BENCHMARKS.md, forty-second round). What was found is kept on the
    // stack, not in a list, which every chunked message allocated
    // (forty-sixth round), and removed in the order it came:
    // `HeaderMap::remove` moves the last entry into the hole, so the order
    // of the removals decides the order of the headers that stay.
    // Each name once (`keys` gives each once), as its place in the table.
    let mut found = [0usize; HOPS];
    let mut count = 0;
    for name in headers.keys() {
        if let Some(i) = HOP_BY_HOP.iter().position(|hop| hop == name)
            && let Some(slot) = found.get_mut(count)
        {
            *slot = i;
            count += 1;
        }
    }
    let found = found.get(..count).unwrap_or_default();
    if found.is_empty() {
        return;
    }
    // Place 0 is `Connection`, whose values name more of them.
    let named: Vec<HeaderName> = if found.contains(&0) {
        headers
            .get_all(header::CONNECTION)
            .iter()
            .filter_map(|v| v.to_str().ok())
            .flat_map(|v| v.split(','))
            .filter_map(|name| HeaderName::from_bytes(name.trim().as_bytes()).ok())
            .collect()
    } else {
        Vec::new()
    };
    for &i in found {
        if let Some(name) = HOP_BY_HOP.get(i) {
            headers.remove(name);
        }
    }
    if found.contains(&TRANSFER_ENCODING_AT) {
        headers.remove(header::CONTENT_LENGTH);
    }
    for name in &named {
        headers.remove(name);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn map(upstream: &str, request: &str) -> String {
        let up = Upstream::parse(upstream).expect("valid upstream");
        up.uri_for(&request.parse().expect("valid request uri"))
            .expect("maps")
            .to_string()
    }

    /// The credentials a client sends go to an HTTP/2 upstream marked
    /// sensitive (never indexed by HPACK), every value of them; other
    /// headers are left as they are.
    #[test]
    fn credentials_are_marked_sensitive() {
        let mut headers = HeaderMap::new();
        for (name, value) in [
            ("authorization", "Bearer sk-1"),
            ("cookie", "a=1"),
            ("cookie", "b=2"),
            ("api-key", "k"),
            ("x-api-key", "k"),
            ("content-type", "application/json"),
        ] {
            headers.append(
                HeaderName::from_static(name),
                http::HeaderValue::from_static(value),
            );
        }
        mark_credentials_sensitive(&mut headers);
        for (name, value) in &headers {
            assert_eq!(
                value.is_sensitive(),
                name != header::CONTENT_TYPE,
                "{name}: {value:?}"
            );
        }
        assert_eq!(headers.len(), 6);
    }

    #[test]
    fn the_upstream_path_is_a_prefix() {
        assert_eq!(
            map("http://h:1", "/v1/chat/completions"),
            "http://h:1/v1/chat/completions"
        );
        assert_eq!(
            map("https://h/v1", "/v1/chat/completions"),
            "https://h/v1/chat/completions"
        );
        assert_eq!(
            map("https://h/v1/", "/chat/completions?x=1"),
            "https://h/v1/chat/completions?x=1"
        );
        assert_eq!(
            map("https://h/v1", "/v1beta/models"),
            "https://h/v1/v1beta/models"
        );
        assert_eq!(map("https://h/v1", "/v1"), "https://h/v1");
        assert_eq!(
            map("https://h/v1", "/v1/chat?stream=1&x=%20"),
            "https://h/v1/chat?stream=1&x=%20"
        );
        assert_eq!(map("http://h:1", "/a?"), "http://h:1/a?");
        assert_eq!(map("http://h:1", "http://e?q"), "http://h:1/?q");
        assert_eq!(map("http://h:1", "http://e"), "http://h:1/");
        assert_eq!(
            map("http://h:1", "http://elsewhere:2/v1/x?q#frag"),
            "http://h:1/v1/x?q"
        );
    }

    #[test]
    fn a_path_kept_whole_is_shared_not_copied() {
        let up = Upstream::parse("https://h/v1").expect("valid upstream");
        let request: Uri = "/v1/chat/completions?x=1"
            .parse()
            .expect("valid request uri");
        let mapped = up.uri_for(&request).expect("maps");
        let kept = |uri: &Uri| uri.path_and_query().map(|pq| pq.as_str().as_ptr());
        assert_eq!(kept(&mapped), kept(&request));
        // A path that gets the prefix is a new one.
        let request: Uri = "/chat/completions".parse().expect("valid request uri");
        let mapped = up.uri_for(&request).expect("maps");
        assert_eq!(mapped.path(), "/v1/chat/completions");
        assert_ne!(kept(&mapped), kept(&request));
    }

    /// Under a path prefix, `.` and `..` segments, plain or encoded, are
    /// refused: the upstream could resolve them outside the prefix. Dots
    /// inside a segment are a name like any other; without a prefix there
    /// is nothing to leave.
    #[test]
    fn dot_segments_cannot_leave_the_upstream_path() {
        let up = Upstream::parse("http://h/v1").expect("valid upstream");
        for path in [
            "/../admin",
            "/v1/../admin",
            "/v1/./x",
            "/v1/x/..",
            "/%2e%2e/admin",
            "/v1/.%2E/admin",
            "/v1/%2E./admin",
            "/v1/%2e/admin",
            "/v1/..\\admin",
            "/v1/..%2Fadmin",
            "/v1/x%2f..%5cadmin",
            "/v1/..%5Cadmin",
            "/v1/..;/admin",
            "/v1/..;x=1/admin",
            "/v1/..%3b/admin",
            "/v1/%2e%2E%3Bx/admin",
            "/v1/.;/x",
        ] {
            let err = up
                .uri_for(&path.parse().expect("valid request uri"))
                .expect_err(path)
                .to_string();
            assert!(err.contains("outside /v1"), "{path}: {err}");
        }
        for (path, mapped) in [
            ("/v1/file.txt", "http://h/v1/file.txt"),
            ("/v1/...", "http://h/v1/..."),
            ("/v1/..a", "http://h/v1/..a"),
            ("/v1/%2e%2e%2e", "http://h/v1/%2e%2e%2e"),
            ("/v1/.well-known/x", "http://h/v1/.well-known/x"),
            ("/v1/a;b/x", "http://h/v1/a;b/x"),
            ("/v1/...;x", "http://h/v1/...;x"),
        ] {
            assert_eq!(map("http://h/v1", path), mapped, "{path}");
        }
        assert_eq!(map("http://h", "/a/../b"), "http://h/a/../b");
        // `OPTIONS *`: the server itself, under no prefix.
        assert_eq!(map("http://h/v1", "*"), "http://h*");
    }

    /// `--upstream-ca` with an `http://` upstream is a mistake (a scheme
    /// mistyped, most likely), said at start, not ignored.
    #[test]
    fn an_upstream_ca_for_an_http_upstream_is_refused() {
        let up = Upstream::parse("http://h:1").expect("valid upstream");
        let err = build_client(
            &up,
            Some(Path::new("ca.pem")),
            Duration::from_secs(1),
            Duration::from_secs(1),
        )
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default();
        assert!(err.contains("applies to an https:// upstream"), "{err}");
    }

    #[test]
    fn bad_upstreams_are_refused_with_a_reason() {
        for (url, wanted) in [
            ("ftp://h/", "must be an http"),
            ("h:80", "must be an http"),
            ("http://h/?a=1", "query string"),
            ("not a url", "is not a URL"),
            ("http://user:secret@h:1", "must not contain credentials"),
            (
                "https://user:sk-live-1@h/v1",
                "must not contain credentials",
            ),
            (
                "https://user:sk-live-1@h:99999",
                "must not contain credentials",
            ),
            (
                "http://127.0.0.1:99999",
                "port is not a number from 0 to 65535",
            ),
            ("https://h:80800/v1", "port is not a number from 0 to 65535"),
        ] {
            let err = Upstream::parse(url).expect_err(url).to_string();
            assert!(err.contains(wanted), "{url}: {err}");
            assert!(!err.contains("sk-live"), "{url}: a secret printed: {err}");
        }
        // An empty port is the scheme's.
        assert!(Upstream::parse("http://h:/v1").is_ok());
    }

    /// A header map of `pairs`, in order, repeats kept.
    fn header_map(pairs: &[(&'static str, &str)]) -> HeaderMap {
        let mut headers = HeaderMap::new();
        for &(k, v) in pairs {
            headers.append(HeaderName::from_static(k), v.parse().expect("value"));
        }
        headers
    }

    #[test]
    fn hop_by_hop_headers_go_and_named_ones_too() {
        let mut headers = header_map(&[
            ("connection", "keep-alive, x-hop"),
            ("keep-alive", "timeout=5"),
            ("x-hop", "1"),
            ("transfer-encoding", "chunked"),
            ("te", "trailers"),
            ("upgrade", "h2c"),
            ("authorization", "Bearer k"),
            ("content-type", "application/json"),
        ]);
        strip_hop_by_hop(&mut headers);
        let mut left: Vec<_> = headers.keys().map(|k| k.as_str()).collect();
        left.sort_unstable();
        assert_eq!(left, vec!["authorization", "content-type"]);
    }

    #[test]
    fn each_hop_by_hop_header_goes_with_its_repeats() {
        for name in [
            "connection",
            "keep-alive",
            "proxy-connection",
            "proxy-authenticate",
            "proxy-authorization",
            "te",
            "transfer-encoding",
            "upgrade",
        ] {
            let mut headers = header_map(&[
                ("content-type", "text/event-stream"),
                (name, "a"),
                ("x-kept", "1"),
                (name, "b"),
            ]);
            strip_hop_by_hop(&mut headers);
            let left: Vec<_> = headers.keys().map(|k| k.as_str()).collect();
            assert_eq!(left, ["content-type", "x-kept"], "{name}");
        }
    }

    #[test]
    fn the_table_knows_where_transfer_encoding_is() {
        assert_eq!(
            HOP_BY_HOP.get(TRANSFER_ENCODING_AT),
            Some(&header::TRANSFER_ENCODING)
        );
    }

    /// An upstream that sends both gets its body framed by
    /// `Transfer-Encoding`; forwarding its `Content-Length` would cut the
    /// body the client gets. Alone, a `Content-Length` stays.
    #[test]
    fn a_content_length_beside_a_transfer_encoding_goes() {
        let mut headers = header_map(&[
            ("content-length", "3"),
            ("content-type", "application/json"),
            ("transfer-encoding", "chunked"),
        ]);
        strip_hop_by_hop(&mut headers);
        let left: Vec<_> = headers.keys().map(|k| k.as_str()).collect();
        assert_eq!(left, ["content-type"]);
        let mut headers = header_map(&[("content-length", "3"), ("connection", "close")]);
        strip_hop_by_hop(&mut headers);
        let left: Vec<_> = headers.keys().map(|k| k.as_str()).collect();
        assert_eq!(left, ["content-length"]);
    }

    /// `Trailer` announces the trailers that pass through: it stays.
    #[test]
    fn a_trailer_announcement_stays() {
        let mut headers = header_map(&[("trailer", "x-usage"), ("transfer-encoding", "chunked")]);
        strip_hop_by_hop(&mut headers);
        let left: Vec<_> = headers
            .iter()
            .map(|(k, v)| (k.as_str(), v.as_bytes()))
            .collect();
        assert_eq!(left, [("trailer", &b"x-usage"[..])]);
    }

    /// The headers that stay keep the order they had when the names found
    /// were collected into a list and removed in the order they came.
    #[test]
    fn the_headers_that_stay_keep_their_order() {
        fn as_before(headers: &mut HeaderMap) {
            let mut present: Vec<HeaderName> = headers
                .keys()
                .filter(|name| HOP_BY_HOP.contains(name))
                .cloned()
                .collect();
            if present.contains(&header::CONNECTION) {
                let named: Vec<HeaderName> = headers
                    .get_all(header::CONNECTION)
                    .iter()
                    .filter_map(|v| v.to_str().ok())
                    .flat_map(|v| v.split(','))
                    .filter_map(|name| HeaderName::from_bytes(name.trim().as_bytes()).ok())
                    .collect();
                present.extend(named);
            }
            for name in &present {
                headers.remove(name);
            }
        }
        let cases: [&[(&'static str, &str)]; 4] = [
            &[
                ("transfer-encoding", "chunked"),
                ("connection", "x-hop"),
                ("x-a", "1"),
                ("x-b", "2"),
                ("x-hop", "3"),
                ("content-type", "text/event-stream"),
            ],
            &[
                ("x-a", "1"),
                ("upgrade", "h2c"),
                ("x-b", "2"),
                ("te", "trailers"),
                ("x-c", "3"),
                ("keep-alive", "timeout=5"),
                ("x-d", "4"),
            ],
            &[
                ("te", "trailers"),
                ("x-a", "1"),
                ("trailer", "x-t"),
                ("x-b", "2"),
                ("transfer-encoding", "chunked"),
                ("x-c", "3"),
            ],
            &[("x-a", "1"), ("x-b", "2"), ("transfer-encoding", "chunked")],
        ];
        for pairs in cases {
            let (mut now, mut before) = (header_map(pairs), header_map(pairs));
            strip_hop_by_hop(&mut now);
            as_before(&mut before);
            let order = |h: &HeaderMap| {
                h.iter()
                    .map(|(k, v)| (k.clone(), v.clone()))
                    .collect::<Vec<_>>()
            };
            assert_eq!(order(&now), order(&before), "{pairs:?}");
        }
    }

    /// A message without hop-by-hop headers keeps every header, values
    /// and repeats included; one with only `Transfer-Encoding` loses that
    /// alone.
    #[test]
    fn end_to_end_headers_stay() {
        let mut headers = header_map(&[
            ("content-type", "text/event-stream"),
            ("x-request-id", "a"),
            ("x-request-id", "b"),
            ("cache-control", "no-cache"),
        ]);
        let before = headers.clone();
        strip_hop_by_hop(&mut headers);
        assert_eq!(headers, before);
        headers.insert(header::TRANSFER_ENCODING, "chunked".parse().expect("value"));
        strip_hop_by_hop(&mut headers);
        assert_eq!(headers, before);
    }
}
