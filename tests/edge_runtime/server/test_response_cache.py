"""The response cache through a real `serve` process: the official openai client, /v1/stream, restarts,
concurrent clients, per-key tenants, and a broken cache file."""
import asyncio
import json
import os
import sqlite3
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest
from websockets.asyncio.client import connect

from edge_cli.serve_process import ServeProcess
from tests.edge_runtime.server.gateway_fixtures import ROOT

ALICE, BOB = "sk-alice", "sk-bob"
Q = "What is the capital of France?"


def serve(path, *extra):
    return ServeProcess("--draft", "none", "--api-key", BOB, *extra, key=ALICE, threads=2, cwd=ROOT, cache=str(path))


@pytest.fixture(scope="module")
def cache_file(tmp_path_factory):
    return tmp_path_factory.mktemp("cache") / "responses.sqlite3"


@pytest.fixture(scope="module")
def gw(cache_file):
    s = serve(cache_file)
    yield s
    s.stop()


def ask(gw, question, key=ALICE, **extra):
    """(text, the set of x_source values, completion_tokens) of one streamed greedy answer."""
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0)
    text, sources, usage = [], set(), None
    for ch in client.chat.completions.create(model="default", messages=[{"role": "user", "content": question}],
                                             max_tokens=16, temperature=extra.pop("temperature", 0), stream=True,
                                             stream_options={"include_usage": True}, extra_body=extra):
        if ch.choices and ch.choices[0].delta.content:
            text.append(ch.choices[0].delta.content)
            sources.add(ch.model_extra["x_source"])
        if ch.usage is not None:
            usage = ch.usage.completion_tokens
    return "".join(text), sources, usage


def _metric(gw, name):
    line = next(x for x in httpx.get(gw.url + "/metrics").text.splitlines() if x.startswith(name + " "))
    return float(line.split()[-1])


def test_a_repeated_question_is_answered_from_the_cache_and_a_near_miss_is_not(gw):
    first, src, used = ask(gw, Q)
    assert src == {"local"} and used == 16
    again, src, used = ask(gw, Q)
    assert (again, src, used) == (first, {"cache"}, 0)
    assert ask(gw, "  what is the capital of france ")[:2] == (first, {"cache"})  # exact tier: normalized
    assert ask(gw, "Could you tell me what the capital of France is?")[:2] == (first, {"cache"})  # semantic tier
    for near in ("What is the capital of Spain?", "What is not the capital of France?",
                 "What is the capital of France? Answer in 3 words."):
        assert ask(gw, near)[1] == {"local"}, near
    whole = openai.OpenAI(base_url=gw.url + "/v1", api_key=ALICE, max_retries=0).chat.completions.create(
        model="default", messages=[{"role": "user", "content": Q}], max_tokens=16, temperature=0)
    assert whole.choices[0].message.content == first and whole.model_extra["x_hybrid"]["route"] == "cache"


def test_tenants_do_not_see_each_others_answers(gw):
    q = "Name a large animal."
    assert ask(gw, q, key=ALICE)[1] == {"local"}
    assert ask(gw, q, key=BOB)[1] == {"local"}  # Bob's first time, although Alice asked
    assert ask(gw, q, key=BOB)[1] == {"cache"}


def test_off_refresh_and_sampled_requests(gw):
    q = "Name a small bird."
    text, src, _ = ask(gw, q)
    assert src == {"local"}
    assert ask(gw, q, cache="off")[1] == {"local"}
    assert ask(gw, q, cache="refresh")[1] == {"local"}
    assert ask(gw, q)[:2] == (text, {"cache"})
    sampled = "Name a green vegetable."
    assert ask(gw, sampled, temperature=0.8, seed=1)[1] == {"local"}
    assert ask(gw, sampled, temperature=0.8, seed=1)[1] == {"local"}  # sampled: neither served nor stored
    bad = httpx.post(gw.url + "/v1/chat/completions", headers={"Authorization": f"Bearer {ALICE}"},
                     json={"model": "default", "messages": [{"role": "user", "content": q}], "cache": "sometimes"})
    assert bad.status_code == 400 and "cache" in bad.json()["error"]["message"]


