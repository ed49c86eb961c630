"""Routing configuration, validated once at the edge into immutable typed objects.

Names follow SageMaker's API (SPEC §2): a production variant has a ``RoutingConfig``
with a ``RoutingStrategy`` and, for ``PREFIX_AWARE``, a ``PrefixAwareRoutingConfig``
with ``PrefixLength`` and ``ConcurrencyThreshold``. Python attribute names are
snake_case; the SageMaker CamelCase names are accepted as aliases (YAML, admin API).

Errors: every constructor raises :class:`ConfigError` whose message names the field,
the value and the allowed range, e.g.
``PrefixAwareRoutingConfig.PrefixLength: 100 is out of range (allowed 1,024-65,536)``.
"""

from __future__ import annotations

import enum
import re
from typing import Any
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from prefixroute.core.config_errors import (
    MAX_ERROR_CLAUSES,  # noqa: F401 (re-exported from its old home)
    ConfigError,
    _dupes,
    _shown,
    _with_lines,
    format_validation_error,
    parse_model,
)
from prefixroute.core.discovery_config import DiscoveryConfig
from prefixroute.core.kvevents.config import KvEventsConfig
from prefixroute.core.lora_config import LoraAdaptersConfig
from prefixroute.core.tiers import KvTiersConfig

__all__ = [
    "ConfigError",
    "RoutingStrategy",
    "NativeKey",
    "PrefixAwareRoutingConfig",
    "CacheAwareRoutingConfig",
    "RoutingConfig",
    "PREFIX_LENGTH_RANGE",
    "CONCURRENCY_THRESHOLD_RANGE",
    "format_validation_error",
    "parse_model",
    "VariantConfig",
    "InferenceComponentConfig",
    "DISCOVER",
    "EndpointConfig",
    "FleetConfig",
]

#: Allowed PrefixLength (bytes on the native API, characters on the OpenAI API); SageMaker's range.
PREFIX_LENGTH_RANGE = (1_024, 65_536)
#: Allowed ConcurrencyThreshold (requests in flight on one instance); SageMaker's range.
CONCURRENCY_THRESHOLD_RANGE = (1, 1_024)


class RoutingStrategy(str, enum.Enum):
    """How a production variant picks an instance (SPEC §2)."""

    RANDOM = "RANDOM"
    LEAST_OUTSTANDING_REQUESTS = "LEAST_OUTSTANDING_REQUESTS"
    PREFIX_AWARE = "PREFIX_AWARE"
    #: prefixroute's own: chained block hashes matched against a learned, bounded view of
    #: each instance's cache, weighed against load (:mod:`prefixroute.core.cache_aware`).
    CACHE_AWARE = "CACHE_AWARE"
    #: A re-implementation of llm-d's documented default scorers (prefix cache 3, queue 2,
    #: KV-cache utilisation 2, highest score wins), for comparisons
    #: (:mod:`prefixroute.core.llmd_reference`); not prefixroute's own policy.
    LLMD_REFERENCE = "LLMD_REFERENCE"

    @classmethod
    def parse(cls, value: "str | RoutingStrategy") -> "RoutingStrategy":
        """Accept ``PREFIX_AWARE``, ``prefix_aware``, ``prefix-aware`` (any case).

        Raises:
            ConfigError: not a known strategy; the message lists the known ones.
        """
        if isinstance(value, RoutingStrategy):
            return value
        norm = str(value).strip().upper().replace("-", "_")
        try:
            return cls(norm)
        except ValueError:
            known = ", ".join(s.value for s in cls)
            raise ConfigError(f"RoutingStrategy: unknown strategy {value!r} (known: {known})") from None

    @property
    def cli_name(self) -> str:
        """The kebab-case spelling used on the command line, e.g. ``prefix-aware``."""
        return self.value.lower().replace("_", "-")


