"""``LLMD_REFERENCE``: llm-d's documented default scheduling, re-implemented for comparisons.

Not prefixroute's own policy: a faithful re-implementation of what llm-d's inference
scheduler (the Gateway API Inference Extension's endpoint picker) does with its default
profile, so that the benchmarks and the simulator can run it beside prefixroute's
strategies on the same data plane, fleet and traffic. What it does, from the
Inference Extension's and llm-d's documentation:

* **prefix-cache scorer**, approximate mode (weight 3): the prompt is cut into blocks of
  64 characters (:data:`prefixroute.core.keys.LLMD_BLOCK_CHARS`, at most 256 blocks, a
  prompt shorter than one block has none); each instance's blocks routed to it are
  remembered in an LRU of 31,250 blocks; the score is the instance's longest matched run
  of leading blocks divided by the prompt's blocks (0 to 1).
* **queue scorer** (weight 2): ``(max - q) / (max - min)`` of the instances' waiting
  queues as scraped from ``vllm:num_requests_waiting``; 1 for all when they are equal.
* **KV-cache utilisation scorer** (weight 2): ``1 - vllm:kv_cache_usage_perc``.
* **max-score picker**: the highest weighted sum, ties broken uniformly at random.

There is no ConcurrencyThreshold; load comes in only through the scraped metrics.
"""

from __future__ import annotations

import random
from collections import OrderedDict
from typing import Sequence

from prefixroute.core.config import RoutingConfig, RoutingStrategy
from prefixroute.core.strategies import DecisionKind, InstanceState, Strategy, register

__all__ = ["LlmdReferenceStrategy", "PREFIX_WEIGHT", "QUEUE_WEIGHT", "KV_WEIGHT", "LRU_BLOCKS_PER_INSTANCE"]

#: llm-d's default weights of its three scorers.
PREFIX_WEIGHT, QUEUE_WEIGHT, KV_WEIGHT = 3.0, 2.0, 2.0
#: Blocks each instance's LRU remembers (the prefix plugin's LRUCapacityPerServer default).
LRU_BLOCKS_PER_INSTANCE = 31_250


@register
class LlmdReferenceStrategy(Strategy):
    """``LLMD_REFERENCE`` (see the module docstring)."""

    name = RoutingStrategy.LLMD_REFERENCE

    def __init__(self, config: RoutingConfig, rng: random.Random) -> None:
        super().__init__(config, rng)
        self.lru: dict[str, OrderedDict[int, None]] = {}

    def _match(self, inst: InstanceState, blocks: Sequence[int]) -> int:
        lru = self.lru.get(inst.instance_id)
        if not lru:
            return 0
        n = 0
        for h in blocks:
            if h not in lru:
                break
            n += 1
        return n

    def choose(
        self, key: int | None, candidates: Sequence[InstanceState], blocks: Sequence[int] = ()
    ) -> tuple[InstanceState, DecisionKind]:
        n = len(blocks)
        queues = [c.engine_waiting for c in candidates]
        lo, hi = min(queues), max(queues)
        best: list[int] = []
        top = -1.0
        for i, c in enumerate(candidates):
            prefix = self._match(c, blocks) / n if n else 0.0
            queue = 1.0 if hi == lo else (hi - queues[i]) / (hi - lo)
            kv = 1.0 - min(1.0, max(0.0, c.engine_kv_usage))
            score = PREFIX_WEIGHT * prefix + QUEUE_WEIGHT * queue + KV_WEIGHT * kv
            if score > top + 1e-12:
                top, best = score, [i]
            elif abs(score - top) <= 1e-12:
                best.append(i)
        i = best[0] if len(best) == 1 else self.rng.choice(best)
        return candidates[i], DecisionKind.AFFINITY if n and self._match(candidates[i], blocks) else DecisionKind.RANDOM

    def on_routed(self, instance: InstanceState, blocks: Sequence[int]) -> None:
        if not blocks:
            return
        lru = self.lru.setdefault(instance.instance_id, OrderedDict())
        for h in blocks:
            lru[h] = None
            lru.move_to_end(h)
        while len(lru) > LRU_BLOCKS_PER_INSTANCE:
            lru.popitem(last=False)

    def on_membership_change(self, instances: Sequence[InstanceState]) -> None:
        keep = {i.instance_id for i in instances}
        for gone in [k for k in self.lru if k not in keep]:
            del self.lru[gone]

    def on_cache_lost(self, instance: InstanceState) -> None:
        self.lru.pop(instance.instance_id, None)
