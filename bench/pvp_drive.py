"""The traffic of a ``bench/policy_vs_peers.py`` run: users running a workload's sessions
through the routers as streamed chat requests, closed loop or at their arrival times, and
membership events at their times (:func:`drive`).
"""

from __future__ import annotations

import asyncio
import itertools
import time
from typing import Any, Callable, Iterator, Sequence

import aiohttp
import orjson

from peer_process import PeerError
from prefixroute.demo.loadgen import RequestResult


async def _request(http: aiohttp.ClientSession, url: str, body: dict[str, Any], headers: dict[str, str],
                   index: int, group: int, want_text: bool) -> RequestResult:
    """One streamed chat request; TTFT = first chunk with generated text."""
    payload = orjson.dumps(dict(body, stream=True))
    res = RequestResult(index, group, time.perf_counter())
    parts: list[str] = []
    try:
        async with http.post(url, data=payload, headers={"Content-Type": "application/json", **headers}) as resp:
            res.status = resp.status
            res.instance = resp.headers.get("X-Emulated-Instance") or resp.headers.get("X-Prefixroute-Instance", "")
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
                    if not event.startswith(b"data:"):
                        continue
                    data = event[5:].strip()
                    if data == b"[DONE]":
                        continue
                    msg = orjson.loads(data)
                    for choice in msg.get("choices") or ():
                        text = (choice.get("delta") or {}).get("content") or choice.get("text") or ""
                        if text:
                            if res.ttft_s is None:
                                res.ttft_s = time.perf_counter() - res.start_s
                            if want_text:
                                parts.append(text)
            res.latency_s = time.perf_counter() - res.start_s
            res.text = "".join(parts)
            if res.ttft_s is None:
                res.error = "stream ended without generated text"
                res.latency_s = None
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
        res.error = f"{type(exc).__name__}: {exc}"
    return res


async def drive(router_urls: Sequence[str], sessions: Iterator[Any], session_key: Callable[[Any], str],
                users: int | None, duration_s: float, time_scale: float,
                events: Sequence[tuple[float, Callable[[], Any]]] = (), timeout_s: float = 120.0) -> tuple[list[RequestResult], float, list[dict[str, Any]]]:
    """Closed-loop users running sessions back to back through the routers, or (``users``
    None) sessions started at their own arrival times (open loop).

    User ``u`` talks to router ``u mod len(router_urls)`` (clients spread round robin
    over the replicas); in the open loop, session ``i`` to router ``i mod len(...)``.
    Each session's turns follow each other after its think time (model seconds ×
    ``time_scale``); each turn resends the earlier answers as received. No turn starts
    after ``duration_s`` real seconds; an open-loop session starts ``start_s`` model
    seconds (× ``time_scale``) after the run's start. ``events`` are ``(real second,
    blocking callable)`` run in a thread at that time (membership).

    Returns:
        ``(results, wall_s, event log)``.
    """
    results: list[RequestResult] = []
    log: list[dict[str, Any]] = []
    counter = itertools.count()
    connector = aiohttp.TCPConnector(limit=0)
    t0 = time.perf_counter()
    deadline = t0 + duration_s

    async def session(http: aiohttp.ClientSession, url: str, s: Any) -> None:
        headers = {"X-Session-ID": session_key(s)}
        answers: list[str] = []
        for k in range(s.num_turns):
            if k > 0:
                await asyncio.sleep(s.think_s(k) * time_scale)
                if time.perf_counter() >= deadline:
                    break
            r = await _request(http, url, s.body(k, answers), headers, next(counter), s.group,
                               want_text=k + 1 < s.num_turns)
            results.append(r)
            if r.error:
                break
            answers.append(r.text)
            r.text = ""

    async def user(http: aiohttp.ClientSession, u: int) -> None:
        url = router_urls[u % len(router_urls)] + "/v1/chat/completions"
        while time.perf_counter() < deadline:
            s = next(sessions, None)
            if s is None:
                return
            await session(http, url, s)

    async def arrivals(http: aiohttp.ClientSession) -> None:
        running: set[asyncio.Task[None]] = set()
        for i, s in enumerate(sessions):
            at = t0 + s.start_s * time_scale
            if at >= deadline:
                break
            await asyncio.sleep(max(0.0, at - time.perf_counter()))
            task = asyncio.create_task(session(http, router_urls[i % len(router_urls)] + "/v1/chat/completions", s))
            running.add(task)
            task.add_done_callback(running.discard)
        if running:
            await asyncio.gather(*running)

    async def event(at: float, fn: Callable[[], Any]) -> None:
        await asyncio.sleep(max(0.0, t0 + at - time.perf_counter()))
        started = time.perf_counter() - t0
        try:
            what = await asyncio.to_thread(fn)
            log.append({"at_s": round(started, 3), "took_s": round(time.perf_counter() - t0 - started, 3),
                        "what": str(what)})
        except PeerError as exc:
            log.append({"at_s": round(started, 3), "error": str(exc)[:500]})

    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=timeout_s)) as http:
        drivers = [arrivals(http)] if users is None else [user(http, u) for u in range(users)]
        await asyncio.gather(*drivers, *(event(at, fn) for at, fn in events))
    first = min((r.start_s for r in results), default=t0)
    last = max((r.start_s + r.latency_s for r in results if r.latency_s is not None), default=first)
    return results, last - first, log
