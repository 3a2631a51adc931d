"""Interactive streaming chat on one backend, keeping the conversation.

Commands: /reset clears the history, /quit (or end of input) leaves. Ctrl-C
while an answer streams stops that answer only; the partial answer stays in
the history as the user saw it. It knows nothing about how tokens are made.
"""
from __future__ import annotations

import sys

from .errors import EdgeRuntimeError
from .request import GenerationRequest, SamplingParams


class ChatSession:
    def __init__(self, backend, params: SamplingParams, system: str | None = None):
        self.backend = backend
        self.params = params
        self.system = system
        self.messages: list[dict] = []
        self.reset()

    def reset(self) -> None:
        self.messages = [{"role": "system", "content": self.system}] if self.system else []

    def answer(self, user_text: str, out) -> str:
        self.messages.append({"role": "user", "content": user_text})
        request = GenerationRequest(messages=list(self.messages), params=self.params)
        parts: list[str] = []
        interrupted = False
        try:
            for ev in self.backend.stream_sync(request):
                if ev.type == "delta":
                    parts.append(ev.text)
                    out.write(ev.text)
                    out.flush()
        except KeyboardInterrupt:
            interrupted = True
        except EdgeRuntimeError as e:
            self.messages.pop()
            out.write(f"[error: {e.message}]\n")
            return ""
        text = "".join(parts)
        out.write(" [stopped]\n" if interrupted else "\n")
        self.messages.append({"role": "assistant", "content": text})
        return text

    def run(self, stdin=sys.stdin, out=sys.stdout) -> int:
        interactive = stdin.isatty()
        if interactive:
            out.write(f"edge-runtime chat ({self.backend.name}). /reset clears history, /quit leaves, "
                      "Ctrl-C stops an answer.\n")
        while True:
            if interactive:
                out.write("> ")
                out.flush()
            try:
                line = stdin.readline()
            except KeyboardInterrupt:
                out.write("\n")
                continue
            if not line:
                return 0
            line = line.strip()
            if not line:
                continue
            if line == "/quit":
                return 0
            if line == "/reset":
                self.reset()
                out.write("[history cleared]\n")
                continue
            self.answer(line, out)
