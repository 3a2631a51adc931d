"""The engine core: many concurrent requests on one model and one paged KV cache.

`BatchEngine` owns the model, the block manager, the scheduler, the batch runner and the
drafter, and runs them on one thread (`run_forever`): each step it applies the commands other
threads queued (submit, cancel, hold, park, unpark), schedules (scheduler.py), gives decode
chunks drafts (drafting.py), runs the step (batch_runner.py), samples each finished chunk's
next tokens with that request's own `Completion` (completion.py: sampling, detokenization,
stop strings and limits), and hands the request's `StreamEvent`s (delta ..., finish) to its
sink. Sinks are called on the engine thread and must not block. The native backend on the
device, the worker and the CLI all generate through it.

- cancel frees the request's KV blocks at once and finishes it `cancelled`;
- hold keeps its blocks but stops scheduling it (its reader is behind);
- park frees its blocks and keeps its state (its client went away and may
  resume); unpark queues it again, recomputing its tokens so far.

A request with `confidence` gets each token's entropy and top-2 margin in its delta's info,
and the first delta also carries the prompt's final hidden state (`hidden`), for the hybrid
runtime's escalation monitor and difficulty probe. The engine knows nothing about routing.
"""
from __future__ import annotations

import collections
import contextlib
import itertools
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Callable

import torch

from edge_runtime.engine.batch_runner import BatchRunner
from edge_runtime.engine.block_manager import BlockManager
from edge_runtime.engine.completion import Completion, confidence, request_ids
from edge_runtime.engine.drafting import DRAFTS, JobDrafts, StepDrafter, draft_children, keep_tree_path, tree_depth
from edge_runtime.engine.kv_cache_config import KVCacheConfig, format_bytes
from edge_runtime.engine.scheduler import BATCH, INTERACTIVE, Scheduler, SchedulerConfig, Sequence
from edge_runtime.errors import ContextLengthError
from edge_runtime.model.chat_template import ChatTemplate
from edge_runtime.request import GenerationRequest, StreamEvent, Usage

Sink = Callable[[StreamEvent], None]


@dataclass(eq=False)
class Job:
    """One request's generation state on the engine."""
    id: str
    request: GenerationRequest
    seq: Sequence
    sink: Sink
    completion: Completion
    drafts: JobDrafts | None = None
    hidden: torch.Tensor | None = None  # [dim]: the hidden state whose logits chose the last token
    next_seq: int = 0  # seq number of the next delta
    parked: bool = False
    done: bool = False
    t_submit: float = field(default_factory=time.perf_counter)
    t_first: float | None = None


