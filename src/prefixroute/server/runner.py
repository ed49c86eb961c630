"""Start and stop a router in the running event loop (tests, the demo, the CLI).

>>> handle = await start_router(FleetConfig.single([...], RoutingConfig.build("prefix-aware", 4096, 8)),
...                             ServerSettings(port=0))
>>> handle.url          # 'http://127.0.0.1:54321'
>>> await handle.close()
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import sys
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from prefixroute.server.worker_sockets import worker_socket_fallback_prefix, worker_socket_prefix
from prefixroute.core.config import ConfigError, FleetConfig, RoutingConfig
from prefixroute.core.counters import InFlightTable
from prefixroute.core.endpoint import Fleet
from prefixroute.server.admin import build_admin_app
from prefixroute.server.app import build_app
from prefixroute.server.request_body import close_receiving
from prefixroute.server.client import LINGER_S
from prefixroute.server.dataplane import FrontServer
from prefixroute.server.internal_socket import internal_socket_path
from prefixroute.server.settings import ServerSettings
from prefixroute.server.state import RouterState

__all__ = ["RouterHandle", "WorkerRuntime", "start_router", "reload_logged"]

log = logging.getLogger("prefixroute.server")


class _ServerLog(logging.LoggerAdapter):  # type: ignore[type-arg]
    """aiohttp's server logger (``aiohttp.server``), minus what a client sent.

    aiohttp logs a request it cannot parse (``HttpProcessingError``: ``BadHttpMessage``,
    ``LineTooLong``, ``InvalidHeader``...) as an ERROR with a traceback whose message
    quotes the raw bytes read: a body's prompt text, an ``Authorization`` header. Such a
    request is the client's error, not the router's: it is logged here in one INFO line,
    the peer, the status and the error's class, and never its text (with or without
    ``--log-prompts``). Every other record passes unchanged (a traceback of our own bug
    stays an ERROR)."""

    def log(self, level: int, msg: Any, *args: Any, **kwargs: Any) -> None:
        exc = kwargs.get("exc_info")
        if exc is True:
            exc = sys.exc_info()[1]
        elif isinstance(exc, tuple):
            exc = exc[1]
        if isinstance(exc, HttpProcessingError):
            del kwargs["exc_info"]
            level = min(level, logging.INFO)
            msg = f"{msg}: malformed HTTP request refused ({exc.code} {type(exc).__name__}; its text is not logged)"
        super().log(level, msg, *args, **kwargs)


#: The logger every aiohttp server of the router is given (:func:`_start`).
SERVER_LOG = _ServerLog(logging.getLogger("aiohttp.server"), {})


def _url(host: str, port: int) -> str:
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


@dataclass(frozen=True)
class WorkerRuntime:
    """What one worker process of ``serve --workers N`` adds to a router
    (:mod:`prefixroute.server.workers` makes it).

    Attributes:
        index: the worker's number, 0 to N - 1.
        counters: the shared in-flight table, attached with this worker's column.
        admin_token: token of the worker's own admin listener (loopback, ephemeral
            port), which only the supervisor calls.
        metrics_dir: prometheus-client's multiprocess directory
            (:func:`prefixroute.server.metrics.use_multiprocess_values` was called).
    """

    index: int
    counters: InFlightTable
    admin_token: str = field(repr=False)
    metrics_dir: str


@dataclass
class RouterHandle:
    """A running router.

    Attributes:
        url: base URL of the router, e.g. ``http://127.0.0.1:8080`` (no trailing slash).
        admin_url: base URL of the admin API, or ``None`` if disabled.
        state: the live :class:`RouterState` (``state.fleet``, ``state.metrics``...).
    """

    url: str
    admin_url: str | None
    state: RouterState
    _runners: list[web.AppRunner] = field(default_factory=list, repr=False)
    _front: FrontServer | None = field(default=None, repr=False)
    _socket_path: str | None = field(default=None, repr=False)
    _hurried: bool = field(default=False, repr=False)

    @property
    def fleet(self) -> Fleet:
        """The live fleet: endpoints, variant pools, per-instance in-flight counts."""
        return self.state.fleet

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1])

    def apply_config(self, config: FleetConfig) -> None:
        """Adopt a validated configuration (what ``PUT /admin/config`` does)."""
        self.state.apply_config(config)

    def set_routing(self, endpoint: str, variant: str, routing: RoutingConfig) -> FleetConfig:
        """Switch one variant's routing. Raises ``UnknownEndpoint``/``UnknownVariant``."""
        return self.state.set_routing(endpoint, variant, routing)

    def reload_config(self) -> FleetConfig:
        """Re-read ``settings.config_path`` (what SIGHUP does). Raises ``ConfigError``."""
        return self.state.reload_config_file()

    async def close(self) -> None:
        """Stop listening, let requests in flight finish (up to
        ``settings.shutdown_timeout_s``, or until :meth:`hurry`), then close the
        upstream client and remove the internal socket.

        Every port stops accepting at once (the public one and the admin API's), and
        their connections whose request is still arriving are closed at once (it
        reached no instance); the requests already read are waited for."""
        front = self._front
        timeout_s = self.state.settings.shutdown_timeout_s
        if front is not None:  # the public port first, before anything waits
            front.stop_listening()
        runners = list(self._runners)
        internal = runners[0] if front is not None and runners else None  # the fast plane's aiohttp app
        outer = [r for r in runners if r is not internal]  # the public aiohttp port, the admin API
        for runner in outer:
            await stop_accepting(runner)

        async def clean(runner: web.AppRunner, within_s: float) -> None:
            if self._hurried:
                _cut(runner)
            await cleanup_within(runner, within_s)

        async def drain_front() -> None:
            if front is not None:
                if self._hurried:
                    front.hurry()
                await front.close(timeout_s)
                self._front = None

        # The data plane and the admin API drain side by side (the admin API's own
        # requests: ADMIN_SHUTDOWN_S at most).
        results = await asyncio.gather(
            drain_front(), *(clean(r, timeout_s if front is None and i == 0 else ADMIN_SHUTDOWN_S)
                             for i, r in enumerate(outer)), return_exceptions=True)
        if internal is not None:
            results += await asyncio.gather(clean(internal, timeout_s), return_exceptions=True)
        self._runners.clear()
        errors = [r for r in results if isinstance(r, BaseException)]
        if self._socket_path is not None:
            with contextlib.suppress(OSError):
                os.unlink(self._socket_path)
                os.rmdir(os.path.dirname(self._socket_path))
            self._socket_path = None
        if errors:
            raise errors[0]

    def hurry(self) -> None:
        """Make a :meth:`close` under way (or the next one) stop waiting for the
        requests in flight: they are cut, their connections closed, as at the
        shutdown timeout. What a second SIGTERM/SIGINT does."""
        self._hurried = True
        if self._front is not None:
            self._front.hurry()
        for runner in self._runners:
            _cut(runner)


