//! Bounded load test of `aalis-proxy serve` (issue 7, "Load" and "Limits"):
//! many concurrent streams, every received byte checked against what the
//! upstream sent, memory read from `/proc`. `scripts/loadtest.sh` builds the
//! binaries and runs it; `--help` lists the sizes.
//!
//! It starts the real binary (`serve`, and `mock` for one phase) as child
//! processes on loopback ports, plays the upstream and every client itself,
//! and runs six phases:
//!
//! - `exact`: N concurrent streams through `serve`, each with content derived
//!   from its own stream key (tool names, argument text, a hold marker), held
//!   open together at a hold point so memory and `/_aalis/sessions` are read
//!   with all N open. Field injection: the body with every injected member
//!   removed ([`strip_injected`]) must equal what the upstream sent, and the
//!   removed progress must be exactly the progress of that stream's own tool
//!   calls. Then the same again in the same process (`--again`), and N more
//!   with `X-Aalis-Inject: none`: byte for byte.
//! - `churn`: many short streams without `X-Aalis-Session`: what serve keeps
//!   per finished stream.
//! - `mock`: N concurrent streams from `aalis-proxy mock` replaying every
//!   capture under `fixtures/` through `serve`; each, stripped, must equal
//!   its capture file.
//! - `faults`: N concurrent streams of which one in five is faulty ([`Kind`]:
//!   reset, bad chunked framing, EOF mid-body, stall past `--idle-timeout`,
//!   a client that leaves, garbage events, a cut event, a garbage or reset
//!   response head); the healthy ones must be exact, the faulty ones must
//!   end as SPEC.md says.
//! - `slow`: slow readers (one byte per 10 ms, a 4 KiB receive buffer) on
//!   upstreams that send as fast as they can; `serve`'s RSS is sampled and
//!   must stay under a stated bound ([`SLOW_STREAM_BOUND_KIB`]).
//! - `line`: one 1 GiB line with no newline through `annotate` and through
//!   `serve`, then several 64 MiB ones at once; output checked byte for
//!   byte, peak RSS (VmHWM) of the single line under 100 MiB.
//!
//! Before all that, [`self_check`] shows the checks catch what they look
//! for. Read [`check_stream`] first.
//!
//! Everything listens and connects on 127.0.0.1; every wait has a deadline
//! and the whole run has one. HTTP is written by hand (as in
//! `examples/loadgen.rs`): the upstream must be able to misbehave in ways a
//! real server library would not allow (a reset mid-body, a broken chunk
//! size), and the client must see exactly where a response ends.

use std::collections::HashMap;
use std::fmt::Write as _;
use std::io::{BufRead as _, Read as _, Write as _};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use clap::{Parser, ValueEnum};
use memchr::memmem;
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::{TcpListener, TcpSocket, TcpStream};
use tokio::sync::{Notify, watch};

#[path = "common/http.rs"]
mod http;

type Error = Box<dyn std::error::Error + Send + Sync>;

#[derive(Parser)]
#[command(about = "Bounded load test of aalis-proxy serve (issue 7); see scripts/loadtest.sh")]
struct Cli {
    /// The aalis-proxy binary under test.
    #[arg(long, default_value = "target/release/aalis-proxy")]
    aalis: PathBuf,
    /// Captures the `mock` phase replays (every .sse and .ndjson below it).
    #[arg(long, default_value = "fixtures")]
    fixtures: PathBuf,
    /// Where the logs of the child processes go.
    #[arg(long, default_value = "/tmp/aalis-loadtest")]
    workdir: PathBuf,
    /// Concurrent streams of the exact, mock and faults phases.
    #[arg(long, default_value_t = 1000)]
    streams: usize,
    /// Tool-call argument fragments per stream.
    #[arg(long, default_value_t = 40)]
    fragments: usize,
    /// Rounds of the exact phase run again in the same serve (field
    /// mode), to see what stays behind.
    #[arg(long, default_value_t = 3)]
    again: usize,
    /// Streams of the churn phase, 100 at a time.
    #[arg(long, default_value_t = 5000)]
    churn_streams: usize,
    /// Clients of the slow phase.
    #[arg(long, default_value_t = 100)]
    slow_readers: usize,
    /// How long the slow readers read.
    #[arg(long, default_value_t = 20)]
    slow_seconds: u64,
    /// Size of the line without a newline of the line phase, in MiB.
    #[arg(long, default_value_t = 1024)]
    line_mib: u64,
    /// Lines of 64 MiB sent through one serve at once, after the big one.
    #[arg(long, default_value_t = 8)]
    line_streams: usize,
    /// `--idle-timeout` of the faults phase's serve, in milliseconds.
    #[arg(long, default_value_t = 2000)]
    idle_timeout_ms: u64,
    /// Phases to run, in this order.
    #[arg(
        long,
        value_enum,
        value_delimiter = ',',
        default_value = "exact,churn,mock,faults,slow,line"
    )]
    only: Vec<Phase>,
    /// The whole run stops at this deadline (and fails).
    #[arg(long, default_value_t = 900)]
    max_seconds: u64,
    /// An extra argument for every `aalis-proxy serve` started (repeat for
    /// several), e.g. `--serve-arg=--session-ttl=1s`.
    #[arg(long = "serve-arg", allow_hyphen_values = true)]
    serve_args: Vec<String>,
    /// Worker threads of this tool (the upstream and every client).
    #[arg(long, default_value_t = 2)]
    threads: usize,
}

#[derive(Clone, Copy, PartialEq, Eq, Debug, ValueEnum)]
enum Phase {
    Exact,
    Churn,
    Mock,
    Faults,
    Slow,
    Line,
}

fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(cli.threads.max(1))
        .enable_all()
        .build();
    let runtime = match runtime {
        Ok(r) => r,
        Err(e) => {
            eprintln!("loadtest: error: cannot start the runtime: {e}");
            return std::process::ExitCode::FAILURE;
        }
    };
    let report = Arc::new(Report::default());
    let deadline = Duration::from_secs(cli.max_seconds);
    let result = runtime.block_on({
        let report = report.clone();
        async move {
            match tokio::time::timeout(deadline, run(cli, &report)).await {
                Ok(result) => result,
                Err(_) => Err(format!("the run passed its deadline of {deadline:?}").into()),
            }
        }
    });
    // Children are killed by their guards; connections die with the runtime.
    runtime.shutdown_timeout(Duration::from_secs(2));
    let failures = report.failures();
    match result {
        Err(e) => {
            eprintln!("loadtest: error: {e}");
            std::process::ExitCode::FAILURE
        }
        Ok(()) if !failures.is_empty() => {
            println!("\nFAILED: {} check(s):", failures.len());
            for failure in failures.iter().take(40) {
                println!("  - {failure}");
            }
            if failures.len() > 40 {
                println!("  … and {} more", failures.len() - 40);
            }
            std::process::ExitCode::FAILURE
        }
        Ok(()) => {
            println!("\nloadtest: every check passed");
            std::process::ExitCode::SUCCESS
        }
    }
}

async fn run(cli: Cli, report: &Arc<Report>) -> Result<(), Error> {
    std::fs::create_dir_all(&cli.workdir)
        .map_err(|e| format!("cannot create {}: {e}", cli.workdir.display()))?;
    if !cli.aalis.is_file() {
        return Err(format!(
            "{} does not exist; build it (scripts/loadtest.sh does)",
            cli.aalis.display()
        )
        .into());
    }
    // Each stream costs a descriptor here (client side and upstream side)
    // and two in serve, which inherits this limit.
    if cli.streams > 100_000 {
        // Stream keys of different rounds are 100,000 apart.
        return Err("at most 100,000 streams".into());
    }
    let needed = (2 * cli.streams.max(cli.slow_readers) + 256) as u64;
    let limit = open_files_limit()?;
    if limit < needed {
        return Err(format!(
            "the open-files limit is {limit}, {needed} are needed: raise it with `ulimit -n` \
             (scripts/loadtest.sh raises it to the hard limit)"
        )
        .into());
    }
    self_check()?;
    println!(
        "loadtest: {} streams, {} fragments each, {} slow readers for {} s, a {} MiB line; 127.0.0.1 only",
        cli.streams, cli.fragments, cli.slow_readers, cli.slow_seconds, cli.line_mib
    );
    for phase in &cli.only {
        let started = Instant::now();
        match phase {
            Phase::Exact => phase_exact(&cli, report).await?,
            Phase::Churn => phase_churn(&cli, report).await?,
            Phase::Mock => phase_mock(&cli, report).await?,
            Phase::Faults => phase_faults(&cli, report).await?,
            Phase::Slow => phase_slow(&cli, report).await?,
            Phase::Line => phase_line(&cli, report).await?,
        }
        println!(
            "  ({phase:?} took {:.1} s)",
            started.elapsed().as_secs_f64()
        );
    }
    Ok(())
}

/// Failed checks, gathered from every task.
#[derive(Default)]
struct Report {
    failures: Mutex<Vec<String>>,
    /// Gather without printing (the checker's self-test).
    quiet: bool,
}

/// Waits for every task of `tasks`, handing each result to `each`; a task
/// that panicked or was cancelled fails the run ("{what} task failed").
async fn each_joined<T: 'static>(
    tasks: &mut tokio::task::JoinSet<T>,
    report: &Report,
    what: &str,
    mut each: impl FnMut(T),
) {
    while let Some(joined) = tasks.join_next().await {
        match joined {
            Ok(done) => each(done),
            Err(e) => report.fail(format!("{what} task failed: {e}")),
        }
    }
}

impl Report {
    fn fail(&self, what: String) {
        if !self.quiet {
            println!("  FAIL {what}");
        }
        if let Ok(mut failures) = self.failures.lock() {
            failures.push(what);
        }
    }

    fn check(&self, ok: bool, what: impl FnOnce() -> String) {
        if !ok {
            self.fail(what());
        }
    }

    fn failures(&self) -> Vec<String> {
        self.failures.lock().map(|f| f.clone()).unwrap_or_default()
    }
}

// === /proc ===

/// Resident memory of a process, from `/proc/PID/status`.
#[derive(Debug, Clone, Copy, Default)]
struct Mem {
    rss_kib: u64,
    /// The high-water mark of RSS since the process started.
    hwm_kib: u64,
}

fn mem_of(pid: u32) -> Result<Mem, Error> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))
        .map_err(|e| format!("cannot read the memory of process {pid}: {e}"))?;
    let field = |name: &str| -> Option<u64> {
        let line = status.lines().find(|l| l.starts_with(name))?;
        line[name.len()..].split_whitespace().next()?.parse().ok()
    };
    Ok(Mem {
        rss_kib: field("VmRSS:").ok_or("no VmRSS in /proc/PID/status")?,
        hwm_kib: field("VmHWM:").ok_or("no VmHWM in /proc/PID/status")?,
    })
}

/// Kernel memory of all TCP sockets (buffers), in KiB: not in any RSS.
fn kernel_tcp_kib() -> u64 {
    let Ok(sockstat) = std::fs::read_to_string("/proc/net/sockstat") else {
        return 0;
    };
    let pages = sockstat
        .lines()
        .find(|l| l.starts_with("TCP:"))
        .and_then(|l| {
            let mut words = l.split_whitespace();
            words.find(|w| *w == "mem")?;
            words.next()?.parse::<u64>().ok()
        })
        .unwrap_or(0);
    pages * 4
}

/// What the kernel holds in the TCP sockets of process `pid` (receive and
/// send queues, `skmem` r + w as `ss -tmnp` reports them), in KiB; `None`
/// when `ss` is not there.
fn socket_kib_of(pid: u32) -> Option<u64> {
    let output = Command::new("ss").args(["-tmnpH"]).output().ok()?;
    if !output.status.success() {
        return None;
    }
    let text = String::from_utf8_lossy(&output.stdout);
    let owner = format!("pid={pid},");
    let mut total = 0u64;
    let mut lines = text.lines();
    while let Some(line) = lines.next() {
        if !line.contains(&owner) {
            continue;
        }
        // The next line is `skmem:(r…,rb…,t…,tb…,f…,w…,…)`.
        let Some(skmem) = lines.next().and_then(|l| l.split("skmem:(").nth(1)) else {
            continue;
        };
        for field in skmem.trim_end_matches([')', ' ']).split(',') {
            let value = |prefix: char| {
                field
                    .strip_prefix(prefix)
                    .filter(|v| v.bytes().all(|b| b.is_ascii_digit()))
                    .and_then(|v| v.parse::<u64>().ok())
            };
            total += value('r').or(value('w')).unwrap_or(0);
        }
    }
    Some(total / 1024)
}

fn open_files_limit() -> Result<u64, Error> {
    let limits = std::fs::read_to_string("/proc/self/limits")?;
    let line = limits
        .lines()
        .find(|l| l.starts_with("Max open files"))
        .ok_or("no open-files limit in /proc/self/limits")?;
    let soft = line["Max open files".len()..]
        .split_whitespace()
        .next()
        .ok_or("unreadable open-files limit")?;
    Ok(if soft == "unlimited" {
        u64::MAX
    } else {
        soft.parse()?
    })
}

fn mib(kib: u64) -> String {
    format!("{:.1} MiB", kib as f64 / 1024.0)
}

// === child processes ===

/// A running `aalis-proxy serve` or `mock`; killed when dropped.
struct Served {
    child: Child,
    addr: SocketAddr,
    log: PathBuf,
    /// Lines of its log at WARN level so far.
    warnings: Arc<AtomicU64>,
}

