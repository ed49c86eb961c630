"""``CACHE_AWARE`` on what the engines report holding (precise mode), and on KV tiers.

:class:`~prefixroute.core.cache_aware.CacheAwareStrategy` decides on its learned view of
every instance's cache. When a request carries precise-mode data (:class:`PreciseRequest`:
its KV block keys from its token ids, set by the driver on the request's
:class:`~prefixroute.core.block_chain.BlockChain` as ``blocks.precise``) or the engines have KV
tiers the router must model (``CacheAwareRoutingConfig.KvTiers``), the strategy hands the
decision to :func:`choose_precise`, which applies **the same rule** (module docstring of
:mod:`prefixroute.core.cache_aware`: homes, the cost of uncached prefill plus queue, a new
branch leaving a busy home (rule 4's spread), bounded-load rendezvous placement,
ConcurrencyThreshold first, a prefill weighed by the requests it delays)
with two changes:

1. **What an instance holds** comes, for each instance whose event stream is
   ``precise`` (:meth:`prefixroute.core.kvevents.view.PreciseCacheView.mode`), from its
   events: the leading tokens of the request it holds on the GPU, then in its CPU
   tier, then in the shared tier (:class:`~prefixroute.core.kvevents.view.PrefixHolding`).
   Every other instance falls back, on its own, to the learned view (its match there).
2. **A held token is weighed by its tier** (:class:`prefixroute.core.tiers.TierCosts`,
   from the engine's cost constants): the prefill a holding *saves* is
   ``gpu + (1 - 0.023) cpu + (1 - 0.19) shared - 57 tokens`` (the last two terms only
   with a shared-tier holding) instead of its length, so a GPU-resident block counts
   above a CPU one above a shared-tier one above a miss. In approximate mode a shared
   tier (``KvTiers.SharedTier``) is modelled: the longest prefix held by any candidate is
   loadable by every other one at the shared tier's cost, and the margin a home keeps
   its request by (``REPLICATE_FRACTION`` of the request, ``BACKLOG_REPLICATE_FRACTION`` for a
   backlogged fleet) shrinks by the shared tier's
   weight, since a copy elsewhere then costs a load, not a prefill: load spreads more
   freely.

Units. A precise decision counts in **tokens x 4** (the routing text's nominal 4
characters per token, the unit of ``InstanceCacheTokens``, ``pending_prefill`` and the
strategy's thresholds): the request's size is its prompt tokens x 4, an instance's
holding its held tokens x 4, and an approximate instance's match is scaled from
routing-text units by the same ratio. Placement anchors are the request's own KV block
keys: the key of the first engine block past the longest match (never before block
``ANCHOR_MIN_BLOCKS x BlockSize / (4 x engine block size)``: 1,024 characters), so
router replicas, which see the same events, place a prefix on the same instance.

A conversation's next turn is recognised as the learned view recognises it (the router
routed a request that this one continues; ``ApproxPrefixCache.tail``), and, for a
precise instance, only while its events show it still holds that request's blocks.

Sans-I/O: the view is asked, never waited for.
"""

from __future__ import annotations

import math
from bisect import bisect_right
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Sequence

from prefixroute.core.hashing import rendezvous_best
from prefixroute.core.block_chain import BlockChain
from prefixroute.core.kvevents.index import CPU_UNIT
from prefixroute.core.kvevents.view import PrefixHolding
from prefixroute.core.placement_rules import ANCHOR_MIN_BLOCKS, SPREAD_SLACK, STICK_FRACTION
from prefixroute.core.strategies import DecisionKind, InstanceState
from prefixroute.core.tiers import TierCosts

if TYPE_CHECKING:
    from prefixroute.core.cache_aware import CacheAwareStrategy
    from prefixroute.core.kvevents.view import PreciseCacheView

__all__ = ["UNITS_PER_TOKEN", "DEFAULT_TIER_COSTS", "PreciseRequest", "choose_precise", "decide",
           "leading_holdings", "Speculative"]

#: Routing-text units one token stands for in a precise decision (4 characters).
UNITS_PER_TOKEN = 4
#: The costs used when ``KvTiers`` is not configured (the engine's defaults).
DEFAULT_TIER_COSTS = TierCosts()


