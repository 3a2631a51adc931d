"""Every example in examples/ runs on the embedded model, as a user runs it (a fresh Python process)."""
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run(name, *args, input=None):
    p = subprocess.run([sys.executable, os.path.join("examples", name), *args], cwd=ROOT, capture_output=True,
                       text=True, timeout=400, input=input, env={**os.environ, "PYTHONPATH": ROOT})
    assert p.returncode == 0, p.stderr[-3000:]
    return p.stdout


def test_local_generate():
    out = run("local_generate.py", "Name a colour.")
    assert re.search(r"\[(stop|length); \d+ tokens\]", out)


def test_offline_laptop_never_leaves_the_device():
    out = run("offline_laptop.py", "Name the capital of France.")
    assert out.count("answered local: offline mode") == 2 and "asked route=cloud" in out
    assert "Paris" in out and "'cloud'" not in out


def test_desktop_assistant_keeps_the_conversation_and_marks_sources():
    out = run("desktop_assistant.py", input="I have a dog called Max.\nWhat is my dog called?\n")
    assert re.search(r"\[cloud worker on ws://127\.0\.0\.1:\d+\]", out)
    answers = [line for line in out.splitlines() if line.startswith("[local]") or line.startswith("[cloud]")]
    assert len(answers) == 2, out
    assert "Max" in answers[1]  # the second answer saw the first turn (asked alone, greedy, it names no dog)


def test_hybrid_api_with_the_official_openai_client():
    pytest.importorskip("openai")
    out = run("hybrid_api.py")
    assert "route local (route hint: local); sources ['local']" in out
    assert "route cloud (route hint: cloud); sources ['cloud']" in out
    assert "Paris" in out and re.search(r"streamed: .*<cloud>", out)


def test_ws_client_resumes_without_losing_a_frame():
    out = run("ws_client.py")
    assert "[connection dropped after frame 7; reconnecting]" in out and "with none missing: True" in out
