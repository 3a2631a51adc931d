"""`edge-runtime generate|chat --cloud URL --route R [--offline]`: answers through the hybrid runtime."""
from __future__ import annotations

import asyncio
import json
import os
import sys

from edge_runtime.errors import EdgeRuntimeError
from edge_runtime.hybrid.runtime import HybridRuntime


def _cloud(args):
    if args.offline or not args.cloud:
        return None
    if not args.cloud_token_file:
        raise EdgeRuntimeError("--cloud needs --cloud-token-file (the worker's token)")
    try:
        with open(args.cloud_token_file, encoding="utf-8") as f:
            token = f.read().strip()
    except OSError as e:
        raise EdgeRuntimeError(f"cannot read {args.cloud_token_file}: {e.strerror}") from None
    from cloud_fallback.cloud_backend import CloudBackend  # the CLI wires the cloud side in

    return CloudBackend(args.cloud, token)


def add_hybrid_args(p) -> None:
    p.add_argument("--cloud", default=None, help="the cloud worker, ws://host:port or wss://... (hybrid mode)")
    p.add_argument("--cloud-token-file", default=None, help="file holding the worker's token")
    p.add_argument("--route", default="auto", choices=["auto", "local", "cloud"], help="where to answer")
    p.add_argument("--offline", action="store_true", help="never touch the network: answer on the device")


def make_runtime(args, make_backend) -> HybridRuntime:
    """The hybrid runtime the flags ask for, with the response cache in front on commands that have its flags."""
    from edge_cli.cache import make_cache

    local, cloud = make_backend(args), _cloud(args)
    return HybridRuntime(local, cloud, offline=args.offline, route=args.route, cache=make_cache(args, local, cloud))


def chat_hybrid(args, make_params, make_backend) -> int:
    """make_params(defaults) -> SamplingParams: the flags over the local model's sampling defaults."""
    from edge_cli.chat import ChatSession

    if not args.busy_notice > 0:
        raise EdgeRuntimeError(f"--busy-notice must be a positive number of seconds, not {args.busy_notice:g}")
    runtime = make_runtime(args, make_backend)
    params = make_params(runtime.local.sampling_defaults)
    print(f"[sampling: {_sampling_text(params, runtime.local.sampling_defaults)}]", file=sys.stderr, flush=True)
    session = ChatSession(runtime.local, params, runtime=runtime, busy_notice_s=args.busy_notice)
    try:
        return session.run(sys.stdin, sys.stdout)
    finally:
        if runtime.cloud is not None:
            session.loop.run_until_complete(runtime.cloud.aclose())
        session.loop.close()


def _sampling_text(params, defaults) -> str:
    """What a session samples with, and where each setting came from (a flag, or the defaults' source)."""
    given = [k for k in defaults.values if getattr(params, k) != defaults.values[k]]
    if params.temperature == 0:
        return "greedy" + (" (--temperature 0)" if "temperature" in given else "")
    text = (f"temperature {params.temperature:g}, top-k {params.top_k}, top-p {params.top_p:g}, min-p "
            f"{params.min_p:g}, repeat penalty {params.repetition_penalty:g} over the last {params.repeat_last_n} tokens")
    return text + f" ({'flags: ' + ', '.join(given) + '; the rest ' if given else ''}{defaults.source})"


def generate_hybrid(args, request, make_backend) -> int:
    runtime = make_runtime(args, make_backend)
    cloud = runtime.cloud
    out = sys.stdout

    async def run() -> dict:
        res = {"text": [], "token_ids": [], "handoffs": []}
        try:
            async for ev in runtime.stream(request):
                if ev.type == "start":
                    res.update(route=ev.info["route"], route_reason=ev.info["route_reason"])
                    if not args.json:
                        print(f"[route {ev.info['route']}: {ev.info['route_reason']}]", file=sys.stderr, flush=True)
                elif ev.type == "delta":
                    res["text"].append(ev.text)
                    res["token_ids"] += ev.token_ids
                    if not args.json:
                        out.write(ev.text)
                        out.flush()
                elif ev.type == "handoff":
                    res["handoffs"].append({k: ev.info[k] for k in ("from", "to", "at_char", "reason")})
                    if not args.json:
                        print(f"\n[handoff {ev.info['from']} -> {ev.info['to']} at character {ev.info['at_char']}: "
                              f"{ev.info['reason']}]", file=sys.stderr, flush=True)
                elif ev.type == "finish":
                    res.update(finish_reason=ev.finish_reason, usage=ev.usage,
                               usage_by_source=ev.info["usage_by_source"])
                else:
                    raise EdgeRuntimeError(ev.error or "generation failed")
        finally:
            if cloud is not None:
                await cloud.aclose()
        return res

    res = asyncio.run(run())
    text = "".join(res["text"])
    if args.json:
        print(json.dumps({"text": text, "token_ids": res["token_ids"], "finish_reason": res["finish_reason"],
                          "backend": "hybrid", "model": os.path.basename(getattr(runtime.local, "path", args.model)),
                          "route": res["route"], "route_reason": res["route_reason"], "handoffs": res["handoffs"],
                          "usage_by_source": res["usage_by_source"], "prompt_tokens": res["usage"].prompt_tokens,
                          "completion_tokens": res["usage"].completion_tokens}, ensure_ascii=False))
    else:
        out.write("\n")
        print(f"[{res['usage'].completion_tokens} tokens, finish={res['finish_reason']}, by source "
              f"{res['usage_by_source']}]", file=sys.stderr)
    return 0
