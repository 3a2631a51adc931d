"""Draft trees (issue 18): several candidate continuations, verified in one pass with tree attention.

A tree's root is the last sampled token; every other node is a drafted token after its parent.
`TreeDrafter.grow` builds it from the MTP head as EAGLE-2's dynamic tree does: level by level, each
frontier node's `width` likeliest next tokens by the head's draft distribution, of which the `width`
likeliest by cumulative probability (the product along the path) become the next frontier; then the
best `size` nodes overall are kept (a child is never likelier than its parent, so they form a tree),
in depth-first order with the likeliest child first (a node's first child comes right after it, so
the rows of one path attend in one pass). `NativeRunner.verify_tree` computes every node's logits in
one pass (`decode_layers_tree`: each node attends over the prefix and its own ancestors), each equal
to the one-token step after that node's path, bit for bit.

Acceptance: the generation loop draws each token from the verified row exactly as plain decoding
does (greedy: the argmax; sampled: the same draw from the same random stream), then moves to the
child holding that token, if there is one. The drafts are deterministic (q one-hot), and for those
the multi-draft rejection scheme (SpecInfer; EAGLE's tree sampling) - keep sibling x with probability
p(x) over the mass not yet rejected, else remove it and try the next - keeps each sibling with
exactly its probability under p and otherwise draws from p without them: the same as one draw from p
compared with every sibling. So the output is plain decoding's, in distribution and (same seed) token
for token. On a miss, or past a leaf, `keep_path` moves the accepted path's K/V onto consecutive
positions and drops every other node, so rejected branches never stay in the KV cache nor reach the
prefix cache.

Size: since drafts are deterministic, a tree's outcome is known once the answer has gone past it -
the accepted path is the longest path of the tree that the answer follows. So each step's candidate
tree (15 nodes ranked by cumulative draft probability, grown only as deep as the size verified can
reach: each level is a head step) is scored for every size at once, against the tokens actually
generated (`TreeGain`), and the next size is the one with the most tokens per second at the measured
verification cost of that many rows (0: a plain step). While no size pays, every `probe_every`-th
step still grows a small candidate tree (not verified, only scored).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch

from edge_runtime.spec.draft_planner import StepCost


@dataclass
class DraftTree:
    tokens: list[int]  # the root (the last sampled token), then the drafts, depth first
    parents: list[int]  # parents[0] = -1
    ranks: list[int]  # each draft's rank by cumulative draft probability (0: likeliest); the root's -1
    children: list[dict[int, int]] = field(default_factory=list)  # node -> {token: child node}

    def __post_init__(self):
        self.children = [{} for _ in self.tokens]
        for i, p in enumerate(self.parents[1:], 1):
            self.children[p][self.tokens[i]] = i

    @property
    def size(self) -> int:
        return len(self.tokens) - 1

    def top(self, n: int) -> "DraftTree":
        """The root and the n best-ranked drafts, in the same order (parents always rank better)."""
        keep = [i for i, r in enumerate(self.ranks) if r < n]
        new = {old: j for j, old in enumerate(keep)}
        return DraftTree([self.tokens[i] for i in keep], [new[self.parents[i]] if i else -1 for i in keep],
                         [self.ranks[i] for i in keep])

    def follow(self, tokens: list[int]) -> list[int]:
        """The nodes of the longest path from the root that `tokens` (what came after the root) follow."""
        node, path = 0, []
        for t in tokens:
            node = self.children[node].get(t)
            if node is None:
                break
            path.append(node)
        return path


class TreeDrafter:
    """An MtpDrafter's heads (or an AttnDrafter's head, through each answer's chain) grown into trees. `fixed_k`
    (set_draft's k) fixes the tree's size in drafts."""
    name = "mtp-tree"
    needs_hidden = True

    def __init__(self, mtp, size: int = 15, width: int = 4, depth: int = 5):
        if not 1 <= size <= 15 or not 1 <= width <= 8 or depth < 1:
            raise ValueError(f"tree size must be 1..15 drafts, width 1..8, depth >= 1; got {size}, {width}, {depth}")
        self.mtp, self.size, self.width, self.depth = mtp, size, width, depth
        self.fixed_k = None

    @torch.inference_mode()
    def grow(self, hidden: torch.Tensor, token: int, size: int, depth: int, head=None,
             lookup: list[int] | None = None) -> DraftTree:
        """The best `size` drafts after `token` (chosen by the hidden state `hidden`), at most `depth` deep.
        `head`: what steps the tree (first_state, head_step, vocab): the MLP heads (default) or the attention
        head's chain of this answer (attn_drafter.AttnChain). `lookup`: prompt lookup's chain, a branch ranked
        before every drafted node (taken as certain: the head's drafts under it score from 0); where the head
        drafts one of its tokens at the same place, that node is the lookup's (no node twice)."""
        head = head if head is not None else self.mtp
        nodes = [(0.0, -1, token)]  # (cumulative log-probability, parent, token); node 0 the root
        at: dict[tuple[int, int], int] = {}  # (parent, token) -> node
        for t in lookup or ():
            at[(len(nodes) - 1, t)] = len(nodes)
            nodes.append((0.0, len(nodes) - 1, t))
        frontier, states = [0], head.first_state(hidden)
        for _ in range(depth):
            states, logits = head.head_step(states, [nodes[i][2] for i in frontier])
            # each row's `width` likeliest tokens and their log-probabilities (numpy: a torch reduction over
            # these few thousand values costs milliseconds of thread wake-ups here)
            lg = logits.numpy()
            w = min(self.width, lg.shape[1])
            idx = np.argpartition(-lg, w - 1, axis=1)[:, :w]
            top = lg.max(axis=1, keepdims=True)
            logp = np.take_along_axis(lg, idx, 1) - (top + np.log(np.exp(lg - top).sum(axis=1, keepdims=True)))
            cands = sorted(((nodes[f][0] + float(logp[r, c]), r, int(idx[r, c])) for r, f in enumerate(frontier)
                            for c in range(w)), key=lambda x: (-x[0], x[1], x[2]))[:self.width]
            rows, frontier_next = [], []
            for score, r, j in cands:
                key = (frontier[r], head.vocab[j])
                if key not in at:
                    at[key] = len(nodes)
                    nodes.append((score, *key))
                frontier_next.append(at[key])
                rows.append(r)
            frontier, states = frontier_next, states[rows]
        # ranks by score; ties go to the earlier node (a parent before its children)
        order = sorted(range(1, len(nodes)), key=lambda i: (-nodes[i][0], i))[:size]
        rank = {i: r for r, i in enumerate(order)}
        kids: dict[int, list[int]] = {}
        for i in sorted(order, key=lambda i: rank[i]):
            kids.setdefault(nodes[i][1], []).append(i)
        seq, stack = [], [0]  # depth first, the likeliest child first
        while stack:
            i = stack.pop()
            seq.append(i)
            stack.extend(reversed(kids.get(i, [])))
        pos = {i: j for j, i in enumerate(seq)}
        return DraftTree([nodes[i][2] for i in seq], [pos[nodes[i][1]] if i else -1 for i in seq],
                         [rank.get(i, -1) for i in seq])


class TreeGain:
    """What trees of each size earn one sequence: `gain[n]`, a running mean of the drafts a tree of its n
    best-ranked nodes would have had accepted, scored against the answer for every n at once (`score`),
    from the candidate trees grown for it (`pending` until the answer has gone past them)."""

    def __init__(self, max_size: int = 15, decay: float = 0.95, prior: "TreeGain | None" = None):
        self.max_size, self.decay = max_size, decay
        # a hopeful prior (trees get tried), or what earlier sequences measured
        self.gain = list(prior.gain) if prior is not None else [0.0] + [0.5] * max_size
        self.pending: list[tuple[DraftTree, int, int]] = []  # (candidate tree, its root's index, its depth)
        self.idle = 0  # steps without drafts (DraftPlanner's probes)
        self.level_seconds, self.depth = 0.0, 5  # a level of growth (one head step) costs; levels at most

    def marginal(self, k: int) -> float:
        """Expected tokens the (k + 1)-th draft adds (DraftPlanner)."""
        return max(0.0, self.gain[k + 1] - self.gain[k]) if k < self.max_size else 0.0

    def expected_tokens(self, k: int) -> float:
        return 1.0 + self.gain[min(k, self.max_size)]

    def draft_cost(self, k: int) -> float:
        """Seconds growing a tree for k drafts takes (as deep as k can reach, a head step a level)."""
        return self.level_seconds * min(k, self.depth)

    def observe_tree(self, ranks: list[int], into: "TreeGain | None" = None) -> None:
        """One candidate tree scored: `ranks` of the nodes on the path the answer followed."""
        for g in (self, into) if into is not None else (self,):
            for n in range(1, g.max_size + 1):
                g.gain[n] = g.decay * g.gain[n] + (1 - g.decay) * sum(r < n for r in ranks)

    def add(self, tree: DraftTree, root: int, depth: int) -> None:
        self.pending.append((tree, root, depth))

    def score(self, tokens: list[int], final: bool = False, into: "TreeGain | None" = None) -> None:
        """Score the pending trees the answer `tokens` (the whole sequence) has gone past."""
        keep = []
        for tree, root, depth in self.pending:
            after = tokens[root + 1:]
            if final or len(after) >= depth:
                self.observe_tree([tree.ranks[i] for i in tree.follow(after[:depth])], into)
            else:
                keep.append((tree, root, depth))
        self.pending = keep


class TreeSpeculator:
    """Draft trees inside the generation loop: the interface of `Speculator` (speculative.py)."""

    def __init__(self, runner, drafter: TreeDrafter):
        self.runner, self.drafter = runner, drafter
        self.gain = TreeGain(drafter.size)
        self.cost = StepCost(16, slope=0.2)  # seconds of a verification of R rows (a plain step: 1)
        self.grow_seconds, self.idle, self.probe_every = 0.0, 0, 8
        self.tree: DraftTree | None = None  # the tree being walked, its rows, where it starts, the path so far
        self.rows = self.hidden_rows = None
        self.pos0, self.path = 0, [0]
        self.hidden = None
        self.steps = self.verify_steps = self.proposed = self.accepted = 0
        self.depth_reached = [0] * 16  # verifications whose path reached depth d + 1
        self.depth_offered = [0] * 16  # verifications whose tree had a node at depth d + 1 on reaching d

    def draft(self) -> None:
        return None  # the loop draws as plain decoding; the tree is walked in next_logits

    def _choose(self, limit: int) -> int:
        """The tree size (drafts) with the most expected tokens per second; 0: a plain step."""
        if self.drafter.fixed_k is not None:
            return min(self.drafter.fixed_k, self.drafter.size) if limit > 0 else 0
        best, best_rate = 0, 1.0 / self.cost(1)
        for n in range(1, self.drafter.size + 1 if limit > 0 else 1):
            rate = self.gain.expected_tokens(n) / (self.cost(n + 1) + self.grow_seconds)
            if rate > best_rate * 1.02:  # a marginal gain is not worth the risk of a noisy estimate
                best, best_rate = n, rate
        return best

    def _close(self) -> None:
        """The walk of the current tree is over: keep its accepted path, drop the rest."""
        if self.tree is None:
            return
        self.runner.keep_path(self.pos0, self.path)
        depth = len(self.path) - 1
        self.accepted += depth
        for d in range(depth + 1):
            node = self.path[d]
            if self.tree.children[node] and d < 16:
                self.depth_offered[d] += 1
                self.depth_reached[d] += d < depth
        self.tree = None

    def next_logits(self, token: int, history: list[int], wanted: int):
        if self.hidden is None:
            self.hidden = self.runner.last_hidden  # from the prefill
        if self.tree is not None:
            child = self.tree.children[self.path[-1]].get(token)
            if child is not None:
                self.path.append(child)
                self.hidden = self.hidden_rows[child]
                return self.rows[child]
            self._close()
        self.gain.score(history)
        room = self.runner.n_ctx - len(history) - 1
        limit = max(0, min(wanted - 1, room, self.drafter.depth))
        n = self._choose(limit)
        self.steps += 1
        self.idle = 0 if n else self.idle + 1
        if n or (limit and self.idle % self.probe_every == 0):  # while none pays, a probe now and then
            depth = min(limit, max(n, 2))  # n drafts reach at most n deep, and each level is a head step
            t0 = time.perf_counter()
            cand = self.drafter.grow(self.hidden, token, self.drafter.size, depth)
            seconds = time.perf_counter() - t0
            self.grow_seconds = seconds if not self.grow_seconds else 0.8 * self.grow_seconds + 0.2 * seconds
            self.gain.add(cand, len(history) - 1, depth)
        if not n:
            t0 = time.perf_counter()
            logits = self.runner.step(token)
            self.cost.observe(1, time.perf_counter() - t0)
            self.hidden = self.runner.hidden_rows[0].clone()
            return logits
        self.tree = cand.top(n)
        self.pos0, self.path = len(self.runner.cached_ids), [0]
        t0 = time.perf_counter()
        out = self.runner.verify_tree(self.tree.tokens, self.tree.parents)
        self.cost.observe(len(self.tree.tokens), time.perf_counter() - t0)
        self.rows, self.hidden_rows = out, self.runner.hidden_rows
        self.hidden = self.hidden_rows[0]
        self.verify_steps += 1
        self.proposed += self.tree.size
        return out[0]

    def finish(self, history: list[int]) -> None:
        """The request is over: the tree's unchecked nodes leave the KV cache too."""
        self._close()
        self.gain.score(history, final=True)

    def stats(self) -> dict:
        per_depth = [self.depth_reached[d] / self.depth_offered[d] for d in range(16) if self.depth_offered[d]]
        return {"drafter": self.drafter.name, "steps": self.steps, "verify_steps": self.verify_steps,
                "proposed": self.proposed, "accepted": self.accepted,
                "mean_accepted": (self.accepted / self.verify_steps + 1.0) if self.verify_steps else 0.0,
                "acceptance_per_position": per_depth, "tree_size": self._choose(self.drafter.depth),
                "gain_by_size": [round(g, 3) for g in self.gain.gain]}
