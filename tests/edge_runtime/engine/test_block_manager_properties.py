"""BlockManager stateful property test: random allocate, append, fork, commit, truncate and
free over a small pool, simulating the caller writing KV into slots and reading every live
sequence back through its slots."""
import pytest
from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from edge_runtime.engine.block_manager import BlockManager
from tests.edge_runtime.engine.block_manager_fixtures import snapshot

# ---- stateful property test -----------------------------------------------------------

TOKENS = st.integers(0, 2)  # small alphabet, so prefix hits happen
MAX_LIVE_SEQS = 4  # so the pool keeps cycling through free -> evictable -> evicted


class BlockManagerMachine(RuleBasedStateMachine):
    """Random allocate/append/fork/commit/truncate/free against a simulated KV cache.

    `kv` maps a physical slot to what the caller wrote there: the whole token prefix
    the KV at that position depends on. Reading every live sequence back through its
    slots must give its own prefixes; this catches wrong prefix hits, missed copies
    and bad truncation.
    """

    @initialize(num_blocks=st.integers(4, 24), block_size=st.integers(1, 4),
                prefix_caching=st.sampled_from([True, True, True, False]))
    def setup(self, num_blocks, block_size, prefix_caching):
        self.bm = BlockManager(num_blocks, block_size, prefix_caching)
        self.bs = block_size
        self.tokens = {}  # seq id -> expected token ids
        self.kv = {}
        self.prompts = [[0, 1, 2, 0, 1, 2, 0, 1]]
        self.committed_prefixes = set()  # token prefixes ever verified
        self.next_id = 0

    def new_id(self):
        self.next_id += 1
        return self.next_id

    def pick_prefix(self, data):
        """A live sequence and a length in [0, its length]."""
        seq_id = data.draw(st.sampled_from(sorted(self.tokens)))
        return seq_id, data.draw(st.integers(0, len(self.tokens[seq_id])))

    def write(self, seq_id, start):
        """The caller: perform pending copies, then write KV for positions [start, len)."""
        for copy in self.bm.take_copies():
            for o in range(self.bs):
                self.kv[copy.dst * self.bs + o] = self.kv.get(copy.src * self.bs + o)
        toks = self.tokens[seq_id]
        for p, slot in zip(range(start, len(toks)), self.bm.slots(seq_id, start, len(toks))):
            self.kv[slot] = tuple(toks[:p + 1])

    def assert_private_tail(self, seq_id, start):
        """Blocks written by positions >= start belong to this sequence only."""
        table = self.bm.block_table(seq_id)
        written = set(table[start // self.bs:])
        for other in self.tokens:
            if other != seq_id:
                assert not written & set(self.bm.block_table(other)), "two live sequences can write a block"
        for b in written:
            assert self.bm._blocks[b].ref_count == 1 and self.bm._blocks[b].cache_key is None

    def do_allocate(self, prompt, commit_prompt):
        seq_id = self.new_id()
        before = snapshot(self.bm)
        num_cached = self.bm.allocate(seq_id, prompt)
        if num_cached is None:
            assert snapshot(self.bm) == before
            return
        assert num_cached % self.bs == 0 and num_cached <= (len(prompt) - 1) // self.bs * self.bs
        self.tokens[seq_id] = list(prompt)
        self.prompts.append(list(prompt))
        self.record_committed(seq_id, num_cached)
        self.write(seq_id, num_cached)
        self.assert_private_tail(seq_id, num_cached)
        if commit_prompt:  # the usual flow: the prompt is computed, so it is verified
            self.bm.commit(seq_id, len(prompt))
            self.record_committed(seq_id, len(prompt))

    def record_committed(self, seq_id, num_tokens):
        toks = self.tokens[seq_id]
        for end in range(self.bs, num_tokens + 1, self.bs):
            self.committed_prefixes.add(tuple(toks[:end]))

    def do_append(self, seq_id, new_tokens):
        start = len(self.tokens[seq_id])
        before = snapshot(self.bm)
        if not self.bm.append(seq_id, new_tokens):
            assert snapshot(self.bm) == before
            return False
        self.tokens[seq_id] += new_tokens
        self.write(seq_id, start)
        self.assert_private_tail(seq_id, start)
        return True

    @precondition(lambda self: len(self.tokens) < MAX_LIVE_SEQS)
    @rule(prompt=st.lists(TOKENS, min_size=1, max_size=10), commit_prompt=st.booleans())
    def allocate(self, prompt, commit_prompt):
        self.do_allocate(prompt, commit_prompt)

    @precondition(lambda self: len(self.tokens) < MAX_LIVE_SEQS)
    @rule(data=st.data(), tail=st.lists(TOKENS, max_size=4), commit_prompt=st.booleans())
    def allocate_shared_prefix(self, data, tail, commit_prompt):
        base = data.draw(st.sampled_from(self.prompts + [t for t in self.tokens.values() if t]))
        cut = data.draw(st.integers(1, len(base)))
        self.do_allocate(base[:cut] + tail, commit_prompt)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), new_tokens=st.lists(TOKENS, min_size=1, max_size=6))
    def append(self, data, new_tokens):
        self.do_append(data.draw(st.sampled_from(sorted(self.tokens))), new_tokens)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), drafts=st.lists(TOKENS, min_size=1, max_size=5))
    def draft_and_verify(self, data, drafts):
        """Lookahead: append drafts, truncate the rejected ones, commit the accepted part."""
        seq_id = data.draw(st.sampled_from(sorted(self.tokens)))
        start = len(self.tokens[seq_id])
        if self.do_append(seq_id, drafts):
            keep = start + data.draw(st.integers(0, len(drafts)))
            self.bm.truncate(seq_id, keep)
            del self.tokens[seq_id][keep:]
            self.bm.commit(seq_id, keep)
            self.record_committed(seq_id, keep)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), new_tokens=st.lists(TOKENS, min_size=1, max_size=4))
    def rewrite_tail(self, data, new_tokens):
        """Roll back (possibly into committed, cached blocks) and write different tokens."""
        seq_id, num_tokens = self.pick_prefix(data)
        self.bm.truncate(seq_id, num_tokens)
        del self.tokens[seq_id][num_tokens:]
        self.do_append(seq_id, new_tokens)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def commit(self, data):
        seq_id, num_tokens = self.pick_prefix(data)
        self.bm.commit(seq_id, num_tokens)
        self.record_committed(seq_id, num_tokens)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def truncate(self, data):
        seq_id, num_tokens = self.pick_prefix(data)
        num_committed = self.bm.num_committed_tokens(seq_id)
        self.bm.truncate(seq_id, num_tokens)
        del self.tokens[seq_id][num_tokens:]
        assert len(self.bm.block_table(seq_id)) == self.bm.blocks_needed(num_tokens)
        assert self.bm.num_committed_tokens(seq_id) == min(num_committed, num_tokens)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def fork(self, data):
        parent = data.draw(st.sampled_from(sorted(self.tokens)))
        child = self.new_id()
        self.bm.fork(parent, child)
        self.tokens[child] = list(self.tokens[parent])

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def free(self, data):
        seq_id = data.draw(st.sampled_from(sorted(self.tokens)))
        self.bm.free(seq_id)
        del self.tokens[seq_id]
        with pytest.raises(ValueError):
            self.bm.free(seq_id)  # never twice

    @rule()
    def reset_prefix_cache(self):
        self.bm.reset_prefix_cache()

    @invariant()
    def bookkeeping_holds(self):
        self.bm.check_invariants()
        assert set(self.bm._seqs) == set(self.tokens)

    @invariant()
    def every_sequence_reads_back_its_own_kv(self):
        for seq_id, toks in self.tokens.items():
            assert self.bm.num_tokens(seq_id) == len(toks)
            got = [self.kv.get(s) for s in self.bm.slots(seq_id, 0, len(toks))]
            assert got == [tuple(toks[:p + 1]) for p in range(len(toks))], f"seq {seq_id} reads wrong KV"

    @invariant()
    def cached_blocks_hold_verified_content(self):
        for (_, block_tokens), b in self.bm._cache.items():
            kv = [self.kv.get(b * self.bs + o) for o in range(self.bs)]
            assert [prefix[-1] for prefix in kv] == list(block_tokens)
            assert kv[-1] in self.committed_prefixes, "a never-verified block is cached"

    def teardown(self):
        if not hasattr(self, "bm"):
            return
        for seq_id in list(self.tokens):
            self.bm.free(seq_id)
        self.bm.check_invariants()
        assert self.bm.num_free_blocks == self.bm.num_blocks
        assert self.bm.stats()["num_used_blocks"] == 0


BlockManagerMachine.TestCase.settings = settings(max_examples=200, stateful_step_count=30, deadline=None)
test_block_manager_state_machine = BlockManagerMachine.TestCase
