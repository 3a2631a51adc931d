"""Local backends behind one interface: `native` (our torch engine), `llama.cpp` and `onnxruntime`."""
from __future__ import annotations

from edge_runtime.errors import BackendUnavailableError
from edge_runtime.backends.base import Backend

BACKENDS = ("native", "llama.cpp", "onnxruntime")


def create_backend(name: str, model: str = "default", **kwargs) -> Backend:
    """Build a backend by name. kwargs: n_ctx, threads, and backend-specific options."""
    if name == "native":
        from edge_runtime.backends.native import NativeBackend

        return NativeBackend(model, **kwargs)
    if name in ("llama.cpp", "llama_cpp", "llamacpp"):
        from edge_runtime.backends.llama_cpp import LlamaCppBackend

        kwargs = {k: v for k, v in kwargs.items() if k in ("n_ctx", "threads")}
        return LlamaCppBackend(model, **kwargs)
    if name in ("onnxruntime", "ort", "onnx"):
        from edge_runtime.backends.ort import OnnxRuntimeBackend

        kwargs = {k: v for k, v in kwargs.items() if k in ("n_ctx", "threads", "providers", "provider_options",
                                                          "weights")}
        return OnnxRuntimeBackend(model, **kwargs)
    raise BackendUnavailableError(f"unknown backend {name!r} (choose from: {', '.join(BACKENDS)})")


__all__ = ["Backend", "BACKENDS", "create_backend"]
