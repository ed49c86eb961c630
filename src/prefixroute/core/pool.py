"""A production variant's instances, their in-flight counts, and routing decisions.

Sans-I/O and single-threaded: a driver (HTTP router, simulator) calls
:meth:`VariantPool.acquire` when it sends a request and :meth:`Lease.release` when the
request ends on any path (success, error, client abort, timeout, cancellation).
``Lease`` is a context manager and its release is idempotent, so a driver can put it
in a ``finally`` without bookkeeping.

Counts are plain integers on each :class:`InstanceState` by default. A driver running
several router processes passes ``make_state`` (e.g.
:meth:`prefixroute.core.counters.InFlightTable.states`) so that every process sees the
requests in flight of all of them.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

from prefixroute.core.config import RoutingConfig, RoutingStrategy
from prefixroute.core.hashing import rendezvous_order
from prefixroute.core.sessions import SessionPin, instance_tag
from prefixroute.core.strategies import DecisionKind, InstanceState, Strategy, least_outstanding, make_strategy

# The strategies in their own modules register themselves (strategies.register) on import.
import prefixroute.core.cache_aware  # noqa: E402,F401,I001
import prefixroute.core.llmd_reference  # noqa: E402,F401,I001

__all__ = ["NoHealthyInstance", "SetSaturated", "Decision", "Lease", "VariantPool"]


class NoHealthyInstance(RuntimeError):
    """No instance of the variant can take the request (the HTTP drivers answer 503)."""


class SetSaturated(RuntimeError):
    """Every candidate is at ``ConcurrencyThreshold`` and the caller asked not to
    overload one (``refuse_all_busy``: a LoRA adapter's sticky set; the HTTP drivers
    answer 429 with ``Retry-After``, or load the adapter elsewhere)."""


@dataclass(slots=True)
class Decision:
    """Where one request goes and why.

    Attributes:
        instance: the chosen instance.
        kind: affinity, overflow, all_busy, fallback, random or least_outstanding.
        strategy: the strategy that decided.
        variant: the production variant's name.
        decision_s: time the decision took, in seconds (``time.perf_counter``).
        prefill_units: units of the request's routing text the strategy estimated the
            instance must prefill (:attr:`prefixroute.core.strategies.Strategy.uncached_units`;
            0 for strategies without a view of the caches).
    """

    instance: InstanceState
    kind: DecisionKind
    strategy: RoutingStrategy
    variant: str
    decision_s: float
    prefill_units: int = 0


class Lease:
    """One request's claim on an instance's in-flight count (and its share of the
    instance's pending prefill); release exactly once."""

    __slots__ = ("decision", "_released", "_prefill", "_awaiting", "_attached")

    def __init__(self, decision: Decision) -> None:
        self.decision = decision
        self._released = False
        self._prefill = decision.prefill_units
        self._awaiting = True  # counted in the instance's awaiting_first_token until its first token
        self._attached: Any = None

    def attach(self, claim: Any) -> None:
        """Release ``claim`` (anything with ``release()``, e.g. a
        :class:`prefixroute.core.adapters.AdapterUse`) together with this lease."""
        self._attached = claim

    @property
    def instance(self) -> InstanceState:
        return self.decision.instance

    @property
    def released(self) -> bool:
        return self._released

    def first_token(self) -> None:
        """The request's first token (or first response byte) came back: its prefill is
        done, so its units leave the instance's ``pending_prefill``. Idempotent, and
        implied by :meth:`release`."""
        if self._prefill:
            self.decision.instance.pending_prefill -= self._prefill
            self._prefill = 0
        if self._awaiting:
            self._awaiting = False
            self.decision.instance.awaiting_first_token -= 1

    def release(self) -> None:
        """Return the in-flight slot (and the pending prefill, if the first token never
        came). Idempotent: later calls do nothing."""
        if not self._released:
            self._released = True
            if self._prefill:
                self.decision.instance.pending_prefill -= self._prefill
                self._prefill = 0
            if self._awaiting:
                self._awaiting = False
                self.decision.instance.awaiting_first_token -= 1
            self.decision.instance.add_in_flight(-1)
            if self._attached is not None:
                self._attached.release()

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
        make_state: makes the state of an instance from its id; default
            :class:`InstanceState` (counts local to this process).
        view_budget: a router-wide memory ceiling for what strategies learn
            (:class:`prefixroute.core.approx_cache.ViewBudget`), shared by every pool of
            the router; ``None``: each view only has its own bound.
        component: the inference component whose copies the pool holds, or ``None``
            for a production variant's own pool. ``name`` is then the variant the
            component lives on (what ``X-Amzn-Invoked-Production-Variant`` names).

    Raises:
        ValueError: duplicate instance ids.
        prefixroute.core.counters.InFlightTableFull: ``make_state`` found no free
            shared slot.
    """

    def __init__(
        self,
        name: str,
        instance_ids: Iterable[str],
        routing: RoutingConfig,
        seed: int | None = None,
        make_state: Callable[[str], InstanceState] = InstanceState,
        view_budget: Any = None,
        component: str | None = None,
    ) -> None:
        self.name = name
        self.component = component
        #: Changes whenever the membership does (callers cache what they derive from it).
        self.membership_version = 0
        # Healthy candidates restricted to a subset (a model's instances, an adapter's
        # sticky set), kept while membership and health do not change.
        self._subsets: dict[frozenset[str], tuple[InstanceState, ...]] = {}
        self._view_budget = view_budget
        self._make_state = make_state
        self._rng = random.Random(seed)
        self._instances: list[InstanceState] = []
        self._by_id: dict[str, InstanceState] = {}
        # Removed instances that still have requests in flight: if one is added back
        # before they finish, its count must include them.
        self._retired: dict[str, InstanceState] = {}
        # The healthy instances as one tuple, rebuilt only when membership or health
        # changes: strategies may cache what they derive from it (by identity).
        self._healthy: tuple[InstanceState, ...] | None = None
        self._routing = routing
        self._strategy: Strategy = make_strategy(routing, self._rng)
        self._strategy.attach_budget(view_budget)
        self._closed = False
        self.set_instances(instance_ids)

    # -- configuration ------------------------------------------------------------

    @property
    def routing(self) -> RoutingConfig:
        return self._routing

    @property
    def slot_scope(self) -> str:
        """The scope of its instances' shared in-flight slots (``serve --workers N``):
        the variant's name, or ``variant NUL component`` for a component's copies."""
        return self.name if self.component is None else f"{self.name}\0{self.component}"

    @property
    def describe(self) -> str:
        """``production variant 'V'`` or ``inference component 'C'``, for messages."""
        return f"production variant {self.name!r}" if self.component is None else \
            f"inference component {self.component!r}"

    @property
    def strategy(self) -> Strategy:
        return self._strategy

    def set_routing(self, routing: RoutingConfig) -> None:
        """Switch strategy or settings; in-flight counts and leases are unaffected.

        The same configuration again (a reload or a membership change that leaves the
        variant's routing as it was) keeps the strategy and what it learned, as does a
        change the strategy can take in place (:meth:`Strategy.reconfigure`, e.g. a
        ``CACHE_AWARE`` threshold); any other change starts a new strategy."""
        if routing == self._routing:
            return
        if self._strategy.name is routing.strategy and self._strategy.reconfigure(routing):
            self._routing = routing
            return
        self._strategy.attach_budget(None)  # its views leave the router-wide budget
        self._strategy = make_strategy(routing, self._rng)
        self._strategy.attach_budget(self._view_budget)
        self._routing = routing
        self._strategy.on_membership_change(self._instances)

    @property
    def instances(self) -> Sequence[InstanceState]:
        return tuple(self._instances)

    def get(self, instance_id: str) -> InstanceState | None:
        return self._by_id.get(instance_id)

    @property
    def retired_ids(self) -> tuple[str, ...]:
        """Removed instances whose state is kept because requests were in flight on
        them at the last membership change (added back, they count those requests)."""
        return tuple(self._retired)

    def prune_retired(self) -> None:
        """Forget the removed instances whose requests have all finished since."""
        self._retired = {i: s for i, s in self._retired.items() if s.in_flight > 0}

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """The variant was removed from the configuration: no decision is made on it
        any more (:meth:`choose` raises), so a request still on it that retries does not
        claim one of its instances again (with ``--workers N`` their shared slots may
        count another instance by then). Leases already taken still release. What its
        strategy learned leaves the router-wide memory budget."""
        self._closed = True
        self._strategy.attach_budget(None)

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
        self._instances = [known.get(i) or self._make_state(i) for i in ids]
        self._by_id = {s.instance_id: s for s in self._instances}
        self._retired = {i: s for i, s in known.items() if i not in self._by_id and s.in_flight > 0}
        self._healthy = None
        self._subsets.clear()
        self.membership_version += 1
        self._strategy.on_membership_change(self._instances)

    @property
    def has_healthy(self) -> bool:
        """Whether at least one instance is in rotation (a variant without one gets no
        share of untargeted traffic: :meth:`prefixroute.core.endpoint.Endpoint.variant`)."""
        healthy = self._healthy
        if healthy is None:
            healthy = self._healthy = tuple(s for s in self._instances if s.healthy)
        return bool(healthy)

    def set_healthy(self, instance_id: str, healthy: bool) -> None:
        """Take an instance out of rotation (``False``) or put it back (``True``)."""
        inst = self._by_id.get(instance_id)
        if inst is not None and inst.healthy != healthy:
            inst.healthy = healthy
            self._healthy = None
            self._subsets.clear()

    def forget_cache(self, instance_id: str) -> bool:
        """The instance's engine lost its prefix cache (it restarted on the same URL):
        the strategy forgets what it learned about that cache (``CACHE_AWARE`` empties
        its view of the instance; the other strategies keep no such state). In-flight
        counts and health are unchanged.

        Returns:
            ``True`` if the instance is a member of this pool (and was told about),
            ``False`` otherwise.
        """
        inst = self._by_id.get(instance_id)
        if inst is None:
            return False
        self._strategy.on_cache_lost(inst)
        return True

    # -- decisions ----------------------------------------------------------------

    def choose(
        self, key: int | None, exclude: frozenset[str] | set[str] = frozenset(), blocks: Sequence[int] = (),
        session: SessionPin | None = None, only: frozenset[str] | None = None, refuse_all_busy: bool = False,
    ) -> Decision:
        """Decide without claiming anything (for dry runs and tests).

        Args:
            key: the routing key (``PREFIX_AWARE``), or ``None``.
            exclude: instance ids not to use (e.g. one that just refused a connection).
            blocks: chained block hashes (``CACHE_AWARE``), or empty.
            session: the request's session (:mod:`prefixroute.core.sessions`): it goes
                to the session's instance, whatever the strategy, while that one is
                healthy and below the threshold, else along the session's rendezvous
                order (``overflow``; ``all_busy`` when every one is at the threshold).
            only: the instance ids the request may go to (the instances serving its
                model, an adapter's sticky set: :mod:`prefixroute.core.selection`), or
                ``None`` for all. The strategy then chooses among those only.
            refuse_all_busy: raise :class:`SetSaturated` rather than decide ``all_busy``
                when every candidate is at ``ConcurrencyThreshold``.

        Raises:
            NoHealthyInstance: no healthy, non-excluded instance (among ``only``), or
                the pool is :meth:`closed`.
            SetSaturated: ``refuse_all_busy`` and every candidate at the threshold.
        """
        t0 = time.perf_counter()
        if self._closed:
            raise NoHealthyInstance(f"{self.describe} was removed from the configuration")
        candidates = self._candidates(exclude, only)
        if not candidates:
            if only is not None:
                raise NoHealthyInstance(f"{self.describe} has no healthy instance serving the requested model")
            raise NoHealthyInstance(f"{self.describe} has no healthy instance" if self.component is None
                                    else f"{self.describe} has no healthy copy")
        if refuse_all_busy:
            threshold = self._routing.concurrency_threshold
            if threshold is not None and all(c.in_flight >= threshold for c in candidates):
                raise SetSaturated(f"every one of the {len(candidates)} instance(s) serving the requested model in "
                                   f"{self.describe} is at its ConcurrencyThreshold ({threshold})")
        strategy = self._strategy
        if session is not None:
            inst, kind = self._session_choice(session, candidates)
            return Decision(inst, kind, self._routing.strategy, self.name, time.perf_counter() - t0)
        inst, kind = strategy.choose(key, candidates, blocks)
        return Decision(inst, kind, self._routing.strategy, self.name, time.perf_counter() - t0,
                        strategy.uncached_units)

    def _candidates(self, exclude: frozenset[str] | set[str], only: frozenset[str] | None
                    ) -> Sequence[InstanceState]:
        """The healthy instances, without ``exclude``, within ``only``: the same tuple
        while membership and health do not change (strategies cache by identity)."""
        if exclude:
            return [s for s in self._instances if s.healthy and s.instance_id not in exclude
                    and (only is None or s.instance_id in only)]
        healthy = self._healthy
        if healthy is None:
            healthy = self._healthy = tuple(s for s in self._instances if s.healthy)
        if only is None:
            return healthy
        subset = self._subsets.get(only)
        if subset is None:
            if len(self._subsets) > 256:
                self._subsets.clear()
            subset = self._subsets[only] = tuple(s for s in healthy if s.instance_id in only)
        return subset

    def _session_choice(self, session: SessionPin, candidates: Sequence[InstanceState]
                        ) -> tuple[InstanceState, DecisionKind]:
        order = rendezvous_order(session.key, [c.token for c in candidates])
        if session.tag is not None:  # an id the router pinned: its instance first, if still a candidate
            pinned = next((i for i, c in enumerate(candidates) if instance_tag(c.instance_id) == session.tag), None)
            if pinned is not None:
                order.remove(pinned)
                order.insert(0, pinned)
        threshold = self._routing.concurrency_threshold
        for rank, i in enumerate(order):
            if threshold is None or candidates[i].in_flight < threshold:
                return candidates[i], DecisionKind.SESSION if rank == 0 else DecisionKind.OVERFLOW
        return least_outstanding(candidates, self._rng), DecisionKind.ALL_BUSY

    def acquire(
        self, key: int | None, exclude: frozenset[str] | set[str] = frozenset(), blocks: Sequence[int] = (),
        learn: bool = True, session: SessionPin | None = None, only: frozenset[str] | None = None,
        refuse_all_busy: bool = False,
    ) -> Lease:
        """Decide, tell the strategy, and claim one in-flight slot on the chosen instance.

        Args:
            learn: tell the strategy now (``on_routed``). A driver that wants the
                learning off the request's latency path passes ``False`` and calls
                :meth:`learn` once the request is on its way, but before it decides
                another request (else that decision does not see this one:
                :func:`prefixroute.server.attempt.learn_route`).
            session, only, refuse_all_busy: as :meth:`choose`.

        Raises:
            NoHealthyInstance: no healthy, non-excluded instance.
            SetSaturated: as :meth:`choose`.
        """
        decision = self.choose(key, exclude, blocks, session, only, refuse_all_busy)
        if learn:
            self._strategy.on_routed(decision.instance, blocks)
        inst = decision.instance
        inst.add_in_flight(1)
        inst.served += 1
        inst.pending_prefill += decision.prefill_units
        inst.awaiting_first_token += 1
        return Lease(decision)

    def learn(self, instance: InstanceState, blocks: Sequence[int]) -> None:
        """Tell the strategy a request with ``blocks`` went to ``instance`` (what
        :meth:`acquire` does unless ``learn=False``). CACHE_AWARE records the blocks in
        its view of the instance's cache; the other strategies ignore it."""
        if blocks:
            self._strategy.on_routed(instance, blocks)

    def total_in_flight(self) -> int:
        return sum(s.in_flight for s in self._instances)
