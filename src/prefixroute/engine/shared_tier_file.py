"""A shared KV tier across the processes of an emulated fleet: a table in a memory-mapped file.

Every ``prefixroute emulate --shared-tier PATH`` process maps the same file (on Linux,
put it in ``/dev/shm``: memory, not disk) and uses it as the
:class:`~prefixroute.engine.tiers.SharedTier` of its engine. Each operation takes an
exclusive ``flock`` on the file for its duration (microseconds), so concurrent engines
never see a half-written slot.

Layout (little-endian): a 64-byte header, ``b"PRXTIER1"``, the capacity in slots
(u64) and a logical clock (u64); then one 24-byte slot per block: the block hash (u64,
0 = empty; a hash of 0 is stored as 1), the hash its storer published it under (u64)
and the clock value of its last use (u64). A block's slot is searched among the
:data:`PROBE` slots from ``hash % capacity`` on; a new block takes an empty one there, or
evicts the least recently used of them (an approximation of LRU over the whole tier,
as set-associative caches do).

The first process to open the file creates and sizes it (``num_blocks`` slots); the
others use the capacity written in its header.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import struct
from collections.abc import Sequence

__all__ = ["FileSharedTier", "PROBE", "MAGIC"]

MAGIC = b"PRXTIER1"
#: Slots searched for one block (its "set").
PROBE = 16
_HEADER = 64
_SLOT = struct.Struct("<QQQ")
_HEAD = struct.Struct("<8sQQ")


class FileSharedTier:
    """The shared tier of an emulated fleet (see the module docstring).

    Args:
        path: the file (created if missing).
        num_blocks: capacity in blocks when this call creates the file (>= ``PROBE``);
            ignored when it exists.
    Raises:
        ValueError: the file exists but is not a tier (bad magic or size), or
            ``num_blocks`` is too small. OSError: the file cannot be opened or mapped.
    """

    def __init__(self, path: str, num_blocks: int) -> None:
        if num_blocks < PROBE:
            raise ValueError(f"a shared tier holds at least {PROBE} blocks, got {num_blocks}")
        self.path = path
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            try:
                size = os.fstat(fd).st_size
                if size == 0:
                    os.ftruncate(fd, _HEADER + num_blocks * _SLOT.size)
                    os.pwrite(fd, _HEAD.pack(MAGIC, num_blocks, 1), 0)
                    size = _HEADER + num_blocks * _SLOT.size
                head = os.pread(fd, _HEAD.size, 0)
                magic, capacity, _ = _HEAD.unpack(head) if len(head) == _HEAD.size else (b"", 0, 0)
                if magic != MAGIC or capacity < PROBE or size != _HEADER + capacity * _SLOT.size:
                    raise ValueError(f"{path} is not a prefixroute shared tier file")
            finally:
                fcntl.flock(fd, fcntl.LOCK_UN)
            self._map = mmap.mmap(fd, size)
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        self.num_blocks = capacity

    def close(self) -> None:
        """Unmap and close the file (the file stays for the other processes)."""
        if self._fd >= 0:
            self._map.close()
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> "FileSharedTier":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the table ------------------------------------------------------------------------

    def _tick(self) -> int:
        now = struct.unpack_from("<Q", self._map, 16)[0] + 1
        struct.pack_into("<Q", self._map, 16, now)
        return now

    def _find(self, key: int) -> tuple[int, int, int]:
        """``(slot of key or -1, first empty slot or -1, least recently used slot)``."""
        m, cap = self._map, self.num_blocks
        base = key % cap
        empty, lru, lru_stamp = -1, -1, 2**64
        for k in range(PROBE):
            slot = (base + k) % cap
            h, _, stamp = _SLOT.unpack_from(m, _HEADER + slot * _SLOT.size)
            if h == key:
                return slot, empty, lru
            if h == 0:
                if empty < 0:
                    empty = slot
            elif stamp < lru_stamp:
                lru, lru_stamp = slot, stamp
        return -1, empty, lru

    def match(self, hashes: Sequence[int], start: int, end: int) -> int:
        """How many blocks of ``hashes[start:end]``, from ``start`` on, the tier holds
        (touching them)."""
        if start >= end:
            return 0
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        try:
            now = self._tick()
            n = start
            while n < end:
                slot, _, _ = self._find(hashes[n] or 1)
                if slot < 0:
                    break
                struct.pack_into("<Q", self._map, _HEADER + slot * _SLOT.size + 16, now)
                n += 1
            return n - start
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)

    def put(self, hashes: Sequence[int], published: Sequence[int]) -> tuple[list[int], list[int]]:
        """Store blocks; returns ``(positions stored anew, published hashes evicted)``."""
        stored: list[int] = []
        evicted: list[int] = []
        if not hashes:
            return stored, evicted
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        try:
            now = self._tick()
            m = self._map
            for i, h in enumerate(hashes):
                key = h or 1
                slot, empty, lru = self._find(key)
                if slot >= 0:
                    struct.pack_into("<Q", m, _HEADER + slot * _SLOT.size + 16, now)
                    continue
                if empty < 0:
                    empty = lru
                    evicted.append(_SLOT.unpack_from(m, _HEADER + lru * _SLOT.size)[1])
                _SLOT.pack_into(m, _HEADER + empty * _SLOT.size, key, published[i], now)
                stored.append(i)
            return stored, evicted
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)

    def __len__(self) -> int:
        """Blocks held (a scan of the table: for tests and tools)."""
        m = self._map
        return sum(1 for s in range(self.num_blocks) if _SLOT.unpack_from(m, _HEADER + s * _SLOT.size)[0])
