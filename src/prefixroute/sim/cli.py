"""``prefixroute simulate``: predict routing on hours of traffic in seconds.

Two ways to use it:

* ``--scenario aws-long-context`` / ``--scenario aws-multi-turn``: the SPEC's reference
  setups (:mod:`prefixroute.sim.scenarios`), run for RANDOM, LEAST_OUTSTANDING_REQUESTS
  and PREFIX_AWARE, printed beside the published figures;
* a workload of your own (``--workload shared-prefix | multi-turn | trace``) with any
  fleet, strategies and settings, router replicas, and instances added or removed at
  given times.

Prints the reference-style table (model seconds), writes plots, and with ``--json PATH``
SPEC §7's JSON (``router`` is ``prefixroute-sim``). Exit status: 0, or 2 for bad
arguments.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, Sequence

from prefixroute.core.config import ConfigError, RoutingConfig, RoutingStrategy
from prefixroute.core.tiers import TierSpec
from prefixroute.workloads.catalog import BENCH_WORKLOADS, bench_workload

__all__ = ["configure_parser", "run", "build_workload", "run_strategies"]

DEFAULT_STRATEGIES = "random,least-outstanding-requests,prefix-aware"

#: bench/policy_vs_peers.py's fleet and run length (``--bench-workload``): 4 instances
#: of 100,000 KV tokens, 20 real seconds at time scale 0.5.
BENCH_INSTANCES = 4
BENCH_KV_TOKENS = 100_000
BENCH_DURATION_S = 40.0


def bench_routing(strategy: RoutingStrategy) -> RoutingConfig:
    """The routing bench/policy_vs_peers.py gives ``strategy``: PREFIX_AWARE PrefixLength
    4,096 with ConcurrencyThreshold 8, CACHE_AWARE ConcurrencyThreshold 64 with
    InstanceCacheTokens 100,000, the others their defaults."""
    if strategy is RoutingStrategy.PREFIX_AWARE:
        return RoutingConfig.build(strategy, 4096, 8)
    if strategy is RoutingStrategy.CACHE_AWARE:
        return RoutingConfig.build(strategy, None, 64, instance_cache_tokens=BENCH_KV_TOKENS)
    return RoutingConfig.build(strategy)


def configure_parser(p: argparse.ArgumentParser) -> None:
    """Add the ``simulate`` flags to ``p``."""
    from prefixroute.sim.scenarios import SCENARIOS

    p.description = (
        "Simulate a fleet of emulated vLLM instances (Llama-3.1-70B on 8xH100 each) behind the router, on a "
        "virtual clock, with the same routing core and engine model as `prefixroute serve` and "
        "`prefixroute emulate`. Prints P50/P90 TTFT, cache-hit rate, throughput and per-instance share."
    )
    p.add_argument("--scenario", choices=sorted(SCENARIOS),
                   help="run a reference setup for RANDOM, LEAST_OUTSTANDING_REQUESTS and PREFIX_AWARE and print "
                        "it beside the published figures (the other flags, except output ones and --seed, are "
                        "ignored)")
    g = p.add_argument_group("fleet")
    g.add_argument("--instances", type=int, default=7, help="engine instances at the start (default: 7)")
    g.add_argument("--replicas", type=int, default=1,
                   help="router replicas; each counts only its own requests in flight (default: 1)")
    g.add_argument("--replica-per", choices=("request", "session"), default="request",
                   help="how requests reach the replicas: each request to one at random (clients behind a plain "
                        "load balancer), or each session's turns to one (clients keeping their connection) "
                        "(default: request)")
    g.add_argument("--engine-load-interval", type=float, default=10.0, metavar="SECONDS",
                   help="model seconds between two reads of every engine's running and waiting requests by each "
                        "replica, as `prefixroute serve` scrapes /metrics (its default interval: 10); 0: never "
                        "(default: 10)")
    g.add_argument("--change", action="append", default=[], metavar="ACTION:SECONDS:INSTANCE",
                   help="add or remove an instance at a model time, e.g. add:600:instance-7 or "
                        "remove:1200:instance-0 (instances are named instance-0, instance-1, ...); repeatable")
    g.add_argument("--kv-capacity-tokens", type=int, default=None,
                   help="KV-cache capacity of each instance, tokens (default: the engine's 1,200,000)")
    g.add_argument("--cpu-tier-tokens", type=int, default=0,
                   help="a CPU (host-memory) KV tier per instance, tokens: GPU-evicted blocks go there and load "
                        "back at the engine's modelled transfer cost; 0: none (default: 0)")
    g.add_argument("--shared-tier-tokens", type=int, default=0,
                   help="a KV tier shared by every instance, tokens: each instance writes its blocks through "
                        "and any instance loads them, at a higher cost than the CPU tier; 0: none (default: 0)")
    g.add_argument("--tiers", choices=("none", "cpu", "shared", "cpu+shared"), default=None,
                   help="KV tiers in every engine, sized for the fleet when --cpu-tier-tokens/--shared-tier-tokens "
                        "are not given (a CPU tier of 4x each instance's KV capacity, a shared tier of 4x the "
                        "fleet's); CACHE_AWARE is told of them (KvTiers) unless --tier-aware off (default: none)")
    g.add_argument("--tier-aware", choices=("on", "off", "both"), default="on",
                   help="with tiers: whether CACHE_AWARE knows the engines' tiers (KvTiers); both: one run each, "
                        "'tier-unaware' in the table (default: on)")
    g.add_argument("--overhead-ms", type=float, default=0.0,
                   help="model milliseconds each request spends outside the engine (router, network, HTTP), "
                        "added to TTFT and latency (default: 0)")
    g = p.add_argument_group("routing")
    g.add_argument("--strategies", default=DEFAULT_STRATEGIES,
                   help=f"comma-separated strategies, the first is the baseline (default: {DEFAULT_STRATEGIES})")
    g.add_argument("--prefix-length", type=int, default=4096,
                   help="PrefixLength for PREFIX_AWARE, characters (default: 4096)")
    g.add_argument("--precise", nargs="?", const="on", choices=("off", "on", "both"), default="off",
                   help="precise mode: CACHE_AWARE routes on the engines' reported KV state (as `prefixroute serve` "
                        "does on their KV events) instead of its learned view; both: one run each, labelled "
                        "'precise' in the table (default: off)")
    g.add_argument("--concurrency-threshold", type=int, default=8,
                   help="ConcurrencyThreshold for PREFIX_AWARE and CACHE_AWARE (default: 8; CACHE_AWARE's other "
                        "settings are its defaults)")
    g = p.add_argument_group("load")
    g.add_argument("--duration", type=float, default=600.0,
                   help="model seconds during which requests start; requests in flight then finish (default: 600)")
    g.add_argument("--users", type=int, default=None,
                   help="closed loop: this many users, each sending its next request (or conversation turn) "
                        "when the previous one ends; default: open loop at --rate")
    g.add_argument("--rate", type=float, default=5.0,
                   help="open loop: requests per model second (shared-prefix) or new conversations per model "
                        "second (multi-turn), Poisson (default: 5)")
    g = p.add_argument_group("workload")
    g.add_argument("--workload", choices=("shared-prefix", "multi-turn", "trace"), default="shared-prefix",
                   help="what traffic to simulate (default: shared-prefix)")
    g.add_argument("--bench-workload", metavar="NAME", choices=[w.name for w in BENCH_WORKLOADS],
                   help="simulate one of bench/policy_vs_peers.py's workloads exactly as the benchmark runs it (its "
                        "4-instance fleet with 100,000-token caches, users or open-loop arrivals, membership change, "
                        f"40 model seconds, each replica reading engine load every model second, a session's "
                        f"turns on one replica; the fleet, load and workload flags are then ignored): "
                        f"{', '.join(w.name for w in BENCH_WORKLOADS)}")
    g.add_argument("--groups", type=int, default=200, help="shared-prefix: prefix groups (default: 200)")
    g.add_argument("--prefix-tokens", type=int, default=8000, help="shared-prefix: tokens per prefix (default: 8000)")
    g.add_argument("--question-tokens", type=int, default=64, help="shared-prefix: tokens per question (default: 64)")
    g.add_argument("--output-tokens", type=int, default=16, help="shared-prefix: max_tokens (default: 16)")
    g.add_argument("--prompts-per-group", type=int, default=None,
                   help="shared-prefix: requests per document before its group gets a new one (default: never)")
    g.add_argument("--popularity", choices=("uniform", "zipf"), default="uniform",
                   help="shared-prefix: group popularity (default: uniform)")
    g.add_argument("--zipf-s", type=float, default=1.0, help="shared-prefix: Zipf exponent (default: 1.0)")
    g.add_argument("--system-prompts", type=int, default=1,
                   help="multi-turn: distinct system prompts shared by the conversations (default: 1)")
    g.add_argument("--system-tokens", type=int, default=1000, help="multi-turn: system prompt tokens (default: 1000)")
    g.add_argument("--mean-turns", type=float, default=3.51, help="multi-turn: mean turns (default: ShareGPT's 3.51)")
    g.add_argument("--think-time", type=float, default=10.0,
                   help="multi-turn: mean model seconds between an answer and the next turn (default: 10)")
    g.add_argument("--trace", metavar="PATH", help="trace: a Mooncake or prefixroute JSONL trace")
    g.add_argument("--speedup", type=float, default=1.0, help="trace: replay this many times faster (default: 1)")
    g.add_argument("--seed", type=int, default=0, help="workload and router seed (default: 0)")
    g = p.add_argument_group("output")
    g.add_argument("--json", metavar="PATH", help="also write SPEC section 7 JSON to PATH")
    g.add_argument("--out-dir", default="prefixroute-sim", help="where plots go (default: ./prefixroute-sim)")
    g.add_argument("--no-plots", action="store_true", help="do not write plots")
    g.add_argument("--no-progress", action="store_true", help="no progress bars")


def build_workload(args: argparse.Namespace) -> Any:
    """The workload the flags describe.

    Raises:
        ValueError: invalid workload parameters; ``TraceError`` for an unreadable trace.
    """
    if args.workload == "trace":
        from prefixroute.workloads.traces import load_trace

        if not args.trace:
            raise ValueError("--workload trace needs --trace PATH")
        return load_trace(args.trace, speedup=args.speedup)
    if args.workload == "multi-turn":
        from prefixroute.workloads.multi_turn import MultiTurnWorkload

        return MultiTurnWorkload(conversation_rate=args.rate, system_prompts=args.system_prompts,
                                 system_tokens=args.system_tokens, mean_turns=args.mean_turns,
                                 think_time_s=args.think_time, seed=args.seed)
    from prefixroute.workloads.shared_prefix import SharedPrefixWorkload

    return SharedPrefixWorkload(groups=args.groups, prefix_tokens=args.prefix_tokens,
                                question_tokens=args.question_tokens, output_tokens=args.output_tokens,
                                popularity=args.popularity, zipf_s=args.zipf_s,
                                prompts_per_group=args.prompts_per_group, arrival_rate=args.rate, seed=args.seed)


def run_strategies(
    configs: Sequence[tuple[str, Any]],
    make_workload: Any,
    *,
    progress: bool = True,
    console: Any = None,
) -> list[Any]:
    """Run one simulation per ``(label, SimConfig)``, each on a fresh workload from
    ``make_workload()``, with a progress bar per run; returns the :class:`SimResult` s."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from prefixroute.sim.simulator import simulate

    results = []
    with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.fields[info]}"),
                  TimeElapsedColumn(), console=console, disable=not progress, transient=False) as bar:
        for label, cfg in configs:
            task = bar.add_task(f"{label:<27}", total=max(cfg.duration_s, 1e-9), info="")

            def report(t: float, task: Any = task, cfg: Any = cfg) -> None:
                bar.update(task, completed=min(t, cfg.duration_s), info=f"{t:,.0f} model s")

            res = simulate(cfg, make_workload(), report)
            bar.update(task, completed=cfg.duration_s,
                       info=f"{len(res.requests):,} requests in {res.wall_s:.1f} s "
                            f"({len(res.requests) / max(res.wall_s, 1e-9):,.0f}/s)")
            results.append(res)
    return results


