"""In-flight counts shared by several router processes (sans-I/O).

With ``prefixroute serve --workers N`` each worker process routes the requests of the
connections the kernel gave it, yet ``ConcurrencyThreshold`` and
``LEAST_OUTSTANDING_REQUESTS`` must see the requests in flight of every worker. The
counts live in one writable buffer that the server driver allocates as shared memory
(:mod:`prefixroute.server.workers`); this module only lays the buffer out, reads it and
writes it, so the routing core still never touches a socket, a process or a clock.

Layout (native-endian 64-bit integers)::

    header   8 words: magic, layout version, capacity, workers, slots used, 3 reserved
    keys     capacity x uint64: the key of each claimed slot, in claim order
    holders  capacity x uint64: per slot, the bitmask of the workers whose configuration
             (or a removed instance's requests still in flight) holds it
    counts   capacity x workers x int64: counts[slot * workers + worker]

A **slot** counts one (endpoint, production variant, instance): exactly what one
:class:`InstanceState` counts in a single process. It is found by the xxh3-64 of the
three names, so every worker maps an instance to the same slot whatever the order in
which configuration changes reach it, and an instance removed and added back finds its
slot (and any requests still in flight on it) again. Slots are claimed under a lock and
only when the membership changes (:meth:`InFlightTable.reserve`), and each worker marks
the slots it holds in the slot's ``holders`` bitmask; after a change a worker lets go of
the slots its configuration no longer names (:meth:`InFlightTable.retain`). A slot no
worker holds and with no request in flight is taken over by the next new key once the
never-used slots are gone, so an instance that leaves for good frees its slot. The table
holds :data:`DEFAULT_CAPACITY` slots at a time; a configuration that needs more than
the free ones raises :class:`InFlightTableFull`.

Each worker writes only its own column, so the request path takes no lock; a strategy
reads the sum over the workers. Every worker decides and counts its request in one
synchronous step, so at most ``workers - 1`` decisions of the other workers can be based
on a count that is one request stale: a count exceeds ``ConcurrencyThreshold`` by at
most ``workers - 1``. A worker that dies takes its requests with it; the driver then
zeroes its column (:meth:`InFlightTable.zero_worker`) before a replacement starts.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterable, Iterator

import xxhash

from prefixroute.core.config import ConfigError, FleetConfig
from prefixroute.core.strategies import InstanceState

__all__ = [
    "DEFAULT_CAPACITY",
    "MAX_WORKERS",
    "InFlightTableFull",
    "InFlightTableLocked",
    "LOCK_TIMEOUT_S",
    "InFlightTable",
    "SharedInstanceState",
    "slot_key",
    "config_slot_keys",
]

#: Slots of a table unless told otherwise: distinct (endpoint, variant, instance) triples.
DEFAULT_CAPACITY = 4096
#: Most worker processes a table can have a column for.
MAX_WORKERS = 64

_MAGIC = 0x6C666E6978667270  # b"prfxinfl" read as a little-endian int64
_VERSION = 2  # 2: a holders bitmask per slot; slots are reused
_HEADER_WORDS = 8
_HEADER_BYTES = _HEADER_WORDS * 8
_H_MAGIC, _H_VERSION, _H_CAPACITY, _H_WORKERS, _H_USED = range(5)


#: Longest wait for the table's lock (seconds): it is held for a few milliseconds at most
#: (claiming thousands of slots), so a longer wait means something is wrong.
LOCK_TIMEOUT_S = 5.0


class InFlightTableLocked(ConfigError):
    """The shared table's lock stayed taken for :data:`LOCK_TIMEOUT_S`: nothing was
    claimed or let go of."""


class InFlightTableFull(ConfigError):
    """The configuration names more new (endpoint, variant, instance) triples than the
    shared in-flight table has free slots (never used, or held by no worker with nothing
    in flight); the running configuration is kept."""


def slot_key(endpoint: str, variant: str, instance_id: str) -> int:
    """The 64-bit key of one (endpoint, variant, instance) slot; never 0."""
    text = f"{endpoint}\x00{variant}\x00{instance_id}".encode("utf-8", "surrogatepass")
    return xxhash.xxh3_64_intdigest(text) or 1


def config_slot_keys(config: FleetConfig) -> list[int]:
    """The slot keys of every (endpoint, variant, instance) of ``config``, and of every
    inference component's possible copies (scope ``variant NUL component``: its listed
    instances, or all its variant's for ``Instances: DISCOVER``)."""
    keys = [slot_key(e.name, v.name, i) for e in config.endpoints for v in e.variants for i in v.instances]
    for e in config.endpoints:
        for c in e.components:
            variant = e.component_variant(c)
            ids = variant.instances if c.discover else c.instances
            keys += [slot_key(e.name, f"{variant.name}\0{c.name}", i) for i in ids]
    return keys


