"""The router's aiohttp application: routes and request handlers.

Routes (``{e}`` an endpoint name; without it, the default = first configured endpoint;
``{c}`` an inference component; :mod:`prefixroute.server.routes` parses them):

=================================================================  ==========================
``POST /v1/chat/completions``, ``/v1/completions``, ``/v1/embeddings``,
``/v1/responses``, ``/v1/rerank``, ``/v1/score``, ``/tokenize``,
``/detokenize``, any other ``POST /v1/...``                          OpenAI, default endpoint
``GET /v1/models``                                                 the instances' lists, merged
any other method on ``/v1/...``                                    relayed to one instance
``/endpoints/{e}/openai/v1/...``                                   the same, endpoint ``e``
``/endpoints/{e}/inference-components/{c}/openai/v1/...``          the same, component ``c``
``POST /endpoints/{e}/invocations``, ``POST /invocations``         SageMaker native
``POST /endpoints/{e}/invocations-response-stream``                SageMaker, AWS event-stream
``/endpoints/{e}/inference-components/{c}/invocations[...]``       the same, component ``c``
``GET /ping``, ``GET /health``                                     router liveness
``GET /metrics``                                                   Prometheus text
=================================================================  ==========================

A handler reads the body (at most ``max_body_bytes``; 413 beyond, before anything is
sent upstream or counted in flight), validates the request, selects the pool and the
candidate instances (component, model, adapter), computes the routing key
(PREFIX_AWARE) or block hashes (CACHE_AWARE) and hands it to
:func:`prefixroute.server.proxy.forward`.
Every error answer uses the API's shape: an OpenAI error object on ``/v1`` paths, a
SageMaker error (``x-amzn-ErrorType`` header, ``{"message": ...}``) on native paths,
``{"message": ...}`` JSON elsewhere (unknown paths included).

Request bodies (codings, limits, the reader) live in :mod:`prefixroute.server.request_body`,
the router's own refusals (:func:`count_answer`, :func:`error_for_path`, the 401 and the
429) in :mod:`prefixroute.server.refusals`; the names they had here (``read_body``,
``decode_request_body``, ``BodyTooLarge``, ``count_answer``...) import from this module
as before.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import urllib.parse
from random import getrandbits
from typing import Any, AsyncIterator, Awaitable, Callable, Mapping, Sequence

import orjson
from aiohttp import HttpVersion11, web

from prefixroute.core.config import RoutingConfig
from prefixroute.core.endpoint import Endpoint, UnknownComponent, UnknownEndpoint, UnknownVariant
from prefixroute.core.pool import VariantPool
from prefixroute.core.keys import loads_body, native_route, openai_route, openai_tenant, validate_tenant_id
from prefixroute.core.openai_routes import OpenAIRoute, keyed_view, scoped_model
from prefixroute.core.routing_text import InvalidRequest, completion_prompt
from prefixroute.core.selection import ComponentRequired, UnknownModel
from prefixroute.core.sessions import SessionPin, parse_session_id
from prefixroute.discovery.manager import start_discovery
from prefixroute.server import headers as H
from prefixroute.server.clientkeys import Identity
from prefixroute.server.errors import json_response, openai_error, sagemaker_error
from prefixroute.server.limits import Refusal
from prefixroute.server.health import health_check_loop, readiness
from prefixroute.server.lora import LoraManager
from prefixroute.server.metrics import CONTENT_TYPE
from prefixroute.server.models import refresh_models
from prefixroute.server.precise import attach_precise
from prefixroute.server.client_session import make_client_session
from prefixroute.server.proxy import Api, RoutedRequest, forward, forward_get
from prefixroute.server.request_body import (  # (re-exported: request bodies were this module's)
    ACCEPTED_CODINGS, DECODED_CODINGS, RECEIVING, BodyNotDecoded, BodyTimedOut, BodyTooLarge, close_receiving,
    close_receiving_on_shutdown, coding_refusal, decode_request_body, read_body, request_coding, transfer_coding,
    transfer_refused)
from prefixroute.server.refusals import count_answer, error_for_path, throttled, unauthorized  # (re-exported)
from prefixroute.server.routes import RouteMatch, match_route
from prefixroute.server.scrape import scrape_loop
from prefixroute.server.state import RouterState

__all__ = ["STATE", "DECODED_CODINGS", "ACCEPTED_CODINGS", "BodyNotDecoded", "BodyTimedOut", "BodyTooLarge", "build_app",
           "decode_request_body", "request_coding", "coding_refusal", "transfer_coding", "transfer_refused",
           "error_for_path", "parse_openai_request", "native_request_key", "prepare_inference", "request_id",
           "validate_openai_body", "count_answer", "read_body", "RECEIVING", "close_receiving",
           "close_receiving_on_shutdown"]

log = logging.getLogger("prefixroute.server")

#: Where the :class:`RouterState` lives in the app.
STATE = web.AppKey("prefixroute_state", RouterState)

_PROMPT_LOG_BYTES = 512  # with --log-prompts: how much of a body a DEBUG line shows


def validate_openai_body(payload: dict[str, Any], chat: bool) -> None:
    """The checks a request gets when its variant computes no routing key.

    Raises:
        InvalidRequest: a field the router relies on has the wrong type.
    """
    if not isinstance(payload.get("model", ""), str):
        raise InvalidRequest("'model' must be a string")
    openai_tenant(payload)
    if chat:
        messages = payload.get("messages")
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            raise InvalidRequest("'messages' must be a list of message objects")
    else:
        completion_prompt(payload)


_JSON_TYPES = {list: "an array", str: "a string", int: "a number", float: "a number", bool: "a boolean",
               type(None): "null"}


def _json_type(value: Any) -> str:
    """What ``value`` (parsed JSON) is, in JSON's terms: ``an array``, ``null``..."""
    return _JSON_TYPES.get(type(value), "an object" if isinstance(value, dict) else type(value).__name__)


