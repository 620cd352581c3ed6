#!/usr/bin/env bash
# Instructions `aalis-proxy serve` spends on paced events, counted by
# callgrind (stable on a noisy machine, unlike wall-clock time): the
# before/after figures of the proxy in BENCHMARKS.md ("6,432 paced events").
#
#   scripts/bench/callgrind_serve.sh                       # this checkout's release build
#   BIN=/path/to/aalis-proxy scripts/bench/callgrind_serve.sh   # another build, same drive
#   C=64 EVENTS=100 scripts/bench/callgrind_serve.sh
#
# Two drives of C streams × EVENTS events, one every 5 ms per stream, from
# the stamping upstream of examples/loadgen.rs (tool-heavy capture, seed 8).
# Prints the total, the instructions per event and the calls of the hot
# spots; the callgrind file stays in the work directory for
# `callgrind_annotate`. Needs valgrind. Loopback only; every step bounded by
# `timeout`; the processes started here are stopped here by their pids.
set -euo pipefail
cd "$(dirname "$0")/../.."

work=${WORKDIR:-/tmp/aalis-bench/callgrind-serve}
conc=${C:-16}
events=${EVENTS:-200}
mkdir -p "$work"
command -v valgrind >/dev/null || { echo "callgrind_serve: valgrind is missing" >&2; exit 1; }

# shellcheck source=scripts/bench/proxy_setup.sh
. scripts/bench/proxy_setup.sh
cargo build --locked --release --quiet --bin aalis-proxy
bin=${BIN:-target/release/aalis-proxy}

port=$(free_port)
out="$work/callgrind.serve.out"
valgrind --tool=callgrind --callgrind-out-file="$out" \
  "$bin" serve --upstream "http://127.0.0.1:$up_port" --listen "127.0.0.1:$port" \
  >"$work/serve.log" 2>&1 &
serve_pid=$!
pids+=($serve_pid)
wait_port "$port" 60

total_events=0
for _ in 1 2; do
  n=$(timeout 300 "$loadgen" drive --target "127.0.0.1:$port" --concurrency "$conc" --events "$events" \
    --delay-us 5000 --timeout-seconds 240 | python3 -c 'import json,sys; print(json.load(sys.stdin)["events"])')
  total_events=$((total_events + n))
done
# SIGINT: serve shuts down gracefully and callgrind writes its file.
kill -INT "$serve_pid"
timeout 60 tail --pid="$serve_pid" -f /dev/null || true

total=$(grep -E '^(summary|totals):' "$out" | head -1 | awk '{print $2}')
echo "serve: $total instructions for $total_events paced events (C=$conc), $((total / total_events)) per event"
callgrind_annotate --inclusive=yes "$out" 2>/dev/null \
  | grep -E 'TapBody as http_body::Body>::poll_frame|DrivenBody as http_body::Body>::poll_frame|h1::Conn::poll_io|Annotator::push|StreamHandle::publish' \
  | cut -c1-140 || true
