"""The emulated engine serving several models: served-name aliases, LoRA adapters (slots,
runtime load/unload with vLLM's answers, per-adapter prefix-cache blocks, vLLM's metric)
and embeddings."""

from __future__ import annotations

import argparse
import asyncio

import aiohttp
import pytest

from prefixroute.engine.cli import config_from_args, configure_parser, lora_from_args
from prefixroute.engine.core import EngineCore
from prefixroute.engine.model import EngineConfig
from prefixroute.engine.server import start_engine_server
from prefixroute.server.scrape import parse_engine_metrics
from test_server_helpers import metric_value

DOC = "A long shared system prompt about the engine and its adapters. " * 40


@pytest.fixture
async def engine():
    cfg = EngineConfig(model="llama", served_model_names=("llama-alias",), max_loras=2, lora_load_s=0.2)
    runner, port = await start_engine_server(cfg, time_scale=0.0, instance_id="e0",
                                             lora_modules={"sql": "/adapters/sql"}, runtime_lora_updating=True)
    url = f"http://127.0.0.1:{port}"
    async with aiohttp.ClientSession() as http:
        yield url, http, runner
    await runner.cleanup()


async def _complete(http, url, model, prompt=DOC, max_tokens=2):
    async with http.post(url + "/v1/completions", json={"model": model, "prompt": prompt,
                                                        "max_tokens": max_tokens}) as r:
        return r.status, await r.json()


async def test_names_adapters_and_models_list(engine):
    url, http, _ = engine
    async with http.get(url + "/v1/models") as r:
        cards = (await r.json())["data"]
    assert [(c["id"], c["parent"], c["root"]) for c in cards] == [
        ("llama", None, "llama"), ("llama-alias", None, "llama"), ("sql", "llama", "/adapters/sql")]
    status, body = await _complete(http, url, "llama-alias")
    assert status == 200 and body["model"] == "llama-alias"
    status, body = await _complete(http, url, "sql")
    assert status == 200 and body["model"] == "sql"
    status, body = await _complete(http, url, "other")
    assert status == 404 and body["error"] == {"message": "The model `other` does not exist.",
                                               "type": "NotFoundError", "param": None, "code": 404}
    text = await (await http.get(url + "/metrics")).text()
    assert metric_value(text, "prefixroute_engine_requests_total", model_name="sql") == 1
    assert metric_value(text, "prefixroute_engine_requests_total", model_name="llama-alias") == 1
    assert metric_value(text, "prefixroute_engine_model_not_served_total", model_name="other") == 1


