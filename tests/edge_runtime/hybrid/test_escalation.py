"""Mid-stream escalation (device -> cloud) against a real worker process on loopback.

The worker serves the same model, so when token ids travel the whole answer must equal the device's own
greedy answer, token for token, whatever the hand-off point; when they cannot (a different tokenizer), the
cloud continues from the text and the result equals the device continuing from that text."""
import asyncio

import pytest

from cloud_fallback.cloud_backend import CloudBackend
from cloud_fallback.health import CircuitBreaker
from cloud_fallback.launcher import WorkerProcess
from edge_runtime.hybrid.difficulty import Calibration, TripAt
from edge_runtime.hybrid.runtime import HybridRuntime
from edge_runtime.request import GenerationRequest, SamplingParams
from edge_runtime.hybrid.router import Router

QUESTION = "Explain how a rainbow forms."
MAX_TOKENS = 40


def ask(max_tokens=MAX_TOKENS, prefix=""):
    return GenerationRequest(messages=[{"role": "user", "content": QUESTION}],
                             params=SamplingParams(max_tokens=max_tokens), prefix=prefix)


@pytest.fixture(scope="module")
def worker():
    w = WorkerProcess()
    yield w
    w.stop()


def runtime(local, cloud, policy=None, monitor_factory=None):
    # no device probe: other tests' processes must not make this machine look saturated
    router = Router(cloud, n_ctx=local.n_ctx, policy=policy or Calibration(k=4, threshold=1e9, target_cloud_share=0.3),
                    device_probe=None)
    return HybridRuntime(local, cloud, router=router, policy=policy, monitor_factory=monitor_factory)


async def collect(make_cloud, make_runtime, request):
    cloud = make_cloud()
    try:
        return [ev async for ev in make_runtime(cloud).stream(request)]
    finally:
        await cloud.aclose()


def split(events):
    deltas = [e for e in events if e.type == "delta"]
    assert [d.seq for d in deltas] == list(range(len(deltas)))
    assert events[0].type == "start" and events[-1].type == "finish"
    return deltas, [e.info for e in events if e.type == "handoff"]


@pytest.mark.parametrize("trip_at", [0, 6, 25])
def test_monitor_tripping_at_a_known_token_hands_over_token_for_token(worker, native_backend, trip_at):
    events = asyncio.run(collect(lambda: CloudBackend(worker.url, worker.token),
                                 lambda c: runtime(native_backend, c, monitor_factory=lambda: TripAt(trip_at)), ask()))
    deltas, handoffs = split(events)
    assert events[0].info["route"] == "local" and events[0].info["rule"] == "auto"
    assert [d.source for d in deltas] == ["local"] * (trip_at + 1) + ["cloud"] * (len(deltas) - trip_at - 1)
    local_text = "".join(d.text for d in deltas[:trip_at + 1])
    assert handoffs == [{"from": "local", "to": "cloud", "at_char": len(local_text), "token_ids": True,
                         "reason": "escalation: test: forced escalation", "t": handoffs[0]["t"]}]
    plain = native_backend.generate(ask())
    assert "".join(d.text for d in deltas) == plain.text and sum((d.token_ids for d in deltas), []) == plain.token_ids
    fin = events[-1]
    assert fin.finish_reason == plain.finish_reason and fin.usage.completion_tokens == len(plain.token_ids)
    by = fin.info["usage_by_source"]
    assert by["local"]["completion_tokens"] == trip_at + 1
    assert by["cloud"]["completion_tokens"] == len(plain.token_ids) - trip_at - 1


class OtherTokenizerCloud(CloudBackend):
    """The real worker, announced as if its tokenizer differed (a different cloud model): text-level hand-off."""
    tokenizer_fingerprint = "another-vocabulary"


def test_text_level_hand_off_when_the_tokenizers_differ(worker, native_backend):
    events = asyncio.run(collect(lambda: OtherTokenizerCloud(worker.url, worker.token),
                                 lambda c: runtime(native_backend, c, monitor_factory=lambda: TripAt(9)), ask()))
    deltas, handoffs = split(events)
    local_text = "".join(d.text for d in deltas if d.source == "local")
    cloud_text = "".join(d.text for d in deltas if d.source == "cloud")
    assert handoffs[0]["token_ids"] is False and handoffs[0]["at_char"] == len(local_text) and cloud_text
    expect = native_backend.generate(ask(MAX_TOKENS - 10, prefix=local_text))
    assert cloud_text == expect.text and events[-1].finish_reason == expect.finish_reason


@pytest.mark.parametrize("threshold, escalates", [(-1.0, True), (1e9, False)])
def test_the_calibrated_monitor_decides_after_k_tokens(worker, native_backend, threshold, escalates):
    policy = Calibration(k=3, threshold=threshold, target_cloud_share=0.3, window=16, window_threshold=1e9)
    events = asyncio.run(collect(lambda: CloudBackend(worker.url, worker.token),
                                 lambda c: runtime(native_backend, c, policy=policy), ask(24)))
    deltas, handoffs = split(events)
    assert "difficulty after 3 tokens" in events[0].info["route_reason"]
    if escalates:
        assert len(handoffs) == 1 and handoffs[0]["at_char"] == len("".join(d.text for d in deltas[:3]))
        assert "difficulty" in handoffs[0]["reason"] and {d.source for d in deltas[3:]} == {"cloud"}
    else:
        assert handoffs == [] and {d.source for d in deltas} == {"local"}
    assert "".join(d.text for d in deltas) == native_backend.generate(ask(24)).text


def test_escalation_to_an_unreachable_cloud_comes_straight_back_to_the_device(native_backend):
    dead = WorkerProcess()
    url, token = dead.url, dead.token
    dead.stop()
    events = asyncio.run(collect(lambda: CloudBackend(url, token, health=CircuitBreaker()),
                                 lambda c: runtime(native_backend, c, monitor_factory=lambda: TripAt(4)), ask()))
    deltas, handoffs = split(events)
    assert [(h["from"], h["to"]) for h in handoffs] == [("local", "cloud"), ("cloud", "local")]
    assert "unreachable" in handoffs[1]["reason"] and handoffs[0]["at_char"] == handoffs[1]["at_char"]
    assert {d.source for d in deltas} == {"local"}
    assert "".join(d.text for d in deltas) == native_backend.generate(ask()).text
