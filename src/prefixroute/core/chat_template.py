"""A model's Jinja chat template applied to an OpenAI chat request, as vLLM applies it.

Sans-I/O: strings in, a string out. One function renders for both sides, so the
emulated engine and the router's precise mode (which must predict the engine's token
ids) cannot disagree: :func:`render_chat_prompt`.

How vLLM (through Hugging Face ``transformers``' ``apply_chat_template``) renders, and
so how this module does:

* the template runs in Jinja's immutable sandbox with ``trim_blocks`` and
  ``lstrip_blocks`` on and the ``loopcontrols`` extension; it sees ``messages``,
  ``tools`` (``None`` when the request has none), ``add_generation_prompt``,
  ``bos_token``, ``eos_token`` and the request's ``chat_template_kwargs``; a
  ``tojson`` filter (``json.dumps`` with ``ensure_ascii=False``) and a
  ``raise_exception(message)`` function are available;
* a message whose ``content`` is a list of parts is passed with its text parts joined
  by ``"\\n"`` (vLLM's "string" content format); this project's engines serve text only,
  so any other part (image, audio, file) is refused;
* ``add_generation_prompt`` is the request's field of that name (a vLLM extension),
  true by default; the rendered text is then tokenized without adding special tokens
  (the template writes the BOS itself).

Requires ``jinja2`` (the ``precise`` extra).
"""

from __future__ import annotations

import json
from functools import lru_cache
from typing import Any, Mapping

from prefixroute.core.routing_text import InvalidRequest, media_part_text, part_texts

__all__ = ["compile_chat_template", "chat_messages", "render_chat_prompt"]

#: Most distinct templates kept compiled (a process serves one model, seldom more).
_TEMPLATE_CACHE = 16


def _tojson(value: Any, indent: int | None = None, separators: Any = None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=False, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message: str) -> None:
    import jinja2

    raise jinja2.exceptions.TemplateError(message)


@lru_cache(maxsize=_TEMPLATE_CACHE)
def compile_chat_template(source: str) -> Any:
    """Compile a chat template (cached by its text).

    Args:
        source: the Jinja template text (``chat_template`` of ``tokenizer_config.json``).
    Returns:
        A ``jinja2.Template`` bound to a sandboxed environment (see module docstring).
    Raises:
        ValueError: the template does not compile (its syntax error's message).
        ImportError: ``jinja2`` is not installed (``pip install 'prefixroute[precise]'``).
    """
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    try:
        return env.from_string(source)
    except jinja2.exceptions.TemplateSyntaxError as exc:
        raise ValueError(f"chat template does not compile: {exc.message} (line {exc.lineno})") from None


def _content(content: Any, media_chars: int = 0) -> Any:
    if content is None or isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidRequest("message 'content' must be a string, a list of parts or null")

    def other(part: Mapping[str, Any]) -> str:
        kind = part.get("type")
        if media_chars and kind in ("image_url", "input_audio", "file"):
            return media_part_text(part, media_chars)  # its stand-in text (the routing rule's)
        raise InvalidRequest(f"content parts of type {kind!r} are not supported: this model takes text only")

    return "\n".join(part_texts(content, other))


def chat_messages(payload: Mapping[str, Any], media_chars: int = 0) -> list[dict[str, Any]]:
    """The request's ``messages`` as the template sees them.

    Each message keeps its fields (``role``, ``name``, ``tool_calls``,
    ``tool_call_id``...); ``content`` given as parts becomes their texts joined by
    ``"\\n"``. An image, audio or file part is refused (a text-only model), or, with
    ``media_chars`` > 0, becomes its stand-in text of that many characters
    (:func:`prefixroute.core.routing_text.render_chat_text`'s: the same media, the same text).

    Raises:
        InvalidRequest: ``messages`` is missing or not a list, a message is not an
            object with a string ``role``, or content is malformed or not text.
    """
    messages = payload.get("messages")
    if not isinstance(messages, list):
        raise InvalidRequest("'messages' must be a list of message objects")
    out = []
    for msg in messages:
        if not isinstance(msg, Mapping):
            raise InvalidRequest("each message must be an object with 'role' and 'content'")
        if not isinstance(msg.get("role"), str):
            raise InvalidRequest("each message must have a string 'role'")
        m = dict(msg)
        m["content"] = _content(msg.get("content"), media_chars)
        out.append(m)
    return out


def render_chat_prompt(template_source: str, payload: Mapping[str, Any], *, bos_token: str = "",
                       eos_token: str = "", media_chars: int = 0) -> str:
    """The prompt text a vLLM server builds from an OpenAI chat request.

    Args:
        template_source: the model's chat template (Jinja text).
        payload: the parsed body of ``POST /v1/chat/completions``. Read: ``messages``,
            ``tools``, ``add_generation_prompt`` (default true) and
            ``chat_template_kwargs`` (an object of extra template variables).
        bos_token: the tokenizer's beginning-of-sequence token text.
        eos_token: its end-of-sequence (end-of-turn) token text.
        media_chars: characters of an image, audio or file part's stand-in text; 0:
            such parts are refused (see :func:`chat_messages`).
    Returns:
        The rendered text, to be tokenized without adding special tokens.
    Raises:
        InvalidRequest: a malformed request (see :func:`chat_messages`), a non-boolean
            ``add_generation_prompt``, ``chat_template_kwargs`` not an object, or the
            template refusing the conversation (its ``raise_exception``, or a render
            error).
        ValueError: the template does not compile.
    """
    import jinja2

    messages = chat_messages(payload, media_chars)
    add_generation_prompt = payload.get("add_generation_prompt", True)
    if not isinstance(add_generation_prompt, bool):
        raise InvalidRequest("'add_generation_prompt' must be a boolean")
    extra = payload.get("chat_template_kwargs") or {}
    if not isinstance(extra, Mapping):
        raise InvalidRequest("'chat_template_kwargs' must be an object")
    tools = payload.get("tools") or None
    variables = {**extra, "messages": messages, "tools": tools, "add_generation_prompt": add_generation_prompt,
                 "bos_token": bos_token, "eos_token": eos_token}
    template = compile_chat_template(template_source)
    try:
        return template.render(**variables)
    except jinja2.exceptions.TemplateError as exc:
        raise InvalidRequest(f"the chat template refused the conversation: {exc}") from None
    except (TypeError, ValueError, KeyError, AttributeError) as exc:  # e.g. an unserialisable tool
        raise InvalidRequest(f"the chat template could not render the conversation: {exc}") from None
