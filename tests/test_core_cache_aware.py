"""CACHE_AWARE: chained blocks, bounded LRU view, threshold rule, replica agreement."""

import bisect
import math
import random

import xxhash

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixroute.core.cache_aware import BYTES_PER_BLOCK_ENTRY, ApproxPrefixCache, CacheAwareStrategy
from prefixroute.core.match_levels import Levels as _Levels
from prefixroute.core import placement_rules as rules
from prefixroute.core.config import ConfigError, RoutingConfig
from prefixroute.core.keys import (block_ends, byte_block_hashes, openai_block_hashes, openai_route,
                                   text_block_hashes, token_block_hashes)
from prefixroute.core.pool import VariantPool
from prefixroute.core.strategies import DecisionKind

URLS = [f"http://127.0.0.1:{9000 + i}" for i in range(4)]


def ca(threshold=8, **kw):
    return RoutingConfig.build("cache-aware", concurrency_threshold=threshold, **kw)


# -- chained blocks -----------------------------------------------------------------


def test_block_hashes_chain_no_false_match_after_a_difference():
    a = text_block_hashes("A" * 64 + "B" * 64 + "C" * 64, 64, 10_000, "m")
    b = text_block_hashes("A" * 64 + "X" * 64 + "C" * 64, 64, 10_000, "m")
    assert a[0] == b[0]
    assert a[1] != b[1]
    assert a[2] != b[2]  # same third block text, different history: no match


def test_block_hashes_cap_and_scope():
    text = "x" * 5000
    assert len(text_block_hashes(text, 64, 1024, "m")) == 16
    assert text_block_hashes(text, 64, 1024, "m") != text_block_hashes(text, 64, 1024, "other")
    assert text_block_hashes(text, 64, 1024, "m", "t1") != text_block_hashes(text, 64, 1024, "m", "t2")
    assert byte_block_hashes(b"y" * 130, 64, 4096, "ep")[:2] == byte_block_hashes(b"y" * 200, 64, 4096, "ep")[:2]


@settings(max_examples=200)
@given(common=st.text(min_size=0, max_size=3000), a=st.text(max_size=100), b=st.text(max_size=100))
def test_shared_prefix_shares_exactly_its_full_blocks(common, a, b):
    ha = text_block_hashes(common + "\x00" + a, 16, 10_000, "m")
    hb = text_block_hashes(common + "\x01" + b, 16, 10_000, "m")
    # blocks are counted in UTF-8 bytes on the doubling schedule of block_ends
    full = bisect.bisect_right(block_ends(16, 40_000), len(common.encode("utf-8", "surrogatepass")))
    assert ha[:full] == hb[:full]
    assert ha[full] != hb[full]  # the block holding the first difference, and every later one
    assert not set(ha[full:]) & set(hb[full:])


def test_block_schedule_doubles_every_sixteen_blocks():
    ends = block_ends(64, 131_072)
    assert ends[:3] == (64, 128, 192) and ends[15] == 1024
    assert ends[16] - ends[15] == 128 and ends[32] - ends[31] == 256
    # 64 KB of text is 96 full blocks plus a partial one
    chain = text_block_hashes("q" * 65_536, 64, 131_072, "m")
    assert len(chain) == 97 and chain.ends[-1] == 65_536 and chain.ends[-2] == 64_512
    assert sum(chain.sizes()) == 65_536
    # past the first 16 blocks, a block is at most 1/8 of the text before it
    assert all((e - s) * 8 <= max(s, 64 * 8) for s, e in zip((0,) + ends, ends))


def test_chain_reads_lazily_and_agrees_with_the_streaming_pass():
    text = "".join(f"line {i} " for i in range(3000))
    lazy = text_block_hashes(text, 64, 131_072, "m")
    lazy_values = [lazy[k] for k in (len(lazy) - 1, 0, 17, -2)]
    full = text_block_hashes(text, 64, 131_072, "m").hashes()
    assert lazy_values == [full[-1], full[0], full[17], full[-2]]
    assert xxhash.xxh3_64_intdigest(text.encode()[:64], lazy.root) == full[0]


def test_openai_route_gives_blocks_only_for_cache_aware():
    payload = {"model": "m", "messages": [{"role": "user", "content": "q" * 1000}]}
    key, blocks = openai_route(payload, True, ca())
    assert key is None and len(blocks) == len(openai_block_hashes(payload, True, 64, 131072)) > 10
    key, blocks = openai_route(payload, True, RoutingConfig.build("prefix-aware", 1024, 4))
    assert key is not None and blocks == []
    assert openai_route(payload, True, RoutingConfig()) == (None, [])


# -- the approximate cache -------------------------------------------------------------


def test_match_is_longest_remembered_prefix():
    c = ApproxPrefixCache(100)
    chain = list(range(1, 11))
    assert c.match(chain) == 0
    c.insert(chain[:6])
    assert c.match(chain) == 6
    assert c.match(chain[:3]) == 3
    c.insert(chain)
    assert c.match(chain) == 10
    assert c.match([99] + chain) == 0


def test_insert_returns_the_match_it_had():
    c = ApproxPrefixCache(100_000)
    assert c.insert([1, 2, 3]) == 0  # nothing held
    assert c.insert([1, 2, 3, 4, 5]) == 3
    assert c.insert([1, 2, 6]) == 2
    assert c.insert([1, 2, 3, 4, 5]) == 5
    assert c.insert([]) == 0


def test_touching_held_chains_again_and_again_keeps_the_heap_bounded():
    # The heap of leaves is compacted, not grown by one entry a touch (a large view
    # never evicts to drop them).
    c = ApproxPrefixCache(100_000)
    for _ in range(10_000):
        c.insert([1, 2, 3, 4, 5])
        c.insert([1, 2, 6])
    assert c._leaves == 2 and len(c._heap) <= 2 * c._leaves + 64


def test_the_share_of_continuations_tells_conversations_from_document_questions():
    # What CACHE_AWARE learns of each request: whether it continues a request routed to
    # its instance (the next turn; the same prompt again) or branches off a prefix held
    # there (a new question about a document), in the sense of _continuing (the partial
    # block the earlier request ended with must be this text's prefix too).
    def share_after(texts: list[str]) -> float:
        pool = VariantPool("v", URLS[:1], ca())
        for t in texts:
            pool.acquire(None, blocks=text_block_hashes(t, 64, 131_072, "m")).release()
        return pool.strategy.continued_share

    doc = "document: " + "d" * 4_000  # ends inside a block: short questions share its partial block
    questions = [doc + f" q{k}?" for k in range(300)]
    assert share_after(questions) < 0.5  # every one after the first branches off the document
    assert share_after([doc + " the same question?"] * 300) == 1.0  # the same prompt again: continued
    chat = "system: be brief. "
    turns = []
    for k in range(300):
        chat += f"user: question {k}? assistant: answer {k}. "
        turns.append(chat)
    assert share_after(turns) == 1.0  # each turn continues the last
    # prompts sharing nothing count for neither: the share stays where it starts
    assert share_after([f"{k} " + "x" * 500 for k in range(300)]) == 1.0
    # a burst of new conversations behind one system prompt stays conversational for a while
    system = "system: " + "s" * 6_000
    burst = share_after([system + f" user {k}: hello" for k in range(80)])
    assert rules.CONVERSATIONAL_SHARE < burst < 1.0

    # the same on token ids (units of 4 characters a token) and on plain block lists
    def share_of(chains: list) -> float:
        pool = VariantPool("v", URLS[:1], ca())
        for chain in chains:
            pool.acquire(None, blocks=chain).release()
        return pool.strategy.continued_share

    doc_ids = list(range(1, 1_003))  # ends inside a block
    assert share_of([token_block_hashes(doc_ids + [5_000 + k], 64, 131_072, "m") for k in range(300)]) < 0.5
    convo = list(range(1, 50))
    turns_ids = []
    for k in range(300):
        convo += [7_000 + k, 8_000 + k, 9_000 + k]
        turns_ids.append(token_block_hashes(convo, 64, 131_072, "m"))
    assert share_of(turns_ids) == 1.0
    assert share_of([[1, 2, 3, 100 + k] for k in range(300)]) < 0.5  # branches off [1, 2, 3]
    assert share_of([list(range(1, k + 2)) for k in range(300)]) == 1.0  # each extends the last


