"""The difficulty score, its calibration, the confidence monitor, the labelled set and `calibrate-router`."""
import argparse
import json
import math

import numpy as np
import pytest

from edge_cli import router as cli_router

from edge_runtime.hybrid import difficulty
from edge_runtime.hybrid.difficulty import (CATEGORY_RULES, Calibration, ConfidenceMonitor, TripAt, answer_matches, auroc,
                                     calibrate, load_calibration, load_prompts, prompt_features, relabel,
                                     score_from_confidences, score_prompts, window_threshold_for, windowed_means)
from edge_runtime.errors import EdgeRuntimeError, InvalidRequestError
from edge_runtime.hybrid.logistic_probe import LogisticProbe
from edge_runtime.request import GenerationRequest, SamplingParams, StreamEvent


def conf(entropy=0.5, margin=0.5):
    return {"entropy": entropy, "margin": margin}


def cal(**kw):
    base = dict(threshold=0.5, target_cloud_share=0.3, k=3, window=4, window_threshold=2.0)
    return Calibration(**{**base, **kw})


def probe_cal(**kw):
    """A probe on 3 features that reads only the first: score = sigmoid(x0)."""
    probe = LogisticProbe([0.0, 0.0, 0.0], [1.0, 1.0, 1.0], [1.0, 0.0, 0.0], 0.0, 1.0)
    return cal(kind="probe", probe=probe, probe_threshold=0.5, **kw)


def separable_hidden(n=60, d=40, seed=0):
    rng = np.random.default_rng(seed)
    y = rng.random(n) < 0.5
    h = rng.normal(size=(n, d))
    h[:, :4] += np.where(y, 2.0, -2.0)[:, None]
    return h, y


# --- score, AUROC, calibrate -------------------------------------------------------------------------------

def test_score_is_one_minus_mean_margin():
    assert score_from_confidences([conf(margin=0.2), conf(margin=0.6)]) == pytest.approx(0.6)
    assert score_from_confidences([conf(entropy=9.0, margin=1.0)]) == 0.0
    with pytest.raises(ValueError):
        score_from_confidences([])


@pytest.mark.parametrize("pos,neg,expected", [
    ([3, 4, 5], [0, 1, 2], 1.0),
    ([0, 1, 2], [3, 4, 5], 0.0),
    ([1, 1, 1], [1, 1], 0.5),
    ([1, 2], [0, 2], 0.625),  # 1>0, 1<2, 2>0, 2=2 (one half): 2.5 of 4 pairs
])
def test_auroc_known_cases(pos, neg, expected):
    scores = pos + neg
    labels = [True] * len(pos) + [False] * len(neg)
    assert auroc(scores, labels) == pytest.approx(expected)
    order = np.random.default_rng(0).permutation(len(scores))  # order does not matter
    assert auroc(np.array(scores)[order], np.array(labels)[order]) == pytest.approx(expected)


def test_auroc_needs_both_classes():
    with pytest.raises(ValueError):
        auroc([1, 2, 3], [True, True, True])


@pytest.mark.parametrize("share", [0.1, 0.25, 0.3, 0.5, 0.8])
def test_calibrate_threshold_gives_the_target_share(share):
    scores = np.random.default_rng(1).permutation(np.linspace(0.0, 1.0, 200))
    labels = scores > 0.6
    c = calibrate(list(scores), list(labels), share, k=3, model="m.gguf")
    assert (scores > c.threshold).sum() == round(share * 200)
    assert c.achieved_share == pytest.approx(share)
    assert c.threshold == pytest.approx(np.quantile(scores, 1 - share))
    assert c.auroc == 1.0 and c.n_prompts == 200 and c.k == 3 and c.model == "m.gguf"
    assert c.agreement == pytest.approx(1 - abs(share - 0.4))  # 40 % are labelled hard; the rest are misrouted


def test_calibrate_rejects_bad_input():
    with pytest.raises(ValueError):
        calibrate([0.1, 0.2], [True, False], 1.0)
    with pytest.raises(ValueError):
        calibrate([0.1, 0.2], [True], 0.3)


def test_calibration_json_round_trip(tmp_path):
    c = calibrate([0.1, 0.5, 0.9, 0.7], [False, True, True, False], 0.25, window_threshold=3.5, model="x.gguf")
    again = Calibration.from_json(c.to_json())
    assert again == c
    path = c.save(str(tmp_path / "c.json"))
    assert load_calibration(path) == c
    data = json.loads(c.to_json())
    data["from_the_future"] = 1  # unknown keys are ignored
    assert Calibration.from_json(json.dumps(data)) == c
    with pytest.raises(ValueError):
        cal(target_cloud_share=0.0)
    with pytest.raises(ValueError):
        cal(kind="probe")  # without a probe
    with pytest.raises(ValueError):
        cal(kind="guess")


