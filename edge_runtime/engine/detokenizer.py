"""Turn a stream of token ids into a stream of text without broken characters.

One token can end in the middle of a UTF-8 character (byte-level BPE splits
emoji and CJK characters across tokens). `IncrementalDetokenizer` keeps the
bytes of an incomplete character until the next token completes it, and
turns bytes that can never become a valid character into U+FFFD as soon as
that is certain, so the streamed pieces add up to exactly
`b"".join(all token bytes).decode("utf-8", errors="replace")`.

It knows nothing about vocabularies: it is given a `token_bytes_fn`
(e.g. `Tokenizer.token_bytes`), and it does not strip special tokens or stop
strings; callers decide which ids to push.
"""
from __future__ import annotations

import codecs
from typing import Callable


class IncrementalDetokenizer:
    """Stateful bytes -> str for one generation stream. Not thread-safe."""

    def __init__(self, token_bytes_fn: Callable[[int], bytes]):
        self._token_bytes = token_bytes_fn
        # NOTE: the stdlib's incremental UTF-8 decoder buffers an incomplete
        # trailing sequence and emits U+FFFD for a byte only once no later
        # byte can make it valid; its output over any split equals a one-shot
        # decode with errors="replace" (the same maximal-subpart rule).
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._num_tokens = 0

    def push(self, token_id: int) -> str:
        """Add one token; return the text it completes ('' while a character is unfinished)."""
        self._num_tokens += 1
        return self._decoder.decode(self._token_bytes(token_id), final=False)

    def push_many(self, token_ids: list[int]) -> str:
        """Same as concatenating `push` over `token_ids`."""
        self._num_tokens += len(token_ids)
        return self._decoder.decode(b"".join(self._token_bytes(t) for t in token_ids), final=False)

    def flush(self) -> str:
        """End of stream: return held-back bytes, incomplete ones as U+FFFD. Resets the state."""
        text = self._decoder.decode(b"", final=True)
        self._decoder.reset()
        return text

    @property
    def num_pending_bytes(self) -> int:
        """Bytes held back because they may start a character the next token completes."""
        pending, _ = self._decoder.getstate()
        return len(pending)

    @property
    def num_tokens(self) -> int:
        """Tokens pushed so far."""
        return self._num_tokens
