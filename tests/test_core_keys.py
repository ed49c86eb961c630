"""Routing keys: what takes part, what does not, and the rendering rule for chat."""

import base64
import re

import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixroute.core.keys import (
    KEY_SEED,
    InvalidRequest,
    completion_prompt,
    native_routing_key,
    openai_block_hashes,
    openai_routing_key,
    render_chat_text,
    text_block_hashes,
    text_routing_key,
    token_routing_key,
    validate_tenant_id,
)

N = 1024


@settings(max_examples=200)
@given(head=st.binary(min_size=N, max_size=N + 64), tail_a=st.binary(max_size=64), tail_b=st.binary(max_size=64))
def test_native_key_ignores_bytes_after_prefix_length(head, tail_a, tail_b):
    prefix = head[:N]
    assert native_routing_key(prefix + tail_a, N, "ep") == native_routing_key(prefix + tail_b, N, "ep")


@settings(max_examples=200)
@given(body=st.binary(min_size=1, max_size=2 * N), pos=st.integers(min_value=0, max_value=N - 1))
def test_native_key_depends_on_every_byte_before_prefix_length(body, pos):
    if pos >= len(body):
        pos = len(body) - 1
    flipped = bytearray(body)
    flipped[pos] ^= 0xFF
    assert native_routing_key(body, N, "ep") != native_routing_key(bytes(flipped), N, "ep")


@settings(max_examples=200)
@given(text=st.text(min_size=N, max_size=N + 50), a=st.text(max_size=30), b=st.text(max_size=30))
def test_text_key_counts_characters_not_bytes(text, a, b):
    prefix = text[:N]
    assert text_routing_key(prefix + a, N, "m") == text_routing_key(prefix + b, N, "m")


def test_short_body_uses_all_of_it():
    assert native_routing_key(b"abc", N, "ep") != native_routing_key(b"abd", N, "ep")
    assert native_routing_key(b"abc", N, "ep") == native_routing_key(b"abc", 2 * N, "ep")


def test_key_is_deterministic_across_processes():
    # A fixed value: the key never depends on PYTHONHASHSEED or the process.
    assert native_routing_key(b'{"inputs": "hello"}', 4096, "default") == native_routing_key(
        b'{"inputs": "hello"}', 4096, "default")
    import subprocess, sys
    code = ("from prefixroute.core.keys import native_routing_key as k;"
            "print(k(b'{\"inputs\": \"hello\"}', 4096, 'default'))")
    out = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={"PYTHONHASHSEED": str(s)}, check=True).stdout.strip() for s in (1, 2)}
    assert out == {str(native_routing_key(b'{"inputs": "hello"}', 4096, "default"))}


def test_scope_model_and_tenant_are_part_of_the_key():
    body = b"x" * 2000
    base = native_routing_key(body, N, "ep")
    assert native_routing_key(body, N, "other") != base
    assert native_routing_key(body, N, "ep", "tenant-a") != base
    assert native_routing_key(body, N, "ep", "tenant-a") != native_routing_key(body, N, "ep", "tenant-b")
    # the separator keeps (scope, tenant) pairs from colliding by concatenation
    assert native_routing_key(body, N, "ab", "c") != native_routing_key(body, N, "a", "bc")


@pytest.mark.parametrize("tenant", ["a", "x" * 64, "tenant 42 ~!", " "])
def test_valid_tenants(tenant):
    assert validate_tenant_id(tenant) == tenant


@pytest.mark.parametrize("tenant, why", [("", "length 0"), ("x" * 65, "length 65"), ("caf\u00e9", "U+00E9"),
                                        ("a\tb", "U+0009"), ("a\x7f", "U+007F")])
def test_invalid_tenants(tenant, why):
    with pytest.raises(InvalidRequest, match=re.escape(why)):
        validate_tenant_id(tenant)


def test_no_tenant_is_empty():
    assert validate_tenant_id(None) == ""


def chat(*messages, **extra):
    return {"model": "m", "messages": [{"role": r, "content": c} for r, c in messages], **extra}


def test_chat_rendering_rule():
    text = render_chat_text(chat(("system", "You are terse."), ("user", "Hi")))
    assert text == "<|system|>\nYou are terse.\n<|user|>\nHi\n"


