"""Routing keys: from a request to the 64-bit number that decides its instance.

Sans-I/O: pure functions over bytes, parsed JSON objects and strings.

Two APIs, two rules (SPEC §2, as in SageMaker's ``PREFIX_AWARE`` routing):

* **Native API** (``/invocations``): the first ``PrefixLength`` **bytes** of the raw
  request body (the whole body if shorter). The body is never parsed, so callers
  must serialise consistently (whitespace and JSON key order change the bytes).
* **OpenAI-compatible API**: the first ``PrefixLength`` **characters** of the text
  extracted from the request by :func:`~prefixroute.core.routing_text.render_chat_text`
  (chat) or :func:`~prefixroute.core.routing_text.completion_prompt` (completions).

The model name and the tenant id are always part of the key, so identical prompts
for different models or tenants are routed independently. The key is
derived from ``model``, ``tenant`` and ``prefix`` only — deterministic across
processes, machines and restarts (never Python's randomised ``hash()``): the prefix's
``xxh3_64`` seeded with ``xxh3_64(scope NUL tenant NUL, seed=KEY_SEED)``.

``CACHE_AWARE`` and ``LLMD_REFERENCE`` get chained block hashes instead
(:mod:`prefixroute.core.block_chain`), rooted the same way. The names this module
re-exports from :mod:`~prefixroute.core.routing_text` and
:mod:`~prefixroute.core.block_chain` (``InvalidRequest``, ``render_chat_text``,
``completion_prompt``, ``BlockChain``, ``block_ends``...) import from here as before.
"""

from __future__ import annotations

from functools import lru_cache
from typing import TYPE_CHECKING, Any, Mapping, Sequence

import orjson
import xxhash

try:
    import simdjson
except ImportError:  # (not installed where it has no wheel: orjson parses every body)
    simdjson = None

from prefixroute.core.block_chain import (BLOCKS_PER_DOUBLING, BlockChain, block_ends, fixed_blocks,
                                         scheduled_blocks)
from prefixroute.core.config import RoutingStrategy
from prefixroute.core.routing_text import InvalidRequest, chat_pieces, completion_prompt, render_chat_text

if TYPE_CHECKING:
    from prefixroute.core.config import RoutingConfig

_PREFIX_AWARE = RoutingStrategy.PREFIX_AWARE
_CACHE_AWARE = RoutingStrategy.CACHE_AWARE
_LLMD = RoutingStrategy.LLMD_REFERENCE

#: ``LLMD_REFERENCE``'s prefix blocks (the Inference Extension's prefix plugin defaults):
#: 64 characters each, at most 256 of them, no doubling.
LLMD_BLOCK_CHARS = 64
LLMD_MAX_BLOCKS = 256

__all__ = [
    "KEY_SEED",
    "InvalidRequest",
    "loads_body",
    "SIMDJSON_MAX_BYTES",
    "validate_tenant_id",
    "render_chat_text",
    "completion_prompt",
    "native_routing_key",
    "text_routing_key",
    "token_routing_key",
    "openai_routing_key",
    "BLOCKS_PER_DOUBLING",
    "block_ends",
    "BlockChain",
    "text_block_hashes",
    "byte_block_hashes",
    "token_block_hashes",
    "openai_block_hashes",
    "openai_route",
    "native_route",
    "openai_tenant",
    "combine_tenants",
    "GENERATION_FIELDS",
    "canonical_prompt_json",
]

#: Seed of every routing-key hash. Changing it reassigns every key, so it is fixed.
KEY_SEED = 0x7072_6566_6978  # "prefix"

_xxh3 = xxhash.xxh3_64_intdigest

_TENANT_MAX = 64


#: Bodies up to this size are parsed by simdjson (:func:`loads_body`), larger ones by
#: orjson: the parser's buffer, reused and grown to the largest body it has parsed,
#: stays a few MiB.
SIMDJSON_MAX_BYTES = 1 << 20
_PARSER = simdjson.Parser() if simdjson is not None else None
_BOM = b"\xef\xbb\xbf"


