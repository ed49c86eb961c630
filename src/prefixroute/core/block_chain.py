"""Chained block hashes: a routing text cut into blocks, each hashed with all before it.

Sans-I/O: bytes and a 64-bit root in, hashes out, each computed when first read.
:mod:`prefixroute.core.keys` turns a request's text, raw body or token ids into those
bytes and roots the chain in its model (or endpoint) and tenant.

* :func:`block_ends`: ``CACHE_AWARE``'s block schedule (``BlockSize`` units, doubling
  every :data:`BLOCKS_PER_DOUBLING` blocks); :func:`scheduled_blocks` the chain on it,
  with a final partial block.
* :class:`BlockChain`: the chain itself (a sequence of unsigned 64-bit hashes).
* :func:`fixed_blocks`: ``LLMD_REFERENCE``'s fixed-size blocks, no doubling.
"""

from __future__ import annotations

from bisect import bisect_right
from functools import lru_cache
from typing import Sequence

import xxhash

__all__ = ["BLOCKS_PER_DOUBLING", "block_ends", "BlockChain", "scheduled_blocks", "fixed_blocks"]

_xxh3 = xxhash.xxh3_64_intdigest

#: Blocks keep ``BlockSize`` for this many blocks, then double, and double again after as
#: many more: block ends fall at ``BlockSize x 16 x (2**g - 1)`` after ``g`` groups. A
#: long prompt then costs a few dozen blocks (64 KB of text: 97 with BlockSize 64, not
#: 1,024), and a match is still known to within 1/8 of its length (a block is at most
#: 1/8 of the text before it), finer than any prefill-time difference a routing choice
#: can act on.
BLOCKS_PER_DOUBLING = 16


