"""Drafting inside the batch engine: speculative decoding for a sequence that runs alone.

When the engine's batch holds one sequence and nothing waits, a step verifies that
sequence's n-gram drafts instead of decoding one token: the same `Speculator` the
single-stream loop uses, driven over the sequence's own blocks (`SequenceRunner`), each
verification through the fused decoder's `step_chunk`, whose rows are bit for bit
one-token steps. So greedy output is unchanged, and so is a seeded sample: the n-gram
drafter is deterministic, and the sampler then draws exactly as plain decoding does
(sampler.py). As soon as a second sequence runs or waits, drafting stops (`leave`): the
sequence's drafts and its last token leave the cache and it rejoins the batch as a plain
decode, which recomputes that token with the same bits. The draft length adapts as in
the single-stream loop (`DraftLength`: measured acceptance and cost, down to plain steps
when drafting does not pay). Only one sequence at a time drafts: with two or more, the
step's rows are already shared and a verification's extra rows would compete with them.
"""
from __future__ import annotations

from edge_runtime.spec.speculative import NgramProposer, Speculator

DRAFTS = ("none", "ngram")


class NoRoom(Exception):
    """The KV cache has no block for the drafts: the step decodes plainly instead."""


class SequenceRunner:
    """The runner protocol `Speculator` drives (step, verify, keep, n_ctx), over one engine sequence."""

    def __init__(self, engine, job):
        self.engine, self.job = engine, job

    @property
    def n_ctx(self) -> int:
        return self.engine.n_ctx

    def verify(self, token_ids: list[int]):
        """Logits fp32 [T, vocab] of the sequence's next token (token_ids[0], sampled and not yet computed)
        and drafts after it; they stay provisional until `keep`."""
        seq, blocks = self.job.seq, self.engine.blocks
        pos0 = seq.num_computed
        assert pos0 == seq.num_tokens - 1 and token_ids[0] == seq.token_ids[-1], (pos0, seq.num_tokens)
        if not blocks.append(seq.seq_id, seq.token_ids[blocks.num_tokens(seq.seq_id):] + list(token_ids[1:])):
            blocks.truncate(seq.seq_id, pos0)
            raise NoRoom
        with self.engine.step_lock:
            out = self.engine.model.fused.step_chunk(list(token_ids), pos0, blocks.block_table(seq.seq_id))
        seq.num_computed = pos0 + len(token_ids)
        return out

    def step(self, token_id: int):
        return self.verify([token_id])[0]

    def keep(self, num_tokens: int) -> None:
        """The first `num_tokens` tokens are the sequence's (prompt and accepted): the rest leave the cache."""
        seq, blocks = self.job.seq, self.engine.blocks
        blocks.truncate(seq.seq_id, num_tokens)
        blocks.commit(seq.seq_id, num_tokens)  # evaluated and accepted: cacheable
        seq.num_computed = num_tokens


class LoneDrafting:
    """One job's drafting state: its Speculator and the logits of its next position, once computed."""

    def __init__(self, engine, job):
        self.runner = SequenceRunner(engine, job)
        self.spec = Speculator(self.runner, NgramProposer())
        self.logits = None  # after the job's last token, when that token's K/V are in (drafting under way)

    def run(self, job, emit) -> int:
        """One engine step for a job running alone: compute once (a verification or a plain step) and emit
        what it decides. Returns the rows computed (0: nothing could be computed, NoRoom raised through)."""
        seq, params = job.seq, job.request.params
        rows_before = self.spec.proposed + self.spec.steps
        if self.logits is None:  # entering: the last sampled token is not computed yet
            self.logits = self.spec.next_logits(seq.token_ids[-1], seq.token_ids, params.max_tokens - len(job.generated))
            return self.spec.proposed + self.spec.steps - rows_before
        while True:
            token = job.sampler.sample(self.logits, seq.token_ids, draft=self.spec.draft())
            seq.token_ids.append(token)
            emit(job, token)
            if job.done:
                return self.spec.proposed + self.spec.steps - rows_before
            steps = self.spec.steps
            self.logits = self.spec.next_logits(token, seq.token_ids, params.max_tokens - len(job.generated))
            if self.spec.steps != steps:  # it computed: one computation per engine step
                return self.spec.proposed + self.spec.steps - rows_before

    def leave(self, job) -> None:
        """Back to plain batched decoding: keep every token but the last sampled one, whose K/V (and every
        draft's) leave the cache; the batch computes it next, with the same bits."""
        if self.logits is not None or self.spec.queue:
            self.runner.keep(job.seq.num_tokens - 1)
        self.logits, self.spec.queue = None, []
        self.spec._close_verification()
