"""What each benchmark's JSON file means: its kind (from its keys), one plot, and table rows.

For every file that `edge-runtime bench decode|kv|attention|batching|hybrid|spec --json FILE`
writes: `recognise` tells the kind from the keys (never the file name), `draw` returns a
matplotlib figure (object API, no pyplot, no display) and rows of each figure beside its
anchor, the ratio, the target and met / not met. The files hold target values but not
which way they point; that knowledge (from the benchmark modules and the README) is here.
This module does not read directories or write files; `bench_report` does.
"""
from __future__ import annotations

import math
import operator
from dataclasses import dataclass

OPS = {">=": operator.ge, "<=": operator.le, "<": operator.lt}
# The targets the benchmarks write; a file's own "targets" entry overrides these.
DEFAULT_TARGETS = {"decode_ratio": 1.0, "prefill_ratio": 1.0, "warm_start_to_first_token_s": 2.0,
                   "int8_over_fp16": 0.55, "capacity_ratio": 3.0, "waste_slots_per_seq": 16,
                   "prefix_ttft_speedup": 5.0, "mem_ratio_naive_over_tiled_16k": 8.0,
                   "speed_ratio_tiled_over_sdpa_16k": 0.8, "continuous_over_static": 1.8,
                   "continuous_over_sequential": 3.0, "ttft_auto_over_local": 1.2, "handoff_gap_ms_p50": 150,
                   "over_vllm_batch8": 1.0, "over_vllm_default": 1.0}  # the last two: README only
OURS, OURS2, PEER, TARGET = "#3b6ea5", "#8fb3d9", "#e07b39", "#c0392b"


@dataclass(slots=True)
class Row:
    """One table line: a figure beside its anchor."""
    figure: str
    value: str
    anchor: str = ""
    ratio: str = ""
    target: str = ""
    met: bool | None = None  # None: no target, or nothing measured to compare


