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
import asyncio
import dataclasses
import functools
import itertools
import math
import os
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import aiohttp
import orjson

sys.path.insert(0, str(Path(__file__).resolve().parent))

from peers import (  # noqa: E402  (bench/ is a folder of scripts, not a package)
    DEFAULT_PEERS_VENV,
    HAProxySpec,
    PeerError,
    PeerStatus,
    PrefixrouteSpec,
    ProcessTracker,
    run_main,
    RouterSpec,
    RunningRouter,
    SGLangRouterSpec,
    VLLMRouterSpec,
    ensure_haproxy,
    ensure_python_peers,
)
from prefixroute.demo.loadgen import RequestResult  # noqa: E402
from prefixroute.demo.report import RunSummary, scrape_counters, summarize  # noqa: E402
from prefixroute.workloads.catalog import BENCH_WORKLOADS, BenchWorkload, MembershipPlan  # noqa: E402

#: The strategy every verdict is about.
SUBJECT = "CACHE_AWARE"
HIT = "vllm:prefix_cache_hits_total"
QUERIES = "vllm:prefix_cache_queries_total"

# -- settings ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class BenchSettings:
    """Fleet, routing and run-length settings shared by every run.

    Attributes:
        instances: emulated engines routed to from the start.
        time_scale: real seconds per model second of the engines (0.5 = twice as fast).
        kv_capacity_tokens: KV-cache capacity of each instance, tokens.
        duration_s: real seconds during which users start requests, per run.
        users_scale: multiplies each workload's number of closed-loop users.
        prefix_length: PREFIX_AWARE PrefixLength (characters) and HAProxy's hashed bytes.
        concurrency_threshold: PREFIX_AWARE ConcurrencyThreshold (SageMaker's only load
            control for it: about twice the mean in flight per instance).
        cache_aware_threshold: CACHE_AWARE ConcurrencyThreshold: a guard against
            overloading one engine (these engines admit 256 sequences), its cost model
            spreading load below it. 64: at 32 the near-saturation workload (85 % of
            the fleet's capacity, 20-40 requests in flight per instance) crossed the
            guard on every burst, and each crossing sends a request away from its
            document (a 5,500-token miss that adds to the backlog); no other workload
            reaches 32 (simulated: identical decisions at 32 and 64 on the other nine).
        balance_factor: HAProxy ``hash-balance-factor`` (percent of the average load).
        replicas: router replica counts to run.
        multi_replica_workloads: workloads that run with more than 1 replica (None: all).
        baselines_replicas: replica counts at which prefixroute's RANDOM and
            LEAST_OUTSTANDING_REQUESTS baselines run (the comparisons are with the peers).
        repeat: runs of each (workload, router, replicas); tables show the median run
            by P90 TTFT, and the JSON every run (for the run-to-run noise).
        seed: workload and router seed.
        precise: ``off``, ``on`` or ``both``: prefixroute CACHE_AWARE in precise mode
            (``prefixroute CACHE_AWARE precise``: on the engines' KV events) instead of,
            or beside, its learned view. With ``on`` or ``both`` every engine of every
            run tokenizes with the bundled tiny tokenizer (an image part as 576 tokens of
            stand-in text) and publishes its KV events, so every router meets the same
            engines; their per-token costs and sizes are scaled so that a request costs
            what it does on the default engine (:func:`engine_args`).
        tiers: ``none``, ``cpu``, ``shared`` or ``cpu+shared``: KV tiers in every engine
            (a CPU tier of 4x its KV capacity, a shared tier of 4x the fleet's);
            prefixroute CACHE_AWARE is told of them (``KvTiers``).
        tier_aware: with tiers, ``on``, ``off`` or ``both``: CACHE_AWARE runs told of
            the tiers, not told (``tier-unaware`` in its label), or both.
    """

    instances: int = 4
    time_scale: float = 0.5
    kv_capacity_tokens: int = 100_000
    duration_s: float = 20.0
    users_scale: float = 1.0
    prefix_length: int = 4096
    concurrency_threshold: int = 8
    cache_aware_threshold: int = 64
    balance_factor: int = 150
    replicas: tuple[int, ...] = (1, 4, 8)
    multi_replica_workloads: tuple[str, ...] | None = None
    baselines_replicas: tuple[int, ...] = (1,)
    repeat: int = 1
    seed: int = 0
    precise: str = "off"
    tiers: str = "none"
    tier_aware: str = "on"

    @property
    def fleet_mode(self) -> str:
        """What the tables say of the fleet: tokenizer, KV events and tiers."""
        parts = []
        if self.precise != "off":
            parts.append("engines tokenize with the tiny tokenizer and publish KV events (their per-token "
                         "costs and sizes scaled so a request costs what it does on the default engine)")
        parts.append(f"KV tiers: {self.tiers}")
        return "; ".join(parts)


