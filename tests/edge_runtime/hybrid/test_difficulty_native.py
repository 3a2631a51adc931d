"""The difficulty router on the real model: the prompt's hidden state, the margin score and the packaged probe."""
import math
import os

import pytest
import torch

from edge_runtime.hybrid import difficulty
from edge_runtime.hybrid.difficulty import Calibration, load_calibration, prompt_features, score_prompts
from edge_runtime.request import GenerationRequest, SamplingParams


def chat_ids(backend, text):
    return backend.runner.tokenize(f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n")


def test_last_hidden_is_what_the_output_head_reads(native_backend):
    runner, model = native_backend.runner, native_backend.model
    runner.reset()
    logits = runner.prefill(chat_ids(native_backend, "What is the capital of Australia?"))
    h = runner.last_hidden  # the final state, then the layers MTP heads read if the model has taps
    assert h.shape == ((1 + len(model.taps)) * model.cfg.dim,) and h.dtype == torch.float32 and h.device.type == "cpu"
    with torch.inference_mode():
        assert torch.equal(model.output(h[None, :model.cfg.dim].to(model.device)).float()[0].cpu(), logits)
    kept = h.clone()
    runner.step(int(logits.argmax()))
    assert torch.equal(runner.last_hidden, kept)  # a copy: decode steps do not overwrite it


def test_last_hidden_after_a_prefix_cache_hit_that_leaves_one_token(native_backend):
    # the one new token runs through the one-token step (the C-fused decoder when built): same contract
    runner, model = native_backend.runner, native_backend.model
    block = runner.blocks.block_size
    ids = chat_ids(native_backend, "Tell me about the history of the Roman empire in a few sentences, please.")
    ids = ids[:(len(ids) - 1) // block * block + 1]
    assert len(ids) > block and len(ids) % block == 1
    runner.reset()
    full = runner.prefill(ids)
    full_hidden = runner.last_hidden
    runner.prefill(ids[:-1])  # commits the full blocks
    assert runner.blocks.num_cached_prefix(ids) == len(ids) - 1
    logits = runner.prefill(ids)
    h = runner.last_hidden
    with torch.inference_mode():
        assert torch.equal(model.output(h[None, :model.cfg.dim].to(model.device)).float()[0].cpu(), logits)
    assert torch.allclose(h, full_hidden, atol=2e-2, rtol=2e-2) and int(logits.argmax()) == int(full.argmax())


def stream(backend, prompt, confidence, max_tokens=16):
    req = GenerationRequest(messages=[{"role": "user", "content": prompt}], params=SamplingParams(max_tokens=max_tokens),
                            confidence=confidence)
    return [ev for ev in backend.stream_sync(req) if ev.type == "delta"]


def test_greedy_output_is_the_same_with_confidence_and_only_the_first_delta_carries_hidden(native_backend):
    for prompt in ("Write a haiku about the sea.", "What is 347 * 29?"):
        native_backend.runner.reset()
        plain = stream(native_backend, prompt, False)
        native_backend.runner.reset()
        watched = stream(native_backend, prompt, True)
        assert [ev.token_ids for ev in watched] == [ev.token_ids for ev in plain]
        assert "".join(ev.text for ev in watched) == "".join(ev.text for ev in plain)
        assert all(ev.info == {} for ev in plain)
        hidden = watched[0].info["hidden"]
        assert hidden.shape == (native_backend.model.cfg.dim,) and torch.isfinite(hidden).all()
        assert all("hidden" not in ev.info and set(ev.info) == {"entropy", "margin"} for ev in watched[1:] if ev.token_ids)


def test_real_model_scores_are_finite_deterministic_and_match_the_monitor(native_backend):
    prompts = ["Say hello.", "What is 347 * 29?", "What is the capital of Australia?"]
    scores = score_prompts(native_backend, prompts, k=2)
    assert len(scores) == 3 and all(math.isfinite(s) and 0.0 <= s <= 1.0 for s in scores)
    assert score_prompts(native_backend, prompts, k=2) == pytest.approx(scores, abs=1e-4)
    # the monitor of a margin calibration, fed the same stream, computes the same score at token k
    for prompt, score in zip(prompts, scores):
        m = Calibration(threshold=score - 1e-3, target_cloud_share=0.3, k=2).monitor()
        confs = difficulty.answer_confidences(native_backend, [prompt], 2)[0]
        assert "hidden" in confs[0]
        assert [m.push(c) is not None for c in confs] == [False, True]
        assert "after 2 tokens" in m.tripped and m.scorer == "margin"
    assert os.path.basename(native_backend.path) == load_calibration().model


def test_the_packaged_probe_on_the_real_model(native_backend):
    cal = load_calibration()
    code = "Write a Python function that returns the n-th Fibonacci number."
    chat = "Hi! How are you today?"
    _, hidden = prompt_features(native_backend, [code, chat], k=1)
    assert hidden.shape == (2, cal.probe.num_features)
    p_code, p_chat = cal.probe.score(hidden)
    assert p_code > p_chat  # the margin score had these the other way round
    for prompt, p in ((code, p_code), (chat, p_chat)):  # the monitor, fed the real stream, agrees
        m = cal.monitor()
        tripped = [m.push(ev.info) for ev in stream(native_backend, prompt, True, max_tokens=3)]
        assert m.scorer == "probe" and m.score == pytest.approx(p, abs=1e-5)
        assert (tripped[0] is not None) == (p > cal.probe_threshold)
