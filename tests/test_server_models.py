"""Several models on one endpoint, through the router, on both data planes: inference
components, routing by ``model``, LoRA sticky sets, every OpenAI route.

The instances are fakes that echo what they received and list what each serves in
``/v1/models``; every test asserts on what the instances received, so a request that
reached a wrong instance (or any instance, for a refused request) shows.
"""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import orjson
import pytest

from prefixroute.core.config import FleetConfig, RoutingConfig
from prefixroute.server import start_router
from prefixroute.server.models import refresh_models
from prefixroute.server.cli import build_config, configure_parser
from test_server_helpers import FakeInstance, eventually, in_flight, metric_value, settings

PA = {"RoutingStrategy": "PREFIX_AWARE", "PrefixAwareRoutingConfig": {"PrefixLength": 1024, "ConcurrencyThreshold": 1}}
DOC = "A shared document about the fleet. " * 60


def adapter(name: str, parent: str = "base") -> dict[str, Any]:
    return {"id": name, "object": "model", "root": f"/adapters/{name}", "parent": parent}


@pytest.fixture
async def fakes():
    insts = [await FakeInstance().start() for _ in range(4)]
    yield insts
    for f in insts:
        await f.stop()


@pytest.fixture
async def http():
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20)) as s:
        yield s


async def start(fakes: list[FakeInstance], data_plane: str, **endpoint: Any):
    cfg = FleetConfig.from_mapping({"Endpoints": [{
        "EndpointName": "e", "ProductionVariants": [
            {"VariantName": "AllTraffic", "Instances": [f.url for f in fakes], "RoutingConfig": PA}],
        **endpoint}]})
    return await start_router(cfg, settings(data_plane=data_plane))


def received(fakes: list[FakeInstance]) -> dict[str, list[str]]:
    """instance url -> paths it received (inference only)."""
    return {f.url: [p for p, _, _ in f.received] for f in fakes}


def total(fakes: list[FakeInstance]) -> int:
    return sum(len(f.received) for f in fakes)


# -- inference components ------------------------------------------------------------------


async def test_components_route_only_among_their_copies(fakes, data_plane, http):
    a, b, c, d = fakes
    for f in (a, b):
        f.models = ["llama"]
    for f in (c, d):
        f.models = ["qwen"]
    router = await start(fakes, data_plane, InferenceComponents=[
        {"InferenceComponentName": "llama-ic", "ModelName": "llama", "Instances": [a.url, b.url]},
        {"InferenceComponentName": "qwen-ic", "ModelName": "qwen", "Instances": "discover"}])
    try:
        assert [i.instance_id for i in router.fleet.endpoint("e").component("qwen-ic").instances] == [c.url, d.url]
        for k in range(12):
            body = orjson.dumps({"prompt": f"{k} " + DOC, "max_tokens": 1})
            async with http.post(router.url + "/endpoints/e/invocations", data=body,
                                 headers={"X-Amzn-SageMaker-Inference-Component": "qwen-ic"}) as r:
                assert r.status == 200
                assert r.headers["X-Prefixroute-Inference-Component"] == "qwen-ic"
                assert r.headers["X-Amzn-Invoked-Production-Variant"] == "AllTraffic"
                assert r.headers["X-Prefixroute-Instance"] in (c.url, d.url)
            async with http.post(router.url + "/endpoints/e/inference-components/llama-ic/openai/v1/completions",
                                 json={"model": "llama", "prompt": f"{k} " + DOC}) as r:
                assert r.status == 200 and r.headers["X-Prefixroute-Inference-Component"] == "llama-ic"
            async with http.post(router.url + "/endpoints/e/openai/v1/chat/completions",  # the model names it
                                 json={"model": "qwen", "messages": [{"role": "user", "content": f"{k}"}]}) as r:
                assert r.status == 200 and r.headers["X-Prefixroute-Inference-Component"] == "qwen-ic"
        got = received(fakes)
        assert set(got[a.url] + got[b.url]) == {"/v1/completions"}
        assert set(got[c.url] + got[d.url]) == {"/invocations", "/v1/chat/completions"}
        assert all(got[f.url] for f in fakes)  # both copies of each component used
        text = (await (await http.get(router.url + "/metrics")).read()).decode()
        assert metric_value(text, "prefixroute_component_requests_total", component="qwen-ic", instance=c.url) \
            + metric_value(text, "prefixroute_component_requests_total", component="qwen-ic", instance=d.url) == 24
        assert in_flight(router) == 0
    finally:
        await router.close()


