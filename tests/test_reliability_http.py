"""HTTP hygiene, limits, bad input, error shapes, request ids, secrets and prompt privacy."""

from __future__ import annotations

import logging

import aiohttp
import orjson
import pytest

from prefixroute.core.config import FleetConfig, RoutingConfig
from prefixroute.server import ServerSettings, start_router

from fault_backend import Fault, FaultBackend, sse_events
from reliability_helpers import assert_invariants, install_floor, metrics_text
from test_server_helpers import metric_value

PA = RoutingConfig.build("prefix-aware", 1024, 64)
LIMIT = 64 * 1024


@pytest.fixture
def floor(monkeypatch):
    return install_floor(monkeypatch)


@pytest.fixture
async def backends():
    bs = [await FaultBackend().start() for _ in range(3)]
    yield bs
    for b in bs:
        await b.stop()


async def _router(urls, **kw):
    base = dict(port=0, admin_port=0, health_check_interval_s=0, metrics_scrape_interval_s=0,
                shutdown_timeout_s=1.0, seed=5, max_body_bytes=LIMIT)
    base.update(kw)
    return await start_router(FleetConfig.single(urls, PA), ServerSettings(**base))


@pytest.fixture
async def router(backends, data_plane):
    handle = await _router([b.url for b in backends], data_plane=data_plane)
    yield handle
    await handle.close()


@pytest.fixture
async def http():
    async with aiohttp.ClientSession() as s:
        yield s


def _by_url(backends, url):
    return next(b for b in backends if b.url == url)


# -- hop-by-hop headers, Host, framing ------------------------------------------------------


async def test_hop_by_hop_headers_dropped_both_ways(router, backends, http):
    for b in backends:
        b.response_headers = {"Connection": "keep-alive, X-Hop-Resp", "X-Hop-Resp": "1", "Keep-Alive": "timeout=5",
                              "Proxy-Authenticate": "Basic", "Trailer": "X-T", "X-End-To-End": "kept"}
    body = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "x" * 1200}]})
    async with http.post(router.url + "/v1/chat/completions", data=body,
                         headers={"Connection": "keep-alive, X-Hop-Req", "X-Hop-Req": "1", "Keep-Alive": "300",
                                  "TE": "trailers", "Proxy-Authorization": "Basic cA==", "Proxy-Connection": "x",
                                  "Upgrade": "websocket", "X-Kept": "yes"}) as r:
        assert r.status == 200
        await r.read()
        got = r.headers
        inst = _by_url(backends, r.headers["X-Prefixroute-Instance"])
    for name in ("X-Hop-Resp", "Keep-Alive", "Proxy-Authenticate", "Trailer"):
        assert name not in got, name
    assert got["X-End-To-End"] == "kept"
    sent = inst.received[-1].headers
    for name in ("X-Hop-Req", "Keep-Alive", "TE", "Proxy-Authorization", "Proxy-Connection", "Upgrade",
                 "Transfer-Encoding"):
        assert name not in sent, name
    assert sent["X-Kept"] == "yes"
    assert sent["Host"] == inst.url.removeprefix("http://")  # the instance's own Host
    assert "keep-alive" not in sent.get("Connection", "").lower() or "x-hop-req" not in sent.get("Connection", "")


async def test_chunked_request_body_same_bytes_same_key(router, backends, http):
    bodies = [orjson.dumps({"model": "m", "messages": [{"role": "user", "content": f"doc {i} " + "z" * 1500}]})
              for i in range(12)]

    async def chunked(data: bytes):
        for i in range(0, len(data), 100):
            yield data[i:i + 100]

    for body in bodies:
        async with http.post(router.url + "/v1/chat/completions", data=body) as r:
            where_cl = r.headers["X-Prefixroute-Instance"]
            await r.read()
        async with http.post(router.url + "/v1/chat/completions", data=chunked(body)) as r:
            assert r.status == 200
            where_chunked = r.headers["X-Prefixroute-Instance"]
            await r.read()
        assert where_chunked == where_cl  # hashed exactly like the Content-Length body
        rec = _by_url(backends, where_chunked).received[-1]
        assert rec.body == body and not rec.chunked  # forwarded with a Content-Length
        assert rec.headers["Content-Length"] == str(len(body))


