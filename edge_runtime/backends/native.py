"""The native backend: our torch transformer over the GGUF's quantized weights.

`NativeRunner` keeps one KV buffer per layer and the token ids it holds, so a
new prompt that shares a prefix with the last one (a growing chat) only
evaluates the new tokens. Prompts are evaluated in chunks of `n_batch`
tokens; single decode steps go through the compiled block step when
compilation is on.
"""
from __future__ import annotations

import os

import torch

from ..chat_template import ChatTemplate
from ..compile_cache import CompileCache
from ..errors import BackendUnavailableError
from ..model_loader import load_model
from ..tokenizer import Tokenizer
from .base import Backend


class NativeRunner:
    def __init__(self, model, tokenizer: Tokenizer, n_ctx: int, n_batch: int = 512):
        self.model = model
        self.tokenizer = tokenizer
        self.n_ctx = n_ctx
        self.n_batch = n_batch
        self.eog_ids = set(tokenizer.eog_ids)
        self.add_bos = bool(tokenizer.add_bos_token)
        self.bos_id = tokenizer.bos_id
        self.cached_ids: list[int] = []  # tokens whose K/V are in the cache, in order
        model.allocate_cache(n_ctx)

    def tokenize(self, text: str, special: bool = True) -> list[int]:
        return self.tokenizer.encode(text, special=special)

    def reset(self) -> None:
        self.cached_ids = []

    def token_bytes(self, token_id: int) -> bytes:
        return self.tokenizer.token_bytes(token_id)

    def _run(self, token_ids: list[int], pos0: int, all_logits: bool = False) -> torch.Tensor:
        device = self.model.device
        outs = []
        for start in range(0, len(token_ids), self.n_batch):
            chunk = torch.tensor(token_ids[start:start + self.n_batch], dtype=torch.long, device=device)
            outs.append(self.model(chunk, pos0 + start, all_logits=all_logits))
        return torch.cat(outs) if all_logits else outs[-1][-1]

    def prefill(self, token_ids: list[int]) -> torch.Tensor:
        common = 0
        limit = min(len(self.cached_ids), len(token_ids) - 1)  # always evaluate at least the last token
        while common < limit and self.cached_ids[common] == token_ids[common]:
            common += 1
        self.cached_ids = self.cached_ids[:common]
        logits = self._run(token_ids[common:], common)
        self.cached_ids = list(token_ids)
        return logits.float().cpu()

    def step(self, token_id: int) -> torch.Tensor:
        logits = self._run([token_id], len(self.cached_ids))
        self.cached_ids.append(token_id)
        return logits.float().cpu()

    def logits(self, token_ids: list[int]) -> torch.Tensor:
        self.cached_ids = []
        out = self._run(token_ids, 0, all_logits=True).float().cpu()
        self.cached_ids = list(token_ids)
        return out


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
                 head_quant: str | None = None, progress=None, fused: bool = True):
        super().__init__()
        _check_device(device)
        if threads:
            torch.set_num_threads(threads)
        self.model, gf = load_model(model, quant=quant, device=device, head_quant=head_quant)
        self.config = self.model.cfg
        self.path = gf.path
        self.quant = self.model.quant
        tokenizer = Tokenizer.from_metadata(gf.metadata)
        self.template = ChatTemplate.from_metadata(gf.metadata)
        n_ctx = min(n_ctx, self.config.max_context)
        self.runner = NativeRunner(self.model, tokenizer, n_ctx)
        self.fused = False
        if self.quant == "gguf" and fused:  # our C kernels are built: fuse the small decode ops too
            from kernels import cpu_gemv

            self.fused = self.model.enable_fused(cpu_gemv.library())
        self.tokenizer = tokenizer
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
