#!/usr/bin/env python3
"""Where a drive's latency tail is, by each event's position in its stream.

Reads the files `loadgen drive --latencies-out` writes (one line an event:
stream, position, the stream's events, latency in ns), for example those of
`scripts/bench/interleave.sh` with LATENCIES set, named target.rep. For
each file: the p99 of all its events; how many of the events at or above it
(the top 1 %) are among their stream's first 10 events, its last 10, or the
rest; and the p99 of each group. With --buckets, also the p99 of the
events at positions 0-9, 10-19, and so on. With --waves, how the top 1 %
falls over the drive's waves (the events at one position, which a paced
drive's streams send together): in how many of them, the share of the
three worst, and the median over waves (from position 10 on) of each
wave's slowest event; then, for each target (a file name's part before
its first dot), the medians of those over its files.

    python3 scripts/bench/tail_by_position.py /tmp/lat/*
    python3 scripts/bench/tail_by_position.py --buckets 10 /tmp/lat/serve.*
    python3 scripts/bench/tail_by_position.py --waves /tmp/lat/*
"""

import argparse
import collections
import os
import statistics
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
    ap.add_argument("--waves", action="store_true", help="the top 1 %% by wave, and medians by target")
    args = ap.parse_args()
    by_target = collections.defaultdict(list)
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
        if args.waves:
            waves = waves_of(rows, cut)
            by_target[os.path.basename(path).split(".")[0]].append(waves)
            print(f"  waves: the top 1 % in {waves[0]} of {waves[1]}, the three worst hold {waves[2]:.0%} of it; "
                  f"a wave's slowest event (from position {EDGE} on), median {waves[3]:,.0f} µs")
    if args.waves:
        for target, files in by_target.items():
            median = [statistics.median(w[i] for w in files) for i in range(4)]
            print(f"{target}, medians of {len(files)} files: the top 1 % in {median[0]:g} of {median[1]:g} waves, "
                  f"the three worst hold {median[2]:.0%} of it; a wave's slowest event {median[3]:,.0f} µs")


def waves_of(rows, cut):
    """How a drive's top 1 % (latencies at or above `cut`) falls over its waves: in
    how many, of how many waves; the share of the three worst; and the median over
    the waves from position EDGE on of each one's slowest event, in µs."""
    top = collections.Counter(position for _, position, _, ns in rows if ns >= cut)
    slowest = collections.defaultdict(int)
    for _, position, _, ns in rows:
        slowest[position] = max(slowest[position], ns)
    steady = [ns for position, ns in slowest.items() if position >= EDGE] or list(slowest.values())
    return (len(top), len(slowest), sum(c for _, c in top.most_common(3)) / sum(top.values()),
            statistics.median(steady) / 1000)


if __name__ == "__main__":
    main()
