"""The emulated engine's ``GET /metrics``: Prometheus, under vLLM's metric names.

One engine's registry (:func:`engine_registry`) holds:

* the core's counters and gauges, read at scrape time: prefix-cache queries and hits
  (``vllm:prefix_cache_*``, the lower KV tiers' ``vllm:external_prefix_cache_*``),
  prompt and generation tokens, finished requests, running and waiting requests, KV
  usage, and ``prefixroute_engine_tier_hit_tokens`` per tier;
* the server's own: ``vllm:lora_requests_info`` (with LoRA on), requests per model
  name asked for, requests refused with 404 for a model not served, LoRA loads and
  unloads, prefix-cache counters per adapter;
* the two latency histograms the step loop observes, in modelled seconds on vLLM's
  buckets: ``vllm:time_to_first_token_seconds``, ``vllm:e2e_request_latency_seconds``.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from prefixroute.engine.core import EngineCore
    from prefixroute.engine.server import EngineServer

__all__ = ["TTFT_BUCKETS", "E2E_BUCKETS", "engine_registry"]

#: vLLM's buckets (seconds) for ``vllm:time_to_first_token_seconds``.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
               60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


class _EngineCollector(Collector):
    """Reads the core's counters at scrape time, under vLLM's metric names."""

    def __init__(self, core: EngineCore, model: str, server: EngineServer | None = None) -> None:
        self._core = core
        self._model = model
        self._server = server

    def collect(self) -> Iterator[Metric]:
        s = self._core.stats()
        m = [self._model]
        counters = (
            ("vllm:prefix_cache_queries", "Prompt tokens of admitted requests.", s.prefix_cache_queries),
            ("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.", s.prefix_cache_hits),
            ("vllm:gpu_prefix_cache_queries", "Older name of vllm:prefix_cache_queries.", s.prefix_cache_queries),
            ("vllm:gpu_prefix_cache_hits", "Older name of vllm:prefix_cache_hits.", s.prefix_cache_hits),
            ("vllm:prompt_tokens", "Prompt tokens of prefilled requests (cached included).", s.prompt_tokens_total),
            ("vllm:generation_tokens", "Generated tokens.", s.generation_tokens_total),
            ("vllm:num_preemptions", "Preemptions (0: KV blocks are reserved at admission).", 0),
            ("vllm:external_prefix_cache_queries", "Prompt tokens looked up in the lower KV tiers (CPU, shared).",
             s.external_prefix_cache_queries),
            ("vllm:external_prefix_cache_hits", "Prompt tokens loaded from the lower KV tiers.",
             s.external_prefix_cache_hits),
        )
        for name, doc, value in counters:
            c = CounterMetricFamily(name, doc, labels=["model_name"])
            c.add_metric(m, value)
            yield c
        success = CounterMetricFamily(
            "vllm:request_success", "Finished requests.", labels=["model_name", "finished_reason"]
        )
        success.add_metric([self._model, "length"], s.requests_finished)
        yield success
        tiers = CounterMetricFamily("prefixroute_engine_tier_hit_tokens", "Prompt tokens loaded from a KV tier.",
                                    labels=["model_name", "medium"])
        tiers.add_metric([self._model, "CPU"], s.cpu_tier_hits)
        tiers.add_metric([self._model, "SHARED"], s.shared_tier_hits)
        yield tiers
        gauges = (
            ("vllm:num_requests_running", "Requests admitted and running.", s.num_running),
            ("vllm:num_requests_waiting", "Requests waiting for admission.", s.num_waiting),
            ("vllm:kv_cache_usage_perc", "KV-cache usage, fraction 0-1 of blocks referenced.", s.kv_cache_usage),
            ("vllm:gpu_cache_usage_perc", "Alias of vllm:kv_cache_usage_perc (older vLLM name).", s.kv_cache_usage),
        )
        for name, doc, value in gauges:
            g = GaugeMetricFamily(name, doc, labels=["model_name"])
            g.add_metric(m, value)
            yield g
        if self._server is not None:
            yield from _server_metrics(self._server)


def _server_metrics(server: EngineServer) -> Iterator[Metric]:
    """vLLM's ``vllm:lora_requests_info`` (with LoRA on) and the emulator's own
    counters: requests per model asked for, requests for a model not served,
    adapter loads and unloads, prefix-cache counters per adapter."""
    m = [server.config.model]
    if server.config.max_loras:
        running, waiting = server.core.lora_activity()
        info = GaugeMetricFamily("vllm:lora_requests_info", "Running stats on lora requests.",
                                 labels=["max_lora", "running_lora_adapters", "waiting_lora_adapters"])
        info.add_metric([str(server.config.max_loras), ",".join(sorted(running)), ",".join(sorted(waiting))],
                        time.time())
        yield info
    requests = CounterMetricFamily("prefixroute_engine_requests", "Requests accepted, per model name asked for "
                                   "(a served name or a LoRA adapter).", labels=["model_name"])
    for name, n in sorted(server.requests_by_model.items()):
        requests.add_metric([name], n)
    yield requests
    missing = CounterMetricFamily(
        "prefixroute_engine_model_not_served",
        "Requests refused with 404 because the engine did not have the model or adapter asked for at that "
        "moment (for an adapter: a request sent outside its sticky set).", labels=["model_name"])
    for name, n in sorted(server.not_served.items()):
        missing.add_metric([name], n)
    yield missing
    for metric, doc, value in (("prefixroute_engine_lora_loads", "LoRA adapters loaded at run time.",
                                server.lora_loads),
                               ("prefixroute_engine_lora_unloads", "LoRA adapters unloaded at run time.",
                                server.lora_unloads)):
        c = CounterMetricFamily(metric, doc, labels=["model_name"])
        c.add_metric(m, value)
        yield c
    queries = CounterMetricFamily("prefixroute_engine_lora_prefix_cache_queries",
                                  "Prompt tokens looked up in the prefix cache, per LoRA adapter ('' = base).",
                                  labels=["lora_name"])
    hits = CounterMetricFamily("prefixroute_engine_lora_prefix_cache_hits",
                               "Prompt tokens found in the prefix cache, per LoRA adapter ('' = base).",
                               labels=["lora_name"])
    for lora, (q, h) in sorted(server.core.lora_cache_stats().items(), key=lambda kv: kv[0] or ""):
        queries.add_metric([lora or ""], q)
        hits.add_metric([lora or ""], h)
    yield queries
    yield hits


def engine_registry(core: EngineCore, model: str,
                    server: EngineServer | None = None) -> tuple[CollectorRegistry, Histogram, Histogram]:
    """One engine's metrics registry and its two latency histograms.

    Args:
        core: the engine core whose counters are read at scrape time.
        model: the ``model_name`` label (the base model's name).
        server: the :class:`~prefixroute.engine.server.EngineServer` whose own counters
            are exported too; ``None``: the core's only.
    Returns:
        ``(registry, ttft, e2e)``: the registry to render, and the
        ``vllm:time_to_first_token_seconds`` and ``vllm:e2e_request_latency_seconds``
        histograms (labelled by ``model_name``, observed in modelled seconds).
    """
    registry = CollectorRegistry()
    registry.register(_EngineCollector(core, model, server))
    ttft = Histogram(
        "vllm:time_to_first_token_seconds", "Time to first token, in modelled seconds.",
        ["model_name"], registry=registry, buckets=TTFT_BUCKETS,
    )
    e2e = Histogram(
        "vllm:e2e_request_latency_seconds", "End-to-end request latency, in modelled seconds.",
        ["model_name"], registry=registry, buckets=E2E_BUCKETS,
    )
    return registry, ttft, e2e
