"""Trace replay: Mooncake and prefixroute JSONL, keys and KV blocks rebuilt from digests."""

from __future__ import annotations

import itertools

import orjson
import pytest

from prefixroute.core.keys import render_chat_text
from prefixroute.engine.core import EngineCore
from prefixroute.engine.model import EngineConfig
from prefixroute.workloads.shared_prefix import SharedPrefixWorkload
from prefixroute.workloads.traces import (
    TRACE_FORMAT,
    TraceError,
    chained_block_digests,
    load_trace,
    make_trace_record,
    unpack_digests,
)

MOONCAKE = [
    {"timestamp": 0, "input_length": 1200, "output_length": 20, "hash_ids": [0, 1, 2]},
    {"timestamp": 0, "input_length": 1300, "output_length": 30, "hash_ids": [0, 3, 4]},
    {"timestamp": 3052, "input_length": 1100, "output_length": 10, "hash_ids": [0, 1, 5]},
    {"timestamp": 1500, "input_length": 300, "output_length": 5, "hash_ids": [6]},
]


def write_jsonl(path, rows) -> None:
    path.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows))


def recorded_trace(path, workload: SharedPrefixWorkload, n: int, t0: float = 1.7e9) -> None:
    """What `prefixroute serve --record-trace` writes for these requests (no router needed)."""
    rows = []
    for s in itertools.islice(workload.sessions(), n):
        body = s.body(0, [])
        rows.append(make_trace_record(timestamp=t0 + s.start_s, endpoint="default", variant="AllTraffic",
                                      api="openai-chat", scope=body["model"], tenant="", instance="",
                                      decision="random", routing_data=render_chat_text(body),
                                      max_tokens=body["max_tokens"]))
    write_jsonl(path, reversed(rows))  # the recorder writes in order of completion, not arrival


def test_mooncake_trace_is_read_in_arrival_order(tmp_path) -> None:
    p = tmp_path / "mooncake.jsonl"
    write_jsonl(p, MOONCAKE)
    wl = load_trace(p, speedup=2.0)
    assert wl.format == "mooncake" and len(wl.records) == 4
    assert [r.arrival_s for r in wl.records] == [0.0, 0.0, 1.5, 3.052]
    assert [s.start_s for s in wl.sessions()] == [0.0, 0.0, 0.75, 1.526]
    assert [r.output_tokens for r in wl.records] == [20, 30, 5, 10]
    a, b, d, c = (r.prompt for r in wl.records)
    assert a.num_tokens == 1200
    ha, hb, hc = (x.engine_prompt(16).block_hashes for x in (a, b, c))
    assert len(ha) == 1200 // 16
    assert ha[:32] == hb[:32] == hc[:32]  # hash id 0: the first 512 tokens are shared
    assert ha[32] != hb[32] and ha[:64] == hc[:64] and ha[64] != hc[64]
    # a PrefixLength of 2,048 characters = 512 tokens keys on the first block only
    assert a.routing_key(2048) == b.routing_key(2048) == c.routing_key(2048)
    assert a.routing_key(4096) != b.routing_key(4096)
    assert a.routing_key(4096) == c.routing_key(4096)
    assert a.routing_key(8192) != c.routing_key(8192)


def test_prefixroute_trace_rebuilds_keys_and_cache_hits(tmp_path) -> None:
    wl = SharedPrefixWorkload(groups=3, prefix_tokens=600, question_tokens=30, output_tokens=7, seed=2)
    p = tmp_path / "trace.jsonl"
    recorded_trace(p, wl, 12)
    trace = load_trace(p)
    assert trace.format == "prefixroute" and len(trace.records) == 12
    sessions = list(itertools.islice(wl.sessions(), 12))
    assert [r.arrival_s for r in trace.records] == pytest.approx([s.start_s - sessions[0].start_s for s in sessions],
                                                                abs=1e-5)
    assert all(r.output_tokens == 7 for r in trace.records)
    groups = [s.group for s in sessions]
    prompts = [r.prompt for r in trace.records]
    for (i, gi), (j, gj) in itertools.combinations(enumerate(groups), 2):
        # 1,024 characters lie inside the shared document; 4,096 reach the question
        assert (prompts[i].routing_key(1024) == prompts[j].routing_key(1024)) == (gi == gj)
        assert prompts[i].routing_key(4096) != prompts[j].routing_key(4096)
    # replayed into an engine, a request finds its group's document cached
    core = EngineCore(EngineConfig())
    hits = []
    for k, pr in enumerate(prompts):
        core.add_request(str(k), pr.engine_prompt(16), 2)
        cached = None
        while core.has_work():
            for o in core.step().outputs:
                if o.finished:
                    cached = o.cached_tokens
        hits.append(cached)
    for k, g in enumerate(groups):
        if g in groups[:k]:
            assert hits[k] >= 600 - 16
        else:
            assert hits[k] < 100


