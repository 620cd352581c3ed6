//! The proxy's own routes under `/_aalis/` (SPEC.md, "Commands"; issue 5).
//! They are never forwarded upstream, and answer loopback clients only,
//! unless the request carries `Authorization: Bearer <--admin-token>`,
//! or is a browser's with the token's cookie, which `GET
//! /_aalis/?token=<--admin-token>` sets (anything else is a `403`).
//!
//! | route | what |
//! | --- | --- |
//! | `GET /_aalis/` | the status page: a card per in-progress tool, live |
//! | `GET /_aalis/sessions` | `{"type":"sessions_resume","sessions":[{"sessionId","toolCallsProgress"}],"serverTime"}`, sessions with something in progress |
//! | `GET /_aalis/sessions/{id}` | the `stream_resume` snapshot |
//! | `GET /_aalis/sessions/{id}/events` | SSE: `stream_resume`, then one frame per increment |
//! | `GET /_aalis/events` | SSE: `sessions_resume`, then every frame of every session (the status page's one connection) |
//! | `POST /_aalis/tool-execute` | Aalis's `tool:execute` payload; `phase: "start"` clears |
//! | `GET /_aalis/metrics` | Prometheus text |
//!
//! The frames are documented where they are made, in
//! [`super::sessions`].

use std::net::{IpAddr, SocketAddr};
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::header::{self, HeaderValue};
use http::{Method, Request, Response, StatusCode};
use http_body::{Body, Frame};
use http_body_util::{BodyExt, Full, LengthLimitError, Limited};
use hyper::body::Incoming;
use serde::Deserialize;
use tokio::sync::{broadcast, mpsc};

use super::body::log_safe;
use super::metrics::Metrics;
use super::service::{Proxy, json_error, json_response, session_id_problem};
use super::sessions::{
    ALL_SESSIONS_BACKLOG, Frame as SessionFrame, SUBSCRIBER_BACKLOG, SessionRegistry, Subscription,
};
use super::upstream::{BoxError, ProxyBody};

/// The status page: HTML, CSS and JavaScript in one file, in the binary.
const STATUS_PAGE: &str = include_str!("status.html");

/// Largest `tool-execute` body read.
/// The payload carries the tool's whole `args` (a file edit can be large):
/// the bound is four times `--max-event-bytes`' default.
const MAX_TOOL_EXECUTE_BYTES: usize = 64 * 1024 * 1024;

/// A comment sent on idle event streams so proxies and browsers keep them.
const KEEP_ALIVE: Duration = Duration::from_secs(15);

/// Answers a request under `/_aalis/`.
pub async fn handle(
    proxy: &Proxy,
    req: Request<Incoming>,
    peer: SocketAddr,
) -> Response<ProxyBody> {
    if !allowed(proxy, &req, peer) {
        return json_error(
            StatusCode::FORBIDDEN,
            "forbidden",
            "aalis-proxy's own routes answer loopback clients that ask for a loopback host \
             (localhost, 127.x.y.z or [::1] in Host: a guard against DNS rebinding), or a \
             Bearer --admin-token (in a browser: open /_aalis/?token=<--admin-token> once)",
        );
    }
    // The page opened with the token: its cookie is set, and the address
    // loses the token (it is not kept in the history, nor shown).
    if let Some(token) = proxy.config().admin_token.as_deref()
        && page_token(&req).is_some_and(|given| constant_time_eq(&given, token.as_bytes()))
    {
        return with_token_cookie(token);
    }
    let path = req.uri().path().to_owned();
    if path == "/_aalis" {
        // The status page's address, without its slash.
        return redirect("/_aalis/");
    }
    let rest = path.trim_start_matches("/_aalis/");
    let segments: Vec<&str> = rest.split('/').collect();
    let route = match segments.as_slice() {
        [""] => Route::Page,
        ["sessions"] => Route::Sessions,
        ["events"] => Route::Events,
        ["sessions", id] if !id.is_empty() => Route::Session(decode_segment(id)),
        ["sessions", id, "events"] if !id.is_empty() => Route::SessionEvents(decode_segment(id)),
        ["tool-execute"] => Route::ToolExecute,
        ["metrics"] => Route::Metrics,
        _ => {
            return json_error(
                StatusCode::NOT_FOUND,
                "not_found",
                &format!(
                    "no route {} {path} (aalis-proxy's own routes)",
                    req.method()
                ),
            );
        }
    };
    // A known route asked with another method: 405, with the methods it
    // takes (RFC 9110 §15.5.6). A route read with GET takes HEAD too.
    let (takes, allow) = match route {
        Route::ToolExecute => (Method::POST, "POST"),
        _ => (Method::GET, "GET, HEAD"),
    };
    if *req.method() != takes && !(takes == Method::GET && req.method() == Method::HEAD) {
        let mut response = json_error(
            StatusCode::METHOD_NOT_ALLOWED,
            "method_not_allowed",
            &format!("{path} takes {allow}, not {}", req.method()),
        );
        response
            .headers_mut()
            .insert(header::ALLOW, HeaderValue::from_static(allow));
        return response;
    }
    if let Route::Session(id) | Route::SessionEvents(id) = &route
        && let Some(problem) = session_id_problem(id.as_bytes())
    {
        // Never a session: said, rather than an empty snapshot, or a
        // subscriber that waits for good (and holds a long id meanwhile).
        return json_error(
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            &format!("the session id in the path {problem}"),
        );
    }
    match route {
        Route::Page => html(STATUS_PAGE),
        Route::Sessions => json_text(&proxy.sessions().sessions_resume()),
        Route::Events => events(
            proxy.sessions().clone(),
            proxy.metrics().clone(),
            Watch::All,
        ),
        Route::Session(id) => json_text(&proxy.sessions().resume_frame(&id)),
        Route::SessionEvents(id) => events(
            proxy.sessions().clone(),
            proxy.metrics().clone(),
            Watch::Session(id),
        ),
        Route::ToolExecute => tool_execute(proxy, req).await,
        Route::Metrics => {
            let mut response = text(proxy.metrics().render());
            response.headers_mut().insert(
                header::CONTENT_TYPE,
                HeaderValue::from_static("text/plain; version=0.0.4; charset=utf-8"),
            );
            response
        }
    }
}

