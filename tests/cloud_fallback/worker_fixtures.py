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
