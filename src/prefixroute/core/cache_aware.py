"""``CACHE_AWARE``: route on a learned view of every instance's prefix cache, bounded, load-aware.

Why: ``PREFIX_AWARE`` hashes one fixed-length prefix. Many conversations that share a
long system prompt then hash to one instance (a hot spot), and a conversation that
grows past PrefixLength gains nothing from its longer shared history. The cache-aware
routers of the field fix that with a per-instance prefix tree but ignore load or gate it
by coarse thresholds, grow without bound, send every miss to the same instance, and
disagree when several router replicas run (SPEC §5). This strategy:

1. **Chained blocks.** The routing text is cut into blocks of ``BlockSize`` units whose
   hashes chain (:func:`prefixroute.core.keys.text_block_hashes`), up to
   ``MaxPrefixLength``: a block matches only if everything before it matches too.
2. **Bounded approximate cache per instance.** :class:`ApproxPrefixCache` remembers the
   blocks routed to each instance, an LRU bounded by ``InstanceCacheTokens`` (set near
   the engine's KV capacity, so the view forgets roughly when the engine does). Blocks
   are touched deepest-first, so a prefix's parents are always more recent than its
   children and eviction removes the tails first (as vLLM frees blocks in reverse): the
   set of a chain's remembered blocks is always a prefix, and a match is a binary search.
3. **Threshold first.** An instance at or over ``ConcurrencyThreshold`` in flight never
   gets a request while another is below it; when all are at it, the least outstanding
   one does (``all_busy``).
4. **Prefill saved against load.** Among the instances below the threshold, each scores
   ``matched_blocks - LoadWeight x load``, where load is the larger of the router's own
   in-flight count and what the engine reports running plus waiting (so replicas see
   each other's load when engine metrics are scraped). The cost model follows NVIDIA
   Dynamo's "prefill blocks not cached + load" idea, in blocks.
5. **Rendezvous placement and tie-breaks.** A prefix no instance below the threshold
   holds meaningfully more of than the others (within ``LoadWeight`` blocks) is
   placed on the first of them in the rendezvous order of its first block past the
   longest match:
   new prefixes spread over the fleet (never "the same instance on every miss"), and
   independent router replicas place them identically whatever their load views.
   Otherwise every instance within two requests' worth (``2 x LoadWeight``) of the
   best score is a candidate; among them the longest match wins, matches within
   ``LoadWeight`` blocks of it counting as equal, and equal ones go to the highest
   rendezvous score for the request's first block beyond the longest match —
   conversations that share only a system prompt or a short header spread out.

Decision kinds: ``affinity`` (the chosen instance has the longest match anywhere, or
nothing matched anywhere), ``overflow`` (a longer match existed but its instance was at
the threshold or too loaded), ``all_busy``, ``fallback`` (no blocks: an empty prompt).
"""

from __future__ import annotations

import random
from collections import OrderedDict
from typing import Sequence

from prefixroute.core.config import RoutingConfig, RoutingStrategy
from prefixroute.core.hashing import rendezvous_score
from prefixroute.core.strategies import DecisionKind, InstanceState, Strategy, least_outstanding, register

__all__ = ["ApproxPrefixCache", "CacheAwareStrategy", "BYTES_PER_BLOCK_ENTRY", "TIE_REQUESTS"]

#: Scores within this many requests' worth of load (x LoadWeight) of the best count as
#: tied. Router replicas that each count only their own requests see loads that differ
#: by a request or two; treating those as ties keeps their choices identical.
TIE_REQUESTS = 2.0

#: Approximate memory of one remembered block: an OrderedDict entry (~100 B on CPython
#: 3.11, measured with tracemalloc over 1e6 entries) plus the int key (32 B).
BYTES_PER_BLOCK_ENTRY = 132


class ApproxPrefixCache:
    """The router's view of one instance's prefix cache: an LRU set of block hashes.

    Args:
        capacity_blocks: most blocks remembered (>= 1).
    """

    __slots__ = ("capacity", "_lru")

    def __init__(self, capacity_blocks: int) -> None:
        if capacity_blocks < 1:
            raise ValueError(f"capacity_blocks must be >= 1, got {capacity_blocks}")
        self.capacity = capacity_blocks
        self._lru: OrderedDict[int, None] = OrderedDict()

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

    def insert(self, blocks: Sequence[int]) -> None:
        """Remember ``blocks`` as most recent, deepest first, then evict LRU blocks over
        capacity. When a chain is longer than the capacity only its head is kept."""
        lru = self._lru
        move = lru.move_to_end
        for h in reversed(blocks):
            if h in lru:
                move(h)
            else:
                lru[h] = None
        over = len(lru) - self.capacity
        pop = lru.popitem
        for _ in range(over):
            pop(last=False)

    def lru_order(self) -> list[int]:
        """Blocks from least to most recently used (for tests and debugging)."""
        return list(self._lru)


