#!/usr/bin/env bash
# The benchmark suite of issue 6: one command, one run, one table of medians
# and ratios (filter throughput against cat|cat, jq and Python; proxy
# overhead against a direct connection and nginx; memory per open stream and
# over a soak; instruction counts; criterion micro-benchmarks). See
# BENCHMARKS.md for the method and the latest results.
#
#   scripts/bench.sh                      # the full suite, with the issue's 10-minute soak (~23 min of
#                                         # machine time after the builds, which include scripts/pgo.sh's)
#   scripts/bench.sh --soak-seconds 120   # ... with a 2-minute soak, which is not judged
#   scripts/bench.sh --smoke              # seconds: tiny sizes, C=1/4, proves it works
#
# Other options are passed to scripts/bench/run.py: --reps N, --mb N,
# --only throughput,callgrind,proxy,memory,criterion, --workdir DIR,
# --fresh-processes (the proxies started afresh for each repetition).
#
# Loopback only; every loop is bounded in count and time, and the run stops by
# itself. The full suite installs nginx and jq from Debian's packages when they
# are missing (as root, with apt-get); --smoke installs nothing and needs only
# the Rust toolchain and python3 (jq and nginx comparisons are skipped, with a
# note, when they are missing; AALIS_BENCH_WITHOUT=jq,nginx does the same where
# they are installed). Generated captures stay in /tmp/aalis-bench.
set -euo pipefail
cd "$(dirname "$0")/.."

mode=full
args=()
while [ $# -gt 0 ]; do
  case "$1" in
    --smoke) mode=smoke ;;
    -h|--help) sed -n '2,21p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) args+=("$1") ;;
  esac
  shift
done

if [ "$mode" = full ]; then
  missing=()
  command -v nginx >/dev/null || missing+=(nginx-light)
  command -v jq >/dev/null || missing+=(jq)
  if [ ${#missing[@]} -gt 0 ]; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
      echo "bench: installing ${missing[*]} from Debian's packages" >&2
      apt-get update -qq >/dev/null
      DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
    else
      echo "bench: ${missing[*]} missing and cannot be installed here; those comparisons are skipped" >&2
    fi
  fi
fi

# 1,000 idle streams need ~2,000 descriptors in the proxy and in nginx.
hard=$(ulimit -Hn)
if [ "$hard" = unlimited ] || [ "$hard" -ge 16384 ]; then ulimit -n 16384; else ulimit -n "$hard"; fi

export CARGO_TERM_COLOR=never
if [ "$mode" = full ]; then
  # Release builds: what users run. The binary measured is the release
  # build with profile-guided optimization (scripts/pgo.sh, how release
  # binaries are made); the plain `cargo build --release` is measured
  # beside it (--plain). AALIS_BENCH_PLAIN_ONLY=1 measures the plain build
  # alone, as the suite did before the fourteenth round. The binary is
  # built alone, after the load driver: built together with an example it
  # would carry the features the dev-dependencies turn on (tokio's
  # test-util, whose clock takes a lock at every read), which `cargo build
  # --release` leaves out (fifty-second round).
  cargo build --locked --release --quiet --example loadgen
  cargo build --locked --release --quiet --bin aalis-proxy
  bin=target/release
  if [ "${AALIS_BENCH_PLAIN_ONLY:-}" = 1 ]; then
    aalis=$bin/aalis-proxy
  else
    aalis=$(scripts/pgo.sh | tail -n 1)
    args+=(--plain "$bin/aalis-proxy")
  fi
  # The forward-only build (`--cfg aalis_forward_only`: serve annotates
  # nothing), a fourth proxy target: what the HTTP path costs without
  # parsing. Its own target directory, as the flag rebuilds everything;
  # only when the proxy part runs.
  only=proxy
  for ((i = 0; i < ${#args[@]}; i++)); do
    case "${args[i]}" in
      --only) only=${args[i + 1]:-} ;;
      --only=*) only=${args[i]#--only=} ;;
    esac
  done
  case ",$only," in
    *,proxy,*)
      RUSTFLAGS="${RUSTFLAGS:-} --cfg aalis_forward_only" CARGO_TARGET_DIR=target/forward-only \
        cargo build --locked --release --quiet --bin aalis-proxy
      args+=(--forward-only target/forward-only/release/aalis-proxy)
      ;;
  esac
  limit=45m
else
  # The test profile's builds (CI has them from `cargo test` already): the
  # smoke run proves the suite works; its numbers mean nothing.
  cargo build --locked --quiet --bin aalis-proxy --example loadgen
  bin=target/debug
  aalis=$bin/aalis-proxy
  # The same binary again as the plain build: exercises those rows.
  args+=(--plain "$bin/aalis-proxy")
  limit=10m
fi

exec timeout --signal=TERM --kill-after=30s "$limit" \
  python3 scripts/bench/run.py --mode "$mode" \
  --aalis "$aalis" --loadgen "$bin/examples/loadgen" ${args[@]+"${args[@]}"}
