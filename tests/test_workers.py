"""``prefixroute serve --workers N``: the shared in-flight table, and the supervisor with
real worker processes on loopback in front of real (held) HTTP backends."""

from __future__ import annotations

import argparse
import contextlib
import asyncio
import functools
import logging
import multiprocessing
import os
import re
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Awaitable

import aiohttp
import orjson
import pytest
import yaml
from hypothesis import example, given, settings
from hypothesis import strategies as st
from aiohttp import web

from prefixroute.core.config import ConfigError, FleetConfig, RoutingConfig
from prefixroute.core.counters import (
    InFlightTable,
    InFlightTableFull,
    InFlightTableLocked,
    SharedInstanceState,
    slot_key,
)
from prefixroute.core.pool import NoHealthyInstance, VariantPool
from prefixroute.core.strategies import DecisionKind, InstanceState
from prefixroute.server.cli import configure_parser
from prefixroute.server.settings import ServerSettings
from prefixroute.server.state import RouterState
from prefixroute.server.workers import FileLock, SharedCounters, worker_trace_path

SPAWN = multiprocessing.get_context("spawn")
URLS = [f"http://10.0.0.{i}:8000" for i in range(1, 5)]


# -- the table, in one process ------------------------------------------------------


def _table_views(workers: int, capacity: int = 64) -> list[InFlightTable]:
    buf = bytearray(InFlightTable.size(capacity, workers))
    InFlightTable.initialize(buf, capacity, workers)
    return [InFlightTable(buf, w) for w in range(workers)]


def test_single_process_state_is_a_plain_int():
    s = InstanceState("http://a:1")
    s.add_in_flight(2)
    s.add_in_flight(-1)
    assert s.in_flight == 1 and type(s) is InstanceState


def test_pools_of_two_workers_see_each_others_requests():
    w0, w1 = _table_views(2)
    routing = RoutingConfig.build("prefix-aware", 1024, 3)
    p0 = VariantPool("v", URLS[:2], routing, seed=1, make_state=w0.states("e", "v"))
    p1 = VariantPool("v", URLS[:2], routing, seed=2, make_state=w1.states("e", "v"))
    assert all(isinstance(i, SharedInstanceState) for i in (*p0.instances, *p1.instances))
    key = 12345
    leases = [p0.acquire(key), p0.acquire(key), p1.acquire(key)]  # 3 = the threshold, on the key's instance
    preferred = leases[0].instance.instance_id
    assert {lease.instance.instance_id for lease in leases} == {preferred}
    assert p0.get(preferred).in_flight == p1.get(preferred).in_flight == 3
    assert p0.get(preferred).own_in_flight == 2 and p1.get(preferred).own_in_flight == 1
    over = p1.acquire(key)  # worker 1 sees worker 0's two: overflow
    assert over.decision.kind is DecisionKind.OVERFLOW and over.instance.instance_id != preferred
    for lease in (*leases, over):
        lease.release()
        lease.release()  # idempotent
    assert [i.in_flight for i in p0.instances] == [0, 0] == [i.in_flight for i in p1.instances]
    with pytest.raises(AttributeError):
        p0.instances[0].in_flight = 5


def test_slot_survives_membership_changes_and_removed_leases_release():
    (w0,) = _table_views(1)
    pool = VariantPool("v", URLS[:2], RoutingConfig.build("least-outstanding-requests"), seed=1,
                       make_state=w0.states("e", "v"))
    lease = pool.acquire(None)
    gone = lease.instance.instance_id
    pool.set_instances([u for u in URLS[:3] if u != gone])
    assert pool.get(gone) is None
    pool.set_instances(URLS[:3])  # back, with its request still in flight
    assert pool.get(gone).in_flight == 1
    lease.release()
    assert pool.get(gone).in_flight == 0
    assert w0.used == 3


def test_capacity_error_is_all_or_nothing():
    (w0,) = _table_views(1, capacity=3)
    w0.reserve([1, 2])
    with pytest.raises(InFlightTableFull, match=r"full: 2 of 3 .* needs 2 more"):
        w0.reserve([2, 3, 4])
    assert w0.used == 2  # nothing claimed
    assert w0.reserve([3, 1]) == [2, 0]
    # Through the router's state: a configuration that does not fit is refused whole.
    (t,) = _table_views(1, capacity=4)
    state = RouterState(FleetConfig.single(URLS[:3], RoutingConfig.build("random")),
                        ServerSettings(port=0), counters=t)
    bigger = FleetConfig.single(URLS[:2] + [f"http://10.0.1.{i}:8000" for i in range(3)], RoutingConfig.build("random"))
    with pytest.raises(InFlightTableFull):
        state.apply_config(bigger)
    assert [i.instance_id for _, p in state.fleet.all_pools() for i in p.instances] == URLS[:3]
    assert t.used == 3


def test_slots_of_instances_gone_for_good_are_taken_over_once_no_worker_holds_them():
    w0, w1 = _table_views(2, capacity=4)
    a, b, c, d, e, f = (slot_key("e", "v", f"http://10.0.2.{i}:8000") for i in range(6))
    first = w0.reserve([a, b, c])
    assert w1.reserve([c, b, a]) == first[::-1]  # the same slots, held by both
    assert [w0.holders(s) for s in first] == [0b11] * 3
    w0.retain([a])  # worker 0 has applied a configuration without b and c; worker 1 not yet
    assert [w0.holders(s) for s in first] == [0b11, 0b10, 0b10]
    with pytest.raises(InFlightTableFull, match=r"full: 3 of 4 .* needs 2 more"):
        w0.reserve([a, d, e])  # one never-used slot; b and c are still worker 1's
    assert w0.used == 3 and w0.holders(first[1]) == 0b10  # nothing changed
    w1.retain([a])
    got = w0.reserve([a, d, e])
    assert got[0] == first[0] and got[1] == 3  # the never-used slot first
    assert got[2] in first[1:]  # then one that nobody holds, taken over
    assert w0.used == 4 and w0.in_use == 3
    # A slot with a request in flight is not taken over, held or not.
    w0.add(got[1], 1)  # a request to d, whose instance then leaves
    w0.retain([a, e])
    assert w0.holders(got[1]) == 0 and w0.in_use == 3
    spare = next(s for s in first[1:] if s != got[2])
    assert w1.reserve([f]) == [spare]
    with pytest.raises(InFlightTableFull, match=r"full: 4 of 4 .* needs 1 more"):
        w1.reserve([b])
    assert w0.total(got[1]) == 1  # still d's count
    w0.add(got[1], -1)  # the request is over: its slot is free
    assert w1.reserve([b]) == [got[1]]
    # A key reserved again after a worker let go of it keeps its slot while it has one.
    w0.retain([])
    assert w0.reserve([e]) == [got[2]]
    # A dead worker's slots are let go with its counts.
    w1.add(spare, 2)
    assert w0.zero_worker(1) is True
    assert w1.total(spare) == 0 and w0.holders(spare) == 0 and w0.holders(got[2]) == 0b01


