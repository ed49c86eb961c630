"""Real-time HTTP driver of one :class:`~prefixroute.engine.core.EngineCore`: an
OpenAI-compatible server that behaves like one vLLM instance with prefix caching on.

One background task runs the engine: while there is work it calls ``core.step()``,
sleeps until the step's **absolute** deadline ``step_start + duration_s × time_scale``
(``loop.time()``; the next step starts at that deadline, so CPU lateness does not
compound, up to :data:`MAX_LAG_S` of catch-up), then hands the step's tokens to the
waiting handlers. With no work it sleeps until a request arrives.

Routes: ``POST /v1/chat/completions``, ``POST /v1/completions`` (``stream`` as
server-sent events), ``POST /v1/embeddings``, ``/tokenize``, ``/detokenize``,
``/v1/responses``, ``/v1/score``, ``/v1/rerank`` (:mod:`prefixroute.engine.extra_routes`),
``GET /v1/models``, ``GET /health``, ``GET /metrics`` (Prometheus, vLLM metric names:
:mod:`prefixroute.engine.metrics`), ``POST /invocations`` + ``GET /ping``
(SageMaker container contract), ``GET /info`` (instance id, configuration, counters,
KV-event endpoints), ``POST /reset_prefix_cache`` (vLLM's: drops every cached block; 409
while requests run) and, with runtime LoRA updating on (vLLM's
``VLLM_ALLOW_RUNTIME_LORA_UPDATING``), ``POST /v1/load_lora_adapter`` and
``POST /v1/unload_lora_adapter``. Every response carries ``X-Emulated-Instance: <instance
id>``. Prompt text is never logged.

Several models: the base model answers to every name of ``served_model_names`` (vLLM's
``--served-model-name A B``), and with ``max_loras`` > 0 (vLLM's ``--enable-lora
--max-loras N``) LoRA adapters, loaded at start (``lora_modules``) or at run time, are
requested by name in ``model``; ``/v1/models`` lists them with their ``parent``. A
request for a model or adapter the engine does not have gets vLLM's 404 ("The model `X`
does not exist.") and is counted in ``prefixroute_engine_model_not_served_total``:
requests a router sent for an adapter the engine did not have loaded at that moment.
Errors of the LoRA routes are vLLM's (``vllm/entrypoints/openai/models/serving.py``):
400 ``InvalidUserInput`` (a name or path missing, an adapter already loaded), 404
``NotFoundError`` (unloading an adapter that is not loaded), as ``{"error": {...}}``.

With KV events on (``kv_events``), the events of each step are published as one batch
when the step ends (:mod:`prefixroute.engine.kv_publisher`), as vLLM publishes them.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import time
import uuid
from collections.abc import Awaitable
from typing import Any, Mapping

import orjson
import xxhash
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from prefixroute.core.routing_text import InvalidRequest, completion_prompt
from prefixroute.core.model_tokenizer import ModelTokenizer
from prefixroute.engine.core import EngineCore, RequestOutput, RequestRejected, StepOutput
from prefixroute.engine.extra_routes import ExtraRoutes
from prefixroute.engine.http_common import (DEFAULT_MAX_TOKENS, GENERATION_PROMPT, ClientError, InFlight, Job,
                                            chat_prompt_text, error_response)
from prefixroute.engine.kv_events import KvEventRecorder
from prefixroute.engine.kv_publisher import KvEventPublisher, KvEventsSettings
from prefixroute.engine.metrics import engine_registry
from prefixroute.engine.tiers import SharedTier
from prefixroute.engine.model import EngineConfig
from prefixroute.engine.tokenizer import decode, from_token_ids, tokenize

__all__ = [
    "GENERATION_PROMPT",
    "chat_prompt_text",
    "DEFAULT_MAX_TOKENS",
    "MAX_LAG_S",
    "ENGINE_KEY",
    "EngineServer",
    "start_engine_server",
]

log = logging.getLogger(__name__)

#: Most wall seconds the step loop may run behind its schedule before it resets to
#: "now" instead of catching up with back-to-back steps.
MAX_LAG_S = 0.1

_FAILED = object()  # queued to a request's handler when the engine loop crashed


class EngineServer(ExtraRoutes):
    """One emulated vLLM instance: an :class:`EngineCore` driven in real time plus its
    HTTP application.

    Args:
        config: the engine's configuration.
        time_scale: wall seconds per modelled second: 1.0 real time, 0.1 ten times
            faster, 0.0 as fast as the CPU allows (no sleeping). Must be finite, >= 0.
        instance_id: the name reported in ``X-Emulated-Instance`` and ``/info``
            (default: ``"engine-"`` + 8 random hex digits).
        tokenizer: a model's tokenizer and chat template
            (:class:`~prefixroute.core.model_tokenizer.ModelTokenizer`): prompts become
            its token ids (chat: the template applied, as vLLM does) and the model
            generates tokens of its vocabulary. ``None`` (default): the 4-byte rule of
            :mod:`prefixroute.engine.tokenizer` and the chat rendering of
            :func:`~prefixroute.core.routing_text.render_chat_text`.
        kv_events: publish the engine's KV events (ZeroMQ) with these settings;
            ``None`` (default): no events.
        shared_tier: a KV tier shared with other instances
            (:class:`~prefixroute.engine.shared_tier_file.FileSharedTier` across
            processes); ``None``: none. The CPU tier is ``config.cpu_tier_tokens``.
        lora_modules: LoRA adapters loaded at start, name -> path (vLLM's
            ``--lora-modules``); needs ``config.max_loras`` > 0.
        runtime_lora_updating: serve ``/v1/load_lora_adapter`` and
            ``/v1/unload_lora_adapter`` (vLLM's ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``);
            a load takes ``config.lora_load_s`` modelled seconds.
        embedding_dim: length of the vectors ``/v1/embeddings`` answers with.
    Raises:
        ValueError: ``time_scale`` is negative or not finite, adapters without
            ``max_loras``, or ``embedding_dim`` < 1.

    Use :meth:`build_app` and run the app with ``handler_cancellation=True`` (so a
    client that disconnects cancels its handler, which aborts the request in the core),
    or simply :func:`start_engine_server`.
    """

    def __init__(self, config: EngineConfig, *, time_scale: float = 1.0, instance_id: str | None = None,
                 tokenizer: ModelTokenizer | None = None, kv_events: KvEventsSettings | None = None,
                 shared_tier: SharedTier | None = None, lora_modules: Mapping[str, str] | None = None,
                 runtime_lora_updating: bool = False, embedding_dim: int = 16) -> None:
        if not (isinstance(time_scale, (int, float)) and math.isfinite(time_scale) and time_scale >= 0):
            raise ValueError(f"time_scale must be a finite number >= 0, got {time_scale!r}")
        if (lora_modules or runtime_lora_updating) and not config.max_loras:
            raise ValueError("LoRA adapters need max_loras >= 1 (vLLM's --enable-lora --max-loras N)")
        if embedding_dim < 1:
            raise ValueError(f"embedding_dim must be >= 1, got {embedding_dim}")
        self.config = config
        self.time_scale = float(time_scale)
        self.instance_id = instance_id or f"engine-{uuid.uuid4().hex[:8]}"
        #: Loaded LoRA adapters: name -> path.
        self.adapters: dict[str, str] = dict(lora_modules or {})
        self.runtime_lora_updating = runtime_lora_updating
        self.embedding_dim = embedding_dim
        self._lora_locks: dict[str, asyncio.Lock] = {}
        #: Requests accepted, per model name asked for (a served name or an adapter).
        self.requests_by_model: dict[str, int] = {}
        #: Requests refused with 404 because the engine did not have the model asked for.
        self.not_served: dict[str, int] = {}
        self.lora_loads = 0
        self.lora_unloads = 0
        self.tokenizer = tokenizer
        self.events = (KvEventRecorder(config.block_size, hash_seed=kv_events.hash_seed)
                       if kv_events is not None else None)
        self.publisher = KvEventPublisher(kv_events) if kv_events is not None else None
        self.core = EngineCore(config, tokenizer.output_token_ids if tokenizer is not None else None,
                               events=self.events, shared_tier=shared_tier)
        self.registry, self._ttft, self._e2e = engine_registry(self.core, config.model, self)
        self._inflight: dict[str, InFlight] = {}
        self._wakeup = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._wall0 = 0.0
        self._model_elapsed = 0.0  # modelled seconds of steps run so far

    # -- lifecycle ---------------------------------------------------------------------

    def build_app(self) -> web.Application:
        """The aiohttp application; its startup/cleanup start and stop the step loop."""
        app = web.Application(client_max_size=64 * 1024**2)
        app[ENGINE_KEY] = self
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/invocations", self._invocations)
        app.router.add_post("/v1/embeddings", self._embeddings)
        self.add_extra_routes(app)
        if self.runtime_lora_updating:  # (vLLM registers them only when allowed)
            app.router.add_post("/v1/load_lora_adapter", self._load_lora)
            app.router.add_post("/v1/unload_lora_adapter", self._unload_lora)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._ok)
        app.router.add_get("/ping", self._ok)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/info", self._info)
        app.router.add_post("/reset_prefix_cache", self._reset_prefix_cache)
        app.on_response_prepare.append(self._stamp)
        app.on_startup.append(self._on_startup)
        app.on_cleanup.append(self._on_cleanup)
        return app

    async def _on_startup(self, app: web.Application) -> None:
        if self.publisher is not None:
            await self.publisher.start()
        self._wall0 = asyncio.get_running_loop().time()
        self._task = asyncio.create_task(self._run(), name=f"engine-loop-{self.instance_id}")

    async def _on_cleanup(self, app: web.Application) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None
        for rid in list(self._inflight):
            self._release(rid)
        if self.publisher is not None:
            await self.publisher.close()

    @property
    def num_in_flight(self) -> int:
        """Requests with an open handler (waiting, running, or being answered)."""
        return len(self._inflight)

    # -- the step loop -----------------------------------------------------------------

    def _model_now(self) -> float:
        if self.time_scale > 0:
            return (asyncio.get_running_loop().time() - self._wall0) / self.time_scale
        return self._model_elapsed

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        next_start: float | None = None
        while True:
            if not self.core.has_work():
                next_start = None
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            now = loop.time()
            start = next_start if next_start is not None and now - next_start < MAX_LAG_S else now
            try:
                out = self.core.step()
            except Exception:  # a bug in the core must not hang every client
                log.exception("engine step failed; failing all in-flight requests")
                self._fail_all()
                continue
            if not out.outputs and out.duration_s == 0.0:
                next_start = None
                await asyncio.sleep(0)
                continue
            deadline = start + out.duration_s * self.time_scale
            delay = deadline - loop.time()
            await asyncio.sleep(delay if delay > 0 else 0)
            self._model_elapsed += out.duration_s
            self._publish_events()
            self._deliver(out, deadline)
            next_start = deadline

    def _deliver(self, out: StepOutput, deadline: float) -> None:
        end_model = (deadline - self._wall0) / self.time_scale if self.time_scale > 0 else self._model_elapsed
        for o in out.outputs:
            job = self._inflight.get(o.request_id)
            if job is None:
                continue  # its client left; the core already dropped it
            if o.first_token:
                self._ttft.labels(self.config.model).observe(max(0.0, end_model - job.arrival_model))
            if o.finished:
                job.finished = True
                self._e2e.labels(self.config.model).observe(max(0.0, end_model - job.arrival_model))
                log.debug(
                    "request %s finished: prompt_tokens=%d cached_tokens=%d output_tokens=%d",
                    o.request_id, o.prompt_tokens, o.cached_tokens, o.num_output_tokens,
                )
            job.queue.put_nowait(o)

    def _publish_events(self) -> None:
        """Send the events recorded since the last batch, if any, as one batch."""
        if self.events is not None and self.publisher is not None:
            events = self.events.take()
            if events:
                self.publisher.publish(events)

    def _fail_all(self) -> None:
        for rid, job in list(self._inflight.items()):
            self.core.abort(rid)
            job.finished = True
            job.queue.put_nowait(_FAILED)

    def _submit(self, request_id: str, job: Job) -> InFlight:
        try:
            self.core.add_request(request_id, job.prompt, job.max_tokens, lora=job.lora)
        except RequestRejected as exc:
            raise ClientError(400, str(exc)) from None
        loop = asyncio.get_running_loop()
        entry = InFlight(asyncio.Queue(), loop.time(), self._model_now())
        self._inflight[request_id] = entry
        self._wakeup.set()
        return entry

    def _release(self, request_id: str) -> None:
        entry = self._inflight.pop(request_id, None)
        if entry is not None and not entry.finished:
            self.core.abort(request_id)

    # -- request parsing ---------------------------------------------------------------

    async def _read_json(self, request: web.Request) -> dict[str, Any]:
        try:
            payload = orjson.loads(await request.read())
        except orjson.JSONDecodeError as exc:
            raise ClientError(400, f"request body is not valid JSON: {exc}") from None
        if not isinstance(payload, dict):
            raise ClientError(400, "request body must be a JSON object")
        return payload

    def _resolve_model(self, model: Any) -> str | None:
        """The LoRA adapter a request's ``model`` names, ``None`` for the base model.

        Raises:
            ClientError: 404 (vLLM's message) for a name the engine does not serve now,
                counted per name; 400 for a ``model`` that is not a string.
        """
        if model is None or model in self.config.model_names:
            return None
        if not isinstance(model, str):
            raise ClientError(400, "'model' must be a string")
        if model in self.adapters:
            return model
        self.not_served[model] = self.not_served.get(model, 0) + 1
        log.info("request for %s, which this engine does not serve now: 404", model[:200])
        raise ClientError(404, f"The model `{model}` does not exist.", "NotFoundError")

    def _count(self, job: Job) -> None:
        self.requests_by_model[job.model] = self.requests_by_model.get(job.model, 0) + 1

    def _parse(self, payload: dict[str, Any], chat: bool) -> Job:
        lora = self._resolve_model(payload.get("model"))
        try:
            if not chat:
                raw = payload.get("prompt")
                if isinstance(raw, list) and len(raw) > 1 and isinstance(raw[0], (str, list)):
                    raise ClientError(400, "batched prompts are not supported by the emulator; send one per request")
            prompt: str | list[int]
            if self.tokenizer is not None:
                prompt = self.tokenizer.request_token_ids(payload, chat)
            elif chat:
                prompt = chat_prompt_text(payload, self.config.image_tokens)
            else:
                prompt = completion_prompt(payload)
        except InvalidRequest as exc:
            raise ClientError(400, str(exc)) from None
        max_tokens = payload.get("max_completion_tokens")
        if max_tokens is None:
            max_tokens = payload.get("max_tokens")
        if max_tokens is None:
            max_tokens = DEFAULT_MAX_TOKENS
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
            raise ClientError(400, f"max_tokens must be an integer >= 1, got {max_tokens!r}")
        if payload.get("n", 1) != 1:
            raise ClientError(400, "only n=1 is supported by the emulator")
        stream = payload.get("stream", False)
        if not isinstance(stream, bool):
            raise ClientError(400, "'stream' must be a boolean")
        options = payload.get("stream_options") or {}
        if not isinstance(options, dict):
            raise ClientError(400, "'stream_options' must be an object")
        try:
            tokens = tokenize(prompt) if self.tokenizer is None or isinstance(prompt, str) else from_token_ids(prompt)
        except ValueError as exc:
            raise ClientError(400, str(exc)) from None
        model = lora or (payload["model"] if isinstance(payload.get("model"), str) else self.config.model)
        return Job(tokens, max_tokens, stream, bool(options.get("include_usage", False)), lora, model)

    # -- handlers ----------------------------------------------------------------------

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, chat=True)

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, chat=False)

    async def _invocations(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, chat=None)

    async def _serve(self, request: web.Request, chat: bool | None) -> web.StreamResponse:
        """Parse, submit, answer; ``chat=None`` picks chat when the body has ``messages``."""
        try:
            payload = await self._read_json(request)
            if chat is None:
                chat = "messages" in payload
            job = self._parse(payload, chat)
            rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
            entry = self._submit(rid, job)
            self._count(job)
        except ClientError as exc:
            return error_response(exc.status, str(exc), exc.type)
        return await self._released(rid, self._answer_stream(request, rid, chat, job, entry) if job.stream
                                    else self._answer_json(rid, chat, entry, job.model))

    async def _released(self, rid: str, answer: Awaitable[web.StreamResponse]) -> web.StreamResponse:
        """``answer``, then the request's engine state released whatever happened
        (success, error, client disconnect: cancellation): never leaked."""
        try:
            return await answer
        finally:
            self._release(rid)

    def _decode(self, token_ids: tuple[int, ...] | list[int]) -> str:
        return self.tokenizer.decode(token_ids) if self.tokenizer is not None else decode(token_ids)

    async def _next(self, entry: InFlight) -> RequestOutput:
        item = await entry.queue.get()
        if item is _FAILED:
            raise web.HTTPInternalServerError(text="engine step failed")
        return item

    def _usage(self, o: RequestOutput) -> dict[str, Any]:
        return {
            "prompt_tokens": o.prompt_tokens,
            "total_tokens": o.prompt_tokens + o.num_output_tokens,
            "completion_tokens": o.num_output_tokens,
            "prompt_tokens_details": {"cached_tokens": o.cached_tokens},
        }

    async def _whole_answer(self, entry: InFlight) -> tuple[str, RequestOutput]:
        """A request's whole answer: its text, and its last output (the usage)."""
        tokens: list[int] = []
        while True:
            o = await self._next(entry)
            tokens.extend(o.new_token_ids)
            if o.finished:
                return self._decode(tokens), o

    async def _answer_json(self, rid: str, chat: bool, entry: InFlight, model: str) -> web.Response:
        text, o = await self._whole_answer(entry)
        if chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text, "tool_calls": []},
                      "logprobs": None, "finish_reason": "length", "stop_reason": None}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": "length", "stop_reason": None}
        body = {
            "id": rid,
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()),
            "model": model,
            "choices": [choice],
            "usage": self._usage(o),
        }
        return web.Response(body=orjson.dumps(body), content_type="application/json")

    async def _answer_stream(
        self, request: web.Request, rid: str, chat: bool, job: Job, entry: InFlight
    ) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        created = int(time.time())
        obj = "chat.completion.chunk" if chat else "text_completion"

        def event(choices: list[dict[str, Any]], usage: dict[str, Any] | None = None) -> bytes:
            chunk: dict[str, Any] = {"id": rid, "object": obj, "created": created, "model": job.model,
                                     "choices": choices}
            if job.include_usage:
                chunk["usage"] = usage
            return b"data: " + orjson.dumps(chunk) + b"\n\n"

        try:
            while True:
                try:
                    o = await self._next(entry)
                except web.HTTPInternalServerError:
                    await resp.write(b'data: {"error": {"message": "engine step failed", "code": 500}}\n\n')
                    return resp
                reason = "length" if o.finished else None
                parts: list[bytes] = []
                if o.new_token_ids:
                    text = self._decode(o.new_token_ids)
                    if chat:
                        if o.first_token:
                            role = {"index": 0, "delta": {"role": "assistant", "content": ""},
                                    "logprobs": None, "finish_reason": None}
                            parts.append(event([role]))
                        choice = {"index": 0, "delta": {"content": text}, "logprobs": None, "finish_reason": reason}
                    else:
                        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": reason,
                                  "stop_reason": None}
                    parts.append(event([choice]))
                if o.finished:
                    if job.include_usage:
                        parts.append(event([], self._usage(o)))
                    parts.append(b"data: [DONE]\n\n")
                if parts:
                    await resp.write(b"".join(parts))
                if o.finished:
                    break
            await resp.write_eof()
        except ConnectionResetError:  # the client left; _serve's finally aborts the request
            log.debug("client disconnected from stream %s", rid)
        return resp

    async def _models(self, request: web.Request) -> web.Response:
        now = int(time.time())
        cards = [{"id": name, "object": "model", "created": now, "owned_by": "vllm", "root": self.config.model,
                  "parent": None, "max_model_len": self.config.max_model_len, "permission": []}
                 for name in self.config.model_names]
        cards += [{"id": name, "object": "model", "created": now, "owned_by": "vllm", "root": path,
                   "parent": self.config.model, "max_model_len": None, "permission": []}
                  for name, path in self.adapters.items()]
        return web.json_response({"object": "list", "data": cards}, dumps=lambda v: orjson.dumps(v).decode())

    # -- LoRA adapters (vLLM's runtime loading) ----------------------------------------

    async def _lora_body(self, request: web.Request) -> dict[str, Any]:
        try:
            return await self._read_json(request)
        except ClientError as exc:
            raise ClientError(exc.status, str(exc), "InvalidUserInput") from None

    async def _load_lora(self, request: web.Request) -> web.Response:
        """``POST /v1/load_lora_adapter {"lora_name", "lora_path"}``: vLLM's checks and
        answers; the adapter is usable (and listed) once its load time has passed."""
        try:
            body = await self._lora_body(request)
        except ClientError as exc:
            return error_response(exc.status, str(exc), exc.type)
        name, path = body.get("lora_name"), body.get("lora_path")
        if not isinstance(name, str) or not name or not isinstance(path, str) or not path:
            return error_response(400, "Both 'lora_name' and 'lora_path' must be provided.", "InvalidUserInput")
        async with self._lora_locks.setdefault(name, asyncio.Lock()):
            if name in self.adapters and not body.get("load_inplace"):
                return error_response(400, f"The lora adapter '{name}' has already been loaded. If you want to "
                                            "load the adapter in place, set 'load_inplace' to True.",
                                       "InvalidUserInput")
            await asyncio.sleep(self.config.lora_load_s * self.time_scale)
            self.adapters[name] = path
            self.lora_loads += 1
        log.info("Loaded new LoRA adapter: name '%s', path '%s'", name, path)
        return web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")

    async def _unload_lora(self, request: web.Request) -> web.Response:
        """``POST /v1/unload_lora_adapter {"lora_name"}``: vLLM's checks and answers.
        Requests already running with it finish; new ones get 404."""
        try:
            body = await self._lora_body(request)
        except ClientError as exc:
            return error_response(exc.status, str(exc), exc.type)
        name = body.get("lora_name")
        if not isinstance(name, str) or not name:
            return error_response(400, "'lora_name' needs to be provided to unload a LoRA adapter.",
                                   "InvalidUserInput")
        async with self._lora_locks.setdefault(name, asyncio.Lock()):
            if name not in self.adapters:
                return error_response(404, f"The lora adapter '{name}' cannot be found.", "NotFoundError")
            del self.adapters[name]
            self.lora_unloads += 1
        log.info("Removed LoRA adapter: name '%s'", name)
        return web.Response(text=f"Success: LoRA adapter '{name}' removed successfully.")

    # -- embeddings --------------------------------------------------------------------

    async def _embeddings(self, request: web.Request) -> web.Response:
        """``POST /v1/embeddings``: each input is prefilled (through the prefix cache,
        as a pooling model's prompt is) and answered with a deterministic unit vector of
        :attr:`embedding_dim` floats derived from its tokens."""
        try:
            payload = await self._read_json(request)
            lora = self._resolve_model(payload.get("model"))
            raw = payload.get("input")
            inputs: list[Any]
            if isinstance(raw, str) or (isinstance(raw, list) and raw and isinstance(raw[0], int)):
                inputs = [raw]
            elif isinstance(raw, list) and raw and all(isinstance(x, (str, list)) for x in raw):
                inputs = raw
            else:
                raise ClientError(400, "'input' must be a string, a list of strings, or a list of token ids")
            prompts = [tokenize(x) if isinstance(x, str) else from_token_ids(x) for x in inputs]
            model = lora or (payload["model"] if isinstance(payload.get("model"), str) else self.config.model)
            jobs = [Job(p, 1, False, False, lora, model) for p in prompts]
            entries: list[tuple[str, InFlight]] = []
            try:
                for job in jobs:
                    rid = "embd-" + uuid.uuid4().hex
                    entries.append((rid, self._submit(rid, job)))
                self._count(jobs[0])
                outs = [(await self._whole_answer(e))[1] for _, e in entries]
            finally:
                for rid, _ in entries:
                    self._release(rid)
        except ClientError as exc:
            return error_response(exc.status, str(exc), exc.type)
        except ValueError as exc:
            return error_response(400, str(exc))
        b64 = payload.get("encoding_format") == "base64"  # (as vLLM: float32 little-endian, base64)
        data = [{"object": "embedding", "index": i,
                 "embedding": _base64(_vector(p.payload, self.embedding_dim)) if b64 else
                 _vector(p.payload, self.embedding_dim)} for i, p in enumerate(prompts)]
        tokens = sum(o.prompt_tokens for o in outs)
        body = {"id": "embd-" + uuid.uuid4().hex, "object": "list", "created": int(time.time()), "model": model,
                "data": data, "usage": {"prompt_tokens": tokens, "total_tokens": tokens,
                                        "prompt_tokens_details": {"cached_tokens": sum(o.cached_tokens for o in outs)}}}
        return web.Response(body=orjson.dumps(body), content_type="application/json")

    async def _ok(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def _metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(self.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def _info(self, request: web.Request) -> web.Response:
        info = {
            "instance_id": self.instance_id,
            "model": self.config.model,
            "served_model_names": list(self.config.model_names),
            "lora_adapters": dict(self.adapters),
            "requests_by_model": dict(self.requests_by_model),
            "model_not_served": dict(self.not_served),
            "time_scale": self.time_scale,
            "tokenizer": self.tokenizer.name if self.tokenizer is not None else "4-byte",
            "config": dataclasses.asdict(self.config),
            "stats": dataclasses.asdict(self.core.stats()),
            "in_flight": len(self._inflight),
            "model_time_s": self._model_now(),
            "kv_events": None if self.publisher is None else {
                "endpoint": self.publisher.endpoint,
                "replay_endpoint": self.publisher.replay_endpoint,
                "topic": self.publisher.settings.topic,
                "encoding": self.publisher.settings.encoding,
                "block_size": self.config.block_size,
                "published": self.publisher.published,
            },
        }
        return web.Response(body=orjson.dumps(info), content_type="application/json")

    async def _reset_prefix_cache(self, request: web.Request) -> web.Response:
        if not self.core.reset_prefix_cache():
            return error_response(409, "the prefix cache cannot be reset while requests are running")
        self._publish_events()
        return web.Response(status=200)

    async def _stamp(self, request: web.Request, response: web.StreamResponse) -> None:
        response.headers["X-Emulated-Instance"] = self.instance_id


def _vector(payload: bytes, dim: int) -> list[float]:
    """A deterministic unit vector of ``dim`` floats from a prompt's bytes."""
    values = [((xxhash.xxh3_64_intdigest(payload, i) >> 11) / float(1 << 53)) * 2.0 - 1.0 for i in range(dim)]
    norm = math.sqrt(sum(v * v for v in values)) or 1.0
    return [round(v / norm, 6) for v in values]


def _base64(vector: list[float]) -> str:
    """``vector`` as the OpenAI API's ``encoding_format: base64``: float32, little-endian."""
    import base64
    import struct

    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")


#: Key of the :class:`EngineServer` in its ``web.Application`` (``runner.app[ENGINE_KEY]``).
ENGINE_KEY = web.AppKey("prefixroute_engine_server", EngineServer)


async def start_engine_server(
    config: EngineConfig,
    host: str = "127.0.0.1",
    port: int = 0,
    time_scale: float = 1.0,
    instance_id: str | None = None,
    *,
    shutdown_timeout_s: float = 5.0,
    tokenizer: ModelTokenizer | None = None,
    kv_events: KvEventsSettings | None = None,
    shared_tier: SharedTier | None = None,
    lora_modules: Mapping[str, str] | None = None,
    runtime_lora_updating: bool = False,
    embedding_dim: int = 16,
) -> tuple[web.AppRunner, int]:
    """Start one emulated engine on the running event loop.

    Args:
        config: engine configuration.
        host: address to bind.
        port: TCP port; 0 picks a free one.
        time_scale: wall seconds per modelled second (see :class:`EngineServer`).
        instance_id: name for ``X-Emulated-Instance`` (default: random).
        shutdown_timeout_s: seconds ``runner.cleanup()`` waits for open requests.
        tokenizer: the model's tokenizer and chat template (see :class:`EngineServer`).
        kv_events: publish KV events with these settings (see :class:`EngineServer`).
        shared_tier: a KV tier shared with other instances (see :class:`EngineServer`).
        lora_modules, runtime_lora_updating, embedding_dim: LoRA adapters and embeddings
            (see :class:`EngineServer`).
    Returns:
        ``(runner, port)``: the bound port, and the runner to stop with
        ``await runner.cleanup()``; the :class:`EngineServer` is
        ``runner.app[ENGINE_KEY]``.
    Raises:
        OSError: the address cannot be bound. ValueError: bad ``time_scale``.
        zmq.ZMQError: a KV-event endpoint cannot be bound.
    """
    server = EngineServer(config, time_scale=time_scale, instance_id=instance_id, tokenizer=tokenizer,
                          kv_events=kv_events, shared_tier=shared_tier, lora_modules=lora_modules,
                          runtime_lora_updating=runtime_lora_updating, embedding_dim=embedding_dim)
    runner = web.AppRunner(
        server.build_app(), handler_cancellation=True, access_log=None, shutdown_timeout=shutdown_timeout_s
    )
    await runner.setup()
    try:
        site = web.TCPSite(runner, host, port)
        await site.start()
    except BaseException:
        await runner.cleanup()
        raise
    return runner, runner.addresses[0][1]
