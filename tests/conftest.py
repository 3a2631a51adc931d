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


@pytest.fixture(scope="session")
def onnx_export_dir(model_path, tmp_path_factory):
    """The default model exported once to ONNX (edge-runtime export-onnx, default settings)."""
    from edge_runtime.onnx_export import export_onnx

    out = tmp_path_factory.mktemp("onnx")
    export_onnx(model_path, str(out))
    return str(out)


@pytest.fixture(scope="session")
def ort_backend(onnx_export_dir):
    from edge_runtime.backends import create_backend

    return create_backend("onnxruntime", onnx_export_dir, n_ctx=2048, providers=["CPUExecutionProvider"])