async def test_a_change_waits_for_another_worker_to_let_go_of_a_slot_it_needs():
    """Two workers' states over a 4-slot table. Worker 1 keeps the slot of an instance
    removed while its request was in flight (the request is over since). A change that
    needs that slot, applied by worker 0 first, finds the table full: through the admin
    API it waits for worker 1 to apply the same change (which lets go of the slot) and
    is then taken, instead of a 400 that the supervisor turned into a 502."""
    from prefixroute.server.admin import TABLE_FULL_WAIT_S, build_admin_app
    from prefixroute.server.runner import _start

    w0, w1 = _table_views(2, capacity=4)
    lor = RoutingConfig.build("least-outstanding-requests")
    u = [f"http://10.0.3.{i}:8000" for i in range(5)]
    s0 = RouterState(FleetConfig.single(u[:2], lor), ServerSettings(port=0), counters=w0)
    s1 = RouterState(FleetConfig.single(u[:2], lor), ServerSettings(port=0), counters=w1)
    (_, pool1), = s1.fleet.all_pools()
    lease = pool1.acquire(None, exclude={u[0]})
    assert lease.instance.instance_id == u[1]
    second = FleetConfig.single([u[0], u[2]], lor)
    s0.apply_config(second)
    s1.apply_config(second)  # u[1] retired in worker 1, its request in flight
    lease.release()
    third = FleetConfig.single([u[0], u[2], u[3], u[4]], lor)  # 2 more slots: 1 free, 1 is u[1]'s
    with pytest.raises(InFlightTableFull):
        s0.apply_config(third)  # at once: worker 1 has not let go yet
    runner, port = await _start(build_admin_app(s0), "127.0.0.1", 0, 1.0)
    try:
        async def worker_1_applies_it() -> None:
            await asyncio.sleep(TABLE_FULL_WAIT_S / 4)
            s1.apply_config(third)

        def doc(instances: list[str]) -> dict:
            return {"Endpoints": [{"EndpointName": "default", "ProductionVariants": [{
                "VariantName": "AllTraffic", "Instances": instances,
                "RoutingConfig": {"RoutingStrategy": "LEAST_OUTSTANDING_REQUESTS"}}]}]}

        later = asyncio.create_task(worker_1_applies_it())
        async with aiohttp.ClientSession() as http:
            t0 = time.monotonic()
            async with http.put(f"http://127.0.0.1:{port}/admin/config", json=doc([u[0], u[2], u[3], u[4]])) as r:
                assert r.status == 200, await r.text()
            assert time.monotonic() - t0 >= TABLE_FULL_WAIT_S / 4  # taken once worker 1 had let go
            await later
            # Nobody lets go of anything: refused, after the wait.
            t0 = time.monotonic()
            async with http.put(f"http://127.0.0.1:{port}/admin/config",
                                json=doc([u[0], "http://10.0.4.1:8000", "http://10.0.4.2:8000"])) as r:
                assert r.status == 400 and "full" in (await r.json())["message"]
            assert time.monotonic() - t0 >= TABLE_FULL_WAIT_S
        assert sorted(i.instance_id for _, p in s0.fleet.all_pools() for i in p.instances) == sorted(u[:1] + u[2:])
    finally:
        await runner.cleanup()


async def test_a_reload_waits_like_an_admin_change(tmp_path, caplog):
    """SIGHUP's reload in a worker (reload_logged_waiting) waits for the other workers to
    let go of a slot, as an admin change does; what cannot fit is still refused, logged."""
    from prefixroute.server.admin import TABLE_FULL_WAIT_S
    from prefixroute.server.runner import reload_logged_waiting

    w0, w1 = _table_views(2, capacity=4)
    lor = RoutingConfig.build("least-outstanding-requests")
    u = [f"http://10.0.5.{i}:8000" for i in range(5)]
    cfg = tmp_path / "fleet.yaml"
    settings = ServerSettings(port=0, config_path=str(cfg))
    s0 = RouterState(FleetConfig.single(u[:2], lor), settings, counters=w0)
    s1 = RouterState(FleetConfig.single(u[:2], lor), settings, counters=w1)
    (_, pool1), = s1.fleet.all_pools()
    lease = pool1.acquire(None, exclude={u[0]})
    for state in (s0, s1):
        state.apply_config(FleetConfig.single([u[0], u[2]], lor))  # u[1] retired in worker 1
    lease.release()

    def write(instances: list[str]) -> None:
        cfg.write_text(yaml.safe_dump({"Endpoints": [{"EndpointName": "default", "ProductionVariants": [{
            "VariantName": "AllTraffic", "Instances": instances,
            "RoutingConfig": {"RoutingStrategy": "LEAST_OUTSTANDING_REQUESTS"}}]}]}))

    write([u[0], u[2], u[3], u[4]])  # 2 more slots: 1 free, 1 is u[1]'s until worker 1 reloads

    async def worker_1_reloads() -> None:
        await asyncio.sleep(TABLE_FULL_WAIT_S / 4)
        s1.reload_config_file()

    later = asyncio.create_task(worker_1_reloads())
    assert await reload_logged_waiting(s0) is True
    await later
    assert sorted(i.instance_id for _, p in s0.fleet.all_pools() for i in p.instances) == sorted([u[0], *u[2:]])
    write([u[1]])
    assert s0.read_config_file().endpoints[0].variants[0].instances == (u[1],)
    # (read, not applied)
    assert sorted(i.instance_id for _, p in s0.fleet.all_pools() for i in p.instances) == sorted([u[0], *u[2:]])
    write([u[0], "http://10.0.6.1:8000", "http://10.0.6.2:8000"])  # cannot fit while the old ones are held
    with caplog.at_level(logging.ERROR, logger="prefixroute.server"):
        assert await reload_logged_waiting(s0) is False
    assert "reload failed" in caplog.text and "full" in caplog.text


