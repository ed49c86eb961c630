"""The router's own answers to requests it sends to no instance: a 401 without a valid
API key, a 429 over a key's or tenant's limit, an error in the shape of the API of a
path (the 503 of a router shutting down among them), and :func:`count_answer`, which
counts each such answer (``responses_total``, ``request_duration_seconds``) and reports
it to the observers as refused. :func:`prefixroute.server.app.prepare_inference`, the
aiohttp app's handlers and the fast data plane answer with them.
"""

from __future__ import annotations

import time
from typing import Mapping

import orjson
from aiohttp import web

from prefixroute.server import headers as H
from prefixroute.server.clientkeys import Identity
from prefixroute.server.errors import json_response, openai_error, sagemaker_error
from prefixroute.server.limits import Refusal
from prefixroute.server.routes import Api
from prefixroute.server.state import RouterState

__all__ = ["count_answer", "error_for_path", "shutting_down_error", "throttled", "unauthorized"]


def count_answer(state: RouterState, endpoint: str, variant: str, resp: web.Response, t0: float,
                 who: Identity | None = None) -> web.Response:
    """An answer of the router's own, before anything was sent upstream: counted in
    ``responses_total`` and, as every answer, in ``request_duration_seconds``
    (``t0``: ``time.perf_counter()`` at the request's arrival), and reported to the
    observers (``who``: the API key it came with, if known). Returns ``resp``."""
    m = state.metrics
    t_end = time.perf_counter()
    m.responses.labels(endpoint, variant, str(resp.status)).inc()
    m.duration_seconds.labels(endpoint, variant).observe(t_end - t0)
    state.observers.refused(endpoint, variant, resp.status, _message_of(resp), resp.headers.get(H.REQUEST_ID), t0,
                            t_end, len(resp.body) if isinstance(resp.body, bytes) else 0,
                            None if who is None else {"client": who.name, "tenant": who.tenant})
    return resp


def unauthorized(api: Api, why: str, rid: str) -> web.Response:
    """The 401 for a request without a valid API key (``why``: ``missing`` or
    ``wrong``), in its API's shape, with ``WWW-Authenticate: Bearer``."""
    hdrs = {H.REQUEST_ID: rid, "WWW-Authenticate": "Bearer"}
    if why == "missing":
        msg = "missing API key: send Authorization: Bearer <key> or x-api-key: <key>"
    else:
        msg = "invalid API key"
    if api is Api.OPENAI:
        return openai_error(401, msg, code="invalid_api_key", headers=hdrs)
    kind = "MissingAuthenticationTokenException" if why == "missing" else "UnrecognizedClientException"
    return sagemaker_error(kind, msg, status=401, headers=hdrs)


def throttled(api: Api, refusal: Refusal, rid: str, variant: str | None = None) -> web.Response:
    """The 429 for a request over its key's or tenant's limit, in its API's shape
    (OpenAI: type ``requests``, code ``rate_limit_exceeded``; SageMaker:
    ``ThrottlingException``), with ``Retry-After`` (whole seconds)."""
    hdrs = {H.REQUEST_ID: rid, "Retry-After": str(refusal.retry_after_s)}
    if variant:
        hdrs[H.INVOKED_VARIANT] = variant
    what = "requests per second" if refusal.reason == "rate" else "concurrent requests"
    msg = (f"{'tenant' if refusal.scope == 'tenant' else 'API key'} limit on {what} reached; "
           f"retry after {refusal.retry_after_s} s")
    if api is Api.OPENAI:
        return openai_error(429, msg, type_="requests", code="rate_limit_exceeded", headers=hdrs)
    return sagemaker_error("ThrottlingException", msg, status=429, headers=hdrs)


def _message_of(resp: web.Response) -> str:
    """The ``message`` of one of the router's own JSON error answers (OpenAI's or
    SageMaker's shape), or ``""``."""
    try:
        doc = orjson.loads(resp.body) if isinstance(resp.body, bytes) else None
    except orjson.JSONDecodeError:
        return ""
    if isinstance(doc, dict):
        inner = doc.get("error")
        msg = inner.get("message") if isinstance(inner, dict) else doc.get("message")
        return msg if isinstance(msg, str) else ""
    return ""


def error_for_path(path: str, status: int, message: str, code: str, *, sagemaker_type: str = "ValidationError",
                   headers: Mapping[str, str] | None = None) -> web.Response:
    """An error in the shape the API of ``path`` uses: OpenAI's (``code``; type
    ``server_error`` for a 5xx, else ``invalid_request_error``), the SageMaker runtime's
    (``sagemaker_type``), or ``{"message": ...}``; with ``headers``."""
    if "/v1/" in path:
        return openai_error(status, message, type_="server_error" if status >= 500 else "invalid_request_error",
                            code=code, headers=headers)
    if path.startswith("/endpoints/") or path in ("/invocations", "/ping"):
        return sagemaker_error(sagemaker_type, message, status=status, headers=headers)
    return json_response(status, {"message": message}, headers)


def shutting_down_error(path: str, headers: dict[str, str] | None = None) -> web.Response:
    """The 503 for a request the router will not route because it is shutting down, in
    the shape of the API of ``path`` (OpenAI: code ``router_shutting_down``; SageMaker
    runtime: ``ServiceUnavailable``), with ``headers``."""
    return error_for_path(path, 503, "the router is shutting down: the request was not sent to any instance",
                          "router_shutting_down", sagemaker_type="ServiceUnavailable", headers=headers)
