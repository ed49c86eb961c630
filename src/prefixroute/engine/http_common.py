"""What the emulated engine's HTTP handlers share (:mod:`prefixroute.engine.server` and
:mod:`prefixroute.engine.extra_routes`): vLLM's error answer and the client error that
becomes one, a request as the engine runs it, and the engine's chat prompt rule.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import orjson
from aiohttp import web

from prefixroute.core.routing_text import render_chat_text
from prefixroute.engine.tokenizer import TokenizedPrompt

__all__ = ["GENERATION_PROMPT", "DEFAULT_MAX_TOKENS", "ClientError", "InFlight", "Job", "chat_prompt_text",
           "error_response"]

#: Appended to the rendered chat (the template's "add_generation_prompt"). It equals
#: how :func:`render_chat_text` renders the start of an assistant message, so the
#: next turn of a conversation begins with this turn's prompt plus its answer.
GENERATION_PROMPT = "<|assistant|>\n"

#: Output tokens when a request sets neither ``max_completion_tokens`` nor ``max_tokens``
#: (``max_output_tokens`` on ``/v1/responses``).
DEFAULT_MAX_TOKENS = 16


def chat_prompt_text(payload: Any, image_tokens: int) -> str:
    """The prompt the emulated engine prefills for a chat body: the rendered messages
    (:func:`render_chat_text`, each image part ``image_tokens x 4`` characters) and
    :data:`GENERATION_PROMPT`.

    Raises:
        InvalidRequest: a malformed ``messages``.
    """
    return render_chat_text(payload, media_chars=image_tokens * 4) + GENERATION_PROMPT


class ClientError(Exception):
    """A request the engine refuses: answered with :func:`error_response`."""

    def __init__(self, status: int, message: str, type_: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.type = type_


def error_response(status: int, message: str, type_: str | None = None) -> web.Response:
    """vLLM's error answer: ``{"error": {"message", "type", "param", "code"}}``; the type
    defaults to ``NotFoundError`` for a 404, ``invalid_request_error`` otherwise."""
    kind = type_ or ("NotFoundError" if status == 404 else "invalid_request_error")
    body = {"error": {"message": message, "type": kind, "param": None, "code": status}}
    return web.Response(status=status, body=orjson.dumps(body), content_type="application/json")


@dataclass(slots=True)
class Job:
    """A request as the engine core runs it."""

    prompt: TokenizedPrompt
    max_tokens: int
    stream: bool
    include_usage: bool
    lora: str | None = None
    model: str = ""  # the name answers carry (the adapter's, else the first served name)


@dataclass(slots=True)
class InFlight:
    """A submitted request's handler side: the queue its step outputs arrive on."""

    queue: asyncio.Queue[Any]
    arrival_wall: float
    arrival_model: float
    finished: bool = False
