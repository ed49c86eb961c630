"""The router's approximate view of one instance's prefix cache, bounded in memory.

:class:`ApproxPrefixCache` remembers the chained blocks
(:class:`prefixroute.core.block_chain.BlockChain`) of the requests routed to one
instance, least recently used forgotten first, as the engine's own prefix cache forgets
them. :class:`ViewBudget` puts one ceiling on the memory of every view of a router
process, whatever the number of variants and instances.

Memory: every remembered block costs about :data:`BYTES_PER_BLOCK_ENTRY` bytes (its dict
entry and node tuple, its hash and size, its share of the leaves' heap and of the
fleet-wide index, and of the set of tails), measured with tracemalloc by
``bench/cache_memory.py``. A view holds at most ``max_blocks`` blocks, so at most
``max_blocks x BYTES_PER_BLOCK_ENTRY`` bytes.
"""

from __future__ import annotations

import weakref
from heapq import heapify, heappop, heappush
from itertools import repeat
from typing import Callable, Sequence

from prefixroute.core.block_chain import BlockChain

__all__ = ["ApproxPrefixCache", "ViewBudget", "BYTES_PER_BLOCK_ENTRY", "DEFAULT_ROUTER_VIEW_BYTES"]

#: Approximate memory of one remembered block: its dict entry and node (a tuple: size,
#: parent, children, stamp), the int hash and size, its share of the leaves' heap (stale
#: entries included), of the fleet-wide index (a dict slot and a bitmask) and of the
#: tails. Measured with tracemalloc (CPython 3.11) between 175 and 250 B depending on the
#: traffic: 225 B by ``bench/cache_memory.py`` on views filled to their budget, 175-250 B
#: by tests/test_core_cache_aware.py's documents; 210 is within 20 % of both ends.
BYTES_PER_BLOCK_ENTRY = 210

#: Default ceiling on the memory of all approximate views of one router process
#: (``prefixroute serve --cache-aware-memory-mib``): 512 MiB, about 2.5 million blocks.
DEFAULT_ROUTER_VIEW_BYTES = 512 * 1024 * 1024


class ViewBudget:
    """One ceiling on the memory of many :class:`ApproxPrefixCache` views: each view may
    hold at most its own ``max_blocks`` and at most an equal share of the ceiling
    (``max_bytes / BYTES_PER_BLOCK_ENTRY / views``), recomputed whenever a view joins
    or leaves. A router whose fleet grows keeps its memory bounded; its views then
    remember less each (the oldest blocks first).

    Args:
        max_bytes: the ceiling, bytes (at least one block's worth).

    Raises:
        ValueError: ``max_bytes`` below :data:`BYTES_PER_BLOCK_ENTRY`.
    """

    def __init__(self, max_bytes: int = DEFAULT_ROUTER_VIEW_BYTES) -> None:
        if max_bytes < BYTES_PER_BLOCK_ENTRY:
            raise ValueError(f"the memory ceiling must be at least {BYTES_PER_BLOCK_ENTRY} bytes, got {max_bytes}")
        self.max_bytes = max_bytes
        self.max_blocks = max_bytes // BYTES_PER_BLOCK_ENTRY
        self._views: "weakref.WeakSet[ApproxPrefixCache]" = weakref.WeakSet()

    def __len__(self) -> int:
        return len(self._views)

    def add(self, view: "ApproxPrefixCache") -> None:
        """Put ``view`` under this ceiling (and share it again among all views)."""
        self._views.add(view)
        self.rebalance()

    def discard(self, view: "ApproxPrefixCache") -> None:
        """Take ``view`` from under this ceiling (its own limit applies again)."""
        self._views.discard(view)
        view.set_block_limit(view.own_max_blocks)
        self.rebalance()

    def rebalance(self) -> None:
        """Give every view ``min(its own limit, an equal share of the ceiling)``."""
        views = list(self._views)
        if not views:
            return
        share = max(1, self.max_blocks // len(views))
        for v in views:
            v.set_block_limit(min(v.own_max_blocks, share))

    def blocks(self) -> int:
        """Blocks remembered by every view under this ceiling."""
        return sum(len(v) for v in self._views)


class ApproxPrefixCache:
    """The router's view of one instance's prefix cache: the blocks routed to it, least
    recently used forgotten first, bounded by the routing-text units (characters) they
    cover and by a number of blocks (memory: :data:`BYTES_PER_BLOCK_ENTRY` each).

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

    Where every chain routed here ended is remembered too, as a *tail* (while its last
    full block is): that block, and the size and hash of the partial block after it. A
    later request that holds that partial block's text too continues that request (the
    next turn of a conversation, the next step of an agent), however little of it was
    in full blocks (:meth:`continuation`).

    Args:
        capacity: most units remembered (>= 1); a block with no size given counts 1.
        index: optional fleet-wide index ``block hash -> bitmask of instances holding
            it``, kept up to date on every insertion and eviction.
        bit: this instance's bit in ``index``.
        max_blocks: most blocks remembered, whatever units they cover (>= 1; default:
            ``capacity``, i.e. no limit beyond the units). Short prompts cut into short
            blocks: without this bound a view of tiny prompts would hold many times the
            memory its units suggest.

    Raises:
        ValueError: ``capacity`` or ``max_blocks`` < 1.
    """

    __slots__ = ("capacity", "used", "_nodes", "_heap", "_leaves", "_tick", "_index", "_bit", "own_max_blocks",
                 "max_blocks", "_tails", "__weakref__")

    def __init__(self, capacity: int, index: dict[int, int] | None = None, bit: int = 0,
                 max_blocks: int | None = None) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        if max_blocks is not None and max_blocks < 1:
            raise ValueError(f"max_blocks must be >= 1, got {max_blocks}")
        self.capacity = capacity
        #: the block limit asked for; :attr:`max_blocks` is it, or less under a
        #: :class:`ViewBudget` shared by many views
        self.own_max_blocks = capacity if max_blocks is None else max_blocks
        self.max_blocks = self.own_max_blocks
        #: last full block of a chain routed here -> (units after it, hash of the
        #: partial block they form; 0, 0 when the chain ended on the full block)
        self._tails: dict[int, tuple[int, int]] = {}
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

    def tail(self, block: int) -> tuple[int, int] | None:
        """If ``block`` is the last full block of a chain routed here (and still
        remembered): ``(units after it, hash of the partial block they formed)``, ``(0,
        0)`` when the chain ended on it; else ``None``."""
        return self._tails.get(block)

    def continued_rest(self, blocks: BlockChain, d: int) -> int | None:
        """If the chain ``blocks``, whose first ``d`` blocks this view holds (``d >= 1``),
        continues a chain routed here (that chain's full blocks ended at block ``d - 1``
        and the partial block it ended with is this text's prefix there: a
        conversation's next turn, an agent's next step): the units that partial block
        adds past block ``d - 1`` (0 when it ended on a block's end); else ``None``.
        Costs one dictionary read, and one hash of the text up to that partial block's
        end when a chain ended there with one."""
        t = self._tails.get(blocks.hash(d - 1))
        if t is None:
            return None
        rest, h = t
        if rest:
            shift = blocks.unit_shift
            end = (blocks.ends[d - 1] >> shift) + rest
            if end > blocks.ends[-1] >> shift or blocks.prefix_hash(end, d) != h:
                return None
        return rest

    def mark_tail(self, block: int, rest_units: int = 0, rest_hash: int = 0) -> None:
        """Remember that a chain routed here ended ``rest_units`` units (a partial block
        of hash ``rest_hash``) after the held block ``block``, its last full one."""
        if block in self._nodes:
            self._tails[block] = (rest_units, rest_hash)

    def set_block_limit(self, max_blocks: int) -> None:
        """Lower or raise :attr:`max_blocks` (at least 1); blocks over a lowered limit
        are forgotten at once, least recently used first."""
        self.max_blocks = max(1, max_blocks)
        if len(self._nodes) > self.max_blocks:
            self._evict()
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

    def insert(self, blocks: Sequence[int], sizes: Sequence[int] | None = None) -> int:
        """Remember the chain ``blocks`` as most recently used (block ``k`` of
        ``sizes[k]`` units; default: a :class:`BlockChain`'s own sizes, else 1), then
        forget least recently used tails until the total is within capacity. When a
        chain is longer than the capacity only its head is kept.

        Returns:
            how many leading blocks of the chain were remembered before (its match).
        """
        n = len(blocks)
        if not n:
            return 0
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
        if self.used > self.capacity or len(nodes) > self.max_blocks:
            self._evict()
        if len(heap) > 2 * self._leaves + 64:
            self._heap = [(nd[3], h) for h, nd in nodes.items() if not nd[2]]
            heapify(self._heap)
        return d

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
        nodes, heap, index, tails = self._nodes, self._heap, self._index, self._tails
        used, cap, leaves, most = self.used, self.capacity, self._leaves, self.max_blocks
        while (used > cap or len(nodes) > most) and heap:
            stamp, h = heappop(heap)
            node = nodes.get(h)
            if node is None or node[2] or node[3] != stamp:
                continue  # stale
            while True:  # forget h, a leaf as recent as `stamp`
                del nodes[h]
                tails.pop(h, None)
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
                if (used > cap or len(nodes) > most) and (not heap or (recent, parent) <= heap[0]):
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
        self._tails.clear()
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
