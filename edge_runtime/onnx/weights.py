"""GGUF weights as onnxruntime `MatMulNBits` / `GatherBlockQuantized` blocks.

Weight-only quantization for the ONNX export (`export.py`), mapping the
GGUF's own blocks where the formats meet, so the exported model computes with
the same weights as the native engine:

- Q4_1 (d, m, 32 nibbles: w = d q + m) -> 4 bits, scale d, an integer zero
  point zp = round(-m / d), and the remainder m + zp d kept as a per-block
  additive term (`mins`): the graph adds sum over blocks of that term times
  sum(x in block) with one small MatMul. Exact up to fp32 rounding.
- Q4_0 (w = d (q - 8)) -> 4 bits, zero point 8. Exact.
- Q8_0 (d, 32 int8) -> 8 bits, codes q + 128, zero point 128. Exact.
- anything else (F32, F16, K-quants, ...) is dequantized and quantized again by
  round-to-nearest per block of 32: 4 bits asymmetric or 8 bits symmetric.
  This is the only lossy case.

MatMulNBits packs 4-bit codes two per byte, element 2i in the low nibble; GGUF
packs byte j as q[j] (low) and q[j + 16] (high): `_repack_nibbles` converts.
NOTE: zero points are always uint8. Measured here (onnxruntime 1.32, 2 threads,
a 3072 x 576 weight, one row): float zero points (which would map Q4_1's m / d
directly) take 2.7 ms, a dequantize-then-GEMM path; uint8 ones 0.23 ms at
accuracy level 0 and 0.07 ms at level 4 (int8 activations). 8-bit weights at
level 0 take 5.8 ms, at level 4 0.07 ms.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from gguf import GGMLQuantizationType as T

BLOCK = 32


@dataclass
class NBits:
    """One weight [N, K] as MatMulNBits wants it."""
    bits: int
    packed: np.ndarray  # uint8 [N, K / 32, 32 * bits / 8]
    scales: np.ndarray  # float32 [N, K / 32]
    zero_points: np.ndarray  # uint8 [N, K / 32], one per block (the graph packs 4-bit ones two per byte)
    mins: np.ndarray | None = None  # float32 [N, K / 32]: added to every weight of the block (Q4_1's m)

    @property
    def n(self) -> int:
        return self.packed.shape[0]

    @property
    def k(self) -> int:
        return self.packed.shape[1] * BLOCK

    def dequantize(self) -> np.ndarray:
        """float32 [N, K]: what onnxruntime computes with (tests, checks)."""
        if self.bits == 4:
            lo, hi = self.packed & 0xF, self.packed >> 4
            q = np.stack([lo, hi], axis=-1).reshape(self.n, -1, BLOCK)
        else:
            q = self.packed
        w = (q.astype(np.float32) - self.zero_points[..., None].astype(np.float32)) * self.scales[..., None]
        if self.mins is not None:
            w = w + self.mins[..., None]
        return w.reshape(self.n, self.k)

    def packed_zero_points(self) -> np.ndarray:
        """uint8 [N * ceil(blocks * bits / 8)]: MatMulNBits' layout (4 bits: block 2i in the low nibble)."""
        if self.bits == 8:
            return self.zero_points.reshape(-1)
        z = self.zero_points
        if z.shape[1] % 2:
            z = np.pad(z, ((0, 0), (0, 1)))
        return (z[:, 0::2] | (z[:, 1::2] << 4)).astype(np.uint8).reshape(-1)


