"""Forwarding to an instance: the pooled upstream client, retries, timeouts and the
streaming relay.

One request has one owner of its lifecycle (:func:`forward`): it claims an in-flight
slot (``VariantPool.acquire`` -> ``Lease``), sends the body bytes unchanged, relays the
response chunk by chunk as it arrives (SSE is never buffered), and in ``finally``
closes the upstream response and releases the lease, on every path: success, upstream
error, timeout, client disconnect (``ConnectionResetError`` from a write, or
cancellation of the handler, as the runner uses ``handler_cancellation=True``) and
shutdown. Closing the upstream response closes its connection, so the engine sees the
abort at once and stops generating.

What each outcome of an attempt means is decided by :class:`prefixroute.core.attempts.Attempts`
(shared with the fast data plane) and applied by :func:`prefixroute.server.attempt.apply_step`. Retries (at most
``max_retries``, each on an instance not tried yet) happen only when the failed instance
cannot have started the request:

* the connection could not be opened (refused, unreachable, connect timeout);
* the request could not be sent in full (the connection was reset or closed while the
  router was still writing it: an HTTP server cannot run a request whose body it has
  not received). aiohttp's ``UploadTracker`` (in the aiohttp this project installs,
  3.14.5) reports this; with an aiohttp that lacks it only the first case is retried.

A pooled keep-alive connection that the instance has already closed is detected before
anything is written on it (:class:`PoolConnector`) and replaced by another connection,
so the keep-alive race needs no retry. Nothing is retried once the request was sent in
full: not a reset or a timeout before the response headers (the engine may be
generating), not a 4xx/5xx answer, and never after response bytes reached the client.
So a generation never runs twice and the client never sees duplicated tokens.

Timeouts (:class:`~prefixroute.server.settings.ServerSettings`): connect; request sent
to response headers (bounds a non-streaming generation); silence between two body
chunks. There is no total timeout, so a long stream lasts as long as tokens flow.
"""

from __future__ import annotations

import asyncio
import inspect
import io
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import aiohttp
import orjson
from aiohttp import web
from multidict import CIMultiDict

from prefixroute.core.attempts import Attempts, Next
from prefixroute.core.openai_routes import OpenAIRoute
from prefixroute.core.pool import Decision, Lease, NoHealthyInstance, SetSaturated, VariantPool
from prefixroute.server import eventstream
from prefixroute.server import headers as H
from prefixroute.server.errors import MAX_ERROR_BODY, openai_error, sagemaker_error
from prefixroute.server.record import RequestRecord
from prefixroute.server.routes import Api
from prefixroute.server.state import RouterState
from prefixroute.server.attempt import acquire_or_grow, apply_step, client_gone, learn_route, retry_elsewhere
from prefixroute.server.client_session import FRESH_CONNECTION, REUSED_CONNECTION

__all__ = ["Api", "RoutedRequest", "forward", "forward_get", "our_headers", "saturated_error", "no_instance_error",
           "STREAM_ABORTED", "upstream_headers", "sse_error_event", "at_event_boundary", "model_error",
           "broken_message", "upstream_error", "ends_with_done"]

log = logging.getLogger("prefixroute.server.proxy")

#: The ``code`` label of a response whose status was sent but whose body the instance
#: did not finish (it failed or went silent mid-body).
STREAM_ABORTED = "stream_aborted"

#: Errors raised before a connection to the instance existed: safe to retry elsewhere.
CONNECT_ERRORS = (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError)
_UPSTREAM_ERRORS = (aiohttp.ClientError, asyncio.TimeoutError, OSError)
_LARGE_BODY = 1 << 20  # bytes; aiohttp's threshold for "large" raw bodies
_TAIL = 32  # bytes of a stream's end kept to see event boundaries and ``data: [DONE]``
_MODELS_TIMEOUT_S = 30.0  # GET /v1/models is not inference: it answers at once or not at all


def ends_with_done(tail: bytes) -> bool:
    """Whether an event stream's last bytes (``tail``: its last :data:`_TAIL`, or all
    of it if shorter) are its ``data: [DONE]`` event: that line last, then only line
    breaks, and known to start a line (a line break before it, or the stream's start).
    A token whose text is "[DONE]" is not it."""
    if b"[DONE]" not in tail:  # (most calls: one search in C)
        return False
    lines = tail.rstrip(b"\r\n").split(b"\n")
    return lines[-1].rstrip(b"\r") in (b"data: [DONE]", b"data:[DONE]") and (len(lines) >= 2 or len(tail) < _TAIL)

