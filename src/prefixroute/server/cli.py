"""``prefixroute serve``: run the HTTP router.

The top-level CLI calls :func:`configure_parser` on the subcommand's parser and
:func:`run` with the parsed arguments. On startup exactly one line
``prefixroute-serve listening on http://HOST:PORT`` goes to stdout (a launcher reads the
port from it), then ``prefixroute-admin listening on http://HOST:PORT`` if the
admin API is on. Logs go to stderr.

Exit status: 0 after SIGTERM/SIGINT (requests in flight finish first, up to
``--shutdown-timeout``; a second SIGTERM/SIGINT cuts them at once), 2 for a
configuration error, 1 if the router cannot start.

``--workers N`` (N > 1) runs N router processes on the port under a supervisor
(:mod:`prefixroute.server.workers`); the lines printed and the exit statuses are the same.
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

from prefixroute.eventloop import loop_factory
from prefixroute import signals
from prefixroute.core.config import ConfigError, FleetConfig
from prefixroute.core.counters import MAX_WORKERS
from prefixroute.discovery.flags import configure_discovery_flags
from prefixroute.server.settings import DATA_PLANES
from prefixroute.server.runner import RouterHandle, reload_logged, start_router
from prefixroute.server import gc_tuning
from prefixroute.server.settings import DEFAULT_CLIENT_KEEPALIVE_S, DEFAULT_MAX_BODY_BYTES, ServerSettings
from prefixroute.server.summary import draining_message, startup_summary
from prefixroute.server.cli_config import build_config, kv_events_from_flags
# re-exported from their old home:
from prefixroute.server.cli_config import parse_adapter_flag, parse_component_flag, with_model_flags  # noqa: F401

__all__ = ["configure_parser", "run", "build_config", "build_settings", "parse_size", "parse_workers",
           "add_routing_flags", "kv_events_from_flags"]

log = logging.getLogger("prefixroute.server")

_SIZE_UNITS = {"": 1, "B": 1, "K": 1000, "KB": 1000, "KIB": 1024, "M": 1000**2, "MB": 1000**2, "MIB": 1024**2,
               "G": 1000**3, "GB": 1000**3, "GIB": 1024**3}


def parse_size(text: str) -> int:
    """Bytes from ``65536``, ``64MiB``, ``100MB``, ``1GiB`` (argparse type)."""
    t = text.strip().upper().replace(" ", "")
    digits = t.rstrip("KMGIB")
    unit = t[len(digits):]
    try:
        value = float(digits)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size (e.g. 67108864, 64MiB, 100MB)") from None
    if unit not in _SIZE_UNITS or value != value or value in (float("inf"), float("-inf")):
        raise argparse.ArgumentTypeError(f"{text!r} is not a size (e.g. 67108864, 64MiB, 100MB)")
    return int(value * _SIZE_UNITS[unit])


def _retry_statuses(text: str) -> frozenset[int]:
    """``--retry-status``: ``429``, ``503``, ``429,503`` or ``none`` (argparse type)."""
    from prefixroute.core.retry_status import parse_statuses

    try:
        return parse_statuses(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def parse_workers(text: str) -> int:
    """``--workers``: an integer from 1 to 64 (argparse type)."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of worker processes") from None
    if not 1 <= n <= MAX_WORKERS:
        raise argparse.ArgumentTypeError(f"{n} is out of range (allowed 1-{MAX_WORKERS}; about one per CPU core, "
                                         f"this machine has {os.cpu_count() or 'an unknown number of'})")
    return n


def configure_parser(p: argparse.ArgumentParser) -> None:
    """Add the ``serve`` flags to ``p``."""
    add_routing_flags(p)
    add_precise_flags(p)
    configure_discovery_flags(p)
    add_listener_flags(p)