@pytest.mark.parametrize("stream", [False, True])
async def test_response_framing_is_consistent(router, backends, http, stream):
    body = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "q" * 1200}], "stream": stream})
    async with http.post(router.url + "/v1/chat/completions", data=body,
                         headers={"Accept-Encoding": "gzip, deflate"}) as r:
        raw = [(k.decode().lower(), v.decode()) for k, v in r.raw_headers]
        data = await r.read()
    names = [k for k, _ in raw]
    assert not ("content-length" in names and "transfer-encoding" in names)
    assert "content-encoding" not in names  # never compressed by the router
    if stream:
        assert dict(raw)["transfer-encoding"] == "chunked" and data == sse_events(6)
        assert dict(raw)["content-type"] == "text/event-stream"
        assert dict(raw)["x-accel-buffering"] == "no"  # nor buffered by a proxy in front
    else:
        assert dict(raw)["content-length"] == str(len(data))


# -- limits and bad input ------------------------------------------------------------------


@pytest.mark.parametrize("path,shape", [("/v1/chat/completions", "openai"), ("/invocations", "sagemaker"),
                                        ("/endpoints/default/invocations-response-stream", "sagemaker"),
                                        ("/endpoints/default/openai/v1/completions", "openai")])
@pytest.mark.parametrize("framing", ["content-length", "chunked"])
async def test_body_over_the_limit_is_413(router, backends, http, floor, path, shape, framing):
    big = b'{"model": "m", "prompt": "' + b"x" * (LIMIT + 10) + b'"}'

    async def chunked():
        for i in range(0, len(big), 8192):
            yield big[i:i + 8192]

    async with http.post(router.url + path, data=big if framing == "content-length" else chunked(),
                         headers={"X-Request-Id": "too-big"}) as r:
        assert r.status == 413
        doc = await r.json()
        assert r.headers["X-Request-Id"] == "too-big"
    message = doc["error"]["message"] if shape == "openai" else doc["message"]
    assert "too large" in message and f"{LIMIT:,} bytes" in message
    if shape == "sagemaker":
        assert r.headers["x-amzn-ErrorType"] == "ValidationError"
    else:
        assert doc["error"]["code"] == "request_too_large"
    assert not any(b.received for b in backends)  # nothing sent upstream
    assert floor["releases"] == 0  # nothing counted in flight


@pytest.mark.parametrize("raw,needle", [
    (b"{not json", "not valid JSON"),
    (b"\xff\xfe{}", "not valid JSON: it is not UTF-8 text"),
    (b'{"model": "m", "messages": [{"role": "user", "content": "\xff\xfe"}]}', "not valid JSON: it is not UTF-8 text"),
    (b"[1, 2]", "must be a JSON object, got an array"),
    (b'"text"', "must be a JSON object, got a string"),
    (b"null", "must be a JSON object, got null"),
    (b"12.5", "must be a JSON object, got a number"),
    (b"true", "must be a JSON object, got a boolean"),
    (b'{"model": 5, "messages": []}', "'model' must be a string"),
    (b'{"model": "m", "messages": "hi"}', "'messages'"),
    (b'{"model": "m", "messages": [5]}', "message"),
    (b'{"model": "m", "messages": [{"role": 1, "content": "x"}]}', "'role'"),
    (b'{"model": "m", "messages": [{"role": "user", "content": 5}]}', "'content'"),
    (b'{"model": "m", "messages": [], "stream": "yes"}', "'stream' must be a boolean"),
    (b'{"model": "m", "messages": [], "prompt_cache_key": 7}', "'prompt_cache_key' must be a string"),
    (b'{"model": "m", "messages": [], "cache_salt": 3}', "'cache_salt' must be a non-empty string"),
])
async def test_bad_openai_input_is_400_naming_the_problem(router, backends, http, floor, raw, needle):
    async with http.post(router.url + "/v1/chat/completions", data=raw) as r:
        assert r.status == 400
        err = (await r.json())["error"]
    assert needle in err["message"] and err["type"] == "invalid_request_error"
    assert "prefix-aware id" not in err["message"]
    assert not any(b.received for b in backends) and floor["releases"] == 0


