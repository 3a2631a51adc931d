"""What prompt lookup can reach at best on `bench spec`'s workloads, under this machine's measured row costs.

The cost model behind `ngram.speedup_over_plain_grounded` (target 2.0): a verification of R rows of one
sequence costs t(R), measured here on the fused C step (`step_chunk`, medians timed round-robin), and a step
of k drafts of which a are accepted yields a + 1 tokens. Over the model's greedy answers (128 tokens, the
12 grounded prompts and the first turns of the 80 MT-Bench questions, generated here) it replays:

- `planner`: what the engine does with `--draft ngram` (NgramProposer's longest, most recent match; one running
  acceptance per answer; k maximizing expected tokens per second; a probe row after 16 idle steps);
- `foresight`: the same proposals, each cut to exactly its correct prefix (no draft is ever rejected);
- `best copy`: every earlier occurrence of the last 1-3 tokens considered, the longest correct continuation
  (up to 7) taken: no lookup drafter, however it picks among matches or sizes its chains, beats it;
- each also with free rows (t(R) = t(1)): tokens per step, what the workload itself allows.

Speedup = tokens x t(1) / sum of t(k + 1), the step cost alone (drafting and Python are left out: they only
lower it). Writes its table to stdout.

    OMP_WAIT_POLICY=PASSIVE .venv/bin/python scripts/lookup_bound.py
"""
from __future__ import annotations

import torch

from edge_cli.bench.spec import grounded_prompts, mt_bench_prompts
from edge_cli.bench.steps import _interleaved_median_ms
from edge_cli.mtp_data import _prompt
from edge_runtime.backends import create_backend
from edge_runtime.model.path import default_model_path
from edge_runtime.request import GenerationRequest, SamplingParams
from edge_runtime.spec.draft_planner import Acceptance, DraftPlanner
from edge_runtime.spec.speculative import NgramProposer
from kernels import cpu_gemv

K_MAX, ROWS, TOKENS = 7, 8, 128


def row_costs(backend, ids: list[int], context: int = 128) -> dict[int, float]:
    """t(R) / t(1) for R = 1..ROWS consecutive rows of one sequence at a `context`-token position."""
    model = backend.model
    blocks = -(-(context + ROWS) // 16)
    model.allocate_cache(context + ROWS, num_blocks=blocks, block_size=16, kv_dtype=model.kv.kv_dtype)
    model.enable_fused(cpu_gemv.library())
    table = list(range(blocks))
    with torch.inference_mode():
        model(torch.tensor(ids[:context]), 0, block_table=table)
        nxt = ids[context:context + ROWS]
        ms = _interleaved_median_ms({r: (lambda r=r: model.fused.step_chunk(nxt[:r], context, table))
                                     for r in range(1, ROWS + 1)}, repeats=15)
    return {r: ms[r] / ms[1] for r in ms}


def correct(drafts: list[int], truth: list[int]) -> int:
    return next((j for j, (d, t) in enumerate(zip(drafts, truth)) if d != t), min(len(drafts), len(truth)))


def best_copy(history: list[int], truth: list[int], max_n: int = 3) -> int:
    best = 0
    for n in range(1, max_n + 1):
        tail = history[-n:]
        for s in range(len(history) - n):
            if history[s:s + n] == tail:
                best = max(best, correct(history[s + n:s + n + K_MAX], truth[:K_MAX]))
    return best


def replay(records: list[tuple[list[int], list[int]]], cost: dict[int, float], policy: str) -> tuple[float, float]:
    """(speedup under `cost`, tokens per step) of one policy over (prompt, answer) records."""
    tokens = seconds = steps = 0.0
    for prompt, answer in records:
        lookup, est, i = NgramProposer(), Acceptance(), 1
        planner = DraftPlanner(ROWS, k_max=K_MAX)
        planner.cost.seconds = dict(cost)
        while i < len(answer):
            history, truth = prompt + answer[:i], answer[i:i + K_MAX]
            if policy == "best copy":
                k = a = best_copy(history, truth)
            else:
                offer = lookup.propose(history, K_MAX)
                good = correct(offer, truth)
                k = good if policy == "foresight" else planner.plan([est], [len(offer)])[0] if offer else 0
                a = min(k, good)
                if policy == "planner" and k:
                    est.observe(k, a)
            tokens += min(a + 1, len(answer) - i)
            seconds += cost[k + 1]
            steps += 1
            i += a + 1
    return tokens / seconds, tokens / steps


def main() -> None:
    backend = create_backend("native", default_model_path(), n_ctx=2048)
    backend.set_draft("none")  # the answers: plain greedy decoding (any drafter gives the same tokens)
    workloads = {"grounded (12)": grounded_prompts(12), "MT-Bench (80)": mt_bench_prompts(80)}
    records = {}
    for name, prompts in workloads.items():
        records[name] = []
        for text in prompts:
            messages = [{"role": "user", "content": text}]
            res = backend.generate(GenerationRequest(messages=messages,
                                                     params=SamplingParams(temperature=0.0, max_tokens=TOKENS)))
            records[name].append((_prompt(backend, messages, TOKENS), list(res.token_ids)))
    prompt, answer = records["grounded (12)"][0]
    cost = row_costs(backend, prompt + answer)
    print("t(R)/t(1), R = 1..8, one sequence:", " ".join(f"{cost[r]:.2f}" for r in sorted(cost)))
    free = {r: 1.0 for r in cost}
    print("| workload | drafter | speedup (measured t(R)) | tokens per step (free rows) |")
    print("|---|---|---|---|")
    for name, recs in records.items():
        for policy in ("planner", "foresight", "best copy"):
            speed, _ = replay(recs, cost, policy)
            _, per_step = replay(recs, free, policy)
            print(f"| {name} | {policy} | {speed:.3f} | {per_step:.3f} |")


if __name__ == "__main__":
    main()
