"""The fast data plane's relay of an instance's answer to the client, once its head has
come: our head for it (:func:`our_lines`, the instance's end-to-end headers, the
framing), the body copied as it arrives (events of one read in one write, a slow
client pausing the instance, ``--stream-idle-timeout``), a whole answer written from
the parser's callback (:func:`write_whole`), SageMaker's 424 ``ModelError``, and a
stream that breaks or is cut by the shutdown ended in its own terms (an SSE ``error``
event at an event boundary, an event-stream exception) or aborted.

:class:`~prefixroute.server.dataplane.FrontServer` drives it: it sends the request,
retries, releases the lease and accounts for the answer; what it is relayed with
(:class:`~prefixroute.server.upstream._Upstream`, ``_Reply``) is
:mod:`prefixroute.server.upstream`'s.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Any, Callable

from prefixroute.server import eventstream
from prefixroute.server import headers as H
from prefixroute.server.client import _Client, _ClientGone
from prefixroute.server.errors import MAX_ERROR_BODY
from prefixroute.server.http11 import _DATE, _reason, _serialize
from prefixroute.server.proxy import (STREAM_ABORTED, Api, RoutedRequest, at_event_boundary, broken_message,
                                      ends_with_done, model_error, sse_error_event)
from prefixroute.server.state import RouterState
from prefixroute.server.upstream import _error_kind, _Reply, _Upstream

if TYPE_CHECKING:
    from prefixroute.server.dataplane import FrontServer

__all__ = ["our_lines", "relay", "write_whole"]

log = logging.getLogger("prefixroute.server.dataplane")

_INVOKED_VARIANT = H.INVOKED_VARIANT.encode()
_INSTANCE = H.INSTANCE.encode()
_DECISION = H.DECISION.encode()
_OVERHEAD_MS = H.OVERHEAD_MS.encode()
_INVOKED_COMPONENT = H.INVOKED_COMPONENT.encode()


async def relay(front: FrontServer, client: _Client, rr: RoutedRequest, up: _Upstream, decision: Any,
                router_s: float, keep_alive: bool) -> int | str:
    """Copy the instance's answer to the client as it arrives (or account for the
    one :func:`write_whole` already wrote); returns the ``code`` label (the status, 499
    if the client left, or ``stream_aborted``). Run by ``front``'s connection task
    (``FrontServer._relay``)."""
    state = front.state
    m = state.metrics
    instance = decision.instance.instance_id
    variant = decision.variant
    reply = up.reply
    if reply is not None:  # written whole as it arrived
        return front._account_whole(rr, reply, instance)
    up.on_whole = None  # from here on, this task relays the answer
    t_headers = time.perf_counter()
    if rr.api is not Api.OPENAI and not 200 <= up.status < 300:
        return await _model_error(front, client, rr, up, decision, router_s, t_headers, keep_alive)
    reply = _reply(rr, up, our_lines(rr, decision), router_s, t_headers, keep_alive)
    m.overhead_seconds.labels(rr.endpoint, variant).observe(reply.overhead_s)
    ttft = m.ttft_seconds.labels(rr.endpoint, variant)
    transport = client.transport

    framed_out: list[bytes] = []  # what one read of the instance's answer gave, framed

    def sink(chunk: bytes) -> None:
        first = reply.first_s == 0.0
        framed_out.extend(reply.encode(chunk))
        if first:
            ttft.observe(reply.first_s - rr.t0)

    done_marks = reply.sse and rr.done_marked  # [DONE] written: the client has it all

    def flush() -> None:
        # Events that came in one read go out in one write: nothing waits for them.
        if framed_out:
            if not client.closed and transport is not None:
                transport.writelines(framed_out)
                if done_marks and not rr.completed_status and ends_with_done(reply.tail):
                    rr.completed_status = reply.status
            framed_out.clear()

    # The head and whatever already came, in one write.
    parts = [reply.head]
    for chunk in up.chunks:
        parts += reply.encode(chunk)
    up.chunks = []
    if reply.first_s:
        ttft.observe(reply.first_s - rr.t0)
    idle_s = state.settings.stream_idle_timeout_s
    sse, framed, tail = reply.sse, reply.framed, b""
    if not up.done.done():
        client.write(b"".join(parts))
        parts = []
        if done_marks and not client.closed and ends_with_done(reply.tail):
            rr.completed_status = reply.status
        client.upstream = up
        up.sink, up.flush = sink, flush
        if client.write_paused:
            up.pause()
        watch = _IdleWatch(front.loop, up, client, idle_s)
        try:
            await front._await(client, up.done, None)
        except TimeoutError:
            return _end_broken(state, client, rr, up, instance, TimeoutError(), sse, reply.tail, idle_s, framed)
        except _ClientGone:
            up.abort()
            return rr.completed_status or 499
        except asyncio.CancelledError:
            if front.closing:  # cut by the shutdown: ended in the stream's own terms
                _end_cut(client, sse, reply.tail, framed)
            raise
        finally:
            watch.cancel()
            client.upstream = None
    tail = reply.tail
    if up.error is not None and not up.complete:
        if parts:
            client.write(b"".join(parts))
        return _end_broken(state, client, rr, up, instance, up.error, sse, tail, idle_s, framed)
    if not reply.first_s:
        reply.first_s = rr.record.t_first = time.perf_counter()
        ttft.observe(reply.first_s - rr.t0)
    if sse and rr.done_marked and not ends_with_done(tail):
        m.upstream_errors.labels(instance, "no_done").inc()
        rr.record.error = "no_done"
    if client.closed:
        return rr.completed_status or 499
    if reply.chunked:
        parts.append(b"0\r\n\r\n")
    client.write(b"".join(parts))
    return reply.status


def _reply(rr: RoutedRequest, up: _Upstream, ours: bytes, router_s: float, t_headers: float,
           keep_alive: bool) -> _Reply:
    """How ``up``'s answer (its head received) is relayed: our head for it (the
    instance's end-to-end headers, ``ours`` (:func:`our_lines`), the framing) and
    the framing of its body."""
    status = up.status
    framed = rr.api is Api.NATIVE_STREAM
    content_length = up.content_length
    resp_headers: H.RawHeaders = up.resp_headers
    if rr.new_session and rr.lease is not None:
        resp_headers = H.pin_new_session(resp_headers, rr.lease.decision.instance.instance_id)
    if rr.api is Api.OPENAI:
        theirs = H.openai_response_lines(resp_headers)
    else:
        theirs = H.header_lines(H.native_response_headers(resp_headers, stream=framed))
    sse = not framed and up.content_type.startswith(b"text/event-stream")
    reply = _Reply(rr.record)
    reply.lease = rr.lease
    reply.overhead_s = overhead = router_s + (time.perf_counter() - t_headers)
    # An event-stream answer always has a body (the events, maybe none), framed chunked.
    reply.bodyless = bodyless = status in (204, 304) and not framed
    reply.chunked = chunked = (framed or content_length is None) and not bodyless
    if framed:
        status, reason = 200, b"OK"
    elif rr.api is Api.OPENAI:
        reason = up.reason or _reason(status)
    else:
        reason = _reason(status)
    if bodyless:
        framing = b""
    elif chunked:
        framing = b"Transfer-Encoding: chunked\r\n"
    else:
        framing = b"Content-Length: " + content_length + b"\r\n"  # type: ignore[operator]
    reply.status, reply.framed, reply.sse = status, framed, sse
    # Laid out as _head lays a head out (status line, headers, Date, framing), in one step.
    reply.head = b"HTTP/1.1 %d %s\r\n%s%s%s%s: %.3f\r\nDate: %s\r\n%s%s\r\n" % (
        status, reason, theirs, b"X-Accel-Buffering: no\r\n" if sse or framed else b"", ours, _OVERHEAD_MS,
        overhead * 1e3, _DATE.get(), framing,
        b"" if keep_alive else b"Connection: close\r\n")
    return reply


def write_whole(state: RouterState, client: _Client, rr: RoutedRequest, ours: bytes, router_s: float,
                keep_alive: bool, up: _Upstream) -> None:
    """``up``'s answer came whole before its relay started (a non-streamed answer,
    usually): written to the client from the parser's callback, at once, so that
    the bookkeeping (metrics, the lease, the pooled connection: :func:`relay` and
    ``FrontServer._forward``, when the request's task resumes) comes after the client
    has it. Left to the task: a SageMaker ModelError answer, a client gone."""
    if client.closed or (rr.api is not Api.OPENAI and not 200 <= up.status < 300) or \
            state.retry_status.retries(up.status, state.settings.max_retries):
        return  # (a 429/503 that --retry-status may send elsewhere: the task decides)
    reply = _reply(rr, up, ours, router_s, time.perf_counter(), keep_alive)
    if reply.sse or reply.chunked or reply.bodyless or reply.framed:
        parts = [reply.head]
        for chunk in up.chunks:
            parts += reply.encode(chunk)
        if reply.chunked:
            parts.append(b"0\r\n\r\n")
    else:  # the body as it came (what encode() would give for each chunk)
        parts = [reply.head, *up.chunks]
        rr.record.bytes_out += sum(map(len, up.chunks))
    if not reply.first_s:
        reply.first()
    up.chunks = []
    up.reply = reply
    transport = client.transport  # client.write(), inline (the client is there: checked above)
    if transport is not None:
        transport.write(b"".join(parts))


def _end_broken(state: RouterState, client: _Client, rr: RoutedRequest, up: _Upstream, instance: str,
                exc: BaseException, sse: bool, tail: bytes, idle_s: float, framed: bool) -> str:
    """As proxy._end_broken: the status is sent; end in the stream's own terms."""
    timeout = isinstance(exc, TimeoutError)
    kind = rr.record.error = "idle_timeout" if timeout else _error_kind(exc)
    up.abort()
    state.metrics.upstream_errors.labels(instance, kind).inc()
    state.health.passive_failure(instance)
    log.warning("instance %s: response broken mid-body (%s)", instance, kind)
    message = broken_message(instance, kind, idle_s)
    if not _end_with_event(client, sse, tail, framed,
                           lambda: eventstream.model_stream_error(
                               message, "ModelInvocationTimeExceeded" if timeout else "StreamBroken"),
                           lambda: sse_error_event(message, "upstream_timeout" if timeout else
                                                   "upstream_disconnected")):
        client.abort()
    return STREAM_ABORTED


def _end_cut(client: _Client, sse: bool, tail: bytes, framed: bool) -> None:
    """A stream under way cut by the shutdown (``--shutdown-timeout`` passed, or a
    second stop signal): its client gets the stream's own error event and the end of
    the body, as when the instance breaks off (:func:`_end_broken`), where an event
    can be placed; else the connection is closed (by the shutdown), as before."""
    message = "the router is shutting down: the response was cut before its end"
    _end_with_event(client, sse, tail, framed, lambda: eventstream.internal_stream_failure(message),
                    lambda: sse_error_event(message, "router_shutting_down"))


async def _model_error(front: FrontServer, client: _Client, rr: RoutedRequest, up: _Upstream, decision: Any,
                       router_s: float, t_headers: float, keep_alive: bool) -> int:
    """SageMaker's answer to a model's non-2xx status: 424 ``ModelError``."""
    state = front.state
    instance = decision.instance.instance_id
    try:
        await front._await(client, up.done, state.settings.stream_idle_timeout_s)
    except TimeoutError as exc:  # the error body itself went silent: keep the status
        state.metrics.upstream_errors.labels(instance, _error_kind(exc)).inc()
    if up.error is not None and not up.complete:
        state.metrics.upstream_errors.labels(instance, _error_kind(up.error)).inc()
    resp = model_error(state, rr, decision, up.status, b"".join(up.chunks)[:MAX_ERROR_BODY * 4], router_s,
                       t_headers)
    client.write(_serialize(resp, keep_alive))
    return 424


def _end_with_event(client: _Client, sse: bool, tail: bytes, framed: bool, framed_event: Callable[[], bytes],
                    sse_event: Callable[[], bytes]) -> bool:
    """End a chunked stream relayed to ``client`` with an error event in its own terms
    (an event-stream exception, or an SSE error object at an event boundary) and the
    last chunk. False if no event can be placed (an SSE stream cut inside an event, or
    a stream of neither kind): nothing written."""
    if framed:
        event = framed_event()
    elif sse and at_event_boundary(tail):
        event = sse_event()
    else:
        return False
    client.write(b"%x\r\n%s\r\n0\r\n\r\n" % (len(event), event))
    return True


def our_lines(rr: RoutedRequest, decision: Any) -> bytes:
    """Our own response header lines (each ending in CRLF): ``X-Request-Id``, the
    production variant, the instance, the decision and, for a request to one, the
    inference component (``headers.py`` names them)."""
    lines = b"X-Request-Id: %s\r\n%s: %s\r\n%s: %s\r\n%s: %s\r\n" % (
        rr.request_id.encode(), _INVOKED_VARIANT, decision.variant.encode(), _INSTANCE,
        decision.instance.instance_id.encode(), _DECISION, decision.kind.value.encode())
    component = rr.pool.component
    if component is not None:
        lines += b"%s: %s\r\n" % (_INVOKED_COMPONENT, component.encode())
    return lines


class _IdleWatch:
    """Fails ``up.done`` with ``TimeoutError`` once the instance has sent nothing for
    ``idle_s`` (a client that reads slowly, pausing the instance, does not count).
    One timer per ``idle_s``, not one per chunk."""

    def __init__(self, loop: asyncio.AbstractEventLoop, up: _Upstream, client: _Client, idle_s: float) -> None:
        self.loop, self.up, self.client, self.idle_s = loop, up, client, idle_s
        up.last_data = loop.time()
        self.handle: asyncio.TimerHandle | None = loop.call_later(idle_s, self._check)

    def _check(self) -> None:
        up = self.up
        if up.done.done():
            self.handle = None
            return
        due = up.last_data + self.idle_s
        if self.client.write_paused:
            due = self.loop.time() + self.idle_s
        elif self.loop.time() >= due:
            self.handle = None
            up.done.set_exception(TimeoutError())
            return
        self.handle = self.loop.call_at(due, self._check)

    def cancel(self) -> None:
        if self.handle is not None:
            self.handle.cancel()
            self.handle = None
