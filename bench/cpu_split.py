"""Where a router's CPU per request goes at concurrency 1: user and system time, context
switches and (with ``strace`` installed) system calls, per request, side by side with the
python relay floor.

``bench/overhead.py`` reports each router's CPU per request as one figure (its process
tree's user + system time). This program splits it, on the same fast backend, bodies and
wrk load: for each router it starts the backend's peer, runs ``--warmup`` seconds of
wrk at concurrency 1, then ``--duration`` seconds while it reads the router's
``/proc/<pid>/task/*/stat`` and ``status`` before and after (utime, stime, voluntary and
involuntary context switches, minor faults), and prints them per request. With
``--strace`` it runs the measured load a second time under ``strace -c -f -p PID`` and
prints the system calls per request (strace slows the process: its run's latency is not
comparable). Single-process routers only (the figures are the router process's).

Usage::

    python bench/cpu_split.py [--routers prefixroute-cache-aware,python-relay-floor]
                              [--body-size 32K] [--duration 5] [--warmup 2] [--strace]
"""

from __future__ import annotations

import argparse
import glob
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from backend_launch import start_fast_backend  # noqa: E402  (bench/ is a folder of scripts)
import overhead as O  # noqa: E402
from overhead_settings import FULL, make_bodies, parse_size, write_bodies  # noqa: E402
from peer_process import ProcessTracker  # noqa: E402
from wrk_load import WRK_SCRIPT, run_wrk  # noqa: E402

_TICK_US = 1e6 / 100  # /proc/<pid>/stat times are in clock ticks (USER_HZ, 100 on Linux)


def read_proc(pid: int) -> dict[str, int]:
    """Sums over the threads of ``pid``: ``utime``, ``stime`` (clock ticks), ``minflt``,
    ``voluntary`` and ``nonvoluntary`` context switches."""
    out = dict.fromkeys(("utime", "stime", "minflt", "voluntary", "nonvoluntary"), 0)
    for task in glob.glob(f"/proc/{pid}/task/*"):
        try:
            with open(task + "/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(task + "/status") as f:
                status = dict(line.split(":\t", 1) for line in f.read().splitlines() if ":\t" in line)
        except OSError:
            continue  # (a thread that ended meanwhile)
        out["minflt"] += int(fields[7])
        out["utime"] += int(fields[11])
        out["stime"] += int(fields[12])
        out["voluntary"] += int(status["voluntary_ctxt_switches"])
        out["nonvoluntary"] += int(status["nonvoluntary_ctxt_switches"])
    return out


def parse_strace_summary(text: str) -> dict[str, int]:
    """``syscall -> calls`` from ``strace -c`` output."""
    calls: dict[str, int] = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) >= 5 and parts[-1] not in ("syscall", "total") and parts[0][0].isdigit():
            try:
                calls[parts[-1]] = int(parts[3])
            except ValueError:
                continue
    return calls


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python bench/cpu_split.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--routers", default="prefixroute-cache-aware,python-relay-floor",
                   help="comma-separated router slugs of bench/overhead.py (single-process ones) "
                        "(default: prefixroute-cache-aware,python-relay-floor)")
    p.add_argument("--body-size", default="32K", help="request body size, K = 1024 bytes (default: 32K)")
    p.add_argument("--duration", type=int, default=5, help="seconds of measured load per router (default: 5)")
    p.add_argument("--warmup", type=int, default=2, help="seconds of load before measuring (default: 2)")
    p.add_argument("--strace", action="store_true", help="also count system calls per request with strace -c")
    args = p.parse_args(argv)
    if args.duration < 1 or args.warmup < 0:
        p.error("--duration must be >= 1 and --warmup >= 0")
    try:
        size = parse_size(args.body_size)
    except ValueError as exc:
        p.error(f"--body-size: {exc}")
    specs = {O.slug(s.label): s for s in O.router_specs(FULL)}
    wanted = [w.strip() for w in args.routers.split(",") if w.strip()]
    unknown = [w for w in wanted if w not in specs]
    if unknown or not wanted:
        p.error(f"unknown router(s) {unknown}; choose among {', '.join(sorted(specs))}")
    wrk = shutil.which("wrk")
    if wrk is None:
        print("error: wrk is not installed (Debian: apt-get install wrk)", file=sys.stderr)
        return 2
    if args.strace and shutil.which("strace") is None:
        print("error: --strace needs strace installed", file=sys.stderr)
        return 2
    rows = []
    with ProcessTracker() as tracker:
        script = tracker.path("bodies", ".lua")
        script.write_text(WRK_SCRIPT)
        files = write_bodies(tracker.workdir / "bodies", make_bodies(size, False, 16, 0), "body")
        backend = start_fast_backend(tracker, FULL.instances, first_port=FULL.backend_port, log=print)
        for slug in wanted:
            router = specs[slug].start(tracker, backend.urls)
            url = router.url + "/v1/chat/completions"
            pid = router.process.proc.pid
            if args.warmup:
                run_wrk(tracker, url, files, 1, args.warmup, wrk=wrk, script=script)
            before = read_proc(pid)
            res = run_wrk(tracker, url, files, 1, args.duration, wrk=wrk, script=script)
            after = read_proc(pid)
            n = max(1, res.requests)
            row = {"router": specs[slug].label, "requests": res.requests, "p50_ms": res.p50_ms,
                   "user_us": (after["utime"] - before["utime"]) * _TICK_US / n,
                   "sys_us": (after["stime"] - before["stime"]) * _TICK_US / n,
                   "vol": (after["voluntary"] - before["voluntary"]) / n,
                   "invol": (after["nonvoluntary"] - before["nonvoluntary"]) / n,
                   "minflt": (after["minflt"] - before["minflt"]) / n, "syscalls": {}}
            if args.strace:
                out = tracker.path(f"strace-{slug}", ".txt")
                st = subprocess.Popen(["strace", "-c", "-f", "-p", str(pid), "-o", str(out)],
                                      stderr=subprocess.DEVNULL)
                try:
                    time.sleep(0.3)
                    traced = run_wrk(tracker, url, files, 1, args.duration, wrk=wrk, script=script)
                finally:  # (strace detaches and writes its summary on SIGINT)
                    st.send_signal(2)
                    try:
                        st.wait(30)
                    except subprocess.TimeoutExpired:
                        st.kill()
                        st.wait()
                calls = parse_strace_summary(out.read_text())
                row["syscalls"] = {k: v / max(1, traced.requests) for k, v in sorted(calls.items())
                                   if v / max(1, traced.requests) >= 0.05}
            tracker.stop([router.process])
            rows.append(row)
    print(f"concurrency 1, {size // 1024} KB bodies, {args.duration} s of wrk per router; per request:")
    print(f"{'router':32s} {'requests':>9s} {'p50 ms':>7s} {'user us':>8s} {'sys us':>7s} "
          f"{'vol cs':>7s} {'invol cs':>8s} {'minflt':>7s}")
    for r in rows:
        print(f"{r['router']:32s} {r['requests']:9,d} {r['p50_ms']:7.2f} {r['user_us']:8.0f} {r['sys_us']:7.0f} "
              f"{r['vol']:7.2f} {r['invol']:8.2f} {r['minflt']:7.2f}")
        if r["syscalls"]:
            print(f"{'':32s} system calls: " + ", ".join(f"{k} {v:.2f}" for k, v in r["syscalls"].items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
