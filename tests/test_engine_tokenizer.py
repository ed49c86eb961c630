"""The emulated engine's tokenizer: the 4-byte-chunk rule and its prefix stability."""

from __future__ import annotations

import time

import pytest
from hypothesis import given
from hypothesis import strategies as st

from prefixroute.engine.kvcache import prompt_block_hashes
from prefixroute.engine.tokenizer import (
    OUTPUT_WORDS,
    TokenizedPrompt,
    count_tokens,
    decode,
    encode,
    from_token_ids,
    output_token_id,
    token_payload,
    tokenize,
    tokenize_text,
)

# Text without lone surrogates (they cannot round-trip through UTF-8 decoding).
texts = st.text(st.characters(exclude_categories=("Cs",)), max_size=200)


def _aligned(s: str) -> str:
    """Pad ``s`` with ASCII so its UTF-8 length is a multiple of 4 bytes."""
    return s + "x" * (-len(s.encode()) % 4)


def test_encode_rule_values() -> None:
    assert encode("") == []
    assert encode("abcd") == [int.from_bytes(b"abcd", "little") + (4 << 32)]
    assert encode("abcde") == [int.from_bytes(b"abcd", "little") + (4 << 32), ord("e") + (1 << 32)]
    # "é" is 2 UTF-8 bytes: "aé" is 3 bytes, one short token
    assert encode("aé") == [int.from_bytes("aé".encode(), "little") + (3 << 32)]


def test_length_marker_makes_ids_injective() -> None:
    assert encode("a") != encode("a\0")
    assert encode("a\0\0\0") != encode("a")
    assert len(set(encode("a") + encode("a\0") + encode("a\0\0") + encode("a\0\0\0"))) == 4


@given(texts)
def test_counts_agree(text: str) -> None:
    n = len(encode(text))
    assert count_tokens(text) == n
    assert tokenize_text(text).num_tokens == n
    assert n == -(-len(text.encode()) // 4)


@given(texts, texts)
def test_prefix_stability(head: str, tail: str) -> None:
    head = _aligned(head)
    whole = head + tail
    assert encode(whole)[: len(encode(head))] == encode(head)
    # the payload the cache hashes has the same property, so block hashes do too
    assert tokenize_text(whole).payload.startswith(tokenize_text(head).payload)
    assert prompt_block_hashes(tokenize_text(whole), 4)[: len(encode(head)) // 4] == prompt_block_hashes(
        tokenize_text(head), 4
    )


@given(texts)
def test_decode_round_trip(text: str) -> None:
    assert decode(encode(text)) == text


@given(texts)
def test_payload_is_token_aligned_and_padding_cannot_be_text(text: str) -> None:
    p = tokenize_text(text)
    assert len(p.payload) == 4 * p.num_tokens
    raw = text.encode()
    assert p.payload[: len(raw)] == raw
    assert set(p.payload[len(raw) :]) <= {0xFF}


def test_english_is_about_four_characters_per_token() -> None:
    text = ("The quick brown fox jumps over the lazy dog. " * 800)[:32_000]
    assert count_tokens(text) == 8_000


def test_token_ids_are_used_as_is() -> None:
    p = from_token_ids([128000, 9906, 11, 1917])
    assert p == TokenizedPrompt(p.payload, 8, 4)
    assert tokenize([128000, 9906, 11, 1917]) == p
    assert tokenize(p) is p
    assert not p.is_text and tokenize_text("hi").is_text


@pytest.mark.parametrize("bad", [[-1], [1 << 64], [1.5], ["a"]])
def test_bad_token_ids_raise(bad: list) -> None:
    with pytest.raises(ValueError):
        from_token_ids(bad)


def test_output_words_are_one_token_each_and_deterministic() -> None:
    assert all(len(w.encode()) == 4 for w in OUTPUT_WORDS)
    ids = [output_token_id(1234, i) for i in range(64)]
    assert ids == [output_token_id(1234, i) for i in range(64)]
    assert ids != [output_token_id(4321, i) for i in range(64)]
    text = decode(ids)
    assert len(encode(text)) == 64
    assert all(decode([t]) in OUTPUT_WORDS for t in ids)
    assert token_payload(ids[0], 4) == decode([ids[0]]).encode()
    assert token_payload(ids[0], 8) == ids[0].to_bytes(8, "little")


def test_tokenize_and_hash_32k_character_prompts_fast() -> None:
    doc = "Retrieved passage about prefix caching in LLM serving. " * 600
    start = time.perf_counter()
    for i in range(50):
        prompt = tokenize(doc[:32_000] + f" question {i}?")
        prompt_block_hashes(prompt, 16)
    per_request = (time.perf_counter() - start) / 50
    assert prompt.num_tokens == 8_004
    assert per_request < 0.01  # tens of requests/s need < 0.05 s; measured ~0.3 ms
