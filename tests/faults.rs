//! Hostile input and faults (issue 7, "Faults" and the security part of
//! "Limits"), over real HTTP on loopback: the proxy in this process (so a
//! test can read its session registry and metrics) or the real
//! `aalis-proxy` binary where signals or its log matter.
//!
//! - an upstream that closes in the middle of an event, at every byte of it;
//! - invalid UTF-8 in data lines, JSON strings and tool arguments;
//! - a 10,000-delta tool call, a 5 MiB one, 100 parallel calls;
//! - a client that goes away at every phase of a request;
//! - SIGTERM with 100 open streams;
//! - CRLF, NUL and path tricks in session ids, in recorded file names and
//!   in the upstream's response headers.
//!
//! What a stream must become is checked two ways: against the library's own
//! pipeline ([`Annotator`], what `annotate` runs), and independently: the
//! injected `toolCallProgress` keys are cut out of the output again
//! ([`strip_injected`]), which must give the upstream's bytes back, and the
//! progress numbers are recomputed here from the escaped fragments
//! ([`js_len`]).
//!
//! Every wait is bounded; nothing asserts how long something took, except
//! generous deadlines that only fail on a hang.

mod common;
#[allow(dead_code)]
#[path = "common/upstream.rs"]
mod upstream;

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::os::unix::process::CommandExt;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Once};
use std::time::{Duration, Instant};

use aalis_proxy::encode::{InjectMode, OutputFormat};
use aalis_proxy::framing::Framing;
use aalis_proxy::pipeline::{Annotator, AnnotatorConfig};
use aalis_proxy::proxy::service::Proxy;
use aalis_proxy::proxy::sessions::SessionRegistry;
use aalis_proxy::proxy::upstream::Upstream;
use aalis_proxy::proxy::{ProxyConfig, serve_proxy};
use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body::Body;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioIo};
use serde_json::Value;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Notify, mpsc, oneshot};
use tokio::task::JoinHandle;
use upstream::{
    Event, FakeUpstream, Reply, Step, read_at_least, read_body, test_pki, write_test_ca,
};

/// Bound for any single wait (a response, a body, an event).
const PATIENCE: Duration = Duration::from_secs(10);

/// The clock of the reference pipeline (SSE output does not depend on it).
const NOW_MS: u64 = common::NOW_MS;

// === panics ===

/// Panics raised outside this file's own code (the library, hyper, tokio)
/// since the hook was installed: a connection task that panics is only
/// logged by the runtime, so a test could not see it otherwise.
static FOREIGN_PANICS: AtomicUsize = AtomicUsize::new(0);

fn watch_panics() {
    static HOOK: Once = Once::new();
    HOOK.call_once(|| {
        let default = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            let ours = info
                .location()
                .is_some_and(|l| l.file().starts_with("tests/"));
            if !ours {
                FOREIGN_PANICS.fetch_add(1, Ordering::SeqCst);
            }
            default(info);
        }));
    });
}

fn assert_no_foreign_panic() {
    assert_eq!(
        FOREIGN_PANICS.load(Ordering::SeqCst),
        0,
        "something outside the tests panicked (see the output above)"
    );
}

// === the proxy in this process ===

fn proxy_config(upstream: &str) -> ProxyConfig {
    let mut config = ProxyConfig::new(Upstream::parse(upstream).expect("upstream URL"));
    config.connect_timeout = Duration::from_secs(2);
    config.response_timeout = Duration::from_secs(5);
    config.idle_timeout = Duration::from_secs(5);
    config.shutdown_grace = Duration::from_secs(2);
    config
}

/// `serve_proxy` (the public entry point `serve` uses) on a loopback port,
/// with the [`Proxy`] kept so the test can read its sessions and metrics.
struct Served {
    addr: SocketAddr,
    proxy: Proxy,
    _stop: oneshot::Sender<()>,
    task: JoinHandle<()>,
}

impl Served {
    async fn start(config: ProxyConfig) -> Served {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind proxy");
        Served::start_on(listener, config)
    }

    /// The same, on `listener` (one with a small send buffer, say).
    fn start_on(listener: TcpListener, config: ProxyConfig) -> Served {
        watch_panics();
        let addr = listener.local_addr().expect("proxy addr");
        let proxy = Proxy::from_config(config, SessionRegistry::new()).expect("proxy");
        let (stop, stopped) = oneshot::channel::<()>();
        let task = tokio::spawn(serve_proxy(listener, proxy.clone(), async {
            let _ = stopped.await;
        }));
        Served {
            addr,
            proxy,
            _stop: stop,
            task,
        }
    }

    fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }

    fn sessions(&self) -> &SessionRegistry {
        self.proxy.sessions()
    }

    /// The value of the metric line `name` (with its labels) as rendered
    /// for `GET /_aalis/metrics`.
    fn metric(&self, name: &str) -> f64 {
        let text = self.proxy.metrics().render();
        text.lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
            .unwrap_or_else(|| panic!("no metric {name} in\n{text}"))
    }
}

impl Drop for Served {
    fn drop(&mut self) {
        self.task.abort();
    }
}

// === clients ===

type TestClient = Client<HttpConnector, Full<Bytes>>;

fn client() -> TestClient {
    Client::builder(TokioExecutor::new()).build_http()
}

fn post(url: &str, session: &str) -> Request<Full<Bytes>> {
    Request::post(url)
        .header("x-aalis-session", session)
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from_static(b"{\"stream\":true}")))
        .expect("request")
}

async fn send(client: &TestClient, req: Request<Full<Bytes>>) -> Response<Incoming> {
    tokio::time::timeout(PATIENCE, client.request(req))
        .await
        .expect("response headers in time")
        .expect("request sent")
}

/// Waits until `check` holds, polling every 10 ms, at most `limit`.
async fn eventually(limit: Duration, mut check: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + limit;
    loop {
        if check() {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

// === raw HTTP/1.1, for what a well-behaved client or server cannot send ===

/// Sends `request` as is on a new connection and reads the response until
/// the connection closes (the requests say `Connection: close`). The
/// request is written while the response is read, so a server that answers
/// before it has read everything (a `431`) is heard all the same.
async fn raw_exchange(addr: SocketAddr, request: &[u8]) -> Vec<u8> {
    let stream = TcpStream::connect(addr).await.expect("connect");
    let (mut rd, mut wr) = stream.into_split();
    let request = request.to_vec();
    let writer = tokio::spawn(async move {
        // The server may close before it has read it all.
        let _ = wr.write_all(&request).await;
        wr
    });
    let mut got = Vec::new();
    let mut buf = [0u8; 16 * 1024];
    let read = tokio::time::timeout(PATIENCE, async {
        // A reset after a complete response still leaves the response.
        while let Ok(k) = rd.read(&mut buf).await {
            if k == 0 {
                break;
            }
            got.extend_from_slice(&buf[..k]);
        }
    })
    .await;
    assert!(
        read.is_ok(),
        "no end of the response in time:\n{}",
        String::from_utf8_lossy(&got)
    );
    drop(writer.await);
    got
}

/// A response as raw bytes: the status, the header lines (without their
/// CRLF) and the body (de-chunked when chunked).
#[derive(Debug)]
struct RawResponse {
    /// The status line's first word (`HTTP/1.1`).
    version: String,
    status: u16,
    header_lines: Vec<Vec<u8>>,
    body: Vec<u8>,
    /// The body's end was seen as its framing says.
    complete: bool,
    /// A chunked body's trailer lines (without their CRLF).
    trailer_lines: Vec<Vec<u8>>,
}

impl RawResponse {
    fn parse(raw: &[u8]) -> RawResponse {
        let end = find(raw, b"\r\n\r\n")
            .unwrap_or_else(|| panic!("no end of head in {:?}", String::from_utf8_lossy(raw)));
        let head = &raw[..end];
        let rest = &raw[end + 4..];
        let mut lines = split_crlf(head);
        let status_line = lines.remove(0);
        let status_line = String::from_utf8_lossy(&status_line);
        let mut words = status_line.split(' ');
        let version = words.next().unwrap_or_default().to_owned();
        let status = words
            .next()
            .and_then(|code| code.parse().ok())
            .unwrap_or_else(|| panic!("bad status line {status_line:?}"));
        let mut response = RawResponse {
            version,
            status,
            header_lines: lines,
            body: Vec::new(),
            complete: false,
            trailer_lines: Vec::new(),
        };
        if response
            .header("transfer-encoding")
            .is_some_and(|v| v == b"chunked")
        {
            let (body, complete, trailers) = dechunk_with_trailers(rest);
            response.body = body;
            response.complete = complete;
            response.trailer_lines = trailers;
        } else if let Some(length) = response.header("content-length") {
            let length: usize = std::str::from_utf8(&length)
                .ok()
                .and_then(|l| l.parse().ok())
                .expect("numeric content-length");
            response.complete = rest.len() >= length;
            response.body = rest[..length.min(rest.len())].to_vec();
        } else {
            response.body = rest.to_vec();
            response.complete = true;
        }
        response
    }

    /// The value of the only header `name`; fails when it appears twice.
    fn header(&self, name: &str) -> Option<Vec<u8>> {
        let values = self.headers(name);
        assert!(values.len() <= 1, "{name} appears {} times", values.len());
        values.into_iter().next()
    }

    fn headers(&self, name: &str) -> Vec<Vec<u8>> {
        self.header_lines
            .iter()
            .filter_map(|line| {
                let colon = line.iter().position(|&b| b == b':')?;
                line[..colon]
                    .eq_ignore_ascii_case(name.as_bytes())
                    .then(|| trim(&line[colon + 1..]).to_vec())
            })
            .collect()
    }

    /// Every header line is `token: value` and no value holds a CR, an LF
    /// or a NUL: nothing could have been split into another header.
    fn assert_well_formed(&self) {
        for line in &self.header_lines {
            let colon = line
                .iter()
                .position(|&b| b == b':')
                .unwrap_or_else(|| panic!("header line without a colon: {line:?}"));
            let name = &line[..colon];
            assert!(
                !name.is_empty()
                    && name
                        .iter()
                        .all(|b| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(b)),
                "bad header name in {:?}",
                String::from_utf8_lossy(line)
            );
            assert!(
                !line.iter().any(|b| matches!(b, b'\r' | b'\n' | 0)),
                "CR, LF or NUL inside a header line: {:?}",
                String::from_utf8_lossy(line)
            );
        }
    }
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack.windows(needle.len()).position(|w| w == needle)
}

fn split_crlf(bytes: &[u8]) -> Vec<Vec<u8>> {
    let mut lines = Vec::new();
    let mut rest = bytes;
    while let Some(at) = find(rest, b"\r\n") {
        lines.push(rest[..at].to_vec());
        rest = &rest[at + 2..];
    }
    lines.push(rest.to_vec());
    lines
}

fn trim(bytes: &[u8]) -> &[u8] {
    let start = bytes
        .iter()
        .position(|b| !matches!(b, b' ' | b'\t'))
        .unwrap_or(bytes.len());
    let end = bytes
        .iter()
        .rposition(|b| !matches!(b, b' ' | b'\t'))
        .map_or(start, |e| e + 1);
    &bytes[start..end.max(start)]
}

/// Decodes a chunked body as far as it goes: the data, and whether the
/// last chunk was seen.
fn dechunk(raw: &[u8]) -> (Vec<u8>, bool) {
    let (out, complete, _) = dechunk_with_trailers(raw);
    (out, complete)
}

/// [`dechunk`], and the trailer lines after the last chunk.
fn dechunk_with_trailers(mut raw: &[u8]) -> (Vec<u8>, bool, Vec<Vec<u8>>) {
    let mut out = Vec::new();
    loop {
        let Some(line_end) = find(raw, b"\r\n") else {
            return (out, false, Vec::new());
        };
        let size = std::str::from_utf8(&raw[..line_end])
            .ok()
            .and_then(|s| usize::from_str_radix(s.split(';').next()?.trim(), 16).ok());
        let Some(size) = size else {
            return (out, false, Vec::new());
        };
        raw = &raw[line_end + 2..];
        if size == 0 {
            let trailers =
                find(raw, b"\r\n\r\n").map_or_else(Vec::new, |end| split_crlf(&raw[..end]));
            return (out, true, trailers);
        }
        if raw.len() < size + 2 {
            out.extend_from_slice(&raw[..size.min(raw.len())]);
            return (out, false, Vec::new());
        }
        out.extend_from_slice(&raw[..size]);
        raw = &raw[size + 2..];
    }
}

/// One step of a [`RawUpstream`] response.
#[derive(Clone, Debug)]
enum RawStep {
    Write(Bytes),
    /// Half-close: the response ends here (a FIN).
    Close,
}

/// What a [`RawUpstream`] saw.
#[derive(Debug, Clone, PartialEq, Eq)]
enum RawEvent {
    /// Connection `n` sent a whole request head.
    Head { n: usize, head: Vec<u8> },
    /// Connection `n` was closed by the proxy.
    Closed { n: usize },
}

/// An upstream that writes exactly the bytes a script says (a response
/// head with odd bytes, a body cut anywhere) and reports when the proxy
/// closes each connection. After its steps it keeps the connection open
/// until the proxy closes it. Scripts should say `Connection: close`, so
/// that the proxy never reuses a connection.
struct RawUpstream {
    addr: SocketAddr,
    events: mpsc::UnboundedReceiver<RawEvent>,
    task: JoinHandle<()>,
}

impl Drop for RawUpstream {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl RawUpstream {
    async fn start(script: impl Fn(&[u8]) -> Vec<RawStep> + Send + Sync + 'static) -> RawUpstream {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        let (tx, events) = mpsc::unbounded_channel();
        let script = Arc::new(script);
        let task = tokio::spawn(async move {
            let mut n = 0;
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    // Out of descriptors, say: wait rather than spin.
                    tokio::time::sleep(std::time::Duration::from_millis(10)).await;
                    continue;
                };
                let _ = stream.set_nodelay(true);
                let (tx, script) = (tx.clone(), script.clone());
                tokio::spawn(raw_connection(stream, n, tx, script));
                n += 1;
            }
        });
        RawUpstream { addr, events, task }
    }

    fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    async fn next(&mut self, limit: Duration) -> Option<RawEvent> {
        tokio::time::timeout(limit, self.events.recv())
            .await
            .ok()
            .flatten()
    }
}

type RawScript = dyn Fn(&[u8]) -> Vec<RawStep> + Send + Sync;

async fn raw_connection(
    stream: TcpStream,
    n: usize,
    tx: mpsc::UnboundedSender<RawEvent>,
    script: Arc<RawScript>,
) {
    let (mut rd, mut wr) = stream.into_split();
    let mut seen = Vec::new();
    let mut buf = [0u8; 16 * 1024];
    let head_end = loop {
        if let Some(at) = find(&seen, b"\r\n\r\n") {
            break at + 4;
        }
        match rd.read(&mut buf).await {
            Ok(0) | Err(_) => {
                let _ = tx.send(RawEvent::Closed { n });
                return;
            }
            Ok(k) => seen.extend_from_slice(&buf[..k]),
        }
    };
    let head = seen[..head_end].to_vec();
    let _ = tx.send(RawEvent::Head {
        n,
        head: head.clone(),
    });
    // Whatever else comes (a request body) is read and dropped, until the
    // proxy closes its side.
    let reader_tx = tx.clone();
    let reader = tokio::spawn(async move {
        let mut buf = [0u8; 16 * 1024];
        while let Ok(k) = rd.read(&mut buf).await {
            if k == 0 {
                break;
            }
        }
        let _ = reader_tx.send(RawEvent::Closed { n });
    });
    for step in script(&head) {
        match step {
            RawStep::Write(bytes) => {
                if wr.write_all(&bytes).await.is_err() {
                    break;
                }
                let _ = wr.flush().await;
            }
            RawStep::Close => {
                let _ = wr.shutdown().await;
                break;
            }
        }
    }
    let _ = reader.await;
}

/// A chunked response head for `content_type`, closing the connection.
fn chunked_head(content_type: &str) -> Bytes {
    Bytes::from(format!(
        "HTTP/1.1 200 OK\r\ncontent-type: {content_type}\r\ntransfer-encoding: chunked\r\nconnection: close\r\n\r\n"
    ))
}

fn chunk(data: &[u8]) -> Bytes {
    let mut out = format!("{:x}\r\n", data.len()).into_bytes();
    out.extend_from_slice(data);
    out.extend_from_slice(b"\r\n");
    Bytes::from(out)
}

// === streams: building them, and what they must become ===

/// What the proxy's pipeline makes of `input` with the default `field`
/// injection, its end included.
fn annotate(input: &[u8]) -> Vec<u8> {
    common::run_whole(&sse_config(), input).output
}

/// The same for `framing` (NDJSON lines get `field` injection too).
fn annotate_with(input: &[u8], framing: Framing) -> Vec<u8> {
    let config = AnnotatorConfig {
        framing: Some(framing),
        ..sse_config()
    };
    common::run_whole(&config, input).output
}

/// What the pipeline has written after `input` with the stream still open.
fn annotate_open(input: &[u8]) -> Vec<u8> {
    let mut annotator = Annotator::new(sse_config());
    let mut out = Vec::new();
    annotator.push(input, NOW_MS, &mut out);
    out
}

fn sse_config() -> AnnotatorConfig {
    AnnotatorConfig {
        output: OutputFormat::Sse,
        inject: InjectMode::Field,
        framing: Some(Framing::Sse),
        ..AnnotatorConfig::default()
    }
}

fn fixture(name: &str) -> Vec<u8> {
    std::fs::read(common::fixtures_dir().join(name)).expect("read fixture")
}

/// A small tool-call capture (14 events: role, a `get_weather` call in
/// fragments, finish, `[DONE]`).
const SINGLE_CALL: &str = "openai/single_tool_call.sse";

/// Where each SSE event of `input` starts and ends (after its blank line),
/// for inputs with `\n\n` between events.
fn event_spans(input: &[u8]) -> Vec<std::ops::Range<usize>> {
    let mut spans = Vec::new();
    let mut start = 0;
    while let Some(at) = find(&input[start..], b"\n\n") {
        spans.push(start..start + at + 2);
        start += at + 2;
    }
    spans
}

/// The output with every injected `toolCallProgress` and
/// `toolCallsProgress` key cut out again: what `field` injection adds is
/// `,"toolCallsProgress":[…],"toolCallProgress":{…}` right before the last
/// `}` of a `data:` line (or of an NDJSON line). (Argument text cannot contain the unescaped key.)
fn strip_injected(output: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(output.len());
    for line in output.split_inclusive(|&b| b == b'\n') {
        let cut = [
            &b",\"toolCallsProgress\":"[..],
            &b",\"toolCallProgress\":"[..],
        ]
        .iter()
        .filter_map(|key| find(line, key))
        .min();
        match cut {
            Some(at) if line.starts_with(b"data:") || line.starts_with(b"{") => {
                let close = line
                    .iter()
                    .rposition(|&b| b == b'}')
                    .expect("a closing brace after the injection");
                out.extend_from_slice(&line[..at]);
                out.extend_from_slice(&line[close..]);
            }
            _ => out.extend_from_slice(line),
        }
    }
    out
}

/// One progress as a client sees it: `(index, name, charsAccumulated)`.
type Seen = (i64, String, u64);

/// Every progress of an output, in order: `(index, name, charsAccumulated)`
/// (from `toolCallsProgress` when a chunk carries several).
fn progress_of(output: &[u8]) -> Vec<Seen> {
    let mut all = Vec::new();
    for line in output.split(|&b| b == b'\n') {
        // An SSE `data:` line, or an NDJSON line.
        let Some(data) = line
            .strip_prefix(b"data: ")
            .or_else(|| line.starts_with(b"{").then_some(line))
        else {
            continue;
        };
        // Only the injected part is parsed: the chunk itself may hold lone
        // surrogate escapes, which serde_json refuses.
        let Some(at) = [
            &b",\"toolCallsProgress\":"[..],
            &b",\"toolCallProgress\":"[..],
        ]
        .iter()
        .filter_map(|key| find(data, key))
        .min() else {
            continue;
        };
        let close = data
            .iter()
            .rposition(|&b| b == b'}')
            .expect("closing brace");
        let injected = [&b"{"[..], &data[at + 1..close], &b"}"[..]].concat();
        let value: Value = serde_json::from_slice(&injected).expect("the injection is JSON");
        let list = match value.get("toolCallsProgress") {
            Some(list) => list.as_array().expect("a list").clone(),
            None => vec![value["toolCallProgress"].clone()],
        };
        for p in list {
            all.push((
                p["index"].as_i64().expect("index"),
                p["name"].as_str().expect("name").to_owned(),
                p["charsAccumulated"].as_u64().expect("charsAccumulated"),
            ));
        }
    }
    all
}

/// The JavaScript `String.length` of the text a JSON string's escaped
/// contents stand for: each escape is one UTF-16 unit (a lone surrogate
/// escape too), each other character its UTF-16 length.
fn js_len(escaped: &str) -> u64 {
    let mut n = 0;
    let mut chars = escaped.chars();
    while let Some(c) = chars.next() {
        if c == '\\' {
            match chars.next() {
                Some('u') => {
                    for _ in 0..4 {
                        chars.next().expect("four hex digits");
                    }
                }
                Some(_) => {}
                None => panic!("a lone backslash in {escaped:?}"),
            }
            n += 1;
        } else {
            n += c.len_utf16() as u64;
        }
    }
    n
}

/// A deterministic pseudo-random sequence (an LCG; no dependency).
struct Lcg(u64);

impl Lcg {
    fn next(&mut self, below: usize) -> usize {
        self.0 = self
            .0
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        ((self.0 >> 33) % below as u64) as usize
    }
}

/// Argument fragments as they appear inside the JSON string (escaped):
/// ASCII, escapes, two- to four-byte UTF-8, surrogate pairs as escapes, and
/// lone surrogate escapes (a UTF-16 provider cutting inside a pair).
const PIECES: &[&str] = &[
    "a",
    "path",
    " ",
    "0123456789",
    "\\\"",
    "\\\\",
    "\\n",
    "\\t",
    "\\/",
    "é",
    "😀",
    "東京",
    "\\u00e9",
    "\\ud83d\\ude00",
    "\\ud83d",
    "\\ude00",
    "{\\\"k\\\":",
    "},",
];

/// A fragment of one to three pieces.
fn fragment(rng: &mut Lcg) -> String {
    (0..1 + rng.next(3))
        .map(|_| PIECES[rng.next(PIECES.len())])
        .collect()
}

fn chunk_event(delta: &str, finish: &str) -> String {
    format!(
        "data: {{\"id\":\"chatcmpl-faults\",\"object\":\"chat.completion.chunk\",\"created\":1767225600,\"model\":\"m\",\"choices\":[{{\"index\":0,\"delta\":{delta},\"finish_reason\":{finish}}}]}}\n\n"
    )
}

/// One `tool_calls` entry; `start` gives the id and name of a call's
/// first delta.
fn tool_entry(index: usize, start: Option<(&str, &str)>, args: &str) -> String {
    match start {
        Some((id, name)) => format!(
            "{{\"index\":{index},\"id\":\"{id}\",\"type\":\"function\",\"function\":{{\"name\":\"{name}\",\"arguments\":\"{args}\"}}}}"
        ),
        None => format!("{{\"index\":{index},\"function\":{{\"arguments\":\"{args}\"}}}}"),
    }
}

fn tool_event(entries: &[String]) -> String {
    chunk_event(
        &format!("{{\"tool_calls\":[{}]}}", entries.join(",")),
        "null",
    )
}

fn role_event() -> String {
    chunk_event("{\"role\":\"assistant\",\"content\":null}", "null")
}

fn finish_event() -> String {
    chunk_event("{}", "\"tool_calls\"")
}

const DONE: &str = "data: [DONE]\n\n";

/// One call `write_file` whose arguments come in `fragments`: the stream,
/// and the progress each delta must report.
fn one_call_stream(fragments: &[String]) -> (Vec<u8>, Vec<Seen>) {
    let mut stream = role_event();
    stream.push_str(&tool_event(&[tool_entry(
        0,
        Some(("call_1", "write_file")),
        "",
    )]));
    let mut expected = vec![(0, "write_file".to_owned(), 0)];
    let mut chars = 0;
    for f in fragments {
        stream.push_str(&tool_event(&[tool_entry(0, None, f)]));
        chars += js_len(f);
        expected.push((0, "write_file".to_owned(), chars));
    }
    stream.push_str(&finish_event());
    stream.push_str(DONE);
    (stream.into_bytes(), expected)
}

/// `bytes` cut in pieces of 1 to `max` bytes (deterministic).
fn pieces(bytes: &[u8], max: usize, seed: u64) -> Vec<&[u8]> {
    let mut rng = Lcg(seed);
    let mut out = Vec::new();
    let mut rest = bytes;
    while !rest.is_empty() {
        let n = (1 + rng.next(max)).min(rest.len());
        out.push(&rest[..n]);
        rest = &rest[n..];
    }
    out
}

// ===========================================================================
// 1. An upstream that closes in the middle of an event

/// An upstream that just ends its body in the middle of an event, at each
/// of the 365 byte positions of event 5 of `single_tool_call.sse` and at
/// every event boundary ±1 — its body ending cleanly, three ways: the
/// chunked terminator, a `Content-Length` that says so, and a FIN ending a
/// close-delimited body. Every time, the client gets exactly the
/// pipeline's output of the bytes sent, the partial event's bytes
/// included (nothing lost), and a clean end: the upstream did end its
/// response (SPEC.md: "a stream may also just end"), so the proxy invents
/// no error and no `[DONE]`; the session is released.
///
/// (A body that fails instead — an error, a reset, silence past the idle
/// timeout — is `an_upstream_that_stops_mid_event_loses_nothing` in
/// `tests/proxy.rs`: every byte, then an error.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upstream_that_ends_mid_event_loses_nothing_and_invents_nothing() {
    let input = fixture(SINGLE_CALL);
    let spans = event_spans(&input);
    assert_eq!(spans.len(), 11);
    let mut cuts: Vec<usize> = spans[4].clone().collect();
    for span in &spans {
        cuts.extend([span.end.saturating_sub(1), span.end, span.end + 1]);
    }
    cuts.retain(|&c| c < input.len());
    cuts.sort_unstable();
    cuts.dedup();

    let served = Arc::new(input.clone());
    let for_fake = served.clone();
    // `/cut/N/chunked` or `/cut/N/length`.
    let fake = FakeUpstream::start(move |req| {
        let parts: Vec<&str> = req.uri.path().split('/').collect();
        let n: usize = parts[2].parse().expect("cut");
        let sent = &for_fake[..n];
        let reply = Reply::stream("text/event-stream", pieces(sent, 97, n as u64));
        if parts[3] == "length" {
            reply.header("content-length", &n.to_string())
        } else {
            reply
        }
    })
    .await;
    let for_raw = served.clone();
    let raw = RawUpstream::start(move |head| {
        let path = String::from_utf8_lossy(head);
        let n: usize = path
            .split_whitespace()
            .nth(1)
            .and_then(|p| p.rsplit('/').next()?.parse().ok())
            .expect("cut");
        vec![
            RawStep::Write(Bytes::from_static(
                b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n\r\n",
            )),
            RawStep::Write(Bytes::copy_from_slice(&for_raw[..n])),
            RawStep::Close,
        ]
    })
    .await;
    let via_fake = Served::start(proxy_config(&fake.url(""))).await;
    let via_raw = Served::start(proxy_config(&raw.url())).await;
    let client = client();

    let mut failures = Vec::new();
    for &n in &cuts {
        let expected = annotate(&input[..n]);
        // What was sent is all there, the cut event included.
        assert_eq!(strip_injected(&expected), &input[..n]);
        for (proxy, path) in [
            (&via_fake, format!("/cut/{n}/chunked")),
            (&via_fake, format!("/cut/{n}/length")),
            (&via_raw, format!("/cut/{n}")),
        ] {
            let response = send(&client, post(&proxy.url(&path), "cut")).await;
            assert_eq!(response.status(), StatusCode::OK, "{path}");
            let (got, end) = read_body(&mut response.into_body(), PATIENCE).await;
            if got != expected {
                failures.push(format!(
                    "{path}: {} bytes, expected {}",
                    got.len(),
                    expected.len()
                ));
            }
            if let Err(err) = end {
                failures.push(format!("{path}: the body failed: {err}"));
            }
        }
    }
    assert!(
        failures.is_empty(),
        "{} of {} cuts:\n{}",
        failures.len(),
        cuts.len() * 3,
        failures.join("\n")
    );
    for proxy in [&via_fake, &via_raw] {
        let sessions = proxy.sessions().clone();
        assert!(eventually(PATIENCE, || sessions.is_empty()).await);
        assert!(eventually(PATIENCE, || proxy.metric("aalis_streams_open") == 0.0).await);
    }
    assert_eq!(
        via_fake.metric("aalis_streams_total"),
        cuts.len() as f64 * 2.0
    );
    assert_eq!(via_raw.metric("aalis_streams_total"), cuts.len() as f64);
    eprintln!(
        "{} cuts x 3 body framings: every byte, clean end",
        cuts.len()
    );
    assert_no_foreign_panic();
}

/// An upstream with 32 MB of text for its client, and then no end (it
/// waits with its connection open), and a proxy whose `--client-timeout`
/// is `client_timeout`.
async fn a_long_upstream(client_timeout: Duration) -> (RawUpstream, Served) {
    let event = b"data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx\"}}]}\n\n";
    let body: Vec<u8> = event.repeat(32 * 1024 * 1024 / event.len());
    let raw = RawUpstream::start(move |_| {
        vec![
            RawStep::Write(chunked_head("text/event-stream")),
            RawStep::Write(chunk(&body)),
        ]
    })
    .await;
    let mut config = proxy_config(&raw.url());
    config.client_timeout = client_timeout;
    let proxy = Served::start(config).await;
    (raw, proxy)
}

/// [`a_long_upstream`], and an HTTP/1.1 client connected through it, with
/// a receive buffer of `rcvbuf` bytes when given, whose request has
/// reached the upstream.
async fn a_long_stream_to(
    client_timeout: Duration,
    rcvbuf: Option<u32>,
) -> (RawUpstream, Served, TcpStream) {
    let (mut raw, proxy) = a_long_upstream(client_timeout).await;
    let socket = tokio::net::TcpSocket::new_v4().expect("socket");
    if let Some(bytes) = rcvbuf {
        socket.set_recv_buffer_size(bytes).expect("SO_RCVBUF");
    }
    let mut client = socket.connect(proxy.addr).await.expect("connect");
    client
        .write_all(
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nx-aalis-session: stalled\r\n\
              content-length: 2\r\n\r\n{}",
        )
        .await
        .expect("request");
    assert!(
        matches!(raw.next(PATIENCE).await, Some(RawEvent::Head { n: 0, .. })),
        "the request reached the upstream"
    );
    (raw, proxy, client)
}

/// Waits for `raw`'s request to be closed by a proxy whose
/// `--client-timeout` is 1 s, with a client that takes nothing: not
/// before that second, within 30; then the session and the stream are
/// gone.
async fn cancelled_after_a_second(raw: &mut RawUpstream, proxy: &Served) {
    let started = Instant::now();
    let closed = raw.next(Duration::from_secs(30)).await;
    let waited = started.elapsed();
    assert_eq!(
        closed,
        Some(RawEvent::Closed { n: 0 }),
        "the upstream request was still open after {waited:?}"
    );
    assert!(
        waited >= Duration::from_millis(900),
        "closed after {waited:?}, before the client timeout"
    );
    let sessions = proxy.sessions().clone();
    assert!(eventually(PATIENCE, || sessions.is_empty()).await);
    assert!(eventually(PATIENCE, || proxy.metric("aalis_streams_open") == 0.0).await);
}

/// A client that stops reading, with a stream's bytes waiting for it: once
/// they have waited behind its shut TCP window for `--client-timeout` (1 s
/// here), its connection is closed, and with it the upstream request (the
/// upstream sees its connection closed), the stream and the session.
/// Before, nothing bounded it: hyper polled neither the body nor its idle
/// timer while the socket was full, so all of them stayed until the client
/// read again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_takes_no_bytes_is_closed_after_the_client_timeout() {
    let (mut raw, proxy, mut client) = a_long_stream_to(Duration::from_secs(1), Some(4096)).await;
    // The client reads nothing; the proxy closes the upstream connection.
    cancelled_after_a_second(&mut raw, &proxy).await;
    // The client, reading at last, gets what was in the buffers, then the
    // end of a connection that was closed.
    let mut buf = vec![0u8; 64 * 1024];
    let ended = tokio::time::timeout(PATIENCE, async {
        loop {
            match client.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(_) => {}
            }
        }
    })
    .await;
    assert!(ended.is_ok(), "the client's connection is still open");
    assert_no_foreign_panic();
}

