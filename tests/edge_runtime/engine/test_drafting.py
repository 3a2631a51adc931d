"""Drafting inside the batch engine (drafting.py) on the real model: a sequence that runs alone verifies
n-gram drafts, and its answer is what plain decoding gives (greedy token for token, and a seeded sample draw
for draw); a second sequence arriving stops the drafting mid-answer without changing either answer."""
import pytest

from edge_runtime.engine.batch_engine import load_engine
from edge_runtime.request import GenerationRequest, SamplingParams
from edge_runtime.engine.scheduler import SchedulerConfig

PASSAGE = ("The library opens at nine in the morning and closes at six in the evening. Members may borrow up to "
           "five books at a time, and each loan lasts three weeks. Late returns cost ten cents per day.")
GROUNDED = GenerationRequest(messages=[{"role": "user", "content": f"Repeat this text exactly:\n\n{PASSAGE}"}],
                             params=SamplingParams(max_tokens=60))
OTHER = GenerationRequest(messages=[{"role": "user", "content": "Explain how a rainbow forms."}],
                          params=SamplingParams(max_tokens=30))


@pytest.fixture(scope="module")
def engine(model_path):
    from kernels import cpu_gemv

    if not cpu_gemv.available():
        pytest.skip("C kernels unavailable here")
    return load_engine(model_path, n_ctx=1024, config=SchedulerConfig(4, 512, 256))


def run(engine, draft: str, requests, after=None):
    """Submit `requests` (one each `after[i]` engine steps in, else at once), step until all finish; token ids."""
    engine.draft = draft
    out = {i: [] for i in range(len(requests))}
    sinks = {i: (lambda ev, i=i: out[i].extend(ev.token_ids) if ev.type == "delta" else None) for i in out}
    pending = list(range(len(requests)))
    steps = 0
    while pending or engine.jobs or engine._commands:
        for i in list(pending):
            if after is None or steps >= after[i]:
                engine.submit(f"r{i}-{draft}-{id(out)}", requests[i], sinks[i])
                pending.remove(i)
        engine.step()
        steps += 1
    return [out[i] for i in range(len(requests))]


def test_a_lone_sequence_drafts_and_its_greedy_answer_is_unchanged(engine):
    before = engine.draft_stats()
    plain = run(engine, "none", [GROUNDED])[0]
    drafted = run(engine, "ngram", [GROUNDED])[0]
    after = engine.draft_stats()
    assert drafted == plain and len(plain) > 20
    assert after["verifications"] > before["verifications"] and after["accepted"] > before["accepted"]


def test_a_seeded_sample_is_the_same_draw_with_drafts(engine):
    req = GenerationRequest(messages=GROUNDED.messages, params=SamplingParams(max_tokens=40, temperature=0.8,
                                                                              top_k=40, seed=11))
    assert run(engine, "ngram", [req])[0] == run(engine, "none", [req])[0]


def test_a_second_sequence_stops_the_drafting_and_both_answers_stay_the_same(engine):
    alone = [run(engine, "none", [r])[0] for r in (GROUNDED, OTHER)]
    before = engine.draft_stats()
    together = run(engine, "ngram", [GROUNDED, OTHER], after=[0, 6])  # the second arrives mid-answer, with drafts queued
    assert together == alone
    assert engine.draft_stats()["verifications"] > before["verifications"]  # the first drafted while alone
    assert engine.scheduler.stats()["num_running"] == 0 and not engine.jobs
