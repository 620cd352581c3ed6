//! Errors at each boundary, and the exit codes they map to.
//!
//! - [`Warning`]: something in a stream could not be understood. The bytes
//!   are forwarded unchanged all the same; this only says where and why, once.
//! - [`FilterError`]: `annotate` could not read its input or write its output.
//!
//! Exit codes (documented in `man/aalis-proxy.1`): 0 success, also when
//! stdout is closed early (`| head`); 1 the input or output failed, or
//! `serve` or `mock` could not start (a port taken, a CA or capture file);
//! 2 a usage error (clap's own, and values it cannot check); 130
//! interrupted (SIGINT's default).

use std::io;

use crate::providers::FrameError;

/// Exit status when the input or output failed.
pub const EXIT_FAILURE: u8 = 1;
/// Exit status of a usage error (the same as clap's).
pub const EXIT_USAGE: u8 = 2;
/// Exit status of `serve` stopped by a second SIGINT or SIGTERM, without
/// waiting for its open streams (SIGINT's default status).
pub const EXIT_INTERRUPTED: i32 = 130;

/// Something in a stream that could not be understood; see the module docs.
#[derive(Debug, thiserror::Error)]
pub enum Warning {
    #[error(
        "{at}: {source}; {}{}: {excerpt}",
        if *lines { "passed on as an unparsed line" } else { "passed on unchanged" },
        if source.may_be_a_chunk() { "" } else { " (so are the stream's later ones, without a warning)" }
    )]
    Undecodable {
        at: Location,
        source: FrameError,
        /// The start of the frame's data, sanitized for a terminal.
        excerpt: String,
        /// The output is a line format (an `unparsed` line).
        lines: bool,
    },
    #[error(
        "{at}: `{field}` is not of the shape expected, so it is passed over and the rest of the \
         frame read{}; later such fields of the stream likewise, without a warning: {excerpt}",
        if *lines { " (a frame left without a line of its own becomes an unparsed line)" } else { "" }
    )]
    Ignored {
        at: Location,
        field: &'static str,
        /// The start of the field's value, sanitized for a terminal.
        excerpt: String,
        /// The output is a line format (the frame is an `unparsed` line too).
        lines: bool,
    },
    #[error("{at}: upstream error: {message}")]
    Upstream { at: Location, message: String },
    #[error(
        "{at}: an event named `{name}` is no chunk; passed on as an unparsed line (so are \
         the stream's later ones, without a warning): {excerpt}"
    )]
    NamedEvent {
        at: Location,
        /// Its `event:` name, sanitized for a terminal.
        name: String,
        /// The start of its data, sanitized for a terminal.
        excerpt: String,
    },
    #[error(
        "stream ended inside SSE event {number} (byte {offset}) before its blank line: \
         its data was not dispatched, {}",
        passed_on(*lines, "passed on unchanged")
    )]
    Unterminated {
        number: u64,
        offset: u64,
        /// The output is a line format, which leaves it out.
        lines: bool,
    },
    #[error(
        "{at}: data after the end of the stream ({}); {}, not tracked",
        at.end_marker(),
        passed_on(*lines, "passed on unchanged")
    )]
    AfterEnd {
        at: Location,
        /// The output is a line format, which ends with its done line(s).
        lines: bool,
    },
    #[error(
        "{at}: larger than {max_bytes} bytes (--max-event-bytes); {}, not parsed",
        passed_on(*lines, "passed on as it streams")
    )]
    Oversized {
        at: Location,
        max_bytes: usize,
        /// The output is a line format, which leaves it out.
        lines: bool,
    },
    #[error(
        "{at}: a tool call past the first {max_calls} of the stream (or a choice past as \
         many); it and any later new ones are passed on without progress"
    )]
    TooManyCalls { at: Location, max_calls: usize },
    #[error(
        "{count} more frames that could not be read (undecodable or oversized) were passed on, \
         or left out of the lines (--format), without a warning"
    )]
    Suppressed { count: u64 },
    #[error(
        "the stream's first {bytes} bytes are whitespace: it is taken for SSE (an NDJSON \
         stream starts with `{{` within them) and passed on as such"
    )]
    BlankStart { bytes: usize },
    #[error(
        "the stream's {bytes} bytes held no SSE event with data and no NDJSON line: no stream \
         of chat chunks (an HTML error page? another API's?); {}",
        passed_on(*lines, "passed on unchanged")
    )]
    NoFrames {
        bytes: u64,
        /// The output is a line format, which leaves them out.
        lines: bool,
    },
    #[error("--inject {mode} applies to SSE streams; NDJSON lines get `field` injection")]
    InjectModeNotForNdjson { mode: &'static str },
}

