"""DNS discovery: a name's A/AAAA (or SRV) records are a variant's instances.

The name is resolved every ``IntervalSeconds``, sooner when the answer's TTL runs out
first (:func:`prefixroute.core.discovery.next_resolve_delay`). Any failure (timeout,
SERVFAIL, NXDOMAIN, no records of the type) keeps the last good set: a resolver outage
or a name briefly missing never empties the fleet. Failures are retried with backoff
(0.5 s doubling, at most the interval).

Uses ``dnspython``'s asyncio resolver (no cache: every resolution asks the server).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Awaitable, Callable, Sequence

import dns.asyncresolver
import dns.exception
import dns.nameserver
import dns.resolver

from prefixroute.core.discovery import (
    DiscoveredInstance,
    SrvTarget,
    instances_from_addresses,
    instances_from_srv,
    next_resolve_delay,
    retry_delay,
)
from prefixroute.core.discovery_config import DnsDiscoveryConfig, parse_nameserver

__all__ = ["DnsSource", "ResolveFailed", "make_resolver"]

log = logging.getLogger("prefixroute.discovery")

Report = Callable[[list[DiscoveredInstance]], None]
Fail = Callable[[str, str], None]


class ResolveFailed(Exception):
    """One resolution failed; ``kind`` is the metric label (``timeout``, ``nxdomain``,
    ``no_answer``, ``servfail``, ``error``)."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


def make_resolver(cfg: DnsDiscoveryConfig) -> dns.asyncresolver.Resolver:
    """A resolver for ``cfg``: its ``Nameservers`` (with ports), else the system's."""
    if cfg.nameservers:
        resolver = dns.asyncresolver.Resolver(configure=False)
        resolver.nameservers = [dns.nameserver.Do53Nameserver(*parse_nameserver(ns)) for ns in cfg.nameservers]
    else:
        resolver = dns.asyncresolver.Resolver()
    resolver.lifetime = cfg.timeout_s
    resolver.timeout = min(cfg.timeout_s, 2.0)
    resolver.cache = None
    return resolver


async def _query(resolver: dns.asyncresolver.Resolver, name: str, rdtype: str) -> dns.resolver.Answer:
    try:
        return await resolver.resolve(name, rdtype)
    except dns.resolver.NXDOMAIN:
        raise ResolveFailed("nxdomain", f"{name} does not exist (NXDOMAIN)") from None
    except dns.resolver.NoAnswer:
        raise ResolveFailed("no_answer", f"{name} has no {rdtype} records") from None
    except dns.resolver.NoNameservers as exc:
        raise ResolveFailed("servfail", f"{name} {rdtype}: no server answered ({exc})") from None
    except dns.exception.Timeout:
        raise ResolveFailed("timeout", f"{name} {rdtype}: timed out after {resolver.lifetime} s") from None
    except dns.exception.DNSException as exc:
        raise ResolveFailed("error", f"{name} {rdtype}: {type(exc).__name__}: {exc}") from None


async def _addresses(resolver: dns.asyncresolver.Resolver, name: str, types: Sequence[str]
                     ) -> tuple[list[str], list[float]]:
    """Addresses of ``name`` over ``types`` and their TTLs. One type answering is
    enough (a name with A records and no AAAA is normal); all failing is a failure."""
    addresses: list[str] = []
    ttls: list[float] = []
    errors: list[ResolveFailed] = []
    for t in types:
        try:
            ans = await _query(resolver, name, t)
        except ResolveFailed as exc:
            errors.append(exc)
            continue
        ttls.append(float(ans.rrset.ttl) if ans.rrset is not None else 0.0)
        addresses.extend(r.address for r in ans)
    if not addresses and errors:
        # A timeout says more than the other type's NoAnswer.
        raise next((e for e in errors if e.kind not in ("no_answer", "nxdomain")), errors[0])
    return addresses, ttls


async def resolve_once(resolver: dns.asyncresolver.Resolver, cfg: DnsDiscoveryConfig
                       ) -> tuple[list[DiscoveredInstance], list[float]]:
    """Resolve ``cfg.name`` once: ``(instances, ttls)``.

    Raises:
        ResolveFailed: any part of the resolution failed (the caller keeps its last set).
    """
    ip_types = {"A": ("A",), "AAAA": ("AAAA",), "A+AAAA": ("A", "AAAA"), "SRV": ("A", "AAAA")}[cfg.record_type]
    if cfg.record_type != "SRV":
        addresses, ttls = await _addresses(resolver, cfg.name, ip_types)
        assert cfg.port is not None
        return instances_from_addresses(addresses, cfg.port, cfg.scheme, cfg.name.rstrip(".")), ttls
    ans = await _query(resolver, cfg.name, "SRV")
    ttls = [float(ans.rrset.ttl) if ans.rrset is not None else 0.0]
    records = [SrvTarget(r.priority, r.weight, r.port, r.target.to_text()) for r in ans]
    resolved: dict[str, list[str]] = {}
    for target in sorted({r.target.rstrip(".").lower() for r in records if r.target not in (".", "")}):
        addrs, t = await _addresses(resolver, target + ".", ip_types)
        resolved[target] = addrs
        ttls.extend(t)
    return instances_from_srv(records, resolved, cfg.scheme), ttls


class DnsSource:
    """Resolves one DNS name for one production variant until cancelled.

    Args:
        cfg: the variant's ``Discovery.DNS`` settings.
        report: called with the whole set after each successful resolution.
        fail: called with ``(kind, message)`` after each failed one.
        sleep: the wait between resolutions (``asyncio.sleep``; replaceable to step time).
    """

    def __init__(self, cfg: DnsDiscoveryConfig, report: Report, fail: Fail,
                 sleep: Callable[[float], Awaitable[None]] = asyncio.sleep) -> None:
        self.cfg = cfg
        self._report = report
        self._fail = fail
        self._sleep = sleep
        self.resolver = make_resolver(cfg)

    async def run(self) -> None:
        """Resolve, report, wait; forever (cancel the task to stop)."""
        failures = 0
        while True:
            try:
                found, ttls = await resolve_once(self.resolver, self.cfg)
            except ResolveFailed as exc:
                failures += 1
                self._fail(exc.kind, str(exc))
                await self._sleep(min(self.cfg.interval_s, retry_delay(failures)))
                continue
            failures = 0
            self._report(found)
            await self._sleep(next_resolve_delay(self.cfg.interval_s, ttls))
