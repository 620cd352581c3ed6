//! `aalis-proxy mock`: a fake OpenAI-compatible upstream that replays
//! capture files, for demos, tests and benchmarks (issue 3).
//!
//! - `POST …/chat/completions` replays an SSE capture as
//!   `text/event-stream`;
//! - `POST /api/chat` replays an NDJSON capture as `application/x-ndjson`;
//! - `GET …/models` lists the captures as models.
//!
//! The capture is the one whose file stem equals the request's `model`,
//! else the first of the right kind. It is sent byte for byte, with its
//! recorded timing (a `NAME.sse.timing` file beside it, as `serve --record`
//! writes) or one frame (SSE event or NDJSON line) every `delay`. With no capture files, captures bundled in the
//! binary are served, so nothing else is needed for a demo.
//!
//! Read [`MockUpstream`] first.

use std::collections::VecDeque;
use std::future::Future;
use std::path::Path;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::header::{self, HeaderValue};
use http::{Method, Request, Response, StatusCode};
use http_body::{Body, Frame};
use http_body_util::BodyExt;
use hyper::body::Incoming;
use serde::Deserialize;
use tokio::net::TcpListener;
use tokio::time::Sleep;

use crate::capture::{self, Timing};
use crate::encode::OutputFormat;
use crate::framing::Framing;
use crate::pipeline::{Annotator, AnnotatorConfig};
use crate::proxy::body::FLUSH_GRACE;
use crate::proxy::upstream::{BoxError, ProxyBody};
use crate::proxy::{SocketFull, server, service};

/// Captures built into the binary: `(name, bytes)`.
pub const BUNDLED: [(&str, &[u8]); 4] = [
    (
        "parallel_tool_calls",
        include_bytes!("../fixtures/openai/parallel_tool_calls.sse"),
    ),
    (
        "reasoning_then_tool",
        include_bytes!("../fixtures/deepseek/reasoning_then_tool.sse"),
    ),
    (
        "text_then_tool",
        include_bytes!("../fixtures/openai/text_then_tool.sse"),
    ),
    (
        "thinking_two_tools",
        include_bytes!("../fixtures/ollama/thinking_two_tools.ndjson"),
    ),
];

/// Whether `path` is one of the files `serve --record` writes beside a
/// capture (`.timing`, `.request.json`) or a recording left incomplete
/// (`.partial`): no capture to serve, though `mock captures/*` names it.
pub fn is_not_a_capture(path: &Path) -> bool {
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy())
        .unwrap_or_default();
    [".timing", ".request.json", ".partial"]
        .iter()
        .any(|suffix| name.ends_with(suffix))
}

/// One capture: its bytes, and when each piece came if it was recorded.
#[derive(Debug, Clone)]
pub struct Capture {
    /// The file stem; a request's `model` selects it.
    pub name: String,
    pub framing: Framing,
    pub bytes: Bytes,
    /// The recorded timing (`NAME.sse.timing`), if any.
    pub timing: Option<Timing>,
}

impl Capture {
    /// A capture of `bytes`, with the framing sniffed from its start.
    pub fn new(name: &str, bytes: &[u8]) -> Capture {
        Capture {
            name: name.to_owned(),
            framing: Framing::sniff(bytes).unwrap_or(Framing::Sse),
            bytes: Bytes::copy_from_slice(bytes),
            timing: None,
        }
    }

    /// Reads a capture file and its timing file, if it has one.
    pub fn from_file(path: &Path) -> std::io::Result<Capture> {
        let bytes = std::fs::read(path)?;
        let name = path
            .file_stem()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_default();
        let mut capture = Capture::new(&name, &bytes);
        // Its own name in the message: the capture itself was read.
        capture.timing = Timing::load_for(path, bytes.len()).map_err(|err| {
            let sidecar = Timing::sidecar(path);
            std::io::Error::new(
                err.kind(),
                format!("cannot read {}: {err}", sidecar.display()),
            )
        })?;
        Ok(capture)
    }

