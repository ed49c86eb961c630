"""Precise mode matching by bytes: token ids rendered back to text (core/token_bytes.py),
the fleet's held blocks by their bytes (core/kvevents/byte_index.py), a request matched
without tokenizing it (RequestKeyer.match_bytes), and what is about to be held kept by
the routing chain (precise_policy.Speculative)."""

from __future__ import annotations

import random
from itertools import count

import pytest

pytest.importorskip("tokenizers")

from hypothesis import given, settings, strategies as st  # noqa: E402

from prefixroute.core.keys import text_block_hashes  # noqa: E402
from prefixroute.core.kvevents.events import BlockRemoved, BlockStored  # noqa: E402
from prefixroute.core.kvevents.view import PreciseCacheView  # noqa: E402
from prefixroute.core.model_tokenizer import ModelTokenizer  # noqa: E402
from prefixroute.core.precise_keys import RequestKeyer  # noqa: E402
from prefixroute.core.precise_policy import SPECULATIVE_MIN_UNITS, Speculative  # noqa: E402
from prefixroute.core.strategies import InstanceState  # noqa: E402
from prefixroute.core.token_bytes import TokenBytes  # noqa: E402

BS = 16
TOK = ModelTokenizer.load("tiny")
TB = TokenBytes.build(TOK)
_hashes = count(1)
WORDS = ["alpha", "beta,", "gamma.", "délta", "日本語", "🙂", "x", "  ", "\n", "don't", "3.14", "{\"k\":"]


def chat(system: str, user: str) -> dict:
    return {"model": "m", "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}]}


def view_with(*instances: str) -> PreciseCacheView:
    view = PreciseCacheView(BS)
    view.use_token_bytes(TB)
    for i in instances:
        view.add_instance(i).on_connected()
    return view


def store(view: PreciseCacheView, instance: str, ids: list[int], medium: str = "GPU", lora: str | None = None,
          extra_keys: list | None = None) -> list[int]:
    """The instance stores every full block of ``ids``; returns the engine hashes."""
    n = len(ids) // BS
    hashes = [next(_hashes) for _ in range(n)]
    view.stream(instance).index.apply([BlockStored(hashes, None, ids[: n * BS], BS, medium=medium,  # type: ignore[union-attr]
                                                   lora_name=lora, extra_keys=extra_keys)])
    return hashes


def test_the_tiny_tokenizers_tokens_render_to_exactly_their_text():
    assert TB is not None
    assert TB.completion_prefix == b"<|begin_of_text|>"
    text = TOK.render_chat(chat("Système: naïve café 日本語 🙂\n\n  spaces", "Why?"))
    ids = TOK.encode(text, add_special_tokens=False)
    assert TB.render(ids) == text.encode("utf-8")
    assert 1.0 < TB.bytes_per_token < 4.0
    assert TB.render([0, 10**9]) is None and TB.render([-1]) is None


def test_a_tokenizer_whose_tokens_do_not_render_to_their_text_is_refused():
    from tokenizers import Tokenizer, models, pre_tokenizers

    # SentencePiece style: a "▁" before the first word renders a space the text lacks.
    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "▁Hello": 1, "▁world": 2}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    assert TokenBytes.build(ModelTokenizer("sp", tok)) is None


@pytest.mark.parametrize("chat_api", [True, False])
@pytest.mark.parametrize("lora", [None, "sql-adapter"])
def test_a_walk_finds_the_keys_the_tokenized_request_has(chat_api, lora):
    # For a prompt an instance holds, the walk over its bytes gives exactly the keys the
    # tokenized request has (chat and completions, base model and LoRA adapter), and
    # stops where the held chain ends.
    view = view_with("a")
    rng = random.Random(5)
    doc = " ".join(rng.choice(WORDS) for _ in range(900))
    body = chat(doc, "first?") if chat_api else {"model": "m", "prompt": doc + " first?"}
    ids = TOK.request_token_ids(body, chat_api)
    keys = view.request_keys(ids, lora)
    store(view, "a", ids, lora=lora)
    keyer = RequestKeyer(TOK, BS)
    keyer.token_bytes = TB
    follow = chat(doc, "second question, longer") if chat_api else {"model": "m", "prompt": doc + " second one"}
    got, tokens = keyer.match_bytes(follow, chat_api, view, lora)
    follow_keys = view.request_keys(TOK.request_token_ids(follow, chat_api), lora)
    shared = next((i for i, (x, y) in enumerate(zip(keys, follow_keys)) if x != y), min(len(keys), len(follow_keys)))
    assert got == follow_keys[: len(got)] and shared - 1 <= len(got) <= shared
    # Its tokens: the held blocks' exactly, the rest estimated from its bytes.
    assert abs(tokens - len(TOK.request_token_ids(follow, chat_api))) <= 0.05 * tokens
    # The same text on the base model (or on the adapter) matches nothing of the other's.
    other, _ = keyer.match_bytes(follow, chat_api, view, None if lora else "sql-adapter")
    assert other == []
    assert keyer.stats()["byte_matched"] == 2 and keyer.stats()["misses"] == 0


