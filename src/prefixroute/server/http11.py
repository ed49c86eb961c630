"""HTTP/1.1 on the wire for the fast data plane: answer heads (status line, fields,
``Date`` once a second, framing), an aiohttp error response as bytes, the fields never
relayed as they are (hop-by-hop and framing, RFC 9110 §7.6.1)."""

from __future__ import annotations

import email.utils
import http
import time

from aiohttp import web

from prefixroute.server import headers as H

__all__ = ["_head", "_reason", "_field", "_serialize", "_FRAMING", "_DATE"]

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
