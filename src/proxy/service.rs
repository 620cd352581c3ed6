//! The request path of the proxy, as a timeline of named phases (pingora's
//! `proxy_trait.rs`): route → read our headers → build the upstream request
//! → send it (with a deadline for the response headers) → shape the
//! response. Errors say whose fault they are: a bad request is a `400`, an
//! unreachable upstream a `502`, a slow one a `504`, each with an
//! OpenAI-style JSON error body so SDKs surface the message.
//!
//! Read [`Proxy::handle`] first.

use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::Bytes;
use clap::ValueEnum;
use http::header::{self, HeaderName, HeaderValue};
use http::{Request, Response, StatusCode};
use http_body::Body as _;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;

use super::ProxyConfig;
use super::admin;
use super::body::{ClientBodyFailure, ClientBodyNote, RequestLog, TapBody, log_safe};
use super::gate::SocketFull;
use super::h1::wire::MAX_HEADERS;
use super::h1::{H1Error, wire};
use super::metrics::{Metrics, UpstreamErrorKind};
use super::record::{self, OpenRecordings, Recorder};
use super::server::{Peer, RefusedHead};
use super::sessions::SessionRegistry;
use super::upstream::{
    BoxError, ProxyBody, SendError, UpstreamClient, UpstreamConfigError, build_client, error_chain,
    find_cause, has_cause, mark_credentials_sensitive, strip_hop_by_hop,
};
use crate::encode::{InjectMode, OutputFormat};
use crate::framing::Framing;
use crate::pipeline::{Annotator, AnnotatorConfig};

/// Names the session of a request; generated when absent and always
/// returned on the response.
pub const SESSION_HEADER: HeaderName = HeaderName::from_static("x-aalis-session");
/// Chooses the inject mode of one request (`field`, `comment`, …).
pub const INJECT_HEADER: HeaderName = HeaderName::from_static("x-aalis-inject");

/// Paths under this prefix are the proxy's own, never the upstream's.
pub const ADMIN_PREFIX: &str = "/_aalis/";

/// Longest session id accepted.
const MAX_SESSION_ID_BYTES: usize = 128;

/// The proxy service; cheap to clone (one `Arc`).
#[derive(Clone)]
pub struct Proxy {
    shared: Arc<Shared>,
}

struct Shared {
    metrics: Arc<Metrics>,
    /// `--record`: where streamed responses are saved.
    recorder: Option<Recorder>,
    config: ProxyConfig,
    client: UpstreamClient,
    sessions: SessionRegistry,
    /// For generated session ids: `s-`, a per-process random part and a
    /// dash, written once (a `format!` of the whole id cost about 1,800
    /// instructions a stream, BENCHMARKS.md, forty-second round)…
    session_prefix: String,
    /// … and a counter.
    session_counter: AtomicU64,
    /// This process's name in `Via`: `aalis-` and sixteen random hex
    /// digits, what a request coming back carries ([`Shared::came_back`]).
    via_name: String,
    /// The entries it adds to the `Via` of every request it forwards, by
    /// the protocol the request came by (RFC 9110 §7.6.3): HTTP/1.1,
    /// HTTP/2, HTTP/1.0.
    via: [HeaderValue; 3],
    /// An inject mode that does not apply to NDJSON (`comment`, `event`,
    /// `chunk`) has been said once: such streams get `field`, and a
    /// warning for each of them (as Ollama's native routes behind
    /// `--inject comment` made) said nothing new.
    ndjson_inject_said: AtomicBool,
    /// A stream that came compressed (so unread) has been said once.
    encoded_stream_said: AtomicBool,
}

impl Shared {
    /// Whether `headers` hold this process's own `Via` entry: the request
    /// went out of this proxy and came back to it, an `--upstream` that
    /// leads here (its own listen address, or a proxy in between that
    /// points back). Forwarded again, it would go round until the sockets
    /// ran out, some 10,000 requests in a second.
    fn came_back(&self, headers: &http::HeaderMap) -> bool {
        let own = self.via_name.as_bytes();
        headers
            .get_all(header::VIA)
            .iter()
            .any(|via| via.as_bytes().windows(own.len()).any(|w| w == own))
    }

    /// The `Via` entry of a request that came by `version`.
    fn via(&self, version: http::Version) -> HeaderValue {
        let [http_11, http_2, http_10] = &self.via;
        match version {
            http::Version::HTTP_2 => http_2.clone(),
            http::Version::HTTP_10 => http_10.clone(),
            _ => http_11.clone(),
        }
    }
}

/// Whose fault an error response is, and its JSON `type`.
#[derive(Debug, Clone, Copy)]
enum Fault {
    /// The client sent something we cannot use.
    BadRequest,
    /// The upstream could not be reached.
    UpstreamUnreachable,
    /// The upstream did not answer in time.
    UpstreamTimeout,
    /// The upstream connection failed after it was made.
    UpstreamError,
    /// The client's request body failed while it was being forwarded (the
    /// client went away, or sent less than it announced): its fault, not
    /// the upstream's.
    ClientAborted,
    /// The client stopped sending its request body, and sent no more of
    /// it within `--response-timeout`.
    ClientTimeout,
    /// The client asked for a tunnel (a WebSocket upgrade, CONNECT),
    /// which the proxy does not make, or sent its body in a transfer
    /// coding other than `chunked`.
    NotImplemented,
    /// The request came back to the proxy that forwarded it (its `Via`):
    /// `--upstream` leads to this proxy.
    Loop,
    /// The request head has more header fields than the proxy takes
    /// ([`MAX_REQUEST_FIELDS`]; hyper's own limit over HTTP/1.1).
    HeadTooLarge,
}

impl Fault {
    fn status(self) -> StatusCode {
        match self {
            Fault::BadRequest | Fault::ClientAborted => StatusCode::BAD_REQUEST,
            Fault::ClientTimeout => StatusCode::REQUEST_TIMEOUT,
            Fault::UpstreamUnreachable | Fault::UpstreamError => StatusCode::BAD_GATEWAY,
            Fault::UpstreamTimeout => StatusCode::GATEWAY_TIMEOUT,
            Fault::NotImplemented => StatusCode::NOT_IMPLEMENTED,
            Fault::Loop => StatusCode::LOOP_DETECTED,
            Fault::HeadTooLarge => StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE,
        }
    }

    fn kind(self) -> &'static str {
        match self {
            Fault::BadRequest
            | Fault::ClientAborted
            | Fault::ClientTimeout
            | Fault::HeadTooLarge => "invalid_request_error",
            Fault::UpstreamUnreachable => "upstream_unreachable",
            Fault::UpstreamTimeout => "upstream_timeout",
            Fault::UpstreamError => "upstream_error",
            Fault::NotImplemented => "not_implemented",
            Fault::Loop => "loop_detected",
        }
    }

    /// The status of the request's log line: the one sent, but for a
    /// client gone inside its body, which left before the answer: nginx's
    /// 499, as for one that left while the upstream was silent (the `400`
    /// it is sent reaches it only if it still reads).
    fn logged_status(self) -> StatusCode {
        match self {
            Fault::ClientAborted => {
                StatusCode::from_u16(CLIENT_CLOSED_REQUEST).unwrap_or(StatusCode::BAD_REQUEST)
            }
            _ => self.status(),
        }
    }

    /// The outcome word of the request's log line.
    fn outcome(self) -> &'static str {
        match self {
            // The same word as a stream whose client went away.
            Fault::ClientAborted => "cancelled",
            // Not `client-timeout`: that is `--client-timeout`'s, a client
            // that stops reading (logged as `cancelled`).
            Fault::ClientTimeout => "client_body_timeout",
            Fault::BadRequest
            | Fault::HeadTooLarge
            | Fault::NotImplemented
            | Fault::Loop
            | Fault::UpstreamUnreachable
            | Fault::UpstreamTimeout
            | Fault::UpstreamError => self.kind(),
        }
    }

    /// Whose fault a request is whose client's body failed so.
    fn of_client_body(failure: &ClientBodyFailure) -> Fault {
        match failure.gone {
            true => Fault::ClientAborted,
            false => Fault::BadRequest,
        }
    }
}

