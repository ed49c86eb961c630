"""KV-event batches decoded in C (core.kvevents.fast_codec): the same events as the tolerant
decoder for every well-formed batch in either form, ``None`` (the tolerant path) for
anything else, and the same index state either way."""

from __future__ import annotations

from typing import Any

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixroute.core.kvevents.codec import decode_batch, encode_batch
from prefixroute.core.kvevents.events import EVENT_KINDS, AllBlocksCleared, BlockRemoved, BlockStored, EventBatch
from prefixroute.core.kvevents.fast_codec import available, decode_events
from prefixroute.core.kvevents.index import InstanceIndex, SharedIndex


def fields(e: Any) -> tuple:
    kind = EVENT_KINDS[type(e)]
    if kind == "stored":
        return (kind, list(e.block_hashes), e.parent_block_hash, list(e.token_ids), e.block_size, e.lora_id,
                e.medium, e.lora_name, e.extra_keys, e.group_idx)
    if kind == "removed":
        return kind, list(e.block_hashes), e.medium, e.group_idx
    return (kind,)


def test_msgspec_is_installed_with_the_precise_extra() -> None:
    assert available()


hashes = st.lists(st.integers(0, 2**64 - 1) | st.binary(min_size=1, max_size=8), min_size=1, max_size=5)
events = st.lists(st.one_of(
    st.builds(lambda h, p, lora, medium, lid: BlockStored(h, p, list(range(4 * len(h))), 4, lid, medium, lora),
              hashes, st.none() | st.integers(0, 2**64 - 1) | st.binary(min_size=1, max_size=8),
              st.none() | st.text(max_size=5), st.sampled_from([None, "GPU", "CPU", "SHARED"]),
              st.none() | st.integers(0, 9)),
    st.builds(BlockRemoved, hashes, st.sampled_from([None, "GPU", "CPU"]), st.none() | st.integers(0, 2)),
    st.just(AllBlocksCleared())), max_size=6)


@settings(max_examples=200, deadline=None)
@given(events, st.none() | st.integers(0, 7), st.sampled_from(["array", "map"]))
def test_well_formed_batches_decode_to_the_tolerant_decoders_events(evs: list, rank: int | None,
                                                                     form: str) -> None:
    payload = encode_batch(EventBatch(1.0, evs, rank), form)  # type: ignore[arg-type]
    fast = decode_events(payload)
    slow = decode_batch(payload)
    assert fast is not None and slow.malformed == slow.unknown == 0
    assert [fields(e) for e in fast] == [fields(e) for e in slow.batch.events]


def test_older_shorter_arrays_and_newer_longer_ones_decode_as_the_tolerant_decoder_reads_them() -> None:
    old = ["BlockStored", [5], None, list(range(16)), 16, None, "GPU"]
    removed_old = ["BlockRemoved", [5]]
    fast = decode_events(msgpack.packb([9.0, [old, removed_old]]))
    assert fast is not None
    assert [fields(e) for e in fast] == [("stored", [5], None, list(range(16)), 16, None, "GPU", None, None, None),
                                         ("removed", [5], None, None)]
    new = old + ["lora-a", [["lora-a"]], 1, "full_attention", None, "a field from the future"]
    payload = msgpack.packb([9.0, [new], 0, "a field of the batch from the future"])
    fast = decode_events(payload)
    assert fast is not None and fast[0].lora_name == "lora-a" and fast[0].group_idx == 1
    assert [fields(e) for e in fast] == [fields(e) for e in decode_batch(payload).batch.events]


BAD_EVENTS = [
    ["BlockPinned", [1]],  # unknown type
    {"type": "SomethingElse"},
    ["BlockStored", [1, 2], None, [0] * 16, 16],  # token ids for one block only
    ["BlockStored", [], None, [], 16],  # no block
    ["BlockStored", ["not a hash"], None, [0] * 16, 16],
    ["BlockStored", [-1], None, [0] * 16, 16],  # a negative hash
    ["BlockStored", [True], None, [0] * 16, 16],  # a boolean is no hash
    ["BlockStored", [1], None, [0] * 16, 0],  # block size 0
    ["BlockRemoved", [1], 5],  # medium of the wrong type
    ["BlockStored", [1], None, [0] * 16, 16, None, "GPU", None, [1, 2]],  # extra keys not per block
    42,
]


