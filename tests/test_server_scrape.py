"""What the router reads from each engine's ``/metrics``: vLLM's names, or SGLang's."""

from __future__ import annotations

import asyncio
import logging
import zlib

import aiohttp
from aiohttp import web

from prefixroute.core.config import FleetConfig, RoutingConfig
from prefixroute.core.endpoint import Fleet
from prefixroute.engine.model import DEFAULT_MODEL, EngineConfig
from prefixroute.engine.server import start_engine_server
from prefixroute.server.metrics import RouterMetrics
from prefixroute.server.scrape import BackendStats, parse_engine_metrics, scrape_all

from test_server_helpers import eventually, metric_value, router_for

M = 'model_name="meta-llama/Llama-3.1-8B-Instruct"'

# The shape of an SGLang (--enable-metrics) page: counters by is_streaming and
# cache_source, with their _created samples, gauges per scheduler, histograms whose
# names start like the counters'.
SGLANG_PAGE = f"""\
# HELP sglang:prompt_tokens_total Number of prefill tokens processed.
# TYPE sglang:prompt_tokens_total counter
sglang:prompt_tokens_total{{{M},is_streaming="false"}} 6000.0
sglang:prompt_tokens_total{{{M},is_streaming="true"}} 2000.0
# HELP sglang:prompt_tokens_created Number of prefill tokens processed.
# TYPE sglang:prompt_tokens_created gauge
sglang:prompt_tokens_created{{{M},is_streaming="false"}} 1.7917e+09
# HELP sglang:cached_tokens_total Number of cached prompt tokens by source.
# TYPE sglang:cached_tokens_total counter
sglang:cached_tokens_total{{{M},cache_source="device"}} 5000.0
sglang:cached_tokens_total{{{M},cache_source="host"}} 1000.0
# HELP sglang:prompt_tokens_histogram Histogram of prompt token length.
# TYPE sglang:prompt_tokens_histogram histogram
sglang:prompt_tokens_histogram_bucket{{{M},le="1000.0"}} 3.0
sglang:prompt_tokens_histogram_bucket{{{M},le="+Inf"}} 4.0
sglang:prompt_tokens_histogram_sum{{{M}}} 8000.0
sglang:prompt_tokens_histogram_count{{{M}}} 4.0
# HELP sglang:num_running_reqs The number of running requests.
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{{{M},dp_rank="0"}} 3.0
sglang:num_running_reqs{{{M},dp_rank="1"}} 2.0
# HELP sglang:num_queue_reqs The number of requests in the waiting queue.
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{{{M},dp_rank="0"}} 4.0
sglang:num_queue_reqs{{{M},dp_rank="1"}} 0.0
# HELP sglang:cache_hit_rate The prefix cache hit rate.
# TYPE sglang:cache_hit_rate gauge
sglang:cache_hit_rate{{{M}}} 0.42
# HELP sglang:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE sglang:time_to_first_token_seconds histogram
sglang:time_to_first_token_seconds_bucket{{{M},le="0.1"}} 4.0
sglang:time_to_first_token_seconds_bucket{{{M},le="+Inf"}} 4.0
sglang:time_to_first_token_seconds_sum{{{M}}} 0.2
sglang:time_to_first_token_seconds_count{{{M}}} 4.0
"""


async def _serve(app: web.Application) -> tuple[web.AppRunner, str]:
    """Serve ``app`` (a stand-in engine's ``/metrics``) on a free loopback port: its
    runner (to clean up) and base URL."""
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"


def test_an_sglang_page_gives_prompt_and_cached_tokens_and_the_queue():
    s = parse_engine_metrics(SGLANG_PAGE, 12.5)
    assert (s.prefix_cache_queries, s.prefix_cache_hits) == (8000.0, 6000.0)  # summed over the label sets
    assert s.hit_rate == 0.75  # from the counters, not the cache_hit_rate gauge
    assert (s.requests_running, s.requests_waiting, s.engine_load) == (5.0, 4.0, 9)
    assert s.ok and s.scraped_at == 12.5


