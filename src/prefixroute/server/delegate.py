"""The fast data plane's hand-over of what it does not serve itself (``GET /metrics``,
``/health``, ``/v1/models``, HTTP/1.0, unknown paths...) to the aiohttp app on the
private Unix socket, relayed unchanged but for its framing."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from prefixroute.server.client import _Client, _ClientGone, _Incoming
from prefixroute.server.http11 import _FRAMING, _head, _reason
from prefixroute.server.upstream import _Upstream, _UpstreamLost

if TYPE_CHECKING:
    from prefixroute.server.dataplane import FrontServer

__all__ = ["delegate"]

log = logging.getLogger("prefixroute.server.dataplane")


async def delegate(front: "FrontServer", client: _Client, inc: _Incoming) -> None:
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
        up = await front.internal_pool.get(front.internal, 10.0)
        up.no_body = inc.method == b"HEAD"
        up.send(b"".join(parts), body)
        await front._await(client, up.headers_fut, None)
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
        await front._await(client, up.done, None)
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
