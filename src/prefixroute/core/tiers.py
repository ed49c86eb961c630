"""What a KV block is worth to a request by where it is: GPU, CPU tier, shared tier, or nowhere.

An engine with tiered KV caches (LMCache's CPU and remote backends, a managed tiered
cache; the emulated engine's ``--cpu-tier-tokens`` and ``--shared-tier``) loads a block
found in a lower tier instead of prefilling it. Loading is cheaper than recomputing and
dearer than a GPU hit, so ``CACHE_AWARE`` weighs a request's leading tokens by where an
instance holds them (:class:`TierCosts`): a GPU-resident token saves a whole prefill, a
CPU one a little less, a shared-tier one less again, a miss nothing.

**Where the numbers come from.** The defaults are the emulated engine's cost constants
(:mod:`prefixroute.engine.model`, Llama-3.1-70B on 8xH100; ``tests/test_core_tiers.py``
keeps the two equal):

* prefill: 35 µs per token (compute-bound: 2 x 70.6e9 FLOPs over 8 x 989 TFLOP/s at
  ~50 % utilisation);
* CPU tier: 0.8 µs per token (40 KiB of KV per token and GPU over PCIe Gen5 x16 at
  ~51 GB/s), so a CPU hit costs 0.8 / 35 = 2.3 % of a miss;
* shared tier: 6.6 µs per token (320 KiB per token at 50 GB/s of a p5.48xlarge's EFA)
  plus 2 ms per request that loads from it, so a shared-tier hit costs 6.6 / 35 = 19 %
  of a miss plus the prefill of 2 ms / 35 µs = 57 tokens once.

Every cost is overridable (``KvTiers`` in ``CacheAwareRoutingConfig``), for engines
whose hardware differs; only their ratios to the prefill cost matter.

In **precise mode** the tier of every block comes from the engines' KV events (their
``medium``). In **approximate mode** the router cannot tell where an engine keeps what it
was sent, so :class:`KvTiersConfig` says what the engines have and the policy models it
(:mod:`prefixroute.core.precise_policy`): a CPU tier makes the router's view of each
instance remember ``CpuTierTokens`` more (a remembered block is then weighed as a GPU
one: the two differ by 2.3 % of a prefill), and a shared tier makes any prefix routed
anywhere in the fleet loadable by every instance at the shared tier's cost, which
makes a miss cheaper elsewhere, so a hot prefix is replicated more freely.

Sans-I/O: constants and arithmetic only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["PREFILL_S_PER_TOKEN", "CPU_LOAD_S_PER_TOKEN", "SHARED_LOAD_S_PER_TOKEN", "SHARED_LOAD_LATENCY_S",
           "TierCosts", "KvTiersConfig", "TierSpec", "CPU_TIER_FACTOR", "SHARED_TIER_FACTOR"]

#: Seconds to prefill one token (``EngineConfig.prefill_s_per_token``).
PREFILL_S_PER_TOKEN = 35e-6
#: Seconds to load one token's KV from the CPU tier (``EngineConfig.cpu_load_s_per_token``).
CPU_LOAD_S_PER_TOKEN = 0.8e-6
#: Seconds to load one token's KV from the shared tier (``EngineConfig.shared_load_s_per_token``).
SHARED_LOAD_S_PER_TOKEN = 6.6e-6
#: Seconds added once per request that loads from the shared tier
#: (``EngineConfig.shared_load_latency_s``).
SHARED_LOAD_LATENCY_S = 0.002


@dataclass(frozen=True, slots=True)
class TierCosts:
    """The cost of a token by where its KV is, relative to prefilling it.

    Attributes:
        prefill_s_per_token: seconds to prefill a token (a miss), > 0.
        cpu_load_s_per_token: seconds to load a token from the CPU tier, >= 0.
        shared_load_s_per_token: seconds to load a token from the shared tier, >= 0.
        shared_load_latency_s: seconds added once when a request loads from the shared
            tier, >= 0.

    Raises:
        ValueError: on construction, for a prefill cost <= 0 or a negative cost.
    """

    prefill_s_per_token: float = PREFILL_S_PER_TOKEN
    cpu_load_s_per_token: float = CPU_LOAD_S_PER_TOKEN
    shared_load_s_per_token: float = SHARED_LOAD_S_PER_TOKEN
    shared_load_latency_s: float = SHARED_LOAD_LATENCY_S

    def __post_init__(self) -> None:
        if not self.prefill_s_per_token > 0:
            raise ValueError(f"prefill_s_per_token must be > 0 seconds, got {self.prefill_s_per_token}")
        for name in ("cpu_load_s_per_token", "shared_load_s_per_token", "shared_load_latency_s"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be >= 0 seconds, got {getattr(self, name)}")

    @classmethod
    def from_engine(cls, config: Any) -> "TierCosts":
        """The costs of an engine configuration (an
        :class:`~prefixroute.engine.model.EngineConfig`, or anything with its four
        attributes)."""
        return cls(config.prefill_s_per_token, config.cpu_load_s_per_token, config.shared_load_s_per_token,
                   config.shared_load_latency_s)

    @property
    def cpu_weight(self) -> float:
        """A CPU-tier token's cost as a fraction of a miss's (0.023 by default)."""
        return self.cpu_load_s_per_token / self.prefill_s_per_token

    @property
    def shared_weight(self) -> float:
        """A shared-tier token's cost as a fraction of a miss's (0.19 by default)."""
        return self.shared_load_s_per_token / self.prefill_s_per_token

    @property
    def shared_latency_tokens(self) -> float:
        """The shared tier's per-request latency in tokens of prefill (57 by default)."""
        return self.shared_load_latency_s / self.prefill_s_per_token

    def saved_tokens(self, gpu: float, cpu: float = 0.0, shared: float = 0.0) -> float:
        """Tokens of prefill a request saves on an instance holding its leading ``gpu``
        tokens on the GPU, the next ``cpu`` in its CPU tier and the next ``shared`` in
        the shared tier (any unit proportional to tokens: the result is in the same).

        ``gpu + (1 - cpu_weight) x cpu + (1 - shared_weight) x shared``, less the
        shared tier's latency when ``shared > 0`` (in tokens; pass ``shared`` in tokens
        or scale the result). Never below 0: an engine that found only a few tokens in
        the shared tier gains nothing by them."""
        saved = gpu + cpu * (1.0 - self.cpu_weight)
        if shared > 0:
            saved += shared * (1.0 - self.shared_weight) - self.shared_latency_tokens
        return saved if saved > 0 else 0.0


