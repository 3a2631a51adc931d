"""Shared by the block manager's unit and property tests."""


def snapshot(bm):
    """Everything observable, to prove a refused call changed nothing."""
    seqs = {s: (bm.block_table(s), bm.num_tokens(s), bm.num_committed_tokens(s)) for s in list(bm._seqs)}
    return seqs, bm.stats(), list(bm._free_block_ids), list(bm._evictable), dict(bm._cache), list(bm._copies)
