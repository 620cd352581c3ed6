//! aalis-proxy: tool-call progress for LLM chat streams.
//!
//! OpenAI-compatible APIs stream a tool call as argument fragments and no
//! text, so a UI looks frozen; this crate turns those fragments into
//! `toolCallProgress` events `{index, name, charsAccumulated}` without
//! changing a byte of the stream it carries. The contract is SPEC.md.
//!
//! Layout, in the order data flows (the core is synchronous and does no I/O,
//! so the `annotate` filter and the proxy share it):
//!
//! - [`framing`]: bytes → frames (SSE events, NDJSON lines), each with its raw bytes
//! - [`providers`]: a frame's data → normalized [`chunk::Chunk`]s (OpenAI-style, Ollama)
//! - [`progress`]: chunks → tool-call state and progress ([`progress::ToolCallTracker`])
//! - [`encode`]: frames + progress → output bytes (annotated passthrough, NDJSON lines)
//! - [`pipeline`]: all of the above for one stream ([`pipeline::Annotator`])
//! - [`filter`]: the `annotate` command: stdin or a file → stdout
//! - [`cli`]: the command line (clap); [`error`]: errors and exit codes
//! - [`js`]: JavaScript `String.length` and `JSON.stringify`, for exact counts
//! - [`stderr_log`]: the log of `serve` and `mock`, written by a thread of its own

pub mod capture;
pub mod chunk;
pub mod cli;
pub mod demo;
pub mod encode;
pub mod error;
pub mod filter;
pub mod framing;
pub mod js;
pub mod mock;
pub mod pipeline;
pub mod progress;
pub mod providers;
pub mod proxy;
pub mod render;
pub mod stderr_log;