impl Served {
    /// Starts `aalis-proxy ARGS --listen 127.0.0.1:0` and waits for the
    /// address it bound (from its log), copying the log to WORKDIR/NAME.log.
    fn start(cli: &Cli, name: &str, args: &[String]) -> Result<Served, Error> {
        let log = cli.workdir.join(format!("{name}.log"));
        let mut log_file = std::fs::File::create(&log)
            .map_err(|e| format!("cannot create {}: {e}", log.display()))?;
        let extra: &[String] = if args.first().is_some_and(|a| a == "serve") {
            &cli.serve_args
        } else {
            &[]
        };
        let mut child = Command::new(&cli.aalis)
            .args(args)
            .args(extra)
            .args(["--listen", "127.0.0.1:0"])
            .env("RUST_LOG", "info")
            .env_remove("NO_COLOR")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|e| format!("cannot start {}: {e}", cli.aalis.display()))?;
        let stderr = child.stderr.take().ok_or("no stderr pipe")?;
        let warnings = Arc::new(AtomicU64::new(0));
        let (addr_tx, addr_rx) = std::sync::mpsc::channel();
        {
            let warnings = warnings.clone();
            // Drains the log for the child's whole life: a full pipe would
            // block it.
            std::thread::spawn(move || {
                let mut reader = std::io::BufReader::new(stderr);
                let mut line = Vec::new();
                let mut addr_tx = Some(addr_tx);
                loop {
                    line.clear();
                    match reader.read_until(b'\n', &mut line) {
                        Ok(0) | Err(_) => break,
                        Ok(_) => {}
                    }
                    let _ = log_file.write_all(&line);
                    let text = String::from_utf8_lossy(&line);
                    if text.contains(" WARN ") {
                        warnings.fetch_add(1, Ordering::Relaxed);
                    }
                    if let Some(addr) = listen_address(&text)
                        && let Some(tx) = addr_tx.take()
                    {
                        let _ = tx.send(addr);
                    }
                }
            });
        }
        let addr = match addr_rx.recv_timeout(Duration::from_secs(15)) {
            Ok(addr) => addr,
            Err(_) => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(format!(
                    "{name} did not say where it listens within 15 s; see {}",
                    log.display()
                )
                .into());
            }
        };
        Ok(Served {
            child,
            addr,
            log,
            warnings,
        })
    }

    fn pid(&self) -> u32 {
        self.child.id()
    }

    fn mem(&self) -> Result<Mem, Error> {
        mem_of(self.pid())
    }

    fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Reads a counter or gauge from `/_aalis/metrics` (sums labelled series).
    async fn metric(&self, name: &str) -> Option<u64> {
        let mut sink = Vec::new();
        let request = Request::get(self.addr, "/_aalis/metrics");
        let fetched = fetch(&request, &mut sink).await;
        if !fetched.complete {
            return None;
        }
        let text = String::from_utf8_lossy(&sink);
        let values: Vec<u64> = text
            .lines()
            .filter(|l| {
                l.strip_prefix(name)
                    .is_some_and(|rest| rest.starts_with(' ') || rest.starts_with('{'))
            })
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .map(|v| v as u64)
            .collect();
        (!values.is_empty()).then(|| values.iter().sum())
    }
}

impl Drop for Served {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The address in `listening on http://127.0.0.1:PORT, …` (serve) or
/// `mock upstream on http://127.0.0.1:PORT: …` (mock).
fn listen_address(line: &str) -> Option<SocketAddr> {
    if !line.contains("listening on http://") && !line.contains("mock upstream on http://") {
        return None;
    }
    let rest = &line[line.find("http://")? + 7..];
    let end = rest
        .find(|c: char| !(c.is_ascii_digit() || c == '.' || c == ':'))
        .unwrap_or(rest.len());
    rest[..end].trim_end_matches(':').parse().ok()
}

// === what the upstream sends ===

/// What an upstream response does (the `kind` of its request).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Kind {
    /// A whole stream: text, two tool calls, finish, usage, `[DONE]`.
    Normal,
    /// A whole stream with garbage events in the middle: broken JSON,
    /// invalid UTF-8, a line over `--max-event-bytes`, a junk field line, a
    /// wrong shape, a mid-stream `{"error":…}`.
    Garbage,
    /// Ends cleanly (terminal chunk) in the middle of an event.
    MidEvent,
    /// Sends up to the hold marker, waits until the client has it, then
    /// resets the connection (RST).
    Reset,
    /// Sends up to the hold marker, then a chunk size that is not hex.
    BadChunk,
    /// Sends up to the hold marker, then closes (FIN) without the terminal
    /// chunk.
    Eof,
    /// Sends up to the hold marker, then goes silent past `--idle-timeout`.
    Stall,
    /// Sends up to the hold marker and waits; its client goes away there.
    ClientGone,
    /// Answers with a head that is not HTTP.
    BadHead,
    /// Resets the connection before any response.
    ResetBeforeHead,
    /// Tool-call deltas as fast as the connection takes them (slow phase).
    Firehose,
    /// `data: ` and then `bytes` bytes with no line break (line phase).
    BigLine,
}

impl Kind {
    const ALL: [Kind; 12] = [
        Kind::Normal,
        Kind::Garbage,
        Kind::MidEvent,
        Kind::Reset,
        Kind::BadChunk,
        Kind::Eof,
        Kind::Stall,
        Kind::ClientGone,
        Kind::BadHead,
        Kind::ResetBeforeHead,
        Kind::Firehose,
        Kind::BigLine,
    ];

    /// The faults of the faults phase, in turn.
    const FAULTS: [Kind; 9] = [
        Kind::Reset,
        Kind::Garbage,
        Kind::Stall,
        Kind::ClientGone,
        Kind::BadChunk,
        Kind::Eof,
        Kind::MidEvent,
        Kind::BadHead,
        Kind::ResetBeforeHead,
    ];

    fn name(self) -> &'static str {
        match self {
            Kind::Normal => "normal",
            Kind::Garbage => "garbage",
            Kind::MidEvent => "mid-event",
            Kind::Reset => "reset",
            Kind::BadChunk => "bad-chunk",
            Kind::Eof => "eof",
            Kind::Stall => "stall",
            Kind::ClientGone => "client-gone",
            Kind::BadHead => "bad-head",
            Kind::ResetBeforeHead => "reset-before-head",
            Kind::Firehose => "firehose",
            Kind::BigLine => "big-line",
        }
    }

    fn parse(name: &str) -> Option<Kind> {
        Kind::ALL.into_iter().find(|k| k.name() == name)
    }

    /// The stream stops at its hold marker (the rest is never sent).
    fn stops_at_hold(self) -> bool {
        matches!(
            self,
            Kind::Reset | Kind::BadChunk | Kind::Eof | Kind::Stall | Kind::ClientGone
        )
    }
}

/// The events of one stream and the progress each must carry.
struct Script {
    /// The SSE events in order, each written as one HTTP chunk.
    events: Vec<Vec<u8>>,
    /// Per event, the progress `field` injection must add to it.
    progress: Vec<Vec<Value>>,
    /// Index of the hold-marker event (`: hold KEY;`).
    hold: usize,
}

impl Script {
    fn body(&self, upto: usize) -> Vec<u8> {
        self.events[..upto].concat()
    }

    fn progress(&self, upto: usize) -> Vec<Value> {
        self.progress[..upto].concat()
    }

    /// How many events the client should get.
    fn sent_events(&self, kind: Kind) -> usize {
        if kind.stops_at_hold() {
            self.hold + 1
        } else {
            self.events.len()
        }
    }
}

fn hold_marker(key: u64) -> String {
    // `;` ends it, so key 1's marker is not a prefix of key 12's.
    format!(": hold {key};")
}

/// Builds a script event by event, tracking what progress each tool-call
/// entry must produce (SPEC.md: one per entry, after it is applied,
/// `charsAccumulated` in UTF-16 code units).
struct ScriptBuilder {
    key: u64,
    line_end: &'static str,
    script: Script,
    /// Per tool index: its name and the UTF-16 length of its arguments.
    calls: Vec<(String, usize)>,
}

/// One entry of a `delta.tool_calls` list.
enum Entry {
    /// The first delta of call `index`: id, name, empty arguments.
    Announce(usize),
    /// An arguments fragment for call `index`.
    Args(usize, String),
}

impl ScriptBuilder {
    fn new(key: u64) -> ScriptBuilder {
        ScriptBuilder {
            key,
            // A quarter of the streams use CRLF: injected bytes must follow.
            line_end: if key % 4 == 3 { "\r\n" } else { "\n" },
            script: Script {
                events: Vec::new(),
                progress: Vec::new(),
                hold: 0,
            },
            calls: Vec::new(),
        }
    }

    fn raw(&mut self, bytes: &[u8], progress: Vec<Value>) {
        self.script.events.push(bytes.to_vec());
        self.script.progress.push(progress);
    }

    fn data(&mut self, data: &[u8], progress: Vec<Value>) {
        let mut event = b"data: ".to_vec();
        event.extend_from_slice(data);
        event.extend_from_slice(self.line_end.as_bytes());
        event.extend_from_slice(self.line_end.as_bytes());
        self.raw(&event, progress);
    }

    fn chunk(&mut self, delta: Value, finish_reason: Value, progress: Vec<Value>) {
        let key = self.key;
        let chunk = json!({
            "id": format!("chatcmpl-{key}"),
            "object": "chat.completion.chunk",
            "created": 1_700_000_000 + key,
            "model": "loadtest",
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason}],
        });
        self.data(chunk.to_string().as_bytes(), progress);
    }

    fn content(&mut self, text: &str) {
        self.chunk(json!({"content": text}), Value::Null, Vec::new());
    }

    fn tool_calls(&mut self, entries: &[Entry]) {
        let key = self.key;
        let mut list = Vec::new();
        let mut progress = Vec::new();
        for entry in entries {
            let index = match entry {
                Entry::Announce(index) => {
                    let name = format!("tool_{key}_{index}");
                    list.push(json!({
                        "index": index,
                        "id": format!("call_{key}_{index}"),
                        "type": "function",
                        "function": {"name": name, "arguments": ""},
                    }));
                    if self.calls.len() <= *index {
                        self.calls.resize(*index + 1, (String::new(), 0));
                    }
                    self.calls[*index] = (name, 0);
                    *index
                }
                Entry::Args(index, text) => {
                    list.push(json!({"index": index, "function": {"arguments": text}}));
                    if let Some(call) = self.calls.get_mut(*index) {
                        call.1 += text.encode_utf16().count();
                    }
                    *index
                }
            };
            let (name, chars) = self.calls.get(index).cloned().unwrap_or_default();
            progress.push(json!({"index": index, "name": name, "charsAccumulated": chars}));
        }
        self.chunk(json!({"tool_calls": list}), Value::Null, progress);
    }

    fn hold(&mut self) {
        self.script.hold = self.script.events.len();
        let marker = hold_marker(self.key);
        let event = format!("{marker}{le}{le}", le = self.line_end);
        self.raw(event.as_bytes(), Vec::new());
    }

    fn garbage(&mut self, huge_bytes: usize) {
        let le = self.line_end;
        // Broken JSON.
        self.data(
            br#"{"choices":[{"index":0,"delta":{"content":"broken"#,
            Vec::new(),
        );
        // Invalid UTF-8 (a lone continuation byte, a bad sequence).
        self.data(b"\xff\xfe\x80 not UTF-8 \xc3\x28", Vec::new());
        // A line over --max-event-bytes: passed on unparsed.
        let mut huge = vec![b'x'; huge_bytes];
        huge.splice(0..0, *b"{\"huge\":\"");
        self.data(&huge, Vec::new());
        // A field line that is not `data:`, with control bytes.
        self.raw(
            format!("\u{1}junk field\u{0}{le}{le}").as_bytes(),
            Vec::new(),
        );
        // A chunk of an unexpected shape.
        self.data(
            br#"{"choices":[{"index":0,"delta":{"tool_calls":"not a list"}}]}"#,
            Vec::new(),
        );
        // An error object mid-stream: passed on, tracking goes on.
        self.data(br#"{"error":{"message":"a mid-stream error"}}"#, Vec::new());
    }

    fn finish(mut self) -> Script {
        let key = self.key;
        self.chunk(json!({}), json!("tool_calls"), Vec::new());
        let usage = json!({
            "id": format!("chatcmpl-{key}"),
            "object": "chat.completion.chunk",
            "created": 1_700_000_000 + key,
            "model": "loadtest",
            "choices": [],
            "usage": {"prompt_tokens": key % 1000, "completion_tokens": 7, "total_tokens": key % 1000 + 7},
        });
        self.data(usage.to_string().as_bytes(), Vec::new());
        self.data(b"[DONE]", Vec::new());
        self.script
    }
}

/// An arguments fragment of stream `key`: JSON-looking text with quotes,
/// a backslash and characters outside the BMP (UTF-16 counting).
fn fragment(key: u64, i: usize) -> String {
    format!("{{\"stream\":{key},\"part\":{i},\"text\":\"é😀 \\\\ \\\"q\\\"\"}} ")
}

/// The script of stream `key` of the given kind.
fn script(key: u64, kind: Kind, fragments: usize, huge_bytes: usize) -> Script {
    let fragments = fragments.max(6);
    let mut s = ScriptBuilder::new(key);
    s.chunk(
        json!({"role": "assistant", "content": ""}),
        Value::Null,
        Vec::new(),
    );
    for i in 0..2 {
        s.content(&format!("stream {key} says {i}: é😀 \"quoted\"\n"));
    }
    s.tool_calls(&[Entry::Announce(0)]);
    s.tool_calls(&[Entry::Args(0, fragment(key, 0)), Entry::Announce(1)]);
    for i in 1..=fragments {
        if i == fragments / 2 {
            s.hold();
            if kind == Kind::Garbage {
                s.garbage(huge_bytes);
            }
        }
        s.tool_calls(&[Entry::Args(i % 2, fragment(key, i))]);
        if kind == Kind::MidEvent && i == fragments / 2 + 2 {
            let cut = format!(
                "data: {{\"id\":\"chatcmpl-{key}\",\"choices\":[{{\"index\":0,\"delta\":{{\"content\":\"cut he"
            );
            s.raw(cut.as_bytes(), Vec::new());
            return s.script;
        }
    }
    s.finish()
}

