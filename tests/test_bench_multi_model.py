"""bench/multi_model.py: its LoRA part run short end to end (real processes), and the
pieces every part relies on: histogram quantiles, the acceptance rules.

(The full 16-configuration matrix takes minutes; its recorded run is in
docs/BENCHMARKS.md.)"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import mm_lora  # noqa: E402
import mm_matrix  # noqa: E402
import mm_metrics  # noqa: E402

SPEC_FIELDS = {"router", "strategy", "replicas", "requests", "errors", "p50_ttft_s", "p90_ttft_s",
               "p50_latency_s", "cache_hit_rate", "throughput_rps", "instance_share"}


def test_histogram_quantile_is_linear_within_buckets():
    buckets = {0.01: 10.0, 0.1: 30.0, 1.0: 40.0, float("inf"): 40.0}
    assert mm_metrics.histogram_quantile(buckets, 0.25) == pytest.approx(0.01)
    assert mm_metrics.histogram_quantile(buckets, 0.5) == pytest.approx(0.01 + 0.09 * 0.5)
    assert mm_metrics.histogram_quantile(buckets, 0.875) == pytest.approx(0.1 + 0.9 * 0.5)
    assert mm_metrics.histogram_quantile({}, 0.5) != mm_metrics.histogram_quantile({}, 0.5)  # nan


def _run(kind: str, api: str, stream: bool, strategy: str, hit: float, ttft: float, **extra) -> dict:
    return {"endpoint_kind": kind, "api": api, "stream": stream, "strategy": strategy, "cache_hit_rate": hit,
            "p50_ttft_s": ttft, "errors": 0, "error_kinds": [], "requests_served_elsewhere": 0, **extra}


def test_matrix_rules_name_each_failure():
    ok = [_run("single-model", "native", False, "RANDOM", 0.25, 0.2),
          _run("single-model", "native", False, "PREFIX_AWARE", 0.80, 0.03)]
    assert mm_matrix.check_matrix(ok) == []
    bad = [_run("single-model", "native", False, "RANDOM", 0.25, 0.2),
           _run("single-model", "native", False, "PREFIX_AWARE", 0.50, 0.1, errors=2, error_kinds=["HTTP 503"],
                requests_served_elsewhere=1, component_header_mismatches=3)]
    failures = mm_matrix.check_matrix(bad)
    assert len(failures) == 5
    assert any("2 errors" in f for f in failures) and any("hit rate 50.0% vs RANDOM 25.0%" in f for f in failures)
    assert any("not 60 % lower" in f for f in failures) and any("reached an engine without" in f for f in failures)


def _lora(autoload: bool, wait: float, load: float = 1.0, time_scale: float = 1.0, **adapter_waits: float) -> dict:
    """A LoRA run that passes every rule but the router-side wait's, which ``wait`` sets."""
    waits = {"lora-0": 0.0003, "lora-4": wait, **{k.replace("_", "-"): v for k, v in adapter_waits.items()}}
    return {"autoload": autoload, "sticky_set_violations": 0, "errors": 0, "loads": 5 if autoload else 0,
            "throttled_saturated": 0 if autoload else 40, "lora_load_s": load, "time_scale": time_scale,
            "max_router_wait_s": wait, "adapters": {a: {"sticky_set_max": 2, "max_router_wait_s": w}
                                                    for a, w in waits.items()}}


def test_lora_rule_no_request_waits_more_than_one_load():
    assert mm_lora.check_lora([_lora(True, 1.0096), _lora(False, 0.0004)]) == []  # one load and its 9.6 ms
    assert mm_lora.router_wait_limit(1.0, 1.0) == pytest.approx(1.2)  # + 20 %
    assert mm_lora.check_lora([_lora(True, 1.199)]) == []
    failures = mm_lora.check_lora([_lora(True, 2.05, lora_7=1.3)])  # two loads in a row for lora-4, 1.3 s for lora-7
    assert failures == ["LoRA autoload on: the router held a request 2.050 s, more than the 1.200 s allowed (one "
                        "load, 1 s, + 20 %, at least 50 ms of wall time; lora-4, lora-7)"]
    # the floor: a load that takes no time still leaves the router 50 ms of wall time (5 model s at scale 0.01)
    assert mm_lora.router_wait_limit(0.0, 1.0) == pytest.approx(0.05)
    assert mm_lora.check_lora([_lora(True, 4.9, load=0.0, time_scale=0.01)]) == []
    assert mm_lora.check_lora([_lora(True, 0.06, load=0.0)])[0].startswith("LoRA autoload on: the router held")
    # without autoload nothing is loaded, so there is no load to wait for: not this rule's business
    assert mm_lora.check_lora([_lora(False, 3.0)]) == []
    nan = float("nan")  # no answer carried X-Prefixroute-Overhead-Ms: not measured is not a pass
    assert mm_lora.check_lora([_lora(True, nan)]) == [
        "LoRA autoload on: no router-side wait was measured (no X-Prefixroute-Overhead-Ms)"]


@pytest.mark.e2e
def test_lora_part_runs_and_writes_spec_json(tmp_path):
    out = tmp_path / "mm.json"
    proc = subprocess.run([sys.executable, "bench/multi_model.py", "--quick", "--skip-matrix", "--json", str(out),
                           "--out-dir", str(tmp_path / "plots")],
                          capture_output=True, text=True, timeout=300, cwd=Path(__file__).resolve().parents[1])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["checks"] == {"failures": [], "passed": True}
    on, off = doc["runs"]
    for r in (on, off):
        assert SPEC_FIELDS <= set(r) and r["endpoint_kind"] == "lora" and r["api"] == "openai" and r["stream"]
        assert r["errors"] == 0 and r["sticky_set_violations"] == 0
        assert set(r["adapters"]) == set(mm_lora.ADAPTERS) and len(r["instance_share"]) == 4
        assert r["sticky_set_timeline"] and all(set(p["sizes"]) == set(mm_lora.ADAPTERS)
                                                for p in r["sticky_set_timeline"])
    assert on["autoload"] and on["loads"] >= 4 and on["engine_loads"] == on["loads"]  # lora-4..7 placed at least
    assert on["throttled_saturated"] == 0
    # the router's own wait, apart from the first byte: the placing loads (1 s each) at most, each measured
    assert on["router_wait_unknown"] == 0 and on["max_router_wait_s"] <= on["router_wait_limit_s"] == 1.2
    assert on["max_router_wait_s"] <= on["max_first_byte_s"]
    assert all(x["max_router_wait_s"] <= on["max_router_wait_s"] for x in on["adapters"].values())
    assert off["max_router_wait_s"] < 0.5  # nothing to wait for without autoload
    assert not off["autoload"] and off["loads"] == 0 and off["throttled_saturated"] > 0
    assert (tmp_path / "plots" / "sticky_sets_autoload_on.png").stat().st_size > 1000


def test_bad_flags_are_refused():
    for flags in (["--skip-matrix", "--skip-lora"], ["--prefix-length", "10"], ["--time-scale", "0"]):
        proc = subprocess.run([sys.executable, "bench/multi_model.py", *flags], capture_output=True, text=True,
                              timeout=60, cwd=Path(__file__).resolve().parents[1])
        assert proc.returncode == 2 and "error:" in proc.stderr
