"""The continuous-batching engine: many concurrent requests on one model and one paged KV cache.

`BatchEngine` owns the model, the block manager, the scheduler and the batch
runner, and runs them on one thread (`run_forever`): each step it applies the
commands other threads queued (submit, cancel, hold, park, unpark), schedules,
runs the step, samples each finished chunk's next token with that request's
own sampler, and hands the request's `StreamEvent`s (delta ..., finish) to its
sink. Sinks are called on the engine thread and must not block.

- cancel frees the request's KV blocks at once and finishes it `cancelled`;
- hold keeps its blocks but stops scheduling it (its reader is behind);
- park frees its blocks and keeps its state (its client went away and may
  resume); unpark queues it again, recomputing its tokens so far.

Detokenization, stop strings and limits are applied exactly as in the
single-stream generator, so a request's text here equals the local engine's.
"""
from __future__ import annotations

import collections
import contextlib
import itertools
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from edge_runtime.engine.batch_runner import BatchRunner
from edge_runtime.engine.block_manager import BlockManager
from edge_runtime.model.chat_template import ChatTemplate
from edge_runtime.engine.detokenizer import IncrementalDetokenizer
from edge_runtime.errors import ContextLengthError
from edge_runtime.engine.generator import request_ids
from edge_runtime.engine.kv_cache_config import KVCacheConfig, format_bytes
from edge_runtime.request import GenerationRequest, StreamEvent, Usage
from edge_runtime.engine.sampler import Sampler
from edge_runtime.engine.scheduler import BATCH, INTERACTIVE, Scheduler, SchedulerConfig, Sequence
from edge_runtime.engine.stop_matcher import StopMatcher

Sink = Callable[[StreamEvent], None]


@dataclass(eq=False)
class Job:
    """One request's generation state on the engine."""
    id: str
    request: GenerationRequest
    seq: Sequence
    sink: Sink
    sampler: Sampler
    detok: IncrementalDetokenizer
    stops: StopMatcher
    generated: list[int] = field(default_factory=list)
    next_seq: int = 0  # seq number of the next delta
    parked: bool = False
    done: bool = False
    t_submit: float = field(default_factory=time.perf_counter)
    t_first: float | None = None
    drafting: object = None  # engine_draft.LoneDrafting while it runs alone with drafts


