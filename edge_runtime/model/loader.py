"""Build a `Transformer` from a GGUF file.

Reads the tensors of a llama-family GGUF, undoes llama.cpp's q/k row
permutation (GGUF stores RoPE pairs interleaved; `transformer.py` uses the
rotate-half layout), fuses QKV and gate/up by concatenating raw rows, and
hands each weight to `kernels.quant_linear`, which keeps it quantized
(`quant="int4"`: exact int4 repack where the GGUF type allows, int8
per-channel otherwise) or dequantizes it (`quant="fp32"`: the reference).
"""
from __future__ import annotations

import hashlib
import os

import numpy as np
import torch

from kernels import gguf_linear
from kernels.errors import UnsupportedTensorError
from kernels.quant_linear import pack_embedding, pack_weight

from edge_runtime.errors import ModelFileError, UnsupportedModelError
from edge_runtime.model.gguf_file import GGUFFile
from edge_runtime.model.transformer import Block, Transformer
from edge_runtime.model.config import ModelConfig

QUANT_MODES = ("auto", "gguf", "int4", "int8", "bf16", "fp32")
PREFILL_DENSE_MIN_TOKENS = 64


def _unpermute_rows(num_heads: int, rows: int) -> np.ndarray:
    """Row index that turns GGUF's interleaved RoPE order back into rotate-half order."""
    head_dim = rows // num_heads
    half = head_dim // 2
    idx = np.empty(rows, dtype=np.int64)
    for h in range(num_heads):
        for j in range(2):
            for i in range(half):
                idx[h * head_dim + j * half + i] = h * head_dim + 2 * i + j
    return idx


