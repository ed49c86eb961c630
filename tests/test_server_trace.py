"""`prefixroute serve --record-trace`: one line per routed request, digests only, readable by the tuner."""

from __future__ import annotations

import aiohttp
import orjson
import pytest

from prefixroute.core.config import RoutingConfig
from prefixroute.engine.model import DEFAULT_MODEL, EngineConfig
from prefixroute.engine.server import start_engine_server
from prefixroute.server import trace as trace_module
from prefixroute.workloads.traces import load_trace, unpack_digests
from test_server_helpers import eventually, router_for

pytestmark = pytest.mark.e2e

DOC = "Confidential quarterly figures for the board. " * 60


async def test_router_records_a_trace_the_tuner_reads(tmp_path, data_plane, monkeypatch) -> None:
    monkeypatch.setattr(trace_module, "FLUSH_S", 0.05)
    started = [await start_engine_server(EngineConfig(), time_scale=0.0, instance_id=f"e{i}") for i in range(2)]
    urls = [f"http://127.0.0.1:{port}" for _, port in started]
    path = tmp_path / "trace.jsonl"
    handle = await router_for(urls, RoutingConfig.build("prefix-aware", 1024, 8), record_trace=str(path),
                              data_plane=data_plane, admin_port=None)
    try:
        async with aiohttp.ClientSession() as s:
            for q in ("What was revenue?", "And costs?", "Headcount?"):
                body = {"model": DEFAULT_MODEL, "max_tokens": 3, "prompt_cache_key": "tenant-9",
                        "messages": [{"role": "system", "content": DOC}, {"role": "user", "content": q}]}
                async with s.post(handle.url + "/v1/chat/completions", json=body) as r:
                    assert r.status == 200
                    await r.read()
            async with s.post(handle.url + "/invocations", data=b'{"prompt": "Confidential native body", "max_tokens": 2}',
                              headers={"Content-Type": "application/json"}) as r:
                assert r.status == 200
                await r.read()
            async with s.post(handle.url + "/v1/chat/completions", data=b"not json") as r:
                assert r.status == 400  # refused before routing: not recorded
            # Written as requests end, not only at shutdown; the size per request is reported.
            assert await eventually(lambda: len(path.read_bytes().splitlines()) == 4, 3)
            async with s.get(handle.admin_url + "/admin/status.json") as r:
                size = (await r.json())["router"]["trace"]
            assert size["records"] == 4 and size["bytes"] == len(path.read_bytes())
            assert size["bytes_per_request"] == size["bytes"] / 4
    finally:
        await handle.close()
        for runner, _ in started:
            await runner.cleanup()
    raw = path.read_bytes()
    assert b"Confidential" not in raw and b"revenue" not in raw and b"tenant-9" not in raw
    lines = [orjson.loads(line) for line in raw.splitlines()]
    assert len(lines) == 4
    chat = [x for x in lines if x["api"] == "openai-chat"]
    native = [x for x in lines if x["api"] == "native"]
    assert len(chat) == 3 and len(native) == 1
    assert {x["instance"] for x in chat} <= set(urls) and len({x["instance"] for x in chat}) == 1
    assert [x["decision"] for x in chat] == ["affinity"] * 3
    assert all(x["max_tokens"] == 3 and x["scope"] == DEFAULT_MODEL and x["tenant"] for x in chat)
    assert all(len(unpack_digests(x["digests"])) == -(-x["length"] // 64) for x in lines)
    assert all(x["format"] == "prefixroute-trace/2" for x in lines)
    # Small: the digests take 8 bytes (12 in base64) per 64 characters of routing text.
    assert all(len(orjson.dumps(x)) < 600 + x["length"] * 12 / 64 for x in lines)
    assert native[0]["unit"] == "bytes" and native[0]["scope"] == "default"
    trace = load_trace(path)
    keys = {r.prompt.routing_key(1024) for r in trace.records if r.prompt.scope == DEFAULT_MODEL}
    assert len(keys) == 1  # the three questions share their first 1,024 characters
