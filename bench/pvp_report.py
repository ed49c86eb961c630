"""Verdicts of ``bench/policy_vs_peers.py`` runs against their run-to-run noise.

Reads the JSON of one or more runs of the benchmark (``--json PATH``), taken at
different times with the same settings. Per (workload, replicas, router) it takes the
median of each figure over the files; with two or more files it measures the noise:
for each figure, the spread (largest minus smallest) of every cell over the files, and
its 90th percentile over all cells (cache-hit rate in points, TTFT relative). Then
``CACHE_AWARE`` (its learned view, or the run ``--subject`` names) against every
**peer** (the routers that are not prefixroute's own strategies; llm-d's
re-implemented scorers are a peer): it *leads* on a figure when it
is better than every peer or worse by no more than that figure's noise. It also gives
the hit rate with 4 and 8 router replicas against 1.

Usage::

    python bench/pvp_report.py docs/benchmarks/policy_vs_peers.json [earlier.json ...]

The tables are Markdown, as docs/BENCHMARKS.md shows them. Without a second file the
noise is taken as 0 (every loss counts). ``--noise-from A.json B.json`` measures the
noise on other runs instead (two or more files of the same settings, such as the
recorded full run and its repeat), so that one new run is judged with a noise measured
before::

    python bench/pvp_report.py new.json --noise-from docs/benchmarks/policy_vs_peers.json \
        docs/benchmarks/policy_vs_peers_noise.json

The noise files must be other files than the runs judged and than each other; settings
that differ from the judged runs' (other than the replica counts and repeats) are named
in a warning, and so is how many judged groups have a noise cell of their own (the
others are judged with the noise of other cells). ``--tables`` adds one table per
workload with every router and replica count (the medians), as
docs/benchmarks/policy_vs_peers.md keeps them.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Sequence

#: The strategy every verdict is about.
SUBJECT = "CACHE_AWARE"
#: The run of it judged by default: its learned view (``--subject`` names another, such
#: as ``prefixroute CACHE_AWARE precise`` in a ``--precise both`` run).
DEFAULT_SUBJECT_LABEL = "prefixroute CACHE_AWARE"
#: Figures compared: JSON field, label, whether higher is better, how its noise is measured.
FIGURES = (("cache_hit_rate", "hit", True, "points"), ("p50_ttft_s", "P50", False, "relative"),
           ("p90_ttft_s", "P90", False, "relative"))


def is_subject(run: dict[str, Any], label: str = DEFAULT_SUBJECT_LABEL) -> bool:
    """The run judged: prefixroute's :data:`SUBJECT` under ``label``."""
    return run["router"] == "prefixroute" and run["strategy"] == SUBJECT and run["label"] == label


def subject_name(label: str) -> str:
    """How the tables name the run judged (``CACHE_AWARE``, ``CACHE_AWARE precise``)."""
    return label.removeprefix("prefixroute ")


def is_peer(run: dict[str, Any]) -> bool:
    """A router of the field (or the llm-d arm), not one of prefixroute's own strategies."""
    return run["router"] != "prefixroute" or run["strategy"] == "LLMD_REFERENCE"


#: What every run of a file must name.
_RUN_KEYS = ("workload", "replicas", "label", "router", "strategy")


