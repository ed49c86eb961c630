"""The tuning advisor on a small trace, and the `simulate` / `tune` command lines."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from prefixroute.sim import instance_ids
from prefixroute.sim.tune import GridPoint, recommend, run_grid, tune_figure, tune_json, write_tune_plot
from prefixroute.demo.report import RunSummary
from prefixroute.workloads.shared_prefix import SharedPrefixWorkload
from prefixroute.workloads.traces import load_trace
from test_workloads_traces import recorded_trace

SPEC_FIELDS = {"router", "strategy", "replicas", "requests", "errors", "p50_ttft_s", "p90_ttft_s",
               "p50_latency_s", "cache_hit_rate", "throughput_rps", "instance_share"}


@pytest.fixture(scope="module")
def trace_path(tmp_path_factory):
    # every request begins with the same 1,500-character instruction, then one of 8
    # documents: a PrefixLength of 1,024 puts everything on one key.
    wl = SharedPrefixWorkload(groups=8, prefix_tokens=1500, question_tokens=40, output_tokens=8, arrival_rate=6.0,
                              instruction_tokens=375, seed=3)
    p = tmp_path_factory.mktemp("trace") / "trace.jsonl"
    recorded_trace(p, wl, 500)
    return p


def test_grid_and_recommendation_on_a_small_trace(trace_path, tmp_path) -> None:
    trace = load_trace(trace_path)
    from prefixroute.engine.model import EngineConfig

    result = run_grid(trace, instances=instance_ids(4), prefix_lengths=(1024, 4096), thresholds=(2, 16),
                      engine=EngineConfig(kv_capacity_tokens=6_000), jobs=1)
    assert [b.strategy for b in result.baselines] == ["RANDOM", "LEAST_OUTSTANDING_REQUESTS"]
    assert len(result.grid) == 4
    short = {p.concurrency_threshold: p for p in result.grid if p.prefix_length == 1024}
    long = {p.concurrency_threshold: p for p in result.grid if p.prefix_length == 4096}
    # too short a PrefixLength: one key; with a high threshold it piles onto one instance
    assert short[16].busiest_share > 0.5
    assert long[16].busiest_share < 0.45
    assert long[16].summary.cache_hit_rate > result.baselines[0].summary.cache_hit_rate
    rec = result.recommendation
    assert rec.point.prefix_length == 4096
    assert rec.reasons and "PrefixLength 4096" in rec.reasons[0]
    doc = tune_json(result)
    assert doc["recommendation"]["prefix_length"] == 4096
    assert len(doc["grid"]) == 6 and all(SPEC_FIELDS <= set(r) for r in doc["runs"])
    png = write_tune_plot(tmp_path / "tune.png", result)
    assert png.stat().st_size > 10_000
    fig = tune_figure(result)
    axes = fig.axes
    assert axes[0].get_legend() is None and axes[-1].get_legend() is not None  # the legend covers no data
    assert {t.get_text() for t in axes[-1].get_legend().get_texts()} == {"threshold 2", "threshold 16", "recommended"}
    for ax in axes[:5]:  # every grid point inside its panel's y-range
        lo, hi = ax.get_ylim()
        ys = [y for line in ax.lines if line.get_marker() == "o" for y in line.get_ydata()]
        assert ys and all(lo < y < hi for y in ys)
        assert hi - lo <= max(1e-6, (max(ys) - min(ys)) * 1.31, abs(max(ys)) * 0.041)  # the grid's range, padded


def _point(strategy, pl, ct, p90, hit, share=(0.5, 0.5), overflow=0.0):
    s = RunSummary("prefixroute-sim", strategy, 1, 100, 0, p90 / 2, p90, 1.0, hit, 10.0, list(share), overflow)
    return GridPoint(strategy, pl, ct, s)


def test_recommendation_rules() -> None:
    grid = [_point("PREFIX_AWARE", 1024, 4, 0.50, 0.80, (0.9, 0.1)),
            _point("PREFIX_AWARE", 2048, 4, 0.20, 0.80),
            _point("PREFIX_AWARE", 4096, 4, 0.205, 0.80),  # as fast and as good: the shorter one wins
            _point("PREFIX_AWARE", 8192, 4, 0.40, 0.30)]
    rec = recommend(grid, [_point("RANDOM", None, None, 0.6, 0.2)])
    assert (rec.point.prefix_length, rec.point.concurrency_threshold) == (2048, 4)
    assert any("shorter PrefixLength (1024)" in r and "concentrates" in r for r in rec.reasons)
    assert any("longer PrefixLength (4096)" in r for r in rec.reasons)
    assert any("Against RANDOM" in r for r in rec.reasons)
    # a baseline faster than every prefix-aware setting is recommended instead
    rec = recommend(grid, [_point("LEAST_OUTSTANDING_REQUESTS", None, None, 0.1, 0.2)])
    assert rec.point.strategy == "LEAST_OUTSTANDING_REQUESTS" and "beats" in rec.reasons[0]


def test_tune_command(trace_path, tmp_path) -> None:
    out = tmp_path / "tune.json"
    proc = subprocess.run(
        [sys.executable, "-m", "prefixroute", "tune", "--trace", str(trace_path), "--prefix-lengths", "1024,4096",
         "--thresholds", "4", "--instances", "3", "--kv-capacity-tokens", "6000", "--jobs", "2", "--no-progress",
         "--json", str(out), "--plot", str(tmp_path / "tune.png")],
        capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc = json.loads(out.read_text())
    assert set(doc) == {"workload", "runs", "grid", "recommendation"}
    assert doc["recommendation"]["reasons"]
    assert "Recommendation" in proc.stdout and (tmp_path / "tune.png").exists()
    bad = subprocess.run([sys.executable, "-m", "prefixroute", "tune", "--trace", str(tmp_path / "nope.jsonl")],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "cannot read trace" in bad.stderr


def test_simulate_command_writes_spec_json(tmp_path) -> None:
    out = tmp_path / "sim.json"
    proc = subprocess.run(
        [sys.executable, "-m", "prefixroute", "simulate", "--instances", "3", "--groups", "12", "--prefix-tokens",
         "1000", "--kv-capacity-tokens", "8000", "--rate", "4", "--duration", "60", "--prefix-length", "1024",
         "--concurrency-threshold", "4", "--replicas", "2", "--change", "add:30:instance-3", "--no-progress",
         "--json", str(out), "--out-dir", str(tmp_path / "plots")],
        capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc = json.loads(out.read_text())
    runs = {r["strategy"]: r for r in doc["runs"]}
    assert list(runs) == ["RANDOM", "LEAST_OUTSTANDING_REQUESTS", "PREFIX_AWARE"]
    for r in runs.values():
        assert SPEC_FIELDS <= set(r) and r["router"] == "prefixroute-sim" and r["replicas"] == 2
        assert len(r["instance_share"]) == 4 and r["errors"] == 0
    assert runs["PREFIX_AWARE"]["cache_hit_rate"] > runs["RANDOM"]["cache_hit_rate"]
    assert (tmp_path / "plots" / "ttft_cdf.png").exists()
    bad = subprocess.run([sys.executable, "-m", "prefixroute", "simulate", "--prefix-length", "10"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "PrefixLength: 10 is out of range" in bad.stderr


def test_published_table_lists_every_figure() -> None:
    from rich.console import Console

    from prefixroute.sim.cli import published_table
    from prefixroute.sim.scenarios import SCENARIOS

    rows = [RunSummary("prefixroute-sim", "RANDOM", 1, 10, 0, 0.3, 0.6, 1.0, 0.25, 3.5, [0.5, 0.5]),
            RunSummary("prefixroute-sim", "PREFIX_AWARE", 1, 10, 0, 0.08, 0.4, 1.0, 0.8, 4.0, [0.45, 0.55])]
    console = Console(width=200, record=True)
    console.print(published_table(SCENARIOS["aws-long-context"], rows))
    text = console.export_text()
    for needle in ("-77 … -71 %", "-73 %", "~25 % → ~82 %", "25.0 % → 80.0 %", "+14.3 %", "45.0 … 55.0 %"):
        assert needle in text


def test_a_benchmark_workload_takes_the_overhead_too(tmp_path) -> None:
    p50 = {}
    for ms in (0, 10):
        out = tmp_path / f"sim{ms}.json"
        proc = subprocess.run(
            [sys.executable, "-m", "prefixroute", "simulate", "--bench-workload", "images", "--strategies", "random",
             "--overhead-ms", str(ms), "--no-progress", "--no-plots", "--json", str(out)],
            capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        p50[ms] = json.loads(out.read_text())["runs"][0]["p50_latency_s"]
    assert p50[10] - p50[0] >= 0.009  # (it was ignored with --bench-workload)
