"""Validation at the edge: CLI flags, settings, the admin API and the admin token."""

from __future__ import annotations

import argparse

import aiohttp
import pytest

from prefixroute.core.config import ConfigError
from prefixroute.engine import cli as engine_cli
from prefixroute.server.cli import build_settings, configure_parser, parse_size, run
from prefixroute.server.settings import DEFAULT_MAX_BODY_BYTES, ServerSettings

from test_server_helpers import FakeInstance, router_for


def _parse(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    configure_parser(p)
    return p.parse_args(["--backend", "http://127.0.0.1:8001", *argv])


@pytest.mark.parametrize("argv,needle", [
    (["--port", "65535"], "the default (port + 1 = 65,536) is out of range"),
    (["--port", "70000"], "port: 70000 is out of range (allowed 0-65,535)"),
    (["--port", "-1"], "port: -1 is out of range"),
    (["--admin-port", "65536"], "admin port: 65536 is out of range"),
    (["--health-check-interval", "nan"], "health check interval: nan is not a finite number"),
    (["--health-check-interval", "inf"], "health check interval: inf is not a finite number"),
    (["--health-check-interval", "-1"], "must be >= 0"),
    (["--health-check-timeout", "0"], "health check timeout: 0.0 s must be > 0"),
    (["--shutdown-timeout", "nan"], "shutdown timeout: nan is not a finite number"),
    (["--shutdown-timeout=-inf"], "shutdown timeout: -inf is not a finite number"),
    (["--connect-timeout", "0"], "connect timeout: 0.0 s must be > 0"),
    (["--response-headers-timeout", "inf"], "response headers timeout: inf"),
    (["--stream-idle-timeout", "nan"], "stream idle timeout: nan"),
    (["--metrics-scrape-interval", "nan"], "metrics scrape interval: nan"),
    (["--metrics-scrape-timeout", "0"], "metrics scrape timeout: 0.0 s must be > 0"),
    (["--metrics-scrape-timeout", "inf"], "metrics scrape timeout: inf"),
    (["--unhealthy-threshold", "0"], "unhealthy threshold: 0 is out of range"),
    (["--max-retries", "-1"], "max retries: -1 is out of range"),
    (["--max-body-size", "0"], "max body size: 0 is out of range"),
    (["--client-keepalive-timeout", "0"], "client keep-alive timeout: 0.0 s must be > 0"),
    (["--upstream-keepalive-timeout", "0"], "upstream keep-alive timeout (--upstream-keepalive-timeout): 0.0 s"),
    (["--client-send-timeout", "-1"], "client send timeout (--client-send-timeout): -1.0 s must be > 0"),
])
def test_invalid_flags_exit_2_with_a_clear_message(argv, needle, capsys, monkeypatch):
    monkeypatch.delenv("PREFIXROUTE_ADMIN_TOKEN", raising=False)
    assert run(_parse(*argv)) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and needle in err, err


def test_metrics_scrape_timeout_flag_reaches_the_settings():
    assert build_settings(_parse()).metrics_scrape_timeout_s == 2.0
    assert build_settings(_parse("--metrics-scrape-timeout", "7.5")).metrics_scrape_timeout_s == 7.5


def test_a_retry_status_other_than_429_or_503_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exc:
        _parse("--retry-status", "500")
    assert exc.value.code == 2
    assert "'500' is not a status that may be retried (allowed: 429, 503)" in capsys.readouterr().err


def test_retry_and_timeout_flags_reach_the_settings():
    s = build_settings(_parse("--retry-status", "503, 429", "--client-send-timeout", "5",
                              "--upstream-keepalive-timeout", "2.5"))
    assert (s.retry_statuses, s.client_send_timeout_s, s.keepalive_timeout_s) == (frozenset({429, 503}), 5.0, 2.5)
    d = build_settings(_parse())
    assert (d.retry_statuses, d.client_send_timeout_s, d.keepalive_timeout_s) == (frozenset(), 60.0, 4.0)


def test_client_keepalive_timeout_flag_reaches_the_settings():
    assert build_settings(_parse()).client_keepalive_timeout_s == 75.0
    assert build_settings(_parse("--client-keepalive-timeout", "620")).client_keepalive_timeout_s == 620.0


def test_port_65535_with_explicit_admin_port_is_fine():
    s = build_settings(_parse("--port", "65535", "--admin-port", "0"))
    assert s.port == 65535 and not s.admin_enabled
    assert build_settings(_parse("--port", "65534")).admin_port is None  # default port + 1 = 65535


def test_defaults_are_documented_values():
    s = build_settings(_parse())
    assert (s.connect_timeout_s, s.response_headers_timeout_s, s.stream_idle_timeout_s) == (5.0, 600.0, 300.0)
    assert (s.health_check_interval_s, s.health_check_timeout_s, s.health_check_path) == (5.0, 2.0, "/health")
    assert (s.unhealthy_threshold, s.healthy_threshold, s.max_retries) == (2, 2, 2)
    assert s.max_body_bytes == DEFAULT_MAX_BODY_BYTES == 64 * 1024 * 1024
    assert s.metrics_scrape_interval_s == 10.0 and s.shutdown_timeout_s == 30.0 and s.log_prompts is False


@pytest.mark.parametrize("text,expected", [("1024", 1024), ("64MiB", 64 << 20), ("100MB", 100_000_000),
                                           ("1gib", 1 << 30), ("512 KiB", 512 << 10)])
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["lots", "12XB", "nan", "inf", ""])
def test_parse_size_rejects(text):
    with pytest.raises(argparse.ArgumentTypeError):
        parse_size(text)