class KvTiersConfig(BaseModel):
    """``CacheAwareRoutingConfig.KvTiers``: the engines' KV tiers, as the router should weigh them.

    Attributes:
        cpu_tier_tokens: ``CpuTierTokens``, >= 0: each instance's CPU tier, tokens
            (``--cpu-tier-tokens`` of ``prefixroute emulate``, LMCache's
            ``max_local_cpu_size``). In approximate mode the view of each instance then
            remembers ``InstanceCacheTokens + CpuTierTokens`` tokens.
        shared_tier: ``SharedTier``: the instances share a KV tier (any instance loads
            a block another computed). In approximate mode, a prefix routed to any
            instance counts as held in the shared tier by every other one.
        prefill_s_per_token, cpu_load_s_per_token, shared_load_s_per_token,
            shared_load_latency_s: ``PrefillSPerToken``, ``CpuLoadSPerToken``,
            ``SharedLoadSPerToken``, ``SharedLoadLatencyS``: the engines' costs,
            seconds (defaults: :mod:`prefixroute.engine.model`'s, see the module
            docstring). Only their ratios to the prefill cost matter.

    Precise mode needs no ``KvTiers`` to weigh tiers (the events say where each block
    is); its costs are these when given, else the defaults.
    """

    model_config = ConfigDict(frozen=True, populate_by_name=True, extra="forbid")

    cpu_tier_tokens: int = Field(default=0, alias="CpuTierTokens", ge=0, le=10_000_000_000)
    shared_tier: bool = Field(default=False, alias="SharedTier")
    prefill_s_per_token: float = Field(default=PREFILL_S_PER_TOKEN, alias="PrefillSPerToken", gt=0, le=1.0)
    cpu_load_s_per_token: float = Field(default=CPU_LOAD_S_PER_TOKEN, alias="CpuLoadSPerToken", ge=0, le=1.0)
    shared_load_s_per_token: float = Field(default=SHARED_LOAD_S_PER_TOKEN, alias="SharedLoadSPerToken", ge=0,
                                           le=1.0)
    shared_load_latency_s: float = Field(default=SHARED_LOAD_LATENCY_S, alias="SharedLoadLatencyS", ge=0, le=60.0)

    @property
    def costs(self) -> TierCosts:
        """The :class:`TierCosts` of these settings."""
        return TierCosts(self.prefill_s_per_token, self.cpu_load_s_per_token, self.shared_load_s_per_token,
                         self.shared_load_latency_s)

    def to_api(self) -> dict[str, Any]:
        """SageMaker-style dict of every setting."""
        return {"CpuTierTokens": self.cpu_tier_tokens, "SharedTier": self.shared_tier,
                "PrefillSPerToken": self.prefill_s_per_token, "CpuLoadSPerToken": self.cpu_load_s_per_token,
                "SharedLoadSPerToken": self.shared_load_s_per_token,
                "SharedLoadLatencyS": self.shared_load_latency_s}


