"""PagedKVCache (kernels/kv_cache.py): round trips per dtype, int8 error bound, copy-on-write
block copies, sizes and budgets, and argument validation."""
import math
from dataclasses import dataclass

import pytest
import torch

from kernels.kv_cache import KV_DTYPES, PagedKVCache, dequantize_int8, hadamard_rotate, quantize_int8, slot_tensor

NKV, HD, BS = 3, 64, 16


def make(kv_dtype, num_layers=2, num_blocks=8):
    cache = PagedKVCache(num_layers, num_blocks, BS, NKV, HD, kv_dtype)
    for pool in (cache.k_pool, cache.v_pool, cache.k_scale_pool, cache.v_scale_pool):
        if pool is not None:
            pool.fill_(math.nan if pool.is_floating_point() else 0)
    return cache


def kv(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, NKV, HD, generator=g) * 3, torch.randn(n, NKV, HD, generator=g)


@pytest.mark.parametrize("kv_dtype", ["fp32", "fp16", "bf16"])
def test_float_round_trip(kv_dtype):
    cache = make(kv_dtype)
    k, v = kv(21)
    slots = slot_tensor([5, 2], 0, 21, BS)
    cache.write(1, slots, k, v)
    rk, rv = cache.read(1, slots)
    dt = KV_DTYPES[kv_dtype]
    assert rk.dtype == torch.float32 and rk.shape == k.shape
    assert torch.equal(rk, k.to(dt).float()) and torch.equal(rv, v.to(dt).float())
    assert torch.isnan(cache.k[0]).all()  # the other layer is untouched
    assert cache.read(1, slots, dtype=torch.float64)[0].dtype == torch.float64


@pytest.mark.parametrize("head_dim", [64, 48])  # 48: not a power of two, so stored unrotated
def test_int8_round_trip_and_error_bound(head_dim):
    cache = PagedKVCache(1, 8, BS, NKV, head_dim, "int8")
    assert cache.rotated == (head_dim == 64)
    g = torch.Generator().manual_seed(3)
    k, v = torch.randn(40, NKV, head_dim, generator=g) * 3, torch.randn(40, NKV, head_dim, generator=g)
    k[4] = 0.0  # an all-zero row must come back as zeros, not NaN
    slots = slot_tensor([1, 6, 3], 0, 40, BS)
    cache.write(0, slots, k, v)
    rk, rv = cache.read(0, slots)
    rot = hadamard_rotate if cache.rotated else (lambda x: x)
    for x, r in ((k, rk), (v, rv)):
        q, scale = quantize_int8(rot(x))  # what is stored: int8 rows (in the Hadamard basis if rotated)
        assert torch.allclose(r, rot(dequantize_int8(q, scale)), atol=1e-6)
        # round-to-nearest: at most half a step (amax / 127) per stored element; the rotation is
        # orthogonal, so the row's L2 error is bounded the same way in the model's basis
        step = scale.unsqueeze(-1)
        if cache.rotated:
            assert ((x - r).norm(dim=-1) <= 0.5 * step[..., 0] * head_dim ** 0.5 * (1 + 1e-5) + 1e-6).all()
        else:
            assert ((x - r).abs() <= 0.5 * step * (1 + 1e-6) + 1e-7).all()
    assert torch.equal(rk[4], torch.zeros(NKV, head_dim))
    assert cache.k[0].dtype == torch.int8 and cache.k_scale[0].shape == (8, BS, NKV)


def test_hadamard_rotate_is_orthogonal_involution():
    x = torch.randn(5, 3, 64, dtype=torch.float64)
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < 64:  # Sylvester construction
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
    assert torch.allclose(hadamard_rotate(x.float()).double(), x @ h / 8, atol=1e-5)
    assert torch.allclose(hadamard_rotate(hadamard_rotate(x.float())).double(), x, atol=1e-5)
    assert not PagedKVCache(1, 2, BS, NKV, 64, "fp16").rotated


def test_quantize_range():
    q, scale = quantize_int8(torch.tensor([[-2.0, 1.0, 0.5, 2.0]]))
    assert q.tolist() == [[-127, 64, 32, 127]] and scale.item() == pytest.approx(2 / 127)


@dataclass
class Pair:
    src: int
    dst: int


