//! A fake upstream for the proxy tests: a hyper server on `127.0.0.1:0`
//! (one task per connection, HTTP/1.1 and HTTP/2, optionally over TLS)
//! whose every response a test scripts as a list of [`Step`]s: bytes in
//! given pieces, delays, a pause until the test releases it, an error
//! mid-body, a body that never ends or never starts.
//!
//! It records every request it received ([`Recorded`]), counts the body
//! bytes it handed to its connection (`bytes_written`), and reports on a
//! channel when a request arrived, when a response body was dropped
//! (finished or not: a dropped unfinished body is a cancelled request) and
//! when a connection closed ([`Event`]).
//!
//! [`raw_cut_upstream`] scripts what hyper cannot: a chunked body cut by a
//! TCP reset (`SO_LINGER` 0), or by a FIN right after its last bytes.
//!
//! Read [`FakeUpstream::start`] first.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::{
    HeaderMap, HeaderName, HeaderValue, Method, Request, Response, StatusCode, Uri, Version,
};
use http_body::{Body, Frame};
use http_body_util::BodyExt;
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpListener, TcpSocket, TcpStream};
use tokio::sync::{Notify, mpsc};
use tokio::task::JoinHandle;
use tokio_rustls::TlsAcceptor;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// One request as the upstream received it.
#[derive(Debug, Clone)]
pub struct Recorded {
    pub method: Method,
    /// Origin form for HTTP/1.1 (`/v1/x?q`), absolute for HTTP/2.
    pub uri: Uri,
    pub version: Version,
    pub headers: HeaderMap,
    pub body: Bytes,
    /// The request's trailer section, if it had one (read by some of the
    /// test binaries that include this file).
    #[allow(dead_code)]
    pub trailers: Option<HeaderMap>,
}

/// One step of a scripted response.
#[derive(Clone)]
pub enum Step {
    /// Send these bytes as one body frame.
    Data(Bytes),
    /// Return `Pending` once (after waking itself), so the connection
    /// flushes what it has: the next piece goes out in its own write.
    Yield,
    Sleep(Duration),
    /// Wait until the test calls `notify_one` (a permit stored earlier
    /// counts).
    Wait(Arc<Notify>),
    /// The body fails: hyper aborts the connection mid-body.
    Fail(&'static str),
    /// Never go on.
    Hang,
    /// Send these bytes forever.
    Repeat(Bytes),
}

/// A scripted response.
pub struct Reply {
    pub status: StatusCode,
    pub headers: Vec<(HeaderName, HeaderValue)>,
    /// Run before the response headers are sent (`Sleep`, `Wait`, `Hang`).
    pub before_headers: Vec<Step>,
    pub body: Vec<Step>,
}

impl Reply {
    pub fn new(status: u16) -> Reply {
        Reply {
            status: StatusCode::from_u16(status).expect("valid status"),
            headers: Vec::new(),
            before_headers: Vec::new(),
            body: Vec::new(),
        }
    }

    /// A `200` of `content_type` whose body is `pieces`, each its own
    /// frame, flushed on its own.
    pub fn stream<'a>(content_type: &str, pieces: impl IntoIterator<Item = &'a [u8]>) -> Reply {
        let mut reply = Reply::new(200).header("content-type", content_type);
        for piece in pieces {
            reply.body.push(Step::Data(Bytes::copy_from_slice(piece)));
            reply.body.push(Step::Yield);
        }
        reply
    }

    pub fn header(mut self, name: &str, value: &str) -> Reply {
        self.headers.push((
            HeaderName::from_bytes(name.as_bytes()).expect("header name"),
            HeaderValue::from_str(value).expect("header value"),
        ));
        self
    }

    pub fn body(mut self, bytes: impl Into<Bytes>) -> Reply {
        self.body.push(Step::Data(bytes.into()));
        self
    }

    pub fn then(mut self, step: Step) -> Reply {
        self.body.push(step);
        self
    }

    pub fn before_headers(mut self, step: Step) -> Reply {
        self.before_headers.push(step);
        self
    }
}

/// What the upstream reports as it happens.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    /// Request number `n` (0-based) was received, body included.
    Request(usize),
    /// The body of response `request` was dropped; `finished` says whether
    /// it had yielded its end (otherwise the request was cancelled).
    BodyDropped { request: usize, finished: bool },
    /// A connection ended (closed by the peer, or aborted).
    ConnectionClosed,
}

type Handler = dyn Fn(&Recorded) -> Reply + Send + Sync;

struct Shared {
    handler: Box<Handler>,
    /// `SETTINGS_MAX_CONCURRENT_STREAMS` of its HTTP/2 connections.
    h2_streams: Option<u32>,
    requests: Mutex<Vec<Recorded>>,
    bytes_written: AtomicU64,
    events: mpsc::UnboundedSender<Event>,
}