impl Proxy {
    pub fn new(config: ProxyConfig, client: UpstreamClient, sessions: SessionRegistry) -> Proxy {
        use std::hash::{BuildHasher, Hasher};
        // RandomState is seeded randomly per process: enough to keep
        // generated ids of two runs apart, without a dependency.
        let random = || {
            std::collections::hash_map::RandomState::new()
                .build_hasher()
                .finish()
        };
        let session_seed = random();
        let via_name = format!("aalis-{:016x}", random());
        let via = ["1.1", "2", "1.0"].map(|protocol| {
            HeaderValue::try_from(format!("{protocol} {via_name}"))
                .unwrap_or_else(|_| HeaderValue::from_static("1.1 aalis"))
        });
        Proxy {
            shared: Arc::new(Shared {
                metrics: Arc::new(Metrics::default()),
                recorder: config.record_dir.as_deref().map(Recorder::new),
                config,
                client,
                sessions,
                session_prefix: session_prefix(session_seed),
                session_counter: AtomicU64::new(0),
                ndjson_inject_said: AtomicBool::new(false),
                encoded_stream_said: AtomicBool::new(false),
                via_name,
                via,
            }),
        }
    }

    /// A proxy with its own upstream client, publishing to `sessions`.
    pub fn from_config(
        config: ProxyConfig,
        sessions: SessionRegistry,
    ) -> Result<Proxy, UpstreamConfigError> {
        let client = build_client(
            &config.upstream,
            config.upstream_ca.as_deref(),
            config.connect_timeout,
            config.idle_timeout,
        )?;
        Ok(Proxy::new(config, client, sessions))
    }

    pub fn config(&self) -> &ProxyConfig {
        &self.shared.config
    }

    pub fn metrics(&self) -> &Arc<Metrics> {
        &self.shared.metrics
    }

    pub fn sessions(&self) -> &SessionRegistry {
        &self.shared.sessions
    }

    /// `--record`'s open recordings, for an exit that will not wait for
    /// their streams; `None` without `--record`.
    pub fn open_recordings(&self) -> Option<OpenRecordings> {
        self.shared.recorder.as_ref().map(Recorder::open_recordings)
    }

    /// Handles one request; never fails (errors become responses).
    pub async fn handle(&self, req: Request<Incoming>, peer: Peer) -> Response<ProxyBody> {
        // Phase 0: our own routes are never forwarded upstream; they take
        // the request head's rules too.
        if req.uri().path().starts_with(ADMIN_PREFIX) || req.uri().path() == "/_aalis" {
            // Boxed: its state stays out of every proxied request's future.
            return Box::pin(self.handle_own(req, peer)).await;
        }
        let started = Instant::now();
        // The path is taken by `forward` for the stream's log line once a
        // response came; a failure's line below writes it; and if hyper
        // drops this future first (the client left before the response
        // head), the guard writes it.
        let mut unanswered = Unanswered {
            metrics: self.metrics(),
            method: req.method().clone(),
            path: log_safe(req.uri().path()),
            // Shared, not copied: read only if the guard writes.
            session_id: req.headers().get(&SESSION_HEADER).cloned(),
            started,
            answered: false,
        };
        let forwarded = self
            .forward(req, &peer.socket_full, started, &mut unanswered.path)
            .await;
        unanswered.answered = true;
        let method = std::mem::take(&mut unanswered.method);
        let path = std::mem::take(&mut unanswered.path);
        match forwarded {
            Ok(response) => response,
            Err((fault, message, session_id)) => {
                match fault {
                    Fault::UpstreamUnreachable => self
                        .metrics()
                        .upstream_error(UpstreamErrorKind::Unreachable),
                    Fault::UpstreamTimeout => {
                        self.metrics().upstream_error(UpstreamErrorKind::Timeout)
                    }
                    Fault::UpstreamError => self.metrics().upstream_error(UpstreamErrorKind::Error),
                    Fault::BadRequest
                    | Fault::HeadTooLarge
                    | Fault::ClientAborted
                    | Fault::ClientTimeout
                    | Fault::NotImplemented
                    | Fault::Loop => {}
                }
                let mut response = error_response(fault, &message);
                let log = RequestLog {
                    method,
                    path,
                    status: fault.logged_status(),
                    session_id: session_id.clone().unwrap_or_else(|| "-".to_owned()),
                    started,
                };
                // Counted as any answer's bytes are; a client that left
                // gets none of them.
                let bytes_out = match fault {
                    Fault::ClientAborted => 0,
                    _ => response.body().size_hint().exact().unwrap_or(0),
                };
                self.metrics()
                    .bytes_out_total
                    .fetch_add(bytes_out, Ordering::Relaxed);
                // Counted before its line is out: whoever reads the line
                // then finds it counted.
                self.metrics().request_over(log.status);
                log.write(0, bytes_out, 0, fault.outcome());
                match fault {
                    // Why the upstream failed is for whoever runs the
                    // proxy (a refused connection, a certificate that does
                    // not match): said at the default level. The message
                    // holds no header value.
                    Fault::UpstreamUnreachable
                    | Fault::UpstreamTimeout
                    | Fault::UpstreamError
                    | Fault::Loop => {
                        tracing::warn!(session = %log.session_id, path = %log.path, "{message}");
                    }
                    Fault::BadRequest
                    | Fault::HeadTooLarge
                    | Fault::ClientAborted
                    | Fault::ClientTimeout
                    | Fault::NotImplemented => {
                        tracing::debug!(peer = %peer.addr, "request failed: {message}");
                    }
                }
                if let Some(id) = session_id.and_then(|id| HeaderValue::from_str(&id).ok()) {
                    response.headers_mut().insert(SESSION_HEADER, id);
                }
                response
            }
        }
    }

    /// A request head HTTP/1.1's parser refused and answered itself: counted
    /// and logged as every request for the upstream is, as a refused head
    /// the proxy answers (`400`, `431`) is; why, at debug level, as theirs.
    pub fn refused_head(&self, head: RefusedHead<'_>) {
        self.metrics().request_over(head.status);
        RequestLog::write_refused(head.status, Fault::BadRequest.outcome());
        tracing::debug!(peer = %head.peer, "request head refused: {}", head.reason);
    }

    /// [`handle`](Self::handle) for our own routes (`/_aalis/`): their
    /// answer, and its log line.
    async fn handle_own(&self, req: Request<Incoming>, peer: Peer) -> Response<ProxyBody> {
        let log = RequestLog {
            method: req.method().clone(),
            // The path alone: a query may hold the admin token.
            path: log_safe(req.uri().path()),
            status: StatusCode::OK,
            session_id: "-".to_owned(),
            started: Instant::now(),
        };
        let response = match head_problem(&req) {
            Some((fault, problem)) => error_response(fault, &problem),
            None => admin::handle(self, req, peer.addr).await,
        };
        // One line, as every request has (a refused one included):
        // written as the answer's head goes out, or for an events stream
        // when it ends, with the bytes it sent.
        let log = RequestLog {
            status: response.status(),
            ..log
        };
        let outcome = match response.status() {
            StatusCode::FORBIDDEN => "forbidden",
            StatusCode::NOT_FOUND => "not_found",
            StatusCode::METHOD_NOT_ALLOWED => "method_not_allowed",
            status if status.is_client_error() => "invalid_request_error",
            _ => "ok",
        };
        // A HEAD's body is never read: its line goes out now.
        let exact = match log.method == http::Method::HEAD {
            true => Some(0),
            false => response.body().size_hint().exact(),
        };
        match exact {
            Some(bytes_out) => {
                log.write(0, bytes_out, 0, outcome);
                response
            }
            None => response.map(|inner| {
                BodyExt::boxed(LoggedAtEnd {
                    inner,
                    log,
                    bytes_out: 0,
                    ended: false,
                })
            }),
        }
    }