def parse_openai_request(body: bytes, chat: bool | OpenAIRoute, routing: RoutingConfig, header_tenant: str = "",
                         component: str | None = None) -> tuple[dict[str, Any], int | None, Sequence[int]]:
    """Parse and validate an OpenAI request body; compute what its pool routes on.

    Args:
        body: the raw request body.
        chat: the route (``True``: ``/v1/chat/completions``, ``False``:
            ``/v1/completions``, or an :class:`~prefixroute.core.openai_routes.OpenAIRoute`).
        routing: the pool's routing configuration.
        header_tenant: a validated ``X-Amzn-SageMaker-Prefix-Aware-Id``, or ``""``.
        component: the inference component, which takes part in the key, or ``None``.

    Returns:
        ``(payload, key, blocks)``: the parsed JSON object, the 64-bit key
        (PREFIX_AWARE) or ``None``, and the chained block hashes (CACHE_AWARE) or ``[]``
        (:func:`route_key`).

    Raises:
        InvalidRequest: not JSON, not an object, or a field with the wrong type; the
            message names the problem (never quoting prompt text).
    """
    route = chat if isinstance(chat, OpenAIRoute) else (OpenAIRoute.CHAT if chat else OpenAIRoute.COMPLETIONS)
    payload = _openai_payload(body, route)
    if payload is None:
        return {}, None, []
    key, blocks = route_key(payload, route, routing, header_tenant, component)
    return payload, key, blocks


def native_request_key(body: bytes, routing: RoutingConfig, scope: str, tenant: str) -> tuple[int | None, list[int]]:
    """What a native request routes on: ``(key, blocks)`` from its first PrefixLength
    **bytes** (PREFIX_AWARE) or its byte blocks (CACHE_AWARE), never parsed (invalid
    UTF-8 is hashed as bytes), within ``scope`` (endpoint, inference component) and
    tenant (a validated ``X-Amzn-SageMaker-Prefix-Aware-Id`` or ``""``). Never raises."""
    return native_route(body, scope, tenant, routing)


def request_id(headers: Mapping[str, str]) -> str:
    """The client's ``X-Request-Id`` if worth propagating, else 32 new random hex
    digits (128 bits, as a uuid4 hex has; from ``random``: an id, not a secret)."""
    rid = headers.get(H.REQUEST_ID)
    return rid if rid is not None and H.valid_request_id(rid) else "%032x" % getrandbits(128)


def _log_prompt(rid: str, body: bytes) -> None:
    """``--log-prompts``: the head of a request body, at DEBUG."""
    if log.isEnabledFor(logging.DEBUG):
        log.debug("request %s prompt head: %r", rid, body[:_PROMPT_LOG_BYTES])


def _endpoint_label(state: RouterState, name: str | None) -> str:
    if name is None:
        return state.fleet.default_name
    return name if name in state.fleet.endpoints else "unknown"


