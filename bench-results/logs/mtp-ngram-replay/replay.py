"""Prompt lookup with the shipped MTP heads, replayed over the model's greedy answers to MT-Bench's 80 first
turns (128 tokens) at k = 3: which source drafts when, and by category. Run from the repo root:
    .venv/bin/python bench-results/logs/mtp-ngram-replay/replay.py
(writes RESULT lines; the MT-Bench answers are cached in .cache/mtp-mt-bench.pt)."""
import json

import torch

from edge_cli.bench.spec import MT_BENCH, mt_bench_prompts
from edge_cli.mtp_data import _prompt
from edge_cli.mtp_eval import drafter_walk, lookup_walk, summary, walk
from edge_cli.train_attn import MT_BENCH_TOKENS, mt_bench_records
from edge_runtime.backends.native import NativeBackend
from edge_runtime.spec import speculative
from edge_runtime.spec.mtp import MtpDrafter
from edge_runtime.spec.speculative import LookupThenHeads, NgramProposer

torch.set_num_threads(2)
backend = NativeBackend(model="default", threads=2, n_ctx=1024, kv_budget="1GiB")
drafter = MtpDrafter.for_backend(backend)  # first: the records then carry the layers its heads read
records = mt_bench_records(backend, 80, MT_BENCH_TOKENS, ".cache/mtp-mt-bench.pt")
prompts = [_prompt(backend, [{"role": "user", "content": q}], MT_BENCH_TOKENS) for q in mt_bench_prompts(80)]
with open(MT_BENCH, encoding="utf-8") as f:
    cats = [json.loads(line)["category"] for line in f if line.strip()][:80]


def say(name, s):
    print("RESULT", name, json.dumps({"mean_accepted": round(s["mean_accepted"], 3), "verify_steps": s["verify_steps"],
                                      "acceptance_per_position": [round(a, 3) for a in s["acceptance_per_position"]]}),
          flush=True)


def lookup_only(min_n):
    walks = []
    for r, ids in zip(records, prompts):
        p, toks = NgramProposer(min_n=min_n), r["tokens"].tolist()
        walks.append(walk(toks, lambda i, m: p.propose(ids + toks[:i + 1], m), 3, MT_BENCH_TOKENS))
    return summary(walks)


say("heads alone", drafter_walk(drafter, records, 3, MT_BENCH_TOKENS))
say("lookup alone (from a 1-token match)", lookup_only(1))
say("lookup alone (from a 2-token match)", lookup_only(2))
for n in (1, 2, 3):
    LookupThenHeads.LOOKUP_MIN_N = n
    say(f"lookup from a {n}-token match, else heads", lookup_walk(drafter, records, prompts, 3, MT_BENCH_TOKENS))
LookupThenHeads.LOOKUP_MIN_N = 2
for k in (4, 5):
    say(f"lookup from a 2-token match, else heads, k = {k}", lookup_walk(drafter, records, prompts, k, MT_BENCH_TOKENS))
for c in dict.fromkeys(cats):
    sel = [j for j, cc in enumerate(cats) if cc == c]
    rs, ps = [records[j] for j in sel], [prompts[j] for j in sel]
    say(f"{c}: heads alone", drafter_walk(drafter, rs, 3, MT_BENCH_TOKENS))
    say(f"{c}: lookup from a 2-token match, else heads", lookup_walk(drafter, rs, ps, 3, MT_BENCH_TOKENS))
assert speculative.LookupThenHeads.LOOKUP_MIN_N == 2
