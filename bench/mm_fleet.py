"""The fleets of ``bench/multi_model.py``: starting emulated engines and a router, the
routing configuration of a strategy, emptying the engines' caches between runs and
switching the strategy through the admin API.
"""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path
from typing import Any, Sequence

import aiohttp
import yaml

from mm_settings import COMPONENTS, ENDPOINT, Sizes
from prefixroute.demo.processes import Child, ProcessGroup


async def start_engines(procs: ProcessGroup, models: Sequence[str], args: argparse.Namespace, sizes: Sizes,
                        extra: Sequence[Sequence[str]] = ()) -> list[Child]:
    async def one(i: int, model: str) -> Child:
        flags = ["emulate", "--port", "0", "--instance-id", f"engine-{i}", "--model", model,
                 "--time-scale", str(args.time_scale), "--kv-capacity-tokens", str(sizes.kv_tokens),
                 "--log-level", "warning", *(extra[i] if extra else ())]
        return await asyncio.to_thread(procs.start, f"engine-{i}", flags)

    return list(await asyncio.gather(*(one(i, m) for i, m in enumerate(models))))


async def start_router(procs: ProcessGroup, config: dict[str, Any], tmp: Path, name: str,
                       extra: Sequence[str] = ()) -> Child:
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return await asyncio.to_thread(procs.start, "router", [
        "serve", "--config", str(path), "--port", "0", "--seed", "0",  # (admin: a free port, printed)
        "--log-level", "warning", *extra], 30.0, 2)


def routing(strategy: str, threshold: int, prefix_length: int) -> dict[str, Any]:
    if strategy == "PREFIX_AWARE":
        return {"RoutingStrategy": strategy, "PrefixAwareRoutingConfig": {
            "PrefixLength": prefix_length, "ConcurrencyThreshold": threshold}}
    return {"RoutingStrategy": strategy}


async def reset_caches(http: aiohttp.ClientSession, urls: Sequence[str]) -> None:
    """Empty every engine's prefix cache (vLLM's route; refused while requests run)."""
    for url in urls:
        for _ in range(200):
            async with http.post(url + "/reset_prefix_cache") as r:
                if r.status == 200:
                    break
            await asyncio.sleep(0.05)
        else:
            raise RuntimeError(f"{url} kept refusing /reset_prefix_cache")


async def set_strategy(http: aiohttp.ClientSession, admin: str, kind: str, strategy: str, args: argparse.Namespace
                       ) -> None:
    body = routing(strategy, args.concurrency_threshold, args.prefix_length)
    paths = ([f"/admin/endpoints/{ENDPOINT}/variants/AllTraffic/routing"] if kind == "single" else
             [f"/admin/endpoints/{ENDPOINT}/inference-components/{c}/routing" for c in COMPONENTS])
    for p in paths:
        async with http.put(admin + p, json=body) as r:
            if r.status != 200:
                raise RuntimeError(f"admin {p}: {r.status} {await r.text()}")
