"""``prefixroute serve --otel-traces``: OpenTelemetry spans of each routed request.

Needs the ``otel`` extra (``opentelemetry-sdk`` and the OTLP/HTTP exporter). The
exporter is configured as every OpenTelemetry SDK is, by environment variables:
``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` or ``OTEL_EXPORTER_OTLP_ENDPOINT`` (default
``http://localhost:4318``), ``OTEL_EXPORTER_OTLP_HEADERS``, ``OTEL_SERVICE_NAME``
(default ``prefixroute``), ``OTEL_TRACES_EXPORTER=console`` to print spans instead,
``OTEL_BSP_SCHEDULE_DELAY`` (ms between exports)...

Per request, made when it ends (with the times it recorded, so the spans cost the
request nothing while it runs), in the request's W3C trace
(:mod:`prefixroute.server.tracecontext`, under the caller's span if it sent a
``traceparent``)::

    prefixroute request  (SERVER; arrival -> end; endpoint, variant, instance, decision, status...)
    ├── route decision   (INTERNAL; the decision, ending as the request goes out)
    └── upstream         (CLIENT; request sent -> end; the span the engine is told is its parent)
        └── first byte   (INTERNAL; request sent -> first byte of the answer: the engine's TTFT)

The span ids of "prefixroute request" and "upstream" are those the trace context chose
(the engine got the latter in its ``traceparent`` before the span existed): a small
:class:`IdGenerator` hands them to the SDK. A caller's ``traceparent`` not sampled
(flags ``00``) makes no span (the SDK's default parent-based sampler).
"""

from __future__ import annotations

import logging
import os
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from prefixroute.server.proxy import RoutedRequest

__all__ = ["OtelTracing", "OtelUnavailable", "check_available"]

log = logging.getLogger("prefixroute.server")


class OtelUnavailable(RuntimeError):
    """``--otel-traces`` without the ``otel`` extra installed."""


def check_available() -> None:
    """Raises :class:`OtelUnavailable` if the SDK or the OTLP/HTTP exporter cannot be imported."""
    try:
        import opentelemetry.sdk.trace  # noqa: F401
        if os.environ.get("OTEL_TRACES_EXPORTER", "otlp").strip().lower() != "console":
            import opentelemetry.exporter.otlp.proto.http.trace_exporter  # noqa: F401
    except ImportError as exc:
        raise OtelUnavailable(f"--otel-traces needs the OpenTelemetry SDK and its OTLP/HTTP exporter: "
                              f"pip install 'prefixroute[otel]' ({exc})") from None


