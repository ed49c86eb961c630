"""The sans-I/O discovery core: membership changes, EndpointSlice state, DNS helpers,
discovery configuration, and key movement through the pool when membership changes."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixroute.core.config import ConfigError, FleetConfig, RoutingConfig
from prefixroute.core.discovery import (DiscoveredInstance, Membership, SrvTarget, expected_moved_fraction,
                                        instance_url, instances_from_addresses, instances_from_srv,
                                        next_resolve_delay, retry_delay)
from prefixroute.core.endpointslices import EndpointSliceCache, InvalidWatchEvent
from prefixroute.core.pool import VariantPool


def _d(*urls: str) -> list[DiscoveredInstance]:
    return [DiscoveredInstance(u) for u in urls]


def test_membership_reports_changes_only():
    m = Membership(["http://a:1"])
    assert m.update(_d("http://a:1")) is None
    ch = m.update(_d("http://b:1", "http://a:1", "http://b:1"))
    assert ch is not None and ch.added == ("http://b:1",) and ch.removed == () and ch.instances == (
        "http://a:1", "http://b:1")
    ch = m.update(_d("http://b:1"))
    assert ch.removed == ("http://a:1",) and ch.instances == ("http://b:1",)
    m.failed("timeout: x")
    assert m.instances == ("http://b:1",) and m.failures == 1 and m.last_error == "timeout: x"
    assert m.updates == 2 and m.answers == 3
    ch = m.update([])  # a source that answered "none" does empty it
    assert ch.instances == () and ch.removed == ("http://b:1",)


def test_instance_url_and_records():
    assert instance_url("http", "fd00::5", 80) == "http://[fd00::5]:80"
    assert instance_url("https", "Vllm-0.ns.svc.", 8000) == "https://vllm-0.ns.svc:8000"
    with pytest.raises(ValueError):
        instance_url("ftp", "a", 1)
    with pytest.raises(ValueError):
        instance_url("http", "a", 0)
    got = instances_from_addresses(["10.0.0.2", "::1"], 8000, name="v.test")
    assert [i.url for i in got] == ["http://10.0.0.2:8000", "http://[::1]:8000"]
    assert dict(got[0].attributes) == {"dns_name": "v.test"}
    with pytest.raises(ValueError):
        instances_from_addresses(["not-an-ip"], 1)
    srv = [SrvTarget(0, 5, 8001, "a.test."), SrvTarget(10, 0, 8002, "b.test."), SrvTarget(0, 0, 0, "."),
           SrvTarget(0, 0, 9, ".")]
    got = instances_from_srv(srv, {"a.test": ["10.0.0.1", "10.0.0.2"]})
    assert [i.url for i in got] == ["http://10.0.0.1:8001", "http://10.0.0.2:8001", "http://b.test:8002"]


def test_resolve_delay_and_backoff():
    assert next_resolve_delay(10, [30, 60]) == 10
    assert next_resolve_delay(10, [3, 60]) == 3
    assert next_resolve_delay(10, [0]) == 1.0  # never a busy loop
    assert next_resolve_delay(10, []) == 10
    assert [retry_delay(i) for i in range(0, 9)] == [0.0, 0.5, 1, 2, 4, 8, 16, 30, 30]
    assert expected_moved_fraction(4, 5) == pytest.approx(0.2)
    assert expected_moved_fraction(5, 4) == pytest.approx(0.2)


def _slice(name: str, eps: list[tuple[str, bool | None]], port: int = 8000, rv: str = "5",
           port_name: str | None = "http", address_type: str = "IPv4") -> dict:
    return {"metadata": {"name": name, "resourceVersion": rv},
            "addressType": address_type,
            "ports": [{"name": port_name, "port": port, "protocol": "TCP"}],
            "endpoints": [{"addresses": [a], "conditions": ({} if r is None else {"ready": r}),
                           "zone": "z1", "targetRef": {"kind": "Pod", "name": f"pod-{a}"}} for a, r in eps]}


def test_endpointslice_cache_list_watch_bookmark():
    c = EndpointSliceCache(port_name="http")
    c.replace([_slice("s1", [("10.0.0.1", True), ("10.0.0.2", False)]),
               _slice("s2", [("10.0.0.3", None), ("10.0.0.1", True)])], "10")
    assert c.resource_version == "10"
    assert [i.url for i in c.instances()] == ["http://10.0.0.1:8000", "http://10.0.0.3:8000"]
    assert dict(c.instances()[0].attributes) == {"pod": "pod-10.0.0.1", "zone": "z1"}
    assert c.apply({"type": "MODIFIED", "object": _slice("s1", [("10.0.0.1", True), ("10.0.0.2", True)],
                                                         rv="11")})
    assert c.resource_version == "11" and len(c.instances()) == 3
    # the same content again changes nothing
    assert not c.apply({"type": "MODIFIED", "object": _slice("s1", [("10.0.0.1", True), ("10.0.0.2", True)],
                                                             rv="12")})
    assert not c.apply({"type": "BOOKMARK", "object": {"metadata": {"resourceVersion": "20"}}})
    assert c.resource_version == "20"
    assert c.apply({"type": "DELETED", "object": _slice("s2", [], rv="21")})
    assert [i.url for i in c.instances()] == ["http://10.0.0.1:8000", "http://10.0.0.2:8000"]
    assert not c.apply({"type": "DELETED", "object": _slice("nope", [], rv="22")})
    with pytest.raises(InvalidWatchEvent):
        c.apply({"type": "ERROR", "object": {"code": 410}})
    with pytest.raises(InvalidWatchEvent):
        c.apply({"type": "BOOKMARK", "object": {"metadata": {}}})
    with pytest.raises(InvalidWatchEvent):
        c.apply({"type": "ADDED", "object": {"metadata": {}}})
    # a relist replaces everything
    c.replace([], "30")
    assert c.instances() == [] and c.slice_names == []


def test_endpointslice_ports_and_address_types():
    c = EndpointSliceCache(port_name="metrics")
    c.replace([_slice("s1", [("10.0.0.1", True)])], "1")
    assert c.instances() == [] and c.skipped == 1
    c = EndpointSliceCache()  # no name: the only port
    two = _slice("s1", [("10.0.0.1", True)])
    two["ports"].append({"name": "metrics", "port": 9000})
    c.replace([two, _slice("s2", [("fd00::1", True)], address_type="IPv6"),
               _slice("s3", [("vllm.example", True)], address_type="FQDN")], "1")
    assert [i.url for i in c.instances()] == ["http://[fd00::1]:8000"] and c.skipped == 2


def test_discovery_config_validation():
    ok = FleetConfig.from_yaml("""
