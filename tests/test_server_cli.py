"""``prefixroute serve``: flags, configuration errors, the listening line, signals."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest
import yaml

from prefixroute.core.config import RoutingStrategy
from prefixroute.server.cli import build_config, build_settings, configure_parser, run


def _parse(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    configure_parser(p)
    return p.parse_args(list(argv))


def test_every_flag_has_help():
    p = argparse.ArgumentParser()
    configure_parser(p)
    for action in p._actions:
        if action.dest != "help":
            assert action.help and len(action.help) > 20, action.dest


@pytest.mark.parametrize("spelling,expected", [
    ("RANDOM", RoutingStrategy.RANDOM), ("random", RoutingStrategy.RANDOM),
    ("least-outstanding-requests", RoutingStrategy.LEAST_OUTSTANDING_REQUESTS),
    ("LEAST_OUTSTANDING_REQUESTS", RoutingStrategy.LEAST_OUTSTANDING_REQUESTS),
    ("prefix-aware", RoutingStrategy.PREFIX_AWARE), ("PREFIX_AWARE", RoutingStrategy.PREFIX_AWARE),
])
def test_strategy_spellings(spelling, expected):
    args = _parse("--backend", "http://127.0.0.1:8001", "--backend", "http://127.0.0.1:8002/",
                  "--strategy", spelling, "--prefix-length", "4096", "--concurrency-threshold", "10",
                  "--endpoint-name", "ep", "--variant-name", "Blue")
    cfg = build_config(args)
    ep = cfg.endpoints[0]
    assert (ep.name, ep.variants[0].name) == ("ep", "Blue")
    assert ep.variants[0].instances == ("http://127.0.0.1:8001", "http://127.0.0.1:8002")
    assert ep.variants[0].routing.strategy is expected


@pytest.mark.parametrize("strategy,flags,ignored", [
    ("random", ["--concurrency-threshold", "5"], "--concurrency-threshold"),
    ("least-outstanding-requests", ["--prefix-length", "2048"], "--prefix-length"),
    ("random", ["--block-size", "3"], "--block-size"),  # out of range, but not this strategy's
    ("prefix-aware", ["--prefix-length", "2048", "--concurrency-threshold", "4", "--load-weight", "2"],
     "--load-weight"),
    ("cache-aware", ["--concurrency-threshold", "4", "--prefix-length", "2048"], "--prefix-length"),
])
def test_flags_of_another_strategy_are_ignored_with_a_warning(strategy, flags, ignored, caplog):
    with caplog.at_level("WARNING", logger="prefixroute.server"):
        cfg = build_config(_parse("--backend", "http://h:1", "--strategy", strategy, *flags))
    routing = cfg.endpoints[0].variants[0].routing
    assert routing.strategy is RoutingStrategy.parse(strategy)
    assert [r.getMessage() for r in caplog.records] == [f"{ignored} ignored with strategy {routing.strategy.value}"]
    if routing.strategy in (RoutingStrategy.RANDOM, RoutingStrategy.LEAST_OUTSTANDING_REQUESTS):
        assert routing.prefix_aware is None and routing.cache_aware is None


def test_settings_defaults():
    s = build_settings(_parse("--backend", "http://h:1"))
    assert (s.host, s.port, s.admin_host, s.admin_port) == ("127.0.0.1", 8080, "127.0.0.1", None)
    assert s.health_check_interval_s == 5.0 and s.health_check_path == "/health"
    assert s.shutdown_timeout_s == 30.0 and s.log_prompts is False


def test_admin_token_from_env(monkeypatch):
    monkeypatch.setenv("PREFIXROUTE_ADMIN_TOKEN", "tok")
    assert build_settings(_parse("--backend", "http://h:1")).admin_token == "tok"


@pytest.mark.parametrize("argv,needle", [
    ([], "no instances"),
    (["--backend", "http://h:1", "--strategy", "prefix-aware"],
     "--strategy prefix-aware needs --prefix-length and --concurrency-threshold (--prefix-length N: how much"),
    (["--backend", "http://h:1", "--strategy", "prefix-aware", "--prefix-length", "4096"],
     "--strategy prefix-aware needs --concurrency-threshold (--concurrency-threshold N: requests in flight"),
    (["--backend", "http://h:1", "--strategy", "cache-aware"], "--strategy cache-aware needs --concurrency-threshold"),
    (["--backend", "http://h:1", "--strategy", "prefix-aware", "--prefix-length", "100",
      "--concurrency-threshold", "4"], "PrefixLength: 100 is out of range (allowed 1,024-65,536)"),
    (["--backend", "http://h:1", "--strategy", "fastest"], "unknown strategy 'fastest'"),
    (["--backend", "ftp://h:1"], "is not an http:// or https:// URL"),
    (["--backend", "http://h:1", "--config", "x.yaml"], "either --config or --backend"),
    (["--config", "/nonexistent/fleet.yaml"], "cannot read configuration file"),
    (["--backend", "http://h:1", "--admin-host", "0.0.0.0"], "admin token is required"),
])
def test_config_errors_exit_2(argv, needle, capsys, monkeypatch):
    monkeypatch.delenv("PREFIXROUTE_ADMIN_TOKEN", raising=False)
    assert run(_parse(*argv)) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and needle in err


def _write(path, backend: str, routing: dict) -> None:
    path.write_text(yaml.safe_dump({"Endpoints": [{"EndpointName": "default", "ProductionVariants": [
        {"VariantName": "AllTraffic", "Instances": [backend], "RoutingConfig": routing}]}]}))


def _get(url: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_serve_process_lines_sighup_and_sigterm(tmp_path):
    cfg = tmp_path / "fleet.yaml"
    _write(cfg, "http://127.0.0.1:9", {"RoutingStrategy": "RANDOM"})
    with subprocess.Popen(
        [sys.executable, "-m", "prefixroute.server.cli", "--config", str(cfg), "--port", "0",
         "--health-check-interval", "0", "--log-level", "info"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"},
    ) as proc:
        _drive(proc, cfg)


def _drive(proc: subprocess.Popen, cfg) -> None:
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        m = re.fullmatch(r"prefixroute-serve listening on (http://127\.0\.0\.1:(\d+))\n", line)
        assert m, line
        url = m.group(1)
        admin = re.fullmatch(r"prefixroute-admin listening on (http://127\.0\.0\.1:\d+)\n",
                             proc.stdout.readline())
        assert admin
        admin_url = admin.group(1)
        assert _get(url + "/health") == (200, {"status": "ok", "message": "1 of 1 instances healthy",
                                               "variants_down": [], "healthy_instances": 1, "instances": 1})

        def strategy() -> str:
            return _get(admin_url + "/admin/config")[1]["Endpoints"][0]["ProductionVariants"][0][
                "RoutingConfig"]["RoutingStrategy"]

        _write(cfg, "http://127.0.0.1:9", {"RoutingStrategy": "LEAST_OUTSTANDING_REQUESTS"})
        proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 5
        while strategy() != "LEAST_OUTSTANDING_REQUESTS" and time.monotonic() < deadline:
            time.sleep(0.02)
        assert strategy() == "LEAST_OUTSTANDING_REQUESTS"

        cfg.write_text("Endpoints: [oops")  # invalid: logged, running config kept
        proc.send_signal(signal.SIGHUP)
        time.sleep(0.2)
        assert strategy() == "LEAST_OUTSTANDING_REQUESTS"

        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0
        assert proc.stdout.read() == ""  # nothing else on stdout
        err = proc.stderr.read() if proc.stderr else ""
        assert "configuration reload failed" in err and f"{cfg} line 1, column 17: not valid YAML (expected" in err
        # The first hour: a summary at start, what a reload changed, and what stopping does.
        assert f"serving on {url} (data plane" in err and f"live status page: {admin_url}/" in err
        assert "variant AllTraffic: RANDOM" in err and "http://127.0.0.1:9" in err
        assert "configuration applied: default/AllTraffic routing RANDOM -> LEAST_OUTSTANDING_REQUESTS" in err
        assert ("SIGTERM received, stopping. new connections refused; waiting for 0 requests in flight to "
                "finish, at most") in err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _caught(pid: int, sig: int) -> bool:
    """Whether process ``pid`` catches ``sig`` (its SigCgt mask in /proc)."""
    with open(f"/proc/{pid}/status") as f:
        mask = next(int(line.split()[1], 16) for line in f if line.startswith("SigCgt:"))
    return bool(mask >> (sig - 1) & 1)


def _serve_cmd(cfg, workers: int) -> list[str]:
    return [sys.executable, "-m", "prefixroute", "serve", "--config", str(cfg), "--port", "0",
            "--health-check-interval", "0", "--metrics-scrape-interval", "0", "--workers", str(workers)]


@contextlib.contextmanager
def _serving(cfg, workers: int, group: bool = False):
    """``serve`` on ``cfg`` as a child (its own process group if ``group``), killed at the
    end if still running."""
    with subprocess.Popen(_serve_cmd(cfg, workers), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          start_new_session=group, env={**os.environ, "PYTHONUNBUFFERED": "1"}) as proc:
        try:
            yield proc
        finally:
            if proc.poll() is None:
                if group:
                    os.killpg(proc.pid, signal.SIGKILL)
                else:
                    proc.kill()
                proc.wait()


def _signal_once_held(proc: subprocess.Popen, sig: int) -> None:
    """Send ``sig`` as soon as the process holds signals: while it is still importing and
    starting (``prefixroute.signals.hold`` is the first thing ``serve`` does; the
    server's own handlers come a few hundred milliseconds later). SIGTERM and SIGHUP are
    the marks (Python catches SIGINT from the start: KeyboardInterrupt): ``hold`` installs
    SIGTERM's handler first and SIGHUP's last, and a SIGHUP sent in between would get
    the default action (the process ends)."""
    deadline = time.monotonic() + 10
    while not (_caught(proc.pid, signal.SIGTERM) and _caught(proc.pid, signal.SIGHUP)):
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.001)
    proc.send_signal(sig)


@pytest.mark.parametrize("workers", [1, 2])
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_stop_signal_while_starting_stops_cleanly(tmp_path, workers, sig):
    """A SIGTERM or SIGINT before the server's handlers are in place is not the default
    action (killed, status -15; a KeyboardInterrupt traceback): the router stops as
    it would a moment later, status 0, without ever saying it listens."""
    cfg = tmp_path / "fleet.yaml"
    _write(cfg, "http://127.0.0.1:9", {"RoutingStrategy": "RANDOM"})
    with _serving(cfg, workers) as proc:
        _signal_once_held(proc, sig)
        assert proc.wait(timeout=30) == 0
        out, err = proc.communicate()
        assert "listening" not in out
        assert "Traceback" not in err and "KeyboardInterrupt" not in err


@pytest.mark.parametrize("workers", [1, 2])
def test_sighup_while_starting_reloads_once_serving(tmp_path, workers):
    """A SIGHUP while starting does not kill the router (status -1 before): it serves,
    with the configuration file as it is after the signal."""
    cfg = tmp_path / "fleet.yaml"
    _write(cfg, "http://127.0.0.1:9", {"RoutingStrategy": "RANDOM"})
    with _serving(cfg, workers) as proc:
        _write(cfg, "http://127.0.0.1:9", {"RoutingStrategy": "LEAST_OUTSTANDING_REQUESTS"})
        _signal_once_held(proc, signal.SIGHUP)
        assert proc.stdout is not None
        m = re.fullmatch(r"prefixroute-serve listening on (http://127\.0\.0\.1:\d+)\n", proc.stdout.readline())
        assert m
        admin = re.fullmatch(r"prefixroute-admin listening on (http://127\.0\.0\.1:\d+)\n",
                             proc.stdout.readline())
        assert admin
        status, doc = _get(admin.group(1) + "/admin/config")
        assert status == 200
        assert doc["Endpoints"][0]["ProductionVariants"][0]["RoutingConfig"]["RoutingStrategy"] == \
            "LEAST_OUTSTANDING_REQUESTS"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0


def test_second_stop_signal_while_starting_is_not_held(tmp_path):
    """A start stuck reading --config (a FIFO nobody writes) holds the first SIGTERM;
    the second gets the default action, so the router can still be stopped."""
    fifo = tmp_path / "fleet.yaml"
    os.mkfifo(fifo)
    with subprocess.Popen(_serve_cmd(fifo, 1), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as proc:
        try:
            _signal_once_held(proc, signal.SIGTERM)
            time.sleep(0.5)
            assert proc.poll() is None  # held: still (stuck) starting
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=10) == -signal.SIGTERM
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def _children(pid: int) -> dict[int, str]:
    """The child processes of ``pid``: pid -> command line."""
    out = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            if ppid == pid:
                with open(f"/proc/{d}/cmdline", "rb") as f:
                    out[int(d)] = f.read().replace(b"\0", b" ").decode(errors="replace")
        except (FileNotFoundError, ProcessLookupError, IndexError, ValueError):
            continue
    return out


def _group_signal_while_workers_start(proc: subprocess.Popen, sig: int) -> dict[int, str]:
    """Send ``sig`` to the router's whole process group (a Ctrl-C, a terminal's SIGHUP,
    a service manager stopping the group) once its first worker process exists, i.e.
    while that worker is still importing (a worker listens about a second later).
    Returns the router's children at that moment."""
    deadline = time.monotonic() + 20
    while True:
        kids = _children(proc.pid)
        if any("spawn_main" in c for c in kids.values()):
            break
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.002)
    os.killpg(proc.pid, sig)
    return kids


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_group_stop_signal_while_workers_start_stops_cleanly(tmp_path, sig):
    """A stop sent to the process group while --workers start reaches the starting
    workers too: the router stops, status 0, without restarting them (no "exited ...
    restarting" error) and without a traceback from a worker's start-up."""
    cfg = tmp_path / "fleet.yaml"
    _write(cfg, "http://127.0.0.1:9", {"RoutingStrategy": "RANDOM"})
    with _serving(cfg, 2, group=True) as proc:
        _group_signal_while_workers_start(proc, sig)
        assert proc.wait(timeout=30) == 0
        out, err = proc.communicate()
        assert "listening" not in out
        assert "restarting" not in err and "exited with status" not in err
        assert "Traceback" not in err and "KeyboardInterrupt" not in err


