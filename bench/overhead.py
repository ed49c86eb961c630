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
import asyncio
import json
import os
import platform
import re
import shutil
import statistics
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parent))

from fast_backend import EXIT_CANNOT_LISTEN, MODEL, raise_nofile_limit  # noqa: E402  (bench/ is a folder of scripts)
from peers import (  # noqa: E402
    DEFAULT_PEERS_VENV,
    HAProxySpec,
    ManagedProcess,
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
    free_port,
    prefixroute_fleet_config,
    source_commit,
)

BENCH_DIR = Path(__file__).resolve().parent
FAST_BACKEND = BENCH_DIR / "fast_backend.py"
#: The label ratios of added latency are taken against, and the one of requests/s.
LATENCY_REFERENCE = "haproxy hash-balance-factor"
THROUGHPUT_REFERENCE = "sglang-router cache_aware"
#: The reference row of what a bare Python relay costs (bench/relay_floor.py).
RELAY_FLOOR_LABEL = "python relay floor"
#: prefixroute CACHE_AWARE in precise mode, on the fast backend's stand-in KV events.
PRECISE_LABEL = "prefixroute CACHE_AWARE precise"
DIRECT = "direct"
_CLK_TCK = os.sysconf("SC_CLK_TCK")


# -- settings ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class OverheadSettings:
    """What one run measures.

    Attributes:
        concurrency: wrk connections per cell (closed loop; threads = min(2, connections)).
        body_sizes: request body sizes per cell, bytes (each body exactly this long).
        streaming: per cell, whether the bodies ask for a stream.
        duration_s: seconds of load per measurement (wrk takes whole seconds).
        rounds: measurements of every (cell, target); the median is reported.
        warmup_s: seconds of load before a cell's first round, per target (0: none).
        instances: ports of the fast backend, the routers' instances.
        backend_port: the fast backend's first port, the others following it; fixed, so
            that the instances' URLs, by which rendezvous hashing places the test
            bodies (PREFIX_AWARE, CACHE_AWARE, the peers' cache-aware policies), are the
            same in every run. 0, or a port in use: free ports chosen by the OS (the
            placement then changes from run to run).
        distinct_bodies: request bodies the load cycles over (distinct system prompts).
        stream_events: SSE events per streamed answer (before ``data: [DONE]``).
        prefix_length: PREFIX_AWARE PrefixLength (characters) and HAProxy's hashed bytes.
        concurrency_threshold: PREFIX_AWARE and CACHE_AWARE ConcurrencyThreshold.
        balance_factor: HAProxy ``hash-balance-factor``.
        workers: ``prefixroute serve --workers`` of the multi-worker row.
        streams: concurrent streams of the streams phase (0: skip it).
        streams_events: SSE events per stream in that phase.
        streams_delay_ms: milliseconds between two events in that phase (20 events
            250 ms apart: each stream lasts about 5 s, longer than opening 2,000 takes
            here, so all are open at once).
        seed: seed of the request bodies.
        paired_direct_up_to: in cells of at most this concurrency, direct is measured
            again right before every router, and that router's added latency is taken
            against it (0: direct once per round, first). At concurrency 1 the added
            latency is a tenth of a millisecond, less than this machine drifts between
            the start and the end of a round.
    """

    concurrency: tuple[int, ...] = (1, 8, 64, 256)
    body_sizes: tuple[int, ...] = (1024, 32 * 1024, 256 * 1024)
    streaming: tuple[bool, ...] = (False, True)
    duration_s: int = 5
    rounds: int = 3
    warmup_s: int = 1
    instances: int = 4
    backend_port: int = 18431
    distinct_bodies: int = 16
    stream_events: int = 8
    prefix_length: int = 4096
    concurrency_threshold: int = 32
    balance_factor: int = 150
    workers: int = 2
    streams: int = 2000
    streams_events: int = 20
    streams_delay_ms: float = 1000.0
    seed: int = 0
    paired_direct_up_to: int = 1


FULL = OverheadSettings()
#: ``--quick``: 2 s measurements, 1 round, no per-cell warm-up, concurrency 1 and 64,
#: 32 KB bodies, streaming and not (a smoke run, not a result).
QUICK = OverheadSettings(concurrency=(1, 64), body_sizes=(32 * 1024,), duration_s=2, rounds=1, warmup_s=0)


@dataclass(frozen=True)
class Cell:
    """One point of the grid."""

    concurrency: int
    body_bytes: int
    stream: bool

    @property
    def name(self) -> str:
        return f"c={self.concurrency} body={_size_name(self.body_bytes)} {'stream' if self.stream else 'plain'}"


def _size_name(n: int) -> str:
    if n % (1024 * 1024) == 0:
        return f"{n // (1024 * 1024)} MB"
    if n % 1024 == 0:
        return f"{n // 1024} KB"
    return f"{n} B"


def parse_size(text: str) -> int:
    """``"32K"``, ``"32KB"``, ``"1m"`` or ``"1000"`` -> bytes (K = 1024).

    Raises:
        ValueError: not a size.
    """
    m = re.fullmatch(r"\s*(\d+)\s*([kKmM]?)[bB]?\s*", text)
    if not m:
        raise ValueError(f"not a size: {text!r} (e.g. 1K, 32KB, 262144)")
    return int(m.group(1)) * {"": 1, "k": 1024, "m": 1024 * 1024}[m.group(2).lower()]


# -- request bodies ---------------------------------------------------------------------------

_WORDS = ("the", "policy", "customer", "refund", "order", "shipping", "account", "invoice", "warranty", "return",
          "support", "window", "days", "within", "product", "service", "request", "billing", "plan", "tier",
          "escalate", "agent", "ticket", "priority", "region", "contract", "renewal", "discount", "credit", "limit")


