"""The tuning advisor: replay a trace over a grid of PrefixLength × ConcurrencyThreshold.

Each point of the grid is one simulation of the whole trace (:mod:`.simulator`), plus
one run each of RANDOM and LEAST_OUTSTANDING_REQUESTS as baselines. Runs are
independent and spread over processes.

How the recommendation is chosen (:func:`recommend`), and why:

1. Only PREFIX_AWARE settings whose P90 TTFT is within 5 % of the best P90 of the grid
   are kept: the tail is what a user of a loaded fleet feels, and it is where both
   failure modes show (too short a PrefixLength piles traffic onto few instances and
   queues it; too long a one or too low a threshold scatters requests that share a
   cache, so they prefill again).
2. Among those, the highest cache-hit rate (within half a point counts as equal); then
   the lowest busiest-instance share (even load leaves headroom); then the shortest
   PrefixLength (less of the request takes part, so differences late in a prompt never
   split a cache) and the highest ConcurrencyThreshold (fewer overflows when traffic
   shifts).
3. If even that setting's P90 is worse than the best baseline's, the baseline is
   recommended instead: prefix-aware routing does not pay on this traffic.

The reasons printed compare the choice with its neighbours on the grid (half and twice
the PrefixLength, half and twice the threshold) and with the baselines.
"""

from __future__ import annotations

import math
import multiprocessing
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

from prefixroute.core.config import RoutingConfig, RoutingStrategy
from prefixroute.engine.model import EngineConfig

__all__ = ["GridPoint", "Recommendation", "TuneResult", "run_grid", "recommend", "write_tune_plot",
           "DEFAULT_PREFIX_LENGTHS", "DEFAULT_THRESHOLDS"]

#: PrefixLength values tried by default, characters (SageMaker's range is 1,024-65,536).
DEFAULT_PREFIX_LENGTHS = (1024, 2048, 4096, 8192, 16384, 32768)
#: ConcurrencyThreshold values tried by default.
DEFAULT_THRESHOLDS = (2, 4, 8, 16, 32)
_P90_SLACK = 0.05  # settings within 5 % of the best P90 count as equally fast
_HIT_SLACK = 0.005  # hit rates within half a point count as equal


@dataclass
class GridPoint:
    """One run of the grid (PREFIX_AWARE) or a baseline (``prefix_length`` None).

    Attributes:
        strategy: the strategy's name.
        prefix_length, concurrency_threshold: the PREFIX_AWARE settings, or None.
        summary: the run's :class:`prefixroute.demo.report.RunSummary` (model seconds).
    """

    strategy: str
    prefix_length: int | None
    concurrency_threshold: int | None
    summary: Any

    @property
    def label(self) -> str:
        if self.prefix_length is None:
            return self.strategy
        return f"PREFIX_AWARE {self.prefix_length}/{self.concurrency_threshold}"

    @property
    def busiest_share(self) -> float:
        """The largest fraction of requests any instance served."""
        return max(self.summary.instance_share, default=0.0)

    def row(self) -> dict[str, Any]:
        """The point as a flat dict (the ``grid`` entries of the JSON)."""
        s = self.summary
        return {"strategy": self.strategy, "prefix_length": self.prefix_length,
                "concurrency_threshold": self.concurrency_threshold, "cache_hit_rate": s.cache_hit_rate,
                "p50_ttft_s": s.p50_ttft_s, "p90_ttft_s": s.p90_ttft_s, "overflow_rate": s.overflow_rate,
                "busiest_instance_share": self.busiest_share, "throughput_rps": s.throughput_rps,
                "requests": s.requests, "errors": s.errors}


@dataclass
class Recommendation:
    """The advice: a setting and the reasons for it.

    Attributes:
        point: the recommended run (a grid point or a baseline).
        reasons: one sentence each, most important first.
    """

    point: GridPoint
    reasons: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {"strategy": self.point.strategy, "prefix_length": self.point.prefix_length,
                "concurrency_threshold": self.point.concurrency_threshold, "reasons": self.reasons}


@dataclass
class TuneResult:
    """Every run of a tuning grid and the recommendation."""

    workload: str
    baselines: list[GridPoint]
    grid: list[GridPoint]
    recommendation: Recommendation


# -- running the grid ---------------------------------------------------------------------

_WORKLOAD: Any = None  # the loaded trace, shared with forked worker processes


