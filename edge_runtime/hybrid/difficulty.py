"""Prompt difficulty from the local model itself, its calibration, and the confidence monitor.

The hybrid runtime starts every "auto" answer on the device. Its first token
carries the prompt's final hidden state; a logistic probe (logistic_probe.py)
on it gives a difficulty score and `ConfidenceMonitor` sends the answer to the
cloud when it is over the calibrated threshold. Without a hidden state (the
llama.cpp backend) the fallback is the top-1 margin of the first `k` tokens.
Later in the answer the monitor watches the mean entropy over a sliding window
for confidence collapsing. Thresholds are set RouteLLM-style: the (1 - share)
quantile of the scores on the labelled set `data/routing_prompts.jsonl`, so a
target share of traffic goes to the cloud. docs/routing.md: method, figures.

This module knows nothing about the cloud, the network or how logits are
computed: it reads `{"entropy", "margin"[, "hidden"]}` dicts (generator.py)
and talks to a backend only through `stream_sync` when calibrating.
"""
from __future__ import annotations

import datetime
import json
import math
import os
import re
import unicodedata
from dataclasses import asdict, dataclass, fields

import numpy as np

from edge_runtime import DATA_DIR
from edge_runtime.hybrid.logistic_probe import LogisticProbe, auroc, cross_validate, fit_probe

PROMPTS_PATH = os.path.join(DATA_DIR, "routing_prompts.jsonl")
CALIBRATION_PATH = os.path.join(DATA_DIR, "router_calibration.json")

# The written rule for prompts without a checkable reference answer.
CATEGORY_RULES = {
    "greeting": "easy", "rewrite": "easy", "creative": "easy", "definition": "easy",
    "code": "hard", "translation": "hard", "planning": "hard",
}


def score_from_confidences(confs: list[dict]) -> float:
    """Difficulty of a prompt from its first k generated tokens' confidences: 1 - mean top-1/top-2 margin.

    In [0, 1]; higher = harder. The best of the simple uncertainty scores on
    the labelled set (AUROC 0.60 at k = 2; entropy does worse: open-ended easy
    prompts start with many plausible tokens); now the fallback (docs/routing.md).
    """
    if not confs:
        raise ValueError("a difficulty score needs at least one token's confidence")
    return 1.0 - sum(c["margin"] for c in confs) / len(confs)


@dataclass(slots=True)
class Calibration:
    """Where the router's thresholds sit, how they did on the labelled set, and the monitor's settings.

    Two scores; `kind` says which leads. The prompt probe (`kind == "probe"`)
    scores the first token's `hidden`; over `probe_threshold` the answer goes
    to the cloud after that token. `probe_*`: its in-sample figures; `cv_*`:
    held out, by `cv_folds`-fold stratified cross-validation of the whole fit.
    The margin score, the fallback without `hidden` (llama.cpp) or a probe:
    over `threshold` after `k` tokens; `achieved_share`, `agreement`, `auroc`.
    Shares: of the labelled prompts sent to the cloud; agreement: share where
    (sent to cloud) == (label hard). `window_threshold`: a mean entropy (nats)
    over the last `window` tokens above it escalates mid-answer.
    """

    threshold: float
    target_cloud_share: float
    achieved_share: float = 0.0
    agreement: float = 0.0
    auroc: float = 0.5
    n_prompts: int = 0
    k: int = 2
    window: int = 16
    window_threshold: float = math.inf
    window_trip_share: float = 0.0  # share of the easy answers whose windowed entropy ever exceeded it
    created: str = ""
    model: str = ""
    kind: str = "margin"
    probe_threshold: float = math.inf
    probe_share: float = 0.0
    probe_agreement: float = 0.0
    probe_auroc: float = 0.5
    cv_share: float = 0.0
    cv_agreement: float = 0.0
    cv_auroc: float = 0.5
    cv_folds: int = 5
    probe: LogisticProbe | None = None

    def __post_init__(self) -> None:
        if not 0 < self.target_cloud_share < 1:
            raise ValueError(f"target_cloud_share={self.target_cloud_share!r} must be in (0, 1)")
        if self.k < 1 or self.window < 1:
            raise ValueError(f"k={self.k} and window={self.window} must be >= 1")
        if self.kind not in ("margin", "probe"):
            raise ValueError(f"kind={self.kind!r} must be 'margin' or 'probe'")
        if self.kind == "probe" and self.probe is None:
            raise ValueError("kind 'probe' needs a probe")

    def to_json(self) -> str:
        data = asdict(self)
        probe = data.pop("probe")
        text = json.dumps(data, indent=2)
        if probe is None:
            return text[:-2] + ',\n  "probe": null\n}\n'
        # NOTE: one line per vector keeps the few thousand floats readable in a diff
        body = ",\n".join(f"    {json.dumps(key)}: {json.dumps(value)}" for key, value in probe.items())
        return text[:-2] + ',\n  "probe": {\n' + body + "\n  }\n}\n"

    @classmethod
    def from_json(cls, text: str) -> "Calibration":
        data = json.loads(text)
        known = {f.name for f in fields(cls)}
        data = {k: v for k, v in data.items() if k in known}
        if data.get("probe") is not None:
            data["probe"] = LogisticProbe(**data["probe"])
        return cls(**data)

    def save(self, path: str | None = None) -> str:
        path = path or CALIBRATION_PATH
        with open(path, "w", encoding="utf-8") as f:
            f.write(self.to_json())
        return path

    def monitor(self) -> "ConfidenceMonitor":
        return ConfidenceMonitor(self)


