//! Load driver and stamping upstream for `scripts/bench.sh` (issue 6).
//!
//! Two halves, run as separate processes so neither steals the other's
//! scheduler:
//! - `loadgen upstream`: a tiny HTTP/1.1 server that streams SSE events taken
//!   from a capture file, each preceded by an SSE comment `: t=<ns>` holding
//!   its send time (Unix nanoseconds); keep-alive, chunked, as an OpenAI-style
//!   upstream answers;
//! - `loadgen drive` / `idle` / `soak`: clients that open C concurrent streams
//!   to a target (the upstream itself, `aalis-proxy serve` or nginx in front
//!   of it) and measure, per stamped event, arrival minus send time (also
//!   apart for each stream's first `START_EVENTS` events and for the rest),
//!   and per stream the time to first byte.
//!
//! Both ends read `CLOCK_REALTIME` on the same machine, so the stamps compare.
//! HTTP is written by hand (a request line, a few headers, chunked decoding):
//! the driver must add as little as possible to what it measures, and see
//! each read as it returns. Loopback only; every run is bounded by a deadline.
//!
//! Not a general HTTP client or server: it understands what the upstream
//! sends, what hyper and nginx forward, and nothing else.

use std::collections::HashMap;
use std::fmt::Write as _;
use std::io::Write as _;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use clap::{Parser, Subcommand};
use memchr::memmem;
use tokio::io::{AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::{TcpListener, TcpStream};

#[derive(Parser)]
#[command(about = "Stamping upstream and load driver for scripts/bench.sh")]
struct Cli {
    /// Tokio worker threads (1 = a current-thread runtime).
    #[arg(long, default_value_t = 1, global = true)]
    threads: usize,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Serve SSE events from a capture, each stamped with its send time.
    Upstream {
        /// Loopback address; port 0 picks one (printed on stdout).
        #[arg(long, default_value = "127.0.0.1:0")]
        listen: SocketAddr,
        /// SSE capture whose events are replayed in order, cycling; its
        /// `[DONE]` events are left out and one is sent at the end.
        #[arg(long)]
        events: std::path::PathBuf,
        /// The server exits after this many seconds, whatever happens.
        #[arg(long, default_value_t = 3600)]
        max_seconds: u64,
    },
    /// C concurrent streams, one each; prints one JSON line of results.
    Drive {
        #[command(flatten)]
        load: Load,
        /// Also writes each event's latency to this file, one line an
        /// event: the stream's number, the event's position in its stream,
        /// the stream's events, the latency in nanoseconds (for
        /// scripts/bench/tail_by_position.py).
        #[arg(long)]
        latencies_out: Option<std::path::PathBuf>,
    },
    /// C workers, each streaming one stream after another for a duration.
    Soak {
        #[command(flatten)]
        load: Load,
        #[arg(long)]
        duration_seconds: u64,
    },
    /// Opens N streams that stay open and idle after their first event,
    /// prints `ready N` once all have it, and closes them at stdin EOF or
    /// after --hold-seconds.
    Idle {
        #[arg(long)]
        target: SocketAddr,
        #[arg(long, default_value_t = 1000)]
        streams: usize,
        #[arg(long, default_value_t = 120)]
        hold_seconds: u64,
    },
    /// Copies stdin to stdout with `annotate`'s I/O (the pipe widened, the
    /// same reading thread and buffers, each piece written and flushed)
    /// and parses nothing: the filter table's "annotate's I/O alone".
    Copy,
}

/// `loadgen copy`: stdin to stdout as `annotate` reads and writes them
/// (`aalis_proxy::filter::copy`), on the calling thread.
fn copy() -> Result<(), Error> {
    aalis_proxy::filter::widen_pipe(std::io::stdin());
    let mut stdout = std::io::stdout().lock();
    match aalis_proxy::filter::copy(Box::new(std::io::stdin()), "stdin", &mut stdout) {
        Err(e) if !e.is_broken_pipe() => Err(e.into()),
        _ => Ok(()),
    }
}

#[derive(clap::Args, Clone)]
struct Load {
    /// Where to connect: the upstream, the proxy or nginx (loopback).
    #[arg(long)]
    target: SocketAddr,
    #[arg(long, default_value_t = 1)]
    concurrency: usize,
    /// Events per stream.
    #[arg(long, default_value_t = 200)]
    events: usize,
    /// Pause between two events of a stream, in microseconds (0: unpaced).
    #[arg(long, default_value_t = 5000)]
    delay_us: u64,
    /// The whole run is cut at this deadline (the results say so).
    #[arg(long, default_value_t = 120)]
    timeout_seconds: u64,
}

fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    let runtime = if cli.threads <= 1 {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
    } else {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(cli.threads)
            .enable_all()
            .build()
    };
    let runtime = match runtime {
        Ok(r) => r,
        Err(e) => {
            eprintln!("loadgen: error: {e}");
            return std::process::ExitCode::FAILURE;
        }
    };
    let result = runtime.block_on(async move {
        match cli.command {
            Command::Upstream {
                listen,
                events,
                max_seconds,
            } => upstream(listen, &events, max_seconds).await,
            Command::Drive {
                load,
                latencies_out,
            } => drive(load, latencies_out.as_deref()).await,
            Command::Soak {
                load,
                duration_seconds,
            } => soak(load, duration_seconds).await,
            Command::Idle {
                target,
                streams,
                hold_seconds,
            } => idle(target, streams, hold_seconds).await,
            Command::Copy => copy(),
        }
    });
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("loadgen: error: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}

#[path = "common/http.rs"]
mod http;

type Error = Box<dyn std::error::Error + Send + Sync>;

fn now_ns() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64)
}

