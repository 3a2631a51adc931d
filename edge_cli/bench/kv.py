"""`edge-runtime bench kv`: what the paged KV cache buys, each figure against its anchor.

- `kv_bytes_per_token.{fp32,fp16,bf16,int8}`: bytes one token's K and V take over all
  layers of the model, read from real allocated pools (target: int8 <= 0.55x fp16).
- `capacity`: how many concurrent 2,048-token sequences fit in a 256 MiB fp16 budget,
  paged (blocks allocated from the block manager until it says no room) vs a contiguous
  preallocation of the model's full context per sequence (`capacity_ratio`, target >= 3).
- `waste_slots_per_seq`: allocated but unused slots per live sequence over a seeded
  workload of prompts and decodes of varied lengths (target < block size).
- `prefix_ttft_speedup`: time to first token of a request whose 1,000-token system
  prompt was cached by an earlier request, vs the same request cold (target >= 5), on
  the real engine, medians of `repeats`.
"""
from __future__ import annotations

import json
import random
import statistics
import time

from edge_runtime.engine.block_manager import BlockManager

BUDGET_BYTES = 256 * 1024 ** 2
SEQ_TOKENS = 2048
SYSTEM_PROMPT_TOKENS = 1000


def bytes_per_token(model_cfg) -> dict:
    from kernels.kv_cache import KV_DTYPES, PagedKVCache

    out = {}
    for dtype in KV_DTYPES:
        cache = PagedKVCache(model_cfg.num_layers, 4, 16, model_cfg.num_kv_heads, model_cfg.head_dim, dtype)
        out[dtype] = cache.nbytes // (4 * 16)
        assert out[dtype] == PagedKVCache.bytes_per_token(model_cfg.num_layers, model_cfg.num_kv_heads,
                                                          model_cfg.head_dim, dtype)
    return out


def capacity(model_cfg, per_token: int, block_size: int = 16) -> dict:
    num_blocks = BUDGET_BYTES // (block_size * per_token)
    manager = BlockManager(num_blocks, block_size, prefix_caching=False)
    paged = 0
    rng = random.Random(0)
    while manager.allocate(paged, [rng.randrange(1000) for _ in range(SEQ_TOKENS)]) is not None:
        paged += 1
    contiguous = BUDGET_BYTES // (model_cfg.max_context * per_token)
    return {"budget_mib": BUDGET_BYTES / 1024 ** 2, "seq_tokens": SEQ_TOKENS, "paged_seqs": paged,
            "contiguous_seqs": contiguous, "contiguous_tokens_per_seq": model_cfg.max_context,
            "capacity_ratio": paged / contiguous if contiguous else float("inf")}


def waste(block_size: int = 16, num_seqs: int = 64, seed: int = 0) -> float:
    """Average unused allocated slots per live sequence: prompts of 1..2000 tokens, then 0..500 decodes."""
    rng = random.Random(seed)
    manager = BlockManager(num_seqs * (2600 // block_size + 1), block_size, prefix_caching=False)
    samples = []
    for s in range(num_seqs):
        prompt = [rng.randrange(50000) for _ in range(rng.randint(1, 2000))]
        assert manager.allocate(s, prompt) is not None
        for _ in range(rng.randint(0, 500)):
            assert manager.append(s, [rng.randrange(50000)])
    for s in range(num_seqs):
        samples.append(len(manager.block_table(s)) * block_size - manager.num_tokens(s))
    return statistics.mean(samples)


def prefix_ttft(model: str, threads: int | None, repeats: int) -> dict:
    from edge_runtime.backends import create_backend
    from edge_cli.bench.decode import PROSE
    from edge_runtime.request import GenerationRequest, SamplingParams

    backend = create_backend("native", model, n_ctx=2048, threads=threads)
    with open(PROSE, encoding="utf-8") as f:
        ids = backend.tokenize(f.read(), special=False)
    system = backend.runner.tokenizer.decode(ids[:SYSTEM_PROMPT_TOKENS])

    def request(question: str) -> GenerationRequest:
        return GenerationRequest(messages=[{"role": "system", "content": system},
                                           {"role": "user", "content": question}],
                                 params=SamplingParams(max_tokens=1))

    first, second = request("Summarise the preamble in one sentence."), request("Who may copy this license?")
    cold, cached = [], []
    for _ in range(repeats + 1):  # the first round warms up
        backend.reset_prefix_cache()  # empty prefix cache: the second request is evaluated in full
        cold.append(backend.generate(second).ttft_ms)
        backend.reset_prefix_cache()
        backend.generate(first)  # caches the system prompt's full blocks
        cached.append(backend.generate(second).ttft_ms)
    prompt_tokens = backend.generate(second).usage.prompt_tokens
    cold_ms, cached_ms = statistics.median(cold[1:]), statistics.median(cached[1:])
    return {"prompt_tokens": prompt_tokens, "cold_ttft_ms": cold_ms, "cached_ttft_ms": cached_ms,
            "prefix_ttft_speedup": cold_ms / cached_ms, "cold_runs_ms": cold[1:], "cached_runs_ms": cached[1:],
            "kv_dtype": backend.kv_config.kv_dtype}


def run_kv_bench(args) -> int:
    from edge_runtime.model.gguf_file import GGUFFile
    from edge_runtime.model.config import ModelConfig

    cfg = ModelConfig.from_gguf(GGUFFile(args.model))
    per_token = bytes_per_token(cfg)
    res = {"benchmark": "kv", "model": args.model,
           "kv_bytes_per_token": per_token,
           "int8_over_fp16": per_token["int8"] / per_token["fp16"],
           "capacity": capacity(cfg, per_token["fp16"]),
           "waste_slots_per_seq": waste(),
           "block_size": 16,
           "prefix": prefix_ttft(args.model, args.threads, args.repeats)}
    res["capacity_ratio"] = res["capacity"]["capacity_ratio"]
    res["prefix_ttft_speedup"] = res["prefix"]["prefix_ttft_speedup"]
    res["targets"] = {"int8_over_fp16": 0.55, "capacity_ratio": 3.0, "waste_slots_per_seq": 16,
                      "prefix_ttft_speedup": 5.0}
    res["date"] = time.strftime("%Y-%m-%d %H:%M:%S")
    print("KV bytes/token: " + ", ".join(f"{k} {v}" for k, v in per_token.items())
          + f"  (int8 / fp16 = {res['int8_over_fp16']:.3f}, target <= 0.55)")
    c = res["capacity"]
    print(f"{SEQ_TOKENS}-token sequences in {c['budget_mib']:.0f} MiB fp16: paged {c['paged_seqs']}, contiguous "
          f"{c['contiguous_seqs']} ({c['contiguous_tokens_per_seq']} tokens each): capacity_ratio "
          f"{c['capacity_ratio']:.2f} (target >= 3)")
    print(f"waste_slots_per_seq {res['waste_slots_per_seq']:.2f} (block size 16)")
    p = res["prefix"]
    print(f"TTFT with a cached {SYSTEM_PROMPT_TOKENS}-token system prompt ({p['prompt_tokens']} prompt tokens): "
          f"cold {p['cold_ttft_ms']:.0f} ms, cached {p['cached_ttft_ms']:.0f} ms: "
          f"prefix_ttft_speedup {p['prefix_ttft_speedup']:.1f} (target >= 5)")
    from edge_cli.bench.decode import machine

    res["machine"] = machine()
    if args.json_file:
        with open(args.json_file, "w") as f:
            json.dump(res, f, indent=2)
    return 0
