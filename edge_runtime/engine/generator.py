"""The generation loop every local backend shares.

A backend supplies a `Runner` (tokenize, evaluate a prompt reusing whatever
prefix it already holds, evaluate one more token); this loop renders the
prompt, checks the context, samples, detokenizes incrementally, applies stop
strings and limits, and yields `StreamEvent`s. It knows nothing about how
logits are computed.
"""
from __future__ import annotations

import copy
import threading
import time
from typing import Iterator, Protocol

import torch

from edge_runtime.model.chat_template import ChatTemplate
from edge_runtime.engine.detokenizer import IncrementalDetokenizer
from edge_runtime.errors import ContextLengthError, InvalidRequestError
from edge_runtime.request import GenerationRequest, StreamEvent, Usage
from edge_runtime.engine.sampler import Sampler
from edge_runtime.spec.speculative import Speculator
from edge_runtime.engine.stop_matcher import StopMatcher


class Runner(Protocol):
    n_ctx: int
    eog_ids: set[int]
    add_bos: bool
    bos_id: int | None

    def tokenize(self, text: str, special: bool = True) -> list[int]: ...
    def token_bytes(self, token_id: int) -> bytes: ...
    def prefill(self, token_ids: list[int]) -> torch.Tensor: ...  # logits [vocab] after the last id
    def step(self, token_id: int) -> torch.Tensor: ...  # append one token -> logits [vocab]
    def reset(self) -> None: ...  # forget the cached prefix


def build_prompt(request: GenerationRequest, template: ChatTemplate) -> str:
    """The text the model continues: the chat template (or raw prompt) plus any assistant prefix."""
    if request.messages is not None:
        return template.render(request.messages, add_generation_prompt=True) + request.prefix
    return request.prompt + request.prefix


def prompt_ids(runner: Runner, text: str) -> list[int]:
    ids = runner.tokenize(text, special=True)
    if runner.add_bos and runner.bos_id is not None and (not ids or ids[0] != runner.bos_id):
        ids = [runner.bos_id] + ids
    return ids


def request_ids(runner: Runner, request: GenerationRequest, template: ChatTemplate, vocab_size: int) -> list[int]:
    """The token ids the model continues: the rendered prompt, then the assistant prefix.

    With `prefix_token_ids` the prefix is those tokens (a hand-off from a model
    with the same tokenizer continues token for token); otherwise its text is
    tokenized together with the prompt.
    """
    if request.prefix_token_ids is None:
        return prompt_ids(runner, build_prompt(request, template))
    bad = [t for t in request.prefix_token_ids if t >= vocab_size]
    if bad:
        raise InvalidRequestError(f"prefix_token_ids holds {bad[0]}, outside the vocabulary of {vocab_size} tokens")
    plain = copy.copy(request)
    plain.prefix = ""
    return prompt_ids(runner, build_prompt(plain, template)) + list(request.prefix_token_ids)


def confidence(logits: torch.Tensor) -> dict:
    """The model's own uncertainty at one position: entropy (nats) and top-1 minus top-2 probability."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    p = logp.exp()
    top = torch.topk(p, 2).values
    return {"entropy": float(-(p * logp).sum()), "margin": float(top[0] - top[1])}


def generate_stream(runner: Runner, template: ChatTemplate, request: GenerationRequest, backend: str,
                    cancel: threading.Event | None = None, drafter=None) -> Iterator[StreamEvent]:
    """Yield start, delta..., finish for one request. Raises EdgeRuntimeError before 'start' on bad input.

    With a `drafter` (speculative.py) and a runner that can `verify` several tokens in one pass,
    tokens are drafted and verified: the output is the same (greedy: bit for bit; sampled: in
    distribution), only faster when drafts are accepted."""
    params = request.params
    ids = request_ids(runner, request, template, getattr(runner, "vocab_size", 1 << 62))
    if not ids:
        ids = [runner.bos_id if runner.bos_id is not None else 0]
    if len(ids) >= runner.n_ctx:
        limit = getattr(runner, "n_ctx_reason", None) or f"the context window is {runner.n_ctx} tokens"
        raise ContextLengthError(
            f"prompt is {len(ids)} tokens but {limit} (at least one token must be left to generate)"
        )
    sampler = Sampler(params)
    detok = IncrementalDetokenizer(runner.token_bytes)
    stops = StopMatcher(params.stop)
    spec = Speculator(runner, drafter) if drafter is not None and hasattr(runner, "verify") else None
    seq = 0
    t_start = time.perf_counter()
    yield StreamEvent("start", info={"backend": backend, "prompt_tokens": len(ids)})
    logits = runner.prefill(ids)
    # the prompt's representation, for the difficulty probe: only runners that keep it (native) have it
    hidden = getattr(runner, "last_hidden", None) if request.confidence else None
    t_first = None
    history = list(ids)
    generated: list[int] = []
    finish = "length"
    stop_hit = False
    while True:
        if cancel is not None and cancel.is_set():
            finish = "cancelled"
            break
        conf = confidence(logits) if request.confidence else None
        token = sampler.sample(logits, history, draft=spec.draft() if spec else None)
        if t_first is None:
            t_first = time.perf_counter()
        if token in runner.eog_ids and not params.ignore_eos:
            finish = "stop"
            break
        generated.append(token)
        history.append(token)
        text, hit = stops.push(detok.push(token))
        if text or not hit:
            if hidden is not None:  # the first delta's info carries it
                conf["hidden"], hidden = hidden, None
            yield StreamEvent("delta", seq=seq, text=text, token_ids=[token], info=conf or {})
            seq += 1
        if hit:
            finish, stop_hit = "stop", True
            break
        if len(generated) >= params.max_tokens or len(history) >= runner.n_ctx:
            finish = "length"
            break
        logits = spec.next_logits(token, history, params.max_tokens - len(generated)) if spec else runner.step(token)
    if spec is not None:
        spec.finish(history)  # drafts nobody checked leave the KV cache
    if not stop_hit:
        tail, _ = stops.push(detok.flush())
        tail += stops.flush()
        if tail:
            yield StreamEvent("delta", seq=seq, text=tail, token_ids=[])
            seq += 1
    t_end = time.perf_counter()
    t_first = t_first or t_end
    decode_s = t_end - t_first
    info = {
        "backend": backend,
        "ttft_ms": (t_first - t_start) * 1000.0,
        "decode_tok_per_s": (len(generated) - 1) / decode_s if len(generated) > 1 and decode_s > 0 else 0.0,
        "total_s": t_end - t_start,
    }
    if spec is not None:
        info["draft"] = spec.stats()
    yield StreamEvent("finish", seq=seq, finish_reason=finish,
                      usage=Usage(prompt_tokens=len(ids), completion_tokens=len(generated)), info=info)