def _run_point(job: tuple[str, int | None, int | None, dict[str, Any]]) -> GridPoint:
    from prefixroute.sim.simulator import SimConfig, simulate

    strategy, pl, ct, kw = job
    st = RoutingStrategy.parse(strategy)
    routing = RoutingConfig.build(st, pl, ct) if st is RoutingStrategy.PREFIX_AWARE else RoutingConfig.build(st)
    res = simulate(SimConfig(routing=routing, **kw), _WORKLOAD)
    return GridPoint(st.value, pl, ct, res.summary())


def run_grid(
    workload: Any,
    *,
    instances: Sequence[str],
    prefix_lengths: Sequence[int] = DEFAULT_PREFIX_LENGTHS,
    thresholds: Sequence[int] = DEFAULT_THRESHOLDS,
    baselines: Sequence[RoutingStrategy] = (RoutingStrategy.RANDOM, RoutingStrategy.LEAST_OUTSTANDING_REQUESTS),
    engine: EngineConfig | None = None,
    replicas: int = 1,
    overhead_s: float = 0.0,
    duration_s: float | None = None,
    seed: int = 0,
    jobs: int | None = None,
    on_done: Callable[[GridPoint], None] | None = None,
) -> TuneResult:
    """Simulate ``workload`` (usually a :class:`~prefixroute.workloads.traces.TraceWorkload`)
    for every grid point and baseline, then :func:`recommend`.

    Args:
        workload: what to replay (open loop at its own arrival times).
        instances: instance ids of the simulated fleet.
        prefix_lengths, thresholds: the grid (validated like any PrefixAwareRoutingConfig).
        baselines: strategies run once each for comparison.
        engine: engine configuration (default: the calibrated one).
        replicas: router replicas.
        overhead_s: model seconds per request outside the engine.
        duration_s: model seconds of arrivals to replay (default: the whole trace).
        seed: seed of the runs.
        jobs: worker processes (default: CPU count; 1 runs in this process).
        on_done: called after each run (progress bars).

    Raises:
        ConfigError: a PrefixLength or ConcurrencyThreshold out of range.
    """
    global _WORKLOAD
    for pl in prefix_lengths:
        for ct in thresholds:
            RoutingConfig.build("prefix-aware", pl, ct)  # validate before any run
    if duration_s is None:
        duration_s = getattr(workload, "duration_s", 3600.0)
    kw = dict(instances=tuple(instances), engine=engine or EngineConfig(), replicas=replicas, duration_s=duration_s,
              overhead_s=overhead_s, seed=seed)
    todo: list[tuple[str, int | None, int | None, dict[str, Any]]] = [(b.value, None, None, kw) for b in baselines]
    todo += [("PREFIX_AWARE", pl, ct, kw) for pl in prefix_lengths for ct in thresholds]
    _WORKLOAD = workload
    points: list[GridPoint] = []
    try:
        workers = jobs or os.cpu_count() or 1
        if workers <= 1 or len(todo) == 1 or "fork" not in multiprocessing.get_all_start_methods():
            for job in todo:
                points.append(_run_point(job))
                if on_done:
                    on_done(points[-1])
        else:
            with multiprocessing.get_context("fork").Pool(min(workers, len(todo))) as pool:
                for p in pool.imap(_run_point, todo):
                    points.append(p)
                    if on_done:
                        on_done(p)
    finally:
        _WORKLOAD = None
    base = [p for p in points if p.prefix_length is None]
    grid = [p for p in points if p.prefix_length is not None]
    return TuneResult(workload.describe(), base, grid, recommend(grid, base))


# -- the recommendation -------------------------------------------------------------------


def _ms(s: float) -> str:
    return f"{s * 1e3:.0f} ms"


def _pct(x: float) -> str:
    return f"{x * 100:.1f} %"


