//! The command line: what the user typed (clap derive structs), and its
//! translation into validated configuration for the library.
//!
//! The doc comment of each item is its help: the first line is the short
//! help (`-h`), the rest the long help (`--help`) and the man page, which is
//! generated from [`command`] (see `tests/man.rs`).

// Doc comments here are help text first: URLs stay bare so `--help` and
// the man page show them as typed.
#![allow(rustdoc::bare_urls)]

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, CommandFactory, Parser, Subcommand};

use crate::encode::{InjectMode, OutputFormat};
use crate::pipeline::AnnotatorConfig;
use crate::proxy::ProxyConfig;
use crate::proxy::server::Sched;
use crate::proxy::upstream::{Upstream, UpstreamConfigError};
use crate::render::spinner::ProgressMode;

/// The most `serve --threads` takes (each thread is a runtime of its own).
pub const MAX_THREADS: i64 = 1024;

/// Tool-call progress for LLM chat streams
///
/// While a model streams a tool call, OpenAI-compatible APIs send only
/// argument fragments and no text, so chat front ends look frozen.
/// aalis-proxy turns those fragments into toolCallProgress events
/// {index, name, charsAccumulated} without changing a byte of the stream.
#[derive(Debug, Parser)]
#[command(name = "aalis-proxy", version, propagate_version = true)]
#[command(after_long_help = EXIT_STATUS_AND_ENVIRONMENT)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

const EXIT_STATUS_AND_ENVIRONMENT: &str = "\
Exit status:
  0    success, also when stdout is closed early (e.g. `| head -1`)
  1    the input could not be opened or read, or the output written; serve
       or mock could not start (the port taken, a CA or capture file)
  2    usage error: unknown flag, bad value, missing argument, flags that
       cannot go together
  130  annotate or demo interrupted by SIGINT (it dies of the signal, as a
       shell reports, its spinners first ended with their ✗ line); serve and
       mock shut down gracefully on SIGINT, SIGTERM or SIGHUP and exit 0; a second
       signal stops serve at once, its open streams cut, with 130

Environment:
  RUST_LOG           serve's and mock's log filter, in tracing's EnvFilter
                     syntax (`debug`, `aalis_proxy=trace`); set and not
                     empty, it overrides -v; one that is not a filter is
                     said, and ignored
  NO_COLOR           set and not empty: no colour in the log or the spinners
  TERM               `dumb` (or unset): no spinners are drawn, as on a
                     stderr that is not a terminal (--progress=always prints
                     plain lines instead)
  _RJEM_MALLOC_CONF  settings of the allocator (jemalloc), over those it
                     was built with
  AALIS_ADMIN_TOKEN  set and not empty: serve's --admin-token, out of the
                     process list (the flag wins)
  HTTP_PROXY, HTTPS_PROXY and the system's CA store are not read: serve
  connects to --upstream directly, trusting the bundled web PKI roots and
  those of --upstream-ca.";

#[derive(Debug, Subcommand)]
pub enum Command {
    Annotate(AnnotateArgs),
    Serve(ServeArgs),
    Mock(MockArgs),
    Demo(DemoArgs),
}

/// Read a chat stream, write it back with tool-call progress
///
/// Reads an OpenAI-style SSE stream (`data:` events) or an Ollama NDJSON
/// stream (one JSON object per line), detected from its first bytes, from
/// FILE or stdin, and writes the result to stdout event by event, flushed,
/// so it works live in a pipe. Events that cannot be understood are passed
/// on unchanged and reported on stderr with their event number and byte
/// offset. When its input is a pipe, it widens that pipe to 1 MiB (or the
/// system's limit), so a fast writer is read in large pieces.
#[derive(Debug, Args)]
#[command(after_long_help = ANNOTATE_EXAMPLES, display_name = "aalis-proxy")]
pub struct AnnotateArgs {
    /// The stream to read; `-` or nothing reads stdin
    #[arg(value_name = "FILE")]
    pub file: Option<PathBuf>,

    /// What to write on stdout
    ///
    /// `sse` forwards the input byte for byte with progress injected as
    /// --inject says; `ndjson` writes one ChatStreamChunk per line
    /// ({"contentDelta":…}, {"toolCallProgress":{…}}, then
    /// {"done":true,"toolCalls":[…],"usage":{…}}); `messages` writes one
    /// StreamChunkMessage per line for --session.
    ///
    /// Example: --format ndjson
    #[arg(long, value_enum, default_value_t = OutputFormat::Sse, value_name = "FORMAT")]
    pub format: OutputFormat,

    /// How progress is added to the forwarded stream, with --format sse
    /// (the other formats refuse it) [default: field]
    ///
    /// `field` is safe for every SDK: the chunk that carried the tool-call
    /// delta gets a top-level "toolCallProgress":{…} before its closing
    /// brace, nothing else changes; it holds an event that arrives in
    /// several reads until its end. The others write after an event, so
    /// its bytes go out as they come. NDJSON input takes only `field` and
    /// `none`.
    ///
    /// Example: --inject comment
    #[arg(long, value_enum, value_name = "MODE")]
    pub inject: Option<InjectMode>,

    /// Session id written in every line of --format messages (required
    /// there, refused with other formats): 1 to 128 visible ASCII
    /// characters, not . or .., as serve takes X-Aalis-Session
    ///
    /// Example: --format messages --session chat-42
    #[arg(long, value_name = "ID", required_if_eq("format", "messages"))]
    pub session: Option<String>,

    /// Replay the input in real time: with the timing recorded beside it
    /// (FILE.timing, as `serve --record` writes), or one event every --pace
    ///
    /// The whole input is read first, then played, so spinners (with
    /// --progress) show the elapsed times the stream really had.
    ///
    /// Example: --realtime --progress
    #[arg(long)]
    pub realtime: bool,

    /// With --realtime, the pause between events when the input has no
    /// recorded timing (implies --realtime) [default: 100]
    ///
    /// Example: --pace 200
    #[arg(long, value_name = "MS", allow_negative_numbers = true, value_parser = parse_millis)]
    pub pace: Option<u64>,

    #[command(flatten)]
    pub stream: StreamFlags,
}

