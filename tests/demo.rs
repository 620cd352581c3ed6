//! `aalis-proxy demo` (issue 4): the whole path with nothing but the
//! binary — built-in upstream, proxy, client — exits 0 and shows the tools.

use std::process::Command;

fn demo(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_aalis-proxy"))
        .arg("demo")
        .args(args)
        .env_remove("RUST_LOG")
        .env("NO_COLOR", "1")
        .output()
        .expect("demo runs")
}

/// stderr is not a terminal here, so the spinners are plain lines: each
/// tool of each bundled capture shows, then ends with ✓; stdout summarizes
/// what the client received through the proxy.
#[test]
fn the_demo_shows_every_tool_and_exits_0() {
    let output = demo(&["--delay-ms", "1"]);
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "{stdout}\n{stderr}");
    for line in [
        "    tool call get_weather: 47 chars of arguments",
        "    tool call get_local_time: 26 chars of arguments",
        "    tool call get_forecast: 24 chars of arguments",
        "    tool call get_time: 57 chars of arguments",
        "6 tool calls streamed through the proxy, each with progress",
    ] {
        assert!(
            stdout.lines().any(|l| l == line),
            "no {line:?} in:\n{stdout}"
        );
    }
    for tool in [
        "[demo-parallel_tool_calls] get_weather  47 chars",
        "[demo-parallel_tool_calls] get_local_time  26 chars",
        "[demo-reasoning_then_tool] get_weather  33 chars",
        "[demo-thinking_two_tools] get_time  57 chars",
    ] {
        assert!(
            stderr
                .lines()
                .any(|l| l.starts_with("✓ ") && l.contains(tool)),
            "no final line for {tool:?} in:\n{stderr}"
        );
    }
}

/// `--stream` writes the annotated streams themselves.
#[test]
fn the_demo_can_show_the_annotated_streams() {
    let output = demo(&["--delay-ms", "0", "--stream", "--progress=never"]);
    assert!(output.status.success());
    assert!(
        output.stderr.is_empty(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(stdout.contains(r#""toolCallProgress":{"index":1,"name":"get_local_time","#));
    assert!(stdout.contains("data: [DONE]"));
    assert!(stdout.contains(r#""done":true"#), "the Ollama capture too");
}

/// stdout closed by its reader before the demo writes (`| head -0`): the
/// demo ends quietly with status 0, in both modes. Before, its summary
/// line panicked (`println!`, status 101) and its other writes were an
/// error (status 1).
#[test]
fn a_closed_stdout_ends_the_demo_quietly() {
    for extra in [&[][..], &["--stream"][..]] {
        let mut child = Command::new(env!("CARGO_BIN_EXE_aalis-proxy"))
            .args(["demo", "--delay-ms", "0", "--progress=never"])
            .args(extra)
            .env_remove("RUST_LOG")
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .expect("demo runs");
        drop(child.stdout.take());
        let output = child.wait_with_output().expect("demo ends");
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(
            output.status.success(),
            "{extra:?}: {:?}\n{stderr}",
            output.status
        );
        assert!(stderr.is_empty(), "{extra:?}: {stderr}");
    }
}

/// A writer that keeps its first write and then fails, as a closed pipe
/// would: the demo stops there.
struct FirstWrite(Vec<u8>);

impl std::io::Write for FirstWrite {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        if !self.0.is_empty() {
            return Err(std::io::ErrorKind::BrokenPipe.into());
        }
        self.0.extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// `--stream` writes each piece of a stream as it comes: the first thing
/// written is the first capture's start, not the whole of it. (The client
/// collected each body first, so a stream showed only once it had ended.)
#[test]
fn the_demo_streams_as_the_events_come() {
    let options = aalis_proxy::demo::DemoOptions {
        // Far longer than a piece takes to cross the proxy: the first
        // piece is written before the second is sent.
        delay: std::time::Duration::from_millis(300),
        stream: true,
        display: std::sync::Arc::new(aalis_proxy::render::spinner::ProgressDisplay::off()),
    };
    let mut out = FirstWrite(Vec::new());
    let runtime = tokio::runtime::Runtime::new().expect("a runtime");
    let result = runtime.block_on(aalis_proxy::demo::run(options, &mut out));
    let first = String::from_utf8_lossy(&out.0);
    assert!(
        result.is_err_and(|e| e.chain().any(|cause| cause
            .downcast_ref::<std::io::Error>()
            .is_some_and(|e| e.kind() == std::io::ErrorKind::BrokenPipe))),
        "the demo went on past its first write"
    );
    assert!(first.starts_with("data: "), "{first:?}");
    assert!(
        !first.contains("[DONE]"),
        "the whole stream at once: {first:?}"
    );
}
