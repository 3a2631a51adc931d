"""What the attention head costs a sequence per call in the engine: the rows absorbed into its keys, the drafts
of its chain (the C call's own timers), and the rest of the call's wall time (`AttnDrafter._c_chains`), over the
first 12 MT-Bench turns with `--draft mtp-attn-ngram` (one sequence, greedy, 128 tokens); then the same call
timed alone, one row and one draft at a time, 300 times (medians), to show how much of the rest is the Python
and ctypes around the C call; then 2, 4 and 8 sequences' chains (a row fed, 2 drafts each) drafted one call each
against one call for all (`draft_many`, what the engine does), medians of 200. In a full batch every drafting
sequence's row and chain are paid each step, against the extra row its draft adds to the step.

    env -u OMP_WAIT_POLICY .venv/bin/python scripts/attn_head_cost.py
"""
from __future__ import annotations

import statistics
import time

import torch

from edge_cli.bench.spec import Tally, _run, mt_bench_prompts
from edge_runtime.backends.native import NativeBackend
from edge_runtime.spec.attn_drafter import AttnDrafter


def main() -> None:
    native = NativeBackend(threads=2)
    acc = dict.fromkeys(("calls", "rows", "drafts", "absorb", "chain", "wall"), 0.0)
    step = AttnDrafter._c_chains

    def timed(self, jobs, floor=0.0):
        t0 = time.perf_counter()
        out = step(self, jobs, floor)
        acc["wall"] += time.perf_counter() - t0
        acc["calls"] += 1
        acc["rows"] += sum(len(rows) for _, rows, _ in jobs)
        acc["drafts"] += sum(len(drafts) for drafts, _ in out)
        acc["absorb"] += self.seconds[0]  # the C call's own split: rows into the keys, then the chain's steps
        acc["chain"] += self.seconds[1]
        return out
    AttnDrafter._c_chains = timed
    tally = Tally()
    for q in mt_bench_prompts(12):
        _run(native, "mtp-attn-ngram", None, q, 128, tally)
    n = acc["calls"]
    print(f"{n:.0f} calls: {acc['rows'] / n:.2f} rows absorbed and {acc['drafts'] / n:.2f} drafts a call; "
          f"{acc['wall'] / n * 1e3:.3f} ms a call in all, of which absorbing {acc['absorb'] / n * 1e3:.3f} ms "
          f"({acc['absorb'] / acc['rows'] * 1e3:.3f} ms a row), the chain {acc['chain'] / n * 1e3:.3f} ms "
          f"({acc['chain'] / acc['drafts'] * 1e3:.3f} ms a draft), the rest of the wall time "
          f"{(acc['wall'] - acc['absorb'] - acc['chain']) / n * 1e3:.3f} ms")
    AttnDrafter._c_chains = step
    drafter = native._attn_drafter
    hidden = torch.randn(drafter.dim * (1 + len(drafter.taps)))
    chain, walls, timers = drafter.new_chain(), [], []
    for i in range(300):
        t0 = time.perf_counter()
        drafter._c_step(chain, [(hidden, 200 + i)], 1)
        walls.append(time.perf_counter() - t0)
        timers.append(sum(drafter.seconds[:2]))
    wall, timed_c = statistics.median(walls) * 1e3, statistics.median(timers) * 1e3
    print(f"alone: {wall:.3f} ms a call (median), the C call's timers {timed_c:.3f} ms, so {wall - timed_c:.3f} ms "
          "of Python and ctypes around it")
    for batch in (2, 4, 8):  # a full step's chains: one call each against one call for all (medians of 200)
        chains, each, together = [drafter.new_chain() for _ in range(2 * batch)], [], []
        for i in range(200):
            for j, chain in enumerate(chains):
                chain.feed(hidden, 200 + (i + j) % 50)
            t0 = time.perf_counter()
            for chain in chains[:batch]:
                drafter.draft(chain, 2)
            t1 = time.perf_counter()
            drafter.draft_many(chains[batch:], [2] * batch)
            each.append(t1 - t0)
            together.append(time.perf_counter() - t1)
        one, many = statistics.median(each) * 1e3, statistics.median(together) * 1e3
        print(f"{batch} sequences, a row fed and 2 drafts each: one call each {one:.3f} ms, one call for all "
              f"{many:.3f} ms ({one / many:.2f}x)")


if __name__ == "__main__":
    main()
