"""An EAGLE-style draft head: one small decoder layer over the base model's own features.

Where `MtpHead` sees only the last hidden state, this head attends over the answer so far: position t
gets the base model's final-normed hidden state h_t (the state whose logits chose token t) and the
embedding of token t, fused, then one pre-norm decoder layer (causal self-attention with RoPE over the
positions of the answer, then a SwiGLU block), and reads out the token at t + 1 through the model's
tied output head restricted to the draft vocabulary (as `MtpHead`). With `taps` a real position's h_t is
first fused with the tapped layers' outputs there, as `MtpHead.fuse` does (EAGLE-3).

    z = W_in [rms(h_t) * g_h ; rms(emb(x_t)) * g_e]
    z += W_o attn(rms(z) * g_a)          keys and values: the earlier positions' (their own layer's)
    z += W_down silu(W_gate rms(z) * g_m) * W_up(...)
    h' = rms(z) * g_o                    logits = h' @ emb(vocab).T

Chained, the draft at step s >= 1 takes h' of step s - 1 in place of a real feature and the drafted token,
at position t + s; it attends over the real positions <= t and over its own chain's earlier steps. Training
does exactly that for every t at once ("training-time test", EAGLE-3): `chain` computes step s for all
positions with the real keys under a causal mask and the chain's keys on the diagonal, so deep drafts are
trained on the head's own predicted features, as they are used.

`layers` > 1 stacks more such layers (attention and SwiGLU, each with its own weights, `Block`) before
the final norm: a layer's keys at the real positions come from the layer below at every position. Measured
offline only (a second layer added under 0.01 tokens per verification at equal data: docs/speculative.md);
the engine's drafter runs one-layer heads.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from edge_runtime.spec.mtp import _rms, add_tap_fusion, fuse_taps, read_heads, write_heads

FORMAT = "edge-runtime-attn/1"  # safetensors as the MLP heads' (spec/mtp.py), with the layer's shape


def rope(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    """x [B, heads, T, d] rotated by positions pos [T] (or [B, T]: each row's own; pairs split in halves, as
    the base model)."""
    d = x.shape[-1]
    freqs = theta ** (-torch.arange(0, d, 2, dtype=torch.float32) / d)
    ang = pos.float()[..., None] * freqs
    ang = ang[:, None] if pos.dim() == 2 else ang
    cos, sin = torch.cos(ang), torch.sin(ang)
    a, b = x[..., : d // 2], x[..., d // 2:]
    return torch.cat([a * cos - b * sin, a * sin + b * cos], dim=-1)


def _unpack(rows: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """rows [N, ...] computed at the N positions where `valid` [B, T] is true -> [B, T, ...], zeros elsewhere."""
    out = rows.new_zeros(*valid.shape, *rows.shape[1:])
    out[valid] = rows
    return out


class Block(nn.Module):
    """A further decoder layer (`layers` > 1): its own attention and SwiGLU block, as the first layer's."""

    def __init__(self, dim: int, heads: int, head_dim: int, hidden: int):
        super().__init__()
        self.g_a, self.g_m = nn.Parameter(torch.ones(dim)), nn.Parameter(torch.ones(dim))
        self.w_qkv = nn.Linear(dim, 3 * heads * head_dim, bias=False)
        self.w_o = nn.Linear(heads * head_dim, dim, bias=False)
        self.w_gate_up = nn.Linear(dim, 2 * hidden, bias=False)
        self.w_down = nn.Linear(hidden, dim, bias=False)
        for w in (self.w_qkv, self.w_gate_up):
            nn.init.normal_(w.weight, std=0.02)
        nn.init.zeros_(self.w_o.weight)  # starts as the identity: the layers below alone
        nn.init.zeros_(self.w_down.weight)


