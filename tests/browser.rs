//! The status page in a real browser (issue 5, "Tests"): headless Chromium
//! (Debian's `chromium`), driven by `playwright-core` from
//! `tests/browser/status_page.mjs`, loads `GET /_aalis/` of the real binary's
//! `serve` while `mock` streams a parallel tool call through it, sees both
//! cards with growing counts, reloads and sees them again with elapsed time
//! not reset, sees them leave after `[DONE]`, and saves a screenshot as
//! `target/test-artifacts/status-page.png`.
//!
//! It needs Chromium at `/usr/bin/chromium` and the script's packages:
//! `apt-get install -y chromium` and
//! `npm ci --prefix tests/browser --no-audit --no-fund` (`.ci/run` does
//! both). Without them the test fails and says what to run; it never skips.
//!
//! The timing: `mock --delay-ms 800` sends the 14 events of
//! `parallel_tool_calls` 800 ms apart, so, from the request, get_weather is
//! in progress from 0.8 s, get_local_time from 5.6 s (growing at 6.4, 7.2,
//! 8.0 and 8.8 s), and both until `[DONE]` at 10.4 s. The script opens the
//! page when the server has the second call, and does its reads, the
//! screenshot and the reload in that 4.8 s window (2.4 s with 400 ms
//! events, tight for a loaded machine).
//!
//! Every child is a [`Running`], whose `Drop` stops it, and every wait has
//! a deadline.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

/// For `mock` and `serve` to say where they listen.
const START_DEADLINE: Duration = Duration::from_secs(15);
/// For the script to launch Chromium and say `READY`.
const READY_DEADLINE: Duration = Duration::from_secs(90);
/// For the script to finish once `READY` (its own waits are shorter).
const SCRIPT_DEADLINE: Duration = Duration::from_secs(120);
/// For the chat stream (about 10.4 s) to end.
const STREAM_DEADLINE: Duration = Duration::from_secs(30);

/// The session the chat request names and the page shows.
const SESSION: &str = "browser-test";
/// The request of the README demo: the bundled capture with two calls.
const PARALLEL_REQUEST: &str = r#"{"model":"parallel_tool_calls","stream":true}"#;
/// What the script prints on its last line when all its checks pass.
const ALL_PASSED: &str = "8 passed, 0 failed";

const CHROMIUM: &str = "/usr/bin/chromium";
const NPM_CI: &str = "npm ci --prefix tests/browser --no-audit --no-fund";

/// Variables that could change what the children do: logging, proxies.
const SCRUBBED_ENV: &[&str] = &[
    "RUST_LOG",
    "http_proxy",
    "https_proxy",
    "all_proxy",
    "no_proxy",
    "HTTP_PROXY",
    "HTTPS_PROXY",
    "ALL_PROXY",
    "NO_PROXY",
    "NODE_OPTIONS",
];

/// `kill(2)`, without a libc dependency.
mod sig {
    use std::ffi::c_int;

    unsafe extern "C" {
        fn kill(pid: c_int, sig: c_int) -> c_int;
    }

    pub const SIGTERM: c_int = 15;

    /// Sends `signum` to the process `pid`; a process already gone is not
    /// an error.
    pub fn send(pid: u32, signum: c_int) {
        if let Ok(pid) = c_int::try_from(pid) {
            // SAFETY: kill() has no memory-safety preconditions.
            unsafe { kill(pid, signum) };
        }
    }
}

fn package_root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// `target/test-artifacts/status-page.png` (under `CARGO_TARGET_DIR` when
/// that is set).
fn screenshot_path() -> PathBuf {
    let tmp = Path::new(env!("CARGO_TARGET_TMPDIR"));
    tmp.parent()
        .unwrap_or(tmp)
        .join("test-artifacts")
        .join("status-page.png")
}

// ---------------------------------------------------------------------------
// Child processes

