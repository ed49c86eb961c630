"""What reading one engine's ``/metrics`` page costs the router.

Every router replica scrapes every engine (``--metrics-scrape-interval``; 0.5 s in
``bench/policy_vs_peers.py``) and parses the page with
:func:`prefixroute.server.scrape.parse_engine_metrics`: the lines of the families it
reads are kept, then read by :mod:`prefixroute.server.exposition` (plain lines
directly, any other page by prometheus-client's parser). This times that call on two
pages written by prometheus-client's own exposition (as vLLM's is):

* ``small``: the families the router reads (4 label sets) and nothing else;
* ``vllm-like``: the same plus 12 histograms of 30 buckets and a few dozen other
  series, about the size of a vLLM page;

each with the direct reading and with every page sent to prometheus-client's parser
(what the router did before), and checks both give the same figures. Each figure is the
median over ``--repeats`` runs of the mean of ``--number`` parses, in microseconds.
Usage::

    python bench/scrape_parse.py [--quick] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from prefixroute.server import exposition  # noqa: E402
from prefixroute.server.scrape import parse_engine_metrics  # noqa: E402


def page(extra: bool) -> str:
    """A metrics page of one engine with 4 label sets (and, with ``extra``, the rest of a
    vLLM-like page)."""
    reg = CollectorRegistry()
    labels = ["model_name", "engine"]
    queries = Counter("vllm:prefix_cache_queries", "Prefix cache queries, tokens.", labels, registry=reg)
    hits = Counter("vllm:prefix_cache_hits", "Prefix cache hits, tokens.", labels, registry=reg)
    running = Gauge("vllm:num_requests_running", "Requests running.", labels, registry=reg)
    waiting = Gauge("vllm:num_requests_waiting", "Requests waiting.", labels, registry=reg)
    usage = Gauge("vllm:kv_cache_usage_perc", "KV cache usage.", labels, registry=reg)
    for e in range(4):
        lv = ("meta-llama/Llama-3.1-70B-Instruct", str(e))
        queries.labels(*lv).inc(1_000_000 + e)
        hits.labels(*lv).inc(800_000 + e)
        running.labels(*lv).set(12 + e)
        waiting.labels(*lv).set(e)
        usage.labels(*lv).set(0.5)
    if extra:
        buckets = [0.001 * 2 ** k for k in range(29)]
        for h in range(12):
            hist = Histogram(f"vllm:histogram_{h}_seconds", "A latency.", labels, buckets=buckets, registry=reg)
            hist.labels("meta-llama/Llama-3.1-70B-Instruct", "0").observe(0.05 * (h + 1))
        for g in range(40):
            Gauge(f"vllm:other_gauge_{g}", "Something else.", registry=reg).set(g)
    return generate_latest(reg).decode()


def timed(text: str, number: int, repeats: int) -> float:
    """Median over ``repeats`` of the mean µs of ``number`` parses of ``text``."""
    runs = []
    for _ in range(repeats):
        t0 = time.perf_counter_ns()
        for _ in range(number):
            parse_engine_metrics(text)
        runs.append((time.perf_counter_ns() - t0) / number / 1000)
    return statistics.median(runs)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--number", type=int, default=2000, help="parses per run (default 2000)")
    p.add_argument("--repeats", type=int, default=5, help="runs per figure; the median is shown (default 5)")
    p.add_argument("--quick", action="store_true", help="200 parses x 3 runs")
    p.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    args = p.parse_args(argv)
    number, repeats = (200, 3) if args.quick else (args.number, args.repeats)
    if number < 1 or repeats < 1:
        p.error("--number and --repeats must be at least 1")
    rows = []
    plain = exposition._plain
    for name, extra in (("small", False), ("vllm-like", True)):
        text = page(extra)
        direct_stats = parse_engine_metrics(text)
        direct = timed(text, number, repeats)
        exposition._plain = lambda lines: None  # every page to prometheus-client's parser
        try:
            parser_stats = parse_engine_metrics(text)
            parser = timed(text, number, repeats)
        finally:
            exposition._plain = plain
        if parser_stats != direct_stats:
            print(f"error: {name}: the two readings differ:\n{direct_stats}\n{parser_stats}", file=sys.stderr)
            return 1
        rows.append({"page": name, "lines": text.count("\n"), "bytes": len(text.encode()),
                     "direct_us": round(direct, 1), "parser_us": round(parser, 1),
                     "speedup": round(parser / direct, 2)})
    print(f"{'page':<10} {'lines':>6} {'bytes':>7} {'direct µs':>10} {'parser µs':>10} {'x':>6}")
    for r in rows:
        print(f"{r['page']:<10} {r['lines']:>6} {r['bytes']:>7} {r['direct_us']:>10.1f} {r['parser_us']:>10.1f} "
              f"{r['speedup']:>6.2f}")
    print("same figures both ways: yes")
    if args.json:
        Path(args.json).write_text(json.dumps({"number": number, "repeats": repeats, "rows": rows}, indent=2) + "\n")
        print(f"results: {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
