"""The settings of ``bench/policy_vs_peers.py``: the strategy every verdict is about
(:data:`SUBJECT`), the fleet, routing and run-length settings every run shares
(:class:`BenchSettings`; :data:`FULL` and ``--quick``'s :data:`QUICK`) and the workloads.
"""

from __future__ import annotations

from dataclasses import dataclass

from prefixroute.workloads.catalog import BENCH_WORKLOADS, BenchWorkload, MembershipPlan


#: The strategy every verdict is about.
SUBJECT = "CACHE_AWARE"


@dataclass(frozen=True)
class BenchSettings:
    """Fleet, routing and run-length settings shared by every run.

    Attributes:
        instances: emulated engines routed to from the start.
        time_scale: real seconds per model second of the engines (0.5 = twice as fast).
        kv_capacity_tokens: KV-cache capacity of each instance, tokens.
        duration_s: real seconds during which users start requests, per run.
        users_scale: multiplies each workload's number of closed-loop users.
        prefix_length: PREFIX_AWARE PrefixLength (characters) and HAProxy's hashed bytes.
        concurrency_threshold: PREFIX_AWARE ConcurrencyThreshold (SageMaker's only load
            control for it: about twice the mean in flight per instance).
        cache_aware_threshold: CACHE_AWARE ConcurrencyThreshold: a guard against
            overloading one engine (these engines admit 256 sequences), its cost model
            spreading load below it. 64: at 32 the near-saturation workload (85 % of
            the fleet's capacity, 20-40 requests in flight per instance) crossed the
            guard on every burst, and each crossing sends a request away from its
            document (a 5,500-token miss that adds to the backlog); no other workload
            reaches 32 (simulated: identical decisions at 32 and 64 on the other nine).
        balance_factor: HAProxy ``hash-balance-factor`` (percent of the average load).
        replicas: router replica counts to run.
        multi_replica_workloads: workloads that run with more than 1 replica (None: all).
        baselines_replicas: replica counts at which prefixroute's RANDOM and
            LEAST_OUTSTANDING_REQUESTS baselines run (the comparisons are with the peers).
        repeat: runs of each (workload, router, replicas); tables show the median run
            by P90 TTFT, and the JSON every run (for the run-to-run noise).
        seed: workload and router seed.
        precise: ``off``, ``on`` or ``both``: prefixroute CACHE_AWARE in precise mode
            (``prefixroute CACHE_AWARE precise``: on the engines' KV events) instead of,
            or beside, its learned view. With ``on`` or ``both`` every engine of every
            run tokenizes with the bundled tiny tokenizer (an image part as 576 tokens of
            stand-in text) and publishes its KV events, so every router meets the same
            engines; their per-token costs and sizes are scaled so that a request costs
            what it does on the default engine (:func:`engine_args`).
        tiers: ``none``, ``cpu``, ``shared`` or ``cpu+shared``: KV tiers in every engine
            (a CPU tier of 4x its KV capacity, a shared tier of 4x the fleet's);
            prefixroute CACHE_AWARE is told of them (``KvTiers``).
        tier_aware: with tiers, ``on``, ``off`` or ``both``: CACHE_AWARE runs told of
            the tiers, not told (``tier-unaware`` in its label), or both.
    """

    instances: int = 4
    time_scale: float = 0.5
    kv_capacity_tokens: int = 100_000
    duration_s: float = 20.0
    users_scale: float = 1.0
    prefix_length: int = 4096
    concurrency_threshold: int = 8
    cache_aware_threshold: int = 64
    balance_factor: int = 150
    replicas: tuple[int, ...] = (1, 4, 8)
    multi_replica_workloads: tuple[str, ...] | None = None
    baselines_replicas: tuple[int, ...] = (1,)
    repeat: int = 1
    seed: int = 0
    precise: str = "off"
    tiers: str = "none"
    tier_aware: str = "on"

    @property
    def fleet_mode(self) -> str:
        """What the tables say of the fleet: tokenizer, KV events and tiers."""
        parts = []
        if self.precise != "off":
            parts.append("engines tokenize with the tiny tokenizer and publish KV events (their per-token "
                         "costs and sizes scaled so a request costs what it does on the default engine)")
        parts.append(f"KV tiers: {self.tiers}")
        return "; ".join(parts)


FULL = BenchSettings()
#: ``--quick``: the same fleet, traffic and routers, 3 s runs, every workload with 1 replica
#: and shared-prefix also with 4 and 8 (about 12 minutes on 2 cores). For smoke tests, not for conclusions: in
#: 3 s the cold start (every document's first request misses) weighs much more.
QUICK = BenchSettings(duration_s=3.0, multi_replica_workloads=("shared-prefix",))


# -- workloads --------------------------------------------------------------------------------


#: The benchmark's workloads (:mod:`prefixroute.workloads.catalog`).
WORKLOADS: tuple[BenchWorkload, ...] = BENCH_WORKLOADS
WorkloadSpec = BenchWorkload
MembershipChange = MembershipPlan
