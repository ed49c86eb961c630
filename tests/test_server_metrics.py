"""Router metrics: the fast counter/histogram children give prometheus-client's figures,
in one process and in the per-process files of ``serve --workers N``."""

import subprocess
import sys
import textwrap

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