FULL = BenchSettings()
#: ``--quick``: the same fleet, traffic and routers, 3 s runs, and 4 and 8 replicas on one
#: workload only (about 12 minutes on 2 cores). For smoke tests, not for conclusions: in
#: 3 s the cold start (every document's first request misses) weighs much more.
QUICK = BenchSettings(duration_s=3.0, multi_replica_workloads=("shared-prefix",))


# -- workloads --------------------------------------------------------------------------------


#: The benchmark's workloads (:mod:`prefixroute.workloads.catalog`).
WORKLOADS: tuple[BenchWorkload, ...] = BENCH_WORKLOADS
WorkloadSpec = BenchWorkload
MembershipChange = MembershipPlan


# -- routers ----------------------------------------------------------------------------------


def router_specs(s: BenchSettings) -> list[RouterSpec]:
    """Every router under test, in table order (prefixroute baselines, the subject, peers)."""
    threshold = s.concurrency_threshold
    # Engine load scraped often enough to matter at the engines' time scale (the default
    # 10 s would be 40 model seconds stale at time scale 0.25).
    extra = ("--metrics-scrape-interval", "0.5", "--seed", str(s.seed))
    return [
        PrefixrouteSpec("prefixroute RANDOM", "prefixroute", "RANDOM",
                        routing={"RoutingStrategy": "RANDOM"}, extra_args=extra),
        PrefixrouteSpec("prefixroute LEAST_OUTSTANDING", "prefixroute", "LEAST_OUTSTANDING_REQUESTS",
                        routing={"RoutingStrategy": "LEAST_OUTSTANDING_REQUESTS"}, extra_args=extra),
        PrefixrouteSpec("prefixroute PREFIX_AWARE", "prefixroute", "PREFIX_AWARE",
                        routing={"RoutingStrategy": "PREFIX_AWARE", "PrefixAwareRoutingConfig": {
                            "PrefixLength": s.prefix_length, "ConcurrencyThreshold": threshold}},
                        extra_args=extra),
        *cache_aware_specs(s, extra),
        PrefixrouteSpec("llm-d scorers (re-implementation)", "prefixroute", "LLMD_REFERENCE",
                        routing={"RoutingStrategy": "LLMD_REFERENCE"}, extra_args=extra),
        SGLangRouterSpec("sglang-router cache_aware", "sglang-router", "cache_aware"),
        VLLMRouterSpec("vllm-router cache_aware", "vllm-router", "cache_aware"),
        VLLMRouterSpec("vllm-router consistent_hash", "vllm-router", "consistent_hash"),
        HAProxySpec("haproxy hash-balance-factor", "haproxy", f"hash body[:{s.prefix_length}] "
                    f"balance-factor {s.balance_factor}", hash_bytes=s.prefix_length,
                    balance_factor=s.balance_factor),
    ]


#: precise mode's KvEvents section: endpoints from each engine's GET /info, its tokenizer.
PRECISE_KV_EVENTS = {"Discovery": {"FromInfo": True}, "Tokenizer": "tiny"}
#: Tokens of an image part for the tiny tokenizer's engines (``--tokenizer-media-tokens``).
PRECISE_MEDIA_TOKENS = 576


def cache_aware_specs(s: BenchSettings, extra: tuple[str, ...]) -> list[PrefixrouteSpec]:
    """prefixroute CACHE_AWARE once per mode the settings ask for: learned view and/or
    precise (``s.precise``), told of the engines' tiers or not (``s.tier_aware``)."""
    from prefixroute.core.tiers import TierSpec

    tiers = TierSpec.parse(s.tiers)
    precise_modes = {"off": (False,), "on": (True,), "both": (False, True)}[s.precise]
    aware_modes = {"on": (True,), "off": (False,), "both": (True, False)}[s.tier_aware] if tiers else (False,)
    out = []
    for aware in aware_modes:
        ca: dict[str, Any] = {"ConcurrencyThreshold": s.cache_aware_threshold,
                              "InstanceCacheTokens": s.kv_capacity_tokens}
        kv_tiers = tiers.kv_tiers(s.kv_capacity_tokens) if aware else None
        if kv_tiers is not None:
            ca["KvTiers"] = kv_tiers.to_api()
        for precise in precise_modes:
            label = "prefixroute CACHE_AWARE" + (" precise" if precise else "") + \
                ("" if aware or not tiers else " tier-unaware")
            out.append(PrefixrouteSpec(label, "prefixroute", SUBJECT,
                                       routing={"RoutingStrategy": SUBJECT, "CacheAwareRoutingConfig": ca},
                                       extra_args=extra, kv_events=PRECISE_KV_EVENTS if precise else None))
    return out


