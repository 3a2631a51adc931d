"""The model runner of continuous batching: one scheduler step's chunks through the model.

A step holds decode tokens (one per running sequence, each followed by its
drafts, if any) and prefill chunks. Up to `decode_group` decode rows run as one
batched step over their sequences' block tables (a sequence's drafts are rows
at the next positions of the same table, so they attend to the rows before
them, exactly as if decoded one by one): on CPU with the GGUF kernels, one C call for all
layers (`FusedDecoder.step_batch`, whose GEMVs and attention compute every row
exactly as a one-token step does); elsewhere (CUDA, torch's int4 kernels) the
torch step with batched projections and `paged_decode_attention`. Each prefill
chunk runs as its own variable-length forward over its sequence's blocks (SDPA
where it applies, otherwise our tiled paged kernel; see transformer.py).

Batching is lossless on CPU: a sequence's logits do not depend on what it was
batched with, because every kernel a row passes through computes it on its
own, and prefill chunk boundaries are fixed by the scheduler.
"""
from __future__ import annotations

import time

import torch

from kernels.kv_cache import slot_tensor
from kernels.paged_attention import paged_decode_attention, paged_prefill_attention

from edge_runtime.model.fused_decode import tree_paths
from edge_runtime.model.transformer import features, rms_norm
from edge_runtime.engine.scheduler import ScheduledChunk