// === the upstream ===

async fn upstream(
    listen: SocketAddr,
    events: &std::path::Path,
    max_seconds: u64,
) -> Result<(), Error> {
    if !listen.ip().is_loopback() {
        return Err("the upstream listens on loopback only".into());
    }
    let capture = std::fs::read(events)?;
    let blocks: Arc<Vec<Vec<u8>>> = Arc::new(
        capture
            .split(|&b| b == b'\n')
            .collect::<Vec<_>>()
            .split(|line| line.is_empty())
            .map(|lines| lines.join(&b'\n'))
            .filter(|b| !b.is_empty() && b.as_slice() != b"data: [DONE]")
            .collect(),
    );
    if blocks.is_empty() {
        return Err("the capture has no events".into());
    }
    // A deep accept queue: the upstream must never be the one dropping SYNs
    // when C streams (or a proxy's C upstream connections) start at once.
    let socket = if listen.is_ipv4() {
        tokio::net::TcpSocket::new_v4()?
    } else {
        tokio::net::TcpSocket::new_v6()?
    };
    socket.set_reuseaddr(true)?;
    socket.bind(listen)?;
    let listener: TcpListener = socket.listen(4096)?;
    println!("listening {}", listener.local_addr()?);
    std::io::stdout().flush()?;
    let deadline = tokio::time::sleep(Duration::from_secs(max_seconds));
    tokio::pin!(deadline);
    loop {
        tokio::select! {
            accepted = listener.accept() => {
                let (socket, _) = accepted?;
                let blocks = blocks.clone();
                tokio::spawn(async move {
                    let _ = serve_connection(socket, blocks).await;
                });
            }
            _ = &mut deadline => return Ok(()),
            _ = tokio::signal::ctrl_c() => return Ok(()),
        }
    }
}

/// What a request asks for, from its query string.
struct StreamRequest {
    events: usize,
    delay: Duration,
    /// After the first event, stay idle this long (or until the client goes).
    hold: Duration,
}

async fn serve_connection(socket: TcpStream, blocks: Arc<Vec<Vec<u8>>>) -> Result<(), Error> {
    socket.set_nodelay(true)?;
    let mut socket = BufReader::new(socket);
    loop {
        // The request head.
        let Some(target) = http::read_request(&mut socket).await? else {
            return Ok(());
        };
        let request = parse_query(&target);
        stream_events(&mut socket, &blocks, &request).await?;
    }
}

