"""What the serving benchmarks' files mean: batching, batching with drafts, hybrid, cache and serve.

Each builder takes the parsed JSON of one `edge-runtime bench batching|hybrid|cache|serve --json FILE`
(`bench batching --draft ngram` writes the batching-draft kind) and returns (title, caption, rows, figure).
Which builder a file goes to is `figures.recognise`; the report page is `report`. This module reads no
directory and writes no file.
"""
from __future__ import annotations

import math

from edge_cli.bench.figure_kit import (OURS, OURS2, PEER, Row, _bars, _div, _fig, _grouped, _hline, _isnum, _num,
                                       _pct, _row, _stored, _target)

BATCH_RUNS = [("continuous", "continuous", OURS), ("static", "static", OURS2), ("sequential", "sequential", OURS2),
              ("peer_batch8", "vLLM, batch 8", PEER), ("continuous_default_batch", "continuous, batch {}", OURS),
              ("peer_default", "vLLM, default batch", PEER)]
BATCH_VS = [("static", "continuous", "continuous_over_static"),
            ("sequential", "continuous", "continuous_over_sequential"),
            ("peer_batch8", "continuous", "over_vllm_batch8"),
            ("peer_default", "continuous_default_batch", "over_vllm_default")]


def _batching(d):
    runs = [(k, label.format((d[k] or {}).get("max_batch", "?")), col) for k, label, col in BATCH_RUNS
            if isinstance(d.get(k), dict)]
    wk, w = d.get("worker") or {}, d.get("workload") or {}
    quant = "GGUF int4 kernels" if wk.get("quant") == "auto" else f"{wk.get('quant', '?')} weights"
    fig, axs = _fig(3, f"batching: {w.get('requests', '?')} requests at once, worker max batch "
                       f"{wk.get('max_batch', '?')}, {quant}")
    labels = [lab.replace(", ", "\n") for _, lab, _ in runs]
    _bars(axs[0], labels, [d[k].get("tokens_per_s") for k, _, _ in runs], "generated tokens / s", "tok/s",
          [c for _, _, c in runs])
    for (anchor, _, key), ls in zip(BATCH_VS[:2], ("--", ":")):
        if anchor in d and _isnum(d[anchor].get("tokens_per_s")):
            t = _target(d, key)
            _hline(axs[0], d[anchor]["tokens_per_s"] * t, f"target: continuous >= {_num(t)} x {anchor}",
                   [k for k, _, _ in runs].index("continuous"), ls)
    for ax, m, title, unit, scale in ((axs[1], "ttft_ms", "time to first token", "s", 1e-3),
                                      (axs[2], "itl_ms", "inter-token latency", "ms", 1)):
        _grouped(ax, labels, {p: [d[k].get(f"{m}_{p}") * scale if _isnum(d[k].get(f"{m}_{p}")) else None
                                  for k, _, _ in runs] for p in ("p50", "p99")}, title, unit, [OURS, OURS2])
    rows = []
    for anchor, ours, key in BATCH_VS:
        a, o = d.get(anchor), d.get(ours)
        if not (isinstance(a, dict) and isinstance(o, dict)):
            continue
        name, aname = dict((k, lab) for k, lab, _ in runs)[ours], dict((k, lab) for k, lab, _ in runs)[anchor]
        rows.append(_row(f"tok/s, {name}", _num(o.get("tokens_per_s")), f"{aname} {_num(a.get('tokens_per_s'))}",
                         _stored(d, key, o.get("tokens_per_s"), a.get("tokens_per_s")), key, _target(d, key)))
        rows.append(Row(f"TTFT p50 · ITL p50, {name}",
                        f"{_num(_div(o.get('ttft_ms_p50'), 1000), 's')} · {_num(o.get('itl_ms_p50'), 'ms')}",
                        f"{aname} {_num(_div(a.get('ttft_ms_p50'), 1000), 's')} · {_num(a.get('itl_ms_p50'), 'ms')}",
                        f"{_num(_div(o.get('ttft_ms_p50'), a.get('ttft_ms_p50')))} · "
                        f"{_num(_div(o.get('itl_ms_p50'), a.get('itl_ms_p50')))} (ours / anchor, lower is better)"))
    cap = (f"{w.get('short_tokens', '?')} or {w.get('long_tokens', '?')} new tokens per request, arrival "
           f"{w.get('arrival', '?')}; TTFT counts from the arrival of the whole workload; "
           f"{wk.get('threads', '?')} threads.")
    peer = " and the vLLM peer" if any(k.startswith("peer") for k, _, _ in runs) else ""
    return f"batching: {w.get('requests', '?')} requests, {quant}{peer}", cap, rows, fig


