"""The extent-based PrefixCache behaves block for block like a plain per-block LRU cache.

``PerBlockCache`` below is the straightforward implementation the engine used first
(one dictionary entry per block, an OrderedDict of free blocks); it is the reference
model. Random operation sequences, with hits taken the way the engine takes them (the
whole cached prefix, or all of it but the last block), must give the same lookups, the
same free and cached block counts, at every step.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Hashable, Sequence

import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixroute.engine.kvcache import PrefixCache


@dataclass(slots=True)
class _SeqBlocks:
    blocks: list[int]
    committed: int  # leading blocks that are computed, full and hashed


class PerBlockCache:
    """Block allocator with prefix caching and LRU eviction (vLLM V1 semantics).

    Args:
        num_blocks: total KV blocks (``kv_capacity_tokens // block_size``), >= 1.
        block_size: tokens per block (vLLM's default is 16).

    Sequences are identified by any hashable id. A sequence's blocks are allocated all
    at once by :meth:`allocate`; computed full blocks become findable by
    :meth:`commit`; :meth:`free` releases them (hashed ones stay cached, evictable).
    """

    def __init__(self, num_blocks: int, block_size: int = 16) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._ref = [0] * num_blocks
        self._hash: list[int | None] = [None] * num_blocks
        self._empty = list(range(num_blocks - 1, -1, -1))  # pop() hands out block 0 first
        self._evictable: OrderedDict[int, None] = OrderedDict()  # LRU first
        self._by_hash: dict[int, int] = {}
        self._seqs: dict[Hashable, _SeqBlocks] = {}

    # -- queries -----------------------------------------------------------------------

    def lookup(self, block_hashes: Sequence[int]) -> int:
        """Number of leading blocks of ``block_hashes`` that are cached (hit), >= 0."""
        n = 0
        for h in block_hashes:
            if h not in self._by_hash:
                break
            n += 1
        return n

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold ``num_tokens`` tokens: ``ceil(num_tokens / block_size)``."""
        return -(-num_tokens // self.block_size)

    @property
    def num_free_blocks(self) -> int:
        """Blocks no sequence references (empty plus cached-and-evictable)."""
        return len(self._empty) + len(self._evictable)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks findable by hash (referenced or evictable)."""
        return len(self._by_hash)

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by sequences, 0.0–1.0 (vLLM ``kv_cache_usage_perc``)."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def has_sequence(self, seq_id: Hashable) -> bool:
        """True while ``seq_id`` holds blocks."""
        return seq_id in self._seqs

    # -- mutations ---------------------------------------------------------------------

    def allocate(self, seq_id: Hashable, num_tokens: int, cached_prefix: Sequence[int] = ()) -> bool:
        """Give ``seq_id`` blocks for ``num_tokens`` tokens, reusing cached prefix blocks.

        Args:
            seq_id: a sequence id not currently allocated.
            num_tokens: tokens the sequence will ever hold in KV (prompt plus output).
            cached_prefix: hashes of its leading blocks to reuse; all must be cached
                (take them as ``hashes[:lookup(hashes)]``, possibly shortened).
        Returns:
            False, changing nothing, when there are not enough free blocks even after
            evicting every unreferenced cached block; True otherwise.
        Raises:
            ValueError: ``seq_id`` is already allocated, a prefix hash is not cached, or
                the prefix is longer than the sequence.
        """
        if seq_id in self._seqs:
            raise ValueError(f"sequence {seq_id!r} already holds blocks")
        total = self.blocks_for(num_tokens)
        if len(cached_prefix) > total:
            raise ValueError("cached prefix is longer than the sequence")
        try:
            hit_ids = [self._by_hash[h] for h in cached_prefix]
        except KeyError:
            raise ValueError("cached_prefix holds a hash that is not cached") from None
        need = total - len(hit_ids)
        hits_evictable = sum(1 for b in hit_ids if self._ref[b] == 0)
        if need > self.num_free_blocks - hits_evictable:
            return False
        for b in hit_ids:
            if self._ref[b] == 0:
                del self._evictable[b]
            self._ref[b] += 1
        blocks = list(hit_ids)
        for _ in range(need):
            if self._empty:
                b = self._empty.pop()
            else:
                b, _ = self._evictable.popitem(last=False)  # evict the least recently used
                del self._by_hash[self._hash[b]]  # type: ignore[arg-type]
                self._hash[b] = None
            self._ref[b] = 1
            blocks.append(b)
        self._seqs[seq_id] = _SeqBlocks(blocks, len(hit_ids))
        return True

    def commit(self, seq_id: Hashable, block_hashes: Sequence[int]) -> None:
        """Mark the first ``len(block_hashes)`` blocks of ``seq_id`` computed and findable.

        ``block_hashes`` is the sequence's full chain so far (already committed ones
        included); a block whose hash is already cached elsewhere stays anonymous.

        Raises:
            KeyError: ``seq_id`` holds no blocks.
            ValueError: more hashes than the sequence has blocks.
        """
        seq = self._seqs[seq_id]
        if len(block_hashes) > len(seq.blocks):
            raise ValueError("more block hashes than allocated blocks")
        for i in range(seq.committed, len(block_hashes)):
            h = block_hashes[i]
            if h not in self._by_hash:
                b = seq.blocks[i]
                self._by_hash[h] = b
                self._hash[b] = h
        seq.committed = max(seq.committed, len(block_hashes))

    def free(self, seq_id: Hashable) -> None:
        """Release ``seq_id``'s blocks; hashed ones stay cached as evictable.

        Blocks are released tail first, so a sequence's last blocks are evicted before
        its first ones (the shared prefix lives longest), as in vLLM. Freeing an
        unknown id does nothing.
        """
        seq = self._seqs.pop(seq_id, None)
        if seq is None:
            return
        for b in reversed(seq.blocks):
            self._ref[b] -= 1
            if self._ref[b] == 0:
                if self._hash[b] is None:
                    self._empty.append(b)
                else:
                    self._evictable[b] = None  # most recently used end


def chain(contents: Sequence[int]) -> list[int]:
    h = 7
    out = []
    for c in contents:
        h = xxhash.xxh3_64_intdigest(h.to_bytes(8, "little") + c.to_bytes(8, "little"))
        out.append(h)
    return out


DOCS = [[i % 3, (i * 7) % 3, 1, 2, 0, 1, 2, 2, 0, 1, 0, 2] for i in range(4)]

op = st.one_of(
    st.tuples(st.just("alloc"), st.integers(0, 7), st.integers(0, 3), st.integers(1, 12), st.integers(0, 11),
              st.integers(0, 5), st.integers(0, 60)),
    st.tuples(st.just("commit"), st.integers(0, 7), st.integers(0, 12)),
    st.tuples(st.just("free"), st.integers(0, 7)),
)


@settings(max_examples=400, deadline=None)
@given(st.integers(3, 40), st.lists(op, max_size=70))
def test_extent_cache_matches_per_block_reference(num_blocks: int, script: list[tuple]) -> None:
    ref, ext = PerBlockCache(num_blocks, 16), PrefixCache(num_blocks, 16)
    live: dict[int, tuple[list[int], int]] = {}
    for step in script:
        if step[0] == "alloc":
            _, sid, doc, cut, branch_at, branch_to, extra = step
            if sid in live:
                continue
            contents = list(DOCS[doc][:cut])
            if branch_to >= 3:  # a different continuation from position branch_at on
                contents[branch_at % cut] = branch_to
            h = chain(contents)
            n_ref, n_ext = ref.lookup(h), ext.lookup(h)
            assert n_ref == n_ext
            hit = n_ref if n_ref < cut else n_ref - 1  # as the engine: a full hit recomputes the last block
            tokens = max(1, hit * 16) + extra
            ok = ref.allocate(sid, tokens, h[:hit])
            assert ext.allocate(sid, tokens, h[:hit]) == ok
            if ok:
                live[sid] = (h, tokens)
        elif step[0] == "commit" and step[1] in live:
            _, sid, n = step
            h, tokens = live[sid]
            n = min(n, len(h), ref.blocks_for(tokens))
            ref.commit(sid, h[:n])
            ext.commit(sid, h, n)
        elif step[0] == "free":
            live.pop(step[1], None)
            ref.free(step[1])
            ext.free(step[1])
        assert ext.num_free_blocks == ref.num_free_blocks
        assert ext.num_cached_blocks == ref.num_cached_blocks
        assert ext.usage == ref.usage
        for d in DOCS:
            h = chain(d)
            assert ext.lookup(h) == ref.lookup(h)
