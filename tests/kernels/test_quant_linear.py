"""QuantLinear / QuantEmbedding against the plain reference (gguf's exact dequantization + fp32 F.linear).

Block data is real: gguf.quants.quantize for the types it can write, hand-built
random blocks with valid fp16 scales for the K-quants, and tensors of the
default model when it is installed. The CPU int4 layouts of other CPU
capabilities run in child processes (ATEN_CPU_CAPABILITY), and the default
model's int4/int8 greedy generation is checked against its fp32 reference.
"""
import os
import subprocess
import sys

import gguf
import numpy as np
import pytest
import torch

import kernels.quant_linear as quant_linear
from kernels.errors import UnsupportedTensorError
from kernels.gguf_blocks import dequantize_rows, int4_groups, q8_0_blocks
from kernels.quant_linear import MODES, _cpu_layout, pack_embedding, pack_weight, reference_linear
from tests.kernels.test_int4_layout import ATEN_LAYOUTS

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


def test_unknown_cpu_layout_uses_torch_packer(monkeypatch, tmp_path):
    """A layout outside CPU_LAYOUTS: torch's packer, codes read back through the kernel, no prefill switch."""
    monkeypatch.setattr(quant_linear, "_cpu_layout", lambda: "aten test build")
    data = make_tensor(T.Q4_1, 96, 512, seed=7)
    lin = pack_weight(T.Q4_1, data, (96, 512), "int4")
    assert (lin.kernel, lin.cpu_layout) == ("int4_cpu", "aten test build")
    x = torch.randn(8, 512)
    y = lin(x)
    assert rel_err(y, reference_linear(T.Q4_1, data, (96, 512), x)) < TOLERANCE["int4"]
    assert torch.equal(lin.int4_codes(), torch.from_numpy(int4_groups(T.Q4_1, data, (96, 512))[0]))
    lin.dense_min_tokens = 1
    assert torch.equal(lin(x), y)  # the int kernel, not the prefill switch
    torch.save(lin, tmp_path / "lin.pt")
    monkeypatch.undo()
    with pytest.raises(RuntimeError, match="aten test build"):  # the model loader rebuilds such a cache entry
        torch.load(tmp_path / "lin.pt", weights_only=False)


CHILD = """
import sys
import gguf, numpy as np, torch
import torch.nn.functional as F
from kernels.quant_linear import _cpu_layout, _pack_int4_cpu_direct, _unpack_int4_cpu, pack_weight, reference_linear
out, run_kernels = sys.argv[1], sys.argv[2] == "1"
layout = _cpu_layout()
print(torch.backends.cpu.get_cpu_capability(), tuple(layout))
for rows in (16, 48, 96, 176, 3072):
    codes = torch.randint(0, 16, (rows, 576), dtype=torch.int32)
    aten = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
    assert torch.equal(_pack_int4_cpu_direct(codes.to(torch.uint8).numpy(), layout), aten), rows
    assert torch.equal(_unpack_int4_cpu(aten, rows, 576, layout), codes.to(torch.uint8)), rows
saved, rng = [], np.random.default_rng(0)
T = gguf.GGMLQuantizationType
for qtype, mode, rows in ((T.Q4_1, "int4", 112), (T.Q8_0, "int8_block", 176)):
    data = gguf.quants.quantize((rng.standard_normal((rows, 512)) * 0.05).astype(np.float32), qtype)
    lin = pack_weight(qtype, data, (rows, 512), mode)
    assert lin.kernel == "int4_cpu" and lin.cpu_layout == layout
    if run_kernels:
        x = torch.randn(80, 512)
        ref = reference_linear(qtype, data, (rows, 512), x)
        y = lin(x)
        assert ((y - ref).norm() / ref.norm()).item() < 1e-2
        lin.dense_min_tokens = 64
        torch.testing.assert_close(lin(x), F.linear(x, lin.dequantized_weight()))  # the prefill switch
        lin.dense_min_tokens = None
    saved.append((int(qtype), mode, data, lin))
torch.save(saved, out)
"""
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NATIVE_CAPABILITIES = {"DEFAULT": {"default"}, "AVX2": {"default", "avx2"}, "AVX512": {"default", "avx2", "avx512"}}


