"""Validate the simulator against the emulated fleet measured over HTTP through the router.

For each workload (shared-prefix, multi-turn) and each strategy (RANDOM,
LEAST_OUTSTANDING_REQUESTS, PREFIX_AWARE) it

1. starts 4 ``prefixroute emulate`` processes (fresh caches) and ``prefixroute serve``
   in front of them, drives the workload's sessions through the router in scaled real
   time (open loop, :func:`prefixroute.demo.loadgen.run_sessions`) and reads the
   engines' ``/metrics``: prefix-cache counters, and their own TTFT histogram, whose
   mean subtracted from the clients' mean TTFT is the time requests spent outside the
   engines (HTTP, router, event loops: the *overhead*, which the simulator does not
   predict);
2. simulates the same workload, seed, fleet size, routing and duration
   (:mod:`prefixroute.sim`), with that overhead as ``overhead_s``;
3. compares cache-hit rate and P50 TTFT and fails (exit 1) if any differs by more
   than ``--tolerance`` (10 %, relative to the HTTP measurement).

Usage::

    python bench/validate_simulator.py [--duration 180] [--time-scale 1.0] [--json PATH]

Takes about ``6 × duration × time-scale`` real seconds plus start-up. docs/SIMULATOR.md
has a run's output and explains the choices.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from dataclasses import asdict
from typing import Any

import aiohttp
import orjson

from prefixroute.core.config import RoutingConfig, RoutingStrategy
from prefixroute.demo.loadgen import run_sessions
from prefixroute.demo.processes import ProcessGroup
from prefixroute.demo.report import scrape_counters, summarize
from prefixroute.engine.model import EngineConfig, step_duration
from prefixroute.sim import SimConfig, instance_ids, simulate
from prefixroute.workloads.multi_turn import MultiTurnWorkload
from prefixroute.workloads.shared_prefix import SharedPrefixWorkload

STRATEGIES = (RoutingStrategy.RANDOM, RoutingStrategy.LEAST_OUTSTANDING_REQUESTS, RoutingStrategy.PREFIX_AWARE)
PREFIX_LENGTH = 4096
CONCURRENCY_THRESHOLD = 8
#: KV capacity per instance, tokens: the shared-prefix documents (24 × 4,000 tokens) do
#: not fit one instance but fit the four, so the strategies differ.
KV_CAPACITY = 60_000
CALIBRATION_PROMPT = "ping"  # 1 token: no full block, so it touches no cache


def workloads(seed: int) -> dict[str, Any]:
    """The validation workloads (a few minutes each on 4 instances)."""
    return {
        "shared-prefix": SharedPrefixWorkload(groups=24, prefix_tokens=4000, question_tokens=1000, output_tokens=32,
                                              arrival_rate=3.0, seed=seed),
        "multi-turn": MultiTurnWorkload(conversation_rate=0.5, system_prompts=1, system_tokens=500,
                                        think_time_s=5.0, seed=seed),
    }


def routing(strategy: RoutingStrategy) -> RoutingConfig:
    if strategy is RoutingStrategy.PREFIX_AWARE:
        return RoutingConfig.build(strategy, PREFIX_LENGTH, CONCURRENCY_THRESHOLD)
    return RoutingConfig.build(strategy)


async def measure_overhead(url: str, time_scale: float, n: int = 20) -> float:
    """Median model seconds a request spends outside the engine, at idle.

    Sends ``n`` one-token chat requests (``max_tokens`` 1) one at a time; the engine's
    own time for each is one step of its prompt, so the rest of the client's TTFT is
    HTTP, router and event-loop time.
    """
    from prefixroute.engine.server import GENERATION_PROMPT
    from prefixroute.engine.tokenizer import count_tokens

    body = {"model": EngineConfig().model, "messages": [{"role": "user", "content": CALIBRATION_PROMPT}],
            "max_tokens": 1, "stream": True}
    prompt_tokens = count_tokens(f"<|user|>\n{CALIBRATION_PROMPT}\n{GENERATION_PROMPT}")
    engine_s = step_duration(EngineConfig(), prompt_tokens, 0)
    samples = []
    async with aiohttp.ClientSession() as s:
        for _ in range(n):
            t0 = time.perf_counter()
            async with s.post(url, data=orjson.dumps(body), headers={"Content-Type": "application/json"}) as r:
                async for _chunk in r.content.iter_any():
                    samples.append(time.perf_counter() - t0)
                    break
                await r.read()
            await asyncio.sleep(0.05)
    return max(0.0, statistics.median(samples) / time_scale - engine_s)


async def http_run(name: str, strategy: RoutingStrategy, args: argparse.Namespace, procs: ProcessGroup,
                   on_done: Any) -> tuple[Any, float]:
    engines = []
    for i in range(args.instances):
        engines.append(await asyncio.to_thread(procs.start, f"engine-{i}", [
            "emulate", "--port", "0", "--instance-id", f"instance-{i}", "--time-scale", str(args.time_scale),
            "--kv-capacity-tokens", str(KV_CAPACITY)]))
    urls = [e.url for e in engines]
    # An idle measurement through a router of its own (so that the measured run's router
    # starts with its random generator untouched, like the simulator's), for reference.
    calib = ["serve", "--port", "0", "--admin-port", "0"] + [x for u in urls for x in ("--backend", u)]
    calibration_router = await asyncio.to_thread(procs.start, "calibration-router", calib)
    idle_overhead = await measure_overhead(calibration_router.url + "/v1/chat/completions", args.time_scale)
    await asyncio.to_thread(procs.stop, calibration_router)
    serve = ["serve", "--port", "0", "--admin-port", "0", "--strategy", strategy.cli_name, "--seed", str(args.seed)]
    if strategy is RoutingStrategy.PREFIX_AWARE:
        serve += ["--prefix-length", str(PREFIX_LENGTH), "--concurrency-threshold", str(CONCURRENCY_THRESHOLD)]
    for u in urls:
        serve += ["--backend", u]
    router = await asyncio.to_thread(procs.start, "router", serve)
    url = router.url + "/v1/chat/completions"
    names = ["vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total",
             "vllm:time_to_first_token_seconds_sum", "vllm:time_to_first_token_seconds_count"]
    before = await scrape_counters(urls, names)
    wl = workloads(args.seed)[name]
    results, wall = await run_sessions(url, wl.sessions(), args.duration, args.time_scale, on_done=on_done)
    after = await scrape_counters(urls, names)
    d = {n: after[n] - before[n] for n in names}
    summary = summarize(strategy.value, results, wall, args.time_scale, urls, d[names[0]], d[names[1]])
    # The run's own overhead: the clients' mean TTFT minus the engines' mean TTFT (their
    # histogram, model seconds from the engine's arrival to the first token).
    client = [r.ttft_s / args.time_scale for r in results if r.ttft_s is not None and not r.error]
    engine_mean = d[names[2]] / d[names[3]] if d[names[3]] else 0.0
    overhead = max(0.0, statistics.fmean(client) - engine_mean) if client else idle_overhead
    procs.stop_all()
    return summary, overhead, idle_overhead


def sim_run(name: str, strategy: RoutingStrategy, args: argparse.Namespace, overhead_s: float) -> tuple[Any, float]:
    cfg = SimConfig(instance_ids(args.instances), routing(strategy), engine=EngineConfig(kv_capacity_tokens=KV_CAPACITY),
                    duration_s=args.duration, overhead_s=overhead_s, seed=args.seed)
    res = simulate(cfg, workloads(args.seed)[name])
    return res.summary(), res.wall_s


def rel(sim: float, http: float) -> float:
    return abs(sim - http) / http if http else float("inf")


async def main(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
    from rich.table import Table

    console = Console()
    if not console.is_terminal:
        console = Console(width=200)
    names = [n for n in args.workloads.split(",") if n]
    rows: list[dict[str, Any]] = []
    runs: list[dict[str, Any]] = []
    console.print(f"[bold]validate_simulator[/bold]: {args.instances} instances, {args.duration:.0f} model s per run, "
                  f"time scale {args.time_scale}, tolerance {args.tolerance * 100:.0f} %")
    with ProcessGroup() as procs, Progress(TextColumn("{task.description}"), BarColumn(),
                                           TextColumn("{task.completed} requests"), TimeElapsedColumn(),
                                           console=console) as bar:
        for name in names:
            for strategy in STRATEGIES:
                task = bar.add_task(f"{name:<14} {strategy.value:<27} HTTP", total=None)
                http, overhead, idle_overhead = await http_run(name, strategy, args, procs,
                                                               lambda _r, task=task: bar.advance(task))
                bar.update(task, description=f"{name:<14} {strategy.value:<27} HTTP + simulated")
                sim, sim_wall = sim_run(name, strategy, args, overhead)
                bar.update(task, total=http.requests, completed=http.requests)
                d_hit = rel(sim.cache_hit_rate, http.cache_hit_rate)
                d_p50 = rel(sim.p50_ttft_s, http.p50_ttft_s)
                rows.append({"workload": name, "strategy": strategy.value, "overhead_ms": overhead * 1e3,
                             "idle_overhead_ms": idle_overhead * 1e3,
                             "http": http, "sim": sim, "hit_rel_diff": d_hit, "p50_rel_diff": d_p50,
                             "sim_wall_s": sim_wall})
                runs += [asdict(http) | {"workload": name, "side": "http", "overhead_s": overhead},
                         asdict(sim) | {"workload": name, "side": "sim", "overhead_s": overhead}]
    table = Table(title=f"Simulator vs emulated fleet over HTTP ({args.instances} instances, "
                        f"{args.duration:.0f} model s, time scale {args.time_scale}); model seconds",
                  title_justify="left")
    for col in ("workload", "strategy", "requests http/sim", "hit http", "hit sim", "Δ hit", "P50 http",
                "P50 sim", "Δ P50", "P90 http", "P90 sim", "overhead run/idle", "ok"):
        table.add_column(col, justify="left" if col in ("workload", "strategy") else "right", no_wrap=True)
    failed = False
    for r in rows:
        h, s = r["http"], r["sim"]
        ok = r["hit_rel_diff"] <= args.tolerance and r["p50_rel_diff"] <= args.tolerance and h.errors == 0
        failed |= not ok
        table.add_row(r["workload"], r["strategy"], f"{h.requests}/{s.requests}",
                      f"{h.cache_hit_rate * 100:.1f} %", f"{s.cache_hit_rate * 100:.1f} %",
                      f"{r['hit_rel_diff'] * 100:.1f} %", f"{h.p50_ttft_s * 1e3:.1f} ms", f"{s.p50_ttft_s * 1e3:.1f} ms",
                      f"{r['p50_rel_diff'] * 100:.1f} %", f"{h.p90_ttft_s * 1e3:.0f} ms", f"{s.p90_ttft_s * 1e3:.0f} ms",
                      f"{r['overhead_ms']:.1f}/{r['idle_overhead_ms']:.1f} ms", "yes" if ok else "NO")
    console.print(table)
    console.print("Δ = |sim − http| / http. overhead = time a request spent outside the engines, model ms: "
                  "'run' = the run's mean client TTFT minus the engines' mean TTFT (given to the simulator as "
                  "overhead_s), 'idle' = one-token requests at idle before the run (for reference).")
    if args.json:
        from pathlib import Path

        wl = workloads(args.seed)
        doc = {"workload": "; ".join(wl[n].describe() for n in names) +
                           f"; instances={args.instances} duration_s={args.duration:g} time_scale={args.time_scale:g}",
               "runs": runs,
               "validation": [{"workload": r["workload"], "strategy": r["strategy"], "overhead_ms": r["overhead_ms"],
                               "idle_overhead_ms": r["idle_overhead_ms"],
                               "cache_hit_rate": {"http": r["http"].cache_hit_rate, "sim": r["sim"].cache_hit_rate,
                                                  "rel_diff": r["hit_rel_diff"]},
                               "p50_ttft_s": {"http": r["http"].p50_ttft_s, "sim": r["sim"].p50_ttft_s,
                                              "rel_diff": r["p50_rel_diff"]},
                               "p90_ttft_s": {"http": r["http"].p90_ttft_s, "sim": r["sim"].p90_ttft_s},
                               "tolerance": args.tolerance} for r in rows]}
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_bytes(orjson.dumps(doc, option=orjson.OPT_INDENT_2))
        console.print(f"results: {args.json}")
    console.print("[green]all within tolerance[/green]" if not failed else "[red]some runs differ by more than the "
                                                                           "tolerance[/red]")
    return 1 if failed else 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--duration", type=float, default=180.0, help="model seconds of traffic per run (default: 180)")
    p.add_argument("--time-scale", type=float, default=1.0,
                   help="real seconds per model second of the emulated engines (default: 1.0, real time)")
    p.add_argument("--instances", type=int, default=4, help="engine instances (default: 4)")
    p.add_argument("--workloads", default="shared-prefix,multi-turn", help="comma-separated (default: both)")
    p.add_argument("--tolerance", type=float, default=0.10, help="largest relative difference (default: 0.10)")
    p.add_argument("--seed", type=int, default=0, help="workload and router seed (default: 0)")
    p.add_argument("--json", metavar="PATH", help="write SPEC section 7 JSON with both sides per strategy")
    return p.parse_args(argv)


if __name__ == "__main__":
    sys.exit(asyncio.run(main(parse_args())))