def test_admin_token_sources(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PREFIXROUTE_ADMIN_TOKEN", "from-env")
    assert build_settings(_parse()).admin_token == "from-env"
    assert build_settings(_parse("--admin-token", "from-flag")).admin_token == "from-flag"
    f = tmp_path / "token"
    f.write_text("from-file\n")
    s = build_settings(_parse("--admin-token-file", str(f), "--admin-host", "0.0.0.0"))
    assert s.admin_token == "from-file" and "from-file" not in repr(s)
    monkeypatch.delenv("PREFIXROUTE_ADMIN_TOKEN")
    for argv, needle in ((["--admin-token-file", str(tmp_path / "missing")], "cannot read admin token file"),
                         (["--admin-token-file", str(f), "--admin-token", "x"], "not both")):
        assert run(_parse(*argv)) == 2
        assert needle in capsys.readouterr().err
    f.write_text("\n")
    assert run(_parse("--admin-token-file", str(f))) == 2
    assert "is empty" in capsys.readouterr().err


def test_settings_reject_bad_values_directly():
    with pytest.raises(ConfigError, match="not a finite number"):
        ServerSettings(keepalive_timeout_s=float("nan"))
    with pytest.raises(ConfigError, match="must not be empty"):
        ServerSettings(admin_token="")


@pytest.mark.parametrize("argv,needle", [(["--port", "99999"], "--port 99999 is out of range"),
                                         (["--port", "-5"], "--port -5 is out of range")])
def test_emulate_rejects_bad_ports(argv, needle, capsys):
    p = argparse.ArgumentParser()
    engine_cli.configure_parser(p)
    assert engine_cli.run(p.parse_args(argv)) == 2
    assert needle in capsys.readouterr().err


@pytest.mark.parametrize("doc,needle", [
    ({"Endpoints": 5}, "Endpoints: must be a list"),
    ({"Endpoints": [{"EndpointName": "e", "ProductionVariants": 5}]}, "Endpoints.0.ProductionVariants: must be a list"),
    ({"Endpoints": [5]}, "Endpoints.0: must be a mapping"),
    ({"Endpoints": [{"EndpointName": "e", "ProductionVariants": ["x"]}]}, "ProductionVariants.0: must be a mapping"),
    (5, "must be a mapping"),
    ([], "must be a mapping"),
])
async def test_admin_put_config_wrong_types_are_400(doc, needle):
    b = await FakeInstance().start()
    handle = await router_for([b.url], admin_port=None)
    try:
        before = handle.state.config
        async with aiohttp.ClientSession() as http:
            async with http.put(handle.admin_url + "/admin/config", json=doc) as r:
                assert r.status == 400
                assert needle in (await r.json())["message"]
            async with http.put(handle.admin_url + "/admin/config", data=b"\xff{") as r:
                assert r.status == 400 and "not valid JSON" in (await r.json())["message"]
            async with http.get(handle.admin_url + "/admin/nope") as r:
                assert r.status == 404 and "message" in await r.json()
        assert handle.state.config == before
    finally:
        await handle.close()
        await b.stop()
