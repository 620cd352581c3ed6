#!/usr/bin/env python3
"""Where the instructions of one `annotate` run go, from a callgrind output
file: self cost grouped by stage of the pipeline, then the top functions.

    valgrind --tool=callgrind --callgrind-out-file=cg.out \\
        target/release/aalis-proxy annotate capture.sse > /dev/null
    scripts/bench/cg_profile.py cg.out [--top 20] [--markdown]

Instruction counts (Ir) are deterministic for a given binary and input, so
they compare across runs on a noisy machine where timings do not. Used by
scripts/bench/run.py; the stages are matched on function names, first match
wins.
"""
import argparse
import re
import subprocess
import sys

# (stage, pattern on "file:function [object]"), first match wins.
STAGES = [
    ("JSON: string scanning (serde_json skip_to_escape, parse_str, ignore_str)",
     r"skip_to_escape|parse_str|ignore_str"),
    ("JSON: skipping unneeded values (ignore_value, ignore_integer, RawValue)",
     r"ignore_value|ignore_integer|deserialize_raw_value|ignore_exponent|ignore_decimal"),
    ("JSON: structure walk (serde derive visitors, map/seq access)",
     r"serde_json|serde_core|serde::|__FieldVisitor|_::<impl serde"),
    ("decode: providers (views → Chunk, escapes, raw ints)", r"aalis_proxy::providers"),
    ("UTF-8 validation", r"from_utf8|run_utf8_validation"),
    ("SSE / NDJSON framing", r"aalis_proxy::framing|memchr"),
    ("progress tracker + UTF-16 counts", r"aalis_proxy::progress|aalis_proxy::js::utf16_len"),
    ("encode: progress JSON (core::fmt, push_string)",
     r"core::fmt|pad_integral|aalis_proxy::encode::(write_head|write_tail|ProgressBatch::push|ProgressHeads::write)"
     r"|aalis_proxy::js::push_string"
     r"|<alloc::string::String as core::fmt::Write>"),
    ("encode: injection / NDJSON lines", r"aalis_proxy::encode"),
    ("memcpy (forwarding, buffer moves)", r"memmove|memcpy|Sink>::insert|Sink>::forward"),
    ("allocation (malloc, free, realloc, Vec growth, drops)",
     r"malloc|_int_free|free|realloc|raw_vec|drop_in_place|IntoIter"),
    ("pipeline glue", r"aalis_proxy::pipeline|aalis_proxy::filter"),
]

LINE = re.compile(r"^\s*([\d,]+)\s+\(\s*[\d.]+%\)\s+(.*)$")


def functions(path):
    out = subprocess.run(["callgrind_annotate", "--inclusive=no", "--threshold=100", path],
                         capture_output=True, text=True, check=True).stdout
    total = None
    rows = []
    for line in out.splitlines():
        m = LINE.match(line)
        if not m:
            continue
        ir = int(m.group(1).replace(",", ""))
        name = m.group(2)
        if "PROGRAM TOTALS" in name:
            total = ir
            continue
        rows.append((ir, name))
    return total or sum(ir for ir, _ in rows), rows


def short(name):
    name = re.sub(r"\s*\[[^\]]*\]$", "", name)
    return name.split(":", 1)[1] if name.startswith(("???:", "./")) else name


def stages(rows):
    sums = {}
    for ir, name in rows:
        stage = next((s for s, pat in STAGES if re.search(pat, name)), "other")
        sums[stage] = sums.get(stage, 0) + ir
    return sorted(sums.items(), key=lambda kv: -kv[1])


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("callgrind_out")
    ap.add_argument("--top", type=int, default=20)
    ap.add_argument("--bytes", type=int, help="input size, for instructions per byte")
    ap.add_argument("--markdown", action="store_true")
    a = ap.parse_args()
    total, rows = functions(a.callgrind_out)
    per = f", {total / a.bytes:.1f} per input byte" if a.bytes else ""
    print(f"total {total:,} instructions{per}\n")
    if a.markdown:
        print("| stage | Ir | share |\n| --- | ---: | ---: |")
        for stage, ir in stages(rows):
            print(f"| {stage} | {ir:,} | {100 * ir / total:.1f}% |")
        print(f"\n| top functions (self) | Ir | share |\n| --- | ---: | ---: |")
        for ir, name in rows[: a.top]:
            print(f"| `{short(name)[:110]}` | {ir:,} | {100 * ir / total:.1f}% |")
    else:
        for stage, ir in stages(rows):
            print(f"{100 * ir / total:5.1f}%  {ir:>13,}  {stage}")
        print()
        for ir, name in rows[: a.top]:
            print(f"{100 * ir / total:5.1f}%  {ir:>13,}  {short(name)[:140]}")


if __name__ == "__main__":
    sys.exit(main())
