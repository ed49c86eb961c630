"""The ``prefixroute`` command: ``serve``, ``epp``, ``emulate``, ``demo``, ``simulate`` and ``tune``."""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import Sequence

from prefixroute import __version__

__all__ = ["main", "build_parser"]

#: subcommand -> (module with configure_parser/run, one-line help)
SUBCOMMANDS = {
    "serve": ("prefixroute.server.cli", "run the router in front of engine instances"),
    "epp": ("prefixroute.epp.cli", "serve Envoy's ext_proc API as an endpoint picker (Gateway API Inference Extension)"),
    "emulate": ("prefixroute.engine.cli", "run one emulated vLLM engine with a prefix cache"),
    "demo": ("prefixroute.demo.cli", "measure every strategy on an emulated fleet (the main job)"),
    "simulate": ("prefixroute.sim.cli", "predict routing on hours of traffic in seconds (discrete-event simulator)"),
    "tune": ("prefixroute.sim.tune_cli", "replay a trace over PrefixLength x ConcurrencyThreshold and recommend settings"),
}


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser with one subparser per subcommand."""
    parser = argparse.ArgumentParser(
        prog="prefixroute",
        description="Prefix-aware (KV-cache-aware) request router for LLM inference fleets.",
    )
    parser.add_argument("--version", action="version", version=f"prefixroute {__version__}")
    subs = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (module, help_text) in SUBCOMMANDS.items():
        mod = importlib.import_module(module)
        sp = subs.add_parser(name, help=help_text)
        mod.configure_parser(sp)
        sp.set_defaults(_run=mod.run, _parser=sp)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the console script; returns the exit code."""
    args_in = sys.argv[1:] if argv is None else list(argv)
    if args_in[:1] == ["serve"]:  # before the imports: a signal while starting is kept
        from prefixroute import signals

        signals.hold()
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # the subcommand's usage, not the top level's (argparse would print that one)
        args._parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    return int(args._run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
