"""Routing text: the text of an OpenAI request whose prefix is routed on.

Sans-I/O: pure functions over parsed JSON objects and strings.

* **Chat** (:func:`render_chat_text`): the tools and messages rendered by one fixed rule
  (docs/ROUTING_KEYS.md), the "chat template" shared by the router's keys
  (:mod:`prefixroute.core.keys`) and the emulated engine's prompts, so two requests whose
  engine prompts share a beginning also share one here. Image, audio and file parts
  stand in as their URL or a digest of their data, repeated to ``media_chars``
  characters where a part should weigh what the engine prefills for it.
* **Completions** (:func:`completion_prompt`): the prompt, a string or token ids.

A malformed field raises :class:`InvalidRequest` (the HTTP drivers answer 400).
"""

from __future__ import annotations

import base64
from typing import Any, Callable, Mapping

import orjson
import xxhash

__all__ = ["InvalidRequest", "render_chat_text", "chat_pieces", "part_texts", "media_part_text",
           "completion_prompt"]


class InvalidRequest(ValueError):
    """A request the router cannot route; the HTTP drivers answer it with 400."""


def _digest(data: bytes) -> str:
    return xxhash.xxh3_128_hexdigest(data)


def _media_stand_in(kind: str, ref: str, media_chars: int = 0) -> str:
    """A stable stand-in for a non-text part: URLs verbatim, inline data digested.

    With ``media_chars`` > 0 the stand-in is repeated and cut to exactly that many
    characters (at least the stand-in itself), so that a part an engine turns into
    hundreds of prompt tokens (an image: 576 for LLaVA-1.5's 24 x 24 patches) weighs
    as much in the routing text as it does in the engine's prefill."""
    if ref.startswith("data:"):
        header, _, payload = ref.partition(",")
        try:
            raw = base64.b64decode(payload, validate=False) if ";base64" in header else payload.encode()
        except (ValueError, TypeError):
            raw = payload.encode()
        out = f"<{kind}:xxh3-{_digest(raw)}>"
    else:
        out = f"<{kind}:{ref}>"
    if media_chars > len(out):
        out = (out * (media_chars // len(out) + 1))[:media_chars]
    return out


def _canonical_json(value: Any) -> str:
    return orjson.dumps(value, option=orjson.OPT_SORT_KEYS).decode()


def part_texts(parts: list[Any], other: Callable[[Mapping[str, Any]], str]) -> list[str]:
    """The text of each part of a message's content, in order: a string part itself, a
    text part's ``text``, ``other(part)`` for any other part (an object: image, audio,
    file...).

    Raises:
        InvalidRequest: a part is neither a string nor an object, or a text part's
            ``text`` is not a string (and whatever ``other`` raises).
    """
    out: list[str] = []
    for part in parts:
        if isinstance(part, str):
            out.append(part)
            continue
        if not isinstance(part, Mapping):
            raise InvalidRequest("each content part must be an object")
        ptype = part.get("type")
        if ptype == "text" or (ptype is None and "text" in part):
            text = part.get("text", "")
            if not isinstance(text, str):
                raise InvalidRequest("content part 'text' must be a string")
            out.append(text)
        else:
            out.append(other(part))
    return out


def media_part_text(part: Mapping[str, Any], media_chars: int = 0) -> str:
    """The stand-in text of a content part that is not text (:func:`_media_stand_in`):
    an image URL, audio, a file; any other type as a digest of the part."""
    ptype = part.get("type")
    if ptype == "image_url":
        image = part.get("image_url")
        url = image.get("url", "") if isinstance(image, Mapping) else image
        return _media_stand_in("image", str(url or ""), media_chars)
    if ptype == "input_audio":
        audio = part.get("input_audio") or {}
        data = audio.get("data", "") if isinstance(audio, Mapping) else ""
        return _media_stand_in("audio", f"xxh3-{_digest(str(data).encode())}", media_chars)
    if ptype == "file":
        f = part.get("file") or {}
        ref = (f.get("file_id") or f.get("file_data") or "") if isinstance(f, Mapping) else ""
        return _media_stand_in("file", str(ref), media_chars)
    return f"<{ptype}:xxh3-{_digest(orjson.dumps(part, option=orjson.OPT_SORT_KEYS))}>"


def _content_text(content: Any, media_chars: int = 0) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(part_texts(content, lambda part: media_part_text(part, media_chars)))
    raise InvalidRequest("message 'content' must be a string, a list of parts or null")


def render_chat_text(payload: Mapping[str, Any], limit: int | None = None, media_chars: int = 0) -> str:
    """Render an OpenAI chat request into the text whose prefix is routed on.

    The rule (documented in docs/ROUTING_KEYS.md), chosen so that two requests whose
    engine prompts share a beginning also share a beginning here:

    1. Tool definitions first, as most chat templates put them in the system block:
       ``<|tools|>\\n`` + canonical JSON of ``tools`` (sorted keys, no spaces) + ``\\n``.
       Absent or empty ``tools`` renders nothing.
    2. Then each message in order: ``<|role|>\\n`` (plus ``name=NAME\\n`` when the
       message has a name) + its content + tool calls as canonical JSON + ``\\n``.
       Content that is a list of parts renders text parts verbatim, an image URL as
       ``<image:URL>``, inline (``data:``) media as ``<image:xxh3-DIGEST>`` of the decoded
       bytes, audio as ``<audio:xxh3-DIGEST>``.

    Fields that do not reach the prompt (``temperature``, ``max_tokens``, ``stream``...)
    never take part, so they cannot split requests that share a cache.

    Args:
        payload: the parsed JSON body of ``POST /v1/chat/completions``.
        limit: stop rendering once at least this many characters are out (the
            result's first ``limit`` characters are the same as without a limit). The
            router passes PrefixLength, so a huge conversation costs no more than its
            first messages; messages after that point are not validated.
        media_chars: characters each image, audio or file part stands for (0: its
            short stand-in only, as ``PREFIX_AWARE`` keys it; ``CACHE_AWARE`` passes
            ``MediaTokens x 4`` and the emulated engine its image tokens x 4, see
            :func:`_media_stand_in`).

    Returns:
        The rendered text (``str``; PrefixLength counts its characters).

    Raises:
        InvalidRequest: ``messages`` is missing, not a list, or holds a malformed message.
    """
    return "".join(chat_pieces(payload, limit, media_chars))


def chat_pieces(payload: Mapping[str, Any], limit: int | None, media_chars: int = 0) -> list[str]:
    """The pieces of :func:`render_chat_text`'s text, in order, not joined: a long message
    content is its own piece (the very string of the payload), so the key can be hashed
    without copying it into a joined text. Same validation and ``limit`` rule."""
    messages = payload.get("messages")
    if not isinstance(messages, list):
        raise InvalidRequest("'messages' must be a list of message objects")
    out: list[str] = []
    size = 0
    tools = payload.get("tools")
    if tools:
        out.append(f"<|tools|>\n{_canonical_json(tools)}\n")
        size = len(out[0])
    for msg in messages:
        if limit is not None and size >= limit:
            break
        if type(msg) is not dict and not isinstance(msg, Mapping):
            raise InvalidRequest("each message must be an object with 'role' and 'content'")
        role = msg.get("role")
        if not isinstance(role, str):
            raise InvalidRequest("each message must have a string 'role'")
        content = msg.get("content")
        text = content if type(content) is str else _content_text(content, media_chars)
        name = msg.get("name")
        calls = msg.get("tool_calls")
        head = f"<|{role}|>\nname={name}\n" if isinstance(name, str) and name else f"<|{role}|>\n"
        tail = _canonical_json(calls) + "\n" if calls else "\n"
        out += (head, text, tail)
        size += len(head) + len(text) + len(tail)
    return out


def completion_prompt(payload: Mapping[str, Any]) -> str | list[int]:
    """The prompt of an OpenAI completions request: a string or a list of token ids.

    A batch (a list of strings or of token lists) is keyed on its first prompt.

    Raises:
        InvalidRequest: ``prompt`` is missing or has a type the API does not allow.
    """
    prompt = payload.get("prompt")
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt:
        first = prompt[0]
        if isinstance(first, int) and not isinstance(first, bool):
            if not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
                raise InvalidRequest("'prompt' token list must hold only integers")
            return prompt
        if isinstance(first, str):
            return first
        if isinstance(first, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in first):
            return first
    raise InvalidRequest("'prompt' must be a string, a list of strings, or a list of token ids")

