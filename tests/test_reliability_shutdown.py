"""Shutdown: stop accepting, let streams in flight finish up to the deadline, then close."""

from __future__ import annotations

import asyncio
import logging
import contextlib
import os
import re
import signal
import sys
import time

import aiohttp
import orjson
import pytest

from prefixroute.core.config import FleetConfig, RoutingConfig
from prefixroute.server import ServerSettings, start_router

from fault_backend import Fault, FaultBackend, sse_events
from reliability_helpers import assert_invariants, eventually, in_flight, install_floor, sse_data

CHAT = b'{"model": "m", "messages": [{"role": "user", "content": "hello"}], "stream": true}'


@pytest.fixture
def floor(monkeypatch):
    return install_floor(monkeypatch)


@pytest.fixture
async def backend():
    b = await FaultBackend().start()
    yield b
    await b.stop()


async def _router(url, shutdown_timeout_s):
    return await start_router(FleetConfig.single([url], RoutingConfig.build("random")),
                              ServerSettings(port=0, admin_port=0, health_check_interval_s=0,
                                             metrics_scrape_interval_s=0, shutdown_timeout_s=shutdown_timeout_s))


async def test_stream_in_flight_finishes_and_new_connections_are_refused(backend, floor):
    backend.default = Fault("ok", events=10, delay=0.1)  # about 1 s
    handle = await _router(backend.url, shutdown_timeout_s=5.0)
    async with aiohttp.ClientSession() as http:
        r = await http.post(handle.url + "/v1/chat/completions", data=CHAT)
        first = await r.content.readuntil(b"\n\n")
        closing = asyncio.create_task(handle.close())
        await asyncio.sleep(0.1)
        assert not closing.done()
        async with aiohttp.ClientSession() as fresh:  # a new connection during the drain
            with pytest.raises(aiohttp.ClientConnectorError):
                await fresh.post(handle.url + "/v1/chat/completions", data=CHAT)
        rest = await r.read()
        assert first + rest == sse_events(10)  # the stream finished, whole
        await asyncio.wait_for(closing, 5)
    await assert_invariants(handle, [backend], floor)


@pytest.mark.parametrize("route", ["chat_stream", "response_stream", "native_stream"])
async def test_deadline_cuts_longer_streams_and_releases(backend, floor, caplog, data_plane, route):
    # A stream longer than --shutdown-timeout is cut at the deadline: the engine sees its
    # connection close and the slot is released. On the fast data plane its client gets
    # the stream's own error event (an SSE error object, an event-stream
    # InternalStreamFailure; a native SSE stream, relayed as is, an SSE error object too)
    # and the end of the body, as when an instance breaks off. The aiohttp plane closes
    # the connection.
    from reliability_helpers import request_for

    backend.default = Fault("ok", events=100, delay=0.05)  # 5 s: longer than the deadline
    handle = await start_router(FleetConfig.single([backend.url], RoutingConfig.build("random")),
                                ServerSettings(port=0, admin_port=0, health_check_interval_s=0,
                                               metrics_scrape_interval_s=0, shutdown_timeout_s=1.0,
                                               data_plane=data_plane))
    caplog.set_level(logging.WARNING, logger="prefixroute")
    path, body = request_for(route)
    async with aiohttp.ClientSession() as http:
        r = await http.post(handle.url + path, data=body, headers={"Content-Type": "application/json"})
        first = await r.content.readany()
        t0 = time.monotonic()
        await asyncio.wait_for(handle.close(), 5)
        assert 0.9 <= time.monotonic() - t0 < 1.7  # at the deadline (aiohttp alone would wait it twice over)
        message = "the router is shutting down: the response was cut before its end"
        if data_plane == "fast":
            rest = first + await r.read()  # a whole body, ended
            if route != "response_stream":
                events = sse_data(rest)
                assert orjson.loads(events[-1]) == {"error": {
                    "message": message, "type": "server_error", "param": None, "code": "router_shutting_down"}}
                assert 1 <= len(events) - 1 < 100 and all(e.startswith(b"{") for e in events[:-1])
            else:
                from botocore.eventstream import EventStreamBuffer

                buf = EventStreamBuffer()
                buf.add_data(rest)
                msgs = [(dict(m.headers), m.payload) for m in buf]
                assert msgs[-1][0][":exception-type"] == "InternalStreamFailure"
                assert orjson.loads(msgs[-1][1]) == {"Message": message}
                assert {h[":event-type"] for h, _ in msgs[:-1]} == {"PayloadPart"} and len(msgs) >= 2
        else:
            with pytest.raises(aiohttp.ClientPayloadError):
                await r.read()
    [rec] = backend.received
    assert await eventually(lambda: rec.t_closed is not None, 1.0)  # the engine was told
    assert in_flight(handle) == 0
    if data_plane == "fast":
        assert [r.getMessage() for r in caplog.records if "--shutdown-timeout" in r.getMessage()] == [
            "shutting down: 1 request still being answered after 1 s (--shutdown-timeout): cut, their "
            "connections closed"]
    await assert_invariants(handle, [backend], floor)


