"""Does the attention head's draft vocabulary hold it back? Its readout widened without retraining, replayed.

The head drafts from the `draft_vocab` (4,096) tokens most frequent in its training answers, read out through
the model's tied embedding rows; on MT-Bench's greedy answers the shipped head's cover 87.6 % of the tokens.
Since the readout is the embedding itself, it can take more rows without retraining: the next most frequent
answer tokens (ranked over the `train-mtp --prompt-set written --prompts 10200 --taps 20,26` shards, which must be on
disk) up to each size, and the whole vocabulary. For each, the MT-Bench answers are replayed at k = 3 as
`edge_cli/mtp_eval.attention_walk` does, on the shipped head, fp32.

    .venv/bin/python scripts/draft_vocab_readout.py [~/.cache/edge-runtime/mtp-written-10200-taps20-26]
"""
from __future__ import annotations

import collections
import os
import sys

import torch

from edge_cli.mtp_eval import summary, walk
from edge_cli.train_attn import batch_of, mt_bench_records
from edge_cli.train_mtp import embedding_table
from edge_runtime.backends import create_backend
from edge_runtime.model.path import default_model_path
from edge_runtime.spec.attn_head import FORMAT, AttnDraftHead
from edge_runtime.spec.mtp import find_heads

K, SIZES = 3, (4096, 6144, 8192, 12288, 16384)


def main(folder: str) -> None:
    backend = create_backend("native", default_model_path(), n_ctx=2048)
    emb = embedding_table(backend)
    head, _ = AttnDraftHead.load(find_heads(backend, FORMAT))
    backend.model.taps = head.taps
    records = mt_bench_records(backend, n=80, max_tokens=128, path=".cache/mtp-mt-bench.pt")
    counts = collections.Counter()
    for r in torch.load(os.path.join(folder, "flat.pt"), weights_only=False, mmap=True)["records"]:
        counts.update(r["tokens"].tolist())
    base = head.vocab.tolist()
    more = [t for t, _ in counts.most_common() if t not in set(base)]
    greedy = [t for r in records for t in r["greedy"].tolist()]
    print(f"the head's {len(base)} draft tokens cover {sum(t in set(base) for t in greedy) / len(greedy):.1%} of "
          "MT-Bench's greedy answer tokens")
    outs = []
    with torch.no_grad():
        for s in range(0, len(records), 32):
            part = records[s:s + 32]
            h, e, valid, _ = batch_of(part, emb, torch.arange(len(emb)), K)
            outs.append((part, head.chain(h, e, valid, K)))
        for size in (*SIZES, len(emb)):
            vocab = torch.tensor(base + more[:size - len(base)] if size < len(emb) else list(range(len(emb))))
            rows, walks = emb[vocab], []
            for part, states in outs:
                preds = torch.stack([vocab[(x @ rows.T).argmax(-1)] for x in states], -1)
                for b, r in enumerate(part):
                    p = preds[b].tolist()
                    walks.append(walk(r["tokens"].tolist(), lambda i, m: p[i][:m], K, 128))
            s = summary(walks)
            print(f"readout over {size:6d} tokens: {s['mean_accepted']:.4f} tokens per verification at k = {K}, "
                  f"acceptance {[round(a, 3) for a in s['acceptance_per_position']]}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else os.path.expanduser("~/.cache/edge-runtime/mtp-written-10200-taps20-26"))
