"""What one engine step costs as it carries more rows, and what reading the weights costs.

`step_costs(model)` times the fused C decode step (`FusedDecoder.step_batch`) for M = 1, 2, 4,
8, 16 sequences at the same context, and one verification of 4 consecutive rows of one sequence
(`step_chunk`) against one step, medians of `repeats` rounds timed round-robin: the curve t(M)/t(1) says how much a
continuous batch or a draft costs over a lone step. `read_bandwidth_gbs` measures how fast this
machine streams memory (a sum over 512 MiB); `weight_bytes` is what one decode step must read.
Used by `edge-runtime bench decode` inside the native backend's process; it knows nothing of
llama.cpp or the report.
"""
from __future__ import annotations

import statistics
import time

import torch

STEP_ROWS = (1, 2, 4, 8, 16)


def _median_ms(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def _interleaved_median_ms(fns: dict, repeats: int) -> dict:
    """Median ms of each function, timed round-robin (one call of each per round, after a warm-up round), so a
    shared machine's drift during the run touches every figure alike and the ratios compare like with like."""
    for fn in fns.values():
        fn()
    times = {key: [] for key in fns}
    for _ in range(repeats):
        for key, fn in fns.items():
            t = time.perf_counter()
            fn()
            times[key].append((time.perf_counter() - t) * 1e3)
    return {key: statistics.median(v) for key, v in times.items()}


@torch.inference_mode()
def step_costs(model, token_ids: list[int], repeats: int = 11, context: int = 128) -> dict:
    """Step cost by rows: {"step_ms": {M: ms}, "step_cost_ratio": {M: t(M)/t(1)}, "verify_ms_4",
    "verify_cost_ratio_4", "context"}. Replaces the model's KV cache (call it last)."""
    from kernels import cpu_gemv

    rows = [m for m in STEP_ROWS if m <= cpu_gemv.max_rows()]
    block_size = 16
    per_seq = -(-(context + 8) // block_size)
    model.allocate_cache(context + 8, num_blocks=per_seq * max(rows), block_size=block_size,
                         kv_dtype=model.kv.kv_dtype if model.kv is not None else "fp16")
    model.enable_fused(cpu_gemv.library())
    if model.fused is None:
        return {}
    tables = [list(range(s * per_seq, (s + 1) * per_seq)) for s in range(max(rows))]
    for s, table in enumerate(tables):  # each sequence its own prompt, so no two rows attend alike
        model(torch.tensor(token_ids[s:s + context]), 0, block_table=table)
    nxt = token_ids[context:context + max(rows)]
    fns = {m: (lambda m=m: model.fused.step_batch(nxt[:m], [context] * m, tables[:m])) for m in rows}
    fns["verify_1"] = lambda: model.fused.step(nxt[0], context, tables[0])
    fns["verify_4"] = lambda: model.fused.step_chunk(nxt[:4], context, tables[0])
    ms = _interleaved_median_ms(fns, repeats)
    step_ms = {m: ms[m] for m in rows}
    one, four = ms["verify_1"], ms["verify_4"]
    return {"context": context, "step_ms": step_ms,
            "step_cost_ratio": {m: t / step_ms[1] for m, t in step_ms.items()},
            "verify_ms_1": one, "verify_ms_4": four, "verify_cost_ratio_4": four / one}


def weight_bytes(model) -> int:
    """Bytes of quantized weights one decode step reads (every GGUFLinear, the output head included)."""
    from kernels.gguf_linear import GGUFLinear

    return sum(mod.weight.numel() * mod.weight.element_size() for mod in model.modules()
               if isinstance(mod, GGUFLinear))


def read_bandwidth_gbs(threads: int, mib: int = 512, repeats: int = 5) -> float:
    """Memory read bandwidth in GB/s: torch's sum over `mib` MiB of fp32 (far more than the caches)."""
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        x = torch.ones(mib * 2 ** 20 // 4, dtype=torch.float32)
        ms = _median_ms(lambda: float(x.sum()), repeats)
        return x.numel() * 4 / (ms / 1e3) / 1e9
    finally:
        torch.set_num_threads(old)