/// A client that reads slowly (16 KiB every 100 ms, far slower than the
/// stream comes) is not closed, however long it stays behind: its window
/// opens as it reads. A timer on writes that found the socket full cut
/// such a client (Linux reports room only once a third of a full send
/// buffer, 1.3 MB on loopback, has gone).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_reads_slowly_is_not_closed() {
    let (mut raw, _proxy, mut client) = a_long_stream_to(Duration::from_secs(2), None).await;
    let mut buf = vec![0u8; 16 * 1024];
    reads_slowly_and_stays_open(&mut raw, async || {
        let n = tokio::time::timeout(PATIENCE, client.read(&mut buf))
            .await
            .expect("bytes in time")
            .expect("read");
        assert!(n > 0, "the connection was closed");
        n
    })
    .await;
}

/// Takes bytes with `read` (it returns how many one read took), one read
/// every 100 ms for 4 s, far slower than [`a_long_upstream`] sends; then
/// checks that the upstream request is still open, and that the client
/// was behind.
async fn reads_slowly_and_stays_open(raw: &mut RawUpstream, mut read: impl AsyncFnMut() -> usize) {
    let mut got = 0;
    let until = Instant::now() + Duration::from_secs(4);
    while Instant::now() < until {
        got += read().await;
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(
        raw.next(Duration::ZERO).await.is_none(),
        "the upstream request was closed after {got} bytes"
    );
    assert!(
        got < 16 * 1024 * 1024,
        "the client was not behind: {got} bytes"
    );
}

/// [`a_long_upstream`], and an HTTP/2 client connected through it (hyper's,
/// whose windows are h2's first 64 KiB: they open only as the response
/// body is read), whose request has reached the upstream: its response
/// and its connection's task.
async fn a_long_http2_stream_to(
    client_timeout: Duration,
) -> (
    RawUpstream,
    Served,
    Response<Incoming>,
    JoinHandle<hyper::Result<()>>,
) {
    let (mut raw, proxy) = a_long_upstream(client_timeout).await;
    let stream = TcpStream::connect(proxy.addr).await.expect("connect");
    let (mut sender, conn) = hyper::client::conn::http2::Builder::new(TokioExecutor::new())
        .initial_stream_window_size(65_535)
        .initial_connection_window_size(65_535)
        .adaptive_window(false)
        .handshake(TokioIo::new(stream))
        .await
        .expect("handshake");
    let conn = tokio::spawn(conn);
    let request = Request::post(format!("http://{}/v1/chat/completions", proxy.addr))
        .header("x-aalis-session", "stalled")
        .body(Full::new(Bytes::from_static(b"{}")))
        .expect("request");
    let response = tokio::time::timeout(PATIENCE, sender.send_request(request))
        .await
        .expect("in time")
        .expect("response");
    assert_eq!(response.version(), http::Version::HTTP_2);
    assert!(
        matches!(raw.next(PATIENCE).await, Some(RawEvent::Head { n: 0, .. })),
        "the request reached the upstream"
    );
    (raw, proxy, response, conn)
}

/// An HTTP/2 client whose connection reads its socket (so its TCP window
/// stays open, and `TCP_USER_TIMEOUT` never fires) but not the response:
/// once a response's bytes have waited behind its shut HTTP/2
/// flow-control window for `--client-timeout` (1 s here), its connection
/// is closed, and with it the upstream request, the stream and the
/// session, as for an HTTP/1.1 client that stops reading. Before, all of
/// them stayed until the client read again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_http2_client_that_keeps_its_window_shut_is_closed_after_the_client_timeout() {
    let (mut raw, proxy, response, conn) = a_long_http2_stream_to(Duration::from_secs(1)).await;
    cancelled_after_a_second(&mut raw, &proxy).await;
    tokio::time::timeout(PATIENCE, conn)
        .await
        .expect("the client's connection ended")
        .expect("no panic")
        .ok();
    drop(response);
    assert_no_foreign_panic();
}

/// On one HTTP/2 connection, a response held behind its shut window does
/// not get the connection closed while another request on it waits on a
/// quiet upstream: that stream, silent for 2.5 s (past the 1 s
/// `--client-timeout`), comes whole. Once it has ended, the held one is
/// alone, and the connection is closed. (A first version closed it while
/// the quiet stream waited, and cut that stream too.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_held_http2_stream_does_not_cut_a_quiet_one_beside_it() {
    let upstream = FakeUpstream::start(|req| {
        if req.uri.path() == "/v1/big" {
            return Reply::new(200)
                .header("content-type", "text/plain")
                .then(Step::Repeat(Bytes::from(vec![b'x'; 16 * 1024])));
        }
        Reply::new(200)
            .header("content-type", "text/plain")
            .body("before the pause\n")
            .then(Step::Sleep(Duration::from_millis(2500)))
            .body("after it\n")
    })
    .await;
    let mut config = proxy_config(&upstream.url(""));
    config.client_timeout = Duration::from_secs(1);
    let proxy = Served::start(config).await;
    let stream = TcpStream::connect(proxy.addr).await.expect("connect");
    // The connection's window wide, so that the held stream's bytes leave
    // room for the other's.
    let (mut sender, conn) = hyper::client::conn::http2::Builder::new(TokioExecutor::new())
        .initial_stream_window_size(65_535)
        .initial_connection_window_size(16 * 1024 * 1024)
        .adaptive_window(false)
        .handshake(TokioIo::new(stream))
        .await
        .expect("handshake");
    let conn = tokio::spawn(conn);
    let get = |path: &str| {
        Request::get(format!("http://{}{path}", proxy.addr))
            .body(Full::new(Bytes::new()))
            .expect("request")
    };
    let held = tokio::time::timeout(PATIENCE, sender.send_request(get("/v1/big")))
        .await
        .expect("in time")
        .expect("response");
    let quiet = tokio::time::timeout(PATIENCE, sender.send_request(get("/v1/quiet")))
        .await
        .expect("in time")
        .expect("response");
    let (got, end) = read_body(&mut quiet.into_body(), Duration::from_secs(10)).await;
    end.expect("the quiet stream came whole");
    assert_eq!(got, b"before the pause\nafter it\n");
    tokio::time::timeout(Duration::from_secs(10), conn)
        .await
        .expect("the connection was closed once the held stream was alone")
        .expect("no panic")
        .ok();
    drop(held);
}

