"""Offline mode on a laptop: the hybrid runtime with the network off. Every answer is made on the device and
the start event says why; nothing is sent anywhere, even when a request asks for the cloud.

Run: .venv/bin/python examples/offline_laptop.py ["Your question"]
"""
import asyncio
import sys

from edge_runtime.backends import create_backend
from edge_runtime.hybrid.runtime import HybridRuntime
from edge_runtime.request import GenerationRequest, SamplingParams


async def main() -> None:
    question = " ".join(sys.argv[1:]) or "Give me three tips for a long train journey."
    runtime = HybridRuntime(create_backend("native"), cloud=None, offline=True)
    for route in ("auto", "cloud"):  # even an explicit cloud hint stays on the device
        request = GenerationRequest(messages=[{"role": "user", "content": question}],
                                    params=SamplingParams(max_tokens=48), route=route)
        async for ev in runtime.stream(request):
            if ev.type == "start":
                print(f"[asked route={route}; answered {ev.info['route']}: {ev.info['route_reason']}]")
            elif ev.type == "delta":
                print(ev.text, end="", flush=True)
            elif ev.type == "finish":
                print(f"\n[{ev.finish_reason}; tokens by source {ev.info['usage_by_source']}]")


if __name__ == "__main__":
    asyncio.run(main())
