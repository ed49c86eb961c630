"""The level search of ``CACHE_AWARE``'s learned view: which candidates hold how much of a
request's block chain, found in a few probes of the fleet-wide index (block hash ->
bitmask of the instances holding it) instead of one match per instance.

Sans-I/O, pure functions of the index and the chain. Used by
:class:`prefixroute.core.cache_aware.CacheAwareStrategy`.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from typing import Callable

__all__ = ["Levels", "first", "first_over"]


def first(n: int, x: float, key: Callable[[int], float]) -> int:
    """The first block index ``k < n`` with ``key(k) >= x`` (``n`` if none), ``key``
    non-decreasing: a bisection, no block read. Callers pass ``n = Levels.bound``, and
    the answer is most often ``n`` (the other holders match far less): checked first."""
    if not n or key(n - 1) < x:
        return n
    return bisect_left(range(n - 1), x, key=key)


def first_over(n: int, x: float, key: Callable[[int], float]) -> int:
    """The first block index ``k < n`` with ``key(k) > x`` (``n`` if none), ``key``
    non-decreasing (as :func:`first`)."""
    if not n or key(n - 1) <= x:
        return n
    return bisect_right(range(n - 1), x, key=key)


class Levels:
    """The candidates holding a request's first block, grouped into levels by how many
    blocks of its chain they hold, longest first, found lazily over the fleet-wide index.

    Relies on each instance's remembered blocks of a chain forming a prefix of it (see
    :class:`prefixroute.core.approx_cache.ApproxPrefixCache`), so "some of these instances hold block ``k``" is true up to some
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
