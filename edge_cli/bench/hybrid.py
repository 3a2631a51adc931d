"""`edge-runtime bench hybrid`: what the hybrid runtime costs and how it routes, on loopback.

One run, one real worker process (the same model, `--threads` each side),
the device backend in this process:

- time to first token with `--route local`, `--route cloud` and auto (the
  router, device probe and difficulty monitor on), over the first `--prompts`
  prompts of the shipped labelled set; `ttft_auto_over_local` (target <= 1.2);
- the hand-off gap: escalations forced at token 8 (the monitor replaced by one
  that trips there); ms from the last local delta to the first cloud delta
  (`handoff_gap_ms_p50`, target <= 150);
- the failover gap: the worker SIGKILLed after 10 cloud deltas (a fresh worker
  each time); ms from the kill to the next local delta
  (`failover_gap_ms_p50`), beside the device's prefill of the text so far
  (target <= 300 ms plus that prefill);
- routing on the labelled set: share sent to the cloud by the difficulty score
  and its agreement with the labels.
"""
from __future__ import annotations

import asyncio
import contextlib
import os
import statistics
import sys
import time

from edge_cli.bench.decode import print_and_save
from edge_runtime.engine.completion import build_prompt, prompt_ids
from edge_runtime.request import GenerationRequest, SamplingParams

from cloud_fallback.cloud_backend import CloudBackend
from cloud_fallback.launcher import WorkerProcess


WARM_UP = "Reply with the single word OK."  # not in the labelled set: warms both sides without caching a measured prompt


def _p50(xs):
    return round(statistics.median(xs), 2) if xs else None


def _req(prompt: str, max_tokens: int, route: str = "auto") -> GenerationRequest:
    return GenerationRequest(messages=[{"role": "user", "content": prompt}], params=SamplingParams(max_tokens=max_tokens),
                             route=route)


async def _ttft(runtime, request) -> float:
    """ms to the first delta. The answer is read to its end, so no request still runs on the shared cores (a
    cancelled cloud answer's last steps) while the next one is timed."""
    t0, ttft = time.perf_counter(), None
    async with contextlib.aclosing(runtime.stream(request)) as events:
        async for ev in events:
            if ev.type == "delta" and ttft is None:
                ttft = (time.perf_counter() - t0) * 1000.0
            if ev.type == "error":
                raise RuntimeError(ev.error)
    if ttft is None:
        raise RuntimeError("no delta")
    return ttft


async def _handoff_gap(runtime, request) -> float | None:
    last_local = first_cloud = None
    async for ev in runtime.stream(request):
        if ev.type == "delta":
            if ev.source == "local":
                last_local = time.perf_counter()
            elif first_cloud is None:
                first_cloud = time.perf_counter()
    return None if last_local is None or first_cloud is None else (first_cloud - last_local) * 1000.0


