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
   view forgets roughly when the engine does). A block counts as used as recently as
   anything after it in a chain (recency is stamped on the deepest block a request
   reaches: learning a follow-up to a held prompt costs one touch, not one per block),
   so eviction removes the tails first (as vLLM frees blocks in reverse): the
   remembered blocks of a chain always form a prefix. A fleet-wide index maps each block hash to the bitmask of
   instances holding it, so one binary search over the request's chain finds the
   instances with the longest match at once (a few xxh3 passes, whatever the number of
   instances); the others' matches are searched only as far as the rules below need
   (usually not at all: one probe tells whether any of them comes within
   ``LoadWeight`` blocks).
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

Decision kinds: ``affinity`` (a home, or the first choice of a placement, also when it
lands beside a match no more than ``LoadWeight`` longer than the others: rule 4 sets
that match aside whatever the load), ``overflow`` (a longer match existed but its
instance was at the threshold or too loaded, or the placement's first choice was at the
threshold), ``all_busy``, ``fallback`` (no blocks: an empty prompt).
"""

from __future__ import annotations

import random
from bisect import bisect_left, bisect_right
from heapq import heapify, heappop, heappush
from itertools import islice, repeat
from typing import Callable, Sequence

from prefixroute.core.config import RoutingConfig, RoutingStrategy
from prefixroute.core.hashing import rendezvous_best, rendezvous_order
from prefixroute.core.keys import BlockChain
from prefixroute.core.strategies import DecisionKind, InstanceState, Strategy, least_outstanding, register


def _first(n: int, x: float, key: Callable[[int], float]) -> int:
    """The first block index ``k < n`` with ``key(k) >= x`` (``n`` if none), ``key``
    non-decreasing: a bisection, no block read. Callers pass ``n = _Levels.bound``, and
    the answer is most often ``n`` (the other holders match far less): checked first."""
    if not n or key(n - 1) < x:
        return n
    return bisect_left(range(n - 1), x, key=key)


def _first_over(n: int, x: float, key: Callable[[int], float]) -> int:
    """The first block index ``k < n`` with ``key(k) > x`` (``n`` if none), ``key``
    non-decreasing (as :func:`_first`)."""
    if not n or key(n - 1) <= x:
        return n
    return bisect_right(range(n - 1), x, key=key)


class _Levels:
    """The candidates holding a request's first block, grouped into levels by how many
    blocks of its chain they hold, longest first, found lazily over the fleet-wide index.

    Relies on each instance's remembered blocks of a chain forming a prefix of it (see the
    module docstring), so "some of these instances hold block ``k``" is true up to some
    ``k`` and false after: binary searches find where.

    Attributes:
        masks, depths: the levels found so far: the bitmask of the candidates of each
            level and their match in blocks (decreasing).
        remaining: bitmask of the holders in no level yet (they match less than the last).
        bound: no remaining holder holds block ``bound`` or any later one.
    """

    __slots__ = ("_get", "_index", "masks", "depths", "remaining", "bound")

    def __init__(self, get: Callable[[int], int], index: dict[int, int], held: int, n: int) -> None:
        self._get = get
        self._index = index
        self.masks: list[int] = []
        self.depths: list[int] = []
        self.remaining = held
        self.bound = n

    def pull(self) -> bool:
        """Find the next level (``False`` when no holder remains).

        The search gallops down from ``bound`` (1, 2, 4... blocks back), then bisects: a
        follow-up request (a new question about a held document, the next turn of a
        conversation) matches all but its last block or two and is found by reading
        blocks ``bound - 1`` and ``bound - 2``, which a :class:`BlockChain` hashes in one
        xxh3 pass over the prefix."""
        remaining = self.remaining
        if not remaining:
            return False
        index, get, top = self._index, self._get, self.bound
        lo, miss, step = 0, top, 1  # get(lo) is held by someone in `remaining`; get(miss) is not
        while top - step > lo:
            probe = top - step
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
        self.masks.append(holders)
        self.depths.append(lo + 1)
        self.remaining = remaining & ~holders
        self.bound = lo
        return True

    def any_holds(self, k: int) -> bool:
        """Whether a remaining holder holds block ``k`` (one read unless ``k >= bound``)."""
        remaining = self.remaining
        if not remaining or k >= self.bound:
            return False
        if self._index.get(self._get(k), 0) & remaining:
            return True
        self.bound = k
        return False

    def all_hold(self, k: int) -> bool:
        """Whether every remaining holder holds block ``k`` (true when none remains)."""
        remaining = self.remaining
        if not remaining or k <= 0:
            return True
        if k >= self.bound:
            return False
        return self._index.get(self._get(k), 0) & remaining == remaining

    def depth_of(self, bit: int) -> int:
        """Match in blocks of the instance with index bit ``bit`` (0 if it holds nothing),
        finding further levels as needed."""
        for m, d in zip(self.masks, self.depths):
            if bit & m:
                return d
        while bit & self.remaining:
            self.pull()
            if bit & self.masks[-1]:
                return self.depths[-1]
        return 0


__all__ = ["ApproxPrefixCache", "CacheAwareStrategy", "BYTES_PER_BLOCK_ENTRY", "TIE_REQUESTS"]

#: Scores within this many requests' worth of load (x LoadWeight) of the best count as
#: tied. Router replicas that each count only their own requests see loads that differ
#: by a request or two; treating those as ties keeps their choices identical.
TIE_REQUESTS = 2.0

#: Approximate memory of one remembered block: its dict entry and node (a tuple: size,
#: parent, children, stamp), the int hash and size, its share of the leaves' heap, and
#: of the fleet-wide index (a dict slot and a bitmask), measured with tracemalloc: 208 B
#: by ``bench/cache_memory.py`` on views filled to their default budget (51.0 MiB for
#: 245,577 blocks, CPython 3.11), 173 B by the memory test's smaller views.
BYTES_PER_BLOCK_ENTRY = 195


class ApproxPrefixCache:
    """The router's view of one instance's prefix cache: the blocks routed to it, least
    recently used forgotten first, bounded by the routing-text units (characters) they
    cover.

    The blocks form a tree (a block's parent is the block before it in its chain), and
    recency is kept per block touched last, not per block: routing a chain stamps only
    its deepest remembered block (and creates the ones it adds), and a block counts as
    used as recently as anything below it. Eviction removes the least recently used
    *leaf*, so the tails of chains go first and what stays of a chain is always a prefix
    of it (as vLLM frees a sequence's blocks in reverse), exactly as touching every block
    of the chain deepest-first in one LRU list would, at a cost that does not grow with
    the chain: a follow-up request to a held 64 KB prompt (97 blocks) touches one block
    and adds its own last one. Leaves wait in a heap by stamp (entries made stale by a
    later touch are skipped, and the heap is rebuilt when they outnumber the blocks).

    Args:
        capacity: most units remembered (>= 1); a block with no size given counts 1.
        index: optional fleet-wide index ``block hash -> bitmask of instances holding
            it``, kept up to date on every insertion and eviction.
        bit: this instance's bit in ``index``.

    Raises:
        ValueError: ``capacity`` < 1.
    """

    __slots__ = ("capacity", "used", "_nodes", "_heap", "_leaves", "_tick", "_index", "_bit")

    def __init__(self, capacity: int, index: dict[int, int] | None = None, bit: int = 0) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self.used = 0
        #: block -> (size in units, parent block or None, number of children, stamp);
        #: tuples of ints: the garbage collector stops tracking them
        self._nodes: dict[int, tuple[int, int | None, int, int]] = {}
        #: (stamp, block) of leaves, a min-heap; an entry whose stamp or leafness no
        #: longer holds is stale and skipped
        self._heap: list[tuple[int, int]] = []
        self._leaves = 0  # blocks without children (the heap is rebuilt past twice as many entries)
        self._tick = 0
        self._index = index
        self._bit = bit

    def __len__(self) -> int:
        return len(self._nodes)

    def __contains__(self, block: int) -> bool:
        return block in self._nodes

    def match(self, blocks: Sequence[int]) -> int:
        """Number of leading ``blocks`` remembered (binary search: remembered blocks of a
        chain always form a prefix, see the class docstring)."""
        nodes = self._nodes
        lo, hi = 0, len(blocks)
        if hi == 0 or blocks[0] not in nodes:
            return 0
        if blocks[hi - 1] in nodes:
            return hi
        lo = 1  # blocks[:lo] are known present, blocks[hi-1] absent
        hi -= 1
        while lo < hi:
            mid = (lo + hi) // 2
            if blocks[mid] in nodes:
                lo = mid + 1
            else:
                hi = mid
        return lo

    def _depth(self, get: Callable[[int], int], n: int) -> int:
        """:meth:`match` searching down from the end of the chain (1, 2, 4... blocks
        back, then bisecting): a follow-up request matches all but its last block or
        two, which one xxh3 pass of a :class:`BlockChain` reads together."""
        nodes = self._nodes
        if get(n - 1) in nodes:
            return n
        if get(0) not in nodes:
            return 0
        lo, miss, step = 0, n - 1, 1  # get(lo) held, get(miss) not
        while miss - step > lo:
            probe = miss - step
            if get(probe) in nodes:
                lo = probe
                break
            miss, step = probe, step * 2
        while miss - lo > 1:
            mid = (lo + miss) >> 1
            if get(mid) in nodes:
                lo = mid
            else:
                miss = mid
        return lo + 1

    def insert(self, blocks: Sequence[int], sizes: Sequence[int] | None = None) -> None:
        """Remember the chain ``blocks`` as most recently used (block ``k`` of
        ``sizes[k]`` units; default: a :class:`BlockChain`'s own sizes, else 1), then
        forget least recently used tails until the total is within capacity. When a
        chain is longer than the capacity only its head is kept."""
        n = len(blocks)
        if not n:
            return
        chain = isinstance(blocks, BlockChain)
        get = blocks.hash if chain else blocks.__getitem__
        nodes = self._nodes
        heap = self._heap
        self._tick = tick = self._tick + 1
        d = self._depth(get, n)
        if d:
            h = get(d - 1)  # the deepest block already held: the only one touched
            size, parent, children, _ = nodes[h]
            nodes[h] = (size, parent, children, tick)
            if d == n and not children:
                heappush(heap, (tick, h))
        if d < n:
            if chain:
                hashes = blocks.hashes_from(d)
                ends = blocks.ends
                shift = blocks.unit_shift
                starts = ends[d - 1: n - 1] if d else [0, *ends[: n - 1]]
                new_sizes = [(e - b) >> shift for b, e in zip(starts, ends[d:])]
            else:
                hashes = list(blocks[d:])
                new_sizes = list(sizes[d:]) if sizes is not None else [1] * (n - d)
            parent = get(d - 1) if d else None
            if nodes.keys().isdisjoint(hashes) and len(set(hashes)) == len(hashes):
                self._add(hashes, new_sizes, parent, tick)
            else:  # not a chain (a block held though one before it is not, or a block
                # repeated): block by block, a repeat only touched, as a per-block LRU
                for h, size in zip(hashes, new_sizes):
                    if h in nodes:
                        old = nodes[h]
                        nodes[h] = (old[0], old[1], old[2], tick)
                        if not old[2]:
                            heappush(heap, (tick, h))
                    else:
                        self._add([h], [size], parent, tick)
                    parent = h
        if self.used > self.capacity:
            self._evict()
        if len(heap) > 2 * self._leaves + 64:
            self._heap = [(nd[3], h) for h, nd in nodes.items() if not nd[2]]
            heapify(self._heap)

    def _add(self, hashes: list[int], sizes: list[int], parent: int | None, tick: int) -> None:
        """Remember ``hashes``, a chain of blocks none of which is held, below ``parent``
        (``None``: they start a chain), stamped ``tick``: each one the only child of the
        one before it, the last a leaf."""
        nodes = self._nodes
        count = len(hashes)
        children = [1] * count
        children[-1] = 0
        nodes.update(zip(hashes, zip(sizes, [parent, *hashes[:-1]], children, repeat(tick))))
        self.used += sum(sizes)
        self._leaves += 1
        pnode = nodes.get(parent) if parent is not None else None
        if pnode is not None:
            nodes[parent] = (pnode[0], pnode[1], pnode[2] + 1, pnode[3])  # type: ignore[index]
            if not pnode[2]:
                self._leaves -= 1
        heappush(self._heap, (tick, hashes[-1]))
        index = self._index
        if index is not None:
            bit, get = self._bit, index.get
            for h in hashes:
                index[h] = get(h, 0) | bit

    def _evict(self) -> None:
        """Forget least recently used leaves until the blocks fit the capacity; a parent
        left without children becomes a leaf as recent as its last child, and goes next
        without a trip through the heap when it is the least recent one then (a chain's
        tail is forgotten block after block)."""
        nodes, heap, index = self._nodes, self._heap, self._index
        used, cap, leaves = self.used, self.capacity, self._leaves
        while used > cap and heap:
            stamp, h = heappop(heap)
            node = nodes.get(h)
            if node is None or node[2] or node[3] != stamp:
                continue  # stale
            while True:  # forget h, a leaf as recent as `stamp`
                del nodes[h]
                used -= node[0]
                leaves -= 1
                if index is not None:
                    self._unindex(h)
                parent = node[1]
                pnode = nodes.get(parent) if parent is not None else None
                if pnode is None:
                    break
                children, recent = pnode[2] - 1, max(pnode[3], stamp)
                node = nodes[parent] = (pnode[0], pnode[1], children, recent)  # type: ignore[index]
                if children:
                    break
                leaves += 1
                if used > cap and (not heap or (recent, parent) <= heap[0]):
                    h, stamp = parent, recent  # the least recent leaf now: it goes next
                    continue
                heappush(heap, (recent, parent))
                break
        self.used, self._leaves = used, leaves

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
            for h in self._nodes:
                self._unindex(h)
        self._nodes.clear()
        self._heap.clear()
        self._leaves = 0
        self.used = 0

    def lru_order(self) -> list[int]:
        """Blocks in the order they would be forgotten, least recently used first (for
        tests and debugging; O(blocks log blocks))."""
        nodes = self._nodes
        children = {h: nd[2] for h, nd in nodes.items()}
        stamps = {h: nd[3] for h, nd in nodes.items()}
        heap = [(stamps[h], h) for h, c in children.items() if not c]
        heapify(heap)
        out = []
        while heap:
            stamp, h = heappop(heap)
            if children.get(h, -1) != 0 or stamps[h] != stamp:
                continue
            out.append(h)
            del children[h]
            p = nodes[h][1]
            if p in children:
                children[p] -= 1
                stamps[p] = max(stamps[p], stamp)
                if not children[p]:
                    heappush(heap, (stamps[p], p))
        return out


@register
class CacheAwareStrategy(Strategy):
    """``CACHE_AWARE`` (see the module docstring for the rule and its sources).

    State: one :class:`ApproxPrefixCache` per instance and a fleet-wide index from block
    hash to the bitmask of instances holding it, so one binary search over a request's
    chain finds all the instances holding its longest match at once (a few xxh3 passes
    and dict lookups, whatever the number of instances; see :class:`_Levels`).
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
        get = blocks.hash if isinstance(blocks, BlockChain) else blocks.__getitem__
        bits, cmask, by_bit = self._bits_of(candidates)
        held = self._index.get(get(0), 0) & cmask
        if not held:  # no candidate holds even the first block: a new prefix
            return self._place(get(0), candidates)
        w = self.load_weight
        if not held & (held - 1) and cmask != held:
            # One candidate holds the first block and no other does. If it holds the
            # whole chain, or all of it but the last block (the usual follow-up request:
            # a new question about a document, the next turn of a conversation), its
            # match is known from the last two blocks, which one xxh3 pass reads, and the
            # rules below give it the request when it is below the threshold and its
            # score is not a loss: found without them (the same test as the one after
            # the first level below; tested equal in tests/test_core_cache_aware.py).
            index = self._index
            depth = n if index.get(get(n - 1), 0) & held else \
                n - 1 if n > 1 and index.get(get(n - 2), 0) & held else 0
            if depth:
                inst = by_bit[held]
                top = (blocks.ends[depth - 1] >> blocks.unit_shift) / self.block_size \
                    if isinstance(blocks, BlockChain) else float(depth)
                if top > w and inst.in_flight < self.threshold and \
                        top - w * max(inst.in_flight, inst.engine_load) >= 0.0 - w * self.tie_requests:
                    return inst, DecisionKind.AFFINITY
        # Levels of candidates holding part of the chain, longest match first, with the
        # match ``unit(depth)`` in BlockSize units (a chain's later blocks are longer), so
        # LoadWeight keeps its meaning whatever the block schedule. Found lazily: each
        # rule below needs the top level and at most a probe or two about the others.
        unit: Callable[[int], float] = float
        if isinstance(blocks, BlockChain):
            ends, shift, bs = blocks.ends, blocks.unit_shift, self.block_size
            unit = lambda d: (ends[d - 1] >> shift) / bs  # noqa: E731
        levels = _Levels(get, self._index, held, n)
        levels.pull()
        top_mask, top = levels.masks[0], unit(levels.depths[0])
        if not held & (held - 1) and cmask != held and top > w:
            # One candidate holds the chain, more than LoadWeight of it (the usual
            # follow-up request: a new question about a document, the next turn of a
            # conversation): if it is below the threshold and its score is not a loss
            # (no one else holds any of it), it is the answer of the rules below, found
            # without the rest of them (tested equal in tests/test_core_cache_aware.py).
            inst = by_bit[held]
            if inst.in_flight < self.threshold and \
                    top - w * max(inst.in_flight, inst.engine_load) >= 0.0 - w * self.tie_requests:
                return inst, DecisionKind.AFFINITY
        elif levels.remaining and not top_mask & (top_mask - 1) and top > w:
            # One candidate holds the longest match, more than LoadWeight of it, and the
            # other holders less (a follow-up about a document after a system prompt
            # every instance holds). If no other holder comes within LoadWeight of it
            # (it is the only home: no placement, no band of ties) and none matches
            # more than its score plus TIE_REQUESTS requests' worth (no "rest" wins),
            # the rules below give it the request: the same two probes as they make,
            # without the rest of them (tested equal in tests/test_core_cache_aware.py).
            inst = by_bit[top_mask]
            if inst.in_flight < self.threshold:
                best = top - w * max(inst.in_flight, inst.engine_load)
                tie = w * self.tie_requests
                if not levels.any_holds(_first(levels.bound, top - w, lambda k: unit(k + 1))) and \
                        not levels.any_holds(_first_over(levels.bound, best, lambda k: unit(k + 1) - tie)):
                    return inst, DecisionKind.AFFINITY
        anchor = get(min(levels.depths[0], n - 1))  # the first block past the longest match
        # Rule 4 applies when the shortest candidate match ("common": 0 if a candidate
        # holds nothing) is within LoadWeight of the longest: ``top - common <= w``.
        if cmask & ~held:
            like_new = top <= w
        elif levels.remaining:  # do all other holders hold the first block deep enough?
            near = _first(levels.bound, -w, lambda k: -(top - unit(k + 1)))  # top - unit(k + 1) <= w
            like_new = levels.all_hold(near)
        else:  # a single level: common == top
            like_new = True
        if like_new:
            # No instance holds meaningfully more than the others (only a shared header,
            # or the same on all): placed like a new prefix, by the rendezvous order of
            # what is new in it. Independent of load views, so router replicas agree.
            return self._place(anchor, candidates)
        # Some instances hold meaningfully more ("homes": within LoadWeight of the
        # longest match). The best home (match - LoadWeight x load, ties within
        # TIE_REQUESTS requests by rendezvous) gets the request unless the instance a
        # new prefix would go to scores better by more than TIE_REQUESTS requests.
        if levels.remaining:  # further levels within w of the top: the holders of band_block
            band_block = _first(levels.bound, top - w, lambda k: unit(k + 1))
            while levels.any_holds(band_block):
                levels.pull()
        threshold = self.threshold
        tie = w * self.tie_requests
        homes: list[tuple[float, InstanceState]] = []
        for m, d in zip(levels.masks, levels.depths):
            u = unit(d)
            while m:
                low = m & -m
                m ^= low
                inst = by_bit[low]
                if inst.in_flight < threshold:
                    homes.append((u - w * max(inst.in_flight, inst.engine_load), inst))
        if homes:
            best = max(sc for sc, _ in homes)
            # The alternative (not a home) matches at most the longest match outside
            # the homes ("rest", 0 if none): when the best home beats even that with no
            # load (best >= rest - tie), skip the rendezvous pass over every candidate.
            if levels.remaining:  # does a holder outside the homes hold a block deep enough?
                over = _first_over(levels.bound, best, lambda k: unit(k + 1) - tie)  # unit(k + 1) - tie > best
                rest_wins = levels.any_holds(over)
            else:
                rest_wins = best < 0.0 - tie
            if not rest_wins:
                band = [inst for sc, inst in homes if sc >= best - tie]
                home = band[0] if len(band) == 1 else band[self.rendezvous(anchor, band)]
                return home, DecisionKind.AFFINITY
        alt, alt_kind = self._place(anchor, candidates)
        alt_depth = levels.depth_of(bits[candidates.index(alt)])
        alt_match = unit(alt_depth) if alt_depth else 0.0
        alt_score = alt_match - w * max(alt.in_flight, alt.engine_load)
        if homes:
            if best >= alt_score - tie:
                band = [inst for sc, inst in homes if sc >= best - tie]
                home = band[0] if len(band) == 1 else band[self.rendezvous(anchor, band)]
                return home, DecisionKind.AFFINITY
        if alt_kind is DecisionKind.ALL_BUSY:  # every candidate at the threshold (rule 3)
            return alt, alt_kind
        return alt, (DecisionKind.OVERFLOW if alt_match < top or alt_kind is DecisionKind.OVERFLOW else alt_kind)

    def _place(self, anchor: int, candidates: Sequence[InstanceState]) -> tuple[InstanceState, DecisionKind]:
        """Rendezvous placement: the first candidate below the threshold in ``anchor``'s
        rendezvous order (``affinity`` if that is the first one, ``overflow`` if the first
        one was at the threshold); ``all_busy`` (least outstanding) when every one is at
        it. A placement that lands beside a match not meaningfully longer than the
        others (within ``LoadWeight``) is the rule's first choice, not an overflow."""
        tokens = self.tokens(candidates)
        i = rendezvous_best(anchor, tokens)
        threshold = self.threshold
        if candidates[i].in_flight < threshold:
            kind = DecisionKind.AFFINITY
        else:
            for i in islice(rendezvous_order(anchor, tokens), 1, None):
                if candidates[i].in_flight < threshold:
                    break
            else:
                return least_outstanding(candidates, self.rng), DecisionKind.ALL_BUSY
            kind = DecisionKind.OVERFLOW
        return candidates[i], kind

    def on_routed(self, instance: InstanceState, blocks: Sequence[int]) -> None:
        # Every member has its view (on_membership_change); an instance removed between
        # the decision and the learning (the driver learns on the next loop turn) has
        # none, and gets none back: nothing to learn.
        cache = self.caches.get(instance.instance_id)
        if blocks and cache is not None:
            if isinstance(blocks, BlockChain):
                cache.insert(blocks)
            else:
                cache.insert(blocks, [self.block_size] * len(blocks))

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

    def on_cache_lost(self, instance: InstanceState) -> None:
        # The engine starts empty: its view is emptied (and its bit leaves the index),
        # so its chains count as held nowhere until requests are routed to it again.
        cache = self.caches.get(instance.instance_id)
        if cache is not None:
            cache.clear()

    def stats(self) -> dict[str, float]:
        blocks = sum(len(c) for c in self.caches.values())
        return {
            "approx_cache_blocks": float(blocks),
            "approx_cache_bytes": float(blocks * BYTES_PER_BLOCK_ENTRY),
            "approx_cache_capacity_blocks": float(self.capacity_blocks * max(1, len(self.caches))),
        }
