"""The byte layouts of torch's CPU int4 kernel, and our own packer for them.

ATen's `_convert_weight_to_int4pack_for_cpu` picks its layout by the CPU capability it dispatches
to at run time (AVX2, AVX-512, none), so the same torch build packs differently on different CPUs.
`cpu_layout()` finds this process's layout by comparing `pack` with ATen's packer on probes (once);
`pack` writes it from numpy without the op's int32 input (~0.3 s for the default model instead of
1.5-2.5 s), `unpack` reads any known layout back (to repack a layer packed elsewhere).
It knows nothing of layers or GGUF blocks: codes in, bytes out.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import numpy as np
import torch

_aten = torch.ops.aten


class Int4CpuLayout(NamedTuple):
    """A byte layout of torch's CPU int4 kernel: `_convert_weight_to_int4pack_for_cpu` writes, and
    `_weight_int4pack_mm_for_cpu` reads, the one of the CPU capability ATen dispatches to at run
    time (AVX2, AVX-512, none: see `torch.backends.cpu.get_cpu_capability`, ATEN_CPU_CAPABILITY).

    Packed uint8 [N, K/2]: rows in blocks of `block_n`, the last one possibly shorter; block i
    (nb rows) fills the next nb * K/2 bytes, K-major: byte (k, j) holds two rows' codes at column
    k, the first in its low nibble.
    """

    block_n: int  # 4 x the floats in one vector register: 32 (AVX2, non-vectorized), 64 (AVX-512)
    split: bool  # a full block's byte j pairs rows j and j + block_n/2 (the AVX2 and AVX-512
    #              kernels); otherwise, and in a shorter last block, rows 2j and 2j + 1


# ATen's AVX2, AVX-512 and non-vectorized kernels (the last: also 512-bit vectors without AVX-512 code).
CPU_LAYOUTS = (Int4CpuLayout(32, True), Int4CpuLayout(64, True), Int4CpuLayout(32, False), Int4CpuLayout(64, False))


def _segments(num_rows: int, layout: Int4CpuLayout) -> list[tuple[int, int, int, bool]]:
    """(first row, number of blocks, rows per block, split) of the full blocks and the shorter last one."""
    b, tail = layout.block_n, num_rows % layout.block_n
    segments = [(0, num_rows // b, b, layout.split)] if num_rows >= b else []
    return segments + ([(num_rows - tail, 1, tail, False)] if tail else [])


def pack(codes: np.ndarray, layout: Int4CpuLayout) -> torch.Tensor:
    """uint8 codes [N, K] (0..15, N % 16 == 0) -> packed uint8 [N, K/2] in `layout`.

    The same bytes as `_convert_weight_to_int4pack_for_cpu` when `layout` is its layout (checked
    once per process), without the op's int32 input: the default model packs in ~0.3 s, not 1.5-2.5 s.
    """
    n, k = codes.shape
    packed = np.empty((n, k // 2), dtype=np.uint8)
    flat = packed.reshape(-1)
    for row, num_blocks, nb, split in _segments(n, layout):  # numpy: single-threaded, cheap here
        rows = codes[row:row + num_blocks * nb].reshape(num_blocks, nb, k)
        # lo, hi: [blocks, nb/2, K]
        lo, hi = (rows[:, :nb // 2], rows[:, nb // 2:]) if split else (rows[:, 0::2], rows[:, 1::2])
        dst = flat[row * k // 2:(row + num_blocks * nb) * k // 2].reshape(num_blocks, k, nb // 2)
        np.bitwise_or(lo.transpose(0, 2, 1), hi.transpose(0, 2, 1) << 4, out=dst)
    return torch.from_numpy(packed)


def unpack(packed: torch.Tensor, num_rows: int, num_cols: int, layout: Int4CpuLayout) -> torch.Tensor:
    """The inverse of `pack`: packed uint8 [N, K/2] -> codes uint8 [N, K]."""
    flat, parts = packed.reshape(-1), []
    for row, num_blocks, nb, split in _segments(num_rows, layout):
        blocks = flat[row * num_cols // 2:(row + num_blocks * nb) * num_cols // 2].view(num_blocks, num_cols, nb // 2)
        lo, hi = blocks & 15, blocks >> 4
        codes = torch.cat([lo, hi], dim=2) if split else torch.stack([lo, hi], dim=3)  # [blocks, K, nb(/2, 2)]
        parts.append(codes.reshape(num_blocks, num_cols, nb).transpose(1, 2).reshape(num_blocks * nb, num_cols))
    return torch.cat(parts) if len(parts) > 1 else parts[0]


@functools.cache
def cpu_layout() -> Int4CpuLayout | str:
    """The layout of torch's CPU int4 kernel in this process: the one of `CPU_LAYOUTS` whose
    packing equals aten's on probe matrices (full and shorter blocks), else a tag naming the build."""
    gen = torch.Generator().manual_seed(0)
    probes = [torch.randint(0, 16, (n, 96), dtype=torch.int32, generator=gen) for n in (16, 48, 96, 176)]
    wants = [_aten._convert_weight_to_int4pack_for_cpu(p, 1) for p in probes]
    for layout in CPU_LAYOUTS:
        if all(torch.equal(pack(p.to(torch.uint8).numpy(), layout), w) for p, w in zip(probes, wants)):
            return layout
    return f"aten {torch.__version__} {torch.backends.cpu.get_cpu_capability()}"
