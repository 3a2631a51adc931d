"""Probe of the data's distribution (issue 18): the MLP heads' trainer (soft loss, 4 epochs, hidden 1024, no
taps) on the model's own answers to chat-like prompts (edge_cli/mtp_chat.py at per_kind=100, greedy and at 0.8, 160 tokens), about as
many answer tokens as the small set, measured on MT-Bench's 80 first turns replayed at k = 3 alone and with
prompt lookup (mtp-ngram). Compare: the same trainer on the small set's answers, 1.448 (logs/mlp-readout-and-
attention-off-4ep/runs.log, `mlp-soft`). Run from the repo root: .venv/bin/python bench-results/logs/chat-data-small/run.py
gen | train [DATA NAME] (gen writes .cache/mtp-chat.pt; train reads it, or DATA: `train .cache/mtp-data.pt small`
trains the same on the small set's answers for the lookup column)."""
import json
import os
import sys
import time

import torch

from edge_cli.bench.spec import mt_bench_prompts  # noqa: E402
from edge_cli.mtp_chat import chat_prompts  # noqa: E402
from edge_cli.mtp_data import _jobs, _prompt, answer_jobs  # noqa: E402
from edge_cli.mtp_eval import lookup_walk  # noqa: E402
from edge_cli.train_attn import MT_BENCH_TOKENS, mlp_figures, mt_bench_records  # noqa: E402
from edge_cli.train_mtp import train  # noqa: E402
from edge_runtime.backends.native import NativeBackend  # noqa: E402
from edge_runtime.spec.mtp import MtpDrafter  # noqa: E402

PATH = ".cache/mtp-chat.pt"


def answer(backend, prompts: list[str], path: str) -> dict:
    """Each prompt answered greedily and at 0.8 (160 tokens, seed 0), saved to `path`; prints the RESULT gen line."""
    jobs = _jobs([[{"role": "user", "content": p}] for p in prompts], (0.0, 0.8))
    t0 = time.time()
    records = answer_jobs(backend, jobs, 160, seed=0, batch=8, progress=None)
    data = {"records": records, "prompts": len(prompts), "temperatures": [0.0, 0.8], "seed": 0, "max_tokens": 160}
    torch.save(data, path)
    print("RESULT gen", json.dumps({"prompts": len(prompts), "answers": len(records), "seconds": round(time.time() - t0),
                                    "tokens": sum(len(r["tokens"]) for r in records)}), flush=True)
    return data


def train_and_measure(backend, data: dict, name: str, hidden: int = 1024, extra: dict | None = None) -> None:
    """The MLP heads' trainer (soft loss, 4 epochs, no taps) on `data`, measured on MT-Bench's first turns at k = 3
    alone and with prompt lookup; prints the RESULT line (`extra`'s keys first)."""
    bench = mt_bench_records(backend, 80, MT_BENCH_TOKENS, ".cache/mtp-mt-bench.pt")
    t0 = time.time()
    head, rep = train(data, backend, hidden=hidden, epochs=4, loss="soft")
    f = mlp_figures(head, bench, backend)
    prompts = [_prompt(backend, [{"role": "user", "content": q}], MT_BENCH_TOKENS) for q in mt_bench_prompts(80)]
    records = [{**r, "hidden": r["hidden"][:, :head.dim]} for r in bench]
    combo = lookup_walk(MtpDrafter(head, backend.model.embedding), records, prompts, 3, MT_BENCH_TOKENS)
    print(f"RESULT {name}-soft 4", round(time.time() - t0), json.dumps({**(extra or {}),
        "mean_accepted_k3": f["mean_accepted_k3"], "acceptance_per_position": f["acceptance_per_position"],
        "with_lookup_k3": combo["mean_accepted"], "held_out_chain_accuracy": rep["held_out_chain_accuracy"]}), flush=True)


def backend_for_probes():
    torch.set_num_threads(2)
    return NativeBackend(model="default", threads=2, n_ctx=1024, kv_budget="1GiB")


if __name__ == "__main__":
    backend = backend_for_probes()
    if sys.argv[1] == "gen":
        answer(backend, chat_prompts(per_kind=100), PATH)  # the probe's 658 prompts
    else:
        path, name = (sys.argv[2], sys.argv[3]) if len(sys.argv) > 3 else (PATH, "chat")
        train_and_measure(backend, torch.load(path), name)
