"""Workloads: seeded, shaped as documented, and their fast (segment) form equals their text form."""

from __future__ import annotations

import itertools
import random
import statistics

import pytest

from prefixroute.core.keys import render_chat_text
from prefixroute.engine.core import EngineCore
from prefixroute.engine.model import EngineConfig
from prefixroute.engine.server import GENERATION_PROMPT
from prefixroute.engine.tokenizer import decode
from prefixroute.workloads.multi_turn import (
    SHAREGPT_MEAN_INPUT_TOKENS,
    SHAREGPT_MEAN_OUTPUT_TOKENS,
    SHAREGPT_MEAN_TURNS,
    MultiTurnWorkload,
)
from prefixroute.workloads.prompt import PromptChain, Segment
from prefixroute.workloads.shared_prefix import SharedPrefixWorkload, text_of_length


def take(it, n):
    return list(itertools.islice(it, n))


def test_text_of_length_is_exact() -> None:
    rng = random.Random(0)
    for n in list(range(0, 40)) + [999, 4096]:
        assert len(text_of_length(rng, n)) == max(0, n)


def test_shared_prefix_is_seeded() -> None:
    a = SharedPrefixWorkload(groups=5, prefix_tokens=200, seed=3)
    b = SharedPrefixWorkload(groups=5, prefix_tokens=200, seed=3)
    c = SharedPrefixWorkload(groups=5, prefix_tokens=200, seed=4)
    ra, rb, rc = (take(w.requests(20), 20) for w in (a, b, c))
    assert [r.body for r in ra] == [r.body for r in rb]
    assert [r.body for r in ra] != [r.body for r in rc]
    sa = take(a.sessions(), 20)
    assert [s.start_s for s in sa] == [s.start_s for s in take(b.sessions(), 20)]
    assert [s.group for s in sa] == [r.group for r in ra]  # the same requests in both forms
    assert [s.body(0, []) for s in sa] == [r.body for r in ra]


def test_shared_prefix_poisson_rate_and_zipf_popularity() -> None:
    wl = SharedPrefixWorkload(groups=20, prefix_tokens=100, arrival_rate=8.0, popularity="zipf", zipf_s=1.2)
    sessions = take(wl.sessions(), 4000)
    assert sessions[-1].start_s / len(sessions) == pytest.approx(1 / 8.0, rel=0.06)
    counts = [sum(1 for s in sessions if s.group == g) for g in range(20)]
    assert counts[0] > counts[1] > counts[5] > counts[19]
    assert counts[0] / counts[9] == pytest.approx(10 ** 1.2, rel=0.35)


