"""GEMV on raw GGUF block rows for CPU decode: a small C kernel (cpu_gemv.c) built on first use.

`gemv(kind, weight, x, out_features)` computes `x @ W.T` in fp32 for M = 1..8 rows of x,
where W is the GGUF tensor's raw rows exactly as stored (`uint8 [N, row_bytes]`, rows of
several tensors may be concatenated) and `kind` is one of KINDS. The same computation is
the torch op `torch.ops.edge_runtime.gguf_gemv(weight, x, kind, out_features)` (with a
fake kernel), so a `torch.compile(fullgraph=True)` graph can call it. `reference_gemv` is
the plain numpy version the tests compare against.

With `set_arith("int8")` (the default) the op and the callers in gguf_linear/fused_decode use
cpu_qgemm's integer kernels instead; `set_arith("exact")` keeps this fp32-activation arithmetic.

Build: gcc -O3 -mavx2 -mfma -mf16c -ffp-contract=off -fopenmp, plus cpu_qgemm.c once per ISA
variant, into `compile_cache.cache_root()/cpu_gemv/`, named
after a hash of the C source, the gcc version, the flags and the CPU's feature flags;
written to a temp name and renamed into place, so concurrent processes are safe. The
library links libgomp by soname and is loaded after torch, so it shares torch's bundled
libgomp and its warm thread pool instead of starting a second pool that would fight it.
`available()` is False, with `unavailable_reason()`, without x86-64 AVX2/FMA/F16C, gcc,
or a working build, or when EDGE_RUNTIME_CPU_GEMV=0 (the override for tests and A/B runs);
callers then use torch's own kernels.

This module knows nothing of models or layers: callers decide which rows to fuse.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import subprocess
import tempfile

import numpy as np
import torch

KINDS = ("q4_0", "q4_1", "q8_0", "q4_k")
BLOCK = {"q4_0": (32, 18), "q4_1": (32, 20), "q8_0": (32, 34), "q4_k": (256, 144)}  # (values, bytes) per block
MAX_M = 8  # the fp32 GEMV's rows per call
MAX_M_INT8 = 16  # rows per fused decode call with the integer kernels (cpu_qgemm takes any M)
_HERE = os.path.dirname(os.path.abspath(__file__))
_SOURCE = os.path.join(_HERE, "cpu_gemv.c")
# one library: GEMV, dequantization, and the fused small ops of a decode step
_SOURCES = [_SOURCE, os.path.join(_HERE, "cpu_dequant.c"), os.path.join(_HERE, "cpu_decode.c")]
# NOTE: explicit ISA flags rather than -march=native, and no FMA contraction, so every x86-64 CPU
# with AVX2 runs the same instructions and rounds the same way (a hand-off between two machines
# continues the same greedy answer).
FLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC"]
SCALAR_FLAGS = ["-O3", "-march=x86-64", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC"]  # no AVX2: the scalar fallback
# (w uint8*, N, K, x float*, M, y float*, num_threads) -> int rc
_ARGTYPES = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_int]


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


_QG_SOURCE = os.path.join(_HERE, "cpu_qgemm.c")
_QG_DISPATCH = os.path.join(_HERE, "cpu_qgemm_dispatch.c")
_QG_COMMON = ["-O3", "-fPIC", "-fopenmp", "-ffp-contract=off"]
# cpu_qgemm.c once per variant: (name, flags). One library serves every CPU of the architecture;
# cpu_qgemm_dispatch.c picks the variant at run time.
QG_VARIANTS = {
    "x86_64": [("portable", []),
               ("avx2", ["-DQG_AVX2", "-mavx2", "-mfma", "-mf16c"]),
               ("avxvnni", ["-DQG_AVXVNNI", "-mavx2", "-mfma", "-mf16c", "-mavxvnni"]),
               ("avx512vnni", ["-DQG_AVX512VNNI", "-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw",
                               "-mavx512vl", "-mavx512vnni"]),
               ("amx", ["-DQG_AVX512VNNI", "-DQG_AMX", "-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw",
                        "-mavx512vl", "-mavx512vnni", "-mamx-tile", "-mamx-int8"])],
    "aarch64": [("portable", []), ("neon", ["-DQG_NEON", "-march=armv8.2-a+dotprod"])],
}


def qgemm_compile_commands(cc: str, arch: str, out_dir: str) -> tuple[list[list[str]], list[str]]:
    """gcc commands that compile cpu_qgemm.c's variants and its dispatcher for `arch`, and the objects."""
    cmds, objs = [], []
    for name, flags in QG_VARIANTS[arch]:
        obj = os.path.join(out_dir, f"qgemm_{name}.o")
        cmds.append([cc, *_QG_COMMON, f"-DQG_NAME={name}", *flags, "-c", _QG_SOURCE, "-o", obj])
        objs.append(obj)
    obj = os.path.join(out_dir, "qgemm_dispatch.o")
    cmds.append([cc, *_QG_COMMON, "-c", _QG_DISPATCH, "-o", obj])
    return cmds, objs + [obj]


