"""Decode raw GGUF tensor rows into plain numpy arrays for the quantized kernels.

Input is always "rows": the raw tensor data as `gguf.GGUFReader` exposes it
(`uint8 [rows, bytes_per_row]` for block types, a typed `[rows, cols]` array
for F32/F16), possibly several tensors' rows concatenated or permuted by the
caller. Every function works per row, so fused or reordered rows are fine.

Exact dequantization is delegated to `gguf.quants.dequantize` (the reference
for what the file means). The block decoders here (`int4_groups`,
`q8_0_blocks`) re-express the same values in the kernel-friendly form
`value = (q - 8) * scale + zero` per group of 32 (4-bit types) or
`value = q * d` per block of 32 (Q8_0), and the tests check them against gguf.

Pure numpy: this module knows nothing about torch, devices or what the
tensors mean in a model.
"""
from __future__ import annotations

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize as _gguf_dequantize

from kernels.errors import UnsupportedTensorError

T = GGMLQuantizationType
GROUP_SIZE = 32  # weights per scale/zero group of the int4 kernels and of Q8_0
SUPPORTED_TYPES = frozenset({T.F32, T.F16, T.BF16, T.Q8_0, T.Q4_0, T.Q4_1, T.Q4_K, T.Q5_K, T.Q6_K})
INT4_EXACT_TYPES = frozenset({T.Q4_0, T.Q4_1, T.Q4_K})  # 4-bit codes + one affine map per 32 weights


def check_supported(qtype: GGMLQuantizationType, name: str = "") -> GGMLQuantizationType:
    """Returns `qtype` as a GGMLQuantizationType or raises UnsupportedTensorError."""
    try:
        qtype = GGMLQuantizationType(qtype)
    except ValueError:
        raise UnsupportedTensorError(f"unsupported tensor type {qtype!r} in tensor {name or '?'}") from None
    if qtype not in SUPPORTED_TYPES:
        raise UnsupportedTensorError(f"unsupported tensor type {qtype.name} in tensor {name or '?'}")
    return qtype


def row_bytes(qtype: GGMLQuantizationType, in_features: int) -> int:
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    return in_features // block_size * type_size


def as_rows(qtype: GGMLQuantizationType, data: np.ndarray, shape: tuple[int, int], name: str = "") -> np.ndarray:
    """Validates `data` against `shape` and returns it as contiguous rows.

    F32/F16 come back as float32/float16 `[out_features, in_features]`; every other
    type as `uint8 [out_features, bytes_per_row]` (BF16 included, as the reader gives it).
    """
    qtype = check_supported(qtype, name)
    out_features, in_features = (int(s) for s in shape)
    block_size, _ = GGML_QUANT_SIZES[qtype]
    if in_features % block_size:
        raise UnsupportedTensorError(
            f"tensor {name or '?'}: row length {in_features} is not a multiple of the {qtype.name} block size {block_size}"
        )
    data = np.ascontiguousarray(data)
    if qtype in (T.F32, T.F16) and data.dtype == (np.float32 if qtype == T.F32 else np.float16):
        rows = data.reshape(-1, in_features) if data.size == out_features * in_features else None
    else:
        flat = data.reshape(-1).view(np.uint8)
        nbytes = row_bytes(qtype, in_features)
        rows = flat.reshape(out_features, nbytes) if flat.size == out_features * nbytes else None
        if rows is not None and qtype in (T.F32, T.F16):
            rows = rows.view(np.float32 if qtype == T.F32 else np.float16)
    if rows is None:
        raise UnsupportedTensorError(
            f"tensor {name or '?'}: {data.dtype}{list(data.shape)} does not hold a {qtype.name} tensor of shape {list(shape)}"
        )
    return rows


def dequantize(qtype: GGMLQuantizationType, data: np.ndarray, shape: tuple[int, int], name: str = "") -> np.ndarray:
    """Exact float32 weights `[out_features, in_features]` (the reference for every kernel)."""
    rows = as_rows(qtype, data, shape, name)
    qtype = GGMLQuantizationType(qtype)
    if qtype in (T.F32, T.F16):
        return rows.astype(np.float32)
    return np.ascontiguousarray(_gguf_dequantize(rows, qtype), dtype=np.float32)


