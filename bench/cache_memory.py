"""Memory of CACHE_AWARE's learned state with its default budget, over 1,000,000 requests.

Routes ``--requests`` requests (default 1,000,000) through a ``CACHE_AWARE`` variant of
``--instances`` instances with the default settings (``InstanceCacheTokens`` 1,200,000:
each instance's view may cover 4.8 million characters), on traffic that holds far more
distinct text than the views can: ``--documents`` documents of 2-8 KB (Zipf popularity,
s = 1.1), each request a document plus its own 200-character question. Requests end in
the order they started, ``--in-flight`` at a time.

Every ``--report-every`` requests it prints the blocks remembered, the estimated bytes
(``prefixroute_approx_cache_bytes``), the text covered against the budget, the
fleet-wide index size and the process's peak RSS. At the end it checks that no view ever
covered more than its budget and that the estimate is within 25 % of what the state
really takes (measured with ``tracemalloc`` on a copy built from the final views).

Usage::

    python bench/cache_memory.py [--requests 1000000] [--report-every 100000] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import sys
import time
import tracemalloc
from collections import deque

from prefixroute.core.cache_aware import BYTES_PER_BLOCK_ENTRY, ApproxPrefixCache, CacheAwareStrategy
from prefixroute.core.config import RoutingConfig
from prefixroute.core.keys import text_block_hashes
from prefixroute.core.pool import VariantPool


def _peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _measured_bytes(strategy: CacheAwareStrategy) -> int:
    """Bytes a copy of the final state takes (views and index), by tracemalloc."""
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    index: dict[int, int] = {}
    copies = []
    for bit, cache in enumerate(strategy.caches.values()):
        c = ApproxPrefixCache(cache.capacity, index, 1 << bit, cache.max_blocks)
        # The same state built from new objects; an int object the view shares between
        # entries (a parent's hash, one stamp for a whole chain) is shared in the copy too.
        fresh: dict[int, int] = {}

        def new(x: int) -> int:
            return fresh.setdefault(id(x), int(str(x)))

        c._nodes = {new(h): (new(size), None if parent is None else new(parent), children, new(stamp))
                    for h, (size, parent, children, stamp) in cache._nodes.items()}
        c._heap = [(new(stamp), new(h)) for stamp, h in cache._heap]
        c._tails = {new(h): (new(units), new(rest)) for h, (units, rest) in cache._tails.items()}
        c.used, c._leaves, c._tick = cache.used, cache._leaves, cache._tick
        for h in c._nodes:
            index[h] = index.get(h, 0) | c._bit
        copies.append(c)
    after = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    return after - before


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=1_000_000, help="requests to route (default: 1,000,000)")
    p.add_argument("--instances", type=int, default=8, help="instances (default: 8)")
    p.add_argument("--documents", type=int, default=20_000, help="distinct documents (default: 20,000)")
    p.add_argument("--in-flight", type=int, default=32, help="requests in flight at a time (default: 32)")
    p.add_argument("--report-every", type=int, default=100_000, help="print a line every N requests (default: 100,000)")
    p.add_argument("--seed", type=int, default=0, help="traffic seed (default: 0)")
    p.add_argument("--json", metavar="PATH", help="write the figures as JSON")
    args = p.parse_args(argv)
    if min(args.requests, args.instances, args.documents, args.in_flight, args.report_every) < 1:
        p.error("every count must be >= 1")

    routing = RoutingConfig.build("cache-aware", concurrency_threshold=1024)
    pool = VariantPool("v", [f"http://10.0.0.{i}:8000" for i in range(args.instances)], routing, seed=args.seed)
    strategy = pool.strategy
    assert isinstance(strategy, CacheAwareStrategy)
    rng = random.Random(args.seed)
    docs = [f"document {d}\n" + ("lorem ipsum %d " % d) * rng.randrange(150, 600) for d in range(args.documents)]
    weights = [1.0 / (r + 1) ** 1.1 for r in range(args.documents)]
    picks = rng.choices(range(args.documents), weights=weights, k=args.requests)
    budget_units = strategy.capacity_units
    print(f"{args.instances} instances, view budget {budget_units:,} characters each "
          f"({strategy.capacity_blocks:,} blocks at most), {args.documents:,} documents "
          f"({sum(len(d) for d in docs) / 1e6:.0f} M characters)")
    print(f"{'requests':>10} {'blocks':>10} {'est. MiB':>9} {'covered / budget':>17} {'index':>10} "
          f"{'peak RSS MiB':>12} {'req/s':>8}")
    live: deque = deque()
    worst_fill = 0.0
    rows = []
    t0 = time.perf_counter()
    for i in range(args.requests):
        text = docs[picks[i]] + f"\nquestion {i}: " + "q" * 180
        blocks = text_block_hashes(text, 64, 131_072, "bench-model")
        live.append(pool.acquire(None, blocks=blocks))
        if len(live) >= args.in_flight:
            live.popleft().release()
        if (i + 1) % args.report_every == 0 or i + 1 == args.requests:
            stats = strategy.stats()
            fill = max(c.used for c in strategy.caches.values()) / budget_units
            worst_fill = max(worst_fill, fill)
            row = {"requests": i + 1, "blocks": int(stats["approx_cache_blocks"]),
                   "estimated_bytes": int(stats["approx_cache_bytes"]),
                   "max_fill": fill, "index_entries": len(strategy._index), "peak_rss_mib": _peak_rss_mib(),
                   "requests_per_s": (i + 1) / (time.perf_counter() - t0)}
            rows.append(row)
            print(f"{i + 1:>10,} {row['blocks']:>10,} {row['estimated_bytes'] / 2**20:>9.1f} "
                  f"{fill:>16.1%} {row['index_entries']:>10,} {row['peak_rss_mib']:>12.0f} "
                  f"{row['requests_per_s']:>8.0f}", flush=True)
    for lease in live:
        lease.release()
    measured = _measured_bytes(strategy)
    estimate = strategy.stats()["approx_cache_bytes"]
    within = worst_fill <= 1.0
    close = abs(measured - estimate) <= 0.25 * measured
    print(f"\nevery view within its budget: {'yes' if within else 'NO'} (fullest {worst_fill:.1%}); "
          f"state measured {measured / 2**20:.1f} MiB vs estimated {estimate / 2**20:.1f} MiB "
          f"({BYTES_PER_BLOCK_ENTRY} B per block): {'within 25 %' if close else 'OFF by more than 25 %'}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"benchmark": "cache_memory", "command": " ".join(["python", *sys.argv]),
                       "instances": args.instances, "budget_characters": budget_units, "rows": rows,
                       "measured_bytes": measured, "estimated_bytes": estimate, "within_budget": within}, f, indent=2)
        print(f"wrote {args.json}")
    return 0 if within and close else 1


if __name__ == "__main__":
    sys.exit(main())
