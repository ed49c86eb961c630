"""Routing strategies: small classes registered by name, one decision method each.

Adding a strategy touches this file only: subclass :class:`Strategy`, set ``name``,
implement :meth:`Strategy.choose`, decorate with :func:`register`.

A strategy sees the candidate instances (healthy ones of one production variant) and
their in-flight counts; it never changes state. :class:`prefixroute.core.pool.VariantPool`
owns the counts.
"""

from __future__ import annotations

import enum
import random
from abc import ABC, abstractmethod
from collections import OrderedDict
from dataclasses import dataclass, field
from itertools import compress, islice
from operator import attrgetter
from typing import Any, ClassVar, Sequence

from prefixroute.core.config import RoutingConfig, RoutingStrategy
from prefixroute.core.hashing import instance_token, rendezvous_best, rendezvous_order

__all__ = [
    "DecisionKind",
    "InstanceState",
    "Strategy",
    "RandomStrategy",
    "LeastOutstandingStrategy",
    "PrefixAwareStrategy",
    "STRATEGIES",
    "ORDER_CACHE_SIZE",
    "register",
    "make_strategy",
]

#: Routing keys whose rendezvous choice ``PREFIX_AWARE`` remembers for the current
#: candidates, least recently used evicted. An entry is the key's best index or, once an
#: overflow walked past it, its whole order (one index per candidate): at most
#: 1,024 x (candidates + 1) small ints.
ORDER_CACHE_SIZE = 1024


class DecisionKind(str, enum.Enum):
    """Why a request went where it went (a metrics label and a response header)."""

    #: PREFIX_AWARE: the key's preferred instance (below ConcurrencyThreshold).
    AFFINITY = "affinity"
    #: PREFIX_AWARE: the preferred instance was at the threshold; the next instance in
    #: the key's rendezvous order that is below it.
    OVERFLOW = "overflow"
    #: PREFIX_AWARE: every candidate was at the threshold; the least outstanding one.
    ALL_BUSY = "all_busy"
    #: PREFIX_AWARE: the request had no routing key (nothing to key on); least outstanding.
    FALLBACK = "fallback"
    #: RANDOM: uniform over healthy instances.
    RANDOM = "random"
    #: LEAST_OUTSTANDING_REQUESTS: fewest in flight, ties broken randomly.
    LEAST_OUTSTANDING = "least_outstanding"
    #: Any strategy: the request named a session, and went to its instance.
    SESSION = "session"


@dataclass(eq=False, slots=True)
class InstanceState:
    """One engine instance as the router sees it.

    Attributes:
        instance_id: stable identity, normally the base URL (``http://host:port``).
            Rendezvous scores are computed from it, so it must not change across
            restarts of the router.
        in_flight: requests sent and not yet finished (streams count until their end).
            Change it with :meth:`add_in_flight`: with ``serve --workers N`` the
            instances are :class:`prefixroute.core.counters.SharedInstanceState`,
            whose ``in_flight`` is a read-only sum over the worker processes.
        healthy: whether it takes new requests.
        served: requests ever routed to it (for instance share).
        engine_load: requests the engine itself reports running plus waiting (scraped
            from its ``/metrics``; 0 when unknown). Includes other router replicas' load.
        engine_waiting: requests the engine reports waiting (``vllm:num_requests_waiting``,
            scraped; 0 when unknown).
        engine_kv_usage: fraction 0-1 of the engine's KV cache in use
            (``vllm:kv_cache_usage_perc``, scraped; 0.0 when unknown).
        pending_prefill: units of routing text (characters; bytes on the native API)
            that this router sent to the instance and estimates it has not prefilled
            yet: for each request in flight whose first token has not come back, the
            part of its prompt the strategy estimated the instance did not hold
            (:attr:`Strategy.uncached_units`). Its queue of prefill work, the term of
            NVIDIA Dynamo's cost model that "updates when the first output token signals
            prefill completion". Local to the router process.
    """

    instance_id: str
    in_flight: int = 0
    healthy: bool = True
    served: int = 0
    engine_load: int = 0
    engine_waiting: int = 0
    engine_kv_usage: float = 0.0
    pending_prefill: int = 0
    awaiting_first_token: int = 0
    token: bytes = field(default=b"", repr=False)

    def __post_init__(self) -> None:
        if not self.token:
            self.token = instance_token(self.instance_id)

    def add_in_flight(self, delta: int) -> None:
        """Count ``delta`` more requests in flight (``-1`` when one ends)."""
        self.in_flight += delta


