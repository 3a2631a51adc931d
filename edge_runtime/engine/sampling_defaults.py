"""What the interactive entry points sample with when a request does not say.

`chat`, and `serve`'s HTTP API and `/v1/stream`, fill every sampling setting a
request leaves out from the model's own recommendation (a GGUF's
`general.sampling.*` keys, as llama.cpp reads them), else from FALLBACK:
llama.cpp's chain (temperature 0.8, top-k 40, top-p 0.95, min-p 0.05) with
Ollama's repeat penalty 1.1 over the last 64 tokens. The penalty is there
because the default 135M model loops without it: asked "Write a poem about the
sea in eight lines." with llama.cpp's settings alone it repeated a line in 6
of 6 seeded answers, with the penalty in 1 of 6. A request for temperature 0
gets plain greedy decoding (no penalty unless it asks for one), the same tokens
as `generate`. `generate`, the Python API and the benchmarks keep
SamplingParams' own defaults (greedy) unless told.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from edge_runtime.request import SamplingParams

FALLBACK = {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05, "repetition_penalty": 1.1,
            "repeat_last_n": 64}
FALLBACK_SOURCE = "llama.cpp's defaults with Ollama's repeat penalty"
# GGUF key -> SamplingParams field (gguf-py's Keys.General.SAMPLING_*)
GGUF_KEYS = {"general.sampling.temp": "temperature", "general.sampling.top_k": "top_k",
             "general.sampling.top_p": "top_p", "general.sampling.min_p": "min_p",
             "general.sampling.penalty_repeat": "repetition_penalty",
             "general.sampling.penalty_last_n": "repeat_last_n"}
_INTS = {"top_k", "repeat_last_n"}
_LABELS = {"temperature": "temperature", "top_k": "top-k", "top_p": "top-p", "min_p": "min-p",
           "repetition_penalty": "repeat penalty", "repeat_last_n": "over the last"}


@dataclass(frozen=True)
class SamplingDefaults:
    values: dict  # SamplingParams field -> value, every key of FALLBACK
    from_model: tuple  # the fields the model's GGUF set

    @property
    def source(self) -> str:
        if not self.from_model:
            return f"{FALLBACK_SOURCE}; the model recommends none"
        rest = "" if len(self.from_model) == len(FALLBACK) else f", the rest {FALLBACK_SOURCE}"
        return f"the model's recommendation ({', '.join(self.from_model)}){rest}"

    def describe(self) -> str:
        v = self.values
        parts = [f"{_LABELS[k]} {v[k]:g}" for k in ("temperature", "top_k", "top_p", "min_p", "repetition_penalty")]
        return f"{', '.join(parts)} over the last {v['repeat_last_n']} tokens ({self.source})"

    def as_dict(self) -> dict:
        return {**self.values, "source": self.source}

    def params(self, **given) -> SamplingParams:
        """SamplingParams from the settings a request gave (None: not given) over these defaults. A request
        for greedy decoding (temperature 0) gets plain greedy: no repeat penalty unless it sets one (top-k,
        top-p and min-p never drop the most likely token, so they do not matter there)."""
        given = {k: v for k, v in given.items() if v is not None}
        merged = {**self.values, **given}
        if merged["temperature"] == 0 and "repetition_penalty" not in given:
            merged["repetition_penalty"] = 1.0
        return SamplingParams(**merged)


def from_metadata(metadata: dict) -> SamplingDefaults:
    """The defaults a GGUF's metadata recommends, FALLBACK for what it leaves out or sets out of range."""
    values, from_model = dict(FALLBACK), []
    for key, name in GGUF_KEYS.items():
        raw = metadata.get(key)
        if isinstance(raw, bool) or not isinstance(raw, (int, float)) or not math.isfinite(raw):
            continue
        value = int(raw) if name in _INTS else float(raw)
        try:
            SamplingParams(**{**FALLBACK, name: value})  # the sampler's own rules decide what is valid
        except Exception:  # a file's bad value is ignored, not a failure to load
            continue
        values[name] = value
        from_model.append(name)
    return SamplingDefaults(values, tuple(from_model))


NONE = from_metadata({})
