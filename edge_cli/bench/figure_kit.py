"""The parts every benchmark kind's figure is built from: a table `Row`, number formatting, targets, plot helpers.

`figures` tells the kinds apart; `figures_engine` and `figures_serving` build each kind's plot and rows from
these. Plots use matplotlib's object API on an Agg canvas (no pyplot, no display). The benchmark files hold
target values but not which way they point; the defaults and the comparison operators are here. This module
knows no benchmark kind, reads no directory and writes no file.
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
                   "over_vllm_batch8": 1.0, "over_vllm_default": 1.0, "false_hits": 0,
                   "ngram.speedup_over_plain_grounded": 2.0}  # the last four: README only
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


def _target(d: dict, key: str, where: str = "targets"):
    t = _get(d.get(where) or {}, key) if isinstance(d.get(where), dict) else None
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



MACHINE = [("cpu_model", "CPU"), ("isa", "ISA variant"), ("threads", "threads"), ("commit", "commit")]


def machine(d: dict) -> dict:
    """CPU model, ISA variant, threads and commit a benchmark file names, None for each it does not.

    Files put them at the top (decode, serve, cache, perplexity) or under `machine` (kv, batching, spec);
    threads sit at the top, under `worker` (batching) or under `workload(s)` (spec).
    """
    out = {}
    for key, _ in MACHINE:
        places = [d, d.get("machine")] + ([d.get("worker"), d.get("workloads"), d.get("workload")]
                                          if key == "threads" else [])
        out[key] = next((p[key] for p in places if isinstance(p, dict) and p.get(key) not in (None, "")), None)
    return out