_UploadTracker: Any = getattr(aiohttp, "UploadTracker", None)
if _UploadTracker is not None and "upload_tracker" not in inspect.signature(aiohttp.ClientSession._request).parameters:
    _UploadTracker = None


@dataclass(slots=True)
class RoutedRequest:
    """A validated request, ready to be sent.

    Attributes:
        request: the incoming aiohttp request (``None`` on the fast data plane,
            :mod:`prefixroute.server.dataplane`).
        headers: the client's request headers.
        raw_headers: the same, as received (``(name, value)`` bytes).
        api: OpenAI-compatible, SageMaker native, or SageMaker response stream.
        endpoint: the endpoint's name (a metrics label).
        pool: the production variant chosen for it.
        key: the routing key (PREFIX_AWARE), or ``None``.
        body: the raw request body, forwarded unchanged.
        upstream_path: path on the instance, e.g. ``/v1/chat/completions``.
        request_id: the ``X-Request-Id``.
        t0: ``time.perf_counter()`` at handler entry, seconds.
        blocks: chained block hashes (CACHE_AWARE), or empty.
        decoded: the body came gzip or deflate encoded and is sent on decoded (the
            client's digests of it are then not sent on).
        completed_status: the status of an OpenAI event stream whose final
            ``data: [DONE]`` event has been handed to the client's connection (0 until
            then; :func:`ends_with_done`). A client that closes after it (the ``openai``
            client does, before the instance ends its body) had the whole answer: its
            ``responses_total`` code is this status, not 499.
        lease: the current attempt's :class:`prefixroute.core.pool.Lease` (``None``
            before the first decision); its :meth:`~prefixroute.core.pool.Lease.first_token`
            is called when the first byte of the answer's body is relayed.
        session: the session the request is pinned to
            (:class:`prefixroute.core.sessions.SessionPin`), or ``None``.
        new_session: the request asked for a session (``NEW_SESSION``): the answer
            names it (:func:`prefixroute.server.headers.pin_new_session`).
        record: what happened to it so far (:class:`RequestRecord`), read when it ends.
        selection: where the request may go
            (:class:`prefixroute.core.selection.Selection`: the pool, the candidates
            serving its model, an adapter's sticky set), or ``None`` for the whole pool.
        route: the OpenAI route (:class:`prefixroute.core.openai_routes.OpenAIRoute`),
            ``None`` on the native API.
        target: the targeted production variant, if any; ``model``: the body's model,
            if any (what :meth:`RouterState.reselect` needs).
    """

    request: web.Request | None
    headers: Mapping[str, str]
    raw_headers: H.RawHeaders
    api: Api
    endpoint: str
    pool: VariantPool
    key: int | None
    body: bytes
    upstream_path: str
    request_id: str
    t0: float
    blocks: Sequence[int] = ()
    decoded: bool = False
    completed_status: int = 0
    lease: Any = None
    session: Any = None
    new_session: bool = False
    record: RequestRecord = field(default_factory=RequestRecord)
    selection: Any = None
    route: Any = None
    target: str | None = None
    model: str | None = None

    @property
    def component(self) -> str | None:
        """The inference component the request is routed to, or ``None``."""
        return self.pool.component

    @property
    def done_marked(self) -> bool:
        """Whether its event stream (if it streams) ends with ``data: [DONE]``: chat and
        completions do; others (the Responses API's events) end otherwise."""
        return self.api is Api.OPENAI and self.route in _DONE_ROUTES


_DONE_ROUTES = frozenset({OpenAIRoute.CHAT, OpenAIRoute.COMPLETIONS})


def _payload(body: bytes) -> bytes | io.BytesIO:
    # aiohttp sends a BytesIO in chunks, yielding to the loop between them (and does not
    # warn about large raw bytes); BytesIO shares the bytes object, it does not copy it.
    return body if len(body) <= _LARGE_BODY else io.BytesIO(body)


def our_headers(rr: RoutedRequest) -> dict[str, str]:
    """The router's own headers on any answer to ``rr``: the request id, the production
    variant and, when the request was for one, the inference component."""
    out = {H.REQUEST_ID: rr.request_id, H.INVOKED_VARIANT: rr.pool.name}
    if rr.pool.component is not None:
        out[H.INVOKED_COMPONENT] = rr.pool.component
    return out