    /// Forwards a request and shapes its response.
    /// `socket_full`: whether the client's connection could not write
    /// all it holds, for the response body ([`TapBody`]).
    async fn forward(
        &self,
        req: Request<Incoming>,
        socket_full: &SocketFull,
        started: Instant,
        path: &mut String,
    ) -> Result<Response<ProxyBody>, (Fault, String, Option<String>)> {
        let config = &self.shared.config;
        // Phase 1: the request's head, then our headers.
        if let Some((fault, problem)) = head_problem(&req).or_else(|| {
            repeated(req.headers(), &SESSION_HEADER, "X-Aalis-Session")
                .map(|problem| (Fault::BadRequest, problem))
        }) {
            return Err((fault, problem, None));
        }
        let session_id = match req.headers().get(&SESSION_HEADER) {
            Some(value) => valid_session_id(value).map_err(|m| (Fault::BadRequest, m, None))?,
            None => self.generate_session_id(),
        };
        let fail = |fault, message: String| (fault, message, Some(session_id.clone()));
        if self.shared.came_back(req.headers()) {
            return Err(fail(
                Fault::Loop,
                format!(
                    "this request came back to the aalis-proxy that forwarded it (its Via \
                     header): --upstream ({}) leads back to this proxy; point it at the API \
                     instead",
                    config.upstream.authority()
                ),
            ));
        }
        // CONNECT asks for a tunnel too: its target is an authority, not
        // a path under --upstream (mapped, it went out as `CONNECT /v1`).
        if req.method() == http::Method::CONNECT {
            return Err(fail(
                Fault::NotImplemented,
                "aalis-proxy is a reverse proxy and does not tunnel (CONNECT); point the \
                 client's base URL at it instead of setting it as an HTTP proxy"
                    .to_owned(),
            ));
        }
        // A WebSocket (say, a realtime API) would need a tunnel: said at
        // once, rather than forwarded as a plain request. `h2c` is no
        // such upgrade: a client that offers it takes HTTP/1.1 as well.
        if req
            .headers()
            .get_all(header::UPGRADE)
            .iter()
            .any(|upgrade| {
                !upgrade
                    .to_str()
                    .is_ok_and(|v| v.split(',').all(|p| p.trim().eq_ignore_ascii_case("h2c")))
            })
        {
            return Err(fail(
                Fault::NotImplemented,
                "aalis-proxy does not tunnel protocol upgrades (Upgrade: websocket and the \
                 like); connect to the upstream directly for them"
                    .to_owned(),
            ));
        }
        // RFC 9112 §6.1: a transfer coding the proxy does not know (say
        // `gzip, chunked`) is a 501. hyper takes the body as chunked when
        // chunked comes last, and forwarded so, it would lose its coding.
        if req
            .headers()
            .get_all(header::TRANSFER_ENCODING)
            .iter()
            .any(|codings| !only_chunked(codings))
        {
            return Err(fail(
                Fault::NotImplemented,
                "aalis-proxy does not implement a transfer coding other than chunked \
                 (Transfer-Encoding); send the body chunked, or with a Content-Length"
                    .to_owned(),
            ));
        }
        if let Some(problem) = repeated(req.headers(), &INJECT_HEADER, "X-Aalis-Inject") {
            return Err(fail(Fault::BadRequest, problem));
        }
        let inject = match req.headers().get(&INJECT_HEADER) {
            Some(value) => parse_inject(value).map_err(|m| fail(Fault::BadRequest, m))?,
            None => config.inject,
        };

        // Phase 2: the upstream request.
        let (mut parts, body) = req.into_parts();
        let client_version = parts.version;
        let method = parts.method.clone();
        parts.uri = config.upstream.uri_for(&parts.uri).map_err(|e| {
            fail(
                Fault::BadRequest,
                format!("cannot map the request path: {e}"),
            )
        })?;
        // The client may speak HTTP/2 to us and the upstream HTTP/1.1, or
        // the reverse: the client library picks per connection.
        if parts.version == http::Version::HTTP_2 {
            join_cookies(&mut parts.headers);
        }
        // RFC 9110 §7.6.3: a gateway adds its entry to the request's Via,
        // naming the protocol it received the request by; ours also lets
        // a request that comes back be told (`came_back`).
        let via = self.shared.via(parts.version);
        parts.version = http::Version::HTTP_11;
        strip_hop_by_hop(&mut parts.headers);
        parts.headers.append(header::VIA, via);
        // Over HTTP/2 (only `https://` upstreams speak it), the clients'
        // credentials share a connection's header compression table.
        if !config.upstream.is_plain_http() {
            mark_credentials_sensitive(&mut parts.headers);
        }
        parts.headers.remove(header::HOST);
        parts.headers.remove(&SESSION_HEADER);
        parts.headers.remove(&INJECT_HEADER);
        // A compressed stream cannot be read as it passes: ask for none.
        parts.headers.insert(
            header::ACCEPT_ENCODING,
            HeaderValue::from_static("identity"),
        );
        // With --record, the request body is copied as it streams on.
        let (body, request_copy) = match &self.shared.recorder {
            None => (body.map_err(BoxError::from).boxed(), None),
            Some(_) => {
                let (body, copy) = record::tee(body);
                (body.map_err(BoxError::from).boxed(), Some(copy))
            }
        };
        // A body still to come is watched, for the deadline below.
        let (body, watch) = match body.is_end_stream() {
            true => (body, None),
            false => {
                let watch = Arc::new(BodyWatch::new());
                let body = WatchedBody {
                    inner: body,
                    watch: Arc::clone(&watch),
                };
                (body.boxed(), Some(watch))
            }
        };
        let upstream_req = Request::from_parts(parts, body);

        // Phase 3: send, with a deadline for the response headers.
        let timeout = config.response_timeout;
        let sent = with_deadline(
            self.shared.client.request(upstream_req),
            watch.as_deref(),
            timeout,
        )
        .await;
        let upstream = config.upstream.authority();
        let response = match sent {
            Err(Late::Response) => {
                return Err(fail(
                    Fault::UpstreamTimeout,
                    format!(
                        "upstream {upstream} sent no response headers within {timeout:?} of \
                         the request's end"
                    ),
                ));
            }
            Err(Late::Upstream) => {
                return Err(fail(
                    Fault::UpstreamTimeout,
                    format!("upstream {upstream} took no more of the request body for {timeout:?}"),
                ));
            }
            Err(Late::Connect) => {
                return Err(fail(
                    Fault::UpstreamTimeout,
                    format!(
                        "upstream {upstream} took none of the request within {timeout:?} \
                         (--response-timeout): no connection was made, or, over HTTP/2, no \
                         stream let in"
                    ),
                ));
            }
            Err(Late::Client) => {
                return Err(fail(
                    Fault::ClientTimeout,
                    format!("the client sent no more of its request body for {timeout:?}"),
                ));
            }
            Ok(Err(err)) => {
                // The client's body failed: its fault, whatever the
                // upstream client made of it.
                if let Some(client) = watch.as_deref().and_then(|w| w.failed.get()) {
                    return Err(fail(Fault::of_client_body(client), client.message.clone()));
                }
                // The plain-HTTP client's own check of the body it sent
                // (longer or shorter than its Content-Length): the client's.
                if let SendError::Plain(H1Error::RequestBody(_)) = &err {
                    return Err(fail(
                        Fault::BadRequest,
                        format!("the request body could not be sent: {}", error_chain(&err)),
                    ));
                }
                let (fault, what) = classify(&err);
                return Err(fail(
                    fault,
                    format!("upstream {upstream} {what}: {}", error_chain(&err)),
                ));
            }
            Ok(Ok(response)) => response,
        };

        // Phase 4: the response.
        let (mut parts, body) = response.into_parts();
        // The field count's limit, as an HTTP/1.1 upstream's head has it
        // (ours and hyper's parsers): h2 bounds only a head's size.
        if parts.headers.len() > MAX_HEADERS {
            return Err(fail(
                Fault::UpstreamError,
                format!(
                    "upstream {upstream} sent a response head of {} header fields; the proxy \
                     takes at most {MAX_HEADERS}",
                    parts.headers.len()
                ),
            ));
        }
        // A transfer coding but chunked (the proxy asks for none, so the
        // upstream breaks RFC 9110 §10.1.4): its body can only be read as
        // it came, and `Transfer-Encoding` is one hop's, so the client
        // would get `gzip` bytes with nothing to say so.
        if let Some(codings) = parts
            .headers
            .get_all(header::TRANSFER_ENCODING)
            .iter()
            .find(|codings| !only_chunked(codings))
        {
            return Err(fail(
                Fault::UpstreamError,
                format!(
                    "upstream {upstream} answered in a transfer coding the proxy cannot pass \
                     on (Transfer-Encoding: {})",
                    String::from_utf8_lossy(codings.as_bytes())
                ),
            ));
        }
        strip_hop_by_hop(&mut parts.headers);
        // An HTTP/1.0 upstream's answer is still ours to give in HTTP/1.1
        // (hyper answers an HTTP/1.0 client in HTTP/1.0 by itself); kept,
        // its version would make hyper close the client's connection.
        parts.version = http::Version::HTTP_11;
        let session_header = HeaderValue::from_str(&session_id).ok();
        // The log line keeps the id; what follows reads it there.
        let log = RequestLog {
            method,
            path: std::mem::take(path),
            status: parts.status,
            session_id,
            started,
        };
        // A response without a body (to a HEAD, a 204 or 304) is no
        // stream, whatever its type says: it must not take the session
        // over from the stream that runs. A HEAD's answer gets the head
        // its GET's would (RFC 9110 §9.3.2).
        let framing = match stream_framing(&parts.headers) {
            Some(_) if body.is_end_stream() => {
                if log.method == http::Method::HEAD {
                    shape_stream_head(&mut parts.headers);
                }
                None
            }
            None => {
                // A stream the upstream compressed though it was asked not
                // to: passed on as it came, and without progress, which
                // whoever runs the proxy must hear of (once).
                if !body.is_end_stream()
                    && stream_type(&parts.headers).is_some()
                    && encoded(&parts.headers)
                    && !self
                        .shared
                        .encoded_stream_said
                        .swap(true, Ordering::Relaxed)
                {
                    tracing::warn!(
                        path = %log.path,
                        "the upstream sent a stream in Content-Encoding {} though asked for \
                         identity: passed on as it came, without progress{} (said once)",
                        parts
                            .headers
                            .get(header::CONTENT_ENCODING)
                            .and_then(|v| v.to_str().ok())
                            .map_or_else(|| "(not text)".to_owned(), log_safe),
                        match self.shared.recorder {
                            Some(_) => " and not recorded",
                            None => "",
                        }
                    );
                }
                None
            }
            framing => framing,
        };
        let client_body = watch.as_ref().map(|watch| Arc::clone(&watch.failed));
        let body = match framing {
            Some(framing) => {
                shape_stream_head(&mut parts.headers);
                let inject = match (framing, inject) {
                    (
                        Framing::Ndjson,
                        InjectMode::Comment | InjectMode::Event | InjectMode::Chunk,
                    ) => {
                        if !self.shared.ndjson_inject_said.swap(true, Ordering::Relaxed) {
                            tracing::warn!(
                                path = %log.path,
                                "inject mode {} (--inject or X-Aalis-Inject) applies to SSE \
                                 streams; NDJSON streams get `field` injection (said once)",
                                inject.name()
                            );
                        }
                        InjectMode::Field
                    }
                    (Framing::Sse, _) | (Framing::Ndjson, InjectMode::Field | InjectMode::None) => {
                        inject
                    }
                };
                let stream = self.shared.sessions.begin_stream(&log.session_id);
                // Increments are collected while someone listens to the
                // session; the body looks again before each read.
                let mut annotator = Annotator::new(AnnotatorConfig {
                    output: OutputFormat::Sse,
                    inject,
                    // Only `--format messages` writes it.
                    session_id: None,
                    framing: Some(framing),
                    max_event_bytes: config.max_event_bytes,
                    collect_events: stream.listened(),
                });
                stream.keep_ended_calls(annotator.tracker_mut());
                let recording = self.shared.recorder.as_ref().and_then(|recorder| {
                    let request = request_copy.clone().unwrap_or_default();
                    recorder
                        .start(&log.session_id, framing, log.status, request)
                        .map_err(|err| tracing::warn!("cannot record this stream: {err}"))
                        .ok()
                });
                TapBody::stream(
                    body,
                    annotator,
                    stream,
                    recording,
                    config.idle_timeout,
                    socket_full.clone(),
                    log,
                    self.shared.metrics.clone(),
                )
                .with_client_body(client_body)
                .boxed()
            }
            None => TapBody::passthrough(
                body,
                config.idle_timeout,
                socket_full.clone(),
                log,
                self.shared.metrics.clone(),
            )
            .with_client_body(client_body)
            .boxed(),
        };
        // An HTTP/1.0 client gets a body of no stated length (a stream) up
        // to the connection's close, which hyper does, but hyper still
        // says `keep-alive` when the client asked for it (it adds it to an
        // HTTP/1.1 response before it writes it as HTTP/1.0). Given as
        // HTTP/1.0, with `close`, it says what it does.
        if client_version == http::Version::HTTP_10
            && !body.is_end_stream()
            && !parts.headers.contains_key(header::CONTENT_LENGTH)
        {
            parts.version = http::Version::HTTP_10;
            parts
                .headers
                .insert(header::CONNECTION, HeaderValue::from_static("close"));
        }
        if let Some(value) = session_header {
            parts.headers.insert(SESSION_HEADER, value);
        }
        Ok(Response::from_parts(parts, body))
    }

