"""How well the draft length is chosen on MT-Bench, replayed offline: the running estimate against the head's confidence.

At every position of the model's greedy answers to the first turns of the 80 MT-Bench questions (128 tokens, the
`train-mtp` cache .cache/mtp-mt-bench.pt), this reads what `mtp-attn-ngram` could draft there: prompt lookup's
span (up to 7 tokens, where the context's last two tokens or more occurred before; the longest match found, up to
8) and the shipped attention head's chain of 4 with the probability of each draft under the head (its softmax
over the draft vocabulary, one tree level a step: the same drafts as the chain). It then walks each answer as a
verification loop does and prices each cycle with a cost model of this machine's engine (`T1`, `ROW`, `PY`,
`HEAD` below, from the step profile in docs/speculative.md), under several rules for k:

- `running`: the planner's rule (draft_planner.Acceptance: one running per-draft acceptance per source and
  answer, k maximizing expected tokens per second, a probe after 16 idle cycles);
- `by match length`: the same with lookup's estimate kept per longest-match class (2, 3, 4-7, 8+);
- `confidence`: the head's chain sized by its own draft probabilities (expected tokens 1 + p1 + p1 p2 + ...,
  the head drafting one step past the k it keeps, as a C loop that stops at a threshold would); lookup as
  `running`;
- `oracle`: each cycle's k is the number of drafts its source (lookup where it matches, else the head)
  would have accepted, where drafting them pays.

It also prints the head's calibration: by draft probability bin, how often the draft was accepted given the
drafts before it were. A replay of the cost model, not a benchmark: `bench spec` measures the engine.

    OMP_NUM_THREADS=1 .venv/bin/python scripts/draft_length_replay.py
"""
from __future__ import annotations

import math

import torch
from drafter_overlap import accepted  # scripts/: the drafts an answer accepts

from edge_cli.bench.spec import mt_bench_prompts
from edge_cli.mtp_data import _prompt
from edge_cli.train_attn import mt_bench_records
from edge_runtime.backends import create_backend
from edge_runtime.model.path import default_model_path
from edge_runtime.spec.attn_drafter import AttnDrafter
from edge_runtime.spec.draft_planner import Acceptance
from edge_runtime.spec.speculative import NgramProposer

T1, ROW, PY, HEAD = 2.96, 0.38, 0.18, 0.15  # ms: a one-row step, each row more, Python per cycle, a head step
LOOKUP_K, HEAD_K, IDLE = 7, 4, 16
BINS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.01)


def step_ms(rows: int) -> float:
    return T1 + ROW * (rows - 1) + (PY if rows > 1 else 0.0)


def collect() -> list[list[tuple]]:
    """Per answer, per position: (longest lookup match, lookup drafts accepted, head drafts accepted, probs)."""
    backend = create_backend("native", default_model_path(), n_ctx=2048)
    attn = AttnDrafter.for_backend(backend)
    records = mt_bench_records(backend, n=80, max_tokens=128, path=".cache/mtp-mt-bench.pt")
    prompts = [_prompt(backend, [{"role": "user", "content": q}], 128) for q in mt_bench_prompts(80)]
    out = []
    for r, ids in zip(records, prompts):
        tokens, hidden, chain, rows = r["tokens"].tolist(), r["hidden"], attn.new_chain(), []
        lookups = {n: NgramProposer(max_n=n, min_n=n) for n in range(2, 9)}
        for i in range(len(tokens) - 1):
            chain.feed(hidden[i], tokens[i])
            nxt, ctx = tokens[i + 1:], ids + tokens[:i + 1]
            offers = {n: p.propose(ctx, LOOKUP_K) for n, p in lookups.items()}
            longest = max((n for n, o in offers.items() if o), default=0)
            state, tok, drafts, probs = chain.first_state(), [tokens[i]], [], []
            for _ in range(HEAD_K):
                state, logits = chain.head_step(state, tok)
                p = torch.softmax(logits[0].float(), -1)
                j = int(p.argmax())
                drafts.append(attn.vocab[j])
                probs.append(float(p[j]))
                tok = drafts[-1:]
            # mtp-attn-ngram's lookup matches 2 or 3 tokens (LookupThenHeads: max_n 3)
            lk = accepted(offers[min(3, longest)], nxt) if longest else 0
            rows.append((longest, lk, accepted(drafts, nxt), probs))
        out.append(rows)
    return out


