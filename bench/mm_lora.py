"""Part (b) of ``bench/multi_model.py``, LoRA: one run with or without autoload
(:func:`lora_run`: sticky sets over time, loads, 429s, per-adapter figures), the
router-side wait one load allows (:func:`router_wait_limit`) and its checks
(:func:`check_lora`).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time
from pathlib import Path
from typing import Any

import aiohttp

from mm_clients import Result, send
from mm_fleet import routing, start_engines, start_router
from mm_metrics import by_label, histogram_quantile, scrape, total, ttft_buckets
from mm_settings import ENDPOINT, LLAMA, Sizes
from prefixroute.demo.processes import ProcessGroup
from prefixroute.demo.report import percentile
from prefixroute.workloads.shared_prefix import SharedPrefixWorkload


ADAPTERS = [f"lora-{k}" for k in range(8)]


async def lora_run(procs: ProcessGroup, http: aiohttp.ClientSession, args: argparse.Namespace, sizes: Sizes,
                   tmp: Path, autoload: bool, console: Any) -> dict[str, Any]:
    # With autoload, each instance starts with one adapter (lora-0..3; lora-4..7 loaded
    # nowhere, one free slot each): the router places and moves them. Without it, all 8
    # are loaded from the start, two per instance (an adapter loaded nowhere would be an
    # unknown model).
    initial = [[ADAPTERS[i]] if autoload else [ADAPTERS[2 * i], ADAPTERS[2 * i + 1]] for i in range(4)]
    extra = [["--enable-lora", "--max-loras", "2", "--allow-runtime-lora-updating",
              "--lora-load-s", str(args.lora_load_s), "--lora-modules", *(f"{a}=/adapters/{a}" for a in names)]
             for names in initial]
    engines = await start_engines(procs, [LLAMA] * 4, args, sizes, extra)
    urls = [e.url for e in engines]
    config = {"Endpoints": [{"EndpointName": ENDPOINT, "ProductionVariants": [{
        "VariantName": "AllTraffic", "Instances": urls,
        "RoutingConfig": routing("PREFIX_AWARE", args.lora_threshold, args.prefix_length)}],
        "LoraAdapters": {"Autoload": autoload, "RetryAfterSeconds": 1,
                         "Adapters": [{"LoraName": a, "LoraPath": f"/adapters/{a}", "BaseModelName": LLAMA}
                                      for a in ADAPTERS]}}]}
    router = await start_router(procs, config, tmp, f"lora-{autoload}",
                                ["--metrics-scrape-interval", "1", "--health-check-interval", "1"])
    weights = [1 / (k + 1) ** args.zipf for k in range(len(ADAPTERS))]
    rng = random.Random(args.seed)
    workloads = {a: SharedPrefixWorkload(groups=sizes.lora_groups, prefix_tokens=sizes.lora_prefix_tokens,
                                         question_tokens=sizes.question_tokens, output_tokens=sizes.output_tokens,
                                         model=a, seed=args.seed + k).requests(10**9)
                 for k, a in enumerate(ADAPTERS)}
    timeline: list[dict[str, Any]] = []
    before = [await scrape(http, u) for u in urls]
    results: dict[str, list[Result]] = {a: [] for a in ADAPTERS}
    t0 = time.perf_counter()
    deadline = t0 + sizes.lora_s

    async def user() -> None:
        while time.perf_counter() < deadline:
            adapter = rng.choices(ADAPTERS, weights)[0]
            body = next(workloads[adapter]).body
            res = await send(http, router.url, body, "openai", True, None)
            results[adapter].append(res)
            if res.status == 429:  # as a client should: wait what Retry-After says
                await asyncio.sleep(min(res.retry_after_s, max(0.0, deadline - time.perf_counter())))

    async def watch() -> None:
        while time.perf_counter() < deadline:
            samples = await scrape(http, router.url)
            sizes_now = by_label(samples, "prefixroute_adapter_sticky_set_size", "adapter")
            timeline.append({"t_s": round(time.perf_counter() - t0, 2),
                             "sizes": {a: int(sizes_now.get(a, 0)) for a in ADAPTERS}})
            await asyncio.sleep(0.5)

    await asyncio.gather(watch(), *(user() for _ in range(sizes.lora_users)))
    wall = time.perf_counter() - t0
    await asyncio.sleep(0.2)
    after = [await scrape(http, u) for u in urls]
    rmetrics = await scrape(http, router.url)
    all_results = [r for rs in results.values() for r in rs]
    throttled = sum(1 for r in all_results if r.status == 429)
    # why: the set was saturated (every instance at the threshold), or empty (no slot to load it into)
    saturated = sum(1 for r in all_results if r.status == 429 and "ConcurrencyThreshold" in r.error)
    failed = [r for r in all_results if r.error and r.status != 429]
    per_adapter: dict[str, Any] = {}
    violations = 0
    for a in ADAPTERS:
        q = sum(total(x, "prefixroute_engine_lora_prefix_cache_queries_total", lora_name=a)
                - total(y, "prefixroute_engine_lora_prefix_cache_queries_total", lora_name=a)
                for x, y in zip(after, before))
        h = sum(total(x, "prefixroute_engine_lora_prefix_cache_hits_total", lora_name=a)
                - total(y, "prefixroute_engine_lora_prefix_cache_hits_total", lora_name=a)
                for x, y in zip(after, before))
        v = int(sum(total(x, "prefixroute_engine_model_not_served_total", model_name=a)
                    - total(y, "prefixroute_engine_model_not_served_total", model_name=a)
                    for x, y in zip(after, before)))
        violations += v
        set_sizes = [p["sizes"][a] for p in timeline]
        ok = [r for r in results[a] if not r.error]
        per_adapter[a] = {
            "requests": len(results[a]), "throttled_429": sum(1 for r in results[a] if r.status == 429),
            "cache_hit_rate": h / q if q else 0.0, "sticky_set_violations": v,
            "sticky_set_min": min(set_sizes, default=0), "sticky_set_max": max(set_sizes, default=0),
            "sticky_set_final": set_sizes[-1] if set_sizes else 0,
            "loads": int(total(rmetrics, "prefixroute_adapter_loads_total", adapter=a, result="ok")),
            "load_failures": int(total(rmetrics, "prefixroute_adapter_loads_total", adapter=a, result="failed")),
            "unloads": int(total(rmetrics, "prefixroute_adapter_unloads_total", adapter=a, result="ok")),
            "p50_first_byte_s": percentile([r.first_byte_s / args.time_scale for r in ok
                                            if r.first_byte_s is not None], 50),
            "max_first_byte_s": max((r.first_byte_s / args.time_scale for r in ok if r.first_byte_s is not None),
                                    default=float("nan")),
            "max_router_wait_s": max((r.router_wait_s / args.time_scale for r in results[a]
                                      if r.router_wait_s is not None), default=float("nan")),
        }
    ok = [r for r in all_results if not r.error]
    queries = sum(total(a, "vllm:prefix_cache_queries_total") - total(b, "vllm:prefix_cache_queries_total")
                  for a, b in zip(after, before))
    hits = sum(total(a, "vllm:prefix_cache_hits_total") - total(b, "vllm:prefix_cache_hits_total")
               for a, b in zip(after, before))
    buckets = ttft_buckets(before, after)
    counts = {u: 0 for u in urls}
    for r in ok:
        if r.instance in counts:
            counts[r.instance] += 1
    first = [r.first_byte_s / args.time_scale for r in ok if r.first_byte_s is not None]
    waits = [r.router_wait_s / args.time_scale for r in all_results if r.router_wait_s is not None]
    run = {
        "router": "prefixroute", "strategy": "PREFIX_AWARE", "replicas": 1, "requests": len(all_results),
        "errors": len(failed), "p50_ttft_s": histogram_quantile(buckets, 0.5),
        "p90_ttft_s": histogram_quantile(buckets, 0.9),
        "p50_latency_s": percentile([r.latency_s / args.time_scale for r in ok if r.latency_s is not None], 50),
        "cache_hit_rate": hits / queries if queries else 0.0,
        "throughput_rps": len(ok) / (wall / args.time_scale), "instance_share": [counts[u] / (len(ok) or 1)
                                                                                 for u in urls],
        "endpoint_kind": "lora", "api": "openai", "stream": True, "autoload": autoload,
        "throttled_429": throttled, "throttled_saturated": saturated, "throttled_empty_set": throttled - saturated,
        "sticky_set_violations": violations,
        "loads": int(total(rmetrics, "prefixroute_adapter_loads_total", result="ok")),
        "unloads": int(total(rmetrics, "prefixroute_adapter_unloads_total", result="ok")),
        "engine_loads": int(sum(total(a, "prefixroute_engine_lora_loads_total") for a in after)
                            - sum(total(b, "prefixroute_engine_lora_loads_total") for b in before)),
        "engine_unloads": int(sum(total(a, "prefixroute_engine_lora_unloads_total") for a in after)
                              - sum(total(b, "prefixroute_engine_lora_unloads_total") for b in before)),
        "lora_load_s": args.lora_load_s, "time_scale": args.time_scale,
        # the longest first byte a client saw (a load, a queue, a cold prefill, the engine's
        # TTFT) and, apart, the longest the router itself held a request (routing and any
        # wait for a load: X-Prefixroute-Overhead-Ms), model seconds
        "max_first_byte_s": max(first, default=float("nan")),
        "max_router_wait_s": max(waits, default=float("nan")),
        "router_wait_limit_s": router_wait_limit(args.lora_load_s, args.time_scale),
        "router_wait_unknown": len(all_results) - len(waits),
        "adapters": per_adapter, "sticky_set_timeline": timeline,
    }
    console.print(f"  LoRA, autoload {'on ' if autoload else 'off'}: {run['requests']} requests, {run['errors']} "
                  f"errors, {throttled} answered 429 ({saturated} saturated, {throttled - saturated} loaded nowhere "
                  f"with nothing to unload), {run['loads']} loads, {run['unloads']} unloads, "
                  f"{violations} sticky-set violations, hit {run['cache_hit_rate'] * 100:.1f} %, longest router-side "
                  f"wait {run['max_router_wait_s']:.3f} s (load {args.lora_load_s:g} s), longest first byte "
                  f"{run['max_first_byte_s']:.3f} s")
    procs.stop_all()
    return run


#: How much longer than one adapter load (``--lora-load-s``) the router may hold a request
#: with autoload on: 20 % of the load, and at least 50 ms of wall time (the router's own
#: routing, the unload before the load, the event loop of a 2-core machine that also runs
#: the engines and the clients).
LOAD_WAIT_MARGIN = 0.20
LOAD_WAIT_FLOOR_S = 0.05


def router_wait_limit(load_s: float, time_scale: float) -> float:
    """The longest router-side wait (model seconds) the rule allows: one load plus the margin."""
    return max(load_s * (1 + LOAD_WAIT_MARGIN), load_s + LOAD_WAIT_FLOOR_S / time_scale)


def check_lora(runs: list[dict[str, Any]]) -> list[str]:
    """The LoRA part's acceptance rules; returns the failures (empty: all hold)."""
    failures = []
    for r in runs:
        name = f"LoRA autoload {'on' if r['autoload'] else 'off'}"
        if r["sticky_set_violations"]:
            failures.append(f"{name}: {r['sticky_set_violations']} requests reached an engine without the adapter")
        if r["errors"]:
            failures.append(f"{name}: {r['errors']} failed requests (429s aside)")
        if r["autoload"] and (r["loads"] == 0 or r["throttled_saturated"]):
            failures.append(f"{name}: {r['loads']} loads, {r['throttled_saturated']} saturated sets answered 429")
        if not r["autoload"] and not r["throttled_saturated"]:
            failures.append(f"{name}: no saturated set was answered 429 (the run did not saturate any)")
        if r["autoload"] and not any(x["sticky_set_max"] >= 2 for x in r["adapters"].values()):
            failures.append(f"{name}: no sticky set grew past one instance")
        if not r["autoload"] and r["loads"]:
            failures.append(f"{name}: the router loaded adapters without Autoload")
        if r["autoload"]:  # the issue's "no request waits more than one load time"
            limit = router_wait_limit(r["lora_load_s"], r.get("time_scale", 1.0))
            if r["max_router_wait_s"] != r["max_router_wait_s"]:  # nan: no answer carried it
                failures.append(f"{name}: no router-side wait was measured (no X-Prefixroute-Overhead-Ms)")
            elif r["max_router_wait_s"] > limit:
                slow = [a for a, x in r["adapters"].items() if x["max_router_wait_s"] > limit]
                failures.append(f"{name}: the router held a request {r['max_router_wait_s']:.3f} s, more than the "
                                f"{limit:.3f} s allowed (one load, {r['lora_load_s']:g} s, + "
                                f"{LOAD_WAIT_MARGIN * 100:g} %, at least {LOAD_WAIT_FLOOR_S * 1000:g} ms of wall time; "
                                f"{', '.join(slow) or 'no adapter named'})")
    return failures
