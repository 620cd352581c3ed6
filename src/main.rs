//! The `aalis-proxy` binary: parse the command line, run, map the outcome to
//! an exit status. Everything else is library code.

use std::fs::File;
use std::io::{self, Read};
use std::process::ExitCode;

use anyhow::Context;
use clap::Parser;

use aalis_proxy::cli::{AnnotateArgs, Cli, Command};
use aalis_proxy::error::{EXIT_FAILURE, FilterError};
use aalis_proxy::filter;

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Annotate(args) => {
            if let Err(err) = args.validate() {
                err.exit();
            }
            annotate(&args)
        }
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

fn annotate(args: &AnnotateArgs) -> anyhow::Result<()> {
    let mut input: Box<dyn Read> = match args.input_path() {
        Some(path) => {
            Box::new(File::open(path).with_context(|| format!("cannot open {}", path.display()))?)
        }
        None => Box::new(io::stdin().lock()),
    };
    let mut stdout = io::stdout().lock();
    let mut stderr = io::stderr().lock();
    filter::run(
        &mut input,
        &mut stdout,
        &mut stderr,
        args.annotator_config(),
        &mut filter::unix_ms,
    )?;
    Ok(())
}
