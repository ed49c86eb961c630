"""The side-by-side benchmark's parts that need no peer router: configuration files,
the prefixroute launcher with a membership change, result aggregation and verdicts.

(The peers themselves, sglang-router, vllm-router and HAProxy, are installed by the
benchmark into an environment of its own and are not part of CI.)
"""

from __future__ import annotations

import asyncio
import itertools
import json
import sys
import time
import urllib.request
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import checkout  # noqa: E402
import peer_install  # noqa: E402
import peer_process  # noqa: E402
import peers  # noqa: E402
import policy_vs_peers as bench  # noqa: E402
import pvp_drive  # noqa: E402
import pvp_fleet  # noqa: E402
import pvp_output  # noqa: E402
import pvp_results  # noqa: E402
import pvp_routers  # noqa: E402
import pvp_settings  # noqa: E402
import pvp_verdicts  # noqa: E402
from prefixroute.core.config import FleetConfig  # noqa: E402
from prefixroute.demo.report import RunSummary  # noqa: E402


def test_haproxy_config_hashes_the_body_prefix_with_bounded_load_and_streams():
    cfg = peers.haproxy_config(8080, ["http://127.0.0.1:9001", "http://127.0.0.1:9002/"],
                               ["http://127.0.0.1:9001", "http://127.0.0.1:9002", "http://127.0.0.1:9003"],
                               "/tmp/x.sock", hash_bytes=4096, balance_factor=150)
    lines = [ln.strip() for ln in cfg.splitlines()]
    assert "balance hash req.body,bytes(0,4096)" in lines
    assert "option http-buffer-request" in lines  # the body must be read before hashing
    assert "hash-type consistent" in lines and "hash-balance-factor 150" in lines
    assert "option http-no-delay" in lines  # server-sent events are forwarded chunk by chunk
    assert "bind 127.0.0.1:8080" in lines
    servers = [ln for ln in lines if ln.startswith("server ")]
    assert servers == ["server s0 127.0.0.1:9001", "server s1 127.0.0.1:9002",
                       "server s2 127.0.0.1:9003 disabled"]
    bufsize = int(next(ln for ln in lines if ln.startswith("tune.bufsize")).split()[1])
    assert bufsize >= 4096 + 8192  # the hashed bytes plus the request head fit one buffer


def test_haproxy_config_rejects_what_haproxy_would():
    with pytest.raises(ValueError, match="hash-balance-factor"):
        peers.haproxy_config(1, ["http://127.0.0.1:2"], [], "/s", balance_factor=90)
    with pytest.raises(ValueError, match="http://HOST:PORT"):
        peers.haproxy_config(1, ["127.0.0.1:2"], [], "/s")
    assert "hash-balance-factor" not in peers.haproxy_config(1, ["http://127.0.0.1:2"], [], "/s", balance_factor=0)


def test_prefixroute_fleet_config_is_a_valid_fleet_for_every_benchmarked_strategy():
    for spec in pvp_routers.router_specs(pvp_settings.FULL):
        if spec.router != "prefixroute":
            continue
        doc = peers.prefixroute_fleet_config(["http://127.0.0.1:9001/", "http://127.0.0.1:9002"], spec.routing)
        cfg = FleetConfig.from_mapping(doc)
        variant = cfg.endpoints[0].variants[0]
        assert list(variant.instances) == ["http://127.0.0.1:9001", "http://127.0.0.1:9002"]
        assert variant.routing.strategy.value == spec.strategy


def test_router_set_covers_the_field():
    labels = [r.label for r in pvp_routers.router_specs(pvp_settings.FULL)]
    assert labels == ["prefixroute RANDOM", "prefixroute LEAST_OUTSTANDING", "prefixroute PREFIX_AWARE",
                      "prefixroute CACHE_AWARE", "llm-d scorers (re-implementation)", "sglang-router cache_aware",
                      "vllm-router cache_aware", "vllm-router consistent_hash", "haproxy hash-balance-factor"]
    assert {r.peer for r in pvp_routers.router_specs(pvp_settings.FULL)} == \
        {"", "sglang-router", "vllm-router", "haproxy"}


