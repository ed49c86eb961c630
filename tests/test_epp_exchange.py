"""The ext_proc state machine (prefixroute.epp.exchange) without gRPC or Envoy:
messages in, messages out, in-flight accounting, error answers the same as serve's."""

from __future__ import annotations

import json

import orjson
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixroute.core.config import FleetConfig, RoutingConfig
from prefixroute.epp.exchange import (BUFFERED, MAX_CHUNK_BYTES, NONE, STREAMED, EppOptions, Exchange,
                                      endpoint_address)
from prefixroute.server.settings import ServerSettings
from prefixroute.server.state import RouterState

URLS = ["http://10.0.0.1:8000", "http://10.0.0.2:8000", "http://[fd00::3]:8000"]
PA = RoutingConfig.build("prefix-aware", 1024, 2)


def state(max_body: int = 1 << 20, urls=URLS) -> RouterState:
    return RouterState(FleetConfig.single(urls, PA), ServerSettings(port=0, admin_port=0, max_body_bytes=max_body,
                                                                    health_check_interval_s=0))


def headers_msg(path: str = "/v1/chat/completions", method: str = "POST", eos: bool = False,
                **extra: str) -> pb.ProcessingRequest:
    hs = [(":method", method), (":path", path), (":authority", "gw"), ("content-type", "application/json"),
          *((k.replace("_", "-"), v) for k, v in extra.items())]
    return pb.ProcessingRequest(request_headers=pb.HttpHeaders(
        headers=base_pb2.HeaderMap(headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in hs]),
        end_of_stream=eos))


def body_msgs(body: bytes, chunk: int = 10_000) -> list[pb.ProcessingRequest]:
    parts = [body[i:i + chunk] for i in range(0, len(body), chunk)] or [b""]
    return [pb.ProcessingRequest(request_body=pb.HttpBody(body=p, end_of_stream=i == len(parts) - 1))
            for i, p in enumerate(parts)]


def chat(prompt: str = "P" * 3000) -> bytes:
    return orjson.dumps({"model": "m", "messages": [{"role": "user", "content": prompt}], "max_tokens": 1})


def run(ex: Exchange, msgs: list[pb.ProcessingRequest]) -> list[pb.ProcessingResponse]:
    out = []
    for m in msgs:
        out.extend(ex.handle(m))
    return out


def destination(resp: pb.ProcessingResponse) -> str:
    (h,) = [o.header for o in resp.request_headers.response.header_mutation.set_headers
            if o.header.key == "x-gateway-destination-endpoint"]
    return h.raw_value.decode()


def test_endpoint_address():
    assert endpoint_address("http://10.0.0.1:8000") == "10.0.0.1:8000"
    assert endpoint_address("http://[fd00::3]:8000") == "[fd00::3]:8000"


def test_headers_wait_for_the_body_then_destination_and_body_chunks():
    st_ = state()
    ex = Exchange(st_)
    body = chat("x" * 150_000)
    assert ex.handle(headers_msg()) == []  # deferred until the body is whole
    out = run(ex, body_msgs(body))
    first, *chunks = out
    assert first.WhichOneof("response") == "request_headers"
    dest = destination(first)
    assert dest in {endpoint_address(u) for u in URLS}
    assert first.request_headers.response.clear_route_cache
    meta = json.loads(json.dumps(dict(first.dynamic_metadata)["envoy.lb"], default=dict))
    assert meta == {"x-gateway-destination-endpoint": dest}  # header and metadata match
    sent = [c.request_body.response.body_mutation.streamed_response for c in chunks]
    assert b"".join(s.body for s in sent) == body
    assert all(len(s.body) <= MAX_CHUNK_BYTES for s in sent) and len(sent) == 3
    assert [s.end_of_stream for s in sent] == [False, False, True]
    assert ex.lease is not None and st_.fleet.default.variant().total_in_flight() == 1
    # response: headers get the decision, body chunks are echoed, the lease ends with the stream
    resp_h = ex.handle(pb.ProcessingRequest(response_headers=pb.HttpHeaders(headers=base_pb2.HeaderMap(
        headers=[base_pb2.HeaderValue(key=":status", raw_value=b"200")]))))
    set_h = {o.header.key: o.header.raw_value.decode() for o in resp_h[0].response_headers.response.header_mutation
             .set_headers}
    assert set_h["x-prefixroute-decision"] == "affinity" and endpoint_address(set_h["x-prefixroute-instance"]) == dest
    echo = ex.handle(pb.ProcessingRequest(response_body=pb.HttpBody(body=b"data: 1\n\n")))
    assert echo[0].response_body.response.body_mutation.streamed_response.body == b"data: 1\n\n"
    assert st_.fleet.default.variant().total_in_flight() == 1
    ex.handle(pb.ProcessingRequest(response_body=pb.HttpBody(body=b"", end_of_stream=True)))
    assert st_.fleet.default.variant().total_in_flight() == 0
    ex.close()  # idempotent
    assert st_.fleet.default.variant().total_in_flight() == 0


