"""The llama-family transformer, one readable file.

RMSNorm, rotary embeddings (rotate-half layout: the loader undoes GGUF's q/k
row permutation), grouped-query attention that never repeats K/V (the query
heads of each KV head are grouped into one matmul), fused QKV and gate/up
projections, SwiGLU, tied embeddings.

The residual stream, norms and attention run in fp32; the projections are
whatever linear modules the loader hands in (int4/int8 kernels that take bf16
inputs internally, or fp32 reference layers). K/V live only in the paged cache
(`kernels/kv_cache.py`: pools of fixed-size token blocks, fp32/fp16/bf16/int8);
a forward pass gets the sequence's block table, writes the new tokens' K/V into
their slots and attends over the table with the paged kernels of
`kernels/paged_attention.py`.

This file knows nothing about GGUF, tokenization, sampling or which blocks a
sequence owns (the block manager's business).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from kernels.paged_attention import paged_decode_attention, paged_prefill_attention
from kernels.kv_cache import PagedKVCache, read_layer, slot_tensor, write_layer

from edge_runtime.model.config import ModelConfig


@dataclass(slots=True)
class AttentionMetadata:
    """Where one forward pass of one sequence reads and writes K/V."""
    pos0: int  # position of the first new token
    slots: torch.Tensor  # long [num_tokens]: physical slots the new tokens' K/V go to
    block_table: torch.Tensor  # long [num_blocks_of_seq]
    seq_lens: torch.Tensor  # long [1]: pos0 + num_tokens

    @classmethod
    def build(cls, block_table: list[int], pos0: int, num_tokens: int, block_size: int, device) -> "AttentionMetadata":
        slots = slot_tensor(block_table, pos0, pos0 + num_tokens, block_size, device)
        table = torch.tensor(block_table, dtype=torch.long, device=device)
        return cls(pos0, slots, table, torch.tensor([pos0 + num_tokens], device=device))


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

    def qkv_rope(self, x, cos, sin) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x: [T, dim] -> q [T, nh, hd], k [T, nkv, hd] (both with RoPE), v [T, nkv, hd]."""
        num_tokens = x.shape[0]
        nh, nkv, hd = self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.wqkv(rms_norm(x, self.attn_norm, self.eps))  # [T, (nh + 2 nkv) hd]
        if self.qkv_bias is not None:
            qkv = qkv + self.qkv_bias
        # RoPE on q and k together: [T, nh + nkv, hd]
        qk = apply_rope(qkv[:, :(nh + nkv) * hd].view(num_tokens, nh + nkv, hd), cos, sin)
        return qk[:, :nh], qk[:, nh:], qkv[:, (nh + nkv) * hd:].view(num_tokens, nkv, hd)

    def out_mlp(self, x, attn) -> torch.Tensor:
        """Residual adds of the attention output projection and the SwiGLU MLP."""
        x = x + self.wo(attn.reshape(x.shape[0], self.num_heads * self.head_dim))
        gate_up = self.w_gate_up(rms_norm(x, self.ffn_norm, self.eps))  # [T, 2 * hidden]
        gate, up = gate_up.split([self.hidden_dim, self.hidden_dim], dim=-1)
        return x + self.w_down(F.silu(gate) * up)

    def forward(self, x, cos, sin, kv: PagedKVCache, layer: int, meta: AttentionMetadata):
        """x: [T, dim] fp32 at positions meta.pos0..; K/V of this layer go to / come from `kv`."""
        q, k, v = self.qkv_rope(x, cos, sin)
        kv.write(layer, meta.slots, k, v)
        if x.shape[0] == 1:  # grouped query heads over the sequence's blocks, online softmax
            attn = paged_decode_attention(q, kv, layer, meta.block_table.view(1, -1), meta.seq_lens, self.scale)
        else:  # causal, tiled over the blocks (positions 0..pos0 + T - 1)
            attn = paged_prefill_attention(q, kv, layer, meta.block_table, meta.pos0, self.scale)
        return self.out_mlp(x, attn)


