"""The router's live state: the fleet, its configuration, metrics and the upstream client.

One :class:`RouterState` per router process, shared by the serving app, the admin app,
the health checker and the signal handlers. Reconfiguration goes through
:meth:`RouterState.apply_config` (whole fleet) or :meth:`RouterState.set_routing`
(one variant); both keep the in-flight state of what stays (``Fleet.apply``), so
requests in flight are not disturbed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable

import aiohttp

from prefixroute.core.adapters import AdapterTracker
from prefixroute.core.approx_cache import ViewBudget
from prefixroute.core.catalog import ModelCatalog
from prefixroute.core.retry_status import RetryStatus
from prefixroute.core.config import ConfigError, FleetConfig, RoutingConfig
from prefixroute.core.counters import InFlightTable, InFlightTableLocked, config_slot_keys, slot_key
from prefixroute.core.endpoint import Fleet, UnknownComponent, UnknownEndpoint, UnknownVariant
from prefixroute.core.kvevents.view import PreciseCacheView
from prefixroute.server.clientkeys import ClientAuth, load_keys
from prefixroute.core.selection import Selection, Selector
from prefixroute.server.health import HealthTracker
from prefixroute.server.metrics import RouterMetrics
from prefixroute.server.observe import Observers
from prefixroute.server.precise import OffPathTokenizer
from prefixroute.server.scrape import BackendStats
from prefixroute.server.settings import ServerSettings

if TYPE_CHECKING:
    from prefixroute.server.kv_subscriber import KvEventSubscriber
    from prometheus_client.metrics_core import Metric
    from prefixroute.server.lora import LoraManager
    from prefixroute.server.proxy import RoutedRequest

__all__ = ["RouterState"]

log = logging.getLogger("prefixroute.server")


class RouterState:
    """Everything a request handler needs.

    Args:
        config: the validated fleet configuration to start with.
        settings: process settings.
        counters: with ``serve --workers N``, the shared in-flight table (every
            worker's requests count); ``None`` = counts local to this process.
        metrics_dir: with ``serve --workers N``, prometheus-client's multiprocess
            directory (``/metrics`` then sums every worker's counters).

    Attributes:
        fleet: the live :class:`Fleet` (endpoints, variant pools, in-flight counts).
        settings: the :class:`ServerSettings`.
        metrics: the :class:`RouterMetrics`.
        health: the :class:`HealthTracker` (consecutive failures and successes).
        backend_stats: the latest scraped engine metrics per instance URL
            (:class:`BackendStats`: prefix-cache counters, requests running/waiting).
        session: the pooled upstream ``aiohttp.ClientSession``; set while the app runs.
        kv_view: precise mode's :class:`~prefixroute.core.kvevents.view.PreciseCacheView`
            (every instance's KV-cache state from its events), ``None`` when the
            configuration has no ``KvEvents``. A routing policy asks it
            (``holdings``, ``mode``).
        kv_subscriber: the :class:`~prefixroute.server.kv_subscriber.KvEventSubscriber`
            feeding ``kv_view``; set while the app runs.
        kv_keyer: precise mode's :class:`~prefixroute.core.precise_keys.RequestKeyer`
            (the engines' tokenizer: a request's KV block keys), ``None`` without
            ``KvEvents.Tokenizer``: then ``CACHE_AWARE`` routes on its learned view.
        observers: what is told of each request's end (:class:`Observers`: the live
            status counters...).
        clients: the client API keys and their limits (:class:`ClientAuth`), or
            ``None`` when no key is configured (the inference routes are open).
        catalog: what each instance serves (:class:`~prefixroute.core.catalog.ModelCatalog`,
            from their ``/v1/models`` and ``/metrics``: :mod:`prefixroute.server.models`).
        selector: picks a request's pool and candidates from the catalog
            (:class:`~prefixroute.core.selection.Selector`).
        adapter_tracker: requests in flight per (instance, LoRA adapter)
            (:class:`~prefixroute.core.adapters.AdapterTracker`).
        lora: loads and unloads adapters where their sticky sets must grow
            (:class:`~prefixroute.server.lora.LoraManager`); set while the app runs.

    Raises:
        ConfigError: the API keys file (``settings.api_keys_file``) or
            ``$PREFIXROUTE_API_KEYS`` is invalid.
    """

    def __init__(self, config: FleetConfig, settings: ServerSettings, *, counters: InFlightTable | None = None,
                 metrics_dir: str | None = None) -> None:
        self.settings = settings
        self.counters = counters
        if counters is not None:
            counters.reserve(config_slot_keys(config))
        self.fleet = Fleet(config, settings.seed, counters, ViewBudget(settings.cache_aware_memory_bytes))
        self.backend_stats: dict[str, BackendStats] = {}
        self.metrics = RouterMetrics(lambda: self.fleet, lambda: self.backend_stats, multiprocess_dir=metrics_dir,
                                     kv_view=lambda: getattr(self, "kv_view", None),
                                     catalog=lambda: getattr(self, "catalog", None))
        #: --retry-status: which answers are retried, and the instances held back after one.
        self.retry_status = RetryStatus(settings.retry_statuses)
        self.health = HealthTracker(self.set_healthy, self.is_healthy, settings.unhealthy_threshold,
                                    settings.healthy_threshold, active_checks=settings.health_check_interval_s > 0)
        self.session: aiohttp.ClientSession | None = None
        #: Instances found by discovery, per (endpoint, variant): the source's settings
        #: and its last good set; :meth:`apply_config` puts them in place of the
        #: variant's ``Instances`` while the variant keeps that same source.
        self.discovered: dict[tuple[str, str], tuple[object, tuple[str, ...]]] = {}
        #: Called with the configuration in force after every change (the discovery
        #: manager starts and stops its sources from it).
        self.config_listeners: list[Callable[[FleetConfig], None]] = []
        #: The running :class:`prefixroute.discovery.manager.DiscoveryManager` (set while the app runs).
        self.discovery: object | None = None
        self.kv_view: PreciseCacheView | None = None
        self.kv_subscriber: KvEventSubscriber | None = None
        self.catalog = ModelCatalog()
        self.selector = Selector(self.catalog, settings.unknown_model)
        self.adapter_tracker = AdapterTracker()
        self.lora: LoraManager | None = None
        self._models_tasks: set[asyncio.Task[int]] = set()
        self.kv_keyer: Any = None
        #: Tokenizes new prompt text off the event loop for ``kv_keyer`` (``InlineTokenizeChars``).
        self.kv_tokenize = OffPathTokenizer()
        self._kv_keyer_spec: tuple[Any, ...] | None = None
        self._kv_serving = False
        self._kv_tasks: set[asyncio.Task[None]] = set()
        self._make_kv_view(config)
        self._make_kv_keyer(config, startup=True)
        self._link_kv_matching()
        self.observers = Observers()
        keys = load_keys(settings.api_keys_file)
        self.clients = None if keys is None else ClientAuth(keys, self.metrics.client_outcome)
        self.metrics.add_collector(_ClientCollector(lambda: self.clients))

    def _make_kv_view(self, config: FleetConfig) -> None:
        kv = config.kv_events
        if kv is None:
            self.kv_view = None
        elif self.kv_view is None or self.kv_view.block_size != kv.block_size:
            self.kv_view = PreciseCacheView(kv.block_size, kv.stream_settings(True), kv.shared_tier_max_blocks)

    def _make_kv_keyer(self, config: FleetConfig, startup: bool = False) -> None:
        """Load the engines' tokenizer when ``KvEvents.Tokenizer`` names one (again only
        when it changed). At start-up a tokenizer that does not load is a
        :class:`ConfigError`; on a reload it is logged and the keyer in place kept."""
        kv = config.kv_events
        spec = None if kv is None or kv.tokenizer is None else (kv.tokenizer, kv.chat_template, kv.block_size,
                                                                  kv.tokenizer_cache_pieces, kv.matching)
        if spec == self._kv_keyer_spec:
            return
        if spec is None:
            self.kv_keyer, self._kv_keyer_spec = None, None
            return
        from prefixroute.core.model_tokenizer import ModelTokenizer
        from prefixroute.core.precise_keys import RequestKeyer

        try:
            tokenizer = ModelTokenizer.load(spec[0], spec[1])
        except (ValueError, ImportError) as exc:
            if startup:
                raise ConfigError(f"KvEvents.Tokenizer: {exc}") from None
            log.error("KvEvents.Tokenizer %r not loaded, precise routing keeps the tokenizer it had: %s", spec[0], exc)
            return
        keyer = RequestKeyer(tokenizer, spec[2], spec[3])
        if spec[4] == "bytes":
            from prefixroute.core.token_bytes import TokenBytes

            keyer.token_bytes = TokenBytes.build(tokenizer)
            if keyer.token_bytes is None:
                log.warning("KvEvents.Matching bytes: the tokens of %r do not render to exactly their text (not a "
                            "byte-level BPE tokenizer); requests are tokenized instead", spec[0])
        self.kv_keyer, self._kv_keyer_spec = keyer, spec

    def _link_kv_matching(self) -> None:
        """Index the view's held blocks by bytes when the keyer matches requests by bytes."""
        if self.kv_view is not None:
            keyer = self.kv_keyer
            self.kv_view.use_token_bytes(keyer.token_bytes if keyer is not None else None)

    @property
    def config(self) -> FleetConfig:
        """The configuration currently in force."""
        return self.fleet.config

    # -- reconfiguration ----------------------------------------------------------

    def apply_config(self, config: FleetConfig) -> None:
        """Adopt a validated configuration without a restart.

        Variants and instances that stay keep their in-flight counts, health and
        leases; removed instances get no new requests and their leases still release.

        Raises:
            prefixroute.core.counters.InFlightTableFull: (``--workers N``) the shared
                in-flight table has no room for the new instances; nothing changed.
        """
        old = self.fleet.config
        config = self._with_discovered(config)
        counters = self.counters
        if counters is not None:
            # Removed instances whose requests have finished since need their slots no
            # more: let go of them first, so that the new configuration may take them.
            for _, pool in self.fleet.all_pools():
                pool.prune_retired()
            counters.retain(self._held_slot_keys())
            counters.reserve(config_slot_keys(config))  # all or nothing, before any change
        known = set(self.instance_ids())
        self.fleet.apply(config, self.settings.seed)
        ids = self.instance_ids()
        self.catalog.forget(ids)
        self.fleet.discover_components(self.catalog)
        new = set(ids) - known
        if self.session is not None and new:  # new instances: ask what they serve now
            from prefixroute.server.models import refresh_models

            task = asyncio.get_running_loop().create_task(refresh_models(self, sorted(new)))
            self._kv_tasks.add(task)
            task.add_done_callback(self._kv_tasks.discard)
            self._models_tasks.add(task)
            task.add_done_callback(self._models_tasks.discard)
        self._apply_kv_events(config)
        if counters is not None:  # slots of instances gone for good may be taken over
            try:
                counters.retain(self._held_slot_keys())
            except InFlightTableLocked as exc:  # the change is made; the slots are let go of next time
                log.warning("configuration applied, but the slots of removed instances are kept for now: %s", exc)
        self.publish_engine_load()
        self.observers.stats.retain((e.name, v.name, i) for e in config.endpoints for v in e.variants
                                    for i in v.instances)
        log.info("configuration applied: %s", describe_changes(old, config))
        for listener in list(self.config_listeners):
            listener(config)

    def _with_discovered(self, config: FleetConfig) -> FleetConfig:
        """``config`` with each discovery-managed variant's ``Instances`` replaced by
        the last set its source found (a reload keeps what discovery found, unless the
        variant's source itself changed)."""
        if not self.discovered:
            return config
        endpoints = []
        for e in config.endpoints:
            variants = []
            for v in e.variants:
                found = self.discovered.get((e.name, v.name))
                if v.discovery is not None and found is not None and found[0] == v.discovery \
                        and v.instances != found[1]:
                    v = v.model_copy(update={"instances": found[1]})
                variants.append(v)
            endpoints.append(e.model_copy(update={"variants": tuple(variants)}))
        return config.model_copy(update={"endpoints": tuple(endpoints)})

    def set_discovered(self, endpoint: str, variant: str, source: object, instances: tuple[str, ...]) -> bool:
        """Discovery found ``instances`` (normalised base URLs) for a variant whose
        ``Discovery`` is ``source``: make them its membership, keeping the state of the
        instances that stay (the same path as any reconfiguration).

        Returns:
            ``False`` if the variant no longer exists or has another source now (the
            answer is stale and dropped), else ``True``.
        """
        cfg = next((v for e in self.config.endpoints if e.name == endpoint
                    for v in e.variants if v.name == variant), None)
        if cfg is None or cfg.discovery != source:
            return False
        self.discovered[(endpoint, variant)] = (source, tuple(instances))
        self.apply_config(self.config)
        return True

    def _apply_kv_events(self, config: FleetConfig) -> None:
        """Follow precise mode's configuration: subscribe to new instances, drop gone
        ones, start or stop the whole of it."""
        old_view = self.kv_view
        self._make_kv_view(config)
        self._make_kv_keyer(config)
        self._link_kv_matching()
        if not self._kv_serving:
            return  # the app's startup subscribes
        sub = self.kv_subscriber
        if sub is not None and self.kv_view is not old_view:
            # Off, or a new block size (every key changes): close, and start again from scratch.
            self.kv_subscriber = None
            self._spawn(sub.close())
            sub = None
        if self.kv_view is None or config.kv_events is None:
            return
        if sub is None:
            self._spawn(self.start_kv_events())
        else:
            sub.update(config.kv_events, self.instance_ids())

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._kv_tasks.add(task)
        task.add_done_callback(self._kv_tasks.discard)

    async def start_kv_events(self) -> None:
        """Start precise mode's subscriptions (the app's startup; without ``KvEvents``,
        only remembers that the app serves, for a configuration that turns it on).

        Raises:
            ImportError: the ``precise`` extra is missing.
        """
        self._kv_serving = True
        if self.kv_view is None or self.kv_subscriber is not None or self.config.kv_events is None:
            return
        from prefixroute.server.kv_subscriber import KvEventSubscriber

        sub = KvEventSubscriber(self.kv_view, self.config.kv_events, session=self.session)
        self.kv_subscriber = sub
        await sub.start(self.instance_ids())

    async def stop_kv_events(self) -> None:
        """Stop precise mode's subscriptions (the app's cleanup)."""
        self._kv_serving = False
        sub, self.kv_subscriber = self.kv_subscriber, None
        self.kv_tokenize.close()
        if sub is not None:
            await sub.close()
        for task in list(self._kv_tasks):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task

    def _held_slot_keys(self) -> list[int]:
        """The shared slots this process's pools need: their instances' and their
        removed instances' with requests in flight."""
        return [slot_key(ep, pool.slot_scope, i) for ep, pool in self.fleet.all_pools()
                for i in (*(s.instance_id for s in pool.instances), *pool.retired_ids)]

    def set_routing(self, endpoint: str, variant: str, routing: RoutingConfig) -> FleetConfig:
        """Switch one production variant's routing; returns the new configuration.

        Raises:
            UnknownEndpoint: no such endpoint.
            UnknownVariant: the endpoint has no such variant.
        """
        cfg = self.config
        ep_cfg = next((e for e in cfg.endpoints if e.name == endpoint), None)
        if ep_cfg is None:
            raise UnknownEndpoint(f"endpoint {endpoint!r} not found (endpoints: {', '.join(self.fleet.endpoints)})")
        if all(v.name != variant for v in ep_cfg.variants):
            raise UnknownVariant(
                f"endpoint {endpoint!r} has no production variant {variant!r} "
                f"(variants: {', '.join(v.name for v in ep_cfg.variants)})"
            )
        variants = tuple(v.model_copy(update={"routing": routing}) if v.name == variant else v
                         for v in ep_cfg.variants)
        new_ep = ep_cfg.model_copy(update={"variants": variants})
        new = cfg.model_copy(update={"endpoints": tuple(new_ep if e.name == endpoint else e for e in cfg.endpoints)})
        self.apply_config(new)
        return new

    def set_component_routing(self, endpoint: str, component: str, routing: RoutingConfig) -> FleetConfig:
        """Switch one inference component's routing; returns the new configuration.
        Its copies keep their in-flight counts.

        Raises:
            UnknownEndpoint: no such endpoint.
            UnknownComponent: the endpoint has no such inference component.
        """
        cfg = self.config
        ep_cfg = next((e for e in cfg.endpoints if e.name == endpoint), None)
        if ep_cfg is None:
            raise UnknownEndpoint(f"endpoint {endpoint!r} not found (endpoints: {', '.join(self.fleet.endpoints)})")
        if all(c.name != component for c in ep_cfg.components):
            raise UnknownComponent(f"endpoint {endpoint!r} has no inference component {component!r} "
                                   f"(inference components: {', '.join(c.name for c in ep_cfg.components) or 'none'})")
        components = tuple(c.model_copy(update={"routing": routing}) if c.name == component else c
                           for c in ep_cfg.components)
        new_ep = ep_cfg.model_copy(update={"components": components})
        new = cfg.model_copy(update={"endpoints": tuple(new_ep if e.name == endpoint else e for e in cfg.endpoints)})
        self.apply_config(new)
        return new

    def reload_config_file(self) -> FleetConfig:
        """Re-read ``settings.config_path`` and apply it (what SIGHUP does).

        Raises:
            ConfigError: no configuration file was given, it cannot be read, or it is
                invalid. The running configuration is then kept unchanged.
        """
        config = self.read_config_file()
        self.apply_config(config)
        return config

    def reload_keys(self) -> str | None:
        """Re-read the API keys (file and environment), keeping the limit state of the
        keys and tenants that stay; returns what changed (names only), or ``None``
        when keys are off (they are turned on or off only by a restart).

        Raises:
            ConfigError: the new keys are invalid (the keys in force are kept).
        """
        if self.clients is None:
            return None
        keys = load_keys(self.settings.api_keys_file)
        if keys is None:
            raise ConfigError("no API keys left: the keys in force are kept (keys are turned off by a restart)")
        return self.clients.reload(keys)

    def read_config_file(self) -> FleetConfig:
        """``settings.config_path`` read and validated, not applied.

        Raises:
            ConfigError: as :meth:`reload_config_file`.
        """
        path = self.settings.config_path
        if not path:
            raise ConfigError("no configuration file to reload (the router was started without --config)")
        try:
            text = Path(path).read_text(encoding="utf-8")
        except OSError as exc:
            raise ConfigError(f"cannot read configuration file {path}: {exc.strerror or exc}") from None
        except UnicodeDecodeError as exc:
            raise ConfigError(f"configuration file {path} is not UTF-8 text (byte {exc.start})") from None
        return FleetConfig.from_yaml(text, source=path)

    # -- health -------------------------------------------------------------------

    def set_healthy(self, instance_id: str, healthy: bool) -> None:
        """Mark an instance (in every variant that has it) in or out of rotation."""
        changed = False
        for _, pool in self.fleet.all_pools():
            inst = pool.get(instance_id)
            if inst is not None and inst.healthy != healthy:
                pool.set_healthy(instance_id, healthy)
                changed = True
        if changed:
            log.log(logging.INFO if healthy else logging.WARNING, "instance %s is now %s",
                    instance_id, "healthy" if healthy else "unhealthy")

    def is_healthy(self, instance_id: str) -> bool:
        """Whether the instance is in rotation (in any variant that has it)."""
        for _, pool in self.fleet.all_pools():
            inst = pool.get(instance_id)
            if inst is not None and inst.healthy:
                return True
        return False

    def engine_restarted(self, instance_id: str) -> None:
        """The instance's engine restarted (its scraped counters went back): every
        variant that has it forgets what its strategy learned about its prefix cache
        (:meth:`VariantPool.forget_cache`), and precise mode what its events said."""
        told = [pool.forget_cache(instance_id) for _, pool in self.fleet.all_pools()]
        stream = self.kv_view.stream(instance_id) if self.kv_view is not None else None
        if stream is not None:  # its events' state too: a new engine holds nothing until it says so
            stream.reset("the engine restarted (its scraped counters went back)", time.monotonic())
            told.append(True)
        if any(told):
            log.warning("instance %s restarted (its prefix-cache counters went back): the router's view of its "
                        "cache is cleared", instance_id)

    def publish_engine_load(self) -> None:
        """Copy each instance's scraped ``running + waiting``, waiting queue and KV-cache
        usage to its pool state (``InstanceState.engine_load``, ``engine_waiting``,
        ``engine_kv_usage``, read by load-aware strategies)."""
        for _, pool in self.fleet.all_pools():
            for inst in pool.instances:
                stats = self.backend_stats.get(inst.instance_id)
                if stats is None:
                    inst.engine_load, inst.engine_waiting, inst.engine_kv_usage = 0, 0, 0.0
                    continue
                inst.engine_load = stats.engine_load or 0
                inst.engine_waiting = int(stats.requests_waiting or 0)
                inst.engine_kv_usage = stats.kv_usage or 0.0

    def instance_ids(self) -> list[str]:
        """Every configured instance URL, once."""
        seen: dict[str, None] = {}
        for _, pool in self.fleet.all_pools():
            for inst in pool.instances:
                seen.setdefault(inst.instance_id, None)
        return list(seen)

    async def models_settled(self) -> None:
        """Wait (at most the health-check timeout, plus a second) until the model lists
        of the instances a configuration change added are read: an admin change answers
        once the new instances can be routed to by model."""
        tasks = list(self._models_tasks)
        if tasks:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.settings.health_check_timeout_s + 1.0):
                    await asyncio.gather(*tasks, return_exceptions=True)

    def models_changed(self) -> None:
        """The catalog changed (a model list, an adapter loaded or unloaded): inference
        components with ``Instances: DISCOVER`` follow it."""
        if self.fleet.discover_components(self.catalog):
            log.info("inference components' copies now: %s", "; ".join(
                f"{e}/{p.component}: {len(p.instances)}" for e, p in self.fleet.all_pools() if p.component))

    def reselect(self, rr: "RoutedRequest") -> Selection:
        """``rr``'s selection again (after its adapter's sticky set grew).

        Raises:
            LookupError: as :meth:`prefixroute.core.selection.Selector.select`.
        """
        sel = self.selector.select(self.fleet.endpoint(rr.endpoint), variant=rr.target, component=rr.component,
                                   model=rr.model, native=rr.route is None)
        rr.pool = sel.pool
        return sel

    def healthy_counts(self) -> tuple[int, int]:
        """``(healthy, total)`` instances over the fleet (an instance in two variants counts
        twice; an inference component's copies are their variant's instances, not counted
        again)."""
        healthy = total = 0
        for _, pool in self.fleet.all_pools():
            if pool.component is not None:
                continue
            for inst in pool.instances:
                total += 1
                healthy += inst.healthy
        return healthy, total


