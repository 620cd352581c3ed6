#!/usr/bin/env bash
# Fuzzing (issue 7): runs the cargo-fuzz targets of fuzz/ (libFuzzer), each
# for a bounded time, on a corpus seeded from fixtures/.
#
#   scripts/fuzz.sh                              # every target, 15 s each
#   scripts/fuzz.sh --seconds 600 annotate       # one target, 10 minutes
#   scripts/fuzz.sh --seconds 60 -- -max_len=512 # extra libFuzzer flags after --
#
# Targets: sse_framing ndjson_framing openai_decode ollama_decode
# inject_field annotate chunked_body (what each asserts: fuzz/src/lib.rs).
#
# Options:
#   --seconds N        fuzzing time per target (default 15)
#   --sanitizer S      address | none (default: address when the toolchain
#                      can build it, else none). The crate's one `unsafe`
#                      (a system call as serve starts) is in no
#                      target's path; without ASan a target runs several times more inputs
#                      per second (TESTING.md), which CI's short run wants.
#   --toolchain T      nightly | stable (default: nightly when installed;
#                      stable builds with RUSTC_BOOTSTRAP=1)
#   --jobs N           parallel cargo build jobs (default: cargo's)
#
# Replay a corpus without fuzzing (e.g. under ASan after a run without it):
#   scripts/fuzz.sh --sanitizer address -- -runs=0
#
# Installs cargo-fuzz (cargo install --locked) when it is missing.
# Seeds go to fuzz/corpus/<target>/seed-* (scripts/fuzz/seeds.py), next to
# what earlier runs found; tests/fuzz-regressions/<target>/ is read too.
# One process per target (no -jobs/-workers), one target at a time; each run
# is bounded by `timeout`. Exit status 1 when any target crashed, hung or ran
# out of memory, after printing the artifact's path and how to reproduce it.
set -euo pipefail
cd "$(dirname "$0")/.."

all_targets=(sse_framing ndjson_framing openai_decode ollama_decode inject_field annotate chunked_body)
seconds=15
sanitizer=auto
toolchain_name=auto
targets=()
extra=()
while [ $# -gt 0 ]; do
  case "$1" in
    --seconds) seconds="$2"; shift ;;
    --sanitizer) sanitizer="$2"; shift ;;
    --toolchain) toolchain_name="$2"; shift ;;
    --jobs) export CARGO_BUILD_JOBS="$2"; shift ;;
    -h|--help) sed -n '2,30p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    --) shift; extra=("$@"); break ;;
    -*) echo "fuzz.sh: unknown option $1" >&2; exit 2 ;;
    *) targets+=("$1") ;;
  esac
  shift
done
[ ${#targets[@]} -gt 0 ] || targets=("${all_targets[@]}")
for t in "${targets[@]}"; do
  case " ${all_targets[*]} " in
    *" $t "*) ;;
    *) echo "fuzz.sh: unknown target $t (targets: ${all_targets[*]})" >&2; exit 2 ;;
  esac
done

# cargo-fuzz needs nightly flags (-Z); stable takes them with RUSTC_BOOTSTRAP.
if [ "$toolchain_name" = auto ]; then
  toolchain_name=stable
  if command -v rustup >/dev/null && rustup run nightly rustc --version >/dev/null 2>&1; then
    toolchain_name=nightly
  fi
fi
if [ "$toolchain_name" = nightly ]; then
  toolchain=(+nightly)
  rustc_cmd=(rustup run nightly rustc)
else
  toolchain=()
  rustc_cmd=(rustc)
  export RUSTC_BOOTSTRAP=1
fi

if ! cargo fuzz --version >/dev/null 2>&1; then
  echo "== installing cargo-fuzz"
  cargo install cargo-fuzz --locked
fi

