#!/usr/bin/env bash
# Where `aalis-proxy serve` spends an unpaced stream, next to nginx: syscalls
# per event (strace -c) and CPU samples by symbol (perf record -e cpu-clock,
# which works where hardware counters do not, as in this VM). The evidence
# behind the proxy section of BENCHMARKS.md.
#
#   scripts/bench/profile_proxy.sh            # C=16 streams of 5,000 events
#   C=64 EVENTS=2000 scripts/bench/profile_proxy.sh
#
# Needs strace and perf (Debian: strace, linux-perf); nginx is optional.
# Release builds; loopback only; every step bounded by `timeout`; the
# processes started here are stopped here by their pids.
set -euo pipefail
cd "$(dirname "$0")/../.."

work=${WORKDIR:-/tmp/aalis-bench/profile-proxy}
conc=${C:-16}
events=${EVENTS:-5000}
mkdir -p "$work"
for tool in strace perf; do
  command -v "$tool" >/dev/null || { echo "profile_proxy: $tool is missing" >&2; exit 1; }
done

# shellcheck source=scripts/bench/proxy_setup.sh
. scripts/bench/proxy_setup.sh
cargo build --locked --release --quiet --bin aalis-proxy
bin=target/release

aalis_port=$(free_port)
"$bin/aalis-proxy" serve --upstream "http://127.0.0.1:$up_port" --listen "127.0.0.1:$aalis_port" \
  >"$work/serve.log" 2>&1 &
aalis_pid=$!
pids+=($aalis_pid)
wait_port "$aalis_port"

drive() {
  timeout 120 "$bin/examples/loadgen" drive --target "127.0.0.1:$1" --concurrency "$conc" \
    --events "$events" --delay-us 0 --timeout-seconds 100
}

# profile NAME PORT PID...: strace counts, then perf samples, over one run each.
profile() {
  local name=$1 port=$2
  shift 2
  local attach=()
  for p in "$@"; do attach+=(-p "$p"); done
  echo "== $name: strace -c over $conc × $events unpaced events"
  timeout 150 strace -c -f "${attach[@]}" -o "$work/strace.$name.txt" 2>/dev/null &
  local st=$!
  sleep 0.5
  drive "$port" | python3 -c 'import json,sys; r=json.load(sys.stdin); print("events", r["events"], "events/s (under strace)", round(r["events_per_s"]))'
  sleep 0.3
  kill -INT "$st" 2>/dev/null || true
  wait "$st" 2>/dev/null || true
  head -12 "$work/strace.$name.txt" || true
  echo "== $name: perf record -e cpu-clock"
  local pidlist
  pidlist=$(IFS=,; echo "$*")
  timeout 150 perf record -q -e cpu-clock -g -p "$pidlist" -o "$work/perf.$name.data" 2>/dev/null &
  local pr=$!
  sleep 0.5
  drive "$port" | python3 -c 'import json,sys; r=json.load(sys.stdin); print("events", r["events"], "events/s (under perf)", round(r["events_per_s"]))'
  kill -INT "$pr" 2>/dev/null || true
  wait "$pr" 2>/dev/null || true
  # (head closing the pipe early is fine: hence the `|| true`.)
  perf report -i "$work/perf.$name.data" --stdio --no-children --sort dso 2>/dev/null \
    | grep -E '^ +[0-9.]+%' | head -5 || true
  perf report -i "$work/perf.$name.data" --stdio --no-children --sort sym -g none 2>/dev/null \
    | grep -E '^ +[0-9.]+%' | head -25 | cut -c1-150 || true
}

profile aalis "$aalis_port" "$aalis_pid"

if command -v nginx >/dev/null; then
  start_nginx
  # shellcheck disable=SC2046
  profile nginx "$nginx_port" $(echo "$nginx_workers" | tr , ' ')
  kill -QUIT "$nginx_pid"
fi
