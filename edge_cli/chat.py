"""Interactive streaming chat on one backend or on the hybrid runtime, keeping the conversation.

Commands: /reset clears the history, /quit (or end of input) leaves,
/route local|cloud|auto picks where answers go (on the hybrid runtime),
/status shows the connectivity, /save FILE and /load FILE write and read the
conversation as JSON. A line ending in a backslash continues on the next
line, and a line of three double quotes opens and closes a block of
several lines. Ctrl-C while an answer streams stops that answer only; the
partial answer stays in the history as the user saw it. It knows nothing
about how tokens are made. On the hybrid runtime each answer starts with its
source (`[local]`, `[cloud]`, `[cache]`), a hand-off shows inline as
`[-> cloud]` (the reasons go to stderr), and the prompt carries the
connectivity: `(offline)`, `(device only)`, `(cloud down)` or `(cloud)`.
After each answer one line sums it up: tokens, time to first token, tok/s,
sources, hand-offs. Instead of a silent wait it says when the cloud asked
for is down (the device answers) and when no token has come after
`busy_notice_s` seconds.
"""
from __future__ import annotations

import asyncio
import json
import sys
import time

from edge_runtime.errors import EdgeRuntimeError
from edge_runtime.request import GenerationRequest, SamplingParams


SAVE_VERSION = 1
ROLES = ("system", "user", "assistant")


class ChatSession:
    def __init__(self, backend, params: SamplingParams, system: str | None = None, runtime=None,
                 busy_notice_s: float = 2.0):
        self.backend = backend
        self.params = params
        self.system = system
        self.runtime = runtime  # a HybridRuntime: answers go through it (routing, hand-offs, failover)
        self.route = "auto"
        self.loop = asyncio.new_event_loop() if runtime is not None else None
        self.busy_notice_s = busy_notice_s
        self.messages: list[dict] = []
        self._out = None  # where the busy notice goes while an answer is awaited
        self.reset()

    def _events(self, request: GenerationRequest):
        if self.runtime is None:
            yield from self.backend.stream_sync(request)
            return
        agen = self.runtime.stream(request)
        task, seen_delta = None, False
        try:
            while True:
                task = self.loop.create_task(agen.__anext__())
                if not seen_delta and self._out is not None:
                    done, _ = self.loop.run_until_complete(asyncio.wait({task}, timeout=self.busy_notice_s))
                    if not done:  # said once per answer, then the wait goes on
                        self._out.write(f"[no token yet after {self.busy_notice_s:g} s: {self._busy_reason()}] ")
                        self._out.flush()
                        seen_delta = True
                try:
                    ev = self.loop.run_until_complete(task)
                except StopAsyncIteration:
                    return
                if ev.type == "error":
                    raise EdgeRuntimeError(ev.error or "generation failed")
                seen_delta = seen_delta or ev.type == "delta"
                yield ev
        finally:  # also on Ctrl-C: cancel the step in flight, which closes the streams under it
            if task is not None and not task.done():
                task.cancel()
                self.loop.run_until_complete(asyncio.gather(task, return_exceptions=True))
            self.loop.run_until_complete(agen.aclose())

    def _busy_reason(self) -> str:
        engine = getattr(self.backend, "engine", None) if getattr(self.backend, "name", "") == "native" else None
        stats = engine.stats() if engine is not None else {}
        ahead = stats.get("num_running", 0) + stats.get("num_waiting", 0) - 1
        if ahead > 0:
            return f"the device is busy with {ahead} other request{'s' if ahead > 1 else ''}"
        return "the device is busy (a long prompt, or the machine is loaded)"

    def _mark(self, ev, out) -> None:
        if ev.type == "start":
            if ev.info.get("rule") in ("unreachable", "health") and self.route != "local":
                out.write(f"[cloud down: {ev.info['route_reason']}; the device answers] ")
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
        t0, stamps, sources, handoffs, tokens = time.perf_counter(), [], [], 0, 0
        self._out = out
        try:
            for ev in self._events(request):
                if ev.type == "delta":
                    parts.append(ev.text)
                    stamps.append(time.perf_counter())
                    tokens += len(ev.token_ids) or 1
                    if not sources or sources[-1] != ev.source:
                        sources.append(ev.source)
                    out.write(ev.text)
                    out.flush()
                elif ev.type == "handoff":
                    handoffs += 1
                if self.runtime is not None and ev.type != "delta":
                    self._mark(ev, out)
        except KeyboardInterrupt:
            interrupted = True
        except EdgeRuntimeError as e:
            self.messages.pop()
            out.write(f"[error: {e.message}]\n")
            return ""
        finally:
            self._out = None
        text = "".join(parts)
        out.write(" [stopped]\n" if interrupted else "\n")
        out.write(summary_line(tokens, t0, stamps, sources, handoffs) + "\n")
        self.messages.append({"role": "assistant", "content": text})
        return text

    def save(self, path: str) -> str:
        data = {"version": SAVE_VERSION, "messages": self.messages, "route": self.route}
        with open(path, "w", encoding="utf-8") as f:
            json.dump(data, f, ensure_ascii=False, indent=1)
        return f"[saved {len(self.messages)} messages to {path}]"

    def load(self, path: str) -> str:
        """Replaces the conversation with the file's; a bad file changes nothing and says why."""
        try:
            with open(path, encoding="utf-8") as f:
                data = json.load(f)
        except OSError as e:
            return f"[cannot load {path}: {e.strerror}]"
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            return f"[cannot load {path}: not a JSON file ({e})]"
        messages = data.get("messages") if isinstance(data, dict) else None
        if not isinstance(messages, list) or not all(
                isinstance(m, dict) and m.get("role") in ROLES and isinstance(m.get("content"), str) for m in messages):
            return (f"[cannot load {path}: expected {{\"messages\": [{{\"role\": system|user|assistant, "
                    f"\"content\": text}}, ...]}}]")
        self.messages = [{"role": m["role"], "content": m["content"]} for m in messages]
        if data.get("route") in ("local", "cloud", "auto") and self.runtime is not None:
            self.route = data["route"]
        return f"[loaded {len(self.messages)} messages from {path}]"

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
            out.write(f"[{self.connectivity()}; route {self.route}; {len(self.messages)} messages; "
                      f"sampling: {sampling_text(self.params)}]\n")
        elif word in ("/save", "/load"):
            if not arg:
                out.write(f"[{word} needs a file name: {word} FILE]\n")
            else:
                try:
                    out.write((self.save(arg) if word == "/save" else self.load(arg)) + "\n")
                except OSError as e:
                    out.write(f"[cannot save {arg}: {e.strerror}]\n")
        else:
            out.write(f"[unknown command {word}; /reset, /route local|cloud|auto, /status, /save FILE, /load FILE, "
                      "/quit]\n")
        return True

    def run(self, stdin=sys.stdin, out=sys.stdout) -> int:
        interactive = stdin.isatty()
        if interactive:
            name = "hybrid" if self.runtime is not None else self.backend.name
            routing = ", /route local|cloud|auto" if self.runtime is not None else ""
            out.write(f"edge-runtime chat ({name}). /reset clears history{routing}, /status, /save FILE, /load "
                      'FILE, /quit leaves; end a line with \\ or wrap lines in """ for more than one line; Ctrl-C '
                      "stops an answer.\n")
        while True:
            if interactive:
                out.write(f"({self.connectivity()}) > " if self.runtime is not None else "> ")
                out.flush()
            try:
                line = read_message(stdin, out if interactive else None)
            except KeyboardInterrupt:
                out.write("\n")
                continue
            if line is None:
                return 0
            if not line:
                continue
            if line.startswith("/"):
                if not self.command(line, out):
                    return 0
                continue
            self.answer(line, out)