def load_calibration(path: str | None = None) -> Calibration:
    """The calibration at `path`, by default the packaged data/router_calibration.json."""
    with open(path or CALIBRATION_PATH, encoding="utf-8") as f:
        return Calibration.from_json(f.read())


def calibrate(scores: list[float], labels: list[bool], target_cloud_share: float, k: int = 2,
              window: int = 16, window_threshold: float = math.inf, window_trip_share: float = 0.0,
              model: str = "", hidden=None, cv_folds: int = 5, seed: int = 0) -> Calibration:
    """Put the thresholds at the (1 - target_cloud_share) quantile of the scores and measure them on `labels`.

    Args:
        scores: one margin score per labelled prompt (`score_from_confidences` of its first k tokens).
        labels: True where the prompt is labelled hard.
        target_cloud_share: the share of prompts that should go to the cloud, in (0, 1).
        hidden: optional [n, dim] prompt hidden states; with them a probe is fit (penalty chosen by
            cv_folds-fold CV), its threshold is the same quantile of its scores on the set, it leads
            (kind "probe"), and the whole fit is cross-validated for held-out figures.
    Returns:
        the Calibration, with the shares it achieves (ties can move them), agreement and AUROC.
    """
    if not 0 < target_cloud_share < 1:
        raise ValueError(f"target_cloud_share={target_cloud_share!r} must be in (0, 1)")
    s = np.asarray(scores, dtype=np.float64)
    y = np.asarray(labels, dtype=bool)
    if s.size == 0 or s.shape != y.shape:
        raise ValueError(f"calibration needs one label per score ({s.size} scores, {y.size} labels)")
    threshold = float(np.quantile(s, 1.0 - target_cloud_share))
    cloud = s > threshold
    cal = Calibration(threshold=threshold, target_cloud_share=target_cloud_share,
                      achieved_share=float(cloud.mean()), agreement=float((cloud == y).mean()),
                      auroc=auroc(s, y), n_prompts=int(s.size), k=k, window=window,
                      window_threshold=float(window_threshold), window_trip_share=float(window_trip_share),
                      created=datetime.date.today().isoformat(), model=model, cv_folds=cv_folds)
    if hidden is None:
        return cal
    h = np.asarray(hidden, dtype=np.float64)
    if h.ndim != 2 or h.shape[0] != y.size:
        raise ValueError(f"need one hidden state per label, got {h.shape} for {y.size} labels")
    probe = fit_probe(h, y, cv_folds, seed)[0].rounded()
    p = probe.score(h)
    cal.kind, cal.probe = "probe", probe
    cal.probe_threshold = float(np.quantile(p, 1.0 - target_cloud_share))
    cloud = p > cal.probe_threshold
    cal.probe_share, cal.probe_agreement, cal.probe_auroc = float(cloud.mean()), float((cloud == y).mean()), auroc(p, y)
    cv = cross_validate(h, y, target_cloud_share, cv_folds, seed)
    cal.cv_share, cal.cv_agreement, cal.cv_auroc = cv["share"], cv["agreement"], cv["auroc"]
    return cal