async def test_prefix_cache_blocks_are_per_adapter(engine):
    url, http, _ = engine
    _, first = await _complete(http, url, "llama")
    _, again = await _complete(http, url, "llama")
    _, adapter = await _complete(http, url, "sql")
    _, adapter_again = await _complete(http, url, "sql")
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert adapter["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # the base model's blocks are not its
    assert adapter_again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    text = await (await http.get(url + "/metrics")).text()
    tokens = first["usage"]["prompt_tokens"]
    assert metric_value(text, "prefixroute_engine_lora_prefix_cache_queries_total", lora_name="sql") == 2 * tokens
    assert metric_value(text, "prefixroute_engine_lora_prefix_cache_hits_total", lora_name="sql") == \
        adapter_again["usage"]["prompt_tokens_details"]["cached_tokens"]


async def test_load_and_unload_answer_as_vllm(engine):
    url, http, _ = engine

    async def post(path, body):
        async with http.post(url + path, json=body) as r:
            return r.status, await r.text()

    status, text = await post("/v1/load_lora_adapter", {"lora_name": "chat"})
    assert status == 400 and "Both 'lora_name' and 'lora_path' must be provided." in text and "InvalidUserInput" in text
    status, text = await post("/v1/load_lora_adapter", {"lora_name": "sql", "lora_path": "/x"})
    assert status == 400 and "The lora adapter 'sql' has already been loaded." in text
    status, _ = await _complete(http, url, "chat")
    assert status == 404  # not loaded yet
    status, text = await post("/v1/load_lora_adapter", {"lora_name": "chat", "lora_path": "/adapters/chat"})
    assert status == 200 and text == "Success: LoRA adapter 'chat' added successfully."
    status, _ = await _complete(http, url, "chat")
    assert status == 200
    status, text = await post("/v1/unload_lora_adapter", {"lora_name": "chat"})
    assert status == 200 and text == "Success: LoRA adapter 'chat' removed successfully."
    status, text = await post("/v1/unload_lora_adapter", {"lora_name": "chat"})
    assert status == 404 and "The lora adapter 'chat' cannot be found." in text and "NotFoundError" in text
    status, text = await post("/v1/unload_lora_adapter", {})
    assert status == 400 and "'lora_name' needs to be provided" in text
    status, _ = await _complete(http, url, "chat")
    assert status == 404
    text = await (await http.get(url + "/metrics")).text()
    assert metric_value(text, "prefixroute_engine_lora_loads_total") == 1
    assert metric_value(text, "prefixroute_engine_lora_unloads_total") == 1
    assert metric_value(text, "prefixroute_engine_model_not_served_total", model_name="chat") == 2


async def test_a_load_takes_its_load_time():
    cfg = EngineConfig(model="llama", max_loras=1, lora_load_s=0.3)
    runner, port = await start_engine_server(cfg, time_scale=1.0, runtime_lora_updating=True)
    try:
        async with aiohttp.ClientSession() as http:
            loop = asyncio.get_running_loop()
            t0 = loop.time()
            async with http.post(f"http://127.0.0.1:{port}/v1/load_lora_adapter",
                                 json={"lora_name": "a", "lora_path": "/a"}) as r:
                assert r.status == 200
            assert 0.28 <= loop.time() - t0 < 2.0
    finally:
        await runner.cleanup()


async def test_runtime_loading_is_off_unless_allowed():
    runner, port = await start_engine_server(EngineConfig(max_loras=1), time_scale=0.0)
    try:
        async with aiohttp.ClientSession() as http:
            async with http.post(f"http://127.0.0.1:{port}/v1/load_lora_adapter",
                                 json={"lora_name": "a", "lora_path": "/a"}) as r:
                assert r.status in (404, 405)
    finally:
        await runner.cleanup()
    with pytest.raises(ValueError, match="max_loras"):
        await start_engine_server(EngineConfig(), lora_modules={"a": "/a"})


async def test_lora_requests_info_is_vllms_and_the_router_reads_it(engine):
    url, http, runner = engine
    text = await (await http.get(url + "/metrics")).text()
    line = next(x for x in text.splitlines() if x.startswith("vllm:lora_requests_info{"))
    assert 'max_lora="2"' in line and 'running_lora_adapters=""' in line
    stats = parse_engine_metrics(text)
    assert stats.max_lora == 2 and stats.lora_adapters == ()
    sample = ('vllm:lora_requests_info{max_lora="4",running_lora_adapters="a,b",waiting_lora_adapters="c"} 1.7e9\n'
              'vllm:lora_requests_info{max_lora="4",running_lora_adapters="old",waiting_lora_adapters=""} 1.6e9\n')
    stats = parse_engine_metrics(sample)
    assert stats.lora_adapters == ("a", "b", "c") and stats.max_lora == 4


def test_adapter_slots_bound_the_adapters_of_a_batch():
    core = EngineCore(EngineConfig(model="m", max_loras=1, kv_capacity_tokens=100_000))
    core.add_request("a1", "x" * 400, 3, lora="a")
    core.add_request("b1", "y" * 400, 3, lora="b")
    core.add_request("a2", "z" * 400, 3, lora="a")
    core.add_request("base", "w" * 400, 3)
    out = core.step()
    admitted = {o.request_id for o in out.outputs if o.admitted}
    assert admitted == {"a1", "a2", "base"}  # b waits: the one slot is a's; later requests pass it
    assert core.lora_activity() == ({"a": 2}, {"b": 1})
    while core.has_work():
        for o in core.step().outputs:
            if o.request_id == "b1" and o.admitted:
                assert "a1" not in core._running and "a2" not in core._running
    assert core.stats().requests_finished == 4
    with pytest.raises(ValueError, match="LoRA is not enabled"):
        EngineCore(EngineConfig()).add_request("x", "abc", 1, lora="a")


async def test_embeddings(engine):
    url, http, _ = engine
    body = {"model": "llama", "input": [DOC, "short"]}
    async with http.post(url + "/v1/embeddings", json=body) as r:
        first = await r.json()
    async with http.post(url + "/v1/embeddings", json=body) as r:
        again = await r.json()
    assert [len(d["embedding"]) for d in first["data"]] == [16, 16]
    assert first["data"][0]["embedding"] == again["data"][0]["embedding"] != first["data"][1]["embedding"]
    assert abs(sum(v * v for v in first["data"][0]["embedding"]) - 1.0) < 1e-3
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # prefilled through the prefix cache
    async with http.post(url + "/v1/embeddings", json={"model": "llama", "input": {"x": 1}}) as r:
        assert r.status == 400
    async with http.post(url + "/v1/embeddings", json={"model": "nope", "input": "x"}) as r:
        assert r.status == 404
    async with http.post(url + "/v1/embeddings", json={**body, "encoding_format": "base64"}) as r:
        packed = (await r.json())["data"][0]["embedding"]
    import base64
    import struct

    floats = struct.unpack("<16f", base64.b64decode(packed))  # what the openai client decodes
    assert [round(v, 5) for v in floats] == [round(v, 5) for v in first["data"][0]["embedding"]]


def test_emulate_flags():
    p = argparse.ArgumentParser()
    configure_parser(p)
    args = p.parse_args(["--served-model-name", "a", "b", "--enable-lora", "--max-loras", "2",
                         "--lora-modules", "x=/x", "--allow-runtime-lora-updating", "--lora-load-s", "1.5"])
    cfg = config_from_args(args)
    assert (cfg.model, cfg.model_names, cfg.max_loras, cfg.lora_load_s) == ("a", ("a", "b"), 2, 1.5)
    assert lora_from_args(args) == ({"x": "/x"}, True)
    with pytest.raises(ValueError, match="needs --enable-lora"):
        config_from_args(p.parse_args(["--max-loras", "2"]))
    with pytest.raises(ValueError, match="need --enable-lora"):
        lora_from_args(p.parse_args(["--lora-modules", "x=/x"]))
    assert config_from_args(p.parse_args(["--enable-lora"])).max_loras == 1
    with pytest.raises(ValueError, match="--max-loras must be at least 1"):  # (was a traceback)
        lora_from_args(p.parse_args(["--enable-lora", "--max-loras", "0", "--lora-modules", "a=/x"]))
