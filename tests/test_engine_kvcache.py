"""The paged KV cache with prefix caching: chained hashes, sharing, LRU eviction."""

from __future__ import annotations

import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixroute.engine.kvcache import (
    BLOCK_HASH_SEED,
    PrefixCache,
    chain_block_hashes,
    prompt_block_hashes,
    root_hash,
)
from prefixroute.engine.tokenizer import from_token_ids, tokenize_text

BS = 16


def hashes_of(text: str) -> list[int]:
    return prompt_block_hashes(tokenize_text(text), BS)


def test_hash_is_the_documented_chain() -> None:
    text = "A" * 64 + "B" * 64 + "tail"
    h0 = xxhash.xxh3_64_intdigest(root_hash(4).to_bytes(8, "little") + b"A" * 64, BLOCK_HASH_SEED)
    h1 = xxhash.xxh3_64_intdigest(h0.to_bytes(8, "little") + b"B" * 64, BLOCK_HASH_SEED)
    assert hashes_of(text) == [h0, h1]  # the 1-token tail is not a full block


def test_same_block_after_different_parents_hashes_differently() -> None:
    a = hashes_of("X" * 64 + "B" * 64)
    b = hashes_of("Y" * 64 + "B" * 64)
    c = hashes_of("X" * 64 + "B" * 64 + "more text")
    assert a[1] != b[1]
    assert a == c[:2]
    # a block identical to the first one but at position 1 is not a hit either
    assert hashes_of("B" * 64)[0] != a[1]


def test_only_full_blocks_are_hashed() -> None:
    assert len(hashes_of("z" * 63)) == 1  # 16 tokens, the last one 3 bytes: a full block
    assert len(hashes_of("z" * 64)) == 1
    assert len(hashes_of("z" * 60)) == 0  # 15 tokens


def test_text_and_token_id_prompts_never_share_blocks() -> None:
    ids = from_token_ids(list(range(16)))
    assert prompt_block_hashes(ids, BS) != prompt_block_hashes(tokenize_text("q" * 64), BS)
    assert chain_block_hashes(ids.payload, 128, 1, root_hash(8)) == prompt_block_hashes(ids, BS)


def test_lookup_counts_leading_cached_blocks() -> None:
    cache = PrefixCache(num_blocks=8, block_size=BS)
    h = hashes_of("p" * 64 * 3)
    assert cache.allocate("s", 48)
    cache.commit("s", h[:2])  # only two blocks computed so far
    assert cache.lookup(h) == 2
    assert cache.lookup(h[2:]) == 0  # block 2 was never computed
    assert cache.lookup(hashes_of("q" * 64 * 3)) == 0
    assert cache.lookup([]) == 0
    cache.free("s")
    assert cache.lookup(h) == 2  # freed blocks stay cached
    assert cache.num_cached_blocks == 2


def test_cached_prefix_is_shared_not_copied() -> None:
    cache = PrefixCache(num_blocks=8, block_size=BS)
    h = hashes_of("s" * 64 * 4)
    assert cache.allocate("a", 64)
    cache.commit("a", h)
    assert cache.usage == pytest.approx(4 / 8)
    assert cache.allocate("b", 80, h[:4])  # 5 blocks, 4 of them a's
    assert cache.usage == pytest.approx(5 / 8)
    cache.free("a")
    assert cache.usage == pytest.approx(5 / 8)  # still referenced by b
    cache.free("b")
    assert cache.usage == 0.0
    assert cache.num_free_blocks == 8
    assert cache.lookup(h) == 4


def test_lru_eviction_order() -> None:
    cache = PrefixCache(num_blocks=4, block_size=BS)
    ha = hashes_of("a" * 128)
    hb = hashes_of("b" * 128)
    for seq, h in (("A", ha), ("B", hb)):
        assert cache.allocate(seq, 32)
        cache.commit(seq, h)
        cache.free(seq)
    assert cache.num_cached_blocks == 4 and cache.usage == 0.0
    # A was freed first: its blocks go first, its tail before its head
    assert cache.allocate("C", 16)
    assert (cache.lookup(ha), cache.lookup(hb)) == (1, 2)
    assert cache.allocate("D", 16)
    assert (cache.lookup(ha), cache.lookup(hb)) == (0, 2)
    cache.free("C")
    cache.free("D")  # C and D had no hashes: their blocks are empty, handed out first
    assert cache.allocate("E", 32)
    assert cache.lookup(hb) == 2