def test_workloads_are_seeded_and_have_text_sessions():
    names = [w.name for w in pvp_settings.WORKLOADS]
    assert names == ["shared-prefix", "multi-turn", "long-system-prompt", "zipf-hot-groups", "membership-change",
                     "hot-prefix", "near-saturation", "sharegpt-multi-turn", "agentic", "images"]
    assert [w.name for w in pvp_settings.WORKLOADS if w.open_loop] == ["near-saturation"]
    for w in pvp_settings.WORKLOADS:
        a, b = w.make(3), w.make(3)
        assert a.describe() == b.describe()
        sa, sb = next(iter(a.sessions())), next(iter(b.sessions()))
        assert sa.body(0, []) == sb.body(0, [])
        assert w.session_key(sa) == w.session_key(sb)
    assert sum(w.membership is not None for w in pvp_settings.WORKLOADS) == 1


def test_quick_settings_run_more_replicas_on_one_workload_only():
    args = bench.parse_args(["--quick"])
    s = bench.settings_from(args)
    assert s.duration_s < pvp_settings.FULL.duration_s
    assert s.replicas == (1, 4, 8) and s.multi_replica_workloads == ("shared-prefix",)
    s = bench.settings_from(bench.parse_args(["--replicas", "1,2", "--duration", "7"]))
    assert s.replicas == (1, 2) and s.duration_s == 7
    with pytest.raises(SystemExit):
        bench.settings_from(bench.parse_args(["--replicas", "0"]))


def _run(workload: str, label: str, strategy: str, replicas: int, hit: float, p50: float, p90: float,
         errors: int = 0) -> pvp_results.RunResult:
    summary = RunSummary(router=label.split()[0], strategy=strategy, replicas=replicas, requests=100, errors=errors,
                         p50_ttft_s=p50, p90_ttft_s=p90, p50_latency_s=1.0, cache_hit_rate=hit,
                         throughput_rps=10.0, instance_share=[0.5, 0.3, 0.2])
    return pvp_results.RunResult(workload, label, summary)


def test_verdicts_say_where_the_subject_loses_and_by_how_much():
    runs = [
        _run("w", "prefixroute CACHE_AWARE", "CACHE_AWARE", 1, 0.90, 0.100, 0.300),
        _run("w", "sglang-router cache_aware", "cache_aware", 1, 0.92, 0.120, 0.250),
        _run("w", "prefixroute RANDOM", "RANDOM", 1, 0.40, 0.400, 0.900),
        _run("w", "prefixroute CACHE_AWARE", "CACHE_AWARE", 4, 0.89, 0.100, 0.300),
        _run("w", "prefixroute RANDOM", "RANDOM", 4, 0.40, 0.400, 0.900),
    ]
    comps = {(c.replicas, c.other): c for c in pvp_verdicts.compare(runs)}
    sg = comps[(1, "sglang-router cache_aware")]
    assert sg.hit_points == pytest.approx(-2.0)
    assert sg.p50_ratio == pytest.approx(100 / 120) and sg.p90_ratio == pytest.approx(1.2)
    assert not sg.wins and comps[(1, "prefixroute RANDOM")].wins
    assert pvp_verdicts.replica_drift(runs) == {"w": pytest.approx(-1.0)}
    lines = pvp_verdicts.verdict_lines(runs)
    assert "w, 1 replica: vs sglang-router cache_aware: hit -2.0 pts, P90 +20 %" in lines
    assert any(ln.startswith("w, 4 replicas: CACHE_AWARE has the highest hit rate") for ln in lines)
    assert "w: CACHE_AWARE hit rate with 4 replicas vs 1: -1.0 pts (within 2 pts)" in lines