def windowed_means(entropies: list[float], window: int) -> np.ndarray:
    """Mean entropy over each full window of `window` consecutive tokens (empty when the answer is shorter)."""
    e = np.asarray(entropies, dtype=np.float64)
    if e.size < window:
        return np.zeros(0)
    c = np.concatenate([[0.0], np.cumsum(e)])
    return (c[window:] - c[:-window]) / window


def window_threshold_for(answers: list[list[dict]], window: int, k: int = 2,
                         trip_share: float = 0.05) -> tuple[float, float]:
    """The windowed-entropy level that only about `trip_share` of these answers ever exceed.

    Each answer's highest mean entropy over the windows the monitor checks
    (full windows ending after token k) is taken, 0 when it has none (a short
    answer never trips); the threshold is their (1 - trip_share) quantile.
    Returns (threshold, share of the answers that exceed it).
    """
    first = max(0, k - window + 1)  # windowed_means[j] ends at token j + window
    peaks = []
    for a in answers:
        w = windowed_means([c["entropy"] for c in a], window)[first:]
        peaks.append(float(w.max()) if w.size else 0.0)
    peaks = np.array(peaks)
    if peaks.size == 0:
        raise ValueError("no answers to set the window threshold from")
    threshold = float(np.quantile(peaks, 1.0 - trip_share))
    return threshold, float((peaks > threshold).mean())


class ConfidenceMonitor:
    """Watches one local answer token by token and says when it should move to the cloud.

    `push(conf)` takes each generated token's `{"entropy", "margin"}` in order
    (a delta's `info`; an empty dict, a delta without a token, is ignored).
    With a probe calibration, a first token carrying `hidden` is scored by the
    probe at once (trips over `probe_threshold`); otherwise the margin score of
    the first `k` tokens is checked against `threshold` at token k. After k, a
    mean entropy over the last `window` tokens above `window_threshold` trips.
    It trips at most once (`tripped`: the reason, `tripped_at`: the 0-based
    token index); `scorer` ("probe"/"margin") and `score` say what decided.
    """

    def __init__(self, calibration: Calibration):
        self.cal = calibration
        self.num_tokens = 0
        self.tripped: str | None = None
        self.tripped_at: int | None = None
        self.scorer: str | None = None
        self.score: float | None = None
        self._confs: list[dict] = []

    def _trip(self, reason: str) -> str:
        self.tripped, self.tripped_at = reason, self.num_tokens - 1
        return reason

    def _probe_score(self, hidden) -> float | None:
        probe = self.cal.probe
        if self.cal.kind != "probe" or probe is None or hidden is None or len(hidden) != probe.num_features:
            return None  # a llama.cpp stream, a margin calibration, or another model's hidden size
        return probe.score(hidden)

    def push(self, conf: dict) -> str | None:
        """The next generated token's confidence -> a reason to escalate now, or None."""
        if not conf:
            return None
        self.num_tokens += 1
        if self.tripped is not None:
            return None
        cal = self.cal
        n = self.num_tokens
        self._confs.append({"entropy": conf["entropy"], "margin": conf["margin"]})
        if n == 1 and (score := self._probe_score(conf.get("hidden"))) is not None:
            self.scorer, self.score = "probe", score
            if score > cal.probe_threshold:
                return self._trip(f"difficulty {score:.2f} > {cal.probe_threshold:.2f} by the prompt probe "
                                  f"(threshold for a {cal.target_cloud_share:.0%} cloud share)")
        if n == cal.k:
            if self.scorer is None:
                self.scorer = "margin"
                self.score = score = score_from_confidences(self._confs)
                if score > cal.threshold:
                    return self._trip(f"difficulty {score:.2f} > {cal.threshold:.2f} after {n} tokens "
                                      f"(threshold for a {cal.target_cloud_share:.0%} cloud share)")
        elif n > cal.k and n >= cal.window:
            mean = sum(c["entropy"] for c in self._confs[-cal.window:]) / cal.window
            if mean > cal.window_threshold:
                return self._trip(f"confidence collapsed: mean entropy {mean:.2f} > {cal.window_threshold:.2f} "
                                  f"nats over the last {cal.window} tokens (token {n})")
        if len(self._confs) > max(cal.k, cal.window):
            del self._confs[0]
        return None


