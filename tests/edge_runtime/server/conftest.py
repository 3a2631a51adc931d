import pytest

from tests.edge_runtime.server.gateway_fixtures import Gateway
from tests.edge_runtime.server.page_driver import Browser, find_chromium


@pytest.fixture(scope="module")
def gw():
    """A gateway with an API key, device only (one per test module)."""
    g = Gateway()
    yield g
    g.stop()


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    binary = find_chromium()
    if binary is None:
        pytest.skip("no chromium binary (apt-get install chromium, or set $CHROMIUM)")
    b = Browser(binary, str(tmp_path_factory.mktemp("chromium-profile")))
    yield b
    b.close()
