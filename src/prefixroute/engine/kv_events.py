"""The emulated engine's KV events: what its caches store and evict, as vLLM reports it.

Sans-I/O. :class:`KvEventRecorder` is attached to an
:class:`~prefixroute.engine.core.EngineCore` (its ``events`` argument); the core tells it
which blocks became findable and which were evicted, in which medium, and the driver
takes the events of each step as one batch (:meth:`KvEventRecorder.take`) and publishes
it (:mod:`prefixroute.engine.kv_publisher`).

**Engine block hashes are not the router's.** The cache's own chained hashes
(:mod:`prefixroute.engine.kvcache`) are a function of the tokens only, so a router could
in principle recompute them. vLLM's are not reproducible: it chains
``hash(parent or NONE_HASH, block tokens, extra keys)`` with a ``NONE_HASH`` drawn at
random at start-up (unless ``PYTHONHASHSEED`` is fixed). The emulator does the same in
effect: a published hash is ``xxh3_64(internal hash, seed=NONE_HASH)``, with
``NONE_HASH`` random per process unless ``hash_seed`` fixes it. Chained (it is a
function of the whole prefix), opaque, and different for every engine start: the router
must rebuild its own keys from the events' token ids.

What is reported, and when (as vLLM does):

* ``BlockStored`` (medium ``"GPU"``) when full blocks become findable: prompt blocks
  once prefilled, generated blocks once full. A block another sequence had already
  made findable is not reported twice (it stays anonymous, see
  :class:`~prefixroute.engine.kvcache.PrefixCache`);
* ``BlockRemoved`` (``"GPU"``) when a findable block is evicted;
* with tiers (:mod:`prefixroute.engine.tiers`): ``BlockStored``/``BlockRemoved`` with
  medium ``"CPU"`` and ``"SHARED"`` as blocks enter and leave those tiers;
* ``AllBlocksCleared`` when the prefix cache is reset.

The token ids of a block are kept (8 bytes each) while the block is in the GPU or CPU
tier, so that a later ``BlockStored`` of another medium can carry them.
"""

from __future__ import annotations

import secrets
import struct
from collections.abc import Iterable, Sequence

import xxhash

from prefixroute.core.kvevents.events import (
    MEDIUM_CPU,
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KvEvent,
)

__all__ = ["KvEventRecorder"]

_IN_GPU, _IN_CPU = 1, 2
_MEDIUM_BIT = {MEDIUM_GPU: _IN_GPU, MEDIUM_CPU: _IN_CPU}
_U64 = (1 << 64) - 1


class KvEventRecorder:
    """Collects one engine's KV events, step by step (see the module docstring).

    Args:
        block_size: tokens per block (the engine's).
        hash_seed: the ``NONE_HASH`` seeding the published hashes, 0 to 2**64 - 1;
            ``None`` draws one at random (as vLLM does without ``PYTHONHASHSEED``).
        lora_name: the LoRA adapter of blocks stored without one named (``None``: the
            base model); a request on an adapter names its own (:meth:`stored`).
    Raises:
        ValueError: ``block_size`` < 1 or ``hash_seed`` out of range.
    """

    #: The core computes token ids for :meth:`stored` only when this is true.
    wants_tokens = True

    def __init__(self, block_size: int, *, hash_seed: int | None = None, lora_name: str | None = None) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if hash_seed is not None and not 0 <= hash_seed <= _U64:
            raise ValueError(f"hash_seed must be in [0, 2**64), got {hash_seed}")
        self.block_size = block_size
        self.none_hash = secrets.randbits(64) if hash_seed is None else hash_seed
        self.lora_name = lora_name
        # internal hash -> [parent internal hash or None, packed token ids, medium bits, LoRA name]
        self._blocks: dict[int, list] = {}
        self._events: list[KvEvent] = []
        self._pack = struct.Struct(f"<{block_size}Q")

    def engine_hash(self, internal: int) -> int:
        """The published (engine) hash of a block whose cache hash is ``internal``."""
        return xxhash.xxh3_64_intdigest(internal.to_bytes(8, "little"), self.none_hash)

    @property
    def num_tracked_blocks(self) -> int:
        """Blocks whose token ids are kept (in the GPU or CPU tier)."""
        return len(self._blocks)

    # -- what the core reports ------------------------------------------------------------

    def stored(self, hashes: Sequence[int], start: int, end: int, token_ids: Sequence[int] | None,
               medium: str = MEDIUM_GPU, lora_name: str | None = None) -> None:
        """Blocks ``hashes[start:end]`` (one chain run) became findable in ``medium``.

        Args:
            hashes: the sequence's chain of internal hashes.
            start, end: the run, ``0 <= start < end <= len(hashes)``.
            token_ids: the run's token ids (``(end - start) * block_size``), or ``None``
                when every block of the run is already known (a move between tiers).
            medium: ``"GPU"`` or ``"CPU"`` (``"SHARED"`` goes through :meth:`stored_shared`).
            lora_name: the LoRA adapter of blocks new to the recorder (default: the
                recorder's ``lora_name``).
        Raises:
            ValueError: ``token_ids`` is ``None`` for a block never reported before.
        """
        bit = _MEDIUM_BIT[medium]
        bs = self.block_size
        blocks = self._blocks
        pack = self._pack
        for i in range(start, end):
            h = hashes[i]
            entry = blocks.get(h)
            if entry is None:
                if token_ids is None:
                    raise ValueError("token ids are needed for a block never reported")
                j = (i - start) * bs
                blocks[h] = [hashes[i - 1] if i else None, pack.pack(*token_ids[j:j + bs]), bit,
                             lora_name or self.lora_name]
            else:
                entry[2] |= bit
        self._events.append(self._stored_event(hashes[start:end], medium))

    def stored_shared(self, hashes: Sequence[int], medium: str) -> list[int]:
        """Blocks ``hashes`` (one chain run, all known) entered the shared tier.

        Returns the published hashes, which the shared tier keeps to report the blocks'
        removal later (:meth:`removed_published`).
        """
        self._events.append(self._stored_event(hashes, medium))
        return [self.engine_hash(h) for h in hashes]

    def _stored_event(self, run: Sequence[int], medium: str) -> BlockStored:
        blocks = self._blocks
        first = blocks[run[0]]
        parent = first[0]
        if len(run) == 1:
            tokens: Sequence[int] = self._pack.unpack(first[1])
        else:
            packed = b"".join(blocks[h][1] for h in run)
            tokens = struct.unpack(f"<{len(run) * self.block_size}Q", packed)
        lora = first[3]
        return BlockStored([self.engine_hash(h) for h in run],
                           None if parent is None else self.engine_hash(parent),
                           list(tokens), self.block_size, None, medium, lora,
                           [(lora,)] * len(run) if lora else None)

    def has_block(self, internal: int) -> bool:
        """True while the block is known (in the GPU or CPU tier)."""
        return internal in self._blocks

    def removed(self, hashes: Iterable[int], medium: str = MEDIUM_GPU) -> None:
        """Blocks left ``medium`` (``"GPU"`` or ``"CPU"``)."""
        bit = _MEDIUM_BIT[medium]
        blocks = self._blocks
        published = []
        for h in hashes:
            entry = blocks.get(h)
            if entry is not None:
                entry[2] &= ~bit
                if not entry[2]:
                    del blocks[h]
            published.append(self.engine_hash(h))
        if published:
            self._events.append(BlockRemoved(published, medium))

    def removed_published(self, published: Sequence[int], medium: str) -> None:
        """Blocks left a shared medium; ``published`` are the hashes they were stored with."""
        if published:
            self._events.append(BlockRemoved(list(published), medium))

    def cleared(self) -> None:
        """Every block was dropped (``AllBlocksCleared``)."""
        self._blocks.clear()
        self._events.append(AllBlocksCleared())

    # -- the driver ------------------------------------------------------------------------

    def take(self) -> list[KvEvent]:
        """The events since the last call, in order (the next batch); empties the log."""
        events, self._events = self._events, []
        return events