def saturated_error(state: RouterState, rr: RoutedRequest, message: str, headers: dict[str, str]) -> web.Response:
    """429 with ``Retry-After`` (the endpoint's ``LoraAdapters.RetryAfterSeconds``) for a
    saturated sticky set: OpenAI ``rate_limit_error`` / SageMaker ``ModelNotReadyException``."""
    retry = state.fleet.endpoint(rr.endpoint).config.lora.retry_after_s if rr.endpoint in state.fleet.endpoints \
        else 1
    headers = {**headers, H.RETRY_AFTER: str(retry)}
    if rr.api is Api.OPENAI:
        return openai_error(429, message, type_="rate_limit_error", code="sticky_set_saturated", headers=headers)
    return sagemaker_error("ModelNotReadyException", message, status=429, headers=headers)


def no_instance_error(rr: RoutedRequest, exc: BaseException, exclude: set[str] | frozenset[str],
                      headers: dict[str, str]) -> web.Response:
    """503 when no candidate could take ``rr`` (none healthy, or every one tried)."""
    if exclude:
        msg = f"no instance of {rr.pool.describe} could take the request (tried {', '.join(sorted(exclude))})"
        return upstream_error(rr.api, 503, msg, "upstream_unavailable", headers)
    return upstream_error(rr.api, 503, str(exc), "no_healthy_instance", headers)


def upstream_error(api: Api, status: int, message: str, code: str, headers: dict[str, str]) -> web.Response:
    """The router's own answer when the instance could not give one (503/502/504), in
    the API's shape: OpenAI ``server_error`` with ``code``, or SageMaker
    ``ServiceUnavailable`` (503) / ``ModelError``."""
    if api is not Api.OPENAI:
        kind = "ServiceUnavailable" if status == 503 else "ModelError"
        return sagemaker_error(kind, message, headers=headers)
    return openai_error(status, message, type_="server_error", code=code, headers=headers)


def _not_sent(tracker: Any) -> bool:
    """True if the upload tracker proves the request body was not sent in full."""
    if tracker is None:
        return False
    fut = tracker.upload_complete
    return fut.done() and not fut.cancelled() and fut.exception() is not None


def _error_kind(exc: BaseException) -> str:
    if isinstance(exc, asyncio.TimeoutError):
        return "timeout"
    if isinstance(exc, (ConnectionResetError, aiohttp.ClientOSError)):
        return "reset"
    if isinstance(exc, (aiohttp.ServerDisconnectedError, aiohttp.ClientPayloadError, ConnectionError)):
        return "disconnect"
    return "other"


def upstream_headers(state: RouterState, rr: RoutedRequest) -> list[tuple[bytes, bytes]]:
    """The headers ``rr`` is sent to an instance with (raw pairs, no ``Host`` or
    ``Content-Length``): :mod:`headers`' rules for its API, without any header that
    carries the router's admin token, and the router's ``traceparent``
    (:mod:`prefixroute.server.tracecontext`)."""
    if rr.api is Api.OPENAI:
        out = H.openai_upstream_headers(rr.raw_headers, rr.request_id, rr.decoded)
    else:
        out = H.native_upstream_headers(rr.raw_headers, rr.request_id, stream=rr.api is Api.NATIVE_STREAM)
    return H.strip_secrets(out, state.settings.admin_token) + rr.record.trace_context(rr.headers).upstream_pairs()


