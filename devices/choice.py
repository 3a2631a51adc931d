"""From what was found to what to run: pick a profile, then adjust it to this machine, saying why.

`choose(found)` takes the highest-priority profile whose `match` holds (or the
one `device=` names), applies a `backend=` override, then the machine rules:
weights the CPU kernels can run, threads (physical cores, fewer on battery),
KV dtype and budget (a share of the memory the cache lives in, int8 and a small
budget when memory is low), and the onnxruntime providers actually present.
Every decision adds one sentence to `reasons`.

It works on the plain dict `devices.detect()` returns, so a test can hand it a
faked machine; it probes nothing itself.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

from devices.errors import DeviceError
from devices.profile import BACKENDS, CPU_PROVIDER, load_profiles, mismatch

MiB, GiB = 2 ** 20, 2 ** 30
# NOTE: below this much memory where the KV cache lives, int8 KV (~0.53x fp16 with its scales) and a
# budget of at most LOW_MEMORY_KV_MAX_BYTES leave room for the weights (~100 MiB for the default model),
# the runtime and the rest of the machine.
LOW_MEMORY_BYTES = 2 * GiB
LOW_MEMORY_KV_MAX_BYTES = 256 * MiB
MIN_KV_BYTES = 1 * MiB
TORCH_DEVICES = ("cpu", "cuda", "mps")
GGUF_KERNEL_ISA = ("avx2", "fma", "f16c")  # what kernels/cpu_gemv.py needs for quant "gguf"
X86_64 = ("x86_64", "AMD64", "amd64")
ORT_QUANTS = ("int4", "int8")  # MatMulNBits widths of the ONNX export (edge_runtime/onnx/export.py)


@dataclass(slots=True)
class Choice:
    """The settings chosen for this machine and one sentence per decision (`reasons`)."""

    profile: str
    backend: str
    device: str
    quant: str
    kv_dtype: str
    threads: int
    kv_budget_bytes: int
    block_size: int
    providers: list[str]
    reasons: list[str]
    provider_options: dict = field(default_factory=dict)  # provider name -> its options, for onnxruntime

    def to_dict(self) -> dict:
        return asdict(self)


def format_bytes(n: int) -> str:
    return f"{n / MiB:.0f} MiB" if n < GiB else f"{n / GiB:.1f} GiB"


def choose(found: dict, device: str | None = None, backend: str | None = None,
           profiles: list[dict] | None = None) -> Choice:
    """Choose backend, device, weights, KV dtype and budget, threads and providers for `found`.

    Args:
        found: `devices.detect()`'s dict (or a faked one).
        device: a profile name or a device kind (cpu, cuda, cuda:N, mps, qnn, openvino, dml); None = automatic.
        backend: native, llama.cpp or onnxruntime, replacing the profile's; None = the profile's.
        profiles: the candidates (tests); default: `load_profiles()`.
    Raises:
        DeviceError: an unknown device or backend, or one that is not present here.
    """
    profiles = sorted(load_profiles() if profiles is None else profiles, key=lambda p: (-p["priority"], p["name"]))
    reasons: list[str] = []
    if device is None:
        profile, gpu = _automatic(profiles, found, reasons), 0
    else:
        profile, gpu = _requested(profiles, found, device, reasons)
    chosen_backend, dev, quant = _backend(profile, found, backend, device, gpu, reasons)
    threads = _threads(profile, found, reasons)
    kv_dtype, budget = _kv(profile, found, dev, gpu, reasons)
    providers, options = _providers(profile, found, chosen_backend, reasons)
    return Choice(profile=profile["name"], backend=chosen_backend, device=dev, quant=quant, kv_dtype=kv_dtype,
                  threads=threads, kv_budget_bytes=budget, block_size=profile["block_size"], providers=providers,
                  reasons=reasons, provider_options=options)


def _describe(profile: dict, found: dict, gpu: int) -> str:
    """What was found that made `profile` match, in words ('' for the fallback)."""
    m = profile["match"]
    if m.get("cuda"):
        gpus = found["cuda"]
        g = gpus[gpu]
        which = f" (GPU {gpu} of {len(gpus)})" if len(gpus) > 1 else ""
        return f"CUDA GPU {g['name']!r} with {format_bytes(g['memory_bytes'])}{which}"
    if m.get("mps"):
        return "Apple MPS GPU present"
    if "ort_provider" in m:
        return f"onnxruntime {found['onnxruntime'].get('version', '?')} offers {m['ort_provider']}"
    return " ".join(f"{k} {m[k]}" for k in ("os", "machine") if k in m)


def _automatic(profiles: list[dict], found: dict, reasons: list[str]) -> dict:
    skipped = []
    for p in profiles:
        why = mismatch(p, found)
        if why is not None:
            skipped.append(f"{p['name']}: {why}")
            continue
        if p["match"]:
            reasons.append(f"{_describe(p, found, 0)}: profile {p['name']}")
        else:
            reasons.append(f"no accelerator matched ({'; '.join(skipped) or 'no other profiles'}): "
                           f"profile {p['name']}, the fallback")
        return p
    raise DeviceError("no profile matches this machine (the profiles lack a fallback with an empty match)")


def _requested(profiles: list[dict], found: dict, device: str, reasons: list[str]) -> tuple[dict, int]:
    key, _, index = device.strip().lower().partition(":")
    profile = next((p for p in profiles if key in (p["name"], p["kind"])), None)
    if profile is None or index and not (profile["device"] == "cuda" and index.isdigit()):
        kinds = ", ".join(dict.fromkeys(p["kind"] for p in profiles))
        names = ", ".join(p["name"] for p in profiles)
        raise DeviceError(f"unknown device {device!r}: choose one of {kinds}, cuda:N, or a profile name ({names})")
    why = mismatch(profile, found)
    if why is not None:
        ort = found.get("onnxruntime")
        if "ort_provider" in profile["match"] and ort:
            why += f" (onnxruntime {ort.get('version', '?')} has {', '.join(ort.get('providers', [])) or 'none'})"
        raise DeviceError(f"device {device!r} (profile {profile['name']}) is not available here: {why}")
    gpu = int(index or 0)
    if profile["device"] == "cuda" and gpu >= len(found["cuda"]):
        raise DeviceError(f"device {device!r} is not available here: {len(found['cuda'])} CUDA GPU(s) found")
    described = _describe(profile, found, gpu)
    reasons.append(f"device {device!r} requested: profile {profile['name']}" + (f" ({described})" if described
                                                                                else ""))
    return profile, gpu


def _backend(profile: dict, found: dict, backend: str | None, requested: str | None, gpu: int,
             reasons: list[str]) -> tuple[str, str, str]:
    chosen, dev, quant = profile["backend"], profile["device"], profile["quant"]
    if dev == "cuda" and gpu:
        dev = f"cuda:{gpu}"
    if backend is not None and backend != chosen:
        if backend not in BACKENDS:
            raise DeviceError(f"unknown backend {backend!r}: choose one of {', '.join(BACKENDS)}")
        if backend == "onnxruntime" and not found.get("onnxruntime"):
            raise DeviceError("backend 'onnxruntime' requested but onnxruntime is not installed")
        if backend != "onnxruntime" and dev not in TORCH_DEVICES and not dev.startswith("cuda:"):
            if requested is not None:
                raise DeviceError(f"device {requested!r} runs only through onnxruntime; backend {backend!r} "
                                  f"runs on {', '.join(TORCH_DEVICES)}")
            reasons.append(f"backend {backend} cannot drive the {profile['name']} {dev}: device cpu")
            dev, quant = "cpu", "gguf"
        reasons.append(f"backend {backend} requested instead of the profile's {chosen}")
        chosen = backend
    if chosen == "llama.cpp" and quant != "gguf":
        reasons.append(f"llama.cpp reads the GGUF blocks as they are: weights gguf, not {quant}")
        quant = "gguf"
    elif chosen == "onnxruntime" and quant not in ORT_QUANTS:
        reasons.append(f"onnxruntime runs the exported MatMulNBits weights: int4, not {quant}")
        quant = "int4"
    elif chosen == "native" and quant == "gguf":
        quant = _cpu_kernel_quant(found, reasons)
    return chosen, dev, quant


def _cpu_kernel_quant(found: dict, reasons: list[str]) -> str:
    """gguf where our AVX2 kernels run, else torch's int4."""
    isa = set(found.get("cpu", {}).get("isa", []))
    missing = [f for f in GGUF_KERNEL_ISA if f not in isa]
    machine = found.get("machine", "?")
    if machine in X86_64 and not missing:
        reasons.append("AVX2/FMA/F16C present: weights gguf through our CPU kernels")
        return "gguf"
    lacks = f"lacks {'/'.join(f.upper() for f in missing)}" if missing else "is not x86-64"
    reasons.append(f"the CPU ({machine}) {lacks}: weights int4 (torch's kernel) instead of gguf")
    return "int4"


