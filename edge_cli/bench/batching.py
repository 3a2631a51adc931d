"""`edge-runtime bench batching`: continuous vs static vs sequential batching through the real worker.

The workload of the published illustration of continuous batching: N requests
(default 100) arriving at once, half asking 20 new tokens and half 200
(`ignore_eos`, so every request generates exactly that many), short prompts,
greedy. One worker process (max batch 8 unless told) serves three schedules
of the same requests from the same client:

- continuous: all requests sent at once; the worker's scheduler refills a slot
  as soon as a sequence ends;
- static: groups of max-batch requests; the next group is sent when the
  whole group has finished, so a batch runs until its longest member ends;
- sequential: one request at a time.

Time to first token is measured from the moment the whole workload arrives
(what a user waiting in the queue sees), inter-token latency between a
stream's deltas. `--peer URL` runs the continuous schedule against any
OpenAI-compatible server (/v1/completions, streamed) for a side-by-side figure.
"""
from __future__ import annotations

import asyncio
import json
import random
import sys
import time

from edge_cli.bench.decode import print_and_save
from edge_runtime.errors import EdgeRuntimeError

from cloud_fallback.launcher import WorkerProcess

TOPICS = ["the sea", "mountains", "a city at night", "bread", "trains", "the moon", "gardens", "rain", "music",
          "a library", "winter", "bees", "rivers", "a lighthouse", "chess", "volcanoes", "the desert", "owls",
          "bridges", "a market"]


def workload(n: int, short: int = 20, long: int = 200, seed: int = 0) -> list[tuple[str, int]]:
    """(prompt, max_tokens) pairs: half short, half long, in a fixed shuffled order."""
    lengths = [short] * (n // 2) + [long] * (n - n // 2)
    random.Random(seed).shuffle(lengths)
    return [(f"Request {i}: write a few sentences about {TOPICS[i % len(TOPICS)]}.", m) for i, m in enumerate(lengths)]


def _pct(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q / 100 * (len(s) - 1))))]


def summarize(t0: float, t_end: float, records: list[dict]) -> dict:
    ttft = [(r["times"][0] - t0) * 1000 for r in records if r["times"]]
    itl = [(b - a) * 1000 for r in records for a, b in zip(r["times"], r["times"][1:])]
    tokens = sum(r["tokens"] for r in records)
    wall = t_end - t0
    return {"wall_s": round(wall, 2), "generated_tokens": tokens, "tokens_per_s": round(tokens / wall, 1),
            "ttft_ms_p50": round(_pct(ttft, 50), 1), "ttft_ms_p99": round(_pct(ttft, 99), 1),
            "itl_ms_p50": round(_pct(itl, 50), 1), "itl_ms_p99": round(_pct(itl, 99), 1),
            "requests": len(records)}


async def _worker_one(client, prompt: str, max_tokens: int, chat: bool = False) -> dict:
    rec = {"times": [], "tokens": 0, "ids": []}
    text = {"messages": [{"role": "user", "content": prompt}]} if chat else {"prompt": prompt}
    s = client.stream(**text, params={"max_tokens": max_tokens, "temperature": 0, "ignore_eos": True})
    async for frame in s:
        if frame.type == "delta":
            if frame.token_ids:
                rec["times"].append(time.perf_counter())
                rec["ids"] += frame.token_ids
        else:
            rec["tokens"] = frame.usage["completion_tokens"]
    return rec


async def run_schedule(url: str, token: str, work: list[tuple[str, int]], schedule: str, max_batch: int,
                       chat: bool = False, ids: list | None = None) -> dict:
    """`chat`: prompts through the chat template; `ids`: filled with each request's token ids, in order."""
    from cloud_fallback.client import WorkerClient

    async with WorkerClient(url, token) as client:
        t0 = time.perf_counter()
        if schedule == "continuous":
            records = await asyncio.gather(*(_worker_one(client, p, m, chat) for p, m in work))
        else:
            group = max_batch if schedule == "static" else 1
            records = []
            for i in range(0, len(work), group):
                records += await asyncio.gather(*(_worker_one(client, p, m, chat) for p, m in work[i:i + group]))
        if ids is not None:
            ids.extend(r["ids"] for r in records)
        return summarize(t0, time.perf_counter(), list(records))


