"""The report over the committed bench-results/ shows every figure the README's Benchmarks section cites.

"Cites" is mechanical: every bold number (`**1.56x**`, `**54 %**`, `**0** of 20`) from the line
"## Benchmarks" up to the line starting "Accuracy figures from the test suite". A README number is on the
page when a number in index.html's text is equal to it, or has at least its decimals and rounds consistently
with it (4.75 on the page and 4.7 in the README can both be 4.748). Also: every kind the page adds for
serve, cache, batching with drafts and perplexity is drawn from the committed files, and the ratios it
shows agree with the raw figures in the JSON.
"""
from __future__ import annotations

import html
import os
import re

import pytest

pytest.importorskip("matplotlib")

from edge_cli.bench.figures import recognise  # noqa: E402
from tests.edge_cli.bench.report_files import REPO, _json  # noqa: E402

NUMBER = re.compile(r"\d[\d,]*(?:\.\d+)?")


def bold_figures(readme: str) -> list[tuple[str, str]]:
    """(number as written, its README line) for every bold number in the Benchmarks section."""
    start = readme.index("\n## Benchmarks")
    end = readme.index("\nAccuracy figures from the test suite", start)
    found = []
    for line in readme[start:end].splitlines():
        for bold in re.findall(r"\*\*(.+?)\*\*", line):
            found += [(n.replace(",", ""), line.strip()) for n in NUMBER.findall(bold)]
    return found


def page_numbers(page: str) -> set[str]:
    """Every number in the page's text (tags dropped, thousands commas dropped)."""
    text = html.unescape(re.sub(r"<[^>]+>", " ", page))
    return {n.replace(",", "") for n in NUMBER.findall(text)}


def _decimals(s: str) -> int:
    return len(s.split(".")[1]) if "." in s else 0


def shown(figure: str, numbers: set[str]) -> bool:
    """Whether `figure` (as the README writes it) is among `numbers`, up to consistent rounding.

    A page number with at least the README's decimals matches when some value rounds to both: their rounding
    intervals overlap (strictly: 4.8 and 4.7 only touch at 4.75, which rounds to 4.8).
    """
    r, d = float(figure), _decimals(figure)
    for p in numbers:
        dp = _decimals(p)
        if float(p) == r or (dp >= d and abs(float(p) - r) < 0.5 * 10 ** -d + 0.5 * 10 ** -dp - 1e-9):
            return True
    return False


def missing(readme: str, page: str) -> list[tuple[str, str]]:
    """The README's bold figures the page does not show, with their lines."""
    numbers = page_numbers(page)
    return [(f, line) for f, line in bold_figures(readme) if not shown(f, numbers)]


def _ratio(sections, kind: str, key: str, source: str | None = None) -> float:
    """The ratio the page shows in the row of `key` ("2.21 (concurrent_over_sequential)")."""
    rows = [r for s in sections if s.kind == kind and (source is None or s.source == source) for r in s.rows
            if r.ratio.endswith(f"({key})")]
    assert rows, (kind, key)
    return float(rows[0].ratio.split()[0])


def test_the_checker_reads_bold_numbers_and_can_fail():
    readme = ("intro **9.99x** (before the section)\n## Benchmarks\ndecode **1.56x**, false hits **0** of 20,\n"
              "share **54 %**, throughput **1,153** tok/s, **1.29: not met**, made up **123.456x**\n"
              "Accuracy figures from the test suite\n**7.77**\n")
    assert [f for f, _ in bold_figures(readme)] == ["1.56", "0", "54", "1153", "1.29", "123.456"]
    page = "<td>1.556 (decode_ratio)</td><td>0 of 20</td><td>54.1 %</td><td>1,153</td><td>1.294</td><td>123.4</td>"
    assert [f for f, _ in missing(readme, page)] == ["123.456"]
    assert not shown("2.21", {"2"}) and shown("1.70", {"1.7"}) and shown("4.7", {"4.75"}) and not shown("4.7", {"4.8"})