class Strategy(ABC):
    """A routing policy. Subclasses set ``name`` and implement :meth:`choose`."""

    name: ClassVar[RoutingStrategy]

    #: Units of the last chosen request's routing text that the chosen instance is
    #: estimated not to hold (what it must prefill), set by :meth:`choose`; strategies
    #: that keep no view of the caches leave it 0. The pool adds it to the instance's
    #: :attr:`InstanceState.pending_prefill` until the request's first token.
    uncached_units: int = 0

    def __init__(self, config: RoutingConfig, rng: random.Random) -> None:
        self.config = config
        self.rng = rng
        self._tok_src: Sequence[InstanceState] | None = None
        self._tok: list[bytes] = []

    def tokens(self, candidates: Sequence[InstanceState]) -> list[bytes]:
        """The candidates' rendezvous tokens. The pool passes the same tuple while
        membership and health do not change, so the list is built once per tuple."""
        if candidates is self._tok_src:
            return self._tok
        tok = [c.token for c in candidates]
        if type(candidates) is tuple:
            self._tok_src, self._tok = candidates, tok
        return tok

    def rendezvous(self, key: int, candidates: Sequence[InstanceState]) -> int:
        """Index of the candidate with the highest rendezvous score for ``key``
        (:func:`prefixroute.core.hashing.rendezvous_best` on the cached tokens)."""
        return rendezvous_best(key, self.tokens(candidates))

    @abstractmethod
    def choose(
        self, key: int | None, candidates: Sequence[InstanceState], blocks: Sequence[int] = ()
    ) -> tuple[InstanceState, DecisionKind]:
        """Pick one of ``candidates`` (non-empty, healthy) for a request.

        ``key`` is the 64-bit routing key (``PREFIX_AWARE``) or ``None``; ``blocks``
        the request's chained block hashes (``CACHE_AWARE``) or empty. Must not modify
        any state: :meth:`on_routed` is told when the decision is acted on.
        """

    def on_routed(self, instance: InstanceState, blocks: Sequence[int]) -> None:
        """Called once a request with ``blocks`` was sent to ``instance``; stateless
        strategies ignore it."""

    def on_membership_change(self, instances: Sequence[InstanceState]) -> None:
        """Called when instances are added or removed; stateless strategies ignore it."""

    def attach_budget(self, budget: Any) -> None:
        """Put what the strategy learns under ``budget``, a router-wide memory ceiling
        (a :class:`prefixroute.core.approx_cache.ViewBudget`, or ``None``); strategies
        that learn nothing ignore it."""

    def reconfigure(self, config: RoutingConfig) -> bool:
        """Take a new configuration of the same strategy in place, keeping what was
        learned; ``False`` (the default) when it cannot, and the pool then starts a new
        strategy. Stateless strategies take any: nothing is lost by a new one either."""
        return False

    def on_cache_lost(self, instance: InstanceState) -> None:
        """Called when ``instance``'s engine lost its prefix cache (it restarted):
        what a strategy learned about that cache no longer holds. Stateless strategies
        ignore it."""

    def stats(self) -> dict[str, float]:
        """Gauges worth exporting (e.g. memory of learned state); empty by default."""
        return {}

    def instance_stats(self) -> dict[str, dict[str, float]]:
        """Per-instance gauges (instance id -> name -> value), e.g. the memory of what
        was learned about each instance's cache; empty by default."""
        return {}


STRATEGIES: dict[RoutingStrategy, type[Strategy]] = {}


def register(cls: type[Strategy]) -> type[Strategy]:
    """Class decorator: make ``cls`` available under ``cls.name``."""
    STRATEGIES[cls.name] = cls
    return cls


def make_strategy(config: RoutingConfig, rng: random.Random) -> Strategy:
    """Instantiate the registered strategy named by ``config.strategy``."""
    return STRATEGIES[config.strategy](config, rng)


_in_flight = attrgetter("in_flight")


def least_outstanding(candidates: Sequence[InstanceState], rng: random.Random) -> InstanceState:
    """The candidate with the fewest in flight; ties broken uniformly at random (the
    ``k``-th of the tied ones in candidate order, ``k = rng.randrange(ties)``)."""
    loads = list(map(_in_flight, candidates))
    low = min(loads)
    tied = loads.count(low)
    if tied == 1:
        return candidates[loads.index(low)]
    k = rng.randrange(tied)
    if tied == len(loads):
        return candidates[k]
    return candidates[next(islice(compress(range(len(loads)), map(low.__eq__, loads)), k, None))]


