"""The C-fused one-token decode step against the readable torch step in model.py."""
import pytest
import torch

from edge_runtime.model_loader import load_model
from kernels import cpu_gemv

pytestmark = pytest.mark.skipif(not cpu_gemv.available(), reason="C kernels unavailable here")


def test_fused_step_matches_torch_step(model_path, prose):
    from edge_runtime.tokenizer import Tokenizer

    model, gf = load_model(model_path, quant="gguf")
    ids = Tokenizer.from_metadata(gf.metadata).encode(prose)[:40]
    model.allocate_cache(128)
    with torch.inference_mode():
        model(torch.tensor(ids[:20]), 0)  # prompt through the torch path
        assert model.enable_fused(cpu_gemv.library())
        fused = [model(torch.tensor([t]), 20 + i) for i, t in enumerate(ids[20:])]
        # the same steps again through the torch path (it rewrites the same cache rows)
        model.fused = None
        plain = [model(torch.tensor([t]), 20 + i) for i, t in enumerate(ids[20:])]
    for a, b in zip(fused, plain):
        assert a.shape == b.shape == (1, model.cfg.vocab_size)
        assert (a - b).abs().max().item() < 1e-3
        assert int(a.argmax()) == int(b.argmax())


def test_backend_uses_fused_step_and_greedy_matches_unfused(model_path):
    from edge_runtime.backends.native import NativeBackend
    from edge_runtime.request import GenerationRequest, SamplingParams

    fused = NativeBackend(model_path, n_ctx=512)
    plain = NativeBackend(model_path, n_ctx=512, fused=False)
    assert fused.fused and not plain.fused
    req = GenerationRequest(messages=[{"role": "user", "content": "Describe a rainy day."}],
                            params=SamplingParams(max_tokens=48))
    assert fused.generate(req).token_ids == plain.generate(req).token_ids
