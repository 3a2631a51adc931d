"""Drafting policies replayed over chains.py's chains under a cost model: a plain step costs 1, a verification
of R rows 1 + s (R - 1), a head step h (all in plain steps). Prints tokens per unit of cost (= the speedup over
plain decoding the model predicts) for fixed k, a confidence threshold tau on the chain's q (the product of the
heads' top probabilities), and the dynamic rule (a draft joins while q * cost > s * tokens, the step's rate);
and the heads' calibration at the first position. Its output: policies.log."""
import numpy as np
import torch

data = torch.load(".cache/confidence-chains.pt")


def run(s, h, k=3, tau=None, lookup=True, heads=True, dynamic=False):
    """Tokens per unit of cost: lookup's chain where it offers one, else the heads' chain, cut at q < tau, or
    (dynamic) where q no longer beats s times the step's tokens per unit of cost so far."""
    tokens = cost = 0.0
    for toks, rec in data:
        n, i = len(toks), 0
        while i < n - 1:
            m = min(k, n - 2 - i)
            lk, hd, ps = rec[i]
            drafts, c = [], 1.0
            if m >= 1 and lookup and lk:
                drafts = lk[:m]
            elif m >= 1 and heads:
                e, q = 1.0, 1.0
                for j in range(m):
                    c += h
                    q *= ps[j]
                    if (tau is not None and q < tau) or (dynamic and q <= s * e / (c + s * len(drafts))):
                        break
                    drafts.append(hd[j])
                    e += q
            a = 0
            while a < len(drafts) and i + 1 + a < n and drafts[a] == toks[i + 1 + a]:
                a += 1
            cost += c + s * len(drafts)
            tokens += a + 1
            i += a + 1
    return tokens / cost


for s in (0.36, 0.25):
    print(f"s={s}: lookup-only {run(s, .09, heads=False):.3f}  heads-only k3 {run(s, .09, lookup=False):.3f}  "
          f"mtp-ngram k3 {run(s, .09):.3f} k2 {run(s, .09, k=2):.3f} k1 {run(s, .09, k=1):.3f}")
    for tau in (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7):
        print(f"   tau {tau}: mtp-ngram k3 {run(s, .09, tau=tau):.3f}  k4 {run(s, .09, k=4, tau=tau):.3f}   "
              f"heads-only {run(s, .09, lookup=False, tau=tau):.3f}")
bins = np.zeros((10, 2))  # calibration of the first draft
for toks, rec in data:
    for i, (lk, hd, ps) in enumerate(rec):
        if i + 1 < len(toks):
            b = min(9, int(ps[0] * 10))
            bins[b, 0] += 1
            bins[b, 1] += hd[0] == toks[i + 1]
print("calibration p1:", [(f"{(b + .5) / 10:.2f}", int(c), round(a / max(c, 1), 2)) for b, (c, a) in enumerate(bins)])
for s in (0.1, 0.25, 0.36):
    print(f"s={s}: k1 {run(s, .09, k=1):.3f} k2 {run(s, .09, k=2):.3f} k3 {run(s, .09):.3f} lookup-only "
          f"{run(s, .09, heads=False):.3f} | tau " + " ".join(f"{t}:{run(s, .09, tau=t):.3f}" for t in (0.1, 0.2, 0.3, 0.4))
          + f" | dynamic k3 {run(s, .09, dynamic=True):.3f} k4 {run(s, .09, k=4, dynamic=True):.3f}")
for s, h in ((0.26, 0.15), (0.26, 0.09), (0.26, 0.05)):
    print(f"s={s} h={h}: lookup-only {run(s, h, heads=False):.3f} k1 {run(s, h, k=1):.3f} dynamic "
          f"{run(s, h, dynamic=True):.3f} tau.3 {run(s, h, tau=.3):.3f} tau.5 {run(s, h, tau=.5):.3f}")
