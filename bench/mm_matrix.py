"""Part (a) of ``bench/multi_model.py``, the AWS matrix: its 16 runs (:func:`matrix`),
each run's summary from the engines' counters, and its checks (:func:`check_matrix`).
"""

from __future__ import annotations

import argparse
import itertools
from pathlib import Path
from typing import Any, Sequence

import aiohttp

from mm_clients import Result, closed_loop, interleaved
from mm_fleet import reset_caches, routing, set_strategy, start_engines, start_router
from mm_metrics import by_label, histogram_quantile, scrape, total, ttft_buckets
from mm_settings import COMPONENTS, ENDPOINT, LLAMA, QWEN, STRATEGIES, Sizes
from prefixroute.demo.processes import ProcessGroup
from prefixroute.demo.report import percentile
from prefixroute.workloads.shared_prefix import SharedPrefixWorkload


def summary(results: list[Result], wall: float, time_scale: float, urls: Sequence[str], before: list[dict],
            after: list[dict]) -> dict[str, Any]:
    ok = [r for r in results if not r.error]
    counts = {u: 0 for u in urls}
    for r in ok:
        if r.instance in counts:
            counts[r.instance] += 1
    queries = sum(total(a, "vllm:prefix_cache_queries_total") - total(b, "vllm:prefix_cache_queries_total")
                  for a, b in zip(after, before))
    hits = sum(total(a, "vllm:prefix_cache_hits_total") - total(b, "vllm:prefix_cache_hits_total")
               for a, b in zip(after, before))
    buckets = ttft_buckets(before, after)
    first = [r.first_byte_s / time_scale for r in ok if r.first_byte_s is not None]
    return {
        "requests": len(results), "errors": len(results) - len(ok),
        "p50_ttft_s": histogram_quantile(buckets, 0.5), "p90_ttft_s": histogram_quantile(buckets, 0.9),
        "p50_latency_s": percentile([r.latency_s / time_scale for r in ok if r.latency_s is not None], 50),
        "cache_hit_rate": hits / queries if queries else 0.0,
        "throughput_rps": len(ok) / (wall / time_scale) if wall > 0 else 0.0,
        "instance_share": [counts[u] / (len(ok) or 1) for u in urls],
        "p50_first_byte_s": percentile(first, 50),
        "error_kinds": sorted({r.error for r in results if r.error})[:5],
        "error_instances": sorted({r.instance for r in results if r.error}),
    }