def test_router_state_churning_instances_reuses_slots_and_a_retired_one_keeps_its_count():
    (t,) = _table_views(1, capacity=4)
    lor = RoutingConfig.build("least-outstanding-requests")
    state = RouterState(FleetConfig.single(URLS[:2], lor), ServerSettings(port=0), counters=t)
    (_, pool), = state.fleet.all_pools()
    lease = pool.acquire(None)
    kept = lease.instance.instance_id
    other = next(u for u in URLS[:2] if u != kept)
    # Twelve configurations of fresh instances: 24 triples through a table of 4 slots,
    # while the removed instance with its request in flight keeps its own.
    for n in range(12):
        state.apply_config(FleetConfig.single([f"http://10.0.3.{n}:8000", other], lor))
        assert pool.retired_ids == (kept,) and t.in_use == 3
    assert t.used == 4
    state.apply_config(FleetConfig.single([kept, other], lor))  # back, with its request
    assert pool.get(kept).in_flight == 1
    lease.release()
    assert pool.get(kept).in_flight == 0
    # A variant removed with a request in flight: its slot is not taken over until the
    # request is over, and a configuration that would need it is refused whole.
    lease = pool.acquire(None)
    busy = lease.instance.instance_id
    state.apply_config(FleetConfig.single([f"http://10.0.4.{n}:8000" for n in range(2)], lor, variant="B"))
    assert t.in_use == 3  # B's two, and the busy one
    four = FleetConfig.single([f"http://10.0.4.{n}:8000" for n in range(4)], lor, variant="B")
    with pytest.raises(InFlightTableFull, match=r"full: 3 of 4 .* needs 2 more"):
        state.apply_config(four)
    assert [i.instance_id for _, p in state.fleet.all_pools() for i in p.instances] == [f"http://10.0.4.{n}:8000" for n in range(2)]
    lease.release()
    assert lease.instance.in_flight == 0 and lease.instance.instance_id == busy
    state.apply_config(four)
    assert t.in_use == 4 and t.used == 4


def _die_holding(path: str, held) -> None:
    lock = FileLock(path)
    assert lock.acquire(timeout=5)
    held.set()
    os.kill(os.getpid(), signal.SIGKILL)  # inside a claim, as a worker killed mid-reserve()


def test_the_lock_of_a_worker_killed_while_holding_it_is_free_again(tmp_path):
    path = str(tmp_path / "inflight.lock")
    buf = bytearray(InFlightTable.size(4, 2))
    InFlightTable.initialize(buf, 4, 2)
    lock = FileLock(path)
    w0, w1 = InFlightTable(buf, 0, lock), InFlightTable(buf, 1, lock)
    (s,) = w1.reserve([7])
    w1.add(s, 3)
    held = SPAWN.Event()
    p = SPAWN.Process(target=_die_holding, args=(path, held))
    p.start()
    assert held.wait(60)
    p.join(20)
    assert p.exitcode == -signal.SIGKILL
    t0 = time.monotonic()
    assert w0.zero_worker(1) is True  # the kernel let go of the dead process's lock
    assert w0.reserve([8]) == [1]
    assert time.monotonic() - t0 < 1
    assert w0.total(s) == 0 and w0.holders(s) == 0
    lock.close()


def test_a_lock_held_past_the_timeout_refuses_a_claim_and_changes_nothing(tmp_path, monkeypatch):
    path = str(tmp_path / "inflight.lock")
    buf = bytearray(InFlightTable.size(4, 2))
    InFlightTable.initialize(buf, 4, 2)
    locks = [FileLock(path), FileLock(path)]
    w0, w1 = InFlightTable(buf, 0, locks[0]), InFlightTable(buf, 1, locks[1])
    (s,) = w1.reserve([7])
    w1.add(s, 3)
    monkeypatch.setattr("prefixroute.core.counters.LOCK_TIMEOUT_S", 0.2)
    other = FileLock(path)  # another holder (its own open file: flock excludes it even here)
    assert other.acquire(timeout=1)
    t0 = time.monotonic()
    with pytest.raises(InFlightTableLocked, match="not free within 0.2 s"):
        w0.reserve([8])
    assert w0.zero_worker(1) is False  # counts zeroed, the slot stays held
    assert time.monotonic() - t0 < 2
    assert w0.total(s) == 0 and w0.holders(s) == 0b10 and w0.used == 1
    other.release()
    assert w0.reserve([8]) == [1]
    for lock in (*locks, other):
        lock.close()


def test_a_removed_variant_takes_no_new_lease_so_a_retry_cannot_count_on_a_reused_slot():
    (t,) = _table_views(1, capacity=3)
    lor = RoutingConfig.build("least-outstanding-requests")
    x1, x2, y1, z1 = (f"http://10.0.5.{i}:8000" for i in range(1, 5))
    state = RouterState(FleetConfig.single([x1, x2], lor, variant="V"), ServerSettings(port=0), counters=t)
    (_, old), = state.fleet.all_pools()
    lease = old.acquire(None, {x2})  # a request on x1, about to fail and retry
    state.apply_config(FleetConfig.single([z1], lor, variant="Z"))  # V removed
    state.apply_config(FleetConfig.single([y1], lor, variant="W"))
    (_, new), = state.fleet.all_pools()
    assert old.closed and not new.closed
    assert t.reserve([slot_key("default", "W", y1)]) == [1]  # x2's slot, taken over (x1's has the request)
    with pytest.raises(NoHealthyInstance, match="'V' was removed"):
        old.acquire(None, {x1})  # the retry: no instance of the removed variant
    assert new.get(y1).in_flight == 0
    lease.release()
    assert lease.instance.in_flight == 0


