"""The committed draft-head runs (`train-mtp --json`, MLP and attention heads) and the bench spec runs made with
the heads they wrote: every figure recomputed from what the file stores (chain accuracy, tokens and time),
each run measured against the heads shipped before it, the shipped head files carrying their run's figures,
and the README's reading of each run on the report page."""
from __future__ import annotations

import json
import os

import pytest

pytest.importorskip("matplotlib")

from tests.edge_cli.bench.report_files import REPO, _json  # noqa: E402


def _check_heads_run(run: dict) -> None:
    """A `train-mtp --json` run's figures recomputed: each head's tokens per verification from its chain accuracy
    (the replayed figure below the estimate's bound), and the generation rate from its tokens and time."""
    from edge_cli.train_mtp import expected_accepted

    for h in (*run["curve"], run["mlp_shipped_before"]):
        assert h["expected_accepted_k3"] == pytest.approx(expected_accepted(h["chain_accuracy"], 3), abs=1e-9)
        assert 1 <= h["mean_accepted_k3"] <= 4 and len(h["acceptance_per_position"]) == 3
    gen = run["generation"]
    assert gen["answer_tokens"] == run["curve"][-1]["train_answer_tokens"]
    assert gen["tokens_per_s"] == pytest.approx(gen["answer_tokens"] / gen["seconds"])


def test_the_draft_heads_figures_follow_from_their_chain_accuracy(committed):
    """bench-results/mtp-heads.json (`train-mtp --arch attention --curve ...`): every tokens-per-verification
    figure is recomputed from its chain accuracy, the curve ends at the whole dataset, and the page shows it."""
    from edge_cli.train_mtp import expected_accepted

    page, sections, _ = committed
    d = _json("mtp-heads.json")
    heads = [d["mlp_shipped"], d["attention"], *d["curve"]]
    for h in heads:
        assert len(h["chain_accuracy"]) == 4 and all(0 <= a <= 1 for a in h["chain_accuracy"])
        assert h["expected_accepted_k3"] == pytest.approx(expected_accepted(h["chain_accuracy"], 3), abs=1e-9)
    tokens = [c["train_answer_tokens"] for c in d["curve"]]
    assert len(tokens) >= 3 and tokens == sorted(tokens) and tokens[-1] == d["train_answer_tokens"]
    assert d["curve"][-1]["chain_accuracy"] == d["attention"]["chain_accuracy"]
    assert any(s.kind == "mtp-heads" for s in sections)
    assert f"{d['attention']['expected_accepted_k3']:.3g}" in page


def test_the_mlp_heads_curve_follows_from_its_chain_accuracy(committed):
    """bench-results/mtp-train-curve.json (`train-mtp --prompt-set large --curve ... --json`): every
    tokens-per-verification figure is recomputed from its chain accuracy, the generation rate from its tokens
    and time, the curve has at least three points ending at all the data, and the page shows it."""
    from edge_cli.train_mtp import expected_accepted

    page, sections, _ = committed
    d = _json("mtp-train-curve.json")
    for h in (*d["curve"], d["mlp_shipped_before"]):
        assert len(h["chain_accuracy"]) == 4 and all(0 <= a <= 1 for a in h["chain_accuracy"])
        assert h["expected_accepted_k3"] == pytest.approx(expected_accepted(h["chain_accuracy"], 3), abs=1e-9)
    tokens = [c["train_answer_tokens"] for c in d["curve"]]
    gen = d["generation"]
    assert len(tokens) >= 3 and tokens == sorted(tokens) and tokens[-1] == gen["answer_tokens"]
    assert gen["tokens_per_s"] == pytest.approx(gen["answer_tokens"] / gen["seconds"])
    assert any(s.kind == "mtp-curve" for s in sections)
    for h in d["curve"]:  # the replayed walk (test_mtp recomputes the shipped heads' from the file)
        assert 1 <= h["mean_accepted_k3"] <= 4 and len(h["acceptance_per_position"]) == 3
        assert h["mean_accepted_k3"] < h["expected_accepted_k3"]  # the estimate overstates
    assert f"{d['curve'][-1]['mean_accepted_k3']:.3g}" in page


