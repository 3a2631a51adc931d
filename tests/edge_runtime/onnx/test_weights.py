"""GGUF blocks -> MatMulNBits blocks (weights.py): exact where the formats meet, checked by onnxruntime."""
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

from edge_runtime.model.gguf_file import GGUFFile
from edge_runtime.model.loader import _Tensors
from edge_runtime.onnx.export import _Graph
from edge_runtime.onnx.weights import NBits, concat, from_gguf_rows, quantize, split_8bit
from kernels.gguf_blocks import dequantize


@pytest.fixture(scope="module")
def tensors(model_path):
    return _Tensors(GGUFFile(model_path))


def _ort_matmul(w: NBits, x: np.ndarray, level: int = 0) -> np.ndarray:
    """x @ w.T through onnxruntime's MatMulNBits (the exporter's node, with its Q4_1 term)."""
    import onnxruntime as ort
    from onnx import TensorProto, helper

    g = _Graph(level)
    y = g.matmul("x", w, "w")
    g.nodes.append(helper.make_node("Identity", [y], ["y"]))
    graph = helper.make_graph(g.nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, None, w.k])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, None, w.n])], g.inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)])
    model.ir_version = 10
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, {"x": x[None]})[0][0]


@pytest.mark.parametrize("name", ["blk.3.ffn_up.weight", "token_embd.weight"])
def test_gguf_blocks_map_exactly(tensors, name):
    """Q4_1 (layers) and Q8_0 (embeddings / tied head) keep the GGUF's weights, and onnxruntime multiplies with them."""
    qtype, rows, n, k = tensors.rows(name)
    if name == "token_embd.weight":
        rows, n = rows[:2048], 2048  # a slice of the 49152 rows keeps the check fast
    want = dequantize(qtype, rows, (n, k))
    w = from_gguf_rows(qtype, rows, k)
    assert w.bits == (8 if qtype == T.Q8_0 else 4)
    np.testing.assert_allclose(w.dequantize(), want, rtol=1e-6, atol=1e-6)
    x = np.random.default_rng(0).standard_normal((3, k)).astype(np.float32)
    ref = x.astype(np.float64) @ want.T.astype(np.float64)
    got = _ort_matmul(w, x)
    assert np.abs(got - ref).max() < 1e-4 * np.abs(ref).max()  # fp32 sums: the order of additions only


def test_q4_1_zero_point_centres_the_codes(tensors):
    """The integer zero point takes most of m: what is left as the additive term is at most half a step."""
    qtype, rows, n, k = tensors.rows("blk.0.attn_output.weight")
    w = from_gguf_rows(qtype, rows, k)
    inside = (w.zero_points > 0) & (w.zero_points < 15)
    assert inside.mean() > 0.9
    assert np.all(np.abs(w.mins[inside]) <= 0.5 * w.scales[inside] * (1 + 1e-5))


def test_q4_0_and_requantized_weights():
    rng = np.random.default_rng(1)
    w = rng.standard_normal((8, 64)).astype(np.float32)
    q4 = quantize(w, 4)
    step = (np.maximum(w.reshape(8, 2, 32).max(-1), 0) - np.minimum(w.reshape(8, 2, 32).min(-1), 0)) / 15
    assert np.all(np.abs(q4.dequantize() - w).reshape(8, 2, 32) <= step[..., None] * 0.5 + 1e-6)
    q8 = quantize(w, 8)
    assert np.abs(q8.dequantize() - w).max() <= np.abs(w).max() / 127
    # Q4_0: d (q - 8), built by hand (d = 0.5 as fp16, codes 0..15 in GGUF's nibble order)
    codes = rng.integers(0, 16, size=(4, 32)).astype(np.uint8)
    blk = np.concatenate([np.frombuffer(np.float16(0.5).tobytes(), np.uint8)[None].repeat(4, 0),
                          codes[:, :16] | (codes[:, 16:] << 4)], axis=1)
    w0 = from_gguf_rows(T.Q4_0, blk, 32)
    np.testing.assert_array_equal(w0.dequantize(), 0.5 * (codes.astype(np.float32) - 8))
    x = rng.standard_normal((2, 32)).astype(np.float32)
    np.testing.assert_allclose(_ort_matmul(w0, x), x @ w0.dequantize().T, rtol=1e-5, atol=1e-5)


def test_split_8bit_is_the_same_weight(tensors):
    qtype, rows, n, k = tensors.rows("token_embd.weight")
    w = from_gguf_rows(qtype, rows[:512], k)
    hi, lo = split_8bit(w)
    np.testing.assert_allclose(hi.dequantize() + lo.dequantize(), w.dequantize(), rtol=0, atol=1e-6)
    with pytest.raises(ValueError):
        split_8bit(hi)


def test_concat_fuses_same_width_only():
    rng = np.random.default_rng(2)
    a, b = quantize(rng.standard_normal((4, 64)), 4), quantize(rng.standard_normal((6, 64)), 4)
    fused = concat([a, b])
    np.testing.assert_array_equal(fused.dequantize(), np.concatenate([a.dequantize(), b.dequantize()]))
    assert concat([a, quantize(rng.standard_normal((4, 64)), 8)]) is None
