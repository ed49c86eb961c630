"""The admin API, on its own listener: inspect and change routing without a restart.

Routes (JSON in and out; errors are ``{"message": ...}``):

* ``GET /admin/config``: the configuration in force, SageMaker-shaped, with each
  instance's live state under ``InstanceStates`` (``InFlight``, ``Healthy``, ``Served``).
* ``PUT /admin/config``: replace the whole fleet configuration (a ``FleetConfig``
  document, ``{"Endpoints": [...]}``; what ``GET`` returned, edited, is accepted).
* ``PUT /admin/endpoints/{endpoint}/variants/{variant}/routing``: a ``RoutingConfig``,
  e.g. ``{"RoutingStrategy": "PREFIX_AWARE", "PrefixAwareRoutingConfig":
  {"PrefixLength": 4096, "ConcurrencyThreshold": 8}}``.
* ``POST /admin/reload``: re-read the ``--config`` file (what SIGHUP does).
* ``GET /admin/kv-events``: precise mode's status, per instance: ``precise`` or
  ``approximate`` and why, and its KV-event stream's counters (:func:`kv_events_document`).
* ``GET /admin/status``: the live status page (:mod:`prefixroute.server.status`; ``GET /``
  redirects there); ``GET /admin/status.json``: its data.

An invalid configuration is answered 400 with the validation message and the running
configuration is kept. With ``serve --workers N`` every worker runs this app on a
loopback port for the supervisor, which serves the public admin API, sends changes to
every worker and adds ``GET /admin/workers`` (:mod:`prefixroute.server.workers`). If a
token is set, every request needs ``Authorization: Bearer <token>`` (compared in
constant time), but for the status page's HTML and ``GET /``, which hold no data.
"""

from __future__ import annotations

import asyncio
import hmac
import time
from typing import Any, Awaitable, Callable, TypeVar

import orjson
from aiohttp import web

from prefixroute.core.config import ConfigError, FleetConfig, RoutingConfig, parse_model
from prefixroute.core.counters import InFlightTableFull
from prefixroute.core.endpoint import UnknownComponent, UnknownEndpoint, UnknownVariant
from prefixroute.core.lora_config import LoraAdaptersConfig
from prefixroute.server.request_body import (ACCEPTED_CODINGS, BodyNotDecoded, BodyTimedOut, BodyTooLarge,
                                             close_receiving_on_shutdown, coding_refusal, read_body)
from prefixroute.server.errors import json_response
from prefixroute.server.state import RouterState
from prefixroute.server.status import STATUS_JSON_PATH, STATUS_PATH, status_document, status_page

__all__ = ["build_admin_app", "config_document", "admin_middlewares", "strip_live_state", "apply_waiting",
           "TABLE_FULL_WAIT_S", "add_status_routes", "PUBLIC_PATHS"]

_STATE = web.AppKey("prefixroute_admin_state", RouterState)


def config_document(state: RouterState) -> dict[str, Any]:
    """The configuration in force as a SageMaker-shaped dict, with live instance state.

    Shape: ``{"DefaultEndpoint": str, "Endpoints": [{"EndpointName", "ProductionVariants":
    [{"VariantName", "InitialVariantWeight", "RoutingConfig", "Instances": [url, ...],
    "InstanceStates": [{"Instance", "InFlight", "Healthy", "Served"}, ...]}],
    "InferenceComponents": [{"InferenceComponentName", "ModelName", "Instances", "RoutingConfig"?,
    "CopyStates": [...]}], "LoraAdapters": {...}}]}`` (the last two when configured).
    Dropping ``DefaultEndpoint``, ``InstanceStates`` and ``CopyStates`` gives a valid
    ``FleetConfig``.
    """
    fleet = state.fleet
    endpoints = []
    for e in fleet.config.endpoints:
        variants = []
        for v in e.variants:
            pool = fleet.endpoints[e.name].pools[v.name]
            variants.append({
                "VariantName": v.name,
                "InitialVariantWeight": v.weight,
                "RoutingConfig": pool.routing.to_api(),
                "Instances": list(v.instances),
                "InstanceStates": [
                    {"Instance": i.instance_id, "InFlight": i.in_flight, "Healthy": i.healthy, "Served": i.served}
                    for i in pool.instances
                ],
            })
        entry: dict[str, Any] = {"EndpointName": e.name, "ProductionVariants": variants}
        if e.components:
            entry["InferenceComponents"] = [
                {**c.to_api(), "CopyStates": [
                    {"Instance": i.instance_id, "InFlight": i.in_flight, "Healthy": i.healthy, "Served": i.served}
                    for i in fleet.endpoints[e.name].components[c.name].instances]}
                for c in e.components]
        if e.lora != LoraAdaptersConfig():
            entry["LoraAdapters"] = e.lora.model_dump(by_alias=True, exclude_none=True)
        endpoints.append(entry)
    doc: dict[str, Any] = {"DefaultEndpoint": fleet.default_name, "Endpoints": endpoints}
    if fleet.config.kv_events is not None:
        doc["KvEvents"] = fleet.config.kv_events.model_dump(by_alias=True, exclude_none=True)
    return doc


