"""LoRA adapter settings of an endpoint (``LoraAdapters:`` in the fleet YAML).

Validated once, into frozen models, like the rest of :mod:`prefixroute.core.config`::

    LoraAdapters:
      Autoload: true                     # load an adapter where its sticky set can grow (opt-in)
      MaxAdaptersPerInstance: 2          # when the engine does not report vLLM's max_lora
      RetryAfterSeconds: 1               # Retry-After of the 429 for a saturated sticky set
      IdleSeconds: 60                    # a copy may be unloaded after this long without a request
      Adapters:                          # what the router may load, and from where
        - {LoraName: sql-lora, LoraPath: /adapters/sql-lora, BaseModelName: meta-llama/Llama-3.1-8B-Instruct}

A request names an adapter in its ``model`` field (vLLM's API). The instances that have
the adapter loaded are its *sticky set* (learned from each instance's ``/v1/models``,
whose adapter cards carry ``parent`` and ``root``, and from vLLM's
``vllm:lora_requests_info`` metric); the request is routed only among them.

Errors: :class:`prefixroute.core.config.ConfigError` through the fleet's validation,
naming the field, the value and what is allowed.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

__all__ = ["LoraAdapterConfig", "LoraAdaptersConfig"]


class LoraAdapterConfig(BaseModel):
    """One adapter the router may load on an instance.

    Attributes:
        name: ``LoraName``: the name requests use in ``model`` (vLLM's ``lora_name``).
        path: ``LoraPath``: where the engine reads it (vLLM's ``lora_path``: a
            directory on the engine's host, or what its resolver understands).
        base_model: ``BaseModelName``: the base model it applies to; ``None`` = any
            instance's base model (vLLM then uses its first served model).
    """

    model_config = ConfigDict(frozen=True, populate_by_name=True, extra="forbid")

    name: str = Field(alias="LoraName", min_length=1, max_length=256)
    path: str = Field(alias="LoraPath", min_length=1, max_length=4096)
    base_model: str | None = Field(default=None, alias="BaseModelName", min_length=1, max_length=256)


class LoraAdaptersConfig(BaseModel):
    """How an endpoint treats LoRA adapters.

    Attributes:
        autoload: ``Autoload`` (default ``False``): when an adapter's sticky set is
            saturated (every instance of it at ``ConcurrencyThreshold``) or empty, load it
            on the least loaded instance of its base model that has a free adapter slot
            or a copy of another adapter to unload (one idle: ``IdleSeconds``; to place
            an adapter loaded nowhere also a spare copy, its adapter loaded elsewhere
            too, with nothing in flight), and route the request there once it is loaded; a saturated set that cannot grow
            takes the request anyway, an adapter loaded nowhere that cannot be placed
            gets the 429. One router process only (not with
            ``serve --workers N``). Off: a saturated set answers 429 with
            ``Retry-After``, an adapter loaded nowhere is an unknown model (404).
        adapters: ``Adapters``: adapters the router may load, by name. Adapters seen
            loaded on an instance (``/v1/models``: ``root`` is the path) may be loaded
            elsewhere too.
        max_adapters_per_instance: ``MaxAdaptersPerInstance``, 1-1,024: adapter slots of
            an instance whose engine does not report them (vLLM reports ``max_lora``,
            its ``--max-loras``, in ``vllm:lora_requests_info``); ``None``: unbounded.
        retry_after_s: ``RetryAfterSeconds``, 1-3,600: the ``Retry-After`` of a 429.
        load_timeout_s: ``LoadTimeoutSeconds``, 1-3,600: how long one load may take
            before the router gives up on it (the request then gets the 429).
        idle_s: ``IdleSeconds``, 0.1-86,400: how long a copy must have had no request
            (none in flight, none started or ended) before autoload may unload it to
            make room; ``None`` (the default): ``LoadTimeoutSeconds``, so an unload never
            adds to the adapter's next request a wait (one load) longer than the silence
            that allowed it (:mod:`prefixroute.core.adapters`). Only to place an adapter
            loaded nowhere may a spare copy (its adapter loaded elsewhere too) go
            sooner, once nothing is in flight for it.
    """

    model_config = ConfigDict(frozen=True, populate_by_name=True, extra="forbid")

    autoload: bool = Field(default=False, alias="Autoload")
    adapters: tuple[LoraAdapterConfig, ...] = Field(default=(), alias="Adapters")
    max_adapters_per_instance: int | None = Field(default=None, alias="MaxAdaptersPerInstance", ge=1, le=1_024)
    retry_after_s: int = Field(default=1, alias="RetryAfterSeconds", ge=1, le=3_600)
    load_timeout_s: float = Field(default=60.0, alias="LoadTimeoutSeconds", ge=1.0, le=3_600.0)
    idle_s: float | None = Field(default=None, alias="IdleSeconds", ge=0.1, le=86_400.0, allow_inf_nan=False)

    @field_validator("autoload", mode="before")
    @classmethod
    def _v_autoload(cls, v: object) -> object:
        if not isinstance(v, bool):
            raise ValueError(f"Autoload: {v!r} is not true or false")
        return v

    @field_validator("idle_s", mode="before")
    @classmethod
    def _v_idle(cls, v: object) -> object:
        if isinstance(v, bool):
            raise ValueError(f"IdleSeconds: {v!r} is not a number of seconds")
        return v

    @model_validator(mode="after")
    def _v_unique(self) -> "LoraAdaptersConfig":
        names = [a.name for a in self.adapters]
        repeated = sorted({n for n in names if names.count(n) > 1})
        if repeated:
            raise ValueError(f"Adapters: duplicate LoraName {', '.join(map(repr, repeated[:10]))}")
        return self

    @property
    def idle_after_s(self) -> float:
        """``IdleSeconds``, or ``LoadTimeoutSeconds`` when it is not set."""
        return self.idle_s if self.idle_s is not None else self.load_timeout_s

    def path_of(self, name: str) -> LoraAdapterConfig | None:
        """The declared adapter called ``name``, if any."""
        for a in self.adapters:
            if a.name == name:
                return a
        return None
