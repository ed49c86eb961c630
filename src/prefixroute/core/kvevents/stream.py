"""One instance's event stream: sequence numbers, gaps, replay, restarts, and its mode.

Sans-I/O: the driver (:mod:`prefixroute.server.kv_subscriber`) hands over what its
sockets received and the time, and carries out the :class:`RequestReplay` actions this
returns; nothing here blocks, sleeps or reads a clock.

The rules (vLLM numbers batches from 0 at every start, 8 bytes big-endian):

* **in order** (``seq == expected``): applied.
* **a gap** (``seq > expected``): messages were lost (a slow subscriber, the network).
  With a replay endpoint, ask for ``expected`` onwards and hold the live messages meanwhile
  (at most ``max_pending``); the replay's batches, then the held ones, are applied in
  order. If the replay does not reach back to ``expected`` (the engine's buffer moved on),
  fails or times out, or if gaps come faster than one replay per
  ``min_replay_interval_s`` (a flood), the instance's state is **reset** (forgotten: a
  missed removal must not leave a block that is gone) and rebuilt from what comes next.
  Without a replay endpoint, a gap is a reset.
* **going back** (``seq < expected``): the engine restarted (a new sequence from 0): reset,
  and catch up on the new engine's history through replay when there is one.
* **first contact** (and after a reset that replay can repair): a batch with ``seq > 0``
  means history was published before; with a replay endpoint the history still buffered
  is fetched (``start_seq`` 0) and applied first. A history that starts after 0 is
  applied as it is: blocks stored before it are simply unknown (never a false hit).
* **a reconnection** (the driver saw the TCP connection drop and come back): the next
  batch must continue the old sequence exactly; anything else means the engine may
  have restarted meanwhile, so its state is reset and caught up from 0.

**Mode**: an instance is ``precise`` while its stream is connected and its state is
complete as far as the router can tell; ``approximate`` before the first connection,
while disconnected, from a (re)connection until its first message (the engine may have
stored blocks before the router listened, or restarted while it was away: the message's
sequence number tells), and while a replay is repairing its state (the routing policy then
falls back to its own learned state for that instance). ``reason`` says why.
"""

from __future__ import annotations

import enum
import logging
from collections import deque
from dataclasses import dataclass

from prefixroute.core.kvevents.codec import MalformedBatch, decode_batch
from prefixroute.core.kvevents.fast_codec import decode_events
from prefixroute.core.kvevents.index import InstanceIndex

__all__ = ["Mode", "RequestReplay", "StreamSettings", "InstanceStream", "WARN_INTERVAL_S"]

log = logging.getLogger("prefixroute.kv_events")

#: Seconds between two warnings of one kind about one instance's messages.
WARN_INTERVAL_S = 10.0


class Mode(str, enum.Enum):
    """Which state the routing policy should use for an instance."""

    PRECISE = "precise"
    APPROXIMATE = "approximate"


@dataclass(frozen=True, slots=True)
class RequestReplay:
    """Action: ask the instance's replay endpoint for every batch from ``start_seq`` on."""

    start_seq: int


@dataclass(frozen=True, slots=True)
class StreamSettings:
    """How a stream repairs itself (validated by :class:`~.config.KvEventsConfig`).

    Attributes:
        replay: the instance has a replay endpoint.
        max_pending: live messages held while a replay runs; past it the replay is
            abandoned and the state reset.
        min_replay_interval_s: a gap sooner than this after the last replay's start
            resets instead of replaying (a flooding publisher cannot make the router
            replay without end).
    """

    replay: bool = True
    max_pending: int = 10_000
    min_replay_interval_s: float = 1.0


@dataclass(slots=True)
class _Counts:
    messages: int = 0
    gaps: int = 0
    replays: int = 0
    replays_failed: int = 0
    resets: int = 0
    restarts: int = 0


