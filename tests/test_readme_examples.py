"""The README's client example runs as printed against a router and an emulated engine,
on a machine without AWS credentials, with the clients of the ``clients`` extra."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from prefixroute.demo.processes import ProcessGroup

README = Path(__file__).resolve().parent.parent / "README.md"
pytestmark = pytest.mark.e2e


def _client_example() -> str:
    text = README.read_text()
    start = text.index("Then point clients at the router.")
    m = re.search(r"```python\n(.*?)```", text[start:], re.S)
    assert m, "the README's client example"
    return m.group(1)


def test_the_clients_extra_is_named_in_the_readme():
    text = README.read_text()
    assert "pip install 'prefixroute[clients]'" in text
    pyproject = (README.parent / "pyproject.toml").read_text()
    assert re.search(r"^clients = \[\n\s+\"openai[^\n]*\n\s+\"boto3", pyproject, re.M)


def test_the_readme_client_example_runs_without_aws_credentials(tmp_path):
    code = _client_example()
    assert "UNSIGNED" in code
    with ProcessGroup() as group:
        engine = group.start("engine", ["emulate", "--port", "0", "--time-scale", "0"])
        router = group.start("router", ["serve", "--port", "0", "--admin-port", "0", "--backend", engine.url,
                                        "--strategy", "prefix-aware", "--prefix-length", "1024",
                                        "--concurrency-threshold", "8"])
        script = tmp_path / "example.py"
        script.write_text("DOCUMENT = 'A long document. ' * 200\n" + code.replace("http://router:8080", router.url))
        # No credentials anywhere boto3 looks: no variables, no files, no instance metadata.
        env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
        env.update(AWS_SHARED_CREDENTIALS_FILE=str(tmp_path / "none"), AWS_CONFIG_FILE=str(tmp_path / "none"),
                   AWS_EC2_METADATA_DISABLED="true", HOME=str(tmp_path))
        out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "data:" in out.stdout  # the streamed chunks, printed as they came
