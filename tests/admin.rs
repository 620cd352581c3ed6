//! The `/_aalis/` routes over loopback (issue 5): every route, the events
//! stream with two tools in parallel, a subscriber that joins before the
//! first request, a late one, and a stalled one that must not slow the
//! stream; and that none of them reaches the upstream.

mod common;

use std::time::{Duration, Instant};

use aalis_proxy::mock::{Capture, MockUpstream};
use aalis_proxy::proxy::service::Proxy;
use aalis_proxy::proxy::sessions::SessionRegistry;
use aalis_proxy::proxy::upstream::Upstream;
use aalis_proxy::proxy::{ProxyConfig, serve_proxy};
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use serde_json::Value;
use tokio::net::TcpListener;

const PATIENCE: Duration = Duration::from_secs(10);

struct Running {
    proxy: String,
    sessions: SessionRegistry,
    _stops: Vec<tokio::sync::oneshot::Sender<()>>,
}

/// mock (replaying the bundled captures `delay` apart) and a proxy in front.
async fn start(delay: Duration) -> Running {
    start_with(Capture::bundled(), delay).await
}

async fn start_with(captures: Vec<Capture>, delay: Duration) -> Running {
    start_configured(captures, delay, |_| {}).await
}

/// [`start_with`], with the proxy's configuration changed by `change`.
async fn start_configured(
    captures: Vec<Capture>,
    delay: Duration,
    change: impl FnOnce(&mut ProxyConfig),
) -> Running {
    let mock_listener = TcpListener::bind("127.0.0.1:0").await.expect("bind mock");
    let mock_addr = mock_listener.local_addr().expect("addr");
    let (stop_mock, mock_stopped) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(
        MockUpstream::new(captures, delay).run(mock_listener, async {
            let _ = mock_stopped.await;
        }),
    );
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind proxy");
    let addr = listener.local_addr().expect("addr");
    let mut config =
        ProxyConfig::new(Upstream::parse(&format!("http://{mock_addr}")).expect("url"));
    change(&mut config);
    let sessions = SessionRegistry::new();
    let proxy = Proxy::from_config(config, sessions.clone()).expect("proxy");
    let (stop_proxy, proxy_stopped) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(serve_proxy(listener, proxy, async {
        let _ = proxy_stopped.await;
    }));
    Running {
        proxy: format!("http://{addr}"),
        sessions,
        _stops: vec![stop_mock, stop_proxy],
    }
}

fn client() -> Client<hyper_util::client::legacy::connect::HttpConnector, Full<Bytes>> {
    Client::builder(TokioExecutor::new()).build_http()
}

async fn send(
    method: &str,
    url: &str,
    body: &str,
    headers: &[(&str, &str)],
) -> http::Response<Incoming> {
    let mut request = http::Request::builder().method(method).uri(url);
    for (k, v) in headers {
        request = request.header(*k, *v);
    }
    let request = request
        .body(Full::new(Bytes::from(body.to_owned())))
        .expect("request");
    tokio::time::timeout(PATIENCE, client().request(request))
        .await
        .expect("in time")
        .expect("response")
}

async fn json(method: &str, url: &str, body: &str) -> (u16, Value) {
    let response = send(method, url, body, &[("content-type", "application/json")]).await;
    let status = response.status().as_u16();
    let bytes = whole(response.into_body()).await;
    (status, serde_json::from_slice(&bytes).expect("JSON body"))
}

/// All of `body`, failing the test on a hang (60 s) or an error.
async fn whole(body: Incoming) -> Bytes {
    tokio::time::timeout(Duration::from_secs(60), body.collect())
        .await
        .expect("the body ends within 60 s")
        .expect("body")
        .to_bytes()
}

/// Starts the `parallel_tool_calls` stream in session `session`; the task
/// reads it to the end and returns its bytes.
fn chat(base: &str, session: &str) -> tokio::task::JoinHandle<Vec<u8>> {
    let (base, session) = (base.to_owned(), session.to_owned());
    tokio::spawn(async move {
        whole(chat_body(&base, &session, "parallel_tool_calls").await)
            .await
            .to_vec()
    })
}

/// The frames of an event stream, read as they come.
struct Frames {
    body: Incoming,
    buffer: Vec<u8>,
}

impl Frames {
    async fn open(base: &str, session: &str) -> Frames {
        Frames::open_path(base, &format!("/_aalis/sessions/{session}/events")).await
    }

    async fn open_path(base: &str, path: &str) -> Frames {
        let response = send("GET", &format!("{base}{path}"), "", &[]).await;
        assert_eq!(response.status(), 200);
        assert_eq!(
            response
                .headers()
                .get("content-type")
                .and_then(|v| v.to_str().ok()),
            Some("text/event-stream")
        );
        Frames {
            body: response.into_body(),
            buffer: Vec::new(),
        }
    }

    /// The next `data:` frame, as JSON.
    async fn next(&mut self) -> Value {
        let deadline = Instant::now() + PATIENCE;
        loop {
            if let Some(end) = self.buffer.windows(2).position(|w| w == b"\n\n") {
                let frame: Vec<u8> = self.buffer.drain(..end + 2).collect();
                let text = String::from_utf8(frame).expect("UTF-8 frame");
                if let Some(data) = text.strip_prefix("data: ") {
                    return serde_json::from_str(data.trim_end()).expect("JSON frame");
                }
                continue;
            }
            let left = deadline.saturating_duration_since(Instant::now());
            let frame = tokio::time::timeout(left, self.body.frame())
                .await
                .expect("a frame in time")
                .expect("stream open")
                .expect("frame");
            if let Ok(data) = frame.into_data() {
                self.buffer.extend_from_slice(&data);
            }
        }
    }