def load_docs(paths: Sequence[Path]) -> list[dict[str, Any]]:
    """Each file's JSON document, checked: a dict with a ``runs`` list whose runs are
    dicts naming :data:`_RUN_KEYS`.

    Raises:
        ValueError: a file is not JSON or not a policy_vs_peers JSON (the message names it).
    """
    out = []
    for p in paths:
        try:
            doc = json.loads(Path(p).read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ValueError(f"{p}: not JSON ({exc})") from None
        if not isinstance(doc, dict) or not isinstance(doc.get("runs"), list):
            raise ValueError(f"{p}: not a bench/policy_vs_peers.py JSON (no 'runs' list)")
        for i, r in enumerate(doc["runs"]):
            if not isinstance(r, dict) or any(k not in r for k in _RUN_KEYS):
                raise ValueError(f"{p}: run {i} is not a benchmark run (it must name {', '.join(_RUN_KEYS)})")
        out.append(doc)
    return out


def load_runs(paths: Sequence[Path]) -> list[list[dict[str, Any]]]:
    """The ``runs`` of each file (a run repeated within one file is already its median).

    Raises:
        ValueError: a file is not a policy_vs_peers JSON.
    """
    return [doc["runs"] for doc in load_docs(paths)]


def _figure(run: dict[str, Any], field: str) -> float | None:
    """A run's figure as a number, or ``None`` when it is missing, not a number or NaN."""
    v = run.get(field)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v != v:
        return None
    return float(v)


#: Settings that may differ between the runs judged and the noise runs.
_FREE_SETTINGS = ("replicas", "repeat", "multi_replica_workloads", "baselines_replicas")


def settings_differences(judged: Sequence[dict[str, Any]], noise_docs: Sequence[dict[str, Any]]) -> list[str]:
    """The settings (other than :data:`_FREE_SETTINGS`) whose values differ between the
    judged files and the noise files, as ``name: judged values / noise values``."""
    def values(docs: Sequence[dict[str, Any]], key: str) -> list[str]:
        return sorted({json.dumps((d.get("settings") or {}).get(key), sort_keys=True) for d in docs})

    keys = sorted({k for d in [*judged, *noise_docs] for k in (d.get("settings") or {}) if k not in _FREE_SETTINGS})
    out = []
    for k in keys:
        a, b = values(judged, k), values(noise_docs, k)
        if a != b:
            out.append(f"{k}: {', '.join(a)} / {', '.join(b)}")
    return out


Cell = tuple[str, int, str]  # workload, replicas, label


def cells(files: Sequence[Sequence[dict[str, Any]]]) -> dict[Cell, list[dict[str, Any]]]:
    """Every (workload, replicas, label) and its run in each file that has it."""
    out: dict[Cell, list[dict[str, Any]]] = {}
    for runs in files:
        for r in runs:
            out.setdefault((r["workload"], int(r["replicas"]), r["label"]), []).append(r)
    return out


def median_run(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The first run with every compared figure and the error count replaced by their medians."""
    m = dict(runs[0])
    for field, *_ in FIGURES:
        vals = [v for v in (_figure(r, field) for r in runs) if v is not None]
        m[field] = statistics.median(vals) if vals else None
    m["errors"] = max(int(r.get("errors") or 0) for r in runs)
    m["files"] = len(runs)
    return m


@dataclass(frozen=True)
class Noise:
    """Run-to-run spread of one figure: ``p90`` over all cells seen in 2+ files
    (points for the hit rate, a fraction for TTFT), ``median`` likewise; ``cells``
    how many cells it is measured on (0: no second file, the noise is taken as 0)."""

    figure: str
    median: float
    p90: float
    cells: int


def noise(table: dict[Cell, list[dict[str, Any]]]) -> dict[str, Noise]:
    """Per figure label (hit, P50, P90): its :class:`Noise`."""
    out = {}
    for field, label, _, kind in FIGURES:
        spreads = []
        for runs in table.values():
            vals = [v for v in (_figure(r, field) for r in runs) if v is not None]
            if len(vals) < 2:
                continue
            lo, hi = min(vals), max(vals)
            if kind != "points" and lo <= 0:
                continue  # (a relative spread from 0 means nothing)
            spreads.append((hi - lo) * 100 if kind == "points" else hi / lo - 1)
        if spreads:
            spreads.sort()
            out[label] = Noise(label, statistics.median(spreads), spreads[min(len(spreads) - 1,
                                                                                int(0.9 * len(spreads)))],
                               len(spreads))
        else:
            out[label] = Noise(label, 0.0, 0.0, 0)
    return out


@dataclass(frozen=True)
class Verdict:
    """CACHE_AWARE on one workload and replica count against the best peer per figure.

    ``best[label] = (peer label, its value)``; ``subject[label]`` CACHE_AWARE's value;
    ``leads[label]`` whether it is better or within the figure's noise; ``errors`` its
    error count."""

    workload: str
    replicas: int
    subject: dict[str, float]
    best: dict[str, tuple[str, float]]
    leads: dict[str, bool]
    errors: int

    @property
    def all_lead(self) -> bool:
        return all(self.leads.values()) and self.errors == 0


def verdicts(medians: dict[Cell, dict[str, Any]], tolerance: dict[str, Noise],
             subject: str = DEFAULT_SUBJECT_LABEL) -> list[Verdict]:
    """One :class:`Verdict` per (workload, replicas) where the run labelled ``subject``
    (:func:`is_subject`) and a peer ran."""
    groups: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for (wl, reps, _), r in medians.items():
        groups.setdefault((wl, reps), []).append(r)
    out = []
    for (wl, reps), runs in groups.items():
        subj = next((r for r in runs if is_subject(r, subject)), None)
        peers = [r for r in runs if is_peer(r)]
        if subj is None or not peers:
            continue
        best, value, leads = {}, {}, {}
        for field, label, higher, kind in FIGURES:
            pick = max if higher else min
            known = [r for r in peers if _figure(r, field) is not None]
            mine = _figure(subj, field)
            if not known:
                continue  # no peer has this figure: nothing to compare
            b = pick(known, key=lambda r: r[field])
            best[label] = (b["label"], b[field])
            value[label] = mine if mine is not None else math.nan
            tol = tolerance[label].p90
            if mine is None:
                leads[label] = False  # a figure the subject does not have is not a lead
            elif higher:
                leads[label] = mine * 100 >= b[field] * 100 - tol - 1e-9
            else:
                leads[label] = mine <= b[field] * (1 + tol) + 1e-12
        out.append(Verdict(wl, reps, value, best, leads, int(subj["errors"])))
    return out


def replica_drift(medians: dict[Cell, dict[str, Any]], subject: str = DEFAULT_SUBJECT_LABEL
                  ) -> dict[str, dict[int, float]]:
    """Per workload: the ``subject`` run's hit rate (fraction) at each replica count."""
    out: dict[str, dict[int, float]] = {}
    for (wl, reps, _), r in medians.items():
        if is_subject(r, subject) and r.get("cache_hit_rate") is not None:
            out.setdefault(wl, {})[reps] = r["cache_hit_rate"]
    return out


def _fmt(label: str, v: float) -> str:
    return f"{v * 100:.1f} %" if label == "hit" else f"{v * 1000:.0f} ms"


def _short(label: str) -> str:
    return (label.replace(" (re-implementation)", "").replace("hash-balance-factor", "hash")
            .replace("vllm-router ", "vllm ").replace("sglang-router ", "sglang "))


def render(table: dict[Cell, list[dict[str, Any]]],
           noise_table: dict[Cell, list[dict[str, Any]]] | None = None,
           subject: str = DEFAULT_SUBJECT_LABEL) -> Iterable[str]:
    """The report's lines: noise, verdicts, replica drift. ``noise_table``: the runs the
    noise is measured on (default: ``table`` itself); ``subject``: the label of the run
    judged."""
    name = subject_name(subject)
    tol = noise(table if noise_table is None else noise_table)
    medians = {c: median_run(r) for c, r in table.items()}
    files = max((len(r) for r in table.values()), default=0)
    yield f"{files} run(s) per cell"
    if noise_table is not None:
        yield f"noise measured on other runs: {max((len(r) for r in noise_table.values()), default=0)} file(s)"
    yield ""
    yield "| figure | noise, median | noise, 90th percentile | cells |"
    yield "|---|---:|---:|---:|"
    for label, n in tol.items():
        unit = (lambda x: f"{x:.1f} pts") if label == "hit" else (lambda x: f"{x * 100:.0f} %")
        yield f"| {label} | {unit(n.median)} | {unit(n.p90)} | {n.cells} |"
    yield ""
    vs = sorted(verdicts(medians, tol, subject), key=lambda v: (_order(v.workload, table), v.replicas))
    yield f"| workload | replicas | hit: {name} / best peer | P50 TTFT | P90 TTFT | leads |"
    yield "|---|---:|---|---|---|---|"
    for v in vs:
        cols = []
        for label in ("hit", "P50", "P90"):
            if label not in v.best:
                cols.append("- (no peer has it)")
                continue
            who, b = v.best[label]
            mark = "" if v.leads[label] else " **behind**"
            cols.append(f"{_fmt(label, v.subject[label])} / {_fmt(label, b)} {_short(who)}{mark}")
        verdict = "yes" if v.all_lead else ("errors" if v.errors else "no")
        yield f"| {v.workload} | {v.replicas} | {cols[0]} | {cols[1]} | {cols[2]} | {verdict} |"
    led = sum(v.all_lead for v in vs)
    yield ""
    yield f"{name} leads on hit rate, P50 and P90 TTFT (within the noise above) in {led} of {len(vs)} groups"
    yield ""
    yield "| workload | hit, 1 replica | 4 replicas | 8 replicas | largest change from 1 |"
    yield "|---|---:|---:|---:|---:|"
    for wl, by in sorted(replica_drift(medians, subject).items(), key=lambda kv: _order(kv[0], table)):
        if 1 not in by:
            continue
        drift = max(((by[r] - by[1]) * 100 for r in by if r != 1), key=abs, default=0.0)
        yield (f"| {wl} | {by[1] * 100:.1f} % | " + " | ".join(f"{by[r] * 100:.1f} %" if r in by else "-"
                                                           for r in (4, 8)) + f" | {drift:+.1f} pts |")


def workload_tables(table: dict[Cell, list[dict[str, Any]]], subject: str = DEFAULT_SUBJECT_LABEL) -> Iterable[str]:
    """One Markdown table per workload: every router and replica count, medians over the files."""
    medians = {c: median_run(r) for c, r in table.items()}
    workloads: list[str] = []
    for wl, _, _ in table:
        if wl not in workloads:
            workloads.append(wl)
    for wl in workloads:
        yield f"### {wl}"
        yield ""
        yield "| router | replicas | cache hit | P50 TTFT | P90 TTFT | throughput | busiest | errors |"
        yield "|---|---:|---:|---:|---:|---:|---:|---:|"
        rows = [(c, r) for c, r in medians.items() if c[0] == wl]
        for (_, reps, label), r in sorted(rows, key=lambda cr: cr[0][1]):
            name = f"**{label}**" if is_subject(r, subject) else label
            thr = r.get("throughput_rps")
            busy = r.get("busiest_share")
            yield (f"| {name} | {reps} | {r['cache_hit_rate'] * 100:.1f} % | {r['p50_ttft_s'] * 1000:.0f} ms | "
                   f"{r['p90_ttft_s'] * 1000:.0f} ms | {'-' if thr is None else f'{thr:.1f} rps'} | "
                   f"{'-' if busy is None else f'{busy * 100:.0f} %'} | {r['errors']} |")
        yield ""


def _order(workload: str, table: dict[Cell, list[dict[str, Any]]]) -> int:
    seen: list[str] = []
    for wl, _, _ in table:
        if wl not in seen:
            seen.append(wl)
    return seen.index(workload) if workload in seen else len(seen)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("runs", nargs="+", type=Path, help="JSON of bench/policy_vs_peers.py runs (--json)")
    p.add_argument("--tables", action="store_true", help="also print one table per workload (every router)")
    p.add_argument("--noise-from", nargs="+", type=Path, metavar="JSON", default=None,
                   help="measure the noise on these runs (two or more other JSON files of the same settings, "
                        "e.g. a run and its repeat) instead of on the runs judged; put it after the runs, or end "
                        "its list with --")
    p.add_argument("--subject", default=DEFAULT_SUBJECT_LABEL, metavar="LABEL",
                   help="the label of the prefixroute CACHE_AWARE run to judge (default: %(default)r, the learned "
                        "view; 'prefixroute CACHE_AWARE precise' for precise mode in a --precise run)")
    args = p.parse_args(argv)
    try:
        docs = load_docs(args.runs)
        noise_docs = load_docs(args.noise_from) if args.noise_from else None
    except (OSError, ValueError) as exc:
        p.error(str(exc))
    table = cells([d["runs"] for d in docs])
    if not any(is_subject(r, args.subject) for d in docs for r in d["runs"]):
        labels = sorted({r["label"] for d in docs for r in d["runs"] if r["router"] == "prefixroute"
                         and r["strategy"] == SUBJECT})
        p.error(f"--subject: no {SUBJECT} run is labelled {args.subject!r} (the files have: "
                f"{', '.join(map(repr, labels)) or 'none'})")
    noise_table = None
    if noise_docs is not None:
        judged = {Path(x).resolve() for x in args.runs}
        given = [Path(x).resolve() for x in args.noise_from]
        if len(set(given)) != len(given):
            p.error("--noise-from: a file is named twice; the noise is the spread between different runs")
        if judged & set(given):
            p.error("--noise-from: a file judged is also a noise file; the noise must come from other runs")
        noise_table = cells([d["runs"] for d in noise_docs])
        empty = [label for label, n in noise(noise_table).items() if not n.cells]
        if empty:
            p.error(f"--noise-from: no cell has {', '.join(empty)} in two of these files; give two or more runs "
                    "of the same settings")
        for diff in settings_differences(docs, noise_docs):
            print(f"warning: --noise-from: settings differ (judged / noise): {diff}", file=sys.stderr)
        groups = {(wl, reps) for wl, reps, _ in table}
        own = {(wl, reps) for (wl, reps, _), runs in noise_table.items() if len(runs) > 1} & groups
        print(f"note: {len(own)} of {len(groups)} judged groups have noise cells of their own; the others are "
              "judged with the noise of other cells", file=sys.stderr)
    for line in render(table, noise_table, args.subject):
        print(line)
    if args.tables:
        print()
        for line in workload_tables(table, args.subject):
            print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
