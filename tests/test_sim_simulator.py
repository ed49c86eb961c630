"""The discrete-event simulator: determinism, conservation, equivalences and the capacity ordering."""

from __future__ import annotations

import itertools

import pytest

from prefixroute.core.config import RoutingConfig
from prefixroute.engine.core import EngineCore
from prefixroute.engine.model import EngineConfig
from prefixroute.sim import MembershipChange, SimConfig, Simulator, instance_ids, parse_changes, simulate
from prefixroute.core.keys import openai_block_hashes
from prefixroute.sim.blocks import prompt_blocks
from prefixroute.workloads.traces import load_trace
from test_workloads_traces import MOONCAKE, recorded_trace, write_jsonl
from prefixroute.workloads.multi_turn import MultiTurnWorkload
from prefixroute.workloads.shared_prefix import SharedPrefixWorkload

PA = RoutingConfig.build("prefix-aware", 1024, 4)
CA = RoutingConfig.build("cache-aware", None, 4)
RANDOM = RoutingConfig.build("random")
SMALL_ENGINE = EngineConfig(kv_capacity_tokens=20_000)


def shared(**kw) -> SharedPrefixWorkload:
    args = dict(groups=8, prefix_tokens=1000, question_tokens=40, output_tokens=12, arrival_rate=6.0, seed=1)
    args.update(kw)
    return SharedPrefixWorkload(**args)


def chats(**kw) -> MultiTurnWorkload:
    args = dict(conversation_rate=1.0, system_tokens=200, mean_turns=4, think_time_s=2.0, mean_output_tokens=40,
                mean_user_tokens=60, seed=2)
    args.update(kw)
    return MultiTurnWorkload(**args)


def fingerprint(res):
    return [(r.index, r.session, r.turn, r.instance, r.decision, r.cached_tokens, r.ttft_s, r.latency_s)
            for r in res.requests]


@pytest.mark.parametrize("make", [shared, chats])
@pytest.mark.parametrize("routing", [RANDOM, PA, CA])
def test_a_seed_gives_the_same_run(make, routing) -> None:
    cfg = SimConfig(instance_ids(3), routing, engine=SMALL_ENGINE, duration_s=30, seed=5)
    a, b = simulate(cfg, make()), simulate(cfg, make())
    assert fingerprint(a) == fingerprint(b) and (a.cache_hits, a.cache_queries) == (b.cache_hits, b.cache_queries)
    c = simulate(SimConfig(instance_ids(3), routing, engine=SMALL_ENGINE, duration_s=30, seed=6), make(seed=9))
    assert fingerprint(c) != fingerprint(a)


@pytest.mark.parametrize("users", [None, 5])
@pytest.mark.parametrize("make", [shared, chats])
def test_every_request_finishes_exactly_once(make, users) -> None:
    sim = Simulator(SimConfig(instance_ids(3), PA, engine=SMALL_ENGINE, duration_s=30, users=users, replicas=2),
                    make())
    res = sim.run()
    assert len(res.requests) > 50
    assert all(r.error == "" and r.latency_s is not None and r.ttft_s is not None for r in res.requests)
    assert all(0 < r.ttft_s <= r.latency_s for r in res.requests)
    finished = sum(inst.core.stats().requests_finished for inst in sim._instances.values())
    assert finished == len(res.requests)
    assert not any(inst.core.has_work() for inst in sim._instances.values())
    assert all(p.total_in_flight() == 0 for p in sim._pools)  # every lease released
    assert sum(s.served for p in sim._pools for s in p.instances) == len(res.requests)
    assert [r.index for r in res.requests] == list(range(len(res.requests)))


def test_turns_of_a_session_follow_each_other() -> None:
    res = simulate(SimConfig(instance_ids(2), RANDOM, duration_s=40, seed=1), chats())
    by_session: dict[int, list] = {}
    for r in res.requests:
        by_session.setdefault(r.session, []).append(r)
    multi = [rs for rs in by_session.values() if len(rs) > 1]
    assert multi
    for rs in multi:
        assert [r.turn for r in rs] == list(range(len(rs)))
        for prev, nxt in zip(rs, rs[1:]):
            assert nxt.arrival_s >= prev.arrival_s + prev.latency_s  # sent after the answer ended
            assert nxt.prompt_tokens > prev.prompt_tokens  # the history grows


