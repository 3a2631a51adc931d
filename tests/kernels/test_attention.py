"""The attention kernels (attention.py, paged_attention.py) against kernels/reference.py.

Every kernel is checked across head_dim 64/128, GQA ratios 1/3/4/8, lengths from one token to
several blocks (block sizes 16 and 5, non-multiples included), causal and not, q_offset 0 and
> 0. Paged pools are NaN-filled before writing, so any read of an unwritten slot shows up.
"""
import math
import threading

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kernels import attention as A
from kernels import paged_attention as P
from kernels.kv_cache import PagedKVCache, slot_tensor
from kernels.reference import attention as reference

FP32_TOL = 1e-5  # max abs error, fp32 kernels vs the fp64 reference
# Max abs error vs the fp64 reference on the *unrounded* K/V (storage rounding included).
# Measured maxima over this file's cases (q, K, V ~ N(0, 1)): fp16 9.8e-4, bf16 7.5e-3, int8 2.4e-2
# (int8 rows are stored Hadamard-rotated for these power-of-two head sizes);
# the kernels alone (vs the reference on the values the cache stores) stay under 1.5e-6.
STORAGE_TOL = {"fp32": FP32_TOL, "fp16": 3e-3, "bf16": 2e-2, "int8": 5e-2}
HEAD_DIMS = (64, 128)
GROUPS = (1, 3, 4, 8)
NUM_KV_HEADS = 2


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Shapes here are tiny: one intra-op thread is faster, and immune to a busy second core."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def qkv(num_tokens, num_keys, group, head_dim, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(num_tokens, NUM_KV_HEADS * group, head_dim, generator=g)  # [T, num_heads, head_dim]
    k = torch.randn(num_keys, NUM_KV_HEADS, head_dim, generator=g)  # [S, num_kv_heads, head_dim]
    v = torch.randn(num_keys, NUM_KV_HEADS, head_dim, generator=g)
    return q, k, v


def ref64(q, k, v, **kw):
    return reference(q.double(), k.double(), v.double(), dtype=torch.float64, **kw)


def max_err(out, expected):
    assert out.dtype == torch.float32 and out.shape == expected.shape
    return (out.double() - expected).abs().max().item()


# (num_tokens, num_keys, q_offset, causal): one token up to several tiles, ragged tails, q_offset > 0
CASES = [(1, 1, None, True), (1, 37, None, True), (7, 7, None, True), (33, 33, None, True),
         (20, 50, 30, True), (20, 50, 0, True), (12, 80, 41, True), (33, 33, None, False), (5, 41, None, False)]


def test_reference_matches_sdpa_math():
    q, k, v = qkv(6, 11, 3, 64)
    mask = torch.arange(11).view(1, -1) <= torch.arange(5, 11).view(-1, 1)
    kr, vr = (x.double().repeat_interleave(3, dim=1).transpose(0, 1) for x in (k, v))
    sdpa = torch.nn.functional.scaled_dot_product_attention(q.double().transpose(0, 1), kr, vr, attn_mask=mask)
    assert max_err(reference(q, k, v, causal=True), sdpa.transpose(0, 1)) < FP32_TOL


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("group", GROUPS)
@pytest.mark.parametrize("num_tokens,num_keys,q_offset,causal", CASES)
def test_tiled_matches_reference(head_dim, group, num_tokens, num_keys, q_offset, causal):
    q, k, v = qkv(num_tokens, num_keys, group, head_dim)
    expected = ref64(q, k, v, causal=causal, q_offset=q_offset)
    for tile_q, tile_k in ((16, 16), (5, 7), (A.TILE_Q, A.TILE_K)):
        out = A.tiled_attention(q, k, v, causal=causal, q_offset=q_offset, tile_q=tile_q, tile_k=tile_k)
        assert max_err(out, expected) <= FP32_TOL


@pytest.mark.parametrize("backend", ["sdpa", "tiled", "auto"])
@pytest.mark.parametrize("num_tokens,num_keys,q_offset,causal", CASES)
def test_prefill_dispatcher_matches_reference(backend, num_tokens, num_keys, q_offset, causal):
    q, k, v = qkv(num_tokens, num_keys, 4, 64)
    with A.force_attention_backend(backend):
        out = A.prefill_attention(q, k, v, causal=causal, q_offset=q_offset, scale=0.2)
    assert max_err(out, ref64(q, k, v, causal=causal, q_offset=q_offset, scale=0.2)) <= FP32_TOL


