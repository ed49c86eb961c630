"""Rendezvous assignment stability, strategies and in-flight accounting."""

import random
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixroute.core.config import RoutingConfig
from prefixroute.core.hashing import instance_token, rendezvous_best, rendezvous_order, rendezvous_score
from prefixroute.core.pool import NoHealthyInstance, VariantPool
from prefixroute.core.strategies import DecisionKind

KEYS = 100_000


def _keys(seed: int, n: int = KEYS) -> list[int]:
    rng = random.Random(seed)
    return [rng.getrandbits(64) for _ in range(n)]


def _owners(keys, tokens):
    """Owner index of each key among ``tokens`` (scores computed once per pair)."""
    return [max(range(len(tokens)), key=lambda i, k=k: rendezvous_score(k, tokens[i])) for k in keys]


def _check_add_and_remove(ids: list[str], keys: list[int]) -> None:
    n = len(ids) - 1
    tokens = [instance_token(i) for i in ids]
    # Scores of the n old instances and of the added one, once per key.
    moved = 0
    removed_victim = 0
    for k in keys:
        scores = [rendezvous_score(k, t) for t in tokens]
        old = max(range(n), key=scores.__getitem__)
        new = max(range(n + 1), key=scores.__getitem__)
        if new != old:
            moved += 1
            assert new == n, "a key moved to an instance other than the added one"
        # Removing instance 0 from the n old ones: only its keys move.
        if old != 0:
            after = max(range(1, n), key=scores.__getitem__)
            assert after == old, "removing an instance moved a key it did not hold"
        else:
            removed_victim += 1
    assert moved / len(keys) <= 1 / (n + 1) + 0.02
    assert moved / len(keys) >= 1 / (n + 1) - 0.02  # and the new instance does get its share
    assert removed_victim / len(keys) <= 1 / n + 0.02


@pytest.mark.parametrize("n", range(2, 17))
def test_adding_one_instance_moves_about_one_over_n_plus_one(n):
    ids = [f"http://10.0.0.{i}:8000" for i in range(n + 1)]
    _check_add_and_remove(ids, _keys(n))


@settings(max_examples=4, deadline=None)
@given(
    ids=st.lists(st.text(min_size=1, max_size=30), min_size=3, max_size=17, unique=True),
    seed=st.integers(min_value=0, max_value=2**32),
)
def test_stability_property_for_any_instance_names(ids, seed):
    _check_add_and_remove(ids, _keys(seed))


def test_rendezvous_order_starts_with_best():
    tokens = [instance_token(f"i{i}") for i in range(8)]
    for k in _keys(1, 500):
        order = rendezvous_order(k, tokens)
        assert sorted(order) == list(range(8))
        assert order[0] == rendezvous_best(k, tokens)


def pa(threshold=2):
    return RoutingConfig.build("prefix-aware", 4096, threshold)


URLS = [f"http://127.0.0.1:{8000 + i}" for i in range(4)]


def test_affinity_is_sticky_and_even_across_keys():
    pool = VariantPool("v", URLS, pa(threshold=1_000))
    keys = _keys(7, 4000)
    first = {k: pool.choose(k).instance.instance_id for k in keys}
    again = {k: pool.choose(k).instance.instance_id for k in keys}
    assert {pool.choose(k).kind for k in keys} == {DecisionKind.AFFINITY}
    assert first == again
    share = Counter(first.values())
    assert all(abs(c / len(keys) - 0.25) < 0.03 for c in share.values())


def test_overflow_walks_the_key_order_at_the_threshold():
    pool = VariantPool("v", URLS, pa(threshold=2))
    key = 12345
    order = [URLS[i] for i in rendezvous_order(key, [instance_token(u) for u in URLS])]
    leases = [pool.acquire(key) for _ in range(9)]
    got = [(l.decision.kind, l.instance.instance_id) for l in leases]
    assert got[:2] == [(DecisionKind.AFFINITY, order[0])] * 2
    assert got[2:4] == [(DecisionKind.OVERFLOW, order[1])] * 2
    assert got[4:6] == [(DecisionKind.OVERFLOW, order[2])] * 2
    assert got[6:8] == [(DecisionKind.OVERFLOW, order[3])] * 2
    assert got[8][0] is DecisionKind.ALL_BUSY
    assert all(i.in_flight in (2, 3) for i in pool.instances)
    # Once the preferred instance drops below the threshold, affinity resumes.
    leases[8].release()  # the all_busy one may have landed on the preferred instance
    leases[0].release()
    nxt = pool.acquire(key)
    assert (nxt.decision.kind, nxt.instance.instance_id) == (DecisionKind.AFFINITY, order[0])