def endpoint_label(state: RouterState, request: web.Request) -> str:
    """The endpoint name for metrics labels: configured names only, else ``unknown``."""
    return _endpoint_label(state, request.match_info.get("endpoint"))


def prepare_inference(state: RouterState, match: RouteMatch, headers: Mapping[str, str],
                      raw_headers: H.RawHeaders,
                      body: bytes | BodyTooLarge | BodyNotDecoded | BodyTimedOut | None, rid: str, t0: float,
                      request: web.Request | None = None, query: str = "") -> RoutedRequest | web.Response:
    """Everything between an inference request's arrival and its forwarding, for every
    driver: resolve the endpoint, the inference component or production variant, check
    the body's size, validate it, select the pool and candidates for its model
    (:class:`prefixroute.core.selection.Selector`: components, the instances serving the
    model, an adapter's sticky set) and compute what that pool's strategy routes on.

    Args:
        match: the route (:func:`prefixroute.server.routes.match_route`): API, OpenAI
            route, endpoint and inference component of the path.
        headers: the client's request headers.
        raw_headers: the same as received, ``(name, value)`` bytes.
        body: the body read, a :class:`BodyTooLarge` if it was over the limit, a
            :class:`BodyTimedOut` if it stopped arriving part-way, or ``None`` when
            not read yet (only the checks before the body are done; a
            :class:`RoutedRequest` with an empty body is returned if they pass).
        rid: the request id; ``t0``: ``time.perf_counter()`` at arrival.
        request: the aiohttp request, if it came through aiohttp.
        query: the request's query string (passed on for routes relayed as they are).

    Returns:
        The :class:`RoutedRequest` to forward, or the error response to send (already
        counted in ``prefixroute_responses_total``), in the API's shape: 404 unknown
        endpoint or (OpenAI ``model_not_found``) a model no instance serves, 400 unknown
        variant or inference component (SageMaker ``ValidationError`` on the native
        API), a native request to an endpoint with components that names none, an
        invalid request or a body its Content-Encoding does not decode, 408 a body that
        stopped arriving, 405 ``POST /v1/models``, 413 body too large, 415 a Content-Encoding not decoded here
        (checked before the body is read; :data:`DECODED_CODINGS`), 501 a
        Transfer-Encoding other than ``chunked``.
    """
    api = match.api
    openai = api is Api.OPENAI
    hdrs = {H.REQUEST_ID: rid}
    if openai and match.tail == "/v1/models":  # (every other POST under /v1 is routed)
        resp = openai_error(405, "method POST is not allowed on this path (allowed: GET)", code="method_not_allowed",
                            headers={**hdrs, "Allow": "GET"})
        return count_answer(state, "unknown", "", resp, t0)
    clients = state.clients
    who: Identity | None = None
    if clients is not None:  # the key first: no other answer tells a caller without one anything
        found = clients.identify(headers)
        if not isinstance(found, Identity):
            return count_answer(state, "unknown", "", unauthorized(api, found, rid), t0)
        who = found
    header_component = headers.get(H.INFERENCE_COMPONENT)
    component = match.component or header_component or None
    target = headers.get(H.TARGET_VARIANT)
    try:
        endpoint = state.fleet.endpoint(match.endpoint)
        if match.component and header_component and header_component != match.component:
            raise UnknownComponent(f"the path names inference component {match.component!r} and "
                                   f"{H.INFERENCE_COMPONENT} names {header_component!r}")
        pool = endpoint.component(component) if component else endpoint.variant(target)
        if component and target:  # checked as without a component (the component says where it goes)
            endpoint.variant(target)
    except UnknownEndpoint as exc:
        resp = openai_error(404, str(exc), code="endpoint_not_found", headers=hdrs) if openai else \
            sagemaker_error("ValidationError", str(exc), status=404, headers=hdrs)
        return count_answer(state, "unknown", "", resp, t0)
    except UnknownVariant as exc:
        resp = openai_error(400, str(exc), code="variant_not_found", headers=hdrs) if openai else \
            sagemaker_error("ValidationError", str(exc), headers=hdrs)
        return count_answer(state, _endpoint_label(state, match.endpoint), "", resp, t0)
    except UnknownComponent as exc:
        resp = openai_error(400, str(exc), code="inference_component_not_found", headers=hdrs) if openai else \
            sagemaker_error("ValidationError", str(exc), headers=hdrs)
        return count_answer(state, endpoint.name, "", resp, t0)
    hdrs[H.INVOKED_VARIANT] = pool.name
    if pool.component is not None:
        hdrs[H.INVOKED_COMPONENT] = pool.component
    try:
        tenant = validate_tenant_id(headers.get(H.PREFIX_AWARE_ID))
    except InvalidRequest as exc:
        msg = f"{H.PREFIX_AWARE_ID}: {exc}"
        return count_answer(state, endpoint.name, pool.name, openai_error(400, msg, headers=hdrs) if openai
                            else sagemaker_error("ValidationError", msg, headers=hdrs), t0)
    session: SessionPin | None = None
    new_session = False
    sid_header = H.SESSION_ID if H.SESSION_ID in headers else state.settings.session_header
    if sid_header is not None and sid_header in headers:
        try:
            session = parse_session_id(headers[sid_header], sagemaker=sid_header == H.SESSION_ID)
        except InvalidRequest as exc:
            msg = f"{sid_header}: {exc}"
            return count_answer(state, endpoint.name, pool.name, openai_error(400, msg, headers=hdrs) if openai
                                else sagemaker_error("ValidationError", msg, headers=hdrs), t0)
        new_session = session is None
        if session is not None and session.tag is not None:  # the container sees its own id
            raw_headers = H.replace_header(raw_headers, sid_header, session.upstream_id)
    if isinstance(body, BodyTooLarge):
        resp = openai_error(413, str(body), code="request_too_large", headers=hdrs) if openai else \
            sagemaker_error("ValidationError", str(body), status=413, headers=hdrs)
        return count_answer(state, endpoint.name, pool.name, resp, t0)
    if isinstance(body, BodyNotDecoded):
        resp = openai_error(400, str(body), code="invalid_content_encoding", headers=hdrs) if openai else \
            sagemaker_error("ValidationError", str(body), headers=hdrs)
        return count_answer(state, endpoint.name, pool.name, resp, t0)
    if isinstance(body, BodyTimedOut):
        resp = openai_error(408, str(body), code="request_timeout", headers=hdrs) if openai else \
            sagemaker_error("ValidationError", str(body), status=408, headers=hdrs)
        return count_answer(state, endpoint.name, pool.name, resp, t0)
    if body is None:
        if transfer_refused(headers):
            msg = f"Transfer-Encoding {transfer_coding(headers)[:64]!r} is not supported: only chunked"
            resp = openai_error(501, msg, code="unsupported_transfer_encoding", headers=hdrs) if openai else \
                sagemaker_error("ValidationError", msg, status=501, headers=hdrs)
            return count_answer(state, endpoint.name, pool.name, resp, t0)
        msg = coding_refusal(headers)
        if msg is not None:
            hdrs["Accept-Encoding"] = ACCEPTED_CODINGS
            resp = openai_error(415, msg, code="unsupported_content_encoding", headers=hdrs) if openai else \
                sagemaker_error("ValidationError", msg, status=415, headers=hdrs)
            return count_answer(state, endpoint.name, pool.name, resp, t0)
        return RoutedRequest(request, headers, raw_headers, api, endpoint.name, pool, None, b"", "", rid, t0,
                             session=session, new_session=new_session, route=match.route, target=target)
    model: str | None = None
    try:
        if openai:
            route = match.route
            payload = _openai_payload(body, route)
            model = payload.get("model") if payload is not None else None
            if model is not None and not isinstance(model, str):
                raise InvalidRequest("'model' must be a string")
            sel = state.selector.select(endpoint, variant=target, component=component, model=model or None)
        else:
            sel = state.selector.select(endpoint, variant=target, component=component, native=True)
    except InvalidRequest as exc:
        return count_answer(state, endpoint.name, pool.name, openai_error(400, str(exc), headers=hdrs), t0)
    except UnknownModel as exc:
        try:  # a malformed request is a 400 whatever its model names (as vLLM validates before its model check)
            route_key(payload, route, _VALIDATE_ONLY, tenant)
        except InvalidRequest as bad:
            return count_answer(state, endpoint.name, pool.name, openai_error(400, str(bad), headers=hdrs), t0)
        resp = openai_error(404, str(exc), code="model_not_found", headers=hdrs)
        return count_answer(state, endpoint.name, pool.name, resp, t0)
    except (ComponentRequired, UnknownComponent, UnknownVariant) as exc:
        resp = openai_error(400, str(exc), code="inference_component_required", headers=hdrs) if openai else \
            sagemaker_error("ValidationError", str(exc), headers=hdrs)
        return count_answer(state, endpoint.name, pool.name, resp, t0)
    pool = sel.pool
    if openai:
        assert route is not None
        try:
            key, blocks = route_key(payload, route, pool.routing, tenant, pool.component)
        except InvalidRequest as exc:
            return count_answer(state, endpoint.name, pool.name, openai_error(400, str(exc), headers=hdrs), t0)
        if state.kv_keyer is not None and blocks and route in (OpenAIRoute.CHAT, OpenAIRoute.COMPLETIONS):
            attach_precise(state, payload, route is OpenAIRoute.CHAT, blocks)  # precise mode: its KV block keys
        path = match.tail + (f"?{query}" if query and route is OpenAIRoute.OTHER else "")
        # Its digests go if it came encoded (the native API never passes them on).
        decoded = "Content-Encoding" in headers and request_coding(headers) != "identity"  # (else a 415 before)
    else:
        decoded = False
        scope = f"{endpoint.name}:{component}" if component else endpoint.name
        key, blocks = native_request_key(body, pool.routing, scope, tenant)
        path = "/invocations"
    if who is not None:
        assert clients is not None
        admitted = clients.admit(who)
        if isinstance(admitted, Refusal):
            return count_answer(state, endpoint.name, pool.name,
                                throttled(api, admitted, rid, pool.name), t0, who)
        # The key is the router's: it does not go on to the engine.
        raw_headers = [(k, v) for k, v in raw_headers if k.lower() != who.header.encode()]
    if state.settings.log_prompts:
        _log_prompt(rid, body)
    rr = RoutedRequest(request, headers, raw_headers, api, endpoint.name, pool, key, body, path, rid, t0, blocks,
                       decoded, session=session, new_session=new_session, selection=sel, route=match.route,
                       target=target, model=model or None)
    if who is not None:
        rec = rr.record
        rec.client, rec.tenant, rec.admission = who.name, who.tenant, admitted
    return rr


#: A routing configuration that computes no key: :func:`route_key` with it only validates.
_VALIDATE_ONLY = RoutingConfig()


def _openai_payload(body: bytes, route: OpenAIRoute | None) -> dict[str, Any] | None:
    """The parsed JSON object of an OpenAI body; ``None`` for a body of another route
    under ``/v1`` that is not a JSON object (multipart audio...: relayed by the pool
    only, without a model or key).

    Raises:
        InvalidRequest: a known route's body that is not a JSON object, or a ``stream``
            that is not a boolean.
    """
    try:
        payload = loads_body(body)
    except orjson.JSONDecodeError as exc:
        if route is OpenAIRoute.OTHER:
            return None
        if str(exc).startswith("str is not valid UTF-8"):  # (orjson's words for bytes that are not UTF-8)
            raise InvalidRequest("request body is not valid JSON: it is not UTF-8 text (JSON must be UTF-8, "
                                 "RFC 8259 §8.1)") from None
        raise InvalidRequest(f"request body is not valid JSON ({exc})") from None
    if not isinstance(payload, dict):
        if route is OpenAIRoute.OTHER:
            return None
        raise InvalidRequest(f"request body must be a JSON object, got {_json_type(payload)}")
    if not isinstance(payload.get("stream", False), bool):
        raise InvalidRequest("'stream' must be a boolean")
    return payload