def add_routing_flags(p: argparse.ArgumentParser) -> None:
    """The routing configuration flags (``--config``, ``--backend``, ``--strategy``...)
    that :func:`build_config` reads; ``prefixroute epp`` takes the same."""
    g = p.add_argument_group("routing configuration (either --config or --backend)")
    g.add_argument("--config", metavar="PATH",
                   help="YAML fleet configuration ({Endpoints: [{EndpointName, ProductionVariants: [...]}]}); "
                        "SIGHUP re-reads it. Excludes --backend and the routing flags below.")
    g.add_argument("--backend", action="append", metavar="URL", default=[],
                   help="base URL of one engine instance, e.g. http://127.0.0.1:8001; repeat for each instance")
    g.add_argument("--strategy", default=None,
                   help="routing strategy of the variant: random, least-outstanding-requests, prefix-aware or "
                        "cache-aware (SageMaker spellings such as PREFIX_AWARE also work; default: random)")
    g.add_argument("--prefix-length", type=int, metavar="N",
                   help="PREFIX_AWARE PrefixLength, 1024-65536: how much of a request takes part in the routing "
                        "key (bytes of the raw body on /invocations, characters of the prompt text on the OpenAI "
                        "API); required with --strategy prefix-aware")
    g.add_argument("--concurrency-threshold", type=int, metavar="N",
                   help="ConcurrencyThreshold, 1-1024: requests in flight on an instance at which a new request "
                        "overflows to another; required with prefix-aware and cache-aware")
    g.add_argument("--block-size", type=int, metavar="N",
                   help="CACHE_AWARE BlockSize, 16-4096: characters (OpenAI API) or bytes (native API) of routing "
                        "text per hashed block for the first 16 blocks; then blocks double every 16 "
                        "(default: 64, about one 16-token KV block)")
    g.add_argument("--max-prefix-length", type=int, metavar="N",
                   help="CACHE_AWARE MaxPrefixLength, 1024-1048576: how much routing text is hashed into blocks "
                        "(default: 131072)")
    g.add_argument("--instance-cache-tokens", type=int, metavar="N",
                   help="CACHE_AWARE InstanceCacheTokens: prompt tokens the router remembers per instance, "
                        "set near the engine's KV capacity; a view holds at most InstanceCacheTokens x 4 / BlockSize "
                        "blocks of about 210 bytes each (all views of the router together also stay under "
                        "--cache-aware-memory-mib) (default: 1200000)")
    g.add_argument("--load-weight", type=float, metavar="W",
                   help="CACHE_AWARE LoadWeight: blocks of prefill one more request in flight on an instance costs "
                        "a new request there (the decode share of the cost model); higher spreads load more, lower "
                        "chases cache hits (default: 0.5, the reference engine's ratio of a decoding sequence's "
                        "step time to a prefilled token's)")
    g.add_argument("--media-tokens", type=int, metavar="N",
                   help="CACHE_AWARE MediaTokens: prompt tokens one image, audio or file part of a chat request "
                        "stands for, so a repeated image keeps its instance (default: 576)")
    g.add_argument("--cpu-tier-tokens", type=int, metavar="N",
                   help="CACHE_AWARE KvTiers.CpuTierTokens: the engines have a CPU KV tier of N tokens each (vLLM "
                        "CPU offloading, LMCache); the learned view then remembers N tokens more per instance "
                        "(default: 0)")
    g.add_argument("--shared-tier", action="store_true", default=None,
                   help="CACHE_AWARE KvTiers.SharedTier: the engines share a KV tier (LMCache remote, a managed "
                        "tiered cache): a prefix any instance computed costs the others a load, not a prefill, so "
                        "a hot prefix is replicated more freely (tier costs: the emulated engine's, "
                        "core/tiers.py) (default: off)")
    g.add_argument("--native-key", choices=("raw-bytes", "canonical-json"), default=None,
                   help="what native (/invocations) requests are keyed on: the raw body's first PrefixLength bytes "
                        "(SageMaker's rule, the default), or a JSON body re-serialized canonically (sorted keys, no "
                        "whitespace, sampling fields left out) so clients that serialize the same prompt "
                        "differently share an instance")
    g.add_argument("--endpoint-name", default=None,
                   help="endpoint name (the EndpointName of /endpoints/NAME/invocations; default: default)")
    g.add_argument("--variant-name", default=None,
                   help="production variant name, returned in X-Amzn-Invoked-Production-Variant "
                        "(default: AllTraffic)")
    m = p.add_argument_group("several models on one endpoint (the --backend case; with --config, the YAML's "
                             "InferenceComponents and LoraAdapters)")
    m.add_argument("--inference-component", action="append", default=[], metavar="NAME[:MODEL]=URL,...|discover",
                   help="an inference component: requests naming NAME (X-Amzn-SageMaker-Inference-Component, "
                        "/endpoints/E/inference-components/NAME/..., or MODEL in an OpenAI body) go only to its "
                        "copies, the listed --backend URLs or, with 'discover', the backends whose /v1/models "
                        "lists MODEL (default: NAME); routed with the flags above, in-flight counts per copy; "
                        "repeatable")
    m.add_argument("--lora-adapter", action="append", default=[], metavar="NAME=PATH[@BASE_MODEL]",
                   help="a LoRA adapter the router may load (vLLM's lora_name=lora_path, on instances of "
                        "BASE_MODEL); repeatable")
    m.add_argument("--lora-autoload", action="store_true",
                   help="when an adapter's sticky set (the instances that have it loaded) is saturated or empty, "
                        "load it on the least loaded instance of its base model with a free adapter slot (or a copy "
                        "of another adapter to unload: one idle for --lora-idle-seconds; for an adapter loaded "
                        "nowhere also a spare copy with nothing in flight; a saturated set that cannot grow queues "
                        "within itself, an adapter loaded nowhere gets 429), logging and counting every load and "
                        "unload; --workers 1 only (default: off: a saturated set gets 429 with Retry-After)")
    m.add_argument("--lora-max-adapters", type=int, metavar="N", default=None,
                   help="adapter slots of an instance whose engine does not report vLLM's max_lora "
                        "(default: unbounded)")
    m.add_argument("--lora-retry-after", type=int, metavar="SECONDS", default=None,
                   help="Retry-After of the 429 for a saturated sticky set (default: 1)")
    m.add_argument("--lora-idle-seconds", type=float, metavar="SECONDS", default=None,
                   help="with --lora-autoload, how long a copy of an adapter must have had no request before it "
                        "may be unloaded to make room, 0.1-86400 (default: 60, the load timeout)")



