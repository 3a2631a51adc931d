"""`edge-runtime train-mtp`: train the MTP draft heads of the default model by self-distillation.

1. The model answers the training prompts of `mtp_data.py` (text shipped in the repo, never
   MT-Bench), recording each step's hidden state, token and argmax.
2. The draft vocabulary is the `--draft-vocab` most frequent tokens of those answers.
3. One `MtpHead` is trained to chain `--depth` drafts: step j reads the previous step's
   output state (the base model's state for j = 0) and the answer's token, and is scored by
   cross-entropy against the model's own argmax one position further (targets outside the
   draft vocabulary are skipped). The base model and its tied head stay frozen.
4. The weights go to `edge_runtime/data/mtp/<model>.safetensors` (fp16), with the
   training settings and held-out per-depth accuracy in the file's metadata.

Everything is seeded; the answers are cached in `--data` so training can be rerun alone.
"""
from __future__ import annotations

import math
import os
import random
import time

import torch
import torch.nn.functional as F

from edge_cli.mtp_data import PROMPT_SETS
from edge_runtime.errors import EdgeRuntimeError
from edge_runtime.spec.mtp import HEADS_DIR, MtpHead, base_fingerprint

SMALL_DATA = os.path.join(".cache", "mtp-data.pt")


def flatten(records: list[dict], flat: torch.Tensor | None = None) -> tuple[torch.Tensor, list[int]]:
    """The records' hidden rows as one tensor [R, W] and each record's first row in it: `flat`, the store
    `load_shards` maps from disk, when given (its records carry their "row"); else their rows concatenated."""
    if flat is not None:
        return flat, [r["row"] for r in records]
    sizes = [len(r["tokens"]) for r in records]
    starts = [0] + torch.tensor(sizes).cumsum(0).tolist()[:-1] if records else []
    return torch.cat([r["hidden"] for r in records]), starts


def examples(records: list[dict], depth: int, vocab_index: torch.Tensor, starts: list[int]):
    """rows [N] (each position's hidden row in the records' flat store, see `flatten`; `starts`: each record's
    first row there), tokens [N, depth] (chain inputs), targets [N, depth] (draft-vocab index, OUTSIDE, or
    -100 past the answer's end)."""
    rows, toks, tgts = [], [], []
    for r, start in zip(records, starts):
        n = len(r["tokens"])
        if n < 2:
            continue
        pad_tok = torch.cat([r["tokens"], torch.zeros(depth, dtype=torch.long)])
        greedy = torch.cat([vocab_index[r["greedy"]], torch.full((depth + 1,), -100, dtype=torch.long)])
        idx = torch.arange(n - 1)
        rows.append(idx + start)
        toks.append(torch.stack([pad_tok[idx + j] for j in range(depth)], dim=1))
        tgts.append(torch.stack([greedy[idx + j + 1] for j in range(depth)], dim=1))
    return torch.cat(rows), torch.cat(toks), torch.cat(tgts)


def next_states(records: list[dict], depth: int, starts: list[int]) -> torch.Tensor:
    """For `examples`' rows, in its order, and each depth j: the flat row of the model's final state that chose
    the token j + 1 positions on ([N, depth], -1 past the answer's end): the soft targets' source
    (`soft_loss`; a row's first `dim` values are that final state, what its logits read)."""
    idx = []
    for r, start in zip(records, starts):
        n = len(r["tokens"])
        if n < 2:
            continue
        i = torch.arange(n - 1)[:, None] + torch.arange(1, depth + 1)[None, :]
        idx.append(torch.where(i < n, i + start, -1))
    return torch.cat(idx)