def _console() -> Any:
    from rich.console import Console

    console = Console()
    return console if console.is_terminal else Console(width=200)


def _pct(v: float, b: float) -> float:
    return (v - b) / b * 100 if b else float("nan")


def published_table(scenario: Any, summaries: Sequence[Any]) -> Any:
    """A table of the published figures (PREFIX_AWARE against RANDOM) beside the simulated
    ones of PREFIX_AWARE and, when it ran, CACHE_AWARE (each against RANDOM)."""
    from rich.table import Table

    by = {s.strategy: s for s in summaries}
    r = by["RANDOM"]
    arms = [a for a in ("PREFIX_AWARE", "CACHE_AWARE") if a in by]
    pub = scenario.published
    t = Table(title=f"{scenario.title}: against RANDOM, published (PREFIX_AWARE) and simulated", title_justify="left")
    for col in ("metric", "published", *(f"simulated {a}" for a in arms)):
        t.add_column(col, no_wrap=True)

    def shares(a: str) -> str:
        xs = [x * 100 for x in by[a].instance_share]
        return f"{min(xs):.1f} … {max(xs):.1f} %" if xs else ""

    t.add_row("P50 TTFT change", f"{pub.p50_ttft_change_pct[0]:+.0f} … {pub.p50_ttft_change_pct[1]:+.0f} %",
              *(f"{_pct(by[a].p50_ttft_s, r.p50_ttft_s):+.0f} % ({r.p50_ttft_s * 1e3:.0f} → "
                f"{by[a].p50_ttft_s * 1e3:.0f} ms)" for a in arms))
    t.add_row("P90 TTFT change", f"{pub.p90_ttft_change_pct[0]:+.0f} … {pub.p90_ttft_change_pct[1]:+.0f} %",
              *(f"{_pct(by[a].p90_ttft_s, r.p90_ttft_s):+.0f} % ({r.p90_ttft_s * 1e3:.0f} → "
                f"{by[a].p90_ttft_s * 1e3:.0f} ms)" for a in arms))
    t.add_row("cache-hit rate", f"~{pub.hit_rate_random * 100:.0f} % → ~{pub.hit_rate_prefix_aware * 100:.0f} %",
              *(f"{r.cache_hit_rate * 100:.1f} % → {by[a].cache_hit_rate * 100:.1f} %" for a in arms))
    t.add_row("throughput change", f"{pub.throughput_change_pct[0]:+.1f} … {pub.throughput_change_pct[1]:+.1f} %",
              *(f"{_pct(by[a].throughput_rps, r.throughput_rps):+.1f} % ({r.throughput_rps:.2f} → "
                f"{by[a].throughput_rps:.2f} rps)" for a in arms))
    t.add_row("per-instance share", f"{pub.instance_share_pct[0]:.1f} … {pub.instance_share_pct[1]:.1f} %",
              *(shares(a) for a in arms))
    return t