/// A child process whose output is collected by threads. Dropping it stops
/// it: SIGTERM (so the script closes Chromium), then SIGKILL if it is still
/// there after a few seconds.
struct Running {
    name: String,
    child: Child,
    /// stdout and stderr as they came, interleaved.
    output: Arc<Mutex<Vec<u8>>>,
    /// stdout's lines, as they come.
    lines: mpsc::Receiver<String>,
    readers: Vec<JoinHandle<()>>,
    /// Print the output if the test fails (the script's is in the panic
    /// messages instead).
    show_on_failure: bool,
}

impl Running {
    fn spawn(name: &str, mut cmd: Command) -> Running {
        for var in SCRUBBED_ENV {
            cmd.env_remove(var);
        }
        cmd.stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let mut child = cmd
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {name} ({cmd:?}): {e}"));
        let output = Arc::new(Mutex::new(Vec::new()));
        let (tx, lines) = mpsc::channel();
        let stdout = child.stdout.take().expect("piped stdout");
        let stderr = child.stderr.take().expect("piped stderr");
        let sink = Arc::clone(&output);
        let out_reader = thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                let mut all = sink.lock().unwrap_or_else(|e| e.into_inner());
                all.extend_from_slice(line.as_bytes());
                all.push(b'\n');
                drop(all);
                let _ = tx.send(line);
            }
        });
        let sink = Arc::clone(&output);
        let err_reader = thread::spawn(move || {
            let mut pipe = stderr;
            let mut buf = [0u8; 4096];
            while let Ok(n) = pipe.read(&mut buf) {
                if n == 0 {
                    break;
                }
                let mut all = sink.lock().unwrap_or_else(|e| e.into_inner());
                all.extend_from_slice(&buf[..n]);
            }
        });
        Running {
            name: name.to_owned(),
            child,
            output,
            lines,
            readers: vec![out_reader, err_reader],
            show_on_failure: true,
        }
    }

    /// `aalis-proxy args`, run from the package root.
    fn aalis_proxy(name: &str, args: &[&str]) -> Running {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_aalis-proxy"));
        cmd.current_dir(package_root()).args(args);
        Running::spawn(name, cmd)
    }

    fn output(&self) -> String {
        String::from_utf8_lossy(&self.output.lock().unwrap_or_else(|e| e.into_inner())).into_owned()
    }

    fn exited(&mut self) -> Option<ExitStatus> {
        self.child.try_wait().expect("try_wait")
    }

    /// The address logged after `prefix` (`… on http://127.0.0.1:PORT…`);
    /// fails past [`START_DEADLINE`] or if the child exits first.
    fn wait_for_address(&mut self, prefix: &str) -> SocketAddr {
        let start = Instant::now();
        loop {
            let output = self.output();
            if let Some((_, rest)) = output.split_once(prefix) {
                let word = rest.split([' ', ',', '\n']).next().unwrap_or_default();
                return word.trim_end_matches(':').parse().unwrap_or_else(|e| {
                    panic!("{}: bad address {word:?} ({e}):\n{output}", self.name)
                });
            }
            if let Some(status) = self.exited() {
                panic!(
                    "{} exited ({status}) before listening:\n{output}",
                    self.name
                );
            }
            assert!(
                start.elapsed() < START_DEADLINE,
                "{} did not say {prefix:?} within {START_DEADLINE:?}:\n{output}",
                self.name
            );
            thread::sleep(Duration::from_millis(10));
        }
    }

    /// Waits for a stdout line equal to `wanted`; `Err` with the output if
    /// the child exits or `deadline` passes first.
    fn wait_for_line(&mut self, wanted: &str, deadline: Duration) -> Result<(), String> {
        let start = Instant::now();
        loop {
            match self.lines.recv_timeout(Duration::from_millis(50)) {
                Ok(line) if line == wanted => return Ok(()),
                Ok(_) => {}
                Err(mpsc::RecvTimeoutError::Timeout) => {
                    if start.elapsed() > deadline {
                        return Err(format!("no {wanted:?} within {deadline:?}"));
                    }
                }
                Err(mpsc::RecvTimeoutError::Disconnected) => {
                    return Err(format!("it exited before printing {wanted:?}"));
                }
            }
        }
    }

    /// Waits for the child to exit, then for its output; `None` past
    /// `deadline`.
    fn wait(&mut self, deadline: Duration) -> Option<ExitStatus> {
        let start = Instant::now();
        loop {
            if let Some(status) = self.exited() {
                for reader in self.readers.drain(..) {
                    let _ = reader.join();
                }
                return Some(status);
            }
            if start.elapsed() > deadline {
                return None;
            }
            thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        if self.exited().is_none() {
            sig::send(self.child.id(), sig::SIGTERM);
            let start = Instant::now();
            while self.exited().is_none() && start.elapsed() < Duration::from_secs(5) {
                thread::sleep(Duration::from_millis(20));
            }
            if self.exited().is_none() {
                let _ = self.child.kill();
                let _ = self.child.wait();
            }
        }
        if self.show_on_failure && thread::panicking() {
            eprintln!("--- {} said:\n{}", self.name, self.output());
        }
    }
}

