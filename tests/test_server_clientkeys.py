"""Client API keys and limits: 401 without a valid key, 429 with Retry-After over a key's or
tenant's limit, in OpenAI's or SageMaker's shape, on both data planes, with the real clients."""

from __future__ import annotations

import asyncio
import hashlib

import aiohttp
import pytest

from prefixroute.core.config import ConfigError, FleetConfig, RoutingConfig
from prefixroute.server import clientkeys, start_router
from prefixroute.server.clientkeys import ClientAuth, load_keys
from prefixroute.server.limits import Admission, Limits, LimitState, Refusal, admit
from test_server_helpers import FakeInstance, eventually, metric_value, settings

PA = RoutingConfig.build("prefix-aware", 1024, 4)
KEYS = """
Keys:
  - {Name: alpha, Key: sk-alpha-0001, RequestsPerSecond: 2, Burst: 3}
  - {Name: beta, Key: sk-beta-00002, MaxConcurrent: 1, Tenant: acme}
  - {Name: gamma, KeySha256: %s, Tenant: acme}
  - {Name: delta, Key: sk-delta-0004}
Tenants:
  - {Name: acme, MaxConcurrent: 2}
""" % hashlib.sha256(b"sk-gamma-0003").hexdigest()


# -- the limits, on a clock we move ------------------------------------------------------


def test_token_bucket_rate_burst_and_retry_after():
    s = LimitState(Limits(rate=2.0, burst=3), now=0.0)
    got = [admit(s, None, 0.0) for _ in range(4)]
    assert [isinstance(g, Admission) for g in got] == [True, True, True, False]  # the burst, then empty
    assert got[3] == Refusal("key", "rate", 1)
    for g in got[:3]:
        g.release()  # type: ignore[union-attr]
    assert isinstance(admit(s, None, 0.5), Admission)  # 0.5 s at 2/s: one token
    refused = admit(s, None, 0.5)
    assert isinstance(refused, Refusal) and refused.retry_after_s == 1
    # Over 10 s of steady asking, the admitted count is the burst plus 2 per second.
    s = LimitState(Limits(rate=2.0, burst=3), now=0.0)
    admitted = 0
    for i in range(1000):
        a = admit(s, None, i * 0.01)
        if isinstance(a, Admission):
            admitted += 1
            a.release()
    assert admitted == 3 + 20 - 1 or admitted == 3 + 20  # 9.99 s of refill


def test_concurrency_and_all_or_nothing_with_the_tenant():
    key = LimitState(Limits(max_concurrent=2), 0.0)
    tenant = LimitState(Limits(max_concurrent=1), 0.0)
    first = admit(key, tenant, 0.0)
    assert isinstance(first, Admission)
    second = admit(key, tenant, 0.0)
    assert second == Refusal("tenant", "concurrency", 1) and second.outcome == "tenant_concurrency_limited"
    assert key.in_flight == 1  # the key was not charged for a request the tenant refused
    first.release()
    first.release()  # idempotent
    assert (key.in_flight, tenant.in_flight) == (0, 0)
    rated = LimitState(Limits(rate=1.0), 0.0)
    assert isinstance(admit(rated, None, 0.0), Admission)
    assert admit(rated, None, 0.1).outcome == "rate_limited"  # type: ignore[union-attr]


def test_reloaded_limits_keep_the_state():
    s = LimitState(Limits(rate=10.0, burst=10), 0.0)
    for _ in range(10):
        admit(s, None, 0.0)
    s.set_limits(Limits(rate=1.0, burst=2), 0.0)
    assert isinstance(admit(s, None, 0.0), Refusal)  # still empty, not refilled by the reload


# -- the keys file ---------------------------------------------------------------------------


def test_keys_file_and_environment(tmp_path):
    path = tmp_path / "keys.yaml"
    path.write_text(KEYS)
    cfg = load_keys(str(path), environ={"PREFIXROUTE_API_KEYS": "ci:sk-ci-000005, sk-bare-00006"})
    assert [k.name for k in cfg.keys] == ["alpha", "beta", "gamma", "delta", "ci", "env-2"]
    assert "sk-alpha" not in repr(cfg)  # a key is never shown
    assert load_keys(None, environ={}) is None
    assert [k.name for k in load_keys(None, environ={"PREFIXROUTE_API_KEYS": "a:sk-a-0000001"}).keys] == ["a"]


