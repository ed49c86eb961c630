"""Runs the discovery sources of a router and applies what they find.

One task per production variant that has ``Discovery`` in the configuration in force;
a reload that adds, removes or changes a variant's source starts, stops or restarts
its task. Each answer goes through a :class:`prefixroute.core.discovery.Membership`;
a change becomes the variant's membership through
:meth:`prefixroute.server.state.RouterState.set_discovered` (the router's live
reconfiguration path: instances that stay keep their in-flight counts and health,
removed ones get no new request the moment the change is applied).

Metrics (in the router's registry, so on its ``/metrics``):

- ``prefixroute_discovery_instances{endpoint,variant,source}``: instances in force;
- ``prefixroute_discovery_changes_total{endpoint,variant,source}``: membership changes applied;
- ``prefixroute_discovery_errors_total{endpoint,variant,source,kind}``: failed
  resolutions, lists and watches (the last good set was kept);
- ``prefixroute_discovery_up{endpoint,variant,source}``: 1 if the source's last
  attempt succeeded, else 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from prometheus_client import Counter, Gauge

from prefixroute.core.config import FleetConfig
from prefixroute.core.discovery import DiscoveredInstance, Membership, MembershipChange, retry_delay
from prefixroute.core.discovery_config import DiscoveryConfig

if TYPE_CHECKING:
    from prefixroute.server.state import RouterState

__all__ = ["DiscoveryManager", "AppliedChange", "start_discovery", "METRIC_NAMES"]

log = logging.getLogger("prefixroute.discovery")

#: The metric families discovery exports.
METRIC_NAMES = ("prefixroute_discovery_instances", "prefixroute_discovery_changes_total",
                "prefixroute_discovery_errors_total", "prefixroute_discovery_up")

#: Changes remembered for :attr:`DiscoveryManager.history`.
HISTORY = 1_000

Key = tuple[str, str]


@dataclass(frozen=True, slots=True)
class AppliedChange:
    """A membership change and when it took effect.

    Attributes:
        at: ``time.monotonic()`` right after the router adopted it: a request decided
            later cannot go to a removed instance.
        endpoint, variant: whose membership.
        change: what changed.
    """

    at: float
    endpoint: str
    variant: str
    change: MembershipChange


class _Metrics:
    def __init__(self, registry: Any) -> None:
        labels = ("endpoint", "variant", "source")
        self.instances = Gauge("prefixroute_discovery_instances",
                               "Instances in force per discovery-managed production variant.", labels,
                               registry=registry)
        self.changes = Counter("prefixroute_discovery_changes",
                               "Membership changes applied from discovery.", labels, registry=registry)
        self.errors = Counter("prefixroute_discovery_errors",
                              "Failed DNS resolutions and Kubernetes lists/watches (kind: timeout, nxdomain, "
                              "no_answer, servfail, gone, api, connection, invalid, config); the last good set "
                              "was kept.", (*labels, "kind"), registry=registry)
        self.up = Gauge("prefixroute_discovery_up",
                        "1 if the discovery source's last attempt succeeded, else 0.", labels, registry=registry)


class DiscoveryManager:
    """The discovery tasks of one router.

    Args:
        state: the router's live state; its ``config_listeners`` get this manager.

    Attributes:
        memberships: the :class:`Membership` of each (endpoint, variant) with a source.
        history: the last :data:`HISTORY` changes applied (:class:`AppliedChange`).
        sources: the running source objects per (endpoint, variant) (``DnsSource`` /
            ``KubernetesSource``: counters of lists, watches).
    """

    def __init__(self, state: "RouterState") -> None:
        self.state = state
        self.memberships: dict[Key, Membership] = {}
        self.history: deque[AppliedChange] = deque(maxlen=HISTORY)
        self.sources: dict[Key, Any] = {}
        self._tasks: dict[Key, tuple[DiscoveryConfig, asyncio.Task[None]]] = {}
        self._metrics = _Metrics(state.metrics.registry)
        self._closed = False

    def start(self) -> None:
        """Start a task per discovery-managed variant; follow configuration changes."""
        self.state.config_listeners.append(self._sync)
        self._sync(self.state.config)

    async def close(self) -> None:
        """Stop every task and wait for them."""
        self._closed = True
        with contextlib.suppress(ValueError):
            self.state.config_listeners.remove(self._sync)
        tasks = [t for _, t in self._tasks.values()]
        self._tasks.clear()
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t

    # -- tasks --------------------------------------------------------------------

    def _sync(self, config: FleetConfig) -> None:
        if self._closed:
            return
        wanted: dict[Key, tuple[DiscoveryConfig, tuple[str, ...]]] = {
            (e.name, v.name): (v.discovery, v.instances)
            for e in config.endpoints for v in e.variants if v.discovery is not None}
        for key in list(self._tasks):
            if key not in wanted or wanted[key][0] != self._tasks[key][0]:
                self._tasks.pop(key)[1].cancel()
                self.memberships.pop(key, None)
                self.sources.pop(key, None)
        for key, (disc, instances) in wanted.items():
            if key not in self._tasks:
                self.memberships[key] = Membership(instances)
                self._tasks[key] = (disc, asyncio.get_running_loop().create_task(
                    self._run(key, disc), name=f"prefixroute-discovery-{key[0]}-{key[1]}"))

    async def _run(self, key: Key, disc: DiscoveryConfig) -> None:
        crashes = 0
        while True:
            source = self._make_source(key, disc)
            self.sources[key] = source
            try:
                await source.run()
            except asyncio.CancelledError:
                raise
            except Exception:  # a bug in a source must not end discovery: log it, start it again
                crashes += 1
                log.exception("discovery source of %s/%s failed; restarting it", *key)
                self._fail(key, disc, "error", "source failed (see the traceback above)")
                await asyncio.sleep(retry_delay(crashes))

    def _make_source(self, key: Key, disc: DiscoveryConfig) -> Any:
        def report(found: list[DiscoveredInstance]) -> None:
            self._report(key, disc, found)

        def fail(kind: str, message: str) -> None:
            self._fail(key, disc, kind, message)

        if disc.dns is not None:
            from prefixroute.discovery.dns import DnsSource

            return DnsSource(disc.dns, report, fail)
        assert disc.kubernetes is not None
        from prefixroute.discovery.kubernetes import KubernetesSource

        return KubernetesSource(disc.kubernetes, report, fail)

    # -- answers ------------------------------------------------------------------

    def _report(self, key: Key, disc: DiscoveryConfig, found: list[DiscoveredInstance]) -> None:
        membership = self.memberships.get(key)
        current = self._tasks.get(key)
        if membership is None or current is None or current[0] != disc:
            return  # a source stopped by a reload answered late
        labels = (*key, disc.source)
        recovered = membership.last_error is not None
        change = membership.update(found)
        self._metrics.up.labels(*labels).set(1)
        self._metrics.instances.labels(*labels).set(len(membership.instances))
        if recovered:
            log.warning("discovery of %s/%s (%s) works again", *labels)
        if change is None:
            return
        if not self.state.set_discovered(key[0], key[1], disc, change.instances):
            return
        self._metrics.changes.labels(*labels).inc()
        self.history.append(AppliedChange(time.monotonic(), key[0], key[1], change))
        log.info("discovery of %s/%s (%s): %d instance(s); added %s; removed %s", *labels, len(change.instances),
                 ", ".join(change.added) or "none", ", ".join(change.removed) or "none")

    def _fail(self, key: Key, disc: DiscoveryConfig, kind: str, message: str) -> None:
        membership = self.memberships.get(key)
        if membership is None:
            return
        labels = (*key, disc.source)
        membership.failed(f"{kind}: {message}")
        self._metrics.errors.labels(*labels, kind).inc()
        self._metrics.up.labels(*labels).set(0)
        # gone (410) is routine: the relist follows at once.
        log.log(logging.INFO if kind == "gone" else logging.WARNING,
                "discovery of %s/%s (%s) failed (%s: %s); keeping the last %d instance(s)", *labels, kind, message,
                len(membership.instances))


def start_discovery(state: "RouterState") -> DiscoveryManager:
    """A started :class:`DiscoveryManager` for ``state`` (``state.discovery``). It
    follows reloads, so a source added later starts then; a driver's library (the
    ``discovery`` extra) is imported only when a variant uses it."""
    manager = DiscoveryManager(state)
    state.discovery = manager
    manager.start()
    return manager
