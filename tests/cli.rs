//! The `aalis-proxy` binary as a user runs it: every way of feeding input,
//! what it prints for each kind of bad input (snapshots of stdout, stderr
//! and exit status), every exit status, the pipe behaviour a Unix filter
//! owes its neighbours (live flushing, quiet broken pipe, SIGINT), and the
//! help text.
//!
//! Every command starts from [`aalis_proxy`], which clears the environment
//! variables that could change what the binary prints. Child processes that
//! stay alive across steps are always waited for with a deadline
//! ([`wait_bounded`], [`LiveStdout::recv_until`]) so a regression fails the
//! test instead of hanging it.

mod common;

use std::io::{BufRead, BufReader, Read, Write};
use std::process::{Child, ChildStdin, ChildStdout, Command, ExitStatus, Stdio};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use common::{fixtures, fixtures_dir};

/// Generous bound for anything a child process is waited for.
const DEADLINE: Duration = Duration::from_secs(20);

/// Bound for one expected piece of output from a live child.
const RECV_TIMEOUT: Duration = Duration::from_secs(10);

/// A small SSE tool-call stream used by the process tests.
const TOOL_CALL_FIXTURE: &str = "openai/single_tool_call.sse";

/// The base command ([`common::base_command`]).
fn aalis_proxy() -> Command {
    common::base_command()
}

/// `aalis-proxy` with `args`.
fn aalis_proxy_with(args: &[&str]) -> Command {
    let mut cmd = aalis_proxy();
    cmd.args(args);
    cmd
}

/// Runs `cmd` to the end with `stdin` as its input (fed from a thread, so a
/// large input cannot deadlock against a full stdout pipe).
fn run_with_stdin(cmd: Command, stdin: &[u8]) -> std::process::Output {
    assert_cmd::Command::from_std(cmd)
        .write_stdin(stdin.to_vec())
        .timeout(DEADLINE)
        .output()
        .expect("run aalis-proxy")
}

/// `annotate` with `args` on `input`, which must exit 0.
fn annotate_ok(args: &[&str], input: &[u8]) -> std::process::Output {
    let output = run_with_stdin(aalis_proxy_with(&[&["annotate"][..], args].concat()), input);
    assert_eq!(output.status.code(), Some(0), "{args:?}");
    output
}

/// Runs `cmd` to the end with no input.
fn run(cmd: Command) -> std::process::Output {
    run_with_stdin(cmd, b"")
}

/// The path of a fixture relative to the package root, as a user types it.
fn fixture_arg(name: &str) -> String {
    format!("fixtures/{name}")
}

fn read_fixture(name: &str) -> Vec<u8> {
    std::fs::read(fixtures_dir().join(name)).expect("read fixture")
}

/// What a person sees after running `args`: the command line, the exit
/// status, stdout and stderr. A missing final newline is marked, since a
/// line format must end every line.
fn transcript(args: &[&str]) -> String {
    let output = run(aalis_proxy_with(args));
    let mut text = format!("$ aalis-proxy {}\n", args.join(" "));
    text.push_str(&describe_status(output.status));
    text.push('\n');
    for (name, bytes) in [("stdout", &output.stdout), ("stderr", &output.stderr)] {
        text.push_str(&format!("--- {name}\n"));
        text.push_str(&String::from_utf8_lossy(bytes));
        if !bytes.is_empty() && !bytes.ends_with(b"\n") {
            text.push_str("[no newline at end]\n");
        }
    }
    text
}

fn describe_status(status: ExitStatus) -> String {
    use std::os::unix::process::ExitStatusExt;
    match (status.code(), status.signal()) {
        (Some(code), _) => format!("exit status: {code}"),
        (None, Some(signal)) => format!("killed by signal {signal}"),
        (None, None) => format!("ended somehow: {status:?}"),
    }
}

/// Waits for `child` at most [`DEADLINE`]; on timeout kills it and fails.
fn wait_bounded(child: &mut Child, what: &str) -> ExitStatus {
    let start = Instant::now();
    loop {
        if let Some(status) = child.try_wait().expect("try_wait") {
            return status;
        }
        if start.elapsed() > DEADLINE {
            let _ = child.kill();
            let _ = child.wait();
            panic!("{what}: aalis-proxy still running after {DEADLINE:?}; killed");
        }
        thread::sleep(Duration::from_millis(10));
    }
}

/// The stdout of a live child, read on a thread and handed over a channel,
/// so the test can wait for bytes with a timeout.
struct LiveStdout {
    chunks: Receiver<Vec<u8>>,
    received: Vec<u8>,
    reader: JoinHandle<()>,
}

impl LiveStdout {
    fn new(mut stdout: ChildStdout) -> Self {
        let (tx, chunks) = mpsc::channel();
        let reader = thread::spawn(move || {
            let mut buf = vec![0u8; 64 * 1024];
            loop {
                match stdout.read(&mut buf) {
                    Ok(0) | Err(_) => break,
                    Ok(n) => {
                        if tx.send(buf[..n].to_vec()).is_err() {
                            break;
                        }
                    }
                }
            }
        });
        LiveStdout {
            chunks,
            received: Vec::new(),
            reader,
        }
    }

    /// Receives until at least `len` bytes have arrived in all; fails if
    /// nothing new arrives for [`RECV_TIMEOUT`] or stdout closes first.
    fn recv_until(&mut self, len: usize, what: &str) {
        while self.received.len() < len {
            match self.chunks.recv_timeout(RECV_TIMEOUT) {
                Ok(chunk) => self.received.extend_from_slice(&chunk),
                Err(RecvTimeoutError::Timeout) => panic!(
                    "{what}: waited {RECV_TIMEOUT:?} for {len} bytes, got {}:\n{}",
                    self.received.len(),
                    String::from_utf8_lossy(&self.received)
                ),
                Err(RecvTimeoutError::Disconnected) => panic!(
                    "{what}: stdout closed after {} of {len} bytes:\n{}",
                    self.received.len(),
                    String::from_utf8_lossy(&self.received)
                ),
            }
        }
    }

    /// Receives until stdout closes; returns everything received.
    fn recv_to_end(mut self, what: &str) -> Vec<u8> {
        loop {
            match self.chunks.recv_timeout(RECV_TIMEOUT) {
                Ok(chunk) => self.received.extend_from_slice(&chunk),
                Err(RecvTimeoutError::Disconnected) => break,
                Err(RecvTimeoutError::Timeout) => {
                    panic!("{what}: stdout still open after {RECV_TIMEOUT:?} without output")
                }
            }
        }
        self.reader.join().expect("stdout reader thread");
        self.received
    }
}

/// The index just past the first blank line (`\n\n`) at or after `from`.
fn end_of_event(bytes: &[u8], from: usize) -> usize {
    bytes[from..]
        .windows(2)
        .position(|w| w == b"\n\n")
        .map(|at| from + at + 2)
        .expect("a complete SSE event")
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack.windows(needle.len()).position(|w| w == needle)
}

// === Input: stdin, FILE and `-` ===

/// For every fixture, the three ways of naming the input (stdin, FILE, `-`)
/// give the same stdout, stderr and status; and `--inject none` gives back
/// the input bytes exactly.
#[test]
fn stdin_file_and_dash_are_the_same_input() {
    let all = fixtures();
    assert!(all.len() >= 10, "fixtures found: {}", all.len());
    for (name, bytes) in all {
        let path = fixture_arg(&name);
        let from_stdin = run_with_stdin(aalis_proxy_with(&["annotate"]), &bytes);
        let from_file = run(aalis_proxy_with(&["annotate", &path]));
        let from_dash = run_with_stdin(aalis_proxy_with(&["annotate", "-"]), &bytes);
        assert!(
            from_stdin.status.success(),
            "{name}: {:?}",
            from_stdin.status
        );
        assert_eq!(from_stdin, from_file, "{name}: stdin vs FILE");
        assert_eq!(from_stdin, from_dash, "{name}: stdin vs -");

        let none = run(aalis_proxy_with(&["annotate", "--inject", "none", &path]));
        assert!(none.status.success(), "{name}: {:?}", none.status);
        assert!(
            none.stdout == bytes,
            "{name}: --inject none changed the bytes:\n{}",
            String::from_utf8_lossy(&none.stdout)
        );
    }
}

// === What the user sees (snapshots) ===

