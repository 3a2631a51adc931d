"""What turning logits into a sampled token costs in decoding: the engine's sampler now (after top-k the rest on the
kept tokens alone; the draw by one uniform and the inverse of the cumulative sum, `Sampler.draw`) against the
sampler before 2026-12-06 (top-p's sort and every softmax over all 49,152 tokens; `torch.multinomial`, an
exponential for each of them), timed in one process, alternating, on the default model through the native
backend: 6 prompts, 128 tokens each, 3 rounds, with `chat`'s and `serve`'s defaults (temperature 0.8, top-k 40,
top-p 0.95, min-p 0.05, repeat penalty 1.1) and with temperature 0.8 alone; decode tok/s as the backend reports
it (`decode_tok_per_s`), medians. Both sample the same distribution; their tokens differ for a seed. Prints its
figures and writes them, with the machine, to the JSON file named as its argument.

    OMP_WAIT_POLICY=PASSIVE .venv/bin/python scripts/sampled_decode.py bench-results/logs/sampled-decode.json
"""
from __future__ import annotations

import statistics
import sys

import torch

from edge_runtime.backends import create_backend
from edge_runtime.engine.sampler import Sampler
from edge_runtime.model.path import default_model_path
from edge_runtime.request import GenerationRequest, SamplingParams

PROMPTS = ["Write a short story about a lighthouse keeper.", "Explain how vaccines train the immune system.",
           "Give me five ideas for a rainy weekend.", "Describe the water cycle to a child.",
           "What makes a good cup of coffee?", "Summarize the plot of a heist movie you invent."]


def before_draw(self, weights: torch.Tensor) -> int:
    return int(torch.multinomial(weights, 1, generator=self.generator))


def before_probabilities(self, logits: torch.Tensor, history: list[int]) -> torch.Tensor:
    """The sampler's distribution as of commit d9d3632: every step on the whole vocabulary."""
    p = self.params
    logits = self.apply_penalty(logits.float(), history)
    if p.top_k > 0 and p.top_k < logits.shape[-1]:
        kth = torch.topk(logits, p.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cum = torch.softmax(sorted_logits, dim=-1).cumsum(-1)
        drop_sorted = (cum - torch.softmax(sorted_logits, dim=-1)) >= p.top_p
        drop_sorted[0] = False
        drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    if p.min_p > 0.0:
        probs = torch.softmax(logits, dim=-1)
        logits = logits.masked_fill(probs < p.min_p * probs.max(), float("-inf"))
    return torch.softmax(logits / max(p.temperature, 1e-6), dim=-1)


def main() -> None:
    from edge_runtime.engine import sampling_defaults

    backend = create_backend("native", model=default_model_path(), threads=2)
    backend.set_draft("none")
    now = (Sampler.probabilities, Sampler.draw)
    arms = {"now": now, "before": (before_probabilities, before_draw)}
    settings = {"defaults": lambda seed: sampling_defaults.NONE.params(max_tokens=128, seed=seed),
                "temperature 0.8": lambda seed: SamplingParams(temperature=0.8, max_tokens=128, seed=seed)}
    runs = {(s, a): [] for s in settings for a in arms}
    for r in range(3):
        for s, make in settings.items():
            for a, (probabilities, draw) in arms.items():
                Sampler.probabilities, Sampler.draw = probabilities, draw
                for i, p in enumerate(PROMPTS):
                    req = GenerationRequest(messages=[{"role": "user", "content": p}], params=make(100 * r + i))
                    runs[(s, a)].append(backend.generate(req).decode_tok_per_s)
    Sampler.probabilities, Sampler.draw = now
    figures = {"benchmark": "sampled-decode", "threads": 2, "answers_per_arm": len(runs[("defaults", "now")]),
               "max_tokens": 128, "settings": {}}
    for s in settings:
        med = {a: statistics.median(runs[(s, a)]) for a in arms}
        figures["settings"][s] = {"now_tok_s": med["now"], "before_tok_s": med["before"],
                                  "now_over_before": med["now"] / med["before"]}
        print(f"{s}: decode tok/s, medians of {len(runs[(s, 'now')])} answers: now {med['now']:.1f}, before "
              f"{med['before']:.1f}; now / before {med['now'] / med['before']:.3f}")
    if len(sys.argv) > 1:
        from edge_cli.bench.decode import print_and_save

        print_and_save(figures, sys.argv[1])


if __name__ == "__main__":
    main()
