"""What verification accepts, measured offline and exactly: a replay over the model's greedy answers.

For greedy decoding with chains of k drafts, what a drafter gains is decided by the answer alone: at each
verification, starting after the last verified token i, the drafter proposes up to k tokens; the longest
prefix equal to the model's own next tokens is accepted, the model's token after it comes free (the bonus),
and the next verification starts there. Replaying that walk over the model's greedy answers (with their
hidden states, as `train-mtp` records them) gives the tokens per verification and the acceptance per
draft position that `bench spec` measures online, without running the model again.

Averaging chain accuracy over every position instead (`expected_accepted`) overstates it: the walk starts
where the last drafts failed, which are the harder positions (on the shipped heads, 1.64 estimated against
1.58 walked and measured online).
"""
from __future__ import annotations

import torch


def walk(tokens: list[int], propose, k: int, limit: int | None = None) -> tuple[int, int, list[int], list[int]]:
    """Greedy verification replayed on the greedy answer `tokens`, asked for `limit` tokens (default: as many
    as it has): `propose(i, m)` drafts up to m <= k tokens after tokens[i] (none: a plain step). Returns (verifications, drafts accepted,
    drafts accepted and drafts proposed at each draft position)."""
    steps = accepted = 0
    pos, proposed = [0] * k, [0] * k
    i, n = 0, len(tokens)
    limit = n if limit is None else limit
    while i < n - 1:
        m = min(k, limit - 2 - i)  # as the engine: the drafts and the bonus fit in the tokens still wanted
        drafts = propose(i, m)[:m] if m >= 1 else []
        if not drafts:  # the last token, or nothing to propose: a plain step, not a verification
            i += 1
            continue
        a = 0
        while a < len(drafts) and i + 1 + a < n and drafts[a] == tokens[i + 1 + a]:
            pos[a] += 1
            a += 1
        for j in range(len(drafts)):
            proposed[j] += 1
        steps, accepted, i = steps + 1, accepted + a, i + a + 1
    return steps, accepted, pos, proposed


def summary(walks: list[tuple]) -> dict:
    """`bench spec`'s figures from walks: tokens per verification (bonus included), the share of the drafts at
    each position that were accepted, and the verification count."""
    steps = sum(w[0] for w in walks)
    k = len(walks[0][2]) if walks else 0
    acc, prop = ([sum(w[n][j] for w in walks) for j in range(k)] for n in (2, 3))
    return {"mean_accepted": 1.0 + sum(w[1] for w in walks) / steps if steps else 0.0,
            "acceptance_per_position": [a / p for a, p in zip(acc, prop) if p], "verify_steps": steps}


def drafter_walk(drafter, records: list[dict], k: int = 3, limit: int | None = None) -> dict:
    """An `MtpDrafter` (what `--draft mtp` runs) replayed over greedy answers asked for `limit` tokens."""
    def one(r):
        tokens, hidden = r["tokens"].tolist(), r["hidden"]
        return walk(tokens, lambda i, m: drafter.propose_from(hidden[i], tokens[i], m), k, limit)

    return summary([one(r) for r in records])


def chain_walk(drafter, records: list[dict], k: int = 3, limit: int | None = None) -> dict:
    """An `AttnDrafter` (what `--draft mtp-attn` runs: a chain per answer, fed each token with the row that
    chose it, as the engine feeds it) replayed over greedy answers asked for `limit` tokens."""
    def one(r):
        tokens, hidden, chain, fed = r["tokens"].tolist(), r["hidden"], drafter.new_chain(), [0]

        def propose(i, m):
            for j in range(fed[0], i + 1):
                chain.feed(hidden[j], tokens[j])
            fed[0] = i + 1
            return chain.propose(tokens[:i + 1], m)
        return walk(tokens, propose, k, limit)

    return summary([one(r) for r in records])


def lookup_walk(drafter, records: list[dict], prompts: list[list[int]], k: int = 3, limit: int | None = None) -> dict:
    """The heads with prompt lookup (`LookupThenHeads`, what `--draft mtp-ngram` runs) replayed over greedy
    answers; `prompts[j]`: the prompt ids of `records[j]`, which lookup reads with the answer so far."""
    from edge_runtime.spec.speculative import LookupThenHeads

    def one(r, ids):
        combo = LookupThenHeads(drafter)  # a fresh lookup index per answer
        tokens, hidden = r["tokens"].tolist(), r["hidden"]
        return walk(tokens, lambda i, m: combo.propose(ids + tokens[:i + 1], m, hidden[i]), k, limit)

    return summary([one(r, ids) for r, ids in zip(records, prompts)])


def attention_walk(head, records: list[dict], emb_table: torch.Tensor, k: int = 3, limit: int | None = None,
                   batch: int = 32) -> dict:
    """The attention head replayed over greedy answers: its chains at every position at once (`chain` computes
    each as drafting would), then the walk picks the ones verification would have asked for."""
    from edge_cli.train_attn import batch_of

    index = torch.arange(len(emb_table))  # the targets are not needed, only the chains' drafts
    walks = []
    rows = emb_table[head.vocab]
    with torch.no_grad():
        for s in range(0, len(records), batch):
            part = records[s:s + batch]
            h, emb, valid, _ = batch_of(part, emb_table, index, k)
            preds = torch.stack([head.vocab[(o @ rows.T).argmax(-1)] for o in head.chain(h, emb, valid, k)], -1)
            for b, r in enumerate(part):
                p = preds[b].tolist()
                walks.append(walk(r["tokens"].tolist(), lambda i, m: p[i][:m], k, limit))
    return summary(walks)
