"""The fast data plane: the router's public port on raw asyncio protocols.

aiohttp's server and client cost about 0.4 ms of CPU per proxied request on the
development machine (docs/PERFORMANCE.md, "Where the time goes"), several times the
routing itself. The inference routes therefore run here, on ``asyncio.Protocol``
objects with ``httptools`` (llhttp) parsing both sides, with no task, stream reader
or response object per request (the usual request, sent over a pooled connection and
answered whole, wakes no task at all); everything else goes to the aiohttp application.

::

    client ──► FrontServer (public port, this module)
                 │ POST inference route (routes.match_route), HTTP/1.1, http:// instances, a body plain or
                 │ gzip/deflate (decoded here, strictly; any other coding: 415)
                 ├──► prepare_inference (app.py: resolve, validate, select the pool and
                 │      its candidates for the component / model / adapter, routing key)
                 │      └─► proxy.acquire ─► _Upstream (pooled raw connection) ─► instance
                 │      (from the parser's callback, FrontServer.begin, when the client
                 │      connection is idle; a whole answer is then written and settled
                 │      by callbacks, anything else handed to the connection's task)
                 │ anything else (GET /metrics, /health, /v1/models, HTTP/1.0,
                 │ unknown paths, https instances)
                 └──► the aiohttp app on a private Unix socket (same process), relayed

Behaviour is the aiohttp path's (:func:`prefixroute.server.proxy.forward`), which stays
the reference: the same error shapes and status codes, headers, metrics, retries (only
when the instance cannot have started the request: connect failure, or the connection
lost before the request was written in full), timeouts (connect, response headers,
stream idle), mid-stream failures (an SSE ``error`` event at an event boundary, a
``ModelStreamError`` event for the AWS event-stream, else the client connection is
aborted), SageMaker's 424 ``ModelError``, the in-flight lease released on every path,
and the instance's connection closed at once when the client goes away (so the engine
stops generating). Bodies are relayed as they arrive; backpressure from a slow client
pauses reading from the instance.

Client connections: HTTP/1.1 keep-alive and pipelining (answered in order, one at a
time), ``Expect: 100-continue``, request line + headers at most
:data:`MAX_HEAD_BYTES` in at most :data:`MAX_HEADERS` fields (431 beyond), bodies at most ``--max-body-size`` (413 in the
API's shape, then the connection is closed), idle keep-alive connections closed after
``--client-keepalive-timeout`` (``ServerSettings.client_keepalive_timeout_s``), and a
request that stops arriving part-way answered 408 and closed after as long without a
byte of it.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import email.utils
import functools
import http
import logging
import os
import select
import tempfile
import time
from typing import Any, Callable

import httptools
import orjson
from aiohttp import web

from prefixroute.core.pool import Lease, NoHealthyInstance, SetSaturated
from prefixroute.server import eventstream
from prefixroute.server import headers as H
from prefixroute.server.app import (
    BodyNotDecoded,
    BodyTimedOut,
    BodyTooLarge,
    count_answer,
    decode_request_body,
    error_for_path,
    prepare_inference,
    request_coding,
    request_id,
    transfer_refused,
)
from prefixroute.server.proxy import STREAM_ABORTED, Api, RoutedRequest, acquire, acquire_or_grow, at_event_boundary, \
    broken_message, connect_failed, count_routed, ends_with_done, model_error, no_instance_error, our_headers, \
    peer_closed, retry_elsewhere, saturated_error, sse_error_event, upstream_error, upstream_headers
from prefixroute.server.record import RequestRecord
from prefixroute.server.routes import RouteMatch, match_route
from prefixroute.server.state import RouterState

__all__ = ["FrontServer", "match_route", "MAX_HEAD_BYTES", "MAX_HEADERS"]

log = logging.getLogger("prefixroute.server.dataplane")

#: Most bytes of request line + headers a client may send (aiohttp's limits are of the
#: same order: 8,190 bytes per line); 431 beyond.
MAX_HEAD_BYTES = 64 * 1024
_MAX_ERROR_BODY = 8192  # characters of a model's error body kept (as proxy.py)
#: How long the metrics of an answer written whole wait, seconds: they are recorded
#: together, off the requests' path (:meth:`FrontServer.account`); ``/metrics`` records
#: them first.
ACCOUNTING_DELAY_S = 0.001
_TAIL = 32  # bytes of a stream's end kept to see event boundaries and ``data: [DONE]``
# Hop-by-hop and framing headers never relayed as they are (RFC 9110 §7.6.1).
_FRAMING = frozenset({b"connection", b"keep-alive", b"transfer-encoding", b"content-length", b"te",
                      b"trailer", b"upgrade", b"proxy-connection", b"expect"})


class _Date:
    """The ``Date`` header, formatted once per second."""

    __slots__ = ("second", "value")

    def __init__(self) -> None:
        self.second = -1
        self.value = b""

    def get(self) -> bytes:
        now = time.time()
        second = int(now)
        if second != self.second:
            self.second = second
            self.value = email.utils.formatdate(now, usegmt=True).encode()
        return self.value


_DATE = _Date()
_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
#: Longest request header line accepted (aiohttp's limit): 431 beyond.
MAX_FIELD_BYTES = 8190
#: Most header fields a request may have: 431 beyond. Without it, a request with
#: thousands of small headers within MAX_HEAD_BYTES would be relayed to the engine
#: whole. HAProxy's default (101 with the request line); below aiohttp's 128, with room
#: for the fields the router adds to what it passes on (to the aiohttp app, to an engine).
MAX_HEADERS = 100
#: Fields a request may carry once (RFC 9110's singletons, as aiohttp's parser checks
#: them, so both data planes answer a repeated one alike: 400 "Duplicate 'Host' header
#: found."); lower-case name -> the name the answer gives.
SINGLETON_FIELDS = {n.lower().encode(): n for n in (
    "Content-Length", "Content-Location", "Content-Range", "Content-Type", "ETag", "Host", "Max-Forwards",
    "Server", "Transfer-Encoding", "User-Agent")}

#: Seconds of silence after which a connection refused mid-request (413, 431, 400), or
#: closed at shutdown with pipelined input unread, closes; until then it reads and drops
#: what the client still sends: closing with unread bytes would reset the connection,
#: and the client could lose the answers not yet delivered.
LINGER_S = 2.0
#: Most seconds a connection lingers, however long the client keeps sending (nginx's
#: ``lingering_time`` idea; its ``lingering_timeout`` is :data:`LINGER_S`'s).
LINGER_MAX_S = 10.0
_INVOKED_VARIANT = H.INVOKED_VARIANT.encode()
_INSTANCE = H.INSTANCE.encode()
_DECISION = H.DECISION.encode()
_OVERHEAD_MS = H.OVERHEAD_MS.encode()
_INVOKED_COMPONENT = H.INVOKED_COMPONENT.encode()


def _reason(status: int) -> bytes:
    try:
        return http.HTTPStatus(status).phrase.encode()
    except ValueError:
        return b"Unknown"


def _head(status: int, reason: bytes, headers: H.RawHeaders, framing: bytes, keep_alive: bool,
          lines: bytes = b"") -> bytes:
    """A response head: status line, ``headers`` (raw pairs), ``lines`` (header lines
    already formatted, each ending in CRLF), ``Date``, the framing header line(s)
    (``framing``, ending in CRLF) and the blank line."""
    parts = [b"HTTP/1.1 %d %s\r\n" % (status, reason)]
    for k, v in headers:
        parts += (k, b": ", v, b"\r\n")
    parts.append(lines)
    parts.append(b"Date: " + _DATE.get() + b"\r\n")
    parts.append(framing)
    if not keep_alive:
        parts.append(b"Connection: close\r\n")
    parts.append(b"\r\n")
    return b"".join(parts)


def _field(headers: H.RawHeaders, name: bytes) -> bytes | None:
    """The first value of field ``name`` (lower-case) in raw header pairs, or ``None``."""
    for k, v in headers:
        if k.lower() == name:
            return v
    return None


def _serialize(resp: web.Response, keep_alive: bool) -> bytes:
    """A complete aiohttp ``web.Response`` (the error constructors') as bytes."""
    body = resp.body
    assert isinstance(body, bytes), "only responses with a bytes body are serialised"
    headers = [(k.encode("latin-1"), v.encode("utf-8", "surrogateescape")) for k, v in resp.headers.items()
               if k.lower() not in ("content-length", "date")]
    return _head(resp.status, _reason(resp.status), headers, b"Content-Length: %d\r\n" % len(body),
                 keep_alive) + body


class _UpstreamLost(Exception):
    """The instance's connection ended before the response headers."""

    def __init__(self, exc: BaseException | None, sent: bool) -> None:
        super().__init__(str(exc) if exc else "connection closed")
        self.exc = exc
        self.sent = sent  # the request was written in full


class _ClientGone(Exception):
    """The client closed its connection before the answer was complete."""


class _Reply:
    """An answer as relayed to the client: its status and head, and how each body chunk
    is framed (:meth:`encode`). ``first_s`` is ``time.perf_counter()`` when the first
    body chunk was framed (0.0 until then), ``tail`` the last bytes of an SSE stream,
    ``overhead_s`` the router's time on the request (``X-Prefixroute-Overhead-Ms``)."""

    __slots__ = ("status", "head", "framed", "sse", "chunked", "bodyless", "tail", "first_s", "overhead_s", "record",
                 "lease")

    def __init__(self, record: RequestRecord) -> None:
        self.record = record  # the request's: its first byte and bytes out are counted here
        self.status = 0
        self.head = b""
        self.framed = self.sse = self.chunked = self.bodyless = False
        self.tail = b""
        self.first_s = 0.0
        self.overhead_s = 0.0
        self.lease: Any = None  # told of the first body byte (Lease.first_token)

    def first(self) -> None:
        """The first body byte is relayed now: ``first_s`` (the record's ``t_first``) and the
        lease's prefill end."""
        self.first_s = self.record.t_first = time.perf_counter()
        if self.lease is not None:
            self.lease.first_token()

    def encode(self, chunk: bytes) -> tuple[bytes, ...]:
        """``chunk`` of the instance's body as written to the client."""
        if not self.first_s:
            self.first()
        self.record.bytes_out += len(chunk)
        if self.sse:
            self.tail = (self.tail + chunk)[-_TAIL:]
        if self.bodyless:
            return ()
        if self.framed:
            chunk = eventstream.payload_part(chunk)
        return (b"%x\r\n" % len(chunk), chunk, b"\r\n") if self.chunked else (chunk,)


class _Upstream(asyncio.Protocol):
    """One pooled HTTP/1.1 connection to an instance (or to the internal aiohttp app),
    carrying one exchange at a time. The response is parsed by ``httptools``; its head
    resolves :attr:`headers_fut`; body chunks go to :attr:`sink` (buffered until the
    relay is set up); the end resolves :attr:`done`."""

    def __init__(self, pool: _UpstreamPool, target: tuple[Any, ...]) -> None:
        self.pool = pool
        self.target = target
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.lost = False
        self.idle = False  # in the pool, between two exchanges
        self.reused = False  # taken from the pool: it carried an exchange before this one
        self.idle_since = 0.0
        self.poller: select.poll | None = None  # this socket registered, for peer_gone()
        self.read_paused = False  # reading paused while a slow client catches up
        self._reset()

    def _reset(self) -> None:
        loop = self.pool.loop
        self.headers_fut: asyncio.Future[None] = loop.create_future()
        self.done: asyncio.Future[None] = loop.create_future()
        self.status = 0
        self.reason = b""
        self.resp_headers: list[tuple[bytes, bytes]] = []
        self.chunks: list[bytes] = []
        self.sink: Callable[[bytes], None] | None = None
        self.flush: Callable[[], None] | None = None  # called after each read the parser took
        self.complete = False
        self.keep_alive = False
        self.until_eof = False
        self.sent = False
        self.no_body = False  # the answer to a HEAD request: the head is all of it
        self.in_trailers = False
        self.stray = False  # bytes after the complete answer: the connection is not reused
        self.error: BaseException | None = None
        self.last_data = 0.0
        # From the answer's head: its Content-Length (None if chunked or absent), whether
        # it is chunked, its first Content-Type.
        self.content_length: bytes | None = None
        self.chunked = False
        self.content_type = b""
        # Called with this connection when the answer is complete, if set by then (the
        # relay has not started): FrontServer._whole writes it to the client at once.
        self.on_whole: Callable[[_Upstream], None] | None = None
        self.reply: _Reply | None = None  # what on_whole wrote
        # Called once, on the loop's next turn, at the first event of the exchange (the
        # head came, the answer is complete, the connection failed), if set by then: how
        # FrontServer.begin's callbacks learn of it without a task or future callbacks.
        self.watcher: Callable[[], None] | None = None
        # The head came: headers_fut is resolved once the read that brought it is parsed
        # (after on_whole wrote a whole answer to the client, so that scheduling the
        # future's callbacks is not on the way).
        self.headers_due = False

    # -- asyncio.Protocol ---------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's are not asyncio.Transport
        # pause_writing/resume_writing then say exactly when the request left our buffer.
        self.transport.set_write_buffer_limits(high=0, low=0)  # type: ignore[union-attr]
        sock = transport.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError, ValueError):
                poller = select.poll()
                poller.register(sock.fileno(), select.POLLIN | select.POLLPRI)
                self.poller = poller

    def peer_gone(self) -> bool:
        """:func:`~prefixroute.server.proxy.peer_closed` for this idle connection, with
        its socket registered once (one ``poll`` system call, zero timeout)."""
        transport = self.transport
        if transport is None or transport.is_closing():
            return True
        poller = self.poller
        return peer_closed(transport) if poller is None else bool(poller.poll(0))

    def data_received(self, data: bytes) -> None:
        if self.idle:  # bytes nobody asked for on a pooled connection: never reuse it
            self.abort()
            return
        self.last_data = self.pool.loop.time()
        try:
            self.parser.feed_data(data)
        except (httptools.HttpParserError, httptools.HttpParserUpgrade) as exc:  # (an engine's 101 is invalid here)
            if self.headers_due:  # a head parsed, then a broken body: as when it resolved at once
                self._headers_now()
            log.warning("instance %s: invalid HTTP response (%s)", self.target[0], exc)
            self._fail(exc)
            if self.transport is not None:
                self.transport.abort()
        finally:
            if self.flush is not None:  # what the sink framed from these bytes, in one write
                self.flush()
            if self.headers_due:
                self._headers_now()

    def eof_received(self) -> bool | None:
        if self.until_eof and self.headers_fut.done() and not self.complete:
            self.on_message_complete()
        return None

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        self.pool.forget(self)
        if self.until_eof and self.headers_fut.done() and not self.complete and exc is None:
            self.on_message_complete()
            return
        if not self.complete:
            self._fail(exc or ConnectionError("connection closed by the instance"))

    def pause_writing(self) -> None:
        self.sent = False

    def resume_writing(self) -> None:
        self.sent = True

    # -- httptools callbacks ------------------------------------------------------

    def on_message_begin(self) -> None:
        if self.complete:  # a second answer to one request: ignored, and no reuse
            self.stray = True

    def on_status(self, reason: bytes) -> None:
        if not self.stray:
            self.reason += reason

    def on_header(self, name: bytes, value: bytes) -> None:
        if not self.in_trailers and not self.stray:  # trailers of a chunked body are not relayed
            self.resp_headers.append((name, value))

    def on_headers_complete(self) -> None:
        if self.stray:
            return
        self.status = self.parser.get_status_code()
        if 100 <= self.status < 200:  # an interim answer (we never send Expect): skip it
            self.reason = b""
            self.resp_headers = []
            return
        self.sent = True  # an answer means the instance took the request
        self.in_trailers = True
        length: bytes | None = None
        chunked = False
        content_type = b""
        for k, v in self.resp_headers:
            low = k.lower()
            if low == b"content-length":
                if length is None:
                    length = v
            elif low == b"transfer-encoding":
                chunked = True
            elif low == b"content-type" and not content_type:
                content_type = v
        self.content_length = None if chunked else length
        self.chunked = chunked
        self.content_type = content_type
        self.until_eof = length is None and not chunked and self.status not in (204, 304)
        self.headers_due = True  # the answer may be all in this read: written first
        if self.no_body:  # llhttp cannot be told; end the exchange here, and the connection after it
            self.until_eof = False
            self.on_message_complete()
            self.keep_alive = False

    def on_body(self, body: bytes) -> None:
        if self.complete:
            return
        if self.sink is not None:
            self.sink(body)
        else:
            self.chunks.append(body)

    def on_message_complete(self) -> None:
        if 100 <= self.status < 200 or self.complete:
            return
        self.complete = True
        self.keep_alive = self.parser.should_keep_alive()  # llhttp forgets it once the message is over
        hook = self.on_whole
        if hook is not None:
            self.on_whole = None
            try:
                hook(self)
            except Exception:  # our bug: the request's task relays the answer instead
                log.exception("instance %s: writing a whole answer failed", self.target[0])
        if self.headers_due:
            self._headers_now()
        if not self.done.done():
            self.done.set_result(None)
        self._notify()

    def _headers_now(self) -> None:
        self.headers_due = False
        if not self.headers_fut.done():
            self.headers_fut.set_result(None)
        self._notify()

    def _notify(self) -> None:
        watcher = self.watcher
        if watcher is not None:
            self.watcher = None
            self.pool.notify(watcher)

    # -- the exchange -------------------------------------------------------------

    def send(self, head: bytes, body: bytes) -> None:
        """Write one request (``head`` ends with the blank line)."""
        assert self.transport is not None
        self.transport.writelines((head, body) if body else (head,))
        self.sent = self.transport.get_write_buffer_size() == 0

    def _fail(self, exc: BaseException) -> None:
        if self.error is None:
            self.error = exc
        if not self.headers_fut.done():
            self.headers_fut.set_exception(_UpstreamLost(exc, self.sent))
            self.headers_fut.exception()  # retrieved: no "never retrieved" warning if unawaited
        if not self.done.done():
            self.done.set_result(None)  # the relay reads self.error
        self._notify()

    def pause(self) -> None:
        if self.transport is not None and not self.lost:
            self.read_paused = True
            self.transport.pause_reading()

    def resume(self) -> None:
        if self.transport is not None and not self.lost:
            self.read_paused = False
            self.transport.resume_reading()

    def abort(self) -> None:
        """Close at once (the instance sees the abort and stops generating)."""
        if self.transport is not None:
            self.transport.abort()

    def finish(self) -> None:
        """The exchange is over: keep the connection for the next request if it is
        clean and kept alive, else close it."""
        self.sink = None
        self.flush = None
        self.on_whole = None
        self.watcher = None
        if self.read_paused and self.transport is not None and not self.lost and not self.transport.is_closing():
            # Paused for a slow client by the read that ended the answer: a pooled
            # connection must read again (its next answer, or the engine closing it).
            self.read_paused = False
            self.transport.resume_reading()
        if self.complete and not self.lost and self.keep_alive and not self.stray and self.transport is not None \
                and not self.transport.is_closing():
            self._reset()  # the parser goes on with the next response (llhttp keeps alive)
            self.pool.put(self)
        elif self.transport is not None:
            self.transport.abort() if not self.complete else self.transport.close()