def test_eviction_removes_tails_first():
    c = ApproxPrefixCache(8)
    c.insert([1, 2, 3, 4, 5])  # chain A
    c.insert([11, 12, 13, 14, 15])  # chain B: 2 of A's blocks must go, A's deepest first
    assert len(c) == 8
    assert c.match([1, 2, 3, 4, 5]) == 3
    assert c.match([11, 12, 13, 14, 15]) == 5
    # LRU order: A's remaining blocks (oldest), then B tail-to-head... head most recent
    assert c.lru_order() == [3, 2, 1, 15, 14, 13, 12, 11]
    c.insert([1])  # touching A's root makes it most recent
    c.insert([21, 22])
    assert c.match([1, 2, 3]) == 1  # 3 and 2 were least recent
    assert 15 not in c or c.match([11, 12, 13, 14, 15]) == 5


def test_a_chain_longer_than_capacity_keeps_its_head():
    c = ApproxPrefixCache(4)
    c.insert(list(range(10)))
    assert c.lru_order() == [3, 2, 1, 0]
    assert c.match(list(range(10))) == 4


class _ReferenceLRU:
    """The rule the view implements, written the plain way: one LRU list of blocks,
    every block of a routed chain touched, deepest first."""

    def __init__(self, capacity):
        from collections import OrderedDict

        self.capacity, self.used, self.lru = capacity, 0, OrderedDict()

    def insert(self, blocks, sizes):
        for k in range(len(blocks) - 1, -1, -1):
            if blocks[k] in self.lru:
                self.lru.move_to_end(blocks[k])
            else:
                self.lru[blocks[k]] = sizes[k]
                self.used += sizes[k]
        while self.used > self.capacity:
            self.used -= self.lru.popitem(last=False)[1]


@pytest.mark.parametrize("seed", range(12))
def test_view_forgets_exactly_as_a_per_block_lru(seed):
    # Touching only a chain's deepest held block (recency kept per leaf) must remember
    # and forget the same blocks, in the same order, as touching every block.
    rng = random.Random(seed)
    capacity = rng.choice([5, 50, 300, 1000])
    view, ref = ApproxPrefixCache(capacity, {}, 1), _ReferenceLRU(capacity)

    def chain(doc, length):
        return [xxhash.xxh3_64_intdigest(f"{seed}/{doc}/{k}".encode()) for k in range(length)]

    for _ in range(1500):
        doc = rng.randrange(30)
        blocks = chain(doc % 8 if rng.random() < 0.6 else doc, rng.randrange(1, 60))
        sizes = [k % 3 + 1 for k in range(len(blocks))]
        view.insert(blocks, sizes)
        ref.insert(blocks, sizes)
        assert set(view._nodes) == set(ref.lru)
        assert view.used == ref.used <= capacity
        assert set(view._index) == set(ref.lru)
        assert view._leaves == sum(1 for node in view._nodes.values() if not node[2])
        assert len(view._heap) <= 2 * view._leaves + 64
    assert view.lru_order() == list(ref.lru)


@pytest.mark.parametrize("odd", [[1, 2, 3, 3], [7, 7], [5, 6, 5], [9, 9, 9, 8, 9]])
def test_block_lists_that_are_not_chains_keep_the_view_sound(odd):
    # A list with a repeated block (not a chain of hashes; only reachable through the
    # plain-list API) must not double-count or pin blocks: the view stays within its
    # capacity, counts what it holds, and forgets everything in time.
    pool = VariantPool("v", ["http://a"], ca(threshold=4, block_size=4096, instance_cache_tokens=1024))
    view = pool.strategy.caches["http://a"]
    assert view.capacity == 4096  # one 4,096-unit block
    pool.acquire(None, blocks=odd).release()
    assert view.used == 4096 * len(view) <= view.capacity
    assert all(node[1] != h for h, node in view._nodes.items())  # no block is its own parent
    for k in range(200):
        pool.acquire(None, blocks=[100 + k, 200_000 + k]).release()
        assert view.used == 4096 * len(view) <= view.capacity
    assert set(view._nodes) == {100 + 199} == set(pool.strategy._index)
    assert view._leaves == 1


def test_learning_for_an_instance_removed_meanwhile_is_dropped():
    # The HTTP driver learns on the next loop turn; the instance may be gone by then.
    pool = VariantPool("v", URLS, ca())
    lease = pool.acquire(None, blocks=[1, 2, 3], learn=False)
    gone = lease.instance
    pool.set_instances([u for u in URLS if u != gone.instance_id])
    pool.learn(gone, [1, 2, 3])
    lease.release()
    assert gone.instance_id not in pool.strategy.caches
    assert 1 not in pool.strategy._index and len(pool.strategy.caches) == len(URLS) - 1


def test_touching_a_held_chain_reads_only_its_last_blocks():
    # A follow-up to a held 64 KB prompt: learning touches its deepest held block and
    # adds its new one; it reads the hashes of the last two blocks (one xxh3 pass) and
    # the first (64 bytes), not all 97.
    doc = "d" * 65_536
    view = ApproxPrefixCache(10**9, {}, 1)
    view.insert(text_block_hashes(doc, 64, 131_072, "m"))
    held = len(view)
    assert held == 97  # 96 full blocks and the partial one ending the text
    follow_up = text_block_hashes(doc + "question 2?", 64, 131_072, "m")
    assert len(follow_up) == 97  # the partial block now ends 11 characters later
    view.insert(follow_up)
    assert len(view) == held + 1 and view.match(follow_up) == 97
    assert follow_up._all is None and sorted(follow_up._memo) == [0, 95, 96]
    order = view.lru_order()
    assert order[:2] == [text_block_hashes(doc, 64, 131_072, "m")[96], follow_up[96]]
    assert order[-1] == follow_up[0]


def test_memory_stays_within_budget_over_a_million_routed_requests():
    pool = VariantPool("v", URLS, ca(threshold=1024, instance_cache_tokens=1024, block_size=64))
    strategy = pool.strategy
    assert isinstance(strategy, CacheAwareStrategy)
    budget = strategy.capacity_blocks  # 1024 tokens * 4 chars / 64 = 64 blocks per instance
    assert budget == 64
    rng = random.Random(1)
    for i in range(1_000_000):
        blocks = [rng.getrandbits(64)] if i % 4 else [i % 97, rng.getrandbits(64), rng.getrandbits(64)]
        lease = pool.acquire(None, blocks=blocks)
        lease.release()
        if i % 100_000 == 0:
            assert all(len(c) <= budget for c in strategy.caches.values())
    assert all(len(c) == budget for c in strategy.caches.values())
    stats = strategy.stats()
    assert stats["approx_cache_blocks"] == 4 * budget
    assert stats["approx_cache_bytes"] == stats["approx_cache_blocks"] * BYTES_PER_BLOCK_ENTRY
    # the fleet-wide index holds exactly the blocks some view remembers
    assert set(strategy._index) == {h for c in strategy.caches.values() for h in c.lru_order()}


