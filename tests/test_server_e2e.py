"""End to end: real emulated engines behind the router, driven by the official clients.

The ``openai`` and ``boto3`` clients are synchronous; they run in a worker thread so the
event loop (router and engines) keeps serving.
"""

from __future__ import annotations

import asyncio
import json
from collections import defaultdict

import aiohttp
import boto3
import openai
import pytest
from botocore.config import Config

from prefixroute.core.config import RoutingConfig
from prefixroute.engine.model import DEFAULT_MODEL, EngineConfig
from prefixroute.engine.server import start_engine_server
from test_server_helpers import FakeInstance, eventually, in_flight, router_for

pytestmark = pytest.mark.e2e

SYSTEM = "You are a careful assistant. Answer using the retrieved document. " * 30  # ~2,000 characters


async def _engines(n: int, time_scale: float):
    started = [await start_engine_server(EngineConfig(), time_scale=time_scale, instance_id=f"e{i}")
               for i in range(n)]
    return [r for r, _ in started], [f"http://127.0.0.1:{p}" for _, p in started]


@pytest.fixture
async def fleet():
    runners, urls = await _engines(3, time_scale=0.0)
    handle = await router_for(urls, RoutingConfig.build("prefix-aware", 1024, 8))
    yield handle, urls
    await handle.close()
    for r in runners:
        await r.cleanup()


def _openai(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=20)


def _sagemaker(url: str):
    return boto3.client("sagemaker-runtime", endpoint_url=url, region_name="us-east-1",
                        aws_access_key_id="x", aws_secret_access_key="x",
                        config=Config(retries={"max_attempts": 1, "mode": "standard"}))


async def test_openai_client_chat_and_completions(fleet):
    handle, urls = fleet
    client = _openai(handle.url)
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is in it?"}]

    def run():
        raw = client.chat.completions.with_raw_response.create(model=DEFAULT_MODEL, messages=messages, max_tokens=5)
        chat = raw.parse()
        stream = client.chat.completions.create(model=DEFAULT_MODEL, messages=messages, max_tokens=5, stream=True)
        deltas = [c.choices[0].delta.content for c in stream if c.choices]
        comp = client.completions.create(model=DEFAULT_MODEL, prompt=SYSTEM + "Q1", max_tokens=4)
        comp_stream = list(client.completions.create(model=DEFAULT_MODEL, prompt=SYSTEM + "Q1", max_tokens=4,
                                                     stream=True))
        models = client.models.list()
        return raw.headers, chat, deltas, comp, comp_stream, models

    headers, chat, deltas, comp, comp_stream, models = await asyncio.to_thread(run)
    assert headers["x-prefixroute-instance"] in urls
    assert headers["x-prefixroute-decision"] == "affinity"
    assert headers["x-amzn-invoked-production-variant"] == "AllTraffic"
    assert chat.choices[0].message.content and chat.usage.completion_tokens == 5
    assert len([d for d in deltas if d]) == 5
    assert comp.choices[0].text and comp.usage.completion_tokens == 4
    assert "".join(c.choices[0].text for c in comp_stream if c.choices)
    assert [m.id for m in models.data] == [DEFAULT_MODEL]
    assert await eventually(lambda: in_flight(handle) == 0)


async def test_openai_client_errors(fleet):
    handle, _ = fleet
    client = _openai(handle.url)

    def bad():
        with pytest.raises(openai.BadRequestError) as e1:
            client.chat.completions.create(model=DEFAULT_MODEL, messages="nope")  # type: ignore[arg-type]
        with pytest.raises(openai.NotFoundError) as e2:
            client.chat.completions.create(model="other-model", messages=[{"role": "user", "content": "x"}])
        return e1.value, e2.value

    e1, e2 = await asyncio.to_thread(bad)
    assert "'messages'" in e1.message
    assert e2.status_code == 404  # the engine's answer, relayed


async def test_same_prompt_group_sticks_and_hits_the_cache(fleet):
    handle, urls = fleet
    client = _openai(handle.url)

    def run():
        seen: dict[int, set[str]] = defaultdict(set)
        cached: dict[int, list[int]] = defaultdict(list)
        for group in range(10):
            for q in range(3):
                messages = [{"role": "system", "content": f"[doc {group}] " + SYSTEM},
                            {"role": "user", "content": f"question {q} about doc {group}"}]
                raw = client.chat.completions.with_raw_response.create(
                    model=DEFAULT_MODEL, messages=messages, max_tokens=2)
                seen[group].add(raw.headers["x-prefixroute-instance"])
                cached[group].append(raw.parse().usage.prompt_tokens_details.cached_tokens)
        return seen, cached

    seen, cached = await asyncio.to_thread(run)
    assert all(len(s) == 1 for s in seen.values()), seen  # every group on exactly one instance
    assert len(set().union(*seen.values())) >= 2  # and groups spread over instances
    for group in range(10):
        assert cached[group][1] > 0 and cached[group][2] > 0  # later turns reuse the warm prefix


