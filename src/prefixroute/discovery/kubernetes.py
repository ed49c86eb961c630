"""Kubernetes discovery: a Service's ready endpoints, from its EndpointSlices.

client-go's informer loop, with ``kubernetes-asyncio`` as the client:

1. **list** the slices (``labelSelector`` = the Service's name label, or the configured
   selector), in pages of 500 (``limit``/``continue``), and take the list's
   ``resourceVersion``; report the ready endpoints;
2. **watch** from that resourceVersion with ``allowWatchBookmarks=true`` (bookmarks keep
   it fresh while nothing changes) and ``timeoutSeconds`` (the server ends the watch
   after it; a silent dead connection is noticed by then); report after every event
   that changed a slice;
3. a watch that ends or whose connection drops is **resumed** from the last
   resourceVersion; ``410 Gone`` (the version was compacted away) means **relist**
   at once; any other error backs off (0.5 s doubling to 30 s) and retries; while
   the API server cannot be reached the last good set stays in force.

The state (slices, resourceVersion, readiness) is :class:`prefixroute.core.endpointslices.EndpointSliceCache`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from pathlib import Path
from typing import Any, Awaitable, Callable

import aiohttp
from kubernetes_asyncio import client, config, watch
from kubernetes_asyncio.client.exceptions import ApiException

from prefixroute.core.discovery import DiscoveredInstance, retry_delay
from prefixroute.core.discovery_config import KubernetesDiscoveryConfig
from prefixroute.core.endpointslices import EndpointSliceCache, InvalidWatchEvent

__all__ = ["KubernetesSource", "make_api_client", "namespace_for", "LIST_PAGE_SIZE"]

log = logging.getLogger("prefixroute.discovery")

Report = Callable[[list[DiscoveredInstance]], None]
Fail = Callable[[str, str], None]

#: Slices per list page (``limit``); the API server's own default page is 500 too.
LIST_PAGE_SIZE = 500
#: Where a pod finds its service account (token, CA, namespace).
SERVICE_ACCOUNT_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")


class _Gone(Exception):
    """410 Gone: the resourceVersion is too old; relist."""


async def make_api_client(cfg: KubernetesDiscoveryConfig) -> client.ApiClient:
    """An API client: ``cfg.kubeconfig`` if given, else the in-cluster service account
    (``KUBERNETES_SERVICE_HOST`` set), else ``$KUBECONFIG`` / ``~/.kube/config``.

    Raises:
        kubernetes_asyncio.config.ConfigException: no usable configuration.
    """
    conf = client.Configuration()
    if cfg.kubeconfig is None and os.environ.get("KUBERNETES_SERVICE_HOST"):
        config.load_incluster_config(client_configuration=conf)
    else:
        await config.load_kube_config(config_file=cfg.kubeconfig, client_configuration=conf)
    return client.ApiClient(configuration=conf)


def namespace_for(cfg: KubernetesDiscoveryConfig) -> str:
    """``cfg.namespace``, else the pod's own namespace, else the kubeconfig context's,
    else ``default``."""
    if cfg.namespace:
        return cfg.namespace
    ns_file = SERVICE_ACCOUNT_DIR / "namespace"
    if cfg.kubeconfig is None and os.environ.get("KUBERNETES_SERVICE_HOST") and ns_file.exists():
        return ns_file.read_text(encoding="utf-8").strip() or "default"
    try:
        _, active = config.list_kube_config_contexts(config_file=cfg.kubeconfig)
        return (active or {}).get("context", {}).get("namespace") or "default"
    except Exception:  # no kubeconfig: the in-cluster case handled above, or none at all
        return "default"


class KubernetesSource:
    """Lists and watches the EndpointSlices of one Service until cancelled.

    Args:
        cfg: the variant's ``Discovery.Kubernetes`` settings.
        report: called with the whole ready set after the list and after every
            event that changed it.
        fail: called with ``(kind, message)``: ``gone`` (410, relisting), ``api``
            (an HTTP error status), ``connection`` (unreachable, dropped, timed out),
            ``invalid`` (an object that is not an EndpointSlice), ``config``.
        sleep: the backoff wait (``asyncio.sleep``).

    Attributes:
        cache: the slices and the last resourceVersion.
        lists: lists made (1 + relists); ``watches``: watch requests made.
    """

    def __init__(self, cfg: KubernetesDiscoveryConfig, report: Report, fail: Fail,
                 sleep: Callable[[float], Awaitable[None]] = asyncio.sleep) -> None:
        self.cfg = cfg
        self._report = report
        self._fail = fail
        self._sleep = sleep
        self.cache = EndpointSliceCache(cfg.port_name, cfg.scheme)
        self.namespace = namespace_for(cfg)
        self.lists = 0
        self.watches = 0
        self._events = 0  # watch events since the last failure (a failure after progress starts backoff afresh)

    def _progressed(self) -> bool:
        progressed, self._events = self._events > 0, 0
        return progressed

    async def run(self) -> None:
        """The informer loop, forever (cancel the task to stop)."""
        failures = 0
        api_client: client.ApiClient | None = None
        try:
            while api_client is None:
                try:
                    api_client = await make_api_client(self.cfg)
                except Exception as exc:  # bad or missing kubeconfig: say so, retry (it may appear)
                    failures += 1
                    self._fail("config", f"no Kubernetes API configuration: {exc}")
                    await self._sleep(retry_delay(failures))
            api = client.DiscoveryV1Api(api_client)
            failures = 0
            listed = False
            while True:
                try:
                    if not listed:
                        await self._list(api)
                        listed = True
                        failures = 0
                    await self._watch(api)
                    failures = 0  # a watch that ended normally: resume at once
                except _Gone as exc:
                    listed = False
                    self._fail("gone", str(exc))
                except ApiException as exc:
                    failures = 1 if self._progressed() else failures + 1
                    self._fail("api", f"API server answered {exc.status} {exc.reason}")
                    await self._sleep(retry_delay(failures))
                except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
                    failures = 1 if self._progressed() else failures + 1
                    self._fail("connection", f"API server unreachable: {type(exc).__name__}: {exc}")
                    await self._sleep(retry_delay(failures))
                except InvalidWatchEvent as exc:
                    failures += 1
                    listed = False
                    self._fail("invalid", str(exc))
                    await self._sleep(retry_delay(failures))
        finally:
            if api_client is not None:
                await api_client.close()

    async def _list(self, api: client.DiscoveryV1Api) -> None:
        items: list[dict[str, Any]] = []
        cont: str | None = None
        while True:
            kwargs: dict[str, Any] = {"label_selector": self.cfg.selector, "limit": LIST_PAGE_SIZE,
                                      "_preload_content": False, "_request_timeout": 30}
            if cont:
                kwargs["_continue"] = cont
            resp = await api.list_namespaced_endpoint_slice(self.namespace, **kwargs)
            try:
                body = await resp.read()
            finally:
                resp.release()
            if resp.status == 410:  # the continue token expired: start the list again
                raise _Gone("list continuation expired")
            if not 200 <= resp.status <= 299:
                raise ApiException(status=resp.status, reason=_status_message(body))
            try:
                data = json.loads(body)
            except ValueError:
                raise InvalidWatchEvent("the EndpointSlice list is not JSON") from None
            items.extend(data.get("items") or [])
            meta = data.get("metadata") or {}
            cont = meta.get("continue")
            if not cont:
                rv = str(meta.get("resourceVersion") or "")
                break
        self.lists += 1
        self.cache.replace(items, rv)
        self._report(self.cache.instances())

    async def _watch(self, api: client.DiscoveryV1Api) -> None:
        self.watches += 1
        w = watch.Watch(return_type="object")
        stream = w.stream(api.list_namespaced_endpoint_slice, self.namespace, label_selector=self.cfg.selector,
                          resource_version=self.cache.resource_version, allow_watch_bookmarks=True,
                          timeout_seconds=self.cfg.watch_timeout_s,
                          _request_timeout=aiohttp.ClientTimeout(sock_connect=10,
                                                                 sock_read=self.cfg.watch_timeout_s + 30))
        try:
            async with stream:
                async for event in stream:
                    if not isinstance(event, dict):  # a line that is not JSON: an error page, a proxy's answer
                        raise InvalidWatchEvent(f"watch stream sent a line that is not JSON: {str(event)[:80]!r}")
                    self._events += 1
                    if self.cache.apply({"type": event["type"], "object": event["raw_object"]}):
                        self._report(self.cache.instances())
        except ApiException as exc:
            if exc.status == 410:
                raise _Gone(f"watch from resourceVersion {self.cache.resource_version} expired: {exc.reason}") \
                    from None
            raise


def _status_message(body: bytes) -> str:
    """The ``message`` of a Kubernetes ``Status`` body, else the start of the body."""
    try:
        return str(json.loads(body).get("message", ""))[:200]
    except (ValueError, AttributeError):
        return body[:200].decode("utf-8", "replace")
