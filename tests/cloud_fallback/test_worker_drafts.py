"""The worker with drafts (`--draft ngram`, `--draft mtp`) as a real process on loopback: drafts are verified
as rows of the batched steps (counted on /metrics) and every answer is token for token the plain worker's."""
import pytest

from tests.cloud_fallback.worker_fixtures import (PROMPTS, WorkerProcess, answers_at_once, collect, gen, joined,
                                                  open_raw, run)


def test_a_worker_with_ngram_drafts_answers_as_without(worker, solo):
    """--draft ngram: a stream that runs alone verifies prompt-lookup drafts (counted on /metrics), and every
    answer, alone or with company, is token for token the plain worker's (the module's `solo` runs)."""
    passage = "The library opens at nine and closes at six. Members may borrow five books for three weeks."
    grounded_request = gen("g", f"Repeat this text exactly:\n\n{passage}", max_tokens=40)

    async def grounded_on(w):
        ws, _ = await open_raw(w)
        await ws.send(grounded_request)
        frames = (await collect(ws, {"g"}))["g"]
        await ws.close()
        return frames
    w = WorkerProcess("--max-prompt-tokens", "300", "--max-tokens", "400", "--draft", "ngram")
    try:
        grounded = run(grounded_on(w))
        together = answers_at_once(w, PROMPTS[:3], "c")  # three at once: each may carry drafts in the shared steps
        m = w.metrics()
    finally:
        w.stop()
    assert m["edge_worker_draft_verifications_total"] > 0 and m["edge_worker_draft_accepted_total"] > 0
    step_costs = {k: v for k, v in m.items() if k.startswith('edge_worker_step_seconds{rows="')}
    assert step_costs and all(v > 0 for v in step_costs.values())  # the planner's measured t(R)
    reference = run(grounded_on(worker))  # the module's worker drafts nothing
    assert joined(grounded) == joined(reference) and joined(grounded)[1]
    for i in range(3):
        assert joined(together[i])[:2] == solo[i][:2]


@pytest.mark.parametrize("method", ["mtp", "mtp-ngram", "mtp-tree", "mtp-attn", "mtp-attn-tree"])
def test_a_worker_with_mtp_drafts_answers_as_without(solo, method):
    """--draft mtp (chains), mtp-tree (draft trees), mtp-attn and mtp-attn-tree (the attention head's chains and
    trees): the worker
    drafts with the heads shipped for its
    model (drafts verified, counted on /metrics), and its answers, three at once, are token for token the
    plain worker's."""
    w = WorkerProcess("--max-prompt-tokens", "300", "--max-tokens", "400", "--draft", method)
    try:
        together = answers_at_once(w, PROMPTS[:3], "m")
        m = w.metrics()
    finally:
        w.stop()
    assert m["edge_worker_draft_verifications_total"] > 0
    for i in range(3):
        assert together[i][-1]["type"] == "done"
        assert joined(together[i]) == solo[i][:2], f"prompt {i} changed with {method} drafts"