async def stop_accepting(runner: web.AppRunner) -> None:
    """The first step of stopping an aiohttp server: its ports stop accepting, its
    connections whose request body is still arriving are closed (see
    :func:`prefixroute.server.request_body.close_receiving`), and its idle keep-alive connections
    close (busy ones after their answer)."""
    for site in list(runner.sites):
        await site.stop()
    await close_receiving(runner.app)
    if runner.server is not None:
        runner.server.pre_shutdown()


async def cleanup_within(runner: web.AppRunner, within_s: float) -> None:
    """``runner.cleanup()``, its handlers still running cut after ``within_s`` seconds
    (aiohttp alone waits up to its shutdown timeout twice over: for the handler, then
    for its cancellation)."""
    deadline = asyncio.get_running_loop().call_later(within_s, _cut, runner)
    try:
        await runner.cleanup()
    finally:
        deadline.cancel()


def _cut(runner: web.AppRunner) -> None:
    """Close every connection of ``runner``'s server (its handlers are cancelled:
    ``handler_cancellation``), so that its cleanup does not wait for them."""
    server = runner.server
    if server is not None:
        for conn in server.connections:
            conn.force_close()


def reload_keys_logged(state: RouterState) -> bool:
    """Re-read the API keys (what SIGHUP does besides the configuration): log what
    changed, or the error (the keys in force are kept). True unless it failed."""
    try:
        changed = state.reload_keys()
    except ConfigError as exc:
        log.error("API keys reload failed, keeping the keys in force: %s", exc)
        return False
    if changed is not None:
        log.warning("API keys reloaded: %s", changed)
    return True


def reload_logged(state: RouterState) -> bool:
    """SIGHUP's action: re-read the config file (if the router was started with one)
    and the API keys; on error log it and keep what is in force. Returns True if both
    reloads that apply succeeded."""
    ok = reload_keys_logged(state)
    if state.settings.config_path is None and state.clients is not None:
        return ok  # keys only: nothing else to re-read
    try:
        state.reload_config_file()
    except ConfigError as exc:
        log.error("configuration reload failed, keeping the running configuration: %s", exc)
        return False
    return ok


async def reload_logged_waiting(state: RouterState) -> bool:
    """:func:`reload_logged` for a worker of ``serve --workers N``: a change that finds
    the shared in-flight table full waits for the other workers, which reload at the
    same time, to let go of slots (:func:`prefixroute.server.admin.apply_waiting`)."""
    from prefixroute.server.admin import apply_waiting

    ok = reload_keys_logged(state)
    if state.settings.config_path is None and state.clients is not None:
        return ok
    try:
        config = state.read_config_file()  # once: only applying it is tried again
        await apply_waiting(lambda: state.apply_config(config))
    except ConfigError as exc:
        log.error("configuration reload failed, keeping the running configuration: %s", exc)
        return False
    return ok


