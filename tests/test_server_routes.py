"""Routes, headers, error shapes, streaming relay and metrics of the HTTP router."""

from __future__ import annotations

import asyncio
import gzip
import io
import time

import aiohttp
import orjson
import pytest

from prefixroute.core.config import RoutingConfig
from prefixroute.server.metrics import METRIC_NAMES
from prefixroute.server.models import refresh_models
from test_server_helpers import FakeInstance, eventually, in_flight, metric_value, router_for

CHAT = {"model": "m", "messages": [{"role": "system", "content": "S" * 2000}, {"role": "user", "content": "hi"}]}


@pytest.fixture
async def backends():
    insts = [await FakeInstance().start() for _ in range(2)]
    yield insts
    for b in insts:
        await b.stop()


@pytest.fixture
async def router(backends, data_plane):
    handle = await router_for([b.url for b in backends], data_plane=data_plane)
    yield handle
    await handle.close()


@pytest.fixture
async def http():
    async with aiohttp.ClientSession() as s:
        yield s


def _backend(backends, url):
    return next(b for b in backends if b.url == url)


async def test_chat_forwarded_unchanged_with_routing_headers(router, backends, http):
    raw = b'{"model":"m",  "messages":[{"role":"user","content":"hello \xc3\xa9"}],"temperature":0.5}'
    async with http.post(router.url + "/v1/chat/completions", data=raw,
                         headers={"Content-Type": "application/json", "X-Request-Id": "rid-1",
                                  "Authorization": "Bearer k"}) as r:
        assert r.status == 200
        data = await r.json()
        h = r.headers
        assert h["X-Amzn-Invoked-Production-Variant"] == "AllTraffic"
        assert h["X-Prefixroute-Decision"] == "affinity"
        assert h["X-Request-Id"] == "rid-1"
        assert h["X-Prefixroute-Instance"] in {b.url for b in backends}
        assert 0 < float(h["X-Prefixroute-Overhead-Ms"]) < 1000
        assert h["X-Amzn-SageMaker-Custom-Attributes"] == "attr=1"
        assert "Keep-Alive" not in h  # hop-by-hop from the instance is dropped
    assert data["path"] == "/v1/chat/completions"
    inst = _backend(backends, h["X-Prefixroute-Instance"])
    path, headers, body = inst.received[-1]
    assert body == raw  # byte for byte
    assert headers["X-Request-Id"] == "rid-1"
    assert headers["Authorization"] == "Bearer k"
    assert headers["Accept-Encoding"] == "gzip, deflate"  # the client's own choice passes


async def test_compressed_request_body_forwarded_decoded(router, backends, http):
    raw = orjson.dumps(CHAT)
    async with http.post(router.url + "/v1/chat/completions", data=gzip.compress(raw),
                         headers={"Content-Encoding": "gzip", "Content-Type": "application/json"}) as r:
        assert r.status == 200
        inst = _backend(backends, r.headers["X-Prefixroute-Instance"])
    _, headers, body = inst.received[-1]
    assert body == raw and "Content-Encoding" not in headers


async def test_request_id_generated_and_sent_upstream(router, backends, http):
    async with http.post(router.url + "/v1/completions", json={"model": "m", "prompt": "x"}) as r:
        assert r.status == 200
        rid = r.headers["X-Request-Id"]
        inst = _backend(backends, r.headers["X-Prefixroute-Instance"])
    assert len(rid) == 32 and int(rid, 16) >= 0
    assert inst.received[-1][0] == "/v1/completions"
    assert inst.received[-1][1]["X-Request-Id"] == rid


async def test_hop_by_hop_request_headers_not_forwarded(router, backends, http):
    async with http.post(router.url + "/v1/completions", json={"model": "m", "prompt": "x"},
                         headers={"Connection": "keep-alive, X-Secret-Hop", "X-Secret-Hop": "1", "TE": "trailers",
                                  "Proxy-Authorization": "p", "X-Kept": "yes"},
                         skip_auto_headers=["Accept-Encoding"]) as r:
        inst = _backend(backends, r.headers["X-Prefixroute-Instance"])
    headers = inst.received[-1][1]
    assert headers["X-Kept"] == "yes"
    for name in ("X-Secret-Hop", "TE", "Proxy-Authorization"):
        assert name not in headers
    assert headers["Host"] == inst.url.removeprefix("http://")
    assert headers["Accept-Encoding"] == "identity"  # bytes are relayed undecoded


