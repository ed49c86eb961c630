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
from prefixroute.core.precise_keys import _PROBE, RequestKeyer, TokenizeLater
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


class _Counting:
    """A tokenizer that counts the characters it was asked to tokenize."""

    def __init__(self, tok: ModelTokenizer) -> None:
        self.tok, self.chars = tok, 0

    def __getattr__(self, name):
        return getattr(self.tok, name)

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        self.chars += len(text)
        return self.tok.encode(text, add_special_tokens=add_special_tokens)


_PROBE_CHARS = _PROBE + "box yes"
_WORDS = ["route", "cache,", "token.", "é", "12345", "naïve", "(x)", "it's", "日本語", "\n", "a  b", "\t"]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.sampled_from(_WORDS) | st.text(max_size=6), min_size=0, max_size=120),
       st.sampled_from([1, 2, 5, 40]))
def test_long_pieces_cut_in_chunks_key_as_their_whole_token_ids(words, chunk):
    keyer = RequestKeyer(TOK, 16, chunk_chars=chunk)
    assert keyer.chunk_chars == chunk  # the tiny tokenizer starts a word at such a cut
    text = " ".join(words)
    for body, chat in (({"messages": [{"role": "system", "content": text}]}, True), ({"prompt": text}, False)):
        assert keyer.keys(body, chat) == whole(body, chat)
        assert keyer.keys(body, chat) == whole(body, chat)


def test_a_new_question_after_a_known_document_tokenizes_one_chunk():
    counting = _Counting(TOK)
    keyer = RequestKeyer(counting, 16)  # type: ignore[arg-type]
    rng = random.Random(2)
    doc = " ".join(rng.choice(["alpha", "beta,", "gamma.", "delta", "words\n", "12345"]) for _ in range(5000))
    assert len(doc) > 30_000
    for i in range(3):
        before = counting.chars
        body = {"prompt": doc + f" Question {i}: what does it say?"}  # one piece: no special token in it
        assert keyer.keys(body, False) == whole(body, False)
        tokenized = counting.chars - before
        if i == 0:
            assert tokenized >= len(doc)
        else:  # the chunk holding the end of the document, and the question
            assert tokenized < 2 * keyer.chunk_chars + 40, tokenized


def test_much_uncached_text_is_handed_back_to_tokenize_off_the_request_path():
    keyer = RequestKeyer(TOK, 16)
    rng = random.Random(3)
    doc = "The router " + " ".join(rng.choice(["keys", "every", "block.", "of", "the", "document,"]) for _ in range(3000))
    body = {"messages": [{"role": "system", "content": doc}, {"role": "user", "content": "Question 1?"}]}
    with pytest.raises(TokenizeLater) as later:
        keyer.keys(body, True, inline_chars=8192)
    pieces = later.value.pieces
    assert later.value.chars > len(doc) and len(pieces) > 10 and len(set(pieces)) == len(pieces)
    assert any(doc[:50] in p for p in pieces) and any(doc[-50:] in p for p in pieces)
    assert keyer.deferred == 1 and keyer.stats()["deferred"] == 1
    keyer.learn(pieces, keyer.tokenize_pieces(pieces))
    assert keyer.keys(body, True, inline_chars=8192) == whole(body, True)
    follow_up = {"messages": [{"role": "system", "content": doc}, {"role": "user", "content": "Question 2, longer?"}]}
    assert keyer.keys(follow_up, True, inline_chars=100) == whole(follow_up, True)  # only the question is new
    assert keyer.deferred == 1
    assert keyer.keys(body, True, inline_chars=None) == whole(body, True)
    fresh = RequestKeyer(TOK, 16)
    assert fresh.keys(body, True) == whole(body, True)  # no limit: tokenized on the spot


def test_a_tokenizer_that_joins_words_across_a_space_is_not_chunked():
    from tokenizers import AddedToken, Tokenizer, models

    chars = sorted(set(_PROBE_CHARS))
    vocab = {c: i for i, c in enumerate(chars)}
    vocab["x "] = len(vocab)  # a token across the space before a word: a cut there splits it
    tok = Tokenizer(models.BPE(vocab, [("x", " ")]))
    tok.add_special_tokens([AddedToken("<|eot_id|>", special=True, normalized=False)])
    model = ModelTokenizer("joins", tok, "", "", "", ())
    keyer = RequestKeyer(model, 4)
    assert keyer._split is not None and keyer.chunk_chars == 0
    text = "box yes " * 300
    assert keyer.keys({"prompt": text}, False)[0] == block_keys(model.encode(text), 4, chain_root(None))


def test_a_piece_that_cannot_be_cut_is_tokenized_on_the_spot_not_deferred():
    # Japanese text has no space to cut at: the document and each question form one piece,
    # new with every question. Deferring it would route every such request on the learned
    # view and tokenize it for nothing: the chunk that ends a piece is not counted.
    keyer = RequestKeyer(TOK, 16)
    doc = "日本語のテキストで、空白のない長い文書です。" * 420
    assert len(doc) > 9000
    for q in ("質問一", "質問二", "質問三"):
        body = {"messages": [{"role": "user", "content": doc + q}]}
        assert keyer.keys(body, True, inline_chars=8192) == whole(body, True)
    assert keyer.deferred == 0


def test_a_request_with_more_new_pieces_than_the_cache_learns_is_keyed_on_the_spot():
    keyer = RequestKeyer(TOK, 16, cache_pieces=64)
    rng = random.Random(5)
    body = {"messages": [{"role": "system", "content": " ".join(rng.choice(_WORDS[:6]) for _ in range(15_000))},
                         {"role": "user", "content": "Question?"}]}
    assert keyer.keys(body, True, inline_chars=8192) == whole(body, True)  # 60+ chunks: learning would evict them
    assert keyer.deferred == 0


def test_a_request_whose_keys_are_cached_is_not_deferred_when_its_token_ids_were_forgotten():
    keyer = RequestKeyer(TOK, 16)
    rng = random.Random(6)
    doc = " ".join(rng.choice(["cache", "route", "token", "block"]) + str(rng.randrange(100)) for _ in range(3000))
    body = {"messages": [{"role": "system", "content": doc}, {"role": "user", "content": "Q?"}]}
    assert keyer.keys(body, True) == whole(body, True)
    others = [f"other document {i} " + "words " * 30 for i in range(4096)]
    keyer.learn(others, keyer.tokenize_pieces(others))  # pushes the document's ids out of the id cache
    assert keyer.keys(body, True, inline_chars=8192) == whole(body, True)  # its chain keys are still cached
    assert keyer.deferred == 0


def test_a_vocabulary_with_a_token_across_a_space_turns_chunking_off():
    import json

    from tokenizers import Tokenizer

    doc = json.loads(TOK.tokenizer.to_str())
    doc["pre_tokenizer"]["use_regex"] = False  # no pre-tokenizer split: BPE may merge across a space
    model = doc["model"]
    model["vocab"]["dĠo"] = max(model["vocab"].values()) + 1
    model["merges"].insert(0, ["d", "Ġo"] if isinstance(model["merges"][0], list) else "d Ġo")
    joined = dataclasses.replace(TOK, tokenizer=Tokenizer.from_str(json.dumps(doc)))
    keyer = RequestKeyer(joined, 4, chunk_chars=8)
    assert keyer._split is not None and keyer.chunk_chars == 0  # (the probe alone has no "d o")
    body = {"prompt": "word word word and other words " * 20}
    ids = joined.encode(body["prompt"])
    assert keyer.keys(body, False) == (block_keys(ids, 4, chain_root(None)), len(ids))
