"""The interface every backend offers, and what they share.

`stream_sync` is the generator a backend implements: the native backend through
the engine core (concurrent requests share its steps), llama.cpp and onnxruntime
through `generator.generate_stream`, one request at a time behind a lock, so
their KV state is never shared by two streams. `stream` runs it on a worker
thread and hands the same events to asyncio code; `generate` collects a whole
answer.
"""
from __future__ import annotations

import asyncio
import math
import threading
from abc import ABC, abstractmethod
from typing import AsyncIterator, Iterator

import torch

from edge_runtime.engine import sampling_defaults
from edge_runtime.model.chat_template import ChatTemplate
from edge_runtime.engine.generator import Runner, generate_stream
from edge_runtime.request import GenerationRequest, GenerationResult, StreamEvent, Usage


class Backend(ABC):
    name: str = "?"
    runner: Runner
    template: ChatTemplate

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.drafter = None  # speculative drafting (set_draft): None decodes one token per step
        self.draft = "none"
        self.sampling_defaults = sampling_defaults.NONE  # what chat and serve sample with (the model's GGUF may say)

    def set_draft(self, name: str, k: int | None = None, allow_inexact: bool = False) -> None:
        """Speculative drafting for this backend's requests: "auto", "none", "ngram" (prompt lookup) or
        "mtp" (the model's trained multi-token-prediction heads), "mtp-ngram" (prompt lookup where the last two tokens
        or more match, else the heads) or "mtp-tree" (their draft trees, tree.py); "mtp-attn*" (the attention head)
        drafts in the native backend's batch engine only and is refused here;
        `k` fixes the draft length, or the tree's size in drafts (default: adaptive). Output is unchanged;
        see speculative.py."""
        from edge_runtime.errors import InvalidRequestError
        from edge_runtime.spec.speculative import make_drafter, resolve_draft

        if name.endswith("tree") and k is not None and not 1 <= k <= 15:
            raise InvalidRequestError(f"a draft tree holds 1 to 15 drafts (16 rows a pass), not {k}")
        drafter = make_drafter(name, self, allow_inexact)
        if drafter is not None:
            drafter.fixed_k = k
        self.drafter, self.draft = drafter, resolve_draft(name, self)

    @property
    def n_ctx(self) -> int:
        return self.runner.n_ctx

    def tokenize(self, text: str, special: bool = True) -> list[int]:
        return self.runner.tokenize(text, special)

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix, so the next request is evaluated in full (a benchmark's cold start)."""
        self.runner.reset()

    def stream_sync(self, request: GenerationRequest, cancel: threading.Event | None = None) -> Iterator[StreamEvent]:
        """Yield start, delta..., finish. Bad input raises an EdgeRuntimeError before anything is yielded."""
        with self._lock:
            yield from generate_stream(self.runner, self.template, request, self.name, cancel, self.drafter,
                                       getattr(self, "tokenizer_fingerprint", ""))

    async def stream(self, request: GenerationRequest, prefix: str | None = None) -> AsyncIterator[StreamEvent]:
        """Async view of `stream_sync`; `prefix` overrides request.prefix (assistant text to continue)."""
        if prefix is not None:
            request.prefix = prefix
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        cancel = threading.Event()
        done = object()

        def put(item) -> None:
            try:
                loop.call_soon_threadsafe(queue.put_nowait, item)
            except RuntimeError:  # the loop is gone: nobody is listening any more
                cancel.set()

        def work() -> None:
            try:
                for ev in self.stream_sync(request, cancel):
                    put(ev)
            except Exception as e:  # errors travel in the stream
                put(StreamEvent("error", error=str(e), source="local", info={"code": getattr(e, "code", "internal")}))
            finally:
                put(done)

        thread = threading.Thread(target=work, daemon=True)
        thread.start()
        try:
            while (ev := await queue.get()) is not done:
                yield ev
        finally:
            cancel.set()
            if thread.is_alive():  # let it leave torch before anyone exits the process under it
                await asyncio.to_thread(thread.join, 30)

    def generate(self, request: GenerationRequest, on_delta=None) -> GenerationResult:
        text, ids, finish, usage, info = [], [], "length", Usage(), {}
        for ev in self.stream_sync(request):
            if ev.type == "delta":
                text.append(ev.text)
                ids.extend(ev.token_ids)
                if on_delta is not None:
                    on_delta(ev)
            elif ev.type == "finish":
                finish, usage, info = ev.finish_reason, ev.usage, ev.info
        return GenerationResult(text="".join(text), token_ids=ids, finish_reason=finish, usage=usage,
                                backend=self.name, ttft_ms=info.get("ttft_ms", 0.0),
                                decode_tok_per_s=info.get("decode_tok_per_s", 0.0), timings=info)

    @abstractmethod
    def logits(self, token_ids: list[int]) -> torch.Tensor:
        """Teacher-forced logits fp32 [len(token_ids), vocab] from a fresh context (perplexity, agreement)."""

    def perplexity(self, token_ids: list[int], n_ctx: int) -> dict:
        """llama.cpp's method: non-overlapping windows of n_ctx tokens, scoring the second half of each."""
        nll, count = 0.0, 0
        first = n_ctx // 2
        for start in range(0, len(token_ids) - n_ctx + 1, n_ctx):
            window = token_ids[start:start + n_ctx]
            logp = torch.log_softmax(self.logits(window), dim=-1)
            targets = torch.tensor(window[first + 1:])
            nll -= float(logp[first:-1].gather(1, targets[:, None]).sum())
            count += len(targets)
        if count == 0:
            return {"ppl": float("nan"), "tokens": 0, "windows": 0}
        return {"ppl": math.exp(nll / count), "tokens": count, "windows": (len(token_ids) // n_ctx)}