    fn generate_session_id(&self) -> String {
        let n = self.shared.session_counter.fetch_add(1, Ordering::Relaxed);
        session_id(&self.shared.session_prefix, n)
    }
}

/// An own route's answer of no known length (an events stream), whose
/// log line is written when it ends: `ok` at its end (the proxy shut
/// down), `cancelled` when the subscriber left first; with the bytes it
/// sent and how long it ran.
struct LoggedAtEnd {
    inner: ProxyBody,
    log: RequestLog,
    bytes_out: u64,
    ended: bool,
}

impl http_body::Body for LoggedAtEnd {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Bytes>, BoxError>>> {
        let polled = Pin::new(&mut self.inner).poll_frame(cx);
        match &polled {
            Poll::Ready(Some(Ok(frame))) => {
                let bytes = frame.data_ref().map_or(0, |data| data.len() as u64);
                self.bytes_out += bytes;
            }
            Poll::Ready(None) => self.ended = true,
            Poll::Ready(Some(Err(_))) | Poll::Pending => {}
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

impl Drop for LoggedAtEnd {
    fn drop(&mut self) {
        let outcome = match self.ended {
            true => "ok",
            false => "cancelled",
        };
        self.log.write(0, self.bytes_out, 0, outcome);
    }
}

/// The head of a streamed response, whatever `--inject` says: a
/// transformed body has a new length, and nothing between the proxy and
/// the client may hold it. An upstream's `no-store` says more than
/// `no-cache`: kept. Its `private` (no shared cache may store the answer
/// of one user) stays beside `no-cache`.
fn shape_stream_head(headers: &mut http::HeaderMap) {
    headers.remove(header::CONTENT_LENGTH);
    let says = |directive: &str| {
        headers.get_all(header::CACHE_CONTROL).iter().any(|v| {
            v.to_str().is_ok_and(|v| {
                v.split(',').any(|d| {
                    d.split('=')
                        .next()
                        .is_some_and(|name| name.trim().eq_ignore_ascii_case(directive))
                })
            })
        })
    };
    if !says("no-store") {
        let value = if says("private") {
            "private, no-cache"
        } else {
            "no-cache"
        };
        headers.insert(header::CACHE_CONTROL, HeaderValue::from_static(value));
    }
    headers.insert(
        HeaderName::from_static("x-accel-buffering"),
        HeaderValue::from_static("no"),
    );
}

/// A request that has no response yet: if it is dropped so (hyper drops
/// the handler's future when the client leaves before the response head,
/// or the shutdown's grace runs out), it still gets its one log line,
/// `outcome="cancelled"` with nginx's status for a client that closed
/// the request, 499. A generated session id is not known here: `-`.
struct Unanswered<'a> {
    metrics: &'a Metrics,
    method: http::Method,
    path: String,
    session_id: Option<HeaderValue>,
    started: Instant,
    answered: bool,
}

/// nginx's status for a request its client closed before the answer.
const CLIENT_CLOSED_REQUEST: u16 = 499;

impl Drop for Unanswered<'_> {
    fn drop(&mut self) {
        if self.answered {
            return;
        }
        let log = RequestLog {
            method: std::mem::take(&mut self.method),
            path: std::mem::take(&mut self.path),
            status: StatusCode::from_u16(CLIENT_CLOSED_REQUEST).unwrap_or(StatusCode::BAD_REQUEST),
            session_id: self
                .session_id
                .as_ref()
                .and_then(|v| valid_session_id(v).ok())
                .unwrap_or_else(|| "-".to_owned()),
            started: self.started,
        };
        self.metrics.request_over(log.status);
        log.write(0, 0, 0, "cancelled");
    }
}

/// What every generated session id of this process starts with: `s-`,
/// twelve hex digits of `seed`, and a dash.
fn session_prefix(seed: u64) -> String {
    format!("s-{:012x}-", seed & 0xFFFF_FFFF_FFFF)
}

/// The generated session id number `n`: its prefix, then `n` in decimal.
fn session_id(prefix: &str, n: u64) -> String {
    let mut digits = itoa::Buffer::new();
    let n = digits.format(n);
    let mut id = String::with_capacity(prefix.len() + n.len());
    id.push_str(prefix);
    id.push_str(n);
    id
}

/// Whether a `Transfer-Encoding` value names no coding but `chunked`.
fn only_chunked(codings: &HeaderValue) -> bool {
    names_only(codings, "chunked")
}

/// Whether a list of codings (`Transfer-Encoding`, `Content-Encoding`)
/// names none but `coding`, in any case; empty list elements, which RFC
/// 9110 §5.6.1 allows, are skipped, and a value that is not text names
/// something else.
fn names_only(codings: &HeaderValue, coding: &str) -> bool {
    codings.to_str().is_ok_and(|codings| {
        codings
            .split(',')
            .map(str::trim)
            .all(|named| named.is_empty() || named.eq_ignore_ascii_case(coding))
    })
}

/// An HTTP/2 request's `cookie` fields as one, joined by `; ` (RFC 9113
/// §8.2.3): an HTTP/2 client may send each cookie as a field of its own,
/// and they must be one field before an HTTP/1.1 hop, where many servers
/// keep only the first `Cookie` line or join them with `, `. (An HTTP/2
/// upstream takes the joined field as well.) One field or none is left
/// as it is, without an allocation.
fn join_cookies(headers: &mut http::HeaderMap) {
    let mut values = headers.get_all(header::COOKIE).iter();
    if values.next().is_none() || values.next().is_none() {
        return;
    }
    let mut joined = Vec::new();
    let mut sensitive = false;
    for (i, value) in headers.get_all(header::COOKIE).iter().enumerate() {
        if i > 0 {
            joined.extend_from_slice(b"; ");
        }
        joined.extend_from_slice(value.as_bytes());
        sensitive |= value.is_sensitive();
    }
    // Each part is a valid value, and so is `; `: this cannot fail.
    if let Ok(mut value) = HeaderValue::from_bytes(&joined) {
        value.set_sensitive(sensitive);
        headers.insert(header::COOKIE, value);
    }
}

/// The framing of a response the proxy can read, or `None` to pass it
/// through untouched: not a stream, or compressed despite our
/// `Accept-Encoding: identity`.
fn stream_framing(headers: &http::HeaderMap) -> Option<Framing> {
    // The benchmark's lower bound (scripts/bench.sh builds it; BENCHMARKS.md,
    // "Eleventh round"): a build made with `--cfg aalis_forward_only`
    // forwards every response as it came, so that what the HTTP path costs
    // without any parsing can be measured against nginx. Never a build for
    // use: it annotates nothing.
    if cfg!(aalis_forward_only) {
        return None;
    }
    if encoded(headers) {
        return None;
    }
    stream_type(headers)
}

/// Whether a response's body is in a coding but `identity`, in any of
/// its `Content-Encoding` fields (a second field was not read: `identity`
/// then `gzip` was annotated), or one whose value is not text: not ours
/// to read.
fn encoded(headers: &http::HeaderMap) -> bool {
    headers
        .get_all(header::CONTENT_ENCODING)
        .iter()
        .any(|codings| !names_only(codings, "identity"))
}

/// The framing a response's `Content-Type` names, if it names a stream.
fn stream_type(headers: &http::HeaderMap) -> Option<Framing> {
    let content_type = headers.get(header::CONTENT_TYPE)?.to_str().ok()?;
    let essence = content_type.split(';').next()?.trim();
    let is = |name: &str| essence.eq_ignore_ascii_case(name);
    if is("text/event-stream") {
        Some(Framing::Sse)
    } else if is("application/x-ndjson") || is("application/ndjson") || is("application/jsonl") {
        Some(Framing::Ndjson)
    } else {
        None
    }
}

/// What is wrong with a request's `Host`, if anything. RFC 9112 §3.2: a
/// server answers `400` to an HTTP/1.1 request without one, and to any
/// request with more than one (which of two names the target is a guess a
/// proxy must not make). HTTP/1.0 may go without; HTTP/2 names its target
/// in `:authority`, and its `Host`, if any, follows the same rule.
///
/// Over HTTP/2, a `Host` that names another target than `:authority` is
/// refused too (RFC 9113 §8.3.1: the request is malformed), compared as
/// RFC 3986 §6.2 normalizes them (case, a port that is the scheme's
/// default, a trailing dot): the routes' loopback rule reads `Host`.
fn host_problem(
    version: http::Version,
    uri: &http::Uri,
    headers: &http::HeaderMap,
) -> Option<String> {
    let mut hosts = headers.get_all(header::HOST).iter();
    match (hosts.next(), hosts.next()) {
        (None, _) if version == http::Version::HTTP_11 => {
            Some("an HTTP/1.1 request must carry a Host header (RFC 9112 §3.2)".to_owned())
        }
        (Some(_), Some(_)) => Some("a request must carry one Host header, not several".to_owned()),
        (Some(host), None)
            if version == http::Version::HTTP_2
                && uri.authority().is_some_and(|authority| {
                    !same_target(uri.scheme(), authority, host.as_bytes())
                }) =>
        {
            Some(
                "an HTTP/2 request's Host header must name the target its :authority names \
                 (RFC 9113 §8.3.1)"
                    .to_owned(),
            )
        }
        _ => None,
    }
}

/// Whether `host` (a `Host` value) names the target `authority` names,
/// under `scheme`: the same host in any case and without a trailing dot,
/// and the same port, a missing one being the scheme's default.
fn same_target(
    scheme: Option<&http::uri::Scheme>,
    authority: &http::uri::Authority,
    host: &[u8],
) -> bool {
    let Ok(host) = http::uri::Authority::try_from(host) else {
        return false;
    };
    let default_port = match scheme.map(http::uri::Scheme::as_str) {
        Some("https") => 443,
        _ => 80,
    };
    let name = |a: &http::uri::Authority| a.host().trim_end_matches('.').to_ascii_lowercase();
    let port = |a: &http::uri::Authority| a.port_u16().unwrap_or(default_port);
    name(authority) == name(&host) && port(authority) == port(&host)
}

/// The most header fields a request head may have: hyper's limit over
/// HTTP/1.1 (where a request over it gets hyper's `431`), kept over
/// HTTP/2 by [`head_problem`].
const MAX_REQUEST_FIELDS: usize = 100;

/// What is wrong with a request's head before anything of ours is read:
/// [`host_problem`]'s rules, more than [`MAX_REQUEST_FIELDS`] header
/// fields (`431`), or a `Transfer-Encoding` that names `chunked` twice
/// (RFC 9112 §6.1: a sender must not apply it more than once; hyper
/// decodes it once).
fn head_problem<B>(req: &Request<B>) -> Option<(Fault, String)> {
    // An HTTP/2 client may send each cookie as a field of its own (RFC
    // 9113 §8.2.3): they count as the one field they are joined into.
    let cookies = req.headers().get_all(header::COOKIE).iter().count();
    let fields = req.headers().len() - cookies.saturating_sub(1);
    if fields > MAX_REQUEST_FIELDS {
        return Some((
            Fault::HeadTooLarge,
            format!(
                "a request head may have at most {MAX_REQUEST_FIELDS} header fields; this one \
                 has {fields}"
            ),
        ));
    }
    let chunked = req
        .headers()
        .get_all(header::TRANSFER_ENCODING)
        .iter()
        .filter_map(|codings| codings.to_str().ok())
        .flat_map(|codings| codings.split(','))
        .filter(|named| named.trim().eq_ignore_ascii_case("chunked"))
        .count();
    if chunked > 1 {
        return Some((
            Fault::BadRequest,
            "Transfer-Encoding names chunked more than once (RFC 9112 §6.1)".to_owned(),
        ));
    }
    host_problem(req.version(), req.uri(), req.headers())
        .map(|problem| (Fault::BadRequest, problem))
}

/// A header of ours sent more than once: which one the client meant is a
/// guess, so it is refused rather than made.
fn repeated(headers: &http::HeaderMap, name: &HeaderName, spelled: &str) -> Option<String> {
    let mut values = headers.get_all(name).iter();
    (values.next().is_some() && values.next().is_some())
        .then(|| format!("{spelled} must be sent once, not several times"))
}

/// A session id from the header: visible ASCII, at most 128 bytes.
fn valid_session_id(value: &HeaderValue) -> Result<String, String> {
    let bytes = value.as_bytes();
    match session_id_problem(bytes) {
        Some(problem) => Err(format!("X-Aalis-Session {problem}")),
        None => Ok(String::from_utf8_lossy(bytes).into_owned()),
    }
}

/// What makes `id` no session id, if anything: one is 1 to 128 visible
/// ASCII characters, and not `.` or `..`, which a URL's path resolves (a
/// browser or Node asked for `/_aalis/sessions/../events` asks for
/// `/_aalis/events`), so the `/_aalis/` routes could not name them. The
/// same rule for the request header and for those routes' paths.
pub(crate) fn session_id_problem(id: &[u8]) -> Option<String> {
    if id.is_empty() || id.len() > MAX_SESSION_ID_BYTES {
        Some(format!("must be 1 to {MAX_SESSION_ID_BYTES} bytes long"))
    } else if !id.iter().all(u8::is_ascii_graphic) {
        Some("must be visible ASCII without spaces".to_owned())
    } else if id == b"." || id == b".." {
        Some("must not be . or .. (a URL's path would resolve it)".to_owned())
    } else {
        None
    }
}

fn parse_inject(value: &HeaderValue) -> Result<InjectMode, String> {
    let text = value.to_str().unwrap_or_default().trim();
    InjectMode::from_str(text, true).map_err(|_| {
        // Without the value: header values are never logged (`-v` logs
        // this message).
        "X-Aalis-Inject is not one of field, comment, event, chunk, none".to_owned()
    })
}

/// How the sending of a request body goes, for [`with_deadline`].
#[derive(Debug)]
struct BodyWatch {
    /// When it was made: `last_move` counts from here.
    since: Instant,
    /// When the body last moved (a frame taken from the client, or its
    /// end), in microseconds since `since`.
    last_move: AtomicU64,
    /// The last poll found the client had sent nothing more.
    waiting_on_client: AtomicBool,
    /// The upstream client asked for it at least once: a connection was
    /// made and the request's head written.
    polled: AtomicBool,
    /// All of it was taken.
    ended: AtomicBool,
    /// How the client's body failed, if it did: then the request failed
    /// by the client's fault, however the upstream client reports it
    /// (hyper's HTTP/2 client says only "stream error sent by user"),
    /// before the response's head or after it.
    failed: ClientBodyNote,
}

impl BodyWatch {
    fn new() -> BodyWatch {
        BodyWatch {
            since: Instant::now(),
            last_move: AtomicU64::new(0),
            waiting_on_client: AtomicBool::new(false),
            polled: AtomicBool::new(false),
            ended: AtomicBool::new(false),
            failed: ClientBodyNote::default(),
        }
    }

