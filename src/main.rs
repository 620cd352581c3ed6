//! The `aalis-proxy` binary: parse the command line, run, map the outcome to
//! an exit status. Everything else is library code.

use std::fs::File;
use std::io::{self, IsTerminal, Read, Write};
use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context;
use clap::Parser;

use aalis_proxy::capture::{self, Timing};
use aalis_proxy::cli::{AnnotateArgs, Cli, Command, DemoArgs, MockArgs, ServeArgs};
use aalis_proxy::error::{EXIT_FAILURE, EXIT_INTERRUPTED, EXIT_USAGE, FilterError};
use aalis_proxy::filter;
use aalis_proxy::mock::{Capture, MockUpstream};
use aalis_proxy::proxy::server::Workers;
use aalis_proxy::proxy::service::Proxy;
use aalis_proxy::proxy::sessions::SessionRegistry;
use aalis_proxy::proxy::upstream::UpstreamConfigError;
use aalis_proxy::proxy::{ProxyConfig, serve_proxy_on};
use aalis_proxy::render::spinner::{self, ProgressDisplay, ProgressMode};
use aalis_proxy::stderr_log::{self, StderrLog};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

/// jemalloc instead of the system allocator: under steady traffic its
/// resident memory reaches its working set within a minute and stays there,
/// where glibc's per-thread arenas kept touching new pages for minutes
/// (BENCHMARKS.md, "Ninth round"; issue 6's soak). A build made with
/// `--cfg aalis_system_alloc` keeps the system's, for valgrind's dhat to
/// count allocations (scripts/bench/dhat_serve.sh); never a build for use.
/// `.cargo/config.toml` builds jemalloc with thread caches tidied every
/// 4 MiB a thread allocates, not every 64 KiB (BENCHMARKS.md, "After the
/// fiftieth round, fourth session").
#[cfg(not(any(target_env = "msvc", aalis_system_alloc)))]
#[global_allocator]
static GLOBAL: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

fn main() -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(err) => return usage_error(&err),
    };
    let result = match cli.command {
        Command::Annotate(args) => {
            if let Err(err) = args.validate_typed(&typed_args()) {
                return usage_error(&err);
            }
            annotate(&args)
        }
        Command::Serve(args) => match args.proxy_config() {
            Ok(config) => serve(&args, config),
            // A bad --upstream is a usage error, like any bad flag value.
            Err(
                err @ (UpstreamConfigError::BadUrl { .. }
                | UpstreamConfigError::BadScheme { .. }
                | UpstreamConfigError::Credentials
                | UpstreamConfigError::CaForHttp),
            ) => {
                return usage_error_text(&err.to_string(), "serve");
            }
            Err(err) => Err(err.into()),
        },
        Command::Mock(args) => mock(&args),
        Command::Demo(args) => demo(&args),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            // stdout closed by its reader (`| head -1`): we are done, quietly.
            if is_broken_pipe(&err) {
                return ExitCode::SUCCESS;
            }
            say_error(format_args!("{err:#}"));
            ExitCode::from(EXIT_FAILURE)
        }
    }
}

/// Help and version go to stdout as clap prints them; a usage error is one
/// line on stderr and status 2.
fn usage_error(err: &clap::Error) -> ExitCode {
    use clap::error::ErrorKind;
    match err.kind() {
        ErrorKind::DisplayHelp
        | ErrorKind::DisplayVersion
        | ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand => {
            match err.print() {
                // `--help | head -1`: done, as for any output.
                Err(write) if write.kind() != io::ErrorKind::BrokenPipe => {
                    say_error(format_args!("cannot write the output: {write}"));
                    ExitCode::from(EXIT_FAILURE)
                }
                _ => ExitCode::from(u8::try_from(err.exit_code()).unwrap_or(EXIT_USAGE)),
            }
        }
        _ => {
            let args = typed_args();
            say_error(format_args!(
                "{}",
                aalis_proxy::cli::usage_error_line(err, &args)
            ));
            ExitCode::from(EXIT_USAGE)
        }
    }
}

