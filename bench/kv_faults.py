"""Precise mode under faulty KV-event streams: what a router whose engines flood it, send
it garbage, restart, or never answer adds to a request, against one whose engines are
quiet.

One program, one fast backend (``bench/fast_backend.py``, 2 ports: 2 instances), one
``prefixroute serve`` per run (``CACHE_AWARE``, precise mode: ``KvEvents`` with the bundled
tiny tokenizer, each instance's endpoint and replay endpoint), and a publisher process
standing for the engines' KV-event sockets (this file's ``publish`` command: a ZeroMQ PUB
socket and vLLM's replay ROUTER socket per instance). Scenarios:

* ``off``: no ``KvEvents`` at all (the learned view only): the router without precise mode;
* ``quiet``: events flowing at one small batch per second per instance: the reference;
* ``flood``: each instance publishes as fast as the publisher can (batches of 64 one-block
  ``BlockStored`` events and removals of earlier ones): more than the router ingests, so
  ZeroMQ drops past ``ReceiveHwm``, the streams see gaps, replays and resets;
* ``malformed``: as fast as it can, payloads that are not msgpack, batches of unknown event
  types, events with fields of the wrong type, messages of two frames;
* ``restart``: every 100 ms each engine "restarts" (its sequence back to 0), and one
  message in five is skipped (a gap); its replay socket answers only part of what is asked;
* ``unreachable``: the endpoints name ports nothing listens on (the streams never connect).

Each run drives closed-loop requests (``--concurrency``, default 1) of OpenAI chat bodies
cycling over 16 documents of ``--body-kb`` KB for ``--duration`` seconds after a 1 s warm-up,
and reports the client's latency (p50, p99: a blocked event loop shows here), the router's
own time per request (``X-Prefixroute-Overhead-Ms``) and its mean routing decision
(``prefixroute_routing_decision_seconds``), and what the streams went through (the
router's ``GET /admin/kv-events``: mode, gaps, replays, resets, rejected). Scenarios run in
turn, ``--rounds`` times; the table shows medians over rounds and each figure's ratio to
``quiet``'s of the same round (median). The goal of issue 33: decision latency within 10 %
of no events in every fault.

Usage::

    python bench/kv_faults.py [--duration 8] [--rounds 3] [--json PATH]

Wrap it in ``flock /tmp/prefixroute-bench.lock`` on a shared machine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import socket
import statistics
import struct
import sys
import time
from pathlib import Path
from typing import Any, Sequence

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))

SCENARIOS = ("off", "quiet", "flood", "malformed", "restart", "unreachable")
GOAL_RATIO = 1.10
MODEL = "meta-llama/Llama-3.1-70B-Instruct"


# -- the publisher (the engines' sockets) -------------------------------------------------------------


def _publisher(mode: str, endpoints: Sequence[tuple[str, str]], bodies: Sequence[str], seed: int) -> None:
    """Serve ``endpoints`` (PUB, replay ROUTER) pairs in ``mode`` until killed."""
    import zmq

    from prefixroute.core.kvevents.codec import encode_batch
    from prefixroute.core.kvevents.events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch

    ctx = zmq.Context()
    socks = []
    for pub_ep, replay_ep in endpoints:
        pub = ctx.socket(zmq.PUB)
        pub.setsockopt(zmq.SNDHWM, 100_000)
        pub.bind(pub_ep)
        rep = ctx.socket(zmq.ROUTER)
        rep.bind(replay_ep)
        socks.append((pub, rep))
    rng = random.Random(seed)
    seq = [0] * len(socks)
    buffers: list[list[tuple[int, bytes]]] = [[] for _ in socks]
    counter = iter(range(1, 1 << 62))

    def send(i: int, payload: bytes, frames: int = 3) -> None:
        s = seq[i]
        seq[i] += 1
        buffers[i].append((s, payload))
        if len(buffers[i]) > 10_000:
            del buffers[i][:1000]
        parts = [b"", struct.pack(">q", s), payload][:frames]
        socks[i][0].send_multipart(parts)

    def serve_replays(partial: bool = False) -> None:
        for i, (_, rep) in enumerate(socks):
            while rep.poll(0):
                ident, _, start = rep.recv_multipart()
                first = struct.unpack(">q", start)[0]
                rows = [(s, p) for s, p in buffers[i] if s >= first]
                if partial:
                    rows = rows[len(rows) // 2:]  # the engine's buffer no longer reaches back
                for s, p in rows:
                    rep.send_multipart([ident, b"", struct.pack(">q", s), p])
                rep.send_multipart([ident, b"", struct.pack(">q", -1), b""])

    def stored_batch(n: int) -> tuple[bytes, list[int]]:
        hashes = [next(counter) for _ in range(n)]
        events = [BlockStored([h], None, [rng.randrange(800) for _ in range(16)], 16) for h in hashes]
        return encode_batch(EventBatch(time.time(), events)), hashes

    time.sleep(0.2)
    if mode == "state":  # every second, each instance's whole state: its bodies' blocks
        from prefixroute.core.model_tokenizer import ModelTokenizer

        tok = ModelTokenizer.load("tiny")
        per: list[list[Any]] = [[] for _ in socks]
        for j, text in enumerate(bodies):
            ids = tok.request_token_ids(json.loads(text), True)
            n = len(ids) // 16
            per[j % len(socks)].append(BlockStored([next(counter) for _ in range(n)], None, ids[: n * 16], 16))
        payloads = [encode_batch(EventBatch(time.time(), [AllBlocksCleared(), *evs])) for evs in per]
        while True:
            for i, p in enumerate(payloads):
                send(i, p)
            end = time.monotonic() + 1.0
            while time.monotonic() < end:
                serve_replays()
                time.sleep(0.01)
    if mode == "quiet":
        while True:
            for i in range(len(socks)):
                send(i, stored_batch(1)[0])
            end = time.monotonic() + 1.0
            while time.monotonic() < end:
                serve_replays()
                time.sleep(0.01)
    if mode == "flood":
        pool = [stored_batch(64) for _ in range(64)]
        removals = [encode_batch(EventBatch(time.time(), [BlockRemoved(h) for _ in range(1)])) for _, h in pool]
        k = 0
        while True:
            for i in range(len(socks)):
                send(i, pool[k % 64][0])
                send(i, removals[(k + 32) % 64])
            k += 1
            if k % 64 == 0:
                serve_replays()
    if mode == "malformed":
        import msgpack

        garbage = [bytes(rng.randrange(256) for _ in range(200)),
                   msgpack.packb([time.time(), [["NoSuchEvent", 1, 2, 3]] * 8, None]),
                   msgpack.packb([time.time(), [["BlockStored", "not-a-list", None, "x", "16"]] * 8, None]),
                   msgpack.packb({"ts": "yesterday", "events": 7})]
        k = 0
        while True:
            for i in range(len(socks)):
                if k % 5 == 4:
                    send(i, garbage[0], frames=2)  # two frames
                else:
                    send(i, garbage[k % 4])
            k += 1
            if k % 64 == 0:
                serve_replays()
    if mode == "restart":
        k = 0
        next_restart = time.monotonic() + 0.1
        while True:
            for i in range(len(socks)):
                if k % 5 == 3:
                    seq[i] += 1  # a lost message: a gap
                send(i, stored_batch(4)[0])
            k += 1
            if time.monotonic() >= next_restart:
                next_restart = time.monotonic() + 0.1
                seq[:] = [0] * len(socks)  # the engines start again from 0
                for b in buffers:
                    b.clear()
            serve_replays(partial=True)
            time.sleep(0.002)
    raise SystemExit(f"unknown mode {mode!r}")


# -- the measurement ------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def make_bodies(kb: int, count: int = 16) -> list[str]:
    """OpenAI chat bodies: a ``kb`` KB document per body (16 distinct), then a question."""
    rng = random.Random(7)
    words = ["cache", "prefix", "router", "engine", "token", "block", "tier", "event", "replay", "request"]
    out = []
    for i in range(count):
        doc = f"Document {i}: " + " ".join(rng.choice(words) for _ in range(kb * 1024 // 7))
        out.append(json.dumps({"model": MODEL, "max_tokens": 8, "messages": [
            {"role": "system", "content": doc[: kb * 1024]}, {"role": "user", "content": f"Question {i}?"}]}))
    return out


async def drive(url: str, bodies: Sequence[str], concurrency: int, duration_s: float
                ) -> tuple[list[float], list[float], int]:
    """Closed loop: ``(client latencies s, router overheads ms, errors)``."""
    import aiohttp

    lat: list[float] = []
    over: list[float] = []
    errors = 0
    stop = time.perf_counter() + duration_s

    async def user(u: int, http: aiohttp.ClientSession) -> None:
        nonlocal errors
        k = u
        while time.perf_counter() < stop:
            body = bodies[k % len(bodies)]
            k += concurrency
            t0 = time.perf_counter()
            try:
                async with http.post(url + "/v1/chat/completions", data=body,
                                     headers={"Content-Type": "application/json"}) as r:
                    await r.read()
                    ok = r.status == 200
                    oh = r.headers.get("X-Prefixroute-Overhead-Ms")
            except aiohttp.ClientError:
                ok, oh = False, None
            if not ok:
                errors += 1
                continue
            lat.append(time.perf_counter() - t0)
            if oh:
                over.append(float(oh))

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
        await asyncio.gather(*(user(u, http) for u in range(concurrency)))
    return lat, over, errors


def _decision_sum_count(metrics_text: str) -> tuple[float, float]:
    s = c = 0.0
    for line in metrics_text.splitlines():
        if line.startswith("prefixroute_routing_decision_seconds_sum"):
            s += float(line.rsplit(" ", 1)[1])
        elif line.startswith("prefixroute_routing_decision_seconds_count"):
            c += float(line.rsplit(" ", 1)[1])
    return s, c


def _get(url: str) -> str:
    import urllib.request

    with urllib.request.urlopen(url, timeout=10) as r:
        return r.read().decode()


def pct(xs: Sequence[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def run_scenario(tracker: Any, scenario: str, backends: list[str], bodies: list[str], args: argparse.Namespace
                 ) -> dict[str, Any]:
    from peers import PrefixrouteSpec

    routing = {"RoutingStrategy": "CACHE_AWARE", "CacheAwareRoutingConfig": {"ConcurrencyThreshold": 32}}
    kv = None
    if scenario != "off":
        ports = [(free_port(), free_port()) for _ in backends]
        eps = [(f"tcp://127.0.0.1:{a}", f"tcp://127.0.0.1:{b}") for a, b in ports]
        kv = {"Tokenizer": "tiny", "ReplayTimeoutS": 0.5, "Instances": {
            u: {"Endpoint": a, "ReplayEndpoint": b} for u, (a, b) in zip(backends, eps)}}
        if scenario != "unreachable":
            spec_eps = ",".join(f"{a}|{b}" for a, b in eps)
            tracker.start(f"publisher-{scenario}", [sys.executable, str(Path(__file__).resolve()), "publish",
                                                    "--mode", scenario, "--endpoints", spec_eps])
    spec = PrefixrouteSpec(f"prefixroute CACHE_AWARE {scenario}", "prefixroute", "CACHE_AWARE", routing=routing,
                           kv_events=kv)
    router = spec.start(tracker, backends)  # (the tracker stops it and the publisher)
    asyncio.run(drive(router.url, bodies, args.concurrency, 1.0))  # warm-up: tokenizer cache, connections
    s0, c0 = _decision_sum_count(_get(router.url + "/metrics"))
    lat, over, errors = asyncio.run(drive(router.url, bodies, args.concurrency, args.duration))
    s1, c1 = _decision_sum_count(_get(router.url + "/metrics"))
    status = json.loads(_get(router.admin_url + "/admin/kv-events")) if kv is not None else {"Instances": []}
    rows = status.get("Instances", [])
    return {"scenario": scenario, "requests": len(lat), "errors": errors,
            "p50_ms": pct(lat, 0.5) * 1e3, "p99_ms": pct(lat, 0.99) * 1e3,
            "overhead_p50_ms": pct(over, 0.5), "overhead_p99_ms": pct(over, 0.99),
            "decision_mean_us": (s1 - s0) / (c1 - c0) * 1e6 if c1 > c0 else float("nan"),
            "modes": sorted({r.get("Mode") for r in rows}),
            "gaps": sum(r.get("Gaps", 0) for r in rows), "replays": sum(r.get("Replays", 0) for r in rows),
            "resets": sum(r.get("Resets", 0) for r in rows), "restarts": sum(r.get("Restarts", 0) for r in rows),
            "rejected": sum(r.get("MalformedMessages", 0) + r.get("MalformedEvents", 0) + r.get("UnknownEvents", 0)
                            for r in rows),
            "messages": sum(r.get("Messages", 0) for r in rows)}


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python bench/kv_faults.py", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command")
    pub = sub.add_parser("publish", help="(internal) serve KV-event sockets in a mode until killed")
    pub.add_argument("--mode", required=True, choices=("quiet", "flood", "malformed", "restart", "state"))
    pub.add_argument("--endpoints", required=True, help="PUB|REPLAY,PUB|REPLAY,... (one pair per instance)")
    pub.add_argument("--bodies", nargs="*", default=[], help="(state) files of request bodies whose blocks to hold")
    pub.add_argument("--seed", type=int, default=0)
    p.add_argument("--duration", type=float, default=8.0, help="seconds of requests per run (default: 8)")
    p.add_argument("--rounds", type=int, default=3, help="runs of every scenario, medians reported (default: 3)")
    p.add_argument("--concurrency", type=int, default=1, help="closed-loop connections (default: 1)")
    p.add_argument("--body-kb", type=int, default=8, help="document size per request body, KB (default: 8)")
    p.add_argument("--scenarios", default=",".join(SCENARIOS), help=f"(default: {','.join(SCENARIOS)})")
    p.add_argument("--json", metavar="PATH", help="write every run and the medians as JSON")
    args = p.parse_args(argv)
    if args.command == "publish":
        eps = [tuple(pair.split("|", 1)) for pair in args.endpoints.split(",")]
        _publisher(args.mode, eps, [Path(b).read_text() for b in args.bodies], args.seed)  # type: ignore[arg-type]
        return 0

    from rich.console import Console
    from rich.table import Table

    from checkout import source_commit
    from peer_process import ProcessTracker

    scenarios = [s for s in args.scenarios.split(",") if s]
    unknown = set(scenarios) - set(SCENARIOS)
    if unknown or "quiet" not in scenarios:
        raise SystemExit(f"--scenarios: unknown {sorted(unknown)} or no 'quiet' (the reference)")
    console = Console() if Console().is_terminal else Console(width=200)
    bodies = make_bodies(args.body_kb)
    runs: list[dict[str, Any]] = []
    with ProcessTracker() as backend_tracker:
        backend = backend_tracker.start("fast-backend", [sys.executable, str(BENCH / "fast_backend.py"),
                                                         "--port", "0", "--port", "0"])
        import re

        found: list[str] = []

        def ready() -> bool:
            found[:] = re.findall(r"fast-backend listening on (http://\S+)", backend.tail(10))
            return len(found) == 2

        backend.wait_ready(ready, 30.0, "listening")
        backends = list(found)
        for rnd in range(args.rounds):
            order = scenarios[rnd % len(scenarios):] + scenarios[: rnd % len(scenarios)]
            for scenario in order:
                with ProcessTracker() as tracker:
                    r = run_scenario(tracker, scenario, backends, bodies, args)
                r["round"] = rnd
                runs.append(r)
                console.print(f"round {rnd + 1} {scenario:<12} {r['requests']:6d} req  p50 {r['p50_ms']:6.2f} ms  "
                              f"p99 {r['p99_ms']:6.2f} ms  overhead p50 {r['overhead_p50_ms']:.3f} ms  decision "
                              f"{r['decision_mean_us']:6.1f} us  modes {r['modes']}  gaps {r['gaps']} resets "
                              f"{r['resets']} rejected {r['rejected']} errors {r['errors']}")
    med = statistics.median
    summary = []
    for scenario in scenarios:
        rs = [r for r in runs if r["scenario"] == scenario]
        row: dict[str, Any] = {"scenario": scenario}
        for k in ("requests", "errors", "p50_ms", "p99_ms", "overhead_p50_ms", "overhead_p99_ms", "decision_mean_us",
                  "gaps", "replays", "resets", "restarts", "rejected", "messages"):
            row[k] = med(r[k] for r in rs)
        ratios = {}
        for k in ("p50_ms", "p99_ms", "decision_mean_us"):
            per_round = []
            for r in rs:
                q = next(x for x in runs if x["scenario"] == "quiet" and x["round"] == r["round"])
                per_round.append(r[k] / q[k] if q[k] else float("nan"))
            ratios[k] = med(per_round)
        row["ratios_to_quiet"] = ratios
        row["modes"] = sorted({m for r in rs for m in r["modes"]})
        summary.append(row)
    table = Table(title=f"KV-event faults: {args.concurrency} connection(s), {args.body_kb} KB chat bodies, "
                        f"{args.duration:g} s x {args.rounds} rounds, 2 instances; medians, ratios to quiet",
                  title_justify="left")
    for col in ("scenario", "req/s", "p50 ms", "p99 ms", "router p50 ms", "decision us", "p50 x", "p99 x",
                "decision x", "streams went through", "errors"):
        table.add_column(col, justify="left" if col in ("scenario", "streams went through") else "right")
    for row in summary:
        x = row["ratios_to_quiet"]
        went = (f"{'/'.join(row['modes']) or '-'}; {row['messages']:,.0f} msgs, {row['gaps']:,.0f} gaps, "
                f"{row['replays']:,.0f} replays, {row['resets']:,.0f} resets, {row['restarts']:,.0f} restarts, "
                f"{row['rejected']:,.0f} rejected")
        table.add_row(row["scenario"], f"{row['requests'] / args.duration:,.0f}", f"{row['p50_ms']:.2f}",
                      f"{row['p99_ms']:.2f}", f"{row['overhead_p50_ms']:.3f}", f"{row['decision_mean_us']:.1f}",
                      f"{x['p50_ms']:.2f}", f"{x['p99_ms']:.2f}", f"{x['decision_mean_us']:.2f}",
                      went if row["scenario"] != "off" else "no KvEvents", f"{row['errors']:.0f}")
    console.print(table)
    faults = [r for r in summary if r["scenario"] not in ("off", "quiet")]
    worst = max((r["ratios_to_quiet"]["decision_mean_us"] for r in faults), default=float("nan"))
    worst_p50 = max((r["ratios_to_quiet"]["p50_ms"] for r in faults), default=float("nan"))
    console.print(f"goal: decision latency within {GOAL_RATIO - 1:.0%} of quiet events under every fault: worst "
                  f"decision x{worst:.2f}, worst client p50 x{worst_p50:.2f}: "
                  f"{'met' if worst <= GOAL_RATIO and worst_p50 <= GOAL_RATIO else 'NOT met'}")
    if args.json:
        Path(args.json).write_text(json.dumps({"command": "python bench/kv_faults.py " + " ".join(
            sys.argv[1:] if argv is None else argv), "commit": source_commit(), "runs": runs, "summary": summary},
            indent=2))
        console.print(f"results: {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