    /// Frames until (and including) the first one `stop` accepts.
    async fn until(&mut self, stop: impl Fn(&Value) -> bool) -> Vec<Value> {
        let mut seen = Vec::new();
        loop {
            let frame = self.next().await;
            let done = stop(&frame);
            seen.push(frame);
            if done {
                return seen;
            }
        }
    }
}

fn progress(frames: &[Value]) -> Vec<(u64, u64)> {
    frames
        .iter()
        .filter_map(|f| f.get("toolCallProgress"))
        .map(|p| {
            (
                p["index"].as_u64().unwrap_or(99),
                p["charsAccumulated"].as_u64().unwrap_or(0),
            )
        })
        .collect()
}

/// A subscriber that joins before the session's first request gets an
/// empty snapshot, then every increment of two tools in parallel, a clear
/// and done, in order, with counts that only grow per index; and it stays
/// subscribed across the session's next request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_subscriber_before_the_request_sees_two_tools_then_the_clear() {
    two_tools_then_the_clear(Duration::from_millis(5)).await;
}

/// The same with the capture sent at once: the proxy reads its events in
/// a few reads, gathers their output into one write, and publishes once
/// per write; subscribers still hear every increment, in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_subscriber_hears_every_increment_of_a_burst() {
    two_tools_then_the_clear(Duration::ZERO).await;
}

async fn two_tools_then_the_clear(delay: Duration) {
    let run = start(delay).await;
    let mut frames = Frames::open(&run.proxy, "early").await;
    let resume = frames.next().await;
    assert_eq!(resume["type"], "stream_resume");
    assert_eq!(resume["toolCallsProgress"], serde_json::json!([]));
    assert!(resume["serverTime"].as_u64().is_some());
    let stream = chat(&run.proxy, "early");
    let seen = frames.until(|f| f["done"] == true).await;
    let stream = stream.await.expect("stream task");
    assert!(String::from_utf8_lossy(&stream).contains("data: [DONE]"));
    let updates = progress(&seen);
    // 11 deltas in the capture: one frame each, for both indexes.
    assert_eq!(updates.len(), 11, "{seen:?}");
    for index in [0, 1] {
        let counts: Vec<u64> = updates
            .iter()
            .filter(|u| u.0 == index)
            .map(|u| u.1)
            .collect();
        assert!(
            counts.windows(2).all(|w| w[0] <= w[1]),
            "{index}: {counts:?}"
        );
    }
    assert_eq!(updates.iter().rfind(|u| u.0 == 0).map(|u| u.1), Some(47));
    assert_eq!(updates.iter().rfind(|u| u.0 == 1).map(|u| u.1), Some(26));
    let clear = seen
        .iter()
        .position(|f| f["type"] == "tool_call_progress_clear");
    let done = seen.iter().position(|f| f["done"] == true);
    assert!(
        clear.is_some() && clear < done,
        "a clear, then done: {seen:?}"
    );
    assert_eq!(seen[clear.unwrap_or(0)]["reason"], "done");
    // The subscription stays open across the session's next request.
    let again = chat(&run.proxy, "early");
    let seen = frames.until(|f| f["done"] == true).await;
    assert_eq!(progress(&seen).len(), 11, "{seen:?}");
    again.await.expect("second stream");
}