async def forward(state: RouterState, rr: RoutedRequest) -> web.StreamResponse:
    """Route ``rr`` to an instance of its variant and relay the answer.

    Returns the response (already sent when streaming). Status codes of its own:
    503 when no instance is healthy or none could be reached; 502 (OpenAI) / 424
    ``ModelError`` (native) when the instance failed after the request was sent; 504
    (OpenAI) / 424 ``ModelError`` (native) when its response headers did not come
    within ``response_headers_timeout_s``; a native request the model answered with a
    non-2xx status gets 424 ``ModelError`` with ``OriginalStatusCode`` and
    ``OriginalMessage``.
    """
    m = state.metrics
    settings = state.settings
    session = state.session
    assert session is not None, "the router app is not running"
    variant = rr.pool.name
    base_headers = our_headers(rr)
    up_headers = H.to_multidict(upstream_headers(state, rr))
    attempts = Attempts(settings.max_retries, state.retry_status)
    exclude = attempts.exclude
    router_s = 0.0  # router time before the upstream send, summed over attempts
    mark = rr.t0
    code: int | str = 0
    retry: str | None = None  # why the previous attempt is being retried
    record = rr.record
    pending: Lease | None = None  # the next attempt's, claimed before a 429/503 was given up
    fresh = False  # the next attempt goes out on a new connection (a kept-alive one failed)
    try:
        for attempts.index in range(1 + settings.max_retries):
            if attempts.index and client_gone(rr):
                code = 499  # nothing is sent again for a client that has gone
                return web.Response(status=499)
            try:
                if pending is not None:
                    lease, pending = pending, None
                    rr.lease = lease
                else:
                    lease = rr.lease = await acquire_or_grow(state, rr, exclude)
            except NoHealthyInstance as exc:
                code = 503
                record.error = "upstream_unavailable" if exclude else "no_healthy_instance"
                return no_instance_error(rr, exc, exclude, base_headers)
            except SetSaturated as exc:
                code = 429
                record.error = "sticky_set_saturated"
                return saturated_error(state, rr, str(exc), base_headers)
            pool = rr.pool
            if rr.blocks:  # before the next decision (attempt.learn_route)
                learn_route(pool, lease.decision.instance, rr.blocks)
            if retry is not None:
                m.retries.labels(rr.endpoint, variant, retry).inc()
                record.retries += 1
            try:
                decision = record.decision = lease.decision
                instance = decision.instance.instance_id
                m.decision_seconds.labels(rr.endpoint, variant).observe(decision.decision_s)
                t_send = record.t_sent = time.perf_counter()
                router_s += t_send - mark
                tracker = _UploadTracker() if _UploadTracker is not None else None
                kwargs: dict[str, Any] = {"upload_tracker": tracker} if tracker is not None else {}
                REUSED_CONNECTION.set(False)
                FRESH_CONNECTION.set(fresh)
                try:
                    async with asyncio.timeout(settings.response_headers_timeout_s):
                        upstream = await session.request(
                            "POST", instance + rr.upstream_path, data=_payload(rr.body), headers=up_headers,
                            **kwargs)
                except CONNECT_ERRORS as exc:
                    step = attempts.connect_failed(instance, type(exc).__name__,
                                                   timed_out=isinstance(exc, aiohttp.ConnectionTimeoutError))
                except TimeoutError:
                    step = attempts.headers_timeout(instance, settings.response_headers_timeout_s)
                except aiohttp.ClientResponseError as exc:  # the answer's head could not be parsed
                    step = attempts.invalid(instance, str(exc.message)[:80])
                except _UPSTREAM_ERRORS as exc:
                    step = attempts.lost(instance, _error_kind(exc), not _not_sent(tracker), REUSED_CONNECTION.get(),
                                         time.perf_counter() - t_send)
                else:
                    step = attempts.answered(instance, upstream.status)
                    if step.next is Next.TRY_ELSEWHERE:
                        try:
                            pending = await retry_elsewhere(state, rr, instance, upstream.status,
                                                            upstream.headers.get("Retry-After"), exclude)
                        except BaseException:
                            upstream.close()
                            raise
                        if pending is None:
                            step = attempts.relay()
                    if step.next is not Next.RELAY:
                        upstream.close()
                finally:
                    FRESH_CONNECTION.set(False)
                apply_step(state, rr, instance, decision, step)
                if step.next is Next.RETRY or step.next is Next.TRY_ELSEWHERE:
                    mark = time.perf_counter()
                    retry = step.reason
                    fresh = fresh or step.fresh_connection
                    continue  # the finally below releases this lease first
                if step.next is Next.ERROR:
                    code = step.client_status(rr.api is Api.OPENAI)
                    return upstream_error(rr.api, step.status, step.message, step.code,
                                          {**base_headers, H.INSTANCE: instance})
                try:
                    resp, code = await _relay(state, rr, upstream, decision, router_s)
                    return resp
                finally:
                    upstream.close()  # no-op after a clean release; else aborts the engine's request
            finally:
                lease.release()
        code = 503
        record.error = "upstream_unavailable"
        return no_instance_error(rr, NoHealthyInstance(), exclude, base_headers)
    except asyncio.CancelledError:
        code = rr.completed_status or 499  # the client went away (handler cancelled)
        raise
    finally:
        if pending is not None:  # (never left over but by a bug: its slot is not kept)
            pending.release()
        t_end = time.perf_counter()
        m.responses.labels(rr.endpoint, variant, str(code or 500)).inc()
        m.duration_seconds.labels(rr.endpoint, variant).observe(t_end - rr.t0)
        state.observers.finished(rr, code or 500, t_end)


