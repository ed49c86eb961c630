"""``prefixroute serve --workers N``: several router processes on one port, in-flight
counts shared.

A **supervisor** (the process the user started) checks the port is free (picking one
for ``--port 0``) and holds it, creates the shared in-flight table
(:class:`prefixroute.core.counters.InFlightTable` in a ``multiprocessing.shared_memory``
block) and a private directory for prometheus-client's multiprocess files, then starts
N **worker** processes (``multiprocessing``, ``spawn`` context). Each worker is the
ordinary aiohttp router bound to the same host and port with ``SO_REUSEPORT`` (the
kernel spreads connections over them); its pools count requests in its own column of
the table and decide on the sum over all columns. Each worker also serves the admin API
on a loopback ephemeral port, with a token only the supervisor knows.

Once every worker is listening the supervisor prints the usual
``prefixroute-serve listening on http://HOST:PORT`` line, then serves the public admin
API (``--admin-host``/``--admin-port``/token as in one process;
:mod:`prefixroute.server.workers_admin`): a GET is answered from
the workers (``Served`` summed over them), a change (PUT, ``POST /admin/reload``) goes
to every worker and is answered with worker 0's answer, or 502 if they disagree.
``GET /admin/workers`` lists the workers.

* A worker that dies has its column zeroed (its requests died with it) and is started
  again with the configuration in force (read from a live worker), after a back-off if
  it keeps dying young.
* SIGTERM/SIGINT: every worker drains its requests in flight (``--shutdown-timeout``)
  and exits; a second signal kills them. SIGHUP makes every worker re-read
  ``--config``, once: the supervisor tells each (:data:`RELOAD_SIGNAL`); a worker
  ignores SIGHUP itself (one sent to the process group reaches it too). The
  supervisor logs a :data:`RELOAD_SIGNAL` sent to it and does nothing else.
* On exit the shared block is unlinked and the metrics directory removed. Workers exit
  by themselves if the supervisor disappears.

The details, and what each metric means with several workers: docs/WORKERS.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import multiprocessing
import os
import secrets
import shutil
import signal
import socket
import sys
import tempfile
import time
from dataclasses import dataclass
from multiprocessing import resource_tracker
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from pathlib import Path

import aiohttp
import orjson
from aiohttp import web

from prefixroute.eventloop import loop_factory
from prefixroute.server.worker_sockets import worker_socket_fallback_prefix, worker_socket_prefix
from prefixroute import signals
from prefixroute.core.config import ConfigError, FleetConfig
from prefixroute.core.counters import LOCK_TIMEOUT_S, MAX_WORKERS
from prefixroute.server.settings import ServerSettings
from prefixroute.server.shared_counters import FileLock, SharedCounters
from prefixroute.server.worker_process import (
    _CHILD_BLOCKED,
    RELOAD_SIGNAL,
    WorkerSpec,
    _close_admin,
    _worker_main,
    worker_trace_path,
)
# (_call_failure: re-exported from its old home; the admin API moved there)
from prefixroute.server.workers_admin import _ADMIN_CALL_TIMEOUT_S, _call_failure, _PublicAdminAPI  # noqa: F401

__all__ = ["FileLock", "SharedCounters", "WorkerSpec", "Supervisor", "serve_workers", "worker_trace_path",
           "worker_socket_prefix", "worker_socket_fallback_prefix", "MAX_WORKERS", "READY_TIMEOUT_S"]

log = logging.getLogger("prefixroute.server")


#: Longest wait for a worker process to start listening, seconds.
READY_TIMEOUT_S = 60.0
#: A worker that dies sooner than this after it started is restarted after a back-off.
_YOUNG_S = 10.0
#: Extra seconds, beyond --shutdown-timeout, a worker gets to exit before it is killed.
_EXIT_GRACE_S = 10.0
_SHM_PREFIX = "prefixroute-"


def _url(host: str, port: int) -> str:
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def _reserve_port(host: str, port: int) -> tuple[socket.socket, int]:
    """Check that ``host:port`` is free (pick a free port for 0) and hold it with a
    bound, non-listening ``SO_REUSEPORT`` socket until the workers listen on it.

    Raises:
        OSError: in use, or not an address of this machine.
    """
    family, type_, proto, _, addr = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM,
                                                       flags=socket.AI_PASSIVE)[0]
    # Without SO_REUSEPORT: fails if anything listens there, even a router of ours.
    with socket.socket(family, type_, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        probe.bind(addr)
        port = probe.getsockname()[1]
    hold = socket.socket(family, type_, proto)
    try:
        hold.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        hold.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        hold.bind((addr[0], port, *addr[2:]))
    except BaseException:
        hold.close()
        raise
    return hold, port


@dataclass(eq=False)
class _Worker:
    index: int
    process: BaseProcess | None = None
    conn: Connection | None = None
    pid: int = 0
    admin_url: str | None = None
    ready: asyncio.Future[None] | None = None
    started: float = 0.0
    restarts: int = 0
    young_deaths: int = 0
    restarting: asyncio.Task[None] | None = None
    missed_sighup: bool = False  # a SIGHUP came while it was not listening
    answered: float = 0.0  # time.monotonic() of its last answer to the watchdog's probe (or of its start)
    probe: asyncio.Future[None] | None = None  # the watchdog's probe in progress

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.exitcode is None

    @property
    def serving(self) -> bool:
        return self.alive and self.ready is not None and self.ready.done() and not self.ready.exception()


class Supervisor(_PublicAdminAPI):
    """Runs N worker processes on one port; see the module docstring.

    Args:
        config: the validated fleet configuration to start with.
        settings: process settings; ``settings.workers`` >= 2.
        log_level: the workers' log level (``debug``...``error``).
    """

    def __init__(self, config: FleetConfig, settings: ServerSettings, log_level: str = "warning") -> None:
        if settings.workers < 2:
            raise ValueError("Supervisor needs settings.workers >= 2 (1 runs the router in this process)")
        self.config = config
        self.settings = settings
        self.log_level = log_level
        self.port = 0
        self.url = ""
        self.admin_url: str | None = None
        self.counters: SharedCounters | None = None
        self.metrics_dir: str | None = None
        self._ctx = multiprocessing.get_context("spawn")
        self._lock: FileLock | None = None  # in metrics_dir, made by run()
        self._token = secrets.token_urlsafe(32)
        self._workers = [_Worker(i) for i in range(settings.workers)]
        self._stopping = False
        self._watch: asyncio.Future[None] | None = None
        self._stop = asyncio.Event()
        self._killed = False
        self._stopped_by = int(signal.SIGTERM)  # the stop signal received (for the draining message)
        self._config_lock = asyncio.Lock()  # fan-outs and restarts, one at a time
        self._http: aiohttp.ClientSession | None = None
        self._admin_runner: web.AppRunner | None = None

    # -- life cycle -----------------------------------------------------------------

    async def run(self) -> int:
        """Start everything, print the listening lines, serve until SIGTERM/SIGINT,
        stop everything. Returns the exit status (0, or 1 if it could not start)."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._on_stop_signal, sig)
        loop.add_signal_handler(signal.SIGHUP, self._forward_sighup)
        # RELOAD_SIGNAL is how the supervisor talks to its workers; sent to the supervisor
        # (by hand, or to the process group) it would kill it, workers orphaned.
        loop.add_signal_handler(RELOAD_SIGNAL, self._on_reload_signal)
        held = signals.take()  # what came while starting (prefixroute.signals.hold)
        if signal.SIGHUP in held:
            self._forward_sighup()  # no worker listens yet: each reloads once it does
        if held & {signal.SIGTERM, signal.SIGINT}:
            self._on_stop_signal()
        try:
            code = await self._start()
            if code or self._stop.is_set():  # could not start, or told to stop while starting
                return code
            print(f"prefixroute-serve listening on {self.url}", flush=True)
            if self.admin_url:
                print(f"prefixroute-admin listening on {self.admin_url}", flush=True)
            if self.settings.worker_timeout_s > 0:
                self._watch = asyncio.ensure_future(self._watchdog(self.settings.worker_timeout_s))
            await self._print_summary()
            await self._stop.wait()
            from prefixroute.server.summary import draining_message

            table = self.counters.table if self.counters is not None else None
            busy = sum(table.worker_total(w.index) for w in self._workers) if table is not None else -1
            print(draining_message(signal.Signals(self._stopped_by).name, busy, self.settings.shutdown_timeout_s,
                                   len(self._workers)), file=sys.stderr, flush=True)
            return 0
        finally:
            await self._shutdown()
            # Stopped: a signal during the interpreter's exit is ignored (not a -15).
            signals.replace(loop, (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, RELOAD_SIGNAL), signal.SIG_IGN)

    def _on_reload_signal(self) -> None:
        log.warning("%s to the supervisor does nothing (it is how the supervisor tells a worker to reload); "
                    "SIGHUP reloads every worker", RELOAD_SIGNAL.name)

    async def _print_summary(self) -> None:
        """The startup summary on stderr, each instance's health as worker 0 sees it
        once its first round of health checks is done."""
        from prefixroute.server.clientkeys import load_keys
        from prefixroute.server.status import STATUS_JSON_PATH
        from prefixroute.server.summary import startup_summary

        s = self.settings
        status = None
        deadline = time.monotonic() + (s.health_check_timeout_s + 1.0 if s.health_check_interval_s > 0 else 0.0)
        first = next((w for w in self._workers if w.serving), None)
        while first is not None and not self._stop.is_set():
            try:
                code, body = await self._call(first, "GET", STATUS_JSON_PATH)
                status = orjson.loads(body) if code == 200 else None
            except (aiohttp.ClientError, OSError, ValueError):
                status = None
            checked = status is not None and all(i["state"] != "unchecked" for e in status["endpoints"]
                                                 for v in e["variants"] for i in v["instances"])
            if checked or time.monotonic() >= deadline:
                break
            await asyncio.sleep(0.05)
        try:
            keys = load_keys(s.api_keys_file)
        except ConfigError:
            keys = None
        described = None
        if keys is not None:
            described = f"{len(keys.keys)} key(s) " + (f"from {s.api_keys_file}" if s.api_keys_file
                                                       else "from $PREFIXROUTE_API_KEYS")
        print(startup_summary(self.config, s, self.url, self.admin_url, status, described, os.getpid()),
              file=sys.stderr, flush=True)

    def _on_stop_signal(self, signum: int = signal.SIGTERM) -> None:
        self._stopped_by = signum
        self._stopping = True  # a worker that exits from now on is not restarted (a group signal stops it too)
        if self._stop.is_set() and not self._killed:  # a second signal: do not wait for the drain
            log.warning("%s again: killing the workers, not waiting for their requests in flight",
                        signal.Signals(signum).name)
            self._killed = True
            for w in self._workers:
                if w.alive and w.process is not None:
                    w.process.kill()
        self._stop.set()

    async def _start(self) -> int:
        s = self.settings
        try:
            hold, self.port = _reserve_port(s.host, s.port)
        except OSError as exc:
            print(f"error: cannot listen on {s.host}:{s.port}: {exc}", file=sys.stderr)
            return 1
        try:
            self.url = _url(s.host, self.port)
            self.metrics_dir = tempfile.mkdtemp(prefix=f"prefixroute-metrics-{os.getpid()}-")
            # (prometheus-client reads only the *.db files there)
            self._lock = FileLock(os.path.join(self.metrics_dir, "inflight.lock"))
            # The resource tracker (of the shared memory, and of the workers' semaphore)
            # is a child that handles SIGINT and SIGTERM but not SIGHUP or RELOAD_SIGNAL:
            # started with them blocked, it never gets one sent to the process group.
            with signals.blocked(_CHILD_BLOCKED):
                resource_tracker.ensure_running()
            self.counters = SharedCounters.create(s.workers, self._lock)
            self._http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=_ADMIN_CALL_TIMEOUT_S))
            for w in self._workers:
                self._spawn(w, self.config)
            waits = [asyncio.ensure_future(self._wait_ready(w)) for w in self._workers]
            stop = asyncio.ensure_future(self._stop.wait())
            gathered = asyncio.gather(*waits)
            # Its error is each worker's, reported below (or moot once stopping): retrieved
            # whenever it ends, so that asyncio does not log it as never retrieved.
            gathered.add_done_callback(lambda f: f.cancelled() or f.exception())
            try:
                await asyncio.wait([gathered, stop], return_when=asyncio.FIRST_COMPLETED)
            finally:
                stop.cancel()
            if self._stop.is_set():
                return 0
            failed = [str(t.exception()) for t in waits if t.done() and t.exception() is not None]
            for t in waits:
                t.cancel()
            if failed:
                print(f"error: {failed[0]}", file=sys.stderr)
                return 1
            for w in self._workers:
                self._sighup_if_missed(w)
        finally:
            hold.close()  # the workers listen now (or failed)
        if s.admin_enabled:
            from prefixroute.server.runner import ADMIN_SHUTDOWN_S, _start as start_site

            admin_port = s.admin_port if s.admin_port is not None else (self.port + 1 if s.port else 0)
            try:
                self._admin_runner, admin_port = await start_site(self._admin_app(), s.admin_host, admin_port,
                                                                  ADMIN_SHUTDOWN_S,
                                                                  auto_decompress=False)  # read_admin_body decodes
            except OSError as exc:
                print(f"error: cannot listen on the admin port {s.admin_host}:{admin_port}: {exc}", file=sys.stderr)
                return 1
            self.admin_url = _url(s.admin_host, admin_port)
        return 0

    def _worker_settings(self, index: int) -> ServerSettings:
        s = self.settings
        return dataclasses.replace(
            s, port=self.port, admin_port=0, workers=1,
            seed=None if s.seed is None else s.seed + 1_000_003 * index,
            record_trace=None if s.record_trace is None else worker_trace_path(s.record_trace, index))

    def _spawn(self, w: _Worker, config: FleetConfig) -> None:
        assert self.counters is not None and self.metrics_dir is not None
        spec = WorkerSpec(w.index, config, self._worker_settings(w.index), self.counters.name, self._lock,
                          self._token, self.metrics_dir, self.log_level)
        ours, theirs = self._ctx.Pipe(duplex=False)
        proc = self._ctx.Process(target=_worker_main, args=(spec, theirs), name=f"prefixroute-worker-{w.index}",
                                 daemon=False)
        with signals.blocked(_CHILD_BLOCKED):  # until the worker can handle them (_worker_main)
            proc.start()
        theirs.close()
        w.process, w.conn, w.pid, w.admin_url = proc, ours, proc.pid or 0, None
        w.started = time.monotonic()
        loop = asyncio.get_running_loop()
        w.ready = loop.create_future()
        loop.add_reader(ours.fileno(), self._on_message, w)
        loop.add_reader(proc.sentinel, self._on_exit, w, proc)

    def _on_message(self, w: _Worker) -> None:
        loop = asyncio.get_running_loop()
        conn = w.conn
        assert conn is not None and w.ready is not None
        loop.remove_reader(conn.fileno())
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            msg = ("error", f"worker {w.index} exited before it was listening (see its log above)")
        finally:
            conn.close()
            w.conn = None
        if w.ready.done():
            return
        if msg[0] == "ready":
            _, w.pid, w.admin_url = msg
            w.answered = time.monotonic()
            w.ready.set_result(None)
            log.info("worker %d (pid %d) is listening", w.index, w.pid)
        else:
            w.ready.set_exception(RuntimeError(msg[1]))

    async def _wait_ready(self, w: _Worker) -> None:
        assert w.ready is not None
        try:
            await asyncio.wait_for(asyncio.shield(w.ready), READY_TIMEOUT_S)
        except asyncio.TimeoutError:
            if w.process is not None:
                w.process.kill()
            raise RuntimeError(f"worker {w.index} was not listening after {READY_TIMEOUT_S:.0f} s") from None

    def _on_exit(self, w: _Worker, proc: BaseProcess) -> None:
        loop = asyncio.get_running_loop()
        loop.remove_reader(proc.sentinel)
        # The sentinel turns readable as the process closes its descriptors, an instant
        # before it can be reaped: wait for that (bounded) so exitcode is known.
        proc.join(1.0)
        if w.conn is not None:
            loop.remove_reader(w.conn.fileno())
            w.conn.close()
            w.conn = None
        if w.ready is not None and not w.ready.done():
            w.ready.set_exception(RuntimeError(f"worker {w.index} exited with status {proc.exitcode} before it "
                                               "was listening (see its log above)"))
            w.ready.exception()  # retrieved: no "never retrieved" warning if nobody waits
        self._remove_sockets(w)  # a worker killed (SIGKILL) could not remove its own
        if self.counters is not None and not self.counters.table.zero_worker(w.index):  # its requests died with it
            log.warning("worker %d: its in-flight counts were zeroed, but the shared table's lock was not free within "
                        "%g s, so its slots stay held", w.index, LOCK_TIMEOUT_S)
        if self._stopping or w.process is not proc:
            return
        lived = time.monotonic() - w.started
        w.young_deaths = w.young_deaths + 1 if lived < _YOUNG_S else 0
        delay = 0.0 if not w.young_deaths else min(10.0, 0.5 * 2 ** (w.young_deaths - 1))
        log.error("worker %d (pid %d) exited with status %s after %.1f s; its in-flight counts were zeroed; "
                  "restarting it in %.1f s", w.index, proc.pid, proc.exitcode, lived, delay)
        w.restarting = asyncio.ensure_future(self._restart(w, delay))

    def _remove_sockets(self, w: _Worker) -> None:
        """Remove the internal-socket directory of worker ``w`` (it has exited), found by
        its name: in the metrics directory, or in ``$TMPDIR`` when that path was too long
        for a socket (even one made by a worker killed while it was starting)."""
        found = list(Path(tempfile.gettempdir()).glob(f"{worker_socket_fallback_prefix(os.getpid(), w.index)}*"))
        if self.metrics_dir is not None:
            found += Path(self.metrics_dir).glob(f"{worker_socket_prefix(w.index)}*")
        for d in found:
            shutil.rmtree(d, ignore_errors=True)

    async def _restart(self, w: _Worker, delay: float) -> None:
        await asyncio.sleep(delay)
        # Holding the lock until it listens: no change can be fanned out meanwhile and
        # miss it (it starts with the configuration in force).
        async with self._config_lock:
            if self._stopping:
                return
            config = await self._config_in_force()
            w.restarts += 1
            self._spawn(w, config)
            try:
                await self._wait_ready(w)
            except RuntimeError as exc:
                log.error("%s", exc)  # its exit restarts it again
            else:
                self._sighup_if_missed(w)

    async def _config_in_force(self) -> FleetConfig:
        """The configuration of a live worker (admin changes and reloads included);
        the last one known if none answers."""
        from prefixroute.server.admin import strip_live_state

        for w in self._workers:
            if not w.serving:
                continue
            try:
                status, body = await self._call(w, "GET", "/admin/config")
                if status == 200:
                    self.config = FleetConfig.from_mapping(strip_live_state(orjson.loads(body)))
                    break
            except (aiohttp.ClientError, asyncio.TimeoutError, ConfigError, orjson.JSONDecodeError) as exc:
                log.warning("could not read the configuration of worker %d: %s", w.index, exc)
        return self.config

    def _forward_sighup(self) -> None:
        if self._stopping:
            return
        for w in self._workers:
            if w.serving:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(w.pid, RELOAD_SIGNAL)
            else:  # starting: it reloads once it listens (_sighup_if_missed), as the others do now
                w.missed_sighup = True

    def _sighup_if_missed(self, w: _Worker) -> None:
        """A worker now listening reloads too if a SIGHUP came while it was starting (it
        was started with the configuration in force before the others reloaded)."""
        if w.missed_sighup and w.serving and not self._stopping:
            w.missed_sighup = False
            with contextlib.suppress(ProcessLookupError):
                os.kill(w.pid, RELOAD_SIGNAL)

    async def _watchdog(self, timeout: float) -> None:
        """Kill (SIGKILL) a serving worker that has answered none of the probes for
        ``timeout`` seconds: its event loop blocked (a bug) or its process stopped, it
        would keep getting its share of the port's new connections (the kernel's
        SO_REUSEPORT spreading does not know), and they would hang. Its exit restarts
        it (:meth:`_on_exit`). A probe is one admin call (``GET /admin/config``), sent
        every ``timeout / 4`` seconds unless the last one is still waiting; any answer
        counts. A pause of the supervisor itself (longer than two probe intervals)
        restarts every worker's count: its silence was not the workers'."""
        every = timeout / 4
        tick = time.monotonic()
        for w in self._workers:  # probed from now on (the first ready waited for the others)
            w.answered = max(w.answered, tick)
        while not self._stopping:
            await asyncio.sleep(every)
            now = time.monotonic()
            if now - tick > 2 * every:
                # This process did not run for a while (stopped, a paused container, a
                # frozen VM): no probe was sent, so the workers' silence says nothing.
                for w in self._workers:
                    w.answered = max(w.answered, now)
            tick = now
            for w in self._workers:
                if self._stopping or not w.serving or w.process is None:
                    continue
                if now - w.answered > timeout:
                    log.error("worker %d (pid %d) answered nothing for %.1f s (--worker-timeout %g): killing it; "
                              "its requests in flight are lost, and it is restarted", w.index, w.pid,
                              now - w.answered, timeout)
                    w.answered = now  # (killed once)
                    w.process.kill()
                elif w.probe is None or w.probe.done():
                    w.probe = asyncio.ensure_future(self._probe(w, timeout))

    async def _probe(self, w: _Worker, timeout: float) -> None:
        """One probe: an answer, however late within ``timeout``, counts."""
        try:
            async with asyncio.timeout(timeout):
                await self._call(w, "GET", "/admin/config")
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
            return  # no answer: counted by _watchdog from w.answered
        w.answered = time.monotonic()

    async def _shutdown(self) -> None:
        self._stopping = True
        self._stop.set()
        if self._watch is not None:
            self._watch.cancel()
        for w in self._workers:
            if w.probe is not None:
                w.probe.cancel()
        admin_closed: asyncio.Task[None] | None = None
        if self._admin_runner is not None:  # stops accepting now; its requests finish beside the workers' drain
            admin_closed = asyncio.create_task(_close_admin(self._admin_runner))
            self._admin_runner = None
        for w in self._workers:
            if w.restarting is not None:
                w.restarting.cancel()
            if w.alive and w.process is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(w.process.pid, signal.SIGTERM)  # type: ignore[arg-type]
        if admin_closed is not None:
            await admin_closed
        deadline = time.monotonic() + self.settings.shutdown_timeout_s + _EXIT_GRACE_S
        while any(w.alive for w in self._workers) and time.monotonic() < deadline and not self._killed:
            await asyncio.sleep(0.05)
        for w in self._workers:
            if w.alive and w.process is not None:
                if not self._killed:  # (after a second stop signal they were killed on purpose)
                    log.error("worker %d (pid %s) did not exit in time: killed", w.index, w.process.pid)
                w.process.kill()
        loop = asyncio.get_running_loop()
        for w in self._workers:
            if w.process is not None:
                await loop.run_in_executor(None, w.process.join)
                with contextlib.suppress(ValueError, OSError):
                    loop.remove_reader(w.process.sentinel)
                if w.conn is not None:
                    with contextlib.suppress(ValueError, OSError):
                        loop.remove_reader(w.conn.fileno())
                    w.conn.close()
                    w.conn = None
        if self._http is not None:
            await self._http.close()
            self._http = None
        if self.counters is not None:
            self.counters.unlink()
            self.counters = None
        if self._lock is not None:
            self._lock.close()
        if self.metrics_dir is not None:
            shutil.rmtree(self.metrics_dir, ignore_errors=True)
            self.metrics_dir = None

    # -- calls to a worker's admin API ----------------------------------------------

    async def _call(self, w: _Worker, method: str, path: str, body: bytes | None = None) -> tuple[int, bytes]:
        assert self._http is not None and w.admin_url is not None
        async with self._http.request(method, w.admin_url + path, data=body,
                                      headers={"Authorization": f"Bearer {self._token}",
                                               "Content-Type": "application/json"}) as r:
            return r.status, await r.read()


def serve_workers(config: FleetConfig, settings: ServerSettings, log_level: str = "warning") -> int:
    """Run ``settings.workers`` router processes until SIGTERM/SIGINT; the exit status."""
    with asyncio.Runner(loop_factory=loop_factory()) as runner:
        return runner.run(Supervisor(config, settings, log_level).run())