#: A CPU tier's size when only named (``--tiers cpu``): 4x the instance's GPU KV
#: capacity (engine/model.py: a 2 TB host keeps ~5 M tokens of Llama-70B KV, 4x the GPU's 1.2 M).
CPU_TIER_FACTOR = 4
#: A shared tier's size when only named (``--tiers shared``): 4x the fleet's GPU KV capacity.
SHARED_TIER_FACTOR = 4


@dataclass(frozen=True, slots=True)
class TierSpec:
    """Which KV tiers a fleet has, as the ``--tiers`` flag of ``prefixroute demo``,
    ``prefixroute simulate`` and ``bench/policy_vs_peers.py`` names them.

    Attributes:
        cpu: each instance has a CPU tier.
        shared: the instances share a tier.
    """

    cpu: bool = False
    shared: bool = False

    CHOICES: ClassVar[tuple[str, ...]] = ("none", "cpu", "shared", "cpu+shared")

    @classmethod
    def parse(cls, text: str | None) -> "TierSpec":
        """``none`` (or ``None``), ``cpu``, ``shared`` or ``cpu+shared``.

        Raises:
            ValueError: anything else.
        """
        if text is None or text == "none":
            return cls()
        parts = set(text.split("+"))
        if not parts or not parts <= {"cpu", "shared"} or len(parts) != len(text.split("+")):
            raise ValueError(f"--tiers: {text!r} is not one of {', '.join(cls.CHOICES)}")
        return cls("cpu" in parts, "shared" in parts)

    def __bool__(self) -> bool:
        return self.cpu or self.shared

    @property
    def name(self) -> str:
        """``none``, ``cpu``, ``shared`` or ``cpu+shared``."""
        return "+".join(n for n, on in (("cpu", self.cpu), ("shared", self.shared)) if on) or "none"

    def cpu_tokens(self, kv_capacity_tokens: int) -> int:
        """Each instance's CPU tier, tokens: :data:`CPU_TIER_FACTOR` x its GPU capacity (0 without)."""
        return CPU_TIER_FACTOR * kv_capacity_tokens if self.cpu else 0

    def shared_tokens(self, kv_capacity_tokens: int, instances: int) -> int:
        """The shared tier, tokens: :data:`SHARED_TIER_FACTOR` x the fleet's GPU capacity (0 without)."""
        return SHARED_TIER_FACTOR * kv_capacity_tokens * instances if self.shared else 0

    def kv_tiers(self, kv_capacity_tokens: int) -> KvTiersConfig | None:
        """``CACHE_AWARE``'s ``KvTiers`` for such a fleet (``None`` without tiers)."""
        if not self:
            return None
        return KvTiersConfig(CpuTierTokens=self.cpu_tokens(kv_capacity_tokens), SharedTier=self.shared)
