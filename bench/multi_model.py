"""Benchmark: several models on one endpoint, on an emulated vLLM fleet.

Two parts, every engine and the router separate processes on loopback:

(a) **The AWS matrix**: {single-model endpoint, inference-component endpoint} x {native
    API, OpenAI API} x {streaming, not streaming} x {RANDOM, PREFIX_AWARE}, 16 runs of
    the same seeded shared-prefix chat workload. The single-model endpoint is 4
    instances of one model; the inference-component endpoint is 8 instances hosting two
    components (4 copies each, one model each), requests alternating between them by
    document. Each run starts from cold caches (the engines' ``/reset_prefix_cache``);
    the strategy is switched through the admin API (the components' own routing on the
    component endpoint). Checked: 0 errors in every run; each PREFIX_AWARE run's
    cache-hit rate at least 30 points above its paired RANDOM run's and its P50 TTFT at
    least 60 % lower; every request for a component served by a copy of it (the
    engines' own per-model request counters; a request for a model an engine does not
    serve would be a 404 it counts).

(b) **LoRA**: one base model and 8 adapters over 4 instances with 2 adapter slots each
    (vLLM's ``--max-loras 2``), traffic skewed over the adapters (Zipf), PREFIX_AWARE
    within each adapter's sticky set; once with ``LoraAdapters.Autoload`` (each instance
    starts with one adapter, four are loaded nowhere: the router loads an adapter where
    its set is saturated or empty, unloading spare copies or idle adapters) and once
    without (all 8 loaded from the start, two per instance; a saturated set is a 429).
    Reported per adapter: its sticky-set size over time (the router's gauge), loads and
    unloads, 429s, cache-hit rate (the engines' per-adapter counters),
    ``sticky_set_violations``: requests an engine got for an adapter it did not have
    loaded at that moment, counted by the engines themselves (must be 0), and, apart,
    the longest first byte a client saw and the longest *router-side wait*: the router's
    own time on a request, its ``X-Prefixroute-Overhead-Ms`` (routing plus any wait for
    an adapter load; for a 429 the router gave itself, the time to its headers). With
    autoload, no request may wait more than one load: the longest router-side wait must
    be at most ``--lora-load-s`` + 20 % (at least 50 ms of wall time; ``check_lora``).

Times are model seconds (the engines run at ``--time-scale``); TTFT percentiles come from
the engines' own ``vllm:time_to_first_token_seconds`` histograms (linear within their
buckets), the same for streaming and non-streaming runs; cache-hit rate is the engines'
``prefix_cache_hits / prefix_cache_queries`` over the run. ``--json PATH`` writes SPEC §7's
shape, each run with ``endpoint_kind``, ``api`` and ``stream``. Recorded results and the
command: docs/BENCHMARKS.md.

    python bench/multi_model.py --json multi-model.json          # the full run, about 7 minutes on 2 cores
    python bench/multi_model.py --quick                          # a short check of every part
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from prefixroute.demo.processes import ProcessGroup

sys.path.insert(0, str(Path(__file__).resolve().parent))

from mm_lora import check_lora, lora_run  # noqa: E402  (bench/ is a folder of scripts, not a package)
from mm_matrix import check_matrix, matrix  # noqa: E402
from mm_output import plot, render  # noqa: E402
from mm_settings import FULL, QUICK  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="multi_model", description=(
        "Several models on one endpoint on an emulated vLLM fleet: the 16-configuration AWS matrix "
        "(endpoint kind x API x streaming x strategy) and LoRA sticky sets with and without autoload."))
    p.add_argument("--quick", action="store_true", help="short runs and a smaller workload: a check of every part "
                                                        "in about 2.5 minutes (the results are noisier)")
    p.add_argument("--skip-matrix", action="store_true", help="run only the LoRA part")
    p.add_argument("--skip-lora", action="store_true", help="run only the matrix")
    p.add_argument("--time-scale", type=float, default=1.0,
                   help="the engines' speed: wall seconds per modelled second (default: 1.0)")
    p.add_argument("--prefix-length", type=int, default=4096,
                   help="PrefixLength of PREFIX_AWARE, characters (default: 4096; the documents are 6,000)")
    p.add_argument("--concurrency-threshold", type=int, default=8,
                   help="ConcurrencyThreshold of PREFIX_AWARE in the matrix (default: 8)")
    p.add_argument("--lora-threshold", type=int, default=3,
                   help="ConcurrencyThreshold in the LoRA runs: when every instance of an adapter's sticky set is "
                        "at it, the set is saturated (default: 3)")
    p.add_argument("--lora-load-s", type=float, default=1.0,
                   help="modelled seconds one adapter load takes on an engine (default: 1.0)")
    p.add_argument("--zipf", type=float, default=1.1,
                   help="skew of the traffic over the 8 adapters: adapter k gets weight 1/(k+1)^s (default: 1.1)")
    p.add_argument("--seed", type=int, default=0, help="workload seed (default: 0)")
    p.add_argument("--json", metavar="PATH", help="write SPEC §7's JSON (every run, with extra fields) to PATH")
    p.add_argument("--out-dir", default="prefixroute-bench/multi-model", help="where the sticky-set plots go "
                   "(default: %(default)s)")
    p.add_argument("--no-plots", action="store_true", help="write no plots")
    args = p.parse_args(argv)
    if not 0 < args.time_scale <= 10:
        p.error(f"--time-scale must be in (0, 10], got {args.time_scale}")
    if args.skip_matrix and args.skip_lora:
        p.error("--skip-matrix and --skip-lora together leave nothing to run")
    for name in ("concurrency_threshold", "lora_threshold"):
        if not 1 <= getattr(args, name) <= 1024:
            p.error(f"--{name.replace('_', '-')} must be 1-1024")
    if not 1024 <= args.prefix_length <= 65536:
        p.error("--prefix-length must be 1024-65536")
    if args.lora_load_s < 0 or args.zipf < 0:
        p.error("--lora-load-s and --zipf must be >= 0")
    return args


async def _main(args: argparse.Namespace) -> int:
    from rich.console import Console

    console = Console() if sys.stdout.isatty() else Console(width=200)
    sizes = QUICK if args.quick else FULL
    workload = (f"shared-prefix chat: {sizes.groups} documents per model of {sizes.prefix_tokens} tokens, "
                f"{sizes.question_tokens}-token questions, {sizes.output_tokens} output tokens, {sizes.users} users, "
                f"{sizes.run_s:g} s per matrix run; LoRA: 8 adapters x {sizes.lora_groups} documents of "
                f"{sizes.lora_prefix_tokens} tokens, zipf "
                f"s={args.zipf}, {sizes.lora_users} users, {sizes.lora_s:g} s per run, load {args.lora_load_s:g} s; "
                f"KV {sizes.kv_tokens} tokens per engine, time scale {args.time_scale:g}, seed {args.seed}")
    console.print(f"[bold]multi-model benchmark[/bold]: {workload}")
    matrix_runs: list[dict[str, Any]] = []
    lora_runs: list[dict[str, Any]] = []
    t0 = time.perf_counter()
    with ProcessGroup() as procs, tempfile.TemporaryDirectory(prefix="prefixroute-bench-") as tmp:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60),
                                         connector=aiohttp.TCPConnector(limit=0)) as http:
            if not args.skip_matrix:
                matrix_runs = await matrix(procs, http, args, sizes, Path(tmp), console)
            if not args.skip_lora:
                for autoload in (True, False):
                    lora_runs.append(await lora_run(procs, http, args, sizes, Path(tmp), autoload, console))
    for table in render(matrix_runs, lora_runs):
        console.print(table)
    failures = (check_matrix(matrix_runs) if matrix_runs else []) + check_lora(lora_runs)
    console.print(f"took {time.perf_counter() - t0:.0f} s")
    for f in failures:
        console.print(f"[red]FAILED[/red] {f}")
    if not failures:
        console.print("[green]every check holds[/green]: " + "; ".join(filter(None, [
            "16 matrix runs without error, PREFIX_AWARE >= 30 points of hit rate and >= 60 % lower P50 TTFT than "
            "RANDOM, every component request on a copy of it" if matrix_runs else "",
            "0 sticky-set violations; with autoload sets grown by loads, no saturated set refused and no request "
            "held by the router longer than one load (+20 %), without it 429" if lora_runs else ""])))
    if not args.no_plots and lora_runs:
        console.print("plots: " + ", ".join(str(p) for p in plot(Path(args.out_dir), lora_runs)))
    if args.json:
        doc = {"workload": workload, "runs": matrix_runs + lora_runs,
               "checks": {"failures": failures, "passed": not failures}}
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_bytes(orjson.dumps(doc, option=orjson.OPT_INDENT_2 | orjson.OPT_SERIALIZE_NUMPY))
        console.print(f"results: {args.json}")
    return 1 if failures else 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        return asyncio.run(_main(args))
    except KeyboardInterrupt:
        print("interrupted; every process the benchmark started has been stopped", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
