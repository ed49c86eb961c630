"""LoRA autoload (opt-in), end to end on emulated vLLM engines: a saturated or empty sticky
set grows by one load (shared by every waiting request), a spare copy or an idle adapter
is unloaded when slots run out (an adapter in use keeps its last copy), every load and
unload is logged and counted, and no engine ever
gets a request for an adapter it does not have (its own counter says so)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import aiohttp
import pytest

from prefixroute.core.config import FleetConfig
from prefixroute.engine.model import EngineConfig
from prefixroute.engine.server import ENGINE_KEY, start_engine_server
from prefixroute.server import start_router
from test_server_helpers import eventually, in_flight, metric_value, settings

LOAD_S = 0.4  # wall seconds of one adapter load (lora_load_s x time_scale)
TIME_SCALE = 0.05
PROMPT = "The shared instructions of the SQL assistant. " * 30


async def engines(n: int, max_loras: int, modules: list[dict[str, str]], runtime: tuple[bool, ...] = ()):
    cfg = EngineConfig(model="base", max_loras=max_loras, lora_load_s=LOAD_S / TIME_SCALE)
    started = [await start_engine_server(cfg, time_scale=TIME_SCALE, instance_id=f"e{i}", lora_modules=modules[i],
                                         runtime_lora_updating=runtime[i] if runtime else True) for i in range(n)]
    return [r for r, _ in started], [f"http://127.0.0.1:{p}" for _, p in started]


def servers(runners):
    return [r.app[ENGINE_KEY] for r in runners]


async def router_for(urls, data_plane, autoload=True, max_per_instance=None, idle_s=None, **kw):
    lora = {"Autoload": autoload, "Adapters": [{"LoraName": "sql", "LoraPath": "/adapters/sql"},
                                               {"LoraName": "old", "LoraPath": "/adapters/old"}]}
    if max_per_instance:
        lora["MaxAdaptersPerInstance"] = max_per_instance
    if idle_s is not None:
        lora["IdleSeconds"] = idle_s
    cfg = FleetConfig.from_mapping({"Endpoints": [{
        "EndpointName": "e", "LoraAdapters": lora, "ProductionVariants": [
            {"VariantName": "AllTraffic", "Instances": urls, "RoutingConfig": {
                "RoutingStrategy": "PREFIX_AWARE",
                "PrefixAwareRoutingConfig": {"PrefixLength": 1024, "ConcurrencyThreshold": 1}}}]}]})
    return await start_router(cfg, settings(data_plane=data_plane, **kw))


@contextlib.asynccontextmanager
async def lora_fleet(n: int, max_loras: int, modules: list[dict[str, str]], runtime: tuple[bool, ...] = (), *,
                     data_plane: str, **router_kw):
    """``engines(...)`` and a router over them (``router_for``'s settings); both stopped on exit."""
    runners, urls = await engines(n, max_loras, modules, runtime)
    try:
        router = await router_for(urls, data_plane, **router_kw)
        try:
            yield runners, urls, router
        finally:
            await router.close()
    finally:
        for r in runners:
            await r.cleanup()


async def ask(http, router, model, tokens, k=0):
    t0 = time.perf_counter()
    async with http.post(router.url + "/v1/completions", json={
            "model": model, "prompt": PROMPT + f" question {k}", "max_tokens": tokens, "stream": True}) as r:
        first = await r.content.readany()
        ttfb = time.perf_counter() - t0
        rest = await r.read()
        return r.status, r.headers.get("X-Prefixroute-Instance"), ttfb, first + rest, dict(r.headers)


async def test_a_saturated_set_grows_by_one_load_shared_by_the_waiting(data_plane, caplog):
    caplog.set_level(logging.INFO, logger="prefixroute.server.lora")
    async with lora_fleet(3, 2, [{"sql": "/adapters/sql"}, {}, {}],
                          data_plane=data_plane) as (runners, urls, router):
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as http:
            holder = asyncio.ensure_future(ask(http, router, "sql", 300))  # keeps e0 at its threshold (1)
            pool = router.fleet.endpoint("e").variant()
            assert await eventually(lambda: pool.get(urls[0]).in_flight == 1)
            waiting = await asyncio.gather(*(ask(http, router, "sql", 4, k) for k in range(1, 4)))
            status, inst, _, body, _ = await holder
            assert status == 200 and inst == urls[0] and b"[DONE]" in body
        grown = {w[1] for w in waiting}
        assert all(w[0] == 200 for w in waiting), [(w[0], w[3][:300]) for w in waiting]
        # the set grew by one instance; after their one load the waiting requests were taken
        # within the grown set (its new instance first), none refused
        assert len(grown - {urls[0]}) == 1
        new = (grown - {urls[0]}).pop()
        # none waited more than one load (plus its own short generation)
        assert max(w[2] for w in waiting) < LOAD_S + 0.6
        assert router.state.catalog.serving("sql") == {urls[0], new}
        engines_ = servers(runners)
        assert "sql" in engines_[urls.index(new)].adapters
        assert sum(e.lora_loads for e in engines_) == 1  # one load for the three waiting requests
        assert all(not e.not_served for e in engines_)  # no request reached an engine without its adapter
        text = router.state.metrics.render().decode()
        assert metric_value(text, "prefixroute_adapter_loads_total", instance=new, adapter="sql", result="ok") == 1
        assert metric_value(text, "prefixroute_adapter_load_seconds_count", instance=new) == 1
        assert metric_value(text, "prefixroute_adapter_sticky_set_size", adapter="sql") == 2
        assert any(f"LoRA adapter sql loaded on {new}" in m for m in caplog.messages)
        assert await eventually(lambda: in_flight(router) == 0)
        assert router.state.adapter_tracker.in_flight(urls[0], "sql") == 0


async def test_an_adapter_loaded_nowhere_is_loaded_and_an_idle_one_unloaded_for_its_slot(data_plane, caplog):
    caplog.set_level(logging.INFO, logger="prefixroute.server.lora")
    async with lora_fleet(2, 1, [{"old": "/adapters/old"}, {"old": "/adapters/old"}], data_plane=data_plane,
                          metrics_scrape_interval_s=0.1) as (runners, urls, router):
        # the slots (1 each) come from the engines' vllm:lora_requests_info
        assert await eventually(lambda: all(router.state.catalog.slots(u) == 1 for u in urls))
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as http:
            status, inst, ttfb, _, _ = await ask(http, router, "sql", 2)
        assert status == 200 and ttfb < LOAD_S + 0.6
        engine = servers(runners)[urls.index(inst)]
        assert engine.adapters == {"sql": "/adapters/sql"} and engine.lora_unloads == 1
        assert router.state.catalog.serving("old") == {u for u in urls if u != inst}
        assert all(not e.not_served for e in servers(runners))
        text = router.state.metrics.render().decode()
        assert metric_value(text, "prefixroute_adapter_unloads_total", instance=inst, adapter="old",
                            result="ok") == 1
        assert any(f"LoRA adapter old unloaded from {inst}" in m for m in caplog.messages)


async def test_an_adapters_last_copy_is_unloaded_only_once_idle(data_plane, caplog):
    # The review's case: an adapter in use (nothing in flight at that instant, a request a
    # moment ago) kept its only copy; the adapter loaded nowhere got the 429 instead.
    caplog.set_level(logging.INFO, logger="prefixroute.server.lora")
    idle_s = 0.6
    async with lora_fleet(1, 1, [{"old": "/adapters/old"}], data_plane=data_plane, idle_s=idle_s,
                          metrics_scrape_interval_s=0.1) as (runners, urls, router):
        engine = servers(runners)[0]
        assert await eventually(lambda: router.state.catalog.slots(urls[0]) == 1)
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as http:
            assert (await ask(http, router, "old", 2))[0] == 200
            assert router.state.adapter_tracker.in_flight(urls[0], "old") == 0
            status, _, _, body, headers = await ask(http, router, "sql", 2)
            assert status == 429 and headers["Retry-After"] == "1" and b"sticky_set_saturated" in body
            assert engine.adapters == {"old": "/adapters/old"} and engine.lora_unloads == engine.lora_loads == 0
            await asyncio.sleep(idle_s + 0.1)  # no request for "old" for IdleSeconds: idle, its slot may go
            status, inst, ttfb, _, _ = await ask(http, router, "sql", 2)
            assert status == 200 and inst == urls[0] and ttfb < LOAD_S + 0.6
            assert engine.adapters == {"sql": "/adapters/sql"} and engine.lora_unloads == engine.lora_loads == 1
            # and back: "sql" was just used, so "old", now loaded nowhere, waits its turn
            assert (await ask(http, router, "old", 2))[0] == 429
        assert not engine.not_served
        assert any(f"LoRA adapter old unloaded from {urls[0]}" in m for m in caplog.messages)


async def test_a_saturated_set_grows_only_into_an_idle_copy(data_plane):
    # e1 and e2 hold "old" (a spare copy each): in use, neither is taken for sql's saturated
    # set (its requests queue within it); idle, one is, and "old" keeps the other.
    idle_s = 1.5
    async with lora_fleet(3, 1, [{"sql": "/adapters/sql"}, {"old": "/adapters/old"}, {"old": "/adapters/old"}],
                          data_plane=data_plane, idle_s=idle_s,
                          metrics_scrape_interval_s=0.1) as (runners, urls, router):
        pool = router.fleet.endpoint("e").variant()
        assert await eventually(lambda: all(router.state.catalog.slots(u) == 1 for u in urls))
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as http:
            assert (await ask(http, router, "old", 2))[0] == 200  # "old" in use
            holder = asyncio.ensure_future(ask(http, router, "sql", 300))  # e0 at its threshold (1)
            assert await eventually(lambda: pool.get(urls[0]).in_flight == 1)
            status, inst, _, _, headers = await ask(http, router, "sql", 2, 1)
            assert (status, inst, headers["X-Prefixroute-Decision"]) == (200, urls[0], "all_busy")  # queued in the set
            await holder
            assert sum(e.lora_loads for e in servers(runners)) == 0
            await asyncio.sleep(idle_s + 0.1)  # "old" idle now
            holder = asyncio.ensure_future(ask(http, router, "sql", 2000))  # (~0.9 s: e0 stays busy past the load)
            assert await eventually(lambda: pool.get(urls[0]).in_flight == 1)
            status, inst, _, _, headers = await ask(http, router, "sql", 2, 2)
            assert status == 200 and inst in urls[1:]  # the set grew into one of old's slots
            assert float(headers["X-Prefixroute-Overhead-Ms"]) >= LOAD_S * 1000 * 0.9  # it waited the load
            await holder
        grown = servers(runners)[urls.index(inst)]
        assert grown.adapters == {"sql": "/adapters/sql"} and grown.lora_unloads == grown.lora_loads == 1
        assert router.state.catalog.serving("sql") == {urls[0], inst}
        assert router.state.catalog.serving("old") == set(urls[1:]) - {inst}  # not emptied
        assert all(not e.not_served for e in servers(runners))


async def test_without_autoload_a_saturated_set_is_a_429_and_never_overflows(data_plane):
    async with lora_fleet(3, 2, [{"sql": "/adapters/sql"}, {}, {}], data_plane=data_plane,
                          autoload=False) as (runners, urls, router):
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as http:
            holder = asyncio.ensure_future(ask(http, router, "sql", 300))
            pool = router.fleet.endpoint("e").variant()
            assert await eventually(lambda: pool.get(urls[0]).in_flight == 1)
            async with http.post(router.url + "/v1/completions",
                                 json={"model": "sql", "prompt": "x", "max_tokens": 2}) as r:
                assert r.status == 429 and r.headers["Retry-After"] == "1"
            async with http.post(router.url + "/v1/completions",  # the base model overflows as ever
                                 json={"model": "base", "prompt": PROMPT, "max_tokens": 2}) as r:
                assert r.status == 200
            assert (await holder)[0] == 200
        engines_ = servers(runners)
        assert sum(e.lora_loads for e in engines_) == 0 and all(not e.not_served for e in engines_)
        assert engines_[1].requests_by_model.get("sql", 0) == engines_[2].requests_by_model.get("sql", 0) == 0


async def test_a_failed_load_is_logged_counted_and_the_request_waits_within_the_set(data_plane, caplog):
    caplog.set_level(logging.INFO, logger="prefixroute.server.lora")
    # e1 serves LoRA but not runtime loading: its /v1/load_lora_adapter is a 404, as vLLM's
    # without VLLM_ALLOW_RUNTIME_LORA_UPDATING
    async with lora_fleet(2, 2, [{"sql": "/adapters/sql"}, {}], runtime=(True, False),
                          data_plane=data_plane) as (runners, urls, router):
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as http:
            holder = asyncio.ensure_future(ask(http, router, "sql", 300))
            pool = router.fleet.endpoint("e").variant()
            assert await eventually(lambda: pool.get(urls[0]).in_flight == 1)
            async with http.post(router.url + "/v1/completions",
                                 json={"model": "sql", "prompt": "x", "max_tokens": 2}) as r:
                assert r.status == 200  # the set could not grow: queued within it (all_busy), not refused
                assert r.headers["X-Prefixroute-Instance"] == urls[0]
                assert r.headers["X-Prefixroute-Decision"] == "all_busy"
            await holder
        text = router.state.metrics.render().decode()
        assert metric_value(text, "prefixroute_adapter_loads_total", instance=urls[1], adapter="sql",
                            result="failed") == 1
        assert any("load on" in m and "failed" in m for m in caplog.messages)
        assert not servers(runners)[1].not_served