class InstanceStream:
    """The stream of one instance (see the module docstring).

    Args:
        instance_id: the instance (its base URL), for logs.
        index: its :class:`~.index.InstanceIndex`.
        settings: the :class:`StreamSettings`.

    Attributes:
        index: the instance's state.
        expected: the next sequence number expected, ``None`` before the first batch.
        connected: the driver's view of the connection.
        counts: messages, gaps, replays (and failures), resets, restarts seen.
        last_message_at: the driver's clock at the last message, or ``None``.
    """

    def __init__(self, instance_id: str, index: InstanceIndex, settings: StreamSettings | None = None) -> None:
        self.instance_id = instance_id
        self.index = index
        self.settings = settings or StreamSettings()
        self.expected: int | None = None
        self.connected = False
        self.ever_connected = False
        self.counts = _Counts()
        self.last_message_at: float | None = None
        self._reconnected = False
        self._confirmed = False  # a message has arrived since the last (re)connection
        self._replaying = False
        self._replay_start = 0
        self._replay_from_empty = False  # the replay rebuilds from an empty state (catch-up)
        self._replay_started_at: float | None = None
        self._pending: list[tuple[int, bytes]] = []
        self._backlog: deque[tuple[int, bytes]] = deque()  # batches to apply, in order (after a replay)
        self._reason = "never connected"
        self._off_reason = "disconnected"
        #: ``(why, when)`` of the last state reset (``when`` on the driver's clock), or ``None``.
        self.last_reset: tuple[str, float] | None = None
        self._now = 0.0
        self._warned: dict[str, float] = {}  # kind of warning -> when last logged

    # -- mode ---------------------------------------------------------------------------

    @property
    def mode(self) -> Mode:
        """``precise`` or ``approximate`` (see the module docstring)."""
        if self.connected and self._confirmed and not self._replaying and not self._backlog:
            return Mode.PRECISE
        return Mode.APPROXIMATE

    @property
    def reason(self) -> str:
        """Why the mode is what it is, in a few words."""
        if self._replaying or self._backlog:
            return "repairing a gap through replay" if not self._replay_from_empty else "catching up through replay"
        if not self.connected:
            return "never connected" if not self.ever_connected else self._off_reason
        if not self._confirmed:  # what the engine stored meanwhile (or a restart) shows with its next message
            return "reconnected, no event since" if self.expected is not None else "connected, no event yet"
        return self._reason

    @property
    def replaying(self) -> bool:
        """A replay is in progress (its frames are expected)."""
        return self._replaying

    @property
    def backlog(self) -> int:
        """Batches received (a replay's, and live ones held meanwhile) not applied yet:
        :meth:`drain` applies them."""
        return len(self._backlog)

    # -- connection ---------------------------------------------------------------------

    def on_connected(self, complete: bool = False) -> None:
        """The driver's socket (re)connected to the instance's publisher (no-op while
        connected: a message may have told the stream before the socket monitor did).
        The instance stays approximate until its first message (module docstring),
        unless ``complete``: a driver that applies every change straight to the index
        (the simulator) knows the state is whole."""
        if self.connected:
            return
        if self.ever_connected and self.expected is not None:
            self._reconnected = True
        self.connected = self.ever_connected = True
        self._confirmed = complete
        self._reason = "events flowing"

    def on_disconnected(self, reason: str = "disconnected") -> None:
        """The connection dropped (the instance stopped, or the network), or the driver
        dropped it (``reason`` says why: a flooding publisher)."""
        self.connected = False
        self._off_reason = reason

    # -- live messages ------------------------------------------------------------------

    def on_message(self, frames: list[bytes], now: float) -> list[RequestReplay]:
        """A message from the PUB socket (``[topic, seq, payload]``).

        Returns the actions to carry out (a replay to ask for, or nothing).
        """
        c = self.counts
        c.messages += 1
        self.last_message_at = self._now = now
        if not self.connected:  # a message proves the connection (a driver without a monitor)
            self.on_connected()
        if len(frames) != 3 or len(frames[1]) != 8:
            self.index.counters.malformed_messages += 1
            return []
        self._confirmed = True  # its sequence number tells a gap or a restart from here on
        seq = int.from_bytes(frames[1], "big")
        payload = frames[2]
        if self._replaying:
            if len(self._pending) >= self.settings.max_pending:
                log.warning("kv events %s: %d messages arrived during a replay; giving it up and resetting",
                            self.instance_id, len(self._pending))
                self._replaying = False
                c.replays_failed += 1
                self._reset("a replay fell too far behind")
                pending, self._pending = self._pending, []
                self._backlog.extend(pending)
                self._backlog.append((seq, payload))
                return []
            self._pending.append((seq, payload))
            return []
        if self._backlog:  # keep the order: after what is still to be applied
            self._backlog.append((seq, payload))
            return []
        reconnected, self._reconnected = self._reconnected, False
        expected = self.expected
        if expected is None:
            return self._first(seq, payload, now)
        if seq == expected:
            self._apply(seq, payload)
            return []
        if seq < expected or reconnected:
            if seq < expected:
                c.restarts += 1
                log.info("kv events %s: sequence went back from %d to %d: the engine restarted", self.instance_id,
                         expected, seq)
            else:
                log.info("kv events %s: after a reconnection the sequence jumped from %d to %d: resetting",
                         self.instance_id, expected, seq)
            self._reset("engine restarted" if seq < expected else "reconnected with a gap")
            return self._first(seq, payload, now)
        c.gaps += 1
        return self._gap(expected, seq, payload, now)

    def _first(self, seq: int, payload: bytes, now: float) -> list[RequestReplay]:
        """The first batch since start-up or a reset (the state is empty)."""
        if seq > 0 and self.settings.replay and self._may_replay(now):
            return self._start_replay(0, [(seq, payload)], from_empty=True, now=now)
        self._apply(seq, payload)
        return []

    def _gap(self, expected: int, seq: int, payload: bytes, now: float) -> list[RequestReplay]:
        if self.settings.replay and self._may_replay(now):
            log.info("kv events %s: gap (expected %d, got %d): asking for a replay", self.instance_id, expected, seq)
            return self._start_replay(expected, [(seq, payload)], from_empty=False, now=now)
        self._warn("gap", "kv events %s: gap (expected %d, got %d) that replay cannot repair: resetting (further "
                          "such warnings within %.0f s are not logged)", expected, seq, WARN_INTERVAL_S)
        self._reset("gap without replay")
        self._apply(seq, payload)
        return []

    def _may_replay(self, now: float) -> bool:
        started = self._replay_started_at
        return started is None or now - started >= self.settings.min_replay_interval_s

    def _start_replay(self, start: int, pending: list[tuple[int, bytes]], *, from_empty: bool,
                      now: float) -> list[RequestReplay]:
        self._replaying = True
        self._replay_start = start
        self._replay_from_empty = from_empty
        self._replay_started_at = now
        self._pending = pending
        self.counts.replays += 1
        return [RequestReplay(start)]

    # -- replay -------------------------------------------------------------------------

    def on_replay(self, batches: list[tuple[int, bytes]], now: float) -> list[RequestReplay]:
        """A replay answered: its ``(seq, payload)`` batches in order (the end marker
        already removed). Queues them, then the messages held meanwhile, for
        :meth:`drain` (a replay may hold 10,000 batches: the driver applies them in
        slices so that its event loop stays free)."""
        if not self._replaying:
            return []
        self._now = now
        self._replaying = False
        c = self.counts
        if not self._replay_from_empty:
            first = batches[0][0] if batches else None
            if first != self._replay_start:
                # The engine's buffer no longer reaches back to the gap: what was lost is lost.
                c.replays_failed += 1
                log.warning("kv events %s: replay from %d started at %s: resetting", self.instance_id,
                            self._replay_start, first)
                self._reset("replay could not repair a gap")
        pending, self._pending = self._pending, []
        self._backlog.extend(batches)
        self._backlog.extend(pending)
        return []

    def on_replay_failed(self, now: float) -> list[RequestReplay]:
        """The replay request failed or timed out: reset and go on with the held messages."""
        if not self._replaying:
            return []
        self._now = now
        self._replaying = False
        self.counts.replays_failed += 1
        log.warning("kv events %s: replay failed: resetting", self.instance_id)
        if not self._replay_from_empty:
            self._reset("replay failed")
        pending, self._pending = self._pending, []
        self._backlog.extend(pending)
        return []

    def drain(self, max_batches: int = 64) -> int:
        """Apply up to ``max_batches`` queued batches in order, skipping those already
        applied and resetting at any gap left (a second replay is not asked for).
        Returns how many are still queued."""
        backlog = self._backlog
        for _ in range(max_batches):
            if not backlog:
                break
            seq, payload = backlog.popleft()
            expected = self.expected
            if expected is not None and seq < expected:
                continue  # in both the replay and the live messages, or already applied
            if expected is not None and seq > expected and len(self.index):
                self.counts.gaps += 1
                self._reset("gap after a replay")
            self._apply(seq, payload)
        return len(backlog)

    # -- state --------------------------------------------------------------------------

    def _apply(self, seq: int, payload: bytes) -> None:
        self.expected = seq + 1
        index = self.index
        events = decode_events(payload)  # (in C, for a well-formed batch)
        if events is not None:
            index.apply(events)
            return
        try:
            decoded = decode_batch(payload)
        except MalformedBatch as exc:
            index.counters.malformed_messages += 1
            self._warn("malformed", "kv events %s: message %d is not an event batch (%s); ignored", seq, exc)
            return
        if decoded.unknown or decoded.malformed:
            index.counters.unknown_events += decoded.unknown
            index.counters.malformed_events += decoded.malformed
            self._warn("events", "kv events %s: message %d: %d unknown and %d malformed events ignored (%s)",
                       seq, decoded.unknown, decoded.malformed, "; ".join(decoded.problems))
        index.apply(decoded.batch.events)

    def _warn(self, kind: str, msg: str, *args: object) -> None:
        """Log a warning about what the engine sent, at most once per
        :data:`WARN_INTERVAL_S` per kind (a flood of bad messages must not flood the log;
        the counters count every one)."""
        last = self._warned.get(kind)
        if last is None or self._now - last >= WARN_INTERVAL_S:
            self._warned[kind] = self._now
            log.warning(msg, self.instance_id, *args)

    def _reset(self, why: str) -> None:
        self.index.clear()
        self.expected = None
        self.counts.resets += 1
        self.last_reset = (why, self._now)
        self._reason = "events flowing"

    def reset(self, why: str, now: float | None = None) -> None:
        """Forget the instance's state (e.g. its engine was seen restarting by other means);
        ``now``: the driver's clock (the time of the last message if not given)."""
        if now is not None:
            self._now = now
        self._replaying = False
        self._pending = []
        self._backlog.clear()
        self._reset(why)
        self._confirmed = True  # empty, as the engine that restarted is
