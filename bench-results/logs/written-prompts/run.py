"""Probe of the data's variety (issue 18): prompts written one by one (1,020 of them: the first 170 of each of the
six kinds in edge_runtime/data/mtp_written_prompts.json, kinds in name order; none an MT-Bench question: `check` measures the nearest MT-Bench question for each) against the
chat-like set of edge_cli/mtp_chat.py (lists crossed with templates). The model answers each greedily and at
0.8 (160 tokens); the MLP heads' trainer (soft loss, 4 epochs, hidden 1024, no taps) learns from the answers,
and the heads are measured on MT-Bench's 80 first turns replayed at k = 3, alone and with prompt lookup, as in
../chat-data-small (1.518 and 1.841 for the chat-like set at 178,176 answer tokens).

Run from the repo root: .venv/bin/python bench-results/logs/written-prompts/run.py check | gen | train [equal|all]
(gen writes .cache/mtp-written.pt; `train equal` trains on whole prompts (both answers) drawn in a seeded order
until they hold as many answer tokens as the chat-like probe, `train all` on every answer)."""
import difflib
import importlib.util
import json
import os
import random
import sys

import torch

from edge_cli.bench.spec import mt_bench_prompts  # noqa: E402
from edge_cli.mtp_chat import written_kinds  # noqa: E402

PATH = ".cache/mtp-written.pt"
CHAT_PROBE_TOKENS = 178_176  # the chat-like probe's answer tokens (../chat-data-small/README.md)


def written_prompts() -> list[str]:
    return [p for kind, prompts in sorted(written_kinds().items()) for p in prompts[:170]]


if sys.argv[1] == "check":  # the nearest MT-Bench question to each written prompt (difflib's ratio on words)
    mt = [q.lower().split() for q in mt_bench_prompts(80)]
    near = []
    for p in written_prompts():
        words = p.lower().split()
        near.append((max(difflib.SequenceMatcher(None, words, q).ratio() for q in mt), p[:100]))
    near.sort(reverse=True)
    for r, p in near[:10]:
        print(f"{r:.3f} {p}")
    print("RESULT check", json.dumps({"prompts": len(near), "max_ratio": round(near[0][0], 3),
                                      "over_0.5": sum(r > 0.5 for r, _ in near)}))
    sys.exit(0)

# the chat-like probe's answering and its trainer with its measurements, as that probe ran them
spec = importlib.util.spec_from_file_location("chat_probe", os.path.join(os.path.dirname(__file__), "..",
                                                                          "chat-data-small", "run.py"))
probe = importlib.util.module_from_spec(spec)
spec.loader.exec_module(probe)
backend = probe.backend_for_probes()
if sys.argv[1] == "gen":
    probe.answer(backend, written_prompts(), PATH)
else:
    which = sys.argv[2]
    data = torch.load(PATH)
    records, n = data["records"], data["prompts"]
    if which == "equal":  # whole prompts (greedy and sampled answer: jobs are temperature-major) in a seeded order
        order, keep, tokens = list(range(n)), [], 0
        random.Random(0).shuffle(order)
        for i in order:
            if tokens >= CHAT_PROBE_TOKENS:
                break
            keep.append(i)
            tokens += len(records[i]["tokens"]) + len(records[n + i]["tokens"])
        records = [records[i] for i in sorted(keep)] + [records[n + i] for i in sorted(keep)]
        data = {**data, "records": records, "prompts": len(keep)}
    probe.train_and_measure(backend, data, f"written-{which}", extra={
        "prompts": data["prompts"], "answers": len(records), "tokens": sum(len(r["tokens"]) for r in records)})