/// An HTTP/2 client that reads its response slowly (a frame every 100 ms,
/// far slower than the stream comes) is not closed, however long it stays
/// behind: each read opens its window, and the proxy's body is asked for
/// more.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_http2_client_that_reads_slowly_is_not_closed() {
    // 3 s: the client opens its window every other frame (200 ms apart),
    // and a CI run of the suite once starved this test past 1 s.
    let (mut raw, _proxy, response, _conn) = a_long_http2_stream_to(Duration::from_secs(3)).await;
    let mut body = response.into_body();
    reads_slowly_and_stays_open(&mut raw, async || {
        let frame = tokio::time::timeout(PATIENCE, body.frame())
            .await
            .expect("a frame in time")
            .expect("the stream went on")
            .unwrap_or_else(|err| panic!("the stream failed: {err}"));
        frame.data_ref().map_or(0, Bytes::len)
    })
    .await;
}

/// An upstream whose `Content-Length` promises more than it sends before
/// it closes (a FIN in the middle of event 5): the client gets every byte
/// that came, the half event included (the pipeline's output of them),
/// then an error, not a clean end; no `[DONE]` is invented; the session is
/// released and the failure is counted as an upstream reset.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upstream_that_closes_before_its_content_length_loses_nothing() {
    let input = fixture(SINGLE_CALL);
    let spans = event_spans(&input);
    let cut = spans[4].start + spans[4].len() / 2;
    let sent = input[..cut].to_vec();
    let total = input.len();
    let mut raw = RawUpstream::start(move |_| {
        vec![
            RawStep::Write(Bytes::from(format!(
                "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncontent-length: {total}\r\nconnection: close\r\n\r\n"
            ))),
            RawStep::Write(Bytes::copy_from_slice(&sent)),
            RawStep::Close,
        ]
    })
    .await;
    let proxy = Served::start(proxy_config(&raw.url())).await;
    let response = send(&client(), post(&proxy.url("/v1/chat/completions"), "short")).await;
    assert_eq!(response.status(), StatusCode::OK);
    let (got, end) = read_body(&mut response.into_body(), PATIENCE).await;
    let expected = annotate(&input[..cut]);
    assert_eq!(got.len(), expected.len());
    assert!(got == expected, "the bytes differ");
    assert!(got.ends_with(&input[spans[4].start..cut]), "the half event");
    assert!(end.is_err(), "a short body ended cleanly");
    assert!(!String::from_utf8_lossy(&got).contains("[DONE]"));
    assert!(matches!(
        raw.next(PATIENCE).await,
        Some(RawEvent::Head { .. })
    ));
    assert_eq!(
        raw.next(PATIENCE).await,
        Some(RawEvent::Closed { n: 0 }),
        "the proxy kept the upstream connection"
    );
    let sessions = proxy.sessions().clone();
    assert!(eventually(PATIENCE, || sessions.is_empty()).await);
    assert_resets_counted(&proxy, 1.0).await;
    assert_no_foreign_panic();
}

/// A stream of `fragments` (one tool call) that the upstream sends at once
/// and then closes before its last chunk, through a proxy whose sockets
/// to clients have a send buffer of `buffers` bytes (when given), read
/// by a client whose receive buffer is as small, that waits `pause`
/// after its request, then reads 16 KiB at a time, `between` apart. The
/// client must get every byte, each event with its progress, then a cut
/// end (no last chunk).
async fn a_slow_client_gets_every_byte(
    fragments: usize,
    buffers: Option<u32>,
    pause: Duration,
    between: Duration,
) -> usize {
    let fragments: Vec<String> = {
        let mut rng = Lcg(7);
        (0..fragments).map(|_| fragment(&mut rng)).collect()
    };
    let (stream, _) = one_call_stream(&fragments);
    // Whole events, the finish included; no `[DONE]`: the body just stops.
    let sent = stream[..stream.len() - DONE.len()].to_vec();
    let expected = annotate(&sent);
    let body = chunk(&sent);
    let raw = RawUpstream::start(move |_| {
        vec![
            RawStep::Write(chunked_head("text/event-stream")),
            RawStep::Write(body.clone()),
            RawStep::Close,
        ]
    })
    .await;
    let proxy = match buffers {
        Some(bytes) => Served::start_on(
            upstream::listener_with_send_buffer(bytes),
            proxy_config(&raw.url()),
        ),
        None => Served::start(proxy_config(&raw.url())).await,
    };
    let socket = tokio::net::TcpSocket::new_v4().expect("socket");
    if let Some(bytes) = buffers {
        socket.set_recv_buffer_size(bytes).expect("SO_RCVBUF");
    }
    let mut socket = socket.connect(proxy.addr).await.expect("connect");
    socket
        .write_all(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 2\r\n\r\n{}")
        .await
        .expect("request");
    tokio::time::sleep(pause).await;
    let mut got = Vec::new();
    let mut buf = vec![0u8; 16 * 1024];
    let read = tokio::time::timeout(Duration::from_secs(60), async {
        while let Ok(k) = socket.read(&mut buf).await {
            if k == 0 {
                break;
            }
            got.extend_from_slice(&buf[..k]);
            tokio::time::sleep(between).await;
        }
    })
    .await;
    assert!(read.is_ok(), "no end of the response in time");
    let head_end = find(&got, b"\r\n\r\n").expect("a response head") + 4;
    assert!(
        got.starts_with(b"HTTP/1.1 200"),
        "{}",
        String::from_utf8_lossy(&got[..head_end])
    );
    let (got, complete) = dechunk(&got[head_end..]);
    assert!(!complete, "a cut body ended cleanly");
    assert_eq!(got.len(), expected.len(), "bytes lost or added");
    assert!(got == expected, "the bytes differ");
    sent.len()
}

/// A client that reads nothing for a second after its request: the
/// upstream's whole stream (about 80 KB) and its failure come meanwhile.
/// The sockets between proxy and client take about 40 KB (their buffers
/// are 8 KiB, which the kernel doubles), and the connection holds the
/// rest, unwritten, when the failure comes. The error waits while the
/// socket stays full, so those bytes reach the client once it reads.
/// (When the error came 100 ms after the failure, hyper dropped them:
/// the client got 53,041 of its 117,251 bytes.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_pauses_gets_every_byte_before_an_upstream_failure() {
    let sent =
        a_slow_client_gets_every_byte(400, Some(8 * 1024), Duration::from_secs(1), Duration::ZERO)
            .await;
    assert!((60_000..100_000).contains(&sent), "{sent} bytes");
    assert_no_foreign_panic();
}

/// A client that reads 16 KiB a millisecond while its upstream sends
/// 16 MB of events as fast as it can and fails: the proxy's writes wait
/// on the client's socket, so when the failure comes its connection
/// still holds bytes it has not written, for longer than 100 ms in a
/// debug build.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_client_gets_every_byte_before_an_upstream_failure() {
    let sent =
        a_slow_client_gets_every_byte(80_000, None, Duration::ZERO, Duration::from_millis(1)).await;
    assert!(sent > 16_000_000, "{sent} bytes");
    assert_no_foreign_panic();
}

/// What the proxy's own HTTP/1.1 client (plain `http://` upstreams, see
/// `src/proxy/h1.rs`) makes of each way an upstream may frame a response,
/// sent raw. Each reaches the client as the upstream meant it:
///
/// | upstream sends | the client gets |
/// | --- | --- |
/// | `100 Continue` and `103 Early Hints` before the `200` | the `200`, without the interim responses' headers |
/// | an HTTP/1.0 body delimited by the connection's close | the whole body, a clean end |
/// | chunk sizes in upper case, with extensions, and trailers | the body, whole, a clean end |
/// | head and `content-length` body a byte per write | the body, whole |
/// | `101 Switching Protocols` (the proxy does not tunnel) | `502` |
/// | a head of 70,000 bytes (over 64 KiB) | `502` |
/// | `5\r\nhello\r\n` then a chunk size that is not hex | `hello`, then no clean end |
/// | `Content-Length: 3` beside `Transfer-Encoding: chunked` (RFC 9112 §6.3: the chunks frame it) | the whole chunked body, no `Content-Length` |
/// | trailers it names in `Trailer`, to a client that sent `TE: trailers` | the body, then the trailers |
/// | `Transfer-Encoding: gzip, chunked`, or `gzip` until the close | `502` `upstream_error` (the coding is the hop's: passed on, the client got gzip bytes as if plain) |
///
/// The client always gets `HTTP/1.1`, from an HTTP/1.0 upstream too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_response_framing_of_an_http_1_upstream_reaches_the_client() {
    let ok = "HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\nconnection: close\r\n";
    let cases: Vec<(&str, Vec<RawStep>)> = vec![
        (
            "/interim",
            vec![RawStep::Write(Bytes::from(format!(
                "HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nlink: </x>\r\n\r\n\
                 {ok}content-length: 5\r\n\r\nhello"
            )))],
        ),
        (
            "/until-close",
            vec![
                RawStep::Write(Bytes::from_static(
                    b"HTTP/1.0 200 OK\r\ncontent-type: text/plain\r\n\r\nbytes until ",
                )),
                RawStep::Write(Bytes::from_static(b"the end")),
                RawStep::Close,
            ],
        ),
        (
            "/chunk-extensions",
            vec![RawStep::Write(Bytes::from(format!(
                "{ok}transfer-encoding: chunked\r\n\r\nA;name=\"v\"\r\n0123456789\r\n\
                 1 \r\n!\r\n0\r\nx-usage: 12\r\n\r\n"
            )))],
        ),
        (
            "/one-byte-writes",
            format!("{ok}content-length: 11\r\n\r\nhello world")
                .bytes()
                .map(|b| RawStep::Write(Bytes::from(vec![b])))
                .collect(),
        ),
        (
            "/switch",
            vec![RawStep::Write(Bytes::from_static(
                b"HTTP/1.1 101 Switching Protocols\r\nconnection: upgrade\r\nupgrade: x\r\n\r\n",
            ))],
        ),
        (
            "/huge-head",
            vec![RawStep::Write(Bytes::from(format!(
                "{ok}x-big: {}\r\n\r\n",
                "a".repeat(70_000)
            )))],
        ),
        (
            "/bad-chunk",
            vec![RawStep::Write(Bytes::from(format!(
                "{ok}transfer-encoding: chunked\r\n\r\n5\r\nhello\r\nzz\r\n"
            )))],
        ),
        (
            "/length-and-chunks",
            vec![RawStep::Write(Bytes::from(format!(
                "{ok}content-length: 3\r\ntransfer-encoding: chunked\r\n\r\nA\r\n0123456789\r\n0\r\n\r\n"
            )))],
        ),
        (
            "/trailers",
            vec![RawStep::Write(Bytes::from(format!(
                "{ok}trailer: x-usage\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\nx-usage: 12\r\n\r\n"
            )))],
        ),
        (
            "/gzip-chunked",
            vec![RawStep::Write(Bytes::from(format!(
                "{ok}transfer-encoding: gzip, chunked\r\n\r\n3\r\ngz!\r\n0\r\n\r\n"
            )))],
        ),
        (
            "/gzip-until-close",
            vec![
                RawStep::Write(Bytes::from(format!(
                    "{ok}transfer-encoding: gzip\r\n\r\ngz!"
                ))),
                RawStep::Close,
            ],
        ),
    ];
    let scripts: BTreeMap<String, Vec<RawStep>> = cases
        .into_iter()
        .map(|(path, steps)| (path.to_owned(), steps))
        .collect();
    let raw = RawUpstream::start(move |head| {
        let text = String::from_utf8_lossy(head);
        let path = text.split_whitespace().nth(1).unwrap_or_default();
        scripts.get(path).cloned().unwrap_or_default()
    })
    .await;
    let proxy = Served::start(proxy_config(&raw.url())).await;

    let interim = raw_request(proxy.addr, "/interim", &[]).await;
    assert_eq!((interim.status, &interim.body[..]), (200, &b"hello"[..]));
    assert!(interim.complete);
    assert_eq!(interim.header("link"), None, "an interim response's header");

    let until_close = raw_request(proxy.addr, "/until-close", &[]).await;
    assert_eq!(until_close.status, 200);
    assert_eq!(
        until_close.version, "HTTP/1.1",
        "an HTTP/1.0 upstream's version"
    );
    assert_eq!(until_close.body, b"bytes until the end");
    assert!(until_close.complete);

    let both = raw_request(proxy.addr, "/length-and-chunks", &[]).await;
    assert_eq!(both.status, 200);
    assert_eq!(both.header("content-length"), None);
    assert_eq!(both.body, b"0123456789");
    assert!(both.complete);

    let trailers = raw_request(proxy.addr, "/trailers", &[b"te: trailers"]).await;
    assert_eq!(trailers.status, 200);
    assert_eq!(trailers.header("trailer").as_deref(), Some(&b"x-usage"[..]));
    assert_eq!(trailers.body, b"hello");
    assert!(trailers.complete);
    assert_eq!(trailers.trailer_lines, [b"x-usage: 12".to_vec()]);

    let extensions = raw_request(proxy.addr, "/chunk-extensions", &[]).await;
    assert_eq!(extensions.status, 200);
    assert_eq!(extensions.body, b"0123456789!");
    assert!(extensions.complete, "the last chunk reached the client");

    let pieces = raw_request(proxy.addr, "/one-byte-writes", &[]).await;
    assert_eq!(pieces.status, 200);
    assert_eq!(pieces.body, b"hello world");
    assert!(pieces.complete);

    for path in ["/switch", "/huge-head"] {
        let refused = raw_request(proxy.addr, path, &[]).await;
        assert_eq!(refused.status, 502, "{path}");
        refused.assert_well_formed();
    }

    // A transfer coding but chunked: the body could only go on in that
    // coding, and its `Transfer-Encoding` is the hop's (before, the
    // client got the coded bytes as if plain).
    for path in ["/gzip-chunked", "/gzip-until-close"] {
        let coded = raw_request(proxy.addr, path, &[]).await;
        assert_eq!(coded.status, 502, "{path}");
        coded.assert_well_formed();
        let error: Value = serde_json::from_slice(&coded.body).expect("JSON");
        assert_eq!(error["error"]["type"], "upstream_error", "{path}");
        assert!(
            error["error"]["message"]
                .as_str()
                .is_some_and(|m| m.contains("transfer coding")),
            "{path}: {error}"
        );
    }

    let bad = raw_request(proxy.addr, "/bad-chunk", &[]).await;
    assert_eq!(bad.status, 200);
    assert_eq!(bad.body, b"hello", "what came before the bad size line");
    assert!(!bad.complete, "a bad chunk size ended the body cleanly");
    assert_resets_counted(&proxy, 1.0).await;
    // Every request above, by the class its log line gives: the four
    // 502s, the rest 200 (the last cut, but its status went out).
    assert_eq!(proxy.metric("aalis_requests_total{code=\"5xx\"}"), 4.0);
    assert_eq!(proxy.metric("aalis_requests_total{code=\"2xx\"}"), 7.0);
    assert_no_foreign_panic();
}

/// A client that sends all of a large request before it reads (a blocking
/// one), to an upstream that answers at length while it still reads the
/// request: both go through whole. The rest of the request was sent only
/// when the response body was polled, which hyper does only while the
/// client takes bytes: the proxy waited on the client, which waited on
/// the proxy to take its request, for good.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_sent_whole_before_reading_does_not_deadlock_with_an_early_answer() {
    const SIZE: usize = 16 * 1024 * 1024;
    let raw = RawUpstream::start(|_| {
        vec![
            RawStep::Write(Bytes::from(format!(
                "HTTP/1.1 200 OK\r\ncontent-type: application/octet-stream\r\n\
                 content-length: {SIZE}\r\nconnection: close\r\n\r\n"
            ))),
            RawStep::Write(Bytes::from(vec![b'r'; SIZE])),
        ]
    })
    .await;
    let proxy = Served::start(proxy_config(&raw.url())).await;
    let mut client = TcpStream::connect(proxy.addr).await.expect("connect");
    let mut request = format!(
        "POST /v1/upload HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\
         content-type: application/octet-stream\r\ncontent-length: {SIZE}\r\n\r\n"
    )
    .into_bytes();
    request.extend(std::iter::repeat_n(b'q', SIZE));
    tokio::time::timeout(Duration::from_secs(30), client.write_all(&request))
        .await
        .expect("the whole request was taken (else the proxy and the client wait on each other)")
        .expect("write the request");
    let mut got = Vec::new();
    tokio::time::timeout(Duration::from_secs(30), client.read_to_end(&mut got))
        .await
        .expect("the whole response in time")
        .expect("read the response");
    let head_end = find(&got, b"\r\n\r\n").expect("a response head") + 4;
    assert!(
        got.starts_with(b"HTTP/1.1 200"),
        "{}",
        String::from_utf8_lossy(&got[..head_end])
    );
    assert_eq!(got.len() - head_end, SIZE);
    assert!(got[head_end..].iter().all(|&b| b == b'r'));
    assert_no_foreign_panic();
}

/// A client that goes away after all of its request was sent, from a
/// response whose head came before the request's end, while the upstream
/// sends nothing more: the upstream request is cancelled (its connection
/// closed) at once. The task that reads such a response waited on the
/// upstream alone, and no bound was left (the idle timer goes with the
/// client's side).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_leaves_an_early_answered_request_cancels_it() {
    let mut raw = RawUpstream::start(|_| {
        vec![RawStep::Write(Bytes::from_static(
            b"HTTP/1.1 200 OK\r\ncontent-type: application/octet-stream\r\n\
              content-length: 1000000\r\n\r\nfirst bytes",
        ))]
    })
    .await;
    let proxy = Served::start(proxy_config(&raw.url())).await;
    let mut client = TcpStream::connect(proxy.addr).await.expect("connect");
    let half = vec![b'q'; 100_000];
    client
        .write_all(b"POST /v1/upload HTTP/1.1\r\nhost: x\r\ncontent-length: 200000\r\n\r\n")
        .await
        .expect("head");
    client.write_all(&half).await.expect("first half");
    assert!(
        matches!(raw.next(PATIENCE).await, Some(RawEvent::Head { n: 0, .. })),
        "the request reached the upstream"
    );
    // The answer's head comes while half of the request is still to come.
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    while find(&got, b"first bytes").is_none() {
        let n = tokio::time::timeout(PATIENCE, client.read(&mut buf))
            .await
            .expect("the early answer in time")
            .expect("read");
        assert!(n > 0, "closed");
        got.extend_from_slice(&buf[..n]);
    }
    client.write_all(&half).await.expect("second half");
    tokio::time::sleep(Duration::from_millis(200)).await;
    drop(client);
    assert_eq!(
        raw.next(PATIENCE).await,
        Some(RawEvent::Closed { n: 0 }),
        "the upstream request is still open"
    );
    assert_no_foreign_panic();
}