def test_prompts_per_group_replaces_documents() -> None:
    wl = SharedPrefixWorkload(groups=2, prefix_tokens=100, prompts_per_group=3, popularity="uniform")
    sessions = take(wl.sessions(), 60)
    for g in (0, 1):
        docs = [s.doc for s in sessions if s.group == g]
        assert all(docs.count(d) == 3 for d in set(docs[: len(docs) // 3 * 3]))
        assert len(set(docs)) >= len(docs) // 3


def test_shared_prefix_segments_have_the_texts_lengths() -> None:
    wl = SharedPrefixWorkload(groups=3, prefix_tokens=300, question_tokens=25)
    for s in take(wl.sessions(), 12):
        text = render_chat_text(s.body(0, [])) + GENERATION_PROMPT
        assert s.turn(0).prompt.chain.chars == len(text)


def test_multi_turn_lengths_follow_sharegpt_means() -> None:
    wl = MultiTurnWorkload(max_turns=50, max_context_tokens=10**6, max_message_tokens=10**5)
    convs = [wl.conversation(i) for i in range(3000)]
    assert statistics.mean(c.num_turns for c in convs) == pytest.approx(SHAREGPT_MEAN_TURNS, rel=0.06)
    users = [u for c in convs for u in c.user_tokens]
    outs = [o for c in convs for o in c.output_tokens]
    assert statistics.mean(users) == pytest.approx(SHAREGPT_MEAN_INPUT_TOKENS, rel=0.1)
    assert statistics.mean(outs) == pytest.approx(SHAREGPT_MEAN_OUTPUT_TOKENS, rel=0.1)
    assert statistics.median(outs) < statistics.mean(outs)  # the long right tail


def test_multi_turn_prompts_grow_by_the_answer_and_the_next_message() -> None:
    wl = MultiTurnWorkload(system_tokens=50, mean_turns=6, seed=1)
    conv = next(c for c in (wl.conversation(i) for i in range(50)) if c.num_turns >= 3)
    answers = [" the" * conv.output_tokens[k] for k in range(conv.num_turns)]
    texts = [render_chat_text(conv.body(k, answers)) + GENERATION_PROMPT for k in range(conv.num_turns)]
    for k in range(conv.num_turns - 1):
        # each turn's prompt is the previous prompt, its answer, then the new message
        assert texts[k + 1].startswith(texts[k] + answers[k])
        assert len(texts[k]) % 4 == 0  # token-aligned, so the answer's KV blocks are reused
        hk = conv.turn(k).prompt.engine_prompt(16).block_hashes
        hn = conv.turn(k + 1).prompt.engine_prompt(16).block_hashes
        shared = (len(texts[k]) + len(answers[k])) // 64
        assert hn[:shared] == hk[:shared] and len(hk) >= shared
        assert conv.turn(k).prompt.chain.chars == len(texts[k])


def test_many_conversations_share_one_system_prompt() -> None:
    wl = MultiTurnWorkload(system_prompts=1, system_tokens=400)
    firsts = [wl.conversation(i).turn(0).prompt.engine_prompt(16).block_hashes for i in range(5)]
    common = (len("<|system|>\n") + 400 * 4) // 64
    assert all(f[:common] == firsts[0][:common] for f in firsts)
    assert len({tuple(f[common + 1:]) for f in firsts}) == 5


def _run_one(core: EngineCore, rid: str, prompt, max_tokens: int):
    core.add_request(rid, prompt, max_tokens)
    tokens, last = [], None
    while core.has_work():
        for o in core.step().outputs:
            tokens.extend(o.new_token_ids)
            last = o if o.finished else last
    return last, tokens


def test_segment_form_hits_the_cache_exactly_as_the_text_form() -> None:
    wl = MultiTurnWorkload(system_tokens=120, mean_turns=5, seed=4)
    for c in range(4):
        conv = wl.conversation(c)
        text_core, fast_core = EngineCore(EngineConfig()), EngineCore(EngineConfig())
        answers: list[str] = []
        for k in range(conv.num_turns):
            t, f = conv.turn(k, answers), conv.turn(k)
            assert t.prompt.num_tokens == f.prompt.num_tokens
            rt, tokens = _run_one(text_core, f"t{k}", t.prompt.engine_prompt(16), t.output_tokens)
            rf, _ = _run_one(fast_core, f"f{k}", f.prompt.engine_prompt(16), f.output_tokens)
            assert rt.cached_tokens == rf.cached_tokens
            answers.append(decode(tokens))
        assert text_core.cache.num_cached_blocks == fast_core.cache.num_cached_blocks


def test_routing_keys_are_equal_exactly_when_the_first_n_characters_are() -> None:
    rng = random.Random(7)
    # each content's text starts with its own letter, so a text parses into segments one way
    vocab = {c: chr(65 + c) + "".join(rng.choice("xyz") for _ in range(rng.randint(0, 70))) for c in range(4)}

    def chain_and_text(ids: list[int]) -> tuple[PromptChain, str]:
        return PromptChain.of(*(Segment(c + 1, len(vocab[c])) for c in ids)), "".join(vocab[c] for c in ids)

    prompts = [chain_and_text([rng.randrange(4) for _ in range(rng.randint(1, 5))]) for _ in range(60)]
    prompts += [chain_and_text([0, 1, 2]), chain_and_text([0, 1, 3]), chain_and_text([0, 1])]
    for (a, ta), (b, tb) in itertools.combinations(prompts, 2):
        for n in (1, 5, 40, 100, 200, 1000):
            assert (a.routing_key(n, "m") == b.routing_key(n, "m")) == (ta[:n] == tb[:n]), (ta, tb, n)


def test_routing_key_ignores_what_follows_the_prefix_and_includes_model_and_tenant() -> None:
    head = PromptChain.of(Segment(1, 3000))
    a, b = head.extend(Segment(2, 50)), head.extend(Segment(3, 50))
    assert a.routing_key(2048, "m") == b.routing_key(2048, "m")
    assert a.routing_key(3001, "m") != b.routing_key(3001, "m")
    assert a.routing_key(2048, "m") != a.routing_key(2048, "other")
    assert a.routing_key(2048, "m", "t1") != a.routing_key(2048, "m", "t2")
    assert PromptChain.of(Segment(1, 2048)).routing_key(2048, "m") == a.routing_key(2048, "m")