def _isnum(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and not (isinstance(x, float) and math.isnan(x))


def _num(x, unit: str = "") -> str:
    if x is None:
        return "—"
    if not _isnum(x):
        return str(x)
    if isinstance(x, int) or not math.isfinite(x) or abs(x) >= 1000:
        s = f"{x:,.0f}" if math.isfinite(x) else str(x)
    else:
        s = f"{x:.3g}" if abs(x) < 10 else f"{x:.0f}" if abs(x) >= 100 and float(x).is_integer() else f"{x:.1f}"
    return f"{s} {unit}".rstrip()


def _pct(x) -> str:
    return f"{100 * x:.1f} %" if _isnum(x) else "—"


def _div(a, b):
    return a / b if _isnum(a) and _isnum(b) and b else None


def _get(d: dict, path: str):
    """`d["a.b"]` if that literal key exists, else `d["a"]["b"]`; None when absent."""
    if path in d:
        return d[path]
    for part in path.split("."):
        d = d.get(part) if isinstance(d, dict) else None
    return d


def _target(d: dict, key: str):
    t = _get(d.get("targets") or {}, key) if isinstance(d.get("targets"), dict) else None
    return t if _isnum(t) else DEFAULT_TARGETS.get(key)


def _stored(d: dict, key: str, a, b):
    """The ratio the benchmark stored (it may be rounded), else a / b."""
    return d[key] if _isnum(d.get(key)) else _div(a, b)


def _row(figure, value, anchor="", ratio=None, key="", target=None, op=">=", on=None, unit="") -> Row:
    """`on` is what the target is checked against (default: the ratio)."""
    x = ratio if on is None else on
    met = OPS[op](x, target) if target is not None and _isnum(x) else None
    return Row(figure, value, anchor, "" if ratio is None and not key else f"{_num(ratio)} ({key})" if key else _num(ratio),
               "" if target is None else f"{op} {_num(target, unit)}", met)


# ---- plotting helpers (matplotlib's object API on an Agg canvas: no pyplot, no global state)

def _fig(ncols: int, title: str, widths=None):
    from matplotlib.figure import Figure

    fig = Figure(figsize=(4.4 * ncols, 4.0), dpi=100, layout="constrained")
    fig.suptitle(title, fontsize=12, fontweight="bold")
    return fig, fig.subplots(1, ncols, squeeze=False, width_ratios=widths)[0]


def _bars(ax, labels, values, title, ylabel, colors=OURS, runs=None):
    """Bars with their values on top; `runs` (one list per bar) are drawn as dots at the bar's right."""
    ax.bar(labels, [v if _isnum(v) else 0 for v in values], color=colors, width=0.6)
    for i, v in enumerate(values):  # with dots, the value sits at the bar's left so neither hides the other
        ax.annotate(_num(v), (i - 0.28 if runs else i, v if _isnum(v) else 0), xytext=(0, 2), fontsize=8,
                    textcoords="offset points", ha="left" if runs else "center", va="bottom")
    for i, rs in enumerate(runs or []):
        if rs:
            ax.plot([i + 0.18] * len(rs), rs, "k.", ms=4, alpha=0.6, label="each run" if i == 0 else None)
    ax.set_title(title, fontsize=10)
    ax.set_ylabel(ylabel)
    ax.margins(y=0.18)
    ax.grid(axis="y", alpha=0.3)


def _grouped(ax, labels, series: dict, title, ylabel, colors):
    w = 0.8 / len(series)
    for j, (name, vals) in enumerate(series.items()):
        xs = [i + (j - (len(series) - 1) / 2) * w for i in range(len(labels))]
        b = ax.bar(xs, [v if _isnum(v) else 0 for v in vals], w, label=name, color=colors[j])
        ax.bar_label(b, labels=[_num(v) for v in vals], fontsize=7, padding=1)
    ax.set_xticks(range(len(labels)), labels, fontsize=8)
    ax.set_title(title, fontsize=10)
    ax.set_ylabel(ylabel)
    ax.margins(y=0.18)
    ax.grid(axis="y", alpha=0.3)


def _hline(ax, y, text, x=None, ls="--"):
    """A dashed target line, across the axes or over one bar at position `x`."""
    if not _isnum(y):
        return
    if x is None:
        ax.axhline(y, color=TARGET, ls=ls, lw=1.2, label=text)
    else:
        ax.hlines(y, x - 0.4, x + 0.4, color=TARGET, ls=ls, lw=1.5, label=text)


# ---- one builder per kind: (title, caption, rows, figure)

def _decode(d):
    n, l, w = d["native"], d["llama_cpp"], d.get("workload") or {}
    fig, axs = _fig(4, f"native vs llama.cpp: model {d.get('model', '?')}, {d.get('threads', '?')} threads")
    specs = [("prefill_tok_s", "prefill_runs", f"prefill, {w.get('prefill_prompt_tokens', '?')}-token prompt", "tok/s"),
             ("decode_tok_s", "decode_runs", f"decode, {w.get('decode_tokens', '?')} tokens", "tok/s"),
             ("warm_start_to_first_token_s", None, "warm start to first token", "s"),
             ("peak_rss_mib", None, "peak RSS", "MiB")]
    for ax, (key, runs, title, unit) in zip(axs, specs):
        _bars(ax, ["native", "llama.cpp"], [n.get(key), l.get(key)], title, unit, [OURS, PEER],
              runs and [n.get(runs), l.get(runs)])
    rows = []
    for ax, key, what in ((axs[0], "prefill_ratio", "prefill_tok_s"), (axs[1], "decode_ratio", "decode_tok_s")):
        t = _target(d, key)
        _hline(ax, _isnum(l.get(what)) and t and l[what] * t, f"target: native >= {_num(t)} x llama.cpp", 0)
        rows.append(_row(f"{what.split('_')[0]} tok/s", _num(n.get(what)), f"llama.cpp {_num(l.get(what))}",
                         _stored(d, key, n.get(what), l.get(what)), key, t))
    warm = _target(d, "warm_start_to_first_token_s")
    _hline(axs[2], warm, f"target <= {_num(warm)} s")
    ws, rss = "warm_start_to_first_token_s", "peak_rss_mib"
    rows += [_row("warm start to first token", _num(n.get(ws), "s"), f"llama.cpp {_num(l.get(ws), 's')}",
                  _div(n.get(ws), l.get(ws)), "native / llama.cpp", warm, "<=", n.get(ws), "s (native)"),
             _row("peak RSS", _num(n.get(rss), "MiB"), f"llama.cpp {_num(l.get(rss), 'MiB')}",
                  _div(n.get(rss), l.get(rss)), "native / llama.cpp")]
    cap = (f"Each backend in its own process, same GGUF; medians of {w.get('repeats', '?')} runs (dots: each run); "
           f"decode after a {w.get('decode_prompt_tokens', '?')}-token prompt. Ratios: native / llama.cpp.")
    return "decode: native vs llama.cpp", cap, rows, fig


def _kv(d):
    per, c, p = d["kv_bytes_per_token"], d.get("capacity") or {}, d.get("prefix") or {}
    fig, axs = _fig(3, f"paged KV cache: model {d.get('model', '?')}")
    dtypes = list(per)
    _bars(axs[0], dtypes, [per[k] / 1024 if _isnum(per[k]) else None for k in dtypes],
          "KV bytes per token (all layers)", "KiB / token", [PEER if k == "int8" else OURS for k in dtypes])
    t_int8 = _target(d, "int8_over_fp16")
    fp16 = per.get("fp16")
    _hline(axs[0], _isnum(fp16) and fp16 * t_int8 / 1024, f"target: int8 <= {_num(t_int8)} x fp16",
           dtypes.index("int8") if "int8" in dtypes else None)
    _bars(axs[1], ["paged", "contiguous"], [c.get("paged_seqs"), c.get("contiguous_seqs")],
          f"{_num(c.get('seq_tokens'))}-token sequences in {_num(c.get('budget_mib'))} MiB", "sequences", [OURS, PEER])
    t_cap = _target(d, "capacity_ratio")
    _hline(axs[1], _isnum(c.get("contiguous_seqs")) and c["contiguous_seqs"] * t_cap,
           f"target: paged >= {_num(t_cap)} x contiguous", 0)
    _bars(axs[2], ["cached prefix", "cold"], [p.get("cached_ttft_ms"), p.get("cold_ttft_ms")],
          f"TTFT, {_num(p.get('prompt_tokens'))}-token prompt", "ms", [OURS, PEER],
          [p.get("cached_runs_ms"), p.get("cold_runs_ms")])
    t_pre = _target(d, "prefix_ttft_speedup")
    _hline(axs[2], _isnum(p.get("cold_ttft_ms")) and p["cold_ttft_ms"] / t_pre, f"target: cold / {_num(t_pre)}", 0)
    rows = [_row(f"KV bytes / token, {k}", _num(per[k]), f"fp16 {_num(fp16)}", _div(per[k], fp16),
                 "int8_over_fp16" if k == "int8" else f"{k} / fp16", t_int8 if k == "int8" else None, "<=")
            for k in dtypes if k != "fp16"]
    bs, waste = d.get("block_size"), d.get("waste_slots_per_seq")
    rows += [_row("concurrent sequences, paged", _num(c.get("paged_seqs")),
                  f"contiguous {_num(c.get('contiguous_seqs'))} ({_num(c.get('contiguous_tokens_per_seq'))} tokens each)",
                  _stored(d, "capacity_ratio", c.get("paged_seqs"), c.get("contiguous_seqs")), "capacity_ratio", t_cap),
             _row("unused slots per live sequence", _num(waste), f"block size {_num(bs)}", _div(waste, bs),
                  "waste / block size", _target(d, "waste_slots_per_seq"), "<", waste, "slots"),
             _row("TTFT with the prefix cached", _num(p.get("cached_ttft_ms"), "ms"),
                  f"cold {_num(p.get('cold_ttft_ms'), 'ms')}",
                  _stored(d, "prefix_ttft_speedup", p.get("cold_ttft_ms"), p.get("cached_ttft_ms")),
                  "prefix_ttft_speedup", t_pre)]
    cap = (f"int8 includes its fp32 scales; capacity: paged blocks vs a contiguous preallocation of the full context; "
           f"prefix: KV {p.get('kv_dtype', '?')}, medians (dots: each run).")
    return "kv: paged KV cache", cap, rows, fig


def _attention(d):
    res = {int(k): v for k, v in d["results"].items()}
    ns, kernels = sorted(res), ["tiled", "naive", "sdpa"]
    fig, axs = _fig(3, "attention kernels: tiled (ours) vs naive vs torch SDPA")
    style = {"tiled": (OURS, "o", "tiled (ours)"), "naive": (PEER, "s", "naive"), "sdpa": ("#555555", "^", "torch SDPA")}
    for ax, key, title, unit in ((axs[0], "ms", "causal prefill time", "ms"), (axs[1], "peak_mib", "peak extra memory", "MiB")):
        for k in kernels:
            pts = [(n, res[n][k][key]) for n in ns if _isnum((res[n].get(k) or {}).get(key))]
            ax.plot([a for a, _ in pts], [b for _, b in pts], marker=style[k][1], color=style[k][0], label=style[k][2])
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(ns, [f"{n:,}" for n in ns])
        ax.set_xlabel("sequence length N")
        ax.set_ylabel(f"{unit} (log)")
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3, which="both")
    dec = d.get("decode") or {}
    _grouped(axs[2], list(dec), {"paged decode": [v.get("paged_decode_us") for v in dec.values()],
                                 "gather + SDPA": [v.get("gather_then_sdpa_us") for v in dec.values()]},
             "decode attention, 1 token, by KV dtype", "µs", [OURS, PEER])
    t_mem, t_speed, rows = _target(d, "mem_ratio_naive_over_tiled_16k"), _target(d, "speed_ratio_tiled_over_sdpa_16k"), []
    for n in ns:
        r = {k: res[n].get(k) or {} for k in kernels}
        tm, big = (r["tiled"].get("ms"), r["tiled"].get("peak_mib")), n == 16384
        rows += [_row(f"N={n:,}: time, tiled", _num(tm[0], "ms"), f"naive {_num(r['naive'].get('ms'), 'ms')}",
                      _div(r["naive"].get("ms"), tm[0]), "naive / tiled"),
                 _row(f"N={n:,}: time, tiled", _num(tm[0], "ms"), f"SDPA {_num(r['sdpa'].get('ms'), 'ms')}",
                      _stored(d, "speed_ratio_tiled_over_sdpa_16k", r["sdpa"].get("ms"), tm[0]) if big
                      else _div(r["sdpa"].get("ms"), tm[0]), "speed_ratio_tiled_over_sdpa_16k" if big else "SDPA / tiled",
                      t_speed if big else None),
                 _row(f"N={n:,}: peak memory, tiled", _num(tm[1], "MiB"), f"naive {_num(r['naive'].get('peak_mib'), 'MiB')}",
                      _stored(d, "mem_ratio_naive_over_tiled_16k", r["naive"].get("peak_mib"), tm[1]) if big
                      else _div(r["naive"].get("peak_mib"), tm[1]), "mem_ratio_naive_over_tiled_16k" if big
                      else "naive / tiled", t_mem if big else None)]
    rows += [_row(f"decode attention, {k} KV", _num(v.get("paged_decode_us"), "µs"),
                  f"gather + SDPA {_num(v.get('gather_then_sdpa_us'), 'µs')}",
                  _stored(v, "paged_decode_speedup", v.get("gather_then_sdpa_us"), v.get("paged_decode_us")),
                  "paged_decode_speedup") for k, v in dec.items()]
    w = d.get("workload") or {}
    per_head = [f"{n:,}" for n in ns if (res[n].get("naive") or {}).get("mode") == "per_head"]
    cap = (f"{w.get('num_heads', '?')} query / {w.get('num_kv_heads', '?')} KV heads, head_dim {w.get('head_dim', '?')}, "
           f"{w.get('dtype', '?')}, {d.get('threads', '?')} threads; peak memory is the extra RSS of one call."
           + (f" Naive ran head by head at N={', '.join(per_head)}." if per_head else ""))
    return "attention: kernels at each length", cap, rows, fig


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


