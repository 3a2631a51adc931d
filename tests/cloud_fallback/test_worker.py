"""The cloud worker as a real process on loopback, driven by real WebSocket clients.

Batching is lossless (concurrent greedy streams equal the same requests run
alone), cancel and disconnect give KV blocks back at once, malformed frames
get errors while other streams go on, auth failures close with 4401, resume
replays exactly the missing deltas, and /health and /metrics answer.
"""
import asyncio
import json
import time

import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

from cloud_fallback.client import WorkerAuthError, WorkerClient, WorkerStreamError
from tests.cloud_fallback.worker_fixtures import (PROMPTS, WorkerProcess, answers_at_once, collect, gen, joined,
                                                  open_raw, run)


def wait_for(cond, timeout=30.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.05)
    return False


def test_concurrent_greedy_streams_equal_solo_runs(worker, solo):
    async def go():
        a, _ = await open_raw(worker)
        b, _ = await open_raw(worker)
        for i, p in enumerate(PROMPTS):  # four on one connection, two on another, all at once
            await (a if i < 4 else b).send(gen(f"c{i}", p))
        fa, fb = await asyncio.gather(collect(a, {f"c{i}" for i in range(4)}),
                                      collect(b, {f"c{i}" for i in range(4, 6)}))
        await a.close()
        await b.close()
        return {**fa, **fb}
    frames = run(go())
    for i in range(len(PROMPTS)):
        text, ids = joined(frames[f"c{i}"])
        done = frames[f"c{i}"][-1]
        assert done["type"] == "done"
        assert ids == solo[i][1], f"prompt {i}: batched tokens differ from the solo run"
        assert text == solo[i][0]
        assert done["finish_reason"] == solo[i][2]["finish_reason"]
        assert done["usage"] == solo[i][2]["usage"]
    assert worker.metrics()["edge_worker_kv_blocks_used"] == 0


def test_client_class_streams_as_async_iterator(worker, solo):
    async def go():
        async with WorkerClient(worker.url, worker.token) as client:
            assert client.welcome.limits["max_tokens"] == 400
            streams = [client.stream(messages=[{"role": "user", "content": PROMPTS[i]}],
                                     params={"max_tokens": 40}) for i in (0, 1)]
            return await asyncio.gather(*(s.text() for s in streams))
    results = run(go())
    for i, (text, done) in enumerate(results):
        assert text == solo[i][0]
        assert done.finish_reason == solo[i][2]["finish_reason"]


def test_cancel_and_disconnect_return_kv_blocks(worker):
    idle = worker.metrics()["edge_worker_kv_blocks_used"]
    assert idle == 0

    async def cancel_one():
        ws, _ = await open_raw(worker)
        await ws.send(gen("long1", "Tell me a very long story about a dragon.", max_tokens=400))
        seen = [json.loads(await ws.recv()) for _ in range(3)]
        assert all(f["type"] == "delta" for f in seen)
        assert worker.metrics()["edge_worker_kv_blocks_used"] > 0  # it holds blocks while it runs
        await ws.send(json.dumps({"type": "cancel", "id": "long1"}))
        frames = (await collect(ws, {"long1"}))["long1"]
        await ws.close()
        return frames[-1]
    done = run(cancel_one())
    assert done["type"] == "done" and done["finish_reason"] == "cancelled"
    assert done["usage"]["completion_tokens"] < 400
    assert worker.metrics()["edge_worker_kv_blocks_used"] == idle  # freed before done was sent

    async def drop_one():
        ws, _ = await open_raw(worker)
        await ws.send(gen("long2", "Tell me a very long story about a castle.", max_tokens=400))
        for _ in range(3):
            await ws.recv()
        ws.transport.abort()  # the client vanishes without a close frame
    run(drop_one())
    assert wait_for(lambda: worker.metrics()["edge_worker_kv_blocks_used"] == idle), \
        "a dropped connection's KV blocks were not returned"


