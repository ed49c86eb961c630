"""``CACHE_AWARE``: route on a learned view of every instance's prefix cache, by the prefill
time a choice saves against the queue it joins, keeping router replicas in agreement.

Why: ``PREFIX_AWARE`` hashes one fixed-length prefix. Many conversations that share a
long system prompt then hash to one instance (a hot spot), and a conversation that
grows past PrefixLength gains nothing from its longer shared history. The cache-aware
routers of the field track what each instance holds but ignore load or gate it by
coarse thresholds, grow without bound, send every miss to the same instance, and
disagree when several router replicas run (SPEC §5). This strategy:

1. **Chained blocks.** The routing text is cut into blocks whose hashes chain
   (:class:`prefixroute.core.block_chain.BlockChain`), up to ``MaxPrefixLength``: a block
   matches only if everything before it matches too. Blocks are ``BlockSize`` units for
   the first 16 and then double every 16 blocks. An image, audio or file part weighs
   ``MediaTokens`` tokens of text (:func:`prefixroute.core.routing_text.render_chat_text`), as
   it does in the engine's prefill.
2. **A bounded view per instance** (:class:`prefixroute.core.approx_cache.ApproxPrefixCache`):
   the blocks routed there, least recently used forgotten first, within
   ``InstanceCacheTokens`` x 4 characters and as many blocks as fill that with full
   blocks; all views of a router under one memory ceiling
   (:class:`~prefixroute.core.approx_cache.ViewBudget`). A fleet-wide index from block
   hash to the instances holding it finds the longest matches in a few probes
   (:class:`~prefixroute.core.match_levels.Levels`).
3. **The cost of a choice** (NVIDIA Dynamo's router cost, "prefill blocks not cached
   plus decode load", in characters of routing text): ``uncached + queue`` where
   ``uncached`` is the part of the request the instance does not hold and ``queue`` its
   pending prefill (the uncached parts of its requests whose first token has not come
   back, :attr:`~prefixroute.core.strategies.InstanceState.pending_prefill`) plus
   ``LoadWeight`` blocks per request in flight (the larger of the router's count and the
   engine's own running plus waiting, which includes other replicas' requests).
4. **Homes keep their requests.** An instance holding meaningfully more of the request
   than any other (:data:`STICK_MIN_BLOCKS`, :data:`STICK_FRACTION`), or whose match ends
   where a request routed there ended (a conversation's next turn, an agent's next step:
   the router never sees the answers in between), is a home. The cheapest home keeps the
   request unless its cost exceeds the alternative's by more than :data:`TIE_BLOCKS` plus
   :data:`REPLICATE_FRACTION` of the request: a conversation stays on one instance as it
   grows, a hot document is replicated only when its queue is clearly longer
   (:data:`BACKLOG_REPLICATE_FRACTION` of the request when the fleet is backlogged:
   every candidate with a request waiting for its first token, or
   :data:`BACKLOG_QUORUM` of them unless the traffic is conversational,
   :data:`CONVERSATIONAL_SHARE`; a copy then adds its prefill to a fleet already
   behind). A *new*
   branch off a shared prefix (a new conversation behind a long system prompt: the match
   does not end where a request routed there ended) leaves a home that has more than
   :data:`SPREAD_FACTOR` x the mean requests in flight plus :data:`SPREAD_SLACK` for its
   own bounded-load rendezvous choice, which prefills the prefix once and becomes a home
   too (simulated over the ten workloads: P90 TTFT -5 to -13 % on long-system-prompt and
   -17 to -28 % on hot-prefix with 4 and 8 replicas, the others unchanged).
5. **Placement by bounded-load rendezvous.** A prefix no instance holds meaningfully
   more of goes to the first instance in the rendezvous order of its first block past
   the longest match (never before block :data:`ANCHOR_MIN_BLOCKS`) that is below the
   threshold and whose queue is within :data:`BOUND_FACTOR` of the mean: new prefixes
   spread over the fleet, a marked hot spot is skipped, and independent router replicas
   place a prefix on the same instance. A home's alternative is placed the same way
   from the first block past what the other instances hold, so every replica sends a
   hot prefix's overflow to the same second instance.
6. **ConcurrencyThreshold first.** An instance at or over it never gets a request while
   another is below it. When every one is at it (``all_busy``) the threshold cannot be
   honoured and the request goes where it costs least, so an overload does not turn
   into a cascade of cache misses.
7. **A prefill is weighed by the requests it delays.** A prefill on an instance delays
   every request already waiting for its first token there by as long as it lasts, so
   its cost is ``uncached x (1 + waiting)``, ``waiting`` the larger of the router's count
   and the engine's own (other replicas' requests included). An idle fleet has nobody
   waiting and the cost is Dynamo's; near saturation a miss moves a request off its home
   only when the home's queue outweighs the miss's extra prefill times the requests it
   would hold up (no constant: the weight is a count), so an overload does not turn into
   a cascade of misses that lengthen every queue. Until 2026-12 this applied only when
   every candidate was at the threshold; with it at any load and the backlog margin
   (:data:`BACKLOG_REPLICATE_FRACTION`), simulated over the ten workloads x 1, 4, 8
   replicas x 5 seeds (docs/SIMULATOR.md, "Near saturation"; ConcurrencyThreshold 32):
   near-saturation P50 TTFT 815 / 960 / 963 -> 694 / 839 / 740 ms (247 with 1 replica at
   the benchmark's threshold of 64), hot-prefix P90 72 / 101 / 118 -> 58 / 95 /
   109, sharegpt-multi-turn P90 86 / 71 / 76 -> 74 / 75 / 61; the others within 0.5
   points and 2 ms.

The constants were chosen with the simulator over the benchmark's ten workloads at 1, 4
and 8 router replicas (docs/BENCHMARKS.md, docs/SIMULATOR.md).

Decision kinds: ``affinity`` (a home, or the first choice of a placement), ``overflow``
(the alternative to a home, or a placement past its first choice), ``all_busy``,
``fallback`` (no blocks: an empty prompt).
"""

