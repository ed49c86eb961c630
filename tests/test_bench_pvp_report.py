"""bench/pvp_report.py: noise between runs, verdicts against peers only, replica drift."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
import pvp_report as report  # noqa: E402


def _run(label: str, strategy: str, reps: int, hit: float, p50: float, p90: float, errors: int = 0,
         workload: str = "w") -> dict:
    return {"workload": workload, "replicas": reps, "label": label, "router": label.split()[0],
            "strategy": strategy, "cache_hit_rate": hit, "p50_ttft_s": p50, "p90_ttft_s": p90, "errors": errors}


def _files(tmp_path: Path, *runs_per_file: list[dict]) -> list[Path]:
    paths = []
    for i, runs in enumerate(runs_per_file):
        p = tmp_path / f"run{i}.json"
        p.write_text(json.dumps({"runs": runs}))
        paths.append(p)
    return paths


def test_noise_is_the_spread_between_runs_and_a_loss_within_it_still_leads(tmp_path):
    a = [_run("prefixroute CACHE_AWARE", "CACHE_AWARE", 1, 0.940, 0.021, 0.030),
         _run("vllm-router consistent_hash", "consistent_hash", 1, 0.945, 0.020, 0.030),
         _run("prefixroute PREFIX_AWARE", "PREFIX_AWARE", 1, 0.990, 0.010, 0.010)]
    b = [_run("prefixroute CACHE_AWARE", "CACHE_AWARE", 1, 0.930, 0.022, 0.031),
         _run("vllm-router consistent_hash", "consistent_hash", 1, 0.950, 0.020, 0.033),
         _run("prefixroute PREFIX_AWARE", "PREFIX_AWARE", 1, 0.990, 0.010, 0.010)]
    table = report.cells(report.load_runs(_files(tmp_path, a, b)))
    tol = report.noise(table)
    # hit spreads 1.0, 0.5, 0.0 points: the 90th percentile of three is the largest
    assert tol["hit"].p90 == pytest.approx(1.0) and tol["hit"].cells == 3
    assert tol["P90"].p90 == pytest.approx(0.1)  # 33 / 30 - 1
    medians = {c: report.median_run(r) for c, r in table.items()}
    (v,) = report.verdicts(medians, tol)
    # medians: CACHE_AWARE 93.5 % vs 94.75 %: 1.25 points behind, more than the noise of
    # 1.0; P50 21.5 vs 20 ms: 7.5 % behind, more than the 4.8 % noise; P90 30.5 vs 31.5 ms
    assert v.best["hit"] == ("vllm-router consistent_hash", pytest.approx(0.9475))
    assert v.leads == {"hit": False, "P50": False, "P90": True}
    # PREFIX_AWARE is prefixroute's own strategy, not a peer: never the best peer
    assert all(who != "prefixroute PREFIX_AWARE" for who, _ in v.best.values())


def test_one_file_takes_the_noise_as_zero_and_the_llmd_arm_is_a_peer(tmp_path):
    runs = [_run("prefixroute CACHE_AWARE", "CACHE_AWARE", 1, 0.90, 0.030, 0.050),
            _run("llm-d scorers (re-implementation)", "LLMD_REFERENCE", 1, 0.91, 0.040, 0.060),
            _run("prefixroute CACHE_AWARE", "CACHE_AWARE", 8, 0.88, 0.030, 0.050),
            _run("sglang-router cache_aware", "cache_aware", 8, 0.60, 0.200, 0.400)]
    runs[1]["router"] = "prefixroute"
    table = report.cells(report.load_runs(_files(tmp_path, runs)))
    tol = report.noise(table)
    assert tol["hit"].cells == 0 and tol["hit"].p90 == 0
    medians = {c: report.median_run(r) for c, r in table.items()}
    by = {v.replicas: v for v in report.verdicts(medians, tol)}
    assert by[1].best["hit"][0] == "llm-d scorers (re-implementation)" and not by[1].leads["hit"]
    assert by[8].all_lead
    assert report.replica_drift(medians) == {"w": {1: 0.90, 8: 0.88}}
    text = "\n".join(report.render(table))
    assert "| w | 90.0 % | - | 88.0 % | -2.0 pts |" in text
    assert "in 1 of 2 groups" in text


def test_a_file_that_is_not_a_benchmark_json_is_refused(tmp_path, capsys):
    bad = tmp_path / "x.json"
    bad.write_text("[1, 2]")
    with pytest.raises(SystemExit):
        report.main([str(bad)])
    assert "not a bench/policy_vs_peers.py JSON" in capsys.readouterr().err


def test_workload_tables_list_every_router_with_the_subject_in_bold(tmp_path, capsys):
    runs = [_run("prefixroute CACHE_AWARE", "CACHE_AWARE", 1, 0.9, 0.030, 0.050),
            _run("haproxy hash-balance-factor", "hash", 1, 0.8, 0.020, 0.400)]
    runs[0].update(throughput_rps=12.5, busiest_share=0.31)
    assert report.main([*map(str, _files(tmp_path, runs)), "--tables"]) == 0
    out = capsys.readouterr().out
    assert "| **prefixroute CACHE_AWARE** | 1 | 90.0 % | 30 ms | 50 ms | 12.5 rps | 31 % | 0 |" in out
    assert "| haproxy hash-balance-factor | 1 | 80.0 % | 20 ms | 400 ms | - | - | 0 |" in out


def test_noise_from_other_runs_judges_one_new_run(tmp_path, capsys):
    # The noise runs: CACHE_AWARE's hit rate spreads by 1.0 point, its P50 by 10 %.
    old_a = [_run("prefixroute CACHE_AWARE", "CACHE_AWARE", 1, 0.940, 0.020, 0.030),
             _run("vllm-router consistent_hash", "consistent_hash", 1, 0.945, 0.020, 0.030)]
    old_b = [_run("prefixroute CACHE_AWARE", "CACHE_AWARE", 1, 0.930, 0.022, 0.030),
             _run("vllm-router consistent_hash", "consistent_hash", 1, 0.945, 0.020, 0.030)]
    # The new run: 0.8 point behind on hits (within 1.0), 5 % behind on P50 (within 10 %),
    # 20 % behind on P90 (beyond the 0 % P90 noise).
    new = [_run("prefixroute CACHE_AWARE", "CACHE_AWARE", 1, 0.937, 0.021, 0.036),
           _run("vllm-router consistent_hash", "consistent_hash", 1, 0.945, 0.020, 0.030)]
    new_path, a_path, b_path = _files(tmp_path, new, old_a, old_b)
    assert report.main([str(new_path), "--noise-from", str(a_path), str(b_path)]) == 0
    out = capsys.readouterr().out
    assert "| hit | 0.5 pts | 1.0 pts | 2 |" in out  # spreads 1.0 and 0.0 points
    assert "| P50 | 5 % | 10 % | 2 |" in out
    assert ("| w | 1 | 93.7 % / 94.5 % vllm consistent_hash | 21 ms / 20 ms vllm consistent_hash | "
            "36 ms / 30 ms vllm consistent_hash **behind** | no |") in out
    # Judged without it, one file: every loss counts.
    assert report.main([str(new_path)]) == 0
    assert "93.7 % / 94.5 % vllm consistent_hash **behind**" in capsys.readouterr().out


def test_noise_from_one_file_is_refused(tmp_path, capsys):
    new_path, a_path = _files(tmp_path, [_run("prefixroute CACHE_AWARE", "CACHE_AWARE", 1, 0.9, 0.02, 0.03)],
                              [_run("prefixroute CACHE_AWARE", "CACHE_AWARE", 1, 0.9, 0.02, 0.03)])
    with pytest.raises(SystemExit):
        report.main([str(new_path), "--noise-from", str(a_path)])
    assert "no cell has hit, P50, P90 in two of these files" in capsys.readouterr().err


def test_noise_from_refuses_a_file_twice_or_a_judged_file(tmp_path, capsys):
    run = [_run("prefixroute CACHE_AWARE", "CACHE_AWARE", 1, 0.9, 0.02, 0.03)]
    new_path, a_path, b_path = _files(tmp_path, run, run, run)
    with pytest.raises(SystemExit):
        report.main([str(new_path), "--noise-from", str(a_path), str(tmp_path / "." / a_path.name)])
    assert "a file is named twice" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        report.main([str(new_path), "--noise-from", str(new_path), str(b_path)])
    assert "a file judged is also a noise file" in capsys.readouterr().err


def test_bad_runs_and_missing_figures_are_refused_or_not_leads(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text('{"runs": [{}]}')
    with pytest.raises(SystemExit):
        report.main([str(bad)])
    assert "run 0 is not a benchmark run" in capsys.readouterr().err
    # Noise files without any P90: refused, not taken as 0 noise.
    a = [_run("prefixroute CACHE_AWARE", "CACHE_AWARE", 1, 0.9, 0.02, None)]
    b = [_run("prefixroute CACHE_AWARE", "CACHE_AWARE", 1, 0.8, 0.03, None)]
    # The judged run's P90 is unknown: not a lead on P90; a peer without P50 is left out.
    new = [_run("prefixroute CACHE_AWARE", "CACHE_AWARE", 1, 0.95, 0.02, None),
           _run("vllm-router consistent_hash", "consistent_hash", 1, 0.90, None, 0.03),
           _run("haproxy hash-balance-factor", "hash", 1, 0.80, 0.05, 0.04)]
    new_path, a_path, b_path = _files(tmp_path, new, a, b)
    with pytest.raises(SystemExit):
        report.main([str(new_path), "--noise-from", str(a_path), str(b_path)])
    assert "no cell has P90 in two of these files" in capsys.readouterr().err
    table = report.cells(report.load_runs([new_path]))
    (v,) = report.verdicts({c: report.median_run(r) for c, r in table.items()}, report.noise(table))
    assert v.best["P50"] == ("haproxy hash-balance-factor", 0.05) and v.leads["P50"]
    assert v.best["P90"][0] == "vllm-router consistent_hash" and not v.leads["P90"] and not v.all_lead


def test_noise_from_names_settings_that_differ(tmp_path, capsys):
    run = [_run("prefixroute CACHE_AWARE", "CACHE_AWARE", 1, 0.9, 0.02, 0.03),
           _run("vllm-router consistent_hash", "consistent_hash", 1, 0.9, 0.02, 0.03)]
    paths = []
    for i, threshold in enumerate((64, 32, 32)):
        path = tmp_path / f"s{i}.json"
        path.write_text(json.dumps({"runs": run, "settings": {"cache_aware_threshold": threshold, "replicas": [i]}}))
        paths.append(path)
    assert report.main([str(paths[0]), "--noise-from", str(paths[1]), str(paths[2])]) == 0
    err = capsys.readouterr().err
    assert "settings differ (judged / noise): cache_aware_threshold: 64 / 32" in err
    assert "replicas" not in err.split("note:")[0]  # replica counts may differ
    assert "1 of 1 judged groups have noise cells of their own" in err


def test_subject_judges_the_precise_arm_of_a_precise_run(tmp_path, capsys):
    runs = [_run("prefixroute CACHE_AWARE", "CACHE_AWARE", 4, 0.640, 1.500, 2.800),
            _run("prefixroute CACHE_AWARE precise", "CACHE_AWARE", 4, 0.690, 0.500, 1.100),
            _run("vllm-router consistent_hash", "consistent_hash", 4, 0.685, 1.100, 5.700),
            _run("prefixroute CACHE_AWARE", "CACHE_AWARE", 1, 0.670, 0.400, 0.900),
            _run("prefixroute CACHE_AWARE precise", "CACHE_AWARE", 1, 0.700, 0.400, 0.900)]
    (path,) = _files(tmp_path, runs)
    medians = {c: report.median_run(r) for c, r in report.cells(report.load_runs([path])).items()}
    tol = report.noise(report.cells(report.load_runs([path])))
    # the learned view by default, the arm --subject names otherwise; neither is a peer of the other
    (learned,) = report.verdicts(medians, tol)  # (no peer ran with 1 replica: one group)
    (precise,) = report.verdicts(medians, tol, "prefixroute CACHE_AWARE precise")
    assert report.replica_drift(medians) == {"w": {1: 0.670, 4: 0.640}}
    assert report.replica_drift(medians, "prefixroute CACHE_AWARE precise") == {"w": {1: 0.700, 4: 0.690}}
    assert learned.subject["hit"] == 0.640 and not learned.all_lead
    assert precise.subject["hit"] == 0.690 and precise.all_lead
    assert {who for who, _ in precise.best.values()} == {"vllm-router consistent_hash"}
    assert report.main([str(path), "--subject", "prefixroute CACHE_AWARE precise", "--tables"]) == 0
    out = capsys.readouterr().out
    assert "| workload | replicas | hit: CACHE_AWARE precise / best peer |" in out
    assert "CACHE_AWARE precise leads on hit rate, P50 and P90 TTFT (within the noise above) in 1 of 1 groups" in out
    assert "| **prefixroute CACHE_AWARE precise** | 4 |" in out and "| prefixroute CACHE_AWARE | 4 |" in out
    assert "| w | 70.0 % | 69.0 % | - | -1.0 pts |" in out  # the drift of the arm judged


def test_a_subject_no_run_has_is_refused(tmp_path, capsys):
    (path,) = _files(tmp_path, [_run("prefixroute CACHE_AWARE", "CACHE_AWARE", 1, 0.9, 0.02, 0.03),
                                _run("vllm-router consistent_hash", "consistent_hash", 1, 0.9, 0.02, 0.03)])
    with pytest.raises(SystemExit) as exc:
        report.main([str(path), "--subject", "prefixroute CACHE_AWARE precise"])
    assert exc.value.code == 2
    assert "no CACHE_AWARE run is labelled 'prefixroute CACHE_AWARE precise' (the files have: " \
           "'prefixroute CACHE_AWARE')" in capsys.readouterr().err
