"""Real-time HTTP driver of one :class:`~prefixroute.engine.core.EngineCore`: an
OpenAI-compatible server that behaves like one vLLM instance with prefix caching on.

One background task runs the engine: while there is work it calls ``core.step()``,
sleeps until the step's **absolute** deadline ``step_start + duration_s × time_scale``
(``loop.time()``; the next step starts at that deadline, so CPU lateness does not
compound, up to :data:`MAX_LAG_S` of catch-up), then hands the step's tokens to the
waiting handlers. With no work it sleeps until a request arrives.

Routes: ``POST /v1/chat/completions``, ``POST /v1/completions`` (``stream`` as
server-sent events), ``GET /v1/models``, ``GET /health``, ``GET /metrics`` (Prometheus,
vLLM metric names), ``POST /invocations`` + ``GET /ping`` (SageMaker container
contract), ``GET /info`` (instance id, configuration, counters, KV-event endpoints),
``POST /reset_prefix_cache`` (vLLM's: drops every cached block; 409 while requests run).
Every response carries ``X-Emulated-Instance: <instance id>``. Prompt text is never logged.

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
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import orjson
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from prefixroute.core.keys import InvalidRequest, completion_prompt, render_chat_text
from prefixroute.core.model_tokenizer import ModelTokenizer
from prefixroute.engine.core import EngineCore, RequestOutput, RequestRejected, StepOutput
from prefixroute.engine.kv_events import KvEventRecorder
from prefixroute.engine.kv_publisher import KvEventPublisher, KvEventsSettings
from prefixroute.engine.tiers import SharedTier
from prefixroute.engine.model import EngineConfig
from prefixroute.engine.tokenizer import TokenizedPrompt, decode, from_token_ids, tokenize

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

#: Appended to the rendered chat (the template's "add_generation_prompt"). It equals
#: how :func:`render_chat_text` renders the start of an assistant message, so the
#: next turn of a conversation begins with this turn's prompt plus its answer.
GENERATION_PROMPT = "<|assistant|>\n"


def chat_prompt_text(payload: Any, image_tokens: int) -> str:
    """The prompt the emulated engine prefills for a chat body: the rendered messages
    (:func:`render_chat_text`, each image part ``image_tokens x 4`` characters) and
    :data:`GENERATION_PROMPT`.

    Raises:
        InvalidRequest: a malformed ``messages``.
    """
    return render_chat_text(payload, media_chars=image_tokens * 4) + GENERATION_PROMPT


#: Output tokens when a request sets neither ``max_completion_tokens`` nor ``max_tokens``.
DEFAULT_MAX_TOKENS = 16
#: Most wall seconds the step loop may run behind its schedule before it resets to
#: "now" instead of catching up with back-to-back steps.
MAX_LAG_S = 0.1
#: vLLM's buckets (seconds) for ``vllm:time_to_first_token_seconds``.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
               60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)

_FAILED = object()  # queued to a request's handler when the engine loop crashed


class _ClientError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def _error_response(status: int, message: str) -> web.Response:
    body = {"error": {"message": message, "type": "invalid_request_error", "param": None, "code": status}}
    return web.Response(status=status, body=orjson.dumps(body), content_type="application/json")


@dataclass(slots=True)
class _Job:
    prompt: TokenizedPrompt
    max_tokens: int
    stream: bool
    include_usage: bool
    lora_name: str | None = None


@dataclass(slots=True)
class _InFlight:
    queue: asyncio.Queue[Any]
    arrival_wall: float
    arrival_model: float
    finished: bool = False


class _EngineCollector(Collector):
    """Reads the core's counters at scrape time, under vLLM's metric names."""

    def __init__(self, core: EngineCore, model: str) -> None:
        self._core = core
        self._model = model

    def collect(self) -> Iterator[Metric]:
        s = self._core.stats()
        m = [self._model]
        counters = (
            ("vllm:prefix_cache_queries", "Prompt tokens of admitted requests.", s.prefix_cache_queries),
            ("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.", s.prefix_cache_hits),
            ("vllm:gpu_prefix_cache_queries", "Older name of vllm:prefix_cache_queries.", s.prefix_cache_queries),
            ("vllm:gpu_prefix_cache_hits", "Older name of vllm:prefix_cache_hits.", s.prefix_cache_hits),
            ("vllm:prompt_tokens", "Prompt tokens of prefilled requests (cached included).", s.prompt_tokens_total),
            ("vllm:generation_tokens", "Generated tokens.", s.generation_tokens_total),
            ("vllm:num_preemptions", "Preemptions (0: KV blocks are reserved at admission).", 0),
            ("vllm:external_prefix_cache_queries", "Prompt tokens looked up in the lower KV tiers (CPU, shared).",
             s.external_prefix_cache_queries),
            ("vllm:external_prefix_cache_hits", "Prompt tokens loaded from the lower KV tiers.",
             s.external_prefix_cache_hits),
        )
        for name, doc, value in counters:
            c = CounterMetricFamily(name, doc, labels=["model_name"])
            c.add_metric(m, value)
            yield c
        success = CounterMetricFamily(
            "vllm:request_success", "Finished requests.", labels=["model_name", "finished_reason"]
        )
        success.add_metric([self._model, "length"], s.requests_finished)
        yield success
        tiers = CounterMetricFamily("prefixroute_engine_tier_hit_tokens", "Prompt tokens loaded from a KV tier.",
                                    labels=["model_name", "medium"])
        tiers.add_metric([self._model, "CPU"], s.cpu_tier_hits)
        tiers.add_metric([self._model, "SHARED"], s.shared_tier_hits)
        yield tiers
        gauges = (
            ("vllm:num_requests_running", "Requests admitted and running.", s.num_running),
            ("vllm:num_requests_waiting", "Requests waiting for admission.", s.num_waiting),
            ("vllm:kv_cache_usage_perc", "KV-cache usage, fraction 0-1 of blocks referenced.", s.kv_cache_usage),
            ("vllm:gpu_cache_usage_perc", "Alias of vllm:kv_cache_usage_perc (older vLLM name).", s.kv_cache_usage),
        )
        for name, doc, value in gauges:
            g = GaugeMetricFamily(name, doc, labels=["model_name"])
            g.add_metric(m, value)
            yield g


class EngineServer:
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
            :func:`~prefixroute.core.keys.render_chat_text`.
        kv_events: publish the engine's KV events (ZeroMQ) with these settings;
            ``None`` (default): no events.
        shared_tier: a KV tier shared with other instances
            (:class:`~prefixroute.engine.shared_tier_file.FileSharedTier` across
            processes); ``None``: none. The CPU tier is ``config.cpu_tier_tokens``.
        lora_adapters: names of the LoRA adapters it serves (vLLM's ``--lora-modules``):
            a request naming one in ``model`` runs on it, its blocks the adapter's own
            (their KV events name it); ``/v1/models`` lists them with the base model as
            ``parent``.
    Raises:
        ValueError: ``time_scale`` is negative or not finite.

    Use :meth:`build_app` and run the app with ``handler_cancellation=True`` (so a
    client that disconnects cancels its handler, which aborts the request in the core),
    or simply :func:`start_engine_server`.
    """

    def __init__(self, config: EngineConfig, *, time_scale: float = 1.0, instance_id: str | None = None,
                 tokenizer: ModelTokenizer | None = None, kv_events: KvEventsSettings | None = None,
                 shared_tier: SharedTier | None = None, lora_adapters: Sequence[str] = ()) -> None:
        if not (isinstance(time_scale, (int, float)) and math.isfinite(time_scale) and time_scale >= 0):
            raise ValueError(f"time_scale must be a finite number >= 0, got {time_scale!r}")
        self.config = config
        self.lora_adapters = tuple(dict.fromkeys(lora_adapters))
        self.time_scale = float(time_scale)
        self.instance_id = instance_id or f"engine-{uuid.uuid4().hex[:8]}"
        self.tokenizer = tokenizer
        self.events = (KvEventRecorder(config.block_size, hash_seed=kv_events.hash_seed)
                       if kv_events is not None else None)
        self.publisher = KvEventPublisher(kv_events) if kv_events is not None else None
        self.core = EngineCore(config, tokenizer.output_token_ids if tokenizer is not None else None,
                               events=self.events, shared_tier=shared_tier)
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(self.core, config.model))
        self._ttft = Histogram(
            "vllm:time_to_first_token_seconds", "Time to first token, in modelled seconds.",
            ["model_name"], registry=self.registry, buckets=TTFT_BUCKETS,
        )
        self._e2e = Histogram(
            "vllm:e2e_request_latency_seconds", "End-to-end request latency, in modelled seconds.",
            ["model_name"], registry=self.registry, buckets=E2E_BUCKETS,
        )
        self._inflight: dict[str, _InFlight] = {}
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

    def _submit(self, request_id: str, job: _Job) -> _InFlight:
        try:
            self.core.add_request(request_id, job.prompt, job.max_tokens, job.lora_name)
        except RequestRejected as exc:
            raise _ClientError(400, str(exc)) from None
        loop = asyncio.get_running_loop()
        entry = _InFlight(asyncio.Queue(), loop.time(), self._model_now())
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
            raise _ClientError(400, f"request body is not valid JSON: {exc}") from None
        if not isinstance(payload, dict):
            raise _ClientError(400, "request body must be a JSON object")
        return payload

    def _parse(self, payload: dict[str, Any], chat: bool) -> _Job:
        model = payload.get("model")
        lora_name = model if model in self.lora_adapters else None
        if model is not None and model != self.config.model and lora_name is None:
            raise _ClientError(404, f"The model `{model}` does not exist.")
        try:
            if not chat:
                raw = payload.get("prompt")
                if isinstance(raw, list) and len(raw) > 1 and isinstance(raw[0], (str, list)):
                    raise _ClientError(400, "batched prompts are not supported by the emulator; send one per request")
            prompt: str | list[int]
            if self.tokenizer is not None:
                prompt = self.tokenizer.request_token_ids(payload, chat)
            elif chat:
                prompt = chat_prompt_text(payload, self.config.image_tokens)
            else:
                prompt = completion_prompt(payload)
        except InvalidRequest as exc:
            raise _ClientError(400, str(exc)) from None
        max_tokens = payload.get("max_completion_tokens")
        if max_tokens is None:
            max_tokens = payload.get("max_tokens")
        if max_tokens is None:
            max_tokens = DEFAULT_MAX_TOKENS
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
            raise _ClientError(400, f"max_tokens must be an integer >= 1, got {max_tokens!r}")
        if payload.get("n", 1) != 1:
            raise _ClientError(400, "only n=1 is supported by the emulator")
        stream = payload.get("stream", False)
        if not isinstance(stream, bool):
            raise _ClientError(400, "'stream' must be a boolean")
        options = payload.get("stream_options") or {}
        if not isinstance(options, dict):
            raise _ClientError(400, "'stream_options' must be an object")
        try:
            tokens = tokenize(prompt) if self.tokenizer is None or isinstance(prompt, str) else from_token_ids(prompt)
        except ValueError as exc:
            raise _ClientError(400, str(exc)) from None
        return _Job(tokens, max_tokens, stream, bool(options.get("include_usage", False)), lora_name)

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
        except _ClientError as exc:
            return _error_response(exc.status, str(exc))
        try:
            if job.stream:
                return await self._answer_stream(request, rid, chat, job, entry)
            return await self._answer_json(rid, chat, entry)
        finally:  # success, error, client disconnect (cancellation): never leak
            self._release(rid)

    def _decode(self, token_ids: tuple[int, ...] | list[int]) -> str:
        return self.tokenizer.decode(token_ids) if self.tokenizer is not None else decode(token_ids)

    async def _next(self, entry: _InFlight) -> RequestOutput:
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

    async def _answer_json(self, rid: str, chat: bool, entry: _InFlight) -> web.Response:
        tokens: list[int] = []
        while True:
            o = await self._next(entry)
            tokens.extend(o.new_token_ids)
            if o.finished:
                break
        text = self._decode(tokens)
        if chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text, "tool_calls": []},
                      "logprobs": None, "finish_reason": "length", "stop_reason": None}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": "length", "stop_reason": None}
        body = {
            "id": rid,
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()),
            "model": self.config.model,
            "choices": [choice],
            "usage": self._usage(o),
        }
        return web.Response(body=orjson.dumps(body), content_type="application/json")

    async def _answer_stream(
        self, request: web.Request, rid: str, chat: bool, job: _Job, entry: _InFlight
    ) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        created = int(time.time())
        obj = "chat.completion.chunk" if chat else "text_completion"

        def event(choices: list[dict[str, Any]], usage: dict[str, Any] | None = None) -> bytes:
            chunk: dict[str, Any] = {"id": rid, "object": obj, "created": created, "model": self.config.model,
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
        cards = [{"id": name, "object": "model", "created": now, "owned_by": "vllm", "root": name,
                  "parent": None if name == self.config.model else self.config.model,
                  "max_model_len": self.config.max_model_len, "permission": []}
                 for name in (self.config.model, *self.lora_adapters)]
        return web.json_response({"object": "list", "data": cards}, dumps=lambda v: orjson.dumps(v).decode())

    async def _ok(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def _metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(self.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def _info(self, request: web.Request) -> web.Response:
        info = {
            "instance_id": self.instance_id,
            "model": self.config.model,
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
            return _error_response(409, "the prefix cache cannot be reset while requests are running")
        self._publish_events()
        return web.Response(status=200)

    async def _stamp(self, request: web.Request, response: web.StreamResponse) -> None:
        response.headers["X-Emulated-Instance"] = self.instance_id


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
    lora_adapters: Sequence[str] = (),
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
        lora_adapters: the LoRA adapters it serves (see :class:`EngineServer`).
    Returns:
        ``(runner, port)``: the bound port, and the runner to stop with
        ``await runner.cleanup()``; the :class:`EngineServer` is
        ``runner.app[ENGINE_KEY]``.
    Raises:
        OSError: the address cannot be bound. ValueError: bad ``time_scale``.
        zmq.ZMQError: a KV-event endpoint cannot be bound.
    """
    server = EngineServer(config, time_scale=time_scale, instance_id=instance_id, tokenizer=tokenizer,
                          kv_events=kv_events, shared_tier=shared_tier, lora_adapters=lora_adapters)
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
