"""Sentence embeddings for the response cache's semantic tier: `embed(texts) -> [n, dim]` fp32 unit rows.

- `WordLlamaEmbedder` ("wordllama"): WordLlama's l2_supercat 256-d token embeddings (MIT licence), averaged;
  its 16 MB weights and tokenizer ship inside the `wordllama` wheel and are read from there (its loader's
  download is switched off: nothing is fetched at run time). About 0.1 ms per sentence here.
- `HiddenStateEmbedder` ("hidden"): the local model's own final-normed hidden states over the text, mean
  pooled: no new dependency, the same features the router's probe reads. One prefill per text (tens of ms).

`EMBEDDERS` names them for `--cache-embedder` and the calibration; which one the cache uses by default was
picked on the labelled set (edge_runtime/data/cache_pairs.jsonl, `edge-runtime cache calibrate`).
"""
from __future__ import annotations

import numpy as np


def _unit(v: np.ndarray) -> np.ndarray:
    v = np.asarray(v, dtype=np.float32)
    n = np.linalg.norm(v, axis=-1, keepdims=True)
    return v / np.where(n > 0, n, 1.0)


class WordLlamaEmbedder:
    name = "wordllama"

    def __init__(self):
        from pathlib import Path

        import wordllama

        self._model = wordllama.WordLlama.load(cache_dir=Path(wordllama.__file__).parent, disable_download=True)

    def embed(self, texts: list[str]) -> np.ndarray:
        return _unit(self._model.embed(list(texts)))


class HiddenStateEmbedder:
    name = "hidden"

    def __init__(self, model: str = "default", max_tokens: int = 256):
        """Loads its own copy of the model (GGUF blocks, fused CPU step) so it never waits for the engine."""
        import torch

        from edge_runtime.model.loader import load_model
        from edge_runtime.model.path import resolve_model_path
        from edge_runtime.model.tokenizer import Tokenizer
        from kernels import cpu_gemv

        self._torch = torch
        self.model, gf = load_model(resolve_model_path(model), quant="gguf")
        self.tokenizer = Tokenizer.from_metadata(gf.metadata)
        self.max_tokens = max_tokens
        blocks = (max_tokens + 15) // 16
        self.model.allocate_cache(max_tokens, num_blocks=blocks, block_size=16)
        self.table = list(range(blocks))
        self.fused = self.model.enable_fused(cpu_gemv.library())

    def embed(self, texts: list[str]) -> np.ndarray:
        out = []
        with self._torch.inference_mode():
            for text in texts:
                ids = self.tokenizer.encode(text)[: self.max_tokens] or [0]
                if self.fused:
                    self.model.fused.prefill(ids, 0, self.table)
                    h = self.model.fused.chunk_hidden
                else:
                    self.model(self._torch.tensor(ids), 0, block_table=self.table)
                    h = self.model.last_hidden[None]
                out.append(h.float().mean(0).numpy())
        return _unit(np.stack(out))


EMBEDDERS = {"wordllama": WordLlamaEmbedder, "hidden": HiddenStateEmbedder}
