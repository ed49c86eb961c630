"""Precise mode end to end: emulated engines publishing KV events over real ZeroMQ sockets on
loopback, the router subscribing, and the faults its streams must survive."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import errno
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
import msgpack
import pytest
import zmq
import zmq.asyncio

from prefixroute.core.config import FleetConfig, RoutingConfig
from prefixroute.core.keys import openai_route
from prefixroute.core.kvevents.codec import encode_batch
from prefixroute.core.kvevents.events import BlockStored, EventBatch
from prefixroute.core.kvevents.view import PrefixHolding
from prefixroute.core.model_tokenizer import ModelTokenizer
from prefixroute.engine.kv_publisher import KvEventsSettings
from prefixroute.engine.model import DEFAULT_MODEL, EngineConfig
from prefixroute.engine.server import ENGINE_KEY, EngineServer, start_engine_server
from prefixroute.server.cli import build_config, configure_parser
from prefixroute.server.runner import RouterHandle, start_router
from prefixroute.server.settings import ServerSettings

pytestmark = pytest.mark.e2e

TOK = ModelTokenizer.load("tiny")
BS = 16


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def eventually(predicate: Callable[[], bool], timeout: float = 10.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"{what} not reached within {timeout} s"
        await asyncio.sleep(0.02)


class Engine:
    """An emulated engine with the tiny tokenizer, publishing its KV events."""

    def __init__(self, http_port: int = 0, pub_port: int | None = None, replay_port: int | None = None,
                 replay: bool = True, seed: int | None = None, config: EngineConfig | None = None,
                 lora_adapters: tuple[str, ...] = (), encoding: str = "array") -> None:
        self.http_port, self.seed, self.config = http_port, seed, config or EngineConfig()
        self.lora_adapters, self.encoding = lora_adapters, encoding
        self.pub_port = pub_port or free_port()
        self.replay_port = (replay_port or free_port()) if replay else None
        # ports picked here are free when picked, not when bound: another test's process
        # may take one first (seen in CI), so those are picked again on EADDRINUSE
        self._picked = (pub_port is None, replay and replay_port is None)
        self.runner: Any = None

    async def start(self) -> "Engine":
        config = dataclasses.replace(self.config, max_loras=max(1, self.config.max_loras)) if self.lora_adapters \
            else self.config
        for attempt in range(5):
            # "*": vLLM's rule binds only a wildcard endpoint (a host alone would connect).
            settings = KvEventsSettings(f"tcp://*:{self.pub_port}",
                                        f"tcp://*:{self.replay_port}" if self.replay_port else None,
                                        hash_seed=self.seed, encoding=self.encoding)  # type: ignore[arg-type]
            try:
                self.runner, self.http_port = await start_engine_server(
                    config, "127.0.0.1", self.http_port, 0.0, tokenizer=TOK, kv_events=settings,
                    lora_modules={name: f"/adapters/{name}" for name in self.lora_adapters})
                return self
            except zmq.ZMQError as exc:
                if exc.errno != errno.EADDRINUSE or not any(self._picked) or attempt == 4:
                    raise
                if self._picked[0]:
                    self.pub_port = free_port()
                if self._picked[1]:
                    self.replay_port = free_port()
        raise AssertionError("unreachable")

    @property
    def server(self) -> EngineServer:
        return self.runner.app[ENGINE_KEY]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    @property
    def kv(self) -> dict[str, Any]:
        return {"Endpoint": f"tcp://127.0.0.1:{self.pub_port}",
                **({"ReplayEndpoint": f"tcp://127.0.0.1:{self.replay_port}"} if self.replay_port else {})}

    async def stop(self) -> None:
        await self.runner.cleanup()


async def router_for(instances: list[str], kv: dict[str, Any]) -> RouterHandle:
    base = FleetConfig.single(instances, RoutingConfig.build("random")).model_dump(by_alias=True)
    config = FleetConfig.from_mapping({**base, "KvEvents": {"ReplayTimeoutS": 2.0, **kv}})
    return await start_router(config, ServerSettings(port=0, health_check_interval_s=0, metrics_scrape_interval_s=0))


def chat(question: str) -> dict[str, Any]:
    return {"model": DEFAULT_MODEL, "max_tokens": 3,
            "messages": [{"role": "system", "content": "You route requests to warm caches. " * 20},
                         {"role": "user", "content": question}]}


async def send(url: str, body: dict[str, Any], chat_api: bool = True) -> str:
    async with aiohttp.ClientSession() as session:
        async with session.post(url + ("/v1/chat/completions" if chat_api else "/v1/completions"), json=body) as r:
            assert r.status == 200, await r.text()
            await r.read()
            return r.headers.get("X-Prefixroute-Instance", "")


def keys_of(router: RouterHandle, body: dict[str, Any], chat_api: bool = True) -> list[int]:
    view = router.state.kv_view
    assert view is not None
    return view.request_keys(TOK.request_token_ids(body, chat_api))


def held(router: RouterHandle, instance: str, body: dict[str, Any], chat_api: bool = True) -> int:
    view = router.state.kv_view
    assert view is not None
    return view.holdings(keys_of(router, body, chat_api), [instance])[instance].gpu_tokens


def full_blocks(body: dict[str, Any], chat_api: bool = True) -> int:
    return len(TOK.request_token_ids(body, chat_api)) // BS * BS


def status(router: RouterHandle, instance: str) -> Any:
    view = router.state.kv_view
    assert view is not None
    return next(s for s in view.status(time.monotonic()) if s.instance == instance)


async def connected(router: RouterHandle, instance: str) -> None:
    """Wait until the instance's stream is connected, and for its subscription to reach
    the publisher (a PUB socket drops what it sends before that: ZeroMQ's "slow joiner";
    the next message would show the gap and a replay repair it)."""
    await eventually(lambda: status(router, instance).connected, what=f"{instance} connected")
    await asyncio.sleep(0.1)


@pytest.fixture
async def zctx() -> AsyncIterator[zmq.asyncio.Context]:
    ctx = zmq.asyncio.Context()
    yield ctx
    ctx.destroy(linger=0)


async def test_router_state_follows_the_engines_events(caplog: pytest.LogCaptureFixture) -> None:
    engines = [await Engine().start() for _ in range(2)]
    router = await router_for([e.url for e in engines], {"Discovery": {"FromInfo": True}})
    try:
        for e in engines:
            await connected(router, e.url)
        bodies = [(chat(f"Question {i}: " + "why does the block chain matter " * 8), True) for i in range(4)]
        bodies += [({"model": DEFAULT_MODEL, "prompt": "Complete: " + "the cache " * 40, "max_tokens": 2}, False)]
        served = [(await send(router.url, b, c), b, c) for b, c in bodies]
        for instance, body, chat_api in served:
            await eventually(lambda: held(router, instance, body, chat_api) == full_blocks(body, chat_api),
                             what="the served prompt's blocks in the router's view")
            # What only one instance computed, the other does not hold (beyond the shared system prompt).
            other = next(e.url for e in engines if e.url != instance)
            assert held(router, other, body, chat_api) < full_blocks(body, chat_api)
        # An instance is approximate from its connection until its first message: an engine
        # the router happened to send nothing to gets a request from another client.
        for e in engines:
            if e.url not in {instance for instance, _, _ in served}:
                await send(e.url, chat("Another client's question about something else entirely"))
        view = router.state.kv_view
        assert view is not None
        await eventually(lambda: all(view.mode(e.url).value == "precise" for e in engines), what="every engine precise")
        async with aiohttp.ClientSession() as session:
            async with session.get(router.admin_url + "/admin/kv-events") as r:
                doc = await r.json()
            async with session.get(router.url + "/metrics") as r:
                metrics = await r.text()
        assert doc["Enabled"] and doc["BlockSize"] == 16
        assert {row["Instance"]: row["Mode"] for row in doc["Instances"]} == {e.url: "precise" for e in engines}
        assert sum(row["Messages"] for row in doc["Instances"]) >= len(bodies)
        for e in engines:
            assert f'prefixroute_kv_events_precise{{instance="{e.url}"}} 1.0' in metrics
        assert "prefixroute_kv_events_gaps_total" in metrics
        assert "the cache" not in caplog.text  # no prompt text in any log
    finally:
        await router.close()
        for e in engines:
            await e.stop()


async def test_engine_restart_resumes_with_a_new_sequence() -> None:
    first = await Engine(http_port=free_port(), seed=1).start()
    router = await router_for([first.url], {"Instances": {first.url: first.kv}})
    try:
        await connected(router, first.url)
        old = {"model": DEFAULT_MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "Before? " * 60}]}
        await send(router.url, old)
        await eventually(lambda: held(router, first.url, old) == full_blocks(old))
        await first.stop()
        await eventually(lambda: status(router, first.url).mode == "approximate", what="fallback to approximate")
        assert status(router, first.url).reason == "disconnected"
        second = await Engine(http_port=first.http_port, pub_port=first.pub_port, replay_port=first.replay_port,
                              seed=2).start()
        try:
            # Connected again, but what the old engine stored is not trusted until a
            # message from the new one tells whether it is the same engine.
            await eventually(lambda: status(router, first.url).connected, what="connected again")
            st = status(router, first.url)
            assert (st.mode, st.reason) == ("approximate", "reconnected, no event since")
            await asyncio.sleep(0.1)
            new = chat("After the restart?")
            await send(router.url, new)
            await eventually(lambda: held(router, first.url, new) == full_blocks(new))
            await eventually(lambda: status(router, first.url).mode == "precise", what="precise again")
            # Every batch the new engine published reaches the router (one may follow the blocks').
            await eventually(lambda: status(router, first.url).next_seq == second.server.publisher.published,
                             what="every batch received")
            st = status(router, first.url)
            assert st.restarts == 1 and st.resets == 1 and second.server.publisher.published >= 1
            assert held(router, first.url, old) == 0  # the old engine's blocks are forgotten
        finally:
            await second.stop()
    finally:
        await router.close()


@pytest.mark.parametrize("replay", [True, False])
async def test_lost_messages_are_repaired_through_replay_or_reset(replay: bool) -> None:
    engine = await Engine(replay=replay).start()
    router = await router_for([engine.url], {"Instances": {engine.url: engine.kv}})
    try:
        await connected(router, engine.url)
        a, b, c = chat("First?"), chat("Second, lost on the wire?"), chat("Third?")
        await send(router.url, a)
        await eventually(lambda: held(router, engine.url, a) == full_blocks(a))
        publisher = engine.server.publisher
        assert publisher is not None
        wire, publisher._pub = publisher._pub, None  # batches are kept for replay but never sent: lost
        await send(router.url, b)
        publisher._pub = wire
        await send(router.url, c)
        await eventually(lambda: status(router, engine.url).next_seq == publisher.published
                         and status(router, engine.url).mode == "precise", what="the last batch applied")
        st = status(router, engine.url)
        assert st.gaps == 1
        if replay:  # repaired: the lost batch's blocks are known too, nothing was forgotten
            assert (st.replays, st.replays_failed, st.resets, st.orphaned) == (1, 0, 0, 0)
            assert [held(router, engine.url, x) for x in (a, b, c)] == [full_blocks(x) for x in (a, b, c)]
        else:
            # No replay: everything is forgotten and rebuilt from the next batch. Its blocks
            # continue the system prompt's chain, forgotten too: they cannot be placed
            # (orphaned) until stored again. Nothing stale is kept, nothing is guessed.
            assert (st.replays, st.resets) == (0, 1) and st.orphaned > 0
            assert [held(router, engine.url, x) for x in (a, b, c)] == [0, 0, 0]
    finally:
        await router.close()
        await engine.stop()


async def test_unknown_and_malformed_events_are_logged_counted_and_ignored(
        zctx: zmq.asyncio.Context, caplog: pytest.LogCaptureFixture) -> None:
    pub = zctx.socket(zmq.PUB)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    instance = "http://127.0.0.1:9"
    router = await router_for([instance], {"Instances": {instance: {"Endpoint": f"tcp://127.0.0.1:{port}"}}})
    try:
        await connected(router, instance)
        tokens = list(range(32))
        good = encode_batch(EventBatch(1.0, [BlockStored([1, 2], None, tokens, BS, None, "GPU", None)]))
        messages = [
            [b"", (0).to_bytes(8, "big"), good],
            [b"", (1).to_bytes(8, "big"), msgpack.packb([1.0, [["BlockTeleported", [5]], ["BlockStored", 7]]])],
            [b"", (2).to_bytes(8, "big"), b"\xc1\xc1 not msgpack"],
            [b"", (3).to_bytes(8, "big")],  # two frames
            [b"", (4).to_bytes(8, "big"), msgpack.packb({"events": [{"type": "AllBlocksCleared", "x": 1}],
                                                         "ts": 2.0, "future_field": [1]})],
        ]
        for m in messages[:4]:
            await pub.send_multipart(m)
        await eventually(lambda: status(router, instance).messages == 4)
        st = status(router, instance)
        assert (st.unknown_events, st.malformed_events, st.malformed_messages) == (1, 1, 2)
        assert st.mode == "precise" and st.blocks == 2
        view = router.state.kv_view
        assert view is not None
        assert view.holdings(view.request_keys(tokens), [instance])[instance] == PrefixHolding(32, 0, 0)
        await pub.send_multipart(messages[4])  # seq 4 after 3 (the 2-frame message had no usable seq): in order
        await eventually(lambda: status(router, instance).blocks == 0, what="the clear applied")
        assert "unknown event type 'BlockTeleported'" in caplog.text and "not an event batch" in caplog.text
    finally:
        await router.close()


async def test_messages_from_every_instance_are_applied_in_a_few_cycles(zctx: zmq.asyncio.Context) -> None:
    # A fleet's batches are applied in cycles (one timer callback each) shortly after the
    # first signals, not with an event-loop wakeup per message: 4 publishers x 50 batches
    # sent at once cost a handful of cycles, and every block is applied in order.
    pubs = [zctx.socket(zmq.PUB) for _ in range(4)]
    ports = [p.bind_to_random_port("tcp://127.0.0.1") for p in pubs]
    instances = [f"http://127.0.0.{i + 1}:9" for i in range(4)]
    router = await router_for(instances, {"Instances": {
        inst: {"Endpoint": f"tcp://127.0.0.1:{port}"} for inst, port in zip(instances, ports)}})
    try:
        for inst in instances:
            await connected(router, inst)
        sub = router.state.kv_subscriber
        assert sub is not None
        cycles, messages = sub.cycles, sub.messages
        for seq in range(50):
            for i, pub in enumerate(pubs):
                stored = BlockStored([1000 * i + seq], None if seq == 0 else 1000 * i + seq - 1, list(range(BS)), BS,
                                     None, "GPU", None)
                await pub.send_multipart([b"", seq.to_bytes(8, "big"), encode_batch(EventBatch(1.0, [stored]))])
        await eventually(lambda: all(status(router, inst).blocks == 50 for inst in instances), what="every batch")
        assert sub.messages - messages == 200
        assert sub.cycles - cycles <= 20, sub.cycles - cycles
        assert all(status(router, inst).gaps == 0 and status(router, inst).mode == "precise" for inst in instances)
    finally:
        await router.close()


FLOOD = textwrap.dedent("""
    import sys, time, zmq
    from prefixroute.core.kvevents.codec import encode_batch
    from prefixroute.core.kvevents.events import BlockStored, EventBatch
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.SNDHWM, 1000)
    pub.bind(sys.argv[1])
    time.sleep(0.5)
    end = time.monotonic() + float(sys.argv[2])
    seq = 0
    while time.monotonic() < end:
        events = [BlockStored([seq * 4 + i for i in range(4)], None if seq % 50 == 0 else seq * 4 - 1,
                              list(range(64)), 16, None, "GPU", None)]
        pub.send_multipart([b"", seq.to_bytes(8, "big"), encode_batch(EventBatch(0.0, events))])
        seq += 1
    print(seq, flush=True)
