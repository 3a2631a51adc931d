"""`edge-runtime bench serve`: what clients of `edge-runtime serve` get on the device, one at a time and at once.

Starts a real `serve` process (device only) and drives it with the official `openai` client, streamed, greedy,
`ignore_eos` so every answer has the same length:
- the workload: `--serve-requests` (default 8) chat requests with different prompts, `--serve-tokens` tokens each,
  sent one at a time, then all at once. Aggregate decode throughput (completion tokens over the wall time),
  time to first token and inter-token latency (p50 / p99) of each run; `concurrent_over_sequential` is the
  throughput ratio (target >= 3).
- a short request (8 tokens) alone (its idle time to first token, median of 3), then while a 400-token answer
  streams: `short_ttft_ratio` = its time to first token there over the idle one (target <= 2).
The same measurements on `serve --max-batch 1` (one request at a time, the single-stream path with its drafting)
are the anchor in the same run. Machine, ISA, threads and commit go into the JSON.
"""
from __future__ import annotations

import json
import statistics
import threading
import time

from edge_cli.serve_process import ServeProcess

PROMPTS = ["Explain how a rainbow forms.", "Write a short story about a lighthouse keeper.",
           "Describe the water cycle.", "What makes a good friend?", "Explain how a bicycle works.",
           "Write a letter to a pen pal about your city.", "Describe a day at the beach.",
           "How do plants grow from seeds?", "Explain why we have seasons.", "Describe your favourite meal.",
           "Write a poem about the mountains.", "How does a library work?", "Explain what a computer does.",
           "Describe a busy market.", "Why do birds migrate?", "Write a speech for a school sports day."]
SHORT = "What is the capital of France?"
LONG = "Write a very long story about a dragon."
KEY = "bench-serve-key"


def _stream(client, prompt: str, max_tokens: int) -> dict:
    """One streamed greedy answer: time to first token, the gaps between tokens, tokens, end time."""
    t0 = time.perf_counter()
    stamps, tokens = [], 0
    for chunk in client.chat.completions.create(
            model="default", messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens, temperature=0,
            stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True}):
        if chunk.choices and chunk.choices[0].delta.content:
            stamps.append(time.perf_counter())
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    end = time.perf_counter()
    return {"ttft_s": (stamps[0] - t0) if stamps else float("nan"), "gaps": [b - a for a, b in zip(stamps, stamps[1:])],
            "tokens": tokens, "start": t0, "end": end}


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


def _summary(records: list[dict], wall_s: float) -> dict:
    gaps = [g for r in records for g in r["gaps"]]
    ttfts = [r["ttft_s"] for r in records]
    tokens = sum(r["tokens"] for r in records)
    return {"requests": len(records), "completion_tokens": tokens, "wall_s": wall_s, "tokens_per_s": tokens / wall_s,
            "ttft_ms_p50": _pct(ttfts, 0.5) * 1e3, "ttft_ms_p99": _pct(ttfts, 0.99) * 1e3,
            "itl_ms_p50": _pct(gaps, 0.5) * 1e3, "itl_ms_p99": _pct(gaps, 0.99) * 1e3}


def measure(url: str, prompts: list[str], tokens: int) -> dict:
    import openai

    client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=600)
    _stream(client, SHORT, 4)  # warm-up
    t = time.perf_counter()
    sequential = [_stream(client, p, tokens) for p in prompts]
    seq = _summary(sequential, time.perf_counter() - t)
    records: list = [None] * len(prompts)

    def go(i):
        records[i] = _stream(client, prompts[i], tokens)
    threads = [threading.Thread(target=go, args=(i,)) for i in range(len(prompts))]
    t = time.perf_counter()
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    conc = _summary(records, time.perf_counter() - t)
    idle = statistics.median(_stream(client, SHORT, 8)["ttft_s"] for _ in range(3))
    long_first = threading.Event()
    long_rec: dict = {}

    def long():
        t0 = time.perf_counter()
        for chunk in client.chat.completions.create(
                model="default", messages=[{"role": "user", "content": LONG}], max_tokens=400, temperature=0,
                stream=True, extra_body={"ignore_eos": True}):
            if chunk.choices and chunk.choices[0].delta.content:
                long_first.set()
        long_rec["total_s"] = time.perf_counter() - t0
    th = threading.Thread(target=long)
    th.start()
    long_first.wait(300)
    behind = _stream(client, SHORT, 8)
    th.join()
    return {"sequential": seq, "concurrent": conc,
            "concurrent_over_sequential": conc["tokens_per_s"] / seq["tokens_per_s"],
            "short_idle_ttft_ms": idle * 1e3, "short_behind_long_ttft_ms": behind["ttft_s"] * 1e3,
            "short_ttft_ratio": behind["ttft_s"] / idle, "long_answer_s": long_rec.get("total_s")}


def run_serve_bench(args) -> int:
    import torch

    from edge_cli.bench.decode import machine

    n = args.serve_requests
    if n < 1 or args.serve_tokens < 1:
        from edge_runtime.errors import EdgeRuntimeError

        raise EdgeRuntimeError("--serve-requests and --serve-tokens must be >= 1")
    prompts = (PROMPTS * (n // len(PROMPTS) + 1))[:n]
    tokens = args.serve_tokens
    threads = args.threads or torch.get_num_threads()
    out = {"benchmark": "serve", "model": args.model, "threads": threads, **machine(),
           "workload": {"requests": n, "tokens_per_request": tokens, "greedy": True, "ignore_eos": True,
                        "short_request_tokens": 8, "long_answer_tokens": 400},
           "targets": {"concurrent_over_sequential": 3.0, "short_ttft_ratio": 2.0}}
    for name, extra in (("batched", ["--max-batch", str(max(8, n))]), ("single_stream", ["--max-batch", "1"])):
        s = ServeProcess("--model", args.model, "--draft", "auto", *extra, key=KEY, threads=threads)
        try:
            out[name] = measure(s.url, prompts, tokens)
        finally:
            s.stop()
        r = out[name]
        print(f"{name:>13}: sequential {r['sequential']['tokens_per_s']:6.1f} tok/s, {n} at once "
              f"{r['concurrent']['tokens_per_s']:6.1f} tok/s ({r['concurrent_over_sequential']:.2f}x; TTFT p50/p99 "
              f"{r['concurrent']['ttft_ms_p50']:.0f}/{r['concurrent']['ttft_ms_p99']:.0f} ms, ITL p50/p99 "
              f"{r['concurrent']['itl_ms_p50']:.0f}/{r['concurrent']['itl_ms_p99']:.0f} ms); short request TTFT "
              f"idle {r['short_idle_ttft_ms']:.0f} ms, behind a long answer {r['short_behind_long_ttft_ms']:.0f} ms "
              f"({r['short_ttft_ratio']:.1f}x)", flush=True)
    out["concurrent_over_sequential"] = out["batched"]["concurrent_over_sequential"]
    out["short_ttft_ratio"] = out["batched"]["short_ttft_ratio"]
    out["date"] = time.strftime("%Y-%m-%d %H:%M:%S")
    if args.json_file:
        with open(args.json_file, "w", encoding="utf-8") as f:
            json.dump(out, f, indent=2)
    return 0
