"""Endpoints: named fronts with weighted production variants, each a :class:`VariantPool`.

Sans-I/O. The HTTP router holds one :class:`Fleet`; it resolves an endpoint by name,
picks a variant (the one targeted by ``X-Amzn-SageMaker-Target-Variant``, else by
weight among the variants that have a healthy instance), and asks that variant's pool
for an instance.
"""

from __future__ import annotations

import random
from typing import TYPE_CHECKING, Sequence

from prefixroute.core.config import EndpointConfig, FleetConfig, RoutingConfig
from prefixroute.core.pool import VariantPool

if TYPE_CHECKING:
    from prefixroute.core.approx_cache import ViewBudget
    from prefixroute.core.counters import InFlightTable

__all__ = ["UnknownEndpoint", "UnknownVariant", "Endpoint", "Fleet"]


class UnknownEndpoint(LookupError):
    """No endpoint of that name (the HTTP drivers answer 404)."""


class UnknownVariant(LookupError):
    """The targeted production variant does not exist (the HTTP drivers answer 400)."""


class Endpoint:
    """One endpoint and its variant pools.

    Args:
        config: the validated endpoint configuration.
        seed: seeds variant choice and the pools' random choices (``None`` = OS entropy).
        counters: the shared in-flight table of ``serve --workers N``, or ``None``
            (counts local to this process).
        view_budget: the router-wide memory ceiling of what strategies learn
            (:class:`prefixroute.core.approx_cache.ViewBudget`), or ``None``.
    """

    def __init__(self, config: EndpointConfig, seed: int | None = None,
                 counters: "InFlightTable | None" = None, view_budget: "ViewBudget | None" = None) -> None:
        self.name = config.name
        self._rng = random.Random(seed)
        self._counters = counters
        self._view_budget = view_budget
        self.pools: dict[str, VariantPool] = {}
        self._weights: dict[str, float] = {}
        self._only: VariantPool | None = None  # the one variant, if there is one
        self.apply(config, seed)

    def apply(self, config: EndpointConfig, seed: int | None = None) -> None:
        """Adopt a new configuration. Pools of variants that stay keep their in-flight
        counts and instance state; routing and membership are updated in place."""
        pools: dict[str, VariantPool] = {}
        for i, v in enumerate(config.variants):
            pool = self.pools.get(v.name)
            if pool is None:
                pool = VariantPool(v.name, v.instances, v.routing, None if seed is None else seed + i,
                                   view_budget=self._view_budget,
                                   **({} if self._counters is None
                                      else {"make_state": self._counters.states(self.name, v.name)}))
            else:
                pool.set_instances(v.instances)
                pool.set_routing(v.routing)
            pools[v.name] = pool
        for name, gone in self.pools.items():
            if name not in pools:
                gone.close()  # a retry of a request still on it gets no instance
        self.pools = pools
        self._only = next(iter(pools.values())) if len(pools) == 1 else None
        self._weights = {v.name: v.weight for v in config.variants}

    def variant(self, target: str | None = None) -> VariantPool:
        """The targeted variant, or one drawn by weight.

        The draw is among the variants with at least one healthy instance: a variant
        whose instances are all out of rotation gets no weight, so its share goes to
        the others in proportion to theirs (as SageMaker moves traffic off a variant
        that fails its health checks). When no variant has a healthy instance the draw
        is over all of them (the pool then refuses: the drivers answer 503). A targeted
        variant is returned whatever its health: the caller named it.

        Raises:
            UnknownVariant: ``target`` names no variant of this endpoint.
        """
        if target:
            pool = self.pools.get(target)
            if pool is None:
                raise UnknownVariant(
                    f"endpoint {self.name!r} has no production variant {target!r} "
                    f"(variants: {', '.join(self.pools)})"
                )
            return pool
        if self._only is not None:
            return self._only
        pools = self.pools
        names = [n for n in self._weights if pools[n].has_healthy] or list(self._weights)
        if len(names) == 1:
            return pools[names[0]]
        return pools[self._rng.choices(names, weights=[self._weights[n] for n in names])[0]]

    def set_routing(self, variant: str, routing: RoutingConfig) -> None:
        """Switch one variant's routing without a restart.

        Raises:
            UnknownVariant: no such variant.
        """
        self.variant(variant).set_routing(routing)


class Fleet:
    """All endpoints. The first configured endpoint is the default (serves ``/v1/...``).

    ``counters``: the shared in-flight table of ``serve --workers N`` (every pool's
    instances count there), or ``None`` for counts local to this process.
    ``view_budget``: one memory ceiling for what every pool's strategy learns
    (:class:`prefixroute.core.approx_cache.ViewBudget`), or ``None``.
    """

    def __init__(self, config: FleetConfig, seed: int | None = None,
                 counters: "InFlightTable | None" = None, view_budget: "ViewBudget | None" = None) -> None:
        self.endpoints: dict[str, Endpoint] = {}
        self._counters = counters
        self.view_budget = view_budget
        self.default_name = config.endpoints[0].name
        self.config = config
        self.apply(config, seed)

    def apply(self, config: FleetConfig, seed: int | None = None) -> None:
        """Adopt a new validated configuration, keeping the state of what stays."""
        endpoints: dict[str, Endpoint] = {}
        for j, e in enumerate(config.endpoints):
            ep = self.endpoints.get(e.name)
            sub_seed = None if seed is None else seed + 1000 * j
            if ep is None:
                ep = Endpoint(e, sub_seed, self._counters, self.view_budget)
            else:
                ep.apply(e, sub_seed)
            endpoints[e.name] = ep
        for name, gone in self.endpoints.items():
            if name not in endpoints:
                for pool in gone.pools.values():
                    pool.close()
        self.endpoints = endpoints
        self.default_name = config.endpoints[0].name
        self.config = config

    @property
    def default(self) -> Endpoint:
        return self.endpoints[self.default_name]

    def endpoint(self, name: str | None = None) -> Endpoint:
        """The named endpoint (the default one for ``None``).

        Raises:
            UnknownEndpoint: no endpoint of that name.
        """
        if name is None:
            return self.endpoints[self.default_name]
        ep = self.endpoints.get(name)
        if ep is None:
            raise UnknownEndpoint(f"endpoint {name!r} not found (endpoints: {', '.join(self.endpoints)})")
        return ep

    def all_pools(self) -> Sequence[tuple[str, VariantPool]]:
        """``(endpoint name, pool)`` for every variant of every endpoint."""
        return [(e.name, p) for e in self.endpoints.values() for p in e.pools.values()]
