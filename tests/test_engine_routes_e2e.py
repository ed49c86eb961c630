"""End to end as a user runs it: ``prefixroute serve`` in front of two ``prefixroute
emulate`` processes serving different models (the router learns them from the engines'
``/v1/models``). Each of ``/tokenize``, ``/detokenize``, ``/v1/responses`` (streamed too),
``/v1/score`` and ``/v1/rerank`` reaches an engine of the model its body names and
answers 200, on both data planes; the engines' own counters show nothing reached the
wrong one."""

from __future__ import annotations

import aiohttp
import orjson
import pytest

from prefixroute.demo.processes import ProcessGroup

pytestmark = pytest.mark.e2e

DOC = "The instructions every request of this test shares, long enough to fill KV blocks. " * 20
MODELS = ("llama", "qwen")


def _bodies(model: str) -> dict[str, dict]:
    return {
        "/tokenize": {"model": model, "prompt": DOC},
        "/detokenize": {"model": model, "tokens": [0]},  # (set from /tokenize's answer below)
        "/v1/responses": {"model": model, "instructions": DOC, "input": "a question", "max_output_tokens": 3},
        "/v1/score": {"model": model, "text_1": DOC, "text_2": ["one", "two"]},
        "/v1/rerank": {"model": model, "query": DOC, "documents": ["one", "two", "three"], "top_n": 2},
    }


@pytest.fixture(scope="module")
def engines():
    """Two emulated engines, ``llama`` and ``qwen``: ``{model: (url, instance id)}``."""
    with ProcessGroup() as group:
        started = {m: group.start(m, ["emulate", "--port", "0", "--time-scale", "0", "--model", m,
                                      "--instance-id", f"engine-{m}"]) for m in MODELS}
        yield {m: (c.url, f"engine-{m}") for m, c in started.items()}


async def _info(http: aiohttp.ClientSession, url: str) -> dict:
    async with http.get(url + "/info") as r:
        return await r.json()


async def test_each_route_reaches_an_engine_of_its_model_through_serve(engines, data_plane):
    urls = [engines[m][0] for m in MODELS]
    async with aiohttp.ClientSession() as http:
        before = {m: (await _info(http, engines[m][0]))["requests_by_model"] for m in MODELS}
        with ProcessGroup() as group:
            router = group.start("router", ["serve", "--port", "0", "--admin-port", "0", "--backend", urls[0],
                                            "--backend", urls[1], "--strategy", "prefix-aware", "--prefix-length",
                                            "1024", "--concurrency-threshold", "8", "--data-plane", data_plane,
                                            "--health-check-interval", "0", "--metrics-scrape-interval", "0"])
            for model in MODELS:
                url, instance = engines[model]
                bodies = _bodies(model)
                for path, body in bodies.items():
                    async with http.post(router.url + path, json=body) as r:
                        answer = await r.json()
                        assert r.status == 200, (path, model, answer)
                        assert r.headers["X-Prefixroute-Instance"] == url
                        assert r.headers["X-Emulated-Instance"] == instance
                    if path == "/v1/responses":
                        assert answer["model"] == model and answer["output"][0]["content"][0]["text"]
                    elif path == "/v1/rerank":
                        assert answer["model"] == model and len(answer["results"]) == 2
                    elif path == "/v1/score":
                        assert answer["model"] == model and [d["index"] for d in answer["data"]] == [0, 1]
                    elif path == "/tokenize":  # the 4-byte rule: 4 characters a token
                        assert answer["count"] == len(answer["tokens"]) == len(DOC) // 4
                        bodies["/detokenize"]["tokens"] = answer["tokens"][:8]
                    else:
                        assert answer == {"prompt": DOC[:32]}
                # the same instructions again, streamed: the engine's prefix cache has them
                async with http.post(router.url + "/v1/responses",
                                     json={**_bodies(model)["/v1/responses"], "stream": True}) as r:
                    assert r.status == 200 and r.headers["X-Prefixroute-Instance"] == url
                    raw = await r.read()
                events = [orjson.loads(block.split("\ndata: ", 1)[1]) for block in raw.decode().split("\n\n")[:-1]]
                assert events[0]["type"] == "response.created" and events[-1]["type"] == "response.completed"
                usage = events[-1]["response"]["usage"]
                assert usage["input_tokens_details"]["cached_tokens"] >= len(DOC) // 4 // 2
            async with http.post(router.url + "/v1/rerank", json={**_bodies("x")["/v1/rerank"]}) as r:
                assert r.status == 404 and (await r.json())["error"]["code"] == "model_not_found"
        for model in MODELS:
            info = await _info(http, engines[model][0])
            counted = {k: v - before[model].get(k, 0) for k, v in info["requests_by_model"].items()}
            assert counted == {model: 6}  # five routes and the stream, nothing for the other model
            assert info["model_not_served"] == {}