@pytest.mark.parametrize("text, message", [
    ("Keys:\n  - {Name: a, Key: sk-aaaaaaaa\n", "line 3"),  # YAML error: the file and line
    ("Keys:\n  - {Name: a}\n", "give exactly one of Key and KeySha256"),
    ("Keys:\n  - {Name: a, Key: short}\n", "Keys.0.Key"),
    ("Keys:\n  - {Name: a, Key: sk-aaaaaaaa}\n  - {Name: a, Key: sk-bbbbbbbb}\n", "duplicate Name"),
    ("Keys:\n  - {Name: a, Key: sk-aaaaaaaa, RequestsPerSecond: 0}\n", "RequestsPerSecond"),
    ("Keys: []\n", "no keys"),
])
def test_invalid_keys_files_name_the_problem(tmp_path, text, message):
    path = tmp_path / "keys.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as err:
        load_keys(str(path), environ={})
    assert message in str(err.value) and str(path) in str(err.value)
    assert "sk-" not in str(err.value).replace("Key: sk-", "")  # no key quoted back


def test_keys_are_compared_in_constant_time(monkeypatch):
    compared = []
    real = clientkeys.hmac.compare_digest

    def spy(a, b):
        compared.append((len(a), len(b)))
        return real(a, b)

    monkeypatch.setattr(clientkeys.hmac, "compare_digest", spy)
    auth = ClientAuth(load_keys(None, environ={"PREFIXROUTE_API_KEYS": "a:sk-a-0000001"}))
    assert auth.identify({"Authorization": "Bearer sk-a-0000002"}) == "wrong"
    assert auth.identify({"x-api-key": "s"}) == "wrong"
    assert auth.identify({"Authorization": "bearer sk-a-0000001"}).name == "a"  # the scheme in any case
    assert auth.identify({"Authorization": "Basic c2s6"}) == "missing"
    # Every check, right or wrong, compares two 32-byte digests: the time says nothing of the key.
    assert compared == [(32, 32)] * 3


# -- over HTTP, both data planes --------------------------------------------------------------


@pytest.fixture
async def fleet(tmp_path, data_plane):
    path = tmp_path / "keys.yaml"
    path.write_text(KEYS)
    inst = await FakeInstance().start()
    handle = await start_router(FleetConfig.single([inst.url], PA),
                                settings(data_plane=data_plane, api_keys_file=str(path), admin_port=None,
                                         admin_token="admin-secret-1"))
    yield handle, inst, path
    await handle.close()
    await inst.stop()


BODY = {"model": "m", "prompt": "hello"}


async def _post(http, url, path="/v1/completions", key=None, header="Authorization", **kw):
    headers = dict(kw.pop("headers", {}))
    if key is not None:
        headers[header] = f"Bearer {key}" if header == "Authorization" else key
    if "data" not in kw:
        kw["json"] = BODY
    async with http.post(url + path, headers=headers, **kw) as r:
        return r.status, dict(r.headers), await r.read()


