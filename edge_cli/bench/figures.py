"""Which benchmark wrote a JSON file (its kind, told by its keys, never its name), and its plot and rows.

For every file that `edge-runtime bench decode|kv|attention|batching|hybrid|spec|serve|cache --json FILE`
or `edge-runtime perplexity --json` writes: `recognise` tells the kind, `draw` returns a matplotlib figure and
rows of each figure beside its anchor, the ratio, the target and met / not met. Perplexity files are drawn
together (`POOLED`): each run is compared with the others. The builders live in `figures_engine` and
`figures_serving`, the parts they share in `figure_kit`. This module reads no directory and writes no file;
`report` does.
"""
from __future__ import annotations

from edge_cli.bench import figures_engine, figures_serving
from edge_cli.bench.figure_kit import _get, _isnum
from edge_cli.bench.figures_engine import SPEC_KEYS

BUILDERS = {**figures_engine.BUILDERS, **figures_serving.BUILDERS}
# The order of the page: the README's Benchmarks section.
KINDS = ["decode", "perplexity", "kv", "attention", "batching", "batching-draft", "hybrid", "cache", "serve", "spec",
         "mtp-heads", "mtp-curve"]
POOLED = {"perplexity"}  # kinds whose files make one section between them
assert set(KINDS) == set(BUILDERS)


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
    if isinstance(d.get("by_draft"), dict) and any(_isnum(v) for k, v in d.items() if k.startswith("draft_over_plain")):
        return "batching-draft"
    if isinstance(d.get("ttft_ms"), dict) and any(k in d["ttft_ms"] for k in ("local", "cloud", "auto")):
        return "hybrid"
    if isinstance(d.get("batched"), dict) and "concurrent_over_sequential" in d["batched"]:
        return "serve"
    if _isnum(d.get("cold_ttft_ms_p50")) and _isnum(d.get("exact_hit_ttft_ms_p50")):
        return "cache"
    if isinstance(d.get("mlp_shipped"), dict) and isinstance(d.get("attention"), dict):
        return "mtp-heads"
    if isinstance(d.get("generation"), dict) and isinstance(d.get("curve"), list) and d.get("arch") == "mlp":
        return "mtp-curve"
    if _isnum(d.get("ppl")) and isinstance(d.get("backend"), str):
        return "perplexity"
    return None


def draw(kind: str, d: dict):
    """Returns (title, caption, rows, figure) for a file `recognise` called `kind`.

    Args:
        d: the parsed file; for a `POOLED` kind, {file name: parsed file} of every file of that kind.
    """
    title, caption, rows, fig = BUILDERS[kind](d)
    for ax in fig.axes:
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8, loc="best")
    return title, caption, rows, fig
