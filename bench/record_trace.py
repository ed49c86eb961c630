"""Record a request trace through the real router, for ``prefixroute tune``.

Starts emulated engines and ``prefixroute serve --record-trace PATH`` in front of them,
drives a templated-assistant workload through it (every request: one shared
instruction block, then one of many documents, then a question; open loop) and stops.
The trace holds digests, never prompt text.

Usage::

    python bench/record_trace.py --out trace.jsonl [--duration 120] [--time-scale 0.25]
    prefixroute tune --trace trace.jsonl
"""

from __future__ import annotations

import argparse
import asyncio
import sys

from prefixroute.demo.loadgen import run_sessions
from prefixroute.demo.processes import ProcessGroup
from prefixroute.workloads.shared_prefix import SharedPrefixWorkload


def workload(seed: int, rate: float) -> SharedPrefixWorkload:
    """A 1,500-token instruction every request shares (6,000 characters: longer than small
    PrefixLengths), then one of 40 documents of 3,000 tokens, then a 100-token question."""
    return SharedPrefixWorkload(groups=40, prefix_tokens=3000, question_tokens=100, output_tokens=32,
                                instruction_tokens=1500, popularity="zipf", zipf_s=0.8, arrival_rate=rate, seed=seed)


async def main(args: argparse.Namespace) -> int:
    with ProcessGroup() as procs:
        engines = [await asyncio.to_thread(procs.start, f"engine-{i}", [
            "emulate", "--port", "0", "--instance-id", f"instance-{i}", "--time-scale", str(args.time_scale),
            "--kv-capacity-tokens", str(args.kv_capacity_tokens)]) for i in range(args.instances)]
        serve = ["serve", "--port", "0", "--admin-port", "0", "--seed", "0", "--record-trace", args.out]
        for e in engines:
            serve += ["--backend", e.url]
        router = await asyncio.to_thread(procs.start, "router", serve)
        results, _ = await run_sessions(router.url + "/v1/chat/completions", workload(args.seed, args.rate).sessions(),
                                        args.duration, args.time_scale)
    errors = sum(1 for r in results if r.error)
    print(f"recorded {len(results)} requests ({errors} errors) to {args.out}")
    return 0 if not errors else 1


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="the trace file (appended to)")
    p.add_argument("--duration", type=float, default=120.0, help="model seconds of traffic (default: 120)")
    p.add_argument("--time-scale", type=float, default=0.25, help="engine time scale (default: 0.25)")
    p.add_argument("--rate", type=float, default=4.0, help="requests per model second (default: 4)")
    p.add_argument("--instances", type=int, default=4, help="engines (default: 4)")
    p.add_argument("--kv-capacity-tokens", type=int, default=200_000, help="KV cache per engine (default: 200000)")
    p.add_argument("--seed", type=int, default=0)
    sys.exit(asyncio.run(main(p.parse_args())))
