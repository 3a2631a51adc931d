"""Continuous batching: which sequences run in the next forward step, and how many tokens each.

Iteration-level scheduling over the paged KV cache (Orca, vLLM): every step
the running sequences each get their next piece of work (a decode token, or
the next chunk of a prompt), then waiting sequences are admitted while the
step's token budget, the batch size and the free KV blocks allow. A sequence
that finishes leaves at once and its slot goes to the next waiting one.

- Priority: `interactive` (0) before `batch` (1); first come, first served
  within a priority. A waiting sequence that does not fit blocks the ones
  behind it (no overtaking, so a long prompt is never starved).
- Chunked prefill: a prompt is evaluated in chunks whose boundaries are fixed
  multiples of `chunk_size` in the sequence's positions, whatever else runs in
  the step. With the model runner's batch-invariant kernels this makes a
  sequence's logits independent of what it was batched with.
- Preemption by recompute: when a running sequence needs a block and none is
  free, the latest admitted sequence (batch priority first) gives its blocks
  back and returns to the queue with its tokens so far; on readmission the
  prefix cache usually still holds its full blocks.
- Prefix sharing: admission goes through `BlockManager.allocate`, so a prompt
  that starts with cached full blocks only computes the rest.
- Held sequences (a client not reading its stream) keep their blocks but are
  not scheduled until released.
- Drafts: after `schedule()`, a decode chunk may carry draft tokens (`add_drafts`)
  in lookahead slots; `update()` keeps the accepted ones and truncates the rest, so
  only verified tokens are ever committed to the prefix cache.

Pure Python: no torch, no model. The engine calls `schedule()`, runs the chunks,
then `update()` with what was computed and sampled.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from enum import Enum

from edge_runtime.engine.block_manager import BlockManager

INTERACTIVE, BATCH = 0, 1


class Status(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """One request's tokens as the scheduler sees them (prompt, then generated)."""
    seq_id: int
    token_ids: list[int]
    num_prompt_tokens: int
    priority: int = INTERACTIVE
    arrival: int = 0  # set by Scheduler.add: FCFS order
    status: Status = Status.WAITING
    num_computed: int = 0  # leading tokens whose K/V are in the cache
    admitted: int = -1  # admission counter of the current run (latest admitted is preempted first)
    held: bool = False
    num_preemptions: int = 0
    num_cached_tokens: int = 0  # prefix-cache hit at the last admission

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


@dataclass(slots=True)
class ScheduledChunk:
    """Compute tokens [start, end) of `seq`, then its `drafts` (positions end, end + 1, ...); when `end`
    is its length, sample the next token (and one more after each accepted draft). With `parents`, the
    drafts are a tree (tree.py): row 0 is the decode token, row i > 0 draft i - 1, after row parents[i]."""
    seq: Sequence
    start: int
    end: int
    block_table: list[int]
    drafts: list[int] = field(default_factory=list)
    parents: list[int] | None = None

    @property
    def samples(self) -> bool:
        return self.end == self.seq.num_tokens

    @property
    def token_ids(self) -> list[int]:
        """What the step computes: the sequence's tokens [start, end), then the drafts."""
        return self.seq.token_ids[self.start:self.end] + self.drafts

    @property
    def num_rows(self) -> int:
        return self.end - self.start + len(self.drafts)


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    copies: list = field(default_factory=list)  # copy-on-write block copies to do before the step

    @property
    def num_tokens(self) -> int:
        return sum(c.num_rows for c in self.chunks)


@dataclass(slots=True)
class SchedulerConfig:
    max_num_seqs: int = 8  # sequences in one step
    max_num_batched_tokens: int = 512  # tokens computed in one step
    chunk_size: int = 256  # prefill chunk boundaries: multiples of this (a multiple of the block size)

    def validate(self, block_size: int) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.chunk_size < block_size or self.chunk_size % block_size:
            raise ValueError(f"chunk_size {self.chunk_size} must be a multiple of the block size {block_size}")
        if self.max_num_batched_tokens < self.chunk_size + self.max_num_seqs:
            raise ValueError(f"max_num_batched_tokens {self.max_num_batched_tokens} must be at least chunk_size "
                             f"+ max_num_seqs ({self.chunk_size + self.max_num_seqs}): a prefill chunk must fit "
                             f"beside a full batch of decodes")


