#!/usr/bin/env bash
# System calls, context switches and CPU per event of `aalis-proxy serve`,
# of a second build (or the same build with other flags) and of nginx, in
# interleaved drives against the same stamping upstream: the evidence behind
# BENCHMARKS.md's twenty-fifth round ("where the unpaced gap is").
#
#   scripts/bench/per_event.sh                         # unpaced, C = 256, 64, 16, 3 drives each
#   OTHER=target/forward-only/release/aalis-proxy scripts/bench/per_event.sh
#   OTHER=target/release/aalis-proxy OTHER_ARGS="--threads 1" scripts/bench/per_event.sh
#   DELAY_US=5000 EVENTS=200 CS="16 64" REPS=5 scripts/bench/per_event.sh   # paced
#   OTHER=target/release/aalis-proxy OTHER_SCHED=b scripts/bench/per_event.sh  # the same build under SCHED_BATCH
#
# Each drive sends EVENTS events per stream (unpaced: 200,000 / C) through
# one target while `perf stat` counts that target's syscall tracepoints,
# context switches and task clock; one line per drive, the counts divided
# by the events the driver received, with the CPU an event of the stamping
# upstream (its threads' schedstat) and of the load driver (`perf stat`'s
# task clock) beside the target's: the three processes' CPU an event
# (fifty-third round). After each drive of serve or nginx,
# the CPU each worker thread or process spent in it (/proc/*/schedstat)
# shows how the load was spread between them. BIN is serve's build
# (default: this checkout's release build); OTHER, when set, is driven as
# "other". Needs perf (Debian: linux-perf) and nginx (nginx-light); the
# processes run as the user (perf may need kernel.perf_event_paranoid <= 1).
# Loopback only; every drive bounded by `timeout`; the processes started
# here are stopped here by their pids.
set -euo pipefail
cd "$(dirname "$0")/../.."

work=${WORKDIR:-/tmp/aalis-bench/per-event}
delay_us=${DELAY_US:-0}
reps=${REPS:-3}
mkdir -p "$work"
for tool in perf nginx; do
  command -v "$tool" >/dev/null || { echo "per_event: $tool is missing" >&2; exit 1; }
done

# shellcheck source=scripts/bench/proxy_setup.sh
. scripts/bench/proxy_setup.sh
if [ -z "${BIN:-}" ]; then
  cargo build --locked --release --quiet --bin aalis-proxy
fi
bin=${BIN:-target/release/aalis-proxy}

start_serve() { # name, binary, extra args (word-split on purpose)
  local port
  port=$(free_port)
  # shellcheck disable=SC2086
  "$2" serve $3 --upstream "http://127.0.0.1:$up_port" --listen "127.0.0.1:$port" >"$work/$1.log" 2>&1 &
  pids+=($!)
  wait_port "$port"
  ports[$1]=$port
  procs[$1]=$!
}
declare -A ports procs
start_serve serve "$bin" ""
targets=(serve)
if [ -n "${OTHER:-}" ]; then
  start_serve other "$OTHER" "${OTHER_ARGS:-}"
  targets+=(other)
  if [ -n "${OTHER_SCHED:-}" ]; then
    # Every thread of the other process under that policy (chrt's
    # option letter: b for SCHED_BATCH), set once it runs.
    for t in "/proc/${procs[other]}"/task/*; do chrt "-$OTHER_SCHED" -p 0 "${t##*/}"; done
  fi
fi
start_nginx
ports[nginx]=$nginx_port
procs[nginx]=$nginx_workers
targets+=(nginx)

