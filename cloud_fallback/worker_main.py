"""The worker's command line (`python -m cloud_fallback`, also `edge-runtime worker`): arguments -> token,
limits, TLS, a source (engine or upstream) -> serve."""
from __future__ import annotations

import argparse
import asyncio
import os
import secrets
import signal
import ssl
import sys

from edge_runtime.errors import EdgeRuntimeError

from cloud_fallback.worker import Worker, WorkerLimits, serve_worker


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="default", help="'default' (embedded SmolLM2-135M-Instruct Q4_1) or a GGUF path")
    p.add_argument("--threads", type=int, default=None, help="CPU threads (default: all cores)")
    p.add_argument("--ctx", type=int, default=4096, help="context window in tokens")
    p.add_argument("--quant", default="auto", choices=["auto", "gguf", "int4", "int8", "bf16", "fp32"],
                   help="weights: gguf = the file's blocks with our CPU kernels, int4 = torch's packed int4, "
                        "fp32 = dequantized reference; auto = gguf where the kernels run, else int4")
    p.add_argument("--arith", default="auto", choices=["auto", "int8", "exact"],
                   help="GGUF weights: int8 = 8-bit activations and integer dot products, exact = fp32 "
                        "activations (the reference); auto = int8")
    p.add_argument("--compile", action="store_true", help=argparse.SUPPRESS)  # refused with a reason, see below
    p.add_argument("--device", default="cpu", help="torch device (cpu, cuda, mps)")
    p.add_argument("--kv-dtype", default="fp16", choices=["fp16", "bf16", "int8", "fp32"],
                   help="what the paged KV cache stores (int8: per-token-head scales, ~0.53x fp16)")
    p.add_argument("--kv-budget", default=None, help="KV cache memory, a size (512MiB, 2GB) or a share of "
                   "available memory (25%%); default: 4 context windows, at most 25%% of available memory")


def add_worker_args(p: argparse.ArgumentParser) -> None:
    _add_engine_args(p)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default loopback only)")
    p.add_argument("--port", type=int, default=8765, help="port (0: any free port, printed at start)")
    p.add_argument("--token-file", default=None, help="file holding the token clients must send in hello "
                   "(default: a random token, printed at start)")
    p.add_argument("--tls-cert", default=None, help="PEM certificate: serve wss:// (with --tls-key)")
    p.add_argument("--tls-key", default=None, help="PEM private key for --tls-cert")
    p.add_argument("--upstream", default=None, help="forward requests to this OpenAI-compatible server "
                   "(e.g. http://127.0.0.1:8000/v1: vLLM, SGLang, llama.cpp server) instead of running a model")
    p.add_argument("--upstream-model", default=None, help="model name on the upstream server (default: its first)")
    p.add_argument("--upstream-key-file", default=None, help="file holding the upstream server's API key")
    p.add_argument("--max-batch", type=int, default=8, help="sequences per step (continuous batching)")
    p.add_argument("--draft", default="none", choices=["none", "ngram", "mtp", "mtp-ngram", "mtp-tree", "mtp-attn",
                                                         "mtp-attn-ngram", "mtp-attn-tree", "mtp-attn-ngram-tree"],
                   help="speculative decoding, output unchanged: drafts as extra rows of each step, as many per "
                        "sequence as pay for themselves; ngram = prompt lookup, mtp = the model's shipped MTP heads, "
                        "mtp-ngram = prompt lookup where the last 2+ tokens match, else the heads, "
                        "mtp-tree = their draft trees, mtp-attn = the attention draft head's chains, "
                        "mtp-attn-ngram = prompt lookup, else those, mtp-attn-tree = that head's draft trees, "
                        "mtp-attn-ngram-tree = those with prompt lookup's chain as a branch")
    p.add_argument("--max-batched-tokens", type=int, default=512, help="tokens computed per step")
    p.add_argument("--chunk-size", type=int, default=256, help="prefill chunk size (a multiple of 16)")
    p.add_argument("--max-tokens", dest="limit_max_tokens", type=int, default=2048, help="limit on max_tokens")
    p.add_argument("--max-prompt-tokens", type=int, default=8000, help="limit on prompt tokens")
    p.add_argument("--max-streams-per-connection", type=int, default=16)
    p.add_argument("--max-streams", type=int, default=256, help="streams in flight in total")
    p.add_argument("--max-frame-bytes", type=int, default=1 << 20)
    p.add_argument("--resume-grace", type=float, default=30.0, help="seconds a stream stays resumable")