def test_chat_sampling_fields_do_not_take_part():
    a = chat(("system", "S" * 3000), ("user", "q"), temperature=0.1, max_tokens=5, stream=True)
    b = chat(("system", "S" * 3000), ("user", "q"), temperature=0.9, top_p=0.5)
    assert openai_routing_key(a, True, 2048) == openai_routing_key(b, True, 2048)


def test_chat_history_growth_keeps_prefix():
    turn1 = chat(("system", "sys"), ("user", "first question"))
    turn2 = chat(("system", "sys"), ("user", "first question"), ("assistant", "answer"), ("user", "second"))
    t1, t2 = render_chat_text(turn1), render_chat_text(turn2)
    assert t2.startswith(t1)


def test_chat_prompt_cache_key_is_the_tenant():
    a = chat(("user", "same"))
    b = dict(a, prompt_cache_key="tenant-b")
    assert openai_routing_key(a, True, 1024) != openai_routing_key(b, True, 1024)
    # OpenAI takes any string: long and non-ASCII values are hashed in, not refused
    long_a, long_b = dict(a, prompt_cache_key="x" * 65), dict(a, prompt_cache_key="x" * 64 + "y")
    accented = dict(a, prompt_cache_key="café-tenant")
    keys = {openai_routing_key(p, True, 1024) for p in (a, b, long_a, long_b, accented)}
    assert len(keys) == 5
    assert openai_routing_key(dict(a, prompt_cache_key=""), True, 1024) == openai_routing_key(a, True, 1024)
    with pytest.raises(InvalidRequest, match="'prompt_cache_key' must be a string"):
        openai_routing_key(dict(a, prompt_cache_key=7), True, 1024)


def test_cache_salt_takes_part_in_the_key_and_the_blocks():
    a = chat(("system", "s" * 300), ("user", "same prompt"))
    salted = [dict(a, cache_salt=s) for s in ("salt-1", "salt-2")]
    keys = [openai_routing_key(p, True, 1024) for p in (a, *salted)]
    assert len(set(keys)) == 3
    chains = [openai_block_hashes(p, True, 64, 4096) for p in (a, *salted)]
    assert len({c[0] for c in chains}) == 3  # no block shared, from the first one on
    # a salt is not the same tenant as an equal prompt_cache_key, nor as the SageMaker header
    assert openai_routing_key(dict(a, prompt_cache_key="salt-1"), True, 1024) != keys[1]
    assert openai_routing_key(a, True, 1024, header_tenant="salt-1") != keys[1]
    assert openai_routing_key(a, True, 1024, header_tenant="salt-1") == \
        openai_routing_key(dict(a, prompt_cache_key="salt-1"), True, 1024)  # one tenant field alone keys as itself
    for bad in ("", 5):
        with pytest.raises(InvalidRequest, match="'cache_salt' must be a non-empty string"):
            openai_routing_key(dict(a, cache_salt=bad), True, 1024)


def test_chat_model_is_part_of_the_key():
    a = chat(("user", "same"))
    assert openai_routing_key(a, True, 1024) != openai_routing_key(dict(a, model="other"), True, 1024)


def test_multimodal_parts():
    png = base64.b64encode(b"\x89PNG fake image bytes").decode()
    msg = {"role": "user", "content": [
        {"type": "text", "text": "What is in "},
        {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}},
        {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{png}"}},
    ]}
    text = render_chat_text({"messages": [msg]})
    assert text.startswith("<|user|>\nWhat is in <image:https://example.com/cat.png><image:xxh3-")
    assert png not in text  # inline data is digested, not copied
    same = render_chat_text({"messages": [msg]})
    other = dict(msg, content=msg["content"][:2] + [{"type": "image_url", "image_url": {"url": "data:image/png;base64,QUJD"}}])
    assert text == same
    assert render_chat_text({"messages": [other]}) != text


