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
import itertools
import random
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Sequence

import aiohttp
import orjson
import yaml
from prometheus_client.parser import text_string_to_metric_families

from prefixroute.demo.processes import Child, ProcessGroup
from prefixroute.demo.report import percentile
from prefixroute.workloads.shared_prefix import SharedPrefixWorkload

LLAMA = "meta-llama/Llama-3.1-70B-Instruct"
QWEN = "Qwen/Qwen2.5-72B-Instruct"
COMPONENTS = {"llama-70b": LLAMA, "qwen-72b": QWEN}
ENDPOINT = "bench"
STRATEGIES = ("RANDOM", "PREFIX_AWARE")


@dataclass(frozen=True)
class Sizes:
    """How big one benchmark is (``--quick`` shrinks it)."""

    run_s: float  # real seconds of traffic per matrix run
    lora_s: float  # real seconds of traffic per LoRA run
    users: int  # closed-loop users
    groups: int  # documents per model
    prefix_tokens: int  # of each matrix document
    question_tokens: int
    output_tokens: int
    kv_tokens: int  # KV capacity of each engine
    lora_users: int
    lora_groups: int  # documents per adapter
    lora_prefix_tokens: int  # of each LoRA document


# The matrix's documents: 96 of 1,500 tokens per model (144,000 tokens, 80 % of 4 engines'
# KV). PREFIX_AWARE spreads them by rendezvous over the instances' URLs (fresh ports each
# run): with 96 keys an instance's share varies by about 18 % by luck alone, with 48 by 25 %,
# enough to queue the busiest past ConcurrencyThreshold in some runs.
FULL = Sizes(run_s=20.0, lora_s=45.0, users=16, groups=96, prefix_tokens=1500, question_tokens=64, output_tokens=16,
             kv_tokens=45_000, lora_users=20, lora_groups=6, lora_prefix_tokens=3000)
QUICK = Sizes(run_s=4.0, lora_s=8.0, users=12, groups=48, prefix_tokens=1500, question_tokens=64, output_tokens=8,
              kv_tokens=22_500, lora_users=12, lora_groups=3, lora_prefix_tokens=3000)


# -- engine metrics ------------------------------------------------------------------------


