"""The router's aiohttp application: routes and request handlers.

Routes (``{e}`` an endpoint name; without it, the default = first configured endpoint):

=================================================================  ==========================
``POST /v1/chat/completions``, ``POST /v1/completions``           OpenAI, default endpoint
``GET /v1/models``                                                 one healthy instance's list
``/endpoints/{e}/openai/v1/...``                                   the same, endpoint ``e``
``/endpoints/{e}/inference-components/{c}/openai/v1/...``          the same
``POST /endpoints/{e}/invocations``, ``POST /invocations``         SageMaker native
``GET /ping``, ``GET /health``                                     router liveness
``GET /metrics``                                                   Prometheus text
=================================================================  ==========================

A handler validates the request, computes the routing key (only for PREFIX_AWARE
variants) and hands it to :func:`prefixroute.server.proxy.forward`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from typing import Any, AsyncIterator

import orjson
from aiohttp import web

from prefixroute.core.config import RoutingStrategy
from prefixroute.core.endpoint import Endpoint, UnknownEndpoint, UnknownVariant
from prefixroute.core.keys import (
    InvalidRequest,
    completion_prompt,
    native_routing_key,
    openai_routing_key,
    validate_tenant_id,
)
from prefixroute.core.pool import VariantPool
from prefixroute.server import headers as H
from prefixroute.server.errors import json_response, openai_error, sagemaker_error
from prefixroute.server.health import health_check_loop
from prefixroute.server.metrics import CONTENT_TYPE
from prefixroute.server.proxy import Api, RoutedRequest, forward, forward_get, make_client_session
from prefixroute.server.state import RouterState

__all__ = ["STATE", "build_app", "validate_openai_body"]

log = logging.getLogger("prefixroute.server")

#: Where the :class:`RouterState` lives in the app.
STATE = web.AppKey("prefixroute_state", RouterState)

#: Largest request body accepted, bytes (long contexts and inline images are large).
MAX_REQUEST_BYTES = 64 * 1024 * 1024


def validate_openai_body(payload: dict[str, Any], chat: bool) -> None:
    """The checks a request gets when its variant computes no routing key.

    Raises:
        InvalidRequest: a field the router relies on has the wrong type.
    """
    if not isinstance(payload.get("model", ""), str):
        raise InvalidRequest("'model' must be a string")
    validate_tenant_id(payload.get("prompt_cache_key"))
    if chat:
        messages = payload.get("messages")
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            raise InvalidRequest("'messages' must be a list of message objects")
    else:
        completion_prompt(payload)


def _request_id(request: web.Request) -> str:
    return request.headers.get(H.REQUEST_ID) or uuid.uuid4().hex


def _count(state: RouterState, endpoint: str, variant: str, resp: web.Response) -> web.Response:
    state.metrics.responses.labels(endpoint, variant, str(resp.status)).inc()
    return resp


def _resolve(state: RouterState, request: web.Request) -> tuple[Endpoint, VariantPool]:
    endpoint = state.fleet.endpoint(request.match_info.get("endpoint"))
    return endpoint, endpoint.variant(request.headers.get(H.TARGET_VARIANT))


async def _openai_inference(request: web.Request, chat: bool) -> web.StreamResponse:
    t0 = time.perf_counter()
    state = request.app[STATE]
    rid = _request_id(request)
    hdrs = {H.REQUEST_ID: rid}
    try:
        endpoint, pool = _resolve(state, request)
    except UnknownEndpoint as exc:
        return _count(state, "unknown", "", openai_error(404, str(exc), code="endpoint_not_found", headers=hdrs))
    except UnknownVariant as exc:
        return _count(state, endpoint_label(state, request), "",
                      openai_error(400, str(exc), code="variant_not_found", headers=hdrs))
    body = await request.read()
    routing = pool.routing
    try:
        try:
            payload = orjson.loads(body)
        except orjson.JSONDecodeError as exc:
            raise InvalidRequest(f"request body is not valid JSON ({exc})") from None
        if not isinstance(payload, dict):
            raise InvalidRequest("request body must be a JSON object")
        if not isinstance(payload.get("stream", False), bool):
            raise InvalidRequest("'stream' must be a boolean")
        if routing.strategy is RoutingStrategy.PREFIX_AWARE and routing.prefix_aware is not None:
            key: int | None = openai_routing_key(payload, chat, routing.prefix_aware.prefix_length)
        else:
            validate_openai_body(payload, chat)
            key = None
    except InvalidRequest as exc:
        return _count(state, endpoint.name, pool.name,
                      openai_error(400, str(exc), headers={**hdrs, H.INVOKED_VARIANT: pool.name}))
    if state.settings.log_prompts and log.isEnabledFor(logging.DEBUG):
        log.debug("request %s prompt head: %r", rid, body[:512])
    path = "/v1/chat/completions" if chat else "/v1/completions"
    return await forward(state, RoutedRequest(request, Api.OPENAI, endpoint.name, pool, key, body, path, rid, t0))


def endpoint_label(state: RouterState, request: web.Request) -> str:
    """The endpoint name for metrics labels: configured names only, else ``unknown``."""
    name = request.match_info.get("endpoint")
    if name is None:
        return state.fleet.default_name
    return name if name in state.fleet.endpoints else "unknown"


async def chat_completions(request: web.Request) -> web.StreamResponse:
    """``POST .../v1/chat/completions`` (streaming or not)."""
    return await _openai_inference(request, chat=True)


async def completions(request: web.Request) -> web.StreamResponse:
    """``POST .../v1/completions`` (streaming or not)."""
    return await _openai_inference(request, chat=False)


async def models(request: web.Request) -> web.Response:
    """``GET .../v1/models``: the model list of one healthy instance of the endpoint."""
    state = request.app[STATE]
    rid = _request_id(request)
    try:
        _, pool = _resolve(state, request)
    except UnknownEndpoint as exc:
        return openai_error(404, str(exc), code="endpoint_not_found", headers={H.REQUEST_ID: rid})
    except UnknownVariant as exc:
        return openai_error(400, str(exc), code="variant_not_found", headers={H.REQUEST_ID: rid})
    return await forward_get(state, request, pool, "/v1/models", rid)


async def invocations(request: web.Request) -> web.StreamResponse:
    """SageMaker ``InvokeEndpoint``: raw body in, raw body out.

    Routing key: the first PrefixLength **bytes** of the body, scoped by endpoint and
    ``X-Amzn-SageMaker-Inference-Component``, with ``X-Amzn-SageMaker-Prefix-Aware-Id``
    as the tenant. Errors use SageMaker's shapes (``x-amzn-ErrorType``).
    """
    t0 = time.perf_counter()
    state = request.app[STATE]
    rid = _request_id(request)
    hdrs = {H.REQUEST_ID: rid}
    try:
        endpoint, pool = _resolve(state, request)
    except UnknownEndpoint as exc:
        return _count(state, "unknown", "", sagemaker_error("ValidationError", str(exc), status=404, headers=hdrs))
    except UnknownVariant as exc:
        return _count(state, endpoint_label(state, request), "", sagemaker_error("ValidationError", str(exc),
                                                                                 headers=hdrs))
    try:
        tenant = validate_tenant_id(request.headers.get(H.PREFIX_AWARE_ID))
    except InvalidRequest as exc:
        return _count(state, endpoint.name, pool.name,
                      sagemaker_error("ValidationError", f"{H.PREFIX_AWARE_ID}: {exc}", headers=hdrs))
    body = await request.read()
    routing = pool.routing
    key: int | None = None
    if routing.strategy is RoutingStrategy.PREFIX_AWARE and routing.prefix_aware is not None:
        component = request.headers.get(H.INFERENCE_COMPONENT)
        scope = f"{endpoint.name}:{component}" if component else endpoint.name
        key = native_routing_key(body, routing.prefix_aware.prefix_length, scope, tenant)
    return await forward(state, RoutedRequest(request, Api.NATIVE, endpoint.name, pool, key, body, "/invocations",
                                              rid, t0))


async def health(request: web.Request) -> web.Response:
    """``GET /health`` and ``GET /ping``: 200 if at least one instance is healthy, else 503."""
    healthy, total = request.app[STATE].healthy_counts()
    ok = healthy > 0
    return json_response(200 if ok else 503,
                         {"status": "ok" if ok else "unavailable", "healthy_instances": healthy, "instances": total})


async def metrics(request: web.Request) -> web.Response:
    """``GET /metrics``: Prometheus text exposition."""
    body = request.app[STATE].metrics.render()
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE})


async def _client_and_health_checks(app: web.Application) -> AsyncIterator[None]:
    state = app[STATE]
    state.session = make_client_session(state.settings)
    task: asyncio.Task[None] | None = None
    if state.settings.health_check_interval_s > 0:
        task = asyncio.create_task(health_check_loop(state), name="prefixroute-health-checks")
    try:
        yield
    finally:
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await state.session.close()
        state.session = None


def build_app(state: RouterState) -> web.Application:
    """The serving application for ``state``. The pooled upstream client is created on
    startup and closed on cleanup, with the health-check task."""
    app = web.Application(client_max_size=MAX_REQUEST_BYTES)
    app[STATE] = state
    app.cleanup_ctx.append(_client_and_health_checks)
    r = app.router
    for prefix in ("", "/endpoints/{endpoint}/openai", "/endpoints/{endpoint}/inference-components/{component}/openai"):
        r.add_post(prefix + "/v1/chat/completions", chat_completions)
        r.add_post(prefix + "/v1/completions", completions)
        r.add_get(prefix + "/v1/models", models, allow_head=False)
    r.add_post("/endpoints/{endpoint}/invocations", invocations)
    r.add_post("/invocations", invocations)
    r.add_get("/ping", health, allow_head=False)
    r.add_get("/health", health, allow_head=False)
    r.add_get("/metrics", metrics, allow_head=False)
    return app
