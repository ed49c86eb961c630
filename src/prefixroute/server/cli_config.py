"""``prefixroute serve``'s flags turned into a fleet configuration: :func:`build_config`
(``--config`` or ``--backend`` and the routing flags, with the rules on which flags go
together), the ``--inference-component``/``--lora-*`` flags (:func:`with_model_flags`)
and precise mode's ``--kv-events*`` flags (:func:`kv_events_from_flags`).
Re-exported by :mod:`prefixroute.server.cli`, which defines the flags."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path
from typing import Any

from prefixroute.core.config import (ConfigError, EndpointConfig, FleetConfig, RoutingConfig, RoutingStrategy,
                                     parse_model)
from prefixroute.core.kvevents.config import KvEventsConfig
from prefixroute.discovery.flags import discovery_from_args, single_with_discovery, uses_discovery

__all__ = ["build_config", "parse_component_flag", "parse_adapter_flag", "with_model_flags", "kv_events_from_flags"]

log = logging.getLogger("prefixroute.server")


def build_config(args: argparse.Namespace) -> FleetConfig:
    """The fleet configuration from ``--config`` or from ``--backend`` and the routing flags.

    Raises:
        ConfigError: conflicting or missing flags, an unreadable file, invalid values.
    """
    discovering = uses_discovery(args)
    kv_flags = [f for f, given in (("--kv-events-endpoint", getattr(args, "kv_events_endpoint", None)),
                                   ("--kv-events-template", getattr(args, "kv_events_template", None)),
                                   ("--kv-events-replay-template", getattr(args, "kv_events_replay_template", None)),
                                   ("--kv-events-from-info", getattr(args, "kv_events_from_info", None)),
                                   ("--kv-block-size", getattr(args, "kv_block_size", None)),
                                   ("--tokenizer", getattr(args, "tokenizer", None)),
                                   ("--chat-template", getattr(args, "chat_template", None)),
                                   ("--kv-match", getattr(args, "kv_match", None))) if given]
    if args.config:
        if args.backend:
            raise ConfigError("use either --config or --backend, not both")
        if discovering:
            raise ConfigError("discovery flags (--dns, --k8s-...) are for the --backend case; with --config put "
                              "Discovery: on the production variant")
        if kv_flags:
            raise ConfigError(f"{'/'.join(kv_flags)}: with --config, precise mode is the YAML's KvEvents section")
        overridden = [flag for flag, dest in _CONFIG_FLAGS.items() if getattr(args, dest, None) is not None]
        if overridden:  # refused rather than ignored: the file would silently win
            raise ConfigError(f"{', '.join(overridden)} cannot be used with --config: the configuration file sets "
                              "each production variant's RoutingConfig and names (edit the file, or use --backend "
                              "and the flags instead)")
        try:
            text = Path(args.config).read_text(encoding="utf-8")
        except OSError as exc:
            raise ConfigError(f"cannot read configuration file {args.config}: {exc.strerror or exc}") from None
        except UnicodeDecodeError as exc:
            raise ConfigError(f"configuration file {args.config} is not UTF-8 text (byte {exc.start})") from None
        return FleetConfig.from_yaml(text, source=args.config)
    if not args.backend and not discovering:
        raise ConfigError("no instances: give --backend URL (repeatable), --config PATH, or a discovery source "
                          "(--dns NAME, --k8s-service NAME)")
    strategy = RoutingStrategy.parse(args.strategy or "random")
    uses = _STRATEGY_FLAGS.get(strategy, set())
    given = {flag for flag, dest in _ROUTING_FLAGS.items() if getattr(args, dest) is not None}
    if given - uses:  # the same rule for every flag another strategy takes: warn, do not fail
        log.warning("%s ignored with strategy %s", "/".join(sorted(given - uses)), strategy.value)
    value = {dest: (getattr(args, dest) if flag in uses else None) for flag, dest in _ROUTING_FLAGS.items()}
    missing = [flag for flag in _REQUIRED_FLAGS.get(strategy, ()) if value[_ROUTING_FLAGS[flag]] is None]
    if missing:
        raise ConfigError(f"--strategy {args.strategy or 'random'} needs {' and '.join(missing)} "
                          f"({'; '.join(_REQUIRED_FLAGS[strategy][f] for f in missing)})")
    routing = RoutingConfig.build(strategy, value["prefix_length"], value["concurrency_threshold"],
                                  native_key=getattr(args, "native_key", None),
                                  block_size=value["block_size"], max_prefix_length=value["max_prefix_length"],
                                  instance_cache_tokens=value["instance_cache_tokens"], load_weight=value["load_weight"],
                                  media_tokens=value["media_tokens"],
                                  kv_tiers=_kv_tiers(value["cpu_tier_tokens"], value["shared_tier"]))
    endpoint, variant = args.endpoint_name or "default", args.variant_name or "AllTraffic"
    if discovering:
        config = single_with_discovery(args.backend, routing, discovery_from_args(args), endpoint, variant)
    else:
        config = FleetConfig.single(args.backend, routing, endpoint=endpoint, variant=variant)
    config = with_model_flags(config, args)
    if kv_flags:
        config = config.model_copy(update={"kv_events": kv_events_from_flags(args)})
    return config


def parse_component_flag(text: str) -> dict[str, Any]:
    """``NAME[:MODEL]=URL,URL`` or ``NAME[:MODEL]=discover`` as an ``InferenceComponents``
    item (validated with the rest of the configuration).

    Raises:
        ConfigError: no ``=``, nothing after it, or an empty name or ``:MODEL``.
    """
    head, sep, tail = text.partition("=")
    name, colon, model = head.partition(":")
    if not sep or not name or not tail.strip() or (colon and not model):
        raise ConfigError(f"--inference-component {text!r}: expected NAME[:MODEL]=URL,URL or NAME[:MODEL]=discover")
    item: dict[str, Any] = {"InferenceComponentName": name}
    if model:
        item["ModelName"] = model
    urls = [u.strip() for u in tail.split(",") if u.strip()]
    item["Instances"] = "DISCOVER" if len(urls) == 1 and urls[0].lower() == "discover" else urls
    return item


def parse_adapter_flag(text: str) -> dict[str, Any]:
    """``NAME=PATH[@BASE_MODEL]`` as a ``LoraAdapters.Adapters`` item.

    Raises:
        ConfigError: no ``=``, an empty name or path, or an empty ``@BASE_MODEL``.
    """
    name, sep, rest = text.partition("=")
    path, at, base = rest.rpartition("@") if "@" in rest else (rest, "", "")
    if not sep or not name or not path or (at and not base):
        raise ConfigError(f"--lora-adapter {text!r}: expected NAME=PATH or NAME=PATH@BASE_MODEL")
    item: dict[str, Any] = {"LoraName": name, "LoraPath": path}
    if at and base:
        item["BaseModelName"] = base
    return item


def with_model_flags(config: FleetConfig, args: argparse.Namespace) -> FleetConfig:
    """``config`` (one endpoint, from the flags) with the ``--inference-component`` and
    ``--lora-*`` flags applied, validated as the YAML would be.

    Raises:
        ConfigError: a malformed flag or an invalid value.
    """
    components = [parse_component_flag(t) for t in getattr(args, "inference_component", []) or []]
    adapters = [parse_adapter_flag(t) for t in getattr(args, "lora_adapter", []) or []]
    lora: dict[str, Any] = {}
    if adapters:
        lora["Adapters"] = adapters
    if getattr(args, "lora_autoload", False):
        lora["Autoload"] = True
    if getattr(args, "lora_max_adapters", None) is not None:
        lora["MaxAdaptersPerInstance"] = args.lora_max_adapters
    if getattr(args, "lora_retry_after", None) is not None:
        lora["RetryAfterSeconds"] = args.lora_retry_after
    if getattr(args, "lora_idle_seconds", None) is not None:
        lora["IdleSeconds"] = args.lora_idle_seconds
    if not components and not lora:
        return config
    ep = config.endpoints[0]
    data: dict[str, Any] = {"EndpointName": ep.name, "ProductionVariants": list(ep.variants)}
    if components:
        data["InferenceComponents"] = components
    if lora:
        data["LoraAdapters"] = lora
    endpoint = parse_model(EndpointConfig, data, root="flags")
    return config.model_copy(update={"endpoints": (endpoint,)})


def kv_events_from_flags(args: argparse.Namespace) -> KvEventsConfig:
    """Precise mode's configuration from the ``--kv-events*`` flags.

    Raises:
        ConfigError: a malformed ``--kv-events-endpoint``, a bad template or endpoint, or
            neither an endpoint, a template nor ``--kv-events-from-info``.
    """
    instances: dict[str, Any] = {}
    for item in args.kv_events_endpoint:
        url, sep, endpoints = item.partition("=")
        if not sep or not url or not endpoints:
            raise ConfigError(f"--kv-events-endpoint {item!r}: expected URL=ENDPOINT[,REPLAY_ENDPOINT]")
        pub, _, replay = endpoints.partition(",")
        instances[url] = {"Endpoint": pub, **({"ReplayEndpoint": replay} if replay else {})}
    data: dict[str, Any] = {"Instances": instances}
    if args.kv_block_size is not None:
        data["BlockSize"] = args.kv_block_size
    if getattr(args, "tokenizer", None):
        data["Tokenizer"] = args.tokenizer
    if getattr(args, "chat_template", None):
        data["ChatTemplate"] = args.chat_template
    if getattr(args, "kv_match", None):
        if not getattr(args, "tokenizer", None):
            raise ConfigError("--kv-match needs --tokenizer: requests are matched against the events with the "
                              "engines' tokenizer")
        data["Matching"] = args.kv_match
    if args.kv_events_template or args.kv_events_replay_template or args.kv_events_from_info:
        discovery: dict[str, Any] = {"FromInfo": bool(args.kv_events_from_info)}
        if args.kv_events_template:
            discovery["EndpointTemplate"] = args.kv_events_template
        if args.kv_events_replay_template:
            discovery["ReplayEndpointTemplate"] = args.kv_events_replay_template
        data["Discovery"] = discovery
    elif not instances:
        raise ConfigError("precise mode needs --kv-events-endpoint, --kv-events-template or --kv-events-from-info")
    unknown = set(instances) - {u.strip().rstrip("/") for u in args.backend} - set(args.backend)
    if unknown:
        raise ConfigError(f"--kv-events-endpoint names an instance that is no --backend: {sorted(unknown)[0]}")
    return parse_model(KvEventsConfig, data, "KvEvents")


def _kv_tiers(cpu_tier_tokens: int | None, shared_tier: bool | None) -> dict[str, Any] | None:
    """``KvTiers`` from ``--cpu-tier-tokens`` and ``--shared-tier`` (``None``: neither given)."""
    if cpu_tier_tokens is None and not shared_tier:
        return None
    return {"CpuTierTokens": cpu_tier_tokens or 0, "SharedTier": bool(shared_tier)}


#: Flags a --config file overrides (their argparse destinations; None when not given).
_CONFIG_FLAGS = {"--strategy": "strategy", "--prefix-length": "prefix_length",
                 "--concurrency-threshold": "concurrency_threshold", "--block-size": "block_size",
                 "--max-prefix-length": "max_prefix_length", "--instance-cache-tokens": "instance_cache_tokens",
                 "--load-weight": "load_weight", "--media-tokens": "media_tokens", "--native-key": "native_key",
                 "--cpu-tier-tokens": "cpu_tier_tokens", "--shared-tier": "shared_tier",
                 "--endpoint-name": "endpoint_name", "--variant-name": "variant_name"}
#: Routing flags and their argparse destinations.
_ROUTING_FLAGS = {"--prefix-length": "prefix_length", "--concurrency-threshold": "concurrency_threshold",
                  "--block-size": "block_size", "--max-prefix-length": "max_prefix_length",
                  "--instance-cache-tokens": "instance_cache_tokens", "--load-weight": "load_weight",
                  "--media-tokens": "media_tokens", "--cpu-tier-tokens": "cpu_tier_tokens",
                  "--shared-tier": "shared_tier"}
#: The routing flags a strategy cannot do without, and what each one is.
_REQUIRED_FLAGS = {
    RoutingStrategy.PREFIX_AWARE: {
        "--prefix-length": "--prefix-length N: how much of each request makes its routing key, 1,024-65,536 "
                           "characters of the prompt text (OpenAI API) or bytes of the body (SageMaker API)",
        "--concurrency-threshold": "--concurrency-threshold N: requests in flight on the chosen instance at "
                                   "which a request overflows to a less busy one, 1-1,024"},
    RoutingStrategy.CACHE_AWARE: {
        "--concurrency-threshold": "--concurrency-threshold N: requests in flight on an instance at which it "
                                   "takes no more, 1-1,024"},
}
#: The routing flags each strategy takes (the others are ignored with a warning).
_STRATEGY_FLAGS = {
    RoutingStrategy.PREFIX_AWARE: {"--prefix-length", "--concurrency-threshold"},
    RoutingStrategy.CACHE_AWARE: {"--concurrency-threshold", "--block-size", "--max-prefix-length",
                                  "--instance-cache-tokens", "--load-weight", "--media-tokens",
                                  "--cpu-tier-tokens", "--shared-tier"},
}
