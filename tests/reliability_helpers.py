"""Shared pieces of the reliability tests: routes to call, invariant checks, decoding.

The routes a fault scenario runs over (``ROUTES``):

* ``chat`` / ``chat_stream``: ``POST /v1/chat/completions``, JSON or SSE;
* ``native`` / ``native_stream``: ``POST /invocations`` (raw body in and out; the body's
  ``"stream": true`` makes the instance stream SSE, relayed as is);
* ``response_stream``: ``POST /endpoints/default/invocations-response-stream`` (AWS
  event-stream framing of the instance's streamed answer).
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson
from botocore.eventstream import EventStreamBuffer

from prefixroute.core.pool import Lease
from prefixroute.server import RouterHandle

from fault_backend import FaultBackend

ROUTES = ("chat", "chat_stream", "native", "native_stream", "response_stream")
STREAMING = ("chat_stream", "native_stream", "response_stream")
_ids = itertools.count()


@dataclass
class Outcome:
    """What the client got."""

    status: int
    headers: Any
    body: bytes = b""
    events: list[tuple[dict[str, str], bytes]] = field(default_factory=list)  # event-stream messages
    error: BaseException | None = None  # a broken transfer (truncated body)
    request_id: str = ""

    @property
    def json(self) -> Any:
        return orjson.loads(self.body)

    @property
    def payload(self) -> bytes:
        """Event-stream PayloadPart bytes joined (response_stream), else the body."""
        if self.events:
            return b"".join(p for h, p in self.events if h.get(":event-type") == "PayloadPart")
        return self.body


def request_for(route: str, prompt: str = "P" * 1500) -> tuple[str, bytes]:
    """``(path, body)`` of a request on ``route``."""
    stream = route in STREAMING
    if route.startswith("chat"):
        doc: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": prompt}], "stream": stream}
        return "/v1/chat/completions", orjson.dumps(doc)
    doc = {"inputs": prompt, "stream": stream}
    if route == "response_stream":
        return "/endpoints/default/invocations-response-stream", orjson.dumps(doc)
    return "/invocations", orjson.dumps(doc)


async def call(http: aiohttp.ClientSession, router: RouterHandle, route: str, *, prompt: str = "P" * 1500,
               timeout: float = 10.0, headers: dict[str, str] | None = None) -> Outcome:
    """Send one request on ``route`` and read the whole answer."""
    path, body = request_for(route, prompt)
    rid = f"rid-{next(_ids)}"
    hdrs = {"Content-Type": "application/json", "X-Request-Id": rid, **(headers or {})}
    async with asyncio.timeout(timeout):
        async with http.post(router.url + path, data=body, headers=hdrs) as r:
            out = Outcome(r.status, r.headers, request_id=rid)
            try:
                out.body = await r.read()
            except aiohttp.ClientPayloadError as exc:
                out.error = exc
    if route == "response_stream" and out.status == 200:
        buf = EventStreamBuffer()
        buf.add_data(out.body)
        out.events = [(dict(m.headers), m.payload) for m in buf]
    return out


def install_floor(monkeypatch: Any) -> dict[str, int]:
    """Record the lowest in-flight count any instance reaches after a lease release."""
    floor = {"min": 0, "releases": 0}
    original = Lease.release

    def release(self: Lease) -> None:
        original(self)
        floor["releases"] += 1
        floor["min"] = min(floor["min"], self.decision.instance.in_flight)

    monkeypatch.setattr(Lease, "release", release)
    return floor


def in_flight(handle: RouterHandle) -> int:
    return sum(p.total_in_flight() for _, p in handle.fleet.all_pools())


async def eventually(pred: Any, timeout: float = 3.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        await asyncio.sleep(0.01)
    return bool(pred())


async def assert_invariants(handle: RouterHandle, backends: list[FaultBackend], floor: dict[str, int],
                            refused_first: frozenset[str] = frozenset()) -> None:
    """After a scenario: every in-flight count is back to zero and never went negative,
    and no request id reached two instances (or one instance twice), but for ids in
    ``refused_first``: answered 429/503 by one instance and retried on another
    (``--retry-status``), at most once per instance."""
    assert await eventually(lambda: in_flight(handle) == 0), "in-flight did not return to zero"
    for _, pool in handle.fleet.all_pools():
        for inst in pool.instances:
            assert inst.in_flight == 0, inst
    assert floor["min"] >= 0, "an in-flight count went negative"
    seen = Counter(rid for b in backends for rid in b.ids() if rid is not None)
    dup = {rid: n for rid, n in seen.items() if n > (len(backends) if rid in refused_first else 1)}
    assert not dup, f"requests that reached more than one instance (or one twice): {dup}"


def sse_data(body: bytes) -> list[bytes]:
    """The ``data:`` payloads of an SSE body, in order."""
    out = []
    for event in body.split(b"\n\n"):
        for line in event.split(b"\n"):
            if line.startswith(b"data: "):
                out.append(line[6:])
    return out


async def metrics_text(http: aiohttp.ClientSession, handle: RouterHandle) -> str:
    async with http.get(handle.url + "/metrics") as r:
        return await r.text()
