"""bench/scrape_parse.py runs, at a small size, on pages the direct reading takes whole,
and both readings give the same figures."""

from __future__ import annotations

import json
from pathlib import Path

from prefixroute.server.exposition import _plain


def test_scrape_parse_benchmark_runs_and_reports(tmp_path: Path, load_bench) -> None:
    bench = load_bench("scrape_parse")
    for extra in (False, True):  # prometheus-client's own pages are plain: the direct path is what is timed
        text = bench.page(extra)
        assert _plain(text.split("\n")) is not None
    out = tmp_path / "scrape.json"
    assert bench.main(["--number", "5", "--repeats", "1", "--json", str(out)]) == 0  # 1: the readings differ
    rows = json.loads(out.read_text())["rows"]
    assert [r["page"] for r in rows] == ["small", "vllm-like"]
    assert rows[0]["lines"] < 60 < 500 < rows[1]["lines"]
    assert all(r["direct_us"] > 0 and r["parser_us"] > 0 for r in rows)