def kv_events_document(state: RouterState) -> dict[str, Any]:
    """Precise mode's status: per instance, its mode (``precise`` or ``approximate``) and why,
    and its event stream's counters.

    Shape: ``{"Enabled": bool, "BlockSize": int | None, "SharedTierBlocks": int,
    "Instances": [{"Instance", "Mode", "Reason", "Connected", "Blocks", "NextSeq",
    "Messages", "Gaps", "Replays", "ReplaysFailed", "Resets", "Restarts", "Orphaned",
    "MalformedMessages", "MalformedEvents", "UnknownEvents", "LastMessageAgeS", "LastReset",
    "LastResetAgeS"}, ...],
    "Matching": "bytes" | "tokens" | None, "ByteIndexBlocks": int,
    "Tokenizer": {"CachedPieces", "Hits", "Misses", "DeferredRequests", "OffPathPieces",
    "ByteMatchedRequests", "TemplateShapes", "TemplateSubstituted", "TemplateRendered",
    "TemplateMismatches"} | None}``
    (``Matching``: how requests are matched, ``KvEvents.Matching``, ``None`` without a
    tokenizer; ``ByteIndexBlocks``: distinct held blocks indexed by their bytes;
    ``DeferredRequests``: routed on the learned view while their new text was tokenized
    off the request path, ``InlineTokenizeChars``; ``LastReset``: why the instance's
    state was last reset, ``LastResetAgeS`` how long ago, both ``None`` if never;
    ``Template*``: chat requests whose template was applied by substitution into a
    skeleton of their shape or rendered whole, and checks that found the two differ,
    :mod:`prefixroute.core.chat_skeleton`).
    """
    view = state.kv_view
    if view is None:
        return {"Enabled": False, "BlockSize": None, "SharedTierBlocks": 0, "Instances": []}
    rows = []
    for st in view.status(time.monotonic()):
        rows.append({"Instance": st.instance, "Mode": st.mode, "Reason": st.reason, "Connected": st.connected,
                     "Blocks": st.blocks, "NextSeq": st.next_seq, "Messages": st.messages, "Gaps": st.gaps,
                     "Replays": st.replays, "ReplaysFailed": st.replays_failed, "Resets": st.resets,
                     "Restarts": st.restarts, "Orphaned": st.orphaned, "MalformedMessages": st.malformed_messages,
                     "MalformedEvents": st.malformed_events, "UnknownEvents": st.unknown_events,
                     "LastMessageAgeS": None if st.last_message_age_s is None else round(st.last_message_age_s, 3),
                     "LastReset": st.last_reset,
                     "LastResetAgeS": None if st.last_reset_age_s is None else round(st.last_reset_age_s, 3)})
    keyer = state.kv_keyer
    tokenizer = None
    if keyer is not None:
        st = keyer.stats()
        tokenizer = {"CachedPieces": st["pieces"], "Hits": st["hits"], "Misses": st["misses"],
                     "DeferredRequests": st["deferred"], "OffPathPieces": state.kv_tokenize.learned,
                     "ByteMatchedRequests": st["byte_matched"], "TemplateShapes": st["template_shapes"],
                     "TemplateSubstituted": st["template_substituted"], "TemplateRendered": st["template_rendered"],
                     "TemplateMismatches": st["template_mismatches"]}
    bx = view.byte_index
    return {"Enabled": True, "BlockSize": view.block_size, "SharedTierBlocks": len(view.shared), "Instances": rows,
            "Matching": "bytes" if bx is not None else "tokens" if keyer is not None else None,
            "ByteIndexBlocks": len(bx) if bx is not None else 0, "Tokenizer": tokenizer}


def _error(status: int, message: str) -> web.Response:
    return json_response(status, {"message": message})


#: Largest admin request body, bytes, as received and once decoded (aiohttp's default).
ADMIN_MAX_BODY_BYTES = 1024 * 1024


