"""Tiered KV caches of the emulated engine: a CPU tier per instance and a shared tier."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from prefixroute.core.config import RoutingConfig
from prefixroute.core.kvevents.events import AllBlocksCleared, BlockRemoved, BlockStored
from prefixroute.engine.core import EngineCore
from prefixroute.engine.kv_events import KvEventRecorder
from prefixroute.engine.kvcache import prompt_block_hashes
from prefixroute.engine.model import EngineConfig, step_duration
from prefixroute.engine.server import start_engine_server
from prefixroute.engine.shared_tier_file import PROBE, FileSharedTier
from prefixroute.engine.tiers import CpuTier, MemorySharedTier, runs
from prefixroute.engine.tokenizer import from_token_ids
from prefixroute.sim.simulator import SimConfig, Simulator, instance_ids
from prefixroute.workloads.shared_prefix import SharedPrefixWorkload

BS = 16
SMALL = EngineConfig(kv_capacity_tokens=20 * BS, max_num_seqs=4, max_num_batched_tokens=1024)


def prompt(seed: int, blocks: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1 << 30) for _ in range(blocks * BS + 1)]


def run_all(core: EngineCore) -> list[Any]:
    outs = []
    while core.has_work():
        outs.append(core.step())
    return outs


def finished(outs: list[Any], rid: str) -> Any:
    return next(o for s in outs for o in s.outputs if o.request_id == rid and o.finished)


def test_runs_groups_consecutive_positions() -> None:
    assert runs([]) == [] and runs([3]) == [(3, 4)] and runs([1, 2, 3, 7, 8, 10]) == [(1, 4), (7, 9), (10, 11)]


def test_cpu_tier_is_an_lru_victim_cache() -> None:
    tier = CpuTier(4)
    assert tier.put([1, 2, 3], 0, 3) == ([0, 1, 2], [])
    assert tier.put([9, 2, 5, 6], 1, 4) == ([2, 3], [1])  # 2 was held: touched; 1 is the least recent
    assert tier.match([2, 5, 6, 7], 0, 4) == 3 and tier.match([2, 5], 1, 2) == 1
    assert tier.put([7, 8], 0, 2) == ([0, 1], [3, 2])
    assert sorted(tier.clear()) == [5, 6, 7, 8] and len(tier) == 0
    with pytest.raises(ValueError):
        CpuTier(0)


@pytest.mark.parametrize("kind", ["memory", "file"])
def test_shared_tiers_keep_published_hashes_and_evict_the_least_recent(kind: str, tmp_path: Path) -> None:
    tier: Any = MemorySharedTier(PROBE) if kind == "memory" else FileSharedTier(str(tmp_path / "t"), PROBE)
    hashes = list(range(100, 100 + PROBE))
    stored, evicted = tier.put(hashes, [h + 1000 for h in hashes])
    assert stored == list(range(PROBE)) and evicted == [] and len(tier) == PROBE
    assert tier.put(hashes[:3], [0, 0, 0]) == ([], [])  # held: touched, not stored again
    assert tier.match(hashes, 0, PROBE) == PROBE and tier.match([1] + hashes, 0, 3) == 0
    assert tier.match([1] + hashes, 1, 3) == 2
    # A full tier evicts its least recently used block: hashes[2] (hashes[0] and [1] were
    # touched last, the others together before).
    assert tier.put([5], [5005]) == ([0], [1102])
    assert tier.match([5], 0, 1) == 1 and tier.match(hashes[2:3], 0, 1) == 0 and tier.match(hashes, 0, 2) == 2


def test_file_tier_is_shared_between_openers_and_checks_its_file(tmp_path: Path) -> None:
    path = str(tmp_path / "tier")
    with FileSharedTier(path, 64) as a, FileSharedTier(path, 10_000) as b:
        assert b.num_blocks == 64  # the creator's capacity
        assert a.put([11, 12, 0], [1, 2, 3]) == ([0, 1, 2], [])
        assert b.match([11, 12, 0, 13], 0, 4) == 3  # a hash of 0 is kept too
        assert len(b) == 3
    (tmp_path / "junk").write_bytes(b"not a tier" * 100)
    with pytest.raises(ValueError, match="not a prefixroute shared tier"):
        FileSharedTier(str(tmp_path / "junk"), 64)
    with pytest.raises(ValueError, match="at least"):
        FileSharedTier(str(tmp_path / "small"), 2)


def test_cpu_tier_hits_load_instead_of_prefilling() -> None:
    cfg = EngineConfig(kv_capacity_tokens=20 * BS, max_num_seqs=4, max_num_batched_tokens=1024,
                       cpu_tier_tokens=100 * BS)
    core = EngineCore(cfg)
    a, b = prompt(1, 12), prompt(2, 12)
    core.add_request("a", a, 1)
    run_all(core)
    core.add_request("b", b, 1)  # needs 13 blocks of 20: evicts a's blocks to the CPU tier
    run_all(core)
    assert len(core.cpu_tier) >= 5
    core.add_request("a2", a, 1)
    outs = run_all(core)
    done = finished(outs, "a2")
    gpu_hit = core.stats().prefix_cache_hits - 0  # blocks of a still on the GPU when a2 came
    assert done.cpu_cached_tokens > 0 and done.shared_cached_tokens == 0
    assert done.cached_tokens == 12 * BS  # the whole prompt but its last token: GPU + CPU
    computed = len(a) - done.cached_tokens
    assert outs[0].duration_s == pytest.approx(step_duration(cfg, computed, 0)
                                               + cfg.cpu_load_s_per_token * done.cpu_cached_tokens)
    st = core.stats()
    assert st.cpu_tier_hits == done.cpu_cached_tokens == st.external_prefix_cache_hits
    assert st.prefix_cache_hits == done.cached_tokens - done.cpu_cached_tokens == gpu_hit
    assert st.load_s == pytest.approx(cfg.cpu_load_s_per_token * done.cpu_cached_tokens)
    # Without a CPU tier the same sequence recomputes a's evicted blocks.
    plain = EngineCore(SMALL)
    for rid, p in (("a", a), ("b", b), ("a2", a)):
        plain.add_request(rid, p, 1)
        outs = run_all(plain)
    assert finished(outs, "a2").cached_tokens < done.cached_tokens


def test_shared_tier_serves_blocks_another_instance_computed() -> None:
    cfg = EngineConfig(max_num_batched_tokens=1024)
    shared = MemorySharedTier(1000)
    one, two = EngineCore(cfg, shared_tier=shared), EngineCore(cfg, shared_tier=shared)
    p = prompt(3, 20)
    one.add_request("r", p, 1)
    run_all(one)
    assert len(shared) == 20
    two.add_request("r", p, 1)
    outs = run_all(two)
    done = finished(outs, "r")
    assert (done.cached_tokens, done.shared_cached_tokens, done.cpu_cached_tokens) == (20 * BS, 20 * BS, 0)
    assert outs[0].duration_s == pytest.approx(step_duration(cfg, 1, 0) + cfg.shared_load_s_per_token * 20 * BS
                                               + cfg.shared_load_latency_s)
    assert two.stats().shared_tier_hits == 20 * BS and two.stats().prefix_cache_hits == 0
    # Loaded blocks are GPU blocks now: the next request hits them on the GPU, at no load cost.
    two.add_request("again", p, 1)
    outs = run_all(two)
    assert finished(outs, "again").shared_cached_tokens == 0 and outs[0].duration_s == step_duration(cfg, 1, 0)


def test_tier_events_describe_every_medium_exactly() -> None:
    cfg = EngineConfig(kv_capacity_tokens=24 * BS, max_num_seqs=4, max_num_batched_tokens=512,
                       cpu_tier_tokens=30 * BS)
    shared = MemorySharedTier(40)
    rec = KvEventRecorder(BS, hash_seed=9)
    core = EngineCore(cfg, events=rec, shared_tier=shared)
    media: dict[str, set[int]] = {"GPU": set(), "CPU": set(), "SHARED": set()}
    rng = random.Random(5)
    heads = [prompt(s, 6) for s in range(6)]
    for i in range(60):
        core.add_request(f"r{i}", rng.choice(heads)[:rng.randrange(40, 97)] + prompt(100 + i, 1)[:5], 3)
        while core.has_work():
            core.step()
            for e in rec.take():
                if isinstance(e, BlockStored):
                    assert not media[e.medium] & set(e.block_hashes)
                    media[e.medium] |= set(e.block_hashes)
                elif isinstance(e, BlockRemoved):
                    assert set(e.block_hashes) <= media[e.medium]
                    media[e.medium] -= set(e.block_hashes)
                else:
                    assert isinstance(e, AllBlocksCleared)
        gpu = {h for e in core.cache._first.values() for h in e.hashes[e.start:e.end]}
        assert media["GPU"] == {rec.engine_hash(h) for h in gpu}
        assert media["CPU"] == {rec.engine_hash(h) for h in core.cpu_tier._blocks}
        assert media["SHARED"] == {rec.engine_hash(h) for h in shared._blocks}
    assert media["CPU"] and media["SHARED"] and core.stats().cpu_tier_hits > 0


def test_config_validation() -> None:
    with pytest.raises(ValueError, match="cpu_tier_tokens"):
        EngineConfig(cpu_tier_tokens=-1)
    with pytest.raises(ValueError, match="at least one block"):
        EngineConfig(cpu_tier_tokens=8)
    with pytest.raises(ValueError, match="shared_load_s_per_token"):
        EngineConfig(shared_load_s_per_token=-1e-6)
    with pytest.raises(ValueError, match="shared_tier_tokens"):
        SimConfig(("a",), RoutingConfig.build("random"), shared_tier_tokens=3)


def test_simulator_models_the_tiers() -> None:
    workload = SharedPrefixWorkload(groups=12, prefix_tokens=1000, question_tokens=32, output_tokens=8,
                                    arrival_rate=4.0, seed=1)
    small = EngineConfig(kv_capacity_tokens=4000)
    results = {}
    for name, engine, shared in (("gpu", small, 0), ("cpu", EngineConfig(kv_capacity_tokens=4000,
                                                                           cpu_tier_tokens=40_000), 0),
                                 ("shared", small, 40_000)):
        cfg = SimConfig(instance_ids(3), RoutingConfig.build("random"), engine=engine, duration_s=40.0,
                        shared_tier_tokens=shared, seed=1)
        sim = Simulator(cfg, workload)
        res = sim.run()
        stats = [inst.core.stats() for inst in sim._instances.values()]
        ttfts = sorted(r.ttft_s for r in res.requests if r.ttft_s is not None)
        results[name] = (sum(s.cpu_tier_hits for s in stats), sum(s.shared_tier_hits for s in stats),
                         ttfts[len(ttfts) // 2], len(res.requests))
    assert results["gpu"][:2] == (0, 0)
    assert results["cpu"][0] > 0 and results["cpu"][1] == 0
    assert results["shared"][1] > 0 and results["shared"][0] == 0
    assert results["gpu"][3] == results["cpu"][3] == results["shared"][3]  # the same requests
    # Loading 1,000 tokens costs less than prefilling them: the median TTFT drops.
    assert results["cpu"][2] < results["gpu"][2] and results["shared"][2] < results["gpu"][2]


async def test_emulated_instances_share_a_file_tier(tmp_path: Path) -> None:
    path = str(tmp_path / "shared-tier")
    body = {"prompt": prompt(4, 30), "max_tokens": 2}
    runners = []
    try:
        urls = []
        for _ in range(2):
            tier = FileSharedTier(path, 10_000)
            runner, port = await start_engine_server(EngineConfig(), "127.0.0.1", 0, 0.0, shared_tier=tier)
            runners.append((runner, tier))
            urls.append(f"http://127.0.0.1:{port}")
        async with aiohttp.ClientSession() as session:
            usages = []
            for url in urls:
                async with session.post(url + "/v1/completions", json=body) as resp:
                    usages.append((await resp.json())["usage"])
            async with session.get(urls[1] + "/metrics") as resp:
                text = await resp.text()
        assert usages[0]["prompt_tokens_details"]["cached_tokens"] == 0
        assert usages[1]["prompt_tokens_details"]["cached_tokens"] == 30 * BS
        samples = {(s.name, s.labels.get("medium")): s.value for f in text_string_to_metric_families(text)
                   for s in f.samples}
        assert samples[("vllm:external_prefix_cache_hits_total", None)] == 30 * BS
        assert samples[("prefixroute_engine_tier_hit_tokens_total", "SHARED")] == 30 * BS
        assert samples[("vllm:prefix_cache_hits_total", None)] == 0
    finally:
        for runner, tier in runners:
            await runner.cleanup()
            tier.close()
    assert prompt_block_hashes(from_token_ids(body["prompt"]), BS)[0] != 0


def test_simulator_keeps_precise_state_equal_to_the_engines() -> None:
    workload = SharedPrefixWorkload(groups=10, prefix_tokens=800, question_tokens=32, output_tokens=8,
                                    arrival_rate=5.0, seed=2)
    cfg = SimConfig(instance_ids(3), RoutingConfig.build("random"),
                    engine=EngineConfig(kv_capacity_tokens=3000, cpu_tier_tokens=6000), duration_s=30.0,
                    shared_tier_tokens=8000, seed=2, precise=True)
    sim = Simulator(cfg, workload)
    sim.run()
    view = sim.kv_view
    assert view is not None and view.instances == list(instance_ids(3))
    for iid, inst in sim._instances.items():
        index = view.stream(iid).index  # type: ignore[union-attr]
        gpu = {h for e in inst.core.cache._first.values() for h in e.hashes[e.start:e.end]}
        assert {h for h, n in index.held.items() if n & 0xFFFFFF} == gpu
        assert {h for h, n in index.held.items() if n >= 1 << 24} == set(inst.core.cpu_tier._blocks)
        assert view.mode(iid).value == "precise"
    assert set(view.shared.held) == set(sim._shared_tier._blocks)  # type: ignore[union-attr]
    # A request's holdings, asked with its block hashes, are what the engine would find.
    chain = next(iter(sim._instances.values())).core.cache
    some = next(e for e in chain._first.values() if e.start == 0)
    keys = list(some.hashes[:some.end])
    assert next(iter(view.holdings(keys).values())).gpu_tokens == len(keys) * 16