def test_the_tapped_heads_figures_follow_from_their_chain_accuracy(committed):
    """bench-results/mtp-train-taps.json (`train-mtp --taps 20,26 --epochs 2 --curve 2000 --json`, soft loss) and
    mtp-train-taps-4ep.json (the same data, 4 epochs): each figure recomputed from its chain accuracy; the
    4-epoch run (the heads shipped until the written prompts' below) measured the 2-epoch heads it replaced
    (the 2-epoch run's last point) on the same answers; the page shows both."""
    from edge_cli.train_mtp import expected_accepted

    page, sections, _ = committed
    d, d4 = _json("mtp-train-taps.json"), _json("mtp-train-taps-4ep.json")
    for run in (d, d4):
        assert run["taps"] == [20, 26] and run["loss"] == "soft" and run["arch"] == "mlp"
        for h in (*run["curve"], run["mlp_shipped_before"]):
            assert len(h["chain_accuracy"]) == 4 and all(0 <= a <= 1 for a in h["chain_accuracy"])
            assert h["expected_accepted_k3"] == pytest.approx(expected_accepted(h["chain_accuracy"], 3), abs=1e-9)
            assert 1 <= h["mean_accepted_k3"] <= 4 and len(h["acceptance_per_position"]) == 3
        assert f"{run['curve'][-1]['mean_accepted_k3']:.3g}" in page
    tokens = [c["train_answer_tokens"] for c in d["curve"]]
    assert len(tokens) >= 2 and tokens == sorted(tokens) and tokens[-1] == d["generation"]["answer_tokens"]
    assert d4["curve"][-1]["train_answer_tokens"] == tokens[-1]  # the same data, twice the epochs
    # the heads it replaced, replayed on the same MT-Bench answers, measure what they measured when written
    assert d4["mlp_shipped_before"]["mean_accepted_k3"] == pytest.approx(d["curve"][-1]["mean_accepted_k3"], abs=0.005)
    assert any(s.kind == "mtp-curve" and "taps 20,26" in s.title for s in sections)


def test_the_heads_of_two_and_a_half_million_tokens_are_measured_against_the_shipped_ones(committed):
    """bench-results/mtp-train-taps-large.json (`train-mtp --prompt-set large --prompts 0 --taps 20,26 --shards 71
    --epochs 2 --precision bf16 --json`): its figures recomputed from their chain accuracy and its generation
    rate from its tokens and time; it measured the shipped heads (the 4-epoch run's) on the same MT-Bench answers
    as that run did, trained on more than twice their tokens, and the page shows it."""
    from edge_cli.train_mtp import expected_accepted

    page, sections, _ = committed
    d, d4 = _json("mtp-train-taps-large.json"), _json("mtp-train-taps-4ep.json")
    assert d["taps"] == [20, 26] and d["loss"] == "soft" and d["precision"] == "bf16" and d["epochs"] == 2
    for h in (*d["curve"], d["mlp_shipped_before"]):
        assert h["expected_accepted_k3"] == pytest.approx(expected_accepted(h["chain_accuracy"], 3), abs=1e-9)
        assert 1 <= h["mean_accepted_k3"] <= 4 and len(h["acceptance_per_position"]) == 3
    # the shipped heads (saved in fp16) replayed on the same answers measure what they measured when trained
    assert d["mlp_shipped_before"]["mean_accepted_k3"] == pytest.approx(d4["curve"][-1]["mean_accepted_k3"], abs=0.005)
    gen = d["generation"]
    assert gen["shards"] == 71 and gen["answers"] == 71 * 256  # 71 whole shards of 256 answers
    assert gen["answer_tokens"] == d["curve"][-1]["train_answer_tokens"] > 2 * d4["curve"][-1]["train_answer_tokens"]
    assert gen["tokens_per_s"] == pytest.approx(gen["answer_tokens"] / gen["seconds"])
    assert any(s.kind == "mtp-curve" and "bf16" in s.title for s in sections)
    assert f"{d['curve'][-1]['mean_accepted_k3']:.3g}" in page


