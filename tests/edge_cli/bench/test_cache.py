"""`edge-runtime bench cache` end to end on a few pairs: the figures are written and agree with the rows
they summarize (tests check behaviour, not speed); the stored bench-results/cache.json recomputes likewise."""
import json
import os
import subprocess
import sys

from tests.edge_cli.test_main import ROOT


def check(d: dict) -> None:
    rows = d["rows"]
    hits = [r for r in rows if r["label"] == "hit"]
    assert len(rows) == d["workload"]["pairs"] and len(hits) == d["workload"]["should_hit"]
    assert all(r["cold_source"] == "local" for r in rows)  # an empty cache: every first question is cold
    assert d["exact_hits"] == sum(r["repeat_source"] == "cache" and r["repeat_identical"] for r in rows)
    assert d["false_hits"] == sum(r["second_source"] == "cache" for r in rows if r["label"] == "miss")
    assert d["semantic_hit_rate"] == sum(r["second_source"] == "cache" for r in hits) / max(1, len(hits))
    assert d["hit_over_cold"] == d["cold_ttft_ms_p50"] / d["exact_hit_ttft_ms_p50"]


def test_bench_cache_writes_consistent_figures(tmp_path):
    out = tmp_path / "cache.json"
    p = subprocess.run([sys.executable, "-m", "edge_cli", "bench", "cache", "--cache-pairs", "4", "--json", str(out)],
                       cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    d = json.loads(out.read_text())
    check(d)
    assert d["exact_hits"] == 4 and d["false_hits"] == 0  # greedy repeats always hit; these near-misses miss
    assert d["isa"] and d["cpu_model"] and d["commit"]


def test_the_committed_results_are_consistent():
    path = os.path.join(ROOT, "bench-results", "cache.json")
    check(json.load(open(path, encoding="utf-8")))
