"""Drafting with the attention head (spec/attn_head.py) in the batch engine: `--draft mtp-attn`.

The head attends over the answer so far, so each answer keeps the head's own small key/value cache: one
key and value per answer token (9 heads x 64 on the default model, 4.6 KB a token in fp32), at the
token's position in the answer, computed from the model's features at the row that chose the token
and the token's embedding, exactly the keys `AttnDraftHead.chain` trains with. The engine feeds every
sampled token with its row (`AttnChain.feed`: the decode token's and each accepted draft's, so a
verification that accepts three drafts adds four keys); a rejected draft never enters the cache. A chain
then starts at the last token: its query attends over the cache, step s >= 1 feeds the previous step's
state and drafted token and attends over the cache plus the chain's own earlier steps, as in training.

The matrices run as Q8_0 blocks on the kernels of kernels/ (`mtp.Q8Linear`: 8-bit activations where
cpu_qgemm has its packed layout, as `Q8Head`), the attention itself in fp32 torch. Drafts only propose:
verification with the full model decides every token, so this cannot change an answer, only how many
drafts are accepted.

Trees (`--draft mtp-attn-tree`): an `AttnChain` is also the head `TreeDrafter.grow` (spec/tree.py) steps,
one level of the tree at a time. A node at depth s is the chain's step s for the path above it: its query
attends over the answer's keys and the keys of its own ancestors below the root (`TreeStates`), so every
path of the tree is the chain those drafts would have made, to float rounding (a level one C call,
kernels/cpu_decode.c: attn_head_tree_level, where the kernels run; torch otherwise).
"""
from __future__ import annotations

import ctypes
import math
import time

import torch
import torch.nn.functional as F

from edge_runtime.spec.attn_head import FORMAT, AttnDraftHead
from edge_runtime.spec.mtp import Q8Linear, _rms, find_heads


class TreeStates:
    """A tree's frontier while it grows: per node the head's output state [F, dim] (None at the root, which
    starts from `z`, the last fed row's fused input) and the keys and values of its path below the root
    [F, heads, depth, head_dim], rotated to their positions."""

    def __init__(self, state, k: torch.Tensor, v: torch.Tensor, z=None):
        self.state, self.k, self.v, self.z = state, k, v, z

    def __getitem__(self, rows: list[int]) -> "TreeStates":
        return TreeStates(self.state[rows], self.k[rows], self.v[rows])


