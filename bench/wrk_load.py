"""The load generator of ``bench/overhead.py`` (and ``bench/gateway.py``,
``bench/cpu_split.py``): ``wrk`` found or installed with ``apt-get``, run as a tracked
process with a Lua script that POSTs JSON bodies read from files, cycling over them, and
its summary read back as a :class:`WrkResult`.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

from peer_install import PeerStatus
from peer_process import PeerError, ProcessTracker

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