@register
class RandomStrategy(Strategy):
    """``RANDOM``: uniform over healthy instances (SageMaker's default)."""

    name = RoutingStrategy.RANDOM

    def choose(
        self, key: int | None, candidates: Sequence[InstanceState], blocks: Sequence[int] = ()
    ) -> tuple[InstanceState, DecisionKind]:
        return self.rng.choice(candidates), DecisionKind.RANDOM


@register
class LeastOutstandingStrategy(Strategy):
    """``LEAST_OUTSTANDING_REQUESTS``: fewest requests in flight, ties broken randomly."""

    name = RoutingStrategy.LEAST_OUTSTANDING_REQUESTS

    def choose(
        self, key: int | None, candidates: Sequence[InstanceState], blocks: Sequence[int] = ()
    ) -> tuple[InstanceState, DecisionKind]:
        return least_outstanding(candidates, self.rng), DecisionKind.LEAST_OUTSTANDING


@register
class PrefixAwareStrategy(Strategy):
    """``PREFIX_AWARE``: rendezvous affinity with a per-instance concurrency bound.

    1. The key's preferred instance is the one with the highest rendezvous score
       (:mod:`prefixroute.core.hashing`). If it has fewer than ``ConcurrencyThreshold``
       requests in flight, it gets the request (``affinity``).
    2. Otherwise the request goes to the next instance in the key's rendezvous order
       with fewer than ``ConcurrencyThreshold`` in flight (``overflow``). Walking the
       key's own order, rather than picking any idle instance, sends a hot key's
       overflow to the same second instance, whose cache then warms too — the
       bounded-load idea of Mirrokni et al., "Consistent Hashing with Bounded Loads",
       SODA 2018.
    3. If every candidate is at the threshold, the least outstanding one
       (``all_busy``); the engine queues the request rather than the router refusing it.

    The rendezvous orders of recent keys are remembered for the current candidates
    (:meth:`order`): a repeated key is routed without scoring every instance again.
    """

    name = RoutingStrategy.PREFIX_AWARE

    def __init__(self, config: RoutingConfig, rng: random.Random) -> None:
        super().__init__(config, rng)
        assert config.prefix_aware is not None  # guaranteed by RoutingConfig validation
        self.threshold = config.prefix_aware.concurrency_threshold
        # key -> the start of its rendezvous order among _orders_src (best index, or all).
        self._orders: OrderedDict[int, tuple[int, ...]] = OrderedDict()
        self._orders_src: Sequence[InstanceState] | None = None

    def order(self, key: int, candidates: Sequence[InstanceState], full: bool = False) -> tuple[int, ...]:
        """The start of ``key``'s rendezvous order among ``candidates`` (indices, best
        first): the best one (:func:`prefixroute.core.hashing.rendezvous_best`), or all of
        them with ``full`` (:func:`prefixroute.core.hashing.rendezvous_order`).

        For the pool's candidate tuple (the same object until membership or health
        changes) the answer is remembered per key, for the :data:`ORDER_CACHE_SIZE` keys
        used last, and forgotten as soon as another tuple comes. The order depends only
        on the key and the candidates' tokens, so a remembered one is what recomputing
        would give; a hot key then costs a dict look-up instead of one xxh3 call per
        candidate (about 5 µs for 64)."""
        tokens = self.tokens(candidates)
        if type(candidates) is not tuple:  # a one-off list (exclusions): nothing to keep
            return tuple(rendezvous_order(key, tokens)) if full else (rendezvous_best(key, tokens),)
        orders = self._orders
        if candidates is not self._orders_src:
            orders.clear()
            self._orders_src = candidates
        known = orders.get(key)
        if known is not None and (not full or len(known) == len(tokens)):
            orders.move_to_end(key)
            return known
        known = orders[key] = tuple(rendezvous_order(key, tokens)) if full else (rendezvous_best(key, tokens),)
        orders.move_to_end(key)
        if len(orders) > ORDER_CACHE_SIZE:
            orders.popitem(last=False)
        return known

    def choose(
        self, key: int | None, candidates: Sequence[InstanceState], blocks: Sequence[int] = ()
    ) -> tuple[InstanceState, DecisionKind]:
        if key is None:
            return least_outstanding(candidates, self.rng), DecisionKind.FALLBACK
        threshold = self.threshold
        best = candidates[self.order(key, candidates)[0]]
        if best.in_flight < threshold:
            return best, DecisionKind.AFFINITY
        for i in islice(self.order(key, candidates, full=True), 1, None):
            if candidates[i].in_flight < threshold:
                return candidates[i], DecisionKind.OVERFLOW
        return least_outstanding(candidates, self.rng), DecisionKind.ALL_BUSY