def _run(cmd: list[str]) -> None:
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    if res.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{res.stderr[-4000:]}")


def build(flags: list[str] | None = None) -> str:
    """Compiles the kernels unless cached; returns the shared library's path. Raises on failure."""
    from kernels.compile_cache import cache_root

    flags = list(FLAGS if flags is None else flags)
    source = b""
    for src in [*_SOURCES, _QG_SOURCE, _QG_DISPATCH, os.path.join(_HERE, "team_barrier.h")]:
        with open(src, "rb") as f:
            source += f.read()
    gcc = subprocess.run(["gcc", "--version"], capture_output=True, text=True, check=True, timeout=60)
    key = hashlib.sha256()
    for part in (source, gcc.stdout.splitlines()[0], " ".join(flags), repr(QG_VARIANTS), platform.machine(),
                 " ".join(sorted(_cpu_flags()))):
        key.update((part if isinstance(part, bytes) else part.encode()) + b"\0")
    folder = os.path.join(cache_root(), "cpu_gemv")
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"cpu_gemv-{key.hexdigest()[:16]}.so")
    if os.path.exists(path):
        return path
    with tempfile.TemporaryDirectory(prefix=".build-", dir=folder) as tmp:
        cmds, objs = qgemm_compile_commands("gcc", "x86_64", tmp)
        for cmd in cmds:
            _run(cmd)
        out = os.path.join(tmp, "lib.so")
        _run(["gcc", *flags, *_SOURCES, *objs, "-lm", "-o", out])
        os.replace(out, path)  # atomic: a concurrent build of the same key just overwrites an identical file
    return path


class _Library:
    """A loaded build: one ctypes function per kind, argtypes set once."""

    def __init__(self, path: str):
        self.path = path
        self.lib = ctypes.CDLL(path)
        self.fns = {}
        for kind in KINDS:
            fn = getattr(self.lib, f"{kind}_gemv")
            fn.argtypes, fn.restype = _ARGTYPES, ctypes.c_int
            self.fns[kind] = fn
        self.simd = bool(self.lib.cpu_gemv_has_simd())
        self.dequantize = self.lib.gguf_dequantize
        self.dequantize.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_void_p,
                                    ctypes.c_int]
        self.dequantize.restype = ctypes.c_int
        p, i, f = ctypes.c_void_p, ctypes.c_int, ctypes.c_float
        self.add_rmsnorm = self.lib.decode_add_rmsnorm
        self.add_rmsnorm.argtypes, self.add_rmsnorm.restype = [p, p, p, i, f, p], None
        self.decode_layers = self.lib.decode_layers
        self.decode_layers.argtypes = [i, p, f, f, p, p, p, p, p, p, p, p, p]
        self.decode_layers.restype = ctypes.c_int
        self.decode_layers_batch = self.lib.decode_layers_batch
        self.decode_layers_batch.argtypes = [i, i, p, f, f, p, p, p, p, p, i, p, p, p, p, p]
        self.decode_layers_batch.restype = ctypes.c_int
        self.decode_layers_chunk = self.lib.decode_layers_chunk
        self.decode_layers_chunk.argtypes = [i, i, p, f, f, p, p, p, p, p, p, p, p, p, p]
        self.decode_layers_chunk.restype = ctypes.c_int
        self.decode_layers_batch_tree = self.lib.decode_layers_batch_tree
        self.decode_layers_batch_tree.argtypes = [i, i, p, f, f, p, p, p, p, p, i, p, p, p, p, p, p, i, p]
        self.decode_layers_batch_tree.restype = ctypes.c_int
        self.rows_argmax = self.lib.rows_argmax
        self.rows_argmax.argtypes, self.rows_argmax.restype = [p, i, i, p], None
        self.mtp_head_step = self.lib.mtp_head_step
        self.mtp_head_step.argtypes, self.mtp_head_step.restype = [i, p, f, p, p, p, p, p, p], ctypes.c_int
        self.attn_head_chains = self.lib.attn_head_chains
        self.attn_head_chains.argtypes = [i, p, p, f, f, p, p, p, p, p, p, p, p, p, f, p, p, p, p]
        self.attn_head_chains.restype = ctypes.c_int
        self.attn_head_tree_level = self.lib.attn_head_tree_level
        self.attn_head_tree_level.argtypes = [p, f, f, p, p] + [p] * 12
        self.attn_head_tree_level.restype = ctypes.c_int
        self.kv_store_rows = self.lib.decode_kv_store_rows
        self.kv_store_rows.argtypes, self.kv_store_rows.restype = [p, p, i, i, p, i, i, i, p], None