def test_group_sighup_while_workers_start_reloads_and_kills_nothing(tmp_path):
    """A SIGHUP to the process group while --workers start kills neither a starting
    worker (before: "worker 0 exited with status -1 before it was listening", status 1)
    nor multiprocessing's resource tracker (before: a KeyError and a warning at exit):
    the router serves with the configuration as it is after the signal, then stops
    cleanly."""
    cfg = tmp_path / "fleet.yaml"
    _write(cfg, "http://127.0.0.1:9", {"RoutingStrategy": "RANDOM"})
    with _serving(cfg, 2, group=True) as proc:
        _write(cfg, "http://127.0.0.1:9", {"RoutingStrategy": "LEAST_OUTSTANDING_REQUESTS"})
        kids = _group_signal_while_workers_start(proc, signal.SIGHUP)
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert re.fullmatch(r"prefixroute-serve listening on http://127\.0\.0\.1:\d+\n", line), line
        admin = re.fullmatch(r"prefixroute-admin listening on (http://127\.0\.0\.1:\d+)\n",
                             proc.stdout.readline())
        assert admin
        deadline = time.monotonic() + 10
        while True:  # each worker reloads once it listens
            status, doc = _get(admin.group(1) + "/admin/config")
            assert status == 200
            if doc["Endpoints"][0]["ProductionVariants"][0]["RoutingConfig"]["RoutingStrategy"] == \
                    "LEAST_OUTSTANDING_REQUESTS":
                break
            assert time.monotonic() < deadline
            time.sleep(0.05)
        trackers = [p for p, c in kids.items() if "resource_tracker" in c]
        assert trackers and all(p in _children(proc.pid) for p in trackers)  # still alive
        os.killpg(proc.pid, signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        err = proc.communicate()[1]
        assert "exited with status" not in err and "Traceback" not in err
        assert "KeyError" not in err and "resource_tracker" not in err


def test_sigusr1_to_the_supervisor_does_not_stop_the_router(tmp_path):
    """SIGUSR1 is how the supervisor tells a worker to reload: sent to the supervisor it
    is logged and does nothing (before: the default action killed it, leaving its
    workers and metrics directory); the router serves on and stops cleanly."""
    cfg = tmp_path / "fleet.yaml"
    _write(cfg, "http://127.0.0.1:9", {"RoutingStrategy": "RANDOM"})
    with _serving(cfg, 2, group=True) as proc:
        assert proc.stdout is not None and proc.stderr is not None
        lines = [proc.stdout.readline() for _ in range(2)]
        assert all("listening on" in line for line in lines), lines
        admin = lines[1].split("listening on ", 1)[1].strip()
        os.kill(proc.pid, signal.SIGUSR1)
        time.sleep(1.0)
        assert proc.poll() is None
        assert _get(admin + "/admin/config")[0] == 200  # the supervisor answers
        # To the group: the workers reload, the resource tracker (started with it
        # blocked) is not killed, so nothing is relaunched or reported leaking at exit.
        os.killpg(proc.pid, signal.SIGUSR1)
        time.sleep(1.0)
        assert _get(admin + "/admin/config")[0] == 200
        os.killpg(proc.pid, signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        err = proc.stderr.read()
    assert "SIGUSR1 to the supervisor does nothing" in err, err
    assert "leak" not in err and "Traceback" not in err and "relaunching" not in err, err
    assert not list(Path(tempfile.gettempdir()).glob(f"prefixroute-metrics-{proc.pid}-*"))


def test_a_group_sigusr1_while_the_workers_start_kills_none(tmp_path):
    """The supervisor starts its workers with SIGUSR1 blocked until they handle it: one
    sent to the process group while they start (before: the default action killed a
    starting worker, and the router exited 1) delays nothing."""
    cfg = tmp_path / "fleet.yaml"
    _write(cfg, "http://127.0.0.1:9", {"RoutingStrategy": "RANDOM"})
    with _serving(cfg, 2, group=True) as proc:
        assert proc.stdout is not None and proc.stderr is not None
        deadline = time.monotonic() + 30
        while len(_children(proc.pid)) < 3:  # the resource tracker and the two workers
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.002)
        os.killpg(proc.pid, signal.SIGUSR1)
        lines = [proc.stdout.readline() for _ in range(2)]
        assert all("listening on" in line for line in lines), (lines, proc.stderr.read() if proc.poll() else "")
        os.killpg(proc.pid, signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        err = proc.stderr.read()
    assert "exited with status" not in err and "Traceback" not in err and "leak" not in err, err


def test_group_sighup_reloads_each_worker_once(tmp_path):
    """A SIGHUP to the whole process group (a terminal's) reaches the supervisor and the
    workers: each worker reloads once (before: twice, on its own SIGHUP and on the one
    the supervisor forwarded), so an invalid file is reported once per worker."""
    cfg = tmp_path / "fleet.yaml"
    _write(cfg, "http://127.0.0.1:9", {"RoutingStrategy": "RANDOM"})
    with _serving(cfg, 2, group=True) as proc:
        assert proc.stdout is not None
        for _ in range(2):
            assert "listening on" in proc.stdout.readline()
        cfg.write_text("Endpoints: [")  # not YAML: each reload fails, and says so
        os.killpg(proc.pid, signal.SIGHUP)
        time.sleep(2.0)
        os.killpg(proc.pid, signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        err = proc.stderr.read()
    failed = [line for line in err.splitlines() if "configuration reload failed" in line]
    assert sorted(re.search(r"\[worker (\d)\]", line).group(1) for line in failed) == ["0", "1"], err


@pytest.mark.parametrize("flags", [["--strategy", "prefix-aware"], ["--prefix-length", "4096"],
                                   ["--concurrency-threshold", "8"], ["--variant-name", "V"],
                                   ["--endpoint-name", "e"], ["--load-weight", "2"]])
def test_flags_the_config_file_overrides_are_refused(tmp_path, capsys, flags):
    cfg = tmp_path / "fleet.yaml"
    _write(cfg, "http://127.0.0.1:9", {"RoutingStrategy": "RANDOM"})
    from prefixroute.server.cli import main

    assert main(["--config", str(cfg), *flags]) == 2
    err = capsys.readouterr().err
    assert f"error: {flags[0]} cannot be used with --config" in err


def test_a_wrong_flag_prints_the_subcommands_usage():
    for cmd in (["serve", "--bogus"], ["demo", "--nope"], ["emulate", "--backend", "x"]):
        out = subprocess.run([sys.executable, "-m", "prefixroute", *cmd], capture_output=True, text=True, timeout=60)
        assert out.returncode == 2
        assert out.stderr.startswith(f"usage: prefixroute {cmd[0]} "), out.stderr[:200]
        assert f"prefixroute {cmd[0]}: error: unrecognized arguments: {cmd[1]}" in out.stderr


def test_startup_summary_and_draining_text():
    from prefixroute.core.config import FleetConfig, RoutingConfig
    from prefixroute.server.settings import ServerSettings
    from prefixroute.server.summary import draining_message, startup_summary

    cfg = FleetConfig.single(["http://10.0.0.1:8001", "http://10.0.0.2:8001"],
                             RoutingConfig.build("prefix-aware", 4096, 12))
    status = {"router": {"health": {"status": "degraded", "message": "degraded: no healthy instance in x"}},
              "endpoints": [{"name": "default", "variants": [{"name": "AllTraffic", "instances": [
                  {"url": "http://10.0.0.1:8001", "state": "up"}, {"url": "http://10.0.0.2:8001", "state": "down"}]}]}]}
    text = startup_summary(cfg, ServerSettings(access_log="-", api_keys_file="k.yaml"), "http://0.0.0.0:8080",
                           "http://127.0.0.1:8081", status, "3 keys from k.yaml", 42)
    assert "serving on http://0.0.0.0:8080 (data plane fast)" in text
    assert "variant AllTraffic: PREFIX_AWARE PrefixLength=4096 ConcurrencyThreshold=12" in text
    assert "http://10.0.0.1:8001  up" in text and "http://10.0.0.2:8001  DOWN" in text
    assert "readiness (GET /health): degraded: no healthy instance in x" in text
    assert "client API keys: 3 keys from k.yaml" in text and "access log -" in text
    multi = FleetConfig.from_mapping({"Endpoints": [{
        "EndpointName": "llm", "ProductionVariants": [{"VariantName": "AllTraffic", "Instances": [
            "http://10.0.0.1:8001", "http://10.0.0.2:8001"], "RoutingConfig": {"RoutingStrategy": "RANDOM"}}],
        "InferenceComponents": [
            {"InferenceComponentName": "llama", "ModelName": "meta/llama", "Instances": "DISCOVER"},
            {"InferenceComponentName": "qwen", "Instances": ["http://10.0.0.2:8001"], "RoutingConfig": {
                "RoutingStrategy": "LEAST_OUTSTANDING_REQUESTS"}}],
        "LoraAdapters": {"Adapters": [{"LoraName": "sql", "LoraPath": "/a/sql"}]}}]})
    text = startup_summary(multi, ServerSettings(), "http://0.0.0.0:8080", None)
    assert "inference component llama: model meta/llama, copies: those whose /v1/models lists it, " \
           "its variant's routing" in text
    assert "inference component qwen: model qwen, 1 copy, LEAST_OUTSTANDING_REQUESTS (its own)" in text
    assert "LoRA adapters: sql; Autoload off (a saturated sticky set is a 429)" in text
    assert draining_message("SIGINT", 3, 30) == (
        "prefixroute: SIGINT received, stopping. new connections refused; waiting for 3 requests in flight to "
        "finish, at most 30 s (--shutdown-timeout). SIGINT again stops at once.")
