"""The overhead benchmark's parts on real processes: the fast backend's answers (the
``openai`` client, SSE framing, chunked and pipelined request bodies), the wrk script
cycling through its bodies (as the backend saw them), and one measurement through
``prefixroute serve``.

wrk is the benchmark's load generator (Debian package ``wrk``); the tests that drive
load fail, with how to install it, when it is missing.
"""

from __future__ import annotations

import asyncio
import json
import socket
import sys
from pathlib import Path

import aiohttp
import openai
import pytest
import urllib.request

import xxhash

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import backend_launch  # noqa: E402  (bench/ is a folder of scripts, not a package)
import fast_backend  # noqa: E402
import overhead  # noqa: E402
import overhead_report  # noqa: E402
import overhead_results  # noqa: E402
import overhead_settings  # noqa: E402
import overhead_streams  # noqa: E402
import peer_process  # noqa: E402
import proc_stats  # noqa: E402
import wrk_load  # noqa: E402

EVENTS = 8


def _wrk() -> str:
    exe = wrk_load.find_wrk()
    if exe is None:
        pytest.fail("wrk is not installed: `apt-get install -y wrk` (the overhead benchmark's load generator)")
    return exe


@pytest.fixture(scope="module")
def tracker():
    with peer_process.ProcessTracker() as t:
        yield t


@pytest.fixture(scope="module")
def backend(tracker):
    return backend_launch.start_fast_backend(tracker, 2, stream_events=EVENTS, record_bodies=True)


@pytest.fixture(scope="module")
def script(tracker):
    p = tracker.path("bodies", ".lua")
    p.write_text(wrk_load.WRK_SCRIPT)
    return p


def _exchange(url: str, raw: bytes, responses: int) -> list[tuple[bytes, bytes]]:
    """Send ``raw`` on one connection and read ``responses`` responses (head, body),
    bodies by Content-Length or chunked."""
    host, port = url.removeprefix("http://").split(":")
    out = []
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(raw)
        buf = b""

        def fill(n_min: int) -> None:
            nonlocal buf
            while len(buf) < n_min:
                d = s.recv(65536)
                assert d, "connection closed early"
                buf += d

        for _ in range(responses):
            while b"\r\n\r\n" not in buf:
                fill(len(buf) + 1)
            head, buf = buf.split(b"\r\n\r\n", 1)
            if b"transfer-encoding: chunked" in head.lower():
                body = b""
                while True:
                    while b"\r\n" not in buf:
                        fill(len(buf) + 1)
                    line, buf = buf.split(b"\r\n", 1)
                    size = int(line, 16)
                    fill(size + 2)
                    body, buf = body + buf[:size], buf[size + 2:]
                    if size == 0:
                        break
            else:
                n = int(next(ln for ln in head.split(b"\r\n") if ln.lower().startswith(b"content-length")).split(
                    b":")[1])
                fill(n)
                body, buf = buf[:n], buf[n:]
            out.append((head, body))
    return out


# -- the fast backend -----------------------------------------------------------------------------


def test_fast_backend_answers_the_openai_client_on_every_port(backend):
    for url in backend.urls:
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=10)
        chat = client.chat.completions.create(model=fast_backend.MODEL,
                                              messages=[{"role": "user", "content": "hello"}])
        assert chat.object == "chat.completion" and chat.model == fast_backend.MODEL
        assert chat.choices[0].message.role == "assistant"
        assert chat.choices[0].message.content == " ".join(["token"] * 16)
        assert chat.choices[0].finish_reason == "stop" and chat.usage.completion_tokens == 16
        comp = client.completions.create(model=fast_backend.MODEL, prompt="hello")
        assert comp.object == "text_completion" and comp.choices[0].text == " ".join(["token"] * 16)
        chunks = list(client.chat.completions.create(model=fast_backend.MODEL, stream=True,
                                                     messages=[{"role": "user", "content": "hello"}]))
        assert len(chunks) == EVENTS
        assert "".join(c.choices[0].delta.content for c in chunks) == "token " * EVENTS
        assert [c.choices[0].finish_reason for c in chunks] == [None] * (EVENTS - 1) + ["stop"]
        texts = [c.choices[0].text for c in client.completions.create(model=fast_backend.MODEL, prompt="hi",
                                                                        stream=True)]
        assert texts == ["token "] * EVENTS
        assert [m.id for m in client.models.list()] == [fast_backend.MODEL]


