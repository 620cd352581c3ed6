#!/usr/bin/env python3
"""Deterministic generated captures for the benchmark suite (issue 6).

Three kinds, each one stream of at least --mb megabytes (10^6 bytes):

  tool    OpenAI-style SSE, tool-heavy: turns of 1-4 parallel tool calls
          (sometimes interleaved by index), arguments of 200-20,000 characters
          streamed in 3-12 character deltas, some CJK and emoji, some turns with
          non-ASCII escaped as \\uXXXX; a short text delta between some turns.
  text    OpenAI-style SSE, text-heavy: content deltas of a few words, a small
          tool call in one turn out of ten, a usage chunk per turn.
  ollama  Ollama /api/chat NDJSON: thinking and content lines, tool calls whole
          (arguments as a JSON object), one `done: true` line at the end. Every
          Ollama call is a call of its own, so a capture has at most
          OLLAMA_CALLS of them, under `annotate`'s limit of 1,024 calls a
          stream (past it, a call is passed on without progress, while the
          jq and Python baselines would go on counting: not the same job).

The chunk shape copies fixtures/openai/*.sse and fixtures/ollama/*.ndjson. A
capture is one stream: `[DONE]` (or Ollama's `done: true`) comes only at the
end, because everything after it is only forwarded, not analysed.

Same arguments, same bytes (random.Random(seed); no clock, no hash
randomisation). Output goes where --out says; the suite keeps it under /tmp.
"""

import argparse
import json
import random
import string
import sys

ALNUM = string.ascii_letters + string.digits

WORDS = (
    "the of and to in is for on that with as by this from at be are or an it "
    "file path line value return result error config request response stream "
    "tool call index name arguments content delta chunk event session proxy "
    "fn let mut impl struct enum match Some None Ok Err self use pub async await "
    "weather location unit celsius forecast days query search limit offset "
    "docs README update replace insert delete create open close read write"
).split()
CJK = ["北京", "東京", "天气预报", "文件", "数据", "用户", "你好", "世界", "검색", "ファイル"]
EMOJI = ["😀", "🚀", "✅", "🔥", "📁", "🌧️", "👍🏽"]
FUNCTIONS = [
    "write_file", "edit_file", "get_weather", "search_docs", "run_sql",
    "create_issue", "apply_patch", "send_email",
]
MODEL = "gpt-4o-2024-08-06"
FINGERPRINT = "fp_cbf1785567"


def rand_id(rng, n):
    return "".join(rng.choice(ALNUM) for _ in range(n))


def prose(rng, n_chars, cjk_rate=0.03, emoji_rate=0.01):
    """Text of about n_chars characters: code-ish words, newlines, quotes,
    some CJK and emoji."""
    out = []
    total = 0
    while total < n_chars:
        r = rng.random()
        if r < cjk_rate:
            w = rng.choice(CJK)
        elif r < cjk_rate + emoji_rate:
            w = rng.choice(EMOJI)
        else:
            w = rng.choice(WORDS)
        r = rng.random()
        if r < 0.06:
            w += "\n"
        elif r < 0.08:
            w = '"' + w + '"'
        elif r < 0.09:
            w += "\\"
        out.append(w)
        total += len(w) + 1
    return " ".join(out)[:n_chars]


def arguments_text(rng):
    """One tool call's arguments: a JSON document of 200-20,000 characters
    (log-uniform)."""
    target = int(200 * (100 ** rng.random()))
    head = {"path": "src/" + rng.choice(WORDS) + "/" + rng.choice(WORDS) + ".rs", "mode": "overwrite"}
    doc = dict(head)
    doc["content"] = ""
    overhead = len(json.dumps(doc, ensure_ascii=False))
    doc["content"] = prose(rng, max(target - overhead, 1))
    return json.dumps(doc, ensure_ascii=False)


def split_deltas(rng, text, lo=3, hi=12):
    i = 0
    n = len(text)
    while i < n:
        k = rng.randint(lo, hi)
        yield text[i : i + k]
        i += k


