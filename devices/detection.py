"""What this machine has: CPU (cores, ISA flags), memory, battery, CUDA / MPS GPUs, onnxruntime providers.

`detect()` returns one JSON-serialisable dict ("found"). Every probe is guarded:
a probe that raises leaves its default in place and its error string under
`errors[probe]`, so one broken driver never hides the rest. A package that is
simply not installed (torch, onnxruntime) is not an error: it reads as absent.

This module only observes; what to do with it is `devices.choice`'s business.
"""
from __future__ import annotations

import importlib.util
import os
import platform
import re
import subprocess

# ISA flags worth reporting (x86 names as Linux spells them in /proc/cpuinfo): what the kernels or
# the profile rules can use. Anything else the CPU has is left out to keep the list readable.
X86_FLAGS = frozenset({
    "sse4_1", "sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq",
    "avx512_vnni", "avx512_bf16", "avx512_fp16", "avx_vnni", "amx_tile", "amx_int8", "amx_bf16",
})
ARM_FLAGS = frozenset({"neon", "dotprod", "fp16", "i8mm", "bf16", "sve", "sve2", "sme"})
# Linux arm64 /proc/cpuinfo "Features" names -> ours.
_LINUX_ARM = {"asimd": "neon", "asimddp": "dotprod", "asimdhp": "fp16", "i8mm": "i8mm", "bf16": "bf16",
              "sve": "sve", "sve2": "sve2", "sme": "sme"}
# macOS `sysctl hw.optional` names (arm. prefix dropped, lower-cased) -> ours.
_SYSCTL = {"neon": "neon", "advsimd": "neon", "feat_dotprod": "dotprod", "feat_fp16": "fp16",
           "neon_fp16": "fp16", "feat_i8mm": "i8mm", "feat_bf16": "bf16", "feat_sme": "sme", "avx1_0": "avx",
           "avx2_0": "avx2", "sse4_1": "sse4_1", "sse4_2": "sse4_2", "avx512f": "avx512f", "avx512bw": "avx512bw",
           "avx512vl": "avx512vl", "avx512dq": "avx512dq", "avx512vnni": "avx512_vnni"}
# torch's view of the CPU, the last resort (Windows has no /proc/cpuinfo or sysctl): what ATen's
# capability level implies.
_TORCH_CAPABILITY = {"AVX2": ["avx", "avx2", "fma"],
                     "AVX512": ["avx", "avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512dq"]}
ARM64 = ("arm64", "aarch64", "ARM64")


def detect() -> dict:
    """Probe everything once.

    Returns:
        {"os", "machine", "cpu": {"model", "physical_cores", "logical_cores", "usable_cores", "isa",
        "isa_source"}, "memory": {"total_bytes", "available_bytes"}, "battery": None | {"percent",
        "plugged"}, "cuda": [{"name", "memory_bytes", "capability"}], "mps": bool,
        "onnxruntime": None | {"version", "providers"}, "errors": {probe: message}}.
    """
    errors: dict[str, str] = {}
    found = {"os": platform.system(), "machine": platform.machine()}
    probes = [("cpu", _cpu, {"model": "", "physical_cores": os.cpu_count() or 1, "logical_cores": os.cpu_count()
                             or 1, "usable_cores": os.cpu_count() or 1, "isa": [], "isa_source": None}),
              ("memory", _memory, {"total_bytes": 0, "available_bytes": 0}),
              ("battery", _battery, None), ("cuda", _cuda, []), ("mps", _mps, False),
              ("onnxruntime", _onnxruntime, None)]
    for name, probe, default in probes:
        try:
            found[name] = probe()
        except Exception as e:  # NOTE: any failure at all; detection must survive a broken driver
            found[name] = default
            errors[name] = f"{type(e).__name__}: {e}"
    found["errors"] = errors
    return found


def _cpu() -> dict:
    import psutil

    logical = os.cpu_count() or 1
    physical = psutil.cpu_count(logical=False) or logical
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else logical
    isa, source = cpu_isa()
    return {"model": _cpu_model(), "physical_cores": physical, "logical_cores": logical, "usable_cores": usable,
            "isa": isa, "isa_source": source}