def test_the_websocket_stream_says_which_tier_hit(gw):
    ask(gw, Q)

    async def go():
        async with connect(gw.url.replace("http", "ws") + "/v1/stream") as ws:
            await ws.send(json.dumps({"type": "hello", "api_key": ALICE}))
            assert json.loads(await ws.recv())["type"] == "welcome"
            await ws.send(json.dumps({"type": "generate", "id": "s1", "params": {"max_tokens": 16, "temperature": 0},
                                      "messages": [{"role": "user", "content": Q}]}))
            frames = []
            while not frames or frames[-1]["type"] not in ("finish", "error"):
                frames.append(json.loads(await ws.recv()))
            return frames
    frames = asyncio.run(go())
    assert frames[0]["type"] == "start" and frames[0]["source"] == "cache" and frames[0]["cache"]["kind"] == "exact"
    assert {f["source"] for f in frames if f["type"] == "delta"} == {"cache"}
    assert "".join(f["text"] for f in frames if f["type"] == "delta") == ask(gw, Q)[0]


def test_metrics_and_health_count_the_cache(gw):
    ask(gw, Q)
    metrics = httpx.get(gw.url + "/metrics").text
    hits = [line for line in metrics.splitlines() if line.startswith('edge_cache_requests_total{outcome="hits_exact"}')]
    assert hits and float(hits[0].split()[-1]) >= 1
    assert "edge_cache_entries " in metrics and "edge_cache_audit_disagreements_total" in metrics
    cache = httpx.get(gw.url + "/health").json()["cache"]
    assert cache["enabled"] and cache["entries"] >= 1 and cache["embedder"] == "wordllama"


def test_eight_clients_at_once_lose_nothing_and_a_restart_keeps_the_entries(gw, cache_file):
    questions = [f"Write one sentence about the number {n}." for n in range(8)]
    first, second = {}, {}

    def client(q):
        first[q] = ask(gw, q)
        second[q] = ask(gw, q)
    threads = [threading.Thread(target=client, args=(q,)) for q in questions]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for q in questions:
        assert first[q][1] == {"local"} and second[q][:2] == (first[q][0], {"cache"}), q
    gw.stop()
    with sqlite3.connect(cache_file) as db:
        assert db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    again = serve(cache_file, "--cache-sampled", "--cache-audit", "1")
    try:
        for q in questions:
            assert ask(again, q)[:2] == (first[q][0], {"cache"}), q
        # --cache-sampled: a seeded sampled request is stored and served too
        sampled = ask(again, "Name a green vegetable.", temperature=0.8, seed=7)
        assert sampled[1] == {"local"}
        assert ask(again, "Name a green vegetable.", temperature=0.8, seed=7)[:2] == (sampled[0], {"cache"})
        assert ask(again, "Name a green vegetable.", temperature=0.8, seed=8)[1] == {"local"}
        # --cache-audit 1: every hit is regenerated in the background; greedy exact hits agree
        deadline = time.time() + 60
        while time.time() < deadline and _metric(again, "edge_cache_audits_total") < len(questions) + 1:
            time.sleep(0.2)
        assert _metric(again, "edge_cache_audits_total") >= len(questions) + 1
        assert _metric(again, "edge_cache_audit_disagreements_total") == 0
    finally:
        again.stop()
    out = subprocess.run([sys.executable, "-m", "edge_cli", "cache", "stats", "--cache-path", str(cache_file)],
                         capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0 and json.loads(out.stdout)["entries"] >= 8 + 1
    exported = subprocess.run([sys.executable, "-m", "edge_cli", "cache", "export", "--cache-path", str(cache_file)],
                              capture_output=True, text=True, cwd=ROOT, timeout=120)
    queries = {json.loads(line)["query"] for line in exported.stdout.splitlines()}
    assert set(questions) <= queries and Q in queries


def test_a_broken_cache_file_is_reported_once_and_requests_are_answered(tmp_path):
    path = tmp_path / "broken.sqlite3"
    s0 = serve(path)
    ask(s0, Q)
    s0.stop()
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2][:100] + b"\0garbage" * 64)  # a truncated, overwritten header
    for name in os.listdir(tmp_path):
        if name.startswith("broken.sqlite3-"):
            os.remove(tmp_path / name)
    s = serve(path)
    try:
        for _ in range(2):
            text, src, used = ask(s, Q)
            assert src == {"local"} and used == 16 and text
        assert httpx.get(s.url + "/health").json()["cache"]["enabled"] is False
    finally:
        s.stop()
    assert sum("response cache" in line for line in "".join(s.err).splitlines()) == 1
    out = subprocess.run([sys.executable, "-m", "edge_cli", "cache", "stats", "--cache-path", str(path)],
                         capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 2 and "unreadable" in out.stderr