async def test_component_errors_and_nothing_sent(fakes, data_plane, http):
    a, b, c, d = fakes
    router = await start(fakes, data_plane, InferenceComponents=[
        {"InferenceComponentName": "ic", "ModelName": "m", "Instances": [a.url, b.url]}])
    try:
        async with http.post(router.url + "/endpoints/e/invocations", data=b'{"prompt": "x"}',
                             headers={"X-Amzn-SageMaker-Inference-Component": "nope"}) as r:
            assert r.status == 400 and r.headers["x-amzn-ErrorType"] == "ValidationError"
            assert "'nope' is not valid for endpoint 'e'" in (await r.json())["message"]
        async with http.post(router.url + "/endpoints/e/invocations", data=b'{"prompt": "x"}') as r:
            assert r.status == 400 and r.headers["x-amzn-ErrorType"] == "ValidationError"
            assert "X-Amzn-SageMaker-Inference-Component" in (await r.json())["message"]
        async with http.post(router.url + "/endpoints/e/inference-components/nope/openai/v1/completions",
                             json={"model": "m", "prompt": "x"}) as r:
            assert r.status == 400
            assert (await r.json())["error"]["code"] == "inference_component_not_found"
        async with http.post(router.url + "/endpoints/e/inference-components/ic/openai/v1/completions",
                             json={"model": "m", "prompt": "x"},
                             headers={"X-Amzn-SageMaker-Inference-Component": "other"}) as r:
            assert r.status == 400  # path and header disagree
        pool = router.fleet.endpoint("e").component("ic")
        for url in (a.url, b.url):
            pool.set_healthy(url, False)  # every copy down; the variant's other instances are up
        async with http.post(router.url + "/endpoints/e/invocations", data=b'{"prompt": "x"}',
                             headers={"X-Amzn-SageMaker-Inference-Component": "ic"}) as r:
            assert r.status == 503 and r.headers["x-amzn-ErrorType"] == "ServiceUnavailable"
            assert "inference component 'ic' has no healthy copy" in (await r.json())["message"]
        assert total(fakes) == 0
    finally:
        await router.close()


# -- routing by model ----------------------------------------------------------------------


async def test_routing_by_model_and_the_union_of_models(fakes, data_plane, http):
    a, b, c, d = fakes
    a.models = b.models = ["llama"]
    c.models = ["qwen"]
    d.models = None  # serves no /v1/models: unlisted
    router = await start(fakes, data_plane)
    try:
        for k in range(10):
            async with http.post(router.url + "/v1/chat/completions",
                                 json={"model": "qwen", "messages": [{"role": "user", "content": f"q{k}"}]}) as r:
                assert r.status == 200 and r.headers["X-Prefixroute-Instance"] == c.url
            async with http.post(router.url + "/v1/completions", json={"model": "llama", "prompt": f"p{k}"}) as r:
                assert r.headers["X-Prefixroute-Instance"] in (a.url, b.url)
            async with http.post(router.url + "/v1/completions", json={"model": "mistral", "prompt": "p"}) as r:
                assert r.headers["X-Prefixroute-Instance"] == d.url  # listed nowhere: the unlisted instance
        async with http.get(router.url + "/v1/models") as r:
            assert [m["id"] for m in (await r.json())["data"]] == ["llama", "qwen"]
        d.models = ["mistral"]
        await refresh_models(router.state)  # what a health round does
        before = total(fakes)
        async with http.post(router.url + "/v1/completions", json={"model": "gpt-4", "prompt": "p"}) as r:
            assert r.status == 404
            err = (await r.json())["error"]
            assert err["code"] == "model_not_found" and "`gpt-4`" in err["message"]
        async with http.post(router.url + "/v1/completions", json={"model": 7, "prompt": "p"}) as r:
            assert r.status == 400 and "'model' must be a string" in (await r.json())["error"]["message"]
        assert total(fakes) == before
        async with http.get(router.url + "/v1/models") as r:
            assert [m["id"] for m in (await r.json())["data"]] == ["llama", "qwen", "mistral"]
    finally:
        await router.close()