/// Flags of every command that reads streams (`annotate`, `serve`).
#[derive(Debug, Args)]
pub struct StreamFlags {
    /// Events (SSE) or lines (NDJSON) larger than this are passed on as they
    /// stream, unparsed, with a warning; memory stays bounded whatever the
    /// input
    ///
    /// Sizes are a number with an optional unit: B, KiB, MiB, GiB (K, M, G
    /// too, all powers of 1024).
    ///
    /// Example: --max-event-bytes 64MiB
    #[arg(long, value_name = "SIZE", default_value = "16MiB", allow_negative_numbers = true, value_parser = parse_bytes)]
    pub max_event_bytes: usize,

    /// Spinners on stderr, one per tool being generated
    ///
    /// `auto` (what --progress alone means) draws them when stderr is a
    /// terminal (one that can move its cursor: not TERM=dumb); `always`
    /// also prints plain lines (at most one per tool per second) when it is
    /// not, for logs; `never` is the default. stdout is
    /// never touched. NO_COLOR is honoured. Stopped by Ctrl-C or SIGTERM,
    /// annotate ends each spinner with its ✗ line, then dies of the signal;
    /// serve ends each as its stream ends, and a second signal ends those
    /// left with ✗.
    ///
    /// Example: --progress
    #[arg(
        long,
        value_enum,
        value_name = "WHEN",
        num_args = 0..=1,
        require_equals = true,
        default_value_t = ProgressMode::Never,
        default_missing_value = "auto"
    )]
    pub progress: ProgressMode,
}

/// `--realtime` without `--pace` nor timing: one event every this many ms.
const DEFAULT_PACE_MS: u64 = 100;

const ANNOTATE_EXAMPLES: &str = "\
Examples:
  Watch progress live while a model streams:
    curl -N https://api.example.com/v1/chat/completions ... | aalis-proxy annotate
  Only the progress, one JSON object per line:
    aalis-proxy annotate capture.sse --format ndjson | grep toolCallProgress
  Progress as SSE comments, invisible to SDK iterators:
    aalis-proxy annotate --inject comment < capture.sse
  Watch a recorded stream again, with its timing and spinners:
    aalis-proxy annotate --realtime --progress recorded.sse > /dev/null";

impl AnnotateArgs {
    /// Checks what clap cannot express: --session means something only with
    /// --format messages, so anywhere else it is a mistake worth saying.
    pub fn validate(&self) -> Result<(), clap::Error> {
        if self.session.is_some() && self.format != OutputFormat::Messages {
            let kind = clap::error::ErrorKind::ArgumentConflict;
            return Err(annotate_error(
                kind,
                "--session applies only to --format messages",
            ));
        }
        // The line formats write progress as lines of their own: an
        // injection mode would be ignored without a word.
        if self.inject.is_some() && self.format != OutputFormat::Sse {
            let kind = clap::error::ErrorKind::ArgumentConflict;
            return Err(annotate_error(
                kind,
                "--inject applies only to --format sse (the default)",
            ));
        }
        // As serve takes X-Aalis-Session.
        if let Some(problem) = self
            .session
            .as_deref()
            .and_then(|session| crate::proxy::service::session_id_problem(session.as_bytes()))
        {
            let kind = clap::error::ErrorKind::ValueValidation;
            return Err(annotate_error(kind, &format!("--session {problem}")));
        }
        Ok(())
    }

    /// [`validate`](Self::validate), and what only the words typed (`args`,
    /// without the program name) tell: `--progress always` reads a file
    /// named `always` (the value takes an `=`), said unless there is one.
    pub fn validate_typed(&self, args: &[String]) -> Result<(), clap::Error> {
        self.validate()?;
        if let Some(file) = self.input_path().and_then(|p| p.to_str())
            && progress_value_after_a_space(args) == Some(file)
            && !std::path::Path::new(file).exists()
        {
            let kind = clap::error::ErrorKind::InvalidValue;
            let message = format!(
                "no input file {file:?}; give --progress its value with '=': --progress={file}"
            );
            return Err(annotate_error(kind, &message));
        }
        Ok(())
    }

    /// The pipeline configuration these flags ask for.
    pub fn annotator_config(&self) -> AnnotatorConfig {
        AnnotatorConfig {
            output: self.format,
            inject: self.inject.unwrap_or(InjectMode::Field),
            session_id: self.session.clone(),
            framing: None,
            max_event_bytes: self.stream.max_event_bytes,
            collect_events: false,
        }
    }

    /// The pause between events of a replay when the input has no timing,
    /// or `None` for a live run.
    pub fn replay_pace(&self) -> Option<Duration> {
        (self.realtime || self.pace.is_some())
            .then(|| Duration::from_millis(self.pace.unwrap_or(DEFAULT_PACE_MS)))
    }

    /// The input path, `None` for stdin.
    pub fn input_path(&self) -> Option<&std::path::Path> {
        self.file.as_deref().filter(|p| p.as_os_str() != "-")
    }
}