@pytest.mark.parametrize("kv_dtype", ["fp16", "int8"])
def test_copy_blocks(kv_dtype):
    cache = make(kv_dtype, num_layers=3)
    k, v = kv(2 * BS, seed=1)
    for layer in range(3):
        cache.write(layer, slot_tensor([0, 1], 0, 2 * BS, BS), k + layer, v - layer)
    cache.copy_blocks([(0, 4), Pair(1, 7)])
    for layer in range(3):
        a = cache.read(layer, slot_tensor([0, 1], 0, 2 * BS, BS))
        b = cache.read(layer, slot_tensor([4, 7], 0, 2 * BS, BS))
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    untouched = cache.k_scale_pool if cache.quantized else cache.k_pool
    assert torch.isnan(untouched[:, 5].float()).all()  # other blocks are left alone


def test_slot_tensor():
    expected = [3 * BS + p for p in range(14, 16)] + [p - BS for p in range(16, 32)]
    expected += [9 * BS + p - 32 for p in range(32, 35)]
    assert slot_tensor([3, 0, 9], 14, 35, BS).tolist() == expected


def test_bytes_per_token():
    fp16 = PagedKVCache.bytes_per_token(30, 3, 64, "fp16")
    assert fp16 == 23040
    assert PagedKVCache.bytes_per_token(30, 3, 64, "bf16") == fp16
    assert PagedKVCache.bytes_per_token(30, 3, 64, "fp32") == 2 * fp16
    int8 = PagedKVCache.bytes_per_token(30, 3, 64, "int8")
    assert int8 == 2 * 30 * 3 * (64 + 4) and int8 <= 0.55 * fp16


@pytest.mark.parametrize("kv_dtype", list(KV_DTYPES))
def test_nbytes_matches_bytes_per_token(kv_dtype):
    cache = PagedKVCache(2, 8, BS, NKV, HD, kv_dtype)
    assert cache.nbytes == 8 * BS * PagedKVCache.bytes_per_token(2, NKV, HD, kv_dtype)


def test_blocks_for_budget():
    per_block = BS * PagedKVCache.bytes_per_token(30, NKV, HD, "int8")
    assert PagedKVCache.blocks_for_budget(10 * per_block, 30, BS, NKV, HD, "int8") == 10
    assert PagedKVCache.blocks_for_budget(10 * per_block - 1, 30, BS, NKV, HD, "int8") == 9
    assert PagedKVCache.blocks_for_budget(0, 30, BS, NKV, HD, "fp16") == 0


def test_bad_arguments():
    with pytest.raises(ValueError, match="kv dtype"):
        PagedKVCache(1, 4, BS, NKV, HD, "fp8")
    with pytest.raises(ValueError, match="kv dtype"):
        PagedKVCache.bytes_per_token(1, NKV, HD, "q4")
    with pytest.raises(ValueError):
        PagedKVCache(1, 0, BS, NKV, HD, "fp16")


@pytest.mark.parametrize("kv_dtype", ["fp16", "int8"])
def test_copy_slots_moves_single_positions_in_every_layer(kv_dtype):
    """A draft tree's accepted path onto consecutive slots: bytes (and int8 scales) as stored, other slots
    untouched, in order."""
    kv = PagedKVCache(3, 4, 4, 2, 8, kv_dtype)
    for layer in range(3):
        kv.write(layer, torch.arange(16), torch.randn(16, 2, 8), torch.randn(16, 2, 8))
    before = [t.clone() for t in (kv.k_pool, kv.v_pool) + ((kv.k_scale_pool,) if kv.quantized else ())]
    kv.copy_slots([5, 9, 14], [5, 6, 7])  # slot 5 stays; 9 -> 6 (same block), 14 -> 7 (another block)
    for new, old in zip((kv.k_pool, kv.v_pool) + ((kv.k_scale_pool,) if kv.quantized else ()), before):
        flat_new, flat_old = new.flatten(1, 2), old.flatten(1, 2)
        assert torch.equal(flat_new[:, 6], flat_old[:, 9]) and torch.equal(flat_new[:, 7], flat_old[:, 14])
        keep = [s for s in range(16) if s not in (6, 7)]
        assert torch.equal(flat_new[:, keep], flat_old[:, keep])
