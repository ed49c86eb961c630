"""A production variant's instances, their in-flight counts, and routing decisions.

Sans-I/O and single-threaded: a driver (HTTP router, simulator) calls
:meth:`VariantPool.acquire` when it sends a request and :meth:`Lease.release` when the
request ends on any path (success, error, client abort, timeout, cancellation).
``Lease`` is a context manager and its release is idempotent, so a driver can put it
in a ``finally`` without bookkeeping.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass
from typing import Iterable, Sequence

from prefixroute.core.config import RoutingConfig, RoutingStrategy
from prefixroute.core.strategies import DecisionKind, InstanceState, Strategy, make_strategy

__all__ = ["NoHealthyInstance", "Decision", "Lease", "VariantPool"]


class NoHealthyInstance(RuntimeError):
    """No instance of the variant can take the request (the HTTP drivers answer 503)."""


@dataclass(frozen=True, slots=True)
class Decision:
    """Where one request goes and why.

    Attributes:
        instance: the chosen instance.
        kind: affinity, overflow, all_busy, fallback, random or least_outstanding.
        strategy: the strategy that decided.
        variant: the production variant's name.
        decision_s: time the decision took, in seconds (``time.perf_counter``).
    """

    instance: InstanceState
    kind: DecisionKind
    strategy: RoutingStrategy
    variant: str
    decision_s: float


class Lease:
    """One request's claim on an instance's in-flight count; release exactly once."""

    __slots__ = ("decision", "_released")

    def __init__(self, decision: Decision) -> None:
        self.decision = decision
        self._released = False

    @property
    def instance(self) -> InstanceState:
        return self.decision.instance

    @property
    def released(self) -> bool:
        return self._released

    def release(self) -> None:
        """Return the in-flight slot. Idempotent: later calls do nothing."""
        if not self._released:
            self._released = True
            self.decision.instance.in_flight -= 1

    def __enter__(self) -> "Lease":
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class VariantPool:
    """The instances of one production variant and its current routing strategy.

    Args:
        name: the production variant's name.
        instance_ids: instance identities (base URLs), in any order; duplicates rejected.
        routing: the validated routing configuration.
        seed: seed of the random choices (RANDOM, tie breaks); ``None`` = from the OS.

    Raises:
        ValueError: duplicate instance ids.
    """

    def __init__(
        self,
        name: str,
        instance_ids: Iterable[str],
        routing: RoutingConfig,
        seed: int | None = None,
    ) -> None:
        self.name = name
        self._rng = random.Random(seed)
        self._instances: list[InstanceState] = []
        self._by_id: dict[str, InstanceState] = {}
        # Removed instances that still have requests in flight: if one is added back
        # before they finish, its count must include them.
        self._retired: dict[str, InstanceState] = {}
        self._routing = routing
        self._strategy: Strategy = make_strategy(routing, self._rng)
        self.set_instances(instance_ids)

    # -- configuration ------------------------------------------------------------

    @property
    def routing(self) -> RoutingConfig:
        return self._routing

    @property
    def strategy(self) -> Strategy:
        return self._strategy

    def set_routing(self, routing: RoutingConfig) -> None:
        """Switch strategy or settings; in-flight counts and leases are unaffected."""
        self._strategy = make_strategy(routing, self._rng)
        self._routing = routing
        self._strategy.on_membership_change(self._instances)

    @property
    def instances(self) -> Sequence[InstanceState]:
        return tuple(self._instances)

    def get(self, instance_id: str) -> InstanceState | None:
        return self._by_id.get(instance_id)

    def set_instances(self, instance_ids: Iterable[str]) -> None:
        """Replace the membership. Instances kept keep their state; removed ones stop
        receiving requests, and leases already on them still release correctly.

        Raises:
            ValueError: duplicate instance ids.
        """
        ids = list(instance_ids)
        if len(set(ids)) != len(ids):
            raise ValueError(f"variant {self.name!r}: duplicate instance ids in {ids}")
        known = {**self._retired, **self._by_id}
        self._instances = [known.get(i) or InstanceState(i) for i in ids]
        self._by_id = {s.instance_id: s for s in self._instances}
        self._retired = {i: s for i, s in known.items() if i not in self._by_id and s.in_flight > 0}
        self._strategy.on_membership_change(self._instances)

    def set_healthy(self, instance_id: str, healthy: bool) -> None:
        """Take an instance out of rotation (``False``) or put it back (``True``)."""
        inst = self._by_id.get(instance_id)
        if inst is not None:
            inst.healthy = healthy

    # -- decisions ----------------------------------------------------------------

    def choose(
        self, key: int | None, exclude: frozenset[str] | set[str] = frozenset(), blocks: Sequence[int] = ()
    ) -> Decision:
        """Decide without claiming anything (for dry runs and tests).

        Args:
            key: the routing key (``PREFIX_AWARE``), or ``None``.
            exclude: instance ids not to use (e.g. one that just refused a connection).
            blocks: chained block hashes (``CACHE_AWARE``), or empty.

        Raises:
            NoHealthyInstance: no healthy, non-excluded instance.
        """
        t0 = time.perf_counter()
        if exclude:
            candidates = [s for s in self._instances if s.healthy and s.instance_id not in exclude]
        else:
            candidates = [s for s in self._instances if s.healthy]
        if not candidates:
            raise NoHealthyInstance(f"production variant {self.name!r} has no healthy instance")
        inst, kind = self._strategy.choose(key, candidates, blocks)
        return Decision(inst, kind, self._routing.strategy, self.name, time.perf_counter() - t0)

    def acquire(
        self, key: int | None, exclude: frozenset[str] | set[str] = frozenset(), blocks: Sequence[int] = ()
    ) -> Lease:
        """Decide, tell the strategy, and claim one in-flight slot on the chosen instance.

        Raises:
            NoHealthyInstance: no healthy, non-excluded instance.
        """
        decision = self.choose(key, exclude, blocks)
        self._strategy.on_routed(decision.instance, blocks)
        decision.instance.in_flight += 1
        decision.instance.served += 1
        return Lease(decision)

    def total_in_flight(self) -> int:
        return sum(s.in_flight for s in self._instances)