def test_tools_rendered_first_and_canonically():
    tools_a = [{"type": "function", "function": {"name": "f", "parameters": {"b": 1, "a": 2}}}]
    tools_b = [{"function": {"parameters": {"a": 2, "b": 1}, "name": "f"}, "type": "function"}]
    a = render_chat_text(chat(("user", "q"), tools=tools_a))
    b = render_chat_text(chat(("user", "q"), tools=tools_b))
    assert a == b
    assert a.startswith("<|tools|>\n[{")
    assert a.endswith("<|user|>\nq\n")


def test_tool_calls_and_names():
    msgs = {"messages": [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "1", "type": "function",
                                                               "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "name": "f", "content": "42"},
    ]}
    text = render_chat_text(msgs)
    assert '"name":"f"' in text
    assert "<|tool|>\nname=f\n42\n" in text


@pytest.mark.parametrize("payload, why", [
    ({}, "'messages' must be a list"),
    ({"messages": "hi"}, "'messages' must be a list"),
    ({"messages": ["hi"]}, "each message must be an object"),
    ({"messages": [{"content": "x"}]}, "string 'role'"),
    ({"messages": [{"role": "user", "content": 5}]}, "'content' must be"),
])
def test_malformed_chat(payload, why):
    with pytest.raises(InvalidRequest, match=why):
        render_chat_text(payload)


def test_completion_prompts():
    assert completion_prompt({"prompt": "abc"}) == "abc"
    assert completion_prompt({"prompt": ["abc", "def"]}) == "abc"
    assert completion_prompt({"prompt": [1, 2, 3]}) == [1, 2, 3]
    assert completion_prompt({"prompt": [[4, 5], [6]]}) == [4, 5]
    for bad in ({}, {"prompt": 5}, {"prompt": []}, {"prompt": [1, "a"]}, {"prompt": [True]}):
        with pytest.raises(InvalidRequest):
            completion_prompt(bad)


def test_token_prompt_counts_tokens():
    toks = list(range(3000))
    assert token_routing_key(toks, 1024, "m") == token_routing_key(toks[:1024] + [9, 9], 1024, "m")
    assert token_routing_key(toks, 1024, "m") != token_routing_key(toks[:1023] + [7], 1024, "m")
    key_tokens = openai_routing_key({"model": "m", "prompt": toks}, False, 1024)
    key_text = openai_routing_key({"model": "m", "prompt": "x" * 3000}, False, 1024)
    assert key_tokens != key_text


def test_completion_string_uses_characters():
    a = {"model": "m", "prompt": "é" * 1024 + "tail-a"}
    b = {"model": "m", "prompt": "é" * 1024 + "tail-b"}
    assert openai_routing_key(a, False, 1024) == openai_routing_key(b, False, 1024)


def test_model_must_be_string():
    with pytest.raises(InvalidRequest, match="'model' must be a string"):
        openai_routing_key({"model": 3, "prompt": "x"}, False, 1024)


def test_render_limit_keeps_the_prefix_and_stops_early():
    msgs = {"messages": [{"role": "user", "content": f"message {i} " + "x" * 50} for i in range(10_000)]}
    full = render_chat_text(msgs)
    short = render_chat_text(msgs, limit=1024)
    assert 1024 <= len(short) < 1200
    assert full.startswith(short)
    assert openai_routing_key(dict(msgs, model="m"), True, 1024) == text_routing_key(full, 1024, "m")


def test_render_limit_with_large_tools():
    payload = {"tools": [{"name": "t" * 5000}], "messages": [{"role": "user", "content": "q"}]}
    assert render_chat_text(payload, limit=1024) == render_chat_text(payload)[: len(render_chat_text(payload, 1024))]
    assert render_chat_text(payload, limit=1024).endswith("\n")


# -- the chat key is hashed piece by piece: it must equal the key of the joined text


def _seeded(model: str, tenant: str = "") -> int:
    """The documented seed: xxh3_64(model NUL tenant NUL, seed=KEY_SEED)."""
    return xxhash.xxh3_64_intdigest(model.encode() + b"\0" + tenant.encode() + b"\0", KEY_SEED)


