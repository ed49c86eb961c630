"""The fast data plane (server/dataplane.py) at the HTTP level: what only it does, on
raw sockets — pooled upstream connections, pipelining, ``Expect: 100-continue``,
limits, chunked request bodies, delegation to the aiohttp app, idle clients. The
behaviour it shares with the aiohttp data plane is tested with both
(tests/test_reliability_*.py, tests/test_server_routes.py use the ``data_plane``
fixture)."""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import logging
import time

import aiohttp
import orjson
import pytest

from prefixroute.core.config import FleetConfig, RoutingConfig
from prefixroute.server import ServerSettings, start_router
from prefixroute.server.app import DECODED_CODINGS
from prefixroute.core.openai_routes import OpenAIRoute
from prefixroute.server.client import MAX_HEAD_BYTES, MAX_HEADERS
from prefixroute.server.dataplane import FrontServer, match_route
from prefixroute.server.proxy import Api

from fault_backend import FaultBackend

LIMIT = 64 * 1024
CHAT = orjson.dumps({"model": "m", "messages": [{"role": "system", "content": "S" * 3000},
                                                {"role": "user", "content": "hi"}]})


@pytest.fixture
async def backend():
    b = await FaultBackend().start()
    yield b
    await b.stop()


@pytest.fixture
async def router(backend):
    handle = await start_router(
        FleetConfig.single([backend.url], RoutingConfig.build("prefix-aware", 1024, 64)),
        ServerSettings(port=0, admin_port=0, health_check_interval_s=0, metrics_scrape_interval_s=0,
                       shutdown_timeout_s=1.0, seed=1, max_body_bytes=LIMIT))
    yield handle
    await handle.close()


async def _connect(router):
    return await asyncio.open_connection("127.0.0.1", router.port)


async def _read_response(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes]:
    """One HTTP/1.1 response (Content-Length or chunked body)."""
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split(" ", 2)[1])
    headers = {}
    for line in lines[1:]:
        if line:
            k, _, v = line.partition(":")
            headers[k.strip().lower()] = v.strip()
    if "content-length" in headers:
        body = await reader.readexactly(int(headers["content-length"]))
    elif headers.get("transfer-encoding") == "chunked":
        body = b""
        while True:
            size = int((await reader.readuntil(b"\r\n")).strip(), 16)
            data = await reader.readexactly(size + 2)
            if size == 0:
                break
            body += data[:-2]
    else:
        body = await reader.read()
    return status, headers, body


async def _plane_router(backend, data_plane: str, **settings):
    """A PREFIX_AWARE router over ``backend`` on ``data_plane``, no background loops."""
    return await start_router(
        FleetConfig.single([backend.url], RoutingConfig.build("prefix-aware", 1024, 64)),
        ServerSettings(port=0, health_check_interval_s=0, metrics_scrape_interval_s=0, shutdown_timeout_s=1.0,
                       seed=1, data_plane=data_plane, **settings))


def _post(path: str, body: bytes, extra: str = "") -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: r\r\nContent-Type: application/json\r\n{extra}"
            f"Content-Length: {len(body)}\r\n\r\n").encode() + body


@pytest.mark.parametrize("path,expected", [
    ("/v1/chat/completions", (Api.OPENAI, OpenAIRoute.CHAT, None, None)),
    ("/v1/completions", (Api.OPENAI, OpenAIRoute.COMPLETIONS, None, None)),
    ("/v1/embeddings", (Api.OPENAI, OpenAIRoute.EMBEDDINGS, None, None)),
    ("/v1/audio/transcriptions", (Api.OPENAI, OpenAIRoute.OTHER, None, None)),
    ("/tokenize", (Api.OPENAI, OpenAIRoute.TOKENIZE, None, None)),
    ("/invocations", (Api.NATIVE, None, None, None)),
    ("/endpoints/e1/invocations", (Api.NATIVE, None, "e1", None)),
    ("/endpoints/e1/invocations-response-stream", (Api.NATIVE_STREAM, None, "e1", None)),
    ("/endpoints/e1/inference-components/c/invocations", (Api.NATIVE, None, "e1", "c")),
    ("/endpoints/e1/openai/v1/chat/completions", (Api.OPENAI, OpenAIRoute.CHAT, "e1", None)),
    ("/endpoints/e1/openai/v1/completions", (Api.OPENAI, OpenAIRoute.COMPLETIONS, "e1", None)),
    ("/endpoints/e1/openai/detokenize", (Api.OPENAI, OpenAIRoute.DETOKENIZE, "e1", None)),
    ("/endpoints/e1/inference-components/c/openai/v1/chat/completions", (Api.OPENAI, OpenAIRoute.CHAT, "e1", "c")),
    ("/endpoints/e1/inference-components/c/openai/v1/rerank", (Api.OPENAI, OpenAIRoute.RERANK, "e1", "c")),
    ("/endpoints//invocations", None),
    ("/endpoints/e%31/invocations", None),  # percent-encoded: aiohttp decodes it
    ("/v1/chat%2Fcompletions", None),
    ("/v1/chat/completions/", None),
    ("/metrics", None),
    ("/endpoints/e1/openai/metrics", None),
    ("/endpoints/e1/inference-components//openai/v1/completions", None),
])
def test_match_route(path, expected):
    found = match_route(path)
    assert (found if found is None else found[:4]) == expected


async def test_upstream_connection_is_kept_alive(router, backend):
    before = backend.accepted  # (the router's own GET /v1/models at start had its connection)
    async with aiohttp.ClientSession() as http:
        for _ in range(20):
            async with http.post(router.url + "/v1/chat/completions", data=CHAT) as r:
                assert r.status == 200
                await r.read()
    assert len(backend.received) == 20
    assert backend.accepted - before == 1


async def test_pipelined_requests_are_answered_in_order(router, backend):
    reader, writer = await _connect(router)
    writer.write(_post("/v1/chat/completions", CHAT, "X-Request-Id: first\r\n")
                 + _post("/v1/chat/completions", b"{not json", "X-Request-Id: second\r\n")
                 + _post("/v1/chat/completions", CHAT, "X-Request-Id: third\r\n"))
    answers = [await _read_response(reader) for _ in range(3)]
    writer.close()
    assert [(s, h["x-request-id"]) for s, h, _ in answers] == [(200, "first"), (400, "second"), (200, "third")]
    assert orjson.loads(answers[1][2])["error"]["type"] == "invalid_request_error"
    assert backend.ids() == ["first", "third"]


async def test_expect_100_continue(router, backend):
    reader, writer = await _connect(router)
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: r\r\nExpect: 100-continue\r\n"
            f"Content-Length: {len(CHAT)}\r\n\r\n").encode()
    writer.write(head)
    interim = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    assert interim == b"HTTP/1.1 100 Continue\r\n\r\n"
    writer.write(CHAT)
    status, _, _ = await _read_response(reader)
    writer.close()
    assert status == 200
    assert backend.received[0].body == CHAT
    assert "expect" not in {k.lower() for k in backend.received[0].headers}


async def test_expect_100_continue_gets_the_final_answer_when_the_head_is_refused(backend, data_plane):
    """A request its head alone refuses gets that answer instead of 100 Continue (RFC
    9110 §10.1.1), so the client need not send its body; the connection closes after
    it (the fast plane at once; aiohttp's after its 2 s linger, unless the client
    closes); the refusal is counted once. A request that passes still gets 100 Continue."""
    handle = await _plane_router(backend, data_plane, max_body_bytes=LIMIT)
    n = len(CHAT)
    cases = [(b"/endpoints/nope/invocations", b"", n, 404),
             (b"/v1/chat/completions", b"Content-Encoding: br\r\n", n, 415),
             (b"/v1/chat/completions", b"X-Amzn-SageMaker-Target-Variant: nope\r\n", n, 400),
             (b"/invocations", b"X-Amzn-SageMaker-Prefix-Aware-Id: " + b"t" * 65 + b"\r\n", n, 400),
             (b"/v1/chat/completions", b"", LIMIT + 1, 413)]
    try:
        for path, extra, length, status in cases:
            reader, writer = await _connect(handle)
            writer.write(b"POST %s HTTP/1.1\r\nHost: r\r\nExpect: 100-continue\r\n%sContent-Length: %d\r\n\r\n"
                         % (path, extra, length))  # and no body
            got, headers, body = await asyncio.wait_for(_read_response(reader), 5)
            assert (got, headers["connection"]) == (status, "close"), (path, extra, body)
            # closed, the body never sent: at once on the fast plane, after the 2 s linger on
            # aiohttp's (LINGER_S on both; aiohttp's default was 10 s)
            assert await asyncio.wait_for(reader.read(), 5) == b""
            writer.close()
        reader, writer = await _connect(handle)
        writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: r\r\nExpect: 100-continue\r\n"
                     b"Content-Length: %d\r\n\r\n" % len(CHAT))
        assert await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5) == b"HTTP/1.1 100 Continue\r\n\r\n"
        writer.write(CHAT)
        assert (await _read_response(reader))[0] == 200
        writer.close()
        assert [rec.body for rec in backend.received] == [CHAT]
        async with aiohttp.ClientSession() as http:
            async with http.get(handle.url + "/metrics") as r:
                text = await r.text()
        refused = {code: sum(v for k, v in _samples(text, "prefixroute_responses_total") if f'code="{code}"' in k)
                   for code in ("400", "404", "413", "415")}
        assert refused == {"400": 2, "404": 1, "413": 1, "415": 1}  # each counted once
    finally:
        await handle.close()


def _samples(text: str, name: str) -> list[tuple[str, float]]:
    """``(labels, value)`` of every sample of ``name`` in a /metrics page."""
    out = []
    for line in text.splitlines():
        if line.startswith(name + "{"):
            labels, value = line[len(name):].rsplit(" ", 1)
            out.append((labels, float(value)))
    return out


