"""Speculative decoding, first parts: the n-gram proposer, and verification on the native runner's paged cache
(several tokens in one pass; rejected drafts leave the KV cache and never reach the prefix cache)."""
import random

import pytest
import torch

from edge_runtime.engine.completion import build_prompt, prompt_ids
from edge_runtime.request import GenerationRequest, SamplingParams
from edge_runtime.spec.speculative import NgramProposer


def brute_force(context, k, max_n, min_n):
    """The specification: the longest suffix n-gram (max_n down to min_n) seen earlier; its latest occurrence."""
    for n in range(min(max_n, len(context) - 1), min_n - 1, -1):
        tail = context[-n:]
        for start in range(len(context) - n - 1, -1, -1):
            if context[start:start + n] == tail:
                return context[start + n:start + n + k]
    return []


def test_prompt_lookup_continues_a_repeated_span():
    p = NgramProposer(max_n=3)
    ctx = [5, 6, 7, 8, 9, 1, 2, 5, 6, 7]
    assert p.propose(ctx, 3) == [8, 9, 1]
    assert p.propose(ctx + [8], 2) == [9, 1]  # incremental: the same answer as from scratch
    assert p.propose([1, 2, 3], 4) == []  # nothing repeats
    assert p.propose(ctx, 0) == [] and NgramProposer().propose([4], 3) == []


def test_incremental_index_equals_brute_force_on_random_histories():
    rng = random.Random(0)
    for max_n, min_n in ((3, 1), (4, 2), (1, 1)):
        p = NgramProposer(max_n=max_n, min_n=min_n)
        ctx = [rng.randrange(6) for _ in range(3)]
        for _ in range(300):
            k = rng.randint(1, 5)
            assert p.propose(ctx, k) == brute_force(ctx, k, max_n, min_n), (ctx, k)
            ctx.append(rng.randrange(6))
        other = [rng.randrange(6) for _ in range(40)]  # a different history resets the index
        assert p.propose(other, 3) == brute_force(other, 3, max_n, min_n)
    with pytest.raises(ValueError):
        NgramProposer(max_n=1, min_n=2)


def prompt(backend, text="Repeat after me: the quick brown fox jumps over the lazy dog."):
    req = GenerationRequest(messages=[{"role": "user", "content": text}], params=SamplingParams())
    return prompt_ids(backend.runner, build_prompt(req, backend.template))


def test_verify_scores_every_position_and_keep_drops_rejected_drafts(native_backend):
    runner = native_backend.runner
    runner.reset()
    ids = prompt(native_backend)
    first = int(torch.argmax(runner.prefill(ids)))
    greedy = [first]  # the reference: plain one-token steps
    logits = runner.step(first)
    rows = [logits]
    for _ in range(5):
        greedy.append(int(torch.argmax(logits)))
        logits = runner.step(greedy[-1])
        rows.append(logits)
    runner.reset()
    runner.prefill(ids)
    drafts = greedy[1:4] + [12345] * 17  # three right, then wrong ones filling at least one whole block
    out = runner.verify([first] + drafts)
    assert out.shape[0] == 21
    assert [int(torch.argmax(out[i])) for i in range(4)] == greedy[1:5]  # row i predicts what follows token i
    for i in range(4):  # not just the same argmax: the same bits as the one-token step (lossless drafting)
        assert torch.equal(out[i], rows[i].reshape(-1)), i
    runner.keep(len(ids) + 4)  # the sampled token and three accepted drafts
    assert runner.cached_ids == ids + greedy[:4]
    assert runner.blocks.num_tokens(runner.seq) == len(ids) + 4
    nxt = runner.step(greedy[4])  # decoding goes on from the kept tokens as if nothing was rejected
    assert int(torch.argmax(nxt)) == greedy[5]
    # the rejected token never entered the prefix cache: a prompt ending in it finds at most the kept part
    cached = runner.blocks.num_cached_prefix(ids + greedy[:4] + [12345] * 17)
    assert cached <= len(ids) + 4
    with pytest.raises(ValueError):
        runner.keep(len(runner.cached_ids) + 1)
