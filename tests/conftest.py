"""Fixtures shared by the test modules."""

import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Callable

import pytest

from prefixroute.server.settings import DATA_PLANES


@pytest.fixture(params=DATA_PLANES)
def data_plane(request: pytest.FixtureRequest) -> str:
    """Each router data plane in turn (``fast``, ``aiohttp``): a test using a router
    made with it checks that both behave the same."""
    return request.param


BENCH = Path(__file__).resolve().parent.parent / "bench"


def _load_bench(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"prefixroute_bench_{name}", BENCH / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def load_bench() -> Callable[[str], ModuleType]:
    """Loads a benchmark script of ``bench/`` by name (``load_bench("kv_ingest")``): the
    scripts are not a package."""
    return _load_bench
