"""The fast data plane: the router's public port on raw asyncio protocols.

aiohttp's server and client cost about 0.4 ms of CPU per proxied request on the
development machine (docs/PERFORMANCE_HISTORY.md, "Where the time goes"), several times the
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
                 │      └─► attempt.acquire ─► _Upstream (pooled raw connection) ─► instance
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
pauses reading from the instance (the answer's relay: :mod:`prefixroute.server.relay`).

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
import contextlib
import functools
import logging
import time
from typing import Any

from aiohttp import web

from prefixroute.core.attempts import Attempts, Next
from prefixroute.core.pool import Lease, NoHealthyInstance, SetSaturated
from prefixroute.server import headers as H
from prefixroute.server.app import prepare_inference, request_id
from prefixroute.server.attempt import acquire, acquire_or_grow, apply_step, count_routed, learn_route, retry_elsewhere
from prefixroute.server.proxy import (Api, RoutedRequest, ends_with_done, no_instance_error, our_headers,
                                      saturated_error, upstream_error, upstream_headers)
from prefixroute.server.relay import our_lines, relay, write_whole
from prefixroute.server.refusals import count_answer, error_for_path, shutting_down_error
from prefixroute.server.request_body import (BodyNotDecoded, BodyTimedOut, BodyTooLarge, decode_request_body,
                                             request_coding, transfer_refused)
from prefixroute.server.routes import RouteMatch, match_route
from prefixroute.server.state import RouterState
from prefixroute.server.delegate import delegate
from prefixroute.server.internal_socket import internal_socket_path  # (re-exported)
from prefixroute.server.http11 import _field, _serialize
from prefixroute.server.upstream import PEER_CHECK_AFTER_S, _error_kind, _Reply, _Upstream, _UpstreamLost, _UpstreamPool
from prefixroute.server.client import _Client, _ClientGone, _Incoming, _Started

__all__ = ["FrontServer", "internal_socket_path", "match_route"]

log = logging.getLogger("prefixroute.server.dataplane")

#: How long the metrics of an answer written whole wait, seconds: they are recorded
#: together, off the requests' path (:meth:`FrontServer.account`); ``/metrics`` records
#: them first.
ACCOUNTING_DELAY_S = 0.001


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
        # A connection pooled moments ago is reused unchecked only when a close racing the
        # send can be sent again (stale_connection needs a retry left).
        self.upstreams = _UpstreamPool(self.loop, s.max_connections, s.keepalive_timeout_s,
                                       PEER_CHECK_AFTER_S if s.max_retries > 0 else 0.0)
        self.internal_pool = _UpstreamPool(self.loop, 1 << 16, 60.0, 0.0)
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
        task (an answer that comes whole is written by
        :func:`~prefixroute.server.relay.write_whole`, then :meth:`_settle` does the
        bookkeeping), unless its answer needs the task (a
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
            if rr.blocks:  # learnt before the connect (attempt.learn_route)
                learn_route(pool, lease.decision.instance, rr.blocks)
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
            learn_route(pool, lease.decision.instance, rr.blocks)
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
        """The bookkeeping of a request whose answer :func:`~prefixroute.server.relay.write_whole`
        wrote (what :meth:`_forward` and :meth:`_relay` do for it), then the connection's next
        request."""
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
            await delegate(self, client, inc)
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
        arrives (:func:`~prefixroute.server.relay.write_whole`)."""
        up.send(b"POST %s%s HTTP/1.1\r\nHost: %s\r\n" % (target[3], rr.upstream_path.encode(), target[4])
                + head_tail, rr.body)
        # The instance is at work: what follows until its answer is off the critical path.
        up.on_whole = functools.partial(write_whole, self.state, client, rr, our_lines(rr, decision), router_s,
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
        attempts = Attempts(settings.max_retries, state.retry_status)  # what each outcome means
        exclude = attempts.exclude
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
        unlearnt = False  # this attempt's lease is not learnt yet
        try:
            for attempts.index in range(1 + settings.max_retries):
                if attempts.index and client.closed:
                    raise _ClientGone()  # nothing is sent again for a client that has gone
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
                    unlearnt = bool(rr.blocks)  # learnt after the send, or before a connect (learn_route)
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
                            up = None if fresh else self.upstreams.take(target[:3])
                            if up is None:
                                if unlearnt:
                                    unlearnt = False
                                    learn_route(pool, decision.instance, rr.blocks)
                                up = await self._connect(client, target[:3])
                        except (OSError, TimeoutError) as exc:
                            step = attempts.connect_failed(instance, type(exc).__name__,
                                                           timed_out=isinstance(exc, TimeoutError))
                            apply_step(state, rr, instance, decision, step)
                            mark = time.perf_counter()
                            retry = step.reason
                            continue
                        head_tail = head_tail or self._head_tail(rr)
                        self._send(client, up, rr, target, head_tail, decision, router_s, keep_alive)
                    if unlearnt:  # (sent over a pooled connection: learnt once on its way)
                        unlearnt = False
                        learn_route(pool, decision.instance, rr.blocks)
                    try:
                        await self._await(client, up.headers_fut, settings.response_headers_timeout_s)
                    except TimeoutError:
                        step = attempts.headers_timeout(instance, settings.response_headers_timeout_s)
                    except _UpstreamLost as lost:
                        if lost.invalid:
                            step = attempts.invalid(instance, str(lost.exc)[:80])
                        else:
                            step = attempts.lost(instance, _error_kind(lost.exc), lost.sent, up.reused,
                                                 time.perf_counter() - record.t_sent)
                    else:
                        step = attempts.answered(instance, up.status)
                        if step.next is Next.TRY_ELSEWHERE:
                            pending = await retry_elsewhere(state, rr, instance, up.status,
                                                            _field(up.resp_headers, b"retry-after"), exclude)
                            if pending is None:
                                step = attempts.relay()
                    apply_step(state, rr, instance, decision, step)
                    if step.next is Next.RETRY or step.next is Next.TRY_ELSEWHERE:
                        mark = time.perf_counter()
                        retry = step.reason
                        fresh = fresh or step.fresh_connection
                        continue  # (finish() below closes the connection if the answer is not all in)
                    if step.next is Next.ERROR:
                        code = step.client_status(rr.api is Api.OPENAI)
                        self._error(client, rr, step.status, step.message, step.code,
                                    {**base_headers, H.INSTANCE: instance}, keep_alive)
                        return
                    if up.status >= 500:
                        m.upstream_errors.labels(instance, "http_5xx").inc()
                        record.error = "http_5xx"
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

    def _answered_metrics(self, rr: RoutedRequest, status: int, decision: Any) -> None:
        instance = decision.instance.instance_id
        count_routed(self.state, rr, decision)
        if status >= 500:
            self.state.metrics.upstream_errors.labels(instance, "http_5xx").inc()
            rr.record.error = "http_5xx"

    def _account_whole(self, rr: RoutedRequest, reply: _Reply, instance: str) -> int:
        """Metrics of an answer :func:`~prefixroute.server.relay.write_whole` wrote; returns
        its status."""
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

    #: The answer's relay, once its head has come (:func:`prefixroute.server.relay.relay`),
    #: as a method: ``self._relay(client, rr, up, decision, router_s, keep_alive)``.
    _relay = relay


def _expire(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_exception(TimeoutError())
