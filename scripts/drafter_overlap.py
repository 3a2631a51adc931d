"""Where each drafter's accepted drafts come from on MT-Bench, position by position (a reading, not a walk).

At every position of the model's greedy answers to the first turns of the 80 MT-Bench questions (128 tokens,
the `train-mtp` cache .cache/mtp-mt-bench.pt), each drafter proposes up to k = 3 tokens after the position and
the drafts equal to the answer's next tokens are counted: prompt lookup (`mtp-ngram`'s, two tokens or more
matched), the shipped MLP heads and the shipped attention head (its chain fed every token, as the engine feeds
it). The table splits the positions by whether lookup has a match: what the attention head gains over the MLP
heads where lookup already drafts does not reach `mtp-attn-ngram`. Every position counts, including those a
verification walk would skip (mtp_eval.walk gives the walk's figures).

    .venv/bin/python scripts/drafter_overlap.py
"""
from __future__ import annotations

import torch

from edge_cli.bench.spec import mt_bench_prompts
from edge_cli.mtp_data import _prompt
from edge_cli.train_attn import mt_bench_records
from edge_runtime.backends import create_backend
from edge_runtime.model.path import default_model_path
from edge_runtime.spec.attn_drafter import AttnDrafter
from edge_runtime.spec.mtp import MtpDrafter
from edge_runtime.spec.speculative import LookupThenHeads, NgramProposer

K = 3


def accepted(drafts: list[int], answer: list[int]) -> int:
    return next((j for j, (d, t) in enumerate(zip(drafts, answer)) if d != t), min(len(drafts), len(answer)))


def main() -> None:
    backend = create_backend("native", default_model_path(), n_ctx=2048)
    mlp, attn = MtpDrafter.for_backend(backend), AttnDrafter.for_backend(backend)
    records = mt_bench_records(backend, n=80, max_tokens=128, path=".cache/mtp-mt-bench.pt")
    prompts = [_prompt(backend, [{"role": "user", "content": q}], 128) for q in mt_bench_prompts(80)]
    rows = []  # (lookup's drafts accepted or None where it has no match, the MLP heads', the attention head's)
    for r, ids in zip(records, prompts):
        tokens, hidden, chain = r["tokens"].tolist(), r["hidden"], attn.new_chain()
        lookup = NgramProposer(min_n=LookupThenHeads.LOOKUP_MIN_N)
        for i in range(len(tokens) - 1):
            chain.feed(hidden[i], tokens[i])
            m, nxt = min(K, len(tokens) - 1 - i), tokens[i + 1:]
            offer = lookup.propose(ids + tokens[:i + 1], m)
            heads = mlp.propose_from(hidden[i], tokens[i], m)[:m]
            rows.append((accepted(offer[:m], nxt) if offer else None, accepted(heads, nxt),
                         accepted(chain.propose(tokens[:i + 1], m)[:m], nxt)))
    mean = lambda xs: sum(xs) / len(xs) if xs else float("nan")  # noqa: E731
    hit = [x for x in rows if x[0] is not None]
    miss = [x for x in rows if x[0] is None]
    print(f"{len(rows)} positions, k = {K}; prompt lookup matches at {len(hit)} ({len(hit) / len(rows):.1%})")
    print("drafts accepted per position     lookup  MLP heads  attention  max(lookup, attention)")
    print(f"  where lookup matches          {mean([x[0] for x in hit]):6.3f}  {mean([x[1] for x in hit]):9.3f}  "
          f"{mean([x[2] for x in hit]):9.3f}  {mean([max(x[0], x[2]) for x in hit]):6.3f}")
    for name, part in (("where it does not", miss), ("everywhere", rows)):
        print(f"  {name:<28}      -  {mean([x[1] for x in part]):9.3f}  {mean([x[2] for x in part]):9.3f}")
    for name, part in (("matches", hit), ("no match", miss)):
        print(f"  {name}: attention > MLP at {sum(x[2] > x[1] for x in part)} positions, MLP > attention at "
              f"{sum(x[1] > x[2] for x in part)}")


if __name__ == "__main__":
    with torch.inference_mode():
        main()
