"""Settings of the HTTP router process (everything that is not routing configuration).

Routing configuration (endpoints, variants, strategies) is a
:class:`prefixroute.core.config.FleetConfig`; this module holds how the router listens,
checks health, talks to instances and shuts down.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass

from prefixroute.core.config import ConfigError

__all__ = ["ServerSettings", "is_loopback"]


def is_loopback(host: str) -> bool:
    """True for ``localhost`` and loopback IP literals (``127.0.0.0/8``, ``::1``)."""
    if host.strip().lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True, slots=True)
class ServerSettings:
    """How the router process runs.

    Attributes:
        host: address the router listens on.
        port: router port; ``0`` picks a free port (read it from ``RouterHandle.url``).
        admin_host: address of the admin listener.
        admin_port: admin port; ``None`` = router port + 1 (a free port when ``port`` is 0);
            ``0`` disables the admin listener.
        admin_token: bearer token the admin API requires (``Authorization: Bearer ...``);
            mandatory when ``admin_host`` is not a loopback address.
        health_check_interval_s: seconds between active health checks of every
            instance; ``0`` disables them (then an instance marked unhealthy after a
            refused connection stays out of rotation until reconfigured).
        health_check_timeout_s: timeout of one health check, seconds.
        health_check_path: path probed on each instance (``GET``; 200 = healthy).
        connect_timeout_s: timeout of opening a connection to an instance, seconds.
        read_timeout_s: longest silence while reading an instance's response, seconds;
            ``None`` = no limit (long generations, slow streams).
        max_connections: most upstream connections open at once (all instances).
        keepalive_timeout_s: how long an idle upstream connection is kept for reuse,
            seconds. Below uvicorn's 5 s default so that we never reuse a connection
            the engine is about to close.
        shutdown_timeout_s: on shutdown, how long requests in flight may take to
            finish before they are cancelled, seconds.
        seed: seed of the random choices (variant by weight, RANDOM strategy, ties).
        log_prompts: allow prompt text in DEBUG logs (off: prompts never reach logs).
        config_path: the YAML file the configuration came from; SIGHUP and
            ``POST /admin/reload`` re-read it.
    """

    host: str = "127.0.0.1"
    port: int = 8080
    admin_host: str = "127.0.0.1"
    admin_port: int | None = None
    admin_token: str | None = None
    health_check_interval_s: float = 5.0
    health_check_timeout_s: float = 2.0
    health_check_path: str = "/health"
    connect_timeout_s: float = 5.0
    read_timeout_s: float | None = None
    max_connections: int = 4096
    keepalive_timeout_s: float = 4.0
    shutdown_timeout_s: float = 30.0
    seed: int | None = None
    log_prompts: bool = False
    config_path: str | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"port: {self.port} is out of range (allowed 0-65,535)")
        if self.admin_port is not None and not 0 <= self.admin_port <= 65535:
            raise ConfigError(f"admin port: {self.admin_port} is out of range (allowed 0-65,535)")
        if self.health_check_interval_s < 0:
            raise ConfigError(f"health check interval: {self.health_check_interval_s} s must be >= 0")
        if self.health_check_timeout_s <= 0:
            raise ConfigError(f"health check timeout: {self.health_check_timeout_s} s must be > 0")
        if not self.health_check_path.startswith("/"):
            raise ConfigError(f"health check path: {self.health_check_path!r} must start with '/'")
        if self.shutdown_timeout_s < 0:
            raise ConfigError(f"shutdown timeout: {self.shutdown_timeout_s} s must be >= 0")
        if self.max_connections < 1:
            raise ConfigError(f"max connections: {self.max_connections} must be >= 1")
        if self.admin_enabled and not is_loopback(self.admin_host) and not self.admin_token:
            raise ConfigError(
                f"admin host {self.admin_host!r} is not a loopback address: an admin token is required "
                "(--admin-token or PREFIXROUTE_ADMIN_TOKEN), or use --admin-port 0 to disable the admin API"
            )

    @property
    def admin_enabled(self) -> bool:
        """False when ``admin_port`` is 0."""
        return self.admin_port != 0