class InFlightTable:
    """One worker's view of the shared in-flight table.

    Args:
        buf: the table's memory (a writable buffer already laid out by
            :meth:`initialize`, e.g. ``SharedMemory.buf``).
        worker: this process's column, ``0 <= worker < workers``; a supervisor that
            only reads and zeroes columns may pass any valid column.
        lock: held while slots are claimed or let go, shared by every process using
            the table: an object with ``acquire(timeout=seconds) -> bool`` and
            ``release()``, best one that the kernel frees when its holder dies
            (:class:`prefixroute.server.shared_counters.FileLock`; a ``multiprocessing.Lock``
            stays taken then). ``None`` for a table used by one process only.

    Raises:
        ValueError: the buffer is not a table, is too small, or ``worker`` is out of range.
    """

    def __init__(self, buf: Any, worker: int, lock: Any = None) -> None:
        mv = memoryview(buf)
        if mv.format != "B" or mv.ndim != 1:
            mv = mv.cast("B")
        if mv.readonly:
            raise ValueError("in-flight table: the buffer is read-only")
        if len(mv) < _HEADER_BYTES:
            raise ValueError(f"in-flight table: buffer of {len(mv)} bytes is smaller than the header")
        header = mv[:_HEADER_BYTES].cast("q")
        if header[_H_MAGIC] != _MAGIC or header[_H_VERSION] != _VERSION:
            header.release()
            raise ValueError("in-flight table: the buffer was not laid out by InFlightTable.initialize")
        capacity, workers = header[_H_CAPACITY], header[_H_WORKERS]
        if len(mv) < self.size(capacity, workers):
            header.release()
            raise ValueError(f"in-flight table: buffer of {len(mv)} bytes is smaller than "
                             f"{self.size(capacity, workers)} ({capacity} slots x {workers} workers)")
        if not 0 <= worker < workers:
            header.release()
            raise ValueError(f"in-flight table: worker {worker} is out of range (0-{workers - 1})")
        keys_end = _HEADER_BYTES + 8 * capacity
        holders_end = keys_end + 8 * capacity
        self._mv = mv
        self._header = header
        self._keys = mv[_HEADER_BYTES:keys_end].cast("Q")
        self._holders = mv[keys_end:holders_end].cast("Q")
        self._cells = mv[holders_end:holders_end + 8 * capacity * workers].cast("q")
        self._lock: Any = lock
        self.capacity: int = capacity
        self.workers: int = workers
        self.worker = worker
        self._bit = 1 << worker
        #: key -> slot of the slots this worker holds (its bit is set in their holders)
        self._slots: dict[int, int] = {}

    # -- layout -------------------------------------------------------------------

    @staticmethod
    def size(capacity: int = DEFAULT_CAPACITY, workers: int = 1) -> int:
        """Bytes a table of ``capacity`` slots and ``workers`` columns needs."""
        return _HEADER_BYTES + 16 * capacity + 8 * capacity * workers

    @classmethod
    def initialize(cls, buf: Any, capacity: int = DEFAULT_CAPACITY, workers: int = 1) -> None:
        """Lay out an empty table in ``buf`` (every count 0, no slot claimed).

        Raises:
            ValueError: ``capacity`` or ``workers`` out of range, or ``buf`` too small.
        """
        if not 1 <= capacity <= 1 << 20:
            raise ValueError(f"in-flight table: capacity {capacity} is out of range (1-1,048,576)")
        if not 1 <= workers <= MAX_WORKERS:
            raise ValueError(f"in-flight table: workers {workers} is out of range (1-{MAX_WORKERS})")
        mv = memoryview(buf).cast("B")
        try:
            need = cls.size(capacity, workers)
            if len(mv) < need:
                raise ValueError(f"in-flight table: buffer of {len(mv)} bytes is smaller than {need}")
            mv[:need] = bytes(need)
            with mv[:_HEADER_BYTES].cast("q") as header:
                header[_H_CAPACITY], header[_H_WORKERS], header[_H_USED] = capacity, workers, 0
                header[_H_VERSION] = _VERSION
                header[_H_MAGIC] = _MAGIC  # last: the table is valid once it is set
        finally:
            mv.release()

    def close(self) -> None:
        """Release the views on the buffer (``SharedMemory.close`` needs that). The
        :class:`SharedInstanceState` objects made by this table must not be used after."""
        for view in (self._cells, self._holders, self._keys, self._header, self._mv):
            view.release()

    # -- slots --------------------------------------------------------------------

    @property
    def used(self) -> int:
        """Slots ever claimed (by any process): the high-water mark, slots taken over
        by a new key included once."""
        return self._header[_H_USED]

    @property
    def in_use(self) -> int:
        """Slots that cannot be taken over now: held by some worker, or with requests
        in flight."""
        holders, w = self._holders, self.workers
        return sum(1 for s in range(self.used) if holders[s] or any(self._cells[s * w:(s + 1) * w]))

    def holders(self, slot: int) -> int:
        """The bitmask of the workers holding ``slot`` (bit ``w`` for worker ``w``)."""
        return self._holders[slot]

    def reserve(self, keys: Iterable[int]) -> list[int]:
        """The slots of ``keys``, held by this worker from now on: the slot a key already
        has, else a never-used one, else one that no worker holds and that has nothing
        in flight (taken over). All or none.

        Raises:
            InFlightTableFull: not enough free slots for the keys without one.
            InFlightTableLocked: the lock stayed taken (see :meth:`_locked`).
        """
        keys = list(keys)
        missing = [k for k in dict.fromkeys(keys) if k not in self._slots]
        if missing:
            with self._locked():
                used = self._header[_H_USED]
                known = {k: i for i, k in enumerate(self._keys[:used].tolist())}
                new = [k for k in missing if k not in known]
                fresh = min(len(new), self.capacity - used)
                reuse: list[int] = []
                if fresh < len(new):  # taken over: held by nobody, nothing in flight
                    w = self.workers
                    taken = {known[k] for k in missing if k in known}
                    reuse = [s for s in range(used) if not self._holders[s] and s not in taken
                             and not any(self._cells[s * w:(s + 1) * w])][: len(new) - fresh]
                    if fresh + len(reuse) < len(new):
                        raise InFlightTableFull(
                            f"the shared in-flight table is full: {used - len(reuse):,} of "
                            f"{self.capacity:,} (endpoint, variant, instance) slots are held by a configuration "
                            f"or have requests in flight, and this configuration needs {len(new):,} more")
                for k, s in zip(new[fresh:], reuse):
                    self._keys[s] = k
                    known[k] = s
                for k in new[:fresh]:
                    self._keys[used] = k
                    known[k] = used
                    used += 1
                self._header[_H_USED] = used  # after the keys: a reader of `used` sees them
                for k in missing:
                    s = self._slots[k] = known[k]
                    self._holders[s] |= self._bit
        return [self._slots[k] for k in keys]

    def retain(self, keys: Iterable[int]) -> None:
        """Let go of the slots this worker holds whose key is not in ``keys`` (what its
        configuration, and its removed instances with requests in flight, still need):
        once no worker holds one and its requests are over, a new key may take it.

        Raises:
            InFlightTableLocked: the lock stayed taken (see :meth:`_locked`).
        """
        keep = set(keys)
        drop = [k for k in self._slots if k not in keep]
        if drop:
            with self._locked():
                for k in drop:
                    self._holders[self._slots.pop(k)] &= ~self._bit

    def slot(self, key: int) -> int:
        """The slot of ``key``, claimed if new. Raises :class:`InFlightTableFull`."""
        s = self._slots.get(key)
        return s if s is not None else self.reserve((key,))[0]

    # -- counts -------------------------------------------------------------------

    def total(self, slot: int) -> int:
        """Requests in flight on ``slot``, summed over every worker."""
        lo = slot * self.workers
        return sum(self._cells[lo:lo + self.workers])

    def count(self, slot: int, worker: int) -> int:
        """Requests in flight on ``slot`` from one worker."""
        return self._cells[slot * self.workers + worker]

    def add(self, slot: int, delta: int) -> None:
        """Add ``delta`` to this worker's count of ``slot``."""
        self._cells[slot * self.workers + self.worker] += delta

    def worker_total(self, worker: int) -> int:
        """Requests in flight from one worker, over every slot."""
        w = self.workers
        return sum(self._cells[worker:self.used * w:w])

    def zero_worker(self, worker: int) -> bool:
        """Set one worker's counts to 0 and let go of its slots (its process is gone, and
        its requests with it; its replacement reserves its configuration again). Call
        only while no process writes that column.

        Returns:
            False if the counts were zeroed but the lock stayed taken, so its slots stay
            held: never taken over, nothing miscounted.
        """
        w = self.workers
        for slot in range(self.used):
            self._cells[slot * w + worker] = 0
        bit = ~(1 << worker)
        try:
            with self._locked():
                for slot in range(self.used):
                    self._holders[slot] &= bit
        except InFlightTableLocked:
            return False
        return True

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        """Hold the table's lock (none for a table of one process).

        Raises:
            InFlightTableLocked: not free within :data:`LOCK_TIMEOUT_S`.
        """
        lock = self._lock
        if lock is None:
            yield
            return
        if not lock.acquire(timeout=LOCK_TIMEOUT_S):
            raise InFlightTableLocked(
                f"the shared in-flight table's lock was not free within {LOCK_TIMEOUT_S:g} s: no slot was claimed "
                "or let go of; try again")
        try:
            yield
        finally:
            lock.release()

    def states(self, endpoint: str, variant: str) -> Callable[[str], InstanceState]:
        """A factory of :class:`SharedInstanceState` for the instances of one variant
        (``VariantPool(..., make_state=...)``). Raises :class:`InFlightTableFull`."""
        cls = _SharedInstanceState2 if self.workers == 2 else SharedInstanceState

        def make(instance_id: str) -> InstanceState:
            return cls(instance_id, self._cells, self.slot(slot_key(endpoint, variant, instance_id)), self.worker,
                       self.workers)

        return make


