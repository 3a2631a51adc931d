"""Stop strings over a stream of text pieces.

Text that might be the start of a stop string is held back until it is
known not to be, so a stop string never reaches the user, even when it is
split across tokens. It knows nothing about tokens.
"""
from __future__ import annotations


class StopMatcher:
    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self.pending = ""

    def push(self, piece: str) -> tuple[str, bool]:
        """Feed new text; returns (text safe to emit now, whether a stop string was hit)."""
        if not self.stops:
            return piece, False
        self.pending += piece
        hits = [i for i in (self.pending.find(s) for s in self.stops) if i >= 0]
        if hits:
            out, self.pending = self.pending[: min(hits)], ""
            return out, True
        hold = 0
        for s in self.stops:  # longest suffix of pending that is a proper prefix of a stop string
            for n in range(min(len(s) - 1, len(self.pending)), hold, -1):
                if self.pending.endswith(s[:n]):
                    hold = n
                    break
        cut = len(self.pending) - hold
        out, self.pending = self.pending[:cut], self.pending[cut:]
        return out, False

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out
