"""Requests/s through ``prefixroute serve --workers N`` for several N, against a fast backend.

What it measures: how the router's throughput scales with worker processes
(``--workers``, docs/WORKERS.md). The backend is ``bench/fast_backend.py`` (a raw
uvloop HTTP/1.1 server answering canned OpenAI-shaped JSON on ``--instances`` ports,
the fleet's instances), so that the router is the bottleneck; the load is ``wrk``
(a separate process, ``/usr/bin/wrk`` or on PATH): a closed loop of ``--connections``
keep-alive connections POSTing 1 KB chat bodies that cycle over 16 distinct system
prompts (so that PREFIX_AWARE spreads them over the instances).

For each of ``--rounds`` rounds: ``direct`` (wrk against the backend's first port, no
router: the ceiling of this machine's load generator + backend), then every worker count
in turn; each target gets a ``--warmup`` run, then a ``--duration`` run. A fresh router
is started per (round, worker count). Reported per target, as the median over rounds:
requests/s, speed-up over one worker, p50/p99 latency (wrk ``--latency``: request sent
to whole response received), the router's CPU use (utime + stime of its process tree,
from ``/proc``, over the measured run, in cores), its CPU time per request (µs: what a
worker count costs, whatever share of the machine the router got) and errors (non-2xx
+ socket errors). The load of the machine (1-minute load average) before and after each
run goes to the JSON.

On a machine with C cores the router cannot use more than the cores that wrk and the
backend leave it: read the speed-up next to the ``cores`` column.

Usage::

    python bench/workers_scaling.py                         # workers 1 and 2, 3 rounds of 10 s
    python bench/workers_scaling.py --workers 1,2,4 --duration 20 --json scaling.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parent))  # (bench/ is a folder of scripts)
from proc_stats import trees_cpu_seconds  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
_LISTEN = re.compile(r"(prefixroute-serve|fast-backend) listening on (http://\S+)")
_RESULT = re.compile(r"^WORKERS_SCALING (\{.*\})$", re.M)

# wrk script: one pre-formatted POST per body file given after `--`, sent in turn;
# `done` prints one machine-readable line.
_LUA = r"""
local reqs = {}
local i = 0
function init(args)
  for k, path in ipairs(args) do
    local f = assert(io.open(path, "rb"))
    local body = f:read("*a")
    f:close()
    reqs[k] = wrk.format("POST", "/v1/chat/completions", {["Content-Type"] = "application/json"}, body)
  end
end
function request()
  i = i % #reqs + 1
  return reqs[i]
end
function done(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    'WORKERS_SCALING {"requests": %d, "duration_us": %d, "p50_us": %d, "p99_us": %d, ' ..
    '"connect": %d, "read": %d, "write": %d, "status": %d, "timeout": %d}\n',
    summary.requests, summary.duration, latency:percentile(50), latency:percentile(99),
    e.connect, e.read, e.write, e.status, e.timeout))
