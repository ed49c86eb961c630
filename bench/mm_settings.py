"""The settings of ``bench/multi_model.py``: the models and their components, the
endpoint's name, the strategies compared, and how big a run is (:class:`Sizes`:
:data:`FULL` and ``--quick``'s :data:`QUICK`).
"""

from __future__ import annotations

from dataclasses import dataclass


LLAMA = "meta-llama/Llama-3.1-70B-Instruct"
QWEN = "Qwen/Qwen2.5-72B-Instruct"
COMPONENTS = {"llama-70b": LLAMA, "qwen-72b": QWEN}
ENDPOINT = "bench"
STRATEGIES = ("RANDOM", "PREFIX_AWARE")


@dataclass(frozen=True)
class Sizes:
    """How big one benchmark is (``--quick`` shrinks it)."""

    run_s: float  # real seconds of traffic per matrix run
    lora_s: float  # real seconds of traffic per LoRA run
    users: int  # closed-loop users
    groups: int  # documents per model
    prefix_tokens: int  # of each matrix document
    question_tokens: int
    output_tokens: int
    kv_tokens: int  # KV capacity of each engine
    lora_users: int
    lora_groups: int  # documents per adapter
    lora_prefix_tokens: int  # of each LoRA document


# The matrix's documents: 96 of 1,500 tokens per model (144,000 tokens, 80 % of 4 engines'
# KV). PREFIX_AWARE spreads them by rendezvous over the instances' URLs (fresh ports each
# run): with 96 keys an instance's share varies by about 18 % by luck alone, with 48 by 25 %,
# enough to queue the busiest past ConcurrencyThreshold in some runs.
FULL = Sizes(run_s=20.0, lora_s=45.0, users=16, groups=96, prefix_tokens=1500, question_tokens=64, output_tokens=16,
             kv_tokens=45_000, lora_users=20, lora_groups=6, lora_prefix_tokens=3000)
QUICK = Sizes(run_s=4.0, lora_s=8.0, users=12, groups=48, prefix_tokens=1500, question_tokens=64, output_tokens=8,
              kv_tokens=22_500, lora_users=12, lora_groups=3, lora_prefix_tokens=3000)