def test_same_prefix_same_instance_and_agreement_between_pickers():
    """Two pickers (two Envoy replicas) pick the same instance for the same prompt
    without talking: rendezvous hashing over the same membership."""
    a, b = state(), state()
    for i in range(20):
        body = chat(f"document {i} " * 200)
        ea, eb = Exchange(a), Exchange(b)
        da = destination(run(ea, [headers_msg(), *body_msgs(body)])[0])
        db = destination(run(eb, [headers_msg(), *body_msgs(body)])[0])
        assert da == db and ea.lease.decision.kind.value == "affinity"
        ea.close()
        eb.close()
    assert a.fleet.default.variant().total_in_flight() == 0


def immediate(out: list[pb.ProcessingResponse]) -> tuple[int, dict, dict]:
    (r,) = out
    assert r.WhichOneof("response") == "immediate_response"
    imm = r.immediate_response
    hdrs = {o.header.key: o.header.raw_value.decode() for o in imm.headers.set_headers}
    return imm.status.code, hdrs, json.loads(imm.body)


def test_malformed_body_is_the_same_400_as_serve():
    st_ = state()
    code, hdrs, body = immediate(run(Exchange(st_), [headers_msg(), *body_msgs(b"{not json")]))
    assert code == 400 and body["error"]["type"] == "invalid_request_error" and hdrs["x-request-id"]
    code, _, body = immediate(run(Exchange(st_), [headers_msg(), *body_msgs(b'{"model": "m"}')]))
    assert code == 400 and "messages" in body["error"]["message"]
    code, _, body = immediate(run(Exchange(st_), [headers_msg(eos=True)]))  # no body at all
    assert code == 400
    assert st_.fleet.default.variant().total_in_flight() == 0


def test_oversized_body_413_declared_and_streamed():
    st_ = state(max_body=50_000)
    code, _, body = immediate(run(Exchange(st_), [headers_msg(content_length="60000")]))
    assert code == 413 and "60,000 bytes" in body["error"]["message"]
    ex = Exchange(st_)
    out = run(ex, [headers_msg(), *body_msgs(chat("y" * 80_000), chunk=20_000)])
    code, _, body = immediate(out)  # answered as soon as it went past the limit; the rest ignored
    assert code == 413 and "limit is 50,000 bytes" in body["error"]["message"]
    assert ex.lease is None


def test_unknown_endpoint_404_and_native_errors():
    st_ = state()
    code, hdrs, body = immediate(run(Exchange(st_), [headers_msg("/endpoints/nope/invocations")]))
    assert code == 404 and hdrs["x-amzn-errortype"] == "ValidationError"
    code, _, _ = immediate(run(Exchange(st_), [headers_msg("/endpoints/default/invocations",
                                                           x_amzn_sagemaker_target_variant="Nope")]))
    assert code == 400


def test_native_invocations_route_on_the_raw_bytes():
    st_ = state()
    body = b'{"inputs": "' + b"z" * 3000 + b'"}'
    dests = set()
    for _ in range(5):
        ex = Exchange(st_)
        dests.add(destination(run(ex, [headers_msg("/endpoints/default/invocations"), *body_msgs(body)])[0]))
        assert ex.lease.decision.kind.value == "affinity"
        ex.close()
    assert len(dests) == 1