def with_access_log(spec: RouterSpec, directory: Path | None, workload: str, replicas: int, repeat: int) -> RouterSpec:
    """``spec`` with ``prefixroute serve --access-log`` writing to
    ``DIRECTORY/WORKLOAD-SLUG-xREPLICAS-REPEAT.jsonl`` (every replica of the run appends to
    that file: one JSON line per request, with its decision, instance, TTFT and body
    size, never its text), when ``directory`` is given and ``spec`` is prefixroute's;
    ``spec`` itself otherwise (the peers have no such log)."""
    if directory is None or not isinstance(spec, PrefixrouteSpec):
        return spec
    path = directory / f"{workload}-{_slug(spec.label)}-x{replicas}-{repeat}.jsonl"
    return dataclasses.replace(spec, extra_args=(*spec.extra_args, "--access-log", str(path)))


def engine_args(s: BenchSettings, shared_tier: Path | None, token_ratio: float = 1.0) -> list[str]:
    """The ``prefixroute emulate`` flags every engine of a run gets: its KV capacity, and
    for precise mode the tiny tokenizer and KV events (on free ports); the tiers.

    ``token_ratio`` (:func:`tiny_token_ratio`; about 0.55 in precise runs, 3 on the images
    workload, whose stand-in image text the tiny tokenizer cuts finer) is the workload's
    tiny tokens per default engine token. Every per-token size and cost of the engine is scaled
    by it (KV capacity, tiers and the step's token budget times it; prefill and tier loads
    per token divided by it), so that a tiny token stands for ``1 / token_ratio`` of the
    model's tokens: a request costs the engine the same modelled time and cache space as
    on a default engine, the fleet's capacity in requests per second is the same, and
    precise runs offer the same load as the peers' table (decode, per sequence, is not
    scaled).
    """
    from prefixroute.core.tiers import TierSpec
    from prefixroute.engine.model import EngineConfig

    r = token_ratio
    if not 0 < r < math.inf:
        raise ValueError(f"token_ratio must be a positive number, got {r!r}")
    out = ["--kv-capacity-tokens", str(round(s.kv_capacity_tokens * r))]
    if s.precise != "off":
        out += ["--tokenizer", "tiny", "--tokenizer-media-tokens", str(PRECISE_MEDIA_TOKENS), "--kv-events-config",
                '{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://127.0.0.1:*", '
                '"replay_endpoint": "tcp://127.0.0.1:*"}']
    if r != 1.0:
        d = EngineConfig()
        out += ["--prefill-s-per-token", repr(d.prefill_s_per_token / r),
                "--max-num-batched-tokens", str(max(d.max_num_seqs, round(d.max_num_batched_tokens * r))),
                "--cpu-load-s-per-token", repr(d.cpu_load_s_per_token / r),
                "--shared-load-s-per-token", repr(d.shared_load_s_per_token / r)]
    tiers = TierSpec.parse(s.tiers)
    if tiers.cpu:
        out += ["--cpu-tier-tokens", str(round(tiers.cpu_tokens(s.kv_capacity_tokens) * r))]
    if tiers.shared and shared_tier is not None:
        out += ["--shared-tier", str(shared_tier),
                "--shared-tier-tokens", str(round(tiers.shared_tokens(s.kv_capacity_tokens, s.instances) * r))]
    return out


def _slug(label: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", label.lower()).strip("-")


# -- one run ----------------------------------------------------------------------------------


@dataclass
class RunResult:
    """One (workload, router, replicas) run: the SPEC §7 summary plus what the tables need."""

    workload: str
    label: str
    summary: RunSummary
    results: list[RequestResult] = field(default_factory=list, repr=False)
    events: list[dict[str, Any]] = field(default_factory=list)
    instances: list[str] = field(default_factory=list)
    repeat: int = 0
    repeats: int = 1
    #: CPU seconds the router processes (every replica, their threads and children) and
    #: the engines used while the traffic ran: on a machine where both share the cores,
    #: a router's CPU is taken from the engines' and shows in TTFT.
    router_cpu_s: float = float("nan")
    engine_cpu_s: float = float("nan")
    #: the prefixroute commit that ran it (:func:`source_commit`), so that a file
    #: resumed across commits says which runs came from which
    commit: str = ""

    @property
    def busiest_share(self) -> float:
        return max(self.summary.instance_share, default=0.0)

    def to_json(self) -> dict[str, Any]:
        """SPEC §7 run fields plus ``workload``, ``label``, ``busiest_share``,
        ``instances``, ``membership_events``, ``repeat(s)``, CPU seconds and ``commit``."""
        d = asdict(self.summary)
        d.update(workload=self.workload, label=self.label, busiest_share=self.busiest_share,
                 instances=self.instances, membership_events=self.events, repeat=self.repeat,
                 repeats=self.repeats, router_cpu_s=self.router_cpu_s, engine_cpu_s=self.engine_cpu_s,
                 commit=self.commit)
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "RunResult":
        """A run as :meth:`to_json` wrote it (its per-request results are not kept)."""
        import dataclasses

        names = {f.name for f in dataclasses.fields(RunSummary)}
        summary = RunSummary(**{k: v for k, v in d.items() if k in names})
        return cls(d["workload"], d["label"], summary, events=list(d.get("membership_events", [])),
                   instances=list(d.get("instances", [])), repeat=int(d.get("repeat", 0)),
                   repeats=int(d.get("repeats", 1)), router_cpu_s=_num(d.get("router_cpu_s")),
                   engine_cpu_s=_num(d.get("engine_cpu_s")), commit=str(d.get("commit", "")))


def _num(v: Any) -> float:
    return float(v) if isinstance(v, (int, float)) else float("nan")


@functools.cache
def source_commit() -> str:
    """The short commit of the checkout this benchmark runs from, with ``+dirty`` when
    tracked files differ from it; ``unknown`` outside a git checkout."""
    root = Path(__file__).resolve().parent.parent
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "--short=7", "HEAD"], capture_output=True,
                              text=True, timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return head + ("+dirty" if dirty else "") if head else "unknown"


_CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def tree_cpu_s(pids: Sequence[int]) -> float:
    """CPU seconds (user + system) used so far by the processes ``pids`` and every
    descendant still running (Linux ``/proc``; ``nan`` elsewhere)."""
    proc = Path("/proc")
    if not proc.is_dir():
        return float("nan")
    children: dict[int, list[int]] = {}
    ticks: dict[int, int] = {}
    for d in proc.iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) ": state, ppid, ...
        pid = int(d.name)
        children.setdefault(int(fields[1]), []).append(pid)
        ticks[pid] = int(fields[11]) + int(fields[12])  # utime, stime
    total, todo, seen = 0, list(pids), set()
    while todo:
        pid = todo.pop()
        if pid in seen:
            continue
        seen.add(pid)
        total += ticks.get(pid, 0)
        todo += children.get(pid, [])
    return total / _CLK_TCK


def resume_commands(path: Path) -> list[str]:
    """The commands of the invocations whose runs ``path`` holds (the earliest first),
    for a ``--resume`` to keep; ``[]`` when there is no such file."""
    if not path.exists():
        return []
    doc = orjson.loads(path.read_bytes())
    return [*doc.get("earlier_commands", []), *([doc["command"]] if doc.get("command") else [])]


def resume_runs(path: Path, s: BenchSettings) -> list[RunResult]:
    """The runs a previous invocation with the same settings left in ``path`` (written
    after every run), to skip them: every repeat of each (workload, label, replicas).

    Raises:
        SystemExit: the file's settings differ from this invocation's (the runs would
            not compare).
    """
    if not path.exists():
        return []
    doc = orjson.loads(path.read_bytes())
    theirs = doc.get("settings", {})
    ours = orjson.loads(orjson.dumps(asdict(s)))
    if theirs != ours:
        diff = sorted(k for k in set(theirs) | set(ours) if theirs.get(k) != ours.get(k))
        raise SystemExit(f"error: --resume: {path} was run with other settings ({', '.join(diff)})")
    runs = doc.get("repeated_runs") or doc.get("runs") or []
    return [RunResult.from_json(r) for r in runs]


def median_run(runs: Sequence[RunResult]) -> RunResult:
    """One run standing for several of the same (workload, router, replicas): the first
    one's, with the median of each figure across them (hit rate, P50 and P90 TTFT,
    latency, throughput, requests, errors summed) and ``repeats`` set."""
    import dataclasses
    import statistics

    if len(runs) == 1:
        return runs[0]
    sm = [r.summary for r in runs]
    med = statistics.median
    summary = dataclasses.replace(
        sm[0], cache_hit_rate=med(x.cache_hit_rate for x in sm), p50_ttft_s=med(x.p50_ttft_s for x in sm),
        p90_ttft_s=med(x.p90_ttft_s for x in sm), p50_latency_s=med(x.p50_latency_s for x in sm),
        throughput_rps=med(x.throughput_rps for x in sm), errors=sum(x.errors for x in sm))
    return dataclasses.replace(runs[0], summary=summary, repeat=-1, repeats=len(runs), results=[],
                               router_cpu_s=med(r.router_cpu_s for r in runs),
                               engine_cpu_s=med(r.engine_cpu_s for r in runs))


_ENGINE_READY = re.compile(r"prefixroute-emulate listening on (http://\S+)")