async def test_bad_completions_prompt_is_400(router, backends, http):
    for raw in (b'{"model": "m", "prompt": 3}', b'{"model": "m", "prompt": [1, "a"]}', b'{"model": "m"}'):
        async with http.post(router.url + "/v1/completions", data=raw) as r:
            assert r.status == 400
            assert "'prompt'" in (await r.json())["error"]["message"]
    assert not any(b.received for b in backends)


async def test_invalid_utf8_native_body_forwarded_and_hashed_as_bytes(router, backends, http, floor):
    head = b"\xff\xfe\x80 not utf-8 \xc3(" + b"\x00" * 1100
    where = set()
    for tail in (b"a", b"\xff" * 50, b"tail"):
        body = head + tail
        async with http.post(router.url + "/invocations", data=body,
                             headers={"Content-Type": "application/octet-stream"}) as r:
            assert r.status == 200
            where.add(r.headers["X-Prefixroute-Instance"])
            await r.read()
        assert _by_url(backends, r.headers["X-Prefixroute-Instance"]).received[-1].body == body
    assert len(where) == 1
    await assert_invariants(router, backends, floor)


@pytest.mark.parametrize("method,path,status,shape", [
    ("PUT", "/health", 405, "json"),
    ("POST", "/endpoints/default/nope", 404, "sagemaker"),
    ("GET", "/invocations", 405, "sagemaker"),
    ("GET", "/nope", 404, "json"),
    ("POST", "/v1/chat%2Fcompletions", 404, "openai"),
])
async def test_unknown_paths_use_the_api_error_shape(router, http, method, path, status, shape):
    """... and are counted, in responses_total and in the duration histogram (a 405 was
    counted in neither, a 404 not in the histogram)."""
    async with http.request(method, router.url + path) as r:
        assert r.status == status
        assert r.headers["Content-Type"].startswith("application/json")
        doc = await r.json()
    if shape == "openai":
        assert doc["error"]["code"] in ("not_found", "method_not_allowed") and path in doc["error"]["message"] \
            or "not allowed" in doc["error"]["message"]
    elif shape == "sagemaker":
        assert r.headers["x-amzn-ErrorType"] == "ValidationError" and doc["message"]
    else:
        assert ("no route" if status == 404 else "is not allowed") in doc["message"]
    text = await metrics_text(http, router)
    assert metric_value(text, "prefixroute_responses_total", endpoint="unknown", variant="", code=str(status)) == 1
    assert metric_value(text, "prefixroute_request_duration_seconds_count", endpoint="unknown", variant="") == 1


# -- request ids, secrets, prompts ----------------------------------------------------------


async def test_request_id_propagated_or_generated(router, backends, http):
    body = orjson.dumps({"model": "m", "prompt": "p" * 1100})
    for given, kept in (("abc-123", True), ("x" * 201, False), ("has space", False), (None, False)):
        headers = {"X-Request-Id": given} if given is not None else {}
        async with http.post(router.url + "/v1/completions", data=body, headers=headers) as r:
            rid = r.headers["X-Request-Id"]
            inst = _by_url(backends, r.headers["X-Prefixroute-Instance"])
            await r.read()
        assert (rid == given) is kept
        if not kept:
            assert len(rid) == 32
        assert inst.received[-1].request_id == rid


