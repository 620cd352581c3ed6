#!/usr/bin/env python3
"""The benchmark suite of issue 6, driven by scripts/bench.sh.

One run measures, side by side, and prints one table of medians and ratios:
  1. filter throughput of `aalis-proxy annotate` (default, --format ndjson,
     --inject none) against the floor `cat | cat` (the faster of it and of
     `cat | cat` on one CPU), a jq pipeline and a Python script doing the
     same progress job, on generated captures; and, not a target,
     `annotate`'s reading and writing alone (`loadgen copy`);
  2. proxy overhead: per-event added latency and time to first byte through
     `aalis-proxy serve` and nginx, against a direct connection to the same
     stamping upstream (examples/loadgen.rs), paced and unpaced; and, not a
     target, a second nginx judged against the first, which shows how many
     cells the host alone lets a proxy that is nginx meet;
  3. memory: RSS per open idle stream, and the RSS slope of a soak;
  4. instruction counts (callgrind) per input byte, stable on a noisy box;
  5. the criterion micro-benchmarks (benches/pipeline.rs).

Loopback only. Every loop is bounded in count, every subprocess in time, and
the whole run by --deadline-seconds; processes started here are stopped here
by their own handles. Generated files live in --workdir (under /tmp).
"""

import argparse
import glob
import hashlib
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))

# What each mode runs. Sizes in MB (10^6 bytes).
MODES = {
    "full": dict(
        mb=200, reps=3, proxy_reps=6, profile_mb=8, sample_mb=2,
        paced_events=200, paced_samples=1000, delay_us=5000, unpaced_total_events=200_000,
        concurrency=[1, 16, 64, 256], idle_streams=1000,
        soak_concurrency=16, criterion=True, callgrind=True,
    ),
    "smoke": dict(
        mb=0.5, reps=1, proxy_reps=1, profile_mb=0, sample_mb=0.3,
        paced_events=20, paced_samples=20, delay_us=5000, unpaced_total_events=2000,
        concurrency=[1, 4], idle_streams=50,
        soak_concurrency=4, criterion=True, callgrind=False,
    ),
}

STARTED = time.monotonic()
DEADLINE = None
CHILDREN = []  # Popen handles of long-running processes we started


def log(msg):
    print(f"[bench {time.monotonic() - STARTED:6.1f}s] {msg}", file=sys.stderr, flush=True)


def left():
    return max(1.0, DEADLINE - time.monotonic())


def check_deadline(what):
    if time.monotonic() > DEADLINE:
        raise SystemExit(f"bench: deadline reached before {what}")


def median(xs):
    return statistics.median(xs) if xs else float("nan")


def fmt(x, digits=1):
    if x is None or x != x:
        return "—"
    if abs(x) >= 100:
        return f"{x:,.0f}"
    return f"{x:.{digits}f}"


# === captures ===

