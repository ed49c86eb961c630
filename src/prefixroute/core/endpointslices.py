"""A Service's ready endpoints from its ``EndpointSlice`` objects, sans-I/O.

The Kubernetes driver (:mod:`prefixroute.discovery.kubernetes`) lists the slices, then
watches them from the list's ``resourceVersion`` (client-go's informer pattern) and
feeds every object and event here as the plain JSON the API server sent
(``discovery.k8s.io/v1``). :meth:`EndpointSliceCache.instances` gives the current
instances: one per endpoint whose ``conditions.ready`` is true (or unset: the API says
consumers should read an unknown state as ready), at the first of its ``addresses``
(the API says they are fungible), on the slice's port chosen by name.

An endpoint may appear in two slices while the controller moves it; it is one
instance, ready when any slice says so.

Reference: Kubernetes API ``EndpointSlice`` (discovery.k8s.io/v1), "Watch" and
"Resource versions" in the API concepts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from prefixroute.core.discovery import DiscoveredInstance, instance_url

__all__ = ["EndpointSliceCache", "SliceEndpoint", "InvalidWatchEvent", "SERVICE_NAME_LABEL"]

#: The label the EndpointSlice controller puts on a Service's slices.
SERVICE_NAME_LABEL = "kubernetes.io/service-name"


class InvalidWatchEvent(ValueError):
    """An object or event that is not an EndpointSlice as the API defines it."""


@dataclass(frozen=True, slots=True)
class SliceEndpoint:
    """One endpoint of one slice, reduced to what routing needs.

    Attributes:
        url: the instance URL (first address, the chosen port).
        ready: ``conditions.ready`` (unset = ready).
        attributes: ``zone``, ``node``, ``pod`` when the slice names them.
    """

    url: str
    ready: bool
    attributes: tuple[tuple[str, str], ...]


class EndpointSliceCache:
    """The slices of one Service (or label selector) and the resourceVersion seen last.

    Args:
        port_name: the slice port to use (``ports[].name``); ``None`` = the slice's only
            port (a slice with several and no name given is skipped, counted in
            :attr:`skipped`).
        scheme: ``http`` or ``https`` for the instance URLs.

    Attributes:
        resource_version: the last ``resourceVersion`` seen (list, event or bookmark);
            where a watch resumes.
        skipped: slices ignored since the last list (no matching port, FQDN addresses).
    """

    def __init__(self, port_name: str | None = None, scheme: str = "http") -> None:
        self.port_name = port_name
        self.scheme = scheme
        self.resource_version: str | None = None
        self.skipped = 0
        self._slices: dict[str, tuple[SliceEndpoint, ...]] = {}

    # -- input --------------------------------------------------------------------

    def replace(self, items: list[Mapping[str, Any]], resource_version: str) -> None:
        """A full list (``EndpointSliceList.items`` and its ``metadata.resourceVersion``):
        what is not in it is gone.

        Raises:
            InvalidWatchEvent: an item is not an EndpointSlice.
        """
        slices = {}
        self.skipped = 0
        for obj in items:
            name, eps = self._parse(obj)
            slices[name] = eps
        self._slices = slices
        self.resource_version = resource_version

    def apply(self, event: Mapping[str, Any]) -> bool:
        """One watch event (``{"type": ..., "object": {...}}``): ``ADDED``, ``MODIFIED``,
        ``DELETED`` or ``BOOKMARK``.

        Returns:
            ``True`` if the set of slices changed (a bookmark only moves the
            resourceVersion).

        Raises:
            InvalidWatchEvent: an unknown type, an ``ERROR`` event (the driver handles
                those before: 410 Gone means relist), or a malformed object.
        """
        kind = event.get("type")
        obj = event.get("object")
        if not isinstance(obj, Mapping):
            raise InvalidWatchEvent(f"watch event {kind!r} has no object")
        rv = (obj.get("metadata") or {}).get("resourceVersion")
        if kind == "BOOKMARK":
            if not rv:
                raise InvalidWatchEvent("BOOKMARK event without metadata.resourceVersion")
            self.resource_version = str(rv)
            return False
        if kind in ("ADDED", "MODIFIED"):
            name, eps = self._parse(obj)
            changed = self._slices.get(name) != eps
            self._slices[name] = eps
        elif kind == "DELETED":
            name = _name(obj)
            changed = self._slices.pop(name, None) is not None
        else:
            raise InvalidWatchEvent(f"unexpected watch event type {kind!r}")
        if rv:
            self.resource_version = str(rv)
        return changed

    # -- output -------------------------------------------------------------------

    def instances(self) -> list[DiscoveredInstance]:
        """The ready instances over every slice, one per URL, sorted by URL."""
        ready: dict[str, tuple[tuple[str, str], ...]] = {}
        for eps in self._slices.values():
            for ep in eps:
                if ep.ready:
                    ready.setdefault(ep.url, ep.attributes)
        return [DiscoveredInstance(url, attrs) for url, attrs in sorted(ready.items())]

    def endpoints(self) -> list[SliceEndpoint]:
        """Every endpoint of every slice, ready or not (for status pages and tests)."""
        return [ep for eps in self._slices.values() for ep in eps]

    @property
    def slice_names(self) -> list[str]:
        return sorted(self._slices)

    # -- parsing ------------------------------------------------------------------

    def _parse(self, obj: Mapping[str, Any]) -> tuple[str, tuple[SliceEndpoint, ...]]:
        name = _name(obj)
        address_type = obj.get("addressType")
        if address_type not in ("IPv4", "IPv6"):  # FQDN slices are deprecated and not routable here
            self.skipped += 1
            return name, ()
        port = self._port(obj.get("ports") or [])
        if port is None:
            self.skipped += 1
            return name, ()
        out = []
        for ep in obj.get("endpoints") or []:
            if not isinstance(ep, Mapping):
                raise InvalidWatchEvent(f"EndpointSlice {name!r}: an endpoint is not an object")
            addresses = ep.get("addresses") or []
            if not addresses or not isinstance(addresses[0], str):
                continue
            cond = ep.get("conditions") or {}
            ready = cond.get("ready")
            attrs = {}
            if ep.get("zone"):
                attrs["zone"] = str(ep["zone"])
            if ep.get("nodeName"):
                attrs["node"] = str(ep["nodeName"])
            ref = ep.get("targetRef") or {}
            if ref.get("kind") == "Pod" and ref.get("name"):
                attrs["pod"] = str(ref["name"])
            try:
                url = instance_url(self.scheme, addresses[0], port)
            except ValueError as exc:
                raise InvalidWatchEvent(f"EndpointSlice {name!r}: {exc}") from None
            out.append(SliceEndpoint(url, ready is None or ready is True, tuple(sorted(attrs.items()))))
        return name, tuple(sorted(out, key=lambda e: e.url))

    def _port(self, ports: list[Any]) -> int | None:
        usable = [p for p in ports if isinstance(p, Mapping) and isinstance(p.get("port"), int)]
        if self.port_name is not None:
            usable = [p for p in usable if p.get("name") == self.port_name]
        elif len(usable) > 1:
            return None
        return usable[0]["port"] if usable else None


def _name(obj: Mapping[str, Any]) -> str:
    name = (obj.get("metadata") or {}).get("name")
    if not isinstance(name, str) or not name:
        raise InvalidWatchEvent("EndpointSlice without metadata.name")
    return name