/// The request side of the same client: a body the client sends chunked
/// (no length) reaches the upstream whole, chunked again; one with a
/// length goes with that length; a `GET` goes without a body. And an
/// upstream that answers `413` as soon as it has the head of a 4 MiB
/// request (more than the sockets buffer) gets its answer to the client:
/// the proxy does not wait to have written the whole body first.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn request_bodies_reach_an_http_1_upstream_however_they_are_framed() {
    let upstream = FakeUpstream::start(|_| Reply::new(200).body("ok")).await;
    let proxy = Served::start(proxy_config(&upstream.url(""))).await;
    let chunked = raw_exchange(
        proxy.addr,
        b"POST /chunked HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\
          transfer-encoding: chunked\r\n\r\n5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n",
    )
    .await;
    assert_eq!(RawResponse::parse(&chunked).status, 200);
    let sized = raw_request(proxy.addr, "/sized", &[]).await;
    assert_eq!(sized.status, 200);
    let got = raw_exchange(
        proxy.addr,
        b"GET /get HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n",
    )
    .await;
    assert_eq!(RawResponse::parse(&got).status, 200);
    let requests = upstream.requests();
    let by_path = |path: &str| {
        requests
            .iter()
            .find(|r| r.uri.path() == path)
            .unwrap_or_else(|| panic!("{path} did not reach the upstream"))
    };
    let chunked = by_path("/chunked");
    assert_eq!(&chunked.body[..], b"hello world");
    assert_eq!(
        chunked
            .headers
            .get("transfer-encoding")
            .map(|v| v.as_bytes()),
        Some(&b"chunked"[..])
    );
    assert_eq!(
        by_path("/sized")
            .headers
            .get("content-length")
            .map(|v| v.as_bytes()),
        Some(&b"2"[..])
    );
    assert_eq!(&by_path("/sized").body[..], b"{}");
    let get = by_path("/get");
    assert!(get.body.is_empty());
    assert!(!get.headers.contains_key("content-length"));
    assert!(!get.headers.contains_key("transfer-encoding"));

    let early = RawUpstream::start(|_| {
        vec![RawStep::Write(Bytes::from_static(
            b"HTTP/1.1 413 Content Too Large\r\ncontent-length: 8\r\nconnection: close\r\n\r\ntoo big!",
        ))]
    })
    .await;
    let proxy = Served::start(proxy_config(&early.url())).await;
    let size = 4 << 20;
    let mut request = format!(
        "POST /big HTTP/1.1\r\nhost: x\r\nconnection: close\r\ncontent-length: {size}\r\n\r\n"
    )
    .into_bytes();
    request.resize(request.len() + size, b'x');
    let answer = RawResponse::parse(&raw_exchange(proxy.addr, &request).await);
    assert_eq!((answer.status, &answer.body[..]), (413, &b"too big!"[..]));
    assert_no_foreign_panic();
}

/// A chunked request whose trailer section carries fields a trailer may
/// not (framing, routing, authentication, request modifiers, hop-by-hop)
/// beside one it may: only that one reaches an HTTP/1.1 upstream, after
/// the body, which is whole. (Before, every trailer line went on as the
/// client wrote it: an upstream that merges trailers into the head would
/// have taken `host: evil` or `content-length: 99` for the request's own.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn request_trailers_that_may_not_be_trailers_stop_at_the_proxy() {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let upstream = listener.local_addr().expect("addr");
    let (tx, seen) = oneshot::channel::<Vec<u8>>();
    tokio::spawn(async move {
        let Ok((mut stream, _)) = listener.accept().await else {
            return;
        };
        // The whole request: its head, its last chunk, its trailers.
        let mut got = Vec::new();
        let mut buf = [0u8; 4096];
        let complete = |got: &[u8]| {
            find(got, b"\r\n0\r\n").is_some_and(|at| find(&got[at + 2..], b"\r\n\r\n").is_some())
        };
        while !complete(&got) {
            match stream.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(k) => got.extend_from_slice(&buf[..k]),
            }
        }
        let _ = tx.send(got);
        let reply = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\nconnection: close\r\n\r\nok";
        let _ = stream.write_all(reply).await;
    });
    let proxy = Served::start(proxy_config(&format!("http://{upstream}"))).await;
    let request = b"POST /t HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\
        transfer-encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\
        x-checksum: 1\r\ncontent-length: 99\r\nauthorization: Bearer x\r\nhost: evil\r\n\
        cookie: a=1\r\nproxy-authorization: Basic eA==\r\ntransfer-encoding: gzip\r\n\
        te: trailers\r\ntrailer: x\r\ncontent-type: text/plain\r\nexpect: 100-continue\r\n\
        cache-control: no-cache\r\nmax-forwards: 1\r\nx-after: 2\r\n\r\n";
    let answer = RawResponse::parse(&raw_exchange(proxy.addr, request).await);
    assert_eq!(answer.status, 200);
    let got = tokio::time::timeout(PATIENCE, seen)
        .await
        .expect("the request in time")
        .expect("the request");
    let body_at = find(&got, b"\r\n\r\n").expect("a head") + 4;
    let (body, complete, trailers) = dechunk_with_trailers(&got[body_at..]);
    assert!(complete, "{}", String::from_utf8_lossy(&got));
    assert_eq!(&body[..], b"hello");
    let trailers: Vec<String> = trailers
        .iter()
        .map(|line| String::from_utf8_lossy(line).into_owned())
        .collect();
    assert_eq!(trailers, ["x-checksum: 1", "x-after: 2"]);
    assert_no_foreign_panic();
}

/// The same trailers to an HTTP/2 upstream (over TLS): only the fields a
/// trailer may carry go on, and the request is answered at once. (Before,
/// they went on as written: `te` or `connection` there made the upstream
/// refuse the request, which then waited for `--response-timeout`,
/// `content-length` was a protocol error blamed on the upstream, and
/// `authorization` and `host` reached it.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn request_trailers_that_may_not_be_trailers_stop_at_the_proxy_over_http2() {
    let pki = test_pki();
    let ca = write_test_ca(&pki, "aalis-faults-test-ca-trailers");
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let upstream = FakeUpstream::start_on(listener, Some(pki.server.clone()), |_| {
        Reply::new(200).body("ok")
    });
    let mut config = proxy_config(&format!("https://127.0.0.1:{}", upstream.addr.port()));
    config.upstream_ca = Some(ca.clone());
    let proxy = Served::start(config).await;
    let refused = [
        "te: gzip\r\n",
        "connection: close\r\n",
        "content-length: 99\r\n",
        "authorization: Bearer x\r\nhost: evil\r\ncookie: a=1\r\n\
         proxy-authorization: Basic eA==\r\ntrailer: x\r\ncontent-type: text/plain\r\n",
    ];
    for trailers in refused {
        let request = format!(
            "POST /t HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\
             transfer-encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\
             x-checksum: 1\r\n{trailers}x-after: 2\r\n\r\n"
        );
        // Answered, not the 504 of a request the upstream refused and
        // never answered (the proxy's response timeout here is 5 s).
        let answer = RawResponse::parse(&raw_exchange(proxy.addr, request.as_bytes()).await);
        assert_eq!(
            (answer.status, &answer.body[..]),
            (200, &b"ok"[..]),
            "{trailers:?}: {}",
            String::from_utf8_lossy(&answer.body)
        );
    }
    let requests = upstream.requests();
    assert_eq!(requests.len(), refused.len());
    for request in requests {
        assert_eq!(&request.body[..], b"hello");
        let mut names: Vec<String> = request
            .trailers
            .iter()
            .flat_map(|t| t.keys().map(|k| k.as_str().to_owned()))
            .collect();
        names.sort();
        assert_eq!(names, ["x-after", "x-checksum"]);
    }
    let _ = std::fs::remove_file(&ca);
    assert_no_foreign_panic();
}

/// A request body in a transfer coding other than `chunked` (`gzip,
/// chunked` in one field, or `gzip` and `chunked` in two) is a `501` with
/// the proxy's JSON error, and never reaches the upstream (RFC 9112
/// §6.1). (Before, hyper took it as chunked, and the gzip-coded bytes
/// went upstream as a plain chunked body.) Plain `chunked`, in any case,
/// still passes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_in_an_unknown_transfer_coding_is_a_501() {
    let upstream = FakeUpstream::start(|_| Reply::new(200).body("ok")).await;
    let proxy = Served::start(proxy_config(&upstream.url(""))).await;
    let body = "5\r\nhello\r\n0\r\n\r\n";
    for codings in [
        &["gzip, chunked"][..],
        &["gzip", "chunked"],
        &["deflate , Chunked"],
        &["x-custom,chunked"],
    ] {
        let mut request = b"POST /coded HTTP/1.1\r\nhost: x\r\nconnection: close\r\n".to_vec();
        for coding in codings {
            request.extend_from_slice(format!("transfer-encoding: {coding}\r\n").as_bytes());
        }
        request.extend_from_slice(format!("\r\n{body}").as_bytes());
        let answer = RawResponse::parse(&raw_exchange(proxy.addr, &request).await);
        assert_eq!(answer.status, 501, "{codings:?}");
        let error: Value = serde_json::from_slice(&answer.body).expect("a JSON error");
        assert_eq!(error["error"]["type"], "not_implemented", "{codings:?}");
        assert!(
            error["error"]["message"]
                .as_str()
                .is_some_and(|m| m.contains("transfer coding")),
            "{error}"
        );
    }
    assert!(
        upstream.requests().is_empty(),
        "a coded body reached the upstream"
    );
    let plain = format!(
        "POST /plain HTTP/1.1\r\nhost: x\r\nconnection: close\r\ntransfer-encoding: Chunked\r\n\r\n{body}"
    );
    let answer = RawResponse::parse(&raw_exchange(proxy.addr, plain.as_bytes()).await);
    assert_eq!(answer.status, 200);
    let requests = upstream.requests();
    assert_eq!(requests.len(), 1);
    assert_eq!(&requests[0].body[..], b"hello");
    assert_no_foreign_panic();
}

/// RFC 9112 §3.2: an HTTP/1.1 request without `Host`, or any with two,
/// is a `400`, never forwarded; so is a request with two `X-Aalis-Session`
/// or `X-Aalis-Inject` headers (before, the first was taken without a
/// word). The proxy's own routes take the `Host` rule too. HTTP/1.0 may go
/// without `Host`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_with_no_host_or_doubled_headers_is_a_400() {
    let upstream = FakeUpstream::start(|_| Reply::new(200).body("ok")).await;
    let proxy = Served::start(proxy_config(&upstream.url(""))).await;
    for (head, said) in [
        ("GET /v1/models HTTP/1.1\r\n", "must carry a Host header"),
        (
            "GET /v1/models HTTP/1.1\r\nhost: 127.0.0.1\r\nhost: example.com\r\n",
            "one Host header",
        ),
        (
            "GET /v1/models HTTP/1.0\r\nhost: a\r\nhost: b\r\n",
            "one Host header",
        ),
        // The proxy's own routes too.
        (
            "GET /_aalis/metrics HTTP/1.1\r\n",
            "must carry a Host header",
        ),
        (
            "GET /v1/models HTTP/1.1\r\nhost: x\r\nx-aalis-session: a\r\nX-Aalis-Session: b\r\n",
            "X-Aalis-Session must be sent once",
        ),
        (
            "GET /v1/models HTTP/1.1\r\nhost: x\r\nx-aalis-inject: none\r\nx-aalis-inject: none\r\n",
            "X-Aalis-Inject must be sent once",
        ),
    ] {
        let request = format!("{head}connection: close\r\n\r\n");
        let answer = RawResponse::parse(&raw_exchange(proxy.addr, request.as_bytes()).await);
        assert_eq!(answer.status, 400, "{head:?}");
        let error: Value = serde_json::from_slice(&answer.body).expect("a JSON error");
        assert_eq!(error["error"]["type"], "invalid_request_error", "{head:?}");
        let message = error["error"]["message"].as_str().unwrap_or_default();
        assert!(message.contains(said), "{head:?}: {message}");
    }
    assert!(
        upstream.requests().is_empty(),
        "a refused request reached the upstream"
    );
    let answer =
        RawResponse::parse(&raw_exchange(proxy.addr, b"GET /v1/models HTTP/1.0\r\n\r\n").await);
    assert_eq!(answer.status, 200, "HTTP/1.0 without Host");
    assert_eq!(answer.body, b"ok");
    assert_eq!(upstream.requests().len(), 1);
    assert_no_foreign_panic();
}

/// An HTTP/1.0 client that asks for keep-alive gets a stream (no length)
/// up to the connection's close, and is told `Connection: close`, not
/// `keep-alive` as hyper said; a response of a stated length keeps the
/// connection as asked.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_http_1_0_client_is_told_a_stream_ends_with_the_connection() {
    let upstream = FakeUpstream::start(|req| match req.uri.path() {
        "/sse" => Reply::stream(
            "text/event-stream",
            [&b"data: {}\n\n"[..], b"data: [DONE]\n\n"],
        ),
        _ => Reply::new(200).header("content-length", "2").body("ok"),
    })
    .await;
    let proxy = Served::start(proxy_config(&upstream.url(""))).await;
    let stream = TcpStream::connect(proxy.addr).await.expect("connect");
    let (mut rd, mut wr) = stream.into_split();
    // A response of a stated length: the connection stays, as asked.
    wr.write_all(b"GET /sized HTTP/1.0\r\nconnection: keep-alive\r\n\r\n")
        .await
        .expect("write");
    let sized = read_sized_response(&mut rd).await;
    assert_eq!(sized.status, 200);
    assert_eq!(sized.body, b"ok");
    assert_eq!(
        sized.header("connection").as_deref(),
        Some(&b"keep-alive"[..])
    );
    // Then a stream on the same connection: told it ends with the close.
    wr.write_all(b"GET /sse HTTP/1.0\r\nconnection: keep-alive\r\n\r\n")
        .await
        .expect("write");
    let mut rest = Vec::new();
    tokio::time::timeout(PATIENCE, rd.read_to_end(&mut rest))
        .await
        .expect("the connection closes after the stream")
        .expect("read");
    let answer = RawResponse::parse(&rest);
    assert_eq!(answer.status, 200);
    assert_eq!(answer.header("connection").as_deref(), Some(&b"close"[..]));
    assert_eq!(answer.header("content-length"), None);
    assert!(
        answer.body.ends_with(b"data: [DONE]\n\n"),
        "{:?}",
        String::from_utf8_lossy(&answer.body)
    );
    assert_no_foreign_panic();
}

/// An upstream that answers each request as soon as it has its head (with
/// the next of `replies`, keep-alive), then waits for `go` before it
/// reads the request's body (its `content-length`), and reports it.
async fn early_answering_upstream(
    replies: Vec<&'static [u8]>,
    go: Arc<Notify>,
) -> (SocketAddr, mpsc::UnboundedReceiver<Vec<u8>>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    let (tx, rx) = mpsc::unbounded_channel();
    let replies = Arc::new(Mutex::new(replies.into_iter()));
    tokio::spawn(async move {
        loop {
            let Ok((mut stream, _)) = listener.accept().await else {
                return;
            };
            let (tx, replies, go) = (tx.clone(), replies.clone(), go.clone());
            tokio::spawn(async move {
                let mut seen = Vec::new();
                let mut buf = vec![0u8; 64 * 1024];
                loop {
                    let end = loop {
                        if let Some(at) = find(&seen, b"\r\n\r\n") {
                            break at + 4;
                        }
                        match stream.read(&mut buf).await {
                            Ok(0) | Err(_) => return,
                            Ok(k) => seen.extend_from_slice(&buf[..k]),
                        }
                    };
                    let head = String::from_utf8_lossy(&seen[..end]).to_ascii_lowercase();
                    let length: usize = head
                        .lines()
                        .find_map(|line| line.strip_prefix("content-length:"))
                        .and_then(|n| n.trim().parse().ok())
                        .unwrap_or(0);
                    seen.drain(..end);
                    let reply = replies.lock().expect("replies").next();
                    let Some(reply) = reply else { return };
                    if stream.write_all(reply).await.is_err() {
                        return;
                    }
                    go.notified().await;
                    while seen.len() < length {
                        match stream.read(&mut buf).await {
                            Ok(0) | Err(_) => break,
                            Ok(k) => seen.extend_from_slice(&buf[..k]),
                        }
                    }
                    let body: Vec<u8> = seen.drain(..length.min(seen.len())).collect();
                    let _ = tx.send(body);
                }
            });
        }
    });
    (addr, rx)
}

/// Reads one response with a `content-length` from `stream`, whole.
async fn read_sized_response(stream: &mut tokio::net::tcp::OwnedReadHalf) -> RawResponse {
    let mut got = Vec::new();
    let mut buf = [0u8; 16 * 1024];
    let read = tokio::time::timeout(PATIENCE, async {
        loop {
            if find(&got, b"\r\n\r\n").is_some() && RawResponse::parse(&got).complete {
                return;
            }
            match stream.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(k) => got.extend_from_slice(&buf[..k]),
            }
        }
    })
    .await;
    assert!(read.is_ok(), "no whole response in time");
    RawResponse::parse(&got)
}

/// An upstream that answers (`202`, no body; then `200` with a body)
/// before it has read the 5 MB request body the client sends in full,
/// then reads it: every byte of it reaches the upstream, and the client
/// has its answer before the upstream reads on. (Before, the rest of the request was dropped when the response
/// ended: the upstream got a few MB of the 5.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_body_answered_early_still_reaches_the_upstream_whole() {
    let go = Arc::new(Notify::new());
    let (upstream, mut bodies) = early_answering_upstream(
        vec![
            b"HTTP/1.1 202 Accepted\r\ncontent-length: 0\r\n\r\n",
            b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok",
        ],
        go.clone(),
    )
    .await;
    let proxy = Served::start(proxy_config(&format!("http://{upstream}"))).await;
    let size = 5_000_000;
    for (round, (status, answer)) in [(202, &b""[..]), (200, b"ok")].into_iter().enumerate() {
        let body: Vec<u8> = (0..size).map(|i| (i % 251) as u8 ^ round as u8).collect();
        let mut request =
            format!("POST /up HTTP/1.1\r\nhost: x\r\ncontent-length: {size}\r\n\r\n").into_bytes();
        request.extend_from_slice(&body);
        let stream = TcpStream::connect(proxy.addr).await.expect("connect");
        let (mut rd, mut wr) = stream.into_split();
        let writer = tokio::spawn(async move {
            wr.write_all(&request)
                .await
                .expect("the whole request written");
            wr
        });
        let response = read_sized_response(&mut rd).await;
        assert_eq!((response.status, &response.body[..]), (status, answer));
        go.notify_one();
        let read = tokio::time::timeout(PATIENCE, bodies.recv())
            .await
            .expect("the upstream read the body in time")
            .expect("a body");
        assert_eq!(read.len(), size, "round {round}: bytes the upstream got");
        assert!(
            read == body,
            "round {round}: the body reached the upstream changed"
        );
        drop(
            tokio::time::timeout(PATIENCE, writer)
                .await
                .expect("written"),
        );
        drop(rd);
    }
    assert_no_foreign_panic();
}