def soft_loss(logits, states, idx, head_rows, weights) -> torch.Tensor:
    """Cross-entropy of the chain's logits [N, depth, V_d] against the model's own distribution over the draft
    vocabulary at each target position (its final state there through the tied head rows), rather than its
    argmax alone: the head learns how sure the model is (`idx` -1: no target)."""
    ok = idx >= 0
    with torch.autocast("cpu", enabled=False):  # the targets in fp32 under `train(precision="bf16")` too
        rows, where = torch.unique(idx.clamp(min=0), return_inverse=True)  # a position is a target of several starts
        p = torch.softmax(states[rows].float() @ head_rows.T, dim=-1)[where]
        ce = -(p * F.log_softmax(logits.float(), dim=-1)).sum(-1)  # [N, depth]
    return ((ce * ok).sum(0) / ok.sum(0).clamp(min=1) * weights).sum()


def chain_logits(head: MtpHead, emb_table: torch.Tensor, head_rows: torch.Tensor, h, toks):
    """Logits [N, depth, V_d] of the chained head (teacher-forced tokens, its own states)."""
    out, h = [], h.float()
    for j in range(toks.shape[1]):
        h = head(h, emb_table[toks[:, j]])
        out.append(h @ head_rows.T)
    return torch.stack(out, dim=1)


def accuracy(head, emb_table, head_rows, h, toks, tgts, batch: int = 1024) -> list[float]:
    """Per depth: the share of positions whose draft equals the model's argmax, among positions
    where every earlier draft of the chain was right too (what verification accepts); a target outside
    the draft vocabulary is a miss (the head cannot draft it)."""
    depth = toks.shape[1]
    right = torch.zeros(depth)
    seen = torch.zeros(depth)
    with torch.no_grad():
        for s in range(0, len(h), batch):
            pred = chain_logits(head, emb_table, head_rows, h[s:s + batch], toks[s:s + batch]).argmax(-1)
            t = tgts[s:s + batch]
            alive = torch.ones(len(t), dtype=torch.bool)
            for j in range(depth):
                alive &= t[:, j] != -100
                seen[j] += alive.sum()
                alive &= pred[:, j] == t[:, j]
                right[j] += alive.sum()
    return [float(right[j] / seen[j]) if seen[j] else 0.0 for j in range(depth)]


def draft_vocabulary(records: list[dict], vocab_size: int, size: int) -> tuple[torch.Tensor, torch.Tensor, float]:
    """(the `size` most frequent answer tokens, index [vocab_size]: token -> its draft index or -100, the share
    of answer tokens they cover)."""
    counts = torch.zeros(vocab_size)
    for r in records:
        counts += torch.bincount(torch.cat([r["tokens"], r["greedy"]]), minlength=vocab_size).float()
    vocab = torch.argsort(counts, descending=True, stable=True)[:size]
    return vocab, draft_index(vocab, vocab_size), float(counts[vocab].sum() / counts.sum())


OUTSIDE = -1  # a target outside the draft vocabulary: never drafted, so a miss (-100: no target, past the end)


def draft_index(vocab: torch.Tensor, vocab_size: int) -> torch.Tensor:
    index = torch.full((vocab_size,), OUTSIDE, dtype=torch.long)
    index[vocab] = torch.arange(len(vocab))
    return index


@torch.inference_mode()
def embedding_table(backend) -> torch.Tensor:
    """The base model's token embeddings [vocab, dim], fp32 (its tied output head)."""
    n = backend.model.cfg.vocab_size
    return backend.model.embedding(torch.arange(n)).float().reshape(n, -1).clone()


def trainable(targets: torch.Tensor) -> torch.Tensor:
    """Targets for the loss: those outside the draft vocabulary cannot be learnt, so they are left out."""
    return targets.masked_fill(targets == OUTSIDE, -100)


def expected_accepted(acc: list[float], k: int) -> float:
    """Tokens per verification at draft length k (bonus included) given per-depth conditional accuracy."""
    total, alive = 1.0, 1.0
    for a in acc[:k]:
        alive *= a
        total += alive
    return total