/// The routes under `/_aalis/`, by path.
enum Route {
    Page,
    Sessions,
    Events,
    /// The session id, percent-decoded.
    Session(String),
    SessionEvents(String),
    ToolExecute,
    Metrics,
}

/// Loopback peers always; others only with the admin token: as a Bearer
/// token, or in a browser as its cookie, or in the page's address (which
/// then sets the cookie).
fn allowed(proxy: &Proxy, req: &Request<Incoming>, peer: SocketAddr) -> bool {
    let host = req
        .headers()
        .get(header::HOST)
        .and_then(|v| v.to_str().ok())
        .or_else(|| req.uri().host());
    let token = proxy.config().admin_token.as_deref();
    admin_allowed(
        peer.ip(),
        host,
        req.headers().get(header::AUTHORIZATION),
        token,
    ) || token.is_some_and(|token| {
        let cookie = cookie_value(token);
        token_cookies(req).any(|given| constant_time_eq(given.as_bytes(), cookie.as_bytes()))
            || page_token(req).is_some_and(|given| constant_time_eq(&given, token.as_bytes()))
    })
}

/// The cookie that holds the admin token in a browser: sent back on the
/// routes only (`Path=/_aalis`), to this site only (`SameSite=Strict`: a
/// page of another site cannot act with it), and never to scripts
/// (`HttpOnly`).
const TOKEN_COOKIE: &str = "aalis_admin";

/// The cookie's value for `token`: its bytes in hexadecimal, since a
/// token may hold what a cookie may not (`;`, `,`, spaces).
fn cookie_value(token: &str) -> String {
    token.bytes().map(|b| format!("{b:02x}")).collect()
}

/// The values of the [`TOKEN_COOKIE`]s a request carries.
fn token_cookies(req: &Request<Incoming>) -> impl Iterator<Item = &str> {
    req.headers()
        .get_all(header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .filter_map(|pair| pair.trim().split_once('='))
        .filter(|(name, _)| *name == TOKEN_COOKIE)
        .map(|(_, value)| value.trim())
}

/// The token given in the status page's address (`GET /_aalis/?token=…`),
/// percent-decoded.
fn page_token(req: &Request<Incoming>) -> Option<Vec<u8>> {
    let page = matches!(req.uri().path(), "/_aalis" | "/_aalis/");
    if !page || !matches!(*req.method(), Method::GET | Method::HEAD) {
        return None;
    }
    req.uri()
        .query()?
        .split('&')
        .find_map(|pair| pair.strip_prefix("token="))
        .map(|token| decode_segment(token).into_bytes())
}

/// The answer to the page opened with the right token: the cookie, and
/// the page again at its own address (`303 See Other`).
fn with_token_cookie(token: &str) -> Response<ProxyBody> {
    let mut response = text("see /_aalis/\n".to_owned());
    *response.status_mut() = StatusCode::SEE_OTHER;
    let headers = response.headers_mut();
    headers.insert(header::LOCATION, HeaderValue::from_static("/_aalis/"));
    let cookie = format!(
        "{TOKEN_COOKIE}={}; Path=/_aalis; HttpOnly; SameSite=Strict",
        cookie_value(token)
    );
    if let Ok(cookie) = HeaderValue::from_str(&cookie) {
        headers.insert(header::SET_COOKIE, cookie);
    }
    headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    response
}

/// The rule itself: `Authorization: Bearer <token>` when a token is
/// configured; otherwise a loopback peer (an IPv4 peer on a dual-stack
/// socket counts) that also asked for a loopback host, so a web page that
/// rebinds its own name to 127.0.0.1 cannot read the routes.
fn admin_allowed(
    peer: IpAddr,
    host: Option<&str>,
    authorization: Option<&HeaderValue>,
    token: Option<&str>,
) -> bool {
    if peer.to_canonical().is_loopback() && host.is_none_or(is_loopback_host) {
        return true;
    }
    let Some(token) = token else {
        return false;
    };
    // `Bearer <token>`, the scheme in any case (RFC 9110 §11.1).
    authorization
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().split_once(' '))
        .filter(|(scheme, _)| scheme.eq_ignore_ascii_case("bearer"))
        .is_some_and(|(_, given)| constant_time_eq(given.trim().as_bytes(), token.as_bytes()))
}

/// `localhost`, `127.x.y.z` or `[::1]`, with or without a port.
fn is_loopback_host(host: &str) -> bool {
    let name = if let Some(rest) = host.strip_prefix('[') {
        rest.split(']').next().unwrap_or_default()
    } else {
        host.rsplit_once(':').map_or(host, |(name, _port)| name)
    };
    name.eq_ignore_ascii_case("localhost")
        || name
            .parse::<IpAddr>()
            .is_ok_and(|ip| ip.to_canonical().is_loopback())
}

