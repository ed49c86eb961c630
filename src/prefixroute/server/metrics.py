"""Prometheus metrics of the router (prefix ``prefixroute_``), in their own registry.

Labels never carry request content: only endpoint, variant and instance names from the
configuration, decision kinds, status codes and error kinds. An endpoint name taken
from a URL that is not configured is reported as ``unknown`` (no label explosion).

The in-flight gauge is not updated per request: a collector reads the pools at scrape
time, so it is exactly the pools' counts. The ``prefixroute_backend_*`` families mirror
what the router last scraped from each engine's own ``/metrics`` (:mod:`.scrape`).

With ``serve --workers N`` every worker calls :func:`use_multiprocess_values` before
it makes its :class:`RouterMetrics`: counters and histograms then live in
prometheus-client's per-process files in a directory private to the router, and each
worker's ``/metrics`` sums every worker's (dead ones' included, so counters never go
back), whichever worker answers the scrape. The in-flight gauge reads the shared
table, so it is the count over every worker; the other gauges (health, the
``prefixroute_backend_*`` mirrors, CACHE_AWARE's view) are those of the worker that
answered.

``prefixroute_responses_total{code}`` is the status the client received in full;
``499`` when the client went away first, and ``stream_aborted`` when the status line
was sent but the instance failed or went silent mid-body (the client got an error
event, or a truncated body).
"""

from __future__ import annotations

import os
from bisect import bisect_left
from typing import Any, Callable, Iterable, Mapping

from prometheus_client import CollectorRegistry, Counter, Histogram, values
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4, generate_latest
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from prefixroute.core.endpoint import Fleet
from prefixroute.server.scrape import BackendStats

__all__ = ["RouterMetrics", "CONTENT_TYPE", "METRIC_NAMES", "KV_EVENTS_METRIC_NAMES", "use_multiprocess_values"]

#: Content type of ``GET /metrics``.
CONTENT_TYPE = CONTENT_TYPE_PLAIN_0_0_4

#: Every metric family the router exports (histograms add _bucket/_sum/_count).
METRIC_NAMES = (
    "prefixroute_requests_total",
    "prefixroute_responses_total",
    "prefixroute_upstream_errors_total",
    "prefixroute_retries_total",
    "prefixroute_in_flight",
    "prefixroute_instance_healthy",
    "prefixroute_approx_cache_blocks",
    "prefixroute_approx_cache_bytes",
    "prefixroute_approx_cache_instance_bytes",
    "prefixroute_approx_cache_instance_max_bytes",
    "prefixroute_approx_cache_capacity_blocks",
    "prefixroute_cache_aware_continued_share",
    "prefixroute_routing_decision_seconds",
    "prefixroute_ttft_seconds",
    "prefixroute_request_duration_seconds",
    "prefixroute_router_overhead_seconds",
    "prefixroute_backend_prefix_cache_queries_total",
    "prefixroute_backend_prefix_cache_hits_total",
    "prefixroute_backend_prefix_cache_hit_rate",
    "prefixroute_fleet_prefix_cache_hit_rate",
    "prefixroute_backend_requests_running",
    "prefixroute_backend_requests_waiting",
    "prefixroute_backend_scrape_ok",
    "prefixroute_client_requests_total",
    "prefixroute_client_in_flight",
    "prefixroute_component_requests_total",
    "prefixroute_component_in_flight",
    "prefixroute_adapter_requests_total",
    "prefixroute_adapter_sticky_set_size",
    "prefixroute_adapter_loads_total",
    "prefixroute_adapter_unloads_total",
    "prefixroute_adapter_load_seconds",
)

#: The families precise mode adds (exported while the configuration has ``KvEvents``).
KV_EVENTS_METRIC_NAMES = (
    "prefixroute_kv_events_precise",
    "prefixroute_kv_events_connected",
    "prefixroute_kv_events_blocks",
    "prefixroute_kv_events_shared_tier_blocks",
    "prefixroute_kv_events_messages_total",
    "prefixroute_kv_events_gaps_total",
    "prefixroute_kv_events_replays_total",
    "prefixroute_kv_events_replays_failed_total",
    "prefixroute_kv_events_resets_total",
    "prefixroute_kv_events_restarts_total",
    "prefixroute_kv_events_rejected_total",
)

