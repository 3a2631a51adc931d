"""The one-token decode step with the small per-layer ops fused in C.

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