def test_trace_records_never_hold_prompt_text() -> None:
    text = "SECRET-document " * 200
    rec = make_trace_record(timestamp=1.0, endpoint="e", variant="v", api="openai-chat", scope="m", tenant="acme",
                            instance="http://x", decision="affinity", routing_data=text, max_tokens=3)
    line = orjson.dumps(rec)
    assert b"SECRET" not in line and b"acme" not in line
    assert rec["format"] == TRACE_FORMAT and rec["length"] == len(text) and rec["unit"] == "chars"
    assert list(unpack_digests(rec["digests"])) == chained_block_digests(text)
    assert len(unpack_digests(rec["digests"])) == -(-len(text) // 64)
    native = make_trace_record(timestamp=1.0, endpoint="e", variant="v", api="native", scope="e", tenant="",
                               instance="", decision="", routing_data=b'{"inputs": "x"}', max_tokens=None)
    assert native["unit"] == "bytes" and native["length"] == 15 and len(unpack_digests(native["digests"])) == 1
    tokens = make_trace_record(timestamp=1.0, endpoint="e", variant="v", api="openai-completions", scope="m",
                               tenant="", instance="", decision="", routing_data=list(range(130)), max_tokens=None)
    assert tokens["unit"] == "tokens" and len(unpack_digests(tokens["digests"])) == 3


def test_version_1_lines_are_still_read(tmp_path) -> None:
    text = "shared document " * 100
    v2 = make_trace_record(timestamp=5.0, endpoint="e", variant="v", api="openai-chat", scope="m", tenant="",
                           instance="http://x", decision="affinity", routing_data=text, max_tokens=3)
    v1 = dict(v2, format="prefixroute-trace/1", timestamp=6.0,
              blocks=[f"{d:016x}" for d in unpack_digests(v2["digests"])])
    del v1["digests"]
    path = tmp_path / "t.jsonl"
    path.write_bytes(orjson.dumps(v1) + b"\n" + orjson.dumps(v2) + b"\n")
    old, new = load_trace(path).records
    assert list(old.prompt.digests) == list(new.prompt.digests) == chained_block_digests(text)
    assert old.prompt.routing_key(1024) == new.prompt.routing_key(1024)
    # The packed digests: 10.7 characters each instead of 19.
    assert len(v2["digests"]) < 0.6 * len(orjson.dumps(v1["blocks"]))


def test_chained_digests_identify_prefixes() -> None:
    a = chained_block_digests("x" * 64 + "y" * 64 + "z")
    b = chained_block_digests("x" * 64 + "y" * 64 + "w")
    c = chained_block_digests("q" * 64 + "y" * 64)
    assert a[:2] == b[:2] and a[2] != b[2]
    assert c[1] != a[1]  # same block after a different prefix
    assert chained_block_digests("") == []


@pytest.mark.parametrize("content, message", [
    (b"not json\n", "not JSON"),
    (b'{"foo": 1}\n', "neither a Mooncake line"),
    (b'{"hash_ids": [1], "timestamp": 0}\n', "bad mooncake record"),
    (b"\n\n", "no records"),
])
def test_bad_traces_are_refused_with_file_and_line(tmp_path, content, message) -> None:
    p = tmp_path / "bad.jsonl"
    p.write_bytes(content)
    with pytest.raises(TraceError, match=message):
        load_trace(p)
    with pytest.raises(TraceError, match="cannot read"):
        load_trace(tmp_path / "missing.jsonl")
