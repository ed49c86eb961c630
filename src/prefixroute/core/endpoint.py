"""Endpoints: named fronts with weighted production variants, each a :class:`VariantPool`,
and inference components, each a pool of its own copies.

Sans-I/O. The HTTP router holds one :class:`Fleet`; it resolves an endpoint by name,
picks a variant (the one targeted by ``X-Amzn-SageMaker-Target-Variant``, else by
weight among the variants that have a healthy instance) or an inference component
(:mod:`prefixroute.core.selection` decides which), and asks that pool for an instance.

An inference component's pool holds its copies: its own :class:`InstanceState` per
instance (in-flight counts and ``ConcurrencyThreshold`` per copy, as SageMaker counts
them), its own routing configuration and strategy state. Its ``name`` is the variant it
lives on; its ``component`` the component's name.
"""

from __future__ import annotations

import random
from typing import TYPE_CHECKING, Sequence

from prefixroute.core.config import EndpointConfig, FleetConfig, InferenceComponentConfig, RoutingConfig
from prefixroute.core.pool import VariantPool

if TYPE_CHECKING:
    from prefixroute.core.approx_cache import ViewBudget
    from prefixroute.core.catalog import ModelCatalog
    from prefixroute.core.counters import InFlightTable

__all__ = ["UnknownEndpoint", "UnknownVariant", "UnknownComponent", "Endpoint", "Fleet"]


class UnknownEndpoint(LookupError):
    """No endpoint of that name (the HTTP drivers answer 404)."""


class UnknownVariant(LookupError):
    """The targeted production variant does not exist (the HTTP drivers answer 400)."""


class UnknownComponent(LookupError):
    """The named inference component does not exist on the endpoint (the HTTP drivers
    answer 400, SageMaker's ``ValidationError``)."""


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
        #: Inference component name -> the pool of its copies.
        self.components: dict[str, VariantPool] = {}
        #: ``ModelName`` -> inference component name.
        self.component_by_model: dict[str, str] = {}
        self.config = config
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
        self.config = config
        components: dict[str, VariantPool] = {}
        for k, c in enumerate(config.components):
            variant = config.component_variant(c)
            routing = config.component_routing(c)
            pool = self.components.get(c.name)
            if pool is not None and pool.name != variant.name:
                pool.close()  # moved to another variant: its copies' state is another's
                pool = None
            if c.discover:  # copies kept from what was discovered, within the variant
                members = set(variant.instances)
                ids = [i.instance_id for i in pool.instances if i.instance_id in members] if pool is not None else []
            else:
                ids = list(c.instances)
            if pool is None:
                pool = VariantPool(variant.name, ids, routing, None if seed is None else seed + 500 + k,
                                   view_budget=self._view_budget, component=c.name,
                                   **({} if self._counters is None else
                                      {"make_state": self._counters.states(self.name, f"{variant.name}\0{c.name}")}))
            else:
                pool.set_instances(ids)
                pool.set_routing(routing)
            components[c.name] = pool
        for name, gone in self.components.items():
            if name not in components:
                gone.close()
        self.components = components
        self.component_by_model = {c.model_name: c.name for c in config.components}

    def component(self, name: str) -> VariantPool:
        """The pool of inference component ``name``.

        Raises:
            UnknownComponent: no such component on this endpoint.
        """
        pool = self.components.get(name)
        if pool is None:
            known = ", ".join(self.components) or "none"
            raise UnknownComponent(f"Inference Component Name {name!r} is not valid for endpoint {self.name!r} "
                                   f"(inference components: {known})")
        return pool

    def component_config(self, name: str) -> InferenceComponentConfig:
        """The configuration of inference component ``name``.

        Raises:
            UnknownComponent: no such component on this endpoint.
        """
        self.component(name)
        return next(c for c in self.config.components if c.name == name)

    def discover_components(self, catalog: "ModelCatalog") -> bool:
        """Set the copies of every ``Instances: DISCOVER`` component to its variant's
        instances whose listed models include its ``ModelName`` (an unlisted instance
        hosts no copy: a request is never sent where the component is not known to
        run). Copies that stay keep their state. Returns whether any membership changed."""
        changed = False
        for c in self.config.components:
            if not c.discover:
                continue
            pool = self.components[c.name]
            serving = catalog.serving(c.model_name)
            variant = self.pools.get(pool.name)
            if variant is None:
                continue
            ids = [i.instance_id for i in variant.instances if i.instance_id in serving]
            if ids != [i.instance_id for i in pool.instances]:
                pool.set_instances(ids)
                changed = True
        return changed

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

    def all_pools(self) -> list[VariantPool]:
        """The variants' pools, then the components' pools."""
        return [*self.pools.values(), *self.components.values()]


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
                for pool in gone.all_pools():
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
        """``(endpoint name, pool)`` for every variant and every inference component of
        every endpoint (a component's pool has ``pool.component`` set)."""
        return [(e.name, p) for e in self.endpoints.values() for p in e.all_pools()]

    def discover_components(self, catalog: "ModelCatalog") -> bool:
        """:meth:`Endpoint.discover_components` on every endpoint; whether any changed."""
        changed = False
        for e in self.endpoints.values():
            changed = e.discover_components(catalog) or changed
        return changed
