"""Attention kernels in plain torch (fp32 compute) and the prefill backend switch.

- `tiled_attention`: contiguous K/V, query chunks x KV tiles with an online softmax (running
  max, sum, rescaled accumulator); never holds the T x S scores, skips causal tiles above the
  diagonal, groups the query heads of each KV head into one matmul instead of repeating K/V.
- The paged kernels (over a `PagedKVCache` and block tables) live in `paged_attention.py` and
  share this module's online-softmax tiles, SDPA call and backend switch.
- `prefill_attention`: torch SDPA where its semantics match and it is faster, the tiled kernel
  otherwise; `EDGE_RUNTIME_ATTENTION=auto|sdpa|tiled` or `force_attention_backend` override
  it. `backend_calls` counts which kernel ran (debug/test hook).

Semantics match `kernels.reference.attention`: q `[T, num_heads, head_dim]`, query row i at
key position q_offset + i (default S - T), causal masks keys past the query's position, query
head h uses KV head h // (num_heads // num_kv_heads).

NOTE: KV pools come from torch.empty, so slots past a sequence's length may hold NaN.
Kernels drop them by slicing or masked_fill (a select), never by multiplying with 0. (The
causal mask of a prefill is an added -inf: the keys it hides are written, hence finite.)

This module knows nothing of the model, RoPE, scheduling or which blocks a sequence owns:
callers pass block tables and lengths.
"""
from __future__ import annotations

import contextlib
import math
import os
import threading
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import torch
import torch.nn.functional as F


BACKENDS = ("auto", "sdpa", "tiled")
ENV_VAR = "EDGE_RUNTIME_ATTENTION"
TILE_Q, TILE_K = 256, 256  # tokens / keys per tile: score tile [num_kv_heads, TILE_Q * group, TILE_K]
LOG2E = 1.0 / math.log(2.0)
SDPA_MASK_MAX_ELEMENTS = 1 << 20  # auto: causal q_offset > 0 goes to SDPA with a mask up to this T * S
PARALLEL_MIN_SCORES = 1 << 21  # T * S from which query chunks go to helper threads (measured: 512^2 no, 2k^2 yes)
WORKSPACE_MAX_BYTES = 16 << 20  # per scratch slot and thread; bigger gathers allocate afresh
backend_calls: Counter = Counter()  # which kernel ran: "sdpa", "tiled", "sdpa_masked", "paged_decode"
_forced: str | None = None
_scratch = threading.local()
_helper_pools: dict[tuple[int, int], ThreadPoolExecutor] = {}
_helpers_lock = threading.Lock()

KVTiles = Callable[[int, int], "tuple[torch.Tensor, torch.Tensor]"]


# ---- backend switch ----------------------------------------------------------------------------
def attention_backend() -> str:
    """The configured prefill backend: the forced one, else $EDGE_RUNTIME_ATTENTION, else "auto"."""
    name = _forced or os.environ.get(ENV_VAR) or "auto"
    if name not in BACKENDS:
        raise ValueError(f"{ENV_VAR} must be one of {', '.join(BACKENDS)}, not {name!r}")
    return name


@contextlib.contextmanager
def force_attention_backend(name: str):
    """Run the block with prefill attention pinned to `name` ("tiled", "sdpa" or "auto")."""
    global _forced
    if name not in BACKENDS:
        raise ValueError(f"attention backend must be one of {', '.join(BACKENDS)}, not {name!r}")
    prev, _forced = _forced, name
    try:
        yield
    finally:
        _forced = prev


def choose_backend(*, causal: bool, q_offset: int, num_tokens: int, num_keys: int) -> str:
    """"sdpa" or "tiled" for a prefill with these semantics under the current override.

    auto: SDPA when its is_causal (top-left aligned) is exact, i.e. not causal or q_offset == 0:
    measured at least as fast as the tiled kernel from 256 to 16k tokens, with one parallel
    region instead of thousands (robust on a busy CPU). With q_offset > 0 SDPA needs an
    explicit [T, S] mask: measured faster for short chunks (2x at T=16), about even at
    T * S = 1M, tiled ~5% faster beyond, and O(T) in memory.
    """
    name = attention_backend()
    if name != "auto":
        return name
    mask_elements = num_tokens * min(num_keys, q_offset + num_tokens)
    return "sdpa" if not causal or q_offset == 0 or mask_elements <= SDPA_MASK_MAX_ELEMENTS else "tiled"