/// Waits (within `PATIENCE`) until `session` has `calls` calls in progress.
async fn until_in_progress(sessions: &SessionRegistry, session: &str, calls: usize) {
    let deadline = Instant::now() + PATIENCE;
    while sessions.snapshot(session).len() < calls {
        assert!(
            Instant::now() < deadline,
            "{session}: never {calls} calls in progress"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// A subscriber that joins mid-call gets both tools back at once, with the
/// server's startedAt, and loses nothing after its snapshot.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_late_subscriber_resumes_mid_call() {
    // Slow enough that both tools stay in progress for about 1.5 s.
    let run = start(Duration::from_millis(300)).await;
    let stream = chat(&run.proxy, "late");
    until_in_progress(&run.sessions, "late", 2).await;
    let mut frames = Frames::open(&run.proxy, "late").await;
    let resume = frames.next().await;
    assert_eq!(resume["type"], "stream_resume");
    let tools = resume["toolCallsProgress"].as_array().expect("list");
    assert_eq!(tools.len(), 2, "{resume}");
    assert_eq!(
        (tools[0]["index"].as_u64(), tools[0]["name"].as_str()),
        (Some(0), Some("get_weather"))
    );
    assert_eq!(
        (tools[1]["index"].as_u64(), tools[1]["name"].as_str()),
        (Some(1), Some("get_local_time"))
    );
    let started = tools[0]["startedAt"].as_u64().expect("startedAt");
    assert!(started <= resume["serverTime"].as_u64().expect("serverTime"));
    let resumed_chars = tools[1]["charsAccumulated"].as_u64().expect("chars");
    // The same view from the snapshot route and the sessions list.
    let (status, snapshot) = json("GET", &format!("{}/_aalis/sessions/late", run.proxy), "").await;
    assert_eq!(status, 200);
    assert_eq!(
        snapshot["toolCallsProgress"][0]["startedAt"].as_u64(),
        Some(started)
    );
    let (_, list) = json("GET", &format!("{}/_aalis/sessions", run.proxy), "").await;
    assert_eq!(list["sessions"][0]["sessionId"], "late");
    // Everything after the snapshot arrives: index 1 goes on from there to
    // its final count, then the clear.
    let seen = frames.until(|f| f["done"] == true).await;
    let after: Vec<u64> = progress(&seen)
        .iter()
        .filter(|u| u.0 == 1)
        .map(|u| u.1)
        .collect();
    assert!(
        after.first().is_some_and(|c| *c >= resumed_chars),
        "{after:?} after {resumed_chars}"
    );
    assert_eq!(after.last(), Some(&26));
    stream.await.expect("stream task");
    // And the session is forgotten as soon as its subscriber leaves.
    assert_eq!(run.sessions.len(), 1, "kept while subscribed");
    drop(frames);
    let deadline = Instant::now() + PATIENCE;
    while !run.sessions.is_empty() {
        assert!(
            Instant::now() < deadline,
            "the session outlived its last subscriber"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// A stream whose session nobody watches collects no increments; one
/// that comes while its text streams hears the rest of it from then on,
/// then the tool's progress and `done`, and the client's stream is the
/// same as without a subscriber.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_subscriber_that_comes_mid_text_hears_the_rest() {
    const TEXT: &str = "Let me check the forecast for you.";
    let run = start(Duration::from_millis(150)).await;
    let unwatched = whole(chat_body(&run.proxy, "alone", "text_then_tool").await).await;
    let mut body = chat_body(&run.proxy, "mid", "text_then_tool").await;
    let mut streamed = Vec::new();
    // Subscribe once the text has begun to flow through the proxy.
    let needle = br#""content":"Let""#;
    while !streamed.windows(needle.len()).any(|w| w == needle) {
        let frame = tokio::time::timeout(PATIENCE, body.frame())
            .await
            .expect("a frame in time")
            .expect("stream open")
            .expect("frame");
        if let Ok(data) = frame.into_data() {
            streamed.extend_from_slice(&data);
        }
    }
    let mut frames = Frames::open(&run.proxy, "mid").await;
    assert_eq!(frames.next().await["type"], "stream_resume");
    let rest = tokio::spawn(whole(body));
    let seen = frames.until(|f| f["done"] == true).await;
    streamed.extend_from_slice(&rest.await.expect("stream task"));
    let heard: String = seen
        .iter()
        .filter_map(|f| f["contentDelta"].as_str())
        .collect();
    assert!(
        !heard.is_empty() && TEXT.ends_with(&heard) && heard != TEXT,
        "the text after the subscription, and only that: {heard:?} {seen:?}"
    );
    let progress = progress(&seen);
    assert!(
        progress.len() >= 3 && progress.iter().all(|p| p.0 == 0),
        "{seen:?}"
    );
    assert_eq!(
        String::from_utf8_lossy(&streamed),
        String::from_utf8_lossy(&unwatched),
        "a subscriber changes nothing in the client's stream"
    );
}

/// Starts `model`'s stream in session `session`: its body, to read.
async fn chat_body(base: &str, session: &str, model: &str) -> Incoming {
    send(
        "POST",
        &format!("{base}/v1/chat/completions"),
        &format!(r#"{{"model":"{model}","stream":true}}"#),
        &[("x-aalis-session", session)],
    )
    .await
    .into_body()
}

/// tool-execute with phase start clears the session's tools and tells
/// subscribers; other phases change nothing; bad JSON is a 400 that says
/// what is wrong.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tool_execute_clears_the_session() {
    let run = start(Duration::from_millis(250)).await;
    let stream = chat(&run.proxy, "exec");
    until_in_progress(&run.sessions, "exec", 1).await;
    let mut frames = Frames::open(&run.proxy, "exec").await;
    assert_eq!(frames.next().await["type"], "stream_resume");
    let url = format!("{}/_aalis/tool-execute", run.proxy);
    let (status, answer) = json(
        "POST",
        &url,
        r#"{"sessionId":"exec","toolName":"get_weather","args":{},"phase":"end"}"#,
    )
    .await;
    assert_eq!((status, answer["cleared"].as_u64()), (200, Some(0)));
    let (status, answer) = json(
        "POST",
        &url,
        r#"{"sessionId":"exec","toolName":"get_weather","args":{"city":"Paris"},"phase":"start"}"#,
    )
    .await;
    assert_eq!(status, 200);
    assert!(
        answer["cleared"].as_u64().is_some_and(|n| n >= 1),
        "{answer}"
    );
    let seen = frames
        .until(|f| f["type"] == "tool_call_progress_clear")
        .await;
    assert_eq!(
        seen.last().map(|f| f["reason"].clone()),
        Some("tool_execute".into())
    );
    for bad in ["{bad", r#"{"toolName":"x","phase":"start"}"#, "[]"] {
        let (status, answer) = json("POST", &url, bad).await;
        assert_eq!(status, 400, "{bad}");
        let message = answer["error"]["message"].as_str().unwrap_or_default();
        assert!(message.contains("sessionId"), "{bad}: {message}");
        assert!(message.contains("line 1 column"), "{bad}: {message}");
    }
    // The session-id rule of the header and the routes' paths.
    for id in ["", "..", "a b", &"x".repeat(129)] {
        let bad = format!(r#"{{"sessionId":"{id}","toolName":"x","args":{{}},"phase":"start"}}"#);
        let (status, answer) = json("POST", &url, &bad).await;
        assert_eq!(status, 400, "{id:?}");
        let message = answer["error"]["message"].as_str().unwrap_or_default();
        assert!(message.starts_with("sessionId must"), "{id:?}: {message}");
    }
    stream.abort();
}

/// A known route asked with a method it does not take gets 405 with an
/// `Allow` header (RFC 9110 §15.5.6), not 404; a route read with GET
/// answers HEAD too, without a body; an unknown route is still 404.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_method_gets_405_with_allow_and_head_is_served() {
    let run = start(Duration::from_millis(250)).await;
    for (method, path, allow) in [
        ("GET", "/_aalis/tool-execute", "POST"),
        ("POST", "/_aalis/sessions/s1", "GET, HEAD"),
        ("DELETE", "/_aalis/", "GET, HEAD"),
        ("PUT", "/_aalis/metrics", "GET, HEAD"),
    ] {
        let response = send(method, &format!("{}{path}", run.proxy), "", &[]).await;
        assert_eq!(response.status(), 405, "{method} {path}");
        assert_eq!(
            response
                .headers()
                .get("allow")
                .and_then(|v| v.to_str().ok()),
            Some(allow),
            "{method} {path}"
        );
    }
    for path in ["/_aalis/", "/_aalis/sessions/s1", "/_aalis/metrics"] {
        let response = send("HEAD", &format!("{}{path}", run.proxy), "", &[]).await;
        assert_eq!(response.status(), 200, "HEAD {path}");
        let body = whole(response.into_body()).await;
        assert!(body.is_empty(), "HEAD {path}");
    }
    let (status, answer) = json("GET", &format!("{}/_aalis/nope", run.proxy), "").await;
    assert_eq!(
        (status, answer["error"]["type"].as_str()),
        (404, Some("not_found"))
    );
}

/// The payload carries the tool's whole `args`: a 2 MiB file edit is
/// taken (it got 400 when the bound was 1 MiB), and one past the bound,
/// 64 MiB, gets 413 saying so.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_large_tool_execute_payload_is_taken_and_one_too_large_is_413() {
    let run = start(Duration::from_millis(250)).await;
    let url = format!("{}/_aalis/tool-execute", run.proxy);
    let payload = |bytes: usize| {
        format!(
            r#"{{"sessionId":"big","toolName":"write_file","args":{{"text":"{}"}},"phase":"start"}}"#,
            "x".repeat(bytes)
        )
    };
    let (status, answer) = json("POST", &url, &payload(2 << 20)).await;
    assert_eq!(
        (status, answer["ok"].as_bool()),
        (200, Some(true)),
        "{answer}"
    );
    let (status, answer) = json("POST", &url, &payload(64 << 20)).await;
    assert_eq!(status, 413, "{answer}");
    let message = answer["error"]["message"].as_str().unwrap_or_default();
    assert!(message.contains("larger than 64 MiB"), "{message}");
}

/// A tool that starts executing while the model still streams another
/// call: the clear holds for the calls that got no delta since. Both calls
/// of `parallel_tool_calls` are in progress when `tool:execute` starts;
/// after the clear, the snapshot holds only calls that a progress frame
/// after the clear named (before the fix, the stream's next publish put
/// both back, with their first `startedAt`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cleared_call_stays_cleared_while_the_stream_goes_on() {
    let run = start(Duration::from_millis(250)).await;
    let stream = chat(&run.proxy, "exec2");
    until_in_progress(&run.sessions, "exec2", 2).await;
    let mut frames = Frames::open(&run.proxy, "exec2").await;
    assert_eq!(frames.next().await["type"], "stream_resume");
    let (status, answer) = json(
        "POST",
        &format!("{}/_aalis/tool-execute", run.proxy),
        r#"{"sessionId":"exec2","toolName":"get_weather","args":{},"phase":"start"}"#,
    )
    .await;
    assert_eq!(
        (status, answer["cleared"].as_u64()),
        (200, Some(2)),
        "{answer}"
    );
    frames
        .until(|f| f["type"] == "tool_call_progress_clear")
        .await;
    let after = frames.until(|f| !f["toolCallProgress"].is_null()).await;
    let named: Vec<i64> = after
        .iter()
        .filter_map(|f| f["toolCallProgress"]["index"].as_i64())
        .collect();
    let snapshot: Vec<i64> = run
        .sessions
        .snapshot("exec2")
        .iter()
        .map(|e| e.index)
        .collect();
    assert!(
        snapshot.iter().all(|i| named.contains(i)),
        "snapshot {snapshot:?} after progress of {named:?} only"
    );
    stream.abort();
}

/// The page (its address without the slash sends there), the metrics, a
/// 404, and none of them forwarded upstream.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_page_and_the_metrics() {
    let run = start(Duration::ZERO).await;
    chat(&run.proxy, "m").await.expect("stream");
    let bare = send("GET", &format!("{}/_aalis", run.proxy), "", &[]).await;
    assert_eq!(bare.status(), 308);
    assert_eq!(
        bare.headers().get("location").and_then(|v| v.to_str().ok()),
        Some("/_aalis/")
    );
    let page = send("GET", &format!("{}/_aalis/", run.proxy), "", &[]).await;
    assert_eq!(page.status(), 200);
    assert_eq!(
        page.headers()
            .get("content-type")
            .and_then(|v| v.to_str().ok()),
        Some("text/html; charset=utf-8")
    );
    let html = whole(page.into_body()).await;
    let html = String::from_utf8_lossy(&html);
    assert!(html.contains("EventSource") && html.contains("/_aalis/events"));
    assert!(
        !html.contains("http://") && !html.contains("https://"),
        "no CDN, nothing remote"
    );

    let metrics = send("GET", &format!("{}/_aalis/metrics", run.proxy), "", &[]).await;
    assert_eq!(metrics.status(), 200);
    let text = whole(metrics.into_body()).await;
    let text = String::from_utf8_lossy(&text);
    for line in [
        // The stream's request; the proxy's own routes are not counted.
        "aalis_requests_total{code=\"2xx\"} 1",
        "aalis_requests_total{code=\"5xx\"} 0",
        "aalis_streams_total 1",
        "aalis_streams_open 0",
        "aalis_tool_calls_total 2",
        "aalis_stream_frames_total 14",
        "aalis_bytes_in_total 4723",
        "aalis_bytes_out_total 5550",
        "aalis_time_to_first_byte_seconds_count 1",
        "aalis_upstream_errors_total{kind=\"reset\"} 0",
        "aalis_subscriber_backlog_bytes 0",
    ] {
        assert!(text.lines().any(|l| l == line), "no {line:?} in\n{text}");
    }
    // Our routes are ours: a 404 from the proxy, not from the mock.
    let (status, answer) = json("GET", &format!("{}/_aalis/nope", run.proxy), "").await;
    assert_eq!(status, 404);
    assert!(
        answer["error"]["message"]
            .as_str()
            .unwrap_or_default()
            .contains("aalis-proxy's own routes")
    );
    let (status, _) = json("GET", &format!("{}/_aalis/sessions/a/b/c", run.proxy), "").await;
    assert_eq!(status, 404);
}

/// Shutting down ends live subscriptions, so a connected status page does
/// not hold the proxy for the whole grace period.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_ends_subscriptions_at_once() {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind proxy");
    let addr = listener.local_addr().expect("addr");
    // Nothing listens on the upstream: only our own routes are used.
    let config = ProxyConfig::new(Upstream::parse("http://127.0.0.1:9").expect("url"));
    assert_eq!(config.shutdown_grace, Duration::from_secs(10));
    let proxy = Proxy::from_config(config, SessionRegistry::new()).expect("proxy");
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(serve_proxy(listener, proxy, async {
        let _ = stopped.await;
    }));
    let base = format!("http://{addr}");
    let mut frames = Frames::open(&base, "watched").await;
    assert_eq!(frames.next().await["type"], "stream_resume");
    let asked = Instant::now();
    let _ = stop.send(());
    // The subscription ends (the body finishes) and the server returns
    // before the 10 s grace period is over (the bound leaves a loaded
    // machine 8 s for what takes milliseconds).
    let in_time = Duration::from_secs(8);
    let end = tokio::time::timeout(in_time, frames.body.frame())
        .await
        .expect("the events stream ends in time");
    assert!(end.is_none(), "{end:?}");
    tokio::time::timeout(in_time.saturating_sub(asked.elapsed()), server)
        .await
        .expect("serve returns before the grace period is over")
        .expect("serve task");
}