def test_calibrate_fits_a_probe_on_hidden_states_and_round_trips(tmp_path):
    h, y = separable_hidden()
    margins = np.random.default_rng(5).random(y.size)  # an uninformative margin score
    c = calibrate(list(margins), list(y), 0.3, hidden=h, cv_folds=5, model="m.gguf")
    assert c.kind == "probe" and c.probe.num_features == 40 and c.cv_folds == 5
    # a 30 % share with half the prompts hard: at best 80 % agreement
    assert c.probe_auroc == 1.0 and c.cv_auroc > 0.95 and c.cv_agreement >= 0.7 and 0 < c.cv_share <= 0.35
    assert c.auroc == pytest.approx(auroc(margins, y))  # the fallback's own figures
    assert 0 < c.probe_threshold < 1 and c.probe_share == pytest.approx(0.3, abs=1 / 60)
    assert c.probe_share == pytest.approx(np.mean(c.probe.score(h) > c.probe_threshold))
    again = Calibration.from_json(c.to_json())
    assert again == c and isinstance(again.probe, LogisticProbe)
    assert load_calibration(c.save(str(tmp_path / "c.json"))) == c
    assert len(c.to_json().splitlines()) < 60  # a vector per line, not a float per line
    margin_only = Calibration.from_json(calibrate(list(margins), list(y), 0.3).to_json())
    assert margin_only.kind == "margin" and margin_only.probe is None
    with pytest.raises(ValueError):
        calibrate(list(margins), list(y), 0.3, hidden=h[:10])


# --- the monitor -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("margin,trips", [(0.3, True), (0.5, False), (0.9, False)])
def test_monitor_trips_at_token_k_only_when_the_score_is_over_the_threshold(margin, trips):
    m = cal(threshold=0.5, k=3, window_threshold=math.inf).monitor()
    assert m.push(conf(margin=margin)) is None and m.push(conf(margin=margin)) is None  # tokens 1, 2: too early
    reason = m.push(conf(margin=margin))  # token 3 = k: score 1 - margin
    if trips:
        assert reason is not None and "after 3 tokens" in reason and "30% cloud share" in reason
        assert m.tripped == reason and m.tripped_at == 2
    else:
        assert reason is None and m.tripped is None
    assert all(m.push(conf(margin=0.0)) is None for _ in range(20))  # past k the score is never checked again


def test_monitor_windowed_trip():
    m = cal(threshold=0.5, k=2, window=4, window_threshold=2.0).monitor()
    got = [m.push(conf(entropy=e, margin=0.9)) for e in [9.0, 9.0]]  # high entropy, but a confident margin: no trip
    assert got == [None, None]
    got = [m.push(conf(entropy=e, margin=0.9)) for e in [0.0, 0.0, 0.0, 0.0]]
    # token 3: no full window yet; token 4: (9 + 9 + 0 + 0) / 4 = 4.5 > 2.0
    assert got[0] is None and got[1] is not None and "over the last 4 tokens" in got[1] and m.tripped_at == 3


def test_monitor_windowed_trip_after_calm_start():
    m = cal(threshold=0.5, k=2, window=4, window_threshold=2.0).monitor()
    entropies = [0.1] * 10 + [2.5, 2.5, 2.5, 2.5, 2.5]
    got = [m.push(conf(entropy=e, margin=0.9)) for e in entropies]
    # mean of the last 4: ... token 13 -> (0.1 + 7.5)/4 = 1.9, token 14 -> 2.5 > 2.0
    assert [i for i, r in enumerate(got) if r] == [13] and m.tripped_at == 13
    assert "2.50 > 2.00" in got[13] and "token 14" in got[13]


def test_monitor_exact_window_threshold_does_not_trip():
    m = cal(k=1, window=2, window_threshold=2.0).monitor()
    assert [m.push(conf(entropy=2.0, margin=0.9)) for _ in range(10)] == [None] * 10


def test_monitor_trips_at_most_once():
    m = cal(threshold=0.5, k=1, window=2, window_threshold=1.0).monitor()
    first = m.push(conf(entropy=5.0, margin=0.0))
    assert first is not None
    assert [m.push(conf(entropy=5.0, margin=0.0)) for _ in range(10)] == [None] * 10
    assert m.tripped == first and m.tripped_at == 0 and m.num_tokens == 11


