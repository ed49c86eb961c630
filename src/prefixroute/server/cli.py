"""``prefixroute serve``: run the HTTP router.

The top-level CLI calls :func:`configure_parser` on the subcommand's parser and
:func:`run` with the parsed arguments. On startup exactly one line
``prefixroute-serve listening on http://HOST:PORT`` goes to stdout (a launcher reads the
port from it), then ``prefixroute-admin listening on http://HOST:PORT`` if the
admin API is on. Logs go to stderr.

Exit status: 0 after SIGTERM/SIGINT (requests in flight finish first, up to
``--shutdown-timeout``), 2 for a configuration error, 1 if the router cannot start.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from pathlib import Path
from typing import Any

from prefixroute.core.config import ConfigError, FleetConfig, RoutingConfig, RoutingStrategy
from prefixroute.server.runner import reload_logged, start_router
from prefixroute.server.settings import ServerSettings

__all__ = ["configure_parser", "run", "build_config", "build_settings"]

log = logging.getLogger("prefixroute.server")


def configure_parser(p: argparse.ArgumentParser) -> None:
    """Add the ``serve`` flags to ``p``."""
    g = p.add_argument_group("routing configuration (either --config or --backend)")
    g.add_argument("--config", metavar="PATH",
                   help="YAML fleet configuration ({Endpoints: [{EndpointName, ProductionVariants: [...]}]}); "
                        "SIGHUP re-reads it. Excludes --backend and the routing flags below.")
    g.add_argument("--backend", action="append", metavar="URL", default=[],
                   help="base URL of one engine instance, e.g. http://127.0.0.1:8001; repeat for each instance")
    g.add_argument("--strategy", default="random",
                   help="routing strategy of the variant: random, least-outstanding-requests or prefix-aware "
                        "(SageMaker spellings such as PREFIX_AWARE also work; default: random)")
    g.add_argument("--prefix-length", type=int, metavar="N",
                   help="PREFIX_AWARE PrefixLength, 1024-65536: how much of a request takes part in the routing "
                        "key (bytes of the raw body on /invocations, characters of the prompt text on the OpenAI "
                        "API); required with --strategy prefix-aware")
    g.add_argument("--concurrency-threshold", type=int, metavar="N",
                   help="PREFIX_AWARE ConcurrencyThreshold, 1-1024: requests in flight on the preferred instance "
                        "at which a new request overflows to the next instance; required with prefix-aware")
    g.add_argument("--endpoint-name", default="default",
                   help="endpoint name (the EndpointName of /endpoints/NAME/invocations; default: default)")
    g.add_argument("--variant-name", default="AllTraffic",
                   help="production variant name, returned in X-Amzn-Invoked-Production-Variant "
                        "(default: AllTraffic)")

    n = p.add_argument_group("listeners")
    n.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    n.add_argument("--port", type=int, default=8080,
                   help="port to listen on; 0 picks a free port, printed on stdout (default: 8080)")
    n.add_argument("--admin-host", default="127.0.0.1",
                   help="address of the admin API (default: 127.0.0.1); a non-loopback address needs "
                        "--admin-token")
    n.add_argument("--admin-port", type=int, default=None,
                   help="port of the admin API; 0 disables it (default: --port + 1, or a free port when "
                        "--port is 0)")
    n.add_argument("--admin-token", default=os.environ.get("PREFIXROUTE_ADMIN_TOKEN"),
                   help="bearer token the admin API requires (Authorization: Bearer TOKEN); default: "
                        "$PREFIXROUTE_ADMIN_TOKEN; none = no check (loopback only)")

    o = p.add_argument_group("health, shutdown, logging")
    o.add_argument("--health-check-interval", type=float, default=5.0, metavar="SECONDS",
                   help="seconds between health checks of every instance; 0 disables them (default: 5)")
    o.add_argument("--health-check-path", default="/health",
                   help="path probed with GET on each instance; 200 = healthy, checked with a 2 s timeout "
                        "(default: /health)")
    o.add_argument("--shutdown-timeout", type=float, default=30.0, metavar="SECONDS",
                   help="on SIGTERM/SIGINT, seconds requests in flight may take to finish (default: 30)")
    o.add_argument("--seed", type=int, default=None,
                   help="seed of the random choices (RANDOM routing, weighted variants, ties); default: random")
    o.add_argument("--log-level", default="warning", type=str.lower, choices=["debug", "info", "warning", "error"],
                   help="log level of stderr logs (default: warning)")
    o.add_argument("--log-prompts", action="store_true",
                   help="allow prompt text in DEBUG logs (default: off, prompts never reach the logs)")


def build_config(args: argparse.Namespace) -> FleetConfig:
    """The fleet configuration from ``--config`` or from ``--backend`` and the routing flags.

    Raises:
        ConfigError: conflicting or missing flags, an unreadable file, invalid values.
    """
    if args.config:
        if args.backend:
            raise ConfigError("use either --config or --backend, not both")
        try:
            text = Path(args.config).read_text(encoding="utf-8")
        except OSError as exc:
            raise ConfigError(f"cannot read configuration file {args.config}: {exc.strerror or exc}") from None
        return FleetConfig.from_yaml(text)
    if not args.backend:
        raise ConfigError("no instances: give --backend URL (repeatable) or --config PATH")
    routing = RoutingConfig.build(args.strategy, args.prefix_length, args.concurrency_threshold)
    return FleetConfig.single(args.backend, routing, endpoint=args.endpoint_name, variant=args.variant_name)


def build_settings(args: argparse.Namespace) -> ServerSettings:
    """The process settings from the flags. Raises ``ConfigError``."""
    return ServerSettings(
        host=args.host, port=args.port, admin_host=args.admin_host, admin_port=args.admin_port,
        admin_token=args.admin_token or None, health_check_interval_s=args.health_check_interval,
        health_check_path=args.health_check_path, shutdown_timeout_s=args.shutdown_timeout,
        seed=args.seed, log_prompts=args.log_prompts, config_path=args.config,
    )


async def _serve(config: FleetConfig, settings: ServerSettings) -> int:
    loop = asyncio.get_running_loop()
    try:
        handle = await start_router(config, settings)
    except OSError as exc:
        print(f"error: cannot listen on {settings.host}:{settings.port} or its admin port: {exc}", file=sys.stderr)
        return 1
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    loop.add_signal_handler(signal.SIGHUP, reload_logged, handle.state)
    print(f"prefixroute-serve listening on {handle.url}", flush=True)
    if handle.admin_url:
        print(f"prefixroute-admin listening on {handle.admin_url}", flush=True)
    try:
        await stop.wait()
        log.info("shutting down: waiting up to %.1f s for requests in flight", settings.shutdown_timeout_s)
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            loop.remove_signal_handler(sig)
        await handle.close()
    return 0


def _loop_factory() -> Any:
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


def run(args: argparse.Namespace) -> int:
    """Run the router until SIGTERM/SIGINT; returns the exit status."""
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = build_config(args)
        settings = build_settings(args)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    routing = config.endpoints[0].variants[0].routing
    if not args.config and routing.prefix_aware is not None and routing.strategy is not RoutingStrategy.PREFIX_AWARE:
        log.warning("--prefix-length/--concurrency-threshold are ignored with strategy %s", routing.strategy.value)
    with asyncio.Runner(loop_factory=_loop_factory()) as runner:
        return runner.run(_serve(config, settings))


def main(argv: list[str] | None = None) -> int:
    """Standalone entry: ``python -m prefixroute.server.cli --backend ...``."""
    parser = argparse.ArgumentParser(prog="prefixroute serve", description="Run the prefix-aware HTTP router.")
    configure_parser(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
