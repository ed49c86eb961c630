"""Publishing an emulated engine's KV events over ZeroMQ, as vLLM's ``ZmqEventPublisher``.

The wire (``vllm/distributed/kv_events.py``):

* a **PUB** socket sends each batch as three frames ``[topic, seq, payload]``: the
  topic (UTF-8, ``""`` by default), the sequence number as 8 bytes big-endian (0 for
  the first batch after start-up, then +1 per batch) and the msgpack payload
  (:func:`prefixroute.core.kvevents.codec.encode_batch`, positional-array or map form);
* a **ROUTER** socket serves replay: a DEALER sends ``[b"", start_seq]`` (8 bytes
  big-endian) and gets, for every batch still buffered with ``seq >= start_seq``, the
  frames ``[b"", seq, payload]``, then ``[b"", -1 (8 bytes, signed), b""]``. The last
  ``buffer_steps`` batches are kept (10,000 by default).

An endpoint with ``*``, ``::``, ``ipc://`` or ``inproc://`` is bound, any other is
connected to (vLLM's rule: a router may bind and let engines connect). ``tcp://HOST:*``
binds a free port; :attr:`KvEventPublisher.endpoint` then tells which.

Sending never blocks the engine: the PUB socket drops what a slow subscriber cannot
take past its high-water mark (the subscriber sees a gap in the sequence and asks for
a replay), and replay is served by its own task.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import orjson

from prefixroute.core.kvevents.codec import ENCODINGS, Encoding, encode_batch
from prefixroute.core.kvevents.events import EventBatch, KvEvent

__all__ = ["KvEventsSettings", "KvEventPublisher", "END_SEQ", "binds"]

log = logging.getLogger("prefixroute.engine.kv_events")

#: The sequence frame that ends a replay: -1 as 8 bytes, big-endian, signed.
END_SEQ = (-1).to_bytes(8, "big", signed=True)
_VLLM_KEYS = {"enable_kv_cache_events", "publisher", "endpoint", "replay_endpoint", "topic", "buffer_steps", "hwm",
              "max_queue_size"}


def binds(endpoint: str) -> bool:
    """True when a publisher binds ``endpoint`` rather than connecting to it (vLLM's rule)."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


@dataclass(frozen=True, slots=True)
class KvEventsSettings:
    """Validated settings of an engine's KV-event publisher.

    Attributes:
        endpoint: the PUB socket's ZeroMQ endpoint (vLLM's default ``tcp://*:5557``).
        replay_endpoint: the replay ROUTER's endpoint (always bound), or ``None``: no
            replay.
        topic: the first frame of every message.
        buffer_steps: batches kept for replay, >= 1.
        hwm: the PUB socket's high-water mark, messages per subscriber.
        encoding: ``"array"`` (vLLM's positional arrays, the releases seen so far) or
            ``"map"`` (the newer form).
        hash_seed: ``NONE_HASH`` of the published block hashes (``None``: random at
            start-up, as vLLM without ``PYTHONHASHSEED``).
    Raises:
        ValueError: on construction, for an endpoint that is not ``tcp://``,
            ``ipc://`` or ``inproc://``, a bad encoding, or a count < 1.
    """

    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    topic: str = ""
    buffer_steps: int = 10_000
    hwm: int = 100_000
    encoding: Encoding = "array"
    hash_seed: int | None = None

    def __post_init__(self) -> None:
        for name in ("endpoint", "replay_endpoint"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, str) and value.startswith(("tcp://", "ipc://",
                                                                                         "inproc://"))):
                raise ValueError(f"kv events {name}: {value!r} is not a tcp://, ipc:// or inproc:// endpoint")
        if self.encoding not in ENCODINGS:
            raise ValueError(f"kv events encoding: {self.encoding!r} is not one of {', '.join(ENCODINGS)}")
        for name in ("buffer_steps", "hwm"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"kv events {name}: {value!r} must be an integer >= 1")
        if not isinstance(self.topic, str):
            raise ValueError("kv events topic must be a string")
        if self.hash_seed is not None and not 0 <= self.hash_seed < 2**64:
            raise ValueError(f"kv events hash seed: {self.hash_seed} is not in [0, 2**64)")

    @classmethod
    def from_vllm_config(cls, text: str, *, encoding: Encoding = "array",
                         hash_seed: int | None = None) -> "KvEventsSettings | None":
        """Parse vLLM's ``--kv-events-config`` JSON.

        Keys: ``enable_kv_cache_events`` (false or absent: no events, returns ``None``),
        ``publisher`` (``"zmq"``; ``"null"`` returns ``None``), ``endpoint``,
        ``replay_endpoint``, ``topic``, ``buffer_steps``, ``hwm``, ``max_queue_size``
        (accepted, unused: publishing is never queued here).

        Raises:
            ValueError: not a JSON object, an unknown key or publisher, a bad value.
        """
        try:
            doc: Any = orjson.loads(text)
        except orjson.JSONDecodeError as exc:
            raise ValueError(f"--kv-events-config is not valid JSON: {exc}") from None
        if not isinstance(doc, dict):
            raise ValueError("--kv-events-config must be a JSON object")
        unknown = set(doc) - _VLLM_KEYS
        if unknown:
            raise ValueError(f"--kv-events-config: unknown key(s) {sorted(unknown)} (known: {sorted(_VLLM_KEYS)})")
        if not doc.get("enable_kv_cache_events", False):
            return None
        publisher = doc.get("publisher", "zmq")
        if publisher == "null":
            return None
        if publisher != "zmq":
            raise ValueError(f"--kv-events-config: publisher {publisher!r} is not 'zmq' or 'null'")
        fields = {k: doc[k] for k in ("endpoint", "replay_endpoint", "topic", "buffer_steps", "hwm") if k in doc}
        return cls(**fields, encoding=encoding, hash_seed=hash_seed)


