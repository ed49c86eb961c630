"""The KV-cache events an engine publishes, typed (vLLM's ``vllm/distributed/kv_events.py``).

An engine publishes **batches** (one per scheduler step that changed its cache), each a
timestamp, a list of events and the data-parallel rank. Three events:

* :class:`BlockStored`: full blocks became findable in the prefix cache of one medium
  (their hashes, the hash of the block before the first of them, their token ids, the
  block size, the LoRA adapter, the medium);
* :class:`BlockRemoved`: blocks left one medium (evicted);
* :class:`AllBlocksCleared`: the whole prefix cache was dropped (``reset_prefix_cache``).

Block hashes are the engine's own: 64-bit integers (vLLM's default, the low 64 bits of
its digest) or bytes. They are opaque ids: vLLM seeds them with a random ``NONE_HASH``,
so the router rebuilds its own keys from the token ids (:mod:`.chain`).

Media: ``"GPU"`` (vLLM's value; ``None`` from releases without the field means GPU too),
``"CPU"`` (blocks offloaded to host memory) and ``"SHARED"`` (prefixroute's emulated
engine: a tier every instance reads). :func:`tier_of` maps a medium to a :class:`Tier`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Sequence, Union

__all__ = [
    "EVENT_KINDS",
    "MEDIUM_GPU",
    "MEDIUM_CPU",
    "MEDIUM_SHARED",
    "Tier",
    "tier_of",
    "EngineBlockHash",
    "BlockStored",
    "BlockRemoved",
    "AllBlocksCleared",
    "KvEvent",
    "EventBatch",
]

#: vLLM's medium of GPU-resident blocks.
MEDIUM_GPU = "GPU"
#: Medium of blocks offloaded to the instance's host memory (vLLM's CPU offloading).
MEDIUM_CPU = "CPU"
#: Medium of blocks in a tier shared by every instance (the emulated engine's name).
MEDIUM_SHARED = "SHARED"

#: An engine's block hash: an unsigned 64-bit integer, or bytes.
EngineBlockHash = Union[int, bytes]


class Tier(enum.IntEnum):
    """Where a block is, cheapest to use first (the order a policy weighs them in)."""

    GPU = 0
    CPU = 1
    SHARED = 2


_TIERS = {None: Tier.GPU, MEDIUM_GPU: Tier.GPU, MEDIUM_CPU: Tier.CPU, MEDIUM_SHARED: Tier.SHARED}


def tier_of(medium: str | None) -> Tier | None:
    """The :class:`Tier` of a medium name (case-insensitive); ``None`` for an unknown one.

    ``None`` (releases that publish no medium) is the GPU.
    """
    tier = _TIERS.get(medium)
    if tier is None and isinstance(medium, str):
        tier = _TIERS.get(medium.upper())
    return tier


@dataclass(frozen=True, slots=True)
class BlockStored:
    """Full blocks became findable in one medium.

    Attributes:
        block_hashes: the engine's hashes of the blocks, in chain order (>= 1).
        parent_block_hash: the engine's hash of the block before the first, ``None``
            when the first is the first block of a sequence.
        token_ids: the blocks' token ids, ``block_size`` per block, in order.
        block_size: tokens per block.
        lora_id: deprecated LoRA adapter id (``None``: the base model).
        medium: where the blocks are (``"GPU"``, ``"CPU"``, ``"SHARED"``; ``None``: GPU).
        lora_name: LoRA adapter name (``None``: the base model); part of the block's key.
        extra_keys: per block, the extra hash inputs (multimodal hashes, LoRA name,
            cache salt) or ``None``.
        group_idx: KV-cache group (hybrid models), ``None`` for the only group.
    """

    block_hashes: Sequence[EngineBlockHash]
    parent_block_hash: EngineBlockHash | None
    token_ids: Sequence[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = MEDIUM_GPU
    lora_name: str | None = None
    extra_keys: Sequence[object] | None = None
    group_idx: int | None = None


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """Blocks left one medium.

    Attributes:
        block_hashes: the engine's hashes of the blocks removed.
        medium: the medium they left (``None``: GPU).
        group_idx: KV-cache group, ``None`` for the only group.
    """

    block_hashes: Sequence[EngineBlockHash]
    medium: str | None = MEDIUM_GPU
    group_idx: int | None = None


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """The engine dropped every cached block (of every medium it publishes)."""


KvEvent = Union[BlockStored, BlockRemoved, AllBlocksCleared]

#: Event class -> ``"stored"``, ``"removed"`` or ``"cleared"``: what
#: :meth:`~prefixroute.core.kvevents.index.InstanceIndex.apply` dispatches on. The
#: structs :mod:`~prefixroute.core.kvevents.fast_codec` decodes into (same field names)
#: are added when it is first used.
EVENT_KINDS: dict[type, str] = {BlockStored: "stored", BlockRemoved: "removed", AllBlocksCleared: "cleared"}


@dataclass(frozen=True, slots=True)
class EventBatch:
    """One published message's payload.

    Attributes:
        ts: the engine's wall-clock time of the batch, seconds since the epoch.
        events: the events, in the order they happened.
        data_parallel_rank: the publishing data-parallel rank, or ``None``.
    """

    ts: float
    events: Sequence[KvEvent]
    data_parallel_rank: int | None = None