# The worker threads of a serve process, or nginx's worker processes.
workers() {
  if [ "$1" = nginx ]; then
    echo "${procs[nginx]}" | tr , '\n' | sed 's|^|/proc/|'
  else
    ls -d "/proc/${procs[$1]}"/task/*
  fi
}
# A process's CPU so far in ns, all its threads (schedstat).
task_ns() {
  cat "/proc/$1"/task/*/schedstat | awk '{s += $1} END {printf "%.0f", s}'
}
# Per worker: its CPU in ms (schedstat), then its user and system time in
# clock ticks (stat's fields 14 and 15; the command name, field 2, may hold
# spaces, so fields are counted after its closing parenthesis).
cpu_ms() {
  for w in $(workers "$1"); do
    awk -v w="${w##*/}" '{printf "%s %d", w, $1 / 1e6}' "$w/schedstat"
    sed 's/.*) //' "$w/stat" | awk '{printf " %d %d\n", $12, $13}'
  done
}

# serve writes with `sendto` (hyper flattens each frame into one buffer,
# twenty-sixth round), nginx with `writev`; `futex` would be a worker
# waking another.
events='raw_syscalls:sys_enter,syscalls:sys_enter_recvfrom,syscalls:sys_enter_sendto,'
events+='syscalls:sys_enter_writev,syscalls:sys_enter_epoll_wait,syscalls:sys_enter_futex,'
events+='syscalls:sys_enter_sched_yield,context-switches,task-clock'
for c in ${CS:-256 64 16}; do
  if [ "$delay_us" = 0 ]; then n=${EVENTS:-$((200000 / c))}; else n=${EVENTS:-200}; fi
  for rep in $(seq "$reps"); do
    for t in "${targets[@]}"; do
      perf stat -x, -e "$events" -p "${procs[$t]}" -o "$work/stat" &
      perf_pid=$!
      sleep 0.3
      cpu_ms "$t" >"$work/before"
      up_before=$(task_ns "$up_pid")
      result=$(timeout 300 perf stat -x, -e task-clock -o "$work/driver" -- \
        "$loadgen" drive --target "127.0.0.1:${ports[$t]}" --concurrency "$c" --events "$n" \
        --delay-us "$delay_us" --timeout-seconds 280)
      up_after=$(task_ns "$up_pid")
      cpu_ms "$t" >"$work/after"
      kill -INT "$perf_pid"
      wait "$perf_pid" || true
      python3 - "$work/stat" "$result" "$t" "$c" "$rep" "$work/before" "$work/after" \
        "$((up_after - up_before))" "$work/driver" <<'PY'
import json, sys
path, result, target, c, rep, before, after, up_ns, driver = sys.argv[1:]
r = json.loads(result)
n = max(r["events"], 1)
driver_ms = next((float(l.split(",")[0]) for l in open(driver) if "task-clock" in l), None)
driver_us = "n/a" if driver_ms is None else f"{driver_ms * 1000 / n:.2f}"
counts = {}
for line in open(path):
    f = line.strip().split(",")
    if len(f) > 3 and f[0][:1].isdigit():
        counts[f[2].split(":")[-1].replace("sys_enter_", "")] = float(f[0])
cpu = counts.pop("task-clock", 0.0) * 1000 / n  # task-clock is in ms
per = " ".join(f"{k}={v / n:.3f}" for k, v in counts.items())
b = {l.split()[0]: [int(x) for x in l.split()[1:]] for l in open(before)}
a = {l.split()[0]: [int(x) for x in l.split()[1:]] for l in open(after)}
d = {k: [x - y for x, y in zip(v, b.get(k, [0, 0, 0]))] for k, v in a.items()}
spread = "/".join(str(v[0]) for v in sorted(d.values(), reverse=True) if v[0] > 0)
user, system = sum(v[1] for v in d.values()), sum(v[2] for v in d.values())
spread += f"; user {100 * user / max(user + system, 1):.0f} % of ticks"
print(f"{target:5} C={c:>3} drive {rep}: {r['events_per_s']:>8.0f} events/s, "
      f"p50 {r['latency_us']['p50']:.0f} p99 {r['latency_us']['p99']:.0f} µs, "
      f"CPU {cpu:.2f} µs/event (upstream {int(up_ns) / 1000 / n:.2f}, driver {driver_us}); "
      f"per event {per}; workers' CPU ms {spread}")
PY
    done
  done
done
