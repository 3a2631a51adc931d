"""A simulated engine for the scheduler tests (no torch, no model).

`Sim` plays the engine. It runs each step's chunks on a fake KV cache holding one token id
per slot: a chunk writes its tokens through its block table, and a chunk that samples reads
positions [0, end) back and must see its own sequence's prefix, which catches a wrong prefix
hit or a block lost to preemption. The sampled token is greedy and depends only on the
tokens so far, so every request must end with `reference(prompt, max_new)` however it was
batched, preempted or parked. With `drafter` (sequence -> draft tokens), decode chunks carry
drafts: every row is computed, the accepted prefix kept, and the rest truncated, as the engine does.
"""
import itertools

from edge_runtime.engine.block_manager import BlockManager
from edge_runtime.engine.scheduler import INTERACTIVE, Scheduler, SchedulerConfig, Sequence, Status

BS = 16


def model(token_ids):
    return sum(token_ids[-3:]) % 1000


def reference(prompt, max_new):
    token_ids = list(prompt)
    for _ in range(max_new):
        token_ids.append(model(token_ids))
    return token_ids


def oracle_drafter(seq, num_drafts=3):
    """Drafts for `seq`: its true next tokens, except one made wrong at a spot that moves with its length
    (none when that spot is past the drafts), so steps see all, some and none of their drafts accepted."""
    ids, out = list(seq.token_ids), []
    for _ in range(num_drafts):
        out.append(model(ids))
        ids.append(out[-1])
    wrong = len(seq.token_ids) % (num_drafts + 1)
    if wrong < num_drafts:
        out[wrong] = 999_999
    return out


class Sim:
    def __init__(self, num_blocks, drafter=None, **config):
        self.drafter = drafter
        self.blocks = BlockManager(num_blocks, block_size=BS)
        self.config = SchedulerConfig(**config)
        self.sched = Scheduler(self.blocks, self.config)
        self.kv = [None] * (num_blocks * BS)
        self.max_new = {}
        self.done = []  # finished after max_new tokens, in order
        self.log = []  # per step: [(seq, start, end, samples)]
        self._ids = itertools.count()

    def add(self, prompt, max_new=8, priority=INTERACTIVE):
        seq = Sequence(next(self._ids), list(prompt), len(prompt), priority)
        self.max_new[seq.seq_id] = max_new
        self.sched.add(seq)
        return seq

    def step(self):
        held = [s for s in self.sched.running if s.held]
        waiting = set(self.sched.waiting)
        out = self.sched.schedule()
        self.check(out, held, waiting)
        if self.drafter is not None:
            for chunk in out.chunks:
                if chunk.samples and chunk.end - chunk.start == 1:
                    left = self.max_new[chunk.seq.seq_id] - (chunk.seq.num_tokens - chunk.seq.num_prompt_tokens)
                    self.sched.add_drafts(chunk, self.drafter(chunk.seq)[:max(0, left - 1)])
            assert not self.blocks.take_copies(), "drafts go into private blocks"
        self.log.append([(c.seq, c.start, c.end, c.samples) for c in out.chunks])
        for copy in out.copies:
            self.kv[copy.dst * BS:(copy.dst + 1) * BS] = self.kv[copy.src * BS:(copy.src + 1) * BS]
        for chunk in out.chunks:
            seq, table = chunk.seq, chunk.block_table
            rows = chunk.token_ids
            slots = [table[p // BS] * BS + p % BS for p in range(chunk.start + len(rows))]
            for p, t in zip(range(chunk.start, chunk.start + len(rows)), rows):
                self.kv[slots[p]] = t
            sampled = []
            if chunk.samples:
                for i in range(len(chunk.drafts) + 1):
                    seen = [self.kv[s] for s in slots[:chunk.end + i]]
                    assert seen == seq.token_ids[:chunk.end] + chunk.drafts[:i], f"seq {seq.seq_id} reads another prefix"
                    sampled.append(model(seen))
                    if i == len(chunk.drafts) or sampled[-1] != chunk.drafts[i]:
                        break
            self.sched.update(chunk, sampled)
            if chunk.drafts and seq.status is Status.RUNNING:
                assert self.blocks.num_tokens(seq.seq_id) == seq.num_computed == seq.num_tokens - 1
            if seq.status is Status.RUNNING and seq.num_tokens - seq.num_prompt_tokens >= self.max_new[seq.seq_id]:
                self.sched.finish(seq)
                self.done.append(seq)
        return out

    def check(self, out, held, waiting):
        sched, cfg, c = self.sched, self.config, self.config.chunk_size
        self.blocks.check_invariants()
        seqs = [chunk.seq for chunk in out.chunks]
        assert len(set(seqs)) == len(seqs), "a sequence scheduled twice in one step"
        assert out.num_tokens <= cfg.max_num_batched_tokens
        assert len(sched.running) <= cfg.max_num_seqs
        assert not set(seqs) & set(out.preempted) and not set(seqs) & set(held)
        for chunk in out.chunks:
            seq = chunk.seq
            assert seq.status is Status.RUNNING and chunk.start == seq.num_computed < chunk.end <= seq.num_tokens
            assert chunk.end == seq.num_tokens or chunk.end % c == 0  # boundaries: multiples of c
            assert chunk.start // c == (chunk.end - 1) // c  # never across one
            if seq in waiting:  # admitted now: computes exactly what the prefix cache lacks
                assert chunk.start == seq.num_cached_tokens < seq.num_tokens
            assert chunk.block_table == self.blocks.block_table(seq.seq_id)
        assert all(s.status is Status.WAITING and s.num_computed == 0 for s in out.preempted)
        assert all(self.blocks.has_seq(s.seq_id) == (s in sched.running) for s in sched.running + sched.waiting)
        assert sched.waiting == sorted(sched.waiting, key=lambda s: (s.priority, s.arrival))

    def run(self, max_steps=5000):
        for _ in range(max_steps):
            if not self.sched.has_work:
                return
            self.step()
        raise AssertionError("no progress: deadlock or starvation")

    def chunks_of(self, seq):
        return [(start, end, samples) for step in self.log for s, start, end, samples in step if s is seq]
