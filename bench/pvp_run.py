"""One run of ``bench/policy_vs_peers.py`` (:func:`run_one`): a fresh fleet and fresh
routers, the workload's traffic with its membership change, the engines' prefix-cache
counters and the CPU seconds the routers and engines used (:func:`tree_cpu_s`, from
``proc_stats``).
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Sequence

from peer_install import PeerStatus
from peer_process import PeerError, ProcessTracker
from peers import RouterSpec, RunningRouter
from proc_stats import trees_cpu_seconds
from prefixroute.demo.report import scrape_counters, summarize
from pvp_drive import drive
from pvp_fleet import start_fleet, tiny_token_ratio
from pvp_results import RunResult, source_commit
from pvp_settings import BenchSettings, WorkloadSpec


HIT = "vllm:prefix_cache_hits_total"
QUERIES = "vllm:prefix_cache_queries_total"


def tree_cpu_s(pids: Sequence[int]) -> float:
    """CPU seconds (user + system) used so far by the processes ``pids`` and every
    descendant still running (their reaped children's not counted; ``nan`` without
    ``/proc``)."""
    return trees_cpu_seconds(pids, reaped=False)


_RATIOS: dict[tuple[str, int, str], float] = {}


def _ratio_of(name: str, seed: int, precise: str, wl: Any) -> float:
    """:func:`tiny_token_ratio` once per (workload, seed, mode) of an invocation: every
    router and replica count of a workload meets the same engines."""
    key = (name, seed, precise)
    if key not in _RATIOS:
        _RATIOS[key] = tiny_token_ratio(wl, precise)
    return _RATIOS[key]


def run_one(spec: RouterSpec, workload: WorkloadSpec, replicas: int, s: BenchSettings, status: PeerStatus | None,
            workdir: Path | None = None) -> RunResult:
    """Fresh fleet, fresh routers, one workload; everything stopped on return.

    Raises:
        PeerError: a process did not start.
    """
    extra = 1 if workload.membership else 0
    with ProcessTracker(workdir) as tracker:
        wl = workload.make(s.seed)
        ratio = _ratio_of(workload.name, s.seed, s.precise, wl)
        fleet = start_fleet(tracker, s.instances + extra, s, token_ratio=ratio)
        ids = [iid for iid, _ in fleet]
        urls = [u for _, u in fleet]
        initial = urls[: s.instances]
        exe = status.executable if status else ""
        # Start the replicas in parallel: each waits for readiness on its own.
        with ThreadPoolExecutor(max_workers=replicas) as pool:
            # (start_retrying: a port taken between its choice and the router's bind, which
            # 8 replicas started at once beside other processes meet, is tried again elsewhere)
            futures = [pool.submit(spec.start_retrying, tracker, initial, exe, urls) for _ in range(replicas)]
            routers: list[RunningRouter] = []
            errors = []
            for f in futures:
                try:
                    routers.append(f.result())
                except PeerError as exc:
                    errors.append(exc)
            if errors:
                raise errors[0]
        events: list[tuple[float, Callable[[], Any]]] = []
        if workload.membership:
            m = workload.membership
            added, removed = urls[-1], urls[0]

            def on_all(action: str, url: str) -> Callable[[], str]:
                def apply() -> str:
                    with ThreadPoolExecutor(max_workers=len(routers)) as pool:
                        list(pool.map(lambda r: getattr(r, action)(url), routers))
                    return f"{action} {ids[urls.index(url)]}"
                return apply

            events = [(m.add_at * s.duration_s, on_all("add_backend", added)),
                      (m.remove_at * s.duration_s, on_all("remove_backend", removed))]
        users = None if workload.users is None else max(1, round(workload.users * s.users_scale))
        router_pids = [r.process.proc.pid for r in routers]
        engine_pids = [p.proc.pid for p in tracker.processes if p.name.startswith("engine-")]
        cpu0 = tree_cpu_s(router_pids), tree_cpu_s(engine_pids)
        results, wall, log = asyncio.run(drive([r.url for r in routers], iter(wl.sessions()), workload.session_key,
                                               users, s.duration_s, s.time_scale, events))
        if ratio != 1.0:
            log.append({"at_s": 0.0, "what": f"tiny tokenizer: {ratio:.3f} of the default engine's tokens; the "
                                             f"engines' per-token costs and sizes scaled by it"})
        cpu = tree_cpu_s(router_pids) - cpu0[0], tree_cpu_s(engine_pids) - cpu0[1]
        counters = asyncio.run(scrape_counters(urls, [HIT, QUERIES]))
        # Results name instances by id (X-Emulated-Instance); prefixroute's header is the URL.
        by_url = dict(zip(urls, ids))
        for r in results:
            r.instance = by_url.get(r.instance.rstrip("/"), r.instance)
        summary = summarize(spec.strategy, results, wall, s.time_scale, ids, counters[HIT], counters[QUERIES],
                            router=spec.router, replicas=replicas)
        return RunResult(workload.name, spec.label, summary, results, log, ids, router_cpu_s=cpu[0],
                         engine_cpu_s=cpu[1], commit=source_commit())