/// The words typed after the program's name. Lossy: an argument that is
/// not UTF-8 (the usual reason for a usage error) must not stop its
/// message (`args()` panics on it).
fn typed_args() -> Vec<String> {
    std::env::args_os()
        .skip(1)
        .map(|arg| arg.to_string_lossy().into_owned())
        .collect()
}

/// A usage error found after parsing: one line, status 2.
fn usage_error_text(message: &str, subcommand: &str) -> ExitCode {
    say_error(format_args!(
        "{message} (see 'aalis-proxy {subcommand} --help')"
    ));
    ExitCode::from(EXIT_USAGE)
}

/// `aalis-proxy: error: …` on stderr. A stderr that cannot be written (a
/// closed pipe) loses the line, but not the exit status: `eprintln!`
/// panicked there, and the status became 101.
fn say_error(message: std::fmt::Arguments<'_>) {
    let _ = writeln!(io::stderr(), "aalis-proxy: error: {message}");
}

fn annotate(args: &AnnotateArgs) -> anyhow::Result<()> {
    let input_name = match args.input_path() {
        Some(path) => path.display().to_string(),
        None => "stdin".to_owned(),
    };
    let mut input: Box<dyn Read + Send> = match args.input_path() {
        Some(path) => {
            let file =
                File::open(path).with_context(|| format!("cannot open {}", path.display()))?;
            // Opened, a directory fails only at its first read: the line
            // formats had written their `done` line by then.
            if file.metadata().is_ok_and(|meta| meta.is_dir()) {
                anyhow::bail!("cannot open {}: it is a directory", path.display());
            }
            filter::widen_pipe(&file);
            Box::new(file)
        }
        None => {
            filter::widen_pipe(io::stdin());
            Box::new(io::stdin())
        }
    };
    // A replay reads the whole capture first, then plays it in time.
    let mut capture = Vec::new();
    let source = match args.replay_pace() {
        None => filter::Source::Live(input),
        Some(pace) => {
            // As the live path reads: a non-blocking stdin's pauses are no
            // end.
            let mut buf = vec![0u8; 64 * 1024];
            loop {
                let n = filter::read_retrying(&mut input, &mut buf)
                    .with_context(|| format!("cannot read {input_name}"))?;
                if n == 0 {
                    break;
                }
                capture.extend_from_slice(&buf[..n]);
            }
            let timing = match args.input_path() {
                Some(path) => Timing::load_for(path, capture.len())
                    .with_context(|| format!("cannot read {}", Timing::sidecar(path).display()))?,
                None => None,
            };
            let schedule = capture::schedule(&capture, timing.as_ref(), pace);
            filter::Source::Replay {
                bytes: &capture,
                schedule,
            }
        }
    };
    let display = Arc::new(display(args.stream.progress, None));
    let signalled = match display.is_off() {
        true => Vec::new(),
        false => end_spinners_on_signal(&display),
    };
    let stdout = io::stdout().lock();
    // Spinners on a terminal: the warnings, and an output that is a
    // terminal too, are written above them (written past them, each was
    // erased by the next redraw). Not locked for the run: the spinners'
    // tick threads write to stderr too, and one waiting for a lock this
    // thread holds, while holding the spinners' own lock this thread
    // waits for, stops both for good.
    let mut stderr = display.above(io::stderr());
    let mut output: Box<dyn Write> = match display.is_terminal() && stdout.is_terminal() {
        true => Box::new(display.above_as_is(stdout)),
        false => Box::new(stdout),
    };
    let result = filter::run(
        source,
        &input_name,
        &mut output,
        &mut stderr,
        args.annotator_config(),
        &display,
        &mut filter::unix_ms,
    );
    die_if_signalled(&display, &signalled);
    display.close();
    result?;
    Ok(())
}

/// How long the spinners may take to end after SIGINT or SIGTERM (a
/// terminal paused with Ctrl-S takes no writes) before the process ends
/// anyway.
const END_SPINNERS_TIMEOUT: Duration = Duration::from_secs(1);