# A routing decision takes microseconds; start at 1 µs.
_DECISION_BUCKETS = (1e-6, 2.5e-6, 5e-6, 1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 1e-2, 0.1)
_OVERHEAD_BUCKETS = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 1.5e-3, 2e-3, 3e-3, 5e-3, 1e-2, 2.5e-2, 0.1, 1.0)
_TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0,
                 7.5, 10.0, 20.0, 30.0, 60.0)
_DURATION_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0)


_STRATEGY_STATS = {
    "approx_cache_blocks": "CACHE_AWARE: block hashes remembered over every instance's approximate cache view.",
    "approx_cache_bytes": "CACHE_AWARE: estimated memory of the approximate cache views and their index, bytes "
                          "(blocks x BYTES_PER_BLOCK_ENTRY).",
    "approx_cache_capacity_blocks": "CACHE_AWARE: most blocks the views may hold (InstanceCacheTokens x 4 / "
                                    "BlockSize per instance).",
}
#: CACHE_AWARE's share of continuations, one series per pool (a variant's own, label
#: ``component=""``, and each inference component's): each pool's strategy reads its own.
_CONTINUED_SHARE = ("prefixroute_cache_aware_continued_share",
                    "CACHE_AWARE: moving average (about 128 requests) of the share of requests extending a prefix "
                    "held on their instance that continue a request routed there (a conversation's next turn) "
                    "rather than branch off it (a new question about a document); below 0.5 a fleet with 3 of 4 "
                    "instances waiting counts as backlogged (core/placement_rules.py). Per pool (component \"\" "
                    "for the variant's own); a pool's series appears with its first such request.")
# CACHE_AWARE's per-instance view (Strategy.instance_stats()).
_INSTANCE_STATS = {
    "approx_cache_instance_bytes": "CACHE_AWARE: estimated memory of one instance's approximate cache view, "
                                   "bytes (blocks x BYTES_PER_BLOCK_ENTRY).",
    "approx_cache_instance_max_bytes": "CACHE_AWARE: most memory one instance's view may take, bytes (its block "
                                       "limit x BYTES_PER_BLOCK_ENTRY).",
}


class _PoolCollector(Collector):
    """In-flight and health per instance, read from the live pools at scrape time."""

    def __init__(self, fleet: Callable[[], Fleet]) -> None:
        self._fleet = fleet

    def collect(self) -> Iterable[Metric]:
        in_flight = GaugeMetricFamily(
            "prefixroute_in_flight", "Requests in flight per instance (sent, not yet finished).",
            labels=("endpoint", "variant", "instance"))
        healthy = GaugeMetricFamily(
            "prefixroute_instance_healthy", "1 if the instance takes requests, 0 if out of rotation.",
            labels=("endpoint", "variant", "instance"))
        # CACHE_AWARE's learned view (Strategy.stats()); other strategies keep no state.
        state = {name: GaugeMetricFamily(f"prefixroute_{name}", doc, labels=("endpoint", "variant"))
                 for name, doc in _STRATEGY_STATS.items()}
        per = {name: GaugeMetricFamily(f"prefixroute_{name}", doc, labels=("endpoint", "variant", "instance"))
               for name, doc in _INSTANCE_STATS.items()}
        comp_in_flight = GaugeMetricFamily(
            "prefixroute_component_in_flight",
            "Requests in flight per inference component copy (its own count and ConcurrencyThreshold).",
            labels=("endpoint", "component", "instance"))
        share = GaugeMetricFamily(*_CONTINUED_SHARE, labels=("endpoint", "variant", "component"))
        stats: dict[tuple[str, str, str], float] = {}
        per_stats: dict[tuple[str, str, str, str], float] = {}
        for endpoint, pool in self._fleet().all_pools():
            for inst in pool.instances:
                if pool.component is not None:
                    comp_in_flight.add_metric((endpoint, pool.component, inst.instance_id), inst.in_flight)
                    continue
                labels = (endpoint, pool.name, inst.instance_id)
                in_flight.add_metric(labels, inst.in_flight)
                healthy.add_metric(labels, 1.0 if inst.healthy else 0.0)
            for name, value in pool.strategy.stats().items():  # (a component's counts as its variant's)
                if name in state:
                    key = (name, endpoint, pool.name)
                    stats[key] = stats.get(key, 0.0) + value
                elif name == "cache_aware_continued_share":
                    share.add_metric((endpoint, pool.name, pool.component or ""), value)
            for instance, gauges in pool.strategy.instance_stats().items():
                for name, value in gauges.items():
                    if name in per:
                        key = (name, endpoint, pool.name, instance)
                        per_stats[key] = per_stats.get(key, 0.0) + value
        for (name, endpoint, variant), value in stats.items():
            state[name].add_metric((endpoint, variant), value)
        for (name, endpoint, variant, instance), value in per_stats.items():
            per[name].add_metric((endpoint, variant, instance), value)
        return [in_flight, healthy, comp_in_flight, *state.values(), *per.values(), share]


