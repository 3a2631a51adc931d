"""The cloud worker as a backend: `stream(request, prefix)` yields the same StreamEvents a local backend does.

Events carry `source="cloud"`: `start` (model, url), `delta` (seq, text,
token_ids), then `finish` (reason, usage) or `error` (`info["code"]`: the
worker's error code, `unreachable` when it cannot be reached or was lost and
did not come back, `stalled` when no frame arrived within `stall_timeout`).
Errors are events, never exceptions, so a caller (the hybrid runtime) can fail
over to the device with the text received so far. Leaving the iteration early
cancels the request on the worker.

Health: every outcome feeds `self.health` (a CircuitBreaker): a finished
stream or an answered heartbeat is a success; unreachable, stalled and busy
are failures. `start_heartbeats(interval)` pings the worker while connected.
A client whose connection was lost for good is reopened by the next
`connect()` (the hybrid runtime probes with it to hand a stream back).
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import asdict
from typing import AsyncIterator

from edge_runtime.request import GenerationRequest, StreamEvent, Usage

from cloud_fallback.client import WorkerClient, WorkerConnectionError, WorkerStreamError
from cloud_fallback.health import CircuitBreaker

HEALTH_FAILURES = {"unreachable", "stalled", "busy", "internal"}


class CloudBackend:
    name = "cloud"

    def __init__(self, url: str, token: str, ssl=None, connect_timeout: float = 5.0, stall_timeout: float = 30.0,
                 reconnects: int = 2, reconnect_delay: float = 0.05, health: CircuitBreaker | None = None):
        self.url, self.stall_timeout = url, stall_timeout
        self.client = WorkerClient(url, token, ssl=ssl, open_timeout=connect_timeout, reconnects=reconnects,
                                   reconnect_delay=reconnect_delay)
        self.health = health or CircuitBreaker()
        self._heartbeats: asyncio.Task | None = None
        self._lock = None

    @property
    def connected(self) -> bool:
        reader = self.client._reader
        return reader is not None and not reader.done() and self.client._connected.is_set()

    @property
    def tokenizer_fingerprint(self) -> str:
        """The worker's vocabulary fingerprint (from its welcome), "" before connecting or when unknown."""
        return (self.client.welcome.tokenizer or "") if self.client.welcome is not None else ""

    async def connect(self) -> None:
        """Open the connection unless it is up; raises WorkerConnectionError (and counts a failure)."""
        loop = asyncio.get_running_loop()
        if self._lock is None or self._lock[0] is not loop:
            self._lock = (loop, asyncio.Lock())
        async with self._lock[1]:  # one handshake at a time (a warm-up and a stream may both ask)
            await self._connect()

    async def _connect(self) -> None:
        if self.connected:
            return
        reader = self.client._reader
        if reader is not None and not reader.done():  # mid-reconnect: let it finish or give up first
            await asyncio.wait({reader}, timeout=self.client.open_timeout)
            if self.connected:
                return
        self.client._closing = False
        try:
            await self.client.connect()
        except WorkerConnectionError as e:
            self.health.record_failure(f"unreachable: {e.message}")
            raise

    async def heartbeat(self, timeout: float = 2.0) -> float | None:
        """Ping the worker once; returns the round trip in ms, or None (a failure) when it does not answer."""
        if not self.connected:
            self.health.record_failure("unreachable: not connected")
            return None
        t0 = time.perf_counter()
        try:
            waiter = await self.client.ws.ping()
            await asyncio.wait_for(waiter, timeout)
        except Exception as e:  # closed or silent: both mean unhealthy
            self.health.record_failure(f"heartbeat: {type(e).__name__}")
            return None
        rtt = (time.perf_counter() - t0) * 1000.0
        self.health.record_success(rtt)
        return rtt

    def start_heartbeats(self, interval: float = 5.0) -> None:
        async def loop() -> None:
            while True:
                await asyncio.sleep(interval)
                await self.heartbeat()

        if self._heartbeats is None or self._heartbeats.done():
            self._heartbeats = asyncio.get_running_loop().create_task(loop())

    async def stream(self, request: GenerationRequest, prefix: str | None = None) -> AsyncIterator[StreamEvent]:
        prefix = request.prefix if prefix is None else prefix
        try:
            await self.connect()
        except WorkerConnectionError as e:
            yield StreamEvent("error", error=e.message, source="cloud", info={"code": "unreachable", "retry_after": None})
            return  # connect() counted the failure
        yield StreamEvent("start", source="cloud", info={"backend": "cloud", "model": self.client.welcome.model,
                                                         "url": self.url})
        s = self.client.stream(messages=request.messages, prompt=request.prompt, prefix=prefix,
                               params=asdict(request.params), id=request.id or None,
                               prefix_token_ids=request.prefix_token_ids)
        finished = False
        try:
            while True:
                try:
                    frame = await asyncio.wait_for(s.__anext__(), self.stall_timeout)
                except StopAsyncIteration:
                    yield self._error("unreachable", "the worker ended the stream without done")
                    return
                except asyncio.TimeoutError:
                    yield self._error("stalled", f"no frame from the worker at {self.url} for {self.stall_timeout:g} s")
                    return
                except WorkerStreamError as e:
                    finished = True
                    yield self._error(e.code, e.frame.message, e.retry_after)
                    return
                except WorkerConnectionError as e:
                    finished = True
                    yield self._error("unreachable", e.message)
                    return
                if frame.type == "delta":
                    yield StreamEvent("delta", seq=frame.seq, text=frame.text, token_ids=list(frame.token_ids),
                                      source="cloud")
                else:
                    finished = True
                    self.health.record_success()
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

    def _error(self, code: str, message: str, retry_after: float | None = None) -> StreamEvent:
        if code in HEALTH_FAILURES:
            self.health.record_failure(f"{code}: {message}")
        return StreamEvent("error", error=message, source="cloud", info={"code": code, "retry_after": retry_after})

    async def aclose(self) -> None:
        if self._heartbeats is not None:
            self._heartbeats.cancel()
        if self.client.ws is not None:
            await self.client.close()