def route_key(payload: dict[str, Any] | None, route: OpenAIRoute, routing: RoutingConfig, header_tenant: str = "",
              component: str | None = None) -> tuple[int | None, Sequence[int]]:
    """What a pool's strategy routes an OpenAI request on: ``(key, blocks)`` from the
    route's own input (:func:`prefixroute.core.openai_routes.keyed_view`), within the
    inference component when there is one.

    Raises:
        InvalidRequest: a field the key needs (or the router checks) has the wrong type.
    """
    if payload is None:
        return None, []
    view, chat = keyed_view(payload, route)
    if view is None:  # another route: keyed on nothing, its tenant fields still checked
        openai_tenant(payload, header_tenant)
        return None, []
    key, blocks = openai_route(scoped_model(view, component), chat, routing, header_tenant)
    if key is None and not blocks and route in (OpenAIRoute.CHAT, OpenAIRoute.COMPLETIONS):
        validate_openai_body(payload, chat)  # the whole body, as no key rendered it
    return key, blocks


def _route_of(request: web.Request) -> RouteMatch:
    """The inference route of an aiohttp request (its handler is only registered on them)."""
    match = match_route(request.raw_path.split("?", 1)[0])
    if match is None:  # an aiohttp route matched a path match_route refuses (e.g. %-escaped)
        raise web.HTTPNotFound()
    return match