class _CatalogCollector(Collector):
    """Each LoRA adapter's sticky set size (instances that have it loaded), read from the
    router's catalog at scrape time."""

    def __init__(self, catalog: Callable[[], Any]) -> None:
        self._catalog = catalog

    def collect(self) -> Iterable[Metric]:
        size = GaugeMetricFamily("prefixroute_adapter_sticky_set_size",
                                 "Instances that have the LoRA adapter loaded (its sticky set), as the router knows.",
                                 labels=("adapter",))
        catalog = self._catalog()
        if catalog is not None:
            for adapter, count in sorted(catalog.sticky_set_sizes().items()):
                size.add_metric((adapter,), count)
        return [size]


class _BackendCollector(Collector):
    """The engines' own prefix-cache counters and queue lengths, as last scraped."""

    def __init__(self, stats: Callable[[], Mapping[str, BackendStats]]) -> None:
        self._stats = stats

    def collect(self) -> Iterable[Metric]:
        lbl = ("instance",)
        queries = CounterMetricFamily(
            "prefixroute_backend_prefix_cache_queries",
            "Prompt tokens the instance looked up in its prefix cache (its vllm:prefix_cache_queries_total, or "
            "sglang:prompt_tokens_total).",
            labels=lbl)
        hits = CounterMetricFamily(
            "prefixroute_backend_prefix_cache_hits",
            "Prompt tokens the instance found in its prefix cache (its vllm:prefix_cache_hits_total, or "
            "sglang:cached_tokens_total).",
            labels=lbl)
        rate = GaugeMetricFamily(
            "prefixroute_backend_prefix_cache_hit_rate",
            "Cached prompt tokens / prompt tokens on the instance since it started (hits / queries).",
            labels=lbl)
        fleet = GaugeMetricFamily(
            "prefixroute_fleet_prefix_cache_hit_rate",
            "Cached prompt tokens / prompt tokens over every scraped instance reporting both (sum of hits / sum of "
            "queries).")
        running = GaugeMetricFamily(
            "prefixroute_backend_requests_running",
            "Requests the instance reports running (vllm:num_requests_running, sglang:num_running_reqs).", labels=lbl)
        waiting = GaugeMetricFamily(
            "prefixroute_backend_requests_waiting",
            "Requests the instance reports queued (vllm:num_requests_waiting, sglang:num_queue_reqs).", labels=lbl)
        restarts = GaugeMetricFamily(
            "prefixroute_backend_restarts_seen",
            "Engine restarts this router process has seen since it started: scrapes that found the instance's "
            "prefix-cache counters lower than before (each clears CACHE_AWARE's view of its cache). A gauge: with "
            "--workers N, the count of the worker that answers (a restarted worker starts from 0).",
            labels=lbl)
        ok = GaugeMetricFamily(
            "prefixroute_backend_scrape_ok", "1 if the latest scrape of the instance's /metrics succeeded, else 0.",
            labels=lbl)
        total_q = total_h = 0.0
        for instance, s in sorted(self._stats().items()):
            labels = (instance,)
            ok.add_metric(labels, 1.0 if s.ok else 0.0)
            restarts.add_metric(labels, s.restarts)
            if s.prefix_cache_queries is not None:
                queries.add_metric(labels, s.prefix_cache_queries)
            if s.prefix_cache_hits is not None:
                hits.add_metric(labels, s.prefix_cache_hits)
            if s.prefix_cache_queries is not None and s.prefix_cache_hits is not None:
                total_q += s.prefix_cache_queries  # (an engine without a hits counter: its rate is unknown)
                total_h += s.prefix_cache_hits
            if s.hit_rate is not None:
                rate.add_metric(labels, s.hit_rate)
            if s.requests_running is not None:
                running.add_metric(labels, s.requests_running)
            if s.requests_waiting is not None:
                waiting.add_metric(labels, s.requests_waiting)
        if total_q > 0:
            fleet.add_metric((), total_h / total_q)
        return [queries, hits, rate, fleet, running, waiting, restarts, ok]