host=$("${rustc_cmd[@]}" -vV | sed -n 's/^host: //p')
if [ "$sanitizer" = auto ]; then
  # AddressSanitizer needs the toolchain's runtime for this host; probe it
  # with an empty program rather than fail the whole build.
  probe=$(mktemp -d)
  if echo 'fn main() {}' > "$probe/p.rs" &&
     RUSTC_BOOTSTRAP=1 "${rustc_cmd[@]}" -Zsanitizer=address --target "$host" \
       -o "$probe/p" "$probe/p.rs" >/dev/null 2>&1 && "$probe/p"; then
    sanitizer=address
  else
    sanitizer=none
  fi
  rm -rf "$probe"
fi

echo "== building fuzz targets (sanitizer: $sanitizer, toolchain: ${toolchain[*]:-stable + RUSTC_BOOTSTRAP})"
build_start=$SECONDS
# cargo-fuzz's default profile: optimized, with debug assertions and
# overflow checks. All targets in one build: they share everything but
# their one-line main.
# One target directory per sanitizer, so switching does not rebuild.
target_dir=fuzz/target/sanitizer-$sanitizer
cargo "${toolchain[@]}" fuzz build --sanitizer "$sanitizer" --target-dir "$target_dir"
echo "built in $((SECONDS - build_start)) s"
bin_dir=$target_dir/$host/release

echo "== seed corpora from fixtures/"
python3 scripts/fuzz/seeds.py .

logs=${TMPDIR:-/tmp}/aalis-fuzz-logs
mkdir -p "$logs"
failed=()
printf '%-15s %10s %8s %7s %7s %9s  %s\n' target runs seconds cov ft corpus result
for t in "${targets[@]}"; do
  corpus=fuzz/corpus/$t
  artifacts=fuzz/artifacts/$t
  mkdir -p "$corpus" "$artifacts"
  regressions=()
  [ -d "tests/fuzz-regressions/$t" ] && regressions=("tests/fuzz-regressions/$t")
  log=$logs/$t.log
  before=$(ls -1 "$artifacts" | wc -l)
  status=0
  # Bounded twice: libFuzzer stops itself after -max_total_time; timeout
  # ends a run that does not (loading a huge corpus, a hang in a callback).
  timeout --kill-after=10 $((seconds + 120)) \
    "$bin_dir/$t" "$corpus" "${regressions[@]}" \
      -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 -max_len=16384 \
      -dict=fuzz/fuzz.dict -artifact_prefix="$artifacts/" -print_final_stats=1 \
      "${extra[@]}" > "$log" 2>&1 || status=$?
  runs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -1)
  time=$(sed -n 's/^Done [0-9]* runs in \([0-9]*\) second.*/\1/p' "$log" | tail -1)
  last=$(grep -E '^#[0-9]+' "$log" | tail -1 || true)
  cov=$(sed -n 's/.* cov: \([0-9]*\).*/\1/p' <<<"$last")
  ft=$(sed -n 's/.* ft: \([0-9]*\).*/\1/p' <<<"$last")
  corp=$(sed -n 's/.* corp: \([0-9]*\)\/.*/\1/p' <<<"$last")
  if [ "$status" -eq 0 ]; then
    result=ok
  else
    result="FAILED (exit $status)"
    failed+=("$t")
  fi
  printf '%-15s %10s %8s %7s %7s %9s  %s\n' "$t" "${runs:--}" "${time:--}" "${cov:--}" "${ft:--}" "${corp:--}" "$result"
  if [ "$status" -ne 0 ]; then
    echo "---- $t: last lines of $log"
    tail -n 40 "$log"
    if [ "$(ls -1 "$artifacts" | wc -l)" -gt "$before" ]; then
      for a in $(ls -1t "$artifacts" | head -n $(( $(ls -1 "$artifacts" | wc -l) - before ))); do
        echo "artifact: $artifacts/$a"
        echo "reproduce: $bin_dir/$t $artifacts/$a"
      done
    fi
    echo "----"
  fi
done

if [ ${#failed[@]} -gt 0 ]; then
  echo "fuzzing failed: ${failed[*]} (logs in $logs)"
  exit 1
fi
echo "fuzzing ok: ${#targets[@]} target(s), ${seconds} s each"