async def test_fast_backend_streams_each_event_as_its_own_http_chunk(backend):
    async with aiohttp.ClientSession() as http:
        async with http.post(backend.urls[0] + "/v1/chat/completions", data=b'{"stream":true}',
                             headers={"Content-Type": "application/json"}) as resp:
            assert resp.status == 200
            assert resp.headers["Content-Type"] == "text/event-stream"
            assert resp.headers["Transfer-Encoding"] == "chunked"
            http_chunks, current = [], b""
            async for data, end_of_http_chunk in resp.content.iter_chunks():
                current += data
                if end_of_http_chunk:
                    http_chunks.append(current)
                    current = b""
    assert current == b""
    assert len(http_chunks) == EVENTS + 1
    for ev in http_chunks[:-1]:
        assert ev.startswith(b"data: {") and ev.endswith(b"\n\n")
        assert json.loads(ev[6:])["object"] == "chat.completion.chunk"
    assert http_chunks[-1] == b"data: [DONE]\n\n"


def test_fast_backend_reads_chunked_and_pipelined_bodies_on_one_connection(backend):
    body = b'{"model": "m", "messages": [{"role": "user", "content": "chunked"}], "stream" :\n true}'
    parts = [body[:7], body[7:40], body[40:]]  # the stream flag is cut across chunks
    chunked = b"".join(b"%x;ext=1\r\n%s\r\n" % (len(p), p) for p in parts) + b"0\r\nX-Trailer: 1\r\n\r\n"
    plain = b'{"messages": [], "stream": false, "note": "\\"stream\\": true"}'
    before = backend.stats()
    raw = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n"
           b"Content-Type: application/json\r\n\r\n" + chunked
           + b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(plain) + plain
           + b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"
           + b"GET /nowhere HTTP/1.1\r\nHost: x\r\n\r\n")
    (h1, b1), (h2, b2), (h3, b3), (h4, b4) = _exchange(backend.urls[1], raw, 4)
    assert h1.startswith(b"HTTP/1.1 200") and b"text/event-stream" in h1
    assert b1.count(b"data: {") == EVENTS and b1.endswith(b"data: [DONE]\n\n")
    assert h2.startswith(b"HTTP/1.1 200") and json.loads(b2)["object"] == "text_completion"
    assert h3.startswith(b"HTTP/1.1 200") and b3 == b""
    assert h4.startswith(b"HTTP/1.1 404") and "no route" in json.loads(b4)["error"]["message"]
    after = backend.stats()
    digest = xxhash.xxh3_64_hexdigest(body)
    assert after["bodies"].get(digest, 0) - before["bodies"].get(digest, 0) == 1  # de-chunked exactly
    assert after["requests"] - before["requests"] == 2
    port = backend.urls[1].rsplit(":", 1)[1]
    assert after["by_port"][port] - before["by_port"].get(port, 0) == 2
    assert after["unknown"]["GET /nowhere"] - before["unknown"].get("GET /nowhere", 0) == 1


def test_fast_backend_get_routes(backend):
    import urllib.request

    def get(path: str) -> tuple[int, bytes]:
        with urllib.request.urlopen(backend.urls[0] + path, timeout=5) as r:
            return r.status, r.read()

    assert get("/health") == (200, b"") and get("/ping") == (200, b"")
    status, models = get("/v1/models")
    assert status == 200 and json.loads(models)["data"][0]["id"] == fast_backend.MODEL
    status, metrics = get("/metrics")
    assert status == 200 and b"# TYPE fast_backend_requests_total counter" in metrics
    for path in ("/info", "/get_server_info", "/server_info", "/get_model_info", "/model_info"):
        status, info = get(path)
        assert status == 200 and json.loads(info)["model_path"] == fast_backend.MODEL


def test_wants_stream_finds_the_stream_key_not_the_word():
    yes = [b'{"stream": true}', b'{"stream":true}', b'{"a": 1, "stream" :\n  true }',
           b'{"stream": false, "x": {"stream": true}}']
    no = [b'{"stream": false}', b'{"content": "say \\"stream\\": true"}', b'{"messages": []}', b'{"stream": "true"}',
          b'{"stream_options": {"include_usage": true}}']
    assert all(fast_backend.wants_stream(b) for b in yes)
    assert not any(fast_backend.wants_stream(b) for b in no)
    assert not fast_backend.wants_stream(b'xx{"stream": true}', 0, 10)  # only the given range counts


# -- request bodies and wrk -------------------------------------------------------------------------


def test_bodies_are_exact_in_size_distinct_from_the_first_prompt_byte_and_valid():
    for size in (1024, 32 * 1024):
        for stream in (False, True):
            bodies = overhead_settings.make_bodies(size, stream, 16, seed=1)
            assert [len(b) for b in bodies] == [size] * 16
            docs = [json.loads(b) for b in bodies]
            assert all(d["stream"] is stream and d["model"] == fast_backend.MODEL for d in docs)
            assert fast_backend.wants_stream(bodies[0]) is stream
            firsts = {d["messages"][0]["content"][:16] for d in docs}
            assert len(firsts) == 16  # HAProxy's and PREFIX_AWARE's keys differ for every body
    assert overhead_settings.make_bodies(1024, True, 4, seed=3) == overhead_settings.make_bodies(1024, True, 4, seed=3)
    with pytest.raises(ValueError, match="cannot hold"):
        overhead_settings.make_bodies(100, False, 1)
    assert [overhead_settings.parse_size(x) for x in ("1K", "32KB", "256k", "1m", "1000")] == [
        1024, 32768, 262144, 1048576, 1000]


