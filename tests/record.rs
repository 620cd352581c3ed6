//! `serve --record` then replay (issue 4): the recording is the upstream's
//! bytes exactly, with timing; `mock` and `annotate --realtime` replay it
//! with that timing (loose tolerances: this machine is shared), and the
//! replay's annotated output equals what the client got live.

mod common;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use aalis_proxy::capture::Timing;
use aalis_proxy::encode::InjectMode;
use aalis_proxy::framing::sse::DEFAULT_MAX_EVENT_BYTES;
use aalis_proxy::mock::{Capture, MockUpstream};
use aalis_proxy::proxy::service::Proxy;
use aalis_proxy::proxy::sessions::SessionRegistry;
use aalis_proxy::proxy::upstream::Upstream;
use aalis_proxy::proxy::{ProxyConfig, serve_proxy};
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use tokio::net::TcpListener;

/// The pause the mock puts between events while recording.
const DELAY: Duration = Duration::from_millis(40);

async fn start_mock(
    captures: Vec<Capture>,
    delay: Duration,
) -> (String, tokio::sync::oneshot::Sender<()>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind mock");
    let addr = listener.local_addr().expect("mock addr");
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(MockUpstream::new(captures, delay).run(listener, async {
        let _ = stopped.await;
    }));
    (format!("http://{addr}"), stop)
}

async fn start_proxy(
    upstream: &str,
    record_dir: Option<PathBuf>,
) -> (String, tokio::sync::oneshot::Sender<()>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind proxy");
    let addr = listener.local_addr().expect("proxy addr");
    let config = ProxyConfig {
        upstream: Upstream::parse(upstream).expect("upstream"),
        upstream_ca: None,
        inject: InjectMode::Field,
        connect_timeout: Duration::from_secs(2),
        response_timeout: Duration::from_secs(10),
        idle_timeout: Duration::from_secs(10),
        client_timeout: Duration::from_secs(10),
        shutdown_grace: Duration::from_secs(1),
        max_event_bytes: DEFAULT_MAX_EVENT_BYTES,
        record_dir,
        session_ttl: Duration::from_secs(600),
        admin_token: None,
    };
    let proxy = Proxy::from_config(config, SessionRegistry::new()).expect("proxy");
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(serve_proxy(listener, proxy, async {
        let _ = stopped.await;
    }));
    (format!("http://{addr}"), stop)
}