/// The status page's one connection: `/_aalis/events` starts with a
/// snapshot of every session and carries the frames of all of them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_stream_carries_every_session() {
    let run = start(Duration::from_millis(5)).await;
    let mut frames = Frames::open_path(&run.proxy, "/_aalis/events").await;
    let resume = frames.next().await;
    assert_eq!(resume["type"], "sessions_resume");
    assert_eq!(resume["sessions"], serde_json::json!([]));
    let a = chat(&run.proxy, "first");
    let b = chat(&run.proxy, "second");
    let mut done = std::collections::BTreeSet::new();
    let mut progress_sessions = std::collections::BTreeSet::new();
    while done.len() < 2 {
        let frame = frames.next().await;
        let session = frame["sessionId"].as_str().unwrap_or_default().to_owned();
        if frame.get("toolCallProgress").is_some() {
            progress_sessions.insert(session.clone());
        }
        if frame["done"] == true {
            done.insert(session);
        }
    }
    assert_eq!(
        progress_sessions,
        ["first", "second"].map(String::from).into()
    );
    a.await.expect("first");
    b.await.expect("second");
}

/// Streams `capture` (which ends with `[DONE]`) to its end past a
/// subscriber of its session that reads nothing meanwhile (the stream must
/// not wait for it); then the frames that subscriber reads, up to a fresh
/// snapshot or the `done`.
async fn past_a_stalled_subscriber(capture: &str) -> Vec<Value> {
    let run = start_with(
        vec![Capture::new("stalled", capture.as_bytes())],
        Duration::ZERO,
    )
    .await;
    let mut stalled = Frames::open(&run.proxy, "stalled").await;
    assert_eq!(stalled.next().await["type"], "stream_resume");
    let body = chat_body(&run.proxy, "stalled", "stalled").await;
    let body = tokio::time::timeout(Duration::from_secs(60), body.collect())
        .await
        .expect("the stream is not held back by the stalled subscriber")
        .expect("body")
        .to_bytes();
    assert!(body.ends_with(b"data: [DONE]\n\n"));
    stalled
        .until(|f| f["type"] == "stream_resume" || f["done"] == true)
        .await
}