async def _inference(request: web.Request) -> web.StreamResponse:
    """Every inference route: read, :func:`prepare_inference`, :func:`forward`."""
    t0 = time.perf_counter()
    state = request.app[STATE]
    rid = request_id(request.headers)
    match = _route_of(request)
    first = prepare_inference(state, match, request.headers, request.raw_headers, None, rid, t0, request)
    if not isinstance(first, RoutedRequest):
        return first
    body = await read_body(request, state.settings.max_body_bytes, state.settings.client_keepalive_timeout_s)
    rr = prepare_inference(state, match, request.headers, request.raw_headers, body, rid, t0, request,
                           request.query_string)
    if not isinstance(rr, RoutedRequest):
        if isinstance(body, BodyTimedOut):
            rr.force_close()  # (what is left of the body is unread)
        return rr
    return await forward(state, rr)


#: The inference handler under its historical names (each route is :func:`_inference`).
chat_completions = completions = invocations = invocations_response_stream = _inference


async def models(request: web.Request) -> web.Response:
    """``GET .../v1/models``: the union of the models the endpoint's healthy instances
    serve (the component's copies, on a component's path), learned from their own
    lists; when no healthy instance's list is known, one healthy instance's list as it
    answers (503 when none is healthy)."""
    state = request.app[STATE]
    rid = request_id(request.headers)
    drop = None
    if state.clients is not None:
        found = state.clients.identify(request.headers)
        if not isinstance(found, Identity):
            return unauthorized(Api.OPENAI, found, rid)
        drop = found.header
    hdrs = {H.REQUEST_ID: rid}
    component = request.match_info.get("component")
    try:
        endpoint = state.fleet.endpoint(request.match_info.get("endpoint"))
        pool = endpoint.component(component) if component else endpoint.variant(request.headers.get(H.TARGET_VARIANT))
    except UnknownEndpoint as exc:
        return openai_error(404, str(exc), code="endpoint_not_found", headers=hdrs)
    except UnknownVariant as exc:
        return openai_error(400, str(exc), code="variant_not_found", headers=hdrs)
    except UnknownComponent as exc:
        return openai_error(400, str(exc), code="inference_component_not_found", headers=hdrs)
    cards = _listed_cards(state, endpoint, pool if component else None)
    if not cards:
        return await forward_get(state, request, pool, "/v1/models", rid, drop)
    hdrs[H.INVOKED_VARIANT] = pool.name
    return json_response(200, {"object": "list", "data": cards}, hdrs)


def _listed_cards(state: RouterState, endpoint: Endpoint, component: VariantPool | None) -> list[Mapping[str, Any]]:
    """The model cards the healthy instances of ``endpoint`` (of ``component``'s copies
    only, when given) list, as the catalog has them; ``[]`` when none is known."""
    pools = [component] if component is not None else endpoint.all_pools()
    return state.catalog.cards(dict.fromkeys(i.instance_id for p in pools for i in p.instances if i.healthy))