class Scheduler:
    def __init__(self, blocks: BlockManager, config: SchedulerConfig | None = None):
        self.blocks = blocks
        self.config = config or SchedulerConfig()
        self.config.validate(blocks.block_size)
        self.waiting: list[Sequence] = []  # kept sorted by (priority, arrival)
        self.running: list[Sequence] = []  # in admission order
        self._arrivals = itertools.count()
        self._admissions = itertools.count()
        self.num_preemptions = 0

    # --- queue changes --------------------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        """Queue a new sequence. Its prompt must fit the whole cache (the engine checks first)."""
        seq.arrival = next(self._arrivals)
        seq.status = Status.WAITING
        self._enqueue(seq)

    def _enqueue(self, seq: Sequence) -> None:
        key = (seq.priority, seq.arrival)
        i = len(self.waiting)
        while i > 0 and (self.waiting[i - 1].priority, self.waiting[i - 1].arrival) > key:
            i -= 1
        self.waiting.insert(i, seq)

    def finish(self, seq: Sequence) -> None:
        """Remove a sequence (finished, cancelled or detached) and free its blocks at once."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        if self.blocks.has_seq(seq.seq_id):
            self.blocks.free(seq.seq_id)
        seq.status = Status.FINISHED

    def requeue(self, seq: Sequence) -> None:
        """Put a finished (detached) sequence back in the queue to continue from its tokens so far."""
        assert seq.status is Status.FINISHED
        seq.num_computed = 0
        seq.status = Status.WAITING
        self._enqueue(seq)

    def _preempt(self, victim: Sequence, out: SchedulerOutput) -> None:
        self.running.remove(victim)
        self.blocks.free(victim.seq_id)  # committed full blocks stay in the prefix cache
        victim.status, victim.num_computed = Status.WAITING, 0
        victim.num_preemptions += 1
        self.num_preemptions += 1
        self._enqueue(victim)  # its arrival keeps its place in the queue
        out.preempted.append(victim)

    # --- one step ----------------------------------------------------------------------------------

    def _chunk_end(self, seq: Sequence) -> int:
        c = self.config.chunk_size
        return min(seq.num_tokens, (seq.num_computed // c + 1) * c)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        scheduled: set[int] = set()
        for seq in list(self.running):  # earliest admitted first
            if seq.status is not Status.RUNNING or seq.held:
                continue
            # slots for tokens sampled since the last step (a decode needs one for its new token)
            while not self.blocks.append(seq.seq_id, seq.token_ids[self.blocks.num_tokens(seq.seq_id):]):
                # never take blocks back from a chunk already scheduled in this step
                victim = max((s for s in self.running if s.seq_id not in scheduled),
                             key=lambda s: (s.priority, s.admitted))
                self._preempt(victim, out)
                if victim is seq:
                    break
            if seq.status is not Status.RUNNING:
                continue
            end = self._chunk_end(seq)
            if end - seq.num_computed > budget:
                continue  # its next prefill chunk waits for a step with room
            out.chunks.append(ScheduledChunk(seq, seq.num_computed, end, self.blocks.block_table(seq.seq_id)))
            scheduled.add(seq.seq_id)
            budget -= end - seq.num_computed
        for seq in list(self.waiting):
            if out.preempted or len(self.running) >= self.config.max_num_seqs:
                break
            if seq.held:
                continue  # it does not want to run: passing it is not overtaking
            seq.num_computed = self.blocks.num_cached_prefix(seq.token_ids)
            end = self._chunk_end(seq)
            if end - seq.num_computed > budget:
                break  # first come, first served: nobody overtakes a sequence waiting for room
            cached = self.blocks.allocate(seq.seq_id, seq.token_ids)
            if cached is None:
                break
            assert cached == seq.num_computed
            seq.num_cached_tokens = cached
            self.waiting.remove(seq)
            seq.status, seq.admitted = Status.RUNNING, next(self._admissions)
            self.running.append(seq)
            out.chunks.append(ScheduledChunk(seq, cached, end, self.blocks.block_table(seq.seq_id)))
            budget -= end - cached
        out.copies = self.blocks.take_copies()
        return out

    def add_drafts(self, chunk: ScheduledChunk, drafts: list[int], parents: list[int] | None = None) -> bool:
        """Give a decode chunk draft tokens to verify in this step, in lookahead slots after its token
        (a tree's nodes, with `parents`, in depth-first order); False (and no drafts) when the cache has no
        room for them: drafts never preempt anyone."""
        assert chunk.samples and chunk.end - chunk.start == 1 and not chunk.drafts, "drafts ride on a decode"
        if not drafts or not self.blocks.append(chunk.seq.seq_id, drafts):
            return False
        chunk.drafts, chunk.parents = list(drafts), parents
        chunk.block_table = self.blocks.block_table(chunk.seq.seq_id)
        return True

    def update(self, chunk: ScheduledChunk, sampled: list[int]) -> None:
        """After the step: `chunk` was computed (its K/V are in the cache) and `sampled` drawn, in order,
        when it ended the sequence's known tokens: with drafts, one token per accepted draft (equal to
        it) and one after the last accepted. The rejected drafts' slots are truncated; what stays is
        verified and committed (cacheable). The engine finishes the sequence separately. (A tree's accepted
        path was moved onto the first lookahead slots and made the chunk's drafts before: drafting.py.)"""
        seq = chunk.seq
        if seq.status is not Status.RUNNING:
            return  # finished or preempted meanwhile
        accepted = max(0, len(sampled) - 1) if chunk.drafts else 0
        assert sampled[:accepted] == chunk.drafts[:accepted], "accepted drafts are the tokens sampled"
        seq.num_computed = chunk.end + accepted
        if self.blocks.num_tokens(seq.seq_id) > seq.num_computed:  # rejected drafts (a chain's or a tree's)
            self.blocks.truncate(seq.seq_id, seq.num_computed)
        self.blocks.commit(seq.seq_id, seq.num_computed)  # evaluated and accepted tokens: cacheable
        seq.token_ids.extend(sampled)

    # --- views ---------------------------------------------------------------------------------------

    @property
    def has_work(self) -> bool:
        return any(not s.held for s in self.waiting) or any(not s.held for s in self.running)

    def stats(self) -> dict:
        return {"num_waiting": len(self.waiting), "num_running": len(self.running),
                "num_preemptions": self.num_preemptions, **self.blocks.stats()}
