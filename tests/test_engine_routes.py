"""The emulated engine's other vLLM routes (engine/extra_routes.py) against a real engine
on loopback, with its 4-byte tokenizer and with the bundled ``tiny`` model tokenizer:
``/tokenize`` and ``/detokenize`` give the ids the engine prefills, ``/v1/responses``
runs as a chat request (prefix cache, TTFT, metrics; the Responses API's stream events,
also through the ``openai`` client), ``/v1/score`` and ``/v1/rerank`` prefill their pairs
through the prefix cache; every route checks ``model`` and answers errors in vLLM's shape."""

from __future__ import annotations

import asyncio

import aiohttp
import openai
import orjson
import pytest

from prefixroute.core.model_tokenizer import ModelTokenizer
from prefixroute.engine.extra_routes import relevance_score
from prefixroute.engine.model import EngineConfig
from prefixroute.engine.server import ENGINE_KEY, start_engine_server
from prefixroute.engine.tokenizer import count_tokens
from test_server_helpers import eventually, metric_value

DOC = "A long shared document about prefix caches and the routers in front of them. " * 30
ROUTES = ("/tokenize", "/detokenize", "/v1/responses", "/v1/score", "/v1/rerank")
BODIES = {"/tokenize": {"prompt": "hello"}, "/detokenize": {"tokens": []}, "/v1/responses": {"input": "hi"},
          "/v1/score": {"text_1": "a", "text_2": "b"}, "/v1/rerank": {"query": "a", "documents": ["b"]}}


class Engine:
    def __init__(self, url, http, runner, tokenizer):
        self.url, self.http, self.runner, self.tokenizer = url, http, runner, tokenizer
        self.server = runner.app[ENGINE_KEY]

    async def post(self, path, body):
        async with self.http.post(self.url + path, json=body) as r:
            return r.status, await r.json()

    async def metrics(self) -> str:
        async with self.http.get(self.url + "/metrics") as r:
            return await r.text()

    async def hits(self) -> float:
        return metric_value(await self.metrics(), "vllm:prefix_cache_hits_total") or 0.0


@pytest.fixture(params=["4-byte", "tiny"])
async def engine(request):
    tokenizer = ModelTokenizer.load("tiny") if request.param == "tiny" else None
    cfg = EngineConfig(model="llama", served_model_names=("llama", "llama-alias"), max_loras=1, max_model_len=32768)
    runner, port = await start_engine_server(cfg, time_scale=0.0, instance_id="e0", tokenizer=tokenizer,
                                             lora_modules={"sql": "/adapters/sql"})
    async with aiohttp.ClientSession() as http:
        yield Engine(f"http://127.0.0.1:{port}", http, runner, tokenizer)
    await runner.cleanup()