class _UpstreamPool:
    """Kept-alive :class:`_Upstream` connections by target, at most ``limit`` open.

    A target is ``(label, host, port)`` for TCP or ``(label, None, path)`` for a Unix
    socket. Idle connections are reused most recent first, checked alive first, and
    closed after ``keepalive_s``.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, limit: int, keepalive_s: float) -> None:
        self.loop = loop
        self.limit = limit
        self.keepalive_s = keepalive_s
        self.idle: dict[tuple[Any, ...], list[_Upstream]] = {}
        self.open = 0
        self._conns: set[_Upstream] = set()
        self._waiters: collections.deque[asyncio.Future[None]] = collections.deque()
        self._sweeper: asyncio.TimerHandle | None = None
        self.due: list[Callable[[], None]] = []  # the watchers of exchanges that had an event (notify())

    def notify(self, watcher: Callable[[], None]) -> None:
        """Run ``watcher`` (an exchange's event: its answer's head, its end, its failure)
        on the next loop turn, or sooner: when :meth:`run_due` is called first."""
        if not self.due:
            self.loop.call_soon(self.run_due)
        self.due.append(watcher)

    def run_due(self) -> None:
        """Run the watchers :meth:`notify` queued, in order. Under load, a loop turn reads
        many sockets before its ``call_soon`` callbacks run: a request read in that turn
        runs them first (:meth:`FrontServer.begin`), so that the answers already written
        have released their instance and pooled their connection, and it can be sent at
        once over one of them instead of waiting for the next turn in the task."""
        due, self.due = self.due, []
        for watcher in due:
            try:
                watcher()
            except Exception:  # our bug: the other exchanges go on
                log.exception("handling an upstream exchange's event failed")

    def take(self, target: tuple[Any, ...]) -> _Upstream | None:
        """An idle connection to ``target`` still open (most recent first), or ``None``.
        Not a coroutine: reusing a connection, the usual case, costs no await."""
        idle = self.idle.get(target)
        if not idle:
            return None
        now = self.loop.time()
        while idle:
            conn = idle.pop()
            conn.idle = False
            if not idle:
                del self.idle[target]  # no empty list kept per instance ever used
            if now - conn.idle_since < self.keepalive_s and not conn.peer_gone():
                conn.reused = True
                return conn
            conn.abort()
        return None

    async def get(self, target: tuple[Any, ...], connect_timeout_s: float) -> _Upstream:
        """A connection to ``target``, idle (:meth:`take`) or new.

        Raises:
            OSError: the connection could not be opened.
            TimeoutError: not within ``connect_timeout_s``.
        """
        conn = self.take(target)
        return conn if conn is not None else await self.connect(target, connect_timeout_s)

    async def connect(self, target: tuple[Any, ...], connect_timeout_s: float) -> _Upstream:
        """A new connection to ``target`` (waiting while ``limit`` are open).

        Raises:
            OSError: the connection could not be opened.
            TimeoutError: not within ``connect_timeout_s``.
        """
        while self.open >= self.limit:
            fut = self.loop.create_future()
            self._waiters.append(fut)
            await fut
        self.open += 1
        try:
            async with asyncio.timeout(connect_timeout_s):
                if target[1] is None:
                    _, conn = await self.loop.create_unix_connection(lambda: _Upstream(self, target), target[2])
                else:
                    _, conn = await self.loop.create_connection(lambda: _Upstream(self, target), target[1],
                                                                target[2])
        except BaseException:
            self._closed_one()
            raise
        self._conns.add(conn)
        sock = conn.transport.get_extra_info("socket") if conn.transport is not None else None
        if target[1] is not None and sock is not None and sock.getsockname() == sock.getpeername():
            # TCP self-connect: nothing listens on the port and the kernel picked that
            # same port as ours (loopback, ephemeral range): a refused connection really.
            conn.abort()
            raise ConnectionRefusedError(f"nothing listens on {target[1]}:{target[2]} (self-connect)")
        return conn

    def put(self, conn: _Upstream) -> None:
        conn.idle = True
        conn.idle_since = self.loop.time()
        self.idle.setdefault(conn.target, []).append(conn)
        if self._sweeper is None:
            self._sweeper = self.loop.call_later(self.keepalive_s, self._sweep)

    def forget(self, conn: _Upstream) -> None:
        if conn in self._conns:
            self._conns.discard(conn)
            idle = self.idle.get(conn.target)
            if idle and conn in idle:
                idle.remove(conn)
                if not idle:
                    del self.idle[conn.target]
            self._closed_one()

    def _closed_one(self) -> None:
        self.open -= 1
        while self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():
                fut.set_result(None)
                break

    def _sweep(self) -> None:
        self._sweeper = None
        now = self.loop.time()
        for idle in self.idle.values():
            for conn in [c for c in idle if now - c.idle_since >= self.keepalive_s]:
                conn.abort()
        if any(self.idle.values()):
            self._sweeper = self.loop.call_later(self.keepalive_s / 2, self._sweep)

    def close(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None
        for conn in list(self._conns):
            conn.abort()


class _Incoming:
    """One request read from a client."""

    __slots__ = ("url", "headers", "index", "head_bytes", "body", "size", "too_large", "method", "version",
                 "keep_alive", "t0", "chunked", "encoded", "refusal", "started", "timed_out")

    def __init__(self) -> None:
        self.url = b""
        self.headers: list[tuple[bytes, bytes]] = []
        self.index: dict[bytes, bytes] | None = None  # lower-cased name -> first value, once the head is read
        self.head_bytes = 0
        self.body: list[bytes] = []
        self.size = 0
        self.too_large: int | None = None  # the limit passed, with the declared size or -1
        self.method = b""
        self.version = "1.1"
        self.keep_alive = True
        self.t0 = 0.0
        self.chunked = False
        self.encoded = False  # a Content-Encoding header (aiohttp decodes compressed bodies)
        self.refusal: bytes | None = None  # a complete answer to send as it is (400, 431)
        self.started: _Started | None = None  # what FrontServer.begin did for it
        self.timed_out: float | None = None  # stopped arriving part-way: seconds waited (answered 408)


class _Started:
    """How far :meth:`FrontServer.begin` took a request from the parser's callback: its
    routed form (or the error answer to send), and, once routed, its lease and the
    connection it was sent on (``None``: the request's task connects). A request sent
    there is answered by callbacks alone (:meth:`FrontServer._settle`) unless its answer
    needs the task (:meth:`FrontServer._hand_over`); ``deadline`` (loop time) ends its
    wait for the answer's head meanwhile (:meth:`_Client.watch_headers`)."""

    __slots__ = ("inc", "prepared", "lease", "up", "router_s", "deadline")

    def __init__(self, inc: _Incoming, prepared: RoutedRequest | web.Response) -> None:
        self.inc = inc
        self.prepared = prepared
        self.lease: Any = None
        self.up: _Upstream | None = None
        self.router_s = 0.0  # the router's time on it until it was sent, seconds
        self.deadline = 0.0

    def drop(self) -> None:
        """Never handled (its client connection ended first): free what it holds."""
        if isinstance(self.prepared, RoutedRequest) and self.prepared.record.admission is not None:
            self.prepared.record.admission.release()  # its client's limits
        if self.lease is not None:
            self.lease.release()
            self.lease = None
        if self.up is not None:
            self.up.finish()  # the answer is not complete: the connection is aborted
            self.up = None


class _Client(asyncio.Protocol):
    """One client connection: requests parsed by ``httptools``, answered in order by
    one task at a time (:meth:`FrontServer.handle`)."""

    def __init__(self, front: FrontServer) -> None:
        self.front = front
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpRequestParser(self)
        self.cur: _Incoming | None = None
        self.queue: collections.deque[_Incoming] = collections.deque()
        self.task: asyncio.Task[None] | None = None
        self.wake: asyncio.Future[None] | None = None  # set while the task waits for a request
        self.busy = False  # a request is being answered
        self.detached: _Started | None = None  # the request being answered by callbacks alone
        self.closed = False
        self.discard = False  # a body over the limit: read no further, close after the answer
        self.lingering = False  # answered and half-closed: what the client still sends is dropped
        self.heard = 0.0  # loop time of the last input while lingering
        self.linger_until = 0.0
        self._linger: asyncio.TimerHandle | None = None
        self.upstream: _Upstream | None = None  # the exchange being relayed to this client
        self.waiting: asyncio.Future[None] | None = None  # what the task awaits for this client
        self.write_paused = False
        self.drained: asyncio.Future[None] | None = None  # set while the task waits for a slow client
        self.read_paused = False
        self.pending_continue = False
        self.upgrading: _Incoming | None = None  # a request with Upgrade, until llhttp stops
        self.raw_inc: _Incoming | None = None  # its body, read without the parser
        self.raw_needed = 0
        self.idle_since = 0.0
        self._idle: asyncio.TimerHandle | None = None
        # The response-headers timeout of the request answered by callbacks (detached):
        # one timer per connection, re-armed only when it fires.
        self._headers_timer: asyncio.TimerHandle | None = None
        self._send_timer: asyncio.TimerHandle | None = None  # --client-send-timeout, while writes are paused

    # -- asyncio.Protocol ---------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's are not asyncio.Transport
        self.front.clients.add(self)
        self._arm_idle()

    def data_received(self, data: bytes) -> None:
        if self.discard or self.closed:
            if self.lingering:
                self.heard = self.front.loop.time()
            return
        self.idle_since = self.front.loop.time()  # a request being sent is progress
        if self.raw_inc is not None:
            self._raw_body(data)
            return
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserCallbackError:
            raise  # our own bug: let asyncio log it
        except httptools.HttpParserUpgrade as exc:
            self._upgrade_ignored(data, exc)
        except httptools.HttpParserError as exc:
            self._bad_request(exc)

    def _upgrade_ignored(self, data: bytes, exc: httptools.HttpParserUpgrade) -> None:
        """A request with ``Upgrade`` (``h2c``, ``websocket``...): llhttp stops at its
        head; the upgrade is not taken (the answer is plain HTTP/1.1, as aiohttp's), its
        body (``Content-Length`` bytes) is read here, and parsing goes on after it."""
        inc, self.upgrading = self.upgrading, None
        if self.discard:
            return
        if inc is None or inc.chunked:
            self._bad_request(exc)
            return
        offset = exc.args[0] if exc.args and isinstance(exc.args[0], int) else len(data)
        self.parser = httptools.HttpRequestParser(self)
        self.raw_inc = inc
        self.raw_needed = next((int(v) for k, v in inc.headers if k.lower() == b"content-length"
                                and v.strip().isdigit()), 0)
        self._raw_body(data[offset:])

    def _raw_body(self, data: bytes) -> None:
        inc = self.raw_inc
        assert inc is not None
        take = data[: self.raw_needed]
        if take:
            inc.body.append(take)
            self.raw_needed -= len(take)
        if self.raw_needed > 0:
            return
        self.raw_inc = None
        self.cur = inc
        self.on_message_complete()
        rest = data[len(take):]
        if rest:
            self.data_received(rest)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.front.clients.discard(self)
        if self._idle is not None:
            self._idle.cancel()
        if self._linger is not None:
            self._linger.cancel()
            self._linger = None
        if self._headers_timer is not None:
            self._headers_timer.cancel()
            self._headers_timer = None
        if self._send_timer is not None:
            self._send_timer.cancel()
            self._send_timer = None
        if self.waiting is not None and not self.waiting.done():
            self.waiting.set_exception(_ClientGone())
        if self.wake is not None and not self.wake.done():
            self.wake.set_result(None)
        if self.drained is not None and not self.drained.done():
            self.drained.set_result(None)
        if self.upstream is not None:
            self.upstream.resume()
        if self.detached is not None:  # the task accounts for it (499) and frees it
            self.front.hand_over(self, self.detached)

    def pause_writing(self) -> None:
        self.write_paused = True
        if self.upstream is not None:
            self.upstream.pause()
        if self._send_timer is None:
            self._send_timer = self.front.loop.call_later(self.front.state.settings.client_send_timeout_s,
                                                          self._send_timed_out)

    def _send_timed_out(self) -> None:
        """The client left what was written to it unread for ``--client-send-timeout``:
        disconnected (:meth:`connection_lost` then aborts the instance's request and
        frees its slot, as for a client that left)."""
        self._send_timer = None
        if self.write_paused and not self.closed:
            log.info("a client left an answer unread for %g s (--client-send-timeout): disconnected",
                     self.front.state.settings.client_send_timeout_s)
            self.abort()

    def resume_writing(self) -> None:
        self.write_paused = False
        if self._send_timer is not None:
            self._send_timer.cancel()
            self._send_timer = None
        if self.drained is not None and not self.drained.done():
            self.drained.set_result(None)
        if self.upstream is not None:
            self.upstream.resume()

    # -- httptools callbacks ------------------------------------------------------

    def on_message_begin(self) -> None:
        self.cur = _Incoming()
        self.cur.t0 = time.perf_counter()

    def on_url(self, url: bytes) -> None:
        cur = self.cur
        if cur is None or self.discard:
            return
        cur.url += url
        cur.head_bytes += len(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        cur = self.cur
        if cur is None or self.discard or cur.index is not None:
            return  # (a chunked body's trailer fields, after the head: neither used nor relayed, as aiohttp)
        cur.headers.append((name, value))
        cur.head_bytes += len(name) + len(value) + 4
        if len(name) + len(value) + 2 > MAX_FIELD_BYTES:
            self._refuse(431, b"Request Header Fields Too Large", f"a header line is over {MAX_FIELD_BYTES:,} bytes")
        elif len(cur.headers) > MAX_HEADERS:
            self._refuse(431, b"Request Header Fields Too Large", f"more than {MAX_HEADERS} header fields")
        elif cur.head_bytes > MAX_HEAD_BYTES:
            self._refuse(431, b"Request Header Fields Too Large",
                         f"request line and headers over {MAX_HEAD_BYTES:,} bytes")

    def on_headers_complete(self) -> None:
        cur = self.cur
        if cur is None or self.discard:
            return
        if cur.head_bytes > MAX_HEAD_BYTES:
            self._refuse(431, b"Request Header Fields Too Large",
                         f"request line and headers over {MAX_HEAD_BYTES:,} bytes")
            return
        p = self.parser
        cur.method = p.get_method()
        cur.version = p.get_http_version()
        cur.keep_alive = p.should_keep_alive()
        limit = self.front.state.settings.max_body_bytes
        declared = None
        expect = False
        index: dict[bytes, bytes] = {}
        for k, v in cur.headers:
            low = k.lower()
            if low not in index:
                index[low] = v
            elif low in SINGLETON_FIELDS:
                self._refuse(400, b"Bad Request", f"bad request: Duplicate '{SINGLETON_FIELDS[low]}' header found.")
                return
            if low == b"content-length":
                try:
                    declared = int(v)
                except ValueError:
                    pass
            elif low == b"transfer-encoding":
                cur.chunked = True
            elif low == b"content-encoding":
                cur.encoded = True
            elif low == b"expect" and v.lower() == b"100-continue" and cur.version == "1.1":
                expect = True
        cur.index = index
        if declared is not None and declared > limit:
            cur.too_large = declared
            self._enqueue_now()
        elif expect:
            refused = self.front.refused_by_head(cur)
            if refused is not None:  # its final answer instead of 100 Continue: the body is not read
                cur.started = _Started(cur, refused)
                self._enqueue_now()
            elif self.busy or self.queue:
                self.pending_continue = True  # sent once the answers before it are out
            else:
                self.write(_CONTINUE)

    def on_body(self, body: bytes) -> None:
        cur = self.cur
        if cur is None or cur.too_large is not None:
            return
        cur.size += len(body)
        if cur.size > self.front.state.settings.max_body_bytes:
            cur.too_large = -1
            cur.body = []
            self._enqueue_now()
            return
        cur.body.append(body)

    def on_message_complete(self) -> None:
        cur = self.cur
        if cur is None or cur.too_large is not None or self.discard:
            return
        self.cur = None
        self.pending_continue = False  # its body is all here: no 100 Continue is owed any more
        if self.front.closing and not self.busy and not self.queue:
            self.close()  # shutting down: a request that arrives now is not routed
            return
        if self.raw_inc is None and self.parser.should_upgrade():
            self.upgrading = cur  # its body (if any) comes after the upgrade point
            return
        if self.busy and self.front.upstreams.due:
            # The previous answer may be written, its bookkeeping waiting for the next
            # loop turn, which under load comes after this read: done now, so that this
            # request starts here too instead of waking the task.
            self.front.upstreams.run_due()
            if self.transport is None or self.transport.is_closing():
                return  # that answer was the last (the router is shutting down): this one is not sent
        if not self.busy and not self.queue and not self.closed and not self.write_paused:
            # Nothing else to answer on this connection: the request's critical path
            # (routing, the send) runs here, now; if it was sent, callbacks answer it
            # and the task is not woken at all (FrontServer.begin).
            try:
                if self.front.begin(self, cur):
                    return
            except Exception:  # our bug: the task handles the request from the start
                log.exception("starting a request from the parser's callback failed")
                if cur.started is not None:
                    if self.detached is cur.started:
                        self.detached, self.busy = None, False
                    cur.started.drop()
                    cur.started = None
        self.queue.append(cur)
        if len(self.queue) > 1 and self.transport is not None and not self.read_paused:
            self.read_paused = True
            self.transport.pause_reading()  # pipelined: read on once the queue drains
        self._start()

    # -- internals ----------------------------------------------------------------

    def _enqueue_now(self) -> None:
        """Answer ``self.cur`` (over a limit) without reading the rest: no more input is
        parsed and the connection closes after the answer."""
        cur = self.cur
        assert cur is not None
        cur.keep_alive = False
        self.discard = True
        self.cur = None
        self.queue.append(cur)
        self._start()

    def _start(self) -> None:
        if self.detached is not None:
            return  # the queue waits for the answer being written by callbacks
        if self.wake is not None:
            if not self.wake.done():
                self.wake.set_result(None)
        elif self.task is None:
            self.task = self.front.loop.create_task(self._serve())
            self.front.tasks.add(self.task)

    async def _serve(self) -> None:
        """Answer queued requests in order; then wait for the next one (one task for
        the connection's life, no task per request)."""
        loop = self.front.loop
        try:
            # A request handed over by callbacks is answered (accounted for, freed) even
            # once the client has gone.
            while not self.closed or (self.queue and self.queue[0].started is not None):
                if not self.queue:
                    if self.read_paused and self.transport is not None:
                        self.read_paused = False
                        self.transport.resume_reading()
                    self._arm_idle()
                    self.wake = loop.create_future()
                    try:
                        await self.wake
                    finally:
                        self.wake = None
                    continue
                if self.write_paused and not self.closed and self.queue[0].started is None:
                    # A client that does not read its answers gets no more of them
                    # (pipelined requests wait, and reading stays paused behind them);
                    # one already routed (it holds a lease) is answered.
                    self.drained = loop.create_future()
                    try:
                        await self.drained
                    finally:
                        self.drained = None
                    continue
                inc = self.queue.popleft()
                self.busy = True
                try:
                    if inc.refusal is not None:
                        self.write(inc.refusal)
                    else:
                        await self.front.handle(self, inc)
                finally:
                    self.busy = False
                if not self.answered(inc):
                    break
        finally:
            for inc in self.queue:
                if inc.started is not None:
                    inc.started.drop()
            self.front.tasks.discard(self.task)  # type: ignore[arg-type]
            self.task = None

    def answered(self, inc: _Incoming) -> bool:
        """After the answer to ``inc``: close if it was the last one, else send a
        ``100 Continue`` owed to the next request. False if the connection is closing."""
        if not inc.keep_alive or self.front.closing:
            if inc.keep_alive and self.queue and not self.closed:
                # Shutting down, requests read whole are queued behind this answer
                # (pipelined): each is answered, not routed (FrontServer.handle), the
                # last with Connection: close.
                return True
            if self.front.closing and self.read_paused:
                # Input left unread (pipelined past the queue): closing on it would make
                # the kernel reset the connection and drop the answers not yet delivered.
                self.discard = True
            self.linger_close() if self.discard else self.close()
            return False
        if self.pending_continue and not self.queue:
            self.pending_continue = False
            self.write(_CONTINUE)
        return True

    def _arm_idle(self) -> None:
        """The connection is idle from now: closed after ``client_keepalive_s`` without
        a request, or without a byte of one that stopped part-way (answered 408 then; one
        timer per connection, re-armed only when it fires)."""
        loop = self.front.loop
        self.idle_since = loop.time()
        if self._idle is None and not self.closed:
            self._idle = loop.call_at(self.idle_since + self.front.client_keepalive_s, self._idle_timeout)

    def watch_headers(self, deadline: float) -> None:
        """The detached request's answer head is due by ``deadline`` (loop time): the
        connection's timer is armed for it unless armed already, for an earlier request
        (one timer per connection instead of one per request; a request answered before
        the timer fires costs none). Deadlines on a connection never decrease (the
        timeout is a process setting), so an armed timer is never due too late: when it
        fires it times out the request then detached if its own deadline has passed,
        else re-arms for it."""
        if self._headers_timer is None:
            self._headers_timer = self.front.loop.call_at(deadline, self._headers_check)

    def _headers_check(self) -> None:
        self._headers_timer = None
        started = self.detached
        if started is None or self.closed:
            return
        if started.deadline <= self.front.loop.time() + 0.001:  # (uvloop's timers have 1 ms steps)
            self.front.headers_late(self, started)
        else:  # an earlier request's deadline: this one is due later
            self.watch_headers(started.deadline)

    def _idle_timeout(self) -> None:
        self._idle = None
        if self.closed or self.lingering:  # (a lingering connection closes on its own terms)
            return
        loop = self.front.loop
        due = self.idle_since + self.front.client_keepalive_s
        if self.busy or self.queue:
            due = loop.time() + self.front.client_keepalive_s
        elif loop.time() >= due:
            inc = self.cur if self.cur is not None else self.raw_inc
            if inc is not None and not self.discard:  # a request stopped arriving part-way: 408
                if inc.index is None:  # its head cut short: nothing to route it by
                    self._refuse(408, b"Request Timeout", str(BodyTimedOut(self.front.client_keepalive_s)))
                else:  # answered in the API's shape, counted, as a body over the limit is
                    inc.timed_out = self.front.client_keepalive_s
                    self.raw_inc, self.cur = None, inc
                    self._enqueue_now()
                return
            self.close()
            return
        self._idle = loop.call_at(due, self._idle_timeout)

    def _bad_request(self, exc: Exception) -> None:
        """400 naming what llhttp found wrong ("Invalid character in Content-Length",
        "Duplicate Content-Length"...: its fixed reasons, which never quote the request),
        else the error's class."""
        reason = exc.args[0] if exc.args else None
        if not (isinstance(reason, str) and 0 < len(reason) <= 120 and reason.isascii() and reason.isprintable()):
            reason = type(exc).__name__
        self._refuse(400, b"Bad Request", f"bad request: {reason}")

    def _refuse(self, status: int, reason: bytes, message: str) -> None:
        """Answer ``status`` after the answers already due, then read no more and close
        (lingering, :meth:`linger_close`)."""
        if self.discard:
            return
        body = orjson.dumps({"message": message})
        t0 = self.cur.t0 if self.cur is not None else time.perf_counter()
        self.front.state.observers.refused("unknown", "", status, message, None, t0, time.perf_counter(),
                                           len(body))
        inc = _Incoming()
        inc.keep_alive = False
        inc.refusal = _head(status, reason, [(b"Content-Type", b"application/json")],
                            b"Content-Length: %d\r\n" % len(body), False) + body
        self.discard = True
        self.cur = None
        self.queue.append(inc)
        self._start()

    def linger_close(self) -> None:
        """Close after an answer to a request not read in full: half-close (our FIN
        follows the answer), drop what the client still sends, close once it has sent
        nothing for :data:`LINGER_S` (at most :data:`LINGER_MAX_S` after this) or when
        it closes."""
        transport = self.transport
        if transport is None or transport.is_closing():
            return
        if self.read_paused:
            self.read_paused = False
            transport.resume_reading()
        if transport.can_write_eof():
            transport.write_eof()
            self.lingering = True
            loop = self.front.loop
            self.heard = now = loop.time()
            self.linger_until = now + LINGER_MAX_S
            self._linger = loop.call_later(LINGER_S, self._linger_check)
        else:
            transport.close()

    def _linger_check(self) -> None:
        self._linger = None
        transport = self.transport
        if transport is None or transport.is_closing():
            return
        loop = self.front.loop
        due = min(self.heard + LINGER_S, self.linger_until)
        if loop.time() >= due:
            transport.close()
        else:
            self._linger = loop.call_later(due - loop.time(), self._linger_check)

    def write(self, data: bytes) -> None:
        if self.transport is not None and not self.closed:
            self.transport.write(data)

    def write_response(self, status: int, reason: bytes, headers: H.RawHeaders, body: bytes,
                       keep_alive: bool) -> None:
        self.write(_head(status, reason, headers, b"Content-Length: %d\r\n" % len(body), keep_alive) + body)

    def close(self) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.close()

    def abort(self) -> None:
        if self.transport is not None:
            self.transport.abort()


class FrontServer:
    """The public listener: inference routes relayed here, the rest by the aiohttp app.

    Args:
        state: the router's state (shared with the aiohttp app).
        internal_socket: path of the Unix socket the aiohttp app listens on.
    """

    def __init__(self, state: RouterState, internal_socket: str) -> None:
        self.state = state
        self.internal = ("aiohttp", None, internal_socket)
        self.loop = asyncio.get_running_loop()
        s = state.settings
        self.upstreams = _UpstreamPool(self.loop, s.max_connections, s.keepalive_timeout_s)
        self.internal_pool = _UpstreamPool(self.loop, 1 << 16, 60.0)
        self.clients: set[_Client] = set()
        self.tasks: set[asyncio.Task[None]] = set()
        self.closing = False
        self.hurried = False  # close(): stop waiting for the requests in flight (hurry())
        self.client_keepalive_s = s.client_keepalive_timeout_s
        self.server: asyncio.AbstractServer | None = None
        self._targets: dict[str, tuple[Any, ...] | None] = {}
        self._plain: tuple[int, bool] = (0, False)
        # Answers written whole whose metrics are not recorded yet (account()).
        self._unaccounted: list[tuple[RoutedRequest, Any, int, _Reply, float]] = []
        self._accounting: asyncio.TimerHandle | None = None
        state.metrics.pending.append(self.account)

    async def start(self, host: str, port: int, reuse_port: bool) -> int:
        """Listen; returns the port bound."""
        self.server = await self.loop.create_server(lambda: _Client(self), host, port, reuse_port=reuse_port or None,
                                                    backlog=4096)
        return int(self.server.sockets[0].getsockname()[1])

    def stop_listening(self) -> None:
        """Refuse new connections and new requests from now on (:meth:`close` begins
        so; callable before it, at once)."""
        self.closing = True
        if self.server is not None:
            self.server.close()

    async def close(self, timeout_s: float) -> None:
        """Stop listening, close idle client connections, let requests being answered
        finish (at most ``timeout_s``), then close everything."""
        self.stop_listening()
        deadline = self.loop.time() + timeout_s
        while True:
            for c in list(self.clients):
                if not c.busy and not c.queue and not c.lingering:
                    c.close()  # idle, or a request still arriving (a busy one closes after its answer)
            # Waited for: answers being written, queued requests' answers (each a 503) to
            # a client that reads them, and lingering closes (at most LINGER_MAX_S).
            if self.hurried or self.loop.time() >= deadline or \
                    not any(c.busy or c.lingering or (c.queue and not c.write_paused) for c in self.clients):
                break
            await asyncio.sleep(0.05)
        cut = sum(1 for c in self.clients if c.busy)
        if cut and not self.hurried:  # (a second stop signal says so itself)
            log.warning("shutting down: %d request%s still being answered after %g s (--shutdown-timeout): "
                        "cut, their connections closed", cut, "" if cut == 1 else "s", timeout_s)
        for t in list(self.tasks):
            t.cancel()
        if self.tasks:
            await asyncio.wait(list(self.tasks), timeout=1.0)
        for c in list(self.clients):
            c.abort()
        self.upstreams.close()
        self.internal_pool.close()
        if self._accounting is not None:
            self._accounting.cancel()
            self._accounting = None
        self.account()
        with contextlib.suppress(ValueError):
            self.state.metrics.pending.remove(self.account)
        if self.server is not None:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.server.wait_closed(), 1.0)

    def hurry(self) -> None:
        """Make :meth:`close` stop waiting for the requests in flight (a second stop
        signal): they end as at its deadline (cancelled, their connections closed)."""
        self.hurried = True

    # -- per request --------------------------------------------------------------

    def _all_plain_http(self) -> bool:
        """True if every instance is ``http://`` (``https://`` ones go through aiohttp)."""
        config = self.state.fleet.config
        if self._plain[0] != id(config):
            plain = all(url.startswith("http://") for e in config.endpoints for v in e.variants
                        for url in v.instances)
            self._plain = (id(config), plain)
        return self._plain[1]

    def _target(self, instance: str) -> tuple[Any, ...]:
        """``(instance, host, port, path prefix bytes, Host header bytes)`` of an http:// URL."""
        t = self._targets.get(instance)
        if t is None:
            from urllib.parse import urlsplit
            u = urlsplit(instance)
            host = u.hostname or "127.0.0.1"
            port = u.port or 80
            t = (instance, host, port, u.path.rstrip("/").encode(), u.netloc.encode())
            if len(self._targets) > 65536:
                self._targets.clear()
            self._targets[instance] = t
        return t

    def _route(self, inc: _Incoming) -> tuple[str, RouteMatch | None]:
        """``(path, route)``: the request's path and its inference route, or ``None``
        if the aiohttp app answers it (see the module's diagram)."""
        path = inc.url.decode("latin-1").split("?", 1)[0]
        if inc.method != b"POST" or inc.version != "1.1":
            return path, None
        route = match_route(path)
        return path, route if route is not None and self._all_plain_http() else None

    def _cut(self, inc: _Incoming) -> BodyTooLarge | BodyTimedOut | None:
        """Why ``inc`` is answered before its body was read in full (over
        ``--max-body-size``, or it stopped arriving), if it is."""
        if inc.timed_out is not None:
            return BodyTimedOut(inc.timed_out)
        if inc.too_large is not None:
            return BodyTooLarge(self.state.settings.max_body_bytes, inc.too_large if inc.too_large >= 0 else None)
        return None

    def _prepare(self, inc: _Incoming, route: RouteMatch) -> RoutedRequest | web.Response:
        """:func:`~prefixroute.server.app.prepare_inference` for a request read here."""
        headers = H.RawHeaderView(inc.headers, inc.index)
        body: bytes | BodyTooLarge | BodyNotDecoded | BodyTimedOut | None
        if inc.too_large is not None or inc.timed_out is not None:
            body = self._cut(inc)  # answered 413 or 408 by prepare_inference
        elif inc.chunked and transfer_refused(headers):
            body = None  # (gzip, chunked...): the checks before the body answer 501
        else:
            body = inc.body[0] if len(inc.body) == 1 else b"".join(inc.body)
            if inc.encoded:
                coding = request_coding(headers)
                if coding in ("gzip", "deflate"):
                    body = decode_request_body(body, coding, self.state.settings.max_body_bytes)
                elif coding != "identity":  # decoded by nobody: the checks before the body answer 415
                    body = None
        query = inc.url.decode("latin-1").partition("?")[2]
        return prepare_inference(self.state, route, headers, inc.headers, body, request_id(headers), inc.t0,
                                 query=query)

    def refused_by_head(self, inc: _Incoming) -> web.Response | None:
        """The answer to an inference request that its head alone refuses (unknown
        endpoint, variant or inference component, a Content-Encoding or
        Transfer-Encoding not decoded, an invalid tenant id: what
        :func:`prepare_inference` checks before the body), or ``None``. Asked for a
        request with ``Expect: 100-continue``: RFC 9110 §10.1.1 lets the final status
        go instead of ``100 Continue``, and the client need not send the body. The
        refusal is counted as the answer it is."""
        route = match_route(inc.url.decode("latin-1").split("?", 1)[0]) if inc.method == b"POST" else None
        if route is None:
            return None  # not for inference: the aiohttp app answers it
        headers = H.RawHeaderView(inc.headers, inc.index)
        checked = prepare_inference(self.state, route, headers, inc.headers, None, request_id(headers), inc.t0)
        return None if isinstance(checked, RoutedRequest) else checked

    def begin(self, client: _Client, inc: _Incoming) -> bool:
        """A request's critical path, run from the client parser's callback when its
        connection has nothing else to answer (the usual case): route it, claim its
        instance and, over an idle pooled connection, send it.

        Returns True if it was sent: callbacks then answer it without the connection's
        task (an answer that comes whole is written by :meth:`_whole`, then
        :meth:`_settle` does the bookkeeping), unless its answer needs the task (a
        stream, an error, a timeout, the client gone: :meth:`hand_over`). False: the
        task answers it, from where this left it (:attr:`_Incoming.started`: routed, or
        the error answer to send; maybe its lease, when a new connection is needed)."""
        if inc.too_large is not None or inc.refusal is not None or inc.timed_out is not None:
            return False
        _, route = self._route(inc)
        if route is None:
            return False
        rr = self._prepare(inc, route)
        started = inc.started = _Started(inc, rr)
        if not isinstance(rr, RoutedRequest):
            return False  # the task sends the error answer
        pool = rr.pool
        try:
            lease = started.lease = rr.lease = acquire(self.state, rr)
        except (NoHealthyInstance, SetSaturated):
            return False  # the task answers 503 or 429 (or loads the adapter first)
        rr.record.decision = lease.decision
        target = self._target(lease.decision.instance.instance_id)
        up = started.up = self.upstreams.take(target[:3])
        if up is None and self.upstreams.due:  # the connection of an answer written this loop turn, maybe
            self.upstreams.run_due()
            up = started.up = self.upstreams.take(target[:3])
        if up is None:
            if rr.blocks:
                self.loop.call_soon(pool.learn, lease.decision.instance, rr.blocks)
            return False
        rr.record.t_sent = t_send = time.perf_counter()
        started.router_s = t_send - rr.t0
        self._send(client, up, rr, target, self._head_tail(rr), lease.decision, started.router_s, inc.keep_alive)
        client.busy = True
        client.detached = started
        up.watcher = functools.partial(self._detached_event, client, started)
        if up.done.done() or up.headers_fut.done():  # (failed during the send)
            up._notify()
        started.deadline = deadline = self.loop.time() + self.state.settings.response_headers_timeout_s
        client.watch_headers(deadline)
        if rr.blocks:  # the request is on its way: CACHE_AWARE learns where it went
            try:
                pool.learn(lease.decision.instance, rr.blocks)
            except Exception:  # our bug: the request goes on; its blocks are not learnt
                log.exception("learning where a request went failed")
        return True

    def account(self) -> None:
        """Record the metrics of the answers :meth:`_settle` left unaccounted: run by a
        timer :data:`ACCOUNTING_DELAY_S` after the first of them, by
        :meth:`RouterMetrics.render` and by :meth:`close`."""
        done, self._unaccounted = self._unaccounted, []
        for record in done:
            self._account_one(*record)

    def _account_one(self, rr: RoutedRequest, decision: Any, status: int, reply: _Reply, t_end: float) -> None:
        self._answered_metrics(rr, status, decision)
        self._account_whole(rr, reply, decision.instance.instance_id)
        self._released(rr, decision)
        self._count(rr, reply.status, t_end)

    def _account_timer(self) -> None:
        self._accounting = None
        self.account()

    def _detached_event(self, client: _Client, started: _Started) -> None:
        """The answer's head came, or the exchange ended, while callbacks answer the
        request: settle it if written whole, else hand it to the task."""
        if client.detached is not started:
            return  # settled or handed over already
        up = started.up
        assert up is not None
        if up.reply is not None and up.done.done() and up.error is None:
            self._settle(client, started)
        else:  # a stream, a failure, a 504 due, a ModelError, the client gone
            self.hand_over(client, started)

    def headers_late(self, client: _Client, started: _Started) -> None:
        """No answer head within the response-headers timeout: the task answers 504 (an
        answer arriving before it runs is not written: the client gets one answer)."""
        up = started.up
        if client.detached is started and up is not None and not up.headers_fut.done():
            up.on_whole = None
            _expire(up.headers_fut)  # what the task's wait then raises
            up.watcher = None
            self.hand_over(client, started)

    def hand_over(self, client: _Client, started: _Started) -> None:
        """The connection's task takes over a request answered by callbacks until now
        (:meth:`_forward` from where :meth:`begin` left it: it waits for the answer's
        head, relays the rest, retries, times out, and accounts for it as ever)."""
        client.detached = None
        client.busy = False
        if started.up is not None:
            started.up.watcher = None
        if client.closed and self.closing:
            started.drop()  # shutting down: no new task
            return
        client.queue.appendleft(started.inc)
        client._start()

    def _settle(self, client: _Client, started: _Started) -> None:
        """The bookkeeping of a request whose answer :meth:`_whole` wrote (what
        :meth:`_forward` and :meth:`_relay` do for it), then the connection's next request."""
        client.detached = None
        client.busy = False
        rr, lease, up = started.prepared, started.lease, started.up
        assert isinstance(rr, RoutedRequest) and up is not None and up.reply is not None
        started.lease = started.up = None
        decision = lease.decision
        self.state.health.passive_success(decision.instance.instance_id)
        lease.release()
        # Its metrics wait a moment (account()): recorded now, they would delay the
        # connection's next request, which is usually on its way already, and recorded
        # right after that request's send they would still hold up its instance's reply
        # (the instance shares the cores).
        # (With --workers, at once: a scrape is answered by one worker, which cannot
        # record the others' pending metrics.)
        if self.state.metrics.multiprocess:
            self._account_one(rr, decision, up.status, up.reply, time.perf_counter())  # type: ignore[arg-type]
        else:
            if self._accounting is None:
                self._accounting = self.loop.call_later(ACCOUNTING_DELAY_S, self._account_timer)
            self._unaccounted.append((rr, decision, up.status, up.reply, time.perf_counter()))
        up.finish()
        inc = started.inc
        inc.started = None
        if client.closed or not client.answered(inc):
            return
        if client.queue:
            client._start()
            return
        if client.read_paused and client.transport is not None:
            client.read_paused = False
            client.transport.resume_reading()
        client._arm_idle()

    async def handle(self, client: _Client, inc: _Incoming) -> None:
        """Answer one request (never raises but for cancellation)."""
        started, inc.started = inc.started, None
        if started is not None:  # routed by begin(), perhaps sent
            rr = started.prepared
            if isinstance(rr, RoutedRequest):
                await self._forward(client, rr, inc.keep_alive, started)
            else:
                client.write(_serialize(rr, inc.keep_alive))
            return
        path, route = self._route(inc)
        if self.closing and self._cut(inc) is None:
            self._turn_away(client, inc, path)
            return
        if route is None:
            cut = self._cut(inc)
            inference = match_route(path) if cut is not None and inc.method == b"POST" else None
            if inference is not None:  # (HTTP/1.0, https instances): counted as the aiohttp app counts it
                client.write(_serialize(self._prepare(inc, inference), keep_alive=False))
                return
            if cut is not None:
                status, code = (408, "request_timeout") if isinstance(cut, BodyTimedOut) else \
                    (413, "request_too_large")
                resp = error_for_path(path, status, str(cut), code,
                                      headers={H.REQUEST_ID: request_id(H.RawHeaderView(inc.headers, inc.index))})
                client.write(_serialize(count_answer(self.state, "unknown", "", resp, inc.t0), keep_alive=False))
                return
            await self._delegate(client, inc)
            return
        rr = self._prepare(inc, route)
        if not isinstance(rr, RoutedRequest):
            client.write(_serialize(rr, inc.keep_alive))
            return
        await self._forward(client, rr, inc.keep_alive)

    def _turn_away(self, client: _Client, inc: _Incoming, path: str) -> None:
        """Shutting down: ``inc``, read whole before and queued behind another answer on
        its connection (pipelined), is not routed. It gets a 503 in its API's shape
        (:func:`shutting_down_error`; counted as its endpoint's and variant's, as the
        router's other answers are), or the answer its head alone calls for (an unknown
        endpoint...); ``Connection: close`` when it is the last one queued."""
        keep = inc.keep_alive and bool(client.queue)
        inference = match_route(path) if inc.method == b"POST" else None
        if inference is None:
            resp = shutting_down_error(path)
        else:
            headers = H.RawHeaderView(inc.headers, inc.index)
            rid = request_id(headers)
            checked = prepare_inference(self.state, inference, headers, inc.headers, None, rid, inc.t0)
            if isinstance(checked, RoutedRequest):
                variant = checked.pool.name
                resp = count_answer(self.state, checked.endpoint, variant,
                                    shutting_down_error(path, our_headers(checked)), inc.t0)
            else:
                resp = checked  # (counted)
        inc.keep_alive = keep
        client.write(_serialize(resp, keep))

    async def _connect(self, client: _Client, target: tuple[Any, ...]) -> _Upstream:
        """A new connection to ``target`` for ``client``'s request, given up when the
        client leaves first (:class:`_ClientGone`: its slot is freed at once and nothing
        is retried for it; a connection that opens after that goes to the pool).

        Raises:
            OSError, TimeoutError: as :meth:`_UpstreamPool.connect`.
        """
        task = self.loop.create_task(self.upstreams.connect(target, self.state.settings.connect_timeout_s))
        done: asyncio.Future[None] = self.loop.create_future()
        task.add_done_callback(lambda _t: done.done() or done.set_result(None))
        try:
            await self._await(client, done, None)
        except BaseException:  # the client gone (or this task cancelled)
            if task.done():
                self._pool_opened(task)
            else:
                task.cancel()
                task.add_done_callback(self._pool_opened)
            raise
        return task.result()

    def _pool_opened(self, task: asyncio.Task[_Upstream]) -> None:
        """A connection opened for a client that left: kept for the next request."""
        if task.cancelled() or task.exception() is not None:
            return
        self.upstreams.put(task.result())

    async def _await(self, client: _Client, fut: asyncio.Future[None], timeout_s: float | None) -> None:
        """Wait for ``fut``; raises what it holds, :class:`_ClientGone` if the client
        leaves first, ``TimeoutError`` after ``timeout_s`` (``None``: no limit). One
        timer handle, no task, no ``asyncio.wait``."""
        if fut.done():
            fut.result()
            return
        if client.closed:
            raise _ClientGone()
        client.waiting = fut
        handle = self.loop.call_later(timeout_s, _expire, fut) if timeout_s is not None else None
        try:
            await fut
        finally:
            client.waiting = None
            if handle is not None:
                handle.cancel()

    def _head_tail(self, rr: RoutedRequest) -> bytes:
        """The upstream request head after its ``Host`` line: the headers relayed, ours,
        ``Content-Length`` and the blank line."""
        if rr.api is Api.OPENAI:
            lines = H.openai_upstream_lines(rr.raw_headers, rr.request_id, self.state.settings.admin_token,
                                            rr.decoded) + rr.record.trace_context(rr.headers).upstream_lines()
        else:
            lines = H.header_lines(upstream_headers(self.state, rr))
        return lines + b"Content-Length: %d\r\n\r\n" % len(rr.body)

    def _send(self, client: _Client, up: _Upstream, rr: RoutedRequest, target: tuple[Any, ...], head_tail: bytes,
              decision: Any, router_s: float, keep_alive: bool) -> None:
        """Send ``rr`` on ``up``; a whole answer is then written to the client as it
        arrives (:meth:`_whole`)."""
        up.send(b"POST %s%s HTTP/1.1\r\nHost: %s\r\n" % (target[3], rr.upstream_path.encode(), target[4])
                + head_tail, rr.body)
        # The instance is at work: what follows until its answer is off the critical path.
        up.on_whole = functools.partial(self._whole, client, rr, _our_lines(rr, decision), router_s,
                                        keep_alive)

    async def _forward(self, client: _Client, rr: RoutedRequest, keep_alive: bool,
                       started: _Started | None = None) -> None:
        """:func:`prefixroute.server.proxy.forward` on raw protocols, from the start or
        from where :meth:`begin` left the request (``started``: its lease, maybe the
        connection it was sent on)."""
        state = self.state
        m = state.metrics
        settings = state.settings
        pool = rr.pool
        variant = pool.name
        base_headers = our_headers(rr)
        head_tail = b""
        exclude: set[str] = set()
        router_s = 0.0
        mark = rr.t0
        code: int | str = 0
        retry: str | None = None
        lease = started.lease if started is not None else None
        up: _Upstream | None = started.up if started is not None else None
        if up is not None:
            router_s = started.router_s  # type: ignore[union-attr]
        record = rr.record
        pending: Lease | None = None  # the next attempt's, claimed before a 429/503 was given up
        fresh = False  # the next attempt opens a new connection (a kept-alive one failed)
        try:
            for _attempt in range(1 + settings.max_retries):
                if lease is None:
                    try:
                        if pending is not None:
                            lease, pending = pending, None
                            rr.lease = lease
                        else:
                            lease = rr.lease = await acquire_or_grow(state, rr, exclude)
                    except NoHealthyInstance as exc:
                        code = 503
                        record.error = "upstream_unavailable" if exclude else "no_healthy_instance"
                        client.write(_serialize(no_instance_error(rr, exc, exclude, base_headers), keep_alive))
                        return
                    except SetSaturated as exc:
                        code = 429
                        record.error = "sticky_set_saturated"
                        client.write(_serialize(saturated_error(state, rr, str(exc), base_headers), keep_alive))
                        return
                    pool = rr.pool
                    if rr.blocks:
                        self.loop.call_soon(pool.learn, lease.decision.instance, rr.blocks)
                if retry is not None:
                    m.retries.labels(rr.endpoint, variant, retry).inc()
                    record.retries += 1
                try:
                    decision = record.decision = lease.decision
                    instance = decision.instance.instance_id
                    if up is None:
                        target = self._target(instance)
                        t_send = record.t_sent = time.perf_counter()
                        router_s += t_send - mark
                        try:
                            up = (None if fresh else self.upstreams.take(target[:3])) or \
                                await self._connect(client, target[:3])
                        except (OSError, TimeoutError) as exc:
                            mark = time.perf_counter()
                            retry = record.error = "connect"
                            connect_failed(state, instance, exc, exclude)
                            continue
                        head_tail = head_tail or self._head_tail(rr)
                        self._send(client, up, rr, target, head_tail, decision, router_s, keep_alive)
                    try:
                        await self._await(client, up.headers_fut, settings.response_headers_timeout_s)
                    except TimeoutError:
                        record.error = "headers_timeout"
                        m.upstream_errors.labels(instance, "headers_timeout").inc()
                        count_routed(state, rr, decision)
                        state.health.passive_failure(instance)
                        code = 504 if rr.api is Api.OPENAI else 424
                        self._error(client, rr, 504, f"instance {instance} timed out: no response headers within "
                                    f"{settings.response_headers_timeout_s:g} s", "upstream_timeout",
                                    {**base_headers, H.INSTANCE: instance}, keep_alive)
                        return
                    except _UpstreamLost as lost:
                        kind = record.error = _error_kind(lost.exc)
                        if up.reused and not fresh and _attempt < settings.max_retries:
                            # A kept-alive connection failed before any byte of an answer: the
                            # instance most likely closed it idle as the request went out.
                            # Once, on a new connection (not a health failure).
                            fresh = True
                            mark = time.perf_counter()
                            m.upstream_errors.labels(instance, "stale_connection").inc()
                            retry = record.error = "stale_connection"
                            log.info("instance %s: a kept-alive connection failed before any answer (%s): the "
                                     "request is sent again on a new connection", instance, kind)
                            continue
                        state.health.passive_failure(instance)
                        if not lost.sent:
                            mark = time.perf_counter()
                            m.upstream_errors.labels(instance, "send").inc()
                            retry = record.error = "send"
                            log.warning("instance %s: connection lost while sending the request (%s)", instance,
                                        kind)
                            exclude.add(instance)
                            continue
                        m.upstream_errors.labels(instance, kind).inc()
                        count_routed(state, rr, decision)
                        log.warning("instance %s: failed before responding (%s)", instance, kind)
                        code = 502 if rr.api is Api.OPENAI else 424
                        self._error(client, rr, 502, f"instance {instance} failed before responding ({kind})",
                                    "upstream_error", {**base_headers, H.INSTANCE: instance}, keep_alive)
                        return
                    if state.retry_status.retries(up.status, settings.max_retries - _attempt):
                        pending = await retry_elsewhere(state, rr, instance, up.status,
                                                        _field(up.resp_headers, b"retry-after"), exclude)
                        if pending is not None:
                            mark = time.perf_counter()
                            retry = record.error = f"http_{up.status}"
                            continue  # (finish() below closes the connection if the answer is not all in)
                    self._answered(rr, up, decision)
                    code = await self._relay(client, rr, up, decision, router_s, keep_alive)
                    return
                finally:
                    lease.release()
                    self._released(rr, lease.decision)
                    lease = None
                    if up is not None:
                        up.finish()
                        up = None
            code = 503
            record.error = "upstream_unavailable"
            client.write(_serialize(no_instance_error(rr, NoHealthyInstance(), exclude, base_headers), keep_alive))
        except _ClientGone:
            code = rr.completed_status or 499
        except asyncio.CancelledError:
            code = rr.completed_status or 499
            raise
        finally:
            if pending is not None:  # (never left over but by a bug: its slot is not kept)
                pending.release()
            self._count(rr, code or 500)

    # -- the bookkeeping of an answer, for _forward/_relay and _settle --------------

    def _answered(self, rr: RoutedRequest, up: _Upstream, decision: Any) -> None:
        """The instance answered (its head came): counted, and a passive health success."""
        self.state.health.passive_success(decision.instance.instance_id)
        self._answered_metrics(rr, up.status, decision)

    def _answered_metrics(self, rr: RoutedRequest, status: int, decision: Any) -> None:
        instance = decision.instance.instance_id
        count_routed(self.state, rr, decision)
        if status >= 500:
            self.state.metrics.upstream_errors.labels(instance, "http_5xx").inc()
            rr.record.error = "http_5xx"

    def _account_whole(self, rr: RoutedRequest, reply: _Reply, instance: str) -> int:
        """Metrics of an answer :meth:`_whole` wrote; returns its status."""
        m = self.state.metrics
        variant = rr.pool.name
        m.overhead_seconds.labels(rr.endpoint, variant).observe(reply.overhead_s)
        m.ttft_seconds.labels(rr.endpoint, variant).observe(reply.first_s - rr.t0)
        if reply.sse and rr.done_marked and not ends_with_done(reply.tail):
            m.upstream_errors.labels(instance, "no_done").inc()
            rr.record.error = "no_done"
        return reply.status

    def _released(self, rr: RoutedRequest, decision: Any) -> None:
        self.state.metrics.decision_seconds.labels(rr.endpoint, rr.pool.name).observe(decision.decision_s)

    def _count(self, rr: RoutedRequest, code: int | str, t_end: float | None = None) -> None:
        """The request is over (at ``t_end``, ``time.perf_counter()``; default now): its
        response code (a status, ``499``, ``stream_aborted``) and its duration."""
        m = self.state.metrics
        if t_end is None:
            t_end = time.perf_counter()
        m.responses.labels(rr.endpoint, rr.pool.name, str(code)).inc()
        m.duration_seconds.labels(rr.endpoint, rr.pool.name).observe(t_end - rr.t0)
        self.state.observers.finished(rr, code, t_end)

    def _error(self, client: _Client, rr: RoutedRequest, status: int, message: str, code: str,
               headers: dict[str, str], keep_alive: bool) -> None:
        resp = upstream_error(rr.api, status, message, code, headers)
        client.write(_serialize(resp, keep_alive))

    async def _relay(self, client: _Client, rr: RoutedRequest, up: _Upstream, decision: Any, router_s: float,
                     keep_alive: bool) -> int | str:
        """Copy the instance's answer to the client as it arrives (or account for the
        one :meth:`_whole` already wrote); returns the ``code`` label (the status, 499
        if the client left, or ``stream_aborted``)."""
        state = self.state
        m = state.metrics
        instance = decision.instance.instance_id
        variant = decision.variant
        reply = up.reply
        if reply is not None:  # written whole as it arrived
            return self._account_whole(rr, reply, instance)
        up.on_whole = None  # from here on, this task relays the answer
        t_headers = time.perf_counter()
        if rr.api is not Api.OPENAI and not 200 <= up.status < 300:
            return await self._model_error(client, rr, up, decision, router_s, t_headers, keep_alive)
        reply = self._reply(rr, up, _our_lines(rr, decision), router_s, t_headers, keep_alive)
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
            watch = _IdleWatch(self.loop, up, client, idle_s)
            try:
                await self._await(client, up.done, None)
            except TimeoutError:
                return self._end_broken(client, rr, up, instance, TimeoutError(), sse, reply.tail, idle_s, framed)
            except _ClientGone:
                up.abort()
                return rr.completed_status or 499
            except asyncio.CancelledError:
                if self.closing:  # cut by the shutdown: ended in the stream's own terms
                    self._end_cut(client, sse, reply.tail, framed)
                raise
            finally:
                watch.cancel()
                client.upstream = None
        tail = reply.tail
        if up.error is not None and not up.complete:
            if parts:
                client.write(b"".join(parts))
            return self._end_broken(client, rr, up, instance, up.error, sse, tail, idle_s, framed)
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

    def _reply(self, rr: RoutedRequest, up: _Upstream, ours: bytes, router_s: float, t_headers: float,
               keep_alive: bool) -> _Reply:
        """How ``up``'s answer (its head received) is relayed: our head for it (the
        instance's end-to-end headers, ``ours`` (:func:`_our_lines`), the framing) and
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

    def _whole(self, client: _Client, rr: RoutedRequest, ours: bytes, router_s: float, keep_alive: bool,
               up: _Upstream) -> None:
        """``up``'s answer came whole before its relay started (a non-streamed answer,
        usually): written to the client from the parser's callback, at once, so that
        the bookkeeping (metrics, the lease, the pooled connection: :meth:`_relay` and
        :meth:`_forward`, when the request's task resumes) comes after the client has
        it. Left to the task: a SageMaker ModelError answer, a client gone."""
        if client.closed or (rr.api is not Api.OPENAI and not 200 <= up.status < 300) or \
                self.state.retry_status.retries(up.status, self.state.settings.max_retries):
            return  # (a 429/503 that --retry-status may send elsewhere: the task decides)
        reply = self._reply(rr, up, ours, router_s, time.perf_counter(), keep_alive)
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

    def _end_broken(self, client: _Client, rr: RoutedRequest, up: _Upstream, instance: str, exc: BaseException,
                    sse: bool, tail: bytes, idle_s: float, framed: bool) -> str:
        """As proxy._end_broken: the status is sent; end in the stream's own terms."""
        timeout = isinstance(exc, TimeoutError)
        kind = rr.record.error = "idle_timeout" if timeout else _error_kind(exc)
        up.abort()
        self.state.metrics.upstream_errors.labels(instance, kind).inc()
        self.state.health.passive_failure(instance)
        log.warning("instance %s: response broken mid-body (%s)", instance, kind)
        message = broken_message(instance, kind, idle_s)
        if not _end_with_event(client, sse, tail, framed,
                               lambda: eventstream.model_stream_error(
                                   message, "ModelInvocationTimeExceeded" if timeout else "StreamBroken"),
                               lambda: sse_error_event(message, "upstream_timeout" if timeout else
                                                       "upstream_disconnected")):
            client.abort()
        return STREAM_ABORTED

    @staticmethod
    def _end_cut(client: _Client, sse: bool, tail: bytes, framed: bool) -> None:
        """A stream under way cut by the shutdown (``--shutdown-timeout`` passed, or a
        second stop signal): its client gets the stream's own error event and the end of
        the body, as when the instance breaks off (:meth:`_end_broken`), where an event
        can be placed; else the connection is closed (by the shutdown), as before."""
        message = "the router is shutting down: the response was cut before its end"
        _end_with_event(client, sse, tail, framed, lambda: eventstream.internal_stream_failure(message),
                        lambda: sse_error_event(message, "router_shutting_down"))

    async def _model_error(self, client: _Client, rr: RoutedRequest, up: _Upstream, decision: Any, router_s: float,
                           t_headers: float, keep_alive: bool) -> int:
        """SageMaker's answer to a model's non-2xx status: 424 ``ModelError``."""
        instance = decision.instance.instance_id
        try:
            await self._await(client, up.done, self.state.settings.stream_idle_timeout_s)
        except TimeoutError as exc:  # the error body itself went silent: keep the status
            self.state.metrics.upstream_errors.labels(instance, _error_kind(exc)).inc()
        if up.error is not None and not up.complete:
            self.state.metrics.upstream_errors.labels(instance, _error_kind(up.error)).inc()
        resp = model_error(self.state, rr, decision, up.status, b"".join(up.chunks)[:_MAX_ERROR_BODY * 4], router_s,
                           t_headers)
        client.write(_serialize(resp, keep_alive))
        return 424

    async def _delegate(self, client: _Client, inc: _Incoming) -> None:
        """Relay a request the fast path does not serve to the aiohttp app, unchanged
        but for its framing (the body is sent whole, with ``Content-Length``) and its
        version (HTTP/1.1 on the private socket: an HTTP/1.0 request without ``Host``,
        such as HAProxy's default ``option httpchk``, gets one, as HTTP/1.0 allows)."""
        body = b"".join(inc.body)
        parts = [b"%s %s HTTP/1.1\r\n" % (inc.method, inc.url)]
        host = False
        for k, v in inc.headers:
            low = k.lower()
            if low not in _FRAMING:
                parts.append(k + b": " + v + b"\r\n")
                host = host or low == b"host"
        if not host and inc.version == "1.0":
            parts.append(b"Host: localhost\r\n")
        if not inc.keep_alive:
            parts.append(b"Connection: close\r\n")
        parts.append(b"Content-Length: %d\r\n\r\n" % len(body))
        up: _Upstream | None = None
        try:
            up = await self.internal_pool.get(self.internal, 10.0)
            up.no_body = inc.method == b"HEAD"
            up.send(b"".join(parts), body)
            await self._await(client, up.headers_fut, None)
            out = [(k, v) for k, v in up.resp_headers if k.lower() not in _FRAMING and k.lower() != b"date"]
            length = up.content_length
            bodyless = up.status in (204, 304) or inc.method == b"HEAD"
            # An HTTP/1.0 client cannot read chunks: its answer ends when the connection does.
            chunked = length is None and not bodyless and inc.version == "1.1"
            if length is None and not bodyless and not chunked:
                inc.keep_alive = False
            if chunked:
                framing = b"Transfer-Encoding: chunked\r\n"
            elif length is not None:
                framing = b"Content-Length: " + length + b"\r\n"
            else:
                framing = b""
            client.write(_head(up.status, up.reason or _reason(up.status), out, framing, inc.keep_alive))
            transport = client.transport

            def sink(chunk: bytes) -> None:
                if client.closed or transport is None:
                    return
                if chunked:
                    transport.writelines((b"%x\r\n" % len(chunk), chunk, b"\r\n"))
                else:
                    transport.write(chunk)

            client.upstream = up
            for chunk in up.chunks:
                sink(chunk)
            up.chunks = []
            up.sink = sink
            if client.write_paused:
                up.pause()
            await self._await(client, up.done, None)
            if chunked:
                client.write(b"0\r\n\r\n")
        except _ClientGone:
            if up is not None:
                up.abort()
        except (_UpstreamLost, OSError, TimeoutError) as exc:
            if up is not None and up.headers_fut.done() and not up.headers_fut.exception():
                client.abort()  # the head is sent: a truncated answer must look truncated
            else:
                log.error("internal application unreachable: %s", exc)
                client.write_response(503, b"Service Unavailable", [(b"Content-Type", b"application/json")],
                                      b'{"message": "the router is shutting down or unavailable"}', False)
                inc.keep_alive = False
        finally:
            client.upstream = None
            if up is not None:
                up.finish()


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


def shutting_down_error(path: str, headers: dict[str, str] | None = None) -> web.Response:
    """The 503 for a request the router will not route because it is shutting down, in
    the shape of the API of ``path`` (OpenAI: code ``router_shutting_down``; SageMaker
    runtime: ``ServiceUnavailable``), with ``headers``."""
    return error_for_path(path, 503, "the router is shutting down: the request was not sent to any instance",
                          "router_shutting_down", sagemaker_type="ServiceUnavailable", headers=headers)


def _our_lines(rr: RoutedRequest, decision: Any) -> bytes:
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


def _expire(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_exception(TimeoutError())


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


def _error_kind(exc: BaseException | None) -> str:
    if isinstance(exc, TimeoutError):
        return "timeout"
    if isinstance(exc, ConnectionResetError):
        return "reset"
    if isinstance(exc, (ConnectionError, httptools.HttpParserError)) or exc is None:
        return "disconnect"
    return "other"


#: Longest path a Unix socket may have (``sun_path`` is 108 bytes on Linux, with its NUL).
_UNIX_PATH_MAX = 107


def internal_socket_path(parent: str | None = None, prefix: str = "prefixroute-",
                         fallback_prefix: str = "prefixroute-") -> str:
    """A fresh path for the aiohttp app's Unix socket, in a new directory only this user
    can enter: ``<parent>/<prefix>XXXXXXXX/app.sock`` (``parent`` ``None``: the system's
    temporary directory), or ``<system temporary directory>/<fallback_prefix>XXXXXXXX/
    app.sock`` if that path would be too long for a Unix socket (a long ``$TMPDIR``).

    Raises:
        OSError: even that path would be too long (nothing is created); the message
            says to shorten ``$TMPDIR``.
    """
    def longest(parent: str | None, prefix: str) -> str:
        return os.path.join(parent or tempfile.gettempdir(), prefix + "X" * 8, "app.sock")

    if parent is not None and len(os.fsencode(longest(parent, prefix))) > _UNIX_PATH_MAX:
        parent, prefix = None, fallback_prefix
    if len(os.fsencode(path := longest(parent, prefix))) > _UNIX_PATH_MAX:
        raise OSError(f"the internal Unix socket would be {path!r}, {len(os.fsencode(path))} bytes, over the "
                      f"{_UNIX_PATH_MAX} a Unix socket path may have: set TMPDIR to a shorter directory")
    directory = tempfile.mkdtemp(prefix=prefix, dir=parent)
    os.chmod(directory, 0o700)
    return os.path.join(directory, "app.sock")