def test_closed_loop_never_has_more_sessions_than_users() -> None:
    res = simulate(SimConfig(instance_ids(2), RANDOM, duration_s=20, users=3), shared())
    events = sorted([(r.arrival_s, 1) for r in res.requests] + [(r.arrival_s + r.latency_s, -1) for r in res.requests],
                    key=lambda e: (e[0], e[1]))
    level = peak = 0
    for _, d in events:
        level += d
        peak = max(peak, level)
    assert peak == 3


@pytest.mark.parametrize("make", [shared, chats])
def test_fast_forward_changes_nothing_but_speed(make) -> None:
    on = simulate(SimConfig(instance_ids(3), PA, engine=SMALL_ENGINE, duration_s=30, fast_forward=True), make())
    off = simulate(SimConfig(instance_ids(3), PA, engine=SMALL_ENGINE, duration_s=30, fast_forward=False), make())
    assert len(on.requests) == len(off.requests)
    for a, b in zip(on.requests, off.requests):
        assert (a.instance, a.cached_tokens) == (b.instance, b.cached_tokens)
        assert a.ttft_s == pytest.approx(b.ttft_s, abs=1e-9)
        assert a.latency_s == pytest.approx(b.latency_s, abs=1e-9)
    assert on.events < off.events


@pytest.mark.parametrize("make", [shared, chats])
def test_fast_path_prompts_hit_the_cache_exactly_like_text(make) -> None:
    """RANDOM's choices do not depend on keys, so the segment (fast) path and the text
    path route identically; the engine then sees the same cache hits to the token."""
    cfg = SimConfig(instance_ids(3), RANDOM, engine=SMALL_ENGINE, duration_s=15, seed=3)
    fast = simulate(cfg, make())
    text = simulate(SimConfig(**{**cfg.__dict__, "exact_text": True}), make())
    assert [(r.instance, r.prompt_tokens, r.cached_tokens) for r in fast.requests] == \
           [(r.instance, r.prompt_tokens, r.cached_tokens) for r in text.requests]
    assert fast.cache_hit_rate == text.cache_hit_rate > 0


@pytest.mark.parametrize("make", [shared, lambda: chats(system_prompts=3, conversation_rate=3.0)])
def test_cache_aware_blocks_of_fast_prompts_are_shared_exactly_as_the_routers_are(make) -> None:
    """The fast path's blocks come from routing keys, not text: two prompts must still
    share exactly the leading blocks whose text they share, as the router's hashes of
    the rendered text (the exact path) do, and the blocks must have the same ends."""
    ca = CA.cache_aware
    fast, text = [], []
    for s in itertools.islice(make().sessions(), 40):
        fast.append(prompt_blocks(s.turn(0).prompt, ca.block_size, ca.max_prefix_length))
        text.append(prompt_blocks(s.turn(0, []).prompt, ca.block_size, ca.max_prefix_length))

    def shared_blocks(a, b) -> int:
        return next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))

    assert [list(f.ends) for f in fast] == [list(t.ends) for t in text]
    assert [f.sizes() for f in fast] == [t.sizes() for t in text]
    pairs = [(shared_blocks(a, b), shared_blocks(c, d)) for (a, c), (b, d) in
             itertools.combinations(zip(fast, text), 2)]
    assert [p for p, _ in pairs] == [q for _, q in pairs]
    assert len({p for p, _ in pairs}) >= 2 and max(p for p, _ in pairs) > 10  # pairs share more or less


