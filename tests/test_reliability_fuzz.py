"""Property-based fuzzing of request parsing and key extraction (hypothesis).

Properties:

* on arbitrary bytes, arbitrary JSON shapes and arbitrary Unicode, parsing either
  succeeds or raises ``InvalidRequest`` (a 400), never anything else;
* the routing key never depends on anything after the first PrefixLength units: bytes
  of a native body, characters of the extracted OpenAI text, token ids of a token
  prompt; nor on fields that do not reach the prompt (temperature, max_tokens...);
* through the running router, no input gets a 5xx of the router's own.
"""

from __future__ import annotations

import asyncio
import json
import threading
from typing import Any

import aiohttp
import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from prefixroute.core.config import FleetConfig, RoutingConfig
from prefixroute.core.keys import InvalidRequest, render_chat_text
from prefixroute.server import ServerSettings, start_router
from prefixroute.server.app import native_request_key, parse_openai_request

from fault_backend import FaultBackend

N = 1024
PA = RoutingConfig.build("prefix-aware", N, 8)
CA = RoutingConfig.build("cache-aware", concurrency_threshold=8)
ROUTINGS = [PA, CA, RoutingConfig.build("random"), RoutingConfig.build("least-outstanding-requests")]
FAST = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# Text without lone surrogates (JSON cannot carry them as UTF-8) but with every other plane.
TEXT = st.text(st.characters(blacklist_categories=("Cs",)), max_size=300)
JSON = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-2**70, max_value=2**70) | st.floats(allow_nan=False)
    | TEXT,
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(TEXT, inner, max_size=5),
    max_leaves=20)
FINITE_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | TEXT,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(TEXT, inner, max_size=3), max_leaves=8)
FIELDS = st.fixed_dictionaries({}, optional={
    "model": JSON, "messages": JSON, "prompt": JSON, "stream": JSON, "prompt_cache_key": JSON, "tools": JSON,
    "temperature": JSON, "max_tokens": JSON})
MESSAGE = st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant", "tool"]),
                                 "content": TEXT | st.lists(st.fixed_dictionaries({"type": st.just("text"),
                                                                                   "text": TEXT}), max_size=3)},
                                optional={"name": TEXT})


def _dumps(value: Any) -> bytes:
    """JSON of any generated value (the stdlib writes integers of any size)."""
    return json.dumps(value, ensure_ascii=False).encode("utf-8")


def _parse(body: bytes, chat: bool, routing: RoutingConfig) -> Any:
    try:
        return parse_openai_request(body, chat, routing)
    except InvalidRequest as exc:
        assert str(exc)  # an error that names the problem
        return None


@FAST
@given(st.binary(max_size=2000), st.booleans(), st.sampled_from(ROUTINGS))
def test_arbitrary_bytes_parse_or_400(body, chat, routing):
    _parse(body, chat, routing)


@FAST
@given(JSON, st.booleans(), st.sampled_from(ROUTINGS))
def test_arbitrary_json_values_parse_or_400(value, chat, routing):
    _parse(_dumps(value), chat, routing)


@FAST
@given(FIELDS, st.booleans(), st.sampled_from(ROUTINGS))
def test_arbitrary_field_shapes_parse_or_400(doc, chat, routing):
    _parse(_dumps(doc), chat, routing)


@FAST
@given(st.lists(MESSAGE, min_size=1, max_size=6), TEXT, st.sampled_from(ROUTINGS))
def test_unicode_chats_parse(messages, model, routing):
    payload, key, blocks = parse_openai_request(orjson.dumps({"model": model, "messages": messages}), True,
                                                routing)
    assert (key is not None) == (routing is PA) and (blocks != []) == (routing is CA)


@FAST
@given(st.sampled_from([b"\\ud800", b"\\udfff", b"\\ud83d\\u0041", b"\\u0000", b"\xed\xa0\x80", b"\xc0\xaf"]),
       st.booleans())
def test_surrogates_and_overlong_utf8(fragment, chat):
    body = b'{"model": "m", "messages": [{"role": "user", "content": "x' + fragment + b'"}], "prompt": "p' + \
        fragment + b'"}'
    _parse(body, chat, PA)


# -- the key never depends on anything after the first PrefixLength units -----------------


@FAST
@given(st.binary(min_size=N, max_size=N + 50), st.binary(max_size=200), st.binary(max_size=200), TEXT)
def test_native_key_ignores_bytes_after_prefix_length(head, tail1, tail2, tenant_seed):
    tenant = "".join(c for c in tenant_seed if " " <= c <= "~")[:64]
    k1, _ = native_request_key(head + tail1, PA, "default", tenant)
    k2, _ = native_request_key(head[:N] + tail2, PA, "default", tenant)
    assert k1 == k2


@FAST
@given(st.binary(max_size=N - 1), st.binary(min_size=1, max_size=10))
def test_native_key_sees_every_byte_before_prefix_length(body, extra):
    assert native_request_key(body, PA, "e", "")[0] != native_request_key(body + extra, PA, "e", "")[0]


