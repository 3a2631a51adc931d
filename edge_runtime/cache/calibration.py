"""The semantic tier's threshold, chosen on a labelled set of request pairs for a false-hit budget.

edge_runtime/data/cache_pairs.jsonl: pairs (a: a cached request, b: a new one) written for this purpose,
labelled "hit" (paraphrase, reorder, spelling_case, politeness) or "miss" (negation, number, entity,
constraint, language, earlier_turn). For an embedder, each pair gets what the cache decides from: whether b
is an exact hit of a, whether they share a scope (the same system prompt and earlier turns), whether the
guards agree, and the cosine similarity of the last messages. b hits at threshold t when it is an exact hit,
or shares the scope, the guards agree and the similarity is >= t.

`calibrate(embedder)` picks the lowest threshold whose false-hit rate on the misses is <= the budget (0.1 %),
reports recall on the hits there, and the same by k-fold cross-validation (threshold chosen on k-1 folds,
measured on the held-out one). `edge-runtime cache calibrate` writes edge_runtime/data/cache_calibration.json,
which `calibrated_threshold` reads; tests recompute it.
"""
from __future__ import annotations

import functools
import hashlib
import json
import os

import numpy as np

DATA = os.path.join(os.path.dirname(os.path.dirname(__file__)), "data")
PAIRS = os.path.join(DATA, "cache_pairs.jsonl")
CALIBRATION = os.path.join(DATA, "cache_calibration.json")
FALSE_HIT_BUDGET = 0.001
HIT_CLASSES = ("paraphrase", "reorder", "spelling_case", "politeness")
MISS_CLASSES = ("negation", "number", "entity", "constraint", "language", "earlier_turn")


def load_pairs(path: str = PAIRS) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def request_of(side: dict):
    """A pair's side as the GenerationRequest the cache would see (greedy, default settings)."""
    from edge_runtime.request import GenerationRequest

    messages = ([{"role": "system", "content": side["system"]}] if side.get("system") else [])
    messages += [dict(m) for m in side.get("history", [])] + [{"role": "user", "content": side["user"]}]
    return GenerationRequest(messages=messages)


def features(pairs: list[dict], embedder) -> dict:
    """Per pair: exact (bool), scope (bool), guards (bool: they agree), score (cosine), label (1 = hit)."""
    from edge_runtime.cache.guards import Signature
    from edge_runtime.cache.response_cache import request_keys

    ka = [request_keys("calibration", request_of(p["a"])) for p in pairs]
    kb = [request_keys("calibration", request_of(p["b"])) for p in pairs]
    ea = embedder.embed([p["a"]["user"] for p in pairs])
    eb = embedder.embed([p["b"]["user"] for p in pairs])
    return {"exact": np.array([a[1] == b[1] for a, b in zip(ka, kb)]),
            "scope": np.array([a[0] == b[0] for a, b in zip(ka, kb)]),
            "guards": np.array([Signature.of(p["a"]["user"]).agrees(Signature.of(p["b"]["user"])) for p in pairs]),
            "score": np.einsum("ij,ij->i", ea, eb).astype(np.float64),
            "label": np.array([p["label"] == "hit" for p in pairs]),
            "cls": np.array([p["class"] for p in pairs])}


def decide(f: dict, threshold: float, idx=slice(None)) -> np.ndarray:
    return f["exact"][idx] | (f["scope"][idx] & f["guards"][idx] & (f["score"][idx] >= threshold))


def pick_threshold(f: dict, idx=slice(None), budget: float = FALSE_HIT_BUDGET) -> float:
    """The lowest threshold (0, a positive candidate score, or 1.0 + tiny) whose false-hit rate on idx's misses
    is <= budget. NOTE: never below 0: a request unrelated to the stored one (cosine < 0) never hits."""
    label = f["label"][idx]
    misses = max(1, int((~label).sum()))
    scores = np.round(f["score"][idx], 6)
    for t in sorted(set(scores[scores > 0].tolist()) | {0.0, 1.000001}):
        if (decide(f, t, idx) & ~label).sum() / misses <= budget:
            return float(t)
    return 1.000001


def calibrate(embedder, pairs: list[dict] | None = None, folds: int = 5, seed: int = 0) -> dict:
    pairs = pairs if pairs is not None else load_pairs()
    f = features(pairs, embedder)
    t = pick_threshold(f)
    hit = decide(f, t)
    label = f["label"]
    order = np.random.default_rng(seed).permutation(len(pairs))
    cv_recall, cv_false = [], []
    for k in range(folds):
        test = np.zeros(len(pairs), bool)
        test[order[k::folds]] = True
        tk = pick_threshold(f, ~test)
        d = decide(f, tk, test)
        cv_recall.append(float((d & label[test]).sum() / max(1, label[test].sum())))
        cv_false.append(float((d & ~label[test]).sum() / max(1, (~label[test]).sum())))
    by_class = {c: {"pairs": int((f["cls"] == c).sum()), "hit_rate": float(hit[f["cls"] == c].mean())}
                for c in HIT_CLASSES + MISS_CLASSES if (f["cls"] == c).any()}
    guards_only = f["exact"] | (f["scope"] & f["guards"])
    return {"embedder": embedder.name, "threshold": round(t, 6), "false_hit_budget": FALSE_HIT_BUDGET,
            "recall": float((hit & label).sum() / label.sum()),
            "false_hit_rate": float((hit & ~label).sum() / (~label).sum()),
            "false_hits": int((hit & ~label).sum()),
            "cv": {"folds": folds, "recall_mean": float(np.mean(cv_recall)), "recall_by_fold": cv_recall,
                   "false_hit_rate_mean": float(np.mean(cv_false)), "false_hit_rate_by_fold": cv_false},
            "guards_alone": {"recall": float((guards_only & label).sum() / label.sum()),
                             "false_hit_rate": float((guards_only & ~label).sum() / (~label).sum())},
            "by_class": by_class}


def set_digest(path: str = PAIRS) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()[:16]


@functools.cache
def _stored() -> dict:
    with open(CALIBRATION, encoding="utf-8") as f:
        return json.load(f)


def calibrated_threshold(embedder_name: str) -> float:
    """The threshold `edge-runtime cache calibrate` chose for this embedder (a ValueError if it has none)."""
    results = _stored()["embedders"]
    if embedder_name not in results:
        raise ValueError(f"no calibrated threshold for embedder {embedder_name!r} (have: {', '.join(results)}); "
                         f"run `edge-runtime cache calibrate`")
    return float(results[embedder_name]["threshold"])


def default_embedder() -> str:
    """The embedder the labelled set picked (the highest cross-validated recall within the budget)."""
    return _stored()["chosen"]
