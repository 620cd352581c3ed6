//! Captures: a stream body as it came (`NAME.sse`, `NAME.ndjson`) and,
//! beside it, when each piece of it arrived (`NAME.sse.timing`).
//!
//! `serve --record DIR` writes both; `annotate --realtime` and `mock`
//! replay a capture with its timing, or, without a timing file, one frame
//! (SSE event or NDJSON line) every `pace`. The capture file is always the
//! exact bytes of the body, so `annotate` and `cmp` read it as any stream.
//!
//! The timing file is text, one line per piece, after a header line:
//!
//! ```text
//! # aalis-proxy timing 1: <end offset in bytes> <milliseconds since the response began>
//! 312 0
//! 1045 52
//! ```
//!
//! A recording whose response did not end (the upstream failed, the
//! client left, or `serve` exited) ends with [`CUT_LINE`] and when the cut
//! came, a comment to readers that know nothing of it; `mock` replays
//! such a capture cut, at that time.
//! A response whose status was not `200` has it on a line after the
//! header ([`STATUS_LINE`], a comment too); `mock` answers with it.
//!
//! Read [`schedule`] first.

use std::ops::Range;
use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::framing::Framing;
use crate::framing::ndjson::NdjsonDecoder;
use crate::framing::sse::SseDecoder;

/// The first line of every timing file.
pub const TIMING_HEADER: &str =
    "# aalis-proxy timing 1: <end offset in bytes> <milliseconds since the response began>";

/// The last line of the timing of a response that was cut, not ended;
/// followed by `, <ms>` and [`CUT_TIME_SUFFIX`] when the time is known.
/// Readers of version 1 take any comment that starts `# cut:` for a cut.
pub const CUT_LINE: &str = "# cut: the response stopped here without its end";

/// The start of the line, after the header, of a recording whose status
/// was not `200`: `# status: 503`.
pub const STATUS_LINE: &str = "# status: ";

/// The end of a cut line that says when the cut came.
pub const CUT_TIME_SUFFIX: &str = " ms after it began";

/// When each piece of a capture arrived: `(end offset, ms since start)`,
/// both non-decreasing.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Timing {
    pub marks: Vec<(u64, u64)>,
    /// The response stopped after its last mark without its end
    /// ([`CUT_LINE`]).
    pub cut: bool,
    /// When it stopped, in milliseconds since it began, when the cut line
    /// says (a timing of an older version does not): a replay waits until
    /// then before it cuts, as an upstream that fell silent first did.
    pub cut_ms: Option<u64>,
    /// The response's status when it was not `200` ([`STATUS_LINE`]): a
    /// replay answers with it.
    pub status: Option<u16>,
}

/// Why a timing file cannot be used.
#[derive(Debug, thiserror::Error)]
#[error("timing line {line}: {reason}")]
pub struct TimingError {
    pub line: usize,
    pub reason: String,
}

impl Timing {
    /// The timing file that goes with `capture`: `capture` + `.timing`.
    pub fn sidecar(capture: &Path) -> PathBuf {
        let mut name = capture.as_os_str().to_owned();
        name.push(".timing");
        PathBuf::from(name)
    }

