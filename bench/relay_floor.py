"""The least a Python HTTP/1.1 relay can cost: a reference row for ``bench/overhead.py``.

prefixroute's data plane runs on CPython, uvloop and ``httptools`` (llhttp). This
program runs on the same three and does little else: no routing key, no JSON, no
metrics, no timeouts, no retries. It reads a request with ``httptools``, sends its
method, target, end-to-end headers and body (re-framed with ``Content-Length``) to the
next instance in turn (round robin) over a kept-alive connection, and copies the
instance's answer to the client byte for byte, read by read. What it adds to a request
is about what the interpreter, the event loop and the two extra sockets cost; what
prefixroute adds above it is at most prefixroute's own work (the relay also skips some
of what a correct proxy must do, below, so the gap is an upper bound).

It is a measuring instrument for the benchmark's own backend, not a proxy to deploy:
it trusts both sides. Not handled: ``Expect: 100-continue``; HTTP/1.0 clients; a
client's ``Connection: close`` (the connection stays open) or half-close (the
connection is closed at once); requests that ask to upgrade the connection (the
connection is closed); answers delimited by the connection's end; answers to ``HEAD``;
a slow client (no flow control); a client that leaves mid-answer (the instance is not
told: it finishes the answer, which is read and dropped); a pooled connection the
instance has just closed (the client connection is closed; no retry).

Usage::

    python bench/relay_floor.py --port 0 --backend http://127.0.0.1:9001 --backend http://127.0.0.1:9002

Prints ``relay-floor listening on http://HOST:PORT``, then relays until SIGTERM or SIGINT.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import signal
import sys
from urllib.parse import urlsplit

import httptools
import uvloop  # prefixroute's own event loop (a dependency of it on Linux): no other loop is measured

#: Request headers not relayed as they are: framing and hop-by-hop ones (RFC 9110 §7.6.1).
_NOT_RELAYED = frozenset({b"connection", b"keep-alive", b"transfer-encoding", b"content-length", b"te", b"trailer",
                          b"upgrade", b"proxy-connection", b"expect", b"host"})


class _Upstream(asyncio.Protocol):
    """One kept-alive connection to an instance; relays one answer at a time."""

    def __init__(self, pool: "_Pool") -> None:
        self.pool = pool
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.client: _Client | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        client = self.client
        if client is not None and client.transport is not None:
            client.transport.write(data)  # the answer's bytes as they came
        self.parser.feed_data(data)

    def on_message_complete(self) -> None:
        client, self.client = self.client, None
        if client is None:  # an answer nobody asked for: never reuse this connection
            if self.transport is not None:
                self.transport.close()
            return
        self.pool.idle.append(self)
        client.answered()

    def connection_lost(self, exc: Exception | None) -> None:
        if self in self.pool.idle:
            self.pool.idle.remove(self)
        client, self.client = self.client, None
        if client is not None and client.transport is not None:
            client.transport.close()  # what was relayed still reaches the client, then the end


class _Pool:
    """Kept-alive connections to one instance."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.idle: collections.deque[_Upstream] = collections.deque()

    async def connect(self) -> _Upstream:
        _, up = await asyncio.get_running_loop().create_connection(lambda: _Upstream(self), self.host, self.port)
        return up


class _Client(asyncio.Protocol):
    """One client connection: requests answered in order, one at a time."""

    pools: list[_Pool] = []  # one per instance (serve() fills it once per process)
    turn = 0
    connecting: set[asyncio.Task[None]] = set()  # (a task must be referenced while it runs)

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpRequestParser(self)
        self.url = b""
        self.headers: list[bytes] = []
        self.body: list[bytes] = []
        self.queue: collections.deque[bytes] = collections.deque()
        self.busy = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except (httptools.HttpParserError, httptools.HttpParserUpgrade):  # (not a subclass of the other)
            if self.transport is not None:
                self.transport.close()

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        if name.lower() not in _NOT_RELAYED:
            self.headers.append(b"%s: %s\r\n" % (name, value))

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        body = b"".join(self.body)
        self.queue.append(b"%s %s HTTP/1.1\r\nHost: backend\r\n%sContent-Length: %d\r\n\r\n%s"
                          % (self.parser.get_method(), self.url, b"".join(self.headers), len(body), body))
        self.url, self.headers, self.body = b"", [], []
        if not self.busy:
            self._next()

    def _next(self) -> None:
        if not self.queue or self.transport is None or self.transport.is_closing():
            return
        self.busy = True
        request = self.queue.popleft()
        pool = self.pools[_Client.turn % len(self.pools)]
        _Client.turn += 1
        if pool.idle:
            self._send(pool.idle.pop(), request)
        else:
            task = asyncio.get_running_loop().create_task(self._connect_and_send(pool, request))
            self.connecting.add(task)
            task.add_done_callback(self.connecting.discard)

    async def _connect_and_send(self, pool: _Pool, request: bytes) -> None:
        try:
            up = await pool.connect()
        except OSError:
            if self.transport is not None:
                self.transport.abort()
            return
        self._send(up, request)

    def _send(self, up: _Upstream, request: bytes) -> None:
        up.client = self
        assert up.transport is not None
        up.transport.write(request)

    def answered(self) -> None:
        self.busy = False
        self._next()

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None


async def serve(host: str, port: int, backends: list[str]) -> None:
    """Relay on ``host:port`` to ``backends`` (``http://HOST:PORT`` each) until stopped."""
    for url in backends:
        u = urlsplit(url)
        _Client.pools.append(_Pool(u.hostname, u.port))  # type: ignore[arg-type]  # (checked by main)
    loop = asyncio.get_running_loop()
    server = await loop.create_server(_Client, host, port, backlog=4096)
    bound = server.sockets[0].getsockname()
    print(f"relay-floor listening on http://{bound[0]}:{bound[1]}", flush=True)
    stop = loop.create_future()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, lambda: stop.done() or stop.set_result(None))
    await stop
    server.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python bench/relay_floor.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    p.add_argument("--port", type=int, default=0, help="port to listen on; 0 picks a free one (default)")
    p.add_argument("--backend", action="append", default=[], required=True,
                   help="base URL of one instance, http://HOST:PORT; repeat for each")
    args = p.parse_args(argv)
    for url in args.backend:
        u = urlsplit(url)
        try:
            port = u.port
        except ValueError:
            port = None
        if u.scheme != "http" or not u.hostname or port is None:
            p.error(f"--backend {url!r}: expected http://HOST:PORT")
    uvloop.install()
    asyncio.run(serve(args.host, args.port, args.backend))
    return 0


if __name__ == "__main__":
    sys.exit(main())