def loads_body(body: bytes) -> Any:
    """``orjson.loads(body)``: the same value or the same error, sooner for a body that
    is one JSON object of at most :data:`SIMDJSON_MAX_BYTES` (a 64 KB chat request in
    about two thirds of the time: the ``parse`` and ``orjson`` columns of
    ``bench/decision.py``).

    simdjson (SIMD validation, then a dict built from its document) reads such a body;
    whatever it refuses, and every other body, goes to orjson, which then decides. The
    two accept the same JSON except for what is thereby left to orjson: a UTF-8 byte
    order mark (simdjson skips it, orjson refuses it) and an integer beyond 64 bits
    (simdjson refuses it, orjson reads it as a float). An error thus always comes from
    orjson, whose message names the position. Without pysimdjson (not installed on
    Python 3.14 and later, which it has no wheels for yet) orjson parses every body.

    Args:
        body: the request body, ``bytes``.

    Raises:
        orjson.JSONDecodeError: ``body`` is not one valid JSON document.
    """
    if _PARSER is not None and len(body) <= SIMDJSON_MAX_BYTES and not body.startswith(_BOM):
        try:
            doc = _PARSER.parse(body)
        except (ValueError, RuntimeError):
            pass  # orjson decides (and names the position)
        else:
            if isinstance(doc, simdjson.Object):
                return doc.as_dict()
            del doc  # (a proxy kept alive stops the parser's reuse)
    return orjson.loads(body)


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
# Keys
# ----------------------------------------------------------------------------------


@lru_cache(maxsize=4096)
def _root(scope: str, tenant: str) -> int:
    """Seed of every hash for one scope (model or endpoint) and tenant: ``xxh3_64`` of
    ``scope NUL tenant NUL`` with seed :data:`KEY_SEED` (cached: a handful of models)."""
    return _xxh3(scope.encode("utf-8", "surrogatepass") + b"\0" + tenant.encode() + b"\0", KEY_SEED)


def _key(scope: str, tenant: str, prefix: bytes) -> int:
    return _xxh3(prefix, _root(scope, tenant))


#: Routing texts (and pieces of them) shorter than this many characters are copied
#: freely: joining and slicing them costs less than avoiding it.
_JOIN_BELOW = 4096


def _utf8_head(text: str, n: int) -> bytes | memoryview:
    """The UTF-8 bytes (lone surrogates passed through) of ``text[:n]``, copying a long
    text once where it can: an ASCII text (one byte a character) is encoded whole and the
    bytes viewed up to ``n`` when ``n`` is at least half of it, instead of being sliced
    (a copy) and then encoded (another)."""
    if len(text) <= n:
        return text.encode("utf-8", "surrogatepass")
    if len(text) >= _JOIN_BELOW and 2 * n >= len(text) and text.isascii():
        return memoryview(text.encode("ascii"))[:n]
    return text[:n].encode("utf-8", "surrogatepass")


def _pieces_key(pieces: Sequence[str], limit: int, seed: int) -> int:
    """``xxh3_64`` of the UTF-8 bytes of ``"".join(pieces)[:limit]``, seeded with ``seed``.

    A long text is hashed piece by piece (xxh3's streaming and one-shot forms give the
    same value), short pieces joined, long ones on their own, without building the
    text. Only the piece that crosses ``limit`` is cut, so a 64 KB message (whole, or
    ASCII) is copied once (its encoding) instead of three times (join, cut, encoding).
    With a ``limit`` of at most :data:`_JOIN_BELOW` characters, nothing past ``limit``
    is copied anyway: the pieces are cut, joined and hashed in one call."""
    if limit <= _JOIN_BELOW or sum(map(len, pieces)) < _JOIN_BELOW:
        head: list[str] = []  # "".join(pieces)[:limit], copying nothing past limit
        left = limit
        for p in pieces:
            if len(p) >= left:
                head.append(p[:left])
                break
            head.append(p)
            left -= len(p)
        return _xxh3("".join(head).encode("utf-8", "surrogatepass"), seed)
    h = xxhash.xxh3_64(seed=seed)
    short: list[str] = []
    left = limit
    for p in pieces:
        if len(p) < _JOIN_BELOW:
            short.append(p if len(p) <= left else p[:left])
        else:
            if short:
                h.update("".join(short).encode("utf-8", "surrogatepass"))
                short.clear()
            h.update(_utf8_head(p, left))
        left -= len(p)
        if left <= 0:
            break
    if short:
        h.update("".join(short).encode("utf-8", "surrogatepass"))
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
    return _xxh3(_utf8_head(text, prefix_length), _root(model, tenant))


