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
``tiny`` tokenizer, matched by bytes): every ``--requests-per-step`` requests (all
instances' together), each instance's pending events as one encoded message, handed to
its stream (:meth:`~prefixroute.core.kvevents.stream.InstanceStream.on_message`). The
stand-in's clock moves 20 ms per 64 requests (3,200 requests/s), so its prompts are
stored again every 6,400 requests (``restore_s`` 2 s). 63 leases are held while a
request is decided and 64 after it (the oldest released before the next one), as 64
connections would.

Phases, microseconds per request (``time.perf_counter_ns`` around each):

* ``prepare``: :func:`prefixroute.server.app.prepare_inference` on the body (parse,
  validation, selection, the routing chain; in precise mode also the request's KV block
  keys by its bytes, ``server/precise.attach_precise``);
* ``decide``: :func:`prefixroute.server.attempt.acquire` (the strategy's choice; in
  precise mode :func:`prefixroute.core.precise_policy.choose_precise`);
* ``learn``: :func:`prefixroute.server.attempt.learn_route` and a lease's release;
* ``ingest``: the router applying the events (precise arm only; the stand-in's encoding
  is not timed), per request.

A precise row counts the requests *matched on the events* (their KV block keys found
some instance's held blocks: ``blocks.precise.keys`` not empty) and checks that the
precise rule decided (its record of what was just sent, ``Speculative``, has entries);
the program exits 1 when a request was not matched, an instance was not in precise mode
or the precise rule did not decide.

Each figure is the median over ``--rounds`` rounds of the mean over ``--number``
requests, after a warm-up of 2,000 requests. The router's HTTP work
(``bench/overhead.py``'s CPU per request minus these) is the same in both arms and not
here. Usage::

    python bench/precise_path.py [--body-sizes 1K,32K] [--number 20000] [--rounds 3]
                                 [--requests-per-step 64] [--json PATH]
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
from checkout import source_commit  # noqa: E402  (bench/ is a folder of scripts)
from kv_stand_in import PortCache  # noqa: E402
from overhead_settings import make_bodies, parse_size  # noqa: E402
from peers import prefixroute_fleet_config  # noqa: E402

INSTANCES = [f"http://127.0.0.1:{18431 + i}" for i in range(4)]
ROUTING = {"RoutingStrategy": "CACHE_AWARE", "CacheAwareRoutingConfig": {"ConcurrencyThreshold": 64}}
CONCURRENCY = 64
WARMUP = 2000
PHASES = ("prepare", "decide", "learn", "ingest")
#: The stand-in's clock: seconds per request (64 requests per 20 ms step).
SECONDS_PER_REQUEST = 0.020 / 64


def size_label(size: int) -> str:
    """``1024`` -> ``1K``, ``300`` -> ``300 B``."""
    return f"{size // 1024}K" if size % 1024 == 0 else f"{size} B"


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

    def publish() -> int:
        """The stand-ins' batches, encoded (their work: not timed), applied by the
        router's streams; returns the nanoseconds the streams took."""
        messages = []
        for u in INSTANCES:
            caches[u].step()
            if pending[u]:
                messages.append((u, [b"kv", seqs[u].to_bytes(8, "big"), encode_batch(EventBatch(now, pending[u]))]))
                seqs[u] += 1
                pending[u] = []
        t = clock()
        for u, frames in messages:
            state.kv_view.stream(u).on_message(frames, now)
        return clock() - t

    runs: dict[str, list[float]] = {p: [] for p in PHASES}
    served = matched = 0  # (served: every request, the warm-up's too; matched: the timed rounds')
    for r in range(-1, rounds):  # round -1: the warm-up
        n = WARMUP if r < 0 else number
        acc = dict.fromkeys(PHASES, 0)
        for _ in range(n):
            body = bodies[rng.randrange(len(bodies))]
            now += SECONDS_PER_REQUEST
            t = clock()
            if len(leases) >= CONCURRENCY:  # the oldest request's answer came: its lease goes
                leases.pop(0).release()
            t0 = clock()
            rr = prepare_inference(state, route, headers, raw_headers, body, "bench", time.perf_counter())
            t1 = clock()
            lease = acquire(state, rr)
            t2 = clock()
            learn_route(rr.pool, lease.decision.instance, rr.blocks)
            t3 = clock()
            leases.append(lease)
            acc["prepare"] += t1 - t0
            acc["decide"] += t2 - t1
            acc["learn"] += t3 - t2 + t0 - t
            served += 1
            if precise:
                if r >= 0:
                    p = rr.blocks.precise
                    matched += p is not None and len(p.keys) > 0
                inst = lease.decision.instance.instance_id
                pending[inst].extend(caches[inst].on_request(body, True, now))
                if served % per_step == 0:
                    acc["ingest"] += publish()
        if r >= 0:
            for p in PHASES:
                runs[p].append(acc[p] / n / 1000)
    row: dict[str, Any] = {"mode": "precise" if precise else "learned", "body_bytes": size}
    for p in PHASES:
        row[f"{p}_us"] = statistics.median(runs[p])
    row["total_us"] = sum(row[f"{p}_us"] for p in PHASES)
    if precise:
        row["matched_share"] = matched / (number * rounds)
        row["modes"] = sorted({state.kv_view.mode(u).value for u in INSTANCES})
        row["all_precise"] = all(state.kv_view.mode(u) is Mode.PRECISE for u in INSTANCES)
        # (read while 64 requests are in flight: entries go when an instance has none)
        speculative = getattr(rr.pool.strategy, "precise_speculative", None)
        row["precise_rule_decided"] = speculative is not None and any(speculative.entries.values())
    for lease in leases:
        lease.release()
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description="Precise mode's cost on a request's path, in process: the router's CPU per request in "
                    "CACHE_AWARE's learned view and in precise mode, by phase (prepare, decide, learn, ingest).",
        epilog="How each figure is measured: the docstring at the top of bench/precise_path.py. Exit status 1: "
               "precise mode did not match every request on the events, an instance was not in precise mode, "
               "or the precise rule did not decide; 2: bad arguments.")
    p.add_argument("--body-sizes", default="1K,32K",
                   help="comma-separated request body sizes, K = 1024 bytes (default: 1K,32K)")
    p.add_argument("--number", type=int, default=20_000, help="requests per timed round (default: 20,000)")
    p.add_argument("--rounds", type=int, default=3, help="timed rounds per arm, median reported (default: 3)")
    p.add_argument("--requests-per-step", type=int, default=64,
                   help="requests between two deliveries of events (each instance's pending events as one message; "
                        "default: 64, one engine step of 20 ms at 3,200 requests/s)")
    p.add_argument("--json", metavar="PATH", help="write every figure and the settings as JSON")
    args = p.parse_args(argv)
    if args.number < 1 or args.rounds < 1 or args.requests_per_step < 1:
        p.error("--number, --rounds and --requests-per-step must be >= 1")
    if args.requests_per_step > min(args.number, WARMUP):
        p.error(f"--requests-per-step ({args.requests_per_step}) must be at most --number and the warm-up's "
                f"{WARMUP:,} requests, or no events reach the router in a round")
    try:
        sizes = [parse_size(s) for s in args.body_sizes.split(",") if s.strip()]
        for size in sizes:
            make_bodies(size, False)  # (refuses a size too small for a chat body)
    except ValueError as exc:
        p.error(f"--body-sizes: {exc}")
    if not sizes:
        p.error("--body-sizes names no size")
    if args.json and not Path(args.json).resolve().parent.is_dir():
        p.error(f"--json: no directory {str(Path(args.json).resolve().parent)!r} to write {args.json!r} in")
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
        print(f"{size_label(row['body_bytes']):>6} {row['mode']:8} {row['prepare_us']:8.1f} {row['decide_us']:8.1f} "
              f"{row['learn_us']:7.1f} {row['ingest_us']:7.1f} {row['total_us']:7.1f} {ratio:9.2f}{extra}")
    if args.json:
        doc = {"benchmark": "precise_path", "commit": source_commit(), "settings": vars(args), "rows": rows}
        Path(args.json).write_text(json.dumps(doc, indent=1) + "\n")
        print(f"results: {args.json}")
    bad = [r for r in rows if r["mode"] == "precise"
           and not (r["all_precise"] and r["matched_share"] == 1.0 and r["precise_rule_decided"])]
    if bad:
        print("error: precise mode did not hold throughout: "
              + "; ".join(f"{size_label(r['body_bytes'])}: {r['matched_share']:.0%} matched on the events, modes "
                          f"{r['modes']}, precise rule decided: {r['precise_rule_decided']}" for r in bad),
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
