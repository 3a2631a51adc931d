"""A streaming WebSocket client of the gateway's /v1/stream: start a generation, drop the connection halfway,
reconnect and `resume` from the last frame received; the text comes out whole, each piece marked with its source.

Run: .venv/bin/python examples/ws_client.py [ws://host:port/v1/stream]   (without a URL it starts a gateway)
"""
import asyncio
import json
import os
import re
import signal
import subprocess
import sys

from websockets.asyncio.client import connect

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QUESTION = "Explain in two sentences why leaves change colour in autumn."


async def stream(url: str) -> None:
    frames = []
    async with connect(url) as ws:
        await ws.send(json.dumps({"type": "generate", "id": "q1", "messages": [{"role": "user", "content": QUESTION}],
                                  "params": {"max_tokens": 60}}))
        while len(frames) < 8:
            frames.append(json.loads(await ws.recv()))
    print(f"[connection dropped after frame {frames[-1]['n']}; reconnecting]")
    async with connect(url) as ws:
        await ws.send(json.dumps({"type": "resume", "id": "q1", "after": frames[-1]["n"]}))
        while frames[-1]["type"] not in ("finish", "error"):
            frames.append(json.loads(await ws.recv()))
    for f in frames:
        if f["type"] == "start":
            print(f"[route {f['route']}: {f['route_reason']}]")
        elif f["type"] == "delta":
            print(f["text"], end="", flush=True)
        elif f["type"] == "handoff":
            print(f" [-> {f['to']}] ", end="")
        elif f["type"] == "finish":
            print(f"\n[{f['finish_reason']}; frames 0..{f['n']} with none missing: "
                  f"{[x['n'] for x in frames] == list(range(len(frames)))}; by source {f.get('usage_by_source')}]")


def main() -> int:
    if len(sys.argv) > 1:
        asyncio.run(stream(sys.argv[1]))
        return 0
    gateway = subprocess.Popen([sys.executable, "-m", "edge_cli", "serve", "--port", "0", "--threads", "2"],
                               cwd=ROOT, stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        url = re.search(r"http://(\S+)", gateway.stdout.readline()).group(1)
        asyncio.run(stream(f"ws://{url}/v1/stream"))
        return 0
    finally:
        os.killpg(gateway.pid, signal.SIGTERM)
        gateway.wait(15)


if __name__ == "__main__":
    sys.exit(main())
