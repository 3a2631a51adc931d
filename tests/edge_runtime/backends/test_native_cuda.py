"""The native engine on a CUDA GPU (skipped where CUDA is absent, as on the CPU CI machine)."""
import pytest
import torch

from edge_runtime.request import GenerationRequest, SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_cuda_greedy_matches_cpu_reference(model_path):
    from edge_runtime.backends.native import NativeBackend

    req = GenerationRequest(messages=[{"role": "user", "content": "Name three colours."}],
                            params=SamplingParams(max_tokens=16))
    gpu = NativeBackend(model_path, n_ctx=512, device="cuda", compile=False)
    cpu = NativeBackend(model_path, n_ctx=512, quant="fp32", compile=False)
    assert gpu.model.device.type == "cuda"
    out_gpu, out_cpu = gpu.generate(req), cpu.generate(req)
    assert out_gpu.token_ids[:8] == out_cpu.token_ids[:8]
