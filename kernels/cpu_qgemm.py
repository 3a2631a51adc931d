"""Integer dot-product GEMM on raw GGUF block rows (cpu_qgemm.c), one variant per ISA.

`qgemm(kind, weight, x, out_features)` computes `x @ W.T` for any number of rows of x:
the activations are quantized to 8 bits per 32-value block and every weight block meets
them through an exact integer dot product, with a fixed float epilogue (cpu_qgemm.c says
which operations), so the result is bit-identical across the variants (portable C, AVX2,
AVX-VNNI, AVX512-VNNI, NEON dotprod), across M, across batch mates and thread counts.
`reference_qgemm` is the same arithmetic in numpy (integers exact, float32 step by step):
tests compare every variant with it bit for bit.

The variants live in the one library `cpu_gemv` builds. At load the best one the CPU
reports (cpuid through `__builtin_cpu_supports`, arm64 HWCAP) is chosen;
`EDGE_RUNTIME_ISA=portable|avx2|avxvnni|avx512vnni|amx|neon|auto` overrides it, and `select()`
switches at run time (a variant this CPU cannot run is refused with the list it can).

It knows nothing of models: callers decide which rows to fuse.
"""
from __future__ import annotations

import ctypes
import functools
import os

import numpy as np
import torch

from kernels import cpu_gemv

VARIANTS = ("portable", "avx2", "avxvnni", "avx512vnni", "neon", "amx")  # ids 0..5 in cpu_qgemm_dispatch.c
KIND_CODE = {"q4_0": 0, "q4_1": 1, "q4_k": 4, "q8_0": 8}
BLOCK = cpu_gemv.BLOCK
ENV = "EDGE_RUNTIME_ISA"


class ISAError(ValueError):
    """An EDGE_RUNTIME_ISA value or a variant this CPU cannot run."""


@functools.cache
def _lib():
    lib = cpu_gemv.library()
    if lib is None:
        raise RuntimeError(f"cpu_qgemm unavailable: {cpu_gemv.unavailable_reason()}")
    c = lib.lib
    p, i = ctypes.c_void_p, ctypes.c_int
    c.qgemm.argtypes, c.qgemm.restype = [p, i, i, i, p, i, p, i], i
    c.qgemm_quantize.argtypes, c.qgemm_quantize.restype = [p, i, i, p, p, p, p], i
    for name in ("qgemm_supported", "qgemm_select"):
        getattr(c, name).argtypes, getattr(c, name).restype = [i], i
    c.qgemm_variant.restype = c.qgemm_best.restype = i
    c.qgemm_packed.argtypes, c.qgemm_packed.restype = [p, i, i, i, p, i, p, i], i
    c.qgemm_packed_supported.argtypes, c.qgemm_packed_supported.restype = [i], i
    c.qgemm_packed_bytes.argtypes, c.qgemm_packed_bytes.restype = [i, i, i], ctypes.c_longlong
    c.qgemm_repack.argtypes, c.qgemm_repack.restype = [p, i, i, i, p], i
    want = os.environ.get(ENV, "auto").strip().lower() or "auto"
    if want != "auto":
        _select(c, want)
    return c


def _select(c, name: str) -> None:
    if name not in VARIANTS:
        raise ISAError(f"{ENV}={name!r}: unknown ISA variant; choose one of auto, {', '.join(VARIANTS)}")
    if c.qgemm_select(VARIANTS.index(name)):
        can = [v for k, v in enumerate(VARIANTS) if c.qgemm_supported(k)]
        raise ISAError(f"this CPU cannot run the {name} kernels; it runs: {', '.join(can)}")


def available() -> bool:
    return cpu_gemv.available()


def supported() -> list[str]:
    """The variants this library holds and this CPU runs, best last."""
    c = _lib()
    return [v for k, v in enumerate(VARIANTS) if c.qgemm_supported(k)]


def variant() -> str:
    """The variant in use now."""
    return VARIANTS[_lib().qgemm_variant()]


def best() -> str:
    """The variant chosen from the CPU's features when nothing overrides it."""
    return VARIANTS[_lib().qgemm_best()]


def select(name: str) -> str:
    """Switch to `name` ('auto': the best); returns the variant that was in use."""
    c = _lib()
    old = variant()
    _select(c, best() if name == "auto" else name)
    return old