def test_fallback_without_key_is_least_outstanding():
    pool = VariantPool("v", URLS, pa())
    busy = [pool.acquire(None) for _ in range(3)]
    assert {l.decision.kind for l in busy} == {DecisionKind.FALLBACK}
    assert len({l.instance.instance_id for l in busy}) == 3


def test_least_outstanding_spreads_load():
    pool = VariantPool("v", URLS, RoutingConfig.build("least-outstanding-requests"), seed=3)
    leases = [pool.acquire(None) for _ in range(8)]
    assert sorted(i.in_flight for i in pool.instances) == [2, 2, 2, 2]
    assert {l.decision.kind for l in leases} == {DecisionKind.LEAST_OUTSTANDING}


def test_random_is_uniform():
    pool = VariantPool("v", URLS, RoutingConfig(), seed=11)
    counts = Counter()
    for _ in range(20_000):
        with pool.acquire(None) as lease:
            counts[lease.instance.instance_id] += 1
    assert all(abs(c / 20_000 - 0.25) < 0.02 for c in counts.values())
    assert pool.total_in_flight() == 0


def test_lease_release_is_idempotent():
    pool = VariantPool("v", URLS, RoutingConfig())
    lease = pool.acquire(None)
    lease.release()
    lease.release()
    assert pool.total_in_flight() == 0
    assert lease.released


def test_switching_strategy_keeps_in_flight():
    pool = VariantPool("v", URLS, RoutingConfig())
    leases = [pool.acquire(None) for _ in range(5)]
    pool.set_routing(pa())
    assert pool.total_in_flight() == 5
    assert pool.acquire(99).decision.kind in (DecisionKind.AFFINITY, DecisionKind.OVERFLOW)
    for l in leases:
        l.release()
    assert pool.total_in_flight() == 1


def test_membership_change_keeps_state_and_removed_leases_release():
    pool = VariantPool("v", URLS, pa(threshold=100))
    keys = _keys(5, 2000)
    before = {k: pool.choose(k).instance.instance_id for k in keys}
    lease = pool.acquire(keys[0])
    victim = lease.instance.instance_id
    pool.set_instances([u for u in URLS if u != victim])
    after = {k: pool.choose(k).instance.instance_id for k in keys}
    assert all(after[k] == before[k] for k in keys if before[k] != victim)
    lease.release()
    assert lease.instance.in_flight == 0
    assert pool.total_in_flight() == 0


def test_unhealthy_instances_are_skipped_and_none_raises():
    pool = VariantPool("v", URLS[:2], pa())
    pool.set_healthy(URLS[0], False)
    assert {pool.choose(k).instance.instance_id for k in _keys(2, 50)} == {URLS[1]}
    pool.set_healthy(URLS[1], False)
    with pytest.raises(NoHealthyInstance, match="no healthy instance"):
        pool.acquire(1)
    assert pool.total_in_flight() == 0


def test_exclude():
    pool = VariantPool("v", URLS, pa())
    for k in _keys(3, 50):
        first = pool.choose(k).instance.instance_id
        assert pool.choose(k, exclude={first}).instance.instance_id != first


def test_duplicate_instances_rejected():
    with pytest.raises(ValueError, match="duplicate"):
        VariantPool("v", ["http://a", "http://a"], RoutingConfig())


def test_instance_removed_and_added_back_keeps_its_in_flight():
    pool = VariantPool("v", URLS, RoutingConfig.build("least-outstanding-requests"))
    leases = [pool.acquire(None) for _ in range(8)]
    victim = leases[0].instance.instance_id
    held = pool.get(victim).in_flight
    pool.set_instances([u for u in URLS if u != victim])
    pool.set_instances(URLS)
    assert pool.get(victim).in_flight == held == 2
    for lease in leases:
        lease.release()
    assert [i.in_flight for i in pool.instances] == [0, 0, 0, 0]
    # once drained, a removed instance is forgotten
    pool.set_instances(URLS[1:])
    pool.set_instances(URLS)
    assert pool.get(URLS[0]).served == 0


