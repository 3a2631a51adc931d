"""The llama-family transformer, one readable file.

RMSNorm, rotary embeddings (rotate-half layout: the loader undoes GGUF's q/k
row permutation), grouped-query attention that never repeats K/V (the query
heads of each KV head are grouped into one matmul), fused QKV and gate/up
projections, SwiGLU, tied embeddings.

The residual stream, norms and attention run in fp32; the projections are
whatever linear modules the loader hands in (int4/int8 kernels that take bf16
inputs internally, or fp32 reference layers). The KV cache is one static
buffer per layer, `[num_kv_heads, n_ctx, head_dim]`.

This file knows nothing about GGUF, tokenization or sampling.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .model_config import ModelConfig


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # x: [num_tokens, dim] fp32. NOTE: F.rms_norm measured ~2x slower here for one token.
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def rope_tables(cfg: ModelConfig, n_ctx: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin `[n_ctx, head_dim]` in the rotate-half layout, computed as transformers does."""
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.int64).float() / cfg.head_dim))
    t = torch.arange(n_ctx, dtype=torch.int64).float()
    freqs = torch.outer(t, inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(device), emb.sin().to(device)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [num_tokens, num_heads, head_dim]; cos/sin: [num_tokens, 1, head_dim]
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class Block(nn.Module):
    """One decoder layer: pre-norm attention + pre-norm SwiGLU MLP."""

    def __init__(self, cfg: ModelConfig, attn_norm, wqkv: nn.Module, wo: nn.Module, ffn_norm,
                 w_gate_up: nn.Module, w_down: nn.Module, qkv_bias: torch.Tensor | None = None):
        super().__init__()
        self.register_buffer("attn_norm", attn_norm)
        self.register_buffer("ffn_norm", ffn_norm)
        self.register_buffer("qkv_bias", qkv_bias)
        self.wqkv, self.wo, self.w_gate_up, self.w_down = wqkv, wo, w_gate_up, w_down
        self.eps = cfg.norm_eps
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.hidden_dim = cfg.hidden_dim
        self.scale = 1.0 / math.sqrt(cfg.head_dim)
        self.register_buffer("_zero", torch.zeros(()), persistent=False)  # baddbmm input, ignored (beta=0)

    def forward(self, x, cos, sin, k_cache, v_cache, pos0: int):
        """x: [T, dim] fp32 at positions pos0..pos0+T-1; k/v_cache: [num_kv_heads, n_ctx, head_dim]."""
        num_tokens = x.shape[0]
        nh, nkv, hd = self.num_heads, self.num_kv_heads, self.head_dim
        group = nh // nkv
        qkv = self.wqkv(rms_norm(x, self.attn_norm, self.eps))  # [T, (nh + 2 nkv) hd]
        if self.qkv_bias is not None:
            qkv = qkv + self.qkv_bias
        # RoPE on q and k together: [T, nh + nkv, hd]
        qk = apply_rope(qkv[:, :(nh + nkv) * hd].view(num_tokens, nh + nkv, hd), cos, sin)
        q, k = qk[:, :nh], qk[:, nh:]
        v = qkv[:, (nh + nkv) * hd:].view(num_tokens, nkv, hd)
        end = pos0 + num_tokens
        k_cache[:, pos0:end] = k.transpose(0, 1)
        v_cache[:, pos0:end] = v.transpose(0, 1)
        keys, values = k_cache[:, :end], v_cache[:, :end]  # [nkv, S, hd]
        # Group the query heads of each KV head: [nkv, group * T, hd]; K/V are never repeated.
        qg = q.reshape(num_tokens, nkv, group, hd).permute(1, 2, 0, 3).reshape(nkv, group * num_tokens, hd)
        scores = torch.baddbmm(self._zero, qg, keys.transpose(1, 2), beta=0.0, alpha=self.scale)  # [nkv, group*T, S]
        if num_tokens > 1:
            rows = torch.arange(num_tokens, device=x.device).view(num_tokens, 1) + pos0
            cols = torch.arange(end, device=x.device).view(1, end)
            mask = torch.zeros(num_tokens, end, device=x.device).masked_fill(cols > rows, float("-inf"))
            scores = (scores.view(nkv, group, num_tokens, end) + mask).view(nkv, group * num_tokens, end)
        probs = torch.softmax(scores, dim=-1)
        attn = torch.bmm(probs, values)  # [nkv, group * T, hd]
        attn = attn.view(nkv, group, num_tokens, hd).permute(2, 0, 1, 3).reshape(num_tokens, nh * hd)
        x = x + self.wo(attn)
        gate_up = self.w_gate_up(rms_norm(x, self.ffn_norm, self.eps))  # [T, 2 * hidden]
        gate, up = gate_up.split([self.hidden_dim, self.hidden_dim], dim=-1)
        return x + self.w_down(F.silu(gate) * up)


class Transformer(nn.Module):
    """Embedding -> blocks -> final norm -> output head, over a static per-layer KV buffer."""

    def __init__(self, cfg: ModelConfig, embedding: nn.Module, blocks: list[Block], norm: torch.Tensor, output: nn.Module):
        super().__init__()
        self.cfg = cfg
        self.embedding = embedding  # ids [T] -> [T, dim] fp32
        self.blocks = nn.ModuleList(blocks)
        self.register_buffer("norm", norm)
        self.output = output
        self.n_ctx = 0
        self.k_cache: list[torch.Tensor] = []
        self.v_cache: list[torch.Tensor] = []
        self.block_step = None  # set by enable_compile(): the compiled decode step of one block
        self.fused = None  # set by enable_fused(): FusedDecoder for one-token steps

    @property
    def device(self) -> torch.device:
        return self.norm.device

    def allocate_cache(self, n_ctx: int, dtype: torch.dtype = torch.float32) -> None:
        cfg = self.cfg
        shape = (cfg.num_kv_heads, n_ctx, cfg.head_dim)
        self.k_cache = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(cfg.num_layers)]
        self.v_cache = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(cfg.num_layers)]
        self.cos, self.sin = rope_tables(cfg, n_ctx, self.device)
        self.n_ctx = n_ctx

    def enable_fused(self, lib) -> bool:
        """Route one-token steps through the C-fused decoder (see fused_decode.py) when it applies."""
        from .fused_decode import FusedDecoder

        self.fused = FusedDecoder(self, lib) if lib is not None and FusedDecoder.usable(self) else None
        return self.fused is not None

    def enable_compile(self, **compile_kwargs) -> None:
        """Compile the one-token block step. All blocks share one graph (their weights are inputs)."""
        self.block_step = torch.compile(_block_forward, **compile_kwargs)

    @torch.inference_mode()
    def forward(self, token_ids: torch.Tensor, pos0: int, all_logits: bool = False) -> torch.Tensor:
        """token_ids: [T] at positions pos0.. -> logits fp32 [T, vocab] (or [1, vocab] for the last)."""
        num_tokens = token_ids.shape[0]
        assert pos0 + num_tokens <= self.n_ctx, "caller checks the context length"
        if num_tokens == 1 and self.fused is not None:
            return self.fused.step(int(token_ids[0]), pos0)
        x = self.embedding(token_ids)
        cos = self.cos[pos0:pos0 + num_tokens].unsqueeze(1)  # [T, 1, hd]
        sin = self.sin[pos0:pos0 + num_tokens].unsqueeze(1)
        step = self.block_step if (num_tokens == 1 and self.block_step is not None) else _block_forward
        for block, kc, vc in zip(self.blocks, self.k_cache, self.v_cache):
            x = step(block, x, cos, sin, kc, vc, pos0)
        if not all_logits:
            x = x[-1:]
        return self.output(rms_norm(x, self.norm, self.cfg.norm_eps)).float()


def _block_forward(block: Block, x, cos, sin, k_cache, v_cache, pos0: int):
    return block(x, cos, sin, k_cache, v_cache, pos0)
