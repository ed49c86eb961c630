"""In-flight exactness: every path a request can take returns its in-flight slot."""

from __future__ import annotations

import asyncio
import random

import aiohttp
import pytest

from prefixroute.core.config import RoutingConfig

from test_server_helpers import FakeInstance, closed_port_url, eventually, in_flight, metric_value, router_for

CHAT = {"model": "m", "messages": [{"role": "user", "content": "Q" * 1500}]}


@pytest.fixture
async def backend():
    b = await FakeInstance().start()
    yield b
    await b.stop()


@pytest.fixture
async def router(backend):
    handle = await router_for([backend.url])
    yield handle
    await handle.close()


async def test_normal_and_streaming(router, backend):
    async with aiohttp.ClientSession() as http:
        async with http.post(router.url + "/v1/chat/completions", json=CHAT) as r:
            assert r.status == 200
            await r.read()
        assert in_flight(router) == 0
        backend.mode = "stream"
        backend.gates = [asyncio.Event(), asyncio.Event()]
        backend.gates[0].set()
        async with http.post(router.url + "/v1/chat/completions", json={**CHAT, "stream": True}) as r:
            await r.content.readuntil(b"\n\n")
            assert in_flight(router) == 1  # a stream counts until its end
            backend.gates[1].set()
            assert b"data: 1\n\n" + await r.read() == b"data: 1\n\ndata: 2\n\ndata: [DONE]\n\n"
        assert await eventually(lambda: in_flight(router) == 0)


async def test_backend_500(router, backend):
    backend.mode = "status"
    async with aiohttp.ClientSession() as http:
        async with http.post(router.url + "/v1/completions", json={"model": "m", "prompt": "p"}) as r:
            assert r.status == 500
        async with http.post(router.url + "/invocations", data=b"x") as r:
            assert r.status == 424
        async with http.get(router.url + "/metrics") as r:
            text = await r.text()
    assert in_flight(router) == 0
    assert metric_value(text, "prefixroute_upstream_errors_total", instance=backend.url, kind="http_5xx") == 2


async def test_connection_refused_retries_elsewhere(backend):
    dead = closed_port_url()
    backend.models = None  # neither lists its models: both are candidates (a listed one would be preferred)
    handle = await router_for([dead, backend.url], routing=RoutingConfig.build("random"))
    try:
        async with aiohttp.ClientSession() as http:
            for _ in range(20):  # RANDOM picks the dead one at some point (seeded)
                async with http.post(handle.url + "/v1/chat/completions", json=CHAT) as r:
                    assert r.status == 200
                    assert r.headers["X-Prefixroute-Instance"] == backend.url
            async with http.get(handle.url + "/metrics") as r:
                text = await r.text()
        pool = handle.fleet.endpoint().variant()
        assert pool.get(dead).healthy is False  # passive health check
        assert pool.get(backend.url).healthy is True
        assert metric_value(text, "prefixroute_upstream_errors_total", instance=dead, kind="connect") == 1
        assert in_flight(handle) == 0
        assert pool.get(dead).in_flight == 0
    finally:
        await handle.close()


async def test_all_refused_503():
    handle = await router_for([closed_port_url(), closed_port_url()])
    try:
        async with aiohttp.ClientSession() as http:
            async with http.post(handle.url + "/v1/chat/completions", json=CHAT) as r:
                assert r.status == 503
                assert (await r.json())["error"]["code"] == "upstream_unavailable"
            assert in_flight(handle) == 0
            async with http.post(handle.url + "/v1/chat/completions", json=CHAT) as r:
                assert r.status == 503  # both now marked unhealthy
                assert (await r.json())["error"]["code"] == "no_healthy_instance"
            async with http.post(handle.url + "/invocations", data=b"x") as r:
                assert r.status == 503 and r.headers["x-amzn-ErrorType"] == "ServiceUnavailable"
        assert in_flight(handle) == 0
    finally:
        await handle.close()