class TripAt:
    """A monitor that trips at a given 0-based token index with a given reason (tests, demos)."""

    def __init__(self, index: int, reason: str = "test: forced escalation"):
        if index < 0:
            raise ValueError(f"index={index} must be >= 0")
        self.index, self.reason = index, reason
        self.num_tokens = 0
        self.tripped: str | None = None
        self.tripped_at: int | None = None

    def push(self, conf: dict) -> str | None:
        if not conf:
            return None
        self.num_tokens += 1
        if self.tripped is None and self.num_tokens - 1 == self.index:
            self.tripped, self.tripped_at = self.reason, self.index
            return self.reason
        return None


# --- the labelled set and the backend passes ---------------------------------------------------------------

def load_prompts(path: str | None = None) -> list[dict]:
    with open(path or PROMPTS_PATH, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def save_prompts(rows: list[dict], path: str | None = None) -> None:
    with open(path or PROMPTS_PATH, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)


def normalize(text: str) -> str:
    """Lower case, accents dropped, thousands separators out of numbers, whitespace collapsed."""
    text = unicodedata.normalize("NFKD", text)
    text = "".join(ch for ch in text if not unicodedata.combining(ch)).lower()
    text = re.sub(r"(?<=\d)[,\u202f\u00a0 ](?=\d{3}\b)", "", text)
    return re.sub(r"\s+", " ", text).strip()


def answer_matches(reference: str, text: str) -> bool:
    """Whether `text` holds the reference answer (alternatives separated by '|').

    Numbers must stand alone (42 does not match 420 or 4.2); words match on word boundaries.
    """
    out = normalize(text)
    for ref in (normalize(r) for r in reference.split("|")):
        if not ref:
            continue
        left = r"(?<![\d.])" if ref[0].isdigit() else r"(?<!\w)"
        right = r"(?!\.?\d)" if ref[-1].isdigit() else r"(?!\w)"
        if re.search(left + re.escape(ref) + right, out):
            return True
    return False


def _greedy(backend, prompt: str, max_tokens: int) -> tuple[str, list[dict]]:
    from edge_runtime.request import GenerationRequest, SamplingParams

    request = GenerationRequest(messages=[{"role": "user", "content": prompt}],
                                params=SamplingParams(max_tokens=max_tokens), confidence=True)
    text, confs = [], []
    for ev in backend.stream_sync(request):
        if ev.type == "delta":
            text.append(ev.text)
            if ev.token_ids and ev.info:
                confs.append(ev.info)
    return "".join(text), confs


def answer_confidences(backend, prompts: list[str], max_tokens: int) -> list[list[dict]]:
    """Each prompt's greedy answer (up to max_tokens) as its tokens' `{"entropy", "margin"}`."""
    return [_greedy(backend, p, max_tokens)[1] for p in prompts]


def prompt_features(backend, prompts: list[str], k: int) -> tuple[list[float], np.ndarray | None]:
    """One greedy pass of k tokens per prompt (as a user message): margin scores and hidden states.

    Returns (scores, hidden [n, dim] fp32), hidden None unless the backend
    reports it (native) for every prompt. An answer that ends before k tokens
    is scored on the tokens it has.
    """
    scores, hidden = [], []
    for prompt in prompts:
        confs = _greedy(backend, prompt, k)[1]
        scores.append(score_from_confidences(confs))
        h = confs[0].get("hidden") if confs else None
        hidden.append(None if h is None else np.asarray(h, dtype=np.float32))
    return scores, None if any(h is None for h in hidden) else np.stack(hidden)


def score_prompts(backend, prompts: list[str], k: int) -> list[float]:
    """The margin scores of the first k greedy tokens of each prompt (`prompt_features`)."""
    return prompt_features(backend, prompts, k)[0]


def label_by_rule(row: dict) -> str:
    if row["category"] not in CATEGORY_RULES:
        raise ValueError(f"prompt {row['id']}: category {row['category']!r} has no answer and no rule")
    return CATEGORY_RULES[row["category"]]


def relabel(backend, rows: list[dict], max_tokens: int = 64) -> list[dict]:
    """New rows with labels recomputed: rows with an `answer` by the model's greedy answer, others by rule.

    A checked row is easy when the model's answer (up to max_tokens) holds the
    reference, hard otherwise.
    """
    out = []
    for row in rows:
        row = dict(row)
        if row.get("answer"):
            text, _ = _greedy(backend, row["prompt"], max_tokens)
            row["label"] = "easy" if answer_matches(row["answer"], text) else "hard"
            row["label_source"] = "checked"
        else:
            row["label"] = label_by_rule(row)
            row["label_source"] = "rule"
        out.append(row)
    return out