fn parse_query(target: &str) -> StreamRequest {
    let params: HashMap<&str, u64> = target
        .split_once('?')
        .map(|(_, q)| q)
        .unwrap_or("")
        .split('&')
        .filter_map(|kv| kv.split_once('='))
        .filter_map(|(k, v)| Some((k, v.parse().ok()?)))
        .collect();
    StreamRequest {
        events: params.get("events").copied().unwrap_or(100) as usize,
        delay: Duration::from_micros(params.get("delay_us").copied().unwrap_or(0)),
        hold: Duration::from_millis(params.get("hold_ms").copied().unwrap_or(0)),
    }
}

async fn stream_events(
    socket: &mut BufReader<TcpStream>,
    blocks: &[Vec<u8>],
    request: &StreamRequest,
) -> Result<(), Error> {
    socket
        .get_mut()
        .write_all(
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncache-control: no-cache\r\n\
              transfer-encoding: chunked\r\n\r\n",
        )
        .await?;
    let start = tokio::time::Instant::now();
    let mut chunk = Vec::with_capacity(64 * 1024);
    for i in 0..=request.events {
        if i > 0 && !request.delay.is_zero() {
            tokio::time::sleep_until(start + request.delay * i as u32).await;
        }
        if i == 1 && !request.hold.is_zero() {
            // Idle: wait out the hold, or stop at once when the client goes.
            let mut probe = [0u8; 1];
            tokio::select! {
                _ = tokio::time::sleep(request.hold) => {}
                _ = socket.read(&mut probe) => return Ok(()),
            }
        }
        let block: &[u8] = if i == request.events {
            b"data: [DONE]"
        } else {
            &blocks[i % blocks.len()]
        };
        let stamp = format!(": t={}\n", now_ns());
        let len = stamp.len() + block.len() + 2;
        chunk.clear();
        write!(chunk, "{len:x}\r\n")?;
        chunk.extend_from_slice(stamp.as_bytes());
        chunk.extend_from_slice(block);
        chunk.extend_from_slice(b"\n\n\r\n");
        if i == request.events {
            chunk.extend_from_slice(b"0\r\n\r\n");
        }
        socket.get_mut().write_all(&chunk).await?;
    }
    Ok(())
}

// === the clients ===

/// What one stream measured.
#[derive(Default)]
struct StreamStats {
    /// Arrival minus send time of each stamped event, in nanoseconds.
    latencies_ns: Vec<u64>,
    /// Connect start to the first response byte.
    ttfb_ns: u64,
    /// Body bytes received (after chunked decoding).
    body_bytes: u64,
    /// Stamped events received.
    events: u64,
    /// Set once the first event arrived (for `idle`).
    first_event: bool,
}

/// Reads one HTTP/1.1 response: head, then a chunked or length-delimited or
/// close-delimited body, handing each completed SSE event to the stats.
struct ResponseReader {
    raw: Vec<u8>,
    body: Vec<u8>,
    head_done: bool,
    chunked: bool,
    /// Bytes left in the current chunk (chunked) or the body (length).
    remaining: Option<usize>,
    /// The terminal chunk or the whole body arrived.
    done: bool,
}

impl ResponseReader {
    fn new() -> Self {
        ResponseReader {
            raw: Vec::with_capacity(64 * 1024),
            body: Vec::with_capacity(64 * 1024),
            head_done: false,
            chunked: false,
            remaining: None,
            done: false,
        }
    }

