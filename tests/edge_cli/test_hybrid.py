"""`edge-runtime generate` in hybrid mode, as a user runs it: real CLI processes and a real worker."""
import json
import socket

import pytest

from cloud_fallback.launcher import WorkerProcess
from tests.child_process import sigint_default
from tests.edge_cli.test_main import run

PROMPT = "Name the capital of France."


@pytest.fixture(scope="module")
def worker(tmp_path_factory):
    w = WorkerProcess()
    token_file = tmp_path_factory.mktemp("tok") / "token"
    token_file.write_text(w.token)
    w.token_path = str(token_file)
    yield w
    w.stop()


def test_route_cloud_answers_through_the_worker(worker):
    p = run("generate", "--json", "--max-tokens", "16", "--cloud", worker.url, "--cloud-token-file", worker.token_path,
            "--route", "cloud", PROMPT)
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert out["route"] == "cloud" and "hint" in out["route_reason"] and out["handoffs"] == []
    assert out["usage_by_source"]["cloud"]["completion_tokens"] == out["completion_tokens"] == len(out["token_ids"])
    local = json.loads(run("generate", "--json", "--max-tokens", "16", PROMPT).stdout)
    assert out["text"] == local["text"] and "Paris" in out["text"]


def test_offline_never_uses_the_cloud(worker):
    p = run("generate", "--json", "--max-tokens", "8", "--cloud", worker.url, "--cloud-token-file", worker.token_path,
            "--route", "cloud", "--offline", PROMPT)
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert out["route"] == "local" and "offline" in out["route_reason"] and list(out["usage_by_source"]) == ["local"]


def test_unreachable_cloud_at_the_start_answers_locally_and_says_why(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    token = tmp_path / "token"
    token.write_text("whatever")
    p = run("generate", "--json", "--max-tokens", "8", "--cloud", f"ws://127.0.0.1:{port}", "--cloud-token-file",
            str(token), "--route", "cloud", PROMPT)
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert out["route"] == "local" and "cloud unreachable" in out["route_reason"] and out["text"]


def test_cloud_without_a_token_file_is_a_clear_error():
    p = run("generate", "--cloud", "ws://127.0.0.1:1", "--route", "cloud", PROMPT)
    assert p.returncode == 2 and "--cloud-token-file" in p.stderr and "Traceback" not in p.stderr


def test_chat_on_the_hybrid_runtime_marks_sources_and_ctrl_c_stops_only_the_cloud_answer(worker):
    import os
    import signal
    import subprocess
    import sys
    import time

    from tests.edge_cli.test_main import ROOT

    proc = subprocess.Popen([sys.executable, "-m", "edge_cli", "chat", "--max-tokens", "400", "--temperature", "0", "--cloud", worker.url,
                             "--cloud-token-file", worker.token_path, "--route", "cloud"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                            bufsize=1, preexec_fn=sigint_default)
    try:
        proc.stdin.write("Write a very long story about a dragon.\n")
        proc.stdin.flush()
        got = ""
        deadline = time.time() + 240
        while len(got) < 60 and time.time() < deadline:  # the cloud answer is streaming
            got += os.read(proc.stdout.fileno(), 64).decode(errors="replace")
        proc.send_signal(signal.SIGINT)
        proc.stdin.write("/reset\nName the capital of France.\n/quit\n")
        proc.stdin.flush()
        out, err = proc.communicate(timeout=240)
    finally:
        proc.kill()
    out = got + out
    assert proc.returncode == 0, err
    assert out.startswith("[cloud] ") and "[stopped]" in out and "[history cleared]" in out
    second = out.split("[history cleared]")[1]
    assert "[cloud]" in second and "Paris" in second
    assert "route cloud: route hint: cloud" in err
    deadline = time.time() + 10  # the stopped stream was cancelled on the worker: its KV blocks are free again
    while worker.metrics().get("edge_worker_kv_blocks_used", 0) and time.time() < deadline:
        time.sleep(0.2)
    assert worker.metrics().get("edge_worker_kv_blocks_used", 0) == 0