async def test_head_too_large_is_431_and_closed(router, backend):
    reader, writer = await _connect(router)
    writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: r\r\nX-Big: " + b"a" * (MAX_HEAD_BYTES + 10)
                 + b"\r\nContent-Length: 2\r\n\r\n{}")
    status, headers, body = await _read_response(reader)
    assert status == 431
    assert headers["connection"] == "close"
    assert await asyncio.wait_for(reader.read(), 5) == b""  # closed by the router
    writer.close()
    assert backend.received == []


async def test_declared_body_over_limit_is_413_without_reading_it(router, backend):
    reader, writer = await _connect(router)
    writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: r\r\nContent-Length: %d\r\n\r\n" % (LIMIT + 1))
    status, headers, body = await _read_response(reader)
    writer.close()
    assert status == 413
    assert headers["connection"] == "close"
    err = orjson.loads(body)["error"]
    assert err["code"] == "request_too_large"
    assert f"{LIMIT + 1:,} bytes" in err["message"]
    assert backend.received == []


async def test_chunked_body_over_limit_is_413(router, backend):
    reader, writer = await _connect(router)
    writer.write(b"POST /invocations HTTP/1.1\r\nHost: r\r\nTransfer-Encoding: chunked\r\n\r\n")
    chunk = b"x" * 16384
    for _ in range(LIMIT // len(chunk) + 1):
        writer.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
    status, headers, body = await _read_response(reader)
    writer.close()
    assert status == 413
    assert headers["x-amzn-errortype"] == "ValidationError"
    assert "chunked body went past it" in orjson.loads(body)["message"]
    assert backend.received == []


async def test_chunked_body_is_forwarded_whole(router, backend):
    reader, writer = await _connect(router)
    writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: r\r\nTransfer-Encoding: chunked\r\n\r\n")
    for i in range(0, len(CHAT), 1000):
        piece = CHAT[i:i + 1000]
        writer.write(b"%x\r\n%s\r\n" % (len(piece), piece))
    writer.write(b"0\r\n\r\n")
    status, _, _ = await _read_response(reader)
    writer.close()
    assert status == 200
    rec = backend.received[0]
    assert rec.body == CHAT and not rec.chunked
    assert rec.headers["Content-Length"] == str(len(CHAT))


async def test_other_routes_and_http10_go_through_aiohttp(router, backend):
    async with aiohttp.ClientSession() as http:
        async with http.get(router.url + "/health") as r:
            assert r.status == 200
            assert await r.json() == {"status": "ok", "message": "1 of 1 instances healthy", "variants_down": [],
                                      "healthy_instances": 1, "instances": 1}
        async with http.get(router.url + "/metrics") as r:
            assert r.status == 200
            assert "prefixroute_responses_total" in await r.text()
        async with http.get(router.url + "/nope") as r:
            assert r.status == 404
            assert (await r.json())["message"].startswith("no route for GET /nope")
    reader, writer = await _connect(router)
    writer.write(b"POST /v1/chat/completions HTTP/1.0\r\nHost: r\r\nContent-Length: %d\r\n\r\n" % len(CHAT) + CHAT)
    status, headers, body = await _read_response(reader)
    writer.close()
    assert status == 200
    assert orjson.loads(body)["object"] == "chat.completion"
    assert len(backend.received) == 1


async def test_a_compressed_body_is_forwarded_decoded(router, backend):
    async with aiohttp.ClientSession() as http:
        async with http.post(router.url + "/v1/chat/completions", data=gzip.compress(CHAT),
                             headers={"Content-Encoding": "gzip", "Content-Type": "application/json"}) as r:
            assert r.status == 200
    rec = backend.received[0]
    assert rec.body == CHAT
    assert "Content-Encoding" not in rec.headers


async def test_digests_of_a_decoded_body_are_not_sent_on(backend, data_plane):
    """Content-Digest, Repr-Digest, Digest and Content-MD5 are computed over the body as
    the client encoded it: next to the decoded body they would be wrong, so they go
    with its Content-Encoding; next to a body sent on as it came they stay."""
    import base64
    import hashlib

    handle = await _plane_router(backend, data_plane)
    names = ("Content-Digest", "Repr-Digest", "Digest", "Content-MD5")

    def digests(data: bytes) -> dict[str, str]:
        sha = base64.b64encode(hashlib.sha256(data).digest()).decode()
        md5 = base64.b64encode(hashlib.md5(data).digest()).decode()
        return {"Content-Digest": f"sha-256=:{sha}:", "Repr-Digest": f"sha-256=:{sha}:", "Digest": f"SHA-256={sha}",
                "Content-MD5": md5}

    packed = gzip.compress(CHAT)
    try:
        async with aiohttp.ClientSession(auto_decompress=False) as http:
            for body, coding in ((packed, "gzip"), (CHAT, "identity"), (CHAT, None)):
                headers = {"Content-Type": "application/json", "X-Custom": "kept", **digests(body)}
                if coding:
                    headers["Content-Encoding"] = coding
                async with http.post(handle.url + "/v1/chat/completions", data=body, headers=headers) as r:
                    assert r.status == 200, await r.text()
        decoded, identity, plain = backend.received
        assert decoded.body == identity.body == plain.body == CHAT
        assert [n for n in names if n in decoded.headers] == [] and decoded.headers["X-Custom"] == "kept"
        for rec in (identity, plain):  # the body unchanged: its digests hold and are sent on
            assert {n: rec.headers[n] for n in names} == digests(CHAT)
    finally:
        await handle.close()


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/endpoints/default/invocations"])
async def test_undecodable_or_unsupported_content_encodings_are_answered_in_the_apis_shape(backend, data_plane,
                                                                                          path, caplog):
    handle = await _plane_router(backend, data_plane)
    openai = path.startswith("/v1")
    unsupported = ["foo", "x-compress", "gzip, gzip", "br", "zstd", "gzip, identity", "gzip, x-gzip"]
    assert not DECODED_CODINGS & set(unsupported)
    try:
        async with aiohttp.ClientSession(auto_decompress=False) as http:
            async with http.post(handle.url + path, data=gzip.compress(CHAT)[:20] + b"not gzip at all",
                                 headers={"Content-Encoding": "gzip", "Content-Type": "application/json"}) as r:
                assert r.status == 400, await r.text()  # was a 500 and two tracebacks
                doc = await r.json()
                message = doc["error"]["message"] if openai else doc["message"]
                assert message == "the request body is not valid gzip data (its Content-Encoding)"
                assert (doc["error"]["code"] == "invalid_content_encoding") if openai else \
                    r.headers["X-Amzn-ErrorType"].startswith("ValidationError")
            for coding in unsupported:
                async with http.post(handle.url + path, data=CHAT,
                                     headers={"Content-Encoding": coding, "Content-Type": "application/json"}) as r:
                    assert r.status == 415, (coding, await r.text())
                    assert r.headers["Accept-Encoding"] == "deflate, gzip"
                    doc = await r.json()
                    message = doc["error"]["message"] if openai else doc["message"]
                    assert message.startswith(f"Content-Encoding {coding!r} is not supported"), message
            for coding in ("GZIP", "x-gzip"):  # good ones still go (x-gzip is gzip: RFC 9110 §8.4.1.3)
                async with http.post(handle.url + path, data=gzip.compress(CHAT),
                                     headers={"Content-Encoding": coding, "Content-Type": "application/json"}) as r:
                    assert r.status == 200, (coding, await r.text())
        assert [rec.body for rec in backend.received] == [CHAT, CHAT]  # nothing forwarded still encoded
        assert not [rec for rec in caplog.records if rec.levelno >= logging.ERROR]
    finally:
        await handle.close()


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/endpoints/default/invocations"])
async def test_content_encoding_values_are_read_alike_by_the_check_and_the_decoders(backend, data_plane, path,
                                                                                   caplog):
    """Raw heads: two Content-Encoding lines are a list (RFC 9110 §5.3), a value with
    non-ASCII space is no coding anyone decodes. Both are 415 and nothing is forwarded
    (aiohttp decodes by the last line, and only ASCII values)."""
    handle = await _plane_router(backend, data_plane)
    packed = gzip.compress(CHAT)
    try:
        for extra in (b"Content-Encoding: gzip\r\nContent-Encoding: gzip\r\n",
                      b"Content-Encoding: gzip\xc2\xa0\r\n", b"Content-Encoding: gzip\r\ncontent-encoding: x-foo\r\n"):
            reader, writer = await _connect(handle)
            writer.write(b"POST %s HTTP/1.1\r\nHost: r\r\nContent-Type: application/json\r\n%sContent-Length: %d\r\n\r\n"
                         % (path.encode(), extra, len(packed)) + packed)
            status, headers, body = await _read_response(reader)
            writer.close()
            assert status == 415, (extra, body)
            assert b"is not supported" in body and headers["accept-encoding"] == "deflate, gzip"
        assert backend.received == []
        assert not [rec for rec in caplog.records if rec.levelno >= logging.ERROR]
    finally:
        await handle.close()


async def test_gzip_and_deflate_are_decoded_strictly_on_both_planes(backend, data_plane, caplog):
    """gzip (several members too) and deflate (zlib-wrapped or raw) bodies are decoded
    by the router itself (aiohttp's decompression is off: it passed a gzip body cut short
    on as the part that decoded); one cut short, with a bad checksum or with bytes after
    its end is a 400, and a body past --max-body-size once decoded a 413, decoding
    stopped there. The same for a request the fast plane hands to the aiohttp app
    (HTTP/1.0)."""
    import zlib

    router = await start_router(
        FleetConfig.single([backend.url], RoutingConfig.build("prefix-aware", 1024, 64)),
        ServerSettings(port=0, health_check_interval_s=0, metrics_scrape_interval_s=0, shutdown_timeout_s=1.0,
                       seed=1, max_body_bytes=LIMIT, data_plane=data_plane))

    def deflate(data: bytes, wbits: int) -> bytes:
        c = zlib.compressobj(wbits=wbits)
        return c.compress(data) + c.flush()

    half = len(CHAT) // 2
    good = {"gzip": [gzip.compress(CHAT), gzip.compress(CHAT[:half]) + gzip.compress(CHAT[half:])],
            "deflate": [deflate(CHAT, 15), deflate(CHAT, -15)]}
    packed = gzip.compress(CHAT)
    bad_crc = packed[:-8] + bytes([packed[-8] ^ 1]) + packed[-7:]
    bad = {"gzip": [packed[: len(packed) // 2], packed[:-4], bad_crc, packed + b"junk", packed + packed[:10]],
           "deflate": [deflate(CHAT, 15)[:-4], deflate(CHAT, -15)[:-3], deflate(CHAT, 15) + b"junk"]}
    bomb = gzip.compress(b"[" + b"0," * LIMIT + b"0]")
    members = gzip.compress(b"") * 1023 + gzip.compress(CHAT)
    good["gzip"].append(members)
    bad["gzip"].append(members[:20] + members)  # 1,025 members
    try:
        await _decode_cases(router, backend, good, bad, bomb)
        reader, writer = await _connect(router)  # HTTP/1.0: the aiohttp app answers it behind the fast plane
        cut = packed[: len(packed) // 2]
        writer.write(b"POST /v1/chat/completions HTTP/1.0\r\nContent-Encoding: gzip\r\nContent-Length: %d\r\n\r\n"
                     % len(cut) + cut)
        status, _, body = await _read_response(reader)
        writer.close()
        assert status == 400 and orjson.loads(body)["error"]["code"] == "invalid_content_encoding"
    finally:
        await router.close()
    assert not [rec for rec in caplog.records if rec.levelno >= logging.ERROR]


async def _decode_cases(router, backend, good, bad, bomb) -> None:
    async with aiohttp.ClientSession(auto_decompress=False) as http:
        for coding, bodies in good.items():
            for body in bodies:
                async with http.post(router.url + "/v1/chat/completions", data=body,
                                     headers={"Content-Encoding": coding, "Content-Type": "application/json"}) as r:
                    assert r.status == 200, (coding, await r.text())
        for coding, bodies in bad.items():
            for body in bodies:
                async with http.post(router.url + "/v1/chat/completions", data=body,
                                     headers={"Content-Encoding": coding, "Content-Type": "application/json"}) as r:
                    assert r.status == 400, (coding, body[-12:], await r.text())
                    assert (await r.json())["error"]["code"] == "invalid_content_encoding"
        async with http.post(router.url + "/endpoints/default/invocations", data=bomb,
                             headers={"Content-Encoding": "gzip", "Content-Type": "application/json"}) as r:
            assert r.status == 413 and len(bomb) < LIMIT
            assert "decoded from its Content-Encoding, it went past it" in (await r.json())["message"]
    assert [rec.body for rec in backend.received] == [CHAT] * 5
    assert all("Content-Encoding" not in rec.headers for rec in backend.received)


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/endpoints/default/invocations"])
async def test_a_transfer_coding_other_than_chunked_is_a_501_and_nothing_is_forwarded(backend, data_plane, path):
    """The parsers frame "gzip, chunked" as chunked and drop the gzip: the body would
    reach the engine still gzipped (RFC 9112 §6.1: 501)."""
    handle = await _plane_router(backend, data_plane)
    try:
        reader, writer = await _connect(handle)
        for te, body, want in ((b"gzip, chunked", gzip.compress(CHAT), 501), (b"Chunked", CHAT, 200),
                               (b"deflate,chunked", CHAT, 501), (b"chunked", CHAT, 200)):
            writer.write(b"POST %s HTTP/1.1\r\nHost: r\r\nContent-Type: application/json\r\nTransfer-Encoding: %s"
                         b"\r\n\r\n%x\r\n%s\r\n0\r\n\r\n" % (path.encode(), te, len(body), body))
            status, _, answer = await _read_response(reader)  # (on one connection: it stays usable)
            assert status == want, (te, answer)
            if want == 501:
                doc = orjson.loads(answer)
                message = doc["error"]["message"] if path.startswith("/v1") else doc["message"]
                assert message == f"Transfer-Encoding {te.decode().lower()!r} is not supported: only chunked"
        writer.close()
        assert [rec.body for rec in backend.received] == [CHAT, CHAT]
    finally:
        await handle.close()


async def test_malformed_request_is_400_and_closed(router, backend):
    reader, writer = await _connect(router)
    writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost r\r\n\r\n")
    status, headers, _ = await _read_response(reader)
    assert status == 400 and headers["connection"] == "close"
    assert await asyncio.wait_for(reader.read(), 5) == b""
    writer.close()


@pytest.mark.parametrize("plane", ["fast", "aiohttp"])
async def test_idle_client_connection_is_closed_after_the_keepalive_timeout(backend, plane):
    handle = await start_router(
        FleetConfig.single([backend.url], RoutingConfig.build("prefix-aware", 1024, 64)),
        ServerSettings(port=0, admin_port=0, health_check_interval_s=0, metrics_scrape_interval_s=0,
                       shutdown_timeout_s=1.0, seed=1, client_keepalive_timeout_s=0.5, data_plane=plane))
    try:
        reader, writer = await _connect(handle)
        writer.write(_post("/v1/chat/completions", CHAT))
        status, _, _ = await _read_response(reader)
        assert status == 200
        t0 = asyncio.get_running_loop().time()
        assert await asyncio.wait_for(reader.read(), 5) == b""
        assert 0.4 <= asyncio.get_running_loop().time() - t0 < 3
        writer.close()
    finally:
        await handle.close()


async def test_head_request_through_aiohttp_does_not_hang(router, backend):
    reader, writer = await _connect(router)
    writer.write(b"HEAD /health HTTP/1.1\r\nHost: r\r\n\r\n")  # a load balancer's check
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    assert head.startswith(b"HTTP/1.1 200 ")
    length = int(next(line.split(b":", 1)[1] for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length:")))
    assert length > 0  # the GET answer's length, with no body after the head
    writer.write(b"HEAD /metrics HTTP/1.1\r\nHost: r\r\n\r\n")
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    assert head.startswith(b"HTTP/1.1 405 ")  # (an answer to HEAD has no body)
    writer.write(_post("/v1/chat/completions", CHAT))  # the connection still serves
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    assert head.startswith(b"HTTP/1.1 200 ")
    writer.close()


async def test_upgrade_offer_is_ignored_and_body_read(router, backend):
    reader, writer = await _connect(router)
    writer.write(b"GET /health HTTP/1.1\r\nHost: r\r\nConnection: Upgrade, HTTP2-Settings\r\nUpgrade: h2c\r\n"
                 b"HTTP2-Settings: AAMAAABkAAQCAAAAAAIAAAAA\r\n\r\n")
    status, _, body = await _read_response(reader)
    assert status == 200 and orjson.loads(body)["status"] == "ok"
    writer.write(_post("/v1/chat/completions", CHAT, "Connection: Upgrade\r\nUpgrade: websocket\r\n"))
    status, _, _ = await _read_response(reader)
    writer.close()
    assert status == 200
    assert backend.received[0].body == CHAT


async def test_413_reaches_a_client_still_sending(router, backend):
    big = b"x" * (3 * 2**20)
    for _ in range(3):
        reader, writer = await _connect(router)
        writer.write(b"POST /invocations HTTP/1.1\r\nHost: r\r\nContent-Length: %d\r\n\r\n" % len(big))
        writer.write(big)  # the router answers before reading it all
        status, headers, _ = await _read_response(reader)
        writer.close()
        assert status == 413 and headers["connection"] == "close"


async def test_a_lingering_connection_drains_while_the_client_sends_then_closes(backend):
    # After a 413 the connection reads and drops what the client still sends, and closes
    # once it has been silent for LINGER_S (at most LINGER_MAX_S), not on a fixed clock,
    # nor on the keep-alive timer (1 s here): closing on unread input would reset it.
    from prefixroute.server.client import LINGER_S

    handle = await start_router(
        FleetConfig.single([backend.url], RoutingConfig.build("random")),
        ServerSettings(port=0, admin_port=0, health_check_interval_s=0, metrics_scrape_interval_s=0,
                       shutdown_timeout_s=1.0, max_body_bytes=LIMIT, client_keepalive_timeout_s=1.0))
    try:
        reader, writer = await _connect(handle)
        writer.write(b"POST /invocations HTTP/1.1\r\nHost: r\r\nContent-Length: %d\r\n\r\n" % (LIMIT + 1))
        status, headers, _ = await _read_response(reader)
        assert status == 413 and headers["connection"] == "close"
        t0 = time.monotonic()
        while time.monotonic() - t0 < 3.5:  # longer than LINGER_S and than the keep-alive timeout
            writer.write(b"y" * 4096)
            await writer.drain()  # (a reset raises ConnectionResetError or BrokenPipeError)
            await asyncio.sleep(0.2)
        silent = time.monotonic()
        assert await asyncio.wait_for(reader.read(), 2 * LINGER_S + 2) == b""  # our FIN came after the answer
        for _ in range(100):  # the router closes its side once the client has been silent for LINGER_S
            if not handle._front.clients:
                break
            await asyncio.sleep(0.05)
        assert not handle._front.clients and LINGER_S - 0.2 < time.monotonic() - silent < LINGER_S + 1.5
        writer.close()
    finally:
        await handle.close()


async def test_http10_client_gets_no_chunks(router, backend):
    reader, writer = await _connect(router)
    body = orjson.dumps({**orjson.loads(CHAT), "stream": True})
    writer.write(b"POST /v1/chat/completions HTTP/1.0\r\nHost: r\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
    data = await asyncio.wait_for(reader.read(), 5)  # the answer ends with the connection
    writer.close()
    head, _, rest = data.partition(b"\r\n\r\n")
    assert b" 200 " in head.split(b"\r\n")[0]
    assert b"transfer-encoding" not in head.lower()
    assert rest.startswith(b"data: ") and rest.rstrip().endswith(b"data: [DONE]")


async def test_refusal_waits_for_the_answer_in_progress(router, backend):
    from fault_backend import Fault

    backend.default = Fault("ok", events=6, delay=0.05)
    body = orjson.dumps({**orjson.loads(CHAT), "stream": True})
    reader, writer = await _connect(router)
    writer.write(_post("/v1/chat/completions", body))
    await asyncio.sleep(0.1)  # the stream has started
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\nContent-Length: 2\r\n\r\n")
    status, _, streamed = await _read_response(reader)  # not cut by the interim answer
    assert status == 200 and streamed.rstrip().endswith(b"data: [DONE]")
    assert await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5) == b"HTTP/1.1 100 Continue\r\n\r\n"
    writer.write(b"{}GARBAGE\r\n\r\n")
    status, _, _ = await _read_response(reader)
    assert status == 400  # {} is no valid completion request
    status, headers, _ = await _read_response(reader)
    assert status == 400 and headers["connection"] == "close"
    writer.close()


async def test_no_content_answer_has_no_body(router, backend):
    from fault_backend import Fault

    backend.default = Fault("status", status=204, body=b"")
    reader, writer = await _connect(router)
    writer.write(_post("/v1/chat/completions", CHAT) + _post("/v1/chat/completions", CHAT))
    for _ in range(2):
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        assert head.startswith(b"HTTP/1.1 204 ")
        assert b"transfer-encoding" not in head.lower() and b"content-length" not in head.lower()
    writer.close()


async def test_header_line_over_limit_is_431(router, backend):
    reader, writer = await _connect(router)
    writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: r\r\nX-Big: " + b"a" * 9000
                 + b"\r\nContent-Length: 2\r\n\r\n{}")
    status, _, _ = await _read_response(reader)
    writer.close()
    assert status == 431
    assert backend.received == []


@pytest.mark.parametrize("count, status", [(MAX_HEADERS - 3, 200), (MAX_HEADERS + 1, 431)])
async def test_too_many_header_fields_is_431_naming_the_limit(router, backend, count, status):
    # Host and Content-Length make up the rest: the limit counts every field.
    reader, writer = await _connect(router)
    extra = b"".join(b"X-H%d: v\r\n" % i for i in range(count))
    writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: r\r\n" + extra
                 + b"Content-Length: %d\r\n\r\n" % len(CHAT) + CHAT)
    got, headers, body = await _read_response(reader)
    writer.close()
    assert got == status
    if status == 431:
        assert orjson.loads(body) == {"message": f"more than {MAX_HEADERS} header fields"}
        assert headers["connection"] == "close"
        assert backend.received == []
    else:
        assert len(backend.received) == 1


@pytest.mark.parametrize("head, reason", [
    (b"Content-Length: -5\r\n", "Invalid character in Content-Length"),
    (b"Content-Length: 5\r\nContent-Length: 6\r\n", "Duplicate Content-Length"),
    (b"X-Secret: sk-SECRET\x01\r\nContent-Length: 2\r\n", "Invalid header value char"),
])
async def test_malformed_request_is_400_naming_what_is_wrong(router, backend, head, reason):
    reader, writer = await _connect(router)
    writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: r\r\n" + head + b"\r\n{}")
    status, _, body = await _read_response(reader)
    writer.close()
    assert status == 400
    assert orjson.loads(body) == {"message": f"bad request: {reason}"}
    assert backend.received == []


async def test_garbage_mid_stream_is_answered_after_it(router, backend):
    from fault_backend import Fault

    backend.default = Fault("ok", events=6, delay=0.05)
    reader, writer = await _connect(router)
    writer.write(_post("/v1/chat/completions", orjson.dumps({**orjson.loads(CHAT), "stream": True})))
    await asyncio.sleep(0.1)
    writer.write(b"GARBAGE\r\n\r\n")
    status, _, streamed = await _read_response(reader)
    assert status == 200 and streamed.rstrip().endswith(b"data: [DONE]")
    status, headers, _ = await _read_response(reader)
    assert status == 400 and headers["connection"] == "close"
    writer.close()


class _ScriptedEngine:
    """A raw HTTP/1.1 engine whose answers are given as bytes, one per request in
    order (then a plain 200); counts the connections it accepted."""

    OK = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}"

    def __init__(self, answers: list[bytes]) -> None:
        self.answers = list(answers)
        self.accepted = 0
        self.heads: list[bytes] = []  # each request's head as received
        self.server: asyncio.AbstractServer | None = None

    async def start(self) -> str:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.accepted += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                if head.startswith(b"GET /v1/models "):  # the router asking what it serves: no list
                    self.accepted -= 1
                    writer.write(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
                    await writer.drain()
                    writer.close()
                    return
                self.heads.append(head)
                length = next(int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                              if line.lower().startswith(b"content-length:"))
                await reader.readexactly(length)
                await self.answer(writer)
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    async def answer(self, writer: asyncio.StreamWriter) -> None:
        writer.write(self.answers.pop(0) if self.answers else self.OK)
        await writer.drain()

    async def stop(self) -> None:
        assert self.server is not None
        self.server.close()
        await self.server.wait_closed()


@contextlib.asynccontextmanager
async def _scripted_router(answers: list[bytes], data_plane: str = "fast"):
    """A router (no retries) in front of a :class:`_ScriptedEngine` with ``answers``;
    yields ``(engine, router)`` and stops both."""
    engine = _ScriptedEngine(answers)
    url = await engine.start()
    handle = await start_router(
        FleetConfig.single([url], RoutingConfig()),
        ServerSettings(port=0, admin_port=0, health_check_interval_s=0, metrics_scrape_interval_s=0,
                       shutdown_timeout_s=1.0, seed=1, max_retries=0, data_plane=data_plane))
    try:
        yield engine, handle
    finally:
        await handle.close()
        await engine.stop()


async def test_bytes_after_an_answer_retire_the_upstream_connection():
    # The engine's answer is followed in the same write by the start of another one:
    # the client gets the answer, and the connection is not used for the next request
    # (whose answer the stray bytes would corrupt).
    async with _scripted_router([_ScriptedEngine.OK + b"HTTP/1.1 2"]) as (engine, router):
        reader, writer = await _connect(router)
        for _ in range(3):
            writer.write(_post("/v1/chat/completions", CHAT))
            status, _, body = await _read_response(reader)
            assert (status, body) == (200, b"{}")
        assert engine.accepted == 2  # the first connection retired, the second reused
        writer.close()


async def test_a_second_answer_to_one_request_is_ignored():
    unavailable = b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 4\r\n\r\nbusy"
    async with _scripted_router([unavailable + _ScriptedEngine.OK]) as (engine, router):
        reader, writer = await _connect(router)
        writer.write(_post("/v1/chat/completions", CHAT))
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        assert head.startswith(b"HTTP/1.1 503 Service Unavailable\r\n") and b"Content-Length: 4\r\n" in head
        assert await asyncio.wait_for(reader.readexactly(4), 5) == b"busy"
        writer.write(_post("/v1/chat/completions", CHAT))  # the next one: a clean connection
        status, _, body = await _read_response(reader)
        assert (status, body) == (200, b"{}") and engine.accepted == 2
        writer.close()


@pytest.mark.parametrize("request_line", [b"HEAD /ping HTTP/1.0", b"GET /health HTTP/1.0"])
async def test_http10_check_without_host_is_answered(router, backend, request_line):
    # HAProxy's default `option httpchk` sends exactly this: HTTP/1.0, no Host header.
    reader, writer = await _connect(router)
    writer.write(request_line + b"\r\n\r\n")
    answer = await asyncio.wait_for(reader.read(), 5)  # HTTP/1.0: the connection closes after
    assert answer.split(b"\r\n", 1)[0] in (b"HTTP/1.1 200 OK", b"HTTP/1.0 200 OK"), answer[:200]
    _, _, body = answer.partition(b"\r\n\r\n")
    if request_line.startswith(b"HEAD"):
        assert body == b""
    else:
        assert orjson.loads(body) == {"status": "ok", "message": "1 of 1 instances healthy", "variants_down": [],
                                      "healthy_instances": 1, "instances": 1}
    writer.close()


class _PacedBackend(_ScriptedEngine):
    """A raw engine stand-in whose JSON answer (``Content-Length`` or chunked) is
    written in one piece (``whole``) or as its head, then its body 30 ms later in two
    writes (``paced``): the first reaches the router's whole-answer path
    (``relay.write_whole``), the second its relay task."""

    BODY = b'{"id": "c1", "object": "chat.completion", "choices": []}'

    def __init__(self) -> None:
        super().__init__([])
        self.mode = "whole"
        self.chunked = False

    async def answer(self, writer: asyncio.StreamWriter) -> None:
        body = self.BODY
        if self.chunked:
            framing, payload = b"Transfer-Encoding: chunked", b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body)
        else:
            framing, payload = b"Content-Length: %d" % len(body), body
        head = (b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nX-Engine: e1\r\n"
                b"Connection: keep-alive, X-Engine-Hop\r\nX-Engine-Hop: drop-me\r\n%s\r\n\r\n" % framing)
        if self.mode == "whole":
            writer.write(head + payload)
        else:
            writer.write(head)
            await writer.drain()
            await asyncio.sleep(0.03)
            half = len(payload) // 2
            writer.write(payload[:half])
            await writer.drain()
            await asyncio.sleep(0.01)
            writer.write(payload[half:])
        await writer.drain()


@pytest.mark.parametrize("chunked", [False, True])
async def test_an_answer_that_comes_whole_is_relayed_as_one_that_comes_in_pieces(chunked, monkeypatch):
    from test_server_helpers import in_flight, metric_value

    paths: list[str] = []  # which path answered each request
    relay, settle = FrontServer._relay, FrontServer._settle

    async def observed_relay(self, client, rr, up, *args):  # sees the path, changes nothing
        paths.append("task, written whole" if up.reply is not None else "task relay")
        return await relay(self, client, rr, up, *args)

    def observed_settle(self, client, started):
        paths.append("callbacks")
        return settle(self, client, started)

    monkeypatch.setattr(FrontServer, "_relay", observed_relay)
    monkeypatch.setattr(FrontServer, "_settle", observed_settle)
    backend = _PacedBackend()
    backend.chunked = chunked
    url = await backend.start()
    handle = await start_router(
        FleetConfig.single([url], RoutingConfig.build("prefix-aware", 1024, 64)),
        ServerSettings(port=0, admin_port=0, health_check_interval_s=0, metrics_scrape_interval_s=0,
                       shutdown_timeout_s=1.0, seed=1))
    try:
        answers = {}
        reader, writer = await _connect(handle)
        for mode in ("whole", "paced", "whole"):
            backend.mode = mode
            writer.write(_post("/v1/chat/completions", CHAT, "X-Request-Id: rid-1\r\n"))
            answers.setdefault(mode, []).append(await _read_response(reader))
        writer.close()
        whole, paced = answers["whole"][0], answers["paced"][0]
        assert answers["whole"][1][0] == 200 and answers["whole"][1][2] == whole[2]
        # The first request opens the instance's connection (its task sends it); on the
        # pooled connection, a paced answer is handed to the task, a whole one is not.
        assert paths == ["task, written whole", "task relay", "callbacks"]
        for status, headers, body in (whole, paced):
            assert status == 200 and body == _PacedBackend.BODY
            assert headers["x-engine"] == "e1" and "x-engine-hop" not in headers
            assert headers["x-request-id"] == "rid-1"
            assert float(headers["x-prefixroute-overhead-ms"]) >= 0
            assert headers["x-prefixroute-decision"] == "affinity"
        # The same header lines but for their values of time and length framing.
        assert whole[1].keys() == paced[1].keys()
        assert {k: v for k, v in whole[1].items() if k not in ("date", "x-prefixroute-overhead-ms")} == \
            {k: v for k, v in paced[1].items() if k not in ("date", "x-prefixroute-overhead-ms")}
        assert ("transfer-encoding" in whole[1]) == chunked
        async with aiohttp.ClientSession() as http:
            async with http.get(handle.url + "/metrics") as r:
                text = await r.text()
        lbl = dict(endpoint="default", variant="AllTraffic")
        assert metric_value(text, "prefixroute_responses_total", **lbl, code="200") == 3
        for h in ("routing_decision_seconds", "ttft_seconds", "request_duration_seconds", "router_overhead_seconds"):
            assert metric_value(text, f"prefixroute_{h}_count", **lbl) == 3
        assert in_flight(handle) == 0
    finally:
        await handle.close()
        await backend.stop()


async def test_a_connection_paused_for_a_slow_client_reads_again_in_the_pool():
    # The read that ends a large answer can push a slow client's buffer over its limit,
    # pausing the instance's connection; pooled like that, it would never read the next
    # answer. The next request on it must be answered at once.
    import socket

    for size in (2_860_000, 2_900_000, 3_000_000):
        body = b"x" * size
        big = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (size, body)
        async with _scripted_router([big]) as (engine, router):
            sock = socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.connect(("127.0.0.1", router.port))
            sock.setblocking(False)
            reader, writer = await asyncio.open_connection(sock=sock)
            writer.write(_post("/v1/chat/completions", CHAT))
            await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
            await asyncio.sleep(0.5)  # a client that reads late
            got = 0
            while got < size:
                got += len(await asyncio.wait_for(reader.read(1 << 16), 5))
            writer.write(_post("/v1/chat/completions", CHAT))
            status, _, answer = await asyncio.wait_for(_read_response(reader), 3)
            assert (status, answer) == (200, b"{}")
            assert engine.accepted == 1  # the same pooled connection, reading again
            writer.close()


async def test_an_event_stream_answer_to_no_content_is_framed():
    # invocations-response-stream re-frames the answer as 200 + AWS event-stream: an
    # engine's 204 becomes an empty chunked stream, not an unframed 200.
    bodyless = b"HTTP/1.1 204 No Content\r\nContent-Type: application/json\r\n\r\n"
    async with _scripted_router([bodyless]) as (engine, router):
        reader, writer = await _connect(router)
        writer.write(_post("/endpoints/default/invocations-response-stream", b"{}"))
        got, headers, body = await _read_response(reader)
        assert got == 200 and headers["transfer-encoding"] == "chunked" and body == b""
        assert headers["content-type"] == "application/vnd.amazon.eventstream"
        writer.write(_post("/endpoints/default/invocations", b"{}"))  # the connection goes on
        got, _, body = await _read_response(reader)
        assert (got, body) == (200, b"{}")
        writer.close()


def _in_flight(router) -> list[int]:
    return [i.in_flight for _, pool in router.state.fleet.all_pools() for i in pool.instances]


async def _pooled_then_clients(router, n: int = 1, warm_id: str = "warm") -> list[tuple]:
    """One request through aiohttp (the router keeps its connection to the instance:
    one pooled connection), then ``n`` raw client connections: ``(client, reader,
    writer)`` each, ``client`` being the router's ``_Client`` of that connection."""
    async with aiohttp.ClientSession() as http:
        async with http.post(router.url + "/v1/chat/completions", data=CHAT, headers={"X-Request-Id": warm_id}) as r:
            assert r.status == 200
    front = router._front
    conns = [await _connect(router) for _ in range(n)]
    for _ in range(100):
        if len(front.clients) == n:
            break
        await asyncio.sleep(0.01)
    by_port = {c.transport.get_extra_info("peername")[1]: c for c in front.clients}
    return [(by_port[w.get_extra_info("sockname")[1]], r, w) for r, w in conns]


async def test_a_request_is_sent_from_the_parser_callback_and_freed_if_its_client_leaves_first(router, backend):
    """With an idle pooled connection, a request is routed and sent by the callback that
    parsed it (no task wake-up on its way); a client gone before the connection's task
    takes the request over leaves no lease and no connection to the instance behind."""
    ((client, reader, writer),) = await _pooled_then_clients(router)
    front = router._front
    client.data_received(_post("/v1/chat/completions", CHAT, "X-Request-Id: begun\r\n"))
    # Claimed, and sent on the pooled connection, before anything was awaited.
    assert _in_flight(router) == [1] and front.upstreams.idle == {} and front.upstreams.open == 1
    client.connection_lost(None)
    for _ in range(100):
        await asyncio.sleep(0.01)
        if _in_flight(router) == [0] and front.upstreams.open == 0:
            break
    assert _in_flight(router) == [0]
    assert front.upstreams.open == 0  # the instance's connection was aborted, not pooled
    writer.close()
    # The router goes on: a new client's request is answered.
    async with aiohttp.ClientSession() as http:
        async with http.post(router.url + "/v1/chat/completions", data=CHAT) as r:
            assert r.status == 200
    assert _in_flight(router) == [0]


@pytest.mark.parametrize("same_client", [True, False], ids=["same-client", "other-client"])
async def test_a_request_read_before_the_last_answer_is_settled_is_still_sent_by_callbacks(router, backend,
                                                                                          monkeypatch, same_client):
    """Under load a loop turn reads several sockets before its call_soon callbacks run:
    the answer of request A is written whole (its bookkeeping queued for later), then
    request B is read, from A's client or another one. B still starts in the parser's
    callback, over A's connection (the only one), once A is settled: no task, no new
    connection to the instance."""
    from prefixroute.server import upstream

    conns = await _pooled_then_clients(router, 1 if same_client else 2)
    front = router._front
    first, second = conns[0][0], conns[-1][0]
    seen: dict[str, object] = {}
    received = upstream._Upstream.data_received

    def then_b_is_read(self, data):  # the instance's answer to A is read, then B's bytes in the same turn
        received(self, data)
        if "b" not in seen and front.upstreams.due:
            seen["due"] = len(front.upstreams.due)
            seen["b"] = second.data_received(_post("/v1/chat/completions", CHAT, "X-Request-Id: b\r\n"))
            seen["detached"] = second.detached is not None and second.detached.prepared.request_id == "b"
            seen["task"] = second.task
            seen["open"] = front.upstreams.open
            seen["in_flight"] = _in_flight(router)

    monkeypatch.setattr(upstream._Upstream, "data_received", then_b_is_read)
    first.data_received(_post("/v1/chat/completions", CHAT, "X-Request-Id: a\r\n"))
    assert first.detached is not None and first.task is None  # A: sent by callbacks
    answers = [await _read_response(reader) for _, reader, _ in conns for _ in range(2 if same_client else 1)]
    assert [(s, h["x-request-id"]) for s, h, _ in answers] == [(200, "a"), (200, "b")]
    # B was sent by the callback that read it, over A's pooled connection: A settled first.
    assert seen == {"due": 1, "b": None, "detached": True, "task": None, "open": 1, "in_flight": [1]}
    assert second.task is None and front.upstreams.open == 1
    assert _in_flight(router) == [0]
    for _, _, writer in conns:
        writer.close()


async def test_a_request_read_as_the_last_answer_before_shutdown_is_settled_is_not_sent(backend, monkeypatch):
    """The router starts shutting down while A is in flight; A's answer is written and, in
    the same loop turn, the client's next request B is read. Settling A closes the
    connection (the router is closing), so B is not sent to the engine: the client gets
    A's answer only, and nothing is left in flight or open."""
    from prefixroute.server import upstream

    handle = await start_router(
        FleetConfig.single([backend.url], RoutingConfig.build("prefix-aware", 1024, 64)),
        ServerSettings(port=0, admin_port=0, health_check_interval_s=0, metrics_scrape_interval_s=0,
                       shutdown_timeout_s=2.0, seed=1))
    ((client, reader, writer),) = await _pooled_then_clients(handle)
    front = handle._front
    seen: dict[str, object] = {}
    received = upstream._Upstream.data_received

    def then_b_is_read(self, data):
        received(self, data)
        if "b" not in seen and front.upstreams.due:
            seen["b"] = client.data_received(_post("/v1/chat/completions", CHAT, "X-Request-Id: b\r\n"))
            seen["b_started"] = client.detached is not None or bool(client.queue)

    monkeypatch.setattr(upstream._Upstream, "data_received", then_b_is_read)
    client.data_received(_post("/v1/chat/completions", CHAT, "X-Request-Id: a\r\n"))
    assert client.detached is not None  # A: sent by callbacks
    closing = asyncio.create_task(handle.close())
    await asyncio.sleep(0)
    assert front.closing
    data = await asyncio.wait_for(reader.read(), 5)
    await closing
    assert seen == {"b": None, "b_started": False}
    assert data.count(b"HTTP/1.1 ") == 1 and b"x-request-id: a\r\n" in data.lower()
    assert backend.ids() == ["warm", "a"]
    assert _in_flight(handle) == [0] and front.upstreams.open == 0
    writer.close()


def test_the_events_of_exchanges_run_in_order_once_and_one_failing_spares_the_others(caplog):
    """_UpstreamPool.notify queues an exchange's watcher; run_due runs what is queued, in
    order, each once (the loop's own callback then finds nothing left), and one that
    raises is logged without keeping the others from running."""
    from prefixroute.server.upstream import _UpstreamPool

    loop = asyncio.new_event_loop()
    try:
        pool = _UpstreamPool(loop, 8, 10.0)
        ran: list[str] = []

        def broken() -> None:
            ran.append("broken")
            raise RuntimeError("watcher bug")

        pool.notify(lambda: ran.append("first"))
        pool.notify(broken)
        pool.notify(lambda: ran.append("third"))
        with caplog.at_level(logging.ERROR, logger="prefixroute.server.dataplane"):
            pool.run_due()
        assert ran == ["first", "broken", "third"] and pool.due == []
        assert "handling an upstream exchange's event failed" in caplog.text
        pool.notify(lambda: ran.append("later"))
        loop.call_soon(loop.stop)
        loop.run_forever()  # the call_soon of each batch runs: the first finds nothing, the second runs "later"
        assert ran == ["first", "broken", "third", "later"] and pool.due == []
    finally:
        loop.close()


async def test_answers_that_need_the_task_are_handed_over_from_callbacks(backend, monkeypatch):
    """On a pooled connection a request is sent, and a whole answer written and settled,
    by callbacks alone; every other outcome is handed to the connection's task, which
    answers it as ever: a stream, an instance that fails or says nothing in time, a
    server error relayed, pipelined requests after it, in order."""
    from fault_backend import Fault
    from test_server_helpers import metric_value

    handle = await start_router(
        FleetConfig.single([backend.url], RoutingConfig.build("prefix-aware", 1024, 64)),
        ServerSettings(port=0, admin_port=0, health_check_interval_s=0, metrics_scrape_interval_s=0,
                       shutdown_timeout_s=1.0, seed=1, response_headers_timeout_s=0.3, max_retries=0))
    settled: list[str] = []
    settle = FrontServer._settle

    def observed_settle(self, client, started):  # sees the path, changes nothing
        settled.append(started.prepared.request_id)
        return settle(self, client, started)

    monkeypatch.setattr(FrontServer, "_settle", observed_settle)
    try:
        reader, writer = await _connect(handle)

        async def ask(rid: str, body: bytes = CHAT, fault: Fault | None = None) -> tuple[int, dict, bytes]:
            backend.default = fault or Fault()
            writer.write(_post("/v1/chat/completions", body, f"X-Request-Id: {rid}\r\n"))
            return await _read_response(reader)

        assert (await ask("warm"))[0] == 200  # opens the pooled connection (the task sends it)
        assert (await ask("whole"))[0] == 200
        status, headers, streamed = await ask("stream", orjson.dumps({**orjson.loads(CHAT), "stream": True}))
        assert status == 200 and headers["transfer-encoding"] == "chunked"
        assert streamed.rstrip().endswith(b"data: [DONE]")
        status, _, body = await ask("5xx", fault=Fault("status", status=500))
        assert status == 500 and orjson.loads(body)["error"]["message"] == "fault"
        status, _, body = await ask("closed", fault=Fault("close_before_headers"))
        assert status == 502 and orjson.loads(body)["error"]["code"] == "upstream_error"
        assert (await ask("after-502"))[0] == 200  # a new connection (the task's)
        status, _, body = await ask("late", fault=Fault("stall"))
        assert status == 504 and orjson.loads(body)["error"]["code"] == "upstream_timeout"
        assert (await ask("after-504"))[0] == 200
        backend.default = Fault()
        writer.write(_post("/v1/chat/completions", CHAT, "X-Request-Id: p1\r\n")
                     + _post("/v1/chat/completions", b"{not json", "X-Request-Id: p2\r\n")
                     + _post("/v1/chat/completions", CHAT, "X-Request-Id: p3\r\n"))
        answers = [await _read_response(reader) for _ in range(3)]
        assert [(s, h["x-request-id"]) for s, h, _ in answers] == [(200, "p1"), (400, "p2"), (200, "p3")]
        assert (await ask("last"))[0] == 200
        writer.close()
        # Written whole on a pooled connection with nothing before it: settled by callbacks.
        assert settled == ["whole", "5xx", "p1", "last"]
        async with aiohttp.ClientSession() as http:
            async with http.get(handle.url + "/metrics") as r:
                text = await r.text()
        lbl = dict(endpoint="default", variant="AllTraffic")
        counts = {code: metric_value(text, "prefixroute_responses_total", **lbl, code=code)
                  for code in ("200", "400", "500", "502", "504")}
        assert counts == {"200": 8, "400": 1, "500": 1, "502": 1, "504": 1}
        # Every answer has a duration, the 400 refused before routing included: the
        # histogram's count is responses_total's sum.
        assert metric_value(text, "prefixroute_request_duration_seconds_count", **lbl) == 12 == sum(counts.values())
        assert metric_value(text, "prefixroute_upstream_errors_total", instance=backend.url, kind="http_5xx") == 1
        assert metric_value(text, "prefixroute_upstream_errors_total", instance=backend.url,
                            kind="headers_timeout") == 1
        assert _in_flight(handle) == [0]
    finally:
        await handle.close()


async def test_an_answer_landing_as_the_headers_timeout_fires_is_not_written_after_the_504(backend):
    """The response-headers timeout of a request answered by callbacks hands it to the
    task, which answers 504; an answer that lands before the task runs is not written
    too: the client gets one answer per request."""
    from fault_backend import Fault

    handle = await start_router(
        FleetConfig.single([backend.url], RoutingConfig.build("prefix-aware", 1024, 64)),
        ServerSettings(port=0, admin_port=0, health_check_interval_s=0, metrics_scrape_interval_s=0,
                       shutdown_timeout_s=1.0, seed=1, response_headers_timeout_s=30.0))
    try:
        reader, writer = await _connect(handle)
        writer.write(_post("/v1/chat/completions", CHAT, "X-Request-Id: warm\r\n"))
        assert (await _read_response(reader))[0] == 200  # a pooled connection from now on
        front = handle._front
        (client,) = front.clients
        backend.default = Fault("stall")
        client.data_received(_post("/v1/chat/completions", CHAT, "X-Request-Id: late\r\n"))
        started = client.detached
        assert started is not None and client._headers_timer is not None
        client._headers_timer.cancel()
        front.headers_late(client, started)  # the timeout fires...
        # ...and, before the task runs, the instance's whole answer arrives.
        started.up.data_received(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}")
        status, headers, body = await _read_response(reader)
        assert (status, headers["x-request-id"]) == (504, "late")
        assert orjson.loads(body)["error"]["code"] == "upstream_timeout"
        with pytest.raises(asyncio.TimeoutError):  # and nothing after it
            await asyncio.wait_for(reader.read(1), 0.3)
        writer.close()
        assert _in_flight(handle) == [0]
    finally:
        await handle.close()


async def test_the_headers_timeout_of_callback_answers_counts_from_each_request(backend):
    """The response-headers timeout of requests answered by callbacks is one timer per
    connection, armed for the first request's deadline: a request sent later is timed
    out at its own deadline, never at the earlier one."""
    from fault_backend import Fault

    timeout = 0.4
    handle = await start_router(
        FleetConfig.single([backend.url], RoutingConfig.build("prefix-aware", 1024, 64)),
        ServerSettings(port=0, admin_port=0, health_check_interval_s=0, metrics_scrape_interval_s=0,
                       shutdown_timeout_s=1.0, seed=1, response_headers_timeout_s=timeout, max_retries=0))
    try:
        reader, writer = await _connect(handle)
        writer.write(_post("/v1/chat/completions", CHAT, "X-Request-Id: warm\r\n"))
        assert (await _read_response(reader))[0] == 200  # a pooled connection from now on
        (client,) = handle._front.clients
        loop = asyncio.get_running_loop()
        armed = loop.time()
        writer.write(_post("/v1/chat/completions", CHAT, "X-Request-Id: fast\r\n"))
        assert (await _read_response(reader))[0] == 200
        assert client._headers_timer is not None and client._headers_timer.when() >= armed + timeout - 0.01
        await asyncio.sleep(timeout / 2)
        backend.default = Fault("stall")
        sent = loop.time()
        writer.write(_post("/v1/chat/completions", CHAT, "X-Request-Id: slow\r\n"))
        status, headers, body = await _read_response(reader)
        waited = loop.time() - sent
        assert (status, headers["x-request-id"]) == (504, "slow")
        assert timeout - 0.01 <= waited < timeout + 0.3, waited  # its own deadline, not the fast one's
        assert orjson.loads(body)["error"]["code"] == "upstream_timeout"
        writer.close()
        await asyncio.sleep(0.05)
        assert client.closed and client._headers_timer is None  # (cancelled with the connection)
        assert _in_flight(handle) == [0]
    finally:
        backend.default = Fault()
        await handle.close()


async def test_no_100_continue_is_sent_for_a_body_that_came_without_it(router, backend):
    """A request with ``Expect: 100-continue`` behind one in progress, whose body the
    client sent at once, gets its answer and no 100 Continue after it (which the client
    would take for an interim answer to its next request)."""
    from fault_backend import Fault

    backend.default = Fault("ok", events=4, delay=0.05)
    streamed = orjson.dumps({**orjson.loads(CHAT), "stream": True})
    reader, writer = await _connect(router)
    writer.write(_post("/v1/chat/completions", streamed, "X-Request-Id: first\r\n"))
    await asyncio.sleep(0.05)  # the stream has started
    writer.write(_post("/v1/chat/completions", CHAT, "X-Request-Id: second\r\nExpect: 100-continue\r\n"))
    answers = [await _read_response(reader) for _ in range(2)]
    assert [(s, h["x-request-id"]) for s, h, _ in answers] == [(200, "first"), (200, "second")]
    backend.default = Fault()
    writer.write(_post("/v1/chat/completions", CHAT, "X-Request-Id: third\r\n"))
    status, headers, _ = await _read_response(reader)  # not a stray "100 Continue"
    assert (status, headers["x-request-id"]) == (200, "third")
    writer.close()


async def test_a_client_that_pipelines_and_does_not_read_gets_no_more_answers_until_it_reads(router, backend):
    """Answers are not produced faster than a client reads them: pipelined requests
    behind an answer the client has not read wait (and reading from the client stays
    paused), so the router's memory does not grow with them; once it reads, every
    answer comes, in order."""
    import socket

    from fault_backend import Fault

    backend.default = Fault("status", status=200, body=b'{"pad": "' + b"x" * 200_000 + b'"}')
    n = 100
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    loop = asyncio.get_running_loop()
    await loop.sock_connect(sock, ("127.0.0.1", router.port))
    requests = b"".join(_post("/v1/chat/completions", CHAT, f"X-Request-Id: r{i}\r\n") for i in range(n))
    send = loop.create_task(loop.sock_sendall(sock, requests))
    await asyncio.sleep(1.0)
    # What the kernel's socket buffers hold went out (a few MB); the rest waits.
    assert len(backend.received) < n // 2
    reader, writer = await asyncio.open_connection(sock=sock)
    answers = [await _read_response(reader) for _ in range(n)]
    await send
    assert [(s, h["x-request-id"]) for s, h, _ in answers] == [(200, f"r{i}") for i in range(n)]
    assert len(backend.received) == n
    writer.close()


async def test_a_broken_body_in_the_read_that_brings_the_head_ends_the_answer_as_apart():
    # On a pooled connection the head resolves once its whole read is parsed; a body
    # that breaks in that same read still ends the answer as a broken one (the head
    # relayed, then the client connection closed), and frees everything.
    broken = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\nZZ\r\n"
    async with _scripted_router([_ScriptedEngine.OK, broken]) as (engine, router):
        reader, writer = await _connect(router)
        writer.write(_post("/v1/chat/completions", CHAT))
        assert (await _read_response(reader))[0] == 200  # opens the pooled connection
        writer.write(_post("/v1/chat/completions", CHAT))
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        assert head.startswith(b"HTTP/1.1 200 OK\r\n") and b"Transfer-Encoding: chunked\r\n" in head
        assert await asyncio.wait_for(reader.read(), 5) == b""  # no body, no last chunk: closed
        writer.close()
        reader, writer = await _connect(router)
        writer.write(_post("/v1/chat/completions", CHAT))
        status, _, body = await _read_response(reader)
        assert (status, body) == (200, b"{}")
        writer.close()
        assert _in_flight(router) == [0] and engine.accepted == 2


async def test_trailer_fields_of_a_chunked_request_are_neither_used_nor_relayed():
    # RFC 9110 6.5.1: trailers are not headers. As on the aiohttp plane, none of them
    # routes the request (no variant, no request id from them) or reaches the engine.
    trailers = (b"X-Amzn-SageMaker-Target-Variant: Nope\r\nAuthorization: Bearer injected\r\n"
                b"X-Request-Id: trailer-id\r\n")
    async with _scripted_router([]) as (engine, router):
        reader, writer = await _connect(router)
        for _ in range(2):  # sent by the task (a new connection), then from the parser's callback
            writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: r\r\nTransfer-Encoding: chunked\r\n\r\n"
                         b"%x\r\n%s\r\n0\r\n%s\r\n" % (len(CHAT), CHAT, trailers))
            status, headers, body = await _read_response(reader)
            assert (status, body) == (200, b"{}") and headers["x-request-id"] != "trailer-id"
        writer.close()
        assert len(engine.heads) == 2
        for head in engine.heads:
            low = head.lower()
            assert b"target-variant" not in low and b"authorization" not in low and b"trailer-id" not in low
            assert b"content-length: %d\r\n" % len(CHAT) in low


@pytest.mark.parametrize("interim", [b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: h2c\r\nConnection: Upgrade\r\n\r\n",
                                     b"HTTP/1.1 103 Early Hints\r\nLink: </a>; rel=preload\r\n\r\n"])
async def test_an_engine_answering_101_gets_a_502_and_no_traceback(caplog, data_plane, interim):
    """An unsolicited 101 is never relayed: the client gets a 502 and the next request
    a new connection. An interim 103 (Early Hints) is skipped and the final answer
    relayed. Both data planes."""
    upgrade = interim
    if interim.startswith(b"HTTP/1.1 103"):
        async with _scripted_router([upgrade + _ScriptedEngine.OK], data_plane) as (engine, router):
            reader, writer = await _connect(router)
            writer.write(_post("/v1/chat/completions", CHAT))
            status, headers, body = await _read_response(reader)
            assert (status, body) == (200, b"{}") and "link" not in headers
            writer.close()
        return
    async with _scripted_router([upgrade + _ScriptedEngine.OK], data_plane) as (engine, router):
        reader, writer = await _connect(router)
        writer.write(_post("/v1/chat/completions", CHAT))
        status, _, body = await _read_response(reader)
        assert status == 502 and orjson.loads(body)["error"]["code"] == "upstream_error"
        writer.write(_post("/v1/chat/completions", CHAT))
        status, _, body = await _read_response(reader)
        assert (status, body) == (200, b"{}") and engine.accepted == 2
        writer.close()
        assert _in_flight(router) == [0]
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert any("invalid HTTP response" in r.getMessage() for r in caplog.records)


async def test_refusals_of_requests_the_fast_plane_hands_over_are_counted(backend, data_plane):
    """A body declared over the limit on a request the aiohttp app would answer (an
    unknown path, HTTP/1.0) is refused by the fast plane itself: that 413 is counted
    like every answer (it was counted nowhere). On either plane the responses add up
    to the duration histogram's count."""
    handle = await _plane_router(backend, data_plane, max_body_bytes=LIMIT)
    try:
        for head in (b"POST /nope HTTP/1.1\r\nHost: r\r\n", b"POST /v1/chat/completions HTTP/1.0\r\n"):
            reader, writer = await _connect(handle)
            writer.write(head + b"Content-Length: %d\r\n\r\n" % (LIMIT + 1))
            status, _, _ = await asyncio.wait_for(_read_response(reader), 5)
            writer.close()
            assert status in (404, 413)
        async with aiohttp.ClientSession() as http:
            async with http.get(handle.url + "/metrics") as r:
                text = await r.text()
        answers = sum(v for _, v in _samples(text, "prefixroute_responses_total"))
        durations = sum(v for _, v in _samples(text, "prefixroute_request_duration_seconds_count"))
        assert answers == durations == 2
        # The inference request's 413 is under its endpoint and variant, on both planes.
        assert [v for k, v in _samples(text, "prefixroute_responses_total") if 'code="413"' in k and
                'endpoint="default",variant="AllTraffic"' in k] == [1.0]
    finally:
        await handle.close()


async def test_an_expect_other_than_100_continue(backend, data_plane):
    """The aiohttp plane answers 417 (RFC 9110 §10.1.1) in the API's shape, counted; the
    fast plane ignores the field and answers the request (docs/RELIABILITY.md)."""
    handle = await _plane_router(backend, data_plane)
    try:
        reader, writer = await _connect(handle)
        writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: r\r\nExpect: 200-ok\r\nContent-Length: %d\r\n\r\n"
                     % len(CHAT) + CHAT)
        status, headers, body = await asyncio.wait_for(_read_response(reader), 5)
        writer.close()
        async with aiohttp.ClientSession() as http:
            async with http.get(handle.url + "/metrics") as r:
                text = await r.text()
        counted = sum(v for k, v in _samples(text, "prefixroute_responses_total") if f'code="{status}"' in k)
        if data_plane == "aiohttp":
            assert status == 417 and headers["connection"] == "close"
            assert orjson.loads(body)["error"]["code"] == "expectation_failed"
            assert backend.received == []
        else:
            assert status == 200 and [rec.body for rec in backend.received] == [CHAT]
        assert counted == 1
    finally:
        await handle.close()


async def test_a_field_repeated_in_another_case_reaches_the_engine_whole(backend, data_plane):
    """``X-Custom: a`` then ``x-custom: b`` is one field with two lines; both planes send
    both (aiohttp's client kept only the last when the spelling differed)."""
    handle = await _plane_router(backend, data_plane)
    try:
        for version in (b"1.1", b"1.0"):  # (an HTTP/1.0 request goes through aiohttp on the fast plane too)
            reader, writer = await _connect(handle)
            writer.write(b"POST /v1/chat/completions HTTP/%s\r\nHost: r\r\nX-Custom: a\r\nx-custom: b\r\n"
                         b"X-CUSTOM: c\r\nContent-Length: %d\r\n\r\n" % (version, len(CHAT)) + CHAT)
            status, _, _ = await asyncio.wait_for(_read_response(reader), 5)
            writer.close()
            assert status == 200
        assert [rec.headers.getall("X-Custom") for rec in backend.received] == [["a", "b", "c"]] * 2
    finally:
        await handle.close()


async def test_metrics_of_answers_written_whole_are_recorded_a_moment_later(backend, monkeypatch):
    """An answer written by callbacks alone has its metrics recorded a moment later
    (ACCOUNTING_DELAY_S, together with those of the answers written meanwhile), and in
    any case before ``/metrics`` is rendered and by ``close``: none is lost, and each is
    recorded once."""
    from prefixroute.server import dataplane

    monkeypatch.setattr(dataplane, "ACCOUNTING_DELAY_S", 30.0)  # no timer in the way, until it is tested
    handle = await start_router(
        FleetConfig.single([backend.url], RoutingConfig.build("prefix-aware", 1024, 64)),
        ServerSettings(port=0, admin_port=0, health_check_interval_s=0, metrics_scrape_interval_s=0,
                       shutdown_timeout_s=1.0, seed=1))
    front = handle._front
    registry = handle.state.metrics.registry
    labels = {"endpoint": "default", "variant": "AllTraffic"}

    def recorded() -> tuple[float | None, ...]:  # read without render(): what was recorded so far
        return (registry.get_sample_value("prefixroute_responses_total", {**labels, "code": "200"}),
                registry.get_sample_value("prefixroute_request_duration_seconds_count", labels),
                registry.get_sample_value("prefixroute_ttft_seconds_count", labels),
                registry.get_sample_value("prefixroute_router_overhead_seconds_count", labels),
                registry.get_sample_value("prefixroute_routing_decision_seconds_count", labels))

    async def settled(n: int) -> None:
        for _ in range(500):
            if len(front._unaccounted) == n:
                return
            await asyncio.sleep(0.001)
        raise AssertionError(f"{len(front._unaccounted)} answers left unaccounted, not {n}")

    async def chat(http: aiohttp.ClientSession) -> None:
        async with http.post(handle.url + "/v1/chat/completions", data=CHAT) as r:
            assert r.status == 200
            await r.read()

    try:
        async with aiohttp.ClientSession() as http:
            await chat(http)  # (the task answers it: it connects)
            assert recorded() == (1.0,) * 5
            for n in range(1, 5):  # over the pooled connection: answered by callbacks
                await chat(http)
                await settled(n)
                assert recorded() == (1.0,) * 5  # settled, not recorded yet
            text = handle.state.metrics.render().decode()  # /metrics records them first
            assert 'prefixroute_responses_total{code="200",endpoint="default",variant="AllTraffic"} 5.0' in text
            assert recorded() == (5.0,) * 5 and front._unaccounted == []
            # The timer records them, a moment after the first.
            front._accounting.cancel()
            front._accounting = None
            monkeypatch.setattr(dataplane, "ACCOUNTING_DELAY_S", 0.02)
            await chat(http)
            await chat(http)
            await asyncio.sleep(0.2)
            assert recorded() == (7.0,) * 5 and front._unaccounted == [] and front._accounting is None
            monkeypatch.setattr(dataplane, "ACCOUNTING_DELAY_S", 30.0)
            await chat(http)
            await settled(1)
    finally:
        await handle.close()
    assert recorded() == (8.0,) * 5  # close() recorded the last one
    assert handle.state.metrics.pending == []


async def test_with_several_workers_metrics_of_whole_answers_are_recorded_at_once(backend, monkeypatch):
    """With ``--workers N`` a scrape is answered by one worker, which cannot record the
    others' pending metrics: each answer's are recorded as it is settled."""
    from prefixroute.server import dataplane

    monkeypatch.setattr(dataplane, "ACCOUNTING_DELAY_S", 30.0)  # (a timer would not record them)
    handle = await start_router(
        FleetConfig.single([backend.url], RoutingConfig.build("prefix-aware", 1024, 64)),
        ServerSettings(port=0, admin_port=0, health_check_interval_s=0, metrics_scrape_interval_s=0,
                       shutdown_timeout_s=1.0, seed=1))
    handle.state.metrics.multiprocess = True  # (what RouterMetrics(multiprocess_dir=...) says)
    registry = handle.state.metrics.registry
    labels = {"endpoint": "default", "variant": "AllTraffic", "code": "200"}
    try:
        async with aiohttp.ClientSession() as http:
            for n in range(1, 5):
                async with http.post(handle.url + "/v1/chat/completions", data=CHAT) as r:
                    assert r.status == 200
                    await r.read()
                for _ in range(500):
                    if registry.get_sample_value("prefixroute_responses_total", labels) == n:
                        break
                    await asyncio.sleep(0.001)
                assert registry.get_sample_value("prefixroute_responses_total", labels) == n
                assert handle._front._unaccounted == [] and handle._front._accounting is None
    finally:
        await handle.close()


@pytest.mark.parametrize("field", ["Host", "Content-Type", "host"])
async def test_a_repeated_singleton_field_is_a_400_on_both_planes_and_the_refusal_is_logged(backend, data_plane,
                                                                                           caplog, field):
    """Two ``Host`` lines (or any RFC 9110 singleton twice, in any spelling): 400 naming
    the field, nothing forwarded, and an INFO line says the router refused it (never the
    request's text)."""
    caplog.set_level(logging.INFO)
    handle = await _plane_router(backend, data_plane)
    try:
        reader, writer = await _connect(handle)
        writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: r\r\nContent-Type: application/json\r\n"
                     b"%s: again\r\nContent-Length: %d\r\n\r\n" % (field.encode(), len(CHAT)) + CHAT)
        status, _, body = await asyncio.wait_for(_read_response(reader), 5)
        writer.close()
        named = "Content-Type" if field == "Content-Type" else "Host"
        assert status == 400 and f"Duplicate '{named}' header found." in body.decode()
        assert backend.received == []
        lines = [rec.getMessage() for rec in caplog.records if rec.levelno == logging.INFO and "refused" in
                 rec.getMessage()]
        assert any(f"Duplicate '{named}' header found." in m or "400 BadHttpMessage" in m for m in lines), lines
        assert not any(CHAT.decode() in m for m in lines)
    finally:
        await handle.close()


