"""A closed-loop load generator: N concurrent users send chat requests back to back.

Each user takes the next request of the workload, sends it with ``stream: true`` over
real HTTP, and records TTFT (request sent -> first chunk with generated text), end-to-end
latency, the router's decision headers and the engine's ``usage``. Closed loop, as in
LLMPerf-style benchmarks: the offered load adapts to the fleet, so throughput shows
capacity and TTFT shows queueing and prefill.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator

import aiohttp
import orjson

from prefixroute.workloads.shared_prefix import WorkloadRequest

__all__ = ["RequestResult", "run_closed_loop"]


@dataclass(slots=True)
class RequestResult:
    """What one request did. Times are real seconds (``time.perf_counter``).

    ``ttft_s``/``latency_s`` are ``None`` when the request failed; ``error`` then says why.
    """

    index: int
    group: int
    start_s: float
    ttft_s: float | None = None
    latency_s: float | None = None
    status: int = 0
    instance: str = ""
    decision: str = ""
    overhead_ms: float | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    error: str = ""


async def _one(session: aiohttp.ClientSession, url: str, req: WorkloadRequest) -> RequestResult:
    body = dict(req.body, stream=True, stream_options={"include_usage": True})
    res = RequestResult(req.index, req.group, time.perf_counter())
    try:
        async with session.post(url, data=orjson.dumps(body), headers={"Content-Type": "application/json"}) as resp:
            res.status = resp.status
            res.instance = resp.headers.get("X-Prefixroute-Instance", "")
            res.decision = resp.headers.get("X-Prefixroute-Decision", "")
            oh = resp.headers.get("X-Prefixroute-Overhead-Ms")
            res.overhead_ms = float(oh) if oh else None
            if resp.status != 200:
                res.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return res
            buf = b""
            async for chunk in resp.content.iter_any():
                buf += chunk
                while b"\n\n" in buf:
                    event, buf = buf.split(b"\n\n", 1)
                    if not event.startswith(b"data: "):
                        continue
                    data = event[6:]
                    if data == b"[DONE]":
                        continue
                    msg = orjson.loads(data)
                    if res.ttft_s is None:
                        for choice in msg.get("choices") or ():
                            if (choice.get("delta") or {}).get("content") or choice.get("text"):
                                res.ttft_s = time.perf_counter() - res.start_s
                                break
                    usage = msg.get("usage")
                    if usage:
                        res.prompt_tokens = usage.get("prompt_tokens", 0)
                        res.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0) or 0
            res.latency_s = time.perf_counter() - res.start_s
            if res.ttft_s is None:
                res.error = "stream ended without generated text"
                res.latency_s = None
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
        res.error = f"{type(exc).__name__}: {exc}"
    return res


async def run_closed_loop(
    url: str,
    requests: Iterable[WorkloadRequest],
    users: int,
    duration_s: float,
    on_done: Callable[[RequestResult], None] | None = None,
    timeout_s: float = 120.0,
) -> tuple[list[RequestResult], float]:
    """Send ``requests`` through ``url`` with ``users`` concurrent users.

    Users stop taking new requests after ``duration_s`` real seconds (or when the
    requests run out) and finish the ones they have.

    Args:
        url: the chat-completions URL (e.g. ``http://127.0.0.1:8080/v1/chat/completions``).
        requests: the workload, consumed in order.
        users: concurrent users (each has at most one request in flight).
        duration_s: real seconds during which new requests start.
        on_done: called after each request (progress display).
        timeout_s: per-request timeout, seconds.

    Returns:
        ``(results, wall_s)``: every request's result and the real seconds from the
        first send to the last completion.
    """
    it: Iterator[WorkloadRequest] = iter(requests)
    results: list[RequestResult] = []
    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    t0 = time.perf_counter()
    deadline = t0 + duration_s

    async def user(session: aiohttp.ClientSession) -> None:
        while time.perf_counter() < deadline:
            req = next(it, None)
            if req is None:
                return
            r = await _one(session, url, req)
            results.append(r)
            if on_done is not None:
                on_done(r)

    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        await asyncio.gather(*(user(session) for _ in range(users)))
    return results, time.perf_counter() - t0
