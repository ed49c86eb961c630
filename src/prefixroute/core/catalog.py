"""What each instance serves: its models and LoRA adapters, learned from the engines.

Sans-I/O. The driver fetches each instance's ``GET /v1/models`` (at start and on every
health round) and scrapes its ``/metrics``; it hands the parsed answers to a
:class:`ModelCatalog`, which the routing core asks "which instances serve model M?"
(:meth:`ModelCatalog.serving`) before any strategy runs.

The shapes are vLLM's (vllm-project/vllm, ``vllm/entrypoints/openai/models/serving.py``):
``/v1/models`` answers ``{"object": "list", "data": [card, ...]}``; a base model's card
has ``id`` and ``root`` (its path) and no ``parent``; a LoRA adapter's card has
``id`` (its ``lora_name``), ``root`` (its ``lora_path``) and ``parent`` (the base model's
id). The gauge ``vllm:lora_requests_info`` carries ``running_lora_adapters`` and
``waiting_lora_adapters`` (comma-separated adapter names) and ``max_lora`` (adapter
slots: adapters one batch can serve, vLLM's ``--max-loras``).

An instance whose list is unknown (never fetched, or it serves no ``/v1/models``, as a
SageMaker container may not) is *unlisted*: :meth:`ModelCatalog.serving` leaves the
decision to the caller (:mod:`prefixroute.core.selection` sends a request for a model
no listed instance serves to the unlisted ones).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

__all__ = ["ServedModels", "parse_model_list", "ModelCatalog"]

#: Most model cards one instance's list may hold (a bigger answer is refused, not stored).
MAX_CARDS = 4_096


def _same(a: "ServedModels", b: "ServedModels") -> bool:
    """Equal but for the cards' ``created`` (vLLM stamps every answer with the time)."""
    if (a.base, dict(a.adapters), dict(a.roots), a.max_lora) != (b.base, dict(b.adapters), dict(b.roots), b.max_lora):
        return False
    return [{k: v for k, v in c.items() if k != "created"} for c in a.cards] == \
        [{k: v for k, v in c.items() if k != "created"} for c in b.cards]


@dataclass(frozen=True, slots=True)
class ServedModels:
    """One instance's models.

    Attributes:
        base: ids of the base models (cards without ``parent``), in the engine's order.
        adapters: LoRA adapter id -> its parent (base model id).
        roots: id -> ``root`` (a base model's path, an adapter's ``lora_path``), when given.
        cards: the cards as the engine sent them (for a merged ``/v1/models``).
        max_lora: adapter slots reported by the engine (``vllm:lora_requests_info``'s
            ``max_lora``), or ``None``.
    """

    base: tuple[str, ...] = ()
    adapters: Mapping[str, str] = field(default_factory=dict)
    roots: Mapping[str, str] = field(default_factory=dict)
    cards: tuple[Mapping[str, Any], ...] = ()
    max_lora: int | None = None

    def serves(self, model: str) -> bool:
        """Whether ``model`` is one of its base models or adapters."""
        return model in self.adapters or model in self.base

    def with_adapter(self, name: str, parent: str, root: str | None) -> "ServedModels":
        """A copy with adapter ``name`` loaded (a card like vLLM's added)."""
        adapters = {**self.adapters, name: parent}
        roots = {**self.roots, name: root} if root else dict(self.roots)
        card: dict[str, Any] = {"id": name, "object": "model", "owned_by": "vllm", "root": root, "parent": parent}
        cards = tuple(c for c in self.cards if c.get("id") != name) + (card,)
        return ServedModels(self.base, adapters, roots, cards, self.max_lora)

    def without_adapter(self, name: str) -> "ServedModels":
        """A copy with adapter ``name`` unloaded."""
        adapters = {k: v for k, v in self.adapters.items() if k != name}
        roots = {k: v for k, v in self.roots.items() if k != name}
        return ServedModels(self.base, adapters, roots, tuple(c for c in self.cards if c.get("id") != name),
                            self.max_lora)