async def test_a_request_still_arriving_does_not_hold_up_the_shutdown(backend, floor, data_plane):
    # A client stalled mid-body (its request has reached no instance) must not keep the
    # router waiting for --shutdown-timeout (30 s here): its connection is closed when
    # shutting down starts, on both data planes, while a stream in flight (3 s) goes on
    # and finishes. A body that completes after that start is not routed.
    from urllib.parse import urlsplit

    backend.default = Fault("ok", events=1, delay=0.0)
    handle = await start_router(FleetConfig.single([backend.url], RoutingConfig.build("random")),
                                ServerSettings(port=0, admin_port=None, health_check_interval_s=0,
                                               metrics_scrape_interval_s=0, shutdown_timeout_s=30.0,
                                               data_plane=data_plane))
    u, a = urlsplit(handle.url), urlsplit(handle.admin_url)
    head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    late = head + b"Content-Length: %d\r\n\r\n" % len(CHAT)
    stalled = [(u, head + b"Content-Length: 4000\r\n\r\n" + CHAT[:40]),
               (u, head + b"Transfer-Encoding: chunked\r\n\r\n" + b"%x\r\n" % 2000 + CHAT[:40]),
               (a, b"PUT /admin/config HTTP/1.1\r\nHost: x\r\nContent-Length: 4000\r\n\r\n{"),
               (u, late + CHAT[:40])]  # completed once the shutdown has begun
    conns = [await asyncio.open_connection(where.hostname, where.port) for where, _ in stalled]
    for (_, data), (_, writer) in zip(stalled, conns):
        writer.write(data)
    # Idle keep-alive connections, one request answered on each: on the public port and the
    # admin API. They are closed too: a request sent on them afterwards gets no answer.
    idle = [await asyncio.open_connection(where.hostname, where.port) for where in (u, u, a)]
    again = [late + CHAT, late + CHAT, b"GET /admin/config HTTP/1.1\r\nHost: x\r\n\r\n"]
    for (reader, writer), data in zip(idle, again):
        writer.write(data)
        assert (await asyncio.wait_for(reader.readuntil(b"\r\n"), 5)).startswith(b"HTTP/1.1 200")
        head = await reader.readuntil(b"\r\n\r\n")
        if b"content-length:" in head.lower():
            await reader.readexactly(int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0]))
        else:  # a short stream, chunked
            await asyncio.wait_for(reader.readuntil(b"0\r\n\r\n"), 5)
    backend.default = Fault("ok", events=30, delay=0.1)  # 3 s
    async with aiohttp.ClientSession() as http:
        r = await http.post(handle.url + "/v1/chat/completions", data=CHAT)
        await r.content.readuntil(b"\n\n")
        await asyncio.sleep(0.2)  # the stalled bodies' first bytes are in
        t0 = time.monotonic()
        closing = asyncio.create_task(handle.close())
        await asyncio.sleep(0.05)
        conns[-1][1].write(CHAT[40:])  # the rest of the late one's body
        for (_, writer), data in zip(idle, again):  # a new request on each idle connection
            with contextlib.suppress(ConnectionError):
                writer.write(data)
        for reader, _ in idle:
            assert await asyncio.wait_for(reader.read(), 5) == b""
        for reader, _ in conns:  # closed without an answer, at once: well before the stream ends
            assert await asyncio.wait_for(reader.read(), 5) == b""
        assert time.monotonic() - t0 < 1.5
        assert not closing.done()  # the stream is still being answered
        rest = await r.read()  # and finishes
        await asyncio.wait_for(closing, 10)
        assert time.monotonic() - t0 < 6.0  # not the 30 s shutdown timeout
    assert len(backend.received) == 3  # the stream and the two idle connections' first requests, nothing else
    assert rest.endswith(b"data: [DONE]\n\n")
    for _, writer in conns + idle:
        writer.close()
    await assert_invariants(handle, [backend], floor)