def test_wrk_script_cycles_through_every_body(tracker, backend, script):
    wrk = _wrk()
    bodies = overhead_settings.make_bodies(1024, False, 16, seed=7)
    files = overhead_settings.write_bodies(tracker.workdir / "cycle", bodies, "cycle")
    digests = [xxhash.xxh3_64_hexdigest(b) for b in bodies]
    before = backend.stats()
    result = wrk_load.run_wrk(tracker, backend.urls[0] + "/v1/chat/completions", files, 1, 1, wrk=wrk,
                              script=script)
    after = backend.stats()
    counts = [after["bodies"].get(d, 0) - before["bodies"].get(d, 0) for d in digests]
    assert result.error_count == 0 and result.requests > 100
    # One connection sends body 1, 2, ..., 16, 1, 2...: every body, evenly, nothing else.
    assert min(counts) >= 1 and max(counts) - min(counts) <= 1
    assert result.requests <= sum(counts) <= result.requests + 1  # + the one cut off at the end
    assert after["requests"] - before["requests"] == sum(counts)


def test_parse_wrk_output_needs_the_summary_line():
    with pytest.raises(ValueError, match="no summary"):
        wrk_load.parse_wrk_output("unable to connect to 127.0.0.1:1 Connection refused\n")


# -- one measurement through prefixroute ---------------------------------------------------------------


def test_measure_direct_and_through_prefixroute(tracker, backend, script):
    wrk = _wrk()
    spec = next(r for r in overhead.router_specs(overhead_settings.FULL) if r.label == "prefixroute CACHE_AWARE")
    router = spec.start(tracker, backend.urls)
    cell = overhead_settings.Cell(1, 1024, False)
    files = overhead_settings.write_bodies(tracker.workdir / "measure", overhead_settings.make_bodies(1024, False, 16),
                                           "m")
    direct = overhead.Target(overhead_results.DIRECT, "none", "direct", backend.urls[0], None)
    target = overhead.Target(spec.label, spec.router, spec.strategy, router.url, router.process.proc.pid)
    ms = [overhead.measure(tracker, t, cell, files, 1, backend=backend, wrk=wrk, script=script)
          for t in (direct, target)]
    d, m = ms
    for x in ms:
        assert x.wrk.error_count == 0
        assert x.wrk.requests > 50 and x.wrk.rps > 50
        assert 0 < x.wrk.p50_ms <= x.wrk.p99_ms
        assert x.backend_requests >= x.wrk.requests
    assert d.router_cpu_s is None and d.router_peak_rss_bytes is None
    assert d.instance_requests[1] == 0  # direct goes to the first port only
    assert m.router_cpu_s > 0 and m.router_cpu_us_per_request > 0
    assert m.router_peak_rss_bytes > 10 * 2**20 and m.peak_rss_reset
    assert sum(m.instance_requests) == m.backend_requests  # every request reached an instance...
    assert min(m.instance_requests) > 0  # ...and CACHE_AWARE spread the 16 prompts over both
    assert m.backend_unknown == {}  # prefixroute sends nothing but the requests themselves
    [rd, rm] = overhead_results.aggregate(ms, [direct, target])
    assert rd.added_p50_ms is None and rm.added_p50_ms == pytest.approx(m.wrk.p50_ms - d.wrk.p50_ms)
    run = rm.to_json()
    assert run["router"] == "prefixroute" and run["strategy"] == "CACHE_AWARE" and run["errors"] == 0
    assert run["throughput_rps"] > 0 and sum(run["instance_share"]) == pytest.approx(1.0)
    tracker.stop([router.process])


