"""Precise mode matching by bytes: token ids rendered back to text (core/token_bytes.py),
the fleet's held blocks by their bytes (core/kvevents/byte_index.py), a request matched
without tokenizing it (RequestKeyer.match_bytes), and what is about to be held kept by
the routing chain (precise_policy.Speculative)."""

from __future__ import annotations

import random
from itertools import count

import pytest
from hypothesis import given, settings, strategies as st

from prefixroute.core.keys import text_block_hashes
from prefixroute.core.kvevents.events import BlockRemoved, BlockStored
from prefixroute.core.kvevents.view import PreciseCacheView
from prefixroute.core.model_tokenizer import ModelTokenizer
from prefixroute.core.precise_keys import RequestKeyer
from prefixroute.core.precise_policy import SPECULATIVE_MIN_UNITS, Speculative
from prefixroute.core.strategies import InstanceState
from prefixroute.core.token_bytes import TokenBytes

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
        view.add_instance(i).on_connected(complete=True)
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


def test_a_normalizing_tokenizer_matches_text_in_either_form():
    # A tokenizer with an NFC normalizer (as Qwen's) renders the normalized text: requests
    # are normalized the same way, so a document sent decomposed (NFD) matches what the
    # engine holds, whichever form each request uses.
    import json
    import unicodedata

    from tokenizers import Tokenizer

    spec = json.loads(TOK.tokenizer.to_str())
    spec["normalizer"] = {"type": "NFC"}
    nfc = ModelTokenizer("nfc", Tokenizer.from_str(json.dumps(spec)), TOK.chat_template, TOK.bos_token,
                         TOK.eos_token)
    tb = TokenBytes.build(nfc)
    assert tb is not None and tb.normalize is not None
    view = PreciseCacheView(BS)
    view.use_token_bytes(tb)
    view.add_instance("a").on_connected(complete=True)
    doc = unicodedata.normalize("NFD", "Café déjà vu, naïve Åsa " * 40)
    body = chat(doc, "first?")
    ids = nfc.request_token_ids(body, True)
    store(view, "a", ids)
    keyer = RequestKeyer(nfc, BS)
    keyer.token_bytes = tb
    for form in ("NFD", "NFC"):
        got, _ = keyer.match_bytes(chat(unicodedata.normalize(form, doc), "second?"), True, view)
        assert len(got) >= len(ids) // BS - 2, form


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
    assert (bx._by_bytes, bx._lengths, bx._pending) == ({}, {}, {})  # nothing left behind


