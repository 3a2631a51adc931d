"""The continuous-batching model runner: a step of many sequences gives each one exactly the logits it
gets alone (variable-length prefill packed into one pass, decodes in one batched C call), and the
engine's concurrent greedy requests equal the same requests run one at a time."""
import threading

import pytest
import torch

from edge_runtime.engine.block_manager import BlockManager
from edge_runtime.engine.scheduler import ScheduledChunk, Sequence

PROMPTS = ["The quick brown fox jumps over the lazy dog because",
           "In 1492, Columbus sailed the ocean blue and",
           "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
           "Rain fell on the quiet village all night, and by morning the river"]


@pytest.fixture(scope="module")
def engine(model_path):
    from edge_runtime.engine.batch_engine import load_engine
    from edge_runtime.engine.scheduler import SchedulerConfig

    return load_engine(model_path, n_ctx=1024, kv_budget="64MiB",
                       config=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=96, chunk_size=64))


def _chunks(engine, blocks, ids_list, start_of):
    out = []
    for n, ids in enumerate(ids_list):
        seq = Sequence(n, list(ids), len(ids))
        out.append(ScheduledChunk(seq, start_of(ids), len(ids), blocks.block_table(n)))
    return out


@pytest.mark.parametrize("decode", [False, True])
def test_a_packed_step_equals_each_sequence_alone(engine, decode):
    """Prefill chunks of 4 sequences in one variable-length pass (or their next tokens in one batched
    decode) give bit-identical logits to running each sequence's chunk by itself."""
    runner, kv = engine.runner, engine.model.kv
    ids_list = [engine.tokenize(p) for p in PROMPTS]
    assert sum(len(i) for i in ids_list) <= runner.varlen_max_tokens
    blocks = BlockManager(kv.num_blocks, kv.block_size, prefix_caching=False)
    for n, ids in enumerate(ids_list):
        blocks.allocate(n, ids + [7])
    prompt = [ids for ids in ids_list]
    full = [ids + [7] for ids in ids_list]
    together = runner.run(_chunks(engine, blocks, prompt, lambda ids: 0))
    if decode:
        together = runner.run(_chunks(engine, blocks, full, lambda ids: len(ids) - 1))
    for n in range(len(PROMPTS)):
        alone = runner.run([_chunks(engine, blocks, prompt, lambda ids: 0)[n]])
        if decode:
            alone = runner.run([_chunks(engine, blocks, full, lambda ids: len(ids) - 1)[n]])
        assert torch.equal(together[n], alone[0]), n
    assert together[0].shape == (1, engine.model.cfg.vocab_size)  # one row: no drafts
    engine.blocks.reset_prefix_cache()  # this test wrote the pools through its own block manager


def _generate(engine, prompts, max_tokens=24, **params):
    from edge_runtime.request import GenerationRequest, SamplingParams

    results, done = {}, threading.Event()

    def sink_for(i):
        def sink(ev):
            r = results.setdefault(i, {"ids": [], "text": ""})
            if ev.type == "delta":
                r["ids"] += ev.token_ids
                r["text"] += ev.text
            else:
                r["finish"] = ev.finish_reason
                if len([x for x in results.values() if "finish" in x]) == len(prompts):
                    done.set()
        return sink

    for i, p in enumerate(prompts):
        engine.submit(f"t{i}-{id(done)}", GenerationRequest(prompt=p, params=SamplingParams(max_tokens=max_tokens,
                                                                                            **params)), sink_for(i))
    while not done.is_set():
        engine.step()
    return [results[i] for i in range(len(prompts))]


def test_engine_batched_greedy_equals_one_at_a_time(engine):
    alone = [_generate(engine, [p])[0] for p in PROMPTS]
    together = _generate(engine, PROMPTS)
    assert together == alone
    assert engine.blocks.stats()["num_used_blocks"] == 0


def test_engine_seeded_sampling_equals_one_at_a_time(engine):
    """Each request samples with its own seeded generator: batching does not change what it draws."""
    params = {"temperature": 0.9, "top_p": 0.95, "seed": 11}
    alone = [_generate(engine, [p], **params)[0] for p in PROMPTS]
    assert _generate(engine, PROMPTS, **params) == alone


def test_engine_matches_the_single_stream_backend(engine, model_path):
    """The worker's engine and the local native backend give the same greedy answer."""
    from edge_runtime.backends.native import NativeBackend
    from edge_runtime.request import GenerationRequest, SamplingParams

    local = NativeBackend(model_path, n_ctx=1024)
    for p in PROMPTS[:2]:
        ref = local.generate(GenerationRequest(prompt=p, params=SamplingParams(max_tokens=24)))
        got = _generate(engine, [p])[0]
        assert got["ids"] == ref.token_ids and got["text"] == ref.text


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_engine_on_cuda_bf16_batches_and_agrees_with_one_at_a_time(model_path):
    """On a GPU the torch step runs (bf16 weights, batched projections, paged decode attention, SDPA for
    prompts). cuBLAS picks kernels by batch size, so rows are not bit-identical there: the first tokens
    must agree and every request must finish."""
    from edge_runtime.engine.batch_engine import load_engine

    gpu = load_engine(model_path, n_ctx=1024, device="cuda", quant="bf16", kv_dtype="bf16")
    assert gpu.runner.decode_group > 8 and gpu.model.fused is None
    alone = [_generate(gpu, [p])[0] for p in PROMPTS]
    together = _generate(gpu, PROMPTS)
    for a, b in zip(alone, together):
        assert b["finish"] == "length" and b["ids"][:4] == a["ids"][:4]