def use_multiprocess_values(path: str) -> None:
    """Keep every counter and histogram made from now on in prometheus-client's
    per-process files under ``path`` (its multiprocess mode), for this whole process.
    Call it in a worker process of ``serve --workers N`` before any metric is made."""
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = path
    # The process id read once, not on every increment (prometheus-client's default
    # calls os.getpid(), a system call, to notice a fork: workers are spawned and
    # never fork). Distinct in every running worker, as the parameter requires.
    pid = os.getpid()
    values.ValueClass = values.MultiProcessValue(process_identifier=lambda: pid)


class _LoopValue:
    """prometheus-client's ``MutexValue`` without its lock: a single-process router
    touches its metrics from its event loop's thread only, so the lock (taken on every
    increment, 10 times per request) buys nothing. Same methods, same results."""

    __slots__ = ("_value", "_exemplar")

    def __init__(self) -> None:
        self._value = 0.0
        self._exemplar: Any = None

    def inc(self, amount: float) -> None:
        self._value += amount

    def set(self, value: float, timestamp: float | None = None) -> None:
        self._value = value

    def set_exemplar(self, exemplar: Any) -> None:
        self._exemplar = exemplar

    def get(self) -> float:
        return self._value

    def get_exemplar(self) -> Any:
        return self._exemplar


class _FastCounter:
    """A counter child's ``inc`` on a :class:`_LoopValue`."""

    __slots__ = ("_value",)

    def __init__(self, value: _LoopValue) -> None:
        self._value = value

    def inc(self, amount: float = 1.0) -> None:
        self._value._value += amount


class _FastHistogram:
    """A histogram child's ``observe``: the bucket found by bisection (prometheus-client
    walks the bounds one by one) on :class:`_LoopValue` s. ``bounds`` end with +Inf."""

    __slots__ = ("_sum", "_buckets", "_bounds")

    def __init__(self, sum_: _LoopValue, buckets: list[_LoopValue], bounds: list[float]) -> None:
        self._sum, self._buckets, self._bounds = sum_, buckets, bounds

    def observe(self, amount: float) -> None:
        self._sum._value += amount
        self._buckets[bisect_left(self._bounds, amount)]._value += 1.0


class _MmapValue:
    """A multiprocess value's ``inc`` without its lock and fork check (one event-loop
    thread per worker, workers never fork): the sum kept in the value and written to
    its slot of the worker's file, as prometheus-client's ``MmapedValue.inc`` does."""

    __slots__ = ("_v",)

    def __init__(self, value: Any) -> None:
        self._v = value

    @property
    def _value(self) -> float:
        return float(self._v._value)

    @_value.setter
    def _value(self, total: float) -> None:
        v = self._v
        v._value = total
        v._timestamp = 0.0
        v._file.write_value(v._key, total, 0.0)