/// Event `i` of a firehose stream (slow phase): a role chunk, a tool
/// announcement, then ~1 KiB argument fragments; always LF.
fn firehose_event(key: u64, i: u64) -> Vec<u8> {
    let delta = match i {
        0 => r#"{"role":"assistant","content":""}"#.to_owned(),
        1 => format!(
            r#"{{"tool_calls":[{{"index":0,"id":"call_{key}","type":"function","function":{{"name":"fire_{key}","arguments":""}}}}]}}"#
        ),
        // Built by hand, not with serde_json: the upstream writes these as
        // fast as the connection takes them, even in a debug build.
        _ => format!(
            r#"{{"tool_calls":[{{"index":0,"function":{{"arguments":"[{key}:{i}] {}"}}}}]}}"#,
            *FILLER
        ),
    };
    format!(
        "data: {{\"id\":\"chatcmpl-{key}\",\"object\":\"chat.completion.chunk\",\"choices\":[{{\"index\":0,\"delta\":{delta},\"finish_reason\":null}}]}}\n\n"
    )
    .into_bytes()
}

/// About 1 KiB of argument text for firehose events: 28 times the
/// alphabet and the digits, space-separated (1,035 bytes).
static FILLER: std::sync::LazyLock<String> =
    std::sync::LazyLock::new(|| ["abcdefghijklmnopqrstuvwxyz0123456789"; 28].join(" "));

/// The bytes of the line phase: position `i` of the line holds
/// `PATTERN[i % PERIOD]`, any byte but CR and LF. A prime period, so a
/// shifted or repeated piece shows.
struct Pattern {
    /// The period repeated past `PIECE` bytes, so any piece is one slice.
    bytes: Vec<u8>,
}

impl Pattern {
    const PERIOD: usize = 4093;
    const PIECE: usize = 256 * 1024;

    fn new() -> Pattern {
        let mut state: u32 = 0x2545_f491;
        let period: Vec<u8> = (0..Self::PERIOD)
            .map(|_| {
                state ^= state << 13;
                state ^= state >> 17;
                state ^= state << 5;
                match (state >> 24) as u8 {
                    b'\r' | b'\n' => b'.',
                    b => b,
                }
            })
            .collect();
        let bytes = period
            .iter()
            .copied()
            .cycle()
            .take(Self::PIECE + Self::PERIOD)
            .collect();
        Pattern { bytes }
    }

    /// `len` (at most PIECE) bytes of the line from `offset`.
    fn piece(&self, offset: u64, len: usize) -> &[u8] {
        let at = (offset % Self::PERIOD as u64) as usize;
        &self.bytes[at..at + len]
    }
}

// === the upstream ===

/// What the upstream and the clients of one phase share.
struct Coord {
    /// Streams whose client has seen its hold marker.
    reached: AtomicUsize,
    /// Set when the held streams may go on.
    release: watch::Sender<bool>,
    /// Per stream key: its client saw the hold marker.
    seen: Mutex<HashMap<u64, Arc<Notify>>>,
    /// Per stream key: what the upstream did.
    upstream: Mutex<HashMap<u64, UpstreamRecord>>,
}

#[derive(Debug, Default, Clone)]
struct UpstreamRecord {
    /// Requests that arrived for this key (must be 1: no retry, no copy).
    requests: u32,
    /// Body bytes written (before chunked framing).
    body_bytes: u64,
    /// Stall: how long after the stall began serve closed the connection.
    closed_after_stall: Option<Duration>,
    /// Stall: when the upstream wrote its last byte.
    stall_began: Option<Instant>,
    /// Firehose: the write that failed ended the stream (the client went).
    ended_by_peer: bool,
}

impl Coord {
    fn new() -> Arc<Coord> {
        Arc::new(Coord {
            reached: AtomicUsize::new(0),
            release: watch::channel(false).0,
            seen: Mutex::new(HashMap::new()),
            upstream: Mutex::new(HashMap::new()),
        })
    }

    /// A new round: nobody has reached the hold point, nobody is released.
    fn reset(&self) {
        self.reached.store(0, Ordering::Relaxed);
        self.release.send_replace(false);
    }

    fn seen_signal(&self, key: u64) -> Arc<Notify> {
        match self.seen.lock() {
            Ok(mut seen) => seen.entry(key).or_default().clone(),
            Err(_) => Arc::new(Notify::new()),
        }
    }

    fn client_reached_hold(&self, key: u64) {
        self.reached.fetch_add(1, Ordering::Relaxed);
        // notify_one stores a permit when the upstream is not waiting yet.
        self.seen_signal(key).notify_one();
    }

    fn record(&self, key: u64, f: impl FnOnce(&mut UpstreamRecord)) {
        if let Ok(mut map) = self.upstream.lock() {
            f(map.entry(key).or_default());
        }
    }

    fn upstream_record(&self, key: u64) -> UpstreamRecord {
        self.upstream
            .lock()
            .ok()
            .and_then(|m| m.get(&key).cloned())
            .unwrap_or_default()
    }
}

/// How a stream waits at its hold marker.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Hold {
    /// It does not.
    None,
    /// Until the phase releases every stream at once.
    Global,
    /// Until its own client has the marker.
    Signal,
}

/// The parameters of one upstream request, from its query string.
#[derive(Debug, Clone)]
struct Plan {
    key: u64,
    kind: Kind,
    fragments: usize,
    hold: Hold,
    /// Garbage: size of the oversized line. BigLine: size of the line.
    bytes: u64,
    /// Stall: how long to stay silent at most.
    stall: Duration,
    /// The client names its session (`X-Aalis-Session`); otherwise serve
    /// generates one.
    named: bool,
}

impl Plan {
    fn query(&self) -> String {
        let hold = match self.hold {
            Hold::None => "none",
            Hold::Global => "global",
            Hold::Signal => "signal",
        };
        format!(
            "key={}&kind={}&fragments={}&hold={hold}&bytes={}&stall_ms={}",
            self.key,
            self.kind.name(),
            self.fragments,
            self.bytes,
            self.stall.as_millis()
        )
    }

    fn parse(target: &str) -> Result<Plan, Error> {
        let query = target.split_once('?').map_or("", |(_, q)| q);
        let params: HashMap<&str, &str> = query
            .split('&')
            .filter_map(|kv| kv.split_once('='))
            .collect();
        let number = |name: &str| -> Result<u64, Error> {
            let value = params.get(name).ok_or(format!("no {name} in {target}"))?;
            Ok(value.parse()?)
        };
        let kind = params.get("kind").copied().unwrap_or("");
        Ok(Plan {
            key: number("key")?,
            kind: Kind::parse(kind).ok_or(format!("unknown kind {kind:?}"))?,
            fragments: number("fragments")? as usize,
            hold: match params.get("hold").copied() {
                Some("global") => Hold::Global,
                Some("signal") => Hold::Signal,
                _ => Hold::None,
            },
            bytes: number("bytes")?,
            stall: Duration::from_millis(number("stall_ms")?),
            named: true,
        })
    }
}

/// The in-process upstream of one phase; stops when dropped.
struct Upstream {
    addr: SocketAddr,
    task: tokio::task::JoinHandle<()>,
}

impl Upstream {
    async fn start(coord: Arc<Coord>) -> Result<Upstream, Error> {
        let socket = TcpSocket::new_v4()?;
        socket.set_reuseaddr(true)?;
        socket.bind("127.0.0.1:0".parse()?)?;
        // A deep accept queue: serve opens its upstream connections all at once.
        let listener: TcpListener = socket.listen(4096)?;
        let addr = listener.local_addr()?;
        let task = tokio::spawn(async move {
            let mut connections = tokio::task::JoinSet::new();
            loop {
                let Ok((socket, _)) = listener.accept().await else {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                    continue;
                };
                let coord = coord.clone();
                connections.spawn(async move {
                    let _ = upstream_connection(socket, coord).await;
                });
                while connections.try_join_next().is_some() {}
            }
        });
        Ok(Upstream { addr, task })
    }

    fn url(&self) -> String {
        format!("http://{}", self.addr)
    }
}

impl Drop for Upstream {
    fn drop(&mut self) {
        // Aborting the accept task drops its JoinSet: every connection ends.
        self.task.abort();
    }
}

/// What to do with the connection after a response.
enum After {
    KeepAlive,
    Close,
}

async fn upstream_connection(socket: TcpStream, coord: Arc<Coord>) -> Result<(), Error> {
    socket.set_nodelay(true)?;
    let mut socket = BufReader::new(socket);
    loop {
        let Some(target) = http::read_request(&mut socket).await? else {
            return Ok(());
        };
        let plan = Plan::parse(&target)?;
        coord.record(plan.key, |r| r.requests += 1);
        match respond(&mut socket, &plan, &coord).await? {
            After::KeepAlive => {}
            After::Close => return Ok(()),
        }
    }
}

const STREAM_HEAD: &[u8] = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n\
      cache-control: no-cache\r\ntransfer-encoding: chunked\r\n\r\n";

async fn write_chunk(
    socket: &mut TcpStream,
    scratch: &mut Vec<u8>,
    data: &[u8],
) -> Result<(), Error> {
    scratch.clear();
    write!(scratch, "{:x}\r\n", data.len())?;
    scratch.extend_from_slice(data);
    scratch.extend_from_slice(b"\r\n");
    socket.write_all(scratch).await?;
    Ok(())
}

/// Writes one response as the plan says.
async fn respond(
    reader: &mut BufReader<TcpStream>,
    plan: &Plan,
    coord: &Coord,
) -> Result<After, Error> {
    let key = plan.key;
    let mut scratch = Vec::with_capacity(64 * 1024);
    match plan.kind {
        Kind::BadHead => {
            reader
                .get_mut()
                .write_all(b"garbage \x00\xff\r\n\r\n")
                .await?;
            return Ok(After::Close);
        }
        Kind::ResetBeforeHead => {
            reader.get_ref().set_zero_linger()?;
            return Ok(After::Close);
        }
        Kind::Firehose => {
            reader.get_mut().write_all(STREAM_HEAD).await?;
            // Bounded: 256 MiB, or until serve closes (its client went).
            let mut written = 0u64;
            for i in 0.. {
                let event = firehose_event(key, i);
                if write_chunk(reader.get_mut(), &mut scratch, &event)
                    .await
                    .is_err()
                {
                    coord.record(key, |r| r.ended_by_peer = true);
                    break;
                }
                written += event.len() as u64;
                coord.record(key, |r| r.body_bytes = written);
                if written > 256 << 20 {
                    break;
                }
            }
            return Ok(After::Close);
        }
        Kind::BigLine => {
            let pattern = Pattern::new();
            reader.get_mut().write_all(STREAM_HEAD).await?;
            write_chunk(reader.get_mut(), &mut scratch, b"data: ").await?;
            let mut offset = 0u64;
            while offset < plan.bytes {
                let len = (plan.bytes - offset).min(Pattern::PIECE as u64) as usize;
                write_chunk(reader.get_mut(), &mut scratch, pattern.piece(offset, len)).await?;
                offset += len as u64;
            }
            reader.get_mut().write_all(b"0\r\n\r\n").await?;
            coord.record(key, |r| r.body_bytes = offset + 6);
            return Ok(After::KeepAlive);
        }
        _ => {}
    }
    let script = script(key, plan.kind, plan.fragments, plan.bytes as usize);
    reader.get_mut().write_all(STREAM_HEAD).await?;
    let mut written = 0u64;
    for (i, event) in script.events.iter().enumerate() {
        write_chunk(reader.get_mut(), &mut scratch, event).await?;
        written += event.len() as u64;
        coord.record(key, |r| r.body_bytes = written);
        if i != script.hold {
            continue;
        }
        let wait = Duration::from_secs(120);
        match plan.hold {
            Hold::None => {}
            Hold::Global => {
                let mut release = coord.release.subscribe();
                let _ = tokio::time::timeout(wait, release.wait_for(|r| *r)).await;
            }
            Hold::Signal => {
                let seen = coord.seen_signal(key);
                let _ = tokio::time::timeout(wait, seen.notified()).await;
            }
        }
        match plan.kind {
            Kind::Reset => {
                // SO_LINGER 0: close sends RST, not FIN.
                reader.get_ref().set_zero_linger()?;
                return Ok(After::Close);
            }
            Kind::BadChunk => {
                reader.get_mut().write_all(b"zz\r\nnot hex\r\n").await?;
                return Ok(After::Close);
            }
            Kind::Eof => {
                reader.get_mut().shutdown().await?;
                return Ok(After::Close);
            }
            Kind::Stall | Kind::ClientGone => {
                // Silent until serve gives up on us (its idle timeout) or
                // the stall's bound; a read returns when serve closes.
                let started = Instant::now();
                coord.record(key, |r| r.stall_began = Some(started));
                let mut probe = [0u8; 1];
                let probed = tokio::time::timeout(plan.stall, reader.read(&mut probe)).await;
                // EOF or an error: serve closed it.
                if probed.is_ok() {
                    let after = started.elapsed();
                    coord.record(key, |r| r.closed_after_stall = Some(after));
                }
                return Ok(After::Close);
            }
            _ => {}
        }
    }
    reader.get_mut().write_all(b"0\r\n\r\n").await?;
    Ok(After::KeepAlive)
}

// === the client ===

/// One request to send.
struct Request {
    target: SocketAddr,
    method: &'static str,
    path: String,
    headers: Vec<(String, String)>,
    body: Vec<u8>,
    /// SO_RCVBUF before connecting (slow readers).
    recv_buffer: Option<u32>,
    /// Read one byte per this interval, for at most the given time.
    slow: Option<(Duration, Duration)>,
    deadline: Duration,
}

impl Request {
    fn get(target: SocketAddr, path: &str) -> Request {
        Request {
            target,
            method: "GET",
            path: path.to_owned(),
            headers: Vec::new(),
            body: Vec::new(),
            recv_buffer: None,
            slow: None,
            deadline: Duration::from_secs(10),
        }
    }

    /// A chat request for `plan` through the proxy at `target`.
    fn chat(target: SocketAddr, plan: &Plan, inject: Option<&str>) -> Request {
        let mut headers = vec![
            ("content-type".to_owned(), "application/json".to_owned()),
            ("accept".to_owned(), "text/event-stream".to_owned()),
        ];
        if plan.named {
            headers.push(("x-aalis-session".to_owned(), session_of(plan.key)));
        }
        if let Some(mode) = inject {
            headers.push(("x-aalis-inject".to_owned(), mode.to_owned()));
        }
        Request {
            target,
            method: "POST",
            path: format!("/v1/chat/completions?{}", plan.query()),
            headers,
            body: br#"{"model":"loadtest","stream":true}"#.to_vec(),
            recv_buffer: None,
            slow: None,
            deadline: Duration::from_secs(120),
        }
    }