def add_precise_flags(p: argparse.ArgumentParser) -> None:
    """``serve``'s precise-mode flags (the instances' KV events)."""
    k = p.add_argument_group(
        "precise mode: the instances' KV events (vLLM --kv-events-config; with --config, the YAML's KvEvents "
        "section instead; needs the precise extra)")
    k.add_argument("--kv-events-endpoint", action="append", default=[], metavar="URL=ENDPOINT[,REPLAY]",
                   help="where one instance publishes its KV events, e.g. "
                        "http://10.0.0.5:8000=tcp://10.0.0.5:5557,tcp://10.0.0.5:5558 (the second endpoint: its "
                        "replay socket, optional); repeat per instance")
    k.add_argument("--kv-events-template", metavar="TEMPLATE",
                   help="the endpoint of every instance not given by --kv-events-endpoint, from its URL's {host} "
                        "and {port}, e.g. tcp://{host}:5557 (vLLM's default port on each engine host)")
    k.add_argument("--kv-events-replay-template", metavar="TEMPLATE",
                   help="the replay endpoint likewise, e.g. tcp://{host}:5558 (default: no replay: a gap in the "
                        "events resets the instance's state)")
    k.add_argument("--kv-events-from-info", action="store_true",
                   help="ask each instance's GET /info for its endpoints (prefixroute emulate answers it)")
    k.add_argument("--kv-block-size", type=int, metavar="N",
                   help="the engines' KV block size in tokens (vLLM: 16 on CUDA by default) (default: 16)")
    k.add_argument("--tokenizer", metavar="SPEC",
                   help="the engines' model tokenizer, so CACHE_AWARE matches requests against what the events "
                        "report: tiny (bundled, as `prefixroute emulate --tokenizer tiny`), a model directory "
                        "holding tokenizer.json and tokenizer_config.json, or a tokenizer.json (default: none: the "
                        "events are followed but routing stays on the learned view)")
    k.add_argument("--chat-template", metavar="PATH",
                   help="a Jinja chat template file replacing the tokenizer's (as vLLM's --chat-template)")
    k.add_argument("--kv-match", choices=("bytes", "tokens"),
                   help="how a request is matched against the blocks the events report: bytes (its prompt's "
                        "bytes against the blocks' tokens rendered back to text: no request is tokenized; needs a "
                        "byte-level BPE tokenizer, checked at start, else tokens) or tokens (each request is "
                        "tokenized) (default: bytes)")