@pytest.mark.parametrize("bad", BAD_EVENTS, ids=range(len(BAD_EVENTS)))
@pytest.mark.parametrize("form", ["array", "map"])
def test_a_batch_with_any_bad_event_takes_the_tolerant_path(bad: Any, form: str) -> None:
    good = ["BlockRemoved", [7], "GPU"] if form == "array" else {"type": "BlockRemoved", "block_hashes": [7]}
    batch: Any = [1.0, [good, bad], 0] if form == "array" else {"ts": 1.0, "events": [good, bad]}
    payload = msgpack.packb(batch)
    assert decode_events(payload) is None
    slow = decode_batch(payload)
    assert slow.malformed + slow.unknown == 1 and len(slow.batch.events) == 1


@pytest.mark.parametrize("payload", [b"", b"\xc1", msgpack.packb({"ts": 1.0}), msgpack.packb([1.0]),
                                     msgpack.packb([1.0, "events"]), msgpack.packb("text"),
                                     msgpack.packb([1.0, []]) + b"trailing", msgpack.packb([True, []]),
                                     msgpack.packb([1.0, [], "rank"])])
def test_payloads_that_are_no_plain_batch_take_the_tolerant_path(payload: bytes) -> None:
    assert decode_events(payload) is None


def test_unknown_keys_of_a_map_are_ignored_as_the_tolerant_decoder_ignores_them() -> None:
    payload = msgpack.packb({"ts": 1.0, "new_key": 1, "events": [
        {"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None, "token_ids": [0] * 16,
         "block_size": 16, "brand_new_field": {"x": 1}}]})
    fast = decode_events(payload)
    assert fast is not None and [fields(e) for e in fast] == [fields(e) for e in decode_batch(payload).batch.events]


def test_the_index_ends_in_the_same_state_either_way() -> None:
    stored = BlockStored([11, 12, 13], None, list(range(48)), 16, None, "GPU", None)
    more = BlockStored([21], 12, list(range(100, 116)), 16, None, "CPU", "adapter")
    batches = [EventBatch(1.0, [stored, more]), EventBatch(2.0, [BlockRemoved([13], None), BlockRemoved([21], "CPU")]),
               EventBatch(3.0, [BlockStored([31], 11, list(range(16)), 16), AllBlocksCleared(),
                                BlockStored([41], None, list(range(16)), 16)])]
    for form in ("array", "map"):
        for upto in range(1, len(batches) + 1):
            fast_ix, slow_ix = InstanceIndex(16, SharedIndex()), InstanceIndex(16, SharedIndex())
            for b in batches[:upto]:
                payload = encode_batch(b, form)  # type: ignore[arg-type]
                fast = decode_events(payload)
                assert fast is not None
                fast_ix.apply(fast)
                slow_ix.apply(decode_batch(payload).batch.events)
            assert fast_ix.held == slow_ix.held and fast_ix.keys == slow_ix.keys
            assert fast_ix.counters == slow_ix.counters and len(fast_ix.held) > 0


def test_an_extension_type_in_extra_keys_takes_the_tolerant_path_which_keys_it_as_before() -> None:
    event = ["BlockStored", [1], None, [0] * 16, 16, None, "GPU", None, [[msgpack.ExtType(5, b"xy")]]]
    payload = msgpack.packb([1.0, [event]])
    assert decode_events(payload) is None
    slow = decode_batch(payload)
    assert slow.malformed == slow.unknown == 0 and slow.batch.events[0].extra_keys == [[msgpack.ExtType(5, b"xy")]]
    plain = msgpack.packb([1.0, [event[:8] + [[["mm-hash", 3, b"\x01", 0.5, None, True, ["nested"]]]]]])
    fast = decode_events(plain)
    assert fast is not None and [fields(e) for e in fast] == [fields(e) for e in decode_batch(plain).batch.events]