/// `annotate` with spinners, interrupted (Ctrl-C) or terminated: each tool
/// still in progress ends with its `✗` line, rather than a spinner frozen
/// mid-turn on the terminal, and then the process dies of the signal, as it
/// would have without this (a shell sees status 130 for SIGINT, and a
/// script's loop stops). What was read was written as it came, so no data
/// waits. A signal the process was started with ignored (a background job
/// of a script ignores SIGINT) stays ignored. If the handlers cannot be
/// installed, the signals keep their default action.
///
/// Returns the flags the handlers set, one per signal handled, for
/// [`die_if_signalled`]: Ctrl-C in `producer | aalis-proxy annotate` ends
/// the producer too, and the input's end could let the process exit 0
/// before the thread here had acted.
fn end_spinners_on_signal(display: &Arc<ProgressDisplay>) -> Vec<(i32, Arc<AtomicBool>)> {
    use signal_hook::consts::{SIGINT, SIGTERM};
    let ignored = ignored_signals();
    let handled: Vec<i32> = [SIGINT, SIGTERM]
        .into_iter()
        .filter(|&signal| ignored >> (signal - 1) & 1 == 0)
        .collect();
    if handled.is_empty() {
        return Vec::new();
    }
    let display = Arc::clone(display);
    // The handlers are installed on the thread that waits for them, and
    // only once it runs: never a handler with nobody to act on it.
    let (installed_tx, installed_rx) = std::sync::mpsc::channel();
    let on_thread = handled.clone();
    let spawned = std::thread::Builder::new()
        .name("signals".into())
        .spawn(move || {
            let mut signals = match signal_hook::iterator::Signals::new(&on_thread) {
                Ok(signals) => signals,
                Err(_) => return,
            };
            let _ = installed_tx.send(());
            let Some(signal) = signals.forever().next() else {
                return;
            };
            end_spinners_and_die(&display, signal);
        });
    if spawned.is_err() || installed_rx.recv().is_err() {
        return Vec::new();
    }
    handled
        .into_iter()
        .filter_map(|signal| {
            let raised = Arc::new(AtomicBool::new(false));
            signal_hook::flag::register(signal, Arc::clone(&raised))
                .ok()
                .map(|_| (signal, raised))
        })
        .collect()
}

/// Ends the spinners (on a thread of its own, for at most
/// [`END_SPINNERS_TIMEOUT`]: one stuck on a paused terminal must not keep
/// the process alive), then dies of `signal`.
fn end_spinners_and_die(display: &Arc<ProgressDisplay>, signal: i32) -> ! {
    end_spinners(display);
    let _ = signal_hook::low_level::emulate_default_handler(signal);
    // Not reached: the default action of both signals ends the process.
    std::process::exit(128 + signal);
}

/// Ends every spinner with its `✗` line, on a thread of its own, waiting
/// for it at most [`END_SPINNERS_TIMEOUT`] (a paused terminal).
fn end_spinners(display: &Arc<ProgressDisplay>) {
    let (ended_tx, ended_rx) = std::sync::mpsc::channel();
    let display = Arc::clone(display);
    let _ = std::thread::Builder::new().spawn(move || {
        display.interrupt(filter::unix_ms());
        let _ = ended_tx.send(());
    });
    let _ = ended_rx.recv_timeout(END_SPINNERS_TIMEOUT);
}

/// After the filter's end: if a handled signal came meanwhile, the spinners
/// end and the process dies of it (see [`end_spinners_on_signal`]).
fn die_if_signalled(display: &Arc<ProgressDisplay>, flags: &[(i32, Arc<AtomicBool>)]) {
    if let Some((signal, _)) = flags
        .iter()
        .find(|(_, raised)| raised.load(Ordering::SeqCst))
    {
        end_spinners_and_die(display, *signal);
    }
}

/// The signals this process was started with ignored, as a mask (bit
/// `n - 1` for signal `n`): `SigIgn` of `/proc/self/status` (Linux; none
/// elsewhere). Read without `sigaction`, which would need `unsafe`.
fn ignored_signals() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|status| {
            status
                .lines()
                .find_map(|line| line.strip_prefix("SigIgn:"))
                .and_then(|mask| u64::from_str_radix(mask.trim(), 16).ok())
        })
        .unwrap_or(0)
}

