"""``prefixroute epp``: the endpoint picker behind Envoy (Gateway API Inference Extension).

Prints ``prefixroute-epp listening on HOST:PORT`` (gRPC) and
``prefixroute-epp-metrics listening on http://HOST:PORT`` on stdout once serving; logs
go to stderr. Exit status: 0 after SIGTERM/SIGINT (open streams get
``--shutdown-timeout`` seconds), 2 for a configuration error, 1 if it cannot start.

``--print-envoy-config`` prints an Envoy bootstrap for this picker and exits.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from prefixroute.core.config import ConfigError
from prefixroute.discovery.flags import configure_discovery_flags
from prefixroute.server.cli import add_routing_flags, build_config, parse_size
from prefixroute.server.settings import DEFAULT_MAX_BODY_BYTES, ServerSettings

if TYPE_CHECKING:
    from prefixroute.core.config import FleetConfig
    from prefixroute.epp.exchange import EppOptions
    from prefixroute.epp.server import EppHandle

__all__ = ["configure_parser", "run"]

log = logging.getLogger("prefixroute.epp")


def configure_parser(p: argparse.ArgumentParser) -> None:
    """Add the ``epp`` flags to ``p``."""
    p.description = ("Serve Envoy's ext_proc gRPC API as an Endpoint Picker (Gateway API Inference Extension): "
                     "each request's body is read, routed with the same key, strategy, ConcurrencyThreshold "
                     "overflow and in-flight accounting as `prefixroute serve`, and Envoy is told the instance "
                     "(header and envoy.lb metadata x-gateway-destination-endpoint). Needs the epp extra: "
                     "pip install 'prefixroute[epp]'. See README, 'Behind Envoy / Gateway API'.")
    add_routing_flags(p)
    configure_discovery_flags(p)
    g = p.add_argument_group("picker")
    g.add_argument("--host", default="127.0.0.1",
                   help="address of the gRPC listener Envoy connects to (default: 127.0.0.1; 0.0.0.0 in a pod)")
    g.add_argument("--port", type=int, default=9002,
                   help="gRPC port; 0 picks a free one, printed on stdout (default: 9002, the Inference "
                        "Extension's)")
    g.add_argument("--metrics-host", default="127.0.0.1",
                   help="address of the HTTP listener serving /metrics and /health (default: 127.0.0.1)")
    g.add_argument("--metrics-port", type=int, default=9090,
                   help="port of /metrics and /health; 0 picks a free one (default: 9090)")
    g.add_argument("--saturated", choices=("send", "reject"), default="send",
                   help="when every instance is at its ConcurrencyThreshold: 'send' to the least busy (as serve "
                        "does) or 'reject' with 429 at once (default: send)")
    g.add_argument("--max-body-size", type=parse_size, default=DEFAULT_MAX_BODY_BYTES, metavar="BYTES",
                   help="largest request body the picker buffers; larger ones get 413, as from serve "
                        "(default: 64MiB)")
    g.add_argument("--health-check-interval", type=float, default=5.0, metavar="SECONDS",
                   help="seconds between active health checks of every instance; 0 disables (default: 5)")
    g.add_argument("--health-check-path", default="/health",
                   help="path probed with GET on each instance (default: /health)")
    g.add_argument("--metrics-scrape-interval", type=float, default=10.0, metavar="SECONDS",
                   help="seconds between scrapes of the instances' /metrics (prefix-cache hit rate, queues); "
                        "0 disables (default: 10)")
    g.add_argument("--shutdown-timeout", type=float, default=10.0, metavar="SECONDS",
                   help="on SIGTERM/SIGINT, seconds open streams may take to end (default: 10)")
    g.add_argument("--seed", type=int, default=None, help="seed of the random choices (default: random)")
    g.add_argument("--log-level", default="warning", type=str.lower, choices=["debug", "info", "warning", "error"],
                   help="stderr log level (default: warning)")
    g.add_argument("--print-envoy-config", metavar="LISTEN_PORT", type=int, default=None,
                   help="print an Envoy bootstrap (YAML) listening on LISTEN_PORT with this picker, fail-closed "
                        "(--envoy-fail-open for fail-open), and exit; the instances are the --backend URLs")
    g.add_argument("--envoy-fail-open", action="store_true",
                   help="with --print-envoy-config: failure_mode_allow: true (the picker unreachable, requests go "
                        "round robin) instead of fail-closed (Envoy answers 500)")
    g.add_argument("--envoy-body-mode", choices=("buffered", "full-duplex"), default="buffered",
                   help="with --print-envoy-config: how Envoy sends bodies to the picker: buffered (the request "
                        "body whole, the response body only when the picker reframes it; the fewest messages) or "
                        "full-duplex (FULL_DUPLEX_STREAMED both ways, the Gateway API Inference Extension's "
                        "setting; the picker takes either) (default: buffered)")


def _settings(args: argparse.Namespace) -> ServerSettings:
    return ServerSettings(host=args.host, port=args.port, admin_port=0,
                          health_check_interval_s=args.health_check_interval, health_check_path=args.health_check_path,
                          max_body_bytes=args.max_body_size, metrics_scrape_interval_s=args.metrics_scrape_interval,
                          shutdown_timeout_s=args.shutdown_timeout, seed=args.seed, config_path=args.config)


def check_picker_config(config: "FleetConfig") -> None:
    """What a fleet configuration needs that only the picker asks: instances by IP
    address (Envoy's ``ORIGINAL_DST`` cluster takes ``ip:port`` from the header; DNS
    discovery resolves names to addresses) and no ``LoraAdapters.Autoload`` (loading
    adapters on the engines is ``serve``'s; the picker routes within the loaded sets).

    Raises:
        ConfigError: naming the instance or endpoint and what to do instead.
    """
    import ipaddress

    for e in config.endpoints:
        if e.lora.autoload:
            raise ConfigError(f"endpoint {e.name!r}: LoraAdapters.Autoload is acted on by `prefixroute serve` only "
                              "(it loads adapters on the engines); the picker routes within the sets already "
                              "loaded: set Autoload to false")
        urls = [u for v in e.variants for u in v.instances]
        urls += [u for c in e.components if not isinstance(c.instances, str) for u in c.instances]
        for url in urls:
            host = urlsplit(url).hostname or ""
            try:
                ipaddress.ip_address(host)
            except ValueError:
                raise ConfigError(f"instance {url}: Envoy's ORIGINAL_DST cluster routes to an IP address, not a "
                                  "host name: give the instance by its address (or use DNS discovery, which "
                                  "resolves names to addresses)") from None


def run(args: argparse.Namespace) -> int:
    """Run the picker until SIGTERM/SIGINT; returns the exit status."""
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = build_config(args)
        check_picker_config(config)
        settings = _settings(args)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        import grpc  # noqa: F401
        from envoy.service.ext_proc.v3 import external_processor_pb2  # noqa: F401
        from grpc_health.v1 import health  # noqa: F401
    except ImportError as exc:
        print(f"error: prefixroute epp needs the epp extra (pip install 'prefixroute[epp]'): {exc}", file=sys.stderr)
        return 2
    if args.print_envoy_config is not None:
        from prefixroute.epp.envoy_config import picker_bootstrap, to_yaml

        instances = []
        for url in args.backend:
            u = urlsplit(url)
            instances.append((u.hostname or "", u.port or 80))
        print(to_yaml(picker_bootstrap(args.print_envoy_config, (args.host if args.host != "0.0.0.0" else
                                                                  "127.0.0.1", args.port), instances,
                                       fail_open=args.envoy_fail_open, max_body_bytes=args.max_body_size,
                                       body_mode=args.envoy_body_mode)), end="")
        return 0
    from prefixroute.epp.exchange import EppOptions

    return asyncio.run(_serve(config, settings, EppOptions(saturated=args.saturated), args))


async def _serve(config: "FleetConfig", settings: ServerSettings, options: "EppOptions",
                 args: argparse.Namespace) -> int:
    from prefixroute.epp.server import start_epp

    try:
        handle = await start_epp(config, settings, options, metrics_host=args.metrics_host,
                                 metrics_port=args.metrics_port)
    except (OSError, RuntimeError) as exc:
        print(f"error: cannot start the picker: {exc}", file=sys.stderr)
        return 1
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    loop.add_signal_handler(signal.SIGHUP, _reload, handle)
    print(f"prefixroute-epp listening on {handle.address}", flush=True)
    if handle.metrics_url:
        print(f"prefixroute-epp-metrics listening on {handle.metrics_url}", flush=True)
    await stop.wait()
    log.info("shutting down: %d stream(s) open", handle.open_streams)
    await handle.close(settings.shutdown_timeout_s)
    return 0


def _reload(handle: "EppHandle") -> None:
    """SIGHUP: re-read --config, as serve does (an invalid file is logged and ignored)."""
    from prefixroute.server.runner import reload_logged

    reload_logged(handle.state)