def read_message(stdin, out=None) -> str | None:
    """One message: a line, lines joined while each ends with a backslash, or the lines between two lines of
    three double quotes. None at the end of input."""
    line = stdin.readline()
    if not line:
        return None
    text = line.rstrip("\n")
    if text.strip() == '"""':
        lines = []
        while (more := stdin.readline()) and more.strip() != '"""':
            if out is not None:
                out.write("... ")
                out.flush()
            lines.append(more.rstrip("\n"))
        return "\n".join(lines).strip()
    lines = []
    while text.endswith("\\"):
        lines.append(text[:-1])
        if out is not None:
            out.write("... ")
            out.flush()
        more = stdin.readline()
        text = more.rstrip("\n") if more else ""
    lines.append(text)
    return "\n".join(lines).strip()


def summary_line(tokens: int, t0: float, stamps: list[float], sources: list[str], handoffs: int) -> str:
    """`[12 tokens · first token 35 ms · 210.4 tok/s · local -> cloud · 1 hand-off]`"""
    if not stamps:
        return f"[0 tokens · {', '.join(sources) or 'no source'} · {handoffs} hand-offs]"
    rate = (tokens - 1) / (stamps[-1] - stamps[0]) if tokens > 1 and stamps[-1] > stamps[0] else 0.0
    return (f"[{tokens} tokens · first token {(stamps[0] - t0) * 1e3:.0f} ms · {rate:.1f} tok/s · "
            f"{' -> '.join(sources)} · {handoffs} hand-off{'' if handoffs == 1 else 's'}]")


def sampling_text(p: SamplingParams) -> str:
    if p.temperature == 0:
        return "greedy" + (f", repeat penalty {p.repetition_penalty:g}" if p.repetition_penalty != 1 else "")
    return (f"temperature {p.temperature:g}, top-k {p.top_k}, top-p {p.top_p:g}, min-p {p.min_p:g}, "
            f"repeat penalty {p.repetition_penalty:g}")