# -- decisions -------------------------------------------------------------------------


def _conversation(i: int, turns: int, system: str = "") -> list[list[int]]:
    text = system
    out = []
    for t in range(turns):
        text += f"<user {i} turn {t}> " + "w" * 1500
        out.append(text_block_hashes(text, 64, 131072, "m"))
        text += "<assistant> " + "a" * 800
    return out


def test_conversation_follows_its_cache():
    pool = VariantPool("v", URLS, ca(threshold=100))
    turns = _conversation(1, 6)
    with pool.acquire(None, blocks=turns[0]) as first:
        home = first.instance
    for blocks in turns[1:]:  # each turn starts after the previous one ended
        with pool.acquire(None, blocks=blocks) as lease:
            assert lease.instance is home
            assert lease.decision.kind is DecisionKind.AFFINITY


def test_new_prefixes_spread_over_the_fleet():
    pool = VariantPool("v", URLS, ca(threshold=100))
    counts = {u: 0 for u in URLS}
    for i in range(400):
        d = pool.choose(None, blocks=text_block_hashes(f"document {i} " + "z" * 300, 64, 131072, "m"))
        counts[d.instance.instance_id] += 1
        assert d.kind is DecisionKind.AFFINITY
    assert all(60 < c < 140 for c in counts.values()), counts


def test_shared_system_prompt_does_not_pin_everything_to_one_instance():
    system = "You are a helpful assistant. " * 100  # ~2,900 characters shared by all
    pool = VariantPool("v", URLS, ca(threshold=8, load_weight=16))
    leases = []
    for i in range(32):  # 32 concurrent conversations, none finishing
        leases.append(pool.acquire(None, blocks=_conversation(i, 1, system)[0]))
    per = sorted(i.in_flight for i in pool.instances)
    assert per == [8, 8, 8, 8]


@pytest.mark.parametrize("user_chars", [1500, 40])  # a long first message, and one inside the prompt's last block
def test_new_conversations_leave_a_busy_home_of_their_shared_system_prompt(user_chars):
    """32 conversations behind one long system prompt: new ones join the instance that
    holds it until it has more than SPREAD_FACTOR x the mean in flight (+ SPREAD_SLACK),
    then go to their own rendezvous choice, which prefills the prompt once; a
    conversation's next turn stays on its instance however busy (below the threshold).
    Every decision equals the exhaustive rule's."""
    from prefixroute.core import cache_aware as C

    system = "You are the assistant of a large company; follow these rules. " * 400  # ~25,000 characters

    def turn(i, t):
        text = system
        for k in range(t + 1):
            text += f"<user {i} turn {k}> " + "w" * user_chars + ("<assistant> " + "a" * 300 if k < t else "")
        return text_block_hashes(text, 64, 131072, "m")

    pool = VariantPool("v", URLS, ca(threshold=100, load_weight=4))
    leases, where = [], []
    for i in range(32):  # none finishes
        got = _decide_as_the_reference(pool, turn(i, 0), i)
        lease = pool.acquire(None, blocks=turn(i, 0))
        assert lease.instance is got[0]
        lease.first_token()
        leases.append(lease)
        where.append((lease.instance, lease.decision.kind))
    home = where[0][0]
    first_moved = next(i for i, (inst, _) in enumerate(where) if inst is not home)
    # it moves once the home has more than SPREAD_FACTOR x the mean (itself included) + SPREAD_SLACK
    n = len(URLS)
    assert first_moved == math.floor(C.SPREAD_SLACK / (1 - C.SPREAD_FACTOR / n)) + 1
    assert all(inst is home for inst, _ in where[:first_moved]) and where[first_moved][1] is DecisionKind.OVERFLOW
    second = where[first_moved][0]
    assert second.instance_id in pool.strategy.caches and home.in_flight + second.in_flight == 32
    assert 12 <= home.in_flight <= 20  # the two holders then share the new conversations by cost
    # the next turn of conversation 0 stays on the busy home
    got = _decide_as_the_reference(pool, turn(0, 1), 99)
    assert got[0] is home and got[1] is DecisionKind.AFFINITY


@pytest.mark.parametrize("chars", [3000, 2944])  # ends in a partial block; on a block's end
def test_identical_prompts_in_flight_together_leave_a_busy_home(chars):
    """48 copies of one prompt at once (n samples sent as separate requests), none
    finishing: the home keeps them until it has more than SPREAD_FACTOR x the mean in
    flight (+ SPREAD_SLACK), as new branches off a held prefix; the same prompt again is
    not a continuation that would keep them all there (a conversation has one turn in
    flight, identical prompts may have dozens)."""
    from prefixroute.core import cache_aware as C

    prompt = ("Summarize the refund policy in one line. " * 80)[:chars]
    pool = VariantPool("v", URLS, ca(threshold=64, load_weight=0))  # load ignored: the spread rule alone moves them
    where = []
    for i in range(48):
        blocks = text_block_hashes(prompt, 64, 131072, "m")
        assert (blocks.full < len(blocks)) == (chars == 3000)
        got = _decide_as_the_reference(pool, blocks, i)
        lease = pool.acquire(None, blocks=blocks)
        assert lease.instance is got[0]
        lease.first_token()
        where.append((lease.instance, lease.decision.kind))
    home = where[0][0]
    first_moved = next(i for i, (inst, _) in enumerate(where) if inst is not home)
    assert first_moved == math.floor(C.SPREAD_SLACK / (1 - C.SPREAD_FACTOR / len(URLS))) + 1
    assert where[first_moved][1] is DecisionKind.OVERFLOW
    assert home.in_flight < 48 and sum(1 for inst in pool.instances if inst.in_flight) >= 2


def test_never_over_threshold_while_another_is_below():
    pool = VariantPool("v", URLS, ca(threshold=3, load_weight=0))  # load ignored: cache only
    blocks = text_block_hashes("hot prefix " * 100, 64, 131072, "m")
    leases = [pool.acquire(None, blocks=blocks) for _ in range(12)]
    assert sorted(i.in_flight for i in pool.instances) == [3, 3, 3, 3]
    kinds = [l.decision.kind for l in leases]
    assert kinds[:3] == [DecisionKind.AFFINITY] * 3
    assert all(k is DecisionKind.OVERFLOW for k in kinds[3:] if k is not DecisionKind.AFFINITY)
    extra = pool.acquire(None, blocks=blocks)
    assert extra.decision.kind is DecisionKind.ALL_BUSY


def test_engine_reported_load_counts():
    pool = VariantPool("v", URLS[:2], ca(threshold=100, load_weight=1))
    blocks = text_block_hashes("p" * 640, 64, 131072, "m")  # 10 blocks
    home = pool.acquire(None, blocks=blocks).instance
    home.in_flight = 0
    home.engine_load = 50  # another replica keeps it busy: 10 blocks saved < 50 requests' load
    assert pool.choose(None, blocks=blocks).instance is not home


def _replica_traffic(n=2000):
    rng = random.Random(7)
    docs = [f"doc {d} " + "q" * 8000 for d in range(30)]  # ~125 blocks: a real document
    return [text_block_hashes(docs[rng.randrange(30)] + f" question {i}", 64, 131072, "m") for i in range(n)]