async def test_sagemaker_openai_paths_and_models(router, backends, http):
    async with http.post(router.url + "/endpoints/default/openai/v1/chat/completions", json=CHAT) as r:
        assert r.status == 200
        assert (await r.json())["path"] == "/v1/chat/completions"
    received = sum(len(b.received) for b in backends)
    async with http.post(router.url + "/endpoints/default/inference-components/ic1/openai/v1/completions",
                         json={"model": "m", "prompt": "p"}) as r:  # the endpoint has no inference component
        assert r.status == 400
        assert (await r.json())["error"]["code"] == "inference_component_not_found"
    assert sum(len(b.received) for b in backends) == received
    for path in ("/v1/models", "/endpoints/default/openai/v1/models"):
        async with http.get(router.url + path) as r:  # the union of the instances' lists
            assert r.status == 200
            assert [m["id"] for m in (await r.json())["data"]] == ["fake", "m"]
    for b in backends:
        b.models = None  # no instance lists its models: one instance's answer, as it is
    await refresh_models(router.state)
    async with http.get(router.url + "/v1/models") as r:
        assert r.status == 404 and r.headers["X-Prefixroute-Instance"] in {b.url for b in backends}
    assert in_flight(router) == 0


async def test_native_invocations(router, backends, http):
    raw = b'{"inputs": "abc"}'
    for path in ("/endpoints/default/invocations", "/invocations"):
        async with http.post(router.url + path, data=raw,
                             headers={"Content-Type": "application/json", "Authorization": "AWS4 secret",
                                      "X-Amzn-SageMaker-Custom-Attributes": "c=1"}) as r:
            assert r.status == 200
            assert r.headers["X-Amzn-Invoked-Production-Variant"] == "AllTraffic"
            assert r.headers["X-Amzn-SageMaker-Custom-Attributes"] == "attr=1"
            assert r.headers["Content-Type"] == "application/json"
            data = await r.json()
        assert data["path"] == "/invocations"
        assert data["body"] == raw.decode()
        assert data["headers"]["X-Amzn-SageMaker-Custom-Attributes"] == "c=1"
        assert "Authorization" not in data["headers"]  # AWS signature stays at the router


async def test_native_key_is_first_prefix_length_bytes(router, backends, http):
    head = b"H" * 1024
    seen = set()
    for tail in (b"1", b"22", b"tail-" * 50):
        async with http.post(router.url + "/invocations", data=head + tail) as r:
            assert r.status == 200
            seen.add(r.headers["X-Prefixroute-Instance"])
    assert len(seen) == 1  # only the first PrefixLength bytes decide


async def test_tenant_header_validation(router, http):
    for bad in ("x" * 65, "tab\there", "caf\u00e9"):
        async with http.post(router.url + "/invocations", data=b"{}",
                             headers={"X-Amzn-SageMaker-Prefix-Aware-Id": bad.encode("utf-8").decode("latin-1")}) as r:
            assert r.status == 400
            assert r.headers["x-amzn-ErrorType"] == "ValidationError"
            msg = (await r.json())["message"]
            assert "X-Amzn-SageMaker-Prefix-Aware-Id" in msg and "prefix-aware id" in msg
    async with http.post(router.url + "/invocations", data=b"{}",
                         headers={"X-Amzn-SageMaker-Prefix-Aware-Id": "tenant-A"}) as r:
        assert r.status == 200
    assert in_flight(router) == 0


async def test_tenant_separates_identical_prompts(backends, http):
    handle = await router_for([b.url for b in backends])
    try:
        body = b"P" * 2048
        by_tenant = {}
        for i in range(40):
            async with http.post(handle.url + "/invocations", data=body,
                                 headers={"X-Amzn-SageMaker-Prefix-Aware-Id": f"t{i}"}) as r:
                by_tenant[i] = r.headers["X-Prefixroute-Instance"]
        assert len(set(by_tenant.values())) == 2  # 40 tenants never all land on one of two instances
    finally:
        await handle.close()


@pytest.mark.parametrize("raw,needle", [
    (b"{not json", "not valid JSON"),
    (b"[1, 2]", "JSON object"),
    (b'{"model": 5, "messages": []}', "'model'"),
    (b'{"model": "m", "messages": "hi"}', "'messages'"),
    (b'{"model": "m", "messages": [], "stream": "yes"}', "'stream'"),
    (b'{"model": "m", "messages": [], "prompt_cache_key": [1]}', "'prompt_cache_key' must be a string"),
    (b'{"model": "m", "messages": [], "cache_salt": ""}', "'cache_salt' must be a non-empty string"),
])
async def test_openai_400_shape(router, http, raw, needle):
    async with http.post(router.url + "/v1/chat/completions", data=raw) as r:
        assert r.status == 400
        err = (await r.json())["error"]
    assert err["type"] == "invalid_request_error" and err["param"] is None and err["code"] is None
    assert needle in err["message"]
    assert in_flight(router) == 0


