"""Shared fixtures: the embedded model path and backends loaded once per session."""
import os

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# The response cache's default file is shared by every process of a user: tests that want a cache name their own
# file (--cache-path), so that no test is answered from another's cache.
os.environ["EDGE_RUNTIME_RESPONSE_CACHE"] = "off"


@pytest.fixture
def exact_arith():
    """fp32-activation GEMVs (`--arith exact`) for the test, then back: for tests of the exact path itself,
    and of torch-vs-C op equivalence, where the 8-bit activation rounding would amplify fp32 op-order
    differences of ~1e-7 into whole quantization steps."""
    from kernels import cpu_gemv

    old = cpu_gemv.arith()
    cpu_gemv.set_arith("exact")
    yield
    cpu_gemv.set_arith(old)


@pytest.fixture(scope="session")
def model_path():
    from edge_runtime.model.path import default_model_path

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
    from edge_cli.bench.decode import PROSE

    with open(PROSE, encoding="utf-8") as f:
        return f.read()


@pytest.fixture(scope="session")
def onnx_export_dir(model_path, tmp_path_factory):
    """The default model exported once to ONNX (edge-runtime export-onnx, default settings)."""
    from edge_runtime.onnx.export import export_onnx

    out = tmp_path_factory.mktemp("onnx")
    export_onnx(model_path, str(out))
    return str(out)


@pytest.fixture(scope="session")
def ort_backend(onnx_export_dir):
    from edge_runtime.backends import create_backend

    return create_backend("onnxruntime", onnx_export_dir, n_ctx=2048, providers=["CPUExecutionProvider"])