/// Compares without an early exit on the first differing byte.
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// A path segment, percent-decoded (session ids may hold any visible
/// character).
fn decode_segment(segment: &str) -> String {
    let bytes = segment.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let hex = |b: u8| (b as char).to_digit(16);
        if bytes[i] == b'%'
            && let (Some(hi), Some(lo)) = (
                bytes.get(i + 1).and_then(|b| hex(*b)),
                bytes.get(i + 2).and_then(|b| hex(*b)),
            )
        {
            out.push((hi * 16 + lo) as u8);
            i += 3;
            continue;
        }
        out.push(bytes[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// The `tool:execute` payload of Aalis.
#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct ToolExecute {
    session_id: String,
    #[serde(default)]
    tool_name: Option<String>,
    phase: String,
}

/// What the `tool-execute` bodies being read have reserved, in all
/// ([`Reservation`]).
static RESERVED: AtomicUsize = AtomicUsize::new(0);

/// The most [`RESERVED`] may reach: a body whose declared length would take
/// it further grows as it comes instead. Without a bound, clients that
/// declare 64 MiB and send nothing reserved 64 MiB each, address space a
/// `ulimit -v` or strict overcommit turns into an abort of the process.
const MAX_RESERVED_BYTES: usize = 2 * MAX_TOOL_EXECUTE_BYTES;

/// Bytes of [`RESERVED`] taken by one body, given back when it is dropped.
struct Reservation(usize);

impl Reservation {
    /// `declared` bytes if they fit under [`MAX_RESERVED_BYTES`], else
    /// none; none too for a body declared past [`MAX_TOOL_EXECUTE_BYTES`],
    /// which is read up to that bound all the same, then refused (answered
    /// at once, its client, still sending, got a reset rather than the
    /// `413`).
    fn take(declared: usize) -> Reservation {
        let fits = |reserved: usize| {
            reserved
                .checked_add(declared)
                .filter(|&total| total <= MAX_RESERVED_BYTES)
                .filter(|_| declared <= MAX_TOOL_EXECUTE_BYTES)
        };
        match RESERVED.fetch_update(Ordering::Relaxed, Ordering::Relaxed, fits) {
            Ok(_) => Reservation(declared),
            Err(_) => Reservation(0),
        }
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        RESERVED.fetch_sub(self.0, Ordering::Relaxed);
    }
}

/// A `tool-execute` body, up to [`MAX_TOOL_EXECUTE_BYTES`], in one buffer
/// that each frame is copied into as it comes. With a `Content-Length` the
/// buffer is its size from the start (while [`Reservation`] allows), so
/// the payload is held once, where collecting its frames and then joining
/// them held it twice; without one it grows as a `Vec` does, up to twice
/// the payload for a moment. (Parsing the payload where its
/// frames lie, with `serde_json::from_reader`, held it once too, but held
/// its worker thread, and the streams on it, for about a second a 32 MiB
/// payload: `tests/admin_memory.rs` ran 1.1 s against 0.2 s.)
async fn read_whole(req: Request<Incoming>) -> Result<Vec<u8>, Unread> {
    // hyper's reading of the `Content-Length`, checked.
    let declared = req.body().size_hint().exact().unwrap_or(0);
    let reservation = Reservation::take(usize::try_from(declared).unwrap_or(usize::MAX));
    let mut body = Limited::new(req.into_body(), MAX_TOOL_EXECUTE_BYTES);
    let mut whole = Vec::with_capacity(reservation.0);
    while let Some(frame) = body.frame().await {
        let frame = frame.map_err(|err| match err.downcast_ref::<LengthLimitError>() {
            Some(_) => Unread::TooLarge,
            None => Unread::Failed(err),
        })?;
        if let Ok(data) = frame.into_data() {
            whole.extend_from_slice(&data);
        }
    }
    Ok(whole)
}

/// Why [`read_whole`] has no body.
enum Unread {
    /// Over [`MAX_TOOL_EXECUTE_BYTES`], declared or sent.
    TooLarge,
    Failed(BoxError),
}

async fn tool_execute(proxy: &Proxy, req: Request<Incoming>) -> Response<ProxyBody> {
    let bad =
        |message: String| json_error(StatusCode::BAD_REQUEST, "invalid_request_error", &message);
    // A JSON content type cannot be sent cross-site without a CORS
    // preflight, which this route never grants: a web page cannot clear a
    // session behind the user's back.
    let json = req
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| {
            v.split(';')
                .next()
                .is_some_and(|t| t.trim().eq_ignore_ascii_case("application/json"))
        });
    if !json {
        return json_error(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "invalid_request_error",
            "send the tool:execute payload with Content-Type: application/json",
        );
    }
    let body = match read_whole(req).await {
        Ok(body) => body,
        Err(Unread::TooLarge) => {
            return json_error(
                StatusCode::PAYLOAD_TOO_LARGE,
                "invalid_request_error",
                &format!(
                    "the tool:execute payload is larger than {} MiB",
                    MAX_TOOL_EXECUTE_BYTES >> 20
                ),
            );
        }
        Err(Unread::Failed(err)) => return bad(format!("cannot read the body: {err}")),
    };
    let payload: ToolExecute = match serde_json::from_slice(&body) {
        Ok(payload) => payload,
        Err(err) => {
            return bad(format!(
                "expected {{\"sessionId\":…,\"toolName\":…,\"args\":…,\"phase\":…}}: {err}"
            ));
        }
    };
    if let Some(problem) = session_id_problem(payload.session_id.as_bytes()) {
        return bad(format!("sessionId {problem}"));
    }
    let cleared = match payload.phase.as_str() {
        "start" => proxy.sessions().tool_execution_started(&payload.session_id),
        _ => 0,
    };
    tracing::debug!(
        // Any JSON string: escaped, so it cannot forge a log line.
        session = %log_safe(&payload.session_id),
        tool = %log_safe(payload.tool_name.as_deref().unwrap_or("-")),
        phase = %log_safe(&payload.phase),
        cleared,
        "tool:execute"
    );
    json_response(&serde_json::json!({"ok": true, "cleared": cleared}))
}

/// What an events stream follows.
enum Watch {
    /// One session (`/_aalis/sessions/{id}/events`).
    Session(String),
    /// Every session (`/_aalis/events`).
    All,
}

impl Watch {
    fn subscribe(&self, registry: &SessionRegistry) -> Subscription {
        match self {
            Watch::Session(id) => registry.subscribe(id),
            Watch::All => registry.subscribe_all(),
        }
    }

    /// Whether a stream it follows is open.
    fn streaming(&self, registry: &SessionRegistry) -> bool {
        match self {
            Watch::Session(id) => registry.streaming(Some(id)),
            Watch::All => registry.streaming(None),
        }
    }
}

/// How often a subscriber looks whether the streams it follows have ended,
/// once the proxy shuts down (their ends also send it frames, which it
/// looks at too).
const CLOSING_CHECK: Duration = Duration::from_millis(100);

/// The most a subscriber's frames not yet taken by its connection may
/// hold, in bytes, and in frames (four times as many on `/_aalis/events`,
/// as its broadcast has): past either (and past one frame), the subscriber
/// starts again from a fresh snapshot. Frames are a few hundred bytes, but
/// a content or reasoning frame holds the upstream's delta, whatever its
/// size: counted in frames alone, a subscriber that stopped reading held
/// 256 of them (1,024 on `/_aalis/events`), 285 MiB with 1 MiB deltas.
pub const SUBSCRIBER_BACKLOG_BYTES: usize = 1 << 20;

/// What the frames of every subscriber together may hold, in bytes: past
/// it, a subscriber whose frames have waited a second (`STALLED_AFTER`)
/// without its connection taking one starts again from a fresh snapshot,
/// as one past its own bound does (checked at each frame it gets, and each
/// second while frames wait). One that keeps up is not touched, whatever
/// the others hold. So what stalled subscribers hold past the bound goes
/// within about two seconds (a stall, then the check); the frame each
/// connection is writing (one in its channel, and what hyper holds) is not
/// counted. 300
/// subscribers that stopped reading held 1 MiB each before, their own
/// bound ([`SUBSCRIBER_BACKLOG_BYTES`]).
pub const ALL_SUBSCRIBERS_BACKLOG_BYTES: usize = 64 << 20;

/// How long a subscriber's frames wait without its connection taking one
/// before the bound of all subscribers together
/// ([`ALL_SUBSCRIBERS_BACKLOG_BYTES`]) applies to it. A connection that
/// reads takes a burst's frames in milliseconds; a subscriber to a quiet
/// session, whose queue is empty, is not waiting.
const STALLED_AFTER: Duration = Duration::from_secs(1);

/// The events routes: a task takes frames from a broadcast as they come,
/// into a queue of its own, and hands them to the response body through a
/// channel of one. A subscriber that lags (by more than the broadcast's
/// frames, or than [`SUBSCRIBER_BACKLOG_BYTES`] or the broadcast's frames
/// in its queue, or, its frames having waited [`STALLED_AFTER`], while all
/// queues hold more than [`ALL_SUBSCRIBERS_BACKLOG_BYTES`]) is dropped from the
/// broadcast, and once its connection
/// takes bytes again it gets a fresh snapshot (taken then, with a new
/// receiver) instead of what it missed: a stalled one holds nothing
/// meanwhile. A client that goes away closes the channel, which ends the
/// task at once (and forgets its session if nothing else uses it). At the
/// proxy's shutdown a subscriber ends once no stream it follows (of its
/// session; of any, on `/_aalis/events`) is open and its frames are taken:
/// it hears its stream to the end, clear and `done` included, as the
/// stream's own client does, within `--shutdown-grace` like it; one with
/// no stream open ends at once.
fn events(registry: SessionRegistry, metrics: Arc<Metrics>, watch: Watch) -> Response<ProxyBody> {
    let (tx, rx) = mpsc::channel::<Bytes>(1);
    let Subscription { resume, frames } = watch.subscribe(&registry);
    let max_frames = match watch {
        Watch::Session(_) => SUBSCRIBER_BACKLOG,
        Watch::All => ALL_SESSIONS_BACKLOG,
    };
    tokio::spawn(async move {
        let mut backlog = Backlog::new(metrics);
        backlog.push(sse(&resume));
        // `None` while a fresh snapshot is due (see above).
        let mut frames = Some(frames);
        let mut keep_alive = tokio::time::interval(KEEP_ALIVE);
        keep_alive.tick().await;
        // While frames wait: a stalled subscriber's session may send
        // nothing more, so the bound of all subscribers is also checked
        // each [`STALLED_AFTER`], not only at a frame.
        let mut stall_check =
            tokio::time::interval_at(tokio::time::Instant::now() + STALLED_AFTER, STALLED_AFTER);
        stall_check.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let closed = registry.closed();
        tokio::pin!(closed);
        let mut closing = false;
        // Not ticking until the shutdown: a tick missed meanwhile would
        // come all at once then, one look at the registry each.
        let mut closing_check = tokio::time::interval(CLOSING_CHECK);
        closing_check.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            let resync = frames.is_none();
            // Set by an arm below when the subscriber is to start again.
            let mut behind = false;
            tokio::select! {
                // The proxy shuts down: the stream ends, so that the
                // connection can close (EventSource reconnects), once the
                // streams it follows have (below).
                () = &mut closed, if !closing => closing = true,
                _ = closing_check.tick(), if closing => {}
                // The client went away.
                () = tx.closed() => break,
                // The connection takes the next frame, or the snapshot due.
                permit = tx.reserve(), if !backlog.is_empty() || resync => {
                    let Ok(permit) = permit else { break };
                    backlog.took();
                    match backlog.pop() {
                        Some(frame) => permit.send(frame),
                        None => {
                            let fresh = watch.subscribe(&registry);
                            frames = Some(fresh.frames);
                            permit.send(sse(&fresh.resume));
                        }
                    }
                }
                received = next_frame(&mut frames), if !resync => {
                    behind = match received {
                        Ok(frame) => {
                            backlog.push(sse(&frame));
                            backlog.over(max_frames)
                        }
                        Err(broadcast::error::RecvError::Lagged(_)) => true,
                        Err(broadcast::error::RecvError::Closed) => break,
                    };
                }
                _ = keep_alive.tick(), if backlog.is_empty() && !resync => {
                    backlog.push(Bytes::from_static(b": keep-alive\n\n"));
                }
                _ = stall_check.tick(), if !backlog.is_empty() && !resync => {
                    behind = backlog.stalled_past_all();
                }
            }
            if behind {
                // Too far behind: what waits goes, and so does the
                // receiver, until the connection can take the present (the
                // snapshot, taken then).
                tracing::debug!(
                    frames = backlog.len(),
                    bytes = backlog.bytes,
                    "slow subscriber: a fresh snapshot once it reads again"
                );
                backlog.clear();
                frames = None;
            }
            if closing && backlog.is_empty() && !watch.streaming(&registry) {
                // The end's frames (a clear, `done`) are in the broadcast
                // before its stream counts as ended: taken first.
                let mut more = false;
                if let Some(frames) = frames.as_mut() {
                    while let Ok(frame) = frames.try_recv() {
                        backlog.push(sse(&frame));
                        more = true;
                    }
                }
                if !more {
                    break;
                }
            }
        }
        drop(frames);
        if let Watch::Session(id) = &watch {
            registry.release(id);
        }
    });
    let mut response = Response::new(ChannelBody { rx }.boxed());
    let headers = response.headers_mut();
    headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/event-stream"),
    );
    headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    headers.insert("x-accel-buffering", HeaderValue::from_static("no"));
    response
}