def _long(alphabet: str) -> st.SearchStrategy[str]:
    """4,000-9,000 characters: a short random text repeated (little entropy to draw)."""
    return st.builds(lambda unit, n: (unit * (n // len(unit) + 1))[:n],
                     st.text(alphabet=alphabet, min_size=1, max_size=30), st.integers(4000, 9000))


_piece = st.one_of(st.text(max_size=40), _long("ab\u00e9\u4e2d\ud800"), _long("xyz"))


@settings(max_examples=150, deadline=None)
@given(contents=st.lists(_piece, min_size=1, max_size=5), limit=st.integers(min_value=1, max_value=20_000),
       tenant=st.sampled_from([None, "t-1"]))
def test_chat_key_equals_the_key_of_the_rendered_text(contents, limit, tenant):
    payload = {"model": "m", "messages": [{"role": "user" if i % 2 else "system", "content": c}
                                          for i, c in enumerate(contents)]}
    if tenant:
        payload["prompt_cache_key"] = tenant
    text = render_chat_text(payload)
    want = xxhash.xxh3_64_intdigest(text[:limit].encode("utf-8", "surrogatepass"), _seeded("m", tenant or ""))
    assert openai_routing_key(payload, True, limit) == want
    assert text_routing_key(text, limit, "m", tenant or "") == want


@settings(max_examples=150, deadline=None)
@given(contents=st.lists(_piece, min_size=1, max_size=5), limit=st.integers(min_value=1, max_value=20_000),
       block_size=st.sampled_from([16, 64, 1000]), order=st.randoms(use_true_random=False))
def test_chat_blocks_equal_the_blocks_of_the_rendered_text(contents, limit, block_size, order):
    # Every block of a chat request's chain, read in any order, one by one, all at once
    # or from any block on, is the hash of the rendered text's UTF-8 bytes up to the
    # block's end, cut at MaxPrefixLength characters.
    payload = {"model": "m", "messages": [{"role": "user" if i % 2 else "system", "content": c}
                                          for i, c in enumerate(contents)]}
    data = render_chat_text(payload)[:limit].encode("utf-8", "surrogatepass")
    joined = text_block_hashes(render_chat_text(payload), block_size, limit, "m")
    want = [xxhash.xxh3_64_intdigest(data[:e], _seeded("m")) for e in joined.ends]
    assert joined.hashes() == want
    lazy = openai_block_hashes(payload, True, block_size, limit)
    assert lazy.ends == joined.ends and lazy.ends[-1] == len(data)
    ks = list(range(len(lazy)))
    order.shuffle(ks)
    assert [v for _, v in sorted((k, lazy[k]) for k in ks)] == want
    start = order.randrange(len(want) + 1)
    assert openai_block_hashes(payload, True, block_size, limit).hashes_from(start) == want[start:]
    assert openai_block_hashes(payload, True, block_size, limit).hashes() == want


def test_text_key_cut_inside_a_long_ascii_or_non_ascii_text():
    for text in ("a" * 70_000, "\u00e9" * 70_000, "a" * 40_000 + "\u4e2d" * 30_000):
        for n in (1, 1024, 35_000, 65_536, 69_999, 70_000, 80_000):
            want = xxhash.xxh3_64_intdigest(text[:n].encode("utf-8"), _seeded("m"))
            assert text_routing_key(text, n, "m") == want


def test_strategies_without_a_key_validate_like_the_key():
    from prefixroute.core.config import RoutingConfig
    from prefixroute.core.keys import openai_route

    bad = [({"messages": "x"}, True), ({"model": 3, "messages": []}, True),
           ({"messages": [{"role": "user", "content": "q"}], "prompt_cache_key": 3}, True),
           ({"messages": [{"role": "user", "content": "q"}], "cache_salt": ""}, True),
           ({"messages": [{"content": "q"}]}, True), ({"prompt": [1, "a"]}, False)]
    for payload, chat_ in bad:
        for routing in (RoutingConfig(), RoutingConfig.build("least-outstanding-requests")):
            with pytest.raises(InvalidRequest) as got:
                openai_route(payload, chat_, routing)
            with pytest.raises(InvalidRequest) as want:
                openai_routing_key(payload, chat_, 1024)
            assert str(got.value) == str(want.value)
    # only the first message is looked at, as for a key limited to one character
    payload = {"messages": [{"role": "user", "content": "q"}, {"content": "no role"}]}
    assert openai_route(payload, True, RoutingConfig()) == (None, [])
