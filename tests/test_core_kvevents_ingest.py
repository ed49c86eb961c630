"""Event ingestion in the router's core: keys rebuilt from token ids, the per-instance
index, the stream's sequence/gap/replay/restart rules, and the view a policy asks."""

from __future__ import annotations

import random
from typing import Any

import pytest

from prefixroute.core.kvevents.chain import block_keys, chain_root
from prefixroute.core.kvevents.codec import encode_batch
from prefixroute.core.kvevents.events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch
from prefixroute.core.kvevents.index import InstanceIndex, SharedIndex
from prefixroute.core.kvevents.stream import InstanceStream, Mode, RequestReplay, StreamSettings
from prefixroute.core.kvevents.view import PrefixHolding, PreciseCacheView
from prefixroute.core.model_tokenizer import ModelTokenizer
from prefixroute.engine.core import EngineCore
from prefixroute.engine.kv_events import KvEventRecorder
from prefixroute.engine.kvcache import prompt_block_hashes
from prefixroute.engine.model import EngineConfig
from prefixroute.engine.tiers import MemorySharedTier
from prefixroute.engine.tokenizer import from_token_ids

BS = 16
SYSTEM = "You answer questions about the cache router and its engine, briefly and precisely. " * 12


@pytest.fixture(scope="module")
def tiny() -> ModelTokenizer:
    return ModelTokenizer.load("tiny")


class Engine:
    """An EngineCore with a recorder, publishing numbered message frames like the publisher."""

    def __init__(self, config: EngineConfig = EngineConfig(max_num_batched_tokens=4096), *, seed: int = 1,
                 lora: str | None = None, shared: MemorySharedTier | None = None) -> None:
        self.rec = KvEventRecorder(config.block_size, hash_seed=seed, lora_name=lora)
        self.core = EngineCore(config, events=self.rec, shared_tier=shared)
        self.seq = 0
        self.n = 0

    def run(self, token_ids: list[int], max_tokens: int = 4, encoding: str = "array") -> list[list[bytes]]:
        self.n += 1
        self.core.add_request(f"r{self.n}", token_ids, max_tokens)
        frames = []
        while self.core.has_work():
            self.core.step()
            events = self.rec.take()
            if events:
                frames.append(self.frame(events, encoding))
        return frames

    def frame(self, events: list[Any], encoding: str = "array") -> list[bytes]:
        seq = self.seq
        self.seq += 1
        return [b"", seq.to_bytes(8, "big"), encode_batch(EventBatch(0.0, events), encoding)]  # type: ignore[arg-type]


def feed(stream: InstanceStream, frames: list[list[bytes]], now: float = 0.0) -> list[RequestReplay]:
    actions: list[RequestReplay] = []
    for f in frames:
        actions += stream.on_message(f, now)
    return actions


def chat(question: str, *history: str) -> dict[str, Any]:
    msgs = [{"role": "system", "content": SYSTEM}]
    for i, h in enumerate(history):
        msgs.append({"role": "user" if i % 2 == 0 else "assistant", "content": h})
    msgs.append({"role": "user", "content": question})
    return {"messages": msgs}


# -- correctness: the router's chain is the engine's -------------------------------------


@pytest.mark.parametrize("lora", [None, "adapter-a"])
def test_router_chain_equals_the_chain_rebuilt_from_engine_events(tiny: ModelTokenizer, lora: str | None) -> None:
    engine = Engine(lora=lora)
    view = PreciseCacheView(BS)
    stream = view.add_instance("i")
    requests = [(chat("What is a block?"), True), (chat("And a chain?", "What is a block?", "A unit."), True),
                ({"prompt": SYSTEM + " Complete this:"}, False), ({"prompt": list(range(500, 700))}, False)]
    for payload, is_chat in requests:
        ids = tiny.request_token_ids(payload, is_chat)
        feed(stream, engine.run(ids))
        keys = view.request_keys(ids, lora)
        assert len(keys) == len(ids) // BS > 0
        # Every full block of the prompt was stored by the engine and is held under the router's key.
        assert all(k in stream.index.held for k in keys)
        assert view.holdings(keys)["i"] == PrefixHolding(len(keys) * BS, 0, 0)
        # The engine's own hashes are opaque: they are not the router's keys.
        assert not set(keys) & set(stream.index.keys)
        # The base model's chain and an adapter's never match each other.
        other = view.request_keys(ids, None if lora else "adapter-a")
        assert view.holdings(other)["i"].total_tokens == 0
    assert stream.index.counters.orphaned == stream.index.counters.malformed_events == 0


