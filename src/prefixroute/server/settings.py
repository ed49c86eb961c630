"""Settings of the HTTP router process (everything that is not routing configuration).

Routing configuration (endpoints, variants, strategies) is a
:class:`prefixroute.core.config.FleetConfig`; this module holds how the router listens,
checks health, talks to instances, limits requests and shuts down.

Every duration is in seconds and must be finite; the defaults are documented on the
fields of :class:`ServerSettings` and in docs/RELIABILITY.md.
"""

from __future__ import annotations

import ipaddress
import math
from dataclasses import dataclass, field

from prefixroute.core.approx_cache import BYTES_PER_BLOCK_ENTRY, DEFAULT_ROUTER_VIEW_BYTES
from prefixroute.core.config import ConfigError
from prefixroute.core.counters import MAX_WORKERS

__all__ = ["ServerSettings", "is_loopback", "DEFAULT_MAX_BODY_BYTES", "DEFAULT_CLIENT_KEEPALIVE_S", "DATA_PLANES"]

#: Values of ``ServerSettings.data_plane`` (``--data-plane``).
DATA_PLANES = ("fast", "aiohttp")

#: Default largest request body, bytes: a 128k-token context is about 0.5 MB of text,
#: a few inline base64 images add a few MB each; 64 MiB leaves room for both.
DEFAULT_MAX_BODY_BYTES = 64 * 1024 * 1024
#: Seconds an idle client connection is kept open by default (aiohttp's keep-alive).
DEFAULT_CLIENT_KEEPALIVE_S = 75.0


def is_loopback(host: str) -> bool:
    """True for ``localhost`` and loopback IP literals (``127.0.0.0/8``, ``::1``)."""
    if host.strip().lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _duration(name: str, value: float | None, *, positive: bool = False, optional: bool = False) -> None:
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ConfigError(f"{name}: {value!r} is not a finite number of seconds")
    if positive and value <= 0:
        raise ConfigError(f"{name}: {value} s must be > 0")
    if value < 0:
        raise ConfigError(f"{name}: {value} s must be >= 0")