/// A running fake upstream; stops accepting when dropped.
pub struct FakeUpstream {
    pub addr: SocketAddr,
    shared: Arc<Shared>,
    events: mpsc::UnboundedReceiver<Event>,
    accept_task: JoinHandle<()>,
}

impl Drop for FakeUpstream {
    fn drop(&mut self) {
        self.accept_task.abort();
    }
}

impl FakeUpstream {
    /// Serves plain HTTP (HTTP/1.1, or HTTP/2 with prior knowledge) on a
    /// fresh loopback port.
    pub async fn start(handler: impl Fn(&Recorded) -> Reply + Send + Sync + 'static) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind upstream");
        Self::start_on(listener, None, handler)
    }

    /// Serves on `listener`, over TLS when `tls` is given (HTTP/2 or
    /// HTTP/1.1, as the client's ALPN and preface choose).
    pub fn start_on(
        listener: TcpListener,
        tls: Option<Arc<rustls::ServerConfig>>,
        handler: impl Fn(&Recorded) -> Reply + Send + Sync + 'static,
    ) -> Self {
        Self::start_on_with(listener, tls, None, handler)
    }

    /// [`FakeUpstream::start_on`], letting at most `h2_streams` streams
    /// open at once on one HTTP/2 connection when given.
    pub fn start_on_with(
        listener: TcpListener,
        tls: Option<Arc<rustls::ServerConfig>>,
        h2_streams: Option<u32>,
        handler: impl Fn(&Recorded) -> Reply + Send + Sync + 'static,
    ) -> Self {
        let addr = listener.local_addr().expect("upstream addr");
        let (tx, rx) = mpsc::unbounded_channel();
        let shared = Arc::new(Shared {
            handler: Box::new(handler),
            h2_streams,
            requests: Mutex::new(Vec::new()),
            bytes_written: AtomicU64::new(0),
            events: tx,
        });
        let acceptor = tls.map(TlsAcceptor::from);
        let accept_shared = shared.clone();
        let accept_task = tokio::spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    // Out of descriptors, say: wait rather than spin.
                    tokio::time::sleep(std::time::Duration::from_millis(10)).await;
                    continue;
                };
                let _ = stream.set_nodelay(true);
                let shared = accept_shared.clone();
                let acceptor = acceptor.clone();
                tokio::spawn(async move {
                    match acceptor {
                        Some(acceptor) => {
                            if let Ok(tls) = acceptor.accept(stream).await {
                                serve_io(tls, shared.clone()).await;
                            }
                        }
                        None => serve_io(stream, shared.clone()).await,
                    }
                    let _ = shared.events.send(Event::ConnectionClosed);
                });
            }
        });
        FakeUpstream {
            addr,
            shared,
            events: rx,
            accept_task,
        }
    }

    /// `http://127.0.0.1:PORT` followed by `path`.
    pub fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }

    /// The requests received so far, in order.
    pub fn requests(&self) -> Vec<Recorded> {
        self.shared
            .requests
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Body bytes handed to the connections so far (all responses).
    pub fn bytes_written(&self) -> u64 {
        self.shared.bytes_written.load(Ordering::SeqCst)
    }

    /// Waits at most `limit` for an event `wanted` accepts; the events
    /// before it are consumed.
    pub async fn wait_for(
        &mut self,
        limit: Duration,
        wanted: impl Fn(&Event) -> bool,
    ) -> Option<Event> {
        tokio::time::timeout(limit, async {
            while let Some(event) = self.events.recv().await {
                if wanted(&event) {
                    return Some(event);
                }
            }
            None
        })
        .await
        .ok()
        .flatten()
    }
}

/// Serves one connection with hyper-util's auto builder.
async fn serve_io<I>(io: I, shared: Arc<Shared>)
where
    I: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let mut builder = auto::Builder::new(TokioExecutor::new());
    // Past hyper's 100: a request of as many fields as the proxy takes
    // arrives with the proxy's `Via` besides.
    builder.http1().max_headers(128);
    if let Some(streams) = shared.h2_streams {
        builder.http2().max_concurrent_streams(streams);
    }
    let service = service_fn(move |req: Request<Incoming>| {
        let shared = shared.clone();
        async move { Ok::<_, Infallible>(respond(req, shared).await) }
    });
    let _ = builder.serve_connection(TokioIo::new(io), service).await;
}

