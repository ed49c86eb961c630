"""Soak: mixed streaming traffic through ``prefixroute serve`` while engine instances are
killed (SIGKILL) and restarted at random, for a bounded duration.

    python bench/soak.py --duration 600            # the 10-minute run in docs/RELIABILITY.md
    python bench/soak.py --duration 60 --json soak.json

It starts ``--instances`` emulated vLLM engines (``prefixroute emulate``) and the router
(``prefixroute serve``, PREFIX_AWARE, active health checks) as child processes, then
``--concurrency`` clients send a mix of OpenAI chat/completions (streaming and not),
SageMaker ``/invocations`` (raw and streamed) and ``invocations-response-stream``
requests; some clients leave on purpose at random points (before the answer, in the
middle of their own request body, mid-stream, after leaving a stream unread for a
while) and some read slowly. Meanwhile an engine is killed every
few seconds and restarted on its port after a short outage (at least one stays up).

Every request ends in exactly one class:

* ``succeeded``: 200 and a complete answer (a JSON completion; a stream ending with
  ``data: [DONE]``; an event stream of PayloadParts ending with ``[DONE]``);
* ``failed with a clear error``: an error status with an error body in the API's shape,
  a stream ended by an error event (``data: {"error": ...}`` or ``ModelStreamError``),
  or a transfer the router cut (the client's HTTP library reports a truncated body);
* ``aborted by the client``: the client went away on purpose;
* ``hung``: no end within ``--hang-after`` seconds (must be 0);
* ``unclear``: anything else, e.g. a 200 with a broken body (must be 0).

At the end (engines all back, clients stopped) it reads the router's in-flight gauges
(``leaked in-flight``, must be 0) and its peak RSS (``VmHWM``), stops it with SIGTERM,
prints a table and, with ``--json``, writes the SPEC §7 shape with the soak's counts as
extra fields. Exit status 0 when hung, unclear and leaked are all 0.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import signal
import statistics
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Sequence

import aiohttp

from prefixroute.demo.processes import Child, ProcessGroup

__all__ = ["main", "run_soak", "SoakResult"]

MODEL = "meta-llama/Llama-3.1-70B-Instruct"
DOCS = 24
DOC_CHARS = 2400
_KINDS = (("chat_stream", 30), ("chat", 12), ("completions_stream", 10), ("native", 10), ("native_stream", 10),
          ("response_stream", 12), ("abort_mid_stream", 6), ("abort_before_headers", 4), ("abort_mid_body", 3),
          ("slow_reader", 4), ("stalled_reader", 3))
#: What the clients that misbehave on purpose do:
#: abort_before_headers: send a streamed chat request, leave 0-40 ms later (while it is
#: routed, connecting or waiting for the engine); abort_mid_body: send the head and half of
#: the body, then leave; slow_reader: read a stream 64 bytes at a time, 5 ms apart (it
#: succeeds); stalled_reader: read the head, stop reading for 0.2-3 s, then leave.
_ABORTING = ("abort_mid_stream", "abort_before_headers", "abort_mid_body", "stalled_reader")


@dataclass
class SoakResult:
    """What one soak run observed."""

    duration_s: float = 0.0
    instances: int = 0
    concurrency: int = 0
    kills: int = 0
    restarts: int = 0
    sent: int = 0
    succeeded: int = 0
    failed_clear: int = 0
    aborted_by_client: int = 0
    hung: int = 0
    unclear: int = 0
    leaked_in_flight: int = -1
    peak_rss_bytes: int = 0
    start_rss_bytes: int = 0
    end_rss_bytes: int = 0
    router_exit_code: int | None = None
    failures: Counter = field(default_factory=Counter)
    unclear_examples: list[str] = field(default_factory=list)
    ttft_s: list[float] = field(default_factory=list)
    latency_s: list[float] = field(default_factory=list)
    served_by: Counter = field(default_factory=Counter)

    @property
    def ok(self) -> bool:
        return self.hung == 0 and self.unclear == 0 and self.leaked_in_flight == 0


def _proc_status(pid: int) -> dict[str, int]:
    out = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(("VmHWM:", "VmRSS:")):
                    name, value = line.split(":", 1)
                    out[name] = int(value.split()[0]) * 1024
    except OSError:
        pass
    return out


def _sse_data(body: bytes) -> list[bytes]:
    return [line[6:] for line in body.split(b"\n") if line.startswith(b"data: ")]


def _event_stream(body: bytes) -> tuple[bytes, str | None]:
    """PayloadPart bytes joined, and the exception type that ended the stream (if any)."""
    from botocore.eventstream import EventStreamBuffer

    buf = EventStreamBuffer()
    buf.add_data(body)
    parts, error = [], None
    for msg in buf:
        if msg.headers.get(":message-type") == "event":
            parts.append(msg.payload)
        else:
            error = str(msg.headers.get(":exception-type") or msg.headers.get(":error-code"))
    return b"".join(parts), error


class _Client:
    def __init__(self, url: str, rng: random.Random, result: SoakResult, hang_after: float) -> None:
        self.url = url
        self.rng = rng
        self.r = result
        self.hang_after = hang_after
        self.docs = [f"[document {d}] " + ("Routing keeps caches warm. " * (DOC_CHARS // 27)) for d in range(DOCS)]

    def _request(self, kind: str) -> tuple[str, dict[str, Any] | bytes]:
        doc = self.rng.choice(self.docs)
        question = f"question {self.rng.randrange(10**6)}"
        max_tokens = self.rng.randrange(4, 48)
        stream = kind.endswith("stream")
        messages = [{"role": "system", "content": doc}, {"role": "user", "content": question}]
        if kind in ("chat", "chat_stream", *_ABORTING, "slow_reader"):
            return "/v1/chat/completions", {"model": MODEL, "messages": messages, "max_tokens": max_tokens,
                                            "stream": stream or kind != "chat"}
        if kind == "completions_stream":
            return "/v1/completions", {"model": MODEL, "prompt": doc + question, "max_tokens": max_tokens,
                                       "stream": True}
        body = json.dumps({"messages": messages, "max_tokens": max_tokens, "stream": stream}).encode()
        path = "/endpoints/default/invocations-response-stream" if kind == "response_stream" else "/invocations"
        return path, body

    async def one(self, http: aiohttp.ClientSession) -> None:
        kinds, weights = zip(*_KINDS)
        kind = self.rng.choices(kinds, weights)[0]
        path, payload = self._request(kind)
        self.r.sent += 1
        t0 = time.monotonic()
        try:
            async with asyncio.timeout(self.hang_after):
                await self._send(http, kind, path, payload, t0)
        except TimeoutError:
            self.r.hung += 1

    def _fail(self, why: str) -> None:
        self.r.failed_clear += 1
        self.r.failures[why] += 1

    def _unclear(self, why: str) -> None:
        self.r.unclear += 1
        if len(self.r.unclear_examples) < 10:
            self.r.unclear_examples.append(why)

    async def _abort_mid_body(self, path: str, payload: Any) -> None:
        """The head and half of the body, then the connection closed."""
        body = json.dumps(payload).encode()
        host, port = self.url.removeprefix("http://").rsplit(":", 1)
        _, writer = await asyncio.open_connection(host, int(port))
        writer.write(f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(body)}\r\n\r\n".encode() + body[:len(body) // 2])
        await writer.drain()
        await asyncio.sleep(self.rng.random() * 0.05)
        writer.close()
        self.r.aborted_by_client += 1

    async def _send(self, http: aiohttp.ClientSession, kind: str, path: str, payload: Any, t0: float) -> None:
        kw: dict[str, Any] = {"json": payload} if isinstance(payload, dict) else {
            "data": payload, "headers": {"Content-Type": "application/json"}}
        if kind == "abort_mid_body":
            await self._abort_mid_body(path, payload)
            return
        if kind == "abort_before_headers":
            task = asyncio.ensure_future(http.post(self.url + path, **kw))
            await asyncio.sleep(self.rng.random() * 0.04)
            if task.done() and not task.cancelled() and task.exception() is None:
                task.result().close()  # it answered first: leave mid-answer instead
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
            self.r.aborted_by_client += 1
            return
        try:
            async with http.post(self.url + path, **kw) as resp:
                if resp.status != 200:
                    body = await resp.read()
                    self._classify_error(resp, body)
                    return
                self.r.served_by[resp.headers.get("X-Prefixroute-Instance", "?")] += 1
                if kind == "abort_mid_stream":
                    await resp.content.readuntil(b"\n\n")
                    await asyncio.sleep(self.rng.random() * 0.05)
                    resp.close()
                    self.r.aborted_by_client += 1
                    return
                if kind == "stalled_reader":
                    await asyncio.sleep(0.2 + self.rng.random() * 2.8)
                    resp.close()
                    self.r.aborted_by_client += 1
                    return
                if kind == "slow_reader":
                    parts = []
                    while True:
                        part = await resp.content.read(64)
                        if not part:
                            break
                        if not parts:
                            self.r.ttft_s.append(time.monotonic() - t0)
                        parts.append(part)
                        await asyncio.sleep(0.005)
                    self.r.latency_s.append(time.monotonic() - t0)
                    self._classify_ok("chat_stream", b"".join(parts))
                    return
                first = await resp.content.read(1)
                self.r.ttft_s.append(time.monotonic() - t0)
                body = first + await resp.read()
        except (aiohttp.ClientPayloadError, aiohttp.ServerDisconnectedError) as exc:
            self._fail(f"truncated transfer ({type(exc).__name__})")
            return
        except aiohttp.ClientConnectionError as exc:
            self._fail(f"connection error ({type(exc).__name__})")
            return
        except asyncio.IncompleteReadError:  # readuntil on a cut stream
            self._fail("truncated transfer (IncompleteReadError)")
            return
        self.r.latency_s.append(time.monotonic() - t0)
        self._classify_ok(kind, body)

    def _classify_error(self, resp: aiohttp.ClientResponse, body: bytes) -> None:
        try:
            doc = json.loads(body)
        except ValueError:
            self._unclear(f"{resp.status} with a non-JSON body {body[:80]!r}")
            return
        if isinstance(doc, dict) and isinstance(doc.get("error"), dict) and doc["error"].get("message"):
            self._fail(f"{resp.status} {doc['error'].get('code') or doc['error'].get('type')}")
        elif isinstance(doc, dict) and doc.get("message") and resp.headers.get("x-amzn-ErrorType"):
            self._fail(f"{resp.status} {resp.headers['x-amzn-ErrorType']}")
        else:
            self._unclear(f"{resp.status} with an unshaped error {body[:80]!r}")

    def _classify_ok(self, kind: str, body: bytes) -> None:
        if kind == "response_stream":
            payload, error = _event_stream(body)
            if error:
                self._fail(f"event stream ended by {error}")
                return
            body = payload
            kind = "native_stream"
        if kind in ("chat", "native"):
            try:
                doc = json.loads(body)
                ok = bool(doc["choices"])
            except (ValueError, KeyError, TypeError):
                self._unclear(f"{kind}: 200 with a broken body {body[:80]!r}")
                return
            if ok:
                self.r.succeeded += 1
            return
        data = _sse_data(body)
        if data and data[-1] == b"[DONE]":
            self.r.succeeded += 1
        elif data and data[-1].startswith(b'{"error"'):
            self._fail("stream ended by an error event")
        else:
            self._unclear(f"{kind}: stream without [DONE] or error event, tail {body[-80:]!r}")


class _Fleet:
    """The engines and the router as child processes."""

    def __init__(self, group: ProcessGroup, instances: int, time_scale: float, seed: int) -> None:
        self.group = group
        self.time_scale = time_scale
        self.ports: list[int] = []
        self.engines: list[Child | None] = []
        self.router: Child | None = None
        self.n = instances
        self.seed = seed

    def _engine_args(self, i: int, port: int) -> list[str]:
        return ["emulate", "--port", str(port), "--time-scale", str(self.time_scale), "--instance-id", f"soak-{i}",
                "--log-level", "warning"]

    def start(self) -> None:
        for i in range(self.n):
            child = self.group.start(f"engine-{i}", self._engine_args(i, 0))
            self.engines.append(child)
            self.ports.append(int(child.url.rsplit(":", 1)[1]))
        backends = [a for p in self.ports for a in ("--backend", f"http://127.0.0.1:{p}")]
        self.router = self.group.start("router", [
            "serve", *backends, "--port", "0", "--admin-port", "0", "--strategy", "prefix-aware",
            "--prefix-length", "2048", "--concurrency-threshold", "8", "--health-check-interval", "0.5",
            "--health-check-timeout", "0.5", "--unhealthy-threshold", "1", "--healthy-threshold", "1",
            "--connect-timeout", "1", "--response-headers-timeout", "30", "--stream-idle-timeout", "10",
            "--metrics-scrape-interval", "2", "--shutdown-timeout", "10", "--client-send-timeout", "2",
            "--seed", str(self.seed),
            "--log-level", "error"])

    def kill(self, i: int) -> None:
        child = self.engines[i]
        if child is not None and child.proc.poll() is None:
            try:
                os.killpg(child.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            child.proc.wait(timeout=10)
            self.group.children.remove(child)
        self.engines[i] = None

    def restart(self, i: int) -> None:
        for attempt in range(20):  # the port may linger for an instant after the kill
            try:
                self.engines[i] = self.group.start(f"engine-{i}", self._engine_args(i, self.ports[i]))
                return
            except Exception:
                if attempt == 19:
                    raise
                time.sleep(0.25)

    def alive(self) -> list[int]:
        return [i for i, c in enumerate(self.engines) if c is not None]


async def _chaos(fleet: _Fleet, rng: random.Random, stop: asyncio.Event, result: SoakResult,
                 kill_every: tuple[float, float], down_for: tuple[float, float]) -> None:
    while not stop.is_set():
        try:
            await asyncio.wait_for(stop.wait(), rng.uniform(*kill_every))
            return
        except TimeoutError:
            pass
        alive = fleet.alive()
        if len(alive) <= 1:
            continue
        victim = rng.choice(alive)
        await asyncio.to_thread(fleet.kill, victim)
        result.kills += 1
        try:
            await asyncio.wait_for(stop.wait(), rng.uniform(*down_for))
        except TimeoutError:
            pass
        await asyncio.to_thread(fleet.restart, victim)
        result.restarts += 1


async def _in_flight(http: aiohttp.ClientSession, url: str) -> int:
    async with http.get(url + "/metrics") as r:
        text = await r.text()
    total = 0.0
    for line in text.splitlines():
        if line.startswith("prefixroute_in_flight{"):
            total += float(line.rsplit(" ", 1)[1])
    return int(total)


async def run_soak(duration_s: float, instances: int = 3, concurrency: int = 16, seed: int = 1,
                   time_scale: float = 0.05, hang_after_s: float = 60.0,
                   kill_every_s: tuple[float, float] = (3.0, 8.0), down_for_s: tuple[float, float] = (1.0, 4.0),
                   progress: bool = True) -> SoakResult:
    """Run one soak; see the module docstring."""
    result = SoakResult(duration_s=duration_s, instances=instances, concurrency=concurrency)
    rng = random.Random(seed)
    with ProcessGroup() as group:
        fleet = _Fleet(group, instances, time_scale, seed)
        await asyncio.to_thread(fleet.start)
        assert fleet.router is not None
        url = fleet.router.url
        pid = fleet.router.proc.pid
        result.start_rss_bytes = _proc_status(pid).get("VmRSS", 0)
        stop = asyncio.Event()
        deadline = time.monotonic() + duration_s
        connector = aiohttp.TCPConnector(limit=concurrency * 2)
        async with aiohttp.ClientSession(connector=connector) as http:
            async def worker(w: int) -> None:
                client = _Client(url, random.Random(seed * 1000 + w), result, hang_after_s)
                while time.monotonic() < deadline:
                    await client.one(http)

            async def report() -> None:
                while not stop.is_set():
                    try:
                        await asyncio.wait_for(stop.wait(), 10)
                    except TimeoutError:
                        left = deadline - time.monotonic()
                        print(f"  soak: {result.sent} sent, {result.succeeded} ok, {result.failed_clear} failed, "
                              f"{result.hung} hung, {result.kills} kills, {max(left, 0):.0f} s left",
                              file=sys.stderr, flush=True)

            chaos = asyncio.create_task(_chaos(fleet, rng, stop, result, kill_every_s, down_for_s))
            reporter = asyncio.create_task(report()) if progress else None
            await asyncio.gather(*(worker(w) for w in range(concurrency)))
            stop.set()
            await chaos
            if reporter is not None:
                await reporter
            for i in range(instances):  # every engine back before the final reading
                if fleet.engines[i] is None:
                    await asyncio.to_thread(fleet.restart, i)
            leaked = await _in_flight(http, url)
            t_end = time.monotonic() + 10
            while leaked and time.monotonic() < t_end:
                await asyncio.sleep(0.2)
                leaked = await _in_flight(http, url)
            result.leaked_in_flight = leaked
        status = _proc_status(pid)
        result.peak_rss_bytes = status.get("VmHWM", 0)
        result.end_rss_bytes = status.get("VmRSS", 0)
        fleet.router.proc.send_signal(signal.SIGTERM)
        try:
            result.router_exit_code = await asyncio.to_thread(fleet.router.proc.wait, 20)
        except Exception:
            result.router_exit_code = None
    return result


def _pct(n: int, d: int) -> str:
    return f"{100 * n / d:.1f} %" if d else "-"


def format_table(r: SoakResult) -> str:
    """The soak's report as a plain-text table."""
    mib = 1024 * 1024
    lines = [
        f"prefixroute soak: {r.duration_s:.0f} s, {r.instances} instances, {r.concurrency} concurrent clients, "
        f"{r.kills} kills / {r.restarts} restarts",
        f"  requests sent              {r.sent:>8}",
        f"  succeeded                  {r.succeeded:>8}   {_pct(r.succeeded, r.sent)}",
        f"  failed with a clear error  {r.failed_clear:>8}   {_pct(r.failed_clear, r.sent)}",
        f"  aborted by the client      {r.aborted_by_client:>8}   (on purpose)",
        f"  hung                       {r.hung:>8}   (must be 0)",
        f"  unclear outcome            {r.unclear:>8}   (must be 0)",
        f"  leaked in-flight           {r.leaked_in_flight:>8}   (must be 0)",
        f"  router peak RSS            {r.peak_rss_bytes / mib:>8.1f} MiB (at start {r.start_rss_bytes / mib:.1f}, "
        f"at end {r.end_rss_bytes / mib:.1f})",
        f"  router exit on SIGTERM     {r.router_exit_code!s:>8}",
    ]
    if r.ttft_s:
        q = statistics.quantiles(r.ttft_s, n=10) if len(r.ttft_s) > 1 else [r.ttft_s[0]] * 9
        lines.append(f"  client TTFT p50 / p90      {statistics.median(r.ttft_s) * 1e3:>8.1f} / {q[8] * 1e3:.1f} ms")
    if r.failures:
        lines.append("  clear errors by kind:")
        lines += [f"    {n:>6}  {why}" for why, n in r.failures.most_common()]
    if r.unclear_examples:
        lines.append("  unclear examples:")
        lines += [f"    {e}" for e in r.unclear_examples]
    return "\n".join(lines)