def _response_headers(rr: RoutedRequest, upstream: aiohttp.ClientResponse) -> CIMultiDict[str]:
    raw = upstream.raw_headers
    if rr.new_session and rr.lease is not None:
        raw = H.pin_new_session(raw, rr.lease.decision.instance.instance_id)
    return _relayed_headers(rr, raw)


def _relayed_headers(rr: RoutedRequest, raw: H.RawHeaders) -> CIMultiDict[str]:
    if rr.api is Api.OPENAI:
        return H.to_multidict(H.openai_response_headers(raw))
    return H.to_multidict(H.native_response_headers(raw, stream=rr.api is Api.NATIVE_STREAM))


def sse_error_event(message: str, code: str) -> bytes:
    err = {"error": {"message": message, "type": "server_error", "param": None, "code": code}}
    return b"data: " + orjson.dumps(err) + b"\n\n"


def at_event_boundary(tail: bytes) -> bool:
    return not tail or tail.endswith((b"\n\n", b"\r\n\r\n", b"\r\r"))


async def _relay(
    state: RouterState, rr: RoutedRequest, upstream: aiohttp.ClientResponse, decision: Decision, router_s: float,
) -> tuple[web.StreamResponse, int | str]:
    """Copy the instance's response to the client as it arrives; returns (response,
    ``code`` label: the status, 499 if the client left, or :data:`STREAM_ABORTED`)."""
    t_headers = time.perf_counter()
    m = state.metrics
    instance = decision.instance.instance_id
    variant = decision.variant
    status = upstream.status
    if status >= 500:
        m.upstream_errors.labels(instance, "http_5xx").inc()
        rr.record.error = "http_5xx"
    if rr.api is not Api.OPENAI and not 200 <= status < 300:
        return await _model_error(state, rr, upstream, decision, router_s, t_headers), 424

    framed = rr.api is Api.NATIVE_STREAM
    if framed:
        resp = web.StreamResponse(status=200, headers=_response_headers(rr, upstream))
    else:
        resp = web.StreamResponse(status=status, reason=upstream.reason if rr.api is Api.OPENAI else None,
                                  headers=_response_headers(rr, upstream))
        if upstream.content_length is not None and "Transfer-Encoding" not in upstream.headers:
            resp.content_length = upstream.content_length
    sse = not framed and upstream.headers.get("Content-Type", "").startswith("text/event-stream")
    h = resp.headers
    if sse or framed:
        h["X-Accel-Buffering"] = "no"  # a buffering proxy in front (nginx) must not hold a stream back
    h[H.REQUEST_ID] = rr.request_id
    h[H.INVOKED_VARIANT] = variant
    if rr.pool.component is not None:
        h[H.INVOKED_COMPONENT] = rr.pool.component
    h[H.INSTANCE] = instance
    h[H.DECISION] = decision.kind.value
    overhead = router_s + (time.perf_counter() - t_headers)
    h[H.OVERHEAD_MS] = f"{overhead * 1e3:.3f}"
    m.overhead_seconds.labels(rr.endpoint, variant).observe(overhead)
    request = rr.request
    assert request is not None, "the aiohttp relay needs the aiohttp request"
    try:
        await resp.prepare(request)
    except ConnectionError:
        return resp, 499
    ttft = m.ttft_seconds.labels(rr.endpoint, variant)
    record = rr.record
    idle_s = state.settings.stream_idle_timeout_s
    send_s = state.settings.client_send_timeout_s
    first = True
    tail = b""
    content = upstream.content
    loop = asyncio.get_running_loop()
    while True:
        try:
            # What is already buffered needs no timer; otherwise wait at most idle_s.
            chunk = content.read_nowait()
            if not chunk:
                if content.at_eof():
                    break
                async with asyncio.timeout_at(loop.time() + idle_s):
                    chunk = await content.readany()
                if not chunk:
                    break
        except _UPSTREAM_ERRORS as exc:
            await _end_broken(state, rr, resp, instance, exc, sse, tail, idle_s)
            return resp, STREAM_ABORTED
        if first:
            first = False
            record.t_first = t = time.perf_counter()
            ttft.observe(t - rr.t0)
            if rr.lease is not None:
                rr.lease.first_token()
        record.bytes_out += len(chunk)
        if sse:
            tail = (tail + chunk)[-_TAIL:]
        if not await _send_within(resp.write(eventstream.payload_part(chunk) if framed else chunk), request, send_s):
            return resp, rr.completed_status or 499
        if sse and rr.done_marked and not rr.completed_status and ends_with_done(tail):
            rr.completed_status = status
    if first:
        record.t_first = t = time.perf_counter()
        ttft.observe(t - rr.t0)
    upstream.release()
    if sse and rr.done_marked and not ends_with_done(tail):
        m.upstream_errors.labels(instance, "no_done").inc()
        record.error = "no_done"
    if not await _send_within(resp.write_eof(), request, send_s):
        return resp, rr.completed_status or 499
    return resp, status


