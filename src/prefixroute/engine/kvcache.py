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

from typing import Callable, Hashable, Sequence

import xxhash

from prefixroute.engine.tokenizer import TEXT_TOKEN_BYTES, TokenizedPrompt

__all__ = ["BLOCK_HASH_SEED", "root_hash", "lora_root_hash", "chain_block_hashes", "prompt_block_hashes",
           "PrefixCache"]

#: Seed of every block hash (fixed: hashes are comparable across processes and runs).
BLOCK_HASH_SEED = 0x6B76_6361_6368_65  # "kvcache"
_ROOT_TEXT = xxhash.xxh3_64_intdigest(b"prefixroute/text", BLOCK_HASH_SEED)
_ROOT_IDS = xxhash.xxh3_64_intdigest(b"prefixroute/token-ids", BLOCK_HASH_SEED)


def root_hash(token_bytes: int, lora_name: str | None = None) -> int:
    """The parent hash of the first block: separates text prompts from token-id prompts,
    and a LoRA adapter's blocks from the base model's (vLLM puts the adapter's name in
    every block's extra keys)."""
    root = _ROOT_TEXT if token_bytes == TEXT_TOKEN_BYTES else _ROOT_IDS
    if lora_name:
        root = xxhash.xxh3_64_intdigest(root.to_bytes(8, "little") + lora_name.encode("utf-8", "surrogatepass"),
                                        BLOCK_HASH_SEED)
    return root


def lora_root_hash(token_bytes: int, lora: str) -> int:
    """The parent hash of the first block of a request run with LoRA adapter ``lora``:
    the adapter's blocks are its own (vLLM keeps the LoRA name in every block's extra
    keys, so a prompt cached for one adapter is a miss for another and for the base)."""
    return xxhash.xxh3_64_intdigest(b"lora\0" + lora.encode("utf-8", "surrogatepass"), root_hash(token_bytes))


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


def prompt_block_hashes(prompt: TokenizedPrompt, block_size: int, lora_name: str | None = None) -> list[int]:
    """Hashes of the full blocks of a prompt: ``prompt.num_tokens // block_size`` of them
    (on the base model, or on the LoRA adapter ``lora_name``)."""
    return chain_block_hashes(
        prompt.payload,
        block_size * prompt.token_bytes,
        prompt.num_tokens // block_size,
        root_hash(prompt.token_bytes, lora_name),
    )


class _Extent:
    """Findable blocks at positions ``[start, end)`` of the hash list ``hashes``, all
    referenced by ``refs`` sequences; free ones (``refs == 0``) are linked in LRU order."""

    __slots__ = ("hashes", "start", "end", "refs", "prev", "next")

    def __init__(self, hashes: Sequence[int], start: int, end: int, refs: int) -> None:
        self.hashes = hashes
        self.start = start
        self.end = end
        self.refs = refs
        self.prev: _Extent | None = None
        self.next: _Extent | None = None


class _Seq:
    __slots__ = ("hashes", "ranges", "anon", "committed", "total", "last")

    def __init__(self, hashes: Sequence[int], hit: int, anon: int, total: int) -> None:
        self.hashes = hashes  # its chain (positions from block 0)
        self.ranges: list[list[int]] = [[0, hit]] if hit else []  # positions of findable blocks it references
        self.anon = anon  # blocks it holds that no hash finds (not computed yet, or duplicates)
        self.committed = hit  # leading blocks handed to commit (or hit)
        self.total = total
        self.last: _Extent | None = None  # the extent its last commit created


