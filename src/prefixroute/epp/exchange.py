"""One ext_proc stream (one HTTP request through Envoy) as a state machine, no I/O.

Envoy's ``ext_proc`` filter opens one bidirectional gRPC stream per request and, with
the processing mode of :mod:`prefixroute.epp.envoy_config` (headers SEND, bodies
``FULL_DUPLEX_STREAMED``, trailers SEND), sends ``ProcessingRequest`` messages in
order; :meth:`Exchange.handle` takes each one and returns the ``ProcessingResponse``
messages to send back, in order. The gRPC driver (:mod:`prefixroute.epp.server`)
only moves messages and calls :meth:`Exchange.close` when the stream ends.

What it does (FIELD.md §2; the Inference Extension's EPP protocol):

- request headers without end of stream: the answer waits until the body is whole
  (the routing key is in the body); the body is buffered up to ``--max-body-size``;
- body complete: the same steps as ``prefixroute serve``
  (:func:`prefixroute.server.app.prepare_inference`: endpoint and variant, size,
  Content-Encoding, validation, the routing key), then ``VariantPool.acquire`` (the
  strategy, ConcurrencyThreshold overflow, one in-flight slot). Answer: the headers
  response setting ``x-gateway-destination-endpoint: ip:port`` with
  ``clear_route_cache``, the same value as dynamic metadata ``envoy.lb``, then the
  body re-sent as ``streamed_response`` chunks of at most :data:`MAX_CHUNK_BYTES`
  (in this mode Envoy forwards only what the processor sends back);
- an error ``serve`` would answer itself (400, 404, 413, 415, 503) becomes an
  ``ImmediateResponse`` with the same status and body; every instance at its
  ConcurrencyThreshold with ``saturated="reject"`` is a 429;
- response headers and body chunks are echoed (body chunks unchanged, with their
  end of stream); the response headers get ``X-Prefixroute-Instance`` and
  ``X-Prefixroute-Decision`` as ``serve`` adds them;
- the lease (the in-flight slot) is released at the response's end of stream, or
  when the stream ends for any other reason (:meth:`close`: client gone, Envoy
  reset, picker shutting down), exactly once.

A request that is not an inference route (``GET /v1/models``, ``/health``) goes to an
instance of the default endpoint's variant chosen without a key, at once.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass
from typing import Literal

from aiohttp import web
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.type.v3 import http_status_pb2
from google.protobuf import struct_pb2
from multidict import CIMultiDict

from prefixroute.core.pool import Lease, NoHealthyInstance, SetSaturated
from prefixroute.core.strategies import DecisionKind
from prefixroute.epp.envoy_config import DESTINATION_HEADER, METADATA_NAMESPACE
from prefixroute.server import eventstream
from prefixroute.server import headers as H
from prefixroute.server.app import (BodyTooLarge, decode_request_body, prepare_inference, request_coding,
                                    request_id)
from prefixroute.server.routes import match_route
from prefixroute.server.errors import openai_error, sagemaker_error
from prefixroute.server.attempt import acquire, count_routed
from prefixroute.server.proxy import Api, RoutedRequest, our_headers, saturated_error, upstream_error
from prefixroute.server.state import RouterState

__all__ = ["Exchange", "EppOptions", "MAX_CHUNK_BYTES", "endpoint_address"]

#: Largest body chunk sent back to Envoy in one ``streamed_response``: the reference
#: EPPs use 62,000 bytes, under gRPC's and Envoy's per-message buffers.
MAX_CHUNK_BYTES = 62_000

_OVERWRITE = base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD


@dataclass(frozen=True, slots=True)
class EppOptions:
    """The picker's own settings.

    Attributes:
        saturated: what to do when every instance is at its ConcurrencyThreshold
            (decision ``all_busy``): ``send`` to the least busy one (as ``serve``
            does), or ``reject`` with 429 so that the gateway or client backs off.
    """

    saturated: Literal["send", "reject"] = "send"


def endpoint_address(instance_url: str) -> str:
    """``http://10.0.0.5:8000`` -> ``10.0.0.5:8000`` (``[fd00::5]:8000`` for IPv6):
    the form Envoy's ``ORIGINAL_DST`` cluster reads from the header."""
    rest = instance_url.split("://", 1)[-1]
    return rest.split("/", 1)[0]


class _Phase(enum.Enum):
    HEADERS = 1     # waiting for the request headers
    BODY = 2        # buffering the request body
    UPSTREAM = 3    # decided; the request is at the instance
    DONE = 4        # answered (immediate response) or the response ended