async def relay_other(request: web.Request) -> web.StreamResponse:
    """Any other method on a path under ``/v1`` (``GET /v1/models/{id}``...): relayed as
    it is to one healthy instance of the endpoint (no model to route by, no in-flight
    slot claimed), its answer returned whole. A method a route of its own does not take
    (``GET /v1/chat/completions``, ``PUT /v1/models``) is the router's 405 in OpenAI's
    shape, with ``Allow`` (``POST /v1/models``: :func:`prepare_inference`)."""
    state = request.app[STATE]
    rid = request_id(request.headers)
    match = _route_of(request)
    allowed = "POST" if match.route not in (None, OpenAIRoute.OTHER) else "GET" if match.tail == "/v1/models" else None
    if allowed is not None:
        resp = openai_error(405, f"method {request.method} is not allowed on this path (allowed: {allowed})",
                            code="method_not_allowed", headers={H.REQUEST_ID: rid, "Allow": allowed})
        return count_answer(state, "unknown", "", resp, time.perf_counter())
    drop = None
    if state.clients is not None:
        found = state.clients.identify(request.headers)
        if not isinstance(found, Identity):
            return unauthorized(Api.OPENAI, found, rid)
        drop = found.header
    try:
        endpoint = state.fleet.endpoint(match.endpoint)
        pool = endpoint.component(match.component) if match.component else \
            endpoint.variant(request.headers.get(H.TARGET_VARIANT))
    except UnknownEndpoint as exc:
        return openai_error(404, str(exc), code="endpoint_not_found", headers={H.REQUEST_ID: rid})
    except (UnknownVariant, UnknownComponent) as exc:
        return openai_error(400, str(exc), code="not_found", headers={H.REQUEST_ID: rid})
    if request.method == "GET" and match.tail.startswith("/v1/models/"):  # one model's card, as listed
        mid = urllib.parse.unquote(match.tail[len("/v1/models/"):])
        cards = _listed_cards(state, endpoint, pool if match.component else None)
        card = next((c for c in cards if c.get("id") == mid), None)
        if card is not None:
            return json_response(200, dict(card), {H.REQUEST_ID: rid, H.INVOKED_VARIANT: pool.name})
        if cards:  # the lists are known and none has it
            return openai_error(404, f"The model `{mid[:200]}` does not exist.", code="model_not_found",
                                headers={H.REQUEST_ID: rid})
    body = await read_body(request, state.settings.max_body_bytes, state.settings.client_keepalive_timeout_s)
    if not isinstance(body, bytes):
        return error_for_path(request.path, 413 if isinstance(body, BodyTooLarge) else 400, str(body), "bad_body")
    path = match.tail + (f"?{request.query_string}" if request.query_string else "")
    return await forward_get(state, request, pool, path, rid, drop, method=request.method, body=body)


async def health(request: web.Request) -> web.Response:
    """``GET /health`` and ``GET /ping``: 200 ``ok`` when every production variant has a
    healthy instance, 200 ``degraded`` naming the variants that have none, 503
    ``starting`` until a round of health checks has found every variant with a healthy
    instance, 503 ``unavailable`` when no instance is healthy
    (:func:`prefixroute.server.health.readiness`).

    Body: ``{"status", "message", "variants_down": ["endpoint/variant", ...],
    "healthy_instances", "instances"}``."""
    r = readiness(request.app[STATE])
    return json_response(r.http_status, {"status": r.status, "message": r.message(), "variants_down": list(r.down),
                                         "healthy_instances": r.healthy, "instances": r.total})


async def metrics(request: web.Request) -> web.Response:
    """``GET /metrics``: Prometheus text exposition."""
    body = request.app[STATE].metrics.render()
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE})


def _expect() -> Callable[[web.Request], Awaitable[web.StreamResponse | None]]:
    """The ``Expect`` handler of an inference route: a request its head alone refuses
    (what :func:`prepare_inference` checks before the body: unknown endpoint or
    variant, a coding not decoded, an invalid tenant id; and a declared body over
    ``--max-body-size``) gets its final answer instead of ``100 Continue`` (RFC 9110
    §10.1.1), so its body need not be sent, and the connection closes after it; any
    other gets ``100 Continue``, as from aiohttp's default handler. An ``Expect`` other
    than ``100-continue`` is a 417 (RFC 9110 §10.1.1). Refusals are counted."""
    async def handler(request: web.Request) -> web.StreamResponse | None:
        if request.version != HttpVersion11:
            return None
        state = request.app[STATE]
        t0 = time.perf_counter()
        expect = request.headers.get("Expect", "")
        if expect.strip().lower() != "100-continue":
            resp = error_for_path(request.path, 417, f"Expect {expect[:64]!r} is not supported: only 100-continue",
                                  "expectation_failed", headers={H.REQUEST_ID: request_id(request.headers)})
            resp.force_close()
            return count_answer(state, "unknown", "", resp, t0)
        limit, declared = state.settings.max_body_bytes, request.content_length
        body = BodyTooLarge(limit, declared) if declared is not None and declared > limit else None
        checked = prepare_inference(state, _route_of(request), request.headers, request.raw_headers, body,
                                    request_id(request.headers), t0, request)
        if not isinstance(checked, RoutedRequest):
            checked.force_close()
            return checked
        await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        request.writer.output_size = 0  # as aiohttp's default handler: the answer has not started
        return None
    return handler


