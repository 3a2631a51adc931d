"""`edge-runtime bench decode`: native vs llama.cpp (and onnxruntime) on the same GGUF, in one run.

Each backend is measured in its own fresh process (so peak RSS and warm start
are its own) through the same runner-level loop: prefill of a 512-token
prompt, then 100-token prompt + 128 greedy decode steps, medians of
`--repeats`. Warm start is timed from the start of model loading to the first
token, after one untimed run has filled the compile cache. Results are written
as JSON with the ratios native / llama.cpp. `--backends` picks the set
(native,llama.cpp,onnxruntime runs all three side by side; onnxruntime runs
the export of the same GGUF, made once by the untimed run).
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time

from edge_runtime import DATA_DIR
from edge_runtime.errors import EdgeRuntimeError

PROSE = os.path.join(DATA_DIR, "gpl-3.0.txt")
PREFILL_TOKENS, DECODE_PROMPT_TOKENS, DECODE_TOKENS = 512, 100, 128


def _prose_ids(backend, n: int) -> list[int]:
    with open(PROSE, encoding="utf-8") as f:
        ids = backend.tokenize(f.read(), special=False)
    assert len(ids) >= n
    return ids[:n]


def measure(backend_name: str, model: str, threads: int | None, repeats: int) -> dict:
    """Runs inside the worker process. Returns this backend's figures ("native-exact": the native
    backend with fp32-activation GEMVs; "native": with the integer kernels)."""
    import resource

    import torch

    from edge_runtime.backends import create_backend

    arith = None
    if backend_name.startswith("native"):
        from kernels import cpu_gemv

        arith = "exact" if backend_name == "native-exact" else "int8"
        cpu_gemv.set_arith(arith)
        backend_name = "native"
    t0 = time.perf_counter()
    backend = create_backend(backend_name, model, n_ctx=2048, threads=threads)
    runner = backend.runner
    first = runner.prefill(backend.tokenize("Hello", special=False))
    int(torch.argmax(first))
    warm_start_s = time.perf_counter() - t0
    if repeats == 0:  # the warm-up run only fills caches
        return {"warm_start_to_first_token_s": warm_start_s}

    ids = _prose_ids(backend, PREFILL_TOKENS)
    prefill = []
    for _ in range(repeats + 1):  # the first run warms up
        runner.reset()  # drop the cached prefix so the whole prompt is evaluated
        t = time.perf_counter()
        runner.prefill(ids)
        prefill.append(PREFILL_TOKENS / (time.perf_counter() - t))
    decode = []
    prompt = ids[:DECODE_PROMPT_TOKENS]
    for _ in range(repeats + 1):
        runner.reset()
        logits = runner.prefill(prompt)
        t = time.perf_counter()
        for _ in range(DECODE_TOKENS):
            logits = runner.step(int(torch.argmax(logits)))
        decode.append(DECODE_TOKENS / (time.perf_counter() - t))
    extra = {}
    if arith is not None:
        from kernels import cpu_qgemm

        from edge_cli.bench.steps import step_costs, weight_bytes

        extra = {"arith": arith, "isa": cpu_qgemm.variant(), "weight_bytes": weight_bytes(runner.model)}
        extra.update(step_costs(runner.model, ids))
    return {
        **extra,
        "prefill_tok_s": statistics.median(prefill[1:]),
        "decode_tok_s": statistics.median(decode[1:]),
        "prefill_runs": prefill[1:],
        "decode_runs": decode[1:],
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "warm_start_to_first_token_s": warm_start_s,
        "threads": threads or torch.get_num_threads(),
    }


def _worker(backend_name: str, model: str, threads: int | None, repeats: int) -> dict:
    cmd = [sys.executable, "-m", "edge_cli.bench.decode", backend_name, model, str(threads or 0), str(repeats)]
    env = None
    if "@" in backend_name:  # native@ISA: the integer kernels' variant held to ISA in that process
        env = {**os.environ, "EDGE_RUNTIME_ISA": backend_name.split("@", 1)[1]}
    t = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise EdgeRuntimeError(f"bench worker for {backend_name} failed: {proc.stderr.strip()[-2000:]}")
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    out["process_wall_s"] = time.perf_counter() - t
    return out


def print_and_save(result: dict, json_file: str | None) -> None:
    """Print a benchmark's result as JSON and write it to `json_file` (folders created) when given, with the
    machine it ran on (`machine()`) unless the result already names it."""
    if "cpu_model" not in result:
        result = {**result, "machine": machine()}
    text = json.dumps(result, indent=2)
    if json_file:
        os.makedirs(os.path.dirname(os.path.abspath(json_file)), exist_ok=True)
        with open(json_file, "w", encoding="utf-8") as f:
            f.write(text + "\n")
    print(text)


KNOWN = ("native", "native-exact", "llama.cpp", "onnxruntime")
# t(8)/t(1) and t(4)/t(1) of the batched step, by what the CPU has (issue 16's targets)
STEP_TARGETS = {"vnni": {"8": 1.5, "4": 1.25}, "avx2": {"8": 2.0, "4": 1.5}}


def machine() -> dict:
    """CPU model, ISA variant of the kernels, and the commit, for the JSON."""
    import platform

    from kernels import cpu_gemv, cpu_qgemm

    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), model)
    except OSError:
        pass
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10,
                                cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit = ""
    dirty = bool(commit) and bool(subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                                                 capture_output=True, text=True, timeout=10,
                                                 cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip())
    return {"cpu_model": model, "isa": cpu_qgemm.variant() if cpu_gemv.available() else None,
            "isa_runnable": cpu_qgemm.supported() if cpu_gemv.available() else [],
            "commit": commit + ("-dirty" if dirty else ""), "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", "")}


def run_bench(args) -> int:
    if args.name != "decode":
        raise EdgeRuntimeError(f"unknown benchmark {args.name!r}")
    import torch

    names = [b.strip() for b in (args.backends or "native,native-exact,llama.cpp").split(",") if b.strip()]
    bad = [b for b in names if b not in KNOWN and not b.startswith("native@")]
    if bad or not names:
        raise EdgeRuntimeError(f"--backends takes a comma-separated list of {', '.join(KNOWN)} or native@ISA, "
                               f"got {args.backends!r}")
    for name in names:
        if name.startswith("native@"):
            from kernels import cpu_qgemm

            isa = name.split("@", 1)[1]
            if isa not in cpu_qgemm.supported():
                raise EdgeRuntimeError(f"--backends {name}: this CPU cannot run the {isa!r} kernels; it runs: "
                                       f"{', '.join(cpu_qgemm.supported())}")
    threads = args.threads or torch.get_num_threads()
    from edge_cli.bench.steps import read_bandwidth_gbs

    res = {"benchmark": "decode", "model": args.model, "threads": threads, "backends": names, **machine(),
           "workload": {"prefill_prompt_tokens": PREFILL_TOKENS, "decode_prompt_tokens": DECODE_PROMPT_TOKENS,
                        "decode_tokens": DECODE_TOKENS, "repeats": args.repeats}}
    keys = []
    for name in names:
        # One untimed start fills the compile cache (native) or writes the ONNX export (onnxruntime), so
        # the timed runs measure a warm start.
        if args.repeats > 0 and name != "llama.cpp":
            _worker(name, args.model, threads, 0)
        key = name.replace(".", "_").replace("-", "_").replace("@", "_")
        res[key] = _worker(name, args.model, threads, args.repeats)
        keys.append(key)
    if "native" in res and "llama_cpp" in res:
        res["decode_ratio"] = res["native"]["decode_tok_s"] / res["llama_cpp"]["decode_tok_s"]
        res["prefill_ratio"] = res["native"]["prefill_tok_s"] / res["llama_cpp"]["prefill_tok_s"]
    if "llama_cpp" in res:  # every backend against the llama.cpp anchor
        res["vs_llama_cpp"] = {k: {"decode": res[k]["decode_tok_s"] / res["llama_cpp"]["decode_tok_s"],
                                   "prefill": res[k]["prefill_tok_s"] / res["llama_cpp"]["prefill_tok_s"]}
                               for k in keys if k != "llama_cpp"}
    # after the backends: a parent's peak RSS would show up in its children's (kept across exec)
    res["bandwidth_gbs"] = read_bandwidth_gbs(threads)
    if "native" in res:
        nat = res["native"]
        res["bandwidth_limit_tok_s"] = res["bandwidth_gbs"] * 1e9 / nat["weight_bytes"]
        res["bandwidth_share"] = nat["decode_tok_s"] / res["bandwidth_limit_tok_s"]
        res["step_cost_ratio"] = nat.get("step_cost_ratio", {})
        res["verify_cost_ratio_4"] = nat.get("verify_cost_ratio_4")
        if "native_exact" in res:
            res["int8_over_exact"] = {k: nat[f"{k}_tok_s"] / res["native_exact"][f"{k}_tok_s"]
                                      for k in ("decode", "prefill")}
    step_targets = STEP_TARGETS["vnni" if res["isa"] in ("avxvnni", "avx512vnni", "amx") else "avx2"]
    res["targets"] = {"decode_ratio": 1.5, "prefill_ratio": 1.3, "warm_start_to_first_token_s": 2.0,
                      "step_cost_ratio": step_targets, "verify_cost_ratio_4": step_targets["4"]}
    res["date"] = time.strftime("%Y-%m-%d %H:%M:%S")
    for k in keys:
        r = res[k]
        print(f"{k:11s} prefill {r['prefill_tok_s']:7.1f} tok/s  decode {r['decode_tok_s']:6.1f} tok/s  "
              f"peak RSS {r['peak_rss_mib']:6.0f} MiB  warm start->first token {r['warm_start_to_first_token_s']:.2f} s")
    if "decode_ratio" in res:
        print(f"decode_ratio {res['decode_ratio']:.3f}  prefill_ratio {res['prefill_ratio']:.3f} (native / llama.cpp)")
    if res.get("step_cost_ratio"):
        curve = "  ".join(f"t({m})/t(1) {r:.2f}" for m, r in res["step_cost_ratio"].items())
        print(f"isa {res['isa']}  {curve}  verify t(4)/t(1) {res['verify_cost_ratio_4']:.2f}  "
              f"bandwidth {res['bandwidth_gbs']:.1f} GB/s, decode at {100 * res['bandwidth_share']:.0f} % of its limit")
    if args.json_file:
        with open(args.json_file, "w") as f:
            json.dump(res, f, indent=2)
    return 0


if __name__ == "__main__":
    name, model, thr, rep = sys.argv[1:5]
    print(json.dumps(measure(name, model, int(thr) or None, int(rep))))
