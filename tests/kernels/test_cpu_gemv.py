"""cpu_gemv (C GEMV on raw GGUF rows) against the plain reference (gguf dequantize + float64 matmul).

Block data is real: gguf.quants.quantize for Q4_0 / Q4_1 / Q8_0, random blocks with valid
fp16 scales for Q4_K, and tensors of the default model when it is installed. The scalar
fallback is built separately (no AVX2) and checked the same way. Everything is skipped
when the kernel cannot be built here (no gcc, no AVX2).
"""
import time

import gguf
import numpy as np
import pytest
import torch

from kernels import cpu_gemv

pytestmark = pytest.mark.skipif(not cpu_gemv.available(), reason=f"cpu_gemv unavailable: {cpu_gemv.unavailable_reason()}")

T = gguf.GGMLQuantizationType


def make_rows(kind, rows, cols, seed=0):
    """Raw GGUF rows uint8 [rows, row_bytes] of a random [rows, cols] weight."""
    rng = np.random.default_rng(seed)
    if kind == "q4_k":
        values, nbytes = cpu_gemv.BLOCK[kind]
        blocks = rng.integers(0, 256, (rows * cols // values, nbytes), dtype=np.uint8)
        blocks[:, :4] = (rng.random((blocks.shape[0], 2)) * 1e-3).astype(np.float16).view(np.uint8)  # d, dmin
        return blocks.reshape(rows, -1)
    w = (rng.standard_normal((rows, cols)) * 0.05 + rng.standard_normal((rows, 1)) * 0.02).astype(np.float32)
    return gguf.quants.quantize(w, T[kind.upper()])


def check(kind, rows, x, *, num_threads=None, lib=None):
    """Runs gemv and asserts it matches reference_gemv: max abs error <= 1e-4 * (1 + max|ref|)."""
    n = rows.shape[0]
    weight = torch.from_numpy(rows if rows.flags.writeable else rows.copy())  # model tensors are read-only mmaps
    got = cpu_gemv.gemv(kind, weight, torch.from_numpy(x), n, num_threads=num_threads, lib=lib)
    assert got.dtype == torch.float32 and got.shape == (x.shape[0], n)
    ref = cpu_gemv.reference_gemv(kind, rows, x, n)  # [M, N] float64
    err = np.abs(got.numpy().astype(np.float64) - ref).max()
    assert err <= 1e-4 * (1 + np.abs(ref).max()), (kind, x.shape, n, err, np.abs(ref).max())
    return got


@pytest.mark.parametrize("kind", ["q4_0", "q4_1", "q8_0"])
@pytest.mark.parametrize("num_tokens", [1, 2, 3, 8])
def test_random_blocks(kind, num_tokens):
    rows = make_rows(kind, 203, 576, seed=num_tokens)  # 203 rows: odd, not a multiple of any thread split
    x = np.random.default_rng(num_tokens).standard_normal((num_tokens, 576)).astype(np.float32)
    for threads in (1, 2, 3):
        check(kind, rows, x, num_threads=threads)


@pytest.mark.parametrize("kind", ["q4_0", "q4_1", "q8_0", "q4_k"])
@pytest.mark.parametrize("n, k", [(1, 256), (7, 512), (64, 1536), (1001, 256)])
def test_shapes(kind, n, k):
    """Tiny N (one row, fewer rows than threads), K with a ragged 8-block tail, many rows."""
    rows = make_rows(kind, n, k, seed=n)
    for num_tokens in (1, 4, 8):
        x = np.random.default_rng(k + num_tokens).standard_normal((num_tokens, k)).astype(np.float32)
        check(kind, rows, x, num_threads=2)


@pytest.mark.parametrize("num_tokens", [1, 3])
def test_q4_k(num_tokens):
    rows = make_rows("q4_k", 333, 1536, seed=3)
    x = np.random.default_rng(5).standard_normal((num_tokens, 1536)).astype(np.float32)
    check("q4_k", rows, x)


def test_model_tensors():
    """Real weights: the fused QKV rows, ffn_down (K = 1536) and a slice of the Q8_0 output head."""
    from edge_runtime.errors import ModelFileError
    from edge_runtime.model.gguf_file import GGUFFile
    from edge_runtime.model.path import default_model_path

    try:
        tensors = GGUFFile(default_model_path()).tensors
    except ModelFileError as e:
        pytest.skip(str(e))
    rng = np.random.default_rng(0)
    qkv = [tensors[f"blk.0.attn_{p}.weight"] for p in "qkv"]
    kind = qkv[0].tensor_type.name.lower()
    fused = np.concatenate([t.data for t in qkv])  # [960, row_bytes]: rows of three tensors
    for num_tokens in (1, 2, 3, 8):
        x = rng.standard_normal((num_tokens, qkv[0].shape[0])).astype(np.float32)
        check(kind, fused, x)
    down = tensors["blk.0.ffn_down.weight"]
    check(down.tensor_type.name.lower(), np.asarray(down.data), rng.standard_normal((3, down.shape[0])).astype(np.float32))
    head = tensors["token_embd.weight"]
    sliced = np.ascontiguousarray(head.data[1000:2999])  # 1999 rows
    for num_tokens in (1, 8):
        check(head.tensor_type.name.lower(), sliced, rng.standard_normal((num_tokens, head.shape[0])).astype(np.float32))


def test_scalar_fallback():
    """The portable build (no AVX2: the #else branch of cpu_gemv.c) gives the same results."""
    lib = cpu_gemv.load_variant(cpu_gemv.SCALAR_FLAGS)
    assert not lib.simd
    for kind in cpu_gemv.KINDS:
        k = 512
        rows = make_rows(kind, 45, k, seed=1)
        for num_tokens in (1, 3):
            x = np.random.default_rng(num_tokens).standard_normal((num_tokens, k)).astype(np.float32)
            simd = check(kind, rows, x)
            scalar = check(kind, rows, x, lib=lib)
            torch.testing.assert_close(scalar, simd, rtol=1e-5, atol=1e-5)


def test_input_handling():
    rows = torch.from_numpy(make_rows("q4_1", 16, 64))
    x = torch.randn(2, 64, dtype=torch.float64)
    torch.testing.assert_close(cpu_gemv.gemv("q4_1", rows, x, 16), cpu_gemv.gemv("q4_1", rows, x.float(), 16))
    wide = torch.randn(64, 2).t()  # non-contiguous [2, 64]
    torch.testing.assert_close(cpu_gemv.gemv("q4_1", rows, wide, 16), cpu_gemv.gemv("q4_1", rows, wide.contiguous(), 16))
    with pytest.raises(ValueError):
        cpu_gemv.gemv("q4_1", rows, torch.randn(9, 64), 16)  # M > 8
    with pytest.raises(ValueError):
        cpu_gemv.gemv("q4_1", rows, torch.randn(1, 96), 16)  # K does not match the rows
    with pytest.raises(ValueError):
        cpu_gemv.gemv("q4_1", rows, torch.randn(1, 48), 16)  # K not a multiple of 32
    with pytest.raises(ValueError):
        cpu_gemv.gemv("q4_1", rows[:, :-1], torch.randn(1, 64), 16)  # wrong row bytes


def test_env_override(monkeypatch):
    monkeypatch.setenv("EDGE_RUNTIME_CPU_GEMV", "0")
    cpu_gemv._load.cache_clear()
    try:
        assert not cpu_gemv.available() and "EDGE_RUNTIME_CPU_GEMV" in cpu_gemv.unavailable_reason()
        with pytest.raises(RuntimeError):
            cpu_gemv.gemv("q8_0", torch.zeros(1, 34, dtype=torch.uint8), torch.zeros(1, 32), 1)
    finally:
        monkeypatch.undo()
        cpu_gemv._load.cache_clear()
    assert cpu_gemv.available()


def test_threads_setting():
    rows = torch.from_numpy(make_rows("q8_0", 300, 256))
    x = torch.randn(1, 256)
    want = cpu_gemv.gemv("q8_0", rows, x, 300, num_threads=1)
    try:
        cpu_gemv.set_num_threads(2)
        torch.testing.assert_close(cpu_gemv.gemv("q8_0", rows, x, 300), want, rtol=0, atol=0)  # same row sums, any split
    finally:
        cpu_gemv.set_num_threads(0)


def test_custom_op_eager_and_compiled(exact_arith):
    """torch.ops.edge_runtime.gguf_gemv: same numbers eagerly and inside a fullgraph torch.compile."""
    rows = torch.from_numpy(make_rows("q4_1", 96, 64))
    head = torch.from_numpy(make_rows("q8_0", 40, 96))
    x = torch.randn(2, 64)

    def step(x):  # [2, 64] -> [2, 40]: two GEMVs with torch ops around them
        h = torch.ops.edge_runtime.gguf_gemv(rows, x, "q4_1", 96)
        return torch.ops.edge_runtime.gguf_gemv(head, torch.relu(h), "q8_0", 40) * 0.5

    eager = step(x)
    direct = cpu_gemv.gemv("q8_0", head, torch.relu(cpu_gemv.gemv("q4_1", rows, x, 96)), 40) * 0.5
    torch.testing.assert_close(eager, direct, rtol=0, atol=0)
    torch._dynamo.reset()
    t0 = time.perf_counter()
    compiled = torch.compile(step, fullgraph=True, dynamic=False)
    torch.testing.assert_close(compiled(x), eager, rtol=0, atol=0)
    assert time.perf_counter() - t0 < 120


@pytest.mark.parametrize("kind", ["q4_0", "q4_1", "q8_0", "q4_k"])
def test_dequantize_matches_gguf_exactly(kind):
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize as gguf_dequantize

    n, k = 37, 512
    values, nbytes = cpu_gemv.BLOCK[kind]
    rng = np.random.default_rng(5)
    raw = rng.integers(0, 256, size=(n, k // values * nbytes), dtype=np.uint8)
    # finite fp16 scales at the start of each block (q4_k: d and dmin)
    blocks = raw.reshape(n, -1, nbytes)
    n_scales = 2 if kind in ("q4_1", "q4_k") else 1
    blocks[:, :, : 2 * n_scales] = np.frombuffer(
        rng.uniform(-0.05, 0.05, size=(n, blocks.shape[1], n_scales)).astype(np.float16).tobytes(), np.uint8
    ).reshape(n, blocks.shape[1], 2 * n_scales)
    want = gguf_dequantize(raw, GGMLQuantizationType[kind.upper()]).reshape(n, k)
    got = cpu_gemv.dequantize(kind, torch.from_numpy(raw), n, k).numpy()
    np.testing.assert_array_equal(got, want.astype(np.float32))


@pytest.mark.parametrize("build", ["native", "portable"])
@pytest.mark.parametrize("kind", ["q4_0", "q4_1", "q8_0", "q4_k"])
def test_each_token_is_computed_alone_whatever_the_batch(kind, build):
    """Batch invariance, which makes continuous batching lossless: a token's output row is bit-identical
    whether it is multiplied alone or with 1..7 others (every M, every thread count), and the layer
    (GGUFLinear) splits up to 64 tokens into such GEMVs."""
    from kernels.gguf_linear import GGUFLinear

    lib = cpu_gemv.library() if build == "native" else cpu_gemv.load_variant(cpu_gemv.SCALAR_FLAGS)
    rows = make_rows(kind, 130, 512, seed=3)
    x = np.random.default_rng(5).standard_normal((8, 512)).astype(np.float32)
    weight = torch.from_numpy(rows)
    alone = [cpu_gemv.gemv(kind, weight, torch.from_numpy(x[i:i + 1]), 130, lib=lib)[0] for i in range(8)]
    for m in range(2, 9):
        for threads in (1, 2):
            got = cpu_gemv.gemv(kind, weight, torch.from_numpy(x[:m]), 130, num_threads=threads, lib=lib)
            for i in range(m):
                assert torch.equal(got[i], alone[i]), (m, threads, i)
    if build == "native":
        layer = GGUFLinear(T[kind.upper()], rows, (130, 512))
        xs = torch.randn(40, 512, generator=torch.Generator().manual_seed(0))
        with torch.inference_mode():
            together = layer(xs)
            for i in (0, 9, 17, 39):
                assert torch.equal(together[i], layer(xs[i:i + 1])[0]), i
