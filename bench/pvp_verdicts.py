"""The verdicts of ``bench/policy_vs_peers.py``: the subject against every other router
(:class:`Comparison`), its hit rate's drift with the replica count, and precise mode
against the learned view, as data and as text.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any, Sequence

from pvp_results import RunResult
from pvp_settings import SUBJECT


@dataclass(frozen=True)
class Comparison:
    """The subject against one other router on one workload and replica count.

    ``hit_points`` = subject's hit rate − other's, in percentage points (>= 0 is a win);
    ``p50_ratio``/``p90_ratio`` = subject's TTFT / other's (<= 1 is a win).
    """

    workload: str
    replicas: int
    other: str
    hit_points: float
    p50_ratio: float
    p90_ratio: float

    @property
    def wins(self) -> bool:
        return self.hit_points >= 0 and self.p50_ratio <= 1 and self.p90_ratio <= 1


def compare(runs: Sequence[RunResult], subject: str = SUBJECT) -> list[Comparison]:
    """Every (workload, replicas) pair's subject run against each other router's run."""
    out = []
    keyed = {(r.workload, r.summary.replicas, r.label): r for r in runs}
    for (wl, reps, label), r in keyed.items():
        if r.summary.strategy != subject:
            continue
        for (wl2, reps2, label2), o in keyed.items():
            if (wl2, reps2) != (wl, reps) or label2 == label:
                continue
            a, b = r.summary, o.summary
            out.append(Comparison(wl, reps, label2, (a.cache_hit_rate - b.cache_hit_rate) * 100,
                                  _ratio(a.p50_ttft_s, b.p50_ttft_s), _ratio(a.p90_ttft_s, b.p90_ttft_s)))
    return out


def _ratio(a: float, b: float) -> float:
    if not (a == a and b == b) or b <= 0:
        return float("nan")
    return a / b


def replica_drift(runs: Sequence[RunResult], subject: str = SUBJECT) -> dict[str, float]:
    """Per workload: subject's hit rate with the most replicas minus with 1, in points."""
    by: dict[str, dict[int, float]] = {}
    for r in runs:
        if r.summary.strategy == subject:
            by.setdefault(r.workload, {})[r.summary.replicas] = r.summary.cache_hit_rate
    return {wl: (d[max(d)] - d[1]) * 100 for wl, d in by.items() if 1 in d and max(d) > 1}


def verdict_lines(runs: Sequence[RunResult]) -> list[str]:
    """Plain-text verdicts: per workload and replica count, where the subject loses and by how much."""
    lines = []
    comps = compare(runs)
    for (wl, reps), group in itertools.groupby(sorted(comps, key=lambda c: (c.workload, c.replicas)),
                                               key=lambda c: (c.workload, c.replicas)):
        group = list(group)
        subject = next(r for r in runs if r.workload == wl and r.summary.replicas == reps
                       and r.summary.strategy == SUBJECT)
        losses = [c for c in group if not c.wins]
        err = subject.summary.errors
        head = f"{wl}, {reps} replica{'s' if reps > 1 else ''}: "
        if not losses and err == 0:
            lines.append(head + f"{SUBJECT} has the highest hit rate and the lowest P50 and P90 TTFT, 0 errors")
            continue
        parts = []
        for c in losses:
            bits = []
            if c.hit_points < 0:
                bits.append(f"hit {c.hit_points:+.1f} pts")
            if c.p50_ratio > 1:
                bits.append(f"P50 {(c.p50_ratio - 1) * 100:+.0f} %")
            if c.p90_ratio > 1:
                bits.append(f"P90 {(c.p90_ratio - 1) * 100:+.0f} %")
            parts.append(f"vs {c.other}: " + ", ".join(bits))
        if err:
            parts.append(f"{err} errors")
        lines.append(head + "; ".join(parts))
    for wl, drift in replica_drift(runs).items():
        ok = abs(drift) <= 2.0
        most = max(r.summary.replicas for r in runs if r.workload == wl and r.summary.strategy == SUBJECT)
        lines.append(f"{wl}: {SUBJECT} hit rate with {most} replicas vs 1: {drift:+.1f} pts "
                     f"({'within' if ok else 'outside'} 2 pts)")
    return lines


def precise_comparisons(runs: Sequence[RunResult]) -> list[dict[str, Any]]:
    """Per (workload, replicas) with both: prefixroute CACHE_AWARE precise against its
    learned view (the issue's bar: precise hit rate >= learned's, P90 TTFT <= learned's,
    0 errors). ``hit_points`` = precise - learned; ratios precise / learned."""
    out = []
    by = {(r.workload, r.summary.replicas, r.label): r for r in runs}
    for (wl, reps, label), p in by.items():
        if not label.startswith("prefixroute CACHE_AWARE precise"):
            continue
        learned = by.get((wl, reps, label.replace(" precise", "", 1)))
        if learned is None:
            continue
        a, b = p.summary, learned.summary
        hit = (a.cache_hit_rate - b.cache_hit_rate) * 100
        p50, p90 = _ratio(a.p50_ttft_s, b.p50_ttft_s), _ratio(a.p90_ttft_s, b.p90_ttft_s)
        out.append({"workload": wl, "replicas": reps, "label": label, "hit_points": hit, "p50_ratio": p50,
                    "p90_ratio": p90, "errors": a.errors + b.errors,
                    "meets": hit >= 0 and p90 <= 1 and a.errors == 0 and b.errors == 0})
    return out


def precise_lines(runs: Sequence[RunResult]) -> list[str]:
    """:func:`precise_comparisons` as text, one line each."""
    return [f"{c['workload']}, {c['replicas']} replica{'s' if c['replicas'] > 1 else ''}: precise vs learned "
            f"view: hit {c['hit_points']:+.1f} pts, P50 x{c['p50_ratio']:.2f}, P90 x{c['p90_ratio']:.2f}, "
            f"{c['errors']} errors: {'meets' if c['meets'] else 'MISSES'} (hit >=, P90 <=, 0 errors)"
            for c in precise_comparisons(runs)]
