"""`edge-runtime bench attention`: the attention kernels against each other, in fresh processes.

Causal prefill at N = 1k/4k/16k tokens (9 query heads, 3 KV heads, head_dim 64, fp32):
- tiled: `kernels.attention.tiled_attention` (online softmax, O(N * tile) extra memory);
- naive: `kernels.reference.attention`, the full N x N score matrix (all heads at once up to 4k,
  one query head at a time beyond, so the machine survives: still N x N per head);
- sdpa: torch `F.scaled_dot_product_attention` (is_causal, enable_gqa) on [1, heads, N, 64].
Then paged decode of one token over a 4k context (B=1, block 16, fp16 and int8 pools) against
gathering the blocks into a contiguous fp32 tensor and calling SDPA.

Method: every (kernel, N) runs once in its own process for memory: the peak extra resident
memory its first call needs beyond the inputs (output included). The kernel is warmed up on a
tiny problem, the peak-RSS mark is reset (/proc/self/clear_refs, else ru_maxrss), and the
peak after one call minus the RSS before it is reported. Times are medians of >= 3 warm calls;
tiled and sdpa are timed alternately in one process, so load from other processes hits both
alike; naive is timed in its memory process (at 16k on that single first call: it takes
most of a minute).

NOTE: on a shared machine, OpenMP's spinning waits turn each of the tiled kernel's many short
parallel regions into a scheduler time slice whenever another process holds a core; the JSON
records OMP_WAIT_POLICY, the thread count and the load average so figures can be judged.
This module knows nothing of models or the engine: it times kernels on random tensors.
"""
from __future__ import annotations

import json
import os
import re
import statistics
import subprocess
import sys
import time

from edge_runtime.errors import EdgeRuntimeError

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 9, 3, 64
DECODE_CONTEXT, DECODE_BLOCK = 4096, 16
KERNELS = ("tiled", "naive", "sdpa")
TARGETS = {"mem_ratio_naive_over_tiled_16k": 8.0, "speed_ratio_tiled_over_sdpa_16k": 0.8}


# ---- worker side (runs in a fresh process) -----------------------------------------------------
def _rss_kib() -> tuple[int, int]:
    """(current RSS, peak RSS) in KiB."""
    try:
        with open("/proc/self/status") as f:
            status = f.read()
        return (int(re.search(r"VmRSS:\s+(\d+)", status).group(1)), int(re.search(r"VmHWM:\s+(\d+)", status).group(1)))
    except (OSError, AttributeError):
        import resource

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak, peak


def _reset_peak() -> None:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS (Linux >= 4.0)
    except OSError:
        pass  # ru_maxrss fallback: the peak then also covers start-up, so the figure is an upper bound