class OtelTracing:
    """A tracer provider of the router's own (the process's global one is left alone).

    Raises:
        OtelUnavailable: the OpenTelemetry SDK or its OTLP exporter is not installed.
    """

    def __init__(self) -> None:
        try:
            from opentelemetry import trace
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter
            from opentelemetry.sdk.trace.id_generator import IdGenerator, RandomIdGenerator
        except ImportError as exc:
            raise OtelUnavailable("--otel-traces needs the OpenTelemetry SDK: pip install 'prefixroute[otel]' "
                                  f"({exc})") from None
        from prefixroute import __version__

        class _Preset(IdGenerator):  # type: ignore[misc]
            """Hands out the ids set in ``next_*`` once each, else random ones."""

            def __init__(self) -> None:
                self.random = RandomIdGenerator()
                self.next_span: int | None = None
                self.next_trace: int | None = None

            def generate_span_id(self) -> int:
                span, self.next_span = self.next_span, None
                return span if span is not None else self.random.generate_span_id()

            def generate_trace_id(self) -> int:
                tid, self.next_trace = self.next_trace, None
                return tid if tid is not None else self.random.generate_trace_id()

        if os.environ.get("OTEL_TRACES_EXPORTER", "otlp").strip().lower() == "console":
            exporter: Any = ConsoleSpanExporter()
        else:
            try:
                from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
            except ImportError as exc:
                if "InstrumentationScope" in str(exc):  # xds-protos (the epp extra) ships an older copy
                    raise OtelUnavailable(
                        "--otel-traces: opentelemetry-proto's files were overwritten by xds-protos' older copy "
                        "(both ship opentelemetry/proto; installed together, the last one wins); restore them "
                        "with: pip install --no-deps --force-reinstall \"$(pip freeze | grep '^opentelemetry-proto==')\" "
                        f"({exc})") from None
                raise OtelUnavailable("--otel-traces needs the OTLP/HTTP exporter: pip install 'prefixroute[otel]' "
                                      f"({exc})") from None
            exporter = OTLPSpanExporter()
        self._ids = _Preset()
        service = os.environ.get("OTEL_SERVICE_NAME") or "prefixroute"
        self.provider = TracerProvider(resource=Resource.create({"service.name": service,
                                                                 "service.version": __version__}),
                                       id_generator=self._ids)
        self.provider.add_span_processor(BatchSpanProcessor(exporter))
        self._tracer = self.provider.get_tracer("prefixroute", __version__)
        self._trace = trace

    def request(self, rr: "RoutedRequest", status: int | str, t_end: float) -> None:
        """The spans of ``rr``, ended at ``t_end`` (``time.perf_counter()``) with ``status``."""
        trace = self._trace
        from opentelemetry.trace import SpanContext, SpanKind, Status, StatusCode, TraceFlags

        rec = rr.record
        ctx = rec.trace_context(rr.headers)
        # perf_counter -> Unix nanoseconds
        offset = time.time_ns() - int(time.perf_counter() * 1e9)

        def ns(t: float) -> int:
            return offset + int(t * 1e9)

        if ctx.parent_id is not None:
            parent = trace.set_span_in_context(trace.NonRecordingSpan(SpanContext(
                int(ctx.trace_id, 16), int(ctx.parent_id, 16), is_remote=True,
                trace_flags=TraceFlags(int(ctx.flags, 16)))))
        else:
            parent = None
            self._ids.next_trace = int(ctx.trace_id, 16)
        decision = rec.decision
        attrs: dict[str, Any] = {
            "http.request.method": "POST", "prefixroute.api": rr.api.value, "prefixroute.endpoint": rr.endpoint,
            "prefixroute.variant": rr.pool.name, "prefixroute.request_id": rr.request_id,
            "prefixroute.retries": rec.retries, "prefixroute.status": str(status),
            "http.request.body.size": len(rr.body), "http.response.body.size": rec.bytes_out,
        }
        if isinstance(status, int):
            attrs["http.response.status_code"] = status
        if decision is not None:
            attrs["prefixroute.instance"] = decision.instance.instance_id
            attrs["prefixroute.decision"] = decision.kind.value
        if rec.error is not None:
            attrs["error.type"] = rec.error
        self._ids.next_span = int(ctx.request_span_id, 16)
        root = self._tracer.start_span("prefixroute request", context=parent, kind=SpanKind.SERVER,
                                       start_time=ns(rr.t0), attributes=attrs)
        self._ids.next_span = None
        self._ids.next_trace = None
        failed = (isinstance(status, int) and status >= 500) or status == "stream_aborted"
        if failed:
            root.set_status(Status(StatusCode.ERROR, rec.error or str(status)))
        under = trace.set_span_in_context(root)
        if decision is not None and rec.t_sent:
            route = self._tracer.start_span("route decision", context=under, kind=SpanKind.INTERNAL,
                                            start_time=ns(max(rr.t0, rec.t_sent - decision.decision_s)),
                                            attributes={"prefixroute.decision": decision.kind.value,
                                                        "prefixroute.strategy": decision.strategy.value,
                                                        "prefixroute.instance": decision.instance.instance_id})
            route.end(end_time=ns(rec.t_sent))
            self._ids.next_span = int(ctx.upstream_span_id, 16)
            up = self._tracer.start_span("upstream", context=under, kind=SpanKind.CLIENT,
                                         start_time=ns(rec.t_sent),
                                         attributes={"server.address": decision.instance.instance_id,
                                                     "url.path": rr.upstream_path})
            self._ids.next_span = None
            if failed:
                up.set_status(Status(StatusCode.ERROR, rec.error or str(status)))
            if rec.t_first:
                first = self._tracer.start_span("first byte", context=trace.set_span_in_context(up),
                                                kind=SpanKind.INTERNAL, start_time=ns(rec.t_sent))
                first.end(end_time=ns(max(rec.t_sent, rec.t_first)))
            up.end(end_time=ns(t_end))
        root.end(end_time=ns(t_end))

    def close(self) -> None:
        """Export what is pending and stop (at most a few seconds)."""
        try:
            self.provider.force_flush(5000)
        finally:
            self.provider.shutdown()