    /// Adds bytes just read; stamped events completed by them are measured
    /// against `now`.
    fn feed(&mut self, input: &[u8], now: u64, stats: &mut StreamStats) -> Result<(), Error> {
        self.raw.extend_from_slice(input);
        let mut at = 0;
        if !self.head_done {
            let Some(end) = memmem::find(&self.raw, b"\r\n\r\n") else {
                return Ok(());
            };
            let head = std::str::from_utf8(&self.raw[..end])?;
            let status = head.split_whitespace().nth(1).unwrap_or("");
            if status != "200" {
                return Err(format!("status {status}").into());
            }
            for line in head.lines().skip(1) {
                if let Some((name, value)) = line.split_once(':') {
                    let value = value.trim();
                    if name.eq_ignore_ascii_case("transfer-encoding")
                        && value.eq_ignore_ascii_case("chunked")
                    {
                        self.chunked = true;
                    } else if name.eq_ignore_ascii_case("content-length") {
                        self.remaining = Some(value.parse()?);
                    }
                }
            }
            self.head_done = true;
            at = end + 4;
            if self.chunked {
                self.remaining = None;
            }
        }
        // Body bytes.
        if self.chunked {
            loop {
                match self.remaining {
                    None => {
                        let Some(eol) = memmem::find(&self.raw[at..], b"\r\n") else {
                            break;
                        };
                        let size_text = std::str::from_utf8(&self.raw[at..at + eol])?;
                        let size_text = size_text.split(';').next().unwrap_or("").trim();
                        let size = usize::from_str_radix(size_text, 16)?;
                        at += eol + 2;
                        if size == 0 {
                            self.done = true;
                            break;
                        }
                        self.remaining = Some(size);
                    }
                    Some(0) => {
                        if self.raw.len() - at < 2 {
                            break;
                        }
                        at += 2; // the chunk's CRLF
                        self.remaining = None;
                    }
                    Some(n) => {
                        let take = n.min(self.raw.len() - at);
                        if take == 0 {
                            break;
                        }
                        self.body.extend_from_slice(&self.raw[at..at + take]);
                        at += take;
                        self.remaining = Some(n - take);
                    }
                }
            }
        } else {
            let available = self.raw.len() - at;
            let take = self.remaining.map_or(available, |n| n.min(available));
            self.body.extend_from_slice(&self.raw[at..at + take]);
            at += take;
            if let Some(n) = self.remaining.as_mut() {
                *n -= take;
                self.done = *n == 0;
            }
        }
        self.raw.drain(..at);
        // Completed events.
        let mut consumed = 0;
        while let Some(end) = memmem::find(&self.body[consumed..], b"\n\n") {
            let event = &self.body[consumed..consumed + end];
            if let Some(t) = stamp_of(event) {
                stats.latencies_ns.push(now.saturating_sub(t));
                stats.events += 1;
                stats.first_event = true;
            }
            consumed += end + 2;
        }
        stats.body_bytes += consumed as u64;
        self.body.drain(..consumed);
        Ok(())
    }
}

/// The `t=` of a `: t=<ns>` comment line of an event.
fn stamp_of(event: &[u8]) -> Option<u64> {
    let at = if event.starts_with(b": t=") {
        4
    } else {
        memmem::find(event, b"\n: t=")? + 5
    };
    let digits = event[at..].iter().take_while(|b| b.is_ascii_digit());
    let mut value = 0u64;
    for &d in digits {
        value = value * 10 + u64::from(d - b'0');
    }
    Some(value)
}

fn request_bytes(load: &Load, hold_ms: u64) -> Vec<u8> {
    let body = br#"{"model":"bench","stream":true,"messages":[{"role":"user","content":"go"}]}"#;
    let mut request = format!(
        "POST /v1/chat/completions?events={}&delay_us={}&hold_ms={} HTTP/1.1\r\n\
         host: 127.0.0.1\r\ncontent-type: application/json\r\naccept: text/event-stream\r\n\
         content-length: {}\r\n\r\n",
        load.events,
        load.delay_us,
        hold_ms,
        body.len()
    )
    .into_bytes();
    request.extend_from_slice(body);
    request
}

/// One stream, start to end (or to `stop`, for idle streams).
async fn one_stream(
    target: SocketAddr,
    request: Arc<Vec<u8>>,
    stats: &mut StreamStats,
    ready: Option<tokio::sync::mpsc::Sender<()>>,
) -> Result<(), Error> {
    if !target.ip().is_loopback() {
        return Err("targets are loopback only".into());
    }
    let started = Instant::now();
    let mut socket = TcpStream::connect(target).await?;
    socket.set_nodelay(true)?;
    socket.write_all(&request).await?;
    let mut reader = ResponseReader::new();
    let mut buf = vec![0u8; 64 * 1024];
    let mut ready = ready;
    loop {
        let n = socket.read(&mut buf).await?;
        if n == 0 {
            break;
        }
        let now = now_ns();
        if stats.ttfb_ns == 0 {
            stats.ttfb_ns = started.elapsed().as_nanos() as u64;
        }
        reader.feed(&buf[..n], now, stats)?;
        if stats.first_event
            && let Some(tx) = ready.take()
        {
            let _ = tx.send(()).await;
        }
        if reader.done {
            break;
        }
    }
    if !reader.done {
        return Err("the response ended early".into());
    }
    Ok(())
}