def test_an_sglang_release_without_cached_tokens_has_no_hit_rate_and_stays_out_of_the_fleet_rate():
    old = "\n".join(line for line in SGLANG_PAGE.splitlines() if "cached_tokens" not in line)
    s = parse_engine_metrics(old)
    assert s.prefix_cache_queries == 8000.0 and s.prefix_cache_hits is None and s.hit_rate is None
    assert s.engine_load == 9
    vllm = parse_engine_metrics("vllm:prefix_cache_queries_total 1000.0\nvllm:prefix_cache_hits_total 900.0\n")
    stats = {"http://a:1": vllm, "http://b:1": s}
    fleet = Fleet(FleetConfig.single(list(stats), RoutingConfig()))
    text = RouterMetrics(lambda: fleet, lambda: stats).render().decode()
    assert metric_value(text, "prefixroute_fleet_prefix_cache_hit_rate") == 0.9  # (b's hits are unknown)
    assert metric_value(text, "prefixroute_backend_prefix_cache_queries_total", instance="http://b:1") == 8000
    assert metric_value(text, "prefixroute_backend_prefix_cache_hits_total", instance="http://b:1") is None


def test_vllm_names_come_first_and_the_older_gpu_names_are_a_fallback():
    both = "vllm:prefix_cache_queries_total 10.0\nvllm:gpu_prefix_cache_queries_total 99.0\n" \
           "vllm:prefix_cache_hits_total 4.0\nvllm:num_requests_running 1.0\n"
    s = parse_engine_metrics(both)
    assert (s.prefix_cache_queries, s.prefix_cache_hits, s.requests_running, s.requests_waiting) == \
        (10.0, 4.0, 1.0, None)
    old = parse_engine_metrics("vllm:gpu_prefix_cache_queries_total 20.0\nvllm:gpu_prefix_cache_hits_total 5.0\n")
    assert old.hit_rate == 0.25 and old.engine_load is None
    assert parse_engine_metrics("# nothing an engine of ours exports\nother_total 3.0\n") == BackendStats(ok=True)


def test_nan_infinite_or_negative_samples_leave_a_figure_unknown_and_break_nothing():
    page = ("sglang:num_running_reqs NaN\nsglang:num_queue_reqs{dp_rank=\"0\"} 2\n"
            "sglang:num_queue_reqs{dp_rank=\"1\"} +Inf\nsglang:prompt_tokens_total 100\n"
            "sglang:cached_tokens_total -5\n")
    s = parse_engine_metrics(page)
    assert (s.requests_running, s.requests_waiting, s.prefix_cache_queries, s.prefix_cache_hits) == \
        (None, None, 100.0, None)
    assert s.engine_load is None and s.hit_rate is None  # was a ValueError out of engine_load
    fleet = Fleet(FleetConfig.single(["http://a:1"], RoutingConfig()))
    text = RouterMetrics(lambda: fleet, lambda: {"http://a:1": s}).render().decode()
    assert metric_value(text, "prefixroute_backend_requests_running", instance="http://a:1") is None


async def test_the_router_scrapes_an_sglang_instance_and_its_load_reaches_the_strategy():
    app = web.Application()

    async def metrics(_request: web.Request) -> web.Response:
        return web.Response(text=SGLANG_PAGE, content_type="text/plain")

    app.router.add_get("/metrics", metrics)
    runner, url = await _serve(app)
    handle = await router_for([url], RoutingConfig.build("cache-aware", None, 8))
    try:
        stats = await scrape_all(handle.state)
        assert stats[url].hit_rate == 0.75 and stats[url].ok
        [(_, pool)] = handle.fleet.all_pools()
        assert pool.get(url).engine_load == 9  # running + waiting, what CACHE_AWARE weighs
        text = handle.state.metrics.render().decode()
        assert metric_value(text, "prefixroute_backend_requests_waiting", instance=url) == 4
        assert metric_value(text, "prefixroute_fleet_prefix_cache_hit_rate") == 0.75
    finally:
        await handle.close()
        await runner.cleanup()


