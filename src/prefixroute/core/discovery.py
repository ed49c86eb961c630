"""Discovery, sans-I/O: instances found by a source, turned into membership changes.

A discovery *source* (DNS, Kubernetes EndpointSlices: drivers in
:mod:`prefixroute.discovery`) produces, each time it learns something, the **whole**
current set of instances of one production variant as :class:`DiscoveredInstance`
values. A :class:`Membership` compares that set with the last one applied and returns a
:class:`MembershipChange` (added, removed, the new ordered member list), or ``None``
when nothing changed. The driver hands ``change.instances`` to the router's live
reconfiguration path (:meth:`prefixroute.core.pool.VariantPool.set_instances` through
the fleet configuration), which keeps the state and in-flight counts of the instances
that stay; placement is rendezvous hashing (:mod:`prefixroute.core.hashing`), so adding
one instance to n moves about 1/(n+1) of keys and removing one about 1/n, and no others.

A source that fails (resolver timeout, API server down) reports nothing new:
:meth:`Membership.failed` counts the failure and the last good set stays in force. The
fleet is never emptied by a fault, only by a source that answered "no instance".

This module also holds the small pure pieces of the DNS source (records to instances,
when to resolve again), so that the driver is only I/O.
"""

from __future__ import annotations

import ipaddress
import math
from dataclasses import dataclass, field
from typing import Iterable, Mapping, Sequence

__all__ = [
    "DiscoveredInstance",
    "MembershipChange",
    "Membership",
    "instance_url",
    "instances_from_addresses",
    "instances_from_srv",
    "SrvTarget",
    "next_resolve_delay",
    "retry_delay",
    "expected_moved_fraction",
]


def instance_url(scheme: str, host: str, port: int) -> str:
    """The base URL of an instance: ``http://10.0.0.5:8000``, ``http://[fd00::5]:8000``,
    ``http://vllm-0.vllm.ns.svc:8000`` (a trailing dot of a DNS name is dropped).

    Raises:
        ValueError: ``port`` outside 1-65,535 or ``scheme`` not http/https.
    """
    if scheme not in ("http", "https"):
        raise ValueError(f"scheme {scheme!r} is not http or https")
    if not 1 <= port <= 65_535:
        raise ValueError(f"port {port} is out of range (allowed 1-65,535)")
    host = host.rstrip(".")
    try:
        if ipaddress.ip_address(host).version == 6:
            host = f"[{host}]"
    except ValueError:
        host = host.lower()
    return f"{scheme}://{host}:{port}"


@dataclass(frozen=True, slots=True)
class DiscoveredInstance:
    """One instance as a discovery source sees it.

    Attributes:
        url: its base URL (:func:`instance_url`); the instance's identity in the pool,
            so the same URL from two sources is one instance.
        attributes: what the source knows about it, as sorted ``(name, value)`` pairs:
            ``zone``, ``node``, ``pod`` (Kubernetes), ``dns_name``, ``ttl_s`` (DNS).
            Informational; they take no part in equality.
    """

    url: str
    attributes: tuple[tuple[str, str], ...] = field(default=(), compare=False, hash=False)

    @classmethod
    def make(cls, url: str, attributes: Mapping[str, str] | None = None) -> "DiscoveredInstance":
        """An instance from a URL and a mapping of attributes (sorted for a stable repr)."""
        return cls(url, tuple(sorted((attributes or {}).items())))


@dataclass(frozen=True, slots=True)
class MembershipChange:
    """What one new set changes.

    Attributes:
        instances: the new members' URLs, sorted (placement does not depend on order).
        added: URLs that joined, sorted.
        removed: URLs that left, sorted.
    """

    instances: tuple[str, ...]
    added: tuple[str, ...]
    removed: tuple[str, ...]


