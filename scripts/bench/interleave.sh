#!/usr/bin/env bash
# Drives of one concurrency through several `serve` builds or settings, and
# nginx, interleaved and rotated from one repetition to the next, for as
# many repetitions as asked: an A/B of one cell with the power the suite's
# five repetitions lack (BENCHMARKS.md, forty-first round). Each drive's
# line gives its latencies, time to first byte, the CPU time and minor
# page faults of the target's processes over the drive, and the TCP
# segments sent on the host an event received (`nstat`'s TcpOutSegs, every
# process's: the upstream's, the target's and the driver's; "-" without
# nstat, from Debian's iproute2), and the target's CPU time and context
# switches for each stream of the drive (with EVENTS=3, a stream's set-up:
# BENCHMARKS.md, forty-fourth round); the summary gives
# the medians and, for each pair of targets, in how many repetitions the
# first was below the second.
#
#   TARGETS="a=target/release/aalis-proxy b=target/release/aalis-proxy" ENV_b="RUST_LOG=warn" \
#     C=256 EVENTS=3 scripts/bench/interleave.sh   # what a stream's set-up costs, log line or not
#
#   TARGETS="pgo=target/pgo/release/aalis-proxy plain=target/release/aalis-proxy" scripts/bench/interleave.sh
#   TARGETS="a=target/release/aalis-proxy b=target/release/aalis-proxy" \
#     ENV_b="_RJEM_MALLOC_CONF=muzzy_decay_ms:-1" GAP=6 scripts/bench/interleave.sh
#   C=64 EVENTS=200 REPS=20 LATENCIES=/tmp/lat scripts/bench/interleave.sh   # and
#   python3 scripts/bench/tail_by_position.py /tmp/lat/*                     # where the tail is
#
# TARGETS: name=binary pairs, names of letters, digits and _ (default:
# this checkout's release build as "serve"); ENV_<name>: environment for
# that one (VAR=value ..., split on spaces). C (256), EVENTS per stream
# (200), DELAY_US between two events of a stream (5000; 0 is unpaced), REPS
# (10), GAP seconds of idleness before each drive (0), NGINX=0 leaves nginx
# out, LATENCIES: a directory for each drive's per-event latencies
# (`loadgen drive --latencies-out`), one file per drive named target.rep.
# Each target is warmed by one short drive at C first. Needs nginx
# (nginx-light) unless NGINX=0. Loopback only; every drive bounded by
# `timeout`; the processes started here are stopped here by their pids.
set -euo pipefail
cd "$(dirname "$0")/../.."

work=${WORKDIR:-/tmp/aalis-bench/interleave}
conc=${C:-256}
events=${EVENTS:-200}
delay_us=${DELAY_US:-5000}
reps=${REPS:-10}
gap=${GAP:-0}
mkdir -p "$work"
[ "${NGINX:-1}" = 0 ] || command -v nginx >/dev/null || { echo "interleave: nginx is missing (or NGINX=0)" >&2; exit 1; }
if [ -n "${LATENCIES:-}" ]; then
  mkdir -p "$LATENCIES"
fi

# shellcheck source=scripts/bench/proxy_setup.sh
. scripts/bench/proxy_setup.sh
if [ -z "${TARGETS:-}" ]; then
  cargo build --locked --release --quiet --bin aalis-proxy
fi