def test_monitor_ignores_deltas_without_a_token():
    m = cal(threshold=0.5, k=2).monitor()
    assert m.push({}) is None and m.push(conf(margin=0.0)) is None and m.push({}) is None
    assert m.push(conf(margin=0.0)) is not None and m.tripped_at == 1


@pytest.mark.parametrize("x0,trips", [(2.0, True), (-2.0, False)])
def test_monitor_uses_the_probe_on_the_first_token_when_it_carries_hidden(x0, trips):
    m = probe_cal(threshold=0.0, k=3, window_threshold=math.inf).monitor()  # the margin rule would always trip
    reason = m.push({**conf(margin=0.9), "hidden": [x0, 5.0, -5.0]})
    assert m.scorer == "probe" and m.score == pytest.approx(1 / (1 + math.exp(-x0)))
    if trips:
        assert reason is not None and "prompt probe" in reason and m.tripped_at == 0
    else:
        assert reason is None
        assert all(m.push(conf(margin=0.0)) is None for _ in range(10))  # the probe decided: no margin check at k
        assert m.scorer == "probe" and m.tripped is None


@pytest.mark.parametrize("calibration,first", [
    (probe_cal(threshold=0.5, k=2), conf(margin=0.1)),  # no hidden (llama.cpp): the margin score decides
    (probe_cal(threshold=0.5, k=2), {**conf(margin=0.1), "hidden": [9.0] * 5}),  # another model's width
    (cal(threshold=0.5, k=2), {**conf(margin=0.1), "hidden": [9.0, 0.0, 0.0]}),  # a margin calibration
])
def test_monitor_falls_back_to_the_margin_score(calibration, first):
    m = calibration.monitor()
    assert m.push(first) is None and m.scorer is None
    reason = m.push(conf(margin=0.1))  # token k = 2: 1 - 0.1 = 0.9 > 0.5
    assert reason is not None and "after 2 tokens" in reason
    assert m.scorer == "margin" and m.score == pytest.approx(0.9) and m.tripped_at == 1


def test_monitor_probe_then_window():
    m = probe_cal(k=2, window=4, window_threshold=2.0).monitor()
    assert m.push({**conf(entropy=0.0), "hidden": [-3.0, 0.0, 0.0]}) is None  # easy by the probe
    got = [m.push(conf(entropy=5.0, margin=0.0)) for _ in range(4)]
    assert got[:2] == [None, None] and got[2] is not None and "confidence collapsed" in got[2]


@pytest.mark.parametrize("index", [0, 1, 5])
def test_trip_at_trips_at_the_given_index_once(index):
    t = TripAt(index, reason="because")
    got = [t.push(conf()) for _ in range(10)]
    assert [i for i, r in enumerate(got) if r] == [index] and got[index] == "because"
    assert t.tripped == "because" and t.tripped_at == index
    with pytest.raises(ValueError):
        TripAt(-1)


def test_window_threshold_for_lets_the_target_share_trip():
    rng = np.random.default_rng(2)
    answers = [[conf(entropy=float(e)) for e in rng.gamma(2.0, 0.5 + i / 100, size=40)] for i in range(100)]
    answers += [[conf(entropy=50.0)] * 3] * 20  # shorter than a window: never trips, whatever its entropy
    th, share = window_threshold_for(answers, window=8, k=2, trip_share=0.05)
    peaks = [windowed_means([c["entropy"] for c in a], 8).max() if len(a) >= 8 else 0.0 for a in answers]
    assert share == pytest.approx(np.mean(np.array(peaks) > th)) and 0.03 <= share <= 0.05
    for a in answers:  # the monitor agrees: an answer trips iff its peak is over the threshold
        m = cal(threshold=1.0, k=2, window=8, window_threshold=th).monitor()
        tripped = any(m.push(c) for c in a)
        assert tripped == (len(a) >= 8 and windowed_means([c["entropy"] for c in a], 8).max() > th)


# --- answers and the labelled set --------------------------------------------------------------------------

