"""Forwarding to an instance: the pooled upstream client and the streaming relay.

One request has one owner of its lifecycle (:func:`forward`): it claims an in-flight
slot (``VariantPool.acquire`` -> ``Lease``), sends the body bytes unchanged, relays the
response chunk by chunk as it arrives (SSE is never buffered), and in ``finally``
closes the upstream response and releases the lease, on every path: success, upstream
error, client disconnect (``ConnectionResetError`` from a write, or cancellation of the
handler, as the runner uses ``handler_cancellation=True``) and shutdown.

A connection error before anything was sent (refused, unreachable, connect timeout)
marks the instance unhealthy and retries once on another instance of the variant.
"""

from __future__ import annotations

import asyncio
import enum
import io
import logging
import time
from dataclasses import dataclass

import aiohttp
from aiohttp import web

from prefixroute.core.pool import Decision, NoHealthyInstance, VariantPool
from prefixroute.server import headers as H
from prefixroute.server.errors import openai_error, sagemaker_error
from prefixroute.server.settings import ServerSettings
from prefixroute.server.state import RouterState

__all__ = ["Api", "RoutedRequest", "make_client_session", "forward", "forward_get"]

log = logging.getLogger("prefixroute.server.proxy")

#: Errors raised before the request reached the instance: safe to retry elsewhere.
CONNECT_ERRORS = (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError)
_UPSTREAM_ERRORS = (aiohttp.ClientError, asyncio.TimeoutError)
_LARGE_BODY = 1 << 20  # bytes; aiohttp's threshold for "large" raw bodies
_MAX_ERROR_BODY = 8192  # characters of a model's error body kept in ModelError.OriginalMessage


class Api(enum.Enum):
    """Which API a request came in on: decides headers passed and error shapes."""

    OPENAI = "openai"
    NATIVE = "native"


@dataclass(slots=True)
class RoutedRequest:
    """A validated request, ready to be sent.

    Attributes:
        request: the incoming aiohttp request.
        api: OpenAI-compatible or SageMaker native.
        endpoint: the endpoint's name (a metrics label).
        pool: the production variant chosen for it.
        key: the routing key, or ``None`` (strategies other than PREFIX_AWARE).
        body: the raw request body, forwarded unchanged.
        upstream_path: path on the instance, e.g. ``/v1/chat/completions``.
        request_id: the ``X-Request-Id``.
        t0: ``time.perf_counter()`` at handler entry, seconds.
    """

    request: web.Request
    api: Api
    endpoint: str
    pool: VariantPool
    key: int | None
    body: bytes
    upstream_path: str
    request_id: str
    t0: float


def make_client_session(settings: ServerSettings) -> aiohttp.ClientSession:
    """The one pooled client shared by all requests (keep-alive, bounded connections).

    Bodies are relayed undecoded (``auto_decompress=False``) and aiohttp adds no
    headers of its own (``User-Agent``, ``Accept``...): the instance sees the client's.
    """
    connector = aiohttp.TCPConnector(
        limit=settings.max_connections,
        limit_per_host=0,
        keepalive_timeout=settings.keepalive_timeout_s,
        ttl_dns_cache=60,
    )
    timeout = aiohttp.ClientTimeout(
        total=None, connect=None, sock_connect=settings.connect_timeout_s, sock_read=settings.read_timeout_s)
    return aiohttp.ClientSession(
        connector=connector,
        timeout=timeout,
        auto_decompress=False,
        skip_auto_headers=("User-Agent", "Accept", "Content-Type"),
        trust_env=False,
    )


def _payload(body: bytes) -> bytes | io.BytesIO:
    # aiohttp sends a BytesIO in chunks, yielding to the loop between them (and does not
    # warn about large raw bytes); BytesIO shares the bytes object, it does not copy it.
    return body if len(body) <= _LARGE_BODY else io.BytesIO(body)


def _error(api: Api, status: int, message: str, code: str, headers: dict[str, str]) -> web.Response:
    if api is Api.NATIVE:
        kind = "ServiceUnavailable" if status == 503 else "ModelError"
        return sagemaker_error(kind, message, headers=headers)
    return openai_error(status, message, type_="server_error", code=code, headers=headers)