def _threads(profile: dict, found: dict, reasons: list[str]) -> int:
    cpu = found.get("cpu", {})
    logical = max(1, int(cpu.get("logical_cores") or 1))
    physical = max(1, int(cpu.get("physical_cores") or logical))
    usable = max(1, int(cpu.get("usable_cores") or logical))
    policy = profile["threads"]
    if policy == "physical":
        threads, how = physical, "one per physical core"
    elif policy == "half":
        threads, how = max(1, physical // 2), "half the physical cores (the accelerator does the work)"
    else:
        threads, how = int(policy), "the profile's count"
    cap = min(physical, usable)
    if threads > cap:
        how += f", capped at {cap}"
        threads = cap
    cores = f"{physical} physical, {logical} logical" + (f", {usable} usable" if usable < logical else "")
    reasons.append(f"threads {threads}: {how} ({cores})")
    battery = found.get("battery")
    if battery and battery.get("plugged") is False:
        fewer = min(threads, max(1, physical // 2))
        reasons.append(f"on battery ({battery.get('percent', 0):.0f} %): threads {threads} -> {fewer}")
        threads = fewer
    return threads


def _kv(profile: dict, found: dict, dev: str, gpu: int, reasons: list[str]) -> tuple[str, int]:
    kv_dtype, share, cap = profile["kv_dtype"], profile["kv_budget_fraction"], profile["kv_budget_max_bytes"]
    if dev.startswith("cuda") and found.get("cuda"):
        g = found["cuda"][gpu]
        memory, what = int(g["memory_bytes"]), f"memory on {g['name']!r}"
    else:
        memory = int(found.get("memory", {}).get("available_bytes") or 0)
        what = "available unified memory" if dev == "mps" else "available RAM"
    if memory <= 0:
        budget = min(cap, LOW_MEMORY_KV_MAX_BYTES)
        reasons.append(f"memory unknown (the probe failed): KV {kv_dtype}, budget {format_bytes(budget)}")
        return kv_dtype, budget
    budget = min(int(share * memory), cap)
    if memory < LOW_MEMORY_BYTES:
        kv_dtype, budget = "int8", max(MIN_KV_BYTES, min(budget, LOW_MEMORY_KV_MAX_BYTES))
        reasons.append(f"low memory ({format_bytes(memory)} {what}): KV int8, budget {format_bytes(budget)}")
        return kv_dtype, budget
    capped = f", capped at the profile's {format_bytes(cap)}" if int(share * memory) > cap else ""
    reasons.append(f"KV {kv_dtype}, budget {format_bytes(budget)}: {share:.0%} of {format_bytes(memory)} "
                   f"{what}{capped}")
    return kv_dtype, budget


def _providers(profile: dict, found: dict, backend: str, reasons: list[str]) -> tuple[list[str], dict]:
    providers = list(profile["providers"])
    ort = found.get("onnxruntime")
    if ort:  # NOTE: only those this onnxruntime build has; CPU always stays last
        present = set(ort.get("providers", []))
        dropped = [p for p in providers if p not in present and p != CPU_PROVIDER]
        providers = [p for p in providers if p not in dropped]
        if dropped and backend == "onnxruntime":
            reasons.append(f"onnxruntime {ort.get('version', '?')} lacks {', '.join(dropped)}: "
                           f"providers {', '.join(providers)}")
    options = {k: dict(v) for k, v in profile.get("provider_options", {}).items() if k in providers}
    return providers, options