from __future__ import annotations

import math
import random
from operator import attrgetter
from typing import Callable, Sequence

from prefixroute.core.approx_cache import BYTES_PER_BLOCK_ENTRY, ApproxPrefixCache, ViewBudget
from prefixroute.core.config import RoutingConfig, RoutingStrategy
from prefixroute.core.hashing import rendezvous_best, rendezvous_order
from prefixroute.core.match_levels import Levels as _Levels, first as _first, first_over as _first_over
from prefixroute.core.block_chain import BlockChain
from prefixroute.core.precise_policy import choose_precise
from prefixroute.core.placement_rules import (
    ANCHOR_MIN_BLOCKS,
    SPREAD_FACTOR,
    SPREAD_SLACK,
    BOUND_FACTOR,
    BOUND_SLACK_BLOCKS,
    BOUND_SLACK_REQUESTS,
    REPLICATE_FRACTION,
    BACKLOG_REPLICATE_FRACTION,
    BACKLOG_QUORUM,
    CONTINUED_SHARE_WINDOW,
    CONVERSATIONAL_SHARE,
    STICK_FRACTION,
    STICK_MIN_BLOCKS,
    TIE_BLOCKS,
)
from prefixroute.core.strategies import DecisionKind, InstanceState, Strategy, least_outstanding, register


__all__ = ["CacheAwareStrategy", "ApproxPrefixCache", "ViewBudget", "BYTES_PER_BLOCK_ENTRY", "ANCHOR_MIN_BLOCKS",
           "STICK_MIN_BLOCKS", "STICK_FRACTION", "TIE_BLOCKS", "REPLICATE_FRACTION",
           "BACKLOG_REPLICATE_FRACTION", "BOUND_FACTOR",
           "BOUND_SLACK_REQUESTS", "BOUND_SLACK_BLOCKS"]

# The placement rules' constants live in .placement_rules (shared with .precise_policy).

_in_flight = attrgetter("in_flight")
_engine_load = attrgetter("engine_load")
_pending = attrgetter("pending_prefill")


def _bits(mask: int):
    """The set bits of ``mask``, lowest first."""
    while mask:
        low = mask & -mask
        mask ^= low
        yield low