async def test_openai_400_without_prefix_aware(backends, http):
    handle = await router_for([b.url for b in backends], RoutingConfig.build("random"))
    try:
        for raw in (b'{"model": "m", "prompt": 3}', b'{"model": "m", "messages": [1]}'):
            path = "/v1/completions" if b"prompt" in raw else "/v1/chat/completions"
            async with http.post(handle.url + path, data=raw) as r:
                assert r.status == 400
                assert (await r.json())["error"]["type"] == "invalid_request_error"
        async with http.post(handle.url + "/v1/completions", json={"model": "m", "prompt": "ok"}) as r:
            assert r.status == 200 and r.headers["X-Prefixroute-Decision"] == "random"
    finally:
        await handle.close()


async def test_unknown_endpoint_and_variant(router, http):
    async with http.post(router.url + "/endpoints/nope/openai/v1/chat/completions", json=CHAT) as r:
        assert r.status == 404
        assert "nope" in (await r.json())["error"]["message"]
    async with http.post(router.url + "/endpoints/nope/invocations", data=b"x") as r:
        assert r.status == 404
        assert r.headers["x-amzn-ErrorType"] == "ValidationError"
        assert "nope" in (await r.json())["message"]
    async with http.post(router.url + "/v1/chat/completions", json=CHAT,
                         headers={"X-Amzn-SageMaker-Target-Variant": "Blue"}) as r:
        assert r.status == 400
        assert "Blue" in (await r.json())["error"]["message"]
    async with http.post(router.url + "/invocations", data=b"x",
                         headers={"X-Amzn-SageMaker-Target-Variant": "Blue"}) as r:
        assert r.status == 400 and r.headers["x-amzn-ErrorType"] == "ValidationError"
    async with http.post(router.url + "/v1/chat/completions", json=CHAT,
                         headers={"X-Amzn-SageMaker-Target-Variant": "AllTraffic"}) as r:
        assert r.status == 200


async def test_no_healthy_instance_503(router, http):
    for _, pool in router.fleet.all_pools():
        for inst in pool.instances:
            pool.set_healthy(inst.instance_id, False)
    async with http.post(router.url + "/v1/chat/completions", json=CHAT) as r:
        assert r.status == 503
        err = (await r.json())["error"]
        assert err["code"] == "no_healthy_instance" and "no healthy instance" in err["message"]
    async with http.post(router.url + "/invocations", data=b"x") as r:
        assert r.status == 503 and r.headers["x-amzn-ErrorType"] == "ServiceUnavailable"
    for path in ("/health", "/ping"):
        async with http.get(router.url + path) as r:
            assert r.status == 503
            assert (await r.json()) == {"status": "unavailable", "message": "no instance is healthy",
                                        "variants_down": ["default/AllTraffic"], "healthy_instances": 0,
                                        "instances": 2}
    async with http.get(router.url + "/v1/models") as r:
        assert r.status == 503


async def test_health_ok(router, http):
    async with http.get(router.url + "/health") as r:
        assert r.status == 200
        assert await r.json() == {"status": "ok", "message": "2 of 2 instances healthy", "variants_down": [],
                                  "healthy_instances": 2, "instances": 2}


async def test_upstream_error_status_passed_through(router, backends, http):
    for b in backends:
        b.mode, b.status, b.body = "status", 422, b'{"error": {"message": "bad"}}'
    async with http.post(router.url + "/v1/chat/completions", json=CHAT) as r:
        assert r.status == 422
        assert await r.read() == b'{"error": {"message": "bad"}}'
        assert r.headers["X-Prefixroute-Decision"] == "affinity"


async def test_native_model_error_424(router, backends, http):
    for b in backends:
        b.mode, b.status, b.body = "status", 500, b'{"detail": "engine exploded"}'
    async with http.post(router.url + "/invocations", data=b'{"inputs": 1}') as r:
        assert r.status == 424
        assert r.headers["x-amzn-ErrorType"] == "ModelError"
        body = await r.json()
    assert body["OriginalStatusCode"] == 500
    assert body["OriginalMessage"] == '{"detail": "engine exploded"}'
    assert "(500)" in body["message"]
    assert in_flight(router) == 0


