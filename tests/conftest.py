"""Shared fixtures: the embedded model path and backends loaded once per session."""
import os

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def model_path():
    from edge_runtime.model_path import default_model_path

    return default_model_path()


@pytest.fixture(scope="session")
def native_backend(model_path):
    """The default native backend (int4 weights, compiled decode step)."""
    from edge_runtime.backends import create_backend

    return create_backend("native", model_path, n_ctx=2048)


@pytest.fixture(scope="session")
def llama_backend(model_path):
    from edge_runtime.backends import create_backend

    return create_backend("llama.cpp", model_path, n_ctx=2048)


@pytest.fixture(scope="session")
def prose():
    from edge_runtime.bench import PROSE

    with open(PROSE, encoding="utf-8") as f:
        return f.read()