async def scrape(http: aiohttp.ClientSession, url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of ``url``'s ``/metrics``: ``(name, sorted labels) -> value``."""
    async with http.get(url + "/metrics") as r:
        text = await r.text()
    out: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def total(samples: dict, name: str, **labels: str) -> float:
    return sum(v for (n, lbl), v in samples.items() if n == name and all(dict(lbl).get(k) == x
                                                                         for k, x in labels.items()))


def by_label(samples: dict, name: str, label: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for (n, lbl), v in samples.items():
        if n == name:
            key = dict(lbl).get(label, "")
            out[key] = out.get(key, 0.0) + v
    return out


def histogram_quantile(buckets: dict[float, float], q: float) -> float:
    """The ``q`` quantile (0-1) of a cumulative histogram ``{upper bound: count}``,
    linear within the bucket it falls in (Prometheus' ``histogram_quantile``)."""
    bounds = sorted(buckets)
    count = buckets[bounds[-1]] if bounds else 0.0
    if count <= 0:
        return float("nan")
    rank = q * count
    prev_bound, prev_count = 0.0, 0.0
    for b in bounds:
        c = buckets[b]
        if c >= rank:
            if b == float("inf"):
                return prev_bound
            return prev_bound + (b - prev_bound) * ((rank - prev_count) / (c - prev_count) if c > prev_count else 0)
        prev_bound, prev_count = b, c
    return prev_bound


def ttft_buckets(before: list[dict], after: list[dict]) -> dict[float, float]:
    """The engines' TTFT histogram over a run (every engine, every model), cumulative."""
    out: dict[float, float] = {}
    for b, a in zip(before, after):
        for (name, lbl), v in a.items():
            if name == "vllm:time_to_first_token_seconds_bucket":
                le = float(dict(lbl)["le"])
                out[le] = out.get(le, 0.0) + v - b.get((name, lbl), 0.0)
    return out


# -- clients -------------------------------------------------------------------------------


@dataclass
class Result:
    status: int = 0
    instance: str = ""
    component: str = ""
    first_byte_s: float | None = None
    latency_s: float | None = None
    error: str = ""
    retry_after_s: float = 0.0
    # the router's own time on the request, wall seconds: its X-Prefixroute-Overhead-Ms
    # (routing, and any wait for an adapter load), or, for an answer the router gave itself
    # (a 429: no X-Prefixroute-Instance), the time to its headers; None if unknown
    router_wait_s: float | None = None


async def send(http: aiohttp.ClientSession, router: str, body: dict[str, Any], api: str, stream: bool,
               component: str | None) -> Result:
    """One request in the API's own form: the OpenAI chat route (the component's path on a
    component endpoint) or SageMaker's ``invocations`` / ``invocations-response-stream``
    (the component in ``X-Amzn-SageMaker-Inference-Component``)."""
    headers = {"Content-Type": "application/json"}
    if api == "openai":
        path = (f"/endpoints/{ENDPOINT}/inference-components/{component}/openai/v1/chat/completions" if component
                else f"/endpoints/{ENDPOINT}/openai/v1/chat/completions")
    else:
        path = f"/endpoints/{ENDPOINT}/invocations" + ("-response-stream" if stream else "")
        if component:
            headers["X-Amzn-SageMaker-Inference-Component"] = component
    payload = dict(body, stream=stream)
    res = Result()
    t0 = time.perf_counter()
    try:
        async with http.post(router + path, data=orjson.dumps(payload), headers=headers) as r:
            t_headers = time.perf_counter() - t0
            res.status = r.status
            overhead = r.headers.get("X-Prefixroute-Overhead-Ms")
            if overhead is not None:
                res.router_wait_s = float(overhead) / 1000
            elif r.status != 200 and "X-Prefixroute-Instance" not in r.headers:
                res.router_wait_s = t_headers
            retry = r.headers.get("Retry-After", "")
            res.retry_after_s = float(retry) if retry.isdigit() else 0.0
            res.instance = r.headers.get("X-Prefixroute-Instance", "")
            res.component = r.headers.get("X-Prefixroute-Inference-Component", "")
            head = b""
            async for chunk in r.content.iter_any():
                if chunk and res.first_byte_s is None:
                    res.first_byte_s = time.perf_counter() - t0
                if r.status != 200 and len(head) < 300:
                    head += chunk
            if r.status != 200:
                res.error = f"HTTP {r.status}: {head[:200].decode('utf-8', 'replace')}"
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        res.error = f"{type(exc).__name__} after {time.perf_counter() - t0:.1f} s (instance {res.instance or '?'})"
    res.latency_s = time.perf_counter() - t0
    return res


def interleaved(workloads: Sequence[tuple[str | None, SharedPrefixWorkload]]) -> Iterator[tuple[str | None, dict]]:
    """Requests of several workloads (one per component, or one), alternating."""
    streams = [(c, w.requests(10**9)) for c, w in workloads]
    for c, it in itertools.cycle(streams):
        yield c, next(it).body


async def closed_loop(http: aiohttp.ClientSession, router: str, requests: Iterator[tuple[str | None, dict]],
                      users: int, duration_s: float, api: str, stream: bool) -> tuple[list[Result], float]:
    results: list[Result] = []
    t0 = time.perf_counter()
    deadline = t0 + duration_s

    async def user() -> None:
        while time.perf_counter() < deadline:
            component, body = next(requests)
            results.append(await send(http, router, body, api, stream, component))

    await asyncio.gather(*(user() for _ in range(users)))
    return results, time.perf_counter() - t0


# -- fleets --------------------------------------------------------------------------------


async def start_engines(procs: ProcessGroup, models: Sequence[str], args: argparse.Namespace, sizes: Sizes,
                        extra: Sequence[Sequence[str]] = ()) -> list[Child]:
    async def one(i: int, model: str) -> Child:
        flags = ["emulate", "--port", "0", "--instance-id", f"engine-{i}", "--model", model,
                 "--time-scale", str(args.time_scale), "--kv-capacity-tokens", str(sizes.kv_tokens),
                 "--log-level", "warning", *(extra[i] if extra else ())]
        return await asyncio.to_thread(procs.start, f"engine-{i}", flags)

    return list(await asyncio.gather(*(one(i, m) for i, m in enumerate(models))))


async def start_router(procs: ProcessGroup, config: dict[str, Any], tmp: Path, name: str,
                       extra: Sequence[str] = ()) -> Child:
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return await asyncio.to_thread(procs.start, "router", [
        "serve", "--config", str(path), "--port", "0", "--seed", "0",  # (admin: a free port, printed)
        "--log-level", "warning", *extra], 30.0, 2)


def routing(strategy: str, threshold: int, prefix_length: int) -> dict[str, Any]:
    if strategy == "PREFIX_AWARE":
        return {"RoutingStrategy": strategy, "PrefixAwareRoutingConfig": {
            "PrefixLength": prefix_length, "ConcurrencyThreshold": threshold}}
    return {"RoutingStrategy": strategy}


async def reset_caches(http: aiohttp.ClientSession, urls: Sequence[str]) -> None:
    """Empty every engine's prefix cache (vLLM's route; refused while requests run)."""
    for url in urls:
        for _ in range(200):
            async with http.post(url + "/reset_prefix_cache") as r:
                if r.status == 200:
                    break
            await asyncio.sleep(0.05)
        else:
            raise RuntimeError(f"{url} kept refusing /reset_prefix_cache")


async def set_strategy(http: aiohttp.ClientSession, admin: str, kind: str, strategy: str, args: argparse.Namespace
                       ) -> None:
    body = routing(strategy, args.concurrency_threshold, args.prefix_length)
    paths = ([f"/admin/endpoints/{ENDPOINT}/variants/AllTraffic/routing"] if kind == "single" else
             [f"/admin/endpoints/{ENDPOINT}/inference-components/{c}/routing" for c in COMPONENTS])
    for p in paths:
        async with http.put(admin + p, json=body) as r:
            if r.status != 200:
                raise RuntimeError(f"admin {p}: {r.status} {await r.text()}")


# -- (a) the matrix ------------------------------------------------------------------------


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


# -- (b) LoRA ------------------------------------------------------------------------------


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


# -- output --------------------------------------------------------------------------------


def render(matrix_runs: list[dict[str, Any]], lora_runs: list[dict[str, Any]]) -> list[Any]:
    from rich.table import Table

    tables = []
    t = Table(title="The AWS matrix (model seconds; TTFT from the engines' histograms)", title_justify="left")
    for col in ("endpoint", "API", "stream", "strategy", "requests", "errors", "cache hit", "P50 TTFT", "P90 TTFT",
                "P50 latency", "throughput", "share per instance %"):
        t.add_column(col, no_wrap=True, justify="left" if col in ("endpoint", "API", "strategy") else "right")
    for r in matrix_runs:
        base = next(b for b in matrix_runs if b["strategy"] == "RANDOM" and all(
            b[k] == r[k] for k in ("endpoint_kind", "api", "stream")))
        d = "" if r is base else f" ({(r['p50_ttft_s'] / base['p50_ttft_s'] - 1) * 100:+.0f}%)"
        t.add_row(r["endpoint_kind"], r["api"], "yes" if r["stream"] else "no", r["strategy"], str(r["requests"]),
                  str(r["errors"]), f"{r['cache_hit_rate'] * 100:.1f} %", f"{r['p50_ttft_s'] * 1000:.0f} ms{d}",
                  f"{r['p90_ttft_s'] * 1000:.0f} ms", f"{r['p50_latency_s']:.2f} s", f"{r['throughput_rps']:.1f} rps",
                  " ".join(f"{x * 100:.0f}" for x in r["instance_share"]))
    if matrix_runs:
        tables.append(t)
    for r in lora_runs:
        lt = Table(title=f"LoRA: 8 adapters on 4 instances x 2 slots, autoload {'on' if r['autoload'] else 'off'}; "
                         f"{r['requests']} requests, {r['throttled_429']} answered 429, "
                         f"{r['sticky_set_violations']} sticky-set violations; longest router-side wait "
                         f"{r['max_router_wait_s'] * 1000:.1f} ms (one load: {r['lora_load_s'] * 1000:.0f} ms, "
                         f"allowed with autoload {r['router_wait_limit_s'] * 1000:.0f} ms), longest first byte "
                         f"{r['max_first_byte_s'] * 1000:.1f} ms", title_justify="left")
        for col in ("adapter", "requests", "429", "cache hit", "set min/max/final", "loads", "unloads",
                    "violations", "P50 first byte", "longest first byte", "longest router wait"):
            lt.add_column(col, no_wrap=True, justify="left" if col == "adapter" else "right")
        for a, x in r["adapters"].items():
            lt.add_row(a, str(x["requests"]), str(x["throttled_429"]), f"{x['cache_hit_rate'] * 100:.1f} %",
                       f"{x['sticky_set_min']}/{x['sticky_set_max']}/{x['sticky_set_final']}", str(x["loads"]),
                       str(x["unloads"]), str(x["sticky_set_violations"]), f"{x['p50_first_byte_s'] * 1000:.0f} ms",
                       f"{x['max_first_byte_s'] * 1000:.0f} ms", f"{x['max_router_wait_s'] * 1000:.1f} ms")
        tables.append(lt)
    return tables


def plot(out_dir: Path, lora_runs: list[dict[str, Any]]) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for r in lora_runs:
        fig, ax = plt.subplots(figsize=(8, 4.5))
        ts = [p["t_s"] for p in r["sticky_set_timeline"]]
        for a in ADAPTERS:
            ax.step(ts, [p["sizes"][a] for p in r["sticky_set_timeline"]], where="post", label=a)
        ax.set_xlabel("seconds into the run")
        ax.set_ylabel("instances with the adapter loaded")
        ax.set_title(f"Sticky-set size per adapter (autoload {'on' if r['autoload'] else 'off'})")
        ax.legend(ncol=4, fontsize=8)
        fig.tight_layout()
        p = out_dir / f"sticky_sets_autoload_{'on' if r['autoload'] else 'off'}.png"
        fig.savefig(p, dpi=110)
        plt.close(fig)
        paths.append(p)
    return paths


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