/// The next frame of `frames`; never, while there is no receiver.
async fn next_frame(
    frames: &mut Option<broadcast::Receiver<SessionFrame>>,
) -> Result<SessionFrame, broadcast::error::RecvError> {
    match frames {
        Some(frames) => frames.recv().await,
        None => std::future::pending().await,
    }
}

/// A subscriber's frames that its connection has not taken yet, counted
/// in the proxy's metrics as well (`aalis_subscriber_backlog_bytes`, the
/// sum over every subscriber, which [`Backlog::over`] bounds).
struct Backlog {
    frames: std::collections::VecDeque<Bytes>,
    bytes: usize,
    /// Since when frames have waited without the connection taking one:
    /// the later of its last take and the push into an empty queue.
    waiting_since: tokio::time::Instant,
    metrics: Arc<Metrics>,
}

impl Backlog {
    fn new(metrics: Arc<Metrics>) -> Self {
        Self {
            frames: std::collections::VecDeque::new(),
            bytes: 0,
            waiting_since: tokio::time::Instant::now(),
            metrics,
        }
    }

    /// The connection takes a frame.
    fn took(&mut self) {
        self.waiting_since = tokio::time::Instant::now();
    }

    fn push(&mut self, frame: Bytes) {
        if self.frames.is_empty() {
            self.waiting_since = tokio::time::Instant::now();
        }
        self.bytes += frame.len();
        self.metrics
            .subscriber_backlog_bytes
            .fetch_add(frame.len(), Ordering::Relaxed);
        self.frames.push_back(frame);
    }

