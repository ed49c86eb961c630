"""The routers ``bench/policy_vs_peers.py`` compares: prefixroute's strategies (CACHE_AWARE
once per mode the settings ask for: learned view or precise, told of the tiers or not)
and the peers, in table order, and a prefixroute router's access log for a run.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

from peers import HAProxySpec, PrefixrouteSpec, RouterSpec, SGLangRouterSpec, VLLMRouterSpec
from pvp_settings import SUBJECT, BenchSettings


def router_specs(s: BenchSettings) -> list[RouterSpec]:
    """Every router under test, in table order (prefixroute baselines, the subject, peers)."""
    threshold = s.concurrency_threshold
    # Engine load scraped often enough to matter at the engines' time scale (the default
    # 10 s would be 40 model seconds stale at time scale 0.25).
    extra = ("--metrics-scrape-interval", "0.5", "--seed", str(s.seed))
    return [
        PrefixrouteSpec("prefixroute RANDOM", "prefixroute", "RANDOM",
                        routing={"RoutingStrategy": "RANDOM"}, extra_args=extra),
        PrefixrouteSpec("prefixroute LEAST_OUTSTANDING", "prefixroute", "LEAST_OUTSTANDING_REQUESTS",
                        routing={"RoutingStrategy": "LEAST_OUTSTANDING_REQUESTS"}, extra_args=extra),
        PrefixrouteSpec("prefixroute PREFIX_AWARE", "prefixroute", "PREFIX_AWARE",
                        routing={"RoutingStrategy": "PREFIX_AWARE", "PrefixAwareRoutingConfig": {
                            "PrefixLength": s.prefix_length, "ConcurrencyThreshold": threshold}},
                        extra_args=extra),
        *cache_aware_specs(s, extra),
        PrefixrouteSpec("llm-d scorers (re-implementation)", "prefixroute", "LLMD_REFERENCE",
                        routing={"RoutingStrategy": "LLMD_REFERENCE"}, extra_args=extra),
        SGLangRouterSpec("sglang-router cache_aware", "sglang-router", "cache_aware"),
        VLLMRouterSpec("vllm-router cache_aware", "vllm-router", "cache_aware"),
        VLLMRouterSpec("vllm-router consistent_hash", "vllm-router", "consistent_hash"),
        HAProxySpec("haproxy hash-balance-factor", "haproxy", f"hash body[:{s.prefix_length}] "
                    f"balance-factor {s.balance_factor}", hash_bytes=s.prefix_length,
                    balance_factor=s.balance_factor),
    ]


#: precise mode's KvEvents section: endpoints from each engine's GET /info, its tokenizer.
PRECISE_KV_EVENTS = {"Discovery": {"FromInfo": True}, "Tokenizer": "tiny"}


def cache_aware_specs(s: BenchSettings, extra: tuple[str, ...]) -> list[PrefixrouteSpec]:
    """prefixroute CACHE_AWARE once per mode the settings ask for: learned view and/or
    precise (``s.precise``), told of the engines' tiers or not (``s.tier_aware``)."""
    from prefixroute.core.tiers import TierSpec

    tiers = TierSpec.parse(s.tiers)
    precise_modes = {"off": (False,), "on": (True,), "both": (False, True)}[s.precise]
    aware_modes = {"on": (True,), "off": (False,), "both": (True, False)}[s.tier_aware] if tiers else (False,)
    out = []
    for aware in aware_modes:
        ca: dict[str, Any] = {"ConcurrencyThreshold": s.cache_aware_threshold,
                              "InstanceCacheTokens": s.kv_capacity_tokens}
        kv_tiers = tiers.kv_tiers(s.kv_capacity_tokens) if aware else None
        if kv_tiers is not None:
            ca["KvTiers"] = kv_tiers.to_api()
        for precise in precise_modes:
            label = "prefixroute CACHE_AWARE" + (" precise" if precise else "") + \
                ("" if aware or not tiers else " tier-unaware")
            out.append(PrefixrouteSpec(label, "prefixroute", SUBJECT,
                                       routing={"RoutingStrategy": SUBJECT, "CacheAwareRoutingConfig": ca},
                                       extra_args=extra, kv_events=PRECISE_KV_EVENTS if precise else None))
    return out


def with_access_log(spec: RouterSpec, directory: Path | None, workload: str, replicas: int, repeat: int) -> RouterSpec:
    """``spec`` with ``prefixroute serve --access-log`` writing to
    ``DIRECTORY/WORKLOAD-SLUG-xREPLICAS-REPEAT.jsonl`` (every replica of the run appends to
    that file: one JSON line per request, with its decision, instance, TTFT and body
    size, never its text), when ``directory`` is given and ``spec`` is prefixroute's;
    ``spec`` itself otherwise (the peers have no such log)."""
    if directory is None or not isinstance(spec, PrefixrouteSpec):
        return spec
    path = directory / f"{workload}-{_slug(spec.label)}-x{replicas}-{repeat}.jsonl"
    return dataclasses.replace(spec, extra_args=(*spec.extra_args, "--access-log", str(path)))


def _slug(label: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", label.lower()).strip("-")
