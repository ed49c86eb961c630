"""The git commit of the checkout a benchmark runs from (:func:`source_commit`), which
its JSON names as the code it measured.
"""

from __future__ import annotations

import subprocess
from pathlib import Path


def source_commit(directory: Path | None = None) -> str | None:
    """The short git commit of the checkout holding ``directory`` (default: bench/),
    with ``+uncommitted changes`` when its working tree differs from that commit;
    ``None`` outside a git checkout or without git. What a benchmark's JSON names as
    the code it measured."""
    where = str(directory or Path(__file__).resolve().parent)
    try:
        commit = subprocess.run(["git", "-C", where, "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", where, "status", "--porcelain"], capture_output=True, text=True,
                               timeout=10).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return None
    return commit + ("+uncommitted changes" if dirty else "") if commit else None