async def test_client_disconnect_mid_stream(router, backend):
    backend.mode = "stream"
    backend.gates = [asyncio.Event(), asyncio.Event()]
    backend.gates[0].set()
    async with aiohttp.ClientSession() as http:
        r = await http.post(router.url + "/v1/chat/completions", json={**CHAT, "stream": True})
        assert await r.content.readuntil(b"\n\n") == b"data: 1\n\n"
        assert in_flight(router) == 1
        r.close()  # the client goes away mid-stream
        assert await eventually(lambda: in_flight(router) == 0)
        # The router closed its upstream request at once: the instance saw the abort.
        assert await eventually(lambda: backend.cancelled == 1 and backend.active == 0)
        async with http.get(router.url + "/metrics") as m:
            text = await m.text()
    assert metric_value(text, "prefixroute_responses_total", endpoint="default", variant="AllTraffic",
                        code="499") == 1


async def test_client_disconnect_waiting_for_slow_backend(router, backend):
    backend.mode = "hold"  # never answers unless the gate opens
    async with aiohttp.ClientSession() as http:
        task = asyncio.create_task(http.post(router.url + "/v1/chat/completions", json=CHAT))
        assert await eventually(lambda: backend.active == 1)
        assert in_flight(router) == 1
        task.cancel()  # closes the client's connection
        with pytest.raises(asyncio.CancelledError):
            await task
    assert await eventually(lambda: in_flight(router) == 0)
    assert await eventually(lambda: backend.cancelled == 1)
    assert not backend.gate.is_set()


async def test_native_client_disconnect(router, backend):
    backend.mode = "hold"
    async with aiohttp.ClientSession() as http:
        task = asyncio.create_task(http.post(router.url + "/invocations", data=b"x" * 2000))
        assert await eventually(lambda: backend.active == 1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    assert await eventually(lambda: in_flight(router) == 0 and backend.cancelled == 1)


async def test_instance_dies_mid_stream(router, backend):
    backend.mode = "stream"
    backend.gates = [asyncio.Event(), asyncio.Event()]
    backend.gates[0].set()
    async with aiohttp.ClientSession() as http:
        r = await http.post(router.url + "/v1/chat/completions", json={**CHAT, "stream": True})
        assert await r.content.readuntil(b"\n\n") == b"data: 1\n\n"
        assert backend.runner is not None
        stop = asyncio.create_task(backend.runner.cleanup())  # kills the stream's connection
        rest = await asyncio.wait_for(r.read(), 5)  # cut at an event boundary: an error event, then a clean end
        assert rest.startswith(b'data: {"error":') and b"upstream_disconnected" in rest and b"[DONE]" not in rest
        r.release()
        await stop
    assert await eventually(lambda: in_flight(router) == 0)


async def test_random_client_behaviour_always_returns_to_zero(router, backend):
    """Property: whatever mix of completions, early aborts and stream abandonments the
    clients do, concurrently, in-flight ends at exactly zero."""
    rng = random.Random(1234)
    backend.mode = "stream"
    backend.chunks = [b"data: %d\n\n" % i for i in range(20)]

    async def client(http: aiohttp.ClientSession, action: str) -> None:
        body = {**CHAT, "stream": True}
        if action == "complete":
            async with http.post(router.url + "/v1/chat/completions", json=body) as r:
                await r.read()
        elif action == "abort_after_first":
            r = await http.post(router.url + "/v1/chat/completions", json=body)
            await r.content.readuntil(b"\n\n")
            r.close()
        else:  # abort before any answer
            task = asyncio.create_task(http.post(router.url + "/v1/chat/completions", json=body))
            await asyncio.sleep(rng.random() * 0.01)
            task.cancel()
            try:
                (await task).close()
            except asyncio.CancelledError:
                pass

    async with aiohttp.ClientSession() as http:
        actions = [rng.choice(["complete", "abort_after_first", "abort_early"]) for _ in range(40)]
        await asyncio.gather(*(client(http, a) for a in actions))
    assert await eventually(lambda: in_flight(router) == 0)
    assert await eventually(lambda: backend.active == 0)


async def test_shutdown_lets_in_flight_finish(backend):
    backend.mode = "hold"
    handle = await router_for([backend.url], shutdown_timeout_s=5.0)
    async with aiohttp.ClientSession() as http:
        task = asyncio.create_task(http.post(handle.url + "/v1/chat/completions", json=CHAT))
        assert await eventually(lambda: backend.active == 1)
        closing = asyncio.create_task(handle.close())
        await asyncio.sleep(0.1)
        assert not closing.done()  # waiting for the request in flight
        backend.gate.set()
        resp = await task
        assert resp.status == 200
        await resp.read()
        await asyncio.wait_for(closing, 5)
    assert in_flight(handle) == 0