    /// What is wrong with it as a capture, if anything: no frame at all
    /// (SSE events with data, NDJSON lines), or none that carries text,
    /// reasoning, a tool call, usage or an error, as `annotate --format
    /// ndjson` reads it (named events, objects of another API, a lone
    /// `[DONE]` carry none). Read through the pipeline in pieces, until
    /// something of a chat shows.
    pub fn problem(&self) -> Option<String> {
        let mut annotator = Annotator::new(AnnotatorConfig {
            framing: Some(self.framing),
            output: OutputFormat::Ndjson,
            ..AnnotatorConfig::default()
        });
        let mut out = Vec::new();
        for piece in self.bytes.chunks(64 * 1024) {
            annotator.push(piece, 0, &mut out);
            if carries_chat(&out) {
                return None;
            }
            out.clear();
        }
        annotator.finish(0, &mut out);
        if carries_chat(&out) {
            return None;
        }
        let (none, unit, units) = match self.framing {
            Framing::Sse => ("no SSE event with data", "SSE event", "SSE events"),
            Framing::Ndjson => ("no NDJSON line", "NDJSON line", "NDJSON lines"),
        };
        let frames = annotator.frames();
        if frames == 0 {
            return Some(format!("{none} in it"));
        }
        let what = "text, reasoning, a tool call, usage or an error";
        // "none of" reads for one and for many.
        let mut problem = match frames {
            1 => format!("its one {unit} carries none of {what}"),
            _ => format!("none of its {frames} {units} carries {what}"),
        };
        if let Some(first) = annotator.take_warnings().first() {
            problem.push_str(&format!(" (the first warning: {first})"));
        }
        Some(problem)
    }

    /// The captures bundled in the binary.
    pub fn bundled() -> Vec<Capture> {
        BUNDLED
            .iter()
            .map(|(name, bytes)| Capture::new(name, bytes))
            .collect()
    }

    /// The pieces to send and the pause before each: the recorded timing,
    /// or one frame every `pace`.
    pub fn pieces(&self, pace: Duration) -> Vec<(Bytes, Duration)> {
        capture::schedule(&self.bytes, self.timing.as_ref(), pace)
            .into_iter()
            .map(|(range, pause)| (self.bytes.slice(range), pause))
            .collect()
    }

    /// When the recorded response was cut, not ended (its timing says
    /// so), from its start: a replay stops as it did, then (at once after
    /// its last piece when the timing does not say when).
    pub fn cut(&self) -> Option<Duration> {
        let timing = self.timing.as_ref().filter(|timing| timing.cut)?;
        Some(Duration::from_millis(timing.cut_ms.unwrap_or(0)))
    }

    /// The status the recorded response came with (`200` unless its
    /// timing says another).
    pub fn status(&self) -> StatusCode {
        self.timing
            .as_ref()
            .and_then(|timing| timing.status)
            .and_then(|status| StatusCode::from_u16(status).ok())
            .unwrap_or(StatusCode::OK)
    }
}

/// Whether lines of `annotate --format ndjson` say anything of a chat: a
/// line with a key besides `done`, `incomplete`, `unparsed` and `choice`.
fn carries_chat(lines: &[u8]) -> bool {
    lines
        .split(|b| *b == b'\n')
        .filter(|line| !line.is_empty())
        .any(|line| {
            serde_json::from_slice::<serde_json::Map<String, serde_json::Value>>(line).is_ok_and(
                |keys| {
                    keys.keys().any(|key| {
                        !matches!(key.as_str(), "done" | "incomplete" | "unparsed" | "choice")
                    })
                },
            )
        })
}

/// The mock server's state; cheap to clone.
#[derive(Debug, Clone)]
pub struct MockUpstream {
    captures: Arc<Vec<Capture>>,
    delay: Duration,
}

/// The largest chat request body the mock reads (it needs only its
/// `model`); a larger one gets 413.
pub const MAX_REQUEST_BYTES: usize = 64 * 1024 * 1024;

impl MockUpstream {
    pub fn new(captures: Vec<Capture>, delay: Duration) -> MockUpstream {
        MockUpstream {
            captures: Arc::new(captures),
            delay,
        }
    }

