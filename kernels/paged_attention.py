"""Paged attention: a prompt chunk or one new token per sequence against a `PagedKVCache`.

- `paged_decode_attention`: one new token per sequence, tiles of many blocks gathered for the
  whole batch at once, int8 scales folded into the tile's scores.
- `paged_prefill_attention`: a prompt chunk (also after a prefix-cache hit) against its blocks,
  through the same online-softmax tiles and backend switch as `attention.py`.
Both honour `cache.rotated` (int8 rows stored Hadamard-rotated): q is rotated in and the output
back out, since (qH)(kH)^T = qk^T and sum p (vH) = (sum p v) H.

NOTE: pools come from torch.empty, so slots past a sequence's length may hold NaN: tiles are
sliced to the sequence's length and padding is hidden with masked_fill, never multiplied by 0.

This module knows nothing of the model or of which blocks a sequence owns: callers pass block
tables and lengths.
"""
from __future__ import annotations

import math

import torch

from kernels.attention import LOG2E, TILE_K, TILE_Q, _resolve, _sdpa, _tiled, _workspace, backend_calls, choose_backend
from kernels.kv_cache import PagedKVCache, hadamard_rotate

DECODE_TILE_TOKENS = 2048  # keys per paged-decode tile (rounded to whole blocks)
SPAN_K = 2048  # keys a paged prefill gathers (and dequantizes) at once, rounded to whole blocks


def _gather_kv(cache: PagedKVCache, layer: int, blocks: torch.Tensor, num_tokens: int, *,
               dequantize: bool = True) -> tuple[torch.Tensor, ...]:
    """K and V of the first `num_tokens` slots of each row of `blocks` (long [B, nb]), in workspace.

    Returns (k, v, k_scale, v_scale): k, v fp32 `[B, num_tokens, num_kv_heads, head_dim]` (the
    pool's own layout, so the conversion is one contiguous pass); for an int8 cache with
    dequantize=False, the raw int8 values as fp32 plus their scales `[B, num_tokens, num_kv_heads]`,
    else scales None.
    NOTE: the slice to num_tokens drops the unwritten tail of the last block before any arithmetic.
    """
    batch, nkv, hd = blocks.shape[0], cache.num_kv_heads, cache.head_dim
    flat = blocks.reshape(-1)
    gathered = (flat.numel(), cache.block_size, nkv, hd)
    out, scales = [], [None, None]
    for name, pool in (("k", cache.k[layer]), ("v", cache.v[layer])):
        raw = torch.index_select(pool, 0, flat, out=_workspace(name + "_raw", gathered, pool.dtype))
        raw = raw.view(batch, -1, nkv, hd)[:, :num_tokens]
        if pool.dtype == torch.float32 and raw.is_contiguous():
            out.append(raw)
        else:
            out.append(_workspace(name, (batch, num_tokens, nkv, hd)).copy_(raw))
    if cache.quantized:
        for i, (name, pool) in enumerate((("ks", cache.k_scale[layer]), ("vs", cache.v_scale[layer]))):
            sc = torch.index_select(pool, 0, flat, out=_workspace(name, gathered[:3]))
            scales[i] = sc.view(batch, -1, nkv)[:, :num_tokens]
        if dequantize:
            for x, sc in zip(out, scales):
                x.mul_(sc.unsqueeze(-1))
            scales = [None, None]
    return out[0], out[1], scales[0], scales[1]