def test_router_keys_do_not_depend_on_the_engine_seed(tiny: ModelTokenizer) -> None:
    ids = tiny.request_token_ids(chat("Why?"), True)
    held = []
    for seed in (1, 2):
        view = PreciseCacheView(BS)
        feed(view.add_instance("i"), Engine(seed=seed).run(ids))
        held.append(set(view.stream("i").index.held))  # type: ignore[union-attr]
    assert held[0] == held[1] and held[0] >= set(view.request_keys(ids))


def test_both_encodings_decode_to_the_same_state() -> None:
    rng = random.Random(3)
    states = []
    for encoding in ("array", "map"):
        engine = Engine(EngineConfig(kv_capacity_tokens=30 * BS, max_num_batched_tokens=512, cpu_tier_tokens=40 * BS),
                        shared=MemorySharedTier(50))
        view = PreciseCacheView(BS)
        stream = view.add_instance("i")
        rng.seed(3)
        heads = [[rng.randrange(30_000) for _ in range(rng.randrange(20, 200))] for _ in range(5)]
        for _ in range(40):
            feed(stream, engine.run(rng.choice(heads) + [rng.randrange(30_000)] * rng.randrange(1, 40), 3, encoding))
        states.append((dict(stream.index.held), dict(stream.index.keys), dict(view.shared.held)))
    assert states[0] == states[1] and states[0][0] and states[0][2]


def test_index_follows_the_engine_through_evictions_and_tiers() -> None:
    cfg = EngineConfig(kv_capacity_tokens=24 * BS, max_num_batched_tokens=512, cpu_tier_tokens=30 * BS)
    shared = MemorySharedTier(40)
    engine = Engine(cfg, shared=shared)
    view = PreciseCacheView(BS)
    stream = view.add_instance("i")
    rng = random.Random(7)
    prompts = [[rng.randrange(30_000) for _ in range(rng.randrange(16, 150))] for _ in range(8)]
    for _ in range(60):
        p = rng.choice(prompts)
        feed(stream, engine.run(p, 3))
        # For every prompt, each block's tier in the router's view is its tier in the engine.
        for q in prompts:
            internal = prompt_block_hashes(from_token_ids(q), BS)
            keys = view.request_keys(q)
            gpu = {h for e in engine.core.cache._first.values() for h in e.hashes[e.start:e.end]}
            for h, k in zip(internal, keys):
                count = stream.index.held.get(k, 0)
                assert bool(count & 0xFFFFFF) == (h in gpu)
                assert (count >= 1 << 24) == (h in engine.core.cpu_tier)
                assert (k in view.shared.held) == (h in shared)
    assert stream.index.counters.unknown_removals == 0 and stream.index.counters.orphaned == 0


# -- the index --------------------------------------------------------------------------


def stored(hashes: list[int], parent: int | None, tokens: list[int], medium: str = "GPU", **kw: Any) -> BlockStored:
    return BlockStored(hashes, parent, tokens, BS, None, medium, kw.pop("lora", None), **kw)


def test_index_copies_orphans_and_ignored_events() -> None:
    shared = SharedIndex()
    index = InstanceIndex(BS, shared)
    t = list(range(48))
    k = block_keys(t, BS, chain_root())
    index.apply([stored([1, 2], None, t[:32]), stored([3], 2, t[32:48])])
    assert [index.held[x] for x in k] == [1, 1, 1] and index.keys == {1: k[0], 2: k[1], 3: k[2]}
    index.apply([stored([3], 2, t[32:48]), BlockRemoved([3])])  # a second copy, then one removed
    assert index.held[k[2]] == 1 and 3 in index.keys
    index.apply([stored([3], 2, t[32:48], "CPU"), BlockRemoved([3], "GPU")])  # offloaded
    assert index.held[k[2]] == 1 << 24
    index.apply([BlockRemoved([3], "CPU"), BlockRemoved([3, 99])])
    assert k[2] not in index.held and 3 not in index.keys and index.counters.unknown_removals == 2
    index.apply([stored([7], 123456, t[:16])])  # parent never seen
    index.apply([BlockStored([8], None, t[:8], 8, None, "GPU", None)])  # another block size
    index.apply([stored([9], None, t[:16], group_idx=1), stored([9], None, t[:16], "DISK"), BlockRemoved([1], "NVME")])
    index.apply([stored([10], None, [2**64] + t[:15])])  # a token id out of range
    c = index.counters
    assert (c.orphaned, c.ignored, c.malformed_events) == (1, 4, 1) and 7 not in index.keys
    index.apply([AllBlocksCleared()])
    assert len(index) == 0 and not index.keys and c.clears == 1 and c.batches == 9