    /// Serves until `shutdown` resolves.
    pub async fn run(self, listener: TcpListener, shutdown: impl Future<Output = ()>) {
        let handler = move |req: Request<Incoming>, peer: server::Peer| {
            let mock = self.clone();
            async move {
                // One line a request with -v (the replay itself is the
                // mock's whole job; it logs nothing at the default level).
                let (method, path) = (req.method().clone(), req.uri().path().to_owned());
                let response = mock.handle(req, peer.socket_full).await;
                tracing::debug!(%method, %path, status = response.status().as_u16(), "request");
                response
            }
        };
        let options = server::ServeOptions {
            grace: Duration::from_secs(1),
            head_timeout: server::HEAD_READ_TIMEOUT,
            // As long as `serve`'s default --client-timeout.
            client_timeout: Duration::from_secs(300),
            // As the request lines above, with -v.
            refused: Box::new(|head| {
                tracing::debug!(
                    status = head.status.as_u16(),
                    "request head refused: {}",
                    head.reason
                );
            }),
        };
        server::serve(listener, handler, shutdown, options, &[]).await;
    }

    /// Answers one request from a client whose socket's fullness is
    /// `socket_full`.
    pub async fn handle(
        &self,
        req: Request<Incoming>,
        socket_full: SocketFull,
    ) -> Response<ProxyBody> {
        let path = req.uri().path().to_owned();
        let framing = if path.ends_with("/chat/completions") {
            Framing::Sse
        } else if path == "/api/chat" {
            Framing::Ndjson
        } else if path.ends_with("/models") {
            // HEAD as GET: hyper sends the head alone.
            if req.method() == Method::GET || req.method() == Method::HEAD {
                return self.models();
            }
            let mut response = json_error(StatusCode::METHOD_NOT_ALLOWED, "use GET");
            response
                .headers_mut()
                .insert(hyper::header::ALLOW, HeaderValue::from_static("GET, HEAD"));
            return response;
        } else {
            return json_error(StatusCode::NOT_FOUND, &format!("the mock serves no {path}"));
        };
        if req.method() != Method::POST {
            let mut response = json_error(StatusCode::METHOD_NOT_ALLOWED, "use POST");
            response
                .headers_mut()
                .insert(hyper::header::ALLOW, HeaderValue::from_static("POST"));
            return response;
        }
        // Only its `model` is read: a body past the bound is refused, not
        // held (a 400 MB POST took 832 MB).
        let body = match http_body_util::Limited::new(req.into_body(), MAX_REQUEST_BYTES)
            .collect()
            .await
        {
            Ok(body) => body.to_bytes(),
            Err(err) if err.is::<http_body_util::LengthLimitError>() => {
                return json_error(
                    StatusCode::PAYLOAD_TOO_LARGE,
                    &format!("the mock reads request bodies of at most {MAX_REQUEST_BYTES} bytes"),
                );
            }
            Err(err) => {
                return json_error(
                    StatusCode::BAD_REQUEST,
                    &format!("cannot read the body: {err}"),
                );
            }
        };
        // Each member on its own: a `model` of another type does not hide
        // `stream`.
        #[derive(Deserialize)]
        struct ChatRequest {
            model: Option<serde_json::Value>,
            stream: Option<serde_json::Value>,
        }
        let (model, stream) = serde_json::from_slice::<ChatRequest>(&body)
            .map(|r| (r.model, r.stream))
            .unwrap_or_default();
        let model = model.as_ref().and_then(serde_json::Value::as_str);
        // A client that asked for one JSON answer would choke on a stream
        // (an SDK's parse error says nothing of why). Without `stream`, a
        // stream all the same: `curl -d '{}'` is the mock's use.
        if stream == Some(serde_json::Value::Bool(false)) {
            return json_error(
                StatusCode::BAD_REQUEST,
                "the mock replays streams only, and this request asks for none \
                 (\"stream\": false); send \"stream\": true, or leave it out",
            );
        }
        let of_kind = || self.captures.iter().filter(|c| c.framing == framing);
        let capture = of_kind()
            .find(|c| Some(c.name.as_str()) == model)
            .or_else(|| of_kind().next());
        let Some(capture) = capture else {
            return json_error(StatusCode::NOT_FOUND, "no capture of that kind is loaded");
        };
        let content_type = match framing {
            Framing::Sse => "text/event-stream",
            Framing::Ndjson => "application/x-ndjson",
        };
        let body = PacedBody::new(capture.pieces(self.delay), capture.cut(), Some(socket_full));
        let mut response = Response::new(body.boxed());
        *response.status_mut() = capture.status();
        response
            .headers_mut()
            .insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
        response
    }

