"""The output of ``bench/overhead.py``: a table per cell and one of the streams phase
(rich), plots (matplotlib), the machine's facts, the versions measured, and the JSON
file (SPEC §7's object plus every measurement).
"""

from __future__ import annotations

import os
import platform
from dataclasses import asdict
from pathlib import Path
from typing import Any, Sequence

from checkout import source_commit
from overhead_results import DIRECT, CellResult, Measurement
from overhead_settings import Cell, OverheadSettings, _size_name
from overhead_streams import StreamsResult
from peer_install import PeerStatus

BENCH_DIR = Path(__file__).resolve().parent


def _f(x: float | None, fmt: str, none: str = "-") -> str:
    return none if x is None else format(x, fmt)


def _ratio(median: float | None, rounds: Sequence[float | None], fmt: str) -> str:
    """A ratio of medians, then its lowest and highest round by round when there are
    several rounds (``1.0 (0.9-1.8)``), with how many rounds gave one when some did not
    (``1.5 (0.5-0.6 in 2 of 3)``: HAProxy added nothing in a round, say). The ratio of
    medians need not lie within the rounds' range."""
    if median is None:
        return "-"
    known = [r for r in rounds if r is not None]
    if len(rounds) < 2 or not known:
        return format(median, fmt)
    some = f" in {len(known)} of {len(rounds)}" if len(known) < len(rounds) else ""
    return f"{median:{fmt}} ({min(known):{fmt}}-{max(known):{fmt}}{some})"


def render_cell_table(cell: Cell, results: Sequence[CellResult], s: OverheadSettings) -> Any:
    """A rich table of one cell: one row per target."""
    from rich.table import Table

    rounds = f"median of {s.rounds} rounds of {s.duration_s} s" if s.rounds > 1 else f"1 round of {s.duration_s} s"
    table = Table(title=f"{cell.name} ({rounds})", title_justify="left")
    for col in ("router", "p50 ms", "p99 ms", "added p50", "added p99", "x HAProxy", "req/s", "x sglang",
                "CPU us/req", "peak RSS", "requests", "errors"):
        table.add_column(col, justify="left" if col == "router" else "right", no_wrap=True)
    for r in results:
        table.add_row(
            r.target.label, _f(r.p50_ms, ".2f"), _f(r.p99_ms, ".2f"), _f(r.added_p50_ms, "+.2f"),
            _f(r.added_p99_ms, "+.2f"), _ratio(r.added_vs_haproxy, r.added_vs_haproxy_rounds, ".1f"), f"{r.rps:,.0f}",
            _ratio(r.rps_vs_sglang, r.rps_vs_sglang_rounds, ".2f"),
            _f(r.cpu_us_per_request, ",.0f"),
            "-" if r.peak_rss_bytes is None else f"{r.peak_rss_bytes / 2**20:.0f} MiB", f"{r.requests:,}",
            str(r.errors) + (f" + {r.rounds_without_reply} rounds without reply" if r.rounds_without_reply else ""),
            style="bold" if r.target.label == "prefixroute CACHE_AWARE" else None)
    return table


def render_streams_table(r: StreamsResult) -> Any:
    from rich.table import Table

    table = Table(title=f"streams: {r.streams:,} concurrent streaming requests through {r.label} "
                        f"({r.events_per_stream} events {r.delay_ms:g} ms apart)", title_justify="left")
    for col in ("streams", "completed with [DONE]", "errors", "peak open (client)", "peak open (backend)",
                "router RSS before", "router peak RSS", "router CPU", "p50 stream", "max stream", "wall"):
        table.add_column(col, justify="right", no_wrap=True)
    table.add_row(f"{r.streams:,}", f"{r.completed:,}",
                  str(r.error_count) + (f" {r.errors}" if r.errors else ""), f"{r.peak_open:,}",
                  f"{r.backend_peak_open:,}", f"{r.router_rss_before_bytes / 2**20:.0f} MiB",
                  f"{r.router_peak_rss_bytes / 2**20:.0f} MiB", f"{r.router_cpu_s:.1f} s",
                  _f(r.p50_stream_s, ".2f") + " s", _f(r.max_stream_s, ".2f") + " s", f"{r.wall_s:.1f} s")
    return table


