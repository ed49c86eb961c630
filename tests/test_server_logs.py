"""Structured logs and tracing: the JSON access log, X-Request-Id, W3C traceparent to the
engines, OpenTelemetry spans, and no prompt text in any log unless asked for."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re

import aiohttp
import pytest
from aiohttp import web

from prefixroute.core.config import FleetConfig, RoutingConfig
from prefixroute.core.keys import openai_route
from prefixroute.server import accesslog, start_router
from prefixroute.server import trace as trace_module
from prefixroute.server.tracecontext import TraceContext, parse_traceparent
from test_server_helpers import FakeInstance, closed_port_url, eventually, settings

PA = RoutingConfig.build("prefix-aware", 1024, 4)
SECRET = "SECRET-PROMPT-7f3a"  # prompt text that must never reach a log
TRACEPARENT = re.compile(r"00-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}")


@pytest.fixture
async def instances():
    insts = [await FakeInstance().start() for _ in range(2)]
    yield insts
    for i in insts:
        await i.stop()


@pytest.fixture(autouse=True)
def quick_flush(monkeypatch):
    monkeypatch.setattr(accesslog, "FLUSH_S", 0.02)
    monkeypatch.setattr(trace_module, "FLUSH_S", 0.02)


def _lines(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]  # the standard parser, line by line


async def test_access_log_one_json_line_per_request(instances, data_plane, tmp_path):
    log_path = tmp_path / "access.jsonl"
    dead = closed_port_url()
    for inst in instances:  # no model lists: the dead instance stays a candidate for model "m" too
        inst.models = None
    handle = await start_router(FleetConfig.single([dead, *[i.url for i in instances]], PA),
                                settings(data_plane=data_plane, access_log=str(log_path), max_retries=2))
    sent = []
    try:
        async with aiohttp.ClientSession() as http:
            async def call(path, **kw):
                async with http.post(handle.url + path, **kw) as r:
                    body = await r.read()
                    sent.append((r.status, r.headers.get("X-Request-Id"), kw))
                    return r, body

            pool = handle.fleet.endpoint().variant()
            for n in range(200):  # a prompt whose key prefers the dead instance: its request is retried
                chat = {"model": "m", "messages": [{"role": "user", "content": f"{SECRET} {n}" + " x" * 700}]}
                key, _ = openai_route(chat, True, PA)
                if pool.choose(key).instance.instance_id == dead:
                    break
            for _ in range(3):
                await call("/v1/chat/completions", json=chat)
            instances[0].mode = instances[1].mode = "stream"
            r, body = await call("/v1/chat/completions", json={**chat, "stream": True},
                                 headers={"X-Request-Id": "client-id-1"})
            assert r.headers["X-Request-Id"] == "client-id-1" and b"[DONE]" in body
            instances[0].mode = instances[1].mode = "echo"
            await call("/invocations", data=b'{"inputs": "' + SECRET.encode() + b'"}')
            await call("/v1/chat/completions", data=b'{"model": "m", "messages": "' + SECRET.encode())
            await call("/endpoints/nope/invocations", data=b"x")
            async with http.get(handle.url + "/no/such/path", headers={"X-Request-Id": "lost-1"}) as r:
                assert (r.status, r.headers["X-Request-Id"]) == (404, "lost-1")
        assert await eventually(lambda: log_path.exists() and len(log_path.read_text().splitlines()) == 8, 3)
    finally:
        await handle.close()
    by_id = {line["request_id"]: line for line in _lines(log_path)}  # (written in order of completion)
    assert SECRET not in log_path.read_text()
    lost = by_id.pop("lost-1")  # an unknown path: the router's own 404, logged with the id it answered with
    assert (lost["status"], lost["endpoint"], lost["error"]) == (404, "unknown", "refused")
    assert len(by_id) == 7 and set(by_id) == {rid for _, rid, _ in sent}  # the X-Request-Id the client got
    lines = [by_id[rid] for _, rid, _ in sent]
    assert [line["status"] for line in lines] == [s for s, _, _ in sent] == [200] * 5 + [400, 404]
    routed, bad_json, unknown = lines[:5], lines[5], lines[6]
    for line in routed:
        assert line["instance"] in {i.url for i in instances}
        assert line["decision"] in ("affinity", "overflow", "all_busy")
        assert re.fullmatch(r"[0-9a-f]{16}", line["key"]) and re.fullmatch(r"[0-9a-f]{32}", line["trace_id"])
        assert line["ttft_ms"] > 0 and line["duration_ms"] >= line["ttft_ms"] and line["bytes_out"] > 0
        assert line["endpoint"] == "default" and line["variant"] == "AllTraffic"
        assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", line["time"])
    assert len({line["key"] for line in routed[:4]}) == 1  # the same prefix, the same key digest
    assert [line["api"] for line in routed] == ["openai"] * 4 + ["native"]
    assert routed[0]["bytes_in"] == len(json.dumps(chat).encode())
    assert [(line["retries"], line["error"]) for line in routed] == [(1, "connect")] + [(0, None)] * 4
    assert routed[3]["request_id"] == "client-id-1" and routed[3]["bytes_out"] == len(
        b"".join(instances[0].chunks))
    assert (bad_json["error"], bad_json["instance"], bad_json["variant"]) == ("refused", None, "AllTraffic")
    assert (unknown["endpoint"], unknown["variant"]) == ("unknown", None)


async def test_no_prompt_text_in_any_log_unless_asked(instances, data_plane, tmp_path, caplog):
    caplog.set_level(logging.DEBUG)  # every logger, every level
    log_path, trace_path = tmp_path / "access.jsonl", tmp_path / "trace.jsonl"
    dead = closed_port_url()
    instances[0].models = None  # no model list: the dead instance stays a candidate for model "m" too
    handle = await start_router(FleetConfig.single([dead, instances[0].url], PA),
                                settings(data_plane=data_plane, access_log=str(log_path),
                                         record_trace=str(trace_path), admin_port=None))
    pool = handle.fleet.endpoint().variant()
    for n in range(200):  # a prompt whose key prefers the dead instance: a retry, and its WARNING
        first = {"model": "m", "messages": [{"role": "user", "content": SECRET * 40 + str(n)}]}
        if pool.choose(openai_route(first, True, PA)[0]).instance.instance_id == dead:
            break
    bodies = [
        {"json": first},
        {"json": {"model": "m", "prompt": SECRET * 40, "stream": True}},
        {"data": b'{"model": "m", "prompt": "' + SECRET.encode() + b'"'},  # cut short: 400
        {"json": {"model": "m", "prompt": SECRET, "prompt_cache_key": [SECRET]}},  # a key of the wrong type: 400
        {"json": {"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": SECRET}]}],
                  "stream": "yes"}},
    ]
    try:
        async with aiohttp.ClientSession() as http:
            for kw in bodies:
                async with http.post(handle.url + "/v1/chat/completions", **kw) as r:
                    await r.read()
            async with http.post(handle.url + "/invocations", data=SECRET.encode() * 30,
                                 headers={"X-Amzn-SageMaker-Prefix-Aware-Id": SECRET * 5}) as r:  # over 64
                assert r.status == 400
            async with http.post(handle.url + "/invocations", data=SECRET.encode() * 30) as r:
                assert r.status == 200
            instances[0].mode = "status"  # the model's own error
            async with http.post(handle.url + "/invocations", data=SECRET.encode()) as r:
                assert r.status == 424
            async with http.get(handle.admin_url + "/admin/status.json") as r:
                status_page = await r.text()
    finally:
        await handle.close()
    logged = "\n".join(rec.getMessage() + (rec.exc_text or "") for rec in caplog.records)
    assert len(caplog.records) > 0 and "connect failed" in logged  # DEBUG logs were captured
    assert len(_lines(log_path)) == 8 and len(_lines(trace_path)) == 3  # 3 routed, 5 refused
    for text in (logged, caplog.text, log_path.read_text(), trace_path.read_text(), status_page):
        assert SECRET not in text

    # Asked for with --log-prompts: the head of each body, in DEBUG lines only.
    caplog.clear()
    handle = await start_router(FleetConfig.single([instances[1].url], PA),
                                settings(data_plane=data_plane, log_prompts=True))
    try:
        async with aiohttp.ClientSession() as http:
            async with http.post(handle.url + "/v1/completions", json={"model": "m", "prompt": SECRET}) as r:
                assert r.status == 200
    finally:
        await handle.close()
    shown = [rec for rec in caplog.records if SECRET in rec.getMessage()]
    assert shown and all(rec.levelno == logging.DEBUG for rec in shown)


def test_traceparent_parsing():
    good = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    assert parse_traceparent(good) == ("4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7", "01")
    assert parse_traceparent("01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00-later") is not None
    for bad in (None, "", "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-x",
                "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
                "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
                "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
                "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01", "00-abc-def-01"):
        assert parse_traceparent(bad) is None, bad
    ctx = TraceContext.for_request({"traceparent": good, "tracestate": "vendor=1"})
    assert (ctx.trace_id, ctx.parent_id, ctx.flags, ctx.state) == (
        "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7", "01", "vendor=1")
    assert ctx.traceparent() == f"00-{ctx.trace_id}-{ctx.upstream_span_id}-01"
    fresh = TraceContext.for_request({"tracestate": "orphan=1"})
    assert fresh.parent_id is None and fresh.flags == "01" and fresh.state is None and fresh.sampled


async def test_traceparent_reaches_the_engine(instances, data_plane, tmp_path):
    log_path = tmp_path / "access.jsonl"
    handle = await start_router(FleetConfig.single([instances[0].url], PA),
                                settings(data_plane=data_plane, access_log=str(log_path)))
    caller = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00"
    try:
        async with aiohttp.ClientSession() as http:
            async with http.post(handle.url + "/v1/completions", json={"model": "m", "prompt": "p"},
                                 headers={"traceparent": caller, "tracestate": "vendor=abc"}) as r:
                assert r.status == 200
            async with http.post(handle.url + "/invocations", data=b"x") as r:  # native: a new trace
                assert r.status == 200
            async with http.post(handle.url + "/v1/completions", json={"model": "m", "prompt": "p"},
                                 headers={"traceparent": "garbage"}) as r:
                assert r.status == 200
        assert await eventually(lambda: log_path.exists() and len(log_path.read_text().splitlines()) == 3, 3)
    finally:
        await handle.close()
    got = [rec[1] for rec in instances[0].received]
    assert [h.getall("traceparent") for h in got] == [[got[0]["traceparent"]], [got[1]["traceparent"]],
                                                        [got[2]["traceparent"]]]  # one each, ours
    first, native, fresh = (h["traceparent"] for h in got)
    assert all(TRACEPARENT.fullmatch(t) for t in (first, native, fresh))
    assert first.startswith("00-4bf92f3577b34da6a3ce929d0e0e4736-") and first.endswith("-00")  # trace and flags kept
    assert first.split("-")[2] != "00f067aa0ba902b7"  # the router's span is the engine's parent
    assert got[0]["tracestate"] == "vendor=abc" and "tracestate" not in got[1]
    assert fresh.endswith("-01") and not fresh.startswith("00-4bf92f")
    logged = [line["trace_id"] for line in _lines(log_path)]
    assert logged == [t.split("-")[1] for t in (first, native, fresh)]


async def test_otel_spans_reach_an_otlp_receiver(instances, data_plane, monkeypatch):
    try:
        import opentelemetry.exporter.otlp.proto.http  # noqa: F401
        import opentelemetry.sdk  # noqa: F401
    except ImportError as exc:  # the otel extra: skipped locally without it, a failure in CI
        if os.environ.get("CI"):
            pytest.fail(f"CI must run the OpenTelemetry test (pip install -e '.[otel]'): {exc}")
        pytest.skip(f"needs the otel extra: {exc}")
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    spans: list = []

    async def receive(request: web.Request) -> web.Response:
        req = ExportTraceServiceRequest()
        req.ParseFromString(await request.read())
        for rs in req.resource_spans:
            for ss in rs.scope_spans:
                spans.extend(ss.spans)
        return web.Response(status=200)

    app = web.Application()
    app.router.add_post("/v1/traces", receive)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", f"http://127.0.0.1:{port}/v1/traces")
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")
    handle = await start_router(FleetConfig.single([instances[0].url], PA),
                                settings(data_plane=data_plane, otel_traces=True))
    caller = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    try:
        async with aiohttp.ClientSession() as http:
            async with http.post(handle.url + "/v1/completions", json={"model": "m", "prompt": "p"},
                                 headers={"traceparent": caller}) as r:
                assert r.status == 200
                rid = r.headers["X-Request-Id"]
            async with http.post(handle.url + "/v1/completions", json={"model": "m", "prompt": "p"},
                                 headers={"traceparent": caller[:-2] + "00"}) as r:  # not sampled: no span
                assert r.status == 200
        assert await eventually(lambda: len(spans) >= 4, 5)
    finally:
        await handle.close()  # flushes the exporter
        await runner.cleanup()
    by_name = {s.name: s for s in spans}
    assert sorted(by_name) == ["first byte", "prefixroute request", "route decision", "upstream"] and len(spans) == 4
    root, up = by_name["prefixroute request"], by_name["upstream"]
    assert {s.trace_id.hex() for s in spans} == {"4bf92f3577b34da6a3ce929d0e0e4736"}
    assert root.parent_span_id.hex() == "00f067aa0ba902b7"
    assert by_name["route decision"].parent_span_id == up.parent_span_id == root.span_id
    assert by_name["first byte"].parent_span_id == up.span_id
    engine_saw = instances[0].received[0][1]["traceparent"]
    assert engine_saw.split("-")[2] == up.span_id.hex()  # the engine's parent is the upstream span
    assert root.start_time_unix_nano <= up.start_time_unix_nano <= up.end_time_unix_nano <= root.end_time_unix_nano
    attrs = {a.key: (a.value.string_value or a.value.int_value) for a in root.attributes}
    assert attrs["prefixroute.request_id"] == rid and attrs["http.response.status_code"] == 200
    assert attrs["prefixroute.instance"] == instances[0].url and attrs["prefixroute.decision"] == "affinity"


async def test_unwritable_outputs_and_missing_extras_are_flag_errors(tmp_path, capsys):
    from prefixroute.server.cli import main

    assert main(["--backend", "http://127.0.0.1:1", "--access-log", str(tmp_path / "no" / "such" / "dir.log")]) == 2
    assert "--access-log" in capsys.readouterr().err
    assert main(["--backend", "http://127.0.0.1:1", "--record-trace", str(tmp_path)]) == 2
    assert "--record-trace" in capsys.readouterr().err


async def test_access_log_lines_never_interleave(tmp_path):
    path = tmp_path / "a.jsonl"
    logs = [accesslog.AccessLog(str(path)) for _ in range(3)]  # three workers, one file
    for n in range(400):
        for i, a in enumerate(logs):
            a.write({"worker": i, "n": n, "pad": "x" * (n % 700)})
        if n % 50 == 0:
            for a in logs:
                a.flush()
        await asyncio.sleep(0)
    for a in logs:
        a.close()
    lines = _lines(path)
    assert len(lines) == 1200
    for i in range(3):
        assert [x["n"] for x in lines if x["worker"] == i] == list(range(400))
