"""Probe of the heads' data (issue 18): prompts the model writes itself, Magpie-style. The model is given the
chat template up to the user turn's start (system turn included) and samples a user message (temperature 1.0,
up to 64 tokens, seed per query); messages that end on their own, have at least 6 tokens and are new are kept
until 658 are (the chat probe's count). Then, exactly as bench-results/logs/chat-data-small/run.py: each
answered greedily and at 0.8 (160 tokens), the MLP heads' trainer (soft loss, 4 epochs, hidden 1024, no taps) on
the answers, measured on MT-Bench's 80 first turns replayed at k = 3 alone and with prompt lookup. Compare
(same trainer, about the same answer tokens): the chat-like prompts 1.518, the small set 1.448 (that probe's
runs.log). Run from the repo root: .venv/bin/python bench-results/logs/magpie-probe/run.py gen (writes
.cache/mtp-magpie.pt), then that probe's trainer on it: .venv/bin/python bench-results/logs/chat-data-small/run.py
train .cache/mtp-magpie.pt magpie."""
import json
import sys
import time

import torch

import edge_cli.mtp_data as mtp_data
from edge_cli.mtp_data import _jobs, _prompt, answer_jobs
from edge_runtime.backends.native import NativeBackend

PATH, QUERIES, MARK = ".cache/mtp-magpie.pt", 658, "\x01MAGPIE\x01"
torch.set_num_threads(2)
backend = NativeBackend(model="default", threads=2, n_ctx=1024, kv_budget="1GiB")


def user_prefix() -> list[int]:
    """The template's ids up to where a user's message starts (system turn included)."""
    text = backend.template.render([{"role": "user", "content": MARK}], add_generation_prompt=True)
    return mtp_data.prompt_ids(backend.runner, text[:text.index(MARK)])


def write_queries(n: int) -> list[str]:
    prefix, plain = user_prefix(), _prompt
    mtp_data._prompt = lambda b, messages, m: prefix if messages == MARK else plain(b, messages, m)
    kept, seen, start = [], set(), 0
    while len(kept) < n:
        jobs = [(1.0, start + i, MARK) for i in range(n)]
        for r in answer_jobs(backend, jobs, 64, seed=1000, batch=8, progress=None):
            toks = r["tokens"].tolist()
            if toks[-1] not in backend.runner.eog_ids or len(toks) < 6:
                continue
            q = b"".join(backend.runner.token_bytes(t) for t in toks[:-1]).decode("utf-8", "replace").strip()
            if q and q not in seen and len(kept) < n:
                seen.add(q)
                kept.append(q)
        start += n
    mtp_data._prompt = plain
    return kept


if sys.argv[1] == "gen":
    t0 = time.time()
    queries = write_queries(QUERIES)
    tq = time.time() - t0
    jobs = _jobs([[{"role": "user", "content": q}] for q in queries], (0.0, 0.8))
    records = answer_jobs(backend, jobs, 160, seed=0, batch=8, progress=None)
    torch.save({"records": records, "prompts": len(queries), "queries": queries, "temperatures": [0.0, 0.8],
                "seed": 0, "max_tokens": 160}, PATH)
    print("SAMPLE queries", json.dumps(queries[:12], ensure_ascii=False), flush=True)
    print("RESULT gen", json.dumps({"prompts": len(queries), "query_seconds": round(tq), "answers": len(records),
                                    "seconds": round(time.time() - t0),
                                    "tokens": sum(len(r["tokens"]) for r in records)}), flush=True)
else:
    sys.exit("train: .venv/bin/python bench-results/logs/chat-data-small/run.py train .cache/mtp-magpie.pt magpie")
