"""Compute kernels for the native backend, each with a plain reference beside it.

Quantized linear/embedding layers built from raw GGUF rows live in `quant_linear`
(block decoding in `gguf_blocks`). Kernels know nothing of model structure or of
the GGUF file as a whole: callers hand them one tensor's rows at a time.
"""
from kernels.quant_linear import MODES, QuantEmbedding, QuantLinear, pack_embedding, pack_weight, reference_linear

__all__ = ["MODES", "QuantEmbedding", "QuantLinear", "pack_embedding", "pack_weight", "reference_linear"]
