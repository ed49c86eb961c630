"""vLLM's other OpenAI-compatible routes on the emulated engine, beside chat,
completions and embeddings (:mod:`prefixroute.engine.server`):

=======================================  ================================================
``POST /tokenize``                       ``{"model", "prompt"}`` or ``{"model",
                                         "messages"}`` -> ``{"count", "max_model_len",
                                         "tokens", "token_strs"}``: the engine's own
                                         tokenizer, the prompt it would prefill
``POST /detokenize``                     ``{"model", "tokens"}`` -> ``{"prompt"}``
``POST /v1/responses``                   the Responses API: run through the engine as a
                                         chat request (prefix cache, TTFT, metrics);
                                         ``stream`` answers with its typed events
``POST /v1/score`` (and ``/score``)      ``text_1`` / ``text_2`` pairs (1:1, 1:N, N:N) ->
                                         ``data`` of ``{"index", "score"}``
``POST /v1/rerank`` (``/rerank``,        ``query`` / ``documents`` / ``top_n`` ->
``/v2/rerank``)                          ``results`` of ``{"index", "document",
                                         "relevance_score"}``, best first
=======================================  ================================================

The request and answer shapes are vLLM's (``vllm/entrypoints/serve/tokenize/protocol.py``,
``vllm/entrypoints/openai/responses/``, ``vllm/entrypoints/pooling/score/protocol.py``).
Every route checks ``model`` as the others do: a served name or a loaded LoRA adapter,
else vLLM's 404 (counted in ``prefixroute_engine_model_not_served_total``); a malformed
body is a 400 in vLLM's error shape. Every accepted request is counted in
``prefixroute_engine_requests_total`` under the name it asked for.

What is emulated:

* ``/tokenize`` gives exactly the ids the engine prefills: with ``messages`` (and the
  default ``add_generation_prompt``), those of the same chat request; with ``prompt``,
  those of the same completions request. ``add_special_tokens`` defaults as vLLM's (true
  for a prompt, false for messages, whose template writes the BOS); the 4-byte rule
  has no special tokens.
* ``/v1/responses``: ``instructions`` becomes a system message and ``input`` (a string
  or a list of items) chat messages, exactly as the router keys the route
  (:func:`prefixroute.core.openai_routes.keyed_view`), so the engine's prompt begins
  with what the router routed on. ``max_output_tokens`` defaults to 16 tokens, as
  ``max_tokens`` does on chat. As vLLM without ``VLLM_ENABLE_RESPONSES_API_STORE``:
  ``store`` is ignored, ``previous_response_id`` is a 404 (no response is stored),
  ``background`` a 400; ``status`` is ``completed``. Tools are accepted and rendered
  into the prompt, never called.
* ``/v1/score`` and ``/v1/rerank``: each (text_1, text_2) pair is prefilled as one
  prompt, ``text_1 + "\\n" + text_2`` (a cross-encoder reads a pair as one sequence),
  through the prefix cache as embeddings are, so the pairs of one query share its
  blocks; a real cross-encoder's bidirectional attention runs in vLLM without prefix
  caching. Scores are deterministic, in [0, 1): the Jaccard overlap of the two texts'
  lower-cased words x 0.9 plus a hash of the pair x 0.1.
"""

from __future__ import annotations

import itertools
import re
import time
import uuid
from collections.abc import Awaitable, Sequence
from typing import TYPE_CHECKING, Any

import orjson
import xxhash
from aiohttp import web

from prefixroute.core.routing_text import InvalidRequest, render_chat_text
from prefixroute.core.openai_routes import OpenAIRoute, keyed_view
from prefixroute.engine.http_common import (DEFAULT_MAX_TOKENS, GENERATION_PROMPT, ClientError, InFlight, Job,
                                            chat_prompt_text, error_response)
from prefixroute.engine.tokenizer import TokenizedPrompt, decode, encode, from_token_ids, tokenize_text