def test_malformed_frames_get_errors_and_other_streams_go_on(worker, solo):
    bad = [("not json at all", "bad_frame"), ('{"type": 5}', "bad_frame"), ("[1, 2]", "bad_frame"),
           ('{"type":"bogus","id":"x1"}', "unknown_type"), (b"\x00\x01binary", "bad_frame"),
           ('{"type":"generate","id":"x2","prompt":"hi","params":"fast"}', "bad_frame"),
           ('{"type":"generate","id":"x3","prompt":"hi","colour":"red"}', "bad_frame"),
           ('{"type":"generate","id":"x4","prompt":"hi","params":{"top_p":0}}', "invalid_request"),
           ('{"type":"generate","id":"x5","prompt":"hi","params":{"max_tokens":401}}', "invalid_request"),
           ('{"type":"generate","id":"x6","prompt":"' + "word " * 400 + '"}', "context_length_exceeded"),
           ('{"type":"generate","id":"x7","prompt":"' + "x" * (1 << 20) + '"}', "frame_too_large"),
           ('{"type":"cancel","id":"nope"}', "unknown_stream"), ('{"type":"hello","protocol":1,"token":"t"}', "bad_frame"),
           ('{"type":"done","id":"x8","finish_reason":"stop"}', "bad_frame")]

    async def go():
        ws, _ = await open_raw(worker)
        await ws.send(gen("good", PROMPTS[2]))
        errors = []
        for message, _ in bad:
            await ws.send(message)
        frames = {"good": []}
        while len(errors) < len(bad) or not frames["good"] or frames["good"][-1]["type"] != "done":
            f = json.loads(await asyncio.wait_for(ws.recv(), 60))
            if f.get("id") == "good":
                frames["good"].append(f)
            else:
                assert f["type"] == "error", f
                errors.append(f)
        await ws.send(gen("after", PROMPTS[1]))  # still serving on the same connection
        after = (await collect(ws, {"after"}))["after"]
        await ws.close()
        return errors, frames["good"], after
    errors, good, after = run(go())
    assert [e["code"] for e in errors] == [code for _, code in bad]
    assert all(e["message"] for e in errors)
    assert errors[3]["id"] == "x1" and "id" not in errors[0]
    assert "top_p" in errors[7]["message"] and "401" in errors[8]["message"]
    assert "prompt is" in errors[9]["message"]
    assert joined(good)[1] == solo[2][1]
    assert joined(after)[1] == solo[1][1]


@pytest.mark.parametrize("first", [None, "wrong-token", "generate", "notjson"])
def test_auth_failures_close_with_4401(worker, first):
    async def go():
        ws = await connect(worker.url)
        if first == "generate":
            await ws.send(gen("r1", "hi"))
        elif first == "notjson":
            await ws.send("hello?")
        elif first == "wrong-token":
            await ws.send(json.dumps({"type": "hello", "protocol": 1, "token": "wrong-token"}))
        else:
            await ws.send(json.dumps({"type": "hello", "protocol": 1}))  # no token
        with pytest.raises(ConnectionClosed) as info:
            await ws.recv()
        return info.value.rcvd.code
    assert run(go()) == 4401


def test_client_reports_a_wrong_token(worker):
    async def go():
        with pytest.raises(WorkerAuthError):
            await WorkerClient(worker.url, "nope").connect()
    run(go())