def train(data: dict, backend, depth: int = 4, hidden: int = 1024, draft_vocab: int = 4096, epochs: int = 4,
          batch: int = 256, lr: float = 2e-3, seed: int = 0, loss: str = "soft", precision: str = "fp32",
          progress=print) -> tuple[MtpHead, dict]:
    """`precision` "bf16": the training steps' matrix products in bfloat16 (torch's autocast; the weights, the
    optimizer and the held-out figures stay fp32), about 1.5x as fast where the CPU multiplies bf16 (AVX-512
    BF16, AMX); "fp32" is bit-reproducible on the same machine."""
    torch.manual_seed(seed)
    records = list(data["records"])
    random.Random(seed).shuffle(records)
    flat, starts = flatten(records, data.get("flat"))  # the hidden rows stay where they are (on disk if mapped)
    cut = max(1, len(records) // 20)
    held, train_recs = records[:cut], records[cut:]
    cfg = backend.model.cfg
    vocab, vocab_index, coverage = draft_vocabulary(train_recs, cfg.vocab_size, draft_vocab)
    emb_table = embedding_table(backend)
    head_rows = emb_table[vocab].contiguous()
    rows, toks, tgts = examples(train_recs, depth, vocab_index, starts[cut:])
    states, nxt = (flat[:, :cfg.dim], next_states(train_recs, depth, starts[cut:])) if loss == "soft" else (None, None)
    hv, tv, yv = examples(held, depth, vocab_index, starts[:cut])
    hv = flat[hv]
    head = MtpHead(cfg.dim, hidden, vocab, cfg.norm_eps, depth, tuple(data.get("taps", ())))
    opt = torch.optim.AdamW(head.parameters(), lr=lr, weight_decay=0.01)
    steps = epochs * math.ceil(len(rows) / batch)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 100) * 0.5 * (1 + math.cos(math.pi * s / steps)))
    weights = torch.tensor([0.8 ** j for j in range(depth)])
    progress(f"train-mtp: {len(rows)} positions ({len(hv)} held out), draft vocab {len(vocab)} covers "
             f"{coverage:.1%} of answer tokens, {steps} steps")
    t0 = time.time()
    best = (-1.0, [0.0] * depth, 0, None)
    for epoch in range(epochs):
        order = torch.randperm(len(rows))
        total = 0.0
        for s in range(0, len(rows), batch):
            idx = order[s:s + batch]
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
                logits = chain_logits(head, emb_table, head_rows, flat[rows[idx]], toks[idx])
                if nxt is not None:
                    value = soft_loss(logits, states, nxt[idx], head_rows, weights)
                else:
                    value = sum(weights[j] * F.cross_entropy(logits[:, j], trainable(tgts[idx, j]), ignore_index=-100)
                                for j in range(depth))
            opt.zero_grad()
            value.backward()
            opt.step()
            sched.step()
            total += float(value.detach()) * len(idx)
        acc = accuracy(head, emb_table, head_rows, hv, tv, yv)
        score = expected_accepted(acc, 3)
        if score > best[0]:  # keep the epoch that drafts best on held-out answers
            best = (score, acc, epoch + 1, {k: v.clone() for k, v in head.state_dict().items()})
        progress(f"  epoch {epoch + 1}/{epochs}: loss {total / len(rows):.3f}, held-out chain accuracy "
                 f"{[round(a, 3) for a in acc]}, expected tokens per step at k=3 {score:.3f} "
                 f"({time.time() - t0:.0f} s)")
    score, acc, best_epoch, state = best
    if state is not None:
        head.load_state_dict(state)
    report = {"positions": len(rows), "held_out_positions": len(hv), "draft_vocab": len(vocab),
              "vocab_coverage": round(coverage, 4), "depth": depth, "hidden": hidden, "epochs": epochs,
              "batch": batch, "lr": lr, "seed": seed, "held_out_chain_accuracy": [round(a, 4) for a in acc],
              "held_out_expected_tokens_per_step_k3": round(score, 4), "best_epoch": best_epoch,
              "prompts": data.get("prompts"), "max_tokens": data.get("max_tokens"), "taps": data.get("taps", []),
              "loss": loss, "precision": precision}
    return head.eval(), report


