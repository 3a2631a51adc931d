"""The native backend on the embedded model: compile is lossless, prefix reuse, limits, seeds, stops."""
import pytest

from edge_runtime.backends.native import NativeBackend
from edge_runtime.errors import ContextLengthError
from edge_runtime.request import GenerationRequest, SamplingParams


def chat(text, **params):
    return GenerationRequest(messages=[{"role": "user", "content": text}], params=SamplingParams(**params))


def test_compiled_decode_is_lossless(model_path):
    # On fp32 weights compiling only reorders float sums: greedy tokens must not change.
    compiled = NativeBackend(model_path, n_ctx=1024, quant="fp32", compile=True)
    eager = NativeBackend(model_path, n_ctx=1024, quant="fp32", compile=False)
    assert compiled.compiled and not eager.compiled
    for prompt in ["Name three planets.", "Write a haiku about autumn."]:
        req = chat(prompt, max_tokens=40)
        assert compiled.generate(req).token_ids == eager.generate(req).token_ids


def test_gguf_kernels_agree_with_fp32_reference(native_backend, model_path, exact_arith):
    # --arith exact keeps the file's blocks and multiplies in fp32: greedy output equals the
    # dequantized fp32 reference's.
    assert native_backend.quant == "gguf"
    ref = NativeBackend(model_path, n_ctx=1024, quant="fp32", compile=False)
    for prompt in ["Name three planets.", "Write a haiku about autumn."]:
        req = chat(prompt, max_tokens=40)
        assert native_backend.generate(req).token_ids == ref.generate(req).token_ids


def test_int8_arithmetic_agrees_with_exact_teacher_forced(native_backend, prose):
    """The default --arith int8 (8-bit activations) against --arith exact on the same 512 prose tokens:
    teacher-forced top-1 agreement (measured 95.3 % here; llama.cpp's int8 activations sit at about 96 %
    against the exact path) and the logits close; the two really differ (not the same path twice)."""
    from kernels import cpu_gemv

    runner = native_backend.runner
    ids = runner.tokenize(prose, special=False)[:512]
    assert cpu_gemv.arith() == "int8"
    int8 = runner.logits(ids)
    cpu_gemv.set_arith("exact")
    try:
        exact = runner.logits(ids)
    finally:
        cpu_gemv.set_arith("int8")
    agree = (int8.argmax(-1) == exact.argmax(-1)).float().mean().item()
    assert agree >= 0.93, agree
    assert 0 < (int8 - exact).abs().max().item() < 5.0


def test_chunked_prefill_matches_one_pass(model_path, prose):
    # fp32 weights and KV: bf16 weight kernels and fp16 KV rounding would amplify fp32 summation-order noise.
    ref = NativeBackend(model_path, n_ctx=1024, quant="fp32", compile=False, kv_dtype="fp32")
    runner = ref.runner
    ids = ref.tokenize(prose, special=False)[:300]
    runner.reset()
    one = runner.prefill(ids)
    runner.n_batch = 64
    try:
        runner.reset()
        chunked = runner.prefill(ids)
    finally:
        runner.n_batch = 512
    assert (one - chunked).abs().max().item() < 1e-4


def test_growing_chat_reuses_cached_prefix(native_backend):
    native_backend.reset_prefix_cache()
    first = chat("Tell me a fact about owls.", max_tokens=16)
    r1 = native_backend.generate(first)
    history = first.messages + [{"role": "assistant", "content": r1.text},
                                {"role": "user", "content": "And one about cats?"}]
    second = GenerationRequest(messages=history, params=SamplingParams(max_tokens=16))
    reused = native_backend.generate(second)
    cached, prompt_tokens = reused.timings["cached_prompt_tokens"], reused.usage.prompt_tokens
    # only the new turn was evaluated: the first turn's full blocks came from the cache
    assert cached >= (r1.usage.prompt_tokens // 16) * 16 and 0 < prompt_tokens - cached < 40
    native_backend.reset_prefix_cache()
    cold = native_backend.generate(second)
    assert cold.timings["cached_prompt_tokens"] == 0 and cold.token_ids == reused.token_ids  # same as a cold start


def test_max_tokens_gives_length_and_eos_gives_stop(native_backend):
    r = native_backend.generate(chat("Count from 1 to 100.", max_tokens=5))
    assert r.finish_reason == "length" and r.usage.completion_tokens == 5
    r = native_backend.generate(chat("Reply with just the word yes.", max_tokens=64))
    assert r.finish_reason == "stop" and r.usage.completion_tokens < 64


def test_stop_string_ends_the_answer_and_is_not_shown(native_backend):
    full = native_backend.generate(chat("Count from 1 to 10, separated by commas.", max_tokens=40)).text
    assert "4" in full
    r = native_backend.generate(chat("Count from 1 to 10, separated by commas.", max_tokens=40, stop=["4"]))
    assert r.finish_reason == "stop" and "4" not in r.text and full.startswith(r.text)


def test_same_seed_same_sampled_output(native_backend):
    req = lambda seed: chat("Write a sentence about the sea.", max_tokens=24, temperature=0.9, top_p=0.95, seed=seed)
    a, b, c = (native_backend.generate(req(s)).token_ids for s in (11, 11, 12))
    assert a == b and a != c


def test_prompt_longer_than_context_is_refused_before_work(model_path):
    small = NativeBackend(model_path, n_ctx=64, compile=False)
    with pytest.raises(ContextLengthError, match="context window is 64"):
        list(small.stream_sync(chat("word " * 100)))
    assert small.generate(chat("Hi", max_tokens=4)).usage.completion_tokens > 0  # still healthy