async def forward(state: RouterState, rr: RoutedRequest) -> web.StreamResponse:
    """Route ``rr`` to an instance of its variant and relay the answer.

    Returns the response (already sent when streaming). Status codes of its own:
    503 when no instance is healthy or every attempt was refused; 502 (OpenAI) /
    424 ``ModelError`` (native) when the instance failed after the request was sent;
    a native request the model answered with a non-2xx status gets 424 ``ModelError``
    with ``OriginalStatusCode`` and ``OriginalMessage``.
    """
    m = state.metrics
    session = state.session
    assert session is not None, "the router app is not running"
    pool = rr.pool
    variant = pool.name
    base_headers = {H.REQUEST_ID: rr.request_id, H.INVOKED_VARIANT: variant}
    up_headers = (H.openai_upstream_headers if rr.api is Api.OPENAI else H.native_upstream_headers)(
        rr.request.headers, rr.request_id)
    exclude: set[str] = set()
    router_s = 0.0  # router time before the upstream send, summed over attempts
    mark = rr.t0
    code = 0
    try:
        for _attempt in range(2):
            try:
                lease = pool.acquire(rr.key, exclude)
            except NoHealthyInstance as exc:
                code = 503
                return _error(rr.api, 503, str(exc), "no_healthy_instance", base_headers)
            try:
                decision = lease.decision
                instance = decision.instance.instance_id
                m.decision_seconds.labels(rr.endpoint, variant).observe(decision.decision_s)
                t_send = time.perf_counter()
                router_s += t_send - mark
                try:
                    upstream = await session.request(
                        "POST", instance + rr.upstream_path, data=_payload(rr.body), headers=up_headers)
                except CONNECT_ERRORS as exc:
                    mark = time.perf_counter()
                    m.upstream_errors.labels(instance, "connect").inc()
                    state.set_healthy(instance, False)
                    log.warning("instance %s: connect failed (%s)", instance,
                                type(exc).__name__)
                    exclude.add(instance)
                    continue  # the finally below releases this lease first
                except _UPSTREAM_ERRORS as exc:
                    kind = _error_kind(exc)
                    m.upstream_errors.labels(instance, kind).inc()
                    m.requests.labels(rr.endpoint, variant, instance, decision.kind.value).inc()
                    code = 502 if rr.api is Api.OPENAI else 424
                    return _error(rr.api, code, f"instance {instance} failed before responding ({kind})",
                                  "upstream_error", {**base_headers, H.INSTANCE: instance})
                m.requests.labels(rr.endpoint, variant, instance, decision.kind.value).inc()
                try:
                    resp, code = await _relay(state, rr, upstream, decision, router_s)
                    return resp
                finally:
                    upstream.close()  # no-op after a clean release; else aborts the engine's request
            finally:
                lease.release()
        code = 503
        return _error(rr.api, 503, f"no instance of production variant {variant!r} accepted a connection "
                      f"(tried {', '.join(sorted(exclude))})", "upstream_unavailable", base_headers)
    except asyncio.CancelledError:
        code = 499  # the client went away (handler cancelled)
        raise
    finally:
        m.responses.labels(rr.endpoint, variant, str(code or 500)).inc()
        m.duration_seconds.labels(rr.endpoint, variant).observe(time.perf_counter() - rr.t0)


def _error_kind(exc: BaseException) -> str:
    if isinstance(exc, asyncio.TimeoutError):
        return "timeout"
    if isinstance(exc, (aiohttp.ServerDisconnectedError, aiohttp.ClientPayloadError, ConnectionError)):
        return "disconnect"
    return "other"


async def _relay(
    state: RouterState, rr: RoutedRequest, upstream: aiohttp.ClientResponse, decision: Decision, router_s: float,
) -> tuple[web.StreamResponse, int]:
    """Copy the instance's response to the client as it arrives; returns (response, status
    code for metrics; 499 if the client left)."""
    t_headers = time.perf_counter()
    m = state.metrics
    instance = decision.instance.instance_id
    variant = decision.variant
    status = upstream.status
    if status >= 500:
        m.upstream_errors.labels(instance, "http_5xx").inc()
    if rr.api is Api.NATIVE and not 200 <= status < 300:
        return await _model_error(state, rr, upstream, decision, router_s, t_headers), 424

    if rr.api is Api.OPENAI:
        resp = web.StreamResponse(status=status, reason=upstream.reason,
                                  headers=H.openai_response_headers(upstream.headers))
    else:
        resp = web.StreamResponse(status=status, headers=H.native_response_headers(upstream.headers))
    if upstream.content_length is not None and "Transfer-Encoding" not in upstream.headers:
        resp.content_length = upstream.content_length
    h = resp.headers
    h[H.REQUEST_ID] = rr.request_id
    h[H.INVOKED_VARIANT] = variant
    h[H.INSTANCE] = instance
    h[H.DECISION] = decision.kind.value
    overhead = router_s + (time.perf_counter() - t_headers)
    h[H.OVERHEAD_MS] = f"{overhead * 1e3:.3f}"
    m.overhead_seconds.labels(rr.endpoint, variant).observe(overhead)
    request = rr.request
    try:
        await resp.prepare(request)
    except ConnectionError:
        return resp, 499
    ttft = m.ttft_seconds.labels(rr.endpoint, variant)
    first = True
    chunks = upstream.content.iter_any().__aiter__()
    while True:
        try:
            chunk = await chunks.__anext__()
        except StopAsyncIteration:
            break
        except _UPSTREAM_ERRORS as exc:
            # Headers are gone; the only honest signal left is a broken connection,
            # so the client sees a truncated response rather than a clean end.
            kind = _error_kind(exc)
            m.upstream_errors.labels(instance, kind).inc()
            log.warning("instance %s: response broken mid-body (%s)", instance, kind)
            if request.transport is not None:
                request.transport.abort()
            return resp, status
        if first:
            first = False
            ttft.observe(time.perf_counter() - rr.t0)
        try:
            await resp.write(chunk)
        except ConnectionError:
            return resp, 499
    if first:
        ttft.observe(time.perf_counter() - rr.t0)
    upstream.release()
    try:
        await resp.write_eof()
    except ConnectionError:
        return resp, 499
    return resp, status


