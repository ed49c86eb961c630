"""W3C Trace Context (https://www.w3.org/TR/trace-context/) for the requests the router forwards.

Every forwarded request carries a ``traceparent`` header to its engine, so that an
engine that traces (vLLM with ``--otlp-traces-endpoint``) puts its spans in the caller's
trace, under the router's:

* a request that came with a valid ``traceparent`` keeps its trace id and flags; the
  router's own spans take its parent id as their parent;
* one without (or with an invalid one) starts a new trace (random 128-bit trace id,
  flags ``01``: sampled, so that an engine tracing with its default sampler keeps it).

The ``traceparent`` sent on names the router's upstream span as parent
(:attr:`TraceContext.upstream_span_id`); ``tracestate`` is passed on unchanged (the
router adds no entry of its own). Pure functions, no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass
from random import getrandbits
from typing import Mapping

__all__ = ["TraceContext", "parse_traceparent", "TRACEPARENT", "TRACESTATE"]

TRACEPARENT = "traceparent"
TRACESTATE = "tracestate"

_HEX = frozenset("0123456789abcdef")


def _hex(s: str, n: int) -> bool:
    return len(s) == n and all(c in _HEX for c in s) and s != "0" * n


def parse_traceparent(value: str | None) -> tuple[str, str, str] | None:
    """``(trace_id, parent_id, flags)`` of a valid ``traceparent`` (lower-case hex:
    32, 16 and 2 digits), or ``None``.

    Version ``00`` must have exactly four fields; a higher version may have more (the
    first four are read, as the specification asks); version ``ff`` and all-zero ids are
    invalid."""
    if not value:
        return None
    parts = value.strip().split("-")
    if len(parts) < 4:
        return None
    version, trace_id, parent_id, flags = parts[:4]
    if len(version) != 2 or not all(c in _HEX for c in version) or version == "ff":
        return None
    if version == "00" and len(parts) != 4:
        return None
    if not (_hex(trace_id, 32) and _hex(parent_id, 16) and len(flags) == 2 and all(c in _HEX for c in flags)):
        return None
    return trace_id, parent_id, flags


@dataclass(frozen=True, slots=True)
class TraceContext:
    """The trace a routed request belongs to, and the router's span ids in it.

    Attributes:
        trace_id: 32 lower-case hex digits.
        parent_id: the caller's span (16 hex digits), or ``None`` when the router
            started the trace.
        flags: 2 hex digits (``01``: sampled).
        request_span_id: the router's span for the whole request (16 hex digits).
        upstream_span_id: the router's span for the request to the engine: the parent
            the engine is told of.
        state: the caller's ``tracestate``, passed on unchanged, or ``None``.
    """

    trace_id: str
    parent_id: str | None
    flags: str
    request_span_id: str
    upstream_span_id: str
    state: str | None = None

    @classmethod
    def for_request(cls, headers: Mapping[str, str]) -> "TraceContext":
        """The context of a request with these headers (see the module docstring)."""
        parsed = parse_traceparent(headers.get(TRACEPARENT))
        state = headers.get(TRACESTATE) if parsed is not None else None
        if parsed is None:
            trace_id, parent, flags = "%032x" % (getrandbits(128) or 1), None, "01"
        else:
            trace_id, parent, flags = parsed
        return cls(trace_id, parent, flags, "%016x" % (getrandbits(64) or 1), "%016x" % (getrandbits(64) or 1),
                   state or None)

    @property
    def sampled(self) -> bool:
        return bool(int(self.flags, 16) & 1)

    def traceparent(self) -> str:
        """The ``traceparent`` sent to the engine: version 00, this trace, the router's
        upstream span as parent, the caller's flags."""
        return f"00-{self.trace_id}-{self.upstream_span_id}-{self.flags}"

    def upstream_lines(self) -> bytes:
        """``traceparent`` (and ``tracestate``) as header lines, each ending in CRLF."""
        out = b"traceparent: " + self.traceparent().encode() + b"\r\n"
        if self.state is not None:
            out += b"tracestate: " + self.state.encode("latin-1", "replace") + b"\r\n"
        return out

    def upstream_pairs(self) -> list[tuple[bytes, bytes]]:
        """The same as raw ``(name, value)`` pairs."""
        out = [(b"traceparent", self.traceparent().encode())]
        if self.state is not None:
            out.append((b"tracestate", self.state.encode("latin-1", "replace")))
        return out
