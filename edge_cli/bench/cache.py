"""`edge-runtime bench cache`: what the response cache gives clients of `serve`, against a cold local answer.

Starts a real `serve` process with an empty cache file and drives it with the official `openai` client
(streamed, greedy, `--cache-pairs` pairs of the labelled set, half "hit" and half "miss" pairs, seeded):
each pair's first request is answered cold on the device (its time to first token is the anchor), asked
again word for word (an exact hit), then its second request (a paraphrase that should hit semantically, or a
near-miss that must not). Reported: p50/p99 time to first token of cold answers, exact hits and semantic
hits, `hit_over_cold` (cold p50 over hit p50; target >= 10, and hit p50 <= 20 ms), the hit rate on the
should-hit requests and the false hits on the near-misses. NOTE: the pairs are the ones the threshold was
calibrated on, so the hit and false-hit figures are in-sample.
"""
from __future__ import annotations

import json
import random
import tempfile
import time

from edge_cli.bench.serve import KEY, _pct
from edge_cli.serve_process import ServeProcess


def _ask(client, question: str) -> tuple[float, str, str]:
    t0, first, sources, text = time.perf_counter(), None, set(), []
    for ch in client.chat.completions.create(model="default", messages=[{"role": "user", "content": question}],
                                             max_tokens=32, temperature=0, stream=True):
        if ch.choices and ch.choices[0].delta.content:
            first = first or time.perf_counter() - t0
            sources.add(ch.model_extra.get("x_source"))
            text.append(ch.choices[0].delta.content)
    return first if first is not None else float("nan"), ",".join(sorted(sources)), "".join(text)


def run_cache_bench(args) -> int:
    import openai
    import torch

    from edge_cli.bench.decode import machine
    from edge_runtime.cache import calibration

    pairs = [p for p in calibration.load_pairs() if not p["a"]["system"] and not p["a"]["history"]
             and not p["b"]["system"] and not p["b"]["history"]]
    rng = random.Random(0)
    half = args.cache_pairs // 2
    chosen = (rng.sample([p for p in pairs if p["label"] == "hit"], half)
              + rng.sample([p for p in pairs if p["label"] == "miss"], args.cache_pairs - half))
    threads = args.threads or torch.get_num_threads()
    with tempfile.TemporaryDirectory() as tmp:
        s = ServeProcess("--model", args.model, "--draft", "none", key=KEY, threads=threads,
                         cache=f"{tmp}/responses.sqlite3")
        try:
            client = openai.OpenAI(base_url=s.url + "/v1", api_key=KEY, max_retries=0, timeout=600)
            _ask(client, "Say hello.")  # warm-up
            cold, exact, semantic, rows = [], [], [], []
            for p in chosen:
                t_cold, src_cold, text = _ask(client, p["a"]["user"])
                t_exact, src_exact, again = _ask(client, p["a"]["user"])
                t_b, src_b, _ = _ask(client, p["b"]["user"])
                cold.append(t_cold)
                if src_exact == "cache" and again == text:
                    exact.append(t_exact)
                if src_b == "cache" and p["label"] == "hit":
                    semantic.append(t_b)
                rows.append({"id": p["id"], "label": p["label"], "cold_source": src_cold, "repeat_source": src_exact,
                             "repeat_identical": again == text, "second_source": src_b})
        finally:
            s.stop()
    ms = lambda v, q: _pct(v, q) * 1e3  # noqa: E731
    hits = [r for r in rows if r["label"] == "hit"]
    out = {"benchmark": "cache", "model": args.model, "threads": threads, **machine(),
           "workload": {"pairs": len(chosen), "should_hit": len(hits), "near_misses": len(chosen) - len(hits),
                        "max_tokens": 32, "greedy": True, "in_sample": True},
           "targets": {"hit_p50_ms": 20.0, "hit_over_cold": 10.0},
           "cold_ttft_ms_p50": ms(cold, 0.5), "cold_ttft_ms_p99": ms(cold, 0.99),
           "exact_hit_ttft_ms_p50": ms(exact, 0.5), "exact_hit_ttft_ms_p99": ms(exact, 0.99),
           "semantic_hit_ttft_ms_p50": ms(semantic, 0.5) if semantic else None,
           "exact_hits": len(exact), "repeats": len(rows),
           "semantic_hit_rate": sum(r["second_source"] == "cache" for r in hits) / max(1, len(hits)),
           "false_hits": sum(r["second_source"] == "cache" for r in rows if r["label"] == "miss"),
           "rows": rows, "date": time.strftime("%Y-%m-%d %H:%M:%S")}
    out["hit_over_cold"] = out["cold_ttft_ms_p50"] / out["exact_hit_ttft_ms_p50"]
    print(f"cold TTFT p50 {out['cold_ttft_ms_p50']:.1f} ms; exact hit p50 {out['exact_hit_ttft_ms_p50']:.1f} ms "
          f"({out['hit_over_cold']:.0f}x), semantic hit p50 "
          f"{out['semantic_hit_ttft_ms_p50'] or float('nan'):.1f} ms; {out['exact_hits']}/{out['repeats']} repeats "
          f"hit; semantic hit rate {out['semantic_hit_rate']:.2f} of {len(hits)}; false hits {out['false_hits']} of "
          f"{len(rows) - len(hits)}", flush=True)
    if args.json_file:
        with open(args.json_file, "w", encoding="utf-8") as f:
            json.dump(out, f, indent=1)
    return 0