def test_no_healthy_instance_503_and_saturated_429():
    st_ = state()
    for u in URLS:
        st_.set_healthy(u, False)
    code, _, body = immediate(run(Exchange(st_), [headers_msg(), *body_msgs(chat())]))
    assert code == 503 and body["error"]["code"] == "no_healthy_instance"
    st_ = state(urls=URLS[:1])  # one instance, ConcurrencyThreshold 2
    held = [Exchange(st_, EppOptions("reject")) for _ in range(2)]
    for ex in held:
        run(ex, [headers_msg(), *body_msgs(chat())])
    code, hdrs, body = immediate(run(Exchange(st_, EppOptions("reject")), [headers_msg(), *body_msgs(chat())]))
    assert code == 429 and body["error"]["code"] == "saturated" and hdrs["retry-after"] == "1"
    out = run(Exchange(st_, EppOptions("send")), [headers_msg(), *body_msgs(chat())])
    assert destination(out[0]) == "10.0.0.1:8000"  # serve's behaviour: the least busy, over the threshold
    assert st_.fleet.default.variant().total_in_flight() == 3


def test_gzip_body_is_decoded_and_sent_on_decoded():
    import gzip

    st_ = state()
    raw = chat()
    out = run(Exchange(st_), [headers_msg(content_encoding="gzip"), *body_msgs(gzip.compress(raw))])
    mutation = out[0].request_headers.response.header_mutation
    assert "content-encoding" in mutation.remove_headers
    assert b"".join(o.request_body.response.body_mutation.streamed_response.body for o in out[1:]) == raw


def test_non_inference_request_goes_at_once():
    st_ = state()
    ex = Exchange(st_)
    out = ex.handle(headers_msg("/v1/models", method="GET", eos=True))
    assert destination(out[0]) in {endpoint_address(u) for u in URLS}
    ex.handle(pb.ProcessingRequest(response_headers=pb.HttpHeaders(end_of_stream=True)))
    assert st_.fleet.default.variant().total_in_flight() == 0


def test_stream_cut_releases_and_counts_499():
    st_ = state()
    ex = Exchange(st_)
    run(ex, [headers_msg(), *body_msgs(chat())])
    assert st_.fleet.default.variant().total_in_flight() == 1
    ex.close()
    assert st_.fleet.default.variant().total_in_flight() == 0
    text = st_.metrics.render().decode()
    assert 'prefixroute_responses_total{code="499",endpoint="default",variant="AllTraffic"} 1.0' in text