def test_json_has_spec_fields_and_the_extras(tmp_path):
    runs = [_run("shared-prefix", "prefixroute CACHE_AWARE", "CACHE_AWARE", 1, 0.9, 0.1, 0.2),
            _run("shared-prefix", "haproxy hash-balance-factor", "hash", 1, 0.8, 0.2, 0.4, errors=1)]
    out = tmp_path / "r.json"
    pvp_output.write_json(out, pvp_settings.WORKLOADS[:1], {"shared-prefix": "desc"}, runs, pvp_settings.QUICK, "cmd",
                          {"x": "why"})
    doc = json.loads(out.read_text())
    assert doc["workload"].startswith("policy_vs_peers: shared-prefix (desc)")
    spec_fields = {"router", "strategy", "replicas", "requests", "errors", "p50_ttft_s", "p90_ttft_s",
                   "p50_latency_s", "cache_hit_rate", "throughput_rps", "instance_share"}
    for r in doc["runs"]:
        assert spec_fields <= set(r)
        assert r["workload"] == "shared-prefix" and r["busiest_share"] == 0.5
    assert doc["skipped"] == {"x": "why"} and doc["command"] == "cmd"
    assert doc["comparisons"][0]["wins"] is True


def test_an_interrupted_run_resumes_from_its_json_with_the_same_settings_only(tmp_path):
    runs = [_run("shared-prefix", "prefixroute CACHE_AWARE", "CACHE_AWARE", 1, 0.9, 0.1, 0.2),
            _run("shared-prefix", "haproxy hash-balance-factor", "hash", 4, 0.8, 0.2, 0.4, errors=1)]
    out = tmp_path / "r.json"
    pvp_output.write_json(out, pvp_settings.WORKLOADS[:1], {"shared-prefix": "desc"}, runs, pvp_settings.QUICK, "cmd",
                          {})
    back = pvp_results.resume_runs(out, pvp_settings.QUICK)
    assert [(r.workload, r.label, r.summary.replicas, r.summary.errors) for r in back] == [
        ("shared-prefix", "prefixroute CACHE_AWARE", 1, 0), ("shared-prefix", "haproxy hash-balance-factor", 4, 1)]
    assert back[0].summary.cache_hit_rate == 0.9 and back[1].summary.p90_ttft_s == 0.4
    assert pvp_results.resume_runs(tmp_path / "none.json", pvp_settings.QUICK) == []
    with pytest.raises(SystemExit, match="other settings .*duration_s"):
        pvp_results.resume_runs(out, pvp_settings.FULL)


def test_a_resumed_file_keeps_each_runs_commit_and_every_command(tmp_path):
    first = _run("shared-prefix", "prefixroute CACHE_AWARE", "CACHE_AWARE", 1, 0.9, 0.1, 0.2)
    first.commit = "1111111"
    out = tmp_path / "r.json"
    pvp_output.write_json(out, pvp_settings.WORKLOADS[:1], {"shared-prefix": "d"}, [first], pvp_settings.QUICK,
                          "cmd one", {})
    assert pvp_results.resume_commands(out) == ["cmd one"] and pvp_results.resume_commands(tmp_path / "none.json") == []
    kept = pvp_results.resume_runs(out, pvp_settings.QUICK)
    assert [r.commit for r in kept] == ["1111111"]
    second = _run("shared-prefix", "haproxy hash-balance-factor", "hash", 1, 0.8, 0.2, 0.4)
    second.commit = "2222222+dirty"
    pvp_output.write_json(out, pvp_settings.WORKLOADS[:1], {"shared-prefix": "d"}, [*kept, second],
                          pvp_settings.QUICK, "cmd two", {}, earlier_commands=pvp_results.resume_commands(out))
    doc = json.loads(out.read_text())
    assert doc["command"] == "cmd two" and doc["earlier_commands"] == ["cmd one"]
    assert [r["commit"] for r in doc["runs"]] == ["1111111", "2222222+dirty"]
    assert pvp_results.resume_commands(out) == ["cmd one", "cmd two"]
    # This checkout's own commit: git's short hash, dirty or not.
    here = pvp_results.source_commit()
    assert here == "unknown" or len(here.removesuffix("+dirty")) == 7


def test_missing_python_peers_are_reported_not_installed(tmp_path):
    statuses = peer_install.ensure_python_peers(tmp_path / "no-venv", install=False)
    assert set(statuses) == {"sglang-router", "vllm-router"}
    for st in statuses.values():
        assert not st.available and "no virtual environment" in st.detail


