"""What growing a draft tree from the attention head costs, against its C chain (`--draft mtp-attn-tree`).

The shipped attention head on this machine's kernels, its cache holding 150 answer positions (random features:
the cost does not depend on the values). Times, in ms, the mean of 50 calls after one warm-up: a C chain of 4
drafts and of 1 (`attn_head_chain`, one call), and trees of 15 drafts grown 1, 3 and 5 levels deep
(`TreeDrafter.grow` over `AttnChain.head_step`, up to 4 frontier rows a level), each level one C call
(`attn_head_tree_level`) or torch on the same Q8 matrices (`tree_step`'s fallback).

    OMP_WAIT_POLICY=PASSIVE .venv/bin/python scripts/attn_tree_grow_time.py
"""
from __future__ import annotations

import time

import torch

from edge_runtime.backends.native import NativeBackend
from edge_runtime.spec.attn_drafter import AttnDrafter
from edge_runtime.spec.tree import TreeDrafter


def mean_ms(f, n: int = 50) -> float:
    f()
    t0 = time.perf_counter()
    for _ in range(n):
        f()
    return (time.perf_counter() - t0) / n * 1e3


def main() -> None:
    drafter = AttnDrafter.for_backend(NativeBackend())
    torch_levels = AttnDrafter(drafter.head, drafter.embed, c_step=False)
    if drafter.lib is None:
        raise SystemExit("the C kernels do not run here: nothing to compare")
    torch.manual_seed(0)
    feats = torch.randn(150, (1 + len(drafter.taps)) * drafter.dim)
    tokens = torch.randint(0, 1000, (150,)).tolist()
    chains = []
    for d in (drafter, torch_levels):
        chains.append(d.new_chain())
        for h, t in zip(feats, tokens):
            chains[-1].feed(h, t)
        chains[-1].propose(tokens, 1)  # the rows into the cache
    chain = chains[0]
    print(f"C chain, 4 drafts: {mean_ms(lambda: chain.propose(tokens, 4)):.3f} ms")
    print(f"C chain, 1 draft:  {mean_ms(lambda: chain.propose(tokens, 1)):.3f} ms")
    for name, d, ch in (("C", drafter, chains[0]), ("torch", torch_levels, chains[1])):
        trees = TreeDrafter(d)
        for depth in (1, 3, 5):
            ms = mean_ms(lambda: trees.grow(None, tokens[-1], 15, depth, head=ch))
            print(f"tree of 15, {depth} level{'s' if depth > 1 else ''}, {name} levels: {ms:.3f} ms "
                  f"({ms / depth:.3f} a level)")


if __name__ == "__main__":
    main()
