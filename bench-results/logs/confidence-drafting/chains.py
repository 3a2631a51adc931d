"""The shipped MTP heads' chains (4 drafts, each with the heads' top probability over the draft vocabulary) and
prompt lookup's offer at every position of the model's greedy answers to MT-Bench's 80 first turns (128 tokens);
saved for policies.py. Run from the repo root: .venv/bin/python bench-results/logs/confidence-drafting/chains.py"""
import json, sys, numpy as np, torch
from edge_cli.bench.spec import mt_bench_prompts
from edge_cli.mtp_data import _prompt
from edge_cli.train_attn import MT_BENCH_TOKENS, mt_bench_records
from edge_runtime.backends.native import NativeBackend
from edge_runtime.spec.mtp import MtpDrafter
from edge_runtime.spec.speculative import NgramProposer
torch.set_num_threads(2)
backend = NativeBackend(model="default", threads=2, n_ctx=1024, kv_budget="1GiB")
drafter = MtpDrafter.for_backend(backend)
records = mt_bench_records(backend, 80, MT_BENCH_TOKENS, ".cache/mtp-mt-bench.pt")
prompts = [_prompt(backend, [{"role": "user", "content": q}], MT_BENCH_TOKENS) for q in mt_bench_prompts(80)]
D = 4
data = []  # per record: list of (lookup drafts, head drafts, head probs)
with torch.inference_mode():
    for r, ids in zip(records, prompts):
        toks, hidden = r["tokens"].tolist(), r["hidden"]
        rec = []
        for i in range(len(toks) - 1):
            lk = NgramProposer(min_n=2).propose(ids + toks[:i + 1], D)
            h = drafter.first_state(hidden[i]); tok = toks[i]; hd, ps = [], []
            for _ in range(D):
                h, logits = drafter.head_step(h, [tok])
                l = logits[0].numpy().astype(np.float64); j = int(l.argmax())
                p = 1.0 / np.exp(l - l[j]).sum()
                tok = drafter.vocab[j]; hd.append(tok); ps.append(float(p))
            rec.append((list(lk or []), hd, ps))
        data.append((toks, rec))
torch.save(data, ".cache/confidence-chains.pt")
print("saved", sum(len(t) for t, _ in data))
