"""QuantLinear / QuantEmbedding against the plain reference (gguf's exact dequantization + fp32 F.linear).

Block data is real: gguf.quants.quantize for the types it can write, hand-built
random blocks with valid fp16 scales for the K-quants, and tensors of the
default model when it is installed.
"""
import gguf
import numpy as np
import pytest
import torch

from edge_runtime.errors import UnsupportedModelError
from kernels.gguf_blocks import dequantize_rows, int4_groups, q8_0_blocks
from kernels.quant_linear import MODES, _pack_int4_cpu_direct, pack_embedding, pack_weight, reference_linear

T = gguf.GGMLQuantizationType
ALL_TYPES = [T.F32, T.F16, T.BF16, T.Q8_0, T.Q4_0, T.Q4_1, T.Q4_K, T.Q5_K, T.Q6_K]
K_QUANTS = (T.Q4_K, T.Q5_K, T.Q6_K)
# relative Frobenius error of the layer output vs the fp32 reference, bf16 activations included
TOLERANCE = {"fp32": 1e-6, "bf16": 1e-2, "int4": 1e-2, "int8_block": 1e-2, "int8": 2.5e-2}


def make_tensor(qtype, rows, cols, seed=0):
    """Raw GGUF data for a [rows, cols] tensor of `qtype`, as the reader would expose it."""
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((rows, cols)) * 0.05).astype(np.float32)
    if qtype == T.F32:
        return w
    if qtype == T.F16:
        return w.astype(np.float16)
    if qtype not in K_QUANTS:
        return gguf.quants.quantize(w, qtype)  # BF16 comes back as uint8 [rows, 2 * cols]
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, (rows * cols // block_size, type_size), dtype=np.uint8)
    d = (rng.random((blocks.shape[0], 2)) * 1e-3).astype(np.float16).view(np.uint8)  # d, dmin
    if qtype == T.Q6_K:
        blocks[:, -2:] = d[:, :2]
    else:
        blocks[:, :4] = d
    return blocks.reshape(rows, -1)


def exact(qtype, data, shape):
    return torch.from_numpy(gguf.quants.dequantize(np.asarray(data), qtype).reshape(shape).astype(np.float32))


def rel_err(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def expected_mode(qtype, mode):
    if mode == "int4" and qtype not in (T.Q4_0, T.Q4_1, T.Q4_K):
        return "int8"
    if mode == "int8_block" and qtype != T.Q8_0:
        return "int8"
    return mode


@pytest.mark.parametrize("qtype", [T.Q4_0, T.Q4_1, T.Q4_K], ids=lambda t: t.name)
def test_int4_groups_match_gguf(qtype):
    rows, cols = 48, 512
    data = make_tensor(qtype, rows, cols)
    q, scale, zero = int4_groups(qtype, data, (rows, cols))
    assert q.dtype == np.uint8 and q.max() <= 15 and scale.shape == zero.shape == (rows, cols // 32)
    w = (q.astype(np.float32) - 8).reshape(rows, -1, 32) * scale[..., None] + zero[..., None]
    np.testing.assert_allclose(w.reshape(rows, cols), exact(qtype, data, (rows, cols)).numpy(), rtol=1e-6, atol=1e-7)


def test_q8_0_blocks_exact():
    data = make_tensor(T.Q8_0, 16, 256)
    q, d = q8_0_blocks(data, (16, 256))
    w = q.reshape(16, -1, 32).astype(np.float32) * d[..., None].astype(np.float32)
    assert np.array_equal(w.reshape(16, 256), exact(T.Q8_0, data, (16, 256)).numpy())


@pytest.mark.parametrize("qtype", [T.Q4_0, T.Q4_1, T.Q4_K], ids=lambda t: t.name)
def test_int4_repack_keeps_codes_and_rounds_only_scales(qtype):
    rows, cols = 64, 512
    data = make_tensor(qtype, rows, cols, seed=1)
    lin = pack_weight(qtype, data, (rows, cols), "int4")
    assert (lin.mode, lin.kernel) == ("int4", "int4_cpu")
    q, scale, zero = int4_groups(qtype, data, (rows, cols))
    assert torch.equal(lin.int4_codes(), torch.from_numpy(q))  # read back through the kernel
    bf = lambda a: torch.from_numpy(a).to(torch.bfloat16).float()[..., None]  # noqa: E731
    want = ((torch.from_numpy(q).float() - 8).view(rows, -1, 32) * bf(scale) + bf(zero)).view(rows, cols)
    torch.testing.assert_close(lin.dequantized_weight(), want, rtol=1e-6, atol=1e-7)
    assert rel_err(lin.dequantized_weight(), exact(qtype, data, (rows, cols))) < 4e-3
    # identity input: the kernel itself reproduces the weight (rounded to bf16 on output)
    eye = torch.eye(cols)
    torch.testing.assert_close(lin(eye).t(), want.to(torch.bfloat16).float(), rtol=0, atol=0)


@pytest.mark.parametrize("rows", [32, 96, 3072])
def test_direct_cpu_packing_matches_aten(rows):
    codes = torch.randint(0, 16, (rows, 576), dtype=torch.int32)
    want = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
    assert torch.equal(_pack_int4_cpu_direct(codes.to(torch.uint8)), want)


@pytest.mark.parametrize("rows, kernel", [(48, "int4_cpu"), (40, "int4_dequant")])
def test_int4_rows_not_multiple_of_32(rows, kernel):
    data = make_tensor(T.Q4_0, rows, 256)
    lin = pack_weight(T.Q4_0, data, (rows, 256), "int4")
    assert lin.kernel == kernel
    x = torch.randn(3, 256)
    assert rel_err(lin(x), reference_linear(T.Q4_0, data, (rows, 256), x)) < TOLERANCE["int4"]


def test_int8_block_keeps_q8_0_codes():
    rows, cols = 64, 576
    data = make_tensor(T.Q8_0, rows, cols, seed=5)
    lin = pack_weight(T.Q8_0, data, (rows, cols), "int8_block")
    assert (lin.mode, lin.kernel) == ("int8_block", "int4_cpu")
    q, d = q8_0_blocks(data, (rows, cols))
    d_bf16 = torch.from_numpy(d.astype(np.float32)).to(torch.bfloat16).float()[..., None]
    want = (torch.from_numpy(q).float().view(rows, -1, 32) * d_bf16).view(rows, cols)
    assert torch.equal(lin.dequantized_weight(), want)  # codes exact, only d rounded to bf16


def test_move_to_a_device_without_kernel():
    data = make_tensor(T.Q4_1, 64, 256)
    lin = pack_weight(T.Q4_1, data, (64, 256), "int4")
    codes = lin.int4_codes()
    lin.to("meta")
    assert lin.kernel == "int4_dequant" and lin.weight.shape == codes.shape and lin.weight.is_meta
    assert lin(torch.randn(5, 256, device="meta")).shape == (5, 64)


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("mode", MODES)
def test_modes_match_reference(qtype, mode):
    rows, cols = 96, 512
    data = make_tensor(qtype, rows, cols, seed=2)
    lin = pack_weight(qtype, data, (rows, cols), mode)
    assert lin.mode == expected_mode(qtype, mode)
    x = torch.randn(2, 3, cols)  # [batch, tokens, in_features]
    y = lin(x)
    assert y.shape == (2, 3, rows) and y.dtype == torch.float32
    assert rel_err(y, reference_linear(qtype, data, (rows, cols), x)) < TOLERANCE[lin.mode]
    assert lin(x.to(torch.bfloat16)).dtype == torch.bfloat16
    if lin.mode != "fp32":
        lin.use_generic_kernel()  # the any-device path, on CPU
        assert rel_err(lin(x), y) < 1e-2


@pytest.mark.parametrize("qtype, mode", [(T.Q4_K, "int4"), (T.Q8_0, "int8_block"), (T.Q4_1, "int8")])
def test_prefill_dense_switch(qtype, mode):
    data = make_tensor(qtype, 64, 512, seed=6)
    lin = pack_weight(qtype, data, (64, 512), mode)
    x = torch.randn(8, 512)
    y_kernel = lin(x)
    lin.dense_min_tokens = 8
    y_dense = lin(x)
    torch.testing.assert_close(y_dense, torch.nn.functional.linear(x, lin.dequantized_weight()))
    assert rel_err(y_dense, y_kernel) < 1e-2
    torch.testing.assert_close(lin(x[:7]), y_kernel[:7])  # below the switch: the int kernel


@pytest.mark.parametrize("mode", ["int4", "int8", "bf16"])
def test_fused_and_permuted_rows(mode):
    cols = 576
    parts = [make_tensor(T.Q4_1, n, cols, seed=s) for s, n in enumerate((576, 192, 192))]  # q, k, v
    fused = np.concatenate(parts, axis=0)
    perm = np.random.default_rng(3).permutation(fused.shape[0])
    x = torch.randn(5, cols)
    lin = pack_weight(T.Q4_1, fused[perm], (960, cols), mode)
    want = torch.cat([reference_linear(T.Q4_1, p, (p.shape[0], cols), x) for p in parts], dim=-1)[:, perm]
    assert rel_err(lin(x), want) < TOLERANCE[mode]


def test_unsupported_and_malformed_raise():
    data = gguf.quants.quantize(np.ones((4, 64), np.float32), T.Q5_0)
    with pytest.raises(UnsupportedModelError, match="Q5_0.*blk.0.attn_q"):
        pack_weight(T.Q5_0, data, (4, 64), "int4", name="blk.0.attn_q.weight")
    with pytest.raises(UnsupportedModelError, match="Q5_0"):
        pack_embedding(T.Q5_0, data, (4, 64))
    with pytest.raises(UnsupportedModelError):
        pack_weight(T.Q4_1, make_tensor(T.Q4_1, 4, 64), (4, 96), "int4")
    with pytest.raises(ValueError):
        pack_weight(T.F32, np.ones((4, 64), np.float32), (4, 64), "int3")


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
def test_embedding_rows_exact(qtype):
    rows, cols = 40, 256
    data = make_tensor(qtype, rows, cols, seed=4)
    emb = pack_embedding(qtype, data, (rows, cols))
    ids = torch.tensor([[0, 7, 39], [7, 7, 1]])
    want = exact(qtype, data, (rows, cols))[ids]
    assert emb(ids).dtype == torch.float32 and torch.equal(emb(ids), want)
    assert np.array_equal(dequantize_rows(qtype, data, (rows, cols), ids.numpy()), want.reshape(-1, cols).numpy())


def test_dtype_casts_keep_storage():
    data = make_tensor(T.Q4_1, 32, 256)
    x = torch.randn(3, 256)
    for mode in MODES:
        lin = pack_weight(T.Q4_1, data, (32, 256), mode)
        before, dtypes = lin(x), [b.dtype for b in lin.buffers()]
        lin.half().to(torch.float64)
        assert [b.dtype for b in lin.buffers()] == dtypes and torch.equal(lin(x), before)
    emb = pack_embedding(T.Q8_0, make_tensor(T.Q8_0, 8, 64), (8, 64))
    assert emb.float().scales.dtype == torch.float16


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("qtype, mode", [(T.Q4_K, "int4"), (T.Q4_1, "int4"), (T.Q8_0, "int8_block"),
                                         (T.Q4_1, "int8"), (T.Q4_1, "bf16"), (T.Q4_1, "fp32")])
def test_cuda_roundtrip(qtype, mode):
    data = make_tensor(qtype, 256, 512)
    lin = pack_weight(qtype, data, (256, 512), mode)
    x = torch.randn(4, 512)
    y = lin(x)
    lin.to("cuda")
    assert lin.weight.is_cuda and lin.kernel in ("int4_cuda", "int4_dequant", "int8_dequant", "dense")
    assert rel_err(lin(x.cuda()).cpu(), y) < 1e-2, lin.kernel
    lin.to("cpu")
    assert torch.equal(lin(x), y)


@pytest.fixture(scope="module")
def default_reader():
    from edge_runtime.errors import ModelFileError
    from edge_runtime.model_path import default_model_path

    try:
        return gguf.GGUFReader(default_model_path())
    except ModelFileError as e:
        pytest.skip(str(e))


def test_default_model_tensors(default_reader):
    tensors = {t.name: t for t in default_reader.tensors}
    t = tensors["blk.0.attn_q.weight"]
    shape = (int(t.shape[1]), int(t.shape[0]))
    lin = pack_weight(t.tensor_type, t.data, shape, "int4", name=t.name)
    assert lin.mode == "int4"
    assert rel_err(lin.dequantized_weight(), exact(t.tensor_type, t.data, shape)) < 4e-3
    e = tensors["token_embd.weight"]
    shape = (int(e.shape[1]), int(e.shape[0]))
    ids = torch.tensor([0, 1, 12345, shape[0] - 1])
    emb = pack_embedding(e.tensor_type, e.data, shape, name=e.name)
    assert torch.equal(emb(ids), torch.from_numpy(dequantize_rows(e.tensor_type, e.data, shape, ids.numpy())))
    head = pack_weight(e.tensor_type, e.data[:4096], (4096, shape[1]), "int8_block", name=e.name)
    x = torch.randn(2, shape[1])
    assert rel_err(head(x), reference_linear(e.tensor_type, e.data[:4096], (4096, shape[1]), x)) < 1e-2
