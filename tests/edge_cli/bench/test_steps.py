"""bench decode's step-cost figures (edge_cli/bench/steps.py) on the real model: what it times is the
fused step it names, and the ratios are recomputed from the times it reports."""
import pytest

from edge_cli.bench import steps as bench_steps
from edge_runtime.model.loader import load_model
from edge_runtime.model.tokenizer import Tokenizer
from kernels import cpu_gemv

pytestmark = pytest.mark.skipif(not cpu_gemv.available(), reason="C kernels unavailable here")


def test_step_costs_times_every_row_count_and_recomputes_its_ratios(model_path, prose, monkeypatch):
    monkeypatch.setattr(bench_steps, "STEP_ROWS", (1, 2, 4))
    model, gf = load_model(model_path, quant="gguf")
    ids = Tokenizer.from_metadata(gf.metadata).encode(prose * 3)
    calls = []
    real = bench_steps._interleaved_median_ms

    def spy(fns, repeats):
        calls.append((sorted(map(str, fns)), repeats))
        return real(fns, repeats)

    monkeypatch.setattr(bench_steps, "_interleaved_median_ms", spy)
    out = bench_steps.step_costs(model, ids, repeats=2, context=40)
    assert calls == [(sorted(["1", "2", "4", "verify_1", "verify_4"]), 2)]  # one round-robin over every figure
    assert set(out["step_ms"]) == {1, 2, 4} and all(t > 0 for t in out["step_ms"].values())
    for m, t in out["step_ms"].items():
        assert out["step_cost_ratio"][m] == pytest.approx(t / out["step_ms"][1])
    assert out["verify_cost_ratio_4"] == pytest.approx(out["verify_ms_4"] / out["verify_ms_1"])
    assert out["context"] == 40


def test_interleaved_medians_time_each_function_once_per_round():
    order = []
    fns = {k: (lambda k=k: order.append(k)) for k in ("a", "b")}
    ms = bench_steps._interleaved_median_ms(fns, 3)
    assert order == ["a", "b"] * 4  # a warm-up round, then 3 rounds alternating
    assert set(ms) == {"a", "b"} and all(v >= 0 for v in ms.values())