# ---- shared pieces -----------------------------------------------------------------------------
def _resolve(q: torch.Tensor, num_keys: int, num_kv_heads: int, causal: bool, q_offset: int | None,
             scale: float | None) -> tuple[int, float]:
    num_tokens, num_heads, head_dim = q.shape
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    q_offset = num_keys - num_tokens if q_offset is None else int(q_offset)
    if causal and q_offset < 0:
        raise ValueError(f"causal attention needs q_offset >= 0, got {q_offset}")
    if num_keys < 1 and num_tokens > 0:
        raise ValueError("attention needs at least one key")
    return q_offset, 1.0 / math.sqrt(head_dim) if scale is None else float(scale)


def _update(qt, kt, vt, m, l, acc, bias, group: int, buf: torch.Tensor) -> None:
    """One online-softmax step in the log2 domain, in place on (m, l, acc).

    qt: [num_kv_heads, rows * group, head_dim], pre-scaled by scale * log2(e), row-major over
    (token, query head of the group); kt, vt: [num_kv_heads, tk, head_dim];
    m, l: [num_kv_heads, rows * group, 1]; acc: [num_kv_heads, rows * group, head_dim];
    bias: [rows, 1, tk] of 0 / -inf (causal mask) or None;
    buf: flat fp32 scratch of at least num_kv_heads * rows * group * tk elements (the score tile).
    NOTE: exp2 rather than exp: torch's CPU exp is 2x slower, and 10-50x slower when its result
    is denormal (inputs in [-104, -88]), which real attention rows hit all the time.
    NOTE: every row must see a visible key in its first update (callers visit key 0 first),
    else m stays -inf and m - m is NaN.
    """
    nkv, n, tk = qt.shape[0], qt.shape[1], kt.shape[1]
    s = torch.bmm(qt, kt.transpose(1, 2), out=buf[:nkv * n * tk].view(nkv, n, tk))  # [nkv, rows * group, tk]
    if bias is not None:  # an add, not masked_fill (10x slower): the hidden keys are written, finite
        s.view(nkv, -1, group, tk).add_(bias)
    m_new = torch.maximum(m, s.amax(dim=-1, keepdim=True))
    s.sub_(m_new).exp2_()
    alpha = torch.sub(m, m_new).exp2_()  # 0 on the first step (m = -inf)
    l.mul_(alpha).add_(s.sum(dim=-1, keepdim=True))
    acc.mul_(alpha).baddbmm_(s, vt)
    m.copy_(m_new)


