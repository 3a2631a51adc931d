"""Training the attention draft head (`edge_runtime.spec.attn_head`) and measuring it offline.

The data is `train-mtp`'s: the model's own answers with, per answer token i, the hidden state that chose
it, the token and the model's argmax (`mtp_data.py`). A chain started at position t is scored against the
model's argmax one, two, ... positions on; the draft vocabulary is the `draft_vocab` most frequent
answer tokens, as for `MtpHead`. `chain_accuracy` is the share of chains still right at each depth
among those whose earlier drafts were right: for greedy decoding with chains of k drafts that is exactly
what verification accepts, so tokens per verification follow (`expected_accepted`), measured here on
answers the model gives to questions (MT-Bench's, for the held-out figure) without running the drafter.

Training follows the MLP heads' recipe (`train_mtp.train`): each optimizer step takes 256 chain starts,
`WINDOW` consecutive ones from each of many answers (with their real keys: the answer before them), the soft
loss and the taps the data carries; `--answers-per-step` trains on whole answers instead, as before.
"""
from __future__ import annotations

import json
import math
import os
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
    """Whole answers padded into one batch (`piece_batch` with a piece of every position of each, the hard
    targets): h [B, T, W], emb [B, T + steps - 1, dim], valid [B, T], targets [B, T, steps]."""
    lengths = [len(r["tokens"]) for r in records]
    starts = [sum(lengths[:i]) for i in range(len(records))]
    flat = torch.cat([r["hidden"] for r in records])
    pieces = [(i, 0, n) for i, n in enumerate(lengths)]
    h, emb, valid, _, targets = piece_batch(pieces, records, starts, flat, emb_table, index, steps, "hard")
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


POSITIONS = 256  # chain starts per optimizer step, as the MLP heads' batches
WINDOW = 16  # of them, this many consecutive starts from each answer, unless --window or --answers-per-step


def windows(records: list[dict], window: int | None) -> list[tuple[int, int, int]]:
    """The training pieces: (record, first start, starts) tiling every answer (`window` None: whole answers)."""
    out = []
    for i, r in enumerate(records):
        n = len(r["tokens"]) - 1  # the last position has no target
        w = window or n
        out += [(i, o, min(w, n - o)) for o in range(0, n, w)]
    return out


def piece_batch(pieces, records, starts, flat, emb_table, index, steps: int, loss: str):
    """A batch of pieces: h [B, L, W] (each piece's answer up to its last start: the keys), emb [B, L + steps - 1,
    dim], valid [B, L], qpos [B, Q] (the starts), and the targets [B, Q, steps]: with `loss` "soft" the flat row of
    the model's final state at each target position (-1: none), else its argmax's draft index (-100: none)."""
    L, Q = max(o + w for _, o, w in pieces), max(w for _, _, w in pieces)
    rows = torch.zeros(len(pieces), L, dtype=torch.long)
    toks = torch.full((len(pieces), L + steps - 1), -1, dtype=torch.long)  # -1: past the answer's end
    valid = torch.zeros(len(pieces), L, dtype=torch.bool)
    qpos = torch.zeros(len(pieces), Q, dtype=torch.long)
    tgt = torch.full((len(pieces), Q, steps), -1 if loss == "soft" else -100, dtype=torch.long)
    for b, (i, o, w) in enumerate(pieces):
        r, n, m = records[i], len(records[i]["tokens"]), o + w
        rows[b, :m] = torch.arange(m) + starts[i]
        toks[b, :min(n, m + steps - 1)] = r["tokens"][:m + steps - 1]
        valid[b, :m] = True
        qpos[b] = o + torch.arange(Q).clamp(max=w - 1)  # a short piece repeats its last start, without targets
        for s in range(steps):  # start t, step s: the position t + s + 1
            t = torch.arange(o, max(o, min(m, n - s - 1)))
            if len(t):
                tgt[b, :len(t), s] = t + s + 1 + starts[i] if loss == "soft" else index[r["greedy"][t + s + 1]]
    emb = emb_table[toks.clamp(min=0)] * (toks >= 0)[..., None]  # zeros past the answer's end
    return flat[rows].float() * valid[..., None], emb, valid, qpos, tgt