@register
class CacheAwareStrategy(Strategy):
    """``CACHE_AWARE`` (see the module docstring for the rule and its sources).

    State: one :class:`ApproxPrefixCache` per instance (bounded by units and blocks,
    optionally under a router-wide :class:`ViewBudget`) and a fleet-wide index from block
    hash to the bitmask of instances holding it, so one binary search over a request's
    chain finds all the instances holding its longest match at once (a few xxh3 passes
    and dict lookups, whatever the number of instances; see :class:`~prefixroute.core.match_levels.Levels`).
    """

    name = RoutingStrategy.CACHE_AWARE

    def __init__(self, config: RoutingConfig, rng: random.Random) -> None:
        super().__init__(config, rng)
        ca = config.cache_aware
        assert ca is not None  # guaranteed by RoutingConfig validation
        self.block_size = ca.block_size
        self._settings(config)
        self.caches: dict[str, ApproxPrefixCache] = {}
        #: moving average, over about CONTINUED_SHARE_WINDOW learned requests that share a
        #: prefix with what was routed to their instance, of whether each continued a
        #: request routed there (a conversation's next turn) rather than branched off it
        #: (a new question about a document); starts at 1
        self.continued_share = 1.0
        #: learned requests the share has averaged so far
        self.continued_samples = 0
        self.budget: ViewBudget | None = None
        self._index: dict[int, int] = {}
        self._bits: dict[str, int] = {}
        self._free: list[int] = []
        self._next_slot = 0
        self._bits_src: Sequence[InstanceState] | None = None
        self._bits_list: list[int] = []
        self._bits_mask = 0
        self._by_bit: dict[int, InstanceState] = {}

    def _settings(self, config: RoutingConfig) -> None:
        ca = config.cache_aware
        assert ca is not None
        bs = self.block_size
        self.threshold = ca.concurrency_threshold
        self.load_weight = ca.load_weight
        #: routing-text units (characters) of prefill one request in flight costs
        self.load_units = ca.load_weight * bs
        #: the engines' KV tiers (core/tiers.py), or None
        self.kv_tiers = ca.kv_tiers
        #: units (characters) each instance's view may cover: InstanceCacheTokens x 4, and
        #: the engines' CPU tier too when they have one (a block moved there stays held)
        self.capacity_units = (ca.instance_cache_tokens + (ca.kv_tiers.cpu_tier_tokens if ca.kv_tiers else 0)) * 4
        #: most blocks one view holds: as many as full blocks fill its units
        self.capacity_blocks = max(1, self.capacity_units // bs)
        self.tie_units = TIE_BLOCKS * bs
        self.stick_units = STICK_MIN_BLOCKS * bs
        self.bound_slack = BOUND_SLACK_REQUESTS * self.load_units + BOUND_SLACK_BLOCKS * bs

    # -- state ------------------------------------------------------------------------

    def attach_budget(self, budget: ViewBudget | None) -> None:
        """Put every view (and every later one) under ``budget``, a router-wide memory
        ceiling shared with other strategies."""
        if self.budget is not None:
            for cache in self.caches.values():
                self.budget.discard(cache)
        self.budget = budget
        if budget is not None:
            for cache in self.caches.values():
                budget.add(cache)

    def _cache(self, inst: InstanceState) -> ApproxPrefixCache:
        cache = self.caches.get(inst.instance_id)
        if cache is None:
            if self._free:
                slot = self._free.pop()
            else:
                slot, self._next_slot = self._next_slot, self._next_slot + 1
            bit = 1 << slot
            self._bits[inst.instance_id] = bit
            cache = self.caches[inst.instance_id] = ApproxPrefixCache(self.capacity_units, self._index, bit,
                                                                      self.capacity_blocks)
            if self.budget is not None:
                self.budget.add(cache)
        return cache

    def reconfigure(self, config: RoutingConfig) -> bool:
        # The chains (block size, cap, media weight) must stay what the views hold;
        # the threshold, load weight and view size change in place.
        old, new = self.config.cache_aware, config.cache_aware
        if old is None or new is None or (old.block_size, old.max_prefix_length, old.media_tokens) != \
                (new.block_size, new.max_prefix_length, new.media_tokens):
            return False
        self.config = config
        self._settings(config)
        for cache in self.caches.values():
            cache.capacity = self.capacity_units
            cache.own_max_blocks = self.capacity_blocks
            cache.set_block_limit(self.capacity_blocks)
        if self.budget is not None:
            self.budget.rebalance()
        return True

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

    def _uncached_cost(self, inst: InstanceState, uncached: float) -> float:
        """What prefilling ``uncached`` units on ``inst`` costs the fleet (rule 7): the
        units once for the request and once for each request already waiting for its
        first token there, which the prefill delays by as long as it lasts:
        ``uncached x (1 + waiting)``, ``waiting`` the larger of the router's count
        (:attr:`InstanceState.awaiting_first_token`) and the engine's
        (``vllm:num_requests_waiting``). With nobody waiting it is Dynamo's cost (the
        units). No constant: the weight is the count of delayed requests. A holding
        larger than the request (precise mode: the events show every block and the
        learned view adds a continued request's partial block) costs 0, never less, so
        requests waiting never make an instance look cheaper."""
        if uncached <= 0:
            return 0.0
        return uncached * (1 + max(inst.awaiting_first_token, inst.engine_waiting))

    def _replicate_fraction(self, candidates: Sequence[InstanceState]) -> float:
        """The fraction of a request by which a home's cost must exceed an alternative's
        (past the tie band) to replicate its prefix there: :data:`REPLICATE_FRACTION`,
        or :data:`BACKLOG_REPLICATE_FRACTION` when the fleet is backlogged: every
        candidate has a request waiting for its first token (by the router's count or
        the engine's), or, unless the traffic is conversational
        (:attr:`continued_share` at least :data:`CONVERSATIONAL_SHARE`),
        :data:`BACKLOG_QUORUM` of them (rounded up) have. With nothing waiting anywhere
        (the usual case) it reads one candidate, or ``n - ceil(0.75 n) + 1`` of ``n``
        for document traffic."""
        n = len(candidates)
        if self.continued_share >= CONVERSATIONAL_SHARE:
            allowed = 0  # every candidate must have a request waiting
        else:
            allowed = n - math.ceil(BACKLOG_QUORUM * n)  # candidates that may have none
        for c in candidates:
            if not (c.awaiting_first_token or c.engine_waiting):
                allowed -= 1
                if allowed < 0:
                    return REPLICATE_FRACTION
        return BACKLOG_REPLICATE_FRACTION

    def _queue(self, inst: InstanceState) -> float:
        """An instance's queue cost in routing-text units: its pending prefill plus
        LoadWeight blocks per request in flight (the larger of the router's count and the
        engine's running plus waiting)."""
        return inst.pending_prefill + self.load_units * max(inst.in_flight, inst.engine_load)

    def choose(
        self, key: int | None, candidates: Sequence[InstanceState], blocks: Sequence[int] = ()
    ) -> tuple[InstanceState, DecisionKind]:
        self.uncached_units = 0
        if not len(blocks):
            return least_outstanding(candidates, self.rng), DecisionKind.FALLBACK
        # -- precise mode and KV tiers (issue 33; core/precise_policy.py) ------------------
        # A request carrying engine-reported holdings (blocks.precise), or engines with a
        # shared KV tier to model, are decided by the same rule on those holdings; when
        # it has nothing to add (no precise candidate), the rule below decides as before.
        precise = getattr(blocks, "precise", None)
        if precise is not None or self.kv_tiers is not None:
            chosen = choose_precise(self, candidates, blocks, precise)
            if chosen is not None:
                return chosen
        # -- end of the precise-mode hook ---------------------------------------------------
        found = self._decide(candidates, blocks, self.threshold)
        if found is None:
            # Every candidate is at the threshold, so it cannot be honoured: the same rule
            # without it. The engines queue the request; giving up affinity here would
            # turn an overload into a cascade of cache misses.
            found = self._decide(candidates, blocks, math.inf)
            assert found is not None
            return found[0], DecisionKind.ALL_BUSY
        return found

    def _decide(self, candidates: Sequence[InstanceState], blocks: Sequence[int],
                threshold: float) -> tuple[InstanceState, DecisionKind] | None:
        """The rule of the module docstring with ConcurrencyThreshold ``threshold``;
        ``None`` when every candidate is at it."""
        n = len(blocks)
        chain = isinstance(blocks, BlockChain)
        get = blocks.hash if chain else blocks.__getitem__
        if chain:
            ends, shift = blocks.ends, blocks.unit_shift  # type: ignore[attr-defined]
            size = ends[-1] >> shift
            unit: Callable[[int], int] = lambda d: (ends[d - 1] >> shift) if d else 0  # noqa: E731
        else:
            bs = self.block_size
            size = n * bs
            unit = lambda d: d * bs  # noqa: E731
        bits, cmask, by_bit = self._bits_of(candidates)
        amin = min(ANCHOR_MIN_BLOCKS, n - 1)
        held = self._index.get(get(0), 0) & cmask
        if not held:  # no candidate holds even the first block: a new prefix
            return self._place(get(amin), candidates, size, None, bits, unit, threshold)
        if not held & (held - 1):
            # One candidate holds the first block and no other does: the usual follow-up
            # (a new question about a document, the next turn of a conversation). If it
            # holds the whole chain or all of it but the last block, found from those two
            # blocks (one xxh3 pass reads both), the rules below give it the request when
            # it is below the threshold, holds a meaningful part (no other holds any)
            # and its cost is within the margin of any alternative's (which must prefill
            # everything): the same answer, without the level search (tested equal in
            # tests/test_core_cache_aware.py).
            index = self._index
            d = n if index.get(get(n - 1), 0) & held else n - 1 if n > 1 and index.get(get(n - 2), 0) & held else 0
            if d:
                inst = by_bit[held]
                u_top = unit(d)
                if inst.in_flight < threshold and u_top >= max(self.stick_units, STICK_FRACTION * size) and \
                        self._uncached_cost(inst, size - u_top) + self._queue(inst) <= \
                        size + self.tie_units + self._replicate_fraction(candidates) * size:
                    spread = self._spread(blocks, inst, held, candidates, d, by_bit, threshold,
                                          min(max(d, amin), n - 1)) \
                        if chain and max(inst.in_flight, inst.engine_load) > SPREAD_SLACK else None
                    if spread is not None:  # (no other candidate holds even the first block)
                        self.uncached_units = size
                        return spread, DecisionKind.OVERFLOW
                    self.uncached_units = size - u_top
                    return inst, DecisionKind.AFFINITY
        levels = _Levels(get, self._index, held, n)
        levels.pull()
        d_top = levels.depths[0]
        u_top = unit(d_top)
        home_mask = levels.masks[0]
        # Other holders within one block of the longest match are homes too (a prefix
        # held in several places); found by probing one block, not by exact searches.
        upto = lambda k: unit(k + 1)  # noqa: E731  (units up to the end of block k)
        stick = max(self.stick_units, STICK_FRACTION * size)
        alone = not levels.remaining  # no other candidate holds even the first block (the usual follow-up)
        if alone:
            meaningful = u_top >= stick
        else:
            k_band = _first(levels.bound, u_top - self.block_size, upto)
            while levels.any_holds(k_band):
                levels.pull()
                home_mask |= levels.masks[-1]
            # The rest hold less than k_band + 1 blocks: their best match ("u_rest", 0
            # with none) is bounded by probes below, and found exactly only when needed.
            meaningful = u_top >= stick and not levels.any_holds(_first_over(levels.bound, u_top - stick, upto))
        extra = 0  # units past the full blocks a continuation home holds too
        top_mask = levels.masks[0]
        if chain and (not meaningful or top_mask & (top_mask - 1)):
            # Not much more than the others hold, or held by several: the homes are the
            # holders this request continues a request routed to (a conversation's next
            # turn after a short one, the same conversation among holders of its system
            # prompt), if any.
            cont = self._continuing(blocks, top_mask, d_top, by_bit)  # type: ignore[arg-type]
            if cont:
                home_mask, extra, meaningful = cont[0], cont[1], True
        if not meaningful:
            # No instance holds meaningfully more than the others (a new prefix behind a
            # shared header, a shared system prompt held everywhere): placed by the
            # rendezvous order of what is new in it.
            return self._place(get(min(max(d_top, amin), n - 1)), candidates, size, levels, bits, unit, threshold)
        tie = self.tie_units
        homes: list[tuple[float, InstanceState, int]] = []
        for b in _bits(home_mask):
            inst = by_bit[b]
            if inst.in_flight < threshold:
                m = unit(levels.depth_of(b)) + extra
                homes.append((self._uncached_cost(inst, size - m) + self._queue(inst), inst, m))
        limit = tie + self._replicate_fraction(candidates) * size
        if homes:
            low = min(c for c, _, _ in homes)
            band = [h for h in homes if h[0] <= low + tie]
            if len(band) > 1:  # equal homes (a hot prefix replicated): by rendezvous past the match
                tokens = [h[1].token for h in band]
                band = [band[rendezvous_best(get(min(max(d_top, amin), n - 1)), tokens)]]
            c_home, home, m_home = band[0]
            # Any other instance must prefill at least size - u_rest: if the home beats
            # even that by the margin, no alternative is looked at.
            most = size + limit - c_home  # the home wins if u_rest <= most
            if most >= u_top or (most >= 0 and (alone or not levels.any_holds(_first_over(levels.bound, most,
                                                                                             upto)))):
                spread = self._spread(blocks, home, home_mask, candidates, d_top, by_bit, threshold,
                                      min(max(d_top, amin), n - 1), levels) \
                    if chain and max(home.in_flight, home.engine_load) > SPREAD_SLACK else None
                if spread is not None:
                    self.uncached_units = size - unit(levels.depth_of(bits[candidates.index(spread)]))
                    return spread, DecisionKind.OVERFLOW
                self.uncached_units = size - m_home
                return home, DecisionKind.AFFINITY
        # The homes are at the threshold or their queues are long: the alternative is the
        # placement of what the homes hold and the others do not (the first block past
        # the others' match), so every replica sends a hot prefix's overflow to the same
        # second instance.
        d_rest = levels.depths[-1] if levels.pull() else 0
        alt = self._walk(get(min(max(d_rest, amin), n - 1)), candidates, threshold, home_mask)
        if alt is not None:
            m_alt = unit(levels.depth_of(bits[candidates.index(alt)]))
        if homes and (alt is None or c_home <= self._uncached_cost(alt, size - m_alt) + self._queue(alt) + limit):
            self.uncached_units = size - m_home
            return home, DecisionKind.AFFINITY
        if alt is None:
            return None  # every candidate at the threshold (homes included: else one of them had it)
        self.uncached_units = size - m_alt
        return alt, DecisionKind.OVERFLOW

    def _spread(self, blocks: BlockChain, home: InstanceState, home_mask: int, candidates: Sequence[InstanceState],
                d_top: int, by_bit: dict[int, InstanceState], threshold: float,
                anchor_block: int, levels: "_Levels | None" = None) -> InstanceState | None:
        """A new branch off a shared prefix (a new conversation behind a long system
        prompt, a new question about a document) whose home has markedly more requests in
        flight than the fleet's mean (:data:`SPREAD_FACTOR`, :data:`SPREAD_SLACK`): the
        instance the branch's own rendezvous order gives (bounded load, the homes
        skipped), which then prefills the shared prefix once and becomes a home too. Not
        for a continuation (the match ends where a request routed to the home ended: a
        conversation's next turn keeps its instance). ``None``: the home keeps it. Called
        only when the home has more than :data:`SPREAD_SLACK` requests (the usual request
        makes no call and hashes nothing more); ``anchor_block`` is hashed only when the
        home is to be left."""
        if not self._busy_home(home, candidates, threshold):
            return None
        home_load = max(home.in_flight, home.engine_load)
        home_bit = home_mask & -home_mask
        for b in _bits(home_mask):
            if by_bit[b] is home:
                home_bit = b
        if levels is not None:  # the home's own match (a home of the band may hold less)
            d_top = levels.depth_of(home_bit)
        if d_top and self._continuing(blocks, home_bit, d_top, by_bit):
            return None
        alt = self._walk(blocks.hash(anchor_block), candidates, threshold, home_mask)  # (hashed only now)
        if alt is None or max(alt.in_flight, alt.engine_load) >= home_load:
            return None
        return alt

    @staticmethod
    def _busy_home(home: InstanceState, candidates: Sequence[InstanceState], threshold: float) -> bool:
        """Rule 4's test: ``home`` has more than :data:`SPREAD_FACTOR` x the mean requests
        in flight of the candidates below ``threshold`` plus :data:`SPREAD_SLACK` (each
        count the larger of the router's and the engine's, which includes other
        replicas')."""
        home_load = max(home.in_flight, home.engine_load)
        loads = [max(c.in_flight, c.engine_load) for c in candidates if c.in_flight < threshold]
        return bool(loads) and home_load > SPREAD_FACTOR * (sum(loads) / len(loads)) + SPREAD_SLACK

    def _continuing(self, blocks: BlockChain, mask: int, d_top: int,
                    by_bit: dict[int, InstanceState]) -> tuple[int, int] | None:
        """The holders (bits of ``mask``, which hold ``d_top`` blocks) where a chain routed
        earlier ended inside this request's text: its partial last block is this text's
        prefix there (:meth:`ApproxPrefixCache.continued_rest`). Returns ``(their bits, the partial block's units)`` (the longest
        such end), or ``None``. A text the holders hold whole (the same prompt again,
        whether it ends in a partial block or on a block's end) is not a continuation
        here, on purpose: identical prompts may be in flight by the dozen (an evaluation
        harness, n samples sent as separate requests), where a conversation has one turn
        at a time, and the spread rule is what keeps them from piling onto one instance."""
        if d_top >= len(blocks):
            return None
        found, extra = 0, -1
        caches = self.caches
        for b in _bits(mask):
            rest = caches[by_bit[b].instance_id].continued_rest(blocks, d_top)
            if rest is None:
                continue
            if rest > extra:
                found, extra = b, rest
            elif rest == extra:
                found |= b
        return (found, extra) if found else None

    def _walk(self, anchor: int, candidates: Sequence[InstanceState], threshold: float,
              skip: int = 0) -> InstanceState | None:
        """Bounded-load rendezvous: the first candidate in ``anchor``'s rendezvous order
        (its bit not in ``skip``) below the threshold whose queue cost is within the
        bound (:data:`BOUND_FACTOR`); the first one below the threshold if none is
        within it; ``None`` if every one is at the threshold."""
        tokens = self.tokens(candidates)
        bits = self._bits_list if candidates is self._bits_src else self._bits_of(candidates)[0]
        first = rendezvous_best(anchor, tokens)
        inst = candidates[first]
        if not bits[first] & skip and inst.in_flight < threshold and self._queue(inst) <= self.bound_slack:
            return inst  # within any bound (the mean is >= 0): no pass over the fleet
        below = [c for c in candidates if c.in_flight < threshold]
        if not below:
            return None
        w = self.load_units
        loads = list(map(max, map(_in_flight, below), map(_engine_load, below)))
        mean = (sum(map(_pending, below)) + w * sum(loads)) / len(below)
        bound = BOUND_FACTOR * mean + self.bound_slack
        spare = None
        for i in rendezvous_order(anchor, tokens):
            inst = candidates[i]
            if bits[i] & skip or inst.in_flight >= threshold:
                continue
            if self._queue(inst) <= bound:
                return inst
            if spare is None:
                spare = inst
        return spare

    def _place(self, anchor: int, candidates: Sequence[InstanceState], size: int, levels: "_Levels | None",
               bits: list[int], unit: Callable[[int], int],
               threshold: float) -> tuple[InstanceState, DecisionKind] | None:
        """A prefix no instance holds meaningfully more of: the bounded-load rendezvous
        choice of ``anchor`` (``affinity`` if it is the first in the order, ``overflow``
        if that one was skipped); ``None`` when every candidate is at the threshold."""
        inst = self._walk(anchor, candidates, threshold)
        if inst is None:
            return None
        i = candidates.index(inst)
        self.uncached_units = size - (unit(levels.depth_of(bits[i])) if levels is not None else 0)
        first = rendezvous_best(anchor, self.tokens(candidates))
        return inst, DecisionKind.AFFINITY if i == first else DecisionKind.OVERFLOW

    def on_routed(self, instance: InstanceState, blocks: Sequence[int]) -> None:
        # Every member has its view (on_membership_change); an instance removed between
        # the decision and the learning (a driver may learn after its send) has none,
        # and gets none back: nothing to learn.
        cache = self.caches.get(instance.instance_id)
        if blocks and cache is not None:
            if isinstance(blocks, BlockChain):
                continued = self._continued(cache, blocks, cache.insert(blocks))
                full = blocks.full
                if full:
                    n = len(blocks)
                    ends, shift = blocks.ends, blocks.unit_shift
                    if full < n:  # it ended in a partial block
                        cache.mark_tail(blocks.hash(full - 1), (ends[n - 1] - ends[full - 1]) >> shift,
                                        blocks.hash(n - 1))
                    else:
                        cache.mark_tail(blocks.hash(full - 1))
            else:
                held = cache.insert(blocks, [self.block_size] * len(blocks))
                continued = (cache.tail(blocks[held - 1]) is not None) if held else None
                cache.mark_tail(blocks[-1])
            if continued is not None:  # (a prefix nothing routed there shares is neither)
                self.continued_share += (continued - self.continued_share) / CONTINUED_SHARE_WINDOW
                self.continued_samples += 1

    @staticmethod
    def _continued(cache: ApproxPrefixCache, blocks: BlockChain, held: int) -> bool | None:
        """Whether a chain whose ``held`` leading blocks ``cache`` remembered continues a
        chain routed there (the test of :meth:`_continuing`: its last full held block
        is where that chain's full blocks ended, and the partial block that chain ended
        with is this text's prefix there; a conversation's next turn, an agent's next
        step; and, the depth being capped at the full blocks here, unlike in
        :meth:`_continuing`, the same prompt again) or branches off what it holds (a new question
        about a document, a new conversation behind a system prompt); ``None`` when it
        holds nothing of it. Read before this chain's own tail is marked."""
        k = min(held, blocks.full)
        return cache.continued_rest(blocks, k) is not None if k else None

    def on_membership_change(self, instances: Sequence[InstanceState]) -> None:
        # A removed instance's view is dropped; if it comes back its cache is cold anyway.
        keep = {i.instance_id for i in instances}
        for gone in [k for k in self.caches if k not in keep]:
            cache = self.caches.pop(gone)
            cache.clear()
            if self.budget is not None:
                self.budget.discard(cache)
            bit = self._bits.pop(gone)
            self._free.append(bit.bit_length() - 1)
        for inst in instances:  # every member gets its view now: candidate bit lists stay valid
            self._cache(inst)
        self._bits_src, self._bits_list = None, []

    def on_cache_lost(self, instance: InstanceState) -> None:
        # The engine starts empty: its view is emptied (and its bit leaves the index),
        # so its chains count as held nowhere until requests are routed to it again.
        cache = self.caches.get(instance.instance_id)
        if cache is not None:
            cache.clear()

    def instance_stats(self) -> dict[str, dict[str, float]]:
        return {iid: {"approx_cache_instance_bytes": float(len(c) * BYTES_PER_BLOCK_ENTRY),
                      "approx_cache_instance_max_bytes": float(c.max_blocks * BYTES_PER_BLOCK_ENTRY)}
                for iid, c in self.caches.items()}

    def stats(self) -> dict[str, float]:
        blocks = sum(len(c) for c in self.caches.values())
        out = {
            "approx_cache_blocks": float(blocks),
            "approx_cache_bytes": float(blocks * BYTES_PER_BLOCK_ENTRY),
            "approx_cache_capacity_blocks": float(sum(c.max_blocks for c in self.caches.values())),
        }
        if self.continued_samples:  # (a share, not a count: a series per pool, server/metrics.py)
            out["cache_aware_continued_share"] = self.continued_share
        return out
