"""A model's tokenizer and chat template (core.model_tokenizer, core.chat_template), and the
emulated engine tokenizing with them (``prefixroute emulate --tokenizer``)."""

from __future__ import annotations

import json
import shutil
from importlib import resources
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from prefixroute.core.chat_template import render_chat_prompt
from prefixroute.core.keys import InvalidRequest
from prefixroute.core.model_tokenizer import OUTPUT_VOCABULARY_SIZE, ModelTokenizer, load_tokenizer
from prefixroute.engine.model import DEFAULT_MODEL, EngineConfig
from prefixroute.engine.server import ENGINE_KEY, start_engine_server

BOS, EOT = "<|begin_of_text|>", "<|eot_id|>"
HEADER = "<|start_header_id|>{}<|end_header_id|>\n\n"
SYSTEM = "You answer questions about the cache router and its engine. " * 30


@pytest.fixture(scope="module")
def tiny() -> ModelTokenizer:
    return ModelTokenizer.load("tiny")


def chat(*contents: str, **extra: Any) -> dict[str, Any]:
    roles = ["system", "user", "assistant", "user"]
    return {"model": DEFAULT_MODEL, "messages": [{"role": roles[i], "content": c} for i, c in enumerate(contents)],
            **extra}


def test_bundled_tokenizer_files(tiny: ModelTokenizer) -> None:
    assert tiny.vocab_size == 810
    assert (tiny.bos_token, tiny.eos_token) == (BOS, EOT)
    assert tiny.chat_template.startswith("{{- bos_token }}")
    assert tiny.decode(tiny.encode("the cache router")) == "the cache router"
    assert tiny.encode("x", add_special_tokens=True)[0] == tiny.tokenizer.token_to_id(BOS)
    assert tiny.tokenizer.token_to_id(BOS) not in tiny.encode("x", add_special_tokens=False)


def test_chat_template_renders_as_llama3(tiny: ModelTokenizer) -> None:
    payload = chat("  Be brief.  ", "Hi there")
    assert tiny.render_chat(payload) == (
        BOS + HEADER.format("system") + "Be brief." + EOT + HEADER.format("user") + "Hi there" + EOT
        + HEADER.format("assistant"))
    no_prompt = tiny.render_chat({**payload, "add_generation_prompt": False})
    assert no_prompt == tiny.render_chat(payload).removesuffix(HEADER.format("assistant"))


def test_chat_template_content_parts_tools_and_kwargs(tiny: ModelTokenizer) -> None:
    parts = {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]}
    assert tiny.render_chat(parts) == tiny.render_chat({"messages": [{"role": "user", "content": "a\nb"}]})
    tool = {"type": "function", "function": {"name": "f", "description": "é"}}
    rendered = tiny.render_chat({**parts, "tools": [tool]})
    assert rendered.startswith(BOS + HEADER.format("system") + "Tools available:\n" + json.dumps(tool,
                                                                                                  ensure_ascii=False))
    template = "{{ greeting }} {{ messages | length }}{% if not messages %}{{ raise_exception('empty') }}{% endif %}"
    assert render_chat_prompt(template, {"messages": [{"role": "user", "content": ""}],
                                         "chat_template_kwargs": {"greeting": "hello"}}) == "hello 1"
    with pytest.raises(InvalidRequest, match="refused the conversation: empty"):
        render_chat_prompt(template, {"messages": []})


@pytest.mark.parametrize("payload, message", [
    ({"messages": "hi"}, "'messages' must be a list"),
    ({"messages": [{"content": "x"}]}, "string 'role'"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "type 'image_url' are not supported"),
    ({"messages": [{"role": "user", "content": 3}]}, "must be a string, a list of parts or null"),
    ({"messages": [], "add_generation_prompt": "yes"}, "'add_generation_prompt' must be a boolean"),
])
def test_chat_template_refuses_malformed_requests(tiny: ModelTokenizer, payload: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidRequest, match=message):
        tiny.chat_token_ids(payload)


def test_request_token_ids_follow_vllm(tiny: ModelTokenizer) -> None:
    bos = tiny.tokenizer.token_to_id(BOS)
    ids = tiny.request_token_ids(chat(SYSTEM, "What is a block?"), chat=True)
    assert ids[0] == bos and ids.count(bos) == 1  # the template's BOS only
    assert ids == tiny.encode(tiny.render_chat(chat(SYSTEM, "What is a block?")), add_special_tokens=False)
    assert tiny.request_token_ids({"prompt": "the cache"}, chat=False) == [bos, *tiny.encode("the cache", add_special_tokens=False)]
    assert tiny.request_token_ids({"prompt": [5, 6, 7]}, chat=False) == [5, 6, 7]
    assert tiny.request_token_ids({"prompt": ["the cache", "other"]}, chat=False) == tiny.encode("the cache")
    with pytest.raises(InvalidRequest):
        tiny.request_token_ids({"prompt": 3}, chat=False)


def test_output_vocabulary_round_trips(tiny: ModelTokenizer) -> None:
    vocab = tiny.output_token_ids
    assert len(vocab) == OUTPUT_VOCABULARY_SIZE == len(set(vocab))
    for tid in vocab:
        word = tiny.decode([tid])
        assert word.startswith(" ") and word[1:].isalpha()
        assert tiny.encode(word, add_special_tokens=False) == [tid]  # generated text re-tokenizes to itself


