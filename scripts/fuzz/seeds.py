#!/usr/bin/env python3
"""Seed corpora for the fuzz targets, from fixtures/ (issue 7).

Writes fuzz/corpus/<target>/seed-* (the corpus directories are not
committed; libFuzzer adds what it finds next to the seeds). Every input is
laid out as the target reads it (fuzz/src/lib.rs): the stream targets get
a config byte and a cutting byte before each fixture, whole and split into
single events or lines; the decoder targets get the data of each event or
line, and whole streams one frame per line; inject_field gets progress
objects before each event's data; chunked_body gets hand-written chunked
bodies (valid, cut short, invalid), each fixture sent chunked one event or
line per chunk, and fixtures as payloads for its encoder (odd configs).

    scripts/fuzz/seeds.py [ROOT]     # ROOT: the repository (default: .)
"""

import re
import struct
import sys
from pathlib import Path

ROOT = Path(sys.argv[1] if len(sys.argv) > 1 else ".")
CORPUS = ROOT / "fuzz" / "corpus"

# One blank line ends an SSE event: a line break right after a line break.
SSE_EVENT_END = re.compile(rb"(\r\n|\r(?!\n)|\n)(\r\n|\r(?!\n)|\n)")


def fixtures():
    for path in sorted((ROOT / "fixtures").rglob("*")):
        if path.suffix in (".sse", ".ndjson") and path.is_file():
            yield path.relative_to(ROOT / "fixtures").as_posix(), path.read_bytes()


def sse_events(stream):
    """The stream cut after each blank line (each piece raw, terminator included)."""
    events, start = [], 0
    for m in SSE_EVENT_END.finditer(stream):
        events.append(stream[start : m.end()])
        start = m.end()
    if start < len(stream):
        events.append(stream[start:])
    return events


def sse_data(event):
    """The joined `data` of one raw event (what the decoder hands over)."""
    data = []
    for line in re.split(rb"\r\n|\r|\n", event.lstrip(b"\xef\xbb\xbf")):
        if line.startswith(b"data:"):
            value = line[5:]
            data.append(value[1:] if value.startswith(b" ") else value)
    return b"\n".join(data) if data else None


def lines(stream):
    return stream.splitlines(keepends=True)


def plan(config, stream, cuts=(), bytewise=False):
    """A stream target input: config byte, cutting byte, cut points, stream."""
    cutting = len(cuts) | (0b1000 if bytewise else 0)
    return bytes([config, cutting]) + b"".join(struct.pack("<H", c) for c in cuts) + stream


def progress(choice, index, chars, name):
    name = name.encode()
    return struct.pack("<bhIB", choice, index, chars, len(name)) + name


def inject_input(flags, progresses, frame):
    return bytes([flags]) + b"".join(progresses) + frame


def chunked(pieces, trailers=b""):
    """`pieces` as an upstream sends them with transfer-encoding: chunked."""
    body = b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in pieces if p)
    return body + b"0\r\n" + trailers + b"\r\n"


# Chunked bodies as an upstream may send them, valid or not (chunked_body,
# even config: the stream is the body).
CHUNKED_BODIES = {
    "one-chunk": b"5\r\nhello\r\n0\r\n\r\n",
    "several-chunks": b"5\r\nhello\r\n1\r\n \r\nA\r\n0123456789\r\n0\r\n\r\n",
    "extensions": b"5;name=value\r\nhello\r\n6 ; a=b;c=\"d e\"\r\n world\r\n0;last\r\n\r\n",
    "trailers": b"3\r\nabc\r\n0\r\nx-usage: 12\r\nx-done: yes\r\n\r\n",
    "next-message": b"3\r\nabc\r\n0\r\n\r\nHTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n",
    "empty": b"0\r\n\r\n",
    "cut-short": b"a\r\n01234",
    "cut-in-size-line": b"5\r\nhello\r\n1",
    "invalid-size-line": b"3\r\nabc\r\nzz\r\nxyz\r\n0\r\n\r\n",
    "data-without-crlf": b"3\r\nabcX\r\n0\r\n\r\n",
}


