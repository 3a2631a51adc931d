"""Self-speculative multi-token prediction (MTP): light draft heads on the model's own hidden states.

One `MtpHead` step takes the base model's final-normed hidden state h at
position t and the embedding of token t + 1, and returns a new hidden state h'
from which the token at t + 2 is read, through the model's own tied output
head restricted to a draft vocabulary (the most frequent tokens of the
model's answers, FR-Spec style: the full 49152-row head would cost a fifth of
a forward step per drafted token). Chained (h' and the drafted token go back
in) it drafts up to 4 tokens. Verification always uses the full head, so a
token outside the draft vocabulary is simply never drafted.

    z  = W_in [rms(h) * g_h ; rms(emb(x)) * g_e]        the two inputs fused
    z += W_down silu(W_gate rms(z) * g_m) * W_up(...)   one small SwiGLU block
    h' = rms(z) * g_o                                   logits = h' @ emb(vocab).T

The block has no attention: h already summarizes the context, and a draft
stays a handful of small matrix-vector products.

File format (safetensors; `edge_runtime/data/mtp/<name>.safetensors`): the
tensors of the module plus `vocab` (int64 draft token ids); the metadata holds
`format` ("edge-runtime-mtp/1"), `dim`, `hidden`, `eps`, `depth` (drafts the
head was trained to chain) and `base_fingerprint` (the base model's tokenizer
fingerprint and shape, so heads never load onto another model). Other models
ship heads by adding a file; GGUF models with native MTP layers can map those
layers onto the same interface later.
"""
from __future__ import annotations

import ctypes

import glob
import json
import os

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from edge_runtime import DATA_DIR

FORMAT = "edge-runtime-mtp/1"
HEADS_DIR = os.path.join(DATA_DIR, "mtp")


def _rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def add_tap_fusion(head: nn.Module) -> None:
    """A head's fusion of the model's features (the final state and its `taps` layers' outputs): a gain per part
    (g_f) and one projection (w_f), starting as the final state alone. Shared by MtpHead and AttnDraftHead."""
    parts = 1 + len(head.taps)
    head.g_f = nn.Parameter(torch.ones(parts, head.dim))
    head.w_f = nn.Linear(parts * head.dim, head.dim, bias=False)
    with torch.no_grad():
        head.w_f.weight.zero_()
        head.w_f.weight[:, :head.dim] = torch.eye(head.dim)


def fuse_taps(head: nn.Module, h: torch.Tensor) -> torch.Tensor:
    """The model's features [..., (1 + taps) * dim] -> [..., dim]: each part normed with its gain, then w_f."""
    parts = h.unflatten(-1, (1 + len(head.taps), head.dim))
    return head.w_f((_rms(parts, head.eps) * head.g_f).flatten(-2))


