"""``prefixroute serve --record-trace PATH``: record routed requests for the tuning advisor.

One JSONL line per request, in the format of :mod:`prefixroute.workloads.traces`
(``prefixroute-trace/1``): arrival time, endpoint and production variant, the instance
and the router's decision, the length of the text the routing key is cut from and
**chained xxh3-64 digests of its successive 64-character blocks** (64 bytes on the
native API, 64 token ids for a token prompt). The digests let ``prefixroute tune``
recompute the key of every request for any PrefixLength that is a multiple of 64, and
rebuild which requests share which prefix, without the text: **prompt text is never
written**, and the tenant id is stored as a digest.

Lines are written when a request ends (so the file is in order of completion;
``load_trace`` sorts by arrival). A recording error is logged once and recording stops;
it never fails a request.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import IO, Any, AsyncIterator, Awaitable, Callable, Mapping

import orjson
from aiohttp import web

from prefixroute.core.keys import InvalidRequest, completion_prompt, openai_tenant, render_chat_text
from prefixroute.workloads.traces import make_trace_record

__all__ = ["TRACE_RECORDER", "TraceRecorder", "recorder_context"]

log = logging.getLogger("prefixroute.server.trace")


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
        self.records = 0

    def _write(self, record: dict[str, Any]) -> None:
        if self._fh is None:
            return
        try:
            self._fh.write(orjson.dumps(record) + b"\n")
            self.records += 1
        except (OSError, ValueError) as exc:
            log.error("trace recording to %s failed, recording stops: %s", self.path, exc)
            self.close()

    def close(self) -> None:
        """Flush and close; later records are dropped."""
        if self._fh is not None:
            try:
                self._fh.close()
            finally:
                self._fh = None

    async def _forward(self, response: Awaitable[web.StreamResponse], describe: Callable[[], dict[str, Any]],
                       endpoint: str, variant: str) -> web.StreamResponse:
        t = time.time()
        resp: web.StreamResponse | None = None
        try:
            resp = await response
            return resp
        finally:
            instance = decision = ""
            if resp is not None:
                instance = resp.headers.get("X-Prefixroute-Instance", "")
                decision = resp.headers.get("X-Prefixroute-Decision", "")
            try:
                fields = describe()
            except (InvalidRequest, TypeError, ValueError):
                fields = None  # nothing routable to record (the request was answered with an error)
            if fields is not None:
                self._write(make_trace_record(timestamp=t, endpoint=endpoint, variant=variant, instance=instance,
                                              decision=decision, **fields))

    async def forward_openai(self, response: Awaitable[web.StreamResponse], payload: Mapping[str, Any], chat: bool,
                             endpoint: str, variant: str) -> web.StreamResponse:
        """Await ``response`` (the forwarding of an OpenAI request) and record it."""

        def describe() -> dict[str, Any]:
            data: Any = render_chat_text(payload) if chat else completion_prompt(payload)
            try:
                tenant = openai_tenant(payload)
            except InvalidRequest:
                tenant = ""
            max_tokens = payload.get("max_completion_tokens", payload.get("max_tokens"))
            return {"api": "openai-chat" if chat else "openai-completions", "scope": str(payload.get("model", "")),
                    "tenant": tenant, "routing_data": data,
                    "max_tokens": max_tokens if isinstance(max_tokens, int) else None}

        return await self._forward(response, describe, endpoint, variant)

    async def forward_native(self, response: Awaitable[web.StreamResponse], body: bytes, scope: str, tenant: str,
                             endpoint: str, variant: str) -> web.StreamResponse:
        """Await ``response`` (the forwarding of a native ``/invocations`` request) and record it."""

        def describe() -> dict[str, Any]:
            return {"api": "native", "scope": scope, "tenant": tenant, "routing_data": body, "max_tokens": None}

        return await self._forward(response, describe, endpoint, variant)


#: Where the :class:`TraceRecorder` lives in the router's app (absent when not recording).
TRACE_RECORDER = web.AppKey("prefixroute_trace_recorder", TraceRecorder)


def recorder_context(path: str | Path) -> Callable[[web.Application], AsyncIterator[None]]:
    """An aiohttp ``cleanup_ctx`` that opens the recorder on startup and closes it on cleanup."""

    async def ctx(app: web.Application) -> AsyncIterator[None]:
        recorder = TraceRecorder(path)
        app[TRACE_RECORDER] = recorder
        log.info("recording a request trace to %s (no prompt text)", path)
        try:
            yield
        finally:
            recorder.close()

    return ctx