SPEC_KEYS = [("mtp.speedup_over_plain", "MTP vs plain decode", "plain decode 1.0"),
             ("mtp.speedup_over_llama_cpp", "MTP vs llama.cpp", "llama.cpp 1.0"),
             ("ngram.speedup_over_plain_grounded", "n-gram vs plain (grounded prompts)", "plain decode 1.0")]


def _spec(d):
    keys = [(k, name, anchor) for k, name, anchor in SPEC_KEYS if _isnum(_get(d, k))]
    fig, axs = _fig(2, "speculative decoding", [3, 1])
    _bars(axs[0], [n.replace(" vs ", "\nvs ").replace(" (", "\n(") for _, n, _ in keys], [_get(d, k) for k, _, _ in keys], "speedup",
          "x anchor", OURS)
    axs[0].axhline(1.0, color="#555555", lw=1, label="anchor (1.0)")
    for i, (k, _, _) in enumerate(keys):
        _hline(axs[0], _target(d, k), "target" if i == 0 else None, i)
    _bars(axs[1], ["MTP"], [_get(d, "mtp.mean_accepted")], "accepted draft tokens\nper step (mean)", "tokens")
    rows = [_row(name, _num(_get(d, k)), anchor, _get(d, k), k, _target(d, k)) for k, name, anchor in keys]
    if _isnum(_get(d, "mtp.mean_accepted")):
        rows.append(_row("MTP accepted tokens per step", _num(_get(d, "mtp.mean_accepted")), "", None, "",
                         _target(d, "mtp.mean_accepted"), ">=", _get(d, "mtp.mean_accepted")))
    return "spec: speculative decoding", "Speedups are tok/s over the anchor's tok/s.", rows, fig