def token_routing_key(tokens: Sequence[int], prefix_length: int, model: str, tenant: str = "") -> int:
    """Key of a token-id prompt: its first ``prefix_length`` **tokens** (as 64-bit ids)."""
    head = tokens[:prefix_length]
    data = b"".join((t & 0xFFFF_FFFF_FFFF_FFFF).to_bytes(8, "little") for t in head)
    return _key(model, tenant, b"\1" + data)  # \1 marks token ids: never equal to text


def combine_tenants(*parts: tuple[str, str | None]) -> str:
    """One tenant string from every field that separates caches, for the key's root.

    Args:
        parts: ``(label, value)`` pairs; ``None`` or ``""`` values are absent.

    Returns:
        ``""`` when none is present; the value itself when it is the only one and its
        label is in :data:`PLAIN_TENANT_FIELDS` (so a ``prompt_cache_key`` or an
        ``X-Amzn-SageMaker-Prefix-Aware-Id`` alone keys as it always has); else
        ``label=value`` pairs joined by NUL, so ``cache_salt`` "a" and
        ``prompt_cache_key`` "a" are different tenants.
    """
    present = [(label, value) for label, value in parts if value]
    if not present:
        return ""
    if len(present) == 1 and present[0][0] in PLAIN_TENANT_FIELDS:
        return present[0][1]  # type: ignore[return-value]
    return "\0".join(f"{label}={value}" for label, value in present)


#: Tenant fields that, alone, key as their bare value (:func:`combine_tenants`).
PLAIN_TENANT_FIELDS = frozenset({"prompt_cache_key", "prefix_aware_id"})


def openai_tenant(payload: Mapping[str, Any], header_tenant: str = "") -> str:
    """The tenant of an OpenAI request: every field that makes an engine keep a separate
    cache, so identical prompts of different tenants never share an assignment.

    * ``prompt_cache_key`` (OpenAI): any string; long or non-ASCII values are hashed
      into the key like any other (``""`` is no tenant).
    * ``cache_salt`` (vLLM): a non-empty string; vLLM mixes it into the first KV block's
      hash, so salted requests never hit another salt's blocks.
    * ``header_tenant``: a validated ``X-Amzn-SageMaker-Prefix-Aware-Id`` sent on the
      OpenAI path, if any.

    Raises:
        InvalidRequest: ``prompt_cache_key`` is not a string, or ``cache_salt`` is not a
            non-empty string (vLLM refuses an empty one too).
    """
    pck = payload.get("prompt_cache_key")
    if pck is not None and not isinstance(pck, str):
        raise InvalidRequest("'prompt_cache_key' must be a string")
    salt = payload.get("cache_salt")
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise InvalidRequest("'cache_salt' must be a non-empty string")
    if salt is None and not header_tenant:
        return pck or ""
    return combine_tenants(("prompt_cache_key", pck), ("cache_salt", salt), ("prefix_aware_id", header_tenant))


def _model_and_tenant(payload: Mapping[str, Any], header_tenant: str = "") -> tuple[str, str]:
    """``model`` and the tenant (:func:`openai_tenant`) of an OpenAI body.

    Raises:
        InvalidRequest: ``model`` is not a string, or a tenant field is invalid.
    """
    model = payload.get("model", "")
    if not isinstance(model, str):
        raise InvalidRequest("'model' must be a string")
    return model, openai_tenant(payload, header_tenant)


def openai_routing_key(payload: Mapping[str, Any], chat: bool, prefix_length: int, header_tenant: str = "") -> int:
    """Key of an OpenAI request body (already parsed to a JSON object).

    Uses ``model`` and the tenant (:func:`openai_tenant`: ``prompt_cache_key``,
    ``cache_salt``, ``header_tenant``).

    Raises:
        InvalidRequest: a malformed ``messages``/``prompt``/``model``/tenant field.
    """
    model, tenant = _model_and_tenant(payload, header_tenant)
    if chat:  # text_routing_key of the rendered text, hashed piece by piece
        return _pieces_key(chat_pieces(payload, prefix_length), prefix_length, _root(model, tenant))
    prompt = completion_prompt(payload)
    if isinstance(prompt, str):
        return text_routing_key(prompt, prefix_length, model, tenant)
    return token_routing_key(prompt, prefix_length, model, tenant)


