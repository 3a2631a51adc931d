"""Failover when the cloud stalls or answers an error mid-stream, and the hand-back when it comes back.

Real processes throughout: the worker is frozen with SIGSTOP (a stall: the socket stays open, nothing
arrives) and thawed with SIGCONT; the upstream engine behind an upstream-mode worker is SIGKILLed so that
the worker itself sends an error frame mid-stream."""
import asyncio
import os
import signal
import subprocess
import sys
import time

import pytest

from cloud_fallback.cloud_backend import CloudBackend
from cloud_fallback.health import CircuitBreaker
from cloud_fallback.launcher import WorkerProcess
from edge_runtime.hybrid import HybridRuntime
from edge_runtime.request import GenerationRequest, SamplingParams
from edge_runtime.router import Router

QUESTION = "Describe, step by step, how to bake bread at home."
MAX_TOKENS = 160


def ask(max_tokens=MAX_TOKENS, prefix=""):
    return GenerationRequest(messages=[{"role": "user", "content": QUESTION}],
                             params=SamplingParams(max_tokens=max_tokens), prefix=prefix, route="cloud")


def runtime(local, cloud, **kw):
    return HybridRuntime(local, cloud, router=Router(cloud, n_ctx=local.n_ctx, device_probe=None), **kw)


def test_stall_fails_over_to_the_device_and_hands_back_when_the_cloud_thaws(native_backend):
    w = WorkerProcess()
    try:
        async def run():
            cloud = CloudBackend(w.url, w.token, stall_timeout=1.0, health=CircuitBreaker(cooldown_s=0.2))
            events = []
            try:
                async for ev in runtime(native_backend, cloud, hand_back="always", probe_interval=0.1).stream(ask()):
                    events.append(ev)
                    if ev.type == "delta" and ev.seq == 9:
                        os.killpg(w.proc.pid, signal.SIGSTOP)
                    if ev.type == "handoff" and ev.info["to"] == "local":
                        asyncio.get_running_loop().call_later(0.3, os.killpg, w.proc.pid, signal.SIGCONT)
            finally:
                os.killpg(w.proc.pid, signal.SIGCONT)
                await cloud.aclose()
            return events
        events = asyncio.run(run())
    finally:
        w.stop()
    deltas = [e for e in events if e.type == "delta"]
    handoffs = [e.info for e in events if e.type == "handoff"]
    assert [d.seq for d in deltas] == list(range(len(deltas))) and events[-1].type == "finish"
    assert [(h["from"], h["to"]) for h in handoffs] == [("cloud", "local"), ("local", "cloud")]
    assert "stalled" in handoffs[0]["reason"] and "hand-back" in handoffs[1]["reason"]
    assert all(h["token_ids"] for h in handoffs)
    sources = [d.source for d in deltas]
    assert sources[:10] == ["cloud"] * 10 and "local" in sources and sources[-1] == "cloud"
    assert handoffs[0]["at_char"] == len("".join(d.text for d in deltas[:sources.index("local")]))
    # ids travelled both ways between models with one tokenizer: the answer is the plain greedy answer
    plain = native_backend.generate(ask())
    assert "".join(d.text for d in deltas) == plain.text and events[-1].finish_reason == plain.finish_reason
    by = events[-1].info["usage_by_source"]
    assert by["cloud"]["completion_tokens"] + by["local"]["completion_tokens"] == len(plain.token_ids)


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture()
def llama_server(model_path):
    pytest.importorskip("llama_cpp.server.app")
    import httpx
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "llama_cpp.server", "--model", model_path, "--host", "127.0.0.1",
                             "--port", str(port), "--n_ctx", "2048", "--n_threads", "1", "--interrupt_requests",
                             "False"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}/v1"
    deadline = time.monotonic() + 90
    while True:
        assert proc.poll() is None, "llama_cpp.server exited"
        try:
            if httpx.get(f"{base}/models", timeout=2).status_code == 200:
                break
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, "llama_cpp.server did not start"
        time.sleep(0.25)
    yield proc, base
    proc.kill()
    proc.wait()


def test_an_error_frame_mid_stream_fails_over_on_text(native_backend, llama_server):
    """The upstream engine dies; the worker answers an error frame; the device continues from the text
    (an upstream engine's deltas carry no token ids, so the hand-off is text-level)."""
    proc, base = llama_server
    w = WorkerProcess("--upstream", base)
    try:
        async def run():
            cloud = CloudBackend(w.url, w.token)
            events = []
            try:
                async for ev in runtime(native_backend, cloud).stream(ask()):
                    events.append(ev)
                    if ev.type == "delta" and ev.seq == 4:
                        proc.kill()
            finally:
                await cloud.aclose()
            return events
        events = asyncio.run(run())
    finally:
        w.stop()
    deltas = [e for e in events if e.type == "delta"]
    handoffs = [e.info for e in events if e.type == "handoff"]
    assert events[-1].type == "finish" and [d.seq for d in deltas] == list(range(len(deltas)))
    assert len(handoffs) == 1 and handoffs[0]["from"] == "cloud" and handoffs[0]["token_ids"] is False
    assert "failover" in handoffs[0]["reason"] and "upstream" in handoffs[0]["reason"]
    cloud_text = "".join(d.text for d in deltas if d.source == "cloud")
    local_text = "".join(d.text for d in deltas if d.source == "local")
    n_cloud = sum(d.source == "cloud" for d in deltas)
    assert n_cloud >= 5 and handoffs[0]["at_char"] == len(cloud_text)
    expect = native_backend.generate(ask(MAX_TOKENS - n_cloud, prefix=cloud_text))
    assert local_text == expect.text and events[-1].finish_reason == expect.finish_reason
