"""Routing keys: from a request to the 64-bit number that decides its instance.

Sans-I/O: pure functions over bytes, parsed JSON objects and strings.

Two APIs, two rules (SPEC §2, as in SageMaker's ``PREFIX_AWARE`` routing):

* **Native API** (``/invocations``): the first ``PrefixLength`` **bytes** of the raw
  request body (the whole body if shorter). The body is never parsed, so callers
  must serialise consistently (whitespace and JSON key order change the bytes).
* **OpenAI-compatible API**: the first ``PrefixLength`` **characters** of the text
  extracted from the request by :func:`render_chat_text` (chat) or
  :func:`completion_prompt` (completions).

The model name and the tenant id are always part of the key, so identical prompts
for different models or tenants are routed independently. The key is
``xxh3_64(seed=KEY_SEED)`` over ``model NUL tenant NUL prefix`` — deterministic across
processes, machines and restarts (never Python's randomised ``hash()``).
"""

from __future__ import annotations

import base64
from typing import TYPE_CHECKING, Any, Mapping, Sequence

import orjson
import xxhash

if TYPE_CHECKING:
    from prefixroute.core.config import RoutingConfig

__all__ = [
    "KEY_SEED",
    "InvalidRequest",
    "validate_tenant_id",
    "render_chat_text",
    "completion_prompt",
    "native_routing_key",
    "text_routing_key",
    "token_routing_key",
    "openai_routing_key",
    "text_block_hashes",
    "byte_block_hashes",
    "token_block_hashes",
    "openai_block_hashes",
    "openai_route",
    "native_route",
]

#: Seed of every routing-key hash. Changing it reassigns every key, so it is fixed.
KEY_SEED = 0x7072_6566_6978  # "prefix"

_TENANT_MAX = 64


class InvalidRequest(ValueError):
    """A request the router cannot route; the HTTP drivers answer it with 400."""


def validate_tenant_id(tenant: str | None) -> str:
    """Check a tenant id (``X-Amzn-SageMaker-Prefix-Aware-Id`` / ``prompt_cache_key``).

    Returns ``""`` for ``None`` (no tenant) and the id itself when valid.

    Raises:
        InvalidRequest: the id is empty, longer than 64 characters, or contains a
            character outside printable ASCII (0x20–0x7E), as SageMaker requires.
    """
    if tenant is None:
        return ""
    if not isinstance(tenant, str):
        raise InvalidRequest(f"prefix-aware id must be a string, got {type(tenant).__name__}")
    if not 1 <= len(tenant) <= _TENANT_MAX:
        raise InvalidRequest(
            f"prefix-aware id must be 1-{_TENANT_MAX} printable ASCII characters, got length {len(tenant)}"
        )
    for ch in tenant:
        if not " " <= ch <= "~":
            raise InvalidRequest(
                f"prefix-aware id must be printable ASCII (0x20-0x7E); found character U+{ord(ch):04X}"
            )
    return tenant


# ----------------------------------------------------------------------------------
# Text extraction (the "chat template" shared by the router and the emulated engine)
# ----------------------------------------------------------------------------------


def _digest(data: bytes) -> str:
    return xxhash.xxh3_128_hexdigest(data)


def _media_stand_in(kind: str, ref: str) -> str:
    """A stable, short stand-in for a non-text part: URLs verbatim, inline data digested."""
    if ref.startswith("data:"):
        header, _, payload = ref.partition(",")
        try:
            raw = base64.b64decode(payload, validate=False) if ";base64" in header else payload.encode()
        except (ValueError, TypeError):
            raw = payload.encode()
        return f"<{kind}:xxh3-{_digest(raw)}>"
    return f"<{kind}:{ref}>"


def _canonical_json(value: Any) -> str:
    return orjson.dumps(value, option=orjson.OPT_SORT_KEYS).decode()


def _content_text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        out: list[str] = []
        for part in content:
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
            elif ptype == "image_url":
                image = part.get("image_url")
                url = image.get("url", "") if isinstance(image, Mapping) else image
                out.append(_media_stand_in("image", str(url or "")))
            elif ptype == "input_audio":
                audio = part.get("input_audio") or {}
                data = audio.get("data", "") if isinstance(audio, Mapping) else ""
                out.append(f"<audio:xxh3-{_digest(str(data).encode())}>")
            elif ptype == "file":
                f = part.get("file") or {}
                ref = (f.get("file_id") or f.get("file_data") or "") if isinstance(f, Mapping) else ""
                out.append(_media_stand_in("file", str(ref)))
            else:
                out.append(f"<{ptype}:xxh3-{_digest(orjson.dumps(part, option=orjson.OPT_SORT_KEYS))}>")
        return "".join(out)
    raise InvalidRequest("message 'content' must be a string, a list of parts or null")