/// Forward requests to an upstream API and inject progress into its streams
///
/// A reverse proxy: point any OpenAI-compatible client's base URL at
/// http://127.0.0.1:8787/v1 and every request goes to --upstream, headers
/// and body as sent (Authorization included, never logged). Streamed
/// responses (text/event-stream; NDJSON as application/x-ndjson, application/ndjson or
/// application/jsonl) are passed on as they
/// arrive, with progress injected as --inject (or the request header
/// X-Aalis-Inject) says; every other response passes through untouched. The
/// request header X-Aalis-Session names the session, 1 to 128 visible ASCII
/// characters, not . or .. (one is generated and returned in that response
/// header when absent).
///
/// Errors are OpenAI-style JSON: 400 for a bad or repeated X-Aalis-Session
/// or X-Aalis-Inject, for two Host headers or an HTTP/1.1 request without
/// one (or an HTTP/2 Host that names another target than :authority), for
/// Transfer-Encoding chunked twice, or for a request body framed wrong or cut by the client, 501 for a protocol upgrade (WebSocket, not tunnelled)
/// or a request body in a transfer coding besides chunked (gzip, chunked; one that does not end
/// in chunked is a 400 of the HTTP parser's), 502 when the upstream is unreachable, 504 when it sends no response
/// headers in time, 408 when the client stops sending its request body,
/// 508 when a request comes back to this proxy (its own entry in the Via
/// header it adds: --upstream leads here); a
/// request head over 64 KiB or 100 header fields gets 431 (over HTTP/1.1
/// with an empty body). A client that half-closes its connection after
/// its request is taken for gone, as nginx takes it (499). A client connection that sends nothing
/// within 30 s is closed, as is one whose HTTP/1.1 request head does not
/// come whole within 30 s of its first bytes (or of its last response's
/// end), or an HTTP/2 one with no request open for 30 s (a GOAWAY; dropped
/// if still open 30 s later). SIGINT or SIGTERM (or SIGHUP) stops accepting connections and lets open
/// streams finish for --shutdown-grace (an events subscriber, the streams it
/// follows), then exits 0.
///
/// The log and the --progress spinners are written to stderr by threads of
/// their own: a stderr nobody reads, or a terminal paused with Ctrl-S, stops
/// no stream.
///
/// Its own routes, under /_aalis/ (loopback clients that ask for a loopback
/// Host only, unless --admin-token; no CORS headers): GET /_aalis/ a live status page; GET /_aalis/sessions
/// the sessions with something in progress, and /_aalis/events every
/// session's frames as SSE; GET /_aalis/sessions/{id} a session's
/// stream_resume snapshot, and /_aalis/sessions/{id}/events that snapshot
/// then every increment as SSE (what a UI that reconnects resumes from);
/// POST /_aalis/tool-execute with {sessionId, toolName, args, phase}
/// (Content-Type: application/json, else 415) clears a session on phase
/// "start"; GET /_aalis/metrics Prometheus text.
/// README.md's "Resume after reconnect" has the frames.
#[derive(Debug, Args)]
#[command(after_long_help = SERVE_EXAMPLES, display_name = "aalis-proxy")]
pub struct ServeArgs {
    /// The upstream API: http:// or https://, with an optional path prefix
    ///
    /// The URL's path is a prefix of the request path: a request path that
    /// already starts with it (at a segment boundary) is kept, any other
    /// gets it put in front. With https://api.example.com/v1, both
    /// /v1/chat/completions and /chat/completions go to
    /// https://api.example.com/v1/chat/completions.
    /// Under such a prefix, a request path with a `.` or `..` segment (also
    /// written %2e, or with parameters: `..;x`) gets 400: the upstream could
    /// resolve it outside the prefix.
    ///
    /// Example: --upstream https://api.openai.com
    #[arg(long, value_name = "URL")]
    pub upstream: String,

    /// Address to listen on; anything but loopback must be given here
    ///
    /// An IP address and a port (host names are not looked up); port 0
    /// lets the system pick one, which the "listening on" line says and
    /// stdout gets as one line, `http://ADDR`, whatever RUST_LOG is.
    ///
    /// Example: --listen 127.0.0.1:9000
    #[arg(long, value_name = "ADDR", default_value = "127.0.0.1:8787", value_parser = parse_listen)]
    pub listen: SocketAddr,

    /// How progress is added to streams (a request may choose with the
    /// X-Aalis-Inject header)
    ///
    /// Example: --inject comment
    #[arg(long, value_enum, default_value_t = InjectMode::Field, value_name = "MODE")]
    pub inject: InjectMode,

    /// A PEM file of CA certificates to trust for the upstream, besides the
    /// bundled web PKI roots
    ///
    /// The upstream's own certificate must not be a CA's: a self-signed one
    /// made by `openssl req -x509` is (CA:TRUE) unless it is made with
    /// `-addext basicConstraints=critical,CA:FALSE`, and is refused, with a
    /// 502 that says so; or sign the server's certificate with a CA of its
    /// own and give that CA here.
    ///
    /// Example: --upstream-ca internal-ca.pem
    #[arg(long, value_name = "FILE")]
    pub upstream_ca: Option<PathBuf>,

    /// Deadline for connecting to the upstream (name lookup, TCP and TLS);
    /// past it, 504
    ///
    /// Durations are a number with an optional unit: ms, s (the default), m;
    /// a timeout must be longer than 0.
    ///
    /// Example: --connect-timeout 5s
    #[arg(long, value_name = "DURATION", default_value = "10s", value_parser = parse_timeout)]
    pub connect_timeout: Duration,

    /// Deadline for the upstream's response headers; past it, 504
    ///
    /// It counts from the request's end: while the request body is still
    /// being sent, it starts again each time the body moves. A client that
    /// stops sending its body for as long gets 408, an upstream that stops
    /// reading it 504.
    ///
    /// Example: --response-timeout 2m
    #[arg(long, value_name = "DURATION", default_value = "10m", value_parser = parse_timeout)]
    pub response_timeout: Duration,

    /// Longest silence of the upstream in the middle of a response; past it
    /// the stream ends (cut, not completed) and its session is cleared.
    /// Also the longest a failed upstream's cut waits for an HTTP/1.1 client
    /// that has not yet taken the bytes that came before it
    ///
    /// Example: --idle-timeout 90s
    #[arg(long, value_name = "DURATION", default_value = "5m", value_parser = parse_timeout)]
    pub idle_timeout: Duration,

    /// Longest a client may leave the bytes sent to it unread; past it its
    /// connection is closed, its upstream request cancelled and its stream
    /// ended
    ///
    /// Counted by the kernel (TCP_USER_TIMEOUT, Linux): bytes that wait
    /// behind the client's shut TCP window this long, or unacknowledged
    /// (a remote client cut off from the network). Over HTTP/2, also a
    /// connection whose every open response waits behind the client's shut
    /// flow-control windows (HTTP/2 clients open a window once half of it
    /// is read: about 32 KiB). A client that reads is left alone as long
    /// as its kernel reopens its window within the timeout: Linux reopens a
    /// shut window only once a sixteenth of the client's receive buffer is
    /// free (the buffer grows up to net.ipv4.tcp_rmem's maximum, 6 MiB by
    /// default: up to 384 KiB), so a client that reads less than that in
    /// --client-timeout is taken for one that stopped.
    /// At most 2147483647ms (about 24.8 days: the kernel's bound).
    ///
    /// Example: --client-timeout 1m
    #[arg(long, value_name = "DURATION", default_value = "5m", value_parser = parse_client_timeout)]
    pub client_timeout: Duration,

