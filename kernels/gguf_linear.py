"""A linear layer that keeps the GGUF's own blocks and multiplies with our AVX2 kernels.

`GGUFLinear` stores the weight exactly as the file does (raw Q4_0 / Q4_1 / Q8_0 / Q4_K
rows, rows of several tensors may be concatenated), so nothing is requantized or
rounded. With `cpu_gemv.arith() == "int8"` (the default) every call, decode and prefill
alike, runs `cpu_qgemm`'s integer GEMM (8-bit activations), so a row's result does not
depend on how many rows came with it. With "exact", decode (up to `cpu_gemv.MAX_M` tokens)
runs `cpu_gemv`'s fp32-activation GEMV, and prefill dequantizes the rows to fp32 for that
call (`cpu_gemv.dequantize`) and runs one dense GEMM. CPU only: `.to()` another device is refused; the loader uses
`quant_linear` (torch's int4/int8 kernels) there.

It knows nothing about models: callers decide which rows to fuse.
"""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType
from torch import nn

from kernels import cpu_gemv, cpu_qgemm

KIND_OF = {GGMLQuantizationType.Q4_0: "q4_0", GGMLQuantizationType.Q4_1: "q4_1",
           GGMLQuantizationType.Q8_0: "q8_0", GGMLQuantizationType.Q4_K: "q4_k"}


def supported(qtype: GGMLQuantizationType) -> bool:
    """True when this type has a kernel and the kernels are built for this machine."""
    return qtype in KIND_OF and cpu_gemv.available()


class GGUFLinear(nn.Module):
    def __init__(self, qtype: GGMLQuantizationType, data: np.ndarray, shape: tuple[int, int]):
        super().__init__()
        self.kind = KIND_OF[qtype]
        self.out_features, self.in_features = (int(s) for s in shape)
        values, nbytes = cpu_gemv.BLOCK[self.kind]
        rows = np.array(np.asarray(data).view(np.uint8).reshape(self.out_features, -1), copy=True)  # own, writable
        assert rows.shape[1] == self.in_features // values * nbytes, (rows.shape, shape)
        self.register_buffer("weight", torch.from_numpy(rows))  # uint8 [N, row_bytes], as in the file
        self.mode = "gguf"
        self._packed = None  # packed_weight()
        # Up to here: the GEMV in groups of MAX_M rows (each row computed on its own, so a token's result
        # does not depend on what it is batched with). From here on: dequantize + one dense GEMM, which
        # measured faster than 8 GEMV passes over the weights here.
        self.dense_min_tokens = 65

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, kind={self.kind}"

    def _apply(self, fn, recurse=True):
        out = fn(self.weight)
        if out.device.type != "cpu" or out.dtype != torch.uint8:
            raise RuntimeError("GGUFLinear holds raw GGUF blocks for the CPU kernels; load with quant='int4' "
                               "for other devices")
        return self

    def packed_weight(self) -> torch.Tensor:
        """The weight in cpu_qgemm's packed layout (rows of 8 as SIMD lanes), made on first use and kept
        beside the GGUF rows (the exact path and the portable kernels read those)."""
        if self._packed is None:
            self._packed = cpu_qgemm.repack(self.kind, self.weight, self.out_features, self.in_features)
        return self._packed

    def dequantized_weight(self) -> torch.Tensor:
        """fp32 [N, K], exactly the file's values."""
        return cpu_gemv.dequantize(self.kind, self.weight, self.out_features, self.in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)  # [num_tokens, in_features]
        if cpu_gemv.arith() == "int8":  # any number of rows: the same integer arithmetic per row
            if torch.compiler.is_compiling():
                y = torch.ops.edge_runtime.gguf_gemv(self.weight, x2.float().contiguous(), self.kind, self.out_features)
            elif cpu_qgemm.packed_supported(self.kind):
                y = cpu_qgemm.qgemm_packed(self.kind, self.packed_weight(), x2, self.out_features)
            else:
                y = cpu_qgemm.qgemm(self.kind, self.weight, x2, self.out_features)
        elif x2.shape[0] < self.dense_min_tokens:
            if torch.compiler.is_compiling():
                y = torch.ops.edge_runtime.gguf_gemv(self.weight, x2.float().contiguous(), self.kind, self.out_features)
            else:  # eager: straight to the C function; shapes were checked once, at construction
                if x2.dtype != torch.float32 or not x2.is_contiguous():
                    x2 = x2.float().contiguous()
                y = torch.empty((x2.shape[0], self.out_features), dtype=torch.float32)  # [M, N]
                fn, step = cpu_gemv.library().fns[self.kind], cpu_gemv.MAX_M
                for m0 in range(0, x2.shape[0], step):
                    m = min(step, x2.shape[0] - m0)
                    rc = fn(self.weight.data_ptr(), self.out_features, self.in_features, x2[m0].data_ptr(), m,
                            y[m0].data_ptr(), cpu_gemv.threads())
                    assert rc == 0, rc
        else:
            y = F.linear(x2.float(), self.dequantized_weight())
        return y.to(x.dtype).reshape(*lead, self.out_features)
