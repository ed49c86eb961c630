"""bench/decision.py: every row of its matrix, and the facts a run is compared by."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import decision  # noqa: E402


def test_json_has_every_row_the_commit_and_the_interpreter_reference(tmp_path, capsys):
    out = tmp_path / "decision.json"
    assert decision.main(["--number", "3", "--repeats", "1", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    rows = {(r["strategy"], r["prefix_bytes"], r["instances"], r["scenario"]): r for r in doc["rows"]}
    want = {(s, size, n, sc) for s in decision.STRATEGIES for size in decision.SIZES for n in decision.INSTANCES
            for sc in (("warm", "cold", "shared") if s == "CACHE_AWARE" else ("warm",))}
    assert set(rows) == want
    for r in rows.values():
        # decide = key + the choice, timed around both: never less than the key alone
        assert 0 < r["key_us"] <= r["decide_us"]
    ref = doc["interpreter_reference_us"]
    assert ref["before"] > 0 and ref["after"] > 0
    assert doc["prefixroute_commit"] is None or len(doc["prefixroute_commit"].split("+")[0]) >= 7
    printed = capsys.readouterr().out
    assert "interpreter reference: sum(range(1000)) takes" in printed
    assert "64 KB prefix, 64 instances: slowest decision" in printed
