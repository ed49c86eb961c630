"""`prefixroute demo` end to end: real processes, real HTTP, SPEC §7 JSON."""

import json
import subprocess
import sys

import pytest

from prefixroute.demo.report import percentile, summarize
from prefixroute.demo.loadgen import RequestResult

SPEC_FIELDS = {"router", "strategy", "replicas", "requests", "errors", "p50_ttft_s", "p90_ttft_s",
               "p50_latency_s", "cache_hit_rate", "throughput_rps", "instance_share"}


@pytest.mark.e2e
def test_small_demo_writes_spec_json_and_prefix_aware_wins(tmp_path):
    out = tmp_path / "demo.json"
    proc = subprocess.run(
        [sys.executable, "-m", "prefixroute", "demo", "--instances", "3", "--groups", "12",
         "--prefix-tokens", "1024", "--kv-capacity-tokens", "8192", "--users", "6", "--duration", "4",
         "--time-scale", "0.5", "--concurrency-threshold", "6", "--prefix-length", "1024",
         "--json", str(out), "--out-dir", str(tmp_path / "plots")],
        capture_output=True, text=True, timeout=180,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc = json.loads(out.read_text())
    assert doc["workload"].startswith("shared-prefix groups=12 prefix_tokens=1024")
    runs = {r["strategy"]: r for r in doc["runs"]}
    assert list(runs) == ["RANDOM", "LEAST_OUTSTANDING_REQUESTS", "PREFIX_AWARE"]
    for r in runs.values():
        assert SPEC_FIELDS <= set(r)
        assert r["errors"] == 0
        assert r["requests"] > 20
        assert len(r["instance_share"]) == 3
        assert sum(r["instance_share"]) == pytest.approx(1.0)
        assert 0 < r["p50_ttft_s"] <= r["p90_ttft_s"]
    # 12 groups of 1,024 tokens do not fit one 8,192-token cache but fit three. The threshold
    # equals the users, so PREFIX_AWARE never overflows and its hit rate depends on the groups'
    # rendezvous homes alone (they follow the engines' fresh ports): 0.87-0.90 in 8 runs, even
    # with 64 % of the requests on one instance; with threshold 4 an unlucky draw gave 0.68.
    assert runs["PREFIX_AWARE"]["cache_hit_rate"] > runs["RANDOM"]["cache_hit_rate"] + 0.15
    assert (tmp_path / "plots" / "ttft_cdf.png").stat().st_size > 1000
    assert (tmp_path / "plots" / "instance_share.png").stat().st_size > 1000
    assert "PREFIX_AWARE" in proc.stdout and "cache hit" in proc.stdout


def test_demo_rejects_bad_settings():
    proc = subprocess.run([sys.executable, "-m", "prefixroute", "demo", "--prefix-length", "10"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "PrefixLength: 10 is out of range (allowed 1,024-65,536)" in proc.stderr


def test_percentile():
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert percentile([1.0, 2.0], 90) == pytest.approx(1.9)
    assert percentile([], 50) != percentile([], 50)  # nan


def test_summarize_converts_to_model_time_and_shares():
    results = [
        RequestResult(0, 0, 0.0, ttft_s=0.01, latency_s=0.1, instance="a", decision="affinity"),
        RequestResult(1, 0, 0.0, ttft_s=0.03, latency_s=0.3, instance="a", decision="overflow"),
        RequestResult(2, 1, 0.0, ttft_s=0.02, latency_s=0.2, instance="b", decision="affinity"),
        RequestResult(3, 1, 0.0, error="HTTP 503"),
    ]
    s = summarize("PREFIX_AWARE", results, wall_s=1.0, time_scale=0.1, instances=["a", "b", "c"],
                  cache_hits=30, cache_queries=40)
    assert s.requests == 4 and s.errors == 1
    assert s.p50_ttft_s == pytest.approx(0.2)
    assert s.cache_hit_rate == pytest.approx(0.75)
    assert s.throughput_rps == pytest.approx(0.3)  # 3 ok in 1 real s = 10 model s
    assert s.instance_share == pytest.approx([2 / 3, 1 / 3, 0.0])
    assert s.overflow_rate == pytest.approx(1 / 3)


@pytest.mark.e2e
def test_multi_model_demo_reports_each_component(tmp_path):
    out = tmp_path / "demo.json"
    # Caches of 4,096 tokens hold 3 of a component's 6 documents: RANDOM thrashes them
    # (about 0.55 hits) where PREFIX_AWARE keeps 3 on each copy (about 0.8); at 6,144 every
    # copy held all 6 and the gap (0.76 against 0.89) once closed in CI under load.
    proc = subprocess.run(
        [sys.executable, "-m", "prefixroute", "demo", "--multi-model", "--instances", "4", "--groups", "12",
         "--prefix-tokens", "1024", "--kv-capacity-tokens", "4096", "--users", "6", "--duration", "4",
         "--time-scale", "0.5", "--concurrency-threshold", "6", "--prefix-length", "1024",
         "--strategies", "random,prefix-aware", "--json", str(out), "--no-plots"],
        capture_output=True, text=True, timeout=180,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    runs = {r["strategy"]: r for r in json.loads(out.read_text())["runs"]}
    assert list(runs) == ["RANDOM", "PREFIX_AWARE"]
    for r in runs.values():
        assert r["errors"] == 0 and len(r["instance_share"]) == 4
        comps = r["components"]
        assert set(comps) == {"llama-70b", "qwen-72b"}
        for c in comps.values():
            assert c["requests"] > 10 and c["served_elsewhere"] == 0  # each on its own two copies only
            assert len(c["instance_share"]) == 2 and sum(c["instance_share"]) == pytest.approx(1.0)
            assert 0 <= c["cache_hit_rate"] <= 1
        # every request went to a copy of its component: the first two instances serve one, the others the other
        assert sum(r["instance_share"]) == pytest.approx(1.0)
    # Which copy PREFIX_AWARE puts a document on is a hash of the instances' URLs, whose
    # ports change every run: one split in five puts 5 of a component's 6 documents on
    # one copy, whose cache holds 3, and that component's hits fall to RANDOM's (CI: 0.565
    # against 0.579; 0.66-0.90 in 6 runs on a loaded machine). The two components split
    # independently: their mean keeps PREFIX_AWARE's lead, and no component falls far behind.
    hits = {s: [runs[s]["components"][n]["cache_hit_rate"] for n in ("llama-70b", "qwen-72b")] for s in runs}
    assert sum(hits["PREFIX_AWARE"]) / 2 > sum(hits["RANDOM"]) / 2 + 0.03, hits
    assert all(p > r - 0.1 for p, r in zip(hits["PREFIX_AWARE"], hits["RANDOM"])), hits
    assert "Per inference component" in proc.stdout and "qwen-72b" in proc.stdout


def test_multi_model_demo_needs_emulated_engines_and_two_instances():
    for flags, needle in ((["--engine", "llama-cpp"], "emulated engines only"),
                          (["--instances", "1"], "at least 2 instances")):
        proc = subprocess.run([sys.executable, "-m", "prefixroute", "demo", "--multi-model", *flags],
                              capture_output=True, text=True, timeout=60)
        assert proc.returncode == 2 and needle in proc.stderr, proc.stderr


def test_precise_demo_runs_cache_aware_even_when_the_strategies_leave_it_out():
    from prefixroute.cli import build_parser
    from prefixroute.core.config import RoutingStrategy
    from prefixroute.demo.cli import _arms, _check

    args = build_parser().parse_args(["demo", "--precise", "--strategies", "random,prefix-aware"])
    strategies = _check(args)
    assert strategies == [RoutingStrategy.RANDOM, RoutingStrategy.PREFIX_AWARE, RoutingStrategy.CACHE_AWARE]
    assert (RoutingStrategy.CACHE_AWARE, True) in _arms(args, strategies)
    plain = build_parser().parse_args(["demo", "--strategies", "random"])
    assert _check(plain) == [RoutingStrategy.RANDOM]
