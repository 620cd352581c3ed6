#!/usr/bin/env bash
# Heap allocations `aalis-proxy serve` makes for each stream, counted by
# valgrind's dhat (exact, unlike wall-clock time): the allocation counts of
# BENCHMARKS.md's forty-sixth round.
#
#   scripts/bench/dhat_serve.sh                         # a stream's set-up: C=32 × 2 events
#   C=16 EVENTS=200 scripts/bench/dhat_serve.sh         # with 200 paced events a stream
#   TOP=40 DEPTH=6 scripts/bench/dhat_serve.sh          # more sites, longer call chains
#
# dhat sees only the system allocator's calls, so the script builds `serve`
# with `--cfg aalis_system_alloc` (the system allocator instead of
# jemalloc; line tables for the sites) into target/system-alloc. It runs
# that build twice under dhat, for DRIVES_LO (2) and DRIVES_HI (6) drives
# of C streams × EVENTS events, one every 5 ms per stream (DELAY_US), from
# the stamping upstream of examples/loadgen.rs; the difference of the two
# runs divided by the streams between them is what a stream costs, with the
# process's start and end cancelled out. Prints the allocations and bytes a
# stream, then the TOP (25) call sites that differ most, each as its first
# DEPTH (4) frames outside the standard library. dhat's files stay in the
# work directory for dhat's viewer. Needs valgrind. Loopback only; every
# step bounded by `timeout`; the processes started here are stopped here by
# their pids.
set -euo pipefail
cd "$(dirname "$0")/../.."

work=${WORKDIR:-/tmp/aalis-bench/dhat-serve}
conc=${C:-32}
events=${EVENTS:-2}
delay_us=${DELAY_US:-5000}
lo=${DRIVES_LO:-2}
hi=${DRIVES_HI:-6}
mkdir -p "$work"
command -v valgrind >/dev/null || { echo "dhat_serve: valgrind is missing" >&2; exit 1; }
[ "$hi" -gt "$lo" ] || { echo "dhat_serve: DRIVES_HI must be more than DRIVES_LO" >&2; exit 2; }

RUSTFLAGS="${RUSTFLAGS:-} --cfg aalis_system_alloc" CARGO_PROFILE_RELEASE_DEBUG=line-tables-only \
  CARGO_TARGET_DIR=target/system-alloc cargo build --locked --release --quiet --bin aalis-proxy
bin=target/system-alloc/release/aalis-proxy

# shellcheck source=scripts/bench/proxy_setup.sh
. scripts/bench/proxy_setup.sh

# One run of serve under dhat with $1 drives; its file is $work/dhat.$1.json,
# and the streams that ended well are added up in $work/ok.$1.
run() {
  local drives=$1 port pid ok=0 n
  port=$(free_port)
  valgrind --tool=dhat --dhat-out-file="$work/dhat.$drives.json" \
    "$bin" serve --upstream "http://127.0.0.1:$up_port" --listen "127.0.0.1:$port" \
    >"$work/serve.$drives.log" 2>&1 &
  pid=$!
  pids+=("$pid")
  wait_port "$port" 60
  for _ in $(seq "$drives"); do
    # A stream that fails would make the counts a stream wrong: none may.
    n=$(timeout 300 "$loadgen" drive --target "127.0.0.1:$port" --concurrency "$conc" --events "$events" \
      --delay-us "$delay_us" --timeout-seconds 240 |
      python3 -c 'import json,sys; d=json.load(sys.stdin); print(d["ok"] if d["errors"] == 0 else -1)')
    [ "$n" -ge 0 ] || { echo "dhat_serve: a drive had failed streams (see $work/serve.$drives.log)" >&2; exit 1; }
    ok=$((ok + n))
  done
  echo "$ok" >"$work/ok.$drives"
  # serve shuts down gracefully on SIGINT; dhat then writes its file.
  kill -INT "$pid"
  for _ in $(seq 240); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
  if kill -0 "$pid" 2>/dev/null; then
    echo "dhat_serve: serve under dhat did not exit within 2 minutes of SIGINT" >&2
    exit 1
  fi
  [ -s "$work/dhat.$drives.json" ] || { echo "dhat_serve: no dhat file for $drives drives" >&2; exit 1; }
}
run "$lo"
run "$hi"

streams=$(($(cat "$work/ok.$hi") - $(cat "$work/ok.$lo")))
python3 - "$work/dhat.$lo.json" "$work/dhat.$hi.json" "$streams" "${TOP:-25}" "${DEPTH:-4}" <<'PY'
import json, re, sys

lo_path, hi_path, streams, top, depth = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])


def sites(path):
    """{call chain: [blocks, bytes]}: each chain its first `depth` frames
    that have a source line (valgrind's and the C allocator's have none)
    outside Rust's standard library."""
    data = json.load(open(path))
    frames = data["ftbl"]
    out = {}
    for pp in data["pps"]:
        chain = []
        for i in pp["fs"]:
            m = re.search(r"\(([^()]*:\d+)\)$", frames[i])
            if not m:
                continue
            where = m.group(1)
            if where.startswith("library/") or "/rustc/" in where:
                continue
            if "/registry/src/" in where:
                where = re.sub(r".*/registry/src/[^/]*/", "", where)  # a crate's: hyper-1.12.0/src/...
            else:
                where = re.sub(r"^.*?/src/", "src/", where)  # this repository's: src/...
            chain.append(where)
        key = " < ".join(chain[:depth]) or "(no frame outside the standard library)"
        entry = out.setdefault(key, [0, 0])
        entry[0] += pp["tbk"]
        entry[1] += pp["tb"]
    return out


lo, hi = sites(lo_path), sites(hi_path)
rows = []
for key in set(lo) | set(hi):
    a, b = lo.get(key, [0, 0]), hi.get(key, [0, 0])
    rows.append(((b[0] - a[0]) / streams, (b[1] - a[1]) / streams, key))
blocks = sum(r[0] for r in rows)
size = sum(r[1] for r in rows)
print(f"serve: {blocks:.1f} allocations, {size:,.0f} bytes a stream ({streams} streams between the two runs)")
print(f"{'allocations':>11} {'bytes':>8}  call site (innermost first)")
for n, b, key in sorted(rows, key=lambda r: -abs(r[0]))[:top]:
    if abs(n) >= 0.05:
        print(f"{n:11.2f} {b:8.0f}  {key}")
PY
