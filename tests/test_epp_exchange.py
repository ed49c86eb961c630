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
from prefixroute.epp.exchange import MAX_CHUNK_BYTES, EppOptions, Exchange, endpoint_address
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
    code, _, body = immediate(run(Exchange(st_, EppOptions("reject")), [headers_msg(), *body_msgs(chat())]))
    assert code == 429 and body["error"]["code"] == "saturated"
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
                view.add_instance(u).on_connected()
            doc = f"document held by {holder}: " + "tokens of a long shared document " * 60
            ids = tok.request_token_ids(json.loads(chat(doc)), True)
            n = len(ids) // 16 * 16
            view.stream(holder).index.apply([BlockStored(list(range(1, n // 16 + 1)), None, ids[:n], 16)])
            ex = Exchange(st_)
            pickers.append(destination(run(ex, [headers_msg(), *body_msgs(chat(doc + " and a question?"))])[0]))
            assert ex.lease.decision.kind.value == "affinity"
            ex.close()
        assert pickers == [endpoint_address(holder)] * 2