    fn bytes(&self) -> Vec<u8> {
        let mut out = format!(
            "{} {} HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-length: {}\r\n",
            self.method,
            self.path,
            self.body.len()
        );
        for (name, value) in &self.headers {
            let _ = write!(out, "{name}: {value}\r\n");
        }
        out.push_str("\r\n");
        let mut bytes = out.into_bytes();
        bytes.extend_from_slice(&self.body);
        bytes
    }
}

fn session_of(key: u64) -> String {
    format!("lt-{key}")
}

/// Where the decoded body goes.
trait BodySink: Send {
    fn data(&mut self, bytes: &[u8]);

    /// The client should go away now.
    fn stop(&self) -> bool {
        false
    }
}

impl BodySink for Vec<u8> {
    fn data(&mut self, bytes: &[u8]) {
        self.extend_from_slice(bytes);
    }
}

/// Keeps the body and calls back once when `marker` appears in it.
struct MarkerSink<'a> {
    body: Vec<u8>,
    marker: Vec<u8>,
    /// Where to search from next (the marker may straddle two reads).
    searched: usize,
    on_marker: Option<Box<dyn FnOnce() + Send + 'a>>,
    /// Close the connection once the marker is in.
    leave_at_marker: bool,
}

impl BodySink for MarkerSink<'_> {
    fn stop(&self) -> bool {
        self.leave_at_marker && self.on_marker.is_none()
    }

    fn data(&mut self, bytes: &[u8]) {
        self.body.extend_from_slice(bytes);
        if self.on_marker.is_some() {
            if memmem::find(&self.body[self.searched..], &self.marker).is_some() {
                if let Some(f) = self.on_marker.take() {
                    f();
                }
            } else {
                self.searched = self.body.len().saturating_sub(self.marker.len());
            }
        }
    }
}

/// Checks the line phase's output against the pattern without keeping it.
struct PatternSink<'a> {
    pattern: &'a Pattern,
    /// Bytes of the `data: ` prefix still expected.
    prefix_left: &'static [u8],
    /// Line bytes seen so far.
    offset: u64,
    total: u64,
    mismatch: Option<u64>,
}

impl<'a> PatternSink<'a> {
    fn new(pattern: &'a Pattern) -> PatternSink<'a> {
        PatternSink {
            pattern,
            prefix_left: b"data: ",
            offset: 0,
            total: 0,
            mismatch: None,
        }
    }
}

impl BodySink for PatternSink<'_> {
    fn data(&mut self, mut bytes: &[u8]) {
        self.total += bytes.len() as u64;
        if self.mismatch.is_some() {
            return;
        }
        let n = self.prefix_left.len().min(bytes.len());
        if bytes[..n] != self.prefix_left[..n] {
            self.mismatch = Some(self.total - bytes.len() as u64);
            return;
        }
        self.prefix_left = &self.prefix_left[n..];
        bytes = &bytes[n..];
        while !bytes.is_empty() {
            let len = bytes.len().min(Pattern::PIECE);
            if bytes[..len] != *self.pattern.piece(self.offset, len) {
                let at = (0..len)
                    .find(|&i| bytes[i] != self.pattern.piece(self.offset + i as u64, 1)[0])
                    .unwrap_or(0);
                self.mismatch = Some(self.offset + at as u64 + 6);
                return;
            }
            self.offset += len as u64;
            bytes = &bytes[len..];
        }
    }
}

/// The response head.
#[derive(Debug, Clone, Default)]
struct Head {
    status: u16,
    headers: Vec<(String, String)>,
}

impl Head {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }
}

/// How a response went.
#[derive(Debug, Default)]
struct Fetched {
    head: Option<Head>,
    /// The body ended as HTTP says it ends (terminal chunk, length).
    complete: bool,
    /// Why it ended otherwise: `closed` (EOF before the end), a read error,
    /// `deadline`.
    error: Option<String>,
    /// When the response ended (as this client saw it).
    ended: Option<Instant>,
}

/// Decodes an HTTP/1.1 response as it arrives.
struct ResponseParser {
    pending: Vec<u8>,
    head: Option<Head>,
    state: BodyState,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum BodyState {
    Head,
    ChunkSize,
    ChunkData(usize),
    ChunkEnd,
    Trailers,
    Length(u64),
    UntilClose,
    Done,
}

impl ResponseParser {
    fn new() -> ResponseParser {
        ResponseParser {
            pending: Vec::new(),
            head: None,
            state: BodyState::Head,
        }
    }

    /// Adds bytes; body bytes go to `sink`.
    fn feed(&mut self, input: &[u8], sink: &mut dyn BodySink) -> Result<(), String> {
        // Data of a chunk or a plain body goes straight through.
        let mut input = input;
        if self.pending.is_empty() {
            match self.state {
                BodyState::ChunkData(n) => {
                    let take = n.min(input.len());
                    sink.data(&input[..take]);
                    input = &input[take..];
                    self.state = if take == n {
                        BodyState::ChunkEnd
                    } else {
                        BodyState::ChunkData(n - take)
                    };
                }
                BodyState::UntilClose => {
                    sink.data(input);
                    return Ok(());
                }
                _ => {}
            }
        }
        self.pending.extend_from_slice(input);
        let mut at = 0;
        loop {
            let rest = &self.pending[at..];
            match self.state {
                BodyState::Head => {
                    let Some(end) = memmem::find(rest, b"\r\n\r\n") else {
                        break;
                    };
                    let head = parse_head(&rest[..end])?;
                    let chunked = head
                        .header("transfer-encoding")
                        .is_some_and(|v| v.eq_ignore_ascii_case("chunked"));
                    let length = head.header("content-length").and_then(|v| v.parse().ok());
                    self.state = match (chunked, length) {
                        (true, _) => BodyState::ChunkSize,
                        (false, Some(0)) => BodyState::Done,
                        (false, Some(n)) => BodyState::Length(n),
                        (false, None) => BodyState::UntilClose,
                    };
                    self.head = Some(head);
                    at += end + 4;
                }
                BodyState::ChunkSize => {
                    let Some(eol) = memmem::find(rest, b"\r\n") else {
                        break;
                    };
                    let text = std::str::from_utf8(&rest[..eol]).map_err(|e| e.to_string())?;
                    let text = text.split(';').next().unwrap_or("").trim();
                    let size = usize::from_str_radix(text, 16)
                        .map_err(|_| format!("bad chunk size {text:?}"))?;
                    at += eol + 2;
                    self.state = if size == 0 {
                        BodyState::Trailers
                    } else {
                        BodyState::ChunkData(size)
                    };
                }
                BodyState::ChunkData(n) => {
                    if rest.is_empty() {
                        break;
                    }
                    let take = n.min(rest.len());
                    sink.data(&rest[..take]);
                    at += take;
                    self.state = if take == n {
                        BodyState::ChunkEnd
                    } else {
                        BodyState::ChunkData(n - take)
                    };
                }
                BodyState::ChunkEnd => {
                    if rest.len() < 2 {
                        break;
                    }
                    if &rest[..2] != b"\r\n" {
                        return Err("a chunk does not end with CRLF".to_owned());
                    }
                    at += 2;
                    self.state = BodyState::ChunkSize;
                }
                BodyState::Trailers => {
                    let Some(eol) = memmem::find(rest, b"\r\n") else {
                        break;
                    };
                    at += eol + 2;
                    if eol == 0 {
                        self.state = BodyState::Done;
                    }
                }
                BodyState::Length(n) => {
                    if rest.is_empty() {
                        break;
                    }
                    let take = (n.min(rest.len() as u64)) as usize;
                    sink.data(&rest[..take]);
                    at += take;
                    self.state = if take as u64 == n {
                        BodyState::Done
                    } else {
                        BodyState::Length(n - take as u64)
                    };
                }
                BodyState::UntilClose => {
                    sink.data(rest);
                    at = self.pending.len();
                    break;
                }
                BodyState::Done => break,
            }
        }
        self.pending.drain(..at);
        Ok(())
    }
}

fn parse_head(head: &[u8]) -> Result<Head, String> {
    let text = String::from_utf8_lossy(head);
    let mut lines = text.split("\r\n");
    let status_line = lines.next().unwrap_or("");
    let status = status_line
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| format!("bad status line {status_line:?}"))?;
    let headers = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(n, v)| (n.trim().to_owned(), v.trim().to_owned()))
        .collect();
    Ok(Head { status, headers })
}

/// Sends a request and reads its response into `sink`, as fast as it comes
/// or (slow readers) one byte per interval.
async fn fetch(request: &Request, sink: &mut dyn BodySink) -> Fetched {
    let mut fetched = Fetched::default();
    let deadline = tokio::time::Instant::now() + request.deadline;
    let result = tokio::time::timeout_at(deadline, fetch_inner(request, sink, &mut fetched)).await;
    match result {
        Ok(Ok(())) => {}
        Ok(Err(e)) => fetched.error = Some(e),
        Err(_) => fetched.error = Some("deadline".to_owned()),
    }
    fetched.ended.get_or_insert_with(Instant::now);
    fetched
}

async fn fetch_inner(
    request: &Request,
    sink: &mut dyn BodySink,
    fetched: &mut Fetched,
) -> Result<(), String> {
    if !request.target.ip().is_loopback() {
        return Err("loopback only".to_owned());
    }
    let socket = TcpSocket::new_v4().map_err(|e| e.to_string())?;
    if let Some(size) = request.recv_buffer {
        socket
            .set_recv_buffer_size(size)
            .map_err(|e| e.to_string())?;
    }
    let mut stream = socket
        .connect(request.target)
        .await
        .map_err(|e| format!("connect: {e}"))?;
    stream.set_nodelay(true).map_err(|e| e.to_string())?;
    stream
        .write_all(&request.bytes())
        .await
        .map_err(|e| format!("write: {e}"))?;
    let mut parser = ResponseParser::new();
    let mut buf = vec![0u8; 64 * 1024];
    let slow = request.slow.map(|(interval, duration)| {
        let mut ticker = tokio::time::interval(interval);
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        (ticker, Instant::now() + duration)
    });
    let mut slow = slow;
    loop {
        let want = match slow.as_mut() {
            Some((ticker, until)) => {
                if Instant::now() >= *until {
                    // A slow reader stops here: not an error.
                    fetched.head = parser.head.clone();
                    return Ok(());
                }
                ticker.tick().await;
                1
            }
            None => buf.len(),
        };
        let n = match stream.read(&mut buf[..want]).await {
            Ok(n) => n,
            Err(e) => {
                fetched.head = parser.head.clone();
                fetched.ended = Some(Instant::now());
                return Err(format!("read: {e}"));
            }
        };
        if n == 0 {
            fetched.head = parser.head.clone();
            fetched.ended = Some(Instant::now());
            if parser.state == BodyState::UntilClose {
                fetched.complete = true;
                return Ok(());
            }
            return Err("closed".to_owned());
        }
        parser.feed(&buf[..n], sink)?;
        if sink.stop() {
            // Leaving: dropping the socket closes the connection.
            fetched.head = parser.head.clone();
            fetched.ended = Some(Instant::now());
            return Ok(());
        }
        if parser.state == BodyState::Done {
            fetched.head = parser.head.clone();
            fetched.complete = true;
            fetched.ended = Some(Instant::now());
            return Ok(());
        }
    }
}

// === checking what came back ===

/// The body with every injected `toolCallProgress` member (and the
/// `toolCallsProgress` list before it) removed, and the progress objects
/// they carried, in order.
///
/// `field` mode inserts `,"toolCallsProgress":[…],"toolCallProgress":{…}`
/// (the list only when one chunk updated several calls) right before the
/// chunk's closing brace (SPEC.md, "Injection"); the streams sent never
/// contain `"toolCall`, so every occurrence must be such a member, and each
/// must be followed by that `}`.
fn strip_injected(body: &[u8]) -> Result<(Vec<u8>, Vec<Value>), String> {
    const ONE: &[u8] = b"\"toolCallProgress\":";
    const LIST: &[u8] = b"\"toolCallsProgress\":";
    let finder = memmem::Finder::new(b"\"toolCall");
    let mut out = Vec::with_capacity(body.len());
    let mut progress = Vec::new();
    let mut at = 0;
    while let Some(found) = finder.find(&body[at..]) {
        let key_at = at + found;
        let start = match key_at.checked_sub(1).map(|i| body[i]) {
            Some(b',') => key_at - 1,
            Some(b'{') => key_at,
            _ => {
                return Err(format!(
                    "byte {key_at}: \"toolCall… is not an injected member"
                ));
            }
        };
        let mut pos = key_at;
        let mut list = None;
        if body[pos..].starts_with(LIST) {
            let (value, end) = json_value_at(body, pos + LIST.len())?;
            list = Some(value);
            pos = end;
            if body.get(pos) != Some(&b',') {
                return Err(format!("byte {pos}: no toolCallProgress after the list"));
            }
            pos += 1;
        }
        if !body[pos..].starts_with(ONE) {
            return Err(format!("byte {pos}: not a toolCallProgress member"));
        }
        let (last, end) = json_value_at(body, pos + ONE.len())?;
        pos = end;
        // The brace must close the chunk itself, not an object inside it
        // (SPEC.md: never inside `delta`): the line ends right after it.
        let line_ends = matches!(body.get(pos + 1), None | Some(b'\n' | b'\r'));
        if body.get(pos) != Some(&b'}') || !line_ends {
            return Err(format!(
                "byte {pos}: the injected member is not right before the chunk's closing brace"
            ));
        }
        match list {
            Some(Value::Array(items)) => {
                if items.last() != Some(&last) {
                    return Err(format!(
                        "byte {key_at}: toolCallProgress is not the last of toolCallsProgress"
                    ));
                }
                progress.extend(items);
            }
            Some(other) => return Err(format!("byte {key_at}: toolCallsProgress is {other}")),
            None => progress.push(last),
        }
        out.extend_from_slice(&body[at..start]);
        at = pos;
    }
    out.extend_from_slice(&body[at..]);
    Ok((out, progress))
}

