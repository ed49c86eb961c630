"""The KV-event ingest cycle (server/kv_subscriber.py) over stand-in sockets: a quiet
instance is not starved by a flooding one, and an error applying one instance's message
neither stops the others' ingest nor leaves a socket unwatched."""

from __future__ import annotations

import asyncio
import collections
import os
import time
from typing import Any

import pytest
import zmq

from prefixroute.core.kvevents.config import KvEventsConfig, KvEventsEndpoint
from prefixroute.server.kv_subscriber import FLOOD_S, KvEventSubscriber, _Subscription


class _Socket:
    """A socket's non-blocking reads (each taking ``cost`` seconds) and EVENTS."""

    def __init__(self, messages: int, cost: float = 0.0) -> None:
        self.queue: collections.deque[list[bytes]] = collections.deque([[b"", b"", b""]] * messages)
        self.cost = cost

    def recv_multipart(self, flags: int = 0) -> list[bytes]:
        if not self.queue:
            raise zmq.Again()
        end = time.perf_counter() + self.cost
        while time.perf_counter() < end:
            pass
        return self.queue.popleft()

    def getsockopt(self, option: int) -> int:
        return zmq.POLLIN if self.queue else 0


class _Stream:
    mode = "precise"
    reason = ""

    def __init__(self, name: str, applied: list[str], fail: bool = False) -> None:
        self.name, self.applied, self.fail, self.resets = name, applied, fail, 0

    def on_message(self, frames: list[bytes], now: float) -> list[Any]:
        if self.fail:
            raise RuntimeError("a bug")
        self.applied.append(self.name)
        return []

    def reset(self, why: str, now: float | None = None) -> None:
        self.resets += 1
        self.reset_at = now


@pytest.fixture
def pipes():
    fds: list[int] = []
    yield fds
    for fd in fds:
        os.close(fd)


def _subscription(sub: KvEventSubscriber, name: str, sock: _Socket, stream: _Stream, fds: list[int]) -> _Subscription:
    r, w = os.pipe()  # a file descriptor that never signals: the cycle is what reads
    fds += [r, w]
    sub.busy_s[name] = 0.0
    ep = KvEventsEndpoint(Endpoint="tcp://127.0.0.1:1")
    shed = asyncio.get_running_loop().create_future()
    return _Subscription(name, stream, ep, sock, r, set(), shed)  # type: ignore[arg-type]


async def _until(done, timeout: float) -> float:
    """Seconds until ``done()`` held (checked every 5 ms), at most ``timeout``."""
    t0 = time.perf_counter()
    while not done() and time.perf_counter() - t0 < timeout:
        await asyncio.sleep(0.005)
    return time.perf_counter() - t0


async def test_a_quiet_instance_is_not_starved_by_a_flooding_one(pipes: list[int]) -> None:
    sub = KvEventSubscriber(None, KvEventsConfig())  # type: ignore[arg-type]
    applied: list[str] = []
    flood = _subscription(sub, "flood", _Socket(1_000_000, cost=50e-6), _Stream("flood", applied), pipes)
    quiet = _subscription(sub, "quiet", _Socket(5), _Stream("quiet", applied), pipes)
    try:
        sub._readable(flood)
        sub._readable(quiet)
        took = await _until(lambda: applied.count("quiet") == 5, 3)
        assert applied.count("quiet") == 5
        assert took < FLOOD_S / 2, f"the quiet instance waited {took:.2f} s behind the flood"
        assert not quiet.shed.done()
    finally:
        for s in (flood, quiet):
            sub._disarm(s)
        await sub.close()


async def test_an_error_applying_one_instances_message_leaves_the_others_ingesting(pipes: list[int]) -> None:
    sub = KvEventSubscriber(None, KvEventsConfig())  # type: ignore[arg-type]
    applied: list[str] = []
    broken_stream = _Stream("broken", applied, fail=True)
    broken = _subscription(sub, "broken", _Socket(3), broken_stream, pipes)
    fine = _subscription(sub, "fine", _Socket(3), _Stream("fine", applied), pipes)
    try:
        sub._readable(broken)
        sub._readable(fine)
        await _until(lambda: applied.count("fine") == 3, 2)
        assert applied.count("fine") == 3
        assert broken_stream.resets >= 1  # its state forgotten (it may be wrong), not its socket
        assert isinstance(broken_stream.reset_at, float)  # dated by the ingest cycle's clock
        assert broken.armed or "broken" in sub._ready
    finally:
        for s in (broken, fine):
            sub._disarm(s)
        await sub.close()