    /// After SIGINT, SIGTERM or SIGHUP, how long open streams may go on (a second
    /// signal cuts them at once; their --record files keep what came until
    /// then, and the exit waits up to 5 s more for recordings to be written)
    ///
    /// Example: --shutdown-grace 30s
    #[arg(long, value_name = "DURATION", default_value = "10s", value_parser = parse_duration)]
    pub shutdown_grace: Duration,

    /// Threads that serve connections, 1 to 1024 [default: one per CPU]
    ///
    /// Each thread runs an event loop of its own and accepts connections for
    /// itself; a new connection goes to a thread with the fewest open ones,
    /// and stays on the thread that accepted it.
    ///
    /// Example: --threads 1
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u16).range(1..=MAX_THREADS))]
    pub threads: Option<u16>,

    /// How the kernel schedules the process (Linux): batch or inherit
    ///
    /// batch (the default) runs every thread of it as SCHED_BATCH when it
    /// runs under the default policy: a thread that an event wakes waits for the
    /// task running on its CPU to end its turn instead of cutting in (on an
    /// idle CPU it runs at once), so the upstream and the client are not
    /// cut off mid-write, and on a busy machine a thread takes several
    /// events at once, for less CPU each. While every CPU is busy, an event
    /// can then wait for the running task to sleep or end its turn
    /// (milliseconds: a scheduler tick, a time slice). inherit keeps
    /// the policy the process was started with (chrt). Neither needs a
    /// privilege, nor changes the nice value; elsewhere than Linux with
    /// glibc both do nothing.
    ///
    /// Example: --sched inherit
    #[arg(long, value_enum, default_value_t = Sched::Batch, value_name = "POLICY")]
    pub sched: Sched,

    #[command(flatten)]
    pub stream: StreamFlags,

    /// Forget a session nothing uses after this much idleness (sessions of
    /// open streams and of live subscribers are kept)
    ///
    /// Example: --session-ttl 30m
    #[arg(long, value_name = "DURATION", default_value = "10m", value_parser = parse_duration)]
    pub session_ttl: Duration,

    /// Let clients that are not on loopback, or that ask for a Host other
    /// than localhost, 127.x.y.z or `[::1]` (a proxy in front that keeps its
    /// own), use the /_aalis/ routes with `Authorization: Bearer TOKEN`
    /// (without it they get 403)
    ///
    /// A browser, which sends no such header, opens the status page once as
    /// /_aalis/?token=TOKEN: it gets the token as a cookie (HttpOnly,
    /// SameSite=Strict, for /_aalis only) and the page at /_aalis/, and the
    /// cookie lets the page and its event stream in from then on.
    ///
    /// On the command line, the token is in the process list for any user
    /// of the machine to read: the environment variable AALIS_ADMIN_TOKEN,
    /// set and not empty, keeps it out (the flag, if given, wins).
    ///
    /// Example: --admin-token "$(openssl rand -hex 16)"
    #[arg(long, value_name = "TOKEN", value_parser = parse_token)]
    pub admin_token: Option<String>,

    /// Save every streamed upstream response in DIR as a replayable capture
    ///
    /// Per stream: the body as the upstream sent it (.sse or .ndjson), its
    /// timing (.timing, for `annotate --realtime` and `mock`, with the
    /// status when it is not 200, which `mock` answers with), and the
    /// request body (.request.json; headers are never saved). File names
    /// are `<unix ms>-<session>-<n>`, with the session reduced to safe
    /// characters. Request bodies stream on as usual; their first MiB is
    /// kept. The body has `.partial` added to its name until the other two
    /// files are written: a recording its process could not finish
    /// (killed), or one a write failed for (a full disk; it stops there),
    /// keeps it, which `mock` skips (a killed one's .request.json and
    /// .timing, made at the start to hold the name, stay empty); a sidecar
    /// not written whole is removed (a cut recording then stays .partial). A response that
    /// stopped before its end (the upstream failed, the client left, serve
    /// exited) is kept as it came, and its .timing ends with a `# cut` line
    /// that says when: `mock` replays it cut, then. A DIR that takes no
    /// files fails the start.
    ///
    /// Example: --record captures/
    #[arg(long, value_name = "DIR")]
    pub record: Option<PathBuf>,

    /// More log lines on stderr: -v debug, -vv trace (a non-empty RUST_LOG
    /// overrides; one that is not a filter is said, and ignored)
    ///
    /// At the default level there is one line per request: method, path,
    /// status (499 when the client left before the answer), session,
    /// duration, bytes, tool calls, outcome (ok, cancelled, idle_timeout,
    /// upstream_error, upstream_unreachable, upstream_timeout,
    /// client_body_timeout, invalid_request_error, not_implemented,
    /// loop_detected; for the /_aalis/ routes, whose line is written as
    /// their answer's head goes out (an events stream's when it ends, with
    /// its bytes), forbidden, not_found or method_not_allowed too; a
    /// request head the HTTP/1.1 parser refused, answered 400 or 431
    /// (over 64 KiB or 100 fields), with method, path and session "-" and
    /// duration 0); and a warning that says why when the upstream could not be reached,
    /// answered too late or failed mid-stream. Header values are never
    /// logged. Lines are written by a thread of their own, so a stderr that
    /// nobody reads stops no stream: past 1,024 lines (or 1 MiB) waiting,
    /// lines are dropped, and a warning says how many (checked every 10 s,
    /// and at exit). A failed accept (out of file descriptors) is retried
    /// every 50 ms and warned of at most once every 10 s per worker.
    #[arg(short, long, action = clap::ArgAction::Count)]
    pub verbose: u8,
}

const SERVE_EXAMPLES: &str = "\
Examples:
  Proxy OpenAI; point the client's base URL at http://127.0.0.1:8787/v1:
    aalis-proxy serve --upstream https://api.openai.com
  A local Ollama: its OpenAI-compatible /v1 routes stream SSE, progress as SSE
  comments here; its native /api/chat streams NDJSON, which always gets field
  injection (or none):
    aalis-proxy serve --upstream http://127.0.0.1:11434 --inject comment";