def parse_model_list(payload: Any, max_lora: int | None = None) -> ServedModels:
    """``GET /v1/models``'s answer (parsed JSON) as :class:`ServedModels`.

    Cards with an ``id`` and a string ``parent`` are adapters; other cards with an
    ``id`` are base models. Cards that are not objects, or have no string ``id``, are
    skipped.

    Raises:
        ValueError: not an object with a ``data`` list, or more than :data:`MAX_CARDS` cards.
    """
    if not isinstance(payload, dict) or not isinstance(payload.get("data"), list):
        raise ValueError("a model list must be an object with a 'data' list")
    data = payload["data"]
    if len(data) > MAX_CARDS:
        raise ValueError(f"a model list of {len(data):,} cards is over the limit of {MAX_CARDS:,}")
    base: list[str] = []
    adapters: dict[str, str] = {}
    roots: dict[str, str] = {}
    cards: list[Mapping[str, Any]] = []
    for card in data:
        if not isinstance(card, dict):
            continue
        mid = card.get("id")
        if not isinstance(mid, str) or not mid:
            continue
        parent = card.get("parent")
        root = card.get("root")
        if isinstance(parent, str) and parent and parent != mid:
            adapters[mid] = parent
        elif mid not in base:
            base.append(mid)
        if isinstance(root, str) and root:
            roots[mid] = root
        cards.append(card)
    return ServedModels(tuple(base), adapters, roots, tuple(cards), max_lora)


