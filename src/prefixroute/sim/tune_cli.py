"""``prefixroute tune --trace PATH``: choose PrefixLength and ConcurrencyThreshold from a trace.

Replays a recorded trace (``prefixroute serve --record-trace``) or a Mooncake trace in
the simulator over a grid of PrefixLength × ConcurrencyThreshold plus the RANDOM and
LEAST_OUTSTANDING_REQUESTS baselines, prints a table, writes a plot, and recommends
settings with the reasons (:mod:`prefixroute.sim.tune`). Exit status: 0, or 2 for bad
arguments or an unreadable trace.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from prefixroute.core.config import ConfigError

__all__ = ["configure_parser", "run"]


def _ints(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers") from None


def configure_parser(p: argparse.ArgumentParser) -> None:
    """Add the ``tune`` flags to ``p``."""
    from prefixroute.sim.tune import DEFAULT_PREFIX_LENGTHS, DEFAULT_THRESHOLDS

    p.description = (
        "Replay a trace (prefixroute's own, from `prefixroute serve --record-trace`, or Mooncake's JSONL) in "
        "the simulator over a grid of PrefixLength and ConcurrencyThreshold, and recommend settings."
    )
    p.add_argument("--trace", required=True, metavar="PATH", help="the JSONL trace (format detected)")
    p.add_argument("--prefix-lengths", type=_ints, default=list(DEFAULT_PREFIX_LENGTHS), metavar="N,N,...",
                   help="PrefixLength values to try, characters (default: "
                        f"{','.join(map(str, DEFAULT_PREFIX_LENGTHS))})")
    p.add_argument("--thresholds", type=_ints, default=list(DEFAULT_THRESHOLDS), metavar="N,N,...",
                   help=f"ConcurrencyThreshold values to try (default: {','.join(map(str, DEFAULT_THRESHOLDS))})")
    p.add_argument("--instances", type=int, default=None,
                   help="instances of the simulated fleet (default: as many as the trace names, else 4)")
    p.add_argument("--replicas", type=int, default=1, help="router replicas (default: 1)")
    p.add_argument("--kv-capacity-tokens", type=int, default=None,
                   help="KV-cache capacity per instance, tokens (default: the engine's 1,200,000)")
    p.add_argument("--speedup", type=float, default=1.0,
                   help="replay the trace this many times faster, to see the settings under more load (default: 1)")
    p.add_argument("--duration", type=float, default=None,
                   help="replay only the first SECONDS (after the speed-up) of the trace (default: all)")
    p.add_argument("--overhead-ms", type=float, default=0.0,
                   help="model milliseconds per request outside the engine (default: 0)")
    p.add_argument("--jobs", type=int, default=None, help="worker processes (default: CPU count)")
    p.add_argument("--seed", type=int, default=0, help="seed (default: 0)")
    p.add_argument("--json", metavar="PATH", help="write SPEC section 7 JSON plus grid and recommendation")
    p.add_argument("--plot", default="prefixroute-tune.png", metavar="PATH",
                   help="where the plot goes (default: ./prefixroute-tune.png)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def _table(result: Any) -> Any:
    from rich.table import Table

    t = Table(title=f"prefixroute tune: {result.workload}; model seconds", title_justify="left")
    for col in ("strategy", "PrefixLength", "threshold", "cache hit", "P50 TTFT", "P90 TTFT", "overflow",
                "busiest instance", "throughput"):
        t.add_column(col, justify="left" if col == "strategy" else "right", no_wrap=True)
    rec = result.recommendation.point
    for p in result.baselines + result.grid:
        s = p.summary
        mark = " ◀" if p is rec else ""
        t.add_row(p.strategy + mark, str(p.prefix_length or "-"), str(p.concurrency_threshold or "-"),
                  f"{s.cache_hit_rate * 100:.1f} %", f"{s.p50_ttft_s * 1e3:.0f} ms", f"{s.p90_ttft_s * 1e3:.0f} ms",
                  f"{s.overflow_rate * 100:.1f} %", f"{p.busiest_share * 100:.1f} %", f"{s.throughput_rps:.2f} rps")
    return t


def run(args: argparse.Namespace) -> int:
    """Run ``prefixroute tune``; returns the exit status."""
    import orjson
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from prefixroute.engine.model import EngineConfig
    from prefixroute.sim.simulator import instance_ids
    from prefixroute.sim.tune import run_grid, tune_json, write_tune_plot
    from prefixroute.workloads.traces import TraceError, load_trace

    try:
        workload = load_trace(args.trace, speedup=args.speedup)
        names = workload.instances()
        n = args.instances or len(names) or 4
        instances = instance_ids(n)
        engine = EngineConfig() if args.kv_capacity_tokens is None else EngineConfig(
            kv_capacity_tokens=args.kv_capacity_tokens)
        if not args.prefix_lengths or not args.thresholds:
            raise ConfigError("--prefix-lengths and --thresholds need at least one value each")
    except (TraceError, ConfigError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    console = Console()
    if not console.is_terminal:
        console = Console(width=200)
    total = 2 + len(args.prefix_lengths) * len(args.thresholds)
    console.print(f"[bold]prefixroute tune[/bold]: {workload.describe()}; {n} instances, {total} runs")
    try:
        with Progress(TextColumn("simulating"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[last]}"),
                      TimeElapsedColumn(), console=console, disable=args.no_progress) as bar:
            task = bar.add_task("grid", total=total, last="")
            result = run_grid(
                workload, instances=instances, prefix_lengths=args.prefix_lengths, thresholds=args.thresholds,
                engine=engine, replicas=args.replicas, overhead_s=args.overhead_ms / 1000,
                duration_s=args.duration, seed=args.seed, jobs=args.jobs,
                on_done=lambda p: bar.update(task, advance=1, last=p.label))
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    console.print(_table(result))
    rec = result.recommendation
    console.print("[bold]Recommendation[/bold]: " + (
        f"PREFIX_AWARE with PrefixLength {rec.point.prefix_length}, ConcurrencyThreshold "
        f"{rec.point.concurrency_threshold}" if rec.point.prefix_length is not None else rec.point.strategy))
    for r in rec.reasons:
        console.print(f"  - {r}")
    path = write_tune_plot(args.plot, result)
    console.print(f"plot: {path}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_bytes(orjson.dumps(tune_json(result), option=orjson.OPT_INDENT_2))
        console.print(f"results: {args.json}")
    return 0