class _Tensors:
    def __init__(self, gf: GGUFFile):
        self.gf = gf

    def get(self, name: str):
        t = self.gf.tensors.get(name)
        if t is None:
            raise ModelFileError(f"GGUF file {self.gf.path} lacks tensor {name!r}")
        return t

    def rows(self, name: str, perm: np.ndarray | None = None):
        """(qtype, raw rows [out_features, ...], out_features, in_features)."""
        t = self.get(name)
        in_features = int(t.shape[0])
        out_features = int(t.shape[1]) if len(t.shape) > 1 else 1
        data = np.asarray(t.data).reshape(out_features, -1)
        if perm is not None:
            data = data[perm]
        return t.tensor_type, data, out_features, in_features

    def vector(self, name: str, device) -> torch.Tensor:
        from gguf.quants import dequantize

        t = self.get(name)
        return torch.from_numpy(np.array(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(-1)).to(device)

    def linear(self, names: list[str], quant: str, device, perms=None):
        parts = [self.rows(n, None if perms is None else perms[i]) for i, n in enumerate(names)]
        qtypes = {p[0] for p in parts}
        in_features = {p[3] for p in parts}
        if len(qtypes) != 1 or len(in_features) != 1:
            # Mixed types cannot share one packed matrix: dequantize the parts and fuse them in fp32.
            from gguf.quants import dequantize
            import gguf

            data = np.concatenate([np.asarray(dequantize(p[1], p[0]), dtype=np.float32).reshape(p[2], -1) for p in parts])
            qtype, in_f = gguf.GGMLQuantizationType.F32, data.shape[1]
        else:
            data = np.concatenate([p[1] for p in parts]) if len(parts) > 1 else parts[0][1]
            qtype, in_f = parts[0][0], parts[0][3]
        if quant == "gguf":
            if gguf_linear.supported(qtype) and torch.device(device).type == "cpu":
                return gguf_linear.GGUFLinear(qtype, data, (data.shape[0], in_f))
            quant = "int8_block" if qtype.name == "Q8_0" else "int4"  # no AVX2 kernel for this type
        return pack_weight(qtype, data, (data.shape[0], in_f), quant, name=names[0]).to(device)


def _packed_cache_file(gf: GGUFFile, quant: str, head_quant: str | None) -> str:
    """Where the packed model of this file, mode and code version is cached."""
    from kernels.compile_cache import cache_root

    st = os.stat(gf.path)
    h = hashlib.sha256(f"{os.path.abspath(gf.path)}|{st.st_size}|{st.st_mtime_ns}|{quant}|{head_quant}|"
                       f"{torch.__version__}".encode())
    import kernels.gguf_blocks
    import kernels.int4_layout
    import kernels.quant_linear

    from edge_runtime.model import transformer as model_module

    for mod in (kernels.quant_linear, kernels.int4_layout, kernels.gguf_blocks, model_module):
        with open(mod.__file__, "rb") as f:
            h.update(f.read())
    with open(__file__, "rb") as f:
        h.update(f.read())
    folder = os.path.join(cache_root(), "packed")
    os.makedirs(folder, exist_ok=True)
    return os.path.join(folder, h.hexdigest()[:24] + ".pt")


def load_model(path: str, quant: str = "auto", device: str | torch.device = "cpu",
               head_quant: str | None = None, cache: bool = True) -> tuple[Transformer, GGUFFile]:
    """Load a GGUF into a Transformer. `quant` is one of QUANT_MODES; `head_quant` overrides the output head's mode.

    Packed (quantized) CPU models are cached on disk after the first load, so a warm start only
    memory-maps the packed tensors instead of repacking the GGUF.
    """
    if quant not in QUANT_MODES:
        raise ValueError(f"quant must be one of {QUANT_MODES}, got {quant!r}")
    device = torch.device(device)
    if quant == "auto":
        from kernels import cpu_gemv

        quant = "gguf" if device.type == "cpu" and cpu_gemv.available() else "int4"
    gf = GGUFFile(path)
    use_cache = cache and quant not in ("fp32", "gguf") and device.type == "cpu" and os.environ.get("EDGE_RUNTIME_NO_PACK_CACHE") != "1"
    if use_cache:
        cache_file = _packed_cache_file(gf, quant, head_quant)
        if os.path.exists(cache_file):
            try:
                return torch.load(cache_file, weights_only=False, mmap=True).eval(), gf
            except Exception:  # a damaged or stale cache entry: rebuild it
                os.unlink(cache_file)
    try:
        model = _build(gf, quant, device, head_quant)
    except UnsupportedTensorError as e:
        raise UnsupportedModelError(f"{gf.path}: {e.message}") from None
    if use_cache:
        tmp = f"{cache_file}.{os.getpid()}.tmp"
        torch.save(model, tmp)
        os.replace(tmp, cache_file)
    return model, gf


def _build(gf: GGUFFile, quant: str, device: torch.device, head_quant: str | None) -> Transformer:
    cfg = ModelConfig.from_gguf(gf)
    ts = _Tensors(gf)
    q_perm = k_perm = None
    if cfg.arch == "llama":  # llama.cpp permutes q/k rows for its interleaved RoPE; qwen2 is stored as is
        q_perm = _unpermute_rows(cfg.num_heads, cfg.num_heads * cfg.head_dim)
        k_perm = _unpermute_rows(cfg.num_kv_heads, cfg.num_kv_heads * cfg.head_dim)
    blocks = []
    for i in range(cfg.num_layers):
        p = f"blk.{i}."
        bias = None
        if cfg.attn_bias:
            qb, kb = ts.vector(p + "attn_q.bias", "cpu"), ts.vector(p + "attn_k.bias", "cpu")
            bias = torch.cat([qb, kb, ts.vector(p + "attn_v.bias", "cpu")]).to(device)
        if q_perm is not None and bias is not None:  # pragma: no cover - llama has no biases
            raise UnsupportedModelError("q/k biases with permuted rows are not supported")
        blocks.append(Block(
            cfg,
            attn_norm=ts.vector(p + "attn_norm.weight", device),
            wqkv=ts.linear([p + "attn_q.weight", p + "attn_k.weight", p + "attn_v.weight"], quant, device,
                           perms=[q_perm, k_perm, None]),
            wo=ts.linear([p + "attn_output.weight"], quant, device),
            ffn_norm=ts.vector(p + "ffn_norm.weight", device),
            w_gate_up=ts.linear([p + "ffn_gate.weight", p + "ffn_up.weight"], quant, device),
            w_down=ts.linear([p + "ffn_down.weight"], quant, device),
            qkv_bias=bias,
        ))
    emb_t = ts.get("token_embd.weight")
    embedding = pack_embedding(emb_t.tensor_type, np.asarray(emb_t.data).reshape(cfg.vocab_size, -1),
                               (cfg.vocab_size, cfg.dim), name="token_embd.weight").to(device)
    head_name = "output.weight" if "output.weight" in gf.tensors else "token_embd.weight"  # tied embeddings
    # The Q8_0 head keeps its codes exactly as int8_block (bf16 block scales) in int4 mode.
    output = ts.linear([head_name], head_quant or ("int8_block" if quant == "int4" else quant), device)
    if quant in ("int4", "int8"):
        # From PREFILL_DENSE_MIN_TOKENS tokens on, one dense fp32 GEMM on weights dequantized for that
        # call beats the int kernels (they scale linearly with the number of tokens on this CPU).
        for block in blocks:
            for lin in (block.wqkv, block.wo, block.w_gate_up, block.w_down):
                lin.dense_min_tokens = PREFILL_DENSE_MIN_TOKENS
    model = Transformer(cfg, embedding, blocks, ts.vector("output_norm.weight", device), output)
    model.quant = quant
    return model.eval()
