"""BlockManager: unit tests per method and an import guard (the stateful property test is in
test_block_manager_properties.py)."""
import subprocess
import sys
from pathlib import Path

import pytest

from edge_runtime.engine.block_manager import BlockCopy, BlockManager
from tests.edge_runtime.engine.block_manager_fixtures import snapshot

REPO_ROOT = Path(__file__).resolve().parents[3]


# ---- construction and counts ---------------------------------------------------


@pytest.mark.parametrize("kwargs, match", [
    ({"num_blocks": 0}, "num_blocks must be a positive int"),
    ({"num_blocks": 4, "block_size": 0}, "block_size must be a positive int"),
    ({"num_blocks": 2.0}, "num_blocks must be a positive int"),
    ({"num_blocks": True}, "num_blocks must be a positive int"),
])
def test_bad_constructor_args(kwargs, match):
    with pytest.raises(ValueError, match=match):
        BlockManager(**kwargs)


def test_blocks_needed_and_initial_state():
    bm = BlockManager(8, block_size=4)
    assert (bm.num_blocks, bm.block_size, bm.num_free_blocks, bm.num_cached_blocks) == (8, 4, 8, 0)
    assert [bm.blocks_needed(n) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]
    with pytest.raises(ValueError, match=">= 0"):
        bm.blocks_needed(-1)
    bm.check_invariants()


# ---- allocate, slots ---------------------------------------------------------------