async def test_admin_token_never_forwarded_or_shown(backends, http):
    handle = await _router([b.url for b in backends], admin_port=None, admin_token="s3cret-token")
    try:
        assert "s3cret" not in repr(handle.state.settings)
        body = orjson.dumps({"model": "m", "prompt": "p" * 1100})
        for auth in ("Bearer s3cret-token", "s3cret-token"):
            async with http.post(handle.url + "/v1/completions", data=body,
                                 headers={"Authorization": auth, "X-Api-Key": "s3cret-token"}) as r:
                assert r.status == 200
                inst = _by_url(backends, r.headers["X-Prefixroute-Instance"])
            sent = inst.received[-1].headers
            assert "Authorization" not in sent and "X-Api-Key" not in sent
        async with http.post(handle.url + "/v1/completions", data=body,
                             headers={"Authorization": "Bearer engine-key"}) as r:
            inst = _by_url(backends, r.headers["X-Prefixroute-Instance"])
        assert inst.received[-1].headers["Authorization"] == "Bearer engine-key"  # the engine's own key passes
        async with http.get(handle.admin_url + "/admin/config", headers={"Authorization": "Bearer s3cret-token"}) as r:
            assert "s3cret" not in await r.text()
        assert "s3cret" not in await metrics_text(http, handle)
    finally:
        await handle.close()


@pytest.mark.parametrize("log_prompts", [False, True])
async def test_prompts_reach_logs_only_when_enabled(backends, http, caplog, log_prompts):
    secret = "SECRET-PROMPT-TEXT"
    handle = await _router([b.url for b in backends], log_prompts=log_prompts)
    caplog.set_level(logging.DEBUG)
    try:
        for b in backends:
            b.default = Fault("status", status=500)  # error paths log too
        chat = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": secret + "x" * 1100}]})
        async with http.post(handle.url + "/v1/chat/completions", data=chat) as r:
            await r.read()
        async with http.post(handle.url + "/invocations", data=(secret + "y" * 1100).encode()) as r:
            await r.read()
        async with http.post(handle.url + "/v1/chat/completions", data=b'{"model": "' + secret.encode() + b'"') as r:
            assert r.status == 400
            assert secret not in (await r.json())["error"]["message"]
        text = await metrics_text(http, handle)
    finally:
        await handle.close()
    assert secret not in text
    logged = [rec.getMessage() for rec in caplog.records if rec.name.startswith("prefixroute")]
    hits = [m for m in logged if secret in m]
    if log_prompts:
        assert len(hits) == 2  # the OpenAI request and the native one
    else:
        assert hits == []


async def _raw_exchange(url: str, data: bytes) -> bytes:
    """Send ``data`` on a new connection to ``url`` and read until the router closes it."""
    import asyncio
    from urllib.parse import urlsplit

    u = urlsplit(url)
    reader, writer = await asyncio.open_connection(u.hostname, u.port)
    writer.write(data)
    await writer.drain()
    try:
        return await asyncio.wait_for(reader.read(), 10)
    finally:
        writer.close()


async def test_malformed_http_never_puts_what_the_client_sent_in_the_logs(router, http, caplog):
    # aiohttp logs a request it cannot parse with a traceback quoting the bytes it read;
    # the router logs one line instead, whichever data plane the request came in by (the
    # fast one hands GET routes to the aiohttp app too).
    secret, token = "SECRET-PROMPT-TEXT", "sk-SECRET-TOKEN"
    caplog.set_level(logging.DEBUG)
    body = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": secret * 40}]})

    def head(path: str, length: int | None, extra: str = "", close: bool = True) -> bytes:
        lines = f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        if length is not None:
            lines += f"Content-Length: {length}\r\n"
        return (lines + extra + ("Connection: close\r\n" if close else "") + "\r\n").encode()

    chat = "/v1/chat/completions"
    sent = [
        head(chat, len(body) - 300) + body,  # the rest of the body read as the next request
        head(chat, 60, close=False) + body,
        head(chat, len(body), f"Authorization: Bearer {token}\x01\r\n") + body,
        head(chat, len(body), f"Authorization: Bearer {token}{'a' * 9000}\r\n") + body,
        f"GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {token}{'a' * 9000}\r\n\r\n".encode(),
    ]
    answers = [await _raw_exchange(router.url, data) for data in sent]
    assert all(a.startswith(b"HTTP/1.1 200 ") or b" 4" in a.split(b"\r\n", 1)[0] for a in answers), answers
    assert any(b" 4" in a.split(b"\r\n", 1)[0] for a in answers)
    async with http.post(router.url + chat, data=body) as r:  # and it goes on serving
        assert r.status == 200
    texts = []
    for rec in caplog.records:
        texts.append(rec.getMessage())
        if rec.exc_info:
            texts.append(logging.Formatter().formatException(rec.exc_info))
    assert not [t for t in texts if secret in t or token in t]
    assert not [rec for rec in caplog.records if rec.name.startswith("aiohttp") and rec.levelno >= logging.ERROR]