/// Nearest-rank percentile of sorted values.
fn percentile(sorted: &[u64], p: f64) -> u64 {
    if sorted.is_empty() {
        return 0;
    }
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

fn summary_json(values: &mut [u64]) -> String {
    values.sort_unstable();
    let us = |ns: u64| ns as f64 / 1000.0;
    format!(
        r#"{{"p50":{:.1},"p99":{:.1},"max":{:.1},"n":{}}}"#,
        us(percentile(values, 50.0)),
        us(percentile(values, 99.0)),
        us(values.last().copied().unwrap_or(0)),
        values.len()
    )
}

/// Events of each stream counted as its start in `drive`'s
/// `latency_start_us` (the rest are `latency_steady_us`).
const START_EVENTS: usize = 10;

async fn drive(load: Load, latencies_out: Option<&std::path::Path>) -> Result<(), Error> {
    let request = Arc::new(request_bytes(&load, 0));
    let deadline = Duration::from_secs(load.timeout_seconds);
    let started = Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    for k in 0..load.concurrency {
        let request = request.clone();
        let target = load.target;
        // Paced streams start spread over one pacing interval, so the
        // events of C streams arrive spread out rather than in bursts of C.
        let offset =
            Duration::from_micros(load.delay_us * k as u64 / load.concurrency.max(1) as u64);
        tasks.spawn(async move {
            let mut stats = StreamStats::default();
            tokio::time::sleep(offset).await;
            let result = tokio::time::timeout_at(
                tokio::time::Instant::from_std(started + deadline),
                one_stream(target, request, &mut stats, None),
            )
            .await;
            let ok = matches!(result, Ok(Ok(())));
            let error = match result {
                Ok(Ok(())) => None,
                Ok(Err(e)) => Some(e.to_string()),
                Err(_) => Some("deadline".to_owned()),
            };
            (ok, error, stats)
        });
    }
    let mut latencies = Vec::new();
    // The first events of each stream (paced, its first 50 ms, which
    // include the set-up of all C streams) and the rest, apart: which part
    // a tail comes from.
    let (mut start, mut steady) = (Vec::new(), Vec::new());
    let mut ttfbs = Vec::new();
    // Each stream's latencies in order, kept for `latencies_out` only.
    let mut per_stream = Vec::new();
    let (mut ok, mut errors, mut events, mut bytes) = (0u64, 0u64, 0u64, 0u64);
    let mut first_error = None;
    while let Some(joined) = tasks.join_next().await {
        let (stream_ok, error, stats) = joined?;
        if stream_ok {
            ok += 1;
        } else {
            errors += 1;
            first_error = first_error.or(error);
        }
        events += stats.events;
        bytes += stats.body_bytes;
        ttfbs.push(stats.ttfb_ns);
        latencies.extend_from_slice(&stats.latencies_ns);
        let split = stats.latencies_ns.len().min(START_EVENTS);
        start.extend_from_slice(&stats.latencies_ns[..split]);
        steady.extend_from_slice(&stats.latencies_ns[split..]);
        if latencies_out.is_some() {
            per_stream.push(stats.latencies_ns);
        }
    }
    let wall = started.elapsed().as_secs_f64();
    // Written once every stream has ended, so that the writing costs the
    // drive nothing.
    if let Some(path) = latencies_out {
        let mut text = String::new();
        for (stream, latencies) in per_stream.iter().enumerate() {
            for (position, ns) in latencies.iter().enumerate() {
                let _ = writeln!(text, "{stream} {position} {} {ns}", latencies.len());
            }
        }
        std::fs::write(path, text).map_err(|e| format!("cannot write {}: {e}", path.display()))?;
    }
    println!(
        r#"{{"concurrency":{},"ok":{},"errors":{},"first_error":{},"events":{},"bytes":{},"wall_s":{:.4},"events_per_s":{:.1},"mb_per_s":{:.3},"latency_us":{},"ttfb_us":{},"start_events":{},"latency_start_us":{},"latency_steady_us":{}}}"#,
        load.concurrency,
        ok,
        errors,
        first_error.map_or("null".to_owned(), |e| format!("{e:?}")),
        events,
        bytes,
        wall,
        events as f64 / wall,
        bytes as f64 / wall / 1e6,
        summary_json(&mut latencies),
        summary_json(&mut ttfbs),
        START_EVENTS,
        summary_json(&mut start),
        summary_json(&mut steady),
    );
    Ok(())
}

async fn soak(load: Load, duration_seconds: u64) -> Result<(), Error> {
    let request = Arc::new(request_bytes(&load, 0));
    let started = Instant::now();
    let end = started + Duration::from_secs(duration_seconds);
    let hard_end = end + Duration::from_secs(load.timeout_seconds);
    let mut tasks = tokio::task::JoinSet::new();
    for k in 0..load.concurrency {
        let request = request.clone();
        let target = load.target;
        let offset =
            Duration::from_micros(load.delay_us * k as u64 / load.concurrency.max(1) as u64);
        tasks.spawn(async move {
            tokio::time::sleep(offset).await;
            let (mut streams, mut errors, mut events) = (0u64, 0u64, 0u64);
            while Instant::now() < end {
                let mut stats = StreamStats::default();
                let result = tokio::time::timeout_at(
                    tokio::time::Instant::from_std(hard_end),
                    one_stream(target, request.clone(), &mut stats, None),
                )
                .await;
                match result {
                    Ok(Ok(())) => streams += 1,
                    Ok(Err(_)) => errors += 1,
                    Err(_) => {
                        errors += 1;
                        break;
                    }
                }
                events += stats.events;
            }
            (streams, errors, events)
        });
    }
    let (mut streams, mut errors, mut events) = (0u64, 0u64, 0u64);
    while let Some(joined) = tasks.join_next().await {
        let (s, e, n) = joined?;
        streams += s;
        errors += e;
        events += n;
    }
    println!(
        r#"{{"streams":{streams},"errors":{errors},"events":{events},"wall_s":{:.2}}}"#,
        started.elapsed().as_secs_f64()
    );
    Ok(())
}

async fn idle(target: SocketAddr, streams: usize, hold_seconds: u64) -> Result<(), Error> {
    let load = Load {
        target,
        concurrency: streams,
        events: 1,
        delay_us: 0,
        timeout_seconds: hold_seconds,
    };
    let request = Arc::new(request_bytes(&load, hold_seconds * 1000 + 10_000));
    let (ready_tx, mut ready_rx) = tokio::sync::mpsc::channel(streams.max(1));
    let failed = Arc::new(AtomicBool::new(false));
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..streams {
        let request = request.clone();
        let ready_tx = ready_tx.clone();
        let failed = failed.clone();
        tasks.spawn(async move {
            let mut stats = StreamStats::default();
            if let Err(e) = one_stream(target, request, &mut stats, Some(ready_tx)).await
                && !failed.swap(true, Ordering::Relaxed)
            {
                eprintln!("loadgen: idle stream failed: {e}");
            }
        });
    }
    drop(ready_tx);
    let hold = Duration::from_secs(hold_seconds);
    let started = Instant::now();
    let mut ready = 0;
    while ready < streams {
        match tokio::time::timeout(hold, ready_rx.recv()).await {
            Ok(Some(())) => ready += 1,
            Ok(None) | Err(_) => break,
        }
    }
    println!("ready {ready}");
    std::io::stdout().flush()?;
    // Hold until stdin closes (the caller took its measurement) or the hold
    // runs out; dropping the tasks closes every connection. A thread reads
    // stdin: the crate's tokio has no `io-std`.
    let (closed_tx, closed_rx) = tokio::sync::oneshot::channel::<()>();
    std::thread::spawn(move || {
        let mut sink = Vec::new();
        let _ = std::io::Read::read_to_end(&mut std::io::stdin(), &mut sink);
        let _ = closed_tx.send(());
    });
    let left = hold.saturating_sub(started.elapsed());
    let _ = tokio::time::timeout(left, closed_rx).await;
    tasks.abort_all();
    Ok(())
}