class BatchEngine:
    def __init__(self, model, tokenizer, template: ChatTemplate, n_ctx: int,
                 kv_config: KVCacheConfig | None = None, config: SchedulerConfig | None = None,
                 model_name: str = "model", fused: bool = True, source: str = "cloud", step_lock=None,
                 draft: str = "none"):
        """source: what its events say they came from ("cloud" on the worker, "local" on the device);
        step_lock: held while a step computes (the device's single-stream path shares the weights);
        draft: "ngram" drafts for a sequence that runs alone (drafting.py), "none" never."""
        from edge_runtime.engine.drafting import DRAFTS

        if draft not in DRAFTS:
            raise ValueError(f"the batch engine drafts with {' or '.join(DRAFTS)}, not {draft!r}")
        self.draft = draft
        from kernels.kv_cache import PagedKVCache

        self.model, self.tokenizer, self.template, self.model_name = model, tokenizer, template, model_name
        self.source, self.step_lock = source, step_lock or contextlib.nullcontext()
        self.kv_config = kv = kv_config or KVCacheConfig()
        cfg = model.cfg
        budget = kv.budget_bytes(cfg, n_ctx, model.device)
        num_blocks = PagedKVCache.blocks_for_budget(budget, cfg.num_layers, kv.block_size, cfg.num_kv_heads,
                                                    cfg.head_dim, kv.kv_dtype)
        if num_blocks < 1:
            raise ContextLengthError(f"KV budget {format_bytes(budget)} ({kv.kv_dtype}) holds less than one block")
        self.capacity = num_blocks * kv.block_size
        self.n_ctx = min(n_ctx, self.capacity)  # one sequence always fits alone: no preemption deadlock
        self.kv_budget_text = f"{format_bytes(budget)}, {kv.kv_dtype}"
        model.allocate_cache(self.n_ctx, num_blocks, kv.block_size, kv.kv_dtype)
        if fused and getattr(model, "quant", None) == "gguf":  # the file's blocks with our C kernels
            from kernels import cpu_gemv

            model.enable_fused(cpu_gemv.library())
        self.blocks = BlockManager(num_blocks, kv.block_size)
        self.config = config or SchedulerConfig()
        self.scheduler = Scheduler(self.blocks, self.config)
        self.runner = BatchRunner(model)
        self.eog_ids = set(tokenizer.eog_ids)
        self.add_bos, self.bos_id = bool(tokenizer.add_bos_token), tokenizer.bos_id
        self.jobs: dict[str, Job] = {}
        self._by_seq: dict[int, Job] = {}
        self._commands: collections.deque = collections.deque()
        self._wake = threading.Condition()
        self._seq_ids = itertools.count()
        self._stop = threading.Event()
        self.thread: threading.Thread | None = None
        self.num_steps = 0
        self.max_sequences = 0  # the most sequences one step has carried
        self._draft_done = (0, 0, 0)  # verifications, drafts proposed, drafts accepted of finished jobs
        self.tokens_generated = 0
        self._recent: collections.deque = collections.deque()  # (time, tokens) of recent steps

    # --- the Runner protocol bits prompt_ids() uses ----------------------------------------------
    def tokenize(self, text: str, special: bool = True) -> list[int]:
        return self.tokenizer.encode(text, special=special)

    def token_bytes(self, token_id: int) -> bytes:
        return self.tokenizer.token_bytes(token_id)

    # --- called from any thread ------------------------------------------------------------------
    def prepare(self, request: GenerationRequest, max_prompt_tokens: int | None = None) -> list[int]:
        """The prompt's token ids; raises ContextLengthError when it cannot be served."""
        ids = request_ids(self, request, self.template, self.tokenizer.vocab_size) or [self.bos_id or 0]
        limit = self.n_ctx if max_prompt_tokens is None else min(self.n_ctx, max_prompt_tokens + 1)
        if len(ids) >= limit:
            why = (f"the worker's limit is {max_prompt_tokens} prompt tokens" if limit <= self.n_ctx - 1
                   and max_prompt_tokens is not None else
                   f"the context is {self.n_ctx} tokens (KV budget {self.kv_budget_text})")
            raise ContextLengthError(f"prompt is {len(ids)} tokens but {why}; at least one token must be "
                                     f"left to generate")
        return ids

    def submit(self, id: str, request: GenerationRequest, sink: Sink, priority: str = "interactive",
               prompt_token_ids: list[int] | None = None) -> None:
        ids = prompt_token_ids if prompt_token_ids is not None else self.prepare(request)
        seq = Sequence(next(self._seq_ids), list(ids), len(ids), BATCH if priority == "batch" else INTERACTIVE)
        job = Job(id, request, seq, sink, Sampler(request.params), IncrementalDetokenizer(self.token_bytes),
                  StopMatcher(request.params.stop))
        self._command("submit", job)

    def cancel(self, id: str) -> None:
        self._command("cancel", id)

    def hold(self, id: str, held: bool) -> None:
        self._command("hold", (id, held))

    def park(self, id: str) -> None:
        self._command("park", id)

    def unpark(self, id: str) -> None:
        self._command("unpark", id)

    def _command(self, kind: str, arg) -> None:
        with self._wake:
            self._commands.append((kind, arg))
            self._wake.notify()

    def start(self) -> "BatchEngine":
        self.thread = threading.Thread(target=self.run_forever, name="batch-engine", daemon=True)
        self.thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        with self._wake:
            self._wake.notify()
        if self.thread is not None:
            self.thread.join(timeout=30)

    def run_forever(self) -> None:
        while not self._stop.is_set():
            with self._wake:
                while not self._commands and not self.scheduler.has_work and not self._stop.is_set():
                    self._wake.wait()
            if not self.step():  # nothing could run (e.g. held streams fill the cache): wait for a command
                with self._wake:
                    if not self._commands:
                        self._wake.wait(0.05)

    # --- the engine thread ------------------------------------------------------------------------
    def _apply_commands(self) -> None:
        while self._commands:
            with self._wake:
                kind, arg = self._commands.popleft()
            if kind == "submit":
                self.jobs[arg.id] = self._by_seq[arg.seq.seq_id] = arg
                self.scheduler.add(arg.seq)
                continue
            job = self.jobs.get(arg[0] if kind == "hold" else arg)
            if job is None or job.done:
                continue
            if kind == "cancel":
                self._finish(job, "cancelled")
            elif kind == "hold":
                job.seq.held = arg[1]
            elif kind == "park" and not job.parked:
                if job.drafting is not None:
                    job.drafting.leave(job)
                job.parked = True
                self.scheduler.finish(job.seq)  # its blocks go back at once
            elif kind == "unpark" and job.parked:
                job.parked = False
                self.scheduler.requeue(job.seq)

    def step(self) -> int:
        """One scheduler step; returns the number of tokens computed."""
        self._apply_commands()
        lone = self._lone_job()
        if lone is not None:
            rows = self._draft_step(lone)
            if rows:
                return rows
        for job in self.jobs.values():  # with company, nobody drafts: back to plain rows of the batch
            if job.drafting is not None:
                job.drafting.leave(job)
        out = self.scheduler.schedule()
        if not out.chunks:
            return 0
        with self.step_lock:
            logits = self.runner.run(out.chunks, out.copies)
        self.num_steps += 1
        self.max_sequences = max(self.max_sequences, len(out.chunks))
        sampled = 0
        for chunk, row in zip(out.chunks, logits):
            job = self._by_seq.get(chunk.seq.seq_id)
            token = None
            if row is not None and job is not None and not job.done:
                token = job.sampler.sample(row, chunk.seq.token_ids)
            self.scheduler.update(chunk, token)
            if token is not None:
                sampled += 1
                self._emit_token(job, token)
        now = time.perf_counter()
        self.tokens_generated += sampled
        self._recent.append((now, sampled))
        while self._recent and now - self._recent[0][0] > 10.0:
            self._recent.popleft()
        return out.num_tokens

    def _lone_job(self) -> Job | None:
        """The job to draft for this step: the only one running, nothing waiting, past its first token."""
        running = self.scheduler.running
        if self.draft == "none" or len(running) != 1 or self.scheduler.waiting or self.model.fused is None:
            return None
        job = self._by_seq.get(running[0].seq_id)
        if job is None or job.done or job.seq.held or not job.generated:
            return None
        entered = job.drafting is not None and job.drafting.logits is not None
        if not entered and job.seq.num_computed != job.seq.num_tokens - 1:
            return None  # its prompt (or, after a preemption, its recompute) is not all computed yet
        return job

    def _draft_step(self, job: Job) -> int:
        from edge_runtime.engine.drafting import LoneDrafting, NoRoom

        if job.drafting is None:
            job.drafting = LoneDrafting(self, job)
        before = len(job.generated)
        try:
            rows = job.drafting.run(job, self._emit_token)
        except NoRoom:
            job.drafting.leave(job)
            return 0
        self.num_steps += 1
        self.max_sequences = max(self.max_sequences, 1)
        sampled = len(job.generated) - before
        self.tokens_generated += sampled
        self._recent.append((time.perf_counter(), sampled))
        return rows

    def _emit_token(self, job: Job, token: int) -> None:
        if job.t_first is None:
            job.t_first = time.perf_counter()
        if token in self.eog_ids and not job.request.params.ignore_eos:
            return self._finish(job, "stop")  # the end-of-turn token is not part of the answer
        job.generated.append(token)
        text, hit = job.stops.push(job.detok.push(token))
        if text or not hit:
            self._delta(job, text, [token])
        if hit:
            return self._finish(job, "stop", flush=False)
        if len(job.generated) >= job.request.params.max_tokens or job.seq.num_tokens >= self.n_ctx:
            self._finish(job, "length")

    def _delta(self, job: Job, text: str, token_ids: list[int]) -> None:
        job.sink(StreamEvent("delta", seq=job.next_seq, text=text, token_ids=token_ids, source=self.source))
        job.next_seq += 1

    def _finish(self, job: Job, reason: str, flush: bool = True) -> None:
        if flush:
            tail, _ = job.stops.push(job.detok.flush())
            tail += job.stops.flush()
            if tail and reason != "cancelled":
                self._delta(job, tail, [])
        job.done = True
        if job.drafting is not None:  # its draft figures stay in the engine's totals
            s = job.drafting.spec
            self._draft_done = (self._draft_done[0] + s.verify_steps, self._draft_done[1] + s.proposed,
                                self._draft_done[2] + s.accepted)
            job.drafting = None
        self.scheduler.finish(job.seq)
        del self.jobs[job.id], self._by_seq[job.seq.seq_id]
        now = time.perf_counter()
        first = job.t_first or now
        info = {"ttft_ms": (first - job.t_submit) * 1000.0, "total_s": now - job.t_submit,
                "preemptions": job.seq.num_preemptions, "cached_prompt_tokens": job.seq.num_cached_tokens}
        job.sink(StreamEvent("finish", seq=job.next_seq, finish_reason=reason, source=self.source, info=info,
                             usage=Usage(job.seq.num_prompt_tokens, len(job.generated))))

    # --- views -----------------------------------------------------------------------------------------
    def stats(self) -> dict:
        now = time.perf_counter()
        window = [n for t, n in self._recent if now - t <= 10.0]
        span = (now - self._recent[0][0]) if self._recent else 0.0
        return {**self.scheduler.stats(), "num_steps": self.num_steps, "tokens_generated": self.tokens_generated,
                "tokens_per_s": sum(window) / span if span > 0 else 0.0, "num_jobs": len(self.jobs),
                "max_sequences": self.max_sequences, "draft": self.draft_stats()}

    def draft_stats(self) -> dict:
        v, p, a = self._draft_done
        for job in self.jobs.values():
            if job.drafting is not None:
                s = job.drafting.spec
                v, p, a = v + s.verify_steps, p + s.proposed, a + s.accepted
        return {"method": self.draft, "verifications": v, "proposed": p, "accepted": a}


def load_engine(model: str = "default", n_ctx: int = 4096, threads: int | None = None, quant: str = "auto",
                device: str = "cpu", kv_dtype: str = "fp16", kv_budget: str | int | float | None = None,
                kv_block_size: int = 16, config: SchedulerConfig | None = None, draft: str = "none") -> BatchEngine:
    """A BatchEngine on a GGUF model (the default model unless named), loaded as the native backend does."""
    import os

    import torch

    from edge_runtime.backends.native import _check_device
    from edge_runtime.model.loader import load_model
    from edge_runtime.model.tokenizer import Tokenizer

    _check_device(device)
    kv = KVCacheConfig(kv_dtype, kv_block_size, kv_budget)  # bad flags fail before loading
    if threads:
        torch.set_num_threads(threads)
    net, gf = load_model(model, quant=quant, device=device)
    name = gf.metadata.get("general.name") or os.path.splitext(os.path.basename(gf.path))[0]
    return BatchEngine(net, Tokenizer.from_metadata(gf.metadata), ChatTemplate.from_metadata(gf.metadata),
                       min(n_ctx, net.cfg.max_context), kv, config, model_name=str(name), draft=draft)