def _count(name: str, value: int, lo: int, hi: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < lo or (hi is not None and value > hi):
        allowed = f"{lo:,}-{hi:,}" if hi is not None else f">= {lo:,}"
        raise ConfigError(f"{name}: {value!r} is out of range (allowed {allowed})")


@dataclass(frozen=True, slots=True)
class ServerSettings:
    """How the router process runs.

    Attributes:
        host: address the router listens on.
        port: router port, 0-65,535; ``0`` picks a free port (read it from ``RouterHandle.url``).
        admin_host: address of the admin listener.
        admin_port: admin port; ``None`` = router port + 1 (a free port when ``port`` is 0;
            an error when ``port`` is 65,535); ``0`` disables the admin listener.
        admin_token: bearer token the admin API requires (``Authorization: Bearer ...``);
            mandatory when ``admin_host`` is not a loopback address. Never forwarded
            upstream, logged or shown (``repr`` hides it).
        health_check_interval_s: seconds between active health checks of every
            instance; ``0`` disables them (then only a connection that cannot be opened
            takes an instance out, and it stays out until reconfigured).
        health_check_timeout_s: timeout of one health check, seconds.
        health_check_path: path probed on each instance (``GET``; 2xx = healthy):
            ``/health`` for vLLM and SGLang, ``/ping`` for SageMaker containers.
        unhealthy_threshold: consecutive failed checks (active, or passive timeouts and
            resets) that take an instance out of rotation. A refused connection takes
            it out at once.
        healthy_threshold: consecutive successful active checks that put an instance
            that is out of rotation back in.
        connect_timeout_s: timeout of opening a connection to an instance, seconds.
        response_headers_timeout_s: longest wait from sending a request to the
            instance's response headers, seconds. A non-streaming generation sends its
            headers only when it is done, so this bounds the whole generation: 600 s.
        stream_idle_timeout_s: longest silence between two chunks of a response body,
            seconds (there is no total timeout: a stream lasts as long as tokens flow).
        max_retries: most retries on another instance, only when the failed instance
            cannot have started the request (connection refused or never opened, or the
            request body could not be sent in full).
        retry_statuses: answers retried on an instance not tried yet, before any byte of
            them reaches the client and within ``max_retries`` (429 and/or 503; empty,
            the default: relayed as SageMaker does); the instance that gave one is held
            back from new requests for its ``Retry-After``
            (:mod:`prefixroute.core.retry_status`).
        client_send_timeout_s: longest a client may leave an answer unread (the router's
            writes to it blocked by flow control), seconds: then its connection is closed,
            the instance's request aborted and the slot freed.
        max_body_bytes: largest request body accepted, bytes; larger ones get 413.
        max_connections: most upstream connections open at once (all instances).
        keepalive_timeout_s: how long an idle upstream connection is kept for reuse,
            seconds. Below uvicorn's 5 s default so that we never reuse a connection
            the engine is about to close.
        client_keepalive_timeout_s: how long an idle client connection is kept open,
            seconds (aiohttp's 75 s by default), and how long a request that stops
            arriving part-way is waited for before a 408 and the close (the aiohttp data
            plane closes a request head cut short without an answer). Behind a load balancer, set it above the balancer's own idle timeout,
            or the balancer may send a request on a connection the router is closing.
        shutdown_timeout_s: on shutdown, how long requests in flight may take to
            finish before they are cancelled, seconds.
        metrics_scrape_interval_s: seconds between scrapes of every instance's
            ``/metrics`` (prefix-cache counters, running/waiting); ``0`` disables.
        metrics_scrape_timeout_s: timeout of one scrape, seconds.
        seed: seed of the random choices (variant by weight, RANDOM strategy, ties).
        log_prompts: allow prompt text (the first 512 bytes of a body) in DEBUG logs,
            on every route (off: prompts never reach logs).
        config_path: the YAML file the configuration came from; SIGHUP and
            ``POST /admin/reload`` re-read it.
        record_trace: append a JSONL trace of routed requests (digests, never prompt
            text; :mod:`prefixroute.server.trace`) to this file, or ``None``. With
            several workers each writes its own file (``NAME.worker-I.EXT``).
        access_log: append one JSON line per request (:mod:`prefixroute.server.accesslog`)
            to this file, ``"-"`` for standard output, or ``None``. Several workers
            append to the same file (whole lines per write).
        otel_traces: export OpenTelemetry spans of each request
            (:mod:`prefixroute.server.otel`; the ``otel`` extra, ``OTEL_*`` variables).
        api_keys_file: YAML file of client API keys and their limits
            (:mod:`prefixroute.server.clientkeys`), re-read on SIGHUP; with it (or keys
            in ``$PREFIXROUTE_API_KEYS``) the inference routes and ``/v1/models``
            require a key. ``None``: keys from the environment only, if any.
        workers: router processes sharing the port (1-64). ``1``: one process, as
            always. More: a supervisor starts that many worker processes on the same
            port (``SO_REUSEPORT``) sharing their in-flight counts
            (:mod:`prefixroute.server.workers`, docs/WORKERS.md); only
            :func:`prefixroute.server.cli.run` acts on it, ``start_router`` always
            runs one.
        worker_timeout_s: with ``workers`` > 1, seconds a serving worker may go
            without answering the supervisor's probe (its admin API, asked every
            quarter of this) before it is killed (SIGKILL) and restarted: a worker whose
            event loop a bug blocks, or that is stopped (SIGSTOP), would otherwise keep
            its share of the port's new connections, which would hang. 0: never;
            else at least 1 s.
        session_header: a request header whose value pins a session to one instance
            (e.g. ``X-Session-ID``), on every route, as SageMaker's
            ``X-Amzn-SageMaker-Session-Id`` (always honoured) does; ``None``: none.
        cache_aware_memory_bytes: ceiling on the memory of every ``CACHE_AWARE`` view of
            this router process together, bytes (each view also keeps its own bound;
            with ``workers`` > 1, per worker).
        data_plane: ``"fast"`` (default): the public port runs on raw asyncio
            protocols with httptools, inference requests relayed there and everything
            else passed to the aiohttp app (:mod:`prefixroute.server.dataplane`);
            ``"aiohttp"``: the aiohttp app serves the port itself (the reference
            implementation: the same routing, errors and metrics, about twice the CPU
            per request).
        unknown_model: what an OpenAI request whose ``model`` no instance lists (in its
            ``/v1/models``) gets: ``"reject"`` (default): 404 ``model_not_found``;
            ``"any"``: routed among all the pool's instances (for engines that serve
            any name, such as SGLang and TGI with a single model).
    """

    host: str = "127.0.0.1"
    port: int = 8080
    admin_host: str = "127.0.0.1"
    admin_port: int | None = None
    admin_token: str | None = field(default=None, repr=False)
    health_check_interval_s: float = 5.0
    health_check_timeout_s: float = 2.0
    health_check_path: str = "/health"
    unhealthy_threshold: int = 2
    healthy_threshold: int = 2
    connect_timeout_s: float = 5.0
    response_headers_timeout_s: float = 600.0
    stream_idle_timeout_s: float = 300.0
    max_retries: int = 2
    retry_statuses: frozenset[int] = frozenset()
    client_send_timeout_s: float = 60.0
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_connections: int = 4096
    keepalive_timeout_s: float = 4.0
    client_keepalive_timeout_s: float = DEFAULT_CLIENT_KEEPALIVE_S
    shutdown_timeout_s: float = 30.0
    metrics_scrape_interval_s: float = 10.0
    metrics_scrape_timeout_s: float = 2.0
    seed: int | None = None
    log_prompts: bool = False
    config_path: str | None = None
    record_trace: str | None = None
    access_log: str | None = None
    otel_traces: bool = False
    api_keys_file: str | None = None
    workers: int = 1
    worker_timeout_s: float = 60.0
    data_plane: str = "fast"
    session_header: str | None = None
    cache_aware_memory_bytes: int = DEFAULT_ROUTER_VIEW_BYTES
    unknown_model: str = "reject"

    def __post_init__(self) -> None:
        _count("port", self.port, 0, 65535)
        if self.admin_port is not None:
            _count("admin port", self.admin_port, 0, 65535)
        elif self.port == 65535:
            raise ConfigError("admin port: the default (port + 1 = 65,536) is out of range; "
                              "give --admin-port (0 disables the admin API)")
        _duration("health check interval", self.health_check_interval_s)
        _duration("health check timeout", self.health_check_timeout_s, positive=True)
        if not self.health_check_path.startswith("/"):
            raise ConfigError(f"health check path: {self.health_check_path!r} must start with '/'")
        _count("unhealthy threshold", self.unhealthy_threshold, 1, 100)
        _count("healthy threshold", self.healthy_threshold, 1, 100)
        _duration("connect timeout", self.connect_timeout_s, positive=True)
        _duration("response headers timeout", self.response_headers_timeout_s, positive=True)
        _duration("stream idle timeout", self.stream_idle_timeout_s, positive=True)
        _count("max retries", self.max_retries, 0, 16)
        if not self.retry_statuses <= {429, 503}:
            raise ConfigError(f"retry status: {sorted(self.retry_statuses)} (allowed: 429, 503)")
        _duration("client send timeout (--client-send-timeout)", self.client_send_timeout_s, positive=True)
        _count("max body size", self.max_body_bytes, 1)
        _count("max connections", self.max_connections, 1)
        _duration("upstream keep-alive timeout (--upstream-keepalive-timeout)", self.keepalive_timeout_s, positive=True)
        _duration("client keep-alive timeout", self.client_keepalive_timeout_s, positive=True)
        _duration("shutdown timeout", self.shutdown_timeout_s)
        _duration("metrics scrape interval", self.metrics_scrape_interval_s)
        _duration("metrics scrape timeout", self.metrics_scrape_timeout_s, positive=True)
        _count("workers", self.workers, 1, MAX_WORKERS)
        _duration("worker timeout", self.worker_timeout_s)
        if 0 < self.worker_timeout_s < 1:
            raise ConfigError(f"worker timeout: {self.worker_timeout_s:g} s is too short for a probe to come back "
                              "(at least 1 s, or 0 to disable)")
        if self.session_header is not None and (not self.session_header or not all(
                c.isalnum() or c in "-_" for c in self.session_header)):
            raise ConfigError(f"session header: {self.session_header!r} is not a header name (letters, digits, - and _)")
        _count("CACHE_AWARE memory", self.cache_aware_memory_bytes, BYTES_PER_BLOCK_ENTRY)
        if self.unknown_model not in ("reject", "any"):
            raise ConfigError(f"unknown model: {self.unknown_model!r} is not one of reject, any")
        if self.data_plane not in DATA_PLANES:
            raise ConfigError(f"data plane: {self.data_plane!r} is not one of {', '.join(DATA_PLANES)}")
        if self.access_log is not None and not self.access_log:
            raise ConfigError("access log: give a file path, or '-' for standard output")
        if self.admin_token is not None and not self.admin_token:
            raise ConfigError("admin token: must not be empty")
        if self.admin_enabled and not is_loopback(self.admin_host) and not self.admin_token:
            raise ConfigError(
                f"admin host {self.admin_host!r} is not a loopback address: an admin token is required "
                "(PREFIXROUTE_ADMIN_TOKEN, --admin-token-file or --admin-token), or use --admin-port 0 "
                "to disable the admin API"
            )

    @property
    def admin_enabled(self) -> bool:
        """False when ``admin_port`` is 0."""
        return self.admin_port != 0
