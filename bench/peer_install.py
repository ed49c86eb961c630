"""Installing the peer routers of ``bench/peers.py``, which are never dependencies of the
project: :func:`ensure_python_peers` installs them into a virtual environment of their own
(by default ``~/.cache/prefixroute-bench/peers-venv``, reused when present) and
:func:`ensure_haproxy` installs HAProxy with ``apt-get`` when it is missing. Each
returns a :class:`PeerStatus` per peer; a benchmark skips the peers that are not
available and prints why.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence


#: Where the peers' virtual environment lives unless told otherwise.
DEFAULT_PEERS_VENV = Path(os.environ.get("PREFIXROUTE_PEERS_VENV",
                                         Path.home() / ".cache" / "prefixroute-bench" / "peers-venv"))

#: PyPI requirement of each Python-packaged peer. Pinned to the versions the published
#: results were measured with, so a rerun measures the same routers.
PYTHON_PEERS: dict[str, str] = {
    "sglang-router": "sglang-router==0.3.2",
    "vllm-router": "vllm-router==0.1.17",
}


@dataclass(frozen=True)
class PeerStatus:
    """Whether a peer can run here.

    Attributes:
        name: ``sglang-router``, ``vllm-router`` or ``haproxy``.
        available: True when it is installed and runs.
        detail: its version when available, else why not (printed by the benchmark).
        executable: the program to run (a path), "" when not available.
    """

    name: str
    available: bool
    detail: str
    executable: str = ""


# -- installation ---------------------------------------------------------------------------


def _run(argv: Sequence[str], timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout)


def _last_lines(text: str, n: int = 6) -> str:
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    return " | ".join(lines[-n:])


def ensure_python_peers(venv: Path = DEFAULT_PEERS_VENV, peers: dict[str, str] | None = None,
                        install: bool = True, log: Callable[[str], None] = print) -> dict[str, PeerStatus]:
    """Make ``sglang-router`` and ``vllm-router`` runnable from their own virtual environment.

    Creates ``venv`` if it does not exist and ``pip install``\\ s each missing peer into it,
    one at a time so that one failure does not hide the others. A peer counts as
    available when its package imports/its program answers ``--help``.

    Args:
        venv: the peers' virtual environment (never the project's).
        peers: ``{name: pip requirement}``; default :data:`PYTHON_PEERS`.
        install: False to only look, never install.
        log: progress messages.

    Returns:
        ``{name: PeerStatus}`` for every peer asked for.
    """
    peers = dict(PYTHON_PEERS if peers is None else peers)
    python = venv / "bin" / "python"
    out: dict[str, PeerStatus] = {}
    if not python.exists():
        if not install:
            return {n: PeerStatus(n, False, f"no virtual environment at {venv} (run without --no-install)")
                    for n in peers}
        log(f"creating the peers' virtual environment {venv}")
        venv.parent.mkdir(parents=True, exist_ok=True)
        try:
            proc = _run([sys.executable, "-m", "venv", str(venv)], timeout=300)
        except (OSError, subprocess.TimeoutExpired) as exc:
            proc = subprocess.CompletedProcess([], 1, "", str(exc))
        if proc.returncode != 0:
            why = f"cannot create virtual environment {venv}: {_last_lines(proc.stderr + proc.stdout)}"
            return {n: PeerStatus(n, False, why) for n in peers}
    for name, requirement in peers.items():
        status = _python_peer_status(venv, name, requirement)
        if not status.available and install:
            log(f"installing {requirement} into {venv}")
            try:
                proc = _run([str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check", requirement],
                            timeout=900)
            except (OSError, subprocess.TimeoutExpired) as exc:
                proc = subprocess.CompletedProcess([], 1, "", str(exc))
            if proc.returncode != 0:
                out[name] = PeerStatus(name, False, f"pip install {requirement} failed: "
                                                    f"{_last_lines(proc.stderr + proc.stdout)}")
                continue
            status = _python_peer_status(venv, name, requirement)
        out[name] = status
    return out


def _python_peer_status(venv: Path, name: str, requirement: str) -> PeerStatus:
    python = venv / "bin" / "python"
    wanted = requirement.partition("==")[2]
    try:
        proc = _run([str(python), "-m", "pip", "show", name], timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return PeerStatus(name, False, f"pip show {name} failed: {exc}")
    m = re.search(r"^Version:\s*(\S+)", proc.stdout, re.M)
    if proc.returncode != 0 or not m:
        return PeerStatus(name, False, f"{name} is not installed in {venv}")
    version = m.group(1)
    if wanted and version != wanted:
        return PeerStatus(name, False, f"{name} {version} is installed, {wanted} is wanted")
    if name == "vllm-router":
        exe = venv / "bin" / "vllm-router"
        argv = [str(exe), "--help"]
    else:
        exe = python
        argv = [str(python), "-m", "sglang_router.launch_router", "--help"]
    try:
        probe = _run(argv, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return PeerStatus(name, False, f"{name} {version} is installed but does not run: {exc}")
    if probe.returncode != 0:
        return PeerStatus(name, False, f"{name} {version} is installed but `{' '.join(argv[-3:])}` failed: "
                                       f"{_last_lines(probe.stderr + probe.stdout)}")
    return PeerStatus(name, True, f"{name} {version}", str(exe))


def find_haproxy() -> str | None:
    """The ``haproxy`` program on PATH or in /usr/sbin, or None."""
    return shutil.which("haproxy") or next((p for p in ("/usr/sbin/haproxy", "/usr/local/sbin/haproxy")
                                            if os.access(p, os.X_OK)), None)


def ensure_haproxy(install: bool = True, log: Callable[[str], None] = print) -> PeerStatus:
    """Find HAProxy (2.6 or newer, for ``balance hash``), installing the Debian package
    with ``apt-get`` when it is missing and we are root.

    Returns:
        The :class:`PeerStatus` of ``haproxy``.
    """
    exe = find_haproxy()
    if exe is None and install:
        if not shutil.which("apt-get"):
            return PeerStatus("haproxy", False, "haproxy is not installed and there is no apt-get to install it")
        if os.geteuid() != 0:
            return PeerStatus("haproxy", False, "haproxy is not installed; run `apt-get install -y haproxy` as root")
        log("installing haproxy with apt-get")
        env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
        try:
            upd = subprocess.run(["apt-get", "update", "-q"], capture_output=True, text=True, timeout=600, env=env)
            inst = subprocess.run(["apt-get", "install", "-y", "-q", "haproxy"], capture_output=True, text=True,
                                  timeout=900, env=env)
        except (OSError, subprocess.TimeoutExpired) as exc:
            return PeerStatus("haproxy", False, f"apt-get install haproxy failed: {exc}")
        if inst.returncode != 0:
            return PeerStatus("haproxy", False, "apt-get install haproxy failed: "
                                                f"{_last_lines(upd.stderr + inst.stderr + inst.stdout)}")
        exe = find_haproxy()
    if exe is None:
        return PeerStatus("haproxy", False, "haproxy is not installed (apt-get install -y haproxy)")
    try:
        proc = _run([exe, "-v"], timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return PeerStatus("haproxy", False, f"{exe} -v failed: {exc}")
    m = re.search(r"version (\d+)\.(\d+)(\S*)", proc.stdout)
    if not m:
        return PeerStatus("haproxy", False, f"{exe} -v printed no version: {_last_lines(proc.stdout + proc.stderr)}")
    if (int(m.group(1)), int(m.group(2))) < (2, 6):
        return PeerStatus("haproxy", False, f"haproxy {m.group(1)}.{m.group(2)} is too old: `balance hash` "
                                            "on the body needs 2.6 or newer")
    return PeerStatus("haproxy", True, f"haproxy {m.group(1)}.{m.group(2)}{m.group(3)}", exe)
