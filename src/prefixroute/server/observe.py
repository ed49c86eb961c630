"""Where a request's end is reported, once, whichever data plane served it.

:class:`Observers` is held by the :class:`~prefixroute.server.state.RouterState`. Both
data planes call :meth:`Observers.finished` when a routed request ends (on every path:
answered, failed, the client gone) and :meth:`Observers.refused` when the router
answers a request itself before routing it (400, 404, 413, 429...). The observers then
update what reads those events: the live status counters (:mod:`.livestats`).

An observer that fails is logged and never fails the request.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from prefixroute.server.livestats import LiveStats

if TYPE_CHECKING:
    from prefixroute.server.proxy import RoutedRequest

__all__ = ["Observers"]

log = logging.getLogger("prefixroute.server")


class Observers:
    """What is told of each request's end.

    Attributes:
        stats: the live status counters.
    """

    def __init__(self) -> None:
        self.stats = LiveStats()

    def finished(self, rr: "RoutedRequest", code: int | str, t_end: float) -> None:
        """``rr`` ended at ``t_end`` (``time.perf_counter()``) with ``code``: the status the
        client got, ``499`` (it left first) or ``stream_aborted``. Called exactly once per
        routed request."""
        rec = rr.record
        decision = rec.decision
        try:
            self.stats.routed(rr.endpoint, rr.pool.name,
                              decision.instance.instance_id if decision is not None else None,
                              decision.kind.value if decision is not None else None, code,
                              rec.t_first - rr.t0 if rec.t_first else None, rec.bytes_out, rec.retries, rec.error,
                              rr.request_id)
        except Exception:  # a bug in the bookkeeping must not fail the request
            log.exception("recording the end of request %s failed", rr.request_id)

    def refused(self, endpoint: str, variant: str, status: int, message: str, request_id: str | None,
                t0: float, t_end: float) -> None:
        """The router answered ``status`` itself, before routing (``variant`` ``""`` when
        none was chosen; ``message`` is the router's own text)."""
        try:
            self.stats.refused(endpoint, variant, status, message, request_id)
        except Exception:
            log.exception("recording a refused request failed")
