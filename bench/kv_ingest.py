"""Precise mode's cost: KV-event ingest in blocks per second on one core, and the lookup a
routing decision makes.

**Ingest.** An emulated engine (:class:`prefixroute.engine.core.EngineCore` with its
:class:`~prefixroute.engine.kv_events.KvEventRecorder`, 16-token blocks, a KV cache of
``--kv-blocks`` blocks so that it evicts) serves ``--requests`` requests of a
shared-prefix workload (``--documents`` documents of ``--prefix-tokens`` tokens, each
request a document plus its own question); every step's events are encoded as one
message, in vLLM's positional-array and map forms. The router's core then ingests the
messages (:meth:`prefixroute.core.kvevents.stream.InstanceStream.on_message`: msgpack
decoding, the router's keys rebuilt from the token ids, the index updated), timed on this
one thread, ``--rounds`` times; the best round is reported. Blocks = blocks stored plus
blocks removed. The same changes are ingested again with every event cut to one block
(the worst case: a decode step filling one block, an eviction of one). The ``core +
bytes`` rows index every held block by its bytes as well (``KvEvents.Matching: bytes``,
the default with a byte-level tokenizer; a 128K-token table). With ``--zmq``, the same messages also go through real ZeroMQ sockets on
loopback: a publisher process sends them as fast as it can, and the router's subscriber
(:class:`prefixroute.server.kv_subscriber.KvEventSubscriber`) ingests them on its event
loop, in its slices; the rate is what it applied per second of its own time.

**Lookup.** For a request of the workload: the router's keys from its token ids
(:meth:`~prefixroute.core.kvevents.view.PreciseCacheView.request_keys`) and the holdings
of ``--instances`` instances (:meth:`~prefixroute.core.kvevents.view.PreciseCacheView.holdings`),
microseconds per request; and, matching by bytes, the walk over the request's bytes
(:meth:`~prefixroute.core.kvevents.byte_index.ByteIndex.walk`) that replaces
tokenizing it and computing its keys: from the root, and resumed from the checkpoints
of an earlier walk over the same document.

The goal: ingest >= 100,000 blocks/s on one core.

Usage::

    python bench/kv_ingest.py [--requests 2000] [--rounds 3] [--zmq] [--json PATH] [--plot PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import subprocess
import sys
import textwrap
import time
from typing import Any

from prefixroute.core.kvevents.codec import encode_batch
from prefixroute.core.kvevents.events import BlockRemoved, BlockStored, EventBatch
from prefixroute.core.kvevents.view import PreciseCacheView
from prefixroute.core.token_bytes import TokenBytes
from prefixroute.engine.core import EngineCore
from prefixroute.engine.kv_events import KvEventRecorder
from prefixroute.engine.model import EngineConfig

GOAL_BLOCKS_PER_S = 100_000
#: Token ids of the workload are drawn below this (a 128K vocabulary).
VOCABULARY = 128_000


def workload(args: argparse.Namespace) -> list[list[int]]:
    """Token-id prompts: a document's tokens, then a question of its own."""
    rng = random.Random(args.seed)
    docs = [[rng.randrange(VOCABULARY) for _ in range(args.prefix_tokens)] for _ in range(args.documents)]
    return [rng.choice(docs) + [rng.randrange(VOCABULARY) for _ in range(args.question_tokens)]
            for _ in range(args.requests)]


def engine_messages(prompts: list[list[int]], args: argparse.Namespace) -> tuple[list[list[Any]], int, int]:
    """The engine's steps as messages ``[seq, events]``, and the blocks stored and removed."""
    cfg = EngineConfig(kv_capacity_tokens=args.kv_blocks * 16, max_num_batched_tokens=8192, max_num_seqs=64)
    rec = KvEventRecorder(16, hash_seed=1)
    core = EngineCore(cfg, events=rec)
    out: list[list[Any]] = []
    stored = removed = 0
    pending = list(reversed(prompts))
    n = 0
    while pending or core.has_work():
        while pending and core.num_waiting < 8:
            core.add_request(f"r{n}", pending.pop(), 8)
            n += 1
        core.step()
        events = rec.take()
        if events:
            for e in events:
                if isinstance(e, BlockStored):
                    stored += len(e.block_hashes)
                elif isinstance(e, BlockRemoved):
                    removed += len(e.block_hashes)
            out.append([len(out), events])
    return out, stored, removed


