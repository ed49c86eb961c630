"""Several models on one endpoint, end to end with the official clients unchanged: the
``openai`` client (chat, completions, embeddings, streaming, ``model`` = a LoRA adapter's
name) and ``boto3``'s ``invoke_endpoint`` / ``invoke_endpoint_with_response_stream`` with
``InferenceComponentName=``, against the router in front of emulated vLLM engines, on both
data planes. Bad input gets the documented status and shape, and the engines' own
counters show nothing reached a wrong instance.

The clients are synchronous; they run in a worker thread so the event loop (router and
engines) keeps serving.
"""

from __future__ import annotations

import asyncio
import json

import aiohttp
import boto3
import openai
import pytest
from botocore.config import Config

from prefixroute.core.config import FleetConfig
from prefixroute.engine.model import EngineConfig
from prefixroute.engine.server import ENGINE_KEY, start_engine_server
from prefixroute.server import start_router
from test_server_helpers import eventually, in_flight, settings

pytestmark = pytest.mark.e2e

DOC = "The retrieved document every question is about, long enough to be cached. " * 30


class Fleet:
    """Four emulated engines: e0 and e1 serve ``llama`` (e0 with the adapter ``sql``), e2
    and e3 serve ``qwen``; one endpoint with two inference components over them."""

    def __init__(self, runners, urls, router) -> None:
        self.runners, self.urls, self.router = runners, urls, router
        self.engines = [r.app[ENGINE_KEY] for r in runners]

    def asked(self, model: str) -> list[int]:
        """Requests each engine accepted for ``model`` (its own counter)."""
        return [e.requests_by_model.get(model, 0) for e in self.engines]

    def refused(self) -> list[dict[str, int]]:
        """Requests each engine refused with 404 for a model it did not have."""
        return [dict(e.not_served) for e in self.engines]


@pytest.fixture
async def fleet(data_plane):
    configs = [EngineConfig(model="llama", max_loras=2), EngineConfig(model="llama", max_loras=2),
               EngineConfig(model="qwen"), EngineConfig(model="qwen")]
    started = [await start_engine_server(c, time_scale=0.02, instance_id=f"e{i}",
                                         lora_modules={"sql": "/adapters/sql"} if i == 0 else None)
               for i, c in enumerate(configs)]
    runners, urls = [r for r, _ in started], [f"http://127.0.0.1:{p}" for _, p in started]
    cfg = FleetConfig.from_mapping({"Endpoints": [{
        "EndpointName": "default",
        "ProductionVariants": [{"VariantName": "AllTraffic", "Instances": urls, "RoutingConfig": {
            "RoutingStrategy": "PREFIX_AWARE", "PrefixAwareRoutingConfig": {"PrefixLength": 1024,
                                                                            "ConcurrencyThreshold": 1}}}],
        "InferenceComponents": [
            {"InferenceComponentName": "llama-ic", "ModelName": "llama", "Instances": "DISCOVER"},
            {"InferenceComponentName": "qwen-ic", "ModelName": "qwen", "Instances": [urls[2], urls[3]]}],
        # "ghost": declared, loaded on no engine, no Autoload (an unknown model until loaded)
        "LoraAdapters": {"RetryAfterSeconds": 2, "Adapters": [
            {"LoraName": "ghost", "LoraPath": "/adapters/ghost", "BaseModelName": "llama"}]}}]})
    router = await start_router(cfg, settings(data_plane=data_plane))
    yield Fleet(runners, urls, router)
    await router.close()
    for r in runners:
        await r.cleanup()


def _openai(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base, api_key="x", max_retries=0, timeout=20)


def _sagemaker(url: str):
    return boto3.client("sagemaker-runtime", endpoint_url=url, region_name="us-east-1", aws_access_key_id="x",
                        aws_secret_access_key="x", config=Config(retries={"max_attempts": 1, "mode": "standard"}))


