"""cpu_qgemm: every variant this CPU runs equals the numpy integer reference bit for bit, on every
block type, odd shapes and M = 1..16 (and beyond); rows do not depend on their batch mates or the
thread count; the EDGE_RUNTIME_ISA override and its errors."""
from __future__ import annotations

import os
import platform
import subprocess
import sys

import numpy as np
import pytest
import torch

from kernels import cpu_gemv, cpu_qgemm

pytestmark = pytest.mark.skipif(not cpu_gemv.available(), reason=cpu_gemv.unavailable_reason() or "no kernels")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def random_rows(kind: str, n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """uint8 [n, row_bytes]: random codes with finite fp16 scales (and mins) in every block."""
    values, nbytes = cpu_gemv.BLOCK[kind]
    blk = rng.integers(0, 256, size=(n, k // values, nbytes), dtype=np.uint8)
    scales = (rng.uniform(0.002, 0.05, size=(n, k // values, 2)) * rng.choice([-1, 1], size=(n, k // values, 2)))
    if kind in ("q4_k",):
        scales = np.abs(scales)
    halves = scales.astype(np.float16).view(np.uint8).reshape(n, k // values, 4)
    blk[..., :2] = halves[..., :2]
    if kind in ("q4_1", "q4_k"):
        blk[..., 2:4] = halves[..., 2:4]
    return blk.reshape(n, -1)


def activations(m: int, k: int, rng: np.random.Generator) -> np.ndarray:
    x = rng.standard_normal((m, k)).astype(np.float32)
    if m > 1:
        x[1, :32] = 0.0  # an all-zero block
    if m > 2:
        x[2, 7] = 300.0  # an outlier
    return x


def run(kind, w, x, n, threads=2):
    return cpu_qgemm.qgemm(kind, torch.from_numpy(w), torch.from_numpy(x), n, num_threads=threads).numpy()


@pytest.fixture
def each_variant():
    """Yields the variants this CPU runs, selecting each in turn; restores the previous one."""
    def gen():
        old = cpu_qgemm.variant()
        try:
            for v in cpu_qgemm.supported():
                cpu_qgemm.select(v)
                yield v
        finally:
            cpu_qgemm.select(old)
    return gen


SHAPES = [("q4_0", 96), ("q4_0", 576), ("q4_1", 96), ("q4_1", 576), ("q4_1", 1536), ("q8_0", 96), ("q8_0", 576),
          ("q4_k", 256), ("q4_k", 768)]


@pytest.mark.parametrize("kind,k", SHAPES)
def test_every_variant_equals_the_integer_reference_bit_for_bit(kind, k, each_variant):
    rng = np.random.default_rng(k + len(kind))
    n = 37
    w = random_rows(kind, n, k, rng)
    checked = []
    for m in list(range(1, 17)) + [33]:
        x = activations(m, k, rng)
        want = cpu_qgemm.reference_qgemm(kind, w, x, n)
        for v in each_variant():
            got = run(kind, w, x, n)
            assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), (v, m)
            checked.append(v)
    assert "portable" in checked


def test_the_reference_is_a_gemm_of_the_dequantized_weights():
    """Bit-equality with a wrong reference would prove nothing: the integer result stays within the
    8-bit activation rounding of the float64 product of the file's dequantized weights."""
    rng = np.random.default_rng(7)
    for kind, k in SHAPES:
        w = random_rows(kind, 40, k, rng)
        x = rng.standard_normal((5, k)).astype(np.float32)
        exact = cpu_gemv.reference_gemv(kind, w, x, 40)
        got = run(kind, w, x, 40)
        err = np.abs(got - exact).max() / np.abs(exact).max()
        assert err < 0.02, (kind, k, err)


def test_quantization_matches_the_reference(each_variant):
    rng = np.random.default_rng(3)
    x = activations(6, 576, rng)
    q, d, s, sf = cpu_qgemm.reference_quantize(x)
    for v in each_variant():
        gq, gd, gs, gsf = cpu_qgemm.quantize(torch.from_numpy(x))
        assert np.array_equal(gq.astype(np.int32), q), v
        assert np.array_equal(gd.view(np.uint32), d.view(np.uint32)) and np.array_equal(gs, s), v
        assert np.array_equal(gsf.view(np.uint32), sf.view(np.uint32)), v
    assert np.abs(q).max() == 127 and (q[1, :32] == 0).all()
    # half-way values round to even, as the C code's magic-number rounding does
    ties = np.zeros((1, 32), np.float32)
    ties[0, :4] = [127.0, 0.5, 1.5, -2.5]
    assert cpu_qgemm.reference_quantize(ties)[0][0, :4].tolist() == [127, 0, 2, -2]


@pytest.mark.parametrize("kind", ["q4_1", "q8_0", "q4_k"])
def test_a_row_does_not_depend_on_its_batch_or_the_threads(kind):
    rng = np.random.default_rng(11)
    k = 768
    w = random_rows(kind, 50, k, rng)
    x = activations(40, k, rng)
    whole = run(kind, w, x, 50)
    for m in (0, 5, 17, 39):
        alone = run(kind, w, x[m:m + 1], 50, threads=1)
        assert np.array_equal(alone, whole[m:m + 1]), m
    assert np.array_equal(run(kind, w, x[:9], 50, threads=1), whole[:9])


def test_real_gguf_weights(model_path):
    """The default model's own Q4_1 and Q8_0 tensors, every variant, equal to the reference."""
    from gguf import GGUFReader

    reader = GGUFReader(model_path)
    picked = {}
    for t in reader.tensors:
        kind = t.tensor_type.name.lower()
        if kind in cpu_qgemm.KIND_CODE and kind not in picked:
            picked[kind] = t
    assert {"q4_1", "q8_0"} <= set(picked)
    rng = np.random.default_rng(5)
    old = cpu_qgemm.variant()
    try:
        for kind, t in picked.items():
            n = min(64, int(t.shape[-1]))
            k = int(t.shape[0])
            rows = np.asarray(t.data).view(np.uint8).reshape(int(t.shape[-1]), -1)[:n].copy()
            x = rng.standard_normal((3, k)).astype(np.float32)
            want = cpu_qgemm.reference_qgemm(kind, rows, x, n)
            for v in cpu_qgemm.supported():
                cpu_qgemm.select(v)
                assert np.array_equal(run(kind, rows, x, n), want), (kind, v)
    finally:
        cpu_qgemm.select(old)


def test_bad_arguments_are_refused():
    w = torch.zeros((4, 20), dtype=torch.uint8)
    with pytest.raises(ValueError, match="K % 32"):
        cpu_qgemm.qgemm("q4_1", w, torch.zeros((1, 33)), 4)
    with pytest.raises(ValueError, match="weight must be"):
        cpu_qgemm.qgemm("q4_1", w, torch.zeros((1, 64)), 4)


def _isa_in_child(value: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, EDGE_RUNTIME_ISA=value)
    code = "from kernels import cpu_qgemm; print(cpu_qgemm.variant())"
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)


def test_isa_override_selects_and_refuses():
    res = _isa_in_child("portable")
    assert res.returncode == 0 and res.stdout.strip() == "portable", res.stderr
    res = _isa_in_child("auto")
    assert res.stdout.strip() == cpu_qgemm.best()
    res = _isa_in_child("sse9")
    assert res.returncode != 0 and "unknown ISA variant" in res.stderr and "avx512vnni" in res.stderr
    missing = [v for v in cpu_qgemm.VARIANTS if v not in cpu_qgemm.supported()]
    assert missing  # an x86 host lacks neon, an arm64 host the x86 variants
    res = _isa_in_child(missing[-1])
    assert res.returncode != 0 and f"cannot run the {missing[-1]} kernels" in res.stderr
    assert "portable" in res.stderr.splitlines()[-1]


def test_best_follows_the_cpu_flags():
    """On Linux x86-64 the choice from cpuid agrees with /proc/cpuinfo's flags."""
    flags = cpu_gemv._cpu_flags()
    if not flags or "avx2" not in flags:
        pytest.skip("needs Linux x86-64 with AVX2")
    if {"avx512_vnni", "avx512vl", "avx512bw", "amx_tile", "amx_int8"} <= flags:
        assert cpu_qgemm.best() == "amx"  # the kernel lists amx_tile only where it can grant the tile state
    elif {"avx512_vnni", "avx512vl", "avx512bw"} <= flags:
        assert cpu_qgemm.best() == "avx512vnni"
    elif "avx_vnni" in flags:
        assert cpu_qgemm.best() == "avxvnni"
    else:
        assert cpu_qgemm.best() == "avx2"


def test_the_op_and_gguf_linear_follow_the_arith_setting():
    """int8 (the default): torch.ops.edge_runtime.gguf_gemv and GGUFLinear give qgemm's bits for any
    number of rows (prefill included); exact: the fp32 GEMV's."""
    from gguf import GGMLQuantizationType

    from kernels.gguf_linear import GGUFLinear

    rng = np.random.default_rng(2)
    rows = random_rows("q4_1", 64, 256, rng)
    x = torch.from_numpy(activations(70, 256, rng))
    w = torch.from_numpy(rows)
    layer = GGUFLinear(GGMLQuantizationType.Q4_1, rows, (64, 256))
    old = cpu_gemv.arith()
    try:
        cpu_gemv.set_arith("int8")
        want = cpu_qgemm.qgemm("q4_1", w, x, 64)
        assert torch.equal(torch.ops.edge_runtime.gguf_gemv(w, x[:8], "q4_1", 64), want[:8])
        with torch.inference_mode():
            assert torch.equal(layer(x), want)  # 70 rows: no dense switch under int8
        cpu_gemv.set_arith("exact")
        assert torch.equal(torch.ops.edge_runtime.gguf_gemv(w, x[:8], "q4_1", 64), cpu_gemv.gemv("q4_1", w, x[:8], 64))
        with pytest.raises(ValueError, match="unknown arithmetic"):
            cpu_gemv.set_arith("int4")
    finally:
        cpu_gemv.set_arith(old)


@pytest.mark.parametrize("kind,k", [("q4_0", 96), ("q4_0", 576), ("q4_1", 576), ("q4_1", 1536), ("q8_0", 96),
                                    ("q8_0", 576)])
def test_the_packed_layout_gives_the_same_bits(kind, k, each_variant):
    """repack + qgemm_packed (rows of W as SIMD lanes) equals the reference for every M, odd N (a short
    last tile; amx: a pair of tiles and a lone last one) and thread counts; variants without a packed
    kernel say so."""
    rng = np.random.default_rng(k)
    ran = []
    for n, threads in ((29, 2), (20, 1), (20, 3)):
        w = random_rows(kind, n, k, rng)
        packed = cpu_qgemm.repack(kind, torch.from_numpy(w), n, k)
        assert packed.numel() == -(-n // 8) * 8 * (k // 32) * cpu_gemv.BLOCK[kind][1]  # same bytes per weight
        for v in each_variant():
            if not cpu_qgemm.packed_supported(kind):
                with pytest.raises(ValueError, match="rc=-3"):
                    cpu_qgemm.qgemm_packed(kind, packed, torch.zeros(1, k), n)
                continue
            for m in (1, 2, 3, 8, 16, 21):
                x = activations(m, k, rng)
                got = cpu_qgemm.qgemm_packed(kind, packed, torch.from_numpy(x), n, num_threads=threads).numpy()
                want = cpu_qgemm.reference_qgemm(kind, w, x, n)
                assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), (v, n, threads, m)
            ran.append(v)
    if platform.machine() in ("x86_64", "AMD64"):
        assert ran, "no x86 variant ran the packed kernel"
