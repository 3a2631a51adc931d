"""A client of the worker protocol: many streams over one connection, as async iterators.

    async with WorkerClient("ws://127.0.0.1:8765", token) as client:
        async for frame in client.stream(messages=[{"role": "user", "content": "Hi"}]):
            ...  # Delta frames, then one Done (an Error frame raises WorkerStreamError)

When the connection drops mid-stream the client reconnects (`reconnects`
attempts) and sends `resume` with the last `seq` each open stream received,
so the iterators go on with exactly the missing deltas; if the worker cannot
be reached again, each open stream raises `WorkerConnectionError`.
"""
from __future__ import annotations

import asyncio
import uuid

from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidURI

from edge_runtime.errors import EdgeRuntimeError

from cloud_fallback.protocol import (AUTH_CLOSE_CODE, Cancel, Delta, Done, Error, Generate, Hello, ProtocolError, Resume, Welcome,
                       encode, parse_frame)


class WorkerConnectionError(EdgeRuntimeError):
    """The worker cannot be reached (or was lost and did not come back)."""


class WorkerAuthError(WorkerConnectionError):
    """The worker refused the token (close code 4401)."""


class WorkerStreamError(EdgeRuntimeError):
    """The worker answered a stream with an `error` frame."""

    def __init__(self, frame: Error):
        super().__init__(f"{frame.code}: {frame.message}")
        self.frame, self.code, self.retry_after = frame, frame.code, frame.retry_after


class WorkerStream:
    """Async iterator over one stream's frames: Delta ..., then Done (an Error raises)."""

    def __init__(self, client: "WorkerClient", id: str):
        self.client, self.id = client, id
        self.queue: asyncio.Queue = asyncio.Queue()
        self.last_seq = -1
        self.finished = False

    def __aiter__(self):
        return self

    async def __anext__(self) -> Delta | Done:
        if self.finished:
            raise StopAsyncIteration
        item = await self.queue.get()
        if isinstance(item, BaseException):
            self.finished = True
            self.client.streams.pop(self.id, None)
            raise item
        if isinstance(item, Done):
            self.finished = True
            self.client.streams.pop(self.id, None)
        return item

    async def cancel(self) -> None:
        await self.client.send(Cancel(self.id))

    async def text(self) -> tuple[str, Done]:
        """Drain the stream: (the whole text, the Done frame)."""
        parts = []
        async for frame in self:
            if isinstance(frame, Done):
                return "".join(parts), frame
            parts.append(frame.text)
        raise WorkerConnectionError(f"stream {self.id} ended without done")


