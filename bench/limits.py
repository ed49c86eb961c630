"""Client key limits under load: offered vs admitted, per key and per tenant.

Starts 2 emulated engines and ``prefixroute serve --api-keys-file`` (a generated keys
file), then, for each data plane, drives at once:

* key ``rate-50`` (50 requests/s, burst 50): offered 150 requests/s, open loop;
* keys ``shared-a`` and ``shared-b`` of tenant ``team`` (tenant limit 40 requests/s,
  burst 40; the keys themselves unlimited): offered 35 requests/s each;
* key ``conc-8`` (8 concurrent requests): 32 clients in a closed loop (a refused one
  tries again 10 ms later), each request held a few tens of milliseconds by the engine
  (24 tokens at time scale 0.05), the router's ``prefixroute_client_in_flight`` read
  every 50 ms.

and prints, per limit, the offered and admitted rates (admitted = answered 200; the
rest got 429), over the whole run and after the first 2 s (the burst spent), and how far
the admitted rate is from the limit. A limit holds when the steady admitted rate is
within 10 % of it (and, for concurrency, the most in flight never passes it).

    python bench/limits.py                      # both data planes, 20 s each
    python bench/limits.py --duration 30 --json limits.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from prefixroute.demo.processes import ProcessGroup

MODEL = "meta-llama/Llama-3.1-70B-Instruct"
KEYS = """
Keys:
  - {Name: rate-50, Key: sk-bench-rate-50, RequestsPerSecond: 50, Burst: 50}
  - {Name: shared-a, Key: sk-bench-shared-a, Tenant: team}
  - {Name: shared-b, Key: sk-bench-shared-b, Tenant: team}
  - {Name: conc-8, Key: sk-bench-conc-8, MaxConcurrent: 8}
Tenants:
  - {Name: team, RequestsPerSecond: 40, Burst: 40}
