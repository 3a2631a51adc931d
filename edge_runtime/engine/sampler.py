"""Turn one step's logits into the next token.

Greedy, temperature, top-k, top-p, min-p and repetition penalty, applied in
llama.cpp's default order (penalties -> top-k -> top-p -> min-p ->
temperature -> draw). A seeded `torch.Generator` makes sampled output
repeatable: same seed, same request, same tokens. It knows nothing about the
model or the text.
"""
from __future__ import annotations

import torch

from edge_runtime.request import SamplingParams


class Sampler:
    def __init__(self, params: SamplingParams):
        self.params = params
        self.generator = torch.Generator(device="cpu")
        if params.seed is not None:
            self.generator.manual_seed(params.seed)
        else:
            self.generator.seed()

    @property
    def plain_greedy(self) -> bool:
        """Greedy with no repetition penalty: the token is the logits' argmax (the first, on ties), so a
        caller may take it from one argmax over a whole batch of rows (the engine does)."""
        p = self.params
        return p.greedy and (p.repetition_penalty == 1.0 or p.repeat_last_n == 0)

    def apply_penalty(self, logits: torch.Tensor, history: list[int]) -> torch.Tensor:
        p = self.params
        if p.repetition_penalty == 1.0 or not history or p.repeat_last_n == 0:
            return logits
        recent = torch.tensor(sorted(set(history[-p.repeat_last_n:])), dtype=torch.long)
        vals = logits[recent]
        logits = logits.clone()
        # As llama.cpp and transformers: divide positive logits, multiply negative ones.
        logits[recent] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
        return logits

    def probabilities(self, logits: torch.Tensor, history: list[int]) -> torch.Tensor:
        """The distribution a non-greedy draw uses: fp32 [vocab], zeros outside the kept set. After top-k the
        rest runs on the kept tokens alone (ties with the k-th included), not on the whole vocabulary: the same
        kept set and probabilities (to float rounding), at a fraction of the cost (a sort of 49,152 values
        per token was most of it)."""
        p = self.params
        logits = self.apply_penalty(logits.float(), history)
        vocab, keep = logits.shape[-1], None
        if 0 < p.top_k < vocab:
            kth = torch.topk(logits, p.top_k).values[-1]
            keep = torch.nonzero(logits >= kth).squeeze(1)
            logits = logits[keep]
        if p.top_p < 1.0:
            sorted_logits, order = torch.sort(logits, descending=True)
            cum = torch.softmax(sorted_logits, dim=-1).cumsum(-1)
            # Keep the smallest prefix whose mass reaches top_p (always at least one token).
            drop_sorted = (cum - torch.softmax(sorted_logits, dim=-1)) >= p.top_p
            drop_sorted[0] = False  # a top_p that rounds to 0 in fp32 must still keep the top token
            drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
            logits = logits.masked_fill(drop, float("-inf"))
        if p.min_p > 0.0:
            probs = torch.softmax(logits, dim=-1)
            logits = logits.masked_fill(probs < p.min_p * probs.max(), float("-inf"))
        probs = torch.softmax(logits / max(p.temperature, 1e-6), dim=-1)
        if keep is None:
            return probs
        return torch.zeros(vocab).index_copy_(0, keep, probs)

    def sample(self, logits: torch.Tensor, history: list[int], draft: int | None = None,
               draft_probs: torch.Tensor | None = None) -> int:
        """logits: [vocab] for the next position; history: token ids so far (prompt + generated).

        With a speculative `draft` token for this position drawn from the drafter's distribution q
        (`draft_probs`), a sampled draw is the rejection test (speculative sampling, Leviathan et al.,
        Chen et al.): keep the draft with probability min(1, p(d) / q(d)), otherwise draw from
        max(p - q, 0) renormalized; the token then has exactly distribution p. For a deterministic
        drafter (q one-hot at d, `draft_probs` None) that test keeps d with probability p(d) and
        otherwise draws from p without d, which is the same as drawing from p and comparing with d:
        so that is what happens, and the random stream and the tokens stay those of plain decoding
        (same seed, same answer, with or without drafting). Greedy ignores the draft."""
        if self.params.greedy:
            return int(torch.argmax(self.apply_penalty(logits.float(), history)))
        probs = self.probabilities(logits, history)
        if draft is None or draft_probs is None:
            return self.draw(probs)
        q_d = float(draft_probs[draft])
        u = float(torch.rand(1, generator=self.generator))
        if q_d > 0.0 and u * q_d < float(probs[draft]):
            return draft
        residual = torch.clamp(probs - draft_probs.float(), min=0.0)
        if float(residual.sum()) <= 0.0:  # p == q: the draft is always kept above; reached only by rounding
            return draft
        return self.draw(residual)

    def draw(self, weights: torch.Tensor) -> int:
        """One index drawn with probability proportional to `weights` ([vocab], non-negative, any positive sum):
        the inverse of their cumulative sum (fp64) at one uniform number from the generator. The same
        distribution as `torch.multinomial(weights, 1)`, which draws an exponential for every entry (about
        1 ms for this model's 49,152 tokens, a third of a decode step) where this reads one number (0.05 ms)."""
        cdf = weights.double().cumsum(0)
        u = torch.rand(1, dtype=torch.float64, generator=self.generator)
        i = int(torch.searchsorted(cdf, u * cdf[-1], right=True))
        if i >= len(cdf):  # u * sum rounded up to the sum: the last index with weight
            i = int(torch.nonzero(weights).max())
        return i