""")


async def test_a_flooding_publisher_neither_crashes_nor_blocks_the_router() -> None:
    engine, other = await Engine().start(), await Engine().start()
    port = free_port()
    flooder = other.url  # an instance whose event stream is a flooding publisher's
    router = await router_for([engine.url, flooder], {"Instances": {engine.url: engine.kv,
                                                                    flooder: {"Endpoint": f"tcp://127.0.0.1:{port}"}},
                                                      "ReceiveHwm": 1000})
    proc = subprocess.Popen([sys.executable, "-c", FLOOD, f"tcp://127.0.0.1:{port}", "3"], stdout=subprocess.PIPE)
    try:
        lags: list[float] = []
        stop = asyncio.Event()

        async def ticker() -> None:
            while not stop.is_set():
                t = time.perf_counter()
                await asyncio.sleep(0.01)
                lags.append(time.perf_counter() - t - 0.01)

        tick = asyncio.create_task(ticker())
        deadline = time.monotonic() + 4.0
        answered = 0
        while time.monotonic() < deadline:
            await send(router.url, chat(f"During the flood {answered}?"))
            answered += 1
        stop.set()
        await tick
        sent = int(proc.communicate(timeout=30)[0])
        st = status(router, flooder)
        assert sent > 10_000 and st.messages > 1000  # it flooded, and the router kept ingesting
        # The event loop kept turning: a ticker every 10 ms was never held up for long
        # (applying the flood in one go would hold it for seconds).
        assert max(lags) < 0.5, f"the event loop was blocked for {max(lags):.3f} s"
        assert answered >= 10 and status(router, engine.url).mode == "precise"
        assert st.gaps + st.orphaned >= 0 and st.malformed_messages == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        await router.close()
        await engine.stop()
        await other.stop()


async def test_a_stream_that_never_connects_leaves_the_instance_approximate() -> None:
    engine = await Engine().start()
    plain = await start_engine_server(EngineConfig(), "127.0.0.1", 0, 0.0, tokenizer=TOK)  # no events at all
    plain_url = f"http://127.0.0.1:{plain[1]}"
    dead = f"tcp://127.0.0.1:{free_port()}"
    router = await router_for([engine.url, plain_url],
                              {"Instances": {engine.url: {"Endpoint": dead}}, "Discovery": {"FromInfo": True}})
    try:
        for i in range(6):
            await send(router.url, chat(f"Anyone there {i}?"))
        await asyncio.sleep(0.3)
        for url in (engine.url, plain_url):
            st = status(router, url)
            assert (st.mode, st.reason, st.connected, st.messages) == ("approximate", "never connected", False, 0)
        async with aiohttp.ClientSession() as session:
            async with session.get(router.url + "/metrics") as r:
                metrics = await r.text()
        assert f'prefixroute_kv_events_precise{{instance="{engine.url}"}} 0.0' in metrics
    finally:
        t0 = time.monotonic()
        await router.close()
        assert time.monotonic() - t0 < 5  # the retrying discovery and connection do not hold the shutdown
        await engine.stop()
        await plain[0].cleanup()


async def test_reconfiguration_follows_instances_and_turns_precise_mode_off() -> None:
    engines = [await Engine().start() for _ in range(2)]
    router = await router_for([engines[0].url], {"Discovery": {"FromInfo": True}})
    try:
        view = router.state.kv_view
        assert view is not None
        await connected(router, engines[0].url)
        base = router.state.config.model_dump(by_alias=True)
        base["Endpoints"][0]["ProductionVariants"][0]["Instances"] = [engines[1].url]
        router.apply_config(FleetConfig.from_mapping(base))
        assert view.instances == [engines[1].url]
        await eventually(lambda: status(router, engines[1].url).connected)
        kv = base.pop("KvEvents")
        router.apply_config(FleetConfig.from_mapping(base))
        assert router.state.kv_view is None and router.state.kv_subscriber is None
        await send(router.url, chat("Still routed?"))
        router.apply_config(FleetConfig.from_mapping({**base, "KvEvents": kv}))  # on again, at run time
        await eventually(lambda: router.state.kv_subscriber is not None)
        await connected(router, engines[1].url)
    finally:
        await router.close()
        for e in engines:
            await e.stop()


def test_serve_flags_build_the_kv_events_configuration() -> None:
    import argparse

    p = argparse.ArgumentParser()
    configure_parser(p)
    args = p.parse_args(["--backend", "http://10.0.0.1:8000/", "--backend", "http://10.0.0.2:8000",
                         "--kv-events-endpoint", "http://10.0.0.1:8000=tcp://10.0.0.1:5557,tcp://10.0.0.1:5558",
                         "--kv-events-template", "tcp://{host}:5557", "--kv-block-size", "64"])
    kv = build_config(args).kv_events
    assert kv is not None and kv.block_size == 64
    assert kv.endpoints_for("http://10.0.0.1:8000").replay_endpoint == "tcp://10.0.0.1:5558"  # type: ignore[union-attr]
    assert kv.endpoints_for("http://10.0.0.2:8000").endpoint == "tcp://10.0.0.2:5557"  # type: ignore[union-attr]
    from prefixroute.core.config import ConfigError

    for bad, message in [(["--kv-events-endpoint", "tcp://x:1"], "expected URL=ENDPOINT"),
                         (["--kv-events-endpoint", "http://10.9.9.9:1=tcp://x:1"], "no --backend"),
                         (["--kv-block-size", "16"], "needs --kv-events-endpoint"),
                         (["--kv-events-template", "tcp://{hostname}:1"], "only {host} and {port}"),
                         (["--kv-events-endpoint", "http://10.0.0.1:8000=tcp://*:5557"], "no '*'")]:
        with pytest.raises(ConfigError, match=message):
            build_config(p.parse_args(["--backend", "http://10.0.0.1:8000", *bad]))
    with pytest.raises(ConfigError, match="KvEvents section"):
        build_config(p.parse_args(["--config", "x.yaml", "--kv-events-from-info"]))
    from prefixroute.core.kvevents.config import KvEventsConfig

    assert KvEventsConfig().inline_tokenize_chars == 8192
    assert KvEventsConfig.model_validate({"InlineTokenizeChars": None}).inline_tokenize_chars is None
    with pytest.raises(ValueError, match="InlineTokenizeChars"):
        KvEventsConfig.model_validate({"InlineTokenizeChars": -1})


# -- CACHE_AWARE routes on the events (precise mode) ---------------------------------


async def cache_aware_router(instances: list[str], data_plane: str = "fast", matching: str = "bytes") -> RouterHandle:
    routing = RoutingConfig.build("cache-aware", concurrency_threshold=8)
    base = FleetConfig.single(instances, routing).model_dump(by_alias=True)
    config = FleetConfig.from_mapping({**base, "KvEvents": {"Discovery": {"FromInfo": True}, "Tokenizer": "tiny",
                                                            "Matching": matching}})
    return await start_router(config, ServerSettings(port=0, health_check_interval_s=0, metrics_scrape_interval_s=0,
                                                     data_plane=data_plane))


@contextlib.asynccontextmanager
async def precise_fleet(data_plane: str, matching: str = "bytes"
                        ) -> AsyncIterator[tuple[list[Engine], RouterHandle, Callable[[dict], str]]]:
    """Two engines, a CACHE_AWARE router in precise mode connected to both, and where the
    router's learned view alone would send a chat body."""
    engines = [await Engine().start() for _ in range(2)]
    router = await cache_aware_router([e.url for e in engines], data_plane, matching)
    try:
        for e in engines:
            await connected(router, e.url)
        pool = router.state.fleet.endpoint(None).variant(None)

        def learned_choice(body: dict[str, Any]) -> str:
            _, blocks = openai_route(body, True, pool.routing)
            return pool.choose(None, blocks=blocks).instance.instance_id

        yield engines, router, learned_choice
    finally:
        await router.close()
        for e in engines:
            await e.stop()


