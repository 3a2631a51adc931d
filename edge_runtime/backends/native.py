"""The native backend: our torch transformer over the GGUF's quantized weights.

Requests go through the engine core (engine/batch_engine.py) on its own thread: concurrent
requests (a `serve` gateway's clients, the hybrid runtime's) share its steps, up to
`max_batch` sequences per step, and drafts (`set_draft`) are rows of those steps. The engine
runs on a shallow copy of the model: the same weights, its own paged KV cache and fused
decoder. Its prefix cache keeps the full blocks of finished requests, so the next request
that starts with the same tokens (a growing chat, a shared system prompt) only evaluates what
is new.

`NativeRunner` is the model one sequence at a time over a KV cache of its own: teacher-forced
logits (`logits`, perplexity), the compile warm-up and MTP training data use it.
"""
from __future__ import annotations

import asyncio
import atexit
import contextlib
import copy
import itertools
import os
import queue
import threading
import time
from typing import AsyncIterator, Iterator

import torch

from kernels.kv_cache import PagedKVCache

from edge_runtime.backends.loop_mail import LoopMail
from edge_runtime.engine import sampling_defaults
from edge_runtime.engine.block_manager import BlockManager
from edge_runtime.model.chat_template import ChatTemplate
from kernels.compile_cache import CompileCache
from edge_runtime.errors import BackendUnavailableError, ContextLengthError
from edge_runtime.engine.kv_cache_config import KVCacheConfig, format_bytes
from edge_runtime.model.loader import load_model
from edge_runtime.model.tokenizer import Tokenizer
from edge_runtime.backends.base import Backend
from edge_runtime.engine.batch_engine import BatchEngine
from edge_runtime.engine.scheduler import SchedulerConfig
from edge_runtime.errors import InvalidRequestError
from edge_runtime.request import GenerationRequest, StreamEvent