def _messages(q: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": DOC}, {"role": "user", "content": q}]


async def test_openai_client_with_an_adapter_and_a_component(fleet):
    client = _openai(fleet.router.url + "/v1")
    component = _openai(fleet.router.url + "/endpoints/default/inference-components/qwen-ic/openai/v1")

    def run():
        raw = client.chat.completions.with_raw_response.create(model="sql", messages=_messages("q1"), max_tokens=3)
        chat = raw.parse()
        stream = client.chat.completions.create(model="sql", messages=_messages("q2"), max_tokens=4, stream=True)
        deltas = [c.choices[0].delta.content for c in stream if c.choices]
        comp = client.completions.create(model="sql", prompt=DOC + "q3", max_tokens=2)
        comp_stream = list(client.completions.create(model="sql", prompt=DOC + "q4", max_tokens=3, stream=True))
        emb = client.embeddings.create(model="sql", input=[DOC, "short"])
        qwen = component.chat.completions.with_raw_response.create(model="qwen", messages=_messages("q5"),
                                                                   max_tokens=2)
        qwen_emb = component.embeddings.create(model="qwen", input=DOC)
        models = sorted(m.id for m in client.models.list())
        return raw.headers, chat, deltas, comp, comp_stream, emb, qwen.headers, qwen.parse(), qwen_emb, models

    headers, chat, deltas, comp, comp_stream, emb, qh, qchat, qemb, models = await asyncio.to_thread(run)
    assert headers["x-prefixroute-instance"] == fleet.urls[0]  # the adapter's sticky set is e0 alone
    assert headers["x-prefixroute-inference-component"] == "llama-ic"  # its base model's component
    assert chat.model == "sql" and chat.choices[0].message.content
    assert len([d for d in deltas if d]) == 4
    assert comp.choices[0].text and "".join(c.choices[0].text for c in comp_stream if c.choices)
    assert [len(d.embedding) for d in emb.data] == [16, 16]
    assert qh["x-prefixroute-inference-component"] == "qwen-ic" and qh["x-prefixroute-instance"] in fleet.urls[2:]
    assert qchat.model == "qwen" and len(qemb.data[0].embedding) == 16
    assert models == ["llama", "qwen", "sql"]
    # the engines' own counters: the adapter only on e0, qwen only on its copies, nothing refused
    assert fleet.asked("sql") == [5, 0, 0, 0]
    assert fleet.asked("qwen")[:2] == [0, 0] and sum(fleet.asked("qwen")) == 2
    assert fleet.refused() == [{}, {}, {}, {}]
    assert await eventually(lambda: in_flight(fleet.router) == 0)


async def test_boto3_with_inference_component_name(fleet):
    rt = _sagemaker(fleet.router.url)
    body = json.dumps({"model": "qwen", "messages": _messages("native"), "max_tokens": 3}).encode()

    def run():
        out = [rt.invoke_endpoint(EndpointName="default", InferenceComponentName="qwen-ic", Body=body,
                                  ContentType="application/json") for _ in range(3)]
        results = [(o["InvokedProductionVariant"], o["ResponseMetadata"]["HTTPHeaders"],
                    json.loads(o["Body"].read())) for o in out]
        stream = rt.invoke_endpoint_with_response_stream(
            EndpointName="default", InferenceComponentName="llama-ic",
            Body=json.dumps({"model": "llama", "messages": _messages("s"), "max_tokens": 4, "stream": True}).encode())
        parts = [e["PayloadPart"]["Bytes"] for e in stream["Body"] if "PayloadPart" in e]
        return results, stream["ResponseMetadata"]["HTTPHeaders"], b"".join(parts)

    results, sheaders, streamed = await asyncio.to_thread(run)
    assert {r[0] for r in results} == {"AllTraffic"}
    assert {r[1]["x-prefixroute-inference-component"] for r in results} == {"qwen-ic"}
    assert len({r[1]["x-prefixroute-instance"] for r in results}) == 1  # the same prompt: one copy
    assert results[2][2]["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert sheaders["x-prefixroute-inference-component"] == "llama-ic"
    assert sheaders["x-prefixroute-instance"] in fleet.urls[:2]
    assert streamed.count(b"data: ") >= 4 and b"[DONE]" in streamed
    assert fleet.asked("qwen")[:2] == [0, 0] and sum(fleet.asked("qwen")) == 3
    assert fleet.asked("llama")[2:] == [0, 0] and sum(fleet.asked("llama")) == 1
    assert fleet.refused() == [{}, {}, {}, {}]


async def test_bad_input_gets_its_status_and_reaches_no_engine(fleet):
    rt = _sagemaker(fleet.router.url)
    client = _openai(fleet.router.url + "/v1")
    body = json.dumps({"model": "qwen", "messages": _messages("x"), "max_tokens": 2}).encode()

    def bad():
        errors = {}
        with pytest.raises(rt.exceptions.ValidationError) as e:
            rt.invoke_endpoint(EndpointName="default", InferenceComponentName="nope", Body=body)
        errors["component"] = e.value.response
        with pytest.raises(rt.exceptions.ValidationError) as e:
            rt.invoke_endpoint(EndpointName="default", Body=body)  # an endpoint with components: name one
        errors["no component"] = e.value.response
        with pytest.raises(rt.exceptions.ValidationError) as e:  # a variant that is not there, beside a component
            rt.invoke_endpoint(EndpointName="default", InferenceComponentName="qwen-ic", TargetVariant="Nope",
                               Body=body)
        errors["variant"] = e.value.response
        with pytest.raises(openai.NotFoundError) as e:
            client.chat.completions.create(model="gpt-4o", messages=_messages("x"), max_tokens=2)
        errors["model"] = e.value
        with pytest.raises(openai.NotFoundError) as e:
            client.completions.create(model="not-an-adapter", prompt="x", max_tokens=2)
        errors["adapter"] = e.value
        with pytest.raises(openai.NotFoundError) as e:  # an adapter of llama-ic's model, loaded nowhere
            client.completions.create(model="ghost", prompt="x", max_tokens=2)
        errors["ghost"] = e.value
        return errors

    errors = await asyncio.to_thread(bad)
    assert "'nope' is not valid" in errors["component"]["Error"]["Message"]
    assert errors["component"]["ResponseMetadata"]["HTTPStatusCode"] == 400
    assert "InferenceComponentName" in errors["no component"]["Error"]["Message"]
    assert "Nope" in errors["variant"]["Error"]["Message"]
    assert errors["model"].status_code == 404 and errors["model"].code == "model_not_found"
    assert errors["adapter"].code == "model_not_found"
    assert errors["ghost"].code == "model_not_found" and "ghost" in str(errors["ghost"])
    assert sum(sum(e.requests_by_model.values()) for e in fleet.engines) == 0
    assert fleet.refused() == [{}, {}, {}, {}]

    # The component's copies go down (their engines stop): 503, and nothing goes to llama's instances.
    for r in fleet.runners[2:]:
        await r.cleanup()

    def down():
        with pytest.raises(rt.exceptions.ServiceUnavailable) as e:
            rt.invoke_endpoint(EndpointName="default", InferenceComponentName="qwen-ic", Body=body)
        return e.value.response

    resp = await asyncio.to_thread(down)
    assert resp["ResponseMetadata"]["HTTPStatusCode"] == 503
    assert "qwen-ic" in resp["Error"]["Message"] or "could take the request" in resp["Error"]["Message"]
    assert sum(fleet.asked("qwen")) == 0 and fleet.asked("llama") == [0, 0, 0, 0]
    assert fleet.refused()[:2] == [{}, {}]
    fleet.runners = fleet.runners[:2]  # (stopped already)


async def test_a_saturated_adapter_is_a_429_with_retry_after_for_the_openai_client(fleet):
    client = _openai(fleet.router.url + "/v1")
    async with aiohttp.ClientSession() as http:
        holder = asyncio.ensure_future(http.post(fleet.router.url + "/v1/completions", json={
            "model": "sql", "prompt": DOC, "max_tokens": 3000, "stream": True}))
        pool = fleet.router.fleet.endpoint().component("llama-ic")
        assert await eventually(lambda: pool.get(fleet.urls[0]).in_flight == 1)

        def saturated():
            with pytest.raises(openai.RateLimitError) as e:
                client.completions.create(model="sql", prompt="another", max_tokens=2)
            return e.value

        err = await asyncio.to_thread(saturated)
        (await holder).close()
    assert err.status_code == 429 and err.response.headers["retry-after"] == "2"
    assert err.code == "sticky_set_saturated"
    assert fleet.asked("sql")[1:] == [0, 0, 0] and fleet.refused() == [{}, {}, {}, {}]
    assert await eventually(lambda: in_flight(fleet.router) == 0)