def train_attention(data: dict, backend, steps: int = 4, hidden: int = 1024, size: int = 4096, epochs: int = 2,
                    window: int | None = WINDOW, answers_per_step: int | None = None, lr: float = 2e-3,
                    seed: int = 0, loss: str = "soft", precision: str = "fp32", held_out=None,
                    progress=print, layers: int = 1, checkpoint: str | None = None,
                    checkpoint_every: float = 600.0) -> tuple[AttnDraftHead, dict]:
    """Trains on `data`'s records (a 20th held out, seeded) with the MLP heads' recipe: each optimizer step
    takes `POSITIONS` chain starts, `window` consecutive ones from each of many answers (their real keys with
    them: every position of the answer before a start), the soft loss (the model's own distribution over the
    draft vocabulary) and the taps the data carries; `answers_per_step`: whole answers a step instead (the
    recipe before 2026-12-05 with `loss` "hard", but for the warm-up and the epoch kept). The epoch that drafts
    best on the held-out answers is kept; `held_out`: more records (MT-Bench's) scored each epoch.
    `checkpoint`: a file the whole training state is written to every `checkpoint_every` seconds and after each
    epoch, and resumed from when it exists (made with the same settings and data, else refused), so a run
    killed at any point goes on where its last checkpoint was and ends with the same head as one run through."""
    from edge_cli.train_mtp import flatten, soft_loss

    torch.manual_seed(seed)
    records = list(data["records"])
    random.Random(seed).shuffle(records)
    flat, starts = flatten(records, data.get("flat"))
    cut = max(1, len(records) // 20)
    held, train_recs, starts = records[:cut], records[cut:], starts[cut:]
    cfg = backend.model.cfg
    vocab, index = draft_vocab(train_recs, cfg.vocab_size, size)
    emb_table = embedding_table(backend)
    head_rows = emb_table[vocab].contiguous()
    head = AttnDraftHead(cfg.dim, cfg.num_heads, cfg.head_dim, hidden, vocab, cfg.norm_eps, 10000.0, steps,
                         tuple(data.get("taps", ())), layers)
    pieces = windows(train_recs, None if answers_per_step else window)
    per_step = answers_per_step or max(1, POSITIONS // window)
    opt = torch.optim.AdamW(head.parameters(), lr=lr, weight_decay=0.01)
    total_steps = epochs * math.ceil(len(pieces) / per_step)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda i: min(1.0, (i + 1) / 100) * 0.5 * (1 + math.cos(math.pi * i / total_steps)))
    weights = torch.tensor([0.8 ** s for s in range(steps)])
    progress(f"train-mtp: attention head, {sum(w for *_, w in pieces)} chain starts in {len(pieces)} pieces, "
             f"{per_step} a step, {total_steps} steps, loss {loss}, {precision}")
    t0, report, best = time.time(), {"epochs": []}, (-1.0, None, 0, None)
    key = {"records": len(records), "positions": len(flat), "pieces": len(pieces), "steps": steps, "hidden": hidden,
           "size": size, "epochs": epochs, "per_step": per_step, "window": window, "lr": lr, "seed": seed,
           "loss": loss, "precision": precision, "layers": layers, "taps": list(head.taps)}
    state = _resume(checkpoint, key, head, opt, sched)
    first, order, start = (state["epoch"], state["order"], state["step"]) if state else (0, None, 0)
    if state:
        report, best, t0 = state["report"], state["best"], t0 - state["seconds"]
        progress(f"  resumed from {checkpoint}: epoch {first + 1}, step {start // per_step}")
    saved = time.time()
    for epoch in range(first, epochs):
        order = order if epoch == first and order is not None else torch.randperm(len(pieces)).tolist()
        for s in range(start if epoch == first else 0, len(order), per_step):
            if checkpoint and time.time() - saved >= checkpoint_every:
                _save(checkpoint, key, head, opt, sched, epoch, order, s, report, best, time.time() - t0)
                saved = time.time()
            h, emb, valid, qpos, tgt = piece_batch([pieces[i] for i in order[s:s + per_step]], train_recs, starts,
                                                   flat, emb_table, index, steps, loss)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
                logits = torch.stack([o @ head_rows.T for o in head.chain(h, emb, valid, steps, qpos)], dim=2)
                if loss == "soft":
                    value = soft_loss(logits.flatten(0, 1), flat[:, :cfg.dim], tgt.flatten(0, 1), head_rows, weights)
                else:
                    value = sum(w * F.cross_entropy(logits[:, :, j].flatten(0, 1).float(),
                                                    trainable(tgt[..., j]).flatten(), ignore_index=-100)
                                for j, w in enumerate(weights))
            opt.zero_grad()
            value.backward()
            opt.step()
            sched.step()
        acc = chain_accuracy(head, held, emb_table, head_rows, index, steps)
        extra = chain_accuracy(head, held_out, emb_table, head_rows, index, steps) if held_out else None
        score = expected_accepted(acc, 3)
        if score > best[0]:  # keep the epoch that drafts best on held-out answers
            best = (score, acc, epoch + 1, {k: v.clone() for k, v in head.state_dict().items()})
        report["epochs"].append({"epoch": epoch + 1, "held_out": acc, "extra": extra, "s": round(time.time() - t0)})
        progress(f"  epoch {epoch + 1}/{epochs}: held-out chain accuracy {[round(a, 3) for a in acc]} "
                 f"(k=3: {score:.3f} tokens per verification)"
                 + (f"; other set {[round(a, 3) for a in extra]} (k=3: {expected_accepted(extra, 3):.3f})"
                    if extra else "") + f" ({time.time() - t0:.0f} s)")
        if checkpoint:
            _save(checkpoint, key, head, opt, sched, epoch + 1, None, 0, report, best, time.time() - t0)
            saved = time.time()
    head.load_state_dict(best[3])
    report.update({"positions": sum(len(r["tokens"]) for r in train_recs), "draft_vocab": len(vocab),
                   "steps": steps, "hidden": hidden, "batch": per_step, "window": None if answers_per_step else window,
                   "lr": lr, "seed": seed, "loss": loss, "layers": layers, "precision": precision,
                   "taps": list(head.taps),
                   "best_epoch": best[2], "train_seconds": round(time.time() - t0)})
    return head.eval(), report


def check_attention_args(args) -> None:
    """Refuses `train-mtp` flags of the attention head's training given without it, or out of range."""
    from edge_runtime.errors import EdgeRuntimeError

    attention = args.arch == "attention"
    if args.answers_per_step is not None and (not attention or args.answers_per_step < 1):
        raise EdgeRuntimeError(f"train-mtp: --answers-per-step ({args.answers_per_step}) is the attention head's whole "
                               "answers per step (the MLP heads train on batches of 256 positions): --arch attention, "
                               "at least 1")
    if args.window is not None and (not attention or args.answers_per_step is not None or args.window < 1):
        raise EdgeRuntimeError(f"train-mtp: --window ({args.window}) is the attention head's chain starts per answer "
                               "in a step: --arch attention, without --answers-per-step, at least 1")
    if args.layers != 1 and (not attention or args.layers < 1):
        raise EdgeRuntimeError(f"train-mtp: --layers ({args.layers}) is the attention head's decoder layers: "
                               "--arch attention, at least 1")
    if args.checkpoint and (not attention or args.curve):
        raise EdgeRuntimeError("train-mtp: --checkpoint keeps one attention head's training: --arch attention, "
                               "without --curve")


def _save(path: str, key: dict, head, opt, sched, epoch: int, order, step: int, report, best, seconds: float) -> None:
    """The training state before optimizer step `step` of `epoch` (its piece `order`; None: not drawn yet), with the
    torch RNG that draws the next epochs' orders; written whole, then renamed."""
    torch.save({"key": key, "head": head.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                "epoch": epoch, "order": order, "step": step, "rng": torch.get_rng_state(), "report": report,
                "best": best, "seconds": seconds}, path + ".tmp")
    os.replace(path + ".tmp", path)


def _resume(path: str | None, key: dict, head, opt, sched) -> dict | None:
    if not path or not os.path.exists(path):
        return None
    from edge_runtime.errors import EdgeRuntimeError

    state = torch.load(path, weights_only=False)
    if state["key"] != key:
        raise EdgeRuntimeError(f"train-mtp: the checkpoint {path} was made with other settings or data ({state['key']}, "
                               f"here {key}); use another --checkpoint file")
    head.load_state_dict(state["head"])
    opt.load_state_dict(state["opt"])
    sched.load_state_dict(state["sched"])
    torch.set_rng_state(state["rng"])
    return state


def mt_bench_records(backend, n: int = 80, max_tokens: int = 128, path: str | None = None) -> list[dict]:
    """The model's greedy answers to the first turns of MT-Bench, with their hidden states in fp32, as the engine's
    drafter gets them (so a replay over them drafts what the engine drafts; cached at `path`, a cache of fp16
    states, as the files before 2026-12-05 were, is answered again)."""
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
    accuracy per depth. Returns the head trained on all of `data` (the last point), its report and the figures. With
    `--json` the figures so far are written after each point of the curve (`points_planned` says how many
    the run set out to make), so a long run stopped early keeps the points it finished."""
    from edge_cli.mtp_eval import attention_walk

    where, bench, mlp = _mt_bench_and_shipped(backend, args)
    emb_table = embedding_table(backend)
    sizes, curve = list(_sizes(data, args.curve)), []
    for part, tokens in sizes:
        head, report = train_attention(part, backend, steps=args.depth, hidden=args.hidden, size=args.draft_vocab,
                                       epochs=args.epochs, window=args.window or WINDOW,
                                       answers_per_step=args.answers_per_step, seed=args.seed, held_out=bench,
                                       loss=args.loss or "soft", precision=args.precision or "fp32",
                                       layers=args.layers, checkpoint=args.checkpoint)
        last = report["epochs"][report["best_epoch"] - 1]  # the epoch kept
        w = attention_walk(head, bench, emb_table, 3, MT_BENCH_TOKENS)
        curve.append({"prompts": part.get("prompts"), "train_answer_tokens": tokens, "chain_accuracy": last["extra"],
                      "held_out_chain_accuracy": last["held_out"], "train_seconds": report["train_seconds"],
                      "expected_accepted_k3": expected_accepted(last["extra"], 3), "mean_accepted_k3": w["mean_accepted"],
                      "acceptance_per_position": w["acceptance_per_position"]})
        _say(f"the attention head trained on {tokens} tokens", curve[-1])
        figures = {"benchmark": "mtp-heads-offline", "mt_bench_answers": len(bench), "curve": curve,
                   "points_planned": len(sizes), "targets": {"mean_accepted_k3": 2.5},
                   "mt_bench_answer_tokens": sum(len(r["tokens"]) for r in bench),
                   "train_answer_tokens": sum(len(r["tokens"]) for r in data["records"]), "mlp_shipped": mlp,
                   "attention": {**{k: curve[-1][k] for k in ("chain_accuracy", "expected_accepted_k3",
                                                              "mean_accepted_k3", "acceptance_per_position")},
                                 "held_out_in_domain": last["held_out"], **report},
                   "machine": where}
        if args.json and len(curve) < len(sizes):  # (the whole JSON is printed once, at the end)
            os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
            with open(args.json, "w", encoding="utf-8") as f:
                f.write(json.dumps(figures, indent=2) + "\n")
    report.update({k: curve[-1][k] for k in ("chain_accuracy", "mean_accepted_k3", "acceptance_per_position")})
    return head, report, figures


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
