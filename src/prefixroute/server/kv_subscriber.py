"""The I/O driver of precise mode: one ZeroMQ subscription per instance, feeding the core.

All decisions are the core's (:mod:`prefixroute.core.kvevents`): this module only moves
bytes and time. Per instance, one task:

1. finds the instance's endpoints (the configuration, a template, or the instance's
   ``GET /info``, retried with backoff until it answers);
2. connects a SUB socket (subscribed to the configured topic) and a socket monitor,
   whose connect and disconnect events tell the stream
   (:meth:`~prefixroute.core.kvevents.stream.InstanceStream.on_connected`);
3. hands the socket to the ingest cycle, which reads its messages and gives them to the
   stream, and carries out the replays the stream asks for on a DEALER socket (vLLM's
   protocol, :mod:`prefixroute.engine.kv_publisher`), with ``ReplayTimeoutS`` as the
   longest wait for each of its frames.

**One ingest cycle for every instance.** A socket with a message waiting signals on its
file descriptor; the first signal schedules a cycle :data:`COALESCE_S` later, which reads
every signalled socket to the end (non-blocking) and applies what it read. At a fleet's
few hundred event batches a second this is one timer callback per few batches, where a
coroutine awaiting each socket cost an event-loop wakeup and pyzmq's futures per batch
(the router CPU that precise mode added at 8 router replicas).

**Off the request path, never blocking the event loop.** Every socket is non-blocking;
a cycle applies messages for at most :data:`SLICE_S` seconds, and every instance's
ingest together takes at most :data:`INGEST_DUTY` of the loop's time: after a cycle,
the next one waits three times as long as it took, and requests are served in between;
sockets a cycle did not reach go first in the next, then those it could not finish (a
flooding publisher does not starve the others). What a flood adds beyond that stays in ZeroMQ's queue
(``ReceiveHwm``) and is then dropped by it: the stream sees a gap and repairs or resets
(:mod:`~prefixroute.core.kvevents.stream`). A publisher that leaves messages after every
cycle for :data:`FLOOD_S` seconds is shed: its subscription is closed for a backoff
(:data:`FLOOD_BACKOFF_S`, doubling while it floods), during which the instance is
approximate and its publisher's messages cost the router nothing, then taken up again
(a reconnection: the stream resumes or resets and catches up through replay). A stream
that never connects costs nothing: ZeroMQ retries in the background and the instance
stays approximate.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import aiohttp

from prefixroute.core.kvevents.config import KvEventsConfig, KvEventsEndpoint, check_zmq_endpoint
from prefixroute.core.kvevents.stream import InstanceStream, Mode, RequestReplay
from prefixroute.core.kvevents.view import PreciseCacheView

__all__ = ["KvEventSubscriber", "SLICE_S", "COALESCE_S", "INGEST_DUTY", "FLOOD_S", "FLOOD_BACKOFF_S", "INFO_RETRY_S"]

log = logging.getLogger("prefixroute.kv_events")

#: Longest run of message handling before the task yields to the event loop, seconds.
SLICE_S = 0.001
#: After a socket signals a message, the ingest waits this long (seconds) for more, from
#: it and the other instances, and applies them in one go: at a few hundred messages a
#: second from a fleet, a few cycles instead of one event-loop wakeup per message. 30 ms
#: cut the routers' CPU by 9-27 % with 8 router replicas on 4 engines
#: (bench/policy_vs_peers.py, three runs each of four workloads) but, in
#: bench/overhead.py's 1K/32K/256K sequence, cost the 256 KB cell 45 % of its
#: requests/s (968 and 856 against 1,520 req/s; not analysed: a 256 KB-only run was as fast
#: either way), so it stays 10 ms. What a router sent since the last cycle is counted by
#: :class:`prefixroute.core.precise_policy.Speculative`, until the instance has nothing in
#: flight.
COALESCE_S = 0.010
#: Most of the event loop's time all instances' ingest takes together.
INGEST_DUTY = 0.25
#: Seconds of back-to-back full slices after which a publisher is a flood and is shed.
FLOOD_S = 1.0
#: A shed publisher's subscription is closed this long (seconds), doubling up to the second.
FLOOD_BACKOFF_S = (1.0, 30.0)
#: Batches a replay's backlog applies between two checks of the slice's time.
_DRAIN_STEP = 16
#: Seconds between two logged errors applying one instance's messages.
ERROR_LOG_INTERVAL_S = 10.0
#: Backoff between two ``GET /info`` discovery attempts, seconds (first, then doubling to the last).
INFO_RETRY_S = (0.5, 10.0)
_END_SEQ = (-1).to_bytes(8, "big", signed=True)


_ZMQ: Any = None


def _zmq() -> Any:
    global _ZMQ
    if _ZMQ is not None:
        return _ZMQ
    try:
        import zmq
        import zmq.asyncio
    except ImportError as exc:  # the precise extra
        raise ImportError("precise mode needs pyzmq and msgpack: pip install 'prefixroute[precise]'") from exc
    _ZMQ = zmq
    return zmq


class KvEventSubscriber:
    """Subscriptions to every instance's KV events (see the module docstring).

    Args:
        view: the :class:`~prefixroute.core.kvevents.view.PreciseCacheView` to feed.
        config: the validated :class:`~prefixroute.core.kvevents.config.KvEventsConfig`.
        session: an ``aiohttp.ClientSession`` for ``FromInfo`` discovery (``None``: a
            session of its own is made when needed).
        clock: the monotonic clock handed to the core, seconds.

    Use: ``await start(instances)``, :meth:`update` on reconfiguration, ``await close()``.
    """

    def __init__(self, view: PreciseCacheView, config: KvEventsConfig, *,
                 session: aiohttp.ClientSession | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.view = view
        self.config = config
        self._session = session
        self._own_session: aiohttp.ClientSession | None = None
        self._clock = clock
        self._ctx: Any = None
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._specs: dict[str, tuple[Any, ...]] = {}
        #: Seconds spent applying messages, per instance (the ingest's own CPU time).
        self.busy_s: dict[str, float] = {}
        #: Times each instance's flooding publisher was shed (its subscription closed for a while).
        self.sheds: dict[str, int] = {}
        #: Ingest cycles run, and messages they applied (every instance's).
        self.cycles = 0
        self.messages = 0
        # time.perf_counter() before which no ingest slice starts (INGEST_DUTY, all instances)
        self._next_ingest = 0.0
        self._subs: dict[str, _Subscription] = {}
        self._ready: dict[str, _Subscription] = {}  # sockets that signalled, in turn order
        self._timer: asyncio.TimerHandle | None = None
        self._failed_at: dict[str, float] = {}  # instance -> when an apply error was last logged

    # -- membership ---------------------------------------------------------------------

    async def start(self, instances: Iterable[str]) -> None:
        """Subscribe to every instance's stream (in the running loop).

        Raises:
            ImportError: pyzmq is missing (the ``precise`` extra).
        """
        zmq = _zmq()
        self._ctx = zmq.asyncio.Context()
        self.update(self.config, instances)

    def _spec(self, instance: str) -> tuple[Any, ...]:
        ep = self.config.endpoints_for(instance)
        info = self.config.discovery is not None and self.config.discovery.from_info
        return (ep, info and instance not in self.config.instances, self.config.topic, self.config.receive_hwm,
                self.config.block_size)

    def update(self, config: KvEventsConfig, instances: Iterable[str]) -> None:
        """Follow a new configuration: subscribe to new instances, drop removed ones, and
        resubscribe (from an empty state) those whose endpoints changed."""
        self.config = config
        wanted = list(dict.fromkeys(instances))
        for instance in list(self._tasks):
            if instance not in wanted or self._spec(instance) != self._specs.get(instance):
                self._tasks.pop(instance).cancel()
                self._specs.pop(instance, None)
                self.view.remove_instance(instance)
        for instance in wanted:
            if instance not in self._tasks:
                spec = self._spec(instance)
                self._specs[instance] = spec
                self.view.add_instance(instance, config.stream_settings(True))
                self._tasks[instance] = asyncio.create_task(self._run(instance), name=f"kv-events {instance}")

    async def close(self) -> None:
        """Cancel every subscription and close the sockets."""
        tasks = list(self._tasks.values())
        self._tasks.clear()
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        if self._own_session is not None:
            await self._own_session.close()
            self._own_session = None
        if self._ctx is not None:
            self._ctx.destroy(linger=0)
            self._ctx = None

    # -- one instance -------------------------------------------------------------------

    async def _endpoints(self, instance: str) -> KvEventsEndpoint | None:
        ep = self.config.endpoints_for(instance)
        d = self.config.discovery
        if instance in self.config.instances or d is None or not d.from_info:
            return ep
        delay, longest = INFO_RETRY_S
        while True:
            found = await self._from_info(instance)
            if found is not None:
                return found
            if ep is not None:  # /info says nothing: the template applies
                return ep
            await asyncio.sleep(delay)
            delay = min(longest, delay * 2)

    async def _from_info(self, instance: str) -> KvEventsEndpoint | None:
        session = self._session
        if session is None or session.closed:
            if self._own_session is None:
                self._own_session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5))
            session = self._own_session
        try:
            async with session.get(instance + "/info", timeout=aiohttp.ClientTimeout(total=5)) as resp:
                if resp.status != 200:
                    return None
                doc = await resp.json(content_type=None)
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
            return None
        kv = doc.get("kv_events") if isinstance(doc, dict) else None
        if not isinstance(kv, dict) or not isinstance(kv.get("endpoint"), str):
            return None
        try:
            endpoint = _reachable(kv["endpoint"], instance)
            replay = kv.get("replay_endpoint")
            return KvEventsEndpoint(Endpoint=endpoint,
                                    ReplayEndpoint=_reachable(replay, instance) if isinstance(replay, str) else None)
        except ValueError as exc:
            log.warning("kv events %s: /info gives an unusable endpoint: %s", instance, exc)
            return None

    async def _run(self, instance: str) -> None:
        zmq = _zmq()
        stream = self.view.stream(instance)
        assert stream is not None
        ep = await self._endpoints(instance)
        if ep is None:
            log.info("kv events %s: no endpoint configured or discovered: approximate mode", instance)
            return
        stream.settings = self.config.stream_settings(ep.replay_endpoint is not None)
        backoff = FLOOD_BACKOFF_S[0]
        while True:
            sub = self._ctx.socket(zmq.SUB)
            sub.setsockopt(zmq.LINGER, 0)
            sub.setsockopt(zmq.RCVHWM, self.config.receive_hwm)
            sub.setsockopt(zmq.SUBSCRIBE, self.config.topic.encode())
            monitor = sub.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED)
            watcher = asyncio.create_task(self._watch(monitor, stream, instance),
                                          name=f"kv-events-monitor {instance}")
            replays: set[asyncio.Task[None]] = set()
            try:
                sub.connect(ep.endpoint)
                log.info("kv events %s: subscribed to %s (replay: %s)", instance, ep.endpoint, ep.replay_endpoint)
                await self._receive(sub, stream, ep, instance, replays)
            finally:
                for task in (watcher, *replays):
                    task.cancel()
                for task in (watcher, *replays):
                    with contextlib.suppress(asyncio.CancelledError, Exception):
                        await task
                with contextlib.suppress(Exception):
                    sub.disable_monitor()
                monitor.close(linger=0)
                sub.close(linger=0)
            # _receive returned: the publisher floods. Shed it for a while.
            reason = f"flooding: unsubscribed for {backoff:g} s"
            stream.on_disconnected(reason)
            self.sheds[instance] = self.sheds.get(instance, 0) + 1
            log.warning("kv events %s: the publisher sends faster than the router applies for %.0f s: %s "
                        "(approximate meanwhile)", instance, FLOOD_S, reason)
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, FLOOD_BACKOFF_S[1])

    async def _watch(self, monitor: Any, stream: InstanceStream, instance: str) -> None:
        zmq = _zmq()
        from zmq.utils.monitor import parse_monitor_message

        while True:
            event = parse_monitor_message(await monitor.recv_multipart())["event"]
            before = stream.mode
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                stream.on_connected()
            elif event == zmq.EVENT_DISCONNECTED:
                stream.on_disconnected()
            if stream.mode is not before:
                log.info("kv events %s: %s (%s)", instance, stream.mode.value, stream.reason)

    async def _receive(self, sub: Any, stream: InstanceStream, ep: KvEventsEndpoint, instance: str,
                       replays: set[asyncio.Task[None]]) -> None:
        """Hand the socket to the ingest cycle (:meth:`_cycle`) until its publisher floods."""
        zmq = _zmq()
        loop = asyncio.get_running_loop()
        raw = zmq.Socket.shadow(sub.underlying)  # non-blocking reads, its file descriptor
        self.busy_s.setdefault(instance, 0.0)
        s = _Subscription(instance, stream, ep, raw, raw.getsockopt(zmq.FD), replays, loop.create_future())
        self._subs[instance] = s
        self._arm(s)
        try:
            await s.shed  # set by _cycle when the publisher floods
        finally:
            self._disarm(s)
            if self._subs.get(instance) is s:
                del self._subs[instance]

    # The socket's file descriptor is ZeroMQ's signal that messages may be waiting: readable
    # until the socket is read. _readable stops watching it and schedules one ingest cycle
    # COALESCE_S later for every socket that signalled meanwhile; a socket read to the end is
    # watched again. One timer callback per cycle for every instance's messages, instead of a
    # task wakeup (and pyzmq's futures) per message.

    def _arm(self, s: "_Subscription") -> None:
        zmq = _zmq()
        s.loop.add_reader(s.fd, self._readable, s)
        s.armed = True
        if s.raw.getsockopt(zmq.EVENTS) & zmq.POLLIN:  # (a message came before the watch)
            self._readable(s)

    def _disarm(self, s: "_Subscription") -> None:
        if s.armed:
            s.loop.remove_reader(s.fd)
            s.armed = False
        self._ready.pop(s.instance, None)

    def _readable(self, s: "_Subscription") -> None:
        if s.armed:
            s.loop.remove_reader(s.fd)
            s.armed = False
        self._ready[s.instance] = s
        self._schedule(s.loop, COALESCE_S)

    def _schedule(self, loop: asyncio.AbstractEventLoop, delay: float) -> None:
        if self._timer is None:
            wait = max(delay, self._next_ingest - time.perf_counter())
            self._timer = loop.call_later(wait, self._cycle)

    def _cycle(self) -> None:
        """Read and apply every ready socket's messages, within :data:`SLICE_S` in all."""
        self._timer = None
        self.cycles += 1
        zmq = _zmq()
        perf = time.perf_counter
        now = self._clock()
        t0 = perf()
        deadline = t0 + SLICE_S
        ready, self._ready = self._ready, {}
        skipped: list[_Subscription] = []  # not reached in this cycle: first in the next
        partial: list[_Subscription] = []  # read until the budget ran out: after them
        for s in ready.values():
            if s.shed.done():
                continue
            if perf() >= deadline:
                skipped.append(s)
                continue
            start = perf()
            try:
                more = self._drain(s, now, deadline, zmq)
            except Exception:  # (a bug: one instance's must not stop the others' ingest)
                last = self._failed_at.get(s.instance)
                if last is None or time.monotonic() - last >= ERROR_LOG_INTERVAL_S:
                    self._failed_at[s.instance] = time.monotonic()
                    log.exception("kv events %s: applying a message failed; resetting its state (logged at most "
                                  "every %.0f s)", s.instance, ERROR_LOG_INTERVAL_S)
                s.stream.reset("an error while applying a message", now)
                more = False
            end = perf()
            self.busy_s[s.instance] += end - start
            if more:
                partial.append(s)
                if s.streak_since is None:
                    s.streak_since = start
                elif end - s.streak_since >= FLOOD_S:
                    s.shed.set_result(None)  # _run sheds it
            else:
                s.streak_since = None
                self._arm(s)
        end = perf()
        took = end - t0
        self._rest_after(end, took)
        if skipped or partial:
            left = skipped + partial
            self._ready = {**{s.instance: s for s in left}, **self._ready}
            self._schedule(left[0].loop, 0.0)

    def _rest_after(self, end: float, took: float) -> None:
        """No ingest before the loop has had the rest of :data:`INGEST_DUTY`'s share
        after ``took`` seconds of ingest that ended at ``end`` (``time.perf_counter()``)."""
        self._next_ingest = max(self._next_ingest, end + took * (1 - INGEST_DUTY) / INGEST_DUTY)

    def _drain(self, s: "_Subscription", now: float, deadline: float, zmq: Any) -> bool:
        """Apply ``s``'s waiting messages until none is left (False) or ``deadline`` (True)."""
        stream, recv, perf = s.stream, s.raw.recv_multipart, time.perf_counter
        while perf() < deadline:
            try:
                frames = recv(flags=zmq.NOBLOCK)
            except zmq.Again:
                return False
            self.messages += 1
            before = stream.mode
            for action in stream.on_message(frames, now):
                if isinstance(action, RequestReplay) and s.ep.replay_endpoint is not None:
                    task = asyncio.create_task(self._replay(stream, s.ep.replay_endpoint, action.start_seq,
                                                            s.instance), name=f"kv-events-replay {s.instance}")
                    s.replays.add(task)
                    task.add_done_callback(s.replays.discard)
            if stream.mode is not before:
                log.info("kv events %s: %s (%s)", s.instance, stream.mode.value, stream.reason)
        return True

    async def _replay(self, stream: InstanceStream, endpoint: str, start: int, instance: str) -> None:
        zmq = _zmq()
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.setsockopt(zmq.RCVHWM, 0)
        batches: list[tuple[int, bytes]] = []
        ok = False
        try:
            dealer.connect(endpoint)
            await dealer.send_multipart([b"", start.to_bytes(8, "big")])
            timeout = self.config.replay_timeout_s
            while True:
                frames = await asyncio.wait_for(dealer.recv_multipart(), timeout)
                if len(frames) != 3 or len(frames[1]) != 8:
                    log.warning("kv events %s: malformed replay frame (%d frames); giving the replay up",
                                instance, len(frames))
                    break
                if frames[1] == _END_SEQ:
                    ok = True
                    break
                batches.append((int.from_bytes(frames[1], "big"), frames[2]))
        except asyncio.TimeoutError:
            log.warning("kv events %s: replay from %d: no answer within %.1f s", instance, start,
                        self.config.replay_timeout_s)
        except zmq.ZMQError as exc:
            log.warning("kv events %s: replay from %d failed: %s", instance, start, exc)
        finally:
            dealer.close(linger=0)
        now = self._clock()
        if ok:
            stream.on_replay(batches, now)
        else:
            stream.on_replay_failed(now)
        perf = time.perf_counter
        t0 = perf()
        while stream.drain(_DRAIN_STEP):
            if perf() - t0 >= SLICE_S:
                end = perf()
                took = end - t0
                self.busy_s[instance] = self.busy_s.get(instance, 0.0) + took
                self._rest_after(end, took)
                await asyncio.sleep(max(0.0, self._next_ingest - perf()))
                t0 = perf()
        self.busy_s[instance] = self.busy_s.get(instance, 0.0) + perf() - t0
        log.info("kv events %s: replay from %d %s (%d batches); %s", instance, start,
                 "applied" if ok else "failed", len(batches), stream.mode.value)

    # -- status -------------------------------------------------------------------------

    def modes(self) -> dict[str, Mode]:
        """Each subscribed instance's mode."""
        return {i: self.view.mode(i) for i in self._tasks}


@dataclass(slots=True, eq=False)
class _Subscription:
    """One instance's socket as the ingest cycle sees it."""

    instance: str
    stream: InstanceStream
    ep: KvEventsEndpoint
    raw: Any  # the zmq.Socket (a shadow of the asyncio one)
    fd: int
    replays: set[asyncio.Task[None]]
    shed: asyncio.Future[None]  # set when the publisher floods
    armed: bool = False  # its file descriptor is watched
    streak_since: float | None = None  # back-to-back cycles that left messages, since then

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        return self.shed.get_loop()


def _reachable(endpoint: str, instance: str) -> str:
    """An endpoint as published (``tcp://*:5557``, ``tcp://0.0.0.0:5557``) made one to
    connect to, with the instance URL's host in place of a wildcard."""
    from urllib.parse import urlsplit

    if endpoint.startswith("tcp://"):
        host, sep, port = endpoint[len("tcp://"):].rpartition(":")
        if host in ("*", "0.0.0.0", "[::]", "::", ""):
            h = urlsplit(instance).hostname or "127.0.0.1"
            endpoint = f"tcp://{'[' + h + ']' if ':' in h else h}:{port}"
    return check_zmq_endpoint(endpoint, "endpoint")
