"""The discrete-event simulator: predict routing on hours of traffic in seconds.

* :mod:`~prefixroute.sim.simulator` — :class:`Simulator`: router replicas
  (:class:`~prefixroute.core.pool.VariantPool`) and engine instances
  (:class:`~prefixroute.engine.core.EngineCore`) on a virtual clock;
* :mod:`~prefixroute.sim.scenarios` — the SPEC's reference setups, calibrated, with the
  published figures;
* :mod:`~prefixroute.sim.tune` — the tuning advisor: a grid of PrefixLength and
  ConcurrencyThreshold over a trace, and a recommendation;
* :mod:`~prefixroute.sim.cli`, :mod:`~prefixroute.sim.tune_cli` — ``prefixroute simulate``
  and ``prefixroute tune``.

Sans-I/O except the two CLI modules.
"""

from prefixroute.sim.simulator import (
    MembershipChange,
    RequestRecord,
    SimConfig,
    SimResult,
    Simulator,
    instance_ids,
    parse_changes,
    simulate,
)

__all__ = ["MembershipChange", "RequestRecord", "SimConfig", "SimResult", "Simulator", "instance_ids",
           "parse_changes", "simulate"]
