"""`edge-runtime calibrate-router`: fit the router's difficulty probe on the labelled prompt set and set its thresholds.

Relabels the checked prompts if asked (rewriting the jsonl), runs every prompt
for its first k greedy tokens (the prompt's final hidden state and the margin
score), fits the logistic probe on the hidden states and cross-validates it,
puts each threshold at the quantile that sends the target share to the cloud,
sets the mid-stream window threshold from the easy prompts' greedy answers,
and writes the calibration JSON (docs/routing.md).
"""
from __future__ import annotations

import json
import os
import time

from edge_runtime.errors import EdgeRuntimeError, InvalidRequestError


def register(sub) -> None:
    """Add the `calibrate-router` subcommand to an argparse subparsers object."""
    p = sub.add_parser("calibrate-router", help="calibrate the difficulty router on the labelled prompt set "
                                                "(docs/routing.md)")
    p.add_argument("--model", default="default", help="'default' (embedded SmolLM2-135M-Instruct Q4_1) or a GGUF path")
    p.add_argument("--threads", type=int, default=None, help="CPU threads (default: all cores)")
    p.add_argument("--target-cloud-share", type=float, default=0.3, help="share of prompts sent to the cloud, (0, 1)")
    p.add_argument("--k", type=int, default=2, help="tokens the device generates before deciding by the margin "
                   "score (the fallback; the probe decides after the first token)")
    p.add_argument("--cv-folds", type=int, default=5, help="folds of the probe's stratified cross-validation")
    p.add_argument("--seed", type=int, default=0, help="seed of the cross-validation folds")
    p.add_argument("--window", type=int, default=16, help="mid-stream monitor: tokens in the entropy window")
    p.add_argument("--window-trip-share", type=float, default=0.05,
                   help="mid-stream monitor: share of the easy prompts' answers allowed to trip it")
    p.add_argument("--answer-tokens", type=int, default=128,
                   help="mid-stream monitor: greedy answer length for the easy prompts")
    p.add_argument("--relabel", action="store_true", help="relabel first: checked rows by the model's answers, "
                   "the rest by category rule (rewrites --prompts)")
    p.add_argument("--relabel-tokens", type=int, default=64, help="greedy answer length when relabelling")
    p.add_argument("--prompts", default=None, help="the labelled prompt set, jsonl (default: the packaged "
                   "edge_runtime/data/routing_prompts.jsonl)")
    p.add_argument("--out", default=None, help="where to write the calibration JSON (default: the packaged "
                   "edge_runtime/data/router_calibration.json, which the router loads)")
    p.add_argument("--json", action="store_true", help="print the calibration as JSON")
    p.set_defaults(func=cmd_calibrate_router)


def _check_args(args) -> None:
    if not 0 < args.target_cloud_share < 1:
        raise InvalidRequestError(f"--target-cloud-share {args.target_cloud_share} must be in (0, 1)")
    if not 0 < args.window_trip_share < 1:
        raise InvalidRequestError(f"--window-trip-share {args.window_trip_share} must be in (0, 1)")
    for name in ("k", "window", "answer_tokens", "relabel_tokens"):
        if getattr(args, name) < 1:
            raise InvalidRequestError(f"--{name.replace('_', '-')} must be >= 1")
    if args.cv_folds < 2:
        raise InvalidRequestError("--cv-folds must be >= 2")


def _load_rows(path: str) -> list[dict]:
    from edge_runtime.hybrid.difficulty import load_prompts

    try:
        rows = load_prompts(path)
    except OSError as e:
        raise EdgeRuntimeError(f"cannot read {path}: {e.strerror}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise EdgeRuntimeError(f"{path} is not a JSON-lines file: {e}") from None
    if not rows:
        raise EdgeRuntimeError(f"{path} holds no prompts")
    return rows


def cmd_calibrate_router(args) -> int:
    _check_args(args)
    if args.threads:  # NOTE: before numpy loads (torch loads it): its BLAS threads, spinning on busy cores,
        os.environ.setdefault("OPENBLAS_NUM_THREADS", str(args.threads))  # made the probe's fit 50x slower here
    from edge_runtime.hybrid import difficulty
    from edge_runtime.backends import create_backend

    args.prompts = args.prompts or difficulty.PROMPTS_PATH
    args.out = args.out or difficulty.CALIBRATION_PATH
    rows = _load_rows(args.prompts)
    backend = create_backend("native", args.model, threads=args.threads)
    model = os.path.basename(getattr(backend, "path", args.model))
    t0 = time.perf_counter()
    if args.relabel:
        rows = difficulty.relabel(backend, rows, max_tokens=args.relabel_tokens)
        difficulty.save_prompts(rows, args.prompts)
    labels = [r["label"] == "hard" for r in rows]
    if all(labels) or not any(labels):
        raise EdgeRuntimeError(f"{args.prompts} needs both easy and hard prompts to calibrate")
    scores, hidden = difficulty.prompt_features(backend, [r["prompt"] for r in rows], args.k)
    n_hard = sum(labels)
    if hidden is not None and min(n_hard, len(labels) - n_hard) < 2 * args.cv_folds:  # nested CV: folds of folds
        raise EdgeRuntimeError(f"the probe's {args.cv_folds}-fold cross-validation needs at least "
                               f"{2 * args.cv_folds} easy and {2 * args.cv_folds} hard prompts")
    easy = [r["prompt"] for r in rows if r["label"] == "easy"]
    answers = difficulty.answer_confidences(backend, easy, args.answer_tokens)
    window_threshold, trip_share = difficulty.window_threshold_for(answers, args.window, args.k,
                                                                   args.window_trip_share)
    cal = difficulty.calibrate(scores, labels, args.target_cloud_share, k=args.k, window=args.window,
                               window_threshold=window_threshold, window_trip_share=trip_share, model=model,
                               hidden=hidden, cv_folds=args.cv_folds, seed=args.seed)
    try:
        cal.save(args.out)
    except OSError as e:
        raise EdgeRuntimeError(f"cannot write {args.out}: {e.strerror}") from None
    if args.json:
        print(cal.to_json(), end="")
    else:
        print(f"{cal.n_prompts} prompts ({n_hard} hard, {cal.n_prompts - n_hard} easy), model {model}, "
              f"{time.perf_counter() - t0:.0f} s")
        if cal.probe is not None:
            print(f"prompt probe ({cal.probe.num_features} features, l2 {cal.probe.l2:g}): threshold "
                  f"{cal.probe_threshold:.3f} (target cloud share {cal.target_cloud_share:.0%})")
            print(f"  in-sample: cloud share {cal.probe_share:.1%}, agreement with labels {cal.probe_agreement:.1%}, "
                  f"AUROC {cal.probe_auroc:.3f}")
            print(f"  held out ({cal.cv_folds}-fold CV, seed {args.seed}): cloud share {cal.cv_share:.1%}, "
                  f"agreement {cal.cv_agreement:.1%}, AUROC {cal.cv_auroc:.3f}")
        else:
            print("no hidden states from this backend: the margin score leads")
        print(f"{'fallback: ' if cal.probe is not None else ''}margin score after k={cal.k} tokens: threshold "
              f"{cal.threshold:.3f} -> cloud share {cal.achieved_share:.1%} (target {cal.target_cloud_share:.0%}), "
              f"agreement with labels {cal.agreement:.1%}, AUROC {cal.auroc:.3f}")
        print(f"mid-stream: mean entropy over {cal.window} tokens > {cal.window_threshold:.3f} nats "
              f"(trips on {cal.window_trip_share:.1%} of the easy answers)")
        print(f"wrote {args.out}")
    return 0