def test_removed_instances_whose_requests_ended_free_their_slots_for_the_next_change():
    (t,) = _table_views(1, capacity=4)
    lor = RoutingConfig.build("least-outstanding-requests")
    urls = [f"http://10.0.6.{i}:8000" for i in range(6)]
    state = RouterState(FleetConfig.single(urls[:2], lor), ServerSettings(port=0), counters=t)
    (_, pool), = state.fleet.all_pools()
    lease = pool.acquire(None)
    state.apply_config(FleetConfig.single(urls[2:4], lor))  # the busy one is retired, and keeps its slot
    assert pool.retired_ids == (lease.instance.instance_id,) and t.in_use == 3
    lease.release()
    state.apply_config(FleetConfig.single(urls[4:6], lor))  # needs the retired one's slot: it is free now
    assert [i.instance_id for i in pool.instances] == urls[4:6] and pool.retired_ids == ()
    assert t.in_use == 2


@settings(max_examples=300, deadline=None)
@example([("c", 0, frozenset({1, 2, 3, 4}), 0), ("a", 0, frozenset(), 0),  # a request to 1, whose variant
          ("c", 0, frozenset({5}), 0), ("c", 1, frozenset({5, 6}), 0)])     # goes; 6 needs a slot taken over
@given(st.lists(st.tuples(st.sampled_from("cal"), st.integers(0, 1), st.frozensets(st.integers(1, 6), max_size=4),
                          st.integers(0, 99)), max_size=60))
def test_reused_slots_never_mix_two_instances_counts(ops):
    """A model of two workers: configurations applied (reserve, then retain what the
    configuration, and maybe the retired instances with requests in flight, still name),
    leases taken and released. A lease's slot always keeps its key, each key's count is
    the model's, and a refusal is only ever for want of free slots."""
    views = _table_views(2, capacity=5)
    config: list[frozenset[int]] = [frozenset(), frozenset()]
    leases: list[tuple[int, int, int]] = []  # (worker, key, slot)
    for op, w, keys, pick in ops:
        t = views[w]
        if op == "c":
            keyed = {t._keys[s] for s in range(t.used)}
            free = (5 - t.used) + sum(1 for s in range(t.used) if not t.holders(s) and not t.total(s)
                                      and t._keys[s] not in keys)
            try:
                t.reserve(keys)
            except InFlightTableFull:
                assert len(keys - keyed) > free
                continue
            config[w] = keys
            # Its removed instances with requests in flight are retired if their variant
            # stays (held), or live on only in the leases if it went (not held).
            t.retain(keys | ({k for lw, k, _ in leases if lw == w} if pick % 2 else set()))
        elif op == "a" and config[w]:
            k = sorted(config[w])[pick % len(config[w])]
            (slot,) = t.reserve([k])
            t.add(slot, 1)
            leases.append((w, k, slot))
        elif op == "l" and leases:
            lw, k, slot = leases.pop(pick % len(leases))
            views[lw].add(slot, -1)
        for lw, k, slot in leases:
            assert t._keys[slot] == k  # never taken over while a request is on it
        for v in views:
            for k, slot in v._slots.items():
                assert v._keys[slot] == k and v.holders(slot) >> v.worker & 1
                assert v.total(slot) == sum(1 for _, lk, _ in leases if lk == k)
        slot_of = {k: slot for v in views for k, slot in v._slots.items()}
        assert all(v._slots[k] == slot_of[k] for v in views for k in v._slots)  # one slot per key
        assert len(set(slot_of.values())) == len(slot_of)  # and one key per slot


def test_table_rejects_foreign_buffers_and_bad_columns():
    with pytest.raises(ValueError, match="not laid out"):
        InFlightTable(bytearray(InFlightTable.size(8, 2)), 0)
    buf = bytearray(InFlightTable.size(8, 2))
    InFlightTable.initialize(buf, 8, 2)
    with pytest.raises(ValueError, match="worker 2 is out of range"):
        InFlightTable(buf, 2)
    with pytest.raises(ValueError, match="workers 65 is out of range"):
        InFlightTable.initialize(bytearray(InFlightTable.size(8, 65)), 8, 65)


@pytest.mark.parametrize("value, message", [
    ("0", "0 is out of range (allowed 1-64"), ("-1", "-1 is out of range (allowed 1-64"),
    ("65", "65 is out of range (allowed 1-64"), ("two", "'two' is not a whole number of worker processes")])
def test_invalid_worker_counts_are_refused(value, message, capsys):
    parser = argparse.ArgumentParser()
    configure_parser(parser)
    assert parser.parse_args(["--backend", "http://a:1"]).workers == 1
    assert parser.parse_args(["--workers", "64", "--backend", "http://a:1"]).workers == 64
    with pytest.raises(SystemExit) as exc:
        parser.parse_args(["--workers", value, "--backend", "http://a:1"])
    assert exc.value.code == 2
    assert f"argument --workers: {message}" in capsys.readouterr().err
    assert "--workers N" in parser.format_help() and "SO_REUSEPORT" in parser.format_help()
    with pytest.raises(ConfigError, match="workers: 0 is out of range"):
        ServerSettings(workers=0)


def test_worker_trace_path():
    assert worker_trace_path("/x/trace.jsonl", 1) == "/x/trace.worker-1.jsonl"
    assert worker_trace_path("trace", 0) == "trace.worker-0"


# -- the table, across processes ---------------------------------------------------


def _child(name, lock, keys, go, done, out) -> None:
    counters = SharedCounters.attach(name, 1, lock)
    t = counters.table
    slots = t.reserve(keys)  # another order than the parent's
    for s in slots:
        t.add(s, 10 + s)
    done.set()
    go.wait(10)
    out.send((slots, [t.total(s) for s in slots], t.worker_total(0), t.worker_total(1)))
    counters.close()


