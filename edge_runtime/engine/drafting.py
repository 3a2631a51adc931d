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

It knows nothing about requests, text or the model's arithmetic.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from edge_runtime.spec.draft_planner import Acceptance, DraftPlanner
from edge_runtime.spec.speculative import NgramProposer

DRAFTS = ("none", "ngram", "mtp")
MAX_DRAFTS = 7


@dataclass(eq=False)
class JobDrafts:
    """One job's drafting state: its proposer, acceptance estimate and counters."""
    proposer: object
    acceptance: Acceptance = field(default_factory=Acceptance)
    steps: int = 0  # decode steps it took part in
    verify_steps: int = 0  # of which carried drafts
    proposed: int = 0
    accepted: int = 0
    pos_proposed: list[int] = field(default_factory=lambda: [0] * 8)
    pos_accepted: list[int] = field(default_factory=lambda: [0] * 8)

    def observe(self, proposed: int, accepted: int) -> None:
        self.steps += 1
        if not proposed:
            return
        self.acceptance.observe(proposed, accepted)
        self.verify_steps += 1
        self.proposed += proposed
        self.accepted += accepted
        for i in range(proposed):
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
    def __init__(self, method: str, max_rows: int, mtp=None, fixed_k: int | None = None):
        """method: "ngram" or "mtp" (with `mtp`, an MtpDrafter); fixed_k: always that many drafts when
        the proposer has them (for measuring acceptance at a given k), else the planner decides."""
        if method not in DRAFTS[1:]:
            raise ValueError(f"the batch engine drafts with {' or '.join(DRAFTS)}, not {method!r}")
        if method == "mtp" and mtp is None:
            raise ValueError("MTP drafting needs the MTP heads")
        self.method, self.mtp, self.fixed_k = method, mtp, fixed_k
        self.planner = DraftPlanner(max_rows, k_max=min(MAX_DRAFTS, max_rows - 1))
        # acceptance over every job so far: where a new job's estimate starts (a short answer would
        # otherwise spend its few steps paying for drafts a fixed 0.5 guess offered)
        self.prior = Acceptance(decay=0.98)

    def new_job(self) -> JobDrafts:
        return JobDrafts(NgramProposer() if self.method == "ngram" else self.mtp,
                         Acceptance(alpha=self.prior.alpha))

    def observe(self, drafts: JobDrafts, proposed: int, accepted: int) -> None:
        """One decode step of a job: `accepted` of its `proposed` drafts were taken."""
        drafts.observe(proposed, accepted)
        self.prior.observe(proposed, accepted)

    def _propose(self, job, k: int) -> list[int]:
        if self.method == "ngram":
            return job.drafts.proposer.propose(job.seq.token_ids, k)[:k]
        return self.mtp.propose(job.seq.token_ids, k, job.hidden)[:k] if job.hidden is not None else []

    def add(self, scheduler, out, jobs: list, n_ctx: int, budget: int) -> None:
        """Give the step's decode chunks drafts. jobs[i]: the job of out.chunks[i] (None when gone);
        budget: rows the step may still add."""
        decodes = [(c, j) for c, j in zip(out.chunks, jobs)
                   if j is not None and not j.done and c.samples and c.end - c.start == 1]
        cands, limits = [], []
        for chunk, job in decodes:
            # drafts past the answer's budget or the context would never be used
            room = min(job.completion.room - 1, n_ctx - chunk.seq.num_tokens - 1, self.planner.k_max)
            if room < 1:
                continue
            if self.method == "ngram":  # free to ask: plan with what it offers
                offer = self._propose(job, room)
                if offer:
                    cands.append((chunk, job, offer))
                    limits.append(len(offer))
            else:  # the heads cost a step each: plan first, then ask for that many
                cands.append((chunk, job, None))
                limits.append(room)
        if not cands:
            return
        if self.fixed_k:
            ks = [min(self.fixed_k, limit) for limit in limits]
        else:
            ks = self.planner.plan([job.drafts.acceptance for _, job, _ in cands], limits,
                                   other_rows=len(decodes) - len(cands))
        for (chunk, job, offer), k in zip(cands, ks):
            if k <= 0 or budget <= 0:
                continue
            drafts = (offer if offer is not None else self._propose(job, k))[:min(k, budget)]
            if scheduler.add_drafts(chunk, drafts):
                budget -= len(drafts)

    def observe_step(self, rows: int, seconds: float, sequences: int | None = None) -> None:
        if rows:
            self.planner.cost.observe(rows, seconds, sequences)
