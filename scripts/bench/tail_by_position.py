#!/usr/bin/env python3
"""Where a drive's latency tail is, by each event's position in its stream.

Reads the files `loadgen drive --latencies-out` writes (one line an event:
stream, position, the stream's events, latency in ns), for example those of
`scripts/bench/interleave.sh` with LATENCIES set, named target.rep. For
each file: the p99 of all its events; how many of the events at or above it
(the top 1 %) are among their stream's first 10 events, its last 10, or the
rest; and the p99 of each group. With --buckets, also the p99 of the
events at positions 0-9, 10-19, and so on.

    python3 scripts/bench/tail_by_position.py /tmp/lat/*
    python3 scripts/bench/tail_by_position.py --buckets 10 /tmp/lat/serve.*
"""

import argparse
import os
import sys

EDGE = 10  # the driver's START_EVENTS: a paced stream's first 50 ms


def p99_ns(values):
    """The p99 of latencies in ns (the value at the 99th percentile's rank)."""
    values = sorted(values)
    return values[min(len(values) - 1, int(len(values) * 0.99))] if values else float("nan")


def p99(values):
    """The same, in µs."""
    return p99_ns(values) / 1000


def group(position, events):
    if position < EDGE:
        return "first"
    if position >= events - EDGE:
        return "last"
    return "rest"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("files", nargs="+")
    ap.add_argument("--buckets", type=int, default=0, help="positions per bucket (0: none)")
    args = ap.parse_args()
    for path in args.files:
        try:
            with open(path) as f:
                rows = [tuple(int(x) for x in line.split()) for line in f if line.strip()]
        except (OSError, ValueError) as e:
            sys.exit(f"tail_by_position: {path}: {e}")
        if not rows:
            print(f"{os.path.basename(path)}: no events")
            continue
        cut = p99_ns([r[3] for r in rows])
        top = {"first": 0, "rest": 0, "last": 0}
        parts = {"first": [], "rest": [], "last": []}
        for _, position, events, ns in rows:
            g = group(position, events)
            parts[g].append(ns)
            if ns >= cut:
                top[g] += 1
        line = (f"{os.path.basename(path)}: p99 {cut / 1000:,.0f} µs; the top 1 % among the first {EDGE} "
                f"{top['first']}, the rest {top['rest']}, the last {EDGE} {top['last']}; "
                f"p99 of each {p99(parts['first']):,.0f} / {p99(parts['rest']):,.0f} / {p99(parts['last']):,.0f} µs")
        print(line)
        if args.buckets > 0:
            last = max(r[1] for r in rows)
            cells = []
            for start in range(0, last + 1, args.buckets):
                cells.append(f"{p99([r[3] for r in rows if start <= r[1] < start + args.buckets]):,.0f}")
            print(f"  p99 by {args.buckets} positions, µs: " + " ".join(cells))


if __name__ == "__main__":
    main()
