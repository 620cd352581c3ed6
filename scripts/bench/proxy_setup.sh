# Sourced by the scripts that drive `serve` (profile_proxy.sh, per_event.sh,
# interleave.sh, callgrind_serve.sh, dhat_serve.sh, scripts/pgo.sh), after
# they make `work`: the load driver's build (`loadgen`), the sample capture,
# the stamping upstream on a free loopback port (`up_port`; its pid
# `up_pid`), cleanup of every process started (add its pid to `pids`), and
# `start_nginx` for the scripts that compare with nginx. A caller may set
# `cargo_dir` (`release`, the default, or `debug`) and `sample` (the capture
# to serve; by default a tool-heavy one of 2 MB, seed 8, the benchmark
# suite's) first.

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

# A work directory used before holds the last run's port: not read.
rm -f "$work/upstream.out"
"$loadgen" upstream --events "$sample" --max-seconds 600 >"$work/upstream.out" 2>/dev/null &
pids+=($!)
up_pid=$!
timeout 10 bash -c "until [ -s '$work/upstream.out' ]; do sleep 0.05; done"
up_port=$(sed 's/.*://' "$work/upstream.out")

# start_nginx: nginx with the suite's configuration (run.py's NGINX_CONF,
# `proxy_buffering off`, keep-alive upstream) in "$work/nginx", in front of
# the upstream above. Sets nginx_port, nginx_pid (the master, in `pids`) and
# nginx_workers (its worker processes' pids, comma-separated), once they all
# run.
start_nginx() {
  mkdir -p "$work/nginx/tmp"
  chmod 777 "$work/nginx/tmp"
  nginx_port=$(free_port)
  PYTHONDONTWRITEBYTECODE=1 python3 - "$work/nginx" "$up_port" "$nginx_port" <<'PY'
import sys
sys.path.insert(0, "scripts/bench")
import run
d, up, port = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
with open(f"{d}/nginx.conf", "w") as f:
    f.write(run.NGINX_CONF.format(dir=d, up_port=up, port=port))
PY
  nginx -p "$work/nginx" -c "$work/nginx/nginx.conf" >"$work/nginx/stderr.log" 2>&1 &
  nginx_pid=$!
  pids+=($nginx_pid)
  wait_port "$nginx_port"
  # `worker_processes auto`: one per CPU.
  timeout 10 bash -c "until [ \$(pgrep -c -P $nginx_pid) -ge $(nproc) ]; do sleep 0.05; done"
  nginx_workers=$(pgrep -P "$nginx_pid" | paste -sd,)
}