def test_the_written_prompts_curve_follows_from_its_chain_accuracy(committed):
    """bench-results/mtp-train-written-8-shards.json, mtp-train-written.json and mtp-train-written-4080.json
    (`train-mtp --prompt-set written --taps 20,26 --epochs 2 --json`, half of round 1, round 1, rounds 1 and 2):
    each figure recomputed from its chain accuracy and its generation rate from its tokens and time; all three
    measured the heads shipped before them (the 4-epoch templated ones) on the same MT-Bench answers, so their
    points compare, and the page shows each."""
    page, _, _ = committed
    runs = [_json(f"mtp-train-written{s}.json") for s in ("-8-shards", "", "-4080")]
    d4 = _json("mtp-train-taps-4ep.json")
    points = []
    for run in runs:
        assert run["taps"] == [20, 26] and run["loss"] == "soft" and run["epochs"] == 2 and run["precision"] == "fp32"
        _check_heads_run(run)
        # the same 80 MT-Bench answers and the same heads shipped before, replayed: what the 4-epoch run measured
        assert run["mt_bench_answers"] == 80 and run["mt_bench_answer_tokens"] == runs[0]["mt_bench_answer_tokens"]
        assert run["mlp_shipped_before"]["mean_accepted_k3"] == pytest.approx(d4["curve"][-1]["mean_accepted_k3"],
                                                                               abs=0.005)
        points.append((run["generation"]["answer_tokens"], run["curve"][-1]["mean_accepted_k3"]))
        assert f"{run['curve'][-1]['mean_accepted_k3']:.3g}" in page
    assert [p[0] for p in points] == sorted(p[0] for p in points)  # the curve's three data sizes, growing
    assert [r["generation"]["prompts"] for r in runs] == [2040, 2040, 4080]


def _check_shipped(run: dict, spec_file: str, native_backend) -> None:
    """The shipped heads came from `run` (their metadata carries its point) and `bench spec` with them
    (`spec_file`) verifies in the engine what the run's replay said, within 0.005."""
    from edge_runtime.spec.mtp import MtpHead, find_heads

    last = run["curve"][-1]
    head, meta = MtpHead.load(find_heads(native_backend))
    training = json.loads(meta["training"])
    assert head.taps == tuple(run["taps"]) and training["taps"] == run["taps"] and training["loss"] == run["loss"]
    assert training["epochs"] == run["epochs"] and training["precision"] == run["precision"]
    assert training["prompts"] == run["generation"]["prompts"]
    assert training["mt_bench_tokens_per_verification_k3"] == round(last["mean_accepted_k3"], 4)
    assert training["held_out_chain_accuracy"] == last["held_out_chain_accuracy"]
    spec = _json(spec_file)
    assert spec["mtp.mean_accepted"] == pytest.approx(last["mean_accepted_k3"], abs=0.005)
    assert spec["mtp.acceptance_per_position"] == pytest.approx(last["acceptance_per_position"], abs=0.005)


def test_the_round_three_and_four_runs_each_beat_the_heads_before_them_and_the_last_made_the_shipped_ones(
        committed, native_backend):
    """bench-results/mtp-train-written-6120.json and -8160.json (`train-mtp --prompt-set written --prompts 0
    --taps 20,26 --epochs 2 --precision bf16 --json`, rounds 1-3 and 1-4): their figures recomputed from their
    chain accuracy and their generation rates from tokens and time; each measured the heads shipped before it
    (the 4,080-prompt run's, then the 6,120-prompt run's) on the same MT-Bench answers over fp32 states (the
    4,080-prompt run replayed fp16 ones: within 0.005), on more tokens, and beat them; the 8,160-prompt run
    wrote the shipped heads, and bench spec with the 6,120-prompt heads (spec-zen4-heads-6120.json) measured
    in the engine what their replay said."""
    page, _, _ = committed
    d2, d3, d4 = (_json(f"mtp-train-written-{n}.json") for n in (4080, 6120, 8160))
    for before, d, prompts in ((d2, d3, 6120), (d3, d4, 8160)):
        assert d["taps"] == [20, 26] and d["loss"] == "soft" and d["epochs"] == 2 and d["precision"] == "bf16"
        _check_heads_run(d)
        gen = d["generation"]
        assert gen["prompts"] == prompts and gen["answers"] == 2 * prompts
        assert gen["answer_tokens"] > before["generation"]["answer_tokens"]
        assert d["mlp_shipped_before"]["mean_accepted_k3"] == pytest.approx(before["curve"][-1]["mean_accepted_k3"],
                                                                             abs=0.005)
        last = d["curve"][-1]
        assert f"{last['mean_accepted_k3']:.3g}" in page
        assert last["mean_accepted_k3"] > d["mlp_shipped_before"]["mean_accepted_k3"]
    spec = _json("spec-zen4-heads-6120.json")
    assert spec["mtp.mean_accepted"] == pytest.approx(d3["curve"][-1]["mean_accepted_k3"], abs=0.005)
    _check_shipped(d4, "spec-zen4-heads-8160.json", native_backend)


