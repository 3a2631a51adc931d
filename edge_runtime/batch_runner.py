"""The model runner of continuous batching: one scheduler step's chunks through the model.

A step holds decode tokens (one per running sequence) and prefill chunks.
The decode tokens of up to `decode_group` sequences run as one batched step
over their own block tables: on CPU with the GGUF kernels, one C call for all
layers (`FusedDecoder.step_batch`, whose GEMVs and attention compute every row
exactly as a one-token step does); elsewhere (CUDA, torch's int4 kernels) the
torch step with batched projections and `paged_decode_attention`. Each prefill
chunk runs as its own variable-length forward over its sequence's blocks (SDPA
where it applies, otherwise our tiled paged kernel; see model.py).

Batching is lossless on CPU: a sequence's logits do not depend on what it was
batched with, because every kernel a row passes through computes it on its
own, and prefill chunk boundaries are fixed by the scheduler.
"""
from __future__ import annotations

import torch

from kernels.paged_attention import paged_decode_attention

from .model import rms_norm
from .scheduler import ScheduledChunk


class BatchRunner:
    def __init__(self, model, decode_group: int | None = None):
        self.model = model
        if decode_group is None:
            from kernels.cpu_gemv import MAX_M

            decode_group = MAX_M if model.fused is not None else 256
        self.decode_group = decode_group

    @torch.inference_mode()
    def run(self, chunks: list[ScheduledChunk], copies=()) -> list[torch.Tensor | None]:
        """Logits fp32 [vocab] (on CPU) for each chunk that samples, None for the others."""
        model = self.model
        if copies:
            model.kv.copy_blocks(copies)
        out: list[torch.Tensor | None] = [None] * len(chunks)
        decodes = [i for i, c in enumerate(chunks) if c.end - c.start == 1]
        for i, c in enumerate(chunks):
            if c.end - c.start > 1:
                ids = torch.tensor(c.token_ids, dtype=torch.long, device=model.device)
                logits = model(ids, c.start, block_table=c.block_table)
                if c.samples:
                    out[i] = logits[-1].float().cpu()
        for g in range(0, len(decodes), self.decode_group):
            group = decodes[g:g + self.decode_group]
            logits = self.decode([chunks[i].token_ids[0] for i in group], [chunks[i].start for i in group],
                                 [chunks[i].block_table for i in group])
            for row, i in enumerate(group):
                out[i] = logits[row].float().cpu()
        return out

    def decode(self, token_ids: list[int], positions: list[int], block_tables: list[list[int]]) -> torch.Tensor:
        """One token of each sequence -> logits [M, vocab]."""
        model = self.model
        if model.fused is not None:
            return model.fused.step_batch(token_ids, positions, block_tables)
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
        for layer, block in enumerate(model.blocks):
            q, k, v = block.qkv_rope(x, cos, sin)
            kv.write(layer, slots, k, v)
            x = block.out_mlp(x, paged_decode_attention(q, kv, layer, tables, pos + 1, block.scale))
        return model.output(rms_norm(x, model.norm, model.cfg.norm_eps)).float()