class Exchange:
    """The state of one ext_proc stream.

    Args:
        state: the picker's router state (fleet, metrics, settings).
        options: the :class:`EppOptions`.

    Attributes:
        lease: the in-flight slot while the request is at its instance, else ``None``.
        status: the response status seen (``0`` before the response headers).
        immediate: the status of the immediate response sent, if any.
    """

    def __init__(self, state: RouterState, options: EppOptions = EppOptions()) -> None:
        self.state = state
        self.options = options
        self.phase = _Phase.HEADERS
        self.lease: Lease | None = None
        self.status = 0
        self.immediate = 0
        self._t0 = time.perf_counter()
        self._headers: CIMultiDict[str] = CIMultiDict()
        self._raw: list[tuple[bytes, bytes]] = []
        self._route: tuple[Api, bool, str | None] | None = None
        self._body = bytearray()
        self._rid = ""
        self._endpoint = "unknown"
        self._variant = ""
        self._first_byte = False
        self._decoded = False
        self._framed = False  # InvokeEndpointWithResponseStream: the answer goes out as event-stream PayloadParts

    # -- the stream -----------------------------------------------------------------

    def handle(self, msg: pb.ProcessingRequest) -> list[pb.ProcessingResponse]:
        """The responses to one message from Envoy (possibly none yet)."""
        kind = msg.WhichOneof("request")
        if kind == "request_headers":
            return self._request_headers(msg.request_headers)
        if kind == "request_body":
            return self._request_body(msg.request_body)
        if kind == "request_trailers":  # the request's end when it has trailers
            out = self._end_of_body() if self.phase is _Phase.BODY else []
            if not self.immediate:  # (after an immediate response Envoy expects nothing more)
                out.append(pb.ProcessingResponse(request_trailers=pb.TrailersResponse()))
            return out
        if kind == "response_headers":
            return self._response_headers(msg.response_headers)
        if kind == "response_body":
            return self._response_body(msg.response_body)
        if kind == "response_trailers":
            self._finish()
            return [pb.ProcessingResponse(response_trailers=pb.TrailersResponse())]
        return []

    def close(self) -> None:
        """The stream ended (any reason): release the lease if still held, and count
        a request that got no complete answer as 499 (client or gateway went away)."""
        if self.lease is not None and not self.lease.released:
            self.lease.release()
            self._count(self.status if self.status and self.phase is _Phase.DONE else 499)
        self.phase = _Phase.DONE

    # -- request --------------------------------------------------------------------

    def _request_headers(self, msg: pb.HttpHeaders) -> list[pb.ProcessingResponse]:
        for h in msg.headers.headers:
            value = h.raw_value.decode("latin-1") if h.raw_value else h.value
            self._headers.add(h.key, value)
            if not h.key.startswith(":"):
                self._raw.append((h.key.encode("latin-1"), value.encode("latin-1")))
        method = self._headers.get(":method", "")
        path = self._headers.get(":path", "").split("?", 1)[0]
        self._rid = request_id(self._headers)
        self._route = match_route(path) if method == "POST" else None
        if self._route is None:
            return self._passthrough(msg.end_of_stream)
        declared = self._headers.get("content-length")
        limit = self.state.settings.max_body_bytes
        early = BodyTooLarge(limit, int(declared)) if declared and declared.isdigit() and int(declared) > limit \
            else None
        first = prepare_inference(self.state, self._route, self._headers, self._raw, early, self._rid, self._t0)
        if isinstance(first, web.Response):
            return [self._immediate(first)]
        if early is None and isinstance(first, RoutedRequest):
            self._endpoint, self._variant = first.endpoint, first.pool.name
        self.phase = _Phase.BODY
        if msg.end_of_stream:
            return self._end_of_body()
        return []

    def _request_body(self, msg: pb.HttpBody) -> list[pb.ProcessingResponse]:
        if self.phase is _Phase.UPSTREAM and self._route is None:  # passthrough: echo as it comes
            return [pb.ProcessingResponse(request_body=pb.BodyResponse(response=pb.CommonResponse(
                body_mutation=pb.BodyMutation(streamed_response=pb.StreamedBodyResponse(
                    body=msg.body, end_of_stream=msg.end_of_stream)))))]
        if self.phase is not _Phase.BODY:
            return []  # after an immediate response: Envoy is closing the stream
        self._body += msg.body
        limit = self.state.settings.max_body_bytes
        if len(self._body) > limit and request_coding(self._headers) in (None, "", "identity"):
            assert self._route is not None
            resp = prepare_inference(self.state, self._route, self._headers, self._raw, BodyTooLarge(limit, None),
                                     self._rid, self._t0)
            self._body = bytearray()
            assert isinstance(resp, web.Response)
            return [self._immediate(resp)]
        if msg.end_of_stream:
            return self._end_of_body()
        return []

    def _end_of_body(self) -> list[pb.ProcessingResponse]:
        assert self._route is not None
        api = self._route.api
        limit = self.state.settings.max_body_bytes
        raw = bytes(self._body)
        self._body = bytearray()
        coding = request_coding(self._headers)
        body: bytes | object = raw
        if coding not in (None, "", "identity"):
            body = decode_request_body(raw, coding, limit)
            self._decoded = isinstance(body, bytes)
        elif len(raw) > limit:
            body = BodyTooLarge(limit, len(raw))
        rr = prepare_inference(self.state, self._route, self._headers, self._raw, body,  # type: ignore[arg-type]
                               self._rid, self._t0, query=self._headers.get(":path", "").partition("?")[2])
        if isinstance(rr, web.Response):
            return [self._immediate(rr)]
        self._endpoint, self._variant = rr.endpoint, rr.pool.name
        hdrs = our_headers(rr)
        try:
            lease = acquire(self.state, rr)
        except NoHealthyInstance as exc:
            return [self._immediate(self._counted(upstream_error(api, 503, str(exc), "no_healthy_instance", hdrs)))]
        except SetSaturated as exc:  # an adapter's sticky set: never overflowed to an instance without it
            return [self._immediate(self._counted(saturated_error(self.state, rr, str(exc), hdrs)))]
        if rr.blocks:
            rr.pool.learn(lease.decision.instance, rr.blocks)
        decision = lease.decision
        if decision.kind is DecisionKind.ALL_BUSY and self.options.saturated == "reject":
            lease.release()
            msg = (f"every instance of production variant {rr.pool.name!r} is at its ConcurrencyThreshold; "
                   "retry later")
            resp = openai_error(429, msg, type_="server_error", code="saturated", headers=hdrs) \
                if api is Api.OPENAI else sagemaker_error("ThrottlingException", msg, status=429, headers=hdrs)
            return [self._immediate(self._counted(resp))]
        self.lease = lease
        self.phase = _Phase.UPSTREAM
        m = self.state.metrics
        count_routed(self.state, rr, decision)
        m.decision_seconds.labels(rr.endpoint, rr.pool.name).observe(decision.decision_s)
        out = [self._destination(decision.instance.instance_id, rr.upstream_path)]
        out.extend(_body_chunks(rr.body))
        return out

    def _passthrough(self, end_of_stream: bool) -> list[pb.ProcessingResponse]:
        """Not an inference route: any healthy instance of the default variant, now."""
        try:
            pool = self.state.fleet.default.variant(self._headers.get(H.TARGET_VARIANT))
            self.lease = pool.acquire(None)
        except (NoHealthyInstance, LookupError) as exc:
            resp = openai_error(503, str(exc), type_="server_error", code="no_healthy_instance",
                                headers={H.REQUEST_ID: self._rid})
            return [self._immediate(resp)]
        self._endpoint, self._variant = self.state.fleet.default.name, pool.name
        self.phase = _Phase.UPSTREAM
        out = [self._destination(self.lease.instance.instance_id)]
        return out

    # -- response -------------------------------------------------------------------

    def _response_headers(self, msg: pb.HttpHeaders) -> list[pb.ProcessingResponse]:
        for h in msg.headers.headers:
            if h.key == ":status":
                value = h.raw_value.decode("latin-1") if h.raw_value else h.value
                self.status = int(value) if value.isdigit() else 0
        mutation = pb.HeaderMutation()
        if self._route is not None and self._route.api is Api.NATIVE_STREAM and 200 <= self.status < 300:
            # as serve answers InvokeEndpointWithResponseStream: the model's content type moves to
            # X-Amzn-SageMaker-Content-Type and each body chunk becomes a PayloadPart event
            self._framed = True
            model_type = next((h.raw_value.decode("latin-1") or h.value for h in msg.headers.headers
                               if h.key == "content-type"), None)
            if model_type:
                mutation.set_headers.append(_header(H.SAGEMAKER_CONTENT_TYPE.lower(), model_type))
            mutation.set_headers.append(_header("content-type", eventstream.CONTENT_TYPE))
            mutation.remove_headers.append("content-length")
        if self.lease is not None:
            d = self.lease.decision
            for name, value in ((H.INSTANCE, d.instance.instance_id), (H.DECISION, d.kind.value),
                                (H.INVOKED_VARIANT, d.variant)):
                mutation.set_headers.append(_header(name.lower(), value))
        out = [pb.ProcessingResponse(response_headers=pb.HeadersResponse(response=pb.CommonResponse(
            header_mutation=mutation)))]
        if msg.end_of_stream:
            self._finish()
        return out

    def _response_body(self, msg: pb.HttpBody) -> list[pb.ProcessingResponse]:
        if not self._first_byte and msg.body:
            self._first_byte = True
            if self._variant:
                self.state.metrics.ttft_seconds.labels(self._endpoint, self._variant).observe(
                    time.perf_counter() - self._t0)
        body = eventstream.payload_part(msg.body) if self._framed and msg.body else msg.body
        out = [pb.ProcessingResponse(response_body=pb.BodyResponse(response=pb.CommonResponse(
            body_mutation=pb.BodyMutation(streamed_response=pb.StreamedBodyResponse(
                body=body, end_of_stream=msg.end_of_stream)))))]
        if msg.end_of_stream:
            self._finish()
        return out

    def _finish(self) -> None:
        if self.lease is not None and not self.lease.released:
            self.lease.release()
            self._count(self.status or 502)
        self.phase = _Phase.DONE

    # -- building messages ----------------------------------------------------------

    def _destination(self, instance_id: str, upstream_path: str | None = None) -> pb.ProcessingResponse:
        """The request headers answer: where to send it (header, ``envoy.lb``
        metadata), and the path on the instance when it differs from the client's
        (``/endpoints/NAME/invocations`` -> ``/invocations``, as ``serve`` sends it)."""
        address = endpoint_address(instance_id)
        mutation = pb.HeaderMutation(set_headers=[_header(DESTINATION_HEADER, address)])
        if upstream_path and upstream_path != self._headers.get(":path"):
            mutation.set_headers.append(_header(":path", upstream_path))
        if self._decoded:  # the body goes on decoded, as serve sends it
            mutation.remove_headers.extend(["content-encoding", "content-length"])
        metadata = struct_pb2.Struct()
        metadata.update({METADATA_NAMESPACE: {DESTINATION_HEADER: address}})
        return pb.ProcessingResponse(
            request_headers=pb.HeadersResponse(response=pb.CommonResponse(
                header_mutation=mutation, clear_route_cache=True)),
            dynamic_metadata=metadata)

    def _immediate(self, resp: web.Response) -> pb.ProcessingResponse:
        """An answer of the picker's own (already counted by ``prepare_inference`` or
        :meth:`_counted`) as an ``ImmediateResponse`` with the same status, headers
        and body."""
        self.immediate = resp.status
        self.phase = _Phase.DONE
        mutation = pb.HeaderMutation()
        for name, value in resp.headers.items():
            if name.lower() not in ("content-length", "date", "server"):
                mutation.set_headers.append(_header(name.lower(), value))
        body = resp.body if isinstance(resp.body, bytes) else b""
        return pb.ProcessingResponse(immediate_response=pb.ImmediateResponse(
            status=http_status_pb2.HttpStatus(code=resp.status), headers=mutation, body=body,
            details=f"prefixroute_{resp.status}"))

    def _counted(self, resp: web.Response) -> web.Response:
        m = self.state.metrics
        m.responses.labels(self._endpoint, self._variant, str(resp.status)).inc()
        m.duration_seconds.labels(self._endpoint, self._variant).observe(time.perf_counter() - self._t0)
        return resp

    def _count(self, status: int) -> None:
        m = self.state.metrics
        m.responses.labels(self._endpoint, self._variant, str(status)).inc()
        m.duration_seconds.labels(self._endpoint, self._variant).observe(time.perf_counter() - self._t0)


def _header(name: str, value: str) -> base_pb2.HeaderValueOption:
    return base_pb2.HeaderValueOption(header=base_pb2.HeaderValue(key=name, raw_value=value.encode("latin-1")),
                                      append_action=_OVERWRITE)


def _body_chunks(body: bytes) -> list[pb.ProcessingResponse]:
    """``body`` as ``streamed_response`` mutations of at most :data:`MAX_CHUNK_BYTES`,
    the last one with end of stream (one empty one for an empty body)."""
    chunks = [body[i:i + MAX_CHUNK_BYTES] for i in range(0, len(body), MAX_CHUNK_BYTES)] or [b""]
    return [pb.ProcessingResponse(request_body=pb.BodyResponse(response=pb.CommonResponse(
        body_mutation=pb.BodyMutation(streamed_response=pb.StreamedBodyResponse(
            body=chunk, end_of_stream=i == len(chunks) - 1)))))
        for i, chunk in enumerate(chunks)]