def make_bodies(size_bytes: int, stream: bool, count: int = 16, seed: int = 0) -> list[bytes]:
    """``count`` OpenAI chat bodies of exactly ``size_bytes`` bytes each.

    Each has its own system prompt, different from its first characters (so every
    router that keys on a prefix spreads them), padded with seeded ASCII words; the
    bodies for ``stream`` True and False have the same prompts. JSON as ``json.dumps``
    writes it, so a streaming body contains ``"stream": true``.

    Raises:
        ValueError: ``size_bytes`` is too small for the JSON around the prompt.
    """
    import random

    out = []
    for i in range(count):
        head = f"Tenant {i:02d} of {count}: you are the support assistant of shop number {i}. "
        user = f"Question {i}: what does the policy above say about returns?"

        def doc(system: str) -> bytes:
            return json.dumps({"model": MODEL, "messages": [{"role": "system", "content": system},
                                                            {"role": "user", "content": user}],
                               "max_tokens": 16, "stream": stream}).encode()

        need = size_bytes - len(doc(head))
        if need < 0:
            raise ValueError(f"a body of {size_bytes} bytes cannot hold a chat request (at least {len(doc(head))})")
        rng = random.Random(f"{seed}-{i}")
        parts, have = [], 0
        while have < need:
            words = " ".join(rng.choices(_WORDS, k=256)) + ". "
            parts.append(words)
            have += len(words)
        body = doc(head + "".join(parts)[:need])
        assert len(body) == size_bytes
        out.append(body)
    return out


def write_bodies(directory: Path, bodies: Sequence[bytes], stem: str) -> list[Path]:
    """Write each body to ``directory/stem-NN.json``; returns the paths in order."""
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for i, b in enumerate(bodies):
        p = directory / f"{stem}-{i:02d}.json"
        p.write_bytes(b)
        paths.append(p)
    return paths


# -- wrk ----------------------------------------------------------------------------------------

#: The wrk script: POST the bodies of the files named after ``--``, cycling over them
#: (each thread starts at a different one); ``done`` prints the summary as one JSON line.
WRK_SCRIPT = r"""-- bench/overhead.py: POST JSON bodies read from files, cycling over them.
local requests = {}
local count = 0
local index = 0
local threads = 0

function setup(thread)
   thread:set("thread_number", threads)
   threads = threads + 1
end

function init(args)
   for _, path in ipairs(args) do
      local f = assert(io.open(path, "rb"))
      local body = f:read("*a")
      f:close()
      count = count + 1
      requests[count] = wrk.format("POST", nil, {["Content-Type"] = "application/json"}, body)
   end
   assert(count > 0, "no body files given after --")
   index = (thread_number or 0) % count
end

function request()
   index = index % count + 1
   return requests[index]
end

function done(summary, latency, requests)
   local e = summary.errors
   io.write(string.format(
      'WRK_JSON {"requests": %.0f, "duration_us": %.0f, "bytes": %.0f, ' ..
      '"errors": {"connect": %.0f, "read": %.0f, "write": %.0f, "status": %.0f, "timeout": %.0f}, ' ..
      '"latency_us": {"min": %.0f, "mean": %.3f, "p50": %.0f, "p90": %.0f, "p99": %.0f, "p999": %.0f, "max": %.0f}}\n',
      summary.requests, summary.duration, summary.bytes, e.connect, e.read, e.write, e.status, e.timeout,
      latency.min, latency.mean, latency:percentile(50), latency:percentile(90), latency:percentile(99),
      latency:percentile(99.9), latency.max))
end
"""


def find_wrk() -> str | None:
    """The ``wrk`` program on PATH or in /usr/bin, or None."""
    return shutil.which("wrk") or ("/usr/bin/wrk" if os.access("/usr/bin/wrk", os.X_OK) else None)


def ensure_wrk(install: bool = True, log: Callable[[str], None] = print) -> PeerStatus:
    """Find wrk, installing the Debian package with ``apt-get`` when missing and we are root.

    Returns:
        A :class:`PeerStatus` named ``wrk`` (its version as detail when available).
    """
    exe = find_wrk()
    if exe is None and install:
        if not shutil.which("apt-get"):
            return PeerStatus("wrk", False, "wrk is not installed and there is no apt-get to install it")
        if os.geteuid() != 0:
            return PeerStatus("wrk", False, "wrk is not installed; run `apt-get install -y wrk` as root")
        log("installing wrk with apt-get")
        env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
        try:
            subprocess.run(["apt-get", "update", "-q"], capture_output=True, text=True, timeout=600, env=env)
            inst = subprocess.run(["apt-get", "install", "-y", "-q", "wrk"], capture_output=True, text=True,
                                  timeout=900, env=env)
        except (OSError, subprocess.TimeoutExpired) as exc:
            return PeerStatus("wrk", False, f"apt-get install wrk failed: {exc}")
        if inst.returncode != 0:
            return PeerStatus("wrk", False, f"apt-get install wrk failed: {inst.stderr.strip()[-300:]}")
        exe = find_wrk()
    if exe is None:
        return PeerStatus("wrk", False, "wrk is not installed (apt-get install -y wrk)")
    try:
        proc = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return PeerStatus("wrk", False, f"{exe} --version failed: {exc}")
    m = re.search(r"wrk\s+(\S+)", proc.stdout + proc.stderr)
    return PeerStatus("wrk", True, f"wrk {m.group(1) if m else 'unknown version'}", exe)


