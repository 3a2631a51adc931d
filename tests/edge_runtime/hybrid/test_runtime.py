"""The hybrid runtime with a real worker process: routing decisions, one ordered stream across sources,
failover to the device when the worker is SIGKILLed mid-answer, and resume when only the connection drops."""
import asyncio
import random

import pytest

from cloud_fallback.cloud_backend import CloudBackend
from cloud_fallback.launcher import WorkerProcess
from edge_runtime.hybrid.runtime import HybridRuntime
from edge_runtime.request import GenerationRequest, SamplingParams

QUESTION = "Explain how a rainbow forms."
MAX_TOKENS = 48


def ask(max_tokens=MAX_TOKENS, **kw):
    return GenerationRequest(messages=[{"role": "user", "content": QUESTION}], params=SamplingParams(max_tokens=max_tokens),
                             **kw)


async def collect(runtime, request):
    return [ev async for ev in runtime.stream(request)]


def check_stream(events):
    """One ordered stream: start first, deltas numbered 0.. without gaps, one finish last."""
    assert events[0].type == "start" and events[-1].type == "finish", [e.type for e in events]
    deltas = [e for e in events if e.type == "delta"]
    assert [d.seq for d in deltas] == list(range(len(deltas)))
    assert events[-1].usage.completion_tokens == sum(len(d.token_ids) for d in deltas)
    return deltas


@pytest.mark.parametrize("kw, route, words", [
    ({"local_only": True, "route": "cloud"}, "local", "local_only"),
    ({"route": "cloud"}, "cloud", "hint"),
    ({"route": "local"}, "local", "hint"),
])
def test_route_decisions_say_why(native_backend, kw, route, words):
    cloud = object()  # never called by decide()
    decision = HybridRuntime(native_backend, cloud).decide(ask(**kw))
    assert decision.route == route and words in decision.reason
    assert HybridRuntime(native_backend, cloud, offline=True).decide(ask(route="cloud")).route == "local"
    assert "no cloud" in HybridRuntime(native_backend, None).decide(ask(route="cloud")).reason


@pytest.fixture(scope="module")
def worker():
    w = WorkerProcess()
    yield w
    w.stop()


def test_cloud_route_streams_cloud_deltas_equal_to_the_local_answer(worker, native_backend):
    events = asyncio.run(collect(HybridRuntime(native_backend, CloudBackend(worker.url, worker.token)),
                                 ask(route="cloud")))
    deltas = check_stream(events)
    assert events[0].info["route"] == "cloud" and {d.source for d in deltas} == {"cloud"}
    local = native_backend.generate(ask())
    assert "".join(d.text for d in deltas) == local.text and events[-1].finish_reason == local.finish_reason


def test_connection_cut_mid_answer_resumes_with_the_cloud_20_times(worker, native_backend):
    """The worker stays up, the socket dies at a random delta, 20 times: the client reconnects and resumes
    (protocol `resume`); no hand-off, no gap, no repeat: the same answer as an uninterrupted one."""
    rng = random.Random(5)
    full = native_backend.generate(ask())

    async def run(cut_after):
        cloud = CloudBackend(worker.url, worker.token)
        events = []
        async for ev in HybridRuntime(native_backend, cloud).stream(ask(route="cloud")):
            events.append(ev)
            if ev.type == "delta" and ev.seq + 1 == cut_after:
                cloud.client.ws.transport.abort()
        await cloud.aclose()
        return events
    for attempt in range(20):
        events = asyncio.run(run(rng.randint(1, 40)))
        deltas = check_stream(events)
        assert not [e for e in events if e.type == "handoff"] and {d.source for d in deltas} == {"cloud"}, attempt
        assert "".join(d.text for d in deltas) == full.text and events[-1].finish_reason == full.finish_reason


def test_sigkill_of_the_worker_mid_answer_fails_over_to_the_device_20_times(native_backend):
    """20 times: a fresh worker process, SIGKILLed after a random number of deltas. Every stream
    completes; the cloud part is a prefix of the cloud's full answer (nothing lost or repeated before
    the kill); the local part is exactly what the device says when continuing that text; the finish
    reason and token count are consistent."""
    rng = random.Random(4)
    full = native_backend.generate(ask()).text  # what the (same-model) cloud would have said
    for attempt in range(20):
        kill_after = rng.randint(1, 30)
        w = WorkerProcess()
        try:
            async def run():
                cloud = CloudBackend(w.url, w.token, reconnects=2, reconnect_delay=0.05)
                events = []
                async for ev in HybridRuntime(native_backend, cloud).stream(ask(route="cloud")):
                    events.append(ev)
                    if ev.type == "delta" and ev.seq + 1 == kill_after:
                        w.kill()
                await cloud.aclose()
                return events
            events = asyncio.run(run())
        finally:
            w.stop()
        deltas = check_stream(events)
        handoffs = [e for e in events if e.type == "handoff"]
        cloud_text = "".join(d.text for d in deltas if d.source == "cloud")
        local_text = "".join(d.text for d in deltas if d.source == "local")
        assert len(handoffs) == 1, (attempt, [e.type for e in events])
        assert handoffs[0].info["at_char"] == len(cloud_text) and "unreachable" in handoffs[0].info["reason"]
        assert sum(d.source == "cloud" for d in deltas) >= kill_after
        assert full.startswith(cloud_text), attempt
        used = sum(len(d.token_ids) for d in deltas if d.source == "cloud")
        cont = ask(max_tokens=MAX_TOKENS - used)
        cont.prefix = cloud_text
        expect = native_backend.generate(cont)
        assert local_text == expect.text and events[-1].finish_reason == expect.finish_reason, attempt
        assert events[-1].usage.completion_tokens <= MAX_TOKENS
        assert events[-1].info["usage_by_source"]["cloud"]["completion_tokens"] == used


def test_a_local_request_is_rendered_and_tokenized_once(native_backend):
    """The gateway's context check, the router's size rule and the engine use the same ids: the chat template
    is rendered and the prompt tokenized once per request on the device."""
    runtime = HybridRuntime(native_backend, None, offline=True)
    tokenizer = native_backend.engine.tokenizer
    assert tokenizer is native_backend.runner.tokenizer
    calls = []
    encode = tokenizer.encode
    tokenizer.encode = lambda text, special=True: (calls.append(text), encode(text, special=special))[1]
    try:
        req = ask(max_tokens=8)
        checked = runtime.prompt_tokens(req)  # what the gateway's context check asks first
        events = asyncio.run(collect(runtime, req))
    finally:
        del tokenizer.encode
    assert len(calls) == 1 and checked == len(req.prompt_token_ids)
    assert events[-1].usage.prompt_tokens == checked and check_stream(events)
    plain = native_backend.generate(ask(max_tokens=8))  # tokenized afresh: the same answer
    assert "".join(d.text for d in check_stream(events)) == plain.text