fn serve(args: &ServeArgs, config: ProxyConfig) -> anyhow::Result<()> {
    // The scheduling policy first, on this thread, so that every thread
    // started after it inherits it (aalis_proxy::proxy::server::Sched); a
    // refusal is told once the log is set up.
    let sched = args.sched.apply();
    // Spinners on a terminal are drawn by a thread of their own: a paused
    // terminal must not stop the workers. The log is written above them
    // (written past them, a line was erased by the next redraw); plain
    // lines, without a terminal, go through the log's queue.
    let mode = args.stream.progress;
    let (log, spinners) = match mode.draws_on_a_terminal(spinner::stderr_draws()) {
        true => {
            let spinners = display(mode, None).drawn_apart();
            (
                stderr_log::init_to(args.verbose, spinners.above(io::stderr())),
                spinners,
            )
        }
        false => {
            let log = stderr_log::init(args.verbose);
            let spinners = display(mode, log.as_ref()).drawn_apart();
            (log, spinners)
        }
    };
    if let Err(err) = sched {
        tracing::warn!("cannot run as SCHED_BATCH ({err}): the process keeps its policy");
    }
    let result = serve_logged(args, config, log.clone(), Arc::new(spinners));
    end_logging(log.as_ref());
    result
}

fn serve_logged(
    args: &ServeArgs,
    config: ProxyConfig,
    log: Option<StderrLog>,
    spinners: Arc<ProgressDisplay>,
) -> anyhow::Result<()> {
    // Everything that can fail on configuration (the CA file) fails before
    // the port is taken; the --record directory is made once the port is
    // ours, so that a failed start leaves none behind.
    let record_dir = config.record_dir.clone();
    let sessions = SessionRegistry::with_display(Arc::clone(&spinners));
    let proxy = Proxy::from_config(config, sessions)?;
    // Connections are accepted and served by the workers; this thread
    // waits for the signal to stop.
    let threads = args
        .threads
        .and_then(|n| std::num::NonZeroUsize::new(n.into()))
        .unwrap_or_else(|| {
            std::thread::available_parallelism().unwrap_or(std::num::NonZeroUsize::MIN)
        });
    let workers = Workers::start(threads).context("cannot start the worker threads")?;
    let result = current_thread_runtime()?.block_on(async {
        let (listener, local) = listen(args.listen).await?;
        if let Some(dir) = &record_dir {
            std::fs::create_dir_all(dir).with_context(|| {
                format!("cannot create the --record directory {}", dir.display())
            })?;
            aalis_proxy::proxy::record::check_writable(dir).with_context(|| {
                format!("cannot write in the --record directory {}", dir.display())
            })?;
        }
        // The first signal drains (open streams finish within
        // --shutdown-grace); a second ends the process at once, as a user
        // who presses Ctrl-C again means.
        let mut signals = Signals::install();
        let (first, stop) = tokio::sync::oneshot::channel::<()>();
        let log_at_exit = log.clone();
        let spinners_at_exit = Arc::clone(&spinners);
        let recordings = proxy.open_recordings();
        let finishing = recordings.clone();
        tokio::spawn(async move {
            signals.next().await;
            let _ = first.send(());
            signals.next().await;
            // What the open streams' recordings hold so far is kept, as
            // when the grace period cuts them; and those of streams that
            // ended just before are finished.
            let kept = recordings.as_ref().map_or(0, |open| open.finish_all());
            if let Some(open) = &recordings {
                recordings_finished(open).await;
            }
            match kept {
                0 => tracing::warn!("a second signal: exiting now, open streams are cut"),
                n => tracing::warn!(
                    "a second signal: exiting now, open streams are cut; \
                     recordings kept as they stood: {n}"
                ),
            }
            // The tools still in progress end with their `✗` lines, as
            // when `annotate` is interrupted, not frozen mid-turn.
            end_spinners(&spinners_at_exit);
            end_logging(log_at_exit.as_ref());
            std::process::exit(EXIT_INTERRUPTED);
        });
        let stop = async move {
            let _ = stop.await;
        };
        tracing::info!(
            "listening on http://{local}, forwarding to {} (threads: {threads})",
            args.upstream
        );
        say_chosen_address(args.listen, local);
        // Lines dropped while stderr was not read are told of when it is
        // again (stderr_log).
        if let Some(log) = log {
            tokio::spawn(async move {
                let mut every = tokio::time::interval(stderr_log::DROP_REPORT_INTERVAL);
                loop {
                    every.tick().await;
                    log.report_dropped();
                }
            });
        }
        serve_proxy_on(listener, proxy, stop, workers.handles()).await;
        // The last streams' recordings are finished on the workers'
        // blocking threads, whose queue goes with the workers; and an
        // HTTP/2 stream cut at the grace's end may still hold its own (its
        // task is the connection's executor's, not the accept loop's):
        // finished here, as it stands.
        if let Some(open) = &finishing {
            open.finish_all();
            recordings_finished(open).await;
        }
        Ok(())
    });
    // Stops the workers once every connection has finished or been dropped.
    drop(workers);
    // Their streams' last lines (`✓`, `✗`), unless the terminal is paused;
    // then the cursor goes below them.
    if spinners.flush(stderr_log::FLUSH_TIMEOUT) {
        spinners.close();
    }
    result
}