async def _start(app: web.Application, host: str, port: int, shutdown_timeout_s: float,
                 reuse_port: bool = False, unix_path: str | None = None,
                 keepalive_timeout_s: float = 75.0, auto_decompress: bool = True) -> tuple[web.AppRunner, int]:
    # lingering_time: after an answer to a request whose body was not read (404, 405, a
    # declared body over the limit), what the client still sends is read and dropped
    # this long before closing, as on the fast plane (aiohttp's default, 10 s, also held
    # a shutdown up that long).
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=shutdown_timeout_s,
                           keepalive_timeout=keepalive_timeout_s, auto_decompress=auto_decompress, logger=SERVER_LOG,
                           lingering_time=LINGER_S)
    await runner.setup()
    try:
        site: web.BaseSite
        if unix_path is not None:
            site = web.UnixSite(runner, unix_path)
        else:
            site = web.TCPSite(runner, host, port, reuse_port=reuse_port or None)
        await site.start()
    except BaseException:
        await runner.cleanup()
        raise
    return runner, 0 if unix_path is not None else int(runner.addresses[0][1])


#: How long the admin API's requests in flight may take to finish when the router stops.
ADMIN_SHUTDOWN_S = 1.0


async def start_router(config: FleetConfig, settings: ServerSettings | None = None, *,
                       worker: WorkerRuntime | None = None) -> RouterHandle:
    """Start the router (and its admin API) on the running event loop.

    Args:
        config: the validated fleet configuration.
        settings: process settings; default ``ServerSettings()`` (port 8080).
        worker: set in a worker process of ``serve --workers N``: in-flight counts go
            to the shared table, the port is bound with ``SO_REUSEPORT``, and the
            admin API listens on a loopback ephemeral port with ``worker.admin_token``
            (the supervisor serves the public one; ``settings.admin_*`` are ignored).

    Returns:
        A :class:`RouterHandle`; ``await handle.close()`` to stop.

    Raises:
        OSError: a port is in use or the address cannot be bound.
        prefixroute.core.counters.InFlightTableFull: (``worker``) no room in the table.
    """
    settings = settings or ServerSettings()
    if worker is not None:
        state = RouterState(config, settings, counters=worker.counters, metrics_dir=worker.metrics_dir)
    else:
        state = RouterState(config, settings)
    if settings.data_plane == "fast":
        # The aiohttp app behind the fast data plane, on a private Unix socket.
        # A worker's is in the supervisor's private directory, which goes with the
        # supervisor; the supervisor removes a dead worker's (worker_socket_prefix).
        if worker is None:
            socket_path = internal_socket_path()
        else:
            socket_path = internal_socket_path(worker.metrics_dir, worker_socket_prefix(worker.index),
                                               worker_socket_fallback_prefix(os.getppid(), worker.index))
        runner, _ = await _start(build_app(state), "", 0, settings.shutdown_timeout_s, unix_path=socket_path,
                                 auto_decompress=False)  # request bodies: request_body.read_body decodes them
        handle = RouterHandle("", None, state, [runner], _socket_path=socket_path)
        front = FrontServer(state, socket_path)
        try:
            port = await front.start(settings.host, settings.port, reuse_port=worker is not None)
        except BaseException:
            await front.close(0)
            await handle.close()
            raise
        handle._front = front
        handle.url = _url(settings.host, port)
    else:
        runner, port = await _start(build_app(state), settings.host, settings.port, settings.shutdown_timeout_s,
                                    reuse_port=worker is not None,
                                    keepalive_timeout_s=settings.client_keepalive_timeout_s,
                                    auto_decompress=False)  # request bodies: request_body.read_body decodes them
        handle = RouterHandle(_url(settings.host, port), None, state, [runner])
    if worker is not None:
        try:
            admin_runner, admin_port = await _start(build_admin_app(state, token=worker.admin_token), "127.0.0.1",
                                                    0, ADMIN_SHUTDOWN_S,
                                                    auto_decompress=False)  # admin.read_admin_body decodes
        except BaseException:
            await handle.close()
            raise
        handle._runners.append(admin_runner)
        handle.admin_url = _url("127.0.0.1", admin_port)
    elif settings.admin_enabled:
        admin_port = settings.admin_port
        if admin_port is None:
            admin_port = port + 1 if settings.port else 0
        try:
            admin_runner, admin_port = await _start(build_admin_app(state), settings.admin_host, admin_port,
                                                    ADMIN_SHUTDOWN_S, auto_decompress=False)  # read_admin_body decodes
        except BaseException:
            await handle.close()
            raise
        handle._runners.append(admin_runner)
        handle.admin_url = _url(settings.admin_host, admin_port)
    return handle
