"""The offline replay of greedy verification (`edge_cli.mtp_eval`) against the engine's own drafting."""
import pytest

from edge_cli.bench.spec import Tally, _run, mt_bench_prompts
from edge_cli.mtp_eval import drafter_walk, lookup_walk, summary, walk
from edge_cli.train_attn import mt_bench_records


def test_walk_counts_what_verification_accepts():
    tokens = list(range(10))
    right = lambda i, m: tokens[i + 1:i + 1 + m]  # noqa: E731 - always right: k drafts + the bonus per step
    assert walk(tokens, right, 3) == (2, 6, [2, 2, 2], [2, 2, 2])  # 0 -> 4 -> 8, then a plain step to 9
    wrong = lambda i, m: [-1] * m  # noqa: E731 - never right: every step gives the bonus alone
    steps, acc, pos, prop = walk(tokens, wrong, 2)
    assert (steps, acc, pos) == (8, 0, [0, 0]) and prop == [8, 7]  # the last token is a plain step
    s = summary([walk(tokens, right, 3), (8, 0, [0, 0, 0], [8, 8, 7])])
    assert s["verify_steps"] == 10 and s["mean_accepted"] == pytest.approx(1 + 6 / 10)
    assert s["acceptance_per_position"] == pytest.approx([2 / 10, 2 / 10, 2 / 9])


def test_walk_replays_the_engines_mtp_drafting_exactly(native_backend, tmp_path):
    """The shipped heads on 4 MT-Bench answers: the replay's verifications and accepted drafts per position
    are the engine's own, answer by answer (greedy, k = 3, 64 tokens)."""
    from edge_runtime.spec.mtp import MtpDrafter

    drafter = MtpDrafter.for_backend(native_backend)  # first: the records carry the layers its heads read
    records = mt_bench_records(native_backend, n=4, max_tokens=64)
    for r, q in zip(records, mt_bench_prompts(4)):
        t = Tally()
        _run(native_backend, "mtp", 3, q, 64, t)
        assert t.ids[0] == r["tokens"].tolist()  # lossless: the same answer
        steps, acc, pos, prop = walk(t.ids[0], lambda i, m: drafter.propose_from(r["hidden"][i], t.ids[0][i], m), 3, 64)
        assert (steps, acc, pos, prop) == (t.verify_steps, t.accepted, t.pos_accepted[:3], t.pos_proposed[:3])
    assert drafter_walk(drafter, records, 3, 64)["verify_steps"] > 0


def test_walk_takes_a_step_without_drafts_as_plain_and_counts_short_drafts_as_proposed():
    tokens = list(range(10))
    short = lambda i, m: tokens[i + 1:i + 2] if i % 2 == 0 else []  # noqa: E731 - one right draft, or none
    steps, acc, pos, prop = walk(tokens, short, 3)
    assert (steps, acc, pos, prop) == (4, 4, [4, 0, 0], [4, 0, 0])  # 0 -> 2 -> 4 -> 6 -> 8, then a plain step


def test_lookup_walk_replays_the_engines_mtp_ngram_drafting_exactly(native_backend):
    """The heads with prompt lookup on 4 MT-Bench answers: the replay's verifications and accepted drafts per
    position are the engine's own, answer by answer (greedy, k = 3, 64 tokens)."""
    from edge_cli.mtp_data import _prompt
    from edge_runtime.spec.mtp import MtpDrafter

    drafter = MtpDrafter.for_backend(native_backend)
    records = mt_bench_records(native_backend, n=4, max_tokens=64)
    prompts = [_prompt(native_backend, [{"role": "user", "content": q}], 64) for q in mt_bench_prompts(4)]
    total = Tally()
    for r, q, ids in zip(records, mt_bench_prompts(4), prompts):
        t = Tally()
        _run(native_backend, "mtp-ngram", 3, q, 64, t)
        _run(native_backend, "mtp-ngram", 3, q, 64, total)
        assert t.ids[0] == r["tokens"].tolist()
        s = lookup_walk(drafter, [r], [ids], 3, 64)
        assert s["verify_steps"] == t.verify_steps
        assert s["mean_accepted"] == pytest.approx(1 + t.accepted / t.verify_steps)
        assert s["acceptance_per_position"] == pytest.approx([a / p for a, p in zip(t.pos_accepted, t.pos_proposed) if p])
    both = lookup_walk(drafter, records, prompts, 3, 64)
    assert both["verify_steps"] == total.verify_steps and both["mean_accepted"] > drafter_walk(drafter, records, 3, 64)["mean_accepted"]
