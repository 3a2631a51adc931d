"""`edge-runtime devices`: what this machine has, what would be chosen, and why (docs/devices.md).

Only prints; it loads no model. `--json` prints one object with the keys
`found` (devices.detect()), `chosen` (the Choice without its reasons),
`reasons` and `kernels` (the ISA variant of the C kernels and the ones this CPU runs). A device or backend that is unknown or absent is a user error.
"""
from __future__ import annotations

import json

from edge_runtime.errors import EdgeRuntimeError


def register(sub) -> None:
    """Add the `devices` subcommand to an argparse subparsers object."""
    p = sub.add_parser("devices", help="what this machine has and which backend, dtype, threads and KV budget "
                                       "would be chosen, with the reasons")
    p.add_argument("--json", action="store_true", help="print one JSON object: found, chosen, reasons")
    p.add_argument("--device", default=None, help="a device kind (cpu, cuda, cuda:N, mps, qnn, openvino, dml) or a "
                   "profile name, instead of the automatic choice")
    p.add_argument("--backend", default=None, choices=["native", "llama.cpp", "onnxruntime"],
                   help="replace the profile's backend")
    p.set_defaults(func=cmd_devices)


def report(device: str | None = None, backend: str | None = None) -> dict:
    """{"found", "chosen", "reasons"} for this machine; DeviceError becomes EdgeRuntimeError."""
    import devices

    found = devices.detect()
    try:
        choice = devices.choose(found, device=device, backend=backend).to_dict()
    except devices.DeviceError as e:
        raise EdgeRuntimeError(e.message) from None
    reasons = choice.pop("reasons")
    kernels = kernels_report()
    fused = choice["quant"] == "gguf" and choice["device"] == "cpu" and kernels["available"]
    choice["serve_concurrency"] = (
        f"concurrent requests share decode steps{'' if fused else ' (without drafts: no GGUF C kernels here)'}"
        if choice["backend"] == "native" else f"one request at a time ({choice['backend']})")
    return {"found": found, "chosen": choice, "reasons": reasons, "kernels": kernels}


def kernels_report() -> dict:
    """The C kernels' state: whether they load, the ISA variant in use and the ones this CPU runs."""
    from kernels import cpu_gemv, cpu_qgemm

    if not cpu_gemv.available():
        return {"available": False, "reason": cpu_gemv.unavailable_reason(), "isa_variant": None, "runnable": []}
    try:
        return {"available": True, "reason": "", "isa_variant": cpu_qgemm.variant(), "best": cpu_qgemm.best(),
                "runnable": cpu_qgemm.supported(), "arith": cpu_gemv.arith()}
    except cpu_qgemm.ISAError as e:
        raise EdgeRuntimeError(str(e)) from None


def cmd_devices(args) -> int:
    out = report(args.device, args.backend)
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        print(format_report(out))
    return 0


def _size(n: int) -> str:
    return f"{n / 2 ** 20:.0f} MiB" if n < 2 ** 30 else f"{n / 2 ** 30:.1f} GiB"


def format_report(out: dict) -> str:
    f, c = out["found"], out["chosen"]
    cpu, mem, battery, ort = f["cpu"], f["memory"], f["battery"], f["onnxruntime"]
    usable = f", {cpu['usable_cores']} usable" if cpu.get("usable_cores", 0) < cpu["logical_cores"] else ""
    gpus = [f"{g['name']} ({_size(g['memory_bytes'])}, compute {g['capability']})" for g in f["cuda"]]
    rows = [
        ("system", f"{f['os']} {f['machine']}"),
        ("cpu", f"{cpu['model'] or '?'}: {cpu['physical_cores']} physical / {cpu['logical_cores']} logical "
                f"cores{usable}"),
        ("isa", (" ".join(cpu["isa"]) or "none of interest") + (f" (from {cpu['isa_source']})"
                                                                 if cpu["isa_source"] else "")),
        ("memory", f"{_size(mem['available_bytes'])} available of {_size(mem['total_bytes'])}"),
        ("battery", "none" if battery is None else f"{battery['percent']:.0f} %, "
                    + {True: "plugged in", False: "on battery", None: "power source unknown"}[battery["plugged"]]),
        ("cuda", ", ".join(gpus) or "none"),
        ("mps", "yes" if f["mps"] else "no"),
        ("onnxruntime", "not installed" if ort is None else f"{ort['version']}: {', '.join(ort['providers'])}"),
    ]
    rows += [(f"error ({probe})", msg) for probe, msg in f["errors"].items()]
    lines = ["found"] + [f"  {k:<12} {v}" for k, v in rows]
    lines.append(f"chosen: profile {c['profile']}")
    lines.append(f"  backend {c['backend']}, device {c['device']}, weights {c['quant']}, KV {c['kv_dtype']} "
                 f"(budget {_size(c['kv_budget_bytes'])}, blocks of {c['block_size']} tokens), "
                 f"threads {c['threads']}")
    lines.append(f"  onnxruntime providers: {', '.join(c['providers'])}")
    lines.append(f"  serve: {c['serve_concurrency']}")
    k = out["kernels"]
    lines.append(f"  kernels: ISA variant {k['isa_variant']} (runnable here: {', '.join(k['runnable'])}), "
                 f"arithmetic {k['arith']}" if k["available"] else f"  kernels: unavailable ({k['reason']})")
    lines.append("reasons")
    lines += [f"  - {r}" for r in out["reasons"]]
    return "\n".join(lines)