def test_load_from_directory_file_and_errors(tmp_path: Path) -> None:
    bundled = resources.files("prefixroute") / "data" / "tiny_tokenizer"
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (model_dir / name).write_bytes((bundled / name).read_bytes())
    from_dir = ModelTokenizer.load(model_dir)
    assert from_dir.render_chat(chat("a")) == ModelTokenizer.load("tiny").render_chat(chat("a"))
    (model_dir / "chat_template.jinja").write_text("{% for m in messages %}[{{ m.role }}]{% endfor %}")
    assert ModelTokenizer.load(model_dir).render_chat(chat("a", "b")) == "[system][user]"
    override = tmp_path / "t.jinja"
    override.write_text("X{{ messages[0].content }}")
    assert ModelTokenizer.load(model_dir / "tokenizer.json", override).render_chat(chat("q")) == "Xq"
    lone = tmp_path / "lone"
    lone.mkdir()
    shutil.copy(model_dir / "tokenizer.json", lone / "tokenizer.json")
    bare = ModelTokenizer.load(lone / "tokenizer.json")
    assert bare.chat_template == "" and bare.bos_token == ""
    with pytest.raises(InvalidRequest, match="no chat template"):
        bare.chat_token_ids(chat("q"))
    with pytest.raises(ValueError, match="cannot read"):
        ModelTokenizer.load(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ValueError, match="not a valid tokenizer.json"):
        ModelTokenizer.load(tmp_path / "bad.json")
    override.write_text("{% for %}")
    with pytest.raises(ValueError, match="does not compile"):
        ModelTokenizer.load("tiny", override)
    assert load_tokenizer(None) is None


async def test_engine_tokenizes_with_the_model_tokenizer(tiny: ModelTokenizer) -> None:
    runner, port = await start_engine_server(EngineConfig(), "127.0.0.1", 0, 0.0, "tok", tokenizer=tiny)
    try:
        async with aiohttp.ClientSession(f"http://127.0.0.1:{port}") as session:
            first = chat(SYSTEM, "What is a block?", max_tokens=5)
            async with session.post("/v1/chat/completions", json=first) as resp:
                body = await resp.json()
            n = len(tiny.chat_token_ids(first))
            assert body["usage"]["prompt_tokens"] == n and body["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
            answer = body["choices"][0]["message"]["content"]
            assert len(tiny.encode(answer, add_special_tokens=False)) == 5
            # The next turn holds this turn's prompt (up to its generation header) and answer.
            second = chat(SYSTEM, "What is a block?", answer, "And a chain?", max_tokens=3)
            async with session.post("/v1/chat/completions", json=second) as resp:
                usage = (await resp.json())["usage"]
            ids2 = tiny.chat_token_ids(second)
            ids1 = tiny.chat_token_ids(first)
            common = next((i for i, (a, b) in enumerate(zip(ids1, ids2)) if a != b), len(ids1))
            assert usage["prompt_tokens"] == len(ids2)
            assert usage["prompt_tokens_details"]["cached_tokens"] == common // 16 * 16 > 0
            completion = {"model": DEFAULT_MODEL, "prompt": SYSTEM, "max_tokens": 2}
            async with session.post("/v1/completions", json=completion) as resp:
                usage = (await resp.json())["usage"]
            assert usage["prompt_tokens"] == len(tiny.encode(SYSTEM))
            async with session.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": [
                    {"type": "image_url", "image_url": {"url": "http://x"}}]}]}) as resp:
                assert resp.status == 400
                assert "not supported" in (await resp.json())["error"]["message"]
            async with session.get("/info") as resp:
                assert (await resp.json())["tokenizer"] == "tiny"
    finally:
        await runner.cleanup()
    assert runner.app[ENGINE_KEY].core.stats().requests_finished == 3


def test_emulate_cli_rejects_bad_tokenizer_flags(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    import argparse

    from prefixroute.engine import cli

    parser = argparse.ArgumentParser()
    cli.configure_parser(parser)
    assert cli.run(parser.parse_args(["--chat-template", str(tmp_path / "t.jinja")])) == 2
    assert "--chat-template needs --tokenizer" in capsys.readouterr().err
    assert cli.run(parser.parse_args(["--tokenizer", str(tmp_path / "nowhere")])) == 2
    assert "cannot read" in capsys.readouterr().err


def test_a_multimodal_stand_in_gives_equal_images_equal_tokens(tiny: ModelTokenizer) -> None:
    # --tokenizer-media-tokens: an image part becomes its routing stand-in text (N x 4
    # characters), so the same image prefills the same tokens and another image others.
    import dataclasses

    mm = dataclasses.replace(tiny, media_tokens=64)

    def ask(url: str, q: str) -> list[int]:
        return mm.chat_token_ids({"messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": q}]}]})

    a1, a2, b = ask("http://img/a.png", "what is it?"), ask("http://img/a.png", "and its colour?"), \
        ask("http://img/b.png", "what is it?")
    common = next(i for i, (x, y) in enumerate(zip(a1, a2)) if x != y)
    assert common > 40  # the image's stand-in is shared
    assert next(i for i, (x, y) in enumerate(zip(a1, b)) if x != y) < common
    with pytest.raises(InvalidRequest, match="text only"):
        tiny.chat_token_ids({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}]})
