"""A request's KV block keys from its pieces (core/precise_keys.py) equal the keys of its
whole tokenization, however the pieces are cached."""

from __future__ import annotations

import dataclasses
import itertools
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixroute.core.keys import InvalidRequest
from prefixroute.core.kvevents.chain import block_keys, chain_root
from prefixroute.core.model_tokenizer import ModelTokenizer
from prefixroute.core.precise_keys import RequestKeyer
from prefixroute.workloads.catalog import bench_workload

TOK = dataclasses.replace(ModelTokenizer.load("tiny"), media_tokens=576)  # images as stand-in text


def whole(body: dict, chat: bool, lora: str | None = None, bs: int = 16) -> tuple[list[int], int]:
    ids = TOK.request_token_ids(body, chat)
    return block_keys(ids, bs, chain_root(lora)), len(ids)


def test_chat_requests_of_the_catalog_key_as_their_whole_token_ids():
    keyer = RequestKeyer(TOK, 16)
    assert keyer._split is not None  # the tiny tokenizer's pieces add up: the cache is on
    rng = random.Random(1)
    n = 0
    for name in ("multi-turn", "agentic", "shared-prefix", "images"):
        for s in itertools.islice(bench_workload(name).make(3).sessions(), 6):
            answers: list[str] = []
            for t in range(min(s.num_turns, 3)):
                body = s.body(t, answers)
                assert keyer.keys(body, True) == whole(body, True), (name, t)
                answers.append(" ".join(rng.choice(["cache", "route", "token", "é", "\n"]) for _ in range(30)))
                n += 1
    assert n >= 40 and keyer.hits > keyer.misses  # histories and system prompts came from the cache


@settings(max_examples=60, deadline=None)
@given(st.lists(st.text(min_size=0, max_size=80), min_size=1, max_size=4), st.sampled_from([None, "adapter-a"]),
       st.sampled_from([1, 16, 64]))
def test_any_text_keys_as_its_whole_token_ids(parts, lora, bs):
    keyer = RequestKeyer(TOK, bs)
    body = {"messages": [{"role": "user" if i % 2 == 0 else "assistant", "content": p} for i, p in enumerate(parts)]}
    for _ in range(2):  # cold, then from the cache
        assert keyer.keys(body, True, lora) == whole(body, True, lora, bs)
    prompt = {"prompt": "<|eot_id|>".join(parts)}
    assert keyer.keys(prompt, False, lora) == whole(prompt, False, lora, bs)


def test_token_id_prompts_and_errors():
    keyer = RequestKeyer(TOK, 16)
    ids = list(range(3, 40))
    assert keyer.keys({"prompt": ids}, False) == (block_keys(ids, 16, chain_root(None)), 37)
    with pytest.raises(InvalidRequest):
        keyer.keys({"prompt": 7}, False)
    with pytest.raises(ValueError):
        RequestKeyer(TOK, 0)
    uncached = RequestKeyer(TOK, 16, cache_pieces=0)
    body = {"messages": [{"role": "user", "content": "hello " * 50}]}
    assert uncached.keys(body, True) == whole(body, True) and uncached.stats()["pieces"] == 0