def shard_folder(prompts: int, taps: tuple[int, ...] = (), prompt_set: str = "large", seed: int = 0,
                 temperatures: tuple[float, ...] | None = None) -> str:
    """A sharded set's default folder: in the per-user cache (~/.cache/edge-runtime or $EDGE_RUNTIME_CACHE),
    not the checkout, so a fresh checkout on the same machine goes on where the last run stopped; one folder
    per set, prompt count and temperatures other than the default (a folder's shards are answers to one job
    list). `prompts` 0 is the whole set, named by its count: a set that grows gets a new folder, and the old
    one lends it the shards they share."""
    from kernels.compile_cache import cache_root
    from edge_cli.mtp_data import TEMPERATURES, prompt_messages

    count = len(prompt_messages(prompt_set, seed))
    tapped = f"-taps{'-'.join(map(str, taps))}" if taps else ""
    temperatures = tuple(temperatures or TEMPERATURES)
    temps = "" if temperatures == TEMPERATURES else "-temps" + "-".join(f"{t:g}" for t in temperatures)
    return os.path.join(cache_root(), f"mtp-{prompt_set}-{min(prompts or count, count)}{tapped}{temps}")


def shard_folders(prompt_set: str = "large") -> list[str]:
    """A sharded set's folders in the per-user cache: other prompt counts and taps, whose shards a run takes
    rather than answering the same jobs again (`build_shards`' donors)."""
    from kernels.compile_cache import cache_root

    root, head = cache_root(), f"mtp-{prompt_set}-"
    return sorted(os.path.join(root, n) for n in os.listdir(root) if n.startswith(head)) if os.path.isdir(root) else []