# ----------------------------------------------------------------------------------
# Chained block hashes of a request (CACHE_AWARE; LLMD_REFERENCE in openai_route)
# ----------------------------------------------------------------------------------


def text_block_hashes(text: str, block_size: int, max_length: int, model: str, tenant: str = "") -> BlockChain:
    """Chained block hashes of a routing text (see :class:`BlockChain`).

    Blocks are counted in bytes of the UTF-8 text (characters, for ASCII) on the
    schedule of :func:`block_ends`; only the first ``max_length`` characters are hashed
    and the last block may be partial. Rooted in the model and the tenant.

    Returns:
        A :class:`BlockChain` (a sequence of unsigned 64-bit hashes; empty for empty text).
    """
    data = _utf8_head(text, max_length)
    return scheduled_blocks(data, _root(model, tenant), block_size, 4 * max_length)  # UTF-8: <= 4 bytes a character


def byte_block_hashes(body: bytes, block_size: int, max_length: int, scope: str, tenant: str = "") -> BlockChain:
    """Chained block hashes of a raw body's first ``max_length`` bytes (native API)."""
    return scheduled_blocks(bytes(body[:max_length]), _root(scope, tenant), block_size, max_length)


def token_block_hashes(tokens: Sequence[int], block_size: int, max_length: int, model: str,
                       tenant: str = "") -> BlockChain:
    """Chained block hashes of a token-id prompt: ``block_size // 4`` tokens per block
    (a token is about 4 characters), at most ``max_length // 4`` tokens."""
    per = max(1, block_size // 4)
    head = tokens[: max(1, max_length // 4)]
    data = b"".join((t & 0xFFFF_FFFF_FFFF_FFFF).to_bytes(8, "little") for t in head)
    return scheduled_blocks(data, _xxh3(b"\1", _root(model, tenant)), per * 8, max(1, max_length // 4) * 8,
                            unit_shift=1)


def openai_block_hashes(payload: Mapping[str, Any], chat: bool, block_size: int, max_length: int,
                        header_tenant: str = "", media_chars: int = 0) -> BlockChain:
    """Chained block hashes of an OpenAI request body (see :func:`text_block_hashes`);
    image, audio and file parts weigh ``media_chars`` characters each
    (:func:`render_chat_text`).

    Raises:
        InvalidRequest: as :func:`openai_routing_key`.
    """
    model, tenant = _model_and_tenant(payload, header_tenant)
    if chat:
        return text_block_hashes("".join(chat_pieces(payload, max_length, media_chars)), block_size, max_length,
                                 model, tenant)
    prompt = completion_prompt(payload)
    if isinstance(prompt, str):
        return text_block_hashes(prompt, block_size, max_length, model, tenant)
    return token_block_hashes(prompt, block_size, max_length, model, tenant)


def openai_route(payload: Mapping[str, Any], chat: bool, routing: "RoutingConfig",
                 header_tenant: str = "") -> tuple[int | None, Sequence[int]]:
    """What the variant's strategy needs from an OpenAI request: ``(key, blocks)``.

    ``PREFIX_AWARE`` gets a key, ``CACHE_AWARE`` chained block hashes, the others
    neither (the body's routing fields are still validated). ``header_tenant`` is a
    validated ``X-Amzn-SageMaker-Prefix-Aware-Id`` sent on the OpenAI path, if any.

    Raises:
        InvalidRequest: a malformed field.
    """
    if routing.strategy is _PREFIX_AWARE and routing.prefix_aware is not None:
        return openai_routing_key(payload, chat, routing.prefix_aware.prefix_length, header_tenant), []
    if routing.strategy is _CACHE_AWARE and routing.cache_aware is not None:
        ca = routing.cache_aware
        return None, openai_block_hashes(payload, chat, ca.block_size, ca.max_prefix_length, header_tenant,
                                         ca.media_tokens * 4)
    if routing.strategy is _LLMD:
        model, tenant = _model_and_tenant(payload, header_tenant)
        cap = LLMD_BLOCK_CHARS * LLMD_MAX_BLOCKS
        prompt = "".join(chat_pieces(payload, cap)) if chat else completion_prompt(payload)
        if not isinstance(prompt, str):
            prompt = " ".join(map(str, prompt[: cap // 4]))
        return None, fixed_blocks(_utf8_head(prompt, cap), _root(model, tenant), LLMD_BLOCK_CHARS, LLMD_MAX_BLOCKS)
    _model_and_tenant(payload, header_tenant)  # validation only, as for a key (at most one message rendered)
    if chat:
        chat_pieces(payload, 1)
    else:
        completion_prompt(payload)
    return None, []


#: Fields of a JSON request body that never reach the engine's prompt (sampling,
#: output and bookkeeping settings of the OpenAI, vLLM, TGI and SageMaker container
#: APIs): a canonical native key (:func:`canonical_prompt_json`) leaves them out, so
#: two requests that differ only in them share an instance.
GENERATION_FIELDS = frozenset({
    "stream", "stream_options", "temperature", "top_p", "top_k", "min_p", "typical_p", "max_tokens",
    "max_completion_tokens", "max_new_tokens", "min_tokens", "n", "best_of", "seed", "stop", "stop_token_ids",
    "presence_penalty", "frequency_penalty", "repetition_penalty", "length_penalty", "logprobs", "top_logprobs",
    "prompt_logprobs", "logit_bias", "user", "parameters", "response_format", "ignore_eos", "skip_special_tokens",
    "spaces_between_special_tokens", "include_stop_str_in_output", "metadata", "store", "service_tier",
    "parallel_tool_calls", "priority", "request_id", "details", "decoder_input_details", "return_full_text",
    "do_sample", "watermark",
})


def canonical_prompt_json(body: bytes) -> bytes | None:
    """The canonical serialization of a JSON request body's prompt fields: the body
    parsed, :data:`GENERATION_FIELDS` dropped (at the top level), and the rest
    serialized with sorted keys and no insignificant whitespace (``orjson``'s
    ``OPT_SORT_KEYS``). Two bodies that hold the same prompt however their clients
    serialize them (key order, spaces, escapes) give the same
    bytes.

    Returns:
        The canonical bytes, or ``None`` when the body is not a JSON object (it is then
        keyed on its raw bytes).
    """
    try:
        payload = loads_body(body)
    except (orjson.JSONDecodeError, ValueError):
        return None
    if not isinstance(payload, dict):
        return None
    kept = {k: v for k, v in payload.items() if k not in GENERATION_FIELDS}
    try:
        return orjson.dumps(kept, option=orjson.OPT_SORT_KEYS)
    except TypeError:  # an integer beyond 64 bits (orjson read it, cannot write it back)
        return None


def native_route(body: bytes, scope: str, tenant: str, routing: "RoutingConfig") -> tuple[int | None, Sequence[int]]:
    """``(key, blocks)`` of a native request for the variant's strategy (never raises).

    With ``NativeKey: CANONICAL_JSON`` a JSON object body is keyed on
    :func:`canonical_prompt_json` instead of its raw bytes (PrefixLength then counts
    bytes of that serialization)."""
    if routing.canonical_native_key and (routing.strategy is _PREFIX_AWARE or routing.strategy is _CACHE_AWARE):
        canonical = canonical_prompt_json(body)
        if canonical is not None:
            body = canonical
    if routing.strategy is _PREFIX_AWARE and routing.prefix_aware is not None:
        return native_routing_key(body, routing.prefix_aware.prefix_length, scope, tenant), []
    if routing.strategy is _CACHE_AWARE and routing.cache_aware is not None:
        ca = routing.cache_aware
        return None, byte_block_hashes(body, ca.block_size, ca.max_prefix_length, scope, tenant)
    if routing.strategy is _LLMD:
        return None, fixed_blocks(bytes(body[: LLMD_BLOCK_CHARS * LLMD_MAX_BLOCKS]), _root(scope, tenant),
                                  LLMD_BLOCK_CHARS, LLMD_MAX_BLOCKS)
    return None, []
