"""How fast the simulator runs: one simulated hour of 7 instances at 20 requests/s.

For each workload (8,000-token shared prefixes; ShareGPT-like multi-turn chats) and each
strategy, simulates 3,600 model seconds of open-loop traffic at about 20 requests per
model second on 7 instances, and prints the wall time, the requests simulated and how
many per wall second. The goal is under 60 s per run on a 2-core machine.

Usage::

    python bench/sim_speed.py [--duration 3600] [--rate 20] [--profile]

``--profile`` runs the PREFIX_AWARE long-context case under cProfile and prints the
functions with the most own time.
"""

from __future__ import annotations

import argparse
import sys

from prefixroute.core.config import RoutingConfig, RoutingStrategy
from prefixroute.sim import SimConfig, instance_ids, simulate
from prefixroute.workloads.multi_turn import SHAREGPT_MEAN_TURNS, MultiTurnWorkload
from prefixroute.workloads.shared_prefix import SharedPrefixWorkload


def workloads(rate: float) -> dict[str, object]:
    return {
        "long-context": SharedPrefixWorkload(groups=300, prefix_tokens=8000, question_tokens=200, output_tokens=100,
                                             prompts_per_group=10, arrival_rate=rate),
        # conversations arrive at rate / mean turns, so turns arrive at about `rate`
        "multi-turn": MultiTurnWorkload(conversation_rate=rate / SHAREGPT_MEAN_TURNS, system_tokens=1000,
                                        think_time_s=10.0),
    }


def routing(strategy: RoutingStrategy) -> RoutingConfig:
    if strategy is RoutingStrategy.PREFIX_AWARE:
        return RoutingConfig.build(strategy, 8192, 16)
    return RoutingConfig.build(strategy)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--duration", type=float, default=3600.0, help="model seconds (default: 3600)")
    p.add_argument("--rate", type=float, default=20.0, help="requests per model second (default: 20)")
    p.add_argument("--instances", type=int, default=7, help="instances (default: 7)")
    p.add_argument("--profile", action="store_true", help="profile the PREFIX_AWARE long-context run instead")
    args = p.parse_args(argv)

    if args.profile:
        import cProfile
        import pstats

        cfg = SimConfig(instance_ids(args.instances), routing(RoutingStrategy.PREFIX_AWARE), duration_s=args.duration)
        prof = cProfile.Profile()
        prof.runcall(simulate, cfg, workloads(args.rate)["long-context"])
        pstats.Stats(prof).sort_stats("tottime").print_stats(20)
        return 0

    from rich.console import Console
    from rich.table import Table

    console = Console()
    if not console.is_terminal:
        console = Console(width=160)
    table = Table(title=f"Simulator speed: {args.duration:,.0f} model s, {args.instances} instances, "
                        f"~{args.rate:g} requests/s (open loop)", title_justify="left")
    for col in ("workload", "strategy", "requests", "wall", "requests/s simulated", "model s per wall s",
                "P50 TTFT", "cache hit"):
        table.add_column(col, justify="left" if col in ("workload", "strategy") else "right", no_wrap=True)
    worst = 0.0
    for name in workloads(args.rate):
        for strategy in (RoutingStrategy.RANDOM, RoutingStrategy.LEAST_OUTSTANDING_REQUESTS,
                         RoutingStrategy.PREFIX_AWARE):
            res = simulate(SimConfig(instance_ids(args.instances), routing(strategy), duration_s=args.duration),
                           workloads(args.rate)[name])
            s = res.summary()
            worst = max(worst, res.wall_s)
            table.add_row(name, strategy.value, f"{len(res.requests):,}", f"{res.wall_s:.1f} s",
                          f"{len(res.requests) / res.wall_s:,.0f}", f"{res.end_s / res.wall_s:,.0f}",
                          f"{s.p50_ttft_s * 1e3:.0f} ms", f"{s.cache_hit_rate * 100:.1f} %")
            print(f"  {name:<13} {strategy.value:<27} {len(res.requests):>7,} requests in {res.wall_s:5.1f} s",
                  flush=True)
    console.print(table)
    console.print(f"slowest run: {worst:.1f} s (goal: under 60 s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