def one_block_per_event(messages: list[list[Any]]) -> list[list[Any]]:
    """The same changes with every event cut to a single block (the worst case: decode
    steps each filling one block)."""
    out = []
    for seq, events in messages:
        cut: list[Any] = []
        for e in events:
            if isinstance(e, BlockStored):
                parent = e.parent_block_hash
                for i, h in enumerate(e.block_hashes):
                    cut.append(BlockStored([h], parent, list(e.token_ids[i * 16:(i + 1) * 16]), 16, None, e.medium,
                                           None))
                    parent = h
            elif isinstance(e, BlockRemoved):
                cut += [BlockRemoved([h], e.medium) for h in e.block_hashes]
            else:
                cut.append(e)
        out.append([seq, cut])
    return out


def vocabulary_bytes(size: int = VOCABULARY) -> TokenBytes:
    """A token -> bytes table of ``size`` tokens (a 128K vocabulary as Llama 3's; the
    cost of indexing by bytes is one table lookup per token, whatever the bytes)."""
    return TokenBytes([f" w{i}".encode() for i in range(size)], b"", 4.0)


def ingest_once(frames: list[list[bytes]], token_bytes: TokenBytes | None = None) -> tuple[float, PreciseCacheView]:
    view = PreciseCacheView(16)
    view.use_token_bytes(token_bytes)
    stream = view.add_instance("i")
    stream.on_connected()
    t0 = time.perf_counter()
    on_message = stream.on_message
    for f in frames:
        on_message(f, 0.0)
    return time.perf_counter() - t0, view


def lookup_cost(view: PreciseCacheView, prompts: list[list[int]], instances: int, rounds: int) -> tuple[float, float]:
    """Microseconds per request: keys from token ids, then holdings over ``instances``."""
    stream = view.stream("i")
    assert stream is not None
    for k in range(1, instances):  # more instances holding the same state
        other = view.add_instance(f"i{k}")
        other.index.held = stream.index.held
    sample = prompts[-200:]
    t0 = time.perf_counter()
    for _ in range(rounds):
        keys = [view.request_keys(p) for p in sample]
    t_keys = (time.perf_counter() - t0) / rounds / len(sample)
    t0 = time.perf_counter()
    for _ in range(rounds):
        for k in keys:
            view.holdings(k)
    t_hold = (time.perf_counter() - t0) / rounds / len(sample)
    return t_keys * 1e6, t_hold * 1e6


_PUBLISHER = textwrap.dedent("""
    import sys, time, zmq
    frames = [l.split(b" ", 1) for l in sys.stdin.buffer.read().split(b"\\n\\n") if l]
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.SNDHWM, 0)
    pub.bind(sys.argv[1])
    time.sleep(1.0)  # the subscriber connects
    for seq, hexed in frames:
        pub.send_multipart([b"", int(seq).to_bytes(8, "big"), bytes.fromhex(hexed.decode())])
    time.sleep(30)
""")


