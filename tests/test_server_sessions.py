"""Sticky sessions through the router, on both data planes: boto3's SessionId
(``NEW_SESSION`` and the id it gives back), a container that makes its own session ids,
a configured header for OpenAI clients, two router replicas agreeing, bad ids."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import boto3
import pytest
from botocore.config import Config

from prefixroute.core.config import FleetConfig, RoutingConfig
from prefixroute.core.sessions import instance_tag
from prefixroute.server.runner import start_router
from test_server_helpers import FakeInstance, eventually, in_flight, settings

CA = RoutingConfig.build("cache-aware", None, 4)


def _sagemaker(url: str):
    return boto3.client("sagemaker-runtime", endpoint_url=url, region_name="us-east-1",
                        aws_access_key_id="x", aws_secret_access_key="x",
                        config=Config(retries={"max_attempts": 1, "mode": "standard"}))


@pytest.fixture
async def fakes():
    insts = [await FakeInstance().start() for _ in range(4)]
    yield insts
    for f in insts:
        await f.stop()


async def _router(fakes, data_plane, **kw):
    return await start_router(FleetConfig.single([f.url for f in fakes], CA),
                              settings(data_plane=data_plane, **kw))


async def test_boto3_new_session_then_every_call_to_its_instance(fakes, data_plane):
    handle = await _router(fakes, data_plane)
    try:
        rt = _sagemaker(handle.url)

        def run():
            first = rt.invoke_endpoint(EndpointName="default", Body=b'{"prompt": "hello"}',
                                       ContentType="application/json", SessionId="NEW_SESSION")
            sid = first["NewSessionId"]
            later = [rt.invoke_endpoint(EndpointName="default", Body=json.dumps({"prompt": f"q{i}" * 500}).encode(),
                                        ContentType="application/json", SessionId=sid.split(";")[0])
                     for i in range(12)]
            return first, sid, later

        first, sid, later = await asyncio.to_thread(run)
        home = first["ResponseMetadata"]["HTTPHeaders"]["x-prefixroute-instance"]
        assert sid.endswith(f"-pr{instance_tag(home)}")
        assert {o["ResponseMetadata"]["HTTPHeaders"]["x-prefixroute-instance"] for o in later} == {home}
        assert {o["ResponseMetadata"]["HTTPHeaders"]["x-prefixroute-decision"] for o in later} == {"session"}
        # the container gets the id without the router's pin tag
        sent = [h.get("X-Amzn-SageMaker-Session-Id") for f in fakes for _, h, _ in f.received]
        assert sent.count(sid[: -len(f"-pr{instance_tag(home)}")]) == 12 and sent.count("NEW_SESSION") == 1
        assert await eventually(lambda: in_flight(handle) == 0)
    finally:
        await handle.close()


async def test_a_containers_own_session_id_comes_back_pinned(fakes, data_plane):
    for f in fakes:
        f.extra_headers = {"X-Amzn-SageMaker-New-Session-Id": "ctr-9; Expires=2030-01-01T00:00:00Z"}
    handle = await _router(fakes, data_plane)
    try:
        async with aiohttp.ClientSession() as http:
            async with http.post(handle.url + "/endpoints/default/invocations", data=b'{"prompt": "x"}',
                                 headers={"X-Amzn-SageMaker-Session-Id": "NEW_SESSION"}) as r:
                assert r.status == 200
                home = r.headers["X-Prefixroute-Instance"]
                new = r.headers.getall("X-Amzn-SageMaker-New-Session-Id")
            assert new == [f"ctr-9-pr{instance_tag(home)}; Expires=2030-01-01T00:00:00Z"]
            for f in fakes:
                f.extra_headers = {}
            async with http.post(handle.url + "/endpoints/default/invocations", data=b'{"prompt": "y"}',
                                 headers={"X-Amzn-SageMaker-Session-Id": new[0].split(";")[0]}) as r:
                assert r.status == 200 and r.headers["X-Prefixroute-Instance"] == home
        last = next(f for f in fakes if f.url == home).received[-1]
        assert last[1]["X-Amzn-SageMaker-Session-Id"] == "ctr-9"
    finally:
        await handle.close()


async def test_a_configured_session_header_pins_openai_requests_on_every_replica(fakes, data_plane):
    replicas = [await _router(fakes, data_plane, session_header="X-Session-ID") for _ in range(2)]
    try:
        async with aiohttp.ClientSession() as http:
            where: dict[str, set[str]] = {}
            for i in range(24):
                sid = f"chat-{i % 6}"
                body = json.dumps({"model": "m", "messages": [{"role": "user", "content": f"turn {i} " * 200}]})
                async with http.post(replicas[i % 2].url + "/v1/chat/completions", data=body,
                                     headers={"X-Session-ID": sid, "Content-Type": "application/json"}) as r:
                    assert r.status == 200
                    where.setdefault(sid, set()).add(r.headers["X-Prefixroute-Instance"])
                    assert r.headers["X-Prefixroute-Decision"] == "session"
        assert all(len(v) == 1 for v in where.values()), where  # both replicas: the same instance
        assert len({next(iter(v)) for v in where.values()}) >= 2
    finally:
        for h in replicas:
            await h.close()


@pytest.mark.parametrize("path, header, value", [
    ("/endpoints/default/invocations", "X-Amzn-SageMaker-Session-Id", "bad id!"),
    ("/v1/chat/completions", "X-Amzn-SageMaker-Session-Id", "-x"),
    ("/v1/chat/completions", "X-Session-ID", "x" * 1025),
])
async def test_a_malformed_session_id_is_400_and_sent_nowhere(fakes, data_plane, path, header, value):
    handle = await _router(fakes, data_plane, session_header="X-Session-ID")
    try:
        async with aiohttp.ClientSession() as http:
            async with http.post(handle.url + path, data=b'{"model": "m", "messages": []}',
                                 headers={header: value}) as r:
                assert r.status == 400
                assert header in await r.text()
        assert not any(f.received for f in fakes)
    finally:
        await handle.close()
