"""The worker as a backend: the same events a local backend yields, errors as events, a killed worker."""
import asyncio
import socket

import pytest

from cloud_fallback.cloud_backend import CloudBackend
from edge_runtime.request import GenerationRequest, SamplingParams
from tests.cloud_fallback.worker_fixtures import WorkerProcess


def ask(text, max_tokens=32, **kw):
    return GenerationRequest(messages=[{"role": "user", "content": text}], params=SamplingParams(max_tokens=max_tokens),
                             **kw)


async def drain(backend, request, prefix=None):
    events = [ev async for ev in backend.stream(request, prefix)]
    await backend.aclose()
    return events


@pytest.fixture(scope="module")
def worker():
    w = WorkerProcess("--max-prompt-tokens", "60")
    yield w
    w.stop()


def test_cloud_stream_equals_the_local_backend(worker, native_backend):
    request = ask("Name three rivers in Europe.")
    events = asyncio.run(drain(CloudBackend(worker.url, worker.token), request))
    assert [e.type for e in events][0] == "start" and events[-1].type == "finish"
    assert all(e.source == "cloud" for e in events)
    deltas = [e for e in events if e.type == "delta"]
    assert [d.seq for d in deltas] == list(range(len(deltas)))
    local = native_backend.generate(ask("Name three rivers in Europe."))
    assert "".join(d.text for d in deltas) == local.text  # same engine, same model: same greedy answer
    assert [t for d in deltas for t in d.token_ids] == local.token_ids
    assert events[-1].finish_reason == local.finish_reason and events[-1].usage == local.usage


def test_worker_errors_arrive_as_error_events(worker):
    events = asyncio.run(drain(CloudBackend(worker.url, worker.token), ask("word " * 80)))
    assert events[-1].type == "error" and events[-1].info["code"] == "context_length_exceeded"
    assert "prompt is" in events[-1].error


def test_unreachable_worker_is_an_error_event_not_an_exception():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    events = asyncio.run(drain(CloudBackend(f"ws://127.0.0.1:{port}", "t", connect_timeout=2), ask("hi")))
    assert [e.type for e in events] == ["error"] and events[0].info["code"] == "unreachable"


def test_a_worker_killed_mid_stream_ends_the_stream_with_an_error_and_the_text_so_far():
    """SIGKILL of the real worker process after a few deltas: no exception, an `unreachable` error
    event after the deltas received, which are a prefix of the full answer (what failover builds on)."""
    w = WorkerProcess()
    try:
        full = asyncio.run(drain(CloudBackend(w.url, w.token), ask("Tell me about the moon.", max_tokens=120)))

        async def run():
            backend = CloudBackend(w.url, w.token, reconnects=2, reconnect_delay=0.05)
            events = []
            async for ev in backend.stream(ask("Tell me about the moon.", max_tokens=120)):
                events.append(ev)
                if sum(e.type == "delta" for e in events) == 5:
                    w.kill()
            await backend.aclose()
            return events
        events = asyncio.run(run())
    finally:
        w.stop()
    assert events[-1].type == "error" and events[-1].info["code"] == "unreachable"
    got = "".join(e.text for e in events if e.type == "delta")
    want = "".join(e.text for e in full if e.type == "delta")
    assert 5 <= sum(e.type == "delta" for e in events) and want.startswith(got) and len(got) < len(want)


def test_leaving_early_cancels_on_the_worker(worker):
    async def run():
        backend = CloudBackend(worker.url, worker.token)
        n = 0
        async for ev in backend.stream(ask("Write a long story about a fox.", max_tokens=300)):
            n += ev.type == "delta"
            if n == 3:
                break
        await asyncio.sleep(0.5)
        await backend.aclose()
    asyncio.run(run())

    def idle():
        m = worker.metrics()
        return m["edge_worker_running_requests"] == 0 and m['edge_worker_finished_total{reason="cancelled"}'] >= 1
    import time
    deadline = time.monotonic() + 20
    while not idle() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert idle()


def test_heartbeats_and_the_circuit_breaker_follow_a_real_worker(native_backend):
    """Heartbeats answer while the worker lives; once it is gone, failed connects open the circuit and the
    hybrid router sends a cloud-hinted request to the device, naming the breaker; after the cooldown one
    trial goes through to the restarted worker and closes it."""
    from cloud_fallback.health import CircuitBreaker
    from edge_runtime.hybrid.runtime import HybridRuntime
    from edge_runtime.hybrid.router import Router

    now = [0.0]
    w = WorkerProcess()

    async def phase1(cloud):
        await cloud.connect()
        rtts = [await cloud.heartbeat() for _ in range(3)]
        w.kill()
        w.proc.wait()
        lost = await cloud.heartbeat()
        for _ in range(3):
            with pytest.raises(Exception):
                await cloud.connect()
        return rtts, lost

    cloud = CloudBackend(w.url, w.token, health=CircuitBreaker(failures_to_open=3, cooldown_s=5, clock=lambda: now[0]))
    try:
        rtts, lost = asyncio.run(phase1(cloud))
    finally:
        w.stop()
    assert all(r is not None and r > 0 for r in rtts) and cloud.health.rtt_ms == rtts[-1]
    assert lost is None and cloud.health.state == "open"
    runtime = HybridRuntime(native_backend, cloud, router=Router(cloud, device_probe=None))
    d = runtime.decide(ask("hi", route="cloud"))
    assert (d.route, d.rule) == ("local", "health") and "circuit open" in d.reason
    now[0] = 6.0
    assert runtime.decide(ask("hi", route="cloud")).route == "cloud"  # half-open: one trial
    w2 = WorkerProcess(token=w.token)
    try:
        cloud2 = CloudBackend(w2.url, w2.token, health=cloud.health)
        events = asyncio.run(drain(cloud2, ask("Say yes.", 4)))
    finally:
        w2.stop()
    assert events[-1].type == "finish" and cloud.health.state == "closed" and cloud.health.failures == 0