def test_cache_aware_blocks_of_trace_prompts(tmp_path) -> None:
    ca = CA.cache_aware
    # A prefixroute trace: digests of 64-character blocks, against the text they came from.
    wl = shared(groups=4, prefix_tokens=600)
    path = tmp_path / "trace.jsonl"
    recorded_trace(path, wl, 12)
    bodies = [s.body(0, []) for s in itertools.islice(shared(groups=4, prefix_tokens=600).sessions(), 12)]
    fast = [prompt_blocks(r.prompt, ca.block_size, ca.max_prefix_length) for r in load_trace(path).records]
    text = [openai_block_hashes(b, True, ca.block_size, ca.max_prefix_length) for b in bodies]
    assert [list(f.ends) for f in fast] == [list(t.ends) for t in text]
    for (a, c), (b, d) in itertools.combinations(zip(fast, text), 2):
        assert [x == y for x, y in zip(a, b)] == [x == y for x, y in zip(c, d)]
    # A Mooncake trace: hash ids of 512-token blocks, so sharing is known to 2,048 characters.
    mc = tmp_path / "mooncake.jsonl"
    write_jsonl(mc, MOONCAKE)
    x, y, _, z = (prompt_blocks(r.prompt, ca.block_size, ca.max_prefix_length) for r in load_trace(mc).records)
    within = sum(1 for e in x.ends if e <= 2048)  # the blocks inside hash id 0
    assert x.ends[-1] == 4800 and within == 24
    assert x.hashes()[:within] == y.hashes()[:within] == z.hashes()[:within] and x[within] != y[within]
    two = sum(1 for e in z.ends if e <= 4096)  # ids 0 and 1 in common: 1,024 tokens
    assert x.hashes()[:two] == z.hashes()[:two] and x[two] != z[two] and two > within


def test_cache_aware_routes_conversations_on_their_blocks_in_the_simulator() -> None:
    # Conversations over three system prompts: PREFIX_AWARE's key (1,024 characters)
    # ends inside the system prompt, so every conversation of one prompt shares a key.
    wl = dict(system_prompts=3, system_tokens=400, conversation_rate=3.0)
    ca = simulate(SimConfig(instance_ids(4), CA, engine=SMALL_ENGINE, duration_s=60, seed=1), chats(**wl))
    rnd = simulate(SimConfig(instance_ids(4), RANDOM, engine=SMALL_ENGINE, duration_s=60, seed=1), chats(**wl))
    kinds = {r.decision for r in ca.requests}
    assert "fallback" not in kinds and "affinity" in kinds  # routed on blocks, not the empty-prompt fallback
    assert ca.cache_hit_rate > rnd.cache_hit_rate + 0.1
    assert ca.summary().p50_ttft_s < rnd.summary().p50_ttft_s


def test_prefix_aware_beats_random_when_the_working_set_fits_the_fleet_not_one_instance() -> None:
    # 12 documents of 1,000 tokens (12,000 + questions) against 6,000-token caches:
    # one instance holds about 5, the four hold all 12.
    engine = EngineConfig(kv_capacity_tokens=6_000)
    wl = dict(groups=12, prefix_tokens=1000, question_tokens=40, output_tokens=8, arrival_rate=4.0)
    random_res = simulate(SimConfig(instance_ids(4), RANDOM, engine=engine, duration_s=120), shared(**wl))
    pa_res = simulate(SimConfig(instance_ids(4), PA, engine=engine, duration_s=120), shared(**wl))
    assert pa_res.cache_hit_rate > random_res.cache_hit_rate + 0.3
    assert pa_res.summary().p50_ttft_s < random_res.summary().p50_ttft_s


def test_router_replicas_keep_their_own_in_flight_counts() -> None:
    sim = Simulator(SimConfig(instance_ids(3), PA, duration_s=10, replicas=3, seed=1), shared(arrival_rate=20.0))
    res = sim.run()
    assert {r.replica for r in res.requests} == {0, 1, 2}
    served = [sum(s.served for s in p.instances) for p in sim._pools]
    assert sum(served) == len(res.requests) and min(served) > 0
    # the same key goes to the same instance whichever replica routes it (while below the threshold)
    by_group: dict[int, set[str]] = {}
    for r in res.requests:
        if r.decision == "affinity":
            by_group.setdefault(r.group, set()).add(r.instance)
    assert all(len(v) == 1 for v in by_group.values())