    fn models(&self) -> Response<ProxyBody> {
        // Each id once (an SSE and an NDJSON capture may share a name; a
        // client takes the list's ids for unique, as OpenAI's are).
        let mut seen = std::collections::HashSet::new();
        let data: Vec<_> = self
            .captures
            .iter()
            .filter(|c| seen.insert(c.name.as_str()))
            .map(|c| serde_json::json!({"id": c.name, "object": "model", "owned_by": "aalis-proxy-mock"}))
            .collect();
        service::json_response(&serde_json::json!({"object": "list", "data": data}))
    }
}

/// Sends pieces one by one, each after its pause; stops when the client
/// goes (the body is dropped, and with it the timer). Each piece is due at
/// the body's start plus the pauses before it, not at its pause after the
/// last piece went: the time a piece takes to go out (a wake-up, a write)
/// is not added to every pause, which made a recording replay a third
/// slower, and a piece that is late goes at once. A recording that was cut
/// ends with an error after its last piece, so the connection is cut too
/// (no last chunk), not ended: once the pieces before it are out, as the
/// proxy's body waits ([`FLUSH_GRACE`], longer while the client's socket is
/// full), since hyper drops what it holds when a body fails.
struct PacedBody {
    pieces: VecDeque<(Bytes, Duration)>,
    /// Cut, not ended, so long after the start (not before the last piece).
    cut: Option<Duration>,
    /// The client's socket was full at its connection's last write.
    socket_full: Option<SocketFull>,
    sleep: Option<Pin<Box<Sleep>>>,
    /// When the last piece was due (the body's first poll, at first).
    due: Option<tokio::time::Instant>,
    /// The body's first poll.
    started: Option<tokio::time::Instant>,
}

impl PacedBody {
    fn new(
        pieces: Vec<(Bytes, Duration)>,
        cut: Option<Duration>,
        socket_full: Option<SocketFull>,
    ) -> PacedBody {
        PacedBody {
            pieces: pieces.into(),
            cut,
            socket_full,
            sleep: None,
            due: None,
            started: None,
        }
    }
}

impl Body for PacedBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        loop {
            if let Some(sleep) = self.sleep.as_mut() {
                std::task::ready!(sleep.as_mut().poll(cx));
                self.sleep = None;
                let Some((piece, _)) = self.pieces.pop_front() else {
                    // The wait before a cut: the pieces are out, or the
                    // client's socket is still full.
                    if self.cut.is_none() {
                        return Poll::Ready(None);
                    }
                    if self.socket_full.as_ref().is_some_and(SocketFull::get) {
                        self.sleep = Some(Box::pin(tokio::time::sleep(FLUSH_GRACE)));
                        continue;
                    }
                    self.cut = None;
                    return Poll::Ready(Some(Err(RECORDED_CUT.into())));
                };
                return Poll::Ready(Some(Ok(Frame::data(piece))));
            }
            let now = tokio::time::Instant::now();
            let started = *self.started.get_or_insert(now);
            let Some(&(_, pause)) = self.pieces.front() else {
                if let Some(cut) = self.cut {
                    // At the recorded time of the cut, and not before the
                    // last piece has had its grace.
                    let until = (now + FLUSH_GRACE).max(started + cut);
                    self.sleep = Some(Box::pin(tokio::time::sleep_until(until)));
                    continue;
                }
                return Poll::Ready(None);
            };
            let due = self.due.unwrap_or(now) + pause;
            self.due = Some(due);
            if due <= now {
                let Some((piece, _)) = self.pieces.pop_front() else {
                    return Poll::Ready(None);
                };
                return Poll::Ready(Some(Ok(Frame::data(piece))));
            }
            self.sleep = Some(Box::pin(tokio::time::sleep_until(due)));
        }
    }

    fn is_end_stream(&self) -> bool {
        self.pieces.is_empty() && self.cut.is_none()
    }
}

