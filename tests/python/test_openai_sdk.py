#!/usr/bin/env python3
"""A real client: the official OpenAI Python SDK through `aalis-proxy serve`.

Starts `aalis-proxy mock` (bundled captures) and `aalis-proxy serve` in front
of it, on free loopback ports, then streams the `parallel_tool_calls` capture
with `client.chat.completions.create(stream=True)` once from the mock
directly and once through the proxy, and checks that:

- the tool calls the SDK assembles are the same both ways;
- through the proxy, every chunk that carried `delta.tool_calls` has
  `chunk.model_extra["toolCallProgress"]` = {index, name, charsAccumulated},
  and the last `charsAccumulated` of each call is the UTF-16 length of its
  arguments; without the proxy there is no such key;
- apart from that key, the chunks are the same;
- the SDK's stream helpers (`ChatCompletionStreamState`, and
  `client.chat.completions.stream` / `client.beta.chat.completions.stream`)
  assemble the same final message through the proxy.

Usage: test_openai_sdk.py [PATH_TO_aalis-proxy]  (or $AALIS_PROXY_BIN;
default target/debug/aalis-proxy). Only the standard library and `openai`
(with its own dependency httpx). The last line is `N passed, M failed`; the
exit status is 1 if anything failed.
"""

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import traceback

import httpx
import openai
from openai import OpenAI

DEADLINE = 10.0  # seconds, for anything waited for
MODEL = "parallel_tool_calls"
MESSAGES = [{"role": "user", "content": "What is the weather and the local time in Tokyo?"}]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather at a location",
            "parameters": {
                "type": "object",
                "properties": {
                    "location": {"type": "string"},
                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                },
                "required": ["location"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_local_time",
            "description": "Current local time in a time zone",
            "parameters": {
                "type": "object",
                "properties": {"timezone": {"type": "string"}},
                "required": ["timezone"],
            },
        },
    },
]

# Variables that could change what the binary does (as in tests/cli.rs).
SCRUBBED_ENV = [
    "RUST_LOG", "RUST_BACKTRACE", "NO_COLOR", "CLICOLOR", "CLICOLOR_FORCE", "TERM",
    "http_proxy", "https_proxy", "all_proxy", "no_proxy",
    "HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "NO_PROXY",
]


# --- child processes -------------------------------------------------------

def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Running:
    """An aalis-proxy child listening on a loopback port; stop() ends it."""

    def __init__(self, binary, name, args_for_port):
        env = {k: v for k, v in os.environ.items() if k not in SCRUBBED_ENV}
        last = ""
        for _ in range(5):
            self.port = free_port()
            self.name = f"{name} on port {self.port}"
            self.log = tempfile.TemporaryFile()
            self.proc = subprocess.Popen(
                [binary, *args_for_port(self.port)],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=self.log,
                env=env,
            )
            if self._wait_accepting():
                return
            last = self.stderr()
            if "Address already in use" not in last:
                break
        self.stop()
        raise RuntimeError(f"{self.name} did not start:\n{last}")

    def _wait_accepting(self):
        deadline = time.monotonic() + DEADLINE
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                return False
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                    return True
            except OSError:
                time.sleep(0.01)
        self.stop()
        raise RuntimeError(f"{self.name} accepts no connection after {DEADLINE}s")

    def stderr(self):
        self.log.seek(0)
        return self.log.read().decode("utf-8", "replace")

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=DEADLINE)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


# --- helpers ---------------------------------------------------------------

def client_for(port):
    # trust_env=False: no proxy from the environment for loopback.
    return OpenAI(
        base_url=f"http://127.0.0.1:{port}/v1",
        api_key="sk-test",
        max_retries=0,
        timeout=DEADLINE,
        http_client=httpx.Client(trust_env=False, timeout=DEADLINE),
    )


def stream_chunks(client):
    stream = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, tools=TOOLS, stream=True
    )
    try:
        return list(stream)
    finally:
        stream.close()