async def _send_within(write: Any, request: web.Request, send_s: float) -> bool:
    """Await ``write`` (a write to the client); False when the client is gone or left
    it unread for ``send_s`` seconds (``--client-send-timeout``: then its connection is
    aborted, so the handler ends and the instance's request with it)."""
    try:
        async with asyncio.timeout(send_s):
            await write
        return True
    except ConnectionError:
        return False
    except TimeoutError:
        log.info("a client left an answer unread for %g s (--client-send-timeout): disconnected", send_s)
        if request.transport is not None:
            request.transport.abort()
        return False


async def _end_broken(state: RouterState, rr: RoutedRequest, resp: web.StreamResponse, instance: str,
                      exc: BaseException, sse: bool, tail: bytes, idle_s: float) -> None:
    """The instance failed or went silent after the status line was sent. The status
    cannot change any more, so the client gets the error in the stream's own terms:

    * event-stream (``invocations-response-stream``): a ``ModelStreamError`` event
      (``StreamBroken`` or ``ModelInvocationTimeExceeded``), then a clean end;
    * SSE cut at an event boundary: an ``error`` event (what vLLM sends on a failure
      mid-stream; the ``openai`` client raises ``APIError``), then a clean end;
    * anything else (a JSON body, an SSE event cut in half): the connection is aborted,
      so the client sees a truncated body rather than a complete-looking one.
    """
    timeout = isinstance(exc, asyncio.TimeoutError)
    kind = rr.record.error = "idle_timeout" if timeout else _error_kind(exc)
    state.metrics.upstream_errors.labels(instance, kind).inc()
    state.health.passive_failure(instance)
    log.warning("instance %s: response broken mid-body (%s)", instance, kind)
    message = broken_message(instance, kind, idle_s)
    request = rr.request
    send_s = state.settings.client_send_timeout_s
    event = None
    if rr.api is Api.NATIVE_STREAM:
        event = eventstream.model_stream_error(message, "ModelInvocationTimeExceeded" if timeout else "StreamBroken")
    elif sse and at_event_boundary(tail):
        event = sse_error_event(message, "upstream_timeout" if timeout else "upstream_disconnected")
    if event is not None and request is not None:
        if await _send_within(resp.write(event), request, send_s):
            await _send_within(resp.write_eof(), request, send_s)
        return
    if rr.request is not None and rr.request.transport is not None:
        rr.request.transport.abort()


async def _model_error(
    state: RouterState, rr: RoutedRequest, upstream: aiohttp.ClientResponse, decision: Decision,
    router_s: float, t_headers: float,
) -> web.Response:
    """SageMaker's answer to a model's non-2xx status: 424 ``ModelError``."""
    instance = decision.instance.instance_id
    try:
        async with asyncio.timeout(state.settings.stream_idle_timeout_s):
            raw = await upstream.content.read(MAX_ERROR_BODY * 4)
        upstream.release()
    except _UPSTREAM_ERRORS as exc:  # the error body itself broke off: keep the status
        state.metrics.upstream_errors.labels(instance, _error_kind(exc)).inc()
        raw = b""
    return model_error(state, rr, decision, upstream.status, raw, router_s, t_headers)


