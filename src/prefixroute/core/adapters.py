"""LoRA adapters' sticky sets: requests in flight per (instance, adapter), and where to
load an adapter so that its set grows.

Sans-I/O. An adapter's *sticky set* is the instances that have it loaded
(:class:`prefixroute.core.catalog.ModelCatalog`); requests for it are routed only among
them (:mod:`prefixroute.core.selection`). This module keeps what the router needs to
change a set safely:

* :class:`AdapterTracker` counts, per (instance, adapter), the requests the router has
  in flight (:meth:`AdapterTracker.use`, released with the request's lease), remembers
  the order adapters were last used in (a logical clock: no wall time in the core), and
  the loads under way (one per adapter at a time);
* :func:`plan_load` picks the instance to load an adapter on when its set is saturated
  or empty: the least loaded instance of the adapter's base model that does not have
  it, with a free adapter slot or else an idle adapter to unload first (the least
  recently used one with nothing in flight).

An adapter is never unloaded while this router has a request in flight for it there,
and it leaves the sticky set (:meth:`~prefixroute.core.catalog.ModelCatalog.adapter_unloading`)
before the unload is sent, so no request reaches an instance for an adapter it has
just dropped.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import xxhash

from prefixroute.core.catalog import ModelCatalog
from prefixroute.core.hashing import rendezvous_order
from prefixroute.core.strategies import InstanceState

__all__ = ["AdapterUse", "AdapterTracker", "LoadPlan", "plan_load", "hash_name"]


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
    """Requests in flight per (instance, adapter), last use, and loads under way."""

    def __init__(self) -> None:
        self._in_flight: dict[tuple[str, str], int] = {}
        self._last_used: dict[tuple[str, str], int] = {}
        self._tick = 0
        #: adapter -> the instance a load of it is under way on.
        self.loading: dict[str, str] = {}
        #: (instance, adapter) pairs being unloaded now.
        self.unloading: set[tuple[str, str]] = set()

    def use(self, instance_id: str, adapter: str) -> AdapterUse:
        """A request for ``adapter`` was sent to ``instance_id``."""
        slot = (instance_id, adapter)
        self._in_flight[slot] = self._in_flight.get(slot, 0) + 1
        self._tick += 1
        self._last_used[slot] = self._tick
        return AdapterUse(self, slot)

    def _leave(self, slot: tuple[str, str]) -> None:
        n = self._in_flight.get(slot, 0) - 1
        if n > 0:
            self._in_flight[slot] = n
        else:
            self._in_flight.pop(slot, None)

    def in_flight(self, instance_id: str, adapter: str) -> int:
        """Requests this router has in flight for ``adapter`` on ``instance_id``."""
        return self._in_flight.get((instance_id, adapter), 0)

    def last_used(self, instance_id: str, adapter: str) -> int:
        """When ``adapter`` was last used on ``instance_id`` (logical clock; 0: never)."""
        return self._last_used.get((instance_id, adapter), 0)

    def forget(self, instance_id: str, adapter: str) -> None:
        """``adapter`` is no longer on ``instance_id`` (its last-use mark goes)."""
        self._last_used.pop((instance_id, adapter), None)


def plan_load(adapter: str, path: str, parent: str | None, candidates: Sequence[InstanceState],
              catalog: ModelCatalog, tracker: AdapterTracker, default_slots: int | None = None,
              evictable: Callable[[str], bool] = lambda name: True, evict_last_copy: bool = True) -> LoadPlan | None:
    """Where to load ``adapter`` so that its sticky set grows, or ``None`` if nowhere.

    Args:
        adapter: the adapter's name.
        path: where the engine reads it (``lora_path``).
        parent: its base model; ``None`` = any instance's first base model.
        candidates: the healthy instances of the pool (variant or inference component).
        catalog: what each instance serves now.
        tracker: requests in flight per adapter, loads under way.
        default_slots: adapter slots of an instance whose engine reports none
            (``MaxAdaptersPerInstance``); ``None``: unbounded.
        evictable: whether an adapter may be unloaded to make room (the router must
            be able to load it again: its path known).
        evict_last_copy: whether an adapter loaded on no other instance may be
            unloaded. ``False`` to grow a saturated set (which can otherwise queue
            within itself): making room by emptying another adapter's set would only
            move the load to that adapter's next request, and loads would chase each
            other round the fleet. ``True`` to place an adapter loaded nowhere.

    Rule: an eligible instance serves ``parent`` as a base model, does not have the
    adapter, has no load or unload under way, and has a free slot (fewer adapters than
    its slots) or an evictable adapter with no request in flight from this router (the
    least recently used one is unloaded; adapters with other copies first). Among them,
    the fewest requests in flight wins; a free slot beats an eviction at equal load;
    remaining ties are broken by the adapter's rendezvous order over the instances, so
    router replicas agree.
    """
    if adapter in tracker.loading:
        return None
    busy = {i for i, _ in tracker.unloading} | set(tracker.loading.values())
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
            idle = [a for a in served.adapters if tracker.in_flight(iid, a) == 0 and evictable(a)
                    and (evict_last_copy or len(catalog.serving(a)) > 1)]
            if not idle:
                continue
            # another copy elsewhere first (its set shrinks, it is not emptied), then least recently used
            evict = min(idle, key=lambda a: (len(catalog.serving(a)) <= 1, tracker.last_used(iid, a), a))
        options.append((inst.in_flight, evict is not None, order[pos], inst, evict, base))
    if not options:
        return None
    _, _, _, inst, evict, base = min(options, key=lambda o: o[:3])
    return LoadPlan(inst.instance_id, adapter, path, base, evict)


def hash_name(name: str) -> int:
    """A 64-bit rendezvous key of an adapter's name (stable across processes)."""
    return xxhash.xxh3_64_intdigest(name.encode("utf-8", "surrogatepass"), 0x6C6F7261)  # "lora"
