"""The report page over the committed bench-results/, built once for the report tests."""
from __future__ import annotations

import os

import pytest

from tests.edge_cli.bench.report_files import BENCH


@pytest.fixture(scope="session")
def committed(tmp_path_factory):
    if not os.path.isdir(BENCH):
        pytest.skip("no bench-results/ here")
    pytest.importorskip("matplotlib")
    from edge_cli.bench.report import build_report, render_html

    sections, problems = build_report(BENCH, str(tmp_path_factory.mktemp("report")))
    return render_html(sections, problems, BENCH), sections, problems
