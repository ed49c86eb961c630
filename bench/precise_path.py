"""Precise mode's cost on a request's path, in process: where the CPU a request costs
the router goes with ``CACHE_AWARE`` on its learned view and in precise mode.

``bench/overhead.py`` measures precise mode's requests/s through the whole router (HTTP
included) at concurrency 64; this program takes the router's own code of a request
apart, without sockets, so that each phase's share is a repo command's figure and a
change to one phase can be judged in a minute. Both arms are a
:class:`prefixroute.server.state.RouterState` with one variant of 4 instances (``CACHE_AWARE``,
``ConcurrencyThreshold`` 64), fed the same request bodies as ``bench/overhead.py``
(16 chat bodies of ``--body-sizes`` bytes each, drawn at random with a fixed seed); the
precise arm's instances are in precise mode on the KV events of
``bench/kv_stand_in.py``'s stand-in engines (the ones ``bench/overhead.py``'s backend
publishes: a warm, full prefix cache, an answer block stored per request, the bundled
``tiny`` tokenizer, matched by bytes), delivered to the router's streams as encoded
messages (:meth:`~prefixroute.core.kvevents.stream.InstanceStream.on_message`) every
``--requests-per-step`` requests per instance. 64 leases are held at any time (the
oldest released as a new one is taken), as 64 connections would.

Phases, microseconds per request (``time.perf_counter_ns`` around each):

* ``prepare``: :func:`prefixroute.server.app.prepare_inference` on the body (parse,
  validation, selection, the routing chain; in precise mode also the request's KV block
  keys by its bytes, ``server/precise.attach_precise``);
* ``decide``: :func:`prefixroute.server.attempt.acquire` (the strategy's choice; in
  precise mode :func:`prefixroute.core.precise_policy.choose_precise`);
* ``learn``: :func:`prefixroute.server.attempt.learn_route` and the lease's release;
* ``ingest``: applying the events (precise arm only), per request.

Each figure is the median over ``--rounds`` rounds of the mean over ``--number``
requests, after a warm-up of 2,000 requests. The router's HTTP work (about 100 µs a
request at 1 KB on this machine: ``bench/overhead.py``'s CPU per request minus these)
is the same in both arms and not here. Usage::

    python bench/precise_path.py [--body-sizes 1K,32K] [--number 20000] [--rounds 3] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kv_stand_in import PortCache  # noqa: E402  (bench/ is a folder of scripts)
from overhead import make_bodies, parse_size  # noqa: E402
from peers import prefixroute_fleet_config, source_commit  # noqa: E402

INSTANCES = [f"http://127.0.0.1:{18431 + i}" for i in range(4)]
ROUTING = {"RoutingStrategy": "CACHE_AWARE", "CacheAwareRoutingConfig": {"ConcurrencyThreshold": 64}}
CONCURRENCY = 64
WARMUP = 2000
PHASES = ("prepare", "decide", "learn", "ingest")


def make_state(precise: bool) -> Any:
    """A router's state for one arm (no server started: nothing subscribes)."""
    from prefixroute.core.config import FleetConfig
    from prefixroute.server.settings import ServerSettings
    from prefixroute.server.state import RouterState

    kv = None
    if precise:  # endpoints named only: the events are handed to the streams below
        kv = {"BlockSize": 16, "Tokenizer": "tiny",
              "Instances": {u: {"Endpoint": f"tcp://127.0.0.1:{20000 + i}"} for i, u in enumerate(INSTANCES)}}
    config = FleetConfig.model_validate(prefixroute_fleet_config(INSTANCES, ROUTING, kv))
    return RouterState(config, ServerSettings(port=0, admin_port=0, health_check_interval_s=0))


