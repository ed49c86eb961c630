"""The shortened (60 s) soak of bench/soak.py, as CI runs it: engines killed and
restarted at random under mixed streaming traffic; nothing may hang, stay unclear or
leak an in-flight slot, and the router must drain and exit 0 on SIGTERM."""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.soak

def test_soak_60s(tmp_path, capsys, load_bench):
    soak = load_bench("soak")
    out = tmp_path / "soak.json"
    status = soak.main(["--duration", "60", "--quiet", "--json", str(out)])
    table = capsys.readouterr().out
    print(table)
    run = json.loads(out.read_text())["runs"][0]
    assert status == 0, table
    assert run["hung"] == 0 and run["unclear"] == 0 and run["leaked_in_flight"] == 0, table
    assert run["kills"] >= 3 and run["restarts"] == run["kills"], table
    assert run["requests"] > 1000 and run["succeeded"] > 0.8 * run["requests"], table
    assert run["router_exit_code"] == 0, table
