"""``prefixroute emulate``: run one emulated vLLM instance (no GPU needed).

The lead's top-level CLI calls :func:`configure_parser` on the subcommand's parser and
:func:`run` with the parsed arguments. On startup one line goes to stdout::

    prefixroute-emulate listening on http://HOST:PORT

so a launcher can read the port (useful with ``--port 0``). SIGTERM and SIGINT stop
the server cleanly (open requests get a few seconds, then are aborted).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import math
import os
import signal
import sys

from prefixroute.eventloop import loop_factory
from prefixroute.core.kvevents.codec import ENCODINGS
from prefixroute.core.model_tokenizer import ModelTokenizer, load_tokenizer
from prefixroute.engine.kv_publisher import KvEventsSettings
from prefixroute.engine.shared_tier_file import FileSharedTier
from prefixroute.engine.model import DEFAULT_MODEL, EngineConfig
from prefixroute.engine.server import start_engine_server

__all__ = ["configure_parser", "run", "config_from_args", "kv_events_from_args", "lora_from_args"]

_DEFAULTS = EngineConfig()


#: Engine flags: (flag, type, unit and meaning). Unset flags keep EngineConfig's default.
_ENGINE_FLAGS: tuple[tuple[str, type, str], ...] = (
    ("--kv-capacity-tokens", int, "KV cache size in tokens, shared by running and cached blocks"),
    ("--max-num-seqs", int, "most requests running (admitted) at once"),
    ("--max-num-batched-tokens", int, "token budget per step: prefill chunks plus one token per decode"),
    ("--block-size", int, "tokens per KV block, the prefix-cache granularity"),
    ("--prefill-s-per-token", float, "modelled seconds per prompt token prefilled"),
    ("--decode-s-per-seq", float, "modelled seconds per sequence decoding one token in a step"),
    ("--step-overhead-s", float, "modelled fixed seconds per step"),
    ("--max-model-len", int, "most tokens (prompt + output) per request; longer ones get 400"),
    ("--image-tokens", int, "prompt tokens each image (audio, file) part of a chat request is prefilled as"),
    ("--cpu-tier-tokens", int, "a CPU (host-memory) KV tier of this many tokens: blocks evicted from the GPU go "
                               "there and load back at --cpu-load-s-per-token; 0: none"),
    ("--cpu-load-s-per-token", float, "modelled seconds per token loaded from the CPU tier"),
    ("--shared-load-s-per-token", float, "modelled seconds per token loaded from the shared tier"),
    ("--shared-load-latency-s", float, "modelled seconds added per request loading from the shared tier"),
    ("--lora-load-s", float, "modelled seconds one LoRA adapter takes to load (/v1/load_lora_adapter)"),
)


def configure_parser(p: argparse.ArgumentParser) -> None:
    """Add the ``emulate`` flags to ``p`` (defaults: Llama-3.1-70B on 8×H100, see
    :mod:`prefixroute.engine.model`)."""
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    p.add_argument(
        "--port", type=int, default=8000, help="TCP port; 0 picks a free port and prints it (default: %(default)s)"
    )
    p.add_argument(
        "--model", default=DEFAULT_MODEL, help="served model name, in /v1/models and metrics (default: %(default)s)"
    )
    p.add_argument(
        "--served-model-name", nargs="+", default=None, metavar="NAME",
        help="names the model answers to, as vLLM's flag: the first replaces --model in answers and metrics, all "
        "are listed in /v1/models and accepted in 'model' (default: --model)",
    )
    p.add_argument(
        "--enable-lora", action="store_true",
        help="serve LoRA adapters (vLLM's flag): requests name an adapter in 'model'; its prefix-cache blocks are "
        "its own",
    )
    p.add_argument(
        "--max-loras", type=int, default=None, metavar="N",
        help="adapter slots: the most adapters in one batch (vLLM's flag; reported as max_lora in "
        "vllm:lora_requests_info); a request whose adapter finds every slot taken waits (default with "
        "--enable-lora: 1)",
    )
    p.add_argument(
        "--lora-modules", nargs="+", default=[], metavar="NAME=PATH",
        help="LoRA adapters loaded at start (vLLM's flag; the path is not read: the emulator has no weights): a "
        "request naming one in 'model' runs on it, its KV blocks the adapter's own (their KV events name it); "
        "needs --enable-lora",
    )
    p.add_argument(
        "--allow-runtime-lora-updating", action="store_true",
        help="serve /v1/load_lora_adapter and /v1/unload_lora_adapter, as vLLM does with "
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True (which is honoured too); needs --enable-lora",
    )
    p.add_argument(
        "--embedding-dim", type=int, default=16, metavar="N",
        help="length of the vectors /v1/embeddings answers with (default: %(default)s)",
    )
    p.add_argument(
        "--instance-id", default=None, help="name sent in the X-Emulated-Instance header and /info (default: random)"
    )
    p.add_argument(
        "--time-scale",
        type=float,
        default=1.0,
        help="wall-clock seconds per modelled second: 1.0 real time, 0.1 ten times faster, "
        "0 no sleeping at all (default: %(default)s)",
    )
    for flag, kind, meaning in _ENGINE_FLAGS:
        default = getattr(_DEFAULTS, flag[2:].replace("-", "_"))
        p.add_argument(flag, type=kind, default=None, help=f"{meaning} (default: {default})")
    p.add_argument(
        "--tokenizer",
        default=None,
        metavar="NAME|PATH",
        help="tokenize with a model's own tokenizer and chat template, as vLLM does: 'tiny' (bundled, 810 "
        "tokens) or a model directory with tokenizer.json and tokenizer_config.json (needs the precise extra). "
        "Default: the built-in rule, one token per 4 bytes of UTF-8 and a fixed chat rendering",
    )
    p.add_argument(
        "--chat-template",
        default=None,
        metavar="FILE",
        help="a Jinja chat template replacing the tokenizer's (only with --tokenizer)",
    )
    p.add_argument(
        "--tokenizer-media-tokens",
        type=int,
        default=0,
        metavar="N",
        help="with --tokenizer: an image, audio or file part of a chat request becomes N tokens' worth of stand-in "
        "text (N x 4 characters, the routing rule's stand-in), as a multimodal model prefills it; 0: refused with "
        "400, as a text-only model does (default: 0)",
    )
    p.add_argument(
        "--shared-tier",
        default=None,
        metavar="PATH",
        help="a KV tier shared by every emulated instance given the same file (put it in /dev/shm): each writes "
        "its computed blocks there and any loads them (default: none)",
    )
    p.add_argument(
        "--shared-tier-tokens",
        type=int,
        default=4_800_000,
        help="capacity of the shared tier, tokens, when this process creates its file (default: %(default)s)",
    )
    p.add_argument(
        "--kv-events-config",
        default=None,
        metavar="JSON",
        help="publish KV events as vLLM does, with vLLM's flag: e.g. '{\"enable_kv_cache_events\": true, "
        "\"publisher\": \"zmq\", \"endpoint\": \"tcp://*:5557\", \"replay_endpoint\": \"tcp://*:5558\"}' "
        "(keys: enable_kv_cache_events, publisher, endpoint, replay_endpoint, topic, buffer_steps, hwm; "
        "'tcp://HOST:*' binds a free port, shown in GET /info). Needs the precise extra. Default: no events",
    )
    p.add_argument(
        "--kv-events-encoding",
        choices=list(ENCODINGS),
        default="array",
        help="msgpack form of the events: 'array' (positional, the vLLM releases seen so far) or 'map' "
        "(newer vLLM source) (default: %(default)s)",
    )
    p.add_argument(
        "--kv-events-hash-seed",
        type=int,
        default=None,
        metavar="INT",
        help="seed of the published block hashes (vLLM's NONE_HASH, fixed by PYTHONHASHSEED there), "
        "0 to 2**64-1 (default: random at start-up, so they differ from the router's and between restarts)",
    )
    p.add_argument(
        "--log-level",
        default="info",
        choices=["debug", "info", "warning", "error"],
        help="log verbosity; prompt text is never logged (default: %(default)s)",
    )


def config_from_args(args: argparse.Namespace) -> EngineConfig:
    """Build the :class:`EngineConfig` from parsed flags (unset ones keep defaults).

    Raises:
        ValueError: a value is out of range (see :class:`EngineConfig`).
    """
    names = (flag[2:].replace("-", "_") for flag, _, _ in _ENGINE_FLAGS)
    overrides = {name: getattr(args, name) for name in names if getattr(args, name, None) is not None}
    served = list(getattr(args, "served_model_name", None) or [])
    model = served[0] if served else args.model
    lora_on = getattr(args, "enable_lora", False)
    if getattr(args, "max_loras", None) is not None and not lora_on:
        raise ValueError("--max-loras needs --enable-lora")
    max_loras = (args.max_loras if args.max_loras is not None else 1) if lora_on else 0
    return EngineConfig(model=model, served_model_names=tuple(served[1:]), max_loras=max_loras, **overrides)


def lora_from_args(args: argparse.Namespace) -> tuple[dict[str, str], bool]:
    """``(lora_modules, runtime_lora_updating)`` from the flags (and vLLM's environment
    variable ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``).

    Raises:
        ValueError: a malformed ``NAME=PATH``, adapters without ``--enable-lora``, or
            ``--max-loras`` below 1 with it.
    """
    modules: dict[str, str] = {}
    for item in getattr(args, "lora_modules", []) or []:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--lora-modules {item!r}: expected NAME=PATH")
        modules[name] = path
    runtime = getattr(args, "allow_runtime_lora_updating", False) or \
        os.environ.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "").strip().lower() in ("1", "true")
    if (modules or getattr(args, "allow_runtime_lora_updating", False)) and not getattr(args, "enable_lora", False):
        raise ValueError("--lora-modules and --allow-runtime-lora-updating need --enable-lora")
    max_loras = getattr(args, "max_loras", None)
    if getattr(args, "enable_lora", False) and max_loras is not None and max_loras < 1:
        raise ValueError(f"--max-loras must be at least 1 with --enable-lora, got {max_loras}")
    return modules, runtime and getattr(args, "enable_lora", False)


async def _serve(args: argparse.Namespace, config: EngineConfig, tokenizer: ModelTokenizer | None,
                 kv_events: KvEventsSettings | None, shared_tier: FileSharedTier | None) -> None:
    modules, runtime = lora_from_args(args)
    runner, port = await start_engine_server(config, args.host, args.port, args.time_scale, args.instance_id,
                                             tokenizer=tokenizer, kv_events=kv_events, shared_tier=shared_tier,
                                             lora_modules=modules, runtime_lora_updating=runtime,
                                             embedding_dim=args.embedding_dim)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            loop.add_signal_handler(sig, stop.set)
        except (NotImplementedError, RuntimeError):  # Windows, or not the main thread
            pass
    print(f"prefixroute-emulate listening on http://{args.host}:{port}", flush=True)
    try:
        await stop.wait()
    finally:
        logging.getLogger(__name__).info("shutting down")
        await runner.cleanup()
        if shared_tier is not None:
            shared_tier.close()


def kv_events_from_args(args: argparse.Namespace) -> KvEventsSettings | None:
    """The KV-event publisher's settings from the flags, ``None`` when events are off.

    Raises:
        ValueError: a bad ``--kv-events-config``, or ``--kv-events-hash-seed`` without it.
    """
    if args.kv_events_config is None:
        if args.kv_events_hash_seed is not None:
            raise ValueError("--kv-events-hash-seed needs --kv-events-config")
        return None
    settings = KvEventsSettings.from_vllm_config(args.kv_events_config, encoding=args.kv_events_encoding,
                                                 hash_seed=args.kv_events_hash_seed)
    if settings is not None:
        try:  # the precise extra: fail now, with a clear message, not at start-up
            import msgpack  # noqa: F401
            import zmq  # noqa: F401
        except ImportError:
            raise ImportError("KV events need pyzmq and msgpack: pip install 'prefixroute[precise]'") from None
    return settings


def run(args: argparse.Namespace) -> int:
    """Run the emulated engine until SIGTERM/SIGINT. Returns the process exit code:
    0 after a clean stop, 2 for an invalid configuration, 1 if the port or a KV-event endpoint cannot be bound."""
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = config_from_args(args)
        if not (math.isfinite(args.time_scale) and args.time_scale >= 0):
            raise ValueError(f"--time-scale must be a finite number >= 0, got {args.time_scale}")
        if not 0 <= args.port <= 65535:
            raise ValueError(f"--port {args.port} is out of range (allowed 0-65,535)")
        if args.chat_template is not None and args.tokenizer is None:
            raise ValueError("--chat-template needs --tokenizer")
        lora_from_args(args)  # (checked now: a bad flag is exit code 2)
        if args.embedding_dim < 1:
            raise ValueError(f"--embedding-dim must be >= 1, got {args.embedding_dim}")
        tokenizer = load_tokenizer(args.tokenizer, args.chat_template)
        if args.tokenizer_media_tokens:
            if tokenizer is None or args.tokenizer_media_tokens < 0:
                raise ValueError("--tokenizer-media-tokens needs --tokenizer and a number >= 0")
            tokenizer = dataclasses.replace(tokenizer, media_tokens=args.tokenizer_media_tokens)
        kv_events = kv_events_from_args(args)
        shared_tier = None
        if args.shared_tier is not None:
            shared_tier = FileSharedTier(args.shared_tier, args.shared_tier_tokens // config.block_size)
    except (ValueError, ImportError, OSError) as exc:
        print(f"prefixroute emulate: {exc}", file=sys.stderr)
        return 2
    try:
        with asyncio.Runner(loop_factory=loop_factory()) as runner:
            runner.run(_serve(args, config, tokenizer, kv_events, shared_tier))
    except OSError as exc:
        print(f"prefixroute emulate: cannot listen on {args.host}:{args.port}: {exc}", file=sys.stderr)
        return 1
    except Exception as exc:
        if type(exc).__module__.startswith("zmq"):  # a KV-event endpoint that cannot be bound
            print(f"prefixroute emulate: KV events: {exc}", file=sys.stderr)
            return 1
        raise
    except KeyboardInterrupt:
        pass
    return 0
