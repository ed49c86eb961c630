"""``CACHE_AWARE``: route on a learned view of every instance's prefix cache, bounded, load-aware.

Why: ``PREFIX_AWARE`` hashes one fixed-length prefix. Many conversations that share a
long system prompt then hash to one instance (a hot spot), and a conversation that
grows past PrefixLength gains nothing from its longer shared history. The cache-aware
routers of the field fix that with a per-instance prefix tree but ignore load or gate it
by coarse thresholds, grow without bound, send every miss to the same instance, and
disagree when several router replicas run (SPEC §5). This strategy:

1. **Chained blocks.** The routing text is cut into blocks whose hashes chain
   (:class:`prefixroute.core.keys.BlockChain`), up to ``MaxPrefixLength``: a block
   matches only if everything before it matches too. Blocks are ``BlockSize`` units for
   the first 16 and then double every 16 blocks (64 KB of text is 97 blocks), so a long
   prompt costs a few dozen hashes and index entries, and a match is still known to
   within 1/8 of its length.
2. **Bounded approximate cache per instance.** :class:`ApproxPrefixCache` remembers the
   blocks routed to each instance, an LRU bounded by the text they cover
   (``InstanceCacheTokens`` x 4 characters, set near the engine's KV capacity, so the
   view forgets roughly when the engine does). Blocks are touched deepest-first, so a
   prefix's parents are always more recent than its children and eviction removes the
   tails first (as vLLM frees blocks in reverse): the remembered blocks of a chain
   always form a prefix. A fleet-wide index maps each block hash to the bitmask of
   instances holding it, so one binary search over the request's chain finds every
   instance's match at once (a few xxh3 passes, whatever the number of instances).
3. **Threshold first.** An instance at or over ``ConcurrencyThreshold`` in flight never
   gets a request while another is below it; when all are at it, the least outstanding
   one does (``all_busy``).
4. **Placement by rendezvous.** A prefix no candidate holds meaningfully more of than
   the others (the longest and the shortest match within ``LoadWeight`` blocks: a new
   prefix, or only a shared header) is placed on the first instance below the threshold
   in the rendezvous order of its first block past the longest match: new prefixes
   spread over the fleet (never "the same instance on every miss"), and independent
   router replicas place them identically whatever their load views.
5. **Prefill saved against load.** Otherwise the "homes" are the instances below the
   threshold whose match is within ``LoadWeight`` blocks of the longest; each scores
   ``matched_blocks - LoadWeight x load``, load being the larger of the router's own
   in-flight count and what the engine reports running plus waiting (so replicas see
   each other's load when engine metrics are scraped). The cost model follows NVIDIA
   Dynamo's "prefill blocks not cached + load" idea, in blocks. The best home (homes
   within ``TIE_REQUESTS`` requests' worth of it tie, broken by rendezvous) gets the
   request unless the instance rule 4 would pick scores higher by more than
   ``TIE_REQUESTS`` requests' worth: then that one does (``overflow``). Conversations
   that share only a system prompt thus spread out once its holder is busy, and a
   hot document overflows to the same second instance on every replica.

Decision kinds: ``affinity`` (a home, or the first choice of a placement), ``overflow``
(a longer match existed but its instance was at the threshold or too loaded, or the
placement's first choice was at the threshold), ``all_busy``, ``fallback`` (no blocks:
an empty prompt).
"""

from __future__ import annotations

import random
from collections import OrderedDict
from typing import Sequence

from prefixroute.core.config import RoutingConfig, RoutingStrategy
from prefixroute.core.hashing import rendezvous_best, rendezvous_order
from prefixroute.core.keys import BlockChain
from prefixroute.core.strategies import DecisionKind, InstanceState, Strategy, least_outstanding, register


def _value_of(bit: int, levels: Sequence[tuple[int, int]], values: Sequence[float]) -> float:
    """``values[l]`` of the first level whose mask holds ``bit`` (0.0 if none)."""
    for (m, _), v in zip(levels, values):
        if bit & m:
            return v
    return 0.0


__all__ = ["ApproxPrefixCache", "CacheAwareStrategy", "BYTES_PER_BLOCK_ENTRY", "TIE_REQUESTS"]

#: Scores within this many requests' worth of load (x LoadWeight) of the best count as
#: tied. Router replicas that each count only their own requests see loads that differ
#: by a request or two; treating those as ties keeps their choices identical.
TIE_REQUESTS = 2.0