/// A subscriber too slow to keep up is not buffered for, and does not hold
/// the stream back: the stream, far more frames than the subscriber's
/// backlog and the sockets between hold, comes whole while the subscriber
/// reads nothing. When it reads again it is sent a fresh snapshot (a second
/// `stream_resume`) instead of the frames it missed. (This replaces a test
/// of 20 short streams past a stalled subscriber, whose frames all fit in
/// the buffers: it passed whether or not a stall held the stream back.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lagging_subscriber_starts_again_from_a_snapshot() {
    // One tool call in 60,000 one-character deltas: more frames than the
    // subscriber's backlog plus every socket buffer between us.
    let mut capture = String::from(
        "data: {\"choices\":[{\"index\":0,\"delta\":{\"tool_calls\":[{\"index\":0,\"id\":\"c\",\"function\":{\"name\":\"write_file\",\"arguments\":\"\"}}]}}]}\n\n",
    );
    for _ in 0..60_000 {
        capture.push_str(
            "data: {\"choices\":[{\"index\":0,\"delta\":{\"tool_calls\":[{\"index\":0,\"function\":{\"arguments\":\"x\"}}]}}]}\n\n",
        );
    }
    capture.push_str("data: [DONE]\n\n");
    // Now read: somewhere a fresh snapshot replaces what was missed.
    let seen = past_a_stalled_subscriber(&capture).await;
    assert_eq!(
        seen.last().map(|f| f["type"].clone()),
        Some("stream_resume".into()),
        "no resync after {} frames",
        seen.len()
    );
}