def test_holders_are_counted_across_instances_and_tiers_and_the_last_one_forgets():
    view = view_with("a", "b")
    bx = view.byte_index
    assert bx is not None
    ids = TOK.encode("shared document " * 40, add_special_tokens=False)
    data = TB.render(ids)
    n = len(ids) // BS
    ha = store(view, "a", ids)
    hb = store(view, "b", ids)
    assert len(bx) == n and len(view.match_bytes(data)[0]) == n  # type: ignore[index]
    view.stream("a").index.apply([BlockRemoved(ha[3:])])  # type: ignore[union-attr]
    assert len(view.match_bytes(data)[0]) == n  # type: ignore[index]  # b still holds all of it
    view.stream("b").index.apply([BlockRemoved(hb[5:])])  # type: ignore[union-attr]
    assert len(view.match_bytes(data)[0]) == 5 and len(bx) == 5  # type: ignore[index]
    hs = store(view, "b", ids, medium="SHARED")  # the shared tier holds it all again
    assert len(view.match_bytes(data)[0]) == n  # type: ignore[index]
    view.stream("b").index.apply([BlockRemoved(hs, medium="SHARED")])  # type: ignore[union-attr]
    view.remove_instance("a")
    assert len(view.match_bytes(data)[0]) == 5  # type: ignore[index]
    view.stream("b").reset("test")  # type: ignore[union-attr]
    assert len(bx) == 0 and view.match_bytes(data) == ([], [])
    assert (bx._by_bytes, bx._lengths) == ({}, {})  # nothing left behind


def test_blocks_with_a_media_hash_are_not_indexed_but_an_adapters_name_is_no_obstacle():
    view = view_with("a")
    ids = TOK.encode("an image and its question " * 20, add_special_tokens=False)
    n = len(ids) // BS
    store(view, "a", ids, extra_keys=[["mm-hash-1"]] + [None] * (n - 1))
    assert len(view.byte_index) == 0  # type: ignore[arg-type]
    store(view, "a", ids, lora="ad", extra_keys=[["ad"]] * n)
    assert len(view.match_bytes(TB.render(ids), "ad")[0]) == n  # type: ignore[arg-type,index]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(0, 5), st.integers(0, 2)), min_size=1, max_size=12),
       st.integers(0, 3), st.integers(0, 5))
def test_a_walk_reaches_as_far_as_the_longest_held_prefix(stored, doc, question):
    # Whatever prompts (documents x questions) the instances stored, the walk over a
    # prompt's bytes ends where the longest prefix of its keys any instance holds ends
    # (within the one block where a question starts), and the keys it gives are that
    # prefix of the tokenized prompt's keys.
    rngs = [random.Random(d) for d in range(4)]
    docs = [" ".join(rngs[d].choice(WORDS) for _ in range(60 + 30 * d)) for d in range(4)]
    view = view_with("a", "b", "c")
    for d, q, inst in stored:
        store(view, "abc"[inst], TOK.encode(docs[d] + f" question {q}?", add_special_tokens=False))
    text = docs[doc] + f" question {question}?"
    ids = TOK.encode(text, add_special_tokens=False)
    keys = view.request_keys(ids)
    held = view.holdings(keys)
    longest = max(h.total_tokens for h in held.values()) // BS
    got, ends = view.match_bytes(text.encode())  # type: ignore[misc]
    assert got == keys[: len(got)]
    assert longest - 1 <= len(got) <= longest
    assert ends == sorted(ends) and (not ends or ends[-1] <= len(text.encode()))


def test_what_was_just_sent_counts_by_the_routing_chain_until_the_events_show_it():
    spec = Speculative()
    inst = InstanceState("http://a", in_flight=1)
    doc = "a document of some length " * 80
    first = text_block_hashes(doc + "question one", 64, 131_072, "m")
    second = text_block_hashes(doc + "question two", 64, 131_072, "m")
    ends1 = [e >> first.unit_shift for e in first.ends]
    ends2 = [e >> second.unit_shift for e in second.ends]
    spec.routed(inst.instance_id, first.hashes(), ends1)
    shared_units = max(e for e, a, b in zip(ends2, first.hashes(), second.hashes()) if a == b)
    assert shared_units >= SPECULATIVE_MIN_UNITS
    assert spec.match(inst, second.hashes(), ends2, 0) == shared_units  # not in the events yet
    assert spec.match(inst, second.hashes(), ends2, shared_units) == 0  # the events show it now
    assert spec.match(inst, second.hashes(), ends2, 100) == 0  # and later less of it: evicted, dropped
    assert spec.entries[inst.instance_id] == {}
    spec.routed(inst.instance_id, first.hashes(), ends1)
    short = text_block_hashes(doc[:500] + "other", 64, 131_072, "m")
    assert spec.match(inst, short.hashes(), [e >> short.unit_shift for e in short.ends], 0) == 0  # too little shared
    idle = InstanceState("http://a", in_flight=0)
    assert spec.match(idle, second.hashes(), ends2, 0) == 0 and not spec.entries[inst.instance_id]
