"""Configuration and cost model of one emulated vLLM instance.

Step time (seconds) of one continuous-batching step::

    step_overhead_s
      + prefill_s_per_token * (prompt tokens prefilled in the step)
      + decode_s_per_seq    * (sequences decoding one token in the step)

Defaults are calibrated for **Llama-3.1-70B-Instruct, bf16, one 8×H100-SXM instance with
tensor parallelism 8**, vLLM with prefix caching (the SPEC's reference benchmark):

* **Prefill** is compute-bound: ``2 × 70.6e9`` FLOPs per token (2 FLOPs per parameter
  per token; attention's context-dependent FLOPs, about +7 % at 8k tokens, ignored)
  over ``8 × 989 TFLOP/s`` (H100 SXM dense bf16 peak, NVIDIA H100 datasheet) at about
  50 % model-FLOPs utilisation ⇒ 1.41e11 / 3.96e15 ≈ **35 µs per token**. An
  8,000-token cold prefill then takes ≈ 0.28 s, the ~280 ms cold TTFT of the
  reference benchmark (SPEC §1).
* **Decode** is memory-bound. Every step reads all weights: 141 GB (70.6e9 × 2 bytes)
  over ``8 × 3.35 TB/s`` (H100 SXM HBM3) at about 60 % of peak bandwidth ⇒
  5.3 ms / 0.6 ≈ **9 ms fixed per step** (``step_overhead_s``, which also stands for
  the scheduler's CPU time). Each running sequence also reads its KV cache: Llama-70B
  uses grouped-query attention, ``2 (K, V) × 80 layers × 8 KV heads × 128 dims ×
  2 bytes = 320 KiB per token``. For a typical 4–5k-token context that is ~1.5 GB per
  sequence per step ⇒ at 16 TB/s effective ≈ **0.1 ms per decoding sequence**
  (``decode_s_per_seq``; ShareGPT-like 1–2k contexts would be ~0.03 ms, 8k-token
  prefixes ~0.16 ms).
* **KV capacity**: ``8 × 80 GB × 0.9`` (vLLM's default ``gpu_memory_utilization``)
  − 141 GB weights − ~40 GB activations, CUDA graphs and NCCL buffers ≈ 395 GB,
  / 320 KiB per token ≈ **1.2 million tokens** (75,000 blocks of 16).
* **Images**: each image, audio or file part of a chat request is prefilled as
  ``image_tokens`` tokens (576: LLaVA-1.5's 24 x 24 patches of a 336 px image; vLLM
  caches them like text, by the media's hash). Its text in the prompt is its stand-in
  (:func:`prefixroute.core.routing_text.render_chat_text`) repeated to ``image_tokens x 4``
  characters.
* **Scheduler limits**: ``max_num_seqs = 256`` (vLLM's long-standing default; recent
  releases raise it to 1024 on ≥70 GiB GPUs, but with 8k-token prompts the KV cache,
  ~146 such sequences, binds first) and ``max_num_batched_tokens = 8192`` (vLLM V1's
  default for the OpenAI server on ≥70 GiB GPUs such as H100: the per-step token
  budget of chunked prefill). ``block_size = 16`` and ``max_model_len = 131072``
  (Llama-3.1's context) are vLLM's and the model's defaults.

**Tiered KV caches** (optional, :mod:`prefixroute.engine.tiers`): a block found in a lower
tier is loaded instead of prefilled. Loading is modelled as part of the step that admits
the request (LMCache's vLLM connector loads layer by layer inside the forward pass), at a
cost per token moved, from the same 320 KiB of KV per token:

* **CPU tier** (host memory): each of the 8 GPUs loads its eighth (40 KiB a token) over
  its own PCIe Gen5 x16 link, 64 GB/s each way (NVIDIA H100 SXM datasheet: 128 GB/s
  bidirectional), at about 80 % of it for pinned-memory DMA ⇒ 40 KiB / 51 GB/s ≈
  **0.8 µs per token** (``cpu_load_s_per_token``), 44 times cheaper than prefill.
* **Shared tier** (a KV store every instance reads over the network, as LMCache's remote
  backends or a managed tiered cache): an 8×H100 instance such as AWS p5.48xlarge has
  3,200 Gb/s of EFA networking (AWS instance specifications); a KV store reaching one
  eighth of it, 50 GB/s, moves 320 KiB in **6.6 µs per token**
  (``shared_load_s_per_token``), plus **2 ms** per request that loads from it
  (``shared_load_latency_s``: the lookup and connection round trips of a remote store).
* capacities: ``cpu_tier_tokens`` (0: no CPU tier); a host with 2 TB of memory keeps
  about 5 million tokens of Llama-70B KV in 1.6 TB, 4× the GPU tier. The shared tier's
  size is the tier's own (``prefixroute emulate --shared-tier-tokens``).

Every constant can be overridden (``prefixroute emulate --help``).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["DEFAULT_MODEL", "EngineConfig", "step_duration"]

DEFAULT_MODEL = "meta-llama/Llama-3.1-70B-Instruct"


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Immutable, validated configuration of one emulated engine (see module docstring).

    Attributes:
        model: served model name (``/v1/models``, metrics label ``model_name``).
        block_size: tokens per KV block.
        kv_capacity_tokens: KV cache size in tokens; ``// block_size`` blocks.
        max_num_seqs: most sequences running (admitted) at once.
        max_num_batched_tokens: token budget of one step (prefill chunks + decodes).
        max_model_len: most tokens (prompt + output) of one request.
        step_overhead_s: fixed seconds per step (weights read, scheduling).
        prefill_s_per_token: seconds per prompt token prefilled.
        decode_s_per_seq: seconds per sequence decoding one token in a step.
        image_tokens: prompt tokens one image (audio, file) part of a chat request costs.
        cpu_tier_tokens: capacity of the CPU tier in tokens (``// block_size`` blocks);
            0 (default): no CPU tier.
        cpu_load_s_per_token: seconds per token loaded from the CPU tier.
        shared_load_s_per_token: seconds per token loaded from the shared tier.
        shared_load_latency_s: seconds added once per request that loads from the
            shared tier.
        served_model_names: more names the base model answers to (vLLM's
            ``--served-model-name`` takes several; ``model`` is the first, used in
            answers and metrics).
        max_loras: LoRA adapter slots (vLLM's ``--max-loras``: the most adapters in one
            batch); 0 (default): LoRA disabled (vLLM without ``--enable-lora``).
        lora_load_s: modelled seconds to load one adapter (``/v1/load_lora_adapter``;
            reading a rank-16 adapter of a 70B model, a few hundred MB, from local disk).

    Raises:
        ValueError: on construction, for a non-positive size, a negative time, a KV
            cache smaller than one block, or ``max_num_batched_tokens < max_num_seqs``
            (vLLM refuses that too: running sequences could not all decode).
    """

    model: str = DEFAULT_MODEL
    block_size: int = 16
    kv_capacity_tokens: int = 1_200_000
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int = 131_072
    step_overhead_s: float = 0.009
    prefill_s_per_token: float = 35e-6
    decode_s_per_seq: float = 1e-4
    image_tokens: int = 576
    cpu_tier_tokens: int = 0
    cpu_load_s_per_token: float = 0.8e-6
    shared_load_s_per_token: float = 6.6e-6
    shared_load_latency_s: float = 0.002
    served_model_names: tuple[str, ...] = ()
    max_loras: int = 0
    lora_load_s: float = 0.5

    def __post_init__(self) -> None:
        if not isinstance(self.image_tokens, int) or isinstance(self.image_tokens, bool) or self.image_tokens < 0:
            raise ValueError(f"image_tokens must be an integer >= 0, got {self.image_tokens!r}")
        for name in ("block_size", "kv_capacity_tokens", "max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if isinstance(self.cpu_tier_tokens, bool) or not isinstance(self.cpu_tier_tokens, int) \
                or self.cpu_tier_tokens < 0:
            raise ValueError(f"cpu_tier_tokens must be an integer >= 0, got {self.cpu_tier_tokens!r}")
        if 0 < self.cpu_tier_tokens < self.block_size:
            raise ValueError(f"cpu_tier_tokens ({self.cpu_tier_tokens}) must hold at least one block of "
                             f"{self.block_size} (or be 0: no CPU tier)")
        for name in ("step_overhead_s", "prefill_s_per_token", "decode_s_per_seq", "cpu_load_s_per_token",
                     "shared_load_s_per_token", "shared_load_latency_s"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 <= value < float("inf"):
                raise ValueError(f"{name} must be a finite number >= 0 seconds, got {value!r}")
        if not self.model:
            raise ValueError("model name must not be empty")
        if any(not isinstance(n, str) or not n for n in self.served_model_names):
            raise ValueError("served model names must be non-empty strings")
        if isinstance(self.max_loras, bool) or not isinstance(self.max_loras, int) or not 0 <= self.max_loras <= 1024:
            raise ValueError(f"max_loras must be an integer 0-1,024, got {self.max_loras!r}")
        if not isinstance(self.lora_load_s, (int, float)) or isinstance(self.lora_load_s, bool) \
                or not 0 <= self.lora_load_s < float("inf"):
            raise ValueError(f"lora_load_s must be a finite number >= 0 seconds, got {self.lora_load_s!r}")
        if self.kv_capacity_tokens < self.block_size:
            raise ValueError(
                f"kv_capacity_tokens ({self.kv_capacity_tokens}) must hold at least one block of {self.block_size}"
            )
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_num_seqs "
                f"({self.max_num_seqs}) so every running sequence can decode in one step"
            )

    @property
    def model_names(self) -> tuple[str, ...]:
        """Every name the base model answers to: ``model``, then ``served_model_names``."""
        return (self.model, *(n for n in self.served_model_names if n != self.model))

    @property
    def num_kv_blocks(self) -> int:
        """KV cache size in blocks: ``kv_capacity_tokens // block_size``."""
        return self.kv_capacity_tokens // self.block_size


def step_duration(config: EngineConfig, prefill_tokens: int, decode_seqs: int) -> float:
    """Modelled seconds of one step; 0.0 for an empty step (nothing scheduled).

    Args:
        config: the engine's cost constants.
        prefill_tokens: prompt tokens computed in the step (cache hits excluded).
        decode_seqs: sequences that decode one token in the step.
    """
    if prefill_tokens == 0 and decode_seqs == 0:
        return 0.0
    return (
        config.step_overhead_s
        + config.prefill_s_per_token * prefill_tokens
        + config.decode_s_per_seq * decode_seqs
    )
