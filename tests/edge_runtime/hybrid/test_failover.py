"""Failover when the cloud stalls, drops or answers an error mid-stream, and the hand-back when it comes back.

Real processes throughout: the worker is frozen with SIGSTOP (a stall: the socket stays open, nothing
arrives) and thawed with SIGCONT; its connection is cut with the client's reconnects off (lost for good, the
worker still up); the upstream engine behind an upstream-mode worker is SIGKILLed so that the worker itself
sends an error frame mid-stream while it goes on answering heartbeats.

Where a test needs the probe to answer before the device finishes, the device pauses before each event
(`SlowDevice`), so the outcome does not depend on how fast this machine decodes."""
import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time

import pytest

from cloud_fallback.cloud_backend import CloudBackend
from cloud_fallback.health import CircuitBreaker
from cloud_fallback.launcher import WorkerProcess
from edge_runtime.hybrid.runtime import HybridRuntime
from edge_runtime.request import GenerationRequest, SamplingParams
from edge_runtime.hybrid.router import Router

QUESTION = "Describe, step by step, how to bake bread at home."
MAX_TOKENS = 160


def ask(max_tokens=MAX_TOKENS, prefix=""):
    return GenerationRequest(messages=[{"role": "user", "content": QUESTION}],
                             params=SamplingParams(max_tokens=max_tokens), prefix=prefix, route="cloud")


def runtime(local, cloud, **kw):
    return HybridRuntime(local, cloud, router=Router(cloud, n_ctx=local.n_ctx, device_probe=None), **kw)


class SlowDevice:
    """The device backend, pausing `pause` s before each event it streams: at least ~1.5 s for an answer."""

    def __init__(self, inner, pause=0.01):
        self.inner, self.pause = inner, pause

    def __getattr__(self, name):
        return getattr(self.inner, name)

    async def stream(self, request, prefix=None):
        async with contextlib.aclosing(self.inner.stream(request, prefix=prefix)) as events:
            async for ev in events:
                await asyncio.sleep(self.pause)
                yield ev


