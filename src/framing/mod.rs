//! Byte streams → frames, incrementally and without I/O.
//!
//! Each decoder takes input in pieces of any size (`push`), hands out
//! complete frames that borrow its buffer (`next_block` / `next_line`), and
//! after `finish` hands out what is left. Or it frames each piece where it
//! lies (`feed`, [`window`]), which the pipeline uses: the same frames,
//! without copying the input. Every frame carries its exact raw bytes, so
//! forwarding frames in order reproduces the input. Nothing here parses
//! JSON: that is [`crate::providers`].

pub mod ndjson;
pub mod sse;
pub mod window;

/// How a stream is framed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Framing {
    /// `text/event-stream`: OpenAI-compatible chat completions.
    Sse,
    /// `application/x-ndjson`: Ollama's native `/api/chat`.
    Ndjson,
}

impl Framing {
    /// Guesses the framing from the start of a stream: NDJSON starts with
    /// `{` (after an optional BOM and whitespace), SSE with a field or a
    /// comment. Returns `None` while only whitespace has been seen.
    pub fn sniff(start: &[u8]) -> Option<Framing> {
        const BOM: &[u8] = b"\xEF\xBB\xBF";
        if start.len() < BOM.len() && BOM.starts_with(start) {
            return None;
        }
        Framing::sniff_after_start(start.strip_prefix(BOM).unwrap_or(start))
    }

    /// [`sniff`](Self::sniff) for bytes after a stream's start (a BOM
    /// there is no BOM): the first byte that is not whitespace decides.
    pub fn sniff_after_start(bytes: &[u8]) -> Option<Framing> {
        let first = bytes.iter().find(|b| !b.is_ascii_whitespace())?;
        Some(if *first == b'{' {
            Framing::Ndjson
        } else {
            Framing::Sse
        })
    }
}