@dataclass(slots=True)
class PreciseRequest:
    """A request's precise-mode data, computed once by the driver before the decision.

    Attributes:
        view: the fleet's state from the engines' events.
        keys: the router keys of the request's full KV blocks
            (:meth:`~prefixroute.core.kvevents.view.PreciseCacheView.request_keys` of its
            token ids, or the engine's block hashes in the simulator).
        tokens: the request's prompt tokens (>= ``len(keys) x block_size``).
        block_size: the engines' KV block size, tokens (the view's).
    """

    view: "PreciseCacheView"
    keys: Sequence[int]
    tokens: int
    block_size: int


def choose_precise(strategy: "CacheAwareStrategy", candidates: Sequence[InstanceState], blocks: Sequence[int],
                   precise: PreciseRequest | None) -> tuple[InstanceState, DecisionKind] | None:
    """``CACHE_AWARE``'s decision with precise holdings and tier weights (module docstring);
    sets ``strategy.uncached_units``.

    Returns:
        ``(instance, kind)``, or ``None`` when there is nothing to add to the learned
        rule: no candidate is precise (or the request has no full KV block) and no shared
        tier is modelled. The caller then decides as before.
    """
    return decide(strategy, candidates, blocks, precise)


def decide(strategy: "CacheAwareStrategy", candidates: Sequence[InstanceState], blocks: Sequence[int],
           precise: PreciseRequest | None, force: bool = False) -> tuple[InstanceState, DecisionKind] | None:
    """:func:`choose_precise`; ``force`` decides even with nothing to add (then exactly as
    the learned rule does: tested equal in tests/test_core_precise_policy.py)."""
    ca = strategy.config.cache_aware
    tiers = ca.kv_tiers if ca is not None else None
    modelled_shared = tiers is not None and tiers.shared_tier
    costs = tiers.costs if tiers is not None else DEFAULT_TIER_COSTS
    view = precise.view if precise is not None else None
    is_precise: list[bool] | None = None
    if view is not None and precise.tokens >= precise.block_size:  # type: ignore[union-attr]
        is_precise = view.precise_flags([c.instance_id for c in candidates])
        if not any(is_precise):
            is_precise = None
    if is_precise is None and not modelled_shared and not force:
        return None
    speculative: Speculative | None = None
    if is_precise is not None:
        speculative = getattr(strategy, "precise_speculative", None)
        if speculative is None:
            speculative = strategy.precise_speculative = Speculative()  # type: ignore[attr-defined]

    n = len(blocks)
    chain = isinstance(blocks, BlockChain)
    if chain:
        ends, shift = blocks.ends, blocks.unit_shift  # type: ignore[attr-defined]
        size_chain = ends[-1] >> shift
        unit: Callable[[int], int] = lambda d: (ends[d - 1] >> shift) if d else 0  # noqa: E731
        get = blocks.hash  # type: ignore[attr-defined]
    else:
        bs_chain = strategy.block_size
        size_chain = n * bs_chain
        unit = lambda d: d * bs_chain  # noqa: E731
        get = blocks.__getitem__
    caches = strategy.caches
    k = len(candidates)
    depth: list[int | None] = [None] * k  # approximate match in chain blocks, when read

    def approx_depth(i: int) -> int:
        d = depth[i]
        if d is None:
            cache = caches.get(candidates[i].instance_id)
            d = depth[i] = cache.match(blocks) if cache is not None else 0
        return d

    size = float(size_chain)
    units = ends if chain and not shift else [e >> shift for e in ends] if chain else [unit(d) for d in range(1, n + 1)]
    amin = min(ANCHOR_MIN_BLOCKS, n - 1)

    def anchor(u: float) -> int:
        """The hash of the routing block past ``u`` units (never before block ANCHOR_MIN_BLOCKS)."""
        return get(min(max(bisect_right(units, u), amin), n - 1))

    raw: list[float] = []  # units an instance holds itself (GPU or CPU), at routing-block ends
    saved: list[float] = []  # units of prefill its holding saves (tier-weighted)
    shared_seen = False  # the events show the request's blocks in a shared tier
    if is_precise is not None:
        assert precise is not None and view is not None
        # Tokens to routing-text units by this request's own ratio, snapped down to a
        # routing block's end: a holding the learned view would record the same way
        # gives the same number, so the two modes decide alike when they agree.
        ratio = size_chain / max(precise.tokens, 1)
        tol = ratio * precise.block_size / 2

        def snapped(tokens_held: int) -> int:
            if not tokens_held:
                return 0
            d = bisect_right(units, tokens_held * ratio + tol)
            return units[d - 1] if d else 0

        held = leading_holdings(view, precise.keys, candidates)
        wc, ws = 1.0 - costs.cpu_weight, 1.0 - costs.shared_weight
        lat = costs.shared_latency_tokens * ratio
        hashes = (blocks.hashes() if chain else list(blocks)) if speculative is not None else []  # type: ignore[attr-defined]
        spec_anchor = Speculative.anchor_of(hashes, units) if len(hashes) else None
        for i, c in enumerate(candidates):
            if is_precise[i]:
                h = held[c.instance_id]
                g = snapped(h.gpu_tokens)
                own = snapped(h.gpu_tokens + h.cpu_tokens) if h.cpu_tokens else g
                every = snapped(h.total_tokens) if h.shared_tokens else own
                if speculative is not None:  # routed there, not in its events yet: about to be on its GPU
                    m = speculative.match(c, hashes, units, own, 2 * tol, spec_anchor)
                    if m > own:
                        g, own, every = g + m - own, m, max(every, m)
                raw.append(float(own))
                s = g + (own - g) * wc
                if every > own:
                    s += max(0.0, (every - own) * ws - lat)
                    shared_seen = True
                saved.append(s)
            else:
                u = float(unit(approx_depth(i)))
                raw.append(u)
                saved.append(u)
    else:
        for i in range(k):
            u = float(unit(approx_depth(i)))
            raw.append(u)
            saved.append(u)

    if modelled_shared:
        # Any instance's prefix is in the shared tier: every instance that does not hold
        # as much of it (by its events or the learned view) can load the rest from there.
        top = max(raw)
        ws = 1.0 - costs.shared_weight
        lat = costs.shared_latency_tokens * UNITS_PER_TOKEN
        if is_precise is not None:
            lat = costs.shared_latency_tokens * size_chain / max(precise.tokens, 1)  # type: ignore[union-attr]
        for i in range(k):
            if raw[i] < top and (is_precise is None or not is_precise[i]):
                saved[i] += max(0.0, (top - raw[i]) * ws - lat)
    # With a shared tier a copy elsewhere costs a load, not a prefill: homes keep their
    # requests by a smaller margin.
    replicate = strategy._replicate_fraction(candidates) * (costs.shared_weight if modelled_shared or shared_seen else 1.0)

    tokens = strategy.tokens(candidates)
    bits = strategy._bits_of(candidates)[0]
    # The learned rule's rule 7: a prefill is weighed by the requests it delays.
    uncached_cost = strategy._uncached_cost

    def cost(i: int, uncached: float) -> float:
        return uncached_cost(candidates[i], uncached)

    queue = strategy._queue
    bs = strategy.block_size
    stick = max(strategy.stick_units, STICK_FRACTION * size)
    tie = strategy.tie_units

    def continuing(i: int, events_agree: bool = True) -> float | None:
        """Units past candidate ``i``'s saving that a request routed there and continued by
        this one holds too (the partial block it ended with), or ``None`` if it does
        not continue one (for a precise instance, ``events_agree``: nor while its events
        do not show that request's blocks). The same text again (held whole) is not one:
        :meth:`~prefixroute.core.cache_aware.CacheAwareStrategy._continuing`."""
        if not chain:
            return None
        d = approx_depth(i)
        if not d or d >= n:
            return None
        rest = caches[candidates[i].instance_id].continued_rest(blocks, d)  # type: ignore[arg-type]
        if rest is None:
            return None
        u = unit(d)
        if events_agree and is_precise is not None and is_precise[i]:
            # Its events must still show the blocks of the request routed there.
            return float(rest) if raw[i] >= u else None
        return float(rest)

    def rule(threshold: float) -> tuple[int, DecisionKind, float] | None:
        # Homes by what the instances hold themselves (any tier of their own); what a
        # holding is worth (its tiers, the shared tier) enters the costs.
        r_top = max(raw)
        homes: list[int] = []
        tops: list[int] = []
        rest_raw = s_rest = -math.inf  # (a saving is negative when a tier costs more than a prefill)
        band_low = r_top - bs
        for i in range(k):  # (one pass: homes, the best of the rest, the instances at the top)
            r = raw[i]
            if r > 0 and r >= band_low:
                homes.append(i)
                if r == r_top:
                    tops.append(i)
            else:
                if r > rest_raw:
                    rest_raw = r
                if saved[i] > s_rest:
                    s_rest = saved[i]
        if len(homes) == k:  # no other candidate: 0, as for one that holds nothing
            rest_raw = s_rest = 0.0
        meaningful = bool(homes) and r_top > rest_raw and r_top - rest_raw >= stick
        extra = 0.0
        cont: dict[int, float] = {}
        if not meaningful or len(tops) > 1:
            for i in tops:
                e = continuing(i)
                if e is not None:
                    cont[i] = e
            if cont:
                extra = max(cont.values())
                homes, meaningful = [i for i, e in cont.items() if e == extra], True
        if not meaningful:
            top_anchor = anchor(r_top)
            inst = strategy._walk(top_anchor, candidates, threshold)
            if inst is None:
                return None
            i = candidates.index(inst)
            first = rendezvous_best(top_anchor, tokens)
            return i, DecisionKind.AFFINITY if i == first else DecisionKind.OVERFLOW, size - saved[i]
        limit = tie + replicate * size
        homes_cost = [(cost(i, size - saved[i] - extra) + queue(candidates[i]), i) for i in homes
                      if candidates[i].in_flight < threshold]
        def spread(home: int) -> int | None:
            # The learned rule's spread (cache_aware, rule 4): a new branch off a prefix
            # whose home has more than SPREAD_FACTOR x the mean in flight plus
            # SPREAD_SLACK goes to its own bounded-load rendezvous choice past the
            # home's holding, which prefills the prefix once and becomes a home too.
            h = candidates[home]
            home_load = max(h.in_flight, h.engine_load)
            if not chain or cont or home_load <= SPREAD_SLACK:  # (cont: it continues a routed request)
                return None
            if not strategy._busy_home(h, candidates, threshold):
                return None
            if continuing(home, events_agree=False) is not None:
                # A conversation's next turn stays, as the learned rule keeps it, even when
                # the events hold a little less of its last turn than the router sent.
                return None
            skip = 0
            for j in homes:
                skip |= bits[j]
            alt_inst = strategy._walk(anchor(raw[home]), candidates, threshold, skip)
            if alt_inst is None or max(alt_inst.in_flight, alt_inst.engine_load) >= home_load:
                return None
            return candidates.index(alt_inst)
        c_home = 0.0
        home = -1
        if homes_cost:
            low = min(c for c, _ in homes_cost)
            band = [(c, i) for c, i in homes_cost if c <= low + tie]
            if len(band) > 1:  # equal costs: a holding in a faster tier first (a GPU one over a CPU one)
                loss = min(raw[i] - saved[i] for _, i in band)
                band = [(c, i) for c, i in band if raw[i] - saved[i] <= loss + 1e-9]
            c_home, home = band[rendezvous_best(anchor(r_top), [tokens[i] for _, i in band])] if len(band) > 1 \
                else band[0]
            if c_home <= size - s_rest + limit:
                moved = spread(home)
                if moved is not None:
                    return moved, DecisionKind.OVERFLOW, size - saved[moved]
                return home, DecisionKind.AFFINITY, size - saved[home] - extra
        rest_anchor = anchor(rest_raw)
        skip = 0
        for i in homes:
            skip |= bits[i]
        alt_inst = strategy._walk(rest_anchor, candidates, threshold, skip)
        alt = candidates.index(alt_inst) if alt_inst is not None else -1
        if homes_cost and (alt < 0 or c_home <= cost(alt, size - saved[alt]) + queue(candidates[alt]) + limit):
            return home, DecisionKind.AFFINITY, size - saved[home] - extra
        if alt < 0:
            return None
        return alt, DecisionKind.OVERFLOW, size - saved[alt]

    found = rule(strategy.threshold)
    if found is None:
        if is_precise is not None and not force:
            # Every candidate is at ConcurrencyThreshold: the request will wait in an
            # engine's queue, longer than what the engines hold now says anything about
            # what they will hold when they admit it. The learned view's homes (where
            # this router sent each prefix) keep a prefix in one place through such a
            # queue; the engines' present state scatters it (measured with the
            # simulator on the near-saturation workload: 62 % hits this way, 55 % on
            # the events). So the learned rule decides (all_busy).
            return None
        found = rule(math.inf)
        assert found is not None
        found = (found[0], DecisionKind.ALL_BUSY, found[2])
    i, kind, uncached = found
    strategy.uncached_units = max(0, int(round(uncached)))
    if speculative is not None and is_precise is not None and is_precise[i]:
        speculative.routed(candidates[i].instance_id, hashes, units, spec_anchor)
    return candidates[i], kind