def calibration(data) -> list[list[tuple[int, float]]]:
    """Per draft position and probability bin: (drafts reached there, share accepted)."""
    seen = [[0] * len(BINS) for _ in range(HEAD_K)]
    took = [[0] * len(BINS) for _ in range(HEAD_K)]
    for rows in data:
        for _, _, h, probs in rows:
            for s in range(min(h + 1, HEAD_K)):
                b = next(j for j, hi in enumerate(BINS) if probs[s] < hi)
                seen[s][b] += 1
                took[s][b] += h > s
    return [[(n, a / n if n else float("nan")) for n, a in zip(seen[s], took[s])] for s in range(HEAD_K)]


def match_class(n: int) -> int:
    return n if n < 4 else (4 if n < 8 else 8)


def replay(data, rule: str) -> float:
    """Decode speed over plain decoding for one rule (tokens per ms over 1 / T1)."""
    tokens = ms = 0.0
    for rows in data:
        est, i = {}, 0
        while i < len(rows):
            n, lk, h, probs = rows[i]
            lookup, left = n >= 2, len(rows) - i - 1
            kmax = min(left, LOOKUP_K if lookup else HEAD_K)
            if rule == "oracle":
                a = min(kmax, lk if lookup else h)
                cost = step_ms(a + 1) + (0.0 if lookup or not a else HEAD * a)
                if a and (a + 1) / cost < 1 / T1:
                    a, cost = 0, T1
                tokens, ms, i = tokens + a + 1, ms + (cost if a else T1), i + a + 1
                continue
            key = ("L", match_class(n) if rule == "by match length" else 0) if lookup else ("H",)
            acc = est.setdefault(key, Acceptance())
            best, k, cost = 1 / T1, 0, T1
            for j in range(1, kmax + 1):
                if lookup or rule != "confidence":
                    gain, c = acc.expected_tokens(j), step_ms(j + 1) + (0.0 if lookup else HEAD * j)
                else:
                    gain = 1.0 + sum(math.prod(probs[:m]) for m in range(1, j + 1))
                    c = step_ms(j + 1) + HEAD * min(j + 1, HEAD_K)
                if gain / c > best:
                    best, k, cost = gain / c, j, c
            if rule == "confidence" and not lookup and k == 0:
                cost = T1 + HEAD  # the one head step that said no
            elif k == 0 and (rule != "confidence" or lookup):
                acc.idle += 1
                if acc.idle >= IDLE and kmax:
                    k, cost = 1, step_ms(2) + (0.0 if lookup else HEAD)
            if k:
                acc.idle = 0
            a = min(k, lk if lookup else h)
            acc.observe(k, a)
            tokens, ms, i = tokens + a + 1, ms + cost, i + a + 1
    return tokens / ms * T1


def main() -> None:
    data = collect()
    positions = sum(map(len, data))
    print(f"{positions} positions of 80 MT-Bench answers; cost model: one-row step {T1} ms, +{ROW} ms a row, "
          f"{PY} ms Python a cycle, {HEAD} ms a head step")
    print("the attention head's calibration: accepted share (drafts) by its draft probability, position by position")
    lo = (0.0,) + BINS[:-1]
    print("  p in   " + " ".join(f"{a:.2f}-{min(b, 1.0):.2f}" for a, b in zip(lo, BINS)))
    for s, row in enumerate(calibration(data)):
        print(f"  pos {s + 1}  " + " ".join(f"{x:.2f}({n})".ljust(9) for n, x in row))
    classes: dict[int, list] = {}
    for rows in data:
        for n, lk, h, _ in rows:
            c = classes.setdefault(match_class(n) if n >= 2 else 0, [0, 0, 0])
            c[0], c[1], c[2] = c[0] + 1, c[1] + min(lk, 3), c[2] + min(h, 3)
    print("drafts accepted at k = 3 by lookup's longest match (0: none; 4: 4-7; 8: 8 or more): positions, lookup, head")
    for n, (m, lk, h) in sorted(classes.items()):
        print(f"  {n}: {m:5d}  {lk / m:.3f}  {h / m:.3f}")
    for rule in ("running", "by match length", "confidence", "oracle"):
        print(f"{rule:>16}: {replay(data, rule):.3f}x plain decoding")


if __name__ == "__main__":
    main()