/// The backlog of a subscriber that stopped reading is bounded in bytes
/// too: a stream of 200 content deltas of 256 KiB (50 MiB, fewer
/// frames than the backlog's 256) passes a stalled subscriber, which, when
/// it reads again, gets a fresh snapshot in place of most of them. Before,
/// the proxy held every one of them for it, all 50 MiB.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_subscriber_holds_a_bounded_number_of_bytes() {
    const DELTAS: usize = 200;
    let text = "x".repeat(256 * 1024);
    let mut capture = String::new();
    for _ in 0..DELTAS {
        capture.push_str(&format!(
            "data: {{\"choices\":[{{\"index\":0,\"delta\":{{\"content\":\"{text}\"}}}}]}}\n\n"
        ));
    }
    capture.push_str("data: [DONE]\n\n");
    let seen = past_a_stalled_subscriber(&capture).await;
    let deltas = seen.iter().filter(|f| f["contentDelta"] == text).count();
    assert_eq!(
        seen.last().map(|f| f["type"].clone()),
        Some("stream_resume".into()),
        "no resync after {deltas} of {DELTAS} deltas"
    );
    assert!(deltas < DELTAS / 2, "{deltas} of {DELTAS} deltas were held");
}

/// A stream that stops in the middle of a tool call (no finish, no
/// `[DONE]`: an upstream cut, or one that just ends) clears the session,
/// and its subscribers are told so, with reason `stream_end`, and then
/// `done`. Before,
/// they got no clear, and the status page kept the tool's card for good.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_that_stops_mid_call_tells_subscribers_it_cleared() {
    let capture = concat!(
        "data: {\"choices\":[{\"index\":0,\"delta\":{\"tool_calls\":[{\"index\":0,\"id\":\"c\",\"function\":{\"name\":\"get_weather\",\"arguments\":\"\"}}]}}]}\n\n",
        "data: {\"choices\":[{\"index\":0,\"delta\":{\"tool_calls\":[{\"index\":0,\"function\":{\"arguments\":\"{\\\"city\"}}]}}]}\n\n",
    );
    let run = start_with(
        vec![Capture::new("cut_call", capture.as_bytes())],
        Duration::from_millis(50),
    )
    .await;
    let mut frames = Frames::open(&run.proxy, "cut").await;
    assert_eq!(frames.next().await["type"], "stream_resume");
    let body = chat_body(&run.proxy, "cut", "cut_call").await;
    tokio::time::timeout(PATIENCE, body.collect())
        .await
        .expect("in time")
        .expect("body");
    let seen = frames
        .until(|f| f["type"] == "tool_call_progress_clear")
        .await;
    assert!(
        seen.iter()
            .any(|f| f["toolCallProgress"]["name"] == "get_weather"),
        "{seen:?}"
    );
    assert_eq!(
        seen.last().map(|f| f["reason"].clone()),
        Some("stream_end".into())
    );
    // With no `[DONE]` to say so, the end itself is the stream's `done`.
    assert_eq!(frames.next().await["done"], true);
    assert!(run.sessions.snapshot("cut").is_empty());
}

/// Non-JSON tool-execute posts (what a web page may send cross-site) and
/// pages that rebound their own name to 127.0.0.1 are refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cross_site_requests_are_refused() {
    let run = start(Duration::ZERO).await;
    let response = send(
        "POST",
        &format!("{}/_aalis/tool-execute", run.proxy),
        r#"{"sessionId":"x","phase":"start"}"#,
        &[("content-type", "text/plain")],
    )
    .await;
    assert_eq!(response.status(), 415);
    let response = send(
        "GET",
        &format!("{}/_aalis/sessions", run.proxy),
        "",
        &[("host", "evil.example:8787")],
    )
    .await;
    assert_eq!(response.status(), 403);
}

