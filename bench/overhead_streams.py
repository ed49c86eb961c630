"""The streams phase of ``bench/overhead.py``: thousands of streaming requests open at
once through one router in front of a slow fast backend, counted by how they end, with
the router's CPU and peak memory.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Sequence

from backend_launch import start_fast_backend
from fast_backend import raise_nofile_limit
from overhead_settings import OverheadSettings, make_bodies
from peer_process import ProcessTracker
from peers import RouterSpec
from proc_stats import reset_peak_rss, tree_cpu_seconds, tree_peak_rss_bytes


@dataclass
class StreamsResult:
    """The streams phase: ``streams`` streaming requests opened at once through one router."""

    label: str
    streams: int
    completed: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    peak_open: int = 0
    backend_peak_open: int = 0
    wall_s: float = 0.0
    p50_stream_s: float | None = None
    max_stream_s: float | None = None
    router_rss_before_bytes: int = 0
    router_peak_rss_bytes: int = 0
    router_cpu_s: float = 0.0
    events_per_stream: int = 0
    delay_ms: float = 0.0
    nofile_limit: int = 0
    timeline: list[tuple[float, int]] = field(default_factory=list)

    @property
    def error_count(self) -> int:
        return sum(self.errors.values())

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["error_count"] = self.error_count
        return d


async def _streams_client(url: str, bodies: Sequence[bytes], n: int, events: int, res: StreamsResult,
                          connecting: int = 100) -> None:
    """Start ``n`` streaming requests, at most ``connecting`` of them waiting for their
    response headers at a time: a burst of 2,000 connects overflows a listen backlog
    (aiohttp's is 128), and Linux then drops SYNs that are retried only 1, 3, 7... s later,
    which spreads the streams out instead of opening them together."""
    import aiohttp

    gate = asyncio.Semaphore(connecting)
    open_now = 0
    durations: list[float] = []
    t_start = time.perf_counter()

    async def one(i: int) -> None:
        nonlocal open_now
        await gate.acquire()
        t0 = time.perf_counter()
        gated = True
        try:
            async with session.post(url, data=bodies[i % len(bodies)],
                                    headers={"Content-Type": "application/json"}) as resp:
                gate.release()
                gated = False
                if resp.status != 200:
                    await resp.read()
                    res.errors[f"HTTP {resp.status}"] = res.errors.get(f"HTTP {resp.status}", 0) + 1
                    return
                open_now += 1
                res.peak_open = max(res.peak_open, open_now)
                try:
                    data = await resp.read()
                finally:
                    open_now -= 1
            got = data.count(b"data: ")
            if not data.rstrip().endswith(b"data: [DONE]"):
                res.errors["no data: [DONE]"] = res.errors.get("no data: [DONE]", 0) + 1
            elif got != events + 1:
                res.errors[f"{got - 1} events instead of {events}"] = res.errors.get(
                    f"{got - 1} events instead of {events}", 0) + 1
            else:
                res.completed += 1
                durations.append(time.perf_counter() - t0)
        except Exception as exc:  # counted, not raised: the phase reports every failure
            key = type(exc).__name__
            res.errors[key] = res.errors.get(key, 0) + 1
        finally:
            if gated:
                gate.release()

    async def sample() -> None:
        while True:
            res.timeline.append((round(time.perf_counter() - t_start, 3), open_now))
            await asyncio.sleep(0.05)

    connector = aiohttp.TCPConnector(limit=0, limit_per_host=0)
    timeout = aiohttp.ClientTimeout(total=None, connect=120, sock_read=120)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        sampler = asyncio.create_task(sample())
        await asyncio.gather(*(one(i) for i in range(n)))
        sampler.cancel()
    res.wall_s = time.perf_counter() - t_start
    if durations:
        durations.sort()
        res.p50_stream_s = statistics.median(durations)
        res.max_stream_s = durations[-1]


def run_streams_phase(tracker: ProcessTracker, s: OverheadSettings, spec: RouterSpec,
                      log: Callable[[str], None] = print) -> StreamsResult:
    """Open ``s.streams`` streams at once through ``spec`` (started here, in front of a
    slow fast backend of its own) and count how they end.

    Raises:
        PeerError: the backend or the router did not start.
    """
    nofile = raise_nofile_limit()
    need = 3 * s.streams + 256  # the router holds 2 sockets per stream, the client 1
    if nofile < need:
        log(f"warning: RLIMIT_NOFILE is {nofile}, below the {need} that {s.streams} streams may need")
    backend = start_fast_backend(tracker, s.instances, stream_events=s.streams_events,
                                 stream_delay_ms=s.streams_delay_ms)
    router = spec.start_retrying(tracker, backend.urls)
    res = StreamsResult(spec.label, s.streams, events_per_stream=s.streams_events, delay_ms=s.streams_delay_ms,
                        nofile_limit=nofile)
    try:
        bodies = make_bodies(1024, True, s.distinct_bodies, s.seed)
        pid = router.process.proc.pid
        res.router_rss_before_bytes = tree_peak_rss_bytes(pid)
        reset_peak_rss(pid)
        cpu0 = tree_cpu_seconds(pid)
        _run_async(_streams_client(router.url + "/v1/chat/completions", bodies, s.streams, s.streams_events, res))
        res.router_cpu_s = tree_cpu_seconds(pid) - cpu0
        res.router_peak_rss_bytes = tree_peak_rss_bytes(pid)
        res.backend_peak_open = int(backend.stats()["streams_peak"])
    finally:
        tracker.stop([router.process, backend.process])
    return res


def _run_async(coro: Any) -> Any:
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)
