import pytest

from tests.edge_runtime.server.gateway_fixtures import Gateway


@pytest.fixture(scope="module")
def gw():
    """A gateway with an API key, device only (one per test module)."""
    g = Gateway()
    yield g
    g.stop()