def test_every_bold_readme_figure_is_on_the_page(committed):
    with open(os.path.join(REPO, "README.md"), encoding="utf-8") as f:
        readme = f.read()
    gone = missing(readme, committed[0])
    assert not gone, "README bold figures not on the report page:\n" + "\n".join(f"{f}: {line}" for f, line in gone)


@pytest.mark.parametrize("name,kind", [("serve.json", "serve"), ("cache.json", "cache"),
                                       ("batching-draft.json", "batching-draft"),
                                       ("batching-draft-run1.json", "batching-draft"),
                                       ("perplexity-native-int8.json", "perplexity"),
                                       ("perplexity-native-exact.json", "perplexity"),
                                       ("perplexity-llama-cpp.json", "perplexity"),
                                       ("mtp-heads.json", "mtp-heads")])
def test_new_kinds_are_recognised_and_drawn(committed, name, kind):
    page, sections, problems = committed
    assert recognise(_json(name)) == kind
    section = next(s for s in sections if name in s.source.split(", "))
    assert section.kind == kind and section.png in page and any(r.met is not None for r in section.rows)
    assert not problems and "could not be drawn" not in page


def test_one_perplexity_section_compares_the_three_runs(committed):
    _, sections, _ = committed
    (ppl,) = [s for s in sections if s.kind == "perplexity"]
    assert len(ppl.runs) == 3 and len(ppl.rows) == 3 and all(r.met for r in ppl.rows)
    runs = {n: _json(n)["ppl"] for n, _ in ppl.runs}
    for r in ppl.rows:  # "native (a.json)" against "llama.cpp (b.json) 18.35": the difference from the raw ppl
        a, b = (re.search(r"\((perplexity-[^)]+)\)", t).group(1) for t in (r.figure, r.anchor))
        assert float(r.ratio.split()[0]) == pytest.approx(100 * (runs[a] / runs[b] - 1), abs=0.005)


def test_stored_ratios_agree_with_the_raw_figures(committed):
    _, sections, _ = committed
    serve, cache, draft = _json("serve.json"), _json("cache.json"), _json("batching-draft.json")
    b = serve["batched"]
    at_once = b["concurrent"]["tokens_per_s"] / b["sequential"]["tokens_per_s"]
    assert _ratio(sections, "serve", "concurrent_over_sequential") == pytest.approx(at_once, abs=0.006)
    short = b["short_behind_long_ttft_ms"] / b["short_idle_ttft_ms"]
    assert _ratio(sections, "serve", "short_ttft_ratio") == pytest.approx(short, abs=0.006)
    hit = cache["cold_ttft_ms_p50"] / cache["exact_hit_ttft_ms_p50"]
    assert _ratio(sections, "cache", "hit_over_cold") == pytest.approx(hit, abs=0.006)
    for run, key in (("batching", "draft_over_plain_batching"), ("grounded_one_at_a_time", "draft_over_plain_grounded"),
                     ("grounded_two_at_a_time", "draft_over_plain_grounded_two_at_a_time")):
        raw = draft["by_draft"]["ngram"][run]["tokens_per_s"] / draft["by_draft"]["none"][run]["tokens_per_s"]
        assert _ratio(sections, "batching-draft", key, "batching-draft.json") == pytest.approx(raw, abs=0.006)


def test_page_opens_with_every_target_and_names_each_run(committed):
    page, sections, _ = committed
    summary = page[page.index("<h2>Every target</h2>"):page.index("</table>")]
    assert summary.count("<tr") - 1 == sum(bool(r.target) for s in sections for r in s.rows)
    for verdict in ("met", "not met"):
        assert f">{verdict}</td>" in summary
    assert "ISA variant avx512vnni" in page and "commit 203501b2bd" in page and "threads 2" in page
    assert "threads not recorded" in page  # batching-draft.json's worker threads are null
    assert "CPU not recorded" in page  # the perplexity files predate the machine keys
    assert not re.search(r"""(src|href)=['"]?(https?:)?//""", page) and "<script" not in page
