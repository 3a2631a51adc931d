"""Training the attention draft head (`edge_runtime.spec.attn_head`) and measuring it offline.

The data is `train-mtp`'s: the model's own answers with, per answer token i, the hidden state that chose
it, the token and the model's argmax (`mtp_data.py`). A chain started at position t is scored against the
model's argmax one, two, ... positions on; the draft vocabulary is the `draft_vocab` most frequent
answer tokens, as for `MtpHead`. `chain_accuracy` is the share of chains still right at each depth
among those whose earlier drafts were right: for greedy decoding with chains of k drafts that is exactly
what verification accepts, so tokens per verification follow (`expected_accepted`), measured here on
answers the model gives to questions (MT-Bench's, for the held-out figure) without running the drafter.
"""
from __future__ import annotations

import math
import random
import time

import torch
import torch.nn.functional as F

from edge_cli.train_mtp import draft_index, draft_vocabulary, embedding_table, expected_accepted, trainable
from edge_runtime.spec.attn_head import AttnDraftHead


def draft_vocab(records: list[dict], vocab_size: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(the `size` most frequent answer tokens, index [vocab_size]: token -> its draft index or -100)."""
    return draft_vocabulary(records, vocab_size, size)[:2]


def batch_of(records: list[dict], emb_table: torch.Tensor, index: torch.Tensor, steps: int):
    """Padded tensors: h [B, T, dim], emb [B, T + steps - 1, dim], valid [B, T], targets [B, T, steps]."""
    T = max(len(r["tokens"]) for r in records)
    B, dim = len(records), emb_table.shape[1]
    h = torch.zeros(B, T, dim)
    emb = torch.zeros(B, T + steps - 1, dim)
    valid = torch.zeros(B, T, dtype=torch.bool)
    targets = torch.full((B, T, steps), -100, dtype=torch.long)
    for b, r in enumerate(records):
        n = len(r["tokens"])
        h[b, :n] = r["hidden"].float()
        emb[b, :n] = emb_table[r["tokens"]]
        valid[b, :n] = True
        greedy = index[r["greedy"]]
        for s in range(steps):  # start t, step s: the argmax at answer position t + s + 1
            if n > s + 1:
                targets[b, :n - s - 1, s] = greedy[s + 1:]
    return h, emb, valid, targets


def chain_accuracy(head: AttnDraftHead, records: list[dict], emb_table, head_rows, index, steps: int,
                   batch: int = 32) -> list[float]:
    right, seen = torch.zeros(steps), torch.zeros(steps)
    with torch.no_grad():
        for s in range(0, len(records), batch):
            h, emb, valid, tgt = batch_of(records[s:s + batch], emb_table, index, steps)
            preds = torch.stack([(o @ head_rows.T).argmax(-1) for o in head.chain(h, emb, valid, steps)], dim=-1)
            alive = valid.clone()
            for j in range(steps):
                alive &= tgt[..., j] != -100  # a target outside the draft vocabulary stays: a miss
                seen[j] += alive.sum()
                alive &= preds[..., j] == tgt[..., j]
                right[j] += alive.sum()
    return [float(right[j] / seen[j]) if seen[j] else 0.0 for j in range(steps)]


ANSWERS_PER_STEP = 8  # whole answers per optimizer step, unless --answers-per-step says otherwise


def train_attention(records: list[dict], backend, steps: int = 4, hidden: int = 1536, size: int = 4096,
                    epochs: int = 4, batch: int = ANSWERS_PER_STEP, lr: float = 2e-3, seed: int = 0, held_out=None,
                    progress=print) -> tuple[AttnDraftHead, dict]:
    """Trains on `records` (a 20th held out, seeded); `held_out`: more records to score each epoch on."""
    torch.manual_seed(seed)
    records = list(records)
    random.Random(seed).shuffle(records)
    held, train_recs = records[:max(1, len(records) // 20)], records[max(1, len(records) // 20):]
    cfg = backend.model.cfg
    vocab, index = draft_vocab(train_recs, cfg.vocab_size, size)
    emb_table = embedding_table(backend)
    head_rows = emb_table[vocab].contiguous()
    head = AttnDraftHead(cfg.dim, cfg.num_heads, cfg.head_dim, hidden, vocab, cfg.norm_eps, 10000.0, steps)
    opt = torch.optim.AdamW(head.parameters(), lr=lr, weight_decay=0.01)
    total_steps = epochs * math.ceil(len(train_recs) / batch)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda i: min(1.0, (i + 1) / 50) * 0.5 * (1 + math.cos(math.pi * i / total_steps)))
    weights = [0.8 ** s for s in range(steps)]
    t0, report = time.time(), {"epochs": []}
    for epoch in range(epochs):
        order = torch.randperm(len(train_recs)).tolist()
        for s in range(0, len(order), batch):
            h, emb, valid, tgt = batch_of([train_recs[i] for i in order[s:s + batch]], emb_table, index, steps)
            outs = head.chain(h, emb, valid, steps)
            loss = sum(w * F.cross_entropy((o @ head_rows.T).flatten(0, 1), trainable(tgt[..., j]).flatten(), ignore_index=-100)
                       for j, (w, o) in enumerate(zip(weights, outs)))
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
        acc = chain_accuracy(head, held, emb_table, head_rows, index, steps)
        extra = chain_accuracy(head, held_out, emb_table, head_rows, index, steps) if held_out else None
        report["epochs"].append({"epoch": epoch + 1, "held_out": acc, "extra": extra, "s": round(time.time() - t0)})
        progress(f"  epoch {epoch + 1}/{epochs}: held-out chain accuracy {[round(a, 3) for a in acc]} "
                 f"(k=3: {expected_accepted(acc, 3):.3f} tokens per verification)"
                 + (f"; other set {[round(a, 3) for a in extra]} (k=3: {expected_accepted(extra, 3):.3f})"
                    if extra else "") + f" ({time.time() - t0:.0f} s)")
    report.update({"positions": sum(len(r["tokens"]) for r in train_recs), "draft_vocab": len(vocab),
                   "steps": steps, "hidden": hidden, "batch": batch, "lr": lr, "seed": seed})
    return head.eval(), report


def mt_bench_records(backend, n: int = 80, max_tokens: int = 128, path: str | None = None) -> list[dict]:
    """The model's greedy answers to the first turns of MT-Bench, with their hidden states in fp32, as the engine's
    drafter gets them (so a replay over them drafts what the engine drafts; cached at `path`, a cache of fp16
    states, as the files before 2026-12-05 were, is answered again)."""
    import os

    from edge_cli.bench.spec import mt_bench_prompts
    from edge_cli.mtp_data import add_taps, answer_jobs

    jobs = [(0.0, i, [{"role": "user", "content": q}]) for i, q in enumerate(mt_bench_prompts(n))]
    records = torch.load(path) if path and os.path.exists(path) else None
    if records is None or records[0]["hidden"].dtype != torch.float32:
        records = answer_jobs(backend, jobs, max_tokens, seed=0, progress=None, hidden_dtype=torch.float32)
        if path:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            torch.save(records, path)
    dim = backend.model.cfg.dim
    if records[0]["hidden"].shape[1] != (1 + len(backend.model.taps)) * dim:  # the cache made with other taps
        records = [{**r, "hidden": r["hidden"][:, :dim]} for r in records]
        if backend.model.taps:
            records = add_taps(backend, jobs, records, max_tokens)
    return records


def mlp_chain_accuracy(head, records: list[dict], backend) -> list[float]:
    """The shipped `MtpHead`'s chain accuracy on `records`, measured the same way."""
    from edge_cli.train_mtp import accuracy, examples, flatten

    emb_table = embedding_table(backend)
    flat, starts = flatten(records)
    rows, toks, tgts = examples(records, head.depth, draft_index(head.vocab, len(emb_table)), starts)
    return accuracy(head, emb_table, emb_table[head.vocab].contiguous(), flat[rows], toks, tgts)


MT_BENCH_TOKENS = 128  # the MT-Bench answers' length, as `bench spec --spec-tokens` by default


def mlp_figures(head, records: list[dict], backend) -> dict:
    """An MLP head on greedy answers: the replayed verification at k = 3 through the drafter `--draft mtp`
    runs (exact: what `bench spec` measures), the chain accuracy per depth over every position, and the
    tokens per verification that accuracy would give if positions were alike (`expected_accepted_k3`)."""
    from edge_cli.mtp_eval import drafter_walk
    from edge_runtime.spec.mtp import MtpDrafter

    if not head.taps:  # heads without taps read the final states alone
        records = [{**r, "hidden": r["hidden"][:, :head.dim]} for r in records]
    acc = mlp_chain_accuracy(head, records, backend)
    w = drafter_walk(MtpDrafter(head, backend.model.embedding), records, 3, MT_BENCH_TOKENS)
    return {"mean_accepted_k3": w["mean_accepted"], "acceptance_per_position": w["acceptance_per_position"],
            "verify_steps": w["verify_steps"], "chain_accuracy": acc, "expected_accepted_k3": expected_accepted(acc, 3)}


def _say(name: str, f: dict) -> None:
    print(f"train-mtp: {name} on MT-Bench: {f['mean_accepted_k3']:.3f} tokens per verification at k = 3 "
          f"(acceptance by position {[round(a, 3) for a in f['acceptance_per_position']]}; chain accuracy "
          f"{[round(a, 3) for a in f['chain_accuracy']]})")


def _mt_bench_and_shipped(backend, args) -> tuple[dict, list[dict], dict]:
    """(the machine and commit, before anything is written; the model's MT-Bench answers; the shipped MLP
    heads' figures on them, empty without heads)."""
    from edge_cli.bench.decode import machine
    from edge_runtime.spec.mtp import MtpHead, find_heads

    where = machine()
    bench = mt_bench_records(backend, n=args.mt_bench, max_tokens=MT_BENCH_TOKENS, path=args.mt_bench_cache)
    shipped = MtpHead.load(find_heads(backend))[0] if find_heads(backend) else None
    mlp = {}
    if shipped is not None:  # on the same answers, with the layers the shipped heads read
        kept, backend.model.taps = backend.model.taps, shipped.taps
        try:
            mlp = mlp_figures(shipped, mt_bench_records(backend, n=args.mt_bench, max_tokens=MT_BENCH_TOKENS,
                                                        path=args.mt_bench_cache), backend)
        finally:
            backend.model.taps = kept
    if mlp:
        _say("the shipped MLP heads", mlp)
    return where, bench, mlp


def _sizes(data: dict, curve: list[int] | None):
    """The datasets of the curve: the answers to the first N prompts for each N of `curve`, smaller first, then
    all of `data`; each with its answer-token count."""
    from edge_cli.mtp_data import first_prompts

    for n in sorted(curve or []) + [None]:
        part = data if n is None else first_prompts(data, n)
        yield part, sum(len(r["tokens"]) for r in part["records"])


def compare_heads(data: dict, backend, args) -> dict:
    """`train-mtp --arch attention`: trains the attention head on `data` and measures it and the shipped MLP
    heads offline on MT-Bench's first turns (greedy, 128 tokens): verification replayed at k = 3, chain
    accuracy per depth. No drafter loads the attention head yet, so it is measured, not written."""
    from edge_cli.mtp_eval import attention_walk

    where, bench, mlp = _mt_bench_and_shipped(backend, args)
    emb_table = embedding_table(backend)
    curve = []
    for part, tokens in _sizes(data, args.curve):
        head, report = train_attention(part["records"], backend, steps=args.depth, hidden=args.hidden,
                                       size=args.draft_vocab, epochs=args.epochs, seed=args.seed, held_out=bench,
                                       batch=args.answers_per_step or ANSWERS_PER_STEP)
        last = report["epochs"][-1]
        w = attention_walk(head, bench, emb_table, 3, MT_BENCH_TOKENS)
        curve.append({"prompts": part.get("prompts"), "train_answer_tokens": tokens, "chain_accuracy": last["extra"],
                      "expected_accepted_k3": expected_accepted(last["extra"], 3), "mean_accepted_k3": w["mean_accepted"],
                      "acceptance_per_position": w["acceptance_per_position"]})
        _say(f"the attention head trained on {tokens} tokens", curve[-1])
    return {"benchmark": "mtp-heads-offline", "mt_bench_answers": len(bench), "curve": curve,
            "targets": {"mean_accepted_k3": 2.5},
            "mt_bench_answer_tokens": sum(len(r["tokens"]) for r in bench),
            "train_answer_tokens": sum(len(r["tokens"]) for r in data["records"]), "mlp_shipped": mlp,
            "attention": {**{k: curve[-1][k] for k in ("chain_accuracy", "expected_accepted_k3", "mean_accepted_k3",
                                                       "acceptance_per_position")},
                          "held_out_in_domain": last["held_out"], **report},
            "machine": where}


def mlp_curve(data: dict, backend, args):
    """`train-mtp --curve N1,N2 --json F` for the MLP heads: one head per data size (the answers to the first
    N1, N2 ... prompts, then all of them), each measured offline on MT-Bench as `compare_heads` does, so the
    curve of tokens per verification against training tokens shows what more data buys. Returns the last head
    (trained on everything: the one `train-mtp` writes), its report (with its MT-Bench figures) and the figures."""
    from edge_cli.train_mtp import train

    where, bench, before = _mt_bench_and_shipped(backend, args)
    curve = []
    for part, tokens in _sizes(data, args.curve):
        t0 = time.time()
        head, report = train(part, backend, depth=args.depth, hidden=args.hidden, draft_vocab=args.draft_vocab,
                             epochs=args.epochs, seed=args.seed, loss=args.loss or "soft",
                             precision=args.precision or "fp32")
        seconds = round(time.time() - t0)
        f = mlp_figures(head, bench, backend)
        curve.append({"prompts": part.get("prompts"), "train_answer_tokens": tokens, "train_seconds": seconds,
                      "held_out_chain_accuracy": report["held_out_chain_accuracy"], **f})
        _say(f"the heads trained on {tokens} tokens", f)
    report.update({"mt_bench_chain_accuracy": [round(a, 4) for a in f["chain_accuracy"]],
                   "mt_bench_tokens_per_verification_k3": round(f["mean_accepted_k3"], 4),
                   "mt_bench_acceptance_per_position_k3": [round(a, 4) for a in f["acceptance_per_position"]]})
    seconds = data.get("generation_seconds")
    generation = {"answers": len(data["records"]), "prompts": data.get("prompts"), "shards": data.get("shards_present"),
                  "answer_tokens": curve[-1]["train_answer_tokens"],
                  "tap_seconds": data.get("tap_seconds"),
                  "temperatures": data.get("temperatures"), "max_tokens": data.get("max_tokens"), "seconds": seconds,
                  "tokens_per_s": curve[-1]["train_answer_tokens"] / seconds if seconds else None}
    figures = {"benchmark": "mtp-train-curve", "arch": "mlp", "taps": list(backend.model.taps),
               "loss": args.loss or "soft", "epochs": args.epochs, "precision": args.precision or "fp32",
               "hidden": args.hidden, "generation": generation, "curve": curve,
               "mt_bench_answers": len(bench), "mt_bench_answer_tokens": sum(len(r["tokens"]) for r in bench),
               "mlp_shipped_before": before,
               "targets": {"mean_accepted_k3": 2.5}, "machine": where}
    return head, report, figures
