"""The results of ``bench/overhead.py``: one measurement (:class:`Measurement`, a wrk run
with the router's CPU and memory and the backend's counters), and the measurements of a
(cell, target) over its rounds (:class:`CellResult`, from :func:`aggregate`): medians,
latency added over direct, and ratios to the reference routers.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Sequence

from overhead_settings import Cell
from wrk_load import WrkResult

if TYPE_CHECKING:
    from overhead import Target

#: The label ratios of added latency are taken against, and the one of requests/s.
LATENCY_REFERENCE = "haproxy hash-balance-factor"
THROUGHPUT_REFERENCE = "sglang-router cache_aware"
#: The label of the backend measured without a router, which added latency is taken over.
DIRECT = "direct"


@dataclass
class Measurement:
    """One wrk run against one target in one cell and round (``round`` counts from 1,
    as the progress lines do), with the router's CPU and memory and the backend's view
    of it."""

    target: str
    round: int
    cell: Cell
    wrk: WrkResult
    router_cpu_s: float | None
    router_peak_rss_bytes: int | None
    peak_rss_reset: bool
    backend_cpu_s: float
    instance_requests: list[int]
    backend_requests: int
    backend_unknown: dict[str, int]
    #: For a direct measurement taken right before one router's (paired direct), that
    #: router's label; None for the round's own direct measurement and for routers.
    paired_with: str | None = None
    #: For a precise router: each instance's mode after the run and the share of the
    #: run's requests matched on the events (``overhead.precise_check``); else ``None``.
    precise: dict[str, Any] | None = None

    @property
    def router_cpu_us_per_request(self) -> float | None:
        if self.router_cpu_s is None or self.wrk.requests == 0:
            return None
        return self.router_cpu_s / self.wrk.requests * 1e6

    @property
    def backend_cpu_us_per_request(self) -> float | None:
        return self.backend_cpu_s / self.wrk.requests * 1e6 if self.wrk.requests else None

    def to_json(self) -> dict[str, Any]:
        return {"label": self.target, "round": self.round, "concurrency": self.cell.concurrency,
                "body_bytes": self.cell.body_bytes, "stream": self.cell.stream, "requests": self.wrk.requests,
                "duration_s": self.wrk.duration_s, "throughput_rps": self.wrk.rps, "p50_latency_ms": self.wrk.p50_ms,
                "p90_latency_ms": self.wrk.p90_ms, "p99_latency_ms": self.wrk.p99_ms,
                "mean_latency_ms": self.wrk.mean_ms, "max_latency_ms": self.wrk.max_ms, "errors": self.wrk.errors,
                "error_count": self.wrk.error_count, "router_cpu_s": self.router_cpu_s,
                "router_cpu_us_per_request": self.router_cpu_us_per_request,
                "router_peak_rss_bytes": self.router_peak_rss_bytes,
                "peak_rss_scope": None if self.router_peak_rss_bytes is None else
                "this measurement" if self.peak_rss_reset else "since the router started",
                "backend_cpu_s": self.backend_cpu_s, "backend_cpu_us_per_request": self.backend_cpu_us_per_request,
                "backend_requests": self.backend_requests, "instance_requests": self.instance_requests,
                "backend_unknown_requests": self.backend_unknown, "paired_with": self.paired_with,
                **({"precise": self.precise} if self.precise is not None else {})}



def _median(xs: Sequence[float | None]) -> float | None:
    vals = [x for x in xs if x is not None]
    return statistics.median(vals) if vals else None


@dataclass
class CellResult:
    """One (cell, target) over its rounds: medians, and the differences to direct."""

    target: Target
    cell: Cell
    rounds: list[Measurement]
    added_p50_ms: float | None = None
    added_p99_ms: float | None = None
    added_vs_haproxy: float | None = None
    rps_vs_sglang: float | None = None
    #: Added p50 of each round (round -> ms), router minus direct in that round.
    added_p50_by_round: dict[int, float] = field(default_factory=dict)
    #: The same ratios round by round (one entry per round of this target, in round
    #: order), each against the reference's figure of that round; ``None`` for a round
    #: where either is missing or HAProxy's added p50 is not positive (no ratio).
    added_vs_haproxy_rounds: list[float | None] = field(default_factory=list)
    rps_vs_sglang_rounds: list[float | None] = field(default_factory=list)

    @property
    def p50_ms(self) -> float | None:
        """Median p50 over the rounds that completed a request (None if none did)."""
        return _median([m.wrk.p50_ms for m in self.rounds if m.wrk.requests])

    @property
    def p99_ms(self) -> float | None:
        return _median([m.wrk.p99_ms for m in self.rounds if m.wrk.requests])

    @property
    def rounds_without_reply(self) -> int:
        """Rounds in which not one response completed (wrk counts those still in flight
        at the end neither as requests nor as errors; direct, measured several times a
        round at low concurrency: rounds in which none of its runs completed one)."""
        replied: dict[int, bool] = {}
        for m in self.rounds:
            replied[m.round] = replied.get(m.round, False) or m.wrk.requests > 0
        return sum(1 for ok in replied.values() if not ok)

    @property
    def round_count(self) -> int:
        """Rounds measured (``len(self.rounds)`` counts runs: direct has several a round
        in cells with paired direct runs)."""
        return len({m.round for m in self.rounds})

    @property
    def rps(self) -> float:
        return statistics.median(m.wrk.rps for m in self.rounds)

    @property
    def cpu_us_per_request(self) -> float | None:
        return _median([m.router_cpu_us_per_request for m in self.rounds])

    @property
    def peak_rss_bytes(self) -> int | None:
        vals = [m.router_peak_rss_bytes for m in self.rounds if m.router_peak_rss_bytes is not None]
        return max(vals) if vals else None

    @property
    def errors(self) -> int:
        return sum(m.wrk.error_count for m in self.rounds)

    @property
    def requests(self) -> int:
        return sum(m.wrk.requests for m in self.rounds)

    def to_json(self) -> dict[str, Any]:
        """SPEC §7 run fields (TTFT and cache-hit rate null: not measured here) plus the
        overhead figures."""
        inst = [sum(m.instance_requests[i] for m in self.rounds) for i in range(len(self.rounds[0].instance_requests))]
        total = sum(inst)
        return {
            "router": self.target.router, "strategy": self.target.strategy, "replicas": 1,
            "requests": self.requests, "errors": self.errors, "p50_ttft_s": None, "p90_ttft_s": None,
            "p50_latency_s": None if self.p50_ms is None else self.p50_ms / 1000, "cache_hit_rate": None,
            "throughput_rps": self.rps,
            "instance_share": [n / total for n in inst] if total and self.target.pid is not None else [],
            "label": self.target.label, "workers": self.target.workers, "concurrency": self.cell.concurrency,
            "body_bytes": self.cell.body_bytes, "stream": self.cell.stream, "rounds": self.round_count,
            "runs": len(self.rounds),
            "p99_latency_s": None if self.p99_ms is None else self.p99_ms / 1000,
            "rounds_without_reply": self.rounds_without_reply,
            "added_p50_ms": self.added_p50_ms, "added_p99_ms": self.added_p99_ms,
            "added_p50_vs_haproxy": self.added_vs_haproxy, "throughput_vs_sglang_router": self.rps_vs_sglang,
            "added_p50_vs_haproxy_rounds": self.added_vs_haproxy_rounds,
            "throughput_vs_sglang_router_rounds": self.rps_vs_sglang_rounds,
            "router_cpu_us_per_request": self.cpu_us_per_request, "router_peak_rss_bytes": self.peak_rss_bytes,
        }


def _median_run(runs: Sequence[Measurement]) -> Measurement | None:
    """The run of median p50 (the lower middle one of an even count), or None if none."""
    if not runs:
        return None
    return sorted(runs, key=lambda m: m.wrk.p50_ms)[(len(runs) - 1) // 2]


def aggregate(measurements: Sequence[Measurement], targets: Sequence[Target]) -> list[CellResult]:
    """Group measurements by (cell, target) and compute added latency (median over rounds
    of router minus direct in the same round: the direct run right before the router's
    when there is one, see ``paired_direct_up_to``) and the ratios to the reference routers:
    of the medians, and round by round (each round's figure against the reference's
    figure of the same round)."""
    by_target = {t.label: t for t in targets}
    groups: dict[tuple[Cell, str], list[Measurement]] = {}
    for m in measurements:
        groups.setdefault((m.cell, m.target), []).append(m)
    out: list[CellResult] = []
    for (cell, label), ms in groups.items():
        if label not in by_target:
            continue
        cr = CellResult(by_target[label], cell, sorted(ms, key=lambda m: m.round))
        direct = {(m.round, m.paired_with): m for m in groups.get((cell, DIRECT), [])}
        if label != DIRECT and direct:
            # Each router against the direct run right before it (paired), else its round's
            # (unpaired cells), else, its paired run having failed, the round's median one.
            base = {m.round: direct.get((m.round, label)) or direct.get((m.round, None))
                    or _median_run([d for (r, _), d in direct.items() if r == m.round and d.wrk.requests])
                    for m in ms}
            paired = [(m, base[m.round]) for m in ms
                      if base[m.round] is not None and m.wrk.requests and base[m.round].wrk.requests]
            cr.added_p50_by_round = {m.round: m.wrk.p50_ms - d.wrk.p50_ms for m, d in paired}
            d99 = [m.wrk.p99_ms - d.wrk.p99_ms for m, d in paired]
            cr.added_p50_ms, cr.added_p99_ms = _median(list(cr.added_p50_by_round.values())), _median(d99)
        out.append(cr)
    for cr in out:
        ref = next((r for r in out if r.cell == cr.cell and r.target.label == LATENCY_REFERENCE), None)
        if ref is not None and cr.added_p50_ms is not None and ref.added_p50_ms and ref.added_p50_ms > 0:
            cr.added_vs_haproxy = cr.added_p50_ms / ref.added_p50_ms
        if ref is not None and cr.added_p50_by_round:
            theirs_added = ref.added_p50_by_round
            cr.added_vs_haproxy_rounds = [
                cr.added_p50_by_round[m.round] / theirs_added[m.round]
                if m.round in cr.added_p50_by_round and theirs_added.get(m.round, 0) > 0 else None
                for m in cr.rounds]
        ref = next((r for r in out if r.cell == cr.cell and r.target.label == THROUGHPUT_REFERENCE), None)
        if ref is not None and ref.rps > 0:
            cr.rps_vs_sglang = cr.rps / ref.rps
        if ref is not None:  # one entry per round (direct, measured several times a round: their median)
            theirs = {m.round: m.wrk.rps for m in ref.rounds}
            ours: dict[int, list[float]] = {}
            for m in cr.rounds:
                ours.setdefault(m.round, []).append(m.wrk.rps)
            cr.rps_vs_sglang_rounds = [statistics.median(v) / theirs[r] if theirs.get(r, 0) > 0 else None
                                       for r, v in ours.items()]
    order = {t.label: i for i, t in enumerate(targets)}
    out.sort(key=lambda r: (r.cell.stream, r.cell.body_bytes, r.cell.concurrency, order[r.target.label]))
    return out