/// A stream whose upstream ends it with trailers, its last event not
/// ended: that event is held until the trailers come, and goes out just
/// before them. Every byte the client gets is counted in
/// `aalis_bytes_out_total`, those too, and equals what came in.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bytes_sent_before_an_upstreams_trailers_are_counted() {
    let first = "data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"Hel\"}}]}\n\n";
    let last = "data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"lo\"}}]}";
    let head = "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n\
                transfer-encoding: chunked\r\n\r\n";
    let steps = vec![
        RawStep::Write(Bytes::from(format!(
            "{head}{:x}\r\n{first}\r\n",
            first.len()
        ))),
        RawStep::Write(Bytes::from(format!(
            "{:x}\r\n{last}\r\n0\r\nx-usage: 12\r\n\r\n",
            last.len()
        ))),
    ];
    let raw = RawUpstream::start(move |_| steps.clone()).await;
    let proxy = Served::start(proxy_config(&raw.url())).await;
    let response = raw_request(proxy.addr, "/v1/chat/completions", &[b"te: trailers"]).await;
    assert_eq!(response.status, 200);
    assert!(response.complete);
    let sent = format!("{first}{last}");
    assert_eq!(String::from_utf8_lossy(&response.body), sent);
    let want = sent.len() as f64;
    assert!(
        eventually(PATIENCE, || proxy.metric("aalis_bytes_out_total") == want).await,
        "aalis_bytes_out_total is {}, not {want}",
        proxy.metric("aalis_bytes_out_total")
    );
    assert_eq!(proxy.metric("aalis_bytes_in_total"), want);
}

/// The proxy counts `resets` upstream resets (in time: the count follows
/// the stream's end).
async fn assert_resets_counted(proxy: &Served, resets: f64) {
    let name = "aalis_upstream_errors_total{kind=\"reset\"}";
    assert!(
        eventually(PATIENCE, || proxy.metric(name) == resets).await,
        "{name} is {}, not {resets}",
        proxy.metric(name)
    );
}

// ===========================================================================
// 2. Invalid UTF-8

/// An event that must be reported: its number, its byte offset in the
/// stream, and where its data stops being UTF-8.
type BadEvent = (u64, usize, usize);

/// A tool-call stream with invalid UTF-8 in nine places, and what must come
/// of it: `(stream, progress expected, (event number, byte offset, valid_up_to)
/// of each event that must be reported)`.
///
/// Reported (their data is not UTF-8, so not JSON: passed on unchanged,
/// their chunks not applied): a data line of raw bytes; a chunk whose
/// `model` string holds `\xff` (its tool delta is lost with it); tool
/// arguments with a bad continuation byte; tool arguments cut inside a
/// three-byte character. Not reported (nothing in them is parsed): a
/// comment, an event name, an `id:` field.
fn invalid_utf8_stream() -> (Vec<u8>, Vec<Seen>, Vec<BadEvent>) {
    let mut events: Vec<Vec<u8>> = Vec::new();
    let mut bad: Vec<(usize, usize)> = Vec::new(); // (event position, valid_up_to)
    events.push(role_event().into_bytes());
    events.push(tool_event(&[tool_entry(0, Some(("call_1", "write_file")), "")]).into_bytes());
    events.push(tool_event(&[tool_entry(0, None, "{\\\"path\\\":\\\"")]).into_bytes());
    // A data line that is raw bytes.
    bad.push((events.len(), 0));
    events.push(b"data: \xff\xfe not JSON \xc0\n\n".to_vec());
    // Invalid UTF-8 inside a JSON string outside the delta.
    let mut e = tool_event(&[tool_entry(0, None, "LOST")]).into_bytes();
    let at = find(&e, b"\"model\":\"m\"").expect("model") + 9;
    e.splice(at..at, *b"\xff");
    bad.push((events.len(), at - "data: ".len()));
    events.push(e);
    // A bad continuation byte inside the tool arguments.
    let mut e = tool_event(&[tool_entry(0, None, "ab")]).into_bytes();
    let at = find(&e, b"\"arguments\":\"ab").expect("arguments") + 14;
    e.splice(at..at, *b"\xc3(");
    bad.push((events.len(), at - "data: ".len()));
    events.push(e);
    // Tool arguments that end inside a three-byte character.
    let mut e = tool_event(&[tool_entry(0, None, "")]).into_bytes();
    let at = find(&e, b"\"arguments\":\"").expect("arguments") + 13;
    e.splice(at..at, *b"\xe6\x9d");
    bad.push((events.len(), at - "data: ".len()));
    events.push(e);
    // A comment of raw bytes, in a block of its own.
    events.push(b": \xff\xfe\xfd comment\n\n".to_vec());
    // An event whose name is not UTF-8: a named event, forwarded unparsed.
    events.push(b"event: \xffweird\ndata: {\"x\":1}\n\n".to_vec());
    // An `id:` field that is not UTF-8 beside a good tool delta.
    let mut e = b"id: \xff\xfe\n".to_vec();
    e.extend_from_slice(tool_event(&[tool_entry(0, None, "x.txt\\\"")]).as_bytes());
    events.push(e);
    events.push(tool_event(&[tool_entry(0, None, "}")]).into_bytes());
    events.push(finish_event().into_bytes());
    events.push(DONE.as_bytes().to_vec());

    // SSE numbers the events that have data (the comment block has none).
    let mut reported = Vec::new();
    let mut offset = 0;
    let mut number = 0;
    for (k, event) in events.iter().enumerate() {
        if find(event, b"data:").is_some() {
            number += 1;
        }
        if let Some((_, valid)) = bad.iter().find(|(at, _)| *at == k) {
            reported.push((number, offset, *valid));
        }
        offset += event.len();
    }
    let name = "write_file".to_owned();
    let progress = vec![
        (0, name.clone(), 0),
        (0, name.clone(), 9),  // {"path":"
        (0, name.clone(), 15), // x.txt"
        (0, name, 16),         // }
    ];
    (events.concat(), progress, reported)
}

/// Ollama's NDJSON with invalid UTF-8 on two lines inserted before its tool
/// line (a `thinking` string with a lone `\xe9`, and a line of raw bytes):
/// the stream, and `(line number, byte offset, valid_up_to)` of each.
fn invalid_utf8_ndjson() -> (Vec<u8>, Vec<BadEvent>) {
    let fixture = fixture("ollama/thinking_two_tools.ndjson");
    let mut lines: Vec<Vec<u8>> = fixture
        .split_inclusive(|&b| b == b'\n')
        .map(<[u8]>::to_vec)
        .collect();
    let tool_line = lines
        .iter()
        .position(|l| find(l, b"tool_calls").is_some())
        .expect("a tool line");
    let thinking = b"{\"model\":\"qwen3:8b\",\"message\":{\"role\":\"assistant\",\"content\":\"\",\"thinking\":\"caf\xe9\"},\"done\":false}\n".to_vec();
    let valid = find(&thinking, b"\xe9").expect("the bad byte");
    lines.insert(tool_line, b"\xff\xfe raw\n".to_vec());
    lines.insert(tool_line, thinking);
    let mut reported = Vec::new();
    let mut offset = 0;
    for (k, line) in lines.iter().enumerate() {
        if k == tool_line {
            reported.push((k as u64 + 1, offset, valid));
        } else if k == tool_line + 1 {
            reported.push((k as u64 + 1, offset, 0));
        }
        offset += line.len();
    }
    (lines.concat(), reported)
}

/// Invalid UTF-8 through the real `serve` binary and through `annotate`,
/// in an SSE stream (9 places) and in Ollama's NDJSON (2 lines): each
/// stream reaches the client byte for byte (with the injected keys cut
/// out, exactly the upstream's bytes), goes on after each bad event, and
/// the progress after them is right (SSE: 0, 9, 15, 16 chars — the chunks
/// of the undecodable events are not applied, as SPEC.md says of data that
/// is not JSON; NDJSON: the two tools as without the bad lines). Each of
/// the 4 + 2 undecodable frames is reported once, with its event or line
/// number, its byte offset and where its UTF-8 breaks — in serve's log and
/// on annotate's stderr alike; `annotate` writes the same bytes as the
/// proxy sent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn invalid_utf8_is_passed_on_reported_and_tracking_goes_on() {
    let (sse, progress, sse_reported) = invalid_utf8_stream();
    assert_eq!(sse_reported.len(), 4);
    let (ndjson, ndjson_reported) = invalid_utf8_ndjson();
    let ndjson_progress = progress_of(&annotate_with(
        &fixture("ollama/thinking_two_tools.ndjson"),
        Framing::Ndjson,
    ));
    assert_eq!(ndjson_progress.len(), 2);
    let (sent_sse, sent_ndjson) = (sse.clone(), ndjson.clone());
    let upstream = FakeUpstream::start(move |req| {
        if req.uri.path() == "/api/chat" {
            Reply::stream("application/x-ndjson", pieces(&sent_ndjson, 40, 8))
        } else {
            Reply::stream("text/event-stream", pieces(&sent_sse, 40, 7))
        }
    })
    .await;
    let mut serve = ServeProcess::start(&upstream.url(""), &[]).await;
    let mut outputs = Vec::new();
    for (path, session, input, framing) in [
        ("/v1/chat/completions", "utf8-chat", &sse, Framing::Sse),
        ("/api/chat", "utf8-ollama", &ndjson, Framing::Ndjson),
    ] {
        let response = send(&client(), post(&serve.url(path), session)).await;
        assert_eq!(response.status(), StatusCode::OK);
        let (got, end) = read_body(&mut response.into_body(), PATIENCE).await;
        end.expect("a clean end");
        assert!(
            strip_injected(&got) == *input,
            "{path}: not the upstream's bytes"
        );
        assert!(got == annotate_with(input, framing), "{path}");
        outputs.push(got);
    }
    assert_eq!(progress_of(&outputs[0]), progress);
    assert_eq!(progress_of(&outputs[1]), ndjson_progress);

    let log = serve.stop().await;
    assert!(!log.contains("panicked"), "{log}");
    for (input, output, unit, reported) in [
        (&sse, &outputs[0], "SSE event", &sse_reported),
        (&ndjson, &outputs[1], "NDJSON line", &ndjson_reported),
    ] {
        let annotate_run = common::base_command()
            .args(["annotate", "-"])
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .and_then(|mut child| {
                use std::io::Write;
                child.stdin.take().expect("stdin").write_all(input)?;
                child.wait_with_output()
            })
            .expect("run annotate");
        assert!(annotate_run.status.success());
        assert!(annotate_run.stdout == *output, "annotate and serve differ");
        let stderr = String::from_utf8_lossy(&annotate_run.stderr).into_owned();
        assert_eq!(
            stderr.lines().count(),
            reported.len(),
            "annotate: one line per bad frame:\n{stderr}"
        );
        for (name, text) in [("serve's log", &log), ("annotate's stderr", &stderr)] {
            let warnings: Vec<&str> = text
                .lines()
                .filter(|l| l.contains("is not UTF-8") && l.contains(unit))
                .collect();
            assert_eq!(warnings.len(), reported.len(), "{name}:\n{text}");
            for ((number, offset, valid), line) in reported.iter().zip(&warnings) {
                let wanted = format!(
                    "{unit} {number} (byte {offset}): data is not UTF-8 (byte {valid} of the data); passed on unchanged"
                );
                assert!(line.contains(&wanted), "{name}: {line:?} lacks {wanted:?}");
            }
        }
    }
    for (session, calls) in [("utf8-chat", 1), ("utf8-ollama", 2)] {
        assert!(
            log.lines()
                .any(|l| l.contains(&format!("session={session} "))
                    && l.contains(&format!("tool_calls={calls} "))),
            "{log}"
        );
    }
}

// ===========================================================================
// 3. Long tool calls

/// A tool call in 10,000 deltas of one to three pieces each (escapes,
/// two- to four-byte UTF-8, surrogate pairs and lone surrogate escapes;
/// 2.2 MB of SSE), sent in pieces of 1 to 4,000 bytes: the client gets
/// every byte (injections cut out, the upstream's bytes exactly), 10,001
/// progresses each with the count recomputed here, and the last one is
/// the UTF-16 length of the whole arguments.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_10000_delta_tool_call_counts_right_to_the_end() {
    let mut rng = Lcg(10_000);
    let fragments: Vec<String> = (0..10_000).map(|_| fragment(&mut rng)).collect();
    let (input, expected) = one_call_stream(&fragments);
    let total = js_len(&fragments.concat());
    assert_eq!(expected.last().map(|p| p.2), Some(total));

    let sent = Arc::new(input.clone());
    let upstream =
        FakeUpstream::start(move |_| Reply::stream("text/event-stream", pieces(&sent, 4000, 1)))
            .await;
    let proxy = Served::start(proxy_config(&upstream.url(""))).await;
    let response = send(&client(), post(&proxy.url("/v1/chat/completions"), "long")).await;
    let (got, end) = read_body(&mut response.into_body(), PATIENCE * 3).await;
    end.expect("a clean end");
    assert!(strip_injected(&got) == input, "bytes lost or changed");
    let seen = progress_of(&got);
    assert_eq!(seen.len(), 10_001);
    for (k, (got, want)) in seen.iter().zip(&expected).enumerate() {
        assert_eq!(got, want, "progress {k}");
    }
    assert_eq!(seen.last().map(|p| p.2), Some(total));
    eprintln!(
        "10,000 deltas: {} bytes in, {} out, {total} UTF-16 units",
        input.len(),
        got.len()
    );
    assert_eq!(proxy.metric("aalis_tool_calls_total"), 1.0);
    assert_eq!(proxy.metric("aalis_stream_frames_total"), 10_004.0);
    assert_no_foreign_panic();
}

/// Long tool arguments keep O(1) work per delta — shown by what the
/// tracker holds, since a test cannot time: with the proxy's output (SSE)
/// the tracker keeps a count per call and no arguments text, so there is
/// nothing accumulated that a delta could re-scan; a delta costs what its
/// own fragment costs (parse, unescape, UTF-16 count). Only `--format
/// ndjson` keeps the text, for its final `toolCalls`, and appends to it.
///
/// Through the proxy, a 5 MiB call (1,024 deltas of about 4 KiB and one
/// of 1 MiB) reaches the client byte for byte with the right counts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn long_arguments_are_counted_not_kept() {
    let mut rng = Lcg(4096);
    let mut fragments: Vec<String> = (0..1024)
        .map(|_| {
            let mut f = String::new();
            while f.len() < 4096 {
                f.push_str(PIECES[rng.next(PIECES.len())]);
            }
            f
        })
        .collect();
    fragments.push("x".repeat(1024 * 1024));
    let (input, expected) = one_call_stream(&fragments);
    let total = js_len(&fragments.concat());
    assert!(input.len() > 5 * 1024 * 1024);

    // The proxy's pipeline: a count, no text.
    let mut annotator = Annotator::new(AnnotatorConfig {
        collect_events: true,
        ..sse_config()
    });
    let mut out = Vec::new();
    for piece in pieces(&input, 64 * 1024, 3) {
        annotator.push(piece, NOW_MS, &mut out);
    }
    let calls: Vec<_> = annotator
        .tracker()
        .calls()
        .flat_map(|(_, calls)| calls.iter())
        .collect();
    assert_eq!(calls.len(), 1);
    assert_eq!(calls[0].chars_accumulated as u64, total);
    assert!(
        calls[0].arguments.is_empty(),
        "the SSE pipeline keeps {} bytes of arguments",
        calls[0].arguments.len()
    );
    // `--format ndjson` keeps the text (appended, for `toolCalls`).
    let mut annotator = Annotator::new(AnnotatorConfig {
        output: OutputFormat::Ndjson,
        ..sse_config()
    });
    annotator.push(&input, NOW_MS, &mut Vec::new());
    let kept = annotator
        .tracker()
        .calls()
        .flat_map(|(_, calls)| calls.iter())
        .map(|c| c.arguments.encode_utf16().count() as u64)
        .sum::<u64>();
    assert_eq!(kept, total);

    let sent = Arc::new(input.clone());
    let upstream = FakeUpstream::start(move |_| {
        Reply::stream("text/event-stream", pieces(&sent, 64 * 1024, 5))
    })
    .await;
    let proxy = Served::start(proxy_config(&upstream.url(""))).await;
    let response = send(&client(), post(&proxy.url("/v1/chat/completions"), "big")).await;
    let (got, end) = read_body(&mut response.into_body(), PATIENCE * 3).await;
    end.expect("a clean end");
    assert!(strip_injected(&got) == input, "bytes lost or changed");
    assert_eq!(progress_of(&got), expected);
    eprintln!(
        "5 MiB call: {} bytes in, {} deltas, {total} UTF-16 units",
        input.len(),
        fragments.len()
    );
    assert_no_foreign_panic();
}

/// 100 tool calls in one message, indexes 0..99 announced in shuffled
/// order and then interleaved over 20 rounds, one to four entries per
/// chunk (an index may appear twice in one chunk): every entry gets its
/// own progress with its own index, name and count (the 2,120
/// progresses equal the list recomputed here, in order; a chunk with
/// several carries `toolCallsProgress` with all of them); mid-stream,
/// `GET /_aalis/sessions/{id}` lists the 100 calls sorted by index with
/// their counts; at the end the session is gone and the metrics count 100
/// calls.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hundred_parallel_tool_calls_each_get_their_own_progress() {
    const CALLS: usize = 100;
    let mut rng = Lcg(100);
    let names: Vec<String> = (0..CALLS).map(|i| format!("tool_{i:02}")).collect();
    let mut chars = [0u64; CALLS];
    let mut expected = Vec::new();
    let mut body = role_event();
    let mut entries_total = 0;
    // Announce in a shuffled order, then 20 interleaved rounds.
    let mut order: Vec<usize> = (0..CALLS).collect();
    for k in (1..CALLS).rev() {
        order.swap(k, rng.next(k + 1));
    }
    let mut deltas: Vec<(usize, bool)> = order.iter().map(|&i| (i, true)).collect();
    for _ in 0..20 {
        for k in (1..CALLS).rev() {
            order.swap(k, rng.next(k + 1));
        }
        deltas.extend(order.iter().map(|&i| (i, false)));
        // Now and then the same index twice in a row.
        let again = order[rng.next(CALLS)];
        deltas.push((again, false));
    }
    let mut rest = &deltas[..];
    while !rest.is_empty() {
        let n = (1 + rng.next(4)).min(rest.len());
        let (now, later) = rest.split_at(n);
        rest = later;
        let mut entries = Vec::new();
        for &(i, first) in now {
            let id = format!("call_{i}");
            let (args, start) = if first {
                (String::new(), Some((id.as_str(), names[i].as_str())))
            } else {
                (fragment(&mut rng), None)
            };
            chars[i] += js_len(&args);
            entries.push(tool_entry(i, start, &args));
            expected.push((i as i64, names[i].clone(), chars[i]));
            entries_total += 1;
        }
        body.push_str(&tool_event(&entries));
    }
    let head = body.clone().into_bytes();
    let tail = format!("{}{DONE}", finish_event()).into_bytes();
    let input = [head.clone(), tail.clone()].concat();

    let gate = Arc::new(Notify::new());
    let upstream_gate = gate.clone();
    let upstream = FakeUpstream::start(move |_| {
        Reply::stream("text/event-stream", pieces(&head, 3000, 9))
            .then(Step::Wait(upstream_gate.clone()))
            .body(tail.clone())
    })
    .await;
    let proxy = Served::start(proxy_config(&upstream.url(""))).await;
    let client = client();
    let response = send(&client, post(&proxy.url("/v1/chat/completions"), "hundred")).await;
    let mut body = response.into_body();
    let mut got = Vec::new();
    let held = annotate_open(&input[..input.len() - finish_event().len() - DONE.len()]);
    read_at_least(&mut body, &mut got, held.len(), PATIENCE).await;

    let snapshot = send(
        &client,
        Request::get(proxy.url("/_aalis/sessions/hundred"))
            .body(Full::default())
            .expect("request"),
    )
    .await;
    let (snapshot, _) = read_body(&mut snapshot.into_body(), PATIENCE).await;
    let snapshot: Value = serde_json::from_slice(&snapshot).expect("JSON");
    let listed: Vec<Seen> = snapshot["toolCallsProgress"]
        .as_array()
        .expect("a list")
        .iter()
        .map(|p| {
            (
                p["index"].as_i64().expect("index"),
                p["name"].as_str().expect("name").to_owned(),
                p["charsAccumulated"].as_u64().expect("chars"),
            )
        })
        .collect();
    let want: Vec<Seen> = (0..CALLS)
        .map(|i| (i as i64, names[i].clone(), chars[i]))
        .collect();
    assert_eq!(listed, want, "the resume snapshot mid-stream");

    gate.notify_one();
    let (rest, end) = read_body(&mut body, PATIENCE).await;
    end.expect("a clean end");
    got.extend_from_slice(&rest);
    assert!(strip_injected(&got) == input, "bytes lost or changed");
    let seen = progress_of(&got);
    assert_eq!(seen.len(), entries_total);
    assert_eq!(seen, expected);
    let mut last: BTreeMap<i64, u64> = BTreeMap::new();
    for (index, _, chars) in &seen {
        last.insert(*index, *chars);
    }
    assert_eq!(last.len(), CALLS);
    for (i, c) in &last {
        assert_eq!(*c, chars[*i as usize], "final count of index {i}");
    }
    let sessions = proxy.sessions().clone();
    assert!(eventually(PATIENCE, || sessions.is_empty()).await);
    assert_eq!(proxy.metric("aalis_tool_calls_total"), CALLS as f64);
    eprintln!(
        "100 parallel calls: {entries_total} entries in {} bytes",
        input.len()
    );
    assert_no_foreign_panic();
}

