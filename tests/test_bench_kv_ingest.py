"""bench/kv_ingest.py runs, at a small size, and reports what it ingested."""

from __future__ import annotations

import json
from pathlib import Path


def test_kv_ingest_benchmark_runs_and_reports(tmp_path: Path, load_bench) -> None:
    bench = load_bench("kv_ingest")
    out = tmp_path / "kv.json"
    bench.main(["--requests", "60", "--documents", "5", "--prefix-tokens", "400", "--kv-blocks", "200",
                "--rounds", "1", "--json", str(out)])
    doc = json.loads(out.read_text())
    rows = doc["rows"]
    assert [(r["path"], r["events"], r["encoding"]) for r in rows] == [
        ("core", "as published", "array"), ("core", "as published", "map"), ("core + bytes", "as published", "array"),
        ("core", "1 block/event", "array"), ("core", "1 block/event", "map"), ("core + bytes", "1 block/event", "array")]
    blocks = {r["blocks"] for r in rows}
    assert len(blocks) == 1 and blocks.pop() > 500  # the same changes in every row, evictions included
    assert all(r["blocks_per_s"] > 0 and r["messages"] > 0 for r in rows)
    assert doc["lookup_us"]["instances"] == 8 and doc["lookup_us"]["keys"] > 0 and doc["lookup_us"]["walk"] > 0
    assert doc["lookup_us"]["walk_blocks"] >= 10  # the walk finds the held documents' blocks