class SseWriter:
    """Buffers events and writes them in large pieces."""

    def __init__(self, out):
        self.out = out
        self.parts = []
        self.size = 0
        self.written = 0

    def event(self, data):
        s = "data: " + data + "\n\n"
        self.parts.append(s)
        self.size += len(s)
        if self.size > 1 << 20:
            self.flush()

    def line(self, data):
        s = data + "\n"
        self.parts.append(s)
        self.size += len(s)
        if self.size > 1 << 20:
            self.flush()

    def flush(self):
        b = "".join(self.parts).encode("utf-8")
        self.out.write(b)
        self.written += len(b)
        self.parts = []
        self.size = 0

    def total(self):
        # Characters buffered are at most their UTF-8 bytes: a lower bound.
        return self.written + self.size


class Turn:
    """One response's constant chunk parts."""

    def __init__(self, rng, created):
        self.rng = rng
        self.pre = (
            '{"id":"chatcmpl-%s","object":"chat.completion.chunk","created":%d,'
            '"model":"%s","service_tier":"default","system_fingerprint":"%s",'
            '"choices":[{"index":0,"delta":' % (rand_id(rng, 29), created, MODEL, FINGERPRINT)
        )
        self.created = created

    def chunk(self, delta, finish="null"):
        return (
            self.pre + delta + ',"logprobs":null,"finish_reason":' + finish + '}],"obfuscation":"'
            + rand_id(self.rng, self.rng.randint(1, 16)) + '"}'
        )

    def usage(self, prompt, completion):
        pre = self.pre[: self.pre.index('"choices":')]
        return (
            pre + '"choices":[],"usage":{"prompt_tokens":%d,"completion_tokens":%d,"total_tokens":%d,'
            '"prompt_tokens_details":{"cached_tokens":0,"audio_tokens":0},'
            '"completion_tokens_details":{"reasoning_tokens":0,"audio_tokens":0,'
            '"accepted_prediction_tokens":0,"rejected_prediction_tokens":0}},"obfuscation":"%s"}'
            % (prompt, completion, prompt + completion, rand_id(self.rng, 6))
        )


def text_deltas(w, turn, rng, n, ascii_only):
    for _ in range(n):
        words = prose(rng, rng.randint(2, 24))
        w.event(turn.chunk('{"content":' + json.dumps(words, ensure_ascii=ascii_only) + "}"))


def tool_calls(w, turn, rng, calls, interleave, ascii_only):
    """Announces and streams `calls` (a list of (index, name, args))."""
    streams = []
    for index, name, args in calls:
        announce = (
            '{"tool_calls":[{"index":%d,"id":"call_%s","type":"function","function":'
            '{"name":"%s","arguments":""}}]}' % (index, rand_id(rng, 24), name)
        )
        pieces = list(split_deltas(rng, args))
        streams.append((index, announce, pieces))
    if interleave:
        for index, announce, _ in streams:
            w.event(turn.chunk(announce))
        longest = max(len(p) for _, _, p in streams)
        for j in range(longest):
            for index, _, pieces in streams:
                if j < len(pieces):
                    w.event(turn.chunk(delta_args(index, pieces[j], ascii_only)))
    else:
        for index, announce, pieces in streams:
            w.event(turn.chunk(announce))
            for p in pieces:
                w.event(turn.chunk(delta_args(index, p, ascii_only)))


def delta_args(index, piece, ascii_only):
    return (
        '{"tool_calls":[{"index":%d,"function":{"arguments":%s}}]}'
        % (index, json.dumps(piece, ensure_ascii=ascii_only))
    )


def gen_tool(out, target_bytes, seed):
    rng = random.Random(seed)
    w = SseWriter(out)
    created = 1767225661
    while w.total() < target_bytes:
        turn = Turn(rng, created)
        created += rng.randint(1, 30)
        ascii_only = rng.random() < 0.2
        w.event(turn.chunk('{"role":"assistant","content":null}'))
        if rng.random() < 0.3:
            text_deltas(w, turn, rng, rng.randint(2, 10), ascii_only)
        k = rng.choice([1, 1, 2, 2, 3, 4])
        calls = [(i, rng.choice(FUNCTIONS), arguments_text(rng)) for i in range(k)]
        tool_calls(w, turn, rng, calls, k > 1 and rng.random() < 0.25, ascii_only)
        w.event(turn.chunk("{}", '"tool_calls"'))
        w.event(turn.usage(rng.randint(100, 5000), rng.randint(50, 8000)))
    w.event("[DONE]")
    w.flush()
    return w.written