def run_train_mtp(args) -> int:
    from edge_runtime.backends.native import NativeBackend
    from edge_cli.mtp_data import build_dataset, build_shards, first_prompts, load_shards

    from edge_cli.train_attn import check_attention_args

    check_attention_args(args)
    taps = tuple(sorted(set(args.taps or ())))
    sharded = args.prompt_set in PROMPT_SETS
    if args.shards is not None and (not sharded or args.shards < 1):
        raise EdgeRuntimeError(f"train-mtp: --shards applies to --prompt-set large, chat or written and must be at "
                               f"least 1, not {args.shards} with --prompt-set {args.prompt_set}")
    if taps and not sharded:
        raise EdgeRuntimeError("train-mtp: --taps applies to --prompt-set large, chat or written")
    if args.arch == "mlp" and (args.curve or args.mt_bench != 80) and not args.json:
        raise EdgeRuntimeError("train-mtp: --curve and --mt-bench measure heads on MT-Bench: name the --json file "
                               "for the figures")
    try:
        temps = tuple(float(t) for t in args.temperatures.split(","))
    except ValueError:
        temps = ()
    if not temps or any(not 0 <= t <= 2 for t in temps):
        raise EdgeRuntimeError(f"train-mtp: --temperatures takes numbers from 0 to 2 separated by commas (one "
                               f"answer per prompt at each), not {args.temperatures!r}")

    # room for 16 answers decoding together (prompts are cut to leave max_tokens)
    backend = NativeBackend(model=args.model, threads=args.threads, n_ctx=1024, kv_budget="1GiB")
    if any(not 0 <= t < backend.model.cfg.num_layers for t in taps):
        raise EdgeRuntimeError(f"train-mtp: --taps must be layers 0..{backend.model.cfg.num_layers - 1}, not "
                               f"{','.join(map(str, taps))}")
    backend.model.taps = taps
    if sharded:  # shards in a folder, resumable
        folder = args.data or shard_folder(args.prompts, taps, args.prompt_set, args.seed, temps)
        print(f"train-mtp: the model answers the {args.prompt_set} prompt set into {folder} (shards already there "
              "are kept)")
        build_shards(backend, folder, args.prompts or None, args.max_tokens, temps, seed=args.seed,
                     donors=shard_folders(args.prompt_set), limit=args.shards, prompt_set=args.prompt_set)
        data = load_shards(folder, args.shards)
    elif os.path.exists(args.data or SMALL_DATA):
        data = torch.load(args.data or SMALL_DATA)
        print(f"train-mtp: {len(data['records'])} cached answers from {args.data or SMALL_DATA}")
        if args.prompts and args.prompts < data["prompts"]:
            data = first_prompts(data, args.prompts)
            print(f"train-mtp: of those, the {len(data['records'])} answers to the first {args.prompts} prompts")
    else:
        print(f"train-mtp: the model answers {args.prompts or 'all'} training prompts at temperatures {temps} "
              "(self-distillation)")
        data = build_dataset(backend, args.data or SMALL_DATA, args.prompts or None,
                             args.max_tokens, temps, seed=args.seed)
    if args.train_prompts is not None:
        if not 1 <= args.train_prompts <= data["prompts"]:
            raise EdgeRuntimeError(f"train-mtp: --train-prompts must be 1 to the data's {data['prompts']} prompts, "
                                   f"not {args.train_prompts}")
        data = first_prompts(data, args.train_prompts)
        print(f"train-mtp: training on the {len(data['records'])} answers to the first {args.train_prompts} prompts")
    print(f"train-mtp: {sum(len(r['tokens']) for r in data['records'])} answer tokens")
    if args.epochs < 1:
        print("train-mtp: --epochs 0: the answers are cached, no training")
        return 0
    from edge_cli.bench.decode import print_and_save

    name = os.path.splitext(os.path.basename(backend.path))[0]
    if args.arch == "attention":
        from edge_cli.train_attn import compare_heads

        head, report, figures = compare_heads(data, backend, args)
        print_and_save(figures, args.json)
    elif args.json:  # heads for each data size of --curve, then all of it, measured on MT-Bench
        from edge_cli.train_attn import mlp_curve

        head, report, figures = mlp_curve(data, backend, args)
        print_and_save(figures, args.json)
    else:
        head, report = train(data, backend, depth=args.depth, hidden=args.hidden, draft_vocab=args.draft_vocab,
                             epochs=args.epochs, seed=args.seed, loss=args.loss or "soft",
                             precision=args.precision or "fp32")
    out = args.out or os.path.join(HEADS_DIR, f"{name}{'.attn' if args.arch == 'attention' else ''}.safetensors")
    head.save(out, base_fingerprint(backend), report)
    print(f"train-mtp: wrote {out} ({os.path.getsize(out) / 1e6:.1f} MB)")
    return 0


