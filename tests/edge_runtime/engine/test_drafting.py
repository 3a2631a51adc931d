"""Drafting inside the engine core (drafting.py) on the real model: decode chunks carry n-gram drafts as
extra rows of the step, alone or several sequences at once, and every answer is what plain decoding gives
(greedy token for token, a seeded sample draw for draw); rejected drafts never reach the prefix cache."""
import pytest

from edge_runtime.engine.batch_engine import load_engine
from edge_runtime.engine.scheduler import SchedulerConfig
from edge_runtime.request import GenerationRequest, SamplingParams
from edge_runtime.spec.tree import TreeDrafter

PASSAGES = [
    "The library opens at nine in the morning and closes at six in the evening. Members may borrow up to "
    "five books at a time, and each loan lasts three weeks. Late returns cost ten cents per day.",
    "Our bakery sells fresh bread every morning. Sourdough loaves cost four dollars, rye costs three, and "
    "the bakery closes at two in the afternoon on Sundays.",
    "The train leaves the central station at eight fifteen and arrives in the harbour town at ten thirty, "
    "stopping twice on the way.",
]
GROUNDED = [GenerationRequest(messages=[{"role": "user", "content": f"Repeat this text exactly:\n\n{p}"}],
                              params=SamplingParams(max_tokens=60)) for p in PASSAGES]
OTHER = GenerationRequest(messages=[{"role": "user", "content": "Explain how a rainbow forms."}],
                          params=SamplingParams(max_tokens=30))


@pytest.fixture(scope="module")
def engine(model_path):
    from kernels import cpu_gemv

    if not cpu_gemv.available():
        pytest.skip("C kernels unavailable here")
    return load_engine(model_path, n_ctx=1024, config=SchedulerConfig(4, 512, 256))


def shipped(engine, kind: str = "mlp"):
    """The drafter of the heads shipped for the engine's model: the MLP heads' or ("attention") the attention
    head's, found by the model's fingerprint as the backends find them."""
    import types

    from edge_runtime.spec.attn_drafter import AttnDrafter
    from edge_runtime.spec.mtp import MtpDrafter

    model = types.SimpleNamespace(name="test", model=engine.model, tokenizer_fingerprint=engine.tokenizer.fingerprint)
    return (AttnDrafter if kind == "attention" else MtpDrafter).for_backend(model)


def run(engine, draft: str, requests, after=None, steps_log=None, **draft_args):
    """Submit `requests` (one each `after[i]` engine steps in, else at once), step until all finish; token
    ids. `steps_log` collects, per step, how many chunks carried drafts."""
    engine.set_draft(draft, **draft_args)
    engine.blocks.reset_prefix_cache()  # every run cold
    out = {i: [] for i in range(len(requests))}
    sinks = {i: (lambda ev, i=i: out[i].extend(ev.token_ids) if ev.type == "delta" else None) for i in out}
    pending = list(range(len(requests)))
    steps = 0
    while pending or engine.jobs or engine._commands:
        for i in list(pending):
            if after is None or steps >= after[i]:
                engine.submit(f"r{i}-{draft}-{id(out)}", requests[i], sinks[i])
                pending.remove(i)
        before = engine.num_verifications
        engine.step()
        if steps_log is not None:
            steps_log.append(engine.num_verifications - before)
        steps += 1
    return [out[i] for i in range(len(requests))]


def test_a_lone_sequence_drafts_and_its_greedy_answer_is_unchanged(engine):
    plain = run(engine, "none", GROUNDED[:1])[0]
    before = engine.draft_stats()
    drafted = run(engine, "ngram", GROUNDED[:1])[0]
    after = engine.draft_stats()
    assert drafted == plain and len(plain) > 20
    assert after["verifications"] > before["verifications"] and after["accepted"] > before["accepted"]


def test_a_seeded_sample_is_the_same_draw_with_drafts(engine):
    req = GenerationRequest(messages=GROUNDED[0].messages, params=SamplingParams(max_tokens=40, temperature=0.8,
                                                                                 top_k=40, seed=11))
    assert run(engine, "ngram", [req])[0] == run(engine, "none", [req])[0]


def test_several_sequences_draft_in_one_step_and_every_answer_equals_its_solo_plain_run(engine):
    requests = GROUNDED + [OTHER]
    alone = [run(engine, "none", [r])[0] for r in requests]
    log: list[int] = []
    together = run(engine, "ngram", requests, after=[0, 0, 3, 7], steps_log=log)
    assert together == alone
    assert max(log) >= 2  # some step verified drafts of two or more sequences at once
    assert engine.scheduler.stats()["num_running"] == 0 and not engine.jobs