class WorkerClient:
    def __init__(self, url: str, token: str, ssl=None, open_timeout: float = 10.0, reconnects: int = 5,
                 reconnect_delay: float = 0.2):
        self.url, self.token, self.ssl = url, token, ssl
        self.open_timeout, self.reconnects, self.reconnect_delay = open_timeout, reconnects, reconnect_delay
        self.ws = None
        self.welcome: Welcome | None = None
        self.streams: dict[str, WorkerStream] = {}
        self.errors: asyncio.Queue = asyncio.Queue()  # error frames that name no stream
        self._reader: asyncio.Task | None = None
        self._closing = False
        self._connected = asyncio.Event()

    async def __aenter__(self) -> "WorkerClient":
        await self.connect()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def _open(self) -> None:
        try:
            ws = await connect(self.url, ssl=self.ssl, open_timeout=self.open_timeout, max_size=None)
        except (OSError, InvalidHandshake, InvalidURI, asyncio.TimeoutError) as e:
            raise WorkerConnectionError(f"cannot connect to the worker at {self.url}: {e}") from None
        try:
            await ws.send(encode(Hello(self.token)))
            frame = parse_frame(await ws.recv())
        except ConnectionClosed as e:
            if e.rcvd is not None and e.rcvd.code == AUTH_CLOSE_CODE:
                raise WorkerAuthError(f"the worker at {self.url} refused the token") from None
            raise WorkerConnectionError(f"the worker at {self.url} closed the connection: {e}") from None
        if isinstance(frame, Error):
            await ws.close()
            raise WorkerConnectionError(f"the worker at {self.url} refused the connection: {frame.message}")
        if not isinstance(frame, Welcome):
            await ws.close()
            raise WorkerConnectionError(f"expected welcome from {self.url}, got {frame.type}")
        self.ws, self.welcome = ws, frame
        self._connected.set()

    async def connect(self) -> Welcome:
        await self._open()
        self._reader = asyncio.create_task(self._read())
        return self.welcome

    async def send(self, frame) -> None:
        await self._connected.wait()
        try:
            await self.ws.send(encode(frame))
        except ConnectionClosed:
            await self._connected.wait()  # the reader reconnects and resumes; a new frame goes on the new one
            await self.ws.send(encode(frame))

    def stream(self, messages: list | None = None, prompt: str | None = None, prefix: str = "",
               params: dict | None = None, priority: str = "interactive", id: str | None = None,
               prefix_token_ids: list[int] | None = None) -> WorkerStream:
        """Start a generation; iterate the result. The generate frame is sent when iteration starts."""
        id = id or uuid.uuid4().hex
        s = WorkerStream(self, id)
        self.streams[id] = s
        frame = Generate(id, messages=messages, prompt=prompt, prefix=prefix, params=dict(params or {}),
                         priority=priority, prefix_token_ids=prefix_token_ids)
        asyncio.get_running_loop().create_task(self._send_or_fail(s, frame))
        return s

    async def _send_or_fail(self, s: WorkerStream, frame) -> None:
        try:
            await self.send(frame)
        except (ConnectionClosed, WorkerConnectionError) as e:
            s.queue.put_nowait(WorkerConnectionError(f"cannot send to the worker: {e}"))

    async def _read(self) -> None:
        while True:
            try:
                async for message in self.ws:
                    self._dispatch(message)
            except ConnectionClosed:
                pass
            if self._closing:
                return
            self._connected.clear()
            if not await self._reconnect():
                return

    def _dispatch(self, message) -> None:
        try:
            frame = parse_frame(message)
        except ProtocolError as e:
            self.errors.put_nowait(e)
            return
        s = self.streams.get(getattr(frame, "id", None) or "")
        if s is None:
            if isinstance(frame, Error):
                self.errors.put_nowait(frame)
            return
        if isinstance(frame, Delta):
            if frame.seq <= s.last_seq:
                return  # already delivered before a reconnect
            s.last_seq = frame.seq
            s.queue.put_nowait(frame)
        elif isinstance(frame, Done):
            s.queue.put_nowait(frame)
        elif isinstance(frame, Error):
            s.queue.put_nowait(WorkerStreamError(frame))

    async def _reconnect(self) -> bool:
        for attempt in range(self.reconnects):
            await asyncio.sleep(self.reconnect_delay * (2 ** attempt))
            try:
                await self._open()
            except WorkerAuthError as e:
                self._fail_all(e)
                return False
            except WorkerConnectionError:
                continue
            for s in list(self.streams.values()):
                if not s.finished:
                    await self.ws.send(encode(Resume(s.id, s.last_seq)))
            return True
        self._fail_all(WorkerConnectionError(f"lost the connection to the worker at {self.url} and could not "
                                             f"reconnect ({self.reconnects} attempts)"))
        return False

    def _fail_all(self, exc: BaseException) -> None:
        for s in list(self.streams.values()):
            if not s.finished:
                s.queue.put_nowait(exc)

    async def close(self) -> None:
        self._closing = True
        if self.ws is not None:
            await self.ws.close()
        if self._reader is not None:
            try:
                await asyncio.wait_for(self._reader, 5)
            except (asyncio.TimeoutError, asyncio.CancelledError):
                self._reader.cancel()