def _hybrid(d):
    ttft, r = d["ttft_ms"], d.get("routing") or {}
    fig, axs = _fig(3, f"hybrid runtime: {d.get('prompts', '?')} prompts, {d.get('threads', '?')} threads each side")
    routes = [k for k in ("local", "cloud", "auto") if isinstance(ttft.get(k), dict)]
    _bars(axs[0], routes, [ttft[k].get("p50") for k in routes], "time to first token, p50", "ms",
          [PEER if k == "cloud" else OURS for k in routes], [ttft[k].get("all") for k in routes])
    t_ttft = _target(d, "ttft_auto_over_local")
    if "auto" in routes and _isnum((ttft.get("local") or {}).get("p50")):
        _hline(axs[0], ttft["local"]["p50"] * t_ttft, f"target: auto <= {_num(t_ttft)} x local", routes.index("auto"))
    gaps = [d.get("handoff_gap_ms") or [], d.get("failover_gap_ms") or []]
    ax = axs[1]
    ax.boxplot([g or [math.nan] for g in gaps], tick_labels=["hand-off", "failover"], widths=0.5)
    for i, g in enumerate(gaps):
        ax.plot([i + 1] * len(g), g, "k.", ms=4, alpha=0.6, label="each run" if i == 0 else None)
    t_hand, t_fail = _target(d, "handoff_gap_ms_p50"), d.get("failover_target_ms")
    _hline(ax, t_hand, f"target hand-off <= {_num(t_hand)} ms", 1)
    _hline(ax, t_fail, f"target failover <= 300 + prefill = {_num(t_fail)} ms", 2, ":")
    ax.set_title("gaps in the token stream (box: quartiles, line: median)", fontsize=10)
    ax.set_ylabel("ms")
    ax.grid(axis="y", alpha=0.3)
    ax.set_ylim(0, 1.5 * max([x for x in [*gaps[0], *gaps[1], t_hand, t_fail] if _isnum(x)] or [1]))
    _grouped(axs[2], ["cloud share", "agreement"], {"in-sample": [r.get("cloud_share"), r.get("agreement")],
                                                    "held out (CV)": [r.get("cv_cloud_share"), r.get("cv_agreement")]},
             f"routing, {_num(r.get('prompts'))} labelled prompts", "fraction", [OURS, OURS2])
    _hline(axs[2], r.get("target_cloud_share"), f"target cloud share {_pct(r.get('target_cloud_share'))}", 0)
    local = (ttft.get("local") or {}).get("p50")
    rows = [_row(f"TTFT p50, {k}", _num(ttft[k].get("p50"), "ms"), f"local {_num(local, 'ms')}",
                 _stored(d, "ttft_auto_over_local", ttft[k].get("p50"), local) if k == "auto"
                 else _div(ttft[k].get("p50"), local), "ttft_auto_over_local" if k == "auto" else f"{k} / local",
                 t_ttft if k == "auto" else None, "<=") for k in routes if k != "local"]
    hand, fail, pre = d.get("handoff_gap_ms_p50"), d.get("failover_gap_ms_p50"), d.get("failover_local_prefill_ms_p50")
    rows += [_row(f"hand-off gap p50 ({len(gaps[0])} runs)", _num(hand, "ms"), f"target {_num(t_hand, 'ms')}",
                  _div(hand, t_hand), "gap / target", t_hand, "<=", hand, "ms"),
             _row(f"failover gap p50 ({len(gaps[1])} runs)", _num(fail, "ms"), f"device prefill of the text so far "
                  f"{_num(pre, 'ms')}", _div(fail, t_fail), "gap / (300 + prefill)", t_fail, "<=", fail, "ms"),
             Row("cloud share, in-sample / held out", f"{_pct(r.get('cloud_share'))} / {_pct(r.get('cv_cloud_share'))}",
                 f"target share {_pct(r.get('target_cloud_share'))}",
                 f"{_num(_div(r.get('cloud_share'), r.get('target_cloud_share')))} share / target"),
             Row("agreement with labels, in-sample / held out", f"{_pct(r.get('agreement'))} / {_pct(r.get('cv_agreement'))}",
                 f"hard prompts in labels {_pct(r.get('hard_share_in_labels'))}",
                 f"{_num(r.get('cv_auroc'))} (held-out AUROC)")]
    cap = (f"Model {d.get('model', '?')}; routing scorer {r.get('scorer', '?')}, in-sample on the prompts it was "
           f"fitted on, held out by {r.get('cv_folds', '?')}-fold cross-validation. The cloud share is a calibration "
           "target (no met / not met).")
    return "hybrid: routes, hand-off and failover", cap, rows, fig