def start_fleet(tracker: ProcessTracker, count: int, s: BenchSettings, python: str = sys.executable,
                token_ratio: float = 1.0) -> list[tuple[str, str]]:
    """Start ``count`` emulated engines at once (flags: :func:`engine_args`); returns
    ``[(instance id, url)]``.

    Raises:
        PeerError: an engine exited or did not listen within 60 s.
    """
    procs = []
    shared_tier = tracker.path("shared-tier", ".kv") if "shared" in s.tiers else None
    for i in range(count):
        iid = f"instance-{i}"
        procs.append((iid, tracker.start(f"engine-{i}", [
            python, "-m", "prefixroute", "emulate", "--host", "127.0.0.1", "--port", "0", "--instance-id", iid,
            "--time-scale", str(s.time_scale), "--log-level", "warning",
            *engine_args(s, shared_tier, token_ratio)])))
    out = []
    for iid, p in procs:
        found: list[str] = []

        def ready(p=p, found=found) -> bool:
            m = _ENGINE_READY.search(p.tail(5))
            if m:
                found.append(m.group(1))
            return bool(m)

        p.wait_ready(ready, 60.0, "listening")
        out.append((iid, found[-1]))
    return out


async def _request(http: aiohttp.ClientSession, url: str, body: dict[str, Any], headers: dict[str, str],
                   index: int, group: int, want_text: bool) -> RequestResult:
    """One streamed chat request; TTFT = first chunk with generated text."""
    payload = orjson.dumps(dict(body, stream=True))
    res = RequestResult(index, group, time.perf_counter())
    parts: list[str] = []
    try:
        async with http.post(url, data=payload, headers={"Content-Type": "application/json", **headers}) as resp:
            res.status = resp.status
            res.instance = resp.headers.get("X-Emulated-Instance") or resp.headers.get("X-Prefixroute-Instance", "")
            res.decision = resp.headers.get("X-Prefixroute-Decision", "")
            oh = resp.headers.get("X-Prefixroute-Overhead-Ms")
            res.overhead_ms = float(oh) if oh else None
            if resp.status != 200:
                res.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return res
            buf = b""
            async for chunk in resp.content.iter_any():
                buf += chunk
                while b"\n\n" in buf:
                    event, buf = buf.split(b"\n\n", 1)
                    if not event.startswith(b"data:"):
                        continue
                    data = event[5:].strip()
                    if data == b"[DONE]":
                        continue
                    msg = orjson.loads(data)
                    for choice in msg.get("choices") or ():
                        text = (choice.get("delta") or {}).get("content") or choice.get("text") or ""
                        if text:
                            if res.ttft_s is None:
                                res.ttft_s = time.perf_counter() - res.start_s
                            if want_text:
                                parts.append(text)
            res.latency_s = time.perf_counter() - res.start_s
            res.text = "".join(parts)
            if res.ttft_s is None:
                res.error = "stream ended without generated text"
                res.latency_s = None
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
        res.error = f"{type(exc).__name__}: {exc}"
    return res


async def drive(router_urls: Sequence[str], sessions: Iterator[Any], session_key: Callable[[Any], str],
                users: int | None, duration_s: float, time_scale: float,
                events: Sequence[tuple[float, Callable[[], Any]]] = (), timeout_s: float = 120.0) -> tuple[list[RequestResult], float, list[dict[str, Any]]]:
    """Closed-loop users running sessions back to back through the routers, or (``users``
    None) sessions started at their own arrival times (open loop).

    User ``u`` talks to router ``u mod len(router_urls)`` (clients spread round robin
    over the replicas); in the open loop, session ``i`` to router ``i mod len(...)``.
    Each session's turns follow each other after its think time (model seconds ×
    ``time_scale``); each turn resends the earlier answers as received. No turn starts
    after ``duration_s`` real seconds; an open-loop session starts ``start_s`` model
    seconds (× ``time_scale``) after the run's start. ``events`` are ``(real second,
    blocking callable)`` run in a thread at that time (membership).

    Returns:
        ``(results, wall_s, event log)``.
    """
    results: list[RequestResult] = []
    log: list[dict[str, Any]] = []
    counter = itertools.count()
    connector = aiohttp.TCPConnector(limit=0)
    t0 = time.perf_counter()
    deadline = t0 + duration_s

    async def session(http: aiohttp.ClientSession, url: str, s: Any) -> None:
        headers = {"X-Session-ID": session_key(s)}
        answers: list[str] = []
        for k in range(s.num_turns):
            if k > 0:
                await asyncio.sleep(s.think_s(k) * time_scale)
                if time.perf_counter() >= deadline:
                    break
            r = await _request(http, url, s.body(k, answers), headers, next(counter), s.group,
                               want_text=k + 1 < s.num_turns)
            results.append(r)
            if r.error:
                break
            answers.append(r.text)
            r.text = ""

    async def user(http: aiohttp.ClientSession, u: int) -> None:
        url = router_urls[u % len(router_urls)] + "/v1/chat/completions"
        while time.perf_counter() < deadline:
            s = next(sessions, None)
            if s is None:
                return
            await session(http, url, s)

    async def arrivals(http: aiohttp.ClientSession) -> None:
        running: set[asyncio.Task[None]] = set()
        for i, s in enumerate(sessions):
            at = t0 + s.start_s * time_scale
            if at >= deadline:
                break
            await asyncio.sleep(max(0.0, at - time.perf_counter()))
            task = asyncio.create_task(session(http, router_urls[i % len(router_urls)] + "/v1/chat/completions", s))
            running.add(task)
            task.add_done_callback(running.discard)
        if running:
            await asyncio.gather(*running)

    async def event(at: float, fn: Callable[[], Any]) -> None:
        await asyncio.sleep(max(0.0, t0 + at - time.perf_counter()))
        started = time.perf_counter() - t0
        try:
            what = await asyncio.to_thread(fn)
            log.append({"at_s": round(started, 3), "took_s": round(time.perf_counter() - t0 - started, 3),
                        "what": str(what)})
        except PeerError as exc:
            log.append({"at_s": round(started, 3), "error": str(exc)[:500]})

    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=timeout_s)) as http:
        drivers = [arrivals(http)] if users is None else [user(http, u) for u in range(users)]
        await asyncio.gather(*drivers, *(event(at, fn) for at, fn in events))
    first = min((r.start_s for r in results), default=t0)
    last = max((r.start_s + r.latency_s for r in results if r.latency_s is not None), default=first)
    return results, last - first, log