// ---------------------------------------------------------------------------
// The chat request

/// What the chat client saw.
struct Chat {
    response: Vec<u8>,
    /// From the request to the end of the response.
    took: Duration,
}

/// Streams one chat request of [`SESSION`] through the proxy on a thread:
/// a raw HTTP/1.1 POST, its response read slowly (small reads, a pause
/// between them) to the end.
fn start_chat(proxy: SocketAddr) -> JoinHandle<Result<Chat, String>> {
    thread::spawn(move || {
        let start = Instant::now();
        let mut stream = TcpStream::connect_timeout(&proxy, Duration::from_secs(5))
            .map_err(|e| format!("connect to {proxy}: {e}"))?;
        stream
            .set_read_timeout(Some(Duration::from_secs(10)))
            .and_then(|()| stream.set_write_timeout(Some(Duration::from_secs(5))))
            .map_err(|e| format!("socket timeouts: {e}"))?;
        let request = format!(
            "POST /v1/chat/completions HTTP/1.1\r\nHost: {proxy}\r\n\
             Content-Type: application/json\r\nX-Aalis-Session: {SESSION}\r\n\
             Content-Length: {}\r\nConnection: close\r\n\r\n{PARALLEL_REQUEST}",
            PARALLEL_REQUEST.len()
        );
        stream
            .write_all(request.as_bytes())
            .map_err(|e| format!("send the request: {e}"))?;
        let mut response = Vec::new();
        let mut buf = [0u8; 256];
        loop {
            if start.elapsed() > STREAM_DEADLINE {
                return Err(format!(
                    "the stream did not end within {STREAM_DEADLINE:?}:\n{}",
                    String::from_utf8_lossy(&response)
                ));
            }
            match stream.read(&mut buf) {
                Ok(0) => break,
                Ok(n) => response.extend_from_slice(&buf[..n]),
                Err(e) => {
                    return Err(format!(
                        "read the response: {e}:\n{}",
                        String::from_utf8_lossy(&response)
                    ));
                }
            }
            thread::sleep(Duration::from_millis(5));
        }
        Ok(Chat {
            response,
            took: start.elapsed(),
        })
    })
}

/// The body of a `Transfer-Encoding: chunked` HTTP/1.1 response (the
/// bytes after the head, as they are if not chunked).
fn response_body(response: &[u8]) -> (String, Vec<u8>) {
    let text = String::from_utf8_lossy(response);
    let Some((head, _)) = text.split_once("\r\n\r\n") else {
        return (text.into_owned(), Vec::new());
    };
    let mut rest = &response[head.len() + 4..];
    if !head
        .to_ascii_lowercase()
        .contains("transfer-encoding: chunked")
    {
        return (head.to_owned(), rest.to_vec());
    }
    let mut body = Vec::new();
    while let Some(end) = rest.windows(2).position(|w| w == b"\r\n") {
        let size_line = String::from_utf8_lossy(&rest[..end]);
        let size_hex = size_line.split(';').next().unwrap_or_default().trim();
        let Ok(size) = usize::from_str_radix(size_hex, 16) else {
            break;
        };
        rest = &rest[end + 2..];
        if size == 0 || rest.len() < size {
            break;
        }
        body.extend_from_slice(&rest[..size]);
        rest = rest.get(size + 2..).unwrap_or_default();
    }
    (head.to_owned(), body)
}

