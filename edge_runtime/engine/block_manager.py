"""Paged KV-cache block manager: block tables, prefix caching, copy-on-write.

The physical KV cache is `num_blocks` blocks of `block_size` token slots. Each
sequence has a block table (physical block ids); position p of a sequence lives
in slot `block_table[p // block_size] * block_size + p % block_size`.

Full blocks are shared through the prefix cache and `fork`; before a sequence
writes into a shared block it gets a private one plus a `BlockCopy` that the
caller performs first (copy-on-write).

Prefix cache: when positions [0, n) of a sequence are committed (computed and
accepted), every full block inside that range is registered under the chained
key `(parent's cache id, tuple(token_ids))`. A cache id names one registered
content and is never reused, so it stands for the whole token prefix up to and
including that block. Lookups go through a dict, which hashes the key and then
compares the parent id and the actual token ids, so a hash collision can never
produce a wrong hit. Drafted tokens that are not committed are never cached.

It deliberately knows nothing about tensors (the caller writes KV into the
slots and performs the copies), scheduling, preemption or tokenization. "No
room" is a return value (`None` / `False`); the caller decides what to do.
"""
from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

_ROOT_CACHE_ID = 0  # cache id of the empty prefix; registered contents get 1, 2, ...
CacheKey = tuple[int, tuple[int, ...]]  # (parent cache id, token ids of the block)


@dataclass(slots=True)
class BlockCopy:
    """The caller must copy the KV of physical block `src` into `dst` before
    the next forward pass writes anything (`BlockManager.take_copies`)."""

    src: int
    dst: int


@dataclass(slots=True)
class _Block:
    block_id: int
    ref_count: int = 0
    cache_key: CacheKey | None = None  # set while registered in the prefix cache
    cache_id: int = _ROOT_CACHE_ID  # unique id of the registered content; ROOT when unregistered


@dataclass(slots=True)
class _Sequence:
    token_ids: list[int]
    block_table: list[int]
    num_committed: int = 0
    # Cache id of the content of each committed full block (len == num_committed // block_size
    # with prefix caching on); the chain parent for the next block to register.
    cache_ids: list[int] = field(default_factory=list)


def _check(condition: bool, message: str) -> None:
    if not condition:  # explicit raise: survives `python -O`, unlike assert
        raise AssertionError(message)