def _fast_mmap(child: Any) -> Any:
    """A multiprocess Counter or Histogram child with :class:`_MmapValue` s behind the
    fast ``inc``/``observe``; ``child`` itself if prometheus-client's internals differ."""
    try:
        if isinstance(child, Counter):
            child._value._file, child._value._key  # noqa: B018  (the attributes _MmapValue uses)
            return _FastCounter(_MmapValue(child._value))  # type: ignore[arg-type]
        if isinstance(child, Histogram):
            bounds = list(child._upper_bounds)
            if len(child._buckets) != len(bounds) or bounds[-1] != float("inf"):
                return child
            for v in (child._sum, *child._buckets):
                v._file, v._key  # noqa: B018
            return _FastHistogram(_MmapValue(child._sum), [_MmapValue(b) for b in child._buckets],  # type: ignore[arg-type]
                                  bounds)
    except AttributeError:
        return child
    return child


def _fast(child: Any) -> Any:
    """``child`` with lock-free values and a fast ``inc``/``observe``, when it is a
    fresh single-process Counter or Histogram child (multiprocess values:
    :func:`_fast_mmap`); else ``child`` itself (a prometheus-client whose internals
    differ)."""
    if getattr(values.ValueClass, "_multiprocess", False):
        return _fast_mmap(child)
    try:
        if isinstance(child, Counter) and child._value.get() == 0:
            child._value = _LoopValue()
            return _FastCounter(child._value)
        if isinstance(child, Histogram) and child._sum.get() == 0:
            bounds = list(child._upper_bounds)
            if len(child._buckets) != len(bounds) or bounds[-1] != float("inf"):
                return child
            child._sum = _LoopValue()
            child._buckets = [_LoopValue() for _ in bounds]
            return _FastHistogram(child._sum, child._buckets, bounds)
    except AttributeError:
        return child
    return child


class _Labelled:
    """A labelled metric whose children are looked up once: ``labels(...)`` of
    prometheus-client takes a lock and validates the values on every call (several
    microseconds, several times per request); label values here come from the
    configuration, so the set of children is small and they are kept in a dict."""

    __slots__ = ("metric", "_children")

    def __init__(self, metric: Any) -> None:
        self.metric = metric
        self._children: dict[tuple[str, ...], Any] = {}

    def labels(self, *values: str) -> Any:
        child = self._children.get(values)
        if child is None:
            child = self._children[values] = _fast(self.metric.labels(*values))
        return child


class _KvEventsCollector(Collector):
    """Precise mode, per instance: its mode and the health of its event stream, read from
    the :class:`~prefixroute.core.kvevents.view.PreciseCacheView` at scrape time."""

    def __init__(self, view: Callable[[], Any]) -> None:
        self._view = view

    def collect(self) -> Iterable[Metric]:
        view = self._view()
        if view is None:
            return []
        import time

        lbl = ("instance",)
        precise = GaugeMetricFamily(
            "prefixroute_kv_events_precise",
            "1 if the router routes on the instance's own KV events (precise mode), 0 if it falls back to its "
            "learned, approximate state (stream not connected, or repairing a gap).", labels=lbl)
        connected = GaugeMetricFamily("prefixroute_kv_events_connected",
                                      "1 if the instance's KV-event stream is connected.", labels=lbl)
        blocks = GaugeMetricFamily("prefixroute_kv_events_blocks",
                                   "Distinct KV blocks the instance holds (GPU and CPU tiers), from its events.",
                                   labels=lbl)
        shared = GaugeMetricFamily("prefixroute_kv_events_shared_tier_blocks",
                                   "KV blocks in the tier shared by every instance, from the events.")
        counters = {name: CounterMetricFamily(f"prefixroute_kv_events_{name}", doc, labels=lbl) for name, doc in (
            ("messages", "KV-event messages received."),
            ("gaps", "Gaps in the instance's event sequence numbers (lost messages)."),
            ("replays", "Replays asked of the instance to repair a gap or catch up."),
            ("replays_failed", "Replays that failed, timed out or no longer reached the gap."),
            ("resets", "Times the instance's state was forgotten (restart, unrepairable gap)."),
            ("restarts", "Engine restarts seen (the sequence number went back)."),
        )}
        rejected = CounterMetricFamily(
            "prefixroute_kv_events_rejected",
            "What the router could not use, by kind: malformed_message, malformed_event, unknown_event, "
            "orphaned_block (its parent was never seen).", labels=("instance", "kind"))
        for st in view.status(time.monotonic()):
            labels = (st.instance,)
            precise.add_metric(labels, 1.0 if st.mode == "precise" else 0.0)
            connected.add_metric(labels, 1.0 if st.connected else 0.0)
            blocks.add_metric(labels, st.blocks)
            for name, family in counters.items():
                family.add_metric(labels, getattr(st, name))
            for kind, value in (("malformed_message", st.malformed_messages), ("malformed_event", st.malformed_events),
                                ("unknown_event", st.unknown_events), ("orphaned_block", st.orphaned)):
                rejected.add_metric((st.instance, kind), value)
        shared.add_metric((), len(view.shared))
        return [precise, connected, blocks, shared, *counters.values(), rejected]


