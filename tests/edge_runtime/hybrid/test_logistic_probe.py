"""The logistic probe: the fit, stratified folds and cross-validation (synthetic data, no model)."""
import numpy as np
import pytest

from edge_runtime.hybrid.logistic_probe import (LogisticProbe, auroc, cross_validate, fit_logistic, fit_probe,
                                         out_of_fold_scores, stratified_folds)


def separable(n=120, d=300, seed=0, shift=1.5):
    """More features than samples (like 576-wide hidden states for ~200 prompts); the label shifts ten of them
    (unit noise) by +-shift, far enough for the classes to be separable."""
    rng = np.random.default_rng(seed)
    y = rng.random(n) < 0.45
    x = rng.normal(size=(n, d))
    x[:, :10] += np.where(y, shift, -shift)[:, None]
    return x * rng.uniform(0.5, 3.0, size=d) + rng.normal(size=d) * 5, y  # scales and offsets vary


def test_fit_separates_separable_data_and_generalizes():
    x, y = separable()
    probe = fit_logistic(x[:80], y[:80], l2=10.0)
    assert auroc(probe.score(x[:80]), y[:80]) == 1.0
    assert auroc(probe.score(x[80:]), y[80:]) > 0.95  # unseen rows from the same distribution
    p = probe.score(x)
    assert p.shape == (120,) and np.all((0 < p) & (p < 1))
    assert isinstance(probe.score(x[0]), float) and probe.score(x[0]) == pytest.approx(p[0])


def test_fit_is_the_penalized_optimum_in_the_full_feature_space():
    # the fit works in the row space of the standardized data; the gradient of the full problem must vanish
    x, y = separable(n=40, d=100, seed=3)
    l2 = 3.0
    probe = fit_logistic(x, y, l2)
    z = (x - np.array(probe.mean)) / np.array(probe.scale)
    w = np.array(probe.weights)
    p = probe.score(x)
    grad_w = z.T @ (p - y) + l2 * w
    grad_b = (p - y).sum()
    assert np.abs(grad_w).max() < 1e-6 and abs(grad_b) < 1e-6


def test_fit_handles_constant_features_and_rejects_bad_input():
    x, y = separable(n=30, d=10)
    x[:, 3] = 7.0  # no spread: must not divide by zero
    probe = fit_logistic(x, y, 1.0)
    assert np.all(np.isfinite(probe.weights)) and probe.scale[3] == 1.0
    with pytest.raises(ValueError):
        fit_logistic(x, np.ones(30, bool), 1.0)
    with pytest.raises(ValueError):
        fit_logistic(x, y, 0.0)
    with pytest.raises(ValueError):
        fit_logistic(x[:10], y, 1.0)
    with pytest.raises(ValueError):
        probe.score(np.zeros(11))
    with pytest.raises(ValueError):
        LogisticProbe([0.0], [1.0, 1.0], [0.0], 0.0)


def test_rounded_probe_scores_almost_the_same():
    x, y = separable()
    probe = fit_logistic(x, y, 10.0)
    r = probe.rounded(6)
    assert np.abs(r.score(x) - probe.score(x)).max() < 1e-4 and r.l2 == probe.l2
    assert all(len(f"{v!r}") <= 14 for v in r.weights)


@pytest.mark.parametrize("num_folds,seed", [(2, 0), (5, 0), (5, 7), (10, 1)])
def test_stratified_folds_are_disjoint_cover_everything_and_keep_the_class_balance(num_folds, seed):
    y = np.random.default_rng(seed).random(103) < 0.3
    fold = stratified_folds(y, num_folds, seed)
    assert fold.shape == (103,) and set(fold.tolist()) == set(range(num_folds))  # every sample in exactly one
    sizes = np.bincount(fold, minlength=num_folds)
    assert sizes.max() - sizes.min() <= 1
    for cls in (True, False):
        per_fold = np.bincount(fold[y == cls], minlength=num_folds)
        assert per_fold.max() - per_fold.min() <= 1  # each class dealt evenly
    assert np.array_equal(stratified_folds(y, num_folds, seed), fold)  # seeded
    assert not np.array_equal(stratified_folds(y, num_folds, seed + 1), fold)
    with pytest.raises(ValueError):
        stratified_folds(y, 1)
    with pytest.raises(ValueError):
        stratified_folds(np.array([True, True, False, False, False]), 3)


def test_out_of_fold_scores_never_see_their_own_row():
    x, y = separable(n=60, d=20, seed=4)
    oof = out_of_fold_scores(x, y, 1.0, num_folds=5, seed=0)
    fold = stratified_folds(y, 5, 0)
    row = np.flatnonzero(fold == 2)[0]
    expected = fit_logistic(x[fold != 2], y[fold != 2], 1.0).score(x[row])
    assert oof[row] == pytest.approx(expected)


def test_cross_validation_is_honest_on_separable_and_on_random_labels():
    x, y = separable(n=100, d=150)
    grid = (1.0, 100.0)
    probe, oof = fit_probe(x, y, num_folds=5, seed=0, l2_grid=grid)
    assert probe.l2 in grid and oof.shape == (100,) and auroc(oof, y) > 0.95
    cv = cross_validate(x, y, 0.3, num_folds=5, seed=0, l2_grid=grid)
    assert cv["auroc"] > 0.95 and cv["scores"].shape == (100,)
    # NOTE: thresholds from in-sample scores, which a separable fit pushes to 0 and 1, route fewer unseen rows
    assert 0 < cv["share"] <= 0.3 and cv["agreement"] > 0.5
    # with more features than samples, noise labels fit perfectly in sample but not held out
    noise = np.random.default_rng(9).random(100) < 0.45
    assert auroc(fit_logistic(x, noise, 0.1).score(x), noise) == 1.0
    assert abs(cross_validate(x, noise, 0.3, num_folds=5, seed=0, l2_grid=grid)["auroc"] - 0.5) < 0.15