#: Changes the "configuration applied" line names; the rest are counted.
_SUMMARY_CHANGES = 20


def routing_text(routing: RoutingConfig) -> str:
    """A routing configuration in one short phrase, e.g. ``PREFIX_AWARE PrefixLength=4096
    ConcurrencyThreshold=12``."""
    api = routing.to_api()
    settings = [f"{k}={v}" for sub in api.values() if isinstance(sub, dict) for k, v in sub.items()]
    return " ".join([routing.strategy.value, *settings])


def _urls(urls: "Iterable[str]", limit: int = 5) -> str:
    urls = list(urls)
    shown = ", ".join(urls[:limit])
    return shown + (f" and {len(urls) - limit} more" if len(urls) > limit else "")


def describe_changes(old: FleetConfig, new: FleetConfig) -> str:
    """What changed from ``old`` to ``new``, in one line for the log: endpoints and
    production variants added or removed; per variant kept, routing (before -> after),
    weight, and instances added or removed; inference components added, removed or
    changed (routing before -> after), LoRA adapter settings. ``no change`` when there is
    none."""
    changes: list[str] = []
    before = {e.name: e for e in old.endpoints}
    after = {e.name: e for e in new.endpoints}
    for name in after.keys() - before.keys():
        e = after[name]
        changes.append(f"endpoint {name} added ({len(e.variants)} variant(s), "
                       f"{sum(len(v.instances) for v in e.variants)} instance(s))")
    for name in before.keys() - after.keys():
        changes.append(f"endpoint {name} removed")
    for name in [e.name for e in new.endpoints if e.name in before]:
        vb = {v.name: v for v in before[name].variants}
        va = {v.name: v for v in after[name].variants}
        for v in va.keys() - vb.keys():
            changes.append(f"{name}/{v} added ({routing_text(va[v].routing)}, {len(va[v].instances)} instance(s))")
        for v in vb.keys() - va.keys():
            changes.append(f"{name}/{v} removed")
        for v in [x.name for x in after[name].variants if x.name in vb]:
            o, n = vb[v], va[v]
            if o.routing != n.routing:
                changes.append(f"{name}/{v} routing {routing_text(o.routing)} -> {routing_text(n.routing)}")
            if o.weight != n.weight:
                changes.append(f"{name}/{v} weight {o.weight:g} -> {n.weight:g}")
            added = [i for i in n.instances if i not in o.instances]
            removed = [i for i in o.instances if i not in n.instances]
            if added:
                changes.append(f"{name}/{v} instances added: {_urls(added)}")
            if removed:
                changes.append(f"{name}/{v} instances removed: {_urls(removed)}")
        cb = {c.name: c for c in before[name].components}
        ca = {c.name: c for c in after[name].components}
        for c in ca.keys() - cb.keys():
            changes.append(f"{name}/component {c} added")
        for c in cb.keys() - ca.keys():
            changes.append(f"{name}/component {c} removed")
        for c in [x.name for x in after[name].components if x.name in cb]:
            o, n = cb[c], ca[c]
            if o.routing != n.routing:
                was = routing_text(o.routing) if o.routing is not None else "its variant's"
                now = routing_text(n.routing) if n.routing is not None else "its variant's"
                changes.append(f"{name}/component {c} routing {was} -> {now}")
            if o != n and o.routing == n.routing:
                changes.append(f"{name}/component {c} changed (model, variant or copies)")
        if before[name].lora != after[name].lora:
            changes.append(f"{name} LoraAdapters changed")
    if new.endpoints[0].name != old.endpoints[0].name:
        changes.append(f"default endpoint {old.endpoints[0].name} -> {new.endpoints[0].name}")
    if old.kv_events != new.kv_events:
        changes.append("KvEvents " + ("added" if old.kv_events is None else "removed" if new.kv_events is None
                                      else "changed"))
    if not changes:
        return "no change"
    if len(changes) > _SUMMARY_CHANGES:
        more = len(changes) - _SUMMARY_CHANGES
        changes = [*changes[:_SUMMARY_CHANGES], f"... and {more:,} more change{'s' if more > 1 else ''}"]
    return "; ".join(changes)


class _ClientCollector:
    """``prefixroute_client_in_flight{client,tenant}``: each API key's requests in flight."""

    def __init__(self, clients: "Callable[[], ClientAuth | None]") -> None:
        self._clients = clients

    def collect(self) -> "Iterable[Metric]":
        from prometheus_client.metrics_core import GaugeMetricFamily

        g = GaugeMetricFamily("prefixroute_client_in_flight", "Requests in flight per client API key.",
                              labels=("client", "tenant"))
        clients = self._clients()
        for name, tenant, n in clients.in_flight() if clients is not None else ():
            g.add_metric((name, tenant), n)
        return [g]