class Transformer(nn.Module):
    """Embedding -> blocks -> final norm -> output head, over the paged KV cache."""

    def __init__(self, cfg: ModelConfig, embedding: nn.Module, blocks: list[Block], norm: torch.Tensor, output: nn.Module):
        super().__init__()
        self.cfg = cfg
        self.embedding = embedding  # ids [T] -> [T, dim] fp32
        self.blocks = nn.ModuleList(blocks)
        self.register_buffer("norm", norm)
        self.output = output
        self.n_ctx = 0
        self.kv: PagedKVCache | None = None
        self.identity_table: list[int] = []  # the block table used when the caller passes none
        self.block_step = None  # set by enable_compile(): the compiled decode step of one block
        self.fused = None  # set by enable_fused(): FusedDecoder for one-token steps
        self.last_hidden: torch.Tensor | None = None  # [dim] fp32: the final-normed state at the last position
        # layers whose output (the residual stream after them) drafters read too, EAGLE-3's fusion of layers:
        # then every hidden row the model reports (last_hidden, the fused step's rows) is `features()`'s
        self.taps: tuple[int, ...] = ()

    @property
    def device(self) -> torch.device:
        return self.norm.device

    def allocate_cache(self, n_ctx: int, num_blocks: int | None = None, block_size: int = 16,
                       kv_dtype: str = "fp32") -> None:
        """Paged K/V pools of `num_blocks` blocks (default: enough for one n_ctx sequence) and RoPE tables
        for positions < n_ctx. Without a block table, forward() uses blocks 0, 1, 2, ... in order."""
        cfg = self.cfg
        max_blocks = -(-n_ctx // block_size)
        num_blocks = num_blocks or max_blocks
        self.kv = PagedKVCache(cfg.num_layers, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim,
                               kv_dtype, self.device)
        self.cos, self.sin = rope_tables(cfg, n_ctx, self.device)
        self.n_ctx = n_ctx
        self.identity_table = list(range(min(num_blocks, max_blocks)))

    def enable_fused(self, lib) -> bool:
        """Route one-token steps through the C-fused decoder (see fused_decode.py) when it applies."""
        from edge_runtime.model.fused_decode import FusedDecoder

        self.fused = FusedDecoder(self, lib) if lib is not None and FusedDecoder.usable(self) else None
        return self.fused is not None

    def enable_compile(self, **compile_kwargs) -> None:
        """Compile the one-token block step. All blocks share one graph (their weights are inputs)."""
        self.block_step = torch.compile(_decode_block_gathered, **compile_kwargs)

    @torch.inference_mode()
    def forward(self, token_ids: torch.Tensor, pos0: int, all_logits: bool = False,
                block_table: list[int] | None = None) -> torch.Tensor:
        """token_ids: [T] at positions pos0.. of the sequence whose blocks are `block_table` (covering
        positions < pos0 + T) -> logits fp32 [T, vocab] (or [1, vocab] for the last)."""
        num_tokens = token_ids.shape[0]
        assert pos0 + num_tokens <= self.n_ctx, "caller checks the context length"
        table = self.identity_table if block_table is None else block_table
        if num_tokens == 1 and self.fused is not None:
            return self.fused.step(int(token_ids[0]), pos0, table)
        if self.fused is not None and self.fused.exact_prefill():
            return self.fused.prefill(token_ids.tolist(), pos0, table, all_logits)
        meta = AttentionMetadata.build(table, pos0, num_tokens, self.kv.block_size, self.device)
        x = self.embedding(token_ids)
        cos = self.cos[pos0:pos0 + num_tokens].unsqueeze(1)  # [T, 1, hd]
        sin = self.sin[pos0:pos0 + num_tokens].unsqueeze(1)
        tapped = []  # [T, dim] after each of self.taps
        if num_tokens == 1 and self.block_step is not None:  # compiled: one graph for every layer
            read_slots = slot_tensor(table, 0, pos0 + 1, self.kv.block_size, self.device)
            for layer, block in enumerate(self.blocks):
                x = self.block_step(block, x, cos, sin, self.kv.layer(layer), meta.slots, read_slots)
                tapped += [x] if layer in self.taps else []
        else:
            for layer, block in enumerate(self.blocks):
                x = block(x, cos, sin, self.kv, layer, meta)
                tapped += [x] if layer in self.taps else []
        h = rms_norm(x if all_logits else x[-1:], self.norm, self.cfg.norm_eps)  # [T or 1, dim]: what the head reads
        self.last_hidden = features(h[-1:], [t[-1:] for t in tapped])[0]  # NOTE: no copy without taps
        return self.output(h).float()


def features(normed: torch.Tensor, tapped: list[torch.Tensor]) -> torch.Tensor:
    """What drafters read for rows [N, dim]: the final-normed state, then the residual stream after each tapped
    layer ([N, (1 + taps) * dim]); without taps, `normed` itself."""
    return torch.cat([normed, *tapped], dim=-1) if tapped else normed


def _decode_block_gathered(block: Block, x, cos, sin, pools: tuple, slots, read_slots):
    """One-token block step on plain tensors for torch.compile: write K/V, gather the sequence's
    slots (traceable, unlike the tiled kernel's Python loop), attend with the query heads of each
    KV head grouped, MLP."""
    q, k, v = block.qkv_rope(x, cos, sin)
    write_layer(pools, slots, k, v)
    keys, values = read_layer(pools, read_slots)  # [S, nkv, hd]
    nkv, hd = keys.shape[1], keys.shape[2]
    qg = q.reshape(nkv, -1, hd)  # [nkv, group, hd]
    probs = torch.softmax(torch.bmm(qg, keys.permute(1, 2, 0)) * block.scale, dim=-1)  # [nkv, group, S]
    return block.out_mlp(x, torch.bmm(probs, values.transpose(0, 1)))