def test_a_hit_refreshes_recency() -> None:
    cache = PrefixCache(num_blocks=4, block_size=BS)
    ha = hashes_of("a" * 128)
    hb = hashes_of("b" * 128)
    for seq, h in (("A", ha), ("B", hb)):
        assert cache.allocate(seq, 32)
        cache.commit(seq, h)
        cache.free(seq)
    assert cache.allocate("A2", 32, ha)  # reuse A: now the most recently used
    cache.free("A2")
    assert cache.allocate("C", 32)
    assert (cache.lookup(ha), cache.lookup(hb)) == (2, 0)


def test_capacity_is_respected_and_referenced_blocks_are_never_evicted() -> None:
    cache = PrefixCache(num_blocks=4, block_size=BS)
    h = hashes_of("r" * 192)
    assert cache.allocate("running", 48)
    cache.commit("running", h)
    assert not cache.allocate("big", 32)  # 2 blocks wanted, 1 free
    assert not cache.has_sequence("big")
    assert cache.usage == pytest.approx(3 / 4)
    assert cache.lookup(h) == 3
    assert cache.allocate("small", 16)
    assert cache.num_free_blocks == 0
    assert not cache.allocate("one-more", 1)
    cache.free("running")
    assert cache.allocate("big", 32)  # evicts two of running's now-free blocks
    assert cache.lookup(h) == 1  # head kept: tail blocks were evicted first


def test_allocating_with_evictable_hits_counts_them_as_used() -> None:
    cache = PrefixCache(num_blocks=3, block_size=BS)
    h = hashes_of("h" * 128)
    assert cache.allocate("a", 32)
    cache.commit("a", h)
    cache.free("a")
    # 3 blocks wanted: 2 hits (currently free) + 1 new: fits exactly
    assert cache.allocate("b", 48, h)
    assert cache.usage == 1.0


def test_duplicate_concurrent_block_stays_anonymous() -> None:
    cache = PrefixCache(num_blocks=4, block_size=BS)
    h = hashes_of("d" * 64)
    assert cache.allocate("x", 16)
    assert cache.allocate("y", 16)
    cache.commit("x", h)
    cache.commit("y", h)
    assert cache.num_cached_blocks == 1
    cache.free("x")
    cache.free("y")
    assert cache.num_free_blocks == 4 and cache.lookup(h) == 1


def test_errors() -> None:
    cache = PrefixCache(num_blocks=2, block_size=BS)
    with pytest.raises(ValueError):
        PrefixCache(num_blocks=0)
    assert cache.allocate("s", 16)
    with pytest.raises(ValueError):
        cache.allocate("s", 16)
    with pytest.raises(ValueError):
        cache.allocate("t", 16, [12345])  # not cached
    with pytest.raises(ValueError):
        cache.commit("s", hashes_of("e" * 128))  # 2 hashes, 1 block
    cache.free("unknown")  # no-op


ops = st.lists(
    st.tuples(st.sampled_from(["alloc", "free"]), st.integers(0, 5), st.integers(1, 80), st.integers(0, 3)),
    max_size=60,
)


@settings(max_examples=150, deadline=None)
@given(ops)
def test_block_accounting_invariants(script: list[tuple[str, int, int, int]]) -> None:
    """Whatever the order of allocations and frees: blocks are conserved, usage is the
    referenced fraction, and everything is free again at the end."""
    cache = PrefixCache(num_blocks=12, block_size=BS)
    prefixes = [hashes_of(c * 64 * 5) for c in "wxyz"]
    live: dict[int, int] = {}
    for op, seq, tokens, which in script:
        if op == "alloc" and seq not in live:
            h = prefixes[which][: tokens // BS]
            hit = h[: cache.lookup(h)]
            if cache.allocate(seq, tokens, hit):
                cache.commit(seq, h)
                live[seq] = cache.blocks_for(tokens)
        elif op == "free":
            cache.free(seq)
            live.pop(seq, None)
        referenced = round(cache.usage * cache.num_blocks)
        assert referenced + cache.num_free_blocks == cache.num_blocks
        assert referenced <= sum(live.values())
        assert cache.num_cached_blocks <= cache.num_blocks
    for seq in list(live):
        cache.free(seq)
    assert cache.usage == 0.0
    assert cache.num_free_blocks == cache.num_blocks