/// What became of a frame the output could not carry as it is: `sse`
/// passes it on as `how` says; the line formats leave it out.
fn passed_on(lines: bool, how: &'static str) -> &'static str {
    match lines {
        true => "left out of the lines (--format)",
        false => how,
    }
}

/// Where in a stream a frame is.
#[derive(Debug, Clone, Copy)]
pub struct Location {
    /// `SSE event` or `NDJSON line`.
    pub unit: &'static str,
    /// 1-based number of the frame in the stream.
    pub number: u64,
    /// Offset of the frame's first byte in the stream.
    pub offset: u64,
}

impl Location {
    /// What ends a stream of this kind of frame: `[DONE]`, or Ollama's
    /// `done: true` line.
    pub fn end_marker(&self) -> &'static str {
        if self.unit.starts_with("NDJSON") {
            "\"done\": true"
        } else {
            "[DONE]"
        }
    }
}

impl std::fmt::Display for Location {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} {} (byte {})", self.unit, self.number, self.offset)
    }
}

/// Why `annotate` stopped.
#[derive(Debug, thiserror::Error)]
pub enum FilterError {
    // The io error is the source, not part of the message: `main` prints
    // the whole chain, and it would appear twice.
    #[error("cannot read {input}")]
    Read {
        /// The file name, or `stdin`.
        input: String,
        #[source]
        source: io::Error,
    },
    #[error("cannot write the output")]
    Write(#[source] io::Error),
}

impl FilterError {
    /// True when stdout was closed by its reader: not a failure.
    pub fn is_broken_pipe(&self) -> bool {
        matches!(self, FilterError::Write(e) if e.kind() == io::ErrorKind::BrokenPipe)
    }
}

/// The first `max_chars` characters of `bytes`, safe to print on a
/// terminal: invalid UTF-8 becomes U+FFFD, control, bidi and zero-width
/// characters are escaped, and an ellipsis marks a cut.
pub fn excerpt(bytes: &[u8], max_chars: usize) -> String {
    // Printable ASCII short enough, as a request path usually is: nothing
    // to cut or escape. (The walk below took about 570 instructions for a
    // path of 20 characters, twice a stream: BENCHMARKS.md, forty-second
    // round.)
    if bytes.len() <= max_chars && bytes.iter().all(|b| (b' '..=b'~').contains(b)) {
        return String::from_utf8_lossy(bytes).into_owned();
    }
    let text = String::from_utf8_lossy(bytes);
    // Sized for the text, not for the limit: a request path is kept in its
    // log line for as long as the stream runs.
    let mut out = String::with_capacity(text.len().min(max_chars) + 8);
    for (n, c) in text.chars().enumerate() {
        if n == max_chars {
            out.push('…');
            break;
        }
        if crate::render::is_hostile(c) {
            out.extend(c.escape_default());
        } else {
            out.push(c);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn excerpts_are_cut_and_neutralized() {
        assert_eq!(excerpt(b"{\"a\":1}", 80), "{\"a\":1}");
        assert_eq!(
            excerpt("ab\x1b[2Jc\u{202E}d".as_bytes(), 80),
            "ab\\u{1b}[2Jc\\u{202e}d"
        );
        assert_eq!(excerpt("東京東京".as_bytes(), 2), "東京…");
        assert_eq!(excerpt(b"\xff\xfe", 5), "\u{fffd}\u{fffd}");
    }

    /// Printable ASCII up to the limit is kept as it is; one character
    /// more, or one that is not printable, takes the full walk.
    #[test]
    fn printable_ascii_is_kept_up_to_the_limit() {
        assert_eq!(
            excerpt(b"/v1/chat/completions?x=1", 80),
            "/v1/chat/completions?x=1"
        );
        assert_eq!(excerpt(b" ~abc", 5), " ~abc");
        assert_eq!(excerpt(b"abcdef", 5), "abcde…");
        assert_eq!(excerpt(b"a\tb\x7f", 5), "a\\tb\\u{7f}");
        assert_eq!(excerpt(b"", 0), "");
    }
}