def write_plots(out_dir: Path, results: Sequence[CellResult], streams: StreamsResult | None) -> list[Path]:
    """Per (body size, streaming): added p50 and p99 latency, requests/s and router CPU
    per request against concurrency, one line per target; the streams phase's open
    streams over time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for body, stream in sorted({(r.cell.body_bytes, r.cell.stream) for r in results}):
        rs = [r for r in results if r.cell.body_bytes == body and r.cell.stream == stream]
        labels = list(dict.fromkeys(r.target.label for r in rs))
        colors = {label: f"C{i % 10}" for i, label in enumerate(labels)}  # the same in every panel
        fig, axes = plt.subplots(1, 4, figsize=(22, 5))
        metrics = (("added p50 latency, ms", lambda r: r.added_p50_ms, False),
                   ("added p99 latency, ms", lambda r: r.added_p99_ms, False),
                   ("requests/s", lambda r: r.rps, True),
                   ("router CPU per request, µs", lambda r: r.cpu_us_per_request, False))
        for ax, (name, get, with_direct) in zip(axes, metrics):
            for label in labels:
                if label == DIRECT and not with_direct:
                    continue
                pts = sorted((r.cell.concurrency, get(r)) for r in rs if r.target.label == label)
                pts = [(c, v) for c, v in pts if v is not None]
                if pts:
                    ax.plot([c for c, _ in pts], [v for _, v in pts], marker="o", color=colors[label],
                            linestyle="--" if label == DIRECT else "-", label=label)
            ax.set_xscale("log", base=2)
            ax.set_xlabel("concurrent connections")
            ax.set_title(name)
            ax.grid(True, alpha=0.3)
        axes[2].legend(fontsize=8)
        mode = "streaming" if stream else "non-streaming"
        fig.suptitle(f"router overhead: {_size_name(body)} bodies, {mode}")
        fig.tight_layout()
        p = out_dir / f"overhead-{body // 1024}k-{'stream' if stream else 'plain'}.png"
        fig.savefig(p, dpi=100)
        plt.close(fig)
        paths.append(p)
    if streams is not None and streams.timeline:
        fig, ax = plt.subplots(figsize=(8, 4))
        ax.plot([t for t, _ in streams.timeline], [n for _, n in streams.timeline])
        ax.axhline(streams.streams, linestyle="--", color="grey")
        ax.set_xlabel("seconds")
        ax.set_ylabel("streams open (client side)")
        ax.set_title(f"{streams.streams:,} concurrent streams through {streams.label}")
        ax.grid(True, alpha=0.3)
        fig.tight_layout()
        p = out_dir / "overhead-streams.png"
        fig.savefig(p, dpi=100)
        plt.close(fig)
        paths.append(p)
    return paths


def machine_facts(root: str = "/") -> dict[str, Any]:
    """What the machine is: CPUs, platform, and how an idle CPU sleeps (Linux cpuidle's
    driver and governor; with the ``haltpoll`` driver of a KVM guest, how long an idle
    vCPU polls before it halts, ``guest_halt_poll_ns``). At concurrency 1 every hop
    wakes a sleeping process; a vCPU that has halted is woken by the host, which costs
    far more than waking one that polls, so these facts go with the latency figures.
    ``None`` for what the system does not say (``root``: where ``/sys`` is read from)."""
    def read(path: str) -> str | None:
        try:
            return (Path(root) / path.lstrip("/")).read_text().strip()
        except OSError:
            return None

    poll_ns = read("/sys/module/haltpoll/parameters/guest_halt_poll_ns")
    return {"cpus": os.cpu_count(), "platform": platform.platform(),
            "cpuidle_driver": read("/sys/devices/system/cpu/cpuidle/current_driver"),
            "cpuidle_governor": read("/sys/devices/system/cpu/cpuidle/current_governor"),
            "guest_halt_poll_ns": int(poll_ns) if poll_ns is not None and poll_ns.isdigit() else None}


def versions(statuses: dict[str, PeerStatus]) -> dict[str, str]:
    """Versions of everything measured: prefixroute (and its git commit), Python, peers."""
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": platform.python_version()}
    try:
        out["prefixroute"] = version("prefixroute")
    except PackageNotFoundError:
        out["prefixroute"] = "unknown"
    commit = source_commit(BENCH_DIR)
    if commit:
        out["prefixroute_commit"] = commit
    for name, st in statuses.items():
        out[name] = st.detail if st.available else f"unavailable: {st.detail}"
    return out


def write_json(path: Path, results: Sequence[CellResult], measurements: Sequence[Measurement],
               streams: StreamsResult | None, s: OverheadSettings, command: str, skipped: dict[str, str],
               statuses: dict[str, PeerStatus], backend_urls: Sequence[str] = ()) -> None:
    """SPEC §7's object plus every measurement, settings, command, versions, skipped routers,
    the fast backend's URLs (the routers' instances)."""
    import orjson

    doc = {
        "workload": (f"overhead: fast backend on {s.instances} ports, wrk closed loop over {s.distinct_bodies} "
                     f"distinct chat bodies; concurrency {list(s.concurrency)}, bodies {list(s.body_sizes)} B, "
                     f"streaming {list(s.streaming)}; {s.rounds} rounds of {s.duration_s} s"),
        "runs": [r.to_json() for r in results],
        "measurements": [m.to_json() for m in measurements],
        "streams": streams.to_json() if streams else None,
        "settings": asdict(s),
        "backend_urls": list(backend_urls),
        "command": command,
        "versions": versions(statuses),
        "skipped": skipped,
        "machine": machine_facts(),
        "notes": {"added_latency": "median over rounds of (router - direct) in the same round, ms; in cells of "
                                   "concurrency <= settings.paired_direct_up_to, direct is the run right before "
                                   "the router's (its paired_with)",
                  "ttft": "not measured: wrk times whole responses",
                  "cpu": "utime+stime of the router's process tree / requests completed"},
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(orjson.dumps(doc, option=orjson.OPT_INDENT_2))
