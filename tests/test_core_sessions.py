"""Sticky sessions in the core: ids, pins, overflow, and replicas agreeing without talking."""

import pytest

from prefixroute.core.config import RoutingConfig
from prefixroute.core.keys import InvalidRequest
from prefixroute.core.pool import VariantPool
from prefixroute.core.sessions import NEW_SESSION, instance_tag, parse_session_id, pin_session_id
from prefixroute.core.strategies import DecisionKind

URLS = [f"http://10.8.0.{i}:8000" for i in range(6)]


def test_session_ids_follow_sagemakers_rules():
    assert parse_session_id(NEW_SESSION) is None
    pin = parse_session_id("abc-123")
    assert (pin.tag, pin.upstream_id) == (None, "abc-123")
    for bad in ("", "-lead", "trail-", "has space", "x" * 257, "é"):
        with pytest.raises(InvalidRequest):
            parse_session_id(bad)
    # a configured header takes any printable ASCII, up to 1,024 characters
    assert parse_session_id("user 42 / chat 7", sagemaker=False).upstream_id == "user 42 / chat 7"
    with pytest.raises(InvalidRequest):
        parse_session_id("x" * 1025, sagemaker=False)


def test_a_pinned_id_names_its_instance_and_keeps_the_containers_id():
    value = pin_session_id("container-id-7; Expires=2026-12-31T00:00:00Z", URLS[3])
    sid, _, expires = value.partition(";")
    assert sid == f"container-id-7-pr{instance_tag(URLS[3])}" and expires.strip() == "Expires=2026-12-31T00:00:00Z"
    pin = parse_session_id(sid)
    assert (pin.tag, pin.upstream_id) == (instance_tag(URLS[3]), "container-id-7")
    minted = pin_session_id(None, URLS[1])
    assert parse_session_id(minted).tag == instance_tag(URLS[1])  # and it matches SageMaker's pattern
    assert len({instance_tag(u) for u in URLS}) == len(URLS)


@pytest.mark.parametrize("routing", [RoutingConfig(), RoutingConfig.build("cache-aware", None, 3),
                                     RoutingConfig.build("prefix-aware", 1024, 3)])
def test_a_session_sticks_to_one_instance_below_the_threshold(routing):
    pool = VariantPool("v", URLS, routing, seed=1)
    pin = parse_session_id("chat-1")
    first = pool.choose(None, session=pin).instance
    for _ in range(50):
        with pool.acquire(None, session=pin) as lease:
            assert (lease.instance, lease.decision.kind) == (first, DecisionKind.SESSION)


def test_a_session_at_the_threshold_overflows_along_its_own_order():
    pool = VariantPool("v", URLS, RoutingConfig.build("cache-aware", None, 2))
    pin = parse_session_id("chat-2")
    leases = [pool.acquire(None, session=pin) for _ in range(6)]
    homes = [lease.instance.instance_id for lease in leases]
    assert homes[0] == homes[1] and homes[2] == homes[3] and homes[4] == homes[5] and len(set(homes)) == 3
    assert [lease.decision.kind for lease in leases] == [DecisionKind.SESSION] * 2 + [DecisionKind.OVERFLOW] * 4
    other = VariantPool("v", URLS, RoutingConfig.build("cache-aware", None, 2))  # a replica: the same order
    seen = []
    for _ in range(6):
        seen.append(other.acquire(None, session=pin).instance.instance_id)
    assert seen == homes


def test_replicas_agree_on_every_session_whatever_their_load():
    a = VariantPool("v", URLS, RoutingConfig.build("cache-aware", None, 64), seed=1)
    b = VariantPool("v", URLS, RoutingConfig.build("cache-aware", None, 64), seed=2)
    for i, inst in enumerate(a.instances):  # different loads on the two replicas
        inst.in_flight = i * 5
    for k in range(300):
        pin = parse_session_id(f"s{k}")
        assert a.choose(None, session=pin).instance.instance_id == b.choose(None, session=pin).instance.instance_id
    spread = {a.choose(None, session=parse_session_id(f"s{k}")).instance.instance_id for k in range(300)}
    assert spread == set(URLS)


def test_a_minted_session_goes_to_its_instance_on_any_replica_and_moves_only_when_it_is_gone():
    pool = VariantPool("v", URLS, RoutingConfig.build("cache-aware", None, 8))
    sid = pin_session_id(None, URLS[4])
    pin = parse_session_id(sid)
    assert pool.choose(None, session=pin).instance.instance_id == URLS[4]
    pool.set_healthy(URLS[4], False)
    moved = pool.choose(None, session=pin).instance.instance_id
    assert moved != URLS[4]
    replica = VariantPool("v", URLS, RoutingConfig.build("cache-aware", None, 8))
    replica.set_healthy(URLS[4], False)
    assert replica.choose(None, session=pin).instance.instance_id == moved
    pool.set_healthy(URLS[4], True)
    assert pool.choose(None, session=pin).instance.instance_id == URLS[4]  # back once healthy