def test_resume_after_a_dropped_connection_replays_exactly_the_missing_deltas(worker):
    prompt = "Describe a walk through a forest in autumn."

    async def go():
        ws, _ = await open_raw(worker)
        await ws.send(gen("ref", prompt, max_tokens=60))
        ref = (await collect(ws, {"ref"}))["ref"]
        await ws.send(gen("res", prompt, max_tokens=60))
        first = [json.loads(await ws.recv()) for _ in range(5)]
        ws.transport.abort()
        await asyncio.sleep(0.3)
        ws2, _ = await open_raw(worker)
        await ws2.send(json.dumps({"type": "resume", "id": "res", "after_seq": 2}))  # 3 and 4 were lost too
        rest = (await collect(ws2, {"res"}))["res"]
        await ws2.send(json.dumps({"type": "resume", "id": "never-was", "after_seq": 0}))
        unknown = json.loads(await ws2.recv())
        await ws2.close()
        return ref, first, rest, unknown
    ref, first, rest, unknown = run(go())
    assert [f["seq"] for f in first] == [0, 1, 2, 3, 4]
    assert [f["seq"] for f in rest if f["type"] == "delta"][0] == 3  # exactly after after_seq, no gap
    assert joined(first[:3] + rest) == joined(ref)  # the same answer as one uninterrupted stream
    assert rest[-1]["type"] == "done" and rest[-1]["usage"] == ref[-1]["usage"]
    assert unknown["type"] == "error" and unknown["code"] == "unknown_stream"


def test_client_reconnects_and_resumes_by_itself(worker, solo):
    async def go():
        async with WorkerClient(worker.url, worker.token) as client:
            s = client.stream(messages=[{"role": "user", "content": PROMPTS[3]}], params={"max_tokens": 40})
            parts = []
            async for frame in s:
                if frame.type == "done":
                    return "".join(parts), frame, client
                parts.append(frame.text)
                if len(parts) == 4:
                    client.ws.transport.abort()  # the network drops mid-answer
    text, done, client = run(go())
    assert text == solo[3][0]
    assert done.finish_reason == solo[3][2]["finish_reason"]
    assert worker.metrics()["edge_worker_resumes_total"] >= 1


def test_health_and_metrics(worker):
    status, body = worker.get("/health")
    assert status == 200 and json.loads(body)["status"] == "ok"
    m = worker.metrics()
    for name in ("edge_worker_queue_depth", "edge_worker_running_requests", "edge_worker_kv_blocks_used",
                 "edge_worker_kv_blocks_free", "edge_worker_tokens_per_second", "edge_worker_generated_tokens_total"):
        assert name in m, name
    assert m["edge_worker_kv_blocks_free"] > 0


def test_slow_reader_does_not_stall_other_connections(worker, solo):
    async def go():
        slow, _ = await open_raw(worker, max_queue=1)  # reads nothing until the other stream is done
        await slow.send(gen("slow", "Write a long poem about rivers.", max_tokens=200))
        fast, _ = await open_raw(worker)
        await fast.send(gen("fast", PROMPTS[4]))
        got = (await collect(fast, {"fast"}))["fast"]
        slow_frames = (await collect(slow, {"slow"}))["slow"]
        await fast.close()
        await slow.close()
        return got, slow_frames
    got, slow_frames = run(go())
    assert joined(got)[1] == solo[4][1]
    assert slow_frames[-1]["type"] == "done"
    assert len(joined(slow_frames)[1]) == slow_frames[-1]["usage"]["completion_tokens"]


def test_busy_beyond_the_per_connection_limit_and_tls(tmp_path):
    import ssl
    import subprocess

    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out",
                    str(cert), "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True)
    w = WorkerProcess("--max-streams-per-connection", "2", "--tls-cert", str(cert), "--tls-key", str(key))
    try:
        assert w.url.startswith("wss://")
        ctx = ssl.create_default_context(cafile=str(cert))

        async def go():
            async with WorkerClient(w.url, w.token, ssl=ctx) as client:
                streams = [client.stream(prompt="Once upon a time", params={"max_tokens": 30}) for _ in range(3)]
                results = []
                for s in streams:
                    try:
                        results.append(await s.text())
                    except WorkerStreamError as e:
                        results.append(e)
                return results
        results = run(go())
        busy = [r for r in results if isinstance(r, WorkerStreamError)]
        assert len(busy) == 1 and busy[0].code == "busy" and busy[0].retry_after > 0
        texts = [r[0] for r in results if not isinstance(r, WorkerStreamError)]
        assert len(texts) == 2 and texts[0] == texts[1] and texts[0]
        status, _ = w.get("/health", context=ctx)
        assert status == 200
    finally:
        w.stop()


