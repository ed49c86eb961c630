"""The aiohttp data plane's pooled client to the instances: one ``ClientSession`` whose
connector checks a kept-alive connection before reusing it (:class:`PoolConnector`),
tells the request's task whether the connection it got was reused, and opens a new one
when an attempt asks for it; :func:`peer_closed`, the same check for the fast plane's
raw connections."""

from __future__ import annotations

import asyncio
import contextvars
import select
import weakref
from typing import Any

import aiohttp

from prefixroute.server.settings import ServerSettings

__all__ = ["PoolConnector", "make_client_session", "peer_closed", "REUSED_CONNECTION", "FRESH_CONNECTION"]

_POLLER = select.poll()  # one poll object, one fd registered at a time (the loop's thread only)


def peer_closed(transport: asyncio.BaseTransport | None) -> bool:
    """True if the peer already closed (or reset) this idle connection: its socket is
    readable (end-of-file, an error, or bytes nobody asked for) though no request is
    outstanding on it. One ``poll`` with a zero timeout: no syscall that reads."""
    if transport is None or transport.is_closing():
        return True
    sock = transport.get_extra_info("socket")
    if sock is None:
        return False
    try:
        fd = sock.fileno()
        _POLLER.register(fd, select.POLLIN | select.POLLPRI)
    except (OSError, ValueError):
        return True
    try:
        return bool(_POLLER.poll(0))
    finally:
        _POLLER.unregister(fd)


#: Whether the connection the current task's last upstream request went out on was a
#: kept-alive one (set by :class:`PoolConnector`, read by :func:`forward`).
REUSED_CONNECTION: contextvars.ContextVar[bool] = contextvars.ContextVar("REUSED_CONNECTION", default=False)
#: Set by :func:`forward` for an attempt that must go out on a new connection (a
#: kept-alive one just failed): :class:`PoolConnector` then closes pooled ones it is given.
FRESH_CONNECTION: contextvars.ContextVar[bool] = contextvars.ContextVar("FRESH_CONNECTION", default=False)


class PoolConnector(aiohttp.TCPConnector):
    """A ``TCPConnector`` that checks a pooled keep-alive connection before reusing it.

    aiohttp drops pooled connections whose close it has already processed; an instance
    may have closed one an instant before (its keep-alive timer fired) without the event
    loop having seen it yet. Such a connection is found dead here, before anything is
    written on it, closed, and another one taken, so the request is never lost to the
    keep-alive race.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._handed_out: weakref.WeakSet[Any] = weakref.WeakSet()  # protocols used before

    async def connect(self, *args: Any, **kwargs: Any) -> aiohttp.connector.Connection:
        for _ in range(8):
            conn = await super().connect(*args, **kwargs)
            proto = conn.protocol
            reused = proto in self._handed_out
            if reused and FRESH_CONNECTION.get():
                conn.close()  # (not kept: the attempt wants a connection of its own)
                continue
            REUSED_CONNECTION.set(reused)  # (the request's task: forward() reads it after a failure)
            self._handed_out.add(proto)
            transport = conn.transport
            # Only idle pooled plain-TCP connections are checked: a fresh one is alive by
            # construction, and a TLS one may hold bytes (session tickets) that are not
            # a close; aiohttp's own check covers those.
            if not reused or transport is None or transport.get_extra_info("sslcontext") is not None \
                    or not peer_closed(transport):
                return conn
            conn.close()
        return conn


def make_client_session(settings: ServerSettings) -> aiohttp.ClientSession:
    """The one pooled client shared by all requests (keep-alive, bounded connections).

    Bodies are relayed undecoded (``auto_decompress=False``) and aiohttp adds no
    headers of its own (``User-Agent``, ``Accept``...): the instance sees the client's.
    Only the connect timeout is set here; :func:`forward` applies the response-headers
    and stream-idle timeouts itself, as they differ.
    """
    connector = PoolConnector(
        limit=settings.max_connections,
        limit_per_host=0,
        keepalive_timeout=settings.keepalive_timeout_s,
        ttl_dns_cache=60,
    )
    timeout = aiohttp.ClientTimeout(total=None, connect=None, sock_connect=settings.connect_timeout_s, sock_read=None)
    return aiohttp.ClientSession(
        connector=connector,
        timeout=timeout,
        auto_decompress=False,
        skip_auto_headers=("User-Agent", "Accept", "Content-Type"),
        trust_env=False,
    )
