"""The opt-in canonical JSON native key through the router, on both data planes: bodies
that hold the same prompt, serialized differently, reach the same instance; raw bytes
(SageMaker's rule, the default) do not."""

from __future__ import annotations

import json

import aiohttp
import pytest

from prefixroute.core.config import FleetConfig, RoutingConfig
from prefixroute.server.runner import start_router
from test_server_helpers import FakeInstance, settings


def _bodies(i: int) -> tuple[bytes, bytes]:
    prompt = {"messages": [{"role": "system", "content": f"document {i} " + "x" * 1500},
                           {"role": "user", "content": "question?"}], "model": "m"}
    a = json.dumps({**prompt, "temperature": 0.1, "max_tokens": 8}, sort_keys=True).encode()
    b = json.dumps({"max_tokens": 64, "stream": False, "model": "m", "messages": prompt["messages"],
                    "temperature": 0.9}, indent=2).encode()
    return a, b


@pytest.mark.parametrize("native_key, same", [("CANONICAL_JSON", True), ("RAW_BYTES", False)])
async def test_canonical_native_key_sends_equal_prompts_to_one_instance(data_plane, native_key, same):
    fakes = [await FakeInstance().start() for _ in range(4)]
    routing = RoutingConfig.model_validate({"RoutingStrategy": "PREFIX_AWARE", "NativeKey": native_key,
                                            "PrefixAwareRoutingConfig": {"PrefixLength": 1024,
                                                                         "ConcurrencyThreshold": 64}})
    handle = await start_router(FleetConfig.single([f.url for f in fakes], routing), settings(data_plane=data_plane))
    try:
        pairs = []
        async with aiohttp.ClientSession() as http:
            for i in range(8):
                got = []
                for body in _bodies(i):
                    async with http.post(handle.url + "/endpoints/default/invocations", data=body,
                                         headers={"Content-Type": "application/json"}) as r:
                        assert r.status == 200
                        got.append(r.headers["X-Prefixroute-Instance"])
                pairs.append(got[0] == got[1])
        if same:
            assert all(pairs)
        else:
            assert not all(pairs)  # raw bytes differ from the first byte on: keys of their own
        # the bodies reach the instances unchanged whatever the key
        sent = {b for f in fakes for _, _, b in f.received}
        assert sent == {b for i in range(8) for b in _bodies(i)}
    finally:
        await handle.close()
        for f in fakes:
            await f.stop()
