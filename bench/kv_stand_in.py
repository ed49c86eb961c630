"""KV events for ``bench/fast_backend.py``: what an engine's prefix cache would publish
for the requests the fast backend answers, so that precise mode's cost can be measured
(``bench/overhead.py``'s ``prefixroute CACHE_AWARE precise``).

Per port (one stand-in engine), a vLLM-style publisher (``prefixroute.engine.kv_publisher``:
PUB and replay sockets, bound on loopback free ports, the positional-array encoding)
and a model of a warm, full prefix cache:

* **A prompt's chain**: the first request of a body on a port stores the full blocks of
  its prompt (the body's chat template applied and tokenized with the bundled ``tiny``
  tokenizer, as the router matches it; ``block_size`` tokens a block); a request of that
  body ``restore_s`` seconds or more after its chain was stored evicts the chain and
  stores it again under new block hashes (a cache under pressure drops and recomputes a
  document now and then; a router that subscribed late catches up within ``restore_s``),
  as far as the engine's prefill throughput allows: at most ``prefill_tokens_per_s``
  tokens a second are stored again (28,000: the emulated engine's 35 µs a token, a
  Llama-3.1-70B on 8 H100s), the rest wait.
* **Answer blocks**: a request stores one block under its prompt's last full block (16
  tokens of its own, :func:`answer_tokens`; a new block hash) and, past ``answer_window`` of them, the
  oldest is removed (an engine that evicts as much as it stores); at most
  ``answers_per_step`` a step (a step of a batch of 64 sequences fills about 4 blocks:
  one every 16 decode steps per sequence), so that the event rate is an engine's, not
  the rate this backend answers at (thousands of requests a second, far beyond an engine).
* **One batch per step**: events accumulate and are published every ``step_s``
  seconds (vLLM publishes one batch per scheduler step; 20 ms is a decode step of a
  large model at a full batch), not one message per request. The replay socket keeps
  the last ``buffer_steps`` batches (200: 4 s).

A body is parsed and tokenized once (the first time it arrives on any port, on the
backend's event loop: about 130 ms for 256 KB); after that a request costs a copy and a
digest of its body and at most three events. The cost to
the backend is counted in its CPU per request, which ``bench/overhead.py`` reports.

Needs the ``precise`` extra (pyzmq, msgpack, tokenizers, jinja2).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Sequence

import xxhash

__all__ = ["KvStandIn", "PortCache", "answer_tokens"]

#: Distinct request bodies a stand-in engine remembers (see :class:`PortCache`).
MAX_BODIES = 4096

#: Token ids answers are drawn from (the tiny tokenizer's vocabulary has 810).
_ANSWER_IDS = range(100, 800)


def answer_tokens(n: int, block_size: int = 16) -> list[int]:
    """The ``n``-th answer block's token ids: a different block for each ``n`` (up to
    700 ** 2 of them), as sampled answers are."""
    span = len(_ANSWER_IDS)
    return [_ANSWER_IDS[(n + i * (n // span + 1)) % span] for i in range(block_size)]


@dataclass
class _Chain:
    hashes: list[int]
    stored_at: float


@dataclass
class PortCache:
    """One stand-in engine's cache model (sans-I/O: :meth:`on_request` returns events).

    Args:
        token_ids: ``(body, chat) -> token ids`` of a request body (the engine's view).
        block_size: tokens per block.
        restore_s: seconds after which a body's next request re-stores its chain, > 0.
        answer_window: answer blocks held before the oldest is removed, >= 1.
        answers_per_step: answer blocks stored per step (:meth:`step`), >= 0.
        prefill_tokens_per_s: tokens a second a chain may be stored again at, > 0.
        hash_base: the first engine block hash (one per port, so ports never share one).
        token_cache: body digest -> token ids, shared by the ports (a body is tokenized once).

    At most :data:`MAX_BODIES` distinct bodies are remembered (tokens and chains; the
    oldest forgotten first, as an engine's cache forgets them): a run with endless
    distinct bodies does not grow the backend without bound.
    """

    token_ids: Any
    block_size: int = 16
    restore_s: float = 2.0
    answer_window: int = 256
    answers_per_step: int = 4
    prefill_tokens_per_s: float = 28_000.0
    hash_base: int = 1 << 40
    chains: dict[int, _Chain] = field(default_factory=dict)
    token_cache: dict[int, list[int]] = field(default_factory=dict)
    _answers: deque[int] = field(default_factory=deque)
    _next: int = 0
    _answered: int = 0
    _budget: float = 0.0  # tokens that may be stored again now
    _budget_at: float | None = None

    def _new_hash(self) -> int:
        self._next += 1
        return self.hash_base + self._next

    def step(self) -> None:
        """A new engine step: answer blocks may be stored again."""
        self._answered = 0

    def on_request(self, body: bytes, chat: bool, now: float) -> list[Any]:
        """The events answering ``body`` at ``now`` (seconds, monotonic) adds to the cache, in order."""
        from prefixroute.core.kvevents.events import BlockRemoved, BlockStored

        digest = xxhash.xxh3_64_intdigest(body)
        ids = self.token_cache.get(digest)
        if ids is None:
            ids = self.token_cache[digest] = self.token_ids(body, chat)
            while len(self.token_cache) > MAX_BODIES:
                del self.token_cache[next(iter(self.token_cache))]
        bs = self.block_size
        n = len(ids) // bs
        events: list[Any] = []
        chain = self.chains.get(digest)
        rate = self.prefill_tokens_per_s
        if self._budget_at is not None:
            self._budget = min(rate * self.restore_s, self._budget + rate * (now - self._budget_at))
        self._budget_at = now
        restore = chain is None  # (a first store always happens: the budget may go below 0)
        if chain is not None and now - chain.stored_at >= self.restore_s and self._budget >= n * bs:
            restore = True
        if restore:
            self._budget -= n * bs
            if chain is not None and chain.hashes:
                events.append(BlockRemoved(chain.hashes))
            hashes = [self._new_hash() for _ in range(n)]
            if hashes:
                events.append(BlockStored(hashes, None, ids[:n * bs], bs))
            chain = self.chains[digest] = _Chain(hashes, now)
            while len(self.chains) > MAX_BODIES:  # (its blocks are evicted with it)
                old = self.chains.pop(next(iter(self.chains)))
                if old.hashes:
                    events.append(BlockRemoved(old.hashes))
        if self._answered < self.answers_per_step:
            self._answered += 1
            h = self._new_hash()
            events.append(BlockStored([h], chain.hashes[-1] if chain.hashes else None, answer_tokens(self._next, bs),
                                      bs))
            self._answers.append(h)
            if len(self._answers) > self.answer_window:
                events.append(BlockRemoved([self._answers.popleft()]))
        return events


class KvStandIn:
    """Every port's :class:`PortCache` and publisher, and the step that publishes.

    Args:
        ports: the backend's HTTP ports, one stand-in engine each.
        step_s: seconds between two published batches per port (> 0).
        restore_s, answer_window, answers_per_step: see :class:`PortCache`.
        buffer_steps: batches each replay socket keeps, >= 1.

    Use: ``await start()``, :meth:`on_request` per answered request, ``await close()``.
    :attr:`endpoints` maps each port to its ``(PUB endpoint, replay endpoint)``.

    Raises:
        ImportError: the ``precise`` extra is missing (on :meth:`start`).
    """

    def __init__(self, ports: Sequence[int], *, step_s: float = 0.020, restore_s: float = 2.0,
                 answer_window: int = 256, answers_per_step: int = 4, buffer_steps: int = 200) -> None:
        if not (step_s > 0 and restore_s > 0) or answer_window < 1 or answers_per_step < 0 or buffer_steps < 1:
            raise ValueError("step_s and restore_s must be > 0, answer_window and buffer_steps >= 1, "
                             "answers_per_step >= 0")
        from prefixroute.core.model_tokenizer import ModelTokenizer

        tokenizer = ModelTokenizer.load("tiny")

        def token_ids(body: bytes, chat: bool) -> list[int]:
            return tokenizer.request_token_ids(json.loads(body), chat)

        self.step_s = step_s
        self.buffer_steps = buffer_steps
        shared: dict[int, list[int]] = {}
        self.caches = {p: PortCache(token_ids, restore_s=restore_s, answer_window=answer_window,
                                    answers_per_step=answers_per_step, hash_base=(i + 1) << 48, token_cache=shared)
                       for i, p in enumerate(ports)}
        self._pending: dict[int, list[Any]] = {p: [] for p in ports}
        self._publishers: dict[int, Any] = {}
        self.endpoints: dict[int, tuple[str, str]] = {}
        self._task: asyncio.Task[None] | None = None
        #: Batches and events published, all ports.
        self.batches = 0
        self.events = 0
        #: Request bodies that could not be tokenized (no events).
        self.untokenizable = 0

    async def start(self) -> None:
        from prefixroute.engine.kv_publisher import KvEventPublisher, KvEventsSettings

        for port in self.caches:
            pub = KvEventPublisher(KvEventsSettings(endpoint="tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*",
                                                    buffer_steps=self.buffer_steps))
            await pub.start()
            self._publishers[port] = pub
            self.endpoints[port] = (pub.endpoint, pub.replay_endpoint or "")
        self._task = asyncio.create_task(self._steps(), name="kv-stand-in-steps")

    def on_request(self, port: int, body: bytes, chat: bool) -> None:
        """Record what answering ``body`` on ``port`` stored and evicted (nothing for a
        body the tokenizer cannot take: counted in :attr:`untokenizable`)."""
        try:
            events = self.caches[port].on_request(body, chat, time.monotonic())
        except Exception:  # not JSON, not a chat or completions request: an engine would answer 400
            self.untokenizable += 1
            return
        self._pending[port].extend(events)

    def flush(self) -> None:
        """Publish every port's pending events as one batch each."""
        for port, events in self._pending.items():
            self.caches[port].step()
            if events:
                self._publishers[port].publish(events)
                self.batches += 1
                self.events += len(events)
                self._pending[port] = []

    async def _steps(self) -> None:
        while True:
            await asyncio.sleep(self.step_s)
            self.flush()

    def stats(self) -> dict[str, int]:
        """Counters for the backend's ``GET /stats``."""
        return {"batches": self.batches, "events": self.events, "untokenizable": self.untokenizable,
                "bodies_tokenized": len(next(iter(self.caches.values())).token_cache) if self.caches else 0}

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        for pub in self._publishers.values():
            await pub.close()
