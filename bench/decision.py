"""The routing decision alone: key extraction + choice, per strategy, prefix size and fleet size.

What one request costs the sans-I/O core, without any HTTP: for an OpenAI chat request
whose system prompt is 4 KB or 64 KB and a variant of 8 or 64 instances, it times

* ``parse``: :func:`prefixroute.core.keys.loads_body` of the request body (the HTTP
  driver does this once per request; shown apart because it is not routing work), and
  ``orjson``: ``orjson.loads`` of the same bodies, for comparison (timed in a pass of
  its own after each run, so as not to evict the payload before ``key``);
* ``key``: :func:`prefixroute.core.keys.openai_route` on the parsed body (routing text,
  key or chained block hashes);
* ``decide``: ``key`` plus :meth:`VariantPool.acquire` (``learn=False``) and
  ``Lease.release``: the choice and the in-flight count, i.e. what a request waits for
  before the router sends it;
* ``learn``: :meth:`VariantPool.learn`, what ``CACHE_AWARE`` records about the request
  (the router does it on the next event-loop turn, once the request is on its way: CPU
  per request, not latency). The other strategies learn nothing.

Each figure is the median over ``--repeats`` runs of the mean over ``--number`` requests
(``time.perf_counter_ns`` around each phase of each request), in microseconds. Every
request is a distinct body, parsed just before it is routed (as the router does, so its
text is in the CPU caches); nothing is reused between requests except what the strategy
learned.

Scenarios of the router's learned state (they matter for ``CACHE_AWARE`` only):

* ``warm``: 64 documents, each already routed once, requests cycle over them (each finds
  its cache on one instance: the affinity path);
* ``cold``: every request is a new document (no instance holds its first block);
* ``shared``: every request starts with the same half-size system prompt, held by every
  instance, then one of 64 documents held by one instance (the scoring path).

The goal (docs/PERFORMANCE.md) is ``decide`` under 20 µs for a 64 KB prefix with 64
instances. This machine's speed moves from one day to the next (the same code has
measured 2.5x apart), so the run also times ``sum(range(1000))`` before and after its
rows (``interpreter reference``, in the output and the JSON): figures from different
runs compare through it. Usage::

    python bench/decision.py [--quick] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import orjson

from prefixroute.core.config import RoutingConfig
from prefixroute.core.keys import loads_body, openai_route
from prefixroute.core.pool import VariantPool

sys.path.insert(0, str(Path(__file__).resolve().parent))
from checkout import source_commit  # noqa: E402  (bench/ is a folder of scripts)

STRATEGIES = ("RANDOM", "LEAST_OUTSTANDING_REQUESTS", "PREFIX_AWARE", "CACHE_AWARE")
SIZES = (4096, 65536)
INSTANCES = (8, 64)
DOCS = 64
GOAL_US = 20.0


def routing(strategy: str, size: int) -> RoutingConfig:
    if strategy == "PREFIX_AWARE":
        return RoutingConfig.build(strategy, prefix_length=min(max(size, 1024), 65536), concurrency_threshold=8)
    if strategy == "CACHE_AWARE":
        return RoutingConfig.build(strategy, concurrency_threshold=8)
    return RoutingConfig.build(strategy)


def _filler(seed: int, n: int) -> str:
    word = f"tok{seed:x} "
    return (word * (n // len(word) + 1))[:n]


def bodies(size: int, scenario: str, count: int, start: int = 0) -> list[bytes]:
    """``count`` chat bodies whose system prompt is ``size`` characters."""
    out = []
    for i in range(start, start + count):
        if scenario == "shared":
            system = _filler(0xABC, size // 2) + _filler(i % DOCS, size - size // 2)
        else:
            doc = i if scenario == "cold" else i % DOCS
            system = f"document {doc:08d}\n" + _filler(doc, size)
            system = system[:size]
        payload = {"model": "bench-model", "stream": True, "max_tokens": 64,
                   "messages": [{"role": "system", "content": system},
                                {"role": "user", "content": f"question {i}?"}]}
        out.append(orjson.dumps(payload))
    return out


def measure(strategy: str, size: int, n: int, scenario: str, number: int, repeats: int) -> dict[str, Any]:
    """One row: median over ``repeats`` runs of the mean µs per request of each phase."""
    rc = routing(strategy, size)
    pool = VariantPool("v", [f"http://10.0.{i // 250}.{i % 250}:8000" for i in range(n)], rc, seed=1)
    total = number * repeats
    if scenario == "shared":  # every instance holds the system prompt's first half
        head = orjson.loads(bodies(size, "shared", 1)[0])
        head["messages"][0]["content"] = head["messages"][0]["content"][: size // 2]
        for inst in pool.instances:
            _, blocks = openai_route(head, True, rc)
            pool.learn(inst, blocks)
    for b in bodies(size, scenario, DOCS):  # learned state: documents routed once
        key, blocks = openai_route(orjson.loads(b), True, rc)
        pool.acquire(key, blocks=blocks).release()
    raw = bodies(size, scenario, total, start=10_000 if scenario == "cold" else 0)
    clock = time.perf_counter_ns
    runs: dict[str, list[float]] = {"parse": [], "orjson": [], "key": [], "decide": [], "learn": []}
    for r in range(repeats):
        acc = dict.fromkeys(runs, 0)
        for i in range(r * number, (r + 1) * number):
            # The router parses a body just before routing it, so the payload is in the
            # CPU's caches when the key is computed; the same here.
            t0 = clock()
            payload = loads_body(raw[i])
            t1 = clock()
            key, blocks = openai_route(payload, True, rc)
            t2 = clock()
            lease = pool.acquire(key, blocks=blocks, learn=False)
            lease.release()
            t3 = clock()
            pool.learn(lease.instance, blocks)
            t4 = clock()
            acc["parse"] += t1 - t0
            acc["key"] += t2 - t1
            acc["decide"] += t3 - t1
            acc["learn"] += t4 - t3
        for i in range(r * number, (r + 1) * number):  # the same bodies, by orjson alone
            t0 = clock()
            orjson.loads(raw[i])
            acc["orjson"] += clock() - t0
        for k, v in acc.items():
            runs[k].append(v / number / 1000)
    row: dict[str, Any] = {"strategy": strategy, "prefix_bytes": size, "instances": n, "scenario": scenario}
    for k, v in runs.items():
        row[f"{k}_us"] = statistics.median(v)
    return row


def interpreter_reference_us(repeats: int = 7, number: int = 2000) -> float:
    """How fast this machine runs Python right now: the best of ``repeats`` timings of
    ``sum(range(1000))``, µs per call. Independent of prefixroute's code, so runs of
    this benchmark on different days (this machine's speed moves by up to 3x) can be
    compared through it: a decision that took twice as long when the reference took
    twice as long was not slower code."""
    import timeit

    return min(timeit.repeat("sum(range(1000))", number=number, repeat=repeats)) / number * 1e6


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="fewer requests per run (200 x 3 instead of 1,000 x 5)")
    p.add_argument("--number", type=int, default=None, help="requests per timed run (default: 1000; --quick: 200)")
    p.add_argument("--repeats", type=int, default=None, help="timed runs per figure, median reported (default: 5; "
                                                                 "--quick: 3)")
    p.add_argument("--json", metavar="PATH", help="write every figure and the settings as JSON")
    args = p.parse_args(argv)
    number = args.number or (200 if args.quick else 1000)
    repeats = args.repeats or (3 if args.quick else 5)
    if number < 1 or repeats < 1:
        p.error("--number and --repeats must be >= 1")

    reference = interpreter_reference_us()
    print(f"interpreter reference: sum(range(1000)) takes {reference:.1f} µs here now")
    rows = []
    print(f"{'strategy':28} {'prefix':>7} {'inst':>5} {'scenario':8} {'parse µs':>9} {'orjson µs':>10} {'key µs':>8} {'decide µs':>10} "
          f"{'learn µs':>9}")
    for strategy in STRATEGIES:
        scenarios = ("warm", "cold", "shared") if strategy == "CACHE_AWARE" else ("warm",)
        for size in SIZES:
            for n in INSTANCES:
                for scenario in scenarios:
                    row = measure(strategy, size, n, scenario, number, repeats)
                    rows.append(row)
                    flag = ""
                    if size == 65536 and n == 64:
                        flag = "  ok" if row["decide_us"] < GOAL_US else f"  over the {GOAL_US:.0f} µs goal"
                    print(f"{strategy:28} {size // 1024:>5}KB {n:>5} {scenario:8} {row['parse_us']:9.1f} {row['orjson_us']:10.1f} "
                          f"{row['key_us']:8.1f} {row['decide_us']:10.1f} {row['learn_us']:9.1f}{flag}", flush=True)
    reference_after = interpreter_reference_us()
    print(f"interpreter reference after the rows: {reference_after:.1f} µs")
    goal = [r for r in rows if r["prefix_bytes"] == 65536 and r["instances"] == 64]
    worst = max(goal, key=lambda r: r["decide_us"])
    print(f"\n64 KB prefix, 64 instances: slowest decision {worst['decide_us']:.1f} µs "
          f"({worst['strategy']}, {worst['scenario']}); goal < {GOAL_US:.0f} µs: "
          f"{'met' if worst['decide_us'] < GOAL_US else 'NOT met'}")
    if args.json:
        doc = {"benchmark": "decision", "command": " ".join([sys.executable.rsplit('/', 1)[-1], *sys.argv]),
               "prefixroute_commit": source_commit(), "python": platform.python_version(),
               "machine": platform.machine(),
               "interpreter_reference_us": {"before": reference, "after": reference_after}, "number": number,
               "repeats": repeats, "goal_us": GOAL_US, "rows": rows}
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=2)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