def add_listener_flags(p: argparse.ArgumentParser) -> None:
    """``serve``'s listener, health, timeout, limit and logging flags."""
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
    n.add_argument("--admin-token", default=None,
                   help="bearer token the admin API requires (Authorization: Bearer TOKEN). A flag's value is "
                        "visible to every user in `ps`: prefer the PREFIXROUTE_ADMIN_TOKEN environment variable "
                        "(the default) or --admin-token-file; with no token set the admin API checks none and "
                        "must listen on loopback")
    n.add_argument("--admin-token-file", metavar="PATH", default=None,
                   help="read the admin bearer token from this file (its first line; keep it mode 0600)")
    n.add_argument("--workers", type=parse_workers, default=1, metavar="N",
                   help=f"router processes, 1-{MAX_WORKERS} (default: 1). With N > 1 a supervisor starts N worker "
                        "processes listening on the same port (SO_REUSEPORT: the kernel spreads connections); "
                        "they share their in-flight counts, so --concurrency-threshold and least-outstanding stay "
                        "exact (a threshold can be exceeded by at most N - 1). Use up to one per CPU core. The "
                        "admin API, SIGHUP and /metrics cover every worker; a worker that dies is restarted. "
                        "See docs/WORKERS.md")
    n.add_argument("--worker-timeout", type=float, default=60.0, metavar="SECONDS",
                   help="with --workers N > 1: a worker that answers none of the supervisor's probes (one every "
                        "quarter of this) for this long, its event loop blocked or the process stopped, is killed "
                        "and restarted, so that its share of new connections does not hang; 0 disables "
                        "(default: 60)")
    n.add_argument("--data-plane", choices=DATA_PLANES, default="fast",
                   help="how the public port is served: 'fast' (default) relays inference requests on raw "
                        "asyncio protocols with httptools and passes everything else to the aiohttp app; "
                        "'aiohttp' lets the aiohttp app serve everything (the same routing, errors and metrics, "
                        "about twice the CPU per request; HTTP-level differences in docs/RELIABILITY.md). See "
                        "docs/PERFORMANCE.md")

    o = p.add_argument_group("health, timeouts, limits, shutdown, logging")
    o.add_argument("--health-check-interval", type=float, default=5.0, metavar="SECONDS",
                   help="seconds between active health checks of every instance, the first round at start; "
                        "0 disables them (default: 5)")
    o.add_argument("--health-check-path", default="/health",
                   help="path probed with GET on each instance; 2xx = healthy: /health for vLLM and SGLang, "
                        "/ping for SageMaker containers (default: /health)")
    o.add_argument("--health-check-timeout", type=float, default=2.0, metavar="SECONDS",
                   help="timeout of one health check (default: 2)")
    o.add_argument("--unhealthy-threshold", type=int, default=2, metavar="N",
                   help="consecutive failures (failed checks, or timeouts and resets of real requests) that take "
                        "an instance out of rotation; a refused connection takes it out at once (default: 2)")
    o.add_argument("--healthy-threshold", type=int, default=2, metavar="N",
                   help="consecutive successful checks that put an instance back in rotation (default: 2)")
    o.add_argument("--connect-timeout", type=float, default=5.0, metavar="SECONDS",
                   help="timeout of opening a connection to an instance; the request then goes to another "
                        "instance (default: 5)")
    o.add_argument("--response-headers-timeout", type=float, default=600.0, metavar="SECONDS",
                   help="longest wait for an instance's response headers after sending a request; a "
                        "non-streaming generation answers only when done, so this bounds it; 504 after it "
                        "(default: 600)")
    o.add_argument("--stream-idle-timeout", type=float, default=300.0, metavar="SECONDS",
                   help="longest silence between two chunks of a response; there is no total timeout, a stream "
                        "lasts as long as tokens flow (default: 300)")
    o.add_argument("--max-retries", type=int, default=2, metavar="N",
                   help="most retries, only when the instance cannot have started the request (connection "
                        "refused, request not sent in full: on another instance; a kept-alive connection the engine "
                        "closed as the request went out: once on a new one) or, with --retry-status, answered "
                        "429/503 (default: 2)")
    o.add_argument("--retry-status", type=_retry_statuses, default=frozenset(), metavar="CODES",
                   help="retry an instance's 429 and/or 503 answer (e.g. 429,503) on an instance not tried yet, "
                        "while nothing of it has reached the client and --max-retries allows; the instance is "
                        "held back from new requests for its Retry-After (at most 30 s, 1 s without one); with "
                        "no other instance left the answer is relayed ('none' or '': off, the default: every "
                        "answer is relayed, as SageMaker does)")
    o.add_argument("--upstream-keepalive-timeout", type=float, default=4.0, metavar="SECONDS",
                   help="seconds an idle pooled connection to an instance is kept for reuse; keep it below the "
                        "engine's own idle timeout (uvicorn, in front of vLLM and SGLang: 5 s), or a request may "
                        "meet a connection the engine is closing (the router then retries it once on a new "
                        "connection) (default: 4)")
    o.add_argument("--client-send-timeout", type=float, default=60.0, metavar="SECONDS",
                   help="longest a client may leave an answer unread (a stream it stopped reading): then its "
                        "connection is closed, the instance's request aborted and the slot freed (default: 60)")
    o.add_argument("--max-body-size", type=parse_size, default=DEFAULT_MAX_BODY_BYTES, metavar="BYTES",
                   help="largest request body; larger ones get 413 and are not sent upstream, e.g. 128MiB "
                        "(default: 64MiB, room for long contexts and inline images)")
    o.add_argument("--metrics-scrape-interval", type=float, default=10.0, metavar="SECONDS",
                   help="seconds between scrapes of every instance's /metrics (prefix-cache hit rate, requests "
                        "running/waiting, exported as prefixroute_backend_*); 0 disables (default: 10)")
    o.add_argument("--metrics-scrape-timeout", type=float, default=2.0, metavar="SECONDS",
                   help="longest one scrape of an instance's /metrics may take, page read whole; a scrape that "
                        "takes longer fails and the last values are kept (default: 2)")
    o.add_argument("--client-keepalive-timeout", type=float, default=DEFAULT_CLIENT_KEEPALIVE_S,
                   metavar="SECONDS",
                   help="seconds an idle client connection is kept open, and a request that stops arriving "
                        "part-way is waited for (then 408 and the connection closed); behind a load balancer, set "
                        "it above the balancer's idle timeout (e.g. 60 s for AWS ALB, 600 s for Google Cloud's) so "
                        "that the balancer never reuses a connection the router is closing (default: 75)")
    o.add_argument("--shutdown-timeout", type=float, default=30.0, metavar="SECONDS",
                   help="on SIGTERM/SIGINT, seconds requests in flight may take to finish; a second signal "
                        "cuts them at once (default: 30)")
    o.add_argument("--seed", type=int, default=None,
                   help="seed of the random choices (RANDOM routing, weighted variants, ties); default: random")
    o.add_argument("--log-level", default="info", type=str.lower, choices=["debug", "info", "warning", "error"],
                   help="log level of stderr logs: info shows health changes, reloads and what they changed, "
                        "startup and shutdown; a request is logged only when the router refuses it or retries a "
                        "429/503 (at most 10 lines a second), all of them with --access-log (default: info)")
    o.add_argument("--log-prompts", action="store_true",
                   help="allow prompt text (the first 512 bytes of a request body, every API) in DEBUG logs "
                        "(default: off, prompts never reach the logs)")
    o.add_argument("--unknown-model", choices=("reject", "any"), default="reject",
                   help="an OpenAI request whose model no instance lists in its /v1/models: 'reject' with 404 "
                        "model_not_found, or route it among 'any' instance (for engines that serve any model "
                        "name, e.g. SGLang or TGI with one model) (default: reject)")
    o.add_argument("--session-header", metavar="NAME",
                   help="a request header whose value pins a session to one instance, e.g. X-Session-ID for "
                        "OpenAI clients (X-Amzn-SageMaker-Session-Id is always honoured): the session's requests go "
                        "to its instance while it is healthy and below ConcurrencyThreshold, and every router "
                        "replica agrees (default: none)")
    o.add_argument("--cache-aware-memory-mib", type=float, default=None, metavar="MIB",
                   help="ceiling on the memory of all CACHE_AWARE views of cached prefixes in this router process, "
                        "MiB: each view holds at most an equal share, as well as its own InstanceCacheTokens "
                        "(default: 512; per worker with --workers)")
    o.add_argument("--record-trace", metavar="PATH",
                   help="append one JSONL line per routed request to PATH as it ends (time, instance, decision, "
                        "length and digests of 64-character blocks of the routing text, never the text; about "
                        "0.17 bytes per character of routing text) for `prefixroute tune --trace PATH`")
    o.add_argument("--access-log", metavar="PATH",
                   help="append one JSON line per request to PATH ('-': standard output) as it ends: request "
                        "id, trace id, endpoint, variant, instance, decision, key digest, status, TTFT, duration, "
                        "bytes in and out, retries; never prompt text (docs/OPERATIONS.md)")
    o.add_argument("--api-keys-file", metavar="PATH",
                   help="YAML file of client API keys (Authorization: Bearer or x-api-key) with per-key and "
                        "per-tenant limits on requests per second and concurrent requests (429 over them); "
                        "re-read on SIGHUP. Keys may also come from $PREFIXROUTE_API_KEYS (name:key,...). "
                        "Without either the inference routes are open (docs/OPERATIONS.md)")
    o.add_argument("--otel-traces", action="store_true",
                   help="export OpenTelemetry spans of each request (route decision, upstream, first byte) over "
                        "OTLP/HTTP, configured by the standard OTEL_* environment variables "
                        "(OTEL_EXPORTER_OTLP_ENDPOINT...); needs the otel extra (default: off)")


