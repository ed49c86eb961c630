"""Lower KV-cache tiers of the emulated engine: host memory (CPU) and a tier shared by all
instances, in the spirit of LMCache and of a managed tiered KV cache.

Sans-I/O bookkeeping of block hashes, no tensors. The hashes are the prefix cache's own
chained hashes (:mod:`prefixroute.engine.kvcache`): a function of the tokens only, the
same on every instance, so a block one instance computed is found by another.

* :class:`CpuTier`, one per instance: blocks **evicted from the GPU** go there (a victim
  cache); least recently used out first. A block loaded back stays (a copy).
* a **shared tier** (:class:`SharedTier`: :class:`MemorySharedTier` in one process, the
  simulator's; :class:`prefixroute.engine.shared_tier_file.FileSharedTier` across the
  processes of an emulated fleet): every block an instance makes findable on its GPU is
  also written there (write-through, as LMCache writes computed chunks to its remote
  backend); any instance loads it.

On admission (:class:`~prefixroute.engine.core.EngineCore`) a prompt's chain is matched
GPU first, then continued in the CPU tier, then in the shared tier; loaded blocks cost
transfer time instead of prefill (:class:`~prefixroute.engine.model.EngineConfig`).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Protocol

__all__ = ["CpuTier", "SharedTier", "MemorySharedTier", "runs"]


def runs(indices: Sequence[int]) -> list[tuple[int, int]]:
    """Increasing ``indices`` grouped into ``[start, end)`` runs of consecutive values."""
    out: list[tuple[int, int]] = []
    for i in indices:
        if out and out[-1][1] == i:
            out[-1] = (out[-1][0], i + 1)
        else:
            out.append((i, i + 1))
    return out


class CpuTier:
    """One instance's host-memory tier: an LRU set of block hashes.

    Args:
        num_blocks: capacity in blocks, >= 1.
    Raises:
        ValueError: ``num_blocks`` < 1.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"a CPU tier holds at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self._blocks: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self._blocks

    def put(self, hashes: Sequence[int], start: int, end: int) -> tuple[list[int], list[int]]:
        """Store blocks ``hashes[start:end]`` (evicted from the GPU).

        Returns:
            ``(stored, evicted)``: the positions (in ``hashes``) of the blocks that were
            not in the tier yet, and the hashes evicted to make room, least recently used
            first (when more blocks are stored than the tier holds, the first of them are
            evicted in the same call: report the stores before the evictions).
        """
        blocks = self._blocks
        stored = []
        for i in range(start, end):
            h = hashes[i]
            if h in blocks:
                blocks.move_to_end(h)
            else:
                blocks[h] = None
                stored.append(i)
        evicted = []
        while len(blocks) > self.num_blocks:
            h, _ = blocks.popitem(last=False)
            evicted.append(h)
        return stored, evicted

    def match(self, hashes: Sequence[int], start: int, end: int) -> int:
        """How many blocks of ``hashes[start:end]``, from ``start`` on, are held (and
        touches them: they are about to be loaded)."""
        blocks = self._blocks
        n = start
        while n < end and hashes[n] in blocks:
            blocks.move_to_end(hashes[n])
            n += 1
        return n - start

    def clear(self) -> list[int]:
        """Drop every block; returns their hashes."""
        gone = list(self._blocks)
        self._blocks.clear()
        return gone


class SharedTier(Protocol):
    """A tier every instance reads and writes (see the module docstring)."""

    def match(self, hashes: Sequence[int], start: int, end: int) -> int:
        """How many blocks of ``hashes[start:end]``, from ``start`` on, the tier holds."""
        ...

    def put(self, hashes: Sequence[int], published: Sequence[int]) -> tuple[list[int], list[int]]:
        """Store blocks ``hashes`` (with the hashes their storer published them under).

        Returns ``(stored, evicted)``: the positions in ``hashes`` of the blocks not held
        before, and the published hashes of the blocks evicted to make room.
        """
        ...


class MemorySharedTier:
    """A shared tier in one process (the simulator's, tests'): an LRU map from block
    hash to the hash its storer published it under.

    Args:
        num_blocks: capacity in blocks, >= 1.
    Raises:
        ValueError: ``num_blocks`` < 1.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"a shared tier holds at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self._blocks: OrderedDict[int, int] = OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self._blocks

    def match(self, hashes: Sequence[int], start: int, end: int) -> int:
        """See :meth:`SharedTier.match` (touches the blocks found)."""
        blocks = self._blocks
        n = start
        while n < end and hashes[n] in blocks:
            blocks.move_to_end(hashes[n])
            n += 1
        return n - start

    def put(self, hashes: Sequence[int], published: Sequence[int]) -> tuple[list[int], list[int]]:
        """See :meth:`SharedTier.put`."""
        blocks = self._blocks
        stored = []
        for i, h in enumerate(hashes):
            if h in blocks:
                blocks.move_to_end(h)
            else:
                blocks[h] = published[i]
                stored.append(i)
        evicted = []
        while len(blocks) > self.num_blocks:
            _, p = blocks.popitem(last=False)
            evicted.append(p)
        return stored, evicted
