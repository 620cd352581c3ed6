#!/usr/bin/env bash
# The load test of issue 7 (examples/loadtest.rs): concurrent streams through
# `aalis-proxy serve` with every byte checked, upstream faults, slow readers
# and lines with no newline, with serve's memory read from /proc. Prints a
# short report; exits non-zero when a check fails. See TESTING.md.
#
#   scripts/loadtest.sh            # full: 1,000 streams, 100 slow readers for 20 s, a 1 GiB line (~45 s after the build)
#   scripts/loadtest.sh --smoke    # small: 50 streams, 10 slow readers for 5 s, a 64 MiB line (~10 s after the build)
#   scripts/loadtest.sh --debug    # with the test profile's builds (CI has them from `cargo test`) instead of release ones
#
# Other options go to the tool: --only exact,churn,mock,faults,slow,line,
# --streams N, --slow-readers N, --slow-seconds S, --line-mib N,
# --serve-arg=--FLAG=VALUE (for every serve), --workdir DIR (logs; default
# /tmp/aalis-loadtest), --help.
#
# Loopback only; every wait in the tool has a deadline, the tool stops itself
# after --max-seconds, and timeout(1) stops it and its children after a
# further margin, whatever happens.
set -euo pipefail
cd "$(dirname "$0")/.."

mode=full
profile=release
args=()
while [ $# -gt 0 ]; do
  case "$1" in
    --smoke) mode=smoke ;;
    --debug) profile=debug ;;
    -h|--help) sed -n '2,18p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) args+=("$1") ;;
  esac
  shift
done

if [ "$mode" = smoke ]; then
  sizes=(--streams 50 --churn-streams 500 --slow-readers 10 --slow-seconds 5 --line-mib 64 --line-streams 2 --idle-timeout-ms 1000 --max-seconds 150)
  limit=180
else
  sizes=(--max-seconds 600)
  limit=660
fi

# 1,000 streams take ~2,000 descriptors in the tool and as many in serve
# (which inherits this limit).
hard=$(ulimit -Hn)
if [ "$hard" = unlimited ] || [ "$hard" -ge 16384 ]; then ulimit -n 16384; else ulimit -n "$hard"; fi

export CARGO_TERM_COLOR=never
if [ "$profile" = release ]; then
  cargo build --locked --release --quiet --bin aalis-proxy --example loadtest
else
  cargo build --locked --quiet --bin aalis-proxy --example loadtest
fi
bin="target/$profile"

# timeout(1) runs the tool in a process group of its own and, at the limit,
# signals the whole group: the tool and every serve it started.
exec timeout --signal=TERM --kill-after=30s "${limit}s" \
  "$bin/examples/loadtest" --aalis "$bin/aalis-proxy" "${sizes[@]}" ${args[@]+"${args[@]}"}
