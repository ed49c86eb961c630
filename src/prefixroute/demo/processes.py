"""Start and stop local ``prefixroute emulate`` / ``prefixroute serve`` processes.

Each child prints one line ``prefixroute-<what> listening on http://HOST:PORT`` when
ready (``--port 0`` lets it pick a free port). :class:`ProcessGroup` owns every child
it started and stops them all on exit, on error and on Ctrl-C (SIGTERM, then SIGKILL
after a grace period).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import re
import selectors
import shutil
import signal
import subprocess
import sys
import time
import weakref
from dataclasses import dataclass, field
from typing import Sequence

__all__ = ["Child", "ProcessGroup", "StartupError"]

_READY = re.compile(r"prefixroute-(\w+) listening on (http://\S+)")


class StartupError(RuntimeError):
    """A child exited or did not report ready in time; the message has its last output."""


@dataclass
class Child:
    """A started child process and the URL it reported."""

    name: str
    proc: subprocess.Popen[str]
    url: str
    extra_urls: dict[str, str] = field(default_factory=dict)


class ProcessGroup:
    """Owns child processes; a context manager that stops them all on exit."""

    def __init__(self) -> None:
        self.children: list[Child] = []
        #: Files or directories the children used (a shared KV tier's file), removed
        #: once every child has stopped.
        self.cleanup_paths: list[str] = []
        self._closed = False
        _LIVE.add(self)

    def start(self, name: str, args: Sequence[str], ready_timeout_s: float = 30.0, ready_lines: int = 1,
              command: Sequence[str] | None = None) -> Child:
        """Run ``python -m prefixroute ARGS`` and wait for its ``listening on`` line(s).

        Args:
            name: a label for errors.
            args: the subcommand and its flags.
            ready_timeout_s: how long to wait for readiness, seconds.
            ready_lines: how many ``listening on`` lines to wait for (the router prints
                one for traffic and one for its admin listener).
            command: run this argv instead of ``python -m prefixroute ARGS`` (``args``
                is then ignored); it must print the same ``listening on`` line.

        Raises:
            StartupError: the child exited or was not ready within the timeout.
        """
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        proc = subprocess.Popen(
            list(command) if command is not None else [sys.executable, "-m", "prefixroute", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            errors="replace",  # a stray byte in a child's output must not stop the draining thread
            env=env,
            start_new_session=True,  # Ctrl-C reaches us; we stop the children ourselves
        )
        child = Child(name, proc, "")
        self.children.append(child)
        if self._closed:  # closed while this thread was starting the child
            self.stop(child)
            raise StartupError(f"{name}: the process group was closed")
        assert proc.stdout is not None
        # Read the pipe's bytes ourselves: readline() on the text wrapper may take two
        # lines in one read, and the second would then sit in its buffer while select()
        # waits for more (a router prints its two lines at once).
        fd = proc.stdout.fileno()
        sel = selectors.DefaultSelector()
        sel.register(fd, selectors.EVENT_READ)
        deadline = time.monotonic() + ready_timeout_s
        seen: list[str] = []
        pending = b""
        found = 0
        eof = False
        try:
            while found < ready_lines and not eof:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise StartupError(f"{name} not ready after {ready_timeout_s:.0f} s; output:\n" + "".join(seen[-20:]))
                if not sel.select(timeout=min(left, 0.5)):
                    if proc.poll() is not None:
                        break
                    continue
                # Raw reads (a buffered readline would take the lines after this one
                # into its buffer, where select() no longer sees them).
                data = os.read(fd, 65536)
                eof = not data
                pending += data
                *lines, pending = pending.split(b"\n")
                for raw in lines:
                    line = raw.decode("utf-8", "replace") + "\n"
                    seen.append(line)
                    m = _READY.search(line)
                    if m and found < ready_lines:
                        if not child.url:
                            child.url = m.group(2)
                        else:
                            child.extra_urls[m.group(1) + str(found)] = m.group(2)
                        found += 1
            if found < ready_lines:
                proc.wait(timeout=5)
                raise StartupError(f"{name} exited with code {proc.returncode}; output:\n" + "".join(seen[-20:]))
        finally:
            sel.close()
        # Keep draining output so a chatty child never blocks on a full pipe.
        _drain(proc)
        return child

    def stop(self, child: Child, grace_s: float = 5.0) -> None:
        """Stop one child: SIGTERM, then SIGKILL after ``grace_s`` seconds."""
        proc = child.proc
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.wait(timeout=5)
        if child in self.children:
            self.children.remove(child)

    def stop_all(self) -> None:
        """Stop every child still running (in parallel: SIGTERM all, then wait)."""
        for c in self.children:
            if c.proc.poll() is None:
                try:
                    os.killpg(c.proc.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        for c in list(self.children):
            self.stop(c)
        paths, self.cleanup_paths = self.cleanup_paths, []
        for path in paths:
            if os.path.isdir(path):
                shutil.rmtree(path, ignore_errors=True)
            elif os.path.exists(path):
                with contextlib.suppress(OSError):
                    os.unlink(path)

    def close(self) -> None:
        """Stop every child and refuse to start new ones."""
        self._closed = True
        self.stop_all()
        _LIVE.discard(self)

    def __enter__(self) -> "ProcessGroup":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_LIVE: "weakref.WeakSet[ProcessGroup]" = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    # Last resort: whatever way the interpreter exits, no child outlives it.
    for group in list(_LIVE):
        group.close()


def _drain(proc: subprocess.Popen[str]) -> None:
    import threading

    def pump() -> None:
        assert proc.stdout is not None
        for _ in proc.stdout:
            pass

    threading.Thread(target=pump, daemon=True).start()
