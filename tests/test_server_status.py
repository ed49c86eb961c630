"""The status page's data: ``GET /admin/status.json`` on both data planes, and its parts."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from prefixroute.core.config import FleetConfig, RoutingConfig
from prefixroute.server import start_router
from prefixroute.server.livestats import LiveStats, code_class, percentiles
from prefixroute.server.status import merge_documents
from test_server_helpers import FakeInstance, closed_port_url, settings

PA = RoutingConfig.build("prefix-aware", 1024, 4)


def test_percentiles_nearest_rank():
    assert percentiles([]) == {"p50": None, "p90": None, "p99": None, "n": 0}
    xs = [float(i) for i in range(1, 101)]  # 1..100
    assert percentiles(xs) == {"p50": 50.0, "p90": 90.0, "p99": 99.0, "n": 100}
    assert percentiles([3.0, 1.0, 2.0]) == {"p50": 2.0, "p90": 3.0, "p99": 3.0, "n": 3}


def test_code_classes():
    assert [code_class(c) for c in (200, 204, 404, 429, 502, 499, "499", "stream_aborted")] == \
        ["2xx", "2xx", "4xx", "4xx", "5xx", "499", "499", "stream_aborted"]


def test_live_stats_bounded_and_pruned():
    s = LiveStats()
    for i in range(1500):
        s.routed("e", "v", "http://a", "affinity", 200, i / 1000, 10, 0, None, f"r{i}")
    for i in range(30):
        s.routed("e", "v", "http://b", "overflow", 502, None, 0, 1, "reset", f"x{i}")
    v = s.variants[("e", "v")]
    assert (v.requests, v.retries, dict(v.decisions)) == (1530, 30, {"affinity": 1500, "overflow": 30})
    assert len(v.instances["http://a"].ttft) == 1000  # the window: the last 1,000
    assert min(v.instances["http://a"].ttft) == 0.5
    assert len(v.errors) == 20 and v.errors[-1]["request_id"] == "x29" and v.errors[-1]["kind"] == "reset"
    assert v.instances["http://a"].bytes_out == 15000
    s.retain([("e", "v", "http://a")])
    assert list(s.variants[("e", "v")].instances) == ["http://a"]
    s.retain([])
    assert s.variants == {}


async def _status(http, handle, **kw):
    async with http.get(handle.admin_url + "/admin/status.json", **kw) as r:
        return r.status, await r.json()


async def test_status_json_counts_what_happened(data_plane):
    a, b = await FakeInstance().start(), await FakeInstance().start()
    dead = closed_port_url()
    cfg = FleetConfig.from_mapping({"Endpoints": [{"EndpointName": "llama", "ProductionVariants": [
        {"VariantName": "A", "Instances": [a.url, b.url], "RoutingConfig": PA},
        {"VariantName": "B", "Instances": [dead], "RoutingConfig": RoutingConfig.build("random")}]}]})
    handle = await start_router(cfg, settings(data_plane=data_plane, admin_port=None))
    try:
        async with aiohttp.ClientSession() as http:
            prompts = [f"{i:03d}" + "x" * 1100 for i in range(12)]
            for p in prompts:
                async with http.post(handle.url + "/endpoints/llama/openai/v1/completions",
                                     json={"model": "m", "prompt": p},
                                     headers={"X-Amzn-SageMaker-Target-Variant": "A"}) as r:
                    assert r.status == 200
                    await r.read()
            async with http.post(handle.url + "/endpoints/llama/openai/v1/completions", data=b"{oops",
                                 headers={"X-Amzn-SageMaker-Target-Variant": "A"}) as r:
                assert r.status == 400
            async with http.post(handle.url + "/endpoints/llama/openai/v1/completions",
                                 json={"model": "m", "prompt": "p"},
                                 headers={"X-Amzn-SageMaker-Target-Variant": "B"}) as r:
                assert r.status == 503  # refused connection: B's one instance is out
            async with http.post(handle.url + "/endpoints/nope/invocations", data=b"x") as r:
                assert r.status == 404
            status, doc = await _status(http, handle)
        assert status == 200
        assert doc["router"]["data_plane"] == data_plane and doc["router"]["workers"] == 1
        [ep] = doc["endpoints"]
        va, vb = ep["variants"]
        assert (va["name"], va["strategy"], va["requests"], va["refused"]) == ("A", "PREFIX_AWARE", 12, 1)
        assert va["responses"] == {"2xx": 12, "4xx": 1}
        assert va["decisions"] == {"affinity": 12}
        assert va["ttft"]["n"] == 12 and 0 < va["ttft"]["p50"] <= va["ttft"]["p99"] < 5
        urls = [i["url"] for i in va["instances"]]
        assert urls == [a.url, b.url]
        served = {i["url"]: i["requests"] for i in va["instances"]}
        assert served == {a.url: len(a.received), b.url: len(b.received)} and sum(served.values()) == 12
        assert sum(i["share"] for i in va["instances"]) == pytest.approx(1.0)
        for inst in va["instances"]:
            assert inst["state"] == "up" and inst["in_flight"] == 0
            assert inst["bytes_out"] > 0 and inst["ttft"]["n"] == inst["requests"]
        [err] = va["errors"]
        assert (err["code"], err["kind"], err["instance"]) == ("400", "refused", None)
        assert "not valid JSON" in err["message"] and "oops" not in err["message"]
        assert (vb["requests"], vb["healthy"], vb["responses"]) == (1, 0, {"5xx": 1})
        assert vb["instances"][0]["state"] == "down"
        assert [(e["kind"], e["instance"]) for e in vb["errors"]] == [("upstream_unavailable", dead)]
        assert doc["router"]["health"]["status"] == "degraded"
        [unrouted] = doc["unrouted_errors"]
        assert (unrouted["code"], unrouted["endpoint"]) == ("404", "unknown")
    finally:
        await handle.close()
        await a.stop()
        await b.stop()


async def test_status_page_html_is_public_and_data_needs_the_token():
    a = await FakeInstance().start()
    handle = await start_router(FleetConfig.single([a.url], PA), settings(admin_port=None, admin_token="s3cret"))
    try:
        async with aiohttp.ClientSession() as http:
            async with http.get(handle.admin_url + "/admin/status") as r:
                page = await r.text()
                assert r.status == 200 and r.headers["Content-Type"].startswith("text/html")
                assert "status.json" in page and "http://" not in page.replace("http://www.w3.org", "")
                assert "<script src" not in page and "<link rel=\"stylesheet\"" not in page  # self-contained
            async with http.get(handle.admin_url + "/", allow_redirects=False) as r:
                assert r.status == 302 and r.headers["Location"] == "/admin/status"
            status, _ = await _status(http, handle)
            assert status == 401
            status, doc = await _status(http, handle, headers={"Authorization": "Bearer s3cret"})
            assert status == 200 and doc["endpoints"][0]["variants"][0]["instances"][0]["url"] == a.url
            async with http.get(handle.admin_url + "/admin/config") as r:
                assert r.status == 401  # the rest of the admin API still needs it
    finally:
        await handle.close()
        await a.stop()


def test_merge_documents_adds_workers_up():
    def doc(requests, samples, errors):
        inst = {"url": "http://a", "requests": requests, "bytes_out": 10 * requests, "served": requests,
                "responses": {"2xx": requests}, "decisions": {"affinity": requests}, "ttft_samples": samples,
                "ttft": {}, "share": 1.0}
        return {"router": {"workers": 1, "pid": 1}, "unrouted_errors": [],
                "endpoints": [{"name": "e", "variants": [{
                    "name": "v", "requests": requests, "refused": 1, "retries": 0, "responses": {"2xx": requests},
                    "decisions": {"affinity": requests}, "ttft_samples": samples, "ttft": {}, "errors": errors,
                    "instances": [inst]}]}]}

    merged = merge_documents([doc(3, [0.1, 0.2, 0.3], [{"time": 2}]),
                              doc(1, [0.9], [{"time": 1}, {"time": 3}])])
    v = merged["endpoints"][0]["variants"][0]
    assert (v["requests"], v["refused"], v["responses"], v["decisions"]) == (4, 2, {"2xx": 4}, {"affinity": 4})
    assert v["ttft"] == {"p50": 0.2, "p90": 0.9, "p99": 0.9, "n": 4}
    assert [e["time"] for e in v["errors"]] == [1, 2, 3]
    i = v["instances"][0]
    assert (i["requests"], i["bytes_out"], i["share"], i["ttft"]["n"]) == (4, 40, 1.0, 4)
    assert merged["router"]["workers"] == 2 and "ttft_samples" not in v


async def test_status_of_a_busy_instance_shows_in_flight(data_plane):
    a = await FakeInstance().start()
    a.mode = "hold"
    handle = await start_router(FleetConfig.single([a.url], PA), settings(data_plane=data_plane, admin_port=None))
    try:
        async with aiohttp.ClientSession() as http:
            held = asyncio.create_task(http.post(handle.url + "/v1/completions", json={"model": "m", "prompt": "p"}))
            for _ in range(200):
                if a.active:
                    break
                await asyncio.sleep(0.01)
            _, doc = await _status(http, handle)
            v = doc["endpoints"][0]["variants"][0]
            assert (v["in_flight"], v["instances"][0]["in_flight"], v["requests"]) == (1, 1, 0)
            a.gate.set()
            resp = await held
            assert resp.status == 200
            resp.release()
    finally:
        await handle.close()
        await a.stop()