def _prefill_fn(kernel: str, n: int):
    import torch
    import torch.nn.functional as F

    from kernels.attention import tiled_attention
    from kernels.reference import attention as reference

    g = torch.Generator().manual_seed(0)
    q = torch.randn(n, NUM_HEADS, HEAD_DIM, generator=g)  # [N, num_heads, head_dim]
    k = torch.randn(n, NUM_KV_HEADS, HEAD_DIM, generator=g)  # [N, num_kv_heads, head_dim]
    v = torch.randn(n, NUM_KV_HEADS, HEAD_DIM, generator=g)
    group = NUM_HEADS // NUM_KV_HEADS
    if kernel == "tiled":
        return lambda: tiled_attention(q, k, v, causal=True)
    if kernel == "sdpa":
        qh, kh, vh = (x.transpose(0, 1).contiguous()[None] for x in (q, k, v))  # [1, heads, N, head_dim]
        return lambda: F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, enable_gqa=True)
    if n <= 4096:
        return lambda: reference(q, k, v, causal=True)

    def naive_per_head():
        out = torch.empty_like(q)
        for h in range(NUM_HEADS):
            kv = slice(h // group, h // group + 1)
            out[:, h:h + 1] = reference(q[:, h:h + 1], k[:, kv], v[:, kv], causal=True)
        return out

    return naive_per_head


def measure_prefill(kernel: str, n: int, threads: int | None, repeats: int) -> dict:
    import torch

    if threads:
        torch.set_num_threads(threads)
    _prefill_fn(kernel, 64)()  # load and initialize everything on a tiny problem first
    fn = _prefill_fn(kernel, n)
    _reset_peak()
    before, _ = _rss_kib()
    t = time.perf_counter()
    out = fn()
    first_s = time.perf_counter() - t
    _, peak = _rss_kib()
    del out
    runs = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        runs.append(time.perf_counter() - t)
    times = runs or [first_s]
    return {"ms": 1e3 * statistics.median(times), "runs_ms": [1e3 * x for x in times], "first_call_ms": 1e3 * first_s,
            "peak_mib": max(0, peak - before) / 1024, "threads": torch.get_num_threads(),
            "mode": "per_head" if kernel == "naive" and n > 4096 else "all_heads"}


def measure_ab(n: int, threads: int | None, repeats: int) -> dict:
    """tiled and sdpa at N, timed alternately (after one warm call each)."""
    import torch

    if threads:
        torch.set_num_threads(threads)
    fns = {kernel: _prefill_fn(kernel, n) for kernel in ("tiled", "sdpa")}
    times = {kernel: [] for kernel in fns}
    for fn in fns.values():
        fn()
    for _ in range(repeats):
        for kernel, fn in fns.items():
            t = time.perf_counter()
            fn()
            times[kernel].append(1e3 * (time.perf_counter() - t))
    return times


def measure_decode(kv_dtype: str, threads: int | None, repeats: int) -> dict:
    import torch
    import torch.nn.functional as F

    from kernels.paged_attention import paged_decode_attention
    from kernels.kv_cache import PagedKVCache, hadamard_rotate, slot_tensor

    if threads:
        torch.set_num_threads(threads)
    num_blocks = DECODE_CONTEXT // DECODE_BLOCK
    cache = PagedKVCache(1, 2 * num_blocks, DECODE_BLOCK, NUM_KV_HEADS, HEAD_DIM, kv_dtype)
    g = torch.Generator().manual_seed(0)
    table = torch.randperm(2 * num_blocks, generator=g)[:num_blocks]  # scattered blocks
    k = torch.randn(DECODE_CONTEXT, NUM_KV_HEADS, HEAD_DIM, generator=g)
    cache.write(0, slot_tensor(table.tolist(), 0, DECODE_CONTEXT, DECODE_BLOCK), k, torch.randn_like(k))
    q = torch.randn(1, NUM_HEADS, HEAD_DIM, generator=g)
    tables, seq_lens = table.view(1, -1), torch.tensor([DECODE_CONTEXT])

    def gather(pool, scales):  # blocks -> contiguous fp32 [1, num_kv_heads, S, head_dim]
        x = pool[table].view(-1, NUM_KV_HEADS, HEAD_DIM).float()
        if scales is not None:
            x = x * scales[table].view(-1, NUM_KV_HEADS, 1)
        return x.transpose(0, 1).contiguous()[None]

    def gather_then_sdpa():
        kh, vh = gather(cache.k[0], cache.k_scale[0]), gather(cache.v[0], cache.v_scale[0])
        qr = hadamard_rotate(q) if cache.rotated else q  # int8 rows are stored Hadamard-rotated
        out = F.scaled_dot_product_attention(qr[:, :, None], kh, vh, enable_gqa=True)
        return hadamard_rotate(out) if cache.rotated else out

    fns = {"paged_decode": lambda: paged_decode_attention(q, cache, 0, tables, seq_lens),
           "gather_then_sdpa": gather_then_sdpa}
    diff = (fns["paged_decode"]().flatten() - gather_then_sdpa().flatten()).abs().max().item()
    times = {name: [] for name in fns}
    for _ in range(repeats):  # interleaved, so both see the same machine
        for name, fn in fns.items():
            t = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t)
    res = {f"{name}_us": 1e6 * statistics.median(ts) for name, ts in times.items()}
    res["max_abs_diff"] = diff
    return res


