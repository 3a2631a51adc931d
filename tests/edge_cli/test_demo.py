"""The README's main job, as a user runs it: `edge-runtime demo` starts a loopback worker, answers the easy
prompt on the device and hands the hard one to the cloud, printing source markers and timings."""
import re
import subprocess
import sys

from tests.cloud_fallback.worker_fixtures import ROOT


def test_demo_answers_easy_locally_and_hard_through_the_cloud():
    p = subprocess.run([sys.executable, "-m", "edge_cli", "demo", "--max-tokens", "24"], capture_output=True,
                       text=True, timeout=300, cwd=ROOT)
    assert p.returncode == 0, p.stderr[-3000:]
    out = p.stdout
    assert re.search(r"worker listening on ws://127\.0\.0\.1:\d+", out)
    easy, hard = out.split(">>> ")[1:]
    assert "[route local: auto" in easy and "[local +" in easy and "[cloud" not in easy and "handoff" not in easy
    assert re.search(r"tokens by source \{'local': \d+\}", easy)
    assert "[route local: auto" in hard and "[handoff local -> cloud at character" in hard and "escalation" in hard
    assert "[cloud +" in hard and re.search(r"tokens by source \{'local': \d+, 'cloud': \d+\}", hard)
    assert all(re.search(r"first token \d+ ms, total \d+ ms", part) for part in (easy, hard))