def _run_scenario(args: argparse.Namespace) -> int:
    from prefixroute.demo.report import render_table, write_json, write_plots
    from prefixroute.sim.scenarios import REFERENCE_STRATEGIES, SCENARIOS
    from prefixroute.sim.simulator import SimConfig, instance_ids

    sc = SCENARIOS[args.scenario]
    console = _console()
    console.print(f"[bold]prefixroute simulate --scenario {sc.name}[/bold]: {sc.title}; {sc.users} users, "
                  f"{sc.duration_s:,.0f} model s per strategy, overhead {sc.overhead_s * 1e3:.0f} ms, "
                  f"PrefixLength {sc.prefix_length}, ConcurrencyThreshold {sc.concurrency_threshold}")
    configs = [(st.value, SimConfig(instance_ids(sc.instances), sc.routing(st), duration_s=sc.duration_s,
                                    users=sc.users, overhead_s=sc.overhead_s, seed=args.seed))
               for st in REFERENCE_STRATEGIES]
    results = run_strategies(configs, lambda: sc.make_workload(args.seed), progress=not args.no_progress,
                             console=console)
    summaries = [res.summary() for res in results]
    console.print(render_table(summaries, f"{sc.title}; simulated, times in model seconds"))
    console.print(published_table(sc, summaries))
    for note in sc.notes:
        console.print(f"  - {note}")
    if not args.no_plots:
        paths = write_plots(args.out_dir, {s.strategy: res.results() for s, res in zip(summaries, results)},
                            summaries)
        console.print("plots: " + ", ".join(str(p) for p in paths))
    if args.json:
        pub = sc.published
        write_json(args.json, f"{results[0].workload} users={sc.users} instances={sc.instances} "
                              f"duration_s={sc.duration_s:g} overhead_s={sc.overhead_s:g}", summaries,
                   {"scenario": sc.name, "published": {
                       "source": pub.source,
                       "p50_ttft_change_pct": list(pub.p50_ttft_change_pct),
                       "p90_ttft_change_pct": list(pub.p90_ttft_change_pct),
                       "cache_hit_rate": {"RANDOM": pub.hit_rate_random, "PREFIX_AWARE": pub.hit_rate_prefix_aware},
                       "throughput_change_pct": list(pub.throughput_change_pct),
                       "instance_share_pct": list(pub.instance_share_pct)},
                    "simulation_wall_s": [round(r.wall_s, 3) for r in results]})
        console.print(f"results: {args.json}")
    return 0


