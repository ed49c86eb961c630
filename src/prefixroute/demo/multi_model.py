"""``prefixroute demo --multi-model``: one endpoint hosting two inference components.

The emulated fleet is split in two: the first half of the instances serves one model
(a Llama), the second half another (a Qwen), and the router's endpoint declares two
inference components whose copies it finds from the instances' ``/v1/models``
(``Instances: DISCOVER``). The same seeded shared-prefix workload runs for both models,
requests alternating between them; an OpenAI body names its model, which selects its
component, so every request goes only to that component's copies. Per strategy, the
demo reports the usual figures and, per component, its cache-hit rate (its copies'
engine counters) and how its requests were shared among its copies.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import yaml

from prefixroute.core.config import RoutingStrategy
from prefixroute.demo.loadgen import RequestResult, run_closed_loop
from prefixroute.demo.processes import ProcessGroup
from prefixroute.demo.report import RunSummary, scrape_counters, summarize
from prefixroute.workloads.shared_prefix import SharedPrefixWorkload, WorkloadRequest

__all__ = ["COMPONENTS", "run_strategy", "render_components"]

#: Component name -> the model its copies serve (``--model`` of the emulated engines).
COMPONENTS = {"llama-70b": "meta-llama/Llama-3.1-70B-Instruct", "qwen-72b": "Qwen/Qwen2.5-72B-Instruct"}


def _requests(workloads: Sequence[SharedPrefixWorkload], count: int, owner: dict[int, str]
              ) -> Iterator[WorkloadRequest]:
    """The workloads' requests alternating, re-indexed; ``owner`` records each index's component."""
    names = list(COMPONENTS)
    streams = [w.requests(count) for w in workloads]
    for i in itertools.count():
        k = i % len(streams)
        req = next(streams[k], None)
        if req is None:
            return
        owner[i] = names[k]
        yield WorkloadRequest(i, req.group, req.body, req.prompt_tokens)


async def run_strategy(args: argparse.Namespace, strategy: RoutingStrategy, procs: ProcessGroup, config_dir: Path,
                       on_done: Callable[[RequestResult], None]) -> tuple[Any, list[RequestResult], RunSummary]:
    """One strategy on a fresh two-component fleet: ``(workload, results, summary)``.
    ``summary.components`` holds, per component: ``requests``, ``cache_hit_rate`` (its
    copies' engine counters), ``instance_share`` (fraction of its requests per copy, in
    copy order) and ``served_elsewhere`` (its requests answered by another instance: 0)."""
    half = args.instances // 2
    models = [COMPONENTS["llama-70b"]] * half + [COMPONENTS["qwen-72b"]] * (args.instances - half)
    engines = []
    for i, model in enumerate(models):
        engines.append(await asyncio.to_thread(procs.start, f"engine-{i}", [
            "emulate", "--port", "0", "--instance-id", f"instance-{i}", "--model", model,
            "--time-scale", str(args.time_scale), "--kv-capacity-tokens", str(args.kv_capacity_tokens)]))
    urls = [e.url for e in engines]
    routing: dict[str, Any] = {"RoutingStrategy": strategy.value}
    if strategy is RoutingStrategy.PREFIX_AWARE:
        routing["PrefixAwareRoutingConfig"] = {"PrefixLength": args.prefix_length,
                                               "ConcurrencyThreshold": args.concurrency_threshold}
    elif strategy is RoutingStrategy.CACHE_AWARE:
        routing["CacheAwareRoutingConfig"] = {"ConcurrencyThreshold": args.concurrency_threshold,
                                              "InstanceCacheTokens": args.kv_capacity_tokens}
    config = {"Endpoints": [{"EndpointName": "default", "ProductionVariants": [
        {"VariantName": "AllTraffic", "Instances": urls, "RoutingConfig": routing}],
        "InferenceComponents": [{"InferenceComponentName": c, "ModelName": m, "Instances": "DISCOVER"}
                                for c, m in COMPONENTS.items()]}]}
    path = config_dir / f"fleet-{strategy.value.lower()}.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    router = await asyncio.to_thread(procs.start, "router", ["serve", "--config", str(path), "--port", "0",
                                                             "--admin-port", "0", "--seed", str(args.seed)])
    workloads = [SharedPrefixWorkload(groups=max(1, args.groups // 2), prefix_tokens=args.prefix_tokens,
                                      question_tokens=args.question_tokens, output_tokens=args.output_tokens,
                                      model=m, seed=args.seed + k) for k, m in enumerate(COMPONENTS.values())]
    owner: dict[int, str] = {}
    results, wall = await run_closed_loop(router.url + "/v1/chat/completions",
                                          _requests(workloads, args.requests or 10**9, owner), args.users,
                                          args.duration, on_done)
    names = ["vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total"]
    per_engine = [await scrape_counters([u], names) for u in urls]
    summary = summarize(strategy.value, results, wall, args.time_scale, urls,
                        sum(c[names[0]] for c in per_engine), sum(c[names[1]] for c in per_engine))
    figures: dict[str, dict[str, Any]] = {}
    for name, model in COMPONENTS.items():
        copies = [u for u, m in zip(urls, models) if m == model]
        mine = [r for r in results if owner.get(r.index) == name and not r.error]
        counts = {u: 0 for u in copies}
        elsewhere = 0
        for r in mine:
            if r.instance in counts:
                counts[r.instance] += 1
            else:
                elsewhere += 1
        queries = sum(c[names[1]] for u, c in zip(urls, per_engine) if u in counts)
        hits = sum(c[names[0]] for u, c in zip(urls, per_engine) if u in counts)
        figures[name] = {"requests": len(mine), "cache_hit_rate": hits / queries if queries else 0.0,
                         "instance_share": [counts[u] / (len(mine) or 1) for u in copies],
                         "served_elsewhere": elsewhere}
    summary.components = figures
    procs.stop_all()
    return workloads[0], results, summary


def render_components(summaries: Sequence[RunSummary]) -> Any:
    """A ``rich`` table: per strategy and component, its requests, cache-hit rate and
    the share of its requests per copy."""
    from rich.table import Table

    table = Table(title="Per inference component (each on its own copies)", title_justify="left")
    for col in ("strategy", "component", "requests", "cache hit", "share per copy %", "on another instance"):
        table.add_column(col, justify="left" if col in ("strategy", "component", "share per copy %") else "right",
                         no_wrap=True)
    for s in summaries:
        for name, f in s.components.items():
            table.add_row(s.strategy, name, str(f["requests"]), f"{f['cache_hit_rate'] * 100:.1f} %",
                          " ".join(f"{x * 100:.1f}" for x in f["instance_share"]), str(f["served_elsewhere"]))
    return table
