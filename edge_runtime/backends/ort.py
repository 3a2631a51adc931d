"""The onnxruntime backend: the ONNX export (`edge_runtime/onnx/export.py`) behind the Backend interface.

It runs the export with the first execution provider of an ordered list (a
device profile's, from `devices.choose`, or `providers=`) that loads, and falls
back along the list, CPU last, logging why each one was passed over: a
provider missing from this onnxruntime build, one whose session fails to
initialise, or one that onnxruntime silently replaced. `provider` and
`fallback_reasons` say what happened.

K/V travel as the graph's inputs and outputs (`past_key_values.*` ->
`present.*`), held here as numpy arrays; like the llama.cpp runner it keeps
the previous sequence and reuses its longest common prefix. It shares the
generation loop (sampling, stop strings, detokenization) with the other
backends, and the tokenizer and chat template come from the GGUF metadata the
export carries.
"""
from __future__ import annotations

import json
import logging
import os

import numpy as np
import torch

from edge_runtime.engine import sampling_defaults
from edge_runtime.model.chat_template import ChatTemplate
from edge_runtime.errors import BackendUnavailableError, ContextLengthError, ModelFileError
from edge_runtime.model.config import ModelConfig
from edge_runtime.model.tokenizer import Tokenizer
from edge_runtime.backends.base import Backend

log = logging.getLogger("edge_runtime.onnxruntime")
CPU = "CPUExecutionProvider"


def open_session(path: str, providers: list[str], threads: int | None, provider_options: dict | None = None):
    """(session, provider, reasons): the first provider of `providers` whose session loads (with its
    `provider_options`, e.g. QNN's backend_type); CPU is tried last whether listed or not. Raises
    BackendUnavailableError when none loads."""
    try:
        import onnxruntime as ort
    except ImportError as e:  # pragma: no cover - a core dependency
        raise BackendUnavailableError(f"onnxruntime is not installed: {e}") from None
    available = ort.get_available_providers()
    order = list(dict.fromkeys(list(providers) + [CPU]))
    reasons: list[str] = []
    for name in order:
        if name not in available:
            reasons.append(f"{name}: not in this onnxruntime build (it has {', '.join(available)})")
            log.warning("onnxruntime: skipping %s", reasons[-1])
            continue
        so = ort.SessionOptions()
        if threads:
            so.intra_op_num_threads = threads
        so.log_severity_level = 3  # our reasons say what failed; onnxruntime's own lines would repeat them
        try:
            chain = [(name, dict((provider_options or {}).get(name, {})))] + ([] if name == CPU else [CPU])
            session = ort.InferenceSession(path, so, providers=chain)
        except Exception as e:  # noqa: BLE001 - any provider failure means: try the next one
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            reasons.append(f"{name}: failed to load ({first[:300]})")
            log.warning("onnxruntime: falling back from %s", reasons[-1])
            continue
        got = session.get_providers()
        if got[0] != name:
            reasons.append(f"{name}: onnxruntime ran the session on {got[0]} instead")
            log.warning("onnxruntime: falling back from %s", reasons[-1])
            continue
        return session, name, reasons
    raise BackendUnavailableError("no onnxruntime execution provider could load the model: " + "; ".join(reasons))


