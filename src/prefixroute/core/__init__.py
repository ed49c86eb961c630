"""The routing core: sans-I/O (no asyncio, no sockets, no clock reads except timing).

request -> routing key (:mod:`.keys`); strategy + per-instance state -> decision
(:mod:`.strategies`, :mod:`.pool`); endpoints and variants (:mod:`.endpoint`);
validated configuration (:mod:`.config`); rendezvous hashing (:mod:`.hashing`).
"""

from prefixroute.core.config import (
    ConfigError,
    EndpointConfig,
    FleetConfig,
    PrefixAwareRoutingConfig,
    RoutingConfig,
    RoutingStrategy,
    VariantConfig,
)
from prefixroute.core.endpoint import Endpoint, Fleet, UnknownEndpoint, UnknownVariant
from prefixroute.core.routing_text import InvalidRequest
from prefixroute.core.pool import Decision, Lease, NoHealthyInstance, VariantPool
from prefixroute.core.strategies import DecisionKind, InstanceState

__all__ = [
    "ConfigError", "EndpointConfig", "FleetConfig", "PrefixAwareRoutingConfig", "RoutingConfig",
    "RoutingStrategy", "VariantConfig", "Endpoint", "Fleet", "UnknownEndpoint", "UnknownVariant",
    "InvalidRequest", "Decision", "Lease", "NoHealthyInstance", "VariantPool", "DecisionKind",
    "InstanceState",
]
