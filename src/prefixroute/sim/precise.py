"""Precise state in the simulator: each engine's cache changes applied straight to the
router's :class:`~prefixroute.core.kvevents.view.PreciseCacheView`.

In the HTTP router, engines publish KV events over ZeroMQ and the router rebuilds its
keys from their token ids (:mod:`prefixroute.core.kvevents`). The simulator's prompts have
no token ids (:class:`~prefixroute.engine.core.HashedPrompt`): their block hashes are
already a function of their content only, the same for every engine and every router
replica, which is what the router's keys are. So the simulator skips the wire: a
:class:`DirectObserver` is the engine's ``events`` hook and applies every store and
eviction, per medium, to the instance's index keyed by those hashes; a policy then asks
the view exactly as it does in the router, with the request's block hashes as its keys.
What the wire adds (encoding, gaps, replays) is tested on its own.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from prefixroute.core.kvevents.index import CPU_UNIT, GPU_UNIT, InstanceIndex

__all__ = ["DirectObserver"]


class DirectObserver:
    """An :class:`~prefixroute.engine.core.EngineCore` ``events`` hook that keeps an
    :class:`~prefixroute.core.kvevents.index.InstanceIndex` (and its shared index) equal to
    the engine's caches, keyed by the cache's own block hashes."""

    #: The core needs no token ids for this hook.
    wants_tokens = False

    def __init__(self, index: InstanceIndex) -> None:
        self.index = index

    @staticmethod
    def engine_hash(internal: int) -> int:
        """The hash a block is "published" under: its own."""
        return internal

    def stored(self, hashes: Sequence[int], start: int, end: int, token_ids: object, medium: str = "GPU",
               lora_name: str | None = None) -> None:
        """Blocks ``hashes[start:end]`` entered the GPU or the CPU tier."""
        unit = GPU_UNIT if medium == "GPU" else CPU_UNIT
        held = self.index.held
        for i in range(start, end):
            h = hashes[i]
            held[h] = held.get(h, 0) + unit
        self.index.counters.blocks_stored += end - start

    def stored_shared(self, hashes: Sequence[int], medium: str) -> list[int]:
        """Blocks entered the shared tier."""
        for h in hashes:
            self.index.shared.add(h, h)
        self.index.counters.blocks_stored += len(hashes)
        return list(hashes)

    def removed(self, hashes: Iterable[int], medium: str = "GPU") -> None:
        """Blocks left the GPU or the CPU tier."""
        unit = GPU_UNIT if medium == "GPU" else CPU_UNIT
        held = self.index.held
        for h in hashes:
            n = held.get(h, 0) - unit
            if n > 0:
                held[h] = n
            else:
                held.pop(h, None)
            self.index.counters.blocks_removed += 1

    def removed_published(self, published: Sequence[int], medium: str) -> None:
        """Blocks left the shared tier."""
        for h in published:
            self.index.shared.remove(h)
        self.index.counters.blocks_removed += len(published)

    def cleared(self) -> None:
        """The engine dropped its caches."""
        self.index.clear()
