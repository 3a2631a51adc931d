"""`edge-runtime bench report`: the one page to read first, plots and targets from a directory of benchmark JSON.

Each file that `edge-runtime bench decode|kv|attention|batching|hybrid|spec|serve|cache --json FILE` or
`edge-runtime perplexity --json` writes is recognised by its keys (not its name), drawn as one PNG on
matplotlib's Agg canvas (no display; the perplexity files together as one) and summarised in a table: each
figure beside its anchor, the ratio, the target and met / not met, under the CPU, ISA variant, threads and
commit the file names. The page opens with every target of every file in one table. `index.html` refers to
the PNGs beside it by relative paths and loads nothing else (no scripts, no fonts, no CDN). A JSON file of
unknown shape is listed as not recognised; a file that is not JSON is named with its parse error; neither
stops the report.

This module walks the directory and writes the page; what each kind of file means, its plot and its rows, is
`figures`. It runs no benchmark and imports nothing from the engine.
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

from edge_cli.bench.figure_kit import MACHINE, Row, machine
from edge_cli.bench.figures import KINDS, POOLED, draw, recognise
from edge_runtime.errors import EdgeRuntimeError


@dataclass(slots=True)
class Section:
    """One recognised file (or the files of a pooled kind): its plot, its table and the runs' machines."""
    kind: str
    source: str
    title: str
    caption: str = ""
    png: str | None = None
    rows: list[Row] = field(default_factory=list)
    runs: list[tuple[str, dict]] = field(default_factory=list)  # (file name, machine(file) plus its date)


def _load(path: str, name: str, problems: list):
    """The parsed file, or None after naming the problem."""
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        problems.append((name, f"not valid JSON (line {e.lineno}, column {e.colno}: {e.msg})"))
    except (OSError, UnicodeDecodeError) as e:
        problems.append((name, f"could not be read ({type(e).__name__}: {e})"))
    return None


def build_report(src_dir: str, out_dir: str) -> tuple[list[Section], list[tuple[str, str]]]:
    """Reads every `*.json` in `src_dir`, writes one PNG per recognised file (per pooled kind) into `out_dir`.

    Returns:
        (sections, problems): the recognised files in benchmark order, and (file name, message)
        for each file that is not JSON, not recognised, or could not be drawn.
    """
    if not os.path.isdir(src_dir):
        raise EdgeRuntimeError(f"bench report: no directory {src_dir!r} (run `edge-runtime bench NAME --json FILE`)")
    os.makedirs(out_dir, exist_ok=True)
    sections, problems, pooled = [], [], {}
    for name in sorted(f for f in os.listdir(src_dir) if f.endswith(".json")):
        data = _load(os.path.join(src_dir, name), name, problems)
        if data is None:
            continue
        kind = recognise(data)
        if kind is None:
            problems.append((name, "not recognised (no known benchmark keys"
                                   + (f"; top-level keys: {', '.join(list(data)[:8])})" if isinstance(data, dict) else ")")))
        elif kind in POOLED:
            pooled.setdefault(kind, {})[name] = data
        else:
            _add_section(sections, problems, kind, {name: data}, data, name[:-5], out_dir)
    for kind, files in pooled.items():
        _add_section(sections, problems, kind, files, files, kind, out_dir)
    sections.sort(key=lambda s: (KINDS.index(s.kind), s.source))
    return sections, problems


def _add_section(sections, problems, kind: str, files: dict, data, stem: str, out_dir: str) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    source = ", ".join(files)
    try:
        title, caption, rows, fig = draw(kind, data)
        png = re.sub(r"[^A-Za-z0-9._-]", "_", stem)
        png += f"-{len(sections)}.png" if png + ".png" in {s.png for s in sections} else ".png"
        FigureCanvasAgg(fig).print_png(os.path.join(out_dir, png))
    except Exception as e:  # NOTE: a malformed file must not stop the rest of the report
        problems.append((source, f"recognised as {kind} but could not be drawn ({type(e).__name__}: {e})"))
        return
    runs = [(name, {**machine(d), "date": d.get("date")}) for name, d in files.items()]
    sections.append(Section(kind, source, title, caption, png, rows, runs))


def _anchor(s: Section) -> str:
    return "s-" + re.sub(r"[^A-Za-z0-9_-]", "-", s.source)


