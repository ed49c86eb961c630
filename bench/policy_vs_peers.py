"""prefixroute's strategies against the open routers of the field, side by side.

One program, one emulated fleet, the same seeded traffic for every router:

* prefixroute ``RANDOM``, ``LEAST_OUTSTANDING_REQUESTS``, ``PREFIX_AWARE`` and
  ``CACHE_AWARE`` (``prefixroute serve``);
* the SGLang router (``sglang-router``, ``cache_aware``);
* vLLM's Rust router (``vllm-router``, ``cache_aware`` and ``consistent_hash``);
* HAProxy with ``balance hash`` on the request body's first PrefixLength bytes and
  ``hash-balance-factor`` (bounded-load consistent hashing).

* a re-implementation of llm-d's default scorers (prefix cache 3, queue 2, KV-cache
  utilisation 2: ``prefixroute serve --strategy llmd-reference``), on prefixroute's data
  plane, labelled as such.

Workloads (:data:`WORKLOADS`, the ten of :mod:`prefixroute.workloads.catalog`): long
shared-prefix groups; multi-turn chats; one long system prompt shared by every
conversation; Zipf-skewed hot groups; an instance added and one removed mid-run; one
very hot document; open-loop arrivals near the fleet's capacity; ShareGPT-style chats;
agent loops; questions about images. Each runs with 1, 4 and 8 router replicas
(independent router processes, users spread over them round robin; for a peer, that
many processes of the peer).

Every run starts a fresh fleet of ``prefixroute emulate`` instances (cold caches) and
fresh routers, drives closed-loop users for a fixed real time, reads the engines'
prefix-cache counters from ``/metrics`` (cache-hit rate = ``vllm:prefix_cache_hits_total
/ vllm:prefix_cache_queries_total``) and stops everything. It prints one table per
workload, a verdict for CACHE_AWARE against every other router, writes plots and,
with ``--json PATH``, SPEC §7's JSON (extra fields: ``workload``, ``label``,
``busiest_share``...).

The peers are installed into their own virtual environment (``--peers-venv``), never
into the project's; HAProxy with ``apt-get`` when missing. A peer that cannot be
installed is skipped with the reason printed.

Usage::

    python bench/policy_vs_peers.py --quick              # about 12 minutes on 2 cores
    python bench/policy_vs_peers.py --json results.json  # the full run (about 2 hours 40 minutes)
    python bench/policy_vs_peers.py --json results.json --resume  # go on after an interruption

Times in tables and JSON are **model seconds** (real seconds / ``--time-scale``), as
in ``prefixroute demo``. docs/BENCHMARKS.md has a run's output and how to read it.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any, Callable, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parent))

from peer_install import (  # noqa: E402  (bench/ is a folder of scripts, not a package)
    DEFAULT_PEERS_VENV,
    PeerStatus,
    ensure_haproxy,
    ensure_python_peers,
)
from peer_process import PeerError, run_main  # noqa: E402
from pvp_output import render_workload_table, write_json, write_plots  # noqa: E402
from pvp_results import RunResult, median_run, resume_commands, resume_runs  # noqa: E402
from pvp_routers import _slug, router_specs, with_access_log  # noqa: E402
from pvp_run import run_one  # noqa: E402
from pvp_settings import FULL, QUICK, SUBJECT, WORKLOADS, BenchSettings  # noqa: E402
from pvp_verdicts import precise_lines, verdict_lines  # noqa: E402


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python bench/policy_vs_peers.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true",
                   help=f"smoke run: {QUICK.duration_s:g} s of traffic per run instead of {FULL.duration_s:g} s, and "
                        "every workload with 1 router replica, shared-prefix also with 4 and 8")
    p.add_argument("--json", metavar="PATH", help="write SPEC §7 JSON (every run, plus settings and verdicts)")
    p.add_argument("--resume", action="store_true",
                   help="with --json: keep the runs already in that file (it is rewritten after every run) and run "
                        "only the missing ones; the settings must be the same")
    p.add_argument("--out-dir", default="prefixroute-bench", help="plots go here (default: ./prefixroute-bench)")
    p.add_argument("--no-plots", action="store_true", help="do not write plots")
    p.add_argument("--workloads", default=",".join(w.name for w in WORKLOADS),
                   help="comma-separated workloads to run (default: all)")
    p.add_argument("--routers", default="",
                   help="comma-separated router labels or their slugs to run, e.g. "
                        "prefixroute-cache-aware,sglang-router-cache-aware, or a product name (haproxy) (default: all)")
    p.add_argument("--replicas", default="", help="comma-separated router replica counts (default: 1,4,8)")
    p.add_argument("--access-logs", type=Path, default=None, metavar="DIR",
                   help="write each prefixroute run's access log (serve --access-log: one JSON line per request "
                        "with its decision, instance, TTFT and body size, never its text) to "
                        "DIR/WORKLOAD-ROUTER-xREPLICAS-REPEAT.jsonl (default: none)")
    p.add_argument("--repeat", type=int, default=None,
                   help="runs of each (workload, router, replicas): tables show the median of each figure, the JSON "
                        "every run, for the run-to-run noise (default: 1)")
    p.add_argument("--duration", type=float, default=None, help="real seconds of traffic per run")
    p.add_argument("--users-scale", type=float, default=None,
                   help="multiply every workload's number of closed-loop users (default: 1)")
    p.add_argument("--time-scale", type=float, default=None, help="engine time scale (real s per model s)")
    p.add_argument("--seed", type=int, default=None, help="workload and router seed")
    p.add_argument("--precise", nargs="?", const="on", choices=("off", "on", "both"), default="off",
                   help="prefixroute CACHE_AWARE in precise mode, on the engines' KV events (every engine then "
                        "tokenizes with the tiny tokenizer and publishes them, its per-token costs and sizes scaled "
                        "so that a request costs what it does on the default engine); both: beside its learned "
                        "view (default: off)")
    p.add_argument("--tiers", choices=("none", "cpu", "shared", "cpu+shared"), default="none",
                   help="KV tiers in every engine (a CPU tier of 4x its KV capacity, a shared tier of 4x the "
                        "fleet's); prefixroute CACHE_AWARE is told of them (default: none)")
    p.add_argument("--tier-aware", choices=("on", "off", "both"), default="on",
                   help="with --tiers: CACHE_AWARE told of the tiers, not told ('tier-unaware'), or both (default: on)")
    p.add_argument("--peers-venv", type=Path, default=DEFAULT_PEERS_VENV,
                   help=f"virtual environment for the Python peers (default: {DEFAULT_PEERS_VENV})")
    p.add_argument("--no-install", action="store_true", help="never install peers; skip the missing ones")
    return p.parse_args(argv)


def settings_from(args: argparse.Namespace) -> BenchSettings:
    base = QUICK if args.quick else FULL
    upd: dict[str, Any] = {}
    if args.duration is not None:
        upd["duration_s"] = args.duration
    if args.users_scale is not None:
        upd["users_scale"] = args.users_scale
    if args.time_scale is not None:
        upd["time_scale"] = args.time_scale
    if args.seed is not None:
        upd["seed"] = args.seed
    if args.replicas:
        upd["replicas"] = tuple(int(x) for x in args.replicas.split(",") if x.strip())
    upd["precise"], upd["tiers"], upd["tier_aware"] = args.precise, args.tiers, args.tier_aware
    if args.repeat is not None:
        if args.repeat < 1:
            raise SystemExit("error: --repeat must be at least 1")
        upd["repeat"] = args.repeat
    out = BenchSettings(**(asdict(base) | upd))
    if not out.duration_s > 0 or not out.users_scale > 0 or not out.time_scale > 0 or not out.replicas \
            or min(out.replicas) < 1:
        raise SystemExit("error: --duration, --users-scale, --time-scale and --replicas must be positive")
    return out


def select(items: Sequence[Any], wanted: str, names: Callable[[Any], Sequence[str]], what: str) -> list[Any]:
    if not wanted:
        return list(items)
    keys = [w.strip() for w in wanted.split(",") if w.strip()]
    out = [it for it in items if any(k in names(it) for k in keys)]
    unknown = [k for k in keys if not any(k in names(it) for it in items)]
    if unknown:
        raise SystemExit(f"error: unknown {what} {unknown}; known: {[names(it)[0] for it in items]}")
    return out


def main(argv: Sequence[str] | None = None) -> int:
    from rich.console import Console
    from rich.markup import escape

    args = parse_args(argv)
    s = settings_from(args)
    if args.access_logs is not None:
        try:
            args.access_logs.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise SystemExit(f"error: --access-logs: {exc}") from None
    workloads = select(WORKLOADS, args.workloads, lambda w: [w.name], "workload")
    routers = select(router_specs(s), args.routers, lambda r: [_slug(r.label), r.label, r.router], "router")
    console = Console() if Console().is_terminal else Console(width=200)
    command = "python bench/policy_vs_peers.py " + " ".join(sys.argv[1:] if argv is None else argv)

    # Peers: install into their own environment; skip (loudly) what cannot run.
    statuses: dict[str, PeerStatus] = {}
    wanted = {r.peer for r in routers if r.peer}
    if wanted & {"sglang-router", "vllm-router"}:
        statuses.update(ensure_python_peers(args.peers_venv, install=not args.no_install,
                                            log=lambda m: console.print(f"[dim]{m}[/dim]")))
    if "haproxy" in wanted:
        statuses["haproxy"] = ensure_haproxy(install=not args.no_install,
                                             log=lambda m: console.print(f"[dim]{m}[/dim]"))
    skipped: dict[str, str] = {}
    for r in list(routers):
        st = statuses.get(r.peer)
        if r.peer and not (st and st.available):
            skipped[r.label] = st.detail if st else "not checked"
            console.print(f"[yellow]SKIPPING {r.label}:[/yellow] {escape(skipped[r.label])}")
            routers.remove(r)
    for st in statuses.values():
        if st.available:
            console.print(f"peer: {st.detail}")

    baselines = {"RANDOM", "LEAST_OUTSTANDING_REQUESTS"}
    plan = [(wl, reps, spec) for wl in workloads for reps in s.replicas
            if reps == 1 or s.multi_replica_workloads is None or wl.name in s.multi_replica_workloads
            for spec in routers
            if not (spec.router == "prefixroute" and spec.strategy in baselines and reps not in s.baselines_replicas)]
    total = len(plan) * s.repeat
    console.print(f"[bold]policy_vs_peers[/bold]: {len(routers)} routers, {len(workloads)} workloads, replicas "
                  f"{','.join(map(str, s.replicas))}: {total} runs; {s.instances} emulated instances (time scale "
                  f"{s.time_scale}, {s.kv_capacity_tokens:,} KV tokens each), {s.duration_s:g} s of traffic per run; "
                  f"{s.fleet_mode}")
    all_runs: list[RunResult] = []
    runs: list[RunResult] = []
    descriptions = {w.name: w.make(s.seed).describe() for w in workloads}
    if args.resume and not args.json:
        raise SystemExit("error: --resume needs --json PATH (the file to resume)")
    done: dict[tuple[str, str, int], list[RunResult]] = {}
    earlier = resume_commands(Path(args.json)) if args.resume else []
    for r in resume_runs(Path(args.json), s) if args.resume else []:
        done.setdefault((r.workload, r.label, r.summary.replicas), []).append(r)
    if done:
        console.print(f"resuming {args.json}: {sum(map(len, done.values()))} runs kept")
    n = 0
    t_start = time.monotonic()
    for wl, reps, spec in plan:
        repeats: list[RunResult] = sorted(done.get((wl.name, spec.label, reps), []), key=lambda r: r.repeat)
        n += len(repeats)
        for k in range(len(repeats), s.repeat):
            n += 1
            t0 = time.monotonic()
            try:
                rr = run_one(with_access_log(spec, args.access_logs, wl.name, reps, k), wl, reps, s,
                             statuses.get(spec.peer))
            except PeerError as exc:
                console.print(f"[red]{wl.name} / {spec.label} x{reps}: failed to start:[/red] {escape(str(exc))}")
                skipped[f"{spec.label} x{reps} on {wl.name}"] = str(exc)[:500]
                continue
            rr.repeat = k
            repeats.append(rr)
            sm = rr.summary
            bad = [e for e in rr.events if "error" in e]
            console.print(
                f"[{n}/{total}] {wl.name:<19} {spec.label:<34} x{reps}: hit {sm.cache_hit_rate * 100:5.1f} %  "
                f"P50 {sm.p50_ttft_s * 1000:6.0f} ms  P90 {sm.p90_ttft_s * 1000:6.0f} ms  "
                f"{sm.requests} req  {sm.errors} err  router CPU {rr.router_cpu_s:.1f} s  "
                f"({time.monotonic() - t0:.0f} s)"
                + (f"  [red]membership:[/red] {escape(str(bad))}" if bad else ""))
            if sm.strategy == SUBJECT and sm.decisions and set(sm.decisions) <= {"fallback"}:
                console.print("[yellow]  CACHE_AWARE made only 'fallback' decisions: the router computed no "
                              "block hashes for it (is the strategy wired into `prefixroute serve`?)[/yellow]")
        all_runs += repeats
        if repeats:
            runs.append(median_run(repeats))
        if args.json:  # after every run: an interrupted run resumes from here (--resume)
            write_json(Path(args.json), workloads, descriptions, runs, s, command, skipped, all_runs, earlier)
    console.print(f"all runs: {time.monotonic() - t_start:.0f} s")
    for wl in workloads:
        wr = [r for r in runs if r.workload == wl.name]
        if wr:
            console.print(render_workload_table(wl, wr, descriptions[wl.name], s.fleet_mode))
    console.print("[bold]Verdicts[/bold] (CACHE_AWARE against every other router: it should have the highest hit "
                  "rate and the lowest P50/P90 TTFT)")
    for line in verdict_lines(runs):
        console.print("  " + line)
    lines = precise_lines(runs)
    if lines:
        console.print("[bold]Precise mode[/bold] (prefixroute CACHE_AWARE on the engines' KV events against its "
                      "learned view)")
        for line in lines:
            console.print("  " + line)
    if skipped:
        console.print("[yellow]skipped:[/yellow] " + escape("; ".join(f"{k}: {v}" for k, v in skipped.items())))
    if not args.no_plots and runs:
        paths = write_plots(Path(args.out_dir), workloads, runs)
        console.print("plots: " + ", ".join(str(p) for p in paths))
    if args.json:
        write_json(Path(args.json), workloads, descriptions, runs, s, command, skipped, all_runs, earlier)
        console.print(f"results: {args.json}")
    return 0 if runs and all(r.summary.errors == 0 for r in runs) else 1


if __name__ == "__main__":
    run_main(main)
