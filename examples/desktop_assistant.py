"""A desktop assistant on the hybrid runtime: a loopback cloud worker, a conversation kept across turns, each
answer streamed with a marker of its source and of any hand-off.

Run: .venv/bin/python examples/desktop_assistant.py   (type questions; an empty line or end of input quits)
Without a terminal it reads the questions from stdin, one per line.
"""
import sys

from cloud_fallback.cloud_backend import CloudBackend
from cloud_fallback.launcher import WorkerProcess
from edge_runtime.backends import create_backend
from edge_cli.chat import ChatSession
from edge_runtime.hybrid.runtime import HybridRuntime
from edge_runtime.request import SamplingParams


def main() -> int:
    worker = WorkerProcess(threads=2)  # stands in for the cloud GPU worker: same protocol, on loopback
    print(f"[cloud worker on {worker.url}]", flush=True)
    try:
        runtime = HybridRuntime(create_backend("native"), CloudBackend(worker.url, worker.token))
        session = ChatSession(runtime.local, SamplingParams(max_tokens=64), runtime=runtime)
        try:
            return session.run(sys.stdin, sys.stdout)
        finally:
            session.loop.run_until_complete(runtime.cloud.aclose())
            session.loop.close()
    finally:
        worker.stop()


if __name__ == "__main__":
    sys.exit(main())