@settings(max_examples=20, deadline=None)
@given(num_tokens=st.integers(1, 40), extra_keys=st.integers(0, 40), group=st.sampled_from(GROUPS),
       causal=st.booleans(), tile_q=st.integers(1, 24), tile_k=st.integers(1, 24), seed=st.integers(0, 99),
       data=st.data())
def test_tiled_property(num_tokens, extra_keys, group, causal, tile_q, tile_k, seed, data):
    q, k, v = qkv(num_tokens, num_tokens + extra_keys, group, 64, seed)
    q_offset = data.draw(st.integers(0, extra_keys))  # queries anywhere in the keys, not only at the end
    out = A.tiled_attention(q, k, v, causal=causal, q_offset=q_offset, tile_q=tile_q, tile_k=tile_k)
    assert max_err(out, ref64(q, k, v, causal=causal, q_offset=q_offset)) <= FP32_TOL


def score_tiles(monkeypatch):
    """Record (tokens, keys, masked) of every score tile the tiled kernel computes."""
    tiles = []
    real = A._update

    def spy(qt, kt, vt, m, l, acc, bias, group, buf):
        tiles.append((qt.shape[1] // group, kt.shape[1], bias is not None))
        real(qt, kt, vt, m, l, acc, bias, group, buf)

    monkeypatch.setattr(A, "_update", spy)
    return tiles


def test_causal_tiles_above_diagonal_are_skipped(monkeypatch):
    tiles = score_tiles(monkeypatch)
    q, k, v = qkv(64, 64, 3, 64)
    A.tiled_attention(q, k, v, causal=False, tile_q=16, tile_k=16)
    assert len(tiles) == 16 and sum(t * s for t, s, _ in tiles) == 64 * 64 and not any(m for *_, m in tiles)
    tiles.clear()
    A.tiled_attention(q, k, v, causal=True, tile_q=16, tile_k=16)
    assert len(tiles) == 4 + 3 + 2 + 1 and sum(m for *_, m in tiles) == 4  # the 4 diagonal tiles are masked
    # the lower triangle plus the upper halves of the diagonal tiles (120 entries each)
    assert sum(t * s for t, s, _ in tiles) == 64 * 65 // 2 + 4 * 120


def test_scores_never_materialized(monkeypatch):
    tiles = score_tiles(monkeypatch)
    q, k, v = qkv(200, 200, 3, 64)
    A.tiled_attention(q, k, v, causal=True, tile_q=16, tile_k=32)
    assert max(t * s for t, s, _ in tiles) == 16 * 32  # one token chunk x one KV tile, never T x S


def test_helper_threads(monkeypatch):
    """With intra-op threads, query chunks go to helper threads; same results, no leaked settings."""
    names = set()
    real = A._update
    spy = lambda *a: names.add((threading.current_thread().name, torch.get_num_threads())) or real(*a)  # noqa: E731
    monkeypatch.setattr(A, "_update", spy)
    monkeypatch.setattr(A, "PARALLEL_MIN_SCORES", 0)
    cache, tables, _, stored = paged_cache("int8", 5, 3, 64, [90])
    torch.set_num_threads(2)
    try:
        for causal, q_offset in ((True, None), (True, 10), (False, 0)):
            q, k, v = qkv(70, 90, 3, 64)
            out = A.tiled_attention(q, k, v, causal=causal, q_offset=q_offset, tile_q=16, tile_k=16)
            assert max_err(out, ref64(q, k, v, causal=causal, q_offset=q_offset)) <= FP32_TOL
        with A.force_attention_backend("tiled"):
            out = P.paged_prefill_attention(q, cache, 0, tables[0], 20, tile_q=16, tile_k=8, span_k=30)
        assert max_err(out, ref64(q, *stored[0], causal=True, q_offset=20)) <= FP32_TOL
        assert torch.get_num_threads() == 2  # the helpers' one-thread setting stays theirs
    finally:
        torch.set_num_threads(1)
    helpers = {threads for name, threads in names if name.startswith("edge-attention")}
    assert helpers == {1}  # chunks ran on helper threads, each with one intra-op thread


# ---- backend switch ----------------------------------------------------------------------------
def ran(fn):
    before = A.backend_calls.copy()
    fn()
    return {name for name in A.backend_calls if A.backend_calls[name] != before[name]}


def test_force_backend_switches_kernel(monkeypatch):
    q, k, v = qkv(16, 16, 3, 64)
    call = lambda: A.prefill_attention(q, k, v, causal=True)  # noqa: E731
    with A.force_attention_backend("tiled"):
        assert ran(call) == {"tiled"}
    with A.force_attention_backend("sdpa"):
        assert ran(call) == {"sdpa"}
        with A.force_attention_backend("tiled"):
            assert ran(call) == {"tiled"}
        assert ran(call) == {"sdpa"}  # restored on exit
    with A.force_attention_backend("auto"):
        assert ran(call) == {"sdpa"}  # is_causal is exact (q_offset == 0)
        assert ran(lambda: A.prefill_attention(q[8:], k, v, causal=False)) == {"sdpa"}
        assert ran(lambda: A.prefill_attention(q[8:], k, v, causal=True)) == {"sdpa_masked"}  # small T * S
        monkeypatch.setattr(A, "SDPA_MASK_MAX_ELEMENTS", 8 * 16 - 1)
        assert ran(lambda: A.prefill_attention(q[8:], k, v, causal=True)) == {"tiled"}  # q_offset 8
        assert ran(call) == {"sdpa"}
    with pytest.raises(ValueError):
        with A.force_attention_backend("flash"):
            pass


def test_env_override(monkeypatch):
    q, k, v = qkv(16, 16, 3, 64)
    call = lambda: A.prefill_attention(q, k, v, causal=True)  # noqa: E731
    monkeypatch.setenv(A.ENV_VAR, "tiled")
    assert ran(call) == {"tiled"}
    monkeypatch.setenv(A.ENV_VAR, "sdpa")
    assert ran(call) == {"sdpa"}
    with A.force_attention_backend("tiled"):  # the context manager wins over the environment
        assert ran(call) == {"tiled"}
    monkeypatch.setenv(A.ENV_VAR, "bogus")
    with pytest.raises(ValueError):
        call()


def test_bad_shapes():
    q, k, v = qkv(4, 4, 3, 64)
    with pytest.raises(ValueError):
        A.tiled_attention(q[:, :5], k, v, causal=True)  # 5 heads over 2 KV heads
    with pytest.raises(ValueError):
        A.tiled_attention(q, k[:2], v[:2], causal=True)  # default q_offset would be -2


# ---- paged -------------------------------------------------------------------------------------
def paged_cache(kv_dtype, block_size, group, head_dim, lengths, seed=0, num_blocks=64):
    """A NaN-filled one-layer cache holding one sequence per length, in shuffled blocks.

    Returns (cache, block tables, [(k, v) as written], [(k, v) as stored, read back]).
    """
    cache = PagedKVCache(1, num_blocks, block_size, NUM_KV_HEADS, head_dim, kv_dtype)
    for pool in (cache.k_pool, cache.v_pool, cache.k_scale_pool, cache.v_scale_pool):
        if pool is not None and pool.is_floating_point():
            pool.fill_(math.nan)
    if cache.quantized:  # int8 pools cannot hold NaN: their scales are NaN, and the values garbage
        cache.k_pool.fill_(-128)
        cache.v_pool.fill_(-128)
    free = torch.randperm(num_blocks - 1, generator=torch.Generator().manual_seed(seed)).tolist()
    tables, written, stored = [], [], []
    for i, n in enumerate(lengths):
        table = [free.pop() for _ in range(-(-n // block_size))]
        _, k, v = qkv(1, n, group, head_dim, seed + 1 + i)
        slots = slot_tensor(table, 0, n, block_size)
        cache.write(0, slots, k, v)
        tables.append(table)
        written.append((k, v))
        stored.append(cache.read(0, slots))
    return cache, tables, written, stored


def padded(tables, width, pad):
    out = torch.full((len(tables), width), pad, dtype=torch.long)
    for i, t in enumerate(tables):
        out[i, :len(t)] = torch.tensor(t)
    return out


KV_DTYPES = ("fp32", "fp16", "bf16", "int8")
# (lengths of the batch's sequences, group, head_dim): single token, exact blocks, ragged batches
# head_dim 96 is not a power of two: int8 rows are stored unrotated
DECODE_CASES = [([1], 8, 64), ([16], 3, 64), ([37], 1, 128), ([5, 1, 80, 33], 4, 128), ([80, 80], 3, 64),
                ([21, 9], 2, 96)]


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
@pytest.mark.parametrize("block_size", (16, 5))
@pytest.mark.parametrize("lengths,group,head_dim", DECODE_CASES)
def test_paged_decode(kv_dtype, block_size, lengths, group, head_dim):
    cache, tables, written, stored = paged_cache(kv_dtype, block_size, group, head_dim, lengths)
    q, _, _ = qkv(len(lengths), 1, group, head_dim, seed=99)
    seq_lens = torch.tensor(lengths)
    width = max(map(len, tables)) + 2
    for pad, tile_tokens in ((cache.num_blocks - 1, 7), (-1, P.DECODE_TILE_TOKENS)):  # a NaN block; block -1
        out = P.paged_decode_attention(q, cache, 0, padded(tables, width, pad), seq_lens, tile_tokens=tile_tokens)
        assert out.shape == q.shape and torch.isfinite(out).all()
        for b in range(len(lengths)):
            # the kernel itself, on exactly the values the cache stores
            assert max_err(out[b:b + 1], ref64(q[b:b + 1], *stored[b], causal=True)) <= FP32_TOL
            # end to end, storage rounding included
            assert max_err(out[b:b + 1], ref64(q[b:b + 1], *written[b], causal=True)) <= STORAGE_TOL[kv_dtype]


# (num_tokens, q_offset, group, head_dim): one token, a fresh prompt, prefix-cache hits
PREFILL_CASES = [(1, 0, 8, 128), (23, 0, 3, 64), (9, 28, 4, 64), (40, 5, 1, 128), (7, 20, 3, 96)]


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
@pytest.mark.parametrize("block_size", (16, 5))
@pytest.mark.parametrize("backend", ("tiled", "sdpa"))
@pytest.mark.parametrize("num_tokens,q_offset,group,head_dim", PREFILL_CASES)
def test_paged_prefill(kv_dtype, block_size, backend, num_tokens, q_offset, group, head_dim):
    n = q_offset + num_tokens
    cache, tables, written, stored = paged_cache(kv_dtype, block_size, group, head_dim, [n])
    q, _, _ = qkv(num_tokens, 1, group, head_dim, seed=7)
    table = tables[0] + [cache.num_blocks - 1]  # a trailing NaN block the kernel must not need
    with A.force_attention_backend(backend):
        out = P.paged_prefill_attention(q, cache, 0, table, q_offset, tile_q=8, tile_k=6, span_k=12)
    assert torch.isfinite(out).all()
    assert max_err(out, ref64(q, *stored[0], causal=True, q_offset=q_offset)) <= FP32_TOL
    assert max_err(out, ref64(q, *written[0], causal=True, q_offset=q_offset)) <= STORAGE_TOL[kv_dtype]


def test_paged_prefill_uses_dispatcher(monkeypatch):
    cache, tables, _, _ = paged_cache("fp16", 16, 3, 64, [40])
    q, _, _ = qkv(8, 1, 3, 64)
    table = torch.tensor(tables[0])
    assert ran(lambda: P.paged_prefill_attention(q, cache, 0, table, 0)) == {"sdpa"}
    assert ran(lambda: P.paged_prefill_attention(q, cache, 0, table, 32)) == {"sdpa_masked"}
    monkeypatch.setattr(A, "SDPA_MASK_MAX_ELEMENTS", 0)
    assert ran(lambda: P.paged_prefill_attention(q, cache, 0, table, 32)) == {"tiled"}
    with A.force_attention_backend("sdpa"):
        assert ran(lambda: P.paged_prefill_attention(q, cache, 0, table, 32)) == {"sdpa_masked"}
    with A.force_attention_backend("tiled"):
        assert ran(lambda: P.paged_prefill_attention(q, cache, 0, table, 0)) == {"tiled"}


def test_paged_errors():
    cache, tables, _, _ = paged_cache("fp32", 16, 3, 64, [20])
    q, _, _ = qkv(1, 1, 3, 64)
    with pytest.raises(ValueError):
        P.paged_decode_attention(q, cache, 0, padded(tables, 2, 0), torch.tensor([33]))  # longer than its table
    with pytest.raises(ValueError):
        P.paged_decode_attention(q, cache, 0, padded(tables, 2, 0), torch.tensor([0]))
    with pytest.raises(ValueError):
        P.paged_prefill_attention(q.expand(30, -1, -1), cache, 0, tables[0][:1], 0)  # 30 tokens in one block