def test_replicas_fed_the_same_requests_make_the_same_choices():
    a = VariantPool("v", URLS, ca(threshold=6), seed=1)
    b = VariantPool("v", URLS, ca(threshold=6), seed=2)
    live_a, live_b = [], []
    for i, blocks in enumerate(_replica_traffic()):
        la, lb = a.acquire(None, blocks=blocks), b.acquire(None, blocks=blocks)
        assert (la.instance.instance_id, la.decision.kind) == (lb.instance.instance_id, lb.decision.kind)
        live_a.append(la)
        live_b.append(lb)
        if len(live_a) > 12:  # the same requests end on both
            k = (i * 7) % len(live_a)
            live_a.pop(k).release()
            live_b.pop(k).release()


def _replicated_traffic(engine_load: bool) -> tuple[float, float]:
    """Two replicas each see only the requests they route (clients spread over both):
    their in-flight counts, pending prefill and learned views differ. Returns the share of
    follow-up requests sent to an instance that already had their document (from either
    replica) and the mean number of instances each document was sent to."""
    a = VariantPool("v", URLS, ca(threshold=1000), seed=1)
    b = VariantPool("v", URLS, ca(threshold=1000), seed=2)
    rng = random.Random(7)
    docs = [f"doc {d} " + "q" * 8000 for d in range(30)]  # ~125 blocks: a real document
    sent: dict[int, set[str]] = {}
    hits = follow = 0
    live = []
    for i in range(2000):
        d = rng.randrange(30)
        blocks = text_block_hashes(docs[d] + f" question {i}", 64, 131072, "m")
        if engine_load:  # scraped /metrics: every replica's requests
            for url in URLS:
                a.get(url).engine_load = b.get(url).engine_load = a.get(url).in_flight + b.get(url).in_flight
        lease = (a if rng_pick(i) else b).acquire(None, blocks=blocks)
        lease.first_token()  # as the drivers do when the answer starts
        inst = lease.instance.instance_id
        if d in sent:
            follow += 1
            hits += inst in sent[d]
        sent.setdefault(d, set()).add(inst)
        live.append(lease)
        if len(live) > 12:
            live.pop(0).release()
    return hits / follow, sum(map(len, sent.values())) / len(sent)


def test_replicas_with_different_views_still_agree():
    # New prefixes are placed by rendezvous hashing of their own blocks and followers go
    # where the cache is, so both replicas send each document to the same instance.
    hits, copies = _replicated_traffic(engine_load=False)
    assert hits >= 0.99 and copies <= 1.05, (hits, copies)


def test_replicas_sharing_engine_load_agree():
    hits, copies = _replicated_traffic(engine_load=True)
    assert hits >= 0.99 and copies <= 1.05, (hits, copies)


def rng_pick(i: int) -> bool:
    return random.Random(i).random() < 0.5


def test_a_shared_header_does_not_starve_an_instance():
    # Every request starts with the same short instruction, then its own document.
    pool = VariantPool("v", URLS, ca(threshold=100))
    counts = {u: 0 for u in URLS}
    for i in range(400):
        text = "<|system|>\nAnswer using only the document below.\n\n" + f"document {i} " + "d" * 3000
        with pool.acquire(None, blocks=text_block_hashes(text, 64, 131072, "m")) as lease:
            counts[lease.instance.instance_id] += 1
    assert all(60 < c < 140 for c in counts.values()), counts


def test_fallback_without_blocks():
    pool = VariantPool("v", URLS, ca())
    assert pool.acquire(None).decision.kind is DecisionKind.FALLBACK


def test_membership_change_drops_views_of_removed_instances():
    pool = VariantPool("v", URLS, ca(threshold=100))
    for i in range(50):
        pool.acquire(None, blocks=[i, i + 1000])
    pool.set_instances(URLS[:2])
    assert set(pool.strategy.caches) <= set(URLS[:2])


def test_an_instance_whose_engine_lost_its_cache_holds_nothing_in_the_view():
    # A document learned on an instance other than its placement (it overflowed there),
    # then that instance's engine restarts: its follow-ups go where a new document would.
    fresh = VariantPool("v", URLS, ca(threshold=100))
    for i in range(100):
        doc = f"document {i} " + "d" * 3000
        placed = fresh.choose(None, blocks=text_block_hashes(doc, 64, 131072, "m")).instance.instance_id
        if placed != URLS[0]:
            break
    assert placed != URLS[0]
    pool = VariantPool("v", URLS, ca(threshold=100))
    other = pool.get(URLS[1])
    pool.learn(pool.get(URLS[0]), text_block_hashes(doc + " question 1", 64, 131072, "m"))
    pool.learn(other, text_block_hashes("another document " + "o" * 3000, 64, 131072, "m"))
    follow_up = text_block_hashes(doc + " question 2", 64, 131072, "m")
    d = pool.choose(None, blocks=follow_up)
    assert (d.instance.instance_id, d.kind) == (URLS[0], DecisionKind.AFFINITY)  # the (stale) view's home
    held = len(pool.strategy.caches[URLS[1]])
    assert pool.forget_cache(URLS[0]) is True
    assert len(pool.strategy.caches[URLS[0]]) == 0 and len(pool.strategy.caches[URLS[1]]) == held
    bit = pool.strategy._bits[URLS[0]]
    assert not any(m & bit for m in pool.strategy._index.values())  # out of the fleet-wide index too
    d = pool.choose(None, blocks=follow_up)
    assert (d.instance.instance_id, d.kind) == (placed, DecisionKind.AFFINITY)  # placed as a new document
    assert pool.forget_cache("http://not-a-member:1") is False
    # Learning starts again from nothing: the next request sticks to where it went.
    with pool.acquire(None, blocks=follow_up) as lease:
        assert lease.instance.instance_id == placed
    assert pool.choose(None, blocks=follow_up).instance.instance_id == placed


def test_strategies_without_learned_state_ignore_a_lost_cache():
    for routing in (RoutingConfig.build("prefix-aware", 1024, 8), RoutingConfig()):
        pool = VariantPool("v", URLS, routing, seed=3)
        before = pool.choose(123).instance.instance_id if pool.routing.prefix_aware else None
        assert pool.forget_cache(URLS[0]) is True
        if before is not None:
            assert pool.choose(123).instance.instance_id == before


def test_config_validation():
    with pytest.raises(ConfigError, match="CacheAwareRoutingConfig.ConcurrencyThreshold: is required"):
        RoutingConfig.build("cache-aware")
    with pytest.raises(ConfigError, match="BlockSize: 8 is out of range"):
        ca(block_size=8)
    cfg = ca(threshold=5, block_size=128)
    assert RoutingConfig.model_validate(cfg.to_api()) == cfg
    assert cfg.concurrency_threshold == 5


def test_fleet_index_gives_every_instance_its_own_match():
    # Differential: the one binary search over the fleet-wide index must find, for every
    # instance, the match its own LRU view reports.
    urls = [f"http://10.0.0.{i}:8000" for i in range(9)]
    pool = VariantPool("v", urls, ca(threshold=3, instance_cache_tokens=4_000))
    strategy = pool.strategy
    rng = random.Random(3)
    bases = ["s" * 700, "t" * 3000, "u" * 64]
    live = []
    for i in range(3000):
        text = rng.choice(bases) + f"|{rng.randrange(40)}|" + "v" * rng.randrange(0, 6000)
        blocks = text_block_hashes(text, 64, 131_072, "m")
        found = _Levels(blocks.hash, strategy._index, strategy._index.get(blocks[0], 0), len(blocks))
        while found.pull():
            pass
        levels = list(zip(found.masks, found.depths))
        for inst in pool.instances:
            bit = strategy._bits.get(inst.instance_id, 0)
            want = strategy.caches[inst.instance_id].match(blocks) if inst.instance_id in strategy.caches else 0
            got = next((d for m, d in levels if m & bit), 0)
            assert got == want
        live.append(pool.acquire(None, blocks=blocks))
        if len(live) > 10:
            live.pop(rng.randrange(len(live))).release()
    assert all(c.used <= strategy.capacity_units for c in strategy.caches.values())


