"""`edge-runtime` command line: generate, chat, perplexity, worker, devices, bench (decode, kv, attention, batching).

Converts arguments into requests and prints results; user errors become one
line on stderr and exit status 2, never a traceback.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

from edge_runtime.errors import EdgeRuntimeError


def _add_model_args(p: argparse.ArgumentParser, draft: bool = True) -> None:
    p.add_argument("--model", default="default", help="'default' (embedded SmolLM2-135M-Instruct Q4_1), a GGUF "
                   "path, or (onnxruntime) an export-onnx folder")
    p.add_argument("--backend", default="auto", choices=["auto", "native", "llama.cpp", "onnxruntime"],
                   help="auto = the device profile's choice for this machine (see `edge-runtime devices`)")
    if draft:
        p.add_argument("--draft", default="auto",
                       choices=["auto", "mtp", "mtp-ngram", "mtp-tree", "mtp-attn", "mtp-attn-ngram", "mtp-attn-tree",
                                "mtp-attn-ngram-tree", "ngram", "none"],
                       help="speculative decoding, output unchanged: mtp = the model's trained draft heads, "
                            "mtp-ngram = prompt lookup where the last 2+ tokens match earlier ones, else the heads, "
                            "mtp-tree = their draft trees (one pass, tree attention), mtp-attn = the attention "
                            "draft head's chains (native), mtp-attn-ngram = prompt lookup, else those, "
                            "mtp-attn-tree = that head's draft trees (native), mtp-attn-ngram-tree = those with "
                            "prompt lookup's chain as a branch, "
                            "ngram = prompt lookup; "
                            "auto = mtp-attn-ngram where the attention head ships, else mtp-ngram where heads ship, "
                            "else ngram (native), else none")
    p.add_argument("--threads", type=int, default=None, help="CPU threads (default: the device profile's, one per "
                   "physical core)")
    p.add_argument("--ctx", type=int, default=4096, help="context window in tokens")
    p.add_argument("--quant", default="auto", choices=["auto", "gguf", "int4", "int8", "bf16", "fp32"],
                   help="native backend weights: gguf = the file's blocks with our AVX2 kernels, int4 = torch's "
                        "packed int4, fp32 = dequantized reference; auto = the device profile's (gguf where the "
                        "kernels run, else int4)")
    p.add_argument("--arith", default="auto", choices=["auto", "int8", "exact"],
                   help="native backend with GGUF weights: int8 = 8-bit activations and integer dot products "
                        "(the same bits on every CPU and for every batch), exact = fp32 activations (the "
                        "reference); auto = int8")
    p.add_argument("--compile", action="store_true", help="native backend: torch.compile the decode step "
                   "(cached on disk; off by default: it does not pay with the default kernels here)")
    p.add_argument("--device", default=None, help="a device kind (cpu, cuda, cuda:N, mps, qnn, openvino, dml) "
                   "or a device profile name; default: the best one found (see `edge-runtime devices`)")
    p.add_argument("--kv-dtype", default=None, choices=["fp16", "bf16", "int8", "fp32"],
                   help="native backend: what the paged KV cache stores (int8: per-token-head scales, ~0.53x "
                        "fp16); default: the device profile's (fp16; int8 when memory is low)")
    p.add_argument("--kv-budget", default=None, help="native backend: KV cache memory, a size (512MiB, 2GB) or a "
                   "share of available memory (25%%); default: 4 context windows, at most 25%% of available memory "
                   "and at most the device profile's budget")


SAMPLING_FLAGS = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty")


def _add_sampling_args(p: argparse.ArgumentParser, interactive: bool = False) -> None:
    """interactive (chat): what is not given comes from the model's recommendation, else sampling_defaults'
    FALLBACK; otherwise (generate) greedy with every filter off."""
    d = {k: None for k in SAMPLING_FLAGS} if interactive else {"temperature": 0.0, "top_k": 0, "top_p": 1.0,
                                                               "min_p": 0.0, "repetition_penalty": 1.0}
    why = " (default: the model's recommendation, else llama.cpp's)" if interactive else ""
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=d["temperature"], help="0 = greedy" + why)
    p.add_argument("--top-k", type=int, default=d["top_k"], help="0 = off" + why)
    p.add_argument("--top-p", type=float, default=d["top_p"], help=why.strip(" ()") or None)
    p.add_argument("--min-p", type=float, default=d["min_p"], help=why.strip(" ()") or None)
    p.add_argument("--repetition-penalty", type=float, default=d["repetition_penalty"],
                   help="1 = off" + (" (default: the model's recommendation, else Ollama's 1.1)" if interactive else ""))
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")


def choose_device(args):
    """The device profile's choice for this machine (devices.choose), honouring --device and --backend."""
    import devices

    try:
        return devices.choose(devices.detect(), device=args.device,
                              backend=None if args.backend == "auto" else args.backend)
    except devices.DeviceError as e:
        raise EdgeRuntimeError(e.message) from None