async def test_missing_or_wrong_key_is_401_in_the_api_shape(fleet):
    handle, inst, _ = fleet
    async with aiohttp.ClientSession() as http:
        status, headers, body = await _post(http, handle.url)
        assert (status, headers["WWW-Authenticate"]) == (401, "Bearer") and b'"invalid_api_key"' in body
        status, _, body = await _post(http, handle.url, key="sk-alpha-0002")
        assert status == 401 and b"invalid API key" in body
        status, headers, _ = await _post(http, handle.url, "/invocations", data=b"x")
        assert (status, headers["x-amzn-ErrorType"]) == (401, "MissingAuthenticationTokenException")
        status, headers, _ = await _post(http, handle.url, "/invocations", key="nope-nope-1", header="x-api-key",
                                         data=b"x")
        assert (status, headers["x-amzn-ErrorType"]) == (401, "UnrecognizedClientException")
        async with http.get(handle.url + "/v1/models") as r:
            assert r.status == 401
        async with http.get(handle.url + "/health") as r:
            assert r.status == 200  # load balancers' checks need no key
        # The admin API keeps its own token: a client key does not open it.
        async with http.get(handle.admin_url + "/admin/config", headers={"Authorization": "Bearer sk-delta-0004"}) as r:
            assert r.status == 401
        status, _, _ = await _post(http, handle.url, key="admin-secret-1")
        assert status == 401  # and the admin token is no client key
    assert inst.received == []  # nothing reached the engine


async def test_a_valid_key_passes_and_is_not_forwarded(fleet):
    handle, inst, _ = fleet
    async with aiohttp.ClientSession() as http:
        assert (await _post(http, handle.url, key="sk-delta-0004"))[0] == 200
        assert (await _post(http, handle.url, key="sk-gamma-0003", header="x-api-key"))[0] == 200  # by its SHA-256
        assert (await _post(http, handle.url, "/invocations", key="sk-delta-0004", header="x-api-key",
                            data=b"x"))[0] == 200
        async with http.get(handle.url + "/v1/models", headers={"x-api-key": "sk-delta-0004"}) as r:
            assert r.status == 200
    for _, headers, _ in inst.received:
        assert "Authorization" not in headers and "x-api-key" not in headers


async def test_rate_limit_429_with_retry_after_then_admitted_again(fleet):
    handle, _, _ = fleet
    async with aiohttp.ClientSession() as http:
        got = [await _post(http, handle.url, key="sk-alpha-0001") for _ in range(5)]
        assert [s for s, _, _ in got[:3]] == [200, 200, 200]  # the burst of 3
        limited = [g for g in got[3:] if g[0] == 429]
        assert limited, [s for s, _, _ in got]
        status, headers, body = limited[0]
        assert headers["Retry-After"] == "1" and b'"rate_limit_exceeded"' in body and b'"requests"' in body
        status, headers, _ = await _post(http, handle.url, "/invocations", key="sk-alpha-0001", header="x-api-key",
                                         data=b"x")
        assert (status, headers["x-amzn-ErrorType"], headers["Retry-After"]) == (429, "ThrottlingException", "1")
        await asyncio.sleep(1.05)  # two tokens back
        assert (await _post(http, handle.url, key="sk-alpha-0001"))[0] == 200
        async with http.get(handle.url + "/metrics") as r:
            text = await r.text()
    assert metric_value(text, "prefixroute_client_requests_total", client="alpha", outcome="admitted") == 4
    assert metric_value(text, "prefixroute_client_requests_total", client="alpha", outcome="rate_limited") == 3
    assert metric_value(text, "prefixroute_client_in_flight", client="alpha") == 0


async def test_concurrency_limits_of_a_key_and_its_tenant(fleet):
    handle, inst, _ = fleet
    inst.mode = "hold"
    async with aiohttp.ClientSession() as http:
        held = asyncio.create_task(_post(http, handle.url, key="sk-beta-00002"))
        for _ in range(300):
            if inst.active == 1:
                break
            await asyncio.sleep(0.01)
        status, headers, body = await _post(http, handle.url, key="sk-beta-00002")
        assert (status, headers["Retry-After"]) == (429, "1") and b"concurrent requests" in body
        held2 = asyncio.create_task(_post(http, handle.url, key="sk-gamma-0003"))  # acme's second slot
        for _ in range(300):
            if inst.active == 2:
                break
            await asyncio.sleep(0.01)
        status, _, body = await _post(http, handle.url, key="sk-gamma-0003")
        assert status == 429 and b"tenant limit" in body  # acme: 2 at once over its keys
        inst.gate.set()
        assert [s for s, _, _ in await asyncio.gather(held, held2)] == [200, 200]
        inst.mode = "echo"
        assert (await _post(http, handle.url, key="sk-beta-00002"))[0] == 200  # the slot came back
        async with http.get(handle.url + "/metrics") as r:
            text = await r.text()
    assert metric_value(text, "prefixroute_client_requests_total", client="beta", outcome="concurrency_limited") == 1
    assert metric_value(text, "prefixroute_client_requests_total", client="gamma",
                        outcome="tenant_concurrency_limited") == 1
    assert metric_value(text, "prefixroute_client_in_flight", client="beta", tenant="acme") == 0