    fn pop(&mut self) -> Option<Bytes> {
        let frame = self.frames.pop_front()?;
        self.bytes -= frame.len();
        self.metrics
            .subscriber_backlog_bytes
            .fetch_sub(frame.len(), Ordering::Relaxed);
        Some(frame)
    }

    fn is_empty(&self) -> bool {
        self.frames.is_empty()
    }

    fn len(&self) -> usize {
        self.frames.len()
    }

    /// Past [`SUBSCRIBER_BACKLOG_BYTES`] or `max_frames` with more than
    /// one frame (a single frame larger than the bound still goes out
    /// whole); or, its frames having waited [`STALLED_AFTER`] without its
    /// connection taking one, while every subscriber's frames together are
    /// past [`ALL_SUBSCRIBERS_BACKLOG_BYTES`].
    fn over(&self, max_frames: usize) -> bool {
        let own = self.frames.len() > 1
            && (self.bytes > SUBSCRIBER_BACKLOG_BYTES || self.frames.len() > max_frames);
        own || self.stalled_past_all()
    }

    /// Its frames have waited [`STALLED_AFTER`] without its connection
    /// taking one, while every subscriber's frames together are past
    /// [`ALL_SUBSCRIBERS_BACKLOG_BYTES`].
    fn stalled_past_all(&self) -> bool {
        !self.frames.is_empty()
            && self
                .metrics
                .subscriber_backlog_bytes
                .load(Ordering::Relaxed)
                > ALL_SUBSCRIBERS_BACKLOG_BYTES
            && self.waiting_since.elapsed() >= STALLED_AFTER
    }

    fn clear(&mut self) {
        self.frames.clear();
        self.metrics
            .subscriber_backlog_bytes
            .fetch_sub(self.bytes, Ordering::Relaxed);
        self.bytes = 0;
    }
}