class AttnChain:
    """One answer's drafting state: the head's keys and values at its positions so far, and the rows fed
    since the last chain (absorbed when the next one starts)."""

    def __init__(self, drafter: "AttnDrafter"):
        d = drafter
        self.drafter, self.n, self.pending = d, 0, []
        self.k = torch.empty(d.heads, 64, d.head_dim)
        self.v = torch.empty(d.heads, 64, d.head_dim)
        self.z = self.q = None  # the last position's fused input and query: where the next chain starts (torch)
        self.zlast = torch.zeros(d.dim)  # the same fused input (the C step's)
        self.probs: list[float] = []  # the last chain's drafts' probabilities under the head

    def feed(self, hidden: torch.Tensor, token: int) -> None:
        """`token` was sampled from the logits of the row whose features are `hidden`."""
        self.pending.append((hidden, token))

    def propose(self, history: list[int], k: int, hidden=None, floor: float = 0.0) -> list[int]:
        """Up to k drafts after history[-1] (the drafter interface; the rows came through `feed`), each one's
        probability under the head in `probs`; `floor` > 0 stops the chain after the draft where the product
        of those probabilities falls below it (the drafts are the first ones of the chain without it)."""
        if not self.pending and self.n == 0:
            self.probs = []
            return []
        return self.drafter.draft(self, min(k, self.drafter.max_depth), floor)

    @property
    def vocab(self) -> list[int]:
        return self.drafter.vocab

    def first_state(self, hidden=None) -> TreeStates:
        """Where a tree starts (TreeDrafter.grow steps this chain as its head; the rows came through `feed`)."""
        return self.drafter.tree_root(self)

    def head_step(self, states: TreeStates, tokens: list[int]):
        return self.drafter.tree_step(self, states, tokens)

    def reserve(self, size: int) -> None:
        if size > self.k.shape[1]:  # grow by doubling
            grow = (self.k.shape[0], max(2 * self.k.shape[1], size) - self.n, self.k.shape[2])
            self.k = torch.cat([self.k[:, :self.n], self.k.new_empty(grow)], 1)
            self.v = torch.cat([self.v[:, :self.n], self.v.new_empty(grow)], 1)

    def store(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Keys and values [heads, m, head_dim] of the next m answer positions."""
        m = k.shape[1]
        self.reserve(self.n + m)
        self.k[:, self.n:self.n + m], self.v[:, self.n:self.n + m] = k, v
        self.n += m


class AttnDrafter:
    """The attention head, loaded for drafting: shared by every answer (each has its `AttnChain`)."""
    name = "mtp-attn"
    needs_hidden = True
    MAX_CHAINS = 64  # answers a C call takes (attn_head_chains)

    def __init__(self, head: AttnDraftHead, embed, fast: bool = True, c_step: bool = True, qtype: str = "q8_0"):
        if head.more:
            raise ValueError(f"the attention drafter runs heads of one decoder layer; this one has {len(head.layers)} "
                             "decoder layers (train-mtp --layers: measured offline only)")
        self.head, self.embed = head, embed  # embed: ids [N] -> [N, dim] fp32 (the base model's, tied with its head)
        self.heads, self.head_dim, self.dim, self.eps = head.heads, head.head_dim, head.dim, head.eps
        self.taps, self.max_depth = head.taps, head.depth
        with torch.inference_mode():
            self.head_rows = embed(head.vocab).float().reshape(len(head.vocab), head.dim).contiguous()
        self.vocab = head.vocab.tolist()
        self.row_of = {t: i for i, t in enumerate(self.vocab)}
        g = lambda p: p.detach().float().clone()  # noqa: E731
        self.g_h, self.g_e, self.g_a, self.g_m, self.g_o = (g(p) for p in (head.g_h, head.g_e, head.g_a, head.g_m,
                                                                          head.g_o))
        self.g_f = g(head.g_f) if self.taps else None
        lin = lambda w: Q8Linear(w, fast, qtype=qtype)  # noqa: E731
        self.w_f = lin(head.w_f.weight) if self.taps else None
        self.w_in, self.w_qkv, self.w_o = lin(head.w_in.weight), lin(head.w_qkv.weight), lin(head.w_o.weight)
        self.w_gate_up, self.w_down = lin(head.w_gate_up.weight), lin(head.w_down.weight)
        self.rows = lin(self.head_rows)
        self.freqs = head.theta ** (-torch.arange(0, self.head_dim, 2, dtype=torch.float32) / self.head_dim)
        self.scale = 1.0 / math.sqrt(self.head_dim)
        # every answer's drafts in one C call (kernels/cpu_decode.c: attn_head_chains) where the kernels run
        mats = (self.w_f or self.w_in, self.w_in, self.w_qkv, self.w_o, self.w_gate_up, self.w_down, self.rows)
        self.lib, self.chain_seconds = None, 0.0
        self.seconds = (ctypes.c_double * 2)()  # the C call's: its rows' part, its chain's
        if c_step and all(m.blocks is not None for m in mats):
            from kernels import cpu_gemv

            self.lib = cpu_gemv.library()
            gains = tuple(x.contiguous() for x in (self.g_f if self.taps else self.g_h, self.g_h, self.g_e, self.g_a,
                                                   self.g_m, self.g_o))
            self._keep = tuple(m.blocks for m in mats) + gains
            self._w = (ctypes.c_void_p * 7)(*(m.blocks.data_ptr() for m in mats))
            self._g = (ctypes.c_void_p * 6)(*(x.data_ptr() for x in gains))
            self._w_tree, self._g_tree = (ctypes.c_void_p * 6)(*self._w[1:]), (ctypes.c_void_p * 5)(*self._g[1:])
            self._dims = [self.dim, self.heads, self.head_dim, head.hidden, len(self.vocab), 1 + len(self.taps)]
            self._rows_ptr = self.head_rows.data_ptr()  # the draft vocabulary's embeddings, row j at 4 dim j bytes on
            self._arith = [self.w_in.kind, int(self.w_in.integer)]

    @classmethod
    def for_backend(cls, backend) -> "AttnDrafter":
        from edge_runtime.errors import InvalidRequestError

        if getattr(backend, "model", None) is None:
            raise InvalidRequestError(f"MTP drafting needs the native backend's hidden states, not {backend.name}")
        path = find_heads(backend, FORMAT)
        if path is None:
            raise InvalidRequestError("no attention draft head ships for this model: train one with `edge-runtime "
                                      "train-mtp --arch attention`")
        head, _ = AttnDraftHead.load(path)
        backend.model.taps = head.taps  # the model reports the layers the head reads with its hidden rows
        return cls(head, backend.model.embedding)

    def new_chain(self) -> AttnChain:
        return AttnChain(self)

    def _emb(self, tokens: list[int]) -> torch.Tensor:
        rows = [self.row_of.get(t) for t in tokens]
        if None not in rows:
            return self.head_rows[rows]
        return self.embed(torch.tensor(tokens)).float().reshape(len(tokens), self.dim)

    def _fuse(self, h: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
        if h.shape[-1] != self.dim:  # the model's features: the final state and the taps, fused first
            parts = h.reshape(h.shape[0], -1, self.dim)
            h = self.w_f((_rms(parts, self.eps) * self.g_f).flatten(1))
        return self.w_in(torch.cat([_rms(h, self.eps) * self.g_h, _rms(e, self.eps) * self.g_e], dim=-1))

    def _qkv(self, z: torch.Tensor, start: int, same: bool = False):
        """z [m, dim] at positions start.. (`same`: every row at start) -> q, k, v [heads, m, head_dim], q and k
        rotated (attn_head.rope)."""
        m = z.shape[0]
        q, k, v = self.w_qkv(_rms(z, self.eps) * self.g_a).view(m, 3, self.heads, self.head_dim).unbind(1)
        pos = torch.full((m,), float(start)) if same else torch.arange(start, start + m, dtype=torch.float32)
        ang = pos[:, None] * self.freqs  # [m, half]
        cos, sin = torch.cos(ang)[None], torch.sin(ang)[None]

        def rot(x):
            x = x.transpose(0, 1)
            a, b = x[..., :self.head_dim // 2], x[..., self.head_dim // 2:]
            return torch.cat([a * cos - b * sin, a * sin + b * cos], dim=-1)
        return rot(q), rot(k), v.transpose(0, 1)

    def _out(self, z: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """z [m, dim], attn [heads, m, head_dim] -> the step's output states [m, dim]."""
        z = z + self.w_o(attn.transpose(0, 1).reshape(z.shape[0], -1))
        gate, up = self.w_gate_up(_rms(z, self.eps) * self.g_m).chunk(2, dim=-1)
        z = z + self.w_down(F.silu(gate) * up)
        return _rms(z, self.eps) * self.g_o

    def draft(self, chain: AttnChain, k: int, floor: float = 0.0) -> list[int]:
        """The rows fed since the last chain into its cache, then up to k drafts from the last position
        (`AttnChain.propose`; their probabilities into `chain.probs`). Sets `chain_seconds`: the time of
        the chain's steps alone (the rows go in whatever k is, so the planner prices a draft by this)."""
        if self.lib is None:
            self.absorb(chain)
            t0 = time.perf_counter()
            drafts, chain.probs = self.chain(chain, k, floor)
            self.chain_seconds = time.perf_counter() - t0
            return drafts
        return self.draft_many([chain], [k], floor)[0]

    def draft_many(self, chains: list[AttnChain], ks: list[int], floor: float = 0.0) -> list[list[int]]:
        """`draft` for several answers at once: chains[i] drafts up to ks[i] (each stopping at `floor` on its
        own), the drafts of each in `chains[i].probs`. Where the kernels run, in one C call (the matrices once a
        step for all of them); `chain_seconds`: the chains' steps, all of them."""
        out: list[list[int]] = [[] for _ in chains]
        todo = [(i, c, min(k, self.max_depth)) for i, (c, k) in enumerate(zip(chains, ks)) if c.pending or c.n]
        for c in chains:
            c.probs = []  # (a chain never fed drafts nothing)
        self.chain_seconds = 0.0
        if self.lib is None:
            seconds = 0.0
            for i, chain, k in todo:
                out[i] = self.draft(chain, k, floor)
                seconds += self.chain_seconds
            self.chain_seconds = seconds
            return out
        while any(len(c.pending) > 8 for _, c, _ in todo):  # (runs of steps without drafts) eight rows a call
            self._c_chains([(c, c.pending[:8], 0) for _, c, _ in todo if len(c.pending) > 8])
        for at in range(0, len(todo), self.MAX_CHAINS):  # (a batch over MAX_CHAINS: a call for each share)
            part = todo[at:at + self.MAX_CHAINS]
            made = self._c_chains([(c, c.pending, k) for _, c, k in part], floor)
            for (i, *_), (drafts, _) in zip(part, made):
                out[i] = drafts
            self.chain_seconds += self.seconds[1]
        return out

    def _c_step(self, chain: AttnChain, rows: list, k: int, floor: float = 0.0) -> tuple[list[int], list[float]]:
        """One answer's rows (at most 8) into its cache, then up to k drafts: `_c_chains` for one."""
        return self._c_chains([(chain, rows, k)], floor)[0]

    def _c_chains(self, jobs: list, floor: float = 0.0) -> list[tuple[list[int], list[float]]]:
        """(chain, rows, k) for each answer: its rows (the first ones of its pending; at most 8) into its
        cache, then up to k drafts, every answer in one call (kernels/cpu_decode.c: attn_head_chains); each
        chain's pending loses the rows taken and its `probs` are its drafts'."""
        from kernels import cpu_gemv

        B, kmax = len(jobs), max(1, max(k for *_, k in jobs))
        rows = [r for _, rs, _ in jobs for r in rs]
        # pointers to each row's features and its token's embedding, nothing gathered here: after the model's
        # step evicted the caches, a torch op's first call costs ~0.1 ms (measured in the engine: 0.12 ms for
        # a stack of two rows that takes 4 us warm)
        h, e, keep = (ctypes.c_void_p * max(1, len(rows)))(), (ctypes.c_void_p * max(1, len(rows)))(), []
        for i, (hidden, token) in enumerate(rows):
            if hidden.dtype != torch.float32 or not hidden.is_contiguous():
                hidden = hidden.float().contiguous()
                keep.append(hidden)
            if hidden.numel() != self._dims[0] * self._dims[5]:
                raise ValueError(f"a fed row has {hidden.numel()} features; the head reads {self._dims[5]} x "
                                 f"{self._dims[0]}")
            h[i], j = hidden.data_ptr(), self.row_of.get(token)
            if j is None:  # outside the draft vocabulary: the model's own embedding
                keep.append(self._emb([token]).reshape(-1).contiguous())
            e[i] = self._rows_ptr + 4 * self.dim * j if j is not None else keep[-1].data_ptr()
        meta = (ctypes.c_int * (4 * B))()
        for i, (chain, rs, k) in enumerate(jobs):
            chain.reserve(chain.n + len(rs) + k)
            meta[4 * i:4 * i + 4] = [chain.n, len(rs), k, chain.k.shape[1]]
        ptrs = lambda xs: (ctypes.c_void_p * B)(*(x.data_ptr() for x in xs))  # noqa: E731
        dims = (ctypes.c_int * 10)(*self._dims, cpu_gemv.threads(), *self._arith, kmax)
        drafts, probs, made = (ctypes.c_int * (B * kmax))(), (ctypes.c_float * (B * kmax))(), (ctypes.c_int * B)()
        rc = self.lib.attn_head_chains(B, dims, meta, self.eps, self.scale, self._w, self._g, h, e,
                                       ptrs(c.k for c, *_ in jobs), ptrs(c.v for c, *_ in jobs),
                                       ptrs(c.zlast for c, *_ in jobs), self.freqs.data_ptr(),
                                       self.head_rows.data_ptr(), floor, drafts, probs, made, self.seconds)
        if rc:
            shapes = [tuple(meta[4 * i:4 * i + 4]) for i in range(B)]
            raise ValueError(f"attn_head_chains rejected its arguments (n, m, k, cap: {shapes}): rc={rc}")
        out = []
        for i, (chain, rs, k) in enumerate(jobs):
            chain.n += len(rs)
            chain.pending = chain.pending[len(rs):]
            got = range(i * kmax, i * kmax + made[i])
            chain.probs = [probs[j] for j in got]
            out.append(([self.vocab[drafts[j]] for j in got], chain.probs))
        return out

    @torch.inference_mode()
    def absorb(self, chain: AttnChain) -> None:
        """The rows fed since the last chain into its cache; the last one is where the next chain starts."""
        if not chain.pending:
            return
        h = torch.stack([r.float().reshape(-1) for r, _ in chain.pending])
        z = self._fuse(h, self._emb([t for _, t in chain.pending]))
        q, k, v = self._qkv(z, chain.n)
        chain.store(k, v)
        chain.z, chain.q, chain.pending = z[-1:], q[:, -1:], []

    @torch.inference_mode()
    def chain(self, chain: AttnChain, k: int, floor: float = 0.0) -> tuple[list[int], list[float]]:
        """Up to k drafts from the chain's last position (`AttnDraftHead.chain` for that start, one step at a
        time) and their probabilities under the head; stops as the C step does below `floor`."""
        n, z, q = chain.n, chain.z, chain.q
        chain.reserve(n + k)  # the chain's own keys go after the answer's, and are overwritten by the next
        out, probs, reached = [], [], 1.0
        for s in range(k):
            if s:  # the previous step's state and its draft, one position on
                z = self._fuse(state, self._emb(out[-1:]))
                q, chain.k[:, n + s - 1:n + s], chain.v[:, n + s - 1:n + s] = self._qkv(z, n - 1 + s)
            keys, values = chain.k[:, :n + s], chain.v[:, :n + s]
            p = torch.softmax((q @ keys.transpose(1, 2)) * self.scale, dim=-1)  # [heads, 1, keys]
            state = self._out(z, p @ values)
            logits = self.rows(state)[0]
            best = int(logits.numpy().argmax())
            out.append(self.vocab[best])
            probs.append(float(1.0 / torch.exp(logits - logits[best]).sum()))
            reached *= probs[-1]
            if reached < floor:
                break
        return out, probs

    @torch.inference_mode()
    def tree_root(self, chain: AttnChain) -> TreeStates:
        """The rows fed since the last chain into its cache; a tree then starts at the last of them."""
        if self.lib is None:
            self.absorb(chain)
            z = chain.z
        else:
            self.draft_many([chain], [0])  # the rows alone (eight a call), no chain
            z = chain.zlast[None].clone()
        empty = torch.empty(1, self.heads, 0, self.head_dim)
        return TreeStates(None, empty, empty, z)

    @torch.inference_mode()
    def tree_step(self, chain: AttnChain, states: TreeStates, tokens: list[int]):
        """One level of a tree for F frontier nodes: the nodes' states and the drafts after them ([F] tokens;
        at the root: the last fed token, already in the cache) -> the children's states and their
        draft-vocabulary logits [F, len(vocab)]. A child at depth s is the chain's step s for its path."""
        if self.lib is not None:
            return self._c_tree_step(chain, states, tokens)
        n = chain.n
        if states.state is None:  # the root: the chain's step 0
            z, k, v = states.z, states.k, states.v
            q = self._qkv(z, n - 1)[0]
        else:
            z = self._fuse(states.state, self._emb(tokens))
            q, k1, v1 = self._qkv(z, n + states.k.shape[2], same=True)  # depth s at position n - 1 + s
            k = torch.cat([states.k, k1.transpose(0, 1)[:, :, None]], 2)
            v = torch.cat([states.v, v1.transpose(0, 1)[:, :, None]], 2)
        qf = q.transpose(0, 1)  # [F, heads, head_dim]: over the answer's keys, then its own path's
        scores = torch.cat([torch.einsum("fhd,hnd->fhn", qf, chain.k[:, :n]), torch.einsum("fhd,fhsd->fhs", qf, k)],
                           -1)
        p = torch.softmax(scores * self.scale, dim=-1)
        attn = torch.einsum("fhn,hnd->fhd", p[..., :n], chain.v[:, :n])
        attn = attn + torch.einsum("fhs,fhsd->fhd", p[..., n:], v)
        state = self._out(z, attn.transpose(0, 1))
        return TreeStates(state, k, v), self.rows(state)

    def _c_tree_step(self, chain: AttnChain, states: TreeStates, tokens: list[int]):
        """tree_step in one C call (kernels/cpu_decode.c: attn_head_tree_level)."""
        from kernels import cpu_gemv

        root, F, s = states.state is None, len(tokens), states.k.shape[2]
        h = torch.zeros(1) if root else states.state.float().contiguous()
        e = torch.zeros(1) if root else self._emb(tokens).contiguous()
        pk, pv = (torch.zeros(1), torch.zeros(1)) if root else (states.k.contiguous(), states.v.contiguous())
        knew, vnew = torch.empty(F, self.heads, self.head_dim), torch.empty(F, self.heads, self.head_dim)
        state, logits = torch.empty(F, self.dim), torch.empty(F, len(self.vocab))
        dims = (ctypes.c_int * 13)(*self._dims[:5], cpu_gemv.threads(), *self._arith, chain.n, F, s, chain.k.shape[1],
                                   int(root))
        rc = self.lib.attn_head_tree_level(dims, self.eps, self.scale, self._w_tree, self._g_tree, h.data_ptr(),
                                           e.data_ptr(), chain.zlast.data_ptr(), chain.k.data_ptr(), chain.v.data_ptr(),
                                           pk.data_ptr(), pv.data_ptr(), self.freqs.data_ptr(), knew.data_ptr(),
                                           vnew.data_ptr(), state.data_ptr(), logits.data_ptr())
        if rc:
            raise ValueError(f"attn_head_tree_level rejected its arguments (n={chain.n}, F={F}, s={s}): rc={rc}")
        k, v = states.k, states.v
        if not root:  # the nodes' own keys and values join their paths'
            k, v = torch.cat([k, knew[:, :, None]], 2), torch.cat([v, vnew[:, :, None]], 2)
        return TreeStates(state, k, v), logits