class PrefixCache:
    """Block allocator with prefix caching and LRU eviction (vLLM V1 semantics).

    Args:
        num_blocks: total KV blocks (``kv_capacity_tokens // block_size``), >= 1.
        block_size: tokens per block (vLLM's default is 16).

    Sequences are identified by any hashable id. A sequence's blocks are allocated all
    at once by :meth:`allocate`; computed full blocks become findable by
    :meth:`commit`; :meth:`free` releases them (hashed ones stay cached, evictable).

    Block hashes must be **chained** (each hash determines every block before it), as
    vLLM's and :func:`chain_block_hashes`'s are: two chains that agree at position ``i``
    agree everywhere before it.

    Implementation: the cost of every operation is per *run* of blocks, not per block,
    so that the simulator can move millions of blocks in seconds. Findable blocks are
    kept as extents, runs of consecutive blocks of one chain that share one reference
    count, found by the hash of their first block. A lookup follows a chain from
    extent to extent (one comparison each, thanks to chaining, and a binary search where
    two chains part inside an extent). Extents split where a sequence's hit ends, so
    reference counts stay uniform. Free extents sit in one LRU list, each one's blocks
    tail first (as :meth:`free` releases them), and eviction shortens the front extent
    from its tail. Empty and anonymous blocks have no identity and are only counted.
    The result is block for block the behaviour of a per-block LRU (tested against one
    on random operations, with hits taken as the engine takes them): the same lookups,
    the same evictions in the same order. One corner differs: when a sequence
    recomputes blocks whose cached copy has become unreachable (a block before them
    was evicted), its copy is kept findable where a per-block cache would keep it
    anonymous; lookups are unaffected.

    Observing evictions (KV events, tiers): :attr:`on_evict`, when set, is called for
    every run of blocks evicted, as ``on_evict(hashes, start, end)``: the blocks
    ``hashes[start:end]`` (consecutive blocks of one chain) are no longer findable.
    :meth:`commit` returns where the blocks it made findable begin.
    """

    def __init__(self, num_blocks: int, block_size: int = 16) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._first: dict[int, _Extent] = {}  # hash of an extent's first block -> extent
        lru = _Extent((), 0, 0, 0)  # sentinel of the circular LRU list of free extents
        lru.prev = lru.next = lru
        self._lru = lru
        self._evictable = 0  # blocks in free extents
        self._cached = 0  # findable blocks
        self._empty = num_blocks  # blocks holding nothing
        self._seqs: dict[Hashable, _Seq] = {}
        #: Called as ``on_evict(hashes, start, end)`` for each run of blocks evicted.
        self.on_evict: Callable[[Sequence[int], int, int], None] | None = None

    # -- extents -----------------------------------------------------------------------

    @staticmethod
    def _match(e: _Extent, hashes: Sequence[int], p: int, n: int) -> int:
        """Blocks of ``hashes[p:n]`` equal to ``e`` from its start (``hashes[p]`` is e's key)."""
        E, s = e.hashes, e.start
        m = min(e.end - s, n - p)
        if hashes[p + m - 1] == E[s + m - 1]:
            return m
        lo, hi = 1, m - 1  # the chains agree for the first lo blocks, part before hi + 1
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if hashes[p + mid - 1] == E[s + mid - 1]:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def _path(self, hashes: Sequence[int], p: int, n: int) -> tuple[list[tuple[_Extent, int]], int]:
        """Extents matching ``hashes`` from position ``p`` (with the blocks each matches)."""
        first = self._first
        path = []
        while p < n:
            e = first.get(hashes[p])
            if e is None:
                break
            k = self._match(e, hashes, p, n)
            path.append((e, k))
            p += k
        return path, p

    def _lru_append(self, e: _Extent) -> None:
        tail = self._lru.prev
        assert tail is not None
        e.prev, e.next = tail, self._lru
        tail.next = e
        self._lru.prev = e

    @staticmethod
    def _lru_remove(e: _Extent) -> None:
        assert e.prev is not None and e.next is not None
        e.prev.next = e.next
        e.next.prev = e.prev
        e.prev = e.next = None

    def _split(self, e: _Extent, k: int) -> _Extent:
        """Cut ``e`` after ``k`` blocks; returns the new extent holding the rest."""
        rest = _Extent(e.hashes, e.start + k, e.end, e.refs)
        e.end = e.start + k
        self._first[rest.hashes[rest.start]] = rest
        if e.refs == 0:  # the rest's blocks were ahead of e's in LRU order (tail first)
            prev = e.prev
            assert prev is not None
            rest.prev, rest.next = prev, e
            prev.next = rest
            e.prev = rest
        return rest

    def _evict(self, k: int) -> None:
        lru = self._lru
        while k > 0:
            e = lru.next
            assert e is not None and e is not lru, "eviction beyond the free blocks"
            n = e.end - e.start
            if n <= k:
                self._lru_remove(e)
                del self._first[e.hashes[e.start]]
                start, end = e.start, e.end
            else:
                n = k
                e.end -= k  # the least recently used blocks of e are its tail
                start, end = e.end, e.end + k
            if self.on_evict is not None:
                self.on_evict(e.hashes, start, end)
            self._evictable -= n
            self._cached -= n
            k -= n

    # -- queries -----------------------------------------------------------------------

    def lookup(self, block_hashes: Sequence[int]) -> int:
        """Number of leading blocks of ``block_hashes`` that are cached (hit), >= 0."""
        return self._path(block_hashes, 0, len(block_hashes))[1]

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold ``num_tokens`` tokens: ``ceil(num_tokens / block_size)``."""
        return -(-num_tokens // self.block_size)

    @property
    def num_free_blocks(self) -> int:
        """Blocks no sequence references (empty plus cached-and-evictable)."""
        return self._empty + self._evictable

    @property
    def num_cached_blocks(self) -> int:
        """Blocks findable by hash (referenced or evictable)."""
        return self._cached

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by sequences, 0.0–1.0 (vLLM ``kv_cache_usage_perc``)."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def has_sequence(self, seq_id: Hashable) -> bool:
        """True while ``seq_id`` holds blocks."""
        return seq_id in self._seqs

    def _prefix_path(self, cached_prefix: Sequence[int]) -> tuple[list[tuple[_Extent, int]], int]:
        path, p = self._path(cached_prefix, 0, len(cached_prefix))
        if p < len(cached_prefix):
            raise ValueError("cached_prefix holds a hash that is not cached")
        return path, sum(k for e, k in path if e.refs == 0)

    def can_allocate(self, num_tokens: int, cached_prefix: Sequence[int] = ()) -> bool:
        """Whether :meth:`allocate` with the same arguments would succeed; changes nothing.

        Raises:
            ValueError: a prefix hash is not cached.
        """
        _, hits_evictable = self._prefix_path(cached_prefix)
        need = self.blocks_for(num_tokens) - len(cached_prefix)
        return need <= self.num_free_blocks - hits_evictable

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
        hit = len(cached_prefix)
        if hit > total:
            raise ValueError("cached prefix is longer than the sequence")
        path, hits_evictable = self._prefix_path(cached_prefix)
        need = total - hit
        if need > self._empty + self._evictable - hits_evictable:
            return False
        for e, k in path:
            if k < e.end - e.start:
                self._split(e, k)
            if e.refs == 0:
                self._lru_remove(e)
                self._evictable -= k
            e.refs += 1
        from_empty = min(need, self._empty)
        self._empty -= from_empty
        self._evict(need - from_empty)
        self._seqs[seq_id] = _Seq(cached_prefix, hit, need, total)
        return True

    def commit(self, seq_id: Hashable, block_hashes: Sequence[int], num_blocks: int | None = None) -> int:
        """Mark the first ``num_blocks`` (default: all) blocks of ``seq_id`` computed and findable.

        ``block_hashes`` is the sequence's chain (already committed blocks included). The
        cache keeps a reference to it: its first ``num_blocks`` entries must never change
        afterwards (appending is fine). A block whose hash is already cached elsewhere
        stays anonymous.

        Returns:
            ``p``: the blocks ``block_hashes[p:num_blocks]`` became findable by this call
            (``p == num_blocks`` when none did).

        Raises:
            KeyError: ``seq_id`` holds no blocks.
            ValueError: more hashes than the sequence has blocks.
        """
        seq = self._seqs[seq_id]
        n = len(block_hashes) if num_blocks is None else num_blocks
        if n > seq.total:
            raise ValueError("more block hashes than allocated blocks")
        seq.hashes = block_hashes
        c = seq.committed
        if n <= c:
            return n
        # Which of blocks [c, n) are cached already (computed by another sequence at the
        # same time)? Follow the chain from its first block; if it breaks before c (a
        # block this sequence holds as a duplicate was evicted), start again at c. When
        # this sequence's own last extent ends at c, the chain reaches c through it, so
        # the walk can start there (the common case: decoding commits one block at a time).
        last = seq.last
        if last is not None and last.end == c and last.hashes is block_hashes:
            _, new = self._path(block_hashes, c, n)
        else:
            _, new = self._path(block_hashes, 0, n)
            if new < c:
                _, new = self._path(block_hashes, c, n)
        seq.committed = n
        if new >= n:
            return n
        count = n - new
        seq.anon -= count
        self._cached += count
        ranges = seq.ranges
        if last is not None and last.hashes is block_hashes and last.end == new and last.refs == 1:
            last.end = n  # only this sequence holds its last extent: grow it
        else:
            last = _Extent(block_hashes, new, n, 1)
            self._first[block_hashes[new]] = last
            seq.last = last
        if ranges and ranges[-1][1] == new:
            ranges[-1][1] = n
        else:
            ranges.append([new, n])
        return new

    def free(self, seq_id: Hashable) -> None:
        """Release ``seq_id``'s blocks; hashed ones stay cached as evictable.

        Blocks are released tail first, so a sequence's last blocks are evicted before
        its first ones (the shared prefix lives longest), as in vLLM. Freeing an
        unknown id does nothing.
        """
        seq = self._seqs.pop(seq_id, None)
        if seq is None:
            return
        self._empty += seq.anon
        first = self._first
        hashes = seq.hashes
        for a, b in reversed(seq.ranges):
            extents = []
            p = a
            while p < b:
                e = first[hashes[p]]
                extents.append(e)
                p += e.end - e.start
            for e in reversed(extents):
                e.refs -= 1
                if e.refs == 0:
                    self._lru_append(e)  # most recently used end
                    self._evictable += e.end - e.start