def admin_token(args: argparse.Namespace) -> str | None:
    """The admin token: ``--admin-token-file``, else ``--admin-token``, else
    ``$PREFIXROUTE_ADMIN_TOKEN``, else none.

    Raises:
        ConfigError: both flags given, or the file cannot be read or is empty.
    """
    path = getattr(args, "admin_token_file", None)
    if path:
        if args.admin_token:
            raise ConfigError("use either --admin-token or --admin-token-file, not both")
        try:
            lines = Path(path).read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"cannot read admin token file {path}: {getattr(exc, 'strerror', None) or exc}") \
                from None
        token = lines[0].strip() if lines else ""
        if not token:
            raise ConfigError(f"admin token file {path} is empty")
        return token
    return args.admin_token or os.environ.get("PREFIXROUTE_ADMIN_TOKEN") or None


def _mib(value: float, flag: str) -> int:
    """``value`` MiB as bytes. Raises ``ConfigError`` for a value that is not positive and finite."""
    if not (value == value and 0 < value < float("inf")):
        raise ConfigError(f"{flag}: {value!r} must be a positive number of MiB")
    return int(value * 1024 * 1024)


def build_settings(args: argparse.Namespace) -> ServerSettings:
    """The process settings from the flags. Raises ``ConfigError``."""
    return ServerSettings(
        host=args.host, port=args.port, admin_host=args.admin_host, admin_port=args.admin_port,
        admin_token=admin_token(args), health_check_interval_s=args.health_check_interval,
        health_check_path=args.health_check_path, health_check_timeout_s=args.health_check_timeout,
        unhealthy_threshold=args.unhealthy_threshold, healthy_threshold=args.healthy_threshold,
        connect_timeout_s=args.connect_timeout, response_headers_timeout_s=args.response_headers_timeout,
        stream_idle_timeout_s=args.stream_idle_timeout, max_retries=args.max_retries,
        retry_statuses=getattr(args, "retry_status", frozenset()),
        keepalive_timeout_s=getattr(args, "upstream_keepalive_timeout", 4.0),
        client_send_timeout_s=getattr(args, "client_send_timeout", 60.0),
        max_body_bytes=args.max_body_size, metrics_scrape_interval_s=args.metrics_scrape_interval,
        metrics_scrape_timeout_s=getattr(args, "metrics_scrape_timeout", 2.0),
        client_keepalive_timeout_s=getattr(args, "client_keepalive_timeout", DEFAULT_CLIENT_KEEPALIVE_S),
        shutdown_timeout_s=args.shutdown_timeout, seed=args.seed, log_prompts=args.log_prompts,
        session_header=getattr(args, "session_header", None), unknown_model=getattr(args, "unknown_model", "reject"),
        **({} if getattr(args, "cache_aware_memory_mib", None) is None
           else {"cache_aware_memory_bytes": _mib(args.cache_aware_memory_mib, "--cache-aware-memory-mib")}),
        config_path=args.config, record_trace=args.record_trace, access_log=getattr(args, "access_log", None),
        otel_traces=getattr(args, "otel_traces", False), api_keys_file=getattr(args, "api_keys_file", None),
        workers=getattr(args, "workers", 1),
        worker_timeout_s=getattr(args, "worker_timeout", 60.0), data_plane=getattr(args, "data_plane", "fast"),
    )


