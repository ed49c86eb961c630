"""bench/precise_path.py: both arms at each body size, precise mode really on the events."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import precise_path  # noqa: E402


def test_both_arms_every_phase_and_every_request_matched_on_events(tmp_path, capsys):
    out = tmp_path / "precise_path.json"
    assert precise_path.main(["--body-sizes", "1K,4K", "--number", "300", "--rounds", "1",
                              "--requests-per-step", "16", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    rows = {(r["mode"], r["body_bytes"]): r for r in doc["rows"]}
    assert set(rows) == {(m, s) for m in ("learned", "precise") for s in (1024, 4096)}
    for (mode, _), r in rows.items():
        assert r["prepare_us"] > 0 and r["decide_us"] > 0 and r["learn_us"] > 0
        assert r["total_us"] == pytest.approx(sum(r[f"{p}_us"] for p in precise_path.PHASES))
        if mode == "learned":
            assert r["ingest_us"] == 0 and "matched_share" not in r
        else:  # the stand-in's events reached every stream and every request matched on them
            assert r["ingest_us"] > 0
            assert r["all_precise"] and r["modes"] == ["precise"] and r["matched_share"] == 1.0
    printed = capsys.readouterr().out
    assert "x learned" in printed and "100% (precise)" in printed


def test_bad_arguments_are_refused(capsys):
    with pytest.raises(SystemExit) as exc:
        precise_path.main(["--number", "0"])
    assert exc.value.code == 2
    with pytest.raises(SystemExit) as exc:
        precise_path.main(["--body-sizes", "big"])
    assert exc.value.code == 2
    assert "not a size" in capsys.readouterr().err
