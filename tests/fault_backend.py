"""A fault-injecting engine instance: a real HTTP/1.1 server on loopback, written on raw
asyncio streams so that it can misbehave in ways a framework would not let it.

What it can do (:class:`Fault`, chosen per request):

* ``ok``: answer like an engine: JSON with Content-Length, or (``"stream": true`` in the
  body) a chunked SSE stream of ``events`` events and ``data: [DONE]`` (the body ended
  ``end_delay`` seconds after it);
* ``stall``: read the request, then send nothing until the client goes away;
* ``reset_before_headers`` / ``close_before_headers``: read the request, then RST / FIN
  (after ``delay`` seconds);
* ``reset_on_headers``: read the request head only, then RST (the body is never read);
* ``reset_after``: stream ``after`` events, then RST;
* ``stall_after``: stream ``after`` events, then go silent;
* ``no_done``: stream ``events`` events and end the chunked body cleanly without
  ``data: [DONE]``;
* ``split``: the ``ok`` stream, but every ``chunk`` bytes is its own write (events and
  UTF-8 characters cut anywhere);
* ``status``: answer ``status`` with ``body`` and ``headers`` (4xx, 5xx, 429...), after
  ``delay`` seconds.

:meth:`FaultBackend.refuse` stops listening (connections are refused),
:meth:`FaultBackend.kill` also resets the open connections, and
:meth:`FaultBackend.listen` starts again on the same port.

``GET /health`` (the router's active check) is answered 200 and only counted
(``health_checks``): it takes no fault from the script. Every other request is recorded
(:class:`Received`): method, path, headers, body, whether the
body came chunked, its ``X-Request-Id``, when it arrived and when the client's
connection closed (``time.monotonic()``) — how the tests see that the router aborted.
"""

from __future__ import annotations

import asyncio
import itertools
import socket
import struct
import time
from dataclasses import dataclass, field
from typing import Callable

import orjson
from multidict import CIMultiDict

__all__ = ["Fault", "Received", "FaultBackend", "TOKENS"]

_BUF_LIMIT = 1 << 20  # bytes a connection buffers before it stops reading (TCP flow control)

#: Text of the streamed tokens: ASCII and multi-byte UTF-8 (2, 3 and 4 bytes).
TOKENS = ["Hé", "llo", " wörld", " €", " 😀", "!"]


@dataclass
class Fault:
    """How to answer one request (see the module docstring)."""

    kind: str = "ok"
    events: int = 6
    after: int = 2
    status: int = 200
    body: bytes = b'{"error": {"message": "fault", "type": "invalid_request_error"}}'
    headers: dict[str, str] = field(default_factory=dict)
    delay: float = 0.0  # seconds between events
    end_delay: float = 0.0  # seconds between an ``ok`` stream's ``[DONE]`` and the end of its body
    chunk: int = 3  # bytes per write with ``split``


@dataclass
class Received:
    """One request as the backend saw it."""

    method: str
    path: str
    headers: CIMultiDict[str]
    body: bytes
    chunked: bool
    fault: Fault
    t_received: float
    t_closed: float | None = None

    @property
    def request_id(self) -> str | None:
        return self.headers.get("X-Request-Id")

    @property
    def stream(self) -> bool:
        try:
            doc = orjson.loads(self.body)
        except orjson.JSONDecodeError:
            return False
        return isinstance(doc, dict) and doc.get("stream") is True


def sse_events(n: int, done: bool = True) -> bytes:
    """The bytes of an ``ok`` stream of ``n`` events (and ``[DONE]``)."""
    return b"".join(event_list(n, done))


def event_list(n: int, done: bool = True) -> list[bytes]:
    """The events of an ``ok`` stream, one ``bytes`` each."""
    out = []
    for i in range(n):
        tok = TOKENS[i % len(TOKENS)]
        out.append(b"data: " + orjson.dumps({"id": "c1", "object": "chat.completion.chunk",
                                             "choices": [{"index": 0, "delta": {"content": tok}}]}) + b"\n\n")
    if done:
        out.append(b"data: [DONE]\n\n")
    return out


