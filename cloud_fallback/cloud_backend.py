"""The cloud worker as a backend: `stream(request, prefix)` yields the same StreamEvents a local backend does.

Events carry `source="cloud"`: `start` (model, url), `delta` (seq, text,
token_ids), then `finish` (reason, usage) or `error` (`info["code"]`: the
worker's error code, `unreachable` when it cannot be reached or was lost and
did not come back, `stalled` when no frame arrived within `stall_timeout`).
Errors are events, never exceptions, so a caller (the hybrid runtime) can fail
over to the device with the text received so far. Leaving the iteration early
cancels the request on the worker.
"""
from __future__ import annotations

import asyncio
from dataclasses import asdict
from typing import AsyncIterator

from edge_runtime.request import GenerationRequest, StreamEvent, Usage

from .client import WorkerClient, WorkerConnectionError, WorkerStreamError


class CloudBackend:
    name = "cloud"

    def __init__(self, url: str, token: str, ssl=None, connect_timeout: float = 5.0, stall_timeout: float = 30.0,
                 reconnects: int = 3, reconnect_delay: float = 0.2):
        self.url, self.stall_timeout = url, stall_timeout
        self.client = WorkerClient(url, token, ssl=ssl, open_timeout=connect_timeout, reconnects=reconnects,
                                   reconnect_delay=reconnect_delay)
        self._connected = False

    async def connect(self) -> None:
        if not self._connected:
            await self.client.connect()
            self._connected = True

    async def stream(self, request: GenerationRequest, prefix: str | None = None) -> AsyncIterator[StreamEvent]:
        prefix = request.prefix if prefix is None else prefix
        try:
            await self.connect()
        except WorkerConnectionError as e:
            yield _error("unreachable", e.message)
            return
        yield StreamEvent("start", source="cloud", info={"backend": "cloud", "model": self.client.welcome.model,
                                                         "url": self.url})
        s = self.client.stream(messages=request.messages, prompt=request.prompt, prefix=prefix,
                               params=asdict(request.params), id=request.id or None)
        finished = False
        try:
            while True:
                try:
                    frame = await asyncio.wait_for(s.__anext__(), self.stall_timeout)
                except StopAsyncIteration:
                    yield _error("unreachable", "the worker ended the stream without done")
                    return
                except asyncio.TimeoutError:
                    yield _error("stalled", f"no frame from the worker at {self.url} for {self.stall_timeout:g} s")
                    return
                except WorkerStreamError as e:
                    finished = True
                    yield _error(e.code, e.frame.message, e.retry_after)
                    return
                except WorkerConnectionError as e:
                    finished = True
                    yield _error("unreachable", e.message)
                    return
                if frame.type == "delta":
                    yield StreamEvent("delta", seq=frame.seq, text=frame.text, token_ids=list(frame.token_ids),
                                      source="cloud")
                else:
                    finished = True
                    usage = Usage(int(frame.usage.get("prompt_tokens", 0)), int(frame.usage.get("completion_tokens", 0)))
                    yield StreamEvent("finish", seq=s.last_seq + 1, finish_reason=frame.finish_reason, usage=usage,
                                      source="cloud")
                    return
        finally:
            if not finished and not s.finished:
                try:
                    await asyncio.wait_for(s.cancel(), 2.0)  # the consumer left (or it stalled): stop the work
                except Exception:  # best effort: the worker may be gone; it frees the stream after its grace period
                    pass
                self.client.streams.pop(s.id, None)

    async def aclose(self) -> None:
        if self._connected:
            await self.client.close()
            self._connected = False


def _error(code: str, message: str, retry_after: float | None = None) -> StreamEvent:
    return StreamEvent("error", error=message, source="cloud", info={"code": code, "retry_after": retry_after})
