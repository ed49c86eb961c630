"""The emulated engine's KV events: what the core records, and the ZeroMQ publisher."""

from __future__ import annotations

import argparse
import asyncio
import random
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
import zmq
import zmq.asyncio

from prefixroute.core.kvevents.codec import decode_batch
from prefixroute.core.kvevents.events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch
from prefixroute.engine import cli
from prefixroute.engine.core import EngineCore
from prefixroute.engine.kv_events import KvEventRecorder
from prefixroute.engine.kv_publisher import END_SEQ, KvEventsSettings, binds
from prefixroute.engine.kvcache import PrefixCache, prompt_block_hashes
from prefixroute.engine.model import EngineConfig
from prefixroute.engine.server import ENGINE_KEY, EngineServer, start_engine_server
from prefixroute.engine.tokenizer import encode, from_token_ids, tokenize_text

SMALL = EngineConfig(kv_capacity_tokens=40 * 16, max_num_seqs=4, max_num_batched_tokens=256)


def findable(cache: PrefixCache) -> set[int]:
    """Internal hashes of every block a lookup can find (the cache's extents)."""
    return {h for e in cache._first.values() for h in e.hashes[e.start:e.end]}


def apply(held: dict[int, tuple[int, ...]], events: list[Any], block_size: int) -> None:
    """Apply events to ``held``: engine hash -> its block's token ids."""
    for e in events:
        if isinstance(e, BlockStored):
            assert e.block_size == block_size and e.medium == "GPU" and e.lora_name is None and e.lora_id is None
            for i, h in enumerate(e.block_hashes):
                assert h not in held, "a block is stored twice without a removal"
                held[h] = tuple(e.token_ids[i * block_size:(i + 1) * block_size])
        elif isinstance(e, BlockRemoved):
            for h in e.block_hashes:
                del held[h]
        else:
            held.clear()


def prompts(seed: int) -> list[list[int] | str]:
    rng = random.Random(seed)
    heads = [[rng.randrange(50_000) for _ in range(rng.randrange(16, 120))] for _ in range(4)]
    out: list[list[int] | str] = []
    for _ in range(30):
        if rng.random() < 0.3:
            out.append("shared text prompt " * rng.randrange(3, 12) + str(rng.random()))
        else:
            out.append(rng.choice(heads) + [rng.randrange(50_000) for _ in range(rng.randrange(1, 60))])
    return out


@pytest.mark.parametrize("seed", range(4))
def test_events_track_exactly_the_findable_blocks(seed: int) -> None:
    rec = KvEventRecorder(SMALL.block_size, hash_seed=seed)
    core = EngineCore(SMALL, events=rec)
    held: dict[int, tuple[int, ...]] = {}
    rng = random.Random(seed)
    for i, p in enumerate(prompts(seed)):
        core.add_request(f"r{i}", p, rng.randrange(1, 40))
        for _ in range(rng.randrange(0, 6)):
            core.step()
            apply(held, rec.take(), SMALL.block_size)
            assert set(held) == {rec.engine_hash(h) for h in findable(core.cache)}
    while core.has_work():
        core.step()
        apply(held, rec.take(), SMALL.block_size)
        assert set(held) == {rec.engine_hash(h) for h in findable(core.cache)}
    assert held and rec.num_tracked_blocks == len(held)
    # Every block's token ids are those of the prompt it came from.
    for p in prompts(seed):
        tokens = from_token_ids(p) if isinstance(p, list) else tokenize_text(p)
        ids = p if isinstance(p, list) else encode(p)
        for k, h in enumerate(prompt_block_hashes(tokens, SMALL.block_size)):
            eh = rec.engine_hash(h)
            if eh in held:
                assert held[eh] == tuple(ids[k * 16:(k + 1) * 16])


def test_stored_events_chain_by_engine_hashes_and_hide_the_internal_ones() -> None:
    ids = list(range(1000, 1100))  # 6 full blocks
    a, b = KvEventRecorder(16, hash_seed=1), KvEventRecorder(16, hash_seed=2)
    stored, cores = {}, {}
    for rec in (a, b):
        core = cores[rec] = EngineCore(EngineConfig(), events=rec)
        core.add_request("r", ids, 1)
        core.step()
        (event,) = rec.take()
        stored[rec] = event
    internal = prompt_block_hashes(from_token_ids(ids), 16)
    ea = stored[a]
    assert ea.parent_block_hash is None and len(ea.block_hashes) == 6 and ea.token_ids == ids[:96]
    assert ea.block_hashes == [a.engine_hash(h) for h in internal]
    assert not set(ea.block_hashes) & set(internal)  # never the cache's own hashes
    assert not set(ea.block_hashes) & set(stored[b].block_hashes)  # another NONE_HASH, other hashes
    assert KvEventRecorder(16, hash_seed=1).engine_hash(internal[0]) == ea.block_hashes[0]
    assert KvEventRecorder(16).none_hash != KvEventRecorder(16).none_hash  # random when not seeded
    # A later block chains to the previous event's last one.
    core = cores[a]
    core.add_request("r2", ids[:96] + list(range(30)), 1)
    while core.has_work():
        core.step()
    (later,) = a.take()
    assert later.parent_block_hash == ea.block_hashes[-1] and len(later.block_hashes) == 1


