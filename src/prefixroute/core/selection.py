"""Pool selection: from a request's endpoint, variant, inference component and model to
the pool and the candidate instances its strategy may choose among.

Sans-I/O, and before any strategy runs::

    request -> routing key (core.keys)
    endpoint, variant, component, model, adapter -> pool + candidates   (this module)
    strategy + per-instance state -> decision (core.pool, core.strategies)

Rules (:meth:`Selector.select`):

1. **An inference component** named by the request (header, path) selects its pool:
   only its copies are candidates. Unknown name: :class:`~prefixroute.core.endpoint.UnknownComponent`.
2. **A model** that is an inference component's ``ModelName``, or a LoRA adapter of it,
   selects that component's pool, as if it were named (the OpenAI API has no component
   header).
3. A native request (``/invocations``) to an endpoint that has inference components
   must name one (:class:`ComponentRequired`, SageMaker's rule).
4. Otherwise the production variant (targeted, else drawn by weight) and, when the
   request names a ``model``, the variant's instances that serve it (learned from
   their ``/v1/models``: :class:`~prefixroute.core.catalog.ModelCatalog`). If the drawn
   variant serves it nowhere and no variant is targeted, another variant that does is
   used. A model that is a LoRA adapter restricts the candidates to its **sticky set**
   (the instances that have it loaded), within a component's copies too.
5. A model no listed instance serves goes to the instances whose list is unknown (an
   engine without ``/v1/models``), or, with ``LoraAdapters.Autoload`` and a path known for
   it, is an adapter with an empty sticky set (the driver loads it); else
   :class:`UnknownModel` (404 ``model_not_found``), unless ``unknown_model="any"``. An
   adapter (declared in ``LoraAdapters``, or listed as one by any instance) that no
   instance of the pool has loaded is unknown there without Autoload, whatever
   ``unknown_model`` and even in a component named by header or path: no request goes
   to an instance that does not have its adapter.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from prefixroute.core.catalog import ModelCatalog
from prefixroute.core.lora_config import LoraAdaptersConfig

if TYPE_CHECKING:
    from prefixroute.core.endpoint import Endpoint
    from prefixroute.core.pool import VariantPool

__all__ = ["Selection", "Selector", "UnknownModel", "ComponentRequired", "UNKNOWN_MODEL_MODES"]

#: What a request for a model no instance lists gets: ``reject`` (404, the default) or
#: ``any`` (routed among all the pool's instances: engines that ignore ``model``).
UNKNOWN_MODEL_MODES = ("reject", "any")
_CACHE_SIZE = 4_096


class UnknownModel(LookupError):
    """No instance of the endpoint serves the requested model (the HTTP drivers answer
    404 with OpenAI's ``model_not_found``)."""


class ComponentRequired(LookupError):
    """A native request to an endpoint with inference components named none (400,
    SageMaker's ``ValidationError``)."""


@dataclass(frozen=True, slots=True)
class Selection:
    """Where a request may go.

    Attributes:
        pool: the variant's or the inference component's pool.
        only: the candidate instance ids, or ``None`` for every instance of the pool.
            An adapter loaded nowhere (autoload on) has ``frozenset()``.
        model: the requested model (``None`` when the request named none).
        adapter: the model's name when it is a LoRA adapter (``only`` is then its
            sticky set), else ``None``.
        parent: the adapter's base model, when known.
    """

    pool: "VariantPool"
    only: frozenset[str] | None = None
    model: str | None = None
    adapter: str | None = None
    parent: str | None = None

    @property
    def component(self) -> str | None:
        """The inference component, or ``None``."""
        return self.pool.component


class Selector:
    """Selects pools and candidates (see the module docstring) over one catalog.

    Args:
        catalog: what each instance serves.
        unknown_model: ``reject`` or ``any`` (:data:`UNKNOWN_MODEL_MODES`).

    Raises:
        ValueError: an unknown ``unknown_model``.
    """

    def __init__(self, catalog: ModelCatalog, unknown_model: str = "reject") -> None:
        if unknown_model not in UNKNOWN_MODEL_MODES:
            raise ValueError(f"unknown_model must be one of {', '.join(UNKNOWN_MODEL_MODES)}, got {unknown_model!r}")
        self.catalog = catalog
        self.unknown_model = unknown_model
        self._cache: dict[tuple[int, str, bool], tuple[int, int, int, Selection | None]] = {}

    def select(self, endpoint: "Endpoint", *, variant: str | None = None, component: str | None = None,
               model: str | None = None, native: bool = False) -> Selection:
        """The pool and candidates of a request (see the module docstring).

        Args:
            endpoint: the request's endpoint.
            variant: ``X-Amzn-SageMaker-Target-Variant``, or ``None``.
            component: the inference component named by header or path, or ``None``.
            model: the body's ``model`` (OpenAI API), or ``None``.
            native: the request came on the native API (``/invocations``).

        Raises:
            UnknownVariant: ``variant`` names no variant.
            UnknownComponent: ``component`` names no component.
            ComponentRequired: native, no component, and the endpoint has components.
            UnknownModel: no instance serves ``model`` (and ``unknown_model`` is ``reject``).
        """
        lora = endpoint.config.lora
        if component:
            found = self._within(endpoint.component(component), model, lora, strict=False)
            if found is None:  # an adapter loaded on none of the component's copies
                raise UnknownModel(f"The model `{model}` does not exist on inference component {component!r}.")
            return found
        if model:
            by_model = endpoint.component_by_model.get(model)
            if by_model is None and endpoint.component_by_model:  # an adapter of a component's model
                declared = lora.path_of(model)
                parent = self.catalog.adapter_parent(model) or (declared.base_model if declared else None)
                by_model = endpoint.component_by_model.get(parent) if parent else None
            if by_model is not None:
                pool = endpoint.components[by_model]
                if variant is None or variant == pool.name:
                    found = self._within(pool, model, lora, strict=False)
                    if found is None:
                        raise UnknownModel(f"The model `{model}` does not exist on endpoint {endpoint.name!r}.")
                    return found
        if native and endpoint.components:
            raise ComponentRequired(
                f"endpoint {endpoint.name!r} hosts inference components: name one with "
                f"X-Amzn-SageMaker-Inference-Component (InferenceComponentName); "
                f"components: {', '.join(endpoint.components)}")
        pool = endpoint.variant(variant)
        if not model:
            return Selection(pool)
        found = self._within(pool, model, lora, strict=True)
        if found is None and variant is None and len(endpoint.pools) > 1:
            for other in endpoint.pools.values():
                if other is not pool:
                    found = self._within(other, model, lora, strict=True)
                    if found is not None:
                        break
        if found is None:
            raise UnknownModel(f"The model `{model}` does not exist on endpoint {endpoint.name!r}.")
        return found

    def _within(self, pool: "VariantPool", model: str | None, lora: LoraAdaptersConfig,
                strict: bool) -> Selection | None:
        if not model:
            return Selection(pool)
        cache_key = (id(pool), model, strict)
        catalog = self.catalog
        hit = self._cache.get(cache_key)
        stamp = (catalog.version, pool.membership_version, id(lora))
        if hit is not None and hit[:3] == stamp:
            return hit[3]
        found = self._compute(pool, model, lora, strict)
        if len(self._cache) >= _CACHE_SIZE:
            self._cache.clear()
        self._cache[cache_key] = (*stamp, found)
        return found

    def _compute(self, pool: "VariantPool", model: str, lora: LoraAdaptersConfig, strict: bool) -> Selection | None:
        catalog = self.catalog
        ids = [s.instance_id for s in pool.instances]
        if not ids:  # nothing to serve it (yet): the pool answers (503), not "unknown model"
            return Selection(pool, None, model)
        serving = catalog.serving(model)
        parent = catalog.adapter_parent(model)
        declared = lora.path_of(model)
        members = frozenset(i for i in ids if i in serving)
        if members:
            adapter = model if parent is not None or declared is not None else None
            only = None if len(members) == len(ids) else members
            return Selection(pool, only, model, adapter, parent or (declared.base_model if declared else None))
        if lora.autoload and (declared is not None or catalog.adapter_root(model) is not None):
            base = parent or (declared.base_model if declared else None)
            return Selection(pool, frozenset(), model, model, base)
        unlisted = frozenset(i for i in ids if not catalog.listed(i))
        if unlisted:
            return Selection(pool, None if len(unlisted) == len(ids) else unlisted, model)
        if parent is not None or declared is not None:
            # An adapter (declared, or listed by an instance elsewhere) that no instance
            # of this pool has loaded, without Autoload: unknown here, even in a pool
            # named by header (a copy without it would refuse it).
            return None
        if not strict or self.unknown_model == "any":
            return Selection(pool, None, model)
        return None
