"""Without the precise extra (pyzmq, msgpack, tokenizers, jinja2) everything else still
imports and runs, and asking for precise mode fails with an error that names the extra."""

from __future__ import annotations

import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import argparse, importlib.abc, sys

    class Block(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name.split(".")[0] in ("msgpack", "zmq", "tokenizers", "jinja2"):
                raise ImportError(f"No module named {name!r}")
            return None

    sys.meta_path.insert(0, Block())
    import prefixroute.cli, prefixroute.server.runner, prefixroute.sim.simulator
    from prefixroute.engine import cli as emulate
    from prefixroute.server import cli as serve

    p = argparse.ArgumentParser(); serve.configure_parser(p)
    print("serve", serve.run(p.parse_args(["--backend", "http://a:1", "--kv-events-template", "tcp://{host}:1"])))
    p = argparse.ArgumentParser(); emulate.configure_parser(p)
    print("events", emulate.run(p.parse_args(["--kv-events-config", '{"enable_kv_cache_events": true}'])))
    print("tokenizer", emulate.run(p.parse_args(["--tokenizer", "tiny"])))
""")


def test_the_default_install_runs_without_the_precise_extra() -> None:
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["serve", "2", "events", "2", "tokenizer", "2"]
    assert out.stderr.count("pip install 'prefixroute[precise]'") == 3