def test_the_relay_floor_relays_whole_and_streamed_answers_round_robin(tracker, backend, script):
    wrk = _wrk()
    spec = next(r for r in overhead.router_specs(overhead_settings.FULL) if r.label == overhead.RELAY_FLOOR_LABEL)
    assert spec.peer == ""  # nothing to install: it runs on prefixroute's own dependencies
    router = spec.start(tracker, backend.urls)
    target = overhead.Target(spec.label, spec.router, spec.strategy, router.url, router.process.proc.pid)
    for stream in (False, True):
        cell = overhead_settings.Cell(2, 32768, stream)
        files = overhead_settings.write_bodies(tracker.workdir / f"floor-{stream}",
                                               overhead_settings.make_bodies(32768, stream, 16), f"floor-{stream}")
        m = overhead.measure(tracker, target, cell, files, 1, backend=backend, wrk=wrk, script=script)
        assert m.wrk.error_count == 0 and m.wrk.requests > 50
        assert sum(m.instance_requests) == m.backend_requests >= m.wrk.requests
        assert max(m.instance_requests) - min(m.instance_requests) <= 2  # round robin over the instances
        assert m.backend_unknown == {}
    # The answers arrive whole: a stream ends with its last chunk, a JSON answer with its body.
    import socket
    import os
    import subprocess
    import sys
    import urllib.request

    for stream, end in ((False, b"}"), (True, b"data: [DONE]\n\n")):
        body = overhead_settings.make_bodies(1024, stream, 1)[0]
        req = urllib.request.Request(router.url + "/v1/chat/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=10) as r:
            assert r.status == 200 and r.read().rstrip(b"\n").endswith(end.rstrip(b"\n"))
    # A request that asks to upgrade the connection (not handled): the connection is closed,
    # and the relay goes on serving.
    host, port = router.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nConnection: Upgrade\r\nUpgrade: h2c\r\n"
                  b"Content-Length: 2\r\n\r\n{}")
        while s.recv(65536):
            pass  # until the relay closes it
    req = urllib.request.Request(router.url + "/v1/chat/completions",
                                 data=overhead_settings.make_bodies(1024, False, 1)[0],
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=10) as r:
        assert r.status == 200
    assert router.process.proc.poll() is None
    tracker.stop([router.process])
    for bad in ("nonsense", "127.0.0.1:9", "https://127.0.0.1:9", "http://127.0.0.1"):
        proc = subprocess.run([sys.executable, str(overhead.RELAY_FLOOR), "--backend", bad], capture_output=True,
                              text=True, timeout=60)
        assert proc.returncode == 2 and "expected http://HOST:PORT" in proc.stderr


def _measured(label: str, rnd: int, p50_ms: float, rps: float) -> "overhead_results.Measurement":
    wrk = wrk_load.WrkResult(requests=int(rps), duration_s=1.0, p50_ms=p50_ms, p90_ms=p50_ms, p99_ms=2 * p50_ms,
                             mean_ms=p50_ms, max_ms=3 * p50_ms, errors={}, bytes=0)
    return overhead_results.Measurement(label, rnd, overhead_settings.Cell(1, 32768, False), wrk, None, None, False,
                                        0.0, [int(rps)], int(rps), {})


def test_ratios_are_given_of_the_medians_and_round_by_round():
    targets = [overhead.Target(label, label, "", "", None) for label in
               (overhead_results.DIRECT, "router", overhead_results.LATENCY_REFERENCE,
                overhead_results.THROUGHPUT_REFERENCE)]
    # (p50 ms, req/s) per round: direct, router, HAProxy, sglang-router
    rounds = [((0.20, 5000), (0.50, 1800), (0.35, 2600), (0.80, 1400)),
              ((0.20, 5000), (0.52, 1600), (0.50, 1700), (0.80, 1100)),
              ((0.20, 5000), (0.47, 1900), (0.49, 1500), (0.70, 1050))]
    ms = [_measured(t.label, rnd, p50, rps) for rnd, row in enumerate(rounds, 1) for t, (p50, rps) in zip(targets, row)]
    results = {r.target.label: r for r in overhead_results.aggregate(ms, targets)}
    router = results["router"]
    assert router.added_p50_by_round == pytest.approx({1: 0.30, 2: 0.32, 3: 0.27})
    assert router.added_p50_ms == pytest.approx(0.30)  # the median of the rounds
    assert router.added_vs_haproxy == pytest.approx(0.30 / 0.29)  # of the medians: HAProxy's is +0.29
    assert router.added_vs_haproxy_rounds == pytest.approx([0.30 / 0.15, 0.32 / 0.30, 0.27 / 0.29])
    assert router.rps_vs_sglang == pytest.approx(1800 / 1100)
    assert router.rps_vs_sglang_rounds == pytest.approx([1800 / 1400, 1600 / 1100, 1900 / 1050])
    run = router.to_json()
    assert run["added_p50_vs_haproxy_rounds"] == pytest.approx(router.added_vs_haproxy_rounds)
    assert run["throughput_vs_sglang_router_rounds"] == pytest.approx(router.rps_vs_sglang_rounds)
    assert results[overhead_results.DIRECT].added_vs_haproxy_rounds == []  # direct adds nothing
    # A round in which HAProxy added nothing (or less than nothing) gives no ratio.
    ms[2 * 4 + 2] = _measured(overhead_results.LATENCY_REFERENCE, 3, 0.19, 1500)
    router = {r.target.label: r for r in overhead_results.aggregate(ms, targets)}["router"]
    first, second, third = router.added_vs_haproxy_rounds  # one entry per round, in order
    assert (first, second, third) == (pytest.approx(0.30 / 0.15), pytest.approx(0.32 / 0.30), None)
    assert overhead_report._ratio(1.03, [2.0, 1.07], ".1f") == "1.0 (1.1-2.0)"
    assert overhead_report._ratio(1.5, [0.5, None, 0.6], ".1f") == "1.5 (0.5-0.6 in 2 of 3)"
    assert overhead_report._ratio(1.03, [1.03], ".1f") == "1.0" and overhead_report._ratio(None, [], ".1f") == "-"
    assert overhead_report._ratio(1.2, [None, None], ".1f") == "1.2"


