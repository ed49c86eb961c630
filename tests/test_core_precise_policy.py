"""CACHE_AWARE on the engines' reported holdings (precise mode) and on KV tiers
(core/precise_policy.py, core/tiers.py)."""

from __future__ import annotations

import random
from itertools import count

import pytest

from prefixroute.core.config import RoutingConfig
from prefixroute.core.keys import text_block_hashes
from prefixroute.core.kvevents.events import BlockRemoved, BlockStored
from prefixroute.core.kvevents.view import PreciseCacheView
from prefixroute.core.pool import VariantPool
from prefixroute.core.precise_policy import PreciseRequest, decide
from prefixroute.core.strategies import DecisionKind
from prefixroute.core.tiers import KvTiersConfig, TierCosts
from prefixroute.engine.model import EngineConfig

BS = 16
_hashes = count(1)


def ca(threshold: int = 8, **kw: object) -> RoutingConfig:
    return RoutingConfig.build("cache-aware", concurrency_threshold=threshold, **kw)


def chain(text: str, block: int = 64):
    return text_block_hashes(text, block, 131_072, "m")


def doc_tokens(d: int, n_tokens: int) -> list[int]:
    """A document's token ids: distinct per document from the first token."""
    rng = random.Random(d)
    return [d] + [rng.randrange(100, 30_000) for _ in range(n_tokens - 1)]


def store(view: PreciseCacheView, instance: str, tokens: list[int], medium: str = "GPU") -> list[int]:
    """Tell the view the instance stored every full block of ``tokens`` in ``medium``;
    returns the engine hashes used (for removals)."""
    stream = view.stream(instance)
    assert stream is not None
    n = len(tokens) // BS
    hashes = [next(_hashes) for _ in range(n)]
    if medium == "GPU":
        stream.index.apply([BlockStored(hashes, None, tokens[: n * BS], BS, medium=medium)])
    else:  # a lower tier: the blocks were on the GPU first (their parent chain is known)
        stream.index.apply([BlockStored(hashes, None, tokens[: n * BS], BS, medium="GPU"),
                            BlockStored(hashes, None, tokens[: n * BS], BS, medium=medium),
                            BlockRemoved(hashes, medium="GPU")])
    return hashes


def fleet(urls: list[str], precise: bool = True, **routing: object) -> tuple[VariantPool, PreciseCacheView]:
    pool = VariantPool("v", urls, ca(**routing), seed=3)
    view = PreciseCacheView(BS)
    for u in urls:
        s = view.add_instance(u)
        if precise:
            s.on_connected(complete=True)
    return pool, view


def request(view: PreciseCacheView, tokens: list[int], text: str):
    """The routing chain of ``text`` carrying the precise keys of ``tokens``."""
    blocks = chain(text)
    blocks.precise = PreciseRequest(view, view.request_keys(tokens), len(tokens), BS)
    return blocks


# -- the same rule as CACHE_AWARE ----------------------------------------------------


@pytest.mark.parametrize("threshold, load_weight", [(2, 0.0), (3, 0.5), (8, 16.0)])
def test_without_precise_state_the_policy_decides_as_cache_aware(threshold, load_weight):
    # The precise policy's rule, given no precise instance and no tiers (forced to decide
    # anyway), is CACHE_AWARE's decision for decision: instance, kind, uncached units.
    urls = [f"http://10.9.0.{i}:8000" for i in range(8)]
    pool = VariantPool("v", urls, ca(threshold=threshold, load_weight=load_weight, block_size=16,
                                     instance_cache_tokens=6_000), seed=4)
    strategy = pool.strategy
    rng = random.Random(threshold)
    headers = ["", "H" * 700, "G" * 2500]
    docs = [f"doc {d}|" + "".join(rng.choice("xy") for _ in range(rng.randrange(0, 3000) >> (d % 4 * 3)))
            for d in range(25)]
    chats = {c: f"chat {c}: " for c in range(6)}
    for inst in pool.instances:
        pool.learn(inst, text_block_hashes(headers[2] + "intro", 16, 131_072, "m"))
    live, kinds = [], set()
    candidates = tuple(pool.instances)
    for i in range(1200):
        if rng.random() < 0.25:
            c = rng.randrange(6)
            chats[c] += f"turn {i} " + "z" * rng.randrange(1, 40)
            text = chats[c]
        else:
            text = rng.choice(headers) + rng.choice(docs) + f"question {rng.randrange(30)}" * rng.randrange(1, 20)
        blocks = text_block_hashes(text, 16, 131_072, "m")
        for inst in pool.instances:
            if rng.random() < 0.05:
                inst.engine_load = rng.randrange(0, 8)
        got = decide(strategy, candidates, blocks, None, force=True)
        assert got is not None
        got_units = strategy.uncached_units
        want = strategy.choose(None, candidates, blocks)
        assert (got[0].instance_id, got[1], got_units) == (want[0].instance_id, want[1], strategy.uncached_units), i
        kinds.add(got[1])
        lease = pool.acquire(None, blocks=blocks)
        if rng.random() < 0.7:
            lease.first_token()
        live.append(lease)
        if len(live) > 3 * threshold or rng.random() < 0.4:
            live.pop(rng.randrange(len(live))).release()
    assert kinds >= {DecisionKind.AFFINITY, DecisionKind.OVERFLOW}