@functools.cache
def _load() -> tuple[_Library | None, str]:
    if os.environ.get("EDGE_RUNTIME_CPU_GEMV", "1") == "0":
        return None, "disabled by EDGE_RUNTIME_CPU_GEMV=0"
    missing = {"avx2", "fma", "f16c"} - _cpu_flags()
    if platform.machine() not in ("x86_64", "AMD64") or missing:
        return None, f"needs an x86-64 CPU with AVX2/FMA/F16C (machine {platform.machine()}, missing {sorted(missing)})"
    try:
        return _Library(build()), ""
    except FileNotFoundError:
        return None, ("gcc not found: the CPU kernels are built on first use; install a C compiler "
                      "(Debian/Ubuntu: apt-get install gcc; macOS: xcode-select --install)")
    except (RuntimeError, OSError, subprocess.SubprocessError) as e:
        return None, f"cpu_gemv build or load failed: {e}"


def library():
    """The loaded build (or None): its `decode_layers` and `add_rmsnorm` serve `edge_runtime.model.fused_decode`."""
    return _load()[0]


def available() -> bool:
    """True when the AVX2 kernel is built and loaded (the first call builds it, ~2 s)."""
    return _load()[0] is not None


def unavailable_reason() -> str:
    """Why `available()` is False ('' when it is True)."""
    return _load()[1]


def load_variant(flags: list[str]) -> _Library:
    """A separately built copy (e.g. SCALAR_FLAGS to test the fallback), for `gemv(lib=...)`."""
    return _Library(build(flags))


_num_threads = 0  # 0: torch.get_num_threads() at call time
ARITHS = ("int8", "exact")
_arith = "int8"


def set_arith(name: str) -> None:
    """The arithmetic of every later GEMV: 'int8' (8-bit activations, integer dot products: cpu_qgemm)
    or 'exact' (fp32 activations: this module's GEMV, dequantize + GEMM for long prompts)."""
    global _arith
    if name not in ARITHS:
        raise ValueError(f"unknown arithmetic {name!r}; choose one of {', '.join(ARITHS)}")
    _arith = name


def arith() -> str:
    return _arith


def max_rows() -> int:
    """The most rows one fused decode call takes: 16 with the integer kernels, MAX_M with fp32 GEMVs."""
    return MAX_M_INT8 if _arith == "int8" else MAX_M


def arith_code() -> int:
    """The arith code of cpu_decode.c's dims[10]: 1 for int8, 0 for exact."""
    return int(_arith == "int8")


def set_num_threads(n: int) -> None:
    """Threads for every later call; n <= 0 restores the default, torch.get_num_threads()."""
    global _num_threads
    _num_threads = max(0, int(n))


def threads() -> int:
    """Threads the kernels use now: the set_num_threads() value, else torch.get_num_threads()."""
    return _num_threads or torch.get_num_threads()