def to_json(r: SoakResult) -> dict[str, Any]:
    """The SPEC §7 shape, with the soak's own counts as extra fields."""
    served = sum(r.served_by.values())
    ttft = sorted(r.ttft_s)
    lat = sorted(r.latency_s)

    def q(xs: list[float], p: float) -> float | None:
        return xs[min(len(xs) - 1, int(p * len(xs)))] if xs else None

    return {
        "workload": f"soak duration_s={r.duration_s:g} instances={r.instances} concurrency={r.concurrency} "
                    f"kills={r.kills}",
        "runs": [{
            "router": "prefixroute", "strategy": "PREFIX_AWARE", "replicas": 1,
            "requests": r.sent, "errors": r.failed_clear + r.hung + r.unclear,
            "p50_ttft_s": q(ttft, 0.5), "p90_ttft_s": q(ttft, 0.9), "p50_latency_s": q(lat, 0.5),
            "cache_hit_rate": None, "throughput_rps": r.sent / r.duration_s if r.duration_s else None,
            "instance_share": [n / served for _, n in sorted(r.served_by.items())] if served else [],
            "succeeded": r.succeeded, "failed_clear": r.failed_clear, "aborted_by_client": r.aborted_by_client,
            "hung": r.hung, "unclear": r.unclear, "leaked_in_flight": r.leaked_in_flight,
            "peak_rss_bytes": r.peak_rss_bytes, "kills": r.kills, "restarts": r.restarts,
            "router_exit_code": r.router_exit_code, "failures": dict(r.failures),
        }],
    }