/// Frames that arrive together go out together: the upstream flushes a
/// role chunk and ten tool-call deltas as eleven chunks in one write, and
/// the proxy, which takes them as eleven frames from one read, passes
/// them on in one write. The latency a write adds is observed once a
/// write (from its first frame), not once a frame; the bytes are the
/// annotated input, whole.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn frames_read_together_go_out_in_one_write_with_one_latency() {
    let mut rng = Lcg(11);
    let mut frames = vec![role_event()];
    frames.push(tool_event(&[tool_entry(
        0,
        Some(("call_0", "write_file")),
        "",
    )]));
    for _ in 0..9 {
        frames.push(tool_event(&[tool_entry(0, None, &fragment(&mut rng))]));
    }
    let head = frames.concat().into_bytes();
    let tail = format!("{}{DONE}", finish_event()).into_bytes();
    let input = [head.clone(), tail.clone()].concat();

    let gate = Arc::new(Notify::new());
    let upstream_gate = gate.clone();
    let upstream = FakeUpstream::start(move |_| {
        // No `Yield` between the frames: the upstream's connection
        // buffers them and writes them at once, when the body waits.
        let mut reply = Reply::new(200).header("content-type", "text/event-stream");
        for frame in &frames {
            reply = reply.body(frame.clone());
        }
        reply
            .then(Step::Wait(upstream_gate.clone()))
            .body(tail.clone())
    })
    .await;
    let proxy = Served::start(proxy_config(&upstream.url(""))).await;
    let client = client();
    let response = send(
        &client,
        post(&proxy.url("/v1/chat/completions"), "together"),
    )
    .await;
    let mut body = response.into_body();
    let mut got = Vec::new();
    let first = annotate_open(&head);
    read_at_least(&mut body, &mut got, first.len(), PATIENCE).await;
    assert!(got == first, "the first eleven frames, annotated");
    let writes = proxy.metric("aalis_added_latency_seconds_count");
    assert!(
        (1.0..=2.0).contains(&writes),
        "{writes} latencies observed for eleven frames read at once"
    );

    gate.notify_one();
    let (rest, end) = read_body(&mut body, PATIENCE).await;
    end.expect("a clean end");
    got.extend_from_slice(&rest);
    assert!(strip_injected(&got) == input, "bytes lost or changed");
    assert!(proxy.metric("aalis_added_latency_seconds_count") <= writes + 2.0);
    assert_no_foreign_panic();
}

// ===========================================================================
// 4. A client that goes away

/// When the client leaves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Leave {
    /// In the middle of its request head.
    DuringHead,
    /// Head sent, 100 of 1,000 body bytes.
    DuringBody,
    /// Request sent; the upstream has it and has not answered.
    AwaitingUpstream,
    /// The upstream sent part of its response head.
    UpstreamHeadPending,
    /// Four whole events came through; the upstream is silent.
    MidBody,
    /// The upstream sent four events and half of the fifth.
    MidEvent,
    /// The whole stream, `[DONE]` included, came through; the upstream
    /// has not ended its body.
    AfterLastByte,
}

const LEAVES: [Leave; 7] = [
    Leave::DuringHead,
    Leave::DuringBody,
    Leave::AwaitingUpstream,
    Leave::UpstreamHeadPending,
    Leave::MidBody,
    Leave::MidEvent,
    Leave::AfterLastByte,
];

impl Leave {
    fn path(self) -> String {
        format!("/leave/{self:?}")
    }

    /// What the upstream sends before it goes silent.
    fn upstream_steps(self, input: &[u8]) -> Vec<RawStep> {
        let spans = event_spans(input);
        let events = |n: usize| RawStep::Write(chunk(&input[..spans[n - 1].end]));
        let head = RawStep::Write(chunked_head("text/event-stream"));
        match self {
            Leave::DuringHead | Leave::DuringBody | Leave::AwaitingUpstream => vec![],
            Leave::UpstreamHeadPending => vec![RawStep::Write(Bytes::from_static(
                b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n",
            ))],
            Leave::MidBody => vec![head, events(4)],
            Leave::MidEvent => vec![
                head,
                RawStep::Write(chunk(&input[..spans[4].start + spans[4].len() / 2])),
            ],
            Leave::AfterLastByte => vec![head, events(spans.len())],
        }
    }

    /// What the client has received when it leaves.
    fn received(self, input: &[u8]) -> Option<Vec<u8>> {
        let spans = event_spans(input);
        match self {
            Leave::DuringHead
            | Leave::DuringBody
            | Leave::AwaitingUpstream
            | Leave::UpstreamHeadPending => None,
            Leave::MidBody | Leave::MidEvent => Some(annotate_open(&input[..spans[3].end])),
            Leave::AfterLastByte => Some(annotate_open(input)),
        }
    }

    fn reaches_upstream(self) -> bool {
        self != Leave::DuringHead
    }
}

/// The upstream of the leave tests: each `Leave`'s path gets that phase's
/// script, any other path the whole `input` as one chunked stream.
async fn upstream_for_leaves(input: Vec<u8>) -> RawUpstream {
    RawUpstream::start(move |head| {
        let text = String::from_utf8_lossy(head);
        let path = text
            .split_whitespace()
            .nth(1)
            .unwrap_or_default()
            .to_owned();
        match LEAVES.iter().find(|l| l.path() == path) {
            Some(leave) => leave.upstream_steps(&input),
            None => vec![
                RawStep::Write(chunked_head("text/event-stream")),
                RawStep::Write(chunk(&input)),
                RawStep::Write(Bytes::from_static(b"0\r\n\r\n")),
            ],
        }
    })
    .await
}

/// After a client left at `leave`: no session kept, no stream counted open.
async fn assert_released(proxy: &Served, leave: Leave) {
    let sessions = proxy.sessions().clone();
    assert!(
        eventually(PATIENCE, || sessions.is_empty()).await,
        "{leave:?}: {} sessions kept",
        sessions.len()
    );
    assert!(
        eventually(PATIENCE, || proxy.metric("aalis_streams_open") == 0.0).await,
        "{leave:?}: a stream is still counted open"
    );
}

/// The whole stream that follows a departure arrives as `annotate` makes
/// it, from an upstream connection of its own that then closes.
async fn assert_whole_stream(
    response: Response<Incoming>,
    input: &[u8],
    upstream: &mut RawUpstream,
    leave: Leave,
) {
    let (got, end) = read_body(&mut response.into_body(), PATIENCE).await;
    end.expect("a clean end");
    assert!(got == annotate(input), "{leave:?}: the next stream differs");
    assert!(matches!(
        upstream.next(PATIENCE).await,
        Some(RawEvent::Head { .. })
    ));
    assert!(matches!(
        upstream.next(PATIENCE).await,
        Some(RawEvent::Closed { .. })
    ));
}

/// No client departure counted as an upstream error of any kind.
fn assert_no_upstream_error(proxy: &Served) {
    for kind in ["unreachable", "timeout", "error", "idle_timeout", "reset"] {
        assert_eq!(
            proxy.metric(&format!("aalis_upstream_errors_total{{kind=\"{kind}\"}}")),
            0.0,
            "a client leaving counted as an upstream {kind}"
        );
    }
}

/// A client that goes away at each phase of a request — in the middle of
/// its request head; with 100 of its 1,000 body bytes sent; with the
/// request at the upstream, unanswered; with half a response head from the
/// upstream; mid-body; mid-event; after the last byte (`[DONE]`) but
/// before the end of the body — over a raw TCP connection it just closes:
///
/// - nothing panics;
/// - the proxy closes its upstream connection (the upstream sees it close;
///   none is made when the head never completed);
/// - the session is released (the registry is empty) and
///   `aalis_streams_open` is back to 0; a live subscriber of the session
///   left mid-event hears a `stream_end` clear;
/// - the same proxy then serves a whole stream, byte for byte;
/// - no client departure counts as an upstream error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_leaves_at_any_phase_releases_everything() {
    let input = fixture(SINGLE_CALL);
    let mut upstream = upstream_for_leaves(input.clone()).await;
    let proxy = Served::start(proxy_config(&upstream.url())).await;
    let client = client();
    let mut upstream_connections = 0;
    for leave in LEAVES {
        let session = format!("gone-{leave:?}");
        // A live subscriber, for the mid-event case.
        let mut subscriber = if leave == Leave::MidEvent {
            let response = send(
                &client,
                Request::get(proxy.url(&format!("/_aalis/sessions/{session}/events")))
                    .body(Full::default())
                    .expect("request"),
            )
            .await;
            let mut body = response.into_body();
            let first = next_sse_data(&mut body).await;
            assert_eq!(first["type"], "stream_resume");
            Some(body)
        } else {
            None
        };

        let mut stream = TcpStream::connect(proxy.addr).await.expect("connect");
        let head = format!(
            "POST {} HTTP/1.1\r\nhost: {}\r\nx-aalis-session: {session}\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n",
            leave.path(),
            proxy.addr,
            if leave == Leave::DuringBody { 1000 } else { 15 },
        );
        match leave {
            Leave::DuringHead => {
                stream
                    .write_all(&head.as_bytes()[..40])
                    .await
                    .expect("write");
            }
            Leave::DuringBody => {
                stream.write_all(head.as_bytes()).await.expect("write");
                stream.write_all(&[b' '; 100]).await.expect("write");
            }
            _ => {
                stream.write_all(head.as_bytes()).await.expect("write");
                stream.write_all(b"{\"stream\":true}").await.expect("write");
            }
        }
        if leave.reaches_upstream() {
            match upstream.next(PATIENCE).await {
                Some(RawEvent::Head { n, .. }) => assert_eq!(n, upstream_connections),
                other => panic!("{leave:?}: the upstream saw {other:?}"),
            }
        }
        if let Some(wanted) = leave.received(&input) {
            let mut raw = Vec::new();
            let mut buf = [0u8; 16 * 1024];
            let got = tokio::time::timeout(PATIENCE, async {
                loop {
                    if let Some(end) = find(&raw, b"\r\n\r\n")
                        && dechunk(&raw[end + 4..]).0.len() >= wanted.len()
                    {
                        return dechunk(&raw[end + 4..]).0;
                    }
                    let k = stream.read(&mut buf).await.expect("read");
                    assert!(k > 0, "{leave:?}: the proxy closed first");
                    raw.extend_from_slice(&buf[..k]);
                }
            })
            .await
            .unwrap_or_else(|_| panic!("{leave:?}: not all bytes in time"));
            assert_eq!(got, wanted, "{leave:?}");
            if leave == Leave::MidEvent {
                // The session shows the call as of the whole events.
                assert_eq!(
                    proxy
                        .sessions()
                        .snapshot(&session)
                        .iter()
                        .map(|p| p.chars_accumulated)
                        .collect::<Vec<_>>(),
                    [10]
                );
            }
        } else if leave == Leave::UpstreamHeadPending {
            // Let the half head reach the proxy (no assertion rests on it).
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let left = Instant::now();
        drop(stream);

        if leave.reaches_upstream() {
            assert_eq!(
                upstream.next(PATIENCE).await,
                Some(RawEvent::Closed {
                    n: upstream_connections
                }),
                "{leave:?}: the upstream connection was kept"
            );
            eprintln!(
                "HTTP/1.1 {leave:?}: upstream connection closed {:?} after the client left",
                left.elapsed()
            );
            upstream_connections += 1;
        } else {
            assert_eq!(
                upstream.next(Duration::from_millis(300)).await,
                None,
                "{leave:?}: an incomplete head reached the upstream"
            );
        }
        if let Some(body) = subscriber.as_mut() {
            // The progress of the four events, then the clear.
            let mut clear = next_sse_data(body).await;
            let mut counts = Vec::new();
            while clear.get("toolCallProgress").is_some() {
                counts.push(clear["toolCallProgress"]["charsAccumulated"].clone());
                clear = next_sse_data(body).await;
            }
            assert_eq!(counts, [0, 2, 10], "{leave:?}");
            assert_eq!(clear["type"], "tool_call_progress_clear", "{clear}");
            assert_eq!(clear["reason"], "stream_end", "{clear}");
            assert_eq!(clear["sessionId"], session.as_str());
        }
        drop(subscriber);
        assert_released(&proxy, leave).await;
        // The proxy still serves a whole stream.
        let response = send(&client, post(&proxy.url("/whole"), "after")).await;
        assert_whole_stream(response, &input, &mut upstream, leave).await;
        upstream_connections += 1;
    }
    // 3 streams left early, 7 whole ones.
    assert_eq!(proxy.metric("aalis_streams_total"), 10.0);
    assert_no_upstream_error(&proxy);
    assert_no_foreign_panic();
}

type BoxError = Box<dyn std::error::Error + Send + Sync>;
type H2Body = http_body_util::combinators::BoxBody<Bytes, BoxError>;

/// The same over HTTP/2, where a client that goes away resets its stream
/// and keeps its connection: at each phase from the request body on (100
/// of 1,000 body bytes sent; request at the upstream; half a response head
/// from the upstream; mid-body; mid-event; after `[DONE]`), the client
/// drops its response (future or body). Each time the proxy closes its
/// upstream connection, the session is released, `aalis_streams_open` is
/// back to 0, nothing panics, no upstream error is counted, and the same
/// HTTP/2 connection then carries a whole stream, byte for byte.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_http2_client_that_resets_at_any_phase_releases_everything() {
    let input = fixture(SINGLE_CALL);
    let mut upstream = upstream_for_leaves(input.clone()).await;
    let proxy = Served::start(proxy_config(&upstream.url())).await;
    let tcp = TcpStream::connect(proxy.addr).await.expect("connect");
    // Without it a reset frame can wait for a delayed ACK (Nagle).
    tcp.set_nodelay(true).expect("TCP_NODELAY");
    let (mut sender, conn) = hyper::client::conn::http2::handshake::<_, _, H2Body>(
        TokioExecutor::new(),
        TokioIo::new(tcp),
    )
    .await
    .expect("HTTP/2 handshake");
    let conn = tokio::spawn(conn);
    let request = |path: &str, session: &str, body: H2Body, length: usize| {
        Request::post(format!("http://{}{path}", proxy.addr))
            .header("x-aalis-session", session)
            .header("content-type", "application/json")
            .header("content-length", length.to_string())
            .body(body)
            .expect("request")
    };
    let full = |bytes: &'static [u8]| -> H2Body {
        Full::new(Bytes::from_static(bytes))
            .map_err(|never| match never {})
            .boxed()
    };
    let mut upstream_connections = 0;
    for leave in LEAVES {
        if leave == Leave::DuringHead {
            continue;
        }
        let session = format!("h2-{leave:?}");
        // A request body that sends 100 bytes of its announced 1,000, or
        // the whole small one.
        let (body_tx, body) = if leave == Leave::DuringBody {
            let (tx, rx) = mpsc::channel::<Bytes>(1);
            tx.send(Bytes::from_static(&[b' '; 100]))
                .await
                .expect("queue the first bytes");
            let body = ChannelBody(rx).boxed();
            (Some(tx), (body, 1000))
        } else {
            (None, (full(b"{\"stream\":true}"), 15))
        };
        let pending =
            Box::pin(sender.send_request(request(&leave.path(), &session, body.0, body.1)));
        let left = match leave.received(&input) {
            None => {
                match upstream.next(PATIENCE).await {
                    Some(RawEvent::Head { n, .. }) => assert_eq!(n, upstream_connections),
                    other => panic!("{leave:?}: the upstream saw {other:?}"),
                }
                if leave == Leave::UpstreamHeadPending {
                    // Let the half head reach the proxy (no assertion rests on it).
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                drop(pending);
                Instant::now()
            }
            Some(wanted) => {
                let response = tokio::time::timeout(PATIENCE, pending)
                    .await
                    .expect("response in time")
                    .expect("response");
                assert!(matches!(
                    upstream.next(PATIENCE).await,
                    Some(RawEvent::Head { .. })
                ));
                let mut body = response.into_body();
                let mut got = Vec::new();
                read_at_least(&mut body, &mut got, wanted.len(), PATIENCE).await;
                assert_eq!(got, wanted, "{leave:?}");
                drop(body);
                Instant::now()
            }
        };
        drop(body_tx);
        assert_eq!(
            upstream.next(PATIENCE).await,
            Some(RawEvent::Closed {
                n: upstream_connections
            }),
            "{leave:?}: the upstream connection was kept"
        );
        eprintln!(
            "HTTP/2 {leave:?}: upstream connection closed {:?} after the client reset",
            left.elapsed()
        );
        upstream_connections += 1;
        assert_released(&proxy, leave).await;
        // The same connection carries a whole stream.
        let response = tokio::time::timeout(
            PATIENCE,
            sender.send_request(request("/whole", "after", full(b"{\"stream\":true}"), 15)),
        )
        .await
        .expect("response in time")
        .unwrap_or_else(|e| panic!("{leave:?}: the connection is broken: {e}"));
        assert_whole_stream(response, &input, &mut upstream, leave).await;
        upstream_connections += 1;
    }
    assert_no_upstream_error(&proxy);
    conn.abort();
    assert_no_foreign_panic();
}

/// A request body fed by a channel: it pends while the sender lives and
/// sends nothing, and ends when the sender is dropped.
struct ChannelBody(mpsc::Receiver<Bytes>);