impl Drop for Backlog {
    /// A subscriber that goes away takes its frames out of the sum.
    fn drop(&mut self) {
        self.clear();
    }
}

fn sse(json: &str) -> Bytes {
    Bytes::from(format!("data: {json}\n\n"))
}

/// A response body fed by a channel.
struct ChannelBody {
    rx: mpsc::Receiver<Bytes>,
}

impl Body for ChannelBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        self.rx
            .poll_recv(cx)
            .map(|frame| frame.map(|bytes| Ok(Frame::data(bytes))))
    }
}

/// An answer of the routes: its body, of `content_type`, with its
/// caching rule.
fn answer(
    body: Bytes,
    content_type: &'static str,
    cache_control: &'static str,
) -> Response<ProxyBody> {
    let mut response = Response::new(Full::new(body).map_err(|never| match never {}).boxed());
    let headers = response.headers_mut();
    headers.insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
    headers.insert(
        header::CACHE_CONTROL,
        HeaderValue::from_static(cache_control),
    );
    response
}

/// Live state as plain text: never to be stored (a cache between would
/// show an old snapshot).
fn text(body: String) -> Response<ProxyBody> {
    answer(Bytes::from(body), "text/plain; charset=utf-8", "no-store")
}

/// Live state as JSON, likewise.
fn json_text(json: &str) -> Response<ProxyBody> {
    answer(Bytes::from(json.to_owned()), "application/json", "no-store")
}

/// A permanent redirect (308: the method and body stay) to `to`.
fn redirect(to: &'static str) -> Response<ProxyBody> {
    let mut response = text(format!("see {to}\n"));
    *response.status_mut() = StatusCode::PERMANENT_REDIRECT;
    response
        .headers_mut()
        .insert(header::LOCATION, HeaderValue::from_static(to));
    response
}

fn html(page: &'static str) -> Response<ProxyBody> {
    answer(
        Bytes::from_static(page.as_bytes()),
        "text/html; charset=utf-8",
        "no-cache",
    )
}

#[cfg(test)]
mod tests {
    /// Reservations add up to [`MAX_RESERVED_BYTES`] at most; one that
    /// would go past it gets nothing, and a dropped one gives its bytes
    /// back. (Other tests of this binary may hold some: the test counts
    /// from what it finds.)
    #[test]
    fn reservations_stay_under_their_bound() {
        let before = RESERVED.load(Ordering::Relaxed);
        let room = MAX_RESERVED_BYTES - before;
        let first = Reservation::take(room / 2);
        let second = Reservation::take(room / 2);
        assert_eq!((first.0, second.0), (room / 2, room / 2));
        let third = Reservation::take(room / 2 + 1);
        assert_eq!(third.0, 0);
        drop(second);
        let fourth = Reservation::take(room / 2);
        assert_eq!(fourth.0, room / 2);
        drop((first, third, fourth));
        assert_eq!(RESERVED.load(Ordering::Relaxed), before);
    }

    use super::*;

    #[test]
    fn segments_are_percent_decoded() {
        assert_eq!(decode_segment("chat-42"), "chat-42");
        assert_eq!(decode_segment("a%20b%2Fc"), "a b/c");
        assert_eq!(decode_segment("bad%zz"), "bad%zz");
    }

    #[test]
    fn only_loopback_or_the_admin_token_gets_in() {
        let remote: IpAddr = "192.0.2.7".parse().expect("ip");
        let bearer = |t: &str| HeaderValue::from_str(&format!("Bearer {t}")).expect("value");
        let local: IpAddr = "127.0.0.1".parse().expect("ip");
        let host = Some("127.0.0.1:8787");
        assert!(admin_allowed(local, host, None, None));
        assert!(admin_allowed(
            "::1".parse().expect("ip"),
            Some("[::1]:8787"),
            None,
            Some("t0k")
        ));
        assert!(admin_allowed(local, Some("localhost:8787"), None, None));
        // 127.0.0.1 reaching a dual-stack listener is still loopback.
        assert!(admin_allowed(
            "::ffff:127.0.0.1".parse().expect("ip"),
            host,
            None,
            None
        ));
        // A page that rebound its name to 127.0.0.1 does not get in.
        assert!(!admin_allowed(local, Some("evil.example:8787"), None, None));
        assert!(
            !admin_allowed(remote, host, None, None),
            "no token configured"
        );
        assert!(
            !admin_allowed(remote, host, Some(&bearer("t0k")), None),
            "no token configured"
        );
        assert!(!admin_allowed(remote, host, None, Some("t0k")), "no header");
        assert!(
            !admin_allowed(remote, host, Some(&bearer("t0K")), Some("t0k")),
            "wrong token"
        );
        assert!(
            !admin_allowed(
                remote,
                host,
                Some(&HeaderValue::from_static("t0k")),
                Some("t0k")
            ),
            "not Bearer"
        );
        assert!(admin_allowed(
            remote,
            Some("proxy.example"),
            Some(&bearer("t0k")),
            Some("t0k")
        ));
        // The scheme in any case (RFC 9110 §11.1); not the token.
        for given in ["bearer t0k", "BEARER t0k", "Bearer  t0k "] {
            assert!(
                admin_allowed(
                    remote,
                    Some("proxy.example"),
                    Some(&HeaderValue::from_static(given)),
                    Some("t0k")
                ),
                "{given:?}"
            );
        }
        for given in ["Basic t0k", "Bearer", "Bearert0k", "bearer T0K"] {
            assert!(
                !admin_allowed(
                    remote,
                    Some("proxy.example"),
                    Some(&HeaderValue::from_static(given)),
                    Some("t0k")
                ),
                "{given:?}"
            );
        }
    }