def render_chat_text(payload: Mapping[str, Any], limit: int | None = None) -> str:
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

    Returns:
        The rendered text (``str``; PrefixLength counts its characters).

    Raises:
        InvalidRequest: ``messages`` is missing, not a list, or holds a malformed message.
    """
    messages = payload.get("messages")
    if not isinstance(messages, list):
        raise InvalidRequest("'messages' must be a list of message objects")
    out: list[str] = []
    size = 0
    tools = payload.get("tools")
    if tools:
        out.append("<|tools|>\n")
        out.append(_canonical_json(tools))
        out.append("\n")
        size = sum(len(x) for x in out)
    for msg in messages:
        if limit is not None and size >= limit:
            break
        start = len(out)
        if not isinstance(msg, Mapping):
            raise InvalidRequest("each message must be an object with 'role' and 'content'")
        role = msg.get("role")
        if not isinstance(role, str):
            raise InvalidRequest("each message must have a string 'role'")
        out.append(f"<|{role}|>\n")
        name = msg.get("name")
        if isinstance(name, str) and name:
            out.append(f"name={name}\n")
        out.append(_content_text(msg.get("content")))
        calls = msg.get("tool_calls")
        if calls:
            out.append(_canonical_json(calls))
        out.append("\n")
        if limit is not None:
            size += sum(len(x) for x in out[start:])
    return "".join(out)


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


# ----------------------------------------------------------------------------------
# Keys
# ----------------------------------------------------------------------------------


def _key(scope: str, tenant: str, prefix: bytes) -> int:
    h = xxhash.xxh3_64(seed=KEY_SEED)
    h.update(scope.encode())
    h.update(b"\0")
    h.update(tenant.encode())
    h.update(b"\0")
    h.update(prefix)
    return h.intdigest()


def native_routing_key(body: bytes, prefix_length: int, scope: str, tenant: str = "") -> int:
    """Key of a native (``/invocations``) request: its first ``prefix_length`` bytes.

    Args:
        body: the raw request body, never parsed (invalid UTF-8 is hashed as bytes).
        prefix_length: PrefixLength in **bytes**.
        scope: what the prompt runs on (endpoint and inference component names).
        tenant: a validated tenant id or ``""``.
    Returns:
        An unsigned 64-bit integer.
    """
    return _key(scope, tenant, bytes(body[:prefix_length]))


def text_routing_key(text: str, prefix_length: int, model: str, tenant: str = "") -> int:
    """Key of extracted text: its first ``prefix_length`` **characters** (UTF-8 encoded)."""
    return _key(model, tenant, text[:prefix_length].encode("utf-8", "surrogatepass"))


def token_routing_key(tokens: Sequence[int], prefix_length: int, model: str, tenant: str = "") -> int:
    """Key of a token-id prompt: its first ``prefix_length`` **tokens** (as 64-bit ids)."""
    head = tokens[:prefix_length]
    data = b"".join((t & 0xFFFF_FFFF_FFFF_FFFF).to_bytes(8, "little") for t in head)
    return _key(model, tenant, b"\1" + data)  # \1 marks token ids: never equal to text


def openai_routing_key(payload: Mapping[str, Any], chat: bool, prefix_length: int) -> int:
    """Key of an OpenAI request body (already parsed to a JSON object).

    Uses ``model`` and ``prompt_cache_key`` (the tenant) from the body.

    Raises:
        InvalidRequest: a malformed ``messages``/``prompt``/``model``/``prompt_cache_key``.
    """
    model = payload.get("model", "")
    if not isinstance(model, str):
        raise InvalidRequest("'model' must be a string")
    tenant = validate_tenant_id(payload.get("prompt_cache_key"))
    if chat:
        return text_routing_key(render_chat_text(payload, prefix_length), prefix_length, model, tenant)
    prompt = completion_prompt(payload)
    if isinstance(prompt, str):
        return text_routing_key(prompt, prefix_length, model, tenant)
    return token_routing_key(prompt, prefix_length, model, tenant)


# ----------------------------------------------------------------------------------
# Chained block hashes (CACHE_AWARE)
# ----------------------------------------------------------------------------------


def _chain(root: int, chunks: Sequence[bytes]) -> list[int]:
    out: list[int] = []
    h = root
    xxh = xxhash.xxh3_64_intdigest
    for c in chunks:
        h = xxh(c, h)
        out.append(h)
    return out


def text_block_hashes(text: str, block_size: int, max_length: int, model: str, tenant: str = "") -> list[int]:
    """Chained hashes of successive ``block_size``-character blocks of ``text``.

    Block ``k``'s hash is ``xxh3_64(block_k, seed=hash_{k-1})``, rooted in the model
    and tenant, so equal hashes at position ``k`` mean equal text up to the end of
    block ``k`` (a match is always a true prefix match). Only the first
    ``max_length`` characters are hashed; the last block may be shorter.

    Returns:
        One unsigned 64-bit hash per block (empty for empty text).
    """
    head = text[:max_length]
    root = _key(model, tenant, b"")
    return _chain(root, [head[i:i + block_size].encode("utf-8", "surrogatepass")
                         for i in range(0, len(head), block_size)])


def byte_block_hashes(body: bytes, block_size: int, max_length: int, scope: str, tenant: str = "") -> list[int]:
    """Chained hashes of successive ``block_size``-byte blocks of a raw body (native API)."""
    head = bytes(body[:max_length])
    root = _key(scope, tenant, b"")
    return _chain(root, [head[i:i + block_size] for i in range(0, len(head), block_size)])


def token_block_hashes(tokens: Sequence[int], block_size: int, max_length: int, model: str,
                       tenant: str = "") -> list[int]:
    """Chained block hashes of a token-id prompt: ``block_size // 4`` tokens per block
    (a token is about 4 characters), at most ``max_length // 4`` tokens."""
    per = max(1, block_size // 4)
    head = tokens[: max(1, max_length // 4)]
    root = _key(model, tenant, b"\1")
    return _chain(root, [b"".join((t & 0xFFFF_FFFF_FFFF_FFFF).to_bytes(8, "little") for t in head[i:i + per])
                         for i in range(0, len(head), per)])


def openai_block_hashes(payload: Mapping[str, Any], chat: bool, block_size: int, max_length: int) -> list[int]:
    """Chained block hashes of an OpenAI request body (see :func:`text_block_hashes`).

    Raises:
        InvalidRequest: as :func:`openai_routing_key`.
    """
    model = payload.get("model", "")
    if not isinstance(model, str):
        raise InvalidRequest("'model' must be a string")
    tenant = validate_tenant_id(payload.get("prompt_cache_key"))
    if chat:
        return text_block_hashes(render_chat_text(payload, max_length), block_size, max_length, model, tenant)
    prompt = completion_prompt(payload)
    if isinstance(prompt, str):
        return text_block_hashes(prompt, block_size, max_length, model, tenant)
    return token_block_hashes(prompt, block_size, max_length, model, tenant)


def openai_route(payload: Mapping[str, Any], chat: bool, routing: "RoutingConfig") -> tuple[int | None, list[int]]:
    """What the variant's strategy needs from an OpenAI request: ``(key, blocks)``.

    ``PREFIX_AWARE`` gets a key, ``CACHE_AWARE`` chained block hashes, the others
    neither (the body's routing fields are still validated).

    Raises:
        InvalidRequest: a malformed field.
    """
    from prefixroute.core.config import RoutingStrategy

    if routing.strategy is RoutingStrategy.PREFIX_AWARE and routing.prefix_aware is not None:
        return openai_routing_key(payload, chat, routing.prefix_aware.prefix_length), []
    if routing.strategy is RoutingStrategy.CACHE_AWARE and routing.cache_aware is not None:
        ca = routing.cache_aware
        return None, openai_block_hashes(payload, chat, ca.block_size, ca.max_prefix_length)
    openai_routing_key(payload, chat, 1)  # validation only: renders at most one message
    return None, []


def native_route(body: bytes, scope: str, tenant: str, routing: "RoutingConfig") -> tuple[int | None, list[int]]:
    """``(key, blocks)`` of a native request for the variant's strategy (never raises)."""
    from prefixroute.core.config import RoutingStrategy

    if routing.strategy is RoutingStrategy.PREFIX_AWARE and routing.prefix_aware is not None:
        return native_routing_key(body, routing.prefix_aware.prefix_length, scope, tenant), []
    if routing.strategy is RoutingStrategy.CACHE_AWARE and routing.cache_aware is not None:
        ca = routing.cache_aware
        return None, byte_block_hashes(body, ca.block_size, ca.max_prefix_length, scope, tenant)
    return None, []