def paged_prefill_attention(q: torch.Tensor, cache: PagedKVCache, layer: int, block_table, q_offset: int,
                            scale: float | None = None, tile_q: int = TILE_Q, tile_k: int = TILE_K,
                            span_k: int = SPAN_K) -> torch.Tensor:
    """Causal attention of a prompt chunk against its sequence's paged K/V.

    Args:
        q: `[T, num_heads, head_dim]` for positions q_offset .. q_offset + T - 1.
        cache, layer: the pools; K/V of positions 0 .. q_offset + T - 1 must already be written.
        block_table: the sequence's block ids (list[int] or long tensor), at least
            ceil((q_offset + T) / block_size) of them.
        tile_q, tile_k: tokens / keys per score tile.
        span_k: keys gathered (and dequantized) at once, rounded to whole blocks: the KV tile
            is a group of blocks, fetched once for all query chunks.
    Returns:
        `[T, num_heads, head_dim]` fp32.
    """
    bs, nkv = cache.block_size, cache.num_kv_heads
    num_keys = q_offset + q.shape[0]
    q_offset, scale = _resolve(q, num_keys, nkv, True, q_offset, scale)
    table = torch.as_tensor(block_table, dtype=torch.long)
    if table.numel() * bs < num_keys:
        raise ValueError(f"block table of {table.numel()} blocks cannot hold {num_keys} tokens")
    rotated = getattr(cache, "rotated", False)
    if rotated:  # K/V rows live in the Hadamard basis: rotate q in, the output back (H H = I)
        q = hadamard_rotate(q)
    if choose_backend(causal=True, q_offset=q_offset, num_tokens=q.shape[0], num_keys=num_keys) == "sdpa":
        k, v, _, _ = _gather_kv(cache, layer, table[None, :-(-num_keys // bs)], num_keys)
        out = _sdpa(q, k[0].transpose(0, 1), v[0].transpose(0, 1), causal=True, q_offset=q_offset, scale=scale)
    else:
        span = max(1, round(span_k / bs)) * bs

        def kv_span(s0: int, s1: int):
            k, v, _, _ = _gather_kv(cache, layer, table[None, s0 // bs:-(-s1 // bs)], s1 - s0)
            return k[0].transpose(0, 1), v[0].transpose(0, 1)  # [nkv, s1 - s0, head_dim] views

        backend_calls["tiled"] += 1
        out = _tiled(q, kv_span, num_keys, nkv, causal=True, q_offset=q_offset, scale=scale, tile_q=tile_q,
                     tile_k=tile_k, span=span)
    return hadamard_rotate(out) if rotated else out


def paged_decode_attention(q: torch.Tensor, cache: PagedKVCache, layer: int, block_tables: torch.Tensor,
                           seq_lens: torch.Tensor, scale: float | None = None,
                           tile_tokens: int = DECODE_TILE_TOKENS) -> torch.Tensor:
    """Attention of one new token per sequence (already written to the cache) over its paged K/V.

    Args:
        q: `[B, num_heads, head_dim]`, the token at position seq_lens[b] - 1 of sequence b.
        block_tables: long `[B, max_blocks]`, padded with anything past each sequence's blocks.
        seq_lens: long `[B]`, tokens in each sequence including the new one (>= 1).
        tile_tokens: keys per tile, rounded to whole blocks; each tile is gathered for the whole
            batch at once and folded in with an online softmax.
    Returns:
        `[B, num_heads, head_dim]` fp32.
    """
    batch, num_heads, head_dim = q.shape
    bs, nkv = cache.block_size, cache.num_kv_heads
    group = num_heads // nkv
    lens = [int(n) for n in seq_lens.tolist()]
    _, scale = _resolve(q, 1, nkv, False, 0, scale)
    if batch == 0:
        return torch.empty(0, num_heads, head_dim)
    if min(lens) < 1 or max(lens) > block_tables.shape[1] * bs:
        raise ValueError(f"seq_lens {lens} out of range for block tables of {block_tables.shape[1]} blocks")
    max_len = max(lens)
    ragged = min(lens) != max_len
    tables = block_tables.long()
    if ragged:  # padded entries may be any id: point them at block 0 (masked below)
        used = torch.arange(tables.shape[1]).view(1, -1) < (seq_lens.view(-1, 1) + bs - 1) // bs
        tables = tables.masked_fill(~used, 0)
    rotated = getattr(cache, "rotated", False)  # int8 rows in the Hadamard basis: rotate q in, output out
    q = hadamard_rotate(q) if rotated else q.float()
    qt = (q * (scale * LOG2E)).view(batch, nkv, group, head_dim).transpose(0, 1)  # [nkv, B, group, hd]
    m = torch.full((nkv, batch, group, 1), -math.inf)
    l = torch.zeros(nkv, batch, group, 1)
    acc = torch.zeros(nkv, batch, group, head_dim)
    tile_blocks = max(1, tile_tokens // bs)
    backend_calls["paged_decode"] += 1
    for j0 in range(0, -(-max_len // bs), tile_blocks):
        k0 = j0 * bs
        k1 = min(k0 + tile_blocks * bs, max_len)  # slice off slots no sequence has reached
        k, v, ks, vs = _gather_kv(cache, layer, tables[:, j0:-(-k1 // bs)], k1 - k0, dequantize=False)
        hidden = None  # [B, tk] slots past a sequence's end (ragged batches only)
        if ragged and min(lens) < k1:
            hidden = torch.arange(k0, k1).view(1, -1) >= seq_lens.view(-1, 1)
            v.masked_fill_(hidden[:, :, None, None], 0.0)  # NaN * 0 would leak: select instead
            vs = vs.masked_fill(hidden[:, :, None], 0.0) if vs is not None else None
        _decode_update(qt, k, v, ks, vs, hidden, m, l, acc)
    out = acc.div_(l).transpose(0, 1).reshape(batch, num_heads, head_dim)
    return hadamard_rotate(out) if rotated else out


def _decode_update(qt, k, v, ks, vs, hidden, m, l, acc) -> None:
    """One online-softmax step (log2 domain) of decode rows, in place on (m, l, acc).

    qt: [nkv, B, group, hd] scaled by scale * log2(e); k, v: [B, tk, nkv, hd] fp32 (raw int8
    values when ks/vs, the per-(token, head) scales [B, tk, nkv], are given: they are folded into
    the scores and the probabilities, which dequantizes without a pass over the tile);
    hidden: bool [B, tk] or None, applied with masked_fill: hidden slots may hold NaN;
    m, l: [nkv, B, group, 1]; acc: [nkv, B, group, hd].
    """
    nkv = qt.shape[0]
    s = torch.empty(nkv, k.shape[0], qt.shape[2], k.shape[1])  # [nkv, B, group, tk]
    for h in range(nkv):  # K/V stay in the pool's [token, head] layout: one strided matmul per KV head
        torch.bmm(qt[h], k[:, :, h].transpose(1, 2), out=s[h])
    if ks is not None:
        s.mul_(ks.permute(2, 0, 1).unsqueeze(2))
    if hidden is not None:
        s.masked_fill_(hidden[None, :, None, :], -math.inf)
    m_new = torch.maximum(m, s.amax(dim=-1, keepdim=True))
    s.sub_(m_new).exp2_()
    alpha = torch.sub(m, m_new).exp2_()
    l.mul_(alpha).add_(s.sum(dim=-1, keepdim=True))
    if vs is not None:
        s.mul_(vs.permute(2, 0, 1).unsqueeze(2))
    acc.mul_(alpha)
    for h in range(nkv):
        acc[h].baddbmm_(s[h], v[:, :, h])
    m.copy_(m_new)