def _ignore_init_only(self: "SharedInstanceState", value: int) -> None:
    # The dataclass __init__ assigns the default 0 before the cells are bound: ignore
    # it. Afterwards the count is the table's; only add_in_flight changes it.
    if self._cells is not None:
        raise AttributeError("a shared in-flight count changes only through add_in_flight()")


class SharedInstanceState(InstanceState):
    """An :class:`InstanceState` whose ``in_flight`` is the sum over every worker's
    column of one slot of an :class:`InFlightTable` (made by :meth:`InFlightTable.states`).
    ``add_in_flight`` changes this worker's column only."""

    __slots__ = ("_cells", "_lo", "_hi", "_own")

    def __init__(self, instance_id: str, cells: memoryview, slot: int, worker: int, workers: int) -> None:
        self._cells: memoryview | None = None
        InstanceState.__init__(self, instance_id)
        self._lo = slot * workers
        self._hi = self._lo + workers
        self._own = self._lo + worker
        self._cells = cells

    def _get_in_flight(self) -> int:
        return sum(self._cells[self._lo:self._hi])  # type: ignore[index]

    in_flight = property(_get_in_flight, _ignore_init_only)  # type: ignore[assignment]

    def add_in_flight(self, delta: int) -> None:
        self._cells[self._own] += delta  # type: ignore[index]

    @property
    def own_in_flight(self) -> int:
        """Requests in flight on this instance from this worker only."""
        return self._cells[self._own]  # type: ignore[index]


class _SharedInstanceState2(SharedInstanceState):
    """Two workers (the common case on small machines): two reads, no slice."""

    __slots__ = ()

    def _get_in_flight(self) -> int:
        c, lo = self._cells, self._lo
        return c[lo] + c[lo + 1]  # type: ignore[index]

    in_flight = property(_get_in_flight, _ignore_init_only)  # type: ignore[assignment]