DRAFT_RUNS = [("batching", "draft_over_plain_batching", "{requests}-request workload, max batch {max_batch}"),
              ("grounded_one_at_a_time", "draft_over_plain_grounded", "grounded prompts, one at a time"),
              ("grounded_two_at_a_time", "draft_over_plain_grounded_two_at_a_time", "grounded prompts, two at a time")]


def _batching_draft(d):
    draft, by = d.get("draft", "?"), d["by_draft"]
    plain, ours = by.get("none") or {}, by.get(draft) or {}
    names = {"requests": (d.get("workload") or {}).get("requests", "?"),
             "max_batch": (d.get("worker") or {}).get("max_batch", "?")}
    runs = [(key, ratio, label.format(**names)) for key, ratio, label in DRAFT_RUNS
            if isinstance(plain.get(key), dict) and isinstance(ours.get(key), dict)]
    fig, axs = _fig(2, f"the worker with --draft {draft} against --draft none, measured in turns")
    labels = [label.replace(", ", ",\n").replace("workload, ", "workload,\n") for _, _, label in runs]
    _grouped(axs[0], labels, {"--draft none": [plain[k].get("tokens_per_s") for k, _, _ in runs],
                              f"--draft {draft}": [ours[k].get("tokens_per_s") for k, _, _ in runs]},
             "generated tokens / s", "tok/s", [PEER, OURS])
    ratios = [_stored(d, r, ours[k].get("tokens_per_s"), plain[k].get("tokens_per_s")) for k, r, _ in runs]
    _bars(axs[1], labels, ratios, f"--draft {draft} over --draft none", "ratio", OURS)
    axs[1].tick_params(axis="x", labelsize=8)
    axs[1].axhline(1.0, color="#555555", lw=1, label="no change (1.0)")
    for i, (_, r, _) in enumerate(runs):
        _hline(axs[1], _target(d, r, "draft_targets"), "target (>=)" if i == 0 else None, i)
    rows = [_row(f"tok/s with --draft {draft}, {label}", _num(ours[k].get("tokens_per_s")),
                 f"--draft none {_num(plain[k].get('tokens_per_s'))}", ratio, r, _target(d, r, "draft_targets"))
            for (k, r, label), ratio in zip(runs, ratios)]
    acc, prop = ours.get("draft_accepted"), ours.get("draft_proposed")
    rows += [Row("drafts accepted", f"{_num(acc)} of {_num(prop)}", "", f"{_pct(_div(acc, prop))} acceptance"),
             Row("same outputs, request by request", f"workload {d.get('identical_batching', '—')}, grounded "
                 f"{d.get('identical_grounded', '—')}", "--draft none")]
    cap = (f"Both workers up at once, measured in turns (ABBA for the workload, alternating for the grounded "
           f"prompts); ratios are tok/s with drafts over tok/s without. {d.get('measured', '')}".rstrip())
    return f"batching with drafts: --draft {draft} vs none", cap, rows, fig