def main(argv: Sequence[str] | None = None) -> int:
    """Run the soak from the command line; exit status 0 if nothing hung or leaked."""
    p = argparse.ArgumentParser(prog="bench/soak.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--duration", type=float, default=600.0, help="seconds of traffic (default: 600)")
    p.add_argument("--instances", type=int, default=3, help="emulated engines (default: 3)")
    p.add_argument("--concurrency", type=int, default=16, help="concurrent clients (default: 16)")
    p.add_argument("--time-scale", type=float, default=0.05,
                   help="engines' wall seconds per modelled second (default: 0.05, 20x faster than real time)")
    p.add_argument("--hang-after", type=float, default=60.0, help="seconds after which a request counts as hung")
    p.add_argument("--seed", type=int, default=1, help="seed of the traffic and of the kills (default: 1)")
    p.add_argument("--json", metavar="PATH", help="write the results (SPEC section 7 shape) to PATH")
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    args = p.parse_args(argv)
    if args.duration <= 0 or args.instances < 2 or args.concurrency < 1:
        p.error("--duration must be > 0, --instances >= 2, --concurrency >= 1")
    result = asyncio.run(run_soak(args.duration, args.instances, args.concurrency, args.seed, args.time_scale,
                                  args.hang_after, progress=not args.quiet))
    print(format_table(result))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(to_json(result), f, indent=2)
    return 0 if result.ok else 1


if __name__ == "__main__":
    sys.exit(main())
