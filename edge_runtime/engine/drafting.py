"""Speculative decoding inside the batch engine: drafts as extra rows of the step.

After the scheduler picks a step, `StepDrafter.add` gives decode chunks drafts: each job's
proposer (n-gram prompt lookup, one index per job; or the shared MTP heads, which read the
hidden state that chose the job's last token) offers up to 7 tokens, `DraftPlanner` decides how
many of them each sequence carries so the step's expected tokens per second is highest, and the
scheduler puts them in lookahead slots. The runner computes them as rows after their sequence's
decode token (every row exactly a one-token step: `decode_layers_batch` stores every row's K/V
before any row attends, and row p attends over positions 0..p only). The engine then samples
row by row, each token exactly as plain decoding would (the same sampler, history and random
draws), while the sampled token equals the next draft; the scheduler truncates the rest. So
greedy output is unchanged bit for bit and a seeded sample draws the same tokens (sampler.py:
for a deterministic drafter, drawing and comparing is the rejection test).

With "mtp-tree" a sequence's drafts are a tree (spec/tree.py: the heads' likeliest continuations, grown
level by level): its nodes are the rows after the decode token, each attending over its own ancestors
(`decode_layers_batch_tree`), and sampling walks from the root to the child holding each token drawn
(`draft_children`); the accepted path's K/V then move onto the first lookahead slots (`keep_tree_path`)
and everything else is truncated as a rejected chain would be. The planner sizes each tree by what
trees of each size would have earned the sequence so far (`TreeGain`, scored against its answer).
"mtp-ngram" (what `--draft auto` runs where only the MLP heads ship) gives each sequence prompt lookup's chain
where its last two tokens or more match earlier ones, else the heads' chain (speculative.py
`LookupThenHeads`), each with an acceptance estimate of its own. "mtp-attn" and "mtp-attn-ngram" (`auto` where
it ships) are "mtp" and "mtp-ngram" with the attention head (spec/attn_drafter.py): each job then drafts from
its own `AttnChain`, which the engine feeds every sampled token with the features of the row that chose it
(`JobDrafts.feed`). That head drafts before the planner decides, every such job's chain of the step in one
call (`AttnDrafter.draft_many`): each chain stops where the product of its drafts' probabilities falls below
what a row must earn (`DraftPlanner.floor`), and the planner keeps as many as pay by those probabilities
(`Confidence`; the head is calibrated, docs/speculative.md), where the MLP heads' k comes from a running
acceptance estimate (a fixed k, as `bench spec --draft-k` measures acceptance, drafts exactly k from either).
"mtp-attn-tree" grows "mtp-tree"'s trees from that chain, and "mtp-attn-ngram-tree" adds prompt lookup's chain
to each tree as a branch where the last two tokens match (`TreeDrafter.grow`'s `lookup`).

It knows nothing about requests, text or the model's arithmetic.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from edge_runtime.spec.draft_planner import Acceptance, Confidence, DraftPlanner
from edge_runtime.spec.speculative import LookupThenHeads, NgramProposer
from edge_runtime.spec.tree import TreeDrafter, TreeGain

DRAFTS = ("none", "ngram", "mtp", "mtp-ngram", "mtp-tree", "mtp-attn", "mtp-attn-ngram", "mtp-attn-tree",
          "mtp-attn-ngram-tree")
TREES = ("mtp-tree", "mtp-attn-tree", "mtp-attn-ngram-tree")
MAX_DRAFTS = 7  # a chain's; a tree's: 15 (16 rows a call)


def draft_children(drafts: list[int], parents: list[int] | None) -> list[dict[int, int]]:
    """Per row of a decode chunk (row 0 its token, row i its draft i - 1): {token: the row after it}."""
    parents = parents or [-1] + list(range(len(drafts)))
    children: list[dict[int, int]] = [{} for _ in parents]
    for i in range(1, len(parents)):
        children[parents[i]].setdefault(drafts[i - 1], i)
    return children


def move_path(blocks, kv, seq_id, start: int, path: list[int], tokens: list[int]) -> None:
    """A verified tree's accepted path (its nodes, the root first, computed at positions start + node) onto
    positions start..: their K/V copied there (`PagedKVCache.copy_slots`) and the block manager told their
    `tokens`; the caller then truncates what lies after, as for a rejected chain."""
    slots = blocks.slots(seq_id, start, start + max(path) + 1)
    kv.copy_slots([slots[n] for n in path], slots[:len(path)])
    blocks.rewrite(seq_id, start, tokens)


def keep_tree_path(blocks, kv, chunk, path: list[int]) -> None:
    """A tree chunk's accepted path (rows, the root first) onto positions chunk.start..; the chunk's drafts
    become the path's, so it updates as a chain would."""
    drafts = [chunk.drafts[r - 1] for r in path[1:]]
    move_path(blocks, kv, chunk.seq.seq_id, chunk.start, path, chunk.token_ids[:1] + drafts)
    chunk.drafts, chunk.parents = drafts, None