def _tiled(q: torch.Tensor, kv_tiles: KVTiles, num_keys: int, num_kv_heads: int, *, causal: bool,
           q_offset: int, scale: float, tile_q: int, tile_k: int, span: int | None = None) -> torch.Tensor:
    """Online-softmax attention over K/V from `kv_tiles(s0, s1)` -> (k, v) `[num_kv_heads, s1 - s0, head_dim]`.

    Loops: KV spans of `span` keys (default all; each fetched once, in ascending order so key 0
    comes first) > query chunks of tile_q tokens > KV tiles of tile_k keys. Query rows are laid
    out (token, head-of-group): any token range is one contiguous row block of the grouped
    matmul. The chunks of a span are independent: with several intra-op threads they go to
    helper threads that each run single-threaded torch ops (see `_helpers`).
    """
    num_tokens, num_heads, head_dim = q.shape
    group = num_heads // num_kv_heads
    if causal:
        num_keys = min(num_keys, q_offset + num_tokens)  # keys past the last query are never visible
    span = num_keys if span is None else span
    rows = num_tokens * group
    qg = _workspace("q", (num_kv_heads, num_tokens, group * head_dim))  # scaled and re-laid out in one pass
    torch.mul(q.float().reshape(num_tokens, num_kv_heads, -1).transpose(0, 1), scale * LOG2E, out=qg)
    qg = qg.view(num_kv_heads, rows, head_dim)  # [nkv, T * group, head_dim]
    m = torch.full((num_kv_heads, rows, 1), -math.inf)  # [nkv, T * group, 1]
    l = torch.zeros(num_kv_heads, rows, 1)
    acc = _workspace("acc", (num_kv_heads, rows, head_dim)).zero_()
    buf_shape = (num_kv_heads * group * min(tile_q, num_tokens) * min(tile_k, num_keys),)
    biases: dict[tuple[int, int, int], torch.Tensor] = {}  # aligned diagonal tiles share their mask

    def chunk(a: int, ks: torch.Tensor, vs: torch.Tensor, s0: int, s1: int) -> None:
        b = min(a + tile_q, num_tokens)
        end = min(s1, q_offset + b) if causal else s1  # keys past the chunk's last token are skipped
        r = slice(a * group, b * group)
        buf = _workspace("scores", buf_shape)  # per thread
        for k0 in range(s0, end, tile_k):
            k1 = min(k0 + tile_k, end)
            bias = None
            if causal and k1 - 1 > q_offset + a:  # diagonal tile: token t hides keys > q_offset + t
                key = (k0 - q_offset - a, b - a, k1 - k0)
                if key not in biases:
                    hidden = torch.arange(k1 - k0).view(1, -1) > torch.arange(b - a).view(-1, 1) - key[0]
                    biases[key] = torch.zeros(hidden.shape).masked_fill_(hidden, -math.inf).unsqueeze(1)
                bias = biases[key]  # [tq, 1, tk]
            _update(qg[:, r], ks[:, k0 - s0:k1 - s0], vs[:, k0 - s0:k1 - s0], m[:, r], l[:, r], acc[:, r],
                    bias, group, buf)

    threads = torch.get_num_threads()
    parallel = threads > 1 and num_tokens > tile_q and num_tokens * num_keys >= PARALLEL_MIN_SCORES
    for s0 in range(0, num_keys, span):
        s1 = min(s0 + span, num_keys)
        ks, vs = kv_tiles(s0, s1)  # [num_kv_heads, s1 - s0, head_dim]
        starts = [a for a in range(0, num_tokens, tile_q)  # chunks whose last token sees key s0
                  if not causal or q_offset + min(a + tile_q, num_tokens) > s0]
        if parallel and len(starts) > 1:  # biggest chunks (latest tokens) first, taken as threads free up
            done = [_helpers(threads).submit(chunk, a, ks, vs, s0, s1) for a in reversed(starts)]
            for f in done:
                f.result()
        else:
            for a in starts:
                chunk(a, ks, vs, s0, s1)
    out = torch.empty(num_tokens, num_kv_heads, group, head_dim)
    torch.div(acc.view(num_kv_heads, num_tokens, group, head_dim).transpose(0, 1),
              l.view(num_kv_heads, num_tokens, group, 1).transpose(0, 1), out=out)
    return out.view(num_tokens, num_heads, head_dim)  # [T, num_heads, head_dim]


def _helpers(num_threads: int) -> ThreadPoolExecutor:
    """`num_threads` helper threads whose torch ops run on one intra-op thread each.

    NOTE: with intra-op threads each of the tiled kernel's thousands of small ops ends in a
    barrier, which waits a scheduler slice whenever another process holds a core; helpers take
    whole query chunks instead. set_num_threads(1) in a helper sets that thread's OpenMP/MKL
    counts and the default for new threads, which is restored here afterwards.
    """
    with _helpers_lock:
        key = (num_threads, os.getpid())  # a forked child has none of its parent's threads
        pool = _helper_pools.get(key)
        if pool is None:
            pool = ThreadPoolExecutor(num_threads, thread_name_prefix="edge-attention")
            ready = threading.Barrier(num_threads)  # one init per helper thread
            # get_num_threads first: torch's lazy per-thread init would later reset the count
            init = lambda _: (torch.get_num_threads(), torch.set_num_threads(1), ready.wait())  # noqa: E731
            list(pool.map(init, range(num_threads)))
            torch.set_num_threads(num_threads)
            _helper_pools[key] = pool
        return pool