def test_reported_memory_matches_what_the_views_take():
    # prefixroute_approx_cache_bytes = blocks x BYTES_PER_BLOCK_ENTRY: within 25 % of the
    # memory tracemalloc sees the views and the index take.
    import tracemalloc

    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    pool = VariantPool("v", URLS, ca(threshold=1024, instance_cache_tokens=200_000))
    for i in range(400):
        text = f"doc {i} " + "lorem ipsum " * 700 + f"question {i}"
        pool.acquire(None, blocks=text_block_hashes(text, 64, 131_072, "m")).release()
    strategy = pool.strategy
    blocks = strategy.stats()["approx_cache_blocks"]
    taken = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    assert blocks > 10_000
    assert abs(strategy.stats()["approx_cache_bytes"] - taken) <= 0.25 * taken, (taken, blocks)


# -- lazy reads and the lazy level search must give what the exhaustive computation gives


@settings(max_examples=100, deadline=None)
@given(text=st.text(alphabet="ab\u00e9 ", min_size=1, max_size=6000), order=st.randoms(use_true_random=False))
def test_chain_reads_in_any_order_equal_the_streaming_pass(text, order):
    lazy = text_block_hashes(text, 16, 10_000, "m")
    ks = list(range(len(lazy)))
    order.shuffle(ks)
    got = {k: lazy[k] for k in ks}
    data = text.encode("utf-8")
    want = [xxhash.xxh3_64_intdigest(data[:e], lazy.root) for e in lazy.ends]
    assert [got[k] for k in range(len(lazy))] == want == text_block_hashes(text, 16, 10_000, "m").hashes()


def _reference_choose(strategy, candidates, blocks):
    """The CACHE_AWARE rule computed exhaustively, as the module docstring states it:
    every candidate's match from its own view (ApproxPrefixCache.match), every
    alternative's cost, no index search, nothing lazy. Returns ``(instance, kind,
    uncached units)``."""
    import math

    from prefixroute.core import cache_aware as C
    from prefixroute.core.hashing import rendezvous_best, rendezvous_order

    n = len(blocks)
    ends, shift = blocks.ends, blocks.unit_shift
    size = ends[-1] >> shift
    unit = lambda d: (ends[d - 1] >> shift) if d else 0  # noqa: E731
    depth = [strategy.caches[c.instance_id].match(blocks) for c in candidates]
    tokens = [c.token for c in candidates]
    amin = min(C.ANCHOR_MIN_BLOCKS, n - 1)
    bs = strategy.block_size

    def queue(c):
        return c.pending_prefill + strategy.load_units * max(c.in_flight, c.engine_load)

    def walk(anchor, threshold, skip=()):
        below = [c for c in candidates if c.in_flight < threshold]
        if not below:
            return None
        bound = C.BOUND_FACTOR * sum(map(queue, below)) / len(below) + strategy.bound_slack
        spare = None
        for i in rendezvous_order(anchor, tokens):
            c = candidates[i]
            if i in skip or c.in_flight >= threshold:
                continue
            if queue(c) <= bound:
                return i
            spare = i if spare is None else spare
        return spare

    def load(c):
        return max(c.in_flight, c.engine_load)

    # A prefill is weighed by the requests it delays: uncached x (1 + waiting).
    def uncached_cost(c, units):
        return units * (1 + max(c.awaiting_first_token, c.engine_waiting))

    def spread(home, homes, top_d, u_top, anchor, threshold):
        """A new branch off a shared prefix whose home is markedly busier than the mean
        goes to the branch's bounded-load rendezvous choice (not a continuation)."""
        below = [load(c) for c in candidates if c.in_flight < threshold]
        h = load(candidates[home])
        if not below or h <= C.SPREAD_FACTOR * sum(below) / len(below) + C.SPREAD_SLACK:
            return None
        d = depth[home]  # the home's own match
        if d and d < n:  # (the same text again, held whole, is not a continuation)
            t = strategy.caches[candidates[home].instance_id].tail(blocks[d - 1])
            if t is not None and (t[0] == 0 or (unit(d) + t[0] <= size
                                                 and blocks.prefix_hash(unit(d) + t[0], d) == t[1])):
                return None  # a continuation keeps its instance
        i = walk(anchor, threshold, set(homes))
        return i if i is not None and load(candidates[i]) < h else None

    def decide(threshold):
        top_d = max(depth)
        u_top = unit(top_d)
        if not top_d:
            homes = []
        else:
            homes = [i for i, d in enumerate(depth) if d and unit(d) >= u_top - bs]
        rest_d = max((d for i, d in enumerate(depth) if i not in homes), default=0)
        u_rest = unit(rest_d)
        stick = max(strategy.stick_units, C.STICK_FRACTION * size)
        meaningful = bool(homes) and u_top > u_rest and u_top - u_rest >= stick
        extra = 0
        tops = [i for i, d in enumerate(depth) if top_d and d == top_d]
        if not meaningful or len(tops) > 1:  # the holders this request continues a request routed to
            cont = {}
            for i in tops if top_d < n else ():
                t = strategy.caches[candidates[i].instance_id].tail(blocks[top_d - 1])
                if t is not None and (t[0] == 0 or (u_top + t[0] <= size
                                                     and blocks.prefix_hash(u_top + t[0], top_d) == t[1])):
                    cont[i] = t[0]
            if cont:
                extra = max(cont.values())
                homes, meaningful = [i for i, r in cont.items() if r == extra], True
        if not meaningful:
            anchor = blocks[min(max(top_d, amin), n - 1)]
            i = walk(anchor, threshold)
            if i is None:
                return None
            kind = DecisionKind.AFFINITY if i == rendezvous_best(anchor, tokens) else DecisionKind.OVERFLOW
            return i, kind, size - unit(depth[i])
        # a backlogged fleet (BACKLOG_QUORUM of the candidates with a request waiting)
        # replicates later
        quorum = 1.0 if strategy.continued_share >= C.CONVERSATIONAL_SHARE else C.BACKLOG_QUORUM
        backlog = sum(1 for c in candidates if max(c.awaiting_first_token, c.engine_waiting)) \
            >= math.ceil(quorum * len(candidates))
        limit = strategy.tie_units + (C.BACKLOG_REPLICATE_FRACTION if backlog else C.REPLICATE_FRACTION) * size
        costs = [(uncached_cost(candidates[i], size - unit(depth[i]) - extra) + queue(candidates[i]), i) for i in homes
                 if candidates[i].in_flight < threshold]
        if costs:
            low = min(c for c, _ in costs)
            band = [(c, i) for c, i in costs if c <= low + strategy.tie_units]
            anchor = blocks[min(max(top_d, amin), n - 1)]
            c_home, home = band[rendezvous_best(anchor, [tokens[i] for _, i in band])]
            if c_home <= size - u_rest + limit:
                alt = spread(home, homes, top_d, u_top, anchor, threshold)
                if alt is not None:
                    return alt, DecisionKind.OVERFLOW, size - unit(depth[alt])
                return home, DecisionKind.AFFINITY, size - unit(depth[home]) - extra
        alt = walk(blocks[min(max(rest_d, amin), n - 1)], threshold, set(homes))
        if costs and (alt is None or c_home <= uncached_cost(candidates[alt], size - unit(depth[alt]))
                      + queue(candidates[alt]) + limit):
            return home, DecisionKind.AFFINITY, size - unit(depth[home]) - extra
        if alt is None:
            return None
        return alt, DecisionKind.OVERFLOW, size - unit(depth[alt])

    got = decide(strategy.threshold)
    if got is None:
        i, _, uncached = decide(math.inf)
        got = (i, DecisionKind.ALL_BUSY, uncached)
    i, kind, uncached = got
    return candidates[i], kind, uncached


