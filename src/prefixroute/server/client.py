"""The fast data plane's side toward the clients: one client connection
(:class:`_Client`, an ``asyncio.Protocol`` parsing requests with httptools: keep-alive,
pipelining answered in order, ``Expect: 100-continue``, limits on heads and bodies,
refusals, lingering close, idle and send timeouts), a request read from it
(:class:`_Incoming`) and where its answer stands (:class:`_Started`). What to do with a
request is :class:`~prefixroute.server.dataplane.FrontServer`'s."""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from typing import TYPE_CHECKING, Any

import httptools
import orjson
from aiohttp import web

from prefixroute.server import headers as H
from prefixroute.server.request_body import BodyTimedOut
from prefixroute.server.proxy import RoutedRequest
from prefixroute.server.http11 import _head
from prefixroute.server.upstream import _Upstream

if TYPE_CHECKING:
    from prefixroute.server.dataplane import FrontServer

__all__ = ["_Client", "_Incoming", "_Started", "_ClientGone", "MAX_HEAD_BYTES", "MAX_FIELD_BYTES", "MAX_HEADERS",
           "SINGLETON_FIELDS", "LINGER_S", "LINGER_MAX_S"]

log = logging.getLogger("prefixroute.server.dataplane")

#: Most bytes of request line + headers a client may send (aiohttp's limits are of the
#: same order: 8,190 bytes per line); 431 beyond.
MAX_HEAD_BYTES = 64 * 1024
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
_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"


class _ClientGone(Exception):
    """The client closed its connection before the answer was complete."""


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
                except Exception:  # our bug: the connection is aborted (part of an answer may be out), nothing hangs
                    log.exception("answering a request failed")
                    self.abort()
                    break
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
