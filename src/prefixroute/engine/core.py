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
   the others (strict FCFS), except for LoRA: with ``max_loras`` adapter slots, a
   request whose adapter is not among the ``max_loras`` adapters of the running batch
   when they are all taken is skipped and the next one considered (vLLM V1's
   scheduler does the same).
3. The step that finishes a prompt's prefill produces its first output token; each
   later step produces one more. A request finishes after exactly ``max_tokens``
   tokens (the emulator ignores EOS) and its blocks are freed (full ones stay cached,
   generated tokens' blocks too, as in vLLM, so a multi-turn conversation hits them).

KV blocks for the whole request (prompt plus output) are reserved at admission, so no
running sequence ever needs preemption. vLLM allocates decode blocks lazily and preempts
when it runs out; the emulator's KV usage therefore rises earlier than vLLM's, by the
output blocks not yet written. A request that could never fit is refused by
:meth:`EngineCore.add_request`, so the queue cannot deadlock.

Two entry points exist for the discrete-event simulator (:mod:`prefixroute.sim`), which
drives this same class on a virtual clock:

* a prompt may be given as a :class:`HashedPrompt` (its token count and KV block hashes)
  instead of text or token ids, so the simulator never builds or tokenizes prompt text;
* :meth:`EngineCore.decode_run` / :meth:`EngineCore.advance_decode` apply a run of
  identical pure-decode steps at once. The result is the same as calling :meth:`step`
  that many times (same durations, same counters, same cache contents), only faster.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import xxhash

from prefixroute.engine.kvcache import PrefixCache, chain_block_hashes, lora_root_hash, root_hash
from prefixroute.engine.model import EngineConfig, step_duration
from prefixroute.engine.tokenizer import TEXT_TOKEN_BYTES, TokenizedPrompt, output_token_id, token_payload, tokenize

from prefixroute.engine.tiers import CpuTier, SharedTier, runs

if TYPE_CHECKING:
    from prefixroute.engine.kv_events import KvEventRecorder

__all__ = ["RequestRejected", "HashedPrompt", "RequestOutput", "StepOutput", "EngineStats", "EngineCore"]

_OUTPUT_SEED = 0x6F75_7470_7574  # "output"
_SYNTHETIC_BLOCK_SEED = 0x7379_6E74_6865_7469  # "synthetic": generated blocks of hashed prompts
_HASHED = 0  # TokenizedPrompt.token_bytes of a HashedPrompt: there is no payload
_GPU, _CPU, _SHARED = "GPU", "CPU", "SHARED"  # media of the KV events


@dataclass(frozen=True, slots=True)
class HashedPrompt:
    """A prompt given by its KV block hashes instead of its tokens (the simulator's fast path).

    The cache only ever compares block hashes, so a prompt whose blocks hash like another
    prompt's blocks hits exactly where that prompt's text would. The simulator's workloads
    (:mod:`prefixroute.workloads.prompt`) compute such hashes from content ids and lengths.

    Attributes:
        num_tokens: prompt length in tokens (>= 1).
        block_hashes: chained hashes of the prompt's full blocks of the engine's
            ``block_size`` tokens, at least ``num_tokens // block_size`` of them. Hashes
            beyond those describe the tokens the request will generate (a conversation's
            answer), so that the next turn, whose prompt contains that answer, finds its
            blocks cached as it would with real text.
        seed: seeds the hashes of generated blocks that ``block_hashes`` does not cover
            (unique per distinct prompt, like the text path's prompt-derived seed).
    """

    num_tokens: int
    block_hashes: Sequence[int]
    seed: int = 0


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
        cached_tokens: prompt tokens not prefilled because their KV was found at
            admission, in the GPU prefix cache or loaded from a lower tier (a multiple of
            ``block_size``; 0 before admission): the usage's ``cached_tokens``.
        num_output_tokens: output tokens generated so far, this step's included.
        cpu_cached_tokens: of ``cached_tokens``, those loaded from the CPU tier.
        shared_cached_tokens: of ``cached_tokens``, those loaded from the shared tier.
    """

    request_id: str
    new_token_ids: tuple[int, ...]
    admitted: bool
    first_token: bool
    finished: bool
    prompt_tokens: int
    cached_tokens: int
    num_output_tokens: int
    cpu_cached_tokens: int = 0
    shared_cached_tokens: int = 0


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
        prefix_cache_hits: of those, tokens found in the GPU prefix cache.
        prompt_tokens_total: prompt tokens of requests whose prefill completed (cached
            ones included, as vLLM's ``prompt_tokens_total``).
        generation_tokens_total: output tokens generated.
        requests_finished: requests that produced all their tokens.
        requests_aborted: requests removed by :meth:`EngineCore.abort`.
        num_steps: non-empty steps run.
        busy_s: modelled seconds spent in steps (sum of ``duration_s``).
        external_prefix_cache_queries: with a lower tier, the prompt tokens of admitted
            requests not found on the GPU, looked up in the tiers (vLLM's
            ``external_prefix_cache_queries`` of a KV connector); 0 without tiers.
        external_prefix_cache_hits: of those, tokens loaded from a tier.
        cpu_tier_hits: tokens loaded from the CPU tier.
        shared_tier_hits: tokens loaded from the shared tier.
        load_s: modelled seconds of step time spent loading from tiers.
        cpu_tier_blocks: blocks in the CPU tier now.
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
    external_prefix_cache_queries: int = 0
    external_prefix_cache_hits: int = 0
    cpu_tier_hits: int = 0
    shared_tier_hits: int = 0
    load_s: float = 0.0
    cpu_tier_blocks: int = 0


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
    cpu_tokens: int = 0  # of cached_tokens, loaded from the CPU tier
    shared_tokens: int = 0  # of cached_tokens, loaded from the shared tier
    lora: str | None = None  # the LoRA adapter's name, or None for the base model
    root: int = 0  # parent hash of the first block (per payload kind and adapter)


class EngineCore:
    """Continuous-batching scheduler plus prefix cache of one instance (see module doc).

    Args:
        config: validated :class:`~prefixroute.engine.model.EngineConfig`.
        output_vocabulary: token ids the model generates from (a model tokenizer's
            :attr:`~prefixroute.core.model_tokenizer.ModelTokenizer.output_token_ids`);
            ``None``: the 4-byte rule's :data:`~prefixroute.engine.tokenizer.OUTPUT_WORDS`.
        events: a :class:`~prefixroute.engine.kv_events.KvEventRecorder` told of every
            block made findable or evicted (the KV events); ``None``: none are recorded.
            It needs token ids, so it serves requests given as text or token ids, not
            :class:`HashedPrompt` ones.
        shared_tier: the tier shared by every instance
            (:class:`~prefixroute.engine.tiers.SharedTier`), or ``None``. The CPU tier
            is the engine's own (``config.cpu_tier_tokens``).

    Tiers (:mod:`prefixroute.engine.tiers`): on admission, the prompt's chain is matched
    on the GPU, continued in the CPU tier, then in the shared tier; the blocks found
    there are loaded (the admitting step takes ``cpu_load_s_per_token`` /
    ``shared_load_s_per_token`` per token longer, plus ``shared_load_latency_s`` per
    request loading from the shared tier) instead of prefilled, and become GPU blocks.
    Blocks evicted from the GPU go to the CPU tier; blocks made findable on the GPU are
    written through to the shared tier.
    Raises:
        ValueError: ``output_vocabulary`` is empty or holds an id outside ``[0, 2**64)``.
    """

    def __init__(self, config: EngineConfig, output_vocabulary: Sequence[int] | None = None, *,
                 events: "KvEventRecorder | None" = None, shared_tier: SharedTier | None = None) -> None:
        if output_vocabulary is not None:
            output_vocabulary = tuple(output_vocabulary)
            if not output_vocabulary or not all(isinstance(t, int) and 0 <= t < 2**64 for t in output_vocabulary):
                raise ValueError("output_vocabulary must be a non-empty sequence of token ids in [0, 2**64)")
        self._vocabulary = output_vocabulary
        self.config = config
        self.events = events
        self.cpu_tier = CpuTier(config.cpu_tier_tokens // config.block_size) if config.cpu_tier_tokens else None
        self.shared_tier = shared_tier
        self.cache = self._new_cache()
        self._step_load_s = 0.0  # load time of the requests admitted in the step being planned
        self._load_s = 0.0
        self._external_queries = 0
        self._cpu_hits = 0
        self._shared_hits = 0
        self._waiting: dict[str, _Request] = {}  # insertion order = FCFS
        self._running: dict[str, _Request] = {}  # insertion order = admission order
        self._queries = 0
        self._hits = 0
        self._by_lora: dict[str | None, tuple[int, int]] = {}
        self._prompt_total = 0
        self._generation_total = 0
        self._finished = 0
        self._aborted = 0
        self._steps = 0
        self._busy_s = 0.0

    def _new_cache(self) -> PrefixCache:
        cache = PrefixCache(self.config.num_kv_blocks, self.config.block_size)
        if self.events is not None or self.cpu_tier is not None:
            cache.on_evict = self._evicted
        return cache

    def _evicted(self, hashes: Sequence[int], start: int, end: int) -> None:
        """The prefix cache evicted ``hashes[start:end]``: report it, offload to the CPU tier."""
        events = self.events
        if self.cpu_tier is not None:
            stored, evicted = self.cpu_tier.put(hashes, start, end)
            if events is not None:  # (reported before the GPU removal: the blocks' token ids are kept meanwhile)
                for a, b in runs(stored):
                    events.stored(hashes, a, b, None, _CPU)
                if evicted:
                    events.removed(evicted, _CPU)
        if events is not None:
            events.removed(hashes[start:end], _GPU)

    def reset_prefix_cache(self) -> bool:
        """Drop every cached block, as vLLM's ``reset_prefix_cache`` (an
        ``AllBlocksCleared`` event). Refused, returning False, while requests run (their
        blocks are in use); True once done."""
        if self._running:
            return False
        self.cache = self._new_cache()
        if self.cpu_tier is not None:
            self.cpu_tier.clear()
        if self.events is not None:
            self.events.cleared()
        return True

    # -- requests ----------------------------------------------------------------------

    def add_request(
        self, request_id: str, prompt_tokens: TokenizedPrompt | HashedPrompt | Sequence[int] | str, max_tokens: int,
        lora: str | None = None,
    ) -> None:
        """Queue a request (FCFS); it is admitted by a later :meth:`step`.

        Args:
            request_id: unique among requests not yet finished or aborted.
            prompt_tokens: a :class:`TokenizedPrompt`, a list of token ids (used as is),
                text (tokenized with the 4-byte rule) or a :class:`HashedPrompt`.
            max_tokens: output tokens to generate, exactly (>= 1).
            lora: the LoRA adapter the request runs with, or ``None`` (the base model).
                Its KV blocks are the adapter's own (the adapter is in every block's
                hash, as vLLM puts the LoRA name in each block's extra keys), its KV
                events name the adapter, and it takes one of ``max_loras`` adapter
                slots of the batch while it runs.
        Raises:
            RequestRejected: duplicate id, empty prompt, ``max_tokens < 1``, prompt plus
                output over ``max_model_len`` tokens, or more KV blocks than the whole
                cache holds (it could never be admitted). A bad token id also raises, and
                so does a :class:`HashedPrompt` with fewer hashes than full prompt blocks.
        """
        if request_id in self._waiting or request_id in self._running:
            raise RequestRejected(f"request id {request_id!r} is already in use")
        cfg = self.config
        hashed = isinstance(prompt_tokens, HashedPrompt)
        if hashed:
            prompt = TokenizedPrompt(b"", _HASHED, prompt_tokens.num_tokens)
            if len(prompt_tokens.block_hashes) < prompt.num_tokens // cfg.block_size:
                raise RequestRejected(
                    f"a hashed prompt of {prompt.num_tokens} tokens needs at least "
                    f"{prompt.num_tokens // cfg.block_size} block hashes, got {len(prompt_tokens.block_hashes)}"
                )
        else:
            try:
                prompt = tokenize(prompt_tokens)
            except ValueError as exc:
                raise RequestRejected(str(exc)) from None
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
        if lora is not None and not cfg.max_loras:
            raise RequestRejected(f"LoRA adapter {lora!r} requested but LoRA is not enabled (max_loras is 0)")
        root = root_hash(prompt.token_bytes) if lora is None else lora_root_hash(prompt.token_bytes, lora)
        if hashed:
            seed = prompt_tokens.seed
            hashes = list(prompt_tokens.block_hashes)
        else:
            seed = xxhash.xxh3_64_intdigest(prompt.payload, _OUTPUT_SEED if lora is None else root)
            hashes = chain_block_hashes(prompt.payload, cfg.block_size * prompt.token_bytes,
                                        prompt.num_tokens // cfg.block_size, root)
        self._waiting[request_id] = _Request(request_id, prompt, max_tokens, hashes, seed, lora=lora, root=root)

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
        loras = self._running_loras() if cfg.max_loras else None
        for req in list(self._waiting.values()) if self._waiting else ():
            if budget <= 0 or len(self._running) >= cfg.max_num_seqs:
                break
            if loras is not None and req.lora is not None and req.lora not in loras and len(loras) >= cfg.max_loras:
                continue  # every adapter slot is taken by another adapter: the next request may go
            if not self._admit(req):
                break  # strict FCFS: the head waits for blocks, the rest wait behind it
            if loras is not None and req.lora is not None:
                loras.add(req.lora)
            n = min(req.prompt.num_tokens - req.num_computed, budget)
            prefill_tokens += n
            budget -= n
            scheduled.append((req, n, True))
        if not scheduled:
            return StepOutput(0.0, (), 0, 0)
        applied = (self._apply(req, n, admitted) for req, n, admitted in scheduled)
        outputs = tuple(out for out in applied if out.admitted or out.new_token_ids)
        duration = step_duration(cfg, prefill_tokens, decode_seqs)
        if self._step_load_s:
            duration += self._step_load_s
            self._load_s += self._step_load_s
            self._step_load_s = 0.0
        self._steps += 1
        self._busy_s += duration
        return StepOutput(duration, outputs, prefill_tokens, decode_seqs)

    def _running_loras(self) -> set[str]:
        return {r.lora for r in self._running.values() if r.lora is not None}

    def lora_activity(self) -> tuple[dict[str, int], dict[str, int]]:
        """``(running, waiting)``: requests per LoRA adapter, running and waiting (what
        vLLM's ``vllm:lora_requests_info`` reports as ``running_lora_adapters`` and
        ``waiting_lora_adapters``)."""
        running: dict[str, int] = {}
        waiting: dict[str, int] = {}
        for table, out in ((self._running, running), (self._waiting, waiting)):
            for r in table.values():
                if r.lora is not None:
                    out[r.lora] = out.get(r.lora, 0) + 1
        return running, waiting

    def lora_cache_stats(self) -> dict[str | None, tuple[int, int]]:
        """Per adapter (``None``: the base model), ``(prompt tokens looked up, found in
        the GPU prefix cache)`` since start: the prefix-cache counters split by adapter."""
        return dict(self._by_lora)

    def _admit(self, req: _Request) -> bool:
        cfg = self.config
        bs = cfg.block_size
        prompt_len = req.prompt.num_tokens
        cap = (prompt_len - 1) // bs
        hashes = req.block_hashes
        hit = min(self.cache.lookup(hashes), cap)
        # KV holds prompt + output - 1 tokens at most: the last token is never fed back.
        if not self.cache.allocate(req.request_id, prompt_len + req.max_tokens - 1, hashes[:hit]):
            return False
        del self._waiting[req.request_id]
        self._running[req.request_id] = req
        cpu = self.cpu_tier.match(hashes, hit, cap) if self.cpu_tier is not None else 0
        shared = self.shared_tier.match(hashes, hit + cpu, cap) if self.shared_tier is not None else 0
        req.num_computed = req.cached_tokens = (hit + cpu + shared) * bs
        req.cpu_tokens, req.shared_tokens = cpu * bs, shared * bs
        req.num_committed = hit
        self._queries += prompt_len
        self._hits += hit * bs
        q, h = self._by_lora.get(req.lora, (0, 0))
        self._by_lora[req.lora] = (q + prompt_len, h + hit * bs)
        if self.cpu_tier is not None or self.shared_tier is not None:
            self._external_queries += prompt_len - hit * bs
            self._cpu_hits += cpu * bs
            self._shared_hits += shared * bs
            if cpu or shared:
                self._step_load_s += (cfg.cpu_load_s_per_token * cpu * bs + cfg.shared_load_s_per_token * shared * bs
                                      + (cfg.shared_load_latency_s if shared else 0.0))
        return True

    def _apply(self, req: _Request, n: int, admitted: bool) -> RequestOutput:
        prompt_len = req.prompt.num_tokens
        was_prefilling = req.num_computed < prompt_len
        req.num_computed += n
        new: tuple[int, ...] = ()
        if req.num_computed >= prompt_len:  # prefill done (now or earlier): sample a token
            tid = output_token_id(req.seed, req.num_output, self._vocabulary)
            req.num_output += 1
            if req.prompt.token_bytes:
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
            req.cpu_tokens,
            req.shared_tokens,
        )

    def _commit_full_blocks(self, req: _Request) -> None:
        bs = self.config.block_size
        full = req.num_computed // bs
        if full <= req.num_committed:
            return
        have = len(req.block_hashes)
        if full > have and not req.prompt.token_bytes:  # hashed prompt: synthetic answer blocks
            h = req.block_hashes[-1] if have else _SYNTHETIC_BLOCK_SEED
            digest = xxhash.xxh3_64_intdigest
            for i in range(have, full):
                h = digest(h.to_bytes(8, "little") + i.to_bytes(8, "little"), req.seed ^ _SYNTHETIC_BLOCK_SEED)
                req.block_hashes.append(h)
        elif full > have:  # blocks that reach into generated tokens: hash them now
            bpb = bs * req.prompt.token_bytes
            payload = req.prompt.payload
            start, end = have * bpb, full * bpb
            if start >= len(payload):
                seg = bytes(req.out_payload[start - len(payload) : end - len(payload)])
            else:
                seg = payload[start:] + req.out_payload[: end - len(payload)]
            parent = req.block_hashes[-1] if have else req.root
            req.block_hashes.extend(chain_block_hashes(seg, bpb, full - have, parent))
        new = self.cache.commit(req.request_id, req.block_hashes, full)
        req.num_committed = full
        if new >= full:
            return
        events = self.events
        if events is not None:
            tokens = self._token_ids(req, new, full) if events.wants_tokens and req.prompt.token_bytes else None
            events.stored(req.block_hashes, new, full, tokens, _GPU, req.lora)
        if self.shared_tier is not None:  # write-through
            run = req.block_hashes[new:full]
            published = [events.engine_hash(h) for h in run] if events is not None else [0] * len(run)
            stored, evicted = self.shared_tier.put(run, published)
            if events is not None:
                for a, b in runs(stored):
                    events.stored_shared(run[a:b], _SHARED)
                events.removed_published(evicted, _SHARED)

    def _token_ids(self, req: _Request, first: int, end: int) -> list[int]:
        """The token ids of blocks ``[first, end)`` of a request (prompt, then output)."""
        tb = req.prompt.token_bytes
        bs = self.config.block_size
        a, b = first * bs * tb, end * bs * tb
        payload = req.prompt.payload
        if b <= len(payload):
            data: bytes | bytearray = payload[a:b]
        elif a >= len(payload):
            data = req.out_payload[a - len(payload):b - len(payload)]
        else:
            data = payload[a:] + req.out_payload[:b - len(payload)]
        n = (end - first) * bs
        if tb != TEXT_TOKEN_BYTES:
            return list(struct.unpack(f"<{n}Q", data))
        marker = TEXT_TOKEN_BYTES << 32
        ids = []
        for v in struct.unpack(f"<{n}I", data):
            if v >> 24 != 0xFF:
                ids.append(v + marker)
            else:  # the 0xFF-padded last chunk of a text prompt: 1 to 3 real bytes
                size = 3 if (v >> 16) & 0xFF != 0xFF else 2 if (v >> 8) & 0xFF != 0xFF else 1
                ids.append((v & ((1 << (8 * size)) - 1)) + (size << 32))
        return ids

    # -- runs of pure-decode steps (the simulator's fast-forward) ------------------------

    def decode_run(self) -> tuple[int, float]:
        """How many identical pure-decode steps lie ahead, and the duration of each.

        Returns ``(steps, duration_s)``: the next ``steps`` calls of :meth:`step` would
        each decode one token for every running request and admit nothing, each taking
        ``duration_s`` model seconds; the last of them finishes at least one request.
        ``(0, 0.0)`` when the next step is not such a step (a request is prefilling, or
        a waiting request can be admitted now).

        A waiting request that cannot be admitted now (no sequence slot or no free KV
        blocks) cannot be admitted until a request finishes: pure decoding frees no block
        and evicts none. (It only commits generated blocks, which a waiting prompt could
        contain only if it were sent before the answer it contains had been generated.)
        """
        running = self._running
        if not running:
            return 0, 0.0
        left = None
        for req in running.values():
            if req.num_computed < req.prompt.num_tokens:
                return 0, 0.0
            n = req.max_tokens - req.num_output
            if left is None or n < left:
                left = n
        cfg = self.config
        if cfg.max_loras and self._waiting:  # (adapter slots may let a later request in: no fast path)
            return 0, 0.0
        if self._waiting and len(running) < cfg.max_num_seqs and len(running) < cfg.max_num_batched_tokens:
            head = next(iter(self._waiting.values()))
            bs = cfg.block_size
            hit = min(self.cache.lookup(head.block_hashes), (head.prompt.num_tokens - 1) // bs)
            if self.cache.can_allocate(head.prompt.num_tokens + head.max_tokens - 1, head.block_hashes[:hit]):
                return 0, 0.0
        return int(left or 0), step_duration(cfg, 0, len(running))

    def advance_decode(self, steps: int) -> StepOutput:
        """Apply ``steps`` pure-decode steps at once (``1 <= steps <= decode_run()[0]``).

        Equivalent to ``steps`` calls of :meth:`step`: the same tokens (for text and
        token-id prompts), block commits, counters and finished requests. Returns one
        :class:`StepOutput` for the whole run: ``duration_s = steps × duration``, a
        :class:`RequestOutput` for every request that finished and for every text or
        token-id request (with every token generated in the run; a
        :class:`HashedPrompt` request generates no ids here and gets news only when it
        finishes), and ``num_decode_seqs`` = tokens decoded (running requests × steps).

        Raises:
            ValueError: ``steps`` is outside ``1..decode_run()[0]``.
        """
        run, duration = self.decode_run()
        if not 1 <= steps <= run:
            raise ValueError(f"advance_decode: steps must be in 1..{run}, got {steps}")
        outputs = []
        finished = []
        for req in self._running.values():
            new: tuple[int, ...] = ()
            if req.prompt.token_bytes:
                ids = [output_token_id(req.seed, req.num_output + i, self._vocabulary) for i in range(steps)]
                req.out_payload += b"".join(token_payload(t, req.prompt.token_bytes) for t in ids)
                new = tuple(ids)
            req.num_computed += steps
            req.num_output += steps
            self._commit_full_blocks(req)
            done = req.num_output >= req.max_tokens
            if done:
                finished.append(req)
            if done or new:
                outputs.append(RequestOutput(req.request_id, new, False, False, done, req.prompt.num_tokens,
                                             req.cached_tokens, req.num_output, req.cpu_tokens, req.shared_tokens))
        n = len(self._running)
        for req in finished:
            del self._running[req.request_id]
            self.cache.free(req.request_id)
        self._finished += len(finished)
        self._generation_total += n * steps
        self._steps += steps
        total = duration * steps
        self._busy_s += total
        return StepOutput(total, tuple(outputs), 0, n * steps)

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
            external_prefix_cache_queries=self._external_queries,
            external_prefix_cache_hits=self._cpu_hits + self._shared_hits,
            cpu_tier_hits=self._cpu_hits,
            shared_tier_hits=self._shared_hits,
            load_s=self._load_s,
            cpu_tier_blocks=len(self.cpu_tier) if self.cpu_tier is not None else 0,
        )