def tree_depth(parents: list[int] | None, num_drafts: int) -> int:
    """How deep a chunk's drafts go (a chain: its length)."""
    if not parents:
        return num_drafts
    depth = [0] * len(parents)
    for i in range(1, len(parents)):
        depth[i] = depth[parents[i]] + 1
    return max(depth)


@dataclass(eq=False)
class JobDrafts:
    """One job's drafting state: its chain proposer (prompt lookup or the heads; None for trees only), the
    chains' acceptance estimate, its trees' gains (`TreeGain`, when it grows trees), the heads' chains' own
    estimate where they stand in for prompt lookup ("mtp-ngram") and counters."""
    proposer: object
    acceptance: Acceptance = field(default_factory=Acceptance)
    tree: TreeGain | None = None
    heads: Acceptance | None = None
    chain: object = None  # the attention head's chain of this job (AttnChain), where that head drafts
    last_tree: bool = False  # whether its last drafts were a tree
    last_heads: bool = False  # whether its last drafts were the heads' chain (only where `heads` is set)
    steps: int = 0  # decode steps it took part in
    verify_steps: int = 0  # of which carried drafts
    proposed: int = 0
    accepted: int = 0
    pos_proposed: list[int] = field(default_factory=lambda: [0] * 8)
    pos_accepted: list[int] = field(default_factory=lambda: [0] * 8)

    @property
    def feed(self):
        """Where the engine sends each sampled token with its row's features (the attention head's chain), or None."""
        return self.chain.feed if self.chain is not None else None

    def observe(self, proposed: int, accepted: int, depth: int | None = None) -> None:
        """`accepted` of `proposed` drafts; `depth`: how deep they went (a chain: `proposed`)."""
        self.steps += 1
        if not proposed:
            return
        if not self.last_tree:  # trees learn from scoring every size against the answer (TreeGain)
            (self.heads if self.last_heads else self.acceptance).observe(proposed, accepted)
        self.verify_steps += 1
        self.proposed += proposed
        self.accepted += accepted
        for i in range(min(8, proposed if depth is None else depth)):
            self.pos_proposed[i] += 1
            self.pos_accepted[i] += i < accepted

    def stats(self, method: str) -> dict:
        per_pos = [a / p for a, p in zip(self.pos_accepted, self.pos_proposed) if p]
        return {"drafter": method, "steps": self.steps, "verify_steps": self.verify_steps,
                "proposed": self.proposed, "accepted": self.accepted,
                "mean_accepted": self.accepted / self.verify_steps + 1.0 if self.verify_steps else 0.0,
                "acceptance_per_position": per_pos, "alpha": self.acceptance.alpha,
                "pos_proposed": list(self.pos_proposed), "pos_accepted": list(self.pos_accepted)}