async def test_models_learned_on_health_rounds(fakes, data_plane, http):
    a, b, c, d = fakes
    for f in fakes:
        f.models = ["llama"]
    cfg = FleetConfig.single([f.url for f in fakes], RoutingConfig.build("random"), endpoint="e")
    router = await start_router(cfg, settings(data_plane=data_plane, health_check_interval_s=0.05))
    try:
        d.models = ["llama", "qwen"]
        assert await eventually(lambda: router.state.catalog.serving("qwen") == {d.url})
        for _ in range(5):
            async with http.post(router.url + "/v1/completions", json={"model": "qwen", "prompt": "x"}) as r:
                assert r.headers["X-Prefixroute-Instance"] == d.url
    finally:
        await router.close()


# -- LoRA sticky sets ----------------------------------------------------------------------


async def test_adapter_requests_stay_in_the_sticky_set_and_429_when_saturated(fakes, data_plane, http):
    a, b, c, d = fakes
    a.models = ["base", adapter("sql")]
    b.models = ["base", adapter("sql"), adapter("chat")]
    c.models = d.models = ["base"]
    router = await start(fakes, data_plane, LoraAdapters={"RetryAfterSeconds": 3})
    try:
        for k in range(12):
            async with http.post(router.url + "/v1/completions",
                                 json={"model": "sql", "prompt": f"{k} " + DOC}) as r:
                assert r.status == 200 and r.headers["X-Prefixroute-Instance"] in (a.url, b.url)
        assert received(fakes)[c.url] == [] and received(fakes)[d.url] == []
        # Hold both instances of the set at the threshold (1): the next request is refused.
        for f in (a, b):
            f.mode = "hold"
        held = [asyncio.ensure_future(http.post(router.url + "/v1/completions",
                                                json={"model": "sql", "prompt": f"{k}{k} " + DOC}))
                for k in range(2)]
        pool = router.fleet.endpoint("e").variant()
        assert await eventually(lambda: pool.get(a.url).in_flight == 1 and pool.get(b.url).in_flight == 1)
        before = total(fakes)
        for path, shape in (("/v1/completions", "openai"), ("/endpoints/e/openai/v1/completions", "openai")):
            async with http.post(router.url + path, json={"model": "sql", "prompt": "new " + DOC}) as r:
                assert r.status == 429 and r.headers["Retry-After"] == "3"
                err = (await r.json())["error"]
                assert err["code"] == "sticky_set_saturated" and "ConcurrencyThreshold" in err["message"]
        async with http.post(router.url + "/v1/completions", json={"model": "chat", "prompt": "x"}) as r:
            assert r.status == 429  # chat's set is b alone, busy
        assert total(fakes) == before
        for f in fakes:
            f.gate.set()
        for h in held:
            (await h).release()
        assert router.state.adapter_tracker.in_flight(a.url, "sql") == 0
        text = (await (await http.get(router.url + "/metrics")).read()).decode()
        assert metric_value(text, "prefixroute_adapter_sticky_set_size", adapter="sql") == 2
        served = sum(metric_value(text, "prefixroute_adapter_requests_total", adapter="sql", instance=u) or 0
                     for u in (a.url, b.url))
        assert served == 14
        assert await eventually(lambda: in_flight(router) == 0)
    finally:
        for f in fakes:
            f.gate.set()
        await router.close()


# -- every OpenAI route ----------------------------------------------------------------------


@pytest.mark.parametrize("path, body", [
    ("/v1/embeddings", {"model": "qwen", "input": DOC}),
    ("/v1/responses", {"model": "qwen", "instructions": DOC, "input": "q"}),
    ("/v1/rerank", {"model": "qwen", "query": DOC, "documents": ["a", "b"]}),
    ("/v1/score", {"model": "qwen", "text_1": DOC, "text_2": "a"}),
    ("/tokenize", {"model": "qwen", "prompt": DOC}),
    ("/detokenize", {"model": "qwen", "tokens": [1, 2, 3]}),
    ("/v1/audio/speech", {"model": "qwen", "input": "hello"}),
])
async def test_every_openai_route_is_routed_by_model_and_its_input(fakes, data_plane, http, path, body):
    a, b, c, d = fakes
    a.models = b.models = ["llama"]
    c.models = d.models = ["qwen"]
    router = await start(fakes, data_plane)
    try:
        seen = set()
        for prefix in ("", "/endpoints/e/openai"):
            for _ in range(4):
                async with http.post(router.url + prefix + path + "?x=1", json=body) as r:
                    assert r.status == 200
                    echoed = await r.json()
                    assert echoed["path"] == path and orjson.loads(echoed["body"]) == body
                    seen.add(r.headers["X-Prefixroute-Instance"])
                    assert r.headers["X-Prefixroute-Decision"] in ("affinity", "fallback")
        assert seen <= {c.url, d.url}
        if path != "/v1/audio/speech":
            assert len(seen) == 1  # same input, same key: one instance
        async with http.post(router.url + path, json={**body, "model": "nope"}) as r:
            assert r.status == 404 and (await r.json())["error"]["code"] == "model_not_found"
        assert sum(len(f.received) for f in (a, b)) == 0
    finally:
        await router.close()