def _padded(messages: list[dict[str, Any]], filler: str) -> list[dict[str, Any]]:
    """Messages whose rendered text is longer than PrefixLength."""
    msgs = [dict(m) for m in messages]
    while len(render_chat_text({"messages": msgs})) <= N + 1:
        msgs.insert(0, {"role": "system", "content": (filler or "s") * 64})
    return msgs


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(MESSAGE, min_size=1, max_size=4), TEXT, st.lists(MESSAGE, max_size=3), TEXT,
       st.dictionaries(st.sampled_from(["temperature", "max_tokens", "top_p", "user", "seed", "n", "stream_options"]),
                       FINITE_JSON, max_size=3), st.booleans())
def test_chat_key_ignores_everything_after_prefix_length(messages, filler, more, appended, extra_fields, stream):
    msgs = _padded(messages, filler)
    base = {"model": "m", "messages": msgs}
    _, k, _ = parse_openai_request(orjson.dumps(base), True, PA)
    assert render_chat_text(base)[:N] == render_chat_text({"messages": msgs + more})[:N]
    _, k_more, _ = parse_openai_request(orjson.dumps({**base, "messages": msgs + more}), True, PA)
    last = dict(msgs[-1])
    if isinstance(last["content"], str):
        last["content"] += appended
    _, k_longer, _ = parse_openai_request(orjson.dumps({**base, "messages": msgs[:-1] + [last]}), True, PA)
    _, k_fields, _ = parse_openai_request(_dumps({**extra_fields, **base, "stream": stream}), True, PA)
    assert k == k_more == k_longer == k_fields


@FAST
@given(st.text(st.characters(blacklist_categories=("Cs",)), min_size=N, max_size=N + 40), TEXT, TEXT)
def test_completion_key_counts_characters(prompt, tail1, tail2):
    _, k1, _ = parse_openai_request(orjson.dumps({"model": "m", "prompt": prompt + tail1}), False, PA)
    _, k2, _ = parse_openai_request(orjson.dumps({"model": "m", "prompt": prompt[:N] + tail2, "max_tokens": 3}),
                                 False, PA)
    assert k1 == k2


@FAST
@given(st.lists(st.integers(min_value=0, max_value=2**31), min_size=1, max_size=50),
       st.lists(st.integers(min_value=0, max_value=2**31), max_size=20))
def test_token_prompt_key_counts_tokens(seed_tokens, tail):
    tokens = (seed_tokens * (N // len(seed_tokens) + 1))[:N]  # exactly PrefixLength tokens
    _, k1, _ = parse_openai_request(orjson.dumps({"model": "m", "prompt": tokens}), False, PA)
    _, k2, _ = parse_openai_request(orjson.dumps({"model": "m", "prompt": tokens + tail}), False, PA)
    changed = tokens[:-1] + [tokens[-1] + 1]
    _, k3, _ = parse_openai_request(orjson.dumps({"model": "m", "prompt": changed}), False, PA)
    assert k1 == k2 != k3


# -- through the running router: never a 5xx of its own -----------------------------------


class _Loop:
    """An event loop in a thread hosting a router and an instance, for sync hypothesis tests."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro: Any, timeout: float = 30) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        self.loop.close()


@pytest.fixture(scope="module")
def live():
    env = _Loop()

    async def up():
        backend = await FaultBackend().start()
        backend.record = False
        handle = await start_router(FleetConfig.single([backend.url], PA),
                                    ServerSettings(port=0, admin_port=0, health_check_interval_s=0,
                                                   metrics_scrape_interval_s=0, shutdown_timeout_s=0.5))
        http = aiohttp.ClientSession()
        return backend, handle, http

    backend, handle, http = env.run(up())
    yield env, handle, http

    async def down():
        await http.close()
        await handle.close()
        await backend.stop()

    env.run(down())
    env.close()


PATHS = ["/v1/chat/completions", "/v1/completions", "/invocations", "/endpoints/default/invocations-response-stream",
         "/endpoints/default/openai/v1/chat/completions"]


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.function_scoped_fixture])
@given(st.sampled_from(PATHS), st.binary(max_size=3000) | FIELDS.map(_dumps),
       st.one_of(st.none(), st.text(st.characters(min_codepoint=0x20, max_codepoint=0xFF, blacklist_characters="\x7f"),
                                    max_size=80)))
def test_router_never_answers_5xx_to_bad_input(live, path, body, tenant):
    env, handle, http = live

    async def send() -> tuple[int, bytes]:
        headers = {"Content-Type": "application/json"}
        if tenant is not None:
            headers["X-Amzn-SageMaker-Prefix-Aware-Id"] = tenant
        async with http.post(handle.url + path, data=body, headers=headers) as r:
            return r.status, await r.read()

    status, answer = env.run(send())
    assert status in (200, 400), (status, answer[:200])
    if status == 400:
        doc = orjson.loads(answer)
        assert doc.get("message") or doc["error"]["message"]