async def test_a_client_gone_mid_stream_gives_its_slot_back(fleet):
    handle, inst, _ = fleet
    inst.mode = "stream"
    inst.gates = [asyncio.Event()]  # the stream's head is sent, its first event never

    def beta_in_flight() -> int:
        return {name: n for name, _, n in handle.state.clients.in_flight()}["beta"]

    async with aiohttp.ClientSession() as http:
        resp = await http.post(handle.url + "/v1/completions", json={**BODY, "stream": True},
                               headers={"Authorization": "Bearer sk-beta-00002"})
        assert resp.status == 200 and beta_in_flight() == 1
        resp.close()  # the client leaves
        assert await eventually(lambda: beta_in_flight() == 0, 3)
        inst.mode = "echo"
        assert (await _post(http, handle.url, key="sk-beta-00002"))[0] == 200


async def test_keys_reload_adds_and_removes_keys(fleet, caplog):
    handle, _, path = fleet
    path.write_text("Keys:\n  - {Name: alpha, Key: sk-alpha-0001}\n  - {Name: epsilon, Key: sk-epsilon-05}\n")
    from prefixroute.server.runner import reload_logged

    assert reload_logged(handle.state)
    assert "API keys reloaded: 2 key(s); added epsilon; removed beta, delta, gamma; changed alpha" in caplog.text
    assert "sk-" not in caplog.text
    async with aiohttp.ClientSession() as http:
        assert (await _post(http, handle.url, key="sk-epsilon-05"))[0] == 200
        assert (await _post(http, handle.url, key="sk-delta-0004"))[0] == 401
    path.write_text("Keys: [oops")
    assert not reload_logged(handle.state)  # invalid: the keys in force are kept
    async with aiohttp.ClientSession() as http:
        assert (await _post(http, handle.url, key="sk-epsilon-05"))[0] == 200


async def test_the_official_clients_with_keys(fleet):
    handle, inst, _ = fleet
    import boto3
    import openai
    from botocore import UNSIGNED
    from botocore.config import Config
    from botocore.exceptions import ClientError

    def run() -> None:
        ok = openai.OpenAI(base_url=handle.url + "/v1", api_key="sk-delta-0004", max_retries=0)
        ok.completions.create(model="m", prompt="hello")
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=handle.url + "/v1", api_key="wrong-key-1", max_retries=0).completions.create(
                model="m", prompt="hello")
        limited = openai.OpenAI(base_url=handle.url + "/v1", api_key="sk-alpha-0001", max_retries=0)
        with pytest.raises(openai.RateLimitError):
            for _ in range(10):
                limited.completions.create(model="m", prompt="hello")
        rt = boto3.client("sagemaker-runtime", endpoint_url=handle.url, region_name="us-east-1",
                          config=Config(signature_version=UNSIGNED, retries={"max_attempts": 1}))
        rt.meta.events.register("before-send.sagemaker-runtime.*",
                                lambda request, **_: request.headers.__setitem__("x-api-key", "sk-delta-0004"))
        assert rt.invoke_endpoint(EndpointName="default", Body=b"x")["Body"].read()
        rt2 = boto3.client("sagemaker-runtime", endpoint_url=handle.url, region_name="us-east-1",
                           config=Config(signature_version=UNSIGNED, retries={"max_attempts": 1}))
        with pytest.raises(ClientError) as err:
            rt2.invoke_endpoint(EndpointName="default", Body=b"x")
        assert err.value.response["Error"]["Code"] == "MissingAuthenticationTokenException"

    await asyncio.to_thread(run)
