"""The clients of ``bench/multi_model.py``: one request through the router, native or
OpenAI API, streamed or not (:func:`send`, its :class:`Result`), several workloads'
requests interleaved, and closed-loop users sending them.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import aiohttp
import orjson

from mm_settings import ENDPOINT
from prefixroute.workloads.shared_prefix import SharedPrefixWorkload


@dataclass
class Result:
    status: int = 0
    instance: str = ""
    component: str = ""
    first_byte_s: float | None = None
    latency_s: float | None = None
    error: str = ""
    retry_after_s: float = 0.0
    # the router's own time on the request, wall seconds: its X-Prefixroute-Overhead-Ms
    # (routing, and any wait for an adapter load), or, for an answer the router gave itself
    # (a 429: no X-Prefixroute-Instance), the time to its headers; None if unknown
    router_wait_s: float | None = None


async def send(http: aiohttp.ClientSession, router: str, body: dict[str, Any], api: str, stream: bool,
               component: str | None) -> Result:
    """One request in the API's own form: the OpenAI chat route (the component's path on a
    component endpoint) or SageMaker's ``invocations`` / ``invocations-response-stream``
    (the component in ``X-Amzn-SageMaker-Inference-Component``)."""
    headers = {"Content-Type": "application/json"}
    if api == "openai":
        path = (f"/endpoints/{ENDPOINT}/inference-components/{component}/openai/v1/chat/completions" if component
                else f"/endpoints/{ENDPOINT}/openai/v1/chat/completions")
    else:
        path = f"/endpoints/{ENDPOINT}/invocations" + ("-response-stream" if stream else "")
        if component:
            headers["X-Amzn-SageMaker-Inference-Component"] = component
    payload = dict(body, stream=stream)
    res = Result()
    t0 = time.perf_counter()
    try:
        async with http.post(router + path, data=orjson.dumps(payload), headers=headers) as r:
            t_headers = time.perf_counter() - t0
            res.status = r.status
            overhead = r.headers.get("X-Prefixroute-Overhead-Ms")
            if overhead is not None:
                res.router_wait_s = float(overhead) / 1000
            elif r.status != 200 and "X-Prefixroute-Instance" not in r.headers:
                res.router_wait_s = t_headers
            retry = r.headers.get("Retry-After", "")
            res.retry_after_s = float(retry) if retry.isdigit() else 0.0
            res.instance = r.headers.get("X-Prefixroute-Instance", "")
            res.component = r.headers.get("X-Prefixroute-Inference-Component", "")
            head = b""
            async for chunk in r.content.iter_any():
                if chunk and res.first_byte_s is None:
                    res.first_byte_s = time.perf_counter() - t0
                if r.status != 200 and len(head) < 300:
                    head += chunk
            if r.status != 200:
                res.error = f"HTTP {r.status}: {head[:200].decode('utf-8', 'replace')}"
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        res.error = f"{type(exc).__name__} after {time.perf_counter() - t0:.1f} s (instance {res.instance or '?'})"
    res.latency_s = time.perf_counter() - t0
    return res


def interleaved(workloads: Sequence[tuple[str | None, SharedPrefixWorkload]]) -> Iterator[tuple[str | None, dict]]:
    """Requests of several workloads (one per component, or one), alternating."""
    streams = [(c, w.requests(10**9)) for c, w in workloads]
    for c, it in itertools.cycle(streams):
        yield c, next(it).body


async def closed_loop(http: aiohttp.ClientSession, router: str, requests: Iterator[tuple[str | None, dict]],
                      users: int, duration_s: float, api: str, stream: bool) -> tuple[list[Result], float]:
    results: list[Result] = []
    t0 = time.perf_counter()
    deadline = t0 + duration_s

    async def user() -> None:
        while time.perf_counter() < deadline:
            component, body = next(requests)
            results.append(await send(http, router, body, api, stream, component))

    await asyncio.gather(*(user() for _ in range(users)))
    return results, time.perf_counter() - t0
