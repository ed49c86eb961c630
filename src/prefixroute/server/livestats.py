"""Counters behind the live status page: per production variant and per instance.

:class:`LiveStats` is fed once per request as it ends
(:meth:`prefixroute.server.observe.Observers.finished`, and
:meth:`~prefixroute.server.observe.Observers.refused` for the router's own answers
before routing) and read by ``GET /admin/status.json``
(:mod:`prefixroute.server.status`). It keeps totals since the process started (the
page turns them into rates by comparing two reads), the TTFT of the last
:data:`TTFT_SAMPLES` requests (percentiles over a recent window, not since start) and
the last :data:`RECENT_ERRORS` errors of each variant. Memory is bounded by the
configured instances: the stats of instances and variants that leave the configuration
are dropped (:meth:`LiveStats.retain`).

Pure bookkeeping, no I/O. Times of errors are wall-clock (``time.time()``), for a
person to read.
"""

from __future__ import annotations

import math
import time
from collections import Counter, deque
from typing import Any, Iterable, Sequence

__all__ = ["LiveStats", "VariantStats", "InstanceStats", "percentiles", "code_class", "TTFT_SAMPLES",
           "RECENT_ERRORS"]

#: TTFT samples kept per instance and per variant (the window of the percentiles).
TTFT_SAMPLES = 1000
#: Errors kept per variant, newest last.
RECENT_ERRORS = 20


def code_class(code: int | str) -> str:
    """The column a response code is counted in: ``2xx``, ``3xx``, ``4xx``, ``5xx``, or the
    code itself for ``499`` (the client left) and ``stream_aborted``."""
    if isinstance(code, str):
        if not code.isdigit():
            return code
        code = int(code)
    if code == 499:
        return "499"
    return f"{code // 100}xx" if 100 <= code < 600 else str(code)


def percentiles(samples: Iterable[float], qs: Sequence[float] = (0.5, 0.9, 0.99)) -> dict[str, float | int | None]:
    """Nearest-rank percentiles of ``samples`` (seconds in, seconds out), as
    ``{"p50": ..., "p90": ..., "p99": ..., "n": count}``; ``None`` for each when there is
    no sample. Nearest rank: the smallest sample with at least q of them at or below it."""
    ordered = sorted(samples)
    n = len(ordered)
    out: dict[str, float | int | None] = {}
    for q in qs:
        key = f"p{q * 100:g}"
        out[key] = ordered[min(n - 1, max(0, math.ceil(q * n - 1e-9) - 1))] if n else None
    out["n"] = n
    return out


def _is_error(code: int | str) -> bool:
    return isinstance(code, str) or code >= 400


class InstanceStats:
    """Totals of one instance within one production variant since the process started."""

    __slots__ = ("requests", "decisions", "responses", "ttft", "bytes_out", "retried_from")

    def __init__(self) -> None:
        self.requests = 0  # requests it was chosen for (the last attempt's instance)
        self.decisions: Counter[str] = Counter()
        self.responses: Counter[str] = Counter()
        self.ttft: deque[float] = deque(maxlen=TTFT_SAMPLES)
        self.bytes_out = 0
        self.retried_from = 0  # attempts that failed on it and went on to another instance

    def document(self, raw: bool = False) -> dict[str, Any]:
        doc: dict[str, Any] = {"requests": self.requests, "decisions": dict(self.decisions),
                               "responses": dict(self.responses), "ttft": percentiles(self.ttft),
                               "bytes_out": self.bytes_out}
        if raw:
            doc["ttft_samples"] = list(self.ttft)
        return doc


class VariantStats:
    """Totals of one production variant since the process started."""

    __slots__ = ("requests", "refused", "responses", "decisions", "retries", "ttft", "errors", "instances")

    def __init__(self) -> None:
        self.requests = 0  # routed and ended (an instance was chosen, or none could be)
        self.refused = 0  # answered by the router before routing (400, 413, 429...)
        self.responses: Counter[str] = Counter()
        self.decisions: Counter[str] = Counter()
        self.retries = 0
        self.ttft: deque[float] = deque(maxlen=TTFT_SAMPLES)
        self.errors: deque[dict[str, Any]] = deque(maxlen=RECENT_ERRORS)
        self.instances: dict[str, InstanceStats] = {}

    def instance(self, url: str) -> InstanceStats:
        stats = self.instances.get(url)
        if stats is None:
            stats = self.instances[url] = InstanceStats()
        return stats


class LiveStats:
    """Every variant's :class:`VariantStats`, keyed by ``(endpoint, variant)``."""

    def __init__(self) -> None:
        self.variants: dict[tuple[str, str], VariantStats] = {}
        #: Errors of requests that matched no configured variant (unknown endpoint...).
        self.unrouted_errors: deque[dict[str, Any]] = deque(maxlen=RECENT_ERRORS)
        self.started = time.time()

    def variant(self, endpoint: str, variant: str) -> VariantStats:
        key = (endpoint, variant)
        stats = self.variants.get(key)
        if stats is None:
            stats = self.variants[key] = VariantStats()
        return stats

    def routed(self, endpoint: str, variant: str, instance: str | None, kind: str | None, code: int | str,
               ttft_s: float | None, bytes_out: int, retries: int, error: str | None, request_id: str) -> None:
        """A routed request ended with ``code`` (status, ``499``, ``stream_aborted``).

        Args:
            instance: the instance of its last attempt, or ``None`` (none was chosen).
            kind: its decision kind (``affinity``...), or ``None``.
            ttft_s: seconds from its arrival to the first byte of the answer, or ``None``.
            bytes_out: answer body bytes relayed.
            retries: attempts after the first.
            error: the kind of the last upstream failure, or ``None``.
        """
        v = self.variant(endpoint, variant)
        v.requests += 1
        cls = code_class(code)
        v.responses[cls] += 1
        v.retries += retries
        if kind is not None:
            v.decisions[kind] += 1
        if ttft_s is not None:
            v.ttft.append(ttft_s)
        if instance is not None:
            i = v.instance(instance)
            i.requests += 1
            i.responses[cls] += 1
            i.bytes_out += bytes_out
            if kind is not None:
                i.decisions[kind] += 1
            if ttft_s is not None:
                i.ttft.append(ttft_s)
        if _is_error(code) or error is not None:
            v.errors.append({"time": time.time(), "instance": instance, "code": str(code), "kind": error,
                             "request_id": request_id})

    def refused(self, endpoint: str, variant: str, code: int, message: str, request_id: str | None) -> None:
        """The router answered ``code`` itself before routing (``message`` is its own
        text: it never quotes the request). ``variant`` is ``""`` when none was chosen."""
        entry = {"time": time.time(), "instance": None, "code": str(code), "kind": "refused",
                 "message": message[:300], "request_id": request_id}
        if (endpoint, variant) in self.variants or variant:
            v = self.variant(endpoint, variant)
            v.refused += 1
            v.responses[code_class(code)] += 1
            if code >= 400:
                v.errors.append(entry)
        elif code >= 400:
            self.unrouted_errors.append({**entry, "endpoint": endpoint})

    def retain(self, keep: Iterable[tuple[str, str, str]]) -> None:
        """Drop the stats of variants and instances not in ``keep`` (``(endpoint,
        variant, instance)`` of the configuration in force)."""
        wanted: dict[tuple[str, str], set[str]] = {}
        for endpoint, variant, instance in keep:
            wanted.setdefault((endpoint, variant), set()).add(instance)
        for key in [k for k in self.variants if k not in wanted]:
            del self.variants[key]
        for key, v in self.variants.items():
            for url in [u for u in v.instances if u not in wanted[key]]:
                del v.instances[url]