async def _serve(config: FleetConfig, settings: ServerSettings) -> int:
    loop = asyncio.get_running_loop()
    try:
        handle = await start_router(config, settings)
    except OSError as exc:
        print(f"error: cannot listen on {settings.host}:{settings.port} or its admin port: {exc}", file=sys.stderr)
        return 1
    stop = asyncio.Event()
    stopped_by = [int(signal.SIGTERM)]

    def on_stop(signum: int = signal.SIGTERM) -> None:
        if stop.is_set():  # a second one (dispatched with the first, from one read of the loop)
            _hurry(loop, handle, signum)
            return
        stopped_by[0] = signum
        stop.set()
        for sig in _STOPS:  # from now on a second one does not wait for the drain
            loop.add_signal_handler(sig, _hurry, loop, handle, sig)

    for sig in _STOPS:
        loop.add_signal_handler(sig, on_stop, sig)
    loop.add_signal_handler(signal.SIGHUP, reload_logged, handle.state)
    held = signals.take()  # what came while starting (prefixroute.signals.hold)
    if signal.SIGHUP in held:
        reload_logged(handle.state)
    if held & set(_STOPS):
        on_stop()  # told to stop while starting: it never served
    else:
        gc_tuning.tune()
        print(f"prefixroute-serve listening on {handle.url}", flush=True)
        if handle.admin_url:
            print(f"prefixroute-admin listening on {handle.admin_url}", flush=True)
        await _print_summary(handle, config, settings, stop)
    try:
        await stop.wait()
        busy = sum(pool.total_in_flight() for _, pool in handle.fleet.all_pools())
        print(draining_message(signal.Signals(stopped_by[0]).name, busy, settings.shutdown_timeout_s),
              file=sys.stderr, flush=True)
    finally:
        signals.replace(loop, (signal.SIGHUP,), signal.SIG_IGN)  # draining: a SIGHUP no longer kills it
        if not stop.is_set():
            on_stop()
        try:
            await handle.close()
        finally:
            # Closed: what is left is the interpreter's exit, which a signal must not
            # turn into a -15, or a KeyboardInterrupt traceback.
            signals.replace(loop, _STOPS, signal.SIG_IGN)
    return 0