def test_text_prompt_token_ids_include_the_padded_tail() -> None:
    rec = KvEventRecorder(4, hash_seed=0)
    core = EngineCore(EngineConfig(block_size=4), events=rec)
    text = "abcdefghijklmnopq"  # 17 bytes: 5 tokens, the last one of 1 byte
    core.add_request("r", text, 4)
    while core.has_work():
        core.step()
    stored = [e for e in rec.take() if isinstance(e, BlockStored)]
    tokens = [t for e in stored for t in e.token_ids]
    assert tokens[:5] == encode(text)  # the prompt, then generated words
    assert len(tokens) == 8 and all(t >> 32 == 4 for t in tokens[5:])


def test_reset_prefix_cache_clears_and_is_refused_while_running() -> None:
    rec = KvEventRecorder(16, hash_seed=0)
    core = EngineCore(EngineConfig(), events=rec)
    core.add_request("r", list(range(64)), 3)
    core.step()
    assert not core.reset_prefix_cache()
    while core.has_work():
        core.step()
    rec.take()
    assert core.reset_prefix_cache()
    assert rec.take() == [AllBlocksCleared()] and rec.num_tracked_blocks == 0
    assert core.cache.lookup(prompt_block_hashes(from_token_ids(list(range(64))), 16)) == 0


def test_settings_validation_and_vllm_flag() -> None:
    s = KvEventsSettings.from_vllm_config('{"enable_kv_cache_events": true, "publisher": "zmq", '
                                          '"endpoint": "tcp://*:6000", "replay_endpoint": "tcp://*:6001", '
                                          '"topic": "kv", "buffer_steps": 5, "max_queue_size": 9}', encoding="map")
    assert s == KvEventsSettings("tcp://*:6000", "tcp://*:6001", "kv", 5, 100_000, "map", None)
    assert KvEventsSettings.from_vllm_config('{"enable_kv_cache_events": false}') is None
    assert KvEventsSettings.from_vllm_config('{"enable_kv_cache_events": true, "publisher": "null"}') is None
    for bad, message in [("[]", "JSON object"), ("{", "not valid JSON"), ('{"endpont": "x"}', "unknown key"),
                         ('{"enable_kv_cache_events": true, "publisher": "kafka"}', "not 'zmq'"),
                         ('{"enable_kv_cache_events": true, "endpoint": "http://x"}', "not a tcp://"),
                         ('{"enable_kv_cache_events": true, "buffer_steps": 0}', "must be an integer >= 1")]:
        with pytest.raises(ValueError, match=message):
            KvEventsSettings.from_vllm_config(bad)
    with pytest.raises(ValueError, match="encoding"):
        KvEventsSettings(encoding="json")  # type: ignore[arg-type]
    assert binds("tcp://*:1") and binds("tcp://[::]:1") and binds("ipc:///tmp/x") and not binds("tcp://10.0.0.1:1")
    parser = argparse.ArgumentParser()
    cli.configure_parser(parser)
    assert cli.run(parser.parse_args(["--kv-events-hash-seed", "3"])) == 2
    assert cli.run(parser.parse_args(["--kv-events-config", '{"x": 1}'])) == 2


# -- the publisher over real ZeroMQ sockets ------------------------------------------------


async def started(encoding: str, seed: int = 5, **extra: Any) -> tuple[Any, EngineServer, str]:
    settings = KvEventsSettings("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", "kv-test", encoding=encoding,
                                hash_seed=seed, **extra)
    runner, port = await start_engine_server(SMALL, "127.0.0.1", 0, 0.0, "ev", kv_events=settings)
    return runner, runner.app[ENGINE_KEY], f"http://127.0.0.1:{port}"


@pytest.fixture
async def zctx() -> AsyncIterator[zmq.asyncio.Context]:
    ctx = zmq.asyncio.Context()
    yield ctx
    ctx.destroy(linger=0)


async def subscribe(ctx: zmq.asyncio.Context, endpoint: str) -> zmq.asyncio.Socket:
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(endpoint)
    await asyncio.sleep(0.2)  # the subscription reaches the publisher
    return sub


