"""What the router learns about one routed request as it goes: :class:`RequestRecord`.

Both data planes fill one record per routed request (the decision of each attempt,
retries, when the request went out and when the first byte of the answer came back,
the bytes relayed, the last upstream error) and hand it, once, to the observers when
the request ends (:meth:`prefixroute.server.observe.Observers.finished`): the live
status page's counters, the JSON access log, the routing trace, OpenTelemetry spans.

A record never holds request content: the routing key is kept as the 64-bit digest
it already is, and nothing of the body or the prompt.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Mapping

from prefixroute.server.tracecontext import TraceContext

if TYPE_CHECKING:
    from prefixroute.core.pool import Decision

__all__ = ["RequestRecord"]


class RequestRecord:
    """One routed request's progress (times are ``time.perf_counter()`` seconds, 0.0 for
    "not yet").

    Attributes:
        decision: the routing decision of the last attempt, or ``None`` if no instance
            was chosen (no healthy instance).
        retries: attempts after the first (each on another instance).
        t_sent: when the last attempt's request started out to the instance.
        t_first: when the first byte of the instance's answer body came (or its head,
            for an answer relayed without a body).
        bytes_out: bytes of the instance's answer body relayed to the client (before
            any re-framing: SSE events, JSON, the payload of event-stream frames).
        error: the kind of the last upstream failure (``connect``, ``send``, ``reset``,
            ``disconnect``, ``headers_timeout``, ``idle_timeout``, ``no_done``,
            ``http_5xx``, ``no_healthy_instance``, ``upstream_unavailable``), or ``None``.
        client: the name of the API key the request was admitted with, or ``None``
            (keys off).
        tenant: the tenant of that key, or ``None``.
        trace: the request's W3C trace context (:class:`TraceContext`), or ``None``
            until :meth:`trace_context` made it.
        admission: the client limits' claim to give back when the request ends
            (anything with ``release()``), or ``None``.
    """

    __slots__ = ("decision", "retries", "t_sent", "t_first", "bytes_out", "error", "client", "tenant", "trace",
                 "admission")

    def __init__(self) -> None:
        self.decision: "Decision | None" = None
        self.retries = 0
        self.t_sent = 0.0
        self.t_first = 0.0
        self.bytes_out = 0
        self.error: str | None = None
        self.client: str | None = None
        self.tenant: str | None = None
        self.trace: Any = None
        self.admission: Any = None

    def trace_context(self, headers: Mapping[str, str]) -> TraceContext:
        """The request's trace context, made from its headers the first time it is
        asked for (when the request is sent, or when it ends if it never was)."""
        trace = self.trace
        if trace is None:
            trace = self.trace = TraceContext.for_request(headers)
        return trace

    def first_byte(self, t: float) -> None:
        """The first byte of the answer came at ``t`` (later calls are ignored)."""
        if not self.t_first:
            self.t_first = t
