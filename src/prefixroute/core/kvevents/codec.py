"""msgpack encoding of KV-event batches, in both of vLLM's forms, and a tolerant decoder.

vLLM encodes its event classes with ``msgspec`` (``vllm/distributed/kv_events.py``):

* **positional arrays** (``array_like`` structs, the releases seen so far): a batch is
  ``[ts, events, data_parallel_rank]`` and an event ``[tag, field, field, ...]`` with
  the class name as the tag, fields in declaration order;
* **maps** (newer source): a batch is ``{"ts", "events", "data_parallel_rank"}`` and an
  event ``{"type": tag, field: value, ...}``.

In both, fields whose value is their default are left out (``omit_defaults``: trailing
ones in an array), and fields are only ever appended between releases. Field order:

* ``BlockStored``: block_hashes, parent_block_hash, token_ids, block_size, lora_id,
  medium, lora_name, extra_keys, group_idx, kv_cache_spec_kind,
  kv_cache_spec_sliding_window;
* ``BlockRemoved``: block_hashes, medium, group_idx;
* ``AllBlocksCleared``: none.

The decoder (:func:`decode_batch`) accepts either form for the batch and for each event,
arrays shorter than today's (missing fields take their defaults) or longer (extra values
ignored), maps with unknown keys. An event of an unknown type, or one whose fields have
the wrong types, is skipped and counted; a payload that is not a batch at all raises
:class:`MalformedBatch`. Nothing here logs: the caller counts and logs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cache
from typing import Any, Literal, Sequence

from prefixroute.core.kvevents.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    KvEvent,
)

__all__ = ["ENCODINGS", "Encoding", "MAX_PAYLOAD_BYTES", "MalformedBatch", "DecodedBatch", "encode_batch",
           "decode_batch"]

#: The two wire forms: vLLM's positional arrays (``"array"``) and maps (``"map"``).
ENCODINGS = ("array", "map")
Encoding = Literal["array", "map"]
#: Largest payload decoded, bytes (a step of a 128k-token prefill is about 1 MB).
MAX_PAYLOAD_BYTES = 64 * 1024 * 1024
#: Problems kept per decoded batch (for a log line); the rest are only counted.
_MAX_PROBLEMS = 4

_STORED_FIELDS = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name",
                  "extra_keys", "group_idx", "kv_cache_spec_kind", "kv_cache_spec_sliding_window")
_REMOVED_FIELDS = ("block_hashes", "medium", "group_idx")
# Defaults of the fields vLLM declares with one (left out when equal to it).
_STORED_DEFAULTS = {"extra_keys": None, "group_idx": None, "kv_cache_spec_kind": None,
                    "kv_cache_spec_sliding_window": None}
_REMOVED_DEFAULTS = {"group_idx": None}


class MalformedBatch(ValueError):
    """A payload that is not a KV-event batch (not msgpack, or not a batch's shape)."""


@dataclass(slots=True)
class DecodedBatch:
    """What :func:`decode_batch` read from one payload.

    Attributes:
        batch: the batch with the events that decoded.
        unknown: events of a type this decoder does not know (skipped).
        malformed: events whose fields have the wrong types or sizes (skipped).
        problems: a few descriptions of skipped events, for a log line (never token ids).
    """

    batch: EventBatch
    unknown: int = 0
    malformed: int = 0
    problems: list[str] = field(default_factory=list)


@cache
def _msgpack() -> Any:
    """The ``msgpack`` module, imported on first use: it belongs to the ``precise`` extra,
    and the routing configuration imports this package whether precise mode is on or not."""
    try:
        import msgpack
    except ImportError as exc:
        raise ImportError("KV events need msgpack: pip install 'prefixroute[precise]'") from exc
    return msgpack


# -- encoding --------------------------------------------------------------------------


def _stored_values(e: BlockStored) -> list[Any]:
    return [list(e.block_hashes), e.parent_block_hash, list(e.token_ids), e.block_size, e.lora_id, e.medium,
            e.lora_name, None if e.extra_keys is None else [None if k is None else list(k) for k in e.extra_keys],
            e.group_idx, None, None]


def _encode_event(e: KvEvent, encoding: Encoding) -> Any:
    if isinstance(e, BlockStored):
        tag, names, values, defaults = "BlockStored", _STORED_FIELDS, _stored_values(e), _STORED_DEFAULTS
    elif isinstance(e, BlockRemoved):
        tag, names, values, defaults = ("BlockRemoved", _REMOVED_FIELDS, [list(e.block_hashes), e.medium, e.group_idx],
                                        _REMOVED_DEFAULTS)
    elif isinstance(e, AllBlocksCleared):
        return ["AllBlocksCleared"] if encoding == "array" else {"type": "AllBlocksCleared"}
    else:
        raise TypeError(f"not a KV event: {type(e).__name__}")
    if encoding == "map":
        out: dict[str, Any] = {"type": tag}
        for name, value in zip(names, values):
            if not (name in defaults and value == defaults[name]):
                out[name] = value
        return out
    n = len(values)
    while n and names[n - 1] in defaults and values[n - 1] == defaults[names[n - 1]]:
        n -= 1  # omit_defaults trims the trailing defaults of an array
    return [tag, *values[:n]]


def encode_batch(batch: EventBatch, encoding: Encoding = "array") -> bytes:
    """The msgpack payload of a batch, in vLLM's positional-array or map form.

    Raises:
        ValueError: an unknown ``encoding``. TypeError: an event of an unknown class.
    """
    if encoding not in ENCODINGS:
        raise ValueError(f"encoding must be one of {ENCODINGS}, got {encoding!r}")
    events = [_encode_event(e, encoding) for e in batch.events]
    if encoding == "map":
        obj: Any = {"ts": batch.ts, "events": events}
        if batch.data_parallel_rank is not None:
            obj["data_parallel_rank"] = batch.data_parallel_rank
    else:
        obj = [batch.ts, events, batch.data_parallel_rank]
    return _msgpack().packb(obj, use_bin_type=True)


# -- decoding --------------------------------------------------------------------------


def _fields(raw: Any, names: Sequence[str]) -> dict[str, Any]:
    """Field values of an event as a dict: from an array (after the tag) or a map."""
    if isinstance(raw, dict):
        return raw
    return dict(zip(names, raw[1:]))


def _is_hash(h: Any) -> bool:
    return (type(h) is int and h >= 0) or type(h) is bytes


_INT_ONLY = frozenset((int,))


def _check_hashes(hashes: Any) -> bool:
    if not isinstance(hashes, list) or not hashes:
        return False
    kinds = set(map(type, hashes))  # (one pass in C: this runs for every event of every batch)
    if kinds == _INT_ONLY:
        return min(hashes) >= 0
    return all(_is_hash(h) for h in hashes)


def _optional(value: Any, kind: type) -> bool:
    return value is None or (type(value) is kind)


_NO_VALUES = [None] * 9


def _stored(raw: Any) -> BlockStored | str:
    """A ``BlockStored`` from its array (``[tag, field, ...]``, read in place) or map."""
    if isinstance(raw, dict):
        hashes, parent, tokens, size, lora_id, medium, lora_name, extra, group = map(raw.get, _STORED_FIELDS[:9])
    else:
        values = raw[1:10]
        if len(values) < 9:  # (omit_defaults: trailing fields left out)
            values += _NO_VALUES[len(values):]
        hashes, parent, tokens, size, lora_id, medium, lora_name, extra, group = values
    if not _check_hashes(hashes):
        return "BlockStored.block_hashes is not a non-empty list of hashes"
    if parent is not None and not _is_hash(parent):
        return "BlockStored.parent_block_hash is not a hash"
    if type(size) is not int or size < 1:
        return "BlockStored.block_size is not a positive integer"
    if not isinstance(tokens, list) or len(tokens) != len(hashes) * size:
        return f"BlockStored.token_ids does not hold block_size x {len(hashes)} token ids"
    if not (_optional(lora_id, int) and _optional(medium, str) and _optional(lora_name, str)
            and _optional(group, int)):
        return "BlockStored.lora_id, medium, lora_name or group_idx has the wrong type"
    if extra is not None and not (isinstance(extra, list) and len(extra) == len(hashes)):
        return "BlockStored.extra_keys does not hold one entry per block"
    return BlockStored(hashes, parent, tokens, size, lora_id, medium, lora_name, extra, group)


def _removed(f: dict[str, Any]) -> BlockRemoved | str:
    hashes = f.get("block_hashes")
    if not _check_hashes(hashes):
        return "BlockRemoved.block_hashes is not a non-empty list of hashes"
    medium, group = f.get("medium"), f.get("group_idx")
    if not (_optional(medium, str) and _optional(group, int)):
        return "BlockRemoved.medium or group_idx has the wrong type"
    return BlockRemoved(hashes, medium, group)


def decode_batch(payload: bytes) -> DecodedBatch:
    """Decode one message's payload, tolerantly (see the module docstring).

    Args:
        payload: the msgpack bytes (the third frame of a published message).
    Returns:
        A :class:`DecodedBatch`: the events that decoded, and counts of those skipped.
    Raises:
        MalformedBatch: not msgpack, larger than :data:`MAX_PAYLOAD_BYTES`, or not a
            batch (an array ``[ts, events, ...]`` or a map with ``events``).
    """
    if len(payload) > MAX_PAYLOAD_BYTES:
        raise MalformedBatch(f"payload of {len(payload):,} bytes is over the {MAX_PAYLOAD_BYTES:,}-byte limit")
    try:
        obj = _msgpack().unpackb(payload, raw=False, strict_map_key=False)
    except Exception as exc:  # msgpack raises several types (ExtraData, FormatError, ValueError...)
        raise MalformedBatch(f"payload is not msgpack: {type(exc).__name__}") from None
    if isinstance(obj, list) and len(obj) >= 2:
        ts, events = obj[0], obj[1]
        rank = obj[2] if len(obj) > 2 else None
    elif isinstance(obj, dict) and "events" in obj:
        ts, events, rank = obj.get("ts", 0.0), obj["events"], obj.get("data_parallel_rank")
    else:
        raise MalformedBatch(f"payload is not an event batch (a {type(obj).__name__})")
    if not isinstance(events, list):
        raise MalformedBatch("the batch's events are not a list")
    if isinstance(ts, bool) or not isinstance(ts, (int, float)):
        ts = 0.0
    out = DecodedBatch(EventBatch(float(ts), [], rank if type(rank) is int else None))
    decoded: list[KvEvent] = out.batch.events  # type: ignore[assignment]
    for raw in events:
        if isinstance(raw, list) and raw and isinstance(raw[0], str):
            tag = raw[0]
        elif isinstance(raw, dict) and isinstance(raw.get("type"), str):
            tag = raw["type"]
        else:
            out.malformed += 1
            if len(out.problems) < _MAX_PROBLEMS:
                out.problems.append(f"an event is a {type(raw).__name__} without a type tag")
            continue
        result: KvEvent | str
        if tag == "BlockStored":
            result = _stored(raw)
        elif tag == "BlockRemoved":
            result = _removed(_fields(raw, _REMOVED_FIELDS))
        elif tag == "AllBlocksCleared":
            result = AllBlocksCleared()
        else:
            out.unknown += 1
            if len(out.problems) < _MAX_PROBLEMS:
                out.problems.append(f"unknown event type {tag[:40]!r}")
            continue
        if isinstance(result, str):
            out.malformed += 1
            if len(out.problems) < _MAX_PROBLEMS:
                out.problems.append(result)
        else:
            decoded.append(result)
    return out
