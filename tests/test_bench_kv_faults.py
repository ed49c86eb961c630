"""bench/kv_faults.py runs every fault, briefly, and the router goes through each one
without an error: the figures it reports are the benchmark's (none asserted here)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_every_fault_is_survived_and_shows_in_the_streams_counters(tmp_path: Path) -> None:
    out = tmp_path / "faults.json"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "kv_faults.py"), "--duration", "1", "--rounds", "1",
                           "--body-kb", "2", "--json", str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {r["scenario"]: r for r in json.loads(out.read_text())["summary"]}
    assert set(rows) == {"off", "quiet", "flood", "malformed", "restart", "unreachable"}
    assert all(r["errors"] == 0 and r["requests"] > 0 for r in rows.values())
    assert rows["quiet"]["modes"] == ["precise"] and rows["quiet"]["gaps"] == 0
    assert rows["flood"]["messages"] > 1000
    assert rows["malformed"]["rejected"] > 100
    assert rows["restart"]["restarts"] + rows["restart"]["resets"] > 0 and rows["restart"]["gaps"] > 0
    assert rows["unreachable"]["modes"] == ["approximate"] and rows["unreachable"]["messages"] == 0
    assert "goal: decision latency" in proc.stdout