async def test_requests_pipelined_behind_a_stream_get_a_503_each_at_shutdown(backend, floor):
    # Requests sent whole, pipelined behind a stream, before the shutdown begins: the
    # stream finishes; they are not routed (nothing is sent to an instance once shutting
    # down has begun), and each gets an answer, in order, the last with Connection:
    # close, instead of a connection closed on them (fast data plane): a 503 in its API's
    # shape, counted as its endpoint's; one its head alone refuses (unknown endpoint,
    # Expect: 100-continue) its own 404, counted once.
    from urllib.parse import urlsplit

    from test_server_helpers import metric_value

    backend.default = Fault("ok", events=15, delay=0.1)  # 1.5 s
    handle = await _router(backend.url, shutdown_timeout_s=10.0)
    u = urlsplit(handle.url)
    native = b'{"inputs": "hi", "stream": false}'
    plain = CHAT.replace(b'"stream": true', b'"stream": false')

    def post(path: bytes, body: bytes) -> bytes:
        return b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (
            path, len(body), body)

    refused = b"POST /endpoints/nope/invocations HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\nContent-Length: 9\r\n\r\n"
    reader, writer = await asyncio.open_connection(u.hostname, u.port)
    writer.write(post(b"/v1/chat/completions", CHAT) + post(b"/v1/chat/completions", plain)
                 + post(b"/invocations", native) + refused)
    assert (await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)).startswith(b"HTTP/1.1 200")
    first = await asyncio.wait_for(reader.readuntil(b"\n\n"), 5)  # the stream's first event
    closing = asyncio.create_task(handle.close())
    rest = await asyncio.wait_for(reader.read(), 10)  # to the end of the connection
    await asyncio.wait_for(closing, 10)
    stream, sep, after = rest.partition(b"\r\n0\r\n\r\n")  # the end of the chunked stream
    assert sep and b"\r\ndata: " in first and b"data: [DONE]" in stream
    answers = [a.split(b"\r\n\r\n", 1) for a in after.split(b"HTTP/1.1 ")[1:]]
    assert [h[:3] for h, _ in answers] == [b"503", b"503", b"404"]
    assert [b"connection: close" in h.lower() for h, _ in answers] == [False, False, True]
    assert orjson.loads(answers[0][1])["error"]["code"] == "router_shutting_down"
    assert b"x-amzn-errortype: serviceunavailable" in answers[1][0].lower()
    assert "shutting down" in orjson.loads(answers[1][1])["message"]
    assert b"x-amzn-errortype: validationerror" in answers[2][0].lower()
    assert len(backend.received) == 1  # the stream alone reached the instance
    text = handle.state.metrics.render().decode()
    assert metric_value(text, "prefixroute_responses_total", endpoint="default", variant="AllTraffic",
                        code="503") == 2
    assert metric_value(text, "prefixroute_responses_total", endpoint="unknown", code="404") == 1
    assert metric_value(text, "prefixroute_responses_total", endpoint="unknown", code="503") is None
    writer.close()
    await assert_invariants(handle, [backend], floor)


