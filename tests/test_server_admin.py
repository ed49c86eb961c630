"""Runtime reconfiguration: the admin API, config-file reload, and what stays untouched."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
import yaml

from prefixroute.core.config import ConfigError, FleetConfig, RoutingConfig
from prefixroute.server import ServerSettings, reload_logged, start_router
from test_server_helpers import FakeInstance, eventually, in_flight, router_for, settings

CHAT = {"model": "m", "messages": [{"role": "user", "content": "A" * 1500}]}
ROUTING_URL = "/admin/endpoints/default/variants/AllTraffic/routing"
PA_BODY = {"RoutingStrategy": "PREFIX_AWARE", "PrefixAwareRoutingConfig": {"PrefixLength": 2048,
                                                                           "ConcurrencyThreshold": 8}}


@pytest.fixture
async def backends():
    insts = [await FakeInstance().start() for _ in range(2)]
    yield insts
    for b in insts:
        await b.stop()


@pytest.fixture
async def router(backends):
    handle = await router_for([b.url for b in backends], RoutingConfig.build("random"))
    yield handle
    await handle.close()


def _states(doc):
    return {s["Instance"]: s for s in doc["Endpoints"][0]["ProductionVariants"][0]["InstanceStates"]}


async def test_get_config_shape(router, backends):
    async with aiohttp.ClientSession() as http:
        async with http.get(router.admin_url + "/admin/config") as r:
            assert r.status == 200
            doc = await r.json()
    assert doc["DefaultEndpoint"] == "default"
    variant = doc["Endpoints"][0]["ProductionVariants"][0]
    assert variant["VariantName"] == "AllTraffic"
    assert variant["RoutingConfig"] == {"RoutingStrategy": "RANDOM"}
    assert variant["Instances"] == [b.url for b in backends]
    assert _states(doc)[backends[0].url] == {"Instance": backends[0].url, "InFlight": 0, "Healthy": True,
                                             "Served": 0}
    # Without the live state it is a valid FleetConfig again.
    del doc["DefaultEndpoint"]
    del variant["InstanceStates"]
    assert FleetConfig.from_mapping(doc) == router.state.config


async def test_switch_routing_while_requests_in_flight(router, backends):
    for b in backends:
        b.mode = "hold"
    async with aiohttp.ClientSession() as http:
        held = asyncio.create_task(http.post(router.url + "/v1/chat/completions", json=CHAT))
        assert await eventually(lambda: in_flight(router) == 1)
        async with http.get(router.admin_url + "/admin/config") as r:
            before = _states(await r.json())
        busy = next(u for u, s in before.items() if s["InFlight"] == 1)

        async with http.put(router.admin_url + ROUTING_URL, json=PA_BODY) as r:
            assert r.status == 200
            assert (await r.json())["RoutingConfig"] == PA_BODY
        async with http.get(router.admin_url + "/admin/config") as r:
            doc = await r.json()
        assert doc["Endpoints"][0]["ProductionVariants"][0]["RoutingConfig"] == PA_BODY
        after = _states(doc)
        assert after[busy]["InFlight"] == 1 and after[busy]["Served"] == 1  # state kept

        for b in backends:
            b.mode = "echo"
            b.gate.set()
        resp = await held
        assert resp.status == 200  # the request in flight was not disturbed
        resp.release()
        async with http.post(router.url + "/v1/chat/completions", json=CHAT) as r:
            assert r.headers["X-Prefixroute-Decision"] == "affinity"
    assert in_flight(router) == 0
    pool = router.fleet.endpoint().variant()
    assert pool.routing.prefix_aware is not None and pool.routing.prefix_aware.prefix_length == 2048


@pytest.mark.parametrize("body,needle", [
    ({"RoutingStrategy": "PREFIX_AWARE", "PrefixAwareRoutingConfig": {"PrefixLength": 100,
                                                                       "ConcurrencyThreshold": 8}},
     "PrefixLength: 100 is out of range (allowed 1,024-65,536)"),
    ({"RoutingStrategy": "PREFIX_AWARE"}, "PrefixAwareRoutingConfig (PrefixLength and ConcurrencyThreshold)"),
    ({"RoutingStrategy": "FASTEST"}, "unknown strategy 'FASTEST'"),
    ({"RoutingStrategy": "RANDOM", "Bogus": 1}, "Bogus"),
])
async def test_invalid_routing_rejected_and_kept(router, body, needle):
    before = router.state.config
    async with aiohttp.ClientSession() as http:
        async with http.put(router.admin_url + ROUTING_URL, json=body) as r:
            assert r.status == 400
            assert needle in (await r.json())["message"]
    assert router.state.config is before
    assert router.fleet.endpoint().variant().routing == RoutingConfig.build("random")


async def test_admin_errors(router):
    async with aiohttp.ClientSession() as http:
        async with http.put(router.admin_url + "/admin/endpoints/default/variants/Nope/routing", json=PA_BODY) as r:
            assert r.status == 404 and "Nope" in (await r.json())["message"]
        async with http.put(router.admin_url + "/admin/endpoints/x/variants/AllTraffic/routing", json=PA_BODY) as r:
            assert r.status == 404 and "'x'" in (await r.json())["message"]
        async with http.put(router.admin_url + ROUTING_URL, data=b"{oops") as r:
            assert r.status == 400 and "not valid JSON" in (await r.json())["message"]
        async with http.post(router.admin_url + "/admin/reload") as r:
            assert r.status == 400 and "without --config" in (await r.json())["message"]
        async with http.put(router.admin_url + "/admin/config", json={"Endpoints": []}) as r:
            assert r.status == 400 and "Endpoints" in (await r.json())["message"]
        async with http.put(router.admin_url + "/admin/config", json=[1]) as r:
            assert r.status == 400


async def test_get_edit_put_round_trip(router, backends):
    async with aiohttp.ClientSession() as http:
        async with http.get(router.admin_url + "/admin/config") as r:
            doc = await r.json()
        doc["Endpoints"][0]["ProductionVariants"][0]["RoutingConfig"] = PA_BODY
        async with http.put(router.admin_url + "/admin/config", json=doc) as r:
            assert r.status == 200
    assert router.fleet.endpoint().variant().routing.to_api() == PA_BODY


async def test_replace_fleet_keeps_state_of_instances_that_stay(router, backends):
    extra = await FakeInstance().start()
    try:
        for b in backends:
            b.mode = "hold"
        async with aiohttp.ClientSession() as http:
            held = asyncio.create_task(http.post(router.url + "/v1/chat/completions", json=CHAT))
            assert await eventually(lambda: in_flight(router) == 1)
            busy = next(i.instance_id for i in router.fleet.endpoint().variant().instances if i.in_flight)
            new = {"Endpoints": [{"EndpointName": "default", "ProductionVariants": [
                {"VariantName": "AllTraffic", "Instances": [busy, extra.url],
                 "RoutingConfig": {"RoutingStrategy": "LEAST_OUTSTANDING_REQUESTS"}}]}]}
            async with http.put(router.admin_url + "/admin/config", json=new) as r:
                assert r.status == 200
                states = _states(await r.json())
            assert set(states) == {busy, extra.url}
            assert states[busy]["InFlight"] == 1
            # least outstanding: the new instance is idle, so it gets the next request
            async with http.post(router.url + "/v1/chat/completions", json=CHAT) as r:
                assert r.headers["X-Prefixroute-Instance"] == extra.url
                assert r.headers["X-Prefixroute-Decision"] == "least_outstanding"
            for b in backends:
                b.gate.set()
            resp = await held
            assert resp.status == 200
            resp.release()
        assert await eventually(lambda: in_flight(router) == 0)
    finally:
        await extra.stop()


async def test_reload_from_file(tmp_path, backends):
    path = tmp_path / "fleet.yaml"

    def write(routing: dict) -> None:
        path.write_text(yaml.safe_dump({"Endpoints": [{"EndpointName": "default", "ProductionVariants": [
            {"VariantName": "AllTraffic", "Instances": [b.url for b in backends], "RoutingConfig": routing}]}]}))

    write({"RoutingStrategy": "RANDOM"})
    config = FleetConfig.from_yaml(path.read_text())
    handle = await start_router(config, settings(config_path=str(path)))
    try:
        write(PA_BODY)
        assert reload_logged(handle.state) is True  # what SIGHUP runs
        assert handle.fleet.endpoint().variant().routing.strategy.value == "PREFIX_AWARE"

        write({"RoutingStrategy": "PREFIX_AWARE", "PrefixAwareRoutingConfig": {"PrefixLength": 5}})
        with pytest.raises(ConfigError, match="PrefixLength"):
            handle.reload_config()
        assert reload_logged(handle.state) is False  # logged, running config kept
        assert handle.fleet.endpoint().variant().routing.prefix_aware.prefix_length == 2048

        async with aiohttp.ClientSession() as http:
            async with http.post(handle.admin_url + "/admin/reload") as r:
                assert r.status == 400 and "ConcurrencyThreshold" in (await r.json())["message"]
            path.write_bytes(b"Endpoints: \xff\xfe\n")  # not UTF-8: a 400 too (was a 500 and a traceback)
            async with http.post(handle.admin_url + "/admin/reload") as r:
                assert r.status == 400 and "not UTF-8" in (await r.json())["message"]
            assert reload_logged(handle.state) is False
            write({"RoutingStrategy": "LEAST_OUTSTANDING_REQUESTS"})
            async with http.post(handle.admin_url + "/admin/reload") as r:
                assert r.status == 200
            async with http.post(handle.url + "/v1/chat/completions", json=CHAT) as r:
                assert r.headers["X-Prefixroute-Decision"] == "least_outstanding"
    finally:
        await handle.close()


async def test_admin_token(backends):
    handle = await router_for([backends[0].url], admin_token="s3cret")
    try:
        async with aiohttp.ClientSession() as http:
            for auth in (None, "Bearer wrong", "s3cret", "Bearer s3cre", "Basic s3cret"):
                headers = {"Authorization": auth} if auth else {}
                async with http.get(handle.admin_url + "/admin/config", headers=headers) as r:
                    assert r.status == 401
            for auth in ("Bearer s3cret", "bearer s3cret"):
                async with http.get(handle.admin_url + "/admin/config", headers={"Authorization": auth}) as r:
                    assert r.status == 200
            # the admin API is not on the serving port
            async with http.get(handle.url + "/admin/config") as r:
                assert r.status == 404
    finally:
        await handle.close()


def test_non_loopback_admin_requires_token():
    with pytest.raises(ConfigError, match="admin token is required"):
        ServerSettings(admin_host="0.0.0.0")
    assert ServerSettings(admin_host="0.0.0.0", admin_token="t").admin_enabled
    assert ServerSettings(admin_host="0.0.0.0", admin_port=0).admin_enabled is False
    assert ServerSettings(admin_host="::1").admin_enabled


async def test_admin_disabled_and_port_default(backends):
    handle = await router_for([backends[0].url], admin_port=0)
    try:
        assert handle.admin_url is None
    finally:
        await handle.close()


async def test_a_compressed_admin_body_is_decoded_strictly_as_inference_bodies_are(router, caplog):
    """The admin API decodes bodies with the inference routes' decoder: one that does
    not decode (a bad CRC was a 500; a truncated gzip body was taken as the part that
    decoded) is a JSON 400, a coding not decoded a JSON 415 (aiohttp's was plain
    text), a body past the limit once decoded a 413; no traceback is logged."""
    import gzip
    import logging
    import zlib

    from prefixroute.server.admin import ADMIN_MAX_BODY_BYTES

    doc = b'{"RoutingStrategy": "RANDOM"}'
    packed = gzip.compress(doc)
    async with aiohttp.ClientSession(auto_decompress=False) as http:
        for body, coding in ((packed[:-8] + b"\0" * 8, "gzip"), (b"not gzip at all", "gzip"),
                             (packed[: len(packed) // 2], "gzip"), (zlib.compress(doc)[:-3], "deflate")):
            async with http.put(router.admin_url + ROUTING_URL, data=body, headers={"Content-Encoding": coding}) as r:
                assert r.status == 400, (coding, await r.text())
                assert (await r.json())["message"].endswith("(its Content-Encoding)")
        for coding in ("br", "zstd", "gzip, gzip"):
            async with http.put(router.admin_url + ROUTING_URL, data=doc, headers={"Content-Encoding": coding}) as r:
                assert r.status == 415 and r.headers["Accept-Encoding"] == "deflate, gzip"
                assert "is not supported" in (await r.json())["message"]
        bomb = gzip.compress(b" " * (ADMIN_MAX_BODY_BYTES + 1) + doc)
        async with http.put(router.admin_url + ROUTING_URL, data=bomb, headers={"Content-Encoding": "gzip"}) as r:
            assert r.status == 413 and "too large" in (await r.json())["message"]
        for body, coding in ((packed, "gzip"), (zlib.compress(doc), "deflate"), (doc, "identity")):
            async with http.put(router.admin_url + ROUTING_URL, data=body, headers={"Content-Encoding": coding}) as r:
                assert r.status == 200 and (await r.json())["RoutingConfig"] == {"RoutingStrategy": "RANDOM"}
    assert not [rec for rec in caplog.records if rec.levelno >= logging.ERROR]