/// A session id that can never be one gets `400`, in the request header
/// and in the `/_aalis/` routes' paths alike: `.` and `..` (which a URL's
/// path resolves, so those routes could not name them), a byte that is
/// not visible ASCII, more than 128 bytes. Before, the header took `..`,
/// and the routes answered such ids with an empty snapshot, or a
/// subscriber that waited for good, holding an id of up to 64 KiB.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ids_that_cannot_be_sessions_get_400() {
    let run = start(Duration::ZERO).await;
    let long = "x".repeat(129);
    for id in ["%2E%2E", ".", "%00", "%FF", "a%20b", long.as_str()] {
        for route in ["", "/events"] {
            let url = format!("{}/_aalis/sessions/{id}{route}", run.proxy);
            let response = send("GET", &url, "", &[]).await;
            assert_eq!(response.status(), 400, "{url}");
            let error: Value =
                serde_json::from_slice(&whole(response.into_body()).await).expect("JSON");
            assert_eq!(error["error"]["type"], "invalid_request_error", "{url}");
        }
    }
    // The longest id, and `...`, are sessions; a snapshot is live state,
    // never to be stored on the way.
    for id in ["x".repeat(128), "...".to_owned()] {
        let url = format!("{}/_aalis/sessions/{id}", run.proxy);
        let response = send("GET", &url, "", &[]).await;
        assert_eq!(response.status(), 200, "{url}");
        assert_eq!(
            response
                .headers()
                .get("cache-control")
                .map(|v| v.as_bytes()),
            Some(&b"no-store"[..])
        );
    }
    let response = send(
        "POST",
        &format!("{}/v1/chat/completions", run.proxy),
        r#"{"model":"single_tool_call","stream":true}"#,
        &[
            ("content-type", "application/json"),
            ("x-aalis-session", ".."),
        ],
    )
    .await;
    assert_eq!(response.status(), 400);
}

/// At the proxy's shutdown, a subscriber whose session has a stream open
/// hears that stream to its end, its clear and `done` included, and then
/// its events stream ends, as the stream's own client gets every byte
/// (one with no stream open still ends at once:
/// `shutdown_ends_subscriptions_at_once`). Before, the subscriber was cut
/// at the signal, mid-call, with no clear and no `done`, while the stream
/// went on to its end.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn at_shutdown_a_subscriber_hears_its_stream_to_the_end() {
    let mock_listener = TcpListener::bind("127.0.0.1:0").await.expect("bind mock");
    let mock_addr = mock_listener.local_addr().expect("addr");
    let (_stop_mock, mock_stopped) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(
        MockUpstream::new(Capture::bundled(), Duration::from_millis(40)).run(
            mock_listener,
            async {
                let _ = mock_stopped.await;
            },
        ),
    );
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind proxy");
    let base = format!("http://{}", listener.local_addr().expect("addr"));
    let config = ProxyConfig::new(Upstream::parse(&format!("http://{mock_addr}")).expect("url"));
    let proxy = Proxy::from_config(config, SessionRegistry::new()).expect("proxy");
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(serve_proxy(listener, proxy, async {
        let _ = stopped.await;
    }));
    let mut frames = Frames::open(&base, "sd").await;
    assert_eq!(frames.next().await["type"], "stream_resume");
    let chat = chat(&base, "sd");
    frames.until(|f| f.get("toolCallProgress").is_some()).await;
    let _ = stop.send(());
    let rest = frames.until(|f| f["done"] == true).await;
    assert!(
        rest.iter().any(|f| f["type"] == "tool_call_progress_clear"),
        "no clear before done: {rest:?}"
    );
    let end = tokio::time::timeout(PATIENCE, frames.body.frame())
        .await
        .expect("the events stream ends in time");
    assert!(end.is_none(), "{end:?}");
    let body = tokio::time::timeout(PATIENCE, chat)
        .await
        .expect("the chat ends in time")
        .expect("chat task");
    assert!(body.ends_with(b"data: [DONE]\n\n"), "the chat was cut");
    tokio::time::timeout(PATIENCE, server)
        .await
        .expect("serve returns once both are over")
        .expect("serve task");
}