def backend_args(args, compile: bool | str = "auto") -> tuple[str, dict, object]:
    """(backend name, create_backend kwargs, Choice): the profile's settings under the explicit flags."""
    choice = choose_device(args)
    kwargs = {"n_ctx": args.ctx, "threads": args.threads or choice.threads}
    arith = getattr(args, "arith", "auto")
    if arith != "auto":
        quant = choice.quant if args.quant == "auto" else args.quant
        if choice.backend != "native" or quant != "gguf":
            raise EdgeRuntimeError(f"--arith {arith} applies to the native backend with GGUF weights "
                                   f"(--quant gguf), not to backend {choice.backend} with weights {quant}")
    if choice.backend != "native":
        given = [flag for flag, on in (("--quant", args.quant != "auto"),
                                       ("--kv-dtype", getattr(args, "kv_dtype", None) is not None),
                                       ("--kv-budget", getattr(args, "kv_budget", None) is not None),
                                       ("--compile", bool(getattr(args, "compile", False))),
                                       ("--max-batch", getattr(args, "max_batch", None) is not None)) if on]
        if given:
            raise EdgeRuntimeError(f"{', '.join(given)} {'applies' if len(given) == 1 else 'apply'} to the native "
                                   f"backend only, not to {choice.backend} (drop {'it' if len(given) == 1 else 'them'}"
                                   f", or pass --backend native)")
    if choice.backend == "native":
        from kernels import cpu_gemv

        cpu_gemv.set_arith("int8" if arith == "auto" else arith)
        quant = choice.quant if args.quant == "auto" else args.quant
        reason = cpu_gemv.unavailable_reason() if quant == "gguf" and choice.device == "cpu" else ""
        if reason and "EDGE_RUNTIME_CPU_GEMV" not in reason:  # a missing compiler or a failed build, not the override
            raise EdgeRuntimeError(f"the CPU kernels for --quant gguf are unavailable: {reason} "
                                   f"(or run with --quant int4: torch's kernels, slower)")
        if cpu_gemv.available():  # a bad EDGE_RUNTIME_ISA is a one-line error now, not a failure mid-answer
            from kernels import cpu_qgemm

            try:
                cpu_qgemm.variant()
            except cpu_qgemm.ISAError as e:
                raise EdgeRuntimeError(str(e)) from None
        kwargs.update(quant=choice.quant if args.quant == "auto" else args.quant, device=choice.device,
                      compile=compile, kv_dtype=args.kv_dtype or choice.kv_dtype, kv_budget=args.kv_budget,
                      kv_budget_cap=None if args.kv_budget else choice.kv_budget_bytes,
                      kv_block_size=choice.block_size, max_batch=getattr(args, "max_batch", None) or 8)
    elif choice.backend == "onnxruntime":
        # int8 where the profile asks for it (QNN's HTP runs 8-bit); otherwise the GGUF's own blocks
        kwargs.update(providers=choice.providers, provider_options=choice.provider_options,
                      weights="int8" if choice.quant == "int8" else "auto")
    return choice.backend, kwargs, choice