class BodyRefused(Exception):
    """An admin request body that is not read: ``status`` 413 (over
    :data:`ADMIN_MAX_BODY_BYTES`), 415 (a Content-Encoding not decoded; the answer
    names the ones that are) or 400 (one that does not decode it)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status

    def response(self) -> web.Response:
        resp = _error(self.status, str(self))
        if self.status == 415:
            resp.headers["Accept-Encoding"] = ACCEPTED_CODINGS
        return resp


async def read_admin_body(request: web.Request, idle_s: float | None = None) -> bytes:
    """An admin request's body, decoded as the inference routes decode theirs (strict
    gzip or deflate: :func:`prefixroute.server.request_body.read_body`; the admin listeners run
    with aiohttp's decompression off), waiting at most ``idle_s`` seconds for each
    part of it (``None``: for ever). Raises :class:`BodyRefused` (408 when it stops
    arriving)."""
    refusal = coding_refusal(request.headers)
    if refusal is not None:
        raise BodyRefused(415, refusal)
    body = await read_body(request, ADMIN_MAX_BODY_BYTES, idle_s)
    if isinstance(body, BodyTimedOut):
        raise BodyRefused(408, str(body))
    if isinstance(body, BodyTooLarge):
        raise BodyRefused(413, str(body).replace(" (--max-body-size)", ""))
    if isinstance(body, BodyNotDecoded):
        raise BodyRefused(400, str(body))
    return body


async def _json_body(request: web.Request) -> Any:
    body = await read_admin_body(request, request.app[_STATE].settings.client_keepalive_timeout_s)
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise ConfigError(f"request body is not valid JSON ({exc})") from None


def strip_live_state(doc: Any) -> Any:
    """Let a client PUT back what it GOT: drop the read-only parts of :func:`config_document`."""
    if not isinstance(doc, dict):
        return doc
    doc.pop("DefaultEndpoint", None)
    endpoints = doc.get("Endpoints")
    # Anything of the wrong type is left alone for FleetConfig's validation to name.
    for ep in endpoints if isinstance(endpoints, list) else ():
        variants = ep.get("ProductionVariants") if isinstance(ep, dict) else None
        for v in variants if isinstance(variants, list) else ():
            if isinstance(v, dict):
                v.pop("InstanceStates", None)
        components = ep.get("InferenceComponents") if isinstance(ep, dict) else None
        for c in components if isinstance(components, list) else ():
            if isinstance(c, dict):
                c.pop("CopyStates", None)
    return doc


#: With ``--workers N``, how long a change that finds the shared in-flight table full
#: waits (seconds) before it is refused: the other workers apply the same change at
#: the same time, and one of them may still hold the slot of an instance that left
#: (its requests over) until it does. In one process the table is never full.
TABLE_FULL_WAIT_S = 1.0
_T = TypeVar("_T")


async def apply_waiting(change: Callable[[], _T]) -> _T:
    """``change()`` (a :class:`RouterState` method), tried again every 50 ms for up to
    :data:`TABLE_FULL_WAIT_S` while it raises ``InFlightTableFull`` (which changes
    nothing); then that error."""
    deadline = time.monotonic() + TABLE_FULL_WAIT_S
    while True:
        try:
            return change()
        except InFlightTableFull:
            if time.monotonic() >= deadline:
                raise
            await asyncio.sleep(0.05)


async def get_config(request: web.Request) -> web.Response:
    """``GET /admin/config``."""
    return json_response(200, config_document(request.app[_STATE]))


async def get_kv_events(request: web.Request) -> web.Response:
    """``GET /admin/kv-events``: precise mode's status (:func:`kv_events_document`)."""
    return json_response(200, kv_events_document(request.app[_STATE]))


async def put_config(request: web.Request) -> web.Response:
    """``PUT /admin/config``: replace the fleet configuration."""
    state = request.app[_STATE]
    try:
        config = FleetConfig.from_mapping(strip_live_state(await _json_body(request)))
        await apply_waiting(lambda: state.apply_config(config))  # InFlightTableFull: a ConfigError, nothing changed
    except ConfigError as exc:
        return _error(400, str(exc))
    await state.models_settled()
    return json_response(200, config_document(state))


async def put_routing(request: web.Request) -> web.Response:
    """``PUT /admin/endpoints/{endpoint}/variants/{variant}/routing``."""
    state = request.app[_STATE]
    endpoint, variant = request.match_info["endpoint"], request.match_info["variant"]
    try:
        routing = parse_model(RoutingConfig, await _json_body(request), "RoutingConfig")
    except ConfigError as exc:
        return _error(400, str(exc))
    try:
        await apply_waiting(lambda: state.set_routing(endpoint, variant, routing))
    except (UnknownEndpoint, UnknownVariant) as exc:
        return _error(404, str(exc.args[0]))
    except ConfigError as exc:
        return _error(400, str(exc))
    return json_response(200, {"EndpointName": endpoint, "VariantName": variant, "RoutingConfig": routing.to_api()})


async def put_component_routing(request: web.Request) -> web.Response:
    """``PUT /admin/endpoints/{endpoint}/inference-components/{component}/routing``: the
    component's own routing, without a restart (in-flight counts kept)."""
    state = request.app[_STATE]
    endpoint, component = request.match_info["endpoint"], request.match_info["component"]
    try:
        routing = parse_model(RoutingConfig, await _json_body(request), "RoutingConfig")
    except ConfigError as exc:
        return _error(400, str(exc))
    try:
        await apply_waiting(lambda: state.set_component_routing(endpoint, component, routing))
    except (UnknownEndpoint, UnknownComponent) as exc:
        return _error(404, str(exc.args[0]))
    except ConfigError as exc:
        return _error(400, str(exc))
    return json_response(200, {"EndpointName": endpoint, "InferenceComponentName": component,
                               "RoutingConfig": routing.to_api()})


