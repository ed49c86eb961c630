"""The fast data plane's side toward the instances: one pooled raw HTTP/1.1 connection
(:class:`_Upstream`, an ``asyncio.Protocol`` parsing the answer with httptools), the
pool of them per instance (:class:`_UpstreamPool`: kept alive, checked before reuse,
closed after ``--upstream-keepalive-timeout``), what an answer written whole is
(:class:`_Reply`), and how a failure before the answer is named
(:class:`_UpstreamLost`, :func:`_error_kind`)."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import select
import time
from typing import Any, Callable

import httptools

from prefixroute.server import eventstream
from prefixroute.server.client_session import peer_closed
from prefixroute.server.record import RequestRecord

__all__ = ["_Upstream", "_UpstreamPool", "_UpstreamLost", "_Reply", "_error_kind"]

log = logging.getLogger("prefixroute.server.dataplane")

#: An idle connection pooled less than this many seconds ago is reused without asking the
#: kernel whether the instance closed it (a ``poll``, a tenth of a request's CPU at
#: thousands of requests a second), when the router may retry (``--max-retries`` above 0:
#: the data plane passes 0 otherwise): engines keep connections alive for seconds (vLLM's
#: uvicorn: 5 s), and a close that raced the send is sent again on a new connection
#: (``stale_connection``, :mod:`prefixroute.core.attempts`; it takes one of the retries).
#: What such a close leaves unseen is also what the check itself cannot see: a close
#: that arrives after it.
PEER_CHECK_AFTER_S = 0.25

_TAIL = 32  # bytes of a stream's end kept to see event boundaries and ``data: [DONE]``


class _UpstreamLost(Exception):
    """The instance's connection ended before the response headers."""

    def __init__(self, exc: BaseException | None, sent: bool) -> None:
        super().__init__(str(exc) if exc else "connection closed")
        self.exc = exc
        self.sent = sent  # the request was written in full
        # Not a lost connection but an answer that is not HTTP for this request (an
        # unsolicited 101, a malformed head): never sent again.
        self.invalid = isinstance(exc, (httptools.HttpParserError, httptools.HttpParserUpgrade))


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
        # relay has not started): relay.write_whole writes it to the client at once.
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

    def transport_closing(self) -> bool:
        """The connection is closed or closing as far as the event loop knows (no system call)."""
        transport = self.transport
        return transport is None or transport.is_closing()

    def peer_gone(self) -> bool:
        """:func:`~prefixroute.server.client_session.peer_closed` for this idle connection, with
        its socket registered once (one ``poll`` system call, zero timeout)."""
        if self.transport_closing():
            return True
        poller = self.poller
        return peer_closed(self.transport) if poller is None else bool(poller.poll(0))  # type: ignore[arg-type]

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
            if self.headers_fut.done():  # (before the head, the request's attempt logs it: core/attempts.py)
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
    socket. Idle connections are reused most recent first, checked alive first (with a
    ``poll`` once idle for ``peer_check_after_s`` seconds or more: :data:`PEER_CHECK_AFTER_S`;
    0 checks every one), and closed after ``keepalive_s``.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, limit: int, keepalive_s: float,
                 peer_check_after_s: float = PEER_CHECK_AFTER_S) -> None:
        self.loop = loop
        self.limit = limit
        self.keepalive_s = keepalive_s
        self.peer_check_after_s = peer_check_after_s
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
            idle_s = now - conn.idle_since
            if idle_s < self.keepalive_s and (idle_s < self.peer_check_after_s and not conn.transport_closing()
                                              or not conn.peer_gone()):
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


def _error_kind(exc: BaseException | None) -> str:
    if isinstance(exc, TimeoutError):
        return "timeout"
    if isinstance(exc, ConnectionResetError):
        return "reset"
    if isinstance(exc, (ConnectionError, httptools.HttpParserError)) or exc is None:
        return "disconnect"
    return "other"
