//! A measurement prototype for issue 6, not a product path: `serve`'s
//! streaming path (the `http://` upstream pool, `TapBody`, the annotator,
//! the session registry) behind an HTTP/1.1 server of its own instead of
//! hyper's, to measure what replacing hyper's server would buy before
//! anyone builds it (BENCHMARKS.md, "Twenty-first round").
//!
//! It understands what `examples/loadgen.rs` sends — a `POST` with a
//! `content-length` body on a keep-alive connection — and answers every
//! request as an SSE stream annotated with `--inject field`, as `serve`
//! does. Nothing else: no admin routes, no HTTP/2, no chunked request
//! bodies, no `Expect`, no timeouts on the client side, no graceful
//! shutdown. Its command line is `serve`'s, so the bench scripts can run it
//! in `serve`'s place:
//!
//! ```sh
//! cargo build --release --example h1_serve_spike
//! BIN=target/release/examples/h1_serve_spike scripts/bench/callgrind_serve.sh
//! ```

use std::future::poll_fn;
use std::io::{self, IoSlice};
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::Poll;
use std::time::{Duration, Instant};

use aalis_proxy::encode::{InjectMode, OutputFormat};
use aalis_proxy::framing::Framing;
use aalis_proxy::pipeline::{Annotator, AnnotatorConfig};
use aalis_proxy::proxy::body::{RequestLog, TapBody};
use aalis_proxy::proxy::h1::{H1Pool, wire};
use aalis_proxy::proxy::metrics::Metrics;
use aalis_proxy::proxy::sessions::SessionRegistry;
use aalis_proxy::proxy::upstream::{ProxyBody, Upstream, UpstreamBody, strip_hop_by_hop};
use bytes::{Bytes, BytesMut};
use clap::Parser;
use http::{Request, Uri};
use http_body_util::{BodyExt, Full};
use hyper::body::Body;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// The allocator `serve` runs on (`src/main.rs`), so that the two differ
/// only in their server.
#[cfg(not(target_env = "msvc"))]
#[global_allocator]
static GLOBAL: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

#[derive(Parser)]
#[command(
    about = "serve's streaming path behind an HTTP/1.1 server of its own (a measurement prototype)"
)]
struct Cli {
    /// `serve`, for the bench scripts' command line.
    command: String,
    #[arg(long)]
    upstream: String,
    #[arg(long, default_value = "127.0.0.1:8787")]
    listen: SocketAddr,
    /// Worker threads, each with a current-thread runtime (0: one per CPU).
    #[arg(long, default_value_t = 0)]
    threads: usize,
}

/// What every connection shares.
struct Shared {
    upstream: Upstream,
    pool: Arc<H1Pool>,
    sessions: SessionRegistry,
    metrics: Arc<Metrics>,
    streams: AtomicU64,
}

/// Largest request head and body read.
const MAX_REQUEST_BYTES: usize = 1024 * 1024;

fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    match run(cli) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("h1_serve_spike: {err}");
            std::process::ExitCode::FAILURE
        }
    }
}