def measure(size: int, precise: bool, number: int, rounds: int, per_step: int, seed: int = 0) -> dict[str, Any]:
    """One arm at one body size: the median per-phase µs, and what precise mode matched."""
    from prefixroute.core.kvevents.codec import encode_batch
    from prefixroute.core.kvevents.events import EventBatch
    from prefixroute.core.model_tokenizer import ModelTokenizer
    from prefixroute.core.kvevents.view import Mode
    from prefixroute.server.app import prepare_inference
    from prefixroute.server.attempt import acquire, learn_route
    from prefixroute.server.routes import match_route

    state = make_state(precise)
    bodies = make_bodies(size, False)
    route = match_route("/v1/chat/completions")
    raw_headers = [(b"content-type", b"application/json")]
    headers = {"content-type": "application/json"}
    caches: dict[str, PortCache] = {}
    pending: dict[str, list[Any]] = {u: [] for u in INSTANCES}
    seqs = dict.fromkeys(INSTANCES, 0)
    if precise:
        tokenizer = ModelTokenizer.load("tiny")
        shared: dict[int, list[int]] = {}
        for i, u in enumerate(INSTANCES):
            caches[u] = PortCache(lambda body, chat: tokenizer.request_token_ids(json.loads(body), chat),
                                  hash_base=(i + 1) << 48, token_cache=shared)
            state.kv_view.add_instance(u).on_connected()
    rng = random.Random(seed)
    clock = time.perf_counter_ns
    leases: list[Any] = []
    now = 0.0
    matched = 0

    def publish() -> None:
        for u in INSTANCES:
            caches[u].step()
            if pending[u]:
                payload = encode_batch(EventBatch(now, pending[u]))
                state.kv_view.stream(u).on_message([b"kv", seqs[u].to_bytes(8, "big"), payload], now)
                seqs[u] += 1
                pending[u] = []

    runs: dict[str, list[float]] = {p: [] for p in PHASES}
    for r in range(-1, rounds):  # round -1: the warm-up
        n = WARMUP if r < 0 else number
        acc = dict.fromkeys(PHASES, 0)
        matched = 0
        for k in range(n):
            body = bodies[rng.randrange(len(bodies))]
            now += 1 / 4000
            t0 = clock()
            rr = prepare_inference(state, route, headers, raw_headers, body, "bench", time.perf_counter())
            t1 = clock()
            lease = acquire(state, rr)
            t2 = clock()
            learn_route(rr.pool, lease.decision.instance, rr.blocks)
            leases.append(lease)
            if len(leases) > CONCURRENCY:
                leases.pop(0).release()
            t3 = clock()
            acc["prepare"] += t1 - t0
            acc["decide"] += t2 - t1
            acc["learn"] += t3 - t2
            if precise:
                matched += getattr(rr.blocks, "precise", None) is not None
                pending[lease.decision.instance.instance_id].extend(caches[lease.decision.instance.instance_id]
                                                                    .on_request(body, True, now))
                if k % per_step == per_step - 1:
                    t4 = clock()
                    publish()
                    acc["ingest"] += clock() - t4
        if r >= 0:
            for p in PHASES:
                runs[p].append(acc[p] / n / 1000)
    for lease in leases:
        lease.release()
    row: dict[str, Any] = {"mode": "precise" if precise else "learned", "body_bytes": size}
    for p in PHASES:
        row[f"{p}_us"] = statistics.median(runs[p])
    row["total_us"] = sum(row[f"{p}_us"] for p in PHASES)
    if precise:
        row["matched_share"] = matched / number
        row["modes"] = sorted({state.kv_view.mode(u).value for u in INSTANCES})
        row["all_precise"] = all(state.kv_view.mode(u) is Mode.PRECISE for u in INSTANCES)
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--body-sizes", default="1K,32K",
                   help="comma-separated request body sizes, K = 1024 bytes (default: 1K,32K)")
    p.add_argument("--number", type=int, default=20_000, help="requests per timed round (default: 20,000)")
    p.add_argument("--rounds", type=int, default=3, help="timed rounds per arm, median reported (default: 3)")
    p.add_argument("--requests-per-step", type=int, default=64,
                   help="requests between two batches of events delivered to every instance's stream "
                        "(default: 64: one engine step of 20 ms at 3,200 requests/s)")
    p.add_argument("--json", metavar="PATH", help="write every figure and the settings as JSON")
    args = p.parse_args(argv)
    if args.number < 1 or args.rounds < 1 or args.requests_per_step < 1:
        p.error("--number, --rounds and --requests-per-step must be >= 1")
    try:
        sizes = [parse_size(s) for s in args.body_sizes.split(",") if s.strip()]
    except ValueError as exc:
        p.error(str(exc))
    rows = []
    for size in sizes:
        for precise in (False, True):
            rows.append(measure(size, precise, args.number, args.rounds, args.requests_per_step))
    print(f"precise mode's path, in process ({args.rounds} rounds of {args.number:,} requests, "
          f"events every {args.requests_per_step} requests; µs per request, medians)")
    print(f"{'body':>6} {'mode':8} {'prepare':>8} {'decide':>8} {'learn':>7} {'ingest':>7} {'total':>7} "
          f"{'x learned':>9}  matched on events")
    by_size: dict[int, float] = {}
    for row in rows:
        if row["mode"] == "learned":
            by_size[row["body_bytes"]] = row["total_us"]
        ratio = row["total_us"] / by_size[row["body_bytes"]]
        extra = (f"  {row['matched_share']:.0%} ({', '.join(row['modes'])})" if row["mode"] == "precise" else "")
        print(f"{row['body_bytes'] // 1024:>5}K {row['mode']:8} {row['prepare_us']:8.1f} {row['decide_us']:8.1f} "
              f"{row['learn_us']:7.1f} {row['ingest_us']:7.1f} {row['total_us']:7.1f} {ratio:9.2f}{extra}")
    if args.json:
        doc = {"benchmark": "precise_path", "commit": source_commit(), "settings": vars(args), "rows": rows}
        Path(args.json).write_text(json.dumps(doc, indent=1) + "\n")
        print(f"results: {args.json}")
    bad = [r for r in rows if r["mode"] == "precise" and not (r["all_precise"] and r["matched_share"] == 1.0)]
    if bad:
        print("warning: precise mode did not match every request on the events: "
              + "; ".join(f"{r['body_bytes']} B: {r['matched_share']:.0%} {r['modes']}" for r in bad), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
