"""CACHE_AWARE's placement faults, each a test that fails on the rule before the cost model:
memory counted in units only, sub-block and image prompts not kept on one instance,
tenants (cache_salt) sharing an assignment, new prefixes placed without regard to load,
conversations drifting near the threshold."""

import random

from prefixroute.core.approx_cache import BYTES_PER_BLOCK_ENTRY, ViewBudget
from prefixroute.core.config import RoutingConfig
from prefixroute.core.keys import openai_block_hashes, text_block_hashes
from prefixroute.core.pool import VariantPool
from prefixroute.core.strategies import DecisionKind

URLS = [f"http://10.9.0.{i}:8000" for i in range(4)]


def ca(threshold=8, **kw):
    return RoutingConfig.build("cache-aware", concurrency_threshold=threshold, **kw)


def chat_blocks(messages, **extra):
    payload = {"model": "m", "messages": messages, **extra}
    return openai_block_hashes(payload, True, 64, 131_072, media_chars=576 * 4)


def test_tiny_prompts_stay_within_each_views_memory():
    # A view bounded by the units it covers alone held 8,192 / 6 = 1,365 blocks of
    # 6-character prompts where 128 full blocks fill its budget: 10 times the memory.
    pool = VariantPool("v", URLS, ca(instance_cache_tokens=2_048))  # 8,192 characters: 128 blocks of 64
    for i in range(20_000):
        with pool.acquire(None, blocks=text_block_hashes(f"p{i:05d}", 64, 131_072, "m")):
            pass
    stats = pool.strategy.stats()
    per_view = [len(c) for c in pool.strategy.caches.values()]
    assert max(per_view) <= 128 and min(per_view) >= 100, per_view
    assert stats["approx_cache_bytes"] == sum(per_view) * BYTES_PER_BLOCK_ENTRY <= 4 * 128 * BYTES_PER_BLOCK_ENTRY
    # the same memory per instance, each under its own ceiling of 128 blocks
    per_instance = pool.strategy.instance_stats()
    assert sorted(per_instance) == sorted(pool.strategy.caches)
    assert sum(v["approx_cache_instance_bytes"] for v in per_instance.values()) == stats["approx_cache_bytes"]
    assert {v["approx_cache_instance_max_bytes"] for v in per_instance.values()} == {128 * BYTES_PER_BLOCK_ENTRY}


def test_a_router_wide_ceiling_bounds_every_view_together():
    # Two variants of 4 instances under one ceiling of 400 blocks: 50 per view, however
    # large each view's own budget (1.2 M tokens: 75,000 blocks each).
    budget = ViewBudget(400 * BYTES_PER_BLOCK_ENTRY)
    pools = [VariantPool(f"v{k}", [f"http://10.9.{k}.{i}:8000" for i in range(4)], ca(), view_budget=budget)
             for k in range(2)]
    assert len(budget) == 8
    for i in range(5_000):
        for pool in pools:
            with pool.acquire(None, blocks=text_block_hashes(f"document {i} " + "x" * 300, 64, 131_072, "m")):
                pass
    assert budget.blocks() <= 400
    assert all(len(c) <= 50 for p in pools for c in p.strategy.caches.values())
    # A variant that leaves frees its share for the others.
    pools[1].close()
    assert len(budget) == 4 and all(c.max_blocks == 100 for c in pools[0].strategy.caches.values())


def test_a_repeated_sub_block_prompt_keeps_its_instance():
    # A short instruction (less than one 64-character block) sent again and again, while
    # the other instances' load moves below the threshold: always the same instance.
    pool = VariantPool("v", URLS, ca(threshold=8))
    rng = random.Random(3)
    prompts = [chat_blocks([{"role": "user", "content": f"Classify #{k}: spam?"}]) for k in range(20)]
    homes = {}
    held = []
    for i in range(400):
        k = rng.randrange(20)
        for inst in pool.instances:
            inst.engine_load = rng.randrange(0, 6)
        lease = pool.acquire(None, blocks=prompts[k])
        assert lease.decision.kind is DecisionKind.AFFINITY
        assert homes.setdefault(k, lease.instance.instance_id) == lease.instance.instance_id, (i, k)
        lease.first_token()
        held.append(lease)
        if len(held) > 4:
            held.pop(0).release()
    assert len(set(homes.values())) >= 3  # and the prompts spread over the fleet