class ModelCatalog:
    """Every instance's :class:`ServedModels`, and the index "model -> instances".

    Single-threaded. Instances are keyed by id (base URL). :attr:`version` changes
    whenever any instance's list does, so callers may cache what they derive from it.

    A list fetched while the router itself loaded or unloaded an adapter on that
    instance may already be stale when it arrives: the driver reads
    :meth:`generation` before fetching and passes it to :meth:`set`, which then drops
    the answer if the router changed that instance since.
    """

    def __init__(self) -> None:
        self._served: dict[str, ServedModels] = {}
        self._generation: dict[str, int] = {}
        self._index: dict[str, frozenset[str]] | None = None
        self.version = 0

    # -- updates ------------------------------------------------------------------

    def generation(self, instance_id: str) -> int:
        """A counter of the router's own changes to ``instance_id`` (loads, unloads)."""
        return self._generation.get(instance_id, 0)

    def set(self, instance_id: str, served: ServedModels | None, generation: int | None = None) -> bool:
        """Record what ``instance_id`` serves (``None``: unlisted). With ``generation``
        (read by :meth:`generation` before the fetch), an answer overtaken by the
        router's own change is dropped. Returns whether anything changed."""
        if generation is not None and generation != self.generation(instance_id):
            return False
        old = self._served.get(instance_id)
        if served is None:
            if old is None:
                return False
            del self._served[instance_id]
        else:
            if old is not None and served.max_lora is None and old.max_lora is not None:
                served = ServedModels(served.base, served.adapters, served.roots, served.cards, old.max_lora)
            if old is not None and _same(old, served):
                return False
            self._served[instance_id] = served
        self._changed()
        return True

    def set_lora_info(self, instance_id: str, running: Iterable[str], max_lora: int | None,
                      generation: int | None = None) -> bool:
        """What the engine's ``vllm:lora_requests_info`` says: adapters it is serving
        now (running or waiting: loaded, so in their sticky sets, with the parent of
        the engine's first base model when ``/v1/models`` has not listed them yet) and
        its adapter slots. Ignored for an unlisted instance, and (as :meth:`set`) when
        the router changed the instance since ``generation``. Returns whether anything
        changed."""
        old = self._served.get(instance_id)
        if old is None or (generation is not None and generation != self.generation(instance_id)):
            return False
        served = old
        if max_lora is not None and max_lora != old.max_lora:
            served = ServedModels(old.base, old.adapters, old.roots, old.cards, max_lora)
        if served.base:
            for name in running:
                if name and name not in served.adapters and name not in served.base:
                    served = served.with_adapter(name, served.base[0], None)
        if served is old:
            return False
        self._served[instance_id] = served
        self._changed()
        return True

    def adapter_loaded(self, instance_id: str, name: str, parent: str, root: str | None) -> None:
        """The router loaded adapter ``name`` on ``instance_id`` (it is in the sticky set now)."""
        old = self._served.get(instance_id) or ServedModels()
        self._bump(instance_id)
        self._served[instance_id] = old.with_adapter(name, parent, root)
        self._changed()

    def adapter_unloading(self, instance_id: str, name: str) -> None:
        """The router is about to unload adapter ``name`` from ``instance_id``: it leaves
        the sticky set first, so that no request is sent there for it any more."""
        old = self._served.get(instance_id)
        self._bump(instance_id)
        if old is not None and name in old.adapters:
            self._served[instance_id] = old.without_adapter(name)
            self._changed()

    def forget(self, keep: Iterable[str]) -> None:
        """Drop the instances not in ``keep`` (no longer configured)."""
        keep = set(keep)
        gone = [i for i in self._served if i not in keep]
        for i in gone:
            del self._served[i]
        for i in [i for i in self._generation if i not in keep]:
            del self._generation[i]
        if gone:
            self._changed()

    def _bump(self, instance_id: str) -> None:
        self._generation[instance_id] = self.generation(instance_id) + 1

    def _changed(self) -> None:
        self._index = None
        self.version += 1

    # -- questions ----------------------------------------------------------------

    def get(self, instance_id: str) -> ServedModels | None:
        """What ``instance_id`` serves, or ``None`` if unlisted."""
        return self._served.get(instance_id)

    def listed(self, instance_id: str) -> bool:
        """Whether ``instance_id``'s list is known."""
        return instance_id in self._served

    def serving(self, model: str) -> frozenset[str]:
        """The listed instances that serve ``model`` (as a base model or an adapter)."""
        index = self._index
        if index is None:
            built: dict[str, set[str]] = {}
            for inst, served in self._served.items():
                for m in (*served.base, *served.adapters):
                    built.setdefault(m, set()).add(inst)
            index = self._index = {m: frozenset(s) for m, s in built.items()}
        return index.get(model, frozenset())

    def adapter_parent(self, model: str) -> str | None:
        """The base model of adapter ``model`` on any instance, or ``None`` if no listed
        instance has it as an adapter."""
        for served in self._served.values():
            parent = served.adapters.get(model)
            if parent is not None:
                return parent
        return None

    def adapter_root(self, model: str) -> str | None:
        """Where an instance that has adapter ``model`` loaded read it from (its card's
        ``root``), or ``None``."""
        for served in self._served.values():
            if model in served.adapters:
                root = served.roots.get(model)
                if root:
                    return root
        return None

    def sticky_set_sizes(self) -> dict[str, int]:
        """Adapter name -> how many listed instances have it loaded."""
        out: dict[str, int] = {}
        for served in self._served.values():
            for name in served.adapters:
                out[name] = out.get(name, 0) + 1
        return out

    def slots(self, instance_id: str, default: int | None = None) -> int | None:
        """Adapter slots of ``instance_id``: the engine's ``max_lora``, else ``default``."""
        served = self._served.get(instance_id)
        if served is not None and served.max_lora is not None:
            return served.max_lora
        return default

    def cards(self, instance_ids: Iterable[str]) -> list[Mapping[str, Any]]:
        """The union of the listed instances' cards (first card of each id kept), in
        order of the instances then of their lists; ``[]`` if none is listed."""
        seen: set[str] = set()
        out: list[Mapping[str, Any]] = []
        for inst in instance_ids:
            served = self._served.get(inst)
            if served is None:
                continue
            for card in served.cards:
                mid = card.get("id")
                if isinstance(mid, str) and mid not in seen:
                    seen.add(mid)
                    out.append(card)
        return out