async fn respond(req: Request<Incoming>, shared: Arc<Shared>) -> Response<ScriptBody> {
    let (parts, body) = req.into_parts();
    let (body, trailers) = match body.collect().await {
        Ok(collected) => {
            let trailers = collected.trailers().cloned();
            (collected.to_bytes(), trailers)
        }
        Err(_) => (Bytes::new(), None),
    };
    let recorded = Recorded {
        method: parts.method,
        uri: parts.uri,
        version: parts.version,
        headers: parts.headers,
        body,
        trailers,
    };
    let reply = (shared.handler)(&recorded);
    let index = {
        let mut requests = shared.requests.lock().unwrap_or_else(|e| e.into_inner());
        requests.push(recorded);
        requests.len() - 1
    };
    let _ = shared.events.send(Event::Request(index));
    for step in reply.before_headers {
        run_pause(step).await;
    }
    let mut response = Response::new(ScriptBody {
        steps: reply.body.into(),
        pending: None,
        finished: false,
        index,
        shared,
    });
    *response.status_mut() = reply.status;
    for (name, value) in reply.headers {
        response.headers_mut().append(name, value);
    }
    response
}

/// A step that only waits.
async fn run_pause(step: Step) {
    match step {
        Step::Sleep(d) => tokio::time::sleep(d).await,
        Step::Wait(gate) => gate.notified().await,
        Step::Hang => std::future::pending::<()>().await,
        Step::Yield => tokio::task::yield_now().await,
        Step::Data(_) | Step::Fail(_) | Step::Repeat(_) => {
            panic!("only pauses can come before the headers")
        }
    }
}

/// The body of a scripted response.
struct ScriptBody {
    steps: VecDeque<Step>,
    /// A pause in progress.
    pending: Option<Pin<Box<dyn Future<Output = ()> + Send>>>,
    finished: bool,
    index: usize,
    shared: Arc<Shared>,
}

impl Drop for ScriptBody {
    fn drop(&mut self) {
        let _ = self.shared.events.send(Event::BodyDropped {
            request: self.index,
            finished: self.finished,
        });
    }
}

impl Body for ScriptBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        loop {
            if let Some(pending) = self.pending.as_mut() {
                std::task::ready!(pending.as_mut().poll(cx));
                self.pending = None;
            }
            let data = match self.steps.pop_front() {
                None => {
                    self.finished = true;
                    return Poll::Ready(None);
                }
                Some(Step::Data(data)) => data,
                Some(Step::Repeat(data)) => {
                    self.steps.push_front(Step::Repeat(data.clone()));
                    data
                }
                Some(Step::Fail(message)) => {
                    self.steps.clear();
                    return Poll::Ready(Some(Err(message.into())));
                }
                Some(Step::Yield) => {
                    cx.waker().wake_by_ref();
                    return Poll::Pending;
                }
                Some(step @ (Step::Sleep(_) | Step::Wait(_) | Step::Hang)) => {
                    self.pending = Some(Box::pin(run_pause(step)));
                    continue;
                }
            };
            self.shared
                .bytes_written
                .fetch_add(data.len() as u64, Ordering::SeqCst);
            return Poll::Ready(Some(Ok(Frame::data(data))));
        }
    }
}

/// A listener whose accepted sockets have a small send buffer (set on the
/// listening socket, inherited by accepted ones, and fixed: no
/// auto-tuning), so what the upstream can write ahead is small and known.
pub fn listener_with_send_buffer(bytes: u32) -> TcpListener {
    let socket = TcpSocket::new_v4().expect("socket");
    socket.set_send_buffer_size(bytes).expect("SO_SNDBUF");
    socket
        .bind("127.0.0.1:0".parse().expect("addr"))
        .expect("bind");
    socket.listen(16).expect("listen")
}

/// Reads from `stream` up to the end of a request head (and whatever came
/// with it); `None` if the connection ended or failed first.
pub async fn read_request_head(stream: &mut TcpStream) -> Option<Vec<u8>> {
    let mut seen = Vec::new();
    let mut buf = [0u8; 4096];
    while !seen.windows(4).any(|w| w == b"\r\n\r\n") {
        match stream.read(&mut buf).await {
            Ok(0) | Err(_) => return None,
            Ok(n) => seen.extend_from_slice(&buf[..n]),
        }
    }
    Some(seen)
}

/// How [`raw_cut_upstream`] ends its connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RawEnd {
    /// `gap` after the last piece, a reset (RST, not FIN).
    Reset,
    /// Right after the last piece, a FIN: the chunked body ends without
    /// its last chunk, and the proxy may read the last bytes and the end
    /// together.
    Fin,
}

