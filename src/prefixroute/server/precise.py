"""Precise mode on the request path: a ``CACHE_AWARE`` request's KV block keys, computed
once in :func:`prefixroute.server.app.prepare_inference` (so every data plane, and the
Envoy endpoint picker, which share it, route alike) and carried on its routing chain
(``blocks.precise``) to the strategy (:mod:`prefixroute.core.precise_policy`)."""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Mapping

from prefixroute.core.block_chain import BlockChain
from prefixroute.core.precise_keys import RequestKeyer, TokenizeLater
from prefixroute.core.precise_policy import PreciseRequest
from prefixroute.core.routing_text import InvalidRequest

if TYPE_CHECKING:
    from prefixroute.server.state import RouterState

__all__ = ["attach_precise", "OffPathTokenizer", "MAX_PENDING_PIECES"]

log = logging.getLogger("prefixroute.kv_events")
_WARN_INTERVAL_S = 10.0
_last_warning = 0.0


def attach_precise(state: "RouterState", payload: Mapping[str, Any], chat: bool, blocks: object) -> bool:
    """Give ``blocks`` (a ``CACHE_AWARE`` request's chain) the request's precise-mode
    data when precise mode can use it: a tokenizer is configured and at least one
    instance's events are flowing. The LoRA adapter is the request's ``model`` when the
    engines' events name it (:meth:`~prefixroute.core.kvevents.view.PreciseCacheView.lora_name`).

    With ``KvEvents.Matching: bytes`` (a byte-level tokenizer) the request is matched by
    its bytes, never tokenized (:meth:`~prefixroute.core.precise_keys.RequestKeyer.match_bytes`);
    else it is tokenized (:meth:`~prefixroute.core.precise_keys.RequestKeyer.keys`).

    Returns:
        Whether the data was attached. A chat request with an image, audio or file part
        is routed on the learned view: an engine keys the blocks holding such a part by
        the media's own hash (vLLM's ``extra_keys``), which the router does not compute,
        so none of them would match. A request the tokenizer cannot render (an unknown
        message shape, no chat template) is routed on the learned view too and the
        engine judges it; a warning (never the prompt) is logged at most every 10 s.
    """
    keyer, view = state.kv_keyer, state.kv_view
    if keyer is None or view is None or not isinstance(blocks, BlockChain) or not view.any_precise():
        return False
    if chat and _has_media(payload):
        return False
    off_path = state.kv_tokenize
    try:
        lora = view.lora_name(payload.get("model"))
        if keyer.token_bytes is not None and view.byte_index is not None:  # Matching: bytes
            keys, tokens = keyer.match_bytes(payload, chat, view, lora)
        else:
            kv = state.config.kv_events
            inline = (kv.inline_tokenize_chars if kv is not None and off_path is not None and off_path.usable()
                      else None)
            keys, tokens = keyer.keys(payload, chat, lora, inline_chars=inline)
    except TokenizeLater as later:  # a new document: on the learned view while a thread tokenizes it
        assert off_path is not None
        off_path.submit(keyer, later.pieces)
        return False
    except (InvalidRequest, ValueError, TypeError) as exc:
        global _last_warning
        now = time.monotonic()
        if now - _last_warning >= _WARN_INTERVAL_S:
            _last_warning = now
            log.warning("precise mode: a request was not tokenized (%s: %s); routed on the learned view",
                        type(exc).__name__, str(exc)[:120])
        return False
    blocks.precise = PreciseRequest(view, keys, tokens, view.block_size)
    return True


#: Most prompt pieces waiting for the tokenizing thread; past it a request's pieces are
#: not queued (it is routed on the learned view, and a later request queues them). One
#: request's pieces are always taken when none wait.
MAX_PENDING_PIECES = 4096


class OffPathTokenizer:
    """Tokenizes prompt pieces on one thread, off the event loop (the ``tokenizers``
    library releases the GIL; the thread runs :data:`TOKENIZE_NICENESS` nicer), and hands their token ids to the keyer on the loop
    (:meth:`~prefixroute.core.precise_keys.RequestKeyer.learn`). A piece already queued is
    not queued again, so a burst of requests naming one new document tokenizes it once.

    Attributes:
        submitted: pieces queued since start; ``dropped``: pieces not queued (the queue
        was full); ``learned``: pieces whose ids reached a keyer.
    """

    def __init__(self, max_pending: int = MAX_PENDING_PIECES) -> None:
        self.max_pending = max_pending
        self._executor: ThreadPoolExecutor | None = None
        self._pending: set[str] = set()
        self._closed = False
        self.submitted = self.dropped = self.learned = 0

    @staticmethod
    def usable() -> bool:
        """Whether pieces can be handed over: only from within a running event loop."""
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return False
        return True

    def submit(self, keyer: RequestKeyer, pieces: tuple[str, ...]) -> None:
        """Queue ``pieces`` (of a :class:`~prefixroute.core.precise_keys.TokenizeLater`)
        for ``keyer``; from the event loop's thread."""
        new = [p for p in pieces if p not in self._pending]
        if not new or self._closed:
            return
        if self._pending and len(self._pending) + len(new) > self.max_pending:
            self.dropped += len(new)  # (a later request names them again)
            return
        loop = asyncio.get_running_loop()
        if self._executor is None:
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="prefixroute-tokenize",
                                                initializer=_lower_priority)
        self._pending.update(new)
        self.submitted += len(new)
        future = self._executor.submit(keyer.tokenize_pieces, new)
        future.add_done_callback(lambda f: _call_soon(loop, self._done, keyer, new, f))

    def _done(self, keyer: RequestKeyer, pieces: list[str], future: "Future[list[list[int]]]") -> None:
        self._pending.difference_update(pieces)
        if future.cancelled():
            return
        exc = future.exception()
        if exc is not None:
            log.warning("precise mode: tokenizing %d prompt pieces failed: %s: %s", len(pieces),
                        type(exc).__name__, str(exc)[:120])
            return
        keyer.learn(pieces, future.result())
        self.learned += len(pieces)

    def close(self) -> None:
        """Stop the thread (pieces still queued are dropped); later pieces are not queued."""
        self._closed = True
        executor, self._executor = self._executor, None
        self._pending.clear()
        if executor is not None:
            executor.shutdown(wait=False, cancel_futures=True)


#: The tokenizing thread's niceness above the process's (Linux: per thread): its work is
#: off every request's path, so the event loop, and the engines sharing the machine,
#: come first.
TOKENIZE_NICENESS = 10


def _lower_priority() -> None:
    """Make the calling thread :data:`TOKENIZE_NICENESS` nicer (where threads have their own)."""
    import os
    import threading

    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + TOKENIZE_NICENESS))
    except (AttributeError, OSError):  # no per-thread priority here: the thread runs as it is
        pass


def _call_soon(loop: asyncio.AbstractEventLoop, fn: Any, *args: Any) -> None:
    """``fn(*args)`` on ``loop``, from another thread; nothing once the loop is closed."""
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:  # the loop closed while the thread worked
        pass


def _has_media(payload: Mapping[str, Any]) -> bool:
    """Whether a chat request has a content part other than text."""
    messages = payload.get("messages")
    if not isinstance(messages, list):
        return False
    for m in messages:
        content = m.get("content") if isinstance(m, Mapping) else None
        if isinstance(content, list):
            for part in content:
                if isinstance(part, Mapping) and part.get("type") not in (None, "text"):
                    return True
    return False
