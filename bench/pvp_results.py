"""The results of ``bench/policy_vs_peers.py``: one run (:class:`RunResult`) and its JSON,
the commit that ran it, the runs and commands a ``--resume`` keeps, and the median of a
run's repeats.
"""

from __future__ import annotations

import functools
import subprocess
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Sequence

import orjson

from prefixroute.demo.loadgen import RequestResult
from prefixroute.demo.report import RunSummary
from pvp_settings import BenchSettings


@dataclass
class RunResult:
    """One (workload, router, replicas) run: the SPEC §7 summary plus what the tables need."""

    workload: str
    label: str
    summary: RunSummary
    results: list[RequestResult] = field(default_factory=list, repr=False)
    events: list[dict[str, Any]] = field(default_factory=list)
    instances: list[str] = field(default_factory=list)
    repeat: int = 0
    repeats: int = 1
    #: CPU seconds the router processes (every replica, their threads and children) and
    #: the engines used while the traffic ran: on a machine where both share the cores,
    #: a router's CPU is taken from the engines' and shows in TTFT.
    router_cpu_s: float = float("nan")
    engine_cpu_s: float = float("nan")
    #: the prefixroute commit that ran it (:func:`source_commit`), so that a file
    #: resumed across commits says which runs came from which
    commit: str = ""

    @property
    def busiest_share(self) -> float:
        return max(self.summary.instance_share, default=0.0)

    def to_json(self) -> dict[str, Any]:
        """SPEC §7 run fields plus ``workload``, ``label``, ``busiest_share``,
        ``instances``, ``membership_events``, ``repeat(s)``, CPU seconds and ``commit``."""
        d = asdict(self.summary)
        d.update(workload=self.workload, label=self.label, busiest_share=self.busiest_share,
                 instances=self.instances, membership_events=self.events, repeat=self.repeat,
                 repeats=self.repeats, router_cpu_s=self.router_cpu_s, engine_cpu_s=self.engine_cpu_s,
                 commit=self.commit)
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "RunResult":
        """A run as :meth:`to_json` wrote it (its per-request results are not kept)."""
        import dataclasses

        names = {f.name for f in dataclasses.fields(RunSummary)}
        summary = RunSummary(**{k: v for k, v in d.items() if k in names})
        return cls(d["workload"], d["label"], summary, events=list(d.get("membership_events", [])),
                   instances=list(d.get("instances", [])), repeat=int(d.get("repeat", 0)),
                   repeats=int(d.get("repeats", 1)), router_cpu_s=_num(d.get("router_cpu_s")),
                   engine_cpu_s=_num(d.get("engine_cpu_s")), commit=str(d.get("commit", "")))


def _num(v: Any) -> float:
    return float(v) if isinstance(v, (int, float)) else float("nan")


@functools.cache
def source_commit() -> str:
    """The short commit of the checkout this benchmark runs from, with ``+dirty`` when
    tracked files differ from it; ``unknown`` outside a git checkout."""
    root = Path(__file__).resolve().parent.parent
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "--short=7", "HEAD"], capture_output=True,
                              text=True, timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return head + ("+dirty" if dirty else "") if head else "unknown"


def resume_commands(path: Path) -> list[str]:
    """The commands of the invocations whose runs ``path`` holds (the earliest first),
    for a ``--resume`` to keep; ``[]`` when there is no such file."""
    if not path.exists():
        return []
    doc = orjson.loads(path.read_bytes())
    return [*doc.get("earlier_commands", []), *([doc["command"]] if doc.get("command") else [])]


def resume_runs(path: Path, s: BenchSettings) -> list[RunResult]:
    """The runs a previous invocation with the same settings left in ``path`` (written
    after every run), to skip them: every repeat of each (workload, label, replicas).

    Raises:
        SystemExit: the file's settings differ from this invocation's (the runs would
            not compare).
    """
    if not path.exists():
        return []
    doc = orjson.loads(path.read_bytes())
    theirs = doc.get("settings", {})
    ours = orjson.loads(orjson.dumps(asdict(s)))
    if theirs != ours:
        diff = sorted(k for k in set(theirs) | set(ours) if theirs.get(k) != ours.get(k))
        raise SystemExit(f"error: --resume: {path} was run with other settings ({', '.join(diff)})")
    runs = doc.get("repeated_runs") or doc.get("runs") or []
    return [RunResult.from_json(r) for r in runs]


def median_run(runs: Sequence[RunResult]) -> RunResult:
    """One run standing for several of the same (workload, router, replicas): the first
    one's, with the median of each figure across them (hit rate, P50 and P90 TTFT,
    latency, throughput, requests, errors summed) and ``repeats`` set."""
    import dataclasses
    import statistics

    if len(runs) == 1:
        return runs[0]
    sm = [r.summary for r in runs]
    med = statistics.median
    summary = dataclasses.replace(
        sm[0], cache_hit_rate=med(x.cache_hit_rate for x in sm), p50_ttft_s=med(x.p50_ttft_s for x in sm),
        p90_ttft_s=med(x.p90_ttft_s for x in sm), p50_latency_s=med(x.p50_latency_s for x in sm),
        throughput_rps=med(x.throughput_rps for x in sm), errors=sum(x.errors for x in sm))
    return dataclasses.replace(runs[0], summary=summary, repeat=-1, repeats=len(runs), results=[],
                               router_cpu_s=med(r.router_cpu_s for r in runs),
                               engine_cpu_s=med(r.engine_cpu_s for r in runs))