if TYPE_CHECKING:
    from prefixroute.core.model_tokenizer import ModelTokenizer
    from prefixroute.engine.core import RequestOutput
    from prefixroute.engine.model import EngineConfig

__all__ = ["PAIR_SEPARATOR", "ExtraRoutes", "relevance_score"]

#: Between the two texts of a score or rerank pair in the prompt the engine prefills.
PAIR_SEPARATOR = "\n"
_MAX_TOKEN_ID = 2**63 - 1  # vLLM's bound on a /detokenize id
_WORDS = re.compile(r"\w+")
_SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}


def relevance_score(first: str, second: str) -> float:
    """The emulated cross-encoder's score of a pair, deterministic, in [0, 1): the
    Jaccard overlap of their lower-cased words x 0.9 plus a hash of the pair x 0.1."""
    a, b = set(_WORDS.findall(first.lower())), set(_WORDS.findall(second.lower()))
    union = a | b
    overlap = len(a & b) / len(union) if union else 0.0
    digest = xxhash.xxh3_64_intdigest(f"{first}\0{second}".encode("utf-8", "surrogatepass"))
    return round(0.9 * overlap + 0.1 * digest / 2**64, 6)


def _flag(payload: dict[str, Any], name: str, default: bool) -> bool:
    value = payload.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ClientError(400, f"'{name}' must be a boolean")
    return value