def gen_text(out, target_bytes, seed):
    rng = random.Random(seed)
    w = SseWriter(out)
    created = 1767225841
    while w.total() < target_bytes:
        turn = Turn(rng, created)
        created += rng.randint(1, 30)
        ascii_only = rng.random() < 0.1
        w.event(turn.chunk('{"role":"assistant","content":"","refusal":null}'))
        text_deltas(w, turn, rng, rng.randint(200, 2000), ascii_only)
        if rng.random() < 0.1:
            args = json.dumps({"query": prose(rng, rng.randint(150, 900))}, ensure_ascii=False)
            tool_calls(w, turn, rng, [(0, "search_docs", args)], False, ascii_only)
            w.event(turn.chunk("{}", '"tool_calls"'))
        else:
            w.event(turn.chunk("{}", '"stop"'))
        w.event(turn.usage(rng.randint(100, 5000), rng.randint(50, 8000)))
    w.event("[DONE]")
    w.flush()
    return w.written


def ollama_args(rng):
    target = int(50 * (40 ** rng.random()))
    return {
        "location": rng.choice(CJK) + ", " + rng.choice(WORDS),
        "days": rng.randint(1, 14),
        "ratio": rng.choice([0.5, 9.5, 21.25, 1.75]),
        "metric": rng.random() < 0.5,
        "notes": prose(rng, target),
    }


# The most tool calls in one Ollama capture (see the module's docs).
OLLAMA_CALLS = 1000


def gen_ollama(out, target_bytes, seed):
    rng = random.Random(seed)
    w = SseWriter(out)
    ms = 0
    # Half of the turns call tools, as long as the calls' expected number
    # (1.75 a turn, about 60 KB a turn) stays under OLLAMA_CALLS; fewer in
    # a larger capture.
    call_rate = min(0.5, 0.9 * OLLAMA_CALLS / 1.75 / (target_bytes / 60e3))
    calls_made = 0

    def stamp():
        s = ms // 1000
        return "2026-01-01T%02d:%02d:%02d.%03dZ" % (9 + s // 3600 % 12, s // 60 % 60, s % 60, ms % 1000)

    head = '{"model":"qwen3:8b","created_at":"'
    while w.total() < target_bytes:
        for field, n in (("thinking", rng.randint(20, 200)), ("content", rng.randint(50, 600))):
            for _ in range(n):
                ms += rng.randint(20, 45)
                text = json.dumps(prose(rng, rng.randint(2, 24)), ensure_ascii=False)
                if field == "thinking":
                    msg = '{"role":"assistant","content":"","thinking":' + text + "}"
                else:
                    msg = '{"role":"assistant","content":' + text + "}"
                w.line(head + stamp() + '","message":' + msg + ',"done":false}')
        k = rng.choice([1, 1, 2, 3])
        if rng.random() < call_rate and calls_made + k <= OLLAMA_CALLS:
            calls_made += k
            calls = []
            for i in range(k):
                calls.append(
                    {
                        "id": "call_" + rand_id(rng, 8).lower(),
                        "function": {"index": i, "name": rng.choice(FUNCTIONS), "arguments": ollama_args(rng)},
                    }
                )
            msg = {"role": "assistant", "content": "", "tool_calls": calls}
            ms += rng.randint(20, 45)
            w.line(head + stamp() + '","message":' + json.dumps(msg, ensure_ascii=False, separators=(",", ":")) + ',"done":false}')
    w.line(
        head + stamp() + '","message":{"role":"assistant","content":""},"done_reason":"stop","done":true,'
        '"total_duration":3521874583,"load_duration":41268917,"prompt_eval_count":231,'
        '"prompt_eval_duration":187334250,"eval_count":94,"eval_duration":3290112416}'
    )
    w.flush()
    return w.written


KINDS = {"tool": gen_tool, "text": gen_text, "ollama": gen_ollama}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kind", choices=sorted(KINDS), required=True)
    ap.add_argument("--mb", type=float, required=True, help="at least this many MB (10^6 bytes)")
    ap.add_argument("--seed", type=int, default=6)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    with open(a.out, "wb") as f:
        n = KINDS[a.kind](f, int(a.mb * 1e6), a.seed)
    print(f"{a.out}: {n} bytes", file=sys.stderr)


if __name__ == "__main__":
    main()