def _f16(raw: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(raw).view(np.float16).astype(np.float32)[..., 0]


def _repack_nibbles(qs: np.ndarray) -> np.ndarray:
    """GGUF nibbles [.., 16] (byte j: q[j] | q[j + 16] << 4) -> MatMulNBits [.., 16] (q[2i] | q[2i + 1] << 4)."""
    q = np.concatenate([qs & 0xF, qs >> 4], axis=-1)  # q[0..31]
    return (q[..., 0::2] | (q[..., 1::2] << 4)).astype(np.uint8)


def from_gguf_rows(qtype, rows: np.ndarray, in_features: int, bits: int | None = None) -> NBits:
    """GGUF raw rows uint8 [N, row_bytes] of type `qtype` -> NBits. `bits` forces 4 or 8 (default: the
    exact mapping of the block type: 4 for Q4_0/Q4_1, 8 for Q8_0, 4 for anything else)."""
    qtype = T(qtype)
    n = rows.shape[0]
    if in_features % BLOCK:
        raise ValueError(f"in_features {in_features} is not a multiple of {BLOCK}")
    nb = in_features // BLOCK
    native = {T.Q4_0: 4, T.Q4_1: 4, T.Q8_0: 8}.get(qtype)
    want = bits or native or 4
    if qtype in (T.Q4_0, T.Q4_1) and want == 4:
        size = 18 if qtype == T.Q4_0 else 20
        blk = np.ascontiguousarray(rows).reshape(n, nb, size)
        d = _f16(blk[..., 0:2])
        qs = blk[..., size - 16:]
        packed = _repack_nibbles(qs)
        if qtype == T.Q4_0:
            return NBits(4, packed, d, np.full((n, nb), 8, np.uint8))
        m = _f16(blk[..., 2:4])
        # Center the codes on an integer zero point and keep only the remainder as the additive term: the
        # same weights, but at accuracy level 4 the int8 rounding of x then meets centred weights (q - zp)
        # instead of 0..15 (measured on a 1536 x 576 weight, random x: max error 0.24 -> 0.10 of 17).
        with np.errstate(divide="ignore", invalid="ignore"):
            zp = np.where(d == 0, 0, np.rint(-m / np.where(d == 0, 1, d))).clip(0, 15).astype(np.uint8)
        return NBits(4, packed, d, zp, (m + zp.astype(np.float32) * d).astype(np.float32))
    if qtype == T.Q8_0 and want == 8:
        blk = np.ascontiguousarray(rows).reshape(n, nb, 34)
        codes = (blk[..., 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
        return NBits(8, codes, _f16(blk[..., 0:2]), np.full((n, nb), 128, np.uint8))
    from kernels.gguf_blocks import dequantize

    return quantize(dequantize(qtype, rows, (n, in_features)), want)


def quantize(w: np.ndarray, bits: int) -> NBits:
    """Round-to-nearest per block of 32 of float weights [N, K]: 4 bits asymmetric, 8 bits symmetric."""
    n, k = w.shape
    blocks = w.astype(np.float32).reshape(n, k // BLOCK, BLOCK)
    if bits == 8:
        amax = np.abs(blocks).max(-1)
        scale = (amax / 127.0).astype(np.float32)
        q = np.rint(blocks / np.where(scale == 0, 1.0, scale)[..., None]).clip(-127, 127)
        return NBits(8, (q + 128).astype(np.uint8), scale, np.full((n, k // BLOCK), 128, np.uint8))
    if bits != 4:
        raise ValueError(f"bits must be 4 or 8, got {bits}")
    lo, hi = np.minimum(blocks.min(-1), 0), np.maximum(blocks.max(-1), 0)  # the range holds 0: zp is a code
    scale = ((hi - lo) / 15.0).astype(np.float32)
    safe = np.where(scale == 0, 1.0, scale)
    zp = np.rint(-lo / safe).clip(0, 15)
    q = np.rint(blocks / safe[..., None] + zp[..., None]).clip(0, 15).astype(np.uint8)
    return NBits(4, (q[..., 0::2] | (q[..., 1::2] << 4)).astype(np.uint8), scale, zp.astype(np.uint8))


def concat(parts: list[NBits]) -> NBits | None:
    """Stack weights of the same bit width along N (fused QKV, gate/up); None when the widths differ."""
    if len({p.bits for p in parts}) != 1 or len({p.k for p in parts}) != 1:
        return None
    mins = None
    if any(p.mins is not None for p in parts):
        mins = np.concatenate([np.zeros_like(p.scales) if p.mins is None else p.mins for p in parts])
    return NBits(parts[0].bits, *(np.concatenate([getattr(p, f) for p in parts])
                                  for f in ("packed", "scales", "zero_points")), mins)


def split_8bit(w: NBits) -> tuple[NBits, NBits]:
    """8-bit codes u (zero point 128) as two 4-bit weights with the same sum: d (u - 128) = 16 d (h - 8) + d l
    for u = 16 h + l. Exact; for kernels that only have a fast 4-bit path."""
    if w.bits != 8 or np.any(w.zero_points != 128) or w.mins is not None:
        raise ValueError("split_8bit takes 8-bit weights with zero point 128")
    hi, lo = w.packed >> 4, w.packed & 0xF
    pack = lambda q: (q[..., 0::2] | (q[..., 1::2] << 4)).astype(np.uint8)  # noqa: E731
    shape = w.zero_points.shape
    return (NBits(4, pack(hi), (w.scales * 16).astype(np.float32), np.full(shape, 8, np.uint8)),
            NBits(4, pack(lo), w.scales, np.zeros(shape, np.uint8)))