def main():
    seeds = {t: {} for t in (
        "sse_framing", "ndjson_framing", "openai_decode",
        "ollama_decode", "inject_field", "annotate", "chunked_body")}

    def add(target, name, data):
        seeds[target][name] = data

    for name, body in CHUNKED_BODIES.items():
        n = len(body)
        add("chunked_body", name, plan(0, body))
        add("chunked_body", name + "-cut", plan(0, body, (1, n // 2, n - 1)))
        add("chunked_body", name + "-bytewise", plan(0, body, bytewise=True))
    # The encoder of odd configs (chunk size 1, extensions, upper case hex,
    # trailers), one byte at a time.
    add("chunked_body", "encoded-small", plan(0x0F, b"data: {}\n\n", bytewise=True))

    for rel, stream in fixtures():
        name = rel.replace("/", "_")
        n = len(stream)
        thirds = (n // 3, n // 2, 2 * n // 3)
        is_ndjson = rel.endswith(".ndjson")
        # Framing: whole, cut in three places, and with small size limits
        # (config % 4: default, 16, 64, 300 bytes).
        for target in ("sse_framing", "ndjson_framing"):
            add(target, name, plan(0, stream))
            add(target, name + "-cut", plan(0, stream, thirds))
            add(target, name + "-max64", plan(2, stream, thirds))
        # The pipeline: every mode (config % 7), one small limit, cut and
        # whole; odd modes also collect the subscribers' increments (+84).
        for mode in range(7):
            odd = mode % 2 == 1
            add("annotate", f"{name}-mode{mode}", plan(mode + (84 if odd else 0), stream, thirds if odd else ()))
        add("annotate", name + "-max300", plan(7 * 3, stream))
        add("annotate", name + "-bytewise", plan(0, stream, bytewise=True))
        pieces = lines(stream) if is_ndjson else sse_events(stream)
        # The fixture as an upstream sends it: one chunk per event or line,
        # whole and cut; and as a payload the target encodes itself
        # (config bits 4-7: chunks of 8, 64, 1000 or any bytes; bits 1-3:
        # extensions, upper case hex, trailers).
        body = chunked(pieces)
        add("chunked_body", name, plan(0, body))
        add("chunked_body", name + "-cut", plan(0, body, (len(body) // 3, 2 * len(body) // 3)))
        for config in (0x41, 0x87, 0xCB, 0xF9):
            add("chunked_body", f"{name}-encoded-{config:02x}", plan(config, stream, thirds))
        for i, piece in enumerate(pieces):
            add("annotate", f"{name}-{i:03}", plan(i % 7, piece))
            add("ndjson_framing" if is_ndjson else "sse_framing", f"{name}-{i:03}", plan(0, piece))
            data = piece.rstrip(b"\r\n") if is_ndjson else sse_data(piece)
            if data is None:
                continue
            add("ollama_decode" if is_ndjson else "openai_decode", f"{name}-{i:03}", data)
            one = [progress(0, 0, 27, "get_weather")]
            two = [progress(0, 0, 3, "a\u00e9\U0001F600"), progress(1, 1, 70000, 'q"\\\n')]
            add("inject_field", f"{name}-{i:03}", inject_input(0, one, data))
            add("inject_field", f"{name}-{i:03}-two", inject_input(1, two, data))
        # A decoder learns a template from the frames before: whole
        # streams, one frame per line, exercise it.
        if is_ndjson:
            add("ollama_decode", name, stream)
        else:
            datas = [sse_data(p) for p in pieces]
            add("openai_decode", name, b"\n".join(d.replace(b"\n", b" ") for d in datas if d is not None))

    for target, files in seeds.items():
        directory = CORPUS / target
        directory.mkdir(parents=True, exist_ok=True)
        for old in directory.glob("seed-*"):
            old.unlink()
        for name, data in files.items():
            (directory / f"seed-{name}").write_bytes(data)
        print(f"{target}: {len(files)} seeds")


if __name__ == "__main__":
    main()