def make_backend(args):
    from edge_runtime.backends import create_backend

    name, kwargs, choice = backend_args(args, True if args.compile else "auto")
    backend = create_backend(name, args.model, **kwargs)
    backend.device_choice = choice
    backend.set_draft(getattr(args, "draft", "none"))
    return backend


def sampling_params(args, defaults=None):
    """The command's SamplingParams: its flags over `defaults` (a SamplingDefaults) where a flag is None."""
    from edge_runtime.engine import sampling_defaults

    given = {k: getattr(args, k) for k in SAMPLING_FLAGS}
    return (defaults or sampling_defaults.NONE).params(max_tokens=args.max_tokens, seed=args.seed,
                                                       stop=list(args.stop), **given)


def cmd_generate(args) -> int:
    from edge_runtime.request import GenerationRequest

    params = sampling_params(args)  # validate before loading anything
    if args.raw:
        request = GenerationRequest(prompt=args.prompt, params=params, route=args.route)
    else:
        request = GenerationRequest(messages=[{"role": "user", "content": args.prompt}], params=params,
                                    route=args.route)
    if args.cloud or args.offline or args.route != "auto":
        from edge_cli.hybrid import generate_hybrid

        return generate_hybrid(args, request, make_backend)
    backend = make_backend(args)
    out = sys.stdout
    show = (lambda ev: (out.write(ev.text), out.flush())) if not args.json else None
    result = backend.generate(request, on_delta=show)
    if args.json:
        print(json.dumps({
            "text": result.text, "token_ids": result.token_ids, "finish_reason": result.finish_reason,
            "backend": result.backend, "model": os.path.basename(getattr(backend, "path", args.model)),
            "device_profile": backend.device_choice.profile,
            "prompt_tokens": result.usage.prompt_tokens, "completion_tokens": result.usage.completion_tokens,
            "ttft_ms": round(result.ttft_ms, 2), "decode_tok_per_s": round(result.decode_tok_per_s, 2),
            "draft": _draft_summary(backend, result),
        }, ensure_ascii=False))
    else:
        out.write("\n")
        d = _draft_summary(backend, result)
        spec = f", draft {d['method']}: {d.get('mean_accepted', 0):.2f} tokens/step" if d["method"] != "none" else ""
        print(f"[{result.backend}: {result.usage.completion_tokens} tokens, finish={result.finish_reason}, "
              f"ttft {result.ttft_ms:.0f} ms, {result.decode_tok_per_s:.1f} tok/s{spec}]", file=sys.stderr)
    return 0


def _draft_summary(backend, result) -> dict:
    d = result.timings.get("draft") or {}
    out = {"method": getattr(backend, "draft", "none")}
    if d:
        out.update({k: d[k] for k in ("steps", "verify_steps", "proposed", "accepted", "mean_accepted")})
    return out


def cmd_chat(args) -> int:
    from edge_cli.hybrid import chat_hybrid

    sampling_params(args)  # bad flags fail before anything loads
    return chat_hybrid(args, lambda defaults: sampling_params(args, defaults), make_backend)  # device alone: no --cloud


def torch_threads() -> int:
    import torch

    return torch.get_num_threads()