_STOPS = (signal.SIGTERM, signal.SIGINT)


def keys_description(settings: ServerSettings, state: Any) -> str | None:
    """How client API keys are set up, for the startup summary (names and counts only)."""
    clients = getattr(state, "clients", None)
    if clients is None:
        return None
    n = len(clients.config.keys)
    where = f"from {settings.api_keys_file}" if settings.api_keys_file else "from $PREFIXROUTE_API_KEYS"
    return f"{n} key{'s' if n != 1 else ''} {where}" + (
        f", {len(clients.config.tenants)} tenant limit(s)" if clients.config.tenants else "")


async def _print_summary(handle: RouterHandle, config: FleetConfig, settings: ServerSettings,
                         stop: asyncio.Event) -> None:
    """The startup summary on stderr, once the first round of health checks has told
    each instance's health (at most a check timeout and a second later)."""
    from prefixroute.server.status import status_document

    if settings.health_check_interval_s > 0:
        deadline = asyncio.get_running_loop().time() + settings.health_check_timeout_s + 1.0
        while handle.state.health.rounds == 0 and not stop.is_set() and \
                asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.02)
    status = status_document(handle.state)
    print(startup_summary(handle.state.config, settings, handle.url, handle.admin_url, status,
                          keys_description(settings, handle.state), os.getpid()), file=sys.stderr, flush=True)


