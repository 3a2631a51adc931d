"""The llama.cpp backend: llama-cpp-python on the same GGUF.

It shares the generation loop (sampling, stop strings, detokenization) with
the native backend, so the two differ only in how logits are computed. The
prompt is rendered with our chat template (from the GGUF metadata) and
tokenized by llama.cpp itself.
"""
from __future__ import annotations

import ctypes
import os

import numpy as np
import torch

from edge_runtime.engine import sampling_defaults
from edge_runtime.model.chat_template import ChatTemplate
from edge_runtime.errors import BackendUnavailableError, ModelFileError
from edge_runtime.model.tokenizer import vocab_fingerprint
from edge_runtime.model.gguf_file import GGUFFile
from edge_runtime.backends.base import Backend


class LlamaCppRunner:
    exact_verify = False  # batched llama_decode rows are not bit-identical to one-token rows (speculative.py)

    def __init__(self, path: str, n_ctx: int, threads: int | None, n_batch: int = 512, logits_all: bool = False,
                 flash_attn: bool = True):
        try:
            import llama_cpp
        except ImportError as e:  # pragma: no cover - installed by scripts/setup.sh
            raise BackendUnavailableError(f"llama-cpp-python is not installed: {e}") from None
        self.lib = llama_cpp
        threads = threads or os.cpu_count() or 1
        try:
            self.llm = llama_cpp.Llama(model_path=path, n_ctx=n_ctx, n_batch=n_batch, n_ubatch=n_batch,
                                       n_threads=threads, n_threads_batch=threads, flash_attn=flash_attn,
                                       logits_all=logits_all, verbose=False)
        except ValueError as e:
            raise ModelFileError(f"llama.cpp could not load {path}: {e}") from None
        self.n_ctx = self.llm.n_ctx()
        self.n_vocab = self.vocab_size = self.llm.n_vocab()
        vocab = self.llm._model.vocab
        self.eog_ids = {i for i in range(self.n_vocab) if llama_cpp.llama_vocab_is_eog(vocab, i)}
        self.add_bos = bool(llama_cpp.llama_vocab_get_add_bos(vocab))
        self.bos_id = int(self.llm.token_bos())
        self._bytes_cache: dict[int, bytes] = {}

    def tokenize(self, text: str, special: bool = True) -> list[int]:
        return self.llm.tokenize(text.encode("utf-8"), add_bos=False, special=special)

    def token_bytes(self, token_id: int) -> bytes:
        # NOTE: Llama.detokenize() returns b"" for pieces over 32 bytes; ask the C API with a larger buffer.
        b = self._bytes_cache.get(token_id)
        if b is None:
            buf = ctypes.create_string_buffer(256)
            n = self.lib.llama_token_to_piece(self.llm._model.vocab, token_id, buf, len(buf), 0, True)
            b = self._bytes_cache[token_id] = buf.raw[:max(n, 0)]
        return b

    def reset(self) -> None:
        self.llm.reset()

    def _last_logits(self) -> torch.Tensor:
        ptr = self.lib.llama_get_logits_ith(self.llm.ctx, -1)
        return torch.from_numpy(np.ctypeslib.as_array(ptr, shape=(self.n_vocab,)).copy())

    def prefill(self, token_ids: list[int]) -> torch.Tensor:
        held = self.llm.n_tokens
        common = 0
        limit = min(held, len(token_ids) - 1)
        cached = self.llm.input_ids
        while common < limit and cached[common] == token_ids[common]:
            common += 1
        self.llm.n_tokens = common  # eval() drops the KV entries past n_tokens
        self.llm.eval(token_ids[common:])
        return self._last_logits()

    def step(self, token_id: int) -> torch.Tensor:
        self.llm.eval([token_id])
        return self._last_logits()

    @property
    def cached_ids(self) -> list[int]:
        return self.llm.input_ids[:self.llm.n_tokens].tolist()

    def verify(self, token_ids: list[int]) -> torch.Tensor:
        """Several tokens in one llama_decode with logits for every row: fp32 [len, vocab], row i after
        token i; `keep` then drops the rejected ones. NOTE: the rows are not bit-identical to one-token
        steps (see `exact_verify`), so drafting here is for measurement only (bench spec)."""
        llm, n = self.llm, len(token_ids)
        assert n <= llm.n_batch, "drafts fit one batch"
        llm._ctx.kv_cache_seq_rm(-1, llm.n_tokens, -1)
        llm._batch.set_batch(batch=token_ids, n_past=llm.n_tokens, logits_all=True)
        llm._ctx.decode(llm._batch)
        llm.input_ids[llm.n_tokens:llm.n_tokens + n] = token_ids
        llm.n_tokens += n
        rows = [np.ctypeslib.as_array(self.lib.llama_get_logits_ith(llm.ctx, i), shape=(self.n_vocab,))
                for i in range(n)]
        return torch.from_numpy(np.stack(rows).astype(np.float32, copy=True))

    def keep(self, num_tokens: int) -> None:
        """Keep the first `num_tokens` evaluated tokens; the KV entries after them are dropped."""
        if not 0 <= num_tokens <= self.llm.n_tokens:
            raise ValueError(f"cannot keep {num_tokens} of {self.llm.n_tokens} tokens")
        self.llm._ctx.kv_cache_seq_rm(-1, num_tokens, -1)
        self.llm.n_tokens = num_tokens


class LlamaCppBackend(Backend):
    name = "llama.cpp"

    def __init__(self, model: str = "default", n_ctx: int = 4096, threads: int | None = None,
                 flash_attn: bool = True):
        super().__init__()
        self.flash_attn = flash_attn
        gf = GGUFFile(model)  # validates the file with the same errors as the native backend
        self.path = gf.path
        self.threads = threads
        self.runner = LlamaCppRunner(self.path, n_ctx, threads, flash_attn=flash_attn)
        self.template = ChatTemplate.from_metadata(gf.metadata)
        self.sampling_defaults = sampling_defaults.from_metadata(gf.metadata)
        self.tokenizer_fingerprint = vocab_fingerprint(gf.metadata.get("tokenizer.ggml.tokens") or [])
        self._scorer: LlamaCppRunner | None = None

    def logits(self, token_ids: list[int]) -> torch.Tensor:
        with self._lock:
            n = len(token_ids)
            if self._scorer is None or self._scorer.n_ctx < n:
                self._scorer = LlamaCppRunner(self.path, max(n, 512), self.threads, logits_all=True,
                                             flash_attn=self.flash_attn)
            llm = self._scorer.llm
            llm.reset()
            llm.eval(token_ids)
            return torch.from_numpy(np.array(llm.scores[:n], dtype=np.float32))
