"""Paged KV cache with automatic prefix caching, modelled on vLLM V1's block pool.

Sans-I/O bookkeeping only; no tensors. The cache holds ``num_blocks`` blocks of
``block_size`` tokens. A block is in one of three states:

* **referenced** by one or more running sequences (never evicted);
* **cached and free**: it holds the KV of a full block of some earlier sequence and is
  found by its hash, but no sequence references it; evictable, least recently used first;
* **empty**: free and holding nothing.

Block hashes are chained as in vLLM: the hash of block ``i`` covers the hash of block
``i-1`` and the block's own tokens, so a block is found only after the same prefix.
``hash_i = xxh3_64(hash_{i-1}.to_bytes(8, "little") + block_payload, seed=BLOCK_HASH_SEED)``
with a fixed root per payload kind (text vs token ids), never Python's ``hash()``.
Only full blocks get a hash; only hashed blocks can be hit.

Differences from vLLM, on purpose: empty blocks are handed out before any cached block
is evicted (vLLM keeps one queue for both); when two sequences compute the same block
concurrently, the second copy stays anonymous (vLLM keeps both under one hash).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Hashable, Sequence

import xxhash

from prefixroute.engine.tokenizer import TEXT_TOKEN_BYTES, TokenizedPrompt

__all__ = ["BLOCK_HASH_SEED", "root_hash", "chain_block_hashes", "prompt_block_hashes", "PrefixCache"]

#: Seed of every block hash (fixed: hashes are comparable across processes and runs).
BLOCK_HASH_SEED = 0x6B76_6361_6368_65  # "kvcache"
_ROOT_TEXT = xxhash.xxh3_64_intdigest(b"prefixroute/text", BLOCK_HASH_SEED)
_ROOT_IDS = xxhash.xxh3_64_intdigest(b"prefixroute/token-ids", BLOCK_HASH_SEED)


def root_hash(token_bytes: int) -> int:
    """The parent hash of the first block: separates text prompts from token-id prompts."""
    return _ROOT_TEXT if token_bytes == TEXT_TOKEN_BYTES else _ROOT_IDS


def chain_block_hashes(payload: bytes, bytes_per_block: int, num_blocks: int, parent: int) -> list[int]:
    """Chained hashes of the first ``num_blocks`` blocks of ``payload``.

    Args:
        payload: token-aligned bytes (see :class:`~prefixroute.engine.tokenizer.TokenizedPrompt`).
        bytes_per_block: ``block_size * token_bytes``.
        num_blocks: how many blocks to hash; ``payload`` must hold at least that many.
        parent: hash of the block before the first one (:func:`root_hash` for block 0).
    Returns:
        ``num_blocks`` unsigned 64-bit hashes.
    """
    out: list[int] = []
    view = memoryview(payload)
    digest = xxhash.xxh3_64_intdigest
    h = parent
    for start in range(0, num_blocks * bytes_per_block, bytes_per_block):
        h = digest(h.to_bytes(8, "little") + view[start : start + bytes_per_block], BLOCK_HASH_SEED)
        out.append(h)
    return out


def prompt_block_hashes(prompt: TokenizedPrompt, block_size: int) -> list[int]:
    """Hashes of the full blocks of a prompt: ``prompt.num_tokens // block_size`` of them."""
    return chain_block_hashes(
        prompt.payload,
        block_size * prompt.token_bytes,
        prompt.num_tokens // block_size,
        root_hash(prompt.token_bytes),
    )


@dataclass(slots=True)
class _SeqBlocks:
    blocks: list[int]
    committed: int  # leading blocks that are computed, full and hashed


class PrefixCache:
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