def gemv(kind: str, weight: torch.Tensor, x: torch.Tensor, out_features: int,
         num_threads: int | None = None, lib: _Library | None = None) -> torch.Tensor:
    """`x @ W.T` in fp32 on raw GGUF rows, straight through ctypes (no torch dispatch).

    Args:
        kind: one of KINDS.
        weight: uint8 [out_features, row_bytes], contiguous, CPU: the GGUF rows as stored.
        x: [M, K] CPU activations, 1 <= M <= 8; cast to contiguous fp32 if it is not.
        out_features: N.
        num_threads: None -> the set_num_threads() value, else torch.get_num_threads().
        lib: a specific build (tests); default: the cached AVX2 build.
    Returns:
        fp32 [M, N].
    """
    lib = lib or _load()[0]
    if lib is None:
        raise RuntimeError(f"cpu_gemv unavailable: {unavailable_reason()}")
    if x.dtype != torch.float32 or not x.is_contiguous():
        x = x.to(torch.float32).contiguous()
    values, nbytes = BLOCK[kind]
    m, k = x.shape
    if not 1 <= m <= MAX_M or k % values:
        raise ValueError(f"x must be [M <= {MAX_M}, K % {values} == 0], got {tuple(x.shape)}")
    if (weight.dtype != torch.uint8 or weight.shape != (out_features, k // values * nbytes)
            or not weight.is_contiguous() or not weight.is_cpu or not x.is_cpu):
        raise ValueError(f"{kind} weight must be a contiguous CPU uint8 {(out_features, k // values * nbytes)}, "
                         f"got {weight.dtype} {tuple(weight.shape)} on {weight.device} (x on {x.device})")
    out = torch.empty((m, out_features), dtype=torch.float32)  # [M, N]
    nt = num_threads if num_threads is not None else (_num_threads or torch.get_num_threads())
    rc = lib.fns[kind](weight.data_ptr(), out_features, k, x.data_ptr(), m, out.data_ptr(), nt)
    if rc:
        raise ValueError(f"{kind}_gemv rejected its arguments (N={out_features}, K={k}, M={m}): rc={rc}")
    return out


_DEQUANT_KIND = {"q4_0": 0, "q4_1": 1, "q8_0": 8, "q4_k": 4}
KIND_CODE = _DEQUANT_KIND  # the C code of each kind (gguf_dequantize, decode_layers)


def dequantize(kind: str, weight: torch.Tensor, out_features: int, in_features: int,
               num_threads: int | None = None) -> torch.Tensor:
    """Raw GGUF rows uint8 [N, row_bytes] -> fp32 [N, K], exactly gguf.quants.dequantize's values."""
    lib = _load()[0]
    if lib is None:
        raise RuntimeError(f"cpu_gemv unavailable: {unavailable_reason()}")
    values, nbytes = BLOCK[kind]
    if (weight.dtype != torch.uint8 or not weight.is_contiguous() or not weight.is_cpu
            or weight.shape != (out_features, in_features // values * nbytes) or in_features % values):
        raise ValueError(f"{kind} weight must be a contiguous CPU uint8 {(out_features, in_features // values * nbytes)}")
    out = torch.empty((out_features, in_features), dtype=torch.float32)
    nt = num_threads if num_threads is not None else (_num_threads or torch.get_num_threads())
    rc = lib.dequantize(weight.data_ptr(), out_features, in_features, _DEQUANT_KIND[kind], out.data_ptr(), nt)
    if rc:
        raise ValueError(f"gguf_dequantize rejected its arguments ({kind}, N={out_features}, K={in_features}): rc={rc}")
    return out


# NOTE: a plain torch.library.Library op rather than @torch.library.custom_op: the latter's
# Python wrapping measured ~20 us more per call here, more than the math of most decode
# GEMVs. Inference only: no autograd formula is registered.
_OPS = torch.library.Library("edge_runtime", "FRAGMENT")
_OPS.define("gguf_gemv(Tensor weight, Tensor x, str kind, int out_features) -> Tensor")
def _gemv_op(weight, x, kind, out_features):
    if _arith == "int8":
        from kernels import cpu_qgemm

        return cpu_qgemm.qgemm(kind, weight, x, out_features)
    return gemv(kind, weight, x, out_features)


_OPS.impl("gguf_gemv", _gemv_op, "CPU")


@torch.library.register_fake("edge_runtime::gguf_gemv")
def _gguf_gemv_fake(weight, x, kind, out_features):
    return x.new_empty((x.shape[0], out_features), dtype=torch.float32)


def gguf_gemv(weight: torch.Tensor, x: torch.Tensor, kind: str, out_features: int) -> torch.Tensor:
    """The op form of `gemv` (what a compiled graph records): fp32 [M, N]."""
    return torch.ops.edge_runtime.gguf_gemv(weight, x, kind, out_features)


def reference_gemv(kind: str, weight: np.ndarray, x: np.ndarray, out_features: int) -> np.ndarray:
    """Plain reference: x @ gguf.quants.dequantize(W).T in float64. Returns float64 [M, N]."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    w = dequantize(np.ascontiguousarray(weight, dtype=np.uint8), GGMLQuantizationType[kind.upper()])
    return np.asarray(x, dtype=np.float64) @ w.reshape(out_features, -1).astype(np.float64).T  # [M, N]