@lru_cache(maxsize=64)
def block_ends(block_size: int, max_length: int) -> tuple[int, ...]:
    """Where the full blocks of a routing text end, in units (characters/bytes), up to
    ``max_length``: ``block_size`` each for :data:`BLOCKS_PER_DOUBLING` blocks, then
    twice that for as many, and so on.

    Raises:
        ValueError: ``block_size`` < 1.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    ends: list[int] = []
    pos, size = 0, block_size
    while pos + size <= max_length:
        pos += size
        ends.append(pos)
        if len(ends) % BLOCKS_PER_DOUBLING == 0:
            size *= 2
    return tuple(ends)


class BlockChain(Sequence[int]):
    """The chained block hashes of one routing text, computed when first read.

    Block ``k``'s hash is ``xxh3_64(data[:ends[k]], seed=root)``: the hash of the whole
    text up to the end of the block, so equal hashes at position ``k`` mean equal text
    up to there (a match is always a true prefix match; the same chaining idea as vLLM's
    block hashes, where each block's hash includes its parent's). ``root`` folds in the
    model (or endpoint) and the tenant.

    Reading one hash costs one xxh3 pass over the prefix (about 1.5 µs for 64 KB), so a
    strategy that binary-searches a chain reads a handful of them. The pass that reads
    block ``k`` also records block ``k - 1``'s hash on the way (xxh3's streaming state
    digested at ``ends[k - 1]``, then continued): a search that gallops down from the end
    of the chain reads ``k - 1`` right after ``k``. :meth:`hashes` computes all of them in
    one streaming pass (what learning needs).

    Args:
        data: the routing text's bytes (UTF-8 text, a raw body, or token ids).
        root: the 64-bit seed of every hash of this chain.
        ends: increasing block end offsets into ``data`` (the last may be ``len(data)``:
            a final partial block).
        unit_shift: block sizes in routing-text units are byte counts ``>> unit_shift``
            (0 for text and raw bodies; 1 for token ids: 8 bytes = 4 characters' worth).
        full: how many of the blocks are full (on the schedule of :func:`block_ends`);
            default all. The rest (at most one) is the final partial block.

    Attributes:
        precise: the request's precise-mode data
            (:class:`prefixroute.core.precise_policy.PreciseRequest`: its KV block keys
            from its token ids), set by the driver that computed them, else ``None``.
            ``CACHE_AWARE`` then weighs what the engines report holding.
    """

    __slots__ = ("_mv", "root", "ends", "_memo", "_all", "unit_shift", "full", "precise")

    def __init__(self, data: bytes | memoryview, root: int, ends: Sequence[int], unit_shift: int = 0,
                 full: int | None = None) -> None:
        self._mv = memoryview(data)
        self.root = root
        self.ends = ends
        self._memo: dict[int, int] = {}
        self._all: list[int] | None = None
        self.unit_shift = unit_shift
        self.full = len(ends) if full is None else full
        self.precise: object = None

    def __len__(self) -> int:
        return len(self.ends)

    def __getitem__(self, k):  # type: ignore[override]
        if isinstance(k, slice):
            return self.hashes()[k]
        if self._all is not None:
            return self._all[k]
        n = len(self.ends)
        if k < 0:
            k += n
        if not 0 <= k < n:
            raise IndexError("block index out of range")
        h = self._memo.get(k)
        if h is None:
            h = self._read(k)
        return h

    def __iter__(self):  # type: ignore[override]
        return iter(self.hashes())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, (BlockChain, list, tuple)):
            return self.hashes() == list(other)
        return NotImplemented

    def __repr__(self) -> str:
        return f"BlockChain({len(self.ends)} blocks, {self.ends[-1] if self.ends else 0} bytes)"

    def prefix_hash(self, end: int, k: int) -> int:
        """The hash a block ``k`` ending ``end`` units into the routing text has (the
        hash of the text up to there, as :meth:`hash` gives for a block ending there):
        a partial block another chain ended with, compared with this chain's text.
        ``end`` must not pass the chain's last end."""
        return _xxh3(self._mv[: end << self.unit_shift], self.root)

    def hash(self, k: int) -> int:
        """Block ``k``'s hash, ``0 <= k < len(self)`` (``self[k]`` without the checks)."""
        if self._all is not None:
            return self._all[k]
        h = self._memo.get(k)
        if h is None:
            h = self._read(k)
        return h

    def _read(self, k: int) -> int:
        """Hash block ``k`` (and block ``k - 1`` on the way, unless known) and memoise."""
        memo, ends, mv = self._memo, self.ends, self._mv
        if k == 0 or k - 1 in memo:
            h = memo[k] = _xxh3(mv[: ends[k]], self.root)
            return h
        state = xxhash.xxh3_64(mv[: ends[k - 1]], self.root)
        memo[k - 1] = state.intdigest()
        state.update(mv[ends[k - 1] : ends[k]])
        h = memo[k] = state.intdigest()
        return h

    def hashes(self) -> list[int]:
        """Every block's hash, in order (one streaming xxh3 pass; cached)."""
        if self._all is None:
            h = xxhash.xxh3_64(seed=self.root)
            mv, prev, out = self._mv, 0, []
            for e in self.ends:
                h.update(mv[prev:e])
                out.append(h.intdigest())
                prev = e
            self._all = out
        return self._all

    def hashes_from(self, start: int) -> list[int]:
        """The hashes of blocks ``start`` to the end, in order: one streaming xxh3 pass
        over the chain's bytes, a digest for those blocks only (the last one alone comes
        from the memo when known)."""
        if self._all is not None:
            return self._all[start:]
        ends = self.ends
        n = len(ends)
        if start <= 0:
            return list(self.hashes())
        if start >= n:
            return []
        if start == n - 1:
            return [self.hash(start)]
        mv, prev = self._mv, ends[start - 1]
        h = xxhash.xxh3_64(mv[:prev], self.root)
        out = []
        for e in ends[start:]:
            h.update(mv[prev:e])
            out.append(h.intdigest())
            prev = e
        return out

    def sizes(self) -> list[int]:
        """Each block's size in routing-text units (characters; token ids count 4)."""
        shift, prev, out = self.unit_shift, 0, []
        for e in self.ends:
            out.append((e - prev) >> shift)
            prev = e
        return out


def fixed_blocks(data: bytes | memoryview, root: int, block_size: int, most: int) -> BlockChain:
    """Chained hashes of ``data``'s full blocks of ``block_size`` bytes, at most ``most``
    of them, no doubling and no partial block (a request shorter than one block has none):
    the blocks of ``LLMD_REFERENCE``, as the Inference Extension's prefix plugin cuts a
    prompt."""
    full = min(len(data) // block_size, most)
    return BlockChain(data, root, [block_size * (k + 1) for k in range(full)])


def scheduled_blocks(data: bytes | memoryview, root: int, block_size: int, max_length: int,
                     unit_shift: int = 0) -> BlockChain:
    """Chain over ``data`` (already cut to the cap): full blocks on the schedule of
    :func:`block_ends`, plus a final partial block when text is left over."""
    n = len(data)
    ends_all = block_ends(block_size, max_length)
    full = bisect_right(ends_all, n)
    ends = list(ends_all[:full])
    if n and (not ends or ends[-1] < n):
        ends.append(n)
    return BlockChain(data, root, ends, unit_shift, full)