class MtpHead(nn.Module):
    def __init__(self, dim: int, hidden: int, vocab: torch.Tensor, eps: float = 1e-5, depth: int = 4,
                 taps: tuple[int, ...] = ()):
        super().__init__()
        self.dim, self.hidden, self.eps, self.depth, self.taps = dim, hidden, eps, depth, tuple(taps)
        if self.taps:  # the first step's h: the final state and the tapped layers' residuals, fused (EAGLE-3)
            add_tap_fusion(self)
        self.g_h, self.g_e = nn.Parameter(torch.ones(dim)), nn.Parameter(torch.ones(dim))
        self.w_in = nn.Linear(2 * dim, dim, bias=False)
        self.g_m = nn.Parameter(torch.ones(dim))
        self.w_gate_up = nn.Linear(dim, 2 * hidden, bias=False)
        self.w_down = nn.Linear(hidden, dim, bias=False)
        self.g_o = nn.Parameter(torch.ones(dim))
        self.register_buffer("vocab", vocab.long())
        nn.init.normal_(self.w_in.weight, std=0.02)
        nn.init.normal_(self.w_gate_up.weight, std=0.02)
        nn.init.zeros_(self.w_down.weight)  # starts as a pure fusion of the inputs

    def fuse(self, h: torch.Tensor) -> torch.Tensor:
        """The model's features [N, (1 + taps) * dim] (`transformer.features`) -> the first step's h [N, dim]."""
        return fuse_taps(self, h)

    def forward(self, h: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
        """h: [N, dim] (a step's output) or the model's features [N, (1 + taps) * dim]; e: [N, dim] -> h' [N, dim]."""
        if h.shape[-1] != self.dim:
            h = self.fuse(h)
        z = self.w_in(torch.cat([_rms(h, self.eps) * self.g_h, _rms(e, self.eps) * self.g_e], dim=-1))
        gate, up = self.w_gate_up(_rms(z, self.eps) * self.g_m).chunk(2, dim=-1)
        z = z + self.w_down(F.silu(gate) * up)
        return _rms(z, self.eps) * self.g_o

    def save(self, path: str, base_fingerprint: str, extra: dict | None = None) -> None:
        write_heads(self, path, {"format": FORMAT, "dim": str(self.dim), "hidden": str(self.hidden),
                                 "eps": repr(self.eps), "depth": str(self.depth)}, base_fingerprint, extra)

    @classmethod
    def load(cls, path: str) -> tuple["MtpHead", dict]:
        tensors, meta, taps = read_heads(path, FORMAT)
        head = cls(int(meta["dim"]), int(meta["hidden"]), tensors["vocab"], float(meta["eps"]), int(meta["depth"]), taps)
        head.load_state_dict(tensors)
        return head.eval(), meta


def write_heads(module: nn.Module, path: str, meta: dict, base_fingerprint: str, extra: dict | None) -> None:
    """A head module as safetensors (fp16 weights): its shape in `meta` (with "format"), its taps, the base
    model's fingerprint and the training settings and figures (`extra`, JSON)."""
    from safetensors.torch import save_file

    tensors = {k: v.detach().to(torch.float16 if v.is_floating_point() else v.dtype).contiguous()
               for k, v in module.state_dict().items()}
    meta = {**meta, "base_fingerprint": base_fingerprint}
    if module.taps:
        meta["taps"] = ",".join(map(str, module.taps))
    if extra:
        meta["training"] = json.dumps(extra, sort_keys=True)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    save_file(tensors, path, metadata=meta)


def read_heads(path: str, fmt: str) -> tuple[dict, dict, tuple[int, ...]]:
    """(tensors in fp32, metadata, taps) of a head file of format `fmt`."""
    from safetensors import safe_open

    with safe_open(path, framework="pt") as f:
        meta = f.metadata() or {}
        if meta.get("format") != fmt:
            raise ValueError(f"{path} is not a head file of format {fmt} (it says {meta.get('format')!r})")
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    taps = tuple(int(t) for t in meta["taps"].split(",")) if meta.get("taps") else ()
    return {k: v.float() if v.is_floating_point() else v for k, v in tensors.items()}, meta, taps


def base_fingerprint(backend) -> str:
    cfg = backend.model.cfg
    return f"{backend.tokenizer_fingerprint}:{cfg.dim}x{cfg.num_layers}:{cfg.vocab_size}"


def find_heads(backend, fmt: str = FORMAT) -> str | None:
    """The shipped head file of format `fmt` (the MLP heads'; spec/attn_head.py's FORMAT: the attention
    head's) made for this backend's model, if any."""
    want = base_fingerprint(backend)
    from safetensors import safe_open

    for path in sorted(glob.glob(os.path.join(HEADS_DIR, "*.safetensors"))):
        with safe_open(path, framework="pt") as f:
            meta = f.metadata() or {}
            if meta.get("base_fingerprint") == want and meta.get("format") == fmt:
                return path
    return None


class Q8Linear:
    """`x @ w.T` for drafting: w [out, in] as Q8_0 blocks on the kernels of kernels/ (8-bit activations where
    cpu_qgemm has its packed layout, as `Q8Head`; else cpu_gemv's fp32 GEMVs, 8 rows a call), one thread;
    fp32 torch where the kernels do not run or `fast` is off. x [m, in] fp32 -> [m, out] fp32. `blocks`,
    `kind` (cpu_decode.c's code: + 16 packed) and `integer` (its arith) for C steps; `blocks` None on fp32.
    `integer` False: the fp32 GEMVs even where the integer kernels run (None: the integer ones where they do)."""

    def __init__(self, w: torch.Tensor, fast: bool = True, integer: bool | None = None, qtype: str = "q8_0"):
        from kernels.cpu_qgemm import KIND_CODE

        self.w = w.detach().float().contiguous()
        self.out_f, in_f = self.w.shape
        self.qtype, self.blocks, self.integer, self.kind = qtype, None, False, KIND_CODE[qtype]  # q4_0: 4-bit blocks
        if fast:
            from kernels import cpu_gemv, cpu_qgemm

            if cpu_gemv.available() and in_f % 32 == 0:
                import gguf

                q = gguf.quants.quantize(self.w.numpy(), gguf.GGMLQuantizationType[qtype.upper()])
                self.blocks = torch.from_numpy(np.ascontiguousarray(q))
                self.integer = cpu_qgemm.available() and cpu_qgemm.packed_supported(qtype) and integer is not False
                if self.integer:
                    self.blocks, self.kind = cpu_qgemm.repack(qtype, self.blocks, self.out_f, in_f), self.kind + 16

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.blocks is None:
            return x @ self.w.T
        from kernels import cpu_gemv, cpu_qgemm

        if self.integer:
            return cpu_qgemm.qgemm_packed(self.qtype, self.blocks, x, self.out_f, num_threads=1)
        return torch.cat([cpu_gemv.gemv(self.qtype, self.blocks, x[i:i + 8], self.out_f, num_threads=1)
                          for i in range(0, x.shape[0], 8)])


class Q8Head:
    """The same head for drafting with the kernels of kernels/: its matrices (and the draft-vocabulary rows of
    the output head) as Q8_0 blocks, about a quarter of the fp32 bytes, so a draft step reads ~4-5 MB instead
    of ~19 MB. Where cpu_qgemm has its packed layout (x86), the blocks are repacked and the step runs the
    integer kernels (8-bit activations, as the model's `--arith int8`): 1.6x faster a step than the fp32
    GEMVs of cpu_gemv.c on a Zen 3, and the drafts accepted on MT-Bench agree to the third place (1.684 vs 1.685
    tokens per verification, heads alone at k = 3); elsewhere the fp32 GEMVs. Drafts only propose:
    verification decides with the full model."""

    def __init__(self, head: MtpHead, head_rows: torch.Tensor, integer: bool | None = None):
        from kernels import cpu_gemv

        lin = lambda w: Q8Linear(w, integer=integer)  # noqa: E731  (one thread each: see Q8Linear)
        self.eps, self.hidden = head.eps, head.hidden
        self.g_h, self.g_e, self.g_m, self.g_o = (g.detach().float().clone()
                                                  for g in (head.g_h, head.g_e, head.g_m, head.g_o))
        self.w_in, self.w_gate_up, self.w_down = (lin(m.weight) for m in (head.w_in, head.w_gate_up, head.w_down))
        self.rows = lin(head_rows)
        self.integer = self.w_in.integer
        self.n_in, self.n_vocab = head.dim, head_rows.shape[0]
        self.w_f = lin(head.w_f.weight) if head.taps else None
        self.g_f = head.g_f.detach().float().clone() if head.taps else None
        # the whole step in one C call (kernels/cpu_decode.c: mtp_head_step): one parallel region on the
        # model's threads, no Python between the GEMVs
        self.lib = cpu_gemv.library()
        parts = 1 + len(head.taps)
        keep = tuple(m.blocks for m in (self.w_f or self.w_in, self.w_in, self.w_gate_up, self.w_down, self.rows))
        gains = (self.g_f.contiguous() if head.taps else self.g_h, self.g_h, self.g_e, self.g_m, self.g_o)
        self._keep = keep + gains
        self._w = (ctypes.c_void_p * 5)(*(t.data_ptr() for t in keep))
        self._g = (ctypes.c_void_p * 5)(*(t.data_ptr() for t in gains))
        # mtp_head_step's dims: sizes, then (threads), the weights' kind code (+ 16: packed) and the arithmetic
        self._dims = [self.n_in, self.hidden, self.n_vocab, parts, self.w_in.kind, int(self.integer)]

    def __call__(self, h: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
        if h.shape[-1] != self.n_in:  # the model's features: fused first (MtpHead.fuse)
            parts = h.reshape(h.shape[0], -1, self.n_in)
            h = self.w_f((_rms(parts, self.eps) * self.g_f).flatten(1))
        z = self.w_in(torch.cat([_rms(h, self.eps) * self.g_h, _rms(e, self.eps) * self.g_e], -1))
        gate, up = self.w_gate_up(_rms(z, self.eps) * self.g_m).chunk(2, dim=-1)
        z = z + self.w_down(F.silu(gate) * up)
        return _rms(z, self.eps) * self.g_o

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.rows(h)

    def step(self, h: torch.Tensor, e: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`self(h, e)` and its `logits` in one C call: next states [F, dim], draft logits [F, n_vocab], F <= 8.
        The same GEMVs; the norms are the C step's (decode_add_rmsnorm: a double sum), so the states agree
        with the two calls' to float rounding, not bit for bit. Drafts only propose: this cannot change an
        answer, only how many drafts verification accepts."""
        from kernels import cpu_gemv

        h, e = h.float().contiguous(), e.float().contiguous()
        f, parts = h.shape[0], self._dims[3] if h.shape[-1] != self.n_in else 1  # later steps: the head's own state
        if h.shape[-1] != parts * self.n_in or e.shape != (f, self.n_in):
            raise ValueError(f"the head step reads h [F, {self.n_in}] or [F, {self._dims[3] * self.n_in}] and "
                             f"e [F, {self.n_in}], got {tuple(h.shape)} and {tuple(e.shape)}")
        state, logits = torch.empty(f, self.n_in), torch.empty(f, self.n_vocab)
        dims = (ctypes.c_int * 7)(*self._dims[:3], parts, cpu_gemv.threads(), *self._dims[4:])
        rc = self.lib.mtp_head_step(f, dims, self.eps, self._w, self._g, h.data_ptr(), e.data_ptr(), state.data_ptr(),
                                    logits.data_ptr())
        if rc:
            raise ValueError(f"mtp_head_step rejected its arguments (F={f}, h {tuple(h.shape)}): rc={rc}")
        return state, logits


class MtpDrafter:
    """Drafts by chaining an MtpHead from the hidden state of the last verified position."""
    name = "mtp"
    needs_hidden = True

    def __init__(self, head: MtpHead, embed, max_depth: int | None = None, fast: bool = True):
        self.head = head
        self.embed = embed  # ids [N] -> [N, dim] fp32: the base model's embedding (tied with its head)
        with torch.inference_mode():
            self.head_rows = embed(head.vocab).float().reshape(len(head.vocab), head.dim).contiguous()
        self.vocab = head.vocab.tolist()
        self.row_of = {t: i for i, t in enumerate(self.vocab)}  # draft token -> its row of head_rows
        self.max_depth = max_depth or head.depth
        self.fast = None
        if fast:
            from kernels import cpu_gemv

            if cpu_gemv.available() and head.dim % 32 == 0 and head.hidden % 32 == 0:
                self.fast = Q8Head(head, self.head_rows)

    @classmethod
    def for_backend(cls, backend) -> "MtpDrafter":
        from edge_runtime.errors import InvalidRequestError

        if getattr(backend, "model", None) is None:
            raise InvalidRequestError(f"MTP drafting needs the native backend's hidden states, not {backend.name}")
        path = find_heads(backend)
        if path is None:
            raise InvalidRequestError("no MTP heads ship for this model: train them with `edge-runtime train-mtp`")
        head, _ = MtpHead.load(path)
        backend.model.taps = head.taps  # the model reports the layers the heads read with its hidden rows
        return cls(head, backend.model.embedding)

    def propose(self, history: list[int], k: int, hidden: torch.Tensor) -> list[int]:
        """The drafter interface of speculative.py: `hidden` chose history[-1]."""
        return self.propose_from(hidden, history[-1], k)

    @torch.inference_mode()
    def head_step(self, h: torch.Tensor, tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """One head step for F drafts at once: states h [F, dim] and the tokens they chose -> the next
        states [F, dim] and their draft-vocabulary logits [F, len(vocab)] (F <= 8 on the Q8 path)."""
        rows = [self.row_of.get(t) for t in tokens]
        if None not in rows:  # drafts: their embeddings are draft-vocabulary rows, no lookup
            e = self.head_rows[rows]
        else:
            e = self.embed(torch.tensor(tokens)).reshape(len(tokens), -1)
        if self.fast is not None and len(tokens) <= 8:
            return self.fast.step(h, e)
        h = self.head(h, e)
        return h, h @ self.head_rows.T

    def first_state(self, hidden: torch.Tensor) -> torch.Tensor:
        """The model's hidden row that chose the last token, as the first step reads it: [1, (1 + taps) * dim]."""
        width = (1 + len(self.head.taps)) * self.head.dim
        if hidden.numel() != width:  # the model must report the layers the heads were trained on
            raise ValueError(f"the MTP heads read {width} features per row (taps {self.head.taps}), got "
                             f"{hidden.numel()}: set the model's taps to the heads' (MtpDrafter.for_backend)")
        return hidden.float().reshape(1, -1)

    def propose_from(self, hidden: torch.Tensor, token: int, k: int) -> list[int]:
        """Up to k drafts after `token`, given the hidden state whose logits chose `token`."""
        h = self.first_state(hidden)
        out = []
        for _ in range(min(k, self.max_depth)):
            h, logits = self.head_step(h, [token])
            token = self.vocab[int(logits[0].numpy().argmax())]  # numpy: no thread wake-ups for 4096 values
            out.append(token)
        return out
