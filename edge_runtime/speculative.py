"""Draft proposers for speculative decoding (issue 7; verification lives in the runner and generator).

`NgramProposer` is prompt lookup: when the last n tokens of the context also
occurred earlier, the tokens that followed that earlier occurrence are the
draft. It needs no model and no training, and pays on input-grounded work
(editing, summarizing, rewriting a given passage), where the answer copies
long spans of its input. Longer n-grams are tried first (more specific), the
most recent occurrence wins, and an index of n-gram -> last end position is
kept up to date incrementally, so a proposal costs O(max_n) dictionary look-ups.
"""
from __future__ import annotations


class NgramProposer:
    def __init__(self, max_n: int = 3, min_n: int = 1):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        self.max_n, self.min_n = max_n, min_n
        self._ids: list[int] = []
        self._last: dict[tuple, int] = {}  # n-gram -> the index just after its latest occurrence (excluding the tail)
        self._indexed = 0  # positions [0, _indexed) have their n-grams in _last

    def reset(self) -> None:
        self._ids, self._last, self._indexed = [], {}, 0

    def _index_upto(self, end: int) -> None:
        """Index every n-gram ending before position `end` (so the current tail never matches itself)."""
        for pos in range(self._indexed, end):
            for n in range(self.min_n, self.max_n + 1):
                if pos + 1 >= n:
                    self._last[tuple(self._ids[pos + 1 - n:pos + 1])] = pos + 1
        self._indexed = end

    def propose(self, context: list[int], k: int) -> list[int]:
        """Up to k draft tokens continuing `context` (the whole token history: prompt and answer so far)."""
        if k < 1 or len(context) < self.min_n + 1:
            return []
        if context[:len(self._ids)] != self._ids:  # a different history: start over
            self.reset()
        self._ids = list(context)
        self._index_upto(len(context) - 1)  # n-grams ending at the last token are the query, not the index
        for n in range(min(self.max_n, len(context) - 1), self.min_n - 1, -1):
            start = self._last.get(tuple(context[-n:]))
            if start is not None:
                return context[start:start + k]
        return []