# ---- driver side -------------------------------------------------------------------------------
def _worker(*args) -> dict:
    cmd = [sys.executable, "-m", "edge_cli.bench.attention", *map(str, args)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise EdgeRuntimeError(f"attention bench worker {args} failed: {proc.stderr.strip()[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run_attention_bench(json_path: str | None, lengths=(1024, 4096, 16384), threads: int | None = None) -> dict:
    """Run the attention benchmark; print a table, write JSON to `json_path` if given.

    Returns the result dict; `results[N][kernel] = {"ms", "peak_mib", ...}` (JSON turns N into a string).
    """
    res = {"benchmark": "attention", "date": time.strftime("%Y-%m-%d %H:%M:%S"), "threads": threads,
           "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"), "loadavg_before": os.getloadavg(),
           "workload": {"num_heads": NUM_HEADS, "num_kv_heads": NUM_KV_HEADS, "head_dim": HEAD_DIM, "dtype": "fp32",
                        "causal": True, "lengths": list(lengths)},
           "results": {}}
    print(f"causal prefill, {NUM_HEADS} query / {NUM_KV_HEADS} KV heads, head_dim {HEAD_DIM}, fp32")
    print(f"{'N':>6} {'kernel':>6} {'ms':>10} {'peak MiB':>9}")
    for n in lengths:
        res["results"][n] = {}
        ab = _worker("ab", n, threads or 0, 3)
        for kernel in KERNELS:
            repeats = 0 if kernel != "naive" or n >= 16384 else 3
            r = res["results"][n][kernel] = _worker("prefill", kernel, n, threads or 0, repeats)
            if kernel in ab:
                r["runs_ms"], r["ms"] = ab[kernel], statistics.median(ab[kernel])
            print(f"{n:>6} {kernel:>6} {r['ms']:>10.1f} {r['peak_mib']:>9.1f}", flush=True)
    if lengths:
        res["threads"] = res["results"][lengths[0]]["tiled"]["threads"]
    big = res["results"].get(16384)
    res["mem_ratio_naive_over_tiled_16k"] = big and big["naive"]["peak_mib"] / max(big["tiled"]["peak_mib"], 1e-9)
    res["speed_ratio_tiled_over_sdpa_16k"] = big and big["sdpa"]["ms"] / big["tiled"]["ms"]
    res["decode"] = {}
    print(f"paged decode, 1 token over {DECODE_CONTEXT} tokens, block {DECODE_BLOCK}")
    for kv_dtype in ("fp16", "int8"):
        r = res["decode"][kv_dtype] = _worker("decode", kv_dtype, threads or 0, 50)
        r["paged_decode_speedup"] = r["gather_then_sdpa_us"] / r["paged_decode_us"]
        print(f"{kv_dtype:>6} paged {r['paged_decode_us']:8.0f} us   gather+sdpa {r['gather_then_sdpa_us']:8.0f} us"
              f"   speedup {r['paged_decode_speedup']:.2f}x")
    for key in ("paged_decode_us", "gather_then_sdpa_us", "paged_decode_speedup"):
        res[key] = {d: r[key] for d, r in res["decode"].items()}
    res["targets"] = TARGETS
    res["loadavg_after"] = os.getloadavg()
    if big:
        print(f"mem_ratio_naive_over_tiled_16k {res['mem_ratio_naive_over_tiled_16k']:.1f} (target >= 8)   "
              f"speed_ratio_tiled_over_sdpa_16k {res['speed_ratio_tiled_over_sdpa_16k']:.2f} (target >= 0.8)")
    if json_path:
        with open(json_path, "w") as f:
            json.dump(res, f, indent=2)
    return res


if __name__ == "__main__":
    args = sys.argv[1:]
    if args[:1] == ["prefill"]:
        print(json.dumps(measure_prefill(args[1], int(args[2]), int(args[3]) or None, int(args[4]))))
    elif args[:1] == ["ab"]:
        print(json.dumps(measure_ab(int(args[1]), int(args[2]) or None, int(args[3]))))
    elif args[:1] == ["decode"]:
        print(json.dumps(measure_decode(args[1], int(args[2]) or None, int(args[3]))))
    else:  # python -m edge_cli.bench.attention [JSON_FILE]
        run_attention_bench(args[0] if args else None)