class OrtRunner:
    exact_verify = False  # no multi-token verification: drafting stays off (speculative.resolve_draft)

    def __init__(self, export_dir: str, n_ctx: int, threads: int | None, providers: list[str],
                 provider_options: dict | None = None, n_batch: int = 512):
        from edge_runtime.onnx.export import FORMAT, META_FILE, MODEL_FILE

        meta_path = os.path.join(export_dir, META_FILE)
        try:
            with open(meta_path, encoding="utf-8") as f:
                meta = json.load(f)
        except (OSError, ValueError) as e:
            raise ModelFileError(f"{export_dir} is not an edge-runtime ONNX export ({META_FILE}: {e})") from None
        if meta.get("format") != FORMAT:
            raise ModelFileError(f"{meta_path} has format {meta.get('format')!r}, expected {FORMAT!r}")
        self.meta = meta
        self.config = ModelConfig(**meta["config"])
        self.tokenizer = Tokenizer.from_metadata(meta["gguf_metadata"])
        self.template = ChatTemplate.from_metadata(meta["gguf_metadata"])
        self.session, self.provider, self.fallback_reasons = open_session(
            os.path.join(export_dir, MODEL_FILE), providers, threads, provider_options)
        self.n_ctx = min(n_ctx, self.config.max_context)
        self.n_batch = n_batch
        self.eog_ids = set(self.tokenizer.eog_ids)
        self.add_bos = bool(self.tokenizer.add_bos_token)
        self.bos_id = self.tokenizer.bos_id
        self.vocab_size = self.tokenizer.vocab_size
        cfg = self.config
        self._names = [f"past_key_values.{i}.{kv}" for i in range(cfg.num_layers) for kv in ("key", "value")]
        self._outputs = [o.name for o in self.session.get_outputs()]  # logits, present.0.key, ...
        self._empty = np.zeros((1, cfg.num_kv_heads, 0, cfg.head_dim), np.float32)
        self.reset()

    def tokenize(self, text: str, special: bool = True) -> list[int]:
        return self.tokenizer.encode(text, special=special)

    def token_bytes(self, token_id: int) -> bytes:
        return self.tokenizer.token_bytes(token_id)

    def reset(self) -> None:
        import onnxruntime as ort

        self.past = [ort.OrtValue.ortvalue_from_numpy(self._empty)] * len(self._names)
        self.cached_ids: list[int] = []

    def _run(self, token_ids: list[int], num_logits: int) -> np.ndarray:
        """Append token_ids to the held sequence; logits [num_logits, vocab] of its last positions.
        NOTE: the K/V stay onnxruntime's own values from one call to the next (io binding): converting the
        60 `present` outputs to numpy each step copied the whole cache once more."""
        if len(self.cached_ids) + len(token_ids) > self.n_ctx:
            raise ContextLengthError(f"{len(self.cached_ids) + len(token_ids)} tokens exceed the context of "
                                     f"{self.n_ctx}")
        binding = self.session.io_binding()
        for name, value in zip(self._names, self.past):
            binding.bind_ortvalue_input(name, value)
        binding.bind_cpu_input("input_ids", np.asarray([token_ids], dtype=np.int64))
        binding.bind_cpu_input("num_logits", np.asarray([num_logits], dtype=np.int64))
        for name in self._outputs:
            binding.bind_output(name)
        self.session.run_with_iobinding(binding)
        out = binding.get_outputs()
        self.past = out[1:]
        self.cached_ids += token_ids
        return out[0].numpy()[0]

    def _keep(self, n: int) -> None:
        if n < len(self.cached_ids):
            import onnxruntime as ort

            self.past = [ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(p.numpy()[:, :, :n]))
                         for p in self.past]
            self.cached_ids = self.cached_ids[:n]

    def prefill(self, token_ids: list[int]) -> torch.Tensor:
        common, limit = 0, min(len(self.cached_ids), len(token_ids) - 1)
        while common < limit and self.cached_ids[common] == token_ids[common]:
            common += 1
        self._keep(common)
        rest = token_ids[common:]
        for i in range(0, len(rest), self.n_batch):
            logits = self._run(rest[i:i + self.n_batch], 1)
        return torch.from_numpy(logits[-1].copy())

    def step(self, token_id: int) -> torch.Tensor:
        return torch.from_numpy(self._run([token_id], 1)[-1].copy())

    def logits(self, token_ids: list[int]) -> torch.Tensor:
        """Teacher-forced logits fp32 [len(token_ids), vocab] from a fresh context."""
        self.reset()
        rows = [self._run(token_ids[i:i + self.n_batch], len(token_ids[i:i + self.n_batch]))
                for i in range(0, len(token_ids), self.n_batch)]
        return torch.from_numpy(np.concatenate(rows))


def resolve_export(model: str, weights: str = "auto", accuracy_level: int = 0) -> str:
    """An export folder for `model`: the folder itself, or (for a GGUF path or 'default') the cached export of
    that file, written on first use."""
    from kernels.compile_cache import cache_root
    from edge_runtime.model.path import resolve_model_path
    from edge_runtime.onnx.export import META_FILE, export_onnx, source_fingerprint

    if os.path.isdir(model):
        return model
    path = resolve_model_path(model)
    folder = os.path.join(cache_root(), "onnx", f"{source_fingerprint(path)}-{weights}-acc{accuracy_level}")
    if not os.path.exists(os.path.join(folder, META_FILE)):
        log.warning("onnxruntime: exporting %s to %s (once)", path, folder)
        tmp = f"{folder}.{os.getpid()}.tmp"
        export_onnx(path, tmp, weights, accuracy_level)
        os.makedirs(os.path.dirname(folder), exist_ok=True)
        try:
            os.replace(tmp, folder)
        except OSError:  # another process finished first
            import shutil

            shutil.rmtree(tmp, ignore_errors=True)
    return folder


class OnnxRuntimeBackend(Backend):
    name = "onnxruntime"

    def __init__(self, model: str = "default", n_ctx: int = 4096, threads: int | None = None,
                 providers: list[str] | None = None, provider_options: dict | None = None, weights: str = "auto"):
        """`model`: an export folder, or a GGUF ('default', a path) exported once into the cache with `weights`
        (auto, int4 or int8: see export-onnx). `providers`: the order to try; default: the device profile's."""
        super().__init__()
        if providers is None:  # the device profile's order for this machine
            import devices

            choice = devices.choose(devices.detect(), backend="onnxruntime")
            providers, provider_options = choice.providers, choice.provider_options
        self.export_dir = resolve_export(model, weights)
        self.runner = OrtRunner(self.export_dir, n_ctx, threads, providers, provider_options)
        self.path = self.runner.meta.get("source", self.export_dir)
        self.config = self.runner.config
        self.template = self.runner.template
        self.sampling_defaults = sampling_defaults.from_metadata(self.runner.meta["gguf_metadata"])
        self.tokenizer = self.runner.tokenizer
        self.tokenizer_fingerprint = self.tokenizer.fingerprint
        self.provider, self.fallback_reasons = self.runner.provider, self.runner.fallback_reasons

    def logits(self, token_ids: list[int]) -> torch.Tensor:
        with self._lock:
            return self.runner.logits(token_ids)