def _text(value: Any, what: str) -> str:
    """A query, document or score text: a string, or an object with a string ``text``."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("text"), str):
        return value["text"]
    raise ClientError(400, f"{what} must be a string or a list of strings")


def _texts(value: Any, what: str) -> list[str]:
    return [_text(v, what) for v in value] if isinstance(value, list) else [_text(value, what)]


def _pairs(firsts: list[str], seconds: list[str]) -> list[tuple[str, str]]:
    """vLLM's pairing of score inputs: 1:1, 1:N (the one first text with each second) or N:N.

    Raises:
        ClientError: 400 with vLLM's messages for empty inputs or other lengths.
    """
    if not firsts:
        raise ClientError(400, "At least one text element must be given")
    if not seconds:
        raise ClientError(400, "At least one text_pair element must be given")
    if len(firsts) > 1 and len(firsts) != len(seconds):
        raise ClientError(400, "Input lengths must be either 1:1, 1:N or N:N")
    if len(firsts) == 1:
        firsts = firsts * len(seconds)
    return list(zip(firsts, seconds))


def _number(value: Any, default: float) -> float:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else default


class ExtraRoutes:
    """The routes of this module, as a mixin of
    :class:`~prefixroute.engine.server.EngineServer` (whose request plumbing they use);
    :meth:`add_extra_routes` registers them."""

    if TYPE_CHECKING:  # provided by EngineServer
        config: EngineConfig
        tokenizer: ModelTokenizer | None
        requests_by_model: dict[str, int]

        async def _read_json(self, request: web.Request) -> dict[str, Any]: ...
        def _resolve_model(self, model: Any) -> str | None: ...
        def _submit(self, request_id: str, job: Job) -> InFlight: ...
        def _release(self, request_id: str) -> None: ...
        async def _released(self, rid: str, answer: Awaitable[web.StreamResponse]) -> web.StreamResponse: ...
        def _count(self, job: Job) -> None: ...
        async def _next(self, entry: InFlight) -> RequestOutput: ...
        async def _whole_answer(self, entry: InFlight) -> tuple[str, RequestOutput]: ...
        def _decode(self, token_ids: Sequence[int]) -> str: ...

    def add_extra_routes(self, app: web.Application) -> None:
        """Register ``/tokenize``, ``/detokenize``, ``/v1/responses``, the score and
        rerank routes (with vLLM's aliases ``/score``, ``/rerank``, ``/v2/rerank``)."""
        app.router.add_post("/tokenize", self._tokenize)
        app.router.add_post("/detokenize", self._detokenize)
        app.router.add_post("/v1/responses", self._responses)
        for path in ("/v1/score", "/score"):
            app.router.add_post(path, self._score)
        for path in ("/v1/rerank", "/rerank", "/v2/rerank"):
            app.router.add_post(path, self._rerank)

    # -- shared ------------------------------------------------------------------------

    def _model_of(self, payload: dict[str, Any]) -> tuple[str | None, str]:
        """``(adapter or None, the name answers carry)``; errors as ``_resolve_model``."""
        lora = self._resolve_model(payload.get("model"))
        model = payload.get("model")
        return lora, lora or (model if isinstance(model, str) else self.config.model)

    def _count_name(self, model: str) -> None:
        self.requests_by_model[model] = self.requests_by_model.get(model, 0) + 1

    def _text_ids(self, text: str, add_special_tokens: bool) -> list[int]:
        if self.tokenizer is None:
            return encode(text)
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def _text_prompt(self, text: str) -> TokenizedPrompt:
        """A text prompt as a completions request's is prefilled (special tokens added)."""
        if self.tokenizer is None:
            return tokenize_text(text)
        return from_token_ids(self.tokenizer.encode(text, add_special_tokens=True))

    def _chat_prompt(self, payload: dict[str, Any]) -> TokenizedPrompt:
        """A chat body's prompt, as ``/v1/chat/completions`` prefills it.

        Raises:
            InvalidRequest: malformed messages, or a tokenizer without a chat template.
        """
        if self.tokenizer is None:
            return tokenize_text(chat_prompt_text(payload, self.config.image_tokens))
        return from_token_ids(self.tokenizer.chat_token_ids(payload))

    async def _prefill(self, prompts: list[TokenizedPrompt], lora: str | None, model: str,
                       prefix: str) -> list[RequestOutput]:
        """Prefill every prompt (one step of output each, as embeddings are) and wait
        for all; the HTTP request is counted once. Raises ClientError (a prompt too long)."""
        jobs = [Job(p, 1, False, False, lora, model) for p in prompts]
        base = f"{prefix}-{uuid.uuid4().hex}"
        entries: list[tuple[str, InFlight]] = []
        try:
            for i, job in enumerate(jobs):
                rid = f"{base}-{i}"
                entries.append((rid, self._submit(rid, job)))
            self._count(jobs[0])
            return [(await self._whole_answer(e))[1] for _, e in entries]
        finally:
            for rid, _ in entries:
                self._release(rid)

    # -- /tokenize, /detokenize --------------------------------------------------------

    async def _tokenize(self, request: web.Request) -> web.Response:
        try:
            payload = await self._read_json(request)
            _, model = self._model_of(payload)
            chat = "messages" in payload
            add_special = _flag(payload, "add_special_tokens", not chat)
            want_strings = _flag(payload, "return_token_strs", False)
            if chat:
                ids = self._chat_ids(payload, add_special)
            else:
                prompt = payload.get("prompt")
                if not isinstance(prompt, str):
                    raise ClientError(400, "'prompt' (a string) or 'messages' is required")
                ids = self._text_ids(prompt, add_special)
        except ClientError as exc:
            return error_response(exc.status, str(exc), exc.type)
        except InvalidRequest as exc:
            return error_response(400, str(exc))
        self._count_name(model)
        strings = None
        if want_strings:
            strings = (self.tokenizer.token_strings(ids) if self.tokenizer is not None
                       else [decode([i]) for i in ids])
        body = {"count": len(ids), "max_model_len": self.config.max_model_len, "tokens": ids, "token_strs": strings}
        return web.Response(body=orjson.dumps(body), content_type="application/json")

    def _chat_ids(self, payload: dict[str, Any], add_special_tokens: bool) -> list[int]:
        """Token ids of ``messages`` as the engine prefills a chat request (with
        ``add_generation_prompt``, default true). Raises InvalidRequest, ClientError."""
        generation = _flag(payload, "add_generation_prompt", True)
        if payload.get("continue_final_message") and payload.get("add_generation_prompt"):
            raise ClientError(400, "Cannot set both `continue_final_message` and `add_generation_prompt` to True.")
        if self.tokenizer is None:
            text = render_chat_text(payload, media_chars=self.config.image_tokens * 4)
            return encode(text + GENERATION_PROMPT if generation else text)
        return self.tokenizer.encode(self.tokenizer.render_chat(payload), add_special_tokens=add_special_tokens)

    async def _detokenize(self, request: web.Request) -> web.Response:
        try:
            payload = await self._read_json(request)
            _, model = self._model_of(payload)
            tokens = payload.get("tokens")
            if not isinstance(tokens, list) or not all(
                    isinstance(t, int) and not isinstance(t, bool) and 0 <= t <= _MAX_TOKEN_ID for t in tokens):
                raise ClientError(400, "'tokens' must be a list of token ids (integers from 0 to 2**63-1)")
            if self.tokenizer is None:
                try:
                    text = decode(tokens)
                except ValueError as exc:
                    raise ClientError(400, str(exc)) from None
            else:
                unknown = next((t for t in tokens if t >= self.tokenizer.vocab_size), None)
                if unknown is not None:
                    raise ClientError(400, f"Token id {unknown} is out of vocabulary")
                text = self.tokenizer.decode(tokens, skip_special_tokens=False)
        except ClientError as exc:
            return error_response(exc.status, str(exc), exc.type)
        self._count_name(model)
        return web.Response(body=orjson.dumps({"prompt": text}), content_type="application/json")

    # -- /v1/responses -----------------------------------------------------------------

    async def _responses(self, request: web.Request) -> web.StreamResponse:
        try:
            payload = await self._read_json(request)
            lora, model = self._model_of(payload)
            job = self._responses_job(payload, lora, model)
            rid = "resp_" + uuid.uuid4().hex
            entry = self._submit(rid, job)
            self._count(job)
        except ClientError as exc:
            return error_response(exc.status, str(exc), exc.type)
        return await self._released(rid, self._responses_stream(request, rid, job, entry, payload) if job.stream
                                    else self._responses_json(rid, job, entry, payload))

    def _responses_job(self, payload: dict[str, Any], lora: str | None, model: str) -> Job:
        """Check a Responses request as vLLM does and make its job. Raises ClientError."""
        stream = _flag(payload, "stream", False)
        max_tokens = payload.get("max_output_tokens")
        if max_tokens is None:
            max_tokens = DEFAULT_MAX_TOKENS
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
            raise ClientError(400, f"'max_output_tokens' must be an integer >= 1, got {max_tokens!r}")
        if payload.get("prompt") is not None:
            raise ClientError(400, "prompt template is not supported")
        if payload.get("background"):
            if payload.get("store", True) is False:
                raise ClientError(400, "background can only be used when `store` is true")
            raise ClientError(400, "This vLLM engine does not support `store=True` and therefore does not support "
                                   "the background mode. To enable these features, set the environment variable "
                                   "`VLLM_ENABLE_RESPONSES_API_STORE=1` when launching the vLLM server.")
        previous = payload.get("previous_response_id")
        if previous is not None:  # nothing is stored (vLLM's default), so nothing is found
            raise ClientError(404, f"Response with id '{previous}' not found.", "invalid_request_error")
        try:
            view, _ = keyed_view(payload, OpenAIRoute.RESPONSES)
            prompt = self._chat_prompt(dict(view))
        except InvalidRequest as exc:
            raise ClientError(400, str(exc)) from None
        return Job(prompt, max_tokens, stream, False, lora, model)

    def _response(self, rid: str, created: int, job: Job, payload: dict[str, Any], status: str,
                  output: list[dict[str, Any]], usage: dict[str, Any] | None) -> dict[str, Any]:
        """vLLM's ``ResponsesResponse``: the request's settings echoed, the output, usage."""
        tools = payload.get("tools")
        return {
            "id": rid, "created_at": created, "incomplete_details": None,
            "instructions": payload.get("instructions"), "metadata": payload.get("metadata"), "model": job.model,
            "object": "response", "output": output,
            "parallel_tool_calls": payload.get("parallel_tool_calls") is not False,
            "temperature": _number(payload.get("temperature"), 1.0), "tool_choice": payload.get("tool_choice", "auto"),
            "tools": tools if isinstance(tools, list) else [], "top_p": _number(payload.get("top_p"), 1.0),
            "background": False, "max_output_tokens": job.max_tokens, "max_tool_calls": payload.get("max_tool_calls"),
            "previous_response_id": None, "prompt": None, "reasoning": payload.get("reasoning"),
            "service_tier": payload.get("service_tier") or "auto", "status": status, "text": payload.get("text"),
            "top_logprobs": None, "truncation": payload.get("truncation") or "disabled", "usage": usage,
            "user": payload.get("user"),
        }

    @staticmethod
    def _responses_usage(o: RequestOutput) -> dict[str, Any]:
        return {"input_tokens": o.prompt_tokens, "input_tokens_details": {"cached_tokens": o.cached_tokens},
                "output_tokens": o.num_output_tokens, "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": o.prompt_tokens + o.num_output_tokens}

    @staticmethod
    def _message(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
        content = [{"type": "output_text", "text": text, "annotations": [], "logprobs": None}] if text else []
        return {"id": item_id, "type": "message", "role": "assistant", "status": status, "content": content}

    async def _responses_json(self, rid: str, job: Job, entry: InFlight, payload: dict[str, Any]) -> web.Response:
        text, o = await self._whole_answer(entry)
        output = [self._message("msg_" + uuid.uuid4().hex, text)] if text else []
        body = self._response(rid, int(time.time()), job, payload, "completed", output, self._responses_usage(o))
        return web.Response(body=orjson.dumps(body), content_type="application/json")

    async def _responses_stream(self, request: web.Request, rid: str, job: Job, entry: InFlight,
                                payload: dict[str, Any]) -> web.StreamResponse:
        """The Responses API's events, each ``event: TYPE`` + ``data: JSON`` with a
        ``sequence_number`` from 0: ``response.created``, ``response.in_progress``, then
        with the first token ``response.output_item.added`` and
        ``response.content_part.added``, one ``response.output_text.delta`` per step's
        tokens, then ``response.output_text.done``, ``response.content_part.done``,
        ``response.output_item.done`` and ``response.completed`` (no ``[DONE]``)."""
        resp = web.StreamResponse(headers=_SSE_HEADERS)
        await resp.prepare(request)
        created = int(time.time())
        sequence = itertools.count()
        item_id = "msg_" + uuid.uuid4().hex
        where = {"item_id": item_id, "output_index": 0, "content_index": 0}

        def event(kind: str, **fields: Any) -> bytes:
            data = {"type": kind, "sequence_number": next(sequence), **fields}
            return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"

        try:
            initial = self._response(rid, created, job, payload, "in_progress", [], None)
            await resp.write(event("response.created", response=initial) +
                             event("response.in_progress", response=initial))
            deltas: list[str] = []
            while True:
                try:
                    o = await self._next(entry)
                except web.HTTPInternalServerError:
                    await resp.write(event("error", code="server_error", message="engine step failed", param=None))
                    return resp
                parts: list[bytes] = []
                if o.new_token_ids:
                    delta = self._decode(o.new_token_ids)
                    if not deltas:
                        parts.append(event("response.output_item.added", output_index=0,
                                           item=self._message(item_id, "", "in_progress")))
                        parts.append(event("response.content_part.added", **where, part={
                            "type": "output_text", "text": "", "annotations": [], "logprobs": []}))
                    deltas.append(delta)
                    parts.append(event("response.output_text.delta", **where, delta=delta, logprobs=[]))
                if o.finished:
                    text = "".join(deltas)
                    part = {"type": "output_text", "text": text, "annotations": [], "logprobs": None}
                    output = [self._message(item_id, text)] if deltas else []
                    if deltas:
                        parts.append(event("response.output_text.done", **where, text=text, logprobs=[]))
                        parts.append(event("response.content_part.done", **where, part=part))
                        parts.append(event("response.output_item.done", output_index=0, item=output[0]))
                    final = self._response(rid, created, job, payload, "completed", output, self._responses_usage(o))
                    parts.append(event("response.completed", response=final))
                if parts:
                    await resp.write(b"".join(parts))
                if o.finished:
                    break
            await resp.write_eof()
        except ConnectionResetError:  # the client left; _responses' finally aborts the request
            pass
        return resp

    # -- /v1/score, /v1/rerank ---------------------------------------------------------

    async def _score(self, request: web.Request) -> web.Response:
        try:
            payload = await self._read_json(request)
            lora, model = self._model_of(payload)
            first = payload.get("text_1", payload.get("queries"))
            second = payload.get("text_2", payload.get("documents"))
            if first is None or second is None:
                raise ClientError(400, "'text_1' and 'text_2' are required")
            pairs = _pairs(_texts(first, "'text_1'"), _texts(second, "'text_2'"))
            outs = await self._prefill_pairs(pairs, lora, model, "score")
        except ClientError as exc:
            return error_response(exc.status, str(exc), exc.type)
        except ValueError as exc:
            return error_response(400, str(exc))
        tokens = sum(o.prompt_tokens for o in outs)
        body = {"id": "score-" + uuid.uuid4().hex, "object": "list", "created": int(time.time()), "model": model,
                "data": [{"index": i, "object": "score", "score": relevance_score(a, b)}
                         for i, (a, b) in enumerate(pairs)],
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0,
                          "prompt_tokens_details": {"cached_tokens": sum(o.cached_tokens for o in outs)}}}
        return web.Response(body=orjson.dumps(body), content_type="application/json")

    async def _prefill_pairs(self, pairs: list[tuple[str, str]], lora: str | None, model: str,
                             kind: str) -> list[Any]:
        """Each (query, document) pair prefilled as one prompt, ``a + PAIR_SEPARATOR + b``."""
        return await self._prefill([self._text_prompt(a + PAIR_SEPARATOR + b) for a, b in pairs], lora, model, kind)

    async def _rerank(self, request: web.Request) -> web.Response:
        try:
            payload = await self._read_json(request)
            lora, model = self._model_of(payload)
            if "query" not in payload or "documents" not in payload:
                raise ClientError(400, "'query' and 'documents' are required")
            query = _text(payload["query"], "'query'")
            documents = payload["documents"]
            if not isinstance(documents, list):
                raise ClientError(400, "'documents' must be a list of strings")
            texts = _texts(documents, "'documents'")
            top_n = payload.get("top_n", 0)
            if top_n is None:
                top_n = 0
            if not isinstance(top_n, int) or isinstance(top_n, bool):
                raise ClientError(400, f"'top_n' must be an integer, got {top_n!r}")
            pairs = _pairs([query], texts)
            outs = await self._prefill_pairs(pairs, lora, model, "rerank")
        except ClientError as exc:
            return error_response(exc.status, str(exc), exc.type)
        except ValueError as exc:
            return error_response(400, str(exc))
        results = [{"index": i, "document": {"text": doc, "multi_modal": None},
                    "relevance_score": relevance_score(query, doc)} for i, doc in enumerate(texts)]
        results.sort(key=lambda r: r["relevance_score"], reverse=True)
        if 0 < top_n < len(results):
            results = results[:top_n]
        tokens = sum(o.prompt_tokens for o in outs)
        body = {"id": "rerank-" + uuid.uuid4().hex, "model": model,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens}, "results": results}
        return web.Response(body=orjson.dumps(body), content_type="application/json")