/// Why a replay of a cut recording stops.
const RECORDED_CUT: &str = "the recorded response was cut here";

fn json_error(status: StatusCode, message: &str) -> Response<ProxyBody> {
    service::json_error(status, "mock_error", message)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A reader that takes 1 ms with each of 100 pieces paced 2 ms apart
    /// gets the last at 200 ms, as the pauses add up, not at 300: the time
    /// a piece takes to go is not added to the next pause.
    #[tokio::test(start_paused = true)]
    async fn a_replay_keeps_its_timing_behind_a_slow_reader() {
        use http_body_util::BodyExt;
        let pieces = (0..100)
            .map(|_| {
                (
                    Bytes::from_static(b"data: {}\n\n"),
                    Duration::from_millis(2),
                )
            })
            .collect();
        let mut body = PacedBody::new(pieces, None, None);
        let start = tokio::time::Instant::now();
        let mut got = 0;
        while let Some(frame) = body.frame().await {
            assert!(frame.expect("a piece").is_data());
            got += 1;
            tokio::time::advance(Duration::from_millis(1)).await;
        }
        assert_eq!(got, 100);
        assert_eq!(
            start.elapsed(),
            Duration::from_millis(201),
            "2 ms a piece, then the last read"
        );
    }

    /// A recording cut 5 s after its start, its last piece at 10 ms (an
    /// upstream that fell silent, then failed), is cut at 5 s on replay, as
    /// it came; cut with no time said (an older timing), a grace after its
    /// last piece. It was cut at once after the last piece either way.
    #[tokio::test(start_paused = true)]
    async fn a_replay_is_cut_when_its_recording_was() {
        use http_body_util::BodyExt;
        let bytes = b"data: 1\n\ndata: 2\n\n";
        for (cut_ms, at) in [
            (Some(5000), Duration::from_secs(5)),
            (None, Duration::from_millis(10) + FLUSH_GRACE),
        ] {
            let mut capture = Capture::new("cut", bytes);
            capture.timing = Some(Timing {
                marks: vec![(9, 0), (18, 10)],
                cut: true,
                cut_ms,
                ..Timing::default()
            });
            let cut = capture.cut();
            let mut body = PacedBody::new(capture.pieces(Duration::ZERO), cut, None);
            let start = tokio::time::Instant::now();
            for _ in 0..2 {
                let frame = body.frame().await.expect("a piece").expect("not the cut");
                assert!(frame.is_data());
            }
            assert!(!body.is_end_stream());
            let end = body.frame().await.expect("the cut");
            assert!(end.is_err(), "{end:?}");
            assert_eq!(start.elapsed(), at, "cut at {cut:?}");
        }
    }

    #[test]
    fn bundled_captures_cut_into_frames_that_rebuild_the_file() {
        for (capture, (_, bytes)) in Capture::bundled().iter().zip(BUNDLED) {
            let pieces = capture.pieces(Duration::from_millis(5));
            assert!(pieces.len() > 3, "{}", capture.name);
            let joined: Vec<u8> = pieces.iter().flat_map(|(p, _)| p.to_vec()).collect();
            assert_eq!(joined, bytes, "{}", capture.name);
            assert_eq!(pieces[0].1, Duration::ZERO);
            assert!(
                pieces[1..]
                    .iter()
                    .all(|(_, pause)| *pause == Duration::from_millis(5))
            );
        }
        assert_eq!(Capture::bundled()[3].framing, Framing::Ndjson);
    }
}
