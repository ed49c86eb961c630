"""Summaries of a measured run: the reference-style table, SPEC §7 JSON, and plots."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Sequence

import aiohttp
import orjson
from prometheus_client.parser import text_string_to_metric_families

from prefixroute.demo.loadgen import RequestResult

__all__ = ["RunSummary", "summarize", "scrape_counters", "render_table", "render_narrow_table", "write_json", "write_plots", "percentile"]


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0-100) by linear interpolation; ``nan`` when empty."""
    if not values:
        return float("nan")
    xs = sorted(values)
    if len(xs) == 1:
        return xs[0]
    pos = (len(xs) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


@dataclass
class RunSummary:
    """One strategy's results in the shape of SPEC §7 (plus extras).

    Times ending in ``_s`` are in **model seconds** (real seconds / time scale), so they
    read as the emulated engine's; ``router_overhead_*_ms`` are **real** milliseconds.
    """

    router: str
    strategy: str
    replicas: int
    requests: int
    errors: int
    p50_ttft_s: float
    p90_ttft_s: float
    p50_latency_s: float
    cache_hit_rate: float
    throughput_rps: float
    instance_share: list[float]
    overflow_rate: float = 0.0
    router_overhead_p50_ms: float = float("nan")
    router_overhead_p99_ms: float = float("nan")
    time_scale: float = 1.0
    decisions: dict[str, int] = field(default_factory=dict)
    #: ``demo --multi-model``: per inference component, its requests, cache-hit rate and
    #: share per copy (:mod:`prefixroute.demo.multi_model`); empty otherwise.
    components: dict[str, Any] = field(default_factory=dict)


async def scrape_counters(urls: Sequence[str], names: Sequence[str]) -> dict[str, float]:
    """Sum Prometheus samples named ``names`` over the ``/metrics`` of every URL.

    Returns:
        ``{sample name: total}``; absent samples count 0.

    Raises:
        aiohttp.ClientError: an instance did not answer.
    """
    totals = {n: 0.0 for n in names}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as s:
        for url in urls:
            async with s.get(url.rstrip("/") + "/metrics") as r:
                r.raise_for_status()
                text = await r.text()
            for fam in text_string_to_metric_families(text):
                for sample in fam.samples:
                    if sample.name in totals:
                        totals[sample.name] += sample.value
    return totals


def summarize(
    strategy: str,
    results: Sequence[RequestResult],
    wall_s: float,
    time_scale: float,
    instances: Sequence[str],
    cache_hits: float,
    cache_queries: float,
    router: str = "prefixroute",
    replicas: int = 1,
) -> RunSummary:
    """Reduce per-request results and engine counters to one :class:`RunSummary`.

    ``cache_hit_rate`` = engine prefix-cache hits / queries over the run (SPEC §7).
    ``instance_share`` follows the order of ``instances``.
    """
    ok = [r for r in results if not r.error]
    ttft = [r.ttft_s / time_scale for r in ok if r.ttft_s is not None]
    lat = [r.latency_s / time_scale for r in ok if r.latency_s is not None]
    counts = {u: 0 for u in instances}
    decisions: dict[str, int] = {}
    for r in ok:
        if r.instance in counts:
            counts[r.instance] += 1
        decisions[r.decision] = decisions.get(r.decision, 0) + 1
    served = sum(counts.values()) or 1
    overheads = [r.overhead_ms for r in ok if r.overhead_ms is not None]
    return RunSummary(
        router=router,
        strategy=strategy,
        replicas=replicas,
        requests=len(results),
        errors=len(results) - len(ok),
        p50_ttft_s=percentile(ttft, 50),
        p90_ttft_s=percentile(ttft, 90),
        p50_latency_s=percentile(lat, 50),
        cache_hit_rate=cache_hits / cache_queries if cache_queries else 0.0,
        throughput_rps=len(ok) / (wall_s / time_scale) if wall_s > 0 else 0.0,
        instance_share=[counts[u] / served for u in instances],
        overflow_rate=(decisions.get("overflow", 0) + decisions.get("all_busy", 0)) / (len(ok) or 1),
        router_overhead_p50_ms=percentile(overheads, 50),
        router_overhead_p99_ms=percentile(overheads, 99),
        time_scale=time_scale,
        decisions=decisions,
    )


def _delta(v: float, b: float) -> str:
    if not b or b != b or v != v:
        return ""
    return f" ({(v - b) / b * 100:+.0f}%)"


def render_narrow_table(summaries: Sequence[RunSummary], title: str) -> Any:
    """The same figures as :func:`render_table`, one column per strategy (fits 80 columns)."""
    from rich.table import Table

    table = Table(title=title, title_justify="left")
    table.add_column("", no_wrap=True)
    for s in summaries:
        table.add_column(s.strategy.replace("_REQUESTS", ""), justify="right", no_wrap=True)
    base = summaries[0]

    def row(label: str, fmt, rel: str | None = None) -> None:
        cells = []
        for s in summaries:
            text = fmt(s)
            if rel and s is not base:
                text += _delta(getattr(s, rel), getattr(base, rel))
            cells.append(text)
        table.add_row(label, *cells)

    row("P50 TTFT", lambda s: f"{s.p50_ttft_s * 1000:.0f} ms", "p50_ttft_s")
    row("P90 TTFT", lambda s: f"{s.p90_ttft_s * 1000:.0f} ms", "p90_ttft_s")
    row("P50 latency", lambda s: f"{s.p50_latency_s:.2f} s")
    row("cache hit", lambda s: f"{s.cache_hit_rate * 100:.1f} %")
    row("throughput", lambda s: f"{s.throughput_rps:.1f} rps", "throughput_rps")
    row("overflow", lambda s: f"{s.overflow_rate * 100:.1f} %")
    row("errors", lambda s: str(s.errors))
    row("overhead p50/p99", lambda s: f"{s.router_overhead_p50_ms:.2f}/{s.router_overhead_p99_ms:.2f} ms")
    for i in range(max(len(s.instance_share) for s in summaries)):
        row(f"share instance {i}",
            lambda s, i=i: f"{s.instance_share[i] * 100:.1f} %" if i < len(s.instance_share) else "")
    return table


def render_table(summaries: Sequence[RunSummary], title: str) -> Any:
    """A ``rich`` table: one row per strategy, with changes against the first (baseline) row."""
    from rich.table import Table

    table = Table(title=title, title_justify="left")
    # Simulated runs measure no router overhead (it is NaN): leave the column out then.
    show_overhead = any(s.router_overhead_p50_ms == s.router_overhead_p50_ms for s in summaries)
    columns = ["strategy", "P50 TTFT", "P90 TTFT", "P50 latency", "cache hit", "throughput",
               "share per instance %", "overflow", "errors"]
    if show_overhead:
        columns.append("overhead p50/p99")
    for col in columns:
        table.add_column(col, justify="left" if col in ("strategy", "share per instance %") else "right",
                         no_wrap=True)
    base = summaries[0] if summaries else None
    delta = _delta
    for s in summaries:
        is_base = s is base
        cells = [
            s.strategy,
            f"{s.p50_ttft_s * 1000:.0f} ms" + ("" if is_base else delta(s.p50_ttft_s, base.p50_ttft_s)),
            f"{s.p90_ttft_s * 1000:.0f} ms" + ("" if is_base else delta(s.p90_ttft_s, base.p90_ttft_s)),
            f"{s.p50_latency_s:.2f} s",
            f"{s.cache_hit_rate * 100:.1f} %",
            f"{s.throughput_rps:.1f} rps" + ("" if is_base else delta(s.throughput_rps, base.throughput_rps)),
            " ".join(f"{x * 100:.1f}" for x in s.instance_share),
            f"{s.overflow_rate * 100:.1f} %",
            str(s.errors),
        ]
        if show_overhead:
            cells.append(f"{s.router_overhead_p50_ms:.2f}/{s.router_overhead_p99_ms:.2f} ms")
        table.add_row(*cells)
    return table


def write_json(path: str | Path, workload: str, summaries: Sequence[RunSummary], extra: dict[str, Any] | None = None) -> None:
    """Write SPEC §7's object: ``{"workload": ..., "runs": [...]}`` (plus ``extra`` keys)."""
    doc: dict[str, Any] = {"workload": workload, "runs": [asdict(s) for s in summaries]}
    if extra:
        doc.update(extra)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_bytes(orjson.dumps(doc, option=orjson.OPT_INDENT_2 | orjson.OPT_SERIALIZE_NUMPY))


def write_plots(out_dir: str | Path, runs: dict[str, Sequence[RequestResult]], summaries: Sequence[RunSummary]) -> list[Path]:
    """TTFT distribution (CDF) per strategy and per-instance share; returns the PNG paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = []

    # Legends sit right of the axes: they never cover a curve or a bar.
    fig, ax = plt.subplots(figsize=(9, 4.5))
    for s in summaries:
        xs = sorted(r.ttft_s / s.time_scale * 1000 for r in runs[s.strategy] if r.ttft_s is not None and not r.error)
        if xs:
            ys = [(i + 1) / len(xs) for i in range(len(xs))]
            ax.plot(xs, ys, label=f"{s.strategy} (P50 {s.p50_ttft_s * 1000:.0f} ms)")
    ax.set_xscale("log")
    ax.set_xlabel("TTFT, model milliseconds (log scale)")
    ax.set_ylabel("fraction of requests")
    ax.set_title("TTFT distribution per routing strategy")
    ax.grid(True, which="both", alpha=0.3)
    ax.set_ylim(0, 1.02)
    ax.legend(loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0.0, fontsize=8)
    fig.tight_layout()
    p = out / "ttft_cdf.png"
    fig.savefig(p, dpi=110)
    plt.close(fig)
    paths.append(p)

    fig, ax = plt.subplots(figsize=(9, 4.5))
    n = max((len(s.instance_share) for s in summaries), default=0)
    width = 0.8 / max(1, len(summaries))
    for j, s in enumerate(summaries):
        ax.bar([i + j * width for i in range(n)], [x * 100 for x in s.instance_share], width, label=s.strategy)
    if n:
        ax.axhline(100 / n, color="black", linestyle="--", linewidth=1, label=f"even split ({100 / n:.1f} %)")
    ax.set_xticks([i + width * (len(summaries) - 1) / 2 for i in range(n)], [f"instance {i}" for i in range(n)])
    ax.set_ylabel("share of requests, %")
    ax.set_title("Requests per instance")
    ax.legend(loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0.0, fontsize=8)
    fig.tight_layout()
    p = out / "instance_share.png"
    fig.savefig(p, dpi=110)
    plt.close(fig)
    paths.append(p)
    return paths
