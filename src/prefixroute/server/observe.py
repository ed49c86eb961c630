"""Where a request's end is reported, once, whichever data plane served it.

:class:`Observers` is held by the :class:`~prefixroute.server.state.RouterState`. Both
data planes call :meth:`Observers.finished` when a routed request ends (on every path:
answered, failed, the client gone) and :meth:`Observers.refused` when the router
answers a request itself before routing it (400, 404, 413, 429...). The observers then
update what reads those events:

* the live status counters (:mod:`.livestats`), always;
* the JSON access log (:mod:`.accesslog`, ``--access-log``);
* the routing trace (:mod:`.trace`, ``--record-trace``);
* OpenTelemetry spans (:mod:`.otel`, ``--otel-traces``).

An observer that fails is logged and never fails the request. The files and the span
exporter are opened by :meth:`Observers.open` as the router starts and flushed and
closed by :meth:`Observers.close` once its requests are over.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from prefixroute.server.livestats import LiveStats

if TYPE_CHECKING:
    from prefixroute.server.accesslog import AccessLog
    from prefixroute.server.otel import OtelTracing
    from prefixroute.server.proxy import RoutedRequest
    from prefixroute.server.trace import TraceRecorder

__all__ = ["Observers", "key_digest", "REFUSALS_LOGGED_PER_S"]

log = logging.getLogger("prefixroute.server")

#: Per-request lines (refusals, retried 429/503) logged per second at most (INFO); the
#: others in that second are counted and named by the next line logged, so a client
#: looping on a 4xx, a rate limit answering thousands of 429s or a fleet shedding load
#: cannot flood the log.
REFUSALS_LOGGED_PER_S = 10

_clock = time.monotonic  # (what the budget's seconds are read from)


def key_digest(rr: "RoutedRequest") -> str | None:
    """What the access log shows of a request's routing key: the 64-bit PREFIX_AWARE key,
    or the last chained block digest of CACHE_AWARE (the whole routing text hashed), as
    16 hex digits; ``None`` when the variant routes on neither. A digest: no text can be
    read back from it."""
    if rr.key is not None:
        return "%016x" % (rr.key & 0xFFFF_FFFF_FFFF_FFFF)
    blocks = rr.blocks
    if blocks:
        return "%016x" % (blocks[len(blocks) - 1] & 0xFFFF_FFFF_FFFF_FFFF)
    return None


class Observers:
    """What is told of each request's end.

    Attributes:
        stats: the live status counters.
        access_log: the JSON access log, or ``None``.
        recorder: the routing trace recorder, or ``None``.
        otel: the OpenTelemetry span maker, or ``None``.
    """

    def __init__(self) -> None:
        self.stats = LiveStats()
        self.access_log: "AccessLog | None" = None
        self.recorder: "TraceRecorder | None" = None
        self.otel: "OtelTracing | None" = None
        self._log_second = 0
        self._logged_this_second = 0
        self._not_logged = 0

    def open(self, access_log: str | None = None, record_trace: str | None = None, otel: bool = False) -> None:
        """Open what the settings ask for.

        Raises:
            OSError: a file cannot be opened.
            prefixroute.server.otel.OtelUnavailable: ``otel`` without the ``otel`` extra.
        """
        try:
            if access_log is not None:
                from prefixroute.server.accesslog import AccessLog

                self.access_log = AccessLog(access_log)
            if record_trace is not None:
                from prefixroute.server.trace import TraceRecorder

                self.recorder = TraceRecorder(record_trace)
                log.info("recording a request trace to %s (no prompt text)", record_trace)
            if otel:
                from prefixroute.server.otel import OtelTracing

                self.otel = OtelTracing()
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Flush and close what :meth:`open` opened."""
        for name in ("access_log", "recorder", "otel"):
            thing = getattr(self, name)
            setattr(self, name, None)
            if thing is not None:
                try:
                    thing.close()
                except Exception:
                    log.exception("closing the %s failed", name.replace("_", " "))

    def finished(self, rr: "RoutedRequest", code: int | str, t_end: float) -> None:
        """``rr`` ended at ``t_end`` (``time.perf_counter()``) with ``code``: the status the
        client got, ``499`` (it left first) or ``stream_aborted``. Called exactly once per
        routed request."""
        rec = rr.record
        if rec.admission is not None:  # first: the client's limits get their slot back whatever follows
            rec.admission.release()
        decision = rec.decision
        instance = decision.instance.instance_id if decision is not None else None
        kind = decision.kind.value if decision is not None else None
        ttft = rec.t_first - rr.t0 if rec.t_first else None
        try:
            self.stats.routed(rr.endpoint, rr.pool.name, instance, kind, code, ttft, rec.bytes_out, rec.retries,
                              rec.error, rr.request_id)
            if self.access_log is not None:
                from prefixroute.server.accesslog import access_entry

                self.access_log.write(access_entry(
                    t_end_wall=time.time() - (time.perf_counter() - t_end), request_id=rr.request_id,
                    trace_id=rec.trace_context(rr.headers).trace_id, api=rr.api.value, endpoint=rr.endpoint,
                    variant=rr.pool.name, instance=instance, decision=kind, key=key_digest(rr), client=rec.client,
                    tenant=rec.tenant, status=code, ttft_s=ttft, duration_s=t_end - rr.t0, bytes_in=len(rr.body),
                    bytes_out=rec.bytes_out, retries=rec.retries, error=rec.error))
            if self.recorder is not None:
                self.recorder.record(rr)
            if self.otel is not None:
                self.otel.request(rr, code, t_end)
        except Exception:  # a bug in the bookkeeping must not fail the request
            log.exception("recording the end of request %s failed", rr.request_id)

    def refused(self, endpoint: str, variant: str, status: int, message: str, request_id: str | None,
                t0: float, t_end: float, bytes_out: int = 0, extra: dict[str, Any] | None = None) -> None:
        """The router answered ``status`` itself, before routing (``variant`` ``""`` when
        none was chosen; ``message`` is the router's own text; ``extra``: access log
        fields known, such as ``client``). Logged at INFO (at most
        :data:`REFUSALS_LOGGED_PER_S` lines a second) with the message, never the request's
        text."""
        try:
            self._log_refusal(endpoint, variant, status, message, request_id)
            self.stats.refused(endpoint, variant, status, message, request_id)
            if self.access_log is not None:
                from prefixroute.server.accesslog import access_entry

                entry = access_entry(
                    t_end_wall=time.time() - (time.perf_counter() - t_end), request_id=request_id, trace_id=None,
                    api=None, endpoint=endpoint, variant=variant, instance=None, decision=None, key=None, client=None,
                    tenant=None, status=status, ttft_s=None, duration_s=t_end - t0, bytes_in=None,
                    bytes_out=bytes_out, retries=0, error="refused")
                if extra:
                    entry.update(extra)
                self.access_log.write(entry)
        except Exception:
            log.exception("recording a refused request failed")

    def _log_refusal(self, endpoint: str, variant: str, status: int, message: str, request_id: str | None) -> None:
        self.log_budgeted("refused%s: %d %s (endpoint %s%s)" % (
            f" request {request_id}" if request_id else "", status, message or "(no message)", endpoint,
            f", variant {variant}" if variant else ""))

    def log_budgeted(self, line: str) -> None:
        """Log ``line`` (a per-request event: a refusal, a retried 429/503; never request
        text) at INFO, at most :data:`REFUSALS_LOGGED_PER_S` lines a second; the others
        of that second are counted into the next line logged."""
        second = int(_clock())
        if second != self._log_second:
            self._log_second, self._logged_this_second = second, 0
        if self._logged_this_second >= REFUSALS_LOGGED_PER_S:
            self._not_logged += 1
            return
        self._logged_this_second += 1
        more, self._not_logged = self._not_logged, 0
        log.info("%s%s", line, f"; {more} more line{'s' if more != 1 else ''} not logged before it" if more else "")
