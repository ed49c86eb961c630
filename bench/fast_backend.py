"""A minimal, fast OpenAI-shaped engine stand-in, so that a router's own cost is what a
benchmark measures (``bench/overhead.py``), not the backend's.

One process, one uvloop event loop, a raw :class:`asyncio.Protocol` HTTP/1.1 server
(no framework) listening on one or more ports, each standing for one engine instance.

* HTTP/1.1 keep-alive (HTTP/1.0 only with ``Connection: keep-alive``), pipelined
  requests answered in order; request bodies by ``Content-Length`` or
  ``Transfer-Encoding: chunked``; ``Expect: 100-continue`` is honoured.
* ``POST /v1/chat/completions``, ``POST /v1/completions`` (and ``POST /invocations``,
  answered like chat): a canned OpenAI-shaped JSON answer, or, when the body has a
  ``"stream"`` key set to ``true`` (``"stream": true``, ``"stream":true``; found by a
  byte search from the end, see :func:`wants_stream`), a server-sent event stream
  (``Transfer-Encoding: chunked``, ``text/event-stream``): ``--stream-chunks`` ``data:
  {...}`` events, each its own HTTP chunk and its own write, ``--stream-delay-ms`` apart
  (0: all at once), then ``data: [DONE]``. The body is never parsed as JSON, nor
  copied: bytes are received straight into a per-connection buffer
  (:class:`asyncio.BufferedProtocol`), so a 256 KB body costs little more than a 1 KB one
  (except with ``--kv-events``: each body is then copied and hashed, and parsed and
  tokenized the first time it arrives).
* ``--kv-events``: every port publishes the KV events of a stand-in engine with a warm,
  full prefix cache (``bench/kv_stand_in.py``; the ``precise`` extra), for a router in
  precise mode; ``GET /stats`` then has their counters under ``kv_events``.
* ``GET /health``, ``/ping``, ``/health_generate``: 200, empty body (vLLM's and SGLang's
  liveness). ``GET /v1/models``: one model. ``GET /metrics``: a short Prometheus text.
  ``GET /info``, ``/model_info``, ``/get_model_info``, ``/server_info``,
  ``/get_server_info``: a small JSON document describing the instance (prefixroute's
  emulated engine answers ``/info``; sglang-router asks SGLang's names at startup).
* ``GET /stats``: this backend's counters as JSON: requests by path and by port,
  streams open now and at most, and, with ``--record-bodies``, how many times each
  distinct request body arrived (keyed by its xxh3-64 hex digest) — how a test sees
  what a load generator or a router actually sent.
* Any other path: 404 with an OpenAI error object, counted in ``/stats`` (``unknown``)
  and logged once to stderr (how one finds what a router probes).

Usage::

    python bench/fast_backend.py --port 0 --port 0 --port 0 --port 0
    python bench/fast_backend.py --port 9001 --stream-chunks 20 --stream-delay-ms 100
    python bench/fast_backend.py --port 0 --port 0 --kv-events

Prints ``fast-backend listening on http://HOST:PORT`` once per port, then serves until
SIGTERM or SIGINT. RLIMIT_NOFILE is raised to its hard limit at start.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import resource
import signal
import socket
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import xxhash

__all__ = ["BackendOptions", "BackendStats", "HTTPProtocol", "wants_stream", "serve", "main", "MODEL"]

#: The model every answer names (the one the rest of the project's benchmarks use).
MODEL = "meta-llama/Llama-3.1-70B-Instruct"

_MAX_HEAD = 64 * 1024  # bytes of request line + headers before 431
_MIN_READ = 64 * 1024  # free buffer space offered to each read
_CHAT_PATHS = ("/v1/chat/completions", "/invocations")
_INFO_PATHS = ("/info", "/model_info", "/get_model_info", "/server_info", "/get_server_info")
_GET_PATHS = ("/health", "/ping", "/health_generate", "/v1/models", "/metrics", "/stats", *_INFO_PATHS)
_REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed",
            413: "Payload Too Large", 431: "Request Header Fields Too Large", 501: "Not Implemented"}


@dataclass(frozen=True)
class BackendOptions:
    """How the backend answers.

    Attributes:
        stream_chunks: ``data: {...}`` events per streamed answer (``[DONE]`` not counted).
        stream_delay_s: seconds between two events of a stream (0: written back to back).
        record_bodies: count request bodies by digest for ``GET /stats``.
        completion_tokens: tokens the canned answers claim in ``usage``.
        max_body_bytes: largest request body accepted (413 beyond).
    """

    stream_chunks: int = 8
    stream_delay_s: float = 0.0
    record_bodies: bool = False
    completion_tokens: int = 16
    max_body_bytes: int = 64 * 1024 * 1024


@dataclass
class BackendStats:
    """Counters served by ``GET /stats`` (only generation requests are counted)."""

    requests: int = 0
    by_path: dict[str, int] = field(default_factory=dict)
    by_port: dict[int, int] = field(default_factory=dict)
    streams_open: int = 0
    streams_peak: int = 0
    streams_done: int = 0
    bodies: dict[str, int] = field(default_factory=dict)
    connections: int = 0
    connections_peak: int = 0
    unknown: dict[str, int] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"requests": self.requests, "by_path": self.by_path,
                "by_port": {str(k): v for k, v in sorted(self.by_port.items())},
                "streams_open": self.streams_open, "streams_peak": self.streams_peak,
                "streams_done": self.streams_done, "bodies": self.bodies,
                "connections": self.connections, "connections_peak": self.connections_peak,
                "unknown": self.unknown}


# -- canned answers (built once) ----------------------------------------------------------------


def _json(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


def _response(status: int, content_type: str, body: bytes, close: bool = False) -> bytes:
    head = (f"HTTP/1.1 {status} {_REASONS.get(status, 'Unknown')}\r\n"
            f"Content-Type: {content_type}\r\nContent-Length: {len(body)}\r\n"
            + ("Connection: close\r\n" if close else "") + "\r\n")
    return head.encode("latin-1") + body


def _http_chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


class _Canned:
    """Every answer as ready-to-write bytes."""

    def __init__(self, opts: BackendOptions, instance: str) -> None:
        created = int(time.time())
        n = opts.completion_tokens
        usage = {"prompt_tokens": 128, "completion_tokens": n, "total_tokens": 128 + n}
        text = " ".join(["token"] * n)
        self.chat = _response(200, "application/json", _json({
            "id": "chatcmpl-fast-backend", "object": "chat.completion", "created": created, "model": MODEL,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}],
            "usage": usage}))
        self.completion = _response(200, "application/json", _json({
            "id": "cmpl-fast-backend", "object": "text_completion", "created": created, "model": MODEL,
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": "stop"}], "usage": usage}))
        self.stream_head = (b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: no-cache\r\n"
                            b"Transfer-Encoding: chunked\r\n\r\n")
        self.chat_events = [_http_chunk(b"data: " + _json({
            "id": "chatcmpl-fast-backend", "object": "chat.completion.chunk", "created": created, "model": MODEL,
            "choices": [{"index": 0, "delta": ({"role": "assistant", "content": "token "} if i == 0
                                               else {"content": "token "}),
                         "finish_reason": "stop" if i == opts.stream_chunks - 1 else None}]}) + b"\n\n")
            for i in range(opts.stream_chunks)]
        self.completion_events = [_http_chunk(b"data: " + _json({
            "id": "cmpl-fast-backend", "object": "text_completion", "created": created, "model": MODEL,
            "choices": [{"index": 0, "text": "token ", "logprobs": None,
                         "finish_reason": "stop" if i == opts.stream_chunks - 1 else None}]}) + b"\n\n")
            for i in range(opts.stream_chunks)]
        self.done = _http_chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n"
        self.empty = _response(200, "text/plain; charset=utf-8", b"")
        self.models = _response(200, "application/json", _json({"object": "list", "data": [{
            "id": MODEL, "object": "model", "created": created, "owned_by": "fast-backend", "root": MODEL,
            "max_model_len": 131072}]}))
        self.info = _response(200, "application/json", _json({
            "instance_id": instance, "model": MODEL, "model_path": MODEL, "served_model_name": MODEL,
            "is_generation": True, "tokenizer_path": MODEL, "max_total_num_tokens": 1_000_000,
            "max_model_len": 131072}))
        self.continue_ = b"HTTP/1.1 100 Continue\r\n\r\n"


def _error(status: int, message: str, close: bool = False) -> bytes:
    return _response(status, "application/json", _json({"error": {
        "message": message, "type": "invalid_request_error", "code": status}}), close)


# -- the protocol ---------------------------------------------------------------------------------


class _App:
    """What every connection shares: options, canned answers, counters."""

    def __init__(self, opts: BackendOptions) -> None:
        self.opts = opts
        self.canned = _Canned(opts, "fast-backend")
        self.stats = BackendStats()
        self.logged_paths: set[str] = set()
        #: The engines' KV events (``--kv-events``: ``bench/kv_stand_in.py``), or ``None``.
        self.kv: Any = None


def wants_stream(body: bytes | bytearray, start: int = 0, end: int | None = None) -> bool:
    """Whether the JSON text ``body[start:end]`` has a ``"stream"`` key whose value is
    ``true`` (the last such key counts, as in a JSON parser; whitespace around the colon
    allowed). Scans from the end, where clients usually put it, and never parses."""
    end = len(body) if end is None else end
    i = body.rfind(b'"stream"', start, end)
    while i >= 0:
        k = i + 8
        while k < end and body[k] in b" \t\r\n":
            k += 1
        if k < end and body[k] == 0x3A:  # ':' : a key, not a string value
            k += 1
            while k < end and body[k] in b" \t\r\n":
                k += 1
            return body.startswith(b"true", k, end)
        i = body.rfind(b'"stream"', start, i)
    return False


class HTTPProtocol(asyncio.BufferedProtocol):
    """One client connection: parses requests out of the byte stream and answers them
    in order. Bytes are received straight into one growing buffer (no copy per read;
    a request's body is never copied unless ``record_bodies``). A slow stream
    (``stream_delay_s`` > 0) is written by a task; requests pipelined behind it wait in
    the buffer until it ends.

    ``buf[start:end]`` holds received bytes not yet consumed; ``body_start``,
    ``body_end`` and ``chunk_pos`` are indexes into ``buf``.
    """

    def __init__(self, app: _App, port: int) -> None:
        self.app = app
        self.port = port
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray(_MIN_READ * 4)
        self.start = 0
        self.end = 0
        self.head: tuple[str, str, str, dict[str, str]] | None = None
        self.body_start = 0
        self.body_end = 0  # Content-Length bodies: index just past the body
        self.chunked = False
        self.chunk_pos = 0  # chunked bodies: index of the next chunk-size line
        self.chunk_parts: list[bytes] = []
        self.chunk_total = 0
        self.busy: asyncio.Task[None] | None = None
        self.closing = False

    # asyncio callbacks

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        sock = transport.get_extra_info("socket")
        if sock is not None:  # events are small writes: never hold one back for an ACK (Nagle)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        st = self.app.stats
        st.connections += 1
        st.connections_peak = max(st.connections_peak, st.connections)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closing = True
        self.app.stats.connections -= 1
        if self.busy is not None:
            self.busy.cancel()

    def get_buffer(self, sizehint: int) -> memoryview:
        want = _MIN_READ
        if self.head is not None and not self.chunked:
            want = max(want, self.body_end - self.end)  # room for the rest of the body in one read
        if len(self.buf) - self.end < want:
            self._make_room(want)
        return memoryview(self.buf)[self.end:]

    def buffer_updated(self, nbytes: int) -> None:
        self.end += nbytes
        if self.busy is None:
            self._process()

    def _make_room(self, want: int) -> None:
        # The buffer is never resized in place (a memoryview handed out may still exist):
        # unread bytes move to the front, or into a new, larger buffer.
        shift, n = self.start, self.end - self.start
        if len(self.buf) - n >= want:
            self.buf[0:n] = self.buf[shift:self.end]
        else:
            new = bytearray(max(2 * len(self.buf), n + want))
            new[0:n] = self.buf[shift:self.end]
            self.buf = new
        self.start, self.end = 0, n
        self.body_start -= shift
        self.body_end -= shift
        self.chunk_pos -= shift

    # parsing

    def _process(self) -> None:
        while not self.closing and self.busy is None:
            if not self._next_request():
                return

    def _fail(self, status: int, message: str) -> None:
        assert self.transport is not None
        self.transport.write(_error(status, message, close=True))
        self.transport.close()
        self.closing = True

    def _next_request(self) -> bool:
        """Parse (and answer) the next complete request; False if it is not all here yet."""
        buf = self.buf
        if self.head is None:
            eoh = buf.find(b"\r\n\r\n", self.start, self.end)
            if eoh < 0:
                if self.end - self.start > _MAX_HEAD:
                    self._fail(431, "request head too large")
                return False
            lines = buf[self.start:eoh].decode("latin-1").split("\r\n")
            try:
                method, target, version = lines[0].split(" ", 2)
            except ValueError:
                self._fail(400, "malformed request line")
                return False
            headers: dict[str, str] = {}
            for line in lines[1:]:
                name, sep, value = line.partition(":")
                if not sep:
                    self._fail(400, "malformed header line")
                    return False
                headers[name.strip().lower()] = value.strip()
            self.start = self.body_start = eoh + 4
            if "chunked" in headers.get("transfer-encoding", "").lower():
                self.chunked = True
                self.chunk_pos = self.body_start
                self.chunk_parts = []
                self.chunk_total = 0
            else:
                try:
                    length = int(headers.get("content-length", "0"))
                except ValueError:
                    length = -1
                if length < 0:
                    self._fail(400, "invalid Content-Length")
                    return False
                if length > self.app.opts.max_body_bytes:
                    self._fail(413, "request body too large")
                    return False
                self.body_end = self.body_start + length
            self.head = (method, target, version, headers)
            if headers.get("expect", "").lower() == "100-continue" and self.transport is not None:
                self.transport.write(self.app.canned.continue_)
        if self.chunked:
            joined = self._dechunk()
            if joined is None:
                return False
            body: bytes | bytearray = joined
            bstart, bend = 0, len(joined)
        else:
            if self.end < self.body_end:
                return False
            body, bstart, bend = buf, self.body_start, self.body_end
            self.start = self.body_end
        head, self.head, self.chunked = self.head, None, False
        # The body stays in the buffer until the next read: _handle looks at it in place.
        self._handle(head, body, bstart, bend)
        if self.start == self.end and self.head is None:
            self.start = self.end = 0
        return True

    def _dechunk(self) -> bytes | None:
        """Advance through a chunked body; the whole body once its last chunk and trailers
        arrived, else None (the chunks parsed so far are kept)."""
        buf = self.buf
        while True:
            eol = buf.find(b"\r\n", self.chunk_pos, self.end)
            if eol < 0:
                if self.end - self.chunk_pos > 4096:
                    self._fail(400, "malformed chunk size line")
                return None
            size_text = bytes(buf[self.chunk_pos:eol]).split(b";", 1)[0].strip()
            try:
                size = int(size_text, 16)
            except ValueError:
                self._fail(400, "malformed chunk size")
                return None
            data_start = eol + 2
            if size == 0:
                if self.end - data_start >= 2 and buf[data_start:data_start + 2] == b"\r\n":
                    last = data_start + 2
                else:  # trailer fields, ended by an empty line
                    t = buf.find(b"\r\n\r\n", data_start - 2, self.end)
                    if t < 0:
                        return None
                    last = t + 4
                self.start = self.chunk_pos = last
                return b"".join(self.chunk_parts)
            if self.end < data_start + size + 2:
                return None
            if buf[data_start + size:data_start + size + 2] != b"\r\n":
                self._fail(400, "chunk data not followed by CRLF")
                return None
            self.chunk_total += size
            if self.chunk_total > self.app.opts.max_body_bytes:
                self._fail(413, "request body too large")
                return None
            self.chunk_parts.append(bytes(buf[data_start:data_start + size]))
            self.start = self.chunk_pos = data_start + size + 2

    # answering

    def _handle(self, head: tuple[str, str, str, dict[str, str]], body: bytes | bytearray, bstart: int,
                bend: int) -> None:
        method, target, version, headers = head
        conn = headers.get("connection", "").lower()
        keep_alive = ("close" not in conn) if version == "HTTP/1.1" else ("keep-alive" in conn)
        path = target.split("?", 1)[0]
        app, t = self.app, self.transport
        assert t is not None
        canned = app.canned
        if path in _CHAT_PATHS or path == "/v1/completions":
            if method != "POST":
                t.write(_error(405, f"{method} {path}: use POST"))
            else:
                st = app.stats
                st.requests += 1
                st.by_path[path] = st.by_path.get(path, 0) + 1
                st.by_port[self.port] = st.by_port.get(self.port, 0) + 1
                if app.opts.record_bodies:
                    d = xxhash.xxh3_64_hexdigest(bytes(body[bstart:bend]))
                    st.bodies[d] = st.bodies.get(d, 0) + 1
                chat = path != "/v1/completions"
                if app.kv is not None:
                    app.kv.on_request(self.port, bytes(body[bstart:bend]), chat)
                if wants_stream(body, bstart, bend):
                    events = canned.chat_events if chat else canned.completion_events
                    if app.opts.stream_delay_s > 0:
                        self.busy = asyncio.get_running_loop().create_task(self._slow_stream(events, keep_alive))
                        return
                    st.streams_open += 1
                    st.streams_peak = max(st.streams_peak, st.streams_open)
                    t.write(canned.stream_head)
                    for ev in events:  # one write per event, as an engine emits them
                        t.write(ev)
                    t.write(canned.done)
                    st.streams_open -= 1
                    st.streams_done += 1
                else:
                    t.write(canned.chat if chat else canned.completion)
        elif path in _GET_PATHS:
            if method != "GET":
                t.write(_error(405, f"{method} {path}: use GET"))
            else:
                self._log_once(f"GET {path}")
                if path == "/v1/models":
                    t.write(canned.models)
                elif path == "/metrics":
                    t.write(_response(200, "text/plain; version=0.0.4; charset=utf-8", (
                        "# HELP fast_backend_requests_total Generation requests answered.\n"
                        "# TYPE fast_backend_requests_total counter\n"
                        f"fast_backend_requests_total {app.stats.requests}\n").encode()))
                elif path in _INFO_PATHS:
                    t.write(canned.info)
                elif path == "/stats":
                    doc = app.stats.to_json()
                    if app.kv is not None:
                        doc["kv_events"] = app.kv.stats()
                    t.write(_response(200, "application/json", _json(doc)))
                else:
                    t.write(canned.empty)
        else:
            key = f"{method} {path}"[:200]
            app.stats.unknown[key] = app.stats.unknown.get(key, 0) + 1
            self._log_once(f"{key} (unknown: 404)")
            t.write(_error(404, f"no route {method} {path}"))
        if not keep_alive:
            t.close()
            self.closing = True

    def _log_once(self, what: str) -> None:
        if what not in self.app.logged_paths:
            self.app.logged_paths.add(what)
            print(f"fast-backend: first {what} (port {self.port})", file=sys.stderr, flush=True)

    async def _slow_stream(self, events: Sequence[bytes], keep_alive: bool) -> None:
        t, st, canned = self.transport, self.app.stats, self.app.canned
        assert t is not None
        st.streams_open += 1
        st.streams_peak = max(st.streams_peak, st.streams_open)
        try:
            t.write(canned.stream_head)
            for i, ev in enumerate(events):
                if i:
                    await asyncio.sleep(self.app.opts.stream_delay_s)
                t.write(ev)
            t.write(canned.done)
            st.streams_done += 1
        except asyncio.CancelledError:
            return  # the client went away
        finally:
            st.streams_open -= 1
            self.busy = None
        if not keep_alive:
            t.close()
            self.closing = True
        elif self.end > self.start:
            self._process()


# -- running ------------------------------------------------------------------------------------


def raise_nofile_limit() -> int:
    """Raise RLIMIT_NOFILE's soft limit to its hard limit (children inherit it); returns
    the soft limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY:
        try:
            with open("/proc/sys/fs/nr_open") as f:
                hard = int(f.read())
        except (OSError, ValueError):
            hard = 1 << 20
    if soft == resource.RLIM_INFINITY or soft >= hard:
        return soft
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
    except (ValueError, OSError):
        return soft
    return hard


async def serve(host: str, ports: Sequence[int], opts: BackendOptions,
                app: "_App | None" = None) -> tuple[list[asyncio.Server], list[int]]:
    """Listen on every port of ``ports`` (0 picks a free one) with one shared state
    (``app``, or a new one).

    Returns:
        The servers and the ports they listen on, in order.

    Raises:
        OSError: a port cannot be bound.
    """
    app = _App(opts) if app is None else app
    loop = asyncio.get_running_loop()
    servers, bound = [], []
    for port in ports:
        holder: list[int] = [port]
        server = await loop.create_server(lambda h=holder: HTTPProtocol(app, h[0]), host, port, backlog=4096,
                                          reuse_address=True)
        holder[0] = server.sockets[0].getsockname()[1]
        servers.append(server)
        bound.append(holder[0])
    return servers, bound


#: Exit code when a port cannot be bound (in use, or not allowed).
EXIT_CANNOT_LISTEN = 3


async def _run(args: argparse.Namespace) -> int:
    opts = BackendOptions(stream_chunks=args.stream_chunks, stream_delay_s=args.stream_delay_ms / 1000.0,
                          record_bodies=args.record_bodies)
    try:
        app = _App(opts)
        servers, ports = await serve(args.host, args.port or [0], opts, app)
    except OSError as exc:  # (a port taken: said in one line the bench reads, exit code 3)
        print(f"fast-backend: cannot listen on {args.host} port(s) {', '.join(map(str, args.port)) or '0'}: "
              f"{exc.strerror or exc}", file=sys.stderr, flush=True)
        return EXIT_CANNOT_LISTEN
    kv = None
    if args.kv_events:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from kv_stand_in import KvStandIn

        kv = KvStandIn(ports, step_s=args.kv_events_step_ms / 1000.0)
        await kv.start()
        app.kv = kv
        for p in ports:
            pub, replay = kv.endpoints[p]
            print(f"fast-backend kv events of http://{args.host}:{p} on {pub} replay {replay}", flush=True)
    for p in ports:
        print(f"fast-backend listening on http://{args.host}:{p}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    for s in servers:
        s.close()
    if kv is not None:
        await kv.close()
    return 0


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python bench/fast_backend.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    p.add_argument("--port", type=int, action="append", default=[],
                   help="port to listen on, 0 for a free one; repeat to listen on several ports, each "
                        "standing for one engine instance (default: one free port)")
    p.add_argument("--stream-chunks", type=int, default=8,
                   help="data events per streamed answer, before data: [DONE] (default: 8)")
    p.add_argument("--stream-delay-ms", type=float, default=0.0,
                   help="milliseconds between two events of a stream (default: 0, all written at once)")
    p.add_argument("--kv-events", action="store_true",
                   help="publish KV events per port, as a vLLM engine with a warm, full prefix cache would "
                        "(bench/kv_stand_in.py; the precise extra): prints 'fast-backend kv events of URL on "
                        "PUB-ENDPOINT replay REPLAY-ENDPOINT' per port")
    p.add_argument("--kv-events-step-ms", type=float, default=20.0,
                   help="with --kv-events: milliseconds between two published batches per port (default: 20, "
                        "an engine step)")
    p.add_argument("--record-bodies", action="store_true",
                   help="count request bodies by xxh3-64 digest in GET /stats (costs a hash per request)")
    args = p.parse_args(argv)
    if not args.kv_events_step_ms > 0:
        p.error("--kv-events-step-ms must be > 0")
    if args.kv_events_step_ms != 20.0 and not args.kv_events:
        p.error("--kv-events-step-ms needs --kv-events")
    if args.stream_chunks < 1 or not args.stream_delay_ms >= 0 or any(not 0 <= x <= 65535 for x in args.port):
        p.error("--stream-chunks must be >= 1, --stream-delay-ms >= 0 and ports within 0-65535")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    raise_nofile_limit()
    try:
        import uvloop
    except ImportError:  # uvloop is a project dependency except on Windows
        return asyncio.run(_run(args))
    return uvloop.run(_run(args))


if __name__ == "__main__":
    sys.exit(main())