@pytest.mark.parametrize("capability", ["default", "avx2", "avx512"])
def test_other_cpu_capabilities(capability, tmp_path):
    """Pack (and, where this CPU can run that kernel, multiply) with ATen dispatching to `capability`;
    the layers it saves load here, repacked for this process's layout (the packed-model cache)."""
    runnable = capability in NATIVE_CAPABILITIES.get(torch.backends.cpu.get_cpu_capability(), {"default"})
    env = {**os.environ, "ATEN_CPU_CAPABILITY": capability}
    proc = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path / "layers.pt"), "1" if runnable else "0"],
                          capture_output=True, text=True, env=env, timeout=120, cwd=REPO_ROOT)
    if proc.returncode == -4 and not runnable:  # SIGILL: this build's packer itself needs that CPU
        pytest.skip(f"torch's {capability} int4 packer does not run on this CPU")
    assert proc.returncode == 0, proc.stderr
    got_capability, got_layout = proc.stdout.split(maxsplit=1)
    if got_capability != capability.upper():
        pytest.skip(f"this torch build has no {capability} kernels (got {got_capability})")
    assert got_layout.strip() == str(tuple(ATEN_LAYOUTS[capability]))
    x = torch.randn(5, 512)
    for qtype, mode, data, lin in torch.load(tmp_path / "layers.pt", weights_only=False):
        assert (lin.mode, lin.kernel, lin.cpu_layout) == (mode, "int4_cpu", _cpu_layout())
        ref = reference_linear(T(qtype), data, (lin.out_features, 512), x)
        assert rel_err(lin(x), ref) < TOLERANCE[mode]


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
    data = make_tensor(qtype, 112, 512, seed=6)  # 112 rows: full blocks and a shorter one in every layout
    lin = pack_weight(qtype, data, (112, 512), mode)
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
    with pytest.raises(UnsupportedTensorError, match="Q5_0.*blk.0.attn_q"):
        pack_weight(T.Q5_0, data, (4, 64), "int4", name="blk.0.attn_q.weight")
    with pytest.raises(UnsupportedTensorError, match="Q5_0"):
        pack_embedding(T.Q5_0, data, (4, 64))
    with pytest.raises(UnsupportedTensorError):
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
    from edge_runtime.model.path import default_model_path

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


PROMPT = ("Explain in a few sentences why the sky is blue, what Rayleigh scattering is, and why sunsets are red "
          "and orange rather than blue. Keep it simple enough for a curious ten year old to follow.")
NEAR_TIE = 0.5  # a reference top-2 logit gap below this may flip under quantization: compare tokens up to there


def greedy(model, ids, num_tokens=16):
    """Greedy decode, one token a step -> (tokens, logits fp32 [num_tokens, vocab])."""
    model.allocate_cache(256)
    logits = [model(torch.tensor(ids), 0)[-1]]
    tokens = [int(logits[-1].argmax())]
    for pos in range(len(ids), len(ids) + num_tokens - 1):
        logits.append(model(torch.tensor(tokens[-1:]), pos)[-1])
        tokens.append(int(logits[-1].argmax()))
    return tokens, torch.stack(logits)


@pytest.fixture(scope="module")
def fp32_greedy(model_path):
    from edge_runtime.model.chat_template import ChatTemplate
    from edge_runtime.model.loader import load_model
    from edge_runtime.model.tokenizer import Tokenizer

    model, gf = load_model(model_path, quant="fp32")
    template = ChatTemplate.from_metadata(gf.metadata)
    prompt = template.render([{"role": "user", "content": PROMPT}])
    ids = Tokenizer.from_metadata(gf.metadata).encode(prompt, special=True)
    return ids, *greedy(model, ids)


@pytest.mark.parametrize("quant, kernel, tol", [("int4", "int4_cpu", 0.04), ("int8", "int8", 0.08)])
def test_greedy_generation_matches_fp32_reference(model_path, fp32_greedy, quant, kernel, tol):
    """The torch path end to end: the prompt (72 tokens) through the prefill switch, then one-token
    steps through the int kernel; tokens equal the fp32 reference's up to its first near-tie."""
    from edge_runtime.model.loader import load_model

    ids, ref_tokens, ref_logits = fp32_greedy
    model, _ = load_model(model_path, quant=quant, cache=False)
    assert len(ids) >= model.blocks[0].wqkv.dense_min_tokens and model.blocks[0].wqkv.kernel == kernel
    tokens, logits = greedy(model, ids, len(ref_tokens))
    top2 = ref_logits.topk(2, dim=-1).values
    ties = ((top2[:, 0] - top2[:, 1]) < NEAR_TIE).nonzero()
    n = int(ties[0]) if len(ties) else len(ref_tokens)
    assert n >= 8 and tokens[:n] == ref_tokens[:n]
    assert rel_err(logits[:n + 1], ref_logits[:n + 1]) < tol