def _hurry(loop: asyncio.AbstractEventLoop, handle: RouterHandle, signum: int) -> None:
    """A second SIGTERM/SIGINT while draining: the requests still in flight are cut
    (their connections closed) and the router exits as at ``--shutdown-timeout``
    (status 0, internal socket removed). A third one gets the default action."""
    busy = sum(pool.total_in_flight() for _, pool in handle.fleet.all_pools())
    log.warning("%s again: not waiting for the %d request(s) at the instances", signal.Signals(signum).name, busy)
    signals.replace(loop, _STOPS, signal.SIG_DFL)
    handle.hurry()


def check_outputs(settings: ServerSettings) -> None:
    """Fail early, with a message naming the flag, when a file the router will write
    cannot be opened, the API keys are invalid or ``--otel-traces`` lacks its extra.

    Raises:
        ConfigError: what is wrong.
    """
    for flag, path in (("--access-log", settings.access_log), ("--record-trace", settings.record_trace)):
        if path is None or path == "-":
            continue
        try:
            with open(path, "ab"):
                pass
        except OSError as exc:
            raise ConfigError(f"{flag} {path}: cannot open it for appending ({exc.strerror or exc})") from None
    from prefixroute.server.clientkeys import load_keys

    load_keys(settings.api_keys_file)  # ConfigError naming the file, line or field
    if settings.otel_traces:
        from prefixroute.server.otel import OtelUnavailable, check_available

        try:
            check_available()
        except OtelUnavailable as exc:
            raise ConfigError(str(exc)) from None


def run(args: argparse.Namespace) -> int:
    """Run the router until SIGTERM/SIGINT; returns the exit status."""
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = build_config(args)
        settings = build_settings(args)
        if config.kv_events is not None:
            try:
                import msgpack  # noqa: F401
                import zmq  # noqa: F401
            except ImportError:
                raise ConfigError("precise mode (KvEvents) needs pyzmq and msgpack: "
                                  "pip install 'prefixroute[precise]'") from None
        check_outputs(settings)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if settings.workers > 1:
        if any(v.discovery is not None for e in config.endpoints for v in e.variants):
            print("error: discovery (Discovery:, --dns, --k8s-...) runs in one router process; use --workers 1 "
                  "and more router replicas", file=sys.stderr)
            return 2
        if any(e.lora.autoload for e in config.endpoints):
            print("error: LoraAdapters.Autoload (--lora-autoload) runs in one router process: its unloads must see "
                  "every request in flight for an adapter; use --workers 1", file=sys.stderr)
            return 2
        from prefixroute.server.workers import serve_workers

        return serve_workers(config, settings, args.log_level)
    with asyncio.Runner(loop_factory=loop_factory()) as runner:
        return runner.run(_serve(config, settings))


def main(argv: list[str] | None = None) -> int:
    """Standalone entry: ``python -m prefixroute.server.cli --backend ...``."""
    signals.hold()
    parser = argparse.ArgumentParser(prog="prefixroute serve", description="Run the prefix-aware HTTP router.")
    configure_parser(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