def test_draft_trees_of_several_sequences_in_one_step_give_their_solo_plain_answers(engine):
    """Trees (tree attention rows) of up to four sequences in one batched C call, next to plain rows."""
    mtp = shipped(engine)
    requests = GROUNDED + [OTHER]
    alone = [run(engine, "none", [r])[0] for r in requests]
    log: list[int] = []
    before = engine.draft_stats()
    together = run(engine, "mtp-tree", requests, after=[0, 0, 3, 7], steps_log=log, mtp=mtp, fixed_k=6)
    after = engine.draft_stats()
    assert together == alone
    assert max(log) >= 2 and after["accepted"] > before["accepted"]
    assert engine.scheduler.stats()["num_running"] == 0 and not engine.jobs
    engine.blocks.check_invariants()
    # mtp-ngram (what --draft auto runs where only the MLP heads ship): prompt lookup where the last two tokens
    # match, the heads' chains elsewhere, each source learning its own acceptance; the same answers
    before = engine.draft_stats()
    assert run(engine, "mtp-ngram", requests, after=[0, 0, 3, 7], mtp=mtp) == alone
    assert engine.draft_stats()["verifications"] > before["verifications"]
    assert engine.drafter.prior.alpha != 0.5 and engine.drafter.heads_prior.alpha != 0.5  # both sources drafted
    with pytest.raises(ValueError, match="MTP drafting needs the MTP heads"):
        engine.set_draft("mtp-ngram")
    with pytest.raises(ValueError, match="the batch engine drafts with"):  # auto is the backend's choice
        engine.set_draft("auto")