def _sdpa(q: torch.Tensor, kh: torch.Tensor, vh: torch.Tensor, *, causal: bool, q_offset: int,
          scale: float) -> torch.Tensor:
    """torch SDPA on kh, vh `[num_kv_heads, S, head_dim]` fp32; exact for any q_offset (explicit mask if > 0)."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads, num_keys, _ = kh.shape
    mask, is_causal = None, False
    if causal:
        num_keys = min(num_keys, q_offset + num_tokens)
        kh, vh = kh[:, :num_keys], vh[:, :num_keys]
        if q_offset == 0:
            is_causal = True  # top-left aligned: query i sees keys 0..i
        else:
            rows = torch.arange(q_offset, q_offset + num_tokens).view(-1, 1)
            mask = torch.arange(num_keys).view(1, -1) <= rows  # [T, S] True = visible
    backend_calls["sdpa" if mask is None else "sdpa_masked"] += 1
    # NOTE: 4-D inputs: with 3-D ones torch (2.13, CPU) takes the unfused math path, ~7x slower.
    qh = q.float().transpose(0, 1).contiguous()[None]  # [1, num_heads, T, head_dim]
    out = F.scaled_dot_product_attention(qh, kh.contiguous()[None], vh.contiguous()[None], attn_mask=mask,
                                         is_causal=is_causal, scale=scale, enable_gqa=num_heads != num_kv_heads)
    return out[0].transpose(0, 1).contiguous()  # [T, num_heads, head_dim]


# ---- contiguous K/V ----------------------------------------------------------------------------
def tiled_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool, q_offset: int | None = None,
                    scale: float | None = None, tile_q: int = TILE_Q, tile_k: int = TILE_K) -> torch.Tensor:
    """Tiled online-softmax attention. q `[T, num_heads, head_dim]`, k/v `[S, num_kv_heads, head_dim]`
    -> `[T, num_heads, head_dim]` fp32. Same semantics as `kernels.reference.attention`."""
    num_keys, num_kv_heads, _ = k.shape
    q_offset, scale = _resolve(q, num_keys, num_kv_heads, causal, q_offset, scale)
    kh = k.float().transpose(0, 1).contiguous()  # [num_kv_heads, S, head_dim]
    vh = v.float().transpose(0, 1).contiguous()
    backend_calls["tiled"] += 1
    return _tiled(q, lambda k0, k1: (kh[:, k0:k1], vh[:, k0:k1]), num_keys, num_kv_heads, causal=causal,
                  q_offset=q_offset, scale=scale, tile_q=tile_q, tile_k=tile_k)


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool, q_offset: int | None = None,
                      scale: float | None = None) -> torch.Tensor:
    """Contiguous-K/V attention through the backend switch (SDPA or `tiled_attention`); same API."""
    num_keys, num_kv_heads, _ = k.shape
    q_offset, scale = _resolve(q, num_keys, num_kv_heads, causal, q_offset, scale)
    if choose_backend(causal=causal, q_offset=q_offset, num_tokens=q.shape[0], num_keys=num_keys) == "sdpa":
        kh = k.float().transpose(0, 1)  # [num_kv_heads, S, head_dim]
        return _sdpa(q, kh, v.float().transpose(0, 1), causal=causal, q_offset=q_offset, scale=scale)
    return tiled_attention(q, k, v, causal=causal, q_offset=q_offset, scale=scale)


# ---- scratch -----------------------------------------------------------------------------------
def _workspace(slot: str, shape, dtype=torch.float32) -> torch.Tensor:
    """A reusable per-thread scratch tensor (contents undefined).

    NOTE: fresh multi-MiB allocations page-fault on every call (glibc returns them to the OS),
    costing more than a gather. Callers must be done with a slot before asking for it again.
    """
    numel = math.prod(shape)
    if numel * torch.empty((), dtype=dtype).element_size() > WORKSPACE_MAX_BYTES:
        return torch.empty(shape, dtype=dtype)
    bufs = _scratch.__dict__.setdefault("bufs", {})
    buf = bufs.get((slot, dtype))
    if buf is None or buf.numel() < numel:
        with torch.inference_mode(False):  # a normal tensor: usable in and out of inference mode
            buf = bufs[(slot, dtype)] = torch.empty(numel, dtype=dtype)
    return buf[:numel].view(shape)
