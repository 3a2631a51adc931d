"""`edge-runtime export-onnx`: the graph, its KV inputs/outputs, and agreement with the native engine."""
import json
import os

import numpy as np
import torch


def test_export_folder_and_graph(onnx_export_dir):
    import onnx

    meta = json.load(open(os.path.join(onnx_export_dir, "edge_runtime.json")))
    assert meta["format"] == "edge-runtime-onnx/1" and meta["accuracy_level"] == 0
    assert meta["config"]["num_layers"] == 30 and meta["gguf_metadata"]["tokenizer.ggml.model"] == "gpt2"
    model = onnx.load(os.path.join(onnx_export_dir, "model.onnx"), load_external_data=False)
    ops = [n.op_type for n in model.graph.node]
    assert ops.count("MatMulNBits") == 30 * 4 + 2  # qkv, o, gate/up, down per layer; the 8-bit head as two halves
    assert ops.count("GroupQueryAttention") == 30 and "GatherBlockQuantized" in ops
    inputs = [i.name for i in model.graph.input]
    outputs = [o.name for o in model.graph.output]
    assert inputs[:2] == ["input_ids", "num_logits"] and inputs[2:4] == ["past_key_values.0.key",
                                                                         "past_key_values.0.value"]
    assert outputs[0] == "logits" and outputs[-1] == "present.29.value" and len(outputs) == 61
    size = os.path.getsize(os.path.join(onnx_export_dir, "model.onnx.data"))
    assert 60e6 < size < 200e6  # weight-only 4/8-bit, not fp32 (which would be ~540 MB)


def test_teacher_forced_top1_agreement_with_native(ort_backend, native_backend, prose, exact_arith):  # the export keeps fp32 activations
    """The issue's bar: >= 99 % top-1 agreement with the native engine on the default model."""
    ids = native_backend.tokenize(prose[:3000], special=False)[:600]
    ours = native_backend.logits(ids)
    theirs = ort_backend.logits(ids)  # 600 tokens: two chunks of n_batch 512 through the KV inputs
    agree = float((ours.argmax(-1) == theirs.argmax(-1)).float().mean())
    print(f"top-1 agreement onnxruntime vs native over {len(ids)} positions: {agree:.4f}")
    assert agree >= 0.99
    assert float((ours - theirs).abs().max()) < 0.5


def test_incremental_steps_match_teacher_forced_rows(ort_backend, prose):
    """K/V fed back through past_key_values -> present: prefill then one-token steps give the rows of one pass."""
    runner = ort_backend.runner
    ids = ort_backend.tokenize(prose[:800], special=False)[:40]
    full = runner.logits(ids)
    runner.reset()
    rows = [runner.prefill(ids[:30])] + [runner.step(t) for t in ids[30:]]
    for i, row in enumerate(rows):
        torch.testing.assert_close(row, full[29 + i], rtol=1e-3, atol=1e-3)
    # a second prompt that shares the first 20 tokens keeps them and evaluates only the rest
    again = runner.prefill(ids[:20] + ids[25:35])
    assert runner.cached_ids == ids[:20] + ids[25:35]
    runner.reset()
    torch.testing.assert_close(again, runner.prefill(ids[:20] + ids[25:35]), rtol=1e-4, atol=1e-4)


def test_export_cli_and_bad_model(tmp_path, capsys):
    from edge_cli.main import main

    assert main(["export-onnx", "--model", str(tmp_path / "nope.gguf"), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("edge-runtime: error:") and "nope.gguf" in err
    assert not os.path.exists(tmp_path / "out" / "model.onnx")


def test_positions_follow_the_past_length(onnx_export_dir):
    """The graph derives positions from the past length: the same token at position 0 and 5 differs."""
    import onnxruntime as ort

    sess = ort.InferenceSession(os.path.join(onnx_export_dir, "model.onnx"), providers=["CPUExecutionProvider"])
    empty = np.zeros((1, 3, 0, 64), np.float32)
    feed = {f"past_key_values.{i}.{kv}": empty for i in range(30) for kv in ("key", "value")}
    out = sess.run(None, {**feed, "input_ids": np.array([[1, 2, 3, 4, 5, 6]]), "num_logits": np.array([6])})
    assert out[0].shape == (1, 6, 49152) and out[1].shape == (1, 3, 6, 64)
    past = {f"past_key_values.{i}.{kv}": out[1 + 2 * i + j] for i in range(30) for j, kv in enumerate(("key", "value"))}
    last = sess.run(None, {**past, "input_ids": np.array([[6]]), "num_logits": np.array([1])})
    assert last[0].shape == (1, 1, 49152) and last[1].shape == (1, 3, 7, 64)
    fresh = sess.run(None, {**feed, "input_ids": np.array([[6]]), "num_logits": np.array([1])})
    assert np.abs(last[0] - fresh[0]).max() > 1.0  # position and context matter


def test_int8_weights_mode(model_path):
    """--weights int8: every projection becomes 8-bit MatMulNBits (requantized per block of 32, symmetric)."""
    from edge_runtime.onnx.export import build_graph

    proto, cfg, _ = build_graph(model_path, weights="int8", accuracy_level=4)
    nbits = [n for n in proto.graph.node if n.op_type == "MatMulNBits"]
    assert len(nbits) == 30 * 4 + 1  # at level 4 the 8-bit head stays one node
    assert {a.i for n in nbits for a in n.attribute if a.name == "bits"} == {8}
    assert not [n for n in proto.graph.node if n.op_type == "ReduceSum"]  # no Q4_1 term: codes carry it all