def test_two_processes_count_in_their_own_columns_and_see_the_sums():
    lock = SPAWN.Lock()
    counters = SharedCounters.create(2, lock, capacity=16)
    try:
        t = counters.table
        keys = [slot_key("e", "v", u) for u in URLS[:3]]
        mine = t.reserve(keys[:2])
        for s in mine:
            t.add(s, 1)
        go, done = SPAWN.Event(), SPAWN.Event()
        ours, theirs = SPAWN.Pipe(duplex=False)
        p = SPAWN.Process(target=_child, args=(counters.name, lock, list(reversed(keys)), go, done, theirs))
        p.start()
        try:
            assert done.wait(60)
            assert t.used == 3  # the child's new key is visible here
            child_slots = list(reversed(t.reserve(keys)))
            assert [t.total(s) for s in t.reserve(keys)] == [1 + 10 + mine[0], 1 + 10 + mine[1], 10 + 2]
            go.set()
            slots, totals, w0, w1 = ours.recv()
            assert slots == child_slots  # same slot for the same instance in both processes
            assert totals == [t.total(s) for s in slots]
            assert (w0, w1) == (2, (10 + 0) + (10 + 1) + (10 + 2))
        finally:
            p.join(20)
        assert p.exitcode == 0
        t.zero_worker(1)  # what the supervisor does when a worker dies
        assert [t.total(s) for s in t.reserve(keys)] == [1, 1, 0]
    finally:
        counters.unlink()
    assert not Path("/dev/shm", counters.name).exists()


# -- real worker processes ------------------------------------------------------------

T = 4  # ConcurrencyThreshold of the e2e tests
BODY = orjson.dumps({"model": "m", "messages": [{"role": "system", "content": "You are terse. " * 100},
                                                {"role": "user", "content": "same prefix for everyone"}]})


class HoldBackend:
    """An engine instance that holds every generation request until ``release``; it
    records how many it held at once (the number the threshold bounds)."""

    def __init__(self) -> None:
        self.current = 0
        self.max = 0
        self.total = 0
        self.release = asyncio.Event()
        self.runner: web.AppRunner | None = None
        self.url = ""

    async def _generate(self, request: web.Request) -> web.Response:
        await request.read()
        self.current += 1
        self.total += 1
        self.max = max(self.max, self.current)
        try:
            await self.release.wait()
        finally:
            self.current -= 1
        return web.json_response({"id": "x", "object": "chat.completion", "choices": [
            {"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}]})

    async def _health(self, request: web.Request) -> web.Response:
        return web.json_response({})

    async def start(self) -> "HoldBackend":
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self._generate)
        app.router.add_get("/health", self._health)
        self.runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{self.runner.addresses[0][1]}"
        return self

    async def stop(self) -> None:
        self.release.set()
        if self.runner is not None:
            await self.runner.cleanup()


@pytest.fixture
async def backends():
    bs = [await HoldBackend().start() for _ in range(3)]
    yield bs
    for b in bs:
        await b.stop()


class Serve:
    """``prefixroute serve --workers N`` as a child process."""

    def __init__(self, proc: asyncio.subprocess.Process, url: str, admin: str) -> None:
        self.proc, self.url, self.admin = proc, url, admin

    @classmethod
    async def start(cls, *args: str, workers: int = 2, env: dict[str, str] | None = None) -> "Serve":
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "prefixroute.server.cli", "--workers", str(workers), "--port", "0",
            "--health-check-interval", "0", "--metrics-scrape-interval", "0", "--shutdown-timeout", "5",
            "--log-level", "info", *args,
            stdout=asyncio.subprocess.PIPE, env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})
        assert proc.stdout is not None
        line = (await asyncio.wait_for(proc.stdout.readline(), 90)).decode()
        m = re.fullmatch(r"prefixroute-serve listening on (http://127\.0\.0\.1:\d+)\n", line)
        assert m, line
        admin = re.fullmatch(r"prefixroute-admin listening on (http://127\.0\.0\.1:\d+)\n",
                             (await asyncio.wait_for(proc.stdout.readline(), 10)).decode())
        assert admin
        return cls(proc, m.group(1), admin.group(1))

    async def stop(self) -> int:
        if self.proc.returncode is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                return await asyncio.wait_for(self.proc.wait(), 30)
            except asyncio.TimeoutError:
                self.proc.kill()
        return await self.proc.wait()

    async def workers(self) -> list[dict]:
        async with aiohttp.ClientSession() as http, http.get(self.admin + "/admin/workers") as r:
            assert r.status == 200
            return (await r.json())["Workers"]

    async def metric(self, name: str) -> float:
        """Sum of a metric family's samples, from one scrape on a new connection."""
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as http, \
                http.get(self.url + "/metrics") as r:
            text = await r.text()
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))


async def _eventually(pred, timeout: float = 15.0, every: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if await pred():
            return True
        await asyncio.sleep(every)
    return bool(await pred())


async def _zero(value: Awaitable[float]) -> bool:
    return await value == 0


async def _send(url: str, n: int) -> list[asyncio.Task]:
    """``n`` requests with the same prefix, each on its own connection (the kernel
    spreads connections, not requests, over the workers)."""
    http = aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True, limit=0))

    async def one() -> int:
        async with http.post(url + "/v1/chat/completions", data=BODY,
                             headers={"Content-Type": "application/json"}) as r:
            await r.read()
            return r.status

    tasks = [asyncio.create_task(one()) for _ in range(n)]
    done = asyncio.gather(*tasks, return_exceptions=True)
    done.add_done_callback(lambda _: asyncio.ensure_future(http.close()))
    return tasks


async def _round(serve: Serve, backends: list[HoldBackend], n: int) -> None:
    tasks = await _send(serve.url, n)

    async def all_held() -> bool:
        return sum(b.current for b in backends) == n

    assert await _eventually(all_held), [b.current for b in backends]
    for b in backends:
        b.release.set()
    assert await asyncio.gather(*tasks) == [200] * n
    for b in backends:
        b.release = asyncio.Event()


