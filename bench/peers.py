"""Routers to benchmark against: start them in front of a fleet, change the fleet while
they run, stop them. Shared by the benchmarks in this folder.

Routers (each a :class:`RouterSpec`; ``start`` returns a :class:`RunningRouter`):

* :class:`PrefixrouteSpec` — ``prefixroute serve`` with a YAML fleet configuration
  (any strategy, CACHE_AWARE included); membership through its admin API
  (``PUT /admin/config``).
* :class:`SGLangRouterSpec` — the SGLang router (PyPI ``sglang-router``,
  ``python -m sglang_router.launch_router``); membership through ``POST /workers``
  and ``DELETE /workers/{worker_id}``.
* :class:`VLLMRouterSpec` — vLLM's Rust router (PyPI ``vllm-router``); membership
  through ``POST /add_worker?url=`` and ``POST /remove_worker?url=``. Its
  ``consistent_hash`` policy hashes the ``X-Session-ID`` header when a request has one
  (else other identity headers or fields, else the whole body).
* :class:`HAProxySpec` — HAProxy (Debian package) in HTTP mode with ``balance hash``
  on the first ``hash_bytes`` bytes of the request body (``option http-buffer-request``
  makes the body available to the hash), ``hash-type consistent`` and
  ``hash-balance-factor`` (bounded-load consistent hashing: no server takes more than
  factor/100 × the average number of requests in flight). Server-sent events stream
  through unchanged (HTTP mode forwards response data as it arrives). Membership through
  its runtime API on a Unix socket: every server that may ever join is declared, the
  ones not in the fleet yet start ``disabled`` and are switched with ``set server
  BACKEND/NAME state ready|maint``.

Installing the peers is :mod:`peer_install`'s; the processes and the tracker that stops
them, :mod:`peer_process`'s; the commit a benchmark measured, :mod:`checkout`'s.
"""

from __future__ import annotations

import json
import os
import re
import socket
import sys
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import yaml

from peer_install import DEFAULT_PEERS_VENV, find_haproxy
from peer_process import ManagedProcess, PeerError, ProcessTracker, free_port

__all__ = [
    "RouterSpec",
    "RunningRouter",
    "PrefixrouteSpec",
    "SGLangRouterSpec",
    "VLLMRouterSpec",
    "HAProxySpec",
    "prefixroute_fleet_config",
    "haproxy_config",
]


_MODEL = "meta-llama/Llama-3.1-70B-Instruct"


# -- small HTTP helpers (blocking; benchmarks call them from a thread) ------------------------