    /// Reads the sidecar of `capture`, if there is one; `capture_bytes`
    /// long, the capture must hold every offset it names (a timing past
    /// its end is another capture's, and would replay this one wrong).
    pub fn load_for(
        capture: &Path,
        capture_bytes: usize,
    ) -> Result<Option<Timing>, std::io::Error> {
        let invalid = |e: String| std::io::Error::new(std::io::ErrorKind::InvalidData, e);
        match std::fs::read_to_string(Timing::sidecar(capture)) {
            Ok(text) => {
                let timing = Timing::parse(&text).map_err(|e| invalid(e.to_string()))?;
                match timing.marks.last() {
                    Some(&(offset, _)) if offset > capture_bytes as u64 => Err(invalid(format!(
                        "its last offset, {offset}, is past the end of the capture \
                         ({capture_bytes} bytes): is it another capture's timing?"
                    ))),
                    _ => Ok(Some(timing)),
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(e),
        }
    }

    pub fn parse(text: &str) -> Result<Timing, TimingError> {
        let mut marks: Vec<(u64, u64)> = Vec::new();
        let (mut cut, mut cut_ms, mut status) = (false, None, None);
        for (n, line) in text.lines().enumerate() {
            let line_no = n + 1;
            let line = line.trim();
            if line.starts_with("# cut:") {
                cut = true;
                // `…, <ms> ms after it began`: a number too large or
                // missing times nothing (the cut then comes at once); the
                // first line that times it does.
                cut_ms = cut_ms.or_else(|| {
                    line.strip_suffix(CUT_TIME_SUFFIX)
                        .and_then(|rest| rest.rsplit(' ').next())
                        .and_then(|ms| ms.parse::<u64>().ok())
                });
            }
            let bad = |reason: &str| TimingError {
                line: line_no,
                reason: reason.to_owned(),
            };
            if let Some(rest) = line.strip_prefix(STATUS_LINE) {
                // One, before the marks: a status of an answer with a body
                // (a replay sends the capture as its body).
                if status.is_some() || !marks.is_empty() {
                    return Err(bad("one status line, before the marks"));
                }
                let code = rest.split_whitespace().next().unwrap_or_default();
                match code.parse::<u16>() {
                    Ok(code @ 200..=599) if code != 204 && code != 304 => status = Some(code),
                    _ => {
                        return Err(bad(
                            "the status is no HTTP status of an answer with a body (200 to \
                             599, not 204 or 304)",
                        ));
                    }
                }
            }
            // A header of another version: its lines may mean something
            // else than this reader would take them for.
            if let Some(version) = line
                .strip_prefix("# aalis-proxy timing ")
                .and_then(|rest| rest.split(':').next())
                && version != "1"
            {
                return Err(bad(&format!(
                    "timing version {version}, which this aalis-proxy does not read (it reads \
                     version 1)"
                )));
            }
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            let mut fields = line.split_whitespace();
            let (Some(offset), Some(ms), None) = (fields.next(), fields.next(), fields.next())
            else {
                return Err(bad("expected two numbers: <end offset> <milliseconds>"));
            };
            let number = |text: &str, what: &str| {
                text.parse::<u64>().map_err(|err| match err.kind() {
                    std::num::IntErrorKind::PosOverflow => {
                        bad(&format!("the {what} is too large (at most {})", u64::MAX))
                    }
                    _ => bad(&format!("the {what} is not a number")),
                })
            };
            let offset = number(offset, "offset")?;
            let ms = number(ms, "time")?;
            if let Some(&(last_offset, last_ms)) = marks.last()
                && (offset < last_offset || ms < last_ms)
            {
                return Err(bad("offsets and times must not go back"));
            }
            marks.push((offset, ms));
        }
        Ok(Timing {
            marks,
            cut,
            cut_ms,
            status,
        })
    }

    /// The file's text.
    pub fn render(&self) -> String {
        let mut out = String::from(TIMING_HEADER);
        out.push('\n');
        if let Some(status) = self.status.filter(|status| *status != 200) {
            out.push_str(&format!("{STATUS_LINE}{status}\n"));
        }
        for (offset, ms) in &self.marks {
            out.push_str(&format!("{offset} {ms}\n"));
        }
        if self.cut {
            out.push_str(CUT_LINE);
            if let Some(ms) = self.cut_ms {
                out.push_str(&format!(", {ms}{CUT_TIME_SUFFIX}"));
            }
            out.push('\n');
        }
        out
    }
}

/// How to replay `bytes`: pieces, each with the pause before it. With a
/// timing, the pieces are the recorded reads and the pauses the recorded
/// gaps; without, the pieces are the stream's frames, `pace` apart. The
/// pieces always cover `bytes` exactly, in order.
pub fn schedule(
    bytes: &[u8],
    timing: Option<&Timing>,
    pace: Duration,
) -> Vec<(Range<usize>, Duration)> {
    let mut out = Vec::new();
    // A timing of no marks (a file cut after its header) times nothing:
    // the capture is paced as one without timing, not sent in one piece.
    match timing.filter(|timing| !timing.marks.is_empty()) {
        Some(timing) => {
            let (mut start, mut last_ms) = (0usize, 0u64);
            for &(offset, ms) in &timing.marks {
                let end = usize::try_from(offset)
                    .unwrap_or(usize::MAX)
                    .min(bytes.len());
                // A mark that brings no bytes (a repeated offset) is no
                // piece: the next pause counts from the last piece.
                if end > start {
                    out.push((
                        start..end,
                        Duration::from_millis(ms.saturating_sub(last_ms)),
                    ));
                    start = end;
                    last_ms = ms;
                }
            }
            if start < bytes.len() {
                out.push((start..bytes.len(), Duration::ZERO));
            }
        }
        None => {
            let mut start = 0;
            for end in frame_ends(bytes) {
                let pause = if start == 0 { Duration::ZERO } else { pace };
                out.push((start..end, pause));
                start = end;
            }
        }
    }
    out
}

/// Where each frame of `bytes` ends, cut by the same framers `annotate`
/// uses.
fn frame_ends(bytes: &[u8]) -> Vec<usize> {
    let mut ends = Vec::new();
    let mut end = 0;
    match Framing::sniff(bytes).unwrap_or(Framing::Sse) {
        Framing::Sse => {
            let mut decoder = SseDecoder::new();
            decoder.push(bytes);
            decoder.finish();
            while let Some(block) = decoder.next_block() {
                end += block.raw.len();
                if !block.raw.is_empty() {
                    ends.push(end);
                }
            }
        }
        Framing::Ndjson => {
            let mut decoder = NdjsonDecoder::new();
            decoder.push(bytes);
            decoder.finish();
            while let Some(line) = decoder.next_line() {
                end += line.raw.len();
                ends.push(end);
            }
        }
    }
    ends
}

/// A file name part made from anything (a session id from a header):
/// ASCII letters, digits, `-` and `_` kept, everything else `_`, at most 64
/// characters, never empty and never starting with `.`, so it cannot name
/// a directory, a hidden file or a path outside the folder on any
/// filesystem.
pub fn safe_file_part(text: &str) -> String {
    let mut out: String = text
        .chars()
        .take(64)
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' || c == '_' {
                c
            } else {
                '_'
            }
        })
        .collect();
    if out.is_empty() {
        out.push_str("session");
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timing_round_trips_and_rejects_nonsense() {
        let mut timing = Timing {
            marks: vec![(10, 0), (25, 40), (25, 41)],
            ..Timing::default()
        };
        assert_eq!(Timing::parse(&timing.render()).expect("parses"), timing);
        // A cut response says so on a last line of its own, a comment to
        // a reader that does not know it; with when it came, if known.
        timing.cut = true;
        let text = timing.render();
        assert!(text.ends_with(&format!("25 41\n{CUT_LINE}\n")), "{text:?}");
        assert_eq!(Timing::parse(&text).expect("parses"), timing);
        timing.cut_ms = Some(90_041);
        let text = timing.render();
        assert!(
            text.ends_with(&format!("25 41\n{CUT_LINE}, 90041 ms after it began\n")),
            "{text:?}"
        );
        assert_eq!(Timing::parse(&text).expect("parses"), timing);
        // A status other than 200 on a line of its own after the header.
        timing.status = Some(503);
        let text = timing.render();
        assert!(
            text.starts_with(&format!("{TIMING_HEADER}\n# status: 503\n10 0\n")),
            "{text:?}"
        );
        assert_eq!(Timing::parse(&text).expect("parses"), timing);
        for bad in [
            "# status: 42",
            "# status: ok",
            "# status: 600",
            "# status: 101",
            "# status: 204",
        ] {
            let err = Timing::parse(bad).expect_err(bad);
            assert!(err.to_string().contains("no HTTP status"), "{err}");
        }
        for twice in ["# status: 503\n# status: 429", "1 2\n# status: 503"] {
            let err = Timing::parse(twice).expect_err(twice);
            assert!(err.to_string().contains("one status line"), "{err}");
        }
        // The first cut line that says when holds.
        let cut = Timing::parse(&format!(
            "1 2\n{CUT_LINE}, 1500 ms after it began\n# cut: again"
        ))
        .expect("parses");
        assert_eq!((cut.cut, cut.cut_ms), (true, Some(1500)));
        for bad in ["10", "a 1", "10 5\n5 6", "10 5\n11 4", "1 2 3"] {
            assert!(Timing::parse(bad).is_err(), "{bad:?}");
        }
        // Said for what it is: a number too large is no "not a number",
        // and another version's header is not read as this one's.
        let large = Timing::parse("1 99999999999999999999").expect_err("too large");
        assert!(large.to_string().contains("too large"), "{large}");
        let newer = Timing::parse("# aalis-proxy timing 2: <offset> <ms>\n1 2")
            .expect_err("another version");
        assert!(newer.to_string().contains("timing version 2"), "{newer}");
        assert!(Timing::parse(&format!("{TIMING_HEADER}\n1 2")).is_ok());
    }

    #[test]
    fn schedules_cover_the_bytes_in_order() {
        let bytes = b"data: 1\n\ndata: 2\n\ndata: [DONE]\n\n";
        let paced = schedule(bytes, None, Duration::from_millis(7));
        assert_eq!(
            paced,
            vec![
                (0..9, Duration::ZERO),
                (9..18, Duration::from_millis(7)),
                (18..32, Duration::from_millis(7)),
            ]
        );
        let timing = Timing {
            marks: vec![(5, 0), (20, 30), (20, 35)],
            ..Timing::default()
        };
        let timed = schedule(bytes, Some(&timing), Duration::ZERO);
        assert_eq!(
            timed,
            vec![
                (0..5, Duration::ZERO),
                (5..20, Duration::from_millis(30)),
                (20..32, Duration::ZERO),
            ]
        );
        // A timing of no marks (a file cut after its header, by a full
        // disk) paces the capture as none does; it was sent in one piece.
        let empty = Timing::default();
        assert_eq!(
            schedule(bytes, Some(&empty), Duration::from_millis(7)),
            paced
        );
        // A mark with no new bytes between two pieces, and one before the
        // first: the pauses count from the pieces, not from those marks.
        let timing = Timing {
            marks: vec![(0, 500), (9, 600), (9, 1000), (18, 1100)],
            ..Timing::default()
        };
        let timed = schedule(bytes, Some(&timing), Duration::ZERO);
        assert_eq!(
            timed,
            vec![
                (0..9, Duration::from_millis(600)),
                (9..18, Duration::from_millis(500)),
                (18..32, Duration::ZERO),
            ]
        );
    }

    #[test]
    fn file_parts_are_safe() {
        assert_eq!(safe_file_part("chat-42"), "chat-42");
        assert_eq!(safe_file_part("../../etc/passwd"), "______etc_passwd");
        assert_eq!(safe_file_part(".hidden"), "_hidden");
        assert_eq!(safe_file_part("a\r\nb"), "a__b");
        assert_eq!(safe_file_part(""), "session");
        assert_eq!(safe_file_part(&"x".repeat(100)).len(), 64);
    }
}