class BatchRunner:
    def __init__(self, model, decode_group: int | None = None):
        self.model = model
        if decode_group is None:
            from kernels.cpu_gemv import max_rows

            decode_group = max_rows() if model.fused is not None else 256
        self.decode_group = decode_group
        # prefill chunks up to this many tokens (in total) share one pass; the GGUF layers compute up
        # to 64 rows as row-by-row GEMVs, so packing them changes no row's result
        self.varlen_max_tokens = 64
        self.hidden: list[torch.Tensor | None] = []  # per chunk of the last run: what the head read [rows, dim]
        self.argmax: list[list[int] | None] = []  # per decode chunk of the last run: each row's argmax
        # of the last run: its decode calls' rows, sequences and time
        self.decode_rows = self.decode_sequences = self.decode_seconds = 0

    @torch.inference_mode()
    def run(self, chunks: list[ScheduledChunk], copies=()) -> list[torch.Tensor | None]:
        """For each chunk that samples, logits fp32 [rows, vocab] (on CPU): its last position's, then one
        row after each draft; None for the others. `hidden` then holds the final-normed hidden states of
        the same rows."""
        model = self.model
        if copies:
            model.kv.copy_blocks(copies)
        out: list[torch.Tensor | None] = [None] * len(chunks)
        self.hidden = [None] * len(chunks)
        self.argmax = [None] * len(chunks)
        decodes = [i for i, c in enumerate(chunks) if c.end - c.start == 1]
        small: list[int] = []  # prefill chunks packed into one variable-length forward
        for i, c in enumerate(chunks):
            n = c.end - c.start
            if n > self.varlen_max_tokens or (n > 1 and model.fused is not None and model.fused.exact_prefill()):
                ids = torch.tensor(c.token_ids, dtype=torch.long, device=model.device)
                logits = model(ids, c.start, block_table=c.block_table)
                if c.samples:
                    out[i] = logits[-1:].float().cpu()
                    self.hidden[i] = model.last_hidden.float().cpu().reshape(1, -1).clone()
            elif n > 1:
                if sum(chunks[j].end - chunks[j].start for j in small) + n > self.varlen_max_tokens:
                    self._varlen(chunks, small, out)
                    small = []
                small.append(i)
        if small:
            self._varlen(chunks, small, out)
        self.decode_rows, self.decode_sequences, self.decode_seconds = 0, 0, 0.0
        for group in self._groups(chunks, decodes):
            ids = [t for i in group for t in chunks[i].token_ids]
            positions, tails, bases = [], [], []
            for i in group:
                c = chunks[i]
                if c.parents:  # a draft tree: node r at start + its depth, attending over its own path
                    slots = slot_tensor(c.block_table, c.start, c.start + c.num_rows, model.kv.block_size).tolist()
                    paths = tree_paths(c.parents, slots)
                    positions += [c.start + len(path) - 1 for path in paths]
                    tails += paths
                    bases += [c.start] * len(paths)
                else:
                    positions += range(c.start, c.start + c.num_rows)
                    tails += [None] * c.num_rows
                    bases += [-1] * c.num_rows
            tables = [chunks[i].block_table for i in group for _ in range(chunks[i].num_rows)]
            t0 = time.perf_counter()
            logits = self.decode(ids, positions, tables, tails, bases)
            self.decode_seconds += time.perf_counter() - t0
            self.decode_rows += len(ids)
            self.decode_sequences += len(group)
            hidden = model.fused.batch_hidden if model.fused is not None else self._torch_hidden
            logits = logits.float().cpu()
            # every row's argmax in one call (greedy sampling reads it)
            best = model.fused.argmax(logits) if model.fused is not None else logits.argmax(dim=-1).tolist()
            row = 0
            for i in group:
                n = chunks[i].num_rows
                out[i], self.hidden[i] = logits[row:row + n], hidden[row:row + n].float().cpu()
                self.argmax[i] = best[row:row + n]
                row += n
        return out

    def _groups(self, chunks: list[ScheduledChunk], decodes: list[int]) -> list[list[int]]:
        """Decode chunks packed in order into calls of at most `decode_group` rows (a chunk and its drafts
        stay in one call)."""
        groups, rows = [[]], 0
        for i in decodes:
            n = chunks[i].num_rows
            if groups[-1] and rows + n > self.decode_group:
                groups.append([])
                rows = 0
            groups[-1].append(i)
            rows += n
        return [g for g in groups if g]

    def _varlen(self, chunks: list[ScheduledChunk], which: list[int], out: list) -> None:
        """Prefill chunks of several sequences in one pass: their rows share every projection (row by
        row, as each would alone), and attention runs per chunk over its own blocks."""
        model, kv, dev = self.model, self.model.kv, self.model.device
        bs = kv.block_size
        ids = [t for i in which for t in chunks[i].token_ids]
        pos = torch.tensor([p for i in which for p in range(chunks[i].start, chunks[i].end)], device=dev)
        slots = torch.cat([slot_tensor(chunks[i].block_table, chunks[i].start, chunks[i].end, bs, dev)
                           for i in which])
        tables = [torch.tensor(chunks[i].block_table, dtype=torch.long, device=dev) for i in which]
        bounds = [0]
        for i in which:
            bounds.append(bounds[-1] + chunks[i].end - chunks[i].start)
        x = model.embedding(torch.tensor(ids, dtype=torch.long, device=dev))
        cos, sin = model.cos[pos].unsqueeze(1), model.sin[pos].unsqueeze(1)
        tapped = []
        for layer, block in enumerate(model.blocks):
            q, k, v = block.qkv_rope(x, cos, sin)
            kv.write(layer, slots, k, v)
            attn = torch.cat([paged_prefill_attention(q[a:b], kv, layer, table, chunks[i].start, block.scale)
                              for i, table, a, b in zip(which, tables, bounds, bounds[1:])])
            x = block.out_mlp(x, attn)
            tapped += [x] if layer in model.taps else []
        last = [b - 1 for i, b in zip(which, bounds[1:]) if chunks[i].samples]
        if last:
            normed = rms_norm(x[last], model.norm, model.cfg.norm_eps)
            logits = model.output(normed).float().cpu()
            hidden = features(normed, [t[last] for t in tapped])
            for row, i in enumerate(i for i in which if chunks[i].samples):
                out[i], self.hidden[i] = logits[row:row + 1], hidden[row:row + 1].float().cpu()

    def decode(self, token_ids: list[int], positions: list[int], block_tables: list[list[int]], tails=None,
               bases=None) -> torch.Tensor:
        """One token of each sequence -> logits [M, vocab]; draft trees' rows with `tails` (fused step only)."""
        model = self.model
        if model.fused is not None:
            return model.fused.step_batch(token_ids, positions, block_tables, tails, bases)
        assert not any(tails or []), "draft trees need the fused C step"
        return self._decode_torch(token_ids, positions, block_tables)

    def _decode_torch(self, token_ids, positions, block_tables) -> torch.Tensor:
        model, kv, dev = self.model, self.model.kv, self.model.device
        bs = kv.block_size
        pos = torch.tensor(positions, dtype=torch.long, device=dev)
        x = model.embedding(torch.tensor(token_ids, dtype=torch.long, device=dev))
        cos, sin = model.cos[pos].unsqueeze(1), model.sin[pos].unsqueeze(1)
        slots = torch.tensor([t[p // bs] * bs + p % bs for t, p in zip(block_tables, positions)], device=dev)
        width = max(p // bs + 1 for p in positions)
        tables = torch.zeros(len(positions), width, dtype=torch.long, device=dev)
        for row, (t, p) in enumerate(zip(block_tables, positions)):
            tables[row, :p // bs + 1] = torch.tensor(t[:p // bs + 1], device=dev)
        tapped = []
        for layer, block in enumerate(model.blocks):
            q, k, v = block.qkv_rope(x, cos, sin)
            kv.write(layer, slots, k, v)
            x = block.out_mlp(x, paged_decode_attention(q, kv, layer, tables, pos + 1, block.scale))
            tapped += [x] if layer in model.taps else []
        normed = rms_norm(x, model.norm, model.cfg.norm_eps)
        self._torch_hidden = features(normed, tapped)
        return model.output(normed).float()