class _Conn:
    """One client connection: a reader task fills ``buf`` and notices the close."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.buf = bytearray()
        self.more = asyncio.Event()
        self.room = asyncio.Event()  # flow control: the reader pauses while ``buf`` is full
        self.room.set()
        self.closed_at: float | None = None
        self.on_close: list[Callable[[float], None]] = []
        self.task = asyncio.create_task(self._read())

    async def _read(self) -> None:
        try:
            while True:
                if len(self.buf) >= _BUF_LIMIT:
                    self.room.clear()
                    await self.room.wait()
                data = await self.reader.read(65536)
                if not data:
                    break
                self.buf += data
                self.more.set()
        except (ConnectionError, OSError):
            pass
        finally:
            self.closed_at = time.monotonic()
            for cb in self.on_close:
                cb(self.closed_at)
            self.more.set()

    async def _until(self, pred: Callable[[], int]) -> int:
        while True:
            n = pred()
            if n >= 0:
                return n
            if self.closed_at is not None:
                raise EOFError
            self.more.clear()
            await self.more.wait()

    async def read_until(self, sep: bytes) -> bytes:
        n = await self._until(lambda: (i + len(sep)) if (i := self.buf.find(sep)) >= 0 else -1)
        out = bytes(self.buf[:n])
        del self.buf[:n]
        self.room.set()
        return out

    async def read_exactly(self, size: int) -> bytes:
        if size > _BUF_LIMIT:  # a large body: read it in pieces, keeping flow control
            parts = []
            while size > 0:
                part = min(size, _BUF_LIMIT // 2)
                parts.append(await self.read_exactly(part))
                size -= part
            return b"".join(parts)
        await self._until(lambda: size if len(self.buf) >= size else -1)
        out = bytes(self.buf[:size])
        del self.buf[:size]
        self.room.set()
        return out

    @property
    def closed(self) -> bool:
        return self.closed_at is not None

    def write(self, data: bytes) -> None:
        if not self.writer.is_closing():
            self.writer.write(data)

    async def drain(self) -> None:
        try:
            await self.writer.drain()
        except (ConnectionError, OSError):
            pass

    def reset(self) -> None:
        sock = self.writer.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.writer.transport.abort()

    def close(self) -> None:
        self.writer.close()


class FaultBackend:
    """The server. ``default`` answers every request unless ``script`` (consumed in
    order) or ``choose`` (``Received -> Fault | None``) says otherwise."""

    def __init__(self) -> None:
        self.default = Fault()
        self.script: list[Fault] = []
        self.choose: Callable[[Received], Fault | None] | None = None
        self.received: list[Received] = []
        self.record = True  # False: keep no record of requests (long load runs)
        self.response_headers: dict[str, str] = {}
        self.port = 0
        self.url = ""
        self.accepted = 0  # connections accepted since start
        self.health_checks = 0  # GET /health answered (active checks: 200, never recorded or scripted)
        self._server: asyncio.base_events.Server | None = None
        self._conns: set[_Conn] = set()
        self._handlers: set[asyncio.Task[None]] = set()
        self._ids = itertools.count()

    # -- lifecycle -------------------------------------------------------------------

    async def start(self) -> "FaultBackend":
        await self.listen()
        return self

    async def listen(self) -> None:
        """Listen (again) on ``self.port`` (a free port the first time)."""
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", self.port, reuse_address=True)
        self.port = self._server.sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"

    async def refuse(self) -> None:
        """Stop listening: new connections are refused; open ones stay."""
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None

    async def kill(self) -> None:
        """Die: stop listening and reset every open connection."""
        await self.refuse()
        for conn in list(self._conns):
            conn.reset()

    async def stop(self) -> None:
        await self.refuse()
        for conn in list(self._conns):
            conn.writer.transport.abort()
        for task in list(self._handlers):
            task.cancel()
        await asyncio.gather(*self._handlers, return_exceptions=True)

    # -- what the tests read ---------------------------------------------------------

    def ids(self) -> list[str | None]:
        return [r.request_id for r in self.received]

    @property
    def open_connections(self) -> int:
        return sum(1 for c in self._conns if not c.closed)

    # -- serving ---------------------------------------------------------------------

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = _Conn(reader, writer)
        self._conns.add(conn)
        self.accepted += 1
        task = asyncio.current_task()
        assert task is not None
        self._handlers.add(task)
        try:
            while True:
                try:
                    rec = await self._read_request(conn)
                except EOFError:
                    return
                keep = await self._answer(conn, rec)
                if not keep:
                    return
        except (ConnectionError, OSError, asyncio.CancelledError):
            return
        finally:
            if not writer.is_closing():
                writer.close()
            self._conns.discard(conn)
            self._handlers.discard(task)

    async def _read_request(self, conn: _Conn) -> Received:
        head = await conn.read_until(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        method, path, _ = lines[0].split(" ", 2)
        headers: CIMultiDict[str] = CIMultiDict()
        for line in lines[1:]:
            if line:
                k, _, v = line.partition(":")
                headers.add(k.strip(), v.strip())
        chunked = "chunked" in headers.get("Transfer-Encoding", "").lower()
        rec = Received(method, path, headers, b"", chunked, Fault(), time.monotonic())
        if method == "GET" and path == "/health":  # the router's active check: 200, not recorded
            self.health_checks += 1
            return rec
        if method == "GET" and path.split("?", 1)[0] == "/v1/models":
            # The router asks every instance what it serves (at start, each health round):
            # no model list here, as a SageMaker container may have none. Neither
            # scripted nor recorded: the faults are for inference requests.
            rec.fault = Fault(kind="status", status=404, body=b'{"detail": "Not Found"}')
            return rec
        fault = None
        if self.script:
            fault = self.script.pop(0)
        elif self.choose is not None:
            fault = self.choose(rec)
        rec.fault = fault or self.default

        def closed(t: float, rec: Received = rec) -> None:
            if rec.t_closed is None:
                rec.t_closed = t

        if self.record:
            conn.on_close.append(closed)
            if conn.closed:
                closed(conn.closed_at or time.monotonic())
        if rec.fault.kind == "reset_on_headers":  # the body is never read
            if self.record:
                self.received.append(rec)
            return rec
        if chunked:
            parts = []
            while True:
                size = int((await conn.read_until(b"\r\n")).split(b";")[0].strip(), 16)
                if size == 0:
                    while await conn.read_until(b"\r\n") != b"\r\n":
                        pass  # trailers
                    break
                parts.append(await conn.read_exactly(size))
                await conn.read_exactly(2)
            rec.body = b"".join(parts)
        else:
            rec.body = await conn.read_exactly(int(headers.get("Content-Length", "0")))
        if self.record:
            self.received.append(rec)
        return rec

    def _head(self, status: int, headers: dict[str, str]) -> bytes:
        lines = [f"HTTP/1.1 {status} {'OK' if status == 200 else 'Fault'}"]
        for k, v in {**self.response_headers, **headers}.items():
            lines.append(f"{k}: {v}")
        return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")

    async def _chunks(self, conn: _Conn, pieces: list[bytes], delay: float) -> bool:
        """Write each piece as one chunked-encoding chunk; False if the client went away."""
        for piece in pieces:
            if conn.closed:
                return False
            conn.write(f"{len(piece):x}\r\n".encode() + piece + b"\r\n")
            await conn.drain()
            if delay:
                await asyncio.sleep(delay)
            else:
                await asyncio.sleep(0)
        return not conn.closed

    async def _wait_closed(self, conn: _Conn) -> None:
        while not conn.closed:
            conn.more.clear()
            await conn.more.wait()

    async def _answer(self, conn: _Conn, rec: Received) -> bool:
        """Answer one request; True to keep the connection for the next one."""
        f = rec.fault
        k = f.kind
        if k == "stall":
            await self._wait_closed(conn)
            return False
        if k in ("reset_before_headers", "reset_on_headers"):
            if f.delay and k == "reset_before_headers":
                await asyncio.sleep(f.delay)  # (the request read whole: an engine failing while it generates)
            conn.reset()
            return False
        if k == "close_before_headers":
            if f.delay:
                await asyncio.sleep(f.delay)
            conn.close()
            return False
        if k == "status":
            if f.delay:
                await asyncio.sleep(f.delay)
            conn.write(self._head(f.status, {"Content-Type": "application/json", "Content-Length": str(len(f.body)),
                                             **f.headers}) + f.body)
            await conn.drain()
            return True
        if not rec.stream:
            body = orjson.dumps({"id": "c1", "object": "chat.completion", "path": rec.path,
                                 "choices": [{"index": 0, "message": {"role": "assistant",
                                                                      "content": "".join(TOKENS)}}]})
            conn.write(self._head(200, {"Content-Type": "application/json", "Content-Length": str(len(body)),
                                        **f.headers}) + body)
            await conn.drain()
            return True
        conn.write(self._head(200, {"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                    "Transfer-Encoding": "chunked", **f.headers}))
        await conn.drain()
        if k in ("reset_after", "stall_after"):
            if not await self._chunks(conn, event_list(f.after, done=False), f.delay):
                return False
            if k == "reset_after":
                await asyncio.sleep(0.01)
                conn.reset()
            else:
                await self._wait_closed(conn)
            return False
        events = event_list(f.events, done=(k != "no_done"))
        if k == "split":
            data = b"".join(events)
            events = [data[i:i + f.chunk] for i in range(0, len(data), f.chunk)]
        if not await self._chunks(conn, events, f.delay):
            return False
        if f.end_delay:
            await asyncio.sleep(f.end_delay)
            if conn.closed:
                return False
        conn.write(b"0\r\n\r\n")
        await conn.drain()
        return True