def qgemm(kind: str, weight: torch.Tensor, x: torch.Tensor, out_features: int,
          num_threads: int | None = None) -> torch.Tensor:
    """`x @ W.T` through the integer kernels.

    Args:
        kind: one of KIND_CODE.
        weight: uint8 [out_features, row_bytes], contiguous, CPU: the GGUF rows as stored.
        x: [M, K] CPU activations (any M >= 1); cast to contiguous fp32 if it is not.
        out_features: N.
        num_threads: None -> cpu_gemv.threads().
    Returns:
        fp32 [M, N].
    """
    c = _lib()
    if x.dtype != torch.float32 or not x.is_contiguous():
        x = x.to(torch.float32).contiguous()
    values, nbytes = BLOCK[kind]
    m, k = x.shape
    if m < 1 or k % values:
        raise ValueError(f"x must be [M >= 1, K % {values} == 0], got {tuple(x.shape)}")
    if (weight.dtype != torch.uint8 or weight.shape != (out_features, k // values * nbytes)
            or not weight.is_contiguous() or not weight.is_cpu or not x.is_cpu):
        raise ValueError(f"{kind} weight must be a contiguous CPU uint8 {(out_features, k // values * nbytes)}, "
                         f"got {weight.dtype} {tuple(weight.shape)} on {weight.device} (x on {x.device})")
    out = torch.empty((m, out_features), dtype=torch.float32)
    nt = num_threads if num_threads is not None else cpu_gemv.threads()
    rc = c.qgemm(weight.data_ptr(), KIND_CODE[kind], out_features, k, x.data_ptr(), m, out.data_ptr(), nt)
    if rc:
        raise ValueError(f"qgemm rejected its arguments ({kind}, N={out_features}, K={k}, M={m}): rc={rc}")
    return out


def packed_supported(kind: str) -> bool:
    """True when the selected variant multiplies `kind` from the packed layout (x86 SIMD: Q4_0, Q4_1, Q8_0)."""
    return bool(_lib().qgemm_packed_supported(KIND_CODE[kind]))


def repack(kind: str, weight: torch.Tensor, out_features: int, in_features: int) -> torch.Tensor:
    """GGUF rows uint8 [N, row_bytes] -> the packed layout (tiles of 8 rows as SIMD lanes; same bytes per
    weight, rounded up to 8 rows). A layout change only: qgemm_packed on it gives qgemm's bits."""
    c = _lib()
    nbytes = c.qgemm_packed_bytes(KIND_CODE[kind], out_features, in_features)
    if not nbytes:
        raise ValueError(f"no packed layout for {kind} [{out_features}, {in_features}]")
    weight = weight.contiguous()
    out = torch.empty(nbytes, dtype=torch.uint8)
    if c.qgemm_repack(weight.data_ptr(), KIND_CODE[kind], out_features, in_features, out.data_ptr()):
        raise ValueError(f"qgemm_repack rejected {kind} [{out_features}, {in_features}]")
    return out


def qgemm_packed(kind: str, packed: torch.Tensor, x: torch.Tensor, out_features: int,
                 num_threads: int | None = None) -> torch.Tensor:
    """`x @ W.T` from `repack`'s layout; the same bits as `qgemm` on the GGUF rows."""
    c = _lib()
    if x.dtype != torch.float32 or not x.is_contiguous():
        x = x.to(torch.float32).contiguous()
    m, k = x.shape
    out = torch.empty((m, out_features), dtype=torch.float32)
    nt = num_threads if num_threads is not None else cpu_gemv.threads()
    rc = c.qgemm_packed(packed.data_ptr(), KIND_CODE[kind], out_features, k, x.data_ptr(), m, out.data_ptr(), nt)
    if rc:
        raise ValueError(f"qgemm_packed rejected its arguments ({kind}, N={out_features}, K={k}, M={m}, "
                         f"variant {variant()}): rc={rc}")
    return out


def quantize(x: torch.Tensor) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The selected variant's 8-bit activations of x [M, K]: (q int8 [M, K], d, s, sf [M, K / 32])."""
    x = x.to(torch.float32).contiguous()
    m, k = x.shape
    q = np.empty((m, k), np.int8)
    d, sf = np.empty((m, k // 32), np.float32), np.empty((m, k // 32), np.float32)
    s = np.empty((m, k // 32), np.int32)
    rc = _lib().qgemm_quantize(x.data_ptr(), m, k, q.ctypes.data, d.ctypes.data, s.ctypes.data, sf.ctypes.data)
    if rc:
        raise ValueError(f"qgemm_quantize: K must be a multiple of 32, got {k}")
    return q, d, s, sf


# ---- the plain reference: the same arithmetic in numpy --------------------------------------------

_MAGIC = np.float32(12582912.0)  # 1.5 * 2^23: (v + magic) - magic rounds half to even


def reference_quantize(x: np.ndarray):
    """x float32 [M, K] -> (q int32 [M, K], d float32, s int32, sf float32 [M, K / 32])."""
    x = np.ascontiguousarray(x, np.float32)
    m, k = x.shape
    b = x.reshape(m, k // 32, 32)
    d = np.abs(b).max(axis=2) / np.float32(127)
    inv = np.zeros_like(d)
    np.divide(np.float32(1), d, out=inv, where=d != 0)
    q = ((b * inv[..., None] + _MAGIC) - _MAGIC).astype(np.int32)
    s = q.sum(axis=2, dtype=np.int32)
    return q.reshape(m, k), d, s, d * s.astype(np.float32)


def _f16(raw: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(raw).view(np.float16)[..., 0].astype(np.float32)


def _q4k_scales(sc6: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[..., 12] packed bytes -> (scale, min) [..., 8] as int32, as cpu_qgemm.c unpacks them."""
    s = sc6.astype(np.int32)
    sc, mn = np.empty(s.shape[:-1] + (8,), np.int32), np.empty(s.shape[:-1] + (8,), np.int32)
    sc[..., :4], mn[..., :4] = s[..., 0:4] & 63, s[..., 4:8] & 63
    sc[..., 4:] = (s[..., 8:12] & 0xF) | ((s[..., 0:4] >> 6) << 4)
    mn[..., 4:] = (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)
    return sc, mn


def _weight_blocks(kind: str, w: np.ndarray, n: int):
    """Raw rows -> (codes int32 [N, nb, 32], dw, mw float32 [N, nb], sc int32 [N, nb]) per 32-value block."""
    values, nbytes = BLOCK[kind]
    blk = np.ascontiguousarray(w, np.uint8).reshape(n, -1, nbytes)
    if kind == "q4_k":
        ns = blk.shape[1]
        d, dmin = _f16(blk[..., 0:2]), _f16(blk[..., 2:4])
        sc, mn = _q4k_scales(blk[..., 4:16])
        qs = blk[..., 16:].reshape(n, ns, 4, 32).astype(np.int32)
        codes = np.stack([qs & 0xF, qs >> 4], axis=3).reshape(n, ns * 8, 32)  # sub-block 2j: low, 2j + 1: high
        dw = np.repeat(d, 8, axis=1)
        mw = dmin[..., None] * mn.astype(np.float32)
        return codes, dw, mw.reshape(n, ns * 8), sc.reshape(n, ns * 8)
    dw = _f16(blk[..., 0:2])
    if kind == "q8_0":
        codes = blk[..., 2:].view(np.int8).astype(np.int32)
        mw = np.zeros_like(dw)
    else:
        qs = blk[..., (4 if kind == "q4_1" else 2):].astype(np.int32)
        codes = np.concatenate([qs & 0xF, qs >> 4], axis=2)
        mw = _f16(blk[..., 2:4]) if kind == "q4_1" else np.zeros_like(dw)
    return codes, dw, mw, np.ones(dw.shape, np.int32)


def reference_qgemm(kind: str, weight: np.ndarray, x: np.ndarray, out_features: int) -> np.ndarray:
    """What every variant of cpu_qgemm.c computes, in numpy: float32 [M, N], bit for bit."""
    q, dx, sx, sxf = reference_quantize(x)
    m, k = q.shape
    codes, dw, mw, sc = _weight_blocks(kind, weight, out_features)
    nb = k // 32
    isum = np.einsum("nbi,mbi->mnb", codes.astype(np.int64), q.reshape(m, nb, 32).astype(np.int64))
    isum = isum.astype(np.int32)  # [M, N, nb], exact
    if kind == "q4_0":
        isum = isum - 8 * sx[:, None, :]
    if kind == "q4_k":
        isum = isum * sc[None]
    c = (dw[None] * dx[:, None, :]) * isum.astype(np.float32)
    if kind == "q4_1":
        c = c + mw[None] * sxf[:, None, :]
    if kind == "q4_k":
        c = c - mw[None] * sxf[:, None, :]
    a = np.zeros((m, out_features, 8), np.float32)
    for g in range(0, nb, 8):  # lane l accumulates blocks l, l + 8, ...; a last short group only its lanes
        r = min(8, nb - g)
        a[..., :r] = a[..., :r] + c[..., g:g + r]
    return ((a[..., 0] + a[..., 1]) + (a[..., 2] + a[..., 3])) + ((a[..., 4] + a[..., 5]) + (a[..., 6] + a[..., 7]))