def add_train_mtp_parser(sub) -> None:
    t = sub.add_parser("train-mtp", help="train the MTP draft heads by self-distillation (see docs/speculative.md)")
    t.add_argument("--model", default="default")
    t.add_argument("--threads", type=int, default=None)
    t.add_argument("--prompt-set", choices=("small", *PROMPT_SETS), default="small",
                   help="small: the 782 prompts of the shipped heads (one file); large: mtp_prompts.json's templates "
                        "over its topics and its tasks too (about 25,000 prompts); chat: chat-like writing, roleplay, "
                        "reasoning, math, code, extraction and questions from templates (6,615 prompts, "
                        "edge_cli/mtp_chat.py); written: the same kinds written one by one (12,240 prompts in six rounds, "
                        "data/mtp_written_prompts.json); large, chat and written answer into shards in the --data "
                        "folder, resumable")
    t.add_argument("--prompts", type=int, default=0, help="training prompts the model answers (0 = all of the set)")
    t.add_argument("--temperatures", default="0,0.8",
                   help="one answer per prompt at each temperature (a temperature twice: two samples); a run "
                        "that adds temperatures after the default's takes the default's shards")
    t.add_argument("--max-tokens", type=int, default=160, help="tokens per answer")
    t.add_argument("--data", default=None,
                   help="cache of the answers and hidden states, reused when it exists (default: .cache/mtp-data.pt; "
                        "with --prompt-set large, chat or written a folder, ~/.cache/edge-runtime/mtp-SET-N, N the prompts "
                        "answered)")
    t.add_argument("--shards", type=int, default=None,
                   help="--prompt-set large, chat or written: answer and train on the first N shards of the job list "
                        "only (256 answers each, greedy ones first; default all)")
    t.add_argument("--depth", type=int, default=4, help="drafts the head learns to chain")
    t.add_argument("--hidden", type=int, default=1024, help="the head's MLP width")
    t.add_argument("--draft-vocab", type=int, default=4096, help="tokens the head can draft")
    t.add_argument("--epochs", type=int, default=4)
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--arch", choices=("mlp", "attention"), default="mlp",
                   help="attention: train the EAGLE-style head and measure it and the shipped heads on MT-Bench "
                        "offline (chain accuracy; written to --json, no head file yet)")
    t.add_argument("--window", type=int, default=None,
                   help="--arch attention: consecutive chain starts taken from each answer in an optimizer step of "
                        "256 (default 16; the answer before them gives their keys)")
    t.add_argument("--layers", type=int, default=1,
                   help="--arch attention: the head's decoder layers (default 1, as EAGLE's; the engine drafts with one)")
    t.add_argument("--checkpoint", default=None,
                   help="--arch attention: write the training state to this file every 10 minutes and after each epoch, "
                        "and go on from it when it exists (a killed run resumes; without --curve)")
    t.add_argument("--answers-per-step", type=int, default=None,
                   help="--arch attention: whole answers per optimizer step instead of windows (with --loss hard, close to "
                        "the recipe before 2026-12-05)")
    t.add_argument("--taps", type=lambda v: [int(x) for x in v.split(",")], default=None,
                   help="layers whose output the heads read too at real positions (EAGLE-3's fusion), e.g. 20,26; "
                        "--prompt-set large, chat or written (shards in their own folder; a shard another folder of the "
                        "cache already answered is copied, or given these taps from its answers when it has other "
                        "taps or none)")
    t.add_argument("--loss", choices=("soft", "hard"), default=None,
                   help="the heads' targets: soft (default), the model's own distribution over the draft "
                        "vocabulary at each position; hard, its argmax alone")
    t.add_argument("--precision", choices=("fp32", "bf16"), default=None,
                   help="the heads' training arithmetic: fp32 (default; the same figures on a rerun here) or bf16 "
                        "(matrix products in bfloat16, about 1.5x faster on CPUs with AVX-512 BF16 or AMX)")
    t.add_argument("--json", default=None,
                   help="measure the heads offline on MT-Bench and write the figures here (with --arch mlp: the data's "
                        "generation, and each --curve point's training time and acceptance; the head of all the data "
                        "is still written to --out)")
    t.add_argument("--mt-bench", type=int, default=80, help="with --json: MT-Bench questions to measure on")
    t.add_argument("--curve", type=lambda v: [int(x) for x in v.split(",")], default=None,
                   help="with --json: also train on the answers to the first N1,N2,... prompts (the curve "
                        "of tokens per verification against training tokens)")
    t.add_argument("--mt-bench-cache", default=os.path.join(".cache", "mtp-mt-bench.pt"),
                   help="with --json: cache of the model's MT-Bench answers")
    t.add_argument("--train-prompts", type=int, default=None,
                   help="train on the answers to the first N prompts of the data only (the rest stays on disk)")
    t.add_argument("--out", default=None, help="output file (default: edge_runtime/data/mtp/<model>.safetensors, "
                   "with --arch attention <model>.attn.safetensors)")
    t.set_defaults(func=lambda a: run_train_mtp(a))
