"""`edge-runtime bench report`: one page of plots from a directory of benchmark JSON files.

Each file that `edge-runtime bench decode|kv|attention|batching|hybrid|spec --json FILE`
writes is recognised by its keys (not its name), drawn as one PNG on matplotlib's Agg
canvas (no display) and summarised in a table: each figure beside its anchor, the ratio,
the target and met / not met. `index.html` refers to the PNGs beside it by relative
paths and loads nothing else. A JSON file of unknown shape is listed as not recognised;
a file that is not JSON is named with its parse error; neither stops the report.

This module walks the directory and writes the page; what each kind of file means, its
plot and its rows, is `bench_figures`. It runs no benchmark and imports nothing from the engine.
"""
from __future__ import annotations

import argparse
import html
import json
import os
import re
import sys
import time
from dataclasses import dataclass, field

from edge_cli.bench.figures import KINDS, Row, draw, recognise
from edge_runtime.errors import EdgeRuntimeError


@dataclass(slots=True)
class Section:
    """One recognised file: its plot and its table."""
    kind: str
    source: str
    title: str
    caption: str = ""
    png: str | None = None
    rows: list[Row] = field(default_factory=list)


def build_report(src_dir: str, out_dir: str) -> tuple[list[Section], list[tuple[str, str]]]:
    """Reads every `*.json` in `src_dir`, writes one PNG per recognised file into `out_dir`.

    Returns:
        (sections, problems): the recognised files in benchmark order, and (file name, message)
        for each file that is not JSON, not recognised, or could not be drawn.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    if not os.path.isdir(src_dir):
        raise EdgeRuntimeError(f"bench report: no directory {src_dir!r} (run `edge-runtime bench NAME --json FILE`)")
    os.makedirs(out_dir, exist_ok=True)
    sections, problems = [], []
    for name in sorted(f for f in os.listdir(src_dir) if f.endswith(".json")):
        try:
            with open(os.path.join(src_dir, name), encoding="utf-8") as f:
                data = json.load(f)
        except json.JSONDecodeError as e:
            problems.append((name, f"not valid JSON (line {e.lineno}, column {e.colno}: {e.msg})"))
            continue
        except (OSError, UnicodeDecodeError) as e:
            problems.append((name, f"could not be read ({type(e).__name__}: {e})"))
            continue
        kind = recognise(data)
        if kind is None:
            problems.append((name, "not recognised (no known benchmark keys"
                                   + (f"; top-level keys: {', '.join(list(data)[:8])})" if isinstance(data, dict) else ")")))
            continue
        try:
            title, caption, rows, fig = draw(kind, data)
            png = re.sub(r"[^A-Za-z0-9._-]", "_", name[:-5])
            png += f"-{len(sections)}.png" if png + ".png" in {s.png for s in sections} else ".png"
            FigureCanvasAgg(fig).print_png(os.path.join(out_dir, png))
        except Exception as e:  # NOTE: a malformed file must not stop the rest of the report
            problems.append((name, f"recognised as {kind} but could not be drawn ({type(e).__name__}: {e})"))
            continue
        sections.append(Section(kind, name, title, caption + (f" Run {data['date']}." if data.get("date") else ""),
                                png, rows))
    sections.sort(key=lambda s: (KINDS.index(s.kind), s.source))
    return sections, problems


def _html_row(r: Row) -> str:
    cls, verdict = {True: ("met", "met"), False: ("notmet", "not met"), None: ("", "—" if r.target else "")}[r.met]
    cells = [r.figure, r.value, r.anchor, r.ratio, r.target]
    return ("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in cells)
            + f'<td class="{cls}">{verdict}</td></tr>')


def render_html(sections: list[Section], problems: list[tuple[str, str]], src_dir: str) -> str:
    met = sum(r.met is True for s in sections for r in s.rows)
    missed = sum(r.met is False for s in sections for r in s.rows)
    out = ["<!DOCTYPE html><html><head><meta charset='utf-8'><title>edge-runtime benchmarks</title><style>",
           "body{font-family:sans-serif;max-width:1800px;margin:1em auto;padding:0 1em;color:#222}"
           "img{max-width:100%;border:1px solid #ddd}table{border-collapse:collapse;margin:.5em 0 2em}"
           "td,th{border:1px solid #ccc;padding:.25em .6em;text-align:left;font-size:.92em}th{background:#f2f2f2}"
           ".met{color:#1e7b34;font-weight:bold}.notmet{color:#c0392b;font-weight:bold}.cap{color:#555}"
           "</style></head><body>",
           f"<h1>edge-runtime benchmarks</h1><p>From <code>{html.escape(src_dir)}</code>, "
           f"{time.strftime('%Y-%m-%d %H:%M')}: {len(sections)} files, targets {met} met, {missed} not met.</p><ul>"]
    for s in sections:
        n_met, misses = sum(r.met is True for r in s.rows), [r for r in s.rows if r.met is False]
        miss = "".join(f"; <span class='notmet'>not met</span>: {html.escape(r.ratio or r.value)} "
                       f"(target {html.escape(r.target)})" for r in misses)
        out.append(f"<li><a href='#{html.escape(s.source)}'>{html.escape(s.title)}</a> ({html.escape(s.source)}): "
                   f"{n_met} met{miss}</li>")
    out.append("</ul>")
    if problems:
        out.append("<h2>Files not shown</h2><ul>")
        out += [f"<li><b>{html.escape(n)}</b>: {html.escape(m)}</li>" for n, m in problems]
        out.append("</ul>")
    for s in sections:
        out.append(f"<h2 id='{html.escape(s.source)}'>{html.escape(s.title)}</h2>"
                   f"<p class='cap'><code>{html.escape(s.source)}</code>. {html.escape(s.caption)}</p>"
                   f"<img src='{html.escape(s.png)}' alt='{html.escape(s.title)}'><table><tr><th>figure</th>"
                   "<th>measured</th><th>anchor</th><th>ratio</th><th>target</th><th>met / not met</th></tr>")
        out += [_html_row(r) for r in s.rows]
        out.append("</table>")
    out.append("</body></html>\n")
    return "\n".join(out)


def run_report(args) -> int:
    """`edge-runtime bench report`: `args.dir` (default bench-results), `args.out` (default DIR/report)."""
    src = getattr(args, "dir", None) or "bench-results"
    out = getattr(args, "out", None) or os.path.join(src, "report")
    sections, problems = build_report(src, out)
    path = os.path.join(out, "index.html")
    with open(path, "w", encoding="utf-8") as f:
        f.write(render_html(sections, problems, src))
    for s in sections:
        verdicts = [r.met for r in s.rows if r.met is not None]
        print(f"{s.source}: {s.kind}, {len(s.rows)} figures, targets {verdicts.count(True)} met, "
              f"{verdicts.count(False)} not met -> {s.png}")
    for name, msg in problems:
        print(f"bench report: {name}: {msg}", file=sys.stderr)
    print(f"wrote {path}")
    return 0


def add_report_args(parser) -> None:
    """The `bench report` options, for the `bench` parser or a standalone one."""
    parser.add_argument("--dir", default="bench-results", help="report: directory of benchmark JSON files")
    parser.add_argument("--out", default=None, help="report: output directory (default DIR/report)")


if __name__ == "__main__":
    p = argparse.ArgumentParser(prog="python -m edge_cli.bench.report")
    add_report_args(p)
    sys.exit(run_report(p.parse_args()))