def test_the_server_log_keeps_other_records_whole(caplog):
    from aiohttp.http_exceptions import LineTooLong

    from prefixroute.server.runner import SERVER_LOG

    caplog.set_level(logging.DEBUG, logger="aiohttp.server")
    SERVER_LOG.exception("Error handling request from %s", "127.0.0.1",
                         exc_info=LineTooLong("b'Bearer sk-SECRET'", "8190"))
    try:
        raise RuntimeError("our own bug")
    except RuntimeError:
        SERVER_LOG.exception("Unhandled exception")
    refused, bug = caplog.records[-2:]
    assert refused.levelno == logging.INFO and refused.exc_info is None
    assert refused.getMessage() == ("Error handling request from 127.0.0.1: malformed HTTP request refused "
                                    "(400 LineTooLong; its text is not logged)")
    assert bug.levelno == logging.ERROR and bug.exc_info[0] is RuntimeError


# -- the keep-alive race: a pooled connection the instance closed is found dead ----------


async def test_pooled_connection_closed_by_the_peer_is_found_dead():
    import asyncio

    from prefixroute.server.client_session import peer_closed

    peers: list[asyncio.StreamWriter] = []

    async def serve(reader, writer):
        peers.append(writer)
        await reader.read()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    loop = asyncio.get_running_loop()
    try:
        transport, _ = await loop.create_connection(asyncio.Protocol, "127.0.0.1", port)
        transport.pause_reading()  # as if the event loop had not looked at the socket yet
        while not peers:
            await asyncio.sleep(0.01)
        assert not peer_closed(transport)  # open and idle: reusable
        peers[0].write(b"HTTP/1.1 408 Request Timeout\r\n\r\n")  # unsolicited bytes: not reusable
        await peers[0].drain()
        await asyncio.sleep(0.05)
        assert peer_closed(transport)
        transport.abort()

        peers.clear()
        transport, _ = await loop.create_connection(asyncio.Protocol, "127.0.0.1", port)
        transport.pause_reading()
        while not peers:
            await asyncio.sleep(0.01)
        peers[0].close()  # the instance's keep-alive timer fired: FIN
        await asyncio.sleep(0.05)
        assert not transport.is_closing()  # aiohttp's own check would still reuse it...
        assert peer_closed(transport)  # ...the peek sees the close
        transport.abort()
    finally:
        server.close()


