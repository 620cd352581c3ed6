//! The command line: what the user typed (clap derive structs), and its
//! translation into validated configuration for the library.
//!
//! The doc comment of each item is its help: the first line is the short
//! help (`-h`), the rest the long help (`--help`) and the man page, which is
//! generated from [`command`] (see `tests/man.rs`).

use std::path::PathBuf;

use clap::{Args, CommandFactory, Parser, Subcommand};

use crate::encode::{InjectMode, OutputFormat};
use crate::pipeline::AnnotatorConfig;

/// Tool-call progress for LLM chat streams
///
/// While a model streams a tool call, OpenAI-compatible APIs send only
/// argument fragments and no text, so chat front ends look frozen.
/// aalis-proxy turns those fragments into toolCallProgress events
/// {index, name, charsAccumulated} without changing a byte of the stream.
#[derive(Debug, Parser)]
#[command(name = "aalis-proxy", version, propagate_version = true)]
#[command(after_long_help = EXIT_STATUS)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

const EXIT_STATUS: &str = "\
Exit status:
  0    success, also when stdout is closed early (e.g. `| head -1`)
  1    the input could not be opened or read, or the output written
  2    usage error: unknown flag, bad value, missing argument
  130  interrupted (SIGINT)";

#[derive(Debug, Subcommand)]
pub enum Command {
    Annotate(AnnotateArgs),
}

/// Read a chat stream, write it back with tool-call progress
///
/// Reads an OpenAI-style SSE stream (`data:` events) or an Ollama NDJSON
/// stream (one JSON object per line), detected from its first bytes, from
/// FILE or stdin, and writes the result to stdout event by event, flushed,
/// so it works live in a pipe. Events that cannot be understood are passed
/// on unchanged and reported on stderr with their event number and byte
/// offset.
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

    /// How progress is added to the forwarded stream (with --format sse)
    ///
    /// `field` is safe for every SDK: the chunk that carried the tool-call
    /// delta gets a top-level "toolCallProgress":{…} before its closing
    /// brace, nothing else changes. NDJSON input takes only `field` and
    /// `none`.
    ///
    /// Example: --inject comment
    #[arg(long, value_enum, default_value_t = InjectMode::Field, value_name = "MODE")]
    pub inject: InjectMode,

    /// Session id written in every line of --format messages (required
    /// there, refused with other formats)
    ///
    /// Example: --format messages --session chat-42
    #[arg(long, value_name = "ID", required_if_eq("format", "messages"))]
    pub session: Option<String>,
}

const ANNOTATE_EXAMPLES: &str = "\
Examples:
  Watch progress live while a model streams:
    curl -N https://api.example.com/v1/chat/completions ... | aalis-proxy annotate
  Only the progress, one JSON object per line:
    aalis-proxy annotate capture.sse --format ndjson | grep toolCallProgress
  Progress as SSE comments, invisible to SDK iterators:
    aalis-proxy annotate --inject comment < capture.sse";

impl AnnotateArgs {
    /// Checks what clap cannot express: --session means something only with
    /// --format messages, so anywhere else it is a mistake worth saying.
    pub fn validate(&self) -> Result<(), clap::Error> {
        if self.session.is_some() && self.format != OutputFormat::Messages {
            let kind = clap::error::ErrorKind::ArgumentConflict;
            let message = "--session applies only to --format messages";
            let mut cmd = command();
            cmd.build();
            return Err(match cmd.find_subcommand_mut("annotate") {
                Some(annotate) => annotate.error(kind, message),
                None => cmd.error(kind, message),
            });
        }
        Ok(())
    }

    /// The pipeline configuration these flags ask for.
    pub fn annotator_config(&self) -> AnnotatorConfig {
        AnnotatorConfig {
            output: self.format,
            inject: self.inject,
            session_id: self.session.clone(),
            framing: None,
        }
    }

    /// The input path, `None` for stdin.
    pub fn input_path(&self) -> Option<&std::path::Path> {
        self.file.as_deref().filter(|p| p.as_os_str() != "-")
    }
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
    fn session_is_refused_outside_messages() {
        let cli =
            Cli::try_parse_from(["aalis-proxy", "annotate", "--session", "s"]).expect("parses");
        let Command::Annotate(args) = cli.command;
        let err = args
            .validate()
            .expect_err("--session needs --format messages");
        assert_eq!(err.kind(), clap::error::ErrorKind::ArgumentConflict);
        assert_eq!(err.exit_code(), 2);
    }
}