def test_preemption_under_a_tiny_kv_budget_gives_identical_outputs(solo):
    """19 blocks of 16 tokens for six concurrent requests that need ~6 blocks each: sequences are
    preempted (their blocks taken back) and recomputed later, and every answer is still the solo one."""
    w = WorkerProcess("--kv-budget", "7MiB", "--max-batch", "6")
    try:
        frames = answers_at_once(w, PROMPTS)
        m = w.metrics()
    finally:
        w.stop()
    assert m["edge_worker_preemptions_total"] > 0, "the budget was meant to force preemption"
    assert m["edge_worker_kv_blocks_free"] == 19
    for i in range(len(PROMPTS)):
        assert frames[i][-1]["type"] == "done"
        assert joined(frames[i]) == solo[i][:2], f"prompt {i} changed under preemption"


def test_every_terminal_path_carries_the_documented_fields(worker):
    """docs/protocol.md's terminal frames, each with every field it lists: `done` {type, id, finish_reason,
    usage {prompt_tokens, completion_tokens}} after a natural end, a stop string, max_tokens and cancel;
    `error` {type, id, code, message} for a bad request and for a resume once a dropped stream's grace
    period is over (a worker with a 1 s grace)."""
    def check_done(frame, reason, id):
        assert frame["type"] == "done" and frame["id"] == id and frame["finish_reason"] == reason, frame
        assert {"type", "id", "finish_reason", "usage"} <= set(frame)
        assert set(frame["usage"]) >= {"prompt_tokens", "completion_tokens"}
        assert frame["usage"]["prompt_tokens"] > 0

    async def go():
        ws, _ = await open_raw(worker)
        await ws.send(gen("natural", "Reply with one word: what color is the sky?", max_tokens=200))
        natural = (await collect(ws, {"natural"}))["natural"]
        words = joined(natural)[0].split()
        await ws.send(gen("stopped", "Reply with one word: what color is the sky?", max_tokens=200, stop=[words[2]]))
        stopped = (await collect(ws, {"stopped"}))["stopped"]
        await ws.send(gen("short", "What is the capital of France?", max_tokens=3))
        short = (await collect(ws, {"short"}))["short"]
        await ws.send(gen("gone", "Tell me a very long story about a dragon.", max_tokens=400))
        assert json.loads(await ws.recv())["type"] == "delta"
        await ws.send(json.dumps({"type": "cancel", "id": "gone"}))
        cancelled = (await collect(ws, {"gone"}))["gone"]
        await ws.send(gen("bad", "Hi", temperature=-1))
        bad = json.loads(await ws.recv())
        await ws.close()
        return natural, words, stopped, short, cancelled, bad
    natural, words, stopped, short, cancelled, bad = run(go())
    check_done(natural[-1], "stop", "natural")
    assert natural[-1]["usage"]["completion_tokens"] < 200
    check_done(stopped[-1], "stop", "stopped")
    assert words[2] not in joined(stopped)[0] and joined(natural)[0].startswith(joined(stopped)[0])
    check_done(short[-1], "length", "short")
    assert short[-1]["usage"]["completion_tokens"] == 3
    check_done(cancelled[-1], "cancelled", "gone")
    assert bad["type"] == "error" and bad["id"] == "bad" and bad["code"] == "invalid_request" and bad["message"]

    brief = WorkerProcess("--resume-grace", "1")
    try:
        async def expire():
            ws, _ = await open_raw(brief)
            await ws.send(gen("lost", "Tell me a very long story about a castle.", max_tokens=400))
            await ws.recv()
            ws.transport.abort()
            await asyncio.sleep(2.5)  # past the grace period
            ws2, _ = await open_raw(brief)
            await ws2.send(json.dumps({"type": "resume", "id": "lost", "after_seq": 0}))
            frame = json.loads(await ws2.recv())
            await ws2.close()
            return frame
        expired = run(expire())
    finally:
        brief.stop()
    assert expired["type"] == "error" and expired["id"] == "lost" and expired["code"] == "unknown_stream"
    assert expired["message"]
