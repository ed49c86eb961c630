"""Starting ``bench/fast_backend.py`` for a benchmark: on fixed ports when they are free
(so the instances' URLs, and the rendezvous placement of the test bodies, are the same
from run to run), else on free ones; its URLs, stand-in KV-event endpoints and
``GET /stats`` counters (:class:`FastBackend`).
"""

from __future__ import annotations

import json
import os
import re
import socket
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from fast_backend import EXIT_CANNOT_LISTEN
from peer_process import ManagedProcess, PeerError, ProcessTracker

FAST_BACKEND = Path(__file__).resolve().parent / "fast_backend.py"
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