@dataclass(frozen=True)
class WrkResult:
    """One wrk run's summary (from the script's ``done``).

    Attributes:
        requests: responses completed (any status).
        duration_s: seconds wrk ran.
        p50_ms, p90_ms, p99_ms, mean_ms, max_ms: latency, request sent to response received.
        errors: ``connect``, ``read``, ``write``, ``timeout`` (socket errors) and
            ``status`` (responses with a status >= 400).
        bytes: response bytes read.
    """

    requests: int
    duration_s: float
    p50_ms: float
    p90_ms: float
    p99_ms: float
    mean_ms: float
    max_ms: float
    errors: dict[str, int]
    bytes: int

    @property
    def rps(self) -> float:
        return self.requests / self.duration_s if self.duration_s > 0 else 0.0

    @property
    def error_count(self) -> int:
        return sum(self.errors.values())


def parse_wrk_output(text: str) -> WrkResult:
    """The script's ``WRK_JSON`` line of wrk's output.

    Raises:
        ValueError: no such line (wrk failed; the message holds its output's end).
    """
    m = re.search(r"^WRK_JSON (\{.*\})\s*$", text, re.M)
    if not m:
        raise ValueError("wrk printed no summary: " + " | ".join(text.strip().splitlines()[-8:]))
    d = json.loads(m.group(1))
    lat = d["latency_us"]
    return WrkResult(requests=int(d["requests"]), duration_s=d["duration_us"] / 1e6, p50_ms=lat["p50"] / 1000,
                     p90_ms=lat["p90"] / 1000, p99_ms=lat["p99"] / 1000, mean_ms=lat["mean"] / 1000,
                     max_ms=lat["max"] / 1000, errors={k: int(v) for k, v in d["errors"].items()},
                     bytes=int(d["bytes"]))


def run_wrk(tracker: ProcessTracker, url: str, body_files: Sequence[Path], connections: int, duration_s: int, *,
            wrk: str, script: Path, timeout_s: int = 30, name: str = "wrk") -> WrkResult:
    """Run wrk (``-t min(2, connections) -c connections -d duration_s --latency``) against
    ``url`` with :data:`WRK_SCRIPT` cycling over ``body_files``, as a tracked process.

    Raises:
        PeerError: wrk failed, printed no summary, or ran far past its duration.
    """
    threads = min(2, connections)
    argv = [wrk, "-t", str(threads), "-c", str(connections), "-d", f"{max(1, int(duration_s))}s",
            "--timeout", f"{timeout_s}s", "--latency", "-s", str(script), url, "--", *map(str, body_files)]
    proc = tracker.start(name, argv)
    try:
        proc.proc.wait(timeout=duration_s + timeout_s + 30)
    except subprocess.TimeoutExpired:
        raise PeerError(f"wrk did not finish; output:\n{proc.tail()}") from None
    finally:
        tracker.stop([proc])
    text = proc.log_path.read_text(errors="replace")
    try:
        return parse_wrk_output(text)
    except ValueError as exc:
        raise PeerError(f"wrk (exit code {proc.proc.returncode}): {exc}") from None


# -- processes: the backend and /proc readings ------------------------------------------------

_BACKEND_READY = re.compile(r"fast-backend listening on (http://\S+)")
_BACKEND_KV = re.compile(r"fast-backend kv events of (http://\S+) on (tcp://\S+) replay (tcp://\S+)")


@dataclass
class FastBackend:
    """A running ``bench/fast_backend.py``: its process and one URL per port."""

    process: ManagedProcess
    urls: list[str]
    #: With ``kv_events``: per URL, its stand-in engine's (PUB endpoint, replay endpoint).
    kv_endpoints: dict[str, tuple[str, str]] = field(default_factory=dict)

    @property
    def pid(self) -> int:
        return self.process.proc.pid

    def kv_events_section(self, block_size: int = 16, tokenizer: str = "tiny") -> dict[str, Any]:
        """Precise mode's ``KvEvents`` section for a router in front of this backend
        (every port's endpoints, the stand-in's block size and tokenizer)."""
        return {"BlockSize": block_size, "Tokenizer": tokenizer,
                "Instances": {u: {"Endpoint": pub, "ReplayEndpoint": replay}
                              for u, (pub, replay) in self.kv_endpoints.items()}}

    def stats(self) -> dict[str, Any]:
        """Its ``GET /stats`` counters (see bench/fast_backend.py)."""
        with urllib.request.urlopen(self.urls[0] + "/stats", timeout=10) as r:
            return json.loads(r.read())


def ports_free(first: int, count: int) -> bool:
    """Whether ports ``first`` to ``first + count - 1`` can be bound on 127.0.0.1 now."""
    for port in range(first, first + count):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                return False
    return True


def start_fast_backend(tracker: ProcessTracker, ports: int = 4, *, first_port: int = 0, stream_events: int = 8,
                       stream_delay_ms: float = 0.0, record_bodies: bool = False, kv_events: bool = False,
                       python: str = sys.executable, timeout_s: float = 30.0,
                       log: Callable[[str], None] = print) -> FastBackend:
    """Start the fast backend on ``ports`` ports and wait until it listens on all: on
    ``first_port`` and the ones after it, or on free ports if ``first_port`` is 0 or
    one of those is in use (said through ``log``). With ``kv_events`` every port
    publishes the KV events of a stand-in engine (``bench/kv_stand_in.py``).

    Raises:
        PeerError: it exited or did not listen in time.
    """
    if not 0 <= first_port <= 65535:
        raise ValueError(f"first_port must be within 0-65535, got {first_port}")
    moved = ("the fast backend listens on free ports, so the test bodies' placement over the instances differs "
             "from other runs")
    if first_port and first_port + ports - 1 > 65535:
        log(f"note: ports {first_port} to {first_port + ports - 1} run past 65535: {moved}")
        first_port = 0
    elif first_port and not ports_free(first_port, ports):
        log(f"note: ports {first_port}-{first_port + ports - 1} are not all free: {moved}")
        first_port = 0
    while True:
        chosen = [str(first_port + i) if first_port else "0" for i in range(ports)]
        argv = [python, str(FAST_BACKEND), *[a for port in chosen for a in ("--port", port)],
                "--stream-chunks", str(stream_events), "--stream-delay-ms", str(stream_delay_ms)]
        if record_bodies:
            argv.append("--record-bodies")
        if kv_events:
            argv.append("--kv-events")
        proc = tracker.start("fast-backend", argv, env=dict(os.environ, PYTHONUNBUFFERED="1"))
        urls: list[str] = []
        kv: dict[str, tuple[str, str]] = {}

        def ready() -> bool:
            text = proc.tail(2 * ports + 5)
            urls[:] = _BACKEND_READY.findall(text)
            kv.update({u: (pub, replay) for u, pub, replay in _BACKEND_KV.findall(text)})
            return len(urls) >= ports

        try:
            proc.wait_ready(ready, timeout_s, "listening")
        except PeerError:
            if not first_port or proc.alive() or proc.proc.returncode != EXIT_CANNOT_LISTEN:
                raise  # (free ports failed too, a timeout, or another failure: nothing to retry)
            # A port was taken between the check and the start (another program's).
            log(f"note: the fast backend could not listen on ports {first_port}-{first_port + ports - 1}: {moved}")
            first_port = 0
            continue
        return FastBackend(proc, urls[:ports], kv)