impl ServeArgs {
    /// The proxy configuration these flags ask for.
    pub fn proxy_config(&self) -> Result<ProxyConfig, UpstreamConfigError> {
        let upstream = Upstream::parse(&self.upstream)?;
        if self.upstream_ca.is_some() && upstream.is_plain_http() {
            return Err(UpstreamConfigError::CaForHttp);
        }
        Ok(ProxyConfig {
            upstream,
            upstream_ca: self.upstream_ca.clone(),
            inject: self.inject,
            connect_timeout: self.connect_timeout,
            response_timeout: self.response_timeout,
            idle_timeout: self.idle_timeout,
            client_timeout: self.client_timeout,
            shutdown_grace: self.shutdown_grace,
            max_event_bytes: self.stream.max_event_bytes,
            record_dir: self.record.clone(),
            session_ttl: self.session_ttl,
            // The environment's, set and not empty (an empty one is unset,
            // as NO_COLOR's is), unless the flag gives one.
            admin_token: self.admin_token.clone().or_else(|| {
                std::env::var(ADMIN_TOKEN_ENV)
                    .ok()
                    .filter(|token| !token.is_empty())
            }),
        })
    }
}

/// Replay capture files as a fake OpenAI-compatible upstream
///
/// For demos, tests and benchmarks without an API key: POST
/// /v1/chat/completions replays an SSE capture as text/event-stream, POST
/// /api/chat an NDJSON capture as application/x-ndjson (Ollama), each event
/// byte for byte, --delay-ms apart (or with its recorded .timing); GET
/// /v1/models lists the captures. A
/// request whose "model" is a capture's file name (without extension) gets
/// that capture, any other the first of its kind; a request body over 64
/// MiB gets 413, and one that sets "stream": false 400 (it replays
/// streams only; without "stream", a stream). Without CAPTURE files,
/// captures bundled in the binary are served (parallel_tool_calls,
/// reasoning_then_tool, text_then_tool, thinking_two_tools).
#[derive(Debug, Args)]
#[command(after_long_help = MOCK_EXAMPLES, display_name = "aalis-proxy")]
pub struct MockArgs {
    /// Capture files (.sse or .ndjson bodies, as `annotate` reads them)
    ///
    /// What `serve --record` writes beside a capture (.timing, read with
    /// it; .request.json) and a .partial recording are left out, with a
    /// warning, so `mock captures/*` serves the captures alone. A capture
    /// whose .timing says it was cut is replayed cut: its bytes, then, at
    /// the time the cut line gives, the connection ends without the body's
    /// end. A file with
    /// no event in it, or none that carries text, reasoning, a tool call,
    /// usage or an error, is served all the same, byte for byte, with a
    /// warning that says so. Files only: `-` (standard input) is refused,
    /// as a capture is named by its file, and a request's model picks it by
    /// that name; save the stream to a file first.
    #[arg(value_name = "CAPTURE")]
    pub captures: Vec<PathBuf>,

    /// Address to listen on
    ///
    /// An IP address and a port (host names are not looked up); port 0
    /// lets the system pick one, which the "listening on" line says and
    /// stdout gets as one line, `http://ADDR`, whatever RUST_LOG is.
    ///
    /// Example: --listen 127.0.0.1:9001
    #[arg(long, value_name = "ADDR", default_value = "127.0.0.1:8788", value_parser = parse_listen)]
    pub listen: SocketAddr,

    /// Pause between two events of a replay, in milliseconds, for a
    /// capture without a .timing file (one recorded by serve --record is
    /// replayed with its own timing)
    ///
    /// Example: --delay-ms 200
    #[arg(long, value_name = "MS", default_value_t = 50, allow_negative_numbers = true, value_parser = parse_millis)]
    pub delay_ms: u64,

    /// More log lines on stderr: -v debug, -vv trace (a non-empty RUST_LOG
    /// overrides; one that is not a filter is said, and ignored)
    #[arg(short, long, action = clap::ArgAction::Count)]
    pub verbose: u8,
}

const MOCK_EXAMPLES: &str = "\
Examples:
  Try the proxy without an API key, in three terminals:
    aalis-proxy mock
    aalis-proxy serve --upstream http://127.0.0.1:8788
    curl -N http://127.0.0.1:8787/v1/chat/completions -d '{\"model\":\"parallel_tool_calls\"}'
  Replay your own capture slowly:
    aalis-proxy mock capture.sse --delay-ms 500";

/// Show the whole path in about ten seconds, with nothing but this binary
///
/// Starts a built-in upstream that replays the bundled captures (parallel
/// tool calls, reasoning then a tool, text then a tool, Ollama thinking then
/// two tools) and the proxy in front of it, on loopback ports the system
/// picks, then sends one streamed request per capture through the proxy.
/// Spinners show each tool on stderr as its arguments stream (plain lines
/// when stderr is not a terminal); stdout gets a summary of what the client
/// received, or the annotated streams with --stream. No API key, no network.
#[derive(Debug, Args)]
#[command(display_name = "aalis-proxy")]
pub struct DemoArgs {
    /// Pause between two events of each replayed capture
    ///
    /// Example: --delay-ms 50
    #[arg(long, value_name = "MS", default_value_t = 150, allow_negative_numbers = true, value_parser = parse_millis)]
    pub delay_ms: u64,

    /// Write the annotated streams on stdout as they arrive, instead of summaries
    #[arg(long)]
    pub stream: bool,

    /// Spinners on stderr: `always` (the default here) draws them on a
    /// terminal and prints plain lines otherwise
    ///
    /// Example: --progress=never
    #[arg(
        long,
        value_enum,
        value_name = "WHEN",
        num_args = 0..=1,
        require_equals = true,
        default_value_t = ProgressMode::Always,
        default_missing_value = "auto"
    )]
    pub progress: ProgressMode,
}