fn run(cli: Cli) -> Result<(), Box<dyn std::error::Error>> {
    if cli.command != "serve" {
        return Err(format!("unknown command {:?} (only `serve`)", cli.command).into());
    }
    let shared = Arc::new(Shared {
        upstream: Upstream::parse(&cli.upstream)?,
        pool: H1Pool::new(Duration::from_secs(10)),
        sessions: SessionRegistry::new(),
        metrics: Arc::new(Metrics::default()),
        streams: AtomicU64::new(0),
    });
    let listener = std::net::TcpListener::bind(cli.listen)?;
    listener.set_nonblocking(true)?;
    let threads = match cli.threads {
        0 => std::thread::available_parallelism().map_or(1, usize::from),
        n => n,
    };
    // One current-thread runtime per worker, each accepting on the same
    // socket: a connection stays on the thread that accepted it, as in
    // `serve`'s workers.
    let mut workers = Vec::new();
    for _ in 0..threads {
        let listener = listener.try_clone()?;
        let shared = shared.clone();
        let worker = std::thread::Builder::new().spawn(move || -> io::Result<()> {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()?;
            runtime.block_on(async move {
                let listener = TcpListener::from_std(listener)?;
                loop {
                    let (socket, _) = match listener.accept().await {
                        Ok(accepted) => accepted,
                        Err(err) => {
                            // As `serve` does: wait instead of spinning.
                            eprintln!("h1_serve_spike: accept failed: {err}");
                            tokio::time::sleep(Duration::from_millis(50)).await;
                            continue;
                        }
                    };
                    let _ = socket.set_nodelay(true);
                    let shared = shared.clone();
                    tokio::spawn(async move {
                        if let Err(err) = connection(socket, &shared).await {
                            eprintln!("h1_serve_spike: connection: {err}");
                        }
                    });
                }
            })
        })?;
        workers.push(worker);
    }
    // SIGINT ends the process at once, and normally, so that a profiler
    // running it (callgrind_serve.sh) writes its counts before the script
    // reads them.
    let signals = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    signals.block_on(async {
        tokio::select! {
            signal = tokio::signal::ctrl_c() => signal,
            // A worker ends only on an error: say so and stop.
            () = async {
                while workers.iter().all(|w| !w.is_finished()) {
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            } => Err(io::Error::other("a worker stopped")),
        }
    })?;
    Ok(())
}

/// A request head, owned.
struct Head {
    method: http::Method,
    path: String,
    headers: Vec<(String, Vec<u8>)>,
    content_length: usize,
}

/// Serves one keep-alive connection, request after request.
async fn connection(mut socket: TcpStream, shared: &Shared) -> io::Result<()> {
    let mut buf = BytesMut::with_capacity(8 * 1024);
    loop {
        let Some(head) = read_head(&mut socket, &mut buf).await? else {
            return Ok(());
        };
        while buf.len() < head.content_length {
            if socket.read_buf(&mut buf).await? == 0 {
                return Ok(());
            }
        }
        let body = buf.split_to(head.content_length).freeze();
        respond(&mut socket, shared, head, body).await?;
    }
}

/// Reads up to a whole request head; `None` at a clean end.
async fn read_head(socket: &mut TcpStream, buf: &mut BytesMut) -> io::Result<Option<Head>> {
    loop {
        let mut fields = [httparse::EMPTY_HEADER; 64];
        let mut request = httparse::Request::new(&mut fields);
        match request.parse(buf).map_err(io::Error::other)? {
            httparse::Status::Complete(len) => {
                let method = http::Method::from_bytes(request.method.unwrap_or("GET").as_bytes())
                    .map_err(io::Error::other)?;
                let path = request.path.unwrap_or("/").to_owned();
                let mut content_length = 0;
                let mut headers = Vec::new();
                for field in request.headers.iter() {
                    if field.name.eq_ignore_ascii_case("content-length") {
                        content_length = std::str::from_utf8(field.value)
                            .ok()
                            .and_then(|v| v.trim().parse().ok())
                            .ok_or_else(|| io::Error::other("bad content-length"))?;
                    }
                    headers.push((field.name.to_owned(), field.value.to_vec()));
                }
                if content_length > MAX_REQUEST_BYTES {
                    return Err(io::Error::other("request body too large"));
                }
                let _ = buf.split_to(len);
                return Ok(Some(Head {
                    method,
                    path,
                    headers,
                    content_length,
                }));
            }
            httparse::Status::Partial if buf.len() > MAX_REQUEST_BYTES => {
                return Err(io::Error::other("request head too large"));
            }
            httparse::Status::Partial => {}
        }
        if socket.read_buf(buf).await? == 0 {
            return if buf.is_empty() {
                Ok(None)
            } else {
                Err(io::Error::other("closed inside a request head"))
            };
        }
    }
}

/// Forwards one request and streams its annotated response.
async fn respond(
    socket: &mut TcpStream,
    shared: &Shared,
    head: Head,
    body: Bytes,
) -> io::Result<()> {
    let started = Instant::now();
    let path: Uri = head.path.parse().map_err(io::Error::other)?;
    let uri = shared.upstream.uri_for(&path).map_err(io::Error::other)?;
    let mut request = Request::builder().method(head.method.clone()).uri(uri);
    for (name, value) in &head.headers {
        if !name.eq_ignore_ascii_case("host") {
            request = request.header(name.as_str(), value.as_slice());
        }
    }
    let upstream_body: ProxyBody = Full::new(body).map_err(|never| match never {}).boxed();
    let mut request = request.body(upstream_body).map_err(io::Error::other)?;
    strip_hop_by_hop(request.headers_mut());
    let response = match shared.pool.request(request).await {
        Ok(response) => response,
        Err(err) => {
            socket
                .write_all(b"HTTP/1.1 502 Bad Gateway\r\ncontent-length: 0\r\n\r\n")
                .await?;
            return Err(io::Error::other(err));
        }
    };
    let (mut parts, body) = response.into_parts();
    let n = shared.streams.fetch_add(1, Ordering::Relaxed);
    let session_id = format!("spike-{n}");
    let annotator = Annotator::new(AnnotatorConfig {
        output: OutputFormat::Sse,
        inject: InjectMode::Field,
        session_id: Some(session_id.clone()),
        framing: Some(Framing::Sse),
        max_event_bytes: aalis_proxy::framing::sse::DEFAULT_MAX_EVENT_BYTES,
        collect_events: true,
    });
    let stream = shared.sessions.begin_stream(&session_id);
    let log = RequestLog {
        method: head.method,
        path: head.path,
        status: parts.status,
        session_id,
        started,
    };
    let mut tap = Box::pin(TapBody::stream(
        UpstreamBody::Plain(body),
        annotator,
        stream,
        None,
        Duration::from_secs(300),
        log,
        shared.metrics.clone(),
    ));
    strip_hop_by_hop(&mut parts.headers);
    parts.headers.remove(http::header::CONTENT_LENGTH);
    let mut out = Vec::with_capacity(512);
    out.extend_from_slice(b"HTTP/1.1 ");
    out.extend_from_slice(parts.status.as_str().as_bytes());
    out.extend_from_slice(b" ");
    out.extend_from_slice(parts.status.canonical_reason().unwrap_or("").as_bytes());
    out.extend_from_slice(b"\r\n");
    for (name, value) in &parts.headers {
        out.extend_from_slice(name.as_str().as_bytes());
        out.extend_from_slice(b": ");
        out.extend_from_slice(value.as_bytes());
        out.extend_from_slice(b"\r\n");
    }
    out.extend_from_slice(b"transfer-encoding: chunked\r\n\r\n");
    // What goes before the next chunk's data: the head until it is sent,
    // then the chunk's size line (`wire::write_chunk_size`, as the
    // upstream client writes request bodies).
    let mut prefix = out;
    let mut head_sent = false;
    loop {
        // As hyper does: the head goes out with the first chunk when that
        // is ready, and alone when it is not.
        let frame = if head_sent {
            tap.frame().await
        } else {
            match poll_fn(|cx| Poll::Ready(tap.as_mut().poll_frame(cx))).await {
                Poll::Ready(frame) => frame,
                Poll::Pending => {
                    socket.write_all(&prefix).await?;
                    prefix.clear();
                    head_sent = true;
                    tap.frame().await
                }
            }
        };
        let Some(frame) = frame else {
            break;
        };
        let frame = frame.map_err(io::Error::other)?;
        let Ok(data) = frame.into_data() else {
            continue; // trailers: dropped by this prototype
        };
        if data.is_empty() {
            continue;
        }
        wire::write_chunk_size(data.len(), &mut prefix);
        // The last chunk and the end in one write, as hyper writes them.
        let last = tap.is_end_stream();
        let after: &[u8] = if last { b"\r\n0\r\n\r\n" } else { b"\r\n" };
        write_all_vectored(socket, [&prefix, &data, after]).await?;
        prefix.clear();
        head_sent = true;
        if last {
            return Ok(());
        }
    }
    prefix.extend_from_slice(b"0\r\n\r\n");
    socket.write_all(&prefix).await
}

/// Writes `parts` in order, with one `writev` when the socket takes them
/// all.
async fn write_all_vectored(socket: &mut TcpStream, parts: [&[u8]; 3]) -> io::Result<()> {
    let total: usize = parts.iter().map(|p| p.len()).sum();
    let mut written = 0;
    while written < total {
        let mut skip = written;
        let mut slices = [IoSlice::new(&[]); 3];
        let mut used = 0;
        for part in parts {
            if skip >= part.len() {
                skip -= part.len();
                continue;
            }
            slices[used] = IoSlice::new(&part[skip..]);
            used += 1;
            skip = 0;
        }
        let n = socket.write_vectored(&slices[..used]).await?;
        if n == 0 {
            return Err(io::ErrorKind::WriteZero.into());
        }
        written += n;
    }
    Ok(())
}
