"""The hybrid OpenAI-compatible API: `edge-runtime serve` with a cloud worker behind it, used through the
official `openai` Python client. One question is answered on the device, one is sent to the cloud (the `route`
extension, passed with extra_body), and the response's `x_hybrid` field says which source wrote which part.

Run: .venv/bin/python examples/hybrid_api.py
"""
import os
import re
import signal
import subprocess
import sys

import openai

from cloud_fallback.launcher import WorkerProcess

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main() -> int:
    worker = WorkerProcess(threads=2)
    gateway = subprocess.Popen([sys.executable, "-m", "edge_cli", "serve", "--port", "0", "--threads", "2",
                                "--cloud", worker.url, "--cloud-token-file", worker.token_file, "--api-key", "sk-local"],
                               cwd=ROOT, stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        url = re.search(r"(http://\S+)", gateway.stdout.readline()).group(1)
        client = openai.OpenAI(base_url=url + "/v1", api_key="sk-local")
        model = client.models.list().data[0].id
        print(f"[gateway {url}, model {model}, cloud {worker.url}]")
        for route, question in (("local", "Name the capital of France."), ("cloud", "Name three planets.")):
            r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": question}],
                                               max_tokens=32, temperature=0, extra_body={"route": route})
            info = r.model_extra["x_hybrid"]
            print(f"Q: {question}\nA: {r.choices[0].message.content}")
            print(f"   route {info['route']} ({info['route_reason']}); sources "
                  f"{[s['source'] for s in info['segments']]}; {r.usage.completion_tokens} tokens")
        print("streamed: ", end="")
        for chunk in client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Say hi."}],
                                                    max_tokens=16, stream=True, extra_body={"route": "cloud"}):
            if chunk.choices and chunk.choices[0].delta.content:
                print(f"{chunk.choices[0].delta.content}<{chunk.model_extra.get('x_source')}>", end="", flush=True)
        print()
        return 0
    finally:
        os.killpg(gateway.pid, signal.SIGTERM)
        gateway.wait(15)
        worker.stop()


if __name__ == "__main__":
    sys.exit(main())