def test_extra_keys_other_than_the_adapter_never_match_plain_requests() -> None:
    index = InstanceIndex(BS, SharedIndex())
    t = list(range(32))
    index.apply([stored([1], None, t[:16], lora="a", extra_keys=[["a"]]),
                 stored([5], None, t[:16], extra_keys=[[("mm-hash", 0)]])])
    assert block_keys(t[:16], BS, chain_root("a"))[0] in index.held  # the adapter's name alone: a match
    assert block_keys(t[:16], BS, chain_root())[0] not in index.held  # an image's hash: no match


def test_shared_tier_is_fleet_wide() -> None:
    view = PreciseCacheView(BS)
    a, b = view.add_instance("a"), view.add_instance("b")
    t = list(range(32))
    keys = view.request_keys(t)
    a.index.apply([stored([11, 12], None, t), stored([11, 12], None, t, "SHARED")])
    assert view.holdings(keys) == {"a": PrefixHolding(32, 0, 0), "b": PrefixHolding(0, 0, 32)}
    b.index.apply([BlockRemoved([12], "SHARED")])  # evicted by b's write: a's published hash
    assert view.holdings(keys)["b"] == PrefixHolding(0, 0, 16)
    assert view.holdings(keys, ["b", "nobody"])["nobody"] == PrefixHolding()


def test_holdings_are_gpu_then_cpu_then_shared_runs() -> None:
    view = PreciseCacheView(BS)
    s = view.add_instance("i")
    t = list(range(6 * BS))
    k = view.request_keys(t)
    hs = [100 + i for i in range(6)]
    s.index.apply([stored(hs[:2], None, t[:32]), stored(hs[2:4], hs[1], t[32:64], "CPU"),
                   stored(hs[4:5], hs[3], t[64:80], "SHARED"), stored(hs[5:], hs[4], t[80:], "GPU")])
    assert view.holdings(k)["i"] == PrefixHolding(32, 32, 16)  # block 5 (GPU) is after the shared run's end
    assert view.holdings(k[:1])["i"] == PrefixHolding(16, 0, 0) and view.holdings([])["i"] == PrefixHolding()


# -- the stream -------------------------------------------------------------------------


def two_engines_frames(n: int = 6) -> tuple[list[list[bytes]], Engine]:
    engine = Engine()
    frames = []
    rng = random.Random(1)
    for i in range(n):
        frames += engine.run([rng.randrange(30_000) for _ in range(40 + 16 * i)], 2)
    return frames, engine


def state(view: PreciseCacheView, instance: str = "i") -> dict[int, int]:
    return dict(view.stream(instance).index.held)  # type: ignore[union-attr]


def test_a_connection_is_trusted_only_once_a_message_has_come_through_it() -> None:
    # A fresh subscription knows nothing of what the engine stored before it listened,
    # and a reconnection nothing of a restart meanwhile: approximate until a message's
    # sequence number tells (then a catch-up, a reset, or nothing to do).
    frames, _ = two_engines_frames()
    view = PreciseCacheView(BS)
    s = view.add_instance("i")
    s.on_connected()
    assert (s.mode, s.reason) == (Mode.APPROXIMATE, "connected, no event yet")
    feed(s, frames[:3])
    assert s.mode is Mode.PRECISE and len(s.index) > 0
    s.on_disconnected()
    s.on_connected()
    assert (s.mode, s.reason) == (Mode.APPROXIMATE, "reconnected, no event since")
    feed(s, frames[3:])
    assert s.mode is Mode.PRECISE and s.counts.resets == 0  # the same engine, no gap
    s.on_disconnected()
    s.on_connected(complete=True)  # a driver that applies every change itself (the simulator)
    assert s.mode is Mode.PRECISE


def test_in_order_stream_is_precise_and_counts() -> None:
    frames, _ = two_engines_frames()
    view = PreciseCacheView(BS)
    s = view.add_instance("i")
    assert s.mode is Mode.APPROXIMATE and s.reason == "never connected"
    s.on_connected()
    assert feed(s, frames) == [] and s.mode is Mode.PRECISE and s.expected == len(frames)
    st, = view.status(5.0)
    assert (st.mode, st.messages, st.gaps, st.resets, st.last_message_age_s) == ("precise", len(frames), 0, 0, 5.0)
    s.on_disconnected()
    assert s.mode is Mode.APPROXIMATE and s.reason == "disconnected" and state(view)