#: Approximate memory of one remembered block: its OrderedDict entry, the int hash, the
#: int size, and its share of the fleet-wide index (a dict slot and a bitmask), measured
#: with tracemalloc by ``bench/cache_memory.py`` on views filled to their default budget
#: (33.9 MiB for 244,590 blocks on CPython 3.11).
BYTES_PER_BLOCK_ENTRY = 145


class ApproxPrefixCache:
    """The router's view of one instance's prefix cache: an LRU of block hashes, bounded
    by the routing-text units (characters) its blocks cover.

    Args:
        capacity: most units remembered (>= 1); a block with no size given counts 1.
        index: optional fleet-wide index ``block hash -> bitmask of instances holding
            it``, kept up to date on every insertion and eviction.
        bit: this instance's bit in ``index``.

    Raises:
        ValueError: ``capacity`` < 1.
    """

    __slots__ = ("capacity", "used", "_lru", "_index", "_bit")

    def __init__(self, capacity: int, index: dict[int, int] | None = None, bit: int = 0) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self.used = 0
        self._lru: OrderedDict[int, int] = OrderedDict()
        self._index = index
        self._bit = bit

    def __len__(self) -> int:
        return len(self._lru)

    def __contains__(self, block: int) -> bool:
        return block in self._lru

    def match(self, blocks: Sequence[int]) -> int:
        """Number of leading ``blocks`` remembered (binary search: remembered blocks of a
        chain always form a prefix, see the module docstring)."""
        lru = self._lru
        lo, hi = 0, len(blocks)
        if hi == 0 or blocks[0] not in lru:
            return 0
        if blocks[hi - 1] in lru:
            return hi
        lo = 1  # blocks[:lo] are known present, blocks[hi-1] absent
        hi -= 1
        while lo < hi:
            mid = (lo + hi) // 2
            if blocks[mid] in lru:
                lo = mid + 1
            else:
                hi = mid
        return lo

    def insert(self, blocks: Sequence[int], sizes: Sequence[int] | None = None) -> None:
        """Remember ``blocks`` (each of ``sizes[k]`` units, default 1) as most recent,
        deepest first, then evict least recently used blocks until the total is within
        capacity. When a chain is longer than the capacity only its head is kept."""
        lru = self._lru
        move = lru.move_to_end
        index, bit = self._index, self._bit
        used = self.used
        hashes = blocks.hashes() if isinstance(blocks, BlockChain) else blocks
        k = len(hashes)
        while k:
            k -= 1
            h = hashes[k]
            if h in lru:
                move(h)
            else:
                size = sizes[k] if sizes is not None else 1
                lru[h] = size
                used += size
                if index is not None:
                    index[h] = index.get(h, 0) | bit
        pop = lru.popitem
        while used > self.capacity:
            h, size = pop(last=False)
            used -= size
            if index is not None:
                self._unindex(h)
        self.used = used

    def _unindex(self, h: int) -> None:
        index = self._index
        assert index is not None
        rest = index.get(h, 0) & ~self._bit
        if rest:
            index[h] = rest
        else:
            index.pop(h, None)

    def clear(self) -> None:
        """Forget everything (and drop this instance from the index)."""
        if self._index is not None:
            for h in self._lru:
                self._unindex(h)
        self._lru.clear()
        self.used = 0

    def lru_order(self) -> list[int]:
        """Blocks from least to most recently used (for tests and debugging)."""
        return list(self._lru)


