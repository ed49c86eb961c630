"""The HTTP router: an aiohttp driver of the sans-I/O routing core.

Modules: :mod:`.app` (routes, handlers), :mod:`.proxy` (forwarding, streaming relay,
pooled client), :mod:`.headers` (header names, what crosses the proxy), :mod:`.errors`
(OpenAI and SageMaker error shapes), :mod:`.metrics` (Prometheus), :mod:`.health`
(active health checks), :mod:`.admin` (admin API), :mod:`.state` (live state,
reconfiguration), :mod:`.settings`, :mod:`.runner` (:func:`start_router`), :mod:`.cli`
(``prefixroute serve``), :mod:`.workers` (``serve --workers N``: supervisor and worker
processes).
"""

from prefixroute.server.runner import RouterHandle, reload_logged, start_router
from prefixroute.server.settings import ServerSettings

__all__ = ["RouterHandle", "ServerSettings", "reload_logged", "start_router"]
