"""CACHE_AWARE learns where a request went before it decides the next one, on both data
planes, also for requests parsed in one loop turn and sent over new connections (a
burst of clients starting at once: no upstream connection is pooled yet); a failure
to learn is logged and spares the request."""

from __future__ import annotations

import asyncio
import logging

import orjson
import pytest

from prefixroute.core.config import FleetConfig, RoutingConfig
from prefixroute.core.pool import VariantPool
from prefixroute.server import attempt
from prefixroute.server.attempt import learn_route
from prefixroute.server.runner import start_router
from fault_backend import FaultBackend
from test_server_helpers import settings

PAIRS = 4


def _post(body: bytes) -> bytes:
    return (b"POST /v1/completions HTTP/1.1\r\nHost: r\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n" % len(body)) + body


def _prompts(i: int) -> tuple[str, str]:
    """A prompt and the same prompt a few characters longer (the next request of a
    session): both shorter than the 16 blocks (1,024 characters) before which
    CACHE_AWARE places a new prefix by the rendezvous order of its last block, so the
    two are placed independently (on the same instance one time in four, with four
    instances) unless the second decision knows where the first went: four pairs are
    all together by chance once in 256 runs. The continuation adds so little that its
    home keeps it however the four pairs fall (all four on one instance included: a
    replay of the decisions over 3,000 random port sets kept every pair together)."""
    first = f"conversation {i:02d}: " + "".join(f"w{i}x{k} " for k in range(60))[:580]
    return first, first + " and?"


@pytest.mark.parametrize("data_plane", ["fast", "aiohttp"])
async def test_requests_parsed_in_one_loop_turn_see_where_the_earlier_ones_went(data_plane):
    backends = [await FaultBackend().start() for _ in range(4)]
    fleet = FleetConfig.single([b.url for b in backends], RoutingConfig.build("cache-aware", None, 64))
    router = await start_router(fleet, settings(data_plane=data_plane))
    conns: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
    try:
        for _ in range(2 * PAIRS):
            conns.append(await asyncio.open_connection("127.0.0.1", router.port))
        await asyncio.sleep(0.2)  # every connection accepted and read by the router
        bodies = []
        for i in range(PAIRS):
            bodies += [orjson.dumps({"model": "m", "prompt": p, "max_tokens": 1}) for p in _prompts(i)]
        # Written with no await in between: the router's loop (this loop) reads them all
        # in its next turn, and decides them there one after the other.
        for (_, writer), body in zip(conns, bodies):
            writer.write(_post(body))
        for reader, _ in conns:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
            assert head.startswith(b"HTTP/1.1 200")
        where = {r.body: n for n, b in enumerate(backends) for r in b.received}
        assert len(where) == 2 * PAIRS
        placed = [(where[bodies[2 * i]], where[bodies[2 * i + 1]]) for i in range(PAIRS)]
        assert all(a == b for a, b in placed), placed
    finally:
        for _, writer in conns:
            writer.close()
        await router.close()
        for b in backends:
            await b.stop()


def test_a_failure_to_learn_is_logged_within_a_budget_and_does_not_reach_the_request(caplog, monkeypatch):
    monkeypatch.setattr(attempt, "_learn_errors", 0)  # (as in a new process)
    pool = VariantPool("v", ["http://a", "http://b"], RoutingConfig.build("cache-aware", None, 8))
    lease = pool.acquire(None, blocks=[1, 2, 3], learn=False)

    def broken(instance, blocks):
        raise KeyError("a bug in the strategy")

    pool._strategy.on_routed = broken
    with caplog.at_level(logging.ERROR, logger="prefixroute.server.proxy"):
        for _ in range(3):  # no exception
            learn_route(pool, lease.decision.instance, [1, 2, 3])
        assert [r.getMessage() for r in caplog.records] == ["learning where a request went failed"]
        assert caplog.records[0].exc_info[0] is KeyError  # the first with its traceback, the next two not logged
        monkeypatch.setattr(attempt, "LEARN_ERROR_LOG_S", 0.0)
        learn_route(pool, lease.decision.instance, [1, 2, 3])
    assert caplog.records[-1].getMessage() == "learning where a request went failed again (4 times so far)"
    lease.release()