def test_each_round_turns_the_routers_order_and_pairs_direct_with_each_at_low_concurrency():
    targets = [overhead.Target(label, label, "", "", None) for label in (overhead_results.DIRECT, "a", "b", "c")]
    order = lambda rnd, paired: [(t.label, pair) for t, pair in overhead.run_order(targets, rnd, paired)]  # noqa: E731
    assert order(1, False) == [("direct", None), ("a", None), ("b", None), ("c", None)]
    assert order(2, False) == [("direct", None), ("b", None), ("c", None), ("a", None)]
    assert order(4, False) == order(1, False)
    assert order(3, True) == [("direct", "c"), ("c", None), ("direct", "a"), ("a", None), ("direct", "b"),
                              ("b", None)]
    assert order(1, True)[:2] == [("direct", "a"), ("a", None)]
    assert overhead.run_order(targets[:1], 1, True) == [(targets[0], None)]  # direct alone: measured once


def test_a_router_is_measured_against_the_direct_run_right_before_it():
    targets = [overhead.Target(label, label, "", "", None) for label in
               (overhead_results.DIRECT, "router", overhead_results.LATENCY_REFERENCE)]
    ms = []
    # One round: the machine slows down between the two pairs (direct 0.20 -> 0.30).
    for label, p50, pair in ((overhead_results.DIRECT, 0.20, "router"), ("router", 0.45, None),
                             (overhead_results.DIRECT, 0.30, overhead_results.LATENCY_REFERENCE),
                             (overhead_results.LATENCY_REFERENCE, 0.42, None)):
        ms.append(_measured(label, 1, p50, 1000))
        ms[-1].paired_with = pair
    results = {r.target.label: r for r in overhead_results.aggregate(ms, targets)}
    assert results["router"].added_p50_ms == pytest.approx(0.25)
    assert results[overhead_results.LATENCY_REFERENCE].added_p50_ms == pytest.approx(0.12)
    assert results["router"].added_vs_haproxy == pytest.approx(0.25 / 0.12)
    assert results[overhead_results.DIRECT].p50_ms == pytest.approx(0.25)  # both direct runs, their median
    sglang = overhead.Target(overhead_results.THROUGHPUT_REFERENCE, "", "", "", None)
    with_sglang = [*ms, _measured(overhead_results.THROUGHPUT_REFERENCE, 1, 0.5, 500)]
    # Both direct runs did 1,000 req/s: one ratio for their round, not one per run.
    direct = {r.target.label: r
              for r in overhead_results.aggregate(with_sglang, [*targets, sglang])}[overhead_results.DIRECT]
    assert direct.rps_vs_sglang_rounds == pytest.approx([2.0])
    assert ms[0].to_json()["paired_with"] == "router" and ms[1].to_json()["paired_with"] is None
    run = results[overhead_results.DIRECT].to_json()
    assert (run["rounds"], run["runs"], run["rounds_without_reply"]) == (1, 2, 0)
    # A paired direct run that failed (never recorded): the router is taken against the
    # round's other direct run rather than losing its round.
    lost = {r.target.label: r for r in overhead_results.aggregate([ms[1], ms[2], ms[3]], targets)}
    assert lost["router"].added_p50_by_round == pytest.approx({1: 0.15})
    assert overhead_results._median_run([]) is None
    assert overhead_results._median_run([ms[2], ms[0]]) is ms[0]  # of two, the lower
    # Without pairs (a cell of higher concurrency), every router against its round's direct.
    for m in ms:
        m.paired_with = None
    unpaired = [ms[0], ms[1], ms[3]]
    results = {r.target.label: r for r in overhead_results.aggregate(unpaired, targets)}
    assert results[overhead_results.LATENCY_REFERENCE].added_p50_ms == pytest.approx(0.22)


