"""The one-token decode step with the small per-layer ops fused in C.

When every projection keeps raw GGUF blocks (`GGUFLinear`), the whole stack of layers
runs in one C call per token (`decode_layers`); otherwise each layer's GEMVs stay
module calls and only the small ops between them are fused.

Same math as `Transformer.forward` for one token (fp32 residual stream, rotate-half
RoPE, grouped attention over the static KV buffer, SwiGLU), but the ~15 tiny torch ops
between a layer's four GEMVs become three calls into `kernels/cpu_decode.c`, and the
residual add is folded into the next RMSNorm. Used on CPU when the C kernels are built;
`model.py` stays the readable reference, and tests compare the two.
"""
from __future__ import annotations

import ctypes

import torch


class FusedDecoder:
    def __init__(self, model, lib):
        cfg = model.cfg
        self.model, self.lib, self.cfg = model, lib, cfg
        self.scale = ctypes.c_float(1.0 / cfg.head_dim ** 0.5)
        self.eps = ctypes.c_float(cfg.norm_eps)
        self.attn = torch.empty(cfg.num_heads * cfg.head_dim)  # [nh * hd]
        self.normed = torch.empty(cfg.dim)
        self.act = torch.empty(cfg.hidden_dim)
        self.logits_norm = torch.empty(1, cfg.dim)
        self.whole = all(getattr(lin, "mode", None) == "gguf" for b in model.blocks
                         for lin in (b.wqkv, b.wo, b.w_gate_up, b.w_down))
        self._tables_for = None  # the cache tensor the pointer tables were built for

    def _tables(self) -> None:
        """Pointer tables for decode_layers (rebuilt if the KV cache was reallocated)."""
        from kernels.cpu_gemv import KIND_CODE

        m, cfg = self.model, self.cfg
        lins = [lin for b in m.blocks for lin in (b.wqkv, b.wo, b.w_gate_up, b.w_down)]
        self.keep = [m.k_cache, m.v_cache]  # the tables point into these
        self.w_ptrs = (ctypes.c_void_p * len(lins))(*[lin.weight.data_ptr() for lin in lins])
        self.kinds = (ctypes.c_int * len(lins))(*[KIND_CODE[lin.kind] for lin in lins])
        self.norm_ptrs = (ctypes.c_void_p * (2 * cfg.num_layers))(
            *[t.data_ptr() for b in m.blocks for t in (b.attn_norm, b.ffn_norm)])
        self.cache_ptrs = (ctypes.c_void_p * (2 * cfg.num_layers))(
            *[t.data_ptr() for kc, vc in zip(m.k_cache, m.v_cache) for t in (kc, vc)])
        n_qkv = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
        self.scratch = torch.empty(3 * cfg.dim + n_qkv + cfg.num_heads * cfg.head_dim + 3 * cfg.hidden_dim + m.n_ctx)
        self._tables_for = m.k_cache[0]

    def _whole_step(self, x: torch.Tensor, pos: int) -> None:
        from kernels import cpu_gemv

        m, cfg = self.model, self.cfg
        if self._tables_for is not m.k_cache[0]:
            self._tables()
        dims = (ctypes.c_int * 8)(cfg.dim, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.hidden_dim,
                                  m.n_ctx, pos, cpu_gemv.threads())
        rc = self.lib.decode_layers(cfg.num_layers, dims, self.eps, self.scale, self.w_ptrs, self.kinds,
                                    self.norm_ptrs, self.cache_ptrs, m.cos[pos].data_ptr(), m.sin[pos].data_ptr(),
                                    x.data_ptr(), self.scratch.data_ptr())
        assert rc == 0, rc

    @staticmethod
    def usable(model) -> bool:
        b = model.blocks[0]
        return (model.device.type == "cpu" and b.qkv_bias is None and bool(model.k_cache)
                and model.k_cache[0].dtype == torch.float32 and model.cfg.head_dim <= 512)

    def step(self, token_id: int, pos: int) -> torch.Tensor:
        """Logits fp32 [1, vocab] for `token_id` at position `pos` (its K/V are written)."""
        m, lib, cfg = self.model, self.lib, self.cfg
        ptr = lambda t: t.data_ptr()  # noqa: E731
        x = m.embedding(torch.tensor([token_id])).reshape(cfg.dim).contiguous()  # [dim], updated in place
        if self.whole:
            self._whole_step(x, pos)
            lib.add_rmsnorm(x.data_ptr(), None, m.norm.data_ptr(), cfg.dim, self.eps, self.logits_norm.data_ptr())
            return m.output(self.logits_norm).float()
        cos, sin = m.cos[pos], m.sin[pos]  # [hd]
        scores = torch.empty(pos + 1)
        normed, attn, act = self.normed, self.attn, self.act
        pending = None  # the last layer's MLP output, added into x by the next norm
        n_ctx = m.n_ctx
        for block, kc, vc in zip(m.blocks, m.k_cache, m.v_cache):
            lib.add_rmsnorm(ptr(x), None if pending is None else ptr(pending), ptr(block.attn_norm), cfg.dim,
                            self.eps, ptr(normed))
            qkv = block.wqkv(normed.view(1, -1))  # [1, (nh + 2 nkv) hd]
            lib.rope_attend(ptr(qkv), cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, ptr(cos), ptr(sin),
                            ptr(kc), ptr(vc), pos, n_ctx, self.scale, ptr(attn), ptr(scores))
            o = block.wo(attn.view(1, -1))
            lib.add_rmsnorm(ptr(x), ptr(o), ptr(block.ffn_norm), cfg.dim, self.eps, ptr(normed))
            gate_up = block.w_gate_up(normed.view(1, -1))  # [1, 2 hidden]
            lib.silu_mul(ptr(gate_up), cfg.hidden_dim, ptr(act))
            pending = block.w_down(act.view(1, -1))
        lib.add_rmsnorm(ptr(x), ptr(pending), ptr(m.norm), cfg.dim, self.eps, ptr(self.logits_norm))
        return m.output(self.logits_norm).float()