class AttnDraftHead(nn.Module):
    def __init__(self, dim: int, heads: int, head_dim: int, hidden: int, vocab: torch.Tensor, eps: float = 1e-5,
                 theta: float = 10000.0, depth: int = 4, taps: tuple[int, ...] = (), layers: int = 1):
        super().__init__()
        self.dim, self.heads, self.head_dim, self.hidden = dim, heads, head_dim, hidden
        self.eps, self.theta, self.depth, self.taps = eps, theta, depth, tuple(taps)
        if self.taps:  # a real position's h: the final state and the tapped layers' residuals, fused (as MtpHead)
            add_tap_fusion(self)
        self.g_h, self.g_e, self.g_a = (nn.Parameter(torch.ones(dim)) for _ in range(3))
        self.g_m, self.g_o = nn.Parameter(torch.ones(dim)), nn.Parameter(torch.ones(dim))
        self.w_in = nn.Linear(2 * dim, dim, bias=False)
        self.w_qkv = nn.Linear(dim, 3 * heads * head_dim, bias=False)
        self.w_o = nn.Linear(heads * head_dim, dim, bias=False)
        self.w_gate_up = nn.Linear(dim, 2 * hidden, bias=False)
        self.w_down = nn.Linear(hidden, dim, bias=False)
        self.register_buffer("vocab", vocab.long())
        for w in (self.w_in, self.w_qkv, self.w_gate_up):
            nn.init.normal_(w.weight, std=0.02)
        nn.init.zeros_(self.w_o.weight)  # starts as MtpHead's pure fusion of the inputs
        nn.init.zeros_(self.w_down.weight)
        self.more = nn.ModuleList(Block(dim, heads, head_dim, hidden) for _ in range(layers - 1))

    @property
    def layers(self) -> list[nn.Module]:
        """The decoder layers, in order: the first's weights are the head's own (the one-layer format's names)."""
        return [self, *self.more]

    def save(self, path: str, base_fingerprint: str, extra: dict | None = None) -> None:
        write_heads(self, path, {"format": FORMAT, "dim": str(self.dim), "heads": str(self.heads),
                                 "head_dim": str(self.head_dim), "hidden": str(self.hidden), "eps": repr(self.eps),
                                 "theta": repr(self.theta), "depth": str(self.depth),
                                 **({"layers": str(len(self.layers))} if self.more else {})}, base_fingerprint, extra)

    @classmethod
    def load(cls, path: str) -> tuple["AttnDraftHead", dict]:
        tensors, meta, taps = read_heads(path, FORMAT)
        head = cls(int(meta["dim"]), int(meta["heads"]), int(meta["head_dim"]), int(meta["hidden"]), tensors["vocab"],
                   float(meta["eps"]), float(meta["theta"]), int(meta["depth"]), taps, int(meta.get("layers", 1)))
        head.load_state_dict(tensors)
        return head.eval(), meta

    def _fuse(self, h: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
        if h.shape[-1] != self.dim:  # the model's features [..., (1 + taps) * dim]: fused first
            h = fuse_taps(self, h)
        return self.w_in(torch.cat([_rms(h, self.eps) * self.g_h, _rms(e, self.eps) * self.g_e], dim=-1))

    def _qkv(self, z: torch.Tensor, pos: torch.Tensor, layer: nn.Module | None = None,
             valid: torch.Tensor | None = None):
        """z [B, T, dim] -> q, k, v [B, heads, T, head_dim] of `layer` (default the first), q and k rotated to `pos`;
        `valid` [B, T]: projected at those positions alone (the others' q, k, v are zero: a batch's padding)."""
        lay = layer or self
        B, T, _ = z.shape
        x = _rms(z, self.eps) * lay.g_a
        qkv = lay.w_qkv(x) if valid is None else _unpack(lay.w_qkv(x[valid]), valid)
        q, k, v = qkv.view(B, T, 3, self.heads, self.head_dim).unbind(2)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        return rope(q, pos, self.theta), rope(k, pos, self.theta), v

    def _block(self, z: torch.Tensor, attn: torch.Tensor, layer: nn.Module | None = None) -> torch.Tensor:
        """The residual stream after `layer`'s attention output `attn` and its SwiGLU block."""
        lay = layer or self
        B, _, T, _ = attn.shape
        z = z + lay.w_o(attn.transpose(1, 2).reshape(B, T, self.heads * self.head_dim))
        gate, up = lay.w_gate_up(_rms(z, self.eps) * lay.g_m).chunk(2, dim=-1)
        return z + lay.w_down(F.silu(gate) * up)

    def chain(self, h: torch.Tensor, emb: torch.Tensor, valid: torch.Tensor, steps: int,
              qpos: torch.Tensor | None = None) -> list[torch.Tensor]:
        """The chain's output states for every start position at once.

        h [B, T, W]: the real features (W = dim, or the model's features with taps); emb [B, T + steps - 1, dim]:
        the embeddings of the answer's tokens (teacher-forced chain inputs; zeros past the end); valid [B, T]:
        real positions. Returns `steps` tensors [B, T, dim]: step s at start t is the draft state for the token
        at t + s + 1. `qpos` [B, Q]: start the chains at these positions only (each row's keys are still all
        its real positions up to the start), and return [B, Q, dim] tensors: training on a window of an
        answer with the keys before it. With more than one layer, each layer's keys at the real positions come
        from the layer below at every position (the last layer's queries alone at the starts).
        """
        T = h.shape[1]
        pos = torch.arange(T)
        z = _unpack(self._fuse(h[valid], emb[:, :T][valid]), valid)  # the real positions alone: padding is masked
        P = pos.expand(h.shape[0], T) if qpos is None else qpos
        scale = 1.0 / math.sqrt(self.head_dim)
        causal = ((pos[None, None, :] <= pos[None, :, None]) & valid[:, None, :])[:, None] if self.more else None
        mask = ((pos[None, None, :] <= P[:, :, None]) & valid[:, None, :])[:, None]  # [B, 1, Q, T]
        real_kv = []
        for i, lay in enumerate(self.layers):
            q, k0, v0 = self._qkv(z, pos, lay, valid)
            real_kv.append((k0, v0))
            if i + 1 < len(self.layers):  # every position (causal [B, 1, T, T]): the next layer's keys
                scores = (q @ k0.transpose(-1, -2) * scale).masked_fill(~causal, float("-inf"))
                z = self._block(z, torch.softmax(scores, dim=-1).nan_to_num() @ v0, lay)
                continue
            if qpos is not None:  # the chains' starts alone
                z = z.gather(1, qpos[..., None].expand(-1, -1, z.shape[-1]))
                q = q.gather(2, qpos[:, None, :, None].expand(-1, q.shape[1], -1, q.shape[-1]))
            scores = (q @ k0.transpose(-1, -2) * scale).masked_fill(~mask, float("-inf"))
            z = self._block(z, torch.softmax(scores, dim=-1) @ v0, lay)
        out = [_rms(z, self.eps) * self.g_o]
        ks, vs = [[] for _ in self.layers], [[] for _ in self.layers]
        for s in range(1, steps):
            z = self._fuse(out[-1], emb.gather(1, (P + s)[..., None].expand(-1, -1, emb.shape[-1])))
            for i, lay in enumerate(self.layers):
                q, k, v = self._qkv(z, P + s, lay)
                ks[i].append(k)
                vs[i].append(v)
                k0, v0 = real_kv[i]
                real = (q @ k0.transpose(-1, -2) * scale).masked_fill(~mask, float("-inf"))
                diag = torch.stack([(q * kd).sum(-1) * scale for kd in ks[i]], dim=-1)  # [B, heads, Q, s]
                p = torch.softmax(torch.cat([real, diag], dim=-1), dim=-1)
                attn = p[..., :T] @ v0 + (p[..., T:, None] * torch.stack(vs[i], dim=-2)).sum(-2)
                z = self._block(z, attn, lay)
            out.append(_rms(z, self.eps) * self.g_o)
        return out