@pytest.mark.e2e
def test_prefixroute_launcher_replicas_and_membership_change():
    s = pvp_settings.BenchSettings(time_scale=0.1, kv_capacity_tokens=20_000)
    spec = next(r for r in pvp_routers.router_specs(s) if r.strategy == "PREFIX_AWARE")
    with peer_process.ProcessTracker() as tracker:
        fleet = pvp_fleet.start_fleet(tracker, 3, s)
        urls = [u for _, u in fleet]
        routers = spec.start_replicas(tracker, 2, urls[:2], all_backends=urls)
        assert len({r.url for r in routers}) == 2
        for r in routers:
            r.add_backend(urls[2])
            r.remove_backend(urls[0])
            with urllib.request.urlopen(r.admin_url + "/admin/config", timeout=5) as resp:
                doc = json.loads(resp.read())
            assert doc["Endpoints"][0]["ProductionVariants"][0]["Instances"] == urls[1:]

        wl = pvp_settings.WORKLOADS[0].make(0)
        results, wall, log = asyncio.run(pvp_drive.drive([r.url for r in routers], iter(wl.sessions()),
                                                     pvp_settings.WORKLOADS[0].session_key, 4, 1.0, s.time_scale))
        assert results and all(not r.error for r in results)
        assert {r.instance for r in results} <= {"instance-1", "instance-2"}  # never the removed one
        assert wall > 0 and log == []


class _BindSpec(peers.RouterSpec):
    """A stand-in router: a real process that binds the next port of ``ports``."""

    def __init__(self, ports: list[int]) -> None:
        super().__init__("bind", "bind", "bind")
        self.ports = ports

    def start(self, tracker, backends, executable="", all_backends=(), ready_timeout_s=10.0):
        port = self.ports.pop(0)
        code = ("import socket, time; s = socket.socket(); s.bind(('127.0.0.1', %d)); s.listen(); "
                "time.sleep(60)" % port)
        proc = tracker.start("bind", [sys.executable, "-c", code])

        def listening() -> bool:
            import socket
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                return True
            except OSError:
                return False

        proc.wait_ready(listening, ready_timeout_s)
        return peers.RunningRouter(self, proc, f"http://127.0.0.1:{port}", backends)


def test_a_router_that_cannot_bind_is_started_again_on_another_port(tmp_path):
    import socket

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))  # held, not listening: a bind elsewhere fails with EADDRINUSE
    busy = taken.getsockname()[1]
    try:
        with peer_process.ProcessTracker(tmp_path) as tracker:
            spec = _BindSpec([busy, peer_process.free_port()])
            router = spec.start_retrying(tracker, [])
            assert router.url != f"http://127.0.0.1:{busy}" and spec.ports == []
            with pytest.raises(peer_process.PeerError, match="in use"):
                _BindSpec([busy, busy]).start_retrying(tracker, [], attempts=2)
    finally:
        taken.close()


def test_source_commit_names_the_commit_and_uncommitted_changes(tmp_path):
    import subprocess

    assert checkout.source_commit(tmp_path) is None  # not a git checkout
    git = ["git", "-C", str(tmp_path), "-c", "user.name=t", "-c", "user.email=t@example.invalid"]
    subprocess.run([*git, "init", "-q"], check=True)
    (tmp_path / "f.txt").write_text("one\n")
    subprocess.run([*git, "add", "f.txt"], check=True)
    subprocess.run([*git, "commit", "-q", "-m", "one"], check=True)
    head = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                          check=True).stdout.strip()
    assert checkout.source_commit(tmp_path) == head
    (tmp_path / "f.txt").write_text("two\n")
    assert checkout.source_commit(tmp_path) == head + "+uncommitted changes"


