"""The output of ``bench/multi_model.py``: the matrix's and the LoRA runs' tables and the
sticky-set plots.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mm_lora import ADAPTERS


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
