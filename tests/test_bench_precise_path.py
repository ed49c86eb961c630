"""bench/precise_path.py: both arms at each body size, precise mode really on the events."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import kv_stand_in  # noqa: E402
import precise_path  # noqa: E402

ARGS = ["--body-sizes", "1K,4K", "--number", "300", "--rounds", "1", "--requests-per-step", "16"]


def test_both_arms_every_phase_and_every_request_matched_on_events(tmp_path, capsys):
    out = tmp_path / "precise_path.json"
    assert precise_path.main([*ARGS, "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    rows = {(r["mode"], r["body_bytes"]): r for r in doc["rows"]}
    assert set(rows) == {(m, s) for m in ("learned", "precise") for s in (1024, 4096)}
    for (mode, size), r in rows.items():
        assert r["prepare_us"] > 0 and r["decide_us"] > 0 and r["learn_us"] > 0
        assert r["total_us"] == pytest.approx(sum(r[f"{p}_us"] for p in precise_path.PHASES))
        if mode == "learned":
            assert r["ingest_us"] == 0 and "matched_share" not in r
        else:  # the stand-in's events reached every stream, every request matched them, the precise rule decided
            assert r["ingest_us"] > 0
            assert r["all_precise"] and r["modes"] == ["precise"] and r["matched_share"] == 1.0
            assert r["precise_rule_decided"]
            # keys by the byte walk and the precise rule cost more than the learned view's alone (3-5x
            # on this machine; only the direction is asserted)
            learned = rows[("learned", size)]
            assert r["prepare_us"] > learned["prepare_us"] and r["decide_us"] > learned["decide_us"]
    printed = capsys.readouterr().out
    assert "x learned" in printed and "100% (precise)" in printed and "    4K precise" in printed


def test_events_that_match_nothing_fail_the_run(monkeypatch, capsys):
    """A stand-in whose blocks are of other tokens than the requests': attached, never matched."""
    class Elsewhere(kv_stand_in.PortCache):
        def __init__(self, token_ids, **kw):
            super().__init__(lambda body, chat: [t + 1 for t in token_ids(body, chat)], **kw)

    monkeypatch.setattr(precise_path, "PortCache", Elsewhere)
    assert precise_path.main(["--body-sizes", "1K", "--number", "200", "--rounds", "1"]) == 1
    err = capsys.readouterr().err
    assert "precise mode did not hold throughout: 1K: 0% matched on the events" in err


@pytest.mark.parametrize("argv, message", [
    (["--number", "0"], "must be >= 1"),
    (["--rounds", "0"], "must be >= 1"),
    (["--requests-per-step", "0"], "must be >= 1"),
    (["--number", "50"], "--requests-per-step (64) must be at most --number"),
    (["--number", "3000", "--requests-per-step", "2001"], "and the warm-up's 2,000 requests"),
    (["--body-sizes", "big"], "not a size"),
    (["--body-sizes", "10"], "cannot hold a chat request"),
    (["--body-sizes", ","], "names no size"),
    (["--json", "/nonexistent-dir/out.json"], "--json: no directory '/nonexistent-dir'"),
])
def test_bad_arguments_are_refused(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        precise_path.main(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err
