"""The committed bench-results/ as the report tests read them: where they are, one file's JSON, and the report
page built from them all (the `committed` fixture, tests/edge_cli/bench/conftest.py)."""
from __future__ import annotations

import json
import os

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
BENCH = os.path.join(REPO, "bench-results")


def _json(name: str) -> dict:
    with open(os.path.join(BENCH, name), encoding="utf-8") as f:
        return json.load(f)