#: Sessions, and turns of each, whose requests measure :func:`tiny_token_ratio`.
CALIBRATION_SESSIONS = 64
CALIBRATION_TURNS = 6


def tiny_token_ratio(wl: Any, precise: str) -> float:
    """The workload's tiny tokens per default engine token when the engines tokenize with
    the tiny tokenizer (``precise`` ``on`` or ``both``): the prompt tokens of its requests
    over the default engine's (4 bytes a token, :mod:`prefixroute.engine.tokenizer`),
    measured on the first :data:`CALIBRATION_TURNS` turns of the first
    :data:`CALIBRATION_SESSIONS` sessions, each turn after the first resending the answers
    each engine writes (whole words from the tiny vocabulary, one tiny token each; 4-byte
    tokens on the default engine); about 0.55 for the workloads' text, up to 0.7 on
    sharegpt-multi-turn, whose answers are much of its prompts. :func:`engine_args`
    scales the engines' per-token costs and sizes by it. 1.0 when ``precise`` is
    ``off``. An image part is ``PRECISE_MEDIA_TOKENS`` x 4 characters of stand-in text on
    both sides (about 3 tiny tokens per default token). One ratio for every request: a
    conversation's later turns (more answer text) cost somewhat more than on the default
    engine and its first turn less.
    """
    if precise == "off":
        return 1.0
    from prefixroute.core.model_tokenizer import ModelTokenizer
    from prefixroute.engine.http_common import chat_prompt_text
    from prefixroute.engine.tokenizer import count_tokens, decode, output_token_id

    # (as the engines tokenize: an image part as PRECISE_MEDIA_TOKENS tokens)
    tok = dataclasses.replace(ModelTokenizer.load("tiny"), media_tokens=PRECISE_MEDIA_TOKENS)
    tiny = default = 0
    for i, sess in enumerate(itertools.islice(wl.sessions(), CALIBRATION_SESSIONS)):
        tiny_answers: list[str] = []
        default_answers: list[str] = []
        for k in range(min(sess.num_turns, CALIBRATION_TURNS)):
            tiny += len(tok.chat_token_ids(sess.body(k, tiny_answers)))
            default += count_tokens(chat_prompt_text(sess.body(k, default_answers), PRECISE_MEDIA_TOKENS))
            n = sess.turn(k).output_tokens
            seed = i * CALIBRATION_TURNS + k
            tiny_answers.append(tok.decode([output_token_id(seed, j, tok.output_token_ids) for j in range(n)]))
            default_answers.append(decode([output_token_id(seed, j) for j in range(n)]))
    return tiny / default


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


# -- verdicts ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Comparison:
    """The subject against one other router on one workload and replica count.

    ``hit_points`` = subject's hit rate − other's, in percentage points (>= 0 is a win);
    ``p50_ratio``/``p90_ratio`` = subject's TTFT / other's (<= 1 is a win).
    """

    workload: str
    replicas: int
    other: str
    hit_points: float
    p50_ratio: float
    p90_ratio: float

    @property
    def wins(self) -> bool:
        return self.hit_points >= 0 and self.p50_ratio <= 1 and self.p90_ratio <= 1


