"""`edge-runtime serve`: the OpenAI-compatible gateway over the hybrid runtime, on uvicorn."""
from __future__ import annotations

import os
import sys

from edge_runtime.errors import EdgeRuntimeError


def add_serve_args(p) -> None:
    p.add_argument("--host", default="127.0.0.1", help="interface to bind (default loopback only)")
    p.add_argument("--port", type=int, default=8080, help="TCP port (0 picks a free one)")
    p.add_argument("--api-key", action="append", default=None,
                   help="require 'Authorization: Bearer KEY' (repeatable: each key is a tenant of the response cache; "
                        "or --api-key-file)")
    p.add_argument("--api-key-file", default=None, help="file holding the API keys, one per line")
    p.add_argument("--max-in-flight", type=int, default=8, help="requests generating at once; more get 429")
    p.add_argument("--default-max-tokens", type=int, default=256, help="max_tokens when a request gives none")
    p.add_argument("--model-id", default=None, help="the id /v1/models reports (default: the model file's name)")
    p.add_argument("--max-batch", type=int, default=None,
                   help="native backend: concurrent requests share decode steps, up to this many sequences per step "
                        "(default 8; 1: one request at a time)")
    p.add_argument("--resume-grace", type=float, default=30.0,
                   help="seconds a /v1/stream stream outlives its connection (resumable meanwhile)")


def _api_keys(args) -> list[str]:
    keys = list(args.api_key or [])
    if args.api_key_file:
        try:
            with open(args.api_key_file, encoding="utf-8") as f:
                keys += [line.strip() for line in f if line.strip()]
        except OSError as e:
            raise EdgeRuntimeError(f"cannot read {args.api_key_file}: {e.strerror}") from None
    return keys


def build_gateway(args, make_backend):
    from edge_cli.hybrid import make_runtime
    from edge_runtime.server.app import Gateway, create_app

    if args.max_in_flight < 1 or args.default_max_tokens < 1:
        raise EdgeRuntimeError("--max-in-flight and --default-max-tokens must be >= 1")
    if not args.resume_grace >= 0:
        raise EdgeRuntimeError(f"--resume-grace must be >= 0 seconds, not {args.resume_grace:g}")
    if args.max_batch is not None and args.max_batch < 1:
        raise EdgeRuntimeError(f"--max-batch must be >= 1, not {args.max_batch}")

    runtime = make_runtime(args, make_backend)  # --max-batch reaches the native backend (main.backend_args)
    model_id = args.model_id or os.path.splitext(os.path.basename(getattr(runtime.local, "path", args.model)))[0]
    gw = Gateway(runtime, model_id, api_key=_api_keys(args), max_in_flight=args.max_in_flight,
                 default_max_tokens=args.default_max_tokens)
    return gw, create_app(gw, resume_grace_s=args.resume_grace)


def _concurrency(local) -> str:
    engine = getattr(local, "engine", None) if getattr(local, "name", "") == "native" else None
    if engine is not None and engine.config.max_num_seqs > 1:
        return f"concurrent requests share decode steps (up to {engine.config.max_num_seqs} sequences per step)"
    return f"one request at a time ({getattr(local, 'name', '?')})"


SWITCH_INTERVAL_S = 0.0005


def run_serve(args, make_backend) -> int:
    # The engine thread releases the GIL for every kernel call and must get it back at once; with the default
    # 5 ms switch interval the event loop thread (SSE writes) holds it that long and stalls the steps.
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    import asyncio
    import socket

    import uvicorn

    gw, app = build_gateway(args, make_backend)
    sock = socket.socket(socket.AF_INET6 if ":" in args.host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((args.host, args.port))
    except OSError as e:
        raise EdgeRuntimeError(f"cannot listen on {args.host}:{args.port}: {e.strerror}") from None
    sock.listen(128)  # connections wait in the backlog until uvicorn accepts them: "listening" is true at once
    host, port = sock.getsockname()[:2]
    config = uvicorn.Config(app, log_level="warning", ws="websockets-sansio", lifespan="off")
    server = uvicorn.Server(config)
    print(f"edge-runtime gateway listening on http://{host}:{port} (model {gw.model_id}, "
          f"{'offline' if gw.runtime.offline else ('cloud ' + args.cloud) if args.cloud else 'device only'}; "
          f"{_concurrency(gw.runtime.local)}; requests that set no sampling get {gw.sampling.describe()})", flush=True)

    async def main():
        try:
            await server.serve(sockets=[sock])
        finally:
            if gw.runtime.cloud is not None:
                await gw.runtime.cloud.aclose()
    asyncio.run(main())
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit("run: edge-runtime serve")