class BatchEngine:
    def __init__(self, model, tokenizer, template: ChatTemplate, n_ctx: int,
                 kv_config: KVCacheConfig | None = None, config: SchedulerConfig | None = None,
                 model_name: str = "model", fused: bool = True, source: str = "cloud", step_lock=None,
                 draft: str = "none"):
        """source: what its events say they came from ("cloud" on the worker, "local" on the device);
        step_lock: held while a step computes; draft: "none", "ngram" or "mtp" (`set_draft`)."""
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
        self.n_ctx_asked = n_ctx
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
        self.num_verifications = self.num_proposed = self.num_accepted = 0
        self.tokens_generated = 0
        self._recent: collections.deque = collections.deque()  # (time, tokens) of recent steps
        self.draft, self.drafter = "none", None
        self.set_draft(draft)
        self._cache_arith = self._arith()  # the GEMV arithmetic the prefix cache's K/V were computed with

    def _arith(self) -> str:
        if getattr(self.model, "quant", None) != "gguf":
            return "n/a"
        from kernels import cpu_gemv

        return cpu_gemv.arith()

    def set_draft(self, method: str, mtp=None, fixed_k: int | None = None) -> None:
        """Drafting for requests submitted from now on: "none", "ngram", "mtp", "mtp-ngram", "mtp-tree" (with
        `mtp`, an MtpDrafter, for all but "ngram"; drafting.py), "mtp-attn", "mtp-attn-ngram", "mtp-attn-tree" or
        "mtp-attn-ngram-tree" (`mtp`: an AttnDrafter).
        Drafts need the fused C step (its rows are bit for bit one-token steps); elsewhere it is refused."""
        if method not in DRAFTS:
            raise ValueError(f"the batch engine drafts with {' or '.join(DRAFTS)}, not {method!r}")
        if method != "none" and self.model.fused is None:
            raise ValueError("drafting needs the GGUF weights on our C kernels (--quant gguf on a CPU): other "
                             "paths round a batch of rows differently from one row, so drafts would change answers")
        # the layers the heads read, reported with each hidden row (none without heads: no cost to plain steps)
        self.model.taps = mtp.head.taps if mtp is not None else ()
        self.draft = method
        self.drafter = None if method == "none" else StepDrafter(method, self.runner.decode_group, mtp, fixed_k)

    # --- the Runner protocol bits prompt_ids() uses ----------------------------------------------
    def tokenize(self, text: str, special: bool = True) -> list[int]:
        return self.tokenizer.encode(text, special=special)

    def token_bytes(self, token_id: int) -> bytes:
        return self.tokenizer.token_bytes(token_id)

    # --- called from any thread ------------------------------------------------------------------
    def prepare(self, request: GenerationRequest, max_prompt_tokens: int | None = None) -> list[int]:
        """The prompt's token ids; raises ContextLengthError when it cannot be served."""
        ids = request_ids(self, request, self.template, self.tokenizer.vocab_size,
                          self.tokenizer.fingerprint) or [self.bos_id or 0]
        limit = self.n_ctx if max_prompt_tokens is None else min(self.n_ctx, max_prompt_tokens + 1)
        if len(ids) >= limit:
            if max_prompt_tokens is not None and limit <= self.n_ctx - 1:
                why = f"the worker's limit is {max_prompt_tokens} prompt tokens"
            elif self.capacity < self.n_ctx_asked:
                why = f"the KV budget ({self.kv_budget_text}) holds {self.capacity} tokens"
            else:
                why = f"the context window is {self.n_ctx} tokens"
            raise ContextLengthError(f"prompt is {len(ids)} tokens but {why}; at least one token must be "
                                     f"left to generate")
        return ids

    def submit(self, id: str, request: GenerationRequest, sink: Sink, priority: str = "interactive",
               prompt_token_ids: list[int] | None = None) -> None:
        ids = prompt_token_ids if prompt_token_ids is not None else self.prepare(request)
        seq = Sequence(next(self._seq_ids), list(ids), len(ids), BATCH if priority == "batch" else INTERACTIVE)
        job = Job(id, request, seq, sink, Completion(request.params, self.token_bytes, self.eog_ids, self.n_ctx))
        if self.drafter is not None:
            job.drafts = self.drafter.new_job()
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
            try:
                ran = self.step()
            except Exception as e:  # a bug: what is in flight fails with an error instead of waiting forever
                traceback.print_exc()
                self._fail_all(e)
                continue
            if not ran:  # nothing could run (e.g. held streams fill the cache): wait for a command
                with self._wake:
                    if not self._commands:
                        self._wake.wait(0.05)

    def _fail_all(self, e: Exception) -> None:
        """Every job in flight ends with an `error` event (code "internal") and gives its KV blocks back; the
        prefix cache is dropped (a failed step may have written blocks half-way). Later requests run."""
        for job in list(self.jobs.values()):
            job.done = True
            with contextlib.suppress(Exception):
                self.scheduler.finish(job.seq)
            self.jobs.pop(job.id, None)
            self._by_seq.pop(job.seq.seq_id, None)
            job.sink(StreamEvent("error", seq=job.next_seq, error=f"internal error in the engine: {e!r}",
                                 source=self.source, info={"code": "internal"}))
        self.blocks.reset_prefix_cache()

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
                job.parked = True
                self.scheduler.finish(job.seq)  # its blocks go back at once
            elif kind == "unpark" and job.parked:
                job.parked = False
                self.scheduler.requeue(job.seq)

    def step(self) -> int:
        """One step: schedule, draft, compute, sample, update. Returns the number of rows computed."""
        self._apply_commands()
        arith = self._arith()
        if arith != self._cache_arith:  # cached K/V made by the other arithmetic are not this one's
            self.blocks.reset_prefix_cache()
            self._cache_arith = arith
        out = self.scheduler.schedule()
        if not out.chunks:
            return 0
        jobs = [self._by_seq.get(c.seq.seq_id) for c in out.chunks]
        if self.drafter is not None:
            self.drafter.add(self.scheduler, out, jobs, self.n_ctx,
                             self.config.max_num_batched_tokens - out.num_tokens)
            out.copies += self.blocks.take_copies()
        with self.step_lock:
            logits = self.runner.run(out.chunks, out.copies)
        if self.drafter is not None:
            self.drafter.observe_step(self.runner.decode_rows, self.runner.decode_seconds, self.runner.decode_sequences)
        self.num_steps += 1
        self.max_sequences = max(self.max_sequences, len(out.chunks))
        num_sampled = 0
        for chunk, job, rows, hidden, best in zip(out.chunks, jobs, logits, self.runner.hidden, self.runner.argmax):
            sampled, path = [], []
            if rows is not None and job is not None and not job.done:
                sampled, path = self._sample(job, chunk, rows, best)
            before, finish = chunk.seq.num_tokens, None
            feed = job.drafts.feed if sampled and job.drafts is not None else None
            for i, token in enumerate(sampled):
                job.hidden = hidden[path[i]] if hidden is not None else None
                if feed is not None and job.hidden is not None:  # the attention head's keys: every token's row
                    feed(job.hidden, token)
                finish = self._emit_token(job, token, before + i + 1, rows[path[i]])
                if finish is not None:  # what the answer does not use is neither kept nor cached
                    del sampled[i + 1:]
                    break
            proposed, depth = len(chunk.drafts), tree_depth(chunk.parents, len(chunk.drafts))
            if chunk.parents and sampled:  # the accepted path onto consecutive slots, then as a chain
                keep_tree_path(self.blocks, self.runner.model.kv, chunk, path[:len(sampled)])
            self.scheduler.update(chunk, sampled)
            if job is None or not sampled:
                continue
            if job.drafts is not None and self.drafter is not None and chunk.end - chunk.start == 1:
                self.drafter.observe(job.drafts, proposed, len(sampled) - 1, depth)
            self.num_verifications += bool(proposed)
            self.num_proposed += proposed
            self.num_accepted += len(sampled) - 1
            num_sampled += len(sampled)
            if finish is not None:
                self._finish(job, finish)
        now = time.perf_counter()
        self.tokens_generated += num_sampled
        self._recent.append((now, num_sampled))
        while self._recent and now - self._recent[0][0] > 10.0:
            self._recent.popleft()
        return out.num_tokens

    @staticmethod
    def _sample(job: Job, chunk, rows: torch.Tensor, best: list[int] | None = None) -> tuple[list[int], list[int]]:
        """The chunk's next tokens and the rows they were drawn from: one from each row while the token drawn
        is a draft after that row (a chain's next, a tree's child), going on from that draft's row (exactly
        the draws of plain decoding, which would have computed that row next). best: the rows' argmax when
        the runner computed it, which is plain greedy's token."""
        history, sampled, path, row = chunk.seq.token_ids, [], [], 0
        plain = best is not None and job.completion.sampler.plain_greedy
        children = draft_children(chunk.drafts, chunk.parents)
        while row is not None:
            if plain:
                sampled.append(best[row])
            else:
                sampled.append(job.completion.sample(rows[row], history + sampled if sampled else history))
            path.append(row)
            row = children[row].get(sampled[-1])
        return sampled, path

    def _emit_token(self, job: Job, token: int, context_len: int, row: torch.Tensor) -> str | None:
        """Send the token's delta, if it makes one; returns the finish reason when the answer ends with it."""
        if job.t_first is None:
            job.t_first = time.perf_counter()
        text, finish = job.completion.push(token, context_len)
        if text is not None:
            info = {}
            if job.request.confidence:
                info = confidence(row)
                if job.next_seq == 0 and job.hidden is not None:
                    # the first token's: the prompt's final hidden state (without the taps drafters read)
                    info["hidden"] = job.hidden[:self.runner.model.cfg.dim]
            self._delta(job, text, [token], info)
        return finish

    def _delta(self, job: Job, text: str, token_ids: list[int], info: dict | None = None) -> None:
        job.sink(StreamEvent("delta", seq=job.next_seq, text=text, token_ids=token_ids, source=self.source,
                             info=info or {}))
        job.next_seq += 1

    def _finish(self, job: Job, reason: str) -> None:
        tail = job.completion.tail() if reason != "cancelled" else ""
        if tail:
            self._delta(job, tail, [])
        job.done = True
        self.scheduler.finish(job.seq)
        del self.jobs[job.id], self._by_seq[job.seq.seq_id]
        now = time.perf_counter()
        first = job.t_first or now
        info = {"ttft_ms": (first - job.t_submit) * 1000.0, "total_s": now - job.t_submit,
                "preemptions": job.seq.num_preemptions, "cached_prompt_tokens": job.seq.num_cached_tokens}
        if job.drafts is not None:
            info["draft"] = job.drafts.stats(self.draft)
        job.sink(StreamEvent("finish", seq=job.next_seq, finish_reason=reason, source=self.source, info=info,
                             usage=Usage(job.seq.num_prompt_tokens, len(job.completion.generated))))

    # --- views -----------------------------------------------------------------------------------------
    def stats(self) -> dict:
        now = time.perf_counter()
        window = [n for t, n in self._recent if now - t <= 10.0]
        span = (now - self._recent[0][0]) if self._recent else 0.0
        return {**self.scheduler.stats(), "num_steps": self.num_steps, "tokens_generated": self.tokens_generated,
                "tokens_per_s": sum(window) / span if span > 0 else 0.0, "num_jobs": len(self.jobs),
                "max_sequences": self.max_sequences, "max_batch": self.config.max_num_seqs,
                "draft": self.draft_stats()}

    def draft_stats(self) -> dict:
        return {"method": self.draft, "verifications": self.num_verifications, "proposed": self.num_proposed,
                "accepted": self.num_accepted,
                "step_seconds": dict(self.drafter.planner.cost.seconds) if self.drafter is not None else {}}


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