@web.middleware
async def _error_shapes(request: web.Request,
                        handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
    """aiohttp's own 404/405/413 answers are plain text; give them the API's shape. They
    are counted (endpoint ``unknown``: nothing was routed) in ``responses_total`` and
    ``request_duration_seconds``, as every answer to a request for inference is."""
    t0 = time.perf_counter()
    try:
        return await handler(request)
    except web.HTTPNotFound:
        # The path as sent: the decoded one would show /v1/chat%2Fcompletions as a real route.
        resp = error_for_path(request.path, 404, f"no route for {request.method} "
                              f"{request.raw_path.split('?', 1)[0][:200]}", "not_found")
    except web.HTTPMethodNotAllowed as exc:
        resp = error_for_path(request.path, 405, f"method {request.method} is not allowed on this path "
                              f"(allowed: {', '.join(sorted(exc.allowed_methods))})", "method_not_allowed")
        resp.headers["Allow"] = ",".join(sorted(exc.allowed_methods))
    except web.HTTPRequestEntityTooLarge:
        limit = request.app[STATE].settings.max_body_bytes
        resp = error_for_path(request.path, 413, f"request body too large; the limit is {limit:,} bytes "
                              "(--max-body-size)", "request_too_large")
    resp.headers[H.REQUEST_ID] = request_id(request.headers)  # (the access log's line names it too)
    return count_answer(request.app[STATE], "unknown", "", resp, t0)


async def _background_tasks(app: web.Application) -> AsyncIterator[None]:
    state = app[STATE]
    s = state.settings
    state.observers.open(s.access_log, s.record_trace, s.otel_traces)
    state.session = make_client_session(state.settings)
    try:  # what each instance serves, before the first request (an instance not up yet: the next round)
        async with asyncio.timeout(state.settings.health_check_timeout_s + 1.0):
            await refresh_models(state)
    except TimeoutError:
        log.warning("model lists not all read at start; the health rounds read them")
    state.lora = LoraManager(state)
    tasks: list[asyncio.Task[None]] = []
    if state.settings.health_check_interval_s > 0:
        tasks.append(asyncio.create_task(health_check_loop(state), name="prefixroute-health-checks"))
    if state.settings.metrics_scrape_interval_s > 0:
        tasks.append(asyncio.create_task(scrape_loop(state), name="prefixroute-metrics-scrape"))
    # Discovery runs in a single router process (serve --workers N refuses a Discovery source).
    discovery = None if state.metrics.multiprocess else start_discovery(state)
    await state.start_kv_events()
    try:
        yield
    finally:
        if discovery is not None:
            await discovery.close()
            state.discovery = None
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await state.stop_kv_events()
        await state.lora.close()
        state.lora = None
        await state.session.close()
        state.session = None
        state.observers.close()


def build_app(state: RouterState) -> web.Application:
    """The serving application for ``state``. The pooled upstream client, the health
    checks, the metrics scrapes and precise mode's KV-event subscriptions start on
    startup and stop on cleanup.

    Serve it with aiohttp's request decompression off (``web.AppRunner(app,
    auto_decompress=False)``, as :mod:`prefixroute.server.runner` does): its handlers
    decode request bodies themselves (:func:`decode_request_body`), and a body aiohttp
    had decoded already would be decoded twice."""
    app = web.Application(client_max_size=state.settings.max_body_bytes, middlewares=[_error_shapes])
    app[STATE] = state
    close_receiving_on_shutdown(app)
    app.cleanup_ctx.append(_background_tasks)
    r = app.router
    expect = _expect()
    components = "/endpoints/{endpoint}/inference-components/{component}"
    for prefix in ("", "/endpoints/{endpoint}/openai", components + "/openai"):
        for route in OpenAIRoute:
            if route is not OpenAIRoute.OTHER:
                r.add_post(prefix + route.path, _inference, expect_handler=expect)
        r.add_get(prefix + "/v1/models", models, allow_head=False)
        # Anything else under /v1: POST routed by the body's model, other methods relayed.
        r.add_post(prefix + "/v1/{tail:.+}", _inference, expect_handler=expect)
        r.add_route("*", prefix + "/v1/{tail:.+}", relay_other)
    for prefix in ("/endpoints/{endpoint}", components):
        r.add_post(prefix + "/invocations", _inference, expect_handler=expect)
        r.add_post(prefix + "/invocations-response-stream", _inference, expect_handler=expect)
    r.add_post("/invocations", _inference, expect_handler=expect)
    r.add_get("/ping", health)  # HEAD too: load balancers may check with HEAD
    r.add_get("/health", health)
    r.add_get("/metrics", metrics, allow_head=False)
    return app
