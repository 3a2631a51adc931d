"""Plain decode on 1 and 2 threads, round-robin in one process (3 rounds of 4 MT-Bench questions, 128 tokens).
Run from the repo root: OMP_WAIT_POLICY=PASSIVE .venv/bin/python bench-results/logs/confidence-drafting/threads.py"""
import sys, time
from edge_runtime.backends.native import NativeBackend
from edge_runtime.request import GenerationRequest, SamplingParams
from edge_cli.bench.spec import mt_bench_prompts
qs = mt_bench_prompts(80)[::10][:4]
nbs = {t: NativeBackend(model=None, threads=t) for t in (1, 2)}
for rnd in range(3):
    for t, nb in nbs.items():
        toks = secs = 0
        for q in qs:
            nb.reset_prefix_cache(); nb.set_draft("none")
            r = nb.generate(GenerationRequest(messages=[{"role": "user", "content": q}], params=SamplingParams(temperature=0.0, max_tokens=128)))
            tm = r.timings; toks += r.usage.completion_tokens - 1; secs += tm["total_s"] - tm["ttft_ms"]/1000
        print(rnd, t, f"{toks/secs:.1f} tok/s", flush=True)
