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
from dataclasses import dataclass, field
from typing import ClassVar, Sequence

from prefixroute.core.config import RoutingConfig, RoutingStrategy
from prefixroute.core.hashing import instance_token, rendezvous_order, rendezvous_score

__all__ = [
    "DecisionKind",
    "InstanceState",
    "Strategy",
    "RandomStrategy",
    "LeastOutstandingStrategy",
    "PrefixAwareStrategy",
    "STRATEGIES",
    "register",
    "make_strategy",
]


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


@dataclass(eq=False, slots=True)
class InstanceState:
    """One engine instance as the router sees it.

    Attributes:
        instance_id: stable identity, normally the base URL (``http://host:port``).
            Rendezvous scores are computed from it, so it must not change across
            restarts of the router.
        in_flight: requests sent and not yet finished (streams count until their end).
        healthy: whether it takes new requests.
        served: requests ever routed to it (for instance share).
        engine_load: requests the engine itself reports running plus waiting (scraped
            from its ``/metrics``; 0 when unknown). Includes other router replicas' load.
    """

    instance_id: str
    in_flight: int = 0
    healthy: bool = True
    served: int = 0
    engine_load: int = 0
    token: bytes = field(default=b"", repr=False)

    def __post_init__(self) -> None:
        if not self.token:
            self.token = instance_token(self.instance_id)


class Strategy(ABC):
    """A routing policy. Subclasses set ``name`` and implement :meth:`choose`."""

    name: ClassVar[RoutingStrategy]

    def __init__(self, config: RoutingConfig, rng: random.Random) -> None:
        self.config = config
        self.rng = rng

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

    def stats(self) -> dict[str, float]:
        """Gauges worth exporting (e.g. memory of learned state); empty by default."""
        return {}


STRATEGIES: dict[RoutingStrategy, type[Strategy]] = {}


def register(cls: type[Strategy]) -> type[Strategy]:
    """Class decorator: make ``cls`` available under ``cls.name``."""
    STRATEGIES[cls.name] = cls
    return cls


def make_strategy(config: RoutingConfig, rng: random.Random) -> Strategy:
    """Instantiate the registered strategy named by ``config.strategy``."""
    return STRATEGIES[config.strategy](config, rng)


def least_outstanding(candidates: Sequence[InstanceState], rng: random.Random) -> InstanceState:
    """The candidate with the fewest in flight; ties broken uniformly at random."""
    low = min(c.in_flight for c in candidates)
    tied = [c for c in candidates if c.in_flight == low]
    return tied[0] if len(tied) == 1 else rng.choice(tied)


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
    """

    name = RoutingStrategy.PREFIX_AWARE

    def __init__(self, config: RoutingConfig, rng: random.Random) -> None:
        super().__init__(config, rng)
        assert config.prefix_aware is not None  # guaranteed by RoutingConfig validation
        self.threshold = config.prefix_aware.concurrency_threshold

    def choose(
        self, key: int | None, candidates: Sequence[InstanceState], blocks: Sequence[int] = ()
    ) -> tuple[InstanceState, DecisionKind]:
        if key is None:
            return least_outstanding(candidates, self.rng), DecisionKind.FALLBACK
        threshold = self.threshold
        best = candidates[0]
        best_score = rendezvous_score(key, best.token)
        for c in candidates[1:]:
            s = rendezvous_score(key, c.token)
            if s > best_score:
                best, best_score = c, s
        if best.in_flight < threshold:
            return best, DecisionKind.AFFINITY
        for i in rendezvous_order(key, [c.token for c in candidates])[1:]:
            if candidates[i].in_flight < threshold:
                return candidates[i], DecisionKind.OVERFLOW
        return least_outstanding(candidates, self.rng), DecisionKind.ALL_BUSY


# Strategies in their own modules register themselves on import.
from prefixroute.core import cache_aware as _cache_aware  # noqa: E402,F401