impl Body for ChannelBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<http_body::Frame<Bytes>, BoxError>>> {
        self.0
            .poll_recv(cx)
            .map(|bytes| bytes.map(|b| Ok(http_body::Frame::data(b))))
    }
}

/// The next `data:` JSON of an SSE body (skipping comments).
async fn next_sse_data(body: &mut Incoming) -> Value {
    let mut buf = Vec::new();
    tokio::time::timeout(PATIENCE, async {
        loop {
            if let Some(end) = find(&buf, b"\n\n") {
                let event: Vec<u8> = buf.drain(..end + 2).collect();
                if let Some(data) = event.strip_prefix(b"data: ") {
                    return serde_json::from_slice(&data[..data.len() - 2]).expect("JSON frame");
                }
                continue;
            }
            match body.frame().await {
                Some(Ok(frame)) => {
                    if let Ok(data) = frame.into_data() {
                        buf.extend_from_slice(&data);
                    }
                }
                other => panic!("the events stream ended: {other:?}"),
            }
        }
    })
    .await
    .expect("a frame in time")
}

// ===========================================================================
// 5. SIGTERM with 100 open streams (the real binary)

/// Signals, without a libc dependency.
mod sig {
    use std::ffi::c_int;

    unsafe extern "C" {
        fn signal(signum: c_int, handler: usize) -> usize;
        fn kill(pid: c_int, sig: c_int) -> c_int;
    }

    pub const SIGINT: c_int = 2;
    pub const SIGTERM: c_int = 15;

    /// In a child between fork and exec: the default disposition (a shell
    /// without job control starts background jobs with SIGINT ignored).
    pub fn reset_to_default() {
        // SAFETY: signal() is async-signal-safe and touches no Rust state.
        unsafe {
            signal(SIGINT, 0);
            signal(SIGTERM, 0);
        }
    }

    pub fn send(pid: u32, signum: c_int) {
        let pid = c_int::try_from(pid).expect("pid fits");
        // SAFETY: kill() has no memory-safety preconditions.
        let rc = unsafe { kill(pid, signum) };
        assert_eq!(rc, 0, "kill: {}", std::io::Error::last_os_error());
    }
}

/// `aalis-proxy serve` as a child process on a port the OS picks; killed
/// when dropped (its stderr shown if the test is failing).
struct ServeProcess {
    child: std::process::Child,
    addr: SocketAddr,
    stderr: Arc<Mutex<Vec<u8>>>,
    reader: Option<std::thread::JoinHandle<()>>,
}

impl ServeProcess {
    async fn start(upstream: &str, extra: &[&str]) -> ServeProcess {
        let mut cmd = common::base_command();
        cmd.args(["serve", "--upstream", upstream, "--listen", "127.0.0.1:0"])
            .args(extra)
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::piped());
        // SAFETY: the closure only calls signal(), which is async-signal-safe.
        unsafe {
            cmd.pre_exec(|| {
                sig::reset_to_default();
                Ok(())
            });
        }
        let mut child = cmd.spawn().expect("spawn aalis-proxy serve");
        let stderr = Arc::new(Mutex::new(Vec::new()));
        let mut pipe = child.stderr.take().expect("piped stderr");
        let sink = stderr.clone();
        let reader = std::thread::spawn(move || {
            use std::io::Read;
            let mut buf = [0u8; 4096];
            while let Ok(n) = pipe.read(&mut buf) {
                if n == 0 {
                    break;
                }
                sink.lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .extend_from_slice(&buf[..n]);
            }
        });
        let mut serve = ServeProcess {
            child,
            addr: "127.0.0.1:0".parse().expect("addr"),
            stderr,
            reader: Some(reader),
        };
        let deadline = Instant::now() + PATIENCE;
        loop {
            let log = serve.stderr();
            if let Some((_, rest)) = log.split_once("listening on http://")
                && let Some(addr) = rest.split(',').next().and_then(|a| a.trim().parse().ok())
            {
                serve.addr = addr;
                return serve;
            }
            assert!(
                serve.child.try_wait().expect("try_wait").is_none(),
                "serve exited:\n{log}"
            );
            assert!(Instant::now() < deadline, "serve did not start:\n{log}");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }

    fn stderr(&self) -> String {
        String::from_utf8_lossy(&self.stderr.lock().unwrap_or_else(|e| e.into_inner())).into_owned()
    }

    fn signal(&self, signum: std::ffi::c_int) {
        sig::send(self.child.id(), signum);
    }

    /// Waits for the exit (at most `limit`, else kills it and fails);
    /// returns the status and the whole stderr.
    async fn wait_exit(&mut self, limit: Duration) -> (std::process::ExitStatus, String) {
        let deadline = Instant::now() + limit;
        loop {
            if let Some(status) = self.child.try_wait().expect("try_wait") {
                if let Some(reader) = self.reader.take() {
                    let _ = reader.join();
                }
                return (status, self.stderr());
            }
            if Instant::now() > deadline {
                let _ = self.child.kill();
                panic!(
                    "serve still running {limit:?} after the signal:\n{}",
                    self.stderr()
                );
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    /// SIGTERM, exit 0; the whole stderr.
    async fn stop(&mut self) -> String {
        self.signal(sig::SIGTERM);
        let (status, log) = self.wait_exit(PATIENCE).await;
        assert_eq!(status.code(), Some(0), "{log}");
        log
    }
}

impl Drop for ServeProcess {
    fn drop(&mut self) {
        if self.child.try_wait().ok().flatten().is_none() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
        if std::thread::panicking() {
            eprintln!("--- serve's stderr:\n{}", self.stderr());
        }
    }
}

/// 100 streams open through `serve`, each on its own connection, each
/// having received its first four events while its upstream holds the
/// rest. Returns their bodies (and the connection tasks).
async fn open_streams(
    serve: &ServeProcess,
    count: usize,
    held: &[u8],
) -> Vec<(Incoming, Vec<u8>, JoinHandle<()>)> {
    let mut opening = Vec::new();
    for i in 0..count {
        let addr = serve.addr;
        opening.push(tokio::spawn(async move {
            let stream = TcpStream::connect(addr).await.expect("connect");
            let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
                .await
                .expect("handshake");
            let conn = tokio::spawn(async move {
                let _ = conn.await;
            });
            let req = Request::post("/v1/chat/completions")
                .header("host", addr.to_string())
                .header("x-aalis-session", format!("term-{i}"))
                .body(Full::new(Bytes::from_static(b"{\"stream\":true}")))
                .expect("request");
            let response = tokio::time::timeout(PATIENCE, sender.send_request(req))
                .await
                .expect("response in time")
                .expect("response");
            assert_eq!(response.status(), StatusCode::OK);
            (response.into_body(), conn)
        }));
    }
    let mut open = Vec::new();
    for task in opening {
        let (mut body, conn) = task.await.expect("open a stream");
        let mut got = Vec::new();
        read_at_least(&mut body, &mut got, held.len(), PATIENCE).await;
        assert_eq!(got, held);
        open.push((body, got, conn));
    }
    open
}

/// An upstream whose every stream sends the first four events of
/// `single_tool_call.sse`, then waits for its own gate (one per request,
/// in arrival order), then `rest` (the rest of the stream), or, without
/// it, hangs.
async fn gated_upstream(rest: Option<Vec<u8>>) -> (FakeUpstream, Arc<Mutex<Vec<Arc<Notify>>>>) {
    let input = fixture(SINGLE_CALL);
    let spans = event_spans(&input);
    let first = input[..spans[3].end].to_vec();
    let gates: Arc<Mutex<Vec<Arc<Notify>>>> = Arc::default();
    let upstream_gates = gates.clone();
    let upstream = FakeUpstream::start(move |_| {
        let gate = Arc::new(Notify::new());
        upstream_gates
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(gate.clone());
        let reply = Reply::stream("text/event-stream", [&first[..]]).then(Step::Wait(gate));
        match &rest {
            Some(rest) => reply.body(rest.clone()),
            None => reply.then(Step::Hang),
        }
    })
    .await;
    (upstream, gates)
}

/// SIGTERM with 100 streams open through the real `serve` binary
/// (`--shutdown-grace 20s`), each held by its upstream after four events:
/// new connections are refused; once the upstreams go on, all 100 streams
/// finish, each byte for byte the pipeline's output of the capture with a
/// clean end; serve then exits 0 without waiting out the grace period
/// (liveness bound only: within the grace + 10 s).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_with_100_open_streams_lets_all_finish_then_exits_0() {
    const STREAMS: usize = 100;
    let input = fixture(SINGLE_CALL);
    let spans = event_spans(&input);
    let (mut upstream, gates) = gated_upstream(Some(input[spans[3].end..].to_vec())).await;
    let mut serve = ServeProcess::start(&upstream.url(""), &["--shutdown-grace", "20s"]).await;
    let held = annotate_open(&input[..spans[3].end]);
    let open = open_streams(&serve, STREAMS, &held).await;
    assert_eq!(upstream.requests().len(), STREAMS);

    let signalled = Instant::now();
    serve.signal(sig::SIGTERM);
    let addr = serve.addr;
    let refused = eventually(PATIENCE, || {
        std::net::TcpStream::connect_timeout(&addr, Duration::from_millis(200))
            .is_err_and(|e| e.kind() == std::io::ErrorKind::ConnectionRefused)
    })
    .await;
    assert!(refused, "new connections still accepted after SIGTERM");

    for gate in gates.lock().unwrap_or_else(|e| e.into_inner()).iter() {
        gate.notify_one();
    }
    let expected = annotate(&input);
    let mut finished = 0;
    for (mut body, mut got, conn) in open {
        let (rest, end) = read_body(&mut body, PATIENCE).await;
        got.extend_from_slice(&rest);
        end.expect("each stream ends cleanly");
        assert!(got == expected, "a stream differs");
        finished += 1;
        conn.abort();
    }
    assert_eq!(finished, STREAMS);
    let (status, log) = serve.wait_exit(Duration::from_secs(30)).await;
    let took = signalled.elapsed();
    assert_eq!(status.code(), Some(0), "{log}");
    assert!(!log.contains("panicked"), "{log}");
    assert!(log.contains("all connections closed"), "{log}");
    let mut finished_upstream = 0;
    while let Some(event) = upstream
        .wait_for(PATIENCE, |e| matches!(e, Event::BodyDropped { .. }))
        .await
    {
        assert!(
            matches!(event, Event::BodyDropped { finished: true, .. }),
            "an upstream body was cut: {event:?}"
        );
        finished_upstream += 1;
        if finished_upstream == STREAMS {
            break;
        }
    }
    assert_eq!(finished_upstream, STREAMS);
    eprintln!("SIGTERM with {STREAMS} open streams: all finished, exit 0 after {took:?}");
}

/// SIGTERM with 100 streams open through `serve` (`--shutdown-grace
/// 500ms`) whose upstreams never go on: when the grace period is over
/// every stream is closed — each client holds exactly the four events it
/// had (no invented end, no `[DONE]`) and sees the body cut, not ended —
/// every upstream request is cancelled, and serve exits 0.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_with_100_stuck_streams_closes_them_after_the_grace_then_exits_0() {
    const STREAMS: usize = 100;
    let input = fixture(SINGLE_CALL);
    let spans = event_spans(&input);
    let (mut upstream, _gates) = gated_upstream(None).await;
    let mut serve = ServeProcess::start(&upstream.url(""), &["--shutdown-grace", "500ms"]).await;
    let held = annotate_open(&input[..spans[3].end]);
    let open = open_streams(&serve, STREAMS, &held).await;

    let signalled = Instant::now();
    serve.signal(sig::SIGTERM);
    let (status, log) = serve.wait_exit(Duration::from_secs(10)).await;
    let took = signalled.elapsed();
    assert_eq!(status.code(), Some(0), "{log}");
    assert!(!log.contains("panicked"), "{log}");
    assert!(log.contains("grace period over"), "{log}");
    let mut cut = 0;
    for (mut body, got, conn) in open {
        let (rest, end) = read_body(&mut body, PATIENCE).await;
        assert!(rest.is_empty(), "{} bytes after the grace", rest.len());
        assert_eq!(got, held);
        assert!(end.is_err(), "a stuck stream ended cleanly");
        cut += 1;
        conn.abort();
    }
    assert_eq!(cut, STREAMS);
    let mut cancelled = 0;
    while upstream
        .wait_for(PATIENCE, |e| {
            matches!(
                e,
                Event::BodyDropped {
                    finished: false,
                    ..
                }
            )
        })
        .await
        .is_some()
    {
        cancelled += 1;
        if cancelled == STREAMS {
            break;
        }
    }
    assert_eq!(cancelled, STREAMS, "upstream requests outlived serve");
    eprintln!("SIGTERM with {STREAMS} stuck streams: all cut, exit 0 after {took:?}");
}

// ===========================================================================
// 6. Injection: session ids, headers, recorded file names

/// Sends a raw request with `header_lines` (each without its CRLF) to the
/// proxy; returns the parsed response.
async fn raw_request(addr: SocketAddr, path: &str, header_lines: &[&[u8]]) -> RawResponse {
    let mut request = format!(
        "POST {path} HTTP/1.1\r\nhost: {addr}\r\nconnection: close\r\ncontent-type: application/json\r\ncontent-length: 2\r\n"
    )
    .into_bytes();
    for line in header_lines {
        request.extend_from_slice(line);
        request.extend_from_slice(b"\r\n");
    }
    request.extend_from_slice(b"\r\n{}");
    RawResponse::parse(&raw_exchange(addr, &request).await)
}

/// `X-Aalis-Session` values that try to split the response, sent raw:
///
/// | value | what happens |
/// | --- | --- |
/// | `a` CR `X-Injected: 1` (bare CR) | `400` from the HTTP parser |
/// | `a` CRLF SP `X-Injected: 1` (obs-fold) | `400` from the HTTP parser |
/// | `a` NUL `b` | `400` from the HTTP parser |
/// | 40 KiB of `x` | `400` `invalid_request_error` (over 128 bytes) |
/// | 512 KiB of `x` | `431` from the HTTP parser (a head over 64 KiB) |
/// | `café` (UTF-8 bytes) | `400` `invalid_request_error`, not echoed |
/// | 129 × `x` | `400` `invalid_request_error` |
/// | `a%0D%0AX-Injected:%201` | accepted and echoed verbatim (no decoding) |
/// | 128 × `x` | accepted and echoed |
/// | `a` LF `X-Injected: 1` (bare LF) | read as two header lines (RFC 9112 allows a bare LF line end): session `a`, echoed, and `X-Injected` goes upstream as a request header |
///
/// No response carries `X-Injected`, every response head is well formed
/// (no CR, LF or NUL inside a line), at most one `x-aalis-session`; only
/// the accepted ones reach the upstream.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn session_ids_cannot_split_responses() {
    let stream = fixture(SINGLE_CALL);
    let upstream =
        FakeUpstream::start(move |_| Reply::stream("text/event-stream", [&stream[..]])).await;
    let proxy = Served::start(proxy_config(&upstream.url(""))).await;
    let long_ok = "x".repeat(128);
    let long_bad = "x".repeat(129);
    let big = "x".repeat(40 * 1024);
    let huge = "x".repeat(512 * 1024);
    let session_line = |value: &[u8]| [&b"x-aalis-session: "[..], value].concat();
    let cases: Vec<(Vec<u8>, u16, Option<&str>)> = vec![
        (session_line(b"a\rX-Injected: 1"), 400, None),
        (session_line(b"a\r\n X-Injected: 1"), 400, None),
        (session_line(b"a\x00b"), 400, None),
        (session_line(big.as_bytes()), 400, None),
        (session_line(huge.as_bytes()), 431, None),
        (session_line("café".as_bytes()), 400, None),
        (session_line(long_bad.as_bytes()), 400, None),
        (
            session_line(b"a%0D%0AX-Injected:%201"),
            200,
            Some("a%0D%0AX-Injected:%201"),
        ),
        (session_line(long_ok.as_bytes()), 200, Some(&long_ok)),
        (session_line(b"a\nX-Injected: 1"), 200, Some("a")),
    ];
    let mut forwarded = 0;
    for (line, status, echoed) in &cases {
        let shown = String::from_utf8_lossy(&line[..line.len().min(60)]).into_owned();
        let response = raw_request(proxy.addr, "/v1/chat/completions", &[line]).await;
        response.assert_well_formed();
        assert_eq!(response.status, *status, "{shown:?}");
        assert!(response.headers("x-injected").is_empty(), "{shown:?}");
        assert_eq!(
            response.header("x-aalis-session").as_deref(),
            echoed.map(str::as_bytes),
            "{shown:?}"
        );
        if *status == 400 && response.header("content-type").as_deref() == Some(b"application/json")
        {
            let error: Value = serde_json::from_slice(&response.body).expect("JSON error");
            assert_eq!(error["error"]["type"], "invalid_request_error");
            assert!(
                !String::from_utf8_lossy(&response.body).contains("caf"),
                "the bad value is echoed in the error"
            );
        }
        if *status == 200 {
            assert!(response.complete, "{shown:?}");
            assert_eq!(response.body, annotate(&fixture(SINGLE_CALL)));
            forwarded += 1;
        }
    }
    let seen = upstream.requests();
    assert_eq!(seen.len(), forwarded, "a refused request reached upstream");
    // The bare LF made two header lines; the second went upstream as one.
    let last = seen.last().expect("a request");
    assert_eq!(
        last.headers.get("x-injected").map(|v| v.as_bytes()),
        Some(&b"1"[..])
    );
    assert!(!last.headers.contains_key("x-aalis-session"));
    assert_no_foreign_panic();
}

/// A request head of 100 header fields is served; one of 101, however
/// small, gets `431`, as README says (hyper's bound, which README did not
/// name).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_with_more_than_100_header_fields_gets_431() {
    let stream = fixture(SINGLE_CALL);
    let upstream =
        FakeUpstream::start(move |_| Reply::stream("text/event-stream", [&stream[..]])).await;
    let proxy = Served::start(proxy_config(&upstream.url(""))).await;
    // `raw_request` sends four fields of its own.
    for (extra, status) in [(96, 200), (97, 431)] {
        let lines: Vec<Vec<u8>> = (0..extra)
            .map(|i| format!("x-field-{i}: v").into_bytes())
            .collect();
        let lines: Vec<&[u8]> = lines.iter().map(Vec::as_slice).collect();
        let response = raw_request(proxy.addr, "/v1/chat/completions", &lines).await;
        assert_eq!(response.status, status, "{} fields", extra + 4);
    }
    assert_eq!(upstream.requests().len(), 1);
}