def dequantize_rows(
    qtype: GGMLQuantizationType, data: np.ndarray, shape: tuple[int, int], ids: np.ndarray, name: str = ""
) -> np.ndarray:
    """Exact float32 rows `[len(ids), in_features]`, decoding only the rows asked for."""
    rows = as_rows(qtype, data, shape, name)
    ids = np.asarray(ids, dtype=np.int64).reshape(-1)
    if ids.size and (ids.min() < 0 or ids.max() >= rows.shape[0]):
        raise IndexError(f"row ids out of range [0, {rows.shape[0]}) for tensor {name or '?'}")
    picked = rows[ids]
    qtype = GGMLQuantizationType(qtype)
    if qtype in (T.F32, T.F16):
        return picked.astype(np.float32)
    return np.ascontiguousarray(_gguf_dequantize(picked, qtype), dtype=np.float32).reshape(ids.size, shape[1])


def _f16(raw: np.ndarray) -> np.ndarray:
    """`uint8 [..., 2]` little-endian fp16 -> float32 `[...]`."""
    return np.ascontiguousarray(raw).view(np.float16)[..., 0].astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """`uint8 [..., span]` -> `uint8 [..., 2 * span]`: the low nibbles first, then the high nibbles."""
    return np.concatenate([qs & np.uint8(0x0F), qs >> np.uint8(4)], axis=-1)


def q4_k_scale_min(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K packed 6-bit scales `uint8 [num_blocks, 12]` -> (sc, mn) `uint8 [num_blocks, 8]`."""
    s = scales.reshape(-1, 3, 4)
    d, m, md = s[:, 0], s[:, 1], s[:, 2]
    sc = np.concatenate([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc, mn


def int4_groups(
    qtype: GGMLQuantizationType, data: np.ndarray, shape: tuple[int, int], name: str = ""
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Re-express a Q4_0/Q4_1/Q4_K tensor as 4-bit codes with one affine map per 32 weights.

    Returns (q `uint8 [N, K]` in 0..15, scale `float32 [N, K/32]`, zero `float32 [N, K/32]`)
    such that, in exact arithmetic, `weight[n, k] = (q[n, k] - 8) * scale[n, g] + zero[n, g]`
    with `g = k // 32`:
      Q4_0: d * (q - 8)          -> scale = d,      zero = 0
      Q4_1: d * q + m            -> scale = d,      zero = m + 8 d
      Q4_K: d*sc * q - dmin*mn   -> scale = d * sc, zero = 8 d sc - dmin mn
    The codes are the file's codes (no requantization); scale/zero are computed in float32.
    """
    rows = as_rows(qtype, data, shape, name)
    qtype = GGMLQuantizationType(qtype)
    if qtype not in INT4_EXACT_TYPES:
        raise ValueError(f"{qtype.name} is not a 4-bit type with 32-weight groups")
    out_features, in_features = shape
    _, type_size = GGML_QUANT_SIZES[qtype]
    blocks = rows.reshape(-1, type_size)  # [num_blocks, type_size]
    if qtype == T.Q4_K:
        d, dmin = _f16(blocks[:, 0:2])[:, None], _f16(blocks[:, 2:4])[:, None]  # [num_blocks, 1]
        sc, mn = q4_k_scale_min(blocks[:, 4:16])  # [num_blocks, 8]
        scale = d * sc.astype(np.float32)
        zero = np.float32(8) * scale - dmin * mn.astype(np.float32)
        q = _nibbles(blocks[:, 16:].reshape(-1, 4, 32))  # [num_blocks, 4, 64]: sub-blocks 2j, 2j+1
    else:
        d = _f16(blocks[:, 0:2])[:, None]  # [num_blocks, 1]
        if qtype == T.Q4_0:
            scale, zero = d, np.zeros_like(d)
        else:
            scale, zero = d, _f16(blocks[:, 2:4])[:, None] + np.float32(8) * d
        q = _nibbles(blocks[:, -16:])  # [num_blocks, 32]
    num_groups = in_features // GROUP_SIZE
    return (
        q.reshape(out_features, in_features),
        np.ascontiguousarray(scale.reshape(out_features, num_groups)),
        np.ascontiguousarray(zero.reshape(out_features, num_groups)),
    )


def q8_0_blocks(data: np.ndarray, shape: tuple[int, int], name: str = "") -> tuple[np.ndarray, np.ndarray]:
    """Q8_0 rows -> (q `int8 [N, K]`, d `float16 [N, K/32]`), exactly `weight = q * d`."""
    rows = as_rows(T.Q8_0, data, shape, name)
    out_features, in_features = shape
    blocks = rows.reshape(out_features, in_features // GROUP_SIZE, 2 + GROUP_SIZE)
    d = np.ascontiguousarray(blocks[..., :2]).view(np.float16)[..., 0]  # [N, K/32]
    q = np.ascontiguousarray(blocks[..., 2:]).view(np.int8).reshape(out_features, in_features)
    return q, d