class StepDrafter:
    size_by_confidence = True  # the attention head's chains sized by its probabilities (False: the running estimate)

    def __init__(self, method: str, max_rows: int, mtp=None, fixed_k: int | None = None):
        """method: "ngram", "mtp", "mtp-ngram" (prompt lookup where the last two tokens or more match, else the
        heads' chain), "mtp-tree" (with `mtp`, an MtpDrafter, for all but "ngram") or "mtp-attn" (`mtp`: an
        AttnDrafter; "mtp-attn-ngram", "mtp-attn-tree": "mtp-ngram", "mtp-tree" with it; "mtp-attn-ngram-tree":
        its trees with prompt lookup's chain as a branch); fixed_k: always that many drafts when the proposer has
        them (for measuring acceptance at a given k), else the planner decides."""
        if method not in DRAFTS[1:]:
            raise ValueError(f"the batch engine drafts with {' or '.join(DRAFTS)}, not {method!r}")
        if method != "ngram" and mtp is None:
            raise ValueError("MTP drafting needs the MTP heads")
        attn = method.startswith("mtp-attn")
        if mtp is not None and attn != hasattr(mtp, "new_chain"):
            raise ValueError(f"{method} drafts with " + ("the attention head (AttnDrafter)" if attn else
                                                          "the MLP heads (MtpDrafter)"))
        # prompt lookup first, the heads' chain elsewhere (with trees: lookup's chain a branch of the tree)
        self.lookup = method != "ngram" and "ngram" in method
        self.method, self.mtp, self.fixed_k = method, mtp, fixed_k
        self.tree = TreeDrafter(mtp, size=min(15, max_rows - 1)) if method in TREES else None
        most = self.tree.size if self.tree else MAX_DRAFTS
        if fixed_k is not None and not 1 <= fixed_k <= most:
            raise ValueError(f"{method} drafts 1 to {most} tokens a step, not {fixed_k}")
        self.planner = DraftPlanner(max_rows, k_max=self.tree.size if self.tree else min(MAX_DRAFTS, max_rows - 1))
        # acceptance over every job so far: where a new job's estimate starts (a short answer would
        # otherwise spend its few steps paying for drafts a fixed 0.5 guess offered); trees' gains likewise
        self.prior = Acceptance(decay=0.98)
        self.heads_prior = Acceptance(decay=0.98)  # the heads' chains, where lookup has its own ("mtp-ngram")
        self.tree_prior = TreeGain(self.tree.size, decay=0.98) if self.tree else None
        self.head_seconds = 0.0  # a head step (one level of a tree, one draft of a chain), measured

    def new_job(self) -> JobDrafts:
        attn = self.mtp.new_chain() if hasattr(self.mtp, "new_chain") else None  # the attention head's
        tree = TreeGain(self.tree.size, prior=self.tree_prior) if self.tree else None
        if self.lookup:
            return JobDrafts(NgramProposer(min_n=LookupThenHeads.LOOKUP_MIN_N), Acceptance(alpha=self.prior.alpha),
                             tree, heads=None if tree else Acceptance(alpha=self.heads_prior.alpha), chain=attn)
        proposer = (None if self.method in TREES else NgramProposer() if self.method == "ngram"
                    else attn or self.mtp)
        return JobDrafts(proposer, Acceptance(alpha=self.prior.alpha), tree, chain=attn)

    def observe(self, drafts: JobDrafts, proposed: int, accepted: int, depth: int | None = None) -> None:
        """One decode step of a job: `accepted` of its `proposed` drafts were taken."""
        drafts.observe(proposed, accepted, depth)
        if not drafts.last_tree:
            (self.heads_prior if drafts.last_heads else self.prior).observe(proposed, accepted)

    def _head_time(self, seconds: float, steps: int) -> None:
        per = seconds / max(1, steps)
        self.head_seconds = per if not self.head_seconds else 0.8 * self.head_seconds + 0.2 * per

    def add(self, scheduler, out, jobs: list, n_ctx: int, budget: int) -> None:
        """Give the step's decode chunks drafts. jobs[i]: the job of out.chunks[i] (None when gone);
        budget: rows the step may still add."""
        decodes = [(c, j) for c, j in zip(out.chunks, jobs)
                   if j is not None and not j.done and c.samples and c.end - c.start == 1]
        # (chunk, job, what prompt lookup or the attention head offers, or the room left; its estimate)
        cands, limits, asks = [], [], []
        lookups = {}  # chunk -> prompt lookup's chain, a branch of its tree
        for chunk, job in decodes:
            d = job.drafts
            if d.tree is not None:  # score its earlier trees against what it has generated since
                d.tree.score(chunk.seq.token_ids, into=self.tree_prior)
            # drafts past the answer's budget or the context would never be used
            room = min(job.completion.room - 1, n_ctx - chunk.seq.num_tokens - 1, self.planner.k_max)
            if room < 1:
                continue
            offer = d.proposer.propose(chunk.seq.token_ids, min(room, MAX_DRAFTS)) \
                if isinstance(d.proposer, NgramProposer) else None
            if offer and d.tree is None:  # free to ask: plan with what it offers
                cands.append((chunk, job, offer, d.acceptance))
                limits.append(len(offer))
            elif d.tree is not None and job.hidden is not None:  # a tree: plan first, then grow it
                d.tree.level_seconds = self.head_seconds
                lookups[id(chunk)] = offer
                cands.append((chunk, job, room, d.tree))
                limits.append(self.tree.size)
            elif self.method not in ("ngram",) + TREES and job.hidden is not None and d.chain is not None \
                    and not self.fixed_k and self.size_by_confidence:  # drafted first, sized by its confidence
                asks.append((len(cands), min(room, MAX_DRAFTS)))  # every such chain below, in one call
                cands.append((chunk, job, None, None))
                limits.append(0)
            elif self.method not in ("ngram",) + TREES and job.hidden is not None:  # a head step per draft
                est = d.heads or d.acceptance
                est.step_seconds = self.head_seconds
                cands.append((chunk, job, room, est))
                limits.append(min(room, MAX_DRAFTS))
        if asks:
            self._ask_chains(cands, limits, asks, len(decodes))
        if not cands:
            return
        if self.fixed_k:
            ks = [min(self.fixed_k, limit) for limit in limits]
        else:
            ks = self.planner.plan([est for *_, est in cands], limits, other_rows=len(decodes) - len(cands))
        for (chunk, job, offer, est), k in zip(cands, ks):
            if isinstance(est, Confidence):
                (job.drafts.heads or job.drafts.acceptance).idle = est.idle
            if k <= 0 or budget <= 0:
                continue
            k = min(k, budget)
            t0 = time.perf_counter()
            if est is job.drafts.tree:
                depth = min(self.tree.depth, offer, k)  # offer: the room left; k drafts reach at most k deep
                lookup = (lookups[id(chunk)] or [])[:k]
                # from this answer's chain where the attention head drafts (None: the MLP heads)
                cand = self.tree.grow(job.hidden, chunk.seq.token_ids[-1], self.tree.size, depth, job.drafts.chain,
                                      lookup)
                self._head_time(time.perf_counter() - t0, depth)
                est.add(cand, chunk.seq.num_tokens - 1, max(depth, len(lookup)))
                tree = cand.top(k)
                drafts, parents = tree.tokens[1:], tree.parents
            elif isinstance(offer, list):
                drafts, parents = offer[:k], None
            else:
                heads = job.drafts.chain or self.mtp
                drafts, parents = heads.propose(chunk.seq.token_ids, k, job.hidden)[:k], None
                # the attention head's chain: its steps alone (the rows fed go into its cache whatever k is)
                if drafts:
                    self._head_time(self.mtp.chain_seconds if job.drafts.chain else time.perf_counter() - t0, k)
            if drafts and scheduler.add_drafts(chunk, drafts, parents):
                budget -= len(drafts)
                job.drafts.last_tree = parents is not None
                heads = job.drafts.heads
                job.drafts.last_heads = heads is not None and (est is heads or isinstance(est, Confidence))

    def _ask_chains(self, cands: list, limits: list, asks: list, sequences: int) -> None:
        """The attention head's chains of the jobs at cands[i] for (i, room) in `asks`, all in one call
        (`AttnDrafter.draft_many`), each stopping where its probability falls below what a row must earn."""
        floor = self.planner.floor(sequences, self.head_seconds)
        chains = [cands[i][1].drafts.chain for i, _ in asks]
        made = self.mtp.draft_many(chains, [room for _, room in asks], floor)
        if any(made):  # a draft's share of the call (its steps carry every chain still going)
            self._head_time(self.mtp.chain_seconds, sum(len(d) for d in made))
        for (i, _), chain, drafts in zip(asks, chains, made):
            chunk, job, *_ = cands[i]
            # the job's idle count goes with it, so the planner's probes reach a chain it keeps declining
            idle = (job.drafts.heads or job.drafts.acceptance).idle
            cands[i] = (chunk, job, drafts, Confidence(chain.probs, idle=idle))
            limits[i] = len(drafts)

    def observe_step(self, rows: int, seconds: float, sequences: int | None = None) -> None:
        if rows:
            self.planner.cost.observe(rows, seconds, sequences)
