"""`edge-runtime demo`: the hybrid runtime end to end on this machine.

It starts a cloud worker on loopback (a child process serving the same
embedded model), then streams two answers through one HybridRuntime on auto
routing: an easy prompt, which the device answers, and a hard one, which the
difficulty monitor hands to the cloud after its first tokens. Each piece of
text is printed as it arrives, with a marker when its source changes and the
timings at the end of each answer. The loopback worker serves the same small
model; a real deployment points `--cloud` at a larger one.
"""
from __future__ import annotations

import asyncio
import sys
import time

EASY = "Say hello to my friend Anna in one short sentence."
HARD = "What is 487 multiplied by 356? Show the steps."


async def _answer(runtime, prompt: str, max_tokens: int, out) -> dict:
    from edge_runtime.request import GenerationRequest, SamplingParams

    req = GenerationRequest(messages=[{"role": "user", "content": prompt}], params=SamplingParams(max_tokens=max_tokens))
    t0 = time.perf_counter()
    ttft, source, summary = None, None, {}
    out.write(f"\n>>> {prompt}\n")
    async for ev in runtime.stream(req):
        now = (time.perf_counter() - t0) * 1000.0
        if ev.type == "start":
            out.write(f"[route {ev.info['route']}: {ev.info['route_reason']}]\n")
        elif ev.type == "delta":
            if ttft is None:
                ttft = now
            if ev.source != source:
                source = ev.source
                out.write(f"[{source} +{now:.0f} ms] ")
            out.write(ev.text)
        elif ev.type == "handoff":
            out.write(f"\n[handoff {ev.info['from']} -> {ev.info['to']} at character {ev.info['at_char']} "
                      f"+{now:.0f} ms: {ev.info['reason']}]\n")
        elif ev.type == "finish":
            by = {k: v["completion_tokens"] for k, v in ev.info["usage_by_source"].items()}
            summary = {"ttft_ms": ttft, "total_ms": now, "tokens_by_source": by, "finish": ev.finish_reason,
                       "handoffs": len(ev.info["handoffs"])}
            out.write(f"\n[done: first token {ttft or 0:.0f} ms, total {now:.0f} ms, tokens by source {by}, "
                      f"finish={ev.finish_reason}]\n")
        else:
            out.write(f"\n[error: {ev.error}]\n")
        out.flush()
    return summary


def run_demo(args) -> int:
    from edge_runtime.backends import create_backend
    from edge_runtime.hybrid.runtime import HybridRuntime

    from cloud_fallback.cloud_backend import CloudBackend
    from cloud_fallback.launcher import WorkerProcess

    out = sys.stdout
    out.write("[starting a cloud worker on loopback (same model, its own process) ...]\n")
    out.flush()
    t = time.perf_counter()
    worker = WorkerProcess("--model", args.model, threads=args.threads or 2)
    out.write(f"[worker listening on {worker.url} after {time.perf_counter() - t:.1f} s]\n")
    try:
        local = create_backend("native", args.model, threads=args.threads)

        async def main():
            cloud = CloudBackend(worker.url, worker.token)
            try:
                runtime = HybridRuntime(local, cloud)
                # the loopback worker shares this machine: its load is not the device being saturated
                runtime.router.limits.cpu_busy_percent = 100.0
                return [await _answer(runtime, p, args.max_tokens, out) for p in (args.easy, args.hard)]
            finally:
                await cloud.aclose()
        asyncio.run(main())
    finally:
        worker.stop()
    return 0


def add_demo_args(p) -> None:
    p.add_argument("--model", default="default")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--easy", default=EASY, help="the prompt the device should answer")
    p.add_argument("--hard", default=HARD, help="the prompt the cloud should take over")
