"""``prefixroute epp``'s servers: the ext_proc gRPC service, gRPC health, and ``/metrics``.

- gRPC (``grpc.aio``): ``envoy.service.ext_proc.v3.ExternalProcessor/Process``, one
  :class:`prefixroute.epp.exchange.Exchange` per stream; the standard health service
  (``grpc.health.v1.Health``) with the services ``""``, ``liveness``, ``readiness``
  and ``envoy.service.ext_proc.v3.ExternalProcessor``: readiness (Kubernetes') is
  SERVING only while some variant has a healthy instance; the ext_proc service (what
  Envoy checks) while the picker runs, since with no healthy instance it answers the
  request itself (503, as ``serve``), and goes NOT_SERVING when it stops;
- HTTP (aiohttp): ``GET /metrics`` (the router's Prometheus families, the picker's
  decisions included) and ``GET /health``; the background work of ``serve`` runs here
  too: active health checks of the instances, engine ``/metrics`` scrapes, discovery.

The routing state is a :class:`prefixroute.server.state.RouterState`, exactly as in
``serve``: the same fleet configuration, strategies, in-flight counts and metrics.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass, field
from typing import AsyncIterator

import grpc
from aiohttp import web
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from prefixroute.core.config import FleetConfig
from prefixroute.discovery.manager import start_discovery
from prefixroute.epp.exchange import EppOptions, Exchange
from prefixroute.server.health import health_check_loop
from prefixroute.server.models import refresh_models
from prefixroute.server.metrics import CONTENT_TYPE
from prefixroute.server.client_session import make_client_session
from prefixroute.server.scrape import scrape_loop
from prefixroute.server.settings import ServerSettings
from prefixroute.server.state import RouterState

__all__ = ["EppHandle", "start_epp", "EXT_PROC_SERVICE", "HEALTH_SERVICES"]

log = logging.getLogger("prefixroute.epp")

#: The ext_proc service's full name (a gRPC health service name too).
EXT_PROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
#: Health service names answered.
HEALTH_SERVICES = ("", "liveness", "readiness", EXT_PROC_SERVICE)
#: The routing state in the HTTP app.
STATE: web.AppKey[RouterState] = web.AppKey("prefixroute_epp_state", RouterState)
#: How often readiness is recomputed, seconds.
READINESS_INTERVAL_S = 0.5


class _ExternalProcessor(pb_grpc.ExternalProcessorServicer):
    def __init__(self, handle: "EppHandle") -> None:
        self._handle = handle

    async def Process(self, request_iterator: AsyncIterator[pb.ProcessingRequest],  # noqa: N802 (gRPC's name)
                      context: grpc.aio.ServicerContext) -> AsyncIterator[pb.ProcessingResponse]:
        ex = Exchange(self._handle.state, self._handle.options)
        self._handle.streams += 1
        self._handle.open_streams += 1
        try:
            async for msg in request_iterator:
                for out in ex.handle(msg):
                    yield out
        finally:
            ex.close()  # every path: end of stream, Envoy reset, cancellation, shutdown
            self._handle.open_streams -= 1


@dataclass
class EppHandle:
    """A running picker.

    Attributes:
        address: ``host:port`` of the gRPC listener.
        metrics_url: base URL of the HTTP listener (``/metrics``, ``/health``), or ``None``.
        state: the routing state (``state.fleet``: pools and in-flight counts).
        streams: ext_proc streams served; ``open_streams``: those open now.
    """

    address: str
    metrics_url: str | None
    state: RouterState
    options: EppOptions
    streams: int = 0
    open_streams: int = 0
    _server: grpc.aio.Server | None = field(default=None, repr=False)
    _health: health.aio.HealthServicer | None = field(default=None, repr=False)
    _runner: web.AppRunner | None = field(default=None, repr=False)
    _ready_task: asyncio.Task[None] | None = field(default=None, repr=False)

    @property
    def port(self) -> int:
        return int(self.address.rsplit(":", 1)[1])

    def in_flight(self) -> int:
        """Requests holding an in-flight slot, over every pool."""
        return sum(p.total_in_flight() for _, p in self.state.fleet.all_pools())

    async def close(self, grace_s: float = 5.0) -> None:
        """Stop: readiness goes NOT_SERVING, open streams get ``grace_s`` seconds to end,
        then everything stops (their leases are released as the streams end)."""
        if self._ready_task is not None:
            self._ready_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._ready_task
        if self._health is not None:
            await self._health.enter_graceful_shutdown()
        if self._server is not None:
            await self._server.stop(grace_s)
            self._server = None
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None


async def _background(app: web.Application) -> AsyncIterator[None]:
    state = app[STATE]
    state.session = make_client_session(state.settings)
    with contextlib.suppress(TimeoutError):  # what each instance serves, before the first request
        async with asyncio.timeout(state.settings.health_check_timeout_s + 1.0):
            await refresh_models(state)
    tasks = []
    if state.settings.health_check_interval_s > 0:
        tasks.append(asyncio.create_task(health_check_loop(state), name="prefixroute-epp-health-checks"))
    if state.settings.metrics_scrape_interval_s > 0:
        tasks.append(asyncio.create_task(scrape_loop(state), name="prefixroute-epp-metrics-scrape"))
    discovery = start_discovery(state)
    try:
        yield
    finally:
        await discovery.close()
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t
        await state.session.close()
        state.session = None


def _http_app(state: RouterState) -> web.Application:
    app = web.Application()
    app[STATE] = state

    async def metrics(_: web.Request) -> web.Response:
        return web.Response(body=state.metrics.render(), headers={"Content-Type": CONTENT_TYPE})

    async def healthz(_: web.Request) -> web.Response:
        healthy, total = state.healthy_counts()
        status = 200 if healthy else 503
        return web.json_response({"status": "ok" if healthy else "no healthy instance", "healthy_instances": healthy,
                                  "instances": total}, status=status)

    app.router.add_get("/metrics", metrics)
    app.router.add_get("/health", healthz)
    app.cleanup_ctx.append(_background)
    return app


async def _readiness(handle: EppHandle, servicer: health.aio.HealthServicer) -> None:
    last = None
    while True:
        healthy, _ = handle.state.healthy_counts()
        status = health_pb2.HealthCheckResponse.SERVING if healthy else health_pb2.HealthCheckResponse.NOT_SERVING
        if status != last:
            await servicer.set("readiness", status)
            last = status
        await asyncio.sleep(READINESS_INTERVAL_S)


async def start_epp(config: FleetConfig, settings: ServerSettings, options: EppOptions = EppOptions(), *,
                    metrics_host: str | None = "127.0.0.1", metrics_port: int = 0) -> EppHandle:
    """Start the picker on the running event loop.

    Args:
        config: the validated fleet configuration (instances or ``Discovery``).
        settings: ``settings.host``/``settings.port`` is the gRPC listener (port 0:
            a free one); health checks, scrapes, body limit and seed as for ``serve``.
        options: the picker's own :class:`EppOptions`.
        metrics_host, metrics_port: the HTTP listener of ``/metrics`` and ``/health``
            (``metrics_host=None`` disables it, and with it health checks, scrapes and
            discovery).

    Raises:
        OSError / RuntimeError: a port cannot be bound.
    """
    state = RouterState(config, settings)
    handle = EppHandle("", None, state, options)
    # a request body comes in one message (BUFFERED), a decoded one goes back in one
    max_message = max(8 << 20, settings.max_body_bytes + (1 << 20))
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0), ("grpc.max_receive_message_length", max_message),
                                      ("grpc.max_send_message_length", max_message)])
    pb_grpc.add_ExternalProcessorServicer_to_server(_ExternalProcessor(handle), server)
    servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    host = settings.host
    bind = f"[{host}]:{settings.port}" if ":" in host else f"{host}:{settings.port}"
    port = server.add_insecure_port(bind)
    if port == 0:
        raise OSError(f"cannot listen on {bind}")
    await server.start()
    for name in ("", "liveness", EXT_PROC_SERVICE):
        await servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    handle._server, handle._health = server, servicer
    handle.address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    handle._ready_task = asyncio.create_task(_readiness(handle, servicer), name="prefixroute-epp-readiness")
    if metrics_host is not None:
        runner = web.AppRunner(_http_app(state), access_log=None, shutdown_timeout=1.0)
        await runner.setup()
        try:
            site = web.TCPSite(runner, metrics_host, metrics_port)
            await site.start()
        except BaseException:
            await runner.cleanup()
            await handle.close(0)
            raise
        handle._runner = runner
        mport = runner.addresses[0][1]
        handle.metrics_url = f"http://[{metrics_host}]:{mport}" if ":" in metrics_host else \
            f"http://{metrics_host}:{mport}"
    return handle