/// Posts a streamed chat request; returns the body and when each piece of
/// it arrived (ms since the request was sent).
async fn stream(base: &str, model: &str, session: &str) -> (Vec<u8>, Vec<u64>) {
    let client = Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>();
    let body = format!(r#"{{"model":"{model}","stream":true}}"#);
    let request = http::Request::post(format!("{base}/v1/chat/completions"))
        .header("x-aalis-session", session)
        .body(Full::new(Bytes::from(body)))
        .expect("request");
    let started = Instant::now();
    let response = tokio::time::timeout(Duration::from_secs(20), client.request(request))
        .await
        .expect("in time")
        .expect("response");
    let mut body = response.into_body();
    let (mut bytes, mut arrivals) = (Vec::new(), Vec::new());
    while let Some(frame) = tokio::time::timeout(Duration::from_secs(20), body.frame())
        .await
        .expect("in time")
    {
        if let Ok(data) = frame.expect("frame").into_data() {
            bytes.extend_from_slice(&data);
            arrivals.push(started.elapsed().as_millis() as u64);
        }
    }
    (bytes, arrivals)
}

/// The three files of the one recording in `dir`, once all are written
/// and the body named (the closing writes happen on the blocking pool,
/// just after the stream).
fn recorded_files(dir: &Path) -> (PathBuf, PathBuf, PathBuf) {
    // The timing and request files are written after the stream ends, on a
    // blocking thread: each is created, then written. Wait until all three
    // are there and none is empty, or a loaded machine reads one between
    // the two (seen once in a full `cargo test`, the request read as "").
    let written = || {
        let entries: Vec<_> = std::fs::read_dir(dir)
            .expect("record dir")
            .filter_map(Result::ok)
            .collect();
        // The body is `….partial` until its sidecars are written.
        entries.len() >= 3
            && entries
                .iter()
                .all(|e| e.metadata().is_ok_and(|m| m.len() > 0))
            && !entries
                .iter()
                .any(|e| e.file_name().to_string_lossy().ends_with(".partial"))
    };
    let deadline = Instant::now() + Duration::from_secs(5);
    while !written() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(10));
    }
    let mut names: Vec<PathBuf> = std::fs::read_dir(dir)
        .expect("record dir")
        .map(|e| e.expect("entry").path())
        .collect();
    names.sort();
    let find = |suffix: &str| {
        names
            .iter()
            .find(|p| p.to_string_lossy().ends_with(suffix))
            .cloned()
            .unwrap_or_else(|| panic!("no *{suffix} in {names:?}"))
    };
    (find(".sse"), find(".sse.timing"), find(".request.json"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_recorded_stream_replays_byte_for_byte_with_its_timing() {
    let dir = std::env::temp_dir().join(format!("aalis-record-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("record dir");

    // Record: mock (40 ms between events) → proxy --record → client.
    let (mock, stop_mock) = start_mock(Capture::bundled(), DELAY).await;
    let (proxy, stop_proxy) = start_proxy(&mock, Some(dir.clone())).await;
    // A hostile session id must not escape the directory.
    let (live, _) = stream(&proxy, "parallel_tool_calls", "../../x\\y").await;
    let _ = stop_proxy.send(());
    let _ = stop_mock.send(());
    let (capture_path, timing_path, request_path) = recorded_files(&dir);
    assert!(capture_path.starts_with(&dir));
    assert!(
        capture_path
            .file_name()
            .is_some_and(|n| n.to_string_lossy().contains("-______x_y-"))
    );

    // The recording is the upstream's bytes exactly, and the request body.
    let original = std::fs::read(common::fixtures_dir().join("openai/parallel_tool_calls.sse"))
        .expect("fixture");
    assert_eq!(std::fs::read(&capture_path).expect("capture"), original);
    assert_eq!(
        std::fs::read_to_string(&request_path).expect("request"),
        r#"{"model":"parallel_tool_calls","stream":true}"#
    );
    // Its timing: one mark per event here, about DELAY apart.
    let timing = Timing::parse(&std::fs::read_to_string(&timing_path).expect("timing"))
        .expect("valid timing");
    let events = original.windows(2).filter(|w| w == b"\n\n").count();
    assert_eq!(timing.marks.len(), events, "{timing:?}");
    assert!(!timing.cut, "a whole response is not marked cut");
    assert_eq!(
        timing.marks.last().map(|m| m.0),
        Some(original.len() as u64)
    );
    let recorded_ms = timing.marks.last().map_or(0, |m| m.1);
    let nominal_ms = DELAY.as_millis() as u64 * (events as u64 - 1);
    assert!(
        recorded_ms >= nominal_ms * 9 / 10 && recorded_ms <= nominal_ms * 3,
        "recorded {recorded_ms} ms for a nominal {nominal_ms} ms"
    );

    // Replay through mock with the recorded timing (its own delay set far
    // off, so only the timing file can explain the pacing).
    let replayed = Capture::from_file(&capture_path).expect("capture with timing");
    assert!(replayed.timing.is_some());
    let (mock, stop_mock) = start_mock(vec![replayed], Duration::from_secs(5)).await;
    let (proxy, stop_proxy) = start_proxy(&mock, None).await;
    let name = capture_path
        .file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .expect("stem");
    let (again, arrivals) = stream(&proxy, &name, "replay").await;
    let _ = stop_proxy.send(());
    let _ = stop_mock.send(());
    assert_eq!(again, live, "the replay annotates to the same bytes");
    let replay_ms = arrivals
        .last()
        .copied()
        .unwrap_or(0)
        .saturating_sub(arrivals[0]);
    assert!(
        replay_ms * 10 >= recorded_ms * 7 && replay_ms <= recorded_ms * 3 + 500,
        "replayed in {replay_ms} ms what was recorded in {recorded_ms} ms"
    );

    // annotate --realtime: the same output as the client got live, in about
    // the recorded time.
    let started = Instant::now();
    let output = std::process::Command::new(env!("CARGO_BIN_EXE_aalis-proxy"))
        .args(["annotate", "--realtime"])
        .arg(&capture_path)
        .output()
        .expect("annotate runs");
    let took_ms = started.elapsed().as_millis() as u64;
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    assert_eq!(output.stdout, live);
    assert!(
        took_ms * 10 >= recorded_ms * 7,
        "annotate --realtime took {took_ms} ms for {recorded_ms} ms recorded"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// Posts a streamed chat request to `base` and reads the body until it
/// ends or fails: the bytes, and whether it failed. `leave_after` drops the
/// response after that many pieces, as a client that goes away.
async fn fetch(base: &str, model: &str, leave_after: Option<usize>) -> (Vec<u8>, bool) {
    let client = Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>();
    let body = format!(r#"{{"model":"{model}","stream":true}}"#);
    let request = http::Request::post(format!("{base}/v1/chat/completions"))
        .body(Full::new(Bytes::from(body)))
        .expect("request");
    let response = tokio::time::timeout(Duration::from_secs(20), client.request(request))
        .await
        .expect("in time")
        .expect("response");
    let mut body = response.into_body();
    let mut bytes = Vec::new();
    let mut pieces = 0;
    while let Some(frame) = tokio::time::timeout(Duration::from_secs(20), body.frame())
        .await
        .expect("in time")
    {
        let Ok(frame) = frame else {
            return (bytes, true);
        };
        if let Ok(data) = frame.into_data() {
            bytes.extend_from_slice(&data);
            pieces += 1;
        }
        if leave_after == Some(pieces) {
            break;
        }
    }
    (bytes, false)
}

/// The timing recorded for the one stream in `dir`.
fn recorded_timing(dir: &Path) -> Timing {
    let (_, timing, _) = recorded_files(dir);
    Timing::parse(&std::fs::read_to_string(&timing).expect("timing")).expect("valid timing")
}

/// A response that did not come to its end, because its upstream cut it or
/// its client left, is recorded with a timing that says so, and `mock`
/// replays such a recording cut, as it came. (A recording of a cut stream
/// was a capture like any other, and its replay ended cleanly.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cut_response_is_recorded_cut_and_replayed_cut() {
    let whole = std::fs::read(common::fixtures_dir().join("openai/parallel_tool_calls.sse"))
        .expect("fixture");
    // Cut in the middle of an event, as a reset would leave it.
    let head = whole[..whole.len() / 2].to_vec();
    let mut cut = Capture::new("cut", &head);
    cut.timing = Some(Timing {
        marks: vec![(head.len() as u64, 0)],
        cut: true,
        ..Timing::default()
    });
    let (mock, stop_mock) = start_mock(vec![cut], DELAY).await;
    // The mock replays it cut: the client gets the bytes, then a failure.
    let (got, failed) = fetch(&mock, "cut", None).await;
    assert_eq!(got, head);
    assert!(failed, "the replay of a cut recording ended cleanly");

    // Through `serve --record`: the client's stream is cut too, and the
    // recording holds what came and says it was cut.
    let dir = std::env::temp_dir().join(format!("aalis-record-cut-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("record dir");
    let (proxy, stop_proxy) = start_proxy(&mock, Some(dir.clone())).await;
    let (_, failed) = fetch(&proxy, "cut", None).await;
    assert!(failed, "the proxy ended a cut stream cleanly");
    let timing = recorded_timing(&dir);
    assert!(timing.cut, "{timing:?}");
    // And when: not before its last piece (a replay waits until then).
    let last_ms = timing.marks.last().map(|mark| mark.1);
    assert!(
        timing.cut_ms.is_some_and(|ms| Some(ms) >= last_ms),
        "{timing:?}"
    );
    let (capture_path, _, _) = recorded_files(&dir);
    assert_eq!(std::fs::read(&capture_path).expect("capture"), head);
    let replayed = Capture::from_file(&capture_path).expect("capture with timing");
    assert!(replayed.cut().is_some());
    let _ = stop_proxy.send(());
    let _ = stop_mock.send(());
    let _ = std::fs::remove_dir_all(&dir);

    // A client that leaves after the first piece: cut as well.
    let dir = std::env::temp_dir().join(format!("aalis-record-left-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("record dir");
    let (mock, stop_mock) = start_mock(Capture::bundled(), DELAY).await;
    let (proxy, stop_proxy) = start_proxy(&mock, Some(dir.clone())).await;
    let (got, failed) = fetch(&proxy, "parallel_tool_calls", Some(1)).await;
    assert!(!got.is_empty() && !failed);
    let timing = recorded_timing(&dir);
    assert!(timing.cut, "{timing:?}");
    let _ = stop_proxy.send(());
    let _ = stop_mock.send(());
    let _ = std::fs::remove_dir_all(&dir);
}

/// A stream answered with an error status (`503`, its body an SSE error
/// event) is recorded with it, and `mock` answers its replay with it too:
/// it answered `200`, the head not recorded.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_recorded_status_is_replayed() {
    let body = b"data: {\"error\":{\"message\":\"overloaded\",\"type\":\"server_error\"}}\n\n";
    let mut overloaded = Capture::new("overloaded", body);
    overloaded.timing = Some(Timing {
        marks: vec![(body.len() as u64, 0)],
        status: Some(503),
        ..Timing::default()
    });
    let (mock, stop_mock) = start_mock(vec![overloaded], DELAY).await;
    let dir = std::env::temp_dir().join(format!("aalis-record-status-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("record dir");
    let (proxy, stop_proxy) = start_proxy(&mock, Some(dir.clone())).await;
    let client = Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>();
    let request = http::Request::post(format!("{proxy}/v1/chat/completions"))
        .body(Full::new(Bytes::from_static(
            br#"{"model":"overloaded","stream":true}"#,
        )))
        .expect("request");
    let response = tokio::time::timeout(Duration::from_secs(20), client.request(request))
        .await
        .expect("in time")
        .expect("response");
    assert_eq!(
        response.status(),
        503,
        "the mock's replay, through the proxy"
    );
    let _ = response.into_body().collect().await;
    let timing = recorded_timing(&dir);
    assert_eq!(timing.status, Some(503), "{timing:?}");
    let (capture_path, _, _) = recorded_files(&dir);
    let replayed = Capture::from_file(&capture_path).expect("capture with timing");
    assert_eq!(replayed.status(), 503);
    assert_eq!(replayed.bytes.as_ref(), &body[..]);
    let _ = stop_proxy.send(());
    let _ = stop_mock.send(());
    let _ = std::fs::remove_dir_all(&dir);
}