class KvEventPublisher:
    """The PUB and replay sockets of one engine (see the module docstring).

    Args:
        settings: the validated :class:`KvEventsSettings`.

    Use: ``await start()`` in the running event loop, :meth:`publish` after each step
    with events, ``await close()`` at the end.
    """

    def __init__(self, settings: KvEventsSettings) -> None:
        self.settings = settings
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=settings.buffer_steps)
        self._seq = 0
        self._topic = settings.topic.encode("utf-8")
        self._ctx: Any = None
        self._pub: Any = None
        self._replay: Any = None
        self._task: asyncio.Task[None] | None = None
        #: The PUB endpoint as bound (the port filled in) or connected to.
        self.endpoint = settings.endpoint
        #: The replay endpoint as bound, or ``None``.
        self.replay_endpoint = settings.replay_endpoint
        #: Batches published since start-up.
        self.published = 0
        #: Replay requests served.
        self.replays_served = 0

    async def start(self) -> None:
        """Bind or connect the sockets and start serving replay.

        Raises:
            zmq.ZMQError: an endpoint cannot be bound or is invalid.
            ImportError: ``pyzmq`` is missing (the ``precise`` extra).
        """
        import zmq
        import zmq.asyncio

        self._ctx = zmq.asyncio.Context()
        try:
            pub = self._ctx.socket(zmq.PUB)
            pub.setsockopt(zmq.SNDHWM, self.settings.hwm)
            pub.setsockopt(zmq.LINGER, 0)
            self._pub = pub
            if binds(self.settings.endpoint):
                pub.bind(self.settings.endpoint)
                self.endpoint = pub.getsockopt_string(zmq.LAST_ENDPOINT)
            else:
                pub.connect(self.settings.endpoint)
            if self.settings.replay_endpoint is not None:
                replay = self._ctx.socket(zmq.ROUTER)
                # Every buffered batch of one replay must fit in the peer's queue.
                replay.setsockopt(zmq.SNDHWM, self.settings.buffer_steps + 16)
                replay.setsockopt(zmq.LINGER, 0)
                self._replay = replay
                replay.bind(self.settings.replay_endpoint)
                self.replay_endpoint = replay.getsockopt_string(zmq.LAST_ENDPOINT)
                self._task = asyncio.create_task(self._serve_replay(), name="kv-events-replay")
        except BaseException:
            await self.close()
            raise
        log.info("KV events published on %s (replay: %s, encoding: %s)", self.endpoint, self.replay_endpoint,
                 self.settings.encoding)

    def publish(self, events: list[KvEvent], ts: float | None = None) -> int:
        """Send one batch; returns its sequence number. Never blocks (see module doc)."""
        import zmq

        seq = self._seq
        self._seq += 1
        payload = encode_batch(EventBatch(time.time() if ts is None else ts, events, None), self.settings.encoding)
        self._buffer.append((seq, payload))
        self.published += 1
        if self._pub is not None:
            with contextlib.suppress(zmq.Again):
                self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload), flags=zmq.NOBLOCK)
        return seq

    async def _serve_replay(self) -> None:
        import zmq

        sock = self._replay
        while True:
            frames = await sock.recv_multipart()
            if len(frames) != 3 or len(frames[2]) != 8:
                log.warning("ignored a malformed replay request (%d frames)", len(frames))
                continue
            client, _, start = frames
            first = int.from_bytes(start, "big")
            try:
                for seq, payload in list(self._buffer):
                    if seq >= first:
                        await sock.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
                await sock.send_multipart((client, b"", END_SEQ, b""))
            except zmq.ZMQError as exc:
                log.warning("replay to a subscriber failed: %s", exc)
            self.replays_served += 1

    async def close(self) -> None:
        """Stop serving replay and close the sockets (nothing is lingered over)."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close(linger=0)
        self._pub = self._replay = None
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None
