"""`edge-runtime bench serve` end to end on a tiny workload: both servers start, every figure is written, and
the figures are consistent with the records they summarize (tests check behaviour, not speed)."""
import json
import subprocess
import sys

from edge_cli.bench.serve import _pct, _summary
from tests.edge_cli.test_main import ROOT


def test_summary_percentiles_and_throughput():
    recs = [{"ttft_s": 0.1, "gaps": [0.01, 0.03], "tokens": 3}, {"ttft_s": 0.3, "gaps": [0.02], "tokens": 2}]
    s = _summary(recs, 2.0)
    assert s["tokens_per_s"] == 2.5 and s["completion_tokens"] == 5
    assert s["ttft_ms_p99"] == 300.0 and s["itl_ms_p50"] == 20.0 and _pct([], 0.5) != _pct([], 0.5)  # nan


def test_bench_serve_writes_both_servers_figures(tmp_path):
    out = tmp_path / "serve.json"
    p = subprocess.run([sys.executable, "-m", "edge_cli", "bench", "serve", "--serve-requests", "2",
                        "--serve-tokens", "6", "--json", str(out)], cwd=ROOT, capture_output=True, text=True,
                       timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    d = json.loads(out.read_text())
    for name in ("batched", "single_stream"):
        r = d[name]
        assert r["sequential"]["completion_tokens"] == r["concurrent"]["completion_tokens"] == 12
        assert r["concurrent_over_sequential"] == r["concurrent"]["tokens_per_s"] / r["sequential"]["tokens_per_s"]
        assert r["short_ttft_ratio"] == r["short_behind_long_ttft_ms"] / r["short_idle_ttft_ms"]
    assert d["concurrent_over_sequential"] == d["batched"]["concurrent_over_sequential"]
    assert d["isa"] and d["cpu_model"] and d["commit"]