def tiers_label(cpu_tier_tokens: int, shared_tier_tokens: int) -> str:
    """How a table names the KV tiers of a run, e.g. ``"KV tiers: GPU + CPU 4.8M tokens"``."""
    parts = ["GPU"]
    if cpu_tier_tokens:
        parts.append(f"CPU {cpu_tier_tokens / 1e6:g}M tokens per instance")
    if shared_tier_tokens:
        parts.append(f"shared {shared_tier_tokens / 1e6:g}M tokens")
    return "KV tiers: " + " + ".join(parts)


def mode_label(args: argparse.Namespace) -> str:
    """How a table names CACHE_AWARE's mode: ``""`` (learned view), ``"; CACHE_AWARE
    precise"`` or ``"; CACHE_AWARE learned and precise"``."""
    precise = getattr(args, "precise", "off")
    return {"off": "", "on": "; CACHE_AWARE precise", "both": "; CACHE_AWARE learned and precise"}[precise]


def arms(strategies: Sequence[RoutingStrategy], routings: Sequence[RoutingConfig], args: argparse.Namespace,
         tiers: TierSpec, cpu_tier_tokens: int) -> list[tuple[str, RoutingConfig, bool]]:
    """The runs: ``(label, routing, precise)`` per strategy, CACHE_AWARE once per mode
    asked for (``--precise``, ``--tier-aware``). Labels: the strategy, then
    ``precise`` (precise mode) and ``tier-unaware`` (tiers CACHE_AWARE is not told of)."""
    out = []
    for s, r in zip(strategies, routings):
        if s is not RoutingStrategy.CACHE_AWARE:
            out.append((s.value, r, False))
            continue
        precise_modes = {"off": (False,), "on": (True,), "both": (False, True)}[args.precise]
        aware_modes = {"on": (True,), "off": (False,), "both": (True, False)}[args.tier_aware] if tiers else (False,)
        for aware in aware_modes:
            routing = r
            if aware:
                ca = r.cache_aware
                assert ca is not None
                kv = TierSpec(tiers.cpu, tiers.shared).kv_tiers(ca.instance_cache_tokens)
                if kv is not None:
                    kv = kv.model_copy(update={"cpu_tier_tokens": cpu_tier_tokens})
                routing = r.model_copy(update={"cache_aware": ca.model_copy(update={"kv_tiers": kv})})
            for precise in precise_modes:
                label = s.value + (" precise" if precise else "") + ("" if aware or not tiers else " tier-unaware")
                out.append((label, routing, precise))
    return out