def cmd_perplexity(args) -> int:
    from edge_runtime.backends import create_backend

    try:
        with open(args.file, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise EdgeRuntimeError(f"cannot read {args.file}: {e.strerror}") from None
    except UnicodeDecodeError:
        raise EdgeRuntimeError(f"{args.file} is not UTF-8 text") from None
    name, kwargs, _ = backend_args(args, compile=False)
    backend = create_backend(name, args.model, **kwargs)
    ids = backend.tokenize(text, special=False)
    if len(ids) < args.ctx:
        raise EdgeRuntimeError(f"{args.file} has {len(ids)} tokens; perplexity needs at least --ctx {args.ctx}")
    t0 = time.perf_counter()
    res = backend.perplexity(ids, args.ctx)
    res.update(backend=backend.name, ctx=args.ctx, seconds=round(time.perf_counter() - t0, 2))
    if args.json:  # what the figure came from: the machine, the kernels' ISA variant and arithmetic, the commit
        from kernels import cpu_gemv

        from edge_cli.bench.decode import machine

        res.update(machine(), threads=kwargs["threads"] or torch_threads(),
                   arith=cpu_gemv.arith() if name == "native" and backend.quant == "gguf" else None)
    print(json.dumps(res) if args.json else f"perplexity {res['ppl']:.4f} over {res['tokens']} scored tokens "
          f"({res['windows']} windows of {args.ctx}, backend {backend.name})")
    return 0


def cmd_serve(args) -> int:
    from edge_cli.serve import run_serve

    return run_serve(args, make_backend)


def cmd_demo(args) -> int:
    from edge_cli.demo import run_demo

    return run_demo(args)


def cmd_worker(args) -> int:
    # Sleeping rather than spinning between parallel regions: the worker's event-loop thread needs a core
    # too, and spinning OpenMP threads starve it (libgomp reads this when it loads, i.e. with torch).
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    from cloud_fallback.worker_main import run_worker  # the CLI wires the cloud side in; nothing else imports it

    return run_worker(args)


def build_parser() -> argparse.ArgumentParser:
    from edge_cli.hybrid import add_hybrid_args
    from edge_cli.router import register as add_calibrate_router

    parser = argparse.ArgumentParser(prog="edge-runtime", description="Hybrid local/cloud LLM inference runtime")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="stream one answer")
    _add_model_args(g)
    _add_sampling_args(g)
    g.add_argument("--raw", action="store_true", help="send PROMPT as is, without the chat template")
    g.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    add_hybrid_args(g)
    g.add_argument("prompt")
    g.set_defaults(func=cmd_generate)

    from edge_cli.cache import add_cache_args, register as add_cache

    c = sub.add_parser("chat", help="interactive streaming assistant (/reset, /quit)")
    _add_model_args(c)
    _add_sampling_args(c, interactive=True)
    add_hybrid_args(c)
    add_cache_args(c)
    c.add_argument("--busy-notice", type=float, default=2.0, help="seconds without a first token before the chat "
                   "says the device is busy")
    c.set_defaults(func=cmd_chat, max_tokens=512)

    p = sub.add_parser("perplexity", help="perplexity of a UTF-8 text file")
    _add_model_args(p, draft=False)
    p.add_argument("--json", action="store_true")
    p.add_argument("file")
    p.set_defaults(func=cmd_perplexity, ctx=512)

    w = sub.add_parser("worker", help="the cloud worker: WebSocket server with continuous batching "
                                      "(docs/protocol.md)")
    from cloud_fallback.worker_main import add_worker_args

    add_worker_args(w)
    w.set_defaults(func=cmd_worker)

    add_calibrate_router(sub)
    from edge_cli.devices import register as add_devices

    add_devices(sub)
    from edge_cli.train_mtp import add_train_mtp_parser

    add_train_mtp_parser(sub)
    from edge_runtime.onnx.export import add_export_parser

    add_export_parser(sub)

    from edge_cli.serve import add_serve_args

    sv = sub.add_parser("serve", help="OpenAI-compatible HTTP API and WebSocket stream over the hybrid runtime")
    _add_model_args(sv)
    add_hybrid_args(sv)
    add_cache_args(sv)
    add_serve_args(sv)
    sv.set_defaults(func=cmd_serve)
    add_cache(sub)

    from edge_cli.demo import add_demo_args

    d = sub.add_parser("demo", help="the hybrid runtime end to end: a loopback worker, an easy prompt answered "
                                    "on the device, a hard one handed to the cloud")
    add_demo_args(d)
    d.set_defaults(func=cmd_demo)

    from edge_cli.bench.command import register as add_bench

    add_bench(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except EdgeRuntimeError as e:
        print(f"edge-runtime: error: {e.message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0


if __name__ == "__main__":
    sys.exit(main())
