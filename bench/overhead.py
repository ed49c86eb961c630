"""The router's own cost: latency it adds, requests/s it sustains, CPU and memory it uses,
side by side with the open routers of the field.

One program, one fast backend, the same requests for every router:

* the backend is ``bench/fast_backend.py``: a raw asyncio/uvloop HTTP/1.1 server
  answering canned OpenAI-shaped JSON or SSE streams (8 events, no delay) on 4 ports,
  the fleet's 4 "instances": 18431-18434 (``--backend-port``), the same in every run,
  so the rendezvous placement of the test bodies over the instances, which depends on
  their URLs, is the same too (free ports, said so, when those are taken; the streams
  phase's own slow backend always takes free ports: it measures no placement). It costs about 25 µs of CPU per JSON answer and 100 µs
  per stream (whatever the body size) on a 2-core development machine, a fraction of
  any router's cost, so the routers differ only by what they do themselves;
* the targets: **direct** (the backend's first port, no router), prefixroute with every
  strategy (``RANDOM``, ``LEAST_OUTSTANDING_REQUESTS``, ``PREFIX_AWARE``,
  ``CACHE_AWARE``; ``prefixroute serve``, its default fast data plane), prefixroute
  ``PREFIX_AWARE`` on the aiohttp data plane (``--data-plane aiohttp``, the reference
  implementation: what the fast one saves), prefixroute ``CACHE_AWARE`` with ``--workers
  2`` (when ``prefixroute serve`` has that option; else listed as skipped),
  prefixroute ``CACHE_AWARE`` in **precise mode** (``prefixroute CACHE_AWARE precise``,
  measured only when ``--routers`` names it: when it is, the backend's ports publish the KV events of a stand-in engine
  with a warm, full prefix cache, ``bench/kv_stand_in.py``, one batch per port every 20
  ms, and the router subscribes to them with the bundled ``tiny`` tokenizer; the
  events' cost shows in every target's backend CPU), the **python
  relay floor** (``bench/relay_floor.py``: a bare round-robin relay on prefixroute's own
  stack, CPython + uvloop + httptools, with no routing, JSON or bookkeeping: about the
  least a router written this way adds), HAProxy with
  ``balance hash`` on the body's first 4096 bytes and ``hash-balance-factor 150``, the
  SGLang router (``sglang-router``, ``cache_aware``) and vLLM's router (``vllm-router``,
  ``cache_aware``), each with its defaults otherwise;
* the load comes from ``wrk`` (a separate process; Debian package, installed with
  ``apt-get`` when missing): a closed loop of N connections (``-c N``, ``-t min(2, N)``),
  each POSTing ``application/json`` chat bodies that cycle over 16 distinct bodies (16
  system prompts, different from their first byte, so prefix routing spreads them) of
  the cell's size, read from files this program writes, through a Lua script.

Cells: concurrency 1, 8, 64, 256 x body 1 KB, 32 KB, 256 KB x non-streaming and
streaming (``"stream": true``: the backend answers 8 SSE events and ``data: [DONE]``,
each its own HTTP chunk). For each cell and each of ``--rounds`` rounds, direct is
measured first, then every router in turn (``--duration`` seconds each, after a
``--warmup`` run), so slow drifts of a shared machine hit every target alike; the
routers' order turns by one place each round. At concurrency 1 (``--paired-direct-up-to``)
direct is measured again right before every router, and each router's added latency is
taken against the direct run right before it: that difference is about a tenth of a
millisecond there, less than this machine's speed drifts over a round. Reported
per (cell, target), as the median over rounds:

* p50 / p99 latency (wrk ``--latency``: request sent to whole response received);
* **added latency**: router p50 (p99) minus direct p50 (p99) of the same round (at
  concurrency 1, of the direct run right before the router's; direct's own row there is
  the median of all its runs), ms; at
  concurrency 64 and 256 the loop is saturated and this is mostly queueing (Little's
  law: connections / requests per second);
* requests/s (at 64 and 256 connections: the saturation throughput, on this machine,
  where the load generator and the backend share the CPUs with the router);
* router CPU per request: utime + stime of the router's process tree (from
  ``/proc/PID/stat``, children included) after minus before, / requests completed;
* peak RSS: ``VmHWM`` summed over the router's process tree, reset before each
  measurement (``/proc/PID/clear_refs``), so it is the peak of that measurement;
* errors: non-2xx responses and socket errors (connect, read, write, timeout) from wrk.

Tables add two ratios per cell: a router's added p50 latency over HAProxy's and its
requests/s over sglang-router's, of the medians, then in brackets the lowest and highest
of the same ratio round by round (each round against the reference's figure of that
round: a verdict that holds in the medians but not in every round shows). Requests a
router sends the backend on its own (not health checks: e.g. tokenization calls) are
counted by the backend and printed per router; the backend answers them 404.

A separate phase, **streams**, opens ``--streams`` (2,000) streaming requests through
one prefixroute router (``CACHE_AWARE``) in front of a slow backend (20 events
``--streams-delay-ms`` 1,000 ms apart, so a stream lasts about 19 s and all are open
at once) from an aiohttp client in this process, and reports errors, how many ended
with ``data: [DONE]`` after all 20 events, the peak number of streams open at once
(client side and backend side) and the router's peak RSS. The client lets at most
100 requests wait for their response headers at a time: a burst of 2,000 connects
overflows the router's listen backlog and Linux retries the dropped SYNs only 1, 3,
7... s later. RLIMIT_NOFILE is raised to its hard limit first; every child process
inherits it.

Peers are installed into their own virtual environment (``--peers-venv``), HAProxy
and wrk with ``apt-get``; a peer that cannot be installed or started is listed as
skipped with the reason. Every process is started through ``bench/peers.py``'s
``ProcessTracker`` and stopped on exit, error or Ctrl-C.

Usage::

    python bench/overhead.py --quick                   # about 4 minutes on 2 cores
    python bench/overhead.py --json overhead.json      # the full grid (about 90 minutes)

``--json PATH`` writes SPEC §7's object (one run per cell and target; TTFT and cache-hit
fields are null, wrk times whole responses and the backend has no cache) plus every
single measurement, the settings, the command line, the peers' versions, the skipped
routers and why, and the streams phase.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parent))

from backend_launch import FastBackend, _settled_stats, start_fast_backend  # noqa: E402  (bench/ is a folder of scripts)
from fast_backend import raise_nofile_limit  # noqa: E402
from overhead_report import (machine_facts, render_cell_table, render_streams_table, write_json,  # noqa: E402
                             write_plots)
from overhead_results import (DIRECT, LATENCY_REFERENCE, THROUGHPUT_REFERENCE, Measurement,  # noqa: E402
                              aggregate)
from overhead_settings import (FULL, QUICK, Cell, OverheadSettings, _size_name, make_bodies,  # noqa: E402
                               parse_size, write_bodies)
from overhead_streams import StreamsResult, run_streams_phase  # noqa: E402
from peer_install import DEFAULT_PEERS_VENV, PeerStatus, ensure_haproxy, ensure_python_peers  # noqa: E402
from peer_process import PeerError, ProcessTracker, free_port, run_main  # noqa: E402
from peers import (  # noqa: E402
    HAProxySpec,
    PrefixrouteSpec,
    RouterSpec,
    RunningRouter,
    SGLangRouterSpec,
    VLLMRouterSpec,
    prefixroute_fleet_config,
)
from proc_stats import reset_peak_rss, tree_cpu_seconds, tree_peak_rss_bytes  # noqa: E402
from wrk_load import WRK_SCRIPT, ensure_wrk, run_wrk  # noqa: E402

BENCH_DIR = Path(__file__).resolve().parent
#: The reference row of what a bare Python relay costs (bench/relay_floor.py).
RELAY_FLOOR_LABEL = "python relay floor"
#: prefixroute CACHE_AWARE in precise mode, on the fast backend's stand-in KV events.
PRECISE_LABEL = "prefixroute CACHE_AWARE precise"


# -- routers ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MultiWorkerPrefixrouteSpec(PrefixrouteSpec):
    """``prefixroute serve --workers N`` on a fixed free port, admin API off; ready when
    ``GET /health`` answers 200 on several fresh connections in a row."""

    workers: int = 2

    def start(self, tracker, backends, executable="", all_backends=(), ready_timeout_s=60.0):
        import yaml

        cfg = tracker.path("prefixroute-workers", ".yaml")
        cfg.write_text(yaml.safe_dump(prefixroute_fleet_config(backends, self.routing), sort_keys=False))
        port = free_port()
        argv = [self.python, "-m", "prefixroute", "serve", "--config", str(cfg), "--host", "127.0.0.1",
                "--port", str(port), "--admin-port", "0", "--workers", str(self.workers), *self.extra_args]
        proc = tracker.start(f"prefixroute-{self.strategy}-workers", argv, env=dict(os.environ, PYTHONUNBUFFERED="1"))
        url = f"http://127.0.0.1:{port}"

        def healthy() -> bool:
            for _ in range(2 * self.workers + 2):
                with urllib.request.urlopen(url + "/health", timeout=2) as r:
                    if r.status != 200:
                        return False
            return True

        proc.wait_ready(healthy, ready_timeout_s, "answering GET /health")
        return RunningRouter(self, proc, url, backends)


RELAY_FLOOR = BENCH_DIR / "relay_floor.py"
_RELAY_READY = re.compile(r"relay-floor listening on (http://\S+)")


@dataclass(frozen=True)
class RelayFloorSpec(RouterSpec):
    """``bench/relay_floor.py``: a bare Python relay on prefixroute's own stack (CPython,
    uvloop, httptools) that routes round robin and does little else, so that its added
    latency is about the least a router written this way adds (nothing to install)."""

    python: str = sys.executable

    @property
    def peer(self) -> str:
        return ""

    def start(self, tracker, backends, executable="", all_backends=(), ready_timeout_s=60.0):
        argv = [self.python, str(RELAY_FLOOR), "--port", "0", *[a for b in backends for a in ("--backend", b)]]
        proc = tracker.start("relay-floor", argv, env=dict(os.environ, PYTHONUNBUFFERED="1"))
        urls: list[str] = []

        def ready() -> bool:
            urls[:] = _RELAY_READY.findall(proc.tail(5))
            return bool(urls)

        proc.wait_ready(ready, ready_timeout_s, "listening")
        return RunningRouter(self, proc, urls[0], backends)


def precise_extra_missing(python: str = sys.executable) -> str:
    """"" when ``python`` has the ``precise`` extra (pyzmq, msgpack, tokenizers, jinja2),
    else why the precise row is skipped."""
    code = "import zmq, msgpack, tokenizers, jinja2"
    try:
        proc = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"checking the precise extra failed: {exc}"
    if proc.returncode:
        return "the precise extra is not installed (pip install -e '.[precise]'): " + proc.stderr.strip()[-200:]
    return ""


def prefixroute_workers_option(python: str = sys.executable) -> str:
    """"" when ``prefixroute serve`` has ``--workers``, else why the multi-worker row is skipped."""
    try:
        proc = subprocess.run([python, "-m", "prefixroute", "serve", "--help"], capture_output=True, text=True,
                              timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"`prefixroute serve --help` failed: {exc}"
    if re.search(r"(^|\s)--workers\b", proc.stdout):
        return ""
    return "`prefixroute serve --help` lists no --workers option (multi-worker mode is not in this checkout)"


def router_specs(s: OverheadSettings) -> list[RouterSpec]:
    """Every router under test, in table order."""
    threshold = s.concurrency_threshold
    cache_aware = {"RoutingStrategy": "CACHE_AWARE", "CacheAwareRoutingConfig": {"ConcurrencyThreshold": threshold}}
    return [
        PrefixrouteSpec("prefixroute RANDOM", "prefixroute", "RANDOM", routing={"RoutingStrategy": "RANDOM"}),
        PrefixrouteSpec("prefixroute LEAST_OUTSTANDING", "prefixroute", "LEAST_OUTSTANDING_REQUESTS",
                        routing={"RoutingStrategy": "LEAST_OUTSTANDING_REQUESTS"}),
        PrefixrouteSpec("prefixroute PREFIX_AWARE", "prefixroute", "PREFIX_AWARE",
                        routing={"RoutingStrategy": "PREFIX_AWARE", "PrefixAwareRoutingConfig": {
                            "PrefixLength": s.prefix_length, "ConcurrencyThreshold": threshold}}),
        PrefixrouteSpec("prefixroute CACHE_AWARE", "prefixroute", "CACHE_AWARE", routing=cache_aware),
        PrefixrouteSpec(PRECISE_LABEL, "prefixroute", "CACHE_AWARE", routing=cache_aware,
                        kv_events={"Tokenizer": "tiny"}),
        PrefixrouteSpec("prefixroute PREFIX_AWARE --data-plane aiohttp", "prefixroute", "PREFIX_AWARE",
                        routing={"RoutingStrategy": "PREFIX_AWARE", "PrefixAwareRoutingConfig": {
                            "PrefixLength": s.prefix_length, "ConcurrencyThreshold": threshold}},
                        extra_args=("--data-plane", "aiohttp")),
        MultiWorkerPrefixrouteSpec(f"prefixroute CACHE_AWARE --workers {s.workers}", "prefixroute", "CACHE_AWARE",
                                   routing=cache_aware, workers=s.workers),
        RelayFloorSpec(RELAY_FLOOR_LABEL, "python-relay-floor", "round robin, no routing"),
        HAProxySpec(LATENCY_REFERENCE, "haproxy", f"hash body[:{s.prefix_length}] balance-factor {s.balance_factor}",
                    hash_bytes=s.prefix_length, balance_factor=s.balance_factor),
        SGLangRouterSpec(THROUGHPUT_REFERENCE, "sglang-router", "cache_aware"),
        VLLMRouterSpec("vllm-router cache_aware", "vllm-router", "cache_aware"),
    ]


def slug(label: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", label.lower()).strip("-")


# -- one measurement ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Target:
    """Where the load goes.

    Attributes:
        label: table name (``direct`` for the backend itself).
        router: SPEC §7 ``router`` (``none`` for direct).
        strategy: SPEC §7 ``strategy``.
        url: base URL (``http://127.0.0.1:PORT``).
        pid: the router's process (its tree is measured), None for direct.
        workers: router worker processes (1 unless multi-worker).
        kv_admin_url: a precise router's admin API (its ``GET /admin/kv-events`` is read
            around each measurement), else ``None``.
    """

    label: str
    router: str
    strategy: str
    url: str
    pid: int | None
    workers: int = 1
    kv_admin_url: str | None = None


def run_order(targets: Sequence[Target], round_index: int, paired: bool) -> list[tuple[Target, str | None]]:
    """The measurements of one round of one cell, in order: ``(target, paired_with)``.

    ``targets[0]`` is direct. The routers come in their list order turned by one place
    each round (round 2 starts with the second router...), so no router is always the
    one measured furthest from direct. With ``paired``, direct is measured right before
    every router (``paired_with`` is that router's label); without it, once, first.
    """
    direct, routers = targets[0], list(targets[1:])
    if routers:
        k = (round_index - 1) % len(routers)
        routers = routers[k:] + routers[:k]
    if not paired:
        return [(direct, None), *((t, None) for t in routers)]
    return [pair for t in routers for pair in ((direct, t.label), (t, None))] or [(direct, None)]


def measure(tracker: ProcessTracker, target: Target, cell: Cell, body_files: Sequence[Path], duration_s: int, *,
            backend: FastBackend, wrk: str, script: Path, round_index: int = 1) -> Measurement:
    """Drive ``target`` with wrk for ``duration_s`` seconds in ``cell`` and read the
    router's CPU time and peak RSS (its process tree) and the backend's counters
    around the run.

    Raises:
        PeerError: wrk failed.
    """
    before = backend.stats()
    kv_before = _kv_status(target.kv_admin_url) if target.kv_admin_url else None
    backend_cpu0 = tree_cpu_seconds(backend.pid)
    cpu0, reset = None, False
    if target.pid is not None:
        reset = reset_peak_rss(target.pid)
        cpu0 = tree_cpu_seconds(target.pid)
    result = run_wrk(tracker, target.url + "/v1/chat/completions", body_files, cell.concurrency, duration_s,
                     wrk=wrk, script=script, name=f"wrk-{slug(target.label)}")
    cpu = rss = None
    if target.pid is not None and cpu0 is not None:
        cpu = tree_cpu_seconds(target.pid) - cpu0
        rss = tree_peak_rss_bytes(target.pid)
    backend_cpu = tree_cpu_seconds(backend.pid) - backend_cpu0
    after = _settled_stats(backend)
    ports = [u.rsplit(":", 1)[1] for u in backend.urls]
    per_port = [after["by_port"].get(p, 0) - before["by_port"].get(p, 0) for p in ports]
    unknown = {k: v - before["unknown"].get(k, 0) for k, v in after["unknown"].items()
               if v - before["unknown"].get(k, 0) > 0}
    m = Measurement(target.label, round_index, cell, result, cpu, rss, reset, backend_cpu, per_port,
                    after["requests"] - before["requests"], unknown)
    if target.kv_admin_url:
        m.precise = precise_check(kv_before, _kv_status(target.kv_admin_url), result.requests)
    return m


def _kv_status(admin_url: str) -> dict[str, Any] | None:
    try:
        with urllib.request.urlopen(admin_url + "/admin/kv-events", timeout=10) as r:
            return json.loads(r.read())
    except (OSError, ValueError):
        return None


def precise_check(before: dict[str, Any] | None, after: dict[str, Any] | None, requests: int) -> dict[str, Any]:
    """What a precise router's ``GET /admin/kv-events`` says of one measurement: each
    instance's mode at its end (``modes``), and the share of its ``requests`` matched on
    the engines' events (``matched_share``: ``Tokenizer.ByteMatchedRequests`` counted
    during the run, over ``requests``; ``None`` when the status could not be read)."""
    if after is None:
        return {"modes": None, "matched_share": None}
    modes = [i.get("Mode") for i in after.get("Instances", [])]
    tok_after = (after.get("Tokenizer") or {}).get("ByteMatchedRequests")
    tok_before = ((before or {}).get("Tokenizer") or {}).get("ByteMatchedRequests")
    share = None
    if requests and isinstance(tok_after, int) and isinstance(tok_before, int):
        share = round((tok_after - tok_before) / requests, 3)
    return {"modes": modes, "matched_share": share}

# -- main ---------------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python bench/overhead.py", description=__doc__.split("\n\n")[0],
                                epilog="How each figure is measured: the docstring at the top of bench/overhead.py.")
    p.add_argument("--quick", action="store_true",
                   help=f"smoke run: {QUICK.duration_s} s per measurement, {QUICK.rounds} round, concurrency "
                        f"{','.join(map(str, QUICK.concurrency))}, {_size_name(QUICK.body_sizes[0])} bodies, "
                        "streaming and not (default: the full grid, concurrency 1,8,64,256 x bodies 1K,32K,256K "
                        f"x streaming and not, {FULL.rounds} rounds of {FULL.duration_s} s)")
    p.add_argument("--json", metavar="PATH",
                   help="write SPEC §7 JSON: one run per (cell, router), every single measurement, settings, the "
                        "command line, versions of prefixroute and the peers, skipped routers with reasons, the "
                        "streams phase")
    p.add_argument("--out-dir", default="prefixroute-bench-overhead",
                   help="plots go here (default: ./prefixroute-bench-overhead)")
    p.add_argument("--no-plots", action="store_true", help="do not write plots")
    p.add_argument("--routers", default="",
                   help="comma-separated router labels or their slugs (prefixroute-cache-aware, "
                        "sglang-router-cache-aware...) or product names (prefixroute, python-relay-floor, haproxy, "
                        "sglang-router, vllm-router) to measure; direct is always measured (default: all but "
                        "prefixroute-cache-aware-precise, precise mode on the backend's stand-in KV events, which "
                        "is measured only when named by its label or slug)")
    p.add_argument("--concurrency", default="",
                   help="comma-separated wrk connection counts, e.g. 1,64 (default: 1,8,64,256)")
    p.add_argument("--body-sizes", default="",
                   help="comma-separated request body sizes, K = 1024 bytes, e.g. 1K,32K,256K (default)")
    p.add_argument("--modes", default="",
                   help="comma-separated response modes: plain (JSON) and/or stream (SSE) (default: both)")
    p.add_argument("--duration", type=int, default=None,
                   help=f"whole seconds of load per measurement (default: {FULL.duration_s}, --quick "
                        f"{QUICK.duration_s})")
    p.add_argument("--rounds", type=int, default=None,
                   help=f"rounds over every (cell, router); medians are reported (default: {FULL.rounds}, "
                        f"--quick {QUICK.rounds})")
    p.add_argument("--warmup", type=int, default=None,
                   help=f"seconds of load per router before each cell (default: {FULL.warmup_s}, --quick "
                        f"{QUICK.warmup_s}); every router also gets one 2 s warm-up at start")
    p.add_argument("--paired-direct-up-to", type=int, default=None, metavar="N",
                   help="in cells of concurrency <= N, measure direct again right before every router and take "
                        "that router's added latency against it (default: "
                        f"{FULL.paired_direct_up_to}; 0: direct once per round, first)")
    p.add_argument("--streams", type=int, default=None,
                   help=f"concurrent streaming requests of the streams phase (default: {FULL.streams}); 0 skips it")
    p.add_argument("--streams-delay-ms", type=float, default=None,
                   help=f"milliseconds between two of the {FULL.streams_events} events of a stream in the streams "
                        f"phase (default: {FULL.streams_delay_ms:g}; shorter streams may end before the last ones "
                        "open)")
    p.add_argument("--backend-port", type=int, default=None,
                   help=f"first of the fast backend's {FULL.instances} consecutive ports (default: {FULL.backend_port}). "
                        "Fixed ports keep the instances' URLs, and so the rendezvous placement of the test bodies, "
                        "the same from run to run; 0 (or a port in use) takes free ports, and the placement then "
                        "changes between runs")
    p.add_argument("--peers-venv", type=Path, default=DEFAULT_PEERS_VENV,
                   help=f"virtual environment for sglang-router and vllm-router (default: {DEFAULT_PEERS_VENV})")
    p.add_argument("--no-install", action="store_true",
                   help="never install anything (peers, HAProxy, wrk); routers that are missing are skipped")
    return p.parse_args(argv)


def settings_from(args: argparse.Namespace) -> OverheadSettings:
    s = QUICK if args.quick else FULL
    upd: dict[str, Any] = {}
    try:
        if args.concurrency:
            upd["concurrency"] = tuple(int(x) for x in args.concurrency.split(",") if x.strip())
        if args.body_sizes:
            upd["body_sizes"] = tuple(parse_size(x) for x in args.body_sizes.split(",") if x.strip())
            for size in upd["body_sizes"]:
                make_bodies(size, True, 1)  # (a size too small for a chat request raises ValueError: said below)
    except ValueError as exc:
        raise SystemExit(f"error: {exc}") from None
    if args.modes:
        modes = [m.strip() for m in args.modes.split(",") if m.strip()]
        if not modes or set(modes) - {"plain", "stream"}:
            raise SystemExit("error: --modes takes plain and/or stream")
        upd["streaming"] = tuple(m == "stream" for m in dict.fromkeys(modes))
    for flag, name in (("duration", "duration_s"), ("rounds", "rounds"), ("warmup", "warmup_s"),
                       ("paired_direct_up_to", "paired_direct_up_to"),
                       ("streams", "streams"), ("streams_delay_ms", "streams_delay_ms"),
                       ("backend_port", "backend_port")):
        if getattr(args, flag) is not None:
            upd[name] = getattr(args, flag)
    s = replace(s, **upd)
    if (not s.concurrency or min(s.concurrency) < 1 or not s.body_sizes or s.duration_s < 1 or s.rounds < 1
            or s.warmup_s < 0 or s.streams < 0 or not s.streams_delay_ms >= 0 or s.paired_direct_up_to < 0):
        raise SystemExit("error: --concurrency, --body-sizes, --duration and --rounds must be positive; "
                         "--warmup, --paired-direct-up-to, --streams and --streams-delay-ms >= 0")
    if not 0 <= s.backend_port <= 65536 - s.instances:
        raise SystemExit(f"error: --backend-port must be 0 (free ports) or 1-{65536 - s.instances}, "
                         f"got {s.backend_port}")
    return s


def select_routers(specs: Sequence[RouterSpec], wanted: str) -> list[RouterSpec]:
    """The routers ``--routers`` names (labels, their slugs, or product names), in table
    order; without names, every router but the precise one (:data:`PRECISE_LABEL`: it
    makes the backend publish KV events for every target, so it is measured when named,
    by its label or slug only)."""
    if not wanted:
        return [r for r in specs if r.label != PRECISE_LABEL]
    keys = [w.strip() for w in wanted.split(",") if w.strip()]

    def names(r: RouterSpec) -> list[str]:
        if r.label == PRECISE_LABEL:
            return [slug(r.label), r.label]
        return [slug(r.label), r.label, r.router]

    unknown = [k for k in keys if not any(k in names(r) for r in specs)]
    if unknown:
        raise SystemExit(f"error: unknown routers {unknown}; known: {[slug(r.label) for r in specs]}")
    return [r for r in specs if any(k in names(r) for k in keys)]


def main(argv: Sequence[str] | None = None) -> int:
    from rich.console import Console
    from rich.markup import escape

    args = parse_args(argv)
    s = settings_from(args)
    specs = select_routers(router_specs(s), args.routers)
    console = Console() if Console().is_terminal else Console(width=200)
    command = "python bench/overhead.py " + " ".join(sys.argv[1:] if argv is None else argv)
    say = lambda m: console.print(f"[dim]{escape(m)}[/dim]")  # noqa: E731
    nofile = raise_nofile_limit()  # inherited by every child process started from here on

    statuses: dict[str, PeerStatus] = {"wrk": ensure_wrk(install=not args.no_install, log=say)}
    if not statuses["wrk"].available:
        console.print(f"[red]cannot measure without wrk:[/red] {escape(statuses['wrk'].detail)}")
        return 2
    wanted = {r.peer for r in specs if r.peer}
    if wanted & {"sglang-router", "vllm-router"}:
        statuses.update(ensure_python_peers(args.peers_venv, install=not args.no_install, log=say))
    if "haproxy" in wanted:
        statuses["haproxy"] = ensure_haproxy(install=not args.no_install, log=say)
    skipped: dict[str, str] = {}
    for r in list(specs):
        reason = ""
        st = statuses.get(r.peer)
        if r.peer and not (st and st.available):
            reason = st.detail if st else "not checked"
        elif isinstance(r, MultiWorkerPrefixrouteSpec):
            reason = prefixroute_workers_option()
        elif r.label == PRECISE_LABEL:
            reason = precise_extra_missing()
        if reason:
            skipped[r.label] = reason
            console.print(f"[yellow]SKIPPING {r.label}:[/yellow] {escape(reason)}")
            specs.remove(r)
    for st in statuses.values():
        if st.available:
            console.print(f"using {st.detail}")

    cells = [Cell(c, b, st) for st in s.streaming for b in s.body_sizes for c in s.concurrency]
    measurements: list[Measurement] = []
    streams: StreamsResult | None = None
    backend_urls: list[str] = []
    with ProcessTracker() as tracker:
        script = tracker.path("bodies", ".lua")
        script.write_text(WRK_SCRIPT)
        files: dict[tuple[int, bool], list[Path]] = {}
        for b in s.body_sizes:
            for st in s.streaming:
                files[(b, st)] = write_bodies(tracker.workdir / "bodies", make_bodies(b, st, s.distinct_bodies, s.seed),
                                              f"body-{b}-{'stream' if st else 'plain'}")
        precise = any(r.label == PRECISE_LABEL for r in specs)
        backend = start_fast_backend(tracker, s.instances, first_port=s.backend_port, stream_events=s.stream_events,
                                     kv_events=precise, log=console.print)
        backend_urls[:] = backend.urls
        if precise:
            console.print(f"the fast backend publishes KV events (bench/kv_stand_in.py) for {PRECISE_LABEL}; "
                          "every target's backend CPU includes them")
        targets = [Target(DIRECT, "none", "direct to the backend", backend.urls[0], None)]
        for spec in specs:
            if spec.label == PRECISE_LABEL and isinstance(spec, PrefixrouteSpec):
                spec = replace(spec, kv_events=backend.kv_events_section())
            try:
                st = statuses.get(spec.peer)
                rr = spec.start_retrying(tracker, backend.urls, st.executable if st else "")
            except PeerError as exc:
                skipped[spec.label] = f"did not start: {exc}"[:1000]
                console.print(f"[red]{spec.label} did not start:[/red] {escape(str(exc))}")
                continue
            targets.append(Target(spec.label, spec.router, spec.strategy, rr.url, rr.process.proc.pid,
                                  getattr(spec, "workers", 1),
                                  getattr(rr, "admin_url", None) if spec.label == PRECISE_LABEL else None))
        procs = {t.label: next((p for p in tracker.processes if p.proc.pid == t.pid), None) for t in targets}
        by_label = {t.label: t for t in targets}
        total = sum(s.rounds * len(run_order(targets, 1, c.concurrency <= s.paired_direct_up_to)) for c in cells)
        est = total * (s.duration_s + 0.5) + len(cells) * len(targets) * s.warmup_s + 2 * len(targets)
        pairs = (f", direct again before every router at concurrency <= {s.paired_direct_up_to}"
                 if any(c.concurrency <= s.paired_direct_up_to for c in cells) and len(targets) > 1 else "")
        console.print(f"[bold]overhead[/bold]: {len(targets)} targets x {len(cells)} cells x {s.rounds} rounds{pairs}: "
                      f"{total} measurements of {s.duration_s} s (about {est / 60:.0f} min), then "
                      + (f"{s.streams:,} concurrent streams" if s.streams else "no streams phase")
                      + f"; RLIMIT_NOFILE {nofile}; scratch {tracker.workdir}")
        facts = machine_facts()
        console.print(f"machine: {facts['cpus']} CPUs, {escape(facts['platform'])}, cpuidle "
                      f"{facts['cpuidle_driver'] or 'unknown'}/{facts['cpuidle_governor'] or 'unknown'}"
                      + ("" if facts["guest_halt_poll_ns"] is None else
                         f", guest_halt_poll_ns {facts['guest_halt_poll_ns']:,}"))

        def alive(t: Target) -> bool:
            p = procs.get(t.label)
            if t.pid is None or p is None or p.alive():
                return True
            if t.label not in skipped:
                skipped[t.label] = f"exited during the run (code {p.proc.returncode}); output:\n{p.tail()}"[:1000]
                console.print(f"[red]{t.label} exited during the run:[/red] {escape(p.tail())}")
            return False

        warm = files[(min(s.body_sizes), False)] if False in s.streaming else files[(min(s.body_sizes), True)]
        for t in targets:
            try:
                run_wrk(tracker, t.url + "/v1/chat/completions", warm, min(64, max(s.concurrency)), 2,
                        wrk=statuses["wrk"].executable, script=script, name="wrk-warmup")
            except PeerError as exc:
                console.print(f"[red]warm-up of {t.label} failed:[/red] {escape(str(exc))}")
        _settled_stats(backend)  # what the last router still had in flight is not the next one's
        n = 0
        t_start = time.monotonic()
        for cell in cells:
            body_files = files[(cell.body_bytes, cell.stream)]
            if s.warmup_s:
                for t in targets:
                    if alive(t):
                        try:
                            run_wrk(tracker, t.url + "/v1/chat/completions", body_files, cell.concurrency,
                                    s.warmup_s, wrk=statuses["wrk"].executable, script=script, name="wrk-warmup")
                        except PeerError as exc:
                            console.print(f"[red]warm-up of {t.label} failed:[/red] {escape(str(exc))}")
                _settled_stats(backend)
            paired = cell.concurrency <= s.paired_direct_up_to
            for rnd in range(1, s.rounds + 1):  # 1-based, in the JSON as in the progress lines
                for t, pair in run_order(targets, rnd, paired):
                    n += 1
                    if not alive(t) or (pair is not None and not alive(by_label[pair])):
                        continue  # (a router gone: no direct run paired with it either)
                    try:
                        m = measure(tracker, t, cell, body_files, s.duration_s, backend=backend,
                                    wrk=statuses["wrk"].executable, script=script, round_index=rnd)
                    except (PeerError, OSError, ValueError) as exc:
                        console.print(f"[red][{n}/{total}] {cell.name} {t.label}: {escape(str(exc))}[/red]")
                        continue
                    m.paired_with = pair
                    measurements.append(m)
                    w = m.wrk
                    cpu = m.router_cpu_us_per_request
                    console.print(
                        f"[{n}/{total}] {cell.name:<28} round {rnd}  "
                        f"{t.label if pair is None else 'direct, paired':<36} p50 {w.p50_ms:7.2f} ms  "
                        f"p99 {w.p99_ms:7.2f} ms  {w.rps:8,.0f} req/s  "
                        + (f"CPU {cpu:6,.0f} us/req  " if cpu is not None else "")
                        + f"{w.error_count} err" + (f"  [dim]backend saw {m.backend_unknown}[/dim]"
                                                   if m.backend_unknown else "")
                        + (f"  matched on events {m.precise['matched_share']:.0%}"
                           if m.precise and m.precise["matched_share"] is not None else ""))
                    if m.precise is not None and (m.precise["matched_share"] is None or m.precise["matched_share"] < 0.9
                                                  or any(x != "precise" for x in m.precise["modes"] or [None])):
                        console.print(f"[yellow]warning: {t.label} was not in precise mode throughout: "
                                      f"{escape(str(m.precise))}[/yellow]")
        console.print(f"measurements: {time.monotonic() - t_start:.0f} s")
        for t in targets:
            if t.pid is not None:
                tracker.stop([p for p in tracker.processes if p.proc.pid == t.pid])
        tracker.stop([backend.process])

        if s.streams:
            spec = next(r for r in router_specs(s) if r.label == "prefixroute CACHE_AWARE")
            console.print(f"[bold]streams[/bold]: {s.streams:,} concurrent streams through {spec.label}")
            try:
                streams = run_streams_phase(tracker, s, spec, log=say)
            except PeerError as exc:
                console.print(f"[red]streams phase failed to start:[/red] {escape(str(exc))}")
                skipped["streams phase"] = str(exc)[:1000]

    results = aggregate(measurements, targets)
    for cell in cells:
        rs = [r for r in results if r.cell == cell]
        if rs:
            console.print(render_cell_table(cell, rs, s))
    paired_note = (f" (at concurrency <= {s.paired_direct_up_to}: the direct run right before the router's; "
                   "direct's row is the median of all its runs)" if s.paired_direct_up_to and
                   any(c.concurrency <= s.paired_direct_up_to for c in cells) else "")
    console.print(f"added = router minus direct in the same round{paired_note} (ms); x HAProxy = added p50 / "
                  "HAProxy's added p50; x sglang = req/s / sglang-router's req/s (both of the medians); in brackets, the lowest "
                  "and highest of the same ratio round by round (a round in which HAProxy added nothing gives "
                  "none); CPU and peak RSS: the router's process tree")
    unknown: dict[str, dict[str, int]] = {}
    for m in measurements:
        for k, v in m.backend_unknown.items():
            unknown.setdefault(m.target, {}).setdefault(k, 0)
            unknown[m.target][k] += v
    for label, counts in unknown.items():
        reqs = sum(m.wrk.requests for m in measurements if m.target == label)
        console.print(f"note: {label} also sent the backend " + ", ".join(
            f"{k} x{v:,} ({v / max(1, reqs):.1f} per request, 404 here)" for k, v in counts.items()))
    if streams is not None:
        console.print(render_streams_table(streams))
        if streams.peak_open < streams.streams:
            console.print(f"[yellow]only {streams.peak_open:,} of {streams.streams:,} streams were open at "
                          "once[/yellow]")
    if skipped:
        console.print("[yellow]skipped:[/yellow]")
        for k, v in skipped.items():
            console.print(f"  {escape(k)}: {escape(v)}")
    if not args.no_plots and results:
        paths = write_plots(Path(args.out_dir), results, streams)
        console.print("plots: " + ", ".join(str(p) for p in paths))
    if args.json:
        write_json(Path(args.json), results, measurements, streams, s, command, skipped, statuses, backend_urls)
        console.print(f"results: {args.json}")
    ok = bool(measurements) and all(m.wrk.error_count == 0 and m.wrk.requests > 0 for m in measurements)
    if s.streams:
        ok = ok and streams is not None and streams.completed == streams.streams
    return 0 if ok else 1


if __name__ == "__main__":
    run_main(main)