async def run_peer(base_url: str, work: list[tuple[str, int]], model: str | None = None) -> dict:
    """The continuous schedule against an OpenAI-compatible server: every request at once, streamed."""
    import httpx

    base = base_url.rstrip("/")
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0, connect=10.0),
                                 limits=httpx.Limits(max_connections=len(work) + 4)) as http:
        if model is None:
            model = (await http.get(base + "/models")).json()["data"][0]["id"]

        async def one(prompt: str, max_tokens: int) -> dict:
            rec = {"times": [], "tokens": 0}
            body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
                    "ignore_eos": True, "stream_options": {"include_usage": True}}
            async with http.stream("POST", base + "/completions", json=body) as r:
                if r.status_code != 200:
                    raise EdgeRuntimeError(f"peer {base} answered {r.status_code}: {(await r.aread())[:300]!r}")
                async for line in r.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if chunk.get("usage"):
                        rec["tokens"] = chunk["usage"]["completion_tokens"]
                    if chunk.get("choices") and chunk["choices"][0].get("text"):
                        rec["times"].append(time.perf_counter())
            rec["tokens"] = rec["tokens"] or len(rec["times"])
            return rec

        t0 = time.perf_counter()
        records = await asyncio.gather(*(one(p, m) for p, m in work))
        return {**summarize(t0, time.perf_counter(), list(records)), "model": model, "url": base_url}


def _measure_worker(args, work, max_batch: int, schedules: list[str]) -> dict:
    w = WorkerProcess("--max-batch", str(max_batch), "--max-batched-tokens", str(max(512, 256 + max_batch)),
                      "--quant", args.quant, "--model", args.model, "--ctx", "2048",
                      "--max-streams-per-connection", "1024", "--max-streams", "1024", "--kv-budget", "2GiB",
                      threads=args.threads)  # 2 GiB of KV, as the vLLM peer is given
    try:
        asyncio.run(run_schedule(w.url, w.token, work[:max_batch], "continuous", max_batch))  # warm-up
        out = {}
        for name in schedules:
            out[name] = asyncio.run(run_schedule(w.url, w.token, work, name, max_batch))
            print(f"  {name:>10} (max batch {max_batch}): {out[name]['tokens_per_s']:7.1f} tok/s, "
                  f"TTFT p50 {out[name]['ttft_ms_p50']:.0f} ms, ITL p50 {out[name]['itl_ms_p50']:.1f} ms",
                  file=sys.stderr, flush=True)
        return out
    finally:
        w.stop()


def _pooled(runs: list[dict]) -> dict:
    """Several timed runs of one configuration as one figure: tokens over wall time, summed."""
    wall, tokens = sum(r["wall_s"] for r in runs), sum(r["generated_tokens"] for r in runs)
    return {"wall_s": round(wall, 2), "generated_tokens": tokens, "tokens_per_s": round(tokens / wall, 1),
            "runs": runs}


def run_draft_comparison(args, work) -> dict:
    """The worker with --draft METHOD (ngram, an MTP method) against without: two worker processes with the same
    flags, up at the same time, measured in turns so the machine's drift touches both alike (ABBA for the 100-request workload at
    max batch --max-batch, continuous; per prompt or pair, alternating which goes first, for bench spec's 12
    input-grounded prompts, 128 tokens each, one at a time and two at a time). Token ids are compared request
    by request (`identical_*`), throughput as ratios."""
    from edge_cli.bench.spec import grounded_prompts

    grounded = [(p, 128) for p in grounded_prompts(12)]
    plan = ("none", args.draft)
    workers = {}
    try:
        for draft in plan:
            workers[draft] = WorkerProcess(
                "--max-batch", str(args.max_batch), "--max-batched-tokens", str(max(512, 256 + args.max_batch)),
                "--draft", draft, "--quant", args.quant, "--model", args.model, "--ctx", "2048",
                "--max-streams-per-connection", "1024", "--max-streams", "1024", "--kv-budget", "2GiB",
                "--max-prompt-tokens", "1900", threads=args.threads)
        ids = {d: ([], [], []) for d in plan}
        runs = {d: ([], [], []) for d in plan}

        def measure(d: str, which: int, items, schedule: str, group: int, chat: bool) -> None:
            w = workers[d]
            runs[d][which].append(asyncio.run(run_schedule(w.url, w.token, items, schedule, group, chat=chat,
                                                           ids=ids[d][which])))

        for d in plan:
            asyncio.run(run_schedule(workers[d].url, workers[d].token, work[:args.max_batch], "continuous",
                                     args.max_batch))  # warm-up
        for d in plan + plan[::-1]:  # A B B A: a linear drift cancels
            measure(d, 0, work, "continuous", args.max_batch, False)
        for i, (p, m) in enumerate(grounded):
            for d in (plan if i % 2 == 0 else plan[::-1]):
                measure(d, 1, [(p, m)], "sequential", 1, True)
        for i in range(0, len(grounded), 2):
            for d in (plan if i % 4 == 0 else plan[::-1]):
                measure(d, 2, grounded[i:i + 2], "static", 2, True)
        metrics = {d: workers[d].metrics() for d in plan}
    finally:
        for w in workers.values():
            w.stop()
    out = {}
    for d in plan:
        b, g, g2 = (_pooled(r) for r in runs[d])
        m = metrics[d]
        out[d] = {"batching": b, "grounded_one_at_a_time": g, "grounded_two_at_a_time": g2,
                  "draft_accepted": m.get("edge_worker_draft_accepted_total", 0.0),
                  "draft_proposed": m.get("edge_worker_draft_tokens_total", 0.0),
                  "step_ms_by_rows": {k.split('"')[1]: round(v * 1e3, 2) for k, v in m.items()
                                      if k.startswith("edge_worker_step_seconds")}}
        print(f"  --draft {d}: workload {b['tokens_per_s']:.1f} tok/s, grounded one at a time "
              f"{g['tokens_per_s']:.1f} tok/s, two at a time {g2['tokens_per_s']:.1f} tok/s", file=sys.stderr, flush=True)
    d, plain = out[args.draft], out["none"]

    def ratio(key: str) -> float:
        return round(d[key]["tokens_per_s"] / plain[key]["tokens_per_s"], 3)

    n = len(work)  # the workload ran twice per worker: its ids twice
    return {"draft": args.draft, "by_draft": out, "measured": "both workers up at once, in turns (ABBA / alternating)",
            "identical_batching": (ids["none"][0][:n] == ids["none"][0][n:] == ids[args.draft][0][:n]
                                   == ids[args.draft][0][n:]),
            "identical_grounded": ids["none"][1] == ids[args.draft][1] == ids["none"][2] == ids[args.draft][2],
            "draft_over_plain_batching": ratio("batching"),
            "draft_over_plain_grounded": ratio("grounded_one_at_a_time"),
            "draft_over_plain_grounded_two_at_a_time": ratio("grounded_two_at_a_time"),
            "draft_targets": {"draft_over_plain_grounded": 1.5, "draft_over_plain_grounded_two_at_a_time": 1.5,
                              "draft_over_plain_batching": 0.95}}