def test_the_round_five_run_drafts_no_better_than_the_shipped_heads(committed):
    """bench-results/mtp-train-written-10200.json (rounds 1-5, the shipped recipe on 1.25 times the tokens): its
    figures recomputed, the heads shipped before (round 4's) replayed on the same MT-Bench answers, and the
    README's reading of it, that the curve's step did not show (within 0.005 of the shipped heads)."""
    page, _, _ = committed
    d4, d5 = _json("mtp-train-written-8160.json"), _json("mtp-train-written-10200.json")
    assert d5["taps"] == [20, 26] and d5["loss"] == "soft" and d5["epochs"] == 2 and d5["precision"] == "bf16"
    _check_heads_run(d5)
    gen = d5["generation"]
    assert gen["prompts"] == 10200 and gen["answers"] == 20400
    assert gen["answer_tokens"] > d4["generation"]["answer_tokens"]
    shipped = d5["mlp_shipped_before"]["mean_accepted_k3"]
    assert shipped == pytest.approx(d4["curve"][-1]["mean_accepted_k3"], abs=0.005)
    last = d5["curve"][-1]
    assert f"{last['mean_accepted_k3']:.3g}" in page
    assert abs(last["mean_accepted_k3"] - shipped) < 0.005


def test_the_wider_heads_draft_more_but_run_slower_than_the_shipped_ones(committed):
    """bench-results/mtp-train-written-10200-h2048.json (round 5's run at SwiGLU width 2048) and the two bench spec
    runs the README reads (the wide heads, then the shipped ones straight after): the wide heads beat the same
    data at width 1024 offline and verify more tokens in the engine, chains and trees, yet chains run at a lower
    speedup over plain in their run than the shipped heads in theirs; every answer identical to plain."""
    page, _, _ = committed
    d5, wide = _json("mtp-train-written-10200.json"), _json("mtp-train-written-10200-h2048.json")
    _check_heads_run(wide)
    assert wide["generation"]["answer_tokens"] == d5["generation"]["answer_tokens"]
    assert wide["curve"][-1]["mean_accepted_k3"] > d5["curve"][-1]["mean_accepted_k3"]
    assert f"{wide['curve'][-1]['mean_accepted_k3']:.3g}" in page
    w, c = _json("spec-zen4-heads-h2048.json"), _json("spec-zen4-heads-8160-control.json")
    assert w["lossless"] and c["lossless"]
    assert w["mtp.mean_accepted"] > c["mtp.mean_accepted"] and w["mtp.tree_mean_accepted"] > c["mtp.tree_mean_accepted"]
    assert w["mtp.k3.speedup_over_plain"] < c["mtp.k3.speedup_over_plain"]
    assert w["mtp.speedup_over_plain"] < c["mtp.speedup_over_plain"]
    for run in (w, c):  # the ratios recomputed from the rates
        mt = run["mt_bench"]
        assert run["mtp.k3.speedup_over_plain"] == pytest.approx(mt["native_mtp_k3"]["tok_s"] / mt["native_plain"]["tok_s"],
                                                                 abs=0.001)