@pytest.mark.parametrize("keeps_sending", [False, True])
async def test_a_long_pipeline_behind_a_stream_ends_without_a_reset_at_shutdown(backend, floor, keeps_sending):
    # More pipelined input than the router reads behind a queue (it stops reading until
    # the queue drains): three 100 KB bodies. The requests read whole get their 503s,
    # the last with Connection: close (the client then knows the ones after it were not
    # processed); what is left unread is drained before the connection closes, since
    # closing on unread input makes the kernel reset it and drop the answers not yet
    # delivered (the end of the stream included). A client that keeps sending meanwhile
    # keeps the connection draining (until it has been silent for 2 s, at most 10 s).
    from urllib.parse import urlsplit

    backend.default = Fault("ok", events=10, delay=0.1)  # 1 s
    handle = await _router(backend.url, shutdown_timeout_s=10.0)
    u = urlsplit(handle.url)
    big = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "x" * 100_000}]})
    head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"
    reader, writer = await asyncio.open_connection(u.hostname, u.port)
    writer.write(head % len(CHAT) + CHAT + (head % len(big) + big) * 3)
    assert (await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)).startswith(b"HTTP/1.1 200")
    await asyncio.wait_for(reader.readuntil(b"\n\n"), 5)  # the stream's first event
    closing = asyncio.create_task(handle.close())
    await asyncio.sleep(1.5)  # the stream ends and the answers are written before the client reads on
    if keeps_sending:  # more input for 3.5 s, none of it read by the client's side yet
        for _ in range(14):
            writer.write(b"x" * 1000)
            await asyncio.sleep(0.25)
    rest = await asyncio.wait_for(reader.read(), 10)  # (a reset raises ConnectionResetError)
    await asyncio.wait_for(closing, 10)
    stream, sep, after = rest.partition(b"\r\n0\r\n\r\n")
    assert sep and b"data: [DONE]" in stream
    answers = [a.split(b"\r\n\r\n", 1) for a in after.split(b"HTTP/1.1 ")[1:]]
    assert 1 <= len(answers) <= 3 and all(h.startswith(b"503 ") for h, _ in answers)
    assert all(orjson.loads(b)["error"]["code"] == "router_shutting_down" for _, b in answers)
    assert [b"connection: close" in h.lower() for h, _ in answers] == [False] * (len(answers) - 1) + [True]
    assert len(backend.received) == 1
    writer.close()
    await assert_invariants(handle, [backend], floor)


