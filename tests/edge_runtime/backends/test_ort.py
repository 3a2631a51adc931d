"""The onnxruntime backend: a greedy stream, provider fallback with reasons, and clear errors."""
import json
import logging
import os

import pytest

from edge_runtime.errors import BackendUnavailableError, ModelFileError
from edge_runtime.request import GenerationRequest, SamplingParams


def _request(text, n=32):
    return GenerationRequest(messages=[{"role": "user", "content": text}], params=SamplingParams(max_tokens=n))


def test_greedy_stream_matches_native(ort_backend, native_backend, exact_arith):
    # the default export keeps fp32 activations: the native engine's --arith exact
    for text in ("What is the capital of France?", "Write a haiku about rain."):
        events = list(ort_backend.stream_sync(_request(text)))
        assert [e.type for e in events[:1]] == ["start"] and events[-1].type == "finish"
        deltas = [e for e in events if e.type == "delta"]
        ids = [t for e in deltas for t in e.token_ids]
        assert deltas and "".join(e.text for e in deltas).strip()
        assert events[-1].usage.completion_tokens == len(ids)
        assert ids == native_backend.generate(_request(text)).token_ids  # the same greedy answer
    assert ort_backend.draft == "none"  # no exact multi-token verification: auto drafting stays off


def test_missing_provider_falls_back_to_cpu_with_reason(onnx_export_dir, caplog):
    """QNN is not in this onnxruntime build (a real miss, nothing faked): CPU runs it, and the log says why."""
    from edge_runtime.backends.ort import open_session

    with caplog.at_level(logging.WARNING, logger="edge_runtime.onnxruntime"):
        _, provider, reasons = open_session(os.path.join(onnx_export_dir, "model.onnx"),
                                            ["QNNExecutionProvider", "CPUExecutionProvider"], 2)
    assert provider == "CPUExecutionProvider"
    assert len(reasons) == 1 and reasons[0].startswith("QNNExecutionProvider: not in this onnxruntime build")
    assert "QNNExecutionProvider" in caplog.text


def test_provider_that_fails_to_load_falls_back_fake_failure(onnx_export_dir, monkeypatch, caplog):
    """A provider that is present but whose session fails (faked: no NPU here) is passed over with its error."""
    import onnxruntime as ort

    from edge_runtime.backends import ort as ort_backend_module

    real = ort.InferenceSession

    def failing(path, so=None, providers=None, **kw):
        if providers and providers[0][0] == "AzureExecutionProvider":
            raise RuntimeError("fake: device not ready\nmore detail")
        return real(path, so, providers=providers, **kw)

    monkeypatch.setattr(ort, "InferenceSession", failing)
    with caplog.at_level(logging.WARNING, logger="edge_runtime.onnxruntime"):
        _, provider, reasons = ort_backend_module.open_session(
            os.path.join(onnx_export_dir, "model.onnx"), ["AzureExecutionProvider"], 2)
    assert provider == "CPUExecutionProvider"
    assert reasons == ["AzureExecutionProvider: failed to load (fake: device not ready)"]
    assert "device not ready" in caplog.text


def test_no_provider_loads_is_a_clear_error(onnx_export_dir, monkeypatch):
    import onnxruntime as ort

    from edge_runtime.backends.ort import open_session

    def failing(*a, **kw):
        raise RuntimeError("fake: broken")

    monkeypatch.setattr(ort, "InferenceSession", failing)
    with pytest.raises(BackendUnavailableError, match="no onnxruntime execution provider could load"):
        open_session(os.path.join(onnx_export_dir, "model.onnx"), ["CPUExecutionProvider"], 1)


def test_folder_that_is_not_an_export(tmp_path):
    from edge_runtime.backends import create_backend

    with pytest.raises(ModelFileError, match="not an edge-runtime ONNX export"):
        create_backend("onnxruntime", str(tmp_path), providers=["CPUExecutionProvider"])


def test_generate_cli_on_onnxruntime(onnx_export_dir, capsys):
    from edge_cli.main import main

    assert main(["generate", "--backend", "onnxruntime", "--model", onnx_export_dir, "--json", "--max-tokens", "8",
                 "What is 2+2?"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["backend"] == "onnxruntime" and out["completion_tokens"] == len(out["token_ids"]) > 0
    assert out["draft"]["method"] == "none"


def test_hybrid_runtime_answers_offline_through_onnxruntime(ort_backend):
    """The router and hybrid stream take the onnxruntime backend as their device side (one interface)."""
    import asyncio

    from edge_runtime.hybrid.runtime import HybridRuntime

    runtime = HybridRuntime(ort_backend, cloud=None, offline=True)
    request = _request("Name a color.", n=12)
    assert runtime.decide(request).route == "local"
    result = asyncio.run(runtime.generate(request))
    assert result.text.strip() and result.backend == "hybrid"
    assert result.token_ids == ort_backend.generate(_request("Name a color.", n=12)).token_ids
