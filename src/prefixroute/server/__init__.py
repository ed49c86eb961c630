"""The HTTP router: an aiohttp driver of the sans-I/O routing core.

Modules: :mod:`.app` (routes, handlers), :mod:`.proxy` (forwarding, streaming relay,
pooled client), :mod:`.headers` (header names, what crosses the proxy), :mod:`.errors`
(OpenAI and SageMaker error shapes), :mod:`.metrics` (Prometheus), :mod:`.health`
(active health checks), :mod:`.admin` (admin API), :mod:`.state` (live state,
reconfiguration), :mod:`.settings`, :mod:`.runner` (:func:`start_router`), :mod:`.cli`
(``prefixroute serve``), :mod:`.workers` (``serve --workers N``: supervisor and worker
processes).
"""

from typing import TYPE_CHECKING, Any

__all__ = ["RouterHandle", "ServerSettings", "reload_logged", "start_router"]

if TYPE_CHECKING:
    from prefixroute.server.runner import RouterHandle, reload_logged, start_router
    from prefixroute.server.settings import ServerSettings


def __getattr__(name: str) -> Any:
    """The package's exports, imported when first asked for (PEP 562): importing one
    module of the package (``prefixroute.server.headers``) does not import them all, and
    no module of the package depends on the package through this file."""
    if name == "ServerSettings":
        from prefixroute.server.settings import ServerSettings

        return ServerSettings
    if name in ("RouterHandle", "reload_logged", "start_router"):
        from prefixroute.server import runner

        return getattr(runner, name)
    raise AttributeError(f"module 'prefixroute.server' has no attribute {name!r}")
