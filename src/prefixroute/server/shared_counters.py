"""The shared in-flight table of ``serve --workers N`` across processes: a
``multiprocessing.shared_memory`` block holding a
:class:`prefixroute.core.counters.InFlightTable`, guarded by an ``flock``
(:class:`FileLock`) that the kernel releases when its holder dies."""

from __future__ import annotations

import contextlib
import fcntl
import os
import secrets
import time
from multiprocessing.shared_memory import SharedMemory
from typing import Any

from prefixroute.core.counters import DEFAULT_CAPACITY, InFlightTable

__all__ = ["FileLock", "SharedCounters"]

_SHM_PREFIX = "prefixroute-"


class FileLock:
    """An exclusive ``flock`` on ``path``: the shared in-flight table's lock. The kernel
    releases it when its holder's process dies, even by SIGKILL (a ``multiprocessing``
    lock would stay taken, and every later claim of a slot would wait for it). Each
    process opens the file itself (only the path is pickled to a worker).
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self._fd: int | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {"path": self.path}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.path, self._fd = state["path"], None

    def acquire(self, timeout: float = -1.0) -> bool:
        """Take the lock; False if it is still taken after ``timeout`` seconds (< 0: wait)."""
        if self._fd is None:
            self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return True
            except BlockingIOError:
                if 0 <= timeout and time.monotonic() >= deadline:
                    return False
                time.sleep(0.0005)  # held for milliseconds at most, and only while slots are claimed

    def release(self) -> None:
        assert self._fd is not None
        fcntl.flock(self._fd, fcntl.LOCK_UN)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


class SharedCounters:
    """A shared in-flight table in a ``multiprocessing.shared_memory`` block.

    :meth:`create` makes it (the supervisor, which later :meth:`unlink` s it);
    :meth:`attach` opens it by name from another process. ``table`` is this process's
    :class:`InFlightTable` view (its column: ``worker``).
    """

    def __init__(self, shm: SharedMemory, worker: int, lock: Any, owner: bool) -> None:
        self.shm = shm
        self.table = InFlightTable(shm.buf, worker, lock)
        self._owner = owner

    @property
    def name(self) -> str:
        return self.shm.name

    @classmethod
    def create(cls, workers: int, lock: Any, capacity: int = DEFAULT_CAPACITY) -> "SharedCounters":
        """A new zeroed table for ``workers`` processes, named ``prefixroute-<pid>-<random>``."""
        name = f"{_SHM_PREFIX}{os.getpid()}-{secrets.token_hex(4)}"
        shm = SharedMemory(name=name, create=True, size=InFlightTable.size(capacity, workers))
        try:
            InFlightTable.initialize(shm.buf, capacity, workers)
            return cls(shm, 0, lock, owner=True)
        except BaseException:
            shm.close()
            shm.unlink()
            raise

    @classmethod
    def attach(cls, name: str, worker: int, lock: Any) -> "SharedCounters":
        """Open the table ``name`` as worker ``worker``."""
        shm = SharedMemory(name=name)
        try:
            return cls(shm, worker, lock, owner=False)
        except BaseException:
            shm.close()
            raise

    def close(self) -> None:
        """Release this process's mapping (the states made from ``table`` die with it)."""
        self.table.close()
        with contextlib.suppress(BufferError):  # a view still alive: the mapping goes at exit
            self.shm.close()

    def unlink(self) -> None:
        """Close, and remove the block from the system (the creator, once, at exit)."""
        self.close()
        if self._owner:
            self._owner = False
            with contextlib.suppress(FileNotFoundError):
                self.shm.unlink()
