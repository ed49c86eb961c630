"""End to end with real emulated engines: boto3's ``invoke_endpoint_with_response_stream``
through the router, and the scrape of the engines' ``/metrics``."""

from __future__ import annotations

import asyncio
import json

import boto3
import botocore.exceptions
import pytest
from botocore.config import Config

from prefixroute.core.config import RoutingConfig
from prefixroute.engine.model import DEFAULT_MODEL, EngineConfig
from prefixroute.engine.server import start_engine_server
from prefixroute.server.scrape import scrape_all

from test_server_helpers import eventually, in_flight, metric_value, router_for

pytestmark = pytest.mark.e2e

DOC = "The retrieved document says many careful things about routing. " * 40


async def _engines(n: int, time_scale: float):
    started = [await start_engine_server(EngineConfig(), time_scale=time_scale, instance_id=f"s{i}",
                                         shutdown_timeout_s=0.1) for i in range(n)]
    return [r for r, _ in started], [f"http://127.0.0.1:{p}" for _, p in started]


def _client(url: str):
    return boto3.client("sagemaker-runtime", endpoint_url=url, region_name="us-east-1",
                        aws_access_key_id="x", aws_secret_access_key="x",
                        config=Config(retries={"max_attempts": 1, "mode": "standard"}, read_timeout=30))


def _sse_payloads(data: bytes) -> list[str]:
    return [line[6:].decode() for line in data.split(b"\n") if line.startswith(b"data: ")]


async def test_boto3_response_stream_end_to_end():
    runners, urls = await _engines(2, time_scale=0.0)
    handle = await router_for(urls, RoutingConfig.build("prefix-aware", 1024, 8))
    rt = _client(handle.url)
    body = json.dumps({"messages": [{"role": "system", "content": DOC}, {"role": "user", "content": "Summary?"}],
                       "max_tokens": 12, "stream": True}).encode()
    try:
        def run():
            out = []
            for _ in range(2):
                resp = rt.invoke_endpoint_with_response_stream(
                    EndpointName="default", Body=body, ContentType="application/json",
                    CustomAttributes="trace=7", PrefixAwareId="tenant-9", Accept="text/event-stream")
                parts = [event["PayloadPart"]["Bytes"] for event in resp["Body"]]
                out.append((resp, parts))
            with pytest.raises(rt.exceptions.ModelError) as bad:  # the model's 400 before any part
                rt.invoke_endpoint_with_response_stream(EndpointName="default", Body=b'{"stream": true}',
                                                        ContentType="application/json")
            with pytest.raises(rt.exceptions.ValidationError):
                rt.invoke_endpoint_with_response_stream(EndpointName="nope", Body=body)
            return out, bad.value

        results, bad = await asyncio.to_thread(run)
        instances = set()
        for resp, parts in results:
            assert resp["InvokedProductionVariant"] == "AllTraffic"
            assert resp["ContentType"] == "text/event-stream"  # the container's, via X-Amzn-SageMaker-Content-Type
            instances.add(resp["ResponseMetadata"]["HTTPHeaders"]["x-prefixroute-instance"])
            assert len(parts) >= 2  # chunk by chunk, not one buffered blob
            payloads = _sse_payloads(b"".join(parts))
            assert payloads[-1] == "[DONE]"
            chunks = [json.loads(p) for p in payloads[:-1]]
            assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
        assert len(instances) == 1  # same body, same tenant: same instance
        assert bad.response["OriginalStatusCode"] == 400
        assert await eventually(lambda: in_flight(handle) == 0)
    finally:
        await handle.close()
        for r in runners:
            await r.cleanup()


async def test_boto3_response_stream_engine_dies_mid_stream():
    runners, urls = await _engines(1, time_scale=1.0)
    handle = await router_for(urls, RoutingConfig.build("random"))
    rt = _client(handle.url)
    body = json.dumps({"prompt": DOC, "max_tokens": 400, "stream": True}).encode()
    got_first = asyncio.Event()
    loop = asyncio.get_running_loop()
    try:
        def run():
            resp = rt.invoke_endpoint_with_response_stream(EndpointName="default", Body=body)
            parts = []
            with pytest.raises(botocore.exceptions.EventStreamError) as err:
                for event in resp["Body"]:
                    parts.append(event["PayloadPart"]["Bytes"])
                    loop.call_soon_threadsafe(got_first.set)
            return parts, err.value

        task = asyncio.create_task(asyncio.to_thread(run))
        await asyncio.wait_for(got_first.wait(), 20)
        await runners[0].cleanup()  # the engine dies mid-generation
        parts, err = await asyncio.wait_for(task, 20)
        assert parts and err.response["Error"]["Code"] == "ModelStreamError"
        assert "closed the connection" in err.response["Error"]["Message"]
        assert await eventually(lambda: in_flight(handle) == 0)
    finally:
        await handle.close()


async def test_backend_metrics_scraped_and_exported():
    runners, urls = await _engines(2, time_scale=0.0)
    handle = await router_for(urls, RoutingConfig.build("prefix-aware", 1024, 8), metrics_scrape_interval_s=0.2)
    rt = _client(handle.url)
    body = json.dumps({"prompt": DOC + "question", "max_tokens": 2}).encode()
    try:
        def run():
            for _ in range(4):
                rt.invoke_endpoint(EndpointName="default", Body=body, ContentType="application/json")

        await asyncio.to_thread(run)
        stats = await scrape_all(handle.state)  # the loop would get there within 0.2 s; be exact
        assert set(stats) == set(urls)
        served = [s for s in stats.values() if s.prefix_cache_queries]
        assert len(served) == 1  # one prompt, one instance
        s = served[0]
        assert s.prefix_cache_hits > 0 and 0 < s.hit_rate < 1
        assert s.requests_running == 0 and s.requests_waiting == 0
        assert handle.state.backend_stats == stats  # kept in the router state
        text = handle.state.metrics.render().decode()
        [inst] = [u for u in urls if stats[u].prefix_cache_queries]
        assert metric_value(text, "prefixroute_backend_prefix_cache_queries_total", instance=inst) == \
            s.prefix_cache_queries
        assert metric_value(text, "prefixroute_backend_prefix_cache_hits_total", instance=inst) == s.prefix_cache_hits
        assert metric_value(text, "prefixroute_backend_prefix_cache_hit_rate", instance=inst) == pytest.approx(
            s.hit_rate)
        assert metric_value(text, "prefixroute_fleet_prefix_cache_hit_rate") == pytest.approx(s.hit_rate)
        assert metric_value(text, "prefixroute_backend_requests_running", instance=inst) == 0
        assert metric_value(text, "prefixroute_backend_requests_waiting", instance=inst) == 0
        assert metric_value(text, "prefixroute_backend_scrape_ok", instance=inst) == 1
        # A failed scrape is not a health failure: the values stay, marked stale.
        await runners[0].cleanup()
        await runners[1].cleanup()
        stats = await scrape_all(handle.state)
        assert all(not st.ok for st in stats.values())
        assert stats[inst].prefix_cache_queries == s.prefix_cache_queries
        assert all(i.healthy for _, p in handle.fleet.all_pools() for i in p.instances)
    finally:
        await handle.close()
    assert DEFAULT_MODEL