def compare(runs: Sequence[RunResult], subject: str = SUBJECT) -> list[Comparison]:
    """Every (workload, replicas) pair's subject run against each other router's run."""
    out = []
    keyed = {(r.workload, r.summary.replicas, r.label): r for r in runs}
    for (wl, reps, label), r in keyed.items():
        if r.summary.strategy != subject:
            continue
        for (wl2, reps2, label2), o in keyed.items():
            if (wl2, reps2) != (wl, reps) or label2 == label:
                continue
            a, b = r.summary, o.summary
            out.append(Comparison(wl, reps, label2, (a.cache_hit_rate - b.cache_hit_rate) * 100,
                                  _ratio(a.p50_ttft_s, b.p50_ttft_s), _ratio(a.p90_ttft_s, b.p90_ttft_s)))
    return out


def _ratio(a: float, b: float) -> float:
    if not (a == a and b == b) or b <= 0:
        return float("nan")
    return a / b


def replica_drift(runs: Sequence[RunResult], subject: str = SUBJECT) -> dict[str, float]:
    """Per workload: subject's hit rate with the most replicas minus with 1, in points."""
    by: dict[str, dict[int, float]] = {}
    for r in runs:
        if r.summary.strategy == subject:
            by.setdefault(r.workload, {})[r.summary.replicas] = r.summary.cache_hit_rate
    return {wl: (d[max(d)] - d[1]) * 100 for wl, d in by.items() if 1 in d and max(d) > 1}


# -- output -----------------------------------------------------------------------------------


def render_workload_table(workload: WorkloadSpec, runs: Sequence[RunResult], description: str,
                          fleet_mode: str = "") -> Any:
    """A rich table: one row per (router, replicas), sorted by replicas then router order."""
    from rich.table import Table

    table = Table(title=f"{workload.name}: {workload.title}\n{description}" + (f"\n{fleet_mode}" if fleet_mode else ""),
                  title_justify="left")
    for col in ("router", "replicas", "cache hit", "P50 TTFT", "P90 TTFT", "throughput", "busiest", "errors",
                "requests", "router CPU"):
        table.add_column(col, justify="left" if col == "router" else "right", no_wrap=True)
    for r in sorted(runs, key=lambda r: r.summary.replicas):
        s = r.summary
        style = "bold" if s.strategy == SUBJECT else None
        table.add_row(r.label, str(s.replicas), f"{s.cache_hit_rate * 100:.1f} %", f"{s.p50_ttft_s * 1000:.0f} ms",
                      f"{s.p90_ttft_s * 1000:.0f} ms", f"{s.throughput_rps:.1f} rps", f"{r.busiest_share * 100:.1f} %",
                      str(s.errors), str(s.requests),
                      f"{r.router_cpu_s:.1f} s" if r.router_cpu_s == r.router_cpu_s else "", style=style)
    return table


def verdict_lines(runs: Sequence[RunResult]) -> list[str]:
    """Plain-text verdicts: per workload and replica count, where the subject loses and by how much."""
    lines = []
    comps = compare(runs)
    for (wl, reps), group in itertools.groupby(sorted(comps, key=lambda c: (c.workload, c.replicas)),
                                               key=lambda c: (c.workload, c.replicas)):
        group = list(group)
        subject = next(r for r in runs if r.workload == wl and r.summary.replicas == reps
                       and r.summary.strategy == SUBJECT)
        losses = [c for c in group if not c.wins]
        err = subject.summary.errors
        head = f"{wl}, {reps} replica{'s' if reps > 1 else ''}: "
        if not losses and err == 0:
            lines.append(head + f"{SUBJECT} has the highest hit rate and the lowest P50 and P90 TTFT, 0 errors")
            continue
        parts = []
        for c in losses:
            bits = []
            if c.hit_points < 0:
                bits.append(f"hit {c.hit_points:+.1f} pts")
            if c.p50_ratio > 1:
                bits.append(f"P50 {(c.p50_ratio - 1) * 100:+.0f} %")
            if c.p90_ratio > 1:
                bits.append(f"P90 {(c.p90_ratio - 1) * 100:+.0f} %")
            parts.append(f"vs {c.other}: " + ", ".join(bits))
        if err:
            parts.append(f"{err} errors")
        lines.append(head + "; ".join(parts))
    for wl, drift in replica_drift(runs).items():
        ok = abs(drift) <= 2.0
        most = max(r.summary.replicas for r in runs if r.workload == wl and r.summary.strategy == SUBJECT)
        lines.append(f"{wl}: {SUBJECT} hit rate with {most} replicas vs 1: {drift:+.1f} pts "
                     f"({'within' if ok else 'outside'} 2 pts)")
    return lines