SERVE_CONFIGS = [("batched", "--max-batch {}", OURS), ("single_stream", "--max-batch 1", PEER)]


def _serve(d):
    w = d.get("workload") or {}
    n = w.get("requests", "?")
    configs = [(k, label.format(max(8, n) if isinstance(n, int) else 8), c) for k, label, c in SERVE_CONFIGS
               if isinstance(d.get(k), dict)]
    fig, axs = _fig(2, f"serve: {n} streamed chat requests of {w.get('tokens_per_request', '?')} tokens, "
                       f"{d.get('threads', '?')} threads")
    _grouped(axs[0], ["one at a time", f"{n} at once"],
             {label: [(d[k].get(s) or {}).get("tokens_per_s") for s in ("sequential", "concurrent")]
              for k, label, _ in configs}, "aggregate decode throughput", "tok/s", [c for _, _, c in configs])
    _grouped(axs[1], ["idle", "behind a long answer"],
             {label: [d[k].get("short_idle_ttft_ms"), d[k].get("short_behind_long_ttft_ms")]
              for k, label, _ in configs}, f"a {w.get('short_request_tokens', '?')}-token request's time to first "
             "token", "ms (log)", [c for _, _, c in configs])
    axs[1].set_yscale("log")
    rows = []
    for k, label, _ in configs:
        r, first = d[k], k == configs[0][0]
        seq, conc = r.get("sequential") or {}, r.get("concurrent") or {}
        t_conc, t_short = _target(d, "concurrent_over_sequential"), _target(d, "short_ttft_ratio")
        if first:
            _hline(axs[0], _isnum(seq.get("tokens_per_s")) and seq["tokens_per_s"] * t_conc,
                   f"target: at once >= {_num(t_conc)} x one at a time ({label})", 1)
            _hline(axs[1], _isnum(r.get("short_idle_ttft_ms")) and r["short_idle_ttft_ms"] * t_short,
                   f"target: behind <= {_num(t_short)} x idle ({label})", 1)
        rows += [_row(f"{n} at once, tok/s, {label}", _num(conc.get("tokens_per_s")),
                      f"one at a time {_num(seq.get('tokens_per_s'))}",
                      _stored(r, "concurrent_over_sequential", conc.get("tokens_per_s"), seq.get("tokens_per_s")),
                      "concurrent_over_sequential", t_conc if first else None),
                 _row(f"short request TTFT behind a long answer, {label}",
                      _num(r.get("short_behind_long_ttft_ms"), "ms"),
                      f"idle {_num(r.get('short_idle_ttft_ms'), 'ms')}",
                      _stored(r, "short_ttft_ratio", r.get("short_behind_long_ttft_ms"), r.get("short_idle_ttft_ms")),
                      "short_ttft_ratio", t_short if first else None, "<="),
                 Row(f"{n} at once: TTFT p50 / p99 · ITL p50 / p99, {label}",
                     f"{_num(conc.get('ttft_ms_p50'))} / {_num(conc.get('ttft_ms_p99'), 'ms')} · "
                     f"{_num(conc.get('itl_ms_p50'))} / {_num(conc.get('itl_ms_p99'), 'ms')}",
                     f"one at a time {_num(seq.get('ttft_ms_p50'))} / {_num(seq.get('ttft_ms_p99'), 'ms')} · "
                     f"{_num(seq.get('itl_ms_p50'))} / {_num(seq.get('itl_ms_p99'), 'ms')}")]
    for ax in axs:  # room for the legend above the bars and the target
        ax.set_ylim(top=ax.get_ylim()[1] * (4 if ax.get_yscale() == "log" else 1.3))
    cap = (f"A real `serve` driven by the `openai` client, streamed greedy answers (`ignore_eos`); the short "
           f"request's wait is timed alone and while a {w.get('long_answer_tokens', '?')}-token answer streams. "
           f"The --max-batch 1 server in the same run is the anchor (no targets).")
    return "serve: one at a time and at once", cap, rows, fig


