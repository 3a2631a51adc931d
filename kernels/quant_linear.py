"""Linear and embedding layers whose weights stay quantized in memory, built from raw GGUF rows.

`pack_weight(qtype, data, shape, mode)` turns one GGUF tensor (or several tensors'
rows, fused or permuted by the caller) into a `QuantLinear`. Storage modes, as
`QuantLinear.mode` reports them after packing:

  "int4"        Q4_0 / Q4_1 / Q4_K: the file's 4-bit codes repacked, not requantized,
                for torch's int4 kernel: groups of 32, `w = (q - 8) * scale + zero`.
                The only rounding is scale and zero to bf16. Any other type asked for
                "int4" falls back to "int8".
  "int8"        per-output-channel symmetric int8 requantized from the exact fp32
                weights (scale = max|row| / 127, stored bf16).
  "int8_block"  Q8_0 only: the file's int8 codes kept exactly, each split into two 4-bit
                codes run through the same int4 kernel (see QuantLinear); the only
                rounding is the fp16 block scale to bf16. Other types fall back to "int8".
  "bf16"        dense bf16 weights (the exact weights rounded once to bf16).
  "fp32"        dense fp32 weights, exact w.r.t. the file: the reference path
                (`reference_linear` is the same thing as a plain function).

The int kernels take bf16 activations (their fp32 path is ~20x slower on CPU);
`forward` casts x to bf16 and the result back to x.dtype. They are GEMV-like: their
cost grows linearly with the number of tokens, so for large prefill batches one
fp32 GEMM is ~2x faster even after dequantizing the weight for that call. Setting
`layer.dense_min_tokens = n` takes that path from n tokens on (off by default;
worth it from ~128-256 tokens under torch.compile, not for the 49k-row head).

Devices: `.to(device)` moves a layer. The int4 codes are repacked for the new
device's kernel (CPU: `_weight_int4pack_mm_for_cpu`; CUDA: `_weight_int4pack_mm`,
used only if a self-check at pack time passes). The CPU kernel's byte layout is
ATen's choice at run time, by CPU capability (AVX2, AVX-512, none): we write the
one of `CPU_LAYOUTS` that matches torch's packer on probes (checked once per
process), else use torch's packer and no prefill switch; unpickled layers packed
for another layout are repacked. On other devices, and for
"int8" off CPU, the layer keeps its compact storage and dequantizes the
weight inside forward. Dtype casts (`.half()`, `.to(torch.float32)`) never change
the storage: it is fixed by the mode.

This module knows nothing of model structure: callers choose which tensors to
fuse and which mode each gets. Block decoding lives in `gguf_blocks`.
"""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType
from torch import nn

from kernels.int4_layout import CPU_LAYOUTS, Int4CpuLayout  # noqa: F401 (re-exported)
from kernels.int4_layout import cpu_layout as _cpu_layout
from kernels.int4_layout import pack as _pack_int4_cpu_direct
from kernels.int4_layout import unpack as _unpack_int4_cpu
from kernels.gguf_blocks import GROUP_SIZE, INT4_EXACT_TYPES, as_rows, check_supported, dequantize, int4_groups, q8_0_blocks

T = GGMLQuantizationType
MODES = ("int4", "int8", "int8_block", "bf16", "fp32")
_aten = torch.ops.aten


def _numpy_to_bf16(a: np.ndarray) -> torch.Tensor:
    """float32 array -> bf16 tensor, rounding to nearest even (as torch does), in numpy."""
    a = np.ascontiguousarray(a, dtype=np.float32)
    bits = a.view(np.uint32)
    rounded = ((bits + (np.uint32(0x7FFF) + ((bits >> 16) & 1))) >> 16).astype(np.uint16)
    rounded[np.isnan(a)] = 0x7FC0  # keep NaN a NaN (the carry could turn it into inf)
    return torch.from_numpy(rounded).view(torch.bfloat16)