def test_gap_is_repaired_by_replay() -> None:
    frames, _ = two_engines_frames()
    ref = PreciseCacheView(BS)
    feed(ref.add_instance("i"), frames)
    view = PreciseCacheView(BS)
    s = view.add_instance("i")
    feed(s, frames[:2])
    assert feed(s, [frames[4]]) == [RequestReplay(2)]  # 2 and 3 lost
    assert s.mode is Mode.APPROXIMATE and s.reason == "repairing a gap through replay"
    assert feed(s, [frames[5]]) == []  # held during the replay
    replayed = [(int.from_bytes(f[1], "big"), f[2]) for f in frames[2:]]
    assert s.on_replay(replayed, 1.0) == []
    assert s.mode is Mode.APPROXIMATE and s.backlog == 6  # the replay, then the two held: applied by drain()
    assert s.drain(3) == 3 and s.drain() == 0
    assert s.mode is Mode.PRECISE and state(view) == state(ref) and s.expected == len(frames)
    assert (s.counts.gaps, s.counts.replays, s.counts.resets) == (1, 1, 0)


def test_a_replay_that_no_longer_reaches_the_gap_resets() -> None:
    frames, _ = two_engines_frames()
    view = PreciseCacheView(BS)
    s = view.add_instance("i")
    feed(s, frames[:2])
    feed(s, [frames[5]], now=0.0)
    replayed = [(int.from_bytes(f[1], "big"), f[2]) for f in frames[4:]]  # the buffer starts at 4
    s.on_replay(replayed, 0.5)
    s.drain()
    only_tail = PreciseCacheView(BS, StreamSettings(replay=False))
    feed(only_tail.add_instance("i"), frames[4:])
    assert s.counts.resets == 1 and s.counts.replays_failed == 1 and state(view) == state(only_tail)
    assert s.last_reset is not None and "replay" in s.last_reset[0] and s.expected == len(frames)


def test_failed_replay_resets_and_goes_on_with_live_messages() -> None:
    frames, _ = two_engines_frames()
    view = PreciseCacheView(BS)
    s = view.add_instance("i")
    feed(s, frames[:2])
    feed(s, [frames[3], frames[4]])
    assert s.on_replay_failed(2.0) == [] and s.drain() == 0 and s.counts.resets == 1 and s.expected == 5
    tail = PreciseCacheView(BS, StreamSettings(replay=False))
    feed(tail.add_instance("i"), frames[3:5])
    assert state(view) == state(tail)
    assert s.on_replay([], 3.0) == []  # a late answer is ignored
    # the status says events flow, and the reset apart (its reason does not stick to the mode)
    assert s.reason == "events flowing" and s.last_reset is not None and "replay" in s.last_reset[0]
    st = view.status(12.0)[0]
    assert st.reason == "events flowing" and st.last_reset == s.last_reset[0]
    assert st.last_reset_age_s == 12.0 - s.last_reset[1]


def test_a_reset_from_outside_the_messages_is_dated_by_the_callers_clock() -> None:
    frames, _ = two_engines_frames()
    view = PreciseCacheView(BS)
    s = view.add_instance("i")
    feed(s, frames[:2], now=10.0)  # its last message at t=10
    s.reset("the engine restarted", 700.0)  # seen restarting by its metrics at t=700
    st = view.status(701.0)[0]
    assert st.last_reset == "the engine restarted" and st.last_reset_age_s == 1.0
    assert st.reason == "events flowing" and st.blocks == 0


def test_gaps_without_replay_or_too_often_reset() -> None:
    frames, _ = two_engines_frames()
    view = PreciseCacheView(BS, StreamSettings(replay=False))
    s = view.add_instance("i")
    feed(s, frames[:2])
    assert feed(s, [frames[3]]) == [] and s.counts.resets == 1 and s.expected == 4
    flood = PreciseCacheView(BS, StreamSettings(min_replay_interval_s=10.0)).add_instance("i")
    feed(flood, frames[:1])
    assert feed(flood, [frames[2]], now=0.0) == [RequestReplay(1)]
    flood.on_replay([(1, frames[1][2]), (2, frames[2][2])], 0.1)
    flood.drain()
    assert feed(flood, [frames[4]], now=1.0) == []  # a second gap within 10 s: reset, no replay
    assert flood.counts.resets == 1 and flood.counts.replays == 1 and flood.expected == 5
    assert feed(flood, [frames[6 - 1]], now=20.0) == []  # in order again