class BlockManager:
    """Hands out KV blocks to sequences. See the module docstring.

    NOTE: every block is in exactly one of: the free list, the evictable set
    (ref 0, registered in the prefix cache, LRU order), or referenced by >= 1
    sequence table (ref count == number of tables holding it). A registered
    block is never written: `append` copies it (shared) or unregisters it
    (exclusive) first. `check_invariants` asserts all of this.
    """

    def __init__(self, num_blocks: int, block_size: int = 16, prefix_caching: bool = True):
        for name, value in (("num_blocks", num_blocks), ("block_size", block_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.prefix_caching = bool(prefix_caching)
        self._blocks = [_Block(i) for i in range(num_blocks)]
        self._free_block_ids: deque[int] = deque(range(num_blocks))
        self._evictable: OrderedDict[int, None] = OrderedDict()  # least recently used first
        self._cache: dict[CacheKey, int] = {}  # cache key -> block id
        self._seqs: dict[Hashable, _Sequence] = {}
        self._copies: list[BlockCopy] = []
        self._next_cache_id = _ROOT_CACHE_ID + 1
        self.num_query_tokens = 0  # prompt tokens looked up by allocate
        self.num_hit_tokens = 0  # of which found in the prefix cache

    @property
    def num_free_blocks(self) -> int:
        """Blocks obtainable now: free list plus evictable cached blocks."""
        return len(self._free_block_ids) + len(self._evictable)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks registered in the prefix cache, live or evictable."""
        return len(self._cache)

    def blocks_needed(self, num_tokens: int) -> int:
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        return -(-num_tokens // self.block_size)

    def stats(self) -> dict[str, int]:
        """Block counts (free includes evictable) and prefix-cache hits/queries in tokens."""
        return {
            "num_free_blocks": self.num_free_blocks,
            "num_evictable_blocks": len(self._evictable),
            "num_used_blocks": self.num_blocks - self.num_free_blocks,
            "num_cached_blocks": len(self._cache),
            "num_hit_tokens": self.num_hit_tokens,
            "num_query_tokens": self.num_query_tokens,
        }

    def allocate(self, seq_id: Hashable, token_ids: Sequence[int]) -> int | None:
        """Create sequence `seq_id` holding the prompt `token_ids`.

        Returns:
            The number of leading tokens whose KV is already present (prefix
            cache hit, a multiple of block_size, at most
            ((len - 1) // block_size) * block_size so the block holding the
            last prompt token is always fresh), or None if there is no room
            (nothing changed). The caller computes the rest and then commits.
        """
        if seq_id in self._seqs:
            raise ValueError(f"sequence {seq_id!r} already exists")
        if len(token_ids) == 0:
            raise ValueError(f"sequence {seq_id!r}: token_ids must not be empty")
        token_ids = list(token_ids)
        hit_block_ids, cache_ids = self._match_prefix(token_ids)
        num_fresh = self.blocks_needed(len(token_ids)) - len(hit_block_ids)
        # NOTE: evictable hits are about to be taken, so they cannot also serve as fresh blocks.
        num_hits_evictable = sum(b in self._evictable for b in hit_block_ids)
        if num_fresh > self.num_free_blocks - num_hits_evictable:
            return None
        for block_id in hit_block_ids:
            self._acquire(block_id)
        block_table = hit_block_ids + [self._take_fresh() for _ in range(num_fresh)]
        num_cached_tokens = len(hit_block_ids) * self.block_size
        self._seqs[seq_id] = _Sequence(token_ids, block_table, num_cached_tokens, cache_ids)
        self.num_query_tokens += len(token_ids)
        self.num_hit_tokens += num_cached_tokens
        return num_cached_tokens

    def num_cached_prefix(self, token_ids: Sequence[int]) -> int:
        """Tokens `allocate(token_ids)` would find cached now; changes nothing (not even the stats)."""
        return len(self._match_prefix(list(token_ids))[0]) * self.block_size if token_ids else 0

    def append(self, seq_id: Hashable, token_ids: Sequence[int]) -> bool:
        """Extend the sequence by tokens to be computed (generated or drafts).

        Returns False (nothing changed) if there is no room. Afterwards every
        block the new tokens go into is private (ref 1) and unregistered; a
        shared one is replaced by a copy, see `take_copies`.
        """
        seq = self._get(seq_id)
        if len(token_ids) == 0:
            return True
        num_tokens = len(seq.token_ids)
        num_new = self.blocks_needed(num_tokens + len(token_ids)) - len(seq.block_table)
        # The partially filled last block, if any, receives the first new tokens.
        last = self._blocks[seq.block_table[-1]] if num_tokens % self.block_size else None
        needs_copy = last is not None and last.ref_count > 1
        if num_new + needs_copy > self.num_free_blocks:
            return False
        if needs_copy:
            seq.block_table[-1] = self._take_fresh()
            self._copies.append(BlockCopy(src=last.block_id, dst=seq.block_table[-1]))
            self._release(last.block_id)
        elif last is not None and last.cache_key is not None:
            # NOTE: kept partially by truncate and ours alone: its tail is about to be
            # overwritten, so its content no longer matches its key. Unregister, don't copy.
            self._unregister(last)
        seq.block_table.extend(self._take_fresh() for _ in range(num_new))
        seq.token_ids.extend(token_ids)
        return True

    def take_copies(self) -> list[BlockCopy]:
        """Pending copy-on-write copies since the last call (then cleared)."""
        copies, self._copies = self._copies, []
        return copies

    def commit(self, seq_id: Hashable, num_tokens: int) -> None:
        """Mark positions [0, num_tokens) verified and cache the full blocks inside.

        Commit is monotonic: a value below the current committed count is a
        no-op (use `truncate` to roll back).
        """
        seq = self._get(seq_id)
        if not 0 <= num_tokens <= len(seq.token_ids):
            raise ValueError(f"sequence {seq_id!r}: cannot commit {num_tokens} tokens, it holds {len(seq.token_ids)}")
        if num_tokens <= seq.num_committed:
            return
        seq.num_committed = num_tokens
        if not self.prefix_caching:
            return
        bs = self.block_size
        for i in range(len(seq.cache_ids), num_tokens // bs):
            parent = seq.cache_ids[-1] if seq.cache_ids else _ROOT_CACHE_ID
            key = (parent, tuple(seq.token_ids[i * bs:(i + 1) * bs]))
            block = self._blocks[seq.block_table[i]]
            if block.cache_key is None:
                existing = self._cache.get(key)
                if existing is None:
                    self._register(block, key)
                else:  # same content computed twice: keep the first copy, ours stays private
                    seq.cache_ids.append(self._blocks[existing].cache_id)
                    continue
            # NOTE: a block registered by a sharer (fork) may sit under another, equivalent
            # parent id; any cache id names exactly one token prefix, so it is still correct.
            seq.cache_ids.append(block.cache_id)

    def truncate(self, seq_id: Hashable, num_tokens: int) -> None:
        """Drop tokens past `num_tokens` (rejected drafts) and release unneeded blocks.

        A partially kept block that is registered stays registered (its content
        is intact); the next `append` copies or unregisters it before writing.
        """
        seq = self._get(seq_id)
        if not 0 <= num_tokens <= len(seq.token_ids):
            raise ValueError(f"sequence {seq_id!r}: cannot truncate to {num_tokens} tokens, it holds {len(seq.token_ids)}")
        num_kept_blocks = self.blocks_needed(num_tokens)
        for block_id in reversed(seq.block_table[num_kept_blocks:]):
            self._release(block_id)
        del seq.block_table[num_kept_blocks:]
        del seq.token_ids[num_tokens:]
        seq.num_committed = min(seq.num_committed, num_tokens)
        del seq.cache_ids[seq.num_committed // self.block_size:]

    def fork(self, parent_id: Hashable, child_id: Hashable) -> None:
        """Create `child_id` sharing all of the parent's blocks, tokens and commits."""
        parent = self._get(parent_id)
        if child_id in self._seqs:
            raise ValueError(f"sequence {child_id!r} already exists")
        for block_id in parent.block_table:
            self._blocks[block_id].ref_count += 1
        self._seqs[child_id] = _Sequence(list(parent.token_ids), list(parent.block_table),
                                         parent.num_committed, list(parent.cache_ids))

    def free(self, seq_id: Hashable) -> None:
        """Release the sequence; its cached blocks become evictable, the rest free."""
        seq = self._get(seq_id)
        # Tail first, so a prompt's later blocks are evicted before its shared head.
        for block_id in reversed(seq.block_table):
            self._release(block_id)
        del self._seqs[seq_id]

    def reset_prefix_cache(self) -> None:
        """Drop all evictable cached blocks back to the free list (live ones stay)."""
        while self._evictable:
            block_id, _ = self._evictable.popitem(last=False)
            self._unregister(self._blocks[block_id])
            self._free_block_ids.append(block_id)

    def has_seq(self, seq_id: Hashable) -> bool:
        return seq_id in self._seqs

    def block_table(self, seq_id: Hashable) -> list[int]:
        return list(self._get(seq_id).block_table)

    def num_tokens(self, seq_id: Hashable) -> int:
        return len(self._get(seq_id).token_ids)

    def num_committed_tokens(self, seq_id: Hashable) -> int:
        return self._get(seq_id).num_committed

    def slots(self, seq_id: Hashable, start: int, end: int) -> list[int]:
        """Physical slot ids of positions [start, end)."""
        seq = self._get(seq_id)
        if not 0 <= start <= end <= len(seq.token_ids):
            raise ValueError(f"sequence {seq_id!r}: positions [{start}, {end}) outside [0, {len(seq.token_ids)})")
        bs, table = self.block_size, seq.block_table
        return [table[p // bs] * bs + p % bs for p in range(start, end)]

    def rewrite(self, seq_id: Hashable, start: int, token_ids: Sequence[int]) -> None:
        """Name other tokens at uncommitted positions start.. (a draft tree's accepted path, whose K/V
        the caller moved onto those positions); nothing is allocated or freed."""
        seq = self._get(seq_id)
        if not seq.num_committed <= start <= start + len(token_ids) <= len(seq.token_ids):
            raise ValueError(f"sequence {seq_id!r}: cannot rewrite [{start}, {start + len(token_ids)}) of "
                             f"{len(seq.token_ids)} tokens, {seq.num_committed} committed")
        seq.token_ids[start:start + len(token_ids)] = list(token_ids)

    def _get(self, seq_id: Hashable) -> _Sequence:
        seq = self._seqs.get(seq_id)
        if seq is None:
            raise ValueError(f"unknown sequence {seq_id!r}")
        return seq

    def _match_prefix(self, token_ids: list[int]) -> tuple[list[int], list[int]]:
        """Cached blocks matching the prompt's leading full blocks, and their cache ids."""
        if not self.prefix_caching:
            return [], []
        bs = self.block_size
        hit_block_ids: list[int] = []
        cache_ids: list[int] = []
        parent = _ROOT_CACHE_ID
        # NOTE: never the block holding the last prompt token: the caller must compute at
        # least one token, and it would write that token into a shared cached block.
        for i in range((len(token_ids) - 1) // bs):
            block_id = self._cache.get((parent, tuple(token_ids[i * bs:(i + 1) * bs])))
            if block_id is None:
                break
            parent = self._blocks[block_id].cache_id
            hit_block_ids.append(block_id)
            cache_ids.append(parent)
        return hit_block_ids, cache_ids

    def _acquire(self, block_id: int) -> None:
        block = self._blocks[block_id]
        if block.ref_count == 0:
            del self._evictable[block_id]
        block.ref_count += 1

    def _take_fresh(self) -> int:
        """A block with ref 1 and no cached content; evicts the LRU cached block if needed."""
        if self._free_block_ids:
            block_id = self._free_block_ids.popleft()
        else:
            block_id, _ = self._evictable.popitem(last=False)
            self._unregister(self._blocks[block_id])
        self._blocks[block_id].ref_count = 1
        return block_id

    def _release(self, block_id: int) -> None:
        block = self._blocks[block_id]
        _check(block.ref_count > 0, f"double free of block {block_id}")
        block.ref_count -= 1
        if block.ref_count == 0:
            if block.cache_key is not None:
                self._evictable[block_id] = None  # most recently used end
            else:
                self._free_block_ids.append(block_id)

    def _register(self, block: _Block, key: CacheKey) -> None:
        block.cache_key = key
        block.cache_id = self._next_cache_id
        self._next_cache_id += 1
        self._cache[key] = block.block_id

    def _unregister(self, block: _Block) -> None:
        del self._cache[block.cache_key]
        block.cache_key = None
        block.cache_id = _ROOT_CACHE_ID

    def check_invariants(self) -> None:
        """Raise AssertionError if any bookkeeping invariant is broken (for tests)."""
        bs = self.block_size
        refs = [0] * self.num_blocks
        for seq_id, seq in self._seqs.items():
            table = seq.block_table
            _check(len(table) == self.blocks_needed(len(seq.token_ids)), f"{seq_id!r}: table size")
            _check(len(set(table)) == len(table), f"{seq_id!r}: a block appears twice in its table")
            _check(0 <= seq.num_committed <= len(seq.token_ids), f"{seq_id!r}: committed count")
            num_chained = seq.num_committed // bs if self.prefix_caching else 0
            _check(len(seq.cache_ids) == num_chained, f"{seq_id!r}: cache id chain length")
            for i, block_id in enumerate(table):
                refs[block_id] += 1
                key = self._blocks[block_id].cache_key
                if key is not None:  # what the sequence holds must agree with the cached content
                    chunk = tuple(seq.token_ids[i * bs:(i + 1) * bs])
                    _check(key[1][:len(chunk)] == chunk, f"{seq_id!r}: block {block_id} differs from its key")
        free = set(self._free_block_ids)
        _check(len(free) == len(self._free_block_ids), "a block is twice in the free list")
        num_registered = 0
        for block in self._blocks:
            b = block.block_id
            places = (b in free) + (b in self._evictable) + (refs[b] > 0)
            _check(places == 1, f"block {b} is in {places} of free/evictable/used")
            _check(block.ref_count == refs[b], f"block {b}: ref {block.ref_count} but in {refs[b]} tables")
            if block.cache_key is None:
                _check(b not in self._evictable, f"evictable block {b} is not cached")
                _check(block.cache_id == _ROOT_CACHE_ID, f"unregistered block {b} has a cache id")
            else:
                num_registered += 1
                _check(b not in free, f"free block {b} is still cached")
                _check(self._cache.get(block.cache_key) == b, f"block {b}: cache index mismatch")
                _check(len(block.cache_key[1]) == bs, f"cached block {b} is not full")
                _check(block.cache_key[0] < block.cache_id, f"block {b}: parent id not older than it")
        _check(num_registered == len(self._cache), "cache index holds unknown blocks")
        _check(self.prefix_caching or not self._cache, "prefix caching off but blocks cached")