class Membership:
    """The last good set of one production variant and what changes it.

    Args:
        initial: URLs in force before the source's first answer (a configuration's
            ``Instances``; may be empty).

    Attributes:
        instances: the URLs in force, sorted.
        updates: sets applied that changed something.
        failures: failures reported with :meth:`failed` (the set was kept).
        answers: answers reported with :meth:`update` (changed or not).
    """

    def __init__(self, initial: Iterable[str] = ()) -> None:
        self.instances: tuple[str, ...] = tuple(sorted(set(initial)))
        self.updates = 0
        self.failures = 0
        self.answers = 0
        self.last_error: str | None = None

    def update(self, found: Iterable[DiscoveredInstance]) -> MembershipChange | None:
        """Adopt the source's current answer (the whole set, duplicates allowed).

        Returns:
            the change, or ``None`` when the set is the one in force.
        """
        self.answers += 1
        self.last_error = None
        new = tuple(sorted({d.url for d in found}))
        if new == self.instances:
            return None
        old = set(self.instances)
        now = set(new)
        self.instances = new
        self.updates += 1
        return MembershipChange(new, tuple(sorted(now - old)), tuple(sorted(old - now)))

    def failed(self, reason: str) -> None:
        """The source could not answer: keep the last good set, count and remember why."""
        self.failures += 1
        self.last_error = reason


# -- DNS ----------------------------------------------------------------------------


def instances_from_addresses(addresses: Iterable[str], port: int, scheme: str = "http",
                             name: str = "") -> list[DiscoveredInstance]:
    """A/AAAA answers to instances: one per address, all on ``port``.

    Raises:
        ValueError: an address that is not an IP literal, or a bad port/scheme.
    """
    out = []
    for a in addresses:
        ip = ipaddress.ip_address(a)  # ValueError for anything else
        out.append(DiscoveredInstance.make(instance_url(scheme, str(ip), port), {"dns_name": name} if name else {}))
    return out


@dataclass(frozen=True, slots=True)
class SrvTarget:
    """One SRV record (RFC 2782): ``priority weight port target``."""

    priority: int
    weight: int
    port: int
    target: str


def instances_from_srv(records: Sequence[SrvTarget], addresses: Mapping[str, Sequence[str]] | None = None,
                       scheme: str = "http") -> list[DiscoveredInstance]:
    """SRV answers to instances.

    Every record is an instance whatever its priority and weight (the router places
    requests itself; RFC 2782's selection is for clients without a policy). A target
    of ``.`` means "no service" (RFC 2782) and is skipped.

    Args:
        records: the SRV records.
        addresses: the target names resolved to IP addresses, when the driver resolved
            them (one instance per address); a target missing here is used by name.
    """
    out = []
    for r in records:
        target = r.target.rstrip(".").lower()
        if not target or r.port == 0:
            continue
        ips = (addresses or {}).get(target)
        if ips:
            for ip in ips:
                out.append(DiscoveredInstance.make(instance_url(scheme, ip, r.port), {"dns_name": target}))
        else:
            out.append(DiscoveredInstance.make(instance_url(scheme, target, r.port), {"dns_name": target}))
    return out


#: The shortest wait between two resolutions, seconds: a record with TTL 0 (some
#: resolvers hand those out) must not turn the loop into a busy one.
MIN_RESOLVE_INTERVAL_S = 1.0


def next_resolve_delay(interval_s: float, ttls_s: Iterable[float]) -> float:
    """Seconds until the next resolution: ``interval_s``, or sooner when an answer's
    TTL runs out sooner (the records would be stale), never below
    :data:`MIN_RESOLVE_INTERVAL_S`."""
    ttl = min((t for t in ttls_s if t >= 0 and math.isfinite(t)), default=math.inf)
    return max(MIN_RESOLVE_INTERVAL_S, min(interval_s, ttl))


def retry_delay(attempt: int, base_s: float = 0.5, cap_s: float = 30.0) -> float:
    """Backoff after ``attempt`` consecutive failures (1, 2, ...): ``base_s * 2**(attempt-1)``
    capped at ``cap_s`` (client-go's informers back off the same way, 0.8 s to 30 s)."""
    if attempt < 1:
        return 0.0
    return min(cap_s, base_s * 2.0 ** min(attempt - 1, 30))


def expected_moved_fraction(before: int, after: int) -> float:
    """The share of keys rendezvous hashing moves when a pool goes from ``before`` to
    ``after`` instances by additions only or removals only: ``|after - before| /
    max(before, after)`` (Thaler & Ravishankar 1998; see :mod:`prefixroute.core.hashing`)."""
    if before == after:
        return 0.0
    return abs(after - before) / max(before, after)