@register
class CacheAwareStrategy(Strategy):
    """``CACHE_AWARE`` (see the module docstring for the rule and its sources)."""

    name = RoutingStrategy.CACHE_AWARE

    def __init__(self, config: RoutingConfig, rng: random.Random) -> None:
        super().__init__(config, rng)
        ca = config.cache_aware
        assert ca is not None  # guaranteed by RoutingConfig validation
        self.threshold = ca.concurrency_threshold
        self.load_weight = ca.load_weight
        self.tie_requests = TIE_REQUESTS
        self.capacity_blocks = ca.instance_cache_blocks
        self.caches: dict[str, ApproxPrefixCache] = {}

    def _cache(self, inst: InstanceState) -> ApproxPrefixCache:
        cache = self.caches.get(inst.instance_id)
        if cache is None:
            cache = self.caches[inst.instance_id] = ApproxPrefixCache(self.capacity_blocks)
        return cache

    def choose(
        self, key: int | None, candidates: Sequence[InstanceState], blocks: Sequence[int] = ()
    ) -> tuple[InstanceState, DecisionKind]:
        if not blocks:
            return least_outstanding(candidates, self.rng), DecisionKind.FALLBACK
        threshold = self.threshold
        caches = self.caches
        matches = [caches[c.instance_id].match(blocks) if c.instance_id in caches else 0 for c in candidates]
        best_match = max(matches)
        eligible = [i for i, c in enumerate(candidates) if c.in_flight < threshold]
        if not eligible:
            return least_outstanding(candidates, self.rng), DecisionKind.ALL_BUSY
        w = self.load_weight
        held_anywhere = max(matches[i] for i in eligible)
        common = min(matches[i] for i in eligible)
        if held_anywhere - common <= w:
            # No instance holds meaningfully more than the others (a new prefix, or only a
            # shared header): place by rendezvous order of the first block past the longest
            # match, bounded by the threshold only. Load views differ between router
            # replicas; this choice does not depend on them, so replicas agree.
            anchor = blocks[min(held_anywhere, len(blocks) - 1)]
            chosen = max(eligible, key=lambda i: rendezvous_score(anchor, candidates[i].token))
            return candidates[chosen], (DecisionKind.OVERFLOW if matches[chosen] < best_match
                                        else DecisionKind.AFFINITY)
        scores = {i: matches[i] - w * max(candidates[i].in_flight, candidates[i].engine_load) for i in eligible}
        top = max(scores.values())
        band = [i for i in eligible if scores[i] >= top - w * self.tie_requests]
        # Within the band the longest match wins, but matches within one request's worth
        # (LoadWeight blocks) of it count as equal: a shared header of a block or two must
        # not decide. Equal ones go by rendezvous score of the first block beyond the
        # longest match, so the choice depends on what is new in this request and is the
        # same on every replica whose load view is close.
        held = max(matches[i] for i in band)
        band = [i for i in band if matches[i] >= held - w]
        anchor = blocks[min(held, len(blocks) - 1)]
        chosen = max(band, key=lambda i: rendezvous_score(anchor, candidates[i].token))
        kind = DecisionKind.OVERFLOW if matches[chosen] < best_match else DecisionKind.AFFINITY
        return candidates[chosen], kind

    def on_routed(self, instance: InstanceState, blocks: Sequence[int]) -> None:
        if blocks:
            self._cache(instance).insert(blocks)

    def on_membership_change(self, instances: Sequence[InstanceState]) -> None:
        # A removed instance's view is dropped; if it comes back its cache is cold anyway.
        keep = {i.instance_id for i in instances}
        for gone in [k for k in self.caches if k not in keep]:
            del self.caches[gone]

    def stats(self) -> dict[str, float]:
        blocks = sum(len(c) for c in self.caches.values())
        return {
            "approx_cache_blocks": float(blocks),
            "approx_cache_bytes": float(blocks * BYTES_PER_BLOCK_ENTRY),
            "approx_cache_capacity_blocks": float(self.capacity_blocks * max(1, len(self.caches))),
        }
