"""Fault injection: real fault-injecting instances on loopback behind the router.

Each scenario runs over the OpenAI route (JSON and SSE), ``/invocations`` (raw and
streamed) and ``invocations-response-stream``, then checks the invariants: every
in-flight count back to zero and never negative, the client got the documented status
or a cleanly ended stream, and no request reached two instances.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import aiohttp
import pytest

from prefixroute.core.config import FleetConfig, RoutingConfig
from prefixroute.server import ServerSettings, start_router

from fault_backend import TOKENS, Fault, FaultBackend, event_list, sse_events
from reliability_helpers import (
    ROUTES,
    STREAMING,
    assert_invariants,
    call,
    eventually,
    in_flight,
    install_floor,
    metrics_text,
    sse_data,
)
from test_server_helpers import metric_value

HEADERS_TIMEOUT = 1.0
IDLE_TIMEOUT = 0.5


@pytest.fixture
def floor(monkeypatch):
    return install_floor(monkeypatch)


@pytest.fixture
async def backends():
    bs = [await FaultBackend().start() for _ in range(2)]
    yield bs
    for b in bs:
        await b.stop()


async def _router(urls, routing=None, **kw):
    # Active checks on (so passive failures count): the first round at start, the next
    # never due during a test.
    base = dict(port=0, admin_port=0, health_check_interval_s=3600, metrics_scrape_interval_s=0,
                shutdown_timeout_s=1.0, seed=3, response_headers_timeout_s=HEADERS_TIMEOUT,
                stream_idle_timeout_s=IDLE_TIMEOUT, unhealthy_threshold=1)
    base.update(kw)
    handle = await start_router(FleetConfig.single(urls, routing or RoutingConfig.build("random")),
                                ServerSettings(**base))
    if base["health_check_interval_s"] > 0:  # the first round is over before the test's requests
        assert await eventually(lambda: handle.state.health.rounds >= 1, 3)
    return handle


@pytest.fixture
async def router(backends, data_plane):
    handle = await _router([b.url for b in backends], data_plane=data_plane)
    yield handle
    await handle.close()


@pytest.fixture
async def http():
    async with aiohttp.ClientSession() as s:
        yield s


def _all(backends, fault: Fault) -> None:
    for b in backends:
        b.default = fault


def _served(backends):
    return [r for b in backends for r in b.received]


# -- the instance answers ----------------------------------------------------------------


@pytest.mark.parametrize("route", ROUTES)
async def test_normal_answer(router, backends, http, floor, route):
    out = await call(http, router, route)
    assert out.status == 200 and out.error is None
    if route in ("chat_stream", "native_stream"):
        assert out.body == sse_events(6)  # relayed unchanged
    elif route == "response_stream":
        assert out.headers["Content-Type"] == "application/vnd.amazon.eventstream"
        assert out.headers["X-Amzn-SageMaker-Content-Type"] == "text/event-stream"
        assert out.payload == sse_events(6)
        assert all(h[":message-type"] == "event" for h, _ in out.events)
    else:
        assert out.json["choices"][0]["message"]["content"] == "".join(TOKENS)
    assert len(_served(backends)) == 1
    await assert_invariants(router, backends, floor)


@pytest.mark.parametrize("route", STREAMING)
async def test_split_writes_relayed_byte_for_byte(router, backends, http, floor, route):
    """Events and UTF-8 characters cut anywhere by the instance reach the client unchanged."""
    for size in (1, 2, 3, 7):
        _all(backends, Fault("split", events=6, chunk=size))
        out = await call(http, router, route)
        assert out.status == 200 and out.error is None
        assert out.payload == sse_events(6)
    await assert_invariants(router, backends, floor)


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("status,extra", [(400, {}), (404, {}), (422, {}), (500, {}), (429, {"Retry-After": "1"}),
                                          (503, {"Retry-After": "2"})])
async def test_error_status_passed_on_and_instance_stays(router, backends, http, floor, route, status, extra):
    _all(backends, Fault("status", status=status, headers=extra))
    out = await call(http, router, route)
    if route.startswith("chat"):
        assert out.status == status
        assert out.body == Fault().body  # the engine's error body, unchanged
    else:  # SageMaker: a model's non-2xx is a ModelError
        assert out.status == 424 and out.headers["x-amzn-ErrorType"] == "ModelError"
        assert out.json["OriginalStatusCode"] == status
    assert len(_served(backends)) == 1  # never retried on a status
    for b in backends:  # 4xx, 429 and 503 are answers, not a dead instance (unhealthy_threshold=1)
        assert router.fleet.endpoint().variant().get(b.url).healthy
    await assert_invariants(router, backends, floor)


@pytest.mark.parametrize("route", ("chat", "chat_stream", "native", "response_stream"))
@pytest.mark.parametrize("status", (429, 503))
async def test_retry_status_sends_a_429_or_503_elsewhere_and_holds_the_instance_back(backends, http, floor,
                                                                                      data_plane, route, status):
    """--retry-status: the refusing instance's answer never reaches the client (a 200
    from the other does), and the instance gets no new request during its Retry-After."""
    handle = await _router([b.url for b in backends], data_plane=data_plane, retry_statuses=frozenset({status}))
    try:
        backends[0].default = Fault("status", status=status, headers={"Retry-After": "30"})
        for _ in range(8):  # RANDOM sends one of them to the refusing instance (seeded)
            out = await call(http, handle, route)
            assert out.status == 200 and out.error is None
        assert len(backends[0].received) == 1  # then held back: not asked again within its Retry-After
        assert len(backends[1].received) == 8
        assert backends[0].received[0].body in [r.body for r in backends[1].received]  # the same request, again
        text = await metrics_text(http, handle)
        assert metric_value(text, "prefixroute_retries_total", endpoint="default", variant="AllTraffic",
                            reason=f"http_{status}") == 1
        assert metric_value(text, "prefixroute_upstream_errors_total", instance=backends[0].url,
                            kind=f"http_{status}") == 1
        assert handle.fleet.endpoint().variant().get(backends[0].url).healthy  # held back, not unhealthy
    finally:
        await handle.close()
    await assert_invariants(handle, backends, floor, frozenset(backends[0].ids()))


@pytest.mark.parametrize("route", ("chat", "native"))
async def test_retry_status_relays_the_last_answer_when_every_instance_refuses(backends, http, floor, data_plane,
                                                                              route):
    handle = await _router([b.url for b in backends], data_plane=data_plane, retry_statuses=frozenset({429, 503}))
    try:
        backends[0].default = Fault("status", status=503, headers={"Retry-After": "7"})
        backends[1].default = Fault("status", status=429, headers={"Retry-After": "9"})
        out = await call(http, handle, route)
        assert len(backends[0].received) == 1 and len(backends[1].received) == 1  # each asked once
        last = 429 if backends[1].received[0].t_received > backends[0].received[0].t_received else 503
        if route == "chat":
            assert (out.status, out.headers["Retry-After"]) == (last, "9" if last == 429 else "7")
            assert out.body == Fault().body
        else:
            assert out.status == 424 and out.json["OriginalStatusCode"] == last
        assert handle.state.retry_status.held() == {b.url for b in backends}
        # both held back: a request still goes where it would have gone, then to the other
        out = await call(http, handle, route)
        assert out.status in (429, 503, 424)
        assert len(backends[0].received) == len(backends[1].received) == 2
    finally:
        await handle.close()
    await assert_invariants(handle, backends, floor, frozenset(backends[0].ids()) | frozenset(backends[1].ids()))


def test_retry_after_is_read_as_seconds_or_a_date_and_holds_are_bounded():
    from prefixroute.core.retry_status import MAX_HOLD_S, RetryStatus, parse_retry_after, parse_statuses

    assert parse_retry_after("5") == 5.0 and parse_retry_after(b" 0 ") == 0.0
    assert parse_retry_after("Fri, 04 Dec 2026 20:00:10 GMT", now_wall=1796414400.0) == 10.0
    assert parse_retry_after("Fri, 04 Dec 2026 19:00:00 GMT", now_wall=1796414400.0) == 0.0  # past: now
    assert parse_retry_after("soon") is None and parse_retry_after("-3") is None and parse_retry_after(None) is None
    assert parse_statuses("429, 503") == {429, 503} and parse_statuses("none") == frozenset()
    with pytest.raises(ValueError, match="500"):
        parse_statuses("500")
    now = [100.0]
    rs = RetryStatus({503}, clock=lambda: now[0])
    assert not rs.retries(429, 2) and not rs.retries(503, 0) and rs.retries(503, 1)
    assert rs.hold("a", "3600") == MAX_HOLD_S and rs.hold("b", None) == 1.0 and rs.hold("c", "0") == 0.0
    assert rs.held() == {"a", "b"}
    now[0] += 1.0
    assert rs.held() == {"a"}
    now[0] += MAX_HOLD_S
    assert rs.held() == frozenset() and rs.holds == {}


# -- the instance cannot be reached: retried elsewhere ------------------------------------


@pytest.mark.parametrize("route", ROUTES)
async def test_refused_connection_retried_on_another_instance(router, backends, http, floor, route):
    await backends[0].refuse()
    for _ in range(6):  # RANDOM picks the refusing instance at some point (seeded)
        out = await call(http, router, route)
        assert out.status == 200 and out.error is None
    assert len(backends[1].received) == 6 and not backends[0].received
    pool = router.fleet.endpoint().variant()
    assert not pool.get(backends[0].url).healthy and pool.get(backends[1].url).healthy
    text = await metrics_text(http, router)
    assert metric_value(text, "prefixroute_retries_total", endpoint="default", variant="AllTraffic",
                        reason="connect") == 1
    await assert_invariants(router, backends, floor)


async def test_a_connect_timeout_counts_as_one_failure_not_as_a_refusal(backends, http, floor, data_plane):
    """An instance seen up whose listen queue is then full (an overloaded engine): a
    connect timeout retries the request elsewhere and counts one failure, so with
    UnhealthyThreshold 2 the instance stays in rotation after the first and goes out
    after the second in a row (a refused connection takes it out at once, above)."""
    import socket

    handle = await _router([b.url for b in backends], data_plane=data_plane, unhealthy_threshold=2,
                           connect_timeout_s=0.3, max_retries=2)
    hung_backend = backends[0]
    hung = hung_backend.url
    await hung_backend.refuse()  # seen up by the first round of checks; now its port hangs
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", hung_backend.port))
    listener.listen(0)
    fillers = []
    for _ in range(3):  # fill the accept queue: the kernel then drops the router's SYNs
        f = socket.socket()
        f.setblocking(False)
        with contextlib.suppress(BlockingIOError):
            f.connect(("127.0.0.1", hung_backend.port))
        fillers.append(f)
    try:
        pool = handle.fleet.endpoint().variant()
        timeouts = []
        for _ in range(30):  # RANDOM (seeded) picks the hung instance now and then
            out = await call(http, handle, "chat")
            assert out.status == 200 and out.error is None  # retried on the other instance
            n = metric_value(await metrics_text(http, handle), "prefixroute_retries_total", endpoint="default",
                             variant="AllTraffic", reason="connect") or 0
            if n > len(timeouts):
                timeouts.append((pool.get(hung).healthy, handle.state.health.state(hung)[0]))
            if not pool.get(hung).healthy:
                break
        # the first timeout: one failure, still in rotation; the second: out
        assert timeouts[0] == (True, 1)
        assert timeouts[-1] == (False, 2) and len(timeouts) == 2
    finally:
        await handle.close()
        for f in fillers:
            f.close()
        listener.close()


@pytest.mark.parametrize("route", ("chat", "native"))
async def test_all_refusing_is_503(router, backends, http, floor, route):
    for b in backends:
        await b.refuse()
    out = await call(http, router, route)
    assert out.status == 503
    if route == "native":
        assert out.headers["x-amzn-ErrorType"] == "ServiceUnavailable"
    else:
        assert out.json["error"]["code"] == "upstream_unavailable"
    await assert_invariants(router, backends, floor)


async def test_reset_while_sending_body_is_retried(backends, http, floor, data_plane):
    """The instance resets the connection before it has read the request: it cannot have
    started it, so the router sends it to the other instance."""
    first = []

    def choose(rec):
        if not first:
            first.append(rec)
            return Fault("reset_on_headers")
        return None

    for b in backends:
        b.choose = choose
    handle = await _router([b.url for b in backends], RoutingConfig.build("prefix-aware", 1024, 8),
                           response_headers_timeout_s=30, data_plane=data_plane)
    try:
        body = b'{"inputs": "' + b"x" * (24 << 20) + b'"}'  # far more than the socket buffers hold
        async with http.post(handle.url + "/invocations", data=body, headers={"X-Request-Id": "big"}) as r:
            assert r.status == 200
            served_by = r.headers["X-Prefixroute-Instance"]
            await r.read()
        [reset] = first
        other = next(b for b in backends if reset not in b.received)
        assert served_by == other.url
        assert [rec.body == body for rec in other.received] == [True]
        text = await metrics_text(http, handle)
        assert metric_value(text, "prefixroute_retries_total", endpoint="default", variant="AllTraffic",
                            reason="send") == 1
    finally:
        await handle.close()
    # The same id reached the instance that reset, but only its head: it never had the request.
    for b in backends:
        b.received = [rec for rec in b.received if rec is not reset]
    await assert_invariants(handle, backends, floor)


# -- the instance fails after receiving the request: never retried ------------------------


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("kind", ["reset_before_headers", "close_before_headers"])
async def test_failure_before_headers_not_retried(router, backends, http, floor, route, kind):
    _all(backends, Fault(kind))
    out = await call(http, router, route)
    if route.startswith("chat"):
        assert out.status == 502 and out.json["error"]["code"] == "upstream_error"
    else:
        assert out.status == 424 and out.headers["x-amzn-ErrorType"] == "ModelError"
    assert len(_served(backends)) == 1  # it may have started generating: no second instance
    [rec] = _served(backends)  # a passive failure (unhealthy_threshold=1): out of rotation
    assert not router.fleet.endpoint().variant().get(next(b.url for b in backends if rec in b.received)).healthy
    await assert_invariants(router, backends, floor)


@pytest.mark.parametrize("route", ROUTES)
async def test_stall_before_headers_times_out(router, backends, http, floor, route):
    _all(backends, Fault("stall"))
    t0 = time.monotonic()
    out = await call(http, router, route)
    elapsed = time.monotonic() - t0
    assert HEADERS_TIMEOUT <= elapsed < HEADERS_TIMEOUT + 1.5
    if route.startswith("chat"):
        assert out.status == 504 and out.json["error"]["code"] == "upstream_timeout"
    else:
        assert out.status == 424 and out.headers["x-amzn-ErrorType"] == "ModelError"
        assert "timed out" in out.json["message"]
    [rec] = _served(backends)
    assert await eventually(lambda: rec.t_closed is not None, 1.0)  # the engine saw the abort
    await assert_invariants(router, backends, floor)


@pytest.mark.parametrize("route", STREAMING)
async def test_reset_mid_stream_ends_cleanly_with_an_error(router, backends, http, floor, route):
    _all(backends, Fault("reset_after", after=3))
    out = await call(http, router, route)
    assert out.status == 200
    if route == "response_stream":
        assert out.error is None
        assert out.payload == b"".join(event_list(3, done=False))
        last_headers, last_payload = out.events[-1]
        assert last_headers[":message-type"] == "exception"
        assert last_headers[":exception-type"] == "ModelStreamError"
        assert b'"ErrorCode":"StreamBroken"' in last_payload
    else:
        assert out.error is None  # a clean end of the HTTP body...
        data = sse_data(out.body)
        assert out.body.startswith(b"".join(event_list(3, done=False)))
        assert b'"code":"upstream_disconnected"' in data[-1] and b"[DONE]" not in out.body  # ...with an error event
    text = await metrics_text(http, router)
    assert metric_value(text, "prefixroute_responses_total", endpoint="default", variant="AllTraffic",
                        code="stream_aborted") == 1
    assert metric_value(text, "prefixroute_responses_total", endpoint="default", variant="AllTraffic",
                        code="200") is None
    assert len(_served(backends)) == 1
    await assert_invariants(router, backends, floor)


@pytest.mark.parametrize("route", STREAMING)
async def test_silent_mid_stream_idle_timeout(router, backends, http, floor, route):
    _all(backends, Fault("stall_after", after=2))
    t0 = time.monotonic()
    out = await call(http, router, route)
    assert IDLE_TIMEOUT <= time.monotonic() - t0 < IDLE_TIMEOUT + 1.5
    assert out.status == 200 and out.error is None
    if route == "response_stream":
        h, payload = out.events[-1]
        assert h[":exception-type"] == "ModelStreamError" and b"ModelInvocationTimeExceeded" in payload
    else:
        assert b'"code":"upstream_timeout"' in sse_data(out.body)[-1]
    [rec] = _served(backends)
    assert await eventually(lambda: rec.t_closed is not None, 1.0)
    await assert_invariants(router, backends, floor)


async def test_slow_stream_is_never_cut_while_tokens_flow(router, backends, http, floor):
    """No total timeout: a stream longer than every timeout lives while events keep coming."""
    _all(backends, Fault("ok", events=12, delay=IDLE_TIMEOUT / 3))  # ~2 s, above HEADERS_TIMEOUT and IDLE_TIMEOUT
    out = await call(http, router, "chat_stream")
    assert out.status == 200 and out.body == sse_events(12)
    await assert_invariants(router, backends, floor)


@pytest.mark.parametrize("route", ("chat_stream", "native_stream", "response_stream"))
async def test_stream_without_done_is_relayed_and_counted(router, backends, http, floor, route):
    _all(backends, Fault("no_done", events=4))
    out = await call(http, router, route)
    assert out.status == 200 and out.error is None
    assert out.payload == sse_events(4, done=False)  # unchanged: the router adds nothing
    text = await metrics_text(http, router)
    if route == "chat_stream":
        assert sum(metric_value(text, "prefixroute_upstream_errors_total", instance=b.url, kind="no_done") or 0
                   for b in backends) == 1
    await assert_invariants(router, backends, floor)


async def test_mid_event_cut_aborts_the_client_connection(router, backends, http, floor):
    """Cut in the middle of an event, an error event would glue onto half an event: the
    client connection is aborted instead, so the truncation cannot look complete."""
    data = sse_events(20)
    cut = data.index(b"\n\n", 100) - 10  # inside the third-or-so event
    _all(backends, Fault("split", events=20, chunk=cut, delay=0.3))  # two writes: [0, cut) then a pause
    task = asyncio.create_task(call(http, router, "chat_stream"))
    assert await eventually(lambda: any(b.received for b in backends))
    await asyncio.sleep(0.15)
    for b in backends:
        for conn in list(b._conns):
            conn.reset()
    out = await task
    assert out.status == 200
    assert isinstance(out.error, aiohttp.ClientPayloadError)  # a truncated transfer, not a clean end
    text = await metrics_text(http, router)
    assert metric_value(text, "prefixroute_responses_total", endpoint="default", variant="AllTraffic",
                        code="stream_aborted") == 1
    await assert_invariants(router, backends, floor)


# -- the client goes away: the engine sees it at once --------------------------------------


@pytest.mark.parametrize("route,when", [(r, "before_headers") for r in ROUTES] + [(r, "mid_stream") for r in STREAMING])
async def test_client_abort_closes_upstream_within_1s(backends, http, floor, route, when):
    handle = await _router([b.url for b in backends], response_headers_timeout_s=30, stream_idle_timeout_s=30)
    try:
        if when == "before_headers":
            _all(backends, Fault("stall"))
        else:
            _all(backends, Fault("ok", events=200, delay=0.05))
        task = asyncio.create_task(call(http, handle, route, timeout=30))
        assert await eventually(lambda: len(_served(backends)) == 1)
        [rec] = _served(backends)
        if when == "mid_stream":
            await asyncio.sleep(0.2)  # some events are through
        assert in_flight(handle) == 1
        task.cancel()
        t_abort = time.monotonic()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert await eventually(lambda: rec.t_closed is not None, 1.5)
        assert rec.t_closed - t_abort < 1.0
        assert await eventually(lambda: in_flight(handle) == 0, 1.0)
        text = await metrics_text(http, handle)
        assert metric_value(text, "prefixroute_responses_total", endpoint="default", variant="AllTraffic",
                            code="499") == 1
    finally:
        await handle.close()
    await assert_invariants(handle, backends, floor)


@pytest.mark.parametrize("route", STREAMING)
async def test_a_client_that_stops_reading_is_cut_after_the_send_timeout(backends, http, floor, data_plane, route,
                                                                        caplog):
    """A client that asks for a long stream and reads none of it: after
    --client-send-timeout its connection is closed, the engine's request aborted and
    the slot freed (the stream-idle timeout is far off: this is the send timeout)."""
    import logging
    import socket

    from reliability_helpers import request_for

    caplog.set_level(logging.INFO)
    handle = await _router([b.url for b in backends], data_plane=data_plane, client_send_timeout_s=0.5,
                           stream_idle_timeout_s=60, response_headers_timeout_s=60)
    try:
        _all(backends, Fault("ok", events=400_000))
        path, body = request_for(route)
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a small window, never read
        sock.setblocking(False)
        host, port = handle.url.removeprefix("http://").split(":")
        await asyncio.get_running_loop().sock_connect(sock, (host, int(port)))
        head = (f"POST {path} HTTP/1.1\r\nHost: r\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\n\r\n").encode()
        await asyncio.get_running_loop().sock_sendall(sock, head + body)
        assert await eventually(lambda: len(_served(backends)) == 1, 3)
        [rec] = _served(backends)
        t0 = time.monotonic()
        assert await eventually(lambda: rec.t_closed is not None, 10), "the engine's request was never aborted"
        assert await eventually(lambda: in_flight(handle) == 0, 2)
        assert rec.t_closed - t0 < 8
        assert any("left an answer unread for 0.5 s" in r.getMessage() for r in caplog.records)
        text = await metrics_text(http, handle)
        assert metric_value(text, "prefixroute_responses_total", endpoint="default", variant="AllTraffic",
                            code="499") == 1
        sock.close()
    finally:
        await handle.close()
    await assert_invariants(handle, backends, floor)


@pytest.mark.parametrize("route", ("chat", "chat_stream", "native"))
async def test_a_client_gone_while_the_router_connects_frees_its_slot_and_is_not_retried(backends, http, floor,
                                                                                        data_plane, route):
    """The instance's listen queue is full (its connect hangs): a client that gives up
    meanwhile gets its slot freed at once, and when the connect times out no retry is
    sent to another instance on behalf of a client that has gone."""
    import socket

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)
    port = listener.getsockname()[1]
    fillers = []
    for _ in range(3):  # fill the accept queue: the kernel then drops the router's SYNs
        f = socket.socket()
        f.setblocking(False)
        with contextlib.suppress(BlockingIOError):
            f.connect(("127.0.0.1", port))
        fillers.append(f)
    hung = f"http://127.0.0.1:{port}"
    handle = await _router([hung, backends[0].url], data_plane=data_plane, health_check_interval_s=0,
                           connect_timeout_s=1.0, max_retries=2)
    try:
        pool = handle.fleet.endpoint().variant()
        for _ in range(20):  # RANDOM (seeded) sends one to the hung instance
            served = len(backends[0].received)
            try:
                await call(http, handle, route, timeout=0.3)
            except (asyncio.TimeoutError, aiohttp.ServerTimeoutError):
                break
            assert len(backends[0].received) == served + 1
        else:
            pytest.fail("no request went to the hung instance")
        served = len(backends[0].received)
        assert await eventually(lambda: in_flight(handle) == 0, 0.5), "the slot was kept while connecting"
        assert pool.get(hung).in_flight == 0
        await asyncio.sleep(1.5)  # the connect timeout passes
        assert len(backends[0].received) == served  # no retry for a client that has gone
        text = await metrics_text(http, handle)
        assert metric_value(text, "prefixroute_responses_total", endpoint="default", variant="AllTraffic",
                            code="499") == 1
        assert not metric_value(text, "prefixroute_retries_total", endpoint="default", variant="AllTraffic",
                                reason="connect")
    finally:
        await handle.close()
        for f in fillers:
            f.close()
        listener.close()
    await assert_invariants(handle, backends, floor)


@pytest.mark.parametrize("route", ("chat", "chat_stream", "native"))
async def test_a_kept_alive_connection_failing_before_an_answer_is_retried_once_on_a_new_one(backends, http, floor,
                                                                                           data_plane, route):
    """The instance closes a kept-alive connection as the next request goes out on it
    (its idle timeout): sent again once, on a new connection, and answered; the
    instance stays healthy. A second failure is not sent a third time."""
    handle = await _router([backends[0].url], data_plane=data_plane, max_retries=2)
    try:
        assert (await call(http, handle, route)).status == 200  # the connection is now kept alive
        backends[0].script = [Fault("close_before_headers")]
        out = await call(http, handle, route)
        assert out.status == 200 and out.error is None
        ids = backends[0].ids()
        assert len(ids) == 3 and ids[1] == ids[2]  # the same request, again
        text = await metrics_text(http, handle)
        assert metric_value(text, "prefixroute_retries_total", endpoint="default", variant="AllTraffic",
                            reason="stale_connection") == 1
        assert handle.fleet.endpoint().variant().get(backends[0].url).healthy
        backends[0].script = [Fault("close_before_headers"), Fault("close_before_headers")]
        out = await call(http, handle, route)
        assert out.status == (502 if route.startswith("chat") else 424)
        assert len(backends[0].ids()) == 5  # once on the kept-alive connection, once on a new one
    finally:
        await handle.close()
    await assert_invariants(handle, backends, floor, frozenset(i for i in backends[0].ids() if i is not None))


async def _read_request(reader: asyncio.StreamReader) -> bytes:
    """One request from a scripted engine's connection (head and Content-Length body); its head."""
    head = await reader.readuntil(b"\r\n\r\n")
    length = int([line.split(b":")[1] for line in head.split(b"\r\n")
                  if line.lower().startswith(b"content-length")][0])
    await reader.readexactly(length)
    return head


