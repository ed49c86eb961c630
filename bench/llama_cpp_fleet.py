"""Benchmark: prefixroute in front of real llama.cpp instances, one run per strategy.

Starts a fresh fleet of llama.cpp instances (cold prefix caches) for every strategy, the
router in front of it, and sends the same seeded shared-prefix workload as raw-prompt
``/v1/completions`` through real HTTP; prints SPEC §1's reference-style table (P50/P90
TTFT, cache-hit rate read from the engines, throughput, per-instance share) and, with
``--json PATH``, SPEC §7's JSON. Docs and the recorded results: docs/BENCHMARKS.md and
docs/LLAMA_CPP.md.

Needs the ``llama-cpp`` extra in this Python, or ``PREFIXROUTE_LLAMA_PYTHON`` naming a
Python that has it::

    pip install -e '.[llama-cpp]'
    python bench/llama_cpp_fleet.py --json llama-cpp-fleet.json

Every time is real seconds on this machine; every token count is the tiny model's
byte-level tokens (one per character of the ASCII prompts).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time

from prefixroute.core.config import ConfigError, RoutingConfig, RoutingStrategy
from prefixroute.engines.llama_cpp import (
    EngineUnavailable, LlamaCppSettings, describe_workload, find_engine_python, run_strategy,
    shared_prefix_workload,
)
from prefixroute.engines.tiny_gguf import TinyModelSpec

DEFAULT_STRATEGIES = "random,least-outstanding-requests,prefix-aware,cache-aware"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="llama_cpp_fleet",
        description="Measure every routing strategy on a fleet of real llama.cpp instances (CPU, tiny "
                    "random-weight model, real prefix caches) and print the reference-style table.",
    )
    p.add_argument("--instances", type=int, default=3, help="llama.cpp instances (default: 3)")
    p.add_argument("--threads", type=int, default=1, help="CPU threads per instance (default: 1)")
    p.add_argument("--cache-tokens", type=int, default=40_000,
                   help="RAM prompt cache of each instance, tokens of saved KV state (~1 KB each); "
                        "0 disables it (default: 40000, about 9 of the default prefixes)")
    p.add_argument("--layers", type=int, default=2, help="layers of the generated model (default: 2)")
    p.add_argument("--width", type=int, default=128, help="width of the generated model (default: 128)")
    p.add_argument("--strategies", default=DEFAULT_STRATEGIES,
                   help=f"comma-separated, the first is the baseline (default: {DEFAULT_STRATEGIES})")
    p.add_argument("--prefix-length", type=int, default=2048,
                   help="PrefixLength for PREFIX_AWARE, characters; shorter than the prefixes (default: 2048)")
    p.add_argument("--concurrency-threshold", type=int, default=4,
                   help="ConcurrencyThreshold for PREFIX_AWARE and CACHE_AWARE (CACHE_AWARE's "
                        "InstanceCacheTokens follows --cache-tokens) (default: 4)")
    p.add_argument("--groups", type=int, default=16, help="prefix groups (documents) (default: 16)")
    p.add_argument("--prefix-tokens", type=int, default=4000, help="tokens per shared prefix (default: 4000)")
    p.add_argument("--question-tokens", type=int, default=64, help="tokens per question (default: 64)")
    p.add_argument("--output-tokens", type=int, default=16, help="max_tokens per request (default: 16)")
    p.add_argument("--requests", type=int, default=150,
                   help="requests per strategy, the same ones for every strategy (default: 150)")
    p.add_argument("--users", type=int, default=2, help="closed-loop concurrent users (default: 2)")
    p.add_argument("--max-duration", type=float, default=600.0,
                   help="no new request after this many seconds of a run (default: 600)")
    p.add_argument("--seed", type=int, default=0, help="workload and router seed (default: 0)")
    p.add_argument("--json", metavar="PATH", help="write SPEC §7's JSON to PATH")
    p.add_argument("--out-dir", default=None, help="also write the TTFT CDF and share plots there")
    return p.parse_args(argv)


async def _main(args: argparse.Namespace, strategies: list[RoutingStrategy]) -> int:
    from rich.console import Console

    from prefixroute.demo.report import render_narrow_table, render_table, write_json, write_plots

    console = Console() if sys.stdout.isatty() else Console(width=200)
    settings = LlamaCppSettings(threads=args.threads, cache_tokens=args.cache_tokens,
                                model=TinyModelSpec(layers=args.layers, width=args.width))
    workload = shared_prefix_workload(args.groups, args.prefix_tokens, args.question_tokens, args.output_tokens,
                                      args.seed)
    desc = describe_workload(args.groups, args.prefix_tokens, args.question_tokens, args.output_tokens, args.seed,
                             args.requests, settings) + f" instances={args.instances} users={args.users}"
    console.print(f"[bold]llama.cpp fleet benchmark[/bold]: {desc}")
    summaries, runs, extras = [], {}, []
    for strategy in strategies:
        t0 = time.perf_counter()
        run = await run_strategy(
            strategy, workload, requests=args.requests, users=args.users, duration_s=args.max_duration,
            instances=args.instances, settings=settings, prefix_length=args.prefix_length,
            concurrency_threshold=args.concurrency_threshold, seed=args.seed,
        )
        c = run.counters
        console.print(
            f"{strategy.value}: {run.summary.requests} requests in {time.perf_counter() - t0:.0f} s; engines "
            f"prefilled {c['llamacpp:prompt_tokens_evaluated_total']:.0f} of "
            f"{c['vllm:prefix_cache_queries_total']:.0f} prompt tokens in "
            f"{c['llamacpp:prompt_eval_seconds_total']:.1f} s, {c['llamacpp:ram_cache_restores_total']:.0f} "
            f"RAM-cache restores"
        )
        summaries.append(run.summary)
        runs[strategy.value] = run.results
        extras.append({"strategy": strategy.value, **{k: v for k, v in c.items()}})
    title = "Shared-prefix workload on llama.cpp (real seconds, CPU, 1 thread per instance)"
    console.print(render_table(summaries, title) if console.width >= 180 else render_narrow_table(summaries, title))
    errors = sum(s.errors for s in summaries)
    if errors:
        console.print(f"[red]{errors} request(s) failed[/red]")
    if args.out_dir:
        console.print("plots: " + ", ".join(str(p) for p in write_plots(args.out_dir, runs, summaries)))
    if args.json:
        write_json(args.json, desc, summaries, {"engine_counters": extras})
        console.print(f"results: {args.json}")
    return 0 if errors == 0 else 1


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        strategies = [RoutingStrategy.parse(s) for s in args.strategies.split(",") if s.strip()]
        if not strategies:
            raise ConfigError("--strategies: name at least one strategy")
        if RoutingStrategy.PREFIX_AWARE in strategies:
            RoutingConfig.build("prefix-aware", args.prefix_length, args.concurrency_threshold)
        if any(s.value == "CACHE_AWARE" for s in strategies):
            RoutingConfig.build("cache-aware", None, args.concurrency_threshold)
        for name in ("instances", "threads", "groups", "prefix_tokens", "question_tokens", "output_tokens",
                     "requests", "users"):
            if getattr(args, name) < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
        find_engine_python()
    except (ConfigError, EngineUnavailable, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        return asyncio.run(_main(args, strategies))
    except KeyboardInterrupt:
        print("interrupted; every process the benchmark started has been stopped", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