    /// Takes note of the error the client's body gave: a body framed
    /// wrong (hyper's parse of it failed: invalid data or input), or else
    /// a client gone (its connection ended, was reset or broke inside the
    /// body).
    fn failed_with(&self, err: &(dyn std::error::Error + 'static)) {
        let malformed = has_cause(err, &|e| {
            e.downcast_ref::<std::io::Error>().is_some_and(|io| {
                matches!(
                    io.kind(),
                    std::io::ErrorKind::InvalidData | std::io::ErrorKind::InvalidInput
                )
            }) || e
                .downcast_ref::<hyper::Error>()
                .is_some_and(hyper::Error::is_parse)
        });
        let what = match malformed {
            true => "the request body is malformed",
            false => "the client's connection ended inside its request body",
        };
        let _ = self.failed.set(ClientBodyFailure {
            gone: !malformed,
            message: format!(
                "{what}, and the upstream request was cancelled: {}",
                error_chain(err)
            ),
        });
    }

    fn moved(&self) {
        let micros = u64::try_from(self.since.elapsed().as_micros()).unwrap_or(u64::MAX);
        self.last_move.store(micros, Ordering::Relaxed);
    }

    /// When the body last moved.
    fn last_move(&self) -> Instant {
        self.since + Duration::from_micros(self.last_move.load(Ordering::Relaxed))
    }
}

pin_project_lite::pin_project! {
    /// A request body, watched ([`BodyWatch`]) as it is sent.
    struct WatchedBody {
        #[pin]
        inner: ProxyBody,
        watch: Arc<BodyWatch>,
    }
}

impl http_body::Body for WatchedBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Bytes>, BoxError>>> {
        let mut this = self.project();
        let polled = match this.inner.as_mut().poll_frame(cx) {
            Poll::Ready(Some(Ok(frame))) if frame.is_trailers() => {
                Poll::Ready(Some(Ok(fit_trailers(frame))))
            }
            polled => polled,
        };
        let watch = &this.watch;
        watch.polled.store(true, Ordering::Relaxed);
        watch
            .waiting_on_client
            .store(polled.is_pending(), Ordering::Relaxed);
        if let Poll::Ready(frame) = &polled {
            if let Some(Err(err)) = frame {
                watch.failed_with(err.as_ref());
            }
            watch.moved();
            // hyper's clients stop polling a body that says it has ended
            // after its last frame: its `None` may never be asked for.
            if frame.is_none() || this.inner.is_end_stream() {
                watch.ended.store(true, Ordering::Relaxed);
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

/// A request's trailer section without the fields no trailer may carry on
/// (RFC 9110 §6.5.1; [`wire::allowed_in_trailers`]), for every upstream:
/// an HTTP/2 upstream took `te` or `connection` there for a malformed
/// request and never answered, `content-length` for a protocol error, and
/// got `authorization` or `host` as the client wrote them.
fn fit_trailers(frame: http_body::Frame<Bytes>) -> http_body::Frame<Bytes> {
    match frame.into_trailers() {
        Ok(mut trailers) => {
            let refused: Vec<_> = trailers
                .keys()
                .filter(|name| !wire::allowed_in_trailers(name))
                .cloned()
                .collect();
            for name in refused {
                trailers.remove(name);
            }
            http_body::Frame::trailers(trailers)
        }
        Err(frame) => frame,
    }
}

/// Who let a request's deadline pass.
#[derive(Debug, PartialEq, Eq)]
enum Late {
    /// The request was sent whole, and no response head came.
    Response,
    /// Its body was never asked for: no connection to the upstream was
    /// made (a connect or TLS handshake that takes longer), or an HTTP/2
    /// upstream let no new stream in.
    Connect,
    /// The upstream took no more of the request body.
    Upstream,
    /// The client sent no more of its request body.
    Client,
}

/// `request`, with a deadline of `timeout` for the response head that
/// counts from the last time the request body (`watch`) moved: from the
/// request's end, so a long upload is no upstream timeout, and a client
/// that stops sending its body is told from an upstream that stops
/// reading it.
async fn with_deadline<F: std::future::Future>(
    request: F,
    watch: Option<&BodyWatch>,
    timeout: Duration,
) -> Result<F::Output, Late> {
    tokio::pin!(request);
    let mut deadline = tokio::time::Instant::now() + timeout;
    loop {
        if let Ok(out) = tokio::time::timeout_at(deadline, &mut request).await {
            return Ok(out);
        }
        let Some(watch) = watch else {
            return Err(Late::Response);
        };
        // The body moved since the deadline was set: it runs from then.
        let moved = tokio::time::Instant::from_std(watch.last_move()) + timeout;
        if moved > deadline {
            deadline = moved;
            continue;
        }
        return Err(if watch.ended.load(Ordering::Relaxed) {
            Late::Response
        } else if !watch.polled.load(Ordering::Relaxed) {
            Late::Connect
        } else if watch.waiting_on_client.load(Ordering::Relaxed) {
            Late::Client
        } else {
            Late::Upstream
        });
    }
}

/// Which fault a client error is, and how to say it.
fn classify(err: &SendError) -> (Fault, &'static str) {
    let timed_out = has_cause(err, &|e| {
        e.downcast_ref::<std::io::Error>()
            .is_some_and(|io| io.kind() == std::io::ErrorKind::TimedOut)
            || e.to_string().contains("timed out")
    });
    let tls = has_cause(err, &|e| e.is::<rustls::Error>());
    let head_too_large = has_cause(err, &|e| {
        e.downcast_ref::<hyper::Error>()
            .is_some_and(hyper::Error::is_parse_too_large)
    });
    if timed_out && err.is_connect() {
        (
            Fault::UpstreamTimeout,
            "did not accept the connection in time",
        )
    } else if timed_out {
        (Fault::UpstreamTimeout, "timed out before its response")
    } else if err.is_connect() && tls {
        (
            Fault::UpstreamUnreachable,
            find_cause(err, &tls_failure).unwrap_or("failed the TLS handshake"),
        )
    } else if err.is_connect() {
        (Fault::UpstreamUnreachable, "is unreachable")
    } else if head_too_large {
        (Fault::UpstreamError, "sent a response head over 64 KiB")
    } else {
        (Fault::UpstreamError, "failed")
    }
}

/// How a TLS handshake that failed is said, with what to do, when `err`
/// is rustls's error and says why: a certificate of a CA not trusted (the
/// usual private CA), expired, not yet valid or of another name; one that
/// is a CA's (`CA:TRUE`, the usual self-signed certificate, which curl
/// takes when it is given as the CA, and rustls (webpki) never does); and
/// a server that does not speak TLS at all.
fn tls_failure(err: &(dyn std::error::Error + 'static)) -> Option<&'static str> {
    use rustls::{CertificateError as Cert, Error as Tls, InvalidMessage};
    match err.downcast_ref::<Tls>()? {
        Tls::InvalidCertificate(Cert::UnknownIssuer) => Some(
            "failed the TLS handshake: its certificate is signed by no CA this proxy trusts \
             (the bundled web roots, and --upstream-ca's); give its CA's certificate, in PEM, \
             with --upstream-ca",
        ),
        Tls::InvalidCertificate(Cert::Other(other))
            if matches!(
                other.0.downcast_ref::<webpki::Error>(),
                Some(webpki::Error::CaUsedAsEndEntity)
            ) =>
        {
            Some(
                "failed the TLS handshake: its certificate is a CA's (basicConstraints \
                 CA:TRUE, as `openssl req -x509` makes by default), which a server may not \
                 use as its own; make it with `-addext basicConstraints=critical,CA:FALSE`, \
                 or sign it with a CA given to --upstream-ca",
            )
        }
        Tls::InvalidCertificate(Cert::Expired | Cert::ExpiredContext { .. }) => {
            Some("failed the TLS handshake: its certificate has expired")
        }
        Tls::InvalidCertificate(Cert::NotValidYet | Cert::NotValidYetContext { .. }) => Some(
            "failed the TLS handshake: its certificate is not valid yet (is this machine's \
             clock right?)",
        ),
        Tls::InvalidCertificate(Cert::NotValidForName | Cert::NotValidForNameContext { .. }) => {
            Some("failed the TLS handshake: its certificate is not for the host --upstream names")
        }
        Tls::InvalidMessage(InvalidMessage::InvalidContentType) => Some(
            "failed the TLS handshake: it does not speak TLS there (a plain HTTP server?); if \
             so, give --upstream as http://",
        ),
        _ => None,
    }
}

/// An OpenAI-style error response.
fn error_response(fault: Fault, message: &str) -> Response<ProxyBody> {
    json_error(fault.status(), fault.kind(), message)
}

/// A JSON error response in OpenAI's shape:
/// `{"error":{"message":…,"type":…,"param":null,"code":null}}`.
pub fn json_error(status: StatusCode, kind: &str, message: &str) -> Response<ProxyBody> {
    let body = serde_json::json!({
        "error": {
            "message": message,
            "type": kind,
            "param": null,
            "code": null,
        }
    });
    let mut response = json_response(&body);
    *response.status_mut() = status;
    response
}

/// A `200` with a JSON body.
pub fn json_response(value: &serde_json::Value) -> Response<ProxyBody> {
    let body = Full::new(Bytes::from(value.to_string()))
        .map_err(|never| match never {})
        .boxed();
    let mut response = Response::new(body);
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    response
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Generated ids are what they were when one `format!` wrote them
    /// whole: `s-`, twelve hex digits, a dash, the counter.
    #[test]
    fn generated_session_ids_keep_their_form() {
        for seed in [0, 0xabc, 0xFFFF_FFFF_FFFF, u64::MAX, 0x1234_5678_9abc_def0] {
            for n in [0, 7, 10, 12_345, u64::MAX] {
                assert_eq!(
                    session_id(&session_prefix(seed), n),
                    format!("s-{:012x}-{n}", seed & 0xFFFF_FFFF_FFFF)
                );
            }
        }
        assert_eq!(session_id(&session_prefix(0xabc), 42), "s-000000000abc-42");
    }

    #[test]
    fn stream_content_types() {
        let headers = |pairs: &[(&'static str, &'static str)]| {
            let mut h = http::HeaderMap::new();
            for (k, v) in pairs {
                h.insert(HeaderName::from_static(k), HeaderValue::from_static(v));
            }
            h
        };
        assert_eq!(
            stream_framing(&headers(&[(
                "content-type",
                "text/event-stream; charset=utf-8"
            )])),
            Some(Framing::Sse)
        );
        assert_eq!(
            stream_framing(&headers(&[("content-type", "application/x-ndjson")])),
            Some(Framing::Ndjson)
        );
        assert_eq!(
            stream_framing(&headers(&[(
                "content-type",
                " Text/Event-Stream ;charset=UTF-8"
            )])),
            Some(Framing::Sse)
        );
        for ndjson in ["Application/NDJSON", "application/jsonl; x=1"] {
            assert_eq!(
                stream_framing(&headers(&[("content-type", ndjson)])),
                Some(Framing::Ndjson),
                "{ndjson}"
            );
        }
        assert_eq!(
            stream_framing(&headers(&[("content-type", "application/json")])),
            None
        );
        assert_eq!(
            stream_framing(&headers(&[("content-type", "text/event-streams")])),
            None
        );
        assert_eq!(
            stream_framing(&headers(&[
                ("content-type", "text/event-stream"),
                ("content-encoding", "gzip")
            ])),
            None
        );
    }

    /// Several `cookie` fields become one, in their order, joined by
    /// `; `; one field, or none, is left alone, and other fields keep
    /// their values.
    #[test]
    fn cookie_fields_are_joined() {
        let mut headers = http::HeaderMap::new();
        headers.append(header::COOKIE, HeaderValue::from_static("a=1"));
        headers.append(header::ACCEPT, HeaderValue::from_static("*/*"));
        headers.append(header::COOKIE, HeaderValue::from_static("b=2"));
        headers.append(header::COOKIE, HeaderValue::from_static("c=3; d=4"));
        join_cookies(&mut headers);
        let cookies: Vec<_> = headers.get_all(header::COOKIE).iter().collect();
        assert_eq!(cookies, ["a=1; b=2; c=3; d=4"]);
        assert_eq!(
            headers.get(header::ACCEPT).map(|v| v.as_bytes()),
            Some(&b"*/*"[..])
        );

        let mut one = http::HeaderMap::new();
        one.append(header::COOKIE, HeaderValue::from_static("a=1, b=2"));
        join_cookies(&mut one);
        assert_eq!(
            one.get(header::COOKIE).map(|v| v.as_bytes()),
            Some(&b"a=1, b=2"[..])
        );
        let mut none = http::HeaderMap::new();
        join_cookies(&mut none);
        assert!(none.is_empty());
    }

    #[test]
    fn only_chunked_is_a_known_transfer_coding() {
        for known in ["chunked", "Chunked", " chunked ", "chunked,", ", chunked"] {
            assert!(only_chunked(&HeaderValue::from_static(known)), "{known:?}");
        }
        for unknown in [
            "gzip, chunked",
            "gzip",
            "deflate,chunked",
            "chunked;q=1",
            "x",
        ] {
            assert!(
                !only_chunked(&HeaderValue::from_static(unknown)),
                "{unknown:?}"
            );
        }
        let not_text = HeaderValue::from_bytes(b"chunked\xff").expect("value");
        assert!(!only_chunked(&not_text));
    }

    /// A client body that fails by its framing is malformed; one that
    /// fails any other way (its connection ended, was reset or broke) is
    /// a client gone. Before, a reset was "malformed".
    #[test]
    fn a_client_bodys_failure_is_told_by_its_cause() {
        use std::io::{Error, ErrorKind};
        for (kind, gone) in [
            (ErrorKind::InvalidData, false),
            (ErrorKind::InvalidInput, false),
            (ErrorKind::UnexpectedEof, true),
            (ErrorKind::ConnectionReset, true),
            (ErrorKind::ConnectionAborted, true),
            (ErrorKind::BrokenPipe, true),
            (ErrorKind::Other, true),
        ] {
            let watch = BodyWatch::new();
            // As hyper's body errors come: an I/O error inside another.
            let err = Error::other(Error::new(kind, "what the client did"));
            watch.failed_with(&err);
            let failure = watch.failed.get().expect("noted");
            assert_eq!(failure.gone, gone, "{kind:?}");
            assert_eq!(
                failure.outcome(),
                if gone {
                    "cancelled"
                } else {
                    "invalid_request_error"
                }
            );
            assert!(
                failure.message.ends_with("what the client did"),
                "{}",
                failure.message
            );
            // The first failure stays.
            watch.failed_with(&Error::new(ErrorKind::InvalidData, "later"));
            assert_eq!(watch.failed.get().map(|f| f.gone), Some(gone));
        }
    }

    #[test]
    fn a_request_names_one_host() {
        use http::Version;
        let origin = http::Uri::from_static("/v1/models");
        let mut headers = http::HeaderMap::new();
        let missing =
            host_problem(Version::HTTP_11, &origin, &headers).expect("HTTP/1.1 needs a Host");
        assert!(missing.contains("must carry a Host"), "{missing}");
        assert_eq!(host_problem(Version::HTTP_10, &origin, &headers), None);
        assert_eq!(host_problem(Version::HTTP_2, &origin, &headers), None);
        headers.append(header::HOST, HeaderValue::from_static("127.0.0.1:8787"));
        for version in [Version::HTTP_10, Version::HTTP_11, Version::HTTP_2] {
            assert_eq!(
                host_problem(version, &origin, &headers),
                None,
                "{version:?}"
            );
        }
        headers.append(header::HOST, HeaderValue::from_static("example.com"));
        for version in [Version::HTTP_10, Version::HTTP_11, Version::HTTP_2] {
            let twice = host_problem(version, &origin, &headers).expect("two Hosts");
            assert!(twice.contains("one Host header"), "{twice}");
        }
    }

    /// Over HTTP/2 `Host` and `:authority` must name one target, as RFC
    /// 3986 §6.2 compares them; over HTTP/1.1 an absolute-form target is
    /// not compared with `Host` (the check is HTTP/2's).
    #[test]
    fn an_http2_host_names_its_authority() {
        use http::Version;
        let uri = http::Uri::from_static("http://127.0.0.1:8787/v1/models");
        let mut headers = http::HeaderMap::new();
        assert_eq!(host_problem(Version::HTTP_2, &uri, &headers), None);
        let problem = |uri: &http::Uri, host: &'static str| {
            let mut headers = http::HeaderMap::new();
            headers.insert(header::HOST, HeaderValue::from_static(host));
            host_problem(Version::HTTP_2, uri, &headers)
        };
        assert_eq!(problem(&uri, "127.0.0.1:8787"), None);
        let other = problem(&uri, "evil.example").expect("another target");
        assert!(other.contains(":authority"), "{other}");
        assert!(problem(&uri, "127.0.0.1:8788").is_some());
        assert!(problem(&uri, "127.0.0.1").is_some(), "port 80 is not 8787");
        // RFC 3986 §6.2: case, the scheme's default port, a trailing dot.
        let http = http::Uri::from_static("http://Example.com/");
        let https = http::Uri::from_static("https://example.com/");
        for (uri, host) in [
            (&http, "example.COM"),
            (&http, "example.com:80"),
            (&http, "example.com."),
            (&https, "example.com:443"),
        ] {
            assert_eq!(problem(uri, host), None, "{uri} {host}");
        }
        assert!(problem(&https, "example.com:80").is_some());
        // Over HTTP/1.1 an absolute-form target is not compared with Host.
        headers.insert(header::HOST, HeaderValue::from_static("evil.example"));
        assert_eq!(host_problem(Version::HTTP_11, &uri, &headers), None);
    }

    #[test]
    fn a_head_of_too_many_fields_or_chunked_twice_is_refused() {
        let request = |fields: usize, codings: &'static str| {
            let mut builder = Request::post("/v1/chat/completions").header(header::HOST, "x");
            for i in 1..fields {
                builder = builder.header(format!("x-field-{i}"), "1");
            }
            if !codings.is_empty() {
                builder = builder.header(header::TRANSFER_ENCODING, codings);
            }
            builder.body(()).expect("a request")
        };
        assert!(head_problem(&request(100, "")).is_none());
        // 101 cookies, each a field of its own (HTTP/2), are one field.
        let mut crumbs = Request::get("/").header(header::HOST, "x");
        for i in 0..101 {
            crumbs = crumbs.header(header::COOKIE, format!("c{i}=1"));
        }
        assert!(head_problem(&crumbs.body(()).expect("a request")).is_none());
        let many = head_problem(&request(101, "")).expect("101 fields");
        assert!(matches!(many.0, Fault::HeadTooLarge), "{many:?}");
        assert!(head_problem(&request(10, "chunked")).is_none());
        for twice in ["chunked, chunked", "Chunked,chunked"] {
            let (fault, problem) = head_problem(&request(10, twice)).expect("chunked twice");
            assert!(matches!(fault, Fault::BadRequest), "{twice}");
            assert!(problem.contains("more than once"), "{problem}");
        }
    }

    #[test]
    fn our_headers_are_sent_once() {
        let mut headers = http::HeaderMap::new();
        assert_eq!(repeated(&headers, &SESSION_HEADER, "X-Aalis-Session"), None);
        headers.append(&SESSION_HEADER, HeaderValue::from_static("a"));
        assert_eq!(repeated(&headers, &SESSION_HEADER, "X-Aalis-Session"), None);
        headers.append(&SESSION_HEADER, HeaderValue::from_static("a"));
        assert_eq!(
            repeated(&headers, &SESSION_HEADER, "X-Aalis-Session").as_deref(),
            Some("X-Aalis-Session must be sent once, not several times")
        );
    }

    #[test]
    fn session_ids_are_checked() {
        assert_eq!(
            valid_session_id(&HeaderValue::from_static("chat-42")),
            Ok("chat-42".into())
        );
        assert!(valid_session_id(&HeaderValue::from_static("a b")).is_err());
        assert!(
            valid_session_id(&HeaderValue::from_str(&"x".repeat(129)).expect("value")).is_err()
        );
        for dots in [".", ".."] {
            let err = valid_session_id(&HeaderValue::from_static(dots)).expect_err(dots);
            assert!(err.contains("must not be . or .."), "{err}");
        }
        assert_eq!(
            valid_session_id(&HeaderValue::from_static("...")),
            Ok("...".into())
        );
    }

    #[test]
    fn inject_header_values() {
        assert_eq!(
            parse_inject(&HeaderValue::from_static("Comment")),
            Ok(InjectMode::Comment)
        );
        // The message (logged with `-v`) does not repeat the value.
        let err = parse_inject(&HeaderValue::from_static("s3cret")).expect_err("refused");
        assert!(!err.contains("s3cret"), "{err}");
        assert!(err.contains("field, comment, event, chunk, none"), "{err}");
    }
}
