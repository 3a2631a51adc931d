"""Probe: the fused decode path's cost for a verification of R rows (one sequence), at a ~200-token context."""
import statistics, sys, time
import torch
from edge_runtime.backends.native import NativeBackend

threads = int(sys.argv[1]) if len(sys.argv) > 1 else 2
b = NativeBackend(threads=threads, n_ctx=1024)
r = b.runner
ids = r.tokenize("Explain how a refrigerator keeps food cold, step by step, for a curious ten-year-old. " * 8)[:200]
r.prefill(ids)
n0 = len(r.cached_ids)
base = None
for R in (1, 2, 3, 4, 6, 8, 12, 16):
    toks = ids[10:10 + R]
    times = []
    for _ in range(40):
        t = time.perf_counter(); r.verify(toks); times.append(time.perf_counter() - t); r.keep(n0)
    m = statistics.median(times[5:]) * 1e3
    base = base or m
    print(f"threads {threads} R={R:2d}: {m:6.2f} ms  ({m / base:4.2f} x one row; extra row {(m - base) / max(R - 1, 1) / base:4.2f} step)", flush=True)