def gen_version():
    with open(os.path.join(HERE, "gen_captures.py"), "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()[:10]


def capture(workdir, kind, mb, seed=6):
    """A generated capture, reused while the generator is unchanged."""
    ext = "ndjson" if kind == "ollama" else "sse"
    path = os.path.join(workdir, f"{kind}-{mb:g}MB-s{seed}-{gen_version()}.{ext}")
    if not os.path.exists(path):
        log(f"generating {os.path.basename(path)}")
        for old in glob.glob(os.path.join(workdir, f"{kind}-{mb:g}MB-s{seed}-*.{ext}")):
            os.remove(old)
        tmp = path + ".part"
        subprocess.run(
            [sys.executable, os.path.join(HERE, "gen_captures.py"), "--kind", kind,
             "--mb", str(mb), "--seed", str(seed), "--out", tmp],
            check=True, timeout=min(left(), 600), stderr=subprocess.DEVNULL,
        )
        os.rename(tmp, path)
    return path


# === 1. filter throughput ===

GNU_TIME = "/usr/bin/time" if os.access("/usr/bin/time", os.X_OK) else None


def run_filter(argv, path, timeout, workdir, cpu=None):
    """`cat path | argv > /dev/null`, both on CPU `cpu` when given; returns
    (seconds, CPU seconds, max RSS KiB or None) of argv. GNU time, when
    present, reports the RSS: a child forked from this Python process would
    count Python's own pages."""
    rss_file = os.path.join(workdir, "time.out")
    wrapped = [GNU_TIME, "-f", "%M", "-o", rss_file, *argv] if GNU_TIME else argv
    pin = None if cpu is None else (lambda: os.sched_setaffinity(0, {cpu}))
    t0 = time.perf_counter()
    cat = subprocess.Popen(["cat", path], stdout=subprocess.PIPE, preexec_fn=pin)
    filt = subprocess.Popen(wrapped, stdin=cat.stdout, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            preexec_fn=pin)
    cat.stdout.close()
    try:
        _, status, usage = os.wait4(filt.pid, 0)
        filt.returncode = os.waitstatus_to_exitcode(status)
    except BaseException:
        filt.kill()
        raise
    finally:
        cat.wait(timeout=timeout)
    elapsed = time.perf_counter() - t0
    err = filt.stderr.read().decode(errors="replace")
    filt.stderr.close()
    if filt.returncode != 0 or cat.returncode != 0:
        raise RuntimeError(f"{argv[0]} exited {filt.returncode}: {err[:300]}")
    if elapsed > timeout:
        raise RuntimeError(f"{argv[0]} took {elapsed:.0f}s, over its {timeout:.0f}s budget")
    rss = None
    if GNU_TIME:
        with open(rss_file) as f:
            rss = int(f.read().split()[-1])
    return elapsed, usage.ru_utime + usage.ru_stime, rss


def smoke_size(cfg):
    return cfg["mb"] < 10


# The floor is the faster of `cat | cat` as the scheduler places it and
# `cat | cat` with both on one CPU: on some virtual machines a pipe between
# two CPUs is bound by the latency of waking the other side (there, 1.2-1.4
# GB/s against 3.5 on one CPU), which would make any filter look close to
# the floor.
FLOOR_ONE_CPU = "cat | cat (one CPU)"


def floor(get):
    """The floor of one capture from its {contender: MB/s}."""
    return max(get["cat | cat"], get.get(FLOOR_ONE_CPU, 0.0))


# The contenders measured a second time on the plain build (`--plain`).
PLAIN = "plain build: "


# `annotate`'s reading and writing without its work (`loadgen copy`): not a
# target; it tells how much of `annotate`'s distance from the floor is the
# bytes' way through two processes on two CPUs rather than the parsing.
IO_ALONE = "annotate's I/O alone (parses nothing)"


def throughput(cfg, workdir, aalis, plain, loadgen, have_jq, notes):
    captures = [("tool-heavy SSE", "tool"), ("text-heavy SSE", "text"), ("Ollama NDJSON", "ollama")]
    rows = []
    for label, kind in captures:
        check_deadline("throughput")
        path = capture(workdir, kind, cfg["mb"])
        size = os.path.getsize(path)
        jq_prog = os.path.join(HERE, "progress_ollama.jq" if kind == "ollama" else "progress_sse.jq")
        contenders = [
            ("cat | cat", ["cat"]),
            (FLOOR_ONE_CPU, ["cat"]),
            ("annotate (sse, field)", [aalis, "annotate"]),
            ("annotate --format ndjson", [aalis, "annotate", "--format", "ndjson"]),
            ("annotate --inject none", [aalis, "annotate", "--inject", "none"]),
            (IO_ALONE, [loadgen, "copy"]),
            ("python json", [sys.executable, os.path.join(HERE, "progress.py")]),
        ]
        if have_jq:
            contenders.append(("jq", ["jq", "-nRc", "-f", jq_prog]))
        if plain:
            contenders += [(PLAIN + "annotate (sse, field)", [plain, "annotate"]),
                           (PLAIN + "annotate --inject none", [plain, "annotate", "--inject", "none"])]
        # Warm the page cache, then interleave contenders within each rep so
        # drift in the machine's load spreads over all of them.
        subprocess.run(["cat", path], stdout=subprocess.DEVNULL, check=True, timeout=120)
        results = {name: [] for name, _ in contenders}
        for rep in range(cfg["reps"]):
            for name, argv in contenders:
                check_deadline(f"throughput {kind} {name}")
                results[name].append(run_filter(argv, path, min(left(), 900), workdir, pinned(name)))
        # Runs under a second (cat, annotate) are noisier: a few more of
        # them, while they add up to under two seconds (at most 4× reps).
        for name, argv in contenders:
            while (len(results[name]) < 4 * cfg["reps"] and sum(r[0] for r in results[name]) < 2.0
                   and not smoke_size(cfg)):
                results[name].append(run_filter(argv, path, min(left(), 900), workdir, pinned(name)))
        for name, _ in contenders:
            rates = [size / r[0] / 1e6 for r in results[name]]
            rss = [r[2] for r in results[name] if r[2] is not None]
            rows.append(dict(capture=label, kind=kind, bytes=size, contender=name,
                             mbps=median(rates), mbps_min=min(rates), mbps_max=max(rates),
                             cpu_s_per_gb=median([r[1] for r in results[name]]) / (size / 1e9),
                             max_rss_mb=max(rss) / 1024 if rss else None, runs=len(rates)))
        log(f"throughput {kind}: " + ", ".join(f"{r['contender']} {r['mbps']:.0f} MB/s" for r in rows if r["kind"] == kind))
    if not have_jq:
        notes.append("jq is not available: the jq column is skipped.")
    return rows


def pinned(contender):
    """The CPU a contender runs on, or None to let the scheduler place it."""
    return min(os.sched_getaffinity(0)) if contender == FLOOR_ONE_CPU else None


def verify_baselines(workdir, aalis, have_jq):
    """The jq and Python baselines do the same progress job: on small
    captures, their lines equal the toolCallProgress lines of `annotate
    --format ndjson`, byte for byte."""
    # Captures of several turns each (the tool one reuses its indexes from
    # turn to turn, as the measured one does), and at least this many
    # progress lines compared, so the check cannot pass on nothing.
    at_least = {"tool": 1000, "text": 5, "ollama": 20}
    for kind in ("tool", "text", "ollama"):
        path = capture(workdir, kind, 3, seed=11)
        with open(path, "rb") as f:
            ours = subprocess.run([aalis, "annotate", "--format", "ndjson"], stdin=f, capture_output=True,
                                  check=True, timeout=120).stdout
        want = b"".join(l + b"\n" for l in ours.splitlines() if l.startswith(b'{"toolCallProgress"'))
        lines = want.count(b"\n")
        if lines < at_least[kind]:
            raise SystemExit(f"bench: {os.path.basename(path)} gives {lines} progress lines, "
                             f"too few to check the baselines on (at least {at_least[kind]})")
        others = [("python", [sys.executable, os.path.join(HERE, "progress.py")])]
        if have_jq:
            prog = "progress_ollama.jq" if kind == "ollama" else "progress_sse.jq"
            others.append(("jq", ["jq", "-nRc", "-f", os.path.join(HERE, prog)]))
        for name, argv in others:
            with open(path, "rb") as f:
                got = subprocess.run(argv, stdin=f, capture_output=True, check=True, timeout=120).stdout
            if got != want:
                raise SystemExit(f"bench: the {name} baseline disagrees with annotate on {os.path.basename(path)}")
    log("baselines agree with annotate --format ndjson on every capture kind")


# === 4. instruction counts ===

def callgrind(cfg, workdir, aalis, plain, notes):
    if not cfg["callgrind"] or cfg["profile_mb"] <= 0:
        return []
    if shutil.which("valgrind") is None:
        notes.append("valgrind is not installed: no instruction counts.")
        return []
    path = capture(workdir, "tool", cfg["profile_mb"], seed=7)
    size = os.path.getsize(path)
    rows = []
    runs = [("annotate (sse, field)", aalis, []), ("annotate --format ndjson", aalis, ["--format", "ndjson"]),
            ("annotate --inject none", aalis, ["--inject", "none"])]
    if plain:
        runs += [(PLAIN + "annotate (sse, field)", plain, []),
                 (PLAIN + "annotate --inject none", plain, ["--inject", "none"])]
    for name, binary, extra in runs:
        check_deadline("callgrind")
        tag = ("plain." if name.startswith(PLAIN) else "") + (extra[-1] if extra else "field")
        out = os.path.join(workdir, "callgrind." + tag + ".out")
        with open(path, "rb") as stdin:
            subprocess.run(["valgrind", "--tool=callgrind", "--callgrind-out-file=" + out, binary, "annotate", *extra],
                           stdin=stdin, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                           check=True, timeout=min(left(), 600))
        total = None
        with open(out) as f:
            for line in f:
                if line.startswith(("summary:", "totals:")):
                    total = int(line.split()[1])
        stage_rows = []
        if shutil.which("callgrind_annotate"):
            sys.dont_write_bytecode = True  # no __pycache__ in the work tree
            sys.path.insert(0, HERE)
            import cg_profile
            _, funcs = cg_profile.functions(out)
            stage_rows = [dict(stage=st, ir=ir) for st, ir in cg_profile.stages(funcs)]
        rows.append(dict(contender=name, instructions=total, bytes=size, ir_per_byte=total / size,
                         stages=stage_rows))
        log(f"callgrind {name}: {total / size:.1f} instructions per input byte")
    return rows


# === 2. proxy overhead ===

def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_port(port, timeout=10):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise RuntimeError(f"nothing listens on 127.0.0.1:{port}")


def start(argv, log_path, **kw):
    f = open(log_path, "wb")
    p = subprocess.Popen(argv, stdout=kw.pop("stdout", f), stderr=f, stdin=subprocess.DEVNULL, **kw)
    CHILDREN.append(p)
    return p


def stop(p, sig=signal.SIGTERM):
    if p.poll() is None:
        p.send_signal(sig)
        try:
            p.wait(timeout=15)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(timeout=5)


def start_upstream(loadgen, sample, workdir):
    p = subprocess.Popen([loadgen, "upstream", "--events", sample, "--max-seconds", str(int(left()) + 60)],
                         stdout=subprocess.PIPE, stderr=open(os.path.join(workdir, "upstream.log"), "wb"),
                         stdin=subprocess.DEVNULL)
    CHILDREN.append(p)
    line = p.stdout.readline().decode()
    if not line.startswith("listening "):
        raise RuntimeError("the stamping upstream did not start")
    return p, int(line.split(":")[-1])


def start_aalis(aalis, up_port, workdir, log_name="serve.log"):
    port = free_port()
    p = start([aalis, "serve", "--upstream", f"http://127.0.0.1:{up_port}", "--listen", f"127.0.0.1:{port}"],
              os.path.join(workdir, log_name))
    wait_port(port)
    return p, port


NGINX_CONF = """\
worker_processes auto;
worker_rlimit_nofile 8192;
daemon off;
pid {dir}/nginx.pid;
error_log {dir}/error.log warn;
events {{ worker_connections 4096; }}
http {{
  access_log off;
  client_body_temp_path {dir}/tmp/body;
  proxy_temp_path {dir}/tmp/proxy;
  fastcgi_temp_path {dir}/tmp/fastcgi;
  uwsgi_temp_path {dir}/tmp/uwsgi;
  scgi_temp_path {dir}/tmp/scgi;
  upstream up {{
    server 127.0.0.1:{up_port};
    keepalive 512;
  }}
  server {{
    listen 127.0.0.1:{port};
    location / {{
      proxy_pass http://up;
      proxy_http_version 1.1;
      proxy_set_header Connection "";
      proxy_buffering off;
      proxy_read_timeout 600s;
    }}
  }}
}}
"""


def start_nginx(up_port, workdir, name="nginx"):
    d = os.path.join(workdir, name)
    os.makedirs(os.path.join(d, "tmp"), exist_ok=True)
    os.chmod(os.path.join(d, "tmp"), 0o777)
    port = free_port()
    conf = os.path.join(d, "nginx.conf")
    with open(conf, "w") as f:
        f.write(NGINX_CONF.format(dir=d, up_port=up_port, port=port))
    p = start(["nginx", "-p", d, "-c", conf], os.path.join(d, "stderr.log"))
    wait_port(port)
    return p, port


def listen_overflows():
    """The kernel's count of connections dropped because an accept queue
    was full (system-wide): a SYN retried after 1 s shows up in TTFB."""
    try:
        with open("/proc/net/netstat") as f:
            lines = f.read().splitlines()
        for names, values in zip(lines[::2], lines[1::2]):
            if names.startswith("TcpExt:"):
                return int(dict(zip(names.split(), values.split()))["ListenOverflows"])
    except (OSError, KeyError, ValueError):
        pass
    return 0


def drive(loadgen, port, concurrency, events, delay_us, timeout):
    before = listen_overflows()
    out = subprocess.run(
        [loadgen, "drive", "--target", f"127.0.0.1:{port}", "--concurrency", str(concurrency),
         "--events", str(events), "--delay-us", str(delay_us), "--timeout-seconds", str(int(timeout))],
        capture_output=True, check=True, timeout=timeout + 30,
    )
    r = json.loads(out.stdout)
    r["listen_overflows"] = listen_overflows() - before
    if r["errors"]:
        raise RuntimeError(f"{r['errors']} of {concurrency} streams failed on :{port}: {r['first_error']}")
    return r


def tree_cpu_s(pid):
    """CPU time (user and system) of every thread of `pid` and of its
    children (nginx's workers), in seconds, from schedstat: nanoseconds,
    not the 10 ms ticks of /proc/PID/stat."""
    total = 0
    for p in [pid] + children(pid):
        for task in glob.glob(f"/proc/{p}/task/*/schedstat"):
            try:
                with open(task) as f:
                    total += int(f.read().split()[0])
            except (OSError, ValueError, IndexError):
                continue
    return total / 1e9


# The pause before each drive of the proxy part.
SETTLE_S = 0.1


def balanced_order(n, rep):
    """Row `rep` of a balanced Latin square on n targets (Williams's
    design): over n rows (2n when n is odd), each target drives in each
    place equally often, and right after each other target equally often. A rotation of
    one order (what the suite did until the forty-ninth round) keeps its
    cyclic order: each target then always drove right after the same
    other one."""
    first = [0]
    lo, hi = 1, n - 1
    while len(first) < n:
        first.append(lo)
        lo += 1
        if len(first) < n:
            first.append(hi)
            hi -= 1
    row = [(x + rep) % n for x in first]
    if n % 2 and (rep // n) % 2:
        row.reverse()
    return row


def warm_up(cfg, loadgen, targets):
    """One short unpaced drive through each target, not measured: the
    first drive of the proxy part then finds no process on its first
    traffic (the upstream's and the proxies' connections, pages and
    caches)."""
    for name, port in targets.items():
        check_deadline(f"warm-up {name}")
        drive(loadgen, port, min(16, max(cfg["concurrency"])), 50, 0, timeout=min(left(), 60))


def proxy_overhead(cfg, loadgen, targets, pids, notes, restart=None):
    """Drives every target (name → port) in turn, repetition after
    repetition; `pids` (name → pid) are the processes whose CPU time per
    event is measured over each drive. With `restart` (name → None, which
    starts a fresh process for that target and updates `targets` and
    `pids`), every repetition but the run's first drives fresh proxies."""
    rows = []
    reps = cfg["proxy_reps"]
    first = True
    warm_up(cfg, loadgen, targets)
    for mode in ("paced", "unpaced"):
        for c in cfg["concurrency"]:
            if mode == "paced":
                # At small C, more events per stream, so p99 is not just
                # the second-worst sample.
                events, delay = max(cfg["paced_events"], cfg["paced_samples"] // c), cfg["delay_us"]
            else:
                events, delay = max(cfg["unpaced_total_events"] // c, 50), 0
            runs = {name: [] for name in targets}
            cpu = {name: [] for name in targets}
            for rep in range(reps):
                if restart and not first:
                    for name in list(pids):
                        restart(name)
                first = False
                # Each repetition drives the targets in the order of one
                # row of a balanced Latin square, so that no target always
                # drives right after the same other one: an effect of the
                # order would read as a difference between the targets.
                items = list(targets.items())
                for i in balanced_order(len(items), rep):
                    name, port = items[i]
                    check_deadline(f"proxy {mode} C={c}")
                    # The last drive's connections closed, its processes
                    # quiet, before this one starts.
                    time.sleep(SETTLE_S)
                    before = tree_cpu_s(pids[name]) if name in pids else None
                    r = drive(loadgen, port, c, events, delay, timeout=min(left(), 300))
                    if before is not None and r["events"]:
                        cpu[name].append((tree_cpu_s(pids[name]) - before) / r["events"] * 1e6)
                    runs[name].append(r)
            direct = runs["direct"]
            for name in targets:
                rs = runs[name]

                def m(key, sub):
                    return median([r[key][sub] for r in rs])

                def added_reps(sub):
                    # Paired by rep: same moment, same machine load.
                    return [r["latency_us"][sub] - d["latency_us"][sub] for r, d in zip(rs, direct)]

                def added(sub):
                    return median(added_reps(sub))

                rows.append(dict(
                    mode=mode, concurrency=c, target=name, events_per_stream=events, runs=len(rs),
                    p50=m("latency_us", "p50"), p99=m("latency_us", "p99"), max=m("latency_us", "max"),
                    added_p50=added("p50"), added_p99=added("p99"), added_max=added("max"),
                    # Each rep's own, for how often one target beat another
                    # (`reps_won`), beside the medians.
                    added_p50_reps=added_reps("p50"), added_p99_reps=added_reps("p99"),
                    events_per_s_reps=[r["events_per_s"] for r in rs],
                    ttfb_p50=m("ttfb_us", "p50"), ttfb_p99=m("ttfb_us", "p99"),
                    # Each stream's first `start_events` events (the driver
                    # says how many; paced, 10 are its first 50 ms, which
                    # include the set-up of all C streams) and the rest:
                    # whether a tail comes from stream set-up or from the
                    # steady part.
                    start_events=rs[0]["start_events"],
                    p99_start=m("latency_start_us", "p99"), p99_steady=m("latency_steady_us", "p99"),
                    listen_overflows=sum(r["listen_overflows"] for r in rs),
                    events_per_s=median([r["events_per_s"] for r in rs]),
                    events_per_s_min=min(r["events_per_s"] for r in rs),
                    events_per_s_max=max(r["events_per_s"] for r in rs),
                    # The upstream's bytes (a direct drive's bytes an event,
                    # same repetition), not what the client got: `serve`
                    # adds its progress to them.
                    mb_per_s=median([r["events_per_s"] * d["bytes"] / d["events"] / 1e6
                                     for r, d in zip(rs, direct) if d["events"]]),
                    throughput_ratio=median([r["events_per_s"] / d["events_per_s"] for r, d in zip(rs, direct)]),
                    cpu_us_per_event=median(cpu[name]),
                ))
            log(f"proxy {mode} C={c}: " + ", ".join(
                f"{r['target']} p50 {r['p50']:.0f}µs p99 {r['p99']:.0f}µs {r['events_per_s']:.0f} ev/s"
                for r in rows if r["mode"] == mode and r["concurrency"] == c))
    return rows


# === 3. memory ===

def rss_kib(pid):
    return status_kib(pid, "VmRSS")


def status_kib(pid, key):
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def hwm_kib(pid):
    return status_kib(pid, "VmHWM")


def children(pid):
    out = []
    for stat in glob.glob("/proc/[0-9]*/stat"):
        try:
            with open(stat) as f:
                fields = f.read().rsplit(")", 1)[1].split()
            if int(fields[1]) == pid:
                out.append(int(stat.split("/")[2]))
        except (OSError, ValueError, IndexError):
            continue
    return out


def tree_hwm_kib(pid):
    return hwm_kib(pid) + sum(hwm_kib(c) for c in children(pid))


def tree_rss_kib(pid):
    """RSS of pid and its children (nginx: master and workers)."""
    return rss_kib(pid) + sum(rss_kib(c) for c in children(pid))


def idle_streams(cfg, loadgen, name, port, pid):
    n = cfg["idle_streams"]
    check_deadline("idle streams")
    before = tree_rss_kib(pid)
    hold = int(min(left(), 120))
    p = subprocess.Popen([loadgen, "--threads", "1", "idle", "--target", f"127.0.0.1:{port}", "--streams", str(n),
                          "--hold-seconds", str(hold)],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    CHILDREN.append(p)
    try:
        line = p.stdout.readline().decode().split()
        ready = int(line[1]) if len(line) == 2 else 0
        time.sleep(0.5)  # let the proxy settle its buffers
        during = tree_rss_kib(pid)
    finally:
        p.stdin.close()
        p.wait(timeout=30)
    time.sleep(1.0)
    after = tree_rss_kib(pid)
    per = (during - before) / max(ready, 1)
    log(f"idle {name}: {ready}/{n} streams, RSS {before} → {during} KiB, {per:.1f} KiB per stream")
    return dict(target=name, streams=n, ready=ready, rss_before_kib=before, rss_open_kib=during,
                rss_after_kib=after, kib_per_stream=per)


def soak(cfg, loadgen, port, pid, seconds):
    check_deadline("soak")
    interval = 1.0 if seconds >= 30 else 0.25
    p = subprocess.Popen(
        [loadgen, "soak", "--target", f"127.0.0.1:{port}", "--concurrency", str(cfg["soak_concurrency"]),
         "--events", str(cfg["paced_events"]), "--delay-us", str(cfg["delay_us"]),
         "--duration-seconds", str(seconds), "--timeout-seconds", "60"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    CHILDREN.append(p)
    samples = []
    # Anonymous pages (heap, stacks) apart from file-backed ones (the
    # binary's code as it runs for the first time): which one grows.
    anon = []
    t0 = time.monotonic()
    while p.poll() is None and time.monotonic() - t0 < seconds + 90:
        t = time.monotonic() - t0
        samples.append((t, rss_kib(pid)))
        anon.append((t, status_kib(pid, "RssAnon")))
        time.sleep(interval)
    out, _ = p.communicate(timeout=60)
    result = json.loads(out)
    # Least-squares slope over the steady part: the allocator takes a
    # minute or two of traffic to reach its working set (BENCHMARKS.md,
    # "Ninth round": jemalloc within the first minute; glibc's arenas took
    # about six), so the first fifth or the first minute, whichever is
    # longer (at most half the run), is warm-up.
    warmup = min(max(seconds / 5, 60.0), seconds / 2)
    slope = slope_per_min(samples, warmup)
    anon_slope = slope_per_min(anon, warmup)
    ts_slope = theil_sen_per_min(samples, warmup)
    ts_anon_slope = theil_sen_per_min(anon, warmup)
    row = dict(seconds=seconds, warmup_s=warmup, streams=result["streams"], errors=result["errors"], events=result["events"],
               rss_start_kib=samples[0][1], rss_steady_start_kib=steady(samples, warmup)[0][1],
               rss_end_kib=samples[-1][1],
               rss_max_kib=max(r for _, r in samples), slope_kib_per_min=slope,
               anon_slope_kib_per_min=anon_slope, ts_slope_kib_per_min=ts_slope,
               ts_anon_slope_kib_per_min=ts_anon_slope, samples=len(samples),
               rss_samples=[(round(t, 2), r) for t, r in samples])
    log(f"soak {seconds}s: {result['streams']} streams, RSS {row['rss_steady_start_kib']} → {row['rss_end_kib']} KiB, "
        f"Theil–Sen slope {ts_slope:+.1f} KiB/min (anonymous {ts_anon_slope:+.1f}), "
        f"least squares {slope:+.1f} (anonymous {anon_slope:+.1f})")
    if result["errors"]:
        raise RuntimeError(f"soak: {result['errors']} streams failed")
    return row


def steady(samples, warmup):
    """The (seconds, KiB) samples taken at or after `warmup` (all of them
    if none was)."""
    return [s for s in samples if s[0] >= warmup] or samples


def slope_per_min(samples, warmup):
    """Least-squares slope, KiB per minute, of the steady samples."""
    kept = steady(samples, warmup)
    n = len(kept)
    mx = sum(t for t, _ in kept) / n
    my = sum(r for _, r in kept) / n
    var = sum((t - mx) ** 2 for t, _ in kept)
    return sum((t - mx) * (r - my) for t, r in kept) / var * 60 if var else 0.0


def theil_sen_per_min(samples, warmup, max_points=1200):
    """Theil–Sen slope, KiB per minute, of the steady samples: the median
    of the slopes between every two samples. The allocator's RSS rises
    for a minute at a time and recedes (BENCHMARKS.md, twenty-second
    round); least squares reads a rise near the end as growth, while the
    median follows the level most samples keep, which a leak does move.
    Over `max_points` samples, every k-th is kept (a long soak)."""
    kept = steady(samples, warmup)
    step = max(1, -(-len(kept) // max_points))
    kept = kept[::step]
    slopes = sorted((r2 - r1) / (t2 - t1)
                    for i, (t1, r1) in enumerate(kept) for t2, r2 in kept[i + 1:] if t2 > t1)
    return median(slopes) * 60 if slopes else 0.0


# === 5. criterion ===

def criterion(cfg, smoke, notes):
    if not cfg["criterion"]:
        return []
    check_deadline("criterion")
    if smoke:
        # One pass of each benchmark in the test profile: proves they run.
        subprocess.run(["cargo", "test", "--locked", "--quiet", "--bench", "pipeline"], cwd=REPO, check=True,
                       timeout=min(left(), 900), stdout=subprocess.DEVNULL)
        notes.append("criterion: smoke runs each micro-benchmark once (cargo test --bench pipeline); no timings.")
        return []
    subprocess.run(["cargo", "bench", "--locked", "--bench", "pipeline", "--", "--warm-up-time", "1",
                    "--measurement-time", "3", "--noplot"],
                   cwd=REPO, check=True, timeout=min(left(), 1200), stdout=subprocess.DEVNULL)
    rows = []
    for bench in sorted(glob.glob(os.path.join(REPO, "target", "criterion", "*", "*", "new", "benchmark.json"))):
        with open(bench) as f:
            meta = json.load(f)
        with open(os.path.join(os.path.dirname(bench), "estimates.json")) as f:
            est = json.load(f)
        med = est["median"]
        ns = med["point_estimate"]
        nbytes = (meta.get("throughput") or {}).get("Bytes")
        rows.append(dict(
            name=meta["full_id"], ns=ns, ns_lo=med["confidence_interval"]["lower_bound"],
            ns_hi=med["confidence_interval"]["upper_bound"],
            mbps=(nbytes / ns * 1e3) if nbytes else None,
        ))
    log(f"criterion: {len(rows)} benchmarks")
    return rows


# === the table ===

def table(results, cfg):
    out = []
    p = out.append
    if results["throughput"]:
        throughput_tables(results, cfg, p)
    if results["callgrind"]:
        p("")
        p("## Instructions per input byte (callgrind, tool-heavy %s MB)\n" % cfg["profile_mb"])
        p("| contender | instructions | per byte |")
        p("| --- | ---: | ---: |")
        for r in results["callgrind"]:
            p(f"| {r['contender']} | {r['instructions']:,} | {r['ir_per_byte']:.1f} |")
        # The PGO build inlines most of the pipeline into one function, so
        # its stages say little: the plain build's, when it was measured.
        rows = results["callgrind"]
        first = next((r for r in rows if r["contender"] == PLAIN + "annotate (sse, field)"), rows[0])
        if first["stages"]:
            p("")
            p(f"Where the instructions of `{first['contender']}` go (self cost by stage, "
              "scripts/bench/cg_profile.py):\n")
            p("| stage | per input byte | share |")
            p("| --- | ---: | ---: |")
            for st in first["stages"]:
                p(f"| {st['stage']} | {st['ir'] / first['bytes']:.2f} | {100 * st['ir'] / first['instructions']:.1f}% |")
    if results["proxy"]:
        proxy_tables(results, cfg, p)
    if results["idle"] or results["peak_rss"] or results.get("soak"):
        memory_tables(results, cfg, p)
    criterion_targets(results, p)
    return "\n".join(out) + "\n"


def throughput_tables(results, cfg, p):
    p("## Filter throughput (MB/s, median of %d; min–max)\n" % cfg["reps"])
    by_capture = {}
    for r in results["throughput"]:
        by_capture.setdefault(r["capture"], []).append(r)
    p("| capture | contender | MB/s | min–max | runs | × floor | CPU s/GB | max RSS MB |")
    p("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for cap, rows in by_capture.items():
        floor_mbps = floor({r["contender"]: r["mbps"] for r in rows})
        for r in rows:
            p(f"| {cap} ({r['bytes'] / 1e6:.0f} MB) | {cell(r['contender'])} | {fmt(r['mbps'])} | "
              f"{fmt(r['mbps_min'])}–{fmt(r['mbps_max'])} | {r['runs']} | {r['mbps'] / floor_mbps:.3f} | {fmt(r['cpu_s_per_gb'], 2)} | "
              f"{fmt(r['max_rss_mb'])} |")
    p("")
    p("Ratios of `annotate` (sse, field) on the same capture, same run:\n")
    p("| capture | ÷ jq | ÷ python | --inject none ÷ floor | ndjson ÷ jq | I/O alone ÷ floor | --inject none ÷ I/O alone |")
    p("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for cap, rows in by_capture.items():
        get = {r["contender"]: r["mbps"] for r in rows}
        a = get["annotate (sse, field)"]
        jq = get.get("jq")
        p(f"| {cap} | {fmt(a / jq) if jq else '—'} | {fmt(a / get['python json'])} | "
          f"{get['annotate --inject none'] / floor(get):.3f} | "
          f"{fmt(get['annotate --format ndjson'] / jq) if jq else '—'} | "
          f"{get[IO_ALONE] / floor(get):.3f} | {get['annotate --inject none'] / get[IO_ALONE]:.3f} |")


def reps_won(a, n, key, lower):
    """In how many of the reps `a` did at least as well as `n` by `key`,
    the two paired by rep (drives of the same rep ran one after the other,
    under the same load): "3 of 5 reps". A cell whose median verdict
    rests on one rep shows it here."""
    pairs = list(zip(a[key], n[key]))
    won = sum(1 for x, y in pairs if (x <= y if lower else x >= y))
    return f"{won} of {len(pairs)} reps"


def proxy_tables(results, cfg, p):
    p("")
    p("## Proxy overhead, paced (one event every %d ms per stream, max(%d, %d/C) events per stream; "
      "µs, median of %d)\n" % (cfg["delay_us"] // 1000, cfg["paced_events"], cfg["paced_samples"], cfg["proxy_reps"]))
    paced = [r for r in results["proxy"] if r["mode"] == "paced"]
    start_events = paced[0]["start_events"] if paced else 0
    p("| C | target | p50 | p99 | max | added p50 | added p99 | added max "
      f"| p99, first {start_events} events | p99, the rest "
      "| TTFB p50 | TTFB p99 | CPU µs/event | SYN drops |")
    p("| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in paced:
        direct = r["target"] == "direct"
        p(f"| {r['concurrency']} | {r['target']} | {fmt(r['p50'])} | {fmt(r['p99'])} | {fmt(r['max'])} | "
          f"{'—' if direct else '%+.0f' % r['added_p50']} | {'—' if direct else '%+.0f' % r['added_p99']} | "
          f"{'—' if direct else '%+.0f' % r['added_max']} | {fmt(r['p99_start'])} | {fmt(r['p99_steady'])} | "
          f"{fmt(r['ttfb_p50'])} | {fmt(r['ttfb_p99'])} | "
          f"{fmt(r['cpu_us_per_event'])} | {r['listen_overflows']} |")
    p("")
    p("## Proxy throughput, unpaced (median of %d; min–max)\n" % cfg["proxy_reps"])
    p("| C | target | events/s | min–max | MB/s of the upstream's | × direct (each rep's, median) "
      "| p50 µs | p99 µs | CPU µs/event |")
    p("| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in results["proxy"]:
        if r["mode"] != "unpaced":
            continue
        p(f"| {r['concurrency']} | {r['target']} | {fmt(r['events_per_s'])} | "
          f"{fmt(r['events_per_s_min'])}–{fmt(r['events_per_s_max'])} | {fmt(r['mb_per_s'])} | "
          f"{r['throughput_ratio']:.2f} | {fmt(r['p50'])} | {fmt(r['p99'])} | {fmt(r['cpu_us_per_event'])} |")


def memory_tables(results, cfg, p):
    p("")
    p("## Memory\n")
    p("| what | target | streams | RSS before KiB | RSS open KiB | RSS after KiB | KiB per stream |")
    p("| --- | --- | ---: | ---: | ---: | ---: | ---: |")
    for r in results["idle"]:
        p(f"| idle streams | {r['target']} | {r['ready']}/{r['streams']} | {r['rss_before_kib']:,} | "
          f"{r['rss_open_kib']:,} | {r['rss_after_kib']:,} | {r['kib_per_stream']:.1f} |")
    for r in results["peak_rss"]:
        p(f"| high-water after the proxy runs (VmHWM) | {r['target']} | — | — | {r['vm_hwm_kib']:,} | "
          f"{r['rss_kib']:,} | — |")
    s = results.get("soak")
    if s:
        p("")
        p(f"Soak: {s['seconds']} s of {cfg['soak_concurrency']} concurrent paced streams through `serve` "
          f"({s['streams']} streams, {s['events']:,} events, {s['errors']} errors): RSS {s['rss_start_kib']:,} KiB at start, "
          f"{s['rss_steady_start_kib']:,} after the {s['warmup_s']:.0f} s warm-up, {s['rss_end_kib']:,} at the end "
          f"(max {s['rss_max_kib']:,}); slope after warm-up (Theil–Sen, the verdict's) "
          f"**{s['ts_slope_kib_per_min']:+.1f} KiB/min**, of anonymous pages alone "
          f"{s['ts_anon_slope_kib_per_min']:+.1f}; least squares {s['slope_kib_per_min']:+.1f}, "
          f"of anonymous pages {s['anon_slope_kib_per_min']:+.1f}.")


def criterion_targets(results, p):
    if results["criterion"]:
        p("")
        p("## Criterion micro-benchmarks (median, 95% CI)\n")
        p("| benchmark | time | CI | MB/s |")
        p("| --- | ---: | ---: | ---: |")
        for r in results["criterion"]:
            p(f"| {r['name']} | {human_ns(r['ns'])} | {human_ns(r['ns_lo'])}–{human_ns(r['ns_hi'])} | "
              f"{fmt(r['mbps']) if r['mbps'] else '—'} |")
    p("")
    if results["mode"] == "smoke":
        p("## Targets (issue 6) — smoke run: debug builds, tiny inputs; these verdicts mean nothing\n")
    else:
        p("## Targets (issue 6)\n")
    for line in targets(results):
        p(f"- {line}")
    if results["notes"]:
        p("")
        p("Notes:")
        for n in results["notes"]:
            p(f"- {n}")


def cell(text):
    """Text for a Markdown table cell."""
    return text.replace("|", "\\|")


def human_ns(ns):
    if ns >= 1e6:
        return f"{ns / 1e6:.2f} ms"
    if ns >= 1e3:
        return f"{ns / 1e3:.2f} µs"
    return f"{ns:.2f} ns"


# Proxy targets that are other builds of `serve`, reported beside the
# verdicts: (target name, how a verdict line names it).
OTHER_BUILDS = [("aalis (plain build)", "the plain build"), ("forward-only", "the forward-only build")]

# A second nginx, configured as the first and driven beside it as one more
# proxy target: judged by the same rules against the first, it shows how
# many cells a proxy that costs what nginx costs meets on this host in this
# run, which is how far the host alone moves a verdict.
TWIN = "nginx (second instance)"
TWIN_SAYS = "a second nginx against the first"


def paced_cells(a, n):
    """The two paced cells, added p50 and added p99, each met or not."""
    return [a["added_p50"] <= n["added_p50"], a["added_p99"] <= n["added_p99"]]


def paced_detail(a, n):
    return (f"p50 {a['added_p50']:+.0f} vs {n['added_p50']:+.0f} µs, "
            f"p99 {a['added_p99']:+.0f} vs {n['added_p99']:+.0f} µs; "
            f"CPU {fmt(a['cpu_us_per_event'])} vs {fmt(n['cpu_us_per_event'])} µs per event; "
            f"p50 {reps_won(a, n, 'added_p50_reps', lower=True)}, "
            f"p99 {reps_won(a, n, 'added_p99_reps', lower=True)}")


def unpaced_cells(a, n):
    """The one unpaced cell, throughput at least nginx's, met or not."""
    return [a["events_per_s"] >= n["events_per_s"]]


def judged(who, c, rule, cells, detail):
    """The verdict line of `serve` (a target) or of the second nginx (not
    one) on the cells of one C."""
    ok = all(cells)
    if who == TWIN:
        return f"  (not a target) {TWIN_SAYS} at C={c}: {'would meet' if ok else 'would miss'} ({detail})"
    return f"{rule}: {'MET' if ok else 'MISSED'} ({detail})"


def unpaced_detail(a, n):
    return (f"{a['events_per_s'] / n['events_per_s']:.2f}× nginx in median events/s; each repetition's ratio "
            f"to direct, median: {a['throughput_ratio']:.2f} vs {n['throughput_ratio']:.2f}; "
            f"{reps_won(a, n, 'events_per_s_reps', lower=False)}")


def paced_other(a, n):
    """A build that is not a target, paced: its added latency and CPU."""
    return (f"p50 {a['added_p50']:+.0f}, p99 {a['added_p99']:+.0f} µs, "
            f"CPU {fmt(a['cpu_us_per_event'])} µs per event")


def unpaced_other(a, n):
    """A build that is not a target, unpaced: its throughput against nginx's."""
    return f"{a['events_per_s'] / n['events_per_s']:.2f}× nginx"


# Per mode, the proxy's rule and how its cells, its verdict's detail and
# the line of a build that is not a target are read from a row and
# nginx's; paced first, as the table shows them.
PROXY_RULES = {
    "paced": ("added latency ≤ nginx's", paced_cells, paced_detail, paced_other),
    "unpaced": ("throughput ≥ nginx's", unpaced_cells, unpaced_detail, unpaced_other),
}


def targets(results):
    lines = []
    for cap in dict.fromkeys(r["capture"] for r in results["throughput"]):
        get = {r["contender"]: r["mbps"] for r in results["throughput"] if r["capture"] == cap}
        a = get["annotate (sse, field)"]
        if "jq" in get:
            x = a / get["jq"]
            lines.append(f"{cap}: default annotate ≥ 50× jq: {'MET' if x >= 50 else 'MISSED'} ({x:.1f}×)")
        x = a / get["python json"]
        lines.append(f"{cap}: default annotate ≥ 15× Python: {'MET' if x >= 15 else 'MISSED'} ({x:.1f}×)")
        x = floor(get) / get["annotate --inject none"]
        lines.append(f"{cap}: --inject none within 2× of cat|cat: {'MET' if x <= 2 else 'MISSED'} "
                     f"(the faster cat|cat is {x:.1f}× faster)")
        lines.append(f"  (not a target) {cap}: annotate's I/O alone, parsing nothing, runs at "
                     f"{get[IO_ALONE] / floor(get):.2f} of the floor's speed; --inject none at "
                     f"{get['annotate --inject none'] / get[IO_ALONE]:.2f} of that I/O's")
        if PLAIN + "annotate (sse, field)" in get:
            pa, pn = get[PLAIN + "annotate (sse, field)"], get[PLAIN + "annotate --inject none"]
            jq = f"{pa / get['jq']:.1f}× jq, " if "jq" in get else ""
            lines.append(f"  (not a target) the plain build on {cap}: {jq}{pa / get['python json']:.1f}× Python, "
                         f"--inject none {floor(get) / pn:.1f}× slower than cat|cat")
    prox = results["proxy"]
    # Which proxy cells (paced: the added p50 and p99 at each C; unpaced:
    # the throughput at each C) `serve` and the second nginx meet, for the
    # count after them.
    met = {"aalis": [], TWIN: []}
    for mode, (rule, cells_of, detail_of, other_build) in PROXY_RULES.items():
        for c in sorted({r["concurrency"] for r in prox}):
            get = {r["target"]: r for r in prox if r["mode"] == mode and r["concurrency"] == c}
            if "aalis" in get and "nginx" in get:
                n = get["nginx"]
                for who in ("aalis", TWIN):
                    if who in get:
                        cells = cells_of(get[who], n)
                        met[who] += cells
                        lines.append(judged(who, c, f"{mode} C={c}: {rule}", cells, detail_of(get[who], n)))
                for target, build in OTHER_BUILDS:
                    if target in get:
                        lines.append(f"  (not a target) {build} at C={c}: {other_build(get[target], n)}")
    if met[TWIN]:
        lines.append(f"  (not a target) proxy cells met: `serve` {sum(met['aalis'])} of {len(met['aalis'])}; "
                     f"{TWIN_SAYS} {sum(met[TWIN])} of {len(met[TWIN])}, which is what the host alone "
                     "gives a proxy that is nginx")
    for r in results["idle"]:
        if r["target"] == "aalis":
            ok = r["kib_per_stream"] <= 64 and r["ready"] == r["streams"]
            lines.append(f"≤ 64 KiB per open stream: {'MET' if ok else 'MISSED'} ({r['kib_per_stream']:.1f} KiB, "
                         f"{r['ready']} streams)")
    s = results.get("soak")
    if s:
        # "No growth": under 1 MiB per hour after warm-up, by the robust
        # (Theil–Sen) slope, judged on a soak of the ten minutes
        # or more.
        steady_min = (s["seconds"] - s["warmup_s"]) / 60
        slope = s["ts_slope_kib_per_min"]
        grew = slope * steady_min
        if s["seconds"] >= 600:
            verdict = "MET" if slope * 60 < 1024 else "MISSED"
        else:
            verdict = f"not judged ({s['seconds']} s soak; run --soak-seconds 600)"
        lines.append(f"no growth over a 10-minute soak: {verdict} (Theil–Sen slope {slope:+.1f} KiB/min "
                     f"after warm-up, {grew:+.0f} KiB over {steady_min:.1f} min; least squares "
                     f"{s['slope_kib_per_min']:+.1f}; RSS {s['rss_steady_start_kib']:,} → {s['rss_end_kib']:,} KiB)")
    return lines


def main():
    global DEADLINE
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mode", choices=sorted(MODES), default="full")
    ap.add_argument("--aalis", required=True, help="the aalis-proxy binary")
    ap.add_argument("--loadgen", required=True, help="the examples/loadgen binary")
    ap.add_argument("--plain", help="a release build without profile-guided optimization (what `cargo build "
                    "--release` gives), measured beside --aalis: filter contenders, instruction counts, a proxy target")
    ap.add_argument("--forward-only", help="a build made with --cfg aalis_forward_only (annotates nothing): "
                    "a fourth proxy target, the HTTP path's cost without parsing")
    ap.add_argument("--fresh-processes", action="store_true",
                    help="start every proxy target afresh for each repetition of the proxy part, so that no "
                    "process's own luck (where its threads run, how its memory is laid out) lasts for all of them")
    ap.add_argument("--workdir", default="/tmp/aalis-bench")
    ap.add_argument("--soak-seconds", type=int)
    ap.add_argument("--reps", type=int)
    ap.add_argument("--mb", type=float, help="size of each generated capture")
    ap.add_argument("--only", default="throughput,callgrind,proxy,memory,criterion",
                    help="comma-separated parts to run")
    ap.add_argument("--deadline-seconds", type=int)
    a = ap.parse_args()
    cfg = dict(MODES[a.mode])
    smoke = a.mode == "smoke"
    if a.reps:
        cfg["reps"] = cfg["proxy_reps"] = a.reps
    if a.mb:
        cfg["mb"] = a.mb
    soak_seconds = a.soak_seconds if a.soak_seconds is not None else (3 if smoke else 600)
    # Inside scripts/bench.sh's `timeout` (10 and 45 min), so the run stops itself.
    DEADLINE = time.monotonic() + (a.deadline_seconds or (300 if smoke else 2400))
    only = set(a.only.split(","))
    os.makedirs(a.workdir, exist_ok=True)
    notes = []
    # AALIS_BENCH_WITHOUT=jq,nginx runs as a machine without them would.
    without = set(os.environ.get("AALIS_BENCH_WITHOUT", "").split(","))
    have_jq = shutil.which("jq") is not None and "jq" not in without
    have_nginx = shutil.which("nginx") is not None and "nginx" not in without
    results = dict(mode=a.mode, config=cfg, throughput=[], callgrind=[], proxy=[], peak_rss=[], idle=[], soak=None,
                   criterion=[], notes=notes)
    try:
        if "throughput" in only:
            verify_baselines(a.workdir, a.aalis, have_jq)
            results["throughput"] = throughput(cfg, a.workdir, a.aalis, a.plain, a.loadgen, have_jq, notes)
        if "callgrind" in only:
            results["callgrind"] = callgrind(cfg, a.workdir, a.aalis, a.plain, notes)
        if "proxy" in only or "memory" in only:
            sample = capture(a.workdir, "tool", cfg["sample_mb"], seed=8)
            upstream, up_port = start_upstream(a.loadgen, sample, a.workdir)
            targets_ = {"direct": up_port}
            pids = {}
            # Each proxy target's process, how it is stopped and how it is
            # started (name → (Popen, signal, launcher)), so that a
            # repetition can drive fresh ones (--fresh-processes).
            procs = {}
            # The largest VmHWM of each target's processes that were stopped,
            # and the targets restarted, one entry a restart.
            peak = {}
            restarted = []

            def launch(name, launcher, sig):
                p, port = launcher()
                procs[name] = (p, sig, launcher)
                targets_[name] = port
                pids[name] = p.pid

            def restart(name):
                restarted.append(name)
                p, sig, launcher = procs[name]
                peak[name] = max(peak.get(name, 0), tree_hwm_kib(p.pid))
                stop(p, sig)
                launch(name, launcher, sig)

            def start_build(binary, log_name="serve.log"):
                return lambda: start_aalis(binary, up_port, a.workdir, log_name)

            launch("aalis", start_build(a.aalis), signal.SIGTERM)
            # The other builds (OTHER_BUILDS), each in serve's place, and the
            # second nginx (TWIN): for the proxy part only.
            builds = [(a.plain, "aalis (plain build)", "serve-plain.log"),
                      (a.forward_only, "forward-only", "serve-forward-only.log")]
            for binary, name, log_name in builds:
                if binary and "proxy" in only:
                    launch(name, start_build(binary, log_name), signal.SIGTERM)
            if have_nginx:
                launch("nginx", lambda: start_nginx(up_port, a.workdir), signal.SIGQUIT)
                if "proxy" in only:
                    launch(TWIN, lambda: start_nginx(up_port, a.workdir, "nginx-2"), signal.SIGQUIT)
            else:
                notes.append("nginx is not available: no nginx comparison.")
            if "proxy" in only:
                results["proxy"] = proxy_overhead(cfg, a.loadgen, targets_, pids, notes,
                                                  restart if a.fresh_processes else None)
                if a.fresh_processes:
                    notes.append(f"--fresh-processes: each repetition of the proxy part drove fresh proxies "
                                 f"({len(restarted)} restarts).")
                # High-water RSS after the unpaced runs: what buffering cost
                # (with --fresh-processes, the largest of any one process).
                results["peak_rss"] = [dict(target=name, rss_kib=tree_rss_kib(procs[name][0].pid),
                                            vm_hwm_kib=max(peak.get(name, 0), tree_hwm_kib(procs[name][0].pid)))
                                       for name in ("aalis", "nginx") if name in procs]
                for name in list(procs):
                    if name not in ("aalis", "nginx"):
                        stop(procs[name][0], procs[name][1])
            aalis = procs["aalis"][0]
            nginx = procs["nginx"][0] if "nginx" in procs else None
            if "memory" in only:
                # Fresh processes, warmed by one small paced run, so "before"
                # is a proxy at rest rather than one that just buffered the
                # unpaced runs.
                stop(aalis)
                aalis, aalis_port = start_aalis(a.aalis, up_port, a.workdir)
                warm = [("aalis", aalis_port, aalis)]
                if nginx:
                    stop(nginx, signal.SIGQUIT)
                    nginx, nginx_port = start_nginx(up_port, a.workdir)
                    warm.append(("nginx", nginx_port, nginx))
                for name, port, proc in warm:
                    drive(a.loadgen, port, 16, 20, cfg["delay_us"], timeout=min(left(), 60))
                    results["idle"].append(idle_streams(cfg, a.loadgen, name, port, proc.pid))
                if nginx:
                    stop(nginx, signal.SIGQUIT)
                if soak_seconds > 0:
                    # A fresh proxy, so the slope is its own.
                    stop(aalis)
                    aalis, aalis_port = start_aalis(a.aalis, up_port, a.workdir)
                    results["soak"] = soak(cfg, a.loadgen, aalis_port, aalis.pid, soak_seconds)
            stop(aalis)
            if nginx:
                stop(nginx, signal.SIGQUIT)
            stop(upstream)
        if "criterion" in only:
            results["criterion"] = criterion(cfg, smoke, notes)
    finally:
        for p in CHILDREN:
            stop(p)
    results["elapsed_s"] = time.monotonic() - STARTED
    md = table(results, cfg)
    with open(os.path.join(a.workdir, "results.json"), "w") as f:
        json.dump(results, f, indent=1, default=str)
    with open(os.path.join(a.workdir, "results.md"), "w") as f:
        f.write(md)
    print(md)
    log(f"done in {results['elapsed_s']:.0f} s; results in {a.workdir}/results.md and results.json")


if __name__ == "__main__":
    main()
