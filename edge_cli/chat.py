"""Interactive streaming chat on one backend or on the hybrid runtime, keeping the conversation.

Commands: /reset clears the history, /quit (or end of input) leaves,
/route local|cloud|auto picks where answers go (on the hybrid runtime),
/status shows the connectivity. Ctrl-C while an answer streams stops that
answer only; the partial answer stays in the history as the user saw it. It
knows nothing about how tokens are made. On the hybrid runtime each answer
starts with its source (`[local]` or `[cloud]`), a hand-off shows inline as
`[-> cloud]` (the reasons go to stderr), and the prompt carries the
connectivity: `(offline)`, `(device only)`, `(cloud down)` or `(cloud)`.
"""
from __future__ import annotations

import asyncio
import sys

from edge_runtime.errors import EdgeRuntimeError
from edge_runtime.request import GenerationRequest, SamplingParams


class ChatSession:
    def __init__(self, backend, params: SamplingParams, system: str | None = None, runtime=None):
        self.backend = backend
        self.params = params
        self.system = system
        self.runtime = runtime  # a HybridRuntime: answers go through it (routing, hand-offs, failover)
        self.route = "auto"
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
        request = GenerationRequest(messages=list(self.messages), params=self.params, route=self.route)
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

    def connectivity(self) -> str:
        """The offline indicator: where answers can go right now."""
        rt = self.runtime
        if rt is None:
            return self.backend.name
        if rt.offline:
            return "offline"
        if rt.cloud is None:
            return "device only"
        health = getattr(rt.cloud, "health", None)
        return "cloud down" if health is not None and not health.allow() else "cloud"

    def command(self, line: str, out) -> bool:
        """Handle a /command; False for /quit."""
        word, _, arg = line.partition(" ")
        arg = arg.strip()
        if word == "/quit":
            return False
        if word == "/reset":
            self.reset()
            out.write("[history cleared]\n")
        elif word == "/route" and self.runtime is not None:
            if arg in ("local", "cloud", "auto"):
                self.route = arg
                note = " (offline: answers stay on the device)" if self.runtime.offline else ""
                out.write(f"[route {arg}{note}]\n")
            else:
                out.write(f"[route {self.route}; use /route local|cloud|auto]\n")
        elif word == "/status":
            out.write(f"[{self.connectivity()}; route {self.route}; {len(self.messages)} messages]\n")
        else:
            out.write(f"[unknown command {word}; /reset, /route local|cloud|auto, /status, /quit]\n")
        return True

    def run(self, stdin=sys.stdin, out=sys.stdout) -> int:
        interactive = stdin.isatty()
        if interactive:
            name = "hybrid" if self.runtime is not None else self.backend.name
            routing = ", /route local|cloud|auto" if self.runtime is not None else ""
            out.write(f"edge-runtime chat ({name}). /reset clears history{routing}, /status, /quit leaves, "
                      "Ctrl-C stops an answer.\n")
        while True:
            if interactive:
                out.write(f"({self.connectivity()}) > " if self.runtime is not None else "> ")
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
            if line.startswith("/"):
                if not self.command(line, out):
                    return 0
                continue
            self.answer(line, out)
