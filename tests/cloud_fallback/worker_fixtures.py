"""A real `edge-runtime worker` process on loopback for the tests, and small helpers around it."""
from __future__ import annotations

import asyncio
import json
import os

from websockets.asyncio.client import connect

from cloud_fallback import launcher
from cloud_fallback.protocol import Hello, encode

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class WorkerProcess(launcher.WorkerProcess):
    def __init__(self, *extra: str, token: str = "test-token-123"):
        super().__init__(*extra, token=token, cwd=ROOT)


async def open_raw(worker: WorkerProcess, token: str | None = None, **kwargs):
    """A raw WebSocket past the handshake (hello -> welcome); returns (ws, welcome dict)."""
    ws = await connect(worker.url, max_size=None, **kwargs)
    await ws.send(encode(Hello(worker.token if token is None else token)))
    welcome = json.loads(await ws.recv())
    assert welcome["type"] == "welcome", welcome
    return ws, welcome


async def collect(ws, ids: set[str]) -> dict[str, list[dict]]:
    """Read frames until every id in `ids` got its done or error; frames grouped by id."""
    frames: dict[str, list[dict]] = {i: [] for i in ids}
    open_ids = set(ids)
    while open_ids:
        f = json.loads(await asyncio.wait_for(ws.recv(), 120))
        frames.setdefault(f.get("id"), []).append(f)
        if f["type"] in ("done", "error") and f.get("id") in open_ids:
            open_ids.discard(f["id"])
    return frames


def joined(frames: list[dict]) -> tuple[str, list[int]]:
    deltas = [f for f in frames if f["type"] == "delta"]
    assert [d["seq"] for d in deltas] == list(range(len(deltas))), "seq must count from 0 without gaps"
    return "".join(d["text"] for d in deltas), [t for d in deltas for t in d["token_ids"]]


PROMPTS = ["Write a haiku about the sea.", "What is the capital of France?", "List three colors.",
           "Explain gravity to a child.", "Name a famous painter.", "Why is the sky blue?"]


def plain_worker() -> WorkerProcess:
    """The worker most tests talk to: default engine, small limits, a 20 s resume grace."""
    return WorkerProcess("--max-prompt-tokens", "300", "--max-tokens", "400", "--resume-grace", "20")


def gen(id, content=None, prompt=None, **params):
    frame = {"type": "generate", "id": id, "params": {"max_tokens": 40, "temperature": 0, **params}}
    if prompt is not None:
        frame["prompt"] = prompt
    else:
        frame["messages"] = [{"role": "user", "content": content}]
    return json.dumps(frame)


def run(coro):
    return asyncio.run(coro)


def solo_runs(worker: WorkerProcess) -> dict:
    """Each of PROMPTS run alone (one stream in flight at a time): {i: (text, token ids, done frame)}."""
    async def go():
        ws, _ = await open_raw(worker)
        out = {}
        for i, p in enumerate(PROMPTS):
            await ws.send(gen(f"solo{i}", p))
            frames = (await collect(ws, {f"solo{i}"}))[f"solo{i}"]
            out[i] = (*joined(frames), frames[-1])
        await ws.close()
        return out
    return run(go())


def answers_at_once(worker: WorkerProcess, prompts: list[str], prefix: str = "p") -> list[list[dict]]:
    """`prompts` sent at once on one connection (ids prefix + index); each one's frames, in order."""
    async def go():
        ws, _ = await open_raw(worker)
        for i, p in enumerate(prompts):
            await ws.send(gen(f"{prefix}{i}", p))
        frames = await collect(ws, {f"{prefix}{i}" for i in range(len(prompts))})
        await ws.close()
        return [frames[f"{prefix}{i}"] for i in range(len(prompts))]
    return run(go())
