"""The processes the benchmarks start: each in its own session with its output in a log
file (:class:`ManagedProcess`); a :class:`ProcessTracker` stops all of them (SIGTERM,
then SIGKILL after a grace period) on exit, on error and on Ctrl-C, and :func:`run_main`
makes SIGTERM and SIGHUP stop a benchmark like Ctrl-C. :class:`PeerError` says what could
not be started, reconfigured or stopped.
"""

from __future__ import annotations

import atexit
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import weakref
from pathlib import Path
from typing import Callable, Sequence


class PeerError(RuntimeError):
    """A router could not be installed, started, reconfigured or stopped; the message
    says which and includes the end of its log."""


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now (for routers that cannot pick their own)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ManagedProcess:
    """One child process in its own session, its output (stdout and stderr) in ``log_path``."""

    def __init__(self, name: str, argv: Sequence[str], log_path: Path, env: dict[str, str] | None = None) -> None:
        self.name = name
        self.argv = list(argv)
        self.log_path = log_path
        self._log = open(log_path, "wb")
        try:
            self.proc = subprocess.Popen(self.argv, stdout=self._log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, env=env, start_new_session=True)
        except OSError as exc:
            self._log.close()
            raise PeerError(f"{name}: cannot run {self.argv[0]}: {exc}") from None

    def alive(self) -> bool:
        return self.proc.poll() is None

    def tail(self, n: int = 15) -> str:
        """The last ``n`` lines of its output."""
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-n:])

    def wait_ready(self, probe: Callable[[], bool], timeout_s: float, what: str = "ready") -> None:
        """Poll ``probe`` until it returns True.

        Raises:
            PeerError: the process exited or ``probe`` stayed False for ``timeout_s`` seconds.
        """
        deadline = time.monotonic() + timeout_s
        delay = 0.05
        while True:
            if not self.alive():
                raise PeerError(f"{self.name} exited with code {self.proc.returncode}; output:\n{self.tail()}")
            try:
                if probe():
                    return
            except (OSError, ValueError, urllib.error.URLError):
                pass
            if time.monotonic() > deadline:
                raise PeerError(f"{self.name} not {what} after {timeout_s:.0f} s; output:\n{self.tail()}")
            time.sleep(delay)
            delay = min(0.25, delay * 1.5)

    def stop(self, grace_s: float = 5.0) -> None:
        """SIGTERM its process group, SIGKILL after ``grace_s`` seconds."""
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                self.proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                self.proc.wait(timeout=5)
        self._log.close()


class ProcessTracker:
    """Owns started :class:`ManagedProcess`\\ es and a scratch directory for their logs and
    configuration files; a context manager that stops them all on exit."""

    def __init__(self, workdir: Path | None = None) -> None:
        self._own_dir = workdir is None
        self.workdir = Path(tempfile.mkdtemp(prefix="prefixroute-bench-")) if workdir is None else workdir
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.processes: list[ManagedProcess] = []
        self._counter = 0
        _LIVE.add(self)

    def path(self, stem: str, suffix: str) -> Path:
        """A fresh file name in the scratch directory."""
        self._counter += 1
        return self.workdir / f"{self._counter:04d}-{re.sub(r'[^A-Za-z0-9_.-]', '_', stem)}{suffix}"

    def start(self, name: str, argv: Sequence[str], env: dict[str, str] | None = None) -> ManagedProcess:
        p = ManagedProcess(name, argv, self.path(name, ".log"), env)
        self.processes.append(p)
        return p

    def stop(self, procs: Sequence[ManagedProcess], grace_s: float = 5.0) -> None:
        """Stop ``procs`` in parallel (SIGTERM all, then wait for each)."""
        for p in procs:
            if p.alive():
                try:
                    os.killpg(p.proc.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        for p in procs:
            p.stop(grace_s)
            if p in self.processes:
                self.processes.remove(p)

    def close(self) -> None:
        """Stop every process; remove the scratch directory if this tracker made it."""
        self.stop(list(self.processes))
        _LIVE.discard(self)
        if self._own_dir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> "ProcessTracker":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_LIVE: "weakref.WeakSet[ProcessTracker]" = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    for tracker in list(_LIVE):
        tracker.close()


def run_main(main: Callable[[], int]) -> None:
    """Run a benchmark's ``main`` as a program: SIGTERM and SIGHUP stop it like Ctrl-C
    (the :class:`ProcessTracker` stops every child on the way out), exit status 130."""

    def stop(signum: int, _frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, stop)
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        print("interrupted; every process the benchmark started has been stopped", file=sys.stderr)
        sys.exit(130)
