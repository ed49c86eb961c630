"""What each instance holds, per medium, keyed by the router's own block keys.

Sans-I/O. :class:`InstanceIndex` is one instance's state, built from its events;
:class:`SharedIndex` is the shared tier's, built from every instance's events (any of
them may store a block there or see one evicted). Both are keyed by the router's chained
block keys (:mod:`.chain`), rebuilt from the events' token ids, so that a request's
keys (from its token ids) can be looked up directly.

Applying a ``BlockStored``: the parent's key is found from the parent's engine hash
(this instance's map, then the shared tier's); each block's key is its engine hash's
known key or, for a block new to the map, the chained hash of its tokens; the engine
hash -> key pair is kept (per instance for GPU and CPU blocks, in the shared index for
shared blocks) so that a ``BlockRemoved``, which carries engine hashes only, can be
applied. A block whose parent is unknown (its chain began before the router listened)
cannot be keyed: the event's blocks are skipped and counted (``orphaned``).

Copies are counted per medium (vLLM may hold two blocks with the same hash, and a
``BlockRemoved`` may fire while another copy stays), so a removal only drops a medium
when its last copy goes. Only the primary KV-cache group (``group_idx`` 0 or ``None``)
is indexed: the other groups of hybrid models hold the same tokens again.

Memory: about 200 bytes per block held per instance (two dict entries).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from prefixroute.core.kvevents.byte_index import ByteIndex
from prefixroute.core.kvevents.chain import block_keys, chain_root, pack_token_ids
from prefixroute.core.kvevents.events import (
    EVENT_KINDS,
    BlockRemoved,
    BlockStored,
    EngineBlockHash,
    KvEvent,
    Tier,
    tier_of,
)

__all__ = ["IngestCounters", "InstanceIndex", "SharedIndex", "GPU_UNIT", "CPU_UNIT"]

#: A GPU copy in :attr:`InstanceIndex.held`'s packed counts (low 24 bits).
GPU_UNIT = 1
#: A CPU copy (bits 24 and up).
CPU_UNIT = 1 << 24
_GPU_MASK = CPU_UNIT - 1


@dataclass(slots=True)
class IngestCounters:
    """What one instance's events did (cumulative; the driver exports them as metrics).

    Attributes:
        batches: batches applied.
        blocks_stored: blocks of ``BlockStored`` events applied (every medium).
        blocks_removed: blocks of ``BlockRemoved`` events applied.
        clears: ``AllBlocksCleared`` events applied.
        orphaned: blocks skipped because their parent's key was unknown.
        unknown_removals: removed blocks the index did not hold.
        ignored: events skipped on purpose: another KV-cache group, an unknown medium,
            or a block size other than the configured one.
        unknown_events: events of an unknown type.
        malformed_events: events with fields of the wrong type or size.
        malformed_messages: messages that were not a batch (or not three frames).
    """

    batches: int = 0
    blocks_stored: int = 0
    blocks_removed: int = 0
    clears: int = 0
    orphaned: int = 0
    unknown_removals: int = 0
    ignored: int = 0
    unknown_events: int = 0
    malformed_events: int = 0
    malformed_messages: int = 0


class SharedIndex:
    """The shared tier's blocks: router key -> copies, and engine hash -> router key.

    Args:
        max_blocks: most blocks remembered (the oldest forgotten first): a removal the
            router missed must not keep a block forever. >= 1.
    """

    def __init__(self, max_blocks: int = 10_000_000) -> None:
        if max_blocks < 1:
            raise ValueError(f"max_blocks must be >= 1, got {max_blocks}")
        self.max_blocks = max_blocks
        self.held: dict[int, int] = {}  # router key -> copies (insertion order = age)
        self.keys: dict[EngineBlockHash, int] = {}  # engine hash (as published) -> router key
        #: LoRA adapters named by any instance's stored blocks: a request naming one of
        #: them in ``model`` runs on that adapter (its keys are rooted in its name).
        self.lora_names: set[str] = set()
        #: The fleet's :class:`~.byte_index.ByteIndex`, or ``None``.
        self.byte_index: ByteIndex | None = None

    def __len__(self) -> int:
        return len(self.held)

    def add(self, engine_hash: EngineBlockHash, key: int) -> bool:
        """One more copy of ``key``, published as ``engine_hash``; True when it is the
        first (the caller gives the :class:`~.byte_index.ByteIndex` its holder)."""
        held = self.held
        self.keys[engine_hash] = key
        count = held.get(key, 0)
        held[key] = count + 1
        while len(held) > self.max_blocks:
            old = next(iter(held))
            del held[old]
            if self.byte_index is not None:
                self.byte_index.unref(old)
        if len(self.keys) > 2 * self.max_blocks:  # engine hashes of forgotten keys
            self.keys = {h: k for h, k in self.keys.items() if k in held}
        return not count and key in held

    def remove(self, engine_hash: EngineBlockHash) -> bool:
        """One copy fewer; False when the hash is unknown."""
        key = self.keys.pop(engine_hash, None)
        if key is None:
            return False
        n = self.held.get(key, 0) - 1
        if n > 0:
            self.held[key] = n
        elif self.held.pop(key, None) is not None and self.byte_index is not None:
            self.byte_index.unref(key)
        return True

    def clear(self) -> None:
        """Forget everything."""
        if self.byte_index is not None:
            for key in self.held:
                self.byte_index.unref(key)
        self.held.clear()
        self.keys.clear()


class InstanceIndex:
    """One instance's GPU and CPU blocks (see the module docstring).

    Args:
        block_size: the engines' block size, tokens; events with another are ignored.
        shared: the fleet's :class:`SharedIndex` (``SHARED`` events go there).

    Attributes:
        held: router key -> packed copy counts (``GPU_UNIT`` and ``CPU_UNIT`` multiples).
        keys: engine hash -> router key, for the blocks in ``held``.
        counters: the :class:`IngestCounters`.
    """

    def __init__(self, block_size: int, shared: SharedIndex) -> None:
        self.block_size = block_size
        self.shared = shared
        self.held: dict[int, int] = {}
        self.keys: dict[EngineBlockHash, int] = {}
        self.counters = IngestCounters()
        #: The fleet's :class:`~.byte_index.ByteIndex` (precise mode matching by bytes), or ``None``.
        self.byte_index: ByteIndex | None = None

    def __len__(self) -> int:
        return len(self.held)

    def clear(self) -> None:
        """Forget every block of this instance (a reset; the shared tier is kept)."""
        if self.byte_index is not None:
            unref = self.byte_index.unref
            for key in self.held:
                unref(key)
        self.held.clear()
        self.keys.clear()

    def apply(self, events: Sequence[KvEvent]) -> None:
        """Apply one batch's events, in order (:data:`~.events.EVENT_KINDS`: the event
        classes, or the structs :mod:`~.fast_codec` decodes into)."""
        kinds = EVENT_KINDS
        for e in events:
            kind = kinds.get(type(e))
            if kind == "stored":
                self._stored(e)  # type: ignore[arg-type]
            elif kind == "removed":
                self._removed(e)  # type: ignore[arg-type]
            elif kind == "cleared":
                self.clear()
                self.counters.clears += 1
        self.counters.batches += 1

    def _parent_key(self, e: BlockStored) -> int | None:
        parent = e.parent_block_hash
        if parent is None:
            return chain_root(e.lora_name)
        key = self.keys.get(parent)
        if key is None:
            key = self.shared.keys.get(parent)
        return key

    def _stored(self, e: BlockStored) -> None:
        c = self.counters
        tier = tier_of(e.medium)
        if tier is None or e.block_size != self.block_size or (e.group_idx or 0) != 0:
            c.ignored += 1
            return
        if e.lora_name and e.lora_name not in self.shared.lora_names and isinstance(e.lora_name, str):
            self.shared.lora_names.add(e.lora_name)
        parent = self._parent_key(e)
        hashes = e.block_hashes
        if parent is None:
            c.orphaned += len(hashes)
            return
        own = self.keys
        known = self.shared.keys if tier is Tier.SHARED else own
        keys: list[int] | None = None
        packed: bytes | None = None
        if not all(map(own.__contains__, hashes)) and (known is own or any(h not in own and h not in known
                                                                           for h in hashes)):
            try:
                extras = None
                if e.extra_keys is not None:
                    extras = [[k for k in x if k != e.lora_name] if x else None for x in e.extra_keys]
                packed = pack_token_ids(e.token_ids)
                keys = block_keys(packed, self.block_size, parent, len(hashes), extras)
            except (ValueError, TypeError):  # token ids out of range or not integers
                c.malformed_events += 1
                return
        bx = self.byte_index
        ids, bs = e.token_ids, self.block_size
        indexable = None  # from the first block with a media hash or a cache salt: no request's bytes say it
        if bx is not None and e.extra_keys is not None:
            indexable = next((i * bs for i, x in enumerate(e.extra_keys) if x and any(k != e.lora_name for k in x)),
                             None)
        new: list[tuple[int, int, int]] = []  # (key, parent, start) of blocks new to their holder
        if tier is Tier.SHARED:
            shared = self.shared
            for i, h in enumerate(hashes):
                key = keys[i] if keys is not None else own.get(h, known.get(h))
                if shared.add(h, key) and bx is not None:  # type: ignore[arg-type]
                    # (counted at once: a later block of this event may evict it from the tier)
                    bx.ref_blocks(ids, [(key, parent, i * bs)], indexable, packed)  # type: ignore[list-item]
                parent = key  # type: ignore[assignment]
        else:
            unit = GPU_UNIT if tier is Tier.GPU else CPU_UNIT
            held = self.held
            for i, h in enumerate(hashes):
                key = keys[i] if keys is not None else own.get(h)
                if key is None:
                    key = known[h]
                own[h] = key
                count = held.get(key, 0)
                held[key] = count + unit
                if not count and bx is not None:  # new to this instance: one more holder
                    new.append((key, parent, i * bs))
                parent = key
        if new:
            bx.ref_blocks(ids, new, indexable, packed)  # type: ignore[union-attr]
        c.blocks_stored += len(hashes)

    def _removed(self, e: BlockRemoved) -> None:
        c = self.counters
        tier = tier_of(e.medium)
        if tier is None or (e.group_idx or 0) != 0:
            c.ignored += 1
            return
        if tier is Tier.SHARED:
            for h in e.block_hashes:
                if self.shared.remove(h):
                    c.blocks_removed += 1
                else:
                    c.unknown_removals += 1
            return
        unit, mask = (GPU_UNIT, _GPU_MASK) if tier is Tier.GPU else (CPU_UNIT, ~_GPU_MASK)
        own, held = self.keys, self.held
        for h in e.block_hashes:
            key = own.get(h)
            count = held.get(key, 0) if key is not None else 0
            if not count & mask:
                c.unknown_removals += 1
                continue
            count -= unit
            if count:
                held[key] = count  # type: ignore[index]
            else:
                del held[key]  # type: ignore[arg-type]
                del own[h]
                if self.byte_index is not None:
                    self.byte_index.unref(key)  # type: ignore[arg-type]
            c.blocks_removed += 1
