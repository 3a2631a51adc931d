"""The one-token decode step in one C call: all layers, with the file's quantized blocks.

Same math as `Transformer.forward` for one token (fp32 residual stream, rotate-half
RoPE, grouped attention over the sequence's blocks of the paged KV cache, SwiGLU),
but `decode_layers` in `kernels/cpu_decode.c` runs the norms, the four GEMVs, RoPE,
the KV write (rounded to the pool's dtype as torch would), paged attention and
SwiGLU of every layer without returning to Python. It applies only when every
projection keeps raw GGUF blocks (`GGUFLinear`) on CPU; otherwise the torch step runs.
`transformer.py` stays the readable reference, and tests compare the two.
"""
from __future__ import annotations

import ctypes

import torch

from edge_runtime.model.transformer import features


class FusedDecoder:
    def __init__(self, model, lib):
        cfg = model.cfg
        self.model, self.lib, self.cfg = model, lib, cfg
        self.scale = ctypes.c_float(1.0 / cfg.head_dim ** 0.5)
        self.eps = ctypes.c_float(cfg.norm_eps)
        self.logits_norm = torch.empty(1, cfg.dim)
        self._tables_for = None  # the cache tensor the pointer tables were built for

    def _tables(self) -> None:
        """Pointer tables for decode_layers (rebuilt if the KV cache was reallocated)."""
        from kernels.cpu_gemv import KIND_CODE

        m, cfg = self.model, self.cfg
        kv = m.kv
        from kernels import cpu_gemv, cpu_qgemm

        lins = [lin for b in m.blocks for lin in (b.wqkv, b.wo, b.w_gate_up, b.w_down)]
        # int8 arithmetic reads the packed layout where the selected kernels have it (kind code + 16)
        packed = [cpu_gemv.arith() == "int8" and cpu_qgemm.packed_supported(lin.kind) for lin in lins]
        self.w_ptrs = (ctypes.c_void_p * len(lins))(*[lin.packed_weight().data_ptr() if p else lin.weight.data_ptr()
                                                      for lin, p in zip(lins, packed)])
        self.kinds = (ctypes.c_int * len(lins))(*[KIND_CODE[lin.kind] + 16 * p for lin, p in zip(lins, packed)])
        self.norm_ptrs = (ctypes.c_void_p * (2 * cfg.num_layers))(
            *[t.data_ptr() for b in m.blocks for t in (b.attn_norm, b.ffn_norm)])
        ptrs = []
        for layer in range(cfg.num_layers):
            ptrs += [kv.k[layer].data_ptr(), kv.v[layer].data_ptr()]
            ptrs += [kv.k_scale[layer].data_ptr(), kv.v_scale[layer].data_ptr()] if kv.quantized else [None, None]
        self.kv_ptrs = (ctypes.c_void_p * len(ptrs))(*ptrs)
        self.table = torch.zeros(-(-m.n_ctx // kv.block_size), dtype=torch.int32)
        n_qkv = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
        self.scratch = torch.empty(3 * cfg.dim + n_qkv + cfg.num_heads * cfg.head_dim + 3 * cfg.hidden_dim
                                   + cfg.num_heads * m.n_ctx)
        self._tables_for = (self.model.kv, self._table_key())  # the tables point into these pools and weights

    def _table_key(self) -> tuple:
        from kernels import cpu_gemv, cpu_qgemm

        return (cpu_gemv.arith(), cpu_qgemm.variant())

    def _whole_step(self, x: torch.Tensor, pos: int, block_table: list[int]) -> list[torch.Tensor]:
        from kernels import cpu_gemv

        m, cfg = self.model, self.cfg
        if self._tables_for is None or self._tables_for[0] is not m.kv or self._tables_for[1] != self._table_key():
            self._tables()
        n = pos // m.kv.block_size + 1
        assert len(block_table) >= n, "the block table must cover the new position"
        self.table[:n] = torch.tensor(block_table[:n], dtype=torch.int32)
        dims = (ctypes.c_int * 11)(cfg.dim, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.hidden_dim,
                                   pos, cpu_gemv.threads(), m.kv.block_size, KV_KIND[m.kv.kv_dtype], int(m.kv.rotated),
                                   cpu_gemv.arith_code())
        return self._layers(lambda n, w, kinds, norms, kv: self.lib.decode_layers(
            n, dims, self.eps, self.scale, w, kinds, norms, kv, self.table.data_ptr(), m.cos[pos].data_ptr(),
            m.sin[pos].data_ptr(), x.data_ptr(), self.scratch.data_ptr()), x, 1)

    def _layers(self, call, x: torch.Tensor, num: int) -> list[torch.Tensor]:
        """Runs `call(n_layers, w, kinds, norms, kv_pools)` (a decode_layers* function on the residual rows x)
        over every layer: in one call, or with the model's taps in runs of layers ending at each tap, since the
        C step keeps no residual between layers (x continues where a run stopped: the same bits as one call).
        Returns x's rows [num, dim] after each tapped layer."""
        from ctypes import addressof, c_int, c_void_p, sizeof

        def at(table, per_layer: int, size: int, layer: int) -> int:  # where `table`'s entries of `layer` begin
            return addressof(table) + per_layer * layer * size

        taps, tapped, first = self.model.taps, [], 0
        for end in sorted({t + 1 for t in taps} | {self.cfg.num_layers}):
            rc = call(end - first, at(self.w_ptrs, 4, sizeof(c_void_p), first), at(self.kinds, 4, sizeof(c_int), first),
                      at(self.norm_ptrs, 2, sizeof(c_void_p), first), at(self.kv_ptrs, 4, sizeof(c_void_p), first))
            assert rc == 0, rc
            if end - 1 in taps:
                tapped.append(x.reshape(num, -1).clone())
            first = end
        return tapped

    def _rows(self, token_ids: list[int], positions: list[int]):
        """What decode_layers_batch/_chunk take for these rows: the residual stream x [M, dim] (embedded,
        updated in place), scratch, and the ctypes arrays of positions, RoPE rows and dims."""
        from kernels import cpu_gemv

        m, cfg = self.model, self.cfg
        if self._tables_for is None or self._tables_for[0] is not m.kv or self._tables_for[1] != self._table_key():
            self._tables()
        num, max_pos = len(token_ids), max(positions)
        x = m.embedding(torch.tensor(token_ids)).reshape(num, cfg.dim).contiguous()
        n_row = 3 * cfg.dim + (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim + cfg.num_heads * cfg.head_dim
        scratch = torch.empty(num * (n_row + 3 * cfg.hidden_dim + cfg.num_heads * (max_pos + 1)))
        pos_arr = (ctypes.c_int * num)(*positions)
        cos = (ctypes.c_void_p * num)(*[m.cos[p].data_ptr() for p in positions])
        sin = (ctypes.c_void_p * num)(*[m.sin[p].data_ptr() for p in positions])
        dims = (ctypes.c_int * 11)(cfg.dim, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.hidden_dim, max_pos,
                                   cpu_gemv.threads(), m.kv.block_size, KV_KIND[m.kv.kv_dtype], int(m.kv.rotated),
                                   cpu_gemv.arith_code())
        return x, scratch, pos_arr, cos, sin, dims

    def _final_norm(self, x: torch.Tensor) -> torch.Tensor:
        """The final RMSNorm of each row, as the one-token step computes it: what the output head reads."""
        m, cfg = self.model, self.cfg
        normed = torch.empty(x.shape[0], cfg.dim)
        for row in range(x.shape[0]):
            self.lib.add_rmsnorm(x[row].data_ptr(), None, m.norm.data_ptr(), cfg.dim, self.eps, normed[row].data_ptr())
        return normed

    def step_batch(self, token_ids: list[int], positions: list[int], block_tables: list[list[int]],
                   tails: list[list[int] | None] | None = None, bases: list[int] | None = None) -> torch.Tensor:
        """Logits fp32 [M, vocab] for M tokens of M different sequences (M <= cpu_gemv.max_rows()), token m
        at positions[m] of the sequence whose blocks are block_tables[m]. Each row's result equals
        `step` of that token alone: the C code runs every row through the one-token operations.
        Draft trees (`decode_layers_batch_tree`): row m with tails[m] is a tree node at positions[m] =
        bases[m] + its depth, tails[m] the slots of its path from the tree's root (at bases[m]) to itself."""
        from kernels import cpu_gemv

        m, cfg = self.model, self.cfg
        num = len(token_ids)
        assert 1 <= num <= cpu_gemv.max_rows(), num
        x, scratch, pos_arr, cos, sin, dims = self._rows(token_ids, positions)
        bs = m.kv.block_size
        stride = max(p // bs + 1 for p in positions)
        flat: list[int] = []  # the rows' tables padded to one width, made into a tensor in one call
        for table, pos in zip(block_tables, positions):
            n = pos // bs + 1
            assert len(table) >= n, "each block table must cover its new position"
            flat += table[:n]
            flat += [0] * (stride - n)
        tables = torch.tensor(flat, dtype=torch.int32)
        if tails is None or all(t is None for t in tails):
            tapped = self._layers(lambda n, w, kinds, norms, kv: self.lib.decode_layers_batch(
                n, num, dims, self.eps, self.scale, w, kinds, norms, kv, tables.data_ptr(), stride, pos_arr, cos,
                sin, x.data_ptr(), scratch.data_ptr()), x, num)
        else:
            width = max(len(t) for t in tails if t is not None)
            flat_tails = torch.tensor([s for t in tails for s in (t or []) + [0] * (width - len(t or []))],
                                      dtype=torch.int32)
            base_arr = torch.tensor([b if t is not None else -1 for t, b in zip(tails, bases)], dtype=torch.int32)
            tapped = self._layers(lambda n, w, kinds, norms, kv: self.lib.decode_layers_batch_tree(
                n, num, dims, self.eps, self.scale, w, kinds, norms, kv, tables.data_ptr(), stride, pos_arr, cos,
                sin, x.data_ptr(), scratch.data_ptr(), flat_tails.data_ptr(), width, base_arr.data_ptr()), x, num)
        normed = self._final_norm(x)  # [M, dim]: what the head reads, one row per sequence
        self.batch_hidden = features(normed, tapped)  # what drafters read
        return m.output(normed).float()

    def prefill(self, token_ids: list[int], pos0: int, block_table: list[int], all_logits: bool = False) -> torch.Tensor:
        """Logits fp32 [T or 1, vocab] for a prompt piece at positions pos0.. through `step_chunk`: every row
        gets the one-token step's bits, so a prompt's last logits do not depend on how it was split (prefix-
        cache hits, chunked prefill, a worker's schedule) and equal feeding it one token at a time. Only the
        rows asked for go through the output head."""
        return self.step_chunk(token_ids, pos0, block_table, head="all" if all_logits else "last")

    def step_chunk(self, token_ids: list[int], pos0: int, block_table: list[int], head: str = "all") -> torch.Tensor:
        """Logits fp32 [T, vocab] for T consecutive tokens of one sequence at positions pos0.. (speculative
        verification: the last sampled token, then the drafts). Row i equals `step(token_ids[i], pos0 + i)`
        after steps of the tokens before it, bit for bit (`decode_layers_chunk`: the one-token operations,
        causal within the chunk), so greedy output with drafting equals plain decoding."""
        from kernels import cpu_gemv

        m, cfg = self.model, self.cfg
        last = pos0 + len(token_ids) - 1
        assert len(block_table) > last // m.kv.block_size, "the block table must cover the new positions"
        table = torch.tensor(block_table[:last // m.kv.block_size + 1], dtype=torch.int32)
        outs, hidden = [], []
        step = cpu_gemv.max_rows()
        for start in range(0, len(token_ids), step):
            ids = token_ids[start:start + step]
            x, scratch, pos_arr, cos, sin, dims = self._rows(ids, list(range(pos0 + start, pos0 + start + len(ids))))
            tapped = self._layers(lambda n, w, kinds, norms, kv: self.lib.decode_layers_chunk(
                n, len(ids), dims, self.eps, self.scale, w, kinds, norms, kv, table.data_ptr(), pos_arr, cos, sin,
                x.data_ptr(), scratch.data_ptr()), x, len(ids))
            normed = self._final_norm(x)
            hidden.append(features(normed, tapped))
            if head == "all":
                outs.append(m.output(normed).float())
        self.chunk_hidden = torch.cat(hidden)  # [T, dim]: what the head read (and the taps: what drafters read)
        m.last_hidden = self.chunk_hidden[-1]
        return torch.cat(outs) if head == "all" else m.output(self.chunk_hidden[-1:, :cfg.dim]).float()

    def step_tree(self, token_ids: list[int], parents: list[int], pos0: int, slots: list[int],
                  block_table: list[int]) -> torch.Tensor:
        """Logits fp32 [N, vocab] for a draft tree of one sequence (`NativeRunner.verify_tree`): node i at
        position pos0 + its depth, its K/V in slots[i]; row i equals the one-token step after node i's path
        (root first), bit for bit. `chunk_hidden` then holds what the head read."""
        paths = tree_paths(parents, slots)
        logits = self.step_batch(token_ids, [pos0 + len(p) - 1 for p in paths], [block_table] * len(paths),
                                 tails=paths, bases=[pos0] * len(paths))
        self.chunk_hidden = self.batch_hidden
        self.model.last_hidden = self.chunk_hidden[-1]
        return logits

    def argmax(self, logits: torch.Tensor) -> list[int]:
        """Each row's argmax of fp32 logits [M, vocab] in one C call (torch.argmax's index: the first on
        ties, the first NaN if any)."""
        logits = logits.float().contiguous()
        out = torch.empty(logits.shape[0], dtype=torch.int64)
        self.lib.rows_argmax(logits.data_ptr(), logits.shape[0], logits.shape[1], out.data_ptr())
        return out.tolist()

    @staticmethod
    def exact_prefill() -> bool:
        """True when prompts go through `prefill` too: with the integer kernels (cpu_gemv.arith() == "int8"),
        whose 8-bit rounding would turn the torch path's fp32 op-order differences into whole steps. With
        "exact" the torch path's dense prefill stays (faster there, within fp32 rounding of the C rows)."""
        from kernels import cpu_gemv

        return cpu_gemv.arith() == "int8"

    @staticmethod
    def usable(model) -> bool:
        b = model.blocks[0]
        all_gguf = all(getattr(lin, "mode", None) == "gguf" for blk in model.blocks
                       for lin in (blk.wqkv, blk.wo, blk.w_gate_up, blk.w_down))
        return (all_gguf and model.device.type == "cpu" and b.qkv_bias is None and model.kv is not None
                and model.cfg.head_dim <= 512 and model.cfg.head_dim % 2 == 0
                and model.cfg.num_heads * model.cfg.head_dim <= 8192 and model.cfg.num_heads <= 1024)

    def step(self, token_id: int, pos: int, block_table: list[int]) -> torch.Tensor:
        """Logits fp32 [1, vocab] for `token_id` at position `pos` (its K/V are written into its slot)."""
        m, cfg = self.model, self.cfg
        x = m.embedding(torch.tensor([token_id])).reshape(cfg.dim).contiguous()  # [dim], updated in place
        tapped = self._whole_step(x, pos, block_table)
        self.lib.add_rmsnorm(x.data_ptr(), None, m.norm.data_ptr(), cfg.dim, self.eps, self.logits_norm.data_ptr())
        m.last_hidden = features(self.logits_norm, tapped)[0]  # NOTE: without taps a view of a reused buffer
        return m.output(self.logits_norm).float()


def tree_paths(parents: list[int], slots: list[int]) -> list[list[int]]:
    """Each node's path of slots from the root (parents[0] = -1; a parent before its children)."""
    paths: list[list[int]] = []
    for i, parent in enumerate(parents):
        if not (i == 0 and parent == -1 or 0 <= parent < i):
            raise ValueError(f"node {i}: its parent {parent} must come before it (and only the root has -1)")
        paths.append((paths[parent] if i else []) + [slots[i]])
    return paths


KV_KIND = {"fp32": 0, "fp16": 1, "bf16": 2, "int8": 3}  # the pool dtype codes of cpu_decode.c
