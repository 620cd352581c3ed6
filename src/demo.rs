//! `aalis-proxy demo`: the whole path with nothing but the binary (issue 4).
//!
//! A built-in upstream ([`MockUpstream`] replaying the bundled captures:
//! parallel tool calls, reasoning then a tool, text then a tool, Ollama
//! thinking then two tools) and the proxy run in this process on loopback
//! ports the system picks; a client sends one streamed request per capture
//! through the proxy, one after the other, each in its own session. Spinners
//! show on stderr (plain lines when stderr is not a terminal); stdout gets a
//! summary per request, or with `--stream` the annotated streams themselves.
//!
//! Read [`run`] first.

use std::io::Write;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use bytes::Bytes;
use http::{Request, header};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use tokio::net::TcpListener;

/// What a failed write to the demo's output says.
pub const CANNOT_WRITE: &str = "cannot write the output";
use tokio::sync::oneshot;

use crate::encode::OutputFormat;
use crate::framing::Framing;
use crate::mock::{Capture, MockUpstream};
use crate::pipeline::{Annotator, AnnotatorConfig};
use crate::proxy::service::Proxy;
use crate::proxy::sessions::SessionRegistry;
use crate::proxy::upstream::Upstream;
use crate::proxy::{ProxyConfig, serve_proxy};
use crate::render::spinner::ProgressDisplay;

/// What the demo does.
pub struct DemoOptions {
    /// Pause between two events of each replayed capture.
    pub delay: Duration,
    /// Write the annotated streams on stdout as they arrive, instead of summaries.
    pub stream: bool,
    /// Where spinners go.
    pub display: Arc<ProgressDisplay>,
}

/// Runs the demo to the end, writing to `out`; returns the number of tool
/// calls the client saw.
pub async fn run(options: DemoOptions, out: &mut (dyn Write + Send)) -> anyhow::Result<usize> {
    let captures = Capture::bundled();
    let mock_listener = TcpListener::bind("127.0.0.1:0")
        .await
        .context("cannot listen for the demo upstream")?;
    let mock_addr = mock_listener.local_addr()?;
    let (stop_mock, mock_stopped) = oneshot::channel::<()>();
    let mock = MockUpstream::new(captures.clone(), options.delay);
    let mock_task = tokio::spawn(mock.run(mock_listener, async {
        let _ = mock_stopped.await;
    }));

    let proxy_listener = TcpListener::bind("127.0.0.1:0")
        .await
        .context("cannot listen for the demo proxy")?;
    let proxy_addr = proxy_listener.local_addr()?;
    let config = proxy_config(mock_addr, options.delay)?;
    let proxy = Proxy::from_config(config, SessionRegistry::with_display(options.display))?;
    let (stop_proxy, proxy_stopped) = oneshot::channel::<()>();
    let proxy_task = tokio::spawn(serve_proxy(proxy_listener, proxy, async {
        let _ = proxy_stopped.await;
    }));

    let client = Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>();
    let mut tool_calls = 0;
    for capture in &captures {
        let path = match capture.framing {
            Framing::Sse => "/v1/chat/completions",
            Framing::Ndjson => "/api/chat",
        };
        let body = serde_json::json!({"model": capture.name, "stream": true}).to_string();
        let request = Request::post(format!("http://{proxy_addr}{path}"))
            .header(header::CONTENT_TYPE, "application/json")
            .header("x-aalis-session", format!("demo-{}", capture.name))
            .body(Full::new(Bytes::from(body)))?;
        let started = Instant::now();
        let response = client
            .request(request)
            .await
            .with_context(|| format!("the demo request for {} failed", capture.name))?;
        let status = response.status();
        // With --stream each piece goes out as it comes, flushed, as
        // `annotate` writes: collected first, a stream showed only once
        // it had ended.
        let mut body = response.into_body();
        let mut annotated = Vec::new();
        while let Some(frame) = body.frame().await {
            let frame =
                frame.with_context(|| format!("the demo stream for {} was cut", capture.name))?;
            if let Ok(data) = frame.into_data() {
                if options.stream {
                    out.write_all(&data)
                        .and_then(|()| out.flush())
                        .context(CANNOT_WRITE)?;
                }
                annotated.extend_from_slice(&data);
            }
        }
        let summary = summarize(&annotated, capture.framing);
        tool_calls += summary.calls.len();
        if !options.stream {
            writeln!(
                out,
                "{}  {status}  {} → {} bytes  {} {} with progress  {:.1}s",
                capture.name,
                capture.bytes.len(),
                annotated.len(),
                summary.annotated_events,
                if summary.annotated_events == 1 {
                    "event"
                } else {
                    "events"
                },
                started.elapsed().as_secs_f64(),
            )
            .context(CANNOT_WRITE)?;
            for (name, chars) in &summary.calls {
                writeln!(out, "    tool call {name}: {chars} chars of arguments")
                    .context(CANNOT_WRITE)?;
            }
        }
        out.flush().context(CANNOT_WRITE)?;
    }
    let _ = stop_proxy.send(());
    let _ = stop_mock.send(());
    let _ = proxy_task.await;
    let _ = mock_task.await;
    Ok(tool_calls)
}

/// What the client got from one request.
struct Summary {
    /// `(name, charsAccumulated)` of each assembled call.
    calls: Vec<(String, usize)>,
    /// Events or lines that carried a `toolCallProgress`.
    annotated_events: usize,
}

/// Reads what the client received with the library itself: the calls it
/// assembles, and how many events carried progress.
fn summarize(annotated: &[u8], framing: Framing) -> Summary {
    let mut annotator = Annotator::new(AnnotatorConfig {
        output: OutputFormat::Ndjson,
        framing: Some(framing),
        ..AnnotatorConfig::default()
    });
    let mut lines = Vec::new();
    annotator.push(annotated, 0, &mut lines);
    annotator.finish(0, &mut lines);
    let calls = annotator
        .tracker()
        .calls()
        .flat_map(|(_, calls)| {
            calls
                .iter()
                .map(|c| (c.name.to_string(), c.chars_accumulated))
        })
        .collect();
    let annotated_events = String::from_utf8_lossy(annotated)
        .matches("\"toolCallProgress\":")
        .count();
    Summary {
        calls,
        annotated_events,
    }
}

/// The demo proxy's configuration, for the mock at `mock_addr` pausing
/// `delay` between pieces. The pauses are the demo's own: the proxy waits
/// 30 s past one (`--delay-ms 30000` was cut at 30 s).
fn proxy_config(mock_addr: std::net::SocketAddr, delay: Duration) -> anyhow::Result<ProxyConfig> {
    let patience = delay.saturating_add(Duration::from_secs(30));
    Ok(ProxyConfig {
        connect_timeout: Duration::from_secs(5),
        response_timeout: patience,
        idle_timeout: patience,
        shutdown_grace: Duration::from_secs(1),
        ..ProxyConfig::new(Upstream::parse(&format!("http://{mock_addr}"))?)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A pause of the demo's mock never trips the proxy's timeouts, however
    /// long `--delay-ms` makes it.
    #[test]
    fn the_demo_proxy_outwaits_the_mocks_pauses() {
        let addr = std::net::SocketAddr::from(([127, 0, 0, 1], 9));
        for delay in [
            Duration::ZERO,
            Duration::from_secs(31),
            Duration::from_secs(3600),
        ] {
            let config = proxy_config(addr, delay).expect("config");
            assert!(config.idle_timeout > delay, "{delay:?}");
            assert!(config.response_timeout > delay, "{delay:?}");
        }
    }
}