def _decide_as_the_reference(pool: VariantPool, blocks, i: int) -> tuple:
    """The strategy's choice for ``blocks`` among all of ``pool``'s instances, asserted
    equal to :func:`_reference_choose`'s at request ``i`` (instance, kind and the
    uncached units it will count as pending prefill)."""
    strategy = pool.strategy
    candidates = tuple(pool.instances)
    want = _reference_choose(strategy, candidates, blocks)
    got = strategy.choose(None, candidates, blocks)
    assert (got[0].instance_id, got[1], strategy.uncached_units) == (want[0].instance_id, want[1], want[2]), i
    return got


@pytest.mark.parametrize("threshold, load_weight", [(2, 0.0), (3, 0.5), (4, 3.0), (8, 16.0)])
def test_decisions_equal_the_exhaustive_rule(threshold, load_weight):
    urls = [f"http://10.2.0.{i}:8000" for i in range(12)]
    pool = VariantPool("v", urls, ca(threshold=threshold, load_weight=load_weight, block_size=16,
                                     instance_cache_tokens=6_000), seed=4)
    rng = random.Random(threshold)
    headers = ["", "H" * 700, "G" * 2500]
    # documents of every length, down to none: then every match is close to the header's
    docs = [f"doc {d}|" + "".join(rng.choice("xy") for _ in range(rng.randrange(0, 3000) >> (d % 4 * 3)))
            for d in range(25)]
    for inst in pool.instances:  # every instance holds the long header (a shared system prompt)
        pool.learn(inst, text_block_hashes(headers[2] + "intro", 16, 131_072, "m"))
    live, kinds, weighted = [], set(), 0
    for i in range(1500):
        text = rng.choice(headers) + rng.choice(docs) + f"question {rng.randrange(30)}" * rng.randrange(1, 20)
        blocks = text_block_hashes(text, 16, 131_072, "m")
        for inst in pool.instances:
            if rng.random() < 0.05:  # in the second half the engines report a saturated fleet
                inst.engine_load = rng.randrange(0, 8) if i < 750 else rng.randrange(threshold, threshold + 6)
                inst.engine_waiting = rng.randrange(0, inst.engine_load + 1)
        got = _decide_as_the_reference(pool, blocks, i)
        kinds.add(got[1])
        weighted += any(max(c.awaiting_first_token, c.engine_waiting) for c in pool.instances)
        lease = pool.acquire(None, blocks=blocks)
        assert lease.instance is got[0]
        if rng.random() < 0.7:
            lease.first_token()
        live.append(lease)
        if len(live) > 3 * threshold or rng.random() < 0.4:
            live.pop(rng.randrange(len(live))).release()
    assert kinds >= {DecisionKind.AFFINITY, DecisionKind.OVERFLOW}
    assert weighted > 300  # rule 7's weight (requests waiting) was exercised too


@pytest.mark.parametrize("threshold, load_weight", [(2, 0.0), (3, 0.5), (8, 16.0)])
def test_repeated_requests_decide_as_the_exhaustive_rule(threshold, load_weight):
    # Requests repeated exactly, and follow-ups, with no shared header: one instance
    # often holds a request's whole chain, or all of it but the last block, sometimes
    # at the threshold; conversations whose next turn continues a routed request.
    urls = [f"http://10.4.0.{i}:8000" for i in range(6)]
    pool = VariantPool("v", urls, ca(threshold=threshold, load_weight=load_weight, block_size=16,
                                     instance_cache_tokens=6_000), seed=5)
    rng = random.Random(threshold * 7)
    texts = [f"tenant {d}: " + "".join(rng.choice("xy") for _ in range(rng.randrange(1, 600))) for d in range(12)]
    chats = {c: f"chat {c}: " for c in range(8)}
    live, kinds, waiting, backlogged, partly, seen_conversational = [], set(), 0, 0, 0, 0
    for i in range(1500):
        r = rng.random()  # the text again, a question asked before, a new one, or a chat's next turn
        if i >= 750 and r < 0.8:  # then mostly new questions: document traffic (the backlog quorum)
            r = 0.8 + r / 4
        if r < 0.25:
            c = rng.randrange(8)
            chats[c] += f"turn {i} " + "z" * rng.randrange(1, 40)
            text = chats[c]
        else:
            text = rng.choice(texts) + ("" if r < 0.6 else f" question {rng.randrange(3) if r < 0.8 else i}")
        blocks = text_block_hashes(text, 16, 131_072, "m")
        for inst in pool.instances:  # the engines report requests waiting (other replicas')
            if rng.random() < 0.05:
                inst.engine_waiting = rng.choice([0, 0, 1, rng.randrange(0, 30)])
        counts = [max(c.awaiting_first_token, c.engine_waiting) for c in pool.instances]
        waiting += any(counts)
        conversational = pool.strategy.continued_share >= rules.CONVERSATIONAL_SHARE
        seen_conversational += conversational
        backlog = sum(1 for w in counts if w) >= math.ceil((1.0 if conversational else rules.BACKLOG_QUORUM)
                                                          * len(counts))
        backlogged += backlog
        partly += backlog and not all(counts)  # backlogged with an instance that has none waiting
        kinds.add(_decide_as_the_reference(pool, blocks, i)[1])
        lease = pool.acquire(None, blocks=blocks)
        if rng.random() < 0.7:  # the others wait for their first token until released
            lease.first_token()
        live.append(lease)
        if len(live) > 2 * threshold or rng.random() < 0.4:
            live.pop(rng.randrange(len(live))).release()
    assert DecisionKind.AFFINITY in kinds and (DecisionKind.OVERFLOW in kinds or threshold > 3)
    # rule 7's weight and the backlog margin were exercised (the fast path weighs too)
    assert waiting > 1000 and backlogged > 50 and partly > 10
    # both backlog tests were exercised: the share starts at 1 (conversational) and the
    # traffic turns to new questions halfway
    assert 0 < seen_conversational < 1400


def test_a_follow_up_among_holders_of_a_shared_header_reads_few_blocks():
    # Every instance holds a long shared header, one holds the document: the decision
    # needs the document holder's match and a probe or two below it, not the header
    # holders' exact match (which would take a binary search of its own).
    urls = [f"http://10.3.0.{i}:8000" for i in range(16)]
    pool = VariantPool("v", urls, ca(threshold=8))
    header = "You are a careful assistant. " * 1200  # ~35,000 characters
    for inst in pool.instances:
        pool.learn(inst, text_block_hashes(header + "intro", 64, 131_072, "m"))
    doc = header + "document 7 " + "z" * 30_000
    home = pool.acquire(None, blocks=text_block_hashes(doc + " question 1?", 64, 131_072, "m"))
    home.release()
    follow_up = text_block_hashes(doc + " question 2?", 64, 131_072, "m")
    lease = pool.acquire(None, blocks=follow_up)
    assert (lease.instance, lease.decision.kind) == (home.instance, DecisionKind.AFFINITY)
    assert len(follow_up._memo) <= 5  # block 0, the last two in one pass, two probes


