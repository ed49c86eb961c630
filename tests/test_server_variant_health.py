"""Health where it matters: production variant choice and ``/health`` follow instance health.

* a variant with no healthy instance gets no weight (untargeted traffic goes to the others);
* ``/health`` names the variants that have no healthy instance (``degraded``);
* ``/health`` is not 200 while every instance of a variant is down at start.
"""

from __future__ import annotations

import asyncio
import socket
from collections import Counter

import aiohttp
import pytest
from aiohttp import web

from prefixroute.core.config import FleetConfig, RoutingConfig
from prefixroute.core.endpoint import Endpoint
from prefixroute.server import start_router
from prefixroute.server.health import check_all
from test_server_helpers import FakeInstance, closed_port_url, eventually, settings

RANDOM = RoutingConfig.build("random")


def _two_variants(a: list[str], b: list[str], weight_b: float = 1.0) -> FleetConfig:
    return FleetConfig.from_mapping({"Endpoints": [{"EndpointName": "llama", "ProductionVariants": [
        {"VariantName": "A", "InitialVariantWeight": 1, "Instances": a, "RoutingConfig": RANDOM},
        {"VariantName": "B", "InitialVariantWeight": weight_b, "Instances": b, "RoutingConfig": RANDOM},
    ]}]})


def test_variant_without_healthy_instance_gets_no_weight():
    cfg = _two_variants(["http://a1", "http://a2"], ["http://b1", "http://b2"], weight_b=100)
    ep = Endpoint(cfg.endpoints[0], seed=3)
    assert Counter(ep.variant().name for _ in range(400))["B"] > 350  # B has 100x the weight
    for url in ("http://b1", "http://b2"):
        ep.pools["B"].set_healthy(url, False)
    assert Counter(ep.variant().name for _ in range(400)) == {"A": 400}
    ep.pools["B"].set_healthy("http://b2", True)  # one instance back: B has its weight again
    assert Counter(ep.variant().name for _ in range(400))["B"] > 350


def test_every_variant_down_still_draws_by_weight_and_targets_are_kept():
    cfg = _two_variants(["http://a1"], ["http://b1"], weight_b=3)
    ep = Endpoint(cfg.endpoints[0], seed=5)
    ep.pools["A"].set_healthy("http://a1", False)
    ep.pools["B"].set_healthy("http://b1", False)
    drawn = Counter(ep.variant().name for _ in range(800))
    assert set(drawn) == {"A", "B"} and drawn["B"] > drawn["A"]  # (the pool then answers 503)
    ep.pools["B"].set_healthy("http://b1", True)
    assert ep.variant("A").name == "A"  # a targeted variant is what the caller asked for, healthy or not


@pytest.fixture
async def instance():
    inst = await FakeInstance().start()
    yield inst
    await inst.stop()


async def test_untargeted_requests_avoid_a_variant_that_is_down(instance, data_plane):
    dead = [closed_port_url(), closed_port_url()]
    handle = await start_router(_two_variants([instance.url], dead, weight_b=5),
                                settings(data_plane=data_plane, seed=11))
    try:
        await check_all(handle.state)
        await check_all(handle.state)  # (2 failures: the unhealthy threshold)
        async with aiohttp.ClientSession() as http:
            statuses = []
            for _ in range(30):
                async with http.post(handle.url + "/endpoints/llama/openai/v1/completions",
                                     json={"model": "m", "prompt": "hello"}) as r:
                    await r.read()
                    statuses.append((r.status, r.headers.get("X-Amzn-Invoked-Production-Variant")))
            assert statuses == [(200, "A")] * 30
            async with http.post(handle.url + "/endpoints/llama/openai/v1/completions",
                                 json={"model": "m", "prompt": "hello"},
                                 headers={"X-Amzn-SageMaker-Target-Variant": "B"}) as r:
                assert r.status == 503  # asked for B by name: no healthy instance there
            async with http.get(handle.url + "/health") as r:
                doc = await r.json()
                assert r.status == 200
                assert doc["status"] == "degraded"
                assert doc["variants_down"] == ["llama/B"]
                assert "llama/B" in doc["message"]
    finally:
        await handle.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def test_health_is_not_200_while_a_variant_is_down_at_start(instance, data_plane):
    port = _free_port()
    late = f"http://127.0.0.1:{port}"
    handle = await start_router(_two_variants([instance.url], [late]),
                                settings(data_plane=data_plane, health_check_interval_s=0.2,
                                         health_check_timeout_s=0.5))
    answers: list[tuple[int, str]] = []
    try:
        async with aiohttp.ClientSession() as http:
            for _ in range(8):  # from the first instant, over several health rounds
                async with http.get(handle.url + "/health") as r:
                    doc = await r.json()
                    answers.append((r.status, doc["status"]))
                    if doc["status"] == "starting" and doc.get("variants_down"):
                        assert doc["variants_down"] == ["llama/B"]
                await asyncio.sleep(0.1)
            assert all(status == 503 and text == "starting" for status, text in answers), answers
            # B's instance comes up: the router becomes ready within a health round or two.
            app = web.Application()
            async def ok(_: web.Request) -> web.Response:
                return web.Response(text="ok")

            app.router.add_get("/health", ok)
            runner = web.AppRunner(app)
            await runner.setup()
            await web.TCPSite(runner, "127.0.0.1", port).start()
            try:
                async def ready() -> bool:
                    async with http.get(handle.url + "/health") as r:
                        return r.status == 200 and (await r.json())["status"] == "ok"

                for _ in range(40):
                    if await ready():
                        break
                    await asyncio.sleep(0.05)
                assert await ready()
            finally:
                await runner.cleanup()
            # Once ready, B going down again is "degraded", still 200: A serves.
            assert await eventually(lambda: not handle.fleet.endpoint("llama").pools["B"].get(late).healthy, 3)
            async with http.get(handle.url + "/health") as r:
                assert r.status == 200 and (await r.json())["variants_down"] == ["llama/B"]
    finally:
        await handle.close()


async def test_health_without_active_checks_is_ready_at_once(instance, data_plane):
    handle = await start_router(_two_variants([instance.url], [instance.url]), settings(data_plane=data_plane))
    try:
        async with aiohttp.ClientSession() as http:
            async with http.get(handle.url + "/health") as r:
                doc = await r.json()
                assert (r.status, doc["status"], doc["variants_down"]) == (200, "ok", [])
                assert (doc["healthy_instances"], doc["instances"]) == (2, 2)
    finally:
        await handle.close()