async def test_boto3_invoke_endpoint(fleet):
    handle, urls = fleet
    rt = _sagemaker(handle.url)
    body = json.dumps({"prompt": SYSTEM + "native question", "max_tokens": 3}).encode()

    def run():
        out = [rt.invoke_endpoint(EndpointName="default", Body=body, ContentType="application/json",
                                  CustomAttributes="trace=1", PrefixAwareId="tenant-1") for _ in range(3)]
        results = [(o["InvokedProductionVariant"], o["ContentType"],
                    o["ResponseMetadata"]["HTTPHeaders"]["x-prefixroute-instance"],
                    json.loads(o["Body"].read())) for o in out]
        with pytest.raises(rt.exceptions.ValidationError) as bad_tenant:
            rt.invoke_endpoint(EndpointName="default", Body=body, PrefixAwareId="x" * 65)
        with pytest.raises(rt.exceptions.ModelError) as model_error:
            rt.invoke_endpoint(EndpointName="default", Body=b'{"max_tokens": 3}', ContentType="application/json")
        with pytest.raises(rt.exceptions.ValidationError) as unknown:
            rt.invoke_endpoint(EndpointName="missing", Body=body)
        with pytest.raises(rt.exceptions.ValidationError) as variant:
            rt.invoke_endpoint(EndpointName="default", Body=body, TargetVariant="Blue")
        return results, bad_tenant.value, model_error.value, unknown.value, variant.value

    results, bad_tenant, model_error, unknown, variant = await asyncio.to_thread(run)
    assert {r[0] for r in results} == {"AllTraffic"}
    assert {r[1] for r in results} == {"application/json"}
    assert len({r[2] for r in results}) == 1  # same bytes, same tenant: same instance
    assert results[0][3]["choices"][0]["text"]
    assert results[2][3]["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert "Prefix-Aware-Id" in bad_tenant.response["Error"]["Message"]
    assert model_error.response["Error"]["Code"] == "ModelError"
    assert model_error.response["OriginalStatusCode"] == 400
    assert "prompt" in model_error.response["OriginalMessage"]
    assert "missing" in unknown.response["Error"]["Message"]
    assert "Blue" in variant.response["Error"]["Message"]
    assert await eventually(lambda: in_flight(handle) == 0)


async def test_boto3_service_unavailable():
    handle = await router_for(["http://127.0.0.1:9"])
    try:
        handle.fleet.endpoint().variant().set_healthy("http://127.0.0.1:9", False)
        rt = _sagemaker(handle.url)

        def run():
            with pytest.raises(rt.exceptions.ServiceUnavailable) as e:
                rt.invoke_endpoint(EndpointName="default", Body=b"{}")
            return e.value

        err = await asyncio.to_thread(run)
        assert "no healthy instance" in err.response["Error"]["Message"]
    finally:
        await handle.close()


async def test_overflow_exactly_at_threshold_fake_backends():
    """Hold requests open on a slow instance: the threshold-th request still gets
    affinity, the next one overflows to another instance."""
    insts = [await FakeInstance().start() for _ in range(3)]
    threshold = 3
    handle = await router_for([b.url for b in insts], RoutingConfig.build("prefix-aware", 1024, threshold))
    body = {"model": "m", "prompt": SYSTEM}
    try:
        for b in insts:
            b.mode = "hold"
        pool = handle.fleet.endpoint().variant()
        async with aiohttp.ClientSession() as http:
            held = []
            for i in range(threshold):
                held.append(asyncio.create_task(http.post(handle.url + "/v1/completions", json=body)))
                assert await eventually(lambda: pool.total_in_flight() == i + 1)
            busy = [i for i in pool.instances if i.in_flight]
            assert len(busy) == 1 and busy[0].in_flight == threshold  # all on the preferred instance
            preferred = busy[0].instance_id
            for b in insts:
                b.mode = "echo"
            async with http.post(handle.url + "/v1/completions", json=body) as r:
                assert r.headers["X-Prefixroute-Decision"] == "overflow"
                assert r.headers["X-Prefixroute-Instance"] != preferred
            for b in insts:
                b.gate.set()
            for t in held:
                resp = await t
                assert resp.headers["X-Prefixroute-Decision"] == "affinity"
                assert resp.headers["X-Prefixroute-Instance"] == preferred
                resp.release()
        assert await eventually(lambda: in_flight(handle) == 0)
    finally:
        await handle.close()
        for b in insts:
            await b.stop()


async def test_overflow_at_threshold_real_engines():
    """Same with real engines in real time: streams of 300 tokens stay open for seconds."""
    runners, urls = await _engines(2, time_scale=1.0)
    handle = await router_for(urls, RoutingConfig.build("prefix-aware", 1024, 2))
    body = {"model": DEFAULT_MODEL, "prompt": SYSTEM, "max_tokens": 300, "stream": True}
    try:
        async with aiohttp.ClientSession() as http:
            streams = []
            decisions = []
            for _ in range(3):
                r = await http.post(handle.url + "/v1/completions", json=body)
                assert r.status == 200
                await r.content.readuntil(b"\n\n")  # generation has started
                streams.append(r)
                decisions.append((r.headers["X-Prefixroute-Decision"], r.headers["X-Prefixroute-Instance"]))
            assert [d for d, _ in decisions] == ["affinity", "affinity", "overflow"]
            assert decisions[0][1] == decisions[1][1] != decisions[2][1]
            for r in streams:  # clients leave mid-stream: slots come back, engines abort
                r.close()
        assert await eventually(lambda: in_flight(handle) == 0)
    finally:
        await handle.close()
        for r in runners:
            await r.cleanup()