def test_questions_about_one_image_stay_on_its_instance():
    # An image is hundreds of prefill tokens but a few dozen characters of stand-in: the
    # stand-in weighs MediaTokens tokens, so the instance that prefilled the image is
    # the home of every later question about it.
    pool = VariantPool("v", URLS, ca(threshold=8))
    homes = {}
    for q in range(60):
        image = q % 6
        blocks = chat_blocks([
            {"role": "system", "content": "Answer briefly."},
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": f"https://img.example/{image}.jpg"}},
                                         {"type": "text", "text": f"What is in region {q}?"}]}])
        with pool.acquire(None, blocks=blocks) as lease:
            lease.first_token()
            assert homes.setdefault(image, lease.instance.instance_id) == lease.instance.instance_id, q
    assert len(set(homes.values())) >= 2


def test_two_cache_salts_on_one_prompt_route_independently():
    # vLLM keeps salted requests' KV blocks apart: a salt is a tenant of its own, so the
    # same prompt under two salts is placed as two prefixes (the same instance only as
    # often as two independent placements coincide).
    pool = VariantPool("v", [f"http://10.9.1.{i}:8000" for i in range(8)], ca(threshold=100))
    same = 0
    for d in range(200):
        messages = [{"role": "system", "content": f"document {d} " + "y" * 3000}, {"role": "user", "content": "q"}]
        got = []
        for salt in ("tenant-a", "tenant-b"):
            with pool.acquire(None, blocks=chat_blocks(messages, cache_salt=salt)) as lease:
                got.append(lease.instance.instance_id)
                assert lease.decision.prefill_units > 3000  # nothing of the other salt's blocks counts as held
        same += got[0] == got[1]
    assert same <= 45, same  # about 200 / 8 = 25 by chance


def test_new_prefixes_go_to_less_loaded_instances():
    # One instance is busy prefilling (three 25,000-character misses waiting for their
    # first token): new prefixes whose rendezvous choice it is go elsewhere, below the
    # threshold, instead of queueing behind them.
    pool = VariantPool("v", URLS, ca(threshold=32))
    busy = [pool.acquire(None, blocks=text_block_hashes(f"cold {k} " + "c" * 25_000, 64, 131_072, "m"))
            for k in range(60)]
    loaded = max(pool.instances, key=lambda i: i.pending_prefill)
    for lease in busy:
        if lease.instance is not loaded:
            lease.release()
    assert loaded.pending_prefill > 3 * 25_000 and loaded.in_flight < 32
    placed = {u: 0 for u in URLS}
    for d in range(400):
        d_ = pool.choose(None, blocks=text_block_hashes(f"new document {d} " + "n" * 4_000, 64, 131_072, "m"))
        placed[d_.instance.instance_id] += 1
    assert placed[loaded.instance_id] == 0, placed
    assert min(placed.values(), key=lambda v: v or 10**9) >= 80  # the others share them


def test_a_growing_conversation_stays_on_one_instance_below_the_threshold():
    # The conversation's instance is busier than the others (6 of 8 in flight, its engine
    # reports more) but below the threshold: every turn goes back to it, short turns
    # included, since the router's match ends exactly where the previous turn ended.
    pool = VariantPool("v", URLS, ca(threshold=8))
    system = "You are a helpful assistant. " * 40  # shared by every conversation
    for inst in pool.instances:  # every instance has served conversations with it
        pool.learn(inst, chat_blocks([{"role": "system", "content": system}, {"role": "user", "content": "hi"}]))
    messages = [{"role": "system", "content": system}]
    home = None
    others = []
    for turn in range(12):
        messages = messages + [{"role": "user", "content": f"turn {turn}: " + "u" * (20 + 60 * (turn % 3))}]
        lease = pool.acquire(None, blocks=chat_blocks(messages))
        lease.first_token()
        if home is None:
            home = lease.instance
            k = 0
            while home.in_flight < 7:  # this turn and 6 others: busier than any other instance
                o = pool.acquire(None, blocks=text_block_hashes(f"other {k}", 64, 131_072, "m"), learn=False)
                k += 1
                if o.instance is home:
                    o.first_token()
                    others.append(o)
                else:
                    o.release()
            home.engine_load = 9
        assert lease.instance is home and lease.decision.kind is DecisionKind.AFFINITY, turn
        assert home.in_flight == 7 and all(i.in_flight == 0 for i in pool.instances if i is not home)
        lease.release()
        messages = messages + [{"role": "assistant", "content": "a" * 900}]  # the answer, as the client resends it