async def _model_error(
    state: RouterState, rr: RoutedRequest, upstream: aiohttp.ClientResponse, decision: Decision,
    router_s: float, t_headers: float,
) -> web.Response:
    """SageMaker's answer to a model's non-2xx status: 424 ``ModelError``."""
    try:
        raw = await upstream.read()
        upstream.release()
    except _UPSTREAM_ERRORS as exc:  # the error body itself broke off: keep the status
        state.metrics.upstream_errors.labels(decision.instance.instance_id, _error_kind(exc)).inc()
        raw = b""
    t_back = time.perf_counter()
    status = upstream.status
    original = raw.decode("utf-8", "replace")[:_MAX_ERROR_BODY]
    side = "client" if status < 500 else "server"
    instance = decision.instance.instance_id
    overhead = router_s + (time.perf_counter() - t_back)
    state.metrics.overhead_seconds.labels(rr.endpoint, decision.variant).observe(overhead)
    state.metrics.ttft_seconds.labels(rr.endpoint, decision.variant).observe(t_headers - rr.t0)
    return sagemaker_error(
        "ModelError",
        f"Received {side} error ({status}) from model instance {instance} with message \"{original}\".",
        extra={"OriginalStatusCode": status, "OriginalMessage": original},
        headers={H.REQUEST_ID: rr.request_id, H.INVOKED_VARIANT: decision.variant, H.INSTANCE: instance,
                 H.DECISION: decision.kind.value, H.OVERHEAD_MS: f"{overhead * 1e3:.3f}"},
    )


async def forward_get(state: RouterState, request: web.Request, pool: VariantPool, path: str,
                      request_id: str) -> web.Response:
    """``GET path`` on one healthy instance of ``pool`` (e.g. ``/v1/models``); no in-flight
    slot is claimed, as this is not inference. Retries once on a connect error."""
    session = state.session
    assert session is not None, "the router app is not running"
    up_headers = H.openai_upstream_headers(request.headers, request_id)
    exclude: set[str] = set()
    for _attempt in range(2):
        try:
            instance = pool.choose(None, exclude).instance.instance_id
        except NoHealthyInstance as exc:
            return openai_error(503, str(exc), type_="server_error", code="no_healthy_instance",
                                headers={H.REQUEST_ID: request_id})
        try:
            async with session.get(instance + path, headers=up_headers) as upstream:
                body = await upstream.read()
                resp = web.Response(status=upstream.status, body=body,
                                    headers=H.openai_response_headers(upstream.headers))
                resp.headers[H.REQUEST_ID] = request_id
                resp.headers[H.INVOKED_VARIANT] = pool.name
                resp.headers[H.INSTANCE] = instance
                return resp
        except CONNECT_ERRORS:
            state.metrics.upstream_errors.labels(instance, "connect").inc()
            state.set_healthy(instance, False)
            exclude.add(instance)
        except _UPSTREAM_ERRORS as exc:
            state.metrics.upstream_errors.labels(instance, _error_kind(exc)).inc()
            return openai_error(502, f"instance {instance} failed ({_error_kind(exc)})", type_="server_error",
                                code="upstream_error", headers={H.REQUEST_ID: request_id})
    return openai_error(503, "no instance accepted a connection", type_="server_error",
                        code="upstream_unavailable", headers={H.REQUEST_ID: request_id})