def walk_cost(view: PreciseCacheView, prompts: list[list[int]], table: TokenBytes, rounds: int
              ) -> tuple[float, float, float]:
    """Microseconds per request to find its held blocks from its bytes
    (:meth:`~prefixroute.core.kvevents.byte_index.ByteIndex.walk`): from the root, and
    resumed from the checkpoints of an earlier walk over the same document (each of the
    last 200 requests after one other request on its document was walked); and the
    blocks found per request (the last 200 requests: mostly still held)."""
    from prefixroute.core.kvevents.chain import chain_root

    bx = view.byte_index
    assert bx is not None
    root = chain_root(None)
    data = [table.render(p) or b"" for p in prompts[-200:]]
    best_root = best_resumed = float("inf")
    found = 0
    for _ in range(rounds):
        t0 = time.perf_counter()
        found = 0
        for d in data:
            found += len(bx.walk(d, root, resume=False)[0])
        best_root = min(best_root, (time.perf_counter() - t0) / len(data) * 1e6)
        bx.clear_checkpoints()
        for d in data[::-1]:  # a walk over each document first (another question on it)
            bx.walk(d[: len(d) - 64], root)
        t0 = time.perf_counter()
        for d in data:
            bx.walk(d, root)
        best_resumed = min(best_resumed, (time.perf_counter() - t0) / len(data) * 1e6)
    return best_root, best_resumed, found / len(data)


