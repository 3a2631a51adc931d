"""WebSocket /v1/stream on a real gateway process: the hybrid events as frames, auth, cancel, bad frames,
and resume after a dropped connection with nothing lost or repeated."""
import asyncio
import json

import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

from tests.edge_runtime.server.gateway_fixtures import KEY, Gateway

GRACE_S = 3.0

QUESTION = [{"role": "user", "content": "Explain how a rainbow forms."}]


@pytest.fixture(scope="module")
def gw():
    """This module's gateway: a short resume grace, so the expiry path can be waited for."""
    g = Gateway("--resume-grace", str(GRACE_S))
    yield g
    g.stop()


# the fields each server frame carries on every path that ends a stream (docs/protocol.md, "The gateway's stream")
FINISH_FIELDS = {"type", "id", "n", "finish_reason", "usage", "usage_by_source", "handoffs", "source"}
ERROR_FIELDS = {"type", "id", "code", "message"}


def ws_url(gw):
    return gw.url.replace("http://", "ws://") + "/v1/stream"


async def hello(gw):
    ws = await connect(ws_url(gw))
    await ws.send(json.dumps({"type": "hello", "api_key": KEY}))
    welcome = json.loads(await ws.recv())
    assert welcome == {"type": "welcome", "model": welcome["model"], "resume_grace_s": GRACE_S}
    return ws


async def read_until_end(ws, sid, frames):
    while True:
        f = json.loads(await asyncio.wait_for(ws.recv(), 120))
        if f.get("id") == sid:
            frames.append(f)
            if f["type"] in ("finish", "error"):
                return frames


def test_stream_frames_equal_the_local_answer(gw, native_backend):
    from edge_runtime.request import GenerationRequest, SamplingParams

    async def go():
        ws = await hello(gw)
        await ws.send(json.dumps({"type": "generate", "id": "a", "messages": QUESTION,
                                  "params": {"max_tokens": 24, "temperature": 0}}))
        frames = await read_until_end(ws, "a", [])
        await ws.close()
        return frames
    frames = asyncio.run(go())
    assert [f["n"] for f in frames] == list(range(len(frames)))
    assert frames[0]["type"] == "start" and frames[0]["route"] == "local" and frames[-1]["type"] == "finish"
    deltas = [f for f in frames if f["type"] == "delta"]
    local = native_backend.generate(GenerationRequest(messages=QUESTION, params=SamplingParams(max_tokens=24)))
    assert "".join(d["text"] for d in deltas) == local.text and {d["source"] for d in deltas} == {"local"}
    assert frames[-1]["usage"]["completion_tokens"] == local.usage.completion_tokens
    assert set(frames[-1]) == FINISH_FIELDS and frames[-1]["usage_by_source"]["local"]["completion_tokens"] == \
        local.usage.completion_tokens and frames[-1]["handoffs"] == [] and frames[-1]["source"] == "local"
    assert frames[0]["prompt_tokens"] == frames[-1]["usage"]["prompt_tokens"] > 0


def test_resume_after_a_dropped_connection_loses_and_repeats_nothing(gw):
    async def go():
        ws = await hello(gw)
        await ws.send(json.dumps({"type": "generate", "id": "r", "messages": QUESTION, "params": {"max_tokens": 60, "temperature": 0}}))
        got = []
        while len(got) < 6:
            got.append(json.loads(await ws.recv()))
        ws.transport.abort() if hasattr(ws, "transport") else None
        await ws.close()
        await asyncio.sleep(0.5)  # the stream goes on generating meanwhile
        ws2 = await hello(gw)
        await ws2.send(json.dumps({"type": "resume", "id": "r", "after": got[-1]["n"]}))
        rest = await read_until_end(ws2, "r", [])
        # and a fresh, uninterrupted run of the same request
        await ws2.send(json.dumps({"type": "generate", "id": "s", "messages": QUESTION, "params": {"max_tokens": 60, "temperature": 0}}))
        whole = await read_until_end(ws2, "s", [])
        await ws2.close()
        return got, rest, whole
    got, rest, whole = asyncio.run(go())
    frames = got + rest
    assert [f["n"] for f in frames] == list(range(len(frames))), [f["n"] for f in frames]
    text = "".join(f["text"] for f in frames if f["type"] == "delta")
    assert text == "".join(f["text"] for f in whole if f["type"] == "delta") and frames[-1]["type"] == "finish"


