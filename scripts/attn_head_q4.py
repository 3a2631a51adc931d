"""The attention head's matrices as 4-bit blocks (Q4_0, Q4_1) against the 8-bit ones (Q8_0) it drafts with: what
each keeps of the drafts accepted and what a draft call costs. At every position of the model's greedy answers
to the first turns of the 80 MT-Bench questions (128 tokens, cached in .cache/mtp-mt-bench.pt), the chain is fed
the position's row and drafts k = 3 (as the engine feeds and asks it, one sequence); the drafts equal to the
answer's next tokens are counted (every position, not a verification walk), and each call (the row absorbed,
then the chain) is timed: its median and the C call's own split. A draft call reads each of the head's
matrices once a step, so its cost follows their bytes: Q4_0 is 18 bytes a 32-weight block against Q8_0's 34.

    env -u OMP_WAIT_POLICY .venv/bin/python scripts/attn_head_q4.py
"""
from __future__ import annotations

import statistics
import time

import torch

from edge_cli.train_attn import mt_bench_records
from edge_runtime.backends import create_backend
from edge_runtime.model.path import default_model_path
from edge_runtime.spec.attn_drafter import AttnDrafter
from edge_runtime.spec.attn_head import FORMAT, AttnDraftHead
from edge_runtime.spec.mtp import find_heads

K = 3


def accepted(drafts: list[int], answer: list[int]) -> int:
    return next((j for j, (d, t) in enumerate(zip(drafts, answer)) if d != t), min(len(drafts), len(answer)))


def main() -> None:
    backend = create_backend("native", default_model_path(), n_ctx=2048)
    head, _ = AttnDraftHead.load(find_heads(backend, FORMAT))
    backend.model.taps = head.taps
    records = mt_bench_records(backend, n=80, max_tokens=128, path=".cache/mtp-mt-bench.pt")
    drafters = {q: AttnDrafter(head, backend.model.embedding, qtype=q) for q in ("q8_0", "q4_0", "q4_1")}
    got = {q: [] for q in drafters}
    walls, rows_s, chain_s = ({q: [] for q in drafters} for _ in range(3))
    same = {q: 0 for q in drafters}
    for r in records:
        tokens, hidden = r["tokens"].tolist(), r["hidden"]
        chains = {q: d.new_chain() for q, d in drafters.items()}
        for i in range(len(tokens) - 1):
            m, nxt = min(K, len(tokens) - 1 - i), tokens[i + 1:]
            out = {}
            for q, d in drafters.items():  # in turns, position by position: the same machine state for each
                chains[q].feed(hidden[i], tokens[i])
                t0 = time.perf_counter()
                out[q] = d.draft_many([chains[q]], [m])[0]
                walls[q].append(time.perf_counter() - t0)
                rows_s[q].append(d.seconds[0])
                chain_s[q].append(d.seconds[1])
                got[q].append(accepted(out[q], nxt))
            for q in drafters:
                same[q] += out[q] == out["q8_0"]
    n = len(got["q8_0"])
    med = lambda xs: statistics.median(xs) * 1e3  # noqa: E731
    print(f"{n} positions of 80 MT-Bench answers, k = {K}, one row fed a call")
    print("matrices  drafts accepted a position  same drafts as Q8_0  call (median ms)  rows part  chain part")
    for q in drafters:
        print(f"{q:8s}  {sum(got[q]) / n:26.3f}  {same[q] / n:18.1%}  {med(walls[q]):16.3f}  {med(rows_s[q]):9.3f}  "
              f"{med(chain_s[q]):10.3f}")


if __name__ == "__main__":
    with torch.inference_mode():
        main()