def _read_secret(path: str, what: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            value = f.read().strip()
    except OSError as e:
        raise EdgeRuntimeError(f"cannot read {what} file {path}: {e.strerror}") from None
    if not value:
        raise EdgeRuntimeError(f"{what} file {path} is empty")
    return value


def _tls(args) -> ssl.SSLContext | None:
    if bool(args.tls_cert) != bool(args.tls_key):
        raise EdgeRuntimeError("--tls-cert and --tls-key go together")
    if not args.tls_cert:
        return None
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        ctx.load_cert_chain(args.tls_cert, args.tls_key)
    except (OSError, ssl.SSLError) as e:
        raise EdgeRuntimeError(f"cannot load the TLS certificate/key: {e}") from None
    return ctx


def _limits(args) -> WorkerLimits:
    for name in ("limit_max_tokens", "max_prompt_tokens", "max_streams_per_connection", "max_streams",
                 "max_frame_bytes", "max_batch"):
        if getattr(args, name) < 1:
            raise EdgeRuntimeError(f"--{name.replace('limit_', '').replace('_', '-')} must be >= 1")
    if args.resume_grace < 0:
        raise EdgeRuntimeError("--resume-grace must be >= 0")
    return WorkerLimits(max_frame_bytes=args.max_frame_bytes, max_prompt_tokens=args.max_prompt_tokens,
                        max_tokens=args.limit_max_tokens, max_streams_per_connection=args.max_streams_per_connection,
                        max_streams_total=args.max_streams, resume_grace_s=args.resume_grace)


# the worker's own engine's flags and their defaults: with --upstream none of them applies
ENGINE_FLAGS = {"quant": "auto", "kv_dtype": "fp16", "kv_budget": None, "max_batch": 8, "max_batched_tokens": 512,
                "chunk_size": 256, "draft": "none"}


def _refuse_what_does_not_apply(args) -> None:
    if getattr(args, "compile", False):
        raise EdgeRuntimeError("--compile does not apply to the worker: its engine runs every step through the "
                               "fused C kernels (no torch.compile)")
    if args.upstream is not None:
        given = [f"--{k.replace('_', '-')}" for k, v in ENGINE_FLAGS.items() if getattr(args, k, v) != v]
        if given:
            raise EdgeRuntimeError(f"{', '.join(given)} {'applies' if len(given) == 1 else 'apply'} to the worker's "
                                   f"own engine, not to --upstream (the upstream server batches on its own)")
    elif args.max_batched_tokens < args.chunk_size + args.max_batch:
        raise EdgeRuntimeError(f"--max-batched-tokens {args.max_batched_tokens} is below what one step needs: a "
                               f"prompt chunk plus a token per sequence ({args.chunk_size} + {args.max_batch} = "
                               f"{args.chunk_size + args.max_batch}); raise it or lower --chunk-size")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m cloud_fallback", description="the cloud worker: WebSocket server "
                                "with continuous batching over the engine core, or over an upstream server")
    add_worker_args(p)
    args = p.parse_args(argv)
    # Sleeping rather than spinning between parallel regions: the worker's event-loop thread needs a core
    # too, and spinning OpenMP threads starve it (libgomp reads this when it loads, i.e. with torch).
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    try:
        return run_worker(args)
    except EdgeRuntimeError as e:
        print(f"edge-runtime: error: {e.message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def run_worker(args) -> int:
    _refuse_what_does_not_apply(args)
    token = _read_secret(args.token_file, "token") if args.token_file else None
    limits, tls = _limits(args), _tls(args)
    engine = None
    arith = getattr(args, "arith", "auto")
    if arith != "auto" and (args.upstream is not None or args.quant not in ("auto", "gguf")):
        raise EdgeRuntimeError(f"--arith {arith} applies to the worker's own engine with GGUF weights, "
                               f"not to {'an upstream' if args.upstream else f'--quant {args.quant}'}")
    if args.upstream is None:
        from kernels import cpu_gemv

        cpu_gemv.set_arith("int8" if arith == "auto" else arith)
        from edge_runtime.engine.batch_engine import load_engine
        from edge_runtime.engine.kv_cache_config import KVCacheConfig
        from edge_runtime.engine.scheduler import SchedulerConfig

        config = SchedulerConfig(args.max_batch, args.max_batched_tokens, args.chunk_size)
        try:
            config.validate(KVCacheConfig().block_size)  # the worker uses the default KV block size
        except ValueError as e:
            raise EdgeRuntimeError(str(e)) from None
        engine = load_engine(args.model, n_ctx=args.ctx, threads=args.threads, quant=args.quant, device=args.device,
                             kv_dtype=args.kv_dtype, kv_budget=args.kv_budget, config=config,
                             draft="none" if args.draft.startswith("mtp") else args.draft)
        if args.draft.startswith("mtp"):
            _draft_mtp(engine, args.draft)
    if token is None:
        token = secrets.token_urlsafe(24)
        print(f"edge-runtime worker: token {token} (pass --token-file to choose one)", file=sys.stderr, flush=True)
    return asyncio.run(_serve(args, token, limits, tls, engine))


def _draft_mtp(engine, method: str = "mtp") -> None:
    """The engine drafts with the MTP heads (the attention head for "mtp-attn*") shipped for its model (found by
    the model's fingerprint, as the device's native backend finds them); none shipped, or no fused C step, is a
    one-line error."""
    import types

    from edge_runtime.errors import InvalidRequestError
    from edge_runtime.spec.attn_drafter import AttnDrafter
    from edge_runtime.spec.mtp import MtpDrafter

    model = types.SimpleNamespace(name="worker", model=engine.model, tokenizer_fingerprint=engine.tokenizer.fingerprint)
    try:
        engine.set_draft(method, mtp=(AttnDrafter if method.startswith("mtp-attn") else MtpDrafter).for_backend(model))
    except (InvalidRequestError, ValueError) as e:
        raise EdgeRuntimeError(f"--draft {method}: {getattr(e, 'message', None) or e}") from None


async def _serve(args, token: str, limits: WorkerLimits, tls, engine) -> int:
    from cloud_fallback.sources import EngineSource, UpstreamSource

    loop = asyncio.get_running_loop()
    worker = Worker(token, limits)
    if engine is not None:
        source = EngineSource(engine.start(), loop, worker.emit)
    else:
        from edge_runtime.model.chat_template import ChatTemplate
        from edge_runtime.model.path import resolve_model_path

        from cloud_fallback.upstream import Upstream

        key = _read_secret(args.upstream_key_file, "upstream key") if args.upstream_key_file else None
        template = ChatTemplate.from_gguf(resolve_model_path(args.model)) if args.model else None
        upstream = Upstream(args.upstream, api_key=key, model=args.upstream_model, template=template)
        name = await upstream.open()  # fails early, naming the server, when it is unreachable
        source = UpstreamSource(upstream, worker.emit, name)
    worker.attach(source)
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    scheme = "wss" if tls else "ws"

    def ready(port: int) -> None:
        print(f"edge-runtime worker: listening on {scheme}://{args.host}:{port} (model {source.model_name}, "
              f"{source.kind}; pid {os.getpid()})", flush=True)

    try:
        await serve_worker(worker, args.host, args.port, ssl=tls, ready=ready, stop=stop)
    except OSError as e:
        raise EdgeRuntimeError(f"cannot listen on {args.host}:{args.port}: {e.strerror or e}") from None
    finally:
        await source.aclose()
    return 0