def _check_range(field: str, value: int, lo: int, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{field}: {value!r} is not an integer (allowed {lo:,}-{hi:,})")
    if not lo <= value <= hi:
        raise ValueError(f"{field}: {value:,} is out of range (allowed {lo:,}-{hi:,})")
    return value


class PrefixAwareRoutingConfig(BaseModel):
    """Settings of ``PREFIX_AWARE`` routing (SageMaker ``PrefixAwareRoutingConfig``).

    Attributes:
        prefix_length: ``PrefixLength``, 1,024-65,536. How much of the request takes
            part in the key: bytes of the raw body (native API) or characters of the
            extracted text (OpenAI API).
        concurrency_threshold: ``ConcurrencyThreshold``, 1-1,024. Requests in flight
            on the preferred instance at which a new request overflows.
    """

    model_config = ConfigDict(frozen=True, populate_by_name=True, extra="forbid")

    prefix_length: int = Field(alias="PrefixLength")
    concurrency_threshold: int = Field(alias="ConcurrencyThreshold")

    @field_validator("prefix_length", mode="before")
    @classmethod
    def _v_prefix_length(cls, v: Any) -> int:
        return _check_range("PrefixAwareRoutingConfig.PrefixLength", v, *PREFIX_LENGTH_RANGE)

    @field_validator("concurrency_threshold", mode="before")
    @classmethod
    def _v_threshold(cls, v: Any) -> int:
        return _check_range("PrefixAwareRoutingConfig.ConcurrencyThreshold", v, *CONCURRENCY_THRESHOLD_RANGE)

    def to_api(self) -> dict[str, int]:
        """SageMaker-shaped dict: ``{"PrefixLength": ..., "ConcurrencyThreshold": ...}``."""
        return {"PrefixLength": self.prefix_length, "ConcurrencyThreshold": self.concurrency_threshold}


#: Allowed CACHE_AWARE block size (characters / bytes of routing text per hashed block).
BLOCK_SIZE_RANGE = (16, 4_096)
#: Allowed CACHE_AWARE MaxPrefixLength (how much routing text is hashed into blocks).
MAX_PREFIX_LENGTH_RANGE = (1_024, 1_048_576)


class CacheAwareRoutingConfig(BaseModel):
    """Settings of ``CACHE_AWARE`` routing (:mod:`prefixroute.core.cache_aware`).

    Attributes:
        concurrency_threshold: ``ConcurrencyThreshold``, 1-1,024. An instance with this
            many requests in flight gets no new request while another is below it.
        block_size: ``BlockSize``, 16-4,096 units of routing text (characters on the
            OpenAI API, bytes on the native API) per hashed block. 64 characters is about
            16 tokens, one vLLM KV block of English text.
        max_prefix_length: ``MaxPrefixLength``, 1,024-1,048,576 units: how much of the
            routing text is hashed (a cap on per-request work, not a key length).
        instance_cache_tokens: ``InstanceCacheTokens``: the prompt tokens the router's
            approximate view remembers per instance (LRU); set it near the engine's KV
            capacity (vLLM Llama-3.1-70B on 8xH100: ~1.2M tokens). Converted to blocks at
            4 units per token. Memory is about 100 bytes per block.
        load_weight: ``LoadWeight``, blocks of prefill (``BlockSize`` units each) that one
            more request in flight on an instance costs a new request there: the decode
            share of the cost model. 0.5 (32 characters, about 8 tokens) is the
            reference engine's: 0.1 ms per decoding sequence per step against 35 µs per
            prefilled token (docs/ENGINE.md). Higher values spread load more, lower values
            chase hits.
        media_tokens: ``MediaTokens``, 0-100,000: prompt tokens an image, audio or file
            part of a chat request stands for. The routing text weighs each such part as
            this many tokens (x 4 characters), so a repeated image keeps its instance as
            a repeated document does. 576 is LLaVA-1.5's 24 x 24 image patches.
        kv_tiers: ``KvTiers``: the engines' CPU and shared KV tiers and their costs
            (:class:`prefixroute.core.tiers.KvTiersConfig`), or ``None``: the engines
            have none (precise mode still weighs the tiers its events report).
    """

    model_config = ConfigDict(frozen=True, populate_by_name=True, extra="forbid")

    concurrency_threshold: int = Field(alias="ConcurrencyThreshold")
    block_size: int = Field(default=64, alias="BlockSize")
    max_prefix_length: int = Field(default=131_072, alias="MaxPrefixLength")
    instance_cache_tokens: int = Field(default=1_200_000, alias="InstanceCacheTokens", ge=1_024, le=100_000_000)
    load_weight: float = Field(default=0.5, alias="LoadWeight", ge=0.0, le=1e6)
    media_tokens: int = Field(default=576, alias="MediaTokens", ge=0, le=100_000)
    kv_tiers: KvTiersConfig | None = Field(default=None, alias="KvTiers")

    @field_validator("concurrency_threshold", mode="before")
    @classmethod
    def _v_threshold(cls, v: Any) -> int:
        return _check_range("CacheAwareRoutingConfig.ConcurrencyThreshold", v, *CONCURRENCY_THRESHOLD_RANGE)

    @field_validator("block_size", mode="before")
    @classmethod
    def _v_block(cls, v: Any) -> int:
        return _check_range("CacheAwareRoutingConfig.BlockSize", v, *BLOCK_SIZE_RANGE)

    @field_validator("max_prefix_length", mode="before")
    @classmethod
    def _v_max(cls, v: Any) -> int:
        return _check_range("CacheAwareRoutingConfig.MaxPrefixLength", v, *MAX_PREFIX_LENGTH_RANGE)

    @property
    def instance_cache_blocks(self) -> int:
        """Per-instance LRU budget in blocks (4 units of routing text per token)."""
        return max(1, self.instance_cache_tokens * 4 // self.block_size)

    def to_api(self) -> dict[str, Any]:
        """SageMaker-style dict of every setting."""
        out = {"ConcurrencyThreshold": self.concurrency_threshold, "BlockSize": self.block_size,
               "MaxPrefixLength": self.max_prefix_length, "InstanceCacheTokens": self.instance_cache_tokens,
               "LoadWeight": self.load_weight, "MediaTokens": self.media_tokens}
        if self.kv_tiers is not None:
            out["KvTiers"] = self.kv_tiers.to_api()
        return out


class NativeKey(str, enum.Enum):
    """What a native (``/invocations``) request is keyed on."""

    #: The first PrefixLength bytes of the raw body, as SageMaker does (the default).
    RAW_BYTES = "RAW_BYTES"
    #: A JSON object body re-serialized canonically (sorted keys, no insignificant
    #: whitespace, sampling settings left out: :func:`prefixroute.core.keys.canonical_prompt_json`),
    #: so clients that serialize the same prompt differently share an instance. Any
    #: other body is keyed on its raw bytes.
    CANONICAL_JSON = "CANONICAL_JSON"


class RoutingConfig(BaseModel):
    """A production variant's routing (SageMaker ``RoutingConfig``).

    ``prefix_aware`` is required with ``PREFIX_AWARE`` and ignored (kept) otherwise.
    ``native_key`` (``NativeKey``, prefixroute's own) chooses what native requests
    are keyed on; ``RAW_BYTES`` by default, for SageMaker parity.
    """

    model_config = ConfigDict(frozen=True, populate_by_name=True, extra="forbid")

    strategy: RoutingStrategy = Field(default=RoutingStrategy.RANDOM, alias="RoutingStrategy")
    prefix_aware: PrefixAwareRoutingConfig | None = Field(default=None, alias="PrefixAwareRoutingConfig")
    cache_aware: CacheAwareRoutingConfig | None = Field(default=None, alias="CacheAwareRoutingConfig")
    native_key: NativeKey = Field(default=NativeKey.RAW_BYTES, alias="NativeKey")

    @field_validator("native_key", mode="before")
    @classmethod
    def _v_native_key(cls, v: Any) -> NativeKey:
        if isinstance(v, NativeKey):
            return v
        norm = str(v).strip().upper().replace("-", "_")
        try:
            return NativeKey(norm)
        except ValueError:
            raise ValueError(f"NativeKey: unknown value {v!r} (known: RAW_BYTES, CANONICAL_JSON)") from None

    @property
    def canonical_native_key(self) -> bool:
        """Whether native JSON bodies are keyed canonically (``NativeKey: CANONICAL_JSON``)."""
        return self.native_key is NativeKey.CANONICAL_JSON

    @field_validator("strategy", mode="before")
    @classmethod
    def _v_strategy(cls, v: Any) -> RoutingStrategy:
        try:
            return RoutingStrategy.parse(v)
        except ConfigError as exc:
            raise ValueError(str(exc)) from None

    @model_validator(mode="after")
    def _v_required(self) -> "RoutingConfig":
        if self.strategy is RoutingStrategy.PREFIX_AWARE and self.prefix_aware is None:
            raise ValueError(
                "PrefixAwareRoutingConfig (PrefixLength and ConcurrencyThreshold) is required "
                "with RoutingStrategy PREFIX_AWARE"
            )
        if self.strategy is RoutingStrategy.CACHE_AWARE and self.cache_aware is None:
            raise ValueError(
                "CacheAwareRoutingConfig (at least ConcurrencyThreshold) is required with RoutingStrategy CACHE_AWARE"
            )
        return self

    @classmethod
    def build(
        cls,
        strategy: "str | RoutingStrategy" = RoutingStrategy.RANDOM,
        prefix_length: int | None = None,
        concurrency_threshold: int | None = None,
        native_key: "str | NativeKey | None" = None,
        **cache_aware: Any,
    ) -> "RoutingConfig":
        """Validate a config from plain values (CLI flags).

        For ``CACHE_AWARE``, ``concurrency_threshold`` and the keyword arguments
        (``block_size``, ``max_prefix_length``, ``instance_cache_tokens``, ``load_weight``,
        ``media_tokens``, ``kv_tiers``; ``None`` = default) fill ``CacheAwareRoutingConfig``;
        ``prefix_length`` is unused. ``native_key``: ``RAW_BYTES`` (default) or
        ``CANONICAL_JSON``.

        Raises:
            ConfigError: a value is out of range or a required one is missing.
        """
        parsed = RoutingStrategy.parse(strategy)
        data: dict[str, Any] = {"RoutingStrategy": parsed}
        if native_key is not None:
            data["NativeKey"] = native_key
        if parsed is RoutingStrategy.CACHE_AWARE:
            fields = CacheAwareRoutingConfig.model_fields
            unknown = set(cache_aware) - set(fields)
            if unknown:
                raise ConfigError(f"CacheAwareRoutingConfig: unknown setting(s) {sorted(unknown)}")
            ca: dict[str, Any] = {fields[k].alias: v for k, v in cache_aware.items() if v is not None}
            if concurrency_threshold is not None:
                ca["ConcurrencyThreshold"] = concurrency_threshold
            data["CacheAwareRoutingConfig"] = ca
        elif prefix_length is not None or concurrency_threshold is not None:
            pa: dict[str, Any] = {}
            if prefix_length is not None:
                pa["PrefixLength"] = prefix_length
            if concurrency_threshold is not None:
                pa["ConcurrencyThreshold"] = concurrency_threshold
            data["PrefixAwareRoutingConfig"] = pa
        return parse_model(cls, data)

    @property
    def concurrency_threshold(self) -> int | None:
        """The active strategy's ConcurrencyThreshold, if it has one."""
        if self.strategy is RoutingStrategy.PREFIX_AWARE and self.prefix_aware is not None:
            return self.prefix_aware.concurrency_threshold
        if self.strategy is RoutingStrategy.CACHE_AWARE and self.cache_aware is not None:
            return self.cache_aware.concurrency_threshold
        return None

    def to_api(self) -> dict[str, Any]:
        """SageMaker-shaped dict (``NativeKey`` only when not the default)."""
        out: dict[str, Any] = {"RoutingStrategy": self.strategy.value}
        if self.prefix_aware is not None:
            out["PrefixAwareRoutingConfig"] = self.prefix_aware.to_api()
        if self.cache_aware is not None:
            out["CacheAwareRoutingConfig"] = self.cache_aware.to_api()
        if self.native_key is not NativeKey.RAW_BYTES:
            out["NativeKey"] = self.native_key.value
        return out


class VariantConfig(BaseModel):
    """A production variant: a pool of instances sharing one routing configuration.

    Attributes:
        name: the variant's name (``X-Amzn-SageMaker-Target-Variant`` selects it).
        weight: relative share of the endpoint's traffic when no variant is targeted (> 0).
        instances: base URLs of the engine instances, e.g. ``http://10.0.0.5:8000``.
            With ``discovery``, optional: the instances in force until the source's
            first answer (may be empty).
        routing: the ``RoutingConfig``.
        discovery: ``Discovery``: where the instances come from when they change on
            their own (DNS, Kubernetes); ``None`` = ``Instances`` is the membership.
    """

    model_config = ConfigDict(frozen=True, populate_by_name=True, extra="forbid")

    name: str = Field(alias="VariantName", min_length=1, max_length=63)
    weight: float = Field(default=1.0, alias="InitialVariantWeight", gt=0)
    instances: tuple[str, ...] = Field(default=(), alias="Instances")
    routing: RoutingConfig = Field(default_factory=RoutingConfig, alias="RoutingConfig")
    discovery: DiscoveryConfig | None = Field(default=None, alias="Discovery")

    @model_validator(mode="after")
    def _v_some_instances(self) -> "VariantConfig":
        if not self.instances and self.discovery is None:
            raise ValueError("Instances: at least one instance is required (or a Discovery source)")
        return self

    @field_validator("instances", mode="after")
    @classmethod
    def _v_instances(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        out = [_instance_url(url) for url in v]
        if len(set(out)) != len(out):
            raise ValueError(f"Instances: duplicate instance URL {_dupes(out)}")
        return tuple(out)


def _instance_url(url: str) -> str:
    """Normalise an instance base URL (no trailing slash) or raise ``ValueError`` naming it."""
    u = url.strip().rstrip("/")
    if not (u.startswith("http://") or u.startswith("https://")):
        raise ValueError(f"Instances: {url!r} is not an http:// or https:// URL")
    try:
        parts = urlsplit(u)
        port = parts.port  # raises ValueError when out of 0-65535 or not a number
    except ValueError as exc:
        raise ValueError(f"Instances: {url!r} is not a valid URL ({exc})") from None
    if not parts.hostname or any(c.isspace() for c in u):
        raise ValueError(f"Instances: {url!r} has no valid host")
    if port == 0:
        raise ValueError(f"Instances: {url!r} has port 0")
    if parts.query or parts.fragment:
        raise ValueError(f"Instances: {url!r} must not have a query or fragment")
    return u


#: ``Instances: DISCOVER`` of an inference component: its copies are the instances of its
#: production variant whose ``/v1/models`` lists its ``ModelName``.
DISCOVER = "DISCOVER"
#: SageMaker's pattern of an inference component's name (``InferenceComponentName``).
_COMPONENT_NAME = re.compile(r"^[a-zA-Z0-9](-*[a-zA-Z0-9])*$")


class InferenceComponentConfig(BaseModel):
    """An inference component: one model with its own copies on some instances of a
    production variant, and its own routing (SageMaker's ``InferenceComponent``).

    A request names it with ``X-Amzn-SageMaker-Inference-Component`` (boto3's
    ``InferenceComponentName=``), the path ``/endpoints/{E}/inference-components/{IC}/...``,
    or, on the OpenAI API, its ``ModelName`` in ``model``; it is routed only among the
    component's copies, with their own in-flight counts and ``ConcurrencyThreshold``.

    Attributes:
        name: ``InferenceComponentName``, 1-63 letters, digits and inner hyphens.
        model: ``ModelName``: the model its copies serve (their ``/v1/models`` id);
            ``None`` = the component's name.
        variant: ``VariantName``: the production variant whose instances host its
            copies; ``None`` = the endpoint's only variant.
        instances: ``Instances``: base URLs of the instances that host a copy (each an
            instance of the variant when the variant lists its instances), or
            ``DISCOVER`` (the default): the variant's instances whose ``/v1/models``
            lists ``ModelName``, learned at start and on each health round.
        routing: ``RoutingConfig``: the component's own; ``None`` = its variant's.
    """

    model_config = ConfigDict(frozen=True, populate_by_name=True, extra="forbid")

    name: str = Field(alias="InferenceComponentName", min_length=1, max_length=63)
    model: str | None = Field(default=None, alias="ModelName", min_length=1, max_length=256)
    variant: str | None = Field(default=None, alias="VariantName", min_length=1, max_length=63)
    instances: tuple[str, ...] | str = Field(default=DISCOVER, alias="Instances")
    routing: RoutingConfig | None = Field(default=None, alias="RoutingConfig")

    @field_validator("name")
    @classmethod
    def _v_name(cls, v: str) -> str:
        if not _COMPONENT_NAME.match(v):
            raise ValueError(f"InferenceComponentName: {v!r} must be letters, digits and inner hyphens "
                             "(SageMaker's pattern)")
        return v

    @field_validator("instances", mode="before")
    @classmethod
    def _v_instances(cls, v: Any) -> Any:
        if isinstance(v, str):
            if v.strip().upper() != DISCOVER:
                raise ValueError(f"Instances: {_shown(v)} is neither a list of instance URLs nor DISCOVER")
            return DISCOVER
        if not isinstance(v, (list, tuple)) or not v:
            raise ValueError(f"Instances: {_shown(v)} is neither a non-empty list of instance URLs nor DISCOVER")
        out = [_instance_url(u) if isinstance(u, str) else u for u in v]
        if any(not isinstance(u, str) for u in out):
            raise ValueError("Instances: every instance must be a URL string")
        if len(set(out)) != len(out):
            raise ValueError(f"Instances: duplicate instance URL {_dupes(out)}")
        return tuple(out)

    @property
    def model_name(self) -> str:
        """The model the copies serve (``ModelName``, else the component's name)."""
        return self.model or self.name

    @property
    def discover(self) -> bool:
        """Whether the copies are found from the instances' ``/v1/models``."""
        return self.instances == DISCOVER

    def to_api(self) -> dict[str, Any]:
        """SageMaker-style dict."""
        out: dict[str, Any] = {"InferenceComponentName": self.name, "ModelName": self.model_name,
                               "Instances": DISCOVER if self.discover else list(self.instances)}
        if self.variant is not None:
            out["VariantName"] = self.variant
        if self.routing is not None:
            out["RoutingConfig"] = self.routing.to_api()
        return out


class EndpointConfig(BaseModel):
    """A named endpoint with one or more production variants, its inference components
    (``InferenceComponents``, optional) and LoRA settings (``LoraAdapters``, optional:
    :class:`~prefixroute.core.lora_config.LoraAdaptersConfig`)."""

    model_config = ConfigDict(frozen=True, populate_by_name=True, extra="forbid")

    name: str = Field(alias="EndpointName", min_length=1, max_length=63)
    variants: tuple[VariantConfig, ...] = Field(alias="ProductionVariants", min_length=1)
    components: tuple[InferenceComponentConfig, ...] = Field(default=(), alias="InferenceComponents")
    lora: LoraAdaptersConfig = Field(default_factory=LoraAdaptersConfig, alias="LoraAdapters")

    @model_validator(mode="after")
    def _v_unique(self) -> "EndpointConfig":
        names = [v.name for v in self.variants]
        if len(set(names)) != len(names):
            raise ValueError(f"endpoint {self.name!r}: duplicate variant names {_dupes(names)}")
        cnames = [c.name for c in self.components]
        if len(set(cnames)) != len(cnames):
            raise ValueError(f"endpoint {self.name!r}: duplicate InferenceComponentName {_dupes(cnames)}")
        models = [c.model_name for c in self.components]
        if len(set(models)) != len(models):
            raise ValueError(f"endpoint {self.name!r}: ModelName {_dupes(models)} is served by more than one "
                             "inference component (a request's model must name one)")
        by_name = {v.name: v for v in self.variants}
        for c in self.components:
            if c.variant is None and len(self.variants) > 1:
                raise ValueError(f"endpoint {self.name!r}: inference component {c.name!r} needs a VariantName "
                                 f"(variants: {', '.join(by_name)})")
            variant = by_name.get(c.variant) if c.variant is not None else self.variants[0]
            if variant is None:
                raise ValueError(f"endpoint {self.name!r}: inference component {c.name!r}: VariantName "
                                 f"{c.variant!r} is not a production variant (variants: {', '.join(by_name)})")
            if not c.discover and variant.discovery is None:
                outside = [u for u in c.instances if u not in variant.instances]
                if outside:
                    raise ValueError(f"endpoint {self.name!r}: inference component {c.name!r}: "
                                     f"{_shown(outside[0], 80)} is not an instance of production variant "
                                     f"{variant.name!r}")
        return self

    def component_variant(self, component: InferenceComponentConfig) -> VariantConfig:
        """The production variant hosting ``component``'s copies."""
        if component.variant is None:
            return self.variants[0]
        return next(v for v in self.variants if v.name == component.variant)

    def component_routing(self, component: InferenceComponentConfig) -> RoutingConfig:
        """``component``'s routing: its own, else its variant's."""
        return component.routing or self.component_variant(component).routing


class FleetConfig(BaseModel):
    """Every endpoint the router serves. The first endpoint also serves ``/v1/...``.

    ``kv_events`` (``KvEvents``): precise mode, the instances' KV-event streams
    (:class:`~prefixroute.core.kvevents.config.KvEventsConfig`); ``None``: off.
    """

    model_config = ConfigDict(frozen=True, populate_by_name=True, extra="forbid")

    endpoints: tuple[EndpointConfig, ...] = Field(alias="Endpoints", min_length=1)
    kv_events: KvEventsConfig | None = Field(default=None, alias="KvEvents")

    @model_validator(mode="after")
    def _v_unique(self) -> "FleetConfig":
        names = [e.name for e in self.endpoints]
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate endpoint names {_dupes(names)}")
        return self

    @classmethod
    def from_mapping(cls, data: Any) -> "FleetConfig":
        """Validate a parsed YAML/JSON document.

        Raises:
            ConfigError: any invalid field; the message gives its path.
        """
        if not isinstance(data, dict):
            shown = "an empty document" if data is None else f"{type(data).__name__} {_shown(data)}"
            raise ConfigError(f"the configuration must be a mapping with an 'Endpoints' list (got {shown})")
        return parse_model(cls, data)

    @classmethod
    def from_yaml(cls, text: str, source: str | None = None) -> "FleetConfig":
        """Parse and validate YAML text.

        Args:
            source: the file the text came from, named in errors with the line of the
                problem (``fleet.yaml line 9: Endpoints.0...PrefixLength: 100 is out
                of range``).

        Raises:
            ConfigError: YAML syntax error or invalid field.
        """
        import yaml

        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            where = f" line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
            problem = getattr(exc, "problem", None) or str(exc)
            raise ConfigError(f"{source or 'configuration'}{where}: not valid YAML ({problem})") from None
        try:
            return cls.from_mapping(data)
        except ConfigError as exc:
            if source is None:
                raise
            raise ConfigError(_with_lines(str(exc), text, source)) from None

    @classmethod
    def single(
        cls,
        instances: "list[str] | tuple[str, ...]",
        routing: RoutingConfig,
        endpoint: str = "default",
        variant: str = "AllTraffic",
    ) -> "FleetConfig":
        """One endpoint with one variant: what ``prefixroute serve --backend ...`` builds."""
        return parse_model(
            cls,
            {"Endpoints": [{"EndpointName": endpoint, "ProductionVariants": [
                {"VariantName": variant, "Instances": list(instances), "RoutingConfig": routing}]}]},
        )