def _machine_text(m: dict) -> str:
    def show(key, v):
        if v in (None, ""):
            return "not recorded"
        return f"{v[:10]}{'-dirty' if v.endswith('-dirty') else ''}" if key == "commit" else str(v)
    return " · ".join(f"{label} {show(key, m.get(key))}" for key, label in MACHINE) + (
        f" · run {m['date']}" if m.get("date") else "")


def _cells(r: Row) -> str:
    cls, verdict = {True: ("met", "met"), False: ("notmet", "not met"), None: ("", "—" if r.target else "")}[r.met]
    return ("".join(f"<td>{html.escape(c)}</td>" for c in (r.figure, r.value, r.anchor, r.ratio, r.target))
            + f'<td class="{cls}">{verdict}</td></tr>')


HEADER = "<th>figure</th><th>measured</th><th>anchor</th><th>ratio</th><th>target</th><th>met / not met</th></tr>"
STYLE = ("body{font-family:sans-serif;max-width:1800px;margin:1em auto;padding:0 1em;color:#222}"
         "img{max-width:100%;border:1px solid #ddd}table{border-collapse:collapse;margin:.5em 0 2em}"
         "td,th{border:1px solid #ccc;padding:.25em .6em;text-align:left;font-size:.92em}th{background:#f2f2f2}"
         ".met{color:#1e7b34;font-weight:bold}.notmet{color:#c0392b;font-weight:bold}.cap,.src{color:#555}"
         ".src{font-size:.85em}.machine{background:#f6f6f6;padding:.3em .6em;margin:.2em 0;display:inline-block}"
         ".summary td{font-size:.82em;padding:.15em .5em;border-top-color:#eee}"
         ".summary tr.first td{border-top:2px solid #999}")


def render_html(sections: list[Section], problems: list[tuple[str, str]], src_dir: str) -> str:
    targets = [(s, r) for s in sections for r in s.rows if r.target]
    met, missed = sum(r.met is True for _, r in targets), sum(r.met is False for _, r in targets)
    out = [f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>edge-runtime benchmarks</title>"
           f"<style>{STYLE}</style></head><body>",
           f"<h1>edge-runtime benchmarks</h1><p>From <code>{html.escape(src_dir)}</code>, "
           f"{time.strftime('%Y-%m-%d %H:%M')}: {len(sections)} sections, {len(targets)} targets: "
           f"<span class='met'>{met} met</span>, <span class='notmet'>{missed} not met</span>.</p>",
           "<h2>Every target</h2><table class='summary'><tr><th>benchmark</th>" + HEADER]
    for i, (s, r) in enumerate(targets):
        isa = ", ".join(sorted({m.get("isa") or "ISA not recorded" for _, m in s.runs}))
        first = i == 0 or targets[i - 1][0] is not s  # the benchmark named once, on its first row
        out.append(f"<tr class='first'><td><a href='#{_anchor(s)}'>{html.escape(s.kind)}</a> <span class='src'>"
                   f"{html.escape(s.source if len(s.runs) == 1 else f'{len(s.runs)} files')} · {html.escape(isa)}"
                   "</span></td>" + _cells(r) if first else "<tr><td></td>" + _cells(r))
    out.append("</table>")
    if problems:
        out.append("<h2>Files not shown</h2><ul>")
        out += [f"<li><b>{html.escape(n)}</b>: {html.escape(m)}</li>" for n, m in problems]
        out.append("</ul>")
    for s in sections:
        machines = {_machine_text(m) for _, m in s.runs}
        where = (f"<p class='machine'>{html.escape(machines.pop())}</p>" if len(machines) == 1 else
                 "<ul class='machine'>" + "".join(f"<li><code>{html.escape(n)}</code>: {html.escape(_machine_text(m))}"
                                                  "</li>" for n, m in s.runs) + "</ul>")
        out.append(f"<h2 id='{_anchor(s)}'>{html.escape(s.title)}</h2>{where}"
                   f"<p class='cap'><code>{html.escape(s.source)}</code>. {html.escape(s.caption)}</p>"
                   f"<img src='{html.escape(s.png)}' alt='{html.escape(s.title)}'><table><tr>" + HEADER)
        out += ["<tr>" + _cells(r) for r in s.rows]
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