/// `--format ndjson`: one progress per tool-call delta with the UTF-16
/// length of the arguments so far, then one `done` line with the assembled
/// call.
#[test]
fn ndjson_output() {
    let path = fixture_arg(TOOL_CALL_FIXTURE);
    insta::assert_snapshot!(
        "ndjson_single_tool_call",
        transcript(&["annotate", "--format", "ndjson", &path])
    );
}

/// A high surrogate held back at a fragment's end (for the low one the
/// next fragment may start with) is written where it was, before a line of
/// another field or of progress: on the code before, its U+FFFD came after
/// the content and the progress that followed it.
#[test]
fn a_lone_high_surrogate_keeps_its_place_among_the_lines() {
    let event =
        |delta: &str| format!(r#"data: {{"choices":[{{"index":0,"delta":{delta}}}]}}"#) + "\n\n";
    let input = [
        event(r#"{"reasoning_content":"think\ud83d"}"#),
        event(r#"{"content":"Hi \ud83d"}"#),
        event(r#"{"content":"\ude00!"}"#),
        event(r#"{"tool_calls":[{"index":0,"id":"c","function":{"name":"f","arguments":"{}"}}]}"#),
        "data: [DONE]\n\n".to_owned(),
    ]
    .concat();
    let output = annotate_ok(&["--format", "ndjson"], input.as_bytes());
    assert_eq!(
        String::from_utf8_lossy(&output.stdout),
        [
            r#"{"reasoningDelta":"think"}"#,
            "{\"reasoningDelta\":\"\u{FFFD}\"}",
            r#"{"contentDelta":"Hi "}"#,
            "{\"contentDelta\":\"\u{1F600}!\"}",
            r#"{"toolCallProgress":{"index":0,"name":"f","charsAccumulated":2}}"#,
            r#"{"done":true,"toolCalls":[{"id":"c","type":"function","function":{"name":"f","arguments":"{}"}}]}"#,
            "",
        ]
        .join("\n")
    );
}

/// With `n` > 1 the choices take turns: a line of another choice between
/// the halves of a pair leaves the pair joined.
#[test]
fn a_pair_cut_between_a_choices_texts_is_joined_across_another_choice() {
    let event = |choice: u8, content: &str| {
        format!(r#"data: {{"choices":[{{"index":{choice},"delta":{{"content":"{content}"}}}}]}}"#)
            + "\n\n"
    };
    let input = [
        event(0, r"Hi \ud83d"),
        event(1, "x"),
        event(0, r"\ude00!"),
        "data: [DONE]\n\n".to_owned(),
    ]
    .concat();
    let output = annotate_ok(&["--format", "ndjson"], input.as_bytes());
    assert_eq!(
        String::from_utf8_lossy(&output.stdout),
        concat!(
            "{\"contentDelta\":\"Hi \"}\n",
            "{\"contentDelta\":\"x\",\"choice\":1}\n",
            "{\"contentDelta\":\"\u{1F600}!\"}\n",
            "{\"done\":true}\n",
        )
    );
}

/// Events over `--max-event-bytes` are warned about as undecodable ones
/// are: the first ten, then a count of the rest (one warning an event
/// before, however many), and the stream passes unchanged.
#[test]
fn oversized_events_are_warned_about_ten_times_then_counted() {
    let event = "data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"xxxxxxxx\"}}]}\n\n";
    let input = event.repeat(15);
    let output = annotate_ok(&["--max-event-bytes", "10"], input.as_bytes());
    assert_eq!(output.stdout, input.as_bytes());
    let stderr = String::from_utf8_lossy(&output.stderr);
    let lines: Vec<&str> = stderr.lines().collect();
    assert_eq!(lines.len(), 11, "{stderr}");
    assert!(
        lines[..10]
            .iter()
            .all(|l| l.contains("larger than 10 bytes")),
        "{stderr}"
    );
    assert!(
        lines[10].starts_with("aalis-proxy: warning: 5 more frames"),
        "{stderr}"
    );
}

/// `"incomplete":true` in `--format ndjson` marks an answer that may stop
/// in the middle, text or tool call alike: a `finish_reason` (Ollama:
/// `done_reason`) that cuts (`length`, `content_filter`, …), or none and a
/// stream that failed or stopped before `[DONE]`. `[DONE]` without a
/// `finish_reason` is whole (NVIDIA NIM and others send none), and `""`
/// is no reason (Ollama's old `/v1`). On the code before, a call was
/// incomplete whenever its choice had no `finish_reason`, `length` passed
/// as whole, and `""` counted as a finish.
#[test]
fn incomplete_marks_answers_that_may_stop_in_the_middle() {
    let event = |choice: &str| format!("data: {{\"choices\":[{choice}]}}\n\n");
    let text = event(r#"{"index":0,"delta":{"content":"The answer is"}}"#);
    let call = event(
        r#"{"index":0,"delta":{"tool_calls":[{"index":0,"id":"c","function":{"name":"f","arguments":"{\"a\":"}}]}}"#,
    );
    let finish = |reason: &str| {
        event(&format!(
            r#"{{"index":0,"delta":{{}},"finish_reason":{reason}}}"#
        ))
    };
    let done = "data: [DONE]\n\n";
    let error = "data: {\"error\":{\"message\":\"overloaded\"}}\n\n";
    let whole = "{\"done\":true}\n";
    let cut = "{\"done\":true,\"incomplete\":true}\n";
    let call_whole = "\"arguments\":\"{\\\"a\\\":\"}}]}\n";
    let call_cut = "\"arguments\":\"{\\\"a\\\":\"}}],\"incomplete\":true}\n";
    for (input, end) in [
        (text.clone(), cut),
        (format!("{text}{}", finish(r#""stop""#)), whole),
        (format!("{text}{done}"), whole),
        (String::new(), cut),
        // Neither does a body that is no stream (an HTML error page).
        (
            "<html><body>502 Bad Gateway</body></html>\n".to_owned(),
            cut,
        ),
        (format!("{text}{}{done}", finish(r#""length""#)), cut),
        (format!("{text}{}", finish(r#""""#)), cut),
        (format!("{text}{}{done}", finish(r#""""#)), whole),
        (format!("{text}{error}{done}"), cut),
        // Text after the error does not make the answer whole.
        (format!("{text}{error}{text}{done}"), cut),
        (format!("{call}{done}"), call_whole),
        (format!("{call}{}", finish(r#""tool_calls""#)), call_whole),
        (call.clone(), call_cut),
        (format!("{call}{}{done}", finish(r#""length""#)), call_cut),
        (
            format!("{call}{}{done}", finish(r#""content_filter""#)),
            call_cut,
        ),
        (format!("{call}{error}{done}"), call_cut),
        // A provider's named error event is an error too.
        (
            format!("{call}event: error\ndata: {{\"error\":{{\"message\":\"boom\"}}}}\n\n{done}"),
            call_cut,
        ),
        (format!("{error}{call}{done}"), call_cut),
    ] {
        let output = annotate_ok(&["--format", "ndjson"], input.as_bytes());
        let stdout = String::from_utf8_lossy(&output.stdout);
        assert!(stdout.ends_with(end), "{input:?}: {stdout}");
    }
    // Ollama's done line, by its `done_reason`.
    let line = |reason: &str| {
        format!(
            "{{\"message\":{{\"role\":\"assistant\",\"content\":\"Hi\"}},\"done\":false}}\n\
             {{\"message\":{{\"role\":\"assistant\",\"content\":\"\"}},\"done_reason\":\"{reason}\",\"done\":true}}\n"
        )
    };
    for (reason, incomplete) in [("stop", false), ("length", true)] {
        let output = annotate_ok(&["--format", "ndjson"], line(reason).as_bytes());
        let stdout = String::from_utf8_lossy(&output.stdout);
        let last = stdout.lines().last().unwrap_or_default();
        assert!(last.starts_with("{\"done\":true"), "{reason}: {stdout}");
        assert_eq!(
            last.contains("\"incomplete\":true"),
            incomplete,
            "{reason}: {stdout}"
        );
    }
}

/// A choice other than 0 cut short makes the stream's one `done` line
/// `incomplete` in `messages`, and in `ndjson` when no choice made calls
/// (its one line speaks for every choice); so do calls refused past the
/// stream's limit of 1,024, which the `done` line's `toolCalls` lack.
/// Before, only choice 0's text and the choices with calls were read, and
/// refused calls went unsaid.
#[test]
fn any_choice_cut_short_or_calls_refused_make_the_done_line_incomplete() {
    let choices = |a: &str, b: &str| format!("data: {{\"choices\":[{a},{b}]}}\n\n");
    let text = |k: u8| format!(r#"{{"index":{k},"delta":{{"content":"hi"}}}}"#);
    let finish =
        |k: u8, reason: &str| format!(r#"{{"index":{k},"delta":{{}},"finish_reason":"{reason}"}}"#);
    let call = r#"{"index":0,"delta":{"tool_calls":[{"index":0,"id":"c","function":{"name":"f","arguments":"{}"}}]}}"#;
    let done = "data: [DONE]\n\n";
    let two_texts = |reason: &str| {
        format!(
            "{}{}{done}",
            choices(&text(0), &text(1)),
            choices(&finish(0, "stop"), &finish(1, reason))
        )
    };
    let calls_and_text = |reason: &str| {
        format!(
            "{}{}{done}",
            choices(call, &text(1)),
            choices(&finish(0, "tool_calls"), &finish(1, reason))
        )
    };
    let messages = &["--format", "messages", "--session", "s"][..];
    let ndjson = &["--format", "ndjson"][..];
    for (format, input, cut) in [
        (messages, two_texts("stop"), false),
        (messages, two_texts("length"), true),
        (messages, two_texts("content_filter"), true),
        (messages, calls_and_text("stop"), false),
        (messages, calls_and_text("length"), true),
        (ndjson, two_texts("stop"), false),
        (ndjson, two_texts("length"), true),
    ] {
        let output = annotate_ok(format, input.as_bytes());
        let stdout = String::from_utf8_lossy(&output.stdout);
        let last = stdout.lines().last().unwrap_or_default();
        assert_eq!(
            last.contains("\"incomplete\":true"),
            cut,
            "{format:?} {input:?}: {stdout}"
        );
    }
    // 1,030 calls, each whole: the last six are refused.
    let mut many = String::new();
    for i in 0..1030 {
        many.push_str(&format!(
            "data: {{\"choices\":[{{\"index\":0,\"delta\":{{\"tool_calls\":[{{\"index\":{i},\"id\":\"c{i}\",\"function\":{{\"name\":\"f\",\"arguments\":\"x\"}}}}]}}}}]}}\n\n"
        ));
    }
    many.push_str(&finish_all(done));
    for format in [ndjson, messages] {
        let output = annotate_ok(format, many.as_bytes());
        let stdout = String::from_utf8_lossy(&output.stdout);
        let last = stdout.lines().last().unwrap_or_default();
        let tail = &last[last.len().saturating_sub(80)..];
        assert!(last.contains("\"incomplete\":true"), "{format:?}: …{tail}");
    }
    fn finish_all(done: &str) -> String {
        format!(
            "data: {{\"choices\":[{{\"index\":0,\"delta\":{{}},\"finish_reason\":\"tool_calls\"}}]}}\n\n{done}"
        )
    }
}

/// A JSON value spread over lines (a pretty-printed error body, as
/// `curl` gets one for a bad key) is read as one value: the upstream's
/// error, said once, and its one `error` line (it was eight `unparsed`
/// lines and two warnings about JSON that ends early and lines that are
/// no object). Lines that cannot join it are read one by one, as before:
/// a line cut inside a string, then whole lines; or a value that never
/// ends.
#[test]
fn a_value_spread_over_lines_is_read_whole() {
    let body =
        std::fs::read(common::fixtures_dir().join("malformed/pretty_printed_error_body.ndjson"))
            .expect("the fixture");
    let output = annotate_ok(&["--format", "ndjson"], &body);
    let stdout = String::from_utf8_lossy(&output.stdout);
    let lines: Vec<&str> = stdout.lines().collect();
    assert_eq!(lines.len(), 2, "{stdout}");
    let error: serde_json::Value = serde_json::from_str(lines[0]).expect("a JSON line");
    assert_eq!(error["error"]["code"], "invalid_api_key", "{stdout}");
    assert_eq!(lines[1], r#"{"done":true,"incomplete":true}"#);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(stderr.lines().count(), 1, "{stderr}");
    assert!(
        stderr.contains("upstream error: Incorrect API key provided"),
        "{stderr}"
    );
    // The bytes themselves pass unchanged.
    assert_eq!(annotate_ok(&[], &body).stdout, body);

    let cut_then_whole =
        b"{\"message\":{\"content\":\"hel\n{\"message\":{\"content\":\"lo\"},\"done\":false}\n{\"done\":true}\n";
    let output = annotate_ok(&["--format", "ndjson"], cut_then_whole);
    assert_eq!(
        String::from_utf8_lossy(&output.stdout),
        "{\"unparsed\":\"{\\\"message\\\":{\\\"content\\\":\\\"hel\"}\n\
         {\"contentDelta\":\"lo\"}\n{\"done\":true,\"incomplete\":true}\n"
    );
    // A line cut after `:` leaves a value open that the good line after
    // it could continue: a whole value of its own, that line is read as
    // itself, and its call gets its progress (it was taken into the cut
    // line's value, and got none).
    let cut_after_colon = concat!(
        "{\"model\":\"m\",\"message\":{\"tool_calls\":[\n",
        "{\"model\":\"m\",\"message\":{\"role\":\"assistant\",\"content\":\"\",\"tool_calls\":",
        "[{\"function\":{\"name\":\"get_weather\",\"arguments\":{\"city\":\"Paris\"}}}]},\"done\":false}\n",
        "{\"model\":\"m\",\"message\":{\"role\":\"assistant\",\"content\":\"\"},\"done\":true}\n",
    );
    let output = annotate_ok(&[], cut_after_colon.as_bytes());
    let stdout = String::from_utf8_lossy(&output.stdout);
    let second = stdout.lines().nth(1).unwrap_or_default();
    assert!(
        second.ends_with(r#""done":false,"toolCallProgress":{"index":0,"name":"get_weather","charsAccumulated":16}}"#),
        "{stdout}"
    );
    let never_ends = b"{\n  \"a\": 1,\n";
    let output = annotate_ok(&["--format", "ndjson"], never_ends);
    assert_eq!(
        String::from_utf8_lossy(&output.stdout),
        "{\"unparsed\":\"{\"}\n{\"unparsed\":\"  \\\"a\\\": 1,\"}\n{\"done\":true,\"incomplete\":true}\n"
    );
}

/// `"finish_reason":""` on every chunk (Ollama's old `/v1`) is no finish:
/// `--inject chunk` adds its progress chunk after such an event, as after
/// any other. (It added none: every chunk looked like the finish chunk.)
#[test]
fn an_empty_finish_reason_does_not_stop_chunk_injection() {
    let input = concat!(
        "data: {\"id\":\"chatcmpl-1\",\"object\":\"chat.completion.chunk\",\"created\":1,\"model\":\"m\",",
        "\"choices\":[{\"index\":0,\"delta\":{\"tool_calls\":[{\"index\":0,\"id\":\"c\",",
        "\"function\":{\"name\":\"f\",\"arguments\":\"{}\"}}]},\"finish_reason\":\"\"}]}\n\n",
    );
    let output = annotate_ok(&["--inject", "chunk"], input.as_bytes());
    let stdout = String::from_utf8_lossy(&output.stdout);
    let added = stdout
        .strip_prefix(input)
        .expect("the event first, unchanged");
    assert!(
        added.starts_with("data: {\"id\":\"chatcmpl-1\"")
            && added.contains(
                "\"toolCallProgress\":{\"index\":0,\"name\":\"f\",\"charsAccumulated\":2}"
            ),
        "{stdout}"
    );
}

/// Gemini's OpenAI-compatible stream carries `usage` on every chunk:
/// `--inject chunk` adds a progress chunk after each of its four tool
/// deltas as after any other, and none after its finish chunk. (It added
/// none at all: every chunk was taken for the usage chunk, which comes
/// last and has no choices.)
#[test]
fn chunks_with_usage_beside_their_choices_get_progress_chunks() {
    let input = std::fs::read(common::fixtures_dir().join("gemini/no_index.sse")).expect("fixture");
    let output = annotate_ok(&["--inject", "chunk"], &input);
    let stdout = String::from_utf8_lossy(&output.stdout);
    let events: Vec<&str> = stdout.split_terminator("\n\n").collect();
    let added: Vec<usize> = events
        .iter()
        .enumerate()
        .filter(|(_, e)| e.contains("\"choices\":[],\"toolCallProgress\""))
        .map(|(k, _)| k)
        .collect();
    // Each right after the delta it counts: events 1, 3, 5 and 7.
    assert_eq!(added, [1, 3, 5, 7], "{stdout}");
    assert!(
        events[7].contains("{\"index\":1,\"name\":\"get_weather\",\"charsAccumulated\":37}"),
        "{}",
        events[7]
    );
    assert!(
        events[8].contains("\"finish_reason\":\"stop\""),
        "{}",
        events[8]
    );
    assert_eq!(events[9..], ["data: [DONE]"], "{stdout}");
}

/// A chunk whose `reasoning` (or `usage`, or another field progress does
/// not need) has an unexpected shape keeps its tool delta: the call's
/// first delta, name and all, counts, the field is reported once for
/// the stream, with its place, and the line formats carry a frame left
/// without a line of its own whole, as an `unparsed` line (nothing is
/// lost, nothing told twice). Before, the whole chunk was undecodable,
/// and the call went on without a name.
#[test]
fn an_odd_field_costs_its_chunk_nothing_else() {
    let input = concat!(
        "data: {\"choices\":[{\"index\":0,\"delta\":{\"reasoning\":{\"text\":\"x\"},",
        "\"tool_calls\":[{\"index\":0,\"id\":\"c\",\"function\":{\"name\":\"f\",\"arguments\":\"ab\"}}]}}]}\n\n",
        "data: {\"choices\":[{\"index\":0,\"delta\":{\"reasoning\":{\"text\":\"y\"}}}]}\n\n",
        "data: {\"choices\":[{\"index\":0,\"delta\":{\"tool_calls\":[{\"index\":0,\"function\":{\"arguments\":\"cd\"}}]}}]}\n\n",
        "data: [DONE]\n\n",
    );
    let output = annotate_ok(&["--format", "ndjson"], input.as_bytes());
    assert_eq!(
        String::from_utf8_lossy(&output.stdout),
        concat!(
            "{\"toolCallProgress\":{\"index\":0,\"name\":\"f\",\"charsAccumulated\":2}}\n",
            // No line of its own: the frame, whole.
            "{\"unparsed\":\"{\\\"choices\\\":[{\\\"index\\\":0,\\\"delta\\\":",
            "{\\\"reasoning\\\":{\\\"text\\\":\\\"y\\\"}}}]}\"}\n",
            "{\"toolCallProgress\":{\"index\":0,\"name\":\"f\",\"charsAccumulated\":4}}\n",
            "{\"done\":true,\"toolCalls\":[{\"id\":\"c\",\"type\":\"function\",",
            "\"function\":{\"name\":\"f\",\"arguments\":\"abcd\"}}]}\n",
        )
    );
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(
        stderr.lines().collect::<Vec<_>>(),
        [
            "aalis-proxy: warning: SSE event 1 (byte 0): `delta.reasoning` is not of the shape \
             expected, so it is passed over and the rest of the frame read (a frame left without \
             a line of its own becomes an unparsed line); later such fields of the stream \
             likewise, without a warning: {\"text\":\"x\"}"
        ],
        "{stderr}"
    );
    // In SSE, every byte as it came, and the same warning but for the line.
    let output = annotate_ok(&[], input.as_bytes());
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert_eq!(stdout.matches("toolCallProgress").count(), 2, "{stdout}");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("the rest of the frame read; later such fields"),
        "{stderr}"
    );
}

/// A JSON object with none of a chunk's keys (another API's stream, here
/// a native Workers AI one) is reported, with its place, and becomes an
/// `unparsed` line; vLLM's older error object is an upstream error. (Both
/// vanished from the line formats without a word.)
#[test]
fn objects_that_are_no_chunks_are_reported() {
    let input = concat!(
        "data: {\"object\":\"error\",\"message\":\"prompt too long\",\"code\":400}\n\n",
        "data: {\"response\":\"Hi\"}\n\n",
        "data: [DONE]\n\n",
    );
    let output = annotate_ok(&["--format", "ndjson"], input.as_bytes());
    assert_eq!(
        String::from_utf8_lossy(&output.stdout),
        concat!(
            "{\"error\":{\"object\":\"error\",\"message\":\"prompt too long\",\"code\":400}}\n",
            "{\"unparsed\":\"{\\\"response\\\":\\\"Hi\\\"}\"}\n",
            "{\"done\":true,\"incomplete\":true}\n",
        )
    );
    assert_eq!(
        String::from_utf8_lossy(&output.stderr),
        concat!(
            "aalis-proxy: warning: SSE event 1 (byte 0): upstream error: prompt too long\n",
            "aalis-proxy: warning: SSE event 2 (byte 65): a JSON object without `choices`, ",
            "`usage` or `error`, so no chat chunk; passed on as an unparsed line (so are the ",
            "stream's later ones, without a warning): {\"response\":\"Hi\"}\n",
        )
    );
    let output = annotate_ok(&[], input.as_bytes());
    assert_eq!(output.stdout, input.as_bytes());
}

/// A stream of another API's objects (Ollama's `/api/pull` progress, each
/// line a `{"status":…}`) is said once, not once a line: through `serve`,
/// every pull wrote ten warnings and a count. Each line is still an
/// `unparsed` line of the line formats, and passed on as it is.
#[test]
fn a_stream_of_objects_that_are_no_chunks_is_said_once() {
    let input: String = (0..17)
        .map(|i| format!("{{\"status\":\"pulling {i}\",\"completed\":{i}}}\n"))
        .collect();
    let output = annotate_ok(&["--format", "ndjson"], input.as_bytes());
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert_eq!(stdout.matches("\"unparsed\"").count(), 17, "{stdout}");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(stderr.lines().count(), 1, "{stderr}");
    assert!(
        stderr.contains("NDJSON line 1 (byte 0): a JSON object without `message`")
            && stderr.contains("so are the stream's later ones, without a warning"),
        "{stderr}"
    );
    let output = annotate_ok(&[], input.as_bytes());
    assert_eq!(output.stdout, input.as_bytes());
    assert_eq!(String::from_utf8_lossy(&output.stderr).lines().count(), 1);
}

/// A provider's named event (`event: error` here) reaches the line
/// formats as an `unparsed` line, with a warning (for an `event: error`,
/// that the upstream failed; for another, that names it); our own
/// `toolCallProgress` events, from a stream annotated before, are left
/// out (the lines give progress afresh). `--format sse` passes both on
/// untouched. (The line formats dropped the error without a word, and the
/// stream looked clean.)
#[test]
fn named_events_reach_the_line_formats() {
    let input = concat!(
        "data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"Hi\"}}]}\n\n",
        "event: error\ndata: {\"error\":{\"message\":\"overloaded\"}}\n\n",
        "event: toolCallProgress\ndata: {\"index\":0}\n\n",
    );
    let output = annotate_ok(&["--format", "ndjson"], input.as_bytes());
    assert_eq!(
        String::from_utf8_lossy(&output.stdout),
        concat!(
            "{\"contentDelta\":\"Hi\"}\n",
            "{\"unparsed\":\"{\\\"error\\\":{\\\"message\\\":\\\"overloaded\\\"}}\"}\n",
            "{\"done\":true,\"incomplete\":true}\n",
        )
    );
    assert_eq!(
        String::from_utf8_lossy(&output.stderr),
        "aalis-proxy: warning: SSE event 2 (byte 58): upstream error: \
         {\"error\":{\"message\":\"overloaded\"}}\n"
    );
    let output = annotate_ok(&[], input.as_bytes());
    assert_eq!(output.stdout, input.as_bytes());
}

/// A named event (a keep-alive `ping`) between the halves of a surrogate
/// pair leaves the pair whole in the line formats, and one after `[DONE]`
/// is left out with the after-the-end warning, as data would be. (The
/// first version wrote two U+FFFD around the ping's line, and dropped the
/// late event without a word.)
#[test]
fn named_events_leave_the_text_whole_and_the_end_last() {
    let input = concat!(
        "data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"a\\ud83d\"}}]}\n\n",
        "event: ping\ndata: {}\n\n",
        "data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"\\ude00b\"}}]}\n\n",
        "data: [DONE]\n\n",
        "event: error\ndata: {}\n\n",
    );
    let output = annotate_ok(&["--format", "ndjson"], input.as_bytes());
    assert_eq!(
        String::from_utf8_lossy(&output.stdout),
        concat!(
            "{\"contentDelta\":\"a\"}\n",
            "{\"unparsed\":\"{}\"}\n",
            "{\"contentDelta\":\"\u{1F600}b\"}\n",
            "{\"done\":true}\n",
        )
    );
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(stderr.lines().count(), 2, "{stderr}");
    assert!(
        stderr.contains("SSE event 5 (byte 162): data after the end of the stream"),
        "{stderr}"
    );
}

/// A call whose fragment came in an event too large to read ends in a done
/// line that says `incomplete`, though its choice finished and the stream
/// ended with `[DONE]`: its arguments lack that fragment (before, they
/// were given as whole). A stream of events all read stays whole.
#[test]
fn a_done_line_after_an_unread_event_says_incomplete() {
    let first = "data: {\"choices\":[{\"index\":0,\"delta\":{\"tool_calls\":[{\"index\":0,\"id\":\"c\",\"function\":{\"name\":\"f\",\"arguments\":\"{\\\"a\\\":\"}}]}}]}\n\n";
    let large = format!(
        "data: {{\"choices\":[{{\"index\":0,\"delta\":{{\"tool_calls\":[{{\"index\":0,\"function\":{{\"arguments\":\"\\\"{}\\\"}}\"}}}}]}}}}]}}\n\n",
        "x".repeat(300)
    );
    let end = "data: {\"choices\":[{\"index\":0,\"delta\":{},\"finish_reason\":\"tool_calls\"}]}\n\ndata: [DONE]\n\n";
    let input = format!("{first}{large}{end}");
    let output = annotate_ok(
        &["--format", "ndjson", "--max-event-bytes", "256"],
        input.as_bytes(),
    );
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    let done = stdout.lines().last().unwrap_or_default();
    assert!(done.contains(r#""arguments":"{\"a\":""#), "{stdout}");
    assert!(done.ends_with(r#","incomplete":true}"#), "{stdout}");
    // Read whole, the same stream is whole; and so it is beside frames
    // that are no chunk (another API's ping, a number), which held nothing
    // of an answer.
    for extra in ["", "data: {\"type\":\"ping\"}\n\ndata: 42\n\n"] {
        let input = format!("{first}{extra}{large}{end}");
        let output = annotate_ok(&["--format", "ndjson"], input.as_bytes());
        let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
        let done = stdout.lines().last().unwrap_or_default();
        assert!(!done.contains("incomplete"), "{stdout}");
    }
}

/// The line formats lose nothing either: an upstream's mid-stream error is
/// an `error` line holding its `error` value (on one line, though the
/// event spread it over two `data:` lines), and an event that cannot be
/// read an `unparsed` line holding its data. On the code before, both were
/// only warned about, and the `done` line made the failed stream look
/// whole. What comes after `[DONE]` is left out (the done line stays
/// last), and the warning says so.
#[test]
fn the_line_formats_pass_on_errors_and_what_they_cannot_read() {
    let input = concat!(
        "data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"Hi\"}}]}\n\n",
        "data: {\"error\":\ndata: {\"message\":\"overloaded\",\"type\":\"server_error\"}}\n\n",
        "data: {bad\n\n",
        "data: [DONE]\n\n",
        "data: late\n\n",
    );
    let output = annotate_ok(&["--format", "ndjson"], input.as_bytes());
    assert_eq!(
        String::from_utf8_lossy(&output.stdout),
        concat!(
            "{\"contentDelta\":\"Hi\"}\n",
            "{\"error\":{\"message\":\"overloaded\",\"type\":\"server_error\"}}\n",
            "{\"unparsed\":\"{bad\"}\n",
            // The error cut the answer short.
            "{\"done\":true,\"incomplete\":true}\n",
        )
    );
    assert!(
        String::from_utf8_lossy(&output.stderr).contains(
            "SSE event 5 (byte 155): data after the end of the stream ([DONE]); left out of the \
             lines (--format), not tracked"
        ),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let ollama = "{\"message\":{\"content\":\"a\"}}\n{\"error\":\"boom\"}\n";
    let output = annotate_ok(
        &["--format", "messages", "--session", "s"],
        ollama.as_bytes(),
    );
    assert_eq!(
        String::from_utf8_lossy(&output.stdout),
        concat!(
            "{\"sessionId\":\"s\",\"contentDelta\":\"a\"}\n",
            "{\"sessionId\":\"s\",\"error\":\"boom\"}\n",
            // Cut short by the error, as the ndjson format's done line says
            // (the messages line did not say so before).
            "{\"sessionId\":\"s\",\"done\":true,\"incomplete\":true}\n",
        )
    );
    // An event too large to parse cannot be a line: the warning says it is
    // left out, not that it was passed on.
    let long = "data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"a long one\"}}]}\n\n";
    let output = annotate_ok(
        &["--format", "ndjson", "--max-event-bytes", "16"],
        long.as_bytes(),
    );
    assert_eq!(
        String::from_utf8_lossy(&output.stdout),
        "{\"done\":true,\"incomplete\":true}\n"
    );
    assert_eq!(
        String::from_utf8_lossy(&output.stderr),
        "aalis-proxy: warning: SSE event 1 (byte 0): larger than 16 bytes (--max-event-bytes); \
         left out of the lines (--format), not parsed\n"
    );
}

/// `--format messages --session chat-42` on Ollama's NDJSON: reasoning
/// deltas, one progress per whole tool call, `done`, each with the session.
#[test]
fn messages_output_for_ollama() {
    let path = fixture_arg("ollama/thinking_two_tools.ndjson");
    insta::assert_snapshot!(
        "messages_ollama_thinking_two_tools",
        transcript(&[
            "annotate",
            "--format",
            "messages",
            "--session",
            "chat-42",
            &path
        ])
    );
}

/// An event that is not valid JSON is passed on unchanged, reported once on
/// stderr with its SSE event number and byte offset, and tracking goes on;
/// the exit status is 0.
#[test]
fn bad_json_event_is_passed_on_and_reported() {
    let path = fixture_arg("malformed/bad_json_event.sse");
    insta::assert_snapshot!("bad_json_event", transcript(&["annotate", &path]));
}

/// A file that does not exist: status 1, and the message names the path as
/// the user typed it.
#[test]
fn missing_file_is_status_1() {
    insta::assert_snapshot!(
        "missing_file",
        transcript(&["annotate", "fixtures/openai/does_not_exist.sse"])
    );
}

/// `mock -`: a capture cannot come from standard input (mock serves each
/// one again at every request, named by its file); it was "cannot read
/// -: No such file or directory".
#[test]
fn mock_refuses_standard_input_and_says_why() {
    insta::assert_snapshot!("mock_stdin", transcript(&["mock", "-"]));
}

/// An unknown flag is a usage error: status 2, clap's message.
#[test]
fn unknown_flag_is_status_2() {
    insta::assert_snapshot!("unknown_flag", transcript(&["annotate", "--bogus"]));
}

/// `--session` means nothing outside `--format messages`: status 2.
#[test]
fn session_without_messages_is_status_2() {
    insta::assert_snapshot!(
        "session_without_messages",
        transcript(&[
            "annotate",
            "--session",
            "chat-42",
            "fixtures/openai/single_tool_call.sse"
        ])
    );
}

/// `--format messages` needs `--session`: status 2.
#[test]
fn messages_without_session_is_status_2() {
    insta::assert_snapshot!(
        "messages_without_session",
        transcript(&["annotate", "--format", "messages"])
    );
}

/// A bad `--inject` value is a usage error listing the possible values:
/// status 2.
#[test]
fn bad_inject_value_is_status_2() {
    insta::assert_snapshot!(
        "bad_inject_value",
        transcript(&["annotate", "--inject", "bogus"])
    );
}

// === Exit status 1: read and write failures ===

/// A stdin left non-blocking by the process that started `annotate` (its
/// pipe's description is shared; Node does this) has nothing for a while:
/// that is no end. Both events come through, and the status is 0. (The
/// first `EAGAIN` ended the stream: a `done` line, then "cannot read
/// stdin: Resource temporarily unavailable", status 1.)
#[cfg(target_os = "linux")]
#[test]
fn a_non_blocking_stdin_is_waited_for() {
    use rustix::fs::{OFlags, fcntl_getfl, fcntl_setfl};
    // Close-on-exec: the child gets the read end as its stdin alone (with
    // the write end too, it would never see the input's end).
    let (read, write) = rustix::pipe::pipe_with(rustix::pipe::PipeFlags::CLOEXEC).expect("pipe");
    fcntl_setfl(&read, fcntl_getfl(&read).expect("flags") | OFlags::NONBLOCK).expect("O_NONBLOCK");
    let mut child = aalis_proxy_with(&["annotate", "--format", "ndjson"])
        .stdin(std::fs::File::from(read))
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn annotate");
    let mut write = std::fs::File::from(write);
    let event = |text: &str| {
        format!(r#"data: {{"choices":[{{"index":0,"delta":{{"content":"{text}"}}}}]}}"#) + "\n\n"
    };
    write.write_all(event("a").as_bytes()).expect("write");
    // The first event's line is out: annotate has read all there was, and
    // its next read finds the pipe empty.
    let mut stdout = BufReader::new(child.stdout.take().expect("stdout"));
    let mut first = String::new();
    stdout.read_line(&mut first).expect("the first line");
    assert_eq!(first, "{\"contentDelta\":\"a\"}\n");
    thread::sleep(Duration::from_millis(100));
    write.write_all(event("b").as_bytes()).expect("write");
    drop(write);
    let mut rest = String::new();
    stdout.read_to_string(&mut rest).expect("the rest");
    let output = child.wait_with_output().expect("annotate ends");
    assert_eq!(
        rest,
        "{\"contentDelta\":\"b\"}\n{\"done\":true,\"incomplete\":true}\n",
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    assert_eq!(output.status.code(), Some(0));
}

/// A stdout left non-blocking, and full (its reader away for a while):
/// waited for, and everything comes out. (The first `EAGAIN` failed the
/// run: "cannot write the output: Resource temporarily unavailable".)
#[cfg(target_os = "linux")]
#[test]
fn a_non_blocking_stdout_is_waited_for() {
    use rustix::fs::{OFlags, fcntl_getfl, fcntl_setfl};
    let (read, write) = rustix::pipe::pipe_with(rustix::pipe::PipeFlags::CLOEXEC).expect("pipe");
    fcntl_setfl(
        &write,
        fcntl_getfl(&write).expect("flags") | OFlags::NONBLOCK,
    )
    .expect("O_NONBLOCK");
    let input =
        "data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"x\"}}]}\n\n".repeat(40_000);
    let path = std::env::temp_dir().join(format!("aalis-nonblocking-{}.sse", std::process::id()));
    std::fs::write(&path, &input).expect("write the input");
    let mut child = aalis_proxy_with(&["annotate", "--inject", "none"])
        .arg(&path)
        .stdout(std::fs::File::from(write))
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn annotate");
    // Away long enough for the pipe to fill.
    thread::sleep(Duration::from_millis(300));
    let mut got = Vec::new();
    std::fs::File::from(read)
        .read_to_end(&mut got)
        .expect("read");
    let status = child.wait().expect("annotate ends");
    let _ = std::fs::remove_file(&path);
    assert_eq!(status.code(), Some(0));
    assert!(
        got == input.as_bytes(),
        "{} of {} bytes",
        got.len(),
        input.len()
    );
}

/// A directory given as the input: status 1 and a clear error, before
/// anything is written, in every format. (It opened, and failed at its
/// first read, after `--format ndjson` had written its `done` line: a
/// consumer of stdout saw a stream that ended well.)
#[test]
fn a_directory_is_refused_before_anything_is_written() {
    for format in ["sse", "ndjson"] {
        let output = run(aalis_proxy_with(&[
            "annotate", "--format", format, "fixtures",
        ]));
        assert_eq!(output.status.code(), Some(1), "{format}");
        assert!(output.stdout.is_empty(), "{format}");
        assert_eq!(
            String::from_utf8_lossy(&output.stderr),
            "aalis-proxy: error: cannot open fixtures: it is a directory\n",
            "{format}"
        );
    }
}

/// An input that opens but cannot be read (`/proc/self/mem` at offset 0):
/// status 1, and the error says its cause once.
/// With a line format, nothing is written: no done line tells a consumer
/// the stream ended well (one was). So for a stdin that is a directory.
#[cfg(target_os = "linux")]
#[test]
fn read_error_names_its_cause_once() {
    for format in ["sse", "ndjson", "messages"] {
        let args: Vec<&str> = match format {
            "messages" => vec![
                "annotate",
                "--format",
                format,
                "--session",
                "s",
                "/proc/self/mem",
            ],
            _ => vec!["annotate", "--format", format, "/proc/self/mem"],
        };
        let output = run(aalis_proxy_with(&args));
        assert_eq!(output.status.code(), Some(1), "{format}");
        assert!(output.stdout.is_empty(), "{format}");
        assert_eq!(
            String::from_utf8_lossy(&output.stderr),
            "aalis-proxy: error: cannot read /proc/self/mem: Input/output error (os error 5)\n",
            "{format}"
        );
    }
    let output = aalis_proxy_with(&["annotate", "--format", "ndjson"])
        .stdin(std::fs::File::open("fixtures").expect("open the directory"))
        .output()
        .expect("run annotate");
    assert_eq!(output.status.code(), Some(1));
    assert!(output.stdout.is_empty());
    assert_eq!(
        String::from_utf8_lossy(&output.stderr),
        "aalis-proxy: error: cannot read stdin: Is a directory (os error 21)\n"
    );
}

/// An output that cannot be written (`/dev/full`): status 1 and an error,
/// unlike a broken pipe.
#[cfg(target_os = "linux")]
#[test]
fn unwritable_output_is_status_1() {
    let full = std::fs::OpenOptions::new()
        .write(true)
        .open("/dev/full")
        .expect("open /dev/full");
    let mut cmd = aalis_proxy_with(&["annotate", &fixture_arg(TOOL_CALL_FIXTURE)]);
    cmd.stdout(full);
    let output = cmd.output().expect("run aalis-proxy");
    assert_eq!(output.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.starts_with("aalis-proxy: error: cannot write the output: No space left on device"),
        "{stderr}"
    );
}

/// The write error says its cause once.
#[cfg(target_os = "linux")]
#[test]
fn write_error_names_its_cause_once() {
    let full = std::fs::OpenOptions::new()
        .write(true)
        .open("/dev/full")
        .expect("open /dev/full");
    let mut cmd = aalis_proxy_with(&["annotate", &fixture_arg(TOOL_CALL_FIXTURE)]);
    cmd.stdout(full);
    let output = cmd.output().expect("run aalis-proxy");
    assert_eq!(
        String::from_utf8_lossy(&output.stderr),
        "aalis-proxy: error: cannot write the output: No space left on device (os error 28)\n"
    );
}

/// `--help` and `demo` say so too, with status 1: the help's failed write
/// was ignored (status 0, nothing said), and `demo` named only the cause.
#[cfg(target_os = "linux")]
#[test]
fn help_and_demo_report_an_unwritable_output() {
    for args in [
        &["--help"][..],
        &["annotate", "--help"],
        &["demo", "--delay-ms", "0", "--progress=never"],
    ] {
        let full = std::fs::OpenOptions::new()
            .write(true)
            .open("/dev/full")
            .expect("open /dev/full");
        let mut cmd = aalis_proxy_with(args);
        cmd.stdout(full);
        let output = cmd.output().expect("run aalis-proxy");
        assert_eq!(
            String::from_utf8_lossy(&output.stderr),
            "aalis-proxy: error: cannot write the output: No space left on device (os error 28)\n",
            "{args:?}"
        );
        assert_eq!(output.status.code(), Some(1), "{args:?}");
    }
}

/// An argument that is not UTF-8 is a usage error like any other: one
/// line and status 2 (the usage error's own message panicked on it,
/// status 101).
#[cfg(unix)]
#[test]
fn an_argument_that_is_not_utf8_is_a_usage_error() {
    use std::os::unix::ffi::OsStrExt;
    let output = aalis_proxy()
        .args(["annotate", "--format", "messages", "--session"])
        .arg(std::ffi::OsStr::from_bytes(b"\xff"))
        .stdin(Stdio::null())
        .output()
        .expect("run aalis-proxy");
    assert_eq!(output.status.code(), Some(2));
    assert_eq!(
        String::from_utf8_lossy(&output.stderr),
        "aalis-proxy: error: invalid UTF-8 was detected in one or more arguments \
         (see 'aalis-proxy annotate --help')\n"
    );
}

// === Pipes and signals ===

/// stdout closed by its reader (`| head -1`) ends `annotate` quietly:
/// status 0, nothing on stderr, even with ~20 MB of input still coming.
#[test]
fn broken_pipe_is_quiet_success() {
    // A stream without `[DONE]`, so repeating it is one long stream (after
    // a `[DONE]`, more data would rightly be warned about).
    let fixture = read_fixture("openai/no_done.sse");
    let input = fixture.repeat(20 * 1024 * 1024 / fixture.len() + 1);

    let mut child = aalis_proxy_with(&["annotate"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn aalis-proxy");
    let mut stdin = child.stdin.take().expect("piped stdin");
    let writer = thread::spawn(move || {
        // Fails with BrokenPipe once aalis-proxy has exited: expected.
        let _ = stdin.write_all(&input);
    });

    let mut stdout = BufReader::new(child.stdout.take().expect("piped stdout"));
    let mut first_line = String::new();
    stdout
        .read_line(&mut first_line)
        .expect("read the first line");
    assert!(first_line.starts_with("data: {"), "{first_line:?}");
    drop(stdout);

    let status = wait_bounded(&mut child, "after closing stdout");
    writer.join().expect("stdin writer thread");
    let mut stderr = String::new();
    child
        .stderr
        .take()
        .expect("piped stderr")
        .read_to_string(&mut stderr)
        .expect("read stderr");
    assert_eq!(
        status.code(),
        Some(0),
        "{}; stderr: {stderr}",
        describe_status(status)
    );
    assert_eq!(stderr, "");
}

/// `annotate` of the tool-call fixture with its input fed live: the fixture,
/// the output for the file read at once, and a child reading a pipe.
struct LiveAnnotate {
    input: Vec<u8>,
    whole: Vec<u8>,
    child: Child,
    stdin: ChildStdin,
    output: LiveStdout,
}

impl LiveAnnotate {
    fn start() -> Self {
        let input = read_fixture(TOOL_CALL_FIXTURE);
        let whole = run(aalis_proxy_with(&[
            "annotate",
            &fixture_arg(TOOL_CALL_FIXTURE),
        ]));
        assert!(whole.status.success());
        let mut child = aalis_proxy_with(&["annotate"])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn aalis-proxy");
        let stdin = child.stdin.take().expect("piped stdin");
        let output = LiveStdout::new(child.stdout.take().expect("piped stdout"));
        LiveAnnotate {
            input,
            whole: whole.stdout,
            child,
            stdin,
            output,
        }
    }

    /// Writes the input up to `head`, flushed, and waits for the output up
    /// to `expected_head`, which must be that of the whole file.
    fn send_head(&mut self, head: usize, expected_head: usize, what: &str) {
        self.stdin
            .write_all(&self.input[..head])
            .expect("write the first events");
        self.stdin.flush().expect("flush stdin");
        self.output.recv_until(expected_head, what);
        assert_eq!(
            String::from_utf8_lossy(&self.output.received),
            String::from_utf8_lossy(&self.whole[..expected_head])
        );
    }

    /// Writes the rest of the input from `head` and closes stdin: the whole
    /// output is that of the file, and the status is success.
    fn finish(mut self, head: usize) {
        self.stdin
            .write_all(&self.input[head..])
            .expect("write the rest");
        drop(self.stdin);
        let received = self.output.recv_to_end("the rest");
        let status = wait_bounded(&mut self.child, "after the end of input");
        assert!(status.success(), "{}", describe_status(status));
        assert_eq!(
            String::from_utf8_lossy(&received),
            String::from_utf8_lossy(&self.whole)
        );
    }
}

/// Each event is written and flushed as soon as it is complete, before the
/// end of the input: the first tool-call event comes out, with its
/// injected `"toolCallProgress"`, while stdin is still open. The whole
/// output is then the same as for the file at once.
#[test]
fn each_event_is_flushed_as_soon_as_it_is_complete() {
    let mut live = LiveAnnotate::start();
    // The input up to the end of the first event that carries a tool-call
    // delta, and the output up to the end of its annotated copy.
    let head = end_of_event(
        &live.input,
        find(&live.input, b"\"tool_calls\"").expect("a tool call"),
    );
    let expected_head = end_of_event(
        &live.whole,
        find(&live.whole, b"\"toolCallProgress\"").expect("injected progress"),
    );
    assert!(
        head < live.input.len(),
        "the fixture must go on after its first tool call"
    );
    live.send_head(
        head,
        expected_head,
        "first tool-call event, stdin still open",
    );
    live.finish(head);
}

/// `annotate` widens the pipe it reads (so a read takes up to a megabyte of
/// what piled up, not 64 KiB), up to the system's limit for unprivileged
/// processes, and the stream through the wider pipe is unchanged. The pipe is
/// shared: its size seen from the writing end is the size annotate set.
#[test]
fn annotate_widens_its_input_pipe() {
    let limit: usize = std::fs::read_to_string("/proc/sys/fs/pipe-max-size")
        .expect("read pipe-max-size")
        .trim()
        .parse()
        .expect("pipe-max-size is a number");
    let want = limit.min(aalis_proxy::filter::PIPE_BYTES);
    // The size annotate's pipe starts with is a new pipe's: read from one of
    // our own, as annotate may widen its own before this test looks (a run on
    // a busy machine once saw it already widened).
    let (fresh, _writer) = rustix::pipe::pipe().expect("make a pipe");
    let before = rustix::pipe::fcntl_getpipe_size(&fresh).expect("a pipe");
    assert!(
        before < want,
        "a pipe starts narrower ({before} bytes) than {want}"
    );
    let mut live = LiveAnnotate::start();
    // Once the first event is out, annotate is reading: the pipe was widened.
    let head = end_of_event(&live.input, 0);
    let expected_head = end_of_event(&live.whole, 0);
    live.send_head(head, expected_head, "the first event");
    assert_eq!(
        rustix::pipe::fcntl_getpipe_size(&live.stdin).expect("stdin is a pipe"),
        want
    );
    live.finish(head);
}

/// SIGINT (Ctrl-C) while `annotate` waits for more input ends it the
/// conventional way: killed by SIGINT, or status 130.
#[test]
fn sigint_ends_annotate() {
    use std::os::unix::process::{CommandExt, ExitStatusExt};

    unsafe extern "C" {
        fn signal(signum: std::ffi::c_int, handler: usize) -> usize;
    }
    const SIGINT: std::ffi::c_int = 2;
    const SIG_DFL: usize = 0;

    let input = read_fixture(TOOL_CALL_FIXTURE);
    let head = end_of_event(&input, 0);

    let mut cmd = aalis_proxy_with(&["annotate", "--inject", "none"]);
    cmd.stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::null());
    // A test run started in the background by a shell without job control
    // inherits SIGINT ignored, and so would the child: give it the default
    // disposition a terminal user's process has.
    // SAFETY: signal() is async-signal-safe and touches no Rust state.
    unsafe {
        cmd.pre_exec(|| {
            signal(SIGINT, SIG_DFL);
            Ok(())
        });
    }
    let mut child = cmd.spawn().expect("spawn aalis-proxy");
    let mut stdin = child.stdin.take().expect("piped stdin");
    let mut output = LiveStdout::new(child.stdout.take().expect("piped stdout"));

    // Once the first event is back, annotate is running and blocked on
    // reading stdin, which stays open.
    stdin
        .write_all(&input[..head])
        .expect("write the first event");
    output.recv_until(head, "first event");

    let kill = Command::new("kill")
        .args(["-INT", &child.id().to_string()])
        .status()
        .expect("run kill");
    assert!(kill.success(), "kill -INT failed: {kill:?}");

    let status = wait_bounded(&mut child, "after SIGINT");
    drop(stdin);
    assert!(
        status.signal() == Some(SIGINT) || status.code() == Some(130),
        "{}",
        describe_status(status)
    );
}

// === Odd inputs ===

/// 64 KiB of pseudo-random bytes from a fixed seed (NULs, invalid UTF-8,
/// stray CR and LF) with `--inject none` come out byte for byte, status 0;
/// anything on stderr is a warning line safe to print on a terminal.
#[test]
fn binary_garbage_passes_through_unchanged() {
    let mut state: u64 = 0x9E37_79B9_7F4A_7C15;
    let garbage: Vec<u8> = (0..64 * 1024)
        .map(|_| {
            // xorshift64*: deterministic, no crate needed.
            state ^= state >> 12;
            state ^= state << 25;
            state ^= state >> 27;
            (state.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 56) as u8
        })
        .collect();
    assert!(garbage.contains(&0) && garbage.contains(&b'\n') && garbage.contains(&b'\r'));
    assert!(std::str::from_utf8(&garbage).is_err());

    let output = run_with_stdin(
        aalis_proxy_with(&["annotate", "--inject", "none"]),
        &garbage,
    );
    assert_eq!(output.status.code(), Some(0));
    assert!(output.stdout == garbage, "the bytes changed");
    let stderr = std::str::from_utf8(&output.stderr).expect("stderr is UTF-8");
    for line in stderr.lines() {
        assert!(line.starts_with("aalis-proxy: warning: "), "{line:?}");
        assert!(!line.chars().any(char::is_control), "{line:?}");
    }
}

/// A body that is no stream of chunks (an HTML error page that `curl`
/// wrote, a capture of another API) is said so once, with its size, and
/// passed on unchanged; in the line formats its done line says the answer
/// may be cut. Before, it ended as a whole, empty answer without a word.
#[test]
fn a_body_that_is_no_stream_is_said_so() {
    let page =
        b"<html>\n<head><title>502 Bad Gateway</title></head>\n<body>nginx</body>\n</html>\n";
    let output = annotate_ok(&[], page);
    assert_eq!(output.stdout, page);
    let output = annotate_ok(&["--format", "ndjson"], page);
    assert_eq!(
        String::from_utf8_lossy(&output.stdout),
        "{\"done\":true,\"incomplete\":true}\n"
    );
    assert_eq!(
        String::from_utf8_lossy(&output.stderr),
        format!(
            "aalis-proxy: warning: the stream's {} bytes held no SSE event with data and no \
             NDJSON line: no stream of chat chunks (an HTML error page? another API's?); left \
             out of the lines (--format)\n",
            page.len()
        )
    );
}

/// A provider's `event: error` is an upstream error, said as one (before,
/// only as an event with a name of its own), in every format; the line
/// formats still carry it as an `unparsed` line.
#[test]
fn a_named_error_event_is_said_as_an_upstream_error() {
    let input = "data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"a\"}}]}\n\n\
                 event: error\ndata: {\"error\":{\"message\":\"overloaded\"}}\n\n\
                 data: [DONE]\n\n";
    for format in ["sse", "ndjson"] {
        let output = annotate_ok(&["--format", format], input.as_bytes());
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(
            stderr.contains(
                "SSE event 2 (byte 57): upstream error: {\"error\":{\"message\":\"overloaded\"}}"
            ),
            "--format {format}: {stderr}"
        );
        if format == "sse" {
            assert_eq!(output.stdout, input.as_bytes());
        }
    }
}

/// An empty input is an empty stream: nothing for `--format sse`, a single
/// `done` line for `--format ndjson`, which says the answer may be cut
/// (no `[DONE]` came: a request that failed before its first byte is no
/// whole, empty answer); status 0, no warnings.
#[test]
fn empty_input() {
    for (format, expected) in [
        ("sse", ""),
        ("ndjson", "{\"done\":true,\"incomplete\":true}\n"),
    ] {
        let output = run_with_stdin(aalis_proxy_with(&["annotate", "--format", format]), b"");
        assert_eq!(output.status.code(), Some(0), "--format {format}");
        assert_eq!(
            String::from_utf8_lossy(&output.stdout),
            expected,
            "--format {format}"
        );
        assert_eq!(
            String::from_utf8_lossy(&output.stderr),
            "",
            "--format {format}"
        );
    }
}

// === Help and version ===

/// The block of `--help` text that documents `flag`: its heading line
/// (`      --format <FORMAT>`) up to the next option heading or section.
fn option_help<'a>(help: &'a str, flag: &str) -> Vec<&'a str> {
    let is_heading = |line: &str| {
        let indent = line.len() - line.trim_start().len();
        (indent < 8 && line.trim_start().starts_with('-')) || (indent == 0 && !line.is_empty())
    };
    let mut lines = help.lines().skip_while(|line| {
        !(is_heading(line) && line.trim_start().split([' ', ',']).any(|word| word == flag))
    });
    let heading = lines
        .next()
        .unwrap_or_else(|| panic!("no {flag} in:\n{help}"));
    std::iter::once(heading)
        .chain(lines.take_while(|line| !is_heading(line)))
        .collect()
}

/// `annotate --help` gives an `Example:` using each of --format, --inject
/// and --session, in that option's own help.
#[test]
fn annotate_help_has_an_example_per_option() {
    let output = run(aalis_proxy_with(&["annotate", "--help"]));
    assert_eq!(output.status.code(), Some(0));
    let help = String::from_utf8(output.stdout).expect("UTF-8 help");
    for flag in ["--format", "--inject", "--session"] {
        let block = option_help(&help, flag);
        assert!(
            block.iter().any(|line| {
                let line = line.trim();
                line.starts_with("Example:") && line.contains(flag)
            }),
            "no `Example: … {flag} …` in its help:\n{}",
            block.join("\n")
        );
    }
}

/// The top-level `--help` lists every exit status.
#[test]
fn top_level_help_lists_exit_statuses() {
    let output = run(aalis_proxy_with(&["--help"]));
    assert_eq!(output.status.code(), Some(0));
    let help = String::from_utf8(output.stdout).expect("UTF-8 help");
    let (_, statuses) = help
        .split_once("Exit status:\n")
        .unwrap_or_else(|| panic!("no `Exit status:` section in:\n{help}"));
    for code in ["0", "1", "2", "130"] {
        assert!(
            statuses.lines().any(|line| {
                let mut words = line.split_whitespace();
                words.next() == Some(code) && words.next().is_some()
            }),
            "exit status {code} not described in:\n{statuses}"
        );
    }
}

/// `--version` prints `aalis-proxy <version>` and exits 0.
#[test]
fn version() {
    let output = run(aalis_proxy_with(&["--version"]));
    assert_eq!(output.status.code(), Some(0));
    assert_eq!(
        String::from_utf8_lossy(&output.stdout),
        format!("aalis-proxy {}\n", env!("CARGO_PKG_VERSION"))
    );
    assert_eq!(String::from_utf8_lossy(&output.stderr), "");
}

/// `annotate --version` (the flag is propagated to the subcommand) names
/// the program the user ran, too.
#[test]
fn annotate_version_names_the_program() {
    let output = run(aalis_proxy_with(&["annotate", "--version"]));
    assert_eq!(output.status.code(), Some(0));
    assert_eq!(
        String::from_utf8_lossy(&output.stdout),
        format!("aalis-proxy {}\n", env!("CARGO_PKG_VERSION"))
    );
}

/// Data after the end of a stream is passed on and reported once, naming
/// what ended the stream: `[DONE]` for SSE, `done: true` for Ollama's
/// NDJSON (which has no `[DONE]`).
#[test]
fn data_after_the_end_names_the_end_of_its_kind() {
    for (input, warning) in [
        (
            &b"data: [DONE]\n\ndata: {}\n\ndata: {}\n\n"[..],
            "SSE event 2 (byte 14): data after the end of the stream ([DONE])",
        ),
        (
            &b"{\"done\":true}\n{\"message\":{\"content\":\"x\"},\"done\":false}\n{}\n"[..],
            "NDJSON line 2 (byte 14): data after the end of the stream (\"done\": true)",
        ),
    ] {
        let output = run_with_stdin(aalis_proxy_with(&["annotate"]), input);
        assert!(output.status.success());
        assert_eq!(output.stdout, input, "passed on unchanged");
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert_eq!(stderr.matches("after the end").count(), 1, "{stderr}");
        assert!(stderr.contains(warning), "{stderr}");
    }
}

/// An error said to a stderr nobody reads (a closed pipe) still ends with
/// its own status: 1 for an input that cannot be opened, 2 for a usage
/// error. Before, the message's `eprintln!` panicked, and the status was
/// 101.
#[test]
fn a_closed_stderr_keeps_the_exit_status() {
    for (args, status) in [
        (&["annotate", "no-such-file.sse"][..], 1),
        (&["annotate", "--no-such-flag"][..], 2),
        (
            &[
                "serve",
                "--upstream",
                "http://127.0.0.1:1",
                "--idle-timeout",
                "0",
            ][..],
            2,
        ),
    ] {
        let (reader, writer) = std::io::pipe().expect("a pipe");
        drop(reader);
        let output = aalis_proxy_with(args)
            .stdin(Stdio::null())
            .stderr(writer)
            .output()
            .expect("runs");
        assert_eq!(output.status.code(), Some(status), "{args:?}");
    }
}