async def _serve(backend, *extra: str, tmp=None, shutdown_timeout: str = "60", group: bool = False):
    """``prefixroute serve`` on ``backend`` as a child (its own process group if
    ``group``); returns it and its URL once it listens (killed if it does not)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **({"TMPDIR": str(tmp)} if tmp is not None else {})}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "prefixroute", "serve", "--backend", backend.url, "--port", "0", "--admin-port", "0",
        "--health-check-interval", "0", "--metrics-scrape-interval", "0", "--shutdown-timeout", shutdown_timeout,
        *extra, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, start_new_session=group, env=env)
    try:
        assert proc.stdout is not None and proc.stderr is not None
        line = (await asyncio.wait_for(proc.stdout.readline(), 60)).decode()
        m = re.fullmatch(r"prefixroute-serve listening on (http://127\.0\.0\.1:\d+)\n", line)
        assert m, line
    except BaseException:
        proc.kill()
        await proc.wait()
        raise
    return proc, m.group(1)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
async def test_serve_process_drains_on_signal(backend, sig):
    backend.default = Fault("ok", events=15, delay=0.1)  # 1.5 s
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "prefixroute.server.cli", "--backend", backend.url, "--port", "0", "--admin-port", "0",
        "--health-check-interval", "0", "--metrics-scrape-interval", "0", "--shutdown-timeout", "10",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        assert proc.stdout is not None
        line = (await asyncio.wait_for(proc.stdout.readline(), 20)).decode()
        m = re.fullmatch(r"prefixroute-serve listening on (http://127\.0\.0\.1:\d+)\n", line)
        assert m, line
        url = m.group(1)
        async with aiohttp.ClientSession() as http:
            r = await http.post(url + "/v1/chat/completions", data=CHAT)
            first = await r.content.readuntil(b"\n\n")
            proc.send_signal(sig)
            await asyncio.sleep(0.3)
            async with aiohttp.ClientSession() as fresh:
                with pytest.raises(aiohttp.ClientConnectorError):
                    await fresh.post(url + "/v1/chat/completions", data=CHAT)
            rest = await asyncio.wait_for(r.read(), 10)
        assert first + rest == sse_events(15)
        assert await asyncio.wait_for(proc.wait(), 10) == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
async def test_workers_drain_on_a_signal_to_the_process_group(backend, sig):
    """Ctrl-C (or a service manager's SIGTERM to the group) reaches the supervisor and
    every worker at once: the worker that serves a stream drains it to its end, and the
    supervisor's own SIGTERM to the workers a moment later does not kill it midway."""
    backend.default = Fault("ok", events=15, delay=0.1)  # 1.5 s
    proc, url = await _serve(backend, "--workers", "2", shutdown_timeout="10", group=True)
    try:
        assert proc.stderr is not None
        async with aiohttp.ClientSession() as http:
            r = await http.post(url + "/v1/chat/completions", data=CHAT)
            first = await r.content.readuntil(b"\n\n")
            os.killpg(proc.pid, sig)
            rest = await asyncio.wait_for(r.read(), 10)
        assert first + rest == sse_events(15)
        assert await asyncio.wait_for(proc.wait(), 15) == 0
        err = (await proc.stderr.read()).decode()
        assert "Traceback" not in err and "did not exit in time" not in err
    finally:
        if proc.returncode is None:
            os.killpg(proc.pid, signal.SIGKILL)
            await proc.wait()


@pytest.mark.parametrize("workers,plane", [(1, "fast"), (1, "aiohttp"), (2, "fast")])
async def test_a_second_stop_signal_cuts_the_drain_short(backend, tmp_path, workers, plane):
    """Ctrl-C twice: the first starts the drain, the second stops waiting for it. The
    stream in flight is cut (the engine sees its connection closed; one fast-plane
    process ends the client's stream with an error event), the router exits
    0 at once with a warning and no traceback, and leaves nothing in TMPDIR."""
    backend.default = Fault("ok", events=100, delay=0.1)  # 10 s, far beyond the test's waits
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    proc, url = await _serve(backend, "--workers", str(workers), "--data-plane", plane, tmp=tmp, group=True)
    try:
        assert proc.stderr is not None
        async with aiohttp.ClientSession() as http:
            r = await http.post(url + "/v1/chat/completions", data=CHAT)
            await r.content.readuntil(b"\n\n")
            os.killpg(proc.pid, signal.SIGINT)
            await asyncio.sleep(0.5)
            assert proc.returncode is None  # draining: the stream goes on
            more = await asyncio.wait_for(r.content.readuntil(b"\n\n"), 5)
            assert more.startswith(b"data: ")
            t0 = time.monotonic()
            os.killpg(proc.pid, signal.SIGINT)
            assert await asyncio.wait_for(proc.wait(), 10) == 0
            assert time.monotonic() - t0 < 5.0
            if plane == "fast" and workers == 1:  # the stream's own error event ends it
                events = sse_data(await asyncio.wait_for(r.read(), 5))
                assert orjson.loads(events[-1])["error"]["code"] == "router_shutting_down"
            else:  # (with --workers the supervisor kills its workers on the second signal)
                with pytest.raises(aiohttp.ClientPayloadError):
                    await asyncio.wait_for(r.read(), 5)
        [rec] = backend.received
        assert await eventually(lambda: rec.t_closed is not None, 2.0)  # the engine was told
        err = (await proc.stderr.read()).decode()
        assert "Traceback" not in err, err
        assert "SIGINT again" in err, err
        assert not list(tmp.iterdir())
    finally:
        if proc.returncode is None:
            os.killpg(proc.pid, signal.SIGKILL)
            await proc.wait()


async def test_a_second_stop_signal_right_after_the_first_is_not_lost(backend, tmp_path):
    """SIGTERM then SIGINT at once (a service manager, then an impatient operator): the
    second one cuts the drain short even though the event loop handles both in a row."""
    backend.default = Fault("ok", events=100, delay=0.1)
    proc, url = await _serve(backend, tmp=tmp_path)
    try:
        async with aiohttp.ClientSession() as http:
            r = await http.post(url + "/v1/chat/completions", data=CHAT)
            await r.content.readuntil(b"\n\n")
            proc.send_signal(signal.SIGTERM)
            proc.send_signal(signal.SIGINT)
            assert await asyncio.wait_for(proc.wait(), 10) == 0
        err = (await proc.stderr.read()).decode()
        # (both pending at once: the kernel delivers SIGINT, the lower number, first)
        assert "again: not waiting" in err and "Traceback" not in err, err
        assert not list(tmp_path.iterdir())
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


@pytest.mark.parametrize("gap_s", [0.005, 0.03, 0.08])
async def test_a_stop_signal_while_the_router_exits_is_ignored(backend, tmp_path, gap_s):
    """An idle router stops at once on the first Ctrl-C; a second one that comes while
    the process exits does not turn its status 0 into -2 (or print a traceback)."""
    proc, _ = await _serve(backend, tmp=tmp_path)
    try:
        proc.send_signal(signal.SIGINT)
        await asyncio.sleep(gap_s)
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGINT)
        assert await asyncio.wait_for(proc.wait(), 10) == 0
        err = (await proc.stderr.read()).decode()
        assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
        assert not list(tmp_path.iterdir())
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