def _http(method: str, url: str, body: Any = None, timeout: float = 10.0) -> tuple[int, bytes]:
    data = None if body is None else (body if isinstance(body, bytes) else json.dumps(body).encode())
    req = urllib.request.Request(url, data=data, method=method,
                                 headers={"Content-Type": "application/json"} if data is not None else {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def _get_json(url: str, timeout: float = 5.0) -> Any:
    status, body = _http("GET", url, timeout=timeout)
    if status != 200:
        raise ValueError(f"GET {url}: HTTP {status}")
    return json.loads(body)


def _norm(url: str) -> str:
    return url.rstrip("/")


# -- routers ----------------------------------------------------------------------------------


class RunningRouter:
    """One started router process.

    Attributes:
        url: where clients send requests (``http://127.0.0.1:PORT``).
        backends: the instances it routes to now (after membership changes).
    """

    def __init__(self, spec: "RouterSpec", process: ManagedProcess, url: str, backends: Sequence[str]) -> None:
        self.spec = spec
        self.process = process
        self.url = url
        self.backends = [_norm(b) for b in backends]

    def add_backend(self, url: str, timeout_s: float = 30.0) -> None:
        """Start routing to ``url`` too, and return once the router does.

        Raises:
            PeerError: the router refused or did not apply the change in time.
        """
        raise NotImplementedError

    def remove_backend(self, url: str, timeout_s: float = 30.0) -> None:
        """Stop routing new requests to ``url`` (requests in flight finish).

        Raises:
            PeerError: the router refused or did not apply the change in time.
        """
        raise NotImplementedError

    def _wait(self, probe: Callable[[], bool], timeout_s: float, what: str) -> None:
        self.process.wait_ready(probe, timeout_s, what)


@dataclass(frozen=True)
class RouterSpec:
    """How to run one router under test.

    Attributes:
        label: the name in tables and JSON (``"sglang-router cache_aware"``).
        router: the product (``"prefixroute"``, ``"sglang-router"``, ``"vllm-router"``,
            ``"haproxy"``) — SPEC §7's ``router`` field.
        strategy: its policy — SPEC §7's ``strategy`` field.
        peer: the :class:`PeerStatus` name it needs ("" for prefixroute).
    """

    label: str
    router: str
    strategy: str

    @property
    def peer(self) -> str:
        return "" if self.router == "prefixroute" else self.router

    def start(self, tracker: ProcessTracker, backends: Sequence[str], executable: str = "",
              all_backends: Sequence[str] = (), ready_timeout_s: float = 60.0) -> RunningRouter:
        """Start one router process routing to ``backends`` and wait until it routes.

        Args:
            tracker: owns the process.
            backends: instance base URLs it routes to from the start.
            executable: the peer's program (from its :class:`PeerStatus`).
            all_backends: every instance that may join later (HAProxy declares them
                up front); defaults to ``backends``.
            ready_timeout_s: seconds to wait for readiness.

        Raises:
            PeerError: it exited or was not ready in time.
        """
        raise NotImplementedError

    def start_retrying(self, tracker: ProcessTracker, backends: Sequence[str], executable: str = "",
                       all_backends: Sequence[str] = (), ready_timeout_s: float = 60.0,
                       attempts: int = 3) -> RunningRouter:
        """:meth:`start`, again on fresh ports when the router could not bind: a port
        :func:`free_port` found free can be taken by another process before the router
        binds it (seen once in 80 runs of policy_vs_peers)."""
        for attempt in range(attempts):
            try:
                return self.start(tracker, backends, executable, all_backends, ready_timeout_s)
            except PeerError as exc:
                if "in use" not in str(exc) or attempt == attempts - 1:
                    raise
        raise AssertionError("unreachable")

    def start_replicas(self, tracker: ProcessTracker, replicas: int, backends: Sequence[str], executable: str = "",
                       all_backends: Sequence[str] = (), ready_timeout_s: float = 60.0) -> list[RunningRouter]:
        """``replicas`` independent router processes over the same instances (each has its
        own view: nothing is shared between them, as with separate router pods)."""
        out: list[RunningRouter] = []
        try:
            for _ in range(replicas):
                out.append(self.start_retrying(tracker, backends, executable, all_backends, ready_timeout_s))
        except BaseException:
            tracker.stop([r.process for r in out])
            raise
        return out


# prefixroute ------------------------------------------------------------------------------


def prefixroute_fleet_config(backends: Sequence[str], routing: dict[str, Any],
                             kv_events: dict[str, Any] | None = None) -> dict[str, Any]:
    """A one-endpoint, one-variant ``FleetConfig`` document (the YAML ``--config`` and
    ``PUT /admin/config`` shape) routing to ``backends`` with ``routing`` (a SageMaker
    ``RoutingConfig`` dict), and precise mode's ``KvEvents`` section when given."""
    doc: dict[str, Any] = {"Endpoints": [{"EndpointName": "default", "ProductionVariants": [{
        "VariantName": "AllTraffic", "InitialVariantWeight": 1,
        "Instances": [_norm(b) for b in backends], "RoutingConfig": routing}]}]}
    if kv_events is not None:
        doc["KvEvents"] = kv_events
    return doc


_LISTENING = re.compile(r"prefixroute-(serve|admin) listening on (http://\S+)")


@dataclass(frozen=True)
class PrefixrouteSpec(RouterSpec):
    """``prefixroute serve`` with ``routing`` (a SageMaker ``RoutingConfig`` dict, e.g.
    ``{"RoutingStrategy": "PREFIX_AWARE", "PrefixAwareRoutingConfig": {...}}``).

    Attributes:
        routing: the variant's RoutingConfig document.
        extra_args: more ``prefixroute serve`` flags.
        python: the interpreter that has prefixroute installed (default: this one).
        kv_events: precise mode's ``KvEvents`` section (the engines' KV events and
            tokenizer), or ``None``.
    """

    routing: dict[str, Any] = field(default_factory=dict)
    extra_args: tuple[str, ...] = ()
    python: str = sys.executable
    kv_events: dict[str, Any] | None = None

    def start(self, tracker, backends, executable="", all_backends=(), ready_timeout_s=60.0):
        cfg = tracker.path("prefixroute", ".yaml")
        cfg.write_text(yaml.safe_dump(prefixroute_fleet_config(backends, self.routing, self.kv_events),
                                      sort_keys=False))
        argv = [self.python, "-m", "prefixroute", "serve", "--config", str(cfg), "--host", "127.0.0.1",
                "--port", "0", *self.extra_args]  # the admin API then listens on a free port
        proc = tracker.start(f"prefixroute-{self.strategy}", argv, env=dict(os.environ, PYTHONUNBUFFERED="1"))
        urls: dict[str, str] = {}

        def ready() -> bool:
            for m in _LISTENING.finditer(proc.tail(50)):
                urls[m.group(1)] = m.group(2)
            return "serve" in urls and "admin" in urls

        proc.wait_ready(ready, ready_timeout_s, "listening")
        return _PrefixrouteRouter(self, proc, urls["serve"], backends, urls["admin"])


class _PrefixrouteRouter(RunningRouter):
    def __init__(self, spec, process, url, backends, admin_url: str) -> None:
        super().__init__(spec, process, url, backends)
        self.admin_url = admin_url

    def _set_instances(self, instances: list[str]) -> None:
        doc = _get_json(self.admin_url + "/admin/config")
        variant = doc["Endpoints"][0]["ProductionVariants"][0]
        variant["Instances"] = instances
        status, body = _http("PUT", self.admin_url + "/admin/config", doc)
        if status != 200:
            raise PeerError(f"prefixroute PUT /admin/config: HTTP {status}: {body[:300]!r}")
        self.backends = instances

    def add_backend(self, url, timeout_s=30.0):
        if _norm(url) not in self.backends:
            self._set_instances(self.backends + [_norm(url)])

    def remove_backend(self, url, timeout_s=30.0):
        self._set_instances([b for b in self.backends if b != _norm(url)])


# SGLang router ----------------------------------------------------------------------------


@dataclass(frozen=True)
class SGLangRouterSpec(RouterSpec):
    """The SGLang router (``sglang-router``) with ``policy`` and its defaults otherwise
    (``cache_aware``: cache_threshold 0.3, balance_abs_threshold 64,
    balance_rel_threshold 1.5)."""

    extra_args: tuple[str, ...] = ()

    def start(self, tracker, backends, executable="", all_backends=(), ready_timeout_s=60.0):
        python = executable or str(DEFAULT_PEERS_VENV / "bin" / "python")
        port, metrics_port = free_port(), free_port()
        argv = [python, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(port),
                "--worker-urls", *[_norm(b) for b in backends], "--policy", self.strategy,
                "--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port),
                "--log-level", "warn", *self.extra_args]
        proc = tracker.start(f"sglang-router-{self.strategy}", argv)
        router = _SGLangRouter(self, proc, f"http://127.0.0.1:{port}", backends)
        proc.wait_ready(lambda: router._healthy_urls() >= set(router.backends), ready_timeout_s,
                        "routing to every instance")
        return router


class _SGLangRouter(RunningRouter):
    def _workers(self) -> list[dict[str, Any]]:
        return list(_get_json(self.url + "/workers").get("workers") or [])

    def _healthy_urls(self) -> set[str]:
        return {_norm(w["url"]) for w in self._workers() if w.get("is_healthy", True)}

    def add_backend(self, url, timeout_s=30.0):
        url = _norm(url)
        status, body = _http("POST", self.url + "/workers", {"url": url})
        if status not in (200, 201, 202):
            raise PeerError(f"sglang-router POST /workers: HTTP {status}: {body[:300]!r}")
        self._wait(lambda: url in self._healthy_urls(), timeout_s, f"routing to {url}")
        self.backends.append(url)

    def remove_backend(self, url, timeout_s=30.0):
        url = _norm(url)
        ids = [w["id"] for w in self._workers() if _norm(w["url"]) == url]
        if not ids:
            raise PeerError(f"sglang-router has no worker {url}")
        for wid in ids:
            status, body = _http("DELETE", f"{self.url}/workers/{urllib.parse.quote(str(wid), safe='')}")
            if status not in (200, 202, 204):
                raise PeerError(f"sglang-router DELETE /workers/{wid}: HTTP {status}: {body[:300]!r}")
        self._wait(lambda: url not in {_norm(w["url"]) for w in self._workers()}, timeout_s, f"rid of {url}")
        self.backends.remove(url)


# vLLM router ------------------------------------------------------------------------------


@dataclass(frozen=True)
class VLLMRouterSpec(RouterSpec):
    """vLLM's Rust router (``vllm-router``) with ``policy`` and its defaults otherwise."""

    extra_args: tuple[str, ...] = ()

    def start(self, tracker, backends, executable="", all_backends=(), ready_timeout_s=60.0):
        exe = executable or str(DEFAULT_PEERS_VENV / "bin" / "vllm-router")
        port, metrics_port = free_port(), free_port()
        argv = [exe, "--host", "127.0.0.1", "--port", str(port), "--worker-urls", *[_norm(b) for b in backends],
                "--policy", self.strategy, "--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port),
                "--log-level", "warning", *self.extra_args]
        proc = tracker.start(f"vllm-router-{self.strategy}", argv)
        router = _VLLMRouter(self, proc, f"http://127.0.0.1:{port}", backends)
        proc.wait_ready(lambda: router._urls() >= set(router.backends) and router._health(), ready_timeout_s,
                        "routing to every instance")
        return router


class _VLLMRouter(RunningRouter):
    def _urls(self) -> set[str]:
        return {_norm(u) for u in _get_json(self.url + "/list_workers").get("urls") or []}

    def _health(self) -> bool:
        return _http("GET", self.url + "/health", timeout=5)[0] == 200

    def add_backend(self, url, timeout_s=30.0):
        url = _norm(url)
        status, body = _http("POST", f"{self.url}/add_worker?url={urllib.parse.quote(url, safe='')}",
                             timeout=timeout_s)
        if status != 200:
            raise PeerError(f"vllm-router POST /add_worker: HTTP {status}: {body[:300]!r}")
        self._wait(lambda: url in self._urls(), timeout_s, f"routing to {url}")
        self.backends.append(url)

    def remove_backend(self, url, timeout_s=30.0):
        url = _norm(url)
        status, body = _http("POST", f"{self.url}/remove_worker?url={urllib.parse.quote(url, safe='')}",
                             timeout=timeout_s)
        if status != 200:
            raise PeerError(f"vllm-router POST /remove_worker: HTTP {status}: {body[:300]!r}")
        self._wait(lambda: url not in self._urls(), timeout_s, f"rid of {url}")
        self.backends.remove(url)


# HAProxy ----------------------------------------------------------------------------------


def haproxy_config(port: int, backends: Sequence[str], all_backends: Sequence[str], socket_path: str,
                   hash_bytes: int = 4096, balance_factor: int = 150) -> str:
    """An ``haproxy.cfg`` for one HTTP listener on 127.0.0.1:``port``.

    ``balance hash req.body,bytes(0,hash_bytes)`` keys a request by the first
    ``hash_bytes`` bytes of its body (like PREFIX_AWARE's PrefixLength on the native API);
    ``option http-buffer-request`` waits for the body (up to ``tune.bufsize``) before
    choosing. ``hash-type consistent`` keeps keys in place when servers come and go, and
    ``hash-balance-factor`` bounds each server to factor/100 × the average load.
    Servers of ``all_backends`` not in ``backends`` start ``disabled``.

    Raises:
        ValueError: ``hash_bytes`` < 1 or a factor that HAProxy would reject (it needs 0 or > 100).
    """
    if hash_bytes < 1:
        raise ValueError(f"hash_bytes must be >= 1, got {hash_bytes}")
    if balance_factor != 0 and balance_factor <= 100:
        raise ValueError(f"hash-balance-factor must be 0 (off) or > 100, got {balance_factor}")
    active = {_norm(b) for b in backends}
    everyone = list(dict.fromkeys([_norm(b) for b in (all_backends or backends)] + sorted(active)))
    # The buffer must hold the hashed bytes plus the request line and headers.
    bufsize = max(16384, 1 << (hash_bytes + 8192 - 1).bit_length())
    lines = [
        "global",
        "    maxconn 4096",  # 2 file descriptors each: stays under common ulimits
        f"    tune.bufsize {bufsize}",
        f"    stats socket {socket_path} mode 600 level admin",
        "defaults",
        "    mode http",
        "    timeout connect 5s",
        "    timeout client 600s",
        "    timeout server 600s",
        "    timeout http-request 60s",
        # Send each response chunk at once: without it HAProxy merges small writes
        # (MSG_MORE) and server-sent events reach the client only at the end.
        "    option http-no-delay",
        "frontend llm",
        f"    bind 127.0.0.1:{port}",
        "    default_backend fleet",
        "backend fleet",
        "    option http-buffer-request",
        f"    balance hash req.body,bytes(0,{hash_bytes})",
        "    hash-type consistent",
    ]
    if balance_factor:
        lines.append(f"    hash-balance-factor {balance_factor}")
    for i, url in enumerate(everyone):
        parsed = urllib.parse.urlsplit(url)
        if parsed.scheme != "http" or not parsed.hostname or not parsed.port:
            raise ValueError(f"HAProxy needs http://HOST:PORT backends, got {url!r}")
        lines.append(f"    server {_server_name(i)} {parsed.hostname}:{parsed.port}"
                     + ("" if url in active else " disabled"))
    return "\n".join(lines) + "\n"


def _server_name(i: int) -> str:
    return f"s{i}"


@dataclass(frozen=True)
class HAProxySpec(RouterSpec):
    """HAProxy with ``balance hash`` on the body's first ``hash_bytes`` bytes and
    ``hash-balance-factor`` ``balance_factor`` (see :func:`haproxy_config`)."""

    hash_bytes: int = 4096
    balance_factor: int = 150

    def start(self, tracker, backends, executable="", all_backends=(), ready_timeout_s=60.0):
        exe = executable or find_haproxy() or "haproxy"
        port = free_port()
        sock = tracker.path("haproxy", ".sock")
        everyone = list(dict.fromkeys([_norm(b) for b in (all_backends or backends)]))
        cfg = tracker.path("haproxy", ".cfg")
        cfg.write_text(haproxy_config(port, backends, everyone, str(sock), self.hash_bytes, self.balance_factor))
        proc = tracker.start("haproxy", [exe, "-db", "-f", str(cfg)])
        router = _HAProxyRouter(self, proc, f"http://127.0.0.1:{port}", backends, str(sock), everyone)
        proc.wait_ready(lambda: sock.exists() and _port_open(port), ready_timeout_s, "listening")
        return router


def _port_open(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


class _HAProxyRouter(RunningRouter):
    def __init__(self, spec, process, url, backends, socket_path: str, everyone: list[str]) -> None:
        super().__init__(spec, process, url, backends)
        self.socket_path = socket_path
        self.names = {u: _server_name(i) for i, u in enumerate(everyone)}

    def command(self, line: str) -> str:
        """Send one runtime-API command; returns HAProxy's answer."""
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(5)
            s.connect(self.socket_path)
            s.sendall(line.encode() + b"\n")
            chunks = []
            while True:
                d = s.recv(65536)
                if not d:
                    break
                chunks.append(d)
        return b"".join(chunks).decode(errors="replace")

    def _set_state(self, url: str, state: str) -> None:
        name = self.names.get(_norm(url))
        if name is None:
            raise PeerError(f"haproxy: {url} was not declared when it started (all_backends)")
        answer = self.command(f"set server fleet/{name} state {state}").strip()
        if answer:
            raise PeerError(f"haproxy: set server fleet/{name} state {state}: {answer}")

    def add_backend(self, url, timeout_s=30.0):
        self._set_state(url, "ready")
        self.backends.append(_norm(url))

    def remove_backend(self, url, timeout_s=30.0):
        self._set_state(url, "maint")
        self.backends.remove(_norm(url))