@pytest.mark.e2e
def test_open_loop_sessions_start_at_their_arrival_times_on_every_replica():
    from prefixroute.workloads.shared_prefix import SharedPrefixWorkload

    s = pvp_settings.BenchSettings(time_scale=0.05, kv_capacity_tokens=20_000)
    spec = next(r for r in pvp_routers.router_specs(s) if r.strategy == "CACHE_AWARE")
    wl = SharedPrefixWorkload(groups=4, prefix_tokens=200, question_tokens=8, output_tokens=4, arrival_rate=2.0,
                              ramp_s=4.0, seed=1)
    due = [x.start_s * s.time_scale for x in itertools.islice(wl.sessions(), 200) if x.start_s * s.time_scale < 1.5]
    with peer_process.ProcessTracker() as tracker:
        fleet = pvp_fleet.start_fleet(tracker, 2, s)
        urls = [u for _, u in fleet]
        routers = spec.start_replicas(tracker, 2, urls, all_backends=urls)
        t0 = time.perf_counter()
        results, wall, _ = asyncio.run(pvp_drive.drive([r.url for r in routers], iter(wl.sessions()),
                                                       lambda x: f"doc-{x.doc}", None, 1.5, s.time_scale))
    assert len(results) == len(due) >= 20 and all(not r.error for r in results)
    starts = sorted(r.start_s - t0 for r in results)
    # each request left at its arrival time (not before; the event loop and the first
    # connection may delay one a little), so the ramp shows: fewer in the first second
    assert all(got >= want - 0.005 for got, want in zip(starts, due))
    assert sum(1 for t in due if t < 0.75) < sum(1 for t in due if t >= 0.75)


def test_repeated_runs_are_summarised_by_their_medians():
    from prefixroute.demo.report import RunSummary

    def run(hit, p50, p90):
        sm = RunSummary(router="r", strategy="CACHE_AWARE", replicas=1, requests=10, errors=0, p50_ttft_s=p50,
                        p90_ttft_s=p90, p50_latency_s=1.0, cache_hit_rate=hit, throughput_rps=5.0,
                        instance_share=[0.5, 0.5])
        return pvp_results.RunResult("shared-prefix", "x", sm)

    med = pvp_results.median_run([run(0.9, 0.02, 0.20), run(0.8, 0.03, 0.05), run(0.95, 0.01, 0.06)])
    assert (med.summary.cache_hit_rate, med.summary.p50_ttft_s, med.summary.p90_ttft_s, med.repeats) == \
        (0.9, 0.02, 0.06, 3)


def test_precise_and_tier_modes_add_labelled_cache_aware_runs_and_their_verdicts():
    s = bench.settings_from(bench.parse_args(["--precise", "both", "--tiers", "cpu+shared", "--tier-aware", "both"]))
    labels = [r.label for r in pvp_routers.router_specs(s) if r.strategy == "CACHE_AWARE"]
    assert labels == ["prefixroute CACHE_AWARE", "prefixroute CACHE_AWARE precise",
                      "prefixroute CACHE_AWARE tier-unaware", "prefixroute CACHE_AWARE precise tier-unaware"]
    specs = {r.label: r for r in pvp_routers.router_specs(s)}
    assert specs["prefixroute CACHE_AWARE precise"].kv_events == pvp_routers.PRECISE_KV_EVENTS
    assert specs["prefixroute CACHE_AWARE"].kv_events is None
    for label, spec in specs.items():
        if spec.router == "prefixroute":
            FleetConfig.from_mapping(peers.prefixroute_fleet_config(["http://127.0.0.1:9001"], spec.routing,
                                                                    spec.kv_events))
    tiers = specs["prefixroute CACHE_AWARE"].routing["CacheAwareRoutingConfig"]["KvTiers"]
    assert tiers["CpuTierTokens"] == 4 * s.kv_capacity_tokens and tiers["SharedTier"] is True
    assert "KvTiers" not in specs["prefixroute CACHE_AWARE tier-unaware"].routing["CacheAwareRoutingConfig"]
    assert "tiny tokenizer" in s.fleet_mode and "cpu+shared" in s.fleet_mode
    runs = [_run("w", "prefixroute CACHE_AWARE", "CACHE_AWARE", 1, 0.90, 0.100, 0.300),
            _run("w", "prefixroute CACHE_AWARE precise", "CACHE_AWARE", 1, 0.91, 0.090, 0.310)]
    (c,) = pvp_verdicts.precise_comparisons(runs)
    assert (round(c["hit_points"], 1), round(c["p90_ratio"], 3), c["meets"]) == (1.0, 1.033, False)
    assert "precise vs learned view: hit +1.0 pts" in pvp_verdicts.precise_lines(runs)[0]