async def zmq_ingest(frames: list[list[bytes]], blocks: int) -> tuple[float, float]:
    """Blocks per second of the subscriber's own time, and wall seconds to apply all."""
    import socket

    from prefixroute.core.kvevents.config import KvEventsConfig
    from prefixroute.server.kv_subscriber import KvEventSubscriber

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-c", _PUBLISHER, f"tcp://127.0.0.1:{port}"], stdin=subprocess.PIPE)
    assert proc.stdin is not None
    proc.stdin.write(b"\n\n".join(b"%d %s" % (int.from_bytes(f[1], "big"), f[2].hex().encode()) for f in frames))
    proc.stdin.close()
    view = PreciseCacheView(16)
    instance = "http://127.0.0.1:1"
    config = KvEventsConfig.model_validate({"Instances": {instance: {"Endpoint": f"tcp://127.0.0.1:{port}"}},
                                            "ReceiveHwm": 10_000_000})
    sub = KvEventSubscriber(view, config)
    try:
        await sub.start([instance])
        stream = view.stream(instance)
        assert stream is not None
        t0 = None
        deadline = time.monotonic() + 120
        while (stream.expected or 0) < len(frames) and time.monotonic() < deadline:
            if t0 is None and stream.counts.messages:
                t0 = time.perf_counter()
            await asyncio.sleep(0.01)
        wall = time.perf_counter() - (t0 or time.perf_counter())
        busy = sub.busy_s.get(instance, 0.0)
        return (blocks / busy if busy else 0.0), wall
    finally:
        await sub.close()
        proc.kill()
        proc.wait()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=2000, help="requests the engine serves (default: 2000)")
    p.add_argument("--documents", type=int, default=50, help="distinct documents (default: 50)")
    p.add_argument("--prefix-tokens", type=int, default=2000, help="tokens per document (default: 2000)")
    p.add_argument("--question-tokens", type=int, default=64, help="tokens per question (default: 64)")
    p.add_argument("--kv-blocks", type=int, default=4000,
                   help="the engine's KV cache, blocks of 16 tokens: smaller evicts more (default: 4000)")
    p.add_argument("--instances", type=int, default=8, help="instances a lookup answers for (default: 8)")
    p.add_argument("--rounds", type=int, default=3, help="timed rounds; the best is reported (default: 3)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--zmq", action="store_true", help="also ingest through real ZeroMQ sockets on loopback")
    p.add_argument("--json", metavar="PATH", help="write the figures as JSON")
    p.add_argument("--plot", metavar="PATH", help="write a bar chart of blocks/s (PNG)")
    args = p.parse_args(argv)

    prompts = workload(args)
    messages, stored, removed = engine_messages(prompts, args)
    blocks = stored + removed
    per_event = blocks / max(1, sum(len(events) for _, events in messages))
    print(f"workload: {args.requests:,} requests, {args.documents} documents of {args.prefix_tokens:,} tokens; "
          f"{len(messages):,} messages, {stored:,} blocks stored + {removed:,} removed "
          f"({per_event:.1f} blocks per event)")
    rows = []
    table = vocabulary_bytes()
    for shape, msgs in (("as published", messages), ("1 block/event", one_block_per_event(messages))):
        for encoding, path in (("array", "core"), ("map", "core"), ("array", "core + bytes")):
            frames = [[b"", seq.to_bytes(8, "big"), encode_batch(EventBatch(0.0, events), encoding)]  # type: ignore
                      for seq, events in msgs]
            size = sum(len(f[2]) for f in frames)
            by_bytes = table if path == "core + bytes" else None
            best, view = min((ingest_once(frames, by_bytes) for _ in range(args.rounds)), key=lambda r: r[0])
            rows.append({"path": path, "events": shape, "encoding": encoding, "messages": len(frames),
                         "blocks": blocks, "payload_mb": round(size / 1e6, 2), "seconds": round(best, 4),
                         "blocks_per_s": round(blocks / best), "us_per_block": round(best / blocks * 1e6, 3)})
            if path == "core" and encoding == "array" and shape == "as published":
                keys_us, hold_us = lookup_cost(view, prompts, args.instances, args.rounds)
                zmq_frames = frames
            if by_bytes is not None and shape == "as published":
                walk_us, resumed_us, walk_blocks = walk_cost(view, prompts, table, args.rounds)
    if args.zmq:
        rate, wall = asyncio.run(zmq_ingest(zmq_frames, blocks))
        rows.append({"path": "zmq subscriber", "events": "as published", "encoding": "array", "messages": len(zmq_frames), "blocks": blocks,
                     "payload_mb": rows[0]["payload_mb"], "seconds": round(blocks / rate, 4) if rate else None,
                     "blocks_per_s": round(rate), "us_per_block": round(1e6 / rate, 3) if rate else None,
                     "wall_s": round(wall, 3)})
    print()
    print(f"{'path':<16}{'events':<15}{'encoding':<10}{'messages':>10}{'blocks':>11}{'MB':>8}{'seconds':>10}"
          f"{'blocks/s':>12}{'us/block':>10}")
    for r in rows:
        print(f"{r['path']:<16}{r['events']:<15}{r['encoding']:<10}{r['messages']:>10,}{r['blocks']:>11,}"
              f"{r['payload_mb']:>8}{r['seconds'] or 0:>10.3f}{r['blocks_per_s']:>12,}{r['us_per_block'] or 0:>10.2f}")
    ok = all(r["blocks_per_s"] >= GOAL_BLOCKS_PER_S for r in rows)
    print(f"\ngoal >= {GOAL_BLOCKS_PER_S:,} blocks/s on one core: {'met' if ok else 'NOT met'}")
    print(f"lookup per request ({args.prefix_tokens + args.question_tokens:,} tokens, "
          f"{(args.prefix_tokens + args.question_tokens) // 16} blocks): keys {keys_us:,.1f} us, holdings over "
          f"{args.instances} instances {hold_us:,.1f} us; by bytes (Matching: bytes), the walk instead of the "
          f"keys {walk_us:,.1f} us from the root, {resumed_us:,.1f} us resumed from an earlier walk's checkpoints "
          f"({walk_blocks:,.0f} held blocks found a request)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"benchmark": "kv_ingest", "command": " ".join(["python", *sys.argv]), "rows": rows,
                       "goal_blocks_per_s": GOAL_BLOCKS_PER_S, "goal_met": ok,
                       "lookup_us": {"keys": round(keys_us, 1), "holdings": round(hold_us, 1),
                                     "walk": round(walk_us, 1), "walk_resumed": round(resumed_us, 1),
                                     "walk_blocks": round(walk_blocks, 1), "instances": args.instances}}, f, indent=2)
        print(f"wrote {args.json}")
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(8, 4))
        labels = [f"{r['path']}\n{r['events']}\n{r['encoding']}" for r in rows]
        ax.bar(labels, [r["blocks_per_s"] for r in rows], color="#4c72b0")
        ax.axhline(GOAL_BLOCKS_PER_S, color="#c44e52", linestyle="--", label="goal")
        ax.set_ylabel("blocks / s (one core)")
        ax.set_title("KV-event ingest")
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.plot, dpi=120)
        print(f"wrote {args.plot}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
