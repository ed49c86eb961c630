"""The event loop every prefixroute server runs on: uvloop when installed (the default
install has it), else asyncio's own."""

from __future__ import annotations

import asyncio
from typing import Callable

__all__ = ["loop_factory"]


def loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """``asyncio.Runner(loop_factory=...)``'s argument: ``uvloop.new_event_loop``, or
    ``None`` (asyncio's default loop) when uvloop is not installed."""
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop
