"""A linear probe: L2-regularized logistic regression on standardized features, with stratified cross-validation.

The difficulty router fits one on the local model's final hidden state at the
last prompt position (docs/routing.md). Written with numpy alone: standardize,
rotate onto the right singular vectors of the training matrix (an L2 solution
lies in the span of the rows, so with fewer samples than features the fit is
exact in at most n dimensions), then Newton's method, which converges in a
handful of steps because the penalty makes the problem strictly convex.

This module knows nothing about models, prompts or routing: rows of floats
and boolean labels in, a probability out.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

L2_GRID = (0.1, 1.0, 10.0, 100.0, 1000.0, 10000.0)  # penalties tried by `fit_probe`, on standardized features


def auroc(scores, labels) -> float:
    """Area under the ROC curve of `scores` for the positive `labels` (True = hard); ties count one half.

    The probability that a random positive scores above a random negative
    (the Mann-Whitney statistic). Raises ValueError without both classes.
    """
    s = np.asarray(scores, dtype=np.float64)
    y = np.asarray(labels, dtype=bool)
    if s.shape != y.shape:
        raise ValueError(f"{s.size} scores but {y.size} labels")
    pos, neg = s[y], s[~y]
    if pos.size == 0 or neg.size == 0:
        raise ValueError("AUROC needs both positive and negative labels")
    greater = (pos[:, None] > neg[None, :]).mean()
    ties = (pos[:, None] == neg[None, :]).mean()
    return float(greater + 0.5 * ties)


def _sigmoid(z: np.ndarray) -> np.ndarray:
    return 0.5 * (1.0 + np.tanh(0.5 * z))  # no overflow for large |z|


@dataclass(slots=True)
class LogisticProbe:
    """p(positive | x) = sigmoid(((x - mean) / scale) . weights + bias).

    `l2`: the penalty it was fit with (on the standardized weights; the bias is
    not penalized). Plain lists so it round-trips through JSON.
    """

    mean: list[float]
    scale: list[float]
    weights: list[float]
    bias: float
    l2: float = 0.0

    def __post_init__(self) -> None:
        if not len(self.mean) == len(self.scale) == len(self.weights):
            raise ValueError(f"mean, scale and weights differ in length ({len(self.mean)}, {len(self.scale)}, "
                             f"{len(self.weights)})")

    @property
    def num_features(self) -> int:
        return len(self.weights)

    def score(self, x) -> np.ndarray | float:
        """Probabilities for rows x [n, num_features], or one float for one vector [num_features]."""
        x = np.asarray(x, dtype=np.float64)
        if x.shape[-1] != self.num_features:
            raise ValueError(f"the probe reads {self.num_features} features, got {x.shape[-1]}")
        z = ((x - np.asarray(self.mean)) / np.asarray(self.scale)) @ np.asarray(self.weights) + self.bias
        p = _sigmoid(z)
        return float(p) if p.ndim == 0 else p

    def rounded(self, digits: int = 6) -> "LogisticProbe":
        """The same probe with its numbers kept to `digits` significant digits (a compact JSON)."""
        r = lambda v: float(f"{v:.{digits}g}")  # noqa: E731
        return LogisticProbe([r(v) for v in self.mean], [r(v) for v in self.scale], [r(v) for v in self.weights],
                             r(self.bias), self.l2)


def fit_logistic(x, y, l2: float, max_iter: int = 100) -> LogisticProbe:
    """The L2-regularized logistic regression of labels y [n] (bool) on rows x [n, d].

    Raises ValueError without both classes or with l2 <= 0 (the penalty keeps
    separable data from driving the weights to infinity).
    """
    x = np.asarray(x, dtype=np.float64)
    t = np.asarray(y, dtype=bool).astype(np.float64)
    if x.ndim != 2 or x.shape[0] != t.size:
        raise ValueError(f"need rows [n, d] and n labels, got {x.shape} and {t.size}")
    if t.min() == t.max():
        raise ValueError("a logistic fit needs both classes")
    if l2 <= 0:
        raise ValueError(f"l2={l2} must be > 0")
    mean = x.mean(0)
    std = x.std(0)
    scale = np.where(std > 1e-12, std, 1.0)
    z = (x - mean) / scale
    # the row space from the n x n Gram matrix (cheaper than an SVD of z): z z^T = u diag(s^2) u^T, and
    # z v = u s for the right singular vectors v = z^T u / s
    s2, u = np.linalg.eigh(z @ z.T)
    keep = s2 > s2.max() * 1e-10
    u, s = u[:, keep], np.sqrt(s2[keep])  # [n, r], [r]
    a = np.hstack([u * s, np.ones((t.size, 1))])  # [n, r + 1]: rotated features, then the bias column
    penalty = np.full(a.shape[1], l2)
    penalty[-1] = 0.0
    w = np.zeros(a.shape[1])
    for _ in range(max_iter):
        p = _sigmoid(a @ w)
        grad = a.T @ (p - t) + penalty * w
        hess = (a * (p * (1 - p))[:, None]).T @ a + np.diag(penalty + 1e-10)
        step = np.linalg.solve(hess, grad)
        w -= step
        if np.abs(step).max() < 1e-10:
            break
    weights = z.T @ (u @ (w[:-1] / s))  # v @ beta
    return LogisticProbe(mean.tolist(), scale.tolist(), weights.tolist(), float(w[-1]), float(l2))


def stratified_folds(y, num_folds: int, seed: int = 0) -> np.ndarray:
    """A fold index in [0, num_folds) per sample: each class shuffled (seeded) and dealt round-robin,
    so every fold holds its share of each class, and each sample is in exactly one fold."""
    y = np.asarray(y, dtype=bool)
    if num_folds < 2:
        raise ValueError(f"num_folds={num_folds} must be >= 2")
    if min(y.sum(), (~y).sum()) < num_folds:
        raise ValueError(f"each class needs at least {num_folds} samples for {num_folds} folds")
    rng = np.random.default_rng(seed)
    fold = np.empty(y.size, dtype=np.int64)
    start = 0
    for cls in (True, False):
        idx = np.flatnonzero(y == cls)
        rng.shuffle(idx)
        fold[idx] = (start + np.arange(idx.size)) % num_folds  # continue the deal: folds stay balanced in size
        start += idx.size
    return fold


def out_of_fold_scores(x, y, l2: float, num_folds: int = 5, seed: int = 0) -> np.ndarray:
    """Each sample's score by the probe fit on the other folds (the scores it gets as an unseen sample)."""
    x = np.asarray(x, dtype=np.float64)
    y = np.asarray(y, dtype=bool)
    fold = stratified_folds(y, num_folds, seed)
    out = np.empty(y.size)
    for f in range(num_folds):
        test = fold == f
        out[test] = fit_logistic(x[~test], y[~test], l2).score(x[test])
    return out