def test_settings_from_flags():
    q = overhead.settings_from(overhead.parse_args(["--quick"]))
    assert q == overhead_settings.QUICK and q.concurrency == (1, 64) and q.body_sizes == (32768,)
    s = overhead.settings_from(overhead.parse_args(["--concurrency", "2,4", "--body-sizes", "1K,2K", "--modes",
                                                    "stream", "--duration", "3", "--rounds", "2", "--streams", "0"]))
    assert (s.concurrency, s.body_sizes, s.streaming, s.duration_s, s.rounds, s.streams) == (
        (2, 4), (1024, 2048), (True,), 3, 2, 0)
    assert overhead.settings_from(overhead.parse_args([])) == overhead_settings.FULL
    assert overhead_settings.FULL.paired_direct_up_to == 1
    assert overhead.settings_from(overhead.parse_args(["--paired-direct-up-to", "8"])).paired_direct_up_to == 8
    with pytest.raises(SystemExit):
        overhead.settings_from(overhead.parse_args(["--paired-direct-up-to", "-1"]))
    with pytest.raises(SystemExit):
        overhead.select_routers(overhead.router_specs(overhead_settings.FULL), "no-such-router")
    with pytest.raises(SystemExit, match="cannot hold a chat request"):  # a clean error, not a traceback
        overhead.settings_from(overhead.parse_args(["--body-sizes", "1K,200"]))
    assert overhead.settings_from(overhead.parse_args(["--backend-port", "0"])).backend_port == 0
    assert overhead.settings_from(overhead.parse_args(["--backend-port", "20000"])).backend_port == 20000
    for bad in ("-1", "65533", "70000"):  # 4 consecutive ports must exist
        with pytest.raises(SystemExit, match="--backend-port must be 0"):
            overhead.settings_from(overhead.parse_args(["--backend-port", bad]))
    labels = [r.label for r in overhead.select_routers(overhead.router_specs(overhead_settings.FULL), "prefixroute")]
    assert labels == ["prefixroute RANDOM", "prefixroute LEAST_OUTSTANDING", "prefixroute PREFIX_AWARE",
                      "prefixroute CACHE_AWARE", "prefixroute PREFIX_AWARE --data-plane aiohttp",
                      "prefixroute CACHE_AWARE --workers 2"]
    specs = overhead.router_specs(overhead_settings.FULL)
    assert [r.label for r in overhead.select_routers(specs, "python-relay-floor")] == [overhead.RELAY_FLOOR_LABEL]


def test_the_fast_backend_listens_on_fixed_ports_unless_one_is_taken(tracker):
    # Fixed ports give the instances the same URLs in every run (the bodies' rendezvous
    # placement depends on them); a port in use falls back to free ports, said so.
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        first = probe.getsockname()[1]
    if not backend_launch.ports_free(first, 2):
        first = 23456
    assert backend_launch.ports_free(first, 2)
    said: list[str] = []
    fixed = backend_launch.start_fast_backend(tracker, 2, first_port=first, log=said.append)
    assert fixed.urls == [f"http://127.0.0.1:{first}", f"http://127.0.0.1:{first + 1}"] and said == []
    assert not backend_launch.ports_free(first, 2)  # (they are taken now)
    moved = backend_launch.start_fast_backend(tracker, 2, first_port=first, log=said.append)
    assert not set(moved.urls) & set(fixed.urls) and len(moved.urls) == 2
    assert said == [f"note: ports {first}-{first + 1} are not all free: the fast backend listens on free ports, so "
                    "the test bodies' placement over the instances differs from other runs"]
    # A port taken between the check and the start (the check said free): the backend
    # that could not listen is replaced by one on free ports, said so.
    said.clear()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(backend_launch, "ports_free", lambda first, count: True)
        raced = backend_launch.start_fast_backend(tracker, 2, first_port=first, log=said.append)
    assert not set(raced.urls) & set(fixed.urls) and len(raced.urls) == 2
    assert said == [f"note: the fast backend could not listen on ports {first}-{first + 1}: the fast backend listens "
                    "on free ports, so the test bodies' placement over the instances differs from other runs"]
    # Any other early exit is not blamed on the ports: its own error, no second start.
    said.clear()
    other = next(p for p in range(first + 2, 65534) if backend_launch.ports_free(p, 2))
    with pytest.raises(peer_process.PeerError, match="stream-chunks"):
        backend_launch.start_fast_backend(tracker, 2, first_port=other, stream_events=0, log=said.append)
    assert said == []
    with pytest.raises(ValueError, match="0-65535"):
        backend_launch.start_fast_backend(tracker, 2, first_port=-5, log=said.append)
    for b in (fixed, moved, raced):
        assert b.stats()["requests"] == 0  # (answered on its first URL: it listens there)
        b.process.stop()


def test_process_tree_readings_of_this_process():
    import os

    assert proc_stats.process_tree(os.getpid())[0] == os.getpid()
    assert proc_stats.tree_cpu_seconds(os.getpid()) > 0
    assert proc_stats.tree_peak_rss_bytes(os.getpid()) > 10 * 2**20
    assert proc_stats.process_tree(2**22 + 12345) == []


async def test_streams_client_counts_completed_streams(tracker):
    slow = backend_launch.start_fast_backend(tracker, 1, stream_events=3, stream_delay_ms=200)
    res = overhead_streams.StreamsResult("direct", 40)
    bodies = overhead_settings.make_bodies(1024, True, 4)
    await overhead_streams._streams_client(slow.urls[0] + "/v1/chat/completions", bodies, 40, 3, res, connecting=10)
    assert res.errors == {} and res.completed == 40
    assert res.peak_open == 40 == slow.stats()["streams_peak"]  # 3 events 200 ms apart outlast 40 connects
    res2 = overhead_streams.StreamsResult("direct", 5)
    await overhead_streams._streams_client(slow.urls[0] + "/v1/chat/completions", bodies, 5, 4, res2)
    assert res2.completed == 0 and res2.errors == {"3 events instead of 4": 5}
    tracker.stop([slow.process])
    await asyncio.sleep(0)