def test_a_precise_fleet_with_tiers_serves_every_workload_and_the_router_follows_its_events():
    s = pvp_settings.BenchSettings(time_scale=0.05, kv_capacity_tokens=20_000, precise="on", tiers="cpu+shared")
    spec = next(r for r in pvp_routers.router_specs(s) if r.label == "prefixroute CACHE_AWARE precise")
    with peer_process.ProcessTracker() as tracker:
        fleet = pvp_fleet.start_fleet(tracker, 2, s)
        urls = [u for _, u in fleet]
        (router,) = spec.start_replicas(tracker, 1, urls, all_backends=urls)
        for w in (pvp_settings.WORKLOADS[0], pvp_settings.WORKLOADS[-1]):  # documents, and questions about images
            results, _, _ = asyncio.run(pvp_drive.drive([router.url], iter(w.make(0).sessions()), w.session_key, 2,
                                                        1.0, s.time_scale))
            assert results and [r.error for r in results if r.error] == []
        # An instance is approximate while the router catches up on a backlog of its
        # events (a loaded machine): every one must be precise within a few seconds.
        deadline = time.monotonic() + 15
        while True:
            with urllib.request.urlopen(router.admin_url + "/admin/kv-events", timeout=5) as resp:
                doc = json.loads(resp.read())
            if {row["Mode"] for row in doc["Instances"]} == {"precise"} or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert {row["Mode"] for row in doc["Instances"]} == {"precise"}, doc["Instances"]
        assert sum(row["Blocks"] for row in doc["Instances"]) > 0


def test_the_simulators_bench_workloads_route_as_the_benchmark_does():
    """``prefixroute simulate --bench-workload`` ranks candidates for this benchmark, so
    its fleet and its PREFIX_AWARE and CACHE_AWARE settings must be the benchmark's."""
    from prefixroute.core.config import RoutingStrategy
    from prefixroute.sim.cli import BENCH_INSTANCES, BENCH_KV_TOKENS, bench_routing

    s = pvp_settings.BenchSettings()
    ca = bench_routing(RoutingStrategy.CACHE_AWARE).cache_aware
    assert (ca.concurrency_threshold, ca.instance_cache_tokens) == (s.cache_aware_threshold, s.kv_capacity_tokens) \
        == (64, 100_000)
    pa = bench_routing(RoutingStrategy.PREFIX_AWARE).prefix_aware
    assert (pa.prefix_length, pa.concurrency_threshold) == (s.prefix_length, s.concurrency_threshold)
    assert (BENCH_INSTANCES, BENCH_KV_TOKENS) == (s.instances, s.kv_capacity_tokens)