async def test_sse_relayed_chunk_by_chunk(router, backends, http):
    for b in backends:
        b.mode = "stream"
        b.gates = [asyncio.Event(), asyncio.Event(), asyncio.Event()]
        b.gates[0].set()  # the first chunk goes at once; the rest wait for the test
    async with http.post(router.url + "/v1/chat/completions", json={**CHAT, "stream": True}) as r:
        assert r.status == 200
        assert r.headers["Content-Type"] == "text/event-stream"
        inst = _backend(backends, r.headers["X-Prefixroute-Instance"])
        first = await asyncio.wait_for(r.content.readuntil(b"\n\n"), 2)
        received_at = time.perf_counter()
        assert first == b"data: 1\n\n"
        assert len(inst.sent) == 1  # the instance has not sent the second chunk yet
        inst.gates[1].set()
        second = await asyncio.wait_for(r.content.readuntil(b"\n\n"), 2)
        assert second == b"data: 2\n\n" and inst.sent[1] > received_at
        inst.gates[2].set()
        assert await r.read() == b"data: [DONE]\n\n"
    assert in_flight(router) == 0


async def test_metrics_values(router, backends, http):
    for _ in range(3):
        async with http.post(router.url + "/v1/chat/completions", json=CHAT) as r:
            assert r.status == 200
            inst = r.headers["X-Prefixroute-Instance"]
    async with http.post(router.url + "/v1/chat/completions", data=b"nope") as r:
        assert r.status == 400
    async with http.post(router.url + "/endpoints/evil-name-123/invocations", data=b"x") as r:
        assert r.status == 404
    async with http.get(router.url + "/metrics") as r:
        assert r.status == 200
        assert r.headers["Content-Type"].startswith("text/plain")
        text = await r.text()
    for name in METRIC_NAMES:
        assert f"# TYPE {name}" in text
    lbl = dict(endpoint="default", variant="AllTraffic")
    assert metric_value(text, "prefixroute_requests_total", **lbl, instance=inst, decision="affinity") == 3
    assert metric_value(text, "prefixroute_responses_total", **lbl, code="200") == 3
    assert metric_value(text, "prefixroute_responses_total", **lbl, code="400") == 1
    assert metric_value(text, "prefixroute_responses_total", endpoint="unknown", variant="", code="404") == 1
    assert "evil-name-123" not in text
    assert metric_value(text, "prefixroute_in_flight", **lbl, instance=inst) == 0
    assert metric_value(text, "prefixroute_instance_healthy", **lbl, instance=inst) == 1
    for h in ("routing_decision_seconds", "ttft_seconds", "router_overhead_seconds"):
        assert metric_value(text, f"prefixroute_{h}_count", **lbl) == 3
    # Every answer has a duration, the router's own 400 and 404 included.
    assert metric_value(text, "prefixroute_request_duration_seconds_count", **lbl) == 4
    assert metric_value(text, "prefixroute_request_duration_seconds_count", endpoint="unknown", variant="") == 1
    assert metric_value(text, "prefixroute_routing_decision_seconds_bucket", **lbl, le="1e-06") is not None
    assert "S" * 50 not in text  # never prompt text


async def test_in_flight_gauge_is_live(router, backends, http):
    for b in backends:
        b.mode = "hold"
    task = asyncio.create_task(http.post(router.url + "/v1/chat/completions", json=CHAT))
    assert await eventually(lambda: in_flight(router) == 1)
    async with http.get(router.url + "/metrics") as r:
        text = await r.text()
    held = [i.instance_id for _, p in router.fleet.all_pools() for i in p.instances if i.in_flight]
    assert metric_value(text, "prefixroute_in_flight", endpoint="default", variant="AllTraffic",
                        instance=held[0]) == 1
    for b in backends:
        b.gate.set()
    resp = await task
    assert resp.status == 200
    resp.release()
    assert in_flight(router) == 0


async def test_large_body_and_orjson_body(router, backends, http):
    payload = {"model": "m", "messages": [{"role": "user", "content": "x" * 3_000_000}]}
    raw = orjson.dumps(payload)
    async with http.post(router.url + "/v1/chat/completions", data=io.BytesIO(raw)) as r:
        assert r.status == 200
        inst = _backend(backends, r.headers["X-Prefixroute-Instance"])
    assert inst.received[-1][2] == raw