async def test_a_request_that_stops_arriving_part_way_is_answered_408_and_closed(backends, data_plane, http):
    # A client that sends a request's head and part of its body, then nothing (a
    # Content-Length body cut short, a chunked one stopped inside a chunk, a request with
    # Upgrade, a native one): after --client-keepalive-timeout without a byte of it, the
    # router answers 408 in the API's shape, counts it, and closes the connection (the
    # aiohttp data plane used to wait for ever; it closes after aiohttp's lingering time,
    # 2 s, in which it still reads what the client sends; the fast one closed without an
    # answer). The same on the admin API. Nothing reaches an engine, a slow client that
    # keeps sending is not cut, and the router goes on serving.
    import asyncio
    import time
    from urllib.parse import urlsplit

    handle = await _router([b.url for b in backends], data_plane=data_plane, client_keepalive_timeout_s=1.0,
                           admin_port=None)  # (admin API on port + 1 or a free one)
    u = urlsplit(handle.url)

    async def stall(data: bytes, url: str = handle.url, wait_close: bool = False,
                    timed_out: bool = True) -> tuple[bytes, bytes]:
        """Send ``data``, then nothing: the answer's head and body (and the close), which
        comes after the 1 s timeout if ``timed_out``."""
        where = urlsplit(url)
        reader, writer = await asyncio.open_connection(where.hostname, where.port)
        t0 = time.monotonic()
        writer.write(data)
        answer_head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        waited = time.monotonic() - t0
        length = int(answer_head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
        body = await reader.readexactly(length)
        assert 0.9 <= waited < 5.0 if timed_out else waited < 0.9, waited
        if wait_close:
            assert await asyncio.wait_for(reader.read(), 15) == b""
        writer.close()
        return answer_head, body

    try:
        part = b'{"model": "m", "messages": [{"role": "user", "content": "' + b"x" * 700
        head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        stalled = [head + b"Content-Length: 4000\r\n\r\n" + part,
                   head + b"Transfer-Encoding: chunked\r\n\r\n" + b"%x\r\n" % 2000 + part,
                   head + b"Connection: Upgrade\r\nUpgrade: websocket\r\nContent-Length: 4000\r\n\r\n" + part]
        for n, data in enumerate(stalled):
            answer_head, body = await stall(data, wait_close=n == 0)
            assert answer_head.startswith(b"HTTP/1.1 408 "), answer_head
            error = orjson.loads(body)["error"]
            assert error["code"] == "request_timeout", error
            assert error["message"] == "the request stopped arriving: nothing for 1 s (--client-keepalive-timeout)"
            assert b"x-request-id: " in answer_head.lower()
        answer_head, body = await stall(b"POST /invocations HTTP/1.1\r\nHost: x\r\nContent-Length: 900\r\n\r\n{")
        assert answer_head.startswith(b"HTTP/1.1 408 ") and b"x-amzn-errortype: validationerror" in answer_head.lower()
        assert b"nothing for 1 s" in body
        assert metric_value(await metrics_text(http, handle), "prefixroute_responses_total", code="408") == 4
        # A POST to a path that is not an inference route: the fast plane reads a body
        # before it hands such a request to the aiohttp app, so it answers 408 (in the
        # plain shape of other paths); aiohttp answers 404 without reading the body.
        answer_head, body = await stall(b"POST /nope HTTP/1.1\r\nHost: x\r\nContent-Length: 900\r\n\r\n{",
                                        timed_out=data_plane == "fast")
        if data_plane == "fast":
            assert answer_head.startswith(b"HTTP/1.1 408 ") and orjson.loads(body)["message"].endswith(
                "nothing for 1 s (--client-keepalive-timeout)"), body
        else:
            assert answer_head.startswith(b"HTTP/1.1 404 "), answer_head
        # A request head cut short: the fast data plane answers 408 too, aiohttp closes.
        reader, writer = await asyncio.open_connection(u.hostname, u.port)
        writer.write(head[:-10])
        answer = await asyncio.wait_for(reader.read(), 5)
        writer.close()
        if data_plane == "fast":
            assert answer.startswith(b"HTTP/1.1 408 ") and b"nothing for 1 s" in answer, answer
        else:
            assert answer == b""
        # The admin API: a configuration change whose body stops arriving.
        answer_head, body = await stall(b"PUT /admin/endpoints/default/variants/AllTraffic/routing HTTP/1.1\r\n"
                                        b"Host: x\r\nContent-Length: 100\r\n\r\n{\"Rout", url=handle.admin_url)
        assert answer_head.startswith(b"HTTP/1.1 408 ") and b"nothing for 1 s" in body
        # A slow client that keeps sending is not cut: a fifth of the body every 0.4 s.
        reader, writer = await asyncio.open_connection(u.hostname, u.port)
        body = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "slow " * 3}]})
        writer.write(head + b"Content-Length: %d\r\n\r\n" % len(body))
        step = len(body) // 5 + 1
        for i in range(0, len(body), step):
            await asyncio.sleep(0.4)
            writer.write(body[i: i + step])
        answer = await asyncio.wait_for(reader.readuntil(b"\r\n"), 5)
        writer.close()
        assert answer.startswith(b"HTTP/1.1 200 "), answer
        assert sum(len(b.received) for b in backends) == 1  # only the slow client's request
        async with http.post(handle.url + "/v1/chat/completions", data=body) as r:
            assert r.status == 200
    finally:
        await handle.close()