async def test_threshold_holds_across_workers_and_admin_reaches_all(backends):
    serve = await Serve.start(*[a for b in backends for a in ("--backend", b.url)], "--strategy", "prefix-aware",
                              "--prefix-length", "1024", "--concurrency-threshold", str(T))
    try:
        # 2T requests with one prefix: T on the key's instance, T on its next one. Two
        # workers counting alone could each send T to the first: 2T there.
        rounds, n = 4, 2 * T
        for _ in range(rounds):
            await _round(serve, backends, n)
        maxima = sorted(b.max for b in backends)
        assert maxima[-1] >= T, maxima  # the preferred instance filled up to the threshold
        assert maxima[-1] <= T + 2, maxima  # and never beyond it by more than the workers
        workers = await serve.workers()
        assert [w["Worker"] for w in workers] == [0, 1]
        assert all(w["Served"] > 0 for w in workers), workers  # both workers routed requests
        assert sum(w["Served"] for w in workers) == rounds * n == sum(b.total for b in backends)
        # Counters do not depend on which worker answers the scrape.
        scrapes = {await serve.metric("prefixroute_requests_total") for _ in range(6)}
        assert scrapes == {float(rounds * n)}
        # (A whole answer reaches its client a loop turn before its worker releases the
        # lease: on a busy machine a scrape can land in between.)
        assert await _eventually(lambda: _zero(serve.metric("prefixroute_in_flight")), 5)

        async with aiohttp.ClientSession() as http:
            # The status page's data adds every worker's requests up.
            async with http.get(serve.admin + "/admin/status.json") as r:
                assert r.status == 200
                status = await r.json()
            v = status["endpoints"][0]["variants"][0]
            assert (status["router"]["workers"], v["requests"]) == (2, rounds * n)
            assert sum(i["requests"] for i in v["instances"]) == rounds * n == v["responses"]["2xx"]
            assert v["ttft"]["n"] == rounds * n
            # A change through the public admin API reaches every worker.
            async with http.put(serve.admin + "/admin/endpoints/default/variants/AllTraffic/routing", json={
                    "RoutingStrategy": "PREFIX_AWARE",
                    "PrefixAwareRoutingConfig": {"PrefixLength": 1024, "ConcurrencyThreshold": 2}}) as r:
                assert r.status == 200, await r.text()
                assert (await r.json())["RoutingConfig"]["PrefixAwareRoutingConfig"]["ConcurrencyThreshold"] == 2
            async with http.put(serve.admin + "/admin/config", json={"Endpoints": "nope"}) as r:
                assert r.status == 400  # every worker refused it; worker 0's answer
            async with http.get(serve.admin + "/admin/config") as r:
                doc = await r.json()
        for w in await serve.workers():
            assert w["RoutingConfigs"]["default/AllTraffic"]["PrefixAwareRoutingConfig"]["ConcurrencyThreshold"] == 2
        states = doc["Endpoints"][0]["ProductionVariants"][0]["InstanceStates"]
        assert sum(s["Served"] for s in states) == rounds * n  # summed over the workers
        for b in backends:
            b.max = 0
        for _ in range(2):
            await _round(serve, backends, 4)
        assert max(b.max for b in backends) <= 2 + 2, [b.max for b in backends]
    finally:
        assert await serve.stop() == 0


async def test_instances_churned_through_the_admin_api_past_the_table_size_get_slots(backends):
    """More (endpoint, variant, instance) triples over the router's life than the shared
    table has slots (4,096): the slots of instances gone for good are taken over."""
    serve = await Serve.start(*[a for b in backends for a in ("--backend", b.url)],
                              "--strategy", "least-outstanding-requests")

    def doc(instances: list[str]) -> dict:
        return {"Endpoints": [{"EndpointName": "default", "ProductionVariants": [{
            "VariantName": "AllTraffic", "Instances": instances,
            "RoutingConfig": {"RoutingStrategy": "LEAST_OUTSTANDING_REQUESTS"}}]}]}

    try:
        async with aiohttp.ClientSession() as http:
            for n in range(9):  # 9 x 500 fresh instances
                fresh = [f"http://10.9.{n}.{i % 250}:{8000 + i // 250}" for i in range(500)]
                async with http.put(serve.admin + "/admin/config", json=doc(fresh)) as r:
                    assert r.status == 200, (n, await r.text())
            async with http.get(serve.admin + "/admin/workers") as r:
                assert (await r.json())["SharedInFlightSlots"] == {"Used": 500, "Capacity": 4096}
            async with http.put(serve.admin + "/admin/config", json=doc([b.url for b in backends])) as r:
                assert r.status == 200, await r.text()
            async with http.get(serve.admin + "/admin/workers") as r:
                assert (await r.json())["SharedInFlightSlots"] == {"Used": 3, "Capacity": 4096}
        await _round(serve, backends, 6)  # routed, and counted, as ever
        # (A whole answer reaches its client a loop turn before its worker releases the
        # lease: on a busy machine a scrape can land in between.)
        assert await _eventually(lambda: _zero(serve.metric("prefixroute_in_flight")), 5)
    finally:
        assert await serve.stop() == 0


async def test_killed_worker_is_replaced_and_its_counts_zeroed(backends):
    serve = await Serve.start(*[a for b in backends for a in ("--backend", b.url)],
                              "--strategy", "least-outstanding-requests")
    try:
        n = 12
        tasks = await _send(serve.url, n)

        async def all_held() -> bool:
            return sum(b.current for b in backends) == n

        assert await _eventually(all_held)
        workers = await serve.workers()
        assert sum(w["InFlight"] for w in workers) == n
        assert await serve.metric("prefixroute_in_flight") == n
        victim = max(workers, key=lambda w: w["InFlight"])
        survivor = next(w for w in workers if w is not victim)
        os.kill(victim["Pid"], signal.SIGKILL)

        async def replaced() -> bool:
            ws = {w["Worker"]: w for w in await serve.workers()}
            new = ws[victim["Worker"]]
            return new["Listening"] and new["Pid"] != victim["Pid"] and new["Restarts"] == 1

        assert await _eventually(replaced, 60)
        # One internal-socket directory per live worker: the victim (SIGKILL) could not
        # remove its own, the supervisor did.
        metrics_dir = next(Path(tempfile.gettempdir()).glob(f"prefixroute-metrics-{serve.proc.pid}-*"))
        sockets = sorted(d.name.rsplit("-", 1)[0] for d in metrics_dir.glob("socket-*"))
        assert sockets == ["socket-0", "socket-1"]
        assert all((d / "app.sock").is_socket() for d in metrics_dir.glob("socket-*"))
        ws = {w["Worker"]: w for w in await serve.workers()}
        assert ws[victim["Worker"]]["InFlight"] == 0  # zeroed: its requests died with it
        assert ws[survivor["Worker"]]["InFlight"] == survivor["InFlight"]
        assert await serve.metric("prefixroute_in_flight") == survivor["InFlight"]
        with pytest.raises(ProcessLookupError):
            os.kill(victim["Pid"], 0)
        for b in backends:
            b.release.set()
        results = await asyncio.gather(*tasks, return_exceptions=True)
        assert results.count(200) == survivor["InFlight"]  # the victim's clients got errors
        assert all(isinstance(r, aiohttp.ClientError) for r in results if r != 200)

        async def drained() -> bool:
            return await serve.metric("prefixroute_in_flight") == 0 and \
                all(w["InFlight"] == 0 for w in await serve.workers())

        assert await _eventually(drained)
        for b in backends:
            b.release = asyncio.Event()
        await _round(serve, backends, 4)  # the replacement serves with the other one
    finally:
        assert await serve.stop() == 0