def _cuda_inner_k_tiles(in_features: int, out_features: int) -> int | None:
    if out_features % 8:
        return None
    for tiles in (8, 4, 2):
        if in_features % (tiles * 16) == 0:
            return tiles
    return None


class QuantLinear(nn.Module):
    """`y = x @ W^T` with W stored in one of `MODES`. Build it with `pack_weight`.

    Buffers by kernel (`self.kernel`, the path forward takes on the current device):
      int4_cpu / int4_cuda  weight: the int4 kernel's packed codes; scales: bf16 [K4/32, N, 2]
      int4_dequant          weight: uint8 codes [N, K4] (0..15); scales as above
      int8 / int8_dequant   weight: int8 [N, K]; scales: bf16 [N]
      dense                 weight: bf16 or fp32 [N, K]
    K4 is in_features for "int4" and 2 * in_features for "int8_block", which stores each
    Q8_0 code q as two 4-bit codes: q + 128 = 16 h + l, so d q = 16 d (h - 8) + d (l - 8) + 8 d
    (a high group with scale 16 d, zero 0, then a low group with scale d, zero 8 d), and
    forward feeds every 32-column block of x twice. With d rounded to bf16 this is exactly
    bf16(d) * q: the codes are kept, only the block scale is rounded.
    """

    def __init__(self, mode: str, in_features: int, out_features: int, weight: torch.Tensor, scales: torch.Tensor | None):
        super().__init__()
        assert mode in MODES, mode
        self.mode, self.in_features, self.out_features = mode, in_features, out_features
        self.register_buffer("weight", weight)
        self.register_buffer("scales", scales)
        self.kernel = "dense"
        # int4_cpu: the layout of `weight`, an Int4CpuLayout (we can unpack it), else aten's tag.
        self.cpu_layout: Int4CpuLayout | str | None = None
        # Prefill switch: from this many tokens on, CPU int layers dequantize to fp32 and use
        # one dense GEMM (faster for large batches, see the module docstring); None: never.
        self.dense_min_tokens: int | None = None
        if mode in ("int4", "int8_block"):
            self._pack_int4(weight)
        elif mode == "int8":
            self.kernel = "int8" if weight.device.type == "cpu" else "int8_dequant"

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, mode={self.mode}, kernel={self.kernel}"

    @property
    def _int4_columns(self) -> int:
        return self.in_features * (2 if self.mode == "int8_block" else 1)

    # --- packing and device moves -------------------------------------------------------------

    def _pack_int4(self, codes: torch.Tensor) -> None:
        """Stores `codes` (uint8 [N, K4], 0..15) in the layout of this device's int4 kernel."""
        device, k4 = codes.device, codes.shape[1]
        self.cpu_layout = None
        if device.type == "cpu" and self.out_features % 16 == 0:  # NOTE: the CPU packer needs N % 16 == 0
            layout = _cpu_layout()
            if isinstance(layout, Int4CpuLayout):
                self.weight = _pack_int4_cpu_direct(codes.numpy(), layout)
            else:  # a layout we do not know: torch's own packer
                self.weight = _aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32).contiguous(), 1)
            self.cpu_layout, self.kernel = layout, "int4_cpu"
            return
        tiles = _cuda_inner_k_tiles(k4, self.out_features)
        if device.type == "cuda" and tiles is not None:
            try:
                pairs = ((codes[:, ::2] << 4) | codes[:, 1::2]).to(torch.uint8).contiguous()  # [N, K4/2]
                self.weight = _aten._convert_weight_to_int4pack(pairs, tiles)
                self.kernel = "int4_cuda"
                if torch.equal(self.int4_codes(), codes):  # NOTE: layout self-check, once per pack
                    return
            except RuntimeError:
                pass
        self.weight = codes.contiguous()
        self.kernel = "int4_dequant"

    def use_generic_kernel(self) -> None:
        """Switches to the any-device path (dequantize inside forward) on the current device.

        Devices without a kernel get it automatically; on CPU it is the test override for that path.
        """
        if self.kernel in ("int4_cpu", "int4_cuda"):
            self.weight = self.int4_codes()
            self.kernel = "int4_dequant"
        elif self.kernel == "int8":
            self.kernel = "int8_dequant"

    def __setstate__(self, state):
        super().__setstate__(state)
        # NOTE: a pickled int4_cpu layer (the packed-model cache) may come from a process whose ATen
        # used another layout (another CPU, ATEN_CPU_CAPABILITY): repack its codes for this one.
        layout = getattr(self, "cpu_layout", None)
        if self.kernel == "int4_cpu" and layout != _cpu_layout():
            if not isinstance(layout, Int4CpuLayout):
                raise RuntimeError(f"int4 weights packed for {layout!r}, this process uses {_cpu_layout()!r}")
            self._pack_int4(_unpack_int4_cpu(self.weight, self.out_features, self._int4_columns, layout))

    def _apply(self, fn, recurse=True):
        # NOTE: storage dtypes are fixed by the kernel: a dtype cast in `fn` is dropped, the move is kept.
        def keep_dtype(t: torch.Tensor) -> torch.Tensor:
            out = fn(t)
            return out if out.dtype == t.dtype else t.to(out.device)

        new_device = fn(torch.empty(0, dtype=torch.uint8, device=self.weight.device)).device
        moving = new_device != self.weight.device
        packed = self.mode in ("int4", "int8_block")
        if moving and packed:
            self.weight = self.int4_codes()  # [N, K4] uint8: device-neutral
        super()._apply(keep_dtype, recurse)
        if moving and packed:
            self._pack_int4(self.weight)
        elif moving and self.mode == "int8":
            self.kernel = "int8" if new_device.type == "cpu" else "int8_dequant"
        return self

    # --- views of the stored weight (tests, device moves, the generic path) --------------------

    def _int4_mm(self, x: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        if self.kernel == "int4_cpu":  # x: [M, K4] bf16 -> [M, N] bf16
            return _aten._weight_int4pack_mm_for_cpu(x, self.weight, GROUP_SIZE, scales)
        return _aten._weight_int4pack_mm(x, self.weight, GROUP_SIZE, scales)

    def int4_codes(self) -> torch.Tensor:
        """The stored 4-bit codes as uint8 [N, K4]: unpacked from a known CPU layout, else
        read back through the kernel itself (identity input)."""
        assert self.mode in ("int4", "int8_block")
        if self.kernel == "int4_dequant":
            return self.weight
        if self.kernel == "int4_cpu" and isinstance(self.cpu_layout, Int4CpuLayout):
            return _unpack_int4_cpu(self.weight, self.out_features, self._int4_columns, self.cpu_layout)
        eye = torch.eye(self._int4_columns, dtype=torch.bfloat16, device=self.weight.device)  # [K4, K4]
        unit = torch.zeros_like(self.scales)
        unit[..., 0] = 1  # scale 1, zero 0: the kernel returns q - 8, exact in bf16
        return (self._int4_mm(eye, unit).t().float() + 8).to(torch.uint8).contiguous()  # [N, K4]

    def dequantized_weight(self) -> torch.Tensor:
        """The weight this layer multiplies by, in fp32 [N, K] (int modes: codes times bf16 scales)."""
        if self.mode in ("int4", "int8_block"):
            codes = self.int4_codes().float().view(self.out_features, -1, GROUP_SIZE)  # [N, K4/32, 32]
            scale, zero = self.scales.float().permute(2, 1, 0).unsqueeze(-1)  # [N, K4/32, 1] each
            w = (codes - 8) * scale + zero
            if self.mode == "int8_block":  # high + low group of each block (exact in fp32)
                w = w.view(self.out_features, -1, 2, GROUP_SIZE).sum(dim=2)
            return w.reshape(self.out_features, self.in_features)
        if self.mode == "int8":
            return self.weight.float() * self.scales.float()[:, None]
        return self.weight.float()

    # --- forward ------------------------------------------------------------------------------

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)  # [num_tokens, in_features]
        kernel = self.kernel
        if self.dense_min_tokens is not None and x2.shape[0] >= self.dense_min_tokens and (
            kernel == "int8" or (kernel == "int4_cpu" and isinstance(self.cpu_layout, Int4CpuLayout))
        ):  # NOTE: int4 only from a layout we unpack: reading codes back through the kernel costs more
            kernel = "prefill"
        if kernel == "dense":
            y = F.linear(x2.to(self.weight.dtype), self.weight)
        elif kernel in ("int4_cpu", "int4_cuda"):
            xb = x2.to(torch.bfloat16)
            if self.mode == "int8_block":  # every 32-column block twice: [num_tokens, K/32, 2, 32]
                xb = xb.view(-1, self.in_features // GROUP_SIZE, 1, GROUP_SIZE).expand(-1, -1, 2, -1)
            y = self._int4_mm(xb.reshape(-1, self._int4_columns).contiguous(), self.scales)
        elif kernel == "int8":
            y = _aten._weight_int8pack_mm(x2.to(torch.bfloat16).contiguous(), self.weight, self.scales)
        elif kernel == "prefill":  # fp32 weights for this call only, one dense GEMM
            y = F.linear(x2.float(), self.dequantized_weight())
        else:  # int4_dequant / int8_dequant: compact storage, dense bf16 math, any device
            y = F.linear(x2.to(torch.bfloat16), self.dequantized_weight().to(torch.bfloat16))
        return y.to(x.dtype).reshape(*lead, self.out_features)


def pack_weight(qtype: GGMLQuantizationType, data: np.ndarray, shape: tuple[int, int], mode: str, *, name: str = "") -> QuantLinear:
    """Builds a CPU `QuantLinear` from raw GGUF rows.

    Args:
        qtype: the rows' GGML type (F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q4_K, Q5_K or Q6_K).
        data: raw tensor data as `gguf.GGUFReader` exposes it; rows may come from several
            tensors of the same type, concatenated or permuted.
        shape: (out_features, in_features) of `data`.
        mode: one of `MODES`; "int4" and "int8_block" fall back to "int8" for types they
            cannot hold exactly (see the module docstring). The result's `.mode` says which.
        name: tensor name for error messages.
    Returns:
        QuantLinear on CPU.
    Raises:
        UnsupportedTensorError: unsupported type, or data that does not match `shape`.
    """
    qtype = check_supported(qtype, name)
    if mode not in MODES:
        raise ValueError(f"unknown QuantLinear mode {mode!r}; expected one of {MODES}")
    out_features, in_features = (int(s) for s in shape)
    if mode == "int4" and qtype in INT4_EXACT_TYPES:
        codes, scale, zero = int4_groups(qtype, data, (out_features, in_features), name)
        scales = _numpy_to_bf16(np.stack([scale.T, zero.T], axis=-1))  # [K/32, N, 2]
        return QuantLinear("int4", in_features, out_features, torch.from_numpy(codes), scales)
    if mode == "int8_block" and qtype == T.Q8_0:
        q, d = q8_0_blocks(data, (out_features, in_features), name)  # int8 [N, K], fp16 [N, K/32]
        u = (q.astype(np.int16) + 128).astype(np.uint8).reshape(out_features, -1, 1, GROUP_SIZE)
        codes = np.concatenate([u >> 4, u & 15], axis=2).reshape(out_features, 2 * in_features)  # hi, lo groups
        d = d.astype(np.float32)
        scale = np.stack([16 * d, d], axis=-1).reshape(out_features, -1)  # [N, 2K/32]
        zero = np.stack([np.zeros_like(d), 8 * d], axis=-1).reshape(out_features, -1)
        scales = _numpy_to_bf16(np.stack([scale.T, zero.T], axis=-1))  # [2K/32, N, 2]
        return QuantLinear("int8_block", in_features, out_features, torch.from_numpy(codes), scales)
    w = dequantize(qtype, data, (out_features, in_features), name)  # [N, K] fp32, exact
    if mode in ("int4", "int8", "int8_block"):
        weight, scales = quantize_int8_per_channel(w)
        return QuantLinear("int8", in_features, out_features, weight, scales)
    dense = torch.from_numpy(w) if mode == "fp32" else _numpy_to_bf16(w)
    return QuantLinear(mode, in_features, out_features, dense, None)


def quantize_int8_per_channel(w: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 [N, K] -> (int8 [N, K], bf16 scales [N]); symmetric, scale = max|row| / 127 rounded to bf16."""
    scales = _numpy_to_bf16(np.abs(w).max(axis=1) / np.float32(127))  # [N]
    s = (scales.view(torch.int16).numpy().astype(np.uint16).astype(np.uint32) << 16).view(np.float32)
    s = np.where(s > 0, s, np.float32(1))[:, None]
    q = np.clip(np.rint(w / s), -127, 127).astype(np.int8)  # numpy: no thread pool to wait on
    return torch.from_numpy(q), scales


def reference_linear(qtype: GGMLQuantizationType, data: np.ndarray, shape: tuple[int, int], x: torch.Tensor) -> torch.Tensor:
    """Plain reference for every QuantLinear kernel: fp32 `x @ W^T` with W exactly as gguf dequantizes it."""
    w = torch.from_numpy(dequantize(qtype, data, shape))  # [N, K]
    return F.linear(x.float(), w)


class QuantEmbedding(nn.Module):
    """Row lookup of a GGUF matrix that returns float32 rows exactly equal to gguf's dequantization.

    Storage: Q8_0 keeps the int8 codes [V, D] and fp16 block scales [V, D/32] (1.06 bytes per
    weight); F32/F16/BF16 keep the file's dtype; other block types are dequantized once to
    fp32 at load (exact, 4 bytes per weight). Build it with `pack_embedding`.
    """

    def __init__(self, weight: torch.Tensor, scales: torch.Tensor | None):
        super().__init__()
        self.num_embeddings, self.embedding_dim = weight.shape
        self.register_buffer("weight", weight)
        self.register_buffer("scales", scales)

    def _apply(self, fn, recurse=True):
        def keep_dtype(t: torch.Tensor) -> torch.Tensor:
            out = fn(t)
            return out if out.dtype == t.dtype else t.to(out.device)

        return super()._apply(keep_dtype, recurse)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # ids: int [...] -> fp32 [..., D]
        rows = self.weight[ids]  # [..., D]
        if self.scales is None:
            return rows.float()
        d = self.scales[ids].float().unsqueeze(-1)  # [..., D/32, 1]
        blocks = rows.float().unflatten(-1, (-1, GROUP_SIZE))  # [..., D/32, 32]
        return (blocks * d).flatten(-2)


def pack_embedding(qtype: GGMLQuantizationType, data: np.ndarray, shape: tuple[int, int], *, name: str = "") -> QuantEmbedding:
    """Builds a CPU `QuantEmbedding` from raw GGUF rows (same arguments as `pack_weight`, no mode)."""
    qtype = check_supported(qtype, name)
    shape = (int(shape[0]), int(shape[1]))
    if qtype == T.Q8_0:
        codes, d = q8_0_blocks(data, shape, name)
        return QuantEmbedding(torch.from_numpy(codes), torch.from_numpy(np.ascontiguousarray(d)))
    if qtype in (T.F16, T.BF16):  # keep the file's 16-bit values
        rows = as_rows(qtype, data, shape, name).copy()
        weight = torch.from_numpy(rows)
        return QuantEmbedding(weight if qtype == T.F16 else weight.view(torch.bfloat16), None)
    return QuantEmbedding(torch.from_numpy(dequantize(qtype, data, shape, name)), None)
