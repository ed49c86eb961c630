"""``prefixroute serve --access-log PATH``: one JSON object per line per request.

A line is written when a request ends (:meth:`prefixroute.server.observe.Observers.finished`
and ``refused``), for every request to an inference route, the router's own refusals
(400, 404, 413, 429...) included. Fields (``null`` when not known)::

    {"time": "2026-12-04T14:02:03.123Z", "request_id": "...", "trace_id": "32 hex",
     "api": "openai" | "native" | "native_stream", "endpoint": "...", "variant": "...",
     "instance": "http://...", "decision": "affinity" | "overflow" | ..., "key": "16 hex",
     "client": "API key name", "tenant": "...", "status": 200 | 499 | "stream_aborted",
     "ttft_ms": 12.3, "duration_ms": 456.7, "bytes_in": 1234, "bytes_out": 5678,
     "retries": 0, "error": "reset" | ...}

``time`` is when the request ended (UTC); ``key`` is the 64-bit routing key
(PREFIX_AWARE) or the chained digest of the routing text's blocks (CACHE_AWARE): a
digest, equal for requests routed on the same prefix, from which no text can be read;
``bytes_in`` is the request body as forwarded (decoded if it came compressed);
``bytes_out`` the answer body relayed. **Prompt text is never written**, whatever the
log level (``--log-prompts`` only affects DEBUG lines of the ordinary log).

Lines go to a file opened for appending (``-`` is standard output) through a buffer
flushed at least every :data:`FLUSH_S` seconds and when the router stops; each write
holds whole lines only, at most :data:`MAX_WRITE` bytes (atomic on a pipe), so the
lines of several ``--workers`` appending to one file or pipe never interleave. A write
error is logged once and the access log stops; it never fails a request.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import time
from typing import Any

import orjson

__all__ = ["AccessLog", "FLUSH_S", "MAX_WRITE"]

log = logging.getLogger("prefixroute.server")

#: Longest a line waits in the buffer, seconds.
FLUSH_S = 0.5
#: Largest single write, bytes (PIPE_BUF on Linux: a write to a pipe of at most this
#: many bytes is atomic).
MAX_WRITE = 4096
#: Buffered bytes that trigger a write at once.
_HIGH_WATER = 64 * 1024


def _iso(t: float) -> str:
    """``t`` (Unix seconds) as ISO 8601 UTC with milliseconds."""
    secs = int(t)
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(secs)) + f".{int((t - secs) * 1000):03d}Z"


class AccessLog:
    """Appends JSON lines to ``path`` (``-``: standard output).

    Raises:
        OSError: the file cannot be opened.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        if path == "-":
            self._fd = sys.stdout.fileno()
            self._owned = False
        else:
            self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            self._owned = True
        self._lines: list[bytes] = []
        self._size = 0
        self._timer: asyncio.TimerHandle | None = None
        self._broken = False
        self.lines_written = 0

    def write(self, entry: dict[str, Any]) -> None:
        """Queue one line (``entry`` as JSON); written within :data:`FLUSH_S` seconds."""
        if self._broken:
            return
        line = orjson.dumps(entry) + b"\n"
        self._lines.append(line)
        self._size += len(line)
        if self._size >= _HIGH_WATER:
            self.flush()
        elif self._timer is None:
            try:
                self._timer = asyncio.get_running_loop().call_later(FLUSH_S, self._flush_timer)
            except RuntimeError:  # no loop (a test calling it directly): write now
                self.flush()

    def _flush_timer(self) -> None:
        self._timer = None
        self.flush()

    def flush(self) -> None:
        """Write what is buffered, in writes of whole lines of at most :data:`MAX_WRITE`
        bytes (a longer line alone)."""
        lines, self._lines, self._size = self._lines, [], 0
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        chunk: list[bytes] = []
        size = 0
        try:
            for line in lines:
                if chunk and size + len(line) > MAX_WRITE:
                    self._write_all(b"".join(chunk))
                    chunk, size = [], 0
                chunk.append(line)
                size += len(line)
            if chunk:
                self._write_all(b"".join(chunk))
            self.lines_written += len(lines)
        except OSError as exc:
            self._broken = True
            log.error("access log %s: write failed, the access log stops: %s", self.path, exc)

    def _write_all(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            n = os.write(self._fd, view)
            view = view[n:]

    def close(self) -> None:
        """Write what is buffered and close the file (standard output stays open)."""
        self.flush()
        self._broken = True
        if self._owned:
            os.close(self._fd)


def access_entry(*, t_end_wall: float, request_id: str | None, trace_id: str | None, api: str | None,
                 endpoint: str, variant: str | None, instance: str | None, decision: str | None,
                 key: str | None, client: str | None, tenant: str | None, status: int | str,
                 ttft_s: float | None, duration_s: float, bytes_in: int | None, bytes_out: int, retries: int,
                 error: str | None) -> dict[str, Any]:
    """One access log line as a dict (see the module docstring for the fields)."""
    return {"time": _iso(t_end_wall), "request_id": request_id, "trace_id": trace_id, "api": api,
            "endpoint": endpoint, "variant": variant or None, "instance": instance, "decision": decision,
            "key": key, "client": client, "tenant": tenant, "status": status,
            "ttft_ms": round(ttft_s * 1000, 3) if ttft_s is not None else None,
            "duration_ms": round(duration_s * 1000, 3), "bytes_in": bytes_in, "bytes_out": bytes_out,
            "retries": retries, "error": error}