def test_invalid_instance_urls_are_rejected():
    from prefixroute.core.config import ConfigError, FleetConfig
    for bad, why in [("http://127.0.0.1:99999", "not a valid URL"), ("http://[::1", "not a valid URL"),
                     ("http://exa mple:80", "no valid host"), ("http://:80", "no valid host"),
                     ("http://a:80/?q=1", "query or fragment"), ("http://a:0", "port 0")]:
        with pytest.raises(ConfigError, match=why):
            FleetConfig.single([bad], RoutingConfig())


# -- PREFIX_AWARE remembers rendezvous orders; the answers must be those of a recomputation


def _expected_owner(pool, key):
    """The preferred healthy instance of ``key``, recomputed from scratch."""
    healthy = [i for i in pool.instances if i.healthy]
    return healthy[rendezvous_best(key, [instance_token(i.instance_id) for i in healthy])].instance_id


def test_remembered_orders_equal_recomputed_ones_across_membership_and_health_changes():
    urls = [f"http://10.1.0.{i}:8000" for i in range(10)]
    pool = VariantPool("v", urls[:6], pa(threshold=1_000))
    strategy = pool.strategy
    keys = _keys(21, 300)
    changes = [
        lambda: None,
        lambda: pool.set_healthy(urls[2], False),
        lambda: pool.set_instances(urls[:8]),  # two added (urls[2] stays unhealthy)
        lambda: pool.set_healthy(urls[2], True),
        lambda: pool.set_instances(urls[3:]),  # three removed, two added
        lambda: pool.set_healthy(urls[9], False),
    ]
    for change in changes:
        change()
        for _ in range(2):  # the second pass is answered from the remembered orders
            assert [pool.choose(k).instance.instance_id for k in keys] == [_expected_owner(pool, k) for k in keys]
        assert len(strategy._orders) == len(keys)
    moved = sum(_expected_owner(pool, k) != pool.choose(k).instance.instance_id for k in keys)
    assert moved == 0


def test_remembered_full_order_serves_overflow_after_a_health_change():
    pool = VariantPool("v", URLS, pa(threshold=1))
    key = 777
    order = [URLS[i] for i in rendezvous_order(key, [instance_token(u) for u in URLS])]
    first = pool.acquire(key)
    second = pool.acquire(key)
    assert (first.instance.instance_id, second.instance.instance_id) == (order[0], order[1])
    assert second.decision.kind is DecisionKind.OVERFLOW
    assert len(pool.strategy._orders[key]) == len(URLS)  # the whole order is remembered
    pool.set_healthy(order[1], False)  # a new candidate tuple: the order is recomputed without it
    third = pool.acquire(key)
    assert (third.instance.instance_id, third.decision.kind) == (order[2], DecisionKind.OVERFLOW)
    remembered = pool.strategy._orders[key]  # indices among the 3 healthy candidates, best first
    assert [pool.strategy._orders_src[i].instance_id for i in remembered] == [order[0], order[2], order[3]]


def test_remembered_orders_are_bounded_and_keep_the_recent_keys():
    from prefixroute.core.strategies import ORDER_CACHE_SIZE

    pool = VariantPool("v", URLS, pa(threshold=1_000))
    keys = _keys(4, ORDER_CACHE_SIZE + 500)
    hot = keys[0]
    for k in keys:
        pool.choose(hot)  # used between every other key: never the least recently used
        pool.choose(k)
    orders = pool.strategy._orders
    assert len(orders) == ORDER_CACHE_SIZE
    assert hot in orders and keys[-1] in orders and keys[1] not in orders
    assert pool.choose(keys[1]).instance.instance_id == _expected_owner(pool, keys[1])


def test_exclusions_are_not_remembered():
    pool = VariantPool("v", URLS, pa(threshold=1_000))
    for k in _keys(8, 50):
        first = pool.choose(k).instance.instance_id
        other = pool.choose(k, exclude={first}).instance.instance_id
        rest = [u for u in URLS if u != first]
        assert other == rest[rendezvous_best(k, [instance_token(u) for u in rest])]
    assert len(pool.strategy._orders) == 50


