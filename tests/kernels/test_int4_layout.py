"""kernels.int4_layout: our packer and unpacker for torch's CPU int4 layouts against a plain Python copy of
ATen's packing loop for every capability (AVX2, AVX-512, default), and against this process's ATen packer."""
import numpy as np
import pytest
import torch

from kernels.int4_layout import CPU_LAYOUTS, Int4CpuLayout, cpu_layout, pack, unpack


def aten_int4_pack_loop(codes, capability):
    """Plain reference: ATen's `weight_to_int4pack_kernel` (native/cpu/int4mm_kernel.cpp), loop by loop."""
    n, k = codes.shape
    block_n = 64 if capability == "avx512" else 32
    out = np.zeros(n * k // 2, np.uint8)
    for i in range(-(-n // block_n)):
        nb, src, dst = min(block_n, n - i * block_n), codes[i * block_n:], i * k * block_n // 2
        for kk in range(k):
            if capability == "avx512" and nb == block_n:
                for d in range(16):
                    out[dst + kk * 32 + d] = src[d + 32, kk] << 4 | src[d, kk]
                    out[dst + kk * 32 + 16 + d] = src[d + 48, kk] << 4 | src[d + 16, kk]
            elif capability == "avx2" and nb == block_n:
                for d in range(16):
                    out[dst + kk * 16 + d] = src[d + 16, kk] << 4 | src[d, kk]
            else:  # shorter last block, or the non-vectorized kernel
                for j in range(0, nb, 2):
                    out[dst + kk * nb // 2 + j // 2] = src[j + 1, kk] << 4 | src[j, kk]
    return out.reshape(n, k // 2)


ATEN_LAYOUTS = {"avx2": Int4CpuLayout(32, True), "avx512": Int4CpuLayout(64, True), "default": Int4CpuLayout(32, False)}


@pytest.mark.parametrize("capability", ATEN_LAYOUTS)
@pytest.mark.parametrize("rows", [16, 48, 96, 176])
def test_cpu_layouts_match_aten_loop(capability, rows):
    codes = np.random.default_rng(rows).integers(0, 16, (rows, 64), dtype=np.uint8)
    layout = ATEN_LAYOUTS[capability]
    packed = pack(codes, layout)
    assert np.array_equal(packed.numpy(), aten_int4_pack_loop(codes, capability))
    assert torch.equal(unpack(packed, rows, 64, layout), torch.from_numpy(codes))


@pytest.mark.parametrize("rows", [16, 48, 96, 3072])
def test_cpu_packing_matches_aten(rows):
    layout = cpu_layout()
    assert layout in CPU_LAYOUTS, f"no fast int4 packing on this torch build: {layout}"
    codes = torch.randint(0, 16, (rows, 576), dtype=torch.int32)
    want = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
    assert torch.equal(pack(codes.to(torch.uint8).numpy(), layout), want)
    assert torch.equal(unpack(want, rows, 576, layout), codes.to(torch.uint8))
