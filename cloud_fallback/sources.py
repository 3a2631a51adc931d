"""Where the worker's tokens come from: our batching engine, or an upstream OpenAI-compatible server.

Both sources take a validated request and call the worker's `emit(stream_id,
StreamEvent)` on the event loop thread with `delta`, then `finish` or `error`.
The worker never knows which one it has.

- `EngineSource` wraps `edge_runtime.engine.batch_engine.BatchEngine` (its own
  thread); events hop to the loop with `call_soon_threadsafe`. Parking a
  stream (its client went away) frees its KV blocks at once; unparking
  recomputes its tokens so far and goes on.
- `UpstreamSource` forwards each request to `cloud_fallback.upstream.Upstream`
  as one asyncio task; cancelling the task closes the upstream HTTP stream.
"""
from __future__ import annotations

import asyncio
import collections
import contextlib
import threading
from typing import Callable

from edge_runtime.errors import EdgeRuntimeError
from edge_runtime.request import GenerationRequest, StreamEvent, Usage

from cloud_fallback.protocol import Generate

Emit = Callable[[str, StreamEvent], None]


class EngineSource:
    kind = "engine"

    def __init__(self, engine, loop: asyncio.AbstractEventLoop, emit: Emit):
        self.engine, self.loop, self.emit = engine, loop, emit
        self.model_name = engine.model_name
        self.tokenizer_fingerprint = engine.tokenizer.fingerprint
        self._pending: collections.deque = collections.deque()  # (id, event) from the engine thread, in order
        self._lock = threading.Lock()
        self._scheduled = False

    def _deliver(self, id: str, ev: StreamEvent) -> None:  # engine thread
        # one loop wake-up for all the events of a step, not one per token
        with self._lock:
            self._pending.append((id, ev))
            if self._scheduled:
                return
            self._scheduled = True
        self.loop.call_soon_threadsafe(self._drain)

    def _drain(self) -> None:  # loop thread
        with self._lock:
            items = list(self._pending)
            self._pending.clear()
            self._scheduled = False
        for id, ev in items:
            self.emit(id, ev)

    def prepare(self, request: GenerationRequest, max_prompt_tokens: int) -> list[int]:
        return self.engine.prepare(request, max_prompt_tokens)  # raises ContextLengthError

    def submit(self, id: str, gen: Generate, request: GenerationRequest, prompt_ids) -> None:
        self.engine.submit(id, request, lambda ev: self._deliver(id, ev), gen.priority, prompt_ids)

    def cancel(self, id: str) -> None:
        self.engine.cancel(id)

    def hold(self, id: str, held: bool) -> None:
        self.engine.hold(id, held)

    def park(self, id: str) -> None:
        self.engine.park(id)

    def unpark(self, id: str) -> None:
        self.engine.unpark(id)

    def stats(self) -> dict:
        return self.engine.stats()

    async def aclose(self) -> None:
        await asyncio.to_thread(self.engine.stop)


class UpstreamSource:
    kind = "upstream"

    def __init__(self, upstream, emit: Emit, model_name: str):
        self.upstream, self.emit, self.model_name = upstream, emit, model_name
        self.tasks: dict[str, asyncio.Task] = {}
        self.ready: dict[str, asyncio.Event] = {}  # cleared while the stream's reader is behind
        self.tokens_generated = 0

    def prepare(self, request: GenerationRequest, max_prompt_tokens: int) -> None:
        return None  # the upstream engine tokenizes and checks the context itself

    def submit(self, id: str, gen: Generate, request: GenerationRequest, prompt_ids) -> None:
        self.ready[id] = asyncio.Event()
        self.ready[id].set()
        self.tasks[id] = asyncio.get_running_loop().create_task(self._run(id, gen))

    async def _run(self, id: str, gen: Generate) -> None:
        from cloud_fallback.upstream import UpstreamDone

        seq = 0
        try:
            async with contextlib.aclosing(self.upstream.stream(gen)) as pieces:  # closed at once on cancel
                async for piece in pieces:
                    if isinstance(piece, UpstreamDone):
                        usage = Usage(int(piece.usage.get("prompt_tokens", 0)), int(piece.usage.get("completion_tokens", 0)))
                        self.emit(id, StreamEvent("finish", seq=seq, finish_reason=piece.finish_reason, usage=usage,
                                                  source="cloud"))
                        return
                    if piece.text or piece.token_ids:
                        self.emit(id, StreamEvent("delta", seq=seq, text=piece.text, token_ids=list(piece.token_ids),
                                                  source="cloud"))
                        seq += 1
                        self.tokens_generated += max(1, len(piece.token_ids))
                    await self.ready[id].wait()  # backpressure: the reader is behind
            self.emit(id, StreamEvent("finish", seq=seq, finish_reason="stop", usage=Usage(0, seq), source="cloud"))
        except asyncio.CancelledError:
            self.emit(id, StreamEvent("finish", seq=seq, finish_reason="cancelled", usage=Usage(0, seq),
                                      source="cloud"))
        except EdgeRuntimeError as e:
            self.emit(id, StreamEvent("error", error=e.message, source="cloud",
                                      info={"code": getattr(e, "code", "upstream_error"),
                                            "retry_after": getattr(e, "retry_after", None)}))
        finally:
            self.tasks.pop(id, None)
            self.ready.pop(id, None)

    def cancel(self, id: str) -> None:
        task = self.tasks.get(id)
        if task is not None:
            task.cancel()

    def hold(self, id: str, held: bool) -> None:
        ev = self.ready.get(id)
        if ev is not None:
            ev.clear() if held else ev.set()

    def park(self, id: str) -> None:
        pass  # the upstream keeps streaming into the replay buffer (bounded by max_tokens)

    def unpark(self, id: str) -> None:
        pass

    def stats(self) -> dict:
        return {"num_running": len(self.tasks), "num_waiting": 0, "tokens_generated": self.tokens_generated}

    async def aclose(self) -> None:
        for task in list(self.tasks.values()):
            task.cancel()
        await self.upstream.aclose()
