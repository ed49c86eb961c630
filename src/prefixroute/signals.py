"""Signals that come while ``prefixroute serve`` is starting.

Until the server installs its own handlers (once it listens) a SIGTERM or SIGINT would
kill the process with the default action, and a SIGHUP too. :func:`hold` is called
first thing by the command: from then on they are kept, not acted on, and the server
acts on them (:func:`take`) once its handlers are in place: a stop stops it (nothing is
in flight yet), a SIGHUP reloads the configuration file, as they would a moment later.
A second SIGTERM (or SIGINT) while starting gets the default action: a start that is
stuck can still be stopped.

:func:`blocked` keeps them pending instead, around the start of a child process: the
child inherits the mask (through ``exec`` too), so a signal sent to the whole process
group (a Ctrl-C, a terminal's SIGHUP, a service manager's stop) does not reach a
``--workers`` worker, or multiprocessing's resource tracker, before either can handle
it; the worker unblocks them once it has (:func:`unblock`).

Importing this module is cheap (the standard library's :mod:`signal` only), so it can
run before the server's own imports, which take a few hundred milliseconds.
"""

from __future__ import annotations

import contextlib
import os
import signal
from types import FrameType
from typing import Any, Iterable, Iterator

__all__ = ["HELD", "blocked", "hold", "replace", "take", "unblock"]

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


@contextlib.contextmanager
def blocked(sigs: Iterable[int] = HELD) -> Iterator[None]:
    """Block ``sigs`` in the calling thread for the ``with`` block, then restore the
    previous mask: a signal that came meanwhile is delivered then, not lost. A child
    process started inside inherits them blocked (``pthread_sigmask``; POSIX keeps the
    mask across ``fork`` and ``exec``) until it calls :func:`unblock`."""
    old = signal.pthread_sigmask(signal.SIG_BLOCK, sigs)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def unblock(sigs: Iterable[int] = HELD) -> None:
    """Unblock ``sigs`` (in a child started inside :func:`blocked`, once its
    dispositions are set): one that came meanwhile is acted on now."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, sigs)


def replace(loop: Any, sigs: Iterable[int], action: Any) -> None:
    """Remove the event loop's handlers of ``sigs`` and give them ``action``
    (``signal.SIG_IGN``, ``signal.SIG_DFL``) with them blocked meanwhile, so that none
    gets the default action (or, for SIGINT, a ``KeyboardInterrupt``) in between."""
    sigs = tuple(sigs)
    with blocked(sigs):
        for sig in sigs:
            loop.remove_signal_handler(sig)
            signal.signal(sig, action)
