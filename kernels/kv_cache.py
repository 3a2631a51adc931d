"""Paged KV storage: per-layer K and V pools of fixed-size token blocks.

Each layer has a K pool and a V pool `[num_blocks, block_size, num_kv_heads, head_dim]`
(one tensor over all layers, so C kernels get one base pointer), in fp32, fp16 or bf16,
or int8 with one fp32 scale per (token, head) (`[num_blocks, block_size, num_kv_heads]`,
symmetric: x ~ q * scale, q in [-127, 127]).

int8 rows are stored in a rotated basis (QuaRot-style): each K and V row is multiplied by
the normalized Hadamard matrix H (orthogonal and symmetric, so H H = I) before
quantization. A few large channels then no longer set the scale of a whole row; measured on
the default model, int8 K/V keep 99.4 % top-1 agreement with fp16 K/V instead of 98.8 %.
Attention is basis-free: (qH)(kH)^T = q k^T, and sum p (vH) = (sum p v) H, so kernels
rotate the query in and the output back out (`rotated` is False for other dtypes and for a
head size that is not a power of two). `hadamard_rotate` is a butterfly (fast Walsh-Hadamard
transform) whose additions run in the same order as cpu_decode.c's, so both round alike. A token's physical slot is
`block * block_size + offset`; which blocks a sequence owns is the block manager's
business (edge_runtime/engine/block_manager.py), not this module's.

NOTE: pools are allocated with torch.empty, so memory is only touched (and counted in
RSS) as blocks are written, and unwritten slots hold garbage, possibly NaN. Readers must
never touch slots past a sequence's length.
"""
from __future__ import annotations

import math

import torch

KV_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16, "int8": torch.int8}
INT8_MAX = 127.0


def quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [..., head_dim] float -> (q int8 [..., head_dim], scale fp32 [...]), per-row symmetric."""
    x = x.float()
    scale = x.abs().amax(dim=-1) / INT8_MAX
    q = torch.round(x / scale.clamp_min(1e-30).unsqueeze(-1)).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q, scale


def hadamard_rotate(x: torch.Tensor) -> torch.Tensor:
    """x [..., n] (n a power of two) -> x @ H / sqrt(n), H the Sylvester Hadamard matrix; its own inverse."""
    n = x.shape[-1]
    lead = x.shape[:-1]
    y = x.float()
    h = 1
    while h < n:
        pairs = y.reshape(*lead, n // (2 * h), 2, h)
        a, b = pairs[..., 0, :], pairs[..., 1, :]
        y = torch.stack((a + b, a - b), dim=-2).reshape(*lead, n)
        h *= 2
    return y * (1.0 / math.sqrt(n))


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    return q.to(dtype) * scale.to(dtype).unsqueeze(-1)


class PagedKVCache:
    """K/V pools for every layer. `k[layer]`, `v[layer]`: `[num_blocks, block_size, num_kv_heads, head_dim]`."""

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 kv_dtype: str = "fp16", device: torch.device | str = "cpu"):
        if kv_dtype not in KV_DTYPES:
            raise ValueError(f"kv dtype must be one of {', '.join(KV_DTYPES)}, not {kv_dtype!r}")
        if min(num_layers, num_blocks, block_size, num_kv_heads, head_dim) < 1:
            raise ValueError("paged KV cache dimensions must all be >= 1")
        self.num_layers, self.num_blocks, self.block_size = num_layers, num_blocks, block_size
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim
        self.kv_dtype = kv_dtype
        self.dtype = KV_DTYPES[kv_dtype]
        self.device = torch.device(device)
        shape = (num_layers, num_blocks, block_size, num_kv_heads, head_dim)
        self.k_pool = torch.empty(shape, dtype=self.dtype, device=self.device)
        self.v_pool = torch.empty(shape, dtype=self.dtype, device=self.device)
        self.quantized = kv_dtype == "int8"
        if self.quantized:
            self.k_scale_pool = torch.empty(shape[:-1], dtype=torch.float32, device=self.device)
            self.v_scale_pool = torch.empty(shape[:-1], dtype=torch.float32, device=self.device)
        else:
            self.k_scale_pool = self.v_scale_pool = None
        hd_pow2 = (head_dim & (head_dim - 1)) == 0
        self.rotated = self.quantized and hd_pow2  # int8 rows live in the Hadamard basis (see above)
        self.k = list(self.k_pool.unbind(0))
        self.v = list(self.v_pool.unbind(0))
        self.k_scale = list(self.k_scale_pool.unbind(0)) if self.quantized else [None] * num_layers
        self.v_scale = list(self.v_scale_pool.unbind(0)) if self.quantized else [None] * num_layers

    # ---- sizes ---------------------------------------------------------------------------------
    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, kv_dtype: str) -> int:
        """K + V bytes one token takes over all layers (int8 includes its per-(token, head) scales)."""
        if kv_dtype not in KV_DTYPES:
            raise ValueError(f"kv dtype must be one of {', '.join(KV_DTYPES)}, not {kv_dtype!r}")
        elem = torch.empty((), dtype=KV_DTYPES[kv_dtype]).element_size()
        per_head = head_dim * elem + (4 if kv_dtype == "int8" else 0)
        return 2 * num_layers * num_kv_heads * per_head

    @classmethod
    def blocks_for_budget(cls, budget_bytes: int, num_layers: int, block_size: int, num_kv_heads: int,
                          head_dim: int, kv_dtype: str) -> int:
        return int(budget_bytes // (block_size * cls.bytes_per_token(num_layers, num_kv_heads, head_dim, kv_dtype)))

    @property
    def nbytes(self) -> int:
        n = self.k_pool.nbytes + self.v_pool.nbytes
        if self.quantized:
            n += self.k_scale_pool.nbytes + self.v_scale_pool.nbytes
        return n

    # ---- writing and reading -------------------------------------------------------------------
    def layer(self, layer: int) -> tuple:
        """This layer's (k pool, v pool, k scales, v scales, rotated) (scales None unless int8)."""
        return self.k[layer], self.v[layer], self.k_scale[layer], self.v_scale[layer], self.rotated

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """slots: long [T] physical slot ids; k, v: [T, num_kv_heads, head_dim] (any float dtype)."""
        write_layer(self.layer(layer), slots, k, v)

    def read(self, layer: int, slots: torch.Tensor, dtype=torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
        """Gather (and dequantize) the K/V of `slots` (long [S]) -> two `[S, num_kv_heads, head_dim]` tensors."""
        return read_layer(self.layer(layer), slots, dtype)

    def copy_blocks(self, pairs) -> None:
        """Copy whole blocks in every layer: pairs of (src, dst) block ids (copy-on-write)."""
        for pair in pairs:
            src, dst = (pair.src, pair.dst) if hasattr(pair, "src") else pair
            self.k_pool[:, dst] = self.k_pool[:, src]
            self.v_pool[:, dst] = self.v_pool[:, src]
            if self.quantized:
                self.k_scale_pool[:, dst] = self.k_scale_pool[:, src]
                self.v_scale_pool[:, dst] = self.v_scale_pool[:, src]

    def copy_slots(self, src: list[int], dst: list[int]) -> None:
        """Copy single slots in every layer, src[i] -> dst[i], bytes as stored (a draft tree's accepted
        path moved onto consecutive positions), in order."""
        bs = self.block_size
        for a, b in zip(src, dst):
            if a == b:
                continue
            pools = (self.k_pool, self.v_pool) + ((self.k_scale_pool, self.v_scale_pool) if self.quantized else ())
            for pool in pools:
                pool[:, b // bs, b % bs] = pool[:, a // bs, a % bs]


def write_layer(pools: tuple, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """`PagedKVCache.write` on one layer's (k, v, k_scale, v_scale) tensors (plain tensors: torch.compile
    traces it without guarding on a cache object)."""
    kp, vp, ks, vs, rotated = pools
    nkv, hd = kp.shape[-2], kp.shape[-1]
    kf, vf = kp.view(-1, nkv, hd), vp.view(-1, nkv, hd)
    if rotated:
        k, v = hadamard_rotate(k), hadamard_rotate(v)
    if ks is not None:
        kq, kscale = quantize_int8(k)
        vq, vscale = quantize_int8(v)
        kf[slots] = kq
        vf[slots] = vq
        ks.view(-1, nkv)[slots] = kscale
        vs.view(-1, nkv)[slots] = vscale
    else:
        kf[slots] = k.to(kp.dtype)
        vf[slots] = v.to(vp.dtype)


def read_layer(pools: tuple, slots: torch.Tensor, dtype=torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """`PagedKVCache.read` on one layer's tensors: `[S, num_kv_heads, head_dim]` K and V in `dtype`, in the
    model's basis (rotated rows are rotated back)."""
    kp, vp, ks, vs, rotated = pools
    nkv, hd = kp.shape[-2], kp.shape[-1]
    kf, vf = kp.view(-1, nkv, hd)[slots], vp.view(-1, nkv, hd)[slots]
    if ks is not None:
        k, v = dequantize_int8(kf, ks.view(-1, nkv)[slots]), dequantize_int8(vf, vs.view(-1, nkv)[slots])
        if rotated:
            k, v = hadamard_rotate(k), hadamard_rotate(v)
        return k.to(dtype), v.to(dtype)
    return kf.to(dtype), vf.to(dtype)


def slot_tensor(block_table: list[int], start: int, end: int, block_size: int, device="cpu") -> torch.Tensor:
    """Physical slots (long [end - start]) of positions [start, end) of a sequence with this block table."""
    pos = torch.arange(start, end)
    table = torch.tensor(block_table, dtype=torch.long)
    return (table[pos // block_size] * block_size + pos % block_size).to(device)
