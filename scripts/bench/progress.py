#!/usr/bin/env python3
"""The progress job of `aalis-proxy annotate --format ndjson`, with Python's
json module: a baseline for scripts/bench.sh, not a reference.

Reads an OpenAI-style SSE stream (strip `data: `, per-index name and
accumulated argument length) or an Ollama NDJSON stream (tool calls whole:
the length of the arguments' compact JSON) from stdin, detected from the
first byte, and writes one `{"toolCallProgress":{...}}` line per tool-call
delta. Lengths are UTF-16 code units, as JavaScript's String.length.
"""
import json
import sys


def utf16len(s):
    return len(s.encode("utf-16-le")) >> 1


def progress(index, name, chars):
    return '{"toolCallProgress":{"index":%d,"name":%s,"charsAccumulated":%d}}\n' % (
        index, json.dumps(name, ensure_ascii=False), chars)


def sse(lines, write):
    names = {}
    lens = {}
    loads = json.loads
    for line in lines:
        if not line.startswith(b"data: "):
            continue
        data = line[6:].rstrip(b"\r\n")
        if data == b"[DONE]":
            continue
        try:
            chunk = loads(data)
        except ValueError:
            continue
        if not isinstance(chunk, dict):
            continue
        for choice in chunk.get("choices") or ():
            for t in (choice.get("delta") or {}).get("tool_calls") or ():
                i = t.get("index", 0)
                f = t.get("function") or {}
                name = f.get("name")
                if name:
                    names[i] = name
                n = lens.get(i, 0) + utf16len(f.get("arguments") or "")
                lens[i] = n
                write(progress(i, names.get(i, ""), n))


def ndjson(lines, write):
    dumps = json.dumps
    # Every Ollama call is distinct: its wire index if still free, else the
    # next number (as aalis-proxy numbers them).
    next_index = 0
    for line in lines:
        try:
            obj = json.loads(line)
        except ValueError:
            continue
        if not isinstance(obj, dict):
            continue
        calls = (obj.get("message") or {}).get("tool_calls") or ()
        for t in calls:
            f = t.get("function") or {}
            args = dumps(f.get("arguments"), ensure_ascii=False, separators=(",", ":"))
            i = f.get("index")
            i = i if isinstance(i, int) and i >= next_index else next_index
            next_index = i + 1
            write(progress(i, f.get("name") or "", utf16len(args)))


def main():
    stdin = sys.stdin.buffer
    first = stdin.peek(1)[:1]
    write = sys.stdout.write
    (ndjson if first == b"{" else sse)(stdin, write)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