def process_tree(root: int) -> list[int]:
    """``root`` and every live descendant (from ``/proc/*/stat``), root first."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        ppid = int(stat[stat.rfind(b")") + 2:].split()[1])
        children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        if pid in out:
            continue
        out.append(pid)
        todo.extend(children.get(pid, ()))
    return out if os.path.exists(f"/proc/{root}") else []


def tree_cpu_seconds(root: int) -> float:
    """CPU seconds (user + system) used by ``root``'s process tree: utime + stime +
    cutime + cstime of every live process (a reaped child's time is in its parent's
    cutime/cstime, a live one's only in its own)."""
    total = 0
    for pid in process_tree(root):
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except OSError:
            continue
        # fields[0] is the state (field 3 of proc(5)); utime..cstime are fields 14-17.
        total += sum(int(x) for x in fields[11:15])
    return total / _CLK_TCK


def tree_peak_rss_bytes(root: int) -> int:
    """``VmHWM`` (peak resident set) summed over ``root``'s process tree, bytes."""
    total = 0
    for pid in process_tree(root):
        try:
            with open(f"/proc/{pid}/status") as f:
                for line in f:
                    if line.startswith("VmHWM:"):
                        total += int(line.split()[1]) * 1024
                        break
        except OSError:
            continue
    return total


def reset_peak_rss(root: int) -> bool:
    """Reset ``VmHWM`` to the current RSS for every process of the tree (``echo 5 >
    /proc/PID/clear_refs``, Linux 4.0+); False if any could not be reset."""
    ok = True
    for pid in process_tree(root):
        try:
            with open(f"/proc/{pid}/clear_refs", "w") as f:
                f.write("5")
        except OSError:
            ok = False
    return ok


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


@dataclass
class Measurement:
    """One wrk run against one target in one cell and round (``round`` counts from 1,
    as the progress lines do), with the router's CPU and memory and the backend's view
    of it."""

    target: str
    round: int
    cell: Cell
    wrk: WrkResult
    router_cpu_s: float | None
    router_peak_rss_bytes: int | None
    peak_rss_reset: bool
    backend_cpu_s: float
    instance_requests: list[int]
    backend_requests: int
    backend_unknown: dict[str, int]
    #: For a direct measurement taken right before one router's (paired direct), that
    #: router's label; None for the round's own direct measurement and for routers.
    paired_with: str | None = None
    #: For a precise router: each instance's mode after the run and the share of the
    #: run's requests matched on the events (:func:`precise_check`); else ``None``.
    precise: dict[str, Any] | None = None

    @property
    def router_cpu_us_per_request(self) -> float | None:
        if self.router_cpu_s is None or self.wrk.requests == 0:
            return None
        return self.router_cpu_s / self.wrk.requests * 1e6

    @property
    def backend_cpu_us_per_request(self) -> float | None:
        return self.backend_cpu_s / self.wrk.requests * 1e6 if self.wrk.requests else None

    def to_json(self) -> dict[str, Any]:
        return {"label": self.target, "round": self.round, "concurrency": self.cell.concurrency,
                "body_bytes": self.cell.body_bytes, "stream": self.cell.stream, "requests": self.wrk.requests,
                "duration_s": self.wrk.duration_s, "throughput_rps": self.wrk.rps, "p50_latency_ms": self.wrk.p50_ms,
                "p90_latency_ms": self.wrk.p90_ms, "p99_latency_ms": self.wrk.p99_ms,
                "mean_latency_ms": self.wrk.mean_ms, "max_latency_ms": self.wrk.max_ms, "errors": self.wrk.errors,
                "error_count": self.wrk.error_count, "router_cpu_s": self.router_cpu_s,
                "router_cpu_us_per_request": self.router_cpu_us_per_request,
                "router_peak_rss_bytes": self.router_peak_rss_bytes,
                "peak_rss_scope": None if self.router_peak_rss_bytes is None else
                "this measurement" if self.peak_rss_reset else "since the router started",
                "backend_cpu_s": self.backend_cpu_s, "backend_cpu_us_per_request": self.backend_cpu_us_per_request,
                "backend_requests": self.backend_requests, "instance_requests": self.instance_requests,
                "backend_unknown_requests": self.backend_unknown, "paired_with": self.paired_with,
                **({"precise": self.precise} if self.precise is not None else {})}


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


def _settled_stats(backend: FastBackend, timeout_s: float = 3.0) -> dict[str, Any]:
    """The backend's counters once a router stopped forwarding what it still had in
    flight when wrk stopped (two equal readings 100 ms apart), so that those requests
    count for the target that sent them, not the next one."""
    prev = backend.stats()
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        time.sleep(0.1)
        cur = backend.stats()
        if cur["requests"] == prev["requests"] and cur["unknown"] == prev["unknown"]:
            return cur
        prev = cur
    return prev


# -- aggregation ----------------------------------------------------------------------------------


def _median(xs: Sequence[float | None]) -> float | None:
    vals = [x for x in xs if x is not None]
    return statistics.median(vals) if vals else None


@dataclass
class CellResult:
    """One (cell, target) over its rounds: medians, and the differences to direct."""

    target: Target
    cell: Cell
    rounds: list[Measurement]
    added_p50_ms: float | None = None
    added_p99_ms: float | None = None
    added_vs_haproxy: float | None = None
    rps_vs_sglang: float | None = None
    #: Added p50 of each round (round -> ms), router minus direct in that round.
    added_p50_by_round: dict[int, float] = field(default_factory=dict)
    #: The same ratios round by round (one entry per round of this target, in round
    #: order), each against the reference's figure of that round; ``None`` for a round
    #: where either is missing or HAProxy's added p50 is not positive (no ratio).
    added_vs_haproxy_rounds: list[float | None] = field(default_factory=list)
    rps_vs_sglang_rounds: list[float | None] = field(default_factory=list)

    @property
    def p50_ms(self) -> float | None:
        """Median p50 over the rounds that completed a request (None if none did)."""
        return _median([m.wrk.p50_ms for m in self.rounds if m.wrk.requests])

    @property
    def p99_ms(self) -> float | None:
        return _median([m.wrk.p99_ms for m in self.rounds if m.wrk.requests])

    @property
    def rounds_without_reply(self) -> int:
        """Rounds in which not one response completed (wrk counts those still in flight
        at the end neither as requests nor as errors; direct, measured several times a
        round at low concurrency: rounds in which none of its runs completed one)."""
        replied: dict[int, bool] = {}
        for m in self.rounds:
            replied[m.round] = replied.get(m.round, False) or m.wrk.requests > 0
        return sum(1 for ok in replied.values() if not ok)

    @property
    def round_count(self) -> int:
        """Rounds measured (``len(self.rounds)`` counts runs: direct has several a round
        in cells with paired direct runs)."""
        return len({m.round for m in self.rounds})

    @property
    def rps(self) -> float:
        return statistics.median(m.wrk.rps for m in self.rounds)

    @property
    def cpu_us_per_request(self) -> float | None:
        return _median([m.router_cpu_us_per_request for m in self.rounds])

    @property
    def peak_rss_bytes(self) -> int | None:
        vals = [m.router_peak_rss_bytes for m in self.rounds if m.router_peak_rss_bytes is not None]
        return max(vals) if vals else None

    @property
    def errors(self) -> int:
        return sum(m.wrk.error_count for m in self.rounds)

    @property
    def requests(self) -> int:
        return sum(m.wrk.requests for m in self.rounds)

    def to_json(self) -> dict[str, Any]:
        """SPEC §7 run fields (TTFT and cache-hit rate null: not measured here) plus the
        overhead figures."""
        inst = [sum(m.instance_requests[i] for m in self.rounds) for i in range(len(self.rounds[0].instance_requests))]
        total = sum(inst)
        return {
            "router": self.target.router, "strategy": self.target.strategy, "replicas": 1,
            "requests": self.requests, "errors": self.errors, "p50_ttft_s": None, "p90_ttft_s": None,
            "p50_latency_s": None if self.p50_ms is None else self.p50_ms / 1000, "cache_hit_rate": None,
            "throughput_rps": self.rps,
            "instance_share": [n / total for n in inst] if total and self.target.pid is not None else [],
            "label": self.target.label, "workers": self.target.workers, "concurrency": self.cell.concurrency,
            "body_bytes": self.cell.body_bytes, "stream": self.cell.stream, "rounds": self.round_count,
            "runs": len(self.rounds),
            "p99_latency_s": None if self.p99_ms is None else self.p99_ms / 1000,
            "rounds_without_reply": self.rounds_without_reply,
            "added_p50_ms": self.added_p50_ms, "added_p99_ms": self.added_p99_ms,
            "added_p50_vs_haproxy": self.added_vs_haproxy, "throughput_vs_sglang_router": self.rps_vs_sglang,
            "added_p50_vs_haproxy_rounds": self.added_vs_haproxy_rounds,
            "throughput_vs_sglang_router_rounds": self.rps_vs_sglang_rounds,
            "router_cpu_us_per_request": self.cpu_us_per_request, "router_peak_rss_bytes": self.peak_rss_bytes,
        }


def _median_run(runs: Sequence[Measurement]) -> Measurement | None:
    """The run of median p50 (the lower middle one of an even count), or None if none."""
    if not runs:
        return None
    return sorted(runs, key=lambda m: m.wrk.p50_ms)[(len(runs) - 1) // 2]


def aggregate(measurements: Sequence[Measurement], targets: Sequence[Target]) -> list[CellResult]:
    """Group measurements by (cell, target) and compute added latency (median over rounds
    of router minus direct in the same round: the direct run right before the router's
    when there is one, see ``paired_direct_up_to``) and the ratios to the reference routers:
    of the medians, and round by round (each round's figure against the reference's
    figure of the same round)."""
    by_target = {t.label: t for t in targets}
    groups: dict[tuple[Cell, str], list[Measurement]] = {}
    for m in measurements:
        groups.setdefault((m.cell, m.target), []).append(m)
    out: list[CellResult] = []
    for (cell, label), ms in groups.items():
        if label not in by_target:
            continue
        cr = CellResult(by_target[label], cell, sorted(ms, key=lambda m: m.round))
        direct = {(m.round, m.paired_with): m for m in groups.get((cell, DIRECT), [])}
        if label != DIRECT and direct:
            # Each router against the direct run right before it (paired), else its round's
            # (unpaired cells), else, its paired run having failed, the round's median one.
            base = {m.round: direct.get((m.round, label)) or direct.get((m.round, None))
                    or _median_run([d for (r, _), d in direct.items() if r == m.round and d.wrk.requests])
                    for m in ms}
            paired = [(m, base[m.round]) for m in ms
                      if base[m.round] is not None and m.wrk.requests and base[m.round].wrk.requests]
            cr.added_p50_by_round = {m.round: m.wrk.p50_ms - d.wrk.p50_ms for m, d in paired}
            d99 = [m.wrk.p99_ms - d.wrk.p99_ms for m, d in paired]
            cr.added_p50_ms, cr.added_p99_ms = _median(list(cr.added_p50_by_round.values())), _median(d99)
        out.append(cr)
    for cr in out:
        ref = next((r for r in out if r.cell == cr.cell and r.target.label == LATENCY_REFERENCE), None)
        if ref is not None and cr.added_p50_ms is not None and ref.added_p50_ms and ref.added_p50_ms > 0:
            cr.added_vs_haproxy = cr.added_p50_ms / ref.added_p50_ms
        if ref is not None and cr.added_p50_by_round:
            theirs_added = ref.added_p50_by_round
            cr.added_vs_haproxy_rounds = [
                cr.added_p50_by_round[m.round] / theirs_added[m.round]
                if m.round in cr.added_p50_by_round and theirs_added.get(m.round, 0) > 0 else None
                for m in cr.rounds]
        ref = next((r for r in out if r.cell == cr.cell and r.target.label == THROUGHPUT_REFERENCE), None)
        if ref is not None and ref.rps > 0:
            cr.rps_vs_sglang = cr.rps / ref.rps
        if ref is not None:  # one entry per round (direct, measured several times a round: their median)
            theirs = {m.round: m.wrk.rps for m in ref.rounds}
            ours: dict[int, list[float]] = {}
            for m in cr.rounds:
                ours.setdefault(m.round, []).append(m.wrk.rps)
            cr.rps_vs_sglang_rounds = [statistics.median(v) / theirs[r] if theirs.get(r, 0) > 0 else None
                                       for r, v in ours.items()]
    order = {t.label: i for i, t in enumerate(targets)}
    out.sort(key=lambda r: (r.cell.stream, r.cell.body_bytes, r.cell.concurrency, order[r.target.label]))
    return out


# -- the streams phase ------------------------------------------------------------------------------


@dataclass
class StreamsResult:
    """The streams phase: ``streams`` streaming requests opened at once through one router."""

    label: str
    streams: int
    completed: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    peak_open: int = 0
    backend_peak_open: int = 0
    wall_s: float = 0.0
    p50_stream_s: float | None = None
    max_stream_s: float | None = None
    router_rss_before_bytes: int = 0
    router_peak_rss_bytes: int = 0
    router_cpu_s: float = 0.0
    events_per_stream: int = 0
    delay_ms: float = 0.0
    nofile_limit: int = 0
    timeline: list[tuple[float, int]] = field(default_factory=list)

    @property
    def error_count(self) -> int:
        return sum(self.errors.values())

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["error_count"] = self.error_count
        return d


async def _streams_client(url: str, bodies: Sequence[bytes], n: int, events: int, res: StreamsResult,
                          connecting: int = 100) -> None:
    """Start ``n`` streaming requests, at most ``connecting`` of them waiting for their
    response headers at a time: a burst of 2,000 connects overflows a listen backlog
    (aiohttp's is 128), and Linux then drops SYNs that are retried only 1, 3, 7... s later,
    which spreads the streams out instead of opening them together."""
    import aiohttp

    gate = asyncio.Semaphore(connecting)
    open_now = 0
    durations: list[float] = []
    t_start = time.perf_counter()

    async def one(i: int) -> None:
        nonlocal open_now
        await gate.acquire()
        t0 = time.perf_counter()
        gated = True
        try:
            async with session.post(url, data=bodies[i % len(bodies)],
                                    headers={"Content-Type": "application/json"}) as resp:
                gate.release()
                gated = False
                if resp.status != 200:
                    await resp.read()
                    res.errors[f"HTTP {resp.status}"] = res.errors.get(f"HTTP {resp.status}", 0) + 1
                    return
                open_now += 1
                res.peak_open = max(res.peak_open, open_now)
                try:
                    data = await resp.read()
                finally:
                    open_now -= 1
            got = data.count(b"data: ")
            if not data.rstrip().endswith(b"data: [DONE]"):
                res.errors["no data: [DONE]"] = res.errors.get("no data: [DONE]", 0) + 1
            elif got != events + 1:
                res.errors[f"{got - 1} events instead of {events}"] = res.errors.get(
                    f"{got - 1} events instead of {events}", 0) + 1
            else:
                res.completed += 1
                durations.append(time.perf_counter() - t0)
        except Exception as exc:  # counted, not raised: the phase reports every failure
            key = type(exc).__name__
            res.errors[key] = res.errors.get(key, 0) + 1
        finally:
            if gated:
                gate.release()

    async def sample() -> None:
        while True:
            res.timeline.append((round(time.perf_counter() - t_start, 3), open_now))
            await asyncio.sleep(0.05)

    connector = aiohttp.TCPConnector(limit=0, limit_per_host=0)
    timeout = aiohttp.ClientTimeout(total=None, connect=120, sock_read=120)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        sampler = asyncio.create_task(sample())
        await asyncio.gather(*(one(i) for i in range(n)))
        sampler.cancel()
    res.wall_s = time.perf_counter() - t_start
    if durations:
        durations.sort()
        res.p50_stream_s = statistics.median(durations)
        res.max_stream_s = durations[-1]


def run_streams_phase(tracker: ProcessTracker, s: OverheadSettings, spec: RouterSpec,
                      log: Callable[[str], None] = print) -> StreamsResult:
    """Open ``s.streams`` streams at once through ``spec`` (started here, in front of a
    slow fast backend of its own) and count how they end.

    Raises:
        PeerError: the backend or the router did not start.
    """
    nofile = raise_nofile_limit()
    need = 3 * s.streams + 256  # the router holds 2 sockets per stream, the client 1
    if nofile < need:
        log(f"warning: RLIMIT_NOFILE is {nofile}, below the {need} that {s.streams} streams may need")
    backend = start_fast_backend(tracker, s.instances, stream_events=s.streams_events,
                                 stream_delay_ms=s.streams_delay_ms)
    router = spec.start_retrying(tracker, backend.urls)
    res = StreamsResult(spec.label, s.streams, events_per_stream=s.streams_events, delay_ms=s.streams_delay_ms,
                        nofile_limit=nofile)
    try:
        bodies = make_bodies(1024, True, s.distinct_bodies, s.seed)
        pid = router.process.proc.pid
        res.router_rss_before_bytes = tree_peak_rss_bytes(pid)
        reset_peak_rss(pid)
        cpu0 = tree_cpu_seconds(pid)
        _run_async(_streams_client(router.url + "/v1/chat/completions", bodies, s.streams, s.streams_events, res))
        res.router_cpu_s = tree_cpu_seconds(pid) - cpu0
        res.router_peak_rss_bytes = tree_peak_rss_bytes(pid)
        res.backend_peak_open = int(backend.stats()["streams_peak"])
    finally:
        tracker.stop([router.process, backend.process])
    return res


def _run_async(coro: Any) -> Any:
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


# -- output -----------------------------------------------------------------------------------------


def _f(x: float | None, fmt: str, none: str = "-") -> str:
    return none if x is None else format(x, fmt)


def _ratio(median: float | None, rounds: Sequence[float | None], fmt: str) -> str:
    """A ratio of medians, then its lowest and highest round by round when there are
    several rounds (``1.0 (0.9-1.8)``), with how many rounds gave one when some did not
    (``1.5 (0.5-0.6 in 2 of 3)``: HAProxy added nothing in a round, say). The ratio of
    medians need not lie within the rounds' range."""
    if median is None:
        return "-"
    known = [r for r in rounds if r is not None]
    if len(rounds) < 2 or not known:
        return format(median, fmt)
    some = f" in {len(known)} of {len(rounds)}" if len(known) < len(rounds) else ""
    return f"{median:{fmt}} ({min(known):{fmt}}-{max(known):{fmt}}{some})"


def render_cell_table(cell: Cell, results: Sequence[CellResult], s: OverheadSettings) -> Any:
    """A rich table of one cell: one row per target."""
    from rich.table import Table

    rounds = f"median of {s.rounds} rounds of {s.duration_s} s" if s.rounds > 1 else f"1 round of {s.duration_s} s"
    table = Table(title=f"{cell.name} ({rounds})", title_justify="left")
    for col in ("router", "p50 ms", "p99 ms", "added p50", "added p99", "x HAProxy", "req/s", "x sglang",
                "CPU us/req", "peak RSS", "requests", "errors"):
        table.add_column(col, justify="left" if col == "router" else "right", no_wrap=True)
    for r in results:
        table.add_row(
            r.target.label, _f(r.p50_ms, ".2f"), _f(r.p99_ms, ".2f"), _f(r.added_p50_ms, "+.2f"),
            _f(r.added_p99_ms, "+.2f"), _ratio(r.added_vs_haproxy, r.added_vs_haproxy_rounds, ".1f"), f"{r.rps:,.0f}",
            _ratio(r.rps_vs_sglang, r.rps_vs_sglang_rounds, ".2f"),
            _f(r.cpu_us_per_request, ",.0f"),
            "-" if r.peak_rss_bytes is None else f"{r.peak_rss_bytes / 2**20:.0f} MiB", f"{r.requests:,}",
            str(r.errors) + (f" + {r.rounds_without_reply} rounds without reply" if r.rounds_without_reply else ""),
            style="bold" if r.target.label == "prefixroute CACHE_AWARE" else None)
    return table


def render_streams_table(r: StreamsResult) -> Any:
    from rich.table import Table

    table = Table(title=f"streams: {r.streams:,} concurrent streaming requests through {r.label} "
                        f"({r.events_per_stream} events {r.delay_ms:g} ms apart)", title_justify="left")
    for col in ("streams", "completed with [DONE]", "errors", "peak open (client)", "peak open (backend)",
                "router RSS before", "router peak RSS", "router CPU", "p50 stream", "max stream", "wall"):
        table.add_column(col, justify="right", no_wrap=True)
    table.add_row(f"{r.streams:,}", f"{r.completed:,}",
                  str(r.error_count) + (f" {r.errors}" if r.errors else ""), f"{r.peak_open:,}",
                  f"{r.backend_peak_open:,}", f"{r.router_rss_before_bytes / 2**20:.0f} MiB",
                  f"{r.router_peak_rss_bytes / 2**20:.0f} MiB", f"{r.router_cpu_s:.1f} s",
                  _f(r.p50_stream_s, ".2f") + " s", _f(r.max_stream_s, ".2f") + " s", f"{r.wall_s:.1f} s")
    return table


def write_plots(out_dir: Path, results: Sequence[CellResult], streams: StreamsResult | None) -> list[Path]:
    """Per (body size, streaming): added p50 and p99 latency, requests/s and router CPU
    per request against concurrency, one line per target; the streams phase's open
    streams over time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for body, stream in sorted({(r.cell.body_bytes, r.cell.stream) for r in results}):
        rs = [r for r in results if r.cell.body_bytes == body and r.cell.stream == stream]
        labels = list(dict.fromkeys(r.target.label for r in rs))
        colors = {label: f"C{i % 10}" for i, label in enumerate(labels)}  # the same in every panel
        fig, axes = plt.subplots(1, 4, figsize=(22, 5))
        metrics = (("added p50 latency, ms", lambda r: r.added_p50_ms, False),
                   ("added p99 latency, ms", lambda r: r.added_p99_ms, False),
                   ("requests/s", lambda r: r.rps, True),
                   ("router CPU per request, µs", lambda r: r.cpu_us_per_request, False))
        for ax, (name, get, with_direct) in zip(axes, metrics):
            for label in labels:
                if label == DIRECT and not with_direct:
                    continue
                pts = sorted((r.cell.concurrency, get(r)) for r in rs if r.target.label == label)
                pts = [(c, v) for c, v in pts if v is not None]
                if pts:
                    ax.plot([c for c, _ in pts], [v for _, v in pts], marker="o", color=colors[label],
                            linestyle="--" if label == DIRECT else "-", label=label)
            ax.set_xscale("log", base=2)
            ax.set_xlabel("concurrent connections")
            ax.set_title(name)
            ax.grid(True, alpha=0.3)
        axes[2].legend(fontsize=8)
        mode = "streaming" if stream else "non-streaming"
        fig.suptitle(f"router overhead: {_size_name(body)} bodies, {mode}")
        fig.tight_layout()
        p = out_dir / f"overhead-{body // 1024}k-{'stream' if stream else 'plain'}.png"
        fig.savefig(p, dpi=100)
        plt.close(fig)
        paths.append(p)
    if streams is not None and streams.timeline:
        fig, ax = plt.subplots(figsize=(8, 4))
        ax.plot([t for t, _ in streams.timeline], [n for _, n in streams.timeline])
        ax.axhline(streams.streams, linestyle="--", color="grey")
        ax.set_xlabel("seconds")
        ax.set_ylabel("streams open (client side)")
        ax.set_title(f"{streams.streams:,} concurrent streams through {streams.label}")
        ax.grid(True, alpha=0.3)
        fig.tight_layout()
        p = out_dir / "overhead-streams.png"
        fig.savefig(p, dpi=100)
        plt.close(fig)
        paths.append(p)
    return paths


def machine_facts(root: str = "/") -> dict[str, Any]:
    """What the machine is: CPUs, platform, and how an idle CPU sleeps (Linux cpuidle's
    driver and governor; with the ``haltpoll`` driver of a KVM guest, how long an idle
    vCPU polls before it halts, ``guest_halt_poll_ns``). At concurrency 1 every hop
    wakes a sleeping process; a vCPU that has halted is woken by the host, which costs
    far more than waking one that polls, so these facts go with the latency figures.
    ``None`` for what the system does not say (``root``: where ``/sys`` is read from)."""
    def read(path: str) -> str | None:
        try:
            return (Path(root) / path.lstrip("/")).read_text().strip()
        except OSError:
            return None

    poll_ns = read("/sys/module/haltpoll/parameters/guest_halt_poll_ns")
    return {"cpus": os.cpu_count(), "platform": platform.platform(),
            "cpuidle_driver": read("/sys/devices/system/cpu/cpuidle/current_driver"),
            "cpuidle_governor": read("/sys/devices/system/cpu/cpuidle/current_governor"),
            "guest_halt_poll_ns": int(poll_ns) if poll_ns is not None and poll_ns.isdigit() else None}


def versions(statuses: dict[str, PeerStatus]) -> dict[str, str]:
    """Versions of everything measured: prefixroute (and its git commit), Python, peers."""
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": platform.python_version()}
    try:
        out["prefixroute"] = version("prefixroute")
    except PackageNotFoundError:
        out["prefixroute"] = "unknown"
    commit = source_commit(BENCH_DIR)
    if commit:
        out["prefixroute_commit"] = commit
    for name, st in statuses.items():
        out[name] = st.detail if st.available else f"unavailable: {st.detail}"
    return out


def write_json(path: Path, results: Sequence[CellResult], measurements: Sequence[Measurement],
               streams: StreamsResult | None, s: OverheadSettings, command: str, skipped: dict[str, str],
               statuses: dict[str, PeerStatus], backend_urls: Sequence[str] = ()) -> None:
    """SPEC §7's object plus every measurement, settings, command, versions, skipped routers,
    the fast backend's URLs (the routers' instances)."""
    import orjson

    doc = {
        "workload": (f"overhead: fast backend on {s.instances} ports, wrk closed loop over {s.distinct_bodies} "
                     f"distinct chat bodies; concurrency {list(s.concurrency)}, bodies {list(s.body_sizes)} B, "
                     f"streaming {list(s.streaming)}; {s.rounds} rounds of {s.duration_s} s"),
        "runs": [r.to_json() for r in results],
        "measurements": [m.to_json() for m in measurements],
        "streams": streams.to_json() if streams else None,
        "settings": asdict(s),
        "backend_urls": list(backend_urls),
        "command": command,
        "versions": versions(statuses),
        "skipped": skipped,
        "machine": machine_facts(),
        "notes": {"added_latency": "median over rounds of (router - direct) in the same round, ms; in cells of "
                                   "concurrency <= settings.paired_direct_up_to, direct is the run right before "
                                   "the router's (its paired_with)",
                  "ttft": "not measured: wrk times whole responses",
                  "cpu": "utime+stime of the router's process tree / requests completed"},
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(orjson.dumps(doc, option=orjson.OPT_INDENT_2))


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
