"""Plain reference attention: the ground truth every attention kernel is tested against.

Repeats K/V for grouped-query attention, materializes the full score matrix, applies the
causal mask and a softmax, all in one float dtype (fp32 by default, fp64 in tests). It is
deliberately slow and memory-hungry (T x S scores per head) and knows nothing of tiling,
paged KV pools, quantization or backend choice.
"""
from __future__ import annotations

import math

import torch


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool, q_offset: int | None = None,
              scale: float | None = None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Scaled dot-product attention, the obvious way.

    Args:
        q: `[T, num_heads, head_dim]`; query row i sits at key position `q_offset + i`.
        k, v: `[S, num_kv_heads, head_dim]`; num_heads must be a multiple of num_kv_heads
            (query head h uses KV head h // (num_heads // num_kv_heads)).
        causal: mask keys at positions greater than the query's position.
        q_offset: position of the first query; defaults to S - T (the queries are the last T keys).
        scale: score scale, default 1 / sqrt(head_dim).
        dtype: compute dtype (fp32, or fp64 for tests).
    Returns:
        `[T, num_heads, head_dim]` in `dtype`.
    """
    num_tokens, num_heads, head_dim = q.shape
    seq_len, num_kv_heads, _ = k.shape
    group = num_heads // num_kv_heads
    q_offset = seq_len - num_tokens if q_offset is None else q_offset
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    qh = q.to(dtype).transpose(0, 1)  # [num_heads, T, head_dim]
    kh = k.to(dtype).repeat_interleave(group, dim=1).transpose(0, 1)  # [num_heads, S, head_dim]
    vh = v.to(dtype).repeat_interleave(group, dim=1).transpose(0, 1)  # [num_heads, S, head_dim]
    scores = torch.matmul(qh, kh.transpose(1, 2)) * scale  # [num_heads, T, S]
    if causal:
        rows = torch.arange(num_tokens).view(-1, 1) + q_offset
        cols = torch.arange(seq_len).view(1, -1)
        scores = scores.masked_fill(cols > rows, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.matmul(probs, vh).transpose(0, 1)  # [T, num_heads, head_dim]