/// A subscriber tells a whole answer from one that may stop in the middle,
/// as `annotate --format messages` does: the `done` of a stream that was
/// cut, failed or was stopped by its length says `incomplete`, and an
/// error the upstream sent mid-stream is a frame of its own. (All four
/// ended with the same `{"done":true}`, and the error was not told.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_subscriber_is_told_when_an_answer_may_stop_in_the_middle() {
    let text = |finish: &str| {
        format!(
            "data: {{\"choices\":[{{\"index\":0,\"delta\":{{\"content\":\"Hello\"}},\"finish_reason\":{finish}}}]}}\n\n"
        )
    };
    let whole = format!("{}{}data: [DONE]\n\n", text("null"), text("\"stop\""));
    let length = format!("{}{}data: [DONE]\n\n", text("null"), text("\"length\""));
    let error = format!(
        "{}data: {{\"error\":{{\"message\":\"boom\",\"type\":\"server_error\"}}}}\n\n",
        text("null")
    );
    let named = format!(
        "{}event: error\ndata: {{\"type\":\"error\",\"error\":{{\"type\":\"overloaded_error\"}}}}\n\n",
        text("null")
    );
    let not_json = format!("{}event: error\ndata: overloaded\n\n", text("null"));
    let mut cut = Capture::new("cut", text("null").as_bytes());
    cut.timing = Some(aalis_proxy::capture::Timing {
        marks: vec![(text("null").len() as u64, 0)],
        cut: true,
        ..Default::default()
    });
    let run = start_with(
        vec![
            Capture::new("whole", whole.as_bytes()),
            Capture::new("length", length.as_bytes()),
            Capture::new("error", error.as_bytes()),
            Capture::new("named", named.as_bytes()),
            Capture::new("not_json", not_json.as_bytes()),
            cut,
        ],
        Duration::from_millis(20),
    )
    .await;
    // (capture, incomplete, the error frame's value)
    let boom = serde_json::json!({"message": "boom", "type": "server_error"});
    let overloaded = serde_json::json!({"type": "error", "error": {"type": "overloaded_error"}});
    for (model, incomplete, error) in [
        ("whole", false, None),
        ("length", true, None),
        ("error", true, Some(boom)),
        // An `event: error`: its data, as JSON, or as a string (the frame
        // was `"error":}`, no JSON).
        ("named", true, Some(overloaded)),
        ("not_json", true, Some(Value::from("overloaded"))),
        ("cut", true, None),
    ] {
        let session = format!("answer-{model}");
        let mut frames = Frames::open(&run.proxy, &session).await;
        assert_eq!(frames.next().await["type"], "stream_resume");
        let body = chat_body(&run.proxy, &session, model).await;
        // The cut stream's body fails: what matters here is its frames.
        let _ = tokio::time::timeout(PATIENCE, body.collect()).await;
        let seen = frames.until(|f| f.get("done").is_some()).await;
        assert!(
            seen.iter().any(|f| f["contentDelta"] == "Hello"),
            "{model}: {seen:?}"
        );
        let done = seen.last().expect("a done frame");
        assert_eq!(
            done.get("incomplete").is_some_and(|v| v == true),
            incomplete,
            "{model}: {done}"
        );
        let told = seen.iter().find_map(|f| f.get("error")).cloned();
        assert_eq!(told, error, "{model}: {seen:?}");
    }
}

/// With `--admin-token`, a browser that is no loopback client (here: a
/// `Host` that is no loopback name) opens the status page once with the
/// token in its address, gets the token's cookie and the page at its own
/// address, and from then on the page and its event stream (what
/// `EventSource` asks, with no header of its own) let it in. A wrong
/// token, a wrong cookie, or the token in another route's address do
/// not. (A browser could not open the page at all: it sends no Bearer
/// header.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_browser_opens_the_page_with_the_admin_token_once() {
    let run = start_configured(Capture::bundled(), Duration::ZERO, |config| {
        config.admin_token = Some("s3 cret;".to_owned());
    })
    .await;
    let remote = ("host", "aalis.lan");
    let status = |response: &http::Response<Incoming>| response.status().as_u16();
    let page = format!("{}/_aalis/", run.proxy);
    assert_eq!(status(&send("GET", &page, "", &[remote]).await), 403);
    let wrong = format!("{page}?token=s3");
    assert_eq!(status(&send("GET", &wrong, "", &[remote]).await), 403);
    let elsewhere = format!("{}/_aalis/metrics?token=s3%20cret%3B", run.proxy);
    assert_eq!(status(&send("GET", &elsewhere, "", &[remote]).await), 403);

    let opened = send("GET", &format!("{page}?token=s3%20cret%3B"), "", &[remote]).await;
    assert_eq!(status(&opened), 303);
    assert_eq!(opened.headers()["location"], "/_aalis/");
    let cookie = opened.headers()["set-cookie"]
        .to_str()
        .expect("a cookie")
        .to_owned();
    for part in ["Path=/_aalis", "HttpOnly", "SameSite=Strict"] {
        assert!(cookie.contains(part), "{cookie}");
    }
    let pair = cookie.split(';').next().unwrap_or_default().to_owned();
    assert!(pair.starts_with("aalis_admin="), "{cookie}");
    assert!(!pair.contains("s3"), "the token as it is: {cookie}");

    let with_cookie = [remote, ("cookie", pair.as_str())];
    let response = send("GET", &page, "", &with_cookie).await;
    assert_eq!(status(&response), 200);
    assert!(String::from_utf8_lossy(&whole(response.into_body()).await).contains("<html"));
    let events = send(
        "GET",
        &format!("{}/_aalis/events", run.proxy),
        "",
        &with_cookie,
    )
    .await;
    assert_eq!(status(&events), 200);
    assert_eq!(events.headers()["content-type"], "text/event-stream");
    drop(events);
    // Among other cookies, as a browser sends them.
    let among = format!("theme=dark; {pair}; lang=en");
    let response = send(
        "GET",
        &format!("{}/_aalis/metrics", run.proxy),
        "",
        &[remote, ("cookie", among.as_str())],
    )
    .await;
    assert_eq!(status(&response), 200);
    let forged = [remote, ("cookie", "aalis_admin=7333")];
    assert_eq!(status(&send("GET", &page, "", &forged).await), 403);
}
