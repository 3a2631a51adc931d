"""Interactive streaming chat on one backend or on the hybrid runtime, keeping the conversation.

Commands: /reset clears the history, /quit (or end of input) leaves. Ctrl-C
while an answer streams stops that answer only; the partial answer stays in
the history as the user saw it. It knows nothing about how tokens are made.
On the hybrid runtime each answer starts with its source (`[local]` or
`[cloud]`) and a hand-off shows inline as `[-> cloud]`; the reasons go to
stderr.
"""
from __future__ import annotations

import asyncio
import sys

from .errors import EdgeRuntimeError
from .request import GenerationRequest, SamplingParams


class ChatSession:
    def __init__(self, backend, params: SamplingParams, system: str | None = None, runtime=None):
        self.backend = backend
        self.params = params
        self.system = system
        self.runtime = runtime  # a HybridRuntime: answers go through it (routing, hand-offs, failover)
        self.loop = asyncio.new_event_loop() if runtime is not None else None
        self.messages: list[dict] = []
        self.reset()

    def _events(self, request: GenerationRequest):
        if self.runtime is None:
            yield from self.backend.stream_sync(request)
            return
        agen = self.runtime.stream(request)
        task = None
        try:
            while True:
                task = self.loop.create_task(agen.__anext__())
                try:
                    ev = self.loop.run_until_complete(task)
                except StopAsyncIteration:
                    return
                if ev.type == "error":
                    raise EdgeRuntimeError(ev.error or "generation failed")
                yield ev
        finally:  # also on Ctrl-C: cancel the step in flight, which closes the streams under it
            if task is not None and not task.done():
                task.cancel()
                self.loop.run_until_complete(asyncio.gather(task, return_exceptions=True))
            self.loop.run_until_complete(agen.aclose())

    def _mark(self, ev, out) -> None:
        if ev.type == "start":
            out.write(f"[{ev.source}] ")
            print(f"[route {ev.info['route']}: {ev.info['route_reason']}]", file=sys.stderr, flush=True)
        elif ev.type == "handoff":
            out.write(f" [-> {ev.info['to']}] ")
            print(f"[handoff at character {ev.info['at_char']}: {ev.info['reason']}]", file=sys.stderr, flush=True)

    def reset(self) -> None:
        self.messages = [{"role": "system", "content": self.system}] if self.system else []

    def answer(self, user_text: str, out) -> str:
        self.messages.append({"role": "user", "content": user_text})
        request = GenerationRequest(messages=list(self.messages), params=self.params)
        parts: list[str] = []
        interrupted = False
        try:
            for ev in self._events(request):
                if ev.type == "delta":
                    parts.append(ev.text)
                    out.write(ev.text)
                    out.flush()
                elif self.runtime is not None:
                    self._mark(ev, out)
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
            name = "hybrid" if self.runtime is not None else self.backend.name
            out.write(f"edge-runtime chat ({name}). /reset clears history, /quit leaves, "
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
