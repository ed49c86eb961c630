"""LoRA adapters' sticky sets: requests in flight per (instance, adapter), and where to
load an adapter so that its set grows.

Sans-I/O. An adapter's *sticky set* is the instances that have it loaded
(:class:`prefixroute.core.catalog.ModelCatalog`); requests for it are routed only among
them (:mod:`prefixroute.core.selection`). This module keeps what the router needs to
change a set safely:

* :class:`AdapterTracker` counts, per (instance, adapter), the requests the router has
  in flight (:meth:`AdapterTracker.use`, released with the request's lease), remembers
  the order adapters were last used in (a logical clock) and when each copy last saw a
  request start or end (an injected monotonic clock, as
  :class:`~prefixroute.core.retry_status.RetryStatus` takes one), and the loads under
  way (one per adapter at a time);
* :func:`plan_load` picks the instance to load an adapter on when its set is saturated
  or empty: the least loaded instance of the adapter's base model that does not have
  it, with a free adapter slot or else a copy of another adapter that may be unloaded.

Which copy of another adapter may be unloaded to make room:

* never one with a request of this router in flight there;
* an *idle* copy: nothing in flight **and** no request for it there started or ended for
  ``idle_s`` seconds (``LoraAdapters.IdleSeconds``; by default ``LoadTimeoutSeconds``,
  60), for a saturated set as for an adapter loaded nowhere. "Nothing in flight at this
  instant" is not idleness: the hottest adapter of a busy fleet is between two of its
  requests every few milliseconds, and unloading its only copy then turned its next
  requests into 429s while the adapter that took the slot was a colder one. An unloaded
  last copy costs its adapter's next request one load, at most ``LoadTimeoutSeconds``:
  waiting at least that long without a request means that the wait an unload adds is
  never longer than the silence that allowed it. A copy the router has seen no request
  on counts from when the tracker started (a router that has just started does not take
  a hot adapter it has not seen yet for an idle one); a copy it loads counts as used
  when the load ends;
* a *spare* copy in use (its adapter is loaded on another healthy instance of the pool
  too; nothing in flight for it there, but not idle) only to place an adapter whose set
  is empty, whose request is refused otherwise: the spare's set shrinks but is not
  emptied, so its requests keep an instance that has it. A saturated set does not take
  one: its requests can queue within it, and shrinking another set in use only makes
  that one saturated, so that loads chase each other round the fleet (the full
  ``bench/multi_model.py`` run at 9aa9001, which allowed it, made 21 loads and 17
  unloads in 45 s, the
  waiting sets taking the slots before an adapter loaded nowhere could, which got 52
  answers 429);
* never the last copy of an adapter that is not idle.

Among the copies that may go: idle ones first (a spare before a last copy), then the least
recently used. When none may go anywhere, there is no plan: a saturated set queues within
itself, and a request for an adapter loaded nowhere gets the 429 with ``Retry-After``.

An adapter is never unloaded while this router has a request in flight for it there,
and it leaves the sticky set (:meth:`~prefixroute.core.catalog.ModelCatalog.adapter_unloading`)
before the unload is sent, so no request reaches an instance for an adapter it has
just dropped.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Sequence

import xxhash

from prefixroute.core.catalog import ModelCatalog
from prefixroute.core.hashing import rendezvous_order
from prefixroute.core.strategies import InstanceState

__all__ = ["AdapterUse", "AdapterTracker", "LoadPlan", "plan_load", "hash_name", "DEFAULT_IDLE_S"]

#: ``LoraAdapters.IdleSeconds`` when neither it nor ``LoadTimeoutSeconds`` is set (the
#: latter's default): how long an adapter's last copy must see no request to be unloaded.
DEFAULT_IDLE_S = 60.0


class AdapterUse:
    """One request's claim on (instance, adapter); :meth:`release` exactly once (idempotent)."""

    __slots__ = ("_tracker", "_slot", "_released")

    def __init__(self, tracker: "AdapterTracker", slot: tuple[str, str]) -> None:
        self._tracker = tracker
        self._slot = slot
        self._released = False

    def release(self) -> None:
        """The request ended (any path)."""
        if not self._released:
            self._released = True
            self._tracker._leave(self._slot)


@dataclass(frozen=True, slots=True)
class LoadPlan:
    """Load ``adapter`` (from ``path``) on ``instance_id``, unloading ``evict`` there first
    if it is not ``None``."""

    instance_id: str
    adapter: str
    path: str
    parent: str
    evict: str | None = None