def test_tiny_tokenizer_engines_cost_what_default_engines_cost():
    """The tiny tokenizer gives the workloads' text about 0.55 of the default engine's
    tokens (4 bytes each); precise runs scale the engines' per-token costs and sizes by
    that ratio, so a request's modelled prefill and cache space, and so the fleet's
    capacity, are those of the peers' runs (the near-saturation workload stays at 85 %)."""
    from prefixroute.core.model_tokenizer import ModelTokenizer
    import argparse

    from prefixroute.engine.cli import config_from_args, configure_parser
    from prefixroute.engine.http_common import chat_prompt_text
    from prefixroute.engine.model import EngineConfig, step_duration
    from prefixroute.engine.tokenizer import count_tokens
    from prefixroute.workloads.catalog import bench_workload

    wl = bench_workload("near-saturation").make(0)
    assert pvp_fleet.tiny_token_ratio(wl, "off") == 1.0
    r = pvp_fleet.tiny_token_ratio(wl, "on")
    assert pvp_fleet.tiny_token_ratio(wl, "both") == r
    assert 0.5 < r < 0.6
    body = next(iter(wl.sessions())).body(0, [])  # one request, measured directly
    tiny = len(ModelTokenizer.load("tiny").chat_token_ids(body))
    default = count_tokens(chat_prompt_text(body, 576))
    assert abs(tiny / default - r) < 0.02

    s = pvp_settings.BenchSettings(precise="both", tiers="cpu+shared")
    argv = pvp_fleet.engine_args(s, Path("/tmp/shared.kv"), r)
    opts = dict(zip(argv[::2], argv[1::2]))
    assert int(opts["--kv-capacity-tokens"]) == round(100_000 * r)
    assert int(opts["--cpu-tier-tokens"]) == round(4 * 100_000 * r)
    assert int(opts["--shared-tier-tokens"]) == round(4 * 100_000 * 4 * r)
    assert opts["--tokenizer"] == "tiny"
    parser = argparse.ArgumentParser()
    configure_parser(parser)
    scaled = config_from_args(parser.parse_args(argv))  # the engine's own CLI takes them
    assert scaled.kv_capacity_tokens == round(100_000 * r) and scaled.cpu_tier_tokens == round(400_000 * r)
    d = EngineConfig()
    assert scaled.max_num_batched_tokens == round(8192 * r)
    assert scaled.cpu_load_s_per_token == pytest.approx(d.cpu_load_s_per_token / r)
    assert scaled.shared_load_s_per_token == pytest.approx(d.shared_load_s_per_token / r)
    assert scaled.shared_load_latency_s == d.shared_load_latency_s  # per request, not per token
    # One step prefilling this request's tiny tokens costs what its default tokens cost.
    chunk = min(tiny, scaled.max_num_batched_tokens)
    assert step_duration(scaled, chunk, 0) == pytest.approx(step_duration(d, round(chunk / r), 0), rel=1e-3)
    assert tiny * scaled.prefill_s_per_token == pytest.approx(default * d.prefill_s_per_token, rel=0.05)
    # Every workload has a ratio, image parts counted as the engines count them.
    ratios = {w.name: pvp_fleet.tiny_token_ratio(w.make(0), "on") for w in pvp_settings.WORKLOADS}
    assert all(0.5 < r < 0.65 for name, r in ratios.items() if name not in ("images", "sharegpt-multi-turn")), ratios
    assert 2.5 < ratios["images"] < 3.5  # the stand-in text of an image: finer tiny tokens
    # Answers resent in later turns count as the engines write them: one tiny token a
    # word, so a workload whose prompts are mostly earlier answers has a higher ratio
    # than its first turns alone (0.60).
    assert 0.7 < ratios["sharegpt-multi-turn"] < 0.85
    # Without precise mode the engines are the defaults, at the bench's KV capacity.
    assert pvp_fleet.engine_args(pvp_settings.BenchSettings(), None) == ["--kv-capacity-tokens", "100000"]
    for bad in (0.0, -1.0, float("nan")):
        with pytest.raises(ValueError):
            pvp_fleet.engine_args(s, None, bad)


def test_access_logs_go_to_prefixroute_runs_only_one_file_per_run(tmp_path):
    specs = {r.label: r for r in pvp_routers.router_specs(pvp_settings.FULL)}
    ca = specs["prefixroute CACHE_AWARE"]
    logged = pvp_routers.with_access_log(ca, tmp_path, "sharegpt-multi-turn", 8, 2)
    assert logged.extra_args[-2:] == ("--access-log", str(tmp_path / "sharegpt-multi-turn-prefixroute-cache-aware-x8-2.jsonl"))
    assert logged.extra_args[:-2] == ca.extra_args and logged.routing == ca.routing
    peer = specs["vllm-router consistent_hash"]
    assert pvp_routers.with_access_log(peer, tmp_path, "images", 1, 0) is peer
    assert pvp_routers.with_access_log(ca, None, "images", 1, 0) is ca
    assert bench.parse_args(["--access-logs", str(tmp_path / "logs")]).access_logs == tmp_path / "logs"