def assemble_tool_calls(chunks):
    """{index: {"id", "name", "arguments"}} as a client assembles them."""
    calls = {}
    for chunk in chunks:
        for choice in chunk.choices:
            for tc in choice.delta.tool_calls or []:
                call = calls.setdefault(tc.index, {"id": None, "name": None, "arguments": ""})
                if tc.id:
                    call["id"] = tc.id
                if tc.function is not None:
                    if tc.function.name:
                        call["name"] = tc.function.name
                    if tc.function.arguments:
                        call["arguments"] += tc.function.arguments
    return calls


def utf16_len(text):
    return len(text.encode("utf-16-le")) // 2


def extra(model):
    return model.model_extra or {}


def without_progress(chunk):
    dumped = chunk.model_dump()
    dumped.pop("toolCallProgress", None)
    dumped.pop("toolCallsProgress", None)
    return dumped


def final_message(message):
    return {
        "role": message.role,
        "content": message.content,
        "tool_calls": [
            {"id": tc.id, "type": tc.type, "name": tc.function.name, "arguments": tc.function.arguments}
            for tc in message.tool_calls or []
        ],
    }


# --- the tests -------------------------------------------------------------

class Skip(Exception):
    """The installed SDK lacks what a test checks."""


class Context:
    def __init__(self, mock, serve):
        self.direct = client_for(mock.port)
        self.proxied = client_for(serve.port)
        self._chunks = {}

    def chunks(self, which):
        """The chunks of one streamed request, direct or proxied (cached)."""
        if which not in self._chunks:
            client = self.direct if which == "direct" else self.proxied
            self._chunks[which] = stream_chunks(client)
        return self._chunks[which]


def test_tool_calls_are_the_same_direct_and_through_the_proxy(ctx):
    direct = assemble_tool_calls(ctx.chunks("direct"))
    proxied = assemble_tool_calls(ctx.chunks("proxied"))
    assert sorted(direct) == [0, 1], direct
    assert direct[0]["name"] == "get_weather", direct
    assert direct[1]["name"] == "get_local_time", direct
    for call in direct.values():
        assert call["id"], direct
        json.loads(call["arguments"])  # complete JSON
    assert proxied == direct, f"{proxied} != {direct}"


def test_progress_is_in_model_extra_through_the_proxy(ctx):
    chunks = ctx.chunks("proxied")
    calls = assemble_tool_calls(chunks)
    last_chars = {}
    names = {}
    with_tool_calls = 0
    for n, chunk in enumerate(chunks):
        deltas = [tc for c in chunk.choices for tc in c.delta.tool_calls or []]
        progress = extra(chunk).get("toolCallProgress")
        if not deltas:
            assert progress is None, f"chunk {n} has no tool call but progress {progress}"
            continue
        with_tool_calls += 1
        assert progress is not None, f"chunk {n} carried tool_calls but no toolCallProgress"
        assert set(progress) == {"index", "name", "charsAccumulated"}, progress
        for tc in deltas:
            if tc.function is not None and tc.function.name:
                names[tc.index] = tc.function.name
        assert progress["index"] == deltas[-1].index, (progress, deltas)
        assert progress["name"] == names[progress["index"]], (progress, names)
        assert isinstance(progress["charsAccumulated"], int), progress
        before = last_chars.get(progress["index"], 0)
        assert progress["charsAccumulated"] >= before, (progress, before)
        last_chars[progress["index"]] = progress["charsAccumulated"]
        # The delta itself is untouched: progress is a top-level key only.
        for choice in chunk.choices:
            assert "toolCallProgress" not in extra(choice.delta), choice.delta
    assert with_tool_calls >= 4, with_tool_calls
    assert sorted(last_chars) == sorted(calls), (last_chars, calls)
    for index, call in calls.items():
        assert last_chars[index] == utf16_len(call["arguments"]), (index, last_chars, call)


def test_no_progress_without_the_proxy(ctx):
    for chunk in ctx.chunks("direct"):
        assert "toolCallProgress" not in extra(chunk), chunk
        assert "toolCallsProgress" not in extra(chunk), chunk


def test_chunks_differ_only_by_the_progress_key(ctx):
    direct = [without_progress(c) for c in ctx.chunks("direct")]
    proxied = [without_progress(c) for c in ctx.chunks("proxied")]
    assert len(direct) == len(proxied), (len(direct), len(proxied))
    for n, (d, p) in enumerate(zip(direct, proxied)):
        assert d == p, f"chunk {n}: {p} != {d}"