/// How long an exit waits for the recordings being finished (their
/// sidecars written, their bodies named): a few file writes each.
const RECORDINGS_FINISH_LIMIT: Duration = Duration::from_secs(5);

/// Waits for the recordings being finished, and says so if some were not
/// in time ([`RECORDINGS_FINISH_LIMIT`]).
async fn recordings_finished(open: &aalis_proxy::proxy::record::OpenRecordings) {
    let left = open.finished(RECORDINGS_FINISH_LIMIT).await;
    if left > 0 {
        tracing::warn!(
            "{left} recording(s) not finished within {RECORDINGS_FINISH_LIMIT:?} of the exit: \
             left as .partial"
        );
    }
}

fn mock(args: &MockArgs) -> anyhow::Result<()> {
    // `-` is standard input to a filter; `mock` serves each capture again
    // and again, named by its file, so it takes files only.
    if args.captures.iter().any(|path| path.as_os_str() == "-") {
        anyhow::bail!(
            "mock replays capture files, not standard input (-): save the stream to a file \
             first (for example `> capture.sse`), then name that file"
        );
    }
    // A recording's sidecars and partial bodies are left out (`mock
    // captures/*` names them), and said so once the log is up.
    let (skipped, given): (Vec<&std::path::PathBuf>, Vec<&std::path::PathBuf>) = args
        .captures
        .iter()
        // A file that is not there is said so below, whatever its name.
        .partition(|path| aalis_proxy::mock::is_not_a_capture(path) && path.exists());
    if given.is_empty() && !skipped.is_empty() {
        anyhow::bail!(
            "no capture among the files given: .timing, .request.json and .partial files \
             are left out"
        );
    }
    let captures: Vec<Capture> = if given.is_empty() {
        Capture::bundled()
    } else {
        given
            .iter()
            .map(|path| {
                Capture::from_file(path).with_context(|| format!("cannot read {}", path.display()))
            })
            .collect::<anyhow::Result<_>>()?
    };
    let log = stderr_log::init(args.verbose);
    for path in &skipped {
        tracing::warn!("left out {}: not a capture", path.display());
    }
    for (path, capture) in given.iter().zip(&captures) {
        if let Some(problem) = capture.problem() {
            tracing::warn!(
                "{}: {problem}; served all the same, byte for byte",
                path.display()
            );
        }
    }
    // Names are looked up among the captures of one route's kind: an SSE
    // and an NDJSON capture of one name are both served.
    for (i, capture) in captures.iter().enumerate() {
        if captures[..i]
            .iter()
            .any(|c| c.name == capture.name && c.framing == capture.framing)
        {
            tracing::warn!(
                "two {} captures are named {}: requests for it get the first",
                match capture.framing {
                    aalis_proxy::framing::Framing::Sse => "SSE",
                    aalis_proxy::framing::Framing::Ndjson => "NDJSON",
                },
                capture.name
            );
        }
    }
    let result = runtime().and_then(|runtime| {
        runtime.block_on(async {
            let (listener, local) = listen(args.listen).await?;
            let stop = shutdown_signal();
            let names: Vec<&str> = captures.iter().map(|c| c.name.as_str()).collect();
            tracing::info!("mock upstream on http://{local}: {}", names.join(", "));
            say_chosen_address(args.listen, local);
            MockUpstream::new(captures, Duration::from_millis(args.delay_ms))
                .run(listener, stop)
                .await;
            Ok(())
        })
    });
    end_logging(log.as_ref());
    result
}

