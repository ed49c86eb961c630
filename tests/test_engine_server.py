"""The emulated engine over real HTTP on loopback (aiohttp client, and the openai client)."""

from __future__ import annotations

import argparse
import asyncio
import re
import signal
import sys
import time
from collections.abc import AsyncIterator
from typing import Any, NamedTuple

import aiohttp
import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from prefixroute.core.keys import render_chat_text
from prefixroute.engine import cli
from prefixroute.engine.model import DEFAULT_MODEL, EngineConfig
from prefixroute.engine.server import ENGINE_KEY, GENERATION_PROMPT, EngineServer, start_engine_server
from prefixroute.engine.tokenizer import count_tokens

SYSTEM = "You are a meticulous assistant for the ACME knowledge base. " * 150  # 9,000 chars


def chat(question: str, max_tokens: int = 8, **extra: Any) -> dict[str, Any]:
    return {
        "model": DEFAULT_MODEL,
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
        "max_tokens": max_tokens,
        **extra,
    }


def engine_prompt(payload: dict[str, Any]) -> str:
    return render_chat_text(payload) + GENERATION_PROMPT


def expected_cached(earlier: str, later: str, block_size: int = 16) -> int:
    """Cached tokens of ``later`` after ``earlier`` ran alone on a fresh engine."""
    a, b = earlier.encode(), later.encode()
    common = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    blocks = min(common // 4 // block_size, (count_tokens(later) - 1) // block_size)
    return blocks * block_size


def sse_events(raw: str) -> list[Any]:
    out: list[Any] = []
    for block in raw.split("\n\n"):
        if block.strip():
            assert block.startswith("data: ")
            data = block[len("data: ") :]
            out.append(data if data == "[DONE]" else orjson.loads(data))
    return out


async def scrape(session: aiohttp.ClientSession) -> dict[str, float]:
    async with session.get("/metrics") as resp:
        assert resp.status == 200
        text = await resp.text()
    return {
        s.name: s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
        if s.labels.get("model_name") == DEFAULT_MODEL and "le" not in s.labels
    }


async def eventually(predicate: Any, timeout: float = 3.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)


class Running(NamedTuple):
    server: EngineServer
    session: aiohttp.ClientSession  # with base URL: request paths like "/v1/models"
    url: str


async def _started(time_scale: float, **config: Any) -> AsyncIterator[Running]:
    runner, port = await start_engine_server(EngineConfig(**config), "127.0.0.1", 0, time_scale, "engine-test")
    url = f"http://127.0.0.1:{port}"
    try:
        async with aiohttp.ClientSession(url) as session:
            yield Running(runner.app[ENGINE_KEY], session, url)
    finally:
        await runner.cleanup()


@pytest.fixture
async def engine() -> AsyncIterator[Running]:
    """An engine 100× faster than real time."""
    async for pair in _started(0.01):
        yield pair


@pytest.fixture
async def realtime_engine() -> AsyncIterator[Running]:
    async for pair in _started(1.0):
        yield pair


async def test_chat_non_stream_shape_and_prefix_cache(engine: Running) -> None:
    server, session, _ = engine
    first, second = chat("What is the refund policy?"), chat("How do I reset my password?", max_tokens=12)
    async with session.post("/v1/chat/completions", json=first) as resp:
        assert resp.status == 200
        assert resp.headers["X-Emulated-Instance"] == "engine-test"
        body = await resp.json()
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    assert body["model"] == DEFAULT_MODEL and isinstance(body["created"], int)
    choice = body["choices"][0]
    assert choice["message"]["role"] == "assistant" and choice["finish_reason"] == "length"
    assert len(choice["message"]["content"]) == 8 * 4  # eight 4-character words
    prompt_tokens = count_tokens(engine_prompt(first))
    assert body["usage"] == {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + 8,
        "completion_tokens": 8,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    async with session.post("/v1/chat/completions", json=second) as resp:
        usage = (await resp.json())["usage"]
    cached = expected_cached(engine_prompt(first), engine_prompt(second))
    assert cached >= 2_240  # the 9,000-character system prompt, in whole blocks
    assert usage["prompt_tokens_details"]["cached_tokens"] == cached
    assert usage["completion_tokens"] == 12


async def test_chat_stream_with_usage(engine: Running) -> None:
    _, session, _ = engine
    payload = chat("Summarise the policy.", max_tokens=6, stream=True, stream_options={"include_usage": True})
    async with session.post("/v1/chat/completions", json=payload) as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        events = sse_events(await resp.text())
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    content = [c["choices"][0]["delta"]["content"] for c in chunks[1:-1]]
    assert len(content) == 6
    assert [c["choices"][0]["finish_reason"] for c in chunks[1:-1]] == [None] * 5 + ["length"]
    assert chunks[-1]["choices"] == []
    assert chunks[-1]["usage"]["completion_tokens"] == 6
    assert chunks[-1]["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    # same prompt without streaming: same (deterministic) text, and now a cache hit
    async with session.post("/v1/chat/completions", json={**payload, "stream": False}) as resp:
        body = await resp.json()
    assert body["choices"][0]["message"]["content"] == "".join(content)
    prompt_tokens = count_tokens(engine_prompt(payload))
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == (prompt_tokens - 1) // 16 * 16


async def test_completions_text_token_ids_and_stream(engine: Running) -> None:
    _, session, _ = engine
    async with session.post("/v1/completions", json={"prompt": SYSTEM + "Q:", "max_tokens": 3}) as resp:
        body = await resp.json()
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
    assert len(body["choices"][0]["text"]) == 12
    assert body["usage"]["prompt_tokens"] == count_tokens(SYSTEM + "Q:")
    ids = list(range(500, 900))
    async with session.post("/v1/completions", json={"prompt": ids, "max_completion_tokens": 2}) as resp:
        body = await resp.json()
    assert body["usage"]["prompt_tokens"] == 400 and body["usage"]["completion_tokens"] == 2
    async with session.post("/v1/completions", json={"prompt": ids + [7], "stream": True, "max_tokens": 4}) as resp:
        events = sse_events(await resp.text())
    assert events[-1] == "[DONE]" and len(events) == 5
    assert all(e["object"] == "text_completion" and "usage" not in e for e in events[:-1])
    assert events[-2]["choices"][0]["finish_reason"] == "length"
    async with session.post("/v1/completions", json={"prompt": "hi"}) as resp:
        assert (await resp.json())["usage"]["completion_tokens"] == 16  # the default


async def test_metrics_follow_the_engine(engine: Running) -> None:
    _, session, _ = engine
    before = await scrape(session)
    assert before["vllm:prefix_cache_queries_total"] == 0 and before["vllm:num_requests_running"] == 0
    payloads = [chat("first question", 5), chat("second question", 7)]
    usages = []
    for p in payloads:
        async with session.post("/v1/chat/completions", json=p) as resp:
            usages.append((await resp.json())["usage"])
    after = await scrape(session)
    prompt = sum(u["prompt_tokens"] for u in usages)
    cached = sum(u["prompt_tokens_details"]["cached_tokens"] for u in usages)
    assert cached > 0
    assert after["vllm:prefix_cache_queries_total"] == prompt
    assert after["vllm:prefix_cache_hits_total"] == cached
    assert after["vllm:prompt_tokens_total"] == prompt
    assert after["vllm:generation_tokens_total"] == 12
    assert after["vllm:request_success_total"] == 2
    assert after["vllm:time_to_first_token_seconds_count"] == 2
    assert after["vllm:e2e_request_latency_seconds_count"] == 2
    assert after["vllm:num_requests_running"] == after["vllm:num_requests_waiting"] == 0
    assert after["vllm:kv_cache_usage_perc"] == after["vllm:gpu_cache_usage_perc"] == 0


async def test_invocations_is_the_sagemaker_container_contract(
    engine: Running,
) -> None:
    _, session, _ = engine
    async with session.get("/ping") as resp:
        assert resp.status == 200
    async with session.post("/invocations", json=chat("via sagemaker", 4)) as resp:
        body = await resp.json()
    assert body["object"] == "chat.completion" and body["usage"]["completion_tokens"] == 4
    async with session.post("/invocations", json={"prompt": "plain completion", "max_tokens": 2}) as resp:
        assert (await resp.json())["object"] == "text_completion"
    async with session.post("/invocations", json=chat("streamed", 3, stream=True)) as resp:
        events = sse_events(await resp.text())
    assert events[-1] == "[DONE]" and events[0]["object"] == "chat.completion.chunk"


@pytest.mark.parametrize(
    ("path", "body", "status", "needle"),
    [
        ("/v1/chat/completions", b"{not json", 400, "JSON"),
        ("/v1/chat/completions", b"[1, 2]", 400, "object"),
        ("/v1/chat/completions", orjson.dumps({"model": DEFAULT_MODEL}), 400, "messages"),
        ("/v1/completions", orjson.dumps({"max_tokens": 3}), 400, "prompt"),
        ("/v1/completions", orjson.dumps({"prompt": "x", "max_tokens": 0}), 400, "max_tokens"),
        ("/v1/completions", orjson.dumps({"prompt": "x", "max_tokens": "9"}), 400, "max_tokens"),
        ("/v1/completions", orjson.dumps({"prompt": ["a", "b"]}), 400, "batched"),
        ("/v1/completions", orjson.dumps({"prompt": [1, -5]}), 400, "token ids"),
        ("/v1/completions", orjson.dumps({"prompt": "x" * 600_000}), 400, "maximum context length"),
        ("/v1/completions", orjson.dumps({"prompt": "x", "stream": "yes"}), 400, "stream"),
        ("/v1/completions", orjson.dumps({"prompt": "x", "model": "other/model"}), 404, "does not exist"),
        ("/invocations", b"", 400, "JSON"),
    ],
)
async def test_bad_requests(
    engine: Running, path: str, body: bytes, status: int, needle: str
) -> None:
    server, session, _ = engine
    async with session.post(path, data=body, headers={"Content-Type": "application/json"}) as resp:
        assert resp.status == status
        err = (await resp.json())["error"]
    # vLLM's error types: NotFoundError for a model it does not serve, else a request error
    assert err["type"] == ("NotFoundError" if status == 404 else "invalid_request_error") and err["code"] == status
    assert needle in err["message"]
    assert server.num_in_flight == 0 and not server.core.has_work()


async def test_prompt_larger_than_kv_cache_is_400() -> None:
    async for server, session, _ in _started(0.01, kv_capacity_tokens=1_024, max_num_seqs=8, max_num_batched_tokens=512):
        async with session.post("/v1/completions", json={"prompt": "k" * 4_000, "max_tokens": 100}) as resp:
            assert resp.status == 400
            assert "KV cache" in (await resp.json())["error"]["message"]
        async with session.post("/v1/completions", json={"prompt": "k" * 3_000, "max_tokens": 10}) as resp:
            assert resp.status == 200  # 759 tokens of KV fit in 1,024


async def test_health_models_and_info(engine: Running) -> None:
    _, session, _ = engine
    async with session.get("/health") as resp:
        assert resp.status == 200 and await resp.read() == b""
        assert resp.headers["X-Emulated-Instance"] == "engine-test"
    async with session.get("/v1/models") as resp:
        models = await resp.json()
    assert models["object"] == "list" and models["data"][0]["id"] == DEFAULT_MODEL
    assert models["data"][0]["max_model_len"] == 131_072
    async with session.get("/info") as resp:
        info = await resp.json()
    assert info["instance_id"] == "engine-test" and info["time_scale"] == 0.01
    assert info["config"]["kv_capacity_tokens"] == 1_200_000 and info["stats"]["num_running"] == 0


async def test_concurrent_requests_batch_and_release(engine: Running) -> None:
    server, session, _ = engine
    seen_running = 0

    async def one(i: int) -> dict[str, Any]:
        async with session.post("/v1/chat/completions", json=chat(f"question {i}", 30)) as resp:
            return await resp.json()

    tasks = [asyncio.create_task(one(i)) for i in range(12)]
    while not all(t.done() for t in tasks):
        seen_running = max(seen_running, server.core.num_running)
        await asyncio.sleep(0.001)
    bodies = [t.result() for t in tasks]
    assert all(b["usage"]["completion_tokens"] == 30 for b in bodies)
    assert seen_running > 1  # continuous batching: several requests decode together
    assert server.num_in_flight == 0 and server.core.stats().kv_cache_usage == 0.0


async def test_steps_follow_the_modelled_clock(realtime_engine: Running) -> None:
    """Real time: an 8,000-token cold prefill takes ~0.29 s and TTFT is recorded in model seconds."""
    server, session, _ = realtime_engine
    start = time.perf_counter()
    async with session.post("/v1/completions", json={"prompt": "w" * 32_000, "max_tokens": 5}) as resp:
        assert resp.status == 200
    elapsed = time.perf_counter() - start
    modelled = (0.009 + 8_000 * 35e-6) + 4 * (0.009 + 1e-4)
    assert modelled <= elapsed < modelled + 0.25
    ttft = (await scrape(session))["vllm:time_to_first_token_seconds_sum"]
    assert 0.289 <= ttft < 0.289 + 0.05


async def test_stream_client_disconnect_aborts(realtime_engine: Running) -> None:
    server, session, _ = realtime_engine
    resp = await session.post("/v1/chat/completions", json=chat("long answer", 5_000, stream=True))
    first = await resp.content.readline()
    assert first.startswith(b"data: ")
    assert server.core.num_running == 1 and server.core.cache.usage > 0
    resp.close()  # drop the connection mid-stream
    await eventually(lambda: server.num_in_flight == 0)
    stats = server.core.stats()
    assert (stats.num_running, stats.num_waiting, stats.kv_cache_usage) == (0, 0, 0.0)
    assert stats.requests_aborted == 1 and stats.requests_finished == 0


async def test_non_stream_client_disconnect_aborts(
    realtime_engine: Running,
) -> None:
    server, session, _ = realtime_engine
    task = asyncio.create_task(session.post("/v1/chat/completions", json=chat("long answer", 5_000)))
    await eventually(lambda: server.core.num_running == 1)
    task.cancel()  # the client gives up: its connection closes
    with pytest.raises(asyncio.CancelledError):
        await task
    await eventually(lambda: server.num_in_flight == 0)
    stats = server.core.stats()
    assert (stats.num_running, stats.kv_cache_usage, stats.requests_aborted) == (0, 0.0, 1)
    metrics = await scrape(session)
    assert metrics["vllm:num_requests_running"] == 0 and metrics["vllm:request_success_total"] == 0


async def test_official_openai_client(engine: Running) -> None:
    import openai  # (the test extra installs it)
    _, _, url = engine
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused")
    try:
        done = await client.chat.completions.create(
            model=DEFAULT_MODEL, messages=chat("hello")["messages"], max_tokens=4
        )
        stream = await client.chat.completions.create(
            model=DEFAULT_MODEL, messages=chat("hello again")["messages"], max_tokens=4,
            stream=True, stream_options={"include_usage": True},
        )  # fmt: skip
        chunks = [c async for c in stream]
    finally:
        await client.close()
    assert done.usage is not None and done.usage.completion_tokens == 4
    usage = chunks[-1].usage
    assert usage is not None and usage.prompt_tokens_details is not None
    assert usage.prompt_tokens_details.cached_tokens > 2_000
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


async def test_cli_prints_its_port_serves_and_stops_on_sigterm() -> None:
    code = (
        "import argparse, sys; from prefixroute.engine import cli; p = argparse.ArgumentParser(); "
        "cli.configure_parser(p); sys.exit(cli.run(p.parse_args(sys.argv[1:])))"
    )
    args = ["--port", "0", "--time-scale", "0", "--instance-id", "cli-test", "--kv-capacity-tokens", "65536"]
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", code, *args, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    try:
        line = await asyncio.wait_for(proc.stdout.readline(), 20)  # type: ignore[union-attr]
        match = re.fullmatch(rb"prefixroute-emulate listening on http://127\.0\.0\.1:(\d+)\n", line)
        assert match, line
        url = f"http://127.0.0.1:{int(match.group(1))}"
        async with aiohttp.ClientSession(url) as session:
            async with session.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}) as resp:
                assert resp.status == 200 and resp.headers["X-Emulated-Instance"] == "cli-test"
            async with session.get("/info") as resp:
                assert (await resp.json())["config"]["kv_capacity_tokens"] == 65_536
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 20) == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


def test_cli_rejects_an_invalid_configuration(capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    cli.configure_parser(parser)
    assert cli.run(parser.parse_args(["--max-num-seqs", "0"])) == 2
    assert "max_num_seqs" in capsys.readouterr().err
    config = cli.config_from_args(parser.parse_args(["--prefill-s-per-token", "2e-5", "--model", "m"]))
    assert (config.prefill_s_per_token, config.model, config.max_num_seqs) == (2e-5, "m", 256)