def test_approximate_instances_leave_the_learned_rule_in_charge():
    # Every stream approximate: the precise data adds nothing and the learned rule decides.
    urls = [f"http://10.9.1.{i}:8000" for i in range(4)]
    pool, view = fleet(urls, precise=False)
    text = "document 1 " + "x" * 4000
    blocks = request(view, doc_tokens(1, 1000), text)
    assert decide(pool.strategy, tuple(pool.instances), blocks, blocks.precise) is None
    lease = pool.acquire(None, blocks=blocks)
    assert lease.decision.kind is DecisionKind.AFFINITY


# -- precise holdings ----------------------------------------------------------------


def test_the_instance_whose_events_show_the_document_gets_it():
    # The learned view believes the document is on A (routed there); the engines say B
    # holds it (A evicted it, B computed it for another router replica).
    urls = [f"http://10.9.2.{i}:8000" for i in range(4)]
    pool, view = fleet(urls)
    a, b = urls[0], urls[2]
    text = "document 7 " + "z" * 6000
    tokens = doc_tokens(7, 1500)
    pool.learn(pool.get(a), chain(text + " question 0"))
    store(view, b, tokens)
    lease = pool.acquire(None, blocks=request(view, tokens + [5, 6, 7], text + " question 1"))
    assert (lease.instance.instance_id, lease.decision.kind) == (b, DecisionKind.AFFINITY)
    # Uncached: the tail past the last routing block its 93 full KV blocks cover
    # (routing-text units: the 1,503 tokens stand for the text's 6,022 characters).
    size = len(text + " question 1")
    assert 0 < lease.decision.prefill_units <= size - (1488 * size // 1503) + 1024


def test_one_instance_without_events_falls_back_to_its_learned_view():
    urls = [f"http://10.9.3.{i}:8000" for i in range(4)]
    pool, view = fleet(urls)
    lost = urls[1]
    view.stream(lost).on_disconnected()  # its stream dropped: approximate
    text = "document 3 " + "q" * 6000
    tokens = doc_tokens(3, 1500)
    pool.learn(pool.get(lost), chain(text))  # the router routed it there earlier
    lease = pool.acquire(None, blocks=request(view, tokens, text + " more"))
    assert (lease.instance.instance_id, lease.decision.kind) == (lost, DecisionKind.AFFINITY)


@pytest.mark.parametrize("better, worse", [("GPU", "CPU"), ("CPU", "SHARED"), ("SHARED", None)])
def test_a_gpu_block_counts_above_a_cpu_one_above_a_shared_one_above_a_miss(better, worse):
    urls = [f"http://10.9.4.{i}:8000" for i in range(6)]
    for trial in range(6):  # whatever the rendezvous order of the document
        pool, view = fleet(urls)
        tokens = doc_tokens(100 + trial, 2000)
        x, y = urls[trial % 6], urls[(trial + 3) % 6]
        if better == "SHARED":
            store(view, x, tokens, "GPU")  # the shared tier: written by another instance...
            view.stream(x).index.apply([BlockStored([next(_hashes) for _ in range(2000 // BS)], None, tokens, BS,
                                                    medium="SHARED")])
            view.stream(x).index.clear()  # ...which then lost its own copies
            holders = set()
        else:
            store(view, x, tokens, better)
            holders = {x}
        if worse is not None:
            store(view, y, tokens, worse)
            holders.add(y)
        lease = pool.acquire(None, blocks=request(view, tokens + [1, 2, 3], f"document {trial} " + "w" * 8000))
        if better == "SHARED":
            # Everyone loads it from the shared tier: no instance is a home; placed by
            # rendezvous, with only the shared tier's cost to pay.
            costs = TierCosts()
            size = len(f"document {trial} " + "w" * 8000)
            saved = size * (1 - costs.shared_weight) - costs.shared_latency_tokens * size / 2003
            assert abs(lease.decision.prefill_units - (size - saved)) <= 2 * 1024  # within a routing block or two
            assert lease.decision.prefill_units < 0.3 * size
        else:
            assert lease.instance.instance_id == x, (better, worse, trial)


def test_tier_weights_come_from_the_engines_cost_constants():
    engine = EngineConfig()
    assert TierCosts() == TierCosts.from_engine(engine) == KvTiersConfig().costs
    costs = TierCosts()
    assert costs.cpu_weight == pytest.approx(0.8 / 35)
    assert costs.shared_weight == pytest.approx(6.6 / 35)
    assert costs.shared_latency_tokens == pytest.approx(0.002 / 35e-6)
    assert costs.saved_tokens(100, 100, 0) == pytest.approx(100 + 100 * (1 - 0.8 / 35))
    assert costs.saved_tokens(0, 0, 10) == 0.0  # a few shared tokens gain nothing against the latency
    with pytest.raises(ValueError):
        TierCosts(prefill_s_per_token=0)


def test_router_replicas_with_different_learned_views_agree_on_precise_state():
    # Two router replicas, each with its own learned view and in-flight counts, see the
    # same events: they place every request on the same instance.
    urls = [f"http://10.9.5.{i}:8000" for i in range(5)]
    view = PreciseCacheView(BS)
    for u in urls:
        view.add_instance(u).on_connected(complete=True)
    pools = [VariantPool(f"r{r}", urls, ca(), seed=r) for r in range(2)]
    rng = random.Random(5)
    for i in range(40):  # replica 0 learned things replica 1 never saw
        pools[0].learn(pools[0].get(rng.choice(urls)), chain(f"document {i} " + "v" * 3000))
    for d in range(30):
        tokens = doc_tokens(200 + d, 600)
        if d % 3 == 0:
            store(view, urls[d % 5], tokens)
        text = f"document {d} " + "v" * 3000
        chosen = {p.choose(None, blocks=request(view, tokens + [9], text)).instance.instance_id for p in pools}
        assert len(chosen) == 1, d
        if d % 3 == 0:
            assert chosen == {urls[d % 5]}


def test_new_prefixes_behind_a_shared_system_prompt_spread_over_the_fleet():
    # Every instance holds the system prompt; new conversations are placed by the key of
    # their first block past it, not all on one instance.
    urls = [f"http://10.9.6.{i}:8000" for i in range(4)]
    pool, view = fleet(urls)
    system = doc_tokens(1, 1024)
    for u in urls:
        store(view, u, system)
    where = []
    for c in range(40):
        tokens = system + doc_tokens(1000 + c, 300)
        lease = pool.acquire(None, blocks=request(view, tokens, "system " + "s" * 4000 + f" chat {c}" + "m" * 1200))
        where.append(lease.instance.instance_id)
        lease.release()
    assert len(set(where)) == 4 and max(where.count(u) for u in urls) <= 20


def test_new_questions_leave_a_busy_home_of_a_hot_document_as_the_learned_rule_does():
    """A document the events show on one instance, and new questions about it, none
    finished (each stored by its engine as it is prefilled): they join it until it has more than SPREAD_FACTOR x the mean in flight
    (+ SPREAD_SLACK), then go to their own rendezvous choice (an overflow), which then
    holds it too and shares the questions; the next turn of a question stays home."""
    from prefixroute.core import placement_rules as R

    urls = [f"http://10.9.9.{i}:8000" for i in range(4)]
    pool, view = fleet(urls, threshold=100, load_weight=4)
    doc = doc_tokens(7, 1024)
    home_url = urls[2]
    store(view, home_url, doc)
    text = "document seven " + "d" * 4000

    def tokens(q: int, turn: int = 0) -> list[int]:
        return doc + doc_tokens(5000 + q, 40 + 30 * turn)

    def ask(q: int, turn: int = 0):
        return request(view, tokens(q, turn), text + f" question {q} " + "q" * 120 + " more" * 30 * turn)

    leases, where = [], []
    for q in range(32):
        lease = pool.acquire(None, blocks=ask(q))
        lease.first_token()
        store(view, lease.instance.instance_id, tokens(q))  # its engine's events after the prefill
        leases.append(lease)
        where.append((lease.instance.instance_id, lease.decision.kind))
    first_moved = next(i for i, (u, _) in enumerate(where) if u != home_url)
    assert first_moved == int(R.SPREAD_SLACK / (1 - R.SPREAD_FACTOR / len(urls))) + 1
    assert where[first_moved][1] is DecisionKind.OVERFLOW
    assert all(u == home_url and k is DecisionKind.AFFINITY for u, k in where[:first_moved])
    home = next(i for i in pool.instances if i.instance_id == home_url)
    assert 12 <= home.in_flight <= 24 and len({u for u, _ in where}) >= 2
    # the next turn of question 0 stays on the busy home (it continues a request routed there)
    lease = pool.acquire(None, blocks=ask(0, turn=1))
    assert lease.instance is home and lease.decision.kind is DecisionKind.AFFINITY


@pytest.mark.parametrize("extra_chars", [320, 324, 328, 332])
def test_a_conversations_next_turn_stays_on_its_busy_home_though_its_last_block_is_not_held(extra_chars):
    """The busy home holds the previous turn's full KV blocks only (its partial last block
    not reused), so its events show a little less than the router sent there: the next turn
    still continues that request and stays, as the learned rule keeps it; not spread."""
    urls = [f"http://10.9.11.{i}:8000" for i in range(4)]
    pool, view = fleet(urls, threshold=100, load_weight=4)
    home_url = urls[2]
    doc = doc_tokens(7, 1024)
    store(view, home_url, doc)
    t0 = "document seven " + "d" * 4000 + " question 0 " + "q" * extra_chars
    tok0 = doc + doc_tokens(5000, 47)
    lease = pool.acquire(None, blocks=request(view, tok0, t0))
    assert lease.instance.instance_id == home_url
    lease.first_token()
    store(view, home_url, tok0)  # its full blocks: 1,056 of 1,071 tokens
    lease.release()
    home = next(i for i in pool.instances if i.instance_id == home_url)
    home.engine_load = 20  # other replicas' requests: well over SPREAD_FACTOR x the mean
    t1 = t0 + " the answer, then a follow-up " + "m" * 400
    inst, kind = pool.strategy.choose(None, tuple(pool.instances), request(view, tok0 + doc_tokens(6000, 100), t1))
    assert inst is home and kind is DecisionKind.AFFINITY
    learned = pool.strategy.choose(None, tuple(pool.instances), chain(t1))  # the learned rule, same state
    assert learned == (home, DecisionKind.AFFINITY)


def test_a_prefill_is_weighed_by_the_requests_it_delays_as_the_learned_rule_does():
    """The document's home has 6 requests waiting for their first token (the engine's
    count: other replicas' requests), so prefilling this request's long question there
    delays all 6; the other instance, with none waiting, prefills the whole request
    sooner (the learned rule's rule 7, from the same decision's state), whether or not
    the fleet is at the threshold."""
    urls = [f"http://10.9.10.{i}:8000" for i in range(2)]
    pool, view = fleet(urls, threshold=4, load_weight=0)
    doc = doc_tokens(11, 600)
    store(view, urls[0], doc)
    home, other = pool.instances
    blocks = request(view, doc + doc_tokens(6000, 400), "document eleven " + "d" * 2400 + " question " + "q" * 1600)

    def choose() -> str:
        inst, kind = pool.strategy.choose(None, tuple(pool.instances), blocks)
        return inst.instance_id

    for load in (5, 0):  # at the threshold by the engines' counts, then below it
        for inst in pool.instances:
            inst.engine_load = load
        home.engine_waiting = 6
        assert choose() == urls[1]
        home.engine_waiting = 0  # nothing waits there: its holding decides
        assert choose() == urls[0]


def test_a_request_without_a_full_kv_block_is_decided_on_the_learned_view():
    urls = [f"http://10.9.7.{i}:8000" for i in range(3)]
    pool, view = fleet(urls)
    blocks = request(view, [1, 2, 3], "hi there")
    assert decide(pool.strategy, tuple(pool.instances), blocks, blocks.precise) is None


# -- tiers in approximate mode -------------------------------------------------------


def test_a_shared_tier_lets_a_hot_document_spread_sooner():
    # A hot document on one instance with a queue: tier-unaware, its home keeps it until
    # the queue outweighs half the request; with a shared tier a second instance loads it
    # from there and the request moves earlier.
    urls = [f"http://10.9.8.{i}:8000" for i in range(4)]
    text = "hot document " + "h" * 24_000

    def first_overflow(routing: RoutingConfig, backlog: bool = False) -> int:
        pool = VariantPool("v", urls, routing, seed=1)
        for inst in pool.instances:  # every engine has a request waiting (another replica's)
            inst.engine_waiting = int(backlog)
        home = pool.acquire(None, blocks=chain(text + " q0"))
        held = [home]
        for q in range(1, 200):
            lease = pool.acquire(None, blocks=chain(text + f" q{q}"))
            held.append(lease)
            if lease.instance is not home.instance:
                return q
        return 200

    plain = first_overflow(ca(threshold=64))
    tiered = first_overflow(ca(threshold=64, kv_tiers=KvTiersConfig(SharedTier=True)))
    assert tiered < plain
    # a backlogged fleet replicates later (BACKLOG_REPLICATE_FRACTION, shrunk by the
    # shared tier's weight too), still no later than without the tier (where the busy
    # home's spread, rule 4, moves it at the same request either way)
    plain_backlog = first_overflow(ca(threshold=64), backlog=True)
    tiered_backlog = first_overflow(ca(threshold=64, kv_tiers=KvTiersConfig(SharedTier=True)), backlog=True)
    assert tiered < tiered_backlog <= plain_backlog == plain


def test_a_cpu_tier_makes_the_learned_view_remember_more():
    pool = VariantPool("v", ["http://a:1"], ca(instance_cache_tokens=10_000,
                                                kv_tiers=KvTiersConfig(CpuTierTokens=40_000)))
    assert pool.strategy.capacity_units == 50_000 * 4
    assert ca(kv_tiers={"CpuTierTokens": 5}).cache_aware.to_api()["KvTiers"]["CpuTierTokens"] == 5


def test_alternatives_whose_tier_costs_more_than_a_prefill_are_weighed_by_their_negative_saving():
    """A CPU tier configured slower than a prefill (CpuLoadSPerToken 10x PrefillSPerToken)
    makes a CPU-only holding worth less than nothing. The best alternative's saving is then
    negative, and the busy home is compared against that (the request overflows to c, as
    e746a58 decided), not against a saving of 0."""
    tiers = KvTiersConfig(PrefillSPerToken=1e-6, CpuLoadSPerToken=1e-5)
    urls = ["http://a:1", "http://b:1", "http://c:1", "http://d:1"]
    pool = VariantPool("v", urls, ca(threshold=8, kv_tiers=tiers), seed=1)
    view = PreciseCacheView(BS)
    for u in urls:
        view.add_instance(u).on_connected(complete=True)
    tokens = doc_tokens(9, 1600)
    store(view, urls[0], tokens, "GPU")
    for j in (1, 2, 3):
        store(view, urls[j], tokens[:160 + 16 * j], "CPU")
    home = pool.get(urls[0])
    home.engine_load, home.pending_prefill = 20, 12000
    blocks = request(view, tokens + [7, 7, 7], "document 9 " + "w" * 6400 + " question")
    chosen, kind = decide(pool.strategy, tuple(pool.instances), blocks, blocks.precise)
    assert (chosen.instance_id, kind, pool.strategy.uncached_units) == ("http://c:1", DecisionKind.OVERFLOW, 13332)
