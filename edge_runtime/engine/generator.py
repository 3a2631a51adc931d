"""The single-sequence loop for backends that keep their own KV state (llama.cpp, onnxruntime).

Those backends evaluate one request at a time through a `Runner` (tokenize, evaluate a prompt
reusing whatever prefix it already holds, evaluate one more token, optionally verify several);
this loop drives it: a `Completion` (completion.py, shared with the engine core) samples,
detokenizes, applies stop strings and limits, and the loop yields `StreamEvent`s. The native
backend does not use it: its requests go through the engine core (batch_engine.py). It knows
nothing about how logits are computed.
"""
from __future__ import annotations

import threading
import time
from typing import Iterator, Protocol

import torch

from edge_runtime.engine.completion import Completion, confidence, request_ids
from edge_runtime.errors import ContextLengthError
from edge_runtime.model.chat_template import ChatTemplate
from edge_runtime.request import GenerationRequest, StreamEvent, Usage
from edge_runtime.spec.speculative import Speculator
from edge_runtime.spec.tree import TreeSpeculator


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


def generate_stream(runner: Runner, template: ChatTemplate, request: GenerationRequest, backend: str,
                    cancel: threading.Event | None = None, drafter=None, tokenizer: str = "") -> Iterator[StreamEvent]:
    """Yield start, delta..., finish for one request. Raises EdgeRuntimeError before 'start' on bad input.

    With a `drafter` (speculative.py) and a runner that can `verify` several tokens in one pass,
    tokens are drafted and verified: the output is the same (greedy: bit for bit; sampled: in
    distribution), only faster when drafts are accepted. `tokenizer`: the runner's tokenizer fingerprint
    (the request's prompt ids are reused when they were made with it)."""
    ids = request_ids(runner, request, template, getattr(runner, "vocab_size", 1 << 62), tokenizer)
    if not ids:
        ids = [runner.bos_id if runner.bos_id is not None else 0]
    if len(ids) >= runner.n_ctx:
        limit = getattr(runner, "n_ctx_reason", None) or f"the context window is {runner.n_ctx} tokens"
        raise ContextLengthError(
            f"prompt is {len(ids)} tokens but {limit} (at least one token must be left to generate)"
        )
    answer = Completion(request.params, runner.token_bytes, runner.eog_ids, runner.n_ctx)
    spec = None
    if drafter is not None and hasattr(runner, "verify"):
        spec = TreeSpeculator(runner, drafter) if hasattr(drafter, "grow") else Speculator(runner, drafter)
    seq = 0
    t_start = time.perf_counter()
    yield StreamEvent("start", info={"backend": backend, "prompt_tokens": len(ids)})
    logits = runner.prefill(ids)
    # the prompt's representation, for the difficulty probe: only runners that keep it have it
    hidden = getattr(runner, "last_hidden", None) if request.confidence else None
    if hidden is not None:  # the final-normed state alone, without the taps MTP drafters may read after it
        hidden = hidden[:runner.model.cfg.dim]
    t_first = None
    history = list(ids)
    finish = None
    while finish is None:
        if cancel is not None and cancel.is_set():
            finish = "cancelled"
            break
        conf = confidence(logits) if request.confidence else {}
        token = answer.sample(logits, history, draft=spec.draft() if spec else None)
        t_first = t_first or time.perf_counter()
        if token not in runner.eog_ids or request.params.ignore_eos:  # an end-of-turn token is not the answer's
            history.append(token)
        text, finish = answer.push(token, len(history))
        if text is not None:
            if hidden is not None:  # the first delta's info carries it
                conf["hidden"], hidden = hidden, None
            yield StreamEvent("delta", seq=seq, text=text, token_ids=[token], info=conf)
            seq += 1
        if finish is None:
            logits = spec.next_logits(token, history, answer.room) if spec else runner.step(token)
    if spec is not None:
        spec.finish(history)  # drafts nobody checked leave the KV cache
    tail = answer.tail() if finish != "cancelled" else ""
    if tail:
        yield StreamEvent("delta", seq=seq, text=tail, token_ids=[])
        seq += 1
    t_end = time.perf_counter()
    t_first = t_first or t_end
    decode_s = t_end - t_first
    generated = len(answer.generated)
    info = {
        "backend": backend,
        "ttft_ms": (t_first - t_start) * 1000.0,
        "decode_tok_per_s": (generated - 1) / decode_s if generated > 1 and decode_s > 0 else 0.0,
        "total_s": t_end - t_start,
    }
    if spec is not None:
        info["draft"] = spec.stats()
    yield StreamEvent("finish", seq=seq, finish_reason=finish,
                      usage=Usage(prompt_tokens=len(ids), completion_tokens=generated), info=info)
