# Sourced by the scripts that drive `serve` (profile_proxy.sh,
# callgrind_serve.sh, scripts/pgo.sh), after they set `work`: the load
# driver's build (`loadgen`), the sample capture, the stamping upstream on a
# free loopback port (`up_port`), and cleanup of every process started (add
# its pid to `pids`). A caller may set `cargo_dir` (`release`, the default,
# or `debug`) and `sample` (the capture to serve; by default a tool-heavy
# one of 2 MB, seed 8, the benchmark suite's) first.

cargo_dir=${cargo_dir:-release}
if [ "$cargo_dir" = release ]; then
  cargo build --locked --release --quiet --example loadgen
else
  cargo build --locked --quiet --example loadgen
fi
loadgen=target/$cargo_dir/examples/loadgen
sample=${sample:-$work/sample.sse}
[ -s "$sample" ] || python3 scripts/bench/gen_captures.py --kind tool --mb 2 --seed 8 --out "$sample" 2>/dev/null

pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  for p in "${pids[@]}"; do timeout 15 tail --pid="$p" -f /dev/null 2>/dev/null || true; wait "$p" 2>/dev/null || true; done
}
trap cleanup EXIT
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
wait_port() { timeout "${2:-10}" bash -c "until (exec 3<>/dev/tcp/127.0.0.1/$1) 2>/dev/null; do sleep 0.05; done"; }

"$loadgen" upstream --events "$sample" --max-seconds 600 >"$work/upstream.out" 2>/dev/null &
pids+=($!)
timeout 10 bash -c "until [ -s '$work/upstream.out' ]; do sleep 0.05; done"
up_port=$(sed 's/.*://' "$work/upstream.out")
