"""Does a continuous batch whose rows sit at very different positions keep both threads busy?

The fused batch step (`FusedDecoder.step_batch`) splits its attention units (part, query head) between the
threads by cost (kernels/cpu_decode.c: unit_split): a row's attention reads every key before it, so a batch
whose long rows all fall in one thread's half of the rows would leave the other waiting at the barrier. This
times, round-robin in one process (medians of 25 rounds), 16 rows of 16 sequences with the same positions in
three orders: the 8 long rows first ("skewed", the worst order for a split by count), long and short
alternating ("interleaved", the best), and all at the mean position ("same"); and all short, all long.
skewed / interleaved near 1.0 says the split follows the cost. Prints its figures and writes them, with the
machine, to the JSON file named as its argument.

    OMP_WAIT_POLICY=PASSIVE .venv/bin/python scripts/batch_balance.py bench-results/logs/batch-balance.json
"""
from __future__ import annotations

import sys

import torch

from edge_cli.bench.steps import _interleaved_median_ms
from edge_runtime.backends import create_backend
from edge_runtime.model.path import default_model_path
from kernels import cpu_gemv

ROWS, SHORT, LONG, SPAN = 16, 150, 850, 64  # SPAN blocks of 16 positions: room for LONG + 1 per sequence


def main() -> None:
    model = create_backend("native", model=default_model_path(), threads=2).model
    model.allocate_cache(SPAN * 16, num_blocks=ROWS * SPAN, block_size=16, kv_dtype="fp16")
    model.enable_fused(cpu_gemv.library())
    tables = [list(range(s * SPAN, (s + 1) * SPAN)) for s in range(ROWS)]
    orders = {"skewed": [LONG] * 8 + [SHORT] * 8, "interleaved": [LONG, SHORT] * 8, "same": [(LONG + SHORT) // 2] * 16,
              "short": [SHORT] * 16, "long": [LONG] * 16}
    tokens = list(range(100, 100 + ROWS))
    with torch.inference_mode():  # the keys' values do not change the work: the cache is left as allocated
        ms = _interleaved_median_ms({k: (lambda p=p: model.fused.step_batch(tokens, p, tables))
                                     for k, p in orders.items()}, repeats=25)
    print(f"{ROWS} rows, positions {SHORT} and {LONG}: " + ", ".join(f"{k} {v:.2f} ms" for k, v in ms.items()))
    print(f"skewed / interleaved: {ms['skewed'] / ms['interleaved']:.3f}")
    if len(sys.argv) > 1:
        from edge_cli.bench.decode import print_and_save

        print_and_save({"benchmark": "batch-balance", "threads": 2, "rows": ROWS, "positions": [SHORT, LONG],
                        "step_ms": ms, "skewed_over_interleaved": ms["skewed"] / ms["interleaved"]}, sys.argv[1])


if __name__ == "__main__":
    main()
