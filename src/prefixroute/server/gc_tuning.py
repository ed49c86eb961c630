"""The garbage collector set for a long-running router process.

CPython's cyclic collector runs a young collection every 700 container allocations and,
every 100 of those (while the long-lived objects grew by a quarter), a full one that
walks every container the process holds: the modules, classes and functions loaded at
start-up (over 100,000 objects with aiohttp, pydantic and the precise extra) as well as
the routing state. A router allocates containers for every request and every KV-event
batch, so on a replica ingesting a fleet's events the full collections took about a
quarter of its CPU (py-spy ``--native`` on one of 8 replicas of ``bench/policy_vs_peers.py
--workloads hot-prefix --replicas 8 --precise on``). :func:`tune` therefore

* freezes what start-up allocated (:func:`gc.freeze`: moved to a permanent generation
  that no collection walks; it is never garbage), and
* raises the young generation's threshold to :data:`GEN0_THRESHOLD` allocations, so
  that a burst of short-lived request objects is freed by reference counting before any
  collection looks at it, and full collections come about 14 times less often.

Reference cycles are still collected (the thresholds are only higher); nothing in the
router relies on prompt collection of cycles.
"""

from __future__ import annotations

import gc

__all__ = ["tune", "GEN0_THRESHOLD"]

#: Container allocations (net of frees) between two young collections (CPython: 700).
GEN0_THRESHOLD = 10_000


def tune() -> None:
    """Freeze the objects allocated so far and raise the young generation's threshold
    (module docstring). Call once, when the process has started serving."""
    gc.collect()  # (what start-up left as garbage is freed, not frozen)
    gc.freeze()
    _, gen1, gen2 = gc.get_threshold()
    gc.set_threshold(GEN0_THRESHOLD, gen1, gen2)