async def test_workers_start_under_a_long_tmpdir(backends, tmp_path):
    """A worker's socket directory goes in the supervisor's metrics directory, which is
    in $TMPDIR: with a long $TMPDIR that path would pass the 107 bytes a Unix socket
    may have, so it goes in $TMPDIR itself, as in one process (it did not start)."""
    long_dir = tmp_path / ("t" * max(1, 72 - len(str(tmp_path)) - 1))
    long_dir.mkdir()
    assert len(str(long_dir)) >= 72
    serve = await Serve.start("--backend", backends[0].url, env={"TMPDIR": str(long_dir)})
    try:
        await _round(serve, backends[:1], 4)
        metrics_dir = next(long_dir.glob(f"prefixroute-metrics-{serve.proc.pid}-*"))
        assert list(metrics_dir.glob("socket-*")) == []
        assert len(list(long_dir.glob(f"pr-{serve.proc.pid}-[01]-*/app.sock"))) == 2  # one per worker
        victim = (await serve.workers())[0]
        os.kill(victim["Pid"], signal.SIGKILL)  # its directory is removed by the supervisor

        async def replaced() -> bool:
            w = (await serve.workers())[0]
            return w["Listening"] and w["Pid"] != victim["Pid"]

        assert await _eventually(replaced, 60)
        assert len(list(long_dir.glob(f"pr-{serve.proc.pid}-[01]-*/app.sock"))) == 2
        assert len(list(long_dir.iterdir())) == 3  # and the metrics directory
    finally:
        assert await serve.stop() == 0
    assert list(long_dir.iterdir()) == []


async def test_the_supervisors_admin_api_decodes_bodies_as_the_workers_do(backends):
    """A gzip body sent to the supervisor reaches every worker decoded; a coding not
    decoded is a JSON 415 from the supervisor, a broken one a JSON 400 (the supervisor
    had passed aiohttp's decoding on)."""
    import gzip

    serve = await Serve.start("--backend", backends[0].url)
    doc = orjson.dumps({"RoutingStrategy": "RANDOM"})
    url = serve.admin + "/admin/endpoints/default/variants/AllTraffic/routing"
    try:
        async with aiohttp.ClientSession(auto_decompress=False) as http:
            async with http.put(url, data=gzip.compress(doc), headers={"Content-Encoding": "gzip"}) as r:
                assert r.status == 200, await r.text()
            async with http.put(url, data=doc, headers={"Content-Encoding": "br"}) as r:
                assert r.status == 415 and "is not supported" in (await r.json())["message"]
            async with http.put(url, data=gzip.compress(doc)[:-8], headers={"Content-Encoding": "gzip"}) as r:
                assert r.status == 400 and (await r.json())["message"].endswith("(its Content-Encoding)")
        workers = await serve.workers()
        assert [w["RoutingConfigs"]["default/AllTraffic"] for w in workers] == [{"RoutingStrategy": "RANDOM"}] * 2
    finally:
        assert await serve.stop() == 0


async def _serve_fleet_file(cfg: Path, write) -> "Serve":
    """``serve --config cfg`` after ``write("RANDOM")``."""
    write("RANDOM")
    return await Serve.start("--config", str(cfg))


def _write_fleet(path: Path, instances: list[str], strategy: str) -> None:
    """A one-variant fleet file for ``--config``."""
    path.write_text(yaml.safe_dump({"Endpoints": [{"EndpointName": "default", "ProductionVariants": [
        {"VariantName": "AllTraffic", "Instances": instances, "RoutingConfig": {"RoutingStrategy": strategy}}]}]}))


def _leftovers(pid: int) -> list[str]:
    shm = [p.name for p in Path("/dev/shm").glob(f"prefixroute-{pid}-*")]
    tmp = [p.name for p in Path(tempfile.gettempdir()).glob(f"prefixroute-metrics-{pid}-*")]
    return shm + tmp


async def test_a_sighup_while_a_worker_restarts_reaches_it_once_it_listens(backends, tmp_path):
    """The replacement of a dead worker starts with the configuration in force before a
    SIGHUP that came meanwhile; it reloads once it listens, so the workers agree (they
    stayed apart)."""
    cfg = tmp_path / "fleet.yaml"
    write = functools.partial(_write_fleet, cfg, [backends[0].url])
    serve = await _serve_fleet_file(cfg, write)
    try:
        victim = (await serve.workers())[1]
        os.kill(victim["Pid"], signal.SIGKILL)

        async def starting() -> bool:  # the replacement runs, with the configuration in force, but does not listen yet
            w = (await serve.workers())[1]
            return w["Alive"] and not w["Listening"] and w["Pid"] not in (0, victim["Pid"])

        assert await _eventually(starting, 30, 0.02)
        write("LEAST_OUTSTANDING_REQUESTS")
        serve.proc.send_signal(signal.SIGHUP)  # worker 0 reloads now, worker 1 once it listens

        async def agreed() -> bool:
            ws = await serve.workers()
            return ws[1]["Listening"] and ws[1]["Pid"] != victim["Pid"] and all(
                w.get("RoutingConfigs", {}).get("default/AllTraffic", {}).get("RoutingStrategy")
                == "LEAST_OUTSTANDING_REQUESTS" for w in ws)

        assert await _eventually(agreed, 60)
    finally:
        assert await serve.stop() == 0