declare -A port pid
names=()
for entry in ${TARGETS:-serve=target/release/aalis-proxy}; do
  name=${entry%%=*}
  bin=${entry#*=}
  [[ $name =~ ^[A-Za-z0-9_]+$ && $name != nginx ]] || { echo "interleave: '$name': a target's name is letters, digits and _ (and not nginx)" >&2; exit 2; }
  [ -x "$bin" ] || { echo "interleave: $bin is not an executable (TARGETS takes name=binary pairs)" >&2; exit 2; }
  envvar="ENV_$name"
  # shellcheck disable=SC2206 # a list of VAR=value words
  extra=(${!envvar:-})
  p=$(free_port)
  env "${extra[@]}" "$bin" serve --upstream "http://127.0.0.1:$up_port" --listen "127.0.0.1:$p" \
    2>"$work/$name.log" &
  pids+=($!)
  pid[$name]=$!
  port[$name]=$p
  names+=("$name")
  wait_port "$p" || { echo "interleave: $name did not start: $(cat "$work/$name.log")" >&2; exit 1; }
done
if [ "${NGINX:-1}" != 0 ]; then
  start_nginx
  pid[nginx]=$nginx_pid
  port[nginx]=$nginx_port
  names+=(nginx)
fi

# The CPU time (ns, from schedstat) and minor page faults of a process and
# its children (nginx's workers).
# shellcheck disable=SC2046 # pgrep prints one pid a line
tree() { echo "$1" $(pgrep -P "$1" || true); }
# The sum over the threads of a process and its children of what awk
# program $3 counts in each thread's /proc file $2.
task_sum() {
  local p
  for p in $(tree "$1"); do cat /proc/"$p"/task/*/"$2" 2>/dev/null || true; done |
    awk "$3"' END {printf "%.0f\n", s}'
}
cpu_ns() { task_sum "$1" schedstat '{s += $1}'; }
# The host's TCP segments sent since the last call (nstat keeps the count
# between calls), or nothing without nstat.
segments() {
  command -v nstat >/dev/null || return 0
  nstat -z TcpOutSegs 2>/dev/null | awk '$1 == "TcpOutSegs" {print $2}'
}
# The context switches (voluntary and not) of a process's threads and its
# children's.
switches() { task_sum "$1" status '/ctxt_switches/ {s += $2}'; }
faults() {
  local s=0 p
  for p in $(tree "$1"); do
    s=$((s + $(awk '{print $10}' /proc/"$p"/stat 2>/dev/null || echo 0)))
  done
  echo "$s"
}
drive() {
  timeout 300 "$loadgen" drive --target "127.0.0.1:$1" --concurrency "$conc" --events "$2" \
    --delay-us "$delay_us" --timeout-seconds 280 "${@:3}"
}

for t in "${names[@]}"; do drive "${port[$t]}" 20 >/dev/null; done
out="$work/drives.txt"
: >"$out"
echo "rep target p50_us p99_us p99_first10_us p99_rest_us ttfb_p50_us events_per_s cpu_ms faults segs_per_event cpu_us_stream switches_stream" | tee -a "$out"
k=${#names[@]}
for rep in $(seq "$reps"); do
  for i in $(seq 0 $((k - 1))); do
    t=${names[$(((i + rep) % k))]}
    sleep "$gap"
    lat=()
    [ -n "${LATENCIES:-}" ] && lat=(--latencies-out "$LATENCIES/$t.$rep")
    c0=$(cpu_ns "${pid[$t]}")
    f0=$(faults "${pid[$t]}")
    x0=$(switches "${pid[$t]}")
    segments >/dev/null
    result=$(drive "${port[$t]}" "$events" "${lat[@]}")
    c1=$(cpu_ns "${pid[$t]}")
    f1=$(faults "${pid[$t]}")
    x1=$(switches "${pid[$t]}")
    s1=$(segments)
    python3 - "$rep" "$t" "$result" $((c1 - c0)) $((f1 - f0)) "${s1:--}" $((x1 - x0)) "$conc" <<'PY' | tee -a "$out"
import json, sys
rep, target, result, cpu_ns, faults, segs, switches, conc = sys.argv[1:]
r = json.loads(result)
if r["errors"]:
    sys.exit(f"interleave: {target} rep {rep}: {r['errors']} failed streams ({r['first_error']})")
print(rep, target, r["latency_us"]["p50"], r["latency_us"]["p99"], r["latency_start_us"]["p99"],
      r["latency_steady_us"]["p99"], r["ttfb_us"]["p50"], round(r["events_per_s"]), int(cpu_ns) // 1000000, faults,
      "-" if segs == "-" or not r["events"] else f"{int(segs) / r['events']:.3f}",
      f"{int(cpu_ns) / 1000 / int(conc):.1f}", f"{int(switches) / int(conc):.2f}")
PY
  done
done

python3 - "$out" "${names[@]}" <<'PY'
import itertools, statistics, sys
rows = [line.split() for line in open(sys.argv[1])][1:]
order = sys.argv[2:]
cols = ["p50_us", "p99_us", "p99_first10_us", "p99_rest_us", "ttfb_p50_us", "events_per_s", "cpu_ms", "faults",
        "segs_per_event", "cpu_us_stream", "switches_stream"]
digits = {"segs_per_event": 3, "cpu_us_stream": 1, "switches_stream": 2}
by = {name: {} for name in order}
for rep, target, *values in rows:
    by.setdefault(target, {})[rep] = [float("nan") if v == "-" else float(v) for v in values]
print(f"\nmedians of {len(next(iter(by.values())))} repetitions")
print("target".ljust(10) + "".join(c.rjust(16) for c in cols))
for target, reps in by.items():
    print(target.ljust(10) + "".join(f"{statistics.median(v[i] for v in reps.values()):16,.{digits.get(c, 0)}f}"
                                      for i, c in enumerate(cols)))
print("\nrepetitions in which the first target was below the second")
for a, b in itertools.combinations(by, 2):
    both = [r for r in by[a] if r in by[b]]
    print(f"{a} < {b}: " + ", ".join(f"{c} {sum(by[a][r][i] < by[b][r][i] for r in both)}/{len(both)}"
                                    for i, c in enumerate(cols)))
PY