async def matrix(procs: ProcessGroup, http: aiohttp.ClientSession, args: argparse.Namespace, sizes: Sizes,
                 tmp: Path, console: Any) -> list[dict[str, Any]]:
    runs: list[dict[str, Any]] = []
    for kind in ("single", "component"):
        models = [LLAMA] * 4 if kind == "single" else [LLAMA] * 4 + [QWEN] * 4
        engines = await start_engines(procs, models, args, sizes)
        urls = [e.url for e in engines]
        endpoint: dict[str, Any] = {"EndpointName": ENDPOINT, "ProductionVariants": [{
            "VariantName": "AllTraffic", "Instances": urls,
            "RoutingConfig": routing("RANDOM", args.concurrency_threshold, args.prefix_length)}]}
        if kind == "component":
            endpoint["InferenceComponents"] = [
                {"InferenceComponentName": c, "ModelName": m, "Instances": "DISCOVER"} for c, m in COMPONENTS.items()]
        router = await start_router(procs, {"Endpoints": [endpoint]}, tmp, kind)
        admin = next(iter(router.extra_urls.values()))
        served = {u: m for u, m in zip(urls, models)}
        for api, stream, strategy in itertools.product(("native", "openai"), (False, True), STRATEGIES):
            await reset_caches(http, urls)
            await set_strategy(http, admin, kind, strategy, args)
            wl = [(None, SharedPrefixWorkload(groups=sizes.groups, prefix_tokens=sizes.prefix_tokens,
                                              question_tokens=sizes.question_tokens,
                                              output_tokens=sizes.output_tokens, model=LLAMA, seed=args.seed))]
            if kind == "component":
                wl = [(c, SharedPrefixWorkload(groups=sizes.groups, prefix_tokens=sizes.prefix_tokens,
                                               question_tokens=sizes.question_tokens, output_tokens=sizes.output_tokens,
                                               model=m, seed=args.seed + k))
                      for k, (c, m) in enumerate(COMPONENTS.items())]
            before = [await scrape(http, u) for u in urls]
            results, wall = await closed_loop(http, router.url, interleaved(wl), sizes.users, sizes.run_s, api, stream)
            after = [await scrape(http, u) for u in urls]
            rm = await scrape(http, router.url)
            run = {"router": "prefixroute", "strategy": strategy, "replicas": 1,
                   **summary(results, wall, args.time_scale, urls, before, after),
                   "endpoint_kind": "single-model" if kind == "single" else "inference-component",
                   "api": api, "stream": stream,
                   # the router's view, to tell a failure's cause (cumulative over the fleet's runs)
                   "router_upstream_errors": by_label(rm, "prefixroute_upstream_errors_total", "kind"),
                   "router_unhealthy_instances": sum(1 for (n, _), v in rm.items()
                                                     if n == "prefixroute_instance_healthy" and v == 0)}
            # The engines' own counts: requests per model asked for, and 404s for a model they lack.
            wrong = 0
            per_copy: dict[str, dict[str, float]] = {}
            for u, b, a in zip(urls, before, after):
                asked = by_label(a, "prefixroute_engine_requests_total", "model_name")
                was = by_label(b, "prefixroute_engine_requests_total", "model_name")
                for model, n in asked.items():
                    d = n - was.get(model, 0.0)
                    if d and model != served[u]:
                        wrong += int(d)
                    if d:
                        per_copy.setdefault(model, {})[u] = d
                wrong += int(total(a, "prefixroute_engine_model_not_served_total")
                             - total(b, "prefixroute_engine_model_not_served_total"))
            run["requests_served_elsewhere"] = wrong
            if kind == "component":
                run["component_requests_by_copy"] = {c: per_copy.get(m, {}) for c, m in COMPONENTS.items()}
                run["component_header_mismatches"] = sum(
                    1 for r in results if not r.error and served.get(r.instance) != COMPONENTS.get(r.component))
            runs.append(run)
            console.print(f"  {run['endpoint_kind']:<20} {api:<6} {'stream' if stream else 'whole':<6} "
                          f"{strategy:<12} {run['requests']:>5} requests, {run['errors']} errors, hit "
                          f"{run['cache_hit_rate'] * 100:5.1f} %, P50 TTFT {run['p50_ttft_s'] * 1000:6.1f} ms")
        procs.stop_all()
    return runs


def check_matrix(runs: list[dict[str, Any]]) -> list[str]:
    """The matrix's acceptance rules; returns the failures (empty: all hold)."""
    failures = []
    for r in runs:
        name = f"{r['endpoint_kind']}/{r['api']}/{'stream' if r['stream'] else 'whole'}/{r['strategy']}"
        if r["errors"]:
            failures.append(f"{name}: {r['errors']} errors {r['error_kinds']}")
        if r["requests_served_elsewhere"]:
            failures.append(f"{name}: {r['requests_served_elsewhere']} requests reached an engine without the model")
        if r.get("component_header_mismatches"):
            failures.append(f"{name}: {r['component_header_mismatches']} answers from another component's copy")
    for r in runs:
        if r["strategy"] != "PREFIX_AWARE":
            continue
        base = next(b for b in runs if b["strategy"] == "RANDOM" and all(
            b[k] == r[k] for k in ("endpoint_kind", "api", "stream")))
        name = f"{r['endpoint_kind']}/{r['api']}/{'stream' if r['stream'] else 'whole'}"
        if r["cache_hit_rate"] - base["cache_hit_rate"] < 0.30:
            failures.append(f"{name}: hit rate {r['cache_hit_rate']:.1%} vs RANDOM {base['cache_hit_rate']:.1%}")
        if not r["p50_ttft_s"] <= 0.4 * base["p50_ttft_s"]:
            failures.append(f"{name}: P50 TTFT {r['p50_ttft_s'] * 1000:.1f} ms vs RANDOM "
                            f"{base['p50_ttft_s'] * 1000:.1f} ms (not 60 % lower)")
    return failures