@settings(max_examples=60, deadline=None)
@given(cut=st.integers(0, 12), status=st.sampled_from([b"200", b"500", b"429"]), chunks=st.integers(1, 4))
def test_in_flight_returns_to_zero_wherever_the_stream_ends(cut: int, status: bytes, chunks: int):
    st_ = state()
    msgs = [headers_msg(), *body_msgs(chat(), chunk=max(1, len(chat()) // chunks)),
            pb.ProcessingRequest(response_headers=pb.HttpHeaders(headers=base_pb2.HeaderMap(
                headers=[base_pb2.HeaderValue(key=":status", raw_value=status)]))),
            pb.ProcessingRequest(response_body=pb.HttpBody(body=b"x")),
            pb.ProcessingRequest(response_body=pb.HttpBody(body=b"y", end_of_stream=True)),
            pb.ProcessingRequest(response_trailers=pb.HttpTrailers())]
    ex = Exchange(st_)
    run(ex, msgs[:cut])
    ex.close()
    assert st_.fleet.default.variant().total_in_flight() == 0


def test_precise_mode_picks_the_instance_whose_events_show_the_prompt():
    """The endpoint picker prepares requests as serve does (``prepare_inference``), so
    precise mode's KV block keys reach CACHE_AWARE here too: two pickers with empty
    learned views pick the instance whose events hold the prompt, whichever it is."""
    from prefixroute.core.kvevents.events import BlockStored
    from prefixroute.core.model_tokenizer import ModelTokenizer

    routing = RoutingConfig.build("cache-aware", concurrency_threshold=8)
    base = FleetConfig.single(URLS, routing).model_dump(by_alias=True)
    config = FleetConfig.from_mapping({**base, "KvEvents": {"Tokenizer": "tiny", "Instances": {
        u: {"Endpoint": f"tcp://127.0.0.{i + 1}:5557"} for i, u in enumerate(URLS)}}})
    tok = ModelTokenizer.load("tiny")
    for holder in URLS:
        pickers = []
        for _ in range(2):
            st_ = RouterState(config, ServerSettings(port=0, admin_port=0, health_check_interval_s=0))
            view = st_.kv_view
            assert view is not None
            for u in URLS:
                view.add_instance(u).on_connected(complete=True)
            doc = f"document held by {holder}: " + "tokens of a long shared document " * 60
            ids = tok.request_token_ids(json.loads(chat(doc)), True)
            n = len(ids) // 16 * 16
            view.stream(holder).index.apply([BlockStored(list(range(1, n // 16 + 1)), None, ids[:n], 16)])
            ex = Exchange(st_)
            pickers.append(destination(run(ex, [headers_msg(), *body_msgs(chat(doc + " and a question?"))])[0]))
            assert ex.lease.decision.kind.value == "affinity"
            ex.close()
        assert pickers == [endpoint_address(holder)] * 2


# -- Envoy's body modes: the picker's own bootstrap (request body BUFFERED, response body NONE)


def buffered_headers(path: str = "/v1/chat/completions", **kw) -> pb.ProcessingRequest:
    """Request headers with the ``protocol_config`` Envoy sends first: request body
    BUFFERED, response body NONE (:func:`prefixroute.epp.envoy_config.picker_bootstrap`)."""
    msg = headers_msg(path, **kw)
    msg.protocol_config.request_body_mode = BUFFERED
    msg.protocol_config.response_body_mode = NONE
    return msg


def response_headers(status: bytes = b"200", content_type: bytes = b"application/json",
                     eos: bool = False) -> pb.ProcessingRequest:
    return pb.ProcessingRequest(response_headers=pb.HttpHeaders(headers=base_pb2.HeaderMap(headers=[
        base_pb2.HeaderValue(key=":status", raw_value=status),
        base_pb2.HeaderValue(key="content-type", raw_value=content_type)]), end_of_stream=eos))


def whole_body(body: bytes, eos: bool = True) -> pb.ProcessingRequest:
    return pb.ProcessingRequest(request_body=pb.HttpBody(body=body, end_of_stream=eos))


def metric(st_: RouterState, line: str) -> float:
    for x in st_.metrics.render().decode().splitlines():
        if x.startswith(line):
            return float(x.rsplit(" ", 1)[1])
    return 0.0


def test_buffered_body_one_message_each_way_destination_in_the_body_answer():
    st_ = state()
    ex = Exchange(st_)
    body = chat("w" * 150_000)
    (first,) = ex.handle(buffered_headers())
    assert first.WhichOneof("response") == "request_headers" and first == pb.ProcessingResponse(
        request_headers=pb.HeadersResponse())  # CONTINUE at once: Envoy sends the body next
    assert ex.request_body_mode == BUFFERED and ex.response_body_mode == NONE
    (answer,) = ex.handle(whole_body(body))
    assert answer.WhichOneof("response") == "request_body"
    common = answer.request_body.response
    (h,) = [o.header for o in common.header_mutation.set_headers if o.header.key == "x-gateway-destination-endpoint"]
    dest = h.raw_value.decode()
    assert dest in {endpoint_address(u) for u in URLS} and common.clear_route_cache
    assert not common.HasField("body_mutation")  # Envoy holds the body: nothing echoed
    meta = json.loads(json.dumps(dict(answer.dynamic_metadata)["envoy.lb"], default=dict))
    assert meta == {"x-gateway-destination-endpoint": dest}
    assert st_.fleet.default.variant().total_in_flight() == 1
    # the response: headers answered with the decision; the body is not sent here (NONE),
    # so the lease lasts until the stream ends, which is the HTTP stream's end
    (resp_h,) = ex.handle(response_headers())
    set_h = {o.header.key: o.header.raw_value.decode() for o in resp_h.response_headers.response.header_mutation
             .set_headers}
    assert endpoint_address(set_h["x-prefixroute-instance"]) == dest and set_h["x-prefixroute-decision"]
    assert not resp_h.HasField("mode_override")
    assert metric(st_, "prefixroute_ttft_seconds_count") == 1  # a whole answer: its first byte follows at once
    assert st_.fleet.default.variant().total_in_flight() == 1
    ex.close()
    assert st_.fleet.default.variant().total_in_flight() == 0
    assert metric(st_, 'prefixroute_responses_total{code="200"') == 1  # the answer's status, not 499
    ex.close()
    assert metric(st_, 'prefixroute_responses_total{code="200"') == 1


def test_buffered_gzip_body_replaced_decoded():
    import gzip

    raw = chat()
    ex = Exchange(state())
    ex.handle(buffered_headers(content_encoding="gzip"))
    (answer,) = ex.handle(whole_body(gzip.compress(raw)))
    common = answer.request_body.response
    assert {"content-encoding", "content-length"} <= set(common.header_mutation.remove_headers)
    assert common.body_mutation.body == raw


def test_buffered_body_with_trailers_after_it_is_routed_at_once():
    """Envoy sends a buffered body without end of stream when request trailers follow:
    it is whole, and the headers can change only in its answer."""
    ex = Exchange(state())
    ex.handle(buffered_headers())
    (answer,) = ex.handle(whole_body(chat(), eos=False))
    assert answer.request_body.response.clear_route_cache and ex.lease is not None
    assert ex.handle(pb.ProcessingRequest(request_trailers=pb.HttpTrailers())) == [
        pb.ProcessingResponse(request_trailers=pb.TrailersResponse())]


def test_buffered_errors_and_413():
    st_ = state(max_body=50_000)
    out = run(Exchange(st_), [buffered_headers(), whole_body(b"{not json")])
    assert out[0] == pb.ProcessingResponse(request_headers=pb.HeadersResponse())
    code, _, _ = immediate(out[1:])
    assert code == 400
    code, _, body = immediate(run(Exchange(st_), [buffered_headers(content_length="60000")]))  # before the body
    assert code == 413
    ex = Exchange(st_)
    assert ex.handle(buffered_headers())[0].WhichOneof("response") == "request_headers"
    code, _, body = immediate(ex.handle(whole_body(chat("y" * 80_000))))  # chunked: Envoy buffered it all
    assert code == 413 and "limit is 50,000 bytes" in body["error"]["message"]
    assert st_.fleet.default.variant().total_in_flight() == 0


def test_event_stream_answer_asks_for_its_body_for_the_ttft_and_holds_the_lease_to_its_end():
    st_ = state()
    ex = Exchange(st_)
    run(ex, [buffered_headers(), whole_body(chat())])
    (resp_h,) = ex.handle(response_headers(content_type=b"text/event-stream"))
    assert resp_h.mode_override.response_body_mode == STREAMED  # only this stream's body
    assert resp_h.mode_override.request_body_mode == BUFFERED
    assert metric(st_, "prefixroute_ttft_seconds_count") == 0
    for chunk in (b"data: 1\n\n", b"data: [DONE]\n\n"):
        (out,) = ex.handle(pb.ProcessingRequest(response_body=pb.HttpBody(body=chunk)))
        assert out == pb.ProcessingResponse(response_body=pb.BodyResponse())  # CONTINUE: Envoy sends its own copy
        assert st_.fleet.default.variant().total_in_flight() == 1
    assert metric(st_, "prefixroute_ttft_seconds_count") == 1
    ex.handle(pb.ProcessingRequest(response_body=pb.HttpBody(body=b"", end_of_stream=True)))
    assert st_.fleet.default.variant().total_in_flight() == 0
    assert metric(st_, 'prefixroute_responses_total{code="200"') == 1


def test_event_stream_cut_before_its_end_is_499():
    st_ = state()
    ex = Exchange(st_)
    run(ex, [buffered_headers(), whole_body(chat()), response_headers(content_type=b"text/event-stream"),
             pb.ProcessingRequest(response_body=pb.HttpBody(body=b"data: 1\n\n"))])
    ex.close()
    assert st_.fleet.default.variant().total_in_flight() == 0
    assert metric(st_, 'prefixroute_responses_total{code="499"') == 1


def test_native_response_stream_reframed_chunk_by_chunk():
    from prefixroute.server import eventstream

    ex = Exchange(state())
    body = b'{"inputs": "' + b"z" * 3000 + b'"}'
    run(ex, [buffered_headers("/endpoints/default/invocations-response-stream"), whole_body(body)])
    (resp_h,) = ex.handle(response_headers(content_type=b"text/plain"))
    assert resp_h.mode_override.response_body_mode == STREAMED
    set_h = {o.header.key: o.header.raw_value.decode() for o in resp_h.response_headers.response.header_mutation
             .set_headers}
    assert set_h["content-type"] == eventstream.CONTENT_TYPE and set_h["x-amzn-sagemaker-content-type"] == "text/plain"
    (out,) = ex.handle(pb.ProcessingRequest(response_body=pb.HttpBody(body=b"part")))
    assert out.response_body.response.body_mutation.body == eventstream.payload_part(b"part")
    (out,) = ex.handle(pb.ProcessingRequest(response_body=pb.HttpBody(body=b"", end_of_stream=True)))
    assert not out.response_body.response.HasField("body_mutation") and ex.lease.released


def test_passthrough_with_a_body_asks_envoy_not_to_send_it():
    st_ = state()
    ex = Exchange(st_)
    (out,) = ex.handle(buffered_headers("/custom/upload"))
    assert destination(out) in {endpoint_address(u) for u in URLS}
    assert out.mode_override.request_body_mode == NONE and out.mode_override.response_body_mode == NONE
    # an Envoy that does not allow the override sends it all the same: let through
    assert ex.handle(whole_body(b"{}")) == [pb.ProcessingResponse(request_body=pb.BodyResponse())]
    ex.handle(response_headers())
    ex.close()
    assert st_.fleet.default.variant().total_in_flight() == 0


def test_a_request_body_mode_the_picker_cannot_route_on_is_a_500():
    msg = headers_msg()
    msg.protocol_config.request_body_mode = STREAMED
    code, _, body = immediate(Exchange(state()).handle(msg))
    assert code == 500 and body["error"]["code"] == "epp_misconfigured"


@settings(max_examples=60, deadline=None)
@given(cut=st.integers(0, 7), status=st.sampled_from([b"200", b"500"]),
       content_type=st.sampled_from([b"application/json", b"text/event-stream"]))
def test_buffered_in_flight_returns_to_zero_wherever_the_stream_ends(cut: int, status: bytes, content_type: bytes):
    st_ = state()
    msgs = [buffered_headers(), whole_body(chat()), response_headers(status, content_type),
            pb.ProcessingRequest(response_body=pb.HttpBody(body=b"x")),
            pb.ProcessingRequest(response_body=pb.HttpBody(body=b"y", end_of_stream=True)),
            pb.ProcessingRequest(response_trailers=pb.HttpTrailers())]
    ex = Exchange(st_)
    run(ex, msgs[:cut])
    ex.close()
    assert st_.fleet.default.variant().total_in_flight() == 0
    text = st_.metrics.render().decode()
    assert text.count("prefixroute_responses_total{") == (cut >= 2)  # counted once, once routed


def test_the_answer_names_the_inference_component_as_serve_does():
    cfg = FleetConfig.from_mapping({"Endpoints": [{
        "EndpointName": "llm", "ProductionVariants": [{"VariantName": "AllTraffic", "Instances": URLS[:2],
                                                      "RoutingConfig": PA.to_api()}],
        "InferenceComponents": [{"InferenceComponentName": "llama-ic", "ModelName": "llama",
                                 "Instances": [URLS[1]]}]}]})
    st_ = RouterState(cfg, ServerSettings(port=0, admin_port=0, health_check_interval_s=0))
    ex = Exchange(st_)
    ex.handle(headers_msg("/endpoints/llm/invocations", x_amzn_sagemaker_inference_component="llama-ic"))
    first, *_ = run(ex, body_msgs(orjson.dumps({"model": "llama", "prompt": "hi", "max_tokens": 1})))
    assert destination(first) == endpoint_address(URLS[1])  # the component's copy
    answer = ex.handle(response_headers())[0]
    names = {h.header.key: h.header.raw_value.decode()
             for h in answer.response_headers.response.header_mutation.set_headers}
    assert names["x-prefixroute-inference-component"] == "llama-ic" and names["x-prefixroute-instance"] == URLS[1]
