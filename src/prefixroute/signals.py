"""Signals that come while ``prefixroute serve`` is starting.

Until the server installs its own handlers (once it listens) a SIGTERM or SIGINT would
kill the process with the default action, and a SIGHUP too. :func:`hold` is called
first thing by the command: from then on they are kept, not acted on, and the server
acts on them (:func:`take`) once its handlers are in place: a stop stops it (nothing is
in flight yet), a SIGHUP reloads the configuration file, as they would a moment later.
A second SIGTERM (or SIGINT) while starting gets the default action: a start that is
stuck can still be stopped.

Importing this module is cheap (the standard library's :mod:`signal` only), so it can
run before the server's own imports, which take a few hundred milliseconds.
"""

from __future__ import annotations

import os
import signal
from types import FrameType

__all__ = ["HELD", "hold", "take"]

#: The signals :func:`hold` keeps.
HELD = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)

_held: set[int] = set()


def _keep(signum: int, _frame: FrameType | None) -> None:
    if signum in _held and signum != signal.SIGHUP:
        # A second stop: starting may be stuck (a --config that is a FIFO nobody
        # writes...), so this one gets the default action, as before hold().
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
        return
    _held.add(signum)


def hold() -> None:
    """Keep :data:`HELD` signals from now on, until the server's handlers replace these
    (``loop.add_signal_handler``). Main thread only (``signal.signal``)."""
    _held.clear()
    for sig in HELD:
        signal.signal(sig, _keep)


def take() -> set[int]:
    """The signals kept since :func:`hold` (each once, however often it came); forgotten
    once taken."""
    out = set(_held)
    _held.clear()
    return out