/// Parses `512`, `64KiB`, `16MiB`, `1GiB` (or `K`, `M`, `G`, `KB`, `MB`,
/// `GB`: all powers of 1024) into bytes; at least 1.
pub fn parse_bytes(text: &str) -> Result<usize, String> {
    let bad = || format!("{text:?} is not a size (examples: 4096, 64KiB, 16MiB)");
    let trimmed = text.trim();
    let split = trimmed
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(trimmed.len());
    let (number, unit) = trimmed.split_at(split);
    let scale: usize = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kb" | "kib" => 1 << 10,
        "m" | "mb" | "mib" => 1 << 20,
        "g" | "gb" | "gib" => 1 << 30,
        _ => return Err(bad()),
    };
    if number.is_empty() {
        return Err(bad());
    }
    let too_large = || format!("{text:?} is too large (at most {} bytes)", usize::MAX);
    let number: usize = number.parse().map_err(|_| too_large())?;
    match number.checked_mul(scale) {
        Some(0) => Err(format!(
            "{text:?} is not a size: it must be at least 1 byte"
        )),
        None => Err(too_large()),
        Some(bytes) => Ok(bytes),
    }
}

/// Parses a whole number of milliseconds, 0 or more (`--pace`,
/// `--delay-ms`). The flags take negative numbers as their value, so that
/// `-1` is said to be out of range, not taken for a flag.
pub fn parse_millis(text: &str) -> Result<u64, String> {
    let trimmed = text.trim();
    if let Ok(ms) = trimmed.parse() {
        return Ok(ms);
    }
    let digits = trimmed.strip_prefix('+').unwrap_or(trimmed);
    if !digits.is_empty() && digits.bytes().all(|b| b.is_ascii_digit()) {
        return Err(format!("{text:?} is too large (at most {} ms)", u64::MAX));
    }
    Err(format!(
        "{text:?} is not a number of milliseconds (a whole number, 0 or more: 200)"
    ))
}

/// Parses `250ms`, `1.5s`, `2m` or a bare number of seconds.
pub fn parse_duration(text: &str) -> Result<Duration, String> {
    let text = text.trim();
    let (number, scale) = if let Some(n) = text.strip_suffix("ms") {
        (n, 0.001)
    } else if let Some(n) = text.strip_suffix('s') {
        (n, 1.0)
    } else if let Some(n) = text.strip_suffix('m') {
        (n, 60.0)
    } else {
        (text, 1.0)
    };
    let value: f64 = number
        .trim()
        .parse()
        .map_err(|_| format!("{text:?} is not a duration (examples: 250ms, 10s, 2m)"))?;
    if !value.is_finite() || value < 0.0 {
        return Err(format!(
            "{text:?} is not a duration (examples: 250ms, 10s, 2m)"
        ));
    }
    let duration =
        Duration::try_from_secs_f64(value * scale).map_err(|e| format!("{text:?}: {e}"))?;
    // Beyond a year a timeout means "never"; larger values would overflow
    // clock arithmetic.
    if duration > MAX_DURATION {
        return Err(format!("{text:?} is longer than a year"));
    }
    Ok(duration)
}

/// [`parse_duration`] for a deadline, which must be longer than 0: a
/// timeout of 0 would fail every request.
pub fn parse_timeout(text: &str) -> Result<Duration, String> {
    match parse_duration(text)? {
        Duration::ZERO => Err(format!(
            "{:?}: a timeout must be longer than 0 (examples: 250ms, 10s, 2m)",
            text.trim()
        )),
        duration => Ok(duration),
    }
}

/// Parses `--client-timeout`: a timeout the kernel can hold
/// (`TCP_USER_TIMEOUT` takes an `int` of milliseconds: about 24.8 days).
fn parse_client_timeout(text: &str) -> Result<Duration, String> {
    let limit = parse_timeout(text)?;
    if limit.as_millis() > i32::MAX as u128 {
        return Err(format!(
            "{:?} is longer than the kernel's bound, 2147483647ms (about 24.8 days)",
            text.trim()
        ));
    }
    Ok(limit)
}

/// Parses `--listen`: an IP address and a port (host names are not looked
/// up: which address a name gives is not the user's choice to leave to a
/// resolver, for a proxy that must stay on loopback unless told).
fn parse_listen(text: &str) -> Result<SocketAddr, String> {
    text.trim().parse().map_err(|_| {
        format!(
            "{text:?} is not an IP address and port (examples: 127.0.0.1:8787, [::1]:8787, \
             0.0.0.0:8787; host names are not looked up)"
        )
    })
}

/// The environment variable that gives `--admin-token` out of the process
/// list.
pub const ADMIN_TOKEN_ENV: &str = "AALIS_ADMIN_TOKEN";

/// Parses `--admin-token`: not empty (no request could send it, so the
/// routes would be closed to every client off loopback, silently).
fn parse_token(text: &str) -> Result<String, String> {
    match text.is_empty() {
        true => Err("an empty token lets no one in; give a token, or leave the flag out".into()),
        false => Ok(text.to_owned()),
    }
}

/// The longest duration a flag accepts.
const MAX_DURATION: Duration = Duration::from_secs(366 * 24 * 3600);

/// A usage error as one line, for `aalis-proxy: error: …`: clap's message
/// with its line breaks folded, clap's tip if it has one (a similar flag or
/// subcommand), and where to read more. The rest of clap's multi-line block
/// (usage, "for more information") is for help, not for errors in a log.
///
/// `args` are the words the user typed (without the program name): the
/// subcommand among them says which `--help` to point to.
pub fn usage_error_line(err: &clap::Error, args: &[String]) -> String {
    let rendered = err.render().to_string();
    let mut paragraphs = rendered.split("\n\n");
    let message = paragraphs.next().unwrap_or_default();
    let message = message.strip_prefix("error: ").unwrap_or(message);
    let mut line = message.split_whitespace().collect::<Vec<_>>().join(" ");
    for tip in paragraphs
        .flat_map(str::lines)
        .map(str::trim)
        .filter(|l| l.starts_with("tip: "))
    {
        line.push_str("; ");
        line.push_str(&tip.split_whitespace().collect::<Vec<_>>().join(" "));
    }
    // `--progress always`: the value takes an `=` (a word after the flag
    // is an argument of its own).
    if let Some(when) = progress_value_after_a_space(args)
        && err.kind() == clap::error::ErrorKind::UnknownArgument
    {
        line.push_str(&format!(
            "; tip: give --progress its value with '=': --progress={when}"
        ));
    }
    let cmd = command();
    let subcommand = args
        .iter()
        .find(|a| cmd.get_subcommands().any(|s| s.get_name() == a.as_str()));
    match subcommand {
        Some(sub) => line.push_str(&format!(" (see 'aalis-proxy {sub} --help')")),
        None => line.push_str(" (see 'aalis-proxy --help')"),
    }
    line
}

