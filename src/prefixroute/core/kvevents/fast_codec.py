"""KV-event batches decoded in C with ``msgspec``, for the usual, well-formed message.

:func:`prefixroute.core.kvevents.codec.decode_batch` reads any message tolerantly, in
Python: about 2.5 µs of a one-block event's 5.5 µs ingest (``bench/kv_ingest.py``).
vLLM itself encodes its events with ``msgspec`` structs (``vllm/distributed/kv_events.py``:
``array_like=True, omit_defaults=True, tag=True``), so the same library, given structs
of the same shape, decodes a batch and checks its fields' types in one C pass.
:func:`decode_events` does that for both of vLLM's forms (positional arrays, maps with a
``type`` key) and returns ``None`` for anything it does not take whole: an unknown
event type, a field of the wrong type, a hash that is negative, token ids that do not
fill the blocks, an extra key that is a msgpack extension type, a payload over
:data:`~prefixroute.core.kvevents.codec.MAX_PAYLOAD_BYTES`, or ``msgspec`` not
installed. The caller then decodes the message with ``decode_batch``, which skips and
counts what is wrong event by event. Arrays longer than today's (fields a later release
appends) and maps with unknown keys are read, as the tolerant decoder reads them. The structs' field names are
:class:`~prefixroute.core.kvevents.events.BlockStored`'s and
:class:`~prefixroute.core.kvevents.events.BlockRemoved`'s, and they are registered
with :data:`~prefixroute.core.kvevents.events.EVENT_KINDS`, so
:meth:`~prefixroute.core.kvevents.index.InstanceIndex.apply` takes either.

Optional: ``msgspec`` belongs to the ``precise`` extra; without it every message takes
the tolerant path.
"""

# (no ``from __future__ import annotations``: the structs below are made in a function,
# and msgspec reads their annotations as the types themselves)
from functools import cache
from typing import Any, Optional

from prefixroute.core.kvevents.codec import MAX_PAYLOAD_BYTES
from prefixroute.core.kvevents.events import EVENT_KINDS

__all__ = ["decode_events", "available"]


@cache
def _decoders() -> Optional[tuple[Any, Any, Any]]:
    """``(array decoder, map decoder, ValidationError-ish errors)``, or ``None`` without msgspec."""
    try:
        import msgspec
    except ImportError:
        return None
    from typing import Annotated, Union

    Hash = Union[Annotated[int, msgspec.Meta(ge=0)], bytes]  # noqa: N806
    Hashes = Annotated[list[Hash], msgspec.Meta(min_length=1)]  # noqa: N806
    Size = Annotated[int, msgspec.Meta(ge=1)]  # noqa: N806

    def kinds(array: bool) -> tuple[type, type, type, type]:
        opts: dict[str, Any] = {"array_like": True} if array else {"tag_field": "type"}

        class Stored(msgspec.Struct, tag="BlockStored", frozen=True, gc=False, **opts):  # type: ignore[call-arg]
            block_hashes: Hashes
            parent_block_hash: Optional[Hash]
            token_ids: list[int]
            block_size: Size
            lora_id: Optional[int] = None
            medium: Optional[str] = None
            lora_name: Optional[str] = None
            extra_keys: Optional[list[Any]] = None
            group_idx: Optional[int] = None
            kv_cache_spec_kind: Any = None
            kv_cache_spec_sliding_window: Any = None

        class Removed(msgspec.Struct, tag="BlockRemoved", frozen=True, gc=False, **opts):  # type: ignore[call-arg]
            block_hashes: Hashes
            medium: Optional[str] = None
            group_idx: Optional[int] = None

        class Cleared(msgspec.Struct, tag="AllBlocksCleared", frozen=True, gc=False, **opts):  # type: ignore[call-arg]
            pass

        Event = Union[Stored, Removed, Cleared]  # noqa: N806
        if array:
            class Batch(msgspec.Struct, array_like=True, gc=False):
                ts: float
                events: list[Event]  # type: ignore[valid-type]
                data_parallel_rank: Optional[int] = None
        else:
            class Batch(msgspec.Struct, gc=False):  # type: ignore[no-redef]
                events: list[Event]  # type: ignore[valid-type]
                ts: float = 0.0
                data_parallel_rank: Optional[int] = None
        return Stored, Removed, Cleared, Batch

    decoders = []
    for array in (True, False):
        stored, removed, cleared, batch = kinds(array)
        EVENT_KINDS[stored] = "stored"
        EVENT_KINDS[removed] = "removed"
        EVENT_KINDS[cleared] = "cleared"
        decoders.append((msgspec.msgpack.Decoder(batch), stored))
    return decoders[0], decoders[1], (msgspec.ValidationError, msgspec.DecodeError)


def available() -> bool:
    """Whether ``msgspec`` is installed (else every message takes the tolerant path)."""
    return _decoders() is not None


def decode_events(payload: bytes) -> Optional[list[Any]]:
    """The events of a well-formed batch, decoded in C; ``None`` when the message is not
    one this decoder takes whole (module docstring): decode it with
    :func:`~prefixroute.core.kvevents.codec.decode_batch`.

    Args:
        payload: the msgpack bytes (the third frame of a published message).
    Returns:
        The events in order: structs with the fields of
        :class:`~prefixroute.core.kvevents.events.BlockStored`,
        :class:`~prefixroute.core.kvevents.events.BlockRemoved` or an
        ``AllBlocksCleared`` (a missing ``medium`` is ``None``: the GPU), or ``None``.
    """
    dec = _decoders()
    if dec is None or not payload or len(payload) > MAX_PAYLOAD_BYTES:
        return None
    first = payload[0]
    if 0x90 <= first <= 0x9F or first in (0xDC, 0xDD):  # an array
        (decoder, stored), errors = dec[0], dec[2]
    elif 0x80 <= first <= 0x8F or first in (0xDE, 0xDF):  # a map
        (decoder, stored), errors = dec[1], dec[2]
    else:
        return None
    try:
        events = decoder.decode(payload).events
    except errors:
        return None
    for e in events:  # what the types cannot say: the token ids fill the blocks
        if type(e) is stored:
            n = len(e.block_hashes)
            extra = e.extra_keys
            if len(e.token_ids) != n * e.block_size or (extra is not None and (len(extra) != n
                                                                              or not _plain(extra))):
                return None
    return events


_PLAIN = (type(None), bool, int, float, str, bytes)


def _plain(value: Any, depth: int = 0) -> bool:
    """Whether ``value`` holds only msgpack's plain values (the tolerant decoder reads an
    extension type or a timestamp as other objects than msgspec does: such a batch goes
    there, so that both paths key its blocks alike)."""
    if type(value) in _PLAIN:
        return True
    if type(value) is list and depth < 4:
        return all(_plain(v, depth + 1) for v in value)
    return False
