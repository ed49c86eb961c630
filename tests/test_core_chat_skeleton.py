"""The chat template applied by substitution (core.chat_skeleton): equal to a whole render
for templates that place contents as they are, and falling back to whole renders where a
template reads, transforms, repeats or drops a content."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixroute.core.chat_skeleton import ChatSkeletons, reads_content
from prefixroute.core.keys import InvalidRequest
from prefixroute.core.model_tokenizer import ModelTokenizer

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# reads the content: a reasoning model's template drops what precedes </think> in an answer
THINK = ("{% for m in messages %}<|im_start|>{{ m.role }}\n"
         "{% if m.role == 'assistant' and '</think>' in m.content %}{{ m.content.split('</think>')[-1] | trim }}"
         "{% else %}{{ m.content }}{% endif %}<|im_end|>\n{% endfor %}")
REPEATS = "{{ messages[0].content }}|{% for m in messages %}{{ m.role }}:{{ m.content }};{% endfor %}"
DROPS = "{% for m in messages %}{% if m.role != 'system' %}{{ m.role }}:{{ m.content }};{% endif %}{% endfor %}"
REVERSED = "{% for m in messages | reverse %}{{ m.role }}:{{ m.content }};{% endfor %}"
STRIP_ANSWERS = ("{% for m in messages %}{{ m.role }}:{% if m.role == 'assistant' %}{{ m.content.strip() }}"
                 "{% else %}{{ m.content }}{% endif %};{% endfor %}")
LENGTH = "{% for m in messages %}{{ m.role }}({{ m.content | length }}):{{ m.content }};{% endfor %}"


@pytest.fixture(scope="module")
def tiny() -> ModelTokenizer:
    return ModelTokenizer.load("tiny")


def with_template(tok: ModelTokenizer, template: str) -> ModelTokenizer:
    return dataclasses.replace(tok, chat_template=template)


def chat(*contents: Any, roles: tuple[str, ...] = ("system", "user", "assistant", "user", "assistant", "user"),
         **extra: Any) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": roles[i], "content": c} for i, c in enumerate(contents)], **extra}


def test_substitution_equals_the_whole_render(tiny: ModelTokenizer) -> None:
    sk = ChatSkeletons(tiny, verify_every=0)
    system = "You answer questions about the cache router. " * 20
    for i in range(10):
        payload = chat(system.strip(), f"Question {i}: what is a KV block?")
        assert sk.render(payload) == tiny.render_chat(payload)
    # one shape: rendered whole when first seen, built and checked when seen again, substituted after
    assert sk.stats() == {"shapes": 1, "hits": 8, "renders": 2, "mismatches": 0}
    longer = chat(system.strip(), "Q?", "An answer.", "And then?", add_generation_prompt=False)
    assert sk.render(longer) == tiny.render_chat(longer) and len(sk) == 2


def test_edge_white_space_and_empty_contents_keep_their_own_shapes(tiny: ModelTokenizer) -> None:
    # the tiny template trims each content: a content with white space at an edge has a
    # shape of its own, whose skeleton strips it; an empty or blank one is rendered as itself
    sk = ChatSkeletons(tiny, verify_every=0)
    payloads = (chat("sys", "plain"), chat(" sys\n", "plain"), chat("", "plain"), chat("sys", "plain\n\n"),
                chat("\u3000sys\u2003", " \n "))
    for payload in payloads:
        for _ in range(4):
            assert sk.render(payload) == tiny.render_chat(payload)
    assert sk.mismatches == 0 and sk.hits == 10 and sk.renders == 10 and len(sk) == 5


def test_untrimmed_template_substitutes_edge_spaces(tiny: ModelTokenizer) -> None:
    tok = with_template(tiny, CHATML)
    sk = ChatSkeletons(tok, verify_every=0)
    payload = chat("  system\n", "\tuser ", "", " \n")
    for _ in range(4):
        assert sk.render(payload) == tok.render_chat(payload)
    assert sk.hits == 2 and sk.renders == 2 and sk.mismatches == 0


@pytest.mark.parametrize("template, hits", [
    # trims spaces and keeps new lines: " \nq" loses its space only, a partial strip
    ("{% for m in messages %}[{{ m.content | trim(' ') }}]{% endfor %}", 4),
    # trims the last message only: " \nq" is last, stripped whole
    ("{% for m in messages %}{% if loop.last %}{{ m.content | trim }}{% else %}{{ m.content }}{% endif %};"
     "{% endfor %}", 5),
])
def test_partial_or_positional_strips_are_substituted_only_where_they_agree(tiny: ModelTokenizer,
                                                                             template: str, hits: int) -> None:
    tok = with_template(tiny, template)
    sk = ChatSkeletons(tok, verify_every=0)
    for payload in (chat("sys", "plain "), chat("sys", "plain\n"), chat("sys ", "plain \n"), chat("s\n", " q"),
                    chat("sys", " \nq")):
        for _ in range(3):
            assert sk.render(payload) == tok.render_chat(payload)
    # a shape whose edges are kept or stripped whole is substituted from its third use; a
    # partial strip is rendered whole every time
    assert sk.mismatches == 0 and sk.hits == hits and sk.renders == 15 - hits


@pytest.mark.parametrize("template", [REPEATS, DROPS, REVERSED])
def test_templates_that_repeat_drop_or_reorder_contents_render_whole(tiny: ModelTokenizer, template: str) -> None:
    tok = with_template(tiny, template)
    sk = ChatSkeletons(tok, verify_every=0)
    payload = chat("the system prompt", "a question")
    for _ in range(3):
        assert sk.render(payload) == tok.render_chat(payload)
    assert sk.hits == 0 and sk.renders == 3


@pytest.mark.parametrize("template, reads", [
    (THINK, True), (LENGTH, True), ("{{ messages[0].content | tojson }}", True),
    ("{% set content = m.content %}{% if '<x>' in content %}{% endif %}", True),
    ("{% if message['content'] == '' %}x{% endif %}", True), ("{{ message['content'][0]['text'] }}", True),
    ("{{ m.content.strip() }}", True), (CHATML, False),
    ("{% if message.content is string %}{{ message.content | trim }}{% endif %}", False),
    ("{{ '<tool_response>\\n' + message.content + '\\n</tool_response>' }}", False),
])
def test_templates_that_read_the_content_are_found_and_rendered_whole(tiny: ModelTokenizer, template: str,
                                                                      reads: bool) -> None:
    assert reads_content(template) is reads
    tok = with_template(tiny, template)
    sk = ChatSkeletons(tok)
    assert sk.enabled is not reads
    assert reads_content(tiny.chat_template) is False


def test_a_dependence_on_the_content_is_caught_by_the_checks_of_each_shape(tiny: ModelTokenizer) -> None:
    # a template that reads the content where the heuristic cannot see it (an alias
    # made with a namespace), on every 4th use of each shape
    sneaky = ("{% set ns = namespace(c='') %}{% for m in messages %}{% set ns.c = m['con' + 'tent'] %}"
              "{{ m.role }}:{% if ns.c.startswith('<think>') %}THOUGHT{% else %}{{ m['content'] }}{% endif %};"
              "{% endfor %}")
    tok = with_template(tiny, sneaky)
    sk = ChatSkeletons(tok, verify_every=4)
    assert sk.enabled
    plain, other = chat("sys", "q", "an answer", "q2"), chat("sys", "q")
    thinking = chat("sys", "q", "<think>hmm</think> the answer", "q2")
    for _ in range(2):
        assert sk.render(plain) == tok.render_chat(plain) and sk.render(other) == tok.render_chat(other)
    wrong = []
    for _ in range(6):
        wrong.append(sk.render(thinking) != tok.render_chat(thinking))
        sk.render(other)  # another shape's uses do not delay this shape's checks
    assert wrong == [True, True, True, False, False, False] and sk.mismatches == 1  # the 4th use of the shape: checked
    assert sk.render(plain) == tok.render_chat(plain)


@pytest.mark.parametrize("payload", [
    chat("sys", "q", tools=[{"type": "function", "function": {"name": "f"}}]),
    chat("sys", "q", chat_template_kwargs={"x": 1}),
    {"model": "m", "messages": [{"role": "user", "content": "q", "name": "ann"}]},
    chat("sys", [{"type": "text", "text": "a"}, {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]),
    {"model": "m", "messages": [{"role": "r" * 65, "content": "q"}]},
    {"model": "m", "messages": [{"role": "user", "content": "q"}] * 513},
    chat("sys", "q" + " " * 17),
])
def test_requests_with_more_than_roles_and_text_render_whole(tiny: ModelTokenizer, payload: dict[str, Any]) -> None:
    tok = dataclasses.replace(tiny, media_tokens=8)
    sk = ChatSkeletons(tok, verify_every=0)
    for _ in range(3):
        assert sk.render(payload) == tok.render_chat(payload)
    assert sk.renders == 3 and len(sk) == 0


def test_text_parts_are_joined_as_the_template_sees_them(tiny: ModelTokenizer) -> None:
    sk = ChatSkeletons(tiny, verify_every=0)
    payload = chat("sys", [{"type": "text", "text": "first"}, "second", {"text": "third"}])
    for _ in range(3):
        assert sk.render(payload) == tiny.render_chat(payload)
    assert sk.hits == 1 and "first\nsecond\nthird" in sk.render(payload)


@pytest.mark.parametrize("payload, message", [
    ({"model": "m"}, "'messages' must be a list"),
    ({"model": "m", "messages": [{"content": "x"}]}, "string 'role'"),
    (chat("sys", "q", add_generation_prompt="yes"), "'add_generation_prompt' must be a boolean"),
])
def test_malformed_requests_raise_as_the_whole_render_does(tiny: ModelTokenizer, payload: dict[str, Any],
                                                           message: str) -> None:
    with pytest.raises(InvalidRequest, match=message):
        ChatSkeletons(tiny).render(payload)


def test_sentinel_characters_in_a_content_render_whole(tiny: ModelTokenizer) -> None:
    sk = ChatSkeletons(tiny, verify_every=0)
    payload = chat("sys \ue0000\ue001 x", "q")
    for _ in range(2):
        assert sk.render(payload) == tiny.render_chat(payload)
    assert sk.renders == 2 and len(sk) == 0


def test_shapes_and_template_text_kept_are_bounded(tiny: ModelTokenizer) -> None:
    sk = ChatSkeletons(tiny, shapes=3, verify_every=0)
    for n in range(1, 7):
        payload = chat(*[f"m{i}" for i in range(n)])
        for _ in range(2):
            assert sk.render(payload) == tiny.render_chat(payload)
    assert len(sk) == 3
    small = ChatSkeletons(tiny, verify_every=0, max_bytes=200)
    for n in range(1, 7):
        payload = chat(*[f"m{i}" for i in range(n)])
        for _ in range(3):
            assert small.render(payload) == tiny.render_chat(payload)
    assert small._bytes <= 200 and small.hits > 0  # noqa: SLF001 (the bound itself)
    with pytest.raises(ValueError):
        ChatSkeletons(tiny, shapes=-1)


_text = st.lists(st.sampled_from(list("ab <>|{}%\n\t\u00e9\u3000\r\x0b\xa0\u2028") + ["</think>", "\ue000", "\ue001"]),
                 max_size=12).map("".join)
PARTIAL = "{% for m in messages %}{{ m.role }}[{{ m.content | trim(' \\n') }}]{% endfor %}"


@settings(max_examples=300, deadline=None)
@given(convs=st.lists(st.tuples(st.lists(st.tuples(st.sampled_from(["system", "user", "assistant"]), _text),
                                         min_size=1, max_size=4), st.booleans()), min_size=1, max_size=10),
       template=st.sampled_from(["tiny", CHATML, PARTIAL,
                                 "{% for m in messages %}{% if loop.last %}{{ m.content | trim }}{% else %}"
                                 "{{ m.content }}{% endif %}|{% endfor %}"]))
def test_property_never_wrong_unchecked_for_templates_that_place_or_trim_contents(
        tiny: ModelTokenizer, convs: list[tuple[list[tuple[str, str]], bool]], template: str) -> None:
    """For templates that place contents as they are, trim them (wholly, partly, or by
    position), every answer equals the whole render, with no check after the first."""
    tok = tiny if template == "tiny" else with_template(tiny, template)
    sk = ChatSkeletons(tok, verify_every=0)
    assert sk.enabled
    for messages, agp in convs + convs:  # (every shape seen again: substituted)
        payload = {"messages": [{"role": r, "content": c} for r, c in messages], "add_generation_prompt": agp}
        assert sk.render(payload) == tok.render_chat(payload)
    assert sk.mismatches == 0