def test_every_instance_at_the_threshold_is_all_busy_and_keeps_affinity():
    # Every candidate at ConcurrencyThreshold: the threshold cannot be honoured, the
    # request is labelled all_busy, and it still goes where its document is cached
    # (least outstanding would scatter an overloaded fleet's requests into misses).
    urls = [f"http://10.7.0.{i}:8000" for i in range(6)]
    pool = VariantPool("v", urls, ca(threshold=1))
    doc = "document 7\n" + "z" * 8_181  # 8 KB
    with pool.acquire(None, blocks=text_block_hashes(doc, 64, 131_072, "m")) as routed:
        holder = routed.instance
    busy = [pool.acquire(None, blocks=text_block_hashes(f"filler {i}", 64, 131_072, "m"), learn=False)
            for i in range(len(urls))]
    for lease in busy:
        lease.first_token()
    assert all(i.in_flight == 1 for i in pool.instances)
    for q in range(20):
        d = pool.choose(None, blocks=text_block_hashes(doc + f"question {q}?", 64, 131_072, "m"))
        assert (d.kind, d.instance) == (DecisionKind.ALL_BUSY, holder)
    for lease in busy:
        lease.release()


def _doc_on_one(pool: VariantPool, doc: str, question: str) -> tuple:
    """Route ``doc`` once (the pool's first choice holds it), then the request ``doc +
    question``: ``(holder, the other instance, its block chain, its length in units)``."""
    home = pool.acquire(None, blocks=text_block_hashes(doc, 64, 131_072, "m"))
    holder = home.instance
    home.release()
    other = next(i for i in pool.instances if i is not holder)
    return holder, other, text_block_hashes(doc + question, 64, 131_072, "m"), len(doc + question)


def test_a_prefill_is_weighed_by_the_requests_it_delays():
    # Two instances, the document on one whose queue of prefill is longer: a miss
    # elsewhere costs its whole prompt once for the request and once for every request
    # waiting there (uncached x (1 + waiting)); the home keeps the request unless its own
    # queue outweighs that. The same whether the fleet is at the threshold or not.
    urls = [f"http://10.9.0.{i}:8000" for i in range(2)]
    pool = VariantPool("v", urls, ca(threshold=2, load_weight=0))
    doc = "document 9\n" + "d" * 8_181
    holder, other, ask, size = _doc_on_one(pool, doc, " question?")

    def decide(home_queue: int, waiting: int, *, engine: bool = False, in_flight: int = 3):
        for inst in pool.instances:
            inst.in_flight = 0 if engine else in_flight
            inst.engine_load = 5 if engine else 0
            inst.awaiting_first_token = 0 if engine else waiting
            inst.engine_waiting = waiting if engine else 0
            inst.pending_prefill = 0
        holder.pending_prefill = home_queue
        d = pool.choose(None, blocks=ask)
        return d.instance, d.kind

    # nobody waiting: the plain cost (the home's queue exceeds a miss plus the margin)
    assert 20_000 > size + 32 * 64 + 0.5 * size + 10
    assert decide(20_000, 0) == (other, DecisionKind.ALL_BUSY)
    # 3 waiting on each: the miss would cost 4 x size there, more than the home's queue
    assert 4 * size > 20_000 + 4 * 10
    assert decide(20_000, 3) == (holder, DecisionKind.ALL_BUSY)
    # every instance has requests waiting (a backlogged fleet): the margin is
    # BACKLOG_REPLICATE_FRACTION of the request, so a home queue must exceed the miss's
    # cost there by four requests' length plus the tie band to move it
    backlog_margin = 32 * 64 + rules.BACKLOG_REPLICATE_FRACTION * size
    assert 60_000 + 4 * 10 <= 4 * size + backlog_margin < 70_000 + 4 * 10
    assert decide(60_000, 3) == (holder, DecisionKind.ALL_BUSY)
    assert decide(70_000, 3) == (other, DecisionKind.ALL_BUSY)
    # the engines' counts (another replica's requests) weigh the same: the router counts
    # none in flight, so ConcurrencyThreshold is honoured and the kinds are plain
    assert decide(20_000, 3, engine=True) == (holder, DecisionKind.AFFINITY)
    assert decide(20_000, 0, engine=True) == (other, DecisionKind.OVERFLOW)
    # below the threshold by every count, requests waiting weigh the same
    assert decide(20_000, 3, in_flight=1) == (holder, DecisionKind.AFFINITY)
    assert decide(20_000, 0, in_flight=1) == (other, DecisionKind.OVERFLOW)
    # requests waiting on the home only (the fleet below the threshold, not backlogged):
    # a long new question there is weighed by them, and a plain-cost home loses it
    long_ask = text_block_hashes(doc + " question " + "q" * 3_000, 64, 131_072, "m")
    long_size = len(doc + " question " + "q" * 3_000)
    tail = long_size - len(doc)  # the question: what the home does not hold (the doc is 128 full blocks)
    for inst in pool.instances:
        inst.in_flight = inst.engine_load = inst.engine_waiting = inst.awaiting_first_token = 0
        inst.pending_prefill = 0
    holder.pending_prefill = 10_000
    alt_cost = long_size + 32 * 64 + 0.5 * long_size  # nobody waits there: the plain margin
    assert tail + 10_000 <= alt_cost < 4 * tail + 10_000
    d = pool.choose(None, blocks=long_ask)
    assert (d.instance, d.kind) == (holder, DecisionKind.AFFINITY)  # nobody waiting yet
    holder.engine_load, holder.engine_waiting = 4, 3
    d = pool.choose(None, blocks=long_ask)
    assert (d.instance, d.kind) == (other, DecisionKind.OVERFLOW)


def test_the_one_holder_shortcut_weighs_the_uncached_tail_by_the_requests_waiting():
    # One instance holds all of a follow-up but its last block (the shortcut of _decide
    # that skips the level search); 20 requests wait there for their first token. Its
    # queue is set so that the tail's plain cost stays within the margin but the tail
    # weighed by 1 + 20 does not: the shortcut must weigh it as the full rule does.
    urls = [f"http://10.9.0.{i}:8000" for i in range(2)]
    pool = VariantPool("v", urls, ca(threshold=8, load_weight=0))
    strategy = pool.strategy
    doc = "document 5\n" + "d" * (20_480 - 11)  # ends at a block's end
    holder, other, ask, size = _doc_on_one(pool, doc, " question " + "q" * 900)
    assert size == ask.ends[-1]
    held = strategy.caches[holder.instance_id].match(ask)
    assert held == len(ask) - 1  # all but the last block: the shortcut's case
    tail = size - ask.ends[held - 1]
    margin = size + strategy.tie_units + rules.REPLICATE_FRACTION * size  # nobody waits elsewhere
    holder.awaiting_first_token = 20
    holder.pending_prefill = int(margin - tail)
    assert tail + holder.pending_prefill <= margin < tail * 21 + holder.pending_prefill
    d = pool.choose(None, blocks=ask)
    assert (d.instance, d.kind) == (other, DecisionKind.OVERFLOW)


def test_a_holding_beyond_the_request_costs_nothing_however_many_wait():
    # Precise mode can find more held than the request is long (every block by the
    # events plus a continued request's partial block by the learned view): that costs
    # 0, not a negative amount that requests waiting would multiply into a bonus.
    pool = VariantPool("v", URLS[:2], ca())
    a, b = pool.instances
    a.awaiting_first_token, b.engine_waiting = 5, 0
    assert pool.strategy._uncached_cost(a, -224.0) == pool.strategy._uncached_cost(b, -224.0) == 0.0
    assert pool.strategy._uncached_cost(a, 100.0) == 600.0 and pool.strategy._uncached_cost(b, 100.0) == 100.0


