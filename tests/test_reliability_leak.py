"""Leak check: thousands of streaming requests whose clients abort at random points.

Afterwards every in-flight count is zero, the per-request state is gone (upstream
connections checked out of the pool, handler tasks), and the process's resident memory
after a garbage collection grew by less than 10 MB.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import gc
import os
import random
import time

import aiohttp

from prefixroute.core.config import FleetConfig, RoutingConfig
from prefixroute.server import ServerSettings, start_router

from fault_backend import Fault, FaultBackend
from reliability_helpers import assert_invariants, eventually, in_flight, install_floor, metrics_text, request_for
from test_server_helpers import metric_value

REQUESTS = 5000
WARMUP = 3000  # first the allocator reaches its steady state (arenas for the peak concurrency)
CONCURRENCY = 48
MAX_RSS_GROWTH = 10 * 1024 * 1024


def rss_bytes() -> int:
    """Resident set size of this process, bytes (Linux /proc)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def collected_rss() -> int:
    """RSS after a full garbage collection and, with glibc, after returning freed heap
    pages to the system (``malloc_trim``), so that what remains is memory in use."""
    gc.collect()
    libc_name = ctypes.util.find_library("c")
    if libc_name:
        trim = getattr(ctypes.CDLL(libc_name), "malloc_trim", None)
        if trim is not None:
            trim(0)
    return rss_bytes()


async def _one(http: aiohttp.ClientSession, url: str, rng: random.Random, tally: dict[str, int]) -> None:
    route = rng.choice(("chat_stream", "chat_stream", "native_stream", "response_stream"))
    path, body = request_for(route, prompt=f"{rng.randrange(50)}-" + "d" * 1100)
    action = rng.choices(("complete", "abort_early", "abort_mid"), weights=(3, 2, 4))[0]
    tally[action] += 1
    if action == "abort_early":  # before or while the response headers come
        task = asyncio.create_task(http.post(url + path, data=body))
        await asyncio.sleep(rng.random() * 0.004)
        task.cancel()
        try:
            (await task).close()
        except (asyncio.CancelledError, aiohttp.ClientError):
            pass
        return
    async with http.post(url + path, data=body) as r:
        assert r.status == 200, r.status
        if action == "complete":
            await r.read()
            return
        stop_after = rng.randrange(1, 60)  # bytes: inside the first events
        got = 0
        async for chunk in r.content.iter_any():
            got += len(chunk)
            if got >= stop_after:
                break
        r.close()  # the client goes away mid-stream


async def _drive(url: str, n: int, seed: int, tally: dict[str, int]) -> None:
    rng = random.Random(seed)
    sem = asyncio.Semaphore(CONCURRENCY)
    connector = aiohttp.TCPConnector(limit=CONCURRENCY * 2)
    async with aiohttp.ClientSession(connector=connector) as http:
        async def guarded() -> None:
            async with sem:
                await _one(http, url, rng, tally)

        await asyncio.gather(*(guarded() for _ in range(n)))


async def test_5000_randomly_aborted_streams_leak_nothing(monkeypatch):
    floor = install_floor(monkeypatch)
    backends = [await FaultBackend().start() for _ in range(2)]
    for b in backends:
        b.default = Fault("ok", events=12, delay=0.001)
        b.record = False  # a record of 5,000 requests would be the test's own memory growth
    handle = await start_router(
        FleetConfig.single([b.url for b in backends], RoutingConfig.build("prefix-aware", 1024, 32)),
        ServerSettings(port=0, admin_port=0, health_check_interval_s=0, metrics_scrape_interval_s=0,
                       shutdown_timeout_s=1.0, seed=11))
    tally = {"complete": 0, "abort_early": 0, "abort_mid": 0}
    try:
        await _drive(handle.url, WARMUP, 1, tally)
        assert await eventually(lambda: in_flight(handle) == 0, 5)
        tally = {k: 0 for k in tally}  # count the measured requests only
        tasks_before = len(asyncio.all_tasks())
        rss_before = collected_rss()
        t0 = time.monotonic()
        await _drive(handle.url, REQUESTS, 2, tally)
        elapsed = time.monotonic() - t0
        assert await eventually(lambda: in_flight(handle) == 0, 5)
        await asyncio.sleep(0.2)
        rss_after = collected_rss()
        growth = rss_after - rss_before
        connector = handle.state.session.connector
        assert await eventually(lambda: not connector._acquired, 3)  # no upstream connection left checked out
        assert await eventually(lambda: len(asyncio.all_tasks()) <= tasks_before, 3)  # no handler left behind
        text = await metrics_text_via(handle)
        for b in backends:
            assert metric_value(text, "prefixroute_in_flight", endpoint="default", variant="AllTraffic",
                                instance=b.url) == 0
        print(f"\nleak check: {REQUESTS} requests in {elapsed:.1f} s ({tally}); RSS {rss_before / 2**20:.1f} -> "
              f"{rss_after / 2**20:.1f} MiB (growth {growth / 2**20:+.2f} MiB); in-flight 0; "
              f"lowest in-flight after a release {floor['min']}")
        assert growth < MAX_RSS_GROWTH, f"RSS grew by {growth / 2**20:.1f} MiB"
        assert tally["abort_mid"] > 1000 and tally["abort_early"] > 500
        await assert_invariants(handle, backends, floor)
    finally:
        await handle.close()
        for b in backends:
            await b.stop()


async def metrics_text_via(handle) -> str:
    async with aiohttp.ClientSession() as http:
        return await metrics_text(http, handle)
