"""The engine core's loop on its own thread (batch_engine.py), on the real model."""
import queue

import pytest

from edge_runtime.engine.batch_engine import load_engine
from edge_runtime.engine.scheduler import SchedulerConfig
from edge_runtime.request import GenerationRequest, SamplingParams

ASK = GenerationRequest(messages=[{"role": "user", "content": "Name three colors."}],
                        params=SamplingParams(max_tokens=12))


def events_of(engine, id, request):
    q: queue.Queue = queue.Queue()
    engine.submit(id, request, q.put)
    out = []
    while not out or out[-1].type == "delta":
        out.append(q.get(timeout=60))
    return out


def test_a_step_that_raises_fails_what_is_in_flight_and_the_engine_goes_on(model_path, monkeypatch):
    """A bug inside a step (injected here: the runner raises once) must not leave the engine thread dead and
    every stream waiting forever: the requests in flight end with an `error` event (code "internal"), their
    KV blocks come back, and the next request is answered as if nothing had happened."""
    engine = load_engine(model_path, n_ctx=512, config=SchedulerConfig(4, 512, 256)).start()
    try:
        reference = events_of(engine, "before", ASK)
        assert reference[-1].type == "finish"
        real_run, calls = engine.runner.run, []

        def broken(*args, **kwargs):
            calls.append(1)
            if len(calls) == 1:
                raise RuntimeError("injected fault")
            return real_run(*args, **kwargs)
        monkeypatch.setattr(engine.runner, "run", broken)
        failed = events_of(engine, "during", ASK)
        assert failed[-1].type == "error" and failed[-1].info["code"] == "internal"
        assert "injected fault" in failed[-1].error
        assert engine.blocks.num_free_blocks == engine.blocks.num_blocks
        after = events_of(engine, "after", ASK)
        assert after[-1].type == "finish"
        assert [t for e in after for t in e.token_ids] == [t for e in reference for t in e.token_ids]
    finally:
        engine.stop()