async def drain(sub: zmq.asyncio.Socket, quiet_s: float = 0.3) -> list[list[bytes]]:
    out = []
    while True:
        try:
            out.append(await asyncio.wait_for(sub.recv_multipart(), quiet_s))
        except asyncio.TimeoutError:
            return out


async def run_requests(url: str, bodies: list[dict[str, Any]]) -> None:
    async with aiohttp.ClientSession() as session:
        for body in bodies:
            async with session.post(url + "/v1/completions", json=body) as resp:
                assert resp.status == 200, await resp.text()


BODIES = [{"prompt": list(range(i * 7, i * 7 + 90)), "max_tokens": 20} for i in range(8)]


async def test_published_stream_is_vllms_wire_and_both_encodings_agree(zctx: zmq.asyncio.Context) -> None:
    decoded = {}
    for encoding in ("array", "map"):
        runner, server, url = await started(encoding)
        try:
            assert server.publisher is not None
            sub = await subscribe(zctx, server.publisher.endpoint)
            await run_requests(url, BODIES)
            messages = await drain(sub)
        finally:
            await runner.cleanup()
        assert messages and all(len(m) == 3 and m[0] == b"kv-test" for m in messages)
        seqs = [int.from_bytes(m[1], "big") for m in messages]
        assert seqs == list(range(len(messages)))  # 8-byte big-endian, from 0, no gap
        batches = [decode_batch(m[2]) for m in messages]
        assert all(b.unknown == b.malformed == 0 for b in batches)
        decoded[encoding] = [list(b.batch.events) for b in batches]
    assert decoded["array"] == decoded["map"]  # same engine, same seed: the same events
    kinds = {type(e) for events in decoded["array"] for e in events}
    assert kinds == {BlockStored, BlockRemoved}  # the small cache evicted


async def test_replay_serves_the_buffer_from_a_sequence(zctx: zmq.asyncio.Context) -> None:
    runner, server, url = await started("array", buffer_steps=4)
    try:
        assert server.publisher is not None
        sub = await subscribe(zctx, server.publisher.endpoint)
        await run_requests(url, BODIES[:4])
        live = await drain(sub)
        assert len(live) > 4
        dealer = zctx.socket(zmq.DEALER)
        dealer.connect(server.publisher.replay_endpoint)

        async def replay(start: int) -> list[tuple[int, bytes]]:
            await dealer.send_multipart([b"", start.to_bytes(8, "big")])
            got = []
            while True:
                empty, seq, payload = await asyncio.wait_for(dealer.recv_multipart(), 5)
                assert empty == b""
                if seq == END_SEQ:
                    assert payload == b""
                    return got
                got.append((int.from_bytes(seq, "big"), payload))

        last = len(live) - 1
        assert await replay(last - 1) == [(s, p) for _, s, p in [(m[0], int.from_bytes(m[1], "big"), m[2])
                                                               for m in live[-2:]]]
        assert [s for s, _ in await replay(0)] == list(range(last - 3, last + 1))  # only 4 kept
        assert await replay(last + 10) == []
        await dealer.send_multipart([b"", b"short"])  # malformed: ignored, the socket keeps serving
        assert [s for s, _ in await replay(last)] == [last]
        async with aiohttp.ClientSession() as session:
            async with session.post(url + "/reset_prefix_cache") as resp:
                assert resp.status == 200
            async with session.get(url + "/info") as resp:
                info = (await resp.json())["kv_events"]
        (cleared,) = await drain(sub)
        assert decode_batch(cleared[2]).batch.events == [AllBlocksCleared()]
        assert info["endpoint"] == server.publisher.endpoint and info["encoding"] == "array"
        assert info["published"] == len(live) + 1 and info["block_size"] == 16
        dealer.close(linger=0)
    finally:
        await runner.cleanup()


async def test_a_publisher_that_connects_reaches_a_bound_subscriber(zctx: zmq.asyncio.Context) -> None:
    # An XSUB that subscribes by hand once the engine has connected (the libzmq here does
    # not pass a bound SUB's subscription to a PUB that connects later).
    sub = zctx.socket(zmq.XSUB)
    port = sub.bind_to_random_port("tcp://127.0.0.1")
    settings = KvEventsSettings(f"tcp://127.0.0.1:{port}", hash_seed=1)
    runner, p = await start_engine_server(SMALL, "127.0.0.1", 0, 0.0, kv_events=settings)
    try:
        await asyncio.sleep(0.2)
        await sub.send(b"\x01")  # subscribe to every topic
        await asyncio.sleep(0.2)
        await run_requests(f"http://127.0.0.1:{p}", BODIES[:1])
        (first, *_) = await drain(sub)
        assert int.from_bytes(first[1], "big") == 0
        assert isinstance(decode_batch(first[2]).batch, EventBatch)
    finally:
        await runner.cleanup()