def test_rendezvous_order_is_by_decreasing_score():
    tokens = [instance_token(f"http://h{i}:80") for i in range(16)]
    for k in _keys(9, 300):
        scores = [rendezvous_score(k, t) for t in tokens]
        order = rendezvous_order(k, tokens)
        assert [scores[i] for i in order] == sorted(scores, reverse=True)


def test_least_outstanding_breaks_ties_with_the_k_th_tied_candidate():
    from prefixroute.core.strategies import InstanceState, least_outstanding

    rng = random.Random(5)
    for trial in range(500):
        loads = [rng.randrange(3) for _ in range(rng.randrange(1, 12))]
        cands = [InstanceState(f"i{j}", in_flight=x) for j, x in enumerate(loads)]
        tied = [j for j, x in enumerate(loads) if x == min(loads)]
        expect = random.Random(trial)
        want = cands[tied[expect.randrange(len(tied))]] if len(tied) > 1 else cands[tied[0]]
        got_rng = random.Random(trial)
        assert least_outstanding(cands, got_rng) is want
        assert got_rng.getstate() == expect.getstate()  # the same draws as before


def test_first_token_ends_a_requests_pending_prefill_once() -> None:
    from prefixroute.core.keys import text_block_hashes

    pool = VariantPool("v", ["a", "b"], RoutingConfig.build("cache-aware", None, 8))
    blocks = text_block_hashes("x" * 5000, 64, 131072, "m")
    lease = pool.acquire(None, blocks=blocks)
    inst = lease.instance
    assert lease.decision.prefill_units == 5000 and inst.pending_prefill == 5000  # nothing cached yet
    second = pool.acquire(None, blocks=blocks)
    assert second.instance is inst and second.decision.prefill_units < 100  # the view holds it now
    lease.first_token()
    lease.first_token()
    assert inst.pending_prefill == second.decision.prefill_units
    lease.release()
    assert inst.pending_prefill == second.decision.prefill_units and inst.in_flight == 1
    second.release()  # released before its first token: its prefill leaves too
    second.first_token()
    assert inst.pending_prefill == 0 and inst.in_flight == 0


def test_strategies_without_a_view_of_the_caches_add_no_pending_prefill() -> None:
    for routing in (RoutingConfig(), RoutingConfig.build("prefix-aware", 1024, 4)):
        pool = VariantPool("v", ["a", "b"], routing)
        lease = pool.acquire(7)
        assert lease.decision.prefill_units == 0 and lease.instance.pending_prefill == 0


def test_the_same_routing_again_keeps_what_cache_aware_learned() -> None:
    # A reload or a membership change re-applies the variant's routing: that must not
    # forget the view of every instance's cache (a cold start of the whole fleet's view).
    from prefixroute.core.keys import text_block_hashes

    routing = RoutingConfig.build("cache-aware", None, 8)
    pool = VariantPool("v", ["a", "b", "c"], routing)
    docs = [text_block_hashes(f"document {i} " * 400, 64, 131072, "m") for i in range(12)]
    homes = {}
    for i, d in enumerate(docs):
        with pool.acquire(None, blocks=d) as lease:  # routed, answered, learned
            homes[i] = lease.instance.instance_id
    strategy = pool.strategy
    pool.set_instances(["a", "b", "c", "d"])
    pool.set_routing(RoutingConfig.build("cache-aware", None, 8))  # equal, not the same object
    assert pool.strategy is strategy
    assert {i: pool.choose(None, blocks=d).instance.instance_id for i, d in enumerate(docs)} == homes
    pool.set_routing(RoutingConfig.build("cache-aware", None, 12))  # a new threshold: taken in place
    assert pool.strategy is strategy and pool.strategy.threshold == 12
    assert {i: pool.choose(None, blocks=d).instance.instance_id for i, d in enumerate(docs)} == homes
    pool.set_routing(RoutingConfig.build("cache-aware", None, 12, block_size=128))  # new blocks: a new view
    assert pool.strategy is not strategy and sum(len(c) for c in pool.strategy.caches.values()) == 0