// ---------------------------------------------------------------------------
// The test

/// What the test needs besides cargo: Chromium and the script's packages.
fn require_tools(browser_dir: &Path) {
    assert!(
        Path::new(CHROMIUM).exists(),
        "{CHROMIUM} is missing: run `apt-get update && apt-get install -y chromium` \
         (.ci/run does)"
    );
    assert!(
        browser_dir
            .join("node_modules/playwright-core/package.json")
            .exists(),
        "tests/browser/node_modules is missing: run `{NPM_CI}` in {} (.ci/run does)",
        package_root().display()
    );
}

#[test]
fn the_status_page_shows_parallel_tool_calls_across_a_reload() {
    let browser_dir = package_root().join("tests/browser");
    require_tools(&browser_dir);
    let screenshot = screenshot_path();
    let _ = std::fs::remove_file(&screenshot);

    let mut mock = Running::aalis_proxy(
        "mock",
        &["mock", "--delay-ms", "800", "--listen", "127.0.0.1:0"],
    );
    let mock_addr = mock.wait_for_address("mock upstream on http://");
    let upstream = format!("http://{mock_addr}");
    let mut serve = Running::aalis_proxy(
        "serve",
        &["serve", "--upstream", &upstream, "--listen", "127.0.0.1:0"],
    );
    let proxy = serve.wait_for_address("listening on http://");
    assert!(proxy.ip().is_loopback() && mock_addr.ip().is_loopback());

    let mut node = Command::new("node");
    node.current_dir(&browser_dir)
        .arg(browser_dir.join("status_page.mjs"))
        .arg(format!("http://{proxy}"))
        .arg(SESSION)
        .arg(&screenshot);
    let mut script = Running::spawn("status_page.mjs", node);
    script.show_on_failure = false;
    if let Err(why) = script.wait_for_line("READY", READY_DEADLINE) {
        script.wait(Duration::from_secs(5));
        panic!(
            "the browser did not start: {why}:\n{}\n(hint: `{NPM_CI}`, \
             `apt-get install -y chromium`)",
            script.output()
        );
    }

    // The browser is up: the call starts now, and the script opens the
    // page when the server has its second tool in progress.
    let chat = start_chat(proxy);
    let status = script.wait(SCRIPT_DEADLINE);
    let output = script.output();
    let chat = chat.join().expect("the chat thread");

    let status = status.unwrap_or_else(|| {
        panic!("the script ran longer than {SCRIPT_DEADLINE:?}; stopped:\n{output}")
    });
    let last = output.lines().last().unwrap_or_default();
    assert!(
        status.success() && last == ALL_PASSED,
        "the browser test failed ({status}, last line {last:?}):\n{output}"
    );

    // The stream itself went through whole, progress injected.
    let chat = chat.unwrap_or_else(|e| panic!("the chat request: {e}\nscript:\n{output}"));
    let (head, body) = response_body(&chat.response);
    let body = String::from_utf8_lossy(&body);
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    assert!(
        body.contains("\"toolCallProgress\"") && body.trim_end().ends_with("data: [DONE]"),
        "{head}\n\n{body}"
    );

    let png = std::fs::read(&screenshot)
        .unwrap_or_else(|e| panic!("the screenshot {}: {e}\n{output}", screenshot.display()));
    assert!(
        png.starts_with(b"\x89PNG\r\n\x1a\n") && png.len() > 1000,
        "{} is not a PNG:\n{output}",
        screenshot.display()
    );

    // Shown with --nocapture.
    println!("status_page.mjs said:\n{output}");
    // Outside libtest's capture, so it shows in every run.
    let _ = writeln!(
        std::io::stderr(),
        "status page screenshot: {} (stream took {:.1} s)",
        screenshot.display(),
        chat.took.as_secs_f64()
    );
    drop(script);
    drop(serve);
    drop(mock);
}
