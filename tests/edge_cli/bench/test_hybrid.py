"""`edge-runtime bench hybrid`, as a user runs it, on a tiny workload: every figure the issue asks for is
written, with its target, and the numbers are sane (positive gaps, shares in [0, 1])."""
import json
import subprocess
import sys

from tests.cloud_fallback.worker_fixtures import ROOT


def test_bench_hybrid_writes_every_figure(tmp_path):
    out = tmp_path / "hybrid.json"
    p = subprocess.run([sys.executable, "-m", "edge_cli", "bench", "hybrid", "--threads", "2", "--prompts", "2",
                        "--failovers", "1", "--routing-prompts", "24", "--json", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    d = json.loads(out.read_text())
    assert json.loads(p.stdout) == d
    for route in ("local", "cloud", "auto"):
        assert len(d["ttft_ms"][route]["all"]) == 2 and d["ttft_ms"][route]["p50"] > 0
    assert d["ttft_auto_over_local"] > 0 and d["handoff_gap_ms_p50"] > 0 and len(d["handoff_gap_ms"]) >= 1
    assert d["failover_gap_ms_p50"] > 0 and d["failover_target_ms"] > 300
    r = d["routing"]
    assert r["prompts"] == 24 and 0 <= r["cloud_share"] <= 1 and 0 <= r["agreement"] <= 1
    assert d["targets"] == {"handoff_gap_ms_p50": 150, "failover_gap_ms_p50": "300 + failover_local_prefill_ms_p50",
                            "ttft_auto_over_local": 1.2}