def cpu_isa() -> tuple[list[str], str | None]:
    """(sorted lower-case flags of interest, where they came from)."""
    machine, system = platform.machine(), platform.system()
    flags: set[str] = set()
    source = None
    if system == "Linux" and os.path.exists("/proc/cpuinfo"):
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            flags, source = parse_cpuinfo_flags(f.read()), "/proc/cpuinfo"
    elif system == "Darwin":
        out = subprocess.run(["sysctl", "hw.optional", "machdep.cpu.features", "machdep.cpu.leaf7_features"],
                             capture_output=True, text=True, timeout=5).stdout
        flags, source = parse_sysctl_flags(out), "sysctl"
    if not flags and machine not in ARM64 and importlib.util.find_spec("torch") is not None:
        import torch

        flags, source = set(_TORCH_CAPABILITY.get(torch.backends.cpu.get_cpu_capability(), [])), "torch"
    if machine in ARM64:
        flags.add("neon")  # NOTE: Advanced SIMD is mandatory on AArch64
        source = source or "arm64"
    return sorted(flags), source


def parse_cpuinfo_flags(text: str) -> set[str]:
    """Flags of interest from /proc/cpuinfo: x86 `flags` or arm64 `Features` (first CPU)."""
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "flags":
            return set(value.split()) & X86_FLAGS
        if key == "Features":
            return {_LINUX_ARM[f] for f in value.split() if f in _LINUX_ARM}
    return set()


def parse_sysctl_flags(text: str) -> set[str]:
    """Flags of interest from `sysctl hw.optional machdep.cpu.features machdep.cpu.leaf7_features`."""
    flags = set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key, value = key.strip(), value.strip()
        if key.startswith("hw.optional.") and value == "1":
            name = key[len("hw.optional."):].lower().removeprefix("arm.")
            if name in _SYSCTL:
                flags.add(_SYSCTL[name])
        elif key in ("machdep.cpu.features", "machdep.cpu.leaf7_features"):
            words = {w.lower().replace(".", "_") for w in value.split()}
            flags |= {_SYSCTL.get(w, w) for w in words} & X86_FLAGS
    return flags


def _cpu_model() -> str:
    system = platform.system()
    if system == "Linux" and os.path.exists("/proc/cpuinfo"):
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            text = f.read()
        for key in ("model name", "Model", "Hardware", "cpu model"):
            m = re.search(rf"^{key}\s*:\s*(.+)$", text, re.MULTILINE)
            if m:
                return m.group(1).strip()
    elif system == "Darwin":
        out = subprocess.run(["sysctl", "-n", "machdep.cpu.brand_string"], capture_output=True, text=True,
                             timeout=5).stdout.strip()
        if out:
            return out
    return platform.processor() or platform.machine()


def _memory() -> dict:
    import psutil

    vm = psutil.virtual_memory()
    return {"total_bytes": int(vm.total), "available_bytes": int(vm.available)}


def _battery() -> dict | None:
    import psutil

    if not hasattr(psutil, "sensors_battery"):
        return None
    b = psutil.sensors_battery()
    if b is None:
        return None
    return {"percent": round(float(b.percent), 1), "plugged": b.power_plugged}  # plugged None: unknown


def _torch():
    if importlib.util.find_spec("torch") is None:
        return None
    import torch

    return torch


def _cuda() -> list[dict]:
    torch = _torch()
    if torch is None or not torch.cuda.is_available():
        return []
    gpus = []
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        gpus.append({"name": p.name, "memory_bytes": int(p.total_memory), "capability": f"{p.major}.{p.minor}"})
    return gpus


def _mps() -> bool:
    torch = _torch()
    return bool(torch is not None and hasattr(torch.backends, "mps") and torch.backends.mps.is_available())


def _onnxruntime() -> dict | None:
    if importlib.util.find_spec("onnxruntime") is None:
        return None
    import onnxruntime

    return {"version": onnxruntime.__version__, "providers": list(onnxruntime.get_available_providers())}
