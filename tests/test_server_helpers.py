"""Shared pieces of the router tests: a scriptable fake instance and small utilities.

The fake instance (:class:`FakeInstance`) is a tiny aiohttp server whose behaviour the
test sets: echo the request, stream chunks gated by events, hold a response until a
gate opens, or answer with an error status. It counts handler cancellations, which is
how the tests see that the router closed the upstream connection.
"""

from __future__ import annotations

import asyncio
import socket
import time
from typing import Any, Callable

import orjson
from aiohttp import web
from multidict import CIMultiDict

from prefixroute.core.config import FleetConfig, RoutingConfig
from prefixroute.server import RouterHandle, ServerSettings, start_router

PA = RoutingConfig.build("prefix-aware", 1024, 4)


class FakeInstance:
    """A scriptable engine instance.

    Attributes:
        mode: ``echo`` (JSON with the request's path, headers and body), ``stream``
            (``chunks`` written one by one, each waiting for its event in ``gates``, as
            ``stream_content_type``),
            ``hold`` (wait for ``gate`` then echo), ``status`` (``status`` + ``body``).
        received: ``(path, headers, body)`` of every request.
        active: handlers running now. cancelled: handlers cancelled (client went away).
    """

    def __init__(self) -> None:
        self.mode = "echo"
        self.status = 500
        self.body = b'{"error": "boom"}'
        self.chunks: list[bytes] = [b"data: 1\n\n", b"data: 2\n\n", b"data: [DONE]\n\n"]
        self.gates: list[asyncio.Event] = []
        self.gate = asyncio.Event()
        self.sent: list[float] = []  # perf_counter of each streamed chunk write
        self.stream_content_type = "text/event-stream"  # of the ``stream`` mode's answer
        self.health_status = 200
        self.extra_headers: dict[str, str] = {}  # more response headers in echo mode
        # What GET /v1/models lists (the router routes a body's model among the instances
        # serving it): ids, or whole cards (a LoRA adapter's with its "parent"); None: no
        # /v1/models (404), as a SageMaker container may have none.
        self.models: list[str | dict[str, Any]] | None = ["fake", "m"]
        self.received: list[tuple[str, CIMultiDict[str], bytes]] = []
        self.active = 0
        self.cancelled = 0
        self.runner: web.AppRunner | None = None
        self.url = ""

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        self.received.append((request.path, CIMultiDict(request.headers), body))
        self.active += 1
        try:
            if self.mode == "hold":
                await self.gate.wait()
            if self.mode in ("echo", "hold"):
                return web.Response(
                    body=orjson.dumps({"path": request.path, "headers": {str(k): v for k, v in request.headers.items()},
                                       "body": body.decode("utf-8", "replace"), "instance": self.url}),
                    content_type="application/json", headers={"X-Amzn-SageMaker-Custom-Attributes": "attr=1",
                                                              "Connection": "keep-alive", "Keep-Alive": "timeout=5",
                                                              **self.extra_headers})
            if self.mode == "status":
                return web.Response(status=self.status, body=self.body, content_type="application/json")
            resp = web.StreamResponse(headers={"Content-Type": self.stream_content_type})
            await resp.prepare(request)
            for i, chunk in enumerate(self.chunks):
                if i < len(self.gates):
                    await self.gates[i].wait()
                self.sent.append(time.perf_counter())
                await resp.write(chunk)
            await resp.write_eof()
            return resp
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        finally:
            self.active -= 1

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(status=self.health_status)

    async def _models(self, request: web.Request) -> web.Response:
        if self.models is None:
            raise web.HTTPNotFound()
        return web.json_response({"object": "list", "data": [
            m if isinstance(m, dict) else {"id": m, "object": "model"} for m in self.models]})

    async def start(self) -> "FakeInstance":
        app = web.Application(client_max_size=64 * 1024 * 1024)
        for path in ("/v1/chat/completions", "/v1/completions", "/invocations"):
            app.router.add_post(path, self._handle)
        app.router.add_post("/{tail:.+}", self._handle)  # every other OpenAI route, echoed as well
        app.router.add_get("/health", self._health)
        app.router.add_get("/v1/models", self._models)
        self.runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=0.5)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{self.runner.addresses[0][1]}"
        return self

    async def stop(self) -> None:
        self.gate.set()
        for g in self.gates:
            g.set()
        if self.runner is not None:
            await self.runner.cleanup()


#: Sockets bound and never listening: their ports refuse connections for as long as the
#: tests run, and no server started later (a router on port 0) can be given them.
_REFUSING: list[socket.socket] = []


def closed_port_url() -> str:
    """A loopback URL on which nothing listens (connection refused). The port stays bound,
    not listening, until the process ends: a port merely freed could be given to the next
    server a test starts on port 0 (once the router under test itself, whose /health then
    answered for the "dead" instance)."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    _REFUSING.append(s)
    return f"http://127.0.0.1:{s.getsockname()[1]}"


def settings(**kw: Any) -> ServerSettings:
    """Test defaults: free ports, no active health checks, quick shutdown, seeded."""
    base: dict[str, Any] = dict(port=0, health_check_interval_s=0, metrics_scrape_interval_s=0, shutdown_timeout_s=1.0,
                                seed=7)
    base.update(kw)
    return ServerSettings(**base)


async def router_for(urls: list[str], routing: RoutingConfig = PA, **kw: Any) -> RouterHandle:
    return await start_router(FleetConfig.single(urls, routing), settings(**kw))


def in_flight(handle: RouterHandle) -> int:
    """Requests in flight over every pool of the router."""
    return sum(p.total_in_flight() for _, p in handle.fleet.all_pools())


async def eventually(pred: Callable[[], bool], timeout: float = 3.0) -> bool:
    """Poll ``pred`` every 10 ms until true or ``timeout`` seconds pass."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        await asyncio.sleep(0.01)
    return pred()


def metric_value(text: str, name: str, **labels: str) -> float | None:
    """The value of sample ``name{labels...}`` in Prometheus text, or None."""
    for line in text.splitlines():
        if line.startswith("#") or not line.startswith(name):
            continue
        head, _, value = line.rpartition(" ")
        metric, _, rest = head.partition("{")
        if metric != name:
            continue
        got = {}
        for part in filter(None, rest.rstrip("}").split(",")):
            k, _, v = part.partition("=")
            got[k] = v.strip('"')
        if all(got.get(k) == v for k, v in labels.items()):
            return float(value)
    return None


def test_gc_tuning_freezes_start_up_objects_and_raises_the_young_threshold() -> None:
    import json
    import subprocess
    import sys

    code = ("import gc, json; import prefixroute.server.runner; from prefixroute.server import gc_tuning as t; "
            "before = [gc.get_threshold()[0], gc.get_freeze_count()]; t.tune(); "
            "print(json.dumps([before, [gc.get_threshold()[0], gc.get_freeze_count()], t.GEN0_THRESHOLD]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    before, after, gen0 = json.loads(out)
    assert before == [700, 0]
    assert after[0] == gen0 == 10_000 and after[1] > 10_000  # the modules, classes and functions loaded
