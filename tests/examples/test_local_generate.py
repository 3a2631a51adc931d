"""Every example runs."""
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_local_generate_example_streams_an_answer():
    p = subprocess.run([sys.executable, "examples/local_generate.py", "Name the capital of France."],
                       capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert p.returncode == 0, p.stderr
    assert "Paris" in p.stdout and "tokens]" in p.stdout