async def _scripted_engine_router(engine, data_plane: str, **kw):
    """A raw asyncio server running ``engine`` and a router in front of it (no health
    checks); returns ``(server, handle)``."""
    server = await asyncio.start_server(engine, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    handle = await _router([f"http://127.0.0.1:{port}"], data_plane=data_plane, health_check_interval_s=0, **kw)
    return server, handle


@pytest.mark.parametrize("route", ("chat_stream", "chat"))
@pytest.mark.parametrize("garbage", [b"zz\r\nnot a chunk", b"5\r\ntoolongforfive\r\n", b"\r\n\r\n\r\n"])
async def test_malformed_chunked_framing_after_a_good_head_ends_the_answer_within_a_second(http, floor, data_plane,
                                                                                          route, garbage):
    """The instance sends a good head and a first chunk, then bytes that are not chunked
    framing, and keeps the connection open: the client gets an error or an aborted
    stream at once, not after the stream-idle timeout (30 s here); the slot is freed."""
    closed = asyncio.Event()

    async def engine(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        sse = b"text/event-stream" if route == "chat_stream" else b"application/json"
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: " + sse + b"\r\nTransfer-Encoding: chunked\r\n\r\n"
                     + b"e\r\ndata: {\"a\":1}\n\n\r\n" + garbage)
        await writer.drain()
        await reader.read()  # keep it open until the router closes it
        closed.set()
        writer.close()

    server, handle = await _scripted_engine_router(engine, data_plane, stream_idle_timeout_s=30)
    try:
        t0 = time.monotonic()
        out = await call(http, handle, route, timeout=5)
        took = time.monotonic() - t0
        assert took < 1.0, took
        if out.status == 200:
            assert out.error is not None or b"error" in out.body  # a cut body, or an SSE error event
        else:
            assert out.status == 502
        assert await eventually(closed.is_set, 1.0)  # the router closed the instance's connection
        assert await eventually(lambda: in_flight(handle) == 0, 1.0)
    finally:
        await handle.close()
        server.close()


@pytest.mark.parametrize("kind", ["reset_before_headers", "close_before_headers"])
async def test_a_kept_alive_connection_failing_long_after_the_send_is_not_sent_again(backends, http, floor,
                                                                                     data_plane, kind):
    """The engine read the request on a kept-alive connection and failed half a second
    later (while generating): not the keep-alive race, so never sent a second time."""
    handle = await _router([backends[0].url], data_plane=data_plane, max_retries=2, health_check_interval_s=0)
    try:
        assert (await call(http, handle, "chat")).status == 200
        backends[0].script = [Fault(kind, delay=0.5)]
        out = await call(http, handle, "chat")
        assert out.status == 502
        assert len(backends[0].ids()) == 2  # once each
    finally:
        await handle.close()
    await assert_invariants(handle, backends, floor)


@pytest.mark.parametrize("answer", [b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: h2c\r\nConnection: Upgrade\r\n\r\n",
                                    b"HTTP/1.1 2x0 Garbage\r\n\r\n"])
async def test_an_invalid_answer_on_a_kept_alive_connection_is_a_502_and_not_sent_again(http, floor, data_plane,
                                                                                        answer):
    """An unsolicited 101 or a malformed head on a reused connection is an invalid
    answer, not the keep-alive race: a 502, the engine asked once."""
    received = []

    async def engine(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                received.append(await _read_request(reader))
                if len(received) == 1:
                    writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}")
                else:
                    writer.write(answer)
                    await writer.drain()
                    await asyncio.sleep(0.2)
                    break
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        writer.close()

    server, handle = await _scripted_engine_router(engine, data_plane, max_retries=2)
    try:
        assert (await call(http, handle, "chat")).status == 200
        out = await call(http, handle, "chat")
        assert out.status == 502 and len(received) == 2
        assert await eventually(lambda: in_flight(handle) == 0, 1.0)
    finally:
        await handle.close()
        server.close()


async def test_nothing_is_sent_again_for_a_client_gone_before_a_429_arrives(backends, http, floor, data_plane):
    """The client leaves while the first instance prepares its 429; with --retry-status
    the request is not sent to the second instance on its behalf."""
    handle = await _router([b.url for b in backends], data_plane=data_plane, retry_statuses=frozenset({429}),
                           response_headers_timeout_s=10)
    try:
        for b in backends:
            b.default = Fault("status", status=429, headers={"Retry-After": "1"}, delay=0.4)
        task = asyncio.create_task(call(http, handle, "chat", timeout=5))
        assert await eventually(lambda: len(_served(backends)) == 1, 2)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await asyncio.sleep(0.6)  # the 429 has come and gone
        assert len(_served(backends)) == 1  # the other instance never got it
        assert await eventually(lambda: in_flight(handle) == 0, 1.0)
    finally:
        await handle.close()
    await assert_invariants(handle, backends, floor)


def test_odd_retry_after_values_never_raise():
    from prefixroute.core.retry_status import MAX_HOLD_S, RetryStatus, parse_retry_after

    for value in ("²", b"\xb2", "9" * 400, "9" * 5000, "Fri, 4 Dec 10000000000000000000 20:00:00 GMT", "", "  ",
                  "1e9", "-1", "Fri, 04 Dec 2026", "0x10", "٣"):
        got = parse_retry_after(value)
        assert got is None or got >= 0, value
    assert parse_retry_after("9" * 400) == 1e12
    rs = RetryStatus({429})
    assert rs.hold("a", "²") == 1.0 and rs.hold("b", "9" * 400) == MAX_HOLD_S


# -- health: out of rotation and back, assignments of the others stay --------------------


async def test_unhealthy_instance_leaves_and_returns_assignments_stay(http, floor):
    bs = [await FaultBackend().start() for _ in range(4)]
    handle = await _router([b.url for b in bs], RoutingConfig.build("prefix-aware", 1024, 64),
                           health_check_interval_s=0.05, unhealthy_threshold=2, healthy_threshold=2,
                           health_check_timeout_s=0.5)
    try:
        prompts = [f"{i:04d}" + "p" * 1100 for i in range(40)]

        async def where() -> dict[str, str]:
            out = {}
            for p in prompts:
                async with http.post(handle.url + "/invocations", data=p.encode()) as r:
                    assert r.status == 200
                    out[p] = r.headers["X-Prefixroute-Instance"]
                    await r.read()
            return out

        before = await where()
        victim = bs[0]
        await victim.kill()  # the instance dies
        pool = handle.fleet.endpoint().variant()
        assert await eventually(lambda: not pool.get(victim.url).healthy, 2)
        during = await where()
        assert victim.url not in during.values()
        for p, inst in before.items():  # keys of the healthy instances did not move
            if inst != victim.url:
                assert during[p] == inst
        await victim.listen()  # it recovers
        assert await eventually(lambda: pool.get(victim.url).healthy, 3)
        after = await where()
        assert after == before
    finally:
        await handle.close()
        for b in bs:
            await b.stop()
    await assert_invariants(handle, bs, floor)


async def test_health_probe_statuses(http):
    """Active checks: 2xx healthy; 429 and 503 with Retry-After are backpressure (no
    change); another status, a refused connection or a timeout count as failures."""
    from aiohttp import web

    from prefixroute.server.health import ProbeResult, probe_instance

    answers = {"/ok": (204, {}), "/busy": (429, {}), "/shed": (503, {"Retry-After": "3"}), "/down": (503, {}),
               "/missing": (404, {})}

    async def handler(request):
        status, headers = answers[request.path]
        return web.Response(status=status, headers=headers)

    app = web.Application()
    for p in answers:
        app.router.add_get(p, handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    try:
        got = {p: await probe_instance(http, url, p, 1.0) for p in answers}
    finally:
        await runner.cleanup()
    assert got == {"/ok": ProbeResult.OK, "/busy": ProbeResult.BUSY, "/shed": ProbeResult.BUSY,
                   "/down": ProbeResult.FAILED, "/missing": ProbeResult.FAILED}
    assert await probe_instance(http, url, "/ok", 0.5) is ProbeResult.FAILED  # nothing listens now


@pytest.mark.parametrize("close_after", ["[DONE]", "first event"])
async def test_a_client_that_leaves_after_done_got_the_whole_answer(backends, http, floor, data_plane, close_after):
    # The openai client closes its connection once it reads `data: [DONE]`, before the
    # engine ends its chunked body: that request was answered in full (its status), not
    # abandoned (499). One that leaves before [DONE] is a 499.
    import urllib.parse

    handle = await _router([b.url for b in backends], data_plane=data_plane)
    try:
        _all(backends, Fault("ok", events=3, delay=0.05, end_delay=1.0))
        u = urllib.parse.urlsplit(handle.url)
        reader, writer = await asyncio.open_connection(u.hostname, u.port)
        body = b'{"model": "m", "stream": true, "messages": [{"role": "user", "content": "hi"}]}'
        writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: r\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        seen = b""
        want = b"data: [DONE]" if close_after == "[DONE]" else b"data: {"
        async with asyncio.timeout(5):
            while want not in seen:
                seen += await reader.read(65536)
        writer.close()
        code = "200" if close_after == "[DONE]" else "499"
        other = "499" if close_after == "[DONE]" else "200"

        async def counted() -> bool:
            text = await metrics_text(http, handle)
            return metric_value(text, "prefixroute_responses_total", endpoint="default", variant="AllTraffic",
                                code=code) == 1

        async with asyncio.timeout(5):
            while not await counted():
                await asyncio.sleep(0.05)
        text = await metrics_text(http, handle)
        assert metric_value(text, "prefixroute_responses_total", endpoint="default", variant="AllTraffic",
                            code=other) is None
        assert await eventually(lambda: in_flight(handle) == 0, 2.0)
    finally:
        await handle.close()
    await assert_invariants(handle, backends, floor)


@pytest.mark.parametrize("tail, done", [
    (b'"finish_reason":"stop"}]}\n\ndata: [DONE]\n\n', True),
    (b'}]}\r\n\r\ndata: [DONE]\r\n\r\n', True),
    (b'"stop"}]}\n\ndata:[DONE]\n\n', True),
    (b'{"delta":{"content":"say [DONE]"}}\n\n', False),  # a token's text is not the event
    (b'"content":"data: [DONE]"}}]}\n\n', False),
    (b'data: [DONE]\n\ndata: {"x":1}\n\n', False),  # not the last event
    (b'data: [DONE]\n\n', True),  # the whole stream (shorter than the window kept)
    (b'xxxxxxxxxxxxxxxxxx data: [DONE]\n\n', False),
    (b'data: [DONE]' + b'\n' * 20, False),  # the window starts at it: not known to start a line
])
def test_the_end_of_a_stream_is_its_done_event_only(tail, done):
    from prefixroute.server.proxy import ends_with_done

    assert ends_with_done(tail) is done