@register
class CacheAwareStrategy(Strategy):
    """``CACHE_AWARE`` (see the module docstring for the rule and its sources).

    State: one :class:`ApproxPrefixCache` per instance and a fleet-wide index from block
    hash to the bitmask of instances holding it, so one binary search over a request's
    chain finds every instance's match at once (a few xxh3 passes and dict lookups,
    whatever the number of instances).
    """

    name = RoutingStrategy.CACHE_AWARE

    def __init__(self, config: RoutingConfig, rng: random.Random) -> None:
        super().__init__(config, rng)
        ca = config.cache_aware
        assert ca is not None  # guaranteed by RoutingConfig validation
        self.threshold = ca.concurrency_threshold
        self.load_weight = ca.load_weight
        self.tie_requests = TIE_REQUESTS
        self.block_size = ca.block_size
        #: Units (characters) each instance's view may cover: InstanceCacheTokens x 4.
        self.capacity_units = ca.instance_cache_tokens * 4
        #: Most blocks one view can hold (all of the smallest size).
        self.capacity_blocks = max(1, self.capacity_units // ca.block_size)
        self.caches: dict[str, ApproxPrefixCache] = {}
        self._index: dict[int, int] = {}
        self._bits: dict[str, int] = {}
        self._free: list[int] = []
        self._next_slot = 0
        self._bits_src: Sequence[InstanceState] | None = None
        self._bits_list: list[int] = []
        self._bits_mask = 0
        self._by_bit: dict[int, InstanceState] = {}

    # -- state ------------------------------------------------------------------------

    def _cache(self, inst: InstanceState) -> ApproxPrefixCache:
        cache = self.caches.get(inst.instance_id)
        if cache is None:
            if self._free:
                slot = self._free.pop()
            else:
                slot, self._next_slot = self._next_slot, self._next_slot + 1
            bit = 1 << slot
            self._bits[inst.instance_id] = bit
            cache = self.caches[inst.instance_id] = ApproxPrefixCache(self.capacity_units, self._index, bit)
        return cache

    def _levels(self, blocks: Sequence[int], held0: int) -> list[tuple[int, int]]:
        """``[(instances bitmask, matched blocks), ...]``, longest match first: every
        instance holding ``blocks[0]`` appears in exactly one level.

        The search gallops down from the end of the chain (1, 2, 4... blocks back), then
        bisects: a follow-up request (a new question about a held document, the next
        turn of a conversation) matches all but its last blocks and is found in two or
        three reads, each an xxh3 pass over the prefix."""
        index = self._index
        get = blocks.hash if isinstance(blocks, BlockChain) else blocks.__getitem__
        levels: list[tuple[int, int]] = []
        remaining, hi = held0, len(blocks)
        while remaining:
            lo = 0  # get(lo) is held by someone in `remaining`; nothing from hi on is
            miss = hi
            step = 1
            while miss - step > lo:
                probe = miss - step
                if index.get(get(probe), 0) & remaining:
                    lo = probe
                    break
                miss, step = probe, step * 2
            while miss - lo > 1:
                mid = (lo + miss) >> 1
                if index.get(get(mid), 0) & remaining:
                    lo = mid
                else:
                    miss = mid
            holders = index.get(get(lo), 0) & remaining
            levels.append((holders, lo + 1))
            remaining &= ~holders
            hi = lo
        return levels

    # -- decisions --------------------------------------------------------------------

    def _bits_of(self, insts: Sequence[InstanceState]) -> tuple[list[int], int, dict[int, InstanceState]]:
        """Each instance's bit in the index (0 for one never routed to), their union and
        the instance of each bit; cached for the pool's candidate tuple, which stays the
        same object until membership or health changes."""
        if insts is self._bits_src:
            return self._bits_list, self._bits_mask, self._by_bit
        get = self._bits.get
        out = [get(c.instance_id, 0) for c in insts]
        mask = 0
        for b in out:
            mask |= b
        by_bit = dict(zip(out, insts))
        if type(insts) is tuple and all(out):
            self._bits_src, self._bits_list, self._bits_mask, self._by_bit = insts, out, mask, by_bit
        return out, mask, by_bit

    def choose(
        self, key: int | None, candidates: Sequence[InstanceState], blocks: Sequence[int] = ()
    ) -> tuple[InstanceState, DecisionKind]:
        n = len(blocks)
        if not n:
            return least_outstanding(candidates, self.rng), DecisionKind.FALLBACK
        held0 = self._index.get(blocks[0], 0)
        bits, cmask, by_bit = self._bits_of(candidates)
        if not held0 & cmask:  # no candidate holds even the first block: a new prefix
            return self._place(blocks[0], candidates, 0.0, bits, ())
        # Levels of candidates holding part of the chain, longest match first, with the
        # match in BlockSize units (a chain's later blocks are longer), so LoadWeight
        # keeps its meaning whatever the block schedule.
        levels = [(m & cmask, d) for m, d in self._levels(blocks, held0) if m & cmask]
        if isinstance(blocks, BlockChain):
            ends, shift, bs = blocks.ends, blocks.unit_shift, self.block_size
            units = [(ends[d - 1] >> shift) / bs for _, d in levels]
        else:
            units = [float(d) for _, d in levels]
        top = units[0]
        covered = 0
        for m, _ in levels:
            covered |= m
        common = 0.0 if cmask & ~covered else units[-1]
        w = self.load_weight
        anchor = blocks[min(levels[0][1], n - 1)]  # the first block past the longest match
        if top - common <= w:
            # No instance holds meaningfully more than the others (only a shared header,
            # or the same on all): placed like a new prefix, by the rendezvous order of
            # what is new in it. Independent of load views, so router replicas agree.
            return self._place(anchor, candidates, top, bits, levels, units)
        # Some instances hold meaningfully more ("homes": within LoadWeight of the
        # longest match). The best home (match - LoadWeight x load, ties within
        # TIE_REQUESTS requests by rendezvous) gets the request unless the instance a
        # new prefix would go to scores better by more than TIE_REQUESTS requests.
        threshold = self.threshold
        tie = w * self.tie_requests
        homes: list[tuple[float, InstanceState]] = []
        for (m, _), u in zip(levels, units):
            if u < top - w:
                break
            while m:
                low = m & -m
                m ^= low
                inst = by_bit[low]
                if inst.in_flight < threshold:
                    homes.append((u - w * max(inst.in_flight, inst.engine_load), inst))
        if homes:
            best = max(sc for sc, _ in homes)
            # The alternative (not a home) matches at most the longest match outside
            # the homes: when the best home beats even that with no load, skip the
            # rendezvous pass over every candidate.
            rest = next((u for u in units if u < top - w), 0.0)
            if best >= rest - tie:
                band = [inst for sc, inst in homes if sc >= best - tie]
                home = band[0] if len(band) == 1 else band[self.rendezvous(anchor, band)]
                return home, DecisionKind.AFFINITY
        alt, alt_kind = self._place(anchor, candidates, top, bits, levels, units)
        alt_match = _value_of(bits[candidates.index(alt)], levels, units)
        alt_score = alt_match - w * max(alt.in_flight, alt.engine_load)
        if homes:
            if best >= alt_score - tie:
                band = [inst for sc, inst in homes if sc >= best - tie]
                home = band[0] if len(band) == 1 else band[self.rendezvous(anchor, band)]
                return home, DecisionKind.AFFINITY
        return alt, (DecisionKind.OVERFLOW if alt_match < top or alt_kind is DecisionKind.OVERFLOW else alt_kind)

    def _place(self, anchor: int, candidates: Sequence[InstanceState], top: float, bits: list[int],
               levels: Sequence[tuple[int, int]], units: Sequence[float] = ()) -> tuple[InstanceState, DecisionKind]:
        """Rendezvous placement: the first candidate below the threshold in ``anchor``'s
        rendezvous order (``overflow`` if that is not the first one, or holds less than
        ``top``); ``all_busy`` (least outstanding) when every one is at it."""
        tokens = self.tokens(candidates)
        i = rendezvous_best(anchor, tokens)
        threshold = self.threshold
        if candidates[i].in_flight < threshold:
            kind = DecisionKind.AFFINITY
        else:
            for i in rendezvous_order(anchor, tokens)[1:]:
                if candidates[i].in_flight < threshold:
                    break
            else:
                return least_outstanding(candidates, self.rng), DecisionKind.ALL_BUSY
            kind = DecisionKind.OVERFLOW
        if levels and _value_of(bits[i], levels, units) < top:
            kind = DecisionKind.OVERFLOW
        return candidates[i], kind

    def on_routed(self, instance: InstanceState, blocks: Sequence[int]) -> None:
        if blocks:
            if isinstance(blocks, BlockChain):
                self._cache(instance).insert(blocks, blocks.sizes())
            else:
                self._cache(instance).insert(blocks, [self.block_size] * len(blocks))

    def on_membership_change(self, instances: Sequence[InstanceState]) -> None:
        # A removed instance's view is dropped; if it comes back its cache is cold anyway.
        keep = {i.instance_id for i in instances}
        for gone in [k for k in self.caches if k not in keep]:
            self.caches.pop(gone).clear()
            bit = self._bits.pop(gone)
            self._free.append(bit.bit_length() - 1)
        for inst in instances:  # every member gets its bit now: candidate bit lists stay valid
            self._cache(inst)
        self._bits_src, self._bits_list = None, []

    def stats(self) -> dict[str, float]:
        blocks = sum(len(c) for c in self.caches.values())
        return {
            "approx_cache_blocks": float(blocks),
            "approx_cache_bytes": float(blocks * BYTES_PER_BLOCK_ENTRY),
            "approx_cache_capacity_blocks": float(self.capacity_blocks * max(1, len(self.caches))),
        }