async def test_every_refusal_of_the_router_is_logged_at_info_within_a_budget(backend, data_plane, caplog,
                                                                             monkeypatch):
    """413, 404 and a bad body are logged as they are answered, one INFO line each; past
    REFUSALS_LOGGED_PER_S in one second the rest are counted into the next line."""
    from prefixroute.server import observe

    caplog.set_level(logging.INFO, logger="prefixroute.server")
    handle = await _plane_router(backend, data_plane, max_body_bytes=1000)
    try:
        async with aiohttp.ClientSession() as http:
            async with http.post(handle.url + "/v1/chat/completions", data=b"x" * 2000) as r:
                assert r.status == 413
            async with http.post(handle.url + "/endpoints/nope/invocations", data=b"{}") as r:
                assert r.status == 404
            async with http.post(handle.url + "/v1/chat/completions", data=b'{"messages": 3}') as r:
                assert r.status == 400
        lines = [rec.getMessage() for rec in caplog.records if rec.getMessage().startswith("refused")]
        assert [m.split(": ", 1)[1][:3] for m in lines] == ["413", "404", "400"], lines
        assert "endpoint 'nope' not found" in lines[1] and "variant AllTraffic" in lines[0]
        caplog.clear()
        obs = handle.state.observers
        now = [1000.5]
        monkeypatch.setattr(observe, "_clock", lambda: now[0])
        for _ in range(observe.REFUSALS_LOGGED_PER_S + 5):
            obs.refused("default", "AllTraffic", 429, "limit", "r", 0.0, 0.0)
        now[0] += 1  # the next second
        obs.refused("default", "AllTraffic", 429, "limit", "r", 0.0, 0.0)
        lines = [rec.getMessage() for rec in caplog.records if rec.getMessage().startswith("refused")]
        assert len(lines) == observe.REFUSALS_LOGGED_PER_S + 1
        assert lines[-1].endswith("; 5 more lines not logged before it")
    finally:
        await handle.close()