def test_allocate_builds_table_and_slots():
    bm = BlockManager(8, block_size=4)
    assert bm.allocate("a", list(range(6))) == 0
    table = bm.block_table("a")
    assert len(table) == 2 and bm.num_tokens("a") == 6 and bm.num_free_blocks == 6
    assert bm.slots("a", 0, 6) == [table[p // 4] * 4 + p % 4 for p in range(6)]
    assert bm.slots("a", 3, 5) == [table[0] * 4 + 3, table[1] * 4]
    assert bm.slots("a", 2, 2) == []
    assert bm.has_seq("a") and not bm.has_seq("b")
    bm.check_invariants()


def test_second_allocate_hits_prefix_cache():
    bm = BlockManager(16, block_size=4)
    prompt = list(range(10))  # blocks [0..3] [4..7] [8, 9]
    assert bm.allocate("a", prompt) == 0
    bm.commit("a", 10)
    assert bm.num_cached_blocks == 2  # the partial block is not cached
    # Live sharing: same prefix, different tail.
    assert bm.allocate("b", prompt[:8] + [99, 98, 97]) == 8
    assert bm.block_table("b")[:2] == bm.block_table("a")[:2]
    assert bm.block_table("b")[2] != bm.block_table("a")[2]
    # Diverging in the second block hits only the first.
    assert bm.allocate("c", prompt[:5] + [50, 51, 52, 53]) == 4
    # After free the cached blocks stay reusable.
    for s in ("a", "b", "c"):
        bm.free(s)
    assert bm.num_free_blocks == 16 and bm.num_cached_blocks == 2
    assert bm.allocate("d", prompt) == 8
    assert bm.stats() == {"num_free_blocks": 13, "num_evictable_blocks": 0, "num_used_blocks": 3,
                          "num_cached_blocks": 2, "num_hit_tokens": 20, "num_query_tokens": 40}
    bm.check_invariants()


def test_allocate_cap_never_reuses_block_of_last_prompt_token():
    bm = BlockManager(16, block_size=4)
    prompt = list(range(8))  # exactly two full blocks
    bm.allocate("a", prompt)
    bm.commit("a", 8)
    assert bm.num_cached_blocks == 2
    assert bm.allocate("b", prompt) == 4  # ((8 - 1) // 4) * 4, not 8
    assert bm.block_table("b")[1] != bm.block_table("a")[1]  # fresh block for the last token
    assert bm.allocate("c", prompt[:4]) == 0  # one-block prompt: nothing reusable
    assert bm.allocate("d", prompt + [8]) == 8
    bm.check_invariants()


def test_allocate_errors_and_no_room():
    bm = BlockManager(2, block_size=4)
    with pytest.raises(ValueError, match="must not be empty"):
        bm.allocate("a", [])
    assert bm.allocate("a", [1, 2, 3, 4, 5]) == 0
    with pytest.raises(ValueError, match="'a' already exists"):
        bm.allocate("a", [1])
    before = snapshot(bm)
    assert bm.allocate("b", [1]) is None
    assert snapshot(bm) == before and not bm.has_seq("b")
    bm.check_invariants()


def test_allocate_does_not_evict_its_own_hits():
    bm = BlockManager(2, block_size=2)
    bm.allocate("a", [1, 2, 3, 4])
    bm.commit("a", 4)
    bm.free("a")  # both blocks evictable, free list empty
    assert bm.num_free_blocks == 2
    before = snapshot(bm)
    # Would hit 2 blocks and need 1 fresh one, which could only come from evicting a hit.
    assert bm.allocate("b", [1, 2, 3, 4, 5]) is None
    assert snapshot(bm) == before
    assert bm.allocate("b", [1, 2, 3]) == 2  # hit 1 + evict the other for the fresh block
    assert bm.num_cached_blocks == 1
    bm.check_invariants()


def test_prefix_cache_compares_tokens_not_just_hashes():
    assert hash((0, (-1, -1))) == hash((0, (-2, -2)))  # CPython: hash(-1) == hash(-2)
    bm = BlockManager(8, block_size=2)
    bm.allocate("a", [-1, -1, 7])
    bm.commit("a", 3)
    bm.free("a")
    assert bm.allocate("b", [-2, -2, 7]) == 0
    assert bm.allocate("c", [-1, -1, 7]) == 2
    bm.check_invariants()


def test_prefix_caching_disabled():
    bm = BlockManager(8, block_size=2, prefix_caching=False)
    bm.allocate("a", [1, 2, 3])
    bm.commit("a", 3)
    assert bm.num_cached_blocks == 0
    bm.free("a")
    assert bm.allocate("b", [1, 2, 3]) == 0
    bm.check_invariants()


# ---- commit: only verified full blocks are cached -----------------------------------


def test_drafts_are_never_cached():
    bm = BlockManager(16, block_size=4)
    bm.allocate("a", [1, 2, 3, 4, 5, 6])
    bm.commit("a", 6)
    assert bm.num_cached_blocks == 1
    assert bm.append("a", [7, 8, 9, 10, 11])  # drafts fill block 1 and spill into block 2
    assert bm.num_cached_blocks == 1
    bm.commit("a", 7)  # accept one draft: block 1 is still not fully verified
    assert bm.num_cached_blocks == 1
    bm.truncate("a", 7)
    bm.free("a")
    assert bm.allocate("b", [1, 2, 3, 4, 5, 6, 7, 8, 9]) == 4  # drafts 8, 9 never hit


def test_commit_validation_and_monotonic():
    bm = BlockManager(8, block_size=2)
    bm.allocate("a", [1, 2, 3])
    with pytest.raises(ValueError, match="cannot commit 4 tokens, it holds 3"):
        bm.commit("a", 4)
    bm.commit("a", 3)
    bm.commit("a", 1)  # lower is a no-op
    assert bm.num_committed_tokens("a") == 3 and bm.num_cached_blocks == 1


def test_duplicate_content_registered_once():
    bm = BlockManager(8, block_size=2)
    bm.allocate("a", [1, 2, 3])
    bm.allocate("b", [1, 2, 3])  # nothing cached yet: computes the same block twice
    bm.commit("a", 3)
    bm.commit("b", 3)
    assert bm.num_cached_blocks == 1
    bm.free("a")
    bm.free("b")
    assert bm.stats()["num_evictable_blocks"] == 1 and bm.stats()["num_free_blocks"] == 8
    bm.check_invariants()


# ---- eviction ----------------------------------------------------------------------


def test_lru_eviction_order_and_hit_refreshes_recency():
    bm = BlockManager(4, block_size=2)
    for s, prompt in (("a", [1, 2]), ("b", [3, 4]), ("c", [5, 6])):
        bm.allocate(s, prompt)
        bm.commit(s, 2)
        bm.free(s)
    block_a = bm._cache[(0, (1, 2))]
    # LRU order is a, b, c. A hit on a moves it to the most recent end once released.
    assert bm.allocate("q", [1, 2, 0]) == 2 and bm.block_table("q")[0] == block_a
    bm.free("q")  # the free list is back to one block
    assert bm.allocate("x", [9]) == 0  # takes the free block, evicts nothing
    assert bm.num_cached_blocks == 3
    assert bm.allocate("y", [9]) == 0  # evicts b (least recently used)
    assert bm.num_cached_blocks == 2
    assert bm.allocate("z", [9]) == 0  # evicts c
    assert bm.num_cached_blocks == 1 and bm.block_table("z") != [block_a]
    for s in ("x", "y", "z"):
        bm.free(s)
    assert bm.allocate("p", [3, 4, 0]) == 0
    assert bm.allocate("r", [1, 2, 0]) == 2
    bm.check_invariants()


def test_free_releases_tail_first_so_it_is_evicted_first():
    bm = BlockManager(3, block_size=2)
    bm.allocate("a", [1, 2, 3, 4, 5])
    bm.commit("a", 5)
    bm.free("a")  # the partial block goes to the free list, then blocks 1 and 0 become evictable
    assert bm.allocate("x", [9]) == 0 and bm.num_cached_blocks == 2
    assert bm.allocate("y", [9]) == 0 and bm.num_cached_blocks == 1  # evicted [3, 4], the tail
    bm.free("x")
    assert bm.allocate("b", [1, 2, 3]) == 2
    bm.check_invariants()


def test_reset_prefix_cache_drops_evictable_only():
    bm = BlockManager(8, block_size=2)
    bm.allocate("a", [1, 2, 3])
    bm.allocate("b", [4, 5, 6])
    bm.commit("a", 3)
    bm.commit("b", 3)
    bm.free("a")
    bm.reset_prefix_cache()
    assert bm.num_cached_blocks == 1 and bm.stats()["num_evictable_blocks"] == 0
    assert bm.allocate("c", [1, 2, 3]) == 0 and bm.allocate("d", [4, 5, 6]) == 2
    bm.check_invariants()


# ---- append, fork, copy-on-write ------------------------------------------------------


def test_append_allocates_blocks_as_needed():
    bm = BlockManager(8, block_size=4)
    bm.allocate("a", [1, 2, 3])
    assert bm.append("a", [4]) and len(bm.block_table("a")) == 1
    assert bm.append("a", [5]) and len(bm.block_table("a")) == 2
    assert bm.append("a", []) and bm.num_tokens("a") == 5
    assert bm.append("a", list(range(9))) and len(bm.block_table("a")) == 4
    assert bm.take_copies() == []
    with pytest.raises(ValueError, match="unknown sequence 'nope'"):
        bm.append("nope", [1])
    bm.check_invariants()


def test_append_no_room_changes_nothing():
    bm = BlockManager(2, block_size=2)
    bm.allocate("a", [1, 2, 3])
    before = snapshot(bm)
    assert not bm.append("a", [4, 5])
    assert snapshot(bm) == before
    assert bm.append("a", [4])
    # Copy-on-write needs a block too.
    bm.truncate("a", 3)
    bm.fork("a", "b")
    bm.allocate("c", [7])
    before = snapshot(bm)
    assert not bm.append("b", [4])
    assert snapshot(bm) == before
    bm.check_invariants()


def test_fork_then_append_copies_exactly_once():
    bm = BlockManager(8, block_size=4)
    bm.allocate("p", [1, 2, 3, 4, 5])
    bm.commit("p", 5)
    bm.fork("p", "c")
    parent_table = bm.block_table("p")
    assert bm.block_table("c") == parent_table and bm.num_committed_tokens("c") == 5
    assert bm.append("c", [6])
    copies = bm.take_copies()
    new_block = bm.block_table("c")[1]
    assert copies == [BlockCopy(src=parent_table[1], dst=new_block)]
    assert new_block != parent_table[1] and bm.block_table("c")[0] == parent_table[0]
    assert bm.block_table("p") == parent_table and bm.num_tokens("p") == 5
    assert bm.take_copies() == []
    assert bm.append("c", [7]) and bm.append("p", [6]) and bm.take_copies() == []  # both private now
    assert bm.block_table("p") == parent_table
    with pytest.raises(ValueError, match="'c' already exists"):
        bm.fork("p", "c")
    with pytest.raises(ValueError, match="unknown sequence 'x'"):
        bm.fork("x", "y")
    bm.check_invariants()


def test_fork_at_block_boundary_needs_no_copy():
    bm = BlockManager(8, block_size=2)
    bm.allocate("p", [1, 2])
    bm.fork("p", "c")
    assert bm.append("c", [3]) and bm.append("p", [4])
    assert bm.take_copies() == []
    assert bm.block_table("c")[0] == bm.block_table("p")[0]
    bm.check_invariants()


# ---- truncate --------------------------------------------------------------------


def test_truncate_releases_blocks_and_lowers_commit():
    bm = BlockManager(8, block_size=4)
    bm.allocate("a", list(range(10)))
    bm.commit("a", 10)
    assert bm.append("a", list(range(10, 16)))
    assert bm.num_free_blocks == 4
    bm.truncate("a", 9)
    assert len(bm.block_table("a")) == 3 and bm.num_free_blocks == 5
    assert bm.num_tokens("a") == 9 and bm.num_committed_tokens("a") == 9
    bm.truncate("a", 0)
    assert bm.block_table("a") == [] and bm.num_committed_tokens("a") == 0
    assert bm.num_free_blocks == 8  # the two cached blocks are evictable
    assert bm.append("a", [5]) and bm.num_tokens("a") == 1
    with pytest.raises(ValueError, match="cannot truncate to 2 tokens, it holds 1"):
        bm.truncate("a", 2)
    bm.check_invariants()


def test_truncate_into_exclusive_cached_block_unregisters_on_write():
    bm = BlockManager(8, block_size=4)
    bm.allocate("a", list(range(8)))
    bm.commit("a", 8)
    assert bm.num_cached_blocks == 2
    bm.truncate("a", 6)
    assert bm.num_cached_blocks == 2  # content intact until something overwrites it
    table = bm.block_table("a")
    assert bm.append("a", [99])
    assert bm.take_copies() == [] and bm.block_table("a") == table  # written in place ...
    assert bm.num_cached_blocks == 1  # ... after leaving the cache
    assert bm.allocate("b", list(range(8)) + [8]) == 4
    bm.check_invariants()


def test_truncate_into_shared_cached_block_copies_on_write():
    bm = BlockManager(8, block_size=4)
    prompt = list(range(8))
    bm.allocate("a", prompt)
    bm.commit("a", 8)
    assert bm.allocate("b", prompt + [8]) == 8
    shared = bm.block_table("a")[1]
    bm.truncate("a", 6)
    assert bm.append("a", [99])
    assert bm.take_copies() == [BlockCopy(src=shared, dst=bm.block_table("a")[1])]
    assert bm.block_table("b")[1] == shared and bm.num_cached_blocks == 2
    assert bm.allocate("c", prompt + [8]) == 8
    bm.check_invariants()


def test_free_and_unknown_sequences():
    bm = BlockManager(4, block_size=2)
    bm.allocate("a", [1, 2, 3])
    bm.free("a")
    assert bm.num_free_blocks == 4 and not bm.has_seq("a")
    for call in (lambda: bm.free("a"), lambda: bm.block_table("a"), lambda: bm.num_tokens("a"),
                 lambda: bm.slots("a", 0, 0), lambda: bm.commit("a", 0), lambda: bm.truncate("a", 0)):
        with pytest.raises(ValueError, match="unknown sequence 'a'"):
            call()
    bm.allocate("b", [1, 2, 3])
    with pytest.raises(ValueError, match=r"positions \[2, 4\) outside \[0, 3\)"):
        bm.slots("b", 2, 4)
    bm.check_invariants()


def test_imports_no_torch_or_numpy():
    code = (
        "import sys\n"
        "sys.modules['torch'] = None\n"  # any `import torch` would now raise ImportError
        "sys.modules['numpy'] = None\n"
        "import edge_runtime.engine.block_manager as m\n"
        "m.BlockManager(4).check_invariants()\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def test_rewrite_names_uncommitted_positions_only():
    """A draft tree's accepted path takes the first lookahead positions: their tokens are renamed, nothing is
    allocated or freed, and committed positions cannot be rewritten."""
    bm = BlockManager(8, block_size=4)
    bm.allocate("a", [1, 2, 3, 4, 5])
    bm.commit("a", 5)
    assert bm.append("a", [6, 70, 71, 80, 81])  # the decode token, then tree nodes
    table = bm.block_table("a")
    bm.rewrite("a", 6, [80, 81])  # the path through the second branch
    bm.truncate("a", 8)
    bm.commit("a", 8)
    assert bm.block_table("a") == table[:2] and bm.num_tokens("a") == 8
    assert bm.num_cached_prefix([1, 2, 3, 4, 5, 6, 80, 81, 9]) == 8
    with pytest.raises(ValueError, match="cannot rewrite"):
        bm.rewrite("a", 7, [1])
    bm.check_invariants()
