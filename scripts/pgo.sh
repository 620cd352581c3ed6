#!/usr/bin/env bash
# The release build of aalis-proxy, optimized with a profile of its own hot
# paths (profile-guided optimization, rustc's -Cprofile-generate and
# -Cprofile-use): an instrumented build, a training run, the merged profile,
# the final build. See BENCHMARKS.md (fourteenth round) for what it gains.
#
#   scripts/pgo.sh           # → target/pgo/release/aalis-proxy (~10 min)
#   scripts/pgo.sh --smoke   # debug builds, a tiny training run: proves the
#                            # script works (CI); the binary means nothing
#
# The training run is loopback only and bounded in count and time:
# `annotate` over every capture in fixtures/ and over generated captures
# (seed 1; the benchmark suite measures seeds 6 to 9), in every output format
# and injection mode; then `serve` in front of the stamping upstream of
# examples/loadgen, driven paced and unpaced. It needs the llvm-profdata of
# rustc's own LLVM: the `llvm-tools` rustup component is added when missing.
# Prints the path of the binary it built on its last line.
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$(pwd)

mode=full
case "${1:-}" in
  --smoke) mode=smoke ;;
  "") ;;
  -h|--help) sed -n '2,17p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
  *) echo "pgo: unknown argument '$1' (try --help)" >&2; exit 2 ;;
esac

log() { echo "pgo: $*" >&2; }

host=$(rustc -vV | sed -n 's/^host: //p')
profdata="$(rustc --print sysroot)/lib/rustlib/$host/bin/llvm-profdata"
if [ ! -x "$profdata" ]; then
  log "adding the llvm-tools rustup component (for llvm-profdata)"
  rustup component add llvm-tools >&2
fi
if [ ! -x "$profdata" ]; then
  log "no llvm-profdata at $profdata after adding llvm-tools; cannot merge the profile"
  exit 1
fi

export CARGO_TERM_COLOR=never
work=$repo/target/pgo-work
rm -rf "$work"
mkdir -p "$work/profiles"
if [ "$mode" = full ]; then
  profile=(--release); dir=release; mb=20; events=400
else
  profile=(); dir=debug; mb=0.05; events=5
fi

log "instrumented build"
RUSTFLAGS="${RUSTFLAGS:-} -Cprofile-generate=$work/profiles" CARGO_TARGET_DIR=target/pgo-gen \
  cargo build --locked --quiet "${profile[@]}" --bin aalis-proxy
gen=$repo/target/pgo-gen/$dir/aalis-proxy

log "training: annotate"
inputs=()
for kind in tool text ollama; do
  ext=sse; [ "$kind" = ollama ] && ext=ndjson
  python3 scripts/bench/gen_captures.py --kind "$kind" --mb "$mb" --seed 1 --out "$work/$kind.$ext" >/dev/null 2>&1
  inputs+=("$work/$kind.$ext")
done
while IFS= read -r f; do inputs+=("$f"); done < <(find fixtures -type f \( -name '*.sse' -o -name '*.ndjson' \) | sort)
for f in "${inputs[@]}"; do
  for run in "--inject field" "--inject comment" "--inject event" "--inject chunk" "--inject none" \
             "--format ndjson" "--format messages --session train"; do
    # Malformed fixtures are part of the training: their warnings (and
    # exit status) are expected.
    # shellcheck disable=SC2086
    timeout 120 "$gen" annotate $run "$f" >/dev/null 2>&1 || true
  done
done

log "training: serve"
# The stamping upstream serves the tool-heavy capture above; the load
# driver and the upstream are an ordinary build, not what is profiled.
cargo_dir=$dir
sample=$work/tool.sse
# shellcheck source=scripts/bench/proxy_setup.sh
. scripts/bench/proxy_setup.sh
port=$(free_port)
"$gen" serve --upstream "http://127.0.0.1:$up_port" --listen "127.0.0.1:$port" 2>"$work/serve.log" &
serve=$!
pids+=("$serve")
wait_port "$port" || { log "serve did not start: $(cat "$work/serve.log")"; exit 1; }
for run in "1 $events 5000" "16 $events 1000" "64 $events 0" "16 $events 0"; do
  read -r c n delay <<<"$run"
  "$loadgen" drive --target "127.0.0.1:$port" --concurrency "$c" --events "$n" --delay-us "$delay" \
    --timeout-seconds 120 >/dev/null
done
# The profile is written when the process exits: a graceful stop.
kill -INT "$serve"
wait "$serve" || true

log "merging $(find "$work/profiles" -name '*.profraw' | wc -l) profiles"
# --sparse drops the functions the training never ran: without a profile
# they are optimized as in the plain build, where with counts of zero they
# would be taken for cold and optimized for size (TLS, HTTP/2 upstreams,
# the admin routes: paths users run that the training does not).
"$profdata" merge --sparse -o "$work/merged.profdata" "$work/profiles"
# Cargo does not look into the profile: naming it by its contents makes a
# new profile a new build.
merged=$work/merged-$(sha256sum "$work/merged.profdata" | cut -c1-16).profdata
mv "$work/merged.profdata" "$merged"

log "optimized build"
RUSTFLAGS="${RUSTFLAGS:-} -Cprofile-use=$merged" CARGO_TARGET_DIR=target/pgo \
  cargo build --locked --quiet "${profile[@]}" --bin aalis-proxy
echo "$repo/target/pgo/$dir/aalis-proxy"
