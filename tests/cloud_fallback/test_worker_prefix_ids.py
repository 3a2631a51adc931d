"""`prefix_token_ids` on a real worker: the welcome's tokenizer fingerprint, a continuation token for token,
and bad ids answered with invalid_request while the connection keeps serving."""
import asyncio
import json

import pytest

from tests.cloud_fallback.worker_fixtures import WorkerProcess, collect, joined, open_raw

QUESTION = "Why is the sky blue?"


@pytest.fixture(scope="module")
def worker():
    w = WorkerProcess()
    yield w
    w.stop()


def gen(id, max_tokens=30, **extra):
    return json.dumps({"type": "generate", "id": id, "messages": [{"role": "user", "content": QUESTION}],
                       "params": {"max_tokens": max_tokens, "temperature": 0}, **extra})


def test_prefix_token_ids_continue_token_for_token(worker, native_backend):
    async def go():
        ws, welcome = await open_raw(worker)
        await ws.send(gen("full"))
        full = (await collect(ws, {"full"}))["full"]
        text, ids = joined(full)
        head_ids = ids[:7]
        head = b"".join(native_backend.runner.token_bytes(t) for t in head_ids).decode()
        await ws.send(gen("cont", 23, prefix=head, prefix_token_ids=head_ids))
        cont = (await collect(ws, {"cont"}))["cont"]
        await ws.close()
        return welcome, text, ids, head, joined(cont)
    welcome, text, ids, head, (cont_text, cont_ids) = asyncio.run(go())
    assert welcome["tokenizer"] == native_backend.tokenizer_fingerprint and len(welcome["tokenizer"]) == 16
    assert head + cont_text == text and ids[:7] + cont_ids == ids


@pytest.mark.parametrize("bad, code, words", [([1, 10**9], "invalid_request", "outside the vocabulary"),
                                              ([1, -2], "invalid_request", "prefix_token_ids"),
                                              (["a"], "invalid_request", "prefix_token_ids"),
                                              ("12", "bad_frame", "'prefix_token_ids' must be a list")])
def test_bad_prefix_token_ids_get_errors_and_the_connection_goes_on(worker, bad, code, words):
    async def go():
        ws, _ = await open_raw(worker)
        await ws.send(gen("bad", prefix="x", prefix_token_ids=bad))
        await ws.send(gen("ok", 5))
        frames = await collect(ws, {"bad", "ok"})
        await ws.close()
        return frames
    frames = asyncio.run(go())
    err = frames["bad"][-1]
    assert err["type"] == "error" and err["code"] == code and words in err["message"], err
    assert frames["ok"][-1]["type"] == "done"
