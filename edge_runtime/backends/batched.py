"""Continuous batching on the device: concurrent requests to the native backend share engine steps.

`BatchedNative` wraps a NativeBackend. Its requests go to a BatchEngine (the worker's continuous-
batching engine, batch_engine.py) on its own thread over a shallow copy of the same model: the
weights are shared, the paged KV cache and the fused decoder are the engine's own, and concurrent
requests are rows of the same steps. So two clients of `edge-runtime serve` no longer wait for each
other's whole answers. A request that asks for per-token confidences (the hybrid runtime's escalation
monitor) takes the wrapped backend's single-stream path (which drafts); its steps and the engine's
take turns (one lock around each step's compute) rather than oversubscribing the cores.

Each row of a batched step gets the one-token step's bits (`--arith int8`:
tests/edge_runtime/model/test_fused_decode.py) and prompts go through the same chunked prefill, so a greedy
answer equals the same request answered alone by the single-stream path (tested through `serve`).
With n-gram drafting configured (`--draft auto` resolves to it) the engine drafts for a sequence
while it runs alone (drafting.py), so a lone request keeps the single-stream path's speed-up;
with company every sequence decodes one token per step. MTP drafts are the single-stream path's
only (the engine does not run the heads).
"""
from __future__ import annotations

import copy
import itertools
import queue
import threading
import time
from typing import Iterator

import torch

from edge_runtime.engine.batch_engine import BatchEngine
from edge_runtime.request import GenerationRequest, StreamEvent
from edge_runtime.engine.scheduler import SchedulerConfig
from edge_runtime.backends.base import Backend


def usable(backend) -> bool:
    """Whether `backend` can batch: the native backend on the CPU with the file's blocks and our C kernels."""
    model = getattr(backend, "model", None)
    return (getattr(backend, "name", "") == "native" and getattr(backend, "quant", None) == "gguf"
            and bool(getattr(backend, "fused", False)) and model is not None and model.device.type == "cpu")


class BatchedNative(Backend):
    name = "native"

    def __init__(self, inner, max_batch: int = 8):
        # NOTE: Backend.__init__ is not called: drafting, sampling defaults and the single-stream lock are the
        # wrapped backend's (see __getattr__)
        self.inner = inner
        engine_model = copy.copy(inner.model)  # the same modules (weights); its own cache and fused decoder below
        engine_model.kv = engine_model.fused = engine_model.last_hidden = None
        config = SchedulerConfig(max_batch, max(512, 256 + max_batch), 256)
        inner.runner.compute_lock = lock = threading.Lock()  # the two paths take turns by step
        self.engine = BatchEngine(engine_model, inner.tokenizer, inner.template, inner.n_ctx,
                                  kv_config=inner.kv_config, config=config, model_name="native", source="local",
                                  step_lock=lock, draft="ngram" if inner.draft == "ngram" else "none").start()
        self.max_batch = max_batch
        self._ids = itertools.count()

    def __getattr__(self, name):  # everything else is the wrapped backend's (runner, template, path, draft, ...)
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    @property
    def n_ctx(self) -> int:
        return min(self.inner.n_ctx, self.engine.n_ctx)

    def set_draft(self, name: str, k: int | None = None, allow_inexact: bool = False) -> None:
        self.inner.set_draft(name, k, allow_inexact)
        self.engine.draft = "ngram" if self.inner.draft == "ngram" else "none"  # the engine drafts n-gram only

    def logits(self, token_ids: list[int]) -> torch.Tensor:
        return self.inner.logits(token_ids)

    def close(self) -> None:
        self.engine.stop()

    def stream_sync(self, request: GenerationRequest, cancel: threading.Event | None = None) -> Iterator[StreamEvent]:
        """start, delta..., finish, as the single-stream path yields them; bad input raises before start."""
        if request.confidence:  # the escalation monitor reads per-token confidences: the single-stream path
            yield from self.inner.stream_sync(request, cancel)
            return
        ids = self.engine.prepare(request)
        rid = f"local-{next(self._ids)}"
        events: queue.Queue = queue.Queue()
        t0 = time.perf_counter()
        yield StreamEvent("start", info={"backend": self.name, "prompt_tokens": len(ids)})
        self.engine.submit(rid, request, events.put, prompt_token_ids=ids)
        cancelled, done, first, generated = False, False, None, 0
        try:
            while True:
                if cancel is not None and cancel.is_set() and not cancelled:
                    self.engine.cancel(rid)  # its KV blocks are freed at once; it finishes "cancelled"
                    cancelled = True
                try:
                    ev = events.get(timeout=0.05)
                except queue.Empty:
                    continue
                if ev.type == "delta":
                    first = first or time.perf_counter()
                    generated += len(ev.token_ids)
                    yield ev
                    continue
                now = time.perf_counter()
                decode_s = now - (first or now)
                ev.info = {**ev.info, "backend": self.name, "ttft_ms": ((first or now) - t0) * 1000.0,
                           "decode_tok_per_s": (generated - 1) / decode_s if generated > 1 and decode_s > 0 else 0.0,
                           "total_s": now - t0}
                done = True
                yield ev
                return
        finally:
            if not done and not cancelled:  # the reader left early (a closed generator): stop generating for it
                self.engine.cancel(rid)