def _messages(q: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": DOC}, {"role": "user", "content": q}]


# -- /tokenize, /detokenize ------------------------------------------------------------------


async def test_tokenize_gives_the_ids_the_engine_prefills(engine):
    status, tok = await engine.post("/tokenize", {"model": "llama", "prompt": DOC})
    assert status == 200 and set(tok) == {"count", "max_model_len", "tokens", "token_strs"}
    assert tok["max_model_len"] == 32768 and tok["token_strs"] is None and tok["count"] == len(tok["tokens"])
    _, comp = await engine.post("/v1/completions", {"model": "llama", "prompt": DOC, "max_tokens": 1})
    assert tok["count"] == comp["usage"]["prompt_tokens"]
    _, chat_tok = await engine.post("/tokenize", {"model": "llama", "messages": _messages("q")})
    _, chat = await engine.post("/v1/chat/completions", {"model": "llama", "messages": _messages("q"), "max_tokens": 1})
    assert chat_tok["count"] == chat["usage"]["prompt_tokens"]
    _, bare = await engine.post("/tokenize", {"model": "llama", "messages": _messages("q"),
                                              "add_generation_prompt": False})
    assert 0 < bare["count"] < chat_tok["count"]  # (the last token of the shorter text may differ)
    assert chat_tok["tokens"][:bare["count"] - 1] == bare["tokens"][:-1]

    _, plain = await engine.post("/tokenize", {"model": "llama", "prompt": "Hello world", "add_special_tokens": False,
                                               "return_token_strs": True})
    _, back = await engine.post("/detokenize", {"model": "llama", "tokens": plain["tokens"]})
    assert back == {"prompt": "Hello world"}
    assert len(plain["token_strs"]) == plain["count"]
    _, special = await engine.post("/tokenize", {"model": "llama", "prompt": "Hello world"})
    if engine.tokenizer is None:  # the 4-byte rule: 4 bytes a token, no special tokens
        assert special == {**plain, "token_strs": None} and plain["token_strs"] == ["Hell", "o wo", "rld"]
        assert tok["count"] == count_tokens(DOC)
    else:  # the model's: its BOS first unless add_special_tokens is false (vLLM shows it when decoding)
        bos = engine.tokenizer.encode("", add_special_tokens=True)
        assert special["tokens"] == bos + plain["tokens"] and plain["token_strs"][-1] == "Ġworld"
        _, back = await engine.post("/detokenize", {"model": "llama", "tokens": special["tokens"]})
        assert back == {"prompt": engine.tokenizer.bos_token + "Hello world"}
    # tokenizing is no inference: nothing reached the core, but the requests are counted
    assert engine.server.requests_by_model == {"llama": 8 if engine.tokenizer is None else 9}


async def test_tokenize_errors_and_models(engine):
    for path, body, needle in (
            ("/tokenize", {"model": "llama"}, "'prompt' (a string) or 'messages' is required"),
            ("/tokenize", {"prompt": ["a"]}, "'prompt'"),
            ("/tokenize", {"prompt": "a", "add_special_tokens": "yes"}, "'add_special_tokens' must be a boolean"),
            ("/tokenize", {"messages": [{"role": "user", "content": "x"}], "add_generation_prompt": True,
                           "continue_final_message": True}, "Cannot set both `continue_final_message`"),
            ("/tokenize", {"messages": "x"}, "messages"),
            ("/detokenize", {"tokens": "1 2"}, "'tokens' must be a list of token ids"),
            ("/detokenize", {"tokens": [1, -2]}, "'tokens' must be a list of token ids"),
            ("/detokenize", {"tokens": [True]}, "'tokens' must be a list of token ids"),
            ("/detokenize", {"tokens": [2**63]}, "'tokens' must be a list of token ids")):
        status, body = await engine.post(path, body)
        assert status == 400 and needle in body["error"]["message"], (path, body)
        assert body["error"]["type"] == "invalid_request_error" and body["error"]["code"] == 400
    status, body = await engine.post("/detokenize", {"tokens": [5]})
    if engine.tokenizer is None:
        assert status == 400 and "is not a text token" in body["error"]["message"]
    else:
        assert status == 200
        status, body = await engine.post("/detokenize", {"tokens": [1, 10**6]})
        assert status == 400 and body["error"]["message"] == "Token id 1000000 is out of vocabulary"
    for alias in ("llama-alias", "sql"):  # a served name, a LoRA adapter
        status, _ = await engine.post("/tokenize", {"model": alias, "prompt": "x"})
        assert status == 200
    assert engine.server.requests_by_model == {"llama": 1, "llama-alias": 1, "sql": 1} if engine.tokenizer else \
        {"llama-alias": 1, "sql": 1}


async def test_every_route_refuses_an_unknown_model_and_bad_json(engine):
    for path in ROUTES:
        status, body = await engine.post(path, {**BODIES[path], "model": "gpt-x"})
        assert status == 404 and body == {"error": {"message": "The model `gpt-x` does not exist.",
                                                    "type": "NotFoundError", "param": None, "code": 404}}
        async with engine.http.post(engine.url + path, data=b"{nope", headers={"Content-Type": "application/json"}) as r:
            assert r.status == 400 and "not valid JSON" in (await r.json())["error"]["message"]
        status, body = await engine.post(path, {**BODIES[path], "model": 7})
        assert status == 400 and body["error"]["message"] == "'model' must be a string"
        status, _ = await engine.post(path, BODIES[path])  # no model: the base model
        assert status == 200, path
    text = await engine.metrics()
    assert metric_value(text, "prefixroute_engine_model_not_served_total", model_name="gpt-x") == len(ROUTES)
    assert metric_value(text, "prefixroute_engine_requests_total", model_name="llama") == len(ROUTES)


# -- /v1/responses ---------------------------------------------------------------------------


async def test_responses_run_as_chat_through_the_prefix_cache(engine):
    body = {"model": "llama", "instructions": DOC, "input": "first question", "max_output_tokens": 3}
    hits0 = await engine.hits()
    status, first = await engine.post("/v1/responses", body)
    assert status == 200
    assert first["object"] == "response" and first["id"].startswith("resp_") and first["status"] == "completed"
    assert first["model"] == "llama" and first["instructions"] == DOC and first["max_output_tokens"] == 3
    assert first["incomplete_details"] is None and first["previous_response_id"] is None and first["tools"] == []
    [message] = first["output"]
    assert message["type"] == "message" and message["role"] == "assistant" and message["status"] == "completed"
    assert message["id"].startswith("msg_")
    [part] = message["content"]
    assert part["type"] == "output_text" and part["text"] and part["annotations"] == []
    usage = first["usage"]
    assert usage["output_tokens"] == 3 and usage["total_tokens"] == usage["input_tokens"] + 3
    assert usage["input_tokens_details"] == {"cached_tokens": 0} and usage["output_tokens_details"] == {
        "reasoning_tokens": 0}

    # the same request's prompt as a chat request: instructions a system message, input a user one
    _, tok = await engine.post("/tokenize", {"messages": _messages("first question")})
    assert usage["input_tokens"] == tok["count"]
    status, second = await engine.post("/v1/responses", {**body, "input": [
        {"role": "user", "content": [{"type": "input_text", "text": "second question"}]}]})
    cached = second["usage"]["input_tokens_details"]["cached_tokens"]
    assert status == 200 and cached >= engine.server.config.block_size * (count_tokens(DOC) // 20)  # the document
    assert cached % engine.server.config.block_size == 0 and cached < second["usage"]["input_tokens"]
    _, again = await engine.post("/v1/responses", body)
    assert again["output"][0]["content"][0]["text"] == part["text"]  # same prompt, same answer
    block = engine.server.config.block_size  # a full hit: every full block but the one with the last token
    assert again["usage"]["input_tokens_details"]["cached_tokens"] == block * ((usage["input_tokens"] - 1) // block)
    text = await engine.metrics()
    assert metric_value(text, "vllm:prefix_cache_hits_total") - hits0 == \
        cached + again["usage"]["input_tokens_details"]["cached_tokens"]
    assert metric_value(text, "vllm:time_to_first_token_seconds_count", model_name="llama") == 3
    assert metric_value(text, "vllm:generation_tokens_total") == 9
    assert metric_value(text, "vllm:request_success_total", finished_reason="length") == 3
    assert metric_value(text, "prefixroute_engine_requests_total", model_name="llama") == 4  # (and /tokenize)


async def test_responses_stream_the_responses_api_events(engine):
    body = {"model": "sql", "input": "stream it", "max_output_tokens": 4, "stream": True, "temperature": 0.2,
            "metadata": {"k": "v"}}
    async with engine.http.post(engine.url + "/v1/responses", json=body) as r:
        assert r.status == 200 and r.headers["Content-Type"].startswith("text/event-stream")
        raw = await r.read()
    assert b"[DONE]" not in raw
    events = []
    for block in raw.decode().split("\n\n")[:-1]:
        head, data = block.split("\n")
        assert head.startswith("event: ") and data.startswith("data: ")
        event = orjson.loads(data[6:])
        assert event["type"] == head[7:]
        events.append(event)
    kinds = [e["type"] for e in events]
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added"] + ["response.output_text.delta"] * 4 + [
        "response.output_text.done", "response.content_part.done", "response.output_item.done", "response.completed"]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    created, completed = events[0]["response"], events[-1]["response"]
    assert created["status"] == "in_progress" and created["output"] == [] and created["usage"] is None
    assert created["id"] == completed["id"] and created["model"] == completed["model"] == "sql"
    assert completed["status"] == "completed" and completed["temperature"] == 0.2 and completed["metadata"] == {"k": "v"}
    item_id = events[2]["item"]["id"]
    assert events[2]["item"] == {"id": item_id, "type": "message", "role": "assistant", "status": "in_progress",
                                 "content": []}
    text = "".join(e["delta"] for e in events[4:8])
    assert all(e["item_id"] == item_id and e["output_index"] == 0 and e["content_index"] == 0 for e in events[3:10])
    assert events[8]["text"] == text and events[9]["part"]["text"] == text
    assert events[10]["item"] == completed["output"][0] and completed["output"][0]["content"][0]["text"] == text
    assert completed["usage"]["output_tokens"] == 4
    assert engine.server.requests_by_model == {"sql": 1}
    assert await eventually(lambda: engine.server.num_in_flight == 0)


async def test_the_openai_client_reads_responses(engine):
    client = openai.OpenAI(base_url=engine.url + "/v1", api_key="x", max_retries=0, timeout=20)

    def run():
        answer = client.responses.create(model="llama", instructions="Be brief.", input="hello", max_output_tokens=3)
        with client.responses.stream(model="llama", input="hello", max_output_tokens=3) as stream:
            kinds = [e.type for e in stream]
            final = stream.get_final_response()
        return answer, kinds, final

    answer, kinds, final = await asyncio.to_thread(run)
    assert answer.status == "completed" and answer.output_text and answer.usage.output_tokens == 3
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed" and final.output_text


async def test_responses_errors_are_vllms(engine):
    for body, status, needle in (
            ({"input": "q", "stream": "yes"}, 400, "'stream' must be a boolean"),
            ({"input": "q", "max_output_tokens": 0}, 400, "'max_output_tokens' must be an integer >= 1"),
            ({"input": "q", "max_output_tokens": "9"}, 400, "'max_output_tokens'"),
            ({"instructions": "x"}, 400, "'input' is required"),
            ({"input": "q", "instructions": 3}, 400, "'instructions' must be a string"),
            ({"input": [3]}, 400, "each 'input' item must be a string or an object"),
            ({"input": "q", "background": True}, 400, "does not support the background mode"),
            ({"input": "q", "background": True, "store": False}, 400, "background can only be used when `store`"),
            ({"input": "q", "prompt": {"id": "p"}}, 400, "prompt template is not supported"),
            ({"input": "q", "max_output_tokens": 40000}, 400, "maximum context length is 32768"),
            ({"input": "q", "previous_response_id": "resp_1"}, 404, "Response with id 'resp_1' not found.")):
        got, answer = await engine.post("/v1/responses", {"model": "llama", **body})
        assert got == status and needle in answer["error"]["message"], (body, answer)
        assert answer["error"]["code"] == status and answer["error"]["type"] == "invalid_request_error"
    assert engine.server.requests_by_model == {} and engine.server.num_in_flight == 0


async def test_a_client_leaving_a_response_stream_aborts_it():
    runner, port = await start_engine_server(EngineConfig(model="m"), time_scale=1.0)
    server = runner.app[ENGINE_KEY]
    try:
        async with aiohttp.ClientSession() as http:
            async with http.post(f"http://127.0.0.1:{port}/v1/responses",
                                 json={"input": "q", "stream": True, "max_output_tokens": 5000}) as r:
                assert (await r.content.readline()).startswith(b"event: response.created")
                assert server.num_in_flight == 1
        assert await eventually(lambda: server.num_in_flight == 0 and not server.core.has_work())
    finally:
        await runner.cleanup()


# -- /v1/score, /v1/rerank -------------------------------------------------------------------


def _pair_tokens(engine, a: str, b: str) -> int:
    text = a + "\n" + b
    return count_tokens(text) if engine.tokenizer is None else len(engine.tokenizer.encode(text))


async def test_score_pairs_as_vllm(engine):
    status, one_n = await engine.post("/v1/score", {"model": "llama", "text_1": "the cat sat",
                                                    "text_2": ["a cat sat here", "dogs bark", "the cat sat"]})
    assert status == 200 and one_n["object"] == "list" and one_n["id"].startswith("score-") and one_n["model"] == "llama"
    scores = [d["score"] for d in one_n["data"]]
    assert [(d["index"], d["object"]) for d in one_n["data"]] == [(0, "score"), (1, "score"), (2, "score")]
    assert scores == [relevance_score("the cat sat", t) for t in ("a cat sat here", "dogs bark", "the cat sat")]
    assert all(0.0 <= s < 1.0 for s in scores) and scores[2] > scores[0] > scores[1]  # word overlap ranks
    tokens = sum(_pair_tokens(engine, "the cat sat", t) for t in ("a cat sat here", "dogs bark", "the cat sat"))
    assert one_n["usage"]["prompt_tokens"] == one_n["usage"]["total_tokens"] == tokens
    assert one_n["usage"]["completion_tokens"] == 0

    _, n_n = await engine.post("/v1/score", {"model": "llama", "text_1": ["the cat sat", "dogs"],
                                             "text_2": ["dogs bark", "dogs bark"]})
    assert [d["score"] for d in n_n["data"]] == [relevance_score("the cat sat", "dogs bark"),
                                                 relevance_score("dogs", "dogs bark")]
    _, one = await engine.post("/score", {"text_1": "x", "text_2": "y"})  # vLLM's alias
    assert [d["index"] for d in one["data"]] == [0]
    _, docs = await engine.post("/v1/score", {"queries": "the cat sat", "documents": ["dogs bark"]})  # newer names
    assert docs["data"][0]["score"] == scores[1]
    for body, needle in (({"text_1": ["a", "b"], "text_2": ["a", "b", "c"]}, "Input lengths must be either 1:1, 1:N or N:N"),
                         ({"text_1": [], "text_2": "a"}, "At least one text element must be given"),
                         ({"text_1": "a", "text_2": []}, "At least one text_pair element must be given"),
                         ({"text_1": "a"}, "'text_1' and 'text_2' are required"),
                         ({"text_1": 3, "text_2": "a"}, "'text_1' must be a string")):
        status, answer = await engine.post("/v1/score", body)
        assert status == 400 and needle in answer["error"]["message"], (body, answer)
    assert engine.server.requests_by_model == {"llama": 4}  # one per request, not per pair


async def test_rerank_as_vllm(engine):
    documents = ["dogs bark at night", "the cat sat on the mat", "a cat", {"text": "cats and the mat"}]
    status, full = await engine.post("/v1/rerank", {"model": "llama", "query": "the cat on the mat",
                                                    "documents": documents})
    assert status == 200 and full["id"].startswith("rerank-") and full["model"] == "llama"
    texts = [d if isinstance(d, str) else d["text"] for d in documents]
    expected = sorted(((relevance_score("the cat on the mat", t), i) for i, t in enumerate(texts)), reverse=True)
    assert [(r["relevance_score"], r["index"]) for r in full["results"]] == expected
    assert full["results"][0]["index"] == 1 and full["results"][-1]["index"] == 0
    assert all(r["document"] == {"text": texts[r["index"]], "multi_modal": None} for r in full["results"])
    tokens = sum(_pair_tokens(engine, "the cat on the mat", t) for t in texts)
    assert full["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens}
    _, top = await engine.post("/v1/rerank", {"model": "llama", "query": "the cat on the mat", "documents": documents,
                                              "top_n": 2})
    assert top["results"] == full["results"][:2]
    for alias in ("/rerank", "/v2/rerank"):
        status, answer = await engine.post(alias, {"model": "sql", "query": "q", "documents": ["d"]})
        assert status == 200 and answer["model"] == "sql" and len(answer["results"]) == 1
    for body, needle in (({"query": "q"}, "'query' and 'documents' are required"),
                         ({"query": "q", "documents": "d"}, "'documents' must be a list"),
                         ({"query": "q", "documents": []}, "At least one text_pair element must be given"),
                         ({"query": "q", "documents": [1]}, "'documents' must be a string or a list of strings"),
                         ({"query": ["q"], "documents": ["d"]}, "'query' must be a string"),
                         ({"query": "q", "documents": ["d"], "top_n": "2"}, "'top_n' must be an integer")):
        status, answer = await engine.post("/v1/rerank", {"model": "llama", **body})
        assert status == 400 and needle in answer["error"]["message"], (body, answer)
    text = await engine.metrics()
    assert metric_value(text, "prefixroute_engine_requests_total", model_name="llama") == 2
    assert metric_value(text, "prefixroute_engine_requests_total", model_name="sql") == 2


async def test_score_and_rerank_prefill_through_the_prefix_cache(engine):
    block = engine.server.config.block_size
    body = {"model": "llama", "query": DOC, "documents": ["first document", "second document"]}
    _, cold = await engine.post("/v1/rerank", body)
    hits0 = await engine.hits()
    _, warm = await engine.post("/v1/rerank", {**body, "documents": ["third document"]})
    hits = await engine.hits() - hits0
    assert hits >= block * ((warm["usage"]["prompt_tokens"] - 8) // block)  # the query's blocks, cached
    assert hits % block == 0 and hits < warm["usage"]["prompt_tokens"]
    status, scored = await engine.post("/v1/score", {"model": "llama", "text_1": DOC, "text_2": ["fourth", "fifth"]})
    assert status == 200 and scored["usage"]["prompt_tokens_details"]["cached_tokens"] >= 2 * hits
    assert engine.server.requests_by_model == {"llama": 3} and engine.server.num_in_flight == 0
    assert cold["usage"]["prompt_tokens"] > warm["usage"]["prompt_tokens"]


async def test_a_prompt_longer_than_the_model_is_a_400():
    runner, port = await start_engine_server(EngineConfig(model="m", max_model_len=64), time_scale=0.0)
    try:
        async with aiohttp.ClientSession() as http:
            for path, body in (("/v1/rerank", {"query": DOC, "documents": ["a", "b"]}),
                               ("/v1/score", {"text_1": "a", "text_2": ["b", DOC]}),
                               ("/v1/responses", {"input": DOC})):
                async with http.post(f"http://127.0.0.1:{port}{path}", json=body) as r:
                    assert r.status == 400 and "maximum context length is 64 tokens" in (await r.json())["error"]["message"]
        assert runner.app[ENGINE_KEY].num_in_flight == 0 and runner.app[ENGINE_KEY].requests_by_model == {}
    finally:
        await runner.cleanup()