def _run_end(keys: Sequence[int], lo: int, hi: int, holds: Callable[[int], bool]) -> int:
    """The end of the run of ``keys[lo:hi]`` that ``holds``, found by bisection: the
    first index in ``[lo, hi]`` whose key is not held, taking held keys to form a
    prefix of the chain (checked at both ends first: the usual answers, all or none)."""
    if lo >= hi or not holds(keys[lo]):
        return lo
    if holds(keys[hi - 1]):
        return hi
    lo, hi = lo + 1, hi - 1  # keys[lo - 1] held, keys[hi] not
    while lo < hi:
        mid = (lo + hi) >> 1
        if holds(keys[mid]):
            lo = mid + 1
        else:
            hi = mid
    return lo


def leading_holdings(view: "PreciseCacheView", keys: Sequence[int], candidates: Sequence[InstanceState]
                     ) -> dict[str, "PrefixHolding"]:
    """:meth:`~prefixroute.core.kvevents.view.PreciseCacheView.holdings` of the
    candidates in a few dictionary reads each, not one per block: each run (GPU, then
    CPU, then the shared tier) is found by bisection, on the engines' own rule that a
    block is findable only while its parent is (vLLM and the emulated engine free a
    sequence's blocks last first, and a lookup walks a prompt from its first block). A
    block an engine still lists after its parent went is one it can no longer find; it
    would count here (rare: it goes first under LRU). Exact holdings:
    ``view.holdings``."""
    bs = view.block_size
    n = len(keys)
    shared = view.shared.held
    gpu_mask = CPU_UNIT - 1
    out: dict[str, PrefixHolding] = {}
    stream_of = view.stream
    first = keys[0] if n else None
    for c in candidates:
        stream = stream_of(c.instance_id)
        if stream is None:
            out[c.instance_id] = _NONE_HELD
            continue
        get = stream.index.held.get
        if first is None or (not get(first, 0) and not (shared and first in shared)):
            out[c.instance_id] = _NONE_HELD  # (the usual answer for all but a prompt's home)
            continue
        g = _run_end(keys, 0, n, lambda k: bool(get(k, 0) & gpu_mask))
        cpu = _run_end(keys, g, n, lambda k: get(k, 0) >= CPU_UNIT)
        sh = _run_end(keys, cpu, n, shared.__contains__) if shared else cpu
        out[c.instance_id] = PrefixHolding(g * bs, (cpu - g) * bs, (sh - cpu) * bs)
    return out