def test_a_prefix_cache_hit_after_drafting_continues_as_a_cold_run(engine):
    """Only verified tokens are cached: a follow-up whose prompt holds the drafted answer hits the cache
    (several split points: the answer cut at different lengths) and continues exactly as cold."""
    first = run(engine, "ngram", GROUNDED[:1])[0]
    text = engine.tokenizer.decode(first)
    for cut in (len(text) // 3, len(text) // 2, len(text)):
        follow = GenerationRequest(messages=GROUNDED[0].messages + [
            {"role": "assistant", "content": text[:cut]}, {"role": "user", "content": "Now say it shorter."}],
            params=SamplingParams(max_tokens=24))
        cold = run(engine, "none", [follow])[0]
        engine.set_draft("ngram")
        run_ids, cached = [], []
        engine.blocks.reset_prefix_cache()
        for _ in range(2):  # the second run hits the cache the first one filled (drafting both times)
            out = []

            def sink(ev, out=out):
                out.extend(ev.token_ids)
                if ev.type == "finish":
                    cached.append(ev.info["cached_prompt_tokens"])

            engine.submit(f"f{cut}-{len(run_ids)}", follow, sink)
            while engine.jobs or engine._commands:
                engine.step()
            run_ids.append(out)
        assert run_ids == [cold, cold]
        assert cached[0] == 0 and cached[1] >= 16


def test_drafting_is_refused_where_rows_would_round_differently(model_path):
    plain_torch = load_engine(model_path, n_ctx=256, quant="fp32", kv_budget="16MiB")
    with pytest.raises(ValueError, match="drafting needs the GGUF weights"):
        plain_torch.set_draft("ngram")


def test_preemption_and_resume_with_drafts_give_the_solo_plain_answers(model_path, engine):
    """A KV budget too small for four drafting sequences: some are preempted (blocks taken back, recomputed
    later from the prefix cache), one is parked mid-answer and resumed; every answer is its solo plain one."""
    requests = GROUNDED + [OTHER]
    alone = [run(engine, "none", [r])[0] for r in requests]
    tiny = load_engine(model_path, n_ctx=1024, kv_budget="6MiB", config=SchedulerConfig(4, 512, 256), draft="ngram")
    assert tiny.capacity < sum(len(tiny.prepare(r)) + r.params.max_tokens for r in requests)
    out = {i: [] for i in range(len(requests))}
    for i, r in enumerate(requests):
        tiny.submit(f"t{i}", r, lambda ev, i=i: out[i].extend(ev.token_ids) if ev.type == "delta" else None)
    steps, parked = 0, False
    while tiny.jobs or tiny._commands:
        tiny.step()
        steps += 1
        if steps == 12:
            tiny.park("t1")  # its client went away: blocks back at once
            parked = True
        elif parked and steps == 30:
            tiny.unpark("t1")
    assert [out[i] for i in range(len(requests))] == alone
    assert tiny.scheduler.num_preemptions > 0 and tiny.num_verifications > 0


def test_attention_head_chains_of_several_sequences_give_their_solo_answers(engine, monkeypatch):
    """--draft mtp-attn: each job drafts from its own chain of the attention head, fed every sampled token with
    its row (and nothing else: a rejected draft never enters it); greedy answers and a seeded sample are
    plain decoding's, several sequences drafting in one step."""
    drafter = shipped(engine, "attention")
    chains = []
    new_chain = drafter.new_chain
    drafter.new_chain = lambda: chains.append(new_chain()) or chains[-1]
    sample = GenerationRequest(messages=OTHER.messages, params=SamplingParams(max_tokens=40, temperature=0.8,
                                                                               top_k=40, seed=5))
    requests = GROUNDED + [OTHER, sample]
    alone = [run(engine, "none", [r])[0] for r in requests]
    log: list[int] = []
    before = engine.draft_stats()
    together = run(engine, "mtp-attn", requests, after=[0, 0, 3, 7, 7], steps_log=log, mtp=drafter, fixed_k=3)
    after = engine.draft_stats()
    assert together == alone
    proposed, accepted = (after[key] - before[key] for key in ("proposed", "accepted"))
    assert max(log) >= 2 and 0 < accepted < proposed
    # every answer token once, and the end-of-generation token that ended an answer short of its limit
    fed = [len(a) + (len(a) < r.params.max_tokens) for a, r in zip(alone, requests)]
    assert [c.n + len(c.pending) for c in chains] == fed
    # prompt lookup where the last two tokens match, else the attention head's chain, sized by the head's
    # confidence (drafted first, stopped below the planner's floor; every such chain of a step in one call):
    # the same answers
    chains.clear()
    calls, sizes, draft_many = [], [], type(drafter).draft_many

    def spy(self, chains_, ks, floor=0.0):
        out = draft_many(self, chains_, ks, floor)
        sizes.append(len(chains_))
        calls.extend((min(k, drafter.max_depth), floor, len(d)) for k, d in zip(ks, out))
        return out
    monkeypatch.setattr(type(drafter), "draft_many", spy)
    assert run(engine, "mtp-attn-ngram", requests, after=[0, 0, 3, 7, 7], mtp=drafter) == alone
    monkeypatch.setattr(type(drafter), "draft_many", draft_many)
    assert [c.n + len(c.pending) for c in chains] == fed
    assert calls and all(floor >= 0 for _, floor, _ in calls) and any(floor > 0 for _, floor, _ in calls)
    assert any(0 < made < k for k, _, made in calls) and any(made == k for k, _, made in calls)
    assert max(sizes) >= 2  # several sequences' chains in one call
    assert engine.drafter.prior.alpha != 0.5 and engine.drafter.heads_prior.alpha != 0.5  # both sources drafted
    # trees grown from each job's chain (--draft mtp-attn-tree): the accepted path's rows feed it, nothing else
    chains.clear()
    log.clear()
    before = engine.draft_stats()
    assert run(engine, "mtp-attn-tree", requests, after=[0, 0, 3, 7, 7], steps_log=log, mtp=drafter, fixed_k=7) == alone
    after = engine.draft_stats()
    assert [c.n + len(c.pending) for c in chains] == fed
    assert max(log) >= 2 and 0 < after["accepted"] - before["accepted"] < after["proposed"] - before["proposed"]
    # and with prompt lookup's chain as a branch of each tree where the last two tokens match
    chains.clear()
    lookups, grow = [], TreeDrafter.grow
    monkeypatch.setattr(TreeDrafter, "grow", lambda self, *a: lookups.append(a[5]) or grow(self, *a))
    assert run(engine, "mtp-attn-ngram-tree", requests, after=[0, 0, 3, 7, 7], mtp=drafter) == alone
    assert [c.n + len(c.pending) for c in chains] == fed
    assert any(lookups) and not all(lookups)  # trees with lookup's branch, and trees without
    assert engine.scheduler.stats()["num_running"] == 0 and not engine.jobs
    engine.blocks.check_invariants()


def test_each_draft_method_refuses_the_other_kind_of_head(engine):
    mlp, attn = shipped(engine), shipped(engine, "attention")
    with pytest.raises(ValueError, match="mtp-attn drafts with the attention head"):
        engine.set_draft("mtp-attn", mtp=mlp)
    with pytest.raises(ValueError, match="mtp-tree drafts with the MLP heads"):
        engine.set_draft("mtp-tree", mtp=attn)
    engine.set_draft("none")