def test_instances_join_and_leave_at_their_times() -> None:
    changes = (MembershipChange(20.0, "add", "instance-3"), MembershipChange(40.0, "remove", "instance-0"))
    res = simulate(SimConfig(instance_ids(3), RANDOM, duration_s=60, changes=changes), shared(arrival_rate=5.0))
    assert res.instances == ["instance-0", "instance-1", "instance-2", "instance-3"]
    new = [r.arrival_s for r in res.requests if r.instance == "instance-3"]
    gone = [r.arrival_s for r in res.requests if r.instance == "instance-0"]
    assert new and min(new) >= 20.0
    assert gone and max(gone) < 40.0
    assert all(r.latency_s is not None for r in res.requests)


def test_no_instance_left_is_an_error_not_a_crash() -> None:
    changes = (MembershipChange(5.0, "remove", "instance-0"),)
    res = simulate(SimConfig(instance_ids(1), RANDOM, duration_s=10, changes=changes), shared())
    late = [r for r in res.requests if r.arrival_s > 5.0]
    assert late and all(r.error and r.latency_s is None for r in late)
    assert res.summary().errors == len(late)


def test_closed_loop_users_wait_for_an_instance_when_none_is_left() -> None:
    # Was a RecursionError: each user's request failed at once and it began the next one
    # at the same model time, forever.
    changes = (MembershipChange(5.0, "remove", "instance-0"), MembershipChange(12.0, "add", "instance-1"))
    res = simulate(SimConfig(instance_ids(1), RANDOM, duration_s=20, users=3, changes=changes), shared())
    failed = [r for r in res.requests if r.error]
    assert len(failed) == 3 and all(5.0 <= r.arrival_s < 12.0 for r in failed)  # one per user, then it waits
    after = [r for r in res.requests if r.arrival_s >= 12.0]
    assert after and all(not r.error and r.instance == "instance-1" for r in after)
    gone = simulate(SimConfig(instance_ids(1), RANDOM, duration_s=20, users=3, changes=changes[:1]), shared())
    assert [r.arrival_s >= 5.0 for r in gone.requests if r.error] == [True] * 3  # none comes back: the run ends


def test_overhead_is_added_to_every_request() -> None:
    base = simulate(SimConfig(instance_ids(2), RANDOM, duration_s=10), shared(arrival_rate=0.5))
    slow = simulate(SimConfig(instance_ids(2), RANDOM, duration_s=10, overhead_s=0.25), shared(arrival_rate=0.5))
    for a, b in zip(base.requests, slow.requests):  # light load: nothing queues
        assert b.ttft_s == pytest.approx(a.ttft_s + 0.25)


def test_summary_has_the_spec_fields() -> None:
    s = simulate(SimConfig(instance_ids(2), PA, duration_s=10), shared()).summary()
    assert s.router == "prefixroute-sim" and s.strategy == "PREFIX_AWARE" and s.errors == 0
    assert sum(s.instance_share) == pytest.approx(1.0) and 0 < s.p50_ttft_s <= s.p90_ttft_s


def test_config_and_change_errors() -> None:
    with pytest.raises(ValueError):
        SimConfig((), RANDOM)
    with pytest.raises(ValueError):
        SimConfig(("a", "a"), RANDOM)
    with pytest.raises(ValueError):
        SimConfig(("a",), RANDOM, replicas=0)
    with pytest.raises(ValueError):
        MembershipChange(1.0, "pause", "a")
    assert parse_changes(["add:12.5:instance-9"]) == (MembershipChange(12.5, "add", "instance-9"),)
    with pytest.raises(ValueError):
        parse_changes(["add:soon:instance-9"])
    with pytest.raises(ValueError):
        parse_changes(["add-instance-9"])


def test_engine_decode_runs_equal_single_steps() -> None:
    def drive(fast: bool) -> list[tuple[str, float]]:
        core = EngineCore(EngineConfig())
        now, done = 0.0, []
        for i, (text, n) in enumerate([("a" * 700, 30), ("b" * 300, 5), ("c" * 90, 17)]):
            core.add_request(f"r{i}", text, n)
        while core.has_work():
            k, _ = core.decode_run()
            out = core.advance_decode(k) if fast and k >= 2 else core.step()
            now += out.duration_s
            done += [(o.request_id, round(now, 9)) for o in out.outputs if o.finished]
        return done + [("stats", core.stats().generation_tokens_total)]

    assert drive(True) == drive(False)