async def test_route_inputs_are_validated(fakes, data_plane, http):
    for f in fakes:
        f.models = ["m"]
    router = await start(fakes, data_plane)
    try:
        for path, body, needle in (("/v1/embeddings", {"model": "m"}, "'input' is required"),
                                   ("/v1/rerank", {"model": "m", "query": "q", "documents": 3}, "'documents'"),
                                   ("/detokenize", {"model": "m", "tokens": "x"}, "'tokens'"),
                                   ("/v1/responses", {"model": "m", "input": "q", "stream": "yes"}, "'stream'")):
            async with http.post(router.url + path, json=body) as r:
                assert r.status == 400 and needle in (await r.json())["error"]["message"]
        async with http.post(router.url + "/v1/audio/transcriptions", data=b"--multipart--",
                             headers={"Content-Type": "multipart/form-data; boundary=x"}) as r:
            assert r.status == 200  # not JSON: relayed by the pool alone
        assert total(fakes) == 1
        async with http.get(router.url + "/v1/files") as r:  # other methods: relayed to one instance
            assert r.status == 405 and "X-Prefixroute-Instance" in r.headers  # the instance's own answer
        async with http.get(router.url + "/v1/models/m") as r:  # one model's card: from the instances' lists
            assert r.status == 200 and (await r.json())["id"] == "m" and "X-Prefixroute-Instance" not in r.headers
    finally:
        await router.close()


async def test_streaming_responses_route(fakes, data_plane, http):
    # The Responses API's stream is typed events ending with response.completed, no [DONE]
    events = [b"event: response.created\ndata: {}\n\n", b"event: response.output_text.delta\ndata: {}\n\n",
              b"event: response.completed\ndata: {}\n\n"]
    for f in fakes:
        f.models = ["m"]
        f.mode = "stream"
        f.chunks = events
    router = await start(fakes, data_plane)
    try:
        async with http.post(router.url + "/v1/responses", json={"model": "m", "input": "q", "stream": True}) as r:
            assert r.status == 200 and r.headers["Content-Type"].startswith("text/event-stream")
            assert await r.read() == b"".join(events)
        assert await eventually(lambda: in_flight(router) == 0)
        text = router.state.metrics.render().decode()
        assert metric_value(text, "prefixroute_upstream_errors_total", kind="no_done") is None  # not an error here
        assert metric_value(text, "prefixroute_responses_total", code="200") == 1
    finally:
        await router.close()


# -- configuration: admin, flags -------------------------------------------------------------


async def test_component_routing_switches_without_restart(fakes, data_plane, http):
    a, b, c, d = fakes
    router = await start(fakes, data_plane, InferenceComponents=[
        {"InferenceComponentName": "ic", "ModelName": "m", "Instances": [a.url, b.url]}])
    try:
        url = f"{router.admin_url}/admin/endpoints/e/inference-components/ic/routing"
        async with http.put(url, json={"RoutingStrategy": "LEAST_OUTSTANDING_REQUESTS"}) as r:
            assert r.status == 200
        assert router.fleet.endpoint("e").component("ic").routing.strategy.value == "LEAST_OUTSTANDING_REQUESTS"
        async with http.put(f"{router.admin_url}/admin/endpoints/e/inference-components/zz/routing",
                            json={"RoutingStrategy": "RANDOM"}) as r:
            assert r.status == 404
        async with http.get(f"{router.admin_url}/admin/config") as r:
            doc = await r.json()
        ic = doc["Endpoints"][0]["InferenceComponents"][0]
        assert ic["RoutingConfig"]["RoutingStrategy"] == "LEAST_OUTSTANDING_REQUESTS"
        assert [s["Instance"] for s in ic["CopyStates"]] == [a.url, b.url]
        async with http.put(f"{router.admin_url}/admin/config", json=doc) as r:  # what it GOT, PUT back
            assert r.status == 200
        async with http.post(router.url + "/endpoints/e/invocations", data=b"x",
                             headers={"X-Amzn-SageMaker-Inference-Component": "ic"}) as r:
            assert r.headers["X-Prefixroute-Decision"] == "least_outstanding"
    finally:
        await router.close()


