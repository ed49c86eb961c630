"""KV-event batches on the wire: both of vLLM's msgpack forms, decoded tolerantly."""

from __future__ import annotations

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixroute.core.kvevents.codec import MalformedBatch, decode_batch, encode_batch
from prefixroute.core.kvevents.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    Tier,
    tier_of,
)

STORED = BlockStored([11, 12], 10, list(range(32)), 16, None, "GPU", None)
REMOVED = BlockRemoved([11], "CPU")


def test_array_form_is_vllms_positional_layout() -> None:
    raw = msgpack.unpackb(encode_batch(EventBatch(1.5, [STORED, REMOVED, AllBlocksCleared()], 0), "array"))
    assert raw == [1.5, [["BlockStored", [11, 12], 10, list(range(32)), 16, None, "GPU", None],
                         ["BlockRemoved", [11], "CPU"],
                         ["AllBlocksCleared"]], 0]


def test_map_form_is_tagged_with_defaults_left_out() -> None:
    raw = msgpack.unpackb(encode_batch(EventBatch(2.0, [STORED, REMOVED, AllBlocksCleared()], None), "map"))
    assert raw == {"ts": 2.0, "events": [
        {"type": "BlockStored", "block_hashes": [11, 12], "parent_block_hash": 10, "token_ids": list(range(32)),
         "block_size": 16, "lora_id": None, "medium": "GPU", "lora_name": None},
        {"type": "BlockRemoved", "block_hashes": [11], "medium": "CPU"},
        {"type": "AllBlocksCleared"}]}


def test_both_forms_decode_to_the_same_batch() -> None:
    batch = EventBatch(3.25, [STORED, REMOVED, AllBlocksCleared(), BlockStored([b"\x01" * 32], b"\x00" * 32,
                                                                               [1] * 16, 16, 7, None, "adapter")], 2)
    a, m = decode_batch(encode_batch(batch, "array")), decode_batch(encode_batch(batch, "map"))
    assert a.batch == m.batch == batch
    assert (a.unknown, a.malformed, m.unknown, m.malformed) == (0, 0, 0, 0)


hashes = st.lists(st.integers(0, 2**64 - 1), min_size=1, max_size=5)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.one_of(
    st.builds(lambda h, p, lora, medium: BlockStored(h, p, list(range(4 * len(h))), 4, None, medium, lora),
              hashes, st.none() | st.integers(0, 2**64 - 1), st.none() | st.text(max_size=5),
              st.sampled_from([None, "GPU", "CPU", "SHARED"])),
    st.builds(BlockRemoved, hashes, st.sampled_from([None, "GPU", "CPU"])),
    st.just(AllBlocksCleared())), max_size=6), st.none() | st.integers(0, 7))
def test_round_trip_in_both_forms(events: list, rank: int | None) -> None:
    batch = EventBatch(1.0, events, rank)
    for form in ("array", "map"):
        assert decode_batch(encode_batch(batch, form)).batch == batch


def test_older_shorter_arrays_and_newer_longer_ones_decode() -> None:
    old = ["BlockStored", [5], None, list(range(16)), 16, None, "GPU"]  # before lora_name was added
    new = ["BlockStored", [5], None, list(range(16)), 16, None, "GPU", "lora-a", [["lora-a"]], 1, "full_attention",
           None, "a field from the future"]
    removed_old = ["BlockRemoved", [5]]  # before medium
    payload = msgpack.packb([9.0, [old, new, removed_old]])  # a batch without the rank field
    out = decode_batch(payload)
    assert out.malformed == out.unknown == 0
    first, second, third = out.batch.events
    assert first == BlockStored([5], None, list(range(16)), 16, None, "GPU", None)
    assert second.lora_name == "lora-a" and second.group_idx == 1 and second.extra_keys == [["lora-a"]]
    assert third == BlockRemoved([5], None) and tier_of(third.medium) is Tier.GPU
    assert out.batch.data_parallel_rank is None


def test_unknown_fields_types_and_malformed_events_are_counted_and_skipped() -> None:
    events = [
        {"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None, "token_ids": [0] * 16,
         "block_size": 16, "lora_id": None, "medium": "GPU", "lora_name": None, "brand_new_field": {"x": 1}},
        ["BlockPinned", [1]],  # unknown type
        {"type": "SomethingElse"},
        ["BlockStored", [1, 2], None, [0] * 16, 16],  # token ids for one block only
        ["BlockStored", [], None, [], 16],  # no block
        ["BlockStored", ["not a hash"], None, [0] * 16, 16],
        ["BlockStored", [1], None, [0] * 16, 0],  # block size 0
        ["BlockRemoved", [1], 5],  # medium of the wrong type
        ["BlockStored", [1], None, [0] * 16, 16, None, "GPU", None, [1, 2]],  # extra keys not per block
        42,  # not an event at all
        ["BlockRemoved", [7], "GPU"],
    ]
    out = decode_batch(msgpack.packb({"ts": 1.0, "events": events, "data_parallel_rank": 0, "new_key": 1}))
    assert out.unknown == 2 and out.malformed == 7
    assert out.batch.events == [BlockStored([1], None, [0] * 16, 16, None, "GPU", None), BlockRemoved([7], "GPU")]
    assert len(out.problems) == 4 and "unknown event type 'BlockPinned'" in out.problems


@pytest.mark.parametrize("payload", [b"", b"\xc1", msgpack.packb({"ts": 1.0}), msgpack.packb([1.0]),
                                     msgpack.packb([1.0, "events"]), msgpack.packb("text"),
                                     msgpack.packb([1.0, []]) + b"trailing"])
def test_a_payload_that_is_no_batch_raises(payload: bytes) -> None:
    with pytest.raises(MalformedBatch):
        decode_batch(payload)


def test_tiers_of_media() -> None:
    assert [tier_of(m) for m in (None, "GPU", "cpu", "SHARED", "DISK")] == [Tier.GPU, Tier.GPU, Tier.CPU,
                                                                            Tier.SHARED, None]
    with pytest.raises(ValueError):
        encode_batch(EventBatch(0.0, []), "json")  # type: ignore[arg-type]