def test_machine_facts_say_how_idle_cpus_sleep(tmp_path):
    sysfs = {"sys/devices/system/cpu/cpuidle/current_driver": "haltpoll\n",
             "sys/devices/system/cpu/cpuidle/current_governor": "haltpoll\n",
             "sys/module/haltpoll/parameters/guest_halt_poll_ns": "200000\n"}
    for rel, text in sysfs.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    facts = overhead_report.machine_facts(str(tmp_path))
    assert (facts["cpuidle_driver"], facts["cpuidle_governor"], facts["guest_halt_poll_ns"]) == \
        ("haltpoll", "haltpoll", 200_000)
    assert facts["cpus"] >= 1 and facts["platform"]
    bare = overhead_report.machine_facts(str(tmp_path / "none"))  # not Linux, or no cpuidle: unknown, not an error
    assert (bare["cpuidle_driver"], bare["cpuidle_governor"], bare["guest_halt_poll_ns"]) == (None, None, None)


# -- precise mode on the fast backend's stand-in KV events ---------------------------------


def test_the_stand_in_cache_stores_a_prompt_once_then_answer_blocks_and_restores_late():
    import kv_stand_in
    from prefixroute.core.kvevents.events import BlockRemoved, BlockStored
    from prefixroute.core.model_tokenizer import ModelTokenizer

    tok = ModelTokenizer.load("tiny")
    cache = kv_stand_in.PortCache(lambda b, chat: tok.request_token_ids(json.loads(b), chat), restore_s=2.0,
                                  answer_window=2, answers_per_step=2)
    body = overhead_settings.make_bodies(1024, False, 1)[0]
    ids = tok.request_token_ids(json.loads(body), True)
    first = cache.on_request(body, True, 0.0)
    prompt, answer = first
    assert isinstance(prompt, BlockStored) and prompt.parent_block_hash is None
    assert list(prompt.token_ids) == ids[: len(ids) // 16 * 16] and len(prompt.block_hashes) == len(ids) // 16
    assert isinstance(answer, BlockStored) and answer.parent_block_hash == prompt.block_hashes[-1]
    second = cache.on_request(body, True, 1.0)
    assert [type(e) for e in second] == [BlockStored]  # an answer block only: the prompt is held
    assert second[0].parent_block_hash == prompt.block_hashes[-1] and second[0].token_ids != answer.token_ids
    assert cache.on_request(body, True, 1.5) == []  # two answer blocks this step: no more
    cache.step()
    third = cache.on_request(body, True, 1.9)
    assert [type(e) for e in third] == [BlockStored, BlockRemoved]  # past the window: the oldest goes
    assert third[1].block_hashes == [answer.block_hashes[0]]
    cache.step()
    late = cache.on_request(body, True, 2.1)  # restore_s after it was stored: evicted and stored again
    assert isinstance(late[0], BlockRemoved) and list(late[0].block_hashes) == list(prompt.block_hashes)
    assert isinstance(late[1], BlockStored) and list(late[1].token_ids) == list(prompt.token_ids)
    assert not set(late[1].block_hashes) & set(prompt.block_hashes)


def test_precise_prefixroute_routes_on_the_fast_backends_kv_events(tracker, script):
    # The stand-in's events reach a precise router: every instance precise, each body's
    # prompt held where it was sent, and the bodies keep their instances.
    wrk = _wrk()
    kv_backend = backend_launch.start_fast_backend(tracker, 2, kv_events=True, record_bodies=True)
    assert set(kv_backend.kv_endpoints) == set(kv_backend.urls)
    section = kv_backend.kv_events_section()
    assert section["Tokenizer"] == "tiny" and set(section["Instances"]) == set(kv_backend.urls)
    assert overhead.precise_extra_missing() == ""
    spec = next(r for r in overhead.router_specs(overhead_settings.FULL) if r.label == overhead.PRECISE_LABEL)
    from dataclasses import replace

    router = replace(spec, kv_events=section).start(tracker, kv_backend.urls)
    files = overhead_settings.write_bodies(tracker.workdir / "precise", overhead_settings.make_bodies(4096, False, 16),
                                           "p")
    target = overhead.Target(spec.label, spec.router, spec.strategy, router.url, router.process.proc.pid,
                             kv_admin_url=router.admin_url)
    m = overhead.measure(tracker, target, overhead_settings.Cell(8, 4096, False), files, 2, backend=kv_backend, wrk=wrk,
                         script=script)
    assert m.wrk.error_count == 0 and m.wrk.requests > 100
    assert m.precise is not None and m.to_json()["precise"] == m.precise
    assert m.precise["matched_share"] >= 0.9 and m.precise["modes"] == ["precise", "precise"]
    kv = kv_backend.stats()["kv_events"]
    assert kv["untokenizable"] == 0 and kv["bodies_tokenized"] == 16 and kv["events"] > kv["batches"] > 10
    assert min(m.instance_requests) > 0
    with urllib.request.urlopen(router.admin_url + "/admin/kv-events", timeout=10) as r:
        status = json.loads(r.read())
    assert [i["Mode"] for i in status["Instances"]] == ["precise", "precise"]
    assert all(i["Blocks"] > 16 for i in status["Instances"]) and status["ByteIndexBlocks"] > 32
    assert status["Tokenizer"]["ByteMatchedRequests"] >= 0.9 * m.wrk.requests  # (not before the streams were up)
    tracker.stop([router.process, kv_backend.process])


def test_the_precise_router_is_measured_only_when_named():
    specs = overhead.router_specs(overhead_settings.FULL)
    assert overhead.PRECISE_LABEL not in [r.label for r in overhead.select_routers(specs, "")]
    assert overhead.PRECISE_LABEL not in [r.label for r in overhead.select_routers(specs, "prefixroute")]
    named = overhead.select_routers(specs, "prefixroute-cache-aware,prefixroute-cache-aware-precise")
    assert [r.label for r in named] == ["prefixroute CACHE_AWARE", overhead.PRECISE_LABEL]


def test_precise_check_reads_modes_and_the_share_matched_on_events():
    before = {"Instances": [{"Mode": "precise"}], "Tokenizer": {"ByteMatchedRequests": 100}}
    after = {"Instances": [{"Mode": "precise"}, {"Mode": "approximate"}], "Tokenizer": {"ByteMatchedRequests": 280}}
    assert overhead.precise_check(before, after, 200) == {"modes": ["precise", "approximate"], "matched_share": 0.9}
    assert overhead.precise_check(before, None, 200) == {"modes": None, "matched_share": None}
    assert overhead.precise_check(None, after, 200)["matched_share"] is None


def test_the_stand_in_stores_chains_again_no_faster_than_an_engine_prefills():
    import kv_stand_in

    ids = list(range(100, 100 + 16 * 100))  # 1,600 tokens a body
    cache = kv_stand_in.PortCache(lambda b, chat: ids, restore_s=1.0, prefill_tokens_per_s=2_000.0)
    for b in range(4):
        assert len(cache.on_request(bytes([b]), True, 0.0)) == 2  # first stores always happen
    restored = []
    for t in range(1, 11):  # ten seconds later, every second, each body asks again
        cache.step()
        restored.append(sum(len(cache.on_request(bytes([b]), True, float(t))) > 1 for b in range(4)))
    # 6,400 tokens stored at 0 at 2,000 a second: the first chain again at 4 s, then one a
    # second (the budget holds at most a second's worth), not four
    assert restored == [0, 0, 0, 1, 1, 1, 1, 1, 1, 1]


def test_the_stand_in_forgets_the_oldest_bodies_past_its_bound(monkeypatch):
    import kv_stand_in
    from prefixroute.core.kvevents.events import BlockRemoved

    monkeypatch.setattr(kv_stand_in, "MAX_BODIES", 3)
    ids = list(range(100, 100 + 32))
    cache = kv_stand_in.PortCache(lambda b, chat: ids)
    first = cache.on_request(b"0", True, 0.0)[0]
    for b in (b"1", b"2"):
        cache.on_request(b, True, 0.0)
    fourth = cache.on_request(b"3", True, 0.0)
    assert len(cache.chains) == 3 and len(cache.token_cache) == 3
    # body 0's prompt blocks are evicted with it (its answer block stays: the answer window's)
    assert [e for e in fourth if isinstance(e, BlockRemoved)] == [BlockRemoved(first.block_hashes)]


def test_cpu_of_several_trees_counts_each_process_once_and_reaped_children_only_when_asked():
    """``trees_cpu_seconds`` (what the peers and workers benchmarks charge their routers):
    a process named twice counts once; a child that has run and been reaped counts in
    its parent's cutime/cstime only with ``reaped``."""
    import os
    import subprocess

    me = os.getpid()
    subprocess.run([sys.executable, "-c", "sum(i * i for i in range(3_000_000))"], check=True)  # reaped: in cutime
    own = proc_stats.trees_cpu_seconds([me], reaped=False)
    both = proc_stats.trees_cpu_seconds([me, me], reaped=False)
    with_reaped = proc_stats.trees_cpu_seconds([me])
    assert own > 0 and abs(both - own) < 0.05  # (the process runs on between the reads)
    assert with_reaped - own > 0.05  # the child's own CPU, about 0.1-0.3 s
    assert abs(proc_stats.tree_cpu_seconds(me) - with_reaped) < 0.05