def test_a_counter_lower_than_its_last_known_value_is_a_restart():
    def page(q: str, h: str) -> BackendStats:
        return parse_engine_metrics(f"vllm:prefix_cache_queries_total {q}\nvllm:prefix_cache_hits_total {h}\n")

    before = page("1000.0", "900.0")
    assert not page("1500.0", "900.0").reset_since(before) and not before.reset_since(before)
    assert page("40.0", "0.0").reset_since(before) and page("1000.0", "5.0").reset_since(before)
    unknown = parse_engine_metrics("vllm:num_requests_running 2.0\n")
    assert not unknown.reset_since(before) and not page("40.0", "0.0").reset_since(unknown)  # nothing to compare
    # A scrape that lacks the counters (missing, NaN, negative, infinite) keeps their last
    # known values: a restart across it is still seen.
    gap = BackendStats(ok=False)
    for bad in (unknown, page("NaN", "NaN"), page("-1.0", "+Inf"), parse_engine_metrics("")):
        carried = bad.after(before)
        assert carried.marks == (1000.0, 900.0) and carried.restarts == 0
        assert carried.hit_rate == 0.9  # the last known counters, not unknown until the next scrape
        gap = carried
    restarted = page("5.0", "0.0").after(gap)
    assert restarted.restarts == 1 and restarted.marks == (5.0, 0.0)
    assert page("6.0", "1.0").after(restarted).restarts == 1  # growing again: no second restart
    half = parse_engine_metrics("vllm:prefix_cache_queries_total 1200.0\n").after(before)  # hits went missing
    assert half.restarts == 0 and half.marks == (1200.0, 900.0)


