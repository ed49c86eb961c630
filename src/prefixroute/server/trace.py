"""``prefixroute serve --record-trace PATH``: record routed requests for the tuning advisor.

One JSONL line per request, in the format of :mod:`prefixroute.workloads.traces`
(``prefixroute-trace/2``): arrival time, endpoint and production variant, the instance
and the router's decision, the length of the text the routing key is cut from and
**chained xxh3-64 digests of its successive 64-character blocks** (64 bytes on the
native API, 64 token ids for a token prompt), packed in base64. The digests let
``prefixroute tune`` recompute the key of every request for any PrefixLength that is a
multiple of 64, and rebuild which requests share which prefix, without the text:
**prompt text is never written**, and the tenant id is stored as a digest.

A line is made when a request ends (:meth:`prefixroute.server.observe.Observers.finished`,
on both data planes), so the file is in order of completion (``load_trace`` sorts by
arrival), and is on disk within :data:`FLUSH_S` seconds, not only at shutdown. A line
takes about 0.17 bytes per character of routing text plus about 330 bytes of fields
(:attr:`TraceRecorder.bytes_written` / :attr:`TraceRecorder.records` is reported on the
status page and logged when the router stops). A recording error is logged once and
recording stops; it never fails a request.
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

import orjson

from prefixroute.core.keys import loads_body, openai_tenant, validate_tenant_id
from prefixroute.core.openai_routes import OpenAIRoute
from prefixroute.core.routing_text import InvalidRequest, completion_prompt, render_chat_text
from prefixroute.server import headers as H
from prefixroute.server.routes import Api
from prefixroute.workloads.traces import make_trace_record

if TYPE_CHECKING:
    from prefixroute.server.proxy import RoutedRequest

__all__ = ["TraceRecorder", "FLUSH_S"]

log = logging.getLogger("prefixroute.server.trace")

#: Longest a line waits in the buffer before it is written, seconds.
FLUSH_S = 1.0


class TraceRecorder:
    """Appends trace lines to a file.

    Args:
        path: the JSONL file; created if missing, appended to otherwise.

    Raises:
        OSError: the file cannot be opened.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._fh: IO[bytes] | None = self.path.open("ab", buffering=1 << 16)
        self._timer: asyncio.TimerHandle | None = None
        self.records = 0
        self.bytes_written = 0

    def _write(self, record: dict[str, Any]) -> None:
        if self._fh is None:
            return
        try:
            line = orjson.dumps(record) + b"\n"
            self._fh.write(line)
            self.records += 1
            self.bytes_written += len(line)
        except (OSError, ValueError) as exc:
            log.error("trace recording to %s failed, recording stops: %s", self.path, exc)
            self.close()
            return
        if self._timer is None:
            try:
                self._timer = asyncio.get_running_loop().call_later(FLUSH_S, self.flush)
            except RuntimeError:
                self.flush()

    def flush(self) -> None:
        """Write the buffered lines to the file."""
        self._timer = None
        if self._fh is not None:
            try:
                self._fh.flush()
            except OSError as exc:
                log.error("trace recording to %s failed, recording stops: %s", self.path, exc)
                self.close()

    def close(self) -> None:
        """Flush and close; later records are dropped. Logs the size per request."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._fh is not None:
            try:
                self._fh.close()
            finally:
                self._fh = None
                if self.records:
                    log.info("trace %s: %d requests recorded, %d bytes (%.0f bytes per request)", self.path,
                             self.records, self.bytes_written, self.bytes_written / self.records)

    def stats(self) -> dict[str, Any]:
        """``{"path", "records", "bytes", "bytes_per_request"}`` since the router started."""
        return {"path": str(self.path), "records": self.records, "bytes": self.bytes_written,
                "bytes_per_request": self.bytes_written / self.records if self.records else None}

    def record(self, rr: "RoutedRequest") -> None:
        """Record ``rr`` (ended), if it carries something routable (a request answered
        with an error before any instance was chosen for it is not recorded)."""
        decision = rr.record.decision
        if decision is None:
            return
        arrival = time.time() - (time.perf_counter() - rr.t0)
        try:
            if rr.api is Api.OPENAI:
                if rr.route not in (OpenAIRoute.CHAT, OpenAIRoute.COMPLETIONS):
                    return  # a trace replays chat and completions only
                payload = loads_body(rr.body)
                if not isinstance(payload, dict):
                    return
                chat = rr.route is OpenAIRoute.CHAT
                data: Any = render_chat_text(payload) if chat else completion_prompt(payload)
                tenant = openai_tenant(payload, validate_tenant_id(rr.headers.get(H.PREFIX_AWARE_ID)))
                max_tokens = payload.get("max_completion_tokens", payload.get("max_tokens"))
                fields = {"api": "openai-chat" if chat else "openai-completions",
                          "scope": str(payload.get("model", "")), "tenant": tenant,
                          "routing_data": data, "max_tokens": max_tokens if isinstance(max_tokens, int) else None}
            else:
                component = rr.component  # (from the path or the header)
                fields = {"api": "native", "scope": f"{rr.endpoint}:{component}" if component else rr.endpoint,
                          "tenant": validate_tenant_id(rr.headers.get(H.PREFIX_AWARE_ID)), "routing_data": rr.body,
                          "max_tokens": None}
        except (InvalidRequest, TypeError, ValueError):
            return  # nothing routable to record
        self._write(make_trace_record(timestamp=arrival, endpoint=rr.endpoint, variant=rr.pool.name,
                                      instance=decision.instance.instance_id, decision=decision.kind.value,
                                      **fields))