def fit_probe(x, y, num_folds: int = 5, seed: int = 0, l2_grid=L2_GRID) -> tuple[LogisticProbe, np.ndarray]:
    """Choose the penalty by cross-validated AUROC, then fit on everything.

    Returns the probe and the out-of-fold scores at the chosen penalty.
    """
    best = None
    for l2 in l2_grid:
        oof = out_of_fold_scores(x, y, l2, num_folds, seed)
        a = auroc(oof, y)
        if best is None or a > best[0] + 1e-12:
            best = (a, l2, oof)
    _, l2, oof = best
    return fit_logistic(x, y, l2), oof


def cross_validate(x, y, target_share: float, num_folds: int = 5, seed: int = 0,
                   l2_grid=L2_GRID) -> dict:
    """Held-out figures of the whole procedure (penalty choice, fit, threshold), by stratified k-fold.

    For each fold the probe is chosen and fit on the other folds, its threshold
    is the (1 - target_share) quantile of its scores on that training part, and
    the fold is scored and routed by it. Returns `auroc` (of the
    pooled held-out scores), `agreement` (routed to the cloud == label) and
    `share` (routed to the cloud), plus the held-out `scores`.
    """
    x = np.asarray(x, dtype=np.float64)
    y = np.asarray(y, dtype=bool)
    fold = stratified_folds(y, num_folds, seed)
    scores = np.empty(y.size)
    cloud = np.empty(y.size, dtype=bool)
    for f in range(num_folds):
        test = fold == f
        probe, _ = fit_probe(x[~test], y[~test], num_folds, seed + 1 + f, l2_grid)
        scores[test] = probe.score(x[test])
        cloud[test] = scores[test] > np.quantile(probe.score(x[~test]), 1.0 - target_share)
    return {"auroc": auroc(scores, y), "agreement": float((cloud == y).mean()), "share": float(cloud.mean()),
            "scores": scores}