def test_chat_completion_stream_state_assembles_the_same_message(ctx):
    try:
        from openai.lib.streaming.chat import ChatCompletionStreamState
    except ImportError:  # added in openai 1.4x
        raise Skip(f"openai {openai.__version__} has no ChatCompletionStreamState")

    finals = {}
    for which in ("direct", "proxied"):
        state = ChatCompletionStreamState(input_tools=TOOLS)
        for chunk in ctx.chunks(which):
            state.handle_chunk(chunk)
        finals[which] = state.get_final_completion().choices[0].message
    direct, proxied = finals["direct"], finals["proxied"]
    assert final_message(proxied) == final_message(direct), (proxied, direct)
    assert len(direct.tool_calls) == 2, direct
    # Nothing of the progress leaks into the message sent back upstream.
    dumped = json.dumps(proxied.model_dump())
    assert "toolCallProgress" not in dumped and "charsAccumulated" not in dumped, dumped


def test_stream_helper_assembles_the_same_message(ctx):
    def helper(client):
        stream = getattr(client.chat.completions, "stream", None)
        if stream is None:  # openai < 1.92: only under beta
            stream = client.beta.chat.completions.stream
        return stream

    finals = {}
    done_events = {}
    for which, client in (("direct", ctx.direct), ("proxied", ctx.proxied)):
        events = []
        with helper(client)(model=MODEL, messages=MESSAGES, tools=TOOLS) as stream:
            for event in stream:
                if event.type == "tool_calls.function.arguments.done":
                    events.append((event.index, event.name, event.arguments))
            finals[which] = stream.get_final_completion().choices[0].message
        done_events[which] = events
    assert final_message(finals["proxied"]) == final_message(finals["direct"]), finals
    assert done_events["proxied"] == done_events["direct"], done_events
    assert [name for _, name, _ in done_events["direct"]] == ["get_weather", "get_local_time"]
    dumped = json.dumps(finals["proxied"].model_dump())
    assert "toolCallProgress" not in dumped, dumped


TESTS = [
    test_tool_calls_are_the_same_direct_and_through_the_proxy,
    test_progress_is_in_model_extra_through_the_proxy,
    test_no_progress_without_the_proxy,
    test_chunks_differ_only_by_the_progress_key,
    test_chat_completion_stream_state_assembles_the_same_message,
    test_stream_helper_assembles_the_same_message,
]


def main(argv):
    binary = (argv[1] if len(argv) > 1 else None) or os.environ.get(
        "AALIS_PROXY_BIN", "target/debug/aalis-proxy"
    )
    if not os.access(binary, os.X_OK):
        print(f"error: {binary} is not an executable (build it with `cargo build`)")
        print("0 passed, 1 failed")
        return 1
    binary = os.path.abspath(binary)
    print(f"openai {openai.__version__}, httpx {httpx.__version__}, {binary}")

    passed = failed = skipped = 0
    mock = serve = None
    try:
        mock = Running(binary, "mock", lambda p: ["mock", "--listen", f"127.0.0.1:{p}", "--delay-ms", "1"])
        serve = Running(
            binary,
            "serve",
            lambda p: ["serve", "--upstream", f"http://127.0.0.1:{mock.port}", "--listen", f"127.0.0.1:{p}"],
        )
        ctx = Context(mock, serve)
        for test in TESTS:
            try:
                test(ctx)
            except Skip as why:
                skipped += 1
                print(f"skip {test.__name__}: {why}")
            except Exception:  # an AssertionError or an SDK error: a failure
                failed += 1
                print(f"FAIL {test.__name__}")
                traceback.print_exc(file=sys.stdout)
            else:
                passed += 1
                print(f"ok   {test.__name__}")
    except Exception:
        failed += 1
        print("FAIL setup")
        traceback.print_exc(file=sys.stdout)
    finally:
        for child in (serve, mock):
            if child is None:
                continue
            status = child.stop()
            if failed:
                print(f"--- stderr of {child.name}:\n{child.stderr()}")
            if status != 0:
                failed += 1
                print(f"FAIL {child.name} exited {status} after SIGTERM:\n{child.stderr()}")
    print(f"{passed} passed, {failed} failed" + (f", {skipped} skipped" if skipped else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