def run(args: argparse.Namespace) -> int:
    """Run ``prefixroute simulate``; returns the exit status (2 for bad arguments)."""
    if args.scenario:
        return _run_scenario(args)
    from prefixroute.demo.report import render_table, write_json, write_plots
    from prefixroute.engine.model import EngineConfig
    from prefixroute.sim.simulator import MembershipChange, SimConfig, instance_ids, parse_changes
    from prefixroute.workloads.traces import TraceError

    try:
        strategies = [RoutingStrategy.parse(s) for s in args.strategies.split(",") if s.strip()]
        if not strategies:
            raise ConfigError("--strategies: no strategy given")
        routings = [RoutingConfig.build(s, args.prefix_length, args.concurrency_threshold)
                    if s in (RoutingStrategy.PREFIX_AWARE, RoutingStrategy.CACHE_AWARE) else RoutingConfig.build(s)
                    for s in strategies]
        changes = parse_changes(args.change)
        engine_kw = {} if args.kv_capacity_tokens is None else {"kv_capacity_tokens": args.kv_capacity_tokens}
        tiers = TierSpec.parse(args.tiers)
        kv_tokens = BENCH_KV_TOKENS if args.bench_workload else EngineConfig(**engine_kw).kv_capacity_tokens
        n_instances = BENCH_INSTANCES if args.bench_workload else args.instances
        if tiers.cpu and not args.cpu_tier_tokens:
            args.cpu_tier_tokens = tiers.cpu_tokens(kv_tokens)
        if tiers.shared and not args.shared_tier_tokens:
            args.shared_tier_tokens = tiers.shared_tokens(kv_tokens, n_instances)
        tiers = TierSpec(bool(args.cpu_tier_tokens), bool(args.shared_tier_tokens))
        engine = EngineConfig(cpu_tier_tokens=args.cpu_tier_tokens, **engine_kw)
        build_workload(args)  # validate once, before any run
        if args.engine_load_interval < 0:
            raise ValueError(f"--engine-load-interval must be >= 0 seconds, got {args.engine_load_interval}")
        common = dict(replicas=args.replicas, seed=args.seed, replica_per=args.replica_per,
                      engine_load_interval_s=args.engine_load_interval or None,
                      shared_tier_tokens=args.shared_tier_tokens)
        if args.bench_workload:
            bw = bench_workload(args.bench_workload)
            n = BENCH_INSTANCES + (1 if bw.membership else 0)
            ids = instance_ids(n)
            duration = BENCH_DURATION_S
            changes = () if bw.membership is None else (
                MembershipChange(duration * bw.membership.add_at, "add", ids[-1]),
                MembershipChange(duration * bw.membership.remove_at, "remove", ids[0]))
            engine = EngineConfig(kv_capacity_tokens=BENCH_KV_TOKENS, cpu_tier_tokens=args.cpu_tier_tokens)
            routings = [bench_routing(s) for s in strategies]
            common.update(engine_load_interval_s=1.0, replica_per="session")
            configs = [(label, SimConfig(ids[:BENCH_INSTANCES], r, engine=engine, duration_s=duration,
                                         users=bw.users, overhead_s=args.overhead_ms / 1000, changes=changes,
                                         precise=precise, **common))
                       for label, r, precise in arms(strategies, routings, args, tiers, args.cpu_tier_tokens)]
        else:
            configs = [(label, SimConfig(instance_ids(args.instances), r, engine=engine, duration_s=args.duration,
                                         users=args.users, overhead_s=args.overhead_ms / 1000, changes=changes,
                                         precise=precise, **common))
                       for label, r, precise in arms(strategies, routings, args, tiers, args.cpu_tier_tokens)]
    except (ConfigError, ValueError, TraceError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    console = _console()
    tiers = tiers_label(args.cpu_tier_tokens, args.shared_tier_tokens) + mode_label(args)
    if args.bench_workload:
        bw = bench_workload(args.bench_workload)
        load = f"{bw.users} users" if bw.users else "open loop"
        console.print(f"[bold]prefixroute simulate --bench-workload {bw.name}[/bold]: {bw.title}; "
                      f"{BENCH_INSTANCES} instances of {BENCH_KV_TOKENS:,} KV tokens, {args.replicas} router "
                      f"replica(s), {load}, {BENCH_DURATION_S:g} model s per strategy, {tiers}")
        make = (lambda: bw.make(args.seed))
    else:
        load = f"{args.users} users" if args.users else f"open loop at {args.rate:g}/s"
        console.print(f"[bold]prefixroute simulate[/bold]: {args.instances} instances, {args.replicas} router "
                      f"replica(s), {args.workload}, {load}, {args.duration:,.0f} model s per strategy, {tiers}")
        make = (lambda: build_workload(args))
    results = run_strategies(configs, make, progress=not args.no_progress, console=console)
    summaries = [res.summary(label) for (label, _), res in zip(configs, results)]
    console.print(render_table(summaries, f"{results[0].workload}; {tiers}; simulated, times in model seconds"))
    if not args.no_plots:
        paths = write_plots(args.out_dir, {s.strategy: res.results() for s, res in zip(summaries, results)},
                            summaries)
        console.print("plots: " + ", ".join(str(p) for p in paths))
    if args.json:
        instances = BENCH_INSTANCES if args.bench_workload else args.instances
        duration = BENCH_DURATION_S if args.bench_workload else args.duration
        write_json(args.json, f"{results[0].workload} instances={instances} replicas={args.replicas} "
                              f"{load} duration_s={duration:g} cpu_tier_tokens={args.cpu_tier_tokens} "
                              f"shared_tier_tokens={args.shared_tier_tokens}", summaries,
                   {"simulation_wall_s": [round(r.wall_s, 3) for r in results]})
        console.print(f"results: {args.json}")
    return 0
