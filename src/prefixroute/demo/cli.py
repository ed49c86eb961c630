"""``prefixroute demo``: an emulated vLLM fleet, the router, and one run per strategy.

For each strategy it starts a fresh fleet of emulated engines (cold caches) and the
router in front of them, all as separate processes on loopback ports they pick,
drives the same seeded shared-prefix workload through real HTTP, reads the engines'
prefix-cache counters from their ``/metrics``, stops everything, and finally prints
the reference-style table, writes plots and (with ``--json``) SPEC §7's JSON.

``--engine llama-cpp`` runs real llama.cpp instances instead of emulated engines
(:mod:`prefixroute.engines.llama_cpp`; docs/LLAMA_CPP.md), with defaults sized for them.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import signal
import sys
from pathlib import Path

from prefixroute.core.config import ConfigError, RoutingConfig, RoutingStrategy

__all__ = ["configure_parser", "run"]

DEFAULT_STRATEGIES = "random,least-outstanding-requests,prefix-aware"
#: Defaults of the flags that depend on --engine (llama-cpp's: engines.llama_cpp.DEMO_DEFAULTS).
EMULATED_DEFAULTS = {"instances": 5, "kv_capacity_tokens": 400_000, "groups": 200, "prefix_tokens": 8000,
                     "users": 30, "duration": 40.0, "prefix_length": 4096}


def configure_parser(p: argparse.ArgumentParser) -> None:
    """Add the ``demo`` flags to ``p``."""
    p.description = (
        "Start an emulated vLLM fleet (Llama-3.1-70B on 8xH100 per instance, run faster than real "
        "time) and the router, drive a shared-prefix workload once per routing strategy, and print "
        "P50/P90 TTFT, cache-hit rate, throughput, per-instance share and router overhead."
    )
    g = p.add_argument_group("fleet")
    g.add_argument("--engine", choices=("emulated", "llama-cpp"), default="emulated",
                   help="emulated: emulated vLLM engines; llama-cpp: real llama.cpp instances on a tiny "
                        "generated model, one CPU thread each, times in real seconds (needs the llama-cpp "
                        "extra; docs/LLAMA_CPP.md) (default: emulated)")
    g.add_argument("--instances", type=int, default=None,
                   help="engine instances (default: 5; 3 with --engine llama-cpp; 6 with --multi-model)")
    g.add_argument("--multi-model", action="store_true",
                   help="one endpoint with two inference components (two models, half of the instances each, "
                        "copies found from their /v1/models); the same workload for both models, and a table of "
                        "each component's cache-hit rate and share per copy (emulated engines only)")
    g.add_argument("--time-scale", type=float, default=0.25,
                   help="engine speed: 0.25 runs the model four times faster than real time; reported "
                        "times are converted back to model seconds (default: 0.25)")
    g.add_argument("--kv-capacity-tokens", type=int, default=None,
                   help="KV-cache capacity of each instance, tokens (llama-cpp: its RAM prompt cache). "
                        "The default keeps the workload's prefixes larger than one instance's cache but "
                        "smaller than the fleet's (default: 400000; 40000 with --engine llama-cpp)")
    g = p.add_argument_group("routing")
    g.add_argument("--strategies", default=DEFAULT_STRATEGIES,
                   help=f"comma-separated strategies to run, first is the baseline (default: {DEFAULT_STRATEGIES})")
    g.add_argument("--prefix-length", type=int, default=None,
                   help="PrefixLength for PREFIX_AWARE, 1024-65536 characters of the chat text; keep it "
                        "shorter than the shared prefix (default: 4096; 2048 with --engine llama-cpp)")
    g.add_argument("--concurrency-threshold", type=int, default=12,
                   help="ConcurrencyThreshold for PREFIX_AWARE and CACHE_AWARE, 1-1024 requests in flight on the preferred "
                        "instance before overflow (default: 12)")
    g.add_argument("--precise", nargs="?", const="on", choices=("off", "on", "both"), default="off",
                   help="precise mode: the engines tokenize with the bundled tiny tokenizer and publish their KV "
                        "events, and CACHE_AWARE routes on them (serve --tokenizer tiny --kv-events-from-info); "
                        "both: CACHE_AWARE once on its learned view and once precise; CACHE_AWARE is added to "
                        "--strategies when missing (emulated engines only; --precise alone means on; default: off)")
    g.add_argument("--tiers", choices=("none", "cpu", "shared", "cpu+shared"), default="none",
                   help="KV tiers in every emulated engine: a CPU tier of 4x its KV capacity, a tier shared by the "
                        "fleet of 4x the fleet's (a file in /dev/shm); CACHE_AWARE is told of them (--cpu-tier-tokens, "
                        "--shared-tier) (default: none)")
    g = p.add_argument_group("workload")
    g.add_argument("--groups", type=int, default=None,
                   help="prefix groups (documents) (default: 200; 16 with --engine llama-cpp)")
    g.add_argument("--prefix-tokens", type=int, default=None,
                   help="tokens per shared prefix; llama-cpp: byte-level tokens, 1 per character "
                        "(default: 8000; 4000 with --engine llama-cpp)")
    g.add_argument("--question-tokens", type=int, default=64, help="tokens per unique question (default: 64)")
    g.add_argument("--output-tokens", type=int, default=16, help="max_tokens of each request (default: 16)")
    g.add_argument("--users", type=int, default=None,
                   help="concurrent users of the closed-loop client; each sends its next request when "
                        "the previous one ends (default: 30; 2 with --engine llama-cpp)")
    g.add_argument("--duration", type=float, default=None,
                   help="real seconds of traffic per strategy (default: 40; 60 with --engine llama-cpp)")
    g.add_argument("--requests", type=int, default=None,
                   help="send at most this many requests per strategy, the same ones each time "
                        "(default: no limit; --duration ends the run)")
    g.add_argument("--seed", type=int, default=0, help="workload and router seed (default: 0)")
    g = p.add_argument_group("output")
    g.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH ({\"workload\": ..., \"runs\": [...]}, see README)")
    g.add_argument("--out-dir", default="prefixroute-demo", help="where plots go (default: ./prefixroute-demo)")
    g.add_argument("--no-plots", action="store_true", help="do not write plots")


def _strategies(text: str) -> list[RoutingStrategy]:
    return [RoutingStrategy.parse(s) for s in text.split(",") if s.strip()]


def _arms(args: argparse.Namespace, strategies: list[RoutingStrategy]) -> list[tuple[RoutingStrategy, bool]]:
    """The runs: ``(strategy, precise)``, CACHE_AWARE once per mode ``--precise`` asks for."""
    out = []
    for st in strategies:
        modes = {"off": (False,), "on": (True,), "both": (False, True)}[args.precise] \
            if st is RoutingStrategy.CACHE_AWARE else (False,)
        out += [(st, m) for m in modes]
    return out


def _engine_args(args: argparse.Namespace, i: int, shared_tier: str | None) -> list[str]:
    """``prefixroute emulate`` flags for instance ``i``: precise mode's tokenizer and KV
    events (free ports), and the tiers."""
    from prefixroute.core.tiers import TierSpec

    out = []
    if args.precise != "off":
        out += ["--tokenizer", "tiny", "--kv-events-config",
                '{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://127.0.0.1:*", '
                '"replay_endpoint": "tcp://127.0.0.1:*"}']
    tiers = TierSpec.parse(args.tiers)
    if tiers.cpu:
        out += ["--cpu-tier-tokens", str(tiers.cpu_tokens(args.kv_capacity_tokens))]
    if tiers.shared and shared_tier is not None:
        out += ["--shared-tier", shared_tier,
                "--shared-tier-tokens", str(tiers.shared_tokens(args.kv_capacity_tokens, args.instances))]
    return out


async def _run_one(args: argparse.Namespace, strategy: RoutingStrategy, group_procs, progress, task,
                   precise: bool = False):
    if args.multi_model:
        import tempfile

        from prefixroute.demo.multi_model import run_strategy

        count = itertools.count(1)
        with tempfile.TemporaryDirectory(prefix="prefixroute-demo-") as tmp:
            return await run_strategy(args, strategy, group_procs, Path(tmp),
                                      lambda _r: progress.update(task, completed=next(count)))

    from prefixroute.core.tiers import TierSpec

    if args.engine == "llama-cpp":
        from prefixroute.engines.llama_cpp import run_demo_strategy

        count = itertools.count(1)
        return await run_demo_strategy(args, strategy, group_procs,
                                       lambda _r: progress.update(task, completed=next(count)))
    from prefixroute.demo.loadgen import run_closed_loop
    from prefixroute.demo.report import scrape_counters, summarize
    from prefixroute.workloads.shared_prefix import SharedPrefixWorkload

    tiers = TierSpec.parse(args.tiers)
    shared_dir = None
    if tiers.shared:  # a fresh shared tier per run (a file every engine maps)
        import tempfile

        shm = Path("/dev/shm")
        shared_dir = tempfile.mkdtemp(prefix="prefixroute-demo-", dir=shm if shm.is_dir() else None)
        group_procs.cleanup_paths.append(shared_dir)
    shared_tier = str(Path(shared_dir) / "shared-tier") if shared_dir else None
    engines = []
    for i in range(args.instances):
        engines.append(await asyncio.to_thread(group_procs.start, f"engine-{i}", [
            "emulate", "--port", "0", "--instance-id", f"instance-{i}",
            "--time-scale", str(args.time_scale), "--kv-capacity-tokens", str(args.kv_capacity_tokens),
            *_engine_args(args, i, shared_tier),
        ]))
    urls = [e.url for e in engines]
    serve = ["serve", "--port", "0", "--admin-port", "0", "--strategy", strategy.cli_name, "--seed", str(args.seed)]
    if strategy is RoutingStrategy.CACHE_AWARE:
        serve += ["--concurrency-threshold", str(args.concurrency_threshold),
                  "--instance-cache-tokens", str(args.kv_capacity_tokens)]
        if tiers.cpu:
            serve += ["--cpu-tier-tokens", str(tiers.cpu_tokens(args.kv_capacity_tokens))]
        if tiers.shared:
            serve += ["--shared-tier"]
        if precise:
            serve += ["--tokenizer", "tiny", "--kv-events-from-info"]
    if strategy is RoutingStrategy.PREFIX_AWARE:
        serve += ["--prefix-length", str(args.prefix_length), "--concurrency-threshold", str(args.concurrency_threshold)]
    for u in urls:
        serve += ["--backend", u]
    router = await asyncio.to_thread(group_procs.start, "router", serve)

    workload = SharedPrefixWorkload(
        groups=args.groups, prefix_tokens=args.prefix_tokens, question_tokens=args.question_tokens,
        output_tokens=args.output_tokens, seed=args.seed,
    )
    done = itertools.count(1)

    def on_done(_r):
        progress.update(task, completed=next(done))

    results, wall = await run_closed_loop(
        router.url + "/v1/chat/completions", workload.requests(args.requests or 10**9), args.users, args.duration,
        on_done,
    )
    counters = await scrape_counters(urls, ["vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total"])
    summary = summarize(
        strategy.value + (" precise" if precise else ""), results, wall, args.time_scale, urls,
        counters["vllm:prefix_cache_hits_total"], counters["vllm:prefix_cache_queries_total"],
    )
    group_procs.stop_all()
    return workload, results, summary


async def _main(args: argparse.Namespace, strategies: list[RoutingStrategy]) -> int:
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from prefixroute.demo.processes import ProcessGroup
    from prefixroute.demo.report import render_narrow_table, render_table, write_json, write_plots

    console = Console()
    if not console.is_terminal:
        console = Console(width=200)  # a log file or pipe: never wrap the table
    fleet = (f"{args.instances} llama.cpp instances (tiny random model, 1 CPU thread each)"
             if args.engine == "llama-cpp" else
             f"{args.instances} emulated Llama-3.1-70B/8xH100 instances (time scale {args.time_scale})")
    if args.multi_model:
        fleet += ", two inference components of half of them each"
    console.print(
        f"[bold]prefixroute demo[/bold]: {fleet}, {args.groups} groups x {args.prefix_tokens}-token prefixes, "
        f"{args.users} users, {args.duration:.0f} s of traffic per strategy (plus starting the fleet and "
        "letting the last requests finish)"
    )
    summaries = []
    runs = {}
    workload_desc = ""
    with ProcessGroup() as procs, Progress(
        TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed} requests"),
        TimeElapsedColumn(), console=console, transient=False,
    ) as progress:
        for strategy, precise in _arms(args, strategies):
            label = strategy.value + (" precise" if precise else "")
            task = progress.add_task(f"{label:<27}", total=None)
            workload, results, summary = await _run_one(args, strategy, procs, progress, task, precise)
            progress.update(task, total=len(results), completed=len(results))
            workload_desc = workload.describe()
            summaries.append(summary)
            runs[label] = results

    title = ("Shared-prefix workload on llama.cpp; real seconds" if args.engine == "llama-cpp" else
             "Shared-prefix workload; times in model seconds, overhead in real milliseconds")
    if args.multi_model:
        title = title.replace("Shared-prefix workload", "Two inference components, one shared-prefix workload each")
    if args.engine != "llama-cpp":
        title += f"; KV tiers: {args.tiers}" + {"off": "", "on": "; CACHE_AWARE precise (KV events, tiny "
                                                       "tokenizer)", "both": "; CACHE_AWARE learned and precise "
                                                       "(KV events, tiny tokenizer)"}[args.precise]
    wide = render_table(summaries, title)
    console.print(wide if console.width >= 180 else render_narrow_table(summaries, title))
    if args.multi_model:
        from prefixroute.demo.multi_model import render_components

        console.print(render_components(summaries))
    errors = sum(s.errors for s in summaries)
    if errors:
        console.print(f"[red]{errors} request(s) failed[/red]")
    if not args.no_plots:
        paths = write_plots(args.out_dir, runs, summaries)
        console.print("plots: " + ", ".join(str(p) for p in paths))
    if args.json:
        write_json(args.json, workload_desc + f" instances={args.instances} users={args.users}", summaries)
        console.print(f"results: {args.json}")
    return 0 if errors == 0 else 1


def _check(args: argparse.Namespace) -> list[RoutingStrategy]:
    """Validate every flag before anything starts; raises ConfigError with the flag's name."""
    if args.engine == "llama-cpp":
        from prefixroute.engines.llama_cpp import DEMO_DEFAULTS as defaults
    else:
        defaults = EMULATED_DEFAULTS
    if getattr(args, "multi_model", False):
        if args.engine != "emulated":
            raise ConfigError("--multi-model runs on emulated engines only (--engine emulated)")
        defaults = {**defaults, "instances": 6}
    else:
        args.multi_model = False
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.multi_model and args.instances < 2:
        raise ConfigError(f"--multi-model needs at least 2 instances (one copy per component), got {args.instances}")
    if args.multi_model and (args.precise != "off" or args.tiers != "none"):
        raise ConfigError("--multi-model runs without --precise and --tiers")
    if args.engine == "llama-cpp" and (args.precise != "off" or args.tiers != "none"):
        raise ConfigError("--precise and --tiers need the emulated engines (--engine emulated)")
    if args.requests is not None and args.requests < 1:
        raise ConfigError(f"--requests must be at least 1, got {args.requests}")
    strategies = _strategies(args.strategies)
    if not strategies:
        raise ConfigError("--strategies: name at least one strategy")
    if args.precise != "off" and RoutingStrategy.CACHE_AWARE not in strategies:
        # precise mode is CACHE_AWARE's: without it in the list, nothing would run precise
        strategies.append(RoutingStrategy.CACHE_AWARE)
    if RoutingStrategy.PREFIX_AWARE in strategies:
        RoutingConfig.build("prefix-aware", args.prefix_length, args.concurrency_threshold)
    for name in ("instances", "users", "groups", "prefix_tokens", "question_tokens", "output_tokens"):
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if args.kv_capacity_tokens < 16:
        raise ConfigError(f"--kv-capacity-tokens must be at least one 16-token block, got {args.kv_capacity_tokens}")
    if not args.duration > 0 or args.duration == float("inf"):
        raise ConfigError(f"--duration must be a positive number of seconds, got {args.duration}")
    if not 0 < args.time_scale <= 10:
        raise ConfigError(f"--time-scale must be in (0, 10], got {args.time_scale}")
    if args.json:
        path = Path(args.json)
        if path.is_dir():
            raise ConfigError(f"--json {args.json}: is a directory; give a file path")
        if path.parent.exists() and not path.parent.is_dir():
            raise ConfigError(f"--json {args.json}: {path.parent} is not a directory")
    if not args.no_plots and Path(args.out_dir).exists() and not Path(args.out_dir).is_dir():
        raise ConfigError(f"--out-dir {args.out_dir}: exists and is not a directory")
    return strategies


def _stop_on_signal(signum: int, _frame: object) -> None:
    # SIGTERM/SIGHUP (terminal closed, `timeout`, a CI job killed) unwind like Ctrl-C, so
    # every child process is stopped by the ProcessGroup on the way out.
    raise KeyboardInterrupt(f"signal {signum}")


def run(args: argparse.Namespace) -> int:
    """Run the demo; returns the process exit code (1 if any request failed, 2 for bad
    flags, 130 when interrupted)."""
    try:
        strategies = _check(args)
        if args.engine == "llama-cpp":
            from prefixroute.engines.llama_cpp import find_engine_python

            find_engine_python()
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except RuntimeError as exc:  # EngineUnavailable
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _stop_on_signal)
    try:
        return asyncio.run(_main(args, strategies))
    except KeyboardInterrupt:
        print("interrupted; every process the demo started has been stopped", file=sys.stderr)
        return 130