def recommend(grid: Sequence[GridPoint], baselines: Sequence[GridPoint] = ()) -> Recommendation:
    """Pick the setting to use and say why (rules in the module docstring).

    Raises:
        ValueError: ``grid`` is empty.
    """
    ok = [p for p in grid if p.summary.p90_ttft_s == p.summary.p90_ttft_s]  # drop NaN (no request finished)
    if not ok:
        errors = sum(p.summary.errors for p in grid)
        raise ValueError(f"no grid point completed any request ({errors} errors)")
    best_p90 = min(p.summary.p90_ttft_s for p in ok)
    near = [p for p in ok if p.summary.p90_ttft_s <= best_p90 * (1 + _P90_SLACK)]
    best_hit = max(p.summary.cache_hit_rate for p in near)
    near = [p for p in near if p.summary.cache_hit_rate >= best_hit - _HIT_SLACK]
    choice = min(near, key=lambda p: (round(p.busiest_share, 3), p.prefix_length, -(p.concurrency_threshold or 0)))
    s = choice.summary
    reasons = [
        f"PrefixLength {choice.prefix_length} with ConcurrencyThreshold {choice.concurrency_threshold}: "
        f"P90 TTFT {_ms(s.p90_ttft_s)}, P50 {_ms(s.p50_ttft_s)}, cache-hit rate {_pct(s.cache_hit_rate)}, "
        f"busiest instance {_pct(choice.busiest_share)} of requests, overflow {_pct(s.overflow_rate)}."
    ]
    by = {(p.prefix_length, p.concurrency_threshold): p for p in ok}
    pls = sorted({p.prefix_length for p in ok if p.prefix_length is not None})
    cts = sorted({p.concurrency_threshold for p in ok if p.concurrency_threshold is not None})
    i, j = pls.index(choice.prefix_length), cts.index(choice.concurrency_threshold)
    if i > 0:
        q = by.get((pls[i - 1], choice.concurrency_threshold))
        if q is not None:
            qs = q.summary
            why = []
            if q.busiest_share > choice.busiest_share + 0.02:
                why.append(f"concentrates load (busiest instance {_pct(q.busiest_share)})")
            if qs.overflow_rate > s.overflow_rate + 0.01:
                why.append(f"overflows {_pct(qs.overflow_rate)} of requests")
            if qs.cache_hit_rate < s.cache_hit_rate - _HIT_SLACK:
                why.append(f"hits less ({_pct(qs.cache_hit_rate)})")
            verdict = ", ".join(why) if why else "is no better"
            reasons.append(f"A shorter PrefixLength ({q.prefix_length}) {verdict}: P90 {_ms(qs.p90_ttft_s)}.")
    if i + 1 < len(pls):
        q = by.get((pls[i + 1], choice.concurrency_threshold))
        if q is not None:
            qs = q.summary
            if qs.cache_hit_rate < s.cache_hit_rate - _HIT_SLACK:
                verdict = f"splits requests that share a cache (hit rate {_pct(qs.cache_hit_rate)})"
            else:
                verdict = "gains nothing and lets later differences in a prompt split its cache"
            reasons.append(f"A longer PrefixLength ({q.prefix_length}) {verdict}: P90 {_ms(qs.p90_ttft_s)}.")
    if j > 0:
        q = by.get((choice.prefix_length, cts[j - 1]))
        if q is not None:
            qs = q.summary
            if qs.overflow_rate <= s.overflow_rate + 0.001 and qs.p90_ttft_s <= s.p90_ttft_s * (1 + _P90_SLACK):
                reasons.append(f"A lower ConcurrencyThreshold ({q.concurrency_threshold}) changes nothing on this "
                               f"trace; the higher one leaves room for bursts before requests overflow.")
            else:
                reasons.append(f"A lower ConcurrencyThreshold ({q.concurrency_threshold}) overflows "
                               f"{_pct(qs.overflow_rate)} of requests (hit rate {_pct(qs.cache_hit_rate)}, "
                               f"P90 {_ms(qs.p90_ttft_s)}).")
    if j + 1 < len(cts):
        q = by.get((choice.prefix_length, cts[j + 1]))
        if q is not None:
            qs = q.summary
            reasons.append(f"A higher ConcurrencyThreshold ({q.concurrency_threshold}) lets a hot prefix queue "
                           f"on its instance (busiest {_pct(q.busiest_share)}, P90 {_ms(qs.p90_ttft_s)}).")
    base_ok = [b for b in baselines if b.summary.p90_ttft_s == b.summary.p90_ttft_s]
    if base_ok:
        best_base = min(base_ok, key=lambda b: b.summary.p90_ttft_s)
        bs = best_base.summary
        if bs.p90_ttft_s < s.p90_ttft_s:
            return Recommendation(best_base, [
                f"{best_base.strategy}: its P90 TTFT ({_ms(bs.p90_ttft_s)}) beats the best PREFIX_AWARE setting "
                f"({choice.label}, {_ms(s.p90_ttft_s)}); this traffic shares too little for prefix-aware "
                f"routing to pay (hit rate {_pct(bs.cache_hit_rate)} vs {_pct(s.cache_hit_rate)})."] + reasons)
        for b in base_ok:
            reasons.append(
                f"Against {b.strategy}: P90 {_ms(b.summary.p90_ttft_s)} → {_ms(s.p90_ttft_s)} "
                f"({(s.p90_ttft_s - b.summary.p90_ttft_s) / b.summary.p90_ttft_s * 100:+.0f} %), P50 "
                f"{_ms(b.summary.p50_ttft_s)} → {_ms(s.p50_ttft_s)}, hit rate {_pct(b.summary.cache_hit_rate)} → "
                f"{_pct(s.cache_hit_rate)}.")
    return Recommendation(choice, reasons)


