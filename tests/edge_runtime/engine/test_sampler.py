"""Sampler and stop strings: pure logic on synthetic logits (the model-level tests live elsewhere)."""
import pytest
import torch

from edge_runtime.errors import InvalidRequestError
from edge_runtime.request import SamplingParams
from edge_runtime.engine.sampler import Sampler
from edge_runtime.engine.stop_matcher import StopMatcher


def logits_of(probs):
    return torch.log(torch.tensor(probs, dtype=torch.float32))


def test_greedy_takes_argmax():
    s = Sampler(SamplingParams(temperature=0))
    assert s.sample(torch.tensor([0.1, 3.0, 2.9, -1.0]), []) == 1


def test_same_seed_same_tokens_different_seed_differs():
    lg = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    def draw(seed):
        s = Sampler(SamplingParams(temperature=1.0, seed=seed))
        return [s.sample(lg, []) for _ in range(50)]
    assert draw(7) == draw(7)
    assert draw(7) != draw(8)


def test_top_k_keeps_only_k_most_likely():
    lg = logits_of([0.05, 0.4, 0.3, 0.2, 0.05])
    s = Sampler(SamplingParams(temperature=1.0, top_k=2, seed=1))
    probs = s.probabilities(lg, [])
    assert set(torch.nonzero(probs).flatten().tolist()) == {1, 2}
    assert torch.allclose(probs[1] / probs[2], torch.tensor(0.4 / 0.3))


def test_top_p_keeps_smallest_prefix_reaching_mass():
    lg = logits_of([0.5, 0.3, 0.15, 0.05])
    probs = Sampler(SamplingParams(temperature=1.0, top_p=0.75)).probabilities(lg, [])
    assert set(torch.nonzero(probs).flatten().tolist()) == {0, 1}
    probs = Sampler(SamplingParams(temperature=1.0, top_p=0.81)).probabilities(lg, [])
    assert set(torch.nonzero(probs).flatten().tolist()) == {0, 1, 2}


def test_min_p_drops_tokens_below_fraction_of_best():
    lg = logits_of([0.6, 0.25, 0.1, 0.05])
    probs = Sampler(SamplingParams(temperature=1.0, min_p=0.2)).probabilities(lg, [])
    assert set(torch.nonzero(probs).flatten().tolist()) == {0, 1}


def test_temperature_sharpens_and_flattens():
    lg = logits_of([0.6, 0.4])
    cold = Sampler(SamplingParams(temperature=0.5)).probabilities(lg, [])
    hot = Sampler(SamplingParams(temperature=2.0)).probabilities(lg, [])
    assert cold[0] > 0.6 > hot[0] > 0.5


def test_sampled_frequencies_match_distribution():
    lg = logits_of([0.5, 0.3, 0.2])
    s = Sampler(SamplingParams(temperature=1.0, seed=3))
    n = 6000
    counts = torch.bincount(torch.tensor([s.sample(lg, []) for _ in range(n)]), minlength=3).float() / n
    assert torch.allclose(counts, torch.tensor([0.5, 0.3, 0.2]), atol=0.03)


def test_draw_follows_the_weights_and_never_picks_a_zero_weight(monkeypatch):
    """The inverse-CDF draw behind every sampled token: unnormalized weights, zeros between them; chi-square
    against the weights (2 degrees of freedom, p = 0.01: 9.21), and a uniform that rounds up to the sum still
    lands on a token with weight."""
    w = torch.tensor([0.0, 2.0, 0.0, 1.0, 5.0, 0.0])
    s = Sampler(SamplingParams(temperature=1.0, seed=3))
    n = 16000
    counts = torch.bincount(torch.tensor([s.draw(w) for _ in range(n)]), minlength=6).double()
    assert counts[[0, 2, 5]].sum() == 0
    expected = n * w.double() / w.sum()
    keep = w > 0
    assert float((((counts - expected) ** 2)[keep] / expected[keep]).sum()) < 9.21
    monkeypatch.setattr(torch, "rand", lambda *a, **k: torch.ones(1, dtype=torch.float64))
    assert s.draw(w) == 4


def test_repetition_penalty_lowers_seen_tokens():
    lg = torch.tensor([2.0, 1.9, -1.0, -1.2])
    s = Sampler(SamplingParams(temperature=0, repetition_penalty=1.5))
    assert s.sample(lg, [0]) == 1  # 2.0 / 1.5 < 1.9
    out = s.apply_penalty(lg, [0, 2])
    assert out[0] == pytest.approx(2.0 / 1.5) and out[2] == pytest.approx(-1.5) and out[1] == 1.9


@pytest.mark.parametrize("kwargs, name", [
    ({"temperature": -1}, "temperature"), ({"top_p": 0}, "top_p"), ({"top_p": 1.5}, "top_p"),
    ({"min_p": -0.1}, "min_p"), ({"top_k": -3}, "top_k"), ({"max_tokens": 0}, "max_tokens"),
    ({"repetition_penalty": 0}, "repetition_penalty"), ({"temperature": float("nan")}, "temperature"),
    ({"seed": "x"}, "seed"), ({"stop": [""]}, "stop"),
])
def test_invalid_values_raise_named_errors(kwargs, name):
    with pytest.raises(InvalidRequestError, match=name):
        SamplingParams(**kwargs)


def test_stop_string_split_across_pieces_is_never_emitted():
    m = StopMatcher(["</end>"])
    out = []
    for piece in ["Hello </", "en", "d> world"]:
        text, hit = m.push(piece)
        out.append(text)
        if hit:
            break
    assert "".join(out) == "Hello " and hit


def test_stop_prefix_that_does_not_complete_is_released():
    m = StopMatcher(["STOP"])
    a, hit1 = m.push("go ST")
    b, hit2 = m.push("ILL")
    assert (a, hit1, hit2) == ("go ", False, False)
    assert a + b + m.flush() == "go STILL"


def test_vanishing_top_p_keeps_the_top_token_and_extreme_values_are_refused():
    logits = torch.tensor([0.5, 3.0, 1.0, -2.0])
    for top_p in (5e-324, 1e-46, 1e-6):
        s = Sampler(SamplingParams(temperature=1.0, top_p=top_p, seed=1))
        probs = s.probabilities(logits, [])
        assert probs.tolist() == [0.0, 1.0, 0.0, 0.0] and s.sample(logits, []) == 1
    for bad in ({"repetition_penalty": 1e-37}, {"repetition_penalty": 1e308}, {"seed": 2**64}, {"seed": -2**63 - 1}):
        with pytest.raises(InvalidRequestError, match=next(iter(bad))):
            SamplingParams(**bad)