/// Session ids in the path of the `/_aalis/` routes are percent-decoded:
/// one that decodes to CR, LF, NUL or a byte past ASCII is no session id
/// (the request header's rule) and gets a well-formed `400` that does not
/// echo it; one of visible ASCII with quotes, backslashes, `data:` or
/// `../` is answered, the snapshot route's JSON with it escaped, and the
/// events route's first frame stays one `data:` line — no second SSE line
/// or event can be made of the id. (There is no query form of the session
/// id.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn session_ids_in_paths_cannot_split_responses_or_events() {
    let upstream = FakeUpstream::start(|_| Reply::new(404)).await;
    let proxy = Served::start(proxy_config(&upstream.url(""))).await;
    for (path, id) in [
        ("a%0D%0AX-Injected:%201", None),
        ("a%0Adata:%20%7B%7D%0A%0Aevent:%20x", None),
        ("a%00b%0Dc", None),
        ("%ff%fe", None),
        ("%2e%2e%2f%2e%2e%2fetc", Some("../../etc")),
        (
            "data:%7B%22a%22:1%7D%22%5C%3Cx%3E",
            Some("data:{\"a\":1}\"\\<x>"),
        ),
    ] {
        // A session's events route stays open: read below, frame by frame.
        let routes: &[&str] = if id.is_none() {
            &["", "/events"]
        } else {
            &[""]
        };
        for route in routes {
            let raw = raw_exchange(
                proxy.addr,
                format!(
                    "GET /_aalis/sessions/{path}{route} HTTP/1.1\r\nhost: 127.0.0.1\r\n\
                     connection: close\r\n\r\n"
                )
                .as_bytes(),
            )
            .await;
            let response = RawResponse::parse(&raw);
            response.assert_well_formed();
            assert!(response.headers("x-injected").is_empty());
            if id.is_none() {
                assert_eq!(response.status, 400, "{path}{route}");
                let value: Value = serde_json::from_slice(&response.body).expect("JSON");
                assert_eq!(value["error"]["type"], "invalid_request_error");
            } else if route.is_empty() {
                assert_eq!(response.status, 200, "{path}");
            }
            assert!(
                !response.body.iter().any(|b| matches!(b, b'\r' | b'\n' | 0)),
                "{path}{route}: a raw control byte in the JSON"
            );
        }
        let Some(id) = id else {
            continue;
        };
        let raw = raw_exchange(
            proxy.addr,
            format!(
                "GET /_aalis/sessions/{path} HTTP/1.1\r\nhost: 127.0.0.1\r\nconnection: close\r\n\r\n"
            )
            .as_bytes(),
        )
        .await;
        let value: Value = serde_json::from_slice(&RawResponse::parse(&raw).body).expect("JSON");
        assert_eq!(value["sessionId"], id, "{path}");

        // The events route: read the first frame, then leave.
        let mut stream = TcpStream::connect(proxy.addr).await.expect("connect");
        stream
            .write_all(
                format!("GET /_aalis/sessions/{path}/events HTTP/1.1\r\nhost: 127.0.0.1\r\n\r\n")
                    .as_bytes(),
            )
            .await
            .expect("write");
        let mut raw = Vec::new();
        let mut buf = [0u8; 4096];
        let frame = tokio::time::timeout(PATIENCE, async {
            loop {
                if let Some(end) = find(&raw, b"\r\n\r\n") {
                    let (body, _) = dechunk(&raw[end + 4..]);
                    if let Some(stop) = find(&body, b"\n\n") {
                        return body[..stop + 2].to_vec();
                    }
                }
                let k = stream.read(&mut buf).await.expect("read");
                assert!(k > 0, "closed");
                raw.extend_from_slice(&buf[..k]);
            }
        })
        .await
        .expect("a first frame");
        let head = RawResponse::parse(&raw);
        head.assert_well_formed();
        assert!(head.headers("x-injected").is_empty());
        assert!(frame.starts_with(b"data: {"), "{path}");
        assert_eq!(
            frame.iter().filter(|&&b| b == b'\n').count(),
            2,
            "{path}: the frame is not one data line: {:?}",
            String::from_utf8_lossy(&frame)
        );
        assert!(!frame.contains(&b'\r'));
        let value: Value = serde_json::from_slice(&frame[6..frame.len() - 2]).expect("JSON");
        assert_eq!(value["type"], "stream_resume");
        assert_eq!(value["sessionId"], id, "{path}");
    }
    let sessions = proxy.sessions().clone();
    assert!(
        eventually(PATIENCE, || sessions.is_empty()).await,
        "subscribers that left kept {} sessions",
        sessions.len()
    );
    assert_eq!(upstream.requests().len(), 0, "an admin route was forwarded");
    assert_no_foreign_panic();
}

/// A fresh directory under the system temp dir, for one test.
fn scratch_dir(what: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!(
        "aalis-faults-{what}-{}-{}",
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos())
    ));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("create a scratch dir");
    dir
}

fn unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// A recording never writes through a name that already exists in `DIR`.
/// While the upstream holds its response headers, symbolic links pointing
/// outside `DIR` are planted at every name the first recording could get
/// in a 400 ms window (`<ms>-victim-0.sse`) and at the timing file of the
/// name after it (`<ms>-victim-1.sse.timing`); the upstream then answers
/// inside that window. Both names are skipped (a name is taken only when
/// all its files are free), the stream is recorded as `<ms>-victim-2.sse`
/// (and its `.request.json` and `.timing`), no link is written through,
/// and nothing is created outside `DIR`. The same holds for a file another
/// `serve --record` process wrote there: it is never overwritten. (Up to
/// three tries, for a machine so slow that the window passes before the
/// links are planted.) See: issue 7 ("recorded file names cannot escape
/// --record DIR").
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_recording_never_writes_through_an_existing_name() {
    const WINDOW_MS: u64 = 400;
    let input = fixture(SINGLE_CALL);
    for attempt in 1..=3 {
        let parent = scratch_dir("planted");
        let dir = parent.join("rec");
        std::fs::create_dir(&dir).expect("create the record dir");
        let outside = parent.join("outside");

        let gate = Arc::new(Notify::new());
        let (sent, upstream_gate) = (input.clone(), gate.clone());
        let upstream = FakeUpstream::start(move |_| {
            Reply::stream("text/event-stream", [&sent[..]])
                .before_headers(Step::Wait(upstream_gate.clone()))
        })
        .await;
        let mut config = proxy_config(&upstream.url(""));
        config.record_dir = Some(dir.clone());
        let proxy = Served::start(config).await;
        let req = post(&proxy.url("/v1/chat/completions"), "victim");
        let request = tokio::spawn(async move { send(&client(), req).await });

        let from_ms = unix_ms() + 1000;
        for ms in from_ms..from_ms + WINDOW_MS {
            for name in [
                format!("{ms}-victim-0.sse"),
                format!("{ms}-victim-1.sse.timing"),
            ] {
                std::os::unix::fs::symlink(&outside, dir.join(name)).expect("plant a link");
            }
        }
        while unix_ms() < from_ms {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        let released_at = unix_ms();
        gate.notify_one();
        let response = request.await.expect("request task");
        let (got, end) = read_body(&mut response.into_body(), PATIENCE).await;
        end.expect("a clean end");
        assert_eq!(got, annotate(&input), "recording changed the stream");

        let real = |dir: &std::path::Path| -> Vec<String> {
            let mut names: Vec<String> = std::fs::read_dir(dir)
                .expect("read dir")
                .map(|e| e.expect("entry"))
                .filter(|e| !e.file_type().expect("file type").is_symlink())
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect();
            names.sort();
            names
        };
        // Give the blocking pool a moment for the sidecars and the body's
        // name (`….partial` until then), the last.
        assert!(
            eventually(PATIENCE, || real(&dir).iter().any(|n| n.ends_with(".sse"))).await,
            "{:?}",
            real(&dir)
        );
        assert!(
            !outside.exists(),
            "a recording wrote through a planted link, outside DIR: {} bytes",
            std::fs::read(&outside).map_or(0, |b| b.len())
        );
        assert_eq!(real(&parent), ["rec"]);
        let names = real(&dir);
        let body = names
            .iter()
            .find(|n| n.ends_with(".sse"))
            .expect("a recording");
        assert_eq!(std::fs::read(dir.join(body)).expect("read"), input);
        let ms: u64 = body
            .split('-')
            .next()
            .and_then(|m| m.parse().ok())
            .expect("<ms>-");
        let _ = std::fs::remove_dir_all(&parent);
        if !(from_ms..from_ms + WINDOW_MS).contains(&ms) {
            eprintln!(
                "attempt {attempt}: recorded at {ms}, released at {released_at}, outside the planted window {from_ms}..{}",
                from_ms + WINDOW_MS
            );
            continue;
        }
        // The planted names were skipped.
        assert_eq!(
            names,
            [
                format!("{ms}-victim-2.request.json"),
                format!("{ms}-victim-2.sse"),
                format!("{ms}-victim-2.sse.timing")
            ]
        );
        assert_no_foreign_panic();
        return;
    }
    panic!("the upstream never answered inside the planted window");
}

/// Nothing a client sends can forge a line of serve's log or put a
/// terminal control sequence in it: a request path with raw UTF-8 bytes
/// for a bidi override (U+202E) and the C1 control CSI (U+009B) — which
/// the HTTP parser accepts — is logged escaped in the request line
/// (`path=/v1/\u{202e}abc\u{9b}`); a `tool-execute` payload whose
/// `sessionId` holds a newline, a fake log line and an escape sequence is
/// logged (at `-v`) on one line, escaped. (Header session ids are visible
/// ASCII, so they cannot do either.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_text_cannot_forge_log_lines() {
    let upstream = FakeUpstream::start(|_| Reply::new(404).body("no")).await;
    let mut serve = ServeProcess::start(&upstream.url(""), &["-v"]).await;
    let response = RawResponse::parse(
        &raw_exchange(
            serve.addr,
            b"GET /v1/\xe2\x80\xaeabc\xc2\x9b HTTP/1.1\r\nhost: 127.0.0.1\r\nconnection: close\r\n\r\n",
        )
        .await,
    );
    assert_eq!(response.status, 404, "forwarded");
    assert_eq!(
        upstream.requests()[0].uri.path().as_bytes(),
        b"/v1/\xe2\x80\xaeabc\xc2\x9b",
        "the path reaches the upstream as sent"
    );
    let payload = r#"{"sessionId":"x\n2099-01-01T00:00:00Z  INFO forged\u001b[31m","toolName":"t","phase":"start"}"#;
    let request = format!(
        "POST /_aalis/tool-execute HTTP/1.1\r\nhost: 127.0.0.1\r\nconnection: close\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{payload}",
        payload.len()
    );
    // No session id (the header's rule): refused, and the refusal writes
    // no line of the id's.
    let response = RawResponse::parse(&raw_exchange(serve.addr, request.as_bytes()).await);
    assert_eq!(response.status, 400);

    let log = serve.stop().await;
    assert!(
        !log.contains('\u{1b}') && !log.contains('\u{202e}') && !log.contains('\u{9b}'),
        "a raw control character in the log:\n{log}"
    );
    assert!(
        !log.lines().any(|l| l.starts_with("2099")),
        "a forged log line:\n{log}"
    );
    let request_line = log
        .lines()
        .find(|l| l.contains(" INFO ") && l.contains(" path=/v1/"))
        .unwrap_or_else(|| panic!("no request line:\n{log}"));
    assert!(
        request_line.contains(r" path=/v1/\u{202e}abc\u{9b} "),
        "{request_line}"
    );
    assert!(!log.contains("forged"), "{log}");
}

/// What `safe_file_part` must make of a session id, written out here
/// independently: ASCII letters, digits, `-` and `_` kept, anything else
/// `_`, at most 64 characters.
fn expected_file_part(id: &str) -> String {
    id.chars()
        .take(64)
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' || c == '_' {
                c
            } else {
                '_'
            }
        })
        .collect()
}

/// `serve --record DIR` with session ids that try to escape `DIR` or make
/// odd names — `../../escape`, `..`, `.hidden`, `/etc/passwd`,
/// `a%2F..%2Fb`, `a%00b`, `C:\Windows\x`, `~root`, `$(touch_pwned)`,
/// `a:b*c?d|e<f>g"h`, 128 × `x` — and `a b` and `café` (refused: `400`,
/// nothing recorded): `DIR`'s parent holds only `DIR`, `DIR` holds no
/// directory and exactly three files per accepted stream, each named
/// `<ms>-<part>-<n>.{sse,sse.timing,request.json}` where `<part>` is the
/// id with every character but `[A-Za-z0-9_-]` made `_`, cut at 64, so no
/// name starts with `.`; each `.sse` is the upstream's bytes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn recorded_file_names_cannot_escape_the_record_dir() {
    let parent = scratch_dir("record");
    let dir = parent.join("rec");
    std::fs::create_dir(&dir).expect("create the record dir");

    let input = fixture(SINGLE_CALL);
    let sent = input.clone();
    let upstream =
        FakeUpstream::start(move |_| Reply::stream("text/event-stream", [&sent[..]])).await;
    let mut config = proxy_config(&upstream.url(""));
    config.record_dir = Some(dir.clone());
    let proxy = Served::start(config).await;
    let long = "x".repeat(128);
    let accepted = [
        "../../escape",
        "...",
        ".hidden",
        "/etc/passwd",
        "a%2F..%2Fb",
        "a%00b",
        "C:\\Windows\\x",
        "~root",
        "$(touch_pwned)",
        "a:b*c?d|e<f>g\"h",
        long.as_str(),
    ];
    for id in accepted {
        let response = raw_request(
            proxy.addr,
            "/v1/chat/completions",
            &[format!("x-aalis-session: {id}").as_bytes()],
        )
        .await;
        assert_eq!(response.status, 200, "{id}");
        assert_eq!(response.body, annotate(&input), "{id}");
    }
    for line in [
        &b"x-aalis-session: a b"[..],
        "x-aalis-session: café".as_bytes(),
        b"x-aalis-session: ..",
    ] {
        let response = raw_request(proxy.addr, "/v1/chat/completions", &[line]).await;
        assert_eq!(response.status, 400);
    }

    let names = |path: &std::path::Path| -> Vec<String> {
        let mut names: Vec<String> = std::fs::read_dir(path)
            .expect("read dir")
            .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        names
    };
    // Each body is `….partial` until its sidecars are written.
    let all_written = || {
        let names = names(&dir);
        names.len() == 3 * accepted.len() && !names.iter().any(|n| n.ends_with(".partial"))
    };
    assert!(eventually(PATIENCE, all_written).await, "{:?}", names(&dir));
    assert_eq!(names(&parent), ["rec"], "something was written beside DIR");
    let mut parts: BTreeMap<String, usize> = BTreeMap::new();
    for name in names(&dir) {
        let path = dir.join(&name);
        assert!(path.is_file(), "{name} is not a file");
        assert!(!name.starts_with('.'), "{name}");
        let (ms, rest) = name.split_once('-').expect("<ms>-");
        assert!(ms.bytes().all(|b| b.is_ascii_digit()), "{name}");
        let stem = rest
            .strip_suffix(".sse.timing")
            .or_else(|| rest.strip_suffix(".sse"))
            .or_else(|| rest.strip_suffix(".request.json"))
            .unwrap_or_else(|| panic!("unexpected file {name}"));
        let (part, n) = stem.rsplit_once('-').expect("-<n>");
        assert!(n.bytes().all(|b| b.is_ascii_digit()), "{name}");
        assert!(
            !part.is_empty()
                && part.len() <= 64
                && part
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_'),
            "{name}"
        );
        if name.ends_with(".sse") {
            assert_eq!(std::fs::read(&path).expect("read"), input, "{name}");
        }
        *parts.entry(part.to_owned()).or_default() += 1;
    }
    let mut wanted: BTreeMap<String, usize> = BTreeMap::new();
    for id in accepted {
        *wanted.entry(expected_file_part(id)).or_default() += 3;
    }
    assert_eq!(parts, wanted);
    let _ = std::fs::remove_dir_all(&parent);
    assert_no_foreign_panic();
}

/// Upstream response headers with odd bytes, sent raw, on a stream and on
/// a JSON response:
///
/// | upstream header | what the client gets |
/// | --- | --- |
/// | `X-Odd: café \xff\xfe` (obs-text) | the same bytes, one header |
/// | `X-Aalis-Session: evil` | replaced: one `x-aalis-session`, the request's |
/// | `X-Split: a` LF `X-Injected: yes` (bare LF) | two headers, as the upstream framed them (RFC 9112 allows a bare LF line end) |
/// | `X-CR: a` CR `X-Injected: yes` (bare CR) | `502` `upstream_error`, no `X-Injected` |
/// | `X-Nul: a` NUL `b` | `502` |
/// | `X-Fold: a` CRLF SP `X-Injected: yes` (obs-fold) | `502` |
///
/// Every response head is well formed; the streams that come through are
/// annotated byte for byte.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn odd_upstream_header_bytes_do_not_split_responses() {
    let input = fixture(SINGLE_CALL);
    let odd: &[(&str, &[u8])] = &[
        ("obs-text", b"X-Odd: caf\xc3\xa9 \xff\xfe"),
        ("session", b"X-Aalis-Session: evil"),
        ("bare-lf", b"X-Split: a\nX-Injected: yes"),
        ("bare-cr", b"X-CR: a\rX-Injected: yes"),
        ("nul", b"X-Nul: a\x00b"),
        ("fold", b"X-Fold: a\r\n X-Injected: yes"),
    ];
    let table: Vec<(String, Vec<u8>)> = odd
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_vec()))
        .collect();
    let sent = input.clone();
    let upstream = RawUpstream::start(move |head| {
        let text = String::from_utf8_lossy(head);
        let path = text.split_whitespace().nth(1).unwrap_or_default().to_owned();
        let mut parts = path.trim_start_matches('/').split('/');
        let (kind, case) = (parts.next().unwrap_or(""), parts.next().unwrap_or(""));
        let line = &table.iter().find(|(k, _)| k == case).expect("case").1;
        let (content_type, body) = if kind == "stream" {
            ("text/event-stream", &sent[..])
        } else {
            ("application/json", &b"{\"ok\":true}"[..])
        };
        let mut response = format!(
            "HTTP/1.1 200 OK\r\ncontent-type: {content_type}\r\ncontent-length: {}\r\nconnection: close\r\n",
            body.len()
        )
        .into_bytes();
        response.extend_from_slice(line);
        response.extend_from_slice(b"\r\n\r\n");
        response.extend_from_slice(body);
        vec![RawStep::Write(Bytes::from(response)), RawStep::Close]
    })
    .await;
    let proxy = Served::start(proxy_config(&upstream.url())).await;
    for kind in ["stream", "json"] {
        for (case, _) in odd {
            let response = raw_request(
                proxy.addr,
                &format!("/{kind}/{case}"),
                &[b"x-aalis-session: mine"],
            )
            .await;
            response.assert_well_formed();
            let what = format!("{kind}/{case}");
            assert_eq!(
                response.header("x-aalis-session").as_deref(),
                Some(&b"mine"[..]),
                "{what}"
            );
            match *case {
                "bare-cr" | "nul" | "fold" => {
                    assert_eq!(response.status, 502, "{what}");
                    assert!(response.headers("x-injected").is_empty(), "{what}");
                    let error: Value = serde_json::from_slice(&response.body).expect("JSON");
                    assert_eq!(error["error"]["type"], "upstream_error", "{what}");
                    continue;
                }
                "obs-text" => assert_eq!(
                    response.headers("x-odd"),
                    [b"caf\xc3\xa9 \xff\xfe".to_vec()],
                    "{what}"
                ),
                "bare-lf" => {
                    assert_eq!(response.headers("x-split"), [b"a".to_vec()], "{what}");
                    assert_eq!(response.headers("x-injected"), [b"yes".to_vec()], "{what}");
                }
                _ => {}
            }
            assert_eq!(response.status, 200, "{what}");
            assert!(response.complete, "{what}");
            if kind == "stream" {
                assert_eq!(response.body, annotate(&input), "{what}");
            } else {
                assert_eq!(response.body, b"{\"ok\":true}", "{what}");
            }
        }
    }
    assert_no_foreign_panic();
}