def test_cancel_bad_frames_and_auth(gw):
    async def go():
        ws = await hello(gw)
        await ws.send("not json")
        bad = json.loads(await ws.recv())
        await ws.send(json.dumps({"type": "generate", "id": "x", "messages": QUESTION, "params": {"top_p": 0}}))
        invalid = json.loads(await ws.recv())
        await ws.send(json.dumps({"type": "generate", "id": "c", "messages": QUESTION,
                                  "params": {"max_tokens": 500, "ignore_eos": True}}))
        frames = [json.loads(await ws.recv()) for _ in range(3)]
        await ws.send(json.dumps({"type": "cancel", "id": "c"}))
        frames = await read_until_end(ws, "c", frames)
        await ws.send(json.dumps({"type": "resume", "id": "nope", "after": 0}))
        unknown = json.loads(await ws.recv())
        await ws.send(json.dumps({"type": "frobnicate", "id": "z"}))
        bad_type = json.loads(await ws.recv())
        await ws.close()
        denied = await connect(ws_url(gw))
        await denied.send(json.dumps({"type": "hello", "api_key": "wrong"}))
        with pytest.raises(ConnectionClosed) as e:
            await denied.recv()
        return bad, invalid, frames, unknown, bad_type, e.value.rcvd.code
    bad, invalid, frames, unknown, bad_type, code = asyncio.run(go())
    assert bad["code"] == "bad_frame" and set(bad) == ERROR_FIELDS
    assert bad_type["code"] == "unknown_type" and bad_type["id"] == "z" and "frobnicate" in bad_type["message"]
    assert invalid["code"] == "invalid_request" and "top_p" in invalid["message"]
    assert frames[-1]["type"] == "finish" and frames[-1]["finish_reason"] == "cancelled"
    assert sum(f["type"] == "delta" for f in frames) < 500
    # a cancelled stream finishes with the fields of a natural finish, counted from the frames it sent
    end, deltas = frames[-1], [f for f in frames if f["type"] == "delta"]
    sent = sum(len(f["token_ids"]) for f in deltas)
    assert set(end) == FINISH_FIELDS and end["n"] == len(frames) - 1 and end["source"] == "local"
    assert end["usage"] == {"prompt_tokens": frames[0]["prompt_tokens"], "completion_tokens": sent} and sent > 0
    assert end["usage_by_source"] == {"local": end["usage"]} and end["handoffs"] == []
    assert unknown["code"] == "unknown_stream" and code == 4401


def _metric(gw, name: str) -> float:
    import urllib.request

    req = urllib.request.Request(gw.url + "/metrics", headers={"Authorization": f"Bearer {KEY}"})
    with urllib.request.urlopen(req, timeout=30) as r:
        for line in r.read().decode().splitlines():
            if line.startswith(name + " ") or line.startswith(name + "{"):
                return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not on /metrics")


def test_a_stream_nobody_resumes_stops_when_its_grace_period_ends(gw):
    async def go():
        ws = await hello(gw)
        await ws.send(json.dumps({"type": "generate", "id": "g", "messages": QUESTION,
                                  "params": {"max_tokens": 2000, "ignore_eos": True}}))
        got = [json.loads(await ws.recv()) for _ in range(3)]
        await ws.close()
        running = _metric(gw, "edge_gateway_in_flight")
        await asyncio.sleep(GRACE_S + 2.0)
        ws2 = await hello(gw)
        await ws2.send(json.dumps({"type": "resume", "id": "g", "after": got[-1]["n"]}))
        gone = json.loads(await asyncio.wait_for(ws2.recv(), 30))
        await ws2.close()
        return running, gone, _metric(gw, "edge_gateway_in_flight")
    running, gone, after = asyncio.run(go())
    assert running == 1 and after == 0  # the generation stopped at the end of the grace period
    assert set(gone) == ERROR_FIELDS and gone["code"] == "unknown_stream" and gone["id"] == "g"
    assert f"{GRACE_S:g} s" in gone["message"]
