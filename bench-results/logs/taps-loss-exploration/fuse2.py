"""Does fusing low/mid layer features into the MLP head's first step raise its chain accuracy? (in-domain held-out)"""
import sys, math, random, time, json, torch
import torch.nn.functional as F
from torch import nn
torch.set_num_threads(int(sys.argv[2]) if len(sys.argv) > 2 else 1)
from edge_runtime.backends.native import NativeBackend
from edge_cli.mtp_data import load_shards
from edge_cli.train_mtp import draft_vocabulary, embedding_table, accuracy, trainable, expected_accepted
from edge_runtime.spec.mtp import MtpHead, _rms
variant = sys.argv[1]  # "final" or comma list of layers, e.g. "2,14"
P = int(sys.argv[3]) if len(sys.argv) > 3 else 782
EPOCHS = int(sys.argv[4]) if len(sys.argv) > 4 else 4
LOSS = sys.argv[5] if len(sys.argv) > 5 else "hard"
HID = int(sys.argv[6]) if len(sys.argv) > 6 else 1024
backend = NativeBackend(model="default", threads=1, n_ctx=1024, kv_budget="1GiB")
cfg = backend.model.cfg
data = load_shards("/root/.cache/edge-runtime/mtp-large-4000")
recs = data["records"][:P]
fd = torch.load(f"/work/mtpdata/diag/feat-{P}.pt")
layers = [] if variant == "final" else [int(x) for x in variant.split(",")]
items = list(zip(recs, fd["feats"]))
random.Random(0).shuffle(items)
held, train_items = items[:len(items) // 20], items[len(items) // 20:]
vocab, index, cov = draft_vocabulary([r for r, _ in train_items], cfg.vocab_size, 4096)
emb = embedding_table(backend)
rows = emb[vocab].contiguous()
depth = 4
ALL = []
def ex(items):
    H, X, T, I = [], [], [], []
    base = sum(len(a) for a in ALL)
    for r, f in items:
        n = len(r["tokens"])
        if n < 2: continue
        pad = torch.cat([r["tokens"], torch.zeros(depth, dtype=torch.long)])
        g = torch.cat([index[r["greedy"]], torch.full((depth + 1,), -100, dtype=torch.long)])
        i = torch.arange(n - 1)
        H.append(torch.cat([r["hidden"][:n - 1].float()] + [f[L][:n - 1].float() for L in layers], -1))
        X.append(torch.stack([pad[i + j] for j in range(depth)], 1))
        T.append(torch.stack([g[i + j + 1] for j in range(depth)], 1))
        ALL.append(r["hidden"])
        ii = torch.stack([i + j + 1 for j in range(depth)], 1)
        I.append(torch.where(ii < n, ii + base, torch.full_like(ii, -1)))
        base += n
    return torch.cat(H), torch.cat(X), torch.cat(T), torch.cat(I)
h, x, t, ti = ex(train_items); hv, xv, tv, _ = ex(held)
HALL = torch.cat([torch.cat(ALL).float(), torch.zeros(1, cfg.dim)])
class Fused(nn.Module):
    def __init__(self):
        super().__init__()
        self.head = MtpHead(cfg.dim, HID, vocab, cfg.norm_eps, depth)
        k = 1 + len(layers)
        self.g = nn.Parameter(torch.ones(k, cfg.dim))
        self.w = nn.Linear(k * cfg.dim, cfg.dim, bias=False) if layers else None
        if self.w is not None:
            nn.init.zeros_(self.w.weight); 
            with torch.no_grad(): self.w.weight[:, :cfg.dim] = torch.eye(cfg.dim)
    def logits(self, H, X):
        if self.w is not None:
            parts = H.view(len(H), -1, cfg.dim)
            H = self.w((_rms(parts, cfg.norm_eps) * self.g).flatten(1))
        out = []
        for j in range(X.shape[1]):
            H = self.head(H, emb[X[:, j]])
            out.append(H)
        self.states = torch.stack(out, 1)
        return self.states @ rows.T
m = Fused()
opt = torch.optim.AdamW(m.parameters(), lr=2e-3, weight_decay=0.01)
B = 256; steps = EPOCHS * math.ceil(len(h) / B)
sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 100) * 0.5 * (1 + math.cos(math.pi * s / steps)))
def acc(H, X, T):
    right = torch.zeros(depth); seen = torch.zeros(depth)
    with torch.no_grad():
        for s in range(0, len(H), 2048):
            p = m.logits(H[s:s+2048], X[s:s+2048]).argmax(-1); tt = T[s:s+2048]
            alive = torch.ones(len(tt), dtype=torch.bool)
            for j in range(depth):
                alive &= tt[:, j] != -100; seen[j] += alive.sum(); alive &= p[:, j] == tt[:, j]; right[j] += alive.sum()
    return [round(float(right[j] / seen[j]), 4) for j in range(depth)]
torch.manual_seed(0); t0 = time.time()
for e in range(EPOCHS):
    order = torch.randperm(len(h))
    for s in range(0, len(h), B):
        i = order[s:s+B]
        lg = m.logits(h[i], x[i])
        if LOSS == "hard":
            loss = sum(0.8 ** j * F.cross_entropy(lg[:, j], trainable(t[i, j]), ignore_index=-100) for j in range(depth))
        else:
            idx = ti[i]; ok = idx >= 0
            true = HALL[idx]  # [b, depth, dim]
            p = torch.softmax(true @ rows.T, -1)
            ce = -(p * F.log_softmax(lg, -1)).sum(-1)  # [b, depth]
            w = torch.tensor([0.8 ** j for j in range(depth)])
            loss = ((ce * ok) .sum(0) / ok.sum(0).clamp(min=1) * w).sum()
            if LOSS == "soft+reg":
                reg = F.smooth_l1_loss(m.states, true, reduction="none").mean(-1)
                loss = 0.1 * loss + ((reg * ok).sum(0) / ok.sum(0).clamp(min=1) * w).sum()
            if LOSS == "soft+hard":
                loss = loss + sum(0.8 ** j * F.cross_entropy(lg[:, j], trainable(t[i, j]), ignore_index=-100) for j in range(depth))
        opt.zero_grad(); loss.backward(); opt.step(); sched.step()
    a = acc(hv, xv, tv)
    print(variant, LOSS, HID, "epoch", e + 1, a, round(expected_accepted(a, 3), 4), round(time.time() - t0), flush=True)