async def test_a_connection_pooled_moments_ago_is_reused_without_a_system_call_and_an_older_one_is_checked():
    """A pooled connection idle for less than PEER_CHECK_AFTER_S is taken without asking
    the kernel whether the instance closed it (a close racing the send is sent again:
    ``stale_connection``); one idle for longer is checked with ``poll``, so a close the
    event loop has not read yet is seen and the connection is not used; so is every one
    of a pool that checks from 0 s (the data plane's with --max-retries 0, tested below)."""
    import socket

    from prefixroute.server.upstream import PEER_CHECK_AFTER_S, _UpstreamPool

    loop = asyncio.get_running_loop()
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    pool = _UpstreamPool(loop, 8, 10.0)
    never_retried = _UpstreamPool(loop, 8, 10.0, 0.0)  # (--max-retries 0: every connection checked)
    target = ("engine", "127.0.0.1", port)
    try:
        for pool, idle_s, reused in ((pool, 0.0, True), (pool, PEER_CHECK_AFTER_S + 0.05, False),
                                     (never_retried, 0.0, False)):
            conn = await pool.connect(target, 2.0)
            server_side, _ = listener.accept()
            pool.put(conn)
            conn.idle_since = loop.time() - idle_s
            server_side.close()  # the instance closes it; the loop has not run since
            time.sleep(0.02)  # (not awaited: the FIN arrives, unread by the loop)
            assert not conn.transport_closing() and conn.peer_gone()
            taken = pool.take(target)
            assert (taken is conn) is reused, idle_s
            if not reused:
                assert taken is None and conn.transport_closing()
            conn.abort()
    finally:
        listener.close()
        await asyncio.sleep(0)


@pytest.mark.parametrize("retries, checked_from", [(0, 0.0), (2, None)])
async def test_the_data_plane_checks_every_pooled_connection_when_it_may_not_retry(backend, retries, checked_from):
    """With --max-retries 0 no close racing a send could be sent again, so the fast data
    plane checks every pooled connection before reuse, however recently it was pooled."""
    from prefixroute.server.upstream import PEER_CHECK_AFTER_S

    handle = await start_router(FleetConfig.single([backend.url], RoutingConfig()),
                                ServerSettings(host="127.0.0.1", port=0, health_check_interval_s=0,
                                               shutdown_timeout_s=1.0, seed=1, max_retries=retries))
    try:
        front = handle._front
        assert front is not None
        assert front.upstreams.peer_check_after_s == (PEER_CHECK_AFTER_S if checked_from is None else checked_from)
        assert front.internal_pool.peer_check_after_s == 0.0
    finally:
        await handle.close()