/// The spinners `--progress` asks for, given this process's stderr; plain
/// lines go through `log`'s queue when there is one (`serve`).
fn display(mode: ProgressMode, log: Option<&StderrLog>) -> ProgressDisplay {
    let color = !stderr_log::no_color();
    // The spinners' colour is drawn only if indicatif's terminal layer
    // allows it, and it takes an empty NO_COLOR for "no colour"; ours is
    // no-color.org's rule, set and not empty. With it empty, the layer's
    // colour is what it would be without it (CLICOLOR and CLICOLOR_FORCE
    // still count).
    if std::env::var_os("NO_COLOR").is_some_and(|value| value.is_empty()) {
        let clicolor = std::env::var_os("CLICOLOR").is_none_or(|value| value != "0");
        let forced = std::env::var_os("CLICOLOR_FORCE").is_some_and(|value| value != "0");
        console::set_colors_enabled_stderr(clicolor || forced);
    }
    let terminal = spinner::stderr_draws();
    match log {
        Some(log) => {
            ProgressDisplay::new_plain_to(mode, terminal, color, || Box::new(log.line_writer()))
        }
        None => ProgressDisplay::new(mode, terminal, color),
    }
}

fn demo(args: &DemoArgs) -> anyhow::Result<()> {
    let display = Arc::new(display(args.progress, None));
    // Ctrl-C ends the spinners with their ✗ lines, as annotate's: they
    // were left half drawn, and the shell's prompt on their line.
    let signalled = match display.is_off() {
        true => Vec::new(),
        false => end_spinners_on_signal(&display),
    };
    let options = aalis_proxy::demo::DemoOptions {
        delay: Duration::from_millis(args.delay_ms),
        stream: args.stream,
        display: Arc::clone(&display),
    };
    let mut stdout = io::stdout();
    // The streams, on the spinners' terminal, are written above them, as
    // `annotate`'s output is: written past them, the next redraw erased
    // what they had just shown.
    let mut output: Box<dyn Write + Send> = match display.is_terminal() && stdout.is_terminal() {
        true => Box::new(display.above_as_is(io::stdout())),
        false => Box::new(io::stdout()),
    };
    let calls = runtime()?.block_on(aalis_proxy::demo::run(options, &mut output));
    drop(output);
    die_if_signalled(&display, &signalled);
    let calls = calls?;
    if !args.stream {
        writeln!(
            stdout,
            "{calls} tool calls streamed through the proxy, each with progress"
        )
        .and_then(|()| stdout.flush())
        .context(aalis_proxy::demo::CANNOT_WRITE)?;
    }
    Ok(())
}

/// Whether `err` is, or was caused by, a write to a closed pipe: the
/// filter's own error, or an I/O error anywhere in the chain (`demo`).
fn is_broken_pipe(err: &anyhow::Error) -> bool {
    err.chain().any(|cause| {
        cause
            .downcast_ref::<FilterError>()
            .is_some_and(FilterError::is_broken_pipe)
            || cause
                .downcast_ref::<io::Error>()
                .is_some_and(|e| e.kind() == io::ErrorKind::BrokenPipe)
    })
}

fn current_thread_runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("cannot start the async runtime")
}

fn runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("cannot start the async runtime")
}

/// How many connections may wait to be accepted: the default of 128
/// overflowed under 256 concurrent clients in the benchmarks (each overflow
/// costs a client a retried SYN, a second).
const LISTEN_BACKLOG: u32 = 1024;

fn bind(addr: std::net::SocketAddr) -> io::Result<tokio::net::TcpListener> {
    let socket = if addr.is_ipv4() {
        tokio::net::TcpSocket::new_v4()?
    } else {
        tokio::net::TcpSocket::new_v6()?
    };
    // As std's TcpListener does: a restarted server can take its port back
    // while old connections sit in TIME_WAIT (a live listener still blocks).
    #[cfg(unix)]
    socket.set_reuseaddr(true)?;
    socket.bind(addr)?;
    socket.listen(LISTEN_BACKLOG)
}

