"""The inference routes: which API a path belongs to, its endpoint, inference component
and OpenAI route. One parser for every driver (the aiohttp app, the fast data plane, the
Envoy endpoint picker), pure and without I/O.

=====================================================================  =================
path (``POST``)                                                        API
=====================================================================  =================
``/v1/...``, ``/tokenize``, ``/detokenize``                            OpenAI, default endpoint
``/endpoints/{E}/openai/v1/...`` (and ``.../openai/tokenize``...)      OpenAI, endpoint E
``/endpoints/{E}/inference-components/{IC}/openai/v1/...``             OpenAI, component IC
``/invocations``, ``/endpoints/{E}/invocations``                       SageMaker native
``/endpoints/{E}/invocations-response-stream``                         SageMaker, event stream
``/endpoints/{E}/inference-components/{IC}/invocations[-response-stream]``  the same, component IC
=====================================================================  =================

Under ``/v1`` every path is an inference route: the known OpenAI routes
(:class:`~prefixroute.core.openai_routes.OpenAIRoute`) are keyed on their input, any
other is relayed to an instance of the body's ``model`` (``OpenAIRoute.OTHER``).
"""

from __future__ import annotations

import enum
from typing import NamedTuple

from prefixroute.core.openai_routes import OpenAIRoute, route_for_path

__all__ = ["Api", "RouteMatch", "match_route"]


class Api(enum.Enum):
    """Which API a request came in on: decides headers passed, framing and error shapes."""

    OPENAI = "openai"
    NATIVE = "native"
    #: ``InvokeEndpointWithResponseStream``: the answer is re-framed as AWS event-stream.
    NATIVE_STREAM = "native_stream"


class RouteMatch(NamedTuple):
    """An inference route found in a path.

    Attributes:
        api: the API.
        route: the OpenAI route (``None`` on the native API).
        endpoint: the ``{E}`` of the path, ``None`` for the default endpoint.
        component: the ``{IC}`` of the path, or ``None``.
        tail: the path after its API prefix, as the instance serves it
            (``/v1/embeddings``, ``/tokenize``, ``/invocations``).
    """

    api: Api
    route: OpenAIRoute | None
    endpoint: str | None = None
    component: str | None = None
    tail: str = ""

    @property
    def chat(self) -> bool:
        """Whether it is ``/v1/chat/completions``."""
        return self.route is OpenAIRoute.CHAT


def _name_ok(part: str) -> bool:
    return bool(part) and "{" not in part and "}" not in part


def _openai(tail: str, endpoint: str | None, component: str | None) -> RouteMatch | None:
    route = route_for_path(tail)
    if route is None or tail.endswith("/"):
        return None
    return RouteMatch(Api.OPENAI, route, endpoint, component, tail)


def match_route(path: str) -> RouteMatch | None:
    """The inference route of ``path`` (no query string), or ``None`` if it is not one
    (``GET /v1/models`` and other reads are answered by the aiohttp app's own routes).

    >>> match_route("/endpoints/e1/inference-components/c/openai/v1/embeddings")[:4]
    (<Api.OPENAI: 'openai'>, <OpenAIRoute.EMBEDDINGS: '/v1/embeddings'>, 'e1', 'c')
    """
    if path == "/invocations":
        return RouteMatch(Api.NATIVE, None, None, None, "/invocations")
    if path.startswith("/v1/") or path in ("/tokenize", "/detokenize"):
        return _openai(path, None, None) if "%" not in path else None
    if not path.startswith("/endpoints/") or "%" in path:
        return None
    parts = path.split("/")  # ['', 'endpoints', e, ...]
    if len(parts) < 4 or not _name_ok(parts[2]):
        return None
    endpoint, rest = parts[2], parts[3:]
    component = None
    if len(rest) >= 2 and rest[0] == "inference-components":
        if not _name_ok(rest[1]):
            return None
        component, rest = rest[1], rest[2:]
    if rest == ["invocations"]:
        return RouteMatch(Api.NATIVE, None, endpoint, component, "/invocations")
    if rest == ["invocations-response-stream"]:
        return RouteMatch(Api.NATIVE_STREAM, None, endpoint, component, "/invocations")
    if len(rest) >= 2 and rest[0] == "openai":
        return _openai("/" + "/".join(rest[1:]), endpoint, component)
    return None
