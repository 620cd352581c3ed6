//! The `aalis-proxy` binary: parse the command line, run, map the outcome to
//! an exit status. Everything else is library code.

use std::fs::File;
use std::io::{self, IsTerminal, Read};
use std::process::ExitCode;

use anyhow::Context;
use clap::Parser;

use aalis_proxy::cli::{AnnotateArgs, Cli, Command, MockArgs, ServeArgs};
use aalis_proxy::error::{EXIT_FAILURE, EXIT_USAGE, FilterError};
use aalis_proxy::filter;
use aalis_proxy::mock::{Capture, MockUpstream};

fn main() -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(err) => return usage_error(&err),
    };
    let result = match cli.command {
        Command::Annotate(args) => {
            if let Err(err) = args.validate() {
                return usage_error(&err);
            }
            annotate(&args)
        }
        Command::Serve(args) => serve(&args),
        Command::Mock(args) => mock(&args),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            // stdout closed by its reader (`| head -1`): we are done, quietly.
            if err
                .downcast_ref::<FilterError>()
                .is_some_and(FilterError::is_broken_pipe)
            {
                return ExitCode::SUCCESS;
            }
            eprintln!("aalis-proxy: error: {err:#}");
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
            let _ = err.print();
            ExitCode::from(u8::try_from(err.exit_code()).unwrap_or(EXIT_USAGE))
        }
        _ => {
            let args: Vec<String> = std::env::args().skip(1).collect();
            eprintln!(
                "aalis-proxy: error: {}",
                aalis_proxy::cli::usage_error_line(err, &args)
            );
            ExitCode::from(EXIT_USAGE)
        }
    }
}

fn annotate(args: &AnnotateArgs) -> anyhow::Result<()> {
    let mut input: Box<dyn Read> = match args.input_path() {
        Some(path) => {
            Box::new(File::open(path).with_context(|| format!("cannot open {}", path.display()))?)
        }
        None => Box::new(io::stdin().lock()),
    };
    let mut stdout = io::stdout().lock();
    let mut stderr = io::stderr().lock();
    let input_name = match args.input_path() {
        Some(path) => path.display().to_string(),
        None => "stdin".to_owned(),
    };
    filter::run(
        &mut input,
        &input_name,
        &mut stdout,
        &mut stderr,
        args.annotator_config(),
        &mut filter::unix_ms,
    )?;
    Ok(())
}

fn serve(args: &ServeArgs) -> anyhow::Result<()> {
    let config = args.proxy_config()?;
    init_logging(args.verbose);
    runtime()?.block_on(async {
        let listener = listen(args.listen).await?;
        tracing::info!(
            "listening on http://{}, forwarding to {}",
            args.listen,
            args.upstream
        );
        aalis_proxy::proxy::run(listener, config, shutdown_signal()).await?;
        Ok(())
    })
}

fn mock(args: &MockArgs) -> anyhow::Result<()> {
    let captures = if args.captures.is_empty() {
        Capture::bundled()
    } else {
        args.captures
            .iter()
            .map(|path| {
                Capture::from_file(path).with_context(|| format!("cannot read {}", path.display()))
            })
            .collect::<anyhow::Result<_>>()?
    };
    init_logging(args.verbose);
    runtime()?.block_on(async {
        let listener = listen(args.listen).await?;
        let names: Vec<&str> = captures.iter().map(|c| c.name.as_str()).collect();
        tracing::info!(
            "mock upstream on http://{}: {}",
            args.listen,
            names.join(", ")
        );
        MockUpstream::new(captures, args.delay)
            .run(listener, shutdown_signal())
            .await;
        Ok(())
    })
}

fn runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("cannot start the async runtime")
}

/// Binds `addr`, warning when it is not loopback.
async fn listen(addr: std::net::SocketAddr) -> anyhow::Result<tokio::net::TcpListener> {
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .with_context(|| format!("cannot listen on {addr}"))?;
    if !addr.ip().is_loopback() {
        tracing::warn!("listening on {addr}, which is not loopback: other machines can reach it");
    }
    Ok(listener)
}

/// Logs to stderr: info by default, more with -v, or as RUST_LOG says.
fn init_logging(verbose: u8) {
    use tracing_subscriber::EnvFilter;
    let default = match verbose {
        0 => "info",
        1 => "debug",
        _ => "trace",
    };
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(default));
    let color = io::stderr().is_terminal() && std::env::var_os("NO_COLOR").is_none();
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(color)
        .with_writer(io::stderr)
        .with_target(false)
        .init();
}

/// Resolves on SIGINT or SIGTERM.
async fn shutdown_signal() {
    let interrupt = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        match signal(SignalKind::terminate()) {
            Ok(mut term) => {
                tokio::select! {
                    _ = interrupt => {}
                    _ = term.recv() => {}
                }
            }
            Err(_) => {
                let _ = interrupt.await;
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = interrupt.await;
    }
}
