"""The output of ``bench/policy_vs_peers.py``: a table per workload, the plots and the
SPEC §7 JSON (with the verdicts).
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Any, Sequence

import orjson

from pvp_results import RunResult
from pvp_settings import SUBJECT, BenchSettings, WorkloadSpec
from pvp_verdicts import compare, precise_comparisons, replica_drift


def render_workload_table(workload: WorkloadSpec, runs: Sequence[RunResult], description: str,
                          fleet_mode: str = "") -> Any:
    """A rich table: one row per (router, replicas), sorted by replicas then router order."""
    from rich.table import Table

    table = Table(title=f"{workload.name}: {workload.title}\n{description}" + (f"\n{fleet_mode}" if fleet_mode else ""),
                  title_justify="left")
    for col in ("router", "replicas", "cache hit", "P50 TTFT", "P90 TTFT", "throughput", "busiest", "errors",
                "requests", "router CPU"):
        table.add_column(col, justify="left" if col == "router" else "right", no_wrap=True)
    for r in sorted(runs, key=lambda r: r.summary.replicas):
        s = r.summary
        style = "bold" if s.strategy == SUBJECT else None
        table.add_row(r.label, str(s.replicas), f"{s.cache_hit_rate * 100:.1f} %", f"{s.p50_ttft_s * 1000:.0f} ms",
                      f"{s.p90_ttft_s * 1000:.0f} ms", f"{s.throughput_rps:.1f} rps", f"{r.busiest_share * 100:.1f} %",
                      str(s.errors), str(s.requests),
                      f"{r.router_cpu_s:.1f} s" if r.router_cpu_s == r.router_cpu_s else "", style=style)
    return table


def write_plots(out_dir: Path, workloads: Sequence[WorkloadSpec], runs: Sequence[RunResult]) -> list[Path]:
    """Per workload: cache-hit rate, P50 and P90 TTFT per router, bars per replica count."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for wl in workloads:
        wr = [r for r in runs if r.workload == wl.name]
        if not wr:
            continue
        labels = list(dict.fromkeys(r.label for r in wr))
        reps = sorted({r.summary.replicas for r in wr})
        fig, axes = plt.subplots(1, 3, figsize=(15, 5))
        width = 0.8 / max(1, len(reps))
        metrics = (("cache-hit rate, %", lambda s: s.cache_hit_rate * 100),
                   ("P50 TTFT, model ms", lambda s: s.p50_ttft_s * 1000),
                   ("P90 TTFT, model ms", lambda s: s.p90_ttft_s * 1000))
        for ax, (name, get) in zip(axes, metrics):
            for j, rep in enumerate(reps):
                vals = []
                for label in labels:
                    r = next((x for x in wr if x.label == label and x.summary.replicas == rep), None)
                    vals.append(get(r.summary) if r else float("nan"))
                ax.bar([i + j * width for i in range(len(labels))], vals, width,
                       label=f"{rep} replica{'s' if rep > 1 else ''}")
            ax.set_xticks([i + width * (len(reps) - 1) / 2 for i in range(len(labels))], labels, rotation=40,
                          ha="right", fontsize=8)
            ax.set_title(name)
            ax.grid(True, axis="y", alpha=0.3)
        axes[0].legend()
        fig.suptitle(f"{wl.name}: {wl.title}")
        fig.tight_layout()
        p = out_dir / f"{wl.name}.png"
        fig.savefig(p, dpi=100)
        plt.close(fig)
        paths.append(p)
    return paths


def write_json(path: Path, workloads: Sequence[WorkloadSpec], descriptions: dict[str, str],
               runs: Sequence[RunResult], s: BenchSettings, command: str, skipped: dict[str, str],
               all_runs: Sequence[RunResult] = (), earlier_commands: Sequence[str] = ()) -> None:
    """SPEC §7's object: ``workload`` names the benchmark, each run carries its workload.
    With repeats, ``runs`` holds the medians and ``repeated_runs`` every run. ``command``
    is this invocation's; ``earlier_commands`` those of the invocations a ``--resume``
    carried on from (their runs are in the file too)."""
    doc = {
        "workload": "policy_vs_peers: " + "; ".join(f"{w.name} ({descriptions.get(w.name, '')})" for w in workloads),
        "runs": [r.to_json() for r in runs],
        "repeated_runs": [r.to_json() for r in all_runs] if len(all_runs) > len(runs) else [],
        "settings": asdict(s),
        "command": command,
        "earlier_commands": list(earlier_commands),
        "skipped": skipped,
        "comparisons": [asdict(c) | {"wins": c.wins} for c in compare(runs)],
        "precise_comparisons": precise_comparisons(runs),
        "replica_drift_points": replica_drift(runs),
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(orjson.dumps(doc, option=orjson.OPT_INDENT_2 | orjson.OPT_SERIALIZE_NUMPY))
