"""Sans-I/O continuous-batching scheduler of one emulated vLLM instance (V1-like).

:class:`EngineCore` never reads a clock and imports no asyncio: each :meth:`EngineCore.step`
plans one model step, applies it, and returns how long it would take on the modelled
hardware (:func:`~prefixroute.engine.model.step_duration`). The driver — the real-time
HTTP server or a discrete-event simulator — advances its own clock by that duration and
makes the step's outputs visible at the step's end.

Scheduling, as in vLLM V1 with chunked prefill and prefix caching:

1. Running sequences, in admission order, get tokens from the step budget
   (``max_num_batched_tokens``): one token each if decoding, the rest of their prompt
   (up to the budget) if their prefill was chunked.
2. Waiting requests are admitted first-come-first-served while there is budget, fewer
   than ``max_num_seqs`` are running and KV blocks can be had. On admission the
   leading cached blocks of the prompt are reused (at most ``prompt_tokens - 1``
   tokens' worth, so at least one token is computed, as vLLM does) and the uncached
   part is prefilled, in chunks if the budget is short. The head of the queue blocks
   the others (strict FCFS).
3. The step that finishes a prompt's prefill produces its first output token; each
   later step produces one more. A request finishes after exactly ``max_tokens``
   tokens (the emulator ignores EOS) and its blocks are freed (full ones stay cached,
   generated tokens' blocks too, as in vLLM, so a multi-turn conversation hits them).

KV blocks for the whole request (prompt plus output) are reserved at admission, so no
running sequence ever needs preemption. vLLM allocates decode blocks lazily and preempts
when it runs out; the emulator's KV usage therefore rises earlier than vLLM's, by the
output blocks not yet written. A request that could never fit is refused by
:meth:`EngineCore.add_request`, so the queue cannot deadlock.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import xxhash

from prefixroute.engine.kvcache import PrefixCache, chain_block_hashes, prompt_block_hashes, root_hash
from prefixroute.engine.model import EngineConfig, step_duration
from prefixroute.engine.tokenizer import TokenizedPrompt, output_token_id, token_payload, tokenize

__all__ = ["RequestRejected", "RequestOutput", "StepOutput", "EngineStats", "EngineCore"]

_OUTPUT_SEED = 0x6F75_7470_7574  # "output"


class RequestRejected(ValueError):
    """A request the engine can never serve (drivers answer 400)."""


@dataclass(frozen=True, slots=True)
class RequestOutput:
    """What happened to one request in one step (only requests with news get one).

    Attributes:
        request_id: the id given to :meth:`EngineCore.add_request`.
        new_token_ids: token ids generated in this step (empty or one id).
        admitted: the request left the waiting queue in this step.
        first_token: ``new_token_ids`` holds the request's first output token.
        finished: the request produced its last token; its blocks are freed.
        prompt_tokens: prompt length in tokens.
        cached_tokens: prompt tokens found in the prefix cache at admission (a multiple
            of ``block_size``; 0 before admission).
        num_output_tokens: output tokens generated so far, this step's included.
    """

    request_id: str
    new_token_ids: tuple[int, ...]
    admitted: bool
    first_token: bool
    finished: bool
    prompt_tokens: int
    cached_tokens: int
    num_output_tokens: int


@dataclass(frozen=True, slots=True)
class StepOutput:
    """One planned-and-applied step.

    Attributes:
        duration_s: modelled duration in seconds (0.0 when nothing was scheduled); the
            outputs become visible at ``step start + duration_s``.
        outputs: per-request news, in scheduling order.
        num_prefill_tokens: prompt tokens computed in the step.
        num_decode_seqs: sequences that decoded one token.
    """

    duration_s: float
    outputs: tuple[RequestOutput, ...]
    num_prefill_tokens: int
    num_decode_seqs: int


@dataclass(frozen=True, slots=True)
class EngineStats:
    """Counters and gauges with vLLM's meaning (names of the ``vllm:*`` metrics).

    Attributes:
        num_running: requests admitted and not finished (``num_requests_running``).
        num_waiting: requests queued, not yet admitted (``num_requests_waiting``).
        kv_cache_usage: fraction 0–1 of KV blocks referenced by running requests.
        prefix_cache_queries: prompt tokens of admitted requests (tokens, cumulative).
        prefix_cache_hits: of those, tokens found in the prefix cache.
        prompt_tokens_total: prompt tokens of requests whose prefill completed (cached
            ones included, as vLLM's ``prompt_tokens_total``).
        generation_tokens_total: output tokens generated.
        requests_finished: requests that produced all their tokens.
        requests_aborted: requests removed by :meth:`EngineCore.abort`.
        num_steps: non-empty steps run.
        busy_s: modelled seconds spent in steps (sum of ``duration_s``).
    """

    num_running: int
    num_waiting: int
    kv_cache_usage: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    prompt_tokens_total: int
    generation_tokens_total: int
    requests_finished: int
    requests_aborted: int
    num_steps: int
    busy_s: float


@dataclass(slots=True)
class _Request:
    request_id: str
    prompt: TokenizedPrompt
    max_tokens: int
    block_hashes: list[int]  # full blocks: the prompt's, extended with generated ones
    seed: int
    num_computed: int = 0  # tokens whose KV exists (cached + prefilled + decoded)
    num_committed: int = 0  # leading blocks handed to PrefixCache.commit
    cached_tokens: int = 0
    num_output: int = 0
    out_payload: bytearray = field(default_factory=bytearray)


class EngineCore:
    """Continuous-batching scheduler plus prefix cache of one instance (see module doc).

    Args:
        config: validated :class:`~prefixroute.engine.model.EngineConfig`.
    """

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.cache = PrefixCache(config.num_kv_blocks, config.block_size)
        self._waiting: dict[str, _Request] = {}  # insertion order = FCFS
        self._running: dict[str, _Request] = {}  # insertion order = admission order
        self._queries = 0
        self._hits = 0
        self._prompt_total = 0
        self._generation_total = 0
        self._finished = 0
        self._aborted = 0
        self._steps = 0
        self._busy_s = 0.0

    # -- requests ----------------------------------------------------------------------

    def add_request(
        self, request_id: str, prompt_tokens: TokenizedPrompt | Sequence[int] | str, max_tokens: int
    ) -> None:
        """Queue a request (FCFS); it is admitted by a later :meth:`step`.

        Args:
            request_id: unique among requests not yet finished or aborted.
            prompt_tokens: a :class:`TokenizedPrompt`, a list of token ids (used as is)
                or text (tokenized with the 4-byte rule).
            max_tokens: output tokens to generate, exactly (>= 1).
        Raises:
            RequestRejected: duplicate id, empty prompt, ``max_tokens < 1``, prompt plus
                output over ``max_model_len`` tokens, or more KV blocks than the whole
                cache holds (it could never be admitted). A bad token id also raises.
        """
        if request_id in self._waiting or request_id in self._running:
            raise RequestRejected(f"request id {request_id!r} is already in use")
        try:
            prompt = tokenize(prompt_tokens)
        except ValueError as exc:
            raise RequestRejected(str(exc)) from None
        cfg = self.config
        if prompt.num_tokens == 0:
            raise RequestRejected("the prompt is empty (0 tokens)")
        if not isinstance(max_tokens, int) or max_tokens < 1:
            raise RequestRejected(f"max_tokens must be an integer >= 1, got {max_tokens!r}")
        total = prompt.num_tokens + max_tokens
        if total > cfg.max_model_len:
            raise RequestRejected(
                f"this model's maximum context length is {cfg.max_model_len} tokens; the request needs "
                f"{total} ({prompt.num_tokens} prompt + {max_tokens} output)"
            )
        if self.cache.blocks_for(total - 1) > self.cache.num_blocks:
            raise RequestRejected(
                f"the request needs {total - 1} tokens of KV cache but the engine holds only "
                f"{self.cache.num_blocks * cfg.block_size} (kv_capacity_tokens)"
            )
        seed = xxhash.xxh3_64_intdigest(prompt.payload, _OUTPUT_SEED)
        hashes = prompt_block_hashes(prompt, cfg.block_size)
        self._waiting[request_id] = _Request(request_id, prompt, max_tokens, hashes, seed)

    def abort(self, request_id: str) -> bool:
        """Remove a waiting or running request and free its blocks (computed full blocks
        stay cached). Returns False when the id is unknown or already finished."""
        req = self._waiting.pop(request_id, None)
        if req is None:
            req = self._running.pop(request_id, None)
            if req is None:
                return False
            self.cache.free(request_id)
        self._aborted += 1
        return True

    def has_work(self) -> bool:
        """True while any request is waiting or running (a :meth:`step` would do work)."""
        return bool(self._waiting or self._running)

    # -- the step ----------------------------------------------------------------------

    def step(self) -> StepOutput:
        """Plan and apply one step; returns its modelled duration and per-request news.

        An empty engine returns ``StepOutput(0.0, (), 0, 0)``.
        """
        cfg = self.config
        budget = cfg.max_num_batched_tokens
        scheduled: list[tuple[_Request, int, bool]] = []  # (request, tokens, admitted now)
        prefill_tokens = 0
        decode_seqs = 0
        for req in self._running.values():
            if budget == 0:
                break
            remaining = req.prompt.num_tokens - req.num_computed
            if remaining > 0:
                n = min(remaining, budget)
                prefill_tokens += n
            else:
                n = 1
                decode_seqs += 1
            budget -= n
            scheduled.append((req, n, False))
        while self._waiting and budget > 0 and len(self._running) < cfg.max_num_seqs:
            req = next(iter(self._waiting.values()))
            if not self._admit(req):
                break  # strict FCFS: the head waits for blocks, the rest wait behind it
            n = min(req.prompt.num_tokens - req.num_computed, budget)
            prefill_tokens += n
            budget -= n
            scheduled.append((req, n, True))
        if not scheduled:
            return StepOutput(0.0, (), 0, 0)
        applied = (self._apply(req, n, admitted) for req, n, admitted in scheduled)
        outputs = tuple(out for out in applied if out.admitted or out.new_token_ids)
        duration = step_duration(cfg, prefill_tokens, decode_seqs)
        self._steps += 1
        self._busy_s += duration
        return StepOutput(duration, outputs, prefill_tokens, decode_seqs)

    def _admit(self, req: _Request) -> bool:
        bs = self.config.block_size
        prompt_len = req.prompt.num_tokens
        hit = min(self.cache.lookup(req.block_hashes), (prompt_len - 1) // bs)
        # KV holds prompt + output - 1 tokens at most: the last token is never fed back.
        if not self.cache.allocate(req.request_id, prompt_len + req.max_tokens - 1, req.block_hashes[:hit]):
            return False
        del self._waiting[req.request_id]
        self._running[req.request_id] = req
        req.num_computed = req.cached_tokens = hit * bs
        req.num_committed = hit
        self._queries += prompt_len
        self._hits += req.cached_tokens
        return True

    def _apply(self, req: _Request, n: int, admitted: bool) -> RequestOutput:
        prompt_len = req.prompt.num_tokens
        was_prefilling = req.num_computed < prompt_len
        req.num_computed += n
        new: tuple[int, ...] = ()
        if req.num_computed >= prompt_len:  # prefill done (now or earlier): sample a token
            tid = output_token_id(req.seed, req.num_output)
            req.num_output += 1
            req.out_payload += token_payload(tid, req.prompt.token_bytes)
            new = (tid,)
            self._generation_total += 1
            if was_prefilling:
                self._prompt_total += prompt_len
        self._commit_full_blocks(req)
        finished = req.num_output >= req.max_tokens
        if finished:
            del self._running[req.request_id]
            self.cache.free(req.request_id)
            self._finished += 1
        return RequestOutput(
            req.request_id,
            new,
            admitted,
            bool(new) and was_prefilling,
            finished,
            prompt_len,
            req.cached_tokens,
            req.num_output,
        )

    def _commit_full_blocks(self, req: _Request) -> None:
        bs = self.config.block_size
        full = req.num_computed // bs
        if full <= req.num_committed:
            return
        have = len(req.block_hashes)
        if full > have:  # blocks that reach into generated tokens: hash them now
            bpb = bs * req.prompt.token_bytes
            payload = req.prompt.payload
            start, end = have * bpb, full * bpb
            if start >= len(payload):
                seg = bytes(req.out_payload[start - len(payload) : end - len(payload)])
            else:
                seg = payload[start:] + req.out_payload[: end - len(payload)]
            parent = req.block_hashes[-1] if have else root_hash(req.prompt.token_bytes)
            req.block_hashes.extend(chain_block_hashes(seg, bpb, full - have, parent))
        self.cache.commit(req.request_id, req.block_hashes[:full])
        req.num_committed = full

    # -- counters ----------------------------------------------------------------------

    @property
    def num_running(self) -> int:
        """Requests admitted and not finished."""
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        """Requests queued for admission."""
        return len(self._waiting)

    def stats(self) -> EngineStats:
        """A snapshot of the counters (see :class:`EngineStats`)."""
        return EngineStats(
            num_running=len(self._running),
            num_waiting=len(self._waiting),
            kv_cache_usage=self.cache.usage,
            prefix_cache_queries=self._queries,
            prefix_cache_hits=self._hits,
            prompt_tokens_total=self._prompt_total,
            generation_tokens_total=self._generation_total,
            requests_finished=self._finished,
            requests_aborted=self._aborted,
            num_steps=self._steps,
            busy_s=self._busy_s,
        )
