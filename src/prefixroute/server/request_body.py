"""Request bodies on both data planes: the Content-Encodings decoded (strict gzip and
deflate, at most ``--max-body-size`` of output) and the Transfer-Encodings understood,
the errors a body can end in (too large, not decoded, stopped arriving), and
:func:`read_body`, the aiohttp app's reader, with the connections whose body is still
arriving closed when the app shuts down.

The fast data plane reads a body itself (:mod:`prefixroute.server.client`) and decodes
it here, as do the admin listeners and the Envoy picker;
:func:`prefixroute.server.app.prepare_inference` turns each error into its answer in
the API's shape.
"""

from __future__ import annotations

import asyncio
import zlib
from typing import Any

from aiohttp import web

__all__ = ["DECODED_CODINGS", "ACCEPTED_CODINGS", "BodyNotDecoded", "BodyTimedOut", "BodyTooLarge", "RECEIVING",
           "close_receiving", "close_receiving_on_shutdown", "coding_refusal", "decode_request_body", "read_body",
           "request_coding", "transfer_coding", "transfer_refused"]


#: The request Content-Encodings decoded, one coding per request, by
#: :func:`decode_request_body` on both data planes (the aiohttp app runs with its own
#: decompression off): gzip and deflate; ``identity`` (or an empty value) is the body as
#: is. Any other value is a 415 (RFC 9110 §15.5.16) with ``Accept-Encoding`` naming
#: these, instead of a body forwarded still encoded without its Content-Encoding.
DECODED_CODINGS = frozenset({"identity", "gzip", "deflate"})
#: A 415's ``Accept-Encoding``: the codings decoded, besides identity.
ACCEPTED_CODINGS = ", ".join(sorted(DECODED_CODINGS - {"identity"}))

#: Most gzip members one body may hold (aiohttp has a cap too): each costs a decoder.
_MAX_GZIP_MEMBERS = 1024
#: Input fed to the decoder at a time: what is left over when a gzip member ends is at
#: most this much (``unused_data`` is a copy), so many members cost linear time.
_DECODE_SLICE = 64 * 1024


def request_coding(headers: Any) -> str | None:
    """The request's Content-Encoding as one normalised value: every field line's value
    joined with ", " (RFC 9110 §5.3: two lines are a list of two codings), without the
    surrounding spaces and tabs, lower-cased; ``"identity"`` for none or an empty value,
    ``"gzip"`` for ``x-gzip`` (RFC 9110 §8.4.1.3: the same coding); ``None`` if it is not
    ASCII (no decoder reads it). ``headers``: a ``CIMultiDict`` or
    :class:`~prefixroute.server.headers.RawHeaderView` (anything with ``getall``)."""
    value = ", ".join(headers.getall("Content-Encoding", []))
    if not value.isascii():
        return None
    value = value.strip(" \t").lower()
    return "gzip" if value == "x-gzip" else value or "identity"


def coding_refusal(headers: Any) -> str | None:
    """The message of the 415 for a request whose Content-Encoding is not one
    :data:`DECODED_CODINGS` names, or ``None`` if it is (what the 415's
    ``Accept-Encoding`` lists is :data:`ACCEPTED_CODINGS`)."""
    if request_coding(headers) in DECODED_CODINGS:
        return None
    shown = ", ".join(headers.getall("Content-Encoding", []))
    return (f"Content-Encoding {shown[:64]!r} is not supported: send the body as is, or in one of "
            f"{ACCEPTED_CODINGS}")


def transfer_coding(headers: Any) -> str:
    """The request's Transfer-Encoding as one normalised value (read as
    :func:`request_coding` reads Content-Encoding; ``""`` for none)."""
    value = ", ".join(headers.getall("Transfer-Encoding", []))
    return value.strip(" \t").lower() if value.isascii() else value


def transfer_refused(headers: Any) -> bool:
    """Whether the request's Transfer-Encoding is one we do not understand (anything but
    none or ``chunked``): the HTTP parsers frame ``gzip, chunked`` as chunked and would
    pass the body on still gzipped, so it is a 501 (RFC 9112 §6.1). The one test both
    data planes apply."""
    return transfer_coding(headers) not in ("", "chunked")


def decode_request_body(data: bytes, coding: str, limit: int) -> bytes | BodyTooLarge | BodyNotDecoded:
    """``data`` decoded from ``coding``, at most ``limit`` bytes of it.

    ``gzip``: one or more members (RFC 1952); ``deflate``: zlib-wrapped (RFC 1950) or
    raw (RFC 1951), as aiohttp and browsers take it. Strict where aiohttp is not: a
    truncated stream, a bad checksum or bytes after the end are :class:`BodyNotDecoded`
    (aiohttp passes a gzip body cut short on as the part that decoded). Decoding stops
    as soon as the output passes ``limit`` (:class:`BodyTooLarge`: a decompression
    bomb costs at most ``limit`` bytes). An empty ``data`` is an empty body.
    """
    if not data:
        return b""
    view = memoryview(data)
    out: list[bytes] = []
    size = pos = 0
    wbits = 31 if coding == "gzip" else (15 if data[0] & 0x0F == 8 else -15)
    d = zlib.decompressobj(wbits)
    members = 1
    left: bytes | memoryview = b""  # input after the end of a gzip member, not fed yet
    try:
        while True:
            if left:
                feed, left = left, b""
            elif pos < len(view):
                feed = view[pos:pos + _DECODE_SLICE]
                pos += len(feed)
            else:
                break
            chunk = d.decompress(feed, limit + 1 - size)  # (output capped: a bomb stops at the limit)
            size += len(chunk)
            if size > limit:
                return BodyTooLarge(limit, None, decoded=True)
            out.append(chunk)
            if d.eof:
                left = d.unused_data
                if left or pos < len(view):  # more after the end
                    if coding != "gzip" or members == _MAX_GZIP_MEMBERS:
                        return BodyNotDecoded(coding)
                    d = zlib.decompressobj(wbits)  # the next gzip member
                    members += 1
    except zlib.error:
        return BodyNotDecoded(coding)
    if not d.eof:
        return BodyNotDecoded(coding)  # cut short
    return b"".join(out)