def _cache(d):
    w = d.get("workload") or {}
    fig, axs = _fig(2, f"response cache: {w.get('pairs', '?')} pairs through a real serve, "
                       f"{w.get('max_tokens', '?')}-token answers")
    keys = [("cold_ttft_ms", "cold (local)", PEER), ("exact_hit_ttft_ms", "exact hit", OURS),
            ("semantic_hit_ttft_ms", "semantic hit", OURS2)]
    _bars(axs[0], [label for _, label, _ in keys], [d.get(f"{k}_p50") for k, _, _ in keys], "time to first token, "
          "p50 (dots: p99)", "ms", [c for _, _, c in keys])
    p99 = [(i, d[f"{k}_p99"]) for i, (k, _, _) in enumerate(keys) if _isnum(d.get(f"{k}_p99"))]
    axs[0].plot([i for i, _ in p99], [v for _, v in p99], "k.", ms=6, label="p99")
    cold, exact, sem = (d.get(f"{k}_p50") for k, _, _ in keys)
    t_hit, t_ratio = _target(d, "hit_p50_ms"), _target(d, "hit_over_cold")
    _hline(axs[0], t_hit, f"target: hit p50 <= {_num(t_hit, 'ms')}", 1)
    _hline(axs[0], _isnum(cold) and t_ratio and cold / t_ratio, f"target: hit <= cold / {_num(t_ratio)}", 1, ":")
    hit_n, miss_n = w.get("should_hit"), w.get("near_misses")
    _bars(axs[1], ["should-hit questions\nserved from cache", "near-misses\nserved from cache"],
          [d.get("semantic_hit_rate"), _div(d.get("false_hits"), miss_n)], "semantic cache decisions", "fraction",
          [OURS, PEER])
    rows = [_row("exact hit TTFT p50", _num(exact, "ms"), f"cold {_num(cold, 'ms')}",
                 _stored(d, "hit_over_cold", cold, exact), "hit_over_cold", t_ratio),
            _row("exact hit TTFT p50, absolute", _num(exact, "ms"), f"p99 {_num(d.get('exact_hit_ttft_ms_p99'), 'ms')}",
                 None, "", t_hit, "<=", exact, "ms"),
            _row("semantic hit TTFT p50", _num(sem, "ms"), f"cold {_num(cold, 'ms')}", _div(cold, sem), "cold / hit",
                 t_hit, "<=", sem, "ms"),
            Row("exact hits on repeated questions", f"{_num(d.get('exact_hits'))} of {_num(d.get('repeats'))}"),
            Row("semantic hit rate on should-hit questions", _pct(d.get("semantic_hit_rate")),
                f"{_num(hit_n)} should-hit questions"),
            _row("false hits on near-misses", f"{_num(d.get('false_hits'))} of {_num(miss_n)}", "", None, "",
                 _target(d, "false_hits"), "<=", d.get("false_hits"))]
    cap = ("Each pair's first question is answered cold, asked again word for word (exact hit), then its second "
           "question is asked (a paraphrase that should hit, or a near-miss that must not)."
           + (" The pairs are the ones the thresholds were calibrated on: in-sample." if w.get("in_sample") else ""))
    return "cache: response cache hits against a cold answer", cap, rows, fig


BUILDERS = {"batching": _batching, "batching-draft": _batching_draft, "hybrid": _hybrid, "cache": _cache,
            "serve": _serve}