def targets() -> dict:
    """The targets by what this CPU has: a VNNI step (vpdpbusd) grows less with its rows than an AVX2 one."""
    from kernels import cpu_qgemm

    vnni = cpu_qgemm.variant() in ("avxvnni", "avx512vnni", "amx")
    return {"continuous_over_static": 1.7 if vnni else 1.5, "continuous_over_sequential": 4.0}


def run_batching_bench(args) -> int:
    work = workload(args.requests)
    schedules = [x.strip() for x in args.schedules.split(",") if x.strip()]
    if args.skip_sequential and "sequential" in schedules:
        schedules.remove("sequential")
    unknown = set(schedules) - {"continuous", "static", "sequential"}
    if unknown or "continuous" not in schedules:
        raise EdgeRuntimeError(f"--schedules takes continuous (required), static and sequential; got {args.schedules!r}")
    print(f"bench batching: {len(work)} requests (half 20, half 200 new tokens), worker quant {args.quant}",
          file=sys.stderr, flush=True)
    if getattr(args, "draft", None):
        result = {"workload": {"requests": len(work), "short_tokens": 20, "long_tokens": 200,
                               "arrival": "all at once", "greedy": True, "ignore_eos": True,
                               "grounded": "bench spec's 12 input-grounded prompts, 128 tokens, one at a time and two at a time"},
                  "worker": {"max_batch": args.max_batch, "quant": args.quant, "threads": args.threads,
                             "model": args.model}, **run_draft_comparison(args, work)}
        print_and_save(result, args.json_file)
        return 0
    ours = _measure_worker(args, work, args.max_batch, schedules)
    c = ours["continuous"]["tokens_per_s"]
    result = {"workload": {"requests": len(work), "short_tokens": 20, "long_tokens": 200, "arrival": "all at once",
                           "greedy": True, "ignore_eos": True},
              "worker": {"max_batch": args.max_batch, "quant": args.quant, "threads": args.threads, "model": args.model},
              **ours, "targets": targets()}
    if "static" in ours:
        result["continuous_over_static"] = round(c / ours["static"]["tokens_per_s"], 2)
    if "sequential" in ours:
        result["continuous_over_sequential"] = round(c / ours["sequential"]["tokens_per_s"], 2)
    if args.peer:
        peer = asyncio.run(run_peer(args.peer, work))
        result["peer_batch8"] = peer
        result["over_vllm_batch8"] = round(c / peer["tokens_per_s"], 2)
        print(f"  peer {args.peer}: {peer['tokens_per_s']:.1f} tok/s", file=sys.stderr, flush=True)
    if args.peer_default:
        big = _measure_worker(args, work, args.default_batch, ["continuous"])["continuous"]
        peer = asyncio.run(run_peer(args.peer_default, work))
        result["continuous_default_batch"] = {**big, "max_batch": args.default_batch}
        result["peer_default"] = peer
        result["over_vllm_default"] = round(big["tokens_per_s"] / peer["tokens_per_s"], 2)
    print_and_save(result, args.json_file)
    return 0