@pytest.mark.parametrize("ref,text,ok", [
    ("42", "The answer is 42.", True), ("42", "It is 420.", False), ("42", "about 4.2 or 142", False),
    ("10063", "347 * 29 = 10,063", True), ("Brasilia", "Brasília is the capital.", True),
    ("Rome", "Romeo and Juliet", False), ("5|five", "It is five.", True), ("37.8", "37.8 °C", True),
    ("37.8", "37.85", False), ("7/8", "the sum is 7/8.", True), ("H2SO4", "formula h2so4", True),
])
def test_answer_matches(ref, text, ok):
    assert answer_matches(ref, text) is ok


def test_the_labelled_set_is_well_formed():
    rows = load_prompts()
    assert 150 <= len(rows) <= 200
    assert len({r["id"] for r in rows}) == len(rows)
    for r in rows:
        assert set(r) <= {"id", "prompt", "category", "label", "answer", "label_source"}, r
        assert r["label"] in ("easy", "hard") and r["prompt"].strip(), r
        if r["label_source"] == "checked":
            assert r.get("answer"), r
            assert not answer_matches(r["answer"], r["prompt"]), r  # the prompt itself must not pass the check
        else:
            assert r["label_source"] == "rule" and "answer" not in r, r
            assert r["label"] == CATEGORY_RULES[r["category"]], r
    hard = np.mean([r["label"] == "hard" for r in rows])
    assert 0.4 <= hard <= 0.6
    for source in ("rule", "checked"):
        assert {r["label"] for r in rows if r["label_source"] == source} == {"easy", "hard"}


def test_the_packaged_calibration_loads_and_meets_its_target():
    c = load_calibration()
    assert c.n_prompts == len(load_prompts())
    assert abs(c.achieved_share - c.target_cloud_share) <= 0.02
    assert 0 <= c.threshold <= 1 and 0 <= c.auroc <= 1 and 0 <= c.agreement <= 1
    assert c.kind == "probe" and c.probe is not None and 0 < c.probe_threshold < 1
    assert abs(c.probe_share - c.target_cloud_share) <= 0.02
    assert c.cv_folds >= 2 and 0.5 < c.cv_auroc <= c.probe_auroc and abs(c.cv_share - c.target_cloud_share) <= 0.1
    assert math.isfinite(c.window_threshold) and c.window_threshold > 0 and c.window_trip_share <= 0.1
    assert c.model.endswith(".gguf") and c.created
    assert isinstance(c.monitor(), ConfidenceMonitor)


# --- relabel and the command, with a scripted backend ------------------------------------------------------

class ScriptedBackend:
    """Answers each prompt with a fixed text, one token per character, with a margin set per prompt."""

    path = "/models/scripted.gguf"

    def __init__(self, answers, hidden=None):
        self.answers = answers  # prompt -> (text, margin)
        self.hidden = hidden  # prompt -> its hidden state (on the first delta), like the native backend

    def stream_sync(self, request):
        prompt = request.messages[-1]["content"]
        text, margin = self.answers[prompt]
        yield StreamEvent("start")
        for i, ch in enumerate(text[:request.params.max_tokens]):
            info = conf(entropy=1 - margin, margin=margin) if request.confidence else {}
            if i == 0 and info and self.hidden is not None:
                info["hidden"] = self.hidden[prompt]
            yield StreamEvent("delta", seq=i, text=ch, token_ids=[i], info=info)
        yield StreamEvent("finish", finish_reason="length")


ROWS = [
    {"id": "a", "prompt": "2+2?", "category": "arithmetic", "label": "hard", "answer": "4", "label_source": "checked"},
    {"id": "b", "prompt": "9*9?", "category": "arithmetic", "label": "easy", "answer": "81", "label_source": "checked"},
    {"id": "c", "prompt": "Hi", "category": "greeting", "label": "hard", "label_source": "rule"},
    {"id": "d", "prompt": "Code", "category": "code", "label": "easy", "label_source": "rule"},
]
ANSWERS = {"2+2?": ("it is 4", 0.9), "9*9?": ("it is 80", 0.1), "Hi": ("hello there", 0.8), "Code": ("def f", 0.2)}


def test_relabel_checks_answers_and_applies_rules():
    out = relabel(ScriptedBackend(ANSWERS), ROWS, max_tokens=64)
    assert [r["label"] for r in out] == ["easy", "hard", "easy", "hard"]
    assert [r["label"] for r in ROWS] == ["hard", "easy", "hard", "easy"]  # the input is not modified
    short = relabel(ScriptedBackend(ANSWERS), ROWS[:1], max_tokens=3)  # "it " misses the answer
    assert short[0]["label"] == "hard"


