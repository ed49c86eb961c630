"""One ext_proc stream (one HTTP request through Envoy) as a state machine, no I/O.

Envoy's ``ext_proc`` filter opens one bidirectional gRPC stream per request and sends
``ProcessingRequest`` messages in order; :meth:`Exchange.handle` takes each one and
returns the ``ProcessingResponse`` messages to send back, in order. The gRPC driver
(:mod:`prefixroute.epp.server`) only moves messages and calls :meth:`Exchange.close`
when the stream ends.

Envoy's body modes come in the first message (``protocol_config``). With the picker's
own bootstrap (:mod:`prefixroute.epp.envoy_config`: request body ``BUFFERED``, response
body ``NONE``, ``allow_mode_override``) a whole (non-streamed) answer costs three
messages each way:

1. request headers: checked at once (route, Content-Length over ``--max-body-size``,
   endpoint and variant); answered ``CONTINUE``, or with an immediate response;
2. the request body, whole, in one message (Envoy holds it): the same steps as
   ``prefixroute serve`` (:func:`prefixroute.server.app.prepare_inference`: size,
   Content-Encoding, validation, the routing key), then ``VariantPool.acquire`` (the
   strategy, ConcurrencyThreshold overflow, one in-flight slot). Answer: the header
   mutation ``x-gateway-destination-endpoint: ip:port`` with ``clear_route_cache``
   (Envoy changes headers in a ``BUFFERED`` body's answer), the same value as dynamic
   metadata ``envoy.lb``, and nothing of the body, unless it came compressed (then it
   is replaced, decoded, as ``serve`` sends it);
3. response headers: ``X-Prefixroute-Instance``, ``X-Prefixroute-Decision`` and the
   invoked variant added, as ``serve`` adds them. The body then goes from the instance
   to the client without the picker (its first byte follows the headers: the TTFT is
   taken here), except when the picker must see it: an event stream
   (``text/event-stream``: the TTFT is its first event) and
   InvokeEndpointWithResponseStream (each chunk reframed as an event-stream
   PayloadPart, the model's content type moved to X-Amzn-SageMaker-Content-Type). For
   those the answer asks for the body (``mode_override``: response body ``STREAMED``),
   each chunk is answered (``CONTINUE``, or replaced) and the lease ends with the last.

Otherwise the lease (the in-flight slot) is released when the stream ends: Envoy ends
it when the HTTP stream ends (the last byte sent to the client, the client gone, a
reset), as response trailers are to be sent here and a response body is not: the
answer's status is counted then. Any other end before the answer was complete (picker
shutting down, Envoy reset before the response headers, an event stream cut) counts as
499. Released exactly once in every case.

With request body ``FULL_DUPLEX_STREAMED`` (an Inference Extension gateway's usual
setting, the picker's own before) the body comes in chunks and is sent back in
``streamed_response`` chunks of at most :data:`MAX_CHUNK_BYTES` after the headers'
answer (in that mode Envoy forwards only what the processor sends back); with response
body ``FULL_DUPLEX_STREAMED`` every response chunk is echoed. Request body ``STREAMED``
or ``NONE`` cannot be routed on: 500.

An error ``serve`` would answer itself (400, 404, 413, 415, 503) becomes an
``ImmediateResponse`` with the same status and body; every instance at its
ConcurrencyThreshold with ``saturated="reject"`` is a 429. A request that is not an
inference route (``GET /v1/models``, ``/health``) goes to an instance of the default
endpoint's variant chosen without a key, at once (with a body, Envoy is asked not to
send it: ``mode_override`` request body ``NONE``).
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass
from typing import Literal

from aiohttp import web
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.type.v3 import http_status_pb2
from google.protobuf import struct_pb2
from multidict import CIMultiDict

from prefixroute.core.pool import Lease, NoHealthyInstance, SetSaturated
from prefixroute.core.strategies import DecisionKind
from prefixroute.epp.envoy_config import DESTINATION_HEADER, METADATA_NAMESPACE
from prefixroute.server import eventstream
from prefixroute.server import headers as H
from prefixroute.server.app import prepare_inference, request_id
from prefixroute.server.request_body import BodyTooLarge, decode_request_body, request_coding
from prefixroute.server.routes import match_route
from prefixroute.server.errors import openai_error, sagemaker_error
from prefixroute.server.attempt import acquire, count_routed, learn_route
from prefixroute.server.proxy import Api, RoutedRequest, our_headers, saturated_error, upstream_error
from prefixroute.server.state import RouterState

__all__ = ["Exchange", "EppOptions", "MAX_CHUNK_BYTES", "endpoint_address"]

#: Largest body chunk sent back to Envoy in one ``streamed_response``: the reference
#: EPPs use 62,000 bytes, under gRPC's and Envoy's per-message buffers.
MAX_CHUNK_BYTES = 62_000

_OVERWRITE = base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD
_Mode = processing_mode_pb2.ProcessingMode
NONE, STREAMED, BUFFERED, BUFFERED_PARTIAL, FULL_DUPLEX = (_Mode.NONE, _Mode.STREAMED, _Mode.BUFFERED,
                                                            _Mode.BUFFERED_PARTIAL, _Mode.FULL_DUPLEX_STREAMED)
_WHOLE = (BUFFERED, BUFFERED_PARTIAL)  # the request body comes in one message, answered with the headers' mutation

# Answers that never change (the gRPC driver serializes each one it sends: no copies)
_CONTINUE_REQUEST_HEADERS = pb.ProcessingResponse(request_headers=pb.HeadersResponse())
_CONTINUE_REQUEST_BODY = pb.ProcessingResponse(request_body=pb.BodyResponse())
_CONTINUE_RESPONSE_BODY = pb.ProcessingResponse(response_body=pb.BodyResponse())
_CONTINUE_REQUEST_TRAILERS = pb.ProcessingResponse(request_trailers=pb.TrailersResponse())
_CONTINUE_RESPONSE_TRAILERS = pb.ProcessingResponse(response_trailers=pb.TrailersResponse())


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
        request_body_mode, response_body_mode: Envoy's body modes for this stream
            (``ProcessingMode.BodySendMode`` values), from the first message's
            ``protocol_config``; ``FULL_DUPLEX_STREAMED`` both ways when Envoy sends
            none.
    """

    def __init__(self, state: RouterState, options: EppOptions = EppOptions()) -> None:
        self.state = state
        self.options = options
        self.phase = _Phase.HEADERS
        self.lease: Lease | None = None
        self.status = 0
        self.immediate = 0
        self.request_body_mode = FULL_DUPLEX
        self.response_body_mode = FULL_DUPLEX
        self._t0 = time.perf_counter()
        self._headers: CIMultiDict[str] = CIMultiDict()
        self._raw: list[tuple[bytes, bytes]] = []
        self._route: tuple[Api, bool, str | None] | None = None
        self._body = bytearray()
        self._rid = ""
        self._endpoint = "unknown"
        self._variant = ""
        self._component: str | None = None  # the inference component served, named in the answer as serve does
        self._first_message = True
        self._first_byte = False
        self._decoded = False
        self._framed = False  # InvokeEndpointWithResponseStream: the answer goes out as event-stream PayloadParts

    # -- the stream -----------------------------------------------------------------

    def handle(self, msg: pb.ProcessingRequest) -> list[pb.ProcessingResponse]:
        """The responses to one message from Envoy (possibly none yet)."""
        if self._first_message:
            self._first_message = False
            if msg.HasField("protocol_config"):
                self.request_body_mode = msg.protocol_config.request_body_mode
                self.response_body_mode = msg.protocol_config.response_body_mode
        kind = msg.WhichOneof("request")
        if kind == "request_headers":
            return self._request_headers(msg.request_headers)
        if kind == "request_body":
            return self._request_body(msg.request_body)
        if kind == "request_trailers":  # the request's end when it has trailers
            out = self._end_of_body("streamed") if self.phase is _Phase.BODY else []
            if not self.immediate:  # (after an immediate response Envoy expects nothing more)
                out.append(_CONTINUE_REQUEST_TRAILERS)
            return out
        if kind == "response_headers":
            return self._response_headers(msg.response_headers)
        if kind == "response_body":
            return self._response_body(msg.response_body)
        if kind == "response_trailers":
            self._finish()
            return [_CONTINUE_RESPONSE_TRAILERS]
        return []

    def close(self) -> None:
        """The stream ended (any reason): release the lease if still held, and count
        it. The end of a stream whose response body was not Envoy's to send here
        (``response_body_mode`` ``NONE``) after the response headers is the end of the
        answer: Envoy closes the stream when the HTTP stream ends; its status is
        counted. Otherwise a request that got no complete answer counts as 499 (client
        or gateway went away)."""
        if self.lease is not None and not self.lease.released:
            self.lease.release()
            done = self.status and (self.phase is _Phase.DONE or self.response_body_mode == NONE)
            self._count(self.status if done else 499)
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
            return self._end_of_body("headers")
        if self.request_body_mode in _WHOLE:
            return [_CONTINUE_REQUEST_HEADERS]  # the body comes next, whole: answered with the destination
        if self.request_body_mode != FULL_DUPLEX:  # STREAMED or NONE: Envoy would hold or skip the body
            return [self._immediate(openai_error(
                500, "prefixroute epp needs the request body: request_body_mode BUFFERED, BUFFERED_PARTIAL or "
                     f"FULL_DUPLEX_STREAMED (this stream: {_Mode.BodySendMode.Name(self.request_body_mode)})",
                type_="server_error", code="epp_misconfigured", headers={H.REQUEST_ID: self._rid}))]
        return []  # FULL_DUPLEX_STREAMED: answered once the body is whole

    def _request_body(self, msg: pb.HttpBody) -> list[pb.ProcessingResponse]:
        if self.phase is _Phase.UPSTREAM and self._route is None:  # passthrough: as it comes
            if self.request_body_mode != FULL_DUPLEX:
                return [_CONTINUE_REQUEST_BODY]
            return [pb.ProcessingResponse(request_body=pb.BodyResponse(response=pb.CommonResponse(
                body_mutation=pb.BodyMutation(streamed_response=pb.StreamedBodyResponse(
                    body=msg.body, end_of_stream=msg.end_of_stream)))))]
        if self.phase is not _Phase.BODY:
            return []  # after an immediate response: Envoy is closing the stream
        if self._body:
            self._body += msg.body
        else:
            self._body = msg.body  # type: ignore[assignment]  # (bytes: the usual one message, no copy)
        limit = self.state.settings.max_body_bytes
        if len(self._body) > limit and request_coding(self._headers) in (None, "", "identity"):
            assert self._route is not None
            resp = prepare_inference(self.state, self._route, self._headers, self._raw, BodyTooLarge(limit, None),
                                     self._rid, self._t0)
            self._body = bytearray()
            assert isinstance(resp, web.Response)
            return [self._immediate(resp)]
        if self.request_body_mode in _WHOLE:
            # the whole body (its end of stream is unset only when request trailers follow),
            # answered now: the headers can change only until this answer
            return self._end_of_body("body")
        if msg.end_of_stream:
            return self._end_of_body("streamed")
        if isinstance(self._body, bytes):
            self._body = bytearray(self._body)
        return []

    def _end_of_body(self, answer: Literal["headers", "body", "streamed"]) -> list[pb.ProcessingResponse]:
        """The decision, answered in the message Envoy waits for: the request headers
        (no body), the whole body (``BUFFERED``, ``BUFFERED_PARTIAL``), or the last
        body chunk or the trailers (``FULL_DUPLEX_STREAMED``: then the body is sent
        back too)."""
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
        self._endpoint, self._variant, self._component = rr.endpoint, rr.pool.name, rr.pool.component
        hdrs = our_headers(rr)
        try:
            lease = acquire(self.state, rr)
        except NoHealthyInstance as exc:
            return [self._immediate(self._counted(upstream_error(api, 503, str(exc), "no_healthy_instance", hdrs)))]
        except SetSaturated as exc:  # an adapter's sticky set: never overflowed to an instance without it
            return [self._immediate(self._counted(saturated_error(self.state, rr, str(exc), hdrs)))]
        if rr.blocks:  # before the next decision (attempt.learn_route)
            learn_route(rr.pool, lease.decision.instance, rr.blocks)
        decision = lease.decision
        if decision.kind is DecisionKind.ALL_BUSY and self.options.saturated == "reject":
            lease.release()
            msg = (f"every instance of production variant {rr.pool.name!r} is at its ConcurrencyThreshold; "
                   "retry later")
            hdrs = {**hdrs, H.RETRY_AFTER: "1"}  # (a request in flight lasts about that long)
            resp = openai_error(429, msg, type_="server_error", code="saturated", headers=hdrs) \
                if api is Api.OPENAI else sagemaker_error("ThrottlingException", msg, status=429, headers=hdrs)
            return [self._immediate(self._counted(resp))]
        self.lease = lease
        self.phase = _Phase.UPSTREAM
        m = self.state.metrics
        count_routed(self.state, rr, decision)
        m.decision_seconds.labels(rr.endpoint, rr.pool.name).observe(decision.decision_s)
        if answer == "body":
            return [self._destination(decision.instance.instance_id, rr.upstream_path,
                                      body=rr.body if self._decoded else None)]
        out = [self._destination(decision.instance.instance_id, rr.upstream_path)]
        if answer == "streamed":
            out.extend(_body_chunks(rr.body))
        return out

    def _passthrough(self, end_of_stream: bool) -> list[pb.ProcessingResponse]:
        """Not an inference route: any healthy instance of the default variant, now
        (with a body, Envoy is asked not to send it here, when it may: ``mode_override``)."""
        try:
            pool = self.state.fleet.default.variant(self._headers.get(H.TARGET_VARIANT))
            self.lease = pool.acquire(None)
        except (NoHealthyInstance, LookupError) as exc:
            resp = openai_error(503, str(exc), type_="server_error", code="no_healthy_instance",
                                headers={H.REQUEST_ID: self._rid})
            return [self._immediate(resp)]
        self._endpoint, self._variant = self.state.fleet.default.name, pool.name
        self.phase = _Phase.UPSTREAM
        out = self._destination(self.lease.instance.instance_id)
        if not end_of_stream and self.request_body_mode not in (FULL_DUPLEX, NONE):
            out.mode_override.request_body_mode = NONE
            out.mode_override.response_body_mode = self.response_body_mode
        return [out]

    # -- response -------------------------------------------------------------------

    def _response_headers(self, msg: pb.HttpHeaders) -> list[pb.ProcessingResponse]:
        content_type = None
        for h in msg.headers.headers:
            key = h.key
            if key == ":status":
                value = h.raw_value.decode("latin-1") if h.raw_value else h.value
                self.status = int(value) if value.isdigit() else 0
            elif key == "content-type":
                content_type = h.raw_value.decode("latin-1") if h.raw_value else h.value
        mutation = pb.HeaderMutation()
        if self._route is not None and self._route.api is Api.NATIVE_STREAM and 200 <= self.status < 300:
            # as serve answers InvokeEndpointWithResponseStream: the model's content type moves to
            # X-Amzn-SageMaker-Content-Type and each body chunk becomes a PayloadPart event
            self._framed = True
            if content_type:
                mutation.set_headers.append(_header(H.SAGEMAKER_CONTENT_TYPE.lower(), content_type))
            mutation.set_headers.append(_header("content-type", eventstream.CONTENT_TYPE))
            mutation.remove_headers.append("content-length")
        if self.lease is not None:
            d = self.lease.decision
            for name, value in ((H.INSTANCE, d.instance.instance_id), (H.DECISION, d.kind.value),
                                (H.INVOKED_VARIANT, d.variant)):
                mutation.set_headers.append(_header(name.lower(), value))
            if self._component is not None:
                mutation.set_headers.append(_header(H.INVOKED_COMPONENT.lower(), self._component))
        out = pb.ProcessingResponse(response_headers=pb.HeadersResponse(response=pb.CommonResponse(
            header_mutation=mutation)))
        if msg.end_of_stream:
            self._finish()
        elif self.response_body_mode == NONE:
            # The body goes from the instance to the client without the picker, unless it
            # must be reframed, or it is an event stream (its first event is the TTFT): then
            # it comes here chunk by chunk (STREAMED: each chunk answered, changed or not).
            if self._framed or (content_type or "").startswith("text/event-stream"):
                out.mode_override.request_body_mode = self.request_body_mode
                out.mode_override.response_body_mode = STREAMED
                self.response_body_mode = STREAMED
            else:  # a whole answer: its first byte follows its headers at once
                self._first_body_byte()
        return [out]

    def _response_body(self, msg: pb.HttpBody) -> list[pb.ProcessingResponse]:
        if not self._first_byte and msg.body:
            self._first_body_byte()
        if self.response_body_mode == FULL_DUPLEX:  # Envoy sends on only what comes back
            body = eventstream.payload_part(msg.body) if self._framed and msg.body else msg.body
            out = pb.ProcessingResponse(response_body=pb.BodyResponse(response=pb.CommonResponse(
                body_mutation=pb.BodyMutation(streamed_response=pb.StreamedBodyResponse(
                    body=body, end_of_stream=msg.end_of_stream)))))
        elif self._framed and msg.body:  # STREAMED (or BUFFERED): the chunk replaced
            out = pb.ProcessingResponse(response_body=pb.BodyResponse(response=pb.CommonResponse(
                body_mutation=pb.BodyMutation(body=eventstream.payload_part(msg.body)))))
        else:
            out = _CONTINUE_RESPONSE_BODY
        if msg.end_of_stream:
            self._finish()
        return [out]

    def _first_body_byte(self) -> None:
        self._first_byte = True
        if self.lease is not None:
            self.lease.first_token()
        if self._variant:
            self.state.metrics.ttft_seconds.labels(self._endpoint, self._variant).observe(
                time.perf_counter() - self._t0)

    def _finish(self) -> None:
        if self.lease is not None and not self.lease.released:
            self.lease.release()
            self._count(self.status or 502)
        self.phase = _Phase.DONE

    # -- building messages ----------------------------------------------------------

    def _destination(self, instance_id: str, upstream_path: str | None = None, *,
                     body: bytes | None | Literal[False] = False) -> pb.ProcessingResponse:
        """Where to send it (header, ``envoy.lb`` metadata), and the path on the
        instance when it differs from the client's (``/endpoints/NAME/invocations`` ->
        ``/invocations``, as ``serve`` sends it): the request headers' answer, or with
        ``body`` (``None``: unchanged, bytes: replaced) the whole body's."""
        address = endpoint_address(instance_id)
        mutation = pb.HeaderMutation(set_headers=[_header(DESTINATION_HEADER, address)])
        if upstream_path and upstream_path != self._headers.get(":path"):
            mutation.set_headers.append(_header(":path", upstream_path))
        if self._decoded:  # the body goes on decoded, as serve sends it
            mutation.remove_headers.extend(["content-encoding", "content-length"])
        metadata = struct_pb2.Struct()
        metadata.update({METADATA_NAMESPACE: {DESTINATION_HEADER: address}})
        common = pb.CommonResponse(header_mutation=mutation, clear_route_cache=True)
        if body is False:
            return pb.ProcessingResponse(request_headers=pb.HeadersResponse(response=common),
                                         dynamic_metadata=metadata)
        if body is not None:
            common.body_mutation.body = body
        return pb.ProcessingResponse(request_body=pb.BodyResponse(response=common), dynamic_metadata=metadata)

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
