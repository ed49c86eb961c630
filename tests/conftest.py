"""Fixtures shared by the test modules."""

import pytest

from prefixroute.server.settings import DATA_PLANES


@pytest.fixture(params=DATA_PLANES)
def data_plane(request: pytest.FixtureRequest) -> str:
    """Each router data plane in turn (``fast``, ``aiohttp``): a test using a router
    made with it checks that both behave the same."""
    return request.param