/// An upstream that answers one connection with `head` (status line and
/// headers of a chunked response), sends each of `pieces` as a chunk, `gap`
/// apart, and then ends the connection as `end` says.
pub async fn raw_cut_upstream(
    head: &'static str,
    pieces: Vec<Bytes>,
    gap: Duration,
    end: RawEnd,
) -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(async move {
        let Ok((mut stream, _)) = listener.accept().await else {
            return;
        };
        let _ = stream.set_nodelay(true);
        if read_request_head(&mut stream).await.is_none() {
            return;
        }
        if stream.write_all(head.as_bytes()).await.is_err() {
            return;
        }
        for (i, piece) in pieces.iter().enumerate() {
            let mut chunk = format!("{:x}\r\n", piece.len()).into_bytes();
            chunk.extend_from_slice(piece);
            chunk.extend_from_slice(b"\r\n");
            if stream.write_all(&chunk).await.is_err() {
                return;
            }
            if end == RawEnd::Fin && i + 1 == pieces.len() {
                break;
            }
            tokio::time::sleep(gap).await;
        }
        if end == RawEnd::Reset {
            let _ = stream.set_zero_linger();
        }
        drop(stream);
    });
    addr
}

/// Reads `body` to its end or its first error, within `limit`: the bytes,
/// then `Ok` for a clean end or the error's text.
pub async fn read_body<B>(body: &mut B, limit: Duration) -> (Vec<u8>, Result<(), String>)
where
    B: Body<Data = Bytes> + Unpin,
    B::Error: std::fmt::Display,
{
    let mut bytes = Vec::new();
    let outcome = tokio::time::timeout(limit, async {
        while let Some(frame) = body.frame().await {
            match frame {
                Ok(frame) => {
                    if let Ok(data) = frame.into_data() {
                        bytes.extend_from_slice(&data);
                    }
                }
                Err(err) => return Err(err.to_string()),
            }
        }
        Ok(())
    })
    .await;
    match outcome {
        Ok(end) => (bytes, end),
        Err(_) => panic!(
            "body neither ended nor failed within {limit:?}; {} bytes so far:\n{}",
            bytes.len(),
            String::from_utf8_lossy(&bytes)
        ),
    }
}

/// Reads from `body` into `got` until it holds at least `wanted` bytes.
pub async fn read_at_least<B>(body: &mut B, got: &mut Vec<u8>, wanted: usize, limit: Duration)
where
    B: Body<Data = Bytes> + Unpin,
    B::Error: std::fmt::Display,
{
    let read = tokio::time::timeout(limit, async {
        while got.len() < wanted {
            match body.frame().await {
                Some(Ok(frame)) => {
                    if let Ok(data) = frame.into_data() {
                        got.extend_from_slice(&data);
                    }
                }
                Some(Err(err)) => panic!("body failed after {} bytes: {err}", got.len()),
                None => panic!("body ended after {} of {wanted} bytes", got.len()),
            }
        }
    })
    .await;
    if read.is_err() {
        panic!(
            "only {} of {wanted} bytes within {limit:?}:\n{}",
            got.len(),
            String::from_utf8_lossy(got)
        );
    }
}

/// A self-signed CA and a server certificate for `localhost` and
/// `127.0.0.1`, made here; the upstream serves TLS with ALPN `h2` and
/// `http/1.1`.
pub struct TestPki {
    pub ca_pem: String,
    pub server: Arc<rustls::ServerConfig>,
}

/// The test CA of `pki`, written to a temp file named after `name`, for
/// `upstream_ca` (the caller removes it).
pub fn write_test_ca(pki: &TestPki, name: &str) -> std::path::PathBuf {
    let path = std::env::temp_dir().join(format!("{name}-{}-{}.pem", std::process::id(), now_ms()));
    std::fs::write(&path, &pki.ca_pem).expect("write CA");
    path
}

pub fn test_pki() -> TestPki {
    use rcgen::{
        BasicConstraints, CertificateParams, DnType, IsCa, Issuer, KeyPair, KeyUsagePurpose,
    };
    let ca_key = KeyPair::generate().expect("CA key");
    let mut ca_params = CertificateParams::new(Vec::new()).expect("CA params");
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca_params
        .distinguished_name
        .push(DnType::CommonName, "aalis-proxy test CA");
    ca_params.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    let ca_cert = ca_params.self_signed(&ca_key).expect("CA cert");
    let issuer = Issuer::new(ca_params, ca_key);

    let server_key = KeyPair::generate().expect("server key");
    let mut server_params =
        CertificateParams::new(vec!["localhost".to_owned(), "127.0.0.1".to_owned()])
            .expect("server params");
    server_params
        .distinguished_name
        .push(DnType::CommonName, "localhost");
    let server_cert = server_params
        .signed_by(&server_key, &issuer)
        .expect("server cert");

    let key = rustls::pki_types::PrivateKeyDer::Pkcs8(server_key.serialize_der().into());
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut server = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .expect("TLS versions")
        .with_no_client_auth()
        .with_single_cert(vec![server_cert.der().clone()], key)
        .expect("server TLS config");
    server.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    TestPki {
        ca_pem: ca_cert.pem(),
        server: Arc::new(server),
    }
}

/// Milliseconds since the Unix epoch (a file name part).
fn now_ms() -> u128 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis())
}