class NativeRunner:
    def __init__(self, model, tokenizer: Tokenizer, n_ctx: int, n_batch: int = 512,
                 kv_config: KVCacheConfig | None = None):
        self.model = model
        self.tokenizer = tokenizer
        self.n_batch = n_batch
        self.eog_ids = set(tokenizer.eog_ids)
        self.add_bos = bool(tokenizer.add_bos_token)
        self.bos_id = tokenizer.bos_id
        self.vocab_size = tokenizer.vocab_size
        self.kv_config = kv = kv_config or KVCacheConfig()
        budget = kv.budget_bytes(model.cfg, n_ctx, model.device)  # read once: available memory moves
        num_blocks = PagedKVCache.blocks_for_budget(budget, model.cfg.num_layers, kv.block_size,
                                                    model.cfg.num_kv_heads, model.cfg.head_dim, kv.kv_dtype)
        if num_blocks < 1:
            raise ContextLengthError(f"KV budget {format_bytes(budget)} ({kv.kv_dtype}) holds less than one "
                                     f"block of {kv.block_size} tokens")
        capacity = num_blocks * kv.block_size
        self.n_ctx = min(n_ctx, capacity)
        self.n_ctx_reason = (f"the KV budget ({format_bytes(budget)}, {kv.kv_dtype}) holds {capacity} tokens"
                             if capacity < n_ctx else None)
        model.allocate_cache(self.n_ctx, num_blocks, kv.block_size, kv.kv_dtype)
        self.blocks = BlockManager(num_blocks, kv.block_size)
        self._seq_ids = itertools.count()
        self.seq: int | None = None  # the live sequence
        self.cached_ids: list[int] = []  # its tokens whose K/V are in the cache, in order
        self.last_hidden: torch.Tensor | None = None  # set by prefill()
        self.hidden_rows: torch.Tensor | None = None  # [T, dim]: set by step() and verify(), one row per token
        self._cache_arith = self._arith()  # the GEMV arithmetic the prefix cache's K/V were computed with
        # held while the model computes: batched.py shares it with a batch engine on the same weights, so the two
        # take turns by step instead of oversubscribing the cores
        self.compute_lock = contextlib.nullcontext()

    def tokenize(self, text: str, special: bool = True) -> list[int]:
        return self.tokenizer.encode(text, special=special)

    def token_bytes(self, token_id: int) -> bytes:
        return self.tokenizer.token_bytes(token_id)

    def _release(self) -> None:
        if self.seq is not None:
            self.blocks.free(self.seq)  # its committed full blocks stay in the prefix cache
            self.seq = None
        self.cached_ids = []

    def reset(self) -> None:
        """Forget everything cached, prefix cache included (the next prompt is evaluated in full)."""
        self._release()
        self.blocks.reset_prefix_cache()

    @staticmethod
    def _arith() -> str:
        from kernels import cpu_gemv

        return cpu_gemv.arith()

    def _start(self, token_ids: list[int]) -> int:
        """A new sequence for this prompt; returns how many leading tokens the prefix cache already holds."""
        self._release()
        if self._arith() != self._cache_arith:  # cached K/V made by the other arithmetic are not this one's
            self.blocks.reset_prefix_cache()
            self._cache_arith = self._arith()
        self.seq = next(self._seq_ids)
        cached = self.blocks.allocate(self.seq, token_ids)
        if cached is None:  # only the prompt itself can be too big: nothing else is live
            self.seq = None
            raise ContextLengthError(f"prompt is {len(token_ids)} tokens but the KV cache holds "
                                     f"{self.blocks.num_blocks * self.blocks.block_size}")
        self.cached_ids = list(token_ids[:cached])
        return cached

    def _run(self, token_ids: list[int], pos0: int, all_logits: bool = False) -> torch.Tensor:
        device = self.model.device
        table = self.blocks.block_table(self.seq)
        outs = []
        with self.compute_lock:
            for start in range(0, len(token_ids), self.n_batch):
                chunk = torch.tensor(token_ids[start:start + self.n_batch], dtype=torch.long, device=device)
                outs.append(self.model(chunk, pos0 + start, all_logits=all_logits, block_table=table))
        self.cached_ids.extend(token_ids)
        self.blocks.commit(self.seq, len(self.cached_ids))  # evaluated and accepted: cacheable
        return torch.cat(outs) if all_logits else outs[-1][-1]

    def prefill(self, token_ids: list[int]) -> torch.Tensor:
        """Logits fp32 [vocab] after the last id; `last_hidden` then holds the final-normed hidden state
        fp32 [dim] at that position (what the output head read: no extra forward pass)."""
        cached = self._start(token_ids)
        logits = self._run(token_ids[cached:], cached).float().cpu()
        self.last_hidden = self.model.last_hidden.float().cpu().clone()  # [dim]; the model reuses its buffer
        return logits

    def step(self, token_id: int) -> torch.Tensor:
        if not self.blocks.append(self.seq, [token_id]):
            raise ContextLengthError("the KV cache is full")  # the generator stops at n_ctx before this
        logits = self._run([token_id], len(self.cached_ids)).float().cpu()
        self.hidden_rows = self.model.last_hidden.reshape(1, -1)  # a view of a reused buffer: read it before the next step
        return logits

    def verify(self, token_ids: list[int]) -> torch.Tensor:
        """Evaluate several tokens at once (the last sampled token, then draft tokens): logits fp32
        [len, vocab], row i after token i. They stay provisional: nothing enters the prefix cache until
        `keep` says how many were accepted."""
        if not self.blocks.append(self.seq, token_ids):
            raise ContextLengthError("the KV cache is full")
        pos0, table = len(self.cached_ids), self.blocks.block_table(self.seq)
        if self.model.fused is not None:  # row i is bit for bit the one-token step: drafting stays lossless
            with self.compute_lock:
                out = self.model.fused.step_chunk(token_ids, pos0, table)
            self.hidden_rows = self.model.fused.chunk_hidden
        else:  # the torch path's T-row kernels round differently from its one-token step: step one by one
            rows, hidden = [], []
            for i, t in enumerate(token_ids):
                rows.append(self.model(torch.tensor([t], device=self.model.device), pos0 + i, block_table=table))
                hidden.append(self.model.last_hidden.float().cpu().clone())
            out, self.hidden_rows = torch.cat(rows), torch.stack(hidden)
        self.cached_ids.extend(token_ids)
        return out.float().cpu()

    def verify_tree(self, token_ids: list[int], parents: list[int]) -> torch.Tensor:
        """Evaluate a draft tree in one pass (tree attention): token_ids[0] is the last sampled token (the
        root, parents[0] = -1), node i > 0 a draft after node parents[i] < i, in depth-first order. Logits
        fp32 [N, vocab], row i after node i's path, each equal to the one-token step after that path bit
        for bit. Provisional until `keep_path`; the fused C step only."""
        if self.model.fused is None:
            raise NotImplementedError("draft trees need the fused C step")
        if not self.blocks.append(self.seq, token_ids):
            raise ContextLengthError("the KV cache is full")
        pos0 = len(self.cached_ids)
        slots = self.blocks.slots(self.seq, pos0, pos0 + len(token_ids))
        with self.compute_lock:
            out = self.model.fused.step_tree(token_ids, parents, pos0, slots, self.blocks.block_table(self.seq))
        self.hidden_rows = self.model.fused.chunk_hidden
        self.cached_ids.extend(token_ids)
        return out.float().cpu()

    def keep_path(self, start: int, nodes: list[int]) -> None:
        """After `verify_tree` at position `start`: its nodes `nodes` (the root, then a path of accepted
        drafts) become positions start.. (their K/V copied there), and every other node leaves the cache."""
        from edge_runtime.engine.drafting import move_path

        tokens = [self.cached_ids[start + n] for n in nodes]
        move_path(self.blocks, self.model.kv, self.seq, start, nodes, tokens)
        self.cached_ids[start:start + len(nodes)] = tokens
        self.keep(start + len(nodes))

    def keep(self, num_tokens: int) -> None:
        """Keep the first `num_tokens` tokens of the sequence (prompt and accepted ones): rejected drafts leave
        the KV cache, and the kept tokens are committed (their full blocks become cacheable)."""
        if not 0 <= num_tokens <= len(self.cached_ids):
            raise ValueError(f"cannot keep {num_tokens} of {len(self.cached_ids)} tokens")
        self.blocks.truncate(self.seq, num_tokens)
        del self.cached_ids[num_tokens:]
        self.blocks.commit(self.seq, num_tokens)

    def logits(self, token_ids: list[int]) -> torch.Tensor:
        self.reset()  # every position's logits are wanted: no prefix-cache hit
        self._start(token_ids)
        return self._run(token_ids, 0, all_logits=True).float().cpu()

    @property
    def prefix_cache_stats(self) -> dict:
        return self.blocks.stats()


