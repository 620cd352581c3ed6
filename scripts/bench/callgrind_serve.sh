#!/usr/bin/env bash
# Instructions `aalis-proxy serve` spends on paced events, counted by
# callgrind (stable on a noisy machine, unlike wall-clock time): the
# before/after figures of the proxy in BENCHMARKS.md ("6,432 paced events").
#
#   scripts/bench/callgrind_serve.sh                       # this checkout's release build
#   BIN=/path/to/aalis-proxy scripts/bench/callgrind_serve.sh   # another build, same drive
#   C=64 EVENTS=100 scripts/bench/callgrind_serve.sh
#   DELAY_US=0 C=16 EVENTS=1000 scripts/bench/callgrind_serve.sh   # unpaced: as fast as it goes
#   sample=/tmp/text.sse C=1 EVENTS=1000 scripts/bench/callgrind_serve.sh   # another capture
#   DRIVES=6 C=32 EVENTS=2 scripts/bench/callgrind_serve.sh   # with DRIVES=2: a stream's set-up
#   CACHE_SIM=1 C=4 EVENTS=400 ARGS="--threads 1" scripts/bench/callgrind_serve.sh
#   CACHE_SIM=1 C=4 EVENTS=400 TARGET=nginx scripts/bench/callgrind_serve.sh
#   CACHE_SIM=1 CACHE_ARGS="--LL=524288,16,64" C=64 EVENTS=200 ARGS="--threads 1" scripts/bench/callgrind_serve.sh   # a 512 KiB last level
#
# DRIVES (two unless set) drives of C streams × EVENTS events, one every 5 ms per stream
# (DELAY_US), from the stamping upstream of examples/loadgen.rs (tool-heavy
# capture, seed 8, unless `sample` names another capture, for example one of
# scripts/bench/gen_captures.py's).
# Prints the total, the instructions per event and the calls of the hot
# spots; the callgrind file stays in the work directory for
# `callgrind_annotate`.
#
# CACHE_SIM=1 also simulates the caches (callgrind's 32 KiB L1s) and prints
# each count per event, L1 instruction misses (I1mr) and data misses (D1mr,
# D1mw) among them: how much code and data an event touches beyond what
# stays in the first-level caches. Valgrind runs about twice as slowly
# then, so keep C low enough for the proxy to keep the pace (C=4), and run
# serve with ARGS="--threads 1": valgrind runs one thread at a time and
# simulates one cache for all of them. TARGET=nginx counts nginx instead
# (one worker, no master process; Debian's nginx-light), with the same
# upstream and drives. Needs valgrind. Loopback only; every step bounded by
# `timeout`; the processes started here are stopped here by their pids.
set -euo pipefail
cd "$(dirname "$0")/../.."

work=${WORKDIR:-/tmp/aalis-bench/callgrind-serve}
conc=${C:-16}
events=${EVENTS:-200}
delay_us=${DELAY_US:-5000}
drives=${DRIVES:-2}
pace=paced
[ "$delay_us" = 0 ] && pace=unpaced
target=${TARGET:-serve}
mkdir -p "$work"
command -v valgrind >/dev/null || { echo "callgrind_serve: valgrind is missing" >&2; exit 1; }
case "$target" in
  serve) ;;
  nginx) command -v nginx >/dev/null || { echo "callgrind_serve: nginx is missing" >&2; exit 1; } ;;
  *) echo "callgrind_serve: TARGET must be serve or nginx" >&2; exit 2 ;;
esac
cache=()
# shellcheck disable=SC2206 # CACHE_ARGS is a list of valgrind flags
[ "${CACHE_SIM:-0}" = 1 ] && cache=(--cache-sim=yes ${CACHE_ARGS:-})

# shellcheck source=scripts/bench/proxy_setup.sh
. scripts/bench/proxy_setup.sh

port=$(free_port)
out="$work/callgrind.$target.out"
if [ "$target" = nginx ]; then
  mkdir -p "$work/nginx/tmp"
  chmod 777 "$work/nginx/tmp"
  # The suite's configuration (scripts/bench/run.py), with one worker in
  # the foreground process, so that callgrind sees all of nginx's work.
  PYTHONDONTWRITEBYTECODE=1 python3 - "$work/nginx" "$up_port" "$port" <<'PY'
import sys
sys.path.insert(0, "scripts/bench")
import run
d, up, port = sys.argv[1:]
conf = run.NGINX_CONF.format(dir=d, up_port=up, port=port)
conf = conf.replace("worker_processes auto;", "worker_processes 1;\nmaster_process off;")
open(f"{d}/nginx.conf", "w").write(conf)
PY
  valgrind --tool=callgrind "${cache[@]}" --callgrind-out-file="$out" \
    nginx -p "$work/nginx" -c "$work/nginx/nginx.conf" >"$work/nginx.log" 2>&1 &
else
  cargo build --locked --release --quiet --bin aalis-proxy
  bin=${BIN:-target/release/aalis-proxy}
  # shellcheck disable=SC2086 # ARGS is a list of flags
  valgrind --tool=callgrind "${cache[@]}" --callgrind-out-file="$out" \
    "$bin" serve --upstream "http://127.0.0.1:$up_port" --listen "127.0.0.1:$port" ${ARGS:-} \
    >"$work/serve.log" 2>&1 &
fi
target_pid=$!
pids+=("$target_pid")
wait_port "$port" 60

total_events=0
for _ in $(seq "$drives"); do
  n=$(timeout 300 "$loadgen" drive --target "127.0.0.1:$port" --concurrency "$conc" --events "$events" \
    --delay-us "$delay_us" --timeout-seconds 240 | python3 -c 'import json,sys; print(json.load(sys.stdin)["events"])')
  total_events=$((total_events + n))
done
# serve shuts down gracefully on SIGINT, nginx on SIGQUIT; callgrind then
# writes its file.
if [ "$target" = nginx ]; then kill -QUIT "$target_pid"; else kill -INT "$target_pid"; fi
timeout 60 tail --pid="$target_pid" -f /dev/null || true

total=$(grep -E '^(summary|totals):' "$out" | head -1 | awk '{print $2}')
echo "$target: $total instructions for $total_events $pace events (C=$conc), $((total / total_events)) per event"
if [ "${CACHE_SIM:-0}" = 1 ]; then
  python3 - "$out" "$total_events" <<'PY'
import sys
path, n = sys.argv[1], int(sys.argv[2])
names = counts = None
for line in open(path):
    if line.startswith("events:"):
        names = line.split()[1:]
    elif line.startswith(("summary:", "totals:")):
        counts = [int(x) for x in line.split()[1:]]
        break
print("per event: " + ", ".join(f"{k} {v / n:,.0f}" for k, v in zip(names, counts)))
PY
fi
[ "$target" = serve ] || exit 0
callgrind_annotate --inclusive=yes "$out" 2>/dev/null \
  | grep -E 'TapBody as http_body::Body>::poll_frame|h1::Conn::poll_fill|Annotator::push|StreamHandle::publish' \
  | cut -c1-140 || true