def model_error(state: RouterState, rr: RoutedRequest, decision: Decision, status: int, raw: bytes,
                router_s: float, t_headers: float) -> web.Response:
    """SageMaker's 424 ``ModelError`` for a model's non-2xx ``status`` with body ``raw``
    (its first :data:`MAX_ERROR_BODY` characters in ``OriginalMessage``); records the
    router overhead (``router_s`` + building this answer) and the TTFT (``t_headers``:
    ``perf_counter()`` when the model's headers came)."""
    t_back = time.perf_counter()
    instance = decision.instance.instance_id
    rr.record.first_byte(t_headers)
    rr.record.bytes_out += len(raw)
    original = raw.decode("utf-8", "replace")[:MAX_ERROR_BODY]
    side = "client" if status < 500 else "server"
    overhead = router_s + (time.perf_counter() - t_back)
    state.metrics.overhead_seconds.labels(rr.endpoint, decision.variant).observe(overhead)
    state.metrics.ttft_seconds.labels(rr.endpoint, decision.variant).observe(t_headers - rr.t0)
    return sagemaker_error(
        "ModelError",
        f"Received {side} error ({status}) from model instance {instance} with message \"{original}\".",
        extra={"OriginalStatusCode": status, "OriginalMessage": original},
        headers={**our_headers(rr), H.INSTANCE: instance,
                 H.DECISION: decision.kind.value, H.OVERHEAD_MS: f"{overhead * 1e3:.3f}"},
    )


def broken_message(instance: str, kind: str, idle_s: float) -> str:
    """What a client is told when the instance failed (``kind``) or went silent
    (``idle_timeout``) after the status line was sent."""
    if kind == "idle_timeout":
        return f"instance {instance} sent nothing for {idle_s:g} s; the response was ended"
    return f"instance {instance} closed the connection mid-response ({kind})"


async def forward_get(state: RouterState, request: web.Request, pool: VariantPool, path: str,
                      request_id: str, drop_header: str | None = None, method: str = "GET",
                      body: bytes = b"") -> web.Response:
    """``method path`` (``GET`` by default: ``/v1/models``) on one healthy instance of
    ``pool``, its answer returned whole; no in-flight slot is claimed, as this is not
    inference. A ``GET`` or ``HEAD`` is retried on another instance after any failure to
    get an answer; another method only when the connection could not be opened.
    ``drop_header``: a request header not passed on (the one that carried the client's
    API key)."""
    session = state.session
    assert session is not None, "the router app is not running"
    raw = request.raw_headers
    if drop_header is not None:
        raw = tuple((k, v) for k, v in raw if k.lower() != drop_header.encode())
    up_headers = H.to_multidict(H.strip_secrets(H.openai_upstream_headers(raw, request_id),
                                                state.settings.admin_token))
    exclude: set[str] = set()
    rid = {H.REQUEST_ID: request_id}
    idempotent = method in ("GET", "HEAD")
    for _attempt in range(1 + state.settings.max_retries):
        try:
            instance = pool.choose(None, exclude).instance.instance_id
        except NoHealthyInstance as exc:
            msg = str(exc) if not exclude else f"no instance answered (tried {', '.join(sorted(exclude))})"
            return openai_error(503, msg, type_="server_error",
                                code="upstream_unavailable" if exclude else "no_healthy_instance", headers=rid)
        try:
            async with asyncio.timeout(min(_MODELS_TIMEOUT_S, state.settings.response_headers_timeout_s)):
                async with session.request(method, instance + path, headers=up_headers,
                                           data=body or None) as upstream:
                    data = await upstream.read()
            resp = web.Response(status=upstream.status, body=data,
                                headers=H.to_multidict(H.openai_response_headers(upstream.raw_headers)))
            resp.headers[H.REQUEST_ID] = request_id
            resp.headers[H.INVOKED_VARIANT] = pool.name
            resp.headers[H.INSTANCE] = instance
            return resp
        except CONNECT_ERRORS as exc:
            state.metrics.upstream_errors.labels(instance, "connect").inc()
            state.health.passive_failure(instance, definitive=not isinstance(exc, aiohttp.ConnectionTimeoutError))
        except _UPSTREAM_ERRORS as exc:
            state.metrics.upstream_errors.labels(instance, _error_kind(exc)).inc()
            state.health.passive_failure(instance)
            if not idempotent:
                return openai_error(502, f"instance {instance} failed before answering", type_="server_error",
                                    code="upstream_error", headers=rid)
        exclude.add(instance)
    return openai_error(503, f"no instance answered (tried {', '.join(sorted(exclude))})", type_="server_error",
                        code="upstream_unavailable", headers=rid)