_NONE_HELD = PrefixHolding()


class Speculative:
    """The requests a router sent to each instance in precise mode, for the time the
    instance's events lag behind them (their prefill is queued or running): the router's
    own knowledge of what is about to be held, as the learned view has it.

    Kept by each request's routing chain (its block hashes, chained: equal at a block
    means equal text up to its end, and where each block ends in routing-text units), so
    that what is about to be held needs no KV block keys: a request matched by its bytes
    (``KvEvents.Matching: bytes``) has keys only for the blocks some engine already holds.
    An entry counts for a later request sharing at least :data:`SPECULATIVE_MIN_UNITS` of
    routing text and one block more with it (found by that block's hash: one lookup,
    whatever the number of entries) while the events do not show that prefix. Once the
    events have shown a prefix of it, they are the truth for that prefix: if they later
    show less of it (evicted), the entry is dropped. Entries also go when the instance
    has nothing in flight (every prefill is done) and beyond
    :data:`SPECULATIVE_PER_INSTANCE` per instance (:data:`SPECULATIVE_PER_ANCHOR` per
    anchor), the oldest first.
    """

    __slots__ = ("entries", "_order")

    def __init__(self) -> None:
        #: instance -> anchor hash -> [[hashes, ends, units the events confirmed], ...]
        self.entries: dict[str, dict[int, list[list]]] = {}
        self._order: dict[str, deque[tuple[int, list]]] = {}

    @staticmethod
    def anchor_of(hashes: Sequence[int], ends: Sequence[int]) -> int:
        """The hash entries of a request's routing chain (block ``hashes`` ending at
        ``ends``, non-empty) are filed under: its block past :data:`SPECULATIVE_MIN_UNITS`
        (or its last)."""
        return hashes[min(bisect_right(ends, SPECULATIVE_MIN_UNITS), len(hashes) - 1)]

    def routed(self, instance_id: str, hashes: Sequence[int], ends: Sequence[int], anchor: int | None = None) -> None:
        """A request whose routing chain has block ``hashes`` ending at ``ends`` (units)
        was sent to the instance; ``anchor``: :meth:`anchor_of` them, when known."""
        if not len(hashes):
            return
        entry = [hashes, ends, 0]
        if anchor is None:
            anchor = self.anchor_of(hashes, ends)
        group = self.entries.setdefault(instance_id, {}).setdefault(anchor, [])
        group.append(entry)
        if len(group) > SPECULATIVE_PER_ANCHOR:  # the oldest: its prefill is the likeliest in the events by now
            del group[0]
        order = self._order.setdefault(instance_id, deque())
        order.append((anchor, entry))
        if len(order) > SPECULATIVE_PER_INSTANCE:
            old_anchor, old = order.popleft()
            self._drop(instance_id, old_anchor, old)

    def _drop(self, instance_id: str, anchor: int, entry: list) -> None:
        group = self.entries.get(instance_id, {}).get(anchor)
        if group is not None:
            for k, e in enumerate(group):
                if e is entry:  # (by identity: list.remove compares every hash of equal chains)
                    del group[k]
                    break
            if not group:
                del self.entries[instance_id][anchor]

    def match(self, inst: InstanceState, hashes: Sequence[int], ends: Sequence[int], held_units: float,
              slack: float = 0.0, anchor: int | None = None) -> int:
        """Leading routing-text units of a request (block ``hashes`` ending at ``ends``)
        about to be held on ``inst``: 0 when no entry shares more than ``held_units``,
        what its events show. An entry the events showed more of than ``held_units +
        slack`` is dropped (evicted since); ``slack`` absorbs the rounding of held tokens
        to units, which differs a little between requests (a KV block's worth).
        ``anchor``: :meth:`anchor_of` ``hashes`` and ``ends``, when known."""
        groups = self.entries.get(inst.instance_id)
        if not groups or not len(hashes):
            return 0
        if inst.in_flight <= 0:  # nothing pending there: the events are complete
            groups.clear()
            self._order.pop(inst.instance_id, None)
            return 0
        if anchor is None:
            anchor = self.anchor_of(hashes, ends)
        group = groups.get(anchor)
        if not group:
            return 0
        n = len(hashes)
        best = 0
        for entry in list(group):
            e = entry[0]
            hi = min(n, len(e))
            if e[hi - 1] == hashes[hi - 1]:
                m = hi
            else:  # chained hashes: equal at a block means equal before it
                lo, hi = 1, hi - 1
                while lo < hi:
                    mid = (lo + hi) >> 1
                    if e[mid] == hashes[mid]:
                        lo = mid + 1
                    else:
                        hi = mid
                m = lo
            u = ends[m - 1]
            if held_units >= u:
                if u > entry[2]:
                    entry[2] = u  # the events show this much of it
            elif entry[2] > held_units + slack:
                self._drop(inst.instance_id, anchor, entry)  # they showed more of it before: evicted since
            elif u > best:
                best = u
        return best


#: An entry counts for requests sharing at least this much routing text and one block
#: more with it (1,024 characters, 256 tokens: a document, a system prompt; not a
#: template's header).
SPECULATIVE_MIN_UNITS = 1024
#: Speculative entries kept per instance (at most about its requests in flight).
SPECULATIVE_PER_INSTANCE = 64
#: Of them, entries kept per anchor (requests sharing their first 17 blocks: one system
#: prompt or document); a request is matched against each, so this bounds the work.
SPECULATIVE_PER_ANCHOR = 8

