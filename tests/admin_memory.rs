//! What a `POST /_aalis/tool-execute` body costs in memory, counted by this
//! test binary's global allocator (the bytes live, and their peak): the
//! route parses a payload whole, so it holds it, but once, not twice. One
//! test alone in its binary, so that nothing else allocates beside it.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use aalis_proxy::proxy::service::Proxy;
use aalis_proxy::proxy::sessions::SessionRegistry;
use aalis_proxy::proxy::upstream::Upstream;
use aalis_proxy::proxy::{ProxyConfig, serve_proxy};
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use tokio::net::TcpListener;

struct Tracking;

static LIVE: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

fn grew(bytes: usize) {
    let live = LIVE.fetch_add(bytes, Ordering::Relaxed) + bytes;
    PEAK.fetch_max(live, Ordering::Relaxed);
}

// SAFETY: every call is passed on to the system allocator unchanged; the
// counts are atomics, which neither allocate nor lock.
unsafe impl GlobalAlloc for Tracking {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        grew(layout.size());
        // SAFETY: the caller's contract, passed on.
        unsafe { System.alloc(layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        grew(layout.size());
        // SAFETY: the caller's contract, passed on.
        unsafe { System.alloc_zeroed(layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // Counted as a new block beside the old one, as a copying realloc
        // holds both for a moment.
        grew(new_size);
        LIVE.fetch_sub(layout.size(), Ordering::Relaxed);
        // SAFETY: the caller's contract, passed on.
        unsafe { System.realloc(ptr, layout, new_size) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        LIVE.fetch_sub(layout.size(), Ordering::Relaxed);
        // SAFETY: the caller's contract, passed on.
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static GLOBAL: Tracking = Tracking;

/// A 32 MiB payload (a large file edit's `args`) raises the peak by well
/// under one and a half times its size. (Collecting its frames and then
/// joining them held it twice.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tool_execute_body_is_held_once() {
    // The upstream is never asked: the route is the proxy's own.
    let config = ProxyConfig::new(Upstream::parse("http://127.0.0.1:9").expect("url"));
    let proxy = Proxy::from_config(config, SessionRegistry::new()).expect("proxy");
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    let (_stop, stopped) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(serve_proxy(listener, proxy, async {
        let _ = stopped.await;
    }));
    let client = Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>();
    let post = |payload: Bytes| {
        let request = hyper::Request::post(format!("http://{addr}/_aalis/tool-execute"))
            .header("content-type", "application/json")
            .body(Full::new(payload))
            .expect("request");
        let sent = client.request(request);
        async move {
            let response = tokio::time::timeout(Duration::from_secs(60), sent)
                .await
                .expect("answered within 60 s")
                .expect("response");
            let status = response.status();
            let body = response.into_body().collect().await.expect("body");
            (status, body.to_bytes())
        }
    };
    // A small one first: connections, buffers and the runtime warm.
    let (status, _) = post(Bytes::from_static(br#"{"sessionId":"s","phase":"start"}"#)).await;
    assert_eq!(status, 200);
    let size = 32 << 20;
    let payload = Bytes::from(format!(
        r#"{{"sessionId":"s","toolName":"write_file","args":{{"text":"{}"}},"phase":"start"}}"#,
        "x".repeat(size)
    ));
    let before = LIVE.load(Ordering::Relaxed);
    PEAK.store(before, Ordering::Relaxed);
    // (A clone: the client's copy, let go once sent, must not offset what
    // the proxy holds.)
    let (status, answer) = post(payload.clone()).await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&answer));
    let raised = PEAK.load(Ordering::Relaxed).saturating_sub(before);
    assert!(
        raised < size + size / 2,
        "the peak rose by {raised} bytes for a {size}-byte payload"
    );
}
