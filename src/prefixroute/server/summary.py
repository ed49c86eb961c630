"""What ``prefixroute serve`` tells the person who started it, on standard error.

* :func:`startup_summary`: once listening (and the first round of health checks is
  done), the listeners, each endpoint, production variant and instance with its health,
  the routing, and the settings that matter in the first hour;
* :func:`draining_message`: on SIGTERM/SIGINT, that it is draining, how many requests,
  for how long at most, and how to stop at once.

Pure functions of what they are given (the status page's document for health), so the
same text comes from one process and from the supervisor of ``--workers N``.
"""

from __future__ import annotations

from typing import Any

from prefixroute import __version__
from prefixroute.core.config import FleetConfig
from prefixroute.server.settings import ServerSettings

__all__ = ["startup_summary", "draining_message"]

#: Instances listed per variant; the rest are counted.
_INSTANCES_SHOWN = 12


def _size(n: int) -> str:
    for unit, factor in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= factor and n % factor == 0:
            return f"{n // factor} {unit}"
    return f"{n:,} bytes"


def _seconds(s: float) -> str:
    return f"{s:g} s"


def startup_summary(config: FleetConfig, settings: ServerSettings, url: str, admin_url: str | None,
                    status: dict[str, Any] | None = None, keys: str | None = None, pid: int | None = None) -> str:
    """The summary printed once ``prefixroute serve`` listens.

    Args:
        status: the status page's document (:func:`prefixroute.server.status.status_document`)
            for each instance's health, or ``None`` (health not shown).
        keys: how client API keys are configured (``"3 keys from keys.yaml"``), or ``None``.
        pid: the process a SIGHUP goes to.
    """
    s = settings
    lines = [f"prefixroute {__version__}: serving on {url} (data plane {s.data_plane}"
             + (f", {s.workers} workers" if s.workers > 1 else "") + ")"]
    if admin_url:
        lines.append(f"  admin API and live status page: {admin_url}/ (loopback only)"
                     if admin_url.startswith(("http://127.", "http://[::1]", "http://localhost"))
                     else f"  admin API and live status page: {admin_url}/ (admin token required)")
    else:
        lines.append("  admin API: off")
    health: dict[tuple[str, str, str], str] = {}
    if status is not None:
        for e in status.get("endpoints", ()):
            for v in e.get("variants", ()):
                for i in v.get("instances", ()):
                    health[(e["name"], v["name"], i["url"])] = i.get("state", "?")
    for j, e in enumerate(config.endpoints):
        paths = f"/endpoints/{e.name}/..." + (" and /v1/..., /invocations" if j == 0 else "")
        lines.append(f"  endpoint {e.name}: {paths}")
        for v in e.variants:
            routing = v.routing.to_api()
            settings_text = " ".join(f"{k}={val}" for sub in routing.values() if isinstance(sub, dict)
                                     for k, val in sub.items())
            weight = f", weight {v.weight:g}" if len(e.variants) > 1 else ""
            lines.append(f"    variant {v.name}: {v.routing.strategy.value}"
                         + (f" {settings_text}" if settings_text else "") + weight)
            for url_i in v.instances[:_INSTANCES_SHOWN]:
                state = health.get((e.name, v.name, url_i))
                shown = {"up": "up", "down": "DOWN (failed its health check)", "unchecked": "not checked yet"}.get(
                    state or "", state or "")
                lines.append(f"      {url_i}" + (f"  {shown}" if shown else ""))
            if len(v.instances) > _INSTANCES_SHOWN:
                lines.append(f"      ... and {len(v.instances) - _INSTANCES_SHOWN} more")
        for c in e.components:
            copies = "copies: those whose /v1/models lists it" if isinstance(c.instances, str) else \
                f"{len(c.instances)} {'copy' if len(c.instances) == 1 else 'copies'}"
            routing_c = f"{c.routing.strategy.value} (its own)" if c.routing is not None else "its variant's routing"
            lines.append(f"    inference component {c.name}: model {c.model_name}"
                         + (f" on variant {c.variant}" if c.variant else "") + f", {copies}, {routing_c}")
        lora = e.lora
        if lora.adapters or lora.autoload:
            names = ", ".join(a.name for a in lora.adapters[:_INSTANCES_SHOWN]) or "none declared"
            more = f" and {len(lora.adapters) - _INSTANCES_SHOWN} more" if len(lora.adapters) > _INSTANCES_SHOWN else ""
            lines.append(f"    LoRA adapters: {names}{more}; Autoload "
                         + ("on (a saturated or empty sticky set grows by a load)" if lora.autoload
                            else "off (a saturated sticky set is a 429)"))
    if s.health_check_interval_s > 0:
        lines.append(f"  health checks: GET {s.health_check_path} every {_seconds(s.health_check_interval_s)} "
                     f"(timeout {_seconds(s.health_check_timeout_s)}; out after {s.unhealthy_threshold} failures, "
                     f"back after {s.healthy_threshold} successes)")
    else:
        lines.append("  health checks: off (only a refused connection takes an instance out)")
    if status is not None:
        h = status.get("router", {}).get("health", {})
        if h:
            said = str(h.get("message", "")).removeprefix(f"{h.get('status')}: ")
            lines.append(f"  readiness (GET /health): {h.get('status')}" + (f": {said}" if h.get("status") != "ok"
                                                                           else ""))
    lines.append(f"  timeouts: connect {_seconds(s.connect_timeout_s)}, response headers "
                 f"{_seconds(s.response_headers_timeout_s)}, stream idle {_seconds(s.stream_idle_timeout_s)}; "
                 f"retries {s.max_retries}"
                 f"{' (and 429/503: ' + ','.join(map(str, sorted(s.retry_statuses))) + ')' if s.retry_statuses else ''}; "
                 f"client send {_seconds(s.client_send_timeout_s)}; upstream keep-alive {_seconds(s.keepalive_timeout_s)}; "
                 f"max body {_size(s.max_body_bytes)}; "
                 f"drain on stop {_seconds(s.shutdown_timeout_s)}")
    scrape = f"every {_seconds(s.metrics_scrape_interval_s)}" if s.metrics_scrape_interval_s > 0 else "off"
    lines.append(f"  engine /metrics scrape: {scrape}; client API keys: {keys or 'off (inference routes open)'}")
    outputs = [f"access log {s.access_log}" if s.access_log else "access log off",
               f"routing trace {s.record_trace}" if s.record_trace else "routing trace off",
               "OpenTelemetry spans on" if s.otel_traces else "OpenTelemetry off",
               "prompt text in DEBUG logs" if s.log_prompts else "no prompt text in logs"]
    lines.append("  " + "; ".join(outputs))
    if s.config_path:
        lines.append(f"  configuration: {s.config_path} (kill -HUP {pid if pid is not None else '<pid>'} "
                     "re-reads it)")
    lines.append("  Ctrl-C (SIGINT) or SIGTERM drains the requests in flight and stops")
    return "\n".join(lines)


def draining_message(signal_name: str, in_flight: int, timeout_s: float, workers: int = 1) -> str:
    """What is printed when a stop signal arrives."""
    who = f"{workers} workers: " if workers > 1 else ""
    busy = (f"{in_flight} request{'s' if in_flight != 1 else ''} in flight" if in_flight >= 0
            else "the requests in flight")
    return (f"prefixroute: {signal_name} received, stopping. {who}new connections refused; waiting for {busy} "
            f"to finish, at most {timeout_s:g} s (--shutdown-timeout). {signal_name} again stops at once.")