def test_a_backlogged_fleet_replicates_a_prefix_only_for_a_much_longer_queue():
    # The document's home has a queue of 16,000 units of prefill; the other instance
    # none. With requests waiting on the home only, the plain margin (half the request)
    # replicates the document there; once the other instance has a request waiting too
    # (every candidate backlogged), the margin is four requests and the home keeps it.
    urls = [f"http://10.9.0.{i}:8000" for i in range(2)]
    pool = VariantPool("v", urls, ca(threshold=8, load_weight=0))
    doc = "document 7\n" + "d" * 4_085
    holder, other, ask, size = _doc_on_one(pool, doc, " question?")
    holder.pending_prefill, holder.awaiting_first_token = 16_000, 1

    def decide(waiting_elsewhere: int):
        other.awaiting_first_token = waiting_elsewhere
        d = pool.choose(None, blocks=ask)
        return d.instance, d.kind

    # plain margin: home 2 x 10 + 16,000 against size x (1 + waiting) + tie + size / 2
    assert 2 * 10 + 16_000 > size + 32 * 64 + rules.REPLICATE_FRACTION * size
    assert decide(0) == (other, DecisionKind.OVERFLOW)
    # backlogged: the alternative costs 2 x size, the margin four requests
    assert 2 * 10 + 16_000 <= 2 * size + 32 * 64 + rules.BACKLOG_REPLICATE_FRACTION * size
    assert decide(1) == (holder, DecisionKind.AFFINITY)


def test_the_backlog_margin_needs_requests_waiting_on_most_instances_not_one_long_queue():
    # Four instances, the document on one with a long queue of prefill. With document
    # traffic the fleet counts as backlogged when BACKLOG_QUORUM of the instances (3 of
    # 4) have a request waiting: then the home keeps the request. A long queue on one or two instances (a hot
    # document's home) is not a backlog, so the document spreads; three with a request
    # waiting are one even though the fourth has none at this moment (near saturation,
    # a router replica sees such moments often: its own requests and the engines' last
    # scraped counts).
    urls = [f"http://10.9.1.{i}:8000" for i in range(4)]
    pool = VariantPool("v", urls, ca(threshold=64, load_weight=0))

    def route(text: str) -> None:
        pool.acquire(None, blocks=text_block_hashes(text, 64, 131_072, "m")).release()

    # the traffic so far: new questions about a manual (each branches off it, none
    # continues a request routed before), so the share of continuations falls from its
    # start at 1 below CONVERSATIONAL_SHARE
    assert pool.strategy.continued_share == 1.0
    manual = "manual: " + "m" * 2_000
    for k in range(200):
        route(manual + f" question {k}: " + "x" * 300)
    assert pool.strategy.continued_share < rules.CONVERSATIONAL_SHARE
    doc = "document 3\n" + "d" * 4_085
    holder, _, ask, size = _doc_on_one(pool, doc, " question?")
    others = [i for i in pool.instances if i is not holder]
    holder.pending_prefill = 16_000
    # the home's cost against an idle alternative's: over the plain margin, within the backlog one
    assert 16_000 > size + 32 * 64 + rules.REPLICATE_FRACTION * size
    assert 16_000 <= size + 32 * 64 + rules.BACKLOG_REPLICATE_FRACTION * size
    assert rules.BACKLOG_QUORUM == 0.75

    alt = pool.choose(None, blocks=ask).instance  # where the document goes from an idle fleet
    assert alt is not holder
    others.sort(key=lambda i: i is alt)  # the alternative last: the waiting below are elsewhere

    def decide(home_waiting: int, engine_waiting: list[int]):
        holder.engine_waiting = home_waiting
        for inst, w in zip(others, engine_waiting):
            inst.engine_waiting = w
        d = pool.choose(None, blocks=ask)
        return d.instance is holder, pool.strategy._replicate_fraction(pool.instances)

    # requests waiting on the home only, however many: the plain margin, the document
    # moves (they weigh a miss only where they wait: not on the idle alternative)
    assert decide(0, [0, 0, 0]) == (False, rules.REPLICATE_FRACTION)
    assert decide(30, [0, 0, 0]) == (False, rules.REPLICATE_FRACTION)
    assert decide(30, [9, 0, 0]) == (False, rules.REPLICATE_FRACTION)  # two of four
    # three of four: backlogged, the home keeps it (the idle fourth costs only the
    # plain prefill, within the backlog margin); the home need not be one of the three
    assert decide(1, [1, 1, 0]) == (True, rules.BACKLOG_REPLICATE_FRACTION)
    assert decide(0, [1, 1, 1]) == (True, rules.BACKLOG_REPLICATE_FRACTION)
    # the router's own count of requests waiting for their first token counts the same
    holder.awaiting_first_token = 5
    assert decide(0, [0, 2, 1]) == (True, rules.BACKLOG_REPLICATE_FRACTION)
    # conversational traffic (a chat's turns, each continuing the last) keeps the plain
    # margin with three of four waiting: a new conversation moved takes its later turns
    holder.awaiting_first_token = 0
    chat = "chat: "
    for k in range(200):
        chat += f"turn {k} " + "z" * 50
        route(chat)
    assert pool.strategy.continued_share >= rules.CONVERSATIONAL_SHARE
    assert decide(1, [1, 1, 0]) == (False, rules.REPLICATE_FRACTION)
    assert decide(1, [1, 1, 1]) == (True, rules.BACKLOG_REPLICATE_FRACTION)  # every one: backlogged
    # with two instances (or three) every one must have a request waiting
    pool2 = VariantPool("v2", urls[:2], ca(threshold=64, load_weight=0))
    pool2.strategy.continued_share = 0.0
    a, b = pool2.instances
    a.engine_waiting = 9
    assert pool2.strategy._replicate_fraction(pool2.instances) == rules.REPLICATE_FRACTION
    b.awaiting_first_token = 1
    assert pool2.strategy._replicate_fraction(pool2.instances) == rules.BACKLOG_REPLICATE_FRACTION
    # with eight, six
    pool8 = VariantPool("v8", [f"http://10.9.2.{i}:8000" for i in range(8)], ca(threshold=64))
    pool8.strategy.continued_share = 0.0  # (document traffic, as above)
    for k, inst in enumerate(pool8.instances):
        inst.engine_waiting = int(k < 5)
    assert pool8.strategy._replicate_fraction(pool8.instances) == rules.REPLICATE_FRACTION
    pool8.instances[5].awaiting_first_token = 1
    assert pool8.strategy._replicate_fraction(pool8.instances) == rules.BACKLOG_REPLICATE_FRACTION


def test_awaiting_first_token_counts_requests_until_their_first_token():
    pool = VariantPool("v", URLS[:1], ca())
    inst = pool.instances[0]
    a = pool.acquire(None, blocks=text_block_hashes("a" * 500, 64, 131_072, "m"))
    b = pool.acquire(None, blocks=text_block_hashes("b" * 500, 64, 131_072, "m"))
    assert inst.awaiting_first_token == 2
    a.first_token()
    a.first_token()  # idempotent
    assert inst.awaiting_first_token == 1
    a.release()
    b.release()  # released before its first token: no longer waiting either
    assert (inst.awaiting_first_token, inst.in_flight, inst.pending_prefill) == (0, 0, 0)
