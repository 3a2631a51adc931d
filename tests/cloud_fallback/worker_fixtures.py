"""A real `edge-runtime worker` process on loopback for the tests, and small helpers around it."""
from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import urllib.request

from websockets.asyncio.client import connect

from cloud_fallback.protocol import Hello, encode

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class WorkerProcess:
    def __init__(self, *extra: str, token: str = "test-token-123", start_timeout: float = 180.0):
        self.token = token
        fd, self.token_file = tempfile.mkstemp(prefix="worker-token-")
        with os.fdopen(fd, "w") as f:
            f.write(token + "\n")
        cmd = [sys.executable, "-m", "edge_runtime", "worker", "--port", "0", "--token-file", self.token_file,
               "--threads", "2", *extra]
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     start_new_session=True)
        self.stderr: list[str] = []
        threading.Thread(target=lambda: self.stderr.extend(self.proc.stderr), daemon=True).start()
        line: list[str] = []
        reader = threading.Thread(target=lambda: line.append(self.proc.stdout.readline()), daemon=True)
        reader.start()
        reader.join(start_timeout)
        m = re.search(r"listening on (wss?)://([\d.]+):(\d+)", line[0] if line else "")
        if not m:
            self.stop()
            raise RuntimeError(f"worker did not start: {line} {''.join(self.stderr)[-3000:]}")
        scheme, host, self.port = m.group(1), m.group(2), int(m.group(3))
        self.url = f"{scheme}://{host}:{self.port}"
        self.http_url = f"{'https' if scheme == 'wss' else 'http'}://{host}:{self.port}"

    def get(self, path: str, context=None) -> tuple[int, str]:
        with urllib.request.urlopen(self.http_url + path, timeout=10, context=context) as r:
            return r.status, r.read().decode()

    def metrics(self) -> dict[str, float]:
        _, text = self.get("/metrics")
        out = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                out[name] = float(value)
        return out

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        os.unlink(self.token_file)


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