class _Timing:
    """A request's times as its caller sees them: the finish event gets time to first token and decode speed."""

    def __init__(self, backend: str):
        self.backend, self.t0, self.first, self.generated = backend, time.perf_counter(), None, 0

    def see(self, ev: StreamEvent) -> StreamEvent:
        now = time.perf_counter()
        if ev.type == "delta":
            self.first = self.first or now
            self.generated += len(ev.token_ids)
            return ev
        first, n = self.first or now, self.generated
        ev.info = {**ev.info, "backend": self.backend, "ttft_ms": (first - self.t0) * 1000.0,
                   "decode_tok_per_s": (n - 1) / (now - first) if n > 1 and now > first else 0.0,
                   "total_s": now - self.t0}
        return ev


def _check_device(device: str) -> None:
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise BackendUnavailableError(f"unknown torch device {device!r}") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise BackendUnavailableError("device 'cuda' requested but CUDA is not available here")
    if dev.type == "mps" and not (hasattr(torch.backends, "mps") and torch.backends.mps.is_available()):
        raise BackendUnavailableError("device 'mps' requested but MPS is not available here")


class NativeBackend(Backend):
    name = "native"

    def __init__(self, model: str = "default", n_ctx: int = 4096, threads: int | None = None,
                 quant: str = "auto", device: str = "cpu", compile: bool | str = "auto",
                 head_quant: str | None = None, progress=None, fused: bool = True,
                 kv_dtype: str = "fp16", kv_budget: str | int | float | None = None, kv_block_size: int = 16,
                 kv_budget_cap: int | None = None, max_batch: int = 8):
        super().__init__()
        if max_batch < 1:
            raise InvalidRequestError(f"max_batch must be >= 1, not {max_batch}")
        self.max_batch = max_batch
        self._engine: BatchEngine | None = None
        self._ids = itertools.count()
        _check_device(device)
        self.kv_config = KVCacheConfig(kv_dtype, kv_block_size, kv_budget, kv_budget_cap)  # bad flags fail before loading
        if threads:
            torch.set_num_threads(threads)
        self.model, gf = load_model(model, quant=quant, device=device, head_quant=head_quant)
        self.config = self.model.cfg
        self.path = gf.path
        self.quant = self.model.quant
        tokenizer = Tokenizer.from_metadata(gf.metadata)
        self.template = ChatTemplate.from_metadata(gf.metadata)
        self.sampling_defaults = sampling_defaults.from_metadata(gf.metadata)
        n_ctx = self.n_ctx_asked = min(n_ctx, self.config.max_context)
        self.runner = NativeRunner(self.model, tokenizer, n_ctx, kv_config=self.kv_config)
        self.fused = False
        if self.quant == "gguf" and fused:  # our C kernels are built: fuse the small decode ops too
            from kernels import cpu_gemv

            self.fused = self.model.enable_fused(cpu_gemv.library())
        self.tokenizer = tokenizer
        self.tokenizer_fingerprint = tokenizer.fingerprint
        if compile == "auto":
            # Measured here: with our AVX2 GGUF kernels the eager decode step is faster than the
            # compiled one (50 vs 38 tok/s), and for torch's int4 kernels compiling gains ~15 % but
            # changes bf16 rounding enough to flip greedy tokens. So it is opt-in (--compile).
            compile = os.environ.get("EDGE_RUNTIME_COMPILE", "0") == "1"
        self.compiled = bool(compile)
        if self.compiled:
            CompileCache(self).warm_up(progress)

    def logits(self, token_ids: list[int]) -> torch.Tensor:
        with self._lock:
            return self.runner.logits(token_ids)

    @property
    def engine(self) -> BatchEngine:
        """The engine core all requests go through, started on first use (max_batch is read then)."""
        if self._engine is None:
            model = copy.copy(self.model)  # the same modules (weights); its own cache and fused decoder below
            model.kv = model.fused = model.last_hidden = None
            self.runner.compute_lock = lock = threading.Lock()  # the runner and the engine take turns by step
            config = SchedulerConfig(self.max_batch, max(512, 256 + self.max_batch), 256)
            self._engine = BatchEngine(model, self.tokenizer, self.template, self.n_ctx_asked,
                                       kv_config=self.kv_config, config=config, model_name="native", source="local",
                                       step_lock=lock, fused=self.fused).start()
            atexit.register(self._engine.stop)  # its thread must leave torch before the interpreter does
        return self._engine

    @property
    def n_ctx(self) -> int:
        return self.engine.n_ctx

    def close(self) -> None:
        if self._engine is not None:
            self._engine.stop()

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (a benchmark's cold start); only while no request runs."""
        self.runner.reset()
        self.engine.blocks.reset_prefix_cache()

    def set_draft(self, name: str, k: int | None = None, allow_inexact: bool = False) -> None:
        """Drafting in the engine's steps: one of DRAFTERS (speculative.py; "mtp-attn*": the attention head's chains,
        alone or after prompt lookup, or its trees); `k` fixes the draft length or tree size (default: the planner's).
        "auto": where the fused C step runs, "mtp-attn-ngram" (prompt lookup where the last two tokens or more match,
        else the attention head's chain) where that head ships, else "mtp-ngram" (the MLP heads), else "ngram"."""
        from edge_runtime.spec.attn_drafter import FORMAT as ATTN_FORMAT, AttnDrafter
        from edge_runtime.spec.mtp import MtpDrafter, find_heads
        from edge_runtime.spec.speculative import DRAFTERS

        if name not in DRAFTERS:
            raise InvalidRequestError(f"unknown draft method {name!r}: choose one of {', '.join(DRAFTERS)}")
        if name == "auto":  # fastest alone (bench spec) and in the worker's batches (bench batching --draft)
            name = ("none" if self.engine.model.fused is None else "mtp-attn-ngram" if find_heads(self, ATTN_FORMAT)
                    else "mtp-ngram" if find_heads(self) else "ngram")
        mtp = None
        if name.startswith("mtp"):  # mtp-attn*: the attention head (spec/attn_drafter.py); else the MLP heads
            kind, attr = (AttnDrafter, "_attn_drafter") if "attn" in name else (MtpDrafter, "_mtp_drafter")
            mtp = getattr(self, attr, None) or kind.for_backend(self)
            setattr(self, attr, mtp)
        try:
            self.engine.set_draft(name, mtp=mtp, fixed_k=k)
        except ValueError as e:
            raise InvalidRequestError(str(e)) from None
        self.draft = name

    def _submit(self, request: GenerationRequest, sink) -> tuple[str, StreamEvent]:
        """Queue the request on the engine (bad input raises first); its id and its start event."""
        ids = self.engine.prepare(request)
        rid = f"local-{next(self._ids)}"
        start = StreamEvent("start", info={"backend": self.name, "prompt_tokens": len(ids)})
        self.engine.submit(rid, request, sink, prompt_token_ids=ids)
        return rid, start

    def stream_sync(self, request: GenerationRequest, cancel: threading.Event | None = None) -> Iterator[StreamEvent]:
        """start, delta..., finish through the engine; bad input raises before start."""
        events: queue.Queue = queue.Queue()
        timing = _Timing(self.name)
        rid, start = self._submit(request, events.put)
        yield start
        cancelled = done = False
        try:
            while not done:
                if cancel is not None and cancel.is_set() and not cancelled:
                    self.engine.cancel(rid)  # its KV blocks are freed at once; it finishes "cancelled"
                    cancelled = True
                try:
                    ev = events.get(timeout=0.05)
                except queue.Empty:
                    continue
                done = ev.type != "delta"
                yield timing.see(ev)
        finally:
            if not done and not cancelled:  # the reader left early (a closed generator): stop generating for it
                self.engine.cancel(rid)

    async def stream(self, request: GenerationRequest, prefix: str | None = None) -> AsyncIterator[StreamEvent]:
        """The engine's events handed straight to the event loop (no thread per request in between); errors
        travel in the stream. Leaving early cancels the request, which frees its KV blocks at once."""
        if prefix is not None:
            request.prefix = prefix
        mail = LoopMail.of(asyncio.get_running_loop())
        events: asyncio.Queue = asyncio.Queue()
        rid = None

        def sink(ev: StreamEvent) -> None:  # on the engine thread
            try:
                mail.post(events.put_nowait, ev)
            except RuntimeError:  # the loop is gone: nobody is listening any more
                self.engine.cancel(rid)

        timing = _Timing(self.name)
        try:
            rid, start = self._submit(request, sink)
        except Exception as e:
            yield StreamEvent("error", error=str(e), source="local", info={"code": getattr(e, "code", "internal")})
            return
        yield start
        done = False
        try:
            while not done:
                ev = await events.get()
                done = ev.type != "delta"
                yield timing.see(ev)
        finally:
            if not done:
                self.engine.cancel(rid)