async def test_a_metrics_page_that_arrives_in_pieces_is_read_whole():
    # A page split across TCP segments (a real engine's page of tens of KB over a real
    # network) must be read to its end: reading only the first piece cut a counter's
    # digits short, which read as a restart every other scrape.
    page = ('vllm:iteration_tokens_total_bucket{engine="0",le="1"} 1\n' * 2000
            + "vllm:prefix_cache_queries_total 123456789.0\nvllm:prefix_cache_hits_total 98765432.0\n"
            + "vllm:num_requests_running 3.0\n").encode()
    cut = page.index(b"123456789.0") + 4

    async def metrics(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/plain"})
        resp.content_length = len(page)
        await resp.prepare(request)
        for piece in (page[:cut], page[cut:-10], page[-10:]):
            await resp.write(piece)
            await asyncio.sleep(0.005)
        return resp

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    runner, url = await _serve(app)
    handle = await router_for([url], RoutingConfig.build("cache-aware", None, 8))
    try:
        for _ in range(3):
            stats = await scrape_all(handle.state)
            assert (stats[url].prefix_cache_queries, stats[url].prefix_cache_hits) == (123456789.0, 98765432.0)
            assert stats[url].requests_running == 3.0 and stats[url].restarts == 0 and stats[url].ok
    finally:
        await handle.close()
        await runner.cleanup()


async def test_an_engine_restarted_on_its_url_is_seen_and_cache_aware_forgets_its_cache(caplog):
    """Real emulated engines behind the router (CACHE_AWARE, scraping every 50 ms). The
    instance that served a document restarts on the same port: the next successful
    scrape finds its counters back at zero, counts a restart, and the router's view of
    that instance's cache is emptied (the other instance's view is kept)."""
    started = [await start_engine_server(EngineConfig(), time_scale=0.0, instance_id=f"r{i}") for i in range(2)]
    runners = [r for r, _ in started]
    urls = [f"http://127.0.0.1:{p}" for _, p in started]
    handle = await router_for(urls, RoutingConfig.build("cache-aware", None, 8), metrics_scrape_interval_s=0.05)
    [(_, pool)] = handle.fleet.all_pools()
    caches = pool.strategy.caches

    async def ask(session: aiohttp.ClientSession, doc: str, question: str) -> str:
        body = {"model": DEFAULT_MODEL, "max_tokens": 2,
                "messages": [{"role": "system", "content": doc}, {"role": "user", "content": question}]}
        async with session.post(handle.url + "/v1/chat/completions", json=body) as resp:
            assert resp.status == 200, await resp.text()
            await resp.read()
            return resp.headers["X-Prefixroute-Instance"]

    def restarts(url: str) -> float | None:
        return metric_value(handle.state.metrics.render().decode(), "prefixroute_backend_restarts_seen", instance=url)

    try:
        async with aiohttp.ClientSession() as session:
            docs = [f"Document {i}. " + "The quick brown fox jumps over the lazy dog. " * 80 for i in range(12)]
            served = [await ask(session, d, "Summarise it.") for d in docs]
            assert set(served) == set(urls)  # both instances hold documents
            home = served[0]
            other = next(u for u in urls if u != home)
            assert await eventually(lambda: restarts(home) == 0 and restarts(other) == 0)
            # More requests: the counters grow, no restart is seen, nothing is forgotten.
            assert await ask(session, docs[0], "And the second part?") == home
            held = {u: len(caches[u]) for u in urls}
            await asyncio.sleep(0.3)
            assert restarts(home) == 0 and {u: len(caches[u]) for u in urls} == held and held[home] > 0

            # The instance restarts on its port (down for a few scrapes first: a failed
            # scrape is not a restart).
            i = urls.index(home)
            await runners[i].cleanup()
            await asyncio.sleep(0.3)
            assert restarts(home) == 0 and len(caches[home]) == held[home]
            with caplog.at_level(logging.WARNING, logger="prefixroute.server.state"):
                runners[i], _ = await start_engine_server(EngineConfig(), port=int(home.rsplit(":", 1)[1]),
                                                          time_scale=0.0, instance_id="r-restarted")
                assert await eventually(lambda: restarts(home) == 1, timeout=5.0)  # its counters start at 0
            assert len(caches[home]) == 0  # forgotten
            assert restarts(other) == 0 and len(caches[other]) == held[other]
            assert [r.getMessage() for r in caplog.records if "restarted" in r.getMessage()] == [
                f"instance {home} restarted (its prefix-cache counters went back): the router's view of its cache "
                "is cleared"]
            # Learning starts again; later scrapes see the counters grow, not another restart.
            served_after = await ask(session, docs[0], "Anything new?")
            assert len(caches[served_after]) > (held[other] if served_after == other else 0)
            await asyncio.sleep(0.3)
            assert restarts(home) == 1 and restarts(other) == 0
    finally:
        await handle.close()
        for r in runners:
            await r.cleanup()


async def test_a_compressed_metrics_page_is_asked_for_plain_and_read_if_sent_anyway():
    # prometheus-client's own servers (SGLang's /metrics) gzip the page when the request
    # allows it; the upstream session does not decompress, so the page read as no
    # counters while the scrape counted as a success.
    import gzip

    page = b"sglang:prompt_tokens_total 8000.0\nsglang:cached_tokens_total 6000.0\nsglang:num_queue_reqs 2.0\n"
    seen: list[str] = []

    async def polite(request: web.Request) -> web.Response:  # gzips only when allowed
        accept = request.headers.get("Accept-Encoding", "")
        seen.append(accept)
        if "gzip" in accept:
            return web.Response(body=gzip.compress(page), headers={"Content-Encoding": "gzip"})
        return web.Response(body=page, content_type="text/plain")

    async def always(request: web.Request) -> web.Response:  # gzips whatever was asked
        return web.Response(body=gzip.compress(page), headers={"Content-Encoding": "gzip"})

    async def deflate(request: web.Request) -> web.Response:
        return web.Response(body=zlib.compress(page), headers={"Content-Encoding": "deflate"})

    async def broken(request: web.Request) -> web.Response:
        return web.Response(body=gzip.compress(page)[:-12] + b"x" * 12, headers={"Content-Encoding": "gzip"})

    app = web.Application()
    for name, handler in (("polite", polite), ("always", always), ("deflate", deflate), ("broken", broken)):
        sub = web.Application()
        sub.router.add_get("/metrics", handler)
        app.add_subapp(f"/{name}", sub)
    runner, base = await _serve(app)
    urls = [f"{base}/{n}" for n in ("polite", "always", "deflate", "broken")]
    handle = await router_for(urls, RoutingConfig.build("cache-aware", None, 8))
    try:
        stats = await scrape_all(handle.state)
        assert seen == ["identity"]
        for url in urls[:3]:
            s = stats[url]
            assert (s.prefix_cache_queries, s.prefix_cache_hits, s.requests_waiting, s.ok) == (8000.0, 6000.0, 2.0,
                                                                                             True), url
        assert not stats[urls[3]].ok and stats[urls[3]].prefix_cache_queries is None  # a failed scrape, not a page
    finally:
        await handle.close()
        await runner.cleanup()


def test_restarts_are_read_series_by_series():
    def page(*rows: tuple[str, str, float]) -> BackendStats:
        return parse_engine_metrics("".join(f'vllm:prefix_cache_{c}_total{{model_name="{m}"}} {v}\n' for c, m, v in rows))

    both = page(("queries", "a", 1000.0), ("hits", "a", 900.0), ("queries", "b", 5000.0), ("hits", "b", 10.0))
    assert both.marks == (6000.0, 910.0)
    # Model b is no longer served: its series disappear, the sums fall, nothing restarted.
    only_a = page(("queries", "a", 1100.0), ("hits", "a", 950.0))
    assert not only_a.reset_since(both)
    carried = only_a.after(both)
    assert carried.restarts == 0 and carried.marks == (6100.0, 960.0)  # b's last values are kept
    # ... and counted: the counters the router exports do not go back (a reset to
    # Prometheus) because a label set stopped being exported.
    assert (carried.prefix_cache_queries, carried.prefix_cache_hits) == (6100.0, 960.0)
    assert carried.hit_rate == 960.0 / 6100.0
    # A series that is still there and went back is a restart, whatever the others do.
    assert page(("queries", "a", 3.0), ("hits", "a", 0.0), ("queries", "b", 9000.0)).reset_since(both)
    assert page(("queries", "a", 1100.0), ("hits", "a", 5.0)).reset_since(both)
    # b comes back lower than it was: its engine lost that cache.
    assert page(("queries", "a", 1200.0), ("hits", "a", 990.0), ("queries", "b", 7.0)).after(carried).restarts == 1
    # No series in common (the engine came back with other labels): the sums are compared.
    assert page(("queries", "c", 40.0), ("hits", "c", 1.0)).reset_since(both)
    assert not page(("queries", "c", 9000.0), ("hits", "c", 1000.0)).reset_since(both)
    # A scrape from an older release's names after the new ones (or back): no series in
    # common, the sums decide.
    old_names = parse_engine_metrics("vllm:gpu_prefix_cache_queries_total 10.0\nvllm:gpu_prefix_cache_hits_total 1.0\n")
    assert old_names.marks == (10.0, 1.0) and old_names.reset_since(both)


def test_restart_checks_compare_each_name_and_keep_few_vanished_series():
    def page(**values: float) -> BackendStats:
        return parse_engine_metrics("".join(f"{k.replace('__', ':')}{{model_name=\"{m}\"}} {v}\n"
                                            for k, (m, v) in values.items()))

    # Only an older release's names (gpu_), then a release exporting both names under a
    # new model_name: 600 tokens against 1,000 is a restart, whichever names it sums.
    before = parse_engine_metrics('vllm:gpu_prefix_cache_queries_total{model_name="x"} 1000\n')
    both_names = parse_engine_metrics('vllm:gpu_prefix_cache_queries_total{model_name="y"} 600\n'
                                      'vllm:prefix_cache_queries_total{model_name="y"} 600\n')
    assert both_names.reset_since(before)
    assert not parse_engine_metrics('vllm:gpu_prefix_cache_queries_total{model_name="y"} 1600\n'
                                    'vllm:prefix_cache_queries_total{model_name="y"} 600\n').reset_since(before)
    # Label sets that churn (a new one every scrape, none coming back), a scrape without
    # the counter among them: no restart; at most 64 vanished series are kept apart, the
    # latest, the earlier ones folded into one sum, so the counter never goes back.
    def page(rows: dict[str, str]) -> BackendStats:
        return parse_engine_metrics("".join(f'vllm:prefix_cache_queries_total{{model_name="{m}"}} {v}\n'
                                            for m, v in rows.items()))

    stats = page({"m0": "10"})
    for i in range(1, 300):  # a new label set each scrape, one scrape without any
        got = page({f"m{i}": "NaN" if i == 150 else "10"}).after(stats)
        assert got.restarts == 0 and got.prefix_cache_queries >= stats.prefix_cache_queries, i
        stats = got
    kept = sorted(int(k[1][0][1][1:]) for k in stats.series_marks if k[1][0][1].startswith("m"))
    assert kept == [i for i in range(300) if i != 150][-65:]
    assert stats.prefix_cache_queries == 10 * 299  # (m150 was NaN on its only page)
    stats = page({"base": "10", "big": "1e6"})  # one big series vanishes, then is folded
    for i in range(1, 100):
        got = page({"base": str(10 + i), f"c{i}": "1"}).after(stats)
        assert got.restarts == 0 and got.prefix_cache_queries >= stats.prefix_cache_queries, i
        stats = got
    assert stats.prefix_cache_queries == 1e6 + 109 + 99
    # An engine back on an older release's names (new-name series kept from before):
    # the counters follow the names it exports now.
    new_first = parse_engine_metrics('vllm:prefix_cache_queries_total{model_name="x"} 500\n')
    old_after = parse_engine_metrics('vllm:gpu_prefix_cache_queries_total{model_name="x"} 600\n').after(new_first)
    old_later = parse_engine_metrics('vllm:gpu_prefix_cache_queries_total{model_name="x"} 900\n').after(old_after)
    assert (old_after.restarts, old_after.prefix_cache_queries, old_later.prefix_cache_queries) == (0, 600, 900)


def test_series_missing_from_one_page_are_not_vanished_and_names_switched_back_are_compared_anew():
    def page(rows: dict[str, str], name: str = "vllm:prefix_cache_queries_total") -> BackendStats:
        return parse_engine_metrics("".join(f'{name}{{model_name="{m}"}} {v}\n' for m, v in rows.items()))

    # Two live series, 64 churned ones beside them, then a page where the live ones are
    # NaN: they are not folded away as vanished, and their return is no restart.
    stats = page({"a": "1000", "b": "500"})
    for i in range(64):
        stats = page({"a": "1000", "b": "500", f"c{i}": "10"}).after(stats)
    stats = page({"a": "NaN", "b": "NaN", "c63": "10"}).after(stats)
    back = page({"a": "1001", "b": "501", "c63": "10"}).after(stats)
    assert back.restarts == 0 and back.prefix_cache_queries == stats.prefix_cache_queries + 2
    # 33 series of each counter, one page with neither, the same values again: the same
    # counters (nothing counted twice).
    both = "".join(f'vllm:prefix_cache_queries_total{{model_name="m{i}"}} 1000\n'
                   f'vllm:prefix_cache_hits_total{{model_name="m{i}"}} 500\n' for i in range(33))
    first = parse_engine_metrics(both)
    again = parse_engine_metrics(both).after(parse_engine_metrics("vllm:num_requests_running 1\n").after(first))
    assert (again.restarts, again.prefix_cache_queries, again.prefix_cache_hits) == (0, 33_000, 16_500)
    # New names, then the older release's (no restart seen: more tokens), then the new
    # names again with fewer than the last found: a restart, not a comparison with the
    # values the new names had before the switch.
    stats = page({"x": "5000"})
    stats = page({"x": "6000"}, "vllm:gpu_prefix_cache_queries_total").after(stats)
    stats = page({"x": "9000"}, "vllm:gpu_prefix_cache_queries_total").after(stats)
    assert (stats.restarts, stats.prefix_cache_queries) == (0, 9000)
    switched = page({"x": "5000"}).after(stats)
    assert switched.restarts == 1 and switched.prefix_cache_queries == 5000