/// The JSON value starting at `at`, and the offset just after it.
fn json_value_at(body: &[u8], at: usize) -> Result<(Value, usize), String> {
    let mut values = serde_json::Deserializer::from_slice(&body[at..]).into_iter::<Value>();
    match values.next() {
        Some(Ok(value)) => Ok((value, at + values.byte_offset())),
        Some(Err(e)) => Err(format!("byte {at}: injected JSON does not parse: {e}")),
        None => Err(format!("byte {at}: no injected value")),
    }
}

/// Where two byte strings first differ, with a little context, for a
/// failure message; says so when the received bytes hold another stream's
/// hold marker (cross-talk).
fn describe_mismatch(got: &[u8], want: &[u8], own_key: Option<u64>) -> String {
    let at = got
        .iter()
        .zip(want)
        .position(|(a, b)| a != b)
        .unwrap_or(got.len().min(want.len()));
    let context = |bytes: &[u8]| {
        let from = at.saturating_sub(40);
        let to = (at + 40).min(bytes.len());
        format!("{:?}", String::from_utf8_lossy(&bytes[from.min(to)..to]))
    };
    let mut text = format!(
        "{} bytes received, {} expected; first difference at byte {at}: got …{}…, expected …{}…",
        got.len(),
        want.len(),
        context(got),
        context(want)
    );
    if let Some(own) = own_key {
        let finder = memmem::Finder::new(b": hold ");
        for found in finder.find_iter(got) {
            let digits: String = got[found + 7..]
                .iter()
                .take_while(|b| b.is_ascii_digit())
                .map(|&b| char::from(b))
                .collect();
            if digits.parse::<u64>().is_ok_and(|k| k != own) {
                let _ = write!(text, "; CROSS-TALK: holds the marker of stream {digits}");
                break;
            }
        }
    }
    text
}

/// The tally of one round.
#[derive(Default)]
struct Tally {
    streams: usize,
    ok: usize,
    body_bytes: u64,
    progress: usize,
    by_kind: HashMap<&'static str, (usize, usize)>,
}

impl Tally {
    fn add(&mut self, kind: Kind, ok: bool, body_bytes: u64, progress: usize) {
        self.streams += 1;
        self.body_bytes += body_bytes;
        self.progress += progress;
        let entry = self.by_kind.entry(kind.name()).or_default();
        entry.0 += 1;
        if ok {
            self.ok += 1;
            entry.1 += 1;
        }
    }
}

/// What a checked stream says back.
struct Checked {
    ok: bool,
    body_bytes: u64,
    progress: usize,
}

/// What a stalled stream is checked against.
#[derive(Clone, Copy)]
struct StallCheck {
    /// serve's `--idle-timeout`.
    idle: Duration,
    /// When the upstream went silent.
    began: Option<Instant>,
}

/// Checks one stream of a script kind against what SPEC.md promises.
fn check_stream(
    plan: &Plan,
    inject_none: bool,
    fetched: &Fetched,
    body: &[u8],
    stall: Option<StallCheck>,
    report: &Report,
) -> Checked {
    let key = plan.key;
    let kind = plan.kind;
    let what = |msg: String| format!("stream {key} ({}): {msg}", kind.name());
    let fail = |msg: String| {
        report.fail(what(msg));
        Checked {
            ok: false,
            body_bytes: body.len() as u64,
            progress: 0,
        }
    };
    let Some(head) = fetched.head.as_ref() else {
        return fail(format!("no response head ({:?})", fetched.error));
    };
    if matches!(kind, Kind::BadHead | Kind::ResetBeforeHead) {
        // SPEC.md: an upstream that fails before a response is a 502 with
        // an OpenAI-style JSON error.
        let error_json = serde_json::from_slice::<Value>(body)
            .ok()
            .is_some_and(|v| v.get("error").and_then(|e| e.get("message")).is_some());
        if head.status != 502 || !fetched.complete || !error_json {
            return fail(format!(
                "expected a complete 502 with a JSON error, got {} complete={} body {:?}",
                head.status,
                fetched.complete,
                String::from_utf8_lossy(&body[..body.len().min(200)])
            ));
        }
        return Checked {
            ok: true,
            body_bytes: body.len() as u64,
            progress: 0,
        };
    }
    if head.status != 200 {
        return fail(format!(
            "status {} ({:?})",
            head.status,
            String::from_utf8_lossy(&body[..body.len().min(200)])
        ));
    }
    let own = session_of(key);
    let session = head.header("x-aalis-session");
    let session_ok = if plan.named {
        session == Some(own.as_str())
    } else {
        session.is_some_and(|s| s.starts_with("s-"))
    };
    if !session_ok {
        return fail(format!(
            "response session header {session:?}, expected {}",
            if plan.named {
                own.as_str()
            } else {
                "a generated one"
            }
        ));
    }
    let script = script(key, kind, plan.fragments, plan.bytes as usize);
    let sent = script.sent_events(kind);
    let want_body = script.body(sent);
    let (got_body, got_progress) = if inject_none {
        (body.to_vec(), Vec::new())
    } else {
        match strip_injected(body) {
            Ok(stripped) => stripped,
            Err(e) => return fail(format!("cannot remove the injected parts: {e}")),
        }
    };
    if kind == Kind::ClientGone {
        // It left as soon as it had the marker: perhaps before the marker
        // event's blank line.
        let has_marker = memmem::find(&got_body, hold_marker(key).as_bytes()).is_some();
        if !(has_marker && want_body.starts_with(&got_body)) {
            return fail(describe_mismatch(&got_body, &want_body, Some(key)));
        }
        return Checked {
            ok: true,
            body_bytes: body.len() as u64,
            progress: got_progress.len(),
        };
    }
    if got_body != want_body {
        return fail(describe_mismatch(&got_body, &want_body, Some(key)));
    }
    let want_progress = if inject_none {
        Vec::new()
    } else {
        script.progress(sent)
    };
    if got_progress != want_progress {
        let at = got_progress
            .iter()
            .zip(&want_progress)
            .position(|(a, b)| a != b)
            .unwrap_or(got_progress.len().min(want_progress.len()));
        return fail(format!(
            "{} progress objects, {} expected; #{at}: got {}, expected {}",
            got_progress.len(),
            want_progress.len(),
            got_progress
                .get(at)
                .map_or("none".into(), |v| v.to_string()),
            want_progress
                .get(at)
                .map_or("none".into(), |v| v.to_string()),
        ));
    }
    // How it must end: whole streams end as HTTP says; cut ones must not
    // look complete (SPEC.md: never an invented end).
    let cut = kind.stops_at_hold();
    if cut == fetched.complete {
        return fail(format!(
            "complete={} (error {:?}), expected {}",
            fetched.complete,
            fetched.error,
            if cut {
                "a cut stream"
            } else {
                "a complete one"
            }
        ));
    }
    if kind == Kind::Stall
        && let Some(StallCheck {
            idle,
            began: Some(began),
        }) = stall
        && let Some(ended) = fetched.ended
    {
        // Measured from the upstream's last write, which serve cannot
        // read earlier: a cut before `idle` is serve's mistake; a late one
        // may be anyone's scheduling under load, up to a bound.
        let silent = ended.duration_since(began);
        if silent + Duration::from_millis(10) < idle || silent > idle + Duration::from_secs(3) {
            return fail(format!(
                "cut {silent:?} after the upstream's last byte; --idle-timeout is {idle:?}"
            ));
        }
    }
    Checked {
        ok: true,
        body_bytes: body.len() as u64,
        progress: got_progress.len(),
    }
}

// === the phases ===

/// Runs one stream of a script kind and checks it.
async fn script_stream(
    proxy: SocketAddr,
    plan: Plan,
    inject: Option<&'static str>,
    coord: Arc<Coord>,
    idle_timeout: Option<Duration>,
    report: Arc<Report>,
) -> (Kind, Checked) {
    let request = Request::chat(proxy, &plan, inject);
    let key = plan.key;
    let marker_coord = coord.clone();
    let mut sink = MarkerSink {
        body: Vec::new(),
        marker: hold_marker(key).into_bytes(),
        searched: 0,
        on_marker: Some(Box::new(move || marker_coord.client_reached_hold(key))),
        leave_at_marker: plan.kind == Kind::ClientGone,
    };
    let fetched = fetch(&request, &mut sink).await;
    let record = coord.upstream_record(key);
    let stall = idle_timeout.map(|idle| StallCheck {
        idle,
        began: record.stall_began,
    });
    let checked = check_stream(
        &plan,
        inject == Some("none"),
        &fetched,
        &sink.body,
        stall,
        &report,
    );
    if record.requests != 1 {
        report.fail(format!(
            "stream {key}: the upstream got {} requests for it, expected 1",
            record.requests
        ));
    }
    (plan.kind, checked)
}

/// N concurrent streams under way: started by [`Round::start`], optionally
/// held at their hold markers ([`Round::wait_at_hold`]), then released and
/// checked ([`Round::finish`]).
struct Round {
    tasks: tokio::task::JoinSet<(Kind, Checked)>,
    /// Streams that wait at their hold marker for the release.
    held: usize,
}

impl Round {
    fn start(
        proxy: SocketAddr,
        coord: &Arc<Coord>,
        plans: Vec<Plan>,
        inject: Option<&'static str>,
        idle_timeout: Option<Duration>,
        report: &Arc<Report>,
    ) -> Round {
        let held = plans.iter().filter(|p| p.hold == Hold::Global).count();
        let mut tasks = tokio::task::JoinSet::new();
        for plan in plans {
            tasks.spawn(script_stream(
                proxy,
                plan,
                inject,
                coord.clone(),
                idle_timeout,
                report.clone(),
            ));
        }
        Round { tasks, held }
    }