def run_hybrid_bench(args) -> int:
    from edge_runtime.backends import create_backend
    from edge_runtime.hybrid.difficulty import TripAt, load_calibration, load_prompts, prompt_features
    from edge_runtime.hybrid.runtime import HybridRuntime

    threads = args.threads or 2
    rows = load_prompts()
    prompts = [r["prompt"] for r in rows[:args.prompts]]
    local = create_backend("native", args.model, threads=threads)
    policy = load_calibration()
    out: dict = {"prompts": len(prompts), "threads": threads, "model": os.path.basename(local.path)}
    log = lambda msg: print(f"  {msg}", file=sys.stderr, flush=True)  # noqa: E731
    print(f"bench hybrid: {len(prompts)} prompts, worker and device on {threads} threads each", file=sys.stderr)
    worker = WorkerProcess("--model", args.model, threads=threads)
    try:
        async def measure():
            cloud = CloudBackend(worker.url, worker.token)
            try:
                rt = HybridRuntime(local, cloud)
                await cloud.connect()
                await _ttft(rt, _req(WARM_UP, 4, "cloud"))  # warm both sides, on a prompt not measured
                await _ttft(rt, _req(WARM_UP, 4, "local"))
                ttft = {k: [] for k in ("local", "cloud", "auto")}
                for p in prompts:
                    for route in ttft:
                        local.reset_prefix_cache()  # no prefix-cache hit from the previous route's run
                        ttft[route].append(await _ttft(rt, _req(p, 16, route)))
                forced = HybridRuntime(local, cloud, monitor_factory=lambda: TripAt(7))
                forced.router.device_probe = None  # the forced monitor must run, whatever the machine's load
                gaps = [g for p in prompts if (g := await _handoff_gap(forced, _req(p, 32))) is not None]
                return ttft, gaps
            finally:
                await cloud.aclose()
        ttft, gaps = asyncio.run(measure())
    finally:
        worker.stop()
    out["ttft_ms"] = {k: {"p50": _p50(v), "all": [round(x, 1) for x in v]} for k, v in ttft.items()}
    out["ttft_auto_over_local"] = round(_p50(ttft["auto"]) / _p50(ttft["local"]), 3)
    out["handoff_gap_ms_p50"] = _p50(gaps)
    out["handoff_gap_ms"] = [round(g, 1) for g in gaps]
    log(f"ttft p50 local {out['ttft_ms']['local']['p50']} ms, cloud {out['ttft_ms']['cloud']['p50']} ms, auto "
        f"{out['ttft_ms']['auto']['p50']} ms; hand-off gap p50 {out['handoff_gap_ms_p50']} ms")

    fail, prefill = [], []
    for p in prompts[:args.failovers]:
        gap, text = _one_failover(local, args, threads, p)
        if gap is None:
            continue
        fail.append(gap)
        req = _req(p, 1)
        req.prefix = text
        ids = prompt_ids(local.runner, build_prompt(req, local.template))
        local.reset_prefix_cache()
        t = time.perf_counter()
        local.runner.prefill(ids)
        prefill.append((time.perf_counter() - t) * 1000.0)
    out["failover_gap_ms_p50"] = _p50(fail)
    out["failover_gap_ms"] = [round(g, 1) for g in fail]
    out["failover_local_prefill_ms_p50"] = _p50(prefill)
    out["failover_target_ms"] = round(300 + (_p50(prefill) or 0), 1)
    log(f"failover gap p50 {out['failover_gap_ms_p50']} ms (target {out['failover_target_ms']} ms)")

    rows = rows[:args.routing_prompts] if args.routing_prompts else rows
    scores, hidden = prompt_features(local, [r["prompt"] for r in rows], policy.k)
    if policy.kind == "probe" and hidden is not None:
        scores, threshold = [float(x) for x in policy.probe.score(hidden)], policy.probe_threshold
    else:
        threshold = policy.threshold
    to_cloud = [s > threshold for s in scores]
    hard = [r["label"] == "hard" for r in rows]
    out["routing"] = {"prompts": len(rows), "scorer": policy.kind, "threshold": threshold,
                      "target_cloud_share": policy.target_cloud_share,
                      "cloud_share": round(sum(to_cloud) / len(rows), 3),
                      "agreement": round(sum(a == b for a, b in zip(to_cloud, hard)) / len(rows), 3),
                      "hard_share_in_labels": round(sum(hard) / len(rows), 3),
                      "note": "in-sample: the probe was fitted on this set; held-out figures below",
                      "cv_cloud_share": policy.cv_share, "cv_agreement": policy.cv_agreement,
                      "cv_auroc": policy.cv_auroc, "cv_folds": policy.cv_folds}
    out["targets"] = {"handoff_gap_ms_p50": 150, "failover_gap_ms_p50": "300 + failover_local_prefill_ms_p50",
                      "ttft_auto_over_local": 1.2}
    print_and_save(out, args.json_file)
    return 0


def _one_failover(local, args, threads: int, prompt: str) -> tuple[float | None, str]:
    from edge_runtime.hybrid.runtime import HybridRuntime

    w = WorkerProcess("--model", args.model, threads=threads)
    try:
        async def run():
            cloud = CloudBackend(w.url, w.token)
            t_kill, text, n = None, "", 0
            try:
                async for ev in HybridRuntime(local, cloud).stream(_req(prompt, 64, "cloud")):
                    if ev.type != "delta":
                        continue
                    if ev.source == "local":
                        return (time.perf_counter() - t_kill) * 1000.0 if t_kill else None, text
                    text += ev.text
                    n += 1
                    if n == 10:
                        w.kill()
                        t_kill = time.perf_counter()
                return None, text  # the answer ended before the kill
            finally:
                await cloud.aclose()
        return asyncio.run(run())
    finally:
        w.stop()