/// Binds `addr` and says the address really bound (port 0 picks one),
/// warning when it is not loopback.
async fn listen(
    addr: std::net::SocketAddr,
) -> anyhow::Result<(tokio::net::TcpListener, std::net::SocketAddr)> {
    let listener = bind(addr).with_context(|| format!("cannot listen on {addr}"))?;
    let local = listener
        .local_addr()
        .with_context(|| format!("cannot read the address bound for {addr}"))?;
    // `[::ffff:127.0.0.1]` is loopback too.
    if !local.ip().to_canonical().is_loopback() {
        tracing::warn!("listening on {local}, which is not loopback: other machines can reach it");
    }
    Ok((listener, local))
}

/// With port 0 the system picks the port, and a script must learn it
/// whatever `RUST_LOG` lets through: the address also goes to stdout, one
/// line `http://ADDR`, flushed (`serve` and `mock` write nothing else
/// there). Said once the signal handlers are in, as the log's line is.
fn say_chosen_address(asked: std::net::SocketAddr, local: std::net::SocketAddr) {
    if asked.port() == 0 {
        let mut stdout = io::stdout().lock();
        // A closed stdout (nobody wanted the line) stops nothing.
        let _ = writeln!(stdout, "http://{local}").and_then(|()| stdout.flush());
    }
}

/// Waits (at most `FLUSH_TIMEOUT` in all) for the queued log lines to
/// reach stderr, says how many were dropped since the last report, and
/// waits for that line too: what main prints next comes after them.
fn end_logging(log: Option<&StderrLog>) {
    if let Some(log) = log {
        let deadline = std::time::Instant::now() + stderr_log::FLUSH_TIMEOUT;
        log.flush(stderr_log::FLUSH_TIMEOUT);
        log.report_dropped();
        log.flush(deadline.saturating_duration_since(std::time::Instant::now()));
    }
}

/// SIGINT, SIGTERM and SIGHUP (a closed terminal, an ssh session gone:
/// taken as SIGTERM, so open streams finish and recordings are kept), as
/// they come. The handlers are installed by
/// [`Signals::install`], not when a future is first polled: a signal sent
/// as soon as the "listening on" line appears then stops the process
/// cleanly instead of killing it (a loaded CI machine once delivered
/// SIGTERM in between). Install them inside the runtime, before that line
/// is logged.
struct Signals {
    #[cfg(unix)]
    interrupt: Option<tokio::signal::unix::Signal>,
    #[cfg(unix)]
    terminate: Option<tokio::signal::unix::Signal>,
    #[cfg(unix)]
    hangup: Option<tokio::signal::unix::Signal>,
}

impl Signals {
    fn install() -> Signals {
        #[cfg(unix)]
        {
            use tokio::signal::unix::{SignalKind, signal};
            let install = |kind: SignalKind, name: &str| {
                signal(kind)
                    .inspect_err(|e| tracing::warn!("cannot handle {name}: {e}"))
                    .ok()
            };
            Signals {
                interrupt: install(SignalKind::interrupt(), "SIGINT"),
                terminate: install(SignalKind::terminate(), "SIGTERM"),
                hangup: install(SignalKind::hangup(), "SIGHUP"),
            }
        }
        #[cfg(not(unix))]
        {
            Signals {}
        }
    }

    /// The next SIGINT, SIGTERM or SIGHUP.
    async fn next(&mut self) {
        #[cfg(unix)]
        {
            async fn one(signal: Option<&mut tokio::signal::unix::Signal>) {
                match signal {
                    Some(signal) => {
                        signal.recv().await;
                    }
                    // Not handled: the signal's default action ends the process.
                    None => std::future::pending().await,
                }
            }
            tokio::select! {
                () = one(self.interrupt.as_mut()) => {}
                () = one(self.terminate.as_mut()) => {}
                () = one(self.hangup.as_mut()) => {}
            }
        }
        #[cfg(not(unix))]
        {
            let _ = tokio::signal::ctrl_c().await;
        }
    }
}

/// Resolves on the first SIGINT, SIGTERM or SIGHUP (see [`Signals`]).
fn shutdown_signal() -> impl std::future::Future<Output = ()> {
    let mut signals = Signals::install();
    async move { signals.next().await }
}
