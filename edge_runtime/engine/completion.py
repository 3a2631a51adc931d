"""One request's answer as it is built: sampling, detokenization, stop strings and limits.

Both generation loops (the batch engine and the single-stream loop that the llama.cpp
and onnxruntime backends drive) feed their sampled tokens through a `Completion`, so the
rules for what text a token makes, when an answer stops and what is held back live here
and nowhere else:

- an end-of-generation token ends the answer (`stop`) and is not part of it, unless the
  request says `ignore_eos`;
- text is released as soon as it is complete UTF-8 and cannot be the start of a stop
  string; a stop string ends the answer (`stop`) and is not part of its text;
- `max_tokens` answer tokens, or a full context window, end it (`length`).
"""
from __future__ import annotations

from typing import Callable

import torch

from edge_runtime.engine.detokenizer import IncrementalDetokenizer
from edge_runtime.engine.sampler import Sampler
from edge_runtime.engine.stop_matcher import StopMatcher
from edge_runtime.request import SamplingParams


class Completion:
    def __init__(self, params: SamplingParams, token_bytes: Callable[[int], bytes], eog_ids: set[int], n_ctx: int):
        self.params, self.eog_ids, self.n_ctx = params, eog_ids, n_ctx
        self.sampler = Sampler(params)
        self.detok = IncrementalDetokenizer(token_bytes)
        self.stops = StopMatcher(params.stop)
        self.generated: list[int] = []  # the answer's tokens (an end-of-generation token never is one)
        self.stop_hit = False

    @property
    def room(self) -> int:
        """Answer tokens still allowed by max_tokens."""
        return self.params.max_tokens - len(self.generated)

    def sample(self, logits: torch.Tensor, history: list[int], draft: list[int] | None = None) -> int:
        return self.sampler.sample(logits, history, draft=draft)

    def push(self, token: int, context_len: int) -> tuple[str | None, str | None]:
        """After one sampled token: (the delta's text, or None when there is no delta to send; the finish
        reason, or None while the answer goes on). `context_len`: the sequence's tokens, this one included."""
        if token in self.eog_ids and not self.params.ignore_eos:
            return None, "stop"
        self.generated.append(token)
        text, hit = self.stops.push(self.detok.push(token))
        delta = text if text or not hit else None
        if hit:
            self.stop_hit = True
            return delta, "stop"
        if len(self.generated) >= self.params.max_tokens or context_len >= self.n_ctx:
            return delta, "length"
        return delta, None

    def tail(self) -> str:
        """Once the answer ends: the text held back (incomplete UTF-8, what might have begun a stop string);
        '' after a stop string, whose text is never sent."""
        if self.stop_hit:
            return ""
        text, _ = self.stops.push(self.detok.flush())
        return text + self.stops.flush()
