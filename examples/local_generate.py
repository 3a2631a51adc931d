"""Stream one local answer from the embedded model through the Python API.

Run: .venv/bin/python examples/local_generate.py "Your question"
"""
import sys

from edge_runtime.backends import create_backend
from edge_runtime.request import GenerationRequest, SamplingParams


def main() -> None:
    question = " ".join(sys.argv[1:]) or "Give me one tip for writing clear emails."
    backend = create_backend("native")
    request = GenerationRequest(messages=[{"role": "user", "content": question}], params=SamplingParams(max_tokens=96))
    for event in backend.stream_sync(request):
        if event.type == "delta":
            print(event.text, end="", flush=True)
        elif event.type == "finish":
            print(f"\n[{event.finish_reason}; {event.usage.completion_tokens} tokens]")


if __name__ == "__main__":
    main()
