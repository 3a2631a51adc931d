"""Model hyper-parameters read from GGUF metadata (llama family).

Maps `{arch}.*` keys to one `ModelConfig`. It knows nothing about tensors or
quantization; `model_loader` uses it to build the transformer.
"""
from __future__ import annotations

from dataclasses import dataclass

from edge_runtime.errors import ModelFileError, UnsupportedModelError

SUPPORTED_ARCHS = ("llama", "qwen2")


@dataclass(slots=True)
class ModelConfig:
    arch: str
    vocab_size: int
    dim: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_dim: int
    norm_eps: float
    rope_theta: float
    max_context: int
    attn_bias: bool = False  # qwen2 has q/k/v biases
    name: str = ""

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise UnsupportedModelError(
                f"head_count {self.num_heads} is not a multiple of head_count_kv {self.num_kv_heads}"
            )
        if self.head_dim % 2:
            raise UnsupportedModelError(f"odd head dimension {self.head_dim} cannot use RoPE")

    @property
    def group_size(self) -> int:
        """Query heads per KV head (GQA ratio)."""
        return self.num_heads // self.num_kv_heads

    @classmethod
    def from_gguf(cls, gf) -> "ModelConfig":
        arch = gf.get("general.architecture")
        if arch is None:
            raise ModelFileError(f"GGUF file {gf.path} has no general.architecture")
        if arch not in SUPPORTED_ARCHS:
            raise UnsupportedModelError(
                f"unsupported architecture {arch!r} in {gf.path} (supported: {', '.join(SUPPORTED_ARCHS)})"
            )
        def key(k: str):
            return gf.require(f"{arch}.{k}")

        dim = int(key("embedding_length"))
        num_heads = int(key("attention.head_count"))
        num_kv = gf.get(f"{arch}.attention.head_count_kv", num_heads)
        num_kv = int(num_kv[0] if isinstance(num_kv, list) else num_kv)
        head_dim = int(gf.get(f"{arch}.attention.key_length", dim // num_heads))
        vocab = gf.get(f"{arch}.vocab_size")
        if vocab is None:
            vocab = len(gf.require("tokenizer.ggml.tokens"))
        scaling = gf.get(f"{arch}.rope.scaling.type", "none")
        if scaling not in ("none", None):
            raise UnsupportedModelError(f"unsupported rope scaling {scaling!r} in {gf.path}")
        return cls(
            arch=arch,
            vocab_size=int(vocab),
            dim=dim,
            num_layers=int(key("block_count")),
            num_heads=num_heads,
            num_kv_heads=num_kv,
            head_dim=head_dim,
            hidden_dim=int(key("feed_forward_length")),
            norm_eps=float(key("attention.layer_norm_rms_epsilon")),
            rope_theta=float(gf.get(f"{arch}.rope.freq_base", 10000.0)),
            max_context=int(key("context_length")),
            attn_bias=arch == "qwen2",
            name=str(gf.get("general.name", "")),
        )
