"""One request's answer as it is built: sampling, detokenization, stop strings and limits.

The engine core (batch_engine.py) and the single-sequence loop that drives the llama.cpp
and onnxruntime backends (generator.py) feed their sampled tokens through a `Completion`,
and both build a request's token ids with `request_ids`, so the rules for what a request
computes, what text a token makes, when an answer stops and what is held back live here and
nowhere else:

- an end-of-generation token ends the answer (`stop`) and is not part of it, unless the
  request says `ignore_eos`;
- text is released as soon as it is complete UTF-8 and cannot be the start of a stop
  string; a stop string ends the answer (`stop`) and is not part of its text;
- `max_tokens` answer tokens, or a full context window, end it (`length`).
"""
from __future__ import annotations

import copy
from typing import Callable

import torch

from edge_runtime.engine.detokenizer import IncrementalDetokenizer
from edge_runtime.engine.sampler import Sampler
from edge_runtime.engine.stop_matcher import StopMatcher
from edge_runtime.errors import InvalidRequestError
from edge_runtime.model.chat_template import ChatTemplate
from edge_runtime.request import GenerationRequest, SamplingParams


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


def build_prompt(request: GenerationRequest, template: ChatTemplate) -> str:
    """The text the model continues: the chat template (or raw prompt) plus any assistant prefix."""
    if request.messages is not None:
        return template.render(request.messages, add_generation_prompt=True) + request.prefix
    return request.prompt + request.prefix


def prompt_ids(runner, text: str) -> list[int]:
    ids = runner.tokenize(text, special=True)
    if runner.add_bos and runner.bos_id is not None and (not ids or ids[0] != runner.bos_id):
        ids = [runner.bos_id] + ids
    return ids


def prompt_token_ids(runner, request: GenerationRequest, template: ChatTemplate, tokenizer: str = "") -> list[int]:
    """The rendered prompt's token ids, without the assistant prefix. With a tokenizer fingerprint they are
    computed once per request and kept on it (`request.prompt_token_ids`), so whoever asks next with the
    same tokenizer (the gateway's context check, the router's size rule, the engine) gets the same ids."""
    if tokenizer and request.prompt_token_ids is not None and request.prompt_tokenizer == tokenizer:
        return request.prompt_token_ids
    plain = copy.copy(request)
    plain.prefix = ""
    ids = prompt_ids(runner, build_prompt(plain, template))
    if tokenizer:
        request.prompt_token_ids, request.prompt_tokenizer = ids, tokenizer
    return ids


def request_ids(runner, request: GenerationRequest, template: ChatTemplate, vocab_size: int,
                tokenizer: str = "") -> list[int]:
    """The token ids the model continues: the rendered prompt, then the assistant prefix.

    With `prefix_token_ids` the prefix is those tokens (a hand-off from a model
    with the same tokenizer continues token for token); a prefix given as text only
    is tokenized together with the prompt (BPE merges may cross the boundary).
    """
    if request.prefix and request.prefix_token_ids is None:
        return prompt_ids(runner, build_prompt(request, template))
    ids = list(prompt_token_ids(runner, request, template, tokenizer))
    if request.prefix_token_ids:
        bad = [t for t in request.prefix_token_ids if t >= vocab_size]
        if bad:
            raise InvalidRequestError(f"prefix_token_ids holds {bad[0]}, outside the vocabulary of {vocab_size} tokens")
        ids += list(request.prefix_token_ids)
    return ids


def confidence(logits: torch.Tensor) -> dict:
    """The model's own uncertainty at one position: entropy (nats) and top-1 minus top-2 probability."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    p = logp.exp()
    top = torch.topk(p, 2).values
    return {"entropy": float(-(p * logp).sum()), "margin": float(top[0] - top[1])}