    /// A subscriber whose connection takes nothing, past more frames than
    /// its backlog's (each small): it is dropped from the broadcast, and
    /// once its connection takes bytes again it gets a fresh snapshot and
    /// nothing more. With the backlog bounded in bytes alone, all 2,000
    /// frames waited for it (1 MiB is about 8,000 of them).
    #[tokio::test(flavor = "current_thread")]
    async fn a_stalled_subscriber_past_its_frames_gets_a_fresh_snapshot() {
        use crate::chunk::{ArgumentsDelta, Chunk, ToolCallDelta};
        use crate::pipeline::StreamEvent;
        use crate::progress::{ProgressEntry, ToolCallTracker};
        let registry = SessionRegistry::new();
        let mut body = events(
            registry.clone(),
            Arc::default(),
            Watch::Session("s1".into()),
        )
        .into_body();
        let mut stream = registry.begin_stream("s1");
        let mut tracker = ToolCallTracker::new(false);
        tracker.apply(
            &Chunk::ToolCallDelta(ToolCallDelta {
                choice: 0,
                index: Some(0),
                id: None,
                name: Some("f".into()),
                arguments: ArgumentsDelta::Append(std::borrow::Cow::<str>::Borrowed("").into()),
                custom: false,
            }),
            1,
        );
        for chars in 0..2_000 {
            let event = StreamEvent::Progress(ProgressEntry {
                choice: 0,
                index: 0,
                name: "f".into(),
                chars_accumulated: chars,
                started_at_ms: 1,
            });
            stream.publish_at(&mut tracker, &[event], false, std::time::Instant::now());
            // The subscriber's task takes each frame as it comes.
            tokio::task::yield_now().await;
        }
        let mut frames = Vec::new();
        while let Ok(Some(Ok(frame))) =
            tokio::time::timeout(Duration::from_millis(200), body.frame()).await
        {
            if let Ok(data) = frame.into_data() {
                frames.push(String::from_utf8_lossy(&data).into_owned());
            }
        }
        let progress = frames
            .iter()
            .filter(|f| f.contains("toolCallProgress"))
            .count();
        assert!(frames.len() >= 2, "{frames:?}");
        assert!(frames[0].contains("stream_resume"), "{}", frames[0]);
        assert!(
            frames.last().is_some_and(|f| f.contains("stream_resume")),
            "no fresh snapshot after {progress} progress frames"
        );
        assert!(progress <= SUBSCRIBER_BACKLOG, "{progress} frames held");
    }

    /// Subscribers that stopped reading hold little more than
    /// [`ALL_SUBSCRIBERS_BACKLOG_BYTES`] together, though each stays under
    /// its own bound; one that reads as bursts of frames come, after a
    /// pause longer than [`STALLED_AFTER`], gets every frame and no fresh
    /// snapshot; and the sum, a metric, goes back to 0 once they are gone.
    /// Before, 300 stalled subscribers held 1 MiB each, 300 MiB in all;
    /// and the first version of the bound cut the reader too, whenever a
    /// burst left two frames in its queue (a review found it).
    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn stalled_subscribers_together_hold_a_bounded_number_of_bytes() {
        use crate::pipeline::StreamEvent;
        use crate::progress::ToolCallTracker;
        const STALLED: usize = 300;
        const BURSTS: usize = 4;
        const BURST: usize = 3;
        let registry = SessionRegistry::new();
        let metrics = Arc::<Metrics>::default();
        let subscribe = || {
            events(
                registry.clone(),
                metrics.clone(),
                Watch::Session("s1".into()),
            )
            .into_body()
        };
        let stalled: Vec<_> = (0..STALLED).map(|_| subscribe()).collect();
        let mut reader = subscribe();
        let held = || metrics.subscriber_backlog_bytes.load(Ordering::Relaxed);
        let mut stream = registry.begin_stream("s1");
        let mut tracker = ToolCallTracker::new(false);
        // Three bursts of 300 × 3 frames of 50 KiB pass the bound; the
        // first stays under it, as nothing has waited long yet.
        let text = "x".repeat(50 * 1024);
        let mut read = Vec::new();
        let mut most = 0;
        for burst in 0..BURSTS {
            for _ in 0..BURST {
                let event = StreamEvent::Content {
                    choice: 0,
                    text: text.clone(),
                };
                stream.publish_at(&mut tracker, &[event], false, std::time::Instant::now());
                // Every subscriber's task takes the frame (each is woken once).
                tokio::task::yield_now().await;
                most = most.max(held());
            }
            while let Ok(Some(Ok(frame))) =
                tokio::time::timeout(Duration::from_millis(50), reader.frame()).await
            {
                if let Ok(data) = frame.into_data() {
                    read.push(String::from_utf8_lossy(&data).into_owned());
                }
            }
            if burst == 0 {
                // The stalled connections have taken nothing for a while.
                tokio::time::advance(2 * STALLED_AFTER).await;
            }
        }
        let frame = format!("data: {{\"contentDelta\":\"{text}\"}}\n\n").len();
        assert!(
            most <= ALL_SUBSCRIBERS_BACKLOG_BYTES + 3 * frame,
            "{most} bytes held for {STALLED} subscribers"
        );
        assert!(most > ALL_SUBSCRIBERS_BACKLOG_BYTES / 2, "{most}");
        let resumes = read.iter().filter(|f| f.contains("stream_resume")).count();
        let deltas = read.iter().filter(|f| f.contains(&text)).count();
        assert_eq!((resumes, deltas), (1, BURSTS * BURST), "the reader was cut");
        drop((stalled, reader));
        for _ in 0..10 {
            tokio::task::yield_now().await;
        }
        assert_eq!(held(), 0);
    }

