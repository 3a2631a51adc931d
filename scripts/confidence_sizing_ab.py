"""Chains sized by the attention head's confidence against the running estimate, in the engine, on MT-Bench.

For each of the first turns of the 80 MT-Bench questions (greedy, 128 tokens, one sequence, cold prefix cache),
back to back: plain decoding, then `--draft mtp-attn-ngram` and `--draft mtp-attn` each twice, with
`StepDrafter.size_by_confidence` on (the head drafts first and stops where the product of its drafts'
probabilities falls below `DraftPlanner.floor`; the planner keeps as many as pay by those probabilities) and off
(the planner sizes the chain from the running acceptance estimate, then the head drafts that many). Prints
decode speed over plain, tokens per verification (bonus included), and the head's work: drafts it made against
drafts carried into verification. Every drafted answer must equal the plain one.

    env -u OMP_WAIT_POLICY .venv/bin/python scripts/confidence_sizing_ab.py
"""
from __future__ import annotations

import time

from edge_cli.bench.spec import Tally, _run, mt_bench_prompts
from edge_runtime.backends.native import NativeBackend
from edge_runtime.engine.drafting import StepDrafter
from edge_runtime.spec.attn_drafter import AttnChain

ROWS = [("mtp-attn-ngram", True), ("mtp-attn-ngram", False), ("mtp-attn", True), ("mtp-attn", False)]


def main() -> None:
    native = NativeBackend(threads=2)
    made = [0]
    propose = AttnChain.propose

    def counted(self, history, k, hidden=None, floor=0.0):
        out = propose(self, history, k, hidden, floor)
        made[0] += len(out)
        return out
    AttnChain.propose = counted
    plain, tallies, heads = Tally(), {row: Tally() for row in ROWS}, dict.fromkeys(ROWS, 0)
    t0 = time.time()
    for q in mt_bench_prompts(80):
        _run(native, "none", None, q, 128, plain)
        for row in ROWS:
            StepDrafter.size_by_confidence = row[1]
            made[0] = 0
            _run(native, row[0], None, q, 128, tallies[row])
            heads[row] += made[0]
    StepDrafter.size_by_confidence = True
    base = plain.summary()["tok_s"]
    print(f"plain decoding: {base} tok/s ({time.time() - t0:.0f} s in all)")
    for (draft, conf), t in tallies.items():
        s = t.summary(plain)
        print(f"{draft:>15} {'confidence' if conf else 'running estimate':>16}: {s['tok_s'] / base:.3f}x plain, "
              f"{s['mean_accepted']:.3f} tokens per verification, {t.verify_steps} verifications, head drafts made "
              f"{heads[(draft, conf)]}, carried {t.proposed}, accepted {t.accepted}, identical {s['identical']}")


if __name__ == "__main__":
    main()