def split(events):
    deltas = [e for e in events if e.type == "delta"]
    assert events[-1].type == "finish" and [d.seq for d in deltas] == list(range(len(deltas)))
    return deltas, [e.info for e in events if e.type == "handoff"]


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
    (an upstream engine's deltas carry no token ids, so the hand-off is text-level) and keeps the answer:
    the worker still answers heartbeats, but that does not show the engine behind it is back, so there is
    no hand-back (which would fail again at once, and flap for the whole answer)."""
    proc, base = llama_server
    w = WorkerProcess("--upstream", base)
    try:
        async def run():
            cloud = CloudBackend(w.url, w.token)
            events = []
            # a probe that answers within ~0.02 s and a device that takes >= 1.5 s: a heartbeat-driven
            # hand-back would happen on any machine
            rt = runtime(SlowDevice(native_backend), cloud, hand_back="always", probe_interval=0.02)
            try:
                async for ev in rt.stream(ask()):
                    events.append(ev)
                    if ev.type == "delta" and ev.seq == 4:
                        proc.kill()
            finally:
                await cloud.aclose()
            return events
        events = asyncio.run(run())
    finally:
        w.stop()
    deltas, handoffs = split(events)
    assert len(handoffs) == 1 and handoffs[0]["from"] == "cloud" and handoffs[0]["token_ids"] is False
    assert "failover" in handoffs[0]["reason"] and "upstream" in handoffs[0]["reason"]
    assert "no hand-back" in handoffs[0]["reason"]
    cloud_text = "".join(d.text for d in deltas if d.source == "cloud")
    local_text = "".join(d.text for d in deltas if d.source == "local")
    n_cloud = sum(d.source == "cloud" for d in deltas)
    assert n_cloud >= 5 and handoffs[0]["at_char"] == len(cloud_text)
    assert [d.source for d in deltas] == ["cloud"] * n_cloud + ["local"] * (len(deltas) - n_cloud)
    expect = native_backend.generate(ask(MAX_TOKENS - n_cloud, prefix=cloud_text))
    assert local_text == expect.text and events[-1].finish_reason == expect.finish_reason


@pytest.fixture(scope="module")
def worker():
    w = WorkerProcess()
    yield w
    w.stop()


def run_dropping(worker, local, drop_after, max_drops=None, **kw):
    """Stream ask() with the cloud on `worker`, cutting the connection at the `drop_after`-th delta of each
    cloud stretch (the first `max_drops` stretches; None: all). The client does not reconnect, so each cut
    is a failover, and the probe's connect() opens a fresh connection to the worker, which stays up."""
    async def run():
        cloud = CloudBackend(worker.url, worker.token, reconnects=0)
        rt = runtime(local, cloud, hand_back="always", **kw)
        events, n, drops = [], 0, 0
        try:
            async for ev in rt.stream(ask()):
                events.append(ev)
                n = 0 if ev.type == "handoff" else n + (ev.type == "delta" and ev.source == "cloud")
                if ev.type == "delta" and n == drop_after and (max_drops is None or drops < max_drops):
                    drops += 1
                    cloud.client.ws.transport.abort()
        finally:
            await cloud.aclose()
        return events
    return asyncio.run(run())


def check_stretches(native, events):
    """Each hand-off continues from exactly the text and ids before it: its at_char is the text so far, the
    first cloud stretch is the start of the plain answer, and each device stretch is what the device says
    from its start (all of it for the last stretch). Not plain-answer equality: prefilling the ids so far
    and decoding them one by one may break a near-tie differently."""
    text, ids, stretches = "", [], [("", [], [])]
    for e in events:
        if e.type == "delta":
            stretches[-1][2].append(e)
            text, ids = text + e.text, ids + e.token_ids
        elif e.type == "handoff":
            assert e.info["at_char"] == len(text) and e.info["token_ids"]
            stretches.append((text, ids, []))
    assert native.generate(ask()).text.startswith("".join(d.text for d in stretches[0][2]))
    for i, (before, before_ids, deltas) in enumerate(stretches):
        if deltas and deltas[0].source == "local":
            cont = ask(MAX_TOKENS - len(before_ids), prefix=before)
            cont.prefix_token_ids = before_ids
            expect, got = native.generate(cont), "".join(d.text for d in deltas)
            if i == len(stretches) - 1:
                assert got == expect.text and events[-1].finish_reason == expect.finish_reason, i
            else:
                assert expect.text.startswith(got), i
    assert events[-1].usage.completion_tokens == len(ids) <= MAX_TOKENS


def test_a_lost_connection_to_a_worker_that_is_still_up_is_handed_back(worker, native_backend):
    events = run_dropping(worker, SlowDevice(native_backend), 10, max_drops=1, probe_interval=0.05)
    deltas, handoffs = split(events)
    assert [(h["from"], h["to"]) for h in handoffs] == [("cloud", "local"), ("local", "cloud")]
    assert "unreachable" in handoffs[0]["reason"] and "no hand-back" not in handoffs[0]["reason"]
    assert handoffs[1]["reason"].startswith("hand-back 1 of at most 2")
    sources = [d.source for d in deltas]
    assert sources[:10] == ["cloud"] * 10 and "local" in sources and sources[-1] == "cloud"
    check_stretches(native_backend, events)


@pytest.mark.parametrize("max_handbacks", [0, 2])
def test_a_cloud_that_keeps_dropping_is_handed_back_at_most_max_handbacks_times(worker, native_backend,
                                                                                max_handbacks):
    """Every cloud stretch is cut at its 3rd delta, and every probe finds the worker up again: the answer
    goes back max_handbacks times, each after twice the previous wait, and then stays on the device."""
    interval = 0.1
    events = run_dropping(worker, SlowDevice(native_backend), 3, probe_interval=interval,
                          max_handbacks=max_handbacks)
    deltas, handoffs = split(events)
    assert len(handoffs) == 1 + 2 * max_handbacks
    assert [(h["from"], h["to"]) for h in handoffs] == [("cloud", "local"), ("local", "cloud")] * max_handbacks + [
        ("cloud", "local")]
    assert f"no hand-back in this answer (limit of {max_handbacks} reached)" in handoffs[-1]["reason"]
    last = max(i for i, e in enumerate(events) if e.type == "handoff")
    assert {e.source for e in events[last + 1:] if e.type == "delta"} == {"local"}
    for k in range(max_handbacks):  # back-off: the k-th hand-back waited at least probe_interval * 2**k
        failover, back = handoffs[2 * k], handoffs[2 * k + 1]
        delay = interval * 2 ** k
        assert back["reason"].startswith(f"hand-back {k + 1} of at most {max_handbacks}")
        assert f"probed every {delay:g} s" in back["reason"]
        assert back["t"] - failover["t"] >= delay - 1e-3, (k, back["t"] - failover["t"])
    check_stretches(native_backend, events)


def test_hand_back_settings_are_validated_and_the_back_off_doubles(native_backend):
    rt = HybridRuntime(native_backend, None, probe_interval=0.25, max_handbacks=3)
    assert [rt.handback_delay(k) for k in range(4)] == [0.25, 0.5, 1.0, 2.0]
    for bad in ({"max_handbacks": -1}, {"max_handbacks": 1.5}, {"max_handbacks": True}, {"probe_interval": 0},
                {"hand_back": "sometimes"}):
        with pytest.raises(ValueError):
            HybridRuntime(native_backend, None, **bad)
