"""A process tree's CPU time and peak memory, read from Linux's ``/proc``: what
``bench/overhead.py``, ``bench/policy_vs_peers.py`` and ``bench/workers_scaling.py``
charge a router (its process and every descendant).
"""

from __future__ import annotations

import os
from collections.abc import Iterable

_CLK_TCK = os.sysconf("SC_CLK_TCK")


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
    return trees_cpu_seconds([root])


def trees_cpu_seconds(roots: Iterable[int], *, reaped: bool = True) -> float:
    """CPU seconds (user + system) used by the process trees of ``roots`` (each process
    counted once): utime + stime of every live process, plus cutime + cstime (its
    reaped children's) when ``reaped``; ``nan`` without ``/proc``."""
    if not os.path.isdir("/proc"):
        return float("nan")
    pids: dict[int, None] = {}
    for root in roots:
        pids.update(dict.fromkeys(process_tree(root)))
    end = 15 if reaped else 13
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except OSError:
            continue
        # fields[0] is the state (field 3 of proc(5)); utime..cstime are fields 14-17.
        total += sum(int(x) for x in fields[11:end])
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