class AdapterTracker:
    """Requests in flight per (instance, adapter), last use, and loads under way.

    Args:
        clock: monotonic seconds (``time.monotonic``; a test passes its own): when a
            copy last saw a request start or end, for :meth:`idle_for`.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._started = clock()
        self._in_flight: dict[tuple[str, str], int] = {}
        self._last_used: dict[tuple[str, str], int] = {}
        self._last_at: dict[tuple[str, str], float] = {}
        self._tick = 0
        #: adapter -> the instance a load of it is under way on.
        self.loading: dict[str, str] = {}
        #: (instance, adapter) pairs being unloaded now.
        self.unloading: set[tuple[str, str]] = set()

    def use(self, instance_id: str, adapter: str) -> AdapterUse:
        """A request for ``adapter`` was sent to ``instance_id``."""
        slot = (instance_id, adapter)
        self._in_flight[slot] = self._in_flight.get(slot, 0) + 1
        self._touch(slot)
        return AdapterUse(self, slot)

    def loaded(self, instance_id: str, adapter: str) -> None:
        """The router loaded ``adapter`` on ``instance_id``: it counts as used now (a copy
        just loaded for waiting requests is not idle)."""
        self._touch((instance_id, adapter))

    def _touch(self, slot: tuple[str, str]) -> None:
        self._tick += 1
        self._last_used[slot] = self._tick
        self._last_at[slot] = self._clock()

    def _leave(self, slot: tuple[str, str]) -> None:
        n = self._in_flight.get(slot, 0) - 1
        if n > 0:
            self._in_flight[slot] = n
        else:
            self._in_flight.pop(slot, None)
        self._last_at[slot] = self._clock()  # a long request ending is a use too

    def in_flight(self, instance_id: str, adapter: str) -> int:
        """Requests this router has in flight for ``adapter`` on ``instance_id``."""
        return self._in_flight.get((instance_id, adapter), 0)

    def last_used(self, instance_id: str, adapter: str) -> int:
        """When ``adapter`` was last used on ``instance_id`` (logical clock; 0: never)."""
        return self._last_used.get((instance_id, adapter), 0)

    def idle_for(self, instance_id: str, adapter: str) -> float:
        """Seconds since a request for ``adapter`` last started or ended on
        ``instance_id`` (or since the tracker started, if none has); 0 while one is in
        flight there."""
        slot = (instance_id, adapter)
        if self._in_flight.get(slot):
            return 0.0
        return max(0.0, self._clock() - self._last_at.get(slot, self._started))

    def forget(self, instance_id: str, adapter: str) -> None:
        """``adapter`` is no longer on ``instance_id`` (its last-use marks go)."""
        self._last_used.pop((instance_id, adapter), None)
        self._last_at.pop((instance_id, adapter), None)


def plan_load(adapter: str, path: str, parent: str | None, candidates: Sequence[InstanceState],
              catalog: ModelCatalog, tracker: AdapterTracker, default_slots: int | None = None,
              evictable: Callable[[str], bool] = lambda name: True, idle_s: float = DEFAULT_IDLE_S,
              empty: bool = True) -> LoadPlan | None:
    """Where to load ``adapter`` so that its sticky set grows, or ``None`` if nowhere.

    Args:
        adapter: the adapter's name.
        path: where the engine reads it (``lora_path``).
        parent: its base model; ``None`` = any instance's first base model.
        candidates: the healthy instances of the pool (variant or inference component).
        catalog: what each instance serves now.
        tracker: requests in flight per adapter, their last use, loads under way.
        default_slots: adapter slots of an instance whose engine reports none
            (``MaxAdaptersPerInstance``); ``None``: unbounded.
        evictable: whether an adapter may be unloaded to make room (the router must
            be able to load it back: its path known).
        idle_s: how long a copy must have seen no request to be idle
            (``LoraAdapters.IdleSeconds``).
        empty: ``True`` to place an adapter whose sticky set is empty (then a spare
            copy in use may be unloaded too); ``False`` to grow a saturated set (idle
            copies only).

    Rule: an eligible instance serves ``parent`` as a base model, does not have the
    adapter, has no load or unload under way, and has a free slot (fewer adapters than
    its slots) or a copy that may be unloaded (the module docstring's rule: nothing in
    flight from this router, and idle for ``idle_s``, or, with ``empty``, another
    healthy copy in the pool; idle first, a spare before a last copy, then the least
    recently used). Among them, the fewest requests in flight wins; a free slot beats
    an unload at equal load; remaining ties are broken by the adapter's rendezvous
    order over the instances, so router replicas agree.
    """
    if adapter in tracker.loading:
        return None
    busy = {i for i, _ in tracker.unloading} | set(tracker.loading.values())
    healthy = frozenset(c.instance_id for c in candidates)
    options: list[tuple[int, int, int, InstanceState, str | None, str]] = []
    order = {i: r for r, i in enumerate(rendezvous_order(hash_name(adapter), [c.token for c in candidates]))}
    for pos, inst in enumerate(candidates):
        iid = inst.instance_id
        served = catalog.get(iid)
        if served is None or iid in busy or adapter in served.adapters:
            continue
        base = parent if parent is not None else (served.base[0] if served.base else None)
        if base is None or base not in served.base:
            continue
        slots = catalog.slots(iid, default_slots)
        evict: str | None = None
        if slots is not None and len(served.adapters) >= slots:
            # name -> (not idle, its adapter's last healthy copy in the pool)
            rank = {a: (tracker.idle_for(iid, a) < idle_s, not ((catalog.serving(a) & healthy) - {iid}))
                    for a in served.adapters if tracker.in_flight(iid, a) == 0 and evictable(a)}
            may_go = [a for a, (busy_copy, last) in rank.items() if not busy_copy or (empty and not last)]
            if not may_go:
                continue
            # idle first, a spare copy before a last one (its set shrinks, it is not emptied), then the LRU
            evict = min(may_go, key=lambda a: (*rank[a], tracker.last_used(iid, a), a))
        options.append((inst.in_flight, evict is not None, order[pos], inst, evict, base))
    if not options:
        return None
    _, _, _, inst, evict, base = min(options, key=lambda o: o[:3])
    return LoadPlan(inst.instance_id, adapter, path, base, evict)


def hash_name(name: str) -> int:
    """A 64-bit rendezvous key of an adapter's name (stable across processes)."""
    return xxhash.xxh3_64_intdigest(name.encode("utf-8", "surrogatepass"), 0x6C6F7261)  # "lora"
