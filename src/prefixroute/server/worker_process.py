"""One worker process of ``serve --workers N``: the ordinary router on the shared port
(``SO_REUSEPORT``), its counts in its own column of the shared table, its admin API on
a loopback port only the supervisor calls, and the supervisor's signals
(:mod:`.workers` starts and watches it)."""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import signal
import sys
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from aiohttp import web

from prefixroute.eventloop import loop_factory
from prefixroute import signals
from prefixroute.core.config import ConfigError, FleetConfig
from prefixroute.server import gc_tuning
from prefixroute.server.settings import ServerSettings
from prefixroute.server.shared_counters import SharedCounters

__all__ = ["WorkerSpec", "RELOAD_SIGNAL", "worker_trace_path"]

log = logging.getLogger("prefixroute.server")

#: What the supervisor sends a worker to make it re-read ``--config`` (its SIGHUP). A
#: worker ignores SIGHUP itself: one sent to the whole process group (a terminal's, a
#: ``kill -HUP -PGID``) would otherwise make it reload twice, on its own and when told.
RELOAD_SIGNAL = signal.SIGUSR1
#: Blocked while the supervisor starts a child (a worker, the resource tracker): the
#: signals a process group gets, and RELOAD_SIGNAL, whose default action would kill a
#: child that does not handle it yet (a starting worker) or at all (the tracker).
_CHILD_BLOCKED = (*signals.HELD, RELOAD_SIGNAL)


def worker_trace_path(path: str, index: int) -> str:
    """``--record-trace`` file of worker ``index``: ``trace.jsonl`` -> ``trace.worker-1.jsonl``."""
    p = Path(path)
    return str(p.with_name(f"{p.stem}.worker-{index}{p.suffix}"))


@dataclass(frozen=True)
class WorkerSpec:
    """Everything a worker process needs (pickled to it by ``multiprocessing``)."""

    index: int
    config: FleetConfig
    settings: ServerSettings
    shm_name: str
    lock: Any
    admin_token: str = field(repr=False)
    metrics_dir: str
    log_level: str


# -- the worker process -----------------------------------------------------------


def _worker_main(spec: WorkerSpec, conn: Connection) -> None:
    """Entry of a worker process (a fresh interpreter: ``spawn``), started with SIGTERM,
    SIGINT, SIGHUP and :data:`RELOAD_SIGNAL` blocked (:func:`prefixroute.signals.blocked`,
    in the supervisor)."""
    # A worker ignores SIGHUP for good: one sent to the process group reaches the
    # supervisor too, which tells each worker to reload (RELOAD_SIGNAL), once.
    # Until the event loop handles them: RELOAD_SIGNAL must not kill a starting worker, nor a
    # Ctrl-C (the supervisor gets it too, and stops the workers) interrupt its start-up
    # with a traceback. A SIGTERM stops it (nothing is in flight yet).
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(RELOAD_SIGNAL, signal.SIG_IGN)
    signals.unblock(_CHILD_BLOCKED)
    logging.basicConfig(level=spec.log_level.upper(), stream=sys.stderr,
                        format=f"%(asctime)s %(levelname)s %(name)s [worker {spec.index}]: %(message)s")
    from prefixroute.server.metrics import use_multiprocess_values

    use_multiprocess_values(spec.metrics_dir)  # before any metric exists in this process
    with asyncio.Runner(loop_factory=loop_factory()) as runner:
        code = runner.run(_worker_serve(spec, conn))
    sys.exit(code)


def _draining() -> None:
    """A worker's SIGTERM and SIGINT handler while it drains: nothing more to do."""


async def _worker_serve(spec: WorkerSpec, conn: Connection) -> int:
    from prefixroute.server.runner import WorkerRuntime, reload_logged_waiting, start_router

    loop = asyncio.get_running_loop()
    counters = SharedCounters.attach(spec.shm_name, spec.index, spec.lock)
    try:
        try:
            handle = await start_router(spec.config, spec.settings, worker=WorkerRuntime(
                spec.index, counters.table, spec.admin_token, spec.metrics_dir))
        except (OSError, ConfigError) as exc:
            conn.send(("error", f"worker {spec.index}: cannot start: {exc}"))
            conn.close()
            return 1
        stop = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        # One reload at a time; signals that come meanwhile make one more after it.
        reloading: asyncio.Task[bool] | None = None
        again = False

        def on_sighup() -> None:
            nonlocal reloading, again
            if reloading is not None:
                again = True
                return
            reloading = loop.create_task(reload_logged_waiting(handle.state))
            reloading.add_done_callback(reloaded)

        def reloaded(_: asyncio.Task[bool]) -> None:
            nonlocal reloading, again
            reloading = None
            if again:
                again = False
                on_sighup()

        loop.add_signal_handler(RELOAD_SIGNAL, on_sighup)
        parent = multiprocessing.parent_process()
        if parent is not None:  # the supervisor died: stop too (its pipe reads EOF)
            loop.add_reader(parent.sentinel, stop.set)
        gc_tuning.tune()
        conn.send(("ready", os.getpid(), handle.admin_url))
        conn.close()
        try:
            await stop.wait()
            log.info("shutting down: waiting up to %.1f s for requests in flight", spec.settings.shutdown_timeout_s)
        finally:
            if parent is not None:
                loop.remove_reader(parent.sentinel)
            # Draining: a stop signal to the process group reached this worker as well as
            # the supervisor, which sends its own SIGTERM a moment later, and kills the
            # workers (SIGKILL) on a second signal or at the deadline. Neither the SIGTERM
            # nor a second Ctrl-C may cut the requests in flight short here: their
            # handlers become no-ops (replaced, never removed: no instant of the default
            # action in between).
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, _draining)
            await handle.close()  # RELOAD_SIGNAL still reloads (never kills) while requests drain
            loop.remove_signal_handler(RELOAD_SIGNAL)
            signal.signal(RELOAD_SIGNAL, signal.SIG_IGN)
        return 0
    finally:
        counters.close()


# -- the supervisor ---------------------------------------------------------------


async def _close_admin(runner: web.AppRunner) -> None:
    """Stop the supervisor's admin API: its port and idle connections at once (a body
    still arriving is cut), the requests in it within ``ADMIN_SHUTDOWN_S``."""
    from prefixroute.server.runner import ADMIN_SHUTDOWN_S, cleanup_within, stop_accepting

    await stop_accepting(runner)
    await cleanup_within(runner, ADMIN_SHUTDOWN_S)
