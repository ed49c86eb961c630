"""Precise mode on the request path: a ``CACHE_AWARE`` request's KV block keys, computed
once in :func:`prefixroute.server.app.prepare_inference` (so every data plane, and the
Envoy endpoint picker, which share it, route alike) and carried on its routing chain
(``blocks.precise``) to the strategy (:mod:`prefixroute.core.precise_policy`)."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any, Mapping

from prefixroute.core.block_chain import BlockChain
from prefixroute.core.precise_policy import PreciseRequest
from prefixroute.core.routing_text import InvalidRequest

if TYPE_CHECKING:
    from prefixroute.server.state import RouterState

__all__ = ["attach_precise"]

log = logging.getLogger("prefixroute.kv_events")
_WARN_INTERVAL_S = 10.0
_last_warning = 0.0


def attach_precise(state: "RouterState", payload: Mapping[str, Any], chat: bool, blocks: object) -> bool:
    """Give ``blocks`` (a ``CACHE_AWARE`` request's chain) the request's precise-mode
    data when precise mode can use it: a tokenizer is configured and at least one
    instance's events are flowing. The LoRA adapter is the request's ``model`` when the
    engines' events name it (:meth:`~prefixroute.core.kvevents.view.PreciseCacheView.lora_name`).

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
    try:
        keys, tokens = keyer.keys(payload, chat, view.lora_name(payload.get("model")))
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