def precise_comparisons(runs: Sequence[RunResult]) -> list[dict[str, Any]]:
    """Per (workload, replicas) with both: prefixroute CACHE_AWARE precise against its
    learned view (the issue's bar: precise hit rate >= learned's, P90 TTFT <= learned's,
    0 errors). ``hit_points`` = precise - learned; ratios precise / learned."""
    out = []
    by = {(r.workload, r.summary.replicas, r.label): r for r in runs}
    for (wl, reps, label), p in by.items():
        if not label.startswith("prefixroute CACHE_AWARE precise"):
            continue
        learned = by.get((wl, reps, label.replace(" precise", "", 1)))
        if learned is None:
            continue
        a, b = p.summary, learned.summary
        hit = (a.cache_hit_rate - b.cache_hit_rate) * 100
        p50, p90 = _ratio(a.p50_ttft_s, b.p50_ttft_s), _ratio(a.p90_ttft_s, b.p90_ttft_s)
        out.append({"workload": wl, "replicas": reps, "label": label, "hit_points": hit, "p50_ratio": p50,
                    "p90_ratio": p90, "errors": a.errors + b.errors,
                    "meets": hit >= 0 and p90 <= 1 and a.errors == 0 and b.errors == 0})
    return out


def precise_lines(runs: Sequence[RunResult]) -> list[str]:
    """:func:`precise_comparisons` as text, one line each."""
    return [f"{c['workload']}, {c['replicas']} replica{'s' if c['replicas'] > 1 else ''}: precise vs learned "
            f"view: hit {c['hit_points']:+.1f} pts, P50 x{c['p50_ratio']:.2f}, P90 x{c['p90_ratio']:.2f}, "
            f"{c['errors']} errors: {'meets' if c['meets'] else 'MISSES'} (hit >=, P90 <=, 0 errors)"
            for c in precise_comparisons(runs)]


def write_plots(out_dir: Path, workloads: Sequence[WorkloadSpec], runs: Sequence[RunResult]) -> list[Path]:
    """Per workload: cache-hit rate, P50 and P90 TTFT per router, bars per replica count."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for wl in workloads:
        wr = [r for r in runs if r.workload == wl.name]
        if not wr:
            continue
        labels = list(dict.fromkeys(r.label for r in wr))
        reps = sorted({r.summary.replicas for r in wr})
        fig, axes = plt.subplots(1, 3, figsize=(15, 5))
        width = 0.8 / max(1, len(reps))
        metrics = (("cache-hit rate, %", lambda s: s.cache_hit_rate * 100),
                   ("P50 TTFT, model ms", lambda s: s.p50_ttft_s * 1000),
                   ("P90 TTFT, model ms", lambda s: s.p90_ttft_s * 1000))
        for ax, (name, get) in zip(axes, metrics):
            for j, rep in enumerate(reps):
                vals = []
                for label in labels:
                    r = next((x for x in wr if x.label == label and x.summary.replicas == rep), None)
                    vals.append(get(r.summary) if r else float("nan"))
                ax.bar([i + j * width for i in range(len(labels))], vals, width,
                       label=f"{rep} replica{'s' if rep > 1 else ''}")
            ax.set_xticks([i + width * (len(reps) - 1) / 2 for i in range(len(labels))], labels, rotation=40,
                          ha="right", fontsize=8)
            ax.set_title(name)
            ax.grid(True, axis="y", alpha=0.3)
        axes[0].legend()
        fig.suptitle(f"{wl.name}: {wl.title}")
        fig.tight_layout()
        p = out_dir / f"{wl.name}.png"
        fig.savefig(p, dpi=100)
        plt.close(fig)
        paths.append(p)
    return paths


def write_json(path: Path, workloads: Sequence[WorkloadSpec], descriptions: dict[str, str],
               runs: Sequence[RunResult], s: BenchSettings, command: str, skipped: dict[str, str],
               all_runs: Sequence[RunResult] = (), earlier_commands: Sequence[str] = ()) -> None:
    """SPEC §7's object: ``workload`` names the benchmark, each run carries its workload.
    With repeats, ``runs`` holds the medians and ``repeated_runs`` every run. ``command``
    is this invocation's; ``earlier_commands`` those of the invocations a ``--resume``
    carried on from (their runs are in the file too)."""
    doc = {
        "workload": "policy_vs_peers: " + "; ".join(f"{w.name} ({descriptions.get(w.name, '')})" for w in workloads),
        "runs": [r.to_json() for r in runs],
        "repeated_runs": [r.to_json() for r in all_runs] if len(all_runs) > len(runs) else [],
        "settings": asdict(s),
        "command": command,
        "earlier_commands": list(earlier_commands),
        "skipped": skipped,
        "comparisons": [asdict(c) | {"wins": c.wins} for c in compare(runs)],
        "precise_comparisons": precise_comparisons(runs),
        "replica_drift_points": replica_drift(runs),
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(orjson.dumps(doc, option=orjson.OPT_INDENT_2 | orjson.OPT_SERIALIZE_NUMPY))


# -- main -------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python bench/policy_vs_peers.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true",
                   help=f"smoke run: {QUICK.duration_s:g} s of traffic per run instead of {FULL.duration_s:g} s, and "
                        "4 replicas on the shared-prefix workload only")
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