Endpoints:
  - EndpointName: chat
    ProductionVariants:
      - VariantName: a
        Discovery: {DNS: {Name: vllm.llm.svc.cluster.local, Port: 8000, IntervalSeconds: 5,
                          Nameservers: ["127.0.0.1:5353", "[::1]:53", "10.0.0.10"]}}
      - VariantName: b
        Discovery: {Kubernetes: {Service: vllm, Namespace: llm, PortName: http}}
        Instances: ["http://10.0.0.9:8000"]
      - VariantName: c
        Discovery: {DNS: {Name: _http._tcp.vllm.test, RecordType: srv}}
""")
    a, b, c = ok.endpoints[0].variants
    assert a.instances == () and a.discovery.dns.port == 8000 and a.discovery.source == "dns"
    assert b.discovery.kubernetes.selector == "kubernetes.io/service-name=vllm" and b.instances
    assert c.discovery.dns.record_type == "SRV"
    bad = {
        "Discovery: {DNS: {Name: vllm.test}}": "Port: required with RecordType A",
        "Discovery: {DNS: {Name: 'bad name', Port: 1}}": "is not a DNS name",
        "Discovery: {DNS: {Name: v.test, Port: 1, Nameservers: [example.com]}}": "is not an IP address",
        "Discovery: {DNS: {Name: v.test, Port: 1, IntervalSeconds: 0.1}}": "greater than or equal to 1",
        "Discovery: {Kubernetes: {}}": "exactly one of Service and LabelSelector",
        "Discovery: {Kubernetes: {Service: Bad_Name}}": "not a valid Kubernetes name",
        "Discovery: {}": "exactly one source",
        "Discovery: {DNS: {Name: v.test, Port: 1}, Kubernetes: {Service: v}}": "exactly one source",
        "Instances: []": "at least one instance is required",
    }
    for line, msg in bad.items():
        doc = "Endpoints:\n  - EndpointName: e\n    ProductionVariants:\n      - VariantName: v\n        " + line
        with pytest.raises(ConfigError, match=msg):
            FleetConfig.from_yaml(doc)


PA = RoutingConfig.build("prefix-aware", 1024, 64)


def _owners(pool: VariantPool, keys: list[int]) -> list[str]:
    return [pool.choose(k).instance.instance_id for k in keys]


@settings(max_examples=30, deadline=None)
@given(n=st.integers(2, 12), seed=st.integers(0, 2**32 - 1))
def test_membership_change_moves_about_one_nth_of_keys(n: int, seed: int):
    """Adding one instance to n moves only keys to the new one, about 1/(n+1) of them;
    removing one moves only its keys, each to another member."""
    rng = random.Random(seed)
    keys = [rng.getrandbits(64) for _ in range(4000)]
    urls = [f"http://10.0.{seed % 250}.{i}:8000" for i in range(n + 1)]
    m = Membership(urls[:n])
    pool = VariantPool("v", m.instances, PA)
    before = _owners(pool, keys)
    ch = m.update(_d(*urls))
    pool.set_instances(ch.instances)
    after = _owners(pool, keys)
    moved = [(b, a) for b, a in zip(before, after) if b != a]
    assert all(a == urls[n] for _, a in moved)
    assert abs(len(moved) / len(keys) - expected_moved_fraction(n, n + 1)) < 0.035
    gone = urls[rng.randrange(n + 1)]
    ch = m.update(_d(*(u for u in urls if u != gone)))
    pool.set_instances(ch.instances)
    final = _owners(pool, keys)
    moved2 = [(b, a) for b, a in zip(after, final) if b != a]
    assert all(b == gone for b, _ in moved2) and all(a != gone for _, a in moved2)
    assert len(moved2) == after.count(gone)
    assert abs(len(moved2) / len(keys) - expected_moved_fraction(n + 1, n)) < 0.035


def test_pool_keeps_in_flight_of_staying_instances():
    m = Membership(["http://a:1", "http://b:1"])
    pool = VariantPool("v", m.instances, PA)
    lease = pool.acquire(12345)
    kept = lease.instance.instance_id
    other = "http://b:1" if kept == "http://a:1" else "http://a:1"
    pool.set_instances(m.update(_d(kept, "http://c:1")).instances)
    assert pool.get(kept).in_flight == 1 and pool.get(other) is None
    lease.release()
    assert pool.total_in_flight() == 0