class BodyNotDecoded(Exception):
    """A request body its Content-Encoding does not decode (e.g. broken gzip data)."""

    def __init__(self, coding: str) -> None:
        super().__init__(f"the request body is not valid {coding[:64]} data (its Content-Encoding)")


class BodyTooLarge(Exception):
    """A request body over ``--max-body-size`` (declared, or found while reading or
    decoding it)."""

    def __init__(self, limit: int, size: int | None, decoded: bool = False) -> None:
        got = f"{size:,} bytes" if size is not None else (
            "decoded from its Content-Encoding, it went past it" if decoded else "a chunked body went past it")
        super().__init__(f"request body too large ({got}); the limit is {limit:,} bytes (--max-body-size)")


class BodyTimedOut(Exception):
    """The client sent nothing of its request body for ``idle_s`` seconds."""

    def __init__(self, idle_s: float) -> None:
        super().__init__(f"the request stopped arriving: nothing for {idle_s:g} s "
                         "(--client-keepalive-timeout)")


class _Receiving:
    """The connections of one aiohttp application whose request body is still arriving
    (in :func:`read_body`), and whether the application is shutting down."""

    __slots__ = ("conns", "closed")

    def __init__(self) -> None:
        self.conns: set[Any] = set()  # (aiohttp's RequestHandler takes no weak reference)
        self.closed = False


RECEIVING = web.AppKey("prefixroute_receiving", _Receiving)


def close_receiving_on_shutdown(app: web.Application) -> None:
    """When ``app`` shuts down, close at once the connections whose request body is
    still arriving (and any that starts arriving after): their requests reached no
    instance, and a client stalled mid-body would otherwise hold the shutdown for up to
    ``--shutdown-timeout`` (aiohttp waits for every handler). Requests already read
    still finish. Serve ``app`` with ``handler_cancellation=True``."""
    app[RECEIVING] = _Receiving()
    app.on_shutdown.append(close_receiving)


async def close_receiving(app: web.Application) -> None:
    """Close now the connections of ``app`` whose request body is still arriving, and
    any that starts arriving from now on (what ``app`` does when it shuts down, if
    :func:`close_receiving_on_shutdown` was called on it; else nothing)."""
    receiving = app.get(RECEIVING)
    if receiving is None:
        return
    receiving.closed = True
    for conn in list(receiving.conns):
        conn.force_close()


async def read_body(request: web.Request, limit: int,
                    idle_s: float | None = None) -> bytes | BodyTooLarge | BodyNotDecoded | BodyTimedOut:
    """The whole body, at most ``limit`` bytes (a chunked body is de-chunked, a
    compressed one decoded by :func:`decode_request_body`: the app runs with aiohttp's
    decompression off), or the :class:`BodyTooLarge` error if its declared, actual or
    decoded size is over ``limit``, or :class:`BodyNotDecoded` if its Content-Encoding
    does not decode it (the coding itself was checked before the body was read), or
    :class:`BodyTimedOut` if ``idle_s`` seconds pass without a byte of it (a client
    that stalls mid-body; aiohttp itself would wait for ever)."""
    declared = request.content_length
    if declared is not None and declared > limit:
        return BodyTooLarge(limit, declared)
    receiving = request.app.get(RECEIVING)
    if receiving is not None:
        conn = request.protocol
        if receiving.closed:  # shutting down: the request is not read, let alone routed
            conn.force_close()
            raise asyncio.CancelledError()  # (what the lost connection does to the handler)
        receiving.conns.add(conn)
    try:
        if idle_s is None:
            body = await request.read()
        else:
            loop = asyncio.get_running_loop()
            parts: list[bytes] = []
            size = 0
            async with asyncio.timeout(idle_s) as deadline:
                while chunk := await request.content.readany():
                    size += len(chunk)
                    if size > limit:
                        return BodyTooLarge(limit, None)
                    parts.append(chunk)
                    deadline.reschedule(loop.time() + idle_s)
            body = b"".join(parts)
    except web.HTTPRequestEntityTooLarge:
        return BodyTooLarge(limit, None)
    except TimeoutError:
        assert idle_s is not None
        return BodyTimedOut(idle_s)
    finally:
        if receiving is not None:
            receiving.conns.discard(request.protocol)
    coding = request_coding(request.headers)
    return decode_request_body(body, coding, limit) if coding in ("gzip", "deflate") else body