async def send_decided(url: str, body: dict[str, Any], chat_api: bool = True) -> tuple[str, str]:
    async with aiohttp.ClientSession() as session:
        async with session.post(url + ("/v1/chat/completions" if chat_api else "/v1/completions"), json=body) as r:
            assert r.status == 200, await r.text()
            await r.read()
            return r.headers.get("X-Prefixroute-Instance", ""), r.headers.get("X-Prefixroute-Decision", "")


@pytest.mark.parametrize("data_plane,matching", [("fast", "bytes"), ("aiohttp", "bytes"), ("fast", "tokens")])
async def test_cache_aware_sends_a_prompt_where_the_events_show_it(data_plane: str, matching: str) -> None:
    # Each engine computes a document of its own without the router knowing (another
    # router replica sent it): the router's learned view is empty, its events are not.
    # Every follow-up question goes to the engine holding its document, whichever that
    # is (a placement by rendezvous would get one of the two wrong), chat and completions;
    # matched by the prompt's bytes (no tokenizing) or by its tokens.
    async with precise_fleet(data_plane, matching) as (engines, router, learned_choice):
        for i, e in enumerate(engines):
            # A document the learned view would place on the other engine.
            doc = next(d for j in range(100) if learned_choice({"model": DEFAULT_MODEL, "messages": [{
                "role": "user", "content": (d := f"Document {i}.{j}: " + f"the engine {i} computed this text first "
                                            * 30) + " x"}]}) != e.url)
            first = {"model": DEFAULT_MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": doc}]}
            await send(e.url, first)  # straight to the engine
            raw = {"model": DEFAULT_MODEL, "prompt": doc, "max_tokens": 2}
            await send(e.url, raw, chat_api=False)
            # Both forms' events must have arrived (they come in separate batches).
            await eventually(lambda: held(router, e.url, first) == full_blocks(first), what="the chat form's blocks")
            await eventually(lambda: held(router, e.url, raw, False) == full_blocks(raw, False),
                             what="the completion form's blocks")
            follow = {**first, "messages": [{"role": "user", "content": doc + " And one more question?"}]}
            assert await send_decided(router.url, follow) == (e.url, "affinity")
            completion = {"model": DEFAULT_MODEL, "prompt": doc + " continued", "max_tokens": 2}
            assert await send_decided(router.url, completion, chat_api=False) == (e.url, "affinity")
        keyer = router.state.kv_keyer
        assert keyer is not None
        stats = keyer.stats()
        if matching == "bytes":  # 2 requests per engine, none tokenized
            assert (stats["byte_matched"], stats["misses"], stats["hits"]) == (4, 0, 0)
            assert router.state.kv_view.byte_index is not None and len(router.state.kv_view.byte_index) > 0
        else:
            assert stats["byte_matched"] == 0 and stats["hits"] > 0


async def document_held_elsewhere(engines: list[Engine], router: RouterHandle, learned_choice: Callable[[dict], str]
                                  ) -> tuple[str, dict[str, Any]]:
    """A 20 KB document (a system prompt and a first question) sent straight to the first
    engine, which the router's learned view would place on the other: only the engine's
    events know it. Returns the engine's URL and the request, once the router holds its
    blocks."""
    words = ["tokens", "blocks,", "engine.", "cache", "router", "prefix"]
    holder = engines[0].url
    for j in range(100):
        doc = f"Document {j}: " + " ".join(words[(i * 7 + j) % 6] + str(i % 97) for i in range(2500))
        first = {"model": DEFAULT_MODEL, "max_tokens": 2,
                 "messages": [{"role": "system", "content": doc}, {"role": "user", "content": "Question 1?"}]}
        if learned_choice(first) != holder:
            break
    assert len(doc) > 20_000 and learned_choice(first) != holder
    await send(holder, first)
    await eventually(lambda: held(router, holder, first) == full_blocks(first), what="the document's blocks")
    return holder, first


@pytest.mark.parametrize("data_plane", ["fast", "aiohttp"])
async def test_a_new_long_document_is_tokenized_off_the_request_path(data_plane: str) -> None:
    # The first request naming a 20 KB document the router never tokenized is not held up
    # by tokenizing it (InlineTokenizeChars, 8,192 by default): it goes where the learned
    # view sends it while a thread tokenizes the document, and the next questions about
    # it are keyed from those pieces (precise again), tokenizing only their new text
    # (KvEvents.Matching: tokens; with bytes nothing is tokenized: the next test).
    async with precise_fleet(data_plane, "tokens") as (engines, router, learned_choice):
        holder, first = await document_held_elsewhere(engines, router, learned_choice)
        keyer, off_path = router.state.kv_keyer, router.state.kv_tokenize
        assert keyer is not None
        # Precise mode would send it to the holder; deferred, it goes where the learned view says.
        assert (await send_decided(router.url, first))[0] == learned_choice(first) != holder
        assert keyer.stats()["deferred"] == 1
        await eventually(lambda: off_path.learned > 10, what="the document tokenized on the thread")
        misses = []
        for q in range(2, 5):
            follow = {**first, "messages": [first["messages"][0], {"role": "user", "content": f"Question {q}?"}]}
            assert (await send_decided(router.url, follow))[1] == "affinity"
            misses.append(keyer.stats()["misses"])
        st = keyer.stats()
        assert st["deferred"] == 1 and st["hits"] > 0
        # The first follow-up keys the document's chunks from their token ids (no tokenizing);
        # each later one misses only the pieces from its question on (the template's few after it).
        assert misses[1] - misses[0] <= 8 and misses[2] - misses[1] <= 8, misses
        async with aiohttp.ClientSession() as session:
            async with session.get(router.admin_url + "/admin/kv-events") as r:
                doc_status = await r.json()
        assert doc_status["Tokenizer"]["DeferredRequests"] == 1
        assert doc_status["Tokenizer"]["OffPathPieces"] == off_path.learned > 10


@pytest.mark.parametrize("data_plane", ["fast", "aiohttp"])
async def test_a_new_long_document_is_matched_by_its_bytes_on_its_first_request(data_plane: str) -> None:
    # KvEvents.Matching: bytes (the default). A 20 KB document another router replica
    # sent to an engine: this router's first request naming it goes to that engine at
    # once, found from the blocks' token ids rendered back to text, and no request is
    # tokenized at all (the keyer's piece cache stays empty).
    async with precise_fleet(data_plane) as (engines, router, learned_choice):
        holder, first = await document_held_elsewhere(engines, router, learned_choice)
        for q in range(2, 5):
            follow = {**first, "messages": [first["messages"][0], {"role": "user", "content": f"Question {q}?"}]}
            assert await send_decided(router.url, follow) == (holder, "affinity")
        keyer = router.state.kv_keyer
        assert keyer is not None
        assert keyer.stats() == {"pieces": 0, "hits": 0, "misses": 0, "deferred": 0, "byte_matched": 3,
                                  "template_shapes": 1, "template_substituted": 1, "template_rendered": 2,
                                  "template_mismatches": 0}
        async with aiohttp.ClientSession() as session:
            async with session.get(router.admin_url + "/admin/kv-events") as r:
                doc_status = await r.json()
        assert doc_status["Matching"] == "bytes" and doc_status["Tokenizer"]["ByteMatchedRequests"] == 3
        assert doc_status["ByteIndexBlocks"] >= full_blocks(first) // router.state.kv_view.block_size


def test_serve_flags_give_precise_mode_its_tokenizer_and_cache_aware_its_tiers() -> None:
    import argparse

    p = argparse.ArgumentParser()
    configure_parser(p)
    config = build_config(p.parse_args(["--backend", "http://10.0.0.1:8000", "--strategy", "cache-aware",
                                        "--concurrency-threshold", "8", "--kv-events-from-info", "--tokenizer",
                                        "tiny", "--cpu-tier-tokens", "400000", "--shared-tier"]))
    assert config.kv_events is not None and config.kv_events.tokenizer == "tiny"
    assert config.kv_events.matching == "bytes"
    tokens = build_config(p.parse_args(["--backend", "http://10.0.0.1:8000", "--kv-events-from-info", "--tokenizer",
                                        "tiny", "--kv-match", "tokens"]))
    assert tokens.kv_events is not None and tokens.kv_events.matching == "tokens"
    from prefixroute.core.config import ConfigError as _ConfigError

    with pytest.raises(_ConfigError, match="--kv-match needs --tokenizer"):
        build_config(p.parse_args(["--backend", "http://10.0.0.1:8000", "--kv-events-from-info", "--kv-match",
                                   "tokens"]))
    tiers = config.endpoints[0].variants[0].routing.cache_aware.kv_tiers  # type: ignore[union-attr]
    assert tiers is not None and (tiers.cpu_tier_tokens, tiers.shared_tier) == (400_000, True)
    from prefixroute.core.config import ConfigError

    with pytest.raises(ConfigError, match="Tokenizer"):
        build_config(p.parse_args(["--backend", "http://10.0.0.1:8000", "--kv-events-from-info", "--tokenizer",
                                   "/no/such/model"]))


@pytest.mark.parametrize("encoding", ["array", "map"])
async def test_the_routers_block_chain_is_the_one_rebuilt_from_the_engines_events(encoding: str) -> None:
    # For one prompt at a time (chat and completions, on the base model and on a LoRA
    # adapter), on a fresh engine: the keys the router computes for the request are
    # exactly the keys it rebuilt from the engine's events for that prompt's blocks, in
    # both encodings; the same prompt on the other model shares none of them.
    from prefixroute.core.kvevents.chain import block_keys, chain_root

    engine = await Engine(lora_adapters=("sql-lora",), encoding=encoding).start()
    router = await cache_aware_router([engine.url])
    try:
        await connected(router, engine.url)
        view, keyer = router.state.kv_view, router.state.kv_keyer
        assert view is not None and keyer is not None
        index = view.stream(engine.url).index  # type: ignore[union-attr]
        async with aiohttp.ClientSession() as session:
            async with session.get(engine.url + "/v1/models") as r:
                cards = {c["id"]: c["parent"] for c in (await r.json())["data"]}
            assert cards == {DEFAULT_MODEL: None, "sql-lora": DEFAULT_MODEL}
            async with session.post(engine.url + "/v1/completions", json={"model": "other", "prompt": "x"}) as r:
                assert r.status == 404
        doc = "A prompt whose blocks the router must rebuild exactly. " * 12
        cases = [({"model": m, "max_tokens": 1, "messages": [{"role": "system", "content": doc},
                                                             {"role": "user", "content": f"Question for {m}?"}]}, True)
                 for m in (DEFAULT_MODEL, "sql-lora")]
        cases += [({"model": m, "max_tokens": 1, "prompt": f"{doc} completed by {m}"}, False)
                  for m in (DEFAULT_MODEL, "sql-lora")]
        for body, chat_api in cases:
            async with aiohttp.ClientSession() as session:  # reset the engine's cache: only this prompt
                async with session.post(engine.url + "/reset_prefix_cache") as r:
                    assert r.status == 200
            await eventually(lambda: len(index) == 0, what="the cleared cache")
            await send(engine.url, body, chat_api)
            lora = body["model"] if body["model"] == "sql-lora" else None
            ids = TOK.request_token_ids(body, chat_api)
            want = block_keys(ids, BS, chain_root(lora))
            await eventually(lambda: len(index) >= len(want), what="the prompt's blocks")
            assert view.lora_name(body["model"]) == lora
            keys, tokens = keyer.keys(body, chat_api, view.lora_name(body["model"]))
            assert (keys, tokens) == (want, len(ids)) and len(keys) >= 10
            # The events' blocks are the prompt's (and at most one more for the output token).
            assert set(keys) <= set(index.held) and len(index.held) - len(keys) <= 1, (body["model"], chat_api)
            other = block_keys(ids, BS, chain_root(None if lora else "sql-lora"))
            assert not set(other) & set(index.held)
    finally:
        await router.close()
        await engine.stop()


async def test_an_engine_seen_restarting_by_its_metrics_loses_its_events_state_at_once() -> None:
    # The scrape sees the counters go back before the new engine publishes anything: what
    # the old engine's events said must not keep routing requests there in the meantime.
    engine = await Engine().start()
    router = await cache_aware_router([engine.url])
    try:
        await connected(router, engine.url)
        body = {"model": DEFAULT_MODEL, "max_tokens": 2,
                "messages": [{"role": "user", "content": "restart me " + "a document line " * 80}]}
        await send(engine.url, body)
        await eventually(lambda: held(router, engine.url, body) == full_blocks(body), what="the blocks")
        stream = router.state.kv_view.stream(engine.url)  # type: ignore[union-attr]
        resets = stream.counts.resets
        router.state.engine_restarted(engine.url)
        assert held(router, engine.url, body) == 0 and stream.counts.resets == resets + 1
        assert stream.last_reset is not None and "engine restarted" in stream.last_reset[0]
        assert stream.reason == "events flowing"  # (the reset is reported apart: LastReset)
        now = time.monotonic()
        st = next(x for x in router.state.kv_view.status(now) if x.instance == engine.url)  # type: ignore[union-attr]
        assert st.last_reset_age_s is not None and 0 <= st.last_reset_age_s < 5  # dated when it happened
    finally:
        await router.close()
        await engine.stop()


async def test_the_tokenizing_thread_runs_nicer_than_the_event_loop() -> None:
    import os
    import threading

    from prefixroute.core.precise_keys import RequestKeyer
    from prefixroute.server.precise import TOKENIZE_NICENESS, OffPathTokenizer

    class Probe(RequestKeyer):
        def tokenize_pieces(self, pieces):  # (runs on the thread: what niceness does it have?)
            self.seen = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
            return super().tokenize_pieces(pieces)

    keyer = Probe(TOK, BS)
    off_path = OffPathTokenizer()
    try:
        off_path.submit(keyer, ("a piece of text to tokenize",))
        await eventually(lambda: off_path.learned == 1, what="the piece learned")
        own = os.getpriority(os.PRIO_PROCESS, 0)
        assert keyer.seen == min(19, own + TOKENIZE_NICENESS)
    finally:
        off_path.close()


async def test_the_test_engine_picks_other_ports_when_one_is_taken_before_it_binds(monkeypatch):
    ctx = zmq.Context()
    taken = ctx.socket(zmq.PUB)
    port = taken.bind_to_random_port("tcp://*")
    picks = iter([port, port])  # the first two picks are both the taken port
    real = free_port
    monkeypatch.setattr(sys.modules[__name__], "free_port", lambda: next(picks, None) or real())
    try:
        engine = Engine()
        assert engine.pub_port == port and engine.replay_port == port
        await engine.start()
        try:
            assert engine.pub_port != port and engine.replay_port != port
            assert engine.server.publisher is not None
            assert engine.server.publisher.endpoint.endswith(f":{engine.pub_port}")
        finally:
            await engine.stop()
        # ports the caller chose are not changed: the error is the caller's
        with pytest.raises(zmq.ZMQError):
            await Engine(pub_port=port).start()
    finally:
        taken.close(0)
        ctx.term()