"""
WARMUP_S = 2.0


@dataclass
class Tally:
    sent: list[float] = field(default_factory=list)  # send times, seconds from the start
    ok: list[float] = field(default_factory=list)  # send times of the requests answered 200
    limited: int = 0
    other: int = 0


async def _one(http: aiohttp.ClientSession, url: str, key: str, t: float, tally: Tally, max_tokens: int) -> None:
    body = {"model": MODEL, "prompt": f"bench {t:.6f}", "max_tokens": max_tokens}
    tally.sent.append(t)
    try:
        async with http.post(url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"}) as r:
            await r.read()
            if r.status == 200:
                tally.ok.append(t)
            elif r.status == 429:
                tally.limited += 1
            else:
                tally.other += 1
    except aiohttp.ClientError:
        tally.other += 1


async def _open_loop(http: aiohttp.ClientSession, url: str, key: str, rate: float, duration: float, t0: float,
                     tally: Tally) -> None:
    """Send ``rate`` requests/s at even intervals for ``duration`` s, whatever the answers."""
    tasks = []
    n = int(rate * duration)
    for i in range(n):
        due = t0 + i / rate
        delay = due - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(_one(http, url, key, time.monotonic() - t0, tally, 1)))
    await asyncio.gather(*tasks)


async def _closed_loop(http: aiohttp.ClientSession, url: str, key: str, clients: int, duration: float, t0: float,
                       tally: Tally) -> None:
    async def client() -> None:
        while time.monotonic() - t0 < duration:
            before = len(tally.ok)
            await _one(http, url, key, time.monotonic() - t0, tally, 24)
            if len(tally.ok) == before:
                await asyncio.sleep(0.01)  # refused: a short pause, as a client honouring Retry-After would not

    await asyncio.gather(*(client() for _ in range(clients)))


async def _watch_in_flight(http: aiohttp.ClientSession, url: str, stop: asyncio.Event) -> int:
    most = 0
    while not stop.is_set():
        async with http.get(url + "/metrics") as r:
            for line in (await r.text()).splitlines():
                if line.startswith('prefixroute_client_in_flight{client="conc-8"'):
                    most = max(most, int(float(line.rsplit(" ", 1)[1])))
        await asyncio.sleep(0.05)
    return most


def _rates(tally: Tally, duration: float) -> tuple[float, float, float]:
    offered = len(tally.sent) / duration
    admitted = len(tally.ok) / duration
    steady = sum(1 for t in tally.ok if t >= WARMUP_S) / (duration - WARMUP_S)
    return offered, admitted, steady


async def run_plane(plane: str, duration: float) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp, ProcessGroup() as group:
        keys = Path(tmp) / "keys.yaml"
        keys.write_text(KEYS)
        # time scale 0.05: a 24-token answer takes a few tens of milliseconds of wall time
        engines = [group.start(f"engine{i}", ["emulate", "--port", "0", "--time-scale", "0.05",
                                              "--log-level", "error"]) for i in range(2)]
        router = group.start("router", ["serve", "--port", "0", "--admin-port", "0", "--data-plane", plane,
                                        *[a for e in engines for a in ("--backend", e.url)],
                                        "--api-keys-file", str(keys), "--health-check-interval", "0",
                                        "--log-level", "error"])
        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=connector) as http:
            tallies = {k: Tally() for k in ("rate-50", "shared-a", "shared-b", "conc-8")}
            stop = asyncio.Event()
            t0 = time.monotonic() + 0.2
            watch = asyncio.create_task(_watch_in_flight(http, router.url, stop))
            await asyncio.gather(
                _open_loop(http, router.url, "sk-bench-rate-50", 150, duration, t0, tallies["rate-50"]),
                _open_loop(http, router.url, "sk-bench-shared-a", 35, duration, t0, tallies["shared-a"]),
                _open_loop(http, router.url, "sk-bench-shared-b", 35, duration, t0, tallies["shared-b"]),
                _closed_loop(http, router.url, "sk-bench-conc-8", 32, duration, t0, tallies["conc-8"]))
            stop.set()
            most = await watch
    rows = []
    off, adm, steady = _rates(tallies["rate-50"], duration)
    rows.append({"plane": plane, "limit": "key rate-50: 50 req/s", "offered_rps": off, "admitted_rps": adm,
                 "steady_rps": steady, "limit_value": 50.0, "errors": tallies["rate-50"].other})
    shared = Tally(sent=tallies["shared-a"].sent + tallies["shared-b"].sent,
                   ok=tallies["shared-a"].ok + tallies["shared-b"].ok,
                   other=tallies["shared-a"].other + tallies["shared-b"].other)
    off, adm, steady = _rates(shared, duration)
    rows.append({"plane": plane, "limit": "tenant team: 40 req/s over 2 keys", "offered_rps": off,
                 "admitted_rps": adm, "steady_rps": steady, "limit_value": 40.0, "errors": shared.other})
    c = tallies["conc-8"]
    rows.append({"plane": plane, "limit": "key conc-8: 8 in flight", "offered_rps": len(c.sent) / duration,
                 "admitted_rps": len(c.ok) / duration, "steady_rps": None, "limit_value": 8.0,
                 "max_in_flight": most, "errors": c.other})
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--duration", type=float, default=20.0, help="seconds of load per data plane (default: 20)")
    p.add_argument("--planes", default="fast,aiohttp", help="data planes, comma-separated (default: fast,aiohttp)")
    p.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    args = p.parse_args()
    rows: list[dict] = []
    for plane in args.planes.split(","):
        rows += asyncio.run(run_plane(plane.strip(), args.duration))
    print(f"Client limits under load, {args.duration:g} s per data plane; steady = after the first "
          f"{WARMUP_S:g} s (the burst spent)")
    print(f"{'plane':<8} {'limit':<34} {'offered':>9} {'admitted':>9} {'steady':>8} {'vs limit':>9} "
          f"{'max in flight':>14} {'errors':>7} holds")
    holds_all = True
    for r in rows:
        if r["steady_rps"] is not None:
            dev = r["steady_rps"] / r["limit_value"] - 1
            holds = abs(dev) <= 0.10
            vs, most = f"{dev * 100:+.1f} %", "-"
        else:
            holds = r["max_in_flight"] <= r["limit_value"]
            vs, most = "-", str(r["max_in_flight"])
        holds_all &= holds and r["errors"] == 0
        steady = f"{r['steady_rps']:.1f}" if r["steady_rps"] is not None else "-"
        print(f"{r['plane']:<8} {r['limit']:<34} {r['offered_rps']:>9.1f} {r['admitted_rps']:>9.1f} {steady:>8} "
              f"{vs:>9} {most:>14} {r['errors']:>7} {'yes' if holds else 'NO'}")
        r["holds"] = holds
    if args.json:
        Path(args.json).write_text(json.dumps({"workload": f"client limits, {args.duration:g} s", "runs": rows},
                                              indent=1))
    raise SystemExit(0 if holds_all else 1)


if __name__ == "__main__":
    main()