class RouterMetrics:
    """The router's metrics and the registry that exports them.

    Args:
        fleet: returns the current :class:`Fleet` (it changes on reconfiguration).
        backend_stats: returns the latest scraped engine metrics per instance URL.
        multiprocess_dir: ``serve --workers N``: the directory given to
            :func:`use_multiprocess_values`; :meth:`render` then sums the counters and
            histograms of every process that wrote there.
        kv_view: returns precise mode's view, or ``None`` when it is off (the
            ``prefixroute_kv_events_*`` families; with several workers, those of the
            worker that answers: each subscribes on its own).
        catalog: returns the router's :class:`~prefixroute.core.catalog.ModelCatalog`
            (the ``prefixroute_adapter_sticky_set_size`` gauge), or ``None``.

    Raises:
        RuntimeError: ``multiprocess_dir`` without :func:`use_multiprocess_values`.
    """

    def __init__(self, fleet: Callable[[], Fleet],
                 backend_stats: Callable[[], Mapping[str, BackendStats]] = dict,
                 multiprocess_dir: str | None = None, kv_view: Callable[[], Any] = lambda: None,
                 catalog: Callable[[], Any] = lambda: None) -> None:
        if multiprocess_dir is not None and not getattr(values.ValueClass, "_multiprocess", False):
            raise RuntimeError("RouterMetrics(multiprocess_dir=...) needs use_multiprocess_values() first")
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = _Labelled(Counter(
            "prefixroute_requests", "Requests routed, per instance and decision kind.",
            ("endpoint", "variant", "instance", "decision"), registry=r))
        self.responses = _Labelled(Counter(
            "prefixroute_responses",
            "Responses per status code the client received in full (499 = the client went away; "
            "stream_aborted = the instance failed or went silent after the status was sent).",
            ("endpoint", "variant", "code"), registry=r))
        self.upstream_errors = _Labelled(Counter(
            "prefixroute_upstream_errors",
            "Failures talking to an instance: connect, send, reset, disconnect, headers_timeout, idle_timeout, "
            "http_5xx, no_done (an SSE stream ended without data: [DONE]), stale_connection (a kept-alive "
            "connection failed as the request went out; sent again), invalid_response (not HTTP for the request), "
            "http_429 and http_503 (answers --retry-status retried elsewhere).",
            ("instance", "kind"), registry=r))
        self.retries = _Labelled(Counter(
            "prefixroute_retries",
            "Requests retried on another instance: the first could not have started them (reason: connect, "
            "send), a kept-alive connection failed before any answer (reason: stale_connection), or it "
            "answered 429/503 with --retry-status (reason: http_429, http_503).",
            ("endpoint", "variant", "reason"), registry=r))
        self.decision_seconds = _Labelled(Histogram(
            "prefixroute_routing_decision_seconds", "Time of one routing decision, seconds.",
            ("endpoint", "variant"), buckets=_DECISION_BUCKETS, registry=r))
        self.ttft_seconds = _Labelled(Histogram(
            "prefixroute_ttft_seconds",
            "Router-observed time to first token: request received to first response body byte "
            "from the instance, seconds.",
            ("endpoint", "variant"), buckets=_TTFT_BUCKETS, registry=r))
        self.duration_seconds = _Labelled(Histogram(
            "prefixroute_request_duration_seconds", "End-to-end request duration at the router, seconds.",
            ("endpoint", "variant"), buckets=_DURATION_BUCKETS, registry=r))
        self.overhead_seconds = _Labelled(Histogram(
            "prefixroute_router_overhead_seconds",
            "Router time per request: entry to upstream send, plus upstream headers to our headers, seconds.",
            ("endpoint", "variant"), buckets=_OVERHEAD_BUCKETS, registry=r))
        self.client_requests = _Labelled(Counter(
            "prefixroute_client_requests",
            "Requests per client API key and outcome: admitted, unauthorized (client 'unknown'), rate_limited, "
            "concurrency_limited, tenant_rate_limited, tenant_concurrency_limited.",
            ("client", "tenant", "outcome"), registry=r))
        self.component_requests = _Labelled(Counter(
            "prefixroute_component_requests",
            "Requests routed to an inference component, per copy (instance) that served it.",
            ("endpoint", "component", "instance"), registry=r))
        self.adapter_requests = _Labelled(Counter(
            "prefixroute_adapter_requests", "Requests routed for a LoRA adapter, per instance of its sticky set.",
            ("endpoint", "adapter", "instance"), registry=r))
        self.adapter_loads = _Labelled(Counter(
            "prefixroute_adapter_loads",
            "LoRA adapter loads the router asked of an instance (LoraAdapters.Autoload), by result: ok, failed.",
            ("instance", "adapter", "result"), registry=r))
        self.adapter_unloads = _Labelled(Counter(
            "prefixroute_adapter_unloads",
            "LoRA adapter unloads the router asked of an instance to free a slot, by result: ok, failed.",
            ("instance", "adapter", "result"), registry=r))
        self.adapter_load_seconds = _Labelled(Histogram(
            "prefixroute_adapter_load_seconds", "Time of one adapter load (and the unload before it), seconds.",
            ("instance",), buckets=_DURATION_BUCKETS, registry=r))
        #: Called before each :meth:`render`: the data plane's metrics not recorded yet
        #: (:meth:`prefixroute.server.dataplane.FrontServer.account`).
        self.pending: list[Callable[[], None]] = []
        #: Several processes write these metrics (``serve --workers N``): a scrape
        #: answered by one of them cannot record what the others have pending.
        self.multiprocess = multiprocess_dir is not None
        pool_collector, backend_collector = _PoolCollector(fleet), _BackendCollector(backend_stats)
        kv_collector = _KvEventsCollector(kv_view)
        catalog_collector = _CatalogCollector(catalog)
        r.register(pool_collector)
        r.register(backend_collector)
        r.register(kv_collector)
        r.register(catalog_collector)
        # What /metrics shows: this registry, or (several workers) every worker's files.
        self._exposed = r
        if multiprocess_dir is not None:
            from prometheus_client.multiprocess import MultiProcessCollector

            self._exposed = CollectorRegistry()
            MultiProcessCollector(self._exposed, path=multiprocess_dir)
            self._exposed.register(pool_collector)
            self._exposed.register(backend_collector)
            self._exposed.register(kv_collector)
            self._exposed.register(catalog_collector)

    def client_outcome(self, client: str, tenant: str, outcome: str) -> None:
        """Count one API key decision (``prefixroute_client_requests_total``)."""
        self.client_requests.labels(client, tenant, outcome).inc()

    def add_collector(self, collector: Collector) -> None:
        """Export ``collector``'s metrics too (in every worker's ``/metrics`` with
        ``--workers N``: read from the worker that answers)."""
        self.registry.register(collector)
        if self._exposed is not self.registry:
            self._exposed.register(collector)

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        for account in self.pending:
            account()
        return generate_latest(self._exposed)
