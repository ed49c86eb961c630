"""Active and passive health checking."""

from __future__ import annotations

import aiohttp
import pytest

from prefixroute.server.health import ProbeResult, check_all
from test_server_helpers import FakeInstance, closed_port_url, eventually, router_for


@pytest.fixture
async def backends():
    insts = [await FakeInstance().start() for _ in range(2)]
    yield insts
    for b in insts:
        await b.stop()


def _healthy(handle, url):
    return handle.fleet.endpoint().variant().get(url).healthy


async def test_check_all_marks_instances(backends):
    dead = closed_port_url()
    handle = await router_for([backends[0].url, backends[1].url, dead], unhealthy_threshold=1, healthy_threshold=1)
    try:
        backends[1].health_status = 503
        result = await check_all(handle.state)
        assert result == {backends[0].url: ProbeResult.OK, backends[1].url: ProbeResult.FAILED,
                          dead: ProbeResult.FAILED}
        assert [_healthy(handle, u) for u in (backends[0].url, backends[1].url, dead)] == [True, False, False]
        async with aiohttp.ClientSession() as http:
            for _ in range(5):  # only the healthy instance is used
                async with http.post(handle.url + "/v1/completions", json={"model": "m", "prompt": "p"}) as r:
                    assert r.headers["X-Prefixroute-Instance"] == backends[0].url
            async with http.get(handle.url + "/health") as r:
                assert (await r.json())["healthy_instances"] == 1
        backends[1].health_status = 200
        await check_all(handle.state)
        assert _healthy(handle, backends[1].url)
    finally:
        await handle.close()


async def test_periodic_checks_restore_an_instance(backends):
    handle = await router_for([b.url for b in backends], health_check_interval_s=0.05,
                              health_check_path="/health")
    try:
        pool = handle.fleet.endpoint().variant()
        pool.set_healthy(backends[0].url, False)  # e.g. after a refused connection
        assert await eventually(lambda: _healthy(handle, backends[0].url), timeout=2)
        backends[1].health_status = 500
        assert await eventually(lambda: not _healthy(handle, backends[1].url), timeout=2)
    finally:
        await handle.close()


async def test_health_path_setting(backends):
    handle = await router_for([backends[0].url], health_check_path="/missing")
    try:
        assert await check_all(handle.state) == {backends[0].url: ProbeResult.FAILED}  # 404 is not healthy
    finally:
        await handle.close()


def test_tracker_thresholds_and_backpressure():
    from prefixroute.server.health import HealthTracker

    state = {"a": True}
    t = HealthTracker(lambda i, h: state.__setitem__(i, h), lambda i: state[i], unhealthy_threshold=3,
                      healthy_threshold=2)
    t.probe("a", ProbeResult.OK)  # seen up: from now on the thresholds apply
    t.probe("a", ProbeResult.FAILED)
    t.passive_failure("a")
    assert state["a"]  # two failures: still in
    t.probe("a", ProbeResult.BUSY)  # backpressure: neither success nor failure
    assert state["a"]
    t.passive_success("a")  # an answer ends the streak
    t.probe("a", ProbeResult.FAILED)
    t.probe("a", ProbeResult.FAILED)
    assert state["a"]
    t.probe("a", ProbeResult.FAILED)
    assert not state["a"]  # three in a row: out
    t.probe("a", ProbeResult.OK)
    assert not state["a"]
    t.probe("a", ProbeResult.FAILED)  # the success streak is broken
    t.probe("a", ProbeResult.OK)
    assert not state["a"]
    t.probe("a", ProbeResult.OK)
    assert state["a"]  # two successes in a row: back
    t.passive_failure("a", definitive=True)  # a refused connection: out at once
    assert not state["a"]


def test_tracker_instance_never_seen_up_needs_no_threshold():
    from prefixroute.server.health import HealthTracker

    state = {"a": True, "b": True}
    t = HealthTracker(lambda i, h: state.__setitem__(i, h), lambda i: state[i], unhealthy_threshold=3,
                      healthy_threshold=3)
    t.probe("a", ProbeResult.FAILED)  # down at start: out at its first failed check
    assert not state["a"]
    t.probe("a", ProbeResult.OK)  # up at last: in at its first success
    assert state["a"]
    t.probe("a", ProbeResult.FAILED)  # seen up since: the threshold applies again
    t.probe("a", ProbeResult.FAILED)
    assert state["a"]
    t.probe("a", ProbeResult.FAILED)
    assert not state["a"]
    t.passive_success("b")  # a request answered: seen up
    t.probe("b", ProbeResult.FAILED)
    assert state["b"]


def test_tracker_without_active_checks_only_definitive_failures_eject():
    from prefixroute.server.health import HealthTracker

    state = {"a": True}
    t = HealthTracker(lambda i, h: state.__setitem__(i, h), lambda i: state[i], unhealthy_threshold=1,
                      healthy_threshold=1, active_checks=False)
    for _ in range(5):
        t.passive_failure("a")  # resets, timeouts: nothing would bring it back, so it stays
    assert state["a"]
    t.passive_failure("a", definitive=True)
    assert not state["a"]
