"""The cloud worker: a WebSocket server speaking protocol v1 (docs/protocol.md) over a token source.

One asyncio loop serves every connection; the source (our continuous-batching
engine on its own thread, or an upstream OpenAI-compatible server) produces
each stream's events. Per connection:

- the first frame must be `hello` with the right token (compared in constant
  time), else the connection is closed with code 4401;
- any number of `generate` frames may be in flight (up to the per-connection
  and total limits: beyond them a `busy` error with `retry_after`);
- one writer task sends frames in order; a stream whose client is behind by
  more than `stream_buffer` frames is held (not scheduled, its KV kept) until
  the backlog halves, so a slow reader never stalls anyone else;
- a bad frame gets an `error` frame and the connection goes on.

Streams outlive their connection for `resume_grace_s`: a dropped connection
parks its streams (the engine frees their KV blocks at once), and `resume`
on a new connection replays the deltas after `after_seq` from the stream's
replay buffer and continues it. HTTP GET /health and /metrics (Prometheus
text) are answered on the same port.
"""
from __future__ import annotations

import asyncio
import collections
import hmac
import http
import logging
from dataclasses import asdict, dataclass

from websockets.asyncio.server import ServerConnection, serve
from websockets.exceptions import ConnectionClosed

from edge_runtime.errors import ContextLengthError, EdgeRuntimeError, InvalidRequestError
from edge_runtime.request import StreamEvent

from cloud_fallback.metrics import render_metrics
from cloud_fallback.protocol import (AUTH_CLOSE_CODE, BAD_FRAME, BUSY, CONTEXT_LENGTH, INVALID_REQUEST, UNKNOWN_STREAM,
                       UNSUPPORTED_PROTOCOL, Cancel, Delta, Done, Error, Generate, Hello, ProtocolError, Resume,
                       Welcome, encode, parse_frame)

log = logging.getLogger("edge_runtime.worker")


@dataclass(slots=True)
class WorkerLimits:
    max_frame_bytes: int = 1 << 20
    max_prompt_tokens: int = 8000
    max_tokens: int = 2048
    max_streams_per_connection: int = 16
    max_streams_total: int = 256
    stream_buffer: int = 256  # unsent frames of one stream before it is held
    replay_deltas: int = 4096  # deltas each stream keeps for resume
    resume_grace_s: float = 30.0  # how long a stream outlives its connection (and its end)
    hello_timeout_s: float = 10.0
    retry_after_s: float = 1.0


class Stream:
    """One generate: its replay buffer, its final frame, and the connection it is delivered on."""

    def __init__(self, id: str, conn: "Connection", replay: int):
        self.id, self.conn = id, conn
        self.replay: collections.deque[Delta] = collections.deque(maxlen=replay)
        self.final: Done | Error | None = None
        self.unsent = 0
        self.held = False
        self.timer: asyncio.TimerHandle | None = None


class Connection:
    def __init__(self, ws: ServerConnection):
        self.ws = ws
        self.queue: asyncio.Queue = asyncio.Queue()
        self.streams: set[str] = set()
        self.open = True

    def active(self, worker: "Worker") -> int:
        return sum(1 for i in self.streams if i in worker.streams and worker.streams[i].final is None)


