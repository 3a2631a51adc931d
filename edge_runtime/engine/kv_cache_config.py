"""How big the paged KV cache is and what it stores: `--kv-dtype`, `--kv-budget`, block size.

The budget is a size (`512MiB`, `2GB`, `1048576`) or a share of the memory available
now (`25%`, `0.25`: psutil's available RAM on CPU, `torch.cuda.mem_get_info` on a CUDA
device). Without one, the cache gets room for four full context windows (prefixes of
earlier requests stay cached), capped at a quarter of available memory. The pools are
allocated untouched (torch.empty), so memory is only used as blocks are written.

This module knows nothing about which blocks a sequence holds.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from kernels.kv_cache import KV_DTYPES, PagedKVCache

from edge_runtime.errors import InvalidRequestError

_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1024, "m": 1000 ** 2, "mb": 1000 ** 2, "mib": 1024 ** 2,
          "g": 1000 ** 3, "gb": 1000 ** 3, "gib": 1024 ** 3}
DEFAULT_WINDOWS = 4  # context windows' worth of blocks when no budget is given
DEFAULT_SHARE = 0.25  # ... capped at this share of available memory


def parse_budget(text: str | int | float | None) -> int | float | None:
    """'512MiB' -> bytes (int); '25%' or '0.25' -> share of available memory (float in (0, 1]); None -> None."""
    if text is None or isinstance(text, (int, float)) and not isinstance(text, bool):
        return text
    s = str(text).strip().lower().replace(" ", "")
    if s.endswith("%"):
        try:
            share = float(s[:-1]) / 100.0
        except ValueError:
            share = -1.0
        if not 0 < share <= 1:
            raise InvalidRequestError(f"--kv-budget {text!r}: a percentage must be in (0, 100]")
        return share
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([a-z]*)", s)
    if not m or m.group(2) not in _UNITS:
        raise InvalidRequestError(f"--kv-budget {text!r}: expected a size such as 512MiB or 2GB, or a share such as 25%")
    value = float(m.group(1))
    if m.group(2) == "" and value <= 1 and "." in m.group(1):
        return value if value > 0 else _bad(text)
    return int(value * _UNITS[m.group(2)])


def _bad(text):
    raise InvalidRequestError(f"--kv-budget {text!r} must be positive")


def available_memory(device) -> int:
    import torch

    dev = torch.device(device)
    if dev.type == "cuda":
        free, _total = torch.cuda.mem_get_info(dev)
        return int(free)
    import psutil

    return int(psutil.virtual_memory().available)


def format_bytes(n: int) -> str:
    return f"{n / 1024 ** 2:.1f} MiB" if n < 1024 ** 3 else f"{n / 1024 ** 3:.2f} GiB"


@dataclass(slots=True)
class KVCacheConfig:
    kv_dtype: str = "fp16"
    block_size: int = 16
    budget: str | int | float | None = None  # see parse_budget
    cap: int | None = None  # bytes: the default budget never exceeds this (a device profile's KV budget)

    def __post_init__(self):
        if self.kv_dtype not in KV_DTYPES:
            raise InvalidRequestError(f"--kv-dtype must be one of {', '.join(KV_DTYPES)}, not {self.kv_dtype!r}")
        if not isinstance(self.block_size, int) or not 1 <= self.block_size <= 1024:
            raise InvalidRequestError(f"KV block size must be an integer in [1, 1024], not {self.block_size!r}")
        self.budget = parse_budget(self.budget)
        if isinstance(self.budget, int) and self.budget <= 0:
            _bad(self.budget)

    def budget_bytes(self, model_cfg, n_ctx: int, device="cpu") -> int:
        per_token = PagedKVCache.bytes_per_token(model_cfg.num_layers, model_cfg.num_kv_heads, model_cfg.head_dim,
                                                 self.kv_dtype)
        if isinstance(self.budget, int):
            return self.budget
        if isinstance(self.budget, float):
            return int(available_memory(device) * self.budget)
        default = min(DEFAULT_WINDOWS * n_ctx * per_token, int(available_memory(device) * DEFAULT_SHARE))
        return default if self.cap is None else min(default, self.cap)