async def test_sighup_reaches_every_worker_and_sigterm_drains_and_cleans_up(backends, tmp_path):
    cfg = tmp_path / "fleet.yaml"
    write = functools.partial(_write_fleet, cfg, [backends[0].url])
    serve = await _serve_fleet_file(cfg, write)
    try:
        pid = serve.proc.pid
        assert len(_leftovers(pid)) == 2  # the shared block and the metrics directory exist
        workers = await serve.workers()
        write("LEAST_OUTSTANDING_REQUESTS")
        serve.proc.send_signal(signal.SIGHUP)

        async def reloaded() -> bool:
            return all(w["RoutingConfigs"]["default/AllTraffic"]["RoutingStrategy"] == "LEAST_OUTSTANDING_REQUESTS"
                       for w in await serve.workers())

        assert await _eventually(reloaded)
        # SIGTERM with a request in flight: it finishes, then everything is gone.
        [task] = await _send(serve.url, 1)

        async def held() -> bool:
            return backends[0].current == 1

        assert await _eventually(held)
        serve.proc.send_signal(signal.SIGTERM)
        await asyncio.sleep(0.5)
        assert serve.proc.returncode is None  # draining
        backends[0].release.set()
        assert await task == 200
        assert await asyncio.wait_for(serve.proc.wait(), 20) == 0
    finally:
        await serve.stop()
    for w in workers:
        with pytest.raises(ProcessLookupError):
            os.kill(w["Pid"], 0)
    assert _leftovers(pid) == []


async def test_port_in_use_is_an_error(backends):
    serve = await Serve.start("--backend", backends[0].url)
    try:
        port = serve.url.rsplit(":", 1)[1]
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "prefixroute.server.cli", "--workers", "2", "--port", port, "--admin-port", "0",
            "--backend", backends[0].url, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        out, err = await asyncio.wait_for(proc.communicate(), 30)
        assert proc.returncode == 1 and out == b""
        assert b"error: cannot listen on 127.0.0.1:" + port.encode() in err
    finally:
        assert await serve.stop() == 0


def test_a_failed_admin_call_to_a_worker_says_what_happened():
    from prefixroute.server.workers import _ADMIN_CALL_TIMEOUT_S, _call_failure

    assert _call_failure(1, asyncio.TimeoutError()) == (
        f"worker 1: no answer within {_ADMIN_CALL_TIMEOUT_S:g} s (stuck or overloaded; it may still apply the "
        "change when it answers)")
    assert _call_failure(0, aiohttp.ClientConnectionError("Connection refused")) == (
        "worker 0: ClientConnectionError: Connection refused")
    assert _call_failure(2, aiohttp.ServerDisconnectedError()) == (
        "worker 2: ServerDisconnectedError: Server disconnected")
    assert _call_failure(3, OSError()) == "worker 3: OSError"


async def test_a_stopped_worker_is_killed_and_restarted_by_the_watchdog(backends):
    # A worker whose event loop no longer runs (here: SIGSTOP) would keep its share of
    # the port's new connections, and they would hang: the supervisor's probes find it.
    for b in backends:
        b.release.set()  # answer at once
    serve = await Serve.start(*[a for b in backends for a in ("--backend", b.url)], "--worker-timeout", "2")
    try:
        victim = (await serve.workers())[1]
        os.kill(victim["Pid"], signal.SIGSTOP)
        t0 = time.monotonic()

        async def replaced() -> bool:
            w = {w["Worker"]: w for w in await serve.workers()}[victim["Worker"]]
            return w["Listening"] and w["Pid"] != victim["Pid"] and w["Restarts"] == 1

        assert await _eventually(replaced, 30)
        assert 2.0 <= time.monotonic() - t0
        with pytest.raises(ProcessLookupError):
            os.kill(victim["Pid"], 0)
        tasks = await _send(serve.url, 20)  # each on its own connection: both workers get some
        assert await asyncio.gather(*tasks) == [200] * 20
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(victim["Pid"], signal.SIGCONT)
        assert await serve.stop() == 0


def test_worker_timeout_flag():
    parser = argparse.ArgumentParser()
    configure_parser(parser)
    args = parser.parse_args(["--workers", "2", "--worker-timeout", "5", "--backend", "http://a:1"])
    from prefixroute.server.cli import build_settings

    assert build_settings(args).worker_timeout_s == 5.0
    assert build_settings(parser.parse_args(["--backend", "http://a:1"])).worker_timeout_s == 60.0
    with pytest.raises(ConfigError, match="worker timeout"):
        ServerSettings(worker_timeout_s=-1)
    with pytest.raises(ConfigError, match="worker timeout: 0.05 s is too short"):
        ServerSettings(worker_timeout_s=0.05)
    assert ServerSettings(worker_timeout_s=0).worker_timeout_s == 0
    assert "--worker-timeout SECONDS" in parser.format_help()


async def test_a_pause_of_the_supervisor_itself_kills_no_worker(backends):
    # Stopped (a process group's Ctrl-Z, a paused container), the supervisor sent no
    # probe: the workers' silence meanwhile is not theirs.
    serve = await Serve.start(*[a for b in backends for a in ("--backend", b.url)], "--worker-timeout", "2")
    try:
        before = await serve.workers()
        os.kill(serve.proc.pid, signal.SIGSTOP)
        await asyncio.sleep(3.5)
        os.kill(serve.proc.pid, signal.SIGCONT)
        await asyncio.sleep(2.0)  # the watchdog's next rounds
        after = await serve.workers()
        assert [(w["Pid"], w["Restarts"]) for w in after] == [(w["Pid"], 0) for w in before]
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(serve.proc.pid, signal.SIGCONT)
        assert await serve.stop() == 0