    /// Subscribers stalled on one session, each holding a single large
    /// frame (80 MiB in all, past the bound of all together), do not cut a
    /// reader of another session that takes bursts of frames; once their
    /// frames have waited [`STALLED_AFTER`], they start again from a
    /// snapshot, though their session sends nothing more, and the sum
    /// comes back under the bound. The first version of the bound cut the
    /// reader at every burst that left two frames in its queue (61
    /// snapshots and 80 of 300 deltas in the review's run), and never the
    /// stalled ones, whose single frames it let be; the second cut them
    /// only at their next frame, which may never come.
    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn a_reader_is_not_cut_for_what_stalled_subscribers_hold() {
        use crate::pipeline::StreamEvent;
        use crate::progress::ToolCallTracker;
        const STALLED: usize = 40;
        const BURSTS: usize = 20;
        let registry = SessionRegistry::new();
        let metrics = Arc::<Metrics>::default();
        let subscribe = |session: &str| {
            events(
                registry.clone(),
                metrics.clone(),
                Watch::Session(session.into()),
            )
            .into_body()
        };
        let held = || metrics.subscriber_backlog_bytes.load(Ordering::Relaxed);
        let content = |text: &str| StreamEvent::Content {
            choice: 0,
            text: text.to_owned(),
        };
        // Every subscriber's task takes what was published; no time passes.
        let settle = || async {
            for _ in 0..20 {
                tokio::task::yield_now().await;
            }
        };
        let stalled: Vec<_> = (0..STALLED).map(|_| subscribe("a")).collect();
        let mut reader = subscribe("b");
        let mut a = registry.begin_stream("a");
        let mut b = registry.begin_stream("b");
        let mut tracker_a = ToolCallTracker::new(false);
        let mut tracker_b = ToolCallTracker::new(false);
        // Each has sent its snapshot (its connection's channel holds it).
        settle().await;
        let big = "x".repeat(2 << 20);
        a.publish_at(
            &mut tracker_a,
            &[content(&big)],
            false,
            std::time::Instant::now(),
        );
        settle().await;
        assert!(held() > ALL_SUBSCRIBERS_BACKLOG_BYTES, "{}", held());
        let mut read = Vec::new();
        for burst in 0..BURSTS {
            for k in 0..3 {
                let text = format!("burst {burst} delta {k}");
                b.publish_at(
                    &mut tracker_b,
                    &[content(&text)],
                    false,
                    std::time::Instant::now(),
                );
                settle().await;
            }
            // What the reader's connection takes, as long as frames come
            // (once more after the tasks had their turn).
            let mut tries = 0;
            while tries < 2 {
                match tokio::time::timeout(Duration::ZERO, reader.frame()).await {
                    Ok(Some(Ok(frame))) => {
                        tries = 0;
                        if let Ok(data) = frame.into_data() {
                            read.push(String::from_utf8_lossy(&data).into_owned());
                        }
                    }
                    _ => {
                        tries += 1;
                        settle().await;
                    }
                }
            }
        }
        assert!(held() > ALL_SUBSCRIBERS_BACKLOG_BYTES, "{}", held());
        let resumes = read.iter().filter(|f| f.contains("stream_resume")).count();
        let deltas = read.iter().filter(|f| f.contains("delta")).count();
        assert_eq!((resumes, deltas), (1, BURSTS * 3), "the reader was cut");
        // Two seconds on, with no frame for session `a`: the stalled ones
        // start again from a snapshot, and what they held goes.
        tokio::time::advance(2 * STALLED_AFTER).await;
        settle().await;
        assert!(held() <= ALL_SUBSCRIBERS_BACKLOG_BYTES, "{}", held());
        drop((stalled, reader));
    }

    /// A subscriber whose connection takes its frames slowly, one every
    /// 0.6 s while more come, is no stalled one, however much the others
    /// hold: each frame taken starts its wait again. It is one once its
    /// frames have waited a second; and a queue that goes takes its bytes
    /// out of the sum.
    #[tokio::test(flavor = "current_thread", start_paused = true)]
    async fn a_queue_that_drains_slowly_is_no_stalled_one() {
        let metrics = Arc::<Metrics>::default();
        // The others hold past the bound.
        let others = ALL_SUBSCRIBERS_BACKLOG_BYTES + 1;
        metrics
            .subscriber_backlog_bytes
            .store(others, Ordering::Relaxed);
        let mut backlog = Backlog::new(Arc::clone(&metrics));
        let frame = || Bytes::from_static(b"data: {}\n\n");
        for _ in 0..3 {
            backlog.push(frame());
        }
        for _ in 0..4 {
            tokio::time::advance(STALLED_AFTER * 6 / 10).await;
            backlog.took();
            let _ = backlog.pop();
            backlog.push(frame());
            assert!(!backlog.over(SUBSCRIBER_BACKLOG), "cut while it reads");
        }
        tokio::time::advance(STALLED_AFTER).await;
        assert!(backlog.over(SUBSCRIBER_BACKLOG), "a second without a take");
        drop(backlog);
        assert_eq!(
            metrics.subscriber_backlog_bytes.load(Ordering::Relaxed),
            others
        );
    }

    #[test]
    fn tokens_compare_whole() {
        assert!(constant_time_eq(b"secret", b"secret"));
        assert!(!constant_time_eq(b"secret", b"secreT"));
        assert!(!constant_time_eq(b"secret", b"secret2"));
    }
}
