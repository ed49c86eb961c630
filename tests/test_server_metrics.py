"""Router metrics: the fast counter/histogram children give prometheus-client's figures,
in one process and in the per-process files of ``serve --workers N``."""

import subprocess
import sys
import textwrap

import pytest

from prefixroute.core.config import FleetConfig, RoutingConfig
from prefixroute.core.endpoint import Fleet
from prefixroute.server.metrics import RouterMetrics

# Runs in a fresh interpreter: multiprocess values are process-wide once chosen.
_MULTIPROCESS = textwrap.dedent("""
    import os, sys, tempfile
    from prefixroute.server.metrics import use_multiprocess_values, RouterMetrics
    from prefixroute.core.config import FleetConfig, RoutingConfig
    from prefixroute.core.endpoint import Fleet
    d = tempfile.mkdtemp()
    use_multiprocess_values(d)
    fleet = Fleet(FleetConfig.single(["http://127.0.0.1:9"], RoutingConfig()))
    m = RouterMetrics(lambda: fleet, multiprocess_dir=d)
    for i in range(7):
        m.responses.labels("e", "v", "200").inc()
    m.responses.labels("e", "v", "503").inc(2)
    for s in (0.0004, 0.03, 0.03, 12.0):
        m.duration_seconds.labels("e", "v").observe(s)
    # the fast children, on the worker's files (not prometheus-client's locked ones)
    assert type(m.responses.labels("e", "v", "200")).__name__ == "_FastCounter"
    assert type(m.duration_seconds.labels("e", "v")).__name__ == "_FastHistogram"
    sys.stdout.write(m.render().decode())
""")


def _samples(text: str) -> dict[str, float]:
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def _expected(render: bytes) -> dict[str, float]:
    # (``*_created`` timestamps exist in one process only: not compared)
    return {k: v for k, v in _samples(render.decode()).items()
            if k.startswith(("prefixroute_responses_total", "prefixroute_request_duration_seconds"))
            and "_created" not in k}


def test_multiprocess_values_match_single_process_ones():
    fleet = Fleet(FleetConfig.single(["http://127.0.0.1:9"], RoutingConfig()))
    single = RouterMetrics(lambda: fleet)
    for _ in range(7):
        single.responses.labels("e", "v", "200").inc()
    single.responses.labels("e", "v", "503").inc(2)
    for s in (0.0004, 0.03, 0.03, 12.0):
        single.duration_seconds.labels("e", "v").observe(s)
    want = _expected(single.render())
    assert want['prefixroute_responses_total{code="200",endpoint="e",variant="v"}'] == 7.0
    assert want['prefixroute_request_duration_seconds_count{endpoint="e",variant="v"}'] == 4.0

    proc = subprocess.run([sys.executable, "-c", _MULTIPROCESS], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    got = _expected(proc.stdout.encode())
    assert got.keys() == want.keys()
    for name, value in want.items():
        assert abs(got[name] - value) < 1e-9, name


def _shares(text: str) -> dict[str, float]:
    """component -> prefixroute_cache_aware_continued_share of endpoint e, variant AllTraffic."""
    out = {}
    for line in text.splitlines():
        if line.startswith('prefixroute_cache_aware_continued_share{'):
            labels, value = line.rsplit(" ", 1)
            assert 'endpoint="e"' in labels and 'variant="AllTraffic"' in labels
            out[labels.split('component="')[1].split('"')[0]] = float(value)
    return out


def test_continued_share_is_one_series_per_pool_that_routed_any():
    """Conversations through one component, questions about one document through the
    other: each component's own share (the one its backlog test reads), none for the
    variant's own pool (no request), none at all before any."""
    from prefixroute.core.keys import openai_route

    a, b = "http://10.0.0.1:8000", "http://10.0.0.2:8000"
    ca = {"RoutingStrategy": "CACHE_AWARE", "CacheAwareRoutingConfig": {"ConcurrencyThreshold": 8}}
    fleet = Fleet(FleetConfig.from_mapping({"Endpoints": [{
        "EndpointName": "e", "ProductionVariants": [{"VariantName": "AllTraffic", "Instances": [a, b],
                                                     "RoutingConfig": ca}],
        "InferenceComponents": [{"InferenceComponentName": "chat", "Instances": [a]},
                                {"InferenceComponentName": "docs", "Instances": [b]}]}]}))
    metrics = RouterMetrics(lambda: fleet)
    text = metrics.render().decode()
    assert "# TYPE prefixroute_cache_aware_continued_share gauge" in text and _shares(text) == {}
    pools = {p.component: p for _, p in fleet.all_pools()}
    routing = pools["chat"].routing

    def send(pool, messages):
        _, blocks = openai_route({"model": "m", "messages": messages}, True, routing)
        pool.acquire(None, blocks=blocks).release()

    # a first prompt shares nothing with what its instance was sent: no sample, no series
    send(pools["docs"], [{"role": "user", "content": "Something unrelated. " * 40}])
    assert _shares(metrics.render().decode()) == {}
    # one conversation, turn after turn: every later turn continues the one before
    history = [{"role": "system", "content": "You are terse. " * 40}]
    for turn in range(20):
        history.append({"role": "user", "content": f"question {turn} " * 30})
        send(pools["chat"], history)
        history.append({"role": "assistant", "content": f"answer {turn} " * 30})
    # new questions about one document: each branches off the document
    doc = "A long document. " * 300
    for q in range(20):
        send(pools["docs"], [{"role": "user", "content": doc + f"Question {q}?"}])
    # (moving averages from 1 over about 128 requests: 19 continuations, 19 branches)
    assert _shares(metrics.render().decode()) == {"chat": 1.0, "docs": pytest.approx((1 - 1 / 128) ** 19)}
    assert pools[None].strategy.continued_samples == 0