    /// Waits (90 s at most) until every held stream's client has its
    /// hold marker: all of them are open at once.
    async fn wait_at_hold(&self, coord: &Coord, report: &Report) {
        let started = Instant::now();
        while coord.reached.load(Ordering::Relaxed) < self.held
            && started.elapsed() < Duration::from_secs(90)
        {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let reached = coord.reached.load(Ordering::Relaxed);
        report.check(reached >= self.held, || {
            format!(
                "only {reached} of {} streams reached the hold point within 90 s",
                self.held
            )
        });
    }

    /// Releases the held streams and checks every stream as it ends.
    async fn finish(mut self, coord: &Coord, report: &Report) -> Tally {
        coord.release.send_replace(true);
        let mut tally = Tally::default();
        each_joined(&mut self.tasks, report, "a stream", |(kind, checked)| {
            tally.add(kind, checked.ok, checked.body_bytes, checked.progress)
        })
        .await;
        tally
    }
}

/// A round with nothing to do at the hold point.
async fn round(
    proxy: SocketAddr,
    coord: &Arc<Coord>,
    plans: Vec<Plan>,
    inject: Option<&'static str>,
    idle_timeout: Option<Duration>,
    report: &Arc<Report>,
) -> Tally {
    let round = Round::start(proxy, coord, plans, inject, idle_timeout, report);
    round.wait_at_hold(coord, report).await;
    round.finish(coord, report).await
}

/// Per session id, its calls in progress as (index, name, charsAccumulated).
type SessionsListed = HashMap<String, Vec<(u64, String, u64)>>;

/// `GET /_aalis/sessions`: the sessions with tool calls in progress.
async fn sessions_in_progress(serve: &Served) -> Result<SessionsListed, String> {
    let mut body = Vec::new();
    let fetched = fetch(&Request::get(serve.addr, "/_aalis/sessions"), &mut body).await;
    if !fetched.complete {
        return Err(format!("/_aalis/sessions: {:?}", fetched.error));
    }
    let value: Value = serde_json::from_slice(&body).map_err(|e| e.to_string())?;
    let sessions = value
        .get("sessions")
        .and_then(Value::as_array)
        .ok_or("/_aalis/sessions has no sessions list")?;
    let mut out = HashMap::new();
    for session in sessions {
        let id = session
            .get("sessionId")
            .and_then(Value::as_str)
            .unwrap_or("");
        let tools = session
            .get("toolCallsProgress")
            .and_then(Value::as_array)
            .map(|tools| {
                tools
                    .iter()
                    .map(|t| {
                        (
                            t.get("index").and_then(Value::as_u64).unwrap_or(u64::MAX),
                            t.get("name")
                                .and_then(Value::as_str)
                                .unwrap_or("")
                                .to_owned(),
                            t.get("charsAccumulated")
                                .and_then(Value::as_u64)
                                .unwrap_or(u64::MAX),
                        )
                    })
                    .collect()
            })
            .unwrap_or_default();
        out.insert(id.to_owned(), tools);
    }
    Ok(out)
}

/// What `/_aalis/sessions` must list for stream `key` at its hold marker:
/// each call with its name and the characters accumulated so far.
fn expected_at_hold(plan: &Plan) -> Vec<(u64, String, u64)> {
    let script = script(plan.key, plan.kind, plan.fragments, plan.bytes as usize);
    let mut last: Vec<(u64, String, u64)> = Vec::new();
    for p in script.progress(script.hold + 1) {
        let index = p.get("index").and_then(Value::as_u64).unwrap_or(u64::MAX);
        let name = p
            .get("name")
            .and_then(Value::as_str)
            .unwrap_or("")
            .to_owned();
        let chars = p
            .get("charsAccumulated")
            .and_then(Value::as_u64)
            .unwrap_or(u64::MAX);
        match last.iter_mut().find(|(i, _, _)| *i == index) {
            Some(entry) => *entry = (index, name, chars),
            None => last.push((index, name, chars)),
        }
    }
    last.sort();
    last
}

/// Checks the session registry against the streams: at the hold point,
/// exactly the held sessions, each with its own calls; after, none.
fn check_sessions(
    label: &str,
    listed: Result<SessionsListed, String>,
    plans: &[Plan],
    report: &Report,
) -> usize {
    let listed = match listed {
        Ok(listed) => listed,
        Err(e) => {
            report.fail(format!("{label}: {e}"));
            return 0;
        }
    };
    let mut wrong = 0;
    for plan in plans {
        let id = session_of(plan.key);
        let mut got = listed.get(&id).cloned().unwrap_or_default();
        got.sort();
        let want = expected_at_hold(plan);
        if got != want {
            wrong += 1;
            if wrong <= 5 {
                report.fail(format!(
                    "{label}: session {id} lists {got:?}, expected {want:?}"
                ));
            }
        }
    }
    let strangers = listed.len().saturating_sub(plans.len());
    report.check(wrong == 0 && strangers == 0, || {
        format!(
            "{label}: {wrong} sessions listed wrong, {} listed in all for {} streams",
            listed.len(),
            plans.len()
        )
    });
    listed.len()
}

fn plans(
    base: u64,
    n: usize,
    fragments: usize,
    hold: Hold,
    kind_of: impl Fn(usize) -> Kind,
) -> Vec<Plan> {
    (0..n)
        .map(|k| Plan {
            key: base + k as u64,
            kind: kind_of(k),
            fragments,
            hold,
            bytes: 0,
            stall: Duration::ZERO,
            named: true,
        })
        .collect()
}

/// Starts a serve in front of `upstream` and sends it a few streams, so
/// that what is measured next excludes its start-up allocations.
async fn warm_serve(
    cli: &Cli,
    name: &str,
    upstream: &Upstream,
    coord: &Arc<Coord>,
    report: &Arc<Report>,
) -> Result<Served, Error> {
    let serve = Served::start(
        cli,
        name,
        &["serve".into(), "--upstream".into(), upstream.url()],
    )?;
    // Keys of their own: the upstream checks each key is asked for once.
    static WARM_KEYS: AtomicU64 = AtomicU64::new(1_000_000);
    let base = WARM_KEYS.fetch_add(8, Ordering::Relaxed);
    let warm = round(
        serve.addr,
        coord,
        plans(base, 8, cli.fragments, Hold::None, |_| Kind::Normal),
        None,
        None,
        report,
    )
    .await;
    report.check(warm.ok == warm.streams, || {
        format!("{name}: warm-up streams failed")
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    Ok(serve)
}

async fn phase_exact(cli: &Cli, report: &Arc<Report>) -> Result<(), Error> {
    let n = cli.streams;
    println!(
        "\n== exact: {n} concurrent streams through serve, distinct content per session, all open at once"
    );
    let coord = Coord::new();
    let upstream = Upstream::start(coord.clone()).await?;
    for (name, label, base, inject) in [
        (
            "serve-field",
            "--inject field (default)",
            2_000_000u64,
            None,
        ),
        (
            "serve-none",
            "X-Aalis-Inject: none",
            3_000_000u64,
            Some("none"),
        ),
    ] {
        // A fresh process per round: RSS never shrinks back, so a second
        // round in the same process would reuse the first one's memory.
        let serve = warm_serve(cli, name, &upstream, &coord, report).await?;
        coord.reset();
        let before = serve.mem()?;
        let tcp_before = kernel_tcp_kib();
        let started = Instant::now();
        let streams = plans(base, n, cli.fragments, Hold::Global, |_| Kind::Normal);
        let held = Round::start(serve.addr, &coord, streams.clone(), inject, None, report);
        held.wait_at_hold(&coord, report).await;
        // All n are open: memory, and what serve says about them.
        let at_hold = serve.mem()?;
        let at_hold_tcp = kernel_tcp_kib();
        let open_at_hold = serve.metric("aalis_streams_open").await;
        let listed_at_hold = check_sessions(
            &format!("{label}: /_aalis/sessions at the hold point"),
            sessions_in_progress(&serve).await,
            &streams,
            report,
        );
        let tally = held.finish(&coord, report).await;
        let wall = started.elapsed();
        let open = serve.metric("aalis_streams_open").await;
        let after = serve.mem()?;
        let listed_after = check_sessions(
            &format!("{label}: /_aalis/sessions after the round"),
            sessions_in_progress(&serve).await,
            &[],
            report,
        );
        let per_stream = at_hold.rss_kib.saturating_sub(before.rss_kib) as f64 / n as f64;
        let warnings = serve.warnings.load(Ordering::Relaxed);
        println!("  {label}: {} of {} streams exact", tally.ok, tally.streams);
        println!(
            "    {} body bytes received, {} progress objects checked against each stream's own tool calls; {:.1} s",
            tally.body_bytes,
            tally.progress,
            wall.as_secs_f64()
        );
        println!(
            "    serve RSS: {} before, {} with {n} open ({per_stream:.1} KiB per open stream), {} after; VmHWM {}",
            mib(before.rss_kib),
            mib(at_hold.rss_kib),
            mib(after.rss_kib),
            mib(after.hwm_kib)
        );
        println!(
            "    kernel TCP buffers (all sockets, not in RSS): {} before, {} with {n} open; {warnings} warnings logged",
            mib(tcp_before),
            mib(at_hold_tcp)
        );
        println!(
            "    at the hold point aalis_streams_open was {open_at_hold:?} and /_aalis/sessions listed {listed_at_hold} sessions, \
             each with its own two calls and counts; after the round, {listed_after}"
        );
        report.check(open_at_hold == Some(n as u64), || {
            format!("{label}: aalis_streams_open was {open_at_hold:?} with {n} streams open")
        });
        if inject.is_none() {
            // The same again in the same process: what stays behind per
            // finished stream (sessions are kept for --session-ttl).
            let mut previous = after;
            for again in 1..=cli.again {
                coord.reset();
                let base = base + again as u64 * 100_000;
                let wave = plans(base, n, cli.fragments, Hold::Global, |_| Kind::Normal);
                let tally = round(serve.addr, &coord, wave, inject, None, report).await;
                let now = serve.mem()?;
                println!(
                    "    the same again in the same serve ({again}): {} of {n} exact; RSS {} after it ({:+.1} KiB per stream)",
                    tally.ok,
                    mib(now.rss_kib),
                    (now.rss_kib as f64 - previous.rss_kib as f64) / n as f64
                );
                report.check(tally.ok == n, || {
                    format!(
                        "{label}, again: {} of {n} streams were not exact",
                        n - tally.ok
                    )
                });
                previous = now;
            }
        }
        report.check(tally.ok == n, || {
            format!("{label}: {} of {n} streams were not exact", n - tally.ok)
        });
        report.check(open == Some(0), || {
            format!("{label}: aalis_streams_open is {open:?} after the round, expected 0")
        });
        report.check(warnings == 0, || {
            format!(
                "{label}: serve logged warnings; see {}",
                serve.log.display()
            )
        });
    }
    Ok(())
}

/// What serve may keep per finished stream: its session stays in the
/// registry until `--session-ttl`; see `phase_churn`.
const RETAINED_PER_STREAM_BOUND_KIB: f64 = 32.0;

/// Many short streams, 100 at a time, none naming its session (so each
/// gets a new generated one): what stays behind in serve per finished
/// stream, as RSS after the churn minus RSS before, over the count.
async fn phase_churn(cli: &Cli, report: &Arc<Report>) -> Result<(), Error> {
    let total = cli.churn_streams;
    let at_once = 100;
    println!(
        "\n== churn: {total} short streams, {at_once} at a time, no X-Aalis-Session (serve generates one each)"
    );
    let coord = Coord::new();
    let upstream = Upstream::start(coord.clone()).await?;
    let serve = warm_serve(cli, "serve-churn", &upstream, &coord, report).await?;
    let before = serve.mem()?;
    let permits = Arc::new(tokio::sync::Semaphore::new(at_once));
    let started = Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    for plan in plans(8_000_000, total, 6, Hold::None, |_| Kind::Normal) {
        let plan = Plan {
            named: false,
            ..plan
        };
        let permits = permits.clone();
        let (coord, report) = (coord.clone(), report.clone());
        let proxy = serve.addr;
        tasks.spawn(async move {
            let _permit = permits.acquire_owned().await;
            script_stream(proxy, plan, None, coord, None, report).await
        });
    }
    let mut ok = 0;
    each_joined(&mut tasks, report, "a churn stream", |(_, checked)| {
        ok += usize::from(checked.ok)
    })
    .await;
    let wall = started.elapsed();
    tokio::time::sleep(Duration::from_millis(300)).await;
    let after = serve.mem()?;
    let per_stream = (after.rss_kib as f64 - before.rss_kib as f64) / total.max(1) as f64;
    println!(
        "  {ok} of {total} streams exact in {:.1} s; serve RSS {} before, {} after: {per_stream:+.1} KiB per finished stream (bound {RETAINED_PER_STREAM_BOUND_KIB} KiB)",
        wall.as_secs_f64(),
        mib(before.rss_kib),
        mib(after.rss_kib)
    );
    report.check(ok == total, || {
        format!("churn: {} of {total} streams were not exact", total - ok)
    });
    report.check(per_stream <= RETAINED_PER_STREAM_BOUND_KIB, || {
        format!("churn: serve keeps {per_stream:.1} KiB per finished stream")
    });
    Ok(())
}

/// The captures under `dir` (`.sse` and `.ndjson`), one per file stem.
fn find_captures(dir: &Path) -> Result<Vec<(String, PathBuf, Vec<u8>)>, Error> {
    let mut files = Vec::new();
    let mut dirs = vec![dir.to_path_buf()];
    while let Some(d) = dirs.pop() {
        let entries =
            std::fs::read_dir(&d).map_err(|e| format!("cannot list {}: {e}", d.display()))?;
        for entry in entries {
            let path = entry?.path();
            if path.is_dir() {
                dirs.push(path);
            } else if matches!(
                path.extension().and_then(|e| e.to_str()),
                Some("sse" | "ndjson")
            ) {
                files.push(path);
            }
        }
    }
    files.sort();
    let mut captures: Vec<(String, PathBuf, Vec<u8>)> = Vec::new();
    for path in files {
        let stem = path
            .file_stem()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_default();
        // The mock picks a capture by its stem: a second file of the same
        // stem could never be asked for.
        if captures.iter().any(|(s, _, _)| *s == stem) {
            continue;
        }
        let bytes = std::fs::read(&path)?;
        if memmem::find(&bytes, b"\"toolCall").is_some() {
            // Already annotated: its injected-looking members are not ours.
            continue;
        }
        captures.push((stem, path, bytes));
    }
    if captures.is_empty() {
        return Err(format!("no .sse or .ndjson capture under {}", dir.display()).into());
    }
    Ok(captures)
}

async fn phase_mock(cli: &Cli, report: &Arc<Report>) -> Result<(), Error> {
    let n = cli.streams;
    let captures = Arc::new(find_captures(&cli.fixtures)?);
    println!(
        "\n== mock: {n} concurrent streams from `aalis-proxy mock` ({} captures of {}, 10 ms between frames) through serve",
        captures.len(),
        cli.fixtures.display()
    );
    let mut args = vec!["mock".to_owned()];
    args.extend(captures.iter().map(|(_, p, _)| p.display().to_string()));
    args.extend(["--delay-ms".to_owned(), "10".to_owned()]);
    let mock = Served::start(cli, "mock", &args)?;
    let serve = Served::start(
        cli,
        "serve-mock",
        &["serve".into(), "--upstream".into(), mock.url()],
    )?;
    let before = serve.mem()?;
    let open = Arc::new(AtomicUsize::new(0));
    let peak_open = Arc::new(AtomicUsize::new(0));
    let started = Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    for k in 0..n {
        let captures = captures.clone();
        let report = report.clone();
        let (open, peak_open) = (open.clone(), peak_open.clone());
        let proxy = serve.addr;
        tasks.spawn(async move {
            let (stem, path, want) = &captures[k % captures.len()];
            let ndjson = path.extension().is_some_and(|e| e == "ndjson");
            let session = format!("lt-mock-{k}");
            let request = Request {
                target: proxy,
                method: "POST",
                path: if ndjson {
                    "/api/chat"
                } else {
                    "/v1/chat/completions"
                }
                .to_owned(),
                headers: vec![
                    ("content-type".into(), "application/json".into()),
                    ("x-aalis-session".into(), session.clone()),
                ],
                body: json!({"model": stem, "stream": true})
                    .to_string()
                    .into_bytes(),
                recv_buffer: None,
                slow: None,
                deadline: Duration::from_secs(120),
            };
            let now = open.fetch_add(1, Ordering::Relaxed) + 1;
            peak_open.fetch_max(now, Ordering::Relaxed);
            let mut body = Vec::new();
            let fetched = fetch(&request, &mut body).await;
            open.fetch_sub(1, Ordering::Relaxed);
            let what = |msg: String| format!("mock stream {k} ({stem}): {msg}");
            let status = fetched.head.as_ref().map(|h| h.status);
            let echoed = fetched
                .head
                .as_ref()
                .and_then(|h| h.header("x-aalis-session"));
            if status != Some(200) || !fetched.complete || echoed != Some(session.as_str()) {
                report.fail(what(format!(
                    "status {status:?}, complete {}, error {:?}, session header {echoed:?}",
                    fetched.complete, fetched.error
                )));
                return (false, body.len() as u64, 0);
            }
            match strip_injected(&body) {
                Ok((got, progress)) if got == *want => (true, body.len() as u64, progress.len()),
                Ok((got, _)) => {
                    report.fail(what(describe_mismatch(&got, want, None)));
                    (false, body.len() as u64, 0)
                }
                Err(e) => {
                    report.fail(what(format!("cannot remove the injected parts: {e}")));
                    (false, body.len() as u64, 0)
                }
            }
        });
    }
    let (mut ok, mut bytes, mut progress) = (0usize, 0u64, 0usize);
    each_joined(&mut tasks, report, "a mock stream", |(good, b, p)| {
        ok += usize::from(good);
        bytes += b;
        progress += p;
    })
    .await;
    let after = serve.mem()?;
    println!(
        "  {ok} of {n} streams equal their capture once the injected members are removed; \
         {bytes} body bytes, {progress} progress objects; at most {} open at once; {:.1} s",
        peak_open.load(Ordering::Relaxed),
        started.elapsed().as_secs_f64()
    );
    println!(
        "  serve RSS {} before, {} after, VmHWM {}",
        mib(before.rss_kib),
        mib(after.rss_kib),
        mib(after.hwm_kib)
    );
    report.check(ok == n, || {
        format!("mock: {} of {n} streams were not exact", n - ok)
    });
    Ok(())
}

async fn phase_faults(cli: &Cli, report: &Arc<Report>) -> Result<(), Error> {
    let n = cli.streams;
    let idle = Duration::from_millis(cli.idle_timeout_ms);
    // Over serve's --max-event-bytes (1 MiB here): passed on unparsed.
    let huge = 1024 * 1024 + 512 * 1024;
    println!(
        "\n== faults: {n} concurrent streams, one in five faulty ({}); serve --idle-timeout {}ms --max-event-bytes 1MiB",
        Kind::FAULTS.map(Kind::name).join(", "),
        idle.as_millis()
    );
    let coord = Coord::new();
    let upstream = Upstream::start(coord.clone()).await?;
    let serve = Served::start(
        cli,
        "serve-faults",
        &[
            "serve".into(),
            "--upstream".into(),
            upstream.url(),
            "--idle-timeout".into(),
            format!("{}ms", idle.as_millis()),
            "--max-event-bytes".into(),
            "1MiB".into(),
        ],
    )?;
    let plans: Vec<Plan> = (0..n)
        .map(|k| {
            let kind = if k % 5 == 4 {
                Kind::FAULTS[(k / 5) % Kind::FAULTS.len()]
            } else {
                Kind::Normal
            };
            Plan {
                key: 4_000_000 + k as u64,
                kind,
                fragments: cli.fragments,
                // A reset waits until its client has everything before it,
                // or the kernel may discard bytes serve has not read yet.
                hold: if kind == Kind::Reset {
                    Hold::Signal
                } else {
                    Hold::None
                },
                bytes: if kind == Kind::Garbage { huge } else { 0 },
                stall: idle + Duration::from_secs(3),
                named: true,
            }
        })
        .collect();
    let keys_of = |kind: Kind| -> Vec<u64> {
        plans
            .iter()
            .filter(|p| p.kind == kind)
            .map(|p| p.key)
            .collect()
    };
    let (stall_keys, gone_keys) = (keys_of(Kind::Stall), keys_of(Kind::ClientGone));
    let started = Instant::now();
    let tally = round(serve.addr, &coord, plans, None, Some(idle), report).await;
    // Every stream has ended, the faulty ones too: no session may still
    // show a tool in progress (SPEC.md: failure clears).
    let lingering = check_sessions(
        "faults: /_aalis/sessions after the round",
        sessions_in_progress(&serve).await,
        &[],
        report,
    );
    let wall = started.elapsed();
    let mut kinds: Vec<_> = tally.by_kind.iter().collect();
    kinds.sort();
    let per_kind: Vec<String> = kinds
        .iter()
        .map(|(kind, (count, ok))| format!("{kind} {ok}/{count}"))
        .collect();
    println!(
        "  streams as specified: {} of {} ({}); {:.1} s",
        tally.ok,
        tally.streams,
        per_kind.join(", "),
        wall.as_secs_f64()
    );
    // A stalled upstream must be dropped at serve's idle timeout; one
    // whose client left, at once (SPEC.md: a client that goes away
    // cancels its upstream request), not at the idle timeout.
    let stall_closes = upstream_closes(&coord, &stall_keys).await;
    let gone_closes = upstream_closes(&coord, &gone_keys).await;
    for (what, keys, closes) in [
        ("stalled upstreams", &stall_keys, &stall_closes),
        ("upstreams whose client left", &gone_keys, &gone_closes),
    ] {
        let min = closes.iter().min().map_or(f64::NAN, Duration::as_secs_f64);
        let max = closes.iter().max().map_or(f64::NAN, Duration::as_secs_f64);
        println!(
            "  {what}: serve closed {} of {} after {min:.2}–{max:.2} s of upstream silence",
            closes.len(),
            keys.len()
        );
        report.check(closes.len() == keys.len(), || {
            format!(
                "{what}: serve closed only {} of {} upstream connections",
                closes.len(),
                keys.len()
            )
        });
    }
    let late = gone_closes.iter().filter(|d| **d >= idle).count();
    report.check(late == 0, || {
        format!(
            "{late} of {} upstream requests whose client had left were closed only by the idle timeout ({idle:?})",
            gone_keys.len()
        )
    });
    let errors = serve.metric("aalis_upstream_errors_total").await;
    let open = serve.metric("aalis_streams_open").await;
    let mem = serve.mem()?;
    println!(
        "  serve: aalis_upstream_errors_total {errors:?}, aalis_streams_open {open:?}, {lingering} sessions in progress, {} warnings logged, RSS {}, VmHWM {}",
        serve.warnings.load(Ordering::Relaxed),
        mib(mem.rss_kib),
        mib(mem.hwm_kib)
    );
    report.check(tally.ok == n, || {
        format!(
            "faults: {} of {n} streams did not end as specified",
            n - tally.ok
        )
    });
    report.check(open == Some(0), || {
        format!("faults: aalis_streams_open is {open:?} after the round, expected 0")
    });
    Ok(())
}

/// How long after it went silent each of these upstream streams saw serve
/// close the connection; waits up to `--idle-timeout`-independent 8 s for
/// the records (the upstream notes a close a moment after the client).
async fn upstream_closes(coord: &Coord, keys: &[u64]) -> Vec<Duration> {
    let waited = Instant::now();
    loop {
        let closes: Vec<Duration> = keys
            .iter()
            .filter_map(|k| coord.upstream_record(*k).closed_after_stall)
            .collect();
        if closes.len() == keys.len() || waited.elapsed() > Duration::from_secs(8) {
            return closes;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A bound on what serve holds for one stream whose client does not read
/// (hyper 1.x defaults; see `src/proxy/body.rs`):
/// - the client connection's write queue: hyper stops polling the body
///   once 8 KiB + 400 KiB are queued (`DEFAULT_MAX_BUFFER_SIZE`);
/// - `TapBody`'s coalescing buffer: 64 KiB plus one upstream frame;
/// - the upstream connection's read buffer: at most the same 408 KiB;
/// - the annotator's partial event: one event (1 KiB here);
///
/// so 880 KiB; 1 MiB with allocator slack. Kernel socket buffers are not
/// in RSS (reported apart).
const SLOW_STREAM_BOUND_KIB: u64 = 1024;

async fn phase_slow(cli: &Cli, report: &Arc<Report>) -> Result<(), Error> {
    let n = cli.slow_readers;
    let seconds = cli.slow_seconds;
    println!(
        "\n== slow: {n} clients reading one byte per 10 ms (SO_RCVBUF 4 KiB) for {seconds} s; the upstream writes as fast as it can"
    );
    let coord = Coord::new();
    let upstream = Upstream::start(coord.clone()).await?;
    let serve = warm_serve(cli, "serve-slow", &upstream, &coord, report).await?;
    let baseline = serve.mem()?;
    let bound_kib = baseline.rss_kib + n as u64 * SLOW_STREAM_BOUND_KIB;
    let samples = Arc::new(Mutex::new(Vec::<(f64, u64, u64)>::new()));
    let started = Instant::now();
    let sampler = {
        let samples = samples.clone();
        let pid = serve.pid();
        tokio::spawn(async move {
            loop {
                if let Ok(mem) = mem_of(pid)
                    && let Ok(mut s) = samples.lock()
                {
                    s.push((
                        started.elapsed().as_secs_f64(),
                        mem.rss_kib,
                        kernel_tcp_kib(),
                    ));
                }
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        })
    };
    // Once, a second before the readers stop: the kernel's share.
    let sockets = {
        let pid = serve.pid();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_secs(seconds.saturating_sub(1))).await;
            tokio::task::spawn_blocking(move || socket_kib_of(pid))
                .await
                .ok()
                .flatten()
        })
    };
    let mut tasks = tokio::task::JoinSet::new();
    for k in 0..n {
        let plan = Plan {
            key: 6_000_000 + k as u64,
            kind: Kind::Firehose,
            fragments: 0,
            hold: Hold::None,
            bytes: 0,
            stall: Duration::ZERO,
            named: true,
        };
        let mut request = Request::chat(serve.addr, &plan, None);
        request.recv_buffer = Some(4096);
        request.slow = Some((Duration::from_millis(10), Duration::from_secs(seconds)));
        request.deadline = Duration::from_secs(seconds + 30);
        let report = report.clone();
        tasks.spawn(async move {
            let mut body = Vec::new();
            let fetched = fetch(&request, &mut body).await;
            let key = plan.key;
            let status = fetched.head.as_ref().map(|h| h.status);
            if status != Some(200) || fetched.error.is_some() {
                report.fail(format!(
                    "slow reader {key}: status {status:?}, error {:?}",
                    fetched.error
                ));
                return (false, body.len(), 0);
            }
            // What arrived must be the stream's own first events: check
            // up to the last whole event.
            let whole = memmem::rfind(&body, b"\n\n").map_or(0, |i| i + 2);
            let ok = match strip_injected(&body[..whole]) {
                Ok((got, _)) => {
                    let mut want = Vec::new();
                    let mut i = 0;
                    while want.len() < got.len() {
                        want.extend(firehose_event(key, i));
                        i += 1;
                    }
                    if got == want {
                        true
                    } else {
                        report.fail(format!(
                            "slow reader {key}: {}",
                            describe_mismatch(&got, &want, None)
                        ));
                        false
                    }
                }
                Err(e) => {
                    report.fail(format!("slow reader {key}: {e}"));
                    false
                }
            };
            (ok, body.len(), whole)
        });
    }
    let (mut ok, mut read, mut verified) = (0usize, 0usize, 0usize);
    each_joined(
        &mut tasks,
        report,
        "a slow reader",
        |(good, bytes, whole)| {
            ok += usize::from(good);
            read += bytes;
            verified += whole;
        },
    )
    .await;
    let read_for = started.elapsed();
    // The clients are gone: serve must drop their upstream requests.
    let keys: Vec<u64> = (0..n).map(|k| 6_000_000 + k as u64).collect();
    let gone = Instant::now();
    let mut cancelled = 0;
    while gone.elapsed() < Duration::from_secs(10) {
        cancelled = keys
            .iter()
            .filter(|k| coord.upstream_record(**k).ended_by_peer)
            .count();
        if cancelled == n {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let cancel_time = gone.elapsed();
    tokio::time::sleep(Duration::from_millis(500)).await;
    sampler.abort();
    let after = serve.mem()?;
    let samples = samples.lock().map(|s| s.clone()).unwrap_or_default();
    let during: Vec<&(f64, u64, u64)> = samples
        .iter()
        .filter(|s| s.0 <= read_for.as_secs_f64())
        .collect();
    let max_rss = during.iter().map(|s| s.1).max().unwrap_or(0);
    let max_tcp = during.iter().map(|s| s.2).max().unwrap_or(0);
    let half = read_for.as_secs_f64() / 2.0;
    let first_half = during
        .iter()
        .filter(|s| s.0 <= half)
        .map(|s| s.1)
        .max()
        .unwrap_or(0);
    let second_half = during
        .iter()
        .filter(|s| s.0 > half)
        .map(|s| s.1)
        .max()
        .unwrap_or(0);
    let sent: u64 = keys
        .iter()
        .map(|k| coord.upstream_record(*k).body_bytes)
        .sum();
    println!(
        "  {ok} of {n} readers got their own stream's first events; they read {read} body bytes in all ({:.0} each), {verified} of them in whole events checked",
        read as f64 / n.max(1) as f64
    );
    println!(
        "  the upstreams wrote {} in all ({:.0} KiB per stream) before backpressure stopped them",
        mib(sent / 1024),
        sent as f64 / 1024.0 / n.max(1) as f64
    );
    println!(
        "  serve RSS: baseline {}, max {} over {} samples (max of the first half {}, of the second half {}), {} after the readers left",
        mib(baseline.rss_kib),
        mib(max_rss),
        during.len(),
        mib(first_half),
        mib(second_half),
        mib(after.rss_kib)
    );
    println!(
        "  bound: baseline + {n} × {SLOW_STREAM_BOUND_KIB} KiB = {}: {}; {:.0} KiB per slow stream measured",
        mib(bound_kib),
        if max_rss <= bound_kib {
            "held"
        } else {
            "EXCEEDED"
        },
        max_rss.saturating_sub(baseline.rss_kib) as f64 / n.max(1) as f64
    );
    let serve_sockets = sockets.await.ok().flatten();
    println!(
        "  kernel TCP buffers (not in RSS): {} in serve's sockets a second before the end ({}), at most {} in all sockets of the machine",
        serve_sockets.map_or("unknown (no ss)".to_owned(), mib),
        serve_sockets.map_or(String::new(), |kib| format!(
            "{:.0} KiB per slow stream",
            kib as f64 / n.max(1) as f64
        )),
        mib(max_tcp)
    );
    println!(
        "  after the readers left, serve closed {cancelled} of {n} upstream requests within {:.2} s",
        cancel_time.as_secs_f64()
    );
    report.check(ok == n, || {
        format!("slow: {} of {n} readers failed", n - ok)
    });
    report.check(max_rss <= bound_kib, || {
        format!(
            "slow: serve RSS reached {} (bound {})",
            mib(max_rss),
            mib(bound_kib)
        )
    });
    report.check(cancelled == n, || {
        format!("slow: only {cancelled} of {n} upstream requests ended after their clients left")
    });
    Ok(())
}

/// The line phase's limit (issue 7, "Limits").
const LINE_RSS_LIMIT_KIB: u64 = 100 * 1024;

async fn phase_line(cli: &Cli, report: &Arc<Report>) -> Result<(), Error> {
    let bytes = cli.line_mib << 20;
    println!(
        "\n== line: `data: ` + {} MiB without a newline, through annotate and through serve",
        cli.line_mib
    );
    let aalis = cli.aalis.clone();
    let annotate = tokio::task::spawn_blocking(move || annotate_line(&aalis, bytes)).await??;
    println!(
        "  annotate: {} of {} bytes out, {}, exit {}, {} warning line(s); VmHWM {} ({:.0} MB/s)",
        annotate.out_bytes,
        bytes + 6,
        match annotate.mismatch {
            None => "byte-exact".to_owned(),
            Some(at) => format!("DIFFERENT at byte {at}"),
        },
        annotate.exit,
        annotate.warnings,
        mib(annotate.hwm_kib),
        (bytes + 6) as f64 / annotate.wall.as_secs_f64() / 1e6
    );
    report.check(
        annotate.out_bytes == bytes + 6 && annotate.mismatch.is_none(),
        || {
            format!(
                "annotate: {} bytes out of {}, mismatch {:?}",
                annotate.out_bytes,
                bytes + 6,
                annotate.mismatch
            )
        },
    );
    report.check(annotate.exit == "0", || {
        format!("annotate exited {}", annotate.exit)
    });
    report.check(annotate.warnings == 1, || {
        format!(
            "annotate printed {} warning lines, expected one",
            annotate.warnings
        )
    });
    report.check(annotate.hwm_kib < LINE_RSS_LIMIT_KIB, || {
        format!("annotate VmHWM {} ≥ 100 MiB", mib(annotate.hwm_kib))
    });

    let coord = Coord::new();
    let upstream = Upstream::start(coord.clone()).await?;
    let serve = Served::start(
        cli,
        "serve-line",
        &["serve".into(), "--upstream".into(), upstream.url()],
    )?;
    let before = serve.mem()?;
    let plan = Plan {
        key: 7_000_000,
        kind: Kind::BigLine,
        fragments: 0,
        hold: Hold::None,
        bytes,
        stall: Duration::ZERO,
        named: true,
    };
    let mut request = Request::chat(serve.addr, &plan, None);
    request.deadline = Duration::from_secs(600);
    let pattern = Pattern::new();
    let mut sink = PatternSink::new(&pattern);
    let started = Instant::now();
    let fetched = fetch(&request, &mut sink).await;
    let wall = started.elapsed();
    let after = serve.mem()?;
    println!(
        "  serve: {} of {} bytes out, {}, {}; VmHWM {} (RSS {} before, {} after; {:.0} MB/s)",
        sink.total,
        bytes + 6,
        match sink.mismatch {
            None => "byte-exact".to_owned(),
            Some(at) => format!("DIFFERENT at byte {at}"),
        },
        if fetched.complete {
            "complete"
        } else {
            "NOT complete"
        },
        mib(after.hwm_kib),
        mib(before.rss_kib),
        mib(after.rss_kib),
        sink.total as f64 / wall.as_secs_f64() / 1e6
    );
    report.check(
        fetched.complete && sink.total == bytes + 6 && sink.mismatch.is_none(),
        || {
            format!(
                "serve: {} bytes of {}, complete {}, error {:?}, mismatch {:?}",
                sink.total,
                bytes + 6,
                fetched.complete,
                fetched.error,
                sink.mismatch
            )
        },
    );
    report.check(after.hwm_kib < LINE_RSS_LIMIT_KIB, || {
        format!("serve VmHWM {} ≥ 100 MiB", mib(after.hwm_kib))
    });
    println!(
        "  serve logged {} warning(s) (one per oversized event expected)",
        serve.warnings.load(Ordering::Relaxed)
    );
    report.check(serve.warnings.load(Ordering::Relaxed) == 1, || {
        format!(
            "serve logged {} warnings for one oversized event; see {}",
            serve.warnings.load(Ordering::Relaxed),
            serve.log.display()
        )
    });
    drop(serve);

    // Several at once, in a fresh serve: what each costs while it lasts.
    let k = cli.line_streams;
    if k == 0 {
        return Ok(());
    }
    let each = 64u64 << 20;
    let serve = Served::start(
        cli,
        "serve-lines",
        &["serve".into(), "--upstream".into(), upstream.url()],
    )?;
    let before = serve.mem()?;
    let started = Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    for i in 0..k {
        let plan = Plan {
            key: 7_100_000 + i as u64,
            kind: Kind::BigLine,
            fragments: 0,
            hold: Hold::None,
            bytes: each,
            stall: Duration::ZERO,
            named: true,
        };
        let mut request = Request::chat(serve.addr, &plan, None);
        request.deadline = Duration::from_secs(300);
        tasks.spawn(async move {
            let pattern = Pattern::new();
            let mut sink = PatternSink::new(&pattern);
            let fetched = fetch(&request, &mut sink).await;
            fetched.complete && sink.total == each + 6 && sink.mismatch.is_none()
        });
    }
    let mut exact = 0;
    while let Some(joined) = tasks.join_next().await {
        exact += usize::from(joined.unwrap_or(false));
    }
    let after = serve.mem()?;
    let per_line = after.hwm_kib.saturating_sub(before.rss_kib) / k as u64;
    println!(
        "  serve, {k} lines of 64 MiB at once: {exact} of {k} byte-exact in {:.1} s; VmHWM {} ({} per line while it lasts)",
        started.elapsed().as_secs_f64(),
        mib(after.hwm_kib),
        mib(per_line)
    );
    report.check(exact == k, || {
        format!(
            "serve: {} of {k} concurrent lines were not byte-exact",
            k - exact
        )
    });
    Ok(())
}

/// What `annotate` did with the line.
struct AnnotateRun {
    out_bytes: u64,
    mismatch: Option<u64>,
    exit: String,
    warnings: usize,
    hwm_kib: u64,
    wall: Duration,
}

/// Pipes `data: ` + `bytes` pattern bytes into `aalis-proxy annotate` and
/// checks its stdout as it comes. VmHWM is read while the process is still
/// alive: once all output is out, before stdin is closed.
fn annotate_line(aalis: &Path, bytes: u64) -> Result<AnnotateRun, Error> {
    let started = Instant::now();
    let mut child = Command::new(aalis)
        .arg("annotate")
        .env_remove("NO_COLOR")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| format!("cannot start {}: {e}", aalis.display()))?;
    let pid = child.id();
    let mut stdin = child.stdin.take().ok_or("no stdin pipe")?;
    let mut stdout = child.stdout.take().ok_or("no stdout pipe")?;
    let mut stderr = child.stderr.take().ok_or("no stderr pipe")?;
    let (close_tx, close_rx) = std::sync::mpsc::channel::<()>();
    let writer = std::thread::spawn(move || -> std::io::Result<()> {
        let pattern = Pattern::new();
        stdin.write_all(b"data: ")?;
        let mut offset = 0u64;
        while offset < bytes {
            let len = (bytes - offset).min(Pattern::PIECE as u64) as usize;
            stdin.write_all(pattern.piece(offset, len))?;
            offset += len as u64;
        }
        // Keep stdin open until VmHWM was read (bounded).
        let _ = close_rx.recv_timeout(Duration::from_secs(60));
        Ok(())
    });
    let out_bytes = Arc::new(AtomicU64::new(0));
    let reader = {
        let out_bytes = out_bytes.clone();
        std::thread::spawn(move || -> (u64, Option<u64>) {
            let pattern = Pattern::new();
            let mut sink = PatternSink::new(&pattern);
            let mut buf = vec![0u8; 256 * 1024];
            loop {
                match stdout.read(&mut buf) {
                    Ok(0) | Err(_) => break,
                    Ok(n) => {
                        sink.data(&buf[..n]);
                        out_bytes.store(sink.total, Ordering::Relaxed);
                    }
                }
            }
            (sink.total, sink.mismatch)
        })
    };
    let errors = std::thread::spawn(move || {
        let mut text = Vec::new();
        let _ = stderr.read_to_end(&mut text);
        String::from_utf8_lossy(&text).into_owned()
    });
    // Sample until everything is out (or the child ended, or 10 minutes).
    let mut hwm_kib = 0;
    while started.elapsed() < Duration::from_secs(600) {
        if let Ok(mem) = mem_of(pid) {
            hwm_kib = hwm_kib.max(mem.hwm_kib);
        }
        if out_bytes.load(Ordering::Relaxed) >= bytes + 6 || child.try_wait()?.is_some() {
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    if let Ok(mem) = mem_of(pid) {
        hwm_kib = hwm_kib.max(mem.hwm_kib);
    }
    let _ = close_tx.send(());
    let written = writer.join().map_err(|_| "the writer thread panicked")?;
    let deadline = Instant::now() + Duration::from_secs(30);
    let status = loop {
        if let Some(status) = child.try_wait()? {
            break Some(status);
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let (out_total, mismatch) = reader.join().map_err(|_| "the reader thread panicked")?;
    let stderr_text = errors.join().map_err(|_| "the stderr thread panicked")?;
    if let Err(e) = written {
        return Err(format!("writing to annotate failed: {e}; its stderr: {stderr_text}").into());
    }
    Ok(AnnotateRun {
        out_bytes: out_total,
        mismatch,
        exit: status
            .and_then(|s| s.code())
            .map_or("(killed after 30 s)".to_owned(), |c| c.to_string()),
        warnings: stderr_text
            .lines()
            .filter(|l| l.contains("warning"))
            .count(),
        hwm_kib,
        wall: started.elapsed(),
    })
}

// === the checker's own test ===

/// What `field` injection makes of a script, done here independently of
/// the proxy: each progress-carrying event gets its members before the
/// closing brace of its JSON.
fn inject_field(script: &Script, upto: usize) -> Vec<u8> {
    let mut out = Vec::new();
    for (event, progress) in script.events[..upto].iter().zip(&script.progress) {
        let Some(brace) = memchr::memrchr(b'}', event).filter(|_| !progress.is_empty()) else {
            out.extend_from_slice(event);
            continue;
        };
        out.extend_from_slice(&event[..brace]);
        if progress.len() > 1 {
            let list: Vec<String> = progress.iter().map(Value::to_string).collect();
            let _ = write!(out, ",\"toolCallsProgress\":[{}]", list.join(","));
            let _ = write!(
                out,
                ",\"toolCallProgress\":{}",
                list.last().map_or("", |s| s)
            );
        } else {
            let _ = write!(out, ",\"toolCallProgress\":{}", progress[0]);
        }
        out.extend_from_slice(&event[brace..]);
    }
    out
}

/// Shows the checks are not vacuous: a stream as the proxy should send it
/// passes, and each kind of damage the load test looks for is caught.
fn self_check() -> Result<(), Error> {
    let key = 42;
    let plan = Plan {
        key,
        kind: Kind::Normal,
        fragments: 10,
        hold: Hold::None,
        bytes: 0,
        stall: Duration::ZERO,
        named: true,
    };
    let other = script(key + 1, Kind::Normal, 10, 0);
    let script = script(key, Kind::Normal, 10, 0);
    let n = script.events.len();
    let good = inject_field(&script, n);
    let fetched = || Fetched {
        head: Some(Head {
            status: 200,
            headers: vec![("x-aalis-session".to_owned(), session_of(key))],
        }),
        complete: true,
        error: None,
        ended: Some(Instant::now()),
    };
    let passes = |body: &[u8], fetched: &Fetched| {
        // Its own report: the failures it prints are the point here.
        let scratch = Report {
            quiet: true,
            ..Report::default()
        };
        check_stream(&plan, false, fetched, body, None, &scratch).ok
    };
    if !passes(&good, &fetched()) {
        return Err("checker self-test: a correct stream is rejected".into());
    }
    let injected = |script: &Script, i: usize| {
        inject_field(script, i + 1)[inject_field(script, i).len()..].to_vec()
    };
    let mut damaged: Vec<(&str, Vec<u8>, bool)> = Vec::new();
    let mut flipped = good.clone();
    flipped[good.len() / 2] ^= 0x20;
    damaged.push(("a changed byte", flipped, true));
    let mut dropped = good.clone();
    dropped.remove(good.len() / 2);
    damaged.push(("a lost byte", dropped, true));
    let swapped: Vec<u8> = (0..n)
        .map(|i| match i {
            6 => injected(&script, 7),
            7 => injected(&script, 6),
            _ => injected(&script, i),
        })
        .collect::<Vec<_>>()
        .concat();
    damaged.push(("two events swapped", swapped, true));
    let doubled: Vec<u8> = (0..n)
        .flat_map(|i| {
            if i == 6 {
                vec![injected(&script, i); 2]
            } else {
                vec![injected(&script, i)]
            }
        })
        .collect::<Vec<_>>()
        .concat();
    damaged.push(("an event twice", doubled, true));
    let crossed: Vec<u8> = (0..n)
        .map(|i| {
            if i == 6 {
                injected(&other, i)
            } else {
                injected(&script, i)
            }
        })
        .collect::<Vec<_>>()
        .concat();
    damaged.push(("another stream's event", crossed, true));
    let renamed = String::from_utf8_lossy(&good)
        .replacen(
            "\"name\":\"tool_42_0\",\"charsAccumulated\":0}",
            "\"name\":\"tool_43_0\",\"charsAccumulated\":0}",
            1,
        )
        .into_bytes();
    damaged.push(("progress naming another stream's tool", renamed, true));
    let miscounted = String::from_utf8_lossy(&good)
        .replacen("\"charsAccumulated\":0}", "\"charsAccumulated\":1}", 1)
        .into_bytes();
    damaged.push(("a wrong charsAccumulated", miscounted, true));
    // Inside `delta` instead of at the top level (event 3 announces call 0).
    let mut in_delta = good[..inject_field(&script, 3).len()].to_vec();
    let event = &script.events[3];
    let delta_end = memmem::find(event, b"]}")
        .map(|i| i + 1)
        .ok_or("no delta end")?;
    in_delta.extend_from_slice(&event[..delta_end]);
    let _ = write!(in_delta, ",\"toolCallProgress\":{}", script.progress[3][0]);
    in_delta.extend_from_slice(&event[delta_end..]);
    in_delta.extend_from_slice(&good[inject_field(&script, 4).len()..]);
    damaged.push(("progress inside delta", in_delta, true));
    damaged.push(("a cut stream reported complete", good.clone(), false));
    let mut caught = 0;
    for (what, body, complete) in &damaged {
        let mut f = fetched();
        if !complete {
            f.complete = false;
        }
        if passes(body, &f) {
            return Err(format!("checker self-test: {what} is not caught").into());
        }
        caught += 1;
    }
    println!(
        "checker self-test: a correct stream passes; {caught} of {} kinds of damage caught",
        damaged.len()
    );
    Ok(())
}