def test_the_attention_head_with_the_mlp_recipe_outdrafts_the_mlp_heads_offline(committed):
    """bench-results/mtp-attention-written.json (`train-mtp --arch attention --prompt-set written --prompts 10200
    --taps 20,26 --epochs 2 --precision bf16 --curve 2040,4080 --json`, stopped after its second point: the JSON is
    written after each point): every figure recomputed from its chain accuracy; the recipe is the MLP heads'
    (windows of 16 starts, soft loss, taps); the shipped heads replayed in it measure what round 5's run measured
    on the same MT-Bench answers; and the attention head trained on the answers to the first 4,080 prompts drafts
    more than the MLP heads trained on those prompts' answers and than the shipped ones (twice its data)."""
    from edge_cli.train_mtp import expected_accepted

    page, sections, _ = committed
    d, d5, m4 = _json("mtp-attention-written.json"), _json("mtp-train-written-10200.json"), _json("mtp-train-written-4080.json")
    att = d["attention"]
    assert att["loss"] == "soft" and att["window"] == 16 and att["batch"] == 16 and att["taps"] == [20, 26]
    assert att["precision"] == "bf16" and att["epochs"][-1]["epoch"] == 2
    for h in (d["mlp_shipped"], att, *d["curve"]):
        assert len(h["chain_accuracy"]) == 4 and all(0 <= a <= 1 for a in h["chain_accuracy"])
        assert h["expected_accepted_k3"] == pytest.approx(expected_accepted(h["chain_accuracy"], 3), abs=1e-9)
        assert 1 <= h["mean_accepted_k3"] <= 4 and len(h["acceptance_per_position"]) == 3
    curve = d["curve"]
    assert [c["prompts"] for c in curve] == [2040, 4080] and d["points_planned"] == 3  # the 3 M point: not run
    assert curve[0]["train_answer_tokens"] < curve[1]["train_answer_tokens"] < d["train_answer_tokens"]
    assert curve[-1]["chain_accuracy"] == att["chain_accuracy"] and curve[-1]["mean_accepted_k3"] == att["mean_accepted_k3"]
    assert d["train_answer_tokens"] == d5["generation"]["answer_tokens"]  # the same folder as round 5's run
    assert d["mlp_shipped"]["mean_accepted_k3"] == pytest.approx(d5["mlp_shipped_before"]["mean_accepted_k3"], abs=0.005)
    mlp4 = m4["curve"][-1]  # the MLP heads on rounds 1 and 2 (their own folder: within 0.1 % of the tokens)
    assert curve[-1]["train_answer_tokens"] == pytest.approx(mlp4["train_answer_tokens"], rel=1e-3)
    assert curve[-1]["mean_accepted_k3"] > d["mlp_shipped"]["mean_accepted_k3"] > mlp4["mean_accepted_k3"]
    assert any(s.kind == "mtp-heads" and "windows of 16" in s.title for s in sections)
    assert f"{att['mean_accepted_k3']:.3g}" in page


SHIPPED_ATTENTION = ("mtp-attention-written-12240-t3.json", "spec-zen4-attn-5m.json")  # the run that wrote it, bench spec's


def test_the_shipped_attention_head_is_its_runs_and_drafts_in_the_engine_what_that_run_replayed(committed):
    """edge_runtime/data/mtp/<model>.attn.safetensors carries the figures of the run that wrote it (its JSON's
    last point, recomputed from chain accuracy), and `bench spec` with it verifies at k = 3 in the engine what
    that run's replay over the same MT-Bench answers said, within 0.005, position by position."""
    from edge_cli.train_mtp import expected_accepted
    from edge_runtime.spec.attn_head import AttnDraftHead

    page, _, _ = committed
    run, spec = (_json(name) for name in SHIPPED_ATTENTION)
    last = run["curve"][-1]
    assert last["expected_accepted_k3"] == pytest.approx(expected_accepted(last["chain_accuracy"], 3), abs=1e-9)
    path = os.path.join(REPO, "edge_runtime", "data", "mtp", "SmolLM2-135M-Instruct.Q4_1.attn.safetensors")
    head, meta = AttnDraftHead.load(path)
    training = json.loads(meta["training"])
    assert training["mean_accepted_k3"] == last["mean_accepted_k3"] and head.taps == tuple(run["attention"]["taps"])
    assert training["chain_accuracy"] == last["chain_accuracy"] and training["epochs"] == run["attention"]["epochs"]
    assert spec["lossless"] and spec["mtp_attn.mean_accepted"] == pytest.approx(last["mean_accepted_k3"], abs=0.005)
    assert spec["mtp_attn.acceptance_per_position"] == pytest.approx(last["acceptance_per_position"], abs=0.005)
    assert f"{last['mean_accepted_k3']:.3f}" in page