def test_pending_overflow_during_a_replay_resets() -> None:
    frames, _ = two_engines_frames()
    s = PreciseCacheView(BS, StreamSettings(max_pending=2)).add_instance("i")
    feed(s, frames[:1])
    feed(s, [frames[2], frames[3]])
    assert s.replaying
    feed(s, [frames[4]])
    assert not s.replaying and s.counts.resets == 1 and s.drain() == 0 and s.expected == 5


def test_engine_restart_resets_and_catches_up_on_the_new_history() -> None:
    frames, _ = two_engines_frames()
    view = PreciseCacheView(BS)
    s = view.add_instance("i")
    s.on_connected()
    feed(s, frames)
    fresh = Engine(seed=77)  # the restarted engine: a new NONE_HASH, a sequence from 0
    new = fresh.run(list(range(100)), 2) + fresh.run(list(range(200, 300)), 2)
    assert feed(s, [new[0]]) == []  # seq 0 < expected: restart, applied from an empty state
    assert s.counts.restarts == 1 and s.counts.resets == 1
    feed(s, new[1:])
    ref = PreciseCacheView(BS)
    feed(ref.add_instance("i"), new)
    assert state(view) == state(ref) and s.mode is Mode.PRECISE
    # A restart noticed only later (the first message seen has seq > 0) catches up from 0.
    s2 = PreciseCacheView(BS).add_instance("j")
    feed(s2, frames[:4])
    assert feed(s2, [new[1]]) == [RequestReplay(0)]
    s2.on_replay([(0, new[0][2]), (1, new[1][2])], 1.0)
    s2.drain()
    assert dict(s2.index.held) == state(ref) and s2.counts.restarts == 1


def test_first_contact_catches_up_on_the_buffered_history() -> None:
    frames, _ = two_engines_frames()
    ref = PreciseCacheView(BS)
    feed(ref.add_instance("i"), frames)
    view = PreciseCacheView(BS)
    s = view.add_instance("i")
    assert feed(s, [frames[3]]) == [RequestReplay(0)] and s.reason == "catching up through replay"
    s.on_replay([(i, f[2]) for i, f in enumerate(frames[:4])], 0.1)
    feed(s, frames[4:])  # queued behind the replay's batches, in order
    assert s.backlog == len(frames) + 1 and s.drain(100) == 0  # frame 3 twice: replayed and held
    assert state(view) == state(ref)


def test_reconnection_keeps_a_continuing_sequence_and_resets_a_jump() -> None:
    frames, _ = two_engines_frames()
    view = PreciseCacheView(BS)
    s = view.add_instance("i")
    s.on_connected()
    feed(s, frames[:3])
    s.on_disconnected()
    s.on_connected()
    feed(s, frames[3:4])  # continues exactly: nothing was missed
    assert s.counts.resets == 0 and s.expected == 4
    s.on_disconnected()
    s.on_connected()
    assert feed(s, [frames[5]]) == [RequestReplay(0)]  # a jump after reconnecting: reset, catch up
    assert s.counts.resets == 1 and s.mode is Mode.APPROXIMATE


def test_malformed_and_unknown_messages_are_counted_and_ignored(caplog: pytest.LogCaptureFixture) -> None:
    frames, engine = two_engines_frames(2)
    view = PreciseCacheView(BS)
    s = view.add_instance("i")
    feed(s, frames)
    before = state(view)
    seq = len(frames)
    bad = [[b"", seq.to_bytes(8, "big"), b"\xc1not msgpack"],
           [b"", (seq + 1).to_bytes(8, "big"), encode_batch(EventBatch(0.0, []))[:-0] + b""],
           [b"only two frames", b"x"],
           [b"", b"short", b""]]
    import msgpack

    bad[1] = [b"", (seq + 1).to_bytes(8, "big"), msgpack.packb([0.0, [["BlockPinned", [1]], ["BlockStored", "x"]]])]
    feed(s, bad)
    st, = view.status(0.0)
    assert (st.malformed_messages, st.unknown_events, st.malformed_events) == (3, 1, 1)
    assert state(view) == before and s.expected == seq + 2 and s.mode is Mode.PRECISE
    assert "not an event batch" in caplog.text and "1 unknown and 1 malformed" in caplog.text