def test_a_block_is_rendered_only_when_a_walk_reaches_its_parent():
    """Ingest keeps a new block's ids; the first walk through its parent renders the
    parent's children (all of them: the walk must know their byte lengths), and a branch
    no prompt enters is never rendered, and is forgotten cleanly."""
    view = view_with("a")
    bx = view.byte_index
    assert bx is not None
    doc = TOK.encode("the document everyone asks about. " * 12, add_special_tokens=False)
    doc = doc[: len(doc) // BS * BS]
    q1 = TOK.encode(" first question, asked at some length so it fills blocks " * 3, add_special_tokens=False)
    q2 = TOK.encode(" second question, never asked again but just as long " * 3, add_special_tokens=False)
    store(view, "a", doc + q1)
    hashes_2 = store(view, "a", doc + q2)  # (the engine's hashes differ per store; the keys agree)
    d, n1, n2 = len(doc) // BS, len(doc + q1) // BS - len(doc) // BS, len(doc + q2) // BS - len(doc) // BS
    assert len(bx) == d + n1 + n2 and bx.tokens_indexed == 0  # held, nothing rendered yet
    keys, ends = view.match_bytes(TB.render(doc + q1))  # type: ignore[misc]
    assert len(keys) == d + n1 and ends[-1] == len(TB.render((doc + q1)[: (d + n1) * BS]))
    assert bx.tokens_indexed == (d + n1 + 1) * BS  # the doc, q1, and q2's first block (a child of the doc's last)
    view.stream("a").index.apply([BlockRemoved(hashes_2[d:])])  # type: ignore[union-attr]
    assert len(bx) == d + n1 and bx._pending == {}
    assert len(view.match_bytes(TB.render(doc + q2))[0]) == d  # type: ignore[index]


def test_many_children_of_one_block_are_rendered_at_ingest_not_by_one_walk():
    """200 conversations behind one system prompt: never RENDER_AT or more wait under one
    block (the first walk through it would render them all on one request), and every
    conversation is still found whole."""
    from prefixroute.core.kvevents.byte_index import RENDER_AT

    view = view_with("a")
    bx = view.byte_index
    assert bx is not None
    system = TOK.encode("You are the assistant of a company; follow these rules. " * 6, add_special_tokens=False)
    system = system[: len(system) // BS * BS]
    convs = [TOK.encode(f" conversation {c}: tell me about item {c * 7} in detail, please. " * 2,
                        add_special_tokens=False) for c in range(200)]
    for conv in convs:
        store(view, "a", system + conv)
    assert max(map(len, bx._pending.values())) < RENDER_AT
    assert bx.tokens_indexed >= (200 // RENDER_AT) * RENDER_AT * BS  # rendered at ingest, RENDER_AT at a time
    for c in (0, 77, 199):
        ids = system + convs[c]
        keys, _ = view.match_bytes(TB.render(ids))  # type: ignore[misc]
        assert len(keys) == len(ids) // BS


def test_blocks_with_a_media_hash_are_not_indexed_but_an_adapters_name_is_no_obstacle():
    view = view_with("a")
    ids = TOK.encode("an image and its question " * 20, add_special_tokens=False)
    n = len(ids) // BS
    store(view, "a", ids, extra_keys=[["mm-hash-1"]] + [None] * (n - 1))
    assert len(view.byte_index) == n and view.match_bytes(TB.render(ids)) == ([], [])  # type: ignore[arg-type]
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
    # A little less, within a rounding: kept (and it still counts up to what was sent).
    assert spec.match(inst, second.hashes(), ends2, shared_units - 30, 64) == shared_units
    assert spec.match(inst, second.hashes(), ends2, 100) == 0  # and later less of it: evicted, dropped
    assert spec.entries[inst.instance_id] == {}
    spec.routed(inst.instance_id, first.hashes(), ends1)
    short = text_block_hashes(doc[:500] + "other", 64, 131_072, "m")
    assert spec.match(inst, short.hashes(), [e >> short.unit_shift for e in short.ends], 0) == 0  # too little shared
    idle = InstanceState("http://a", in_flight=0)
    assert spec.match(idle, second.hashes(), ends2, 0) == 0 and not spec.entries[inst.instance_id]


# -- holders counted on every path ---------------------------------------------------

_h = count(10_000)


def _view(*instances: str, shared_max: int = 10_000_000, tb=TB) -> PreciseCacheView:
    view = PreciseCacheView(BS, shared_tier_max_blocks=shared_max)
    if tb is not None:
        view.use_token_bytes(tb)
    for i in instances:
        view.add_instance(i).on_connected(complete=True)
    return view


def _store(view, inst, ids, medium="GPU", extra_keys=None, parent=None):
    n = len(ids) // BS
    hs = [next(_h) for _ in range(n)]
    view.stream(inst).index.apply([BlockStored(hs, parent, ids[: n * BS], BS, medium=medium, extra_keys=extra_keys)])
    return hs


def _doc_ids(blocks: int) -> list[int]:
    ids = TOK.encode("a shared system prompt, long enough " * 60, add_special_tokens=False)
    assert len(ids) >= blocks * BS
    return ids[: blocks * BS]


def _id_of() -> dict[bytes, int]:
    out: dict[bytes, int] = {}
    for i, b in enumerate(TB.table):
        if b is not None and b not in out:
            out[b] = i
    return out


def _two_byte_tokens(k: int) -> list[bytes]:
    ids = _id_of()
    two = [b for b in ids if len(b) == 2 and all(bytes([c]) in ids for c in b) and b.isalpha()]
    assert len(two) >= k
    return two[:k]


def test_prefix_blocks_stored_with_an_image_block_in_one_event_keep_other_holders_visible():
    # a: system prompt (4 blocks) + an image block in one BlockStored (vLLM: one event per
    # request step): a's 4 plain blocks are counted (and indexed), so a's removal leaves
    # b's holding visible.
    view = _view("a", "b")
    p = _doc_ids(4)
    _store(view, "b", p)  # b: text-only request with the same system prompt
    image = p[:BS]  # any 16 ids for the media block
    ha = _store(view, "a", p + image, extra_keys=[None] * 4 + [["mm-hash-1"]])
    view.stream("a").index.apply([BlockRemoved(ha)])  # a evicts it all
    got, _ = view.match_bytes(TB.render(p))
    assert len(got) == 4  # b still holds all 4


def test_blocks_held_before_the_index_exists_do_not_break_other_holders():
    # use_token_bytes on a populated view (a reload that turns matching by bytes on):
    # what was held is counted, so its removal does not hide another holder's blocks.
    view = _view("a", "b", tb=None)
    p = _doc_ids(4)
    ha = _store(view, "a", p)
    view.use_token_bytes(TB)
    _store(view, "b", p)
    view.stream("a").index.apply([BlockRemoved(ha)])
    got, _ = view.match_bytes(TB.render(p))
    assert len(got) == 4  # b holds them


def test_a_reload_with_a_new_table_keeps_what_is_held():
    view = _view("a")
    p = _doc_ids(4)
    _store(view, "a", p)
    view.use_token_bytes(TokenBytes.build(TOK))  # what a reload of ChatTemplate/TokenizerCachePieces does
    got, _ = view.match_bytes(TB.render(p))
    assert len(got) == 4


def test_two_keys_with_the_same_bytes_under_one_parent():
    # Same parent, same bytes, different token ids (a non-canonical split, e.g. sampled
    # output): both kept; removing one leaves the other findable.
    ids = _id_of()
    t1, t2 = _two_byte_tokens(2)
    fill = _doc_ids(1)[:13]
    x = [ids[t1], ids[t2[:1]], ids[t2[1:]]] + fill  # "ab" "c" "d" ...
    y = [ids[t1[:1]], ids[t1[1:]], ids[t2]] + fill  # "a" "b" "cd" ...
    assert TB.render(x) == TB.render(y) and x != y
    view = _view("a", "b")
    _store(view, "a", x)
    hb = _store(view, "b", y)
    view.stream("b").index.apply([BlockRemoved(hb)])
    got, _ = view.match_bytes(TB.render(x))
    assert len(got) == 1  # a still holds x


def test_where_a_held_chain_forks_inside_the_prompt_the_deeper_branch_is_kept():
    # Root children C1 = F + "a" (a leaf, on a) and C2 = F + "ab" (then 10 more blocks, on b):
    # both follow in the prompt; the walk follows both and keeps the deeper chain.
    ids = _id_of()
    t1 = _two_byte_tokens(1)[0]
    fill = _doc_ids(12)
    c1 = fill[:15] + [ids[t1[:1]]]
    c2 = fill[:15] + [ids[t1]]
    view = _view("a", "b")
    _store(view, "a", c1)
    _store(view, "b", c2 + fill[16:16 + 10 * BS])
    got, _ = view.match_bytes(TB.render(c2 + fill[16:16 + 10 * BS]))
    assert len(got) == 11


def test_shared_tier_eviction_inside_one_event_leaves_nothing_behind():
    # SharedIndex.add evicts blocks added earlier in the same event (SharedTierMaxBlocks
    # smaller than the event): the index holds what the tier holds, and nothing after.
    view = _view("a", shared_max=2)
    p = _doc_ids(4)
    hs = _store(view, "a", p, medium="SHARED")
    assert len(view.shared) == 2
    assert len(view.byte_index) == len(view.shared)
    view.stream("a").index.apply([BlockRemoved(hs, medium="SHARED")])
    assert len(view.byte_index) == 0


# -- walks resumed from an earlier walk's checkpoints ----------------------------------

_LONG_DOCS = [" ".join(random.Random(100 + d).choice(WORDS) for _ in range(900 + 300 * d)) for d in range(3)]


def _fresh_walk(view: PreciseCacheView, data: bytes) -> tuple[list[int], list[int]]:
    """The walk from the root, no checkpoint used (what a walk resumed must equal)."""
    from prefixroute.core.kvevents.chain import chain_root

    return view.byte_index.walk(data, chain_root(None), resume=False)  # type: ignore[union-attr]


def test_a_held_document_walked_again_resumes_from_a_checkpoint_with_the_same_keys():
    from prefixroute.core.kvevents.byte_index import WALK_CHECKPOINT_BYTES

    view = view_with("a", "b")
    doc = _LONG_DOCS[2]
    assert len(doc.encode()) > 4 * WALK_CHECKPOINT_BYTES
    store(view, "a", TOK.encode(doc + " question 1?", add_special_tokens=False))
    bx = view.byte_index
    assert bx is not None
    first = view.match_bytes((doc + " question 2?").encode())
    assert bx.walks_resumed == 0 and first is not None and len(first[0]) > 60
    second = view.match_bytes((doc + " question 3?").encode())
    assert bx.walks_resumed == 1
    assert second == first == _fresh_walk(view, (doc + " question 3?").encode())
    # Blocks stored after the checkpoint was taken are found beyond it.
    store(view, "b", TOK.encode(doc + " question 3? and a long answer to it " * 40, add_special_tokens=False))
    text = (doc + " question 3? and a long answer to it " * 40 + " next").encode()
    got = view.match_bytes(text)
    assert got == _fresh_walk(view, text) and len(got[0]) > len(first[0]) + 20  # type: ignore[index]
    assert bx.walks_resumed == 2


def test_a_short_prompt_resumes_from_the_checkpoints_of_its_first_kb_and_shares_the_path():
    from prefixroute.core.kvevents.byte_index import WALK_CHECKPOINT_BYTES, WALK_FIRST_CHECKPOINT_BYTES, KeyRun

    view = view_with("a")
    system = " ".join(random.Random(3).choices(WORDS[:6], k=400))[:600]
    # the whole prompt under 1 KB (no checkpoint there before the first KB had its own), past 512 bytes
    assert 2 * WALK_FIRST_CHECKPOINT_BYTES < len(system.encode()) < len((system + " question 2?").encode()) \
        < WALK_CHECKPOINT_BYTES
    store(view, "a", TOK.encode(system + " question 1?", add_special_tokens=False))
    bx = view.byte_index
    assert bx is not None
    first = view.match_bytes((system + " question 2?").encode())
    second = view.match_bytes((system + " question 3?").encode())
    assert first is not None and second is not None and bx.walks_resumed == 1
    assert second == first == _fresh_walk(view, (system + " question 3?").encode())
    keys, ends = second
    assert isinstance(keys, KeyRun) and keys.shared > 0  # the checkpoint's path, not copied
    assert ends[keys.shared - 1] <= len(system.encode()) // WALK_FIRST_CHECKPOINT_BYTES * WALK_FIRST_CHECKPOINT_BYTES


def test_a_key_run_reads_as_one_sequence():
    from prefixroute.core.kvevents.byte_index import KeyRun

    run = KeyRun((1, 2, 3, 4), 2, [7, 8])
    assert len(run) == 4 and list(run) == [1, 2, 7, 8] and run == [1, 2, 7, 8] and run == (1, 2, 7, 8)
    assert run[0] == 1 and run[2] == 7 and run[-1] == 8 and run[-4] == 1 and run[1:3] == [2, 7]
    assert run != [1, 2, 3, 4] and KeyRun((), 0, []) == [] and not KeyRun((5,), 0, [])
    assert run.count(7) == 1 and run.index(7) == 2 and 8 in run  # (Sequence's methods)
    with pytest.raises(IndexError):
        run[4]
    with pytest.raises(IndexError):
        run[-5]


def test_a_checkpoint_whose_last_block_is_gone_everywhere_is_not_used():
    view = view_with("a")
    doc = _LONG_DOCS[1]
    ids = TOK.encode(doc, add_special_tokens=False)
    hashes = store(view, "a", ids)
    data = (doc + " what?").encode()
    full = view.match_bytes(data)
    assert full is not None and len(full[0]) == len(hashes)
    # The engine evicts the chain's second half (tail first, as vLLM does).
    half = len(hashes) // 2
    view.stream("a").index.apply([BlockRemoved(hashes[half:])])  # type: ignore[union-attr]
    bx = view.byte_index
    resumed = bx.walks_resumed  # type: ignore[union-attr]
    again = view.match_bytes(data)
    assert again == _fresh_walk(view, data) and again is not None and len(again[0]) == half
    assert bx.walks_resumed == resumed + 1  # (from a checkpoint within the first half)
    view.stream("a").index.apply([BlockRemoved(hashes[:half])])  # type: ignore[union-attr]
    assert view.match_bytes(data) == ([], [])


def _first_blocks_two_ways() -> tuple[list[int], list[int]]:
    """One block's worth of text tokenized two ways (same bytes, other token ids)."""
    ids = _id_of()
    t1, t2 = _two_byte_tokens(2)
    fill = _doc_ids(1)[:13]
    x = [ids[t1], ids[t2[:1]], ids[t2[1:]]] + fill
    y = [ids[t1[:1]], ids[t1[1:]], ids[t2]] + fill
    assert TB.render(x) == TB.render(y) and x != y
    return x, y


def _ids(text: str) -> list[int]:
    ids = TOK.encode(text, add_special_tokens=False)
    return ids[: len(ids) // BS * BS]


def test_a_block_gone_everywhere_in_the_middle_of_a_walked_path_ends_the_resumed_walk_there():
    # leading_holdings (what the policy reads) bisects: a resumed walk must stop where a
    # walk from the root stops, not count the blocks after a gap.
    from prefixroute.core.precise_policy import leading_holdings

    view = view_with("a")
    doc = _ids(_LONG_DOCS[2])
    hashes = store(view, "a", doc)
    data = TB.render(doc) + b" next question?"  # type: ignore[operator]
    view.match_bytes(data)
    view.stream("a").index.apply([BlockRemoved(hashes[5:6])])  # type: ignore[union-attr]
    got = view.match_bytes(data)
    assert got == _fresh_walk(view, data) and got is not None and len(got[0]) == 5
    a = [InstanceState("a")]
    assert leading_holdings(view, got[0], a)["a"].gpu_tokens == 5 * BS


@pytest.mark.parametrize("few", [0, 10**9])  # (parents with several children looked up in the path, or the other way)
@pytest.mark.parametrize("case", ["fork-before", "fork-then-tail-evicted", "other-tokenization-stored-after",
                                  "fork-inside"])
def test_where_the_held_chain_forks_a_resumed_walk_follows_the_branch_a_walk_from_the_root_follows(
        case, few, monkeypatch):
    from prefixroute.core.kvevents import byte_index

    monkeypatch.setattr(byte_index, "_MULTI_LOOKUP_COST", few)
    x, y = _first_blocks_two_ways()
    doc = _ids(_LONG_DOCS[2])
    view = view_with("a", "b")
    if case == "fork-before":  # a: x + D + X, b: y + D + Y; walk D + X, then D + Y
        tail_x, tail_y = _ids(" and then the X part goes on " * 40), _ids(" but the Y part is different " * 40)
        store(view, "a", x + doc + tail_x)
        store(view, "b", y + doc + tail_y)
        view.match_bytes(TB.render(x + doc + tail_x))  # type: ignore[arg-type]
        data = TB.render(y + doc + tail_y)
    elif case == "fork-then-tail-evicted":  # a keeps the deeper branch, then evicts its tail; b holds it all
        ha = store(view, "a", x + doc)
        store(view, "b", y + doc[: 10 * BS])
        data = TB.render(x + doc)
        view.match_bytes(data)  # type: ignore[arg-type]
        view.stream("a").index.apply([BlockRemoved(ha[len(ha) // 2:])])  # type: ignore[union-attr]
        store(view, "b", y + doc)
    elif case == "other-tokenization-stored-after":  # no fork when walked; then the same bytes under other ids
        store(view, "a", x + doc[: 40 * BS])
        data = TB.render(x + doc)
        view.match_bytes(data)  # type: ignore[arg-type]
        store(view, "b", y + doc)
    else:  # a fork deep in the walked path: b holds a's first 21 blocks, then the same bytes otherwise
        d1, d2, more = doc[: 20 * BS], doc[20 * BS: 60 * BS], doc[60 * BS:]
        store(view, "a", x + d1 + x + d2)
        data = TB.render(x + d1 + x + d2 + more)
        view.match_bytes(data)  # type: ignore[arg-type]
        store(view, "b", x + d1 + y + d2 + more)
    assert data is not None
    got = view.match_bytes(data)
    assert got == _fresh_walk(view, data)
    assert got is not None and view.holdings(got[0])["b"].total_tokens > 40 * BS


@pytest.mark.parametrize("deep", [False, True])
def test_a_path_evicted_and_stored_again_under_two_tokenizations_before_any_walk_forks_as_from_the_root(deep):
    # Every block of the walked path forgotten, then stored again (waiting to be
    # rendered) twice over, under either tokenization of the same bytes: the parent has
    # no child indexed and two waiting, a fork the walk from the root takes.
    x, y = _first_blocks_two_ways()
    doc = _ids(_LONG_DOCS[2])
    more = _ids(" and a long sampled answer that goes on " * 10)
    view = view_with("a", "b")
    if deep:
        d1, d2 = doc[: 20 * BS], doc[20 * BS:]
        ha = store(view, "a", x + d1 + x + d2)
        data = TB.render(x + d1 + x + d2 + more)
        view.match_bytes(data)  # type: ignore[arg-type]
        view.stream("a").index.apply([BlockRemoved(ha[21:])])  # type: ignore[union-attr]
        store(view, "b", x + d1 + x + d2)
        store(view, "b", x + d1 + y + d2 + more)
    else:
        ha = store(view, "a", x + doc)
        data = TB.render(x + doc + more)
        view.match_bytes(data)  # type: ignore[arg-type]
        view.stream("a").index.apply([BlockRemoved(ha)])  # type: ignore[union-attr]
        store(view, "b", x + doc)
        store(view, "b", y + doc + more)
    assert data is not None
    got = view.match_bytes(data)
    assert got == _fresh_walk(view, data) and got is not None and len(got[0]) > len(ha)


def test_a_path_block_held_again_without_its_tokens_is_not_walked_through():
    view = view_with("a")
    doc = _ids(_LONG_DOCS[1])
    hashes = store(view, "a", doc)
    data = TB.render(doc) + b" next?"  # type: ignore[operator]
    keys = view.match_bytes(data)[0]  # type: ignore[index]
    bx = view.byte_index
    assert bx is not None and len(keys) == len(hashes)
    parents = {k: bx._info[k][2] for k in keys}
    view.stream("a").index.apply([BlockRemoved(hashes)])  # type: ignore[union-attr]
    for k in keys:  # held again by a holder whose events carry no token ids
        bx.ref(k, parents[k])
    assert view.match_bytes(data) == _fresh_walk(view, data) == ([], [])


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["store", "store-other", "evict", "walk"]), st.integers(0, 2),
                          st.integers(0, 3), st.integers(0, 1), st.integers(0, 80), st.integers(1, 40)),
                min_size=1, max_size=16))
def test_walks_with_checkpoints_give_what_walks_from_the_root_give(ops):
    # Whatever was stored (under either tokenization of the first block), evicted (any run
    # of a chain, the middle too) and walked before, a walk gives the keys a walk from the
    # root gives, and so the same holdings to the policy.
    from prefixroute.core.precise_policy import leading_holdings

    x, y = _first_blocks_two_ways()
    view = view_with("a", "b")
    chains: dict[tuple[int, int, int], list[int]] = {}
    candidates = [InstanceState("a"), InstanceState("b")]
    for op, d, q, inst, start, length in ops:
        text = _LONG_DOCS[d] + f" question {q}?"
        name = "ab"[inst]
        if op in ("store", "store-other"):
            chains[(d, q, inst)] = store(view, name, (x if op == "store" else y) + _ids(text))
        elif op == "evict" and (d, q, inst) in chains:
            hs = chains[(d, q, inst)]
            gone = hs[start:start + length]
            if gone:
                view.stream(name).index.apply([BlockRemoved(gone)])  # type: ignore[union-attr]
                chains[(d, q, inst)] = [h for h in hs if h not in gone]
        data = TB.render(x + _ids(text))
        assert data is not None
        got = view.match_bytes(data)
        want = _fresh_walk(view, data)
        assert got == want
        assert leading_holdings(view, got[0], candidates) == leading_holdings(view, want[0], candidates)  # type: ignore[index]