class Worker:
    def __init__(self, token: str, limits: WorkerLimits | None = None):
        if not token:
            raise EdgeRuntimeError("the worker needs a non-empty token")
        self.token = token.encode("utf-8")
        self.limits = limits or WorkerLimits()
        self.source = None  # set by attach()
        self.streams: dict[str, Stream] = {}
        self.connections: set[Connection] = set()
        self.counters = collections.Counter()

    def attach(self, source) -> None:
        self.source = source

    # --- events from the source (loop thread) ------------------------------------------------
    def emit(self, id: str, ev: StreamEvent) -> None:
        stream = self.streams.get(id)
        if stream is None or stream.final is not None:
            return
        if ev.type == "delta":
            frame = Delta(id, ev.seq, ev.text, list(ev.token_ids))
            stream.replay.append(frame)
        elif ev.type == "finish":
            frame = Done(id, ev.finish_reason, asdict(ev.usage) if ev.usage else {})
            self.counters[f"finished_{ev.finish_reason}"] += 1
        else:
            info = ev.info or {}
            frame = Error(info.get("code") or "error", ev.error or "generation failed", id, info.get("retry_after"))
            self.counters["failed"] += 1
        if frame.type != "delta":
            stream.final = frame
            self._expire_later(stream)
        if stream.conn is not None:
            self._send(stream.conn, frame, stream)

    def _send(self, conn: Connection, frame, stream: Stream | None = None) -> None:
        if not conn.open:
            return
        conn.queue.put_nowait((stream, encode(frame)))
        if stream is not None:
            stream.unsent += 1
            if not stream.held and stream.final is None and stream.unsent > self.limits.stream_buffer:
                stream.held = True
                self.source.hold(stream.id, True)

    async def _writer(self, conn: Connection) -> None:
        while True:
            stream, text = await conn.queue.get()
            await conn.ws.send(text)
            if stream is not None:
                stream.unsent -= 1
                if stream.held and stream.unsent <= self.limits.stream_buffer // 2 and stream.conn is conn:
                    stream.held = False
                    self.source.hold(stream.id, False)

    def _expire_later(self, stream: Stream) -> None:
        if stream.timer is not None:
            stream.timer.cancel()
        stream.timer = asyncio.get_running_loop().call_later(self.limits.resume_grace_s, self._expire, stream)

    def _expire(self, stream: Stream) -> None:
        if self.streams.get(stream.id) is not stream:
            return
        if stream.final is None:
            if stream.conn is not None:
                return  # resumed meanwhile
            self.source.cancel(stream.id)  # nobody came back for it
        del self.streams[stream.id]

    # --- one connection ---------------------------------------------------------------------------
    async def handler(self, ws: ServerConnection) -> None:
        if not await self._handshake(ws):
            return
        conn = Connection(ws)
        self.connections.add(conn)
        writer = asyncio.create_task(self._writer(conn))
        try:
            async for message in ws:
                try:
                    self._handle(conn, parse_frame(message, self.limits.max_frame_bytes))
                except ProtocolError as e:
                    self.counters["bad_frames"] += 1
                    self._send(conn, Error(e.code, e.message, e.id, getattr(e, "retry_after", None)))
        except ConnectionClosed:
            pass
        finally:
            conn.open = False
            writer.cancel()
            self.connections.discard(conn)
            for id in conn.streams:
                stream = self.streams.get(id)
                if stream is None or stream.conn is not conn:
                    continue
                stream.conn, stream.unsent = None, 0
                if stream.final is None:
                    self.source.park(id)  # KV blocks back at once; resumable for the grace period
                    if stream.held:
                        stream.held = False
                        self.source.hold(id, False)
                    self._expire_later(stream)

    async def _handshake(self, ws: ServerConnection) -> bool:
        try:
            message = await asyncio.wait_for(ws.recv(), self.limits.hello_timeout_s)
            frame = parse_frame(message, self.limits.max_frame_bytes)
        except ProtocolError as e:
            if e.code == UNSUPPORTED_PROTOCOL:
                await ws.send(encode(Error(e.code, e.message)))
                await ws.close(1002, "unsupported protocol")
                return False
            frame = None
        except (asyncio.TimeoutError, ConnectionClosed):
            frame = None
        if not isinstance(frame, Hello) or not hmac.compare_digest(frame.token.encode("utf-8"), self.token):
            self.counters["auth_failures"] += 1
            await ws.close(AUTH_CLOSE_CODE, "unauthorized: send hello with the worker's token first")
            return False
        lim = self.limits
        await ws.send(encode(Welcome(self.source.model_name, {
            "max_tokens": lim.max_tokens, "max_prompt_tokens": lim.max_prompt_tokens,
            "max_streams_per_connection": lim.max_streams_per_connection,
            "max_streams_total": lim.max_streams_total, "max_frame_bytes": lim.max_frame_bytes,
            "resume_grace_s": lim.resume_grace_s, "source": self.source.kind},
            tokenizer=getattr(self.source, "tokenizer_fingerprint", ""))))
        return True

    def _handle(self, conn: Connection, frame) -> None:
        if isinstance(frame, Generate):
            self._generate(conn, frame)
        elif isinstance(frame, Cancel):
            stream = self.streams.get(frame.id)
            if stream is None or stream.conn is not conn:
                raise ProtocolError(UNKNOWN_STREAM, f"no stream {frame.id!r} on this connection", frame.id)
            if stream.final is None:
                self.source.cancel(frame.id)
        elif isinstance(frame, Resume):
            self._resume(conn, frame)
        elif isinstance(frame, Hello):
            raise ProtocolError(BAD_FRAME, "hello was already received on this connection")
        else:
            raise ProtocolError(BAD_FRAME, f"'{frame.type}' frames are sent by the server, not to it",
                                getattr(frame, "id", None))

    def _generate(self, conn: Connection, gen: Generate) -> None:
        lim = self.limits
        old = self.streams.get(gen.id)
        if old is not None and old.final is None:
            raise ProtocolError(INVALID_REQUEST, f"stream id {gen.id!r} is already in use", gen.id)
        if conn.active(self) >= lim.max_streams_per_connection:
            raise _busy(f"this connection already has {lim.max_streams_per_connection} streams in flight", gen.id,
                        lim.retry_after_s)
        if sum(1 for s in self.streams.values() if s.final is None) >= lim.max_streams_total:
            self.counters["busy"] += 1
            raise _busy(f"the worker is at its limit of {lim.max_streams_total} streams", gen.id, lim.retry_after_s)
        request = gen.to_request()  # raises INVALID_REQUEST naming the parameter
        if request.params.max_tokens > lim.max_tokens:
            raise ProtocolError(INVALID_REQUEST, f"max_tokens={request.params.max_tokens} is over this worker's "
                                                 f"limit of {lim.max_tokens}", gen.id)
        try:
            prompt_ids = self.source.prepare(request, lim.max_prompt_tokens)
        except ContextLengthError as e:
            raise ProtocolError(CONTEXT_LENGTH, e.message, gen.id) from None
        except InvalidRequestError as e:  # prefix_token_ids outside the vocabulary
            raise ProtocolError(INVALID_REQUEST, e.message, gen.id) from None
        if old is not None:  # a finished stream kept for resume: the id is reused
            if old.timer is not None:
                old.timer.cancel()
        stream = Stream(gen.id, conn, lim.replay_deltas)
        self.streams[gen.id] = stream
        conn.streams.add(gen.id)
        self.counters["requests"] += 1
        self.source.submit(gen.id, gen, request, prompt_ids)

    def _resume(self, conn: Connection, frame: Resume) -> None:
        stream = self.streams.get(frame.id)
        if stream is None:
            raise ProtocolError(UNKNOWN_STREAM, f"stream {frame.id!r} is not held by this worker (unknown, or "
                                                f"its {self.limits.resume_grace_s:g} s grace period passed)", frame.id)
        first = stream.replay[0].seq if stream.replay else 0
        if frame.after_seq + 1 < first:
            raise ProtocolError(UNKNOWN_STREAM, f"deltas {frame.after_seq + 1}..{first - 1} of {frame.id!r} are no "
                                                f"longer held (the replay buffer keeps {self.limits.replay_deltas})",
                                frame.id)
        if stream.conn is not None and stream.conn is not conn:
            stream.conn.streams.discard(frame.id)  # taken over: the old connection stops receiving it
        for delta in stream.replay:  # sent in one go, before any new event can interleave
            if delta.seq > frame.after_seq:
                self._send(conn, delta, stream)
        if stream.final is not None:
            self._send(conn, stream.final, stream)
        was_parked = stream.conn is None and stream.final is None
        stream.conn = conn
        conn.streams.add(frame.id)
        if was_parked:
            if stream.timer is not None:
                stream.timer.cancel()
            self.counters["resumes"] += 1
            self.source.unpark(frame.id)

    # --- HTTP on the same port -------------------------------------------------------------------
    def process_request(self, connection, request):
        path = request.path.split("?", 1)[0]
        if path == "/health":
            return connection.respond(http.HTTPStatus.OK, '{"status":"ok","model":"%s"}\n' % self.source.model_name)
        if path == "/metrics":
            resp = connection.respond(http.HTTPStatus.OK, render_metrics(self))
            resp.headers["Content-Type"] = "text/plain; version=0.0.4"
            return resp
        if request.headers.get("Upgrade", "").lower() != "websocket":
            return connection.respond(http.HTTPStatus.NOT_FOUND, "not found: WebSocket at /, GET /health, "
                                                                 "GET /metrics\n")
        return None


def _busy(message: str, id: str, retry_after: float) -> ProtocolError:
    e = ProtocolError(BUSY, message, id)
    e.retry_after = retry_after
    return e


async def serve_worker(worker: Worker, host: str = "127.0.0.1", port: int = 8765, ssl=None, ready=None,
                       stop: asyncio.Event | None = None) -> None:
    """Serve until `stop` is set (forever without one). `ready(port)` is called once listening."""
    limits = worker.limits
    async with serve(worker.handler, host, port, ssl=ssl, process_request=worker.process_request,
                     max_size=max(limits.max_frame_bytes * 4, 1 << 22), ping_interval=20, ping_timeout=20) as server:
        bound = server.sockets[0].getsockname()[1]
        if ready is not None:
            ready(bound)
        await (stop.wait() if stop is not None else asyncio.Future())
