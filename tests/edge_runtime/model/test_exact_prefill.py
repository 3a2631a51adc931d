"""With the integer kernels every path computes a row with the same arithmetic, so these are bit for bit
(`torch.equal`), on the real model: a prompt's last logits equal feeding it one token at a time; a prefix-
cache hit equals a cold prefill at every split point; a preempted sequence recomputed from its tokens
continues identically; and every ISA variant this CPU runs gives the same logits (the portable C one
included), so a hand-off between two machines continues the same greedy answer."""
from __future__ import annotations

import pytest
import torch

from edge_runtime.model.loader import load_model
from kernels import cpu_gemv, cpu_qgemm

pytestmark = pytest.mark.skipif(not cpu_gemv.available(), reason="C kernels unavailable here")


@pytest.fixture(scope="module")
def model_and_ids(model_path, prose):
    from edge_runtime.model.tokenizer import Tokenizer

    assert cpu_gemv.arith() == "int8"
    model, gf = load_model(model_path, quant="gguf")
    ids = Tokenizer.from_metadata(gf.metadata).encode(prose)[:200]
    model.allocate_cache(256, kv_dtype="fp16")
    assert model.enable_fused(cpu_gemv.library())
    return model, ids


@torch.inference_mode()
def test_prompt_logits_equal_one_token_at_a_time(model_and_ids):
    model, ids = model_and_ids
    whole = model(torch.tensor(ids[:60]), 0)  # [1, vocab]
    for pos, t in enumerate(ids[:60]):
        one = model(torch.tensor([t]), pos)
    assert torch.equal(whole, one)


@torch.inference_mode()
def test_a_prefix_cache_hit_equals_a_cold_prefill_at_every_split(model_and_ids):
    model, ids = model_and_ids
    cold = model(torch.tensor(ids), 0)
    splits = [1, 7, 15, 16, 17, 31, 48, 64, 65, 100, 128, 150, 190, 199]
    for s in splits:
        model(torch.tensor(ids[:s]), 0)  # what the cache held
        warm = model(torch.tensor(ids[s:]), s)  # the hit's tail
        assert torch.equal(warm, cold), s


@torch.inference_mode()
def test_a_recomputed_sequence_continues_identically(model_and_ids):
    """Preemption by recompute: the sequence's prompt and generated tokens prefilled again give the same
    next logits as the uninterrupted decode."""
    model, ids = model_and_ids
    logits = model(torch.tensor(ids[:40]), 0)
    out = []
    for i in range(12):
        t = int(logits.argmax())
        out.append(t)
        logits = model(torch.tensor([t]), 40 + i)
    again = model(torch.tensor(ids[:40] + out), 0)
    assert torch.equal(again, logits)


def test_the_runner_gives_cold_logits_after_a_prefix_hit(model_path, prose):
    """The same through the native runner and its block manager (the prefix cache a user hits)."""
    from edge_runtime.backends.native import NativeBackend

    runner = NativeBackend(model_path, n_ctx=512).runner
    ids = runner.tokenize(prose, special=False)
    shared, tail_a, tail_b = ids[:150], ids[150:170], ids[170:200]
    runner.reset()
    cold = runner.prefill(shared + tail_b)
    runner.reset()
    runner.prefill(shared + tail_a)  # caches the shared prefix's full blocks
    hits = runner.prefix_cache_stats["num_hit_tokens"]
    warm = runner.prefill(shared + tail_b)
    assert runner.prefix_cache_stats["num_hit_tokens"] - hits == (150 // 16) * 16
    assert torch.equal(cold, warm)


@torch.inference_mode()
def test_every_isa_variant_gives_the_same_logits(model_and_ids):
    model, ids = model_and_ids
    variants = cpu_qgemm.supported()
    assert "portable" in variants and len(variants) >= 2 or variants == ["portable"]
    old = cpu_qgemm.variant()
    runs = {}
    try:
        for v in variants:
            cpu_qgemm.select(v)
            logits = model(torch.tensor(ids[:24]), 0)
            rows = [logits]
            for i in range(4):
                logits = model(torch.tensor([int(logits.argmax())]), 24 + i)
                rows.append(logits)
            runs[v] = torch.cat(rows)
    finally:
        cpu_qgemm.select(old)
    for v, got in runs.items():
        assert torch.equal(got, runs["portable"]), v


def test_the_prefix_cache_does_not_mix_arithmetics(model_path, prose):
    """K/V cached under --arith exact are not reused by an int8 request (and back): switching the arithmetic
    at run time empties the prefix cache, so each answer is its own arithmetic's cold answer."""
    from edge_runtime.backends.native import NativeBackend

    runner = NativeBackend(model_path, n_ctx=512).runner
    ids = runner.tokenize(prose, special=False)[:100]
    runner.reset()
    cold_int8 = runner.prefill(ids)
    cpu_gemv.set_arith("exact")
    try:
        exact = runner.prefill(ids)
        assert runner.prefix_cache_stats["num_hit_tokens"] == 0
    finally:
        cpu_gemv.set_arith("int8")
    again = runner.prefill(ids)
    assert not torch.equal(exact, cold_int8) and torch.equal(again, cold_int8)