end
"""


@dataclass
class Measure:
    """One measured wrk run against one target."""

    target: str
    workers: int | None
    round: int
    requests: int
    duration_s: float
    p50_ms: float
    p99_ms: float
    errors: int
    router_cpu_cores: float | None
    loadavg_before: float
    loadavg_after: float

    @property
    def rps(self) -> float:
        return self.requests / self.duration_s if self.duration_s else 0.0


class Child:
    """A child process whose stdout+stderr go to a log file; its listening URLs are
    read from that log."""

    def __init__(self, name: str, argv: Sequence[str], logdir: Path) -> None:
        self.name = name
        self.log = logdir / f"{name}-{time.monotonic_ns()}.log"
        self._fh = self.log.open("wb")
        self.proc = subprocess.Popen(list(argv), stdout=self._fh, stderr=subprocess.STDOUT, cwd=REPO,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1"}, start_new_session=True)

    def urls(self, count: int, timeout_s: float = 90.0) -> list[str]:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            found = [m.group(2) for m in _LISTEN.finditer(self.log.read_text(errors="replace"))]
            if len(found) >= count:
                return found[:count]
            if self.proc.poll() is not None:
                break
            time.sleep(0.05)
        raise RuntimeError(f"{self.name} did not start; its log ({self.log}):\n"
                           f"{self.log.read_text(errors='replace')[-2000:]}")

    def stop(self, timeout_s: float = 30.0) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self._fh.close()


def _tree_cpu_s(root: int) -> float:
    """utime + stime of ``root`` and every live descendant, seconds."""
    return trees_cpu_seconds([root], reaped=False)


def _bodies(directory: Path, count: int = 16, size: int = 1024) -> list[Path]:
    paths = []
    for i in range(count):
        system = f"{i:02d} You are assistant number {i}; answer briefly. "
        filler = ("Context line %d of the shared document. " % i) * (size // 40)
        doc = {"model": "m", "max_tokens": 16,
               "messages": [{"role": "system", "content": (system + filler)[:size - 120]},
                            {"role": "user", "content": "Summarise."}]}
        p = directory / f"body-{i:02d}.json"
        p.write_text(json.dumps(doc))
        paths.append(p)
    return paths


def _wrk(wrk: str, url: str, seconds: int, args: argparse.Namespace, script: Path, bodies: list[Path]) -> dict:
    cmd = [wrk, "--latency", "-t", str(min(args.threads, args.connections)), "-c", str(args.connections),
           "-d", f"{seconds}s", "--timeout", "10s", "-s", str(script), url, "--", *map(str, bodies)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=seconds + 60)
    m = _RESULT.search(out.stdout)
    if not m:
        raise RuntimeError(f"wrk printed no result (exit {out.returncode}):\n{out.stdout[-1500:]}\n"
                           f"{out.stderr[-1500:]}")
    return json.loads(m.group(1))


def _measure(target: str, workers: int | None, rnd: int, url: str, router_pid: int | None,
             wrk: str, args: argparse.Namespace, script: Path, bodies: list[Path]) -> Measure:
    if args.warmup > 0:
        _wrk(wrk, url, args.warmup, args, script, bodies)
    load0 = os.getloadavg()[0]
    cpu0 = _tree_cpu_s(router_pid) if router_pid else None
    t0 = time.monotonic()
    r = _wrk(wrk, url, args.duration, args, script, bodies)
    wall = time.monotonic() - t0
    cpu = (_tree_cpu_s(router_pid) - cpu0) / wall if router_pid and cpu0 is not None else None
    errors = r["connect"] + r["read"] + r["write"] + r["status"] + r["timeout"]
    return Measure(target, workers, rnd, r["requests"], r["duration_us"] / 1e6, r["p50_us"] / 1000,
                   r["p99_us"] / 1000, errors, cpu, load0, os.getloadavg()[0])


def run(args: argparse.Namespace) -> dict[str, Any]:
    wrk = shutil.which("wrk") or ("/usr/bin/wrk" if os.access("/usr/bin/wrk", os.X_OK) else None)
    if wrk is None:
        raise SystemExit("error: wrk is not installed (apt-get install -y wrk)")
    counts = [int(x) for x in args.workers.split(",")]
    if any(not 1 <= n <= 64 for n in counts):
        raise SystemExit("error: --workers takes numbers from 1 to 64, e.g. 1,2")
    measures: list[Measure] = []
    with tempfile.TemporaryDirectory(prefix="workers-scaling-") as tmp:
        work = Path(tmp)
        script = work / "post.lua"
        script.write_text(_LUA)
        bodies = _bodies(work)
        backend = Child("fast-backend", [sys.executable, str(REPO / "bench" / "fast_backend.py"),
                                         *(a for _ in range(args.instances) for a in ("--port", "0"))], work)
        try:
            instances = backend.urls(args.instances)
            for rnd in range(args.rounds):
                m = _measure("direct", None, rnd, instances[0], None, wrk, args, script, bodies)
                measures.append(m)
                print(f"round {rnd + 1}: direct                 {m.rps:9.0f} req/s", flush=True)
                for n in counts:
                    router = Child(f"serve-w{n}", [
                        sys.executable, "-m", "prefixroute", "serve", "--workers", str(n), "--port", "0",
                        "--admin-port", "0", *(a for u in instances for a in ("--backend", u)),
                        "--strategy", args.strategy, "--prefix-length", "1024",
                        "--concurrency-threshold", str(args.concurrency_threshold),
                        "--health-check-interval", "0", "--metrics-scrape-interval", "0"], work)
                    try:
                        [url] = router.urls(1)
                        m = _measure("prefixroute", n, rnd, url, router.proc.pid, wrk, args, script, bodies)
                    finally:
                        router.stop()
                    measures.append(m)
                    print(f"round {rnd + 1}: prefixroute --workers {n:<2} {m.rps:9.0f} req/s  "
                          f"(router {m.router_cpu_cores or 0:.2f} cores)", flush=True)
        finally:
            backend.stop()
    return summarise(measures, counts, args)


def summarise(measures: list[Measure], counts: list[int], args: argparse.Namespace) -> dict[str, Any]:
    def med(xs: list[float]) -> float:
        return statistics.median(xs) if xs else float("nan")

    rows = []
    for target, n in [("direct", None), *(("prefixroute", c) for c in counts)]:
        ms = [m for m in measures if m.target == target and m.workers == n]
        cpu = [m.router_cpu_cores for m in ms if m.router_cpu_cores is not None]
        per_req = [m.router_cpu_cores / m.rps * 1e6 for m in ms if m.router_cpu_cores is not None and m.rps]
        rows.append({"router": target, "workers": n, "throughput_rps": med([m.rps for m in ms]),
                     "p50_latency_s": med([m.p50_ms for m in ms]) / 1000,
                     "p99_latency_s": med([m.p99_ms for m in ms]) / 1000,
                     "router_cpu_cores": med(cpu) if cpu else None,
                     "router_cpu_us_per_request": med(per_req) if per_req else None,
                     "errors": sum(m.errors for m in ms), "requests": sum(m.requests for m in ms)})
    one = next((r["throughput_rps"] for r in rows if r["workers"] == 1), None)
    for r in rows:
        r["speedup_vs_1_worker"] = r["throughput_rps"] / one if one and r["workers"] else None
    return {
        "workload": (f"wrk -c {args.connections} -t {min(args.threads, args.connections)}, 1 KB chat bodies over 16 "
                     f"prefixes, {args.instances} fast-backend instances, strategy {args.strategy}"),
        "cores": os.cpu_count(), "cpu_affinity": len(os.sched_getaffinity(0)),
        "settings": {"duration_s": args.duration, "warmup_s": args.warmup, "rounds": args.rounds,
                     "connections": args.connections, "threads": args.threads, "instances": args.instances,
                     "strategy": args.strategy, "concurrency_threshold": args.concurrency_threshold},
        "runs": rows,
        "measurements": [asdict(m) | {"throughput_rps": m.rps} for m in measures],
    }


def table(result: dict[str, Any]) -> str:
    lines = [f"{result['workload']}; {result['cores']} cores; median of {result['settings']['rounds']} rounds of "
             f"{result['settings']['duration_s']} s",
             f"{'target':<26}{'req/s':>9}{'vs 1 worker':>13}{'p50 ms':>9}{'p99 ms':>9}{'router cores':>14}"
             f"{'CPU us/req':>12}{'errors':>8}"]
    for r in result["runs"]:
        name = "direct (no router)" if r["workers"] is None else f"prefixroute --workers {r['workers']}"
        speed = f"{r['speedup_vs_1_worker']:.2f}x" if r["speedup_vs_1_worker"] else "-"
        cpu = f"{r['router_cpu_cores']:.2f}" if r["router_cpu_cores"] is not None else "-"
        per_req = f"{r['router_cpu_us_per_request']:.0f}" if r["router_cpu_us_per_request"] is not None else "-"
        lines.append(f"{name:<26}{r['throughput_rps']:>9.0f}{speed:>13}{r['p50_latency_s'] * 1000:>9.2f}"
                     f"{r['p99_latency_s'] * 1000:>9.2f}{cpu:>14}{per_req:>12}{r['errors']:>8}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", default="1,2", help="comma-separated worker counts to measure (default: 1,2)")
    p.add_argument("--duration", type=int, default=10, help="seconds of each measured wrk run (default: 10)")
    p.add_argument("--warmup", type=int, default=2, help="seconds of the warm-up run before each (default: 2)")
    p.add_argument("--rounds", type=int, default=3, help="rounds over every target; medians reported (default: 3)")
    p.add_argument("--connections", type=int, default=64, help="wrk connections (default: 64)")
    p.add_argument("--threads", type=int, default=2, help="wrk threads (default: 2)")
    p.add_argument("--instances", type=int, default=4, help="fast-backend ports = instances (default: 4)")
    p.add_argument("--strategy", default="prefix-aware", help="routing strategy (default: prefix-aware)")
    p.add_argument("--concurrency-threshold", type=int, default=64,
                   help="ConcurrencyThreshold (default: 64, so that the threshold rarely binds)")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = p.parse_args(argv)
    result = run(args)
    print()
    print(table(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