def test_score_prompts_reads_the_first_k_tokens():
    scores = score_prompts(ScriptedBackend(ANSWERS), ["2+2?", "9*9?"], k=2)
    assert scores == pytest.approx([0.1, 0.9])
    assert prompt_features(ScriptedBackend(ANSWERS), ["2+2?"], k=2) == (pytest.approx([0.1]), None)
    hidden = {"2+2?": [1.0, 2.0], "9*9?": [3.0, 4.0]}
    scores, h = prompt_features(ScriptedBackend(ANSWERS, hidden), ["2+2?", "9*9?"], k=2)
    assert scores == pytest.approx([0.1, 0.9]) and h.tolist() == [[1.0, 2.0], [3.0, 4.0]]


def run_cli(argv):
    parser = argparse.ArgumentParser()
    cli_router.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["calibrate-router", *argv])
    return args.func(args)


def test_calibrate_router_command(tmp_path, monkeypatch, capsys):
    prompts, out = tmp_path / "p.jsonl", tmp_path / "cal.json"
    difficulty.save_prompts(ROWS, str(prompts))
    monkeypatch.setattr("edge_runtime.backends.create_backend", lambda name, model, **kw: ScriptedBackend(ANSWERS))
    assert run_cli(["--prompts", str(prompts), "--out", str(out), "--relabel", "--k", "2", "--window", "3",
                    "--target-cloud-share", "0.5", "--json"]) == 0
    printed = Calibration.from_json(capsys.readouterr().out)
    assert printed == load_calibration(str(out))
    assert printed.model == "scripted.gguf" and printed.n_prompts == 4 and printed.k == 2 and printed.window == 3
    assert printed.achieved_share == 0.5 and printed.auroc == 1.0 and printed.agreement == 1.0
    assert [r["label"] for r in load_prompts(str(prompts))] == ["easy", "hard", "easy", "hard"]
    assert run_cli(["--prompts", str(prompts), "--out", str(out)]) == 0
    assert "AUROC 1.000" in capsys.readouterr().out


def test_calibrate_router_fits_the_probe_when_the_backend_reports_hidden_states(tmp_path, monkeypatch, capsys):
    h, y = separable_hidden(n=40, d=12, seed=1)
    rows = [{"id": f"p{i}", "prompt": f"prompt {i}", "category": "code" if hard else "greeting",
             "label": "hard" if hard else "easy", "label_source": "rule"} for i, hard in enumerate(y)]
    answers = {r["prompt"]: ("some answer text", 0.5) for r in rows}
    hidden = {r["prompt"]: h[i].tolist() for i, r in enumerate(rows)}
    prompts, out = tmp_path / "p.jsonl", tmp_path / "cal.json"
    difficulty.save_prompts(rows, str(prompts))
    backend = ScriptedBackend(answers, hidden)
    monkeypatch.setattr("edge_runtime.backends.create_backend", lambda name, model, **kw: backend)
    assert run_cli(["--prompts", str(prompts), "--out", str(out), "--window", "4"]) == 0
    printed = capsys.readouterr().out
    assert "prompt probe (12 features" in printed and "held out (5-fold CV, seed 0)" in printed
    c = load_calibration(str(out))
    assert c.kind == "probe" and c.probe_auroc == 1.0 and c.cv_auroc > 0.9
    p = c.probe.score(h)
    for i, trips in ((int(p.argmax()), True), (int(p.argmin()), False)):  # the monitor decides at the first token
        m = c.monitor()
        req = GenerationRequest(messages=[{"role": "user", "content": rows[i]["prompt"]}],
                                params=SamplingParams(max_tokens=4), confidence=True)
        first = next(ev for ev in backend.stream_sync(req) if ev.type == "delta")
        assert (m.push(first.info) is not None) == trips and m.scorer == "probe"
    with pytest.raises(InvalidRequestError):
        run_cli(["--prompts", str(prompts), "--cv-folds", "1"])
    difficulty.save_prompts(rows[:12], str(prompts))  # too few of each class for nested 5-fold CV
    with pytest.raises(EdgeRuntimeError):
        run_cli(["--prompts", str(prompts), "--out", str(out)])


def test_calibrate_router_rejects_bad_arguments_before_loading_a_model(monkeypatch):
    monkeypatch.setattr("edge_runtime.backends.create_backend", lambda *a, **kw: pytest.fail("loaded a model"))
    with pytest.raises(InvalidRequestError):
        run_cli(["--target-cloud-share", "1.5"])
    with pytest.raises(InvalidRequestError):
        run_cli(["--k", "0"])
