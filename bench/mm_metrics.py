"""The engines' metrics as ``bench/multi_model.py`` reads them: one scrape of
``/metrics`` as samples, totals and per-label sums of a metric, and TTFT quantiles from the
difference of two scrapes' histogram buckets (linear within a bucket).
"""

from __future__ import annotations

import aiohttp
from prometheus_client.parser import text_string_to_metric_families


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