def test_flags_declare_components_and_adapters():
    import argparse

    p = argparse.ArgumentParser()
    configure_parser(p)
    args = p.parse_args(["--backend", "http://a:1", "--backend", "http://b:1",
                         "--inference-component", "ic-a:llama=http://a:1", "--inference-component", "ic-b=discover",
                         "--lora-adapter", "sql=/adapters/sql@llama", "--lora-autoload", "--lora-max-adapters", "2",
                         "--lora-idle-seconds", "2.5"])
    ep = build_config(args).endpoints[0]
    assert ep.lora.idle_s == ep.lora.idle_after_s == 2.5
    assert [(c.name, c.model_name, c.instances) for c in ep.components] == [
        ("ic-a", "llama", ("http://a:1",)), ("ic-b", "ic-b", "DISCOVER")]
    assert ep.lora.autoload and ep.lora.max_adapters_per_instance == 2
    assert (ep.lora.adapters[0].name, ep.lora.adapters[0].path, ep.lora.adapters[0].base_model) == \
        ("sql", "/adapters/sql", "llama")
    from prefixroute.core.config import ConfigError

    with pytest.raises(ConfigError, match="expected NAME"):
        build_config(p.parse_args(["--backend", "http://a:1", "--inference-component", "ic"]))
    with pytest.raises(ConfigError, match="not an instance of production variant"):
        build_config(p.parse_args(["--backend", "http://a:1", "--inference-component", "ic=http://z:1"]))
    with pytest.raises(ConfigError, match="IdleSeconds: Input should be greater than or equal to 0.1"):
        build_config(p.parse_args(["--backend", "http://a:1", "--lora-autoload", "--lora-idle-seconds", "0"]))
    for flag, value in (("--inference-component", "foo:=discover"), ("--lora-adapter", "a=/x@")):  # empty parts
        with pytest.raises(ConfigError, match="expected NAME"):
            build_config(p.parse_args(["--backend", "http://a:1", flag, value]))


def test_autoload_is_refused_with_several_workers():
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "prefixroute", "serve", "--backend", "http://127.0.0.1:9",
                           "--lora-autoload", "--workers", "2", "--port", "0"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "Autoload (--lora-autoload) runs in one router process" in proc.stderr


async def test_a_method_a_route_does_not_take_is_the_routers_405_and_reaches_no_engine(fakes, data_plane, http):
    router = await start(fakes, data_plane)
    try:
        for method, path, allowed in (("GET", "/v1/chat/completions", "POST"), ("PUT", "/v1/completions", "POST"),
                                      ("DELETE", "/endpoints/e/openai/v1/embeddings", "POST"),
                                      ("POST", "/v1/models", "GET"), ("PUT", "/v1/models", "GET")):
            async with http.request(method, router.url + path, json={"model": "m"}) as r:
                err = (await r.json())["error"]
                assert (r.status, r.headers["Allow"], err["code"]) == (405, allowed, "method_not_allowed"), path
                assert method in err["message"]
        assert sum(len(f.received) for f in fakes) == 0
    finally:
        await router.close()


async def test_one_models_card_comes_from_the_lists_and_an_unknown_one_is_model_not_found(fakes, data_plane, http):
    a, b, c, d = fakes
    a.models = b.models = ["llama", {"id": "sql-lora", "object": "model", "parent": "llama"}]
    c.models = d.models = ["qwen"]
    router = await start(fakes, data_plane)
    try:
        async with http.get(router.url + "/v1/models/sql-lora") as r:
            assert r.status == 200 and (await r.json())["parent"] == "llama"
        async with http.get(router.url + "/endpoints/e/openai/v1/models/qwen") as r:
            assert r.status == 200 and (await r.json())["id"] == "qwen"
        async with http.get(router.url + "/v1/models/nope") as r:
            assert r.status == 404 and (await r.json())["error"]["code"] == "model_not_found"
        assert sum(len(f.received) for f in fakes) == 0
    finally:
        await router.close()