# -- outputs ------------------------------------------------------------------------------


def tune_json(result: TuneResult) -> dict[str, Any]:
    """SPEC §7's object plus ``grid`` and ``recommendation``."""
    runs = []
    for p in result.baselines + result.grid:
        d = asdict(p.summary)
        d["prefix_length"], d["concurrency_threshold"] = p.prefix_length, p.concurrency_threshold
        runs.append(d)
    return {"workload": result.workload, "runs": runs,
            "grid": [p.row() for p in result.baselines + result.grid],
            "recommendation": result.recommendation.as_dict()}


def write_tune_plot(path: str | Path, result: TuneResult) -> Path:
    """One PNG: cache-hit rate, P50 and P90 TTFT, overflow rate and busiest-instance share
    against PrefixLength, one line per ConcurrencyThreshold, baselines dashed (or named
    at the panel's edge when outside the grid's range); the legend in the sixth panel."""
    import matplotlib.pyplot as plt

    fig = tune_figure(result)
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def tune_figure(result: TuneResult) -> Any:
    """The matplotlib figure :func:`write_tune_plot` saves (Agg backend)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("cache-hit rate, %", lambda p: p.summary.cache_hit_rate * 100),
              ("P50 TTFT, model ms", lambda p: p.summary.p50_ttft_s * 1e3),
              ("P90 TTFT, model ms", lambda p: p.summary.p90_ttft_s * 1e3),
              ("overflow, % of requests", lambda p: p.summary.overflow_rate * 100),
              ("busiest instance, % of requests", lambda p: p.busiest_share * 100)]
    fig, axes = plt.subplots(2, 3, figsize=(15, 8))
    flat = list(axes.flat)
    cts = sorted({p.concurrency_threshold for p in result.grid})
    rec = result.recommendation.point
    for ax, (title, f) in zip(flat, panels):
        grid_values = []
        for ct in cts:
            pts = sorted((p for p in result.grid if p.concurrency_threshold == ct), key=lambda p: p.prefix_length)
            ys = [f(p) for p in pts]
            grid_values += [y for y in ys if not math.isnan(y)]
            ax.plot([p.prefix_length for p in pts], ys, marker="o", label=f"threshold {ct}")
        if rec.prefix_length is not None:
            ax.plot([rec.prefix_length], [f(rec)], marker="*", markersize=16, color="black", linestyle="none",
                    label="recommended")
        ax.set_xscale("log", base=2)
        # The y-range is the grid's (differences between its points stay visible); a
        # baseline outside it is named at the edge with its value, not drawn far away.
        lo, hi = (min(grid_values), max(grid_values)) if grid_values else (0.0, 1.0)
        pad = max((hi - lo) * 0.15, abs(hi) * 0.02, 1e-9)
        ylo, yhi = lo - pad, hi + pad
        for b in result.baselines:
            v = f(b)
            if math.isnan(v):
                continue
            if ylo <= v <= yhi:
                ax.axhline(v, linestyle="--", linewidth=1, color="gray")
                ax.annotate(f"{b.strategy} {v:.3g}", (0.01, v), xycoords=("axes fraction", "data"), fontsize=7,
                            color="gray", va="bottom")
            else:
                ax.annotate(f"{b.strategy} {v:.3g} {'above' if v > yhi else 'below'}",
                            (0.01, 0.97 if v > yhi else 0.03), xycoords="axes fraction", fontsize=7, color="gray",
                            va="top" if v > yhi else "bottom")
        ax.set_ylim(ylo, yhi)
        ax.set_xlabel("PrefixLength, characters")
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
    handles, labels = flat[0].get_legend_handles_labels()
    flat[-1].axis("off")  # the sixth panel: the legend (covering no data) and the reasons
    flat[-1].legend(handles, labels, loc="upper left", fontsize=8, frameon=False)
    flat[-1].text(0.0, 0.55, "\n".join(_wrap(r, 60) for r in result.recommendation.reasons[:4]),
                  va="top", fontsize=8, family="monospace")
    fig.suptitle(f"prefixroute tune: {result.workload}", fontsize=10)
    fig.tight_layout()
    return fig


def _wrap(text: str, width: int) -> str:
    import textwrap

    return "\n".join(textwrap.wrap(text, width)) + "\n"