async def reload(request: web.Request) -> web.Response:
    """``POST /admin/reload``: re-read the configuration file and the API keys (what
    SIGHUP does); answers the configuration in force."""
    state = request.app[_STATE]
    try:
        state.reload_keys()
        if state.settings.config_path is not None or state.clients is None:
            config = state.read_config_file()  # once: only applying it is tried again
            await apply_waiting(lambda: state.apply_config(config))
    except ConfigError as exc:
        return _error(400, str(exc))
    await state.models_settled()
    return json_response(200, config_document(state))


#: Admin paths served without the token: the status page's HTML and the redirect to it
#: hold no data (the page asks for the token before it reads any).
PUBLIC_PATHS = frozenset({"/", STATUS_PATH})


async def get_status(request: web.Request) -> web.Response:
    """``GET /admin/status.json``: :func:`~prefixroute.server.status.status_document`
    (``?raw=1`` adds the TTFT samples)."""
    return json_response(200, status_document(request.app[_STATE], raw=request.query.get("raw") == "1"))


async def get_status_page(request: web.Request) -> web.Response:
    """``GET /admin/status``: the live status page (self-contained HTML)."""
    return web.Response(body=status_page(), content_type="text/html", charset="utf-8",
                        headers={"Cache-Control": "no-store"})


async def to_status_page(request: web.Request) -> web.Response:
    """``GET /``: redirects to the status page."""
    raise web.HTTPFound(STATUS_PATH)


def add_status_routes(app: web.Application, json_handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
                      ) -> None:
    """The status page, its data (``json_handler``) and ``GET /`` on ``app``."""
    app.router.add_get(STATUS_PATH, get_status_page, allow_head=False)
    app.router.add_get(STATUS_JSON_PATH, json_handler, allow_head=False)
    app.router.add_get("/", to_status_page, allow_head=False)


def _auth_middleware(token: str) -> Callable[..., Awaitable[web.StreamResponse]]:
    expected = token.encode()

    @web.middleware
    async def check(request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
                    ) -> web.StreamResponse:
        if request.method == "GET" and request.path in PUBLIC_PATHS:
            return await handler(request)
        scheme, _, given = request.headers.get("Authorization", "").partition(" ")
        # The scheme is case-insensitive (RFC 9110 §11.1); the token is compared in constant time.
        ok = hmac.compare_digest(given.strip().encode("utf-8", "surrogateescape"), expected)
        if not (ok and scheme.lower() == "bearer"):
            resp = _error(401, "missing or wrong admin token (Authorization: Bearer <token>)")
            resp.headers["WWW-Authenticate"] = "Bearer"
            return resp
        return await handler(request)

    return check


@web.middleware
async def _json_errors(request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
                       ) -> web.StreamResponse:
    """aiohttp's own 404/405/413 answers are plain text; the admin API answers JSON (a
    body refused, :class:`BodyRefused`, too)."""
    try:
        return await handler(request)
    except BodyRefused as exc:
        return exc.response()
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return _error(exc.status, f"{exc.reason}: {request.method} {request.path[:200]}")


def admin_middlewares(token: str | None) -> list[Callable[..., Awaitable[web.StreamResponse]]]:
    """JSON error bodies, and the bearer-token check if ``token`` is set. An app with
    them is served with aiohttp's decompression off: :func:`read_admin_body` decodes."""
    return [_json_errors, *([_auth_middleware(token)] if token else [])]


def build_admin_app(state: RouterState, token: str | None = None) -> web.Application:
    """The admin application for ``state``; requires ``token`` (default:
    ``settings.admin_token``) if set. A worker of ``serve --workers N`` runs it on a
    loopback port with a token only its supervisor knows."""
    app = web.Application(client_max_size=ADMIN_MAX_BODY_BYTES,
                          middlewares=admin_middlewares(token if token is not None else state.settings.admin_token))
    app[_STATE] = state
    close_receiving_on_shutdown(app)
    app.router.add_get("/admin/config", get_config, allow_head=False)
    app.router.add_get("/admin/kv-events", get_kv_events, allow_head=False)
    app.router.add_put("/admin/config", put_config)
    app.router.add_put("/admin/endpoints/{endpoint}/variants/{variant}/routing", put_routing)
    app.router.add_put("/admin/endpoints/{endpoint}/inference-components/{component}/routing",
                       put_component_routing)
    app.router.add_post("/admin/reload", reload)
    add_status_routes(app, get_status)
    return app