/// An error of `annotate`'s, as clap words its own.
fn annotate_error(kind: clap::error::ErrorKind, message: &str) -> clap::Error {
    let mut cmd = command();
    cmd.build();
    match cmd.find_subcommand_mut("annotate") {
        Some(annotate) => annotate.error(kind, message),
        None => cmd.error(kind, message),
    }
}

/// A `--progress` value typed after a bare `--progress` with a space (and
/// before any `--`), which clap takes for an argument of its own.
fn progress_value_after_a_space(args: &[String]) -> Option<&str> {
    let typed = args.iter().take_while(|arg| *arg != "--");
    typed
        .clone()
        .zip(typed.skip(1))
        .find(|(flag, value)| {
            *flag == "--progress"
                && <ProgressMode as clap::ValueEnum>::from_str(value, false).is_ok()
        })
        .map(|(_, value)| value.as_str())
}

/// The clap command, for `--help`, the man page and tests.
pub fn command() -> clap::Command {
    Cli::command()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_command_definition_is_consistent() {
        command().debug_assert();
    }

    #[test]
    fn messages_needs_a_session() {
        let err = Cli::try_parse_from(["aalis-proxy", "annotate", "--format", "messages"])
            .expect_err("--session is required");
        assert_eq!(err.kind(), clap::error::ErrorKind::MissingRequiredArgument);
    }

    #[test]
    fn usage_errors_fit_on_one_line() {
        let line = |args: &[&str]| {
            let err = Cli::try_parse_from(args).expect_err("a usage error");
            let typed: Vec<String> = args[1..].iter().map(|a| a.to_string()).collect();
            usage_error_line(&err, &typed)
        };
        assert_eq!(
            line(&["aalis-proxy", "annotate", "--bogus"]),
            "unexpected argument '--bogus' found; tip: to pass '--bogus' as a value, use \
             '-- --bogus' (see 'aalis-proxy annotate --help')"
        );
        assert_eq!(
            line(&["aalis-proxy", "annotate", "--format", "messages"]),
            "the following required arguments were not provided: --session <ID> \
             (see 'aalis-proxy annotate --help')"
        );
        assert_eq!(
            line(&["aalis-proxy", "annotate", "--inject", "x"]),
            "invalid value 'x' for '--inject <MODE>' [possible values: field, comment, event, \
             chunk, none] (see 'aalis-proxy annotate --help')"
        );
        assert_eq!(
            line(&["aalis-proxy", "frobnicate"]),
            "unrecognized subcommand 'frobnicate' (see 'aalis-proxy --help')"
        );
        assert_eq!(
            line(&[
                "aalis-proxy",
                "serve",
                "--upstream",
                "http://h",
                "--progress",
                "always"
            ]),
            "unexpected argument 'always' found; tip: give --progress its value with '=': \
             --progress=always (see 'aalis-proxy serve --help')"
        );
        // Clap's tip, when it has one, is kept on the line.
        assert_eq!(
            line(&["aalis-proxy", "annotate", "--formt"]),
            "unexpected argument '--formt' found; tip: a similar argument exists: '--format' \
             (see 'aalis-proxy annotate --help')"
        );
        assert_eq!(
            line(&["aalis-proxy", "anotate"]),
            "unrecognized subcommand 'anotate'; tip: a similar subcommand exists: 'annotate' \
             (see 'aalis-proxy --help')"
        );
    }

    /// `--progress` takes its value only after `=`: the word after it is
    /// the input, as `annotate --help`'s example has it.
    #[test]
    fn progress_takes_its_value_only_after_an_equals_sign() {
        let annotate = |args: &[&str]| match Cli::try_parse_from(args).expect("parses").command {
            Command::Annotate(args) => args,
            other => panic!("not annotate: {other:?}"),
        };
        let args = annotate(&[
            "aalis-proxy",
            "annotate",
            "--realtime",
            "--progress",
            "x.sse",
        ]);
        assert_eq!(args.stream.progress, ProgressMode::Auto);
        assert_eq!(args.input_path(), Some(std::path::Path::new("x.sse")));
        let args = annotate(&["aalis-proxy", "annotate", "--progress=always", "x.sse"]);
        assert_eq!(args.stream.progress, ProgressMode::Always);
        assert_eq!(
            annotate(&["aalis-proxy", "annotate"]).stream.progress,
            ProgressMode::Never
        );
        let demo = |args: &[&str]| match Cli::try_parse_from(args).expect("parses").command {
            Command::Demo(args) => args.progress,
            other => panic!("not demo: {other:?}"),
        };
        assert_eq!(demo(&["aalis-proxy", "demo"]), ProgressMode::Always);
        assert_eq!(
            demo(&["aalis-proxy", "demo", "--progress=never"]),
            ProgressMode::Never
        );
        assert_eq!(
            demo(&["aalis-proxy", "demo", "--progress"]),
            ProgressMode::Auto
        );
    }

    #[test]
    fn sizes() {
        assert_eq!(parse_bytes("4096"), Ok(4096));
        assert_eq!(parse_bytes("64KiB"), Ok(64 << 10));
        assert_eq!(parse_bytes("16MiB"), Ok(16 << 20));
        assert_eq!(parse_bytes("1G"), Ok(1 << 30));
        for bad in [
            "",
            "0",
            "-1",
            "1.5MiB",
            "12 parsecs",
            "99999999999999999999G",
        ] {
            assert!(parse_bytes(bad).is_err(), "{bad:?}");
        }
        // What is wrong is said: a size that overflows is not "not a size".
        assert_eq!(
            parse_bytes("99999999999GiB"),
            Err(format!(
                "\"99999999999GiB\" is too large (at most {} bytes)",
                usize::MAX
            ))
        );
        assert_eq!(
            parse_bytes("0KiB"),
            Err("\"0KiB\" is not a size: it must be at least 1 byte".to_owned())
        );
        assert_eq!(
            parse_bytes("12 parsecs"),
            Err("\"12 parsecs\" is not a size (examples: 4096, 64KiB, 16MiB)".to_owned())
        );
    }

    #[test]
    fn milliseconds() {
        assert_eq!(parse_millis("0"), Ok(0));
        assert_eq!(parse_millis("200"), Ok(200));
        assert_eq!(parse_millis("+5"), Ok(5), "as u64's own parse takes it");
        assert_eq!(
            parse_millis("-1"),
            Err(
                "\"-1\" is not a number of milliseconds (a whole number, 0 or more: 200)"
                    .to_owned()
            )
        );
        assert!(parse_millis("1.5").is_err());
        assert!(parse_millis("").is_err());
        assert_eq!(
            parse_millis("99999999999999999999"),
            Err(format!(
                "\"99999999999999999999\" is too large (at most {} ms)",
                u64::MAX
            ))
        );
    }

    /// A negative pause or size is said to be out of range, not taken for
    /// a flag (clap's tip was to pass it after `--`, which made it a FILE).
    #[test]
    fn a_negative_pause_or_size_is_out_of_range_not_a_flag() {
        for args in [
            &["aalis-proxy", "annotate", "--pace", "-1"][..],
            &["aalis-proxy", "mock", "--delay-ms", "-5"],
            &["aalis-proxy", "demo", "--delay-ms", "-5"],
            &["aalis-proxy", "annotate", "--max-event-bytes", "-5"],
        ] {
            let err = Cli::try_parse_from(args).expect_err("a negative pause");
            assert_eq!(
                err.kind(),
                clap::error::ErrorKind::ValueValidation,
                "{args:?}"
            );
            let line = usage_error_line(
                &err,
                &args[1..].iter().map(|a| a.to_string()).collect::<Vec<_>>(),
            );
            assert!(
                line.contains("is not a number of milliseconds") || line.contains("is not a size"),
                "{line}"
            );
            assert!(!line.contains("tip"), "{line}");
        }
    }

    #[test]
    fn durations() {
        // --client-timeout: the kernel's int of milliseconds, no more (a
        // longer one was cut to it without a word).
        assert_eq!(
            parse_client_timeout("2147483647ms"),
            Ok(Duration::from_millis(2_147_483_647))
        );
        assert!(parse_client_timeout("2147483648ms").is_err());
        assert!(parse_client_timeout("40000m").is_err());
        assert_eq!(parse_duration("250ms"), Ok(Duration::from_millis(250)));
        assert_eq!(parse_duration("1.5s"), Ok(Duration::from_millis(1500)));
        assert_eq!(parse_duration("2m"), Ok(Duration::from_secs(120)));
        assert_eq!(parse_duration("7"), Ok(Duration::from_secs(7)));
        for bad in [
            "",
            "-1s",
            "soon",
            "NaNs",
            "1h",
            "10000000000000000000",
            "600000m",
        ] {
            assert!(parse_duration(bad).is_err(), "{bad:?}");
        }
        assert_eq!(parse_duration("0"), Ok(Duration::ZERO));
        for zero in ["0", "0s", "0ms", "0.0m"] {
            let err = parse_timeout(zero).expect_err(zero);
            assert!(err.contains("must be longer than 0"), "{zero}: {err}");
        }
        assert_eq!(parse_timeout("1ms"), Ok(Duration::from_millis(1)));
    }

    #[test]
    fn a_progress_value_after_a_space_is_explained() {
        let cli = Cli::try_parse_from(["aalis-proxy", "annotate", "--progress", "always"])
            .expect("parses: always is the input file");
        let Command::Annotate(args) = cli.command else {
            panic!("annotate parses as annotate");
        };
        let typed = |words: &[&str]| words.iter().map(|w| w.to_string()).collect::<Vec<_>>();
        let err = args
            .validate_typed(&typed(&["annotate", "--progress", "always"]))
            .expect_err("no file named always");
        let line = usage_error_line(&err, &[]);
        assert_eq!(
            line,
            "no input file \"always\"; give --progress its value with '=': --progress=always \
             (see 'aalis-proxy --help')"
        );
        // With `=` already, or after `--`, the word is a file: no hint.
        for words in [
            &["annotate", "--progress=auto", "always"][..],
            &["annotate", "--progress", "--", "always"],
        ] {
            let cli = Cli::try_parse_from([&["aalis-proxy"][..], words].concat()).expect("parses");
            let Command::Annotate(args) = cli.command else {
                panic!("annotate parses as annotate");
            };
            assert!(args.validate_typed(&typed(words)).is_ok(), "{words:?}");
        }
    }

    #[test]
    fn session_is_refused_outside_messages() {
        let cli =
            Cli::try_parse_from(["aalis-proxy", "annotate", "--session", "s"]).expect("parses");
        let Command::Annotate(args) = cli.command else {
            panic!("annotate parses as annotate");
        };
        let err = args
            .validate()
            .expect_err("--session needs --format messages");
        assert_eq!(err.kind(), clap::error::ErrorKind::ArgumentConflict);
        assert_eq!(err.exit_code(), 2);
    }

    /// `--inject` with a line format, and an empty or spaced `--session`,
    /// are usage errors (status 2): the first was ignored without a word,
    /// the second written into every line.
    #[test]
    fn inject_and_session_are_refused_where_they_mean_nothing() {
        let validate = |words: &[&str]| {
            let cli = Cli::try_parse_from([&["aalis-proxy", "annotate"], words].concat())
                .expect("parses");
            let Command::Annotate(args) = cli.command else {
                panic!("annotate parses as annotate");
            };
            args.validate().map_err(|err| err.exit_code())
        };
        for words in [
            &["--format", "ndjson", "--inject", "comment"][..],
            &[
                "--format",
                "messages",
                "--session",
                "s",
                "--inject",
                "field",
            ],
            &["--format", "messages", "--session", ""],
            &["--format", "messages", "--session", "a b"],
        ] {
            assert_eq!(validate(words), Err(2), "{words:?}");
        }
        for words in [
            &["--inject", "none"][..],
            &["--format", "ndjson"],
            &["--format", "messages", "--session", "chat-42"],
        ] {
            assert_eq!(validate(words), Ok(()), "{words:?}");
        }
    }
}
