"""`edge-runtime generate` in hybrid mode, as a user runs it: real CLI processes and a real worker."""
import json
import socket

import pytest

from cloud_fallback.launcher import WorkerProcess
from tests.edge_runtime.test_cli import run

PROMPT = "What is the capital of France?"


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