def recognise(d) -> str | None:
    """Which benchmark wrote `d`, from its keys."""
    if not isinstance(d, dict):
        return None
    if any(_isnum(_get(d, k)) for k, _, _ in SPEC_KEYS) or _isnum(_get(d, "mtp.mean_accepted")):
        return "spec"  # first: a spec file may also carry decode-like figures
    if all(isinstance(d.get(k), dict) and "decode_tok_s" in d[k] for k in ("native", "llama_cpp")):
        return "decode"
    if isinstance(d.get("kv_bytes_per_token"), dict):
        return "kv"
    if isinstance(d.get("results"), dict) and any(isinstance(v, dict) and "tiled" in v for v in d["results"].values()):
        return "attention"
    if isinstance(d.get("continuous"), dict) and "tokens_per_s" in d["continuous"]:
        return "batching"
    if isinstance(d.get("ttft_ms"), dict) and any(k in d["ttft_ms"] for k in ("local", "cloud", "auto")):
        return "hybrid"
    return None


BUILDERS = {"decode": _decode, "kv": _kv, "attention": _attention, "batching": _batching, "hybrid": _hybrid,
            "spec": _spec}
KINDS = list(BUILDERS)  # the order of the page


def draw(kind: str, d: dict):
    """Returns (title, caption, rows, figure) for a file `recognise` called `kind`."""
    title, caption, rows, fig = BUILDERS[kind](d)
    for ax in fig.axes:
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8, loc="best")
    return title, caption, rows, fig
