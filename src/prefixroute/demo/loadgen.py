"""Load generators: N concurrent users send chat requests over real HTTP.

:func:`run_closed_loop`: each user takes the next request of the workload, sends it with
``stream: true``, and records TTFT (request sent -> first chunk with generated text),
end-to-end latency, the router's decision headers and the engine's ``usage``. Closed
loop, as in LLMPerf-style benchmarks: the offered load adapts to the fleet, so
throughput shows capacity and TTFT shows queueing and prefill.

:func:`run_sessions`: drives :class:`~prefixroute.workloads.session.Session` s (the
workloads the simulator replays) in scaled real time: open loop, each session starting
at its ``start_s``, or closed loop with N users running sessions back to back. Turns of
a session follow each other after the session's think time, and each turn resends the
previous answers as the engine produced them, as a chat client does.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator

import aiohttp
import orjson

from prefixroute.workloads.shared_prefix import WorkloadRequest

__all__ = ["RequestResult", "run_closed_loop", "run_sessions"]


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
    text: str = ""


async def _one(session: aiohttp.ClientSession, url: str, req: WorkloadRequest, collect_text: bool = False
               ) -> RequestResult:
    body = dict(req.body, stream=True, stream_options={"include_usage": True})
    res = RequestResult(req.index, req.group, time.perf_counter())
    parts: list[str] = []
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
                    if collect_text:
                        for choice in msg.get("choices") or ():
                            parts.append((choice.get("delta") or {}).get("content") or choice.get("text") or "")
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
            res.text = "".join(parts)
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


async def run_sessions(
    url: str,
    sessions: Iterable[Any],
    duration_s: float,
    time_scale: float = 1.0,
    users: int | None = None,
    on_done: Callable[[RequestResult], None] | None = None,
    timeout_s: float = 300.0,
) -> tuple[list[RequestResult], float]:
    """Drive workload sessions through ``url`` in scaled real time.

    Args:
        url: the chat-completions URL.
        sessions: :class:`~prefixroute.workloads.session.Session` s in order of ``start_s``.
        duration_s: model seconds during which turns may start (as the simulator's
            ``SimConfig.duration_s``); turns in flight then finish.
        time_scale: real seconds per model second (the engines' ``--time-scale``):
            start times and think times are multiplied by it.
        users: closed loop with this many users running sessions back to back; None =
            open loop, each session at its ``start_s``.
        on_done: called after each request.
        timeout_s: per-request timeout, real seconds.

    Returns:
        ``(results, wall_s)``: every request (``index`` in order of sending, ``group``
        the session's) and the real seconds from the first send to the last completion.
        A session stops at its first failed turn.
    """
    results: list[RequestResult] = []
    it = iter(sessions)
    counter = 0
    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    t0 = time.perf_counter()

    def model_now() -> float:
        return (time.perf_counter() - t0) / time_scale

    async def run_session(http: aiohttp.ClientSession, s: Any) -> None:
        nonlocal counter
        answers: list[str] = []
        for k in range(s.num_turns):
            if k > 0:
                await asyncio.sleep(s.think_s(k) * time_scale)
                if model_now() > duration_s:
                    return
            req = WorkloadRequest(counter, s.group, s.body(k, answers), 0)
            counter += 1
            r = await _one(http, url, req, collect_text=s.num_turns > k + 1)
            results.append(r)
            if on_done is not None:
                on_done(r)
            if r.error:
                return
            answers.append(r.text)
            r.text = ""

    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as http:
        if users is not None:
            async def user() -> None:
                while model_now() <= duration_s:
                    s = next(it, None)
                    if s is None:
                        return
                    await run_session(http, s)

            await asyncio.gather(*(user() for _ in range(users)))
        else:
            tasks: list[asyncio.Task[None]] = []
            for s in it:
                if s.start_s > duration_s:
                    break
                delay = t0 + s.start_s * time_scale - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                tasks.append(asyncio.create_task(run_session(http, s)))
            await asyncio.gather(*tasks)
    first = min((r.start_s for r in results), default=t0)
    last = max((r.start_s + r.latency_s for r in results if r.latency_s is not None), default=first)
    return results, last - first
